"""The one-rank path (:class:`LocalPath`)."""
from __future__ import annotations

import torch

from ....kernels.launch import fast_kernel
from ...plan import RoutingPlan
from ..plan_graph import PlanOutputs
from .base import BackwardRows, DispatchRows, EnginePath


class LocalPath(EnginePath):
    """One rank: nothing leaves the GPU. Dispatch: the id check, counts and plan (captured once per token count and
    replayed), then ``local_rows_kernel`` reads each token row once, quantizes it once and stores it straight into the
    fresh output at every selection's row (scale rows into ``recv_s``), padding rows zeroed by the same launch; one
    host sync (the output size, with the id check). Combine and dispatch backward: the engine's reduce reads the
    expert rows in place (one partial per token). Combine backward: the same kernel as dispatch with per-slot
    weighting, and the route-weight gradient from the expert rows. Buffer: ``ep.recv_s`` (scale rows)."""

    name = "local"

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.recv_s = bufs["ep.recv_s"]

    def _middle(self, counts_buf: torch.Tensor, topk_idx: torch.Tensor) -> PlanOutputs:
        """Everything before the output kernel: the id check of the caller's ``topk_idx`` and the counts (read at the
        call's one host sync), the counts as the counts matrix, the plan of the checked ids on it (no epoch: nothing
        on one rank waits for a flag). ``extra["ids"]``: the checked ids."""
        e = self.e
        store = e.plan_store(topk_idx)
        ids = e.checked_ids(topk_idx, store=store, counts_out=counts_buf[0])
        po = e.compute_plan(counts_buf, ids, store=store)
        return PlanOutputs(plan=po.plan, extra={**po.extra, "ids": ids})

    def _out(self, x: torch.Tensor, plan: RoutingPlan, R: int, mx: bool, w: torch.Tensor, weighted: bool):
        """Fresh uint8 ``[R, H]`` (MX) / ``[R, 2H]`` (bf16 bytes) written by ``local_rows_kernel`` itself: each row of
        ``x`` (bf16 ``[T, H]``; ``weighted``: times ``w[t, j]`` per slot) read once, quantized (MX), stored at every
        selection's expert-major row, its scale row into ``recv_s``; padding rows zeroed by the same launch. No
        symmetric buffer holds the payload and nothing is copied afterwards."""
        from ..kernels.dispatch import local_rows_kernel

        e = self.e
        T, H = x.shape
        out = torch.empty(R, H if mx else 2 * H, dtype=torch.uint8, device=e.device)
        if R:
            fast_kernel(local_rows_kernel)[(e.output_programs(T),)](
                x, T, plan.dest_rank, plan.dest_row, out if mx else out.view(torch.bfloat16), self.recv_s.peer_ptrs,
                w, plan.offs, plan.expert_counts, plan.num_rows, R, e.El, H=H, K=e.config.topk,
                CHUNK=e.launch.row_chunk(H, weighted), MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round,
                WEIGHTED=weighted, num_warps=e.dispatch_warps(weighted),
            )
        return out

    def dispatch(self, x, topk_idx, topk_weights):
        e = self.e
        po = e.run_middle(self._middle, topk_idx)  # sends nothing: the id check is read at the output size sync
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        q = self._out(x, po.plan, R, e.mx, x, weighted=False)
        return DispatchRows(q=q, scale_rows=self.recv_s.local, kept=po, ids=po.extra["ids"], num_rows=R,
                            origins=None)

    def combine_backward(self, g, w, handle, mx, expert_out):
        from ....kernels.route_grad import route_weight_grad

        e = self.e
        q = self._out(g, handle.plan, handle.num_rows, mx, w, weighted=True)  # no handshake, nothing to wait for
        grad_w = None
        if expert_out is not None:  # <grad_y[t], out[row(t, j)]> where the rows are (here)
            grad_w = route_weight_grad(g, expert_out, handle.plan.dest_row, programs=e.route_grad_programs)
        return BackwardRows(q=q, scale_rows=self.recv_s.local, grad_w=grad_w)
