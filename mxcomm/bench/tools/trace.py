"""Where the host time of one eager EP call goes (exact output sizes), on a GPU: world of 1 (loopback), or several
ranks started by torchrun (one per GPU, round robin over the GPUs there are; rank 0 reports).

    source bench/gpu/env.sh $((12 << 30)); python3 -m mxcomm.bench.tools.trace [--ops dispatch,combine] [--out DIR]
    source bench/gpu/env.sh $((12 << 30)); torchrun --nproc-per-node 2 -m mxcomm.bench.tools.trace --no-cprofile

Per op (dispatch, combine, combine_bwd, dispatch_bwd; the calls of ``mxcomm bench``'s cases):

1. whole call: median host wall time (device synchronised before and after, as ``mxcomm bench`` times it);
2. timeline of one call under ``torch.profiler`` (no Python tracer): every CUDA runtime/driver call on the host
   (launches, syncs, copies) and every kernel on the GPU, in µs from the call's start - the host's gaps between
   launches are Python work, and the GPU idles where no kernel runs;
3. ``cProfile`` of 200 calls, sorted by cumulative time, in µs per call (the Python functions behind those gaps);
4. with ``--conditions``: the whole call again after an L2 flush, after 2 ms of host sleep, after both (what
   ``mxcomm bench`` does before each timed call: flush, sync, barrier).

``--out DIR`` also writes each op's Chrome trace (gzip).
"""
import argparse
import cProfile
import gzip
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from mxcomm.bench.timing import L2Flusher
from mxcomm.ep import EPConfig, EPGroup


def _calls(grp, T, H, E, k):
    """The four timed calls, built like mxcomm.bench.cases (untimed setup here)."""
    g = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, device="cuda", generator=g)
    res = grp.dispatch(x, idx, w)
    h = res.handle
    out = torch.randn(res.num_rows, H, device="cuda", generator=g).to(torch.bfloat16)
    _, saved = grp.steps.combine_for_backward(out, h)
    gy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    return {
        "dispatch": lambda: grp.dispatch(x, idx, w),
        "combine": lambda: grp.combine(out, h),
        "combine_bwd": lambda: grp.steps.combine_backward(gy, h, saved),
        "dispatch_bwd": lambda: grp.steps.dispatch_backward(out, h),
    }


def _sync():
    """Device idle and (several ranks) every rank here: what `mxcomm bench` does before each timed call."""
    torch.cuda.synchronize()
    if dist.get_world_size() > 1:
        dist.barrier()


def _print(*args, **kw):
    if dist.get_rank() == 0:
        print(*args, **kw)


def _wall(fn, iters=30, before=None):
    ts = []
    for _ in range(iters):
        if before is not None:
            before()
        _sync()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts), sorted(ts)[len(ts) // 10], sorted(ts)[(9 * len(ts)) // 10]


def _timeline(name, fn, out_dir):
    from torch.profiler import ProfilerActivity, profile, record_function

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            _sync()
            with record_function(f"call{i}"):
                fn()
            torch.cuda.synchronize()
    if dist.get_rank():
        return
    path = os.path.join(out_dir or tempfile.mkdtemp(), f"trace_{name}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if out_dir:
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
    os.remove(path)
    call = [e for e in events if e["name"] == "call2" and e.get("cat") == "user_annotation"]
    if not call:
        print("  (no call marker in the trace)")
        return
    t0, t1 = call[0]["ts"], call[0]["ts"] + call[0]["dur"]
    rows = []
    for e in events:
        cat, s = e.get("cat"), e["ts"]
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= s <= t1 + 2000:
            rows.append((s - t0, e["dur"], "GPU", e["name"]))
        elif cat in ("cuda_runtime", "cuda_driver") and t0 <= s <= t1:
            rows.append((s - t0, e["dur"], "host", e["name"]))
    print(f"  timeline of one call under the profiler (host span {t1 - t0:.0f} us; µs from its start, duration):")
    for s, d, where, n in sorted(rows):
        print(f"    {s:8.1f} {d:7.1f}  {where:4s} {n[:90]}")


def profile_rows(stats: pstats.Stats, calls: int, lines: int = 40) -> list[str]:
    """The ``lines`` functions of ``stats`` with the most cumulative time, as text rows in µs per profiled call
    (``calls`` calls of the op): cumulative time, own time, how many times each ran per call, and where it is
    (``file:line(function)``, paths shortened to their package part). pstats' own table prints seconds with three
    decimals, which rounds away what one call of a few hundred µs spends in most functions."""
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        short = path
        for mark in ("/mxcomm/", "/torch/", "/triton/"):
            if mark in path:
                short = path[path.rindex(mark) + 1:]
                break
        rows.append((cumtime, tottime, ncalls, f"{short}:{line}({func})"))
    rows.sort(key=lambda r: -r[0])
    out = [f"    {'cum us/call':>11s} {'own us/call':>11s} {'runs/call':>9s}  function"]
    for cum, own, ncalls, where in rows[:lines]:
        out.append(f"    {cum * 1e6 / calls:11.1f} {own * 1e6 / calls:11.1f} {ncalls / calls:9.2f}  {where[:100]}")
    return out


def _cprofile(fn, n=200, lines=40):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
        _sync()
    pr.disable()
    if dist.get_rank():
        return
    print(f"  cProfile of {n} calls (µs per call; the profiler adds its own cost to every Python call):")
    print("\n".join(profile_rows(pstats.Stats(pr), n, lines)), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ops", default="dispatch,combine,combine_bwd,dispatch_bwd")
    ap.add_argument("--out", default="")
    ap.add_argument("--no-cprofile", action="store_true")
    ap.add_argument("--no-timeline", action="store_true")
    ap.add_argument("--conditions", action="store_true",
                    help="also time each call after an L2 flush, after a host sleep, after both")
    a = ap.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun
        dist.init_process_group("gloo", init_method="env://")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    T, H, E, k = a.tokens, 7168, 256, 8
    grp = EPGroup(EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T, backend="nvshmem"))
    calls = _calls(grp, T, H, E, k)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    for name in a.ops.split(","):
        fn = calls[name]
        for _ in range(5):
            fn()
        med, p10, p90 = _wall(fn)
        _print(f"=== {name}: whole call {med:.1f} us (p10 {p10:.1f}, p90 {p90:.1f}), path {grp.path}, "
               f"{dist.get_world_size()} rank(s) on {torch.cuda.device_count()} GPU(s)", flush=True)
        if a.conditions:  # the same call after what `mxcomm bench` does before each timed call
            flush = L2Flusher(torch.device("cuda"))
            for label, before in (("after an L2 flush", flush), ("after 2 ms of host sleep", lambda: time.sleep(2e-3)),
                                  ("after both", lambda: (flush(), time.sleep(2e-3)))):
                med, p10, p90 = _wall(fn, before=before)
                _print(f"    {label:26s} {med:8.1f} us (p10 {p10:.1f}, p90 {p90:.1f})", flush=True)
        if not a.no_timeline:
            _timeline(name, fn, a.out)
        if not a.no_cprofile:
            _cprofile(fn)
    from mxcomm import transport as tp

    tp.finalize()


if __name__ == "__main__":
    main()
