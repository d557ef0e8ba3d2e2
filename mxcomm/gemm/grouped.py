"""Grouped GEMMs for MoE experts: forward/dgrad (2D x 3D, groups along tokens) and wgrad (2D x 2D).

Conventions (all functions):

* Tokens are expert-major: group ``g`` owns rows ``[offs[g-1], offs[g])`` of the 2D operand (``offs[-1] = 0``),
  ``offs`` = int32 END offsets ``[G]``, non-decreasing, ``offs[-1] <= M_total`` (values are not checked on
  CUDA: that would sync). Rows past ``offs[-1]`` belong to no group: their output rows are **zero**.
* Weights are ``[G, N_out, K_red]`` (``y_g = a_g @ W_g^T``): an :class:`~mxcomm.gemm.weights.MXWeightCache`
  (its forward copy), an :class:`~mxcomm.gemm.weights.MXWeight`, a :class:`~mxcomm.gemm.weights.BF16WeightCache`
  (its BF16 copy), or a dense tensor.
* Output BF16 ``[M_total, N_out]``.

``torch._grouped_mm`` (BF16, what the ``dequant`` backend and :func:`grouped_mm_bf16` call), as checked in the
torch 2.11/2.13 sources (``GroupedMMUtils.h``) and tests:

* ``a [M_total, K]`` and ``b [G, K, N]`` BF16 (fp32/fp16 also accepted on recent builds); each operand
  row-major or column-major in its last two dims, with the non-unit stride a multiple of 16 bytes (8 BF16
  elements) and a 16-byte aligned data pointer. We pass ``b = W.transpose(-2, -1)`` (column-major view, no copy).
* ``offs`` int32, 1D, ``len == G``. **No alignment of the offsets is required** for 2D x 3D and 2D x 2D BF16
  (groups start at any row; the per-group base addresses stay 16-byte aligned because K and N are multiples
  of 8); the GPU test uses unaligned group sizes.
* ``out_dtype`` must equal the input dtype (no fp32 output for BF16 inputs). The output is allocated with
  ``empty_strided`` (row stride padded to 8 elements): rows past ``offs[-1]`` are **not written**, so we
  zero them; empty groups in 2D x 2D are masked to zero as well.
* On CPU, torch 2.13 has a ``_grouped_mm`` fallback (loop of ``mm`` with a host copy of ``offs``); where it is
  missing, :func:`grouped_mm_bf16` loops over groups itself.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..mx import MXTensor, ScaleLayout
from . import _ops
from .backend import GemmBackend, check_native_allowed, select_backend
from .triton_gemm import GroupedGemmConfig, triton_grouped_mm, triton_grouped_wgrad, zero_rows_past_end
from .weights import BF16WeightCache, MXWeight, MXWeightCache

_DENSE = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# operand normalisation
# ----------------------------------------------------------------------------------------------
def _resolve_weight(w, fn: str):
    """-> MXWeight or a dense 3D tensor ``[G, N, K]``."""
    if isinstance(w, MXWeightCache):
        return w.forward_weight()
    if isinstance(w, BF16WeightCache):
        return w.weight()
    if isinstance(w, MXWeight):
        return w
    if isinstance(w, torch.Tensor):
        if w.dim() != 3:
            raise ValueError(f"{fn}: weights must be [G, N, K], got shape {tuple(w.shape)}")
        if w.dtype not in _DENSE:
            raise TypeError(f"{fn}: dense weights must be bfloat16 / float16 / float32, got {w.dtype}")
        return w
    raise TypeError(f"{fn}: weights must be an MXWeightCache, BF16WeightCache, MXWeight or a [G, N, K] tensor, got "
                    f"{type(w).__name__}")


def _check_a_mx(a: MXTensor, fn: str) -> None:
    if a.qdata.dim() != 2 or a.axis != 1:
        raise ValueError(f"{fn}: the MX activation must be 2D [M_total, K] quantized along K (axis 1), got shape "
                         f"{tuple(a.qdata.shape)} axis {a.axis}")
    if a.layout not in (ScaleLayout.ROW, ScaleLayout.GROUPED_M, ScaleLayout.BLOCKED):
        raise ValueError(f"{fn}: activation scales must be in row, blocked or grouped_m layout, got {a.layout.value}")
    if a.layout == ScaleLayout.GROUPED_M and a.group_offs is None:
        raise ValueError(f"{fn}: grouped_m activation without group_offs")


def _check_dense_2d(x: torch.Tensor, name: str, fn: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2D, got shape {tuple(x.shape)}")
    if x.dtype not in _DENSE:
        raise TypeError(f"{fn}: {name} must be bfloat16 / float16 / float32, got {x.dtype}")


def _same_offs(a: MXTensor, offs: torch.Tensor, fn: str) -> None:
    """A grouped_m activation's scale placement must use the GEMM's groups (checked on CPU; a contract on CUDA)."""
    if a.layout != ScaleLayout.GROUPED_M or a.group_offs is offs:
        return
    if a.group_offs.numel() != offs.numel():
        raise ValueError(f"{fn}: the activation's grouped_m scales have {a.group_offs.numel()} groups, offs has "
                         f"{offs.numel()}")
    if offs.device.type == "cpu" and not torch.equal(a.group_offs.to(torch.int64), offs.to(torch.int64)):
        raise ValueError(f"{fn}: the activation's grouped_m scales were laid out for other group offsets")


def _dense(x, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``dtype`` view of an MXTensor / MXWeight / tensor."""
    if isinstance(x, MXTensor):
        return _ops.dequantize(x, dtype)
    if isinstance(x, MXWeight):
        return x.dequantize(dtype)
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# BF16 grouped GEMM (torch._grouped_mm or a loop)
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _torch_grouped_mm_on(device_type: str) -> bool:
    """Whether ``torch._grouped_mm`` exists and runs on this device type (probed once on CPU)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda":
        return True
    try:
        a = torch.zeros(16, 32, dtype=torch.bfloat16)
        b = torch.zeros(2, 32, 16, dtype=torch.bfloat16)
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _loop_2d3d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def bf16_grouped_2d3d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ b[g]``: ``a [M, K]`` bf16, ``b [G, K, N]`` bf16 (any major), int32 ``offs``;
    rows past ``offs[-1]`` zero. ``torch._grouped_mm`` where it runs, else a loop over groups (host sync).
    No rows: an empty ``[0, N]`` without a kernel (an empty gradient can carry zero strides, which
    ``torch._grouped_mm`` rejects)."""
    if a.shape[0] == 0:
        return torch.zeros(0, b.shape[-1], dtype=torch.bfloat16, device=a.device)
    if _torch_grouped_mm_on(a.device.type):
        out = torch._grouped_mm(a, b, offs=offs)
        return zero_rows_past_end(out, offs)
    return _loop_2d3d(a, b, offs)


