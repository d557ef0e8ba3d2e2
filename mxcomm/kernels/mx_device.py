"""Reusable Triton device functions for MXFP8 (E4M3 payload, E8M0 scale per 32 values).

Every function here is ``@triton.jit`` and meant to be called from other kernels (quantize,
EP dispatch/combine, fused activations) so that values are quantized in registers, with the
exact rules of :mod:`mxcomm.mx.scales` (the plain-torch reference):

* scale byte (``MODE`` constexpr, see :data:`SCALE_MODE_IDS`):
  rceil (0): exponent field of ``fp32(amax) * fp32(1/448)`` plus one if its mantissa is
  non-zero (fp32 subnormal: if the mantissa exceeds 0x400000), clamped to 254;
  floor (1): ``clamp(exponent_field(amax) - 8, 0, 254)``; NaN/Inf amax -> 255.
* payload: ``e4m3_rne_satfinite(x * 2**(127 - b))``; a block holding NaN or +-Inf gets scale 255
  and payload bytes 0x7F; other blocks are unaffected.
* decode (:func:`mx_decode_tile`, the one device decoder): ``e4m3(q) * 2**(b - 127)`` in fp32, saturated to
  +-``OUT_MAX``, the largest finite value of the dtype the values are delivered in (:data:`BF16_MAX`,
  :data:`FP16_MAX`, :data:`FP32_MAX`; :func:`out_max` on the host); NaN (scale 255, payload 0x7F/0xFF) stays NaN.
  Same rule as :func:`mxcomm.mx.dequantize`.
* E4M3 rounding: ``INT_ROUND=True`` rounds with integer arithmetic (bit-exact everywhere, also
  under ``TRITON_INTERPRET=1`` whose float8 cast is not RNE); ``INT_ROUND=False`` uses the
  hardware ``cvt.rn.satfinite`` cast (GPU only; faster).

Payload bytes are handled as integers (int32 in registers, stored as uint8): store them into a
``float8_e4m3fn`` tensor viewed as ``torch.uint8``.
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from ..mx.scales import _INV_E4M3_MAX_F32, finite_max

#: Scale rule name -> ``MODE`` constexpr id used by the device functions.
SCALE_MODE_RCEIL = 0
SCALE_MODE_FLOOR = 1
SCALE_MODE_IDS = {"rceil": SCALE_MODE_RCEIL, "floor": SCALE_MODE_FLOOR}

#: fp32(1/448), exactly as the reference computes it (a Python float that is an exact fp32).
INV_E4M3_MAX: tl.constexpr = tl.constexpr(_INV_E4M3_MAX_F32)

#: Largest finite values (exact fp32 numbers), the ``OUT_MAX`` of :func:`mx_decode_tile` for each output dtype.
BF16_MAX: tl.constexpr = tl.constexpr(finite_max(torch.bfloat16))
FP16_MAX: tl.constexpr = tl.constexpr(finite_max(torch.float16))
FP32_MAX: tl.constexpr = tl.constexpr(finite_max(torch.float32))


def out_max(dtype: torch.dtype) -> float:
    """Host side: the ``OUT_MAX`` constexpr for values delivered as ``dtype`` (bf16 / fp16 / fp32)."""
    return finite_max(dtype)


@triton.jit
def mx_scale_bytes(amax, MODE: tl.constexpr):
    """E8M0 scale bytes from block maxima.

    Args:
        amax: fp32 tensor (any shape) of ``max |x|`` per block (>= 0); NaN or +Inf marks a bad block.
        MODE: 0 = rceil, 1 = floor (:data:`SCALE_MODE_IDS`).
    Returns:
        int32 tensor of the same shape with values 0..255 (255 for NaN/Inf amax).

    rceil in integer steps: for ``v = amax * fp32(1/448)`` (bits ``vb >= 0``) the rule's "exponent field, plus one if
    the mantissa is non-zero" is ``(vb + 0x7FFFFF) >> 23`` for a normal ``v``, and "plus one if the mantissa exceeds
    0x400000" is ``(vb + 0x3FFFFF) >> 23`` for a subnormal one (exponent field 0). Finite ``amax`` give at most 247,
    so the clamp to 254 never binds; it is kept as the spec states it.
    """
    abits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bad = abits >= 0x7F800000
    if MODE == 0:
        vb = (tl.where(bad, 0.0, amax) * INV_E4M3_MAX).to(tl.int32, bitcast=True)
        b = tl.minimum((vb + tl.where(vb < 0x800000, 0x3FFFFF, 0x7FFFFF)) >> 23, 254)
    else:
        b = tl.minimum(tl.maximum((abits >> 23) - 8, 0), 254)
    return tl.where(bad, 255, b)


@triton.jit
def mx_reciprocal(b):
    """fp32 ``2**(127 - b)`` for int32 E8M0 bytes ``b`` (bit-built, exact).

    b == 254 gives the fp32 subnormal 2**-127 (bits 0x00400000), b == 255 gives NaN.
    """
    bits = (254 - b) << 23
    bits = tl.where(b == 254, 0x00400000, bits)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mx_scale_value(b):
    """fp32 ``2**(b - 127)`` for int32 E8M0 bytes (exact); byte 0 -> 2**-127, byte 255 -> NaN."""
    bits = b << 23
    bits = tl.where(b == 0, 0x00400000, bits)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_rne_satfinite_int(v):
    """fp32 -> E4M3 byte by integer arithmetic: round-to-nearest-even, saturate to +-448.

    Handles normals, E4M3 subnormals (down to 2**-9, ties to even), signed zero, +-Inf
    (saturates to 0x7E/0xFE) and NaN (0x7F, sign kept). Bit-identical to
    ``torch.clamp(v, -448, 448).to(torch.float8_e4m3fn)``.

    Args:
        v: fp32 tensor, any shape.
    Returns:
        int32 tensor of bytes 0..255.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # 448.0: saturate (Inf included)
    # normal E4M3 (|v| >= 2**-6): drop 20 mantissa bits with RNE, rebias exponent 127 -> 7
    norm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal E4M3: value in units of 2**-9 is M * 2**(E - 141), E the fp32 exponent field
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    s = tl.maximum(tl.minimum(141 - e, 25), 21)  # shifts >= 25 round to 0 like 25 does
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    res = tl.where(a >= 0x3C800000, norm, sub)
    res = tl.where(is_nan, 0x7F, res)
    return res | sign


