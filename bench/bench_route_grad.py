"""Launch settings of the route-weight gradient kernel (combine backward), on one GPU.

    python3 bench/bench_route_grad.py [--tokens 8192 --hidden 7168 --topk 8] [--out bench/results/h200/route_grad.json]

``grad_w[t, j] = <grad_y[t], rows[pos[t, j]]>`` with MXFP8 rows (ROW scales) as the forward combine saves them:
``mxcomm.kernels.route_grad.route_weight_grad_kernel`` timed for every (programs per SM, warps, row chunk) of the
grid (CUDA-event median of ``--iters`` launches), against the device copy ceiling measured in the same run, by the
bytes the kernel must read (``grad_y`` BF16 once, every slot's payload and scales once). Every setting's output is
checked against an fp64 sum: ``|got - want| <= 1e-4 * sum_i |g_i v_i|`` (the fp32 rounding of a sum in any order
stays far inside it). Inputs: random BF16 ``grad_y``; rows = the reference quantization of random rows with varied
magnitudes; ``pos`` a random permutation of the ``T * k`` rows with 2 % of slots dropped (-1).
Writes JSON (results, ceiling, config, device, versions).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from mxcomm.bench.ceiling import device_copy, event_median_ms
from mxcomm.bench.env_info import machine, versions
from mxcomm.kernels.route_grad import route_weight_grad_kernel
from mxcomm.mx import quantize


def _ints(s: str) -> list:
    return [int(v) for v in s.split(",") if v]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--per-sm", default="4,8,16")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="bench/results/h200/route_grad.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_route_grad.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    T, H, k = a.tokens, a.hidden, a.topk
    n = T * k
    gen = torch.Generator(device=dev).manual_seed(0)
    gy = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
    rows_q, rows_s = torch.empty(n, H, dtype=torch.uint8, device=dev), None
    scales = []
    for r0 in range(0, n, 8192):  # quantize in pieces (fp32 temporaries)
        r1 = min(n, r0 + 8192)
        x = torch.randn(r1 - r0, H, device=dev, generator=gen) * torch.exp2(
            torch.randint(-6, 7, (r1 - r0, 1), device=dev, generator=gen).float())
        m = quantize(x.to(torch.bfloat16), axis=1)
        rows_q[r0:r1] = m.qdata.view(torch.uint8)
        scales.append(m.scales.view(torch.uint8))
    rows_s = torch.cat(scales)
    pos = torch.randperm(n, device=dev, generator=gen).view(T, k).to(torch.int32)
    pos[torch.rand(T, k, device=dev, generator=gen) < 0.02] = -1
    # fp64 reference and per-slot bound, in token pieces
    want = torch.zeros(T, k, dtype=torch.float64, device=dev)
    bound = torch.zeros(T, k, dtype=torch.float64, device=dev)
    lut = torch.arange(256, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn).to(torch.float64)
    for t0 in range(0, T, 512):
        t1 = min(T, t0 + 512)
        p = pos[t0:t1].long()
        ok = p >= 0
        pc = p.clamp(min=0)
        v = lut[rows_q[pc].long()].view(t1 - t0, k, H // 32, 32) * torch.exp2(rows_s[pc].double() - 127)[..., None]
        prod = v.view(t1 - t0, k, H) * gy[t0:t1].double()[:, None, :]
        want[t0:t1] = torch.where(ok, prod.sum(-1), 0.0)
        bound[t0:t1] = prod.abs().sum(-1)
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    ceiling = device_copy(dev)
    nbytes = T * H * 2 + int((pos >= 0).sum()) * (H + H // 32)
    kp = 1 << max(0, (k - 1).bit_length())
    results = []
    for per_sm in _ints(a.per_sm):
        for warps in _ints(a.warps):
            for chunk in _ints(a.chunks):
                out = torch.empty(T, k, dtype=torch.float32, device=dev)

                def run(progs=per_sm * sm, warps=warps, chunk=chunk, out=out):
                    route_weight_grad_kernel[(min(T, progs),)](gy, rows_q, rows_s, pos, out, T, H=H, K=k, K_POW2=kp,
                                                               CHUNK=chunk, MX=True, INT_ROUND=False, num_warps=warps)
                ms = event_median_ms(run, a.iters, dev)
                err = (out.double() - want).abs()
                correct = bool((err <= 1e-4 * bound + 1e-30).all())
                gbps = nbytes / (ms * 1e-3) / 1e9
                results.append(dict(programs_per_sm=per_sm, warps=warps, chunk=chunk, us=ms * 1e3, gbps=gbps,
                                    vs_copy_ceiling=gbps / ceiling["gbps"], correct=correct,
                                    max_err_over_bound=float((err / (bound + 1e-30)).max())))
                r = results[-1]
                print(f"per_sm={per_sm:2d} warps={warps} chunk={chunk:4d} {r['us']:8.1f} us {gbps:6.0f} GB/s "
                      f"{100 * r['vs_copy_ceiling']:5.1f}% correct={correct}", flush=True)
    best = min((r for r in results if r["correct"]), key=lambda r: r["us"], default=None)
    rec = dict(config=dict(tokens=T, hidden=H, topk=k, iters=a.iters, bytes_read=nbytes), copy_ceiling=ceiling,
               results=results, best=best, device=torch.cuda.get_device_name(dev), machine=machine(),
               versions=versions(), timing="CUDA-event median per launch (kernel only)")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"copy ceiling {ceiling['gbps']:.0f} GB/s; best {best}")
    return 0 if all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
