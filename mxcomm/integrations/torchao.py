"""Zero-copy conversion between :class:`mxcomm.mx.MXTensor` and torchao's MXFP8 ``MXTensor`` (torchao 0.18).

    from mxcomm.integrations.torchao import to_torchao, from_torchao, to_torchao_grouped_mm_input

    t = to_torchao(mx)             # same payload and scale storage (data_ptr equal), torchao MXTensor
    mx2 = from_torchao(t)          # and back, bit-exact, same storage
    a = to_torchao_grouped_mm_input(dispatched.x)   # for torchao's MXFP8 grouped GEMM (ROW scales)

Layout map (mxcomm ``MXTensor`` -> torchao ``MXTensor``; both: ``qdata`` float8_e4m3fn, E8M0 scales, block 32
along the LAST dim, ``orig_dtype`` kept):

=====================================  =========================================================================
mxcomm                                 torchao
=====================================  =========================================================================
``ROW``, axis = last dim               ``is_swizzled_scales=False``, ``scale`` = ``scales.view(float8_e8m0fnu)``
                                       (shape ``[..., K/32]``)
``BLOCKED`` (2D, axis 1)               ``is_swizzled_scales=True``, ``scale`` = the same bytes viewed as
                                       ``[ceil(M/128)*32, ceil(K/128)*16]`` (torchao's shape of one whole-matrix
                                       128x4 swizzle; mxcomm's ``[round_up(M,128), round_up(K/32,4)]``, same order)
``GROUPED_M`` with every group a       ``is_swizzled_scales=True`` as for BLOCKED: a group whose rows are a
multiple of 128 rows (``align=128``)   multiple of 128 starts on a 128-row tile, so the per-group swizzle IS the
                                       whole-matrix swizzle; the first ``round_up(M,128)`` scale rows are viewed
                                       (the allocation's spare zero rows after them are left out)
``GROUPED_M`` otherwise, ``GROUPED_K``  no torchao equivalent: ``ValueError`` (torchao's MXTensor has one
                                       whole-matrix swizzle or none, no per-group offsets). For torchao's grouped
                                       GEMM use :func:`to_torchao_grouped_mm_input` (ROW scales, a copy of the
                                       ``M*K/32`` scale bytes; payload still shared)
axis != last dim (column-wise)         ``ValueError`` (torchao blocks along the last dim of ``qdata``)
=====================================  =========================================================================

torchao -> mxcomm (:func:`from_torchao`): ``is_swizzled_scales=False`` -> ``ROW``; ``True`` (2D) -> ``BLOCKED``.
torchao does not record the scale rule (rceil / floor) in the tensor: pass ``mode`` (metadata only; dequantized
values do not depend on it). torchao tensors with a transposed ``qdata`` view, other element dtypes or block sizes
raise ``ValueError``.

torchao's MXFP8 grouped GEMM (``torchao.prototype.moe_training.mxfp8_grouped_mm._to_mxfp8_then_scaled_grouped_mm``)
accepts a pre-quantized ``A`` as a torchao ``MXTensor`` with UNswizzled ROW scales ``[M, K/32]`` (it swizzles per
group itself, on ``offs``) and only with ``wgrad_with_hp=True``; :func:`to_torchao_grouped_mm_input` makes that
tensor from mxcomm's dispatch output.
"""
from __future__ import annotations


import torch

from torchao.prototype.mx_formats.mx_tensor import MXTensor as TorchAOMXTensor

from ..mx import MXTensor, ScaleLayout
from ..mx.layouts import round_up
from ..mx.subclass import MXFP8Tensor

_E8M0 = torch.float8_e8m0fnu


def _as_mx(x) -> MXTensor:
    if isinstance(x, MXFP8Tensor):
        return x.mx
    if isinstance(x, MXTensor):
        return x
    raise TypeError(f"expected an mxcomm MXTensor or MXFP8Tensor, got {type(x).__name__}")