@triton.jit
def e4m3_byte(v, INT_ROUND: tl.constexpr):
    """fp32 -> E4M3 byte (uint8), RNE satfinite; integer path or hardware cast.

    The hardware path is one ``cvt.rn.satfinite.e4m3x2.f32`` per two values (Triton's fp32 -> float8e4nv cast on
    sm_89+), which saturates +-Inf and out-of-range values to +-448 itself; its bytes stay packed as the cast leaves
    them (no int32 round trip before a store). NaN input: the integer path gives 0x7F with the sign kept; the
    hardware cast gives a NaN byte (``byte & 0x7F == 0x7F``; which sign is the hardware's). Block quantization
    does not depend on it: a block holding a NaN gets scale 255 and payload 0x7F (:func:`mx_quantize_tile`)."""
    if INT_ROUND:
        q = e4m3_rne_satfinite_int(v).to(tl.uint8)
    else:
        q = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return q


@triton.jit
def e4m3_decode(q, INT_ROUND: tl.constexpr):
    """E4M3 bytes (any integer tensor, values 0..255) -> fp32 (exact; 0x7F/0xFF -> NaN)."""
    if INT_ROUND:
        u = q.to(tl.int32) & 0xFF
        e = (u >> 3) & 0xF
        m = u & 7
        mag = tl.where(e == 0, (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True),
                       ((e + 120) << 23) | (m << 20))
        mag = tl.where((u & 0x7F) == 0x7F, 0x7FC00000, mag)
        out = (mag | ((u & 0x80) << 24)).to(tl.float32, bitcast=True)
    else:
        out = q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return out


