"""The MX tensor value type: E4M3 payload + E8M0 scales + which axis and which scale layout, and the reference
dequantize.

Dequantize rule (every decoder in mxcomm follows it: this reference, the Triton dequantize kernels, the decode in
the grouped GEMMs and in the EP combine): ``value = e4m3(q) * 2**(b - 127)`` computed in fp32, then **saturated**:
a value whose magnitude exceeds the largest finite value of the output dtype (bf16 3.3895314e38, fp16 65504,
fp32 3.4028235e38) becomes +-that value, so a finite input stays finite through quantize -> dequantize (rceil
rounds a block max near 2**128 to payload 256 at scale 2**120, whose product 2**128 overflows every dtype).
NaN stays NaN: a block with scale byte 0xFF (a NaN/Inf input block) and payload bytes 0x7F/0xFF decode to NaN.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional

import torch

from . import layouts
from .scales import BLOCK, E4M3_NAN_BYTE, E8M0_NAN, finite_max, saturate_finite, scale_value


class ScaleLayout(str, enum.Enum):
    """How ``MXTensor.scales`` is stored.

    ROW: same shape as ``qdata`` with the quantized axis divided by 32.
    BLOCKED: one 128x4-swizzled matrix (see :mod:`mxcomm.mx.layouts`).
    GROUPED_M: per-group blocked along rows (``group_offs`` = int32 row end offsets).
    GROUPED_K: per-group blocked along the quantized axis (``group_offs`` = element end offsets).
    """

    ROW = "row"
    BLOCKED = "blocked"
    GROUPED_M = "grouped_m"
    GROUPED_K = "grouped_k"


@dataclass(frozen=True)
class MXTensor:
    """An MXFP8 tensor.

    Attributes:
        qdata: ``torch.float8_e4m3fn``, same shape as the original tensor.
        scales: ``torch.uint8`` E8M0 bytes in ``layout``. For ROW, shape is ``qdata``'s with
            ``axis`` divided by 32. Blocked layouts are 2D ``[rows_padded, cols_padded]`` of the
            scale matrix with the quantized axis last (for axis 0: the transpose).
        axis: the quantized axis (non-negative).
        layout: a :class:`ScaleLayout`.
        mode: scale rule used, ``"rceil"`` or ``"floor"``.
        orig_dtype: dtype of the tensor that was quantized (default dequantize dtype).
        group_offs: int32 group end offsets for grouped layouts, else None.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    axis: int = 1
    layout: ScaleLayout = ScaleLayout.ROW
    mode: str = "rceil"
    orig_dtype: torch.dtype = torch.bfloat16
    group_offs: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    def nbytes(self) -> int:
        return self.qdata.numel() + self.scales.numel()

    def row_scales(self) -> torch.Tensor:
        """Scales in ROW layout (uint8, ``qdata`` shape with ``axis`` divided by 32)."""
        s = self.scales.view(torch.uint8)
        if self.layout == ScaleLayout.ROW:
            return s
        if self.qdata.dim() != 2:
            raise ValueError("blocked scale layouts are defined for 2D tensors only")
        rows = self.qdata.shape[1 - self.axis]
        kb = self.qdata.shape[self.axis] // BLOCK
        if self.layout == ScaleLayout.BLOCKED:
            mat = layouts.from_blocked(s, rows, kb)
        elif self.layout == ScaleLayout.GROUPED_M:
            mat = layouts.from_grouped_m(s, self.group_offs, rows, kb)
        elif self.layout == ScaleLayout.GROUPED_K:
            mat = layouts.from_grouped_k(s, self.group_offs, rows, kb)
        else:  # pragma: no cover - enum is closed
            raise ValueError(f"unknown layout {self.layout}")
        return mat if self.axis == 1 else mat.t().contiguous()

    def with_layout(self, layout: ScaleLayout | str, group_offs: Optional[torch.Tensor] = None) -> "MXTensor":
        """The same values with scales re-laid out (reference implementation, plain torch)."""
        layout = ScaleLayout(layout)
        row = self.row_scales()
        if layout == ScaleLayout.ROW:
            return replace(self, scales=row, layout=layout, group_offs=None)
        if self.qdata.dim() != 2:
            raise ValueError("blocked scale layouts are defined for 2D tensors only")
        mat = row if self.axis == 1 else row.t()
        if layout == ScaleLayout.BLOCKED:
            return replace(self, scales=layouts.to_blocked(mat), layout=layout, group_offs=None)
        if group_offs is None:
            raise ValueError(f"layout {layout.value} needs group_offs (int32 group end offsets)")
        if layout == ScaleLayout.GROUPED_M:
            s = layouts.to_grouped_m(mat, group_offs)
        else:
            s = layouts.to_grouped_k(mat, group_offs)
        return replace(self, scales=s, layout=layout, group_offs=group_offs)

    def dequantize(self, dtype: Optional[torch.dtype] = None, *,
                   saturate_to: Optional[torch.dtype] = None) -> torch.Tensor:
        return dequantize(self, dtype, saturate_to=saturate_to)


def dequantize(mx: MXTensor, dtype: Optional[torch.dtype] = torch.bfloat16, *,
               saturate_to: Optional[torch.dtype] = None) -> torch.Tensor:
    """MXTensor -> dense tensor ``qdata * 2**(scale-127)`` computed in fp32, saturated, cast to ``dtype``.

    Args:
        mx: any layout; the result has ``mx.shape``.
        dtype: bfloat16 / float16 / float32 output; ``None`` uses ``mx.orig_dtype``.
        saturate_to: the dtype whose largest finite value bounds the magnitudes (default ``dtype``); e.g.
            ``dequantize(m, torch.float32, saturate_to=torch.bfloat16)`` gives the fp32 values a kernel that sums
            decoded bf16-origin rows in fp32 uses. Must not exceed ``dtype``'s range.
    Returns:
        ``dtype`` tensor; finite wherever the block is finite (see the module doc), NaN in blocks with scale
        byte 255 and at payload bytes 0x7F/0xFF.
    """
    dtype = dtype or mx.orig_dtype
    sat = saturate_to or dtype
    if finite_max(sat) > finite_max(dtype):
        raise ValueError(f"saturate_to={sat} has a larger range than the output dtype {dtype}")
    s = scale_value(mx.row_scales())
    q = mx.qdata.to(torch.float32)
    axis = mx.axis
    qv = q.movedim(axis, -1)
    shp = qv.shape
    out = qv.reshape(*shp[:-1], shp[-1] // BLOCK, BLOCK) * s.movedim(axis, -1).unsqueeze(-1)
    return saturate_finite(out, sat).reshape(shp).movedim(-1, axis).to(dtype)


__all__ = ["MXTensor", "ScaleLayout", "dequantize", "E4M3_NAN_BYTE", "E8M0_NAN"]
