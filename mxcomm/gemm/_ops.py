"""Quantize / dequantize on whichever device the tensor lives: Triton kernels on CUDA, the plain-torch
reference (:mod:`mxcomm.mx`, bit-identical by contract) on CPU. Also input validation shared by the GEMMs."""
from __future__ import annotations

from typing import Optional

import torch

from .. import mx
from ..mx import MXTensor, ScaleLayout


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def quantize_rows(x: torch.Tensor, *, mode: str = "rceil", layout: str | ScaleLayout = "row",
                  group_offs: Optional[torch.Tensor] = None) -> MXTensor:
    """1x32 blocks along the last axis; layouts row / blocked / grouped_m (Triton on CUDA, reference on CPU)."""
    if is_cuda(x):
        from ..kernels import quantize_rows as q

        return q(x, mode=mode, layout=layout, group_offs=group_offs)
    return mx.quantize(x, mode=mode, axis=-1, layout=layout, group_offs=group_offs)


def quantize_cols(x: torch.Tensor, *, mode: str = "rceil") -> MXTensor:
    """32x1 blocks along axis 0 of a 2D tensor, row-layout scales ``[M/32, K]``."""
    if is_cuda(x):
        from ..kernels import quantize_cols as q

        return q(x, mode=mode, layout="row")
    return mx.quantize(x, mode=mode, axis=0)


def dequantize(m: MXTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXTensor -> dense ``dtype`` (Triton kernel on CUDA, reference on CPU)."""
    if is_cuda(m.qdata):
        from ..kernels import dequantize as d

        return d(m, dtype)
    return mx.dequantize(m, dtype)


def check_offs(offs, groups: int, device: torch.device, fn: str) -> torch.Tensor:
    """Validate int32 group END offsets ``[G]``; returns them as contiguous int32 (no host sync: the values,
    non-decreasing and ``<= M_total``, are the caller's contract; on CPU they are checked)."""
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{fn}: offs must be a torch.Tensor of int32 group end offsets, got {type(offs).__name__}")
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: offs must be a 1D int32 tensor of group end offsets, got {offs.dtype} "
                        f"{tuple(offs.shape)}")
    if offs.numel() != groups:
        raise ValueError(f"{fn}: offs has {offs.numel()} groups but the weights have {groups}")
    if offs.device != torch.device(device):
        raise ValueError(f"{fn}: offs is on {offs.device} but the operands are on {device}")
    return offs.to(torch.int32).contiguous()


def check_offs_values(offs: torch.Tensor, m_total: int, fn: str) -> None:
    """Host-side check of offset values (CPU tensors only; on CUDA it would sync)."""
    if offs.device.type != "cpu" or offs.numel() == 0:
        return
    o = offs.to(torch.int64)
    if bool((o[1:] < o[:-1]).any()) or int(o[0]) < 0 or int(o[-1]) > m_total:
        raise ValueError(f"{fn}: offs must be non-decreasing end offsets in [0, {m_total}], got {o.tolist()}")


def as_mx(a) -> Optional[MXTensor]:
    """The MXTensor behind ``a`` (an MXTensor, or any object with an ``.mx`` MXTensor attribute such as an
    autograd-aware MX tensor subclass); None for a plain dense tensor."""
    if isinstance(a, MXTensor):
        return a
    inner = getattr(a, "mx", None)
    if isinstance(inner, MXTensor):
        return inner
    return None
