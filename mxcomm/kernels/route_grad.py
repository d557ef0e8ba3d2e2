"""Route-weight gradient of a combine, as one Triton kernel reading MXFP8 (or BF16) rows directly.

``grad_w[t, j] = <grad_y[t], rows[pos[t, j]]>`` in fp32 (0 where ``pos[t, j] == -1``): the rows are the
expert outputs as they arrived at the token's rank (saved by the forward combine). The plain-torch
reference is :func:`mxcomm.ep.reference.backward.route_weight_grad`, which dequantizes every row to fp32 in
memory first (about 4 bytes x T x k x H of traffic, three times over); this kernel reads each payload
byte once. Sums run in fp32 in a different order from the reference (equal to fp32 rounding). MX rows decode
as the forward combine decodes them (:func:`mxcomm.kernels.mx_device.mx_decode_tile`, saturated to the bf16
max: ``rows.dequantize(torch.float32, saturate_to=torch.bfloat16)``), so the gradient is that of the function the
forward computed.
"""
from __future__ import annotations

from typing import Union

import torch
import triton
import triton.language as tl

from ..mx import MXTensor, ScaleLayout
from .mx_device import BF16_MAX, mx_decode_tile
from .launch import fast_kernel


@triton.jit
def route_weight_grad_kernel(gy_ptr, q_ptr, s_ptr, pos_ptr, out_ptr, T,
                             H: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, CHUNK: tl.constexpr,
                             MX: tl.constexpr, INT_ROUND: tl.constexpr):
    """Program ``p`` handles tokens ``p, p + G, ...``; per token the K rows' chunks are loaded together.

    Args:
        gy_ptr: bf16 ``[T, H]``; q_ptr: MX: uint8 E4M3 ``[n, H]``, else bf16 ``[n, H]``;
        s_ptr: uint8 ROW scales ``[n, H/32]`` (MX only); pos_ptr: int32 ``[T, K]`` row of each slot, -1 =
        dropped; out_ptr: fp32 ``[T, K]``.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NB: tl.constexpr = CHUNK // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    kk = tl.arange(0, K_POW2)
    kmask = kk < K
    t = pid
    while t < T:
        pos = tl.load(pos_ptr + t * K + kk, mask=kmask, other=-1)
        ok = pos >= 0
        p64 = tl.maximum(pos, 0).to(tl.int64)
        acc = tl.zeros((K_POW2,), tl.float32)
        for c0 in tl.static_range(0, H, CHUNK):
            m = (c0 + offs) < H
            g = tl.load(gy_ptr + t.to(tl.int64) * H + c0 + offs, mask=m, other=0.0).to(tl.float32)
            m2 = ok[:, None] & m[None, :]
            q = tl.load(q_ptr + (p64 * H + c0)[:, None] + offs[None, :], mask=m2, other=0)
            if MX:
                cols = c0 // 32 + bcols
                sb = tl.load(s_ptr + (p64 * (H // 32))[:, None] + cols[None, :],
                             mask=ok[:, None] & (cols < H // 32)[None, :], other=127)
                # the values the forward combine summed: decoded, saturated to the bf16 max (bf16-origin rows)
                v3 = mx_decode_tile(tl.reshape(q, (K_POW2, NB, 32)), sb, INT_ROUND, BF16_MAX)
                v = tl.reshape(v3, (K_POW2, CHUNK))
            else:
                v = q.to(tl.float32)
            acc += tl.sum(tl.where(m2, v * g[None, :], 0.0), axis=1)
        tl.store(out_ptr + t * K + kk, tl.where(ok, acc, 0.0), mask=kmask)
        t += G


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype).contiguous()``: ``t`` itself when it already is (checked without a tensor op)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def route_weight_grad(grad_y: torch.Tensor, rows: Union[MXTensor, torch.Tensor], send_pos: torch.Tensor, *,
                      programs: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """``grad_w[t, j] = <grad_y[t], rows[send_pos[t, j]]>`` (fp32 ``[T, k]``, 0 for dropped slots).

    Args:
        grad_y: bfloat16 ``[T, H]`` (H a multiple of 32), CUDA (or CPU under ``TRITON_INTERPRET=1``).
        rows: an :class:`MXTensor` (axis 1, ROW scales) or bfloat16 ``[n, H]``, the saved combine rows.
        send_pos: int32/int64 ``[T, k]`` row of each slot in ``rows``, -1 = dropped.
        programs: persistent programs (grid size cap); num_warps: warps per program.

    Each program loads a ``[k, 512]`` tile of rows per step; ``bench/bench_route_grad.py`` sweeps the launch
    settings (docs/benchmarks.md, route-weight gradient, has the measurements).
    """
    T, H = grad_y.shape
    k = send_pos.shape[1]
    mx = isinstance(rows, MXTensor)
    if mx and (rows.layout != ScaleLayout.ROW or rows.axis != 1):
        raise ValueError("route_weight_grad needs MX rows with ROW scales along axis 1")
    q = rows.qdata.view(torch.uint8).contiguous() if mx else _dense(rows, torch.bfloat16)
    s = rows.scales.view(torch.uint8).contiguous() if mx else q
    if q.shape[-1] != H or H % 32:
        raise ValueError(f"rows must be [n, {H}] with H a multiple of 32, got {tuple(q.shape)}")
    out = torch.empty(T, k, dtype=torch.float32, device=grad_y.device)
    if T == 0:
        return out
    interp = grad_y.device.type != "cuda"
    kp = 1 << max(0, (k - 1).bit_length())
    chunk = max(32, min(1024, 1 << (H - 1).bit_length(), 4096 // kp))
    fast_kernel(route_weight_grad_kernel)[(min(T, programs),)](
        grad_y.contiguous(), q, s, _dense(send_pos, torch.int32), out, T,
        H=H, K=k, K_POW2=kp, CHUNK=chunk, MX=mx, INT_ROUND=interp, num_warps=num_warps,
    )
    return out


__all__ = ["route_weight_grad", "route_weight_grad_kernel"]
