"""Kernel-by-kernel GPU time of one loopback dispatch and one combine, each captured in a CUDA graph (world of 1,
no-host-sync mode, as ``mxcomm bench --cuda-graph`` times them), from torch.profiler over graph replays.

    source bench/gpu/env.sh 0 && python3 -m mxcomm.bench.tools.graph_profile [--tokens 8192] [--precision mxfp8]

Prints, per op: the CUDA-event time of a replay (median), and each kernel's mean GPU time per call, their sum and the
remainder (launch gaps between the graph's nodes). Writes the same as JSON with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import torch.distributed as dist

from mxcomm.bench.routing import make_inputs
from mxcomm.ep import EPConfig, EPGroup


def _graph(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _event_us(g, iters: int) -> float:
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def _kernels(g, reps: int) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        r = rows.setdefault(ev.name, [0, 0.0])
        r[0] += 1
        r[1] += ev.time_range.elapsed_us()
    out = [dict(name=n[:90], calls_per_op=c / reps, us_per_op=t / reps) for n, (c, t) in rows.items()]
    return sorted(out, key=lambda r: -r["us_per_op"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--precision", default="mxfp8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    store = tempfile.mktemp(prefix="mxcomm_prof_store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    inp = make_inputs(seed=1, rank=0, tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                      experts=args.experts, device=torch.device("cuda"))
    grp = EPGroup(EPConfig(num_experts=args.experts, hidden=args.hidden, topk=args.topk,
                           max_tokens_per_rank=args.tokens, precision=args.precision, backend="nvshmem",
                           exact_sizes=False))
    cur = {}

    def disp():
        cur["res"] = grp.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        cur["h"] = cur["res"].handle

    disp()
    expert_out = torch.randn(cur["res"].num_rows, args.hidden, device="cuda").to(torch.bfloat16)

    def comb():
        grp.combine(expert_out, cur["h"])

    report = dict(config=vars(args), device=torch.cuda.get_device_name(), torch=torch.__version__, ops={})
    for name, fn in (("dispatch", disp), ("combine", comb)):
        g = _graph(fn)
        ev = _event_us(g, 30)
        ks = _kernels(g, args.reps)
        total = sum(k["us_per_op"] for k in ks)
        report["ops"][name] = dict(event_us=ev, kernel_sum_us=total, kernels=ks)
        print(f"--- {name} ({args.precision}, T={args.tokens}): replay {ev:.1f} us (CUDA events), kernels {total:.1f} us, "
              f"gaps {ev - total:.1f} us")
        for k in ks:
            print(f"  {k['us_per_op']:8.1f} us  x{k['calls_per_op']:.0f}  {k['name']}")
    grp.check_errors()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    from mxcomm import transport as tp

    tp.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
