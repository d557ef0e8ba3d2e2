"""Copy ceilings measured in the same run as the benchmark (see BENCH.md "Ceilings").

* device copy (GPU): ``dst.copy_(src)`` of a large buffer on one GPU; read + write bytes counted.
* shared device copy (several ranks on one GPU, e.g. under MPS): every rank on rank 0's GPU copies its share of the
  buffer at the same time; their bytes over the slowest rank's time. This is the GPU's memory bandwidth as the ranks
  sharing it can reach it together. Under MPS one rank alone gets only its share of the SMs, and its
  ``device_copy`` can then be far below what the GPU's memory moves (about half on an H200 with 4 ranks).
* peer copy (2+ GPUs with peer access): ``dst_on_gpu_b.copy_(src_on_gpu_a)``; bytes counted once
  (what crosses the link).
* all-pairs copy (2+ GPUs): every GPU copies to every other GPU at the same time (one stream per
  pair); reported per GPU as bytes sent (and received) per second, the ceiling of an all-to-all.
* host copy (CPU runs): ``dst.copy_(src)`` in host memory; read + write counted.

Times are CUDA-event medians (GPU) or perf_counter medians (CPU) over ``iters`` copies after warm-up.
"""
from __future__ import annotations

import statistics
import time

import torch


def event_median_ms(fn, iters: int, device: torch.device) -> float:
    """Median CUDA-event time (ms) of ``fn()`` over ``iters`` runs after 3 warm-up runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize(device)
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def device_copy(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> dict:
    """Device-to-device copy ceiling on ``device`` (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda: dst.copy_(src), iters, device)
    del src, dst
    return dict(kind="device_copy", device=str(device), bytes_copied=nbytes, bytes_counted=2 * nbytes,
                median_us=ms * 1e3, gbps=2 * nbytes / (ms * 1e-3) / 1e9,
                convention="read + write bytes of dst.copy_(src) on one GPU; CUDA-event median")


