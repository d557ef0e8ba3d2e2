"""The dense value of a dispatch output as a ``torch.library`` custom op (``mxcomm_ep::dense``), so that it traces
under ``torch.compile``: an :class:`MXFP8Tensor` with GROUPED_M scales is dequantized with a mask-free gather
(static shapes), a plain tensor is cast. Differentiable: the gradient passes straight through, as
``MXFP8Tensor.dequantize``. Used by ``Dispatched.dense()`` while compiling, and by the compiled steps
(:mod:`mxcomm.ep.compiled`).
"""
from __future__ import annotations

import torch

from ..mx import ScaleLayout
from ..mx.layouts import blocked_index, grouped_m_row_map
from ..mx.scales import BLOCK, saturate_finite, scale_value
from ..mx.subclass import MXFP8Tensor


def grouped_m_dequantize(qdata: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[R, H]`` of an axis-1 MX value with GROUPED_M scales, without boolean-mask indexing
    (so it traces with static shapes). Rows past ``offs[-1]`` get scale byte 0 (value 0 for zero payload),
    as :func:`mxcomm.mx.layouts.from_grouped_m` gives them."""
    R, H = qdata.shape
    kb = H // BLOCK
    row_of = grouped_m_row_map(offs, R)
    keep = row_of >= 0
    rr = torch.clamp(row_of, min=0).view(R, 1).expand(R, kb)
    cc = torch.arange(kb, device=qdata.device, dtype=torch.int64).view(1, kb).expand(R, kb)
    flat = scales.view(torch.uint8).reshape(-1)
    s = flat[blocked_index(rr, cc, scales.shape[-1] // 4).reshape(-1)].view(R, kb)
    s = torch.where(keep.view(R, 1), s, torch.zeros_like(s))
    vals = qdata.to(torch.float32).view(R, kb, BLOCK) * scale_value(s).unsqueeze(-1)
    return saturate_finite(vals.view(R, H), dtype).to(dtype)  # a finite MX value stays finite (mxcomm.mx.tensor)


@torch.library.custom_op("mxcomm_ep::dense", mutates_args=())
def _dense_impl(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)
    return y.clone() if y is x else y  # an op's output must not alias its input


@_dense_impl.register_fake
def _dense_fake(x, dtype):
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.register_torch_dispatch("mxcomm_ep::dense", MXFP8Tensor)
def _dense_of_mx(mode, func, types, args, kwargs):
    t, dtype = args
    if t.scale_layout == ScaleLayout.GROUPED_M and t.axis == 1:
        return grouped_m_dequantize(t.qdata, t.scales, t.group_offs, dtype)
    return t.mx.dequantize(dtype)


def _dense_setup(ctx, inputs, output):
    ctx.in_dtype = inputs[0].dtype


def _dense_backward(ctx, grad):
    return grad.to(ctx.in_dtype), None


_dense_impl.register_autograd(_dense_backward, setup_context=_dense_setup)


def dense(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense ``dtype`` value of ``x`` (an :class:`MXFP8Tensor` or a plain tensor); differentiable,
    traceable by torch.compile (custom op ``mxcomm_ep::dense``)."""
    return torch.ops.mxcomm_ep.dense(x, dtype)


__all__ = ["dense", "grouped_m_dequantize"]
