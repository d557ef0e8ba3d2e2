"""The small protocol between :class:`~mxcomm.ep.group.EPGroup` and a backend, and the factory that builds one.

Backends: ``"torch"`` (:class:`mxcomm.ep.reference.TorchBackend`, the reference: quantize + torch.distributed
all-to-all; CPU/gloo and GPU/NCCL) and ``"nvshmem"`` (:class:`mxcomm.ep.nvshmem.backend.NvshmemBackend`, GPU kernels
over NVSHMEM symmetric buffers; loaded lazily). The group validates every argument before it calls a backend
(:mod:`mxcomm.ep.validate`); every method is collective.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Union

import torch

from ..mx import MXTensor
from .config import EPConfig
from .handle import CombineGrads, CombineSaved, DispatchResult, EPHandle
from .plan import RoutingPlan


class Backend(Protocol):
    """What a backend provides. Built as ``Backend(config, group, rank, world_size, group_id=...)``.

    Attributes:
        path: how it moves rows, one of :data:`mxcomm.ep.config.PATHS`.
        device_side_checks: True when it checks expert ids on the device itself (the group then skips its
            host-synchronising id check).
        memory_bytes: symmetric-buffer bytes it allocated (0 for the reference backend).
    """

    path: str
    device_side_checks: bool
    memory_bytes: int

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[DispatchResult, EPHandle]:
        """Rows to the experts' ranks, expert-major (see :class:`DispatchResult`)."""

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, quantize: bool) -> torch.Tensor:
        """bfloat16 ``[T, H]``: per (token, rank) ``P = sum_j w[t,j] * expert_out[row(t,j)]`` (fp32, ``j`` ascending)
        rounded once for transport (MXFP8 when ``quantize``, else BF16), the partials summed in fp32 at the origin
        (:mod:`mxcomm.ep.reference.backward` has the math)."""

    def combine_for_backward(self, expert_out: torch.Tensor, handle: EPHandle,
                             quantize: bool) -> tuple[torch.Tensor, CombineSaved]:
        """:meth:`combine` and what the route-weight gradient needs: ``CombineSaved(rows=expert_out)``."""

    def combine_backward(self, grad_y: torch.Tensor, handle: EPHandle, saved: Optional[CombineSaved],
                         quantize: bool) -> CombineGrads:
        """Per-slot ``w * grad_y`` rounded at the experts in the dispatch layout; ``<grad_y, expert row>`` formed where
        the expert rows are (``saved``; None: no route-weight gradient)."""

    def dispatch_backward(self, grad_recv: Union[torch.Tensor, MXTensor], handle: EPHandle,
                          quantize: bool) -> torch.Tensor:
        """The rows' gradients back to their origins, one partial per (token, rank) (the :meth:`combine` math with
        weights 1): bfloat16 ``[T, H]``."""

    def check_errors(self) -> None:
        """Raise an error recorded on the device and not reported yet (no-op where every call checks itself)."""

    def refuse(self, op: str, exc: BaseException) -> None:
        """This rank refuses its input to ``op`` and raises ``exc`` without communicating: tell the peers if the
        backend can (so that their bounded waits name this rank and the reason)."""

    def state_tensors(self, handle: EPHandle) -> list[torch.Tensor]:
        """The backend part of ``handle`` as int32 tensors (what a compiled graph carries between the ops)."""

    def state_shapes(self, num_tokens: int, num_rows: int) -> list[tuple]:
        """Shapes of :meth:`state_tensors` for ``num_tokens`` tokens and ``num_rows`` output rows."""

    def handle_fields(self, plan: RoutingPlan, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """The :class:`EPHandle` fields this backend owns (``backend_state``, host split sizes), rebuilt from
        ``plan`` and :meth:`state_tensors`' values."""


def make_backend(config: EPConfig, group, rank: int, world_size: int, group_id: int, bounded=None) -> Backend:
    """The backend ``config.backend`` names, for rank ``rank`` of ``world_size`` on process group ``group``
    (``bounded``: the group's :class:`~mxcomm.transport.BoundedGroup`, through which the reference backend runs its
    collectives)."""
    if config.backend == "torch":
        from .reference import TorchBackend

        return TorchBackend(config, group, rank, world_size, group_id=group_id, bounded=bounded)
    if config.backend == "nvshmem":
        try:
            from .nvshmem.backend import NvshmemBackend  # type: ignore[import-not-found]
        except ImportError as e:
            raise ImportError(f"the 'nvshmem' EP backend is not available: {e}") from e
        return NvshmemBackend(config, group, rank, world_size, group_id=group_id, bounded=bounded)
    raise ValueError(f"unknown backend {config.backend!r}")  # EPConfig.validate rejects it first


__all__ = ["Backend", "make_backend"]