def shared_device_copy(world, nbytes: int = 1 << 30, iters: int = 20) -> dict | None:
    """Collective (every rank calls it): the ranks on rank 0's GPU (``world.devices`` equal to rank 0's) each copy
    ``nbytes / n`` bytes ``iters`` times back to back, all starting after one barrier; the time of a rank is CUDA
    events around its whole loop. Returns (on every rank) ``gbps`` = all the ranks' read + write bytes / the slowest
    rank's time, or None when rank 0's GPU has one rank."""
    mine = [r for r, d in enumerate(world.devices) if d == world.devices[0]]
    n = len(mine)
    if n < 2:
        return None
    us = None
    if world.rank in mine:
        src = torch.empty(nbytes // n // 2, dtype=torch.bfloat16, device=world.device).normal_()
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(world.device)
    world.barrier()
    if world.rank in mine:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            dst.copy_(src)
        e.record()
        torch.cuda.synchronize(world.device)
        us = s.elapsed_time(e) * 1e3
        del src, dst
    times = [t for t in world.all_gather_object(us) if t is not None]
    per_rank = 2 * (nbytes // n // 2) * 2  # read + write bytes of one copy
    slowest = max(times)
    return dict(kind="shared_device_copy", device=world.devices[0], ranks=n, bytes_counted=n * per_rank * iters,
                us_per_copy=slowest / iters, gbps=n * per_rank * iters / (slowest * 1e-6) / 1e9,
                rank_us=times, convention=f"{n} ranks on one GPU copy at once ({iters} copies of 1/{n} of "
                f"{nbytes >> 20} MiB each, one barrier before): read + write bytes of all / the slowest rank's time")


def peer_copy(src_dev: int, dst_dev: int, nbytes: int = 1 << 29, iters: int = 20) -> dict:
    """Copy from GPU ``src_dev`` to GPU ``dst_dev`` (bytes counted once), timed on the source device."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{src_dev}").normal_()
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{dst_dev}")
    with torch.cuda.device(src_dev):
        ms = event_median_ms(lambda: dst.copy_(src), iters, torch.device("cuda", src_dev))
    torch.cuda.synchronize(dst_dev)
    del src, dst
    return dict(kind="peer_copy", src=f"cuda:{src_dev}", dst=f"cuda:{dst_dev}", bytes_counted=nbytes,
                median_us=ms * 1e3, gbps=nbytes / (ms * 1e-3) / 1e9,
                peer_access=bool(torch.cuda.can_device_access_peer(src_dev, dst_dev)),
                convention="bytes moved once between two GPUs; CUDA-event median on the source device")


def all_pairs_copy(devs: list[int], nbytes: int = 1 << 28, iters: int = 10) -> dict:
    """Every GPU in ``devs`` copies ``nbytes`` to every other one simultaneously (one stream per ordered
    pair, on the source device). Wall time of the whole exchange (host clock around launch + sync of
    every device), median over ``iters``; ``gbps_per_gpu`` = bytes each GPU sends / time."""
    n = len(devs)
    pairs = [(a, b) for a in devs for b in devs if a != b]
    src = {a: torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{a}").normal_() for a in devs}
    dst = {(a, b): torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{b}") for a, b in pairs}
    streams = {(a, b): torch.cuda.Stream(device=a) for a, b in pairs}

    def once():
        for a, b in pairs:
            with torch.cuda.stream(streams[(a, b)]):
                dst[(a, b)].copy_(src[a], non_blocking=True)
        for d in devs:
            torch.cuda.synchronize(d)

    for _ in range(3):
        once()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    del src, dst
    sent = (n - 1) * nbytes
    return dict(kind="all_pairs_copy", devices=[f"cuda:{d}" for d in devs], bytes_per_pair=nbytes,
                bytes_sent_per_gpu=sent, median_us=s * 1e6, gbps_per_gpu=sent / s / 1e9,
                gbps=sent / s / 1e9, gbps_total=n * sent / s / 1e9,
                convention="each GPU copies to every other at once; bytes each GPU sends / wall time "
                           "(host clock around launch and sync of all devices)")


def host_copy(nbytes: int = 64 << 20, iters: int = 10) -> dict:
    """Host memory copy (read + write counted): the CPU runs' ceiling."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return dict(kind="host_copy", device="cpu", bytes_copied=nbytes, bytes_counted=2 * nbytes, median_us=s * 1e6,
                gbps=2 * nbytes / s / 1e9, convention="read + write bytes of dst.copy_(src) in host memory; "
                "perf_counter median, torch threads of this process")


def measure_ceilings(world) -> dict:
    """Rank 0 measures (others wait at a barrier, so a shared GPU is idle); then, with several ranks on one GPU, the
    ranks on rank 0's GPU measure ``shared_device_copy`` together. Returns the dict on every rank."""
    out: dict = {}
    if world.rank == 0:
        try:
            if world.device.type == "cuda":
                out["device_copy"] = device_copy(world.device)
                n = torch.cuda.device_count()
                host0 = world.devices[0].split(":cuda:")[0]
                used = sorted({int(d.rsplit(":", 1)[1]) for d in world.devices if d.startswith(host0 + ":cuda:")})
                if len(used) >= 2 and n >= 2:
                    out["peer_copy"] = peer_copy(used[0], used[1])
                else:
                    out["peer_copy"] = None
                    out["peer_copy_skipped"] = "the ranks use one GPU: no link between GPUs in this run"
                if len(used) >= 2 and n >= 2:
                    out["all_pairs_copy"] = all_pairs_copy(used)
                else:
                    out["all_pairs_copy"] = None
                    out["all_pairs_copy_skipped"] = "the ranks use one GPU: no link between GPUs in this run"
            else:
                out["host_copy"] = host_copy()
        except Exception as e:  # noqa: BLE001 - a ceiling must not stop the benchmark
            out["error"] = f"{type(e).__name__}: {e}"
    got = world.all_gather_object(out)[0]
    if world.device.type == "cuda" and world.ranks_per_gpu > 1:
        try:
            shared = shared_device_copy(world)
        except Exception as e:  # noqa: BLE001 - a ceiling must not stop the benchmark
            shared, got = None, {**got, "shared_error": f"{type(e).__name__}: {e}"}
        if shared is not None:
            got = {**got, "shared_device_copy": shared}
    if world.device.type == "cuda":
        torch.cuda.empty_cache()  # give the ceiling buffers back before the benchmark allocates
    return got


__all__ = ["device_copy", "shared_device_copy", "peer_copy", "all_pairs_copy", "host_copy", "measure_ceilings"]