def _torchao_swizzled_shape(m: int, k: int) -> tuple[int, int]:
    """torchao's 2D shape of a whole-matrix swizzled scale tensor for ``qdata [m, k]``."""
    return (m + 127) // 128 * 32, (k + 127) // 128 * 16


def _groups_tile_aligned(offs: torch.Tensor) -> bool:
    """True when every group end offset is a multiple of 128 (one device-to-host sync)."""
    return bool((offs.to(torch.int64) % 128 == 0).all().item()) if offs.numel() else True


def _make(qdata, scale, orig_dtype, swizzled: bool) -> TorchAOMXTensor:
    return TorchAOMXTensor.from_qdata_and_scales(qdata, scale, orig_dtype, block_size=32,
                                                 is_swizzled_scales=swizzled)


def to_torchao(x, *, check_groups: bool = True) -> TorchAOMXTensor:
    """mxcomm ``MXTensor`` (or ``MXFP8Tensor``) -> torchao ``MXTensor`` sharing payload and scale storage.

    Args:
        x: ``qdata`` float8_e4m3fn ``[..., K]`` quantized along the last dim; layout ROW, BLOCKED, or GROUPED_M
            with all groups multiples of 128 rows (see the module docstring).
        check_groups: for GROUPED_M, check on the host that every group end offset is a multiple of 128
            (a device-to-host sync). Pass False only when that is known (dispatch with ``align=128``).
    Returns:
        torchao ``MXTensor`` (``elem_dtype`` float8_e4m3fn, ``block_size`` 32, ``orig_dtype`` = ``x.orig_dtype``);
        ``qdata`` is ``x.qdata`` itself, ``scale`` a view of ``x.scales``.
    Raises:
        ValueError for layouts torchao cannot represent (GROUPED_M with groups off the 128-row tiles, GROUPED_K,
        axis other than the last).
    """
    mx = _as_mx(x)
    q = mx.qdata
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"qdata must be float8_e4m3fn, got {q.dtype}")
    if mx.axis != q.dim() - 1:
        raise ValueError(f"torchao's MXTensor blocks along the last dim; this tensor is quantized along axis "
                         f"{mx.axis} of {q.dim()} (column-wise MX has no torchao equivalent here)")
    s = mx.scales
    if not s.is_contiguous():
        raise ValueError("scales must be contiguous for a zero-copy view")
    layout = ScaleLayout(mx.layout)
    if layout == ScaleLayout.ROW:
        return _make(q, s.view(_E8M0), mx.orig_dtype, False)
    if q.dim() != 2:
        raise ValueError("blocked scale layouts are 2D only")
    m, k = q.shape
    rows_p, cols_p = round_up(m, 128), round_up(k // 32, 4)
    if layout == ScaleLayout.GROUPED_M:
        if check_groups and not _groups_tile_aligned(mx.group_offs):
            raise ValueError(
                "GROUPED_M scales whose groups are not multiples of 128 rows have no torchao equivalent (torchao's "
                "MXTensor holds one whole-matrix swizzle or ROW scales, no per-group offsets): dispatch with "
                "align=128, or use to_torchao_grouped_mm_input() (ROW scales, copies the scale bytes)")
        if s.shape[0] < rows_p or s.shape[1] != cols_p:
            raise ValueError(f"GROUPED_M scales of shape {tuple(s.shape)} do not cover [{rows_p}, {cols_p}]")
        s = s[:rows_p]  # a prefix of rows: contiguous view, same storage
    elif layout == ScaleLayout.BLOCKED:
        if tuple(s.shape) != (rows_p, cols_p):
            raise ValueError(f"BLOCKED scales must have shape {(rows_p, cols_p)}, got {tuple(s.shape)}")
    else:
        raise ValueError(f"scale layout {layout.value} has no torchao equivalent (torchao's MXTensor holds ROW "
                         "scales or one whole-matrix swizzle)")
    return _make(q, s.view(_E8M0).view(*_torchao_swizzled_shape(m, k)), mx.orig_dtype, True)


def from_torchao(t: TorchAOMXTensor, *, mode: str = "rceil") -> MXTensor:
    """torchao ``MXTensor`` -> mxcomm ``MXTensor`` sharing payload and scale storage.

    Args:
        t: torchao MXFP8 tensor (``elem_dtype`` float8_e4m3fn, ``block_size`` 32, row-major ``qdata``).
        mode: the scale rule it was quantized with (torchao does not store it); metadata only.
    Returns:
        :class:`mxcomm.mx.MXTensor`, axis = last dim; ROW (``is_swizzled_scales=False``, scales ``[..., K/32]``
        uint8) or BLOCKED (swizzled, 2D: scales ``[round_up(M,128), round_up(K/32,4)]`` uint8).
    """
    if not isinstance(t, TorchAOMXTensor):
        raise TypeError(f"expected a torchao MXTensor, got {type(t).__name__}")
    if t.elem_dtype != torch.float8_e4m3fn or t.block_size != 32:
        raise ValueError(f"only MXFP8 (float8_e4m3fn, block 32) converts, got {t.elem_dtype}, block {t.block_size}")
    q = t.qdata
    if q.dim() >= 2 and q.stride(-2) < q.stride(-1):
        raise ValueError("torchao tensor with a transposed qdata view (quantized along dim 0 of the storage) has "
                         "no mxcomm row-wise equivalent")
    s = t.scale
    if not s.is_contiguous():
        raise ValueError("torchao scales must be contiguous for a zero-copy view")
    s = s.view(torch.uint8)
    axis = q.dim() - 1
    if not t.is_swizzled_scales:
        return MXTensor(qdata=q, scales=s, axis=axis, layout=ScaleLayout.ROW, mode=mode, orig_dtype=t.orig_dtype)
    if q.dim() != 2:
        raise ValueError("swizzled torchao scales convert for 2D tensors only")
    m, k = q.shape
    return MXTensor(qdata=q, scales=s.view(round_up(m, 128), round_up(k // 32, 4)), axis=axis,
                    layout=ScaleLayout.BLOCKED, mode=mode, orig_dtype=t.orig_dtype)


class _ToGroupedMMInput(torch.autograd.Function):
    """``MXFP8Tensor -> torchao MXTensor`` (ROW scales); backward: the gradient as it comes (dense)."""

    @staticmethod
    def forward(ctx, x: MXFP8Tensor):
        ctx.dtype = x.dtype
        mx = x.mx
        row = mx if mx.layout == ScaleLayout.ROW else mx.with_layout(ScaleLayout.ROW)
        return _make(mx.qdata, row.scales.contiguous().view(_E8M0), mx.orig_dtype, False)

    @staticmethod
    def backward(ctx, grad):
        return grad if grad is None else grad.to(ctx.dtype)


def to_torchao_grouped_mm_input(x) -> TorchAOMXTensor:
    """The pre-quantized ``A`` operand of torchao's MXFP8 grouped GEMM from mxcomm's dispatch output.

    Args:
        x: ``Dispatched.x`` of an MXFP8 dispatch (``MXFP8Tensor`` ``[R, H]``, GROUPED_M scales; autograd-attached:
            the conversion is differentiable, the gradient passes through to the dispatch), or an MXTensor.
    Returns:
        torchao ``MXTensor`` ``[R, H]`` with ROW (unswizzled) scales ``[R, H/32]``: the payload is shared (same
        storage), the scales are re-laid out from GROUPED_M to ROW (a copy of ``R*H/32`` bytes; the GEMM then
        swizzles them per group on ``offs``). Call torchao with ``offs = Dispatched.offs`` and ``wgrad_with_hp=True``.
    """
    if isinstance(x, MXFP8Tensor):
        return _ToGroupedMMInput.apply(x)
    mx = _as_mx(x)
    row = mx if mx.layout == ScaleLayout.ROW else mx.with_layout(ScaleLayout.ROW)
    return _make(mx.qdata, row.scales.contiguous().view(_E8M0), mx.orig_dtype, False)


__all__ = ["to_torchao", "from_torchao", "to_torchao_grouped_mm_input"]
