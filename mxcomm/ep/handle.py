"""The values of the EP API: :class:`Dispatched` (what dispatch returns), :class:`EPHandle` (what links a dispatch to
its combine and to both backward passes), and the values the backward steps exchange (:class:`CombineSaved`,
:class:`CombineGrads`). :class:`DispatchResult` is what a backend's dispatch hands to the group (see
:mod:`mxcomm.ep.backend`); users see :class:`Dispatched`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ..mx import MXTensor
from ..mx.subclass import MXFP8Tensor
from .config import EPConfig
from .plan import RoutingPlan
from .streams import EPEvent


@dataclass(frozen=True)
class EPHandle:
    """Everything combine and the backward passes need about one dispatch (opaque to users; pass it on).

    Attributes:
        config: the group's :class:`EPConfig`.
        group_id: the id of the :class:`~mxcomm.ep.group.EPGroup` that made it (a handle works only with its group).
        plan: the :class:`RoutingPlan` (all routing tensors, int32, on the data device).
        topk_idx: the dispatch's ``[T, k]`` expert ids.
        topk_weights: the ``[T, k]`` route weights given to dispatch (combine's default weights).
        weights_version: ``topk_weights._version`` at dispatch: combine refuses weights changed in place since
            (torch's rule for tensors saved for later use).
        num_tokens: T.
        num_rows: R, rows of the dispatch output (and of ``expert_out`` for combine).
        device: device of the dispatch input.
        send_splits_host / recv_splits_host: per-rank row counts on the host when the backend synchronised to
            learn them (reference backend), else None.
        backend_state: backend-specific state (e.g. the nvshmem backend's row origins), else None.
        op_state: set when the dispatch ran as a custom op (under ``torch.compile``): the backend's state as the
            ops carry it (flat int32 tensors, ``Backend.state_tensors``); combine then runs through the ops too
            (:mod:`mxcomm.ep.compiled`). ``weights_version`` is -1 there (not checked).
    """

    config: EPConfig
    group_id: int
    plan: RoutingPlan
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    weights_version: int
    num_tokens: int
    num_rows: int
    device: torch.device
    send_splits_host: Optional[tuple] = None
    recv_splits_host: Optional[tuple] = None
    backend_state: Optional[Any] = None
    op_state: Optional[tuple] = None


@dataclass(frozen=True)
class DispatchResult:
    """What a backend's dispatch returns to the group (the group wraps it into :class:`Dispatched`).

    Attributes:
        x: precision ``"mxfp8"``: :class:`MXTensor` with ``qdata`` float8_e4m3fn ``[R, H]``, scales uint8 in layout
            GROUPED_M with ``group_offs = offs`` (per-group 128x4-blocked, ``[grouped_m_rows(R, El), round_up(H/32,
            4)]``), axis 1, the config's scale mode. Precision ``"bf16"``: a bfloat16 ``[R, H]`` tensor. Padding
            rows are zero (payload and scale bytes).
        offs: int32 ``[El]`` END offsets of each local expert's padded group (multiples of align).
        counts: int32 ``[El]`` real rows per local expert.
        num_rows: R: ``offs[-1]`` when ``exact_sizes``; else the worst-case bound
            :func:`mxcomm.ep.plan.max_recv_rows` (rows past ``offs[-1]`` are zero).
    """

    x: Union[MXTensor, torch.Tensor]
    offs: torch.Tensor
    counts: torch.Tensor
    num_rows: int


@dataclass(frozen=True)
class Dispatched:
    """What :meth:`EPGroup.dispatch <mxcomm.ep.group.EPGroup.dispatch>` returns: the rows this rank received for
    its local experts, expert-major, and the handle for combine.

    Attributes:
        x: ``[R, H]``, each local expert's group padded to ``align`` with zero rows: an :class:`MXFP8Tensor`
            (precision ``"mxfp8"``: float8_e4m3fn payload, uint8 E8M0 scales GROUPED_M on ``offs``, i.e. each
            group's scales 128x4-blocked as the grouped scaled GEMM reads them; its logical dtype is bfloat16)
            or a bfloat16 tensor. Differentiable with respect to the dispatch input (from
            :meth:`EPGroup.dispatch`; ``EPGroup.steps.dispatch`` returns it detached); its gradient may be bfloat16
            or an MXFP8Tensor.
        offs: int32 ``[El]`` END offsets of the local experts' padded groups (``torch._grouped_mm`` offsets).
        counts: int32 ``[El]`` real (unpadded) rows per local expert.
        num_rows: R (``offs[-1]`` with exact sizes, else the worst-case bound; rows past ``offs[-1]`` are zero).
        handle: the :class:`EPHandle` for combine.
        event: with ``EPGroup.dispatch(..., stream=s)``, the :class:`~mxcomm.ep.streams.EPEvent` of the call (the
            other fields are written on ``s``: ``event.wait()`` before reading them); else None.
    """

    x: torch.Tensor
    offs: torch.Tensor
    counts: torch.Tensor
    num_rows: int
    handle: EPHandle
    event: Optional[EPEvent] = None

    @property
    def mx(self) -> Optional[MXTensor]:
        """The MX value of ``x`` (payload + scales + layout) for an MXFP8 dispatch, else None."""
        return self.x.mx if isinstance(self.x, MXFP8Tensor) else None

    def dense(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``x`` as a dense ``dtype`` ``[R, H]`` tensor (differentiable; dequantizes an MXFP8 dispatch)."""
        if isinstance(self.x, MXFP8Tensor):
            if torch.compiler.is_compiling():
                from .dense import dense  # a custom op with a fake implementation: traces without a break

                return dense(self.x, dtype)
            return self.x.dequantize(dtype)
        return self.x.to(dtype)


@dataclass(frozen=True)
class CombineSaved:
    """What a forward combine keeps for the route-weight gradient.

    Attributes:
        rows: the expert output given to combine, on the expert rank, as it is: bfloat16 ``[R, H]`` in the dispatch
            output's expert-major layout (padding rows never read). The route-weight gradient
            ``grad_w[t, j] = <grad_y[t], rows[row(t, j)]>`` is computed where these rows are (combine backward brings
            ``grad_y`` there once per (token, rank)); nothing is copied at the origin.
    """

    rows: torch.Tensor

    def nbytes(self) -> int:
        r = self.rows
        return r.numel() * r.element_size()


@dataclass(frozen=True)
class CombineGrads:
    """Result of a combine backward.

    Attributes:
        grad_expert_out: ``[R, H]`` in the dispatch output's expert-major layout (padding rows zero):
            :class:`MXTensor` (float8_e4m3fn payload, uint8 scales GROUPED_M on the dispatch ``offs``,
            axis 1, the config's scale mode, ``orig_dtype`` bfloat16) for MXFP8 transport, else bfloat16.
        grad_weights: float32 ``[T, k]`` route-weight gradient (0 for dropped slots), or None when no
            :class:`CombineSaved` was given.
    """

    grad_expert_out: Union[MXTensor, torch.Tensor]
    grad_weights: Optional[torch.Tensor]


def replace_fields(obj, **changes):
    """``dataclasses.replace(obj, **changes)`` for the dataclasses of this module (no ``__post_init__``, no
    ``InitVar``, no ``__slots__``) at a fraction of its host cost: a shallow copy with ``changes`` set. TypeError for a
    name that is not a field, as ``dataclasses.replace`` raises."""
    cls = obj.__class__
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    for name in changes:
        if name not in names:
            raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument '{name}'")
    new = object.__new__(cls)
    d = new.__dict__
    d.update(obj.__dict__)
    d.update(changes)
    return new


def with_weights(handle: EPHandle, w: torch.Tensor) -> EPHandle:
    """``handle`` carrying the route weights ``w`` (float ``[T, k]``) and their current version (see
    :attr:`EPHandle.weights_version`)."""
    return replace_fields(handle, topk_weights=w, weights_version=w._version)


_FIELD_NAMES: dict = {}  # dataclass -> frozenset of its field names (replace_fields)

__all__ = ["EPHandle", "Dispatched", "DispatchResult", "CombineSaved", "CombineGrads", "replace_fields", "with_weights"]
