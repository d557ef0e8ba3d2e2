"""MXFP8Tensor: one :class:`MXTensor` (payload + scales + layout) carried through autograd as ONE value.

Autograd only moves ``torch.Tensor`` objects between functions, and checks that a gradient has the
dtype / shape / device of the tensor it belongs to. :class:`MXFP8Tensor` is a wrapper subclass
(``torch.Tensor._make_wrapper_subclass``) whose *logical* value is ``dequantize(mx)``: it reports the
logical dtype (bfloat16 by default), shape and device of that value, and holds the frozen
:class:`MXTensor` inside. So an MX value can be the output of an autograd function (the dispatch
output) or a gradient (the combine backward's output) without being split into two loose tensors,
and an MX-aware consumer (a grouped scaled GEMM) reads ``t.mx`` directly: no dequantize -> requantize.

Supported tensor operations (``__torch_dispatch__``), all exact:

* ``detach``, ``alias``, ``view`` / ``view_as`` to the same shape: the same MX value (no copy);
* ``clone``: copies payload and scales;
* ``to(device)`` / ``_to_copy`` keeping the logical dtype: the MX value moved (or copied);
* ``to(other_dtype)`` / ``float()`` / ...: the dense dequantized tensor (a plain tensor);
* ``is_same_size``.

Every other operation raises ``NotImplementedError`` naming the op (not TypeError: torch turns a
TypeError inside ``a + b`` into Python's generic "unsupported operand" message): an MX value must not be silently
dequantized inside arbitrary code (that would hide an extra memory pass). Call :meth:`dequantize`
(differentiable, gradient passes straight through) to get a dense tensor.

torch.compile: the subclass implements ``__tensor_flatten__`` / ``__tensor_unflatten__`` (inner
tensors ``qdata``, ``scales`` and ``group_offs`` when present), so compiled code can take and return it.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch

from .tensor import MXTensor, ScaleLayout, dequantize

aten = torch.ops.aten

_INNER = ("qdata", "scales", "group_offs")


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


class MXFP8Tensor(torch.Tensor):
    """A tensor whose value is ``dequantize(mx)`` and whose storage is the :class:`MXTensor` ``mx``.

    Build with :meth:`from_mx` (or ``MXFP8Tensor(mx)``). Attributes: ``qdata`` (float8_e4m3fn),
    ``scales`` (uint8, in ``scale_layout``), ``axis``, ``scale_layout`` (:class:`ScaleLayout`;
    ``Tensor.layout`` stays torch's strided layout), ``mode``, ``orig_dtype``, ``group_offs``
    (int32 or None); ``mx`` rebuilds the frozen :class:`MXTensor`.
    The logical dtype defaults to ``mx.orig_dtype``.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    group_offs: Optional[torch.Tensor]

    @staticmethod
    def __new__(cls, mx: MXTensor, dtype: Optional[torch.dtype] = None, requires_grad: bool = False):
        if not isinstance(mx, MXTensor):
            raise TypeError(f"MXFP8Tensor wraps an mxcomm.mx.MXTensor, got {type(mx).__name__}")
        dtype = dtype or mx.orig_dtype
        if not dtype.is_floating_point:
            raise TypeError(f"the logical dtype of an MXFP8Tensor must be floating, got {dtype}")
        shape = tuple(mx.qdata.shape)
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=_contiguous_strides(shape), dtype=dtype, device=mx.qdata.device,
            requires_grad=requires_grad,
        )
        t.qdata = mx.qdata
        t.scales = mx.scales
        t.group_offs = mx.group_offs
        t.axis = mx.axis
        t.scale_layout = ScaleLayout(mx.layout)
        t.mode = mx.mode
        t.orig_dtype = mx.orig_dtype
        return t

    def __init__(self, mx: MXTensor, dtype: Optional[torch.dtype] = None, requires_grad: bool = False):
        pass  # everything happens in __new__

    @classmethod
    def from_mx(cls, mx: MXTensor, dtype: Optional[torch.dtype] = None, requires_grad: bool = False) -> "MXFP8Tensor":
        """Wrap ``mx`` (no copy). ``dtype``: logical dtype (default ``mx.orig_dtype``)."""
        return cls(mx, dtype=dtype, requires_grad=requires_grad)

    @property
    def mx(self) -> MXTensor:
        """The held value as the frozen :class:`MXTensor` dataclass."""
        return MXTensor(
            qdata=self.qdata, scales=self.scales, axis=self.axis, layout=self.scale_layout, mode=self.mode,
            orig_dtype=self.orig_dtype, group_offs=self.group_offs,
        )

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # type: ignore[override]
        """Dense ``qdata * 2**(scale-127)`` in ``dtype`` (default: the logical dtype).

        Differentiable: the gradient passes straight through (cast to this tensor's logical dtype).
        """
        return _Dequantize.apply(self, dtype or self.dtype)

    def __repr__(self) -> str:  # must not run tensor ops (they would hit __torch_dispatch__)
        return (
            f"MXFP8Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"axis={self.axis}, layout={self.scale_layout.value}, mode={self.mode}"
            f"{', requires_grad=True' if self.requires_grad else ''})"
        )

    # -- torch.compile support ---------------------------------------------------------------
    def __tensor_flatten__(self):
        names = [n for n in _INNER if getattr(self, n) is not None]
        ctx = (self.axis, self.scale_layout.value, self.mode, self.orig_dtype, self.dtype)
        return names, ctx

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        axis, layout, mode, orig_dtype, dtype = ctx
        mx = MXTensor(
            qdata=inner["qdata"], scales=inner["scales"], axis=axis, layout=ScaleLayout(layout), mode=mode,
            orig_dtype=orig_dtype, group_offs=inner.get("group_offs"),
        )
        return MXFP8Tensor(mx, dtype=dtype)

    def _stable_hash_for_caching(self) -> str:
        """Deterministic key of the metadata (not the values) for torch.compile's AOT cache."""
        inner = [
            (n, tuple(getattr(self, n).shape), str(getattr(self, n).dtype), tuple(getattr(self, n).stride()))
            for n in self.__tensor_flatten__()[0]
        ]
        key = repr((tuple(self.shape), self.requires_grad, str(self.device), self.__tensor_flatten__()[1], inner))
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    # -- tensor operations ---------------------------------------------------------------------
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"MXFP8Tensor does not implement {func}: an MX value is not dequantized implicitly. "
                "Call .dequantize() first (differentiable), or hand .mx to an MX-aware kernel."
            )
        return handler(func, args, kwargs)


