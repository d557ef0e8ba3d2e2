"""Loopback dispatch/combine on ONE GPU (world of 1, every expert local): the nvshmem backend's kernels
against the device copy ceiling and against the reference backend, measured in the same run.

    python3 bench/bench_ep_loopback.py [--tokens 8192] [--hidden 7168] [--topk 8] [--experts 256]

Needs nvshmem4py and the NVSHMEM environment (source bench/gpu/env.sh). Writes
bench/results/ep_loopback_h200.json (+ .png). Byte accounting (stated in the JSON):

* dispatch: BF16 read once per token (T*H*2) + payload written once per selection
  (S*(H + H/32) MXFP8, S*2H BF16), S = valid (token, expert) selections.
* combine: expert rows read (S*2H) + transport rows written and read back by the reduce
  (2*S*(H + H/32) MXFP8, 2*S*2H BF16) + output written (T*2H).

Times: ``kernels`` = CUDA-event median of the call in the no-host-sync mode (exact_sizes=False: the
whole device pipeline of the call, no host sync inside); ``call`` = host wall time of the call in
exact-size mode (includes its host sync and Python). Both are medians after warm-up, on fresh random
inputs rotated over several sets.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))

from mxcomm.ep import EPConfig, EPGroup


def copy_ceiling_gbps(nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _event_median(lambda: dst.copy_(src), 20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _event_median(fn, iters: int, setup=None) -> float:
    times = []
    for i in range(iters + 3):
        if setup:
            setup(i)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def _wall_median(fn, iters: int, setup=None) -> float:
    times = []
    for i in range(iters + 3):
        if setup:
            setup(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_inputs(n_sets, T, H, E, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :k].to(torch.int32)
        w = torch.rand(T, k, device="cuda", generator=g)
        sets.append((x, idx, w))
    return sets


def bench_case(args, precision: str, backend: str, sets, iters: int) -> dict:
    T, H, E, k = args.tokens, args.hidden, args.experts, args.topk
    base = dict(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T, precision=precision, backend=backend,
                num_sms=args.num_sms)
    out = {"precision": precision, "backend": backend}
    S = sum(int((s[1] >= 0).sum()) for s in sets) // len(sets)
    row = H + H // 32 if precision == "mxfp8" else 2 * H
    out["selections"] = S
    out["dispatch_bytes"] = T * H * 2 + S * row
    out["combine_bytes"] = S * 2 * H + 2 * S * row + T * 2 * H
    for exact in ([False, True] if backend == "nvshmem" else [True]):
        grp = EPGroup(EPConfig(**base, exact_sizes=exact))
        cur = {}

        def setup(i):
            cur["in"] = sets[i % len(sets)]

        def disp():
            x, idx, w = cur["in"]
            cur["res"] = grp.dispatch(x, idx, w)
            cur["h"] = cur["res"].handle

        setup(0)
        disp()
        outs = [torch.randn(cur["res"].num_rows, H, device="cuda").to(torch.bfloat16) for _ in range(2)]

        def comb():
            grp.combine(outs[0][: cur["h"].num_rows], cur["h"])

        timer = _event_median if not exact else _wall_median
        key = "kernels" if not exact else "call"
        d_ms = timer(disp, iters, setup)
        disp()
        torch.cuda.synchronize()
        c_ms = timer(comb, iters)
        out[f"dispatch_{key}_us"] = d_ms * 1e3
        out[f"combine_{key}_us"] = c_ms * 1e3
        out[f"dispatch_{key}_gbps"] = out["dispatch_bytes"] / (d_ms * 1e-3) / 1e9
        out[f"combine_{key}_gbps"] = out["combine_bytes"] / (c_ms * 1e-3) / 1e9
        del grp
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--num-sms", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ep_loopback_h200.json"))
    ap.add_argument("--profile", action="store_true", help="print a kernel-time table of the nvshmem calls and exit")
    args = ap.parse_args()
    store = tempfile.mktemp(prefix="mxcomm_bench_store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    sets = make_inputs(3, args.tokens, args.hidden, args.experts, args.topk)
    if args.profile:
        return profile(args, sets)
    ceiling = copy_ceiling_gbps(1 << 30)
    cases = []
    for precision in ("mxfp8", "bf16"):
        for backend in ("nvshmem", "torch"):
            r = bench_case(args, precision, backend, sets, args.iters)
            print(json.dumps(r), flush=True)
            cases.append(r)
    for r in cases:
        ref = next(c for c in cases if c["precision"] == r["precision"] and c["backend"] == "torch")
        for op in ("dispatch", "combine"):
            for key in ("kernels", "call"):
                if f"{op}_{key}_gbps" in r:
                    r[f"{op}_{key}_vs_copy_ceiling"] = r[f"{op}_{key}_gbps"] / ceiling
            r[f"{op}_call_speedup_vs_reference"] = ref[f"{op}_call_us"] / r[f"{op}_call_us"]
    import triton

    try:
        from importlib.metadata import version as _v
        nvshmem_v = _v("nvshmem4py-cu13")
    except Exception:  # noqa: BLE001
        nvshmem_v = None
    result = {
        "benchmark": "ep_loopback", "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(), "gpus": 1, "ranks": 1},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "nvshmem4py": nvshmem_v},
        "config": {"tokens": args.tokens, "hidden": args.hidden, "topk": args.topk, "experts": args.experts,
                   "ep_size": 1, "num_sms": args.num_sms, "all_experts_local": True},
        "copy_ceiling_gbps": ceiling,
        "byte_accounting": __doc__.split("Byte accounting (stated in the JSON):")[1].split("Times:")[0].strip(),
        "timing": "kernels: CUDA events, no-host-sync mode; call: host wall time, exact-size mode; medians",
        "cases": cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\ncopy ceiling {ceiling:.0f} GB/s (read+write)")
    print(f"{'precision':9} {'backend':8} {'disp kern us':>12} {'disp GB/s':>9} {'%ceil':>6} {'disp call us':>12} "
          f"{'comb kern us':>12} {'comb GB/s':>9} {'comb call us':>12} {'x ref(call)':>11}")
    for r in cases:
        print(f"{r['precision']:9} {r['backend']:8} {r.get('dispatch_kernels_us', float('nan')):12.1f} "
              f"{r.get('dispatch_kernels_gbps', float('nan')):9.0f} {100 * r.get('dispatch_kernels_vs_copy_ceiling', float('nan')):6.1f} "
              f"{r['dispatch_call_us']:12.1f} {r.get('combine_kernels_us', float('nan')):12.1f} "
              f"{r.get('combine_kernels_gbps', float('nan')):9.0f} {r['combine_call_us']:12.1f} "
              f"{r['dispatch_call_speedup_vs_reference']:5.2f}/{r['combine_call_speedup_vs_reference']:.2f}")
    _plot(result, args.out.replace(".json", ".png"))
    from mxcomm import transport as tp

    tp.finalize()
    return 0


def profile(args, sets) -> int:
    """Kernel-time breakdown of nvshmem dispatch + combine (no-host-sync mode), torch.profiler."""
    from torch.profiler import ProfilerActivity, profile as tprof

    for precision in ("mxfp8", "bf16"):
        grp = EPGroup(EPConfig(num_experts=args.experts, hidden=args.hidden, topk=args.topk,
                               max_tokens_per_rank=args.tokens, precision=precision, backend="nvshmem",
                               num_sms=args.num_sms, exact_sizes=False))
        x, idx, w = sets[0]
        res = grp.dispatch(x, idx, w)
        h = res.handle
        out = torch.randn(res.num_rows, args.hidden, device="cuda").to(torch.bfloat16)
        grp.combine(out, h)
        torch.cuda.synchronize()
        with tprof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                res = grp.dispatch(x, idx, w)
                h = res.handle
                grp.combine(out, h)
            torch.cuda.synchronize()
        print(f"--- {precision}: 3 x (dispatch + combine)")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    from mxcomm import transport as tp

    tp.finalize()
    return 0


def _plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    cases = result["cases"]
    labels, vals = [], []
    for r in cases:
        for op in ("dispatch", "combine"):
            for key in ("kernels", "call"):
                v = r.get(f"{op}_{key}_gbps")
                if v is not None:
                    labels.append(f"{op}\n{r['precision']}\n{r['backend']}\n{key}")
                    vals.append(v)
    fig, ax = plt.subplots(figsize=(max(8, len(vals) * 0.8), 4.5))
    ax.bar(range(len(vals)), vals)
    ax.axhline(result["copy_ceiling_gbps"], color="r", ls="--", label="device copy ceiling")
    ax.set_xticks(range(len(vals)), labels, fontsize=7)
    ax.set_ylabel("GB/s (bytes as in JSON byte_accounting)")
    c = result["config"]
    ax.set_title(f"loopback EP on {result['machine']['gpu']}: {c['tokens']} tok x {c['hidden']}, top-{c['topk']}, "
                 f"{c['experts']} experts (1 rank)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
