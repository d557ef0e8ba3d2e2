"""Where each row of a dispatch output came from, on the ``nvshmem`` backend: :class:`RowOrigins` (origin rank and
send position per expert-major row), :func:`row_origins` (from the plan, torch), :func:`handle_origins` (kept by the
dispatch, or computed when a later op needs them), and :class:`NvshmemState`, the backend's part of an
:class:`~mxcomm.ep.handle.EPHandle`. Shared by the engine (:mod:`mxcomm.ep.nvshmem.backend`) and its paths
(:mod:`mxcomm.ep.nvshmem.paths`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import plan_kernels
from ..handle import EPHandle
from ..plan import RoutingPlan, recv_rows


@dataclass(frozen=True)
class RowOrigins:
    """For each expert-major row of a dispatch output: origin rank (-1 = padding) and its position
    in the origin's send order. int32 ``[R]`` each, device tensors."""

    src: torch.Tensor
    pos: torch.Tensor


def row_origins(plan: RoutingPlan, n_rows: int) -> RowOrigins:
    """Origin (rank, send position) of each of ``n_rows`` expert-major rows (torch, no host sync).

    Receive order (source-major, then local expert, then the source's send order; see
    :func:`mxcomm.ep.plan.recv_rows`) maps each real row to its source block; the position in the
    source's send order is that block's ``src_send_pos`` plus the offset inside the block.
    """
    W, El = plan.world_size, plan.num_local_experts
    dev = plan.device
    lo = plan.rank * El
    sizes = plan.counts[:, lo:lo + El].to(torch.int64).reshape(-1)
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    j = torch.arange(n_rows, dtype=torch.int64, device=dev)  # real rows <= n_rows, so this covers them
    seg = torch.clamp(torch.searchsorted(ends, j, right=True), max=W * El - 1)
    rows = recv_rows(plan, n_rows).to(torch.int64)
    pos = plan.src_send_pos.to(torch.int64).reshape(-1)[seg] + j - starts[seg]
    dst = torch.where(rows >= 0, rows, torch.full_like(rows, n_rows))  # invalid -> spill slot
    out_src = torch.full((n_rows + 1,), -1, dtype=torch.int32, device=dev)
    out_pos = torch.full((n_rows + 1,), -1, dtype=torch.int32, device=dev)
    out_src.scatter_(0, dst, (seg // El).to(torch.int32))
    out_pos.scatter_(0, dst, pos.to(torch.int32))
    return RowOrigins(src=out_src[:n_rows].contiguous(), pos=out_pos[:n_rows].contiguous())


@dataclass(frozen=True)
class DeliveredWeights:
    """Route weights that travelled with a dispatch's pull-list entries: ``table`` fp32 ``[W * T_max, k]``, entry
    ``s * T_max + t`` = source ``s``'s weights of token ``t`` as its dispatch read them (rows of the dispatch's table);
    ``source`` the tensor this rank's dispatch read its own from (kept, so that its storage is not reused while the
    handle lives) and ``version`` its version counter then (in-place changes advance it)."""

    table: torch.Tensor
    source: torch.Tensor
    version: int

    @staticmethod
    def of(table: torch.Tensor, w: torch.Tensor) -> "DeliveredWeights":
        """The weights ``table`` received by a dispatch that was given ``w`` (float ``[T, k]``)."""
        return DeliveredWeights(table=table, source=w, version=w._version)

    def sent(self, w: torch.Tensor) -> bool:
        """True when ``w`` holds the values this rank's dispatch sent: the same storage (an alias such as
        ``w.detach()`` or a full view counts; a copy, even an empty one, does not), offset, shape, strides and dtype,
        unchanged since."""
        s = self.source
        return (w.dtype == s.dtype and w.shape == s.shape and w.stride() == s.stride()
                and w.storage_offset() == s.storage_offset() and w._version == self.version
                and w.untyped_storage()._cdata == s.untyped_storage()._cdata)


@dataclass(frozen=True)
class NvshmemState:
    """Backend part of an :class:`EPHandle`: row origins of the dispatch output (None on the local path, whose
    dispatch does not need them: :func:`handle_origins` computes them when a later op does), its real row count on
    the device, and (several ranks) the dispatch's table: int32 ``[W * T_max, k]``, entry ``s * T_max + t`` = the
    expert-major rows here of source ``s``'s token ``t`` per slot (-1 for slots on other ranks; all -1 when the token
    did not come here). Combine and combine backward move one row per entry with a row. ``weights``: the sources'
    route weights that came with the dispatch's entries (several ranks; None on the local path and in a handle rebuilt
    by the compiled ops), which combine on the peer-pointer paths uses instead of exchanging the weights when every
    rank combines with what it dispatched."""

    origins: Optional[RowOrigins]
    num_rows_dev: torch.Tensor  # int32 [1] real rows (offs[-1])
    table: Optional[torch.Tensor] = None
    weights: Optional[DeliveredWeights] = None


def handle_origins(handle: EPHandle) -> RowOrigins:
    """The row origins of ``handle``'s dispatch output: kept by the dispatch, or (local path) computed now from
    its plan (Triton kernel where the plan's tables fit it, else torch)."""
    st: NvshmemState = handle.backend_state
    if st.origins is not None:
        return st.origins
    plan, R = handle.plan, handle.num_rows
    if plan_kernels.fits(plan.world_size, plan.num_experts):
        o = plan_kernels.plan_row_origins(plan, R)
        return RowOrigins(src=o["origin_src"], pos=o["origin_pos"])
    return row_origins(plan, R)


__all__ = ["RowOrigins", "row_origins", "NvshmemState", "DeliveredWeights", "handle_origins"]
