"""Autograd for the expert projection ``y[rows of g] = a[rows of g] @ W_g^T``.

MXFP8 path (an :class:`~mxcomm.gemm.weights.MXWeightCache` is given):

* forward: ``a`` as MXFP8 (an MXTensor, an object with an ``.mx`` MXTensor - e.g. the autograd-aware MX
  tensor subclass of the dispatch output - or a dense tensor quantized here, 1x32 blocks along K, grouped_m
  scales) times the cache's forward copy;
* dgrad: ``grad_a = quantize(grad_y) @ W_g`` - ``grad_y`` quantized row-wise (1x32 along N, grouped_m
  scales) times the cache's dgrad copy (W quantized along N, stored ``[G, K, N]``), the cache generation
  checked against the forward's (weights changed between forward and backward -> error);
  ``quantize_dgrad=False`` uses BF16 ``grad_y`` and the dequantized dgrad copy instead;
* wgrad: ``dW_g = grad_y_g^T @ deq(a_g)`` in a BF16 grouped GEMM (fp32 accumulation), returned in the master's
  dtype (fp32): the gradient of the function the forward computed (its MX input, dequantized), not of the
  unquantized activation. The MX input is what is saved for backward (33/32 bytes per value).

BF16 path (``cache=None`` or a :class:`~mxcomm.gemm.weights.BF16WeightCache`): ``a`` (dequantized if MX) times
``W`` in BF16; BF16 dgrad, the same wgrad. Without a cache the fp32 master is cast to BF16 in the forward and
again in the backward; with a :class:`~mxcomm.gemm.weights.BF16WeightCache` both read the cache's copy (the same
bits: ``master.to(torch.bfloat16)`` at the last refresh), the backward checking the cache generation of its
forward (weights changed between forward and backward -> error). Either way the wgrad goes to the master, in its
dtype.

The gradient for ``a`` is a dense tensor in ``a``'s dtype (BF16 for MX inputs that are tensors); a plain
MXTensor input (not a tensor) gets no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..mx import MXTensor, ScaleLayout
from . import _ops
from .backend import GemmBackend
from .grouped import bf16_grouped_2d3d, grouped_mm, grouped_mm_bf16, grouped_wgrad
from .triton_gemm import GroupedGemmConfig
from .weights import BF16WeightCache, MXWeightCache


@dataclass(frozen=True)
class GroupedLinearConfig:
    """Options of :class:`MXGroupedLinear`.

    Attributes:
        backend: forward/dgrad GEMM backend (None = auto, see :func:`~mxcomm.gemm.backend.select_backend`).
        mode: scale rule for tensors quantized here (dense ``a``, ``grad_y``).
        quantize_dgrad: quantize ``grad_y`` to MXFP8 for dgrad (MX path only).
        wgrad_backend: backend of :func:`~mxcomm.gemm.grouped.grouped_wgrad` (None = auto).
        gemm_config: tiles for the ``triton`` backend.
    """

    backend: Optional[str] = None
    mode: str = "rceil"
    quantize_dgrad: bool = True
    wgrad_backend: Optional[str] = None
    gemm_config: Optional[GroupedGemmConfig] = None

    def __post_init__(self):
        if self.backend is not None:
            GemmBackend(self.backend)
        if self.wgrad_backend is not None:
            GemmBackend(self.wgrad_backend)


def _save_mx(ctx, m: MXTensor, offs: torch.Tensor) -> None:
    extra = (m.group_offs,) if m.group_offs is not None else ()
    ctx.save_for_backward(m.qdata, m.scales, offs, *extra)
    ctx.mx_meta = (m.axis, m.layout, m.mode, m.orig_dtype, bool(extra))


def _load_mx(ctx):
    saved = ctx.saved_tensors
    axis, layout, mode, orig_dtype, has_offs = ctx.mx_meta
    m = MXTensor(qdata=saved[0], scales=saved[1], axis=axis, layout=layout, mode=mode, orig_dtype=orig_dtype,
                 group_offs=saved[3] if has_offs else None)
    return m, saved[2]


class MXGroupedLinear(torch.autograd.Function):
    """``y = grouped(a @ W^T)``; see the module docstring. Use via :func:`grouped_linear`.

    ``apply(a, weight, offs, cache, config)``:
        a: ``[M_total, K]`` dense tensor, MXTensor, or object/tensor with an ``.mx`` MXTensor.
        weight: master ``[G, N, K]`` (the Parameter; receives the wgrad in its dtype).
        offs: ``[G]`` int32 group end offsets.
        cache: :class:`MXWeightCache` of ``weight`` (MXFP8 path), :class:`BF16WeightCache` of ``weight`` (BF16
            path on the cached copy) or None (BF16 path, master cast per call).
        config: :class:`GroupedLinearConfig`.
    Returns BF16 ``[M_total, N]`` (rows past ``offs[-1]`` zero).
    """

    @staticmethod
    def forward(ctx, a, weight, offs, cache, config: GroupedLinearConfig):
        fn = "MXGroupedLinear"
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise TypeError(f"{fn}: weight must be the [G, N, K] master tensor")
        if cache is not None and not isinstance(cache, (MXWeightCache, BF16WeightCache)):
            raise TypeError(f"{fn}: cache must be an MXWeightCache, a BF16WeightCache or None, got "
                            f"{type(cache).__name__}")
        if cache is not None and cache.master is not weight:
            raise ValueError(f"{fn}: the {type(cache).__name__} was built for another master tensor")
        mxa = _ops.as_mx(a)
        ctx.use_mx = isinstance(cache, MXWeightCache)
        ctx.bf16_cache = cache if isinstance(cache, BF16WeightCache) else None
        ctx.weight_dtype = weight.dtype
        ctx.config = config
        ctx.a_dtype = a.dtype if isinstance(a, torch.Tensor) and mxa is None else torch.bfloat16
        if ctx.use_mx:
            if mxa is None:
                if not isinstance(a, torch.Tensor) or a.dim() != 2:
                    raise TypeError(f"{fn}: a must be a 2D tensor or an MXTensor")
                offs_q = _ops.check_offs(offs, weight.shape[0], a.device, fn)
                mxa = _ops.quantize_rows(a.detach(), mode=config.mode, layout=ScaleLayout.GROUPED_M,
                                         group_offs=offs_q)
            fw = cache.forward_weight()
            ctx.generation = cache.generation
            ctx.cache = cache
            y = grouped_mm(mxa, fw, offs, backend=config.backend, config=config.gemm_config)
            _save_mx(ctx, mxa, offs)
        else:
            a16 = _ops.dequantize(mxa, torch.bfloat16) if mxa is not None else a.detach()
            if ctx.bf16_cache is not None:
                w = cache.weight()  # checked (or auto-refreshed) BF16 copy
                ctx.generation = cache.generation
            else:
                w = weight.detach()  # cast to BF16 inside grouped_mm_bf16, and again in backward
            y = grouped_mm_bf16(a16, w, offs)
            ctx.save_for_backward(a16, w, offs)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        config: GroupedLinearConfig = ctx.config
        grad_y = grad_y.to(torch.bfloat16).contiguous()
        need_a, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_a = grad_w = None
        weight_dtype = ctx.weight_dtype
        if ctx.use_mx:
            x, offs = _load_mx(ctx)
            if need_a:
                dw = ctx.cache.dgrad_weight(expected_generation=ctx.generation)
                if config.quantize_dgrad:
                    gq = _ops.quantize_rows(grad_y, mode=config.mode, layout=ScaleLayout.GROUPED_M,
                                            group_offs=offs.to(torch.int32))
                    grad_a = grouped_mm(gq, dw, offs, backend=config.backend, config=config.gemm_config)
                else:
                    grad_a = grouped_mm_bf16(grad_y, dw, offs)
        else:
            if ctx.bf16_cache is not None:  # before touching the saved copy: refreshed / master changed -> raise
                ctx.bf16_cache._check_generation(ctx.generation)
            x, w, offs = ctx.saved_tensors
            if need_a:
                # grad_a[rows g] = grad_y[rows g] @ W_g: b = W [G, N(red), K(out)] as stored (cast unless cached)
                grad_a = bf16_grouped_2d3d(grad_y, w.to(torch.bfloat16), offs.to(torch.int32))
        if need_a:
            grad_a = grad_a.to(ctx.a_dtype)
        if need_w:
            grad_w = grouped_wgrad(grad_y, x, offs, backend=config.wgrad_backend).to(weight_dtype)
        return grad_a, grad_w, None, None, None


def grouped_linear(a, weight: torch.Tensor, offs: torch.Tensor,
                   cache: Optional[MXWeightCache | BF16WeightCache] = None,
                   config: Optional[GroupedLinearConfig] = None) -> torch.Tensor:
    """Autograd-aware expert projection ``y[rows of g] = a[rows of g] @ weight[g]^T`` (see the module docstring).

    Args:
        a: ``[M_total, K]`` dense tensor, MXTensor, or object/tensor with an ``.mx`` MXTensor (expert-major).
        weight: ``[G, N, K]`` master weight (Parameter).
        offs: ``[G]`` int32 group end offsets.
        cache: :class:`MXWeightCache` of ``weight`` for the MXFP8 path; :class:`BF16WeightCache` of ``weight`` for
            the BF16 path on its cached copy (bit-identical to None); None = BF16 path, master cast per call.
        config: :class:`GroupedLinearConfig` (default options).
    Returns:
        BF16 ``[M_total, N]``.
    """
    return MXGroupedLinear.apply(a, weight, offs, cache, config or GroupedLinearConfig())


__all__ = ["MXGroupedLinear", "GroupedLinearConfig", "grouped_linear"]
