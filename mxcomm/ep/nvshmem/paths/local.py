"""The one-rank path (:class:`LocalPath`)."""
from __future__ import annotations

from typing import Optional

import torch

from ....kernels.launch import fast_kernel
from ...plan import RoutingPlan
from ..call_graph import CallOutputs, CallShape, CallTensors, copy_in, copy_out
from ..plan_graph import PlanOutputs
from .base import BackwardRows, DispatchRows, EnginePath

# the entries of a captured dispatch's address table (mxcomm.ep.nvshmem.kernels.call_io): x, topk_idx, the output,
# its grouped scales (MX), the copy of the checked ids and the plan, the scale rows (recv_s), the output's rows
_X, _IDS, _OUT, _SCALES, _PLAN, _SROWS, _ROWS = range(7)
# the plan tensors a dispatch as one call and the combine after it read (viewed before the call's host sync)
_READ_PLAN = ("offs", "expert_counts", "num_rows", "dest_rank", "dest_row")


class LocalPath(EnginePath):
    """One rank: nothing leaves the GPU. Dispatch: the id check, counts and plan (captured once per token count and
    replayed), then ``local_rows_kernel`` reads each token row once, quantizes it once and stores it straight into the
    fresh output at every selection's row (scale rows into ``recv_s``), padding rows zeroed by the same launch; one
    host sync (the output size, with the id check). With exact sizes and at most ``LaunchConfig.call_graph_tokens``
    tokens the whole dispatch is one captured call instead (:meth:`_dispatch_call`). Combine and dispatch backward:
    the engine's reduce reads the expert rows in place (one partial per token). Combine backward: the same kernel as
    dispatch with per-slot weighting, and the route-weight gradient from the expert rows. Buffer: ``ep.recv_s`` (scale
    rows)."""

    name = "local"
    #: captured copies of one reduce call (per token count and mode) taken in turn (:class:`CallGraphRing`)
    REDUCE_COPIES = 4

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.recv_s = bufs["ep.recv_s"]

    def _middle(self, counts_buf: torch.Tensor, topk_idx: torch.Tensor,
                store: Optional[torch.Tensor] = None) -> PlanOutputs:
        """Everything before the output kernel: the id check of the caller's ``topk_idx`` and the counts (read at the
        call's one host sync), the counts as the counts matrix, the plan of the checked ids on it (no epoch: nothing
        on one rank waits for a flag). ``extra["ids"]``: the checked ids. ``store``: the buffer of the ids and the
        plan (:meth:`NvshmemBackend.plan_store`; a fresh one when None)."""
        e = self.e
        if store is None:
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
        T = x.shape[0]
        if (e.config.exact_sizes and 0 < T <= e.launch.call_graph_tokens and e.plan_impl == "triton"
                and x.data_ptr() % 16 == 0 and not e.capturing()):
            return self._dispatch_call(x, topk_idx.contiguous())
        po = e.run_middle(self._middle, topk_idx)  # sends nothing: the id check is read at the output size sync
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        q = self._out(x, po.plan, R, e.mx, x, weighted=False)
        return DispatchRows(q=q, scale_rows=self.recv_s.local, kept=po, ids=po.extra["ids"], num_rows=R,
                            origins=None)

    # -- a dispatch of a few tokens as one call -------------------------------------------------
    def _call_body(self, table: torch.Tensor, shape: CallShape) -> CallOutputs:
        """Enqueue the whole dispatch of ``shape.T`` tokens reading its tensors' addresses from ``table`` (int64, the
        ``_X`` .. ``_ROWS`` entries): ``topk_idx`` copied into a buffer of the call's own (``[T, k]``, its dtype;
        inside a capture, the graph's: kept with the outputs, since the graph writes it at every replay), the middle
        (:meth:`_middle`), then (CUDA) the copy of the status words read at the call's sync (final after the middle:
        the sync returns while the rest runs), its checked ids and plan copied out (``plan_words`` int32 words), the
        output rows (``local_rows_at_kernel``: ``shape.rows`` rows, the padding and the rows past it as the plan
        says) and their grouped scales (``scale_rows_to_grouped_at_kernel``: every one of ``shape.scale_rows`` rows
        written; the output's rows, ``_ROWS``, are ``shape.rows``). Returns the middle's outputs (in the store, the
        call's own buffer: the graph's, when captured) and the ids' buffer."""
        from ..kernels.dispatch import local_rows_at_kernel

        e = self.e
        cfg = e.config
        H, k, T = cfg.hidden, cfg.topk, shape.T
        idx = torch.empty(T, k, dtype=shape.dtype, device=e.device)
        copy_in(table, _IDS, idx)
        store = e.plan_store(idx)
        po = self._middle(e.counts_mat, idx, store=store)
        e.status_words.enqueue_copy()  # final here (nothing after waits or fails): the host sync returns at its landing
        copy_out(store, table, _PLAN)
        plan = po.plan
        fast_kernel(local_rows_at_kernel)[(e.output_programs(T),)](
            table, T, plan.dest_rank, plan.dest_row, self.recv_s.peer_ptrs, plan.offs, plan.expert_counts,
            plan.num_rows, shape.rows, e.El, H=H, K=k, CHUNK=e.launch.row_chunk(H), MX=e.mx, MODE=e.mode_id,
            INT_ROUND=e.int_round, num_warps=e.dispatch_warps(False),
        )
        if e.mx:
            e.grouped_scales_at(table, _SROWS, _SCALES, _ROWS, plan, shape.scale_rows)
        return CallOutputs(middle=po, buffers=(idx,))

    def _dispatch_call(self, x: torch.Tensor, topk_idx: torch.Tensor) -> DispatchRows:
        """An exact-size dispatch of a few tokens as one call (``T <= LaunchConfig.call_graph_tokens``): on the GPU
        the whole of :meth:`_call_body` replayed from a :class:`CallGraph` captured per token count and id dtype (at a
        key's second call, as the middle is), with fresh output tensors whose addresses go in the graph's table;
        eager elsewhere and at a key's first two calls. Then the call's one host sync (the output size and the id
        check: it waits for the status words' copy, which comes before the output kernels, so the call returns while
        they run; stream order makes the outputs whole for whatever the stream runs next) and views of ``shape.rows``
        / ``shape.scale_rows``-row outputs: the output's storage holds the rows
        ``T`` tokens could fill at most (``T k + E (align - 1)``, rounded up to ``align``), its first ``R`` rows
        the output."""
        e = self.e
        T, H = x.shape
        shape = e.call_shape(T, topk_idx.dtype)
        t = CallTensors.alloc(shape.rows, shape, H, e.El, e.mx, e.device)
        addresses = (x.data_ptr(), topk_idx.data_ptr(), t.out.data_ptr(), CallTensors.address(t.scales),
                     t.plan_copy.data_ptr(), self.recv_s.local.data_ptr(), t.rows)
        layout = e.run_call(("local-call", T, topk_idx.dtype), addresses, lambda tb: self._call_body(tb, shape))
        kept = layout.read(t.plan_copy, now=_READ_PLAN)
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        return DispatchRows(q=t.out[:R], scale_rows=None, kept=kept, ids=kept.extra["ids"], num_rows=R, origins=None,
                            grouped_scales=t.grouped_scales(R, e.El))

    # -- combine and dispatch backward: the reduce ----------------------------------------------
    def reduce(self, rows: torch.Tensor, rows_s: torch.Tensor, plan: RoutingPlan, w: Optional[torch.Tensor],
               y: torch.Tensor, mx: bool, passthrough: bool) -> None:
        """``y[t]`` = the token's one partial (``local_reduce_kernel``: the rows of its valid slots, times ``w``
        unless None, summed in fp32, rounded once for transport - MXFP8 when ``mx``, else BF16). ``rows``: bf16 ``[R,
        H]``, or (``passthrough``) uint8 E4M3 payload with uint8 ``[R, H/32]`` row scales ``rows_s``; ``w`` fp32
        ``[T, k]`` or None; ``y`` bf16 ``[T, H]``, ``T > 0``, filled here. At most ``LaunchConfig.reduce_call_tokens``
        tokens, rows and ``y`` 16-byte aligned and no capture around: one call (``local_reduce_at_kernel`` reading the
        six addresses from a table; on the GPU replayed from a :class:`CallGraphRing` per token count and mode,
        :meth:`NvshmemBackend.run_ring_call`); else the kernel launched."""
        from ..kernels.combine import local_reduce_at_kernel, local_reduce_kernel

        e = self.e
        T, H = y.shape
        weighted = w is not None
        x_ptr, y_ptr = rows.data_ptr(), y.data_ptr()
        if T <= e.launch.reduce_call_tokens and not (x_ptr | y_ptr) % 16 and not e.capturing():
            addresses = (x_ptr, rows_s.data_ptr() if passthrough else 0, plan.dest_rank.data_ptr(),
                         plan.dest_row.data_ptr(), w.data_ptr() if weighted else 0, y_ptr)
            e.run_ring_call(("local-reduce", T, mx, passthrough, weighted), addresses,
                            lambda table: self._launch_reduce(local_reduce_at_kernel, (table, T), T, H, mx,
                                                              passthrough, weighted), self.REDUCE_COPIES)
            return
        self._launch_reduce(local_reduce_kernel, (rows, rows_s, plan.dest_rank, plan.dest_row,
                                                  e.err if w is None else w, y, T), T, H, mx, passthrough, weighted)

    def _launch_reduce(self, kernel, args: tuple, T: int, H: int, mx: bool, passthrough: bool, weighted: bool) -> None:
        """Launch ``kernel`` (``local_reduce_kernel`` or its table form) with ``args`` and the reduce's settings."""
        e = self.e
        chunk = e.launch.reduce_row_chunk(H, True, mx)
        fast_kernel(kernel)[e._reduce_grid(T, H, chunk)](
            *args, H=H, K=e.config.topk, CHUNK=chunk, MX=mx, PASS=passthrough, WEIGHTED=weighted, MODE=e.mode_id,
            INT_ROUND=e.int_round, num_warps=4, enable_fp_fusion=False,
        )

    def combine_backward(self, g, w, handle, mx, expert_out):
        from ....kernels.route_grad import route_weight_grad

        e = self.e
        q = self._out(g, handle.plan, handle.num_rows, mx, w, weighted=True)  # no handshake, nothing to wait for
        grad_w = None
        if expert_out is not None:  # <grad_y[t], out[row(t, j)]> where the rows are (here)
            grad_w = route_weight_grad(g, expert_out, handle.plan.dest_row, programs=e.route_grad_programs)
        return BackwardRows(q=q, scale_rows=self.recv_s.local, grad_w=grad_w)
