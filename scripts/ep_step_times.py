"""Host time of each step of an nvshmem dispatch / combine call (world of 1, loopback), without a profiler.

    source scripts/gpu_env.sh $((12 << 30)); python3 scripts/ep_step_times.py [--tokens 8192] [--transport auto]

Wraps the backend's step methods with a host clock (no device sync added), runs the calls in both size modes
and prints, per step, the median host microseconds it took inside one call (steps that sync with the device
include the wait), the whole call's host time (call + device sync) and the GPU time between CUDA events
around the call.
"""
import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mxcomm.ep import EPConfig, EPGroup  # noqa: E402
from mxcomm.ep.nvshmem_backend import NvshmemBackend  # noqa: E402

STEPS = ("_checked_ids", "_run_middle", "_local_out", "_pack", "_exchange", "_plan", "_push_entries", "_send_to_experts", "_check",
         "_check_async", "_copy_out", "_pull_out", "_grouped_scales")
_times: dict = {}


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _times.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
    return wrapper


def _measure(label, fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    _times.clear()
    walls, gpus = [], []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6)
        gpus.append(e0.elapsed_time(e1) * 1e3)
    print(f"=== {label}: call {statistics.median(walls):.0f} us host wall (call + sync), "
          f"{statistics.median(gpus):.0f} us between CUDA events")
    accounted = 0.0
    for name, ts in _times.items():
        per_call = sum(ts) / iters
        accounted += per_call
        print(f"  {name:18s} {per_call:8.1f} us per call ({len(ts) // iters} x)")
    print(f"  {'(rest)':18s} {statistics.median(walls) - accounted:8.1f} us (validation, results, launches between)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    for name in STEPS:
        if hasattr(NvshmemBackend, name):
            setattr(NvshmemBackend, name, _timed(name, getattr(NvshmemBackend, name)))
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    T, H, E, k = a.tokens, 7168, 256, 8
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, device="cuda")
    for exact in (True, False):
        grp = EPGroup(EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T, backend="nvshmem",
                               exact_sizes=exact, transport=a.transport))
        res, h = grp.dispatch(x, idx, w)
        out = torch.randn(res.num_rows, H, device="cuda").to(torch.bfloat16)
        _measure(f"dispatch exact_sizes={exact}", lambda g=grp: g.dispatch(x, idx, w), a.iters)
        _measure(f"combine exact_sizes={exact}", lambda g=grp, o=out, hh=h: g.combine(o, hh), a.iters)
        del grp, res, h, out  # the symmetric buffers stay allocated: size the heap for two groups
    from mxcomm import transport as tp

    tp.finalize()


if __name__ == "__main__":
    main()
