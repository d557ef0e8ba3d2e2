"""A token's data into this rank's send copy, from where the ranks that need it read it through peer pointers:
``pack_row`` (a token row read once and, MX, quantized once into ``send_q`` / ``send_s``; the pull dispatch's packs in
:mod:`.pull` and combine backward's in :mod:`.combine_backward`) and ``pack_weights`` (its route weights into ``send_w``). Why
the send copies come in two: see :mod:`.pull`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ....kernels.mx_device import mx_quantize_tile, store_block_bytes


@triton.jit
def pack_row(x_ptr, t, send_q_ptr, send_s_ptr, drow, copy0, H: tl.constexpr, CHUNK: tl.constexpr,
             MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, X_SLOT: tl.constexpr):
    """Token row ``t`` of ``x`` read once and (MX) quantized once into a send copy: its values at element
    ``copy0 + t * H`` of ``send_q``, its row-major scales (MX) at row ``drow`` of ``send_s``. Pointers as in
    :func:`pack_rows_kernel` (``x_ptr`` already the tensor's; ``X_SLOT``: it was read from memory, so its
    16-byte alignment is stated here)."""
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    for c0 in tl.static_range(0, H, CHUNK):
        m = (c0 + offs) < H
        xp = x_ptr + t.to(tl.int64) * H + c0 + offs
        if X_SLOT:  # an address read from memory carries no alignment: without the hint, one load per value
            xp = tl.max_contiguous(tl.multiple_of(xp, 16), 16)
        x = tl.load(xp, mask=m, other=0.0)
        dst = send_q_ptr + tl.multiple_of(copy0 + t.to(tl.int64) * H + c0, 16) + offs
        if MX:
            q2, s = mx_quantize_tile(tl.reshape(x, (NB, 32)), MODE, INT_ROUND, 1)
            tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), tl.reshape(q2, (CHUNK,)), mask=m)
            cols = c0 // 32 + bcols
            store_block_bytes(send_s_ptr + drow * C + cols, s, cols < C, INT_ROUND)
        else:
            tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), x, mask=m)


@triton.jit
def pack_weights(w_ptr, t, send_w_ptr, drow, K: tl.constexpr, K_POW2: tl.constexpr):
    """Token ``t``'s fp32 route weights (``w`` ``[T, K]``) into row ``drow`` of ``send_w`` (fp32 ``[., K]``)."""
    kk = tl.arange(0, K_POW2)
    wv = tl.load(w_ptr + t * K + kk, mask=kk < K, other=0.0)
    tl.store(send_w_ptr + drow * K + kk, wv, mask=kk < K)
