"""Benchmark the Triton MXFP8 quantize kernels against the device copy ceiling and torch.compile.

Usage (GPU):   python bench/bench_quantize.py [--out bench/results/quantize_h200.json] [--sweep]
Usage (CPU):   python bench/bench_quantize.py --smoke      (TRITON_INTERPRET, tiny shape, checks it runs)

For each shape (default 16384x7168 and 131072x7168, bf16, random data with varied exponents) it
measures, in the same run:
* the device-to-device copy ceiling: ``dst.copy_(src)`` of a same-size bf16 tensor, read + write counted;
* Triton ``quantize_rows`` (layout row and blocked; hardware and integer rounding), ``quantize_cols``
  (layout row and blocked), rceil;
* the plain-torch reference ``mxcomm.mx.quantize`` under ``torch.compile`` (rows and cols).
Bytes counted per quantize: bf16 read (2 B/elem) + E4M3 write (1 B/elem) + scale bytes written
(the whole scale tensor, padding included). Time: ``triton.testing.do_bench`` median over CUDA-event
timed Python calls (kernel + launch + output allocation), L2 flushed by do_bench between calls and
inputs rotated over >= 2 buffers whose total exceeds 4x the L2 size. Every Triton case is also checked
bit-exact against the eager reference once (the torch.compile one too).

Writes JSON (one record per case: gbps, copy_ceiling_gbps, ratio, ms, shape, direction, layout, ...,
device, versions, timestamp), a PNG bar chart if matplotlib is present, and prints a table.
With ``--sweep`` it also times a grid of tile configurations and records the best per case.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

L2_BYTES_DEFAULT = 60 * 2 ** 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/quantize_h200.json", help="JSON output path (PNG next to it)")
    p.add_argument("--shapes", default="16384x7168,131072x7168", help="comma-separated MxK list")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape: only checks that it runs")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per case")
    p.add_argument("--no-check", action="store_true", help="skip the bit-exactness check against the reference")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of mxcomm.kernels
        if args.shapes == parse_args([]).shapes:
            args.shapes = "256x512"
        if args.out == parse_args([]).out:
            args.out = "bench/results/tmp/quantize_smoke.json"
    import torch
    import triton

    from mxcomm import mx
    from mxcomm.kernels import QuantizeConfig, quantize_cols, quantize_rows

    dev = torch.device("cpu" if args.smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke for a CPU check")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        device_name, sm_count = props.name, props.multi_processor_count
        l2 = getattr(props, "L2_cache_size", L2_BYTES_DEFAULT) or L2_BYTES_DEFAULT
    else:
        device_name, sm_count, l2 = "cpu (TRITON_INTERPRET smoke run)", 0, L2_BYTES_DEFAULT
    meta = dict(
        device=device_name, sm_count=sm_count, torch=torch.__version__, triton=triton.__version__,
        cuda=torch.version.cuda, timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        timing=("do_bench median, CUDA events around the Python call (kernel + launch + output alloc); "
                "L2 flushed by do_bench, inputs rotated") if dev.type == "cuda" else "perf_counter median (smoke)",
        bytes_counted="bf16 read + e4m3 write + scale bytes written (padding included); copy: read + write",
    )

    def timeit(fn):
        if dev.type == "cuda":
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    def rotating(make, nbytes):
        n = max(2, -(-4 * l2 // max(nbytes, 1)))
        if dev.type == "cpu":
            n = 2
        bufs = [make(i) for i in range(n)]
        state = {"i": 0}

        def nxt():
            state["i"] = (state["i"] + 1) % n
            return bufs[state["i"]]
        return bufs, nxt

    def random_bf16(M, K, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(M, K, device=dev, generator=g, dtype=torch.float32)
        e = torch.randint(-8, 8, (M, K // 32, 1), device=dev, generator=g).float()
        x = (x.view(M, K // 32, 32) * torch.exp2(e)).view(M, K)
        return x.to(torch.bfloat16)

    def same(a, b):
        return (torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
                and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)))

    compiled = {}
    if not args.no_compile:
        compiled["row"] = torch.compile(lambda t: mx.quantize(t, mode="rceil", axis=-1))
        compiled["col"] = torch.compile(lambda t: mx.quantize(t, mode="rceil", axis=0))

    records, sweeps = [], []
    for (M, K) in shapes:
        elems = M * K
        in_bytes = elems * 2
        xs, next_x = rotating(lambda i: random_bf16(M, K, 1234 + i), in_bytes)
        # copy ceiling
        dst = torch.empty_like(xs[0])
        copy_ms = timeit(lambda: dst.copy_(next_x()))
        copy_gbps = 2 * in_bytes / copy_ms / 1e6
        del dst
        shape_rec = dict(shape=[M, K], dtype="bfloat16", **meta)
        records.append(dict(case="copy", direction="copy", layout="-", impl="torch copy_", ms=copy_ms,
                            gbps=copy_gbps, copy_ceiling_gbps=copy_gbps, ratio=1.0, bytes=2 * in_bytes, **shape_rec))

        cases = [
            ("row", "row", "triton", lambda t: quantize_rows(t, mode="rceil", layout="row")),
            ("row", "blocked", "triton", lambda t: quantize_rows(t, mode="rceil", layout="blocked")),
            ("row", "row", "triton int_round", lambda t: quantize_rows(t, mode="rceil", layout="row", int_round=True)),
            ("col", "row", "triton", lambda t: quantize_cols(t, mode="rceil", layout="row")),
            ("col", "blocked", "triton", lambda t: quantize_cols(t, mode="rceil", layout="blocked")),
        ]
        if args.smoke:  # the interpreter always uses integer rounding
            cases = [c for c in cases if c[2] != "triton int_round"]
        for direction, fn in compiled.items():
            cases.append((direction, "row", "torch.compile(mx.quantize)", fn))

        for direction, layout, impl, fn in cases:
            rec = dict(case=f"{direction}/{layout}/{impl}", direction=direction, layout=layout, impl=impl, **shape_rec)
            try:
                out = fn(xs[0])
                scale_bytes = out.scales.numel()
                if not args.no_check:
                    ref = mx.quantize(xs[0], mode="rceil", axis=1 if direction == "row" else 0, layout=layout)
                    rec["bit_exact"] = bool(same(out, ref))
                    del ref
                del out
                ms = timeit(lambda: fn(next_x()))
                nbytes = in_bytes + elems + scale_bytes
                gbps = nbytes / ms / 1e6
                rec.update(ms=ms, gbps=gbps, copy_ceiling_gbps=copy_gbps, ratio=gbps / copy_gbps, bytes=nbytes)
            except Exception as e:  # record and go on (e.g. torch.compile unavailable)
                rec.update(error=f"{type(e).__name__}: {e}"[:500])
            records.append(rec)
            if dev.type == "cuda":
                torch.cuda.empty_cache()

        if args.sweep:
            sweeps.extend(run_sweep(M, K, xs, next_x, timeit, copy_gbps, in_bytes, elems, shape_rec,
                                    QuantizeConfig, quantize_rows, quantize_cols, args.smoke))
        del xs
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    out_path = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"records": records, "sweep": sweeps}, f, indent=1)
    png = plot(records, out_path)
    print_table(records, sweeps)
    print(f"\nwrote {out_path}" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    return records


def run_sweep(M, K, xs, next_x, timeit, copy_gbps, in_bytes, elems, shape_rec, QuantizeConfig, quantize_rows,
              quantize_cols, smoke):
    """Time a grid of tile configs for rows (row layout) and cols (row layout); one record per config."""
    out = []
    row_cfgs = [(bm, bk, nw) for bk in (256, 512, 1024, 2048) for bm in (1, 2, 4, 8, 16, 32)
                for nw in (4, 8, 16) if 2048 <= bm * bk <= 32768]
    col_cfgs = [(br, bk, nw) for bk in (64, 128, 256, 512) for br in (32, 64, 128)
                for nw in (4, 8) if 2048 <= br * bk <= 32768]
    if smoke:
        row_cfgs, col_cfgs = row_cfgs[:2], col_cfgs[:2]
    for direction, cfgs, fn in (("row", row_cfgs, quantize_rows), ("col", col_cfgs, quantize_cols)):
        for (r, bk, nw) in cfgs:
            cfg = QuantizeConfig(block_rows=r, block_k=bk, num_warps=nw)
            rec = dict(case=f"sweep/{direction}", direction=direction, layout="row", block_rows=r, block_k=bk,
                       num_warps=nw, **shape_rec)
            try:
                o = fn(xs[0], config=cfg)
                sb = o.scales.numel()
                del o
                ms = timeit(lambda: fn(next_x(), config=cfg))
                gbps = (in_bytes + elems + sb) / ms / 1e6
                rec.update(ms=ms, gbps=gbps, ratio=gbps / copy_gbps)
            except Exception as e:
                rec.update(error=f"{type(e).__name__}: {e}"[:300])
            out.append(rec)
    return out


def print_table(records, sweeps):
    print(f"\n{'shape':>14} {'case':<44} {'ms':>9} {'GB/s':>9} {'/copy':>7} {'exact':>6}")
    for r in records:
        shape = "x".join(str(v) for v in r["shape"])
        if "error" in r:
            print(f"{shape:>14} {r['case']:<44} ERROR {r['error'][:60]}")
            continue
        ex = {True: "yes", False: "NO"}.get(r.get("bit_exact"), "-")
        print(f"{shape:>14} {r['case']:<44} {r['ms']:9.3f} {r['gbps']:9.1f} {r['ratio']:7.1%} {ex:>6}")
    if sweeps:
        print("\nbest swept configs:")
        best = {}
        for s in sweeps:
            if "gbps" not in s:
                continue
            key = (tuple(s["shape"]), s["direction"])
            if key not in best or s["gbps"] > best[key]["gbps"]:
                best[key] = s
        for (shape, d), s in best.items():
            print(f"  {'x'.join(map(str, shape)):>14} {d}: block_rows={s['block_rows']} block_k={s['block_k']} "
                  f"num_warps={s['num_warps']} -> {s['gbps']:.1f} GB/s ({s['ratio']:.1%} of copy)")


def plot(records, out_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    ok = [r for r in records if "gbps" in r]
    shapes = sorted({tuple(r["shape"]) for r in ok})
    cases = list(dict.fromkeys(r["case"] for r in ok))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cases)), 4.5))
    w = 0.8 / max(len(shapes), 1)
    for i, sh in enumerate(shapes):
        vals = [next((r["gbps"] for r in ok if tuple(r["shape"]) == sh and r["case"] == c), 0.0) for c in cases]
        ax.bar([j + i * w for j in range(len(cases))], vals, w, label="x".join(map(str, sh)))
    ax.set_xticks([j + w * (len(shapes) - 1) / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s (read + write)")
    ax.set_title(f"MXFP8 quantize, {ok[0]['device'] if ok else ''}")
    ax.legend()
    fig.tight_layout()
    png = os.path.splitext(out_path)[0] + ".png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


if __name__ == "__main__":
    main()
