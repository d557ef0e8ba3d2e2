"""THE reference MXFP8 quantizer (plain torch; CPU and GPU; bit-exact to the rules in scales.py).

Tests compare every fast path against this, and the CPU backend uses it directly.
"""
from __future__ import annotations

from typing import Optional

import torch

from .scales import (
    BLOCK,
    E4M3_NAN_BYTE,
    E8M0_NAN,
    SUPPORTED_DTYPES,
    check_mode,
    e4m3_rne_satfinite,
    scale_bytes_from_amax,
    scale_reciprocal,
)
from .tensor import MXTensor, ScaleLayout


def check_quantizable(x: torch.Tensor, axis: int) -> int:
    """Validate ``x`` for MX quantization along ``axis``; returns the normalized axis.

    Raises TypeError for unsupported dtypes and ValueError for a bad axis or a quantized
    axis whose size is not a multiple of 32.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"MXFP8 quantize supports bfloat16, float16 and float32 input, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a {x.dim()}-D tensor")
    axis = axis % x.dim()
    if x.shape[axis] % BLOCK:
        raise ValueError(
            f"the quantized axis (axis {axis}) has size {x.shape[axis]}, which is not a multiple of {BLOCK}"
        )
    return axis


def quantize(
    x: torch.Tensor,
    *,
    mode: str = "rceil",
    axis: int = -1,
    layout: ScaleLayout | str = ScaleLayout.ROW,
    group_offs: Optional[torch.Tensor] = None,
) -> MXTensor:
    """Quantize ``x`` to MXFP8 with 32-element blocks along ``axis`` (plain torch reference).

    Args:
        x: bf16 / fp16 / fp32 tensor, any device; ``x.shape[axis] % 32 == 0``.
        mode: ``"rceil"`` (default) or ``"floor"`` scale rule.
        axis: quantized axis (the GEMM reduction axis). ``-1`` = row-wise (1x32 blocks);
            ``0`` on a 2D tensor = column-wise (32x1 blocks, the wgrad operand).
        layout: scale layout of the result (``"row"``, ``"blocked"``, ``"grouped_m"``,
            ``"grouped_k"``); blocked layouts need a 2D ``x``, grouped ones ``group_offs``.
        group_offs: int32 group end offsets for the grouped layouts.
    Returns:
        :class:`MXTensor` with ``qdata`` float8_e4m3fn of ``x.shape`` and uint8 scales.
    """
    axis = check_quantizable(x, axis)
    check_mode(mode)
    xv = x.movedim(axis, -1)
    shp = xv.shape
    blocks = xv.reshape(*shp[:-1], shp[-1] // BLOCK, BLOCK).to(torch.float32)
    absb = blocks.abs()
    # NaN must poison the block: map NaN to +Inf before the max (max may drop NaN).
    absb = torch.where(torch.isnan(absb), torch.full_like(absb, float("inf")), absb)
    if blocks.numel():
        amax = absb.amax(dim=-1)
    else:
        amax = torch.zeros(blocks.shape[:-1], dtype=torch.float32, device=x.device)
    b = scale_bytes_from_amax(amax, mode)
    q = e4m3_rne_satfinite(blocks * scale_reciprocal(b).unsqueeze(-1))
    qb = q.view(torch.uint8)
    qb = torch.where((b == E8M0_NAN).unsqueeze(-1), torch.full_like(qb, E4M3_NAN_BYTE), qb)
    qdata = qb.view(torch.float8_e4m3fn).reshape(shp).movedim(-1, axis).contiguous()
    scales = b.movedim(-1, axis).contiguous() if b.dim() else b
    mx = MXTensor(qdata=qdata, scales=scales, axis=axis, layout=ScaleLayout.ROW, mode=mode, orig_dtype=x.dtype)
    layout = ScaleLayout(layout)
    if layout != ScaleLayout.ROW:
        mx = mx.with_layout(layout, group_offs)
    return mx