@triton.jit
def mx_saturate(v, OUT_MAX: tl.constexpr):
    """Clamp a float tile (fp32 or bf16) to +-``OUT_MAX``; NaN stays NaN (a comparison, not ``tl.minimum``, which
    may drop NaN). Applied to decoded MX values, whose exact products are finite: an fp32 +-Inf there is an
    overflow and becomes +-``OUT_MAX``."""
    lim = tl.where(v < 0, -OUT_MAX, OUT_MAX).to(v.dtype)
    return tl.where(tl.abs(v) > OUT_MAX, lim, v)


@triton.jit
def mx_decode_tile(q, b, INT_ROUND: tl.constexpr, OUT_MAX: tl.constexpr, AXIS: tl.constexpr = -1):
    """Decode MXFP8 bytes to fp32: ``e4m3(q) * 2**(b - 127)`` saturated to +-``OUT_MAX``.

    Args:
        q: E4M3 bytes (any integer tile, values 0..255), e.g. ``[BM, NB, 32]`` (``AXIS=2`` or -1) or ``[BR, 32, BK]``
           (``AXIS=1``): ``AXIS`` is the 32-value block axis.
        b: E8M0 scale bytes (any integer tile), ``q``'s shape without ``AXIS``.
        INT_ROUND: integer E4M3 decode (interpreter) or the hardware cast (:func:`e4m3_decode`).
        OUT_MAX: largest finite value of the dtype the values are delivered in (:data:`BF16_MAX`, ...).
    Returns:
        fp32 tile of ``q``'s shape: finite wherever ``q`` and ``b`` are finite bytes, NaN where ``b == 255`` or
        ``q & 0x7F == 0x7F``; bit for bit :func:`mxcomm.mx.dequantize` (before its cast to the output dtype).
    """
    v = e4m3_decode(q, INT_ROUND) * tl.expand_dims(mx_scale_value(b.to(tl.int32)), AXIS)
    return mx_saturate(v, OUT_MAX)