# ----------------------------------------------------------------------------------------------
# public: forward / dgrad
# ----------------------------------------------------------------------------------------------
def native_args(a: MXTensor, w: MXWeight, offs: torch.Tensor) -> dict:
    """Arguments of ``torch._scaled_grouped_mm`` for MXFP8 ``a [M, K]`` x ``w [G, N, K]`` (checked against torch's
    meta kernel in the CPU tests): payloads as E4M3, ``mat_b`` the column-major view ``[G, K, N]``, scales as
    ``float8_e8m0fnu`` - ``a``'s in the grouped_m layout for ``offs``, ``w``'s per-expert blocked ``[G, ...]``."""
    if a.layout != ScaleLayout.GROUPED_M:
        a = a.with_layout(ScaleLayout.GROUPED_M, offs)
    w = w.with_layout(ScaleLayout.BLOCKED)
    return dict(
        mat_a=a.qdata.contiguous(), mat_b=w.qdata.transpose(-2, -1),
        scale_a=a.scales.contiguous().view(torch.float8_e8m0fnu), scale_b=w.scales.view(torch.float8_e8m0fnu),
        offs=offs, out_dtype=torch.bfloat16,
    )


def _native_grouped_mm(a: MXTensor, w, offs: torch.Tensor) -> torch.Tensor:
    check_native_allowed(a.qdata.device)  # the only road to the native kernel; raises below sm_100
    if not isinstance(w, MXWeight):
        w = MXWeight.from_dense(w, layout=ScaleLayout.BLOCKED)  # per call: use an MXWeightCache instead
    kw = native_args(a, w, offs)
    out = torch._scaled_grouped_mm(kw.pop("mat_a"), kw.pop("mat_b"), kw.pop("scale_a"), kw.pop("scale_b"), **kw)
    return zero_rows_past_end(out, offs)


def reference_grouped_mm(a, w, offs: torch.Tensor) -> torch.Tensor:
    """fp32 oracle: dequantize both operands to fp32 and multiply per group in fp32 (host loop).

    Args: ``a`` MXTensor / dense ``[M, K]``; ``w`` MXWeightCache / MXWeight / dense ``[G, N, K]``; ``offs [G]``.
    Returns: fp32 ``[M, N]``, rows past ``offs[-1]`` zero.
    """
    mxa = _ops.as_mx(a)
    a32 = _dense(mxa if mxa is not None else a, torch.float32)
    w32 = _dense(_resolve_weight(w, "reference_grouped_mm"), torch.float32)
    return _loop_2d3d(a32, w32.transpose(-2, -1), offs)


