"""The dispatch KERNEL alone on one GPU, against the device copy ceiling and a naive baseline kernel.

    python3 bench/bench_dispatch_kernel.py [--tokens 8192] [--hidden 7168] [--topk 8] [--experts 256]

No NVSHMEM: with one rank every slot goes to this GPU, so ``mxcomm.ep.nvshmem_kernels.dispatch_kernel``
is launched with one-entry pointer tables that point at plain CUDA tensors (what the backend passes in
loopback, minus the symmetric heap). The routing plan is the library's (``mxcomm.ep.plan.build_plan``,
random top-k routing, every expert local), built once outside the timed region.

Timed (CUDA-event median per launch, after warm-up):

* ``mxcomm``: the library's dispatch kernel for each (programs, warps) in the sweep;
* ``naive``: one program per token that loads the row once, quantizes it once and stores it to each of
  its k destination rows with row-major scales (the baseline the EP issue names; this file's kernel);
* ``ceiling``: ``dst.copy_(src)`` of 1 GiB (read + write counted).

Bytes counted for both kernels: BF16 read once per token (``T*H*2``) plus the MXFP8 payload and scales
written once per valid selection (``S*(H + H/32)``). Every variant's payload and scales are checked
against the library's output of the same run (payload bytes equal; scales equal after mapping the
naive kernel's row-major scales through the blocked layout). Writes JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mxcomm.bench.env_info import machine, versions  # noqa: E402
from mxcomm.ep.nvshmem_backend import NvshmemBackend, dest_scale_rows, triton_next_pow2  # noqa: E402
from mxcomm.ep.nvshmem_kernels import dispatch_kernel  # noqa: E402
from mxcomm.ep.plan import build_plan, local_counts  # noqa: E402
from mxcomm.kernels.mx_device import mx_quantize_tile  # noqa: E402
from mxcomm.mx import round_up  # noqa: E402


@triton.jit
def naive_dispatch_kernel(x_ptr, dest_row_ptr, q_ptr, s_ptr, H: tl.constexpr, K: tl.constexpr,
                          CHUNK: tl.constexpr, INT_ROUND: tl.constexpr):
    """Baseline: program ``t`` loads bf16 row ``x[t, :]`` once (``CHUNK`` at a time), quantizes it once
    (rceil) and stores payload row ``q[dest_row[t, j]]`` (uint8 ``[*, H]``) and row-major scales
    ``s[dest_row[t, j]]`` (uint8 ``[*, H/32]``) for each valid slot ``j`` (``dest_row >= 0``)."""
    t = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = CHUNK // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    for c0 in tl.static_range(0, H, CHUNK):
        m = (c0 + offs) < H
        x = tl.load(x_ptr + t * H + c0 + offs, mask=m, other=0.0)
        q2, s = mx_quantize_tile(tl.reshape(x, (NB, 32)), 0, INT_ROUND, 1)
        q = tl.reshape(q2, (CHUNK,))
        for j in tl.static_range(K):
            row = tl.load(dest_row_ptr + t * K + j).to(tl.int64)
            if row >= 0:
                tl.store(q_ptr + row * H + c0 + offs, q, mask=m)
                tl.store(s_ptr + row * (H // 32) + c0 // 32 + bcols, s, mask=(c0 // 32 + bcols) < H // 32)


def _event_median_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def _routing(T: int, E: int, k: int, dev, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32)
    return idx.to(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--align", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--programs", default="1,2,4,8,tokens", help="programs per SM (or 'tokens': one per token)")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--chunks", default="", help="row chunks for the library kernel (default: the backend's)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dispatch_kernel.json"))
    args = ap.parse_args()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu" if interp else "cuda")
    T, H, k, E = args.tokens, args.hidden, args.topk, args.experts
    C = H // 32
    idx = _routing(T, E, k, dev)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(dev)
    plan = build_plan(local_counts(idx, E)[None], idx, 0, args.align)
    srow = dest_scale_rows(plan, idx)
    R = int(plan.num_rows)
    R128 = round_up(R + 128 * E, 128)  # blocked rows: each group padded to 128 on its own
    n_col_tiles = round_up(C, 4) // 4
    S = int((idx >= 0).sum())
    nbytes = T * H * 2 + S * (H + C)

    def ptrs(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([t.data_ptr()], dtype=torch.int64, device=dev)

    flags = torch.zeros(3, 1, dtype=torch.int64, device=dev)
    w = torch.zeros(1, dtype=torch.float32, device=dev)
    sms = 1 if interp else torch.cuda.get_device_properties(dev).multi_processor_count

    flag_ptrs = ptrs(flags)

    def lib_launch(q, s, programs, warps, chunk):
        qp, sp = ptrs(q), ptrs(s)
        return lambda: dispatch_kernel[(programs,)](
            x, T, plan.dest_rank, plan.dest_row, srow, qp, sp, flag_ptrs, 0, 1, n_col_tiles, w,
            H=H, K=k, K_POW2=triton_next_pow2(k), CHUNK=chunk, MX=True, MODE=0, INT_ROUND=interp,
            WEIGHTED=False, num_warps=warps)

    # reference output: the library kernel with the backend's launch parameters
    ref_q = torch.zeros(R, H, dtype=torch.uint8, device=dev)
    ref_s = torch.zeros((R128 // 128) * n_col_tiles * 512, dtype=torch.uint8, device=dev)
    default_chunk = NvshmemBackend._chunk(H, k)
    lib_launch(ref_q, ref_s, sms * 4, 8, default_chunk)()
    rows_real = torch.zeros(R, dtype=torch.bool, device=dev)
    rows_real[plan.dest_row.reshape(-1)[plan.dest_row.reshape(-1) >= 0].long()] = True

    results = []

    def record(name, params, fn, q, s, scales_row_major):
        q.zero_()
        s.zero_()
        fn()
        ok_q = bool(torch.equal(q[rows_real], ref_q[rows_real]))
        if scales_row_major:  # naive kernel: row r's scales at s[r*C:(r+1)*C] -> compare with the blocked ref
            dr = plan.dest_row.reshape(-1).long()
            sr = srow.reshape(-1).long()
            keep = dr >= 0
            cols = torch.arange(C, device=dev)
            boff = _blocked_offsets(sr[keep], cols, n_col_tiles)
            ok_s = bool(torch.equal(s.view(-1)[: R * C].view(R, C)[dr[keep]], ref_s[boff]))
        else:
            ok_s = bool(torch.equal(s, ref_s))
        us = float("nan") if interp else _event_median_us(fn, args.iters)
        res = dict(kernel=name, **params, us=us, gbps=nbytes / (us * 1e-6) / 1e9, payload_equal=ok_q,
                   scales_equal=ok_s)
        results.append(res)
        print(json.dumps(res), flush=True)

    q = torch.empty_like(ref_q)
    s = torch.empty_like(ref_s)
    chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [default_chunk]
    for pps in args.programs.split(","):
        programs = T if pps == "tokens" else sms * int(pps)
        for warps in (int(v) for v in args.warps.split(",")):
            for chunk in chunks:
                record("mxcomm", dict(programs=programs, warps=warps, chunk=chunk),
                       lib_launch(q, s, programs, warps, chunk), q, s, False)
    s_rows = torch.empty(R * C, dtype=torch.uint8, device=dev)
    for warps in (int(v) for v in args.warps.split(",")):
        record("naive", dict(programs=T, warps=warps, chunk=default_chunk),
               lambda warps=warps: naive_dispatch_kernel[(T,)](x, plan.dest_row, q, s_rows, H=H, K=k,
                                                                CHUNK=default_chunk, INT_ROUND=interp,
                                                                num_warps=warps),
               q, s_rows, True)
    out = dict(benchmark="dispatch_kernel", machine=machine(), versions=versions(),
               config=dict(tokens=T, hidden=H, topk=k, experts=E, align=args.align, selections=S, rows=R),
               bytes_counted=nbytes, byte_accounting="T*H*2 (bf16 read once) + S*(H + H/32) (MXFP8 written per selection)",
               results=results)
    if not interp:
        src = torch.empty(1 << 29, dtype=torch.int16, device=dev)
        dst = torch.empty_like(src)
        cus = _event_median_us(lambda: dst.copy_(src), args.iters)
        out["copy_ceiling_gbps"] = 2 * src.numel() * 2 / (cus * 1e-6) / 1e9
        for r in results:
            r["vs_copy_ceiling"] = r["gbps"] / out["copy_ceiling_gbps"]
        print(f"copy ceiling {out['copy_ceiling_gbps']:.0f} GB/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    bad = [r for r in results if not (r["payload_equal"] and r["scales_equal"])]
    if bad:
        raise SystemExit(f"{len(bad)} variant(s) differ from the library kernel's output: {bad}")


def _blocked_offsets(rows: torch.Tensor, cols: torch.Tensor, n_col_tiles: int) -> torch.Tensor:
    """Byte offsets ``[len(rows), len(cols)]`` in the 128x4-blocked scale layout (as ``blocked_scale_offset``)."""
    r, c = rows[:, None], cols[None, :]
    return ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


if __name__ == "__main__":
    main()
