"""Host-side cProfile of nvshmem dispatch/combine calls (world of 1): where the Python call spends its time.

    python3 scripts/ep_host_profile.py [--exact] [--tokens 8192]

Prints, for dispatch and combine, the functions with the most own time and the wall time per call
(host clock, the call followed by a device sync), for exact_sizes=True (--exact) or False.
"""
import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mxcomm.ep import EPConfig, EPGroup  # noqa: E402


def _profile(name, fn, n=10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
        torch.cuda.synchronize()
    pr.disable()
    print(f"=== {name}: {wall:.0f} us per call (host wall, call + sync, no profiler)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    T, H, E, k = a.tokens, 7168, 256, 8
    grp = EPGroup(EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T, backend="nvshmem",
                           exact_sizes=a.exact))
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, device="cuda"), dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, device="cuda")
    for _ in range(3):
        res, h = grp.dispatch(x, idx, w)
    out = torch.randn(res.num_rows, H, device="cuda").to(torch.bfloat16)
    grp.combine(out, h)
    _profile(f"dispatch exact_sizes={a.exact}", lambda: grp.dispatch(x, idx, w))
    _profile(f"combine exact_sizes={a.exact}", lambda: grp.combine(out, h))
    from mxcomm import transport as tp

    tp.finalize()


if __name__ == "__main__":
    main()