def grouped_mm(
    a,
    w,
    offs: torch.Tensor,
    *,
    backend: Optional[str | GemmBackend] = None,
    config: Optional[GroupedGemmConfig] = None,
) -> torch.Tensor:
    """MXFP8 grouped GEMM ``y[rows of g] = a[rows of g] @ W_g^T`` (MoE expert projection, forward or dgrad).

    Args:
        a: MXTensor ``[M_total, K]`` quantized along K (axis 1), expert-major, scales in the ``grouped_m`` layout
            for ``offs`` (``row`` / ``blocked`` accepted too), or any object with such an ``.mx`` attribute.
        w: :class:`MXWeightCache` (its checked forward copy), :class:`MXWeight` ``[G, N, K]`` (e.g. a cache's
            ``dgrad_weight()`` for dgrad) or a dense ``[G, N, K]`` tensor.
        offs: ``[G]`` int32 group end offsets (see the module docstring), same device.
        backend: None = auto (:func:`~mxcomm.gemm.backend.select_backend`: native on sm_100/sm_103, ``dequant``
            on other GPUs, ``reference`` on CPU) or ``"native" | "dequant" | "triton" | "reference"``.
        config: tiles for the ``triton`` backend.
    Returns:
        BF16 ``[M_total, N]``; rows past ``offs[-1]`` zero.
    Raises:
        TypeError / ValueError for bad operands (before any kernel runs); RuntimeError for ``native`` below sm_100.
    """
    fn = "grouped_mm"
    mxa = _ops.as_mx(a)
    if mxa is None:
        raise TypeError(f"{fn}: a must be an MXTensor (or carry one as .mx); for dense activations use "
                        f"grouped_mm_bf16, got {type(a).__name__}")
    _check_a_mx(mxa, fn)
    wt = _resolve_weight(w, fn)
    G, N, K = wt.shape
    M, Ka = mxa.qdata.shape
    if Ka != K:
        raise ValueError(f"{fn}: a has K={Ka} but the weights have K={K}")
    dev = mxa.qdata.device
    if wt.device != dev:
        raise ValueError(f"{fn}: a is on {dev} but the weights are on {wt.device}")
    offs = _ops.check_offs(offs, G, dev, fn)
    _ops.check_offs_values(offs, M, fn)
    _same_offs(mxa, offs, fn)
    b = select_backend(dev, backend)
    if b == GemmBackend.REFERENCE:
        return reference_grouped_mm(mxa, wt, offs).to(torch.bfloat16)
    if b == GemmBackend.NATIVE:
        return _native_grouped_mm(mxa, wt, offs)
    if b == GemmBackend.TRITON:
        return triton_grouped_mm(mxa, wt, offs, config=config)
    # DEQUANT: BF16 operands (exactly the dequantized values), BF16 grouped GEMM
    a16 = _ops.dequantize(mxa, torch.bfloat16)
    w16 = _dense(wt, torch.bfloat16)
    return bf16_grouped_2d3d(a16, w16.transpose(-2, -1), offs)


def grouped_mm_bf16(a: torch.Tensor, w, offs: torch.Tensor) -> torch.Tensor:
    """BF16 grouped GEMM ``y[rows of g] = a[rows of g] @ W_g^T`` (the non-MX baseline).

    Args:
        a: ``[M_total, K]`` bf16 (fp16/fp32 are cast to bf16).
        w: dense ``[G, N, K]`` (cast to bf16), a :class:`BF16WeightCache` (its checked copy, no cast), or an
            MXWeight / MXWeightCache (dequantized to bf16).
        offs: ``[G]`` int32 group end offsets.
    Returns:
        BF16 ``[M_total, N]``, rows past ``offs[-1]`` zero. ``torch._grouped_mm`` on CUDA and where the CPU build
        has it, else a loop over groups.
    """
    fn = "grouped_mm_bf16"
    _check_dense_2d(a, "a", fn)
    wt = _resolve_weight(w, fn)
    G, N, K = wt.shape
    if a.shape[1] != K:
        raise ValueError(f"{fn}: a has K={a.shape[1]} but the weights have K={K}")
    if wt.device != a.device:
        raise ValueError(f"{fn}: a is on {a.device} but the weights are on {wt.device}")
    if K % 8 or N % 8:
        raise ValueError(f"{fn}: K={K} and N={N} must be multiples of 8 (16-byte strides)")
    offs = _ops.check_offs(offs, G, a.device, fn)
    _ops.check_offs_values(offs, a.shape[0], fn)
    w16 = _dense(wt, torch.bfloat16)
    return bf16_grouped_2d3d(a.to(torch.bfloat16).contiguous(), w16.transpose(-2, -1), offs)