@triton.jit
def bf16_rne_int(v):
    """fp32 -> bfloat16 by integer RNE (NaN -> canonical quiet NaN with sign); for the interpreter,
    whose bf16 cast truncates."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    a = bits & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, 0x7F800000)
    r = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
    r = tl.where(is_nan, 0x7FC0, r) | sign
    return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_fp32(x, INT_ROUND: tl.constexpr):
    """Widen a float tile to fp32 exactly. With ``INT_ROUND`` bf16 is widened by a bit shift (the
    interpreter's bf16 -> fp32 cast flushes subnormals); otherwise the normal cast."""
    if INT_ROUND and x.dtype == tl.bfloat16:
        xf = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        xf = x.to(tl.float32)
    return xf


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax(xf, AXIS: tl.constexpr, INT_ROUND: tl.constexpr):
    """``max |x|`` along ``AXIS`` of an fp32 tile; a NaN anywhere in the block gives NaN.

    GPU (``INT_ROUND=False``): a NaN-propagating float max (``max.NaN.f32``, the absolute value folded into the
    instruction), one instruction per value. ``INT_ROUND`` (the interpreter, whose reductions with a custom combine
    fail on these tiles): the integer max of the magnitude bits, where NaN bits exceed Inf's, which exceed every
    finite value's - the same result.
    """
    if INT_ROUND:
        bits = tl.max(xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=AXIS)
        amax = bits.to(tl.float32, bitcast=True)
    else:
        amax = tl.reduce(tl.abs(xf), AXIS, _max_keep_nan)
    return amax


@triton.jit
def mx_quantize_tile(x, MODE: tl.constexpr, INT_ROUND: tl.constexpr, AXIS: tl.constexpr = -1):
    """Quantize a register tile whose ``AXIS`` dimension is one 32-value block.

    Args:
        x: tile of any float dtype, e.g. ``[BM, NB, 32]`` with ``AXIS=2`` (row-wise 1x32 blocks)
           or ``[BR, 32, BK]`` with ``AXIS=1`` (column-wise 32x1 blocks). Masked-out lanes must
           be loaded as 0 (an all-zero block gets scale 0, payload 0).
        MODE: 0 rceil, 1 floor.
        INT_ROUND: True = integer RNE and exact bf16 widening (bit-exact everywhere, also in the
            interpreter), False = hardware casts (GPU).
        AXIS: the block axis (size 32); default -1 (the last).
    Returns:
        ``(payload, scales)``: payload uint8 E4M3 bytes of ``x``'s shape; scales uint8 E8M0 bytes of
        ``x``'s shape without ``AXIS``. NaN/Inf blocks: scale 255, payload 0x7F.
    """
    xf = to_fp32(x, INT_ROUND)
    return mx_quantize_tile_amax(xf, block_amax(xf, AXIS, INT_ROUND), MODE, INT_ROUND, AXIS)


@triton.jit
def mx_quantize_tile_amax(xf, amax, MODE: tl.constexpr, INT_ROUND: tl.constexpr, AXIS: tl.constexpr = -1):
    """:func:`mx_quantize_tile` of the fp32 tile ``xf`` whose block maxima ``amax`` (``xf``'s shape without
    ``AXIS``; what :func:`block_amax` gives, NaN for a block holding NaN) the caller already has - e.g.
    ``|w| * block_amax(x)`` for ``xf = w * x`` with a finite scalar ``w``, equal to ``block_amax(xf)`` because
    rounding a product is monotone in its magnitude (``max_i RN(|w| |x_i|) = RN(|w| max_i |x_i|)``)."""
    b = mx_scale_bytes(amax, MODE)
    y = xf * tl.expand_dims(mx_reciprocal(b), AXIS)  # b == 255: the reciprocal is NaN, so is every y
    q = e4m3_byte(y, INT_ROUND)
    if INT_ROUND:  # NaN blocks: 0x7F whatever sign the NaN products carry
        q = tl.where(tl.expand_dims(b == 255, AXIS), 0x7F, q.to(tl.int32)).to(tl.uint8)
    # (hardware cast: a NaN block's y are the canonical NaN 0x7FFFFFFF that a product with a NaN operand gives,
    # which the cast turns into 0x7F - no select needed; the GPU tests check the bytes of NaN blocks)
    return q, b.to(tl.uint8)


@triton.jit
def mx_qdq_tile(x, MODE: tl.constexpr, INT_ROUND: tl.constexpr, AXIS: tl.constexpr = -1,
                OUT_MAX: tl.constexpr = BF16_MAX):
    """``dequantize(quantize(x))`` of a register tile as fp32, bit for bit what :func:`mx_decode_tile` of the bytes
    of :func:`mx_quantize_tile` would give, without building the bytes: on the GPU the scaled values go through the
    hardware E4M3 cast and straight back, and are multiplied by the block's scale (a NaN/Inf block gives NaN, as its
    0x7F payload and 255 scale decode to), then saturated to +-``OUT_MAX`` (default :data:`BF16_MAX`: values
    delivered to a bf16 consumer). For kernels that only need the values a MXFP8 transport would deliver
    (combine on one rank). ``INT_ROUND``: the exact integer path (quantize, then decode).

    Args/returns: as :func:`mx_quantize_tile`, but one fp32 tile of ``x``'s shape.
    """
    if INT_ROUND:
        q, b = mx_quantize_tile(x, MODE, INT_ROUND, AXIS)
        v = mx_decode_tile(q, b, INT_ROUND, OUT_MAX, AXIS)
    else:
        xf = to_fp32(x, INT_ROUND)
        b = mx_scale_bytes(block_amax(xf, AXIS, INT_ROUND), MODE)
        y = xf * tl.expand_dims(mx_reciprocal(b), AXIS)  # b == 255: NaN
        # the cast saturates (cvt.rn.satfinite): no clamp needed; a NaN block's scale below is NaN
        d = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
        v = mx_saturate(d * tl.expand_dims(mx_scale_value(b), AXIS), OUT_MAX)
    return v


@triton.jit
def store_block_bytes(ptr, v, mask, INT_ROUND: tl.constexpr):
    """Store the bytes ``v`` (e.g. the ``[NB]`` scale bytes :func:`mx_quantize_tile` returns, one per 32-value block)
    at ``ptr`` where ``mask``, in the layout the block reduction left them in. A plain ``tl.store`` of such a vector is
    first redistributed one byte per thread through shared memory (two barriers per store, which stall every warp of
    the program); here each thread that holds a byte stores it (threads holding the same byte store the same value).
    ``INT_ROUND`` (the interpreter, which runs no PTX): a plain ``tl.store``."""
    if INT_ROUND:
        tl.store(ptr, v, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p st.global.u8 [$1], $2; } mov.u32 $0, 0;",
            "=r,l,r,r", [ptr, v.to(tl.uint32), mask.to(tl.uint32)], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def load_block_bytes(ptr, mask, other, INT_ROUND: tl.constexpr):
    """Load bytes (e.g. the ``[NB]`` scale bytes of a row chunk) at ``ptr`` where ``mask`` (``other`` elsewhere, an
    int) as uint8, in the layout the pointers are in: each thread loads the bytes it holds (threads holding the same
    byte load it again, from L1). A plain ``tl.load`` of such a vector is given one byte per thread and then
    redistributed through shared memory (two barriers) into the layout a block-wise decode broadcasts from.
    Declared pure (a load the compiler may drop when unused, or merge): only for memory that no program of the same
    launch writes. ``INT_ROUND`` (the interpreter, which runs no PTX): a plain ``tl.load``."""
    if INT_ROUND:
        v = tl.load(ptr, mask=mask, other=other)
    else:
        v = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; mov.u32 $0, $3; @p ld.global.u8 $0, [$1]; }",
            "=r,l,r,r", [ptr, mask.to(tl.uint32), (mask.to(tl.uint32) * 0 + other).to(tl.uint32)], dtype=tl.uint32,
            is_pure=True, pack=1).to(tl.uint8)
    return v


