"""Grouped SwiGLU experts on expert-major rows, BF16 or MXFP8, with autograd.

``y[rows of e] = swiglu(a[rows of e] @ w13[e]^T) @ w2[e]^T`` for every local expert ``e``, rows grouped by
``offs`` (int32 END offsets, as returned by :meth:`mxcomm.ep.EPGroup.dispatch`).

Weights (fp32 masters, the orientation :mod:`mxcomm.gemm` reads, ``y_g = a_g @ W_g^T``):

* ``w13`` ``[E_local, 2F, H]``: rows ``[0, F)`` are the gate projection, rows ``[F, 2F)`` the up projection
  (``gu = a @ w13^T`` has gate in columns ``[0, F)``, up in ``[F, 2F)``: Megatron's fused ``linear_fc1``
  order, ``cat([w1, w3], dim=1)`` of torchtitan's ``w1`` / ``w3``);
* ``w2`` ``[E_local, H, F]`` (down projection).

Precision paths:

* ``"bf16"``: ``a`` BF16 (dense), BF16 grouped GEMMs (:func:`mxcomm.gemm.grouped_mm_bf16`) on the weights'
  :class:`mxcomm.gemm.weights.BF16WeightCache` copies when given, else on the masters cast per call (the same
  bits), ``h = bf16(silu(gate.float()) * up.float())`` in plain torch, BF16 dgrad, fp32 wgrad.
* ``"mxfp8"``: ``a`` MXFP8 (the dispatch output, an :class:`mxcomm.mx.subclass.MXFP8Tensor` with GROUPED_M
  scales; a dense input is quantized), MXFP8 grouped GEMMs against :class:`mxcomm.gemm.MXWeightCache`
  copies, fused SwiGLU + quantize (:func:`swiglu_mx`) whose MXFP8 output feeds the down projection
  directly, MXFP8 dgrad (``quantize(grad_y) @ W``), wgrad from the dequantized MX operands in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import mx
from ..gemm import GroupedLinearConfig, MXWeightCache, grouped_linear
from ..gemm.weights import BF16WeightCache
from ..mx import MXTensor
from ..mx.subclass import MXFP8Tensor, unwrap_mx


# ----------------------------------------------------------------------------------------------
# SwiGLU (+ quantize)
# ----------------------------------------------------------------------------------------------
def swiglu_bf16(gu: torch.Tensor) -> torch.Tensor:
    """``h = bf16(silu(gate.float()) * up.float())`` for ``gu = [gate | up]`` ``[M, 2F]`` (plain torch, autograd).

    The formula of :func:`mxcomm.kernels.swiglu.swiglu_reference`, differentiable."""
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g.float()) * u.float()).to(torch.bfloat16)


def _use_kernel(gu: torch.Tensor, impl: str) -> bool:
    if impl == "reference":
        return False
    if impl == "auto":
        return gu.device.type == "cuda"
    # "kernel": a CUDA tensor, or a CPU tensor with the kernels built for Triton's interpreter
    from ..kernels.swiglu import interpret_mode

    if gu.device.type != "cuda" and not interpret_mode():
        raise RuntimeError("swiglu_impl='kernel' needs a CUDA tensor, or TRITON_INTERPRET=1 set before mxcomm.kernels "
                           "is imported for CPU tensors; use swiglu_impl='auto' or 'reference'")
    return True


def _swiglu_quantize_ref(gu: torch.Tensor, offs: torch.Tensor, mode: str) -> MXTensor:
    """Reference of the fused kernel: :func:`swiglu_reference` then :func:`mxcomm.mx.quantize` (grouped_m)."""
    from ..kernels.swiglu import swiglu_reference

    return mx.quantize(swiglu_reference(gu), mode=mode, layout="grouped_m", group_offs=offs)


def _swiglu_backward_ref(grad_h: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """Autograd of the reference formula (fp32 math, straight-through the bf16 rounding and the quantize)."""
    with torch.enable_grad():
        g32 = gu.detach().float().requires_grad_()
        g, u = g32.chunk(2, dim=-1)
        h = F.silu(g) * u
        (d,) = torch.autograd.grad(h, g32, grad_h.float())
    return d.to(gu.dtype)


class _SwigluQuantize(torch.autograd.Function):
    """``gu [M, 2F]`` bf16 -> MXFP8Tensor ``[M, F]`` (GROUPED_M scales on ``offs``); backward -> ``grad_gu``."""

    @staticmethod
    def forward(ctx, gu, offs, mode: str, impl: str):
        kernel = _use_kernel(gu, impl)
        if kernel:
            from ..kernels.swiglu import swiglu_quantize

            m = swiglu_quantize(gu, mode=mode, layout="grouped_m", group_offs=offs)
        else:
            m = _swiglu_quantize_ref(gu, offs, mode)
        ctx.kernel = kernel
        ctx.save_for_backward(gu)
        return MXFP8Tensor(m, dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_h):
        (gu,) = ctx.saved_tensors
        if grad_h is None:
            return None, None, None, None
        g = unwrap_mx(grad_h)
        if isinstance(g, MXTensor):
            g = g.dequantize(torch.bfloat16) if g.qdata.device.type == "cpu" else _dequant_cuda(g)
        if ctx.kernel:
            from ..kernels.swiglu import swiglu_backward

            return swiglu_backward(g, gu), None, None, None
        return _swiglu_backward_ref(g, gu), None, None, None


def _dequant_cuda(m: MXTensor) -> torch.Tensor:
    from ..kernels import dequantize

    return dequantize(m, torch.bfloat16)


def swiglu_mx(gu: torch.Tensor, offs: torch.Tensor, *, mode: str = "rceil", impl: str = "auto") -> MXFP8Tensor:
    """Fused SwiGLU + MXFP8 quantize with autograd.

    Args:
        gu: bfloat16 ``[M, 2F]`` = gate | up (the up/gate GEMM output), expert-major rows.
        offs: int32 ``[G]`` row-group END offsets (the scales are laid out GROUPED_M on them, ready for the
            down-projection grouped GEMM).
        mode: MX scale rule. impl: ``"auto"`` | ``"kernel"`` | ``"reference"`` (see :class:`MoEConfig`).
    Returns:
        :class:`MXFP8Tensor` ``[M, F]`` (logical bfloat16) of ``quantize(bf16(silu(gate) * up))``; its gradient
        (dense bf16 or MX) gives ``grad_gu`` (straight-through the rounding and quantize).
    """
    return _SwigluQuantize.apply(gu, offs, mode, impl)


# ----------------------------------------------------------------------------------------------
# the expert MLP
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertOptions:
    """How :func:`grouped_swiglu` computes (derived from :class:`MoEConfig`).

    Attributes:
        precision: ``"bf16"`` or ``"mxfp8"``.
        scale_mode: MX scale rule.
        swiglu_impl: ``"auto"`` | ``"kernel"`` | ``"reference"``.
        gemm: :class:`mxcomm.gemm.GroupedLinearConfig` of both projections.
    """

    precision: str
    scale_mode: str = "rceil"
    swiglu_impl: str = "auto"
    gemm: GroupedLinearConfig = GroupedLinearConfig()


def _empty_rows(a, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``[0, H]`` bf16 output for zero rows, still attached to ``a`` and the weights (zero gradients), so that the
    dispatch backward - a collective - runs on this rank too. The GEMMs are skipped: some grouped-GEMM paths
    reject empty operands (e.g. ``torch._grouped_mm`` on the zero-stride gradient of an empty tensor)."""
    dense = a.dequantize(torch.bfloat16) if isinstance(a, MXFP8Tensor) else a
    link = (dense.float().sum() + w13.sum() + w2.sum()) * 0.0
    return torch.zeros(0, w2.shape[1], dtype=torch.bfloat16, device=w2.device) + link.to(torch.bfloat16)


