"""Communication / compute overlap through the ``stream=`` API: an MXFP8 combine on a communication stream while a
BF16 grouped GEMM of another layer runs on the current stream (EP = 1: one process, one GPU, nvshmem backend).

    source bench/gpu/env.sh
    python bench/bench_overlap.py --out bench/results/h200/overlap_ep1.json
    python bench/bench_overlap.py --tokens 8192 --hidden 7168 --topk 8 --experts 256 --num-sms 24 \\
        --gemm-rows 16384 --gemm-experts 32 --gemm-n 2048 --iters 50 --warmup 10 --out overlap.json
    python bench/bench_overlap.py --device cpu --smoke --out /tmp/overlap.json   # CPU: reference backend, no streams

The combine: ``EPGroup.combine(expert_out, handle)`` of one dispatch of ``--tokens`` tokens (top-``--topk`` of
``--experts`` experts, all local), its kernels sized for ``--num-sms`` SMs (``EPConfig.num_sms``, default 24: the
grids are ``per_sm * num_sms`` programs, which leaves most of the GPU to the GEMM; the hardware still places them on
any SM). The GEMM ("another layer"): ``torch._grouped_mm`` BF16 ``[rows, H] x [G, H, N]`` with ``G`` equal groups
(``--gemm-experts``) of ``--gemm-rows / G`` rows (on the CPU: mxcomm.gemm's BF16 grouped GEMM).

Timed cases (CUDA events on the current stream; median over ``--iters`` rounds after ``--warmup``, the cases
interleaved in every round; each sample starts behind a sleep kernel of ``--host-lead-us`` so that the host has
issued the whole case before the GPU starts it - host launch time is not measured, only the GPU's):

* ``gemm``: the GEMM alone;
* ``combine``: the combine alone, on the current stream (``stream=None``);
* ``combine_on_stream``: the combine alone on the communication stream, the current stream waiting for its event;
* ``serial``: combine then GEMM on the current stream;
* ``overlapped``: ``c = group.combine(..., stream=comm)``, then the GEMM on the current stream, then ``c.wait()``:
  from the start event to both done.

Ratios: ``sum_us = gemm + combine``; ``speedup = serial / overlapped``; ``overlap_ratio = (serial - overlapped) /
min(gemm, combine)`` (the share of the shorter op hidden: 0 = none, 1 = fully hidden). Checks: the combine output
and the GEMM output of the overlapped case are ``torch.equal`` to those of the serial case (and of the ops alone);
the script exits 1 when one differs. Writes a JSON (machine, versions, NVSHMEM/NCCL environment, config, samples,
medians, ratios, checks) to ``--out``.

NVSHMEM environment: ``source bench/gpu/env.sh`` exports it (NVLink multicast off, single node, a heap size). The
script sets any of ``mxcomm.transport.launcher_env(EPGroup.buffer_bytes(config, 1))`` that is missing, and raises
``NVSHMEM_SYMMETRIC_SIZE`` when the exported heap is smaller than that (it must be set before NVSHMEM starts: this
process starts it when it builds the group).

``--device cpu --smoke``: the same code on the reference backend at tiny sizes, without streams (``stream=None``:
``combine_on_stream`` and ``overlapped`` then run on the current stream), timed with ``perf_counter``: only checks
that the script runs and reports.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

SMOKE = dict(tokens=32, hidden=64, topk=2, experts=8, gemm_rows=64, gemm_experts=4, gemm_n=32, iters=3, warmup=1)
FULL = dict(tokens=8192, hidden=7168, topk=8, experts=256, gemm_rows=16384, gemm_experts=32, gemm_n=2048, iters=50,
            warmup=10)
CASES = ("gemm", "combine", "combine_on_stream", "serial", "overlapped")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU smoke test)")
    for name in FULL:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                        help=f"default {FULL[name]} (smoke: {SMOKE[name]})")
    ap.add_argument("--precision", default="mxfp8", choices=("mxfp8", "bf16"))
    ap.add_argument("--num-sms", type=int, default=24, help="EPConfig.num_sms of the combine (GPU)")
    ap.add_argument("--no-host-sync", action="store_true", help="EPConfig(exact_sizes=False)")
    ap.add_argument("--host-lead-us", type=float, default=2000.0,
                    help="sleep kernel before each sample (GPU), so that the host issues the case ahead of the GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                         / "mxcomm" / "bench" / "overlap.json"))
    a = ap.parse_args(argv)
    base = SMOKE if a.smoke else FULL
    for name, v in base.items():
        if getattr(a, name) is None:
            setattr(a, name, v)
    if a.gemm_rows % a.gemm_experts:
        ap.error(f"--gemm-rows ({a.gemm_rows}) must be a multiple of --gemm-experts ({a.gemm_experts})")
    return a


def nvshmem_environment(nbytes: int) -> dict:
    """Set what NVSHMEM needs for ``nbytes`` of symmetric buffers where the environment lacks it (before NVSHMEM
    starts); returns the variables this process changed."""
    from mxcomm.transport.env import launcher_env, parse_size

    changed = {}
    for k, v in launcher_env(nbytes).items():
        have = os.environ.get(k)
        if k == "NVSHMEM_SYMMETRIC_SIZE" and have is not None and parse_size(have) >= parse_size(v):
            continue
        if k != "NVSHMEM_SYMMETRIC_SIZE" and have is not None:
            continue  # check_env refuses a wrong multicast setting when NVSHMEM starts: not overridden here
        os.environ[k] = changed[k] = v
    return changed


def make_timer(gpu: bool, lead_us: float):
    """``timer(fn) -> µs``: CUDA events around ``fn`` on the current stream behind a sleep of ``lead_us`` (GPU), or
    ``perf_counter`` (CPU)."""
    if not gpu:
        def run(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        return run
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 1_000_000
    torch.cuda.synchronize()
    s.record()
    torch.cuda._sleep(probe)
    e.record()
    e.synchronize()
    cycles = int(lead_us * probe / max(s.elapsed_time(e) * 1e3, 1e-3)) if lead_us > 0 else 0

    def run(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if cycles:
            torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) * 1e3
        torch.cuda.synchronize()  # nothing of this sample left on any stream
        return us
    return run


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    if gpu and dev.index is None:
        dev = torch.device("cuda", 0)
    from mxcomm.ep import EPConfig, EPGroup

    cfg = EPConfig(num_experts=a.experts, hidden=a.hidden, topk=a.topk, max_tokens_per_rank=a.tokens,
                   precision=a.precision, backend="nvshmem" if gpu else "torch", num_sms=a.num_sms if gpu else None,
                   exact_sizes=not a.no_host_sync)
    env_set = nvshmem_environment(EPGroup.buffer_bytes(cfg, 1)) if gpu else {}
    if env_set:
        print(f"set for NVSHMEM: {env_set}", flush=True)
    if gpu:
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = EPGroup(cfg)
    comm = torch.cuda.Stream(device=dev) if gpu else None

    g = torch.Generator(device=dev).manual_seed(a.seed)
    T, H, k, E = a.tokens, a.hidden, a.topk, a.experts
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, generator=g, device=dev), dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, generator=g, device=dev)
    M, G, N = a.gemm_rows, a.gemm_experts, a.gemm_n
    ga = torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16)
    gb = (torch.randn(G, H, N, generator=g, device=dev) / H ** 0.5).to(torch.bfloat16)  # [G, K, N]
    goffs = torch.arange(1, G + 1, dtype=torch.int32, device=dev) * (M // G)
    if gpu:
        def gemm():
            return torch._grouped_mm(ga, gb, offs=goffs)
    else:
        from mxcomm.gemm.grouped import bf16_grouped_2d3d

        def gemm():
            return bf16_grouped_2d3d(ga, gb, goffs)

    with torch.no_grad():
        d = group.dispatch(x, idx, w)
        handle = d.handle
        expert_out = torch.randn(d.num_rows, H, generator=g, device=dev).to(torch.bfloat16)

        def combine_on(stream):
            """Issue the combine; returns what makes the current stream wait for it and gives its output."""
            if stream is None:
                y = group.combine(expert_out, handle)
                return lambda: y
            return group.combine(expert_out, handle, stream=stream).wait

        outs = {}

        def f_gemm():
            outs["gemm"] = {"g": gemm()}

        def f_combine():
            outs["combine"] = {"y": combine_on(None)()}

        def f_combine_on_stream():
            outs["combine_on_stream"] = {"y": combine_on(comm)()}

        def f_serial():
            y = combine_on(None)()
            outs["serial"] = {"y": y, "g": gemm()}

        def f_overlapped():
            done = combine_on(comm)  # first: the communication stream waits for the current one as it is now
            gm = gemm()  # then the independent compute, on the current stream
            outs["overlapped"] = {"y": done(), "g": gm}

        fns = dict(zip(CASES, (f_gemm, f_combine, f_combine_on_stream, f_serial, f_overlapped)))
        timer = make_timer(gpu, a.host_lead_us)
        for _ in range(a.warmup):
            for fn in fns.values():
                timer(fn)
        samples = {c: [] for c in CASES}
        for _ in range(a.iters):
            for c, fn in fns.items():
                samples[c].append(timer(fn))

    med = {c: statistics.median(v) for c, v in samples.items()}
    shorter = min(med["gemm"], med["combine"])
    ratios = {
        "sum_us": med["gemm"] + med["combine"],
        "speedup": med["serial"] / med["overlapped"],
        "overlap_ratio": (med["serial"] - med["overlapped"]) / shorter if shorter > 0 else None,
        "overlapped_vs_longer_op": med["overlapped"] / max(med["gemm"], med["combine"]),
        "serial_vs_sum": med["serial"] / (med["gemm"] + med["combine"]),
    }

    def same(a_, b_):
        return bool(a_.shape == b_.shape and torch.equal(a_, b_))

    checks = {
        "combine_overlapped_equals_serial": same(outs["overlapped"]["y"], outs["serial"]["y"]),
        "gemm_overlapped_equals_serial": same(outs["overlapped"]["g"], outs["serial"]["g"]),
        "combine_on_stream_equals_combine": same(outs["combine_on_stream"]["y"], outs["combine"]["y"]),
        "serial_equals_ops_alone": same(outs["serial"]["y"], outs["combine"]["y"])
        and same(outs["serial"]["g"], outs["gemm"]["g"]),
    }
    from mxcomm.bench import env_info

    report = dict(
        benchmark="overlap", timestamp=datetime.datetime.now().isoformat(timespec="seconds"), device=str(dev),
        streams=gpu, machine=env_info.machine(), versions=env_info.versions(), env=env_info.relevant_env(),
        env_set_by_script=env_set,
        config=dict(tokens=T, hidden=H, topk=k, experts=E, ep=1, precision=a.precision, backend=cfg.backend,
                    path=group.path, num_sms=cfg.num_sms, exact_sizes=cfg.exact_sizes, num_rows=d.num_rows,
                    gemm=dict(rows=M, groups=G, k=H, n=N, dtype="bfloat16",
                              op="torch._grouped_mm" if gpu else "mxcomm.gemm.grouped.bf16_grouped_2d3d"),
                    iters=a.iters, warmup=a.warmup, host_lead_us=a.host_lead_us if gpu else None, seed=a.seed),
        timing=("CUDA events on the current stream behind a host-lead sleep kernel; median over rounds, cases "
                "interleaved" if gpu else "perf_counter around each case (CPU, no streams); median"),
        ratios_doc=("speedup = serial / overlapped; overlap_ratio = (serial - overlapped) / min(gemm, combine); "
                    "sum_us = gemm + combine (ops alone)"),
        medians_us=med, samples_us=samples, ratios=ratios, checks=checks,
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for c in CASES:
        print(f"{c:18s} {med[c]:12.1f} us", flush=True)
    print(f"sum {ratios['sum_us']:.1f} us, speedup {ratios['speedup']:.3f}, overlap ratio "
          f"{ratios['overlap_ratio'] if ratios['overlap_ratio'] is None else round(ratios['overlap_ratio'], 3)}")
    print(f"checks: {checks}")
    print(f"JSON: {out}")
    if gpu:
        torch.cuda.synchronize()
        from mxcomm import transport as tp

        tp.finalize()
    dist.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
