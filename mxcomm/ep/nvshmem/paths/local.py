"""The one-rank path (:class:`LocalPath`)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from ....kernels.launch import cdiv, fast_kernel
from ....mx import grouped_m_rows, round_up
from ...plan import PLAN_TENSORS, RoutingPlan
from .. import plan_kernels
from ..call_graph import CallGraph
from ..plan_graph import OutputCopier, PlanOutputs
from .base import BackwardRows, DispatchRows, EnginePath

# the entries of a captured dispatch's address table (mxcomm.ep.nvshmem.kernels.call_io): x, topk_idx, the output,
# its grouped scales (MX), the copy of the checked ids and the plan
_X, _IDS, _OUT, _SCALES, _PLAN = range(5)
_COPY_BLOCK = 1024  # int32 words per step of copy_in_kernel / copy_out_kernel


@dataclass(frozen=True)
class _CallShape:
    """What a dispatch of ``T`` tokens (ids of ``dtype``) run as one call allocates: ``rows`` output rows (the most
    ``T`` tokens can fill with their groups' padding), ``scale_rows`` rows of its grouped scales, ``plan_words``
    int32 words of the checked ids and the plan."""

    T: int
    dtype: torch.dtype
    rows: int
    scale_rows: int
    plan_words: int


@dataclass(frozen=True)
class _PlanLayout:
    """How a call's copy of its checked ids and plan is read: ``copier`` lays the copy out as views, ``scalars`` the
    plan's fields that are not tensors (the same for every call of a shape)."""

    copier: OutputCopier
    scalars: dict

    @staticmethod
    def of(po: PlanOutputs) -> "_PlanLayout":
        """The layout of the plan tensors and the checked ids of ``po`` in their store (all of them: the Triton plan
        writes every output there, and the store is all a call copies out)."""
        copier = OutputCopier({**{n: getattr(po.plan, n) for n in PLAN_TENSORS}, **po.extra})
        if copier.aux_names:
            raise RuntimeError(f"the dispatch's outputs {copier.aux_names} are not in the plan's store, which is all "
                               "a call copies out")
        scalars = {f.name: getattr(po.plan, f.name) for f in fields(RoutingPlan) if f.name not in PLAN_TENSORS}
        return _PlanLayout(copier=copier, scalars=scalars)

    def read(self, plan_copy: torch.Tensor) -> PlanOutputs:
        """The plan and the checked ids (``extra["ids"]``) as views of ``plan_copy`` (int32, a copy of the store)."""
        vals = self.copier.views(plan_copy.view(torch.uint8), self.copier.aux)  # (aux: empty, see of)
        plan = RoutingPlan(**self.scalars, **{n: vals[n] for n in PLAN_TENSORS})
        return PlanOutputs(plan=plan, extra={"ids": vals["ids"]})


@dataclass(frozen=True)
class _CallOutputs:
    """What :meth:`LocalPath._call_body` enqueued that outlives it: the middle's outputs (the checked ids and the plan
    in their store) and ``ids_in``, the buffer the caller's ids are copied into. A captured call's are the graph's
    memory, written at every replay: the graph keeps them (:attr:`CallGraph.outputs`), so that no other tensor is
    given their memory while the graph can still write it."""

    middle: PlanOutputs
    ids_in: torch.Tensor


@dataclass(frozen=True)
class _CapturedCall:
    """A dispatch captured for one :class:`_CallShape`: the graph and the layout of its plan copy."""

    graph: CallGraph
    layout: _PlanLayout


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

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.recv_s = bufs["ep.recv_s"]
        self._shapes: dict = {}  # ("local-call", T, ids dtype) -> _CallShape of a dispatch run as one call

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
    def _call_shape(self, T: int, dtype: torch.dtype) -> _CallShape:
        e = self.e
        cfg = e.config
        k, E = cfg.topk, cfg.num_experts
        rows = round_up(T * min(k, E) + E * (cfg.align - 1), cfg.align)
        return _CallShape(T=T, dtype=dtype, rows=rows, scale_rows=grouped_m_rows(rows, e.El),
                          plan_words=T * k + plan_kernels.plan_numel(1, E, T, k, 0))

    def _call_body(self, table: torch.Tensor, shape: _CallShape) -> "_CallOutputs":
        """Enqueue the whole dispatch of ``shape.T`` tokens reading its tensors' addresses from ``table`` (int64, the
        ``_X`` .. ``_PLAN`` entries): ``topk_idx`` copied into a buffer of the call's own (``[T, k]``, its dtype;
        inside a capture, the graph's: kept with the outputs, since the graph writes it at every replay), the middle
        (:meth:`_middle`), its checked ids and plan copied out (``plan_words`` int32 words), the output rows
        (``local_rows_at_kernel``: ``shape.rows`` rows, the padding and the rows past it as the plan says) and
        their grouped scales (``scale_rows_to_grouped_at_kernel``: every one of ``shape.scale_rows`` rows written),
        then (CUDA) the copy of the status words read at the call's sync. Returns the middle's outputs (in the store,
        the call's own buffer: the graph's, when captured) and the ids' buffer."""
        from ..kernels.call_io import copy_in_kernel, copy_out_kernel
        from ..kernels.dispatch import local_rows_at_kernel
        from ..kernels.layout import scale_rows_to_grouped_at_kernel

        e = self.e
        cfg = e.config
        H, k, T = cfg.hidden, cfg.topk, shape.T
        idx = torch.empty(T, k, dtype=shape.dtype, device=e.device)
        n_idx = idx.numel() * idx.element_size() // 4
        fast_kernel(copy_in_kernel)[(min(cdiv(n_idx, _COPY_BLOCK), 64),)](
            table, _IDS, idx.view(-1).view(torch.int32), n_idx, BLOCK=_COPY_BLOCK)
        store = e.plan_store(idx)
        po = self._middle(e.counts_mat, idx, store=store)
        fast_kernel(copy_out_kernel)[(min(cdiv(shape.plan_words, _COPY_BLOCK), 64),)](
            store, table, _PLAN, shape.plan_words, BLOCK=_COPY_BLOCK)
        plan = po.plan
        fast_kernel(local_rows_at_kernel)[(e.output_programs(T),)](
            table, T, plan.dest_rank, plan.dest_row, self.recv_s.peer_ptrs, plan.offs, plan.expert_counts,
            plan.num_rows, shape.rows, e.El, H=H, K=k, CHUNK=e.launch.row_chunk(H), MX=e.mx, MODE=e.mode_id,
            INT_ROUND=e.int_round, num_warps=e.dispatch_warps(False),
        )
        if e.mx:
            g = e.grouped_scales_launch(shape.scale_rows)
            fast_kernel(scale_rows_to_grouped_at_kernel)[g.grid](
                self.recv_s.local.view(-1).view(torch.int32) if g.word else self.recv_s.local, table, _SCALES,
                plan.offs, plan.num_rows, plan.expert_counts, e.El, g.n_col_tiles, C=g.C, CB=g.CB, G_POW2=g.G_POW2,
                WORD=g.word, TAIL=True, num_warps=4,
            )
        if e.device.type == "cuda":
            e.status_words.enqueue_copy()
        return _CallOutputs(middle=po, ids_in=idx)

    def _dispatch_call(self, x: torch.Tensor, topk_idx: torch.Tensor) -> DispatchRows:
        """An exact-size dispatch of a few tokens as one call (``T <= LaunchConfig.call_graph_tokens``): on the GPU
        the whole of :meth:`_call_body` replayed from a :class:`CallGraph` captured per token count and id dtype (at a
        key's second call, as the middle is), with fresh output tensors whose addresses go in the graph's table;
        eager elsewhere and at a key's first two calls. Then the call's one host sync (the output size and the id
        check) and views of ``shape.rows`` / ``shape.scale_rows``-row outputs: the output's storage holds the rows
        ``T`` tokens could fill at most (``T k + E (align - 1)``, rounded up to ``align``), its first ``R`` rows
        the output."""
        e = self.e
        T, H = x.shape
        key = ("local-call", T, topk_idx.dtype)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._call_shape(T, topk_idx.dtype)
        out = torch.empty(shape.rows, H if e.mx else 2 * H, dtype=torch.uint8, device=e.device)
        scales = (torch.empty(shape.scale_rows, round_up(H // 32, 4), dtype=torch.uint8, device=e.device)
                  if e.mx else None)
        plan_copy = torch.empty(shape.plan_words, dtype=torch.int32, device=e.device)
        addresses = (x.data_ptr(), topk_idx.data_ptr(), out.data_ptr(), 0 if scales is None else scales.data_ptr(),
                     plan_copy.data_ptr())
        cap = e.captured_graph(key) if e.device.type == "cuda" else None
        if cap is None:
            table = torch.tensor(addresses, dtype=torch.int64).to(e.device)
            layout = _PlanLayout.of(self._call_body(table, shape).middle)
            if e.device.type == "cuda":
                e.status_words.note_copy_enqueued()
                if e.second_sighting(key):
                    graph = CallGraph(e.device, len(addresses), lambda t: self._call_body(t, shape))
                    e.remember_graph(key, _CapturedCall(graph=graph, layout=_PlanLayout.of(graph.outputs.middle)))
        else:
            cap.graph.replay(addresses)
            e.status_words.note_copy_enqueued()
            layout = cap.layout
        kept = layout.read(plan_copy)
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        grouped = None if scales is None else scales[:grouped_m_rows(R, e.El)]
        ids = kept.extra["ids"]
        return DispatchRows(q=out[:R], scale_rows=self.recv_s.local, kept=kept, ids=ids, num_rows=R, origins=None,
                            grouped_scales=grouped)

    def combine_backward(self, g, w, handle, mx, expert_out):
        from ....kernels.route_grad import route_weight_grad

        e = self.e
        q = self._out(g, handle.plan, handle.num_rows, mx, w, weighted=True)  # no handshake, nothing to wait for
        grad_w = None
        if expert_out is not None:  # <grad_y[t], out[row(t, j)]> where the rows are (here)
            grad_w = route_weight_grad(g, expert_out, handle.plan.dest_row, programs=e.route_grad_programs)
        return BackwardRows(q=q, scale_rows=self.recv_s.local, grad_w=grad_w)