def grouped_swiglu(
    a: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, opts: ExpertOptions, *,
    cache13: Optional[MXWeightCache | BF16WeightCache] = None,
    cache2: Optional[MXWeightCache | BF16WeightCache] = None,
) -> torch.Tensor:
    """SwiGLU experts on expert-major rows (see the module docstring).

    Args:
        a: ``[M, H]`` rows: an MXFP8Tensor (mxfp8 path; dense rows are quantized there) or bfloat16 (bf16 path).
        offs: int32 ``[G]`` END offsets of the ``G = w13.shape[0]`` groups; rows past ``offs[-1]`` give zeros.
        w13: ``[G, 2F, H]`` master (gate rows then up rows). w2: ``[G, H, F]`` master.
        opts: :class:`ExpertOptions`.
        cache13 / cache2: the :class:`MXWeightCache` of ``w13`` / ``w2`` (required for ``"mxfp8"``); for
            ``"bf16"`` optional :class:`~mxcomm.gemm.weights.BF16WeightCache` copies (None = cast per call).
    Returns:
        bfloat16 ``[M, H]`` (differentiable w.r.t. ``a``, ``w13``, ``w2``). ``M == 0``: an empty output still
        attached to ``a`` and the weights (their gradients are zero), no GEMM launched.
    """
    if a.shape[0] == 0:
        return _empty_rows(a, w13, w2)
    if opts.precision == "mxfp8":
        if not isinstance(cache13, MXWeightCache) or not isinstance(cache2, MXWeightCache):
            raise ValueError("grouped_swiglu: the mxfp8 path needs the MXWeightCache of w13 and w2")
        gu = grouped_linear(a, w13, offs, cache13, opts.gemm)
        h = swiglu_mx(gu, offs, mode=opts.scale_mode, impl=opts.swiglu_impl)
        return grouped_linear(h, w2, offs, cache2, opts.gemm)
    for c in (cache13, cache2):
        if c is not None and not isinstance(c, BF16WeightCache):
            raise TypeError(f"grouped_swiglu: the bf16 path takes BF16WeightCache copies (or None), got "
                            f"{type(c).__name__}")
    if isinstance(a, MXFP8Tensor):
        a = a.dequantize(torch.bfloat16)
    gu = grouped_linear(a.to(torch.bfloat16), w13, offs, cache13, opts.gemm)
    return grouped_linear(swiglu_bf16(gu), w2, offs, cache2, opts.gemm)


__all__ = ["swiglu_bf16", "swiglu_mx", "grouped_swiglu", "ExpertOptions"]
