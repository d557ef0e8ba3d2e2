"""Launch-parameter sweep and kernel profile of the nvshmem EP backend across the local GPUs.

    source bench/gpu/env.sh && torchrun --nproc-per-node 2 -m mxcomm.bench.tools.sweep [--tokens 4096] [--profile]
    (several ranks on one GPU: start MPS first, ``mxcomm_mps_start 4`` of bench/gpu/env.sh)

One EPGroup per precision (nvshmem backend, exact sizes; no-sync with --graph); for every routing-plan implementation
and every combination of the backend's frozen :class:`~mxcomm.ep.nvshmem.launch_config.LaunchConfig` fields given with
``--set`` (e.g. ``--set partials_per_sm=8,16 --set reduce_warps=4,8``; replaced on the backend instance between
measurements, identical on every rank) it times dispatch, combine, combine backward and dispatch backward with CUDA
events and as whole calls on the host clock (``us`` / ``whole_us``: medians of --iters, the slowest rank; a field given
the same values twice, ``--set f=0,1,0,1``, alternates them), and with --profile prints rank 0's kernel-time table of
five calls of each op (each started after a barrier). With --graph every op runs in the no-sync mode as a CUDA-graph
replay (captured once per launch setting, after eager warm-up calls), as ``mxcomm bench --cuda-graph`` times it; the
profile then shows the replays' kernels (no host work between them: what is not kernel time is waiting on the device).
Output: text on rank 0 and a JSON line per measurement (prefix ``SWEEP``). Needs the environment of ``bench/gpu/env.sh``
(nvshmem4py, multicast off, NVSHMEM_SYMMETRIC_SIZE).
"""
import argparse
from dataclasses import replace
import itertools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from mxcomm.ep import EPConfig, EPGroup


def _inputs(T, H, E, k, rank, dev):
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32).to(dev)
    w = torch.rand(T, k, generator=g).to(dev)
    return x, idx, w


def _ops(group, x, idx, w):
    res = group.dispatch(x, idx, w)
    h = res.handle
    out = torch.randn(res.num_rows, x.shape[1], device=x.device).to(torch.bfloat16)
    _, saved = group.steps.combine_for_backward(out, h)
    gy = torch.randn_like(x)
    return {
        "dispatch": lambda: group.dispatch(x, idx, w),
        "combine": lambda: group.combine(out, h),
        "combine_bwd": lambda: group.steps.combine_backward(gy, h, saved),
        "dispatch_bwd": lambda: group.steps.dispatch_backward(out, h),
    }


def _graphed(ops: dict) -> dict:
    """Each op captured into a CUDA graph as ``mxcomm bench --cuda-graph`` captures it (2 warm-up calls on a side
    stream first, every rank in step): its replay."""
    from types import SimpleNamespace

    from mxcomm.bench.harness import capture_graph

    world = SimpleNamespace(device=torch.device("cuda", torch.cuda.current_device()), barrier=dist.barrier)
    return {name: capture_graph(fn, world) for name, fn in ops.items()}


def _time(fn, iters) -> tuple:
    """``(events, whole)``: the medians over ``iters`` calls of ``fn`` (each after a barrier and a device sync) of its
    CUDA-event time and of its whole-call time (host clock, the device synchronised after the call), µs, each the
    slowest rank's median."""
    times, whole = [], []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        whole.append((time.perf_counter() - t0) * 1e6)
        times.append(s.elapsed_time(e) * 1e3)
    med = torch.tensor([statistics.median(times), statistics.median(whole)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # gloo: several ranks may share one GPU (under MPS)
    return float(med[0]), float(med[1])


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2",
                    help="LaunchConfig field and the integer values to try (repeatable; the grid is their product)")
    ap.add_argument("--precision", default="mxfp8,bf16")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--plan-impl", default="torch,triton", help="routing plan implementations to time (backend.plan_impl)")
    ap.add_argument("--ops", default="dispatch,combine,combine_bwd,dispatch_bwd")
    ap.add_argument("--graph", action="store_true", help="no-sync mode, every op timed (and profiled) as graph replays")
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    grid = [tuple(item.split("=", 1)) for item in a.set]
    x, idx, w = _inputs(a.tokens, a.hidden, a.experts, a.topk, rank, "cuda")
    for prec in a.precision.split(","):
        group = EPGroup(EPConfig(num_experts=a.experts, hidden=a.hidden, topk=a.topk, max_tokens_per_rank=a.tokens,
                                 precision=prec, backend="nvshmem", exact_sizes=not a.graph))
        be = group.backend
        base = be.launch
        eager = {n: f for n, f in _ops(group, x, idx, w).items() if n in a.ops.split(",")}
        for fn in eager.values():  # compile every kernel variant once
            fn()
        ops = _graphed(eager) if a.graph else eager
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, fn in ops.items():
                fn()
                torch.cuda.synchronize()
                dist.barrier()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):  # every rank in step before each call (the table's "avg": per call)
                        dist.barrier()
                        fn()
                        torch.cuda.synchronize()
                if rank == 0:
                    print(f"--- profile {prec} {name} T={a.tokens}{' graph' if a.graph else ''} {be.launch}")
                    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12,
                                                    max_name_column_width=45), flush=True)
        for impl in a.plan_impl.split(","):
            for values in itertools.product(*(_ints(v) for _, v in grid)):
                fields = dict(zip((f for f, _ in grid), values))
                be.launch = replace(base, **fields)
                be.plan_impl = impl
                if a.graph:  # a replay keeps the launches it captured: capture again with this setting
                    ops = _graphed(eager)
                for fn in ops.values():
                    fn()
                res = {name: _time(fn, a.iters) for name, fn in ops.items()}
                if rank == 0:
                    print("SWEEP " + json.dumps(dict(precision=prec, tokens=a.tokens, launch=fields, plan_impl=impl,
                                                     world=dist.get_world_size(), graph=a.graph,
                                                     us={n: v[0] for n, v in res.items()},
                                                     whole_us={n: v[1] for n, v in res.items()})), flush=True)
    from mxcomm import transport as tp

    dist.barrier()
    tp.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
