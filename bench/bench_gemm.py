"""Grouped GEMM crossover benchmark: BF16 ``torch._grouped_mm`` against the MXFP8 paths of ``mxcomm.gemm``.

Usage (GPU):  python bench/bench_gemm.py [--out bench/results/gemm_h200.json]      (~1-3 minutes on an H200)
Usage (CPU):  python bench/bench_gemm.py --smoke     (TRITON_INTERPRET, tiny sizes: only checks that it runs)

HONESTY NOTE, also written into the JSON: Hopper (sm_90, the H200) has FP8 tensor cores but no block-scaled
(MX) MMA. On it every MXFP8 path here is an *emulation*: E4M3 payloads and E8M0 scales are dequantized to
BF16 (in a separate Triton kernel for ``dequant``, inside the GEMM's load path for ``triton``) and multiplied
on the BF16 tensor cores. The MX paths therefore cannot beat the BF16 GEMM on this GPU; what is measured is
the cost of emulation (and where it becomes negligible). The communication savings of MXFP8 (33/32 vs 2 bytes
per value) are real on Hopper; the GEMM speed-up needs sm_100 (``native`` backend), not measured here.

What is timed, for each projection K -> N (default 4096->4096, 4096->14336, 7168->2048, 1536->3072) and
each ``M`` = TOTAL rows over ``G`` (default 8) equal expert groups (M from 128 to 16384; rows per group M/G):

* ``bf16``: ``grouped_mm_bf16`` (BF16 activations x BF16 weights, ``torch._grouped_mm``), the baseline;
* ``mx_dequant``: prequantized MXFP8 activations (what an MXFP8 dispatch delivers, grouped_m scales) x cached
  MXFP8 weights, ``backend="dequant"`` (activation and weight dequantize charged per call);
* ``mx_dequant_bf16w``: the same with the cache's BF16 weight copy (``keep_bf16=True``; weight dequantize not
  charged; +4 bytes/weight of memory);
* ``mx_triton``: prequantized activations, ``backend="triton"`` (E4M3 decoded in the GEMM's load path);
* ``mx_dequant+q`` / ``mx_triton+q``: BF16 activations, the activation quantize (Triton, grouped_m) charged;
* components: ``quantize_a``, ``dequant_a``, ``dequant_w`` alone.
* wgrad (``dW_g = grad_y_g^T x_g``, fp32 ``[G, N, K]``) at the largest M: ``grouped_wgrad`` backends ``dequant``
  (BF16 ``torch._grouped_mm`` + fp32 cast) and ``triton`` (fp32 accumulator stored), with ``x`` BF16 or MXFP8
  (the forward's saved input; dequantized per call by ``dequant``, in the load path by ``triton``).

Time: ``triton.testing.do_bench`` median of CUDA-event-timed Python calls (whole call: validation, output
allocation and all kernels), L2 flushed by do_bench before each call. TFLOP/s = 2*M*N*K / time. Each (projection,
M) is also checked: ``mx_dequant`` and ``mx_triton`` agree to BF16 rounding. A small Triton tile sweep
(``--no-config-sweep`` to skip) records the best tile config at the largest M per projection.

Writes JSON (meta, records, crossover summary, recommended Hopper backend) and a PNG next to it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time

DEFAULT_PROJ = "4096x4096,4096x14336,7168x2048,1536x3072"
DEFAULT_MS = "128,256,512,1024,2048,4096,8192,16384"

HONESTY = ("Hopper (sm_90) has no block-scaled MMA: the MXFP8 GEMM paths are EMULATED (E4M3 x E8M0 dequantized "
           "to BF16, BF16 tensor-core GEMM with fp32 accumulation). They compute the MXFP8 product exactly as the "
           "dequantized operands define it but cannot be faster than the BF16 GEMM on this GPU; the native MXFP8 "
           "grouped GEMM (torch._scaled_grouped_mm) runs only on sm_100/sm_103 and is never launched on sm_90.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/gemm_h200.json", help="JSON output path (PNG next to it)")
    p.add_argument("--proj", default=DEFAULT_PROJ, help="comma-separated KxN projections (in x out)")
    p.add_argument("--ms", default=DEFAULT_MS, help="comma-separated TOTAL row counts M (over all groups)")
    p.add_argument("--groups", type=int, default=8, help="expert groups G (equal sizes M/G)")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes: only checks that it runs")
    p.add_argument("--no-config-sweep", action="store_true", help="skip the Triton tile sweep")
    p.add_argument("--rep-ms", type=float, default=25.0, help="do_bench measurement window per case (ms)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of mxcomm.kernels / mxcomm.gemm
        if args.proj == DEFAULT_PROJ:
            args.proj = "64x64"
        if args.ms == DEFAULT_MS:
            args.ms = "64"
        if args.out == parse_args([]).out:
            args.out = "bench/results/tmp/gemm_smoke.json"
        args.groups = min(args.groups, 4)
    import torch
    import triton

    from mxcomm.gemm import (
        GroupedGemmConfig,
        MXWeightCache,
        grouped_mm,
        grouped_mm_bf16,
        select_backend,
    )
    from mxcomm.gemm import _ops

    dev = torch.device("cpu" if args.smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke for a CPU check")
    projs = [tuple(int(v) for v in s.lower().split("x")) for s in args.proj.split(",") if s]
    ms = [int(v) for v in args.ms.split(",") if v]
    G = args.groups

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        device_name, cap = props.name, list(torch.cuda.get_device_capability(dev))
    else:
        device_name, cap = "cpu (TRITON_INTERPRET smoke run)", None
    meta = dict(
        device=device_name, capability=cap, torch=torch.__version__, triton=triton.__version__,
        cuda=torch.version.cuda, gpus=1,
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        auto_backend=select_backend(dev).value, mxfp8_emulated=not (cap is not None and cap[0] == 10),
        honesty_note=HONESTY, groups=G,
        m_convention=f"M = total rows over {G} equal expert groups (rows per group = M/{G})",
        timing=("do_bench median, CUDA events around the whole Python call, L2 flushed by do_bench"
                if dev.type == "cuda" else "perf_counter, one call (smoke)"),
        flops="2*M*N*K per grouped GEMM",
    )

    def timeit(fn):
        if dev.type == "cuda":
            return triton.testing.do_bench(fn, warmup=5, rep=args.rep_ms, return_mode="median")
        ts = []
        for _ in range(1):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    def randn(shape, seed, scale=1.0):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(*shape, generator=g, device=dev) * scale
        e = torch.randint(-3, 4, (*shape[:-1], shape[-1] // 32, 1), generator=g, device=dev).float()
        return (x.view(*shape[:-1], shape[-1] // 32, 32) * torch.exp2(e)).view(*shape)

    t_start = time.time()
    records, sweeps = [], []
    for (K, N) in projs:
        master = randn((G, N, K), 7, scale=0.02)
        w16 = master.to(torch.bfloat16)
        cache = MXWeightCache(master)
        cache_bf16 = MXWeightCache(master, keep_bf16=True, build_dgrad=False)
        fw = cache.forward_weight()
        for M in ms:
            rows = [M // G + (1 if i < M % G else 0) for i in range(G)]
            offs = torch.tensor(rows, device=dev).cumsum(0).to(torch.int32)
            a16 = randn((M, K), 11).to(torch.bfloat16)
            amx = _ops.quantize_rows(a16, layout="grouped_m", group_offs=offs)
            flops = 2.0 * M * N * K
            base = dict(K=K, N=N, M=M, rows_per_group=M / G, **meta)
            cases = {
                "bf16": lambda: grouped_mm_bf16(a16, w16, offs),
                "mx_dequant": lambda: grouped_mm(amx, cache, offs, backend="dequant"),
                "mx_dequant_bf16w": lambda: grouped_mm(amx, cache_bf16, offs, backend="dequant"),
                "mx_triton": lambda: grouped_mm(amx, cache, offs, backend="triton"),
                "mx_dequant+q": lambda: grouped_mm(_ops.quantize_rows(a16, layout="grouped_m", group_offs=offs),
                                                   cache, offs, backend="dequant"),
                "mx_triton+q": lambda: grouped_mm(_ops.quantize_rows(a16, layout="grouped_m", group_offs=offs),
                                                  cache, offs, backend="triton"),
            }
            components = {
                "quantize_a": lambda: _ops.quantize_rows(a16, layout="grouped_m", group_offs=offs),
                "dequant_a": lambda: _ops.dequantize(amx, torch.bfloat16),
                "dequant_w": lambda: fw.dequantize(torch.bfloat16),
            }
            # correctness: the two emulated paths compute the same function (accumulation order aside)
            check = {}
            try:
                yd = cases["mx_dequant"]()
                yt = cases["mx_triton"]()
                diff = (yd.float() - yt.float()).abs()
                check = dict(max_abs_diff_dequant_vs_triton=float(diff.max()),
                             max_abs_out=float(yd.float().abs().max()),
                             agree=bool(torch.allclose(yd.float(), yt.float(), rtol=2 ** -7,
                                                       atol=1e-3 * float(yd.float().abs().max()) + 1e-6)))
                del yd, yt, diff
            except Exception as e:
                check = dict(check_error=f"{type(e).__name__}: {e}"[:300])
            for name, fn in {**cases, **components}.items():
                rec = dict(case=name, kind="gemm" if name in cases else "component", **base, **check)
                try:
                    ms_ = timeit(fn)
                    rec.update(ms=ms_, tflops=(flops / ms_ / 1e9) if name in cases else None)
                except Exception as e:
                    rec.update(error=f"{type(e).__name__}: {e}"[:500])
                records.append(rec)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        records.extend(wgrad_cases(torch, dev, G, K, N, max(ms), randn, timeit, _ops, meta))
        if not args.no_config_sweep:
            sweeps.extend(config_sweep(torch, G, K, N, max(ms), cache, randn, timeit, grouped_mm,
                                       GroupedGemmConfig, _ops, meta, args.smoke))

    summary = summarize(records)
    out_path = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(dict(meta=meta, summary=summary, records=records, config_sweep=sweeps,
                       wall_s=time.time() - t_start), f, indent=1)
    png = plot(records, out_path)
    print_table(records, summary, sweeps)
    print(f"\n{HONESTY}\nwrote {out_path}" + (f" and {png}" if png else " (no matplotlib: no PNG)")
          + f"  [{time.time() - t_start:.0f} s]")
    return dict(records=records, summary=summary, config_sweep=sweeps)


def wgrad_cases(torch, dev, G, K, N, M, randn, timeit, _ops, meta):
    """Time grouped_wgrad (dequant vs triton backend; x BF16 or MXFP8) at one (M, K, N); check they agree."""
    from mxcomm.gemm import grouped_wgrad

    rows = [M // G + (1 if i < M % G else 0) for i in range(G)]
    offs = torch.tensor(rows, device=dev).cumsum(0).to(torch.int32)
    x16 = randn((M, K), 21).to(torch.bfloat16)
    xmx = _ops.quantize_rows(x16, layout="grouped_m", group_offs=offs)
    gy = randn((M, N), 22).to(torch.bfloat16)
    out = []
    ref = grouped_wgrad(gy, xmx, offs, backend="dequant")
    for name, xin, backend in (("wgrad_dequant_bf16x", x16, "dequant"), ("wgrad_dequant_mxx", xmx, "dequant"),
                               ("wgrad_triton_bf16x", x16, "triton"), ("wgrad_triton_mxx", xmx, "triton")):
        rec = dict(case=name, kind="wgrad", K=K, N=N, M=M, rows_per_group=M / G, **meta)
        try:
            if xin is xmx:
                got = grouped_wgrad(gy, xin, offs, backend=backend)
                rec["agree_with_dequant"] = bool(torch.allclose(got, ref, rtol=2 ** -7,
                                                                atol=1e-3 * float(ref.abs().max()) + 1e-6))
                del got
            t = timeit(lambda: grouped_wgrad(gy, xin, offs, backend=backend))
            rec.update(ms=t, tflops=2.0 * M * N * K / t / 1e9)
        except Exception as e:
            rec.update(error=f"{type(e).__name__}: {e}"[:500])
        out.append(rec)
    return out


def config_sweep(torch, G, K, N, M, cache, randn, timeit, grouped_mm, GroupedGemmConfig, _ops, meta, smoke):
    """Time a few Triton tile configs at one (M, K, N) (prequantized activations)."""
    cfgs = [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)]
    if smoke:
        cfgs = [(32, 32, 32, 4, 1)]
    rows = [M // G + (1 if i < M % G else 0) for i in range(G)]
    offs = torch.tensor(rows, device=cache.master.device).cumsum(0).to(torch.int32)
    amx = _ops.quantize_rows(randn((M, K), 13).to(torch.bfloat16), layout="grouped_m", group_offs=offs)
    out = []
    for bm, bn, bk, nw, ns in cfgs:
        cfg = GroupedGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        rec = dict(K=K, N=N, M=M, block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        try:
            t = timeit(lambda: grouped_mm(amx, cache, offs, backend="triton", config=cfg))
            rec.update(ms=t, tflops=2.0 * M * N * K / t / 1e9)
        except Exception as e:  # e.g. out of shared memory for a config
            rec.update(error=f"{type(e).__name__}: {e}"[:300])
        out.append(rec)
    return out


def summarize(records):
    """Per projection: time ratios MX/BF16 per M, the crossover M (first M where a variant is within 10% of BF16,
    and where it is at least as fast), and which emulated backend is faster overall."""
    ok = [r for r in records if "ms" in r]
    projs = sorted({(r["K"], r["N"]) for r in ok})
    per_proj = {}
    ratios = {"mx_dequant": [], "mx_triton": []}
    for (K, N) in projs:
        rs = [r for r in ok if (r["K"], r["N"]) == (K, N)]
        ms_ = sorted({r["M"] for r in rs})
        entry = {}
        for case in ("mx_dequant", "mx_dequant_bf16w", "mx_triton", "mx_dequant+q", "mx_triton+q"):
            rat = {}
            for M in ms_:
                b = next((r["ms"] for r in rs if r["M"] == M and r["case"] == "bf16"), None)
                m = next((r["ms"] for r in rs if r["M"] == M and r["case"] == case), None)
                if b and m:
                    rat[M] = m / b
                    if case in ratios:
                        ratios[case].append(m / b)
            entry[case] = dict(
                time_ratio_vs_bf16=rat,
                crossover_M_within_10pct=next((M for M in ms_ if rat.get(M, 9e9) <= 1.1), None),
                crossover_M_faster=next((M for M in ms_ if rat.get(M, 9e9) <= 1.0), None),
            )
        per_proj[f"{K}->{N}"] = entry

    def geo(v):
        return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None

    g = {k: geo(v) for k, v in ratios.items()}
    best = None
    if g["mx_dequant"] is not None and g["mx_triton"] is not None:
        best = "dequant" if g["mx_dequant"] <= g["mx_triton"] else "triton"
    wg = {}
    for name in ("wgrad_dequant_mxx", "wgrad_triton_mxx"):
        v = [r["ms"] for r in ok if r["case"] == name]
        wg[name] = sum(v) if v else None
    wbest = None
    if all(wg.values()):
        wbest = "dequant" if wg["wgrad_dequant_mxx"] <= wg["wgrad_triton_mxx"] else "triton"
    return dict(per_projection=per_proj, geomean_time_ratio_vs_bf16=g, recommended_hopper_backend=best,
                wgrad_total_ms=wg, recommended_wgrad_backend=wbest,
                note="time ratio > 1 means slower than BF16; on sm_90 the MX paths are emulated (see honesty_note)")


def print_table(records, summary, sweeps):
    print(f"\n{'K->N':>11} {'M':>6} {'case':<18} {'ms':>9} {'TFLOP/s':>9}")
    for r in records:
        kn = f"{r['K']}->{r['N']}"
        if "error" in r:
            print(f"{kn:>11} {r['M']:>6} {r['case']:<18} ERROR {r['error'][:70]}")
            continue
        tf = f"{r['tflops']:9.1f}" if r.get("tflops") is not None else f"{'-':>9}"
        print(f"{kn:>11} {r['M']:>6} {r['case']:<18} {r['ms']:9.3f} {tf}")
    print("\ngeomean time ratio vs BF16:", {k: (round(v, 3) if v else v)
                                            for k, v in summary["geomean_time_ratio_vs_bf16"].items()},
          "-> recommended Hopper backend:", summary["recommended_hopper_backend"],
          "| wgrad:", summary["recommended_wgrad_backend"])
    if sweeps:
        best = {}
        for s in sweeps:
            if "tflops" in s and ((s["K"], s["N"]) not in best or s["tflops"] > best[(s["K"], s["N"])]["tflops"]):
                best[(s["K"], s["N"])] = s
        for (K, N), s in best.items():
            print(f"  best triton tiles {K}->{N} M={s['M']}: {s['block_m']}x{s['block_n']}x{s['block_k']} "
                  f"w{s['num_warps']} s{s['num_stages']} -> {s['tflops']:.1f} TFLOP/s")


def plot(records, out_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    ok = [r for r in records if r.get("tflops") and r.get("kind") == "gemm"]
    projs = sorted({(r["K"], r["N"]) for r in ok})
    if not projs:
        return None
    cases = list(dict.fromkeys(r["case"] for r in ok))
    n = len(projs)
    cols = min(2, n)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(6.5 * cols, 4.2 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, (K, N) in zip(axes.flat, projs):
        for c in cases:
            pts = sorted((r["M"], r["tflops"]) for r in ok if (r["K"], r["N"]) == (K, N) and r["case"] == c)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c,
                        linewidth=2.5 if c == "bf16" else 1.3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"M (total rows over {ok[0]['groups']} groups)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{K} -> {N}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    emu = " (MXFP8 emulated via BF16 on sm_90)" if ok[0].get("mxfp8_emulated") else ""
    fig.suptitle(f"grouped GEMM, {ok[0]['device']}{emu}")
    fig.tight_layout()
    png = os.path.splitext(out_path)[0] + ".png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    main()