@triton.jit
def blocked_scale_offset(r, c, n_col_tiles):
    """Flat byte offset of scale (row ``r``, block column ``c``) in a 128x4-blocked scale matrix
    (cuBLAS/CUTLASS SWIZZLE_32_4_4) with ``n_col_tiles`` 4-wide tiles per 128-row tile-row."""
    return ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@triton.jit
def grouped_padded_index(idx, ends_ptr, n_groups, ENDS_DIV: tl.constexpr, ALIGN: tl.constexpr,
                         G_POW2: tl.constexpr):
    """Index of ``idx`` in a concatenation of groups each padded to a multiple of ``ALIGN``.

    Groups are given by int32 end offsets ``ends_ptr[0:n_groups]`` (non-decreasing), divided by
    ``ENDS_DIV`` to get the units of ``idx`` (e.g. 32 for K-blocks from element offsets).
    Group g occupies ``[end[g-1], end[g])``; its padded start is ``sum_{h<g} round_up(n_h, ALIGN)``.
    Computed on device without a scan: ``idx + sum_{h: end[h] <= idx} pad_h``.

    Args:
        idx: 1D int tensor (int32/int64).
        G_POW2: power of two >= n_groups.
    Returns:
        same shape, int64; -1 where ``idx`` is past the last group.
    """
    g = tl.arange(0, G_POW2)
    gm = g < n_groups
    end = tl.load(ends_ptr + g, mask=gm, other=0) // ENDS_DIV
    start = tl.load(ends_ptr + g - 1, mask=gm & (g > 0), other=0) // ENDS_DIV
    size = end - start
    pad = tl.where(gm, (size + ALIGN - 1) // ALIGN * ALIGN - size, 0).to(tl.int64)
    i64 = idx.to(tl.int64)
    before = (end[None, :].to(tl.int64) <= i64[:, None]) & gm[None, :]
    shift = tl.sum(tl.where(before, pad[None, :], 0), axis=1)
    last = tl.load(ends_ptr + tl.maximum(n_groups - 1, 0), mask=n_groups > 0, other=0) // ENDS_DIV
    return tl.where(i64 < last, i64 + shift, -1)


@triton.jit
def grouped_k_placement(kb, ends_ptr, n_groups, G_POW2: tl.constexpr):
    """Where K-blocks ``kb`` (1D int tile) go in the grouped-along-K scale layout (:mod:`mxcomm.mx.layouts`), on
    device without a scan over a host copy: groups by int32 element end offsets ``ends_ptr[0:n_groups]``
    (non-decreasing, multiples of 32), ``n_g = K_g / 32`` blocks, width ``C_g = round_up(n_g, 4)``.

    Returns:
        ``(col0, j, width)`` int64 of ``kb``'s shape: the group's first padded column ``sum_{h<g} C_h``, the block's
        column inside its group, and ``C_g``; all -1 for blocks past the last group. Same as
        :func:`mxcomm.mx.layouts.grouped_k_placement`.
    """
    g = tl.arange(0, G_POW2)
    gm = g < n_groups
    end = (tl.load(ends_ptr + g, mask=gm, other=0) // 32).to(tl.int64)
    start = (tl.load(ends_ptr + g - 1, mask=gm & (g > 0), other=0) // 32).to(tl.int64)
    width = tl.where(gm, (end - start + 3) // 4 * 4, 0)
    col0 = tl.cumsum(width, 0) - width
    k64 = kb.to(tl.int64)
    inside = (start[None, :] <= k64[:, None]) & (k64[:, None] < end[None, :]) & gm[None, :]  # one group at most
    hit = tl.sum(inside.to(tl.int32), axis=1) > 0
    c0 = tl.sum(tl.where(inside, col0[None, :], 0), axis=1)
    st = tl.sum(tl.where(inside, start[None, :], 0), axis=1)
    w = tl.sum(tl.where(inside, width[None, :], 0), axis=1)
    return tl.where(hit, c0, -1), tl.where(hit, k64 - st, -1), tl.where(hit, w, -1)


@triton.jit
def grouped_k_scale_offset(r, kb, ends_ptr, n_groups, n_rows, G_POW2: tl.constexpr):
    """Flat byte offsets of scale-matrix entries ``(r, kb)`` in the grouped-along-K layout of an ``n_rows``-row scale
    matrix: ``round_up(n_rows, 128) * col0 + blocked_scale_offset(r, j, C_g / 4)`` (group g's own blocked matrix).

    Args:
        r: row indices, a ``[1, BC]`` tile; kb: K-block indices, 1D ``[BR]``; ends_ptr / n_groups / G_POW2: as in
            :func:`grouped_k_placement`.
    Returns:
        ``(offsets [BR, BC] int64, valid [BR])``; ``valid`` is False for blocks past the last group.
    """
    col0, j, width = grouped_k_placement(kb, ends_ptr, n_groups, G_POW2)
    rp = ((n_rows + 127) // 128 * 128).to(tl.int64)
    off = rp * col0[:, None] + blocked_scale_offset(r.to(tl.int64), j[:, None], tl.maximum(width, 0)[:, None] // 4)
    return off, width >= 0