def _rewrap(t: MXFP8Tensor, fn) -> MXFP8Tensor:
    """A new MXFP8Tensor with ``fn`` applied to each inner tensor."""
    mx = t.mx
    new = MXTensor(
        qdata=fn(mx.qdata), scales=fn(mx.scales), axis=mx.axis, layout=mx.layout, mode=mx.mode,
        orig_dtype=mx.orig_dtype, group_offs=None if mx.group_offs is None else fn(mx.group_offs),
    )
    return MXFP8Tensor(new, dtype=t.dtype)


def _same_value(func, args, kwargs):
    return _rewrap(args[0], lambda x: x)


def _view(func, args, kwargs):
    t, size = args[0], list(args[1])
    n = t.numel()
    if size.count(-1) == 1:
        known = 1
        for d in size:
            if d != -1:
                known *= d
        size[size.index(-1)] = n // known if known else 0
    if tuple(size) != tuple(t.shape):
        raise NotImplementedError(f"MXFP8Tensor cannot be viewed as {tuple(args[1])} (shape {tuple(t.shape)}); only same-shape views")
    return _rewrap(t, lambda x: x)


def _clone(func, args, kwargs):
    return _rewrap(args[0], lambda x: x.clone())


def _to_copy(func, args, kwargs):
    t = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    if dtype is None or dtype == t.dtype:
        dev = torch.device(device) if device is not None else t.device
        return _rewrap(t, lambda x: x.to(dev, copy=True))
    out = dequantize(t.mx, dtype)
    return out if device is None else out.to(device)


def _is_same_size(func, args, kwargs):
    return tuple(args[0].shape) == tuple(args[1].shape)


_OPS = {
    aten.detach.default: _same_value,
    aten.alias.default: _same_value,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.is_same_size.default: _is_same_size,
}


class _Dequantize(torch.autograd.Function):
    """``MXFP8Tensor -> dense``; backward: the incoming gradient, cast to the MX tensor's logical dtype."""

    @staticmethod
    def forward(ctx, t: MXFP8Tensor, dtype: torch.dtype):
        ctx.in_dtype = t.dtype
        return dequantize(t.mx, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.in_dtype), None


def wrap_mx(value, dtype: Optional[torch.dtype] = None):
    """``MXTensor -> MXFP8Tensor`` (anything else is returned unchanged)."""
    return MXFP8Tensor(value, dtype=dtype) if isinstance(value, MXTensor) else value


def unwrap_mx(value):
    """``MXFP8Tensor -> MXTensor`` (anything else is returned unchanged)."""
    return value.mx if isinstance(value, MXFP8Tensor) else value


def to_dense(value, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense tensor of an MXFP8Tensor (differentiable), an MXTensor, or a plain tensor (cast to ``dtype``)."""
    if isinstance(value, MXFP8Tensor):
        return value.dequantize(dtype)
    if isinstance(value, MXTensor):
        return dequantize(value, dtype)
    return value.to(dtype)


__all__ = ["MXFP8Tensor", "wrap_mx", "unwrap_mx", "to_dense"]
