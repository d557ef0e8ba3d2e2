"""Values returned by ``EPGroup.dispatch``: the received rows (DispatchResult) and the handle linking
dispatch to combine and to both backward passes (EPHandle)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ..mx import MXTensor
from .config import EPConfig
from .plan import RoutingPlan


@dataclass(frozen=True)
class DispatchResult:
    """Rows received by this rank for its local experts, expert-major.

    Attributes:
        x: precision ``"mxfp8"``: :class:`MXTensor` with ``qdata`` float8_e4m3fn ``[R, H]``, scales
            uint8 in layout GROUPED_M with ``group_offs = offs`` (per-group 128x4-blocked,
            ``[grouped_m_rows(R, El), round_up(H/32, 4)]``), axis 1, the config's scale mode.
            Precision ``"bf16"``: a bfloat16 ``[R, H]`` tensor. Padding rows are zero (payload and
            scale bytes).
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
class EPHandle:
    """Everything combine and the backward passes need about one dispatch.

    Attributes:
        config: the group's :class:`EPConfig`.
        plan: the :class:`RoutingPlan` (all routing tensors, int32, on the data device).
        topk_idx: the dispatch's ``[T, k]`` expert ids (as passed).
        topk_weights: the dispatch's ``[T, k]`` route weights (as passed).
        num_tokens: T.
        num_rows: R, rows of the dispatch output (and of ``expert_out`` for combine).
        device: device of the dispatch input.
        send_splits_host / recv_splits_host: per-rank row counts on the host when the backend
            synchronised to learn them (reference backend), else None.
        backend_state: backend-specific state (e.g. the nvshmem backend's row origins), else None.
    """

    config: EPConfig
    plan: RoutingPlan
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int
    num_rows: int
    device: torch.device
    send_splits_host: Optional[tuple] = None
    recv_splits_host: Optional[tuple] = None
    backend_state: Optional[Any] = None


__all__ = ["DispatchResult", "EPHandle"]