# ----------------------------------------------------------------------------------------------
# public: wgrad
# ----------------------------------------------------------------------------------------------
def reference_grouped_wgrad(grad_out, x, offs: torch.Tensor) -> torch.Tensor:
    """fp32 oracle of :func:`grouped_wgrad`: ``dW[g] = grad_out[rows g]^T @ x[rows g]`` in fp32 (host loop)."""
    go = _dense(_ops.as_mx(grad_out) or grad_out, torch.float32)
    xx = _dense(_ops.as_mx(x) or x, torch.float32)
    G = offs.numel()
    out = torch.zeros(G, go.shape[1], xx.shape[1], dtype=torch.float32, device=go.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[g] = go[start:end].t() @ xx[start:end]
        start = end
    return out


def grouped_wgrad(
    grad_out,
    x,
    offs: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    backend: Optional[str | GemmBackend] = None,
) -> torch.Tensor:
    """Expert weight gradient ``dW[g] = grad_out[rows of g]^T @ x[rows of g]`` (2D x 2D, groups along tokens).

    Args:
        grad_out: ``[M_total, N]`` bf16 tensor or MXTensor (dequantized to bf16).
        x: ``[M_total, K]`` bf16 tensor or MXTensor / object with ``.mx`` (dequantized to bf16: for an MX
            forward input this is exactly the operand the forward multiplied).
        offs: ``[G]`` int32 group end offsets; rows past ``offs[-1]`` are ignored.
        out: optional fp32 ``[G, N, K]`` gradient to accumulate into (``out += dW``).
        backend: None = auto (CUDA: ``dequant``; CPU: ``reference``). ``dequant`` / ``native``: BF16
            ``torch._grouped_mm`` (fp32 accumulation inside, one BF16 rounding of each group's result), then fp32;
            ``triton``: one Triton kernel, MX ``x`` decoded in its load path, fp32 accumulator stored (and
            accumulated into ``out``) without a BF16 rounding; ``reference``: fp32 loop.
    Returns:
        fp32 ``[G, N, K]`` (``out`` itself when given); empty groups give zeros.
    """
    fn = "grouped_wgrad"
    go = _ops.as_mx(grad_out) or grad_out
    xx = _ops.as_mx(x) or x
    for name, t in (("grad_out", go), ("x", xx)):
        if isinstance(t, MXTensor):
            _check_a_mx(t, fn)
        else:
            _check_dense_2d(t, name, fn)
    go_shape, x_shape = tuple(go.shape), tuple(xx.shape)
    if go_shape[0] != x_shape[0]:
        raise ValueError(f"{fn}: grad_out has {go_shape[0]} rows but x has {x_shape[0]}")
    dev = go.qdata.device if isinstance(go, MXTensor) else go.device
    xdev = xx.qdata.device if isinstance(xx, MXTensor) else xx.device
    if dev != xdev:
        raise ValueError(f"{fn}: grad_out is on {dev} but x is on {xdev}")
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"{fn}: offs must be a 1D int32 tensor")
    G = offs.numel()
    offs = _ops.check_offs(offs, G, dev, fn)
    _ops.check_offs_values(offs, go_shape[0], fn)
    N, K = go_shape[1], x_shape[1]
    if out is not None:
        if out.dtype != torch.float32 or tuple(out.shape) != (G, N, K) or out.device != dev:
            raise ValueError(f"{fn}: out must be fp32 [{G}, {N}, {K}] on {dev}, got {out.dtype} {tuple(out.shape)} "
                             f"on {out.device}")
    b = GemmBackend.REFERENCE if (backend is None and dev.type != "cuda") else GemmBackend(backend or "dequant")
    if b == GemmBackend.REFERENCE:
        res = reference_grouped_wgrad(go, xx, offs)
    elif b == GemmBackend.TRITON:
        return triton_grouped_wgrad(_dense(go, torch.bfloat16), xx, offs, out=out)
    else:
        if N % 8 or K % 8:
            raise ValueError(f"{fn}: N={N} and K={K} must be multiples of 8 for the BF16 grouped GEMM")
        g16 = _dense(go, torch.bfloat16).contiguous()
        x16 = _dense(xx, torch.bfloat16).contiguous()
        if G == 0 or go_shape[0] == 0:
            res = torch.zeros(G, N, K, dtype=torch.float32, device=dev)
        elif _torch_grouped_mm_on(dev.type):
            res = torch._grouped_mm(g16.t(), x16, offs=offs).float()
            starts = torch.cat([offs.new_zeros(1), offs[:-1]])
            res.masked_fill_((offs <= starts).view(G, 1, 1), 0.0)  # empty groups: the kernel may not write them
        else:
            res = reference_grouped_wgrad(g16, x16, offs)  # loop (fp32 accumulation of the bf16 operands)
    if out is None:
        return res
    return out.add_(res)


__all__ = ["grouped_mm", "grouped_mm_bf16", "grouped_wgrad", "reference_grouped_mm", "reference_grouped_wgrad",
           "native_args", "bf16_grouped_2d3d"]
