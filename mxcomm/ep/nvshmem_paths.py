"""The ways the ``nvshmem`` backend moves rows, one class per path (:func:`mxcomm.ep.plan.dispatch_path`):

* :class:`LocalPath` (one rank): nothing leaves the GPU; dispatch and combine backward write the output directly,
  combine reduces the expert rows in place;
* :class:`PullPath` (several ranks with peer pointers, the default): senders pack each token row once into their send
  copy; receivers read each listed row once per (token, rank) through the peer pointer into fresh tensors;
* :class:`PushPath` (``transport="push"``): senders store the rows into the receivers' symmetric buffer at their
  expert-major rows; receivers copy them out (through a window of rows, in rounds when a rank receives more);
* :class:`PutPath` (``transport="put"``, or peers on other nodes): the push path's kernels write into a staging
  buffer and NVSHMEM puts one block per (destination, expert) with a signal (``csrc/put_signal.cu``), through the
  same window.

Every path with several ranks answers a dispatch one row per (token, rank) in both directions, through the
dispatch's table (one entry per (source token, this rank), kept in the handle): combine and dispatch backward send
the partial sum of a token's rows on this rank (:meth:`EnginePath.send_partials`), combine backward brings each
BF16 gradient row once per (token, rank) to the expert rank, which weights and quantizes it per slot where it lands
and forms the route-weight gradient there (:meth:`EnginePath.combine_backward`).

Each path owns its buffers (taken by name from the symmetric heap's allocation of
:func:`mxcomm.ep.plan.buffer_regions`) and launches its own kernels; the engine (:class:`NvshmemBackend
<mxcomm.ep.nvshmem_backend.NvshmemBackend>`) holds what every path shares: the epochs, flags and counts, the error
words and bounded waits, the routing plan and its captured graphs, the output formatting and the reduce at the
origin. What a path does per call:

* :meth:`EnginePath.dispatch` -> :class:`DispatchRows` (the received rows and their scale rows, the plan the handle
  keeps, the row origins, the table);
* :meth:`EnginePath.combine_backward` -> :class:`BackwardRows` (the weighted gradient rows at the expert ranks, the
  route-weight gradient at the origin);
* :meth:`EnginePath.combine_weights` and :meth:`EnginePath.send_partials`: the route weights combine weights the
  partial sums with (those that came with the dispatch's entries on the pull and push paths, else exchanged: every
  rank's to every rank),
  and the partials of combine / dispatch backward to their origins' ``comb_q`` (then wait for every rank's);
* :meth:`EnginePath.exchange`: the counts exchange or the "ready" handshake.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.launch import cdiv, fast_kernel, next_pow2
from . import put_path
from .handle import EPHandle
from .plan import FLAG_ROWS, RoutingPlan, received_rows, recv_window_rows
from .nvshmem_state import DeliveredWeights, RowOrigins
from .plan_graph import PlanOutputs

PUSH_BLOCK = 64  # tokens per block of push_entries_kernel

_PUBLISH_BLOCK = 1024  # int32 words per step of publish_kernel
_ROW_FLAGS = {name: i for i, name in enumerate(FLAG_ROWS)}  # rows of ep.flags


def fp32_weights(w: torch.Tensor) -> torch.Tensor:
    """Route weights ``w`` (float ``[T, k]``) as the contiguous fp32 tensor the kernels read (``w`` itself when it
    is one)."""
    return w if w.dtype == torch.float32 and w.is_contiguous() else w.to(torch.float32).contiguous()


@dataclass(frozen=True)
class DispatchRows:
    """What a path's dispatch produced: ``q`` fresh uint8 ``[R, H]`` (MX payload) / ``[R, 2H]`` (bf16 bytes) rows,
    ``scale_rows`` their row-major uint8 ``[>= R, H/32]`` scale rows (MX), ``kept`` the plan outputs the handle keeps,
    ``ids`` the checked expert ids ``[T, k]``, ``num_rows`` R, ``origins`` the row origins and ``table`` the dispatch's
    table (both None on the local path), ``weights`` the sources' route weights that came with the pull-list entries
    (None on the local path)."""

    q: torch.Tensor
    scale_rows: torch.Tensor
    kept: PlanOutputs
    ids: torch.Tensor
    num_rows: int
    origins: Optional[RowOrigins]
    table: Optional[torch.Tensor] = None
    weights: Optional[DeliveredWeights] = None


@dataclass(frozen=True)
class BackwardRows:
    """Combine backward's result: ``q`` fresh uint8 ``[R, H]`` / ``[R, 2H]`` rows at the expert rank, ``scale_rows``
    their row-major scale rows (MX), ``grad_w`` fp32 ``[T, k]`` route-weight gradient at the origin (None when not
    asked for)."""

    q: torch.Tensor
    scale_rows: torch.Tensor
    grad_w: Optional[torch.Tensor]


class EnginePath:
    """One way of moving rows (see the module doc). ``engine``: the :class:`~mxcomm.ep.nvshmem_backend.NvshmemBackend`
    that owns this path (this module does not import it: the engine imports the paths); ``bufs``: its symmetric
    buffers by name. The base class moves rows through peer pointers (the pull and push paths share its combine
    direction and its combine backward)."""

    name = ""

    def __init__(self, engine, bufs: dict):
        self.e = engine
        if "ep.comb_w" not in bufs:  # the local path
            return
        e = engine
        T, k = e.config.max_tokens_per_rank, e.config.topk
        self.comb_w, self.comb_gw = bufs["ep.comb_w"], bufs["ep.comb_gw"]
        self.send_q, self.send_w = bufs["ep.send_q"], bufs["ep.send_w"]
        self.pull_list = bufs["ep.pull_list"]
        # by source rank: where its BF16 gradient rows and weights are read in combine backward (its send copies; copy
        # 1 starts g_copy / w_copy values after copy 0), and where the route-weight gradients formed here go (this
        # rank's row of its comb_gw)
        self.g_src, self.w_src = self.send_q.peer_ptrs, self.send_w.peer_ptrs
        self.g_copy, self.w_copy = T * e.config.hidden, T * k
        self.gw_dst = self.comb_gw.peer_ptrs + e.rank * T * k * 4
        # the launch arguments of the waits in a launch's last program (fixed per engine: made once): the partial
        # sums' (flag row 2) and combine backward's route-weight gradients' (row 4)
        self._partials_wait = dict(ticket_ptr=e.tickets[3:4], flags_row_ptr=e.flag_rows[2],
                                   expect_row_ptr=e.expect_rows[2], timeout_ns=e.timeout_ns, WAIT=True)
        self._gradients_wait = dict(ticket_ptr=e.tickets[4:5], flags_row_ptr=e.flag_rows[4],
                                    expect_row_ptr=e.expect_rows[4], err_ptr=e.err, timeout_ns=e.timeout_ns, WAIT=True)

    def _rows_of(self, buf: torch.Tensor, row_bytes: int) -> torch.Tensor:
        """int64 ``[W]``: the address of row ``s`` (``row_bytes`` bytes each) of this rank's ``buf``, by ``s``."""
        e = self.e
        return torch.arange(e.world, dtype=torch.int64, device=e.device) * row_bytes + buf.data_ptr()

    def refuse_capture(self) -> None:
        """Raise before any work if the current stream is being captured and this path cannot be."""

    # -- handshakes ---------------------------------------------------------------------------
    def _publish(self, src: torch.Tensor, n_words: int, dst_peers: torch.Tensor, dst_word0: int, row: str,
                 epoch: torch.Tensor, tail_word: int = -1, wait: bool = True) -> None:
        from .nvshmem_kernels import publish_kernel

        e = self.e
        fast_kernel(publish_kernel)[(e.world,)](
            src, n_words, dst_peers, dst_word0, tail_word, e.flags.peer_ptrs, e.flags.local, _ROW_FLAGS[row], e.world,
            epoch, e.err, e.timeout_ns, e.rank, BLOCK=_PUBLISH_BLOCK, WAIT=wait,
        )

    def exchange(self, my_counts: Optional[torch.Tensor], wait: bool = True) -> None:
        """Publish this rank's int32 ``[E + 1]`` counts and refusal word to every rank and wait (bounded) for
        everybody's (``None``: the "ready" handshake only), through peer pointers. The dispatch epoch must already be
        advanced. ``wait=False`` (counts only): publish, and leave the wait to :meth:`wait_for_counts`."""
        e = self.e
        if my_counts is None:
            self._publish(e.err, 0, e.counts.peer_ptrs, 0, "counts", e.d_epoch)
            return
        E = e.config.num_experts
        self._publish(my_counts, E, e.counts.peer_ptrs, e.rank * E, "counts", e.d_epoch,
                      tail_word=e.world * E + e.rank, wait=wait)

    def wait_for_counts(self) -> None:
        """The wait (bounded) for every rank's counts of this dispatch epoch that ``exchange(..., wait=False)`` left
        out."""
        from .nvshmem_kernels import wait_published_kernel

        e = self.e
        fast_kernel(wait_published_kernel)[(e.world,)](e.flags.local, _ROW_FLAGS["counts"], e.world, e.d_epoch, e.err,
                                                       e.timeout_ns, num_warps=e.launch.wait_warps)

    def _wait_arrivals(self, row: int, per_call: int) -> None:
        """The bounded wait for every source's ``per_call`` arrivals of this call on flag row ``row``
        (``wait_arrivals_kernel``; each source's programs add 1 there when done)."""
        from .nvshmem_kernels import wait_arrivals_kernel

        e = self.e
        fast_kernel(wait_arrivals_kernel)[(e.world,)](e.flag_rows[row], e.expect_rows[row], per_call, e.err,
                                                      e.timeout_ns, num_warps=e.launch.wait_warps)

    def publish_weights(self, w: Optional[torch.Tensor]) -> None:
        """Combine's route weights (fp32 ``[T, k]``) into row ``me`` of every rank's ``comb_w``, then wait (bounded)
        for every rank's: the expert side weights its partial sums with them. ``None``: no weights (dispatch backward;
        nothing to do on the peer-pointer paths). The combine epoch must already be advanced."""
        if w is None:
            return
        e = self.e
        T_max, k = e.config.max_tokens_per_rank, e.config.topk
        self._publish(w.view(torch.int32), w.numel(), self.comb_w.peer_ptrs, e.rank * T_max * k, "weights", e.c_epoch)

    # the peer-pointer paths weight combine's partial sums with the weights that came with the dispatch's entries when
    # they can (combine_weights); the put path always exchanges them (PutPath)
    keeps_dispatch_weights = True

    def combine_weights(self, w: Optional[torch.Tensor], handle: EPHandle) -> Optional[torch.Tensor]:
        """The route weights the expert side weights its partial sums with, fp32 ``[W * T_max, k]`` by table entry.
        ``w`` (float ``[T, k]``) is the tensor this rank dispatched with, unchanged (:meth:`DeliveredWeights.sent`):
        the weights that came with the dispatch's entries (the handle's, nothing exchanged). Other weights: every
        rank's exchanged (:meth:`publish_weights`, bounded) into ``comb_w``. ``None`` (dispatch backward): None, after
        the path's handshake for it (the put path's "ready").

        Every rank must decide alike (the same tensor on every rank, as with any collective argument); when one does
        not, the ranks that exchange wait for weights that are never published, their bounded wait fails and they
        send no partials, so every rank's combine fails (PeerTimeout) rather than sum partials formed with other
        weights."""
        if w is None:
            self.publish_weights(None)
            return None
        d = handle.backend_state.weights
        if self.keeps_dispatch_weights and d is not None and d.sent(w):
            return d.table
        self.publish_weights(fp32_weights(w))
        return self.comb_w.local.view(-1, self.e.config.topk)

    # -- combine direction ------------------------------------------------------------------
    def send_partials(self, payload: torch.Tensor, in_scales: torch.Tensor, handle: EPHandle, mx: bool,
                      passthrough: bool, weights: Optional[torch.Tensor]) -> None:
        """For every (source, token) entry of the handle's table, the partial sum of its rows of ``payload`` (bf16
        ``[R, H]``; or MXFP8 bytes ``[R, H]`` with row scales ``in_scales`` when ``passthrough``), weighted with the
        entry's ``weights`` (fp32 ``[W * T_max, k]``, :meth:`combine_weights`; None: every weight 1), rounded once
        (MXFP8 when ``mx``, else BF16) into the origin's ``comb_q`` at the send position of the token's leading slot
        (copy ``c_epoch % 2``); then wait (bounded) for every rank's partials."""
        e = self.e
        # (the wait for every rank's partials: in the launch's last program)
        self._partials(payload, in_scales, handle, mx, passthrough, weights, e.comb[0].peer_ptrs,
                       e.comb[1].peer_ptrs, staged=False)

    def _partials(self, payload, in_scales, handle, mx, passthrough, weights, q_ptrs, s_ptrs, staged):
        """``combine_partials_kernel``; not ``staged``, its last program waits for every rank's partials."""
        from .nvshmem_kernels import combine_partials_kernel

        e = self.e
        H = e.config.hidden
        st = handle.backend_state
        wait = {} if staged else self._partials_wait
        fast_kernel(combine_partials_kernel)[(e.programs,)](
            payload, in_scales, st.table, st.origins.pos, e.err if weights is None else weights, q_ptrs, s_ptrs,
            e.flags.peer_ptrs, e.rank, e.world, e.config.max_tokens_per_rank, e.c_epoch, e.nslot, e.err, H=H,
            K=e.config.topk, CHUNK=e.launch.partials_row_chunk(H), MX=mx, PASS=passthrough,
            WEIGHTED=weights is not None, MODE=e.mode_id,
            INT_ROUND=e.int_round, STAGED=staged, ROWS=e.launch.partials_rows, num_warps=e.launch.weighted_warps,
            enable_fp_fusion=False, **wait,
        )

    # -- combine backward (the dispatch direction) -------------------------------------------
    def _deliver_gradients(self, g: torch.Tensor, w: torch.Tensor, handle: EPHandle) -> None:
        """Epoch += 1, then make every source's BF16 gradient rows and weights readable at ``g_src`` / ``w_src``: pack
        them into this rank's send copy and publish "ready" in one launch (``pack_ready_kernel``), then wait for every
        rank's "ready" (every rank packed; every rank finished reading the copy of the previous call in this
        direction)."""
        from .nvshmem_kernels import pack_ready_kernel

        e = self.e
        T, H, k = g.shape[0], e.config.hidden, e.config.topk
        fast_kernel(pack_ready_kernel)[(max(1, min(T, e.dispatch_programs)),)](
            g, T, self.send_q.local.view(torch.bfloat16), e.d_epoch, e.config.max_tokens_per_rank, self.g_copy, w,
            self.send_w.local, e.tickets[5:6], e.flags.peer_ptrs,
            _ROW_FLAGS["counts"], e.world, e.rank, H=H, CHUNK=e.launch.row_chunk(H), K=k,
            K_POW2=next_pow2(k), num_warps=e.launch.dispatch_warps,
        )
        self.wait_for_counts()  # (the "ready" flags are the counts row's)

    def combine_backward(self, g: torch.Tensor, w: torch.Tensor, handle: EPHandle, mx: bool,
                         expert_out: Optional[torch.Tensor]) -> BackwardRows:
        """Every (source, token) of the handle's table gets its BF16 gradient row once; the expert rank weights and
        quantizes it per slot into fresh tensors and, with ``expert_out`` (the rows the forward combine was given),
        forms the route-weight gradient, which goes back to the origins' ``comb_gw``."""
        from .nvshmem_kernels import pull_weighted_kernel

        e = self.e
        self._deliver_gradients(g, w, handle)  # (epoch += 1 first)
        plan, R = handle.plan, handle.num_rows
        H, T_max, k = e.config.hidden, e.config.max_tokens_per_rank, e.config.topk
        row_bytes = H if mx else 2 * H
        out = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
        srows = self._scale_rows(R, mx)
        rg = expert_out is not None
        wait = self._gradients_wait if rg and self.gw_arrive else {}
        fast_kernel(pull_weighted_kernel)[(e.programs,)](
            out if mx else out.view(torch.bfloat16), srows, plan.offs, plan.expert_counts, plan.num_rows, e.El, R,
            self.g_src, self.w_src, handle.backend_state.table, e.d_epoch, T_max, e.world, self.g_copy, self.w_copy,
            expert_out if rg else e.err, self.gw_dst, e.flags.peer_ptrs, e.rank,
            H=H, CHUNK=e.launch.row_chunk(H, True), K=k, K_POW2=next_pow2(k), MX=mx, MODE=e.mode_id,
            INT_ROUND=e.int_round,
            ZCHUNK=min(512, next_pow2(row_bytes // 8)), ROUTE_GRAD=rg, ARRIVE=self.gw_arrive,
            num_warps=e.dispatch_warps(True), **wait,
        )
        grad_w = self._route_grads(plan, g.shape[0]) if rg else None
        return BackwardRows(q=out, scale_rows=srows, grad_w=grad_w)

    gw_arrive = True  # pull_weighted_kernel raises flags[4] on the peers (the put path puts instead)

    def _route_grads(self, plan: RoutingPlan, T: int) -> torch.Tensor:
        """This rank's fp32 ``[T, k]`` route-weight gradients, gathered once every rank's arrived (the wait: in
        ``pull_weighted_kernel``'s last program)."""
        return self._gather_route_grads(plan, T)

    def _gather_route_grads(self, plan: RoutingPlan, T: int) -> torch.Tensor:
        from .nvshmem_kernels import gather_route_grad_kernel

        e = self.e
        k = e.config.topk
        gw = torch.empty(T, k, dtype=torch.float32, device=e.device)
        if T:
            fast_kernel(gather_route_grad_kernel)[(cdiv(T * k, 1024),)](
                self.comb_gw.local, plan.dest_rank, gw, T * k, e.config.max_tokens_per_rank * k, BLOCK=1024)
        return gw

    def _scale_rows(self, R: int, mx: bool) -> torch.Tensor:
        """A fresh uint8 ``[R, H/32]`` for the scale rows the receiving kernel writes (a placeholder without MX)."""
        e = self.e
        if not mx:
            return e.err.view(torch.uint8)
        return torch.empty(R, e.config.hidden // 32, dtype=torch.uint8, device=e.device)

    # -- per path ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchRows:
        """Dispatch ``x`` (bf16 ``[T, H]``) by ``topk_idx`` (``[T, k]``); ``topk_weights`` (float ``[T, k]``) travel
        in the pull-list entries (every path but the local one)."""
        raise NotImplementedError

    def _push_entries(self, plan: RoutingPlan, w: torch.Tensor, list_ptrs: torch.Tensor,
                      flags_ptrs: torch.Tensor) -> None:
        """One pull-list entry per (token, destination rank) into ``list_ptrs[d]`` (the destinations' pull lists),
        with the token's rows there and its route weights (fp32, rows ``[:T]`` of ``w``): ``push_programs`` programs
        per destination, each then raising ``flags[1, me]`` on its destination."""
        from .nvshmem_kernels import push_entries_kernel

        e = self.e
        fast_kernel(push_entries_kernel)[(e.push_programs, e.world)](
            plan.dest_rank, plan.dest_row, w, plan.dest_rank.shape[0], list_ptrs, flags_ptrs,
            e.d_epoch, e.rank, e.world, e.config.max_tokens_per_rank, K=e.config.topk,
            EW=self.pull_list.local.shape[-1], BLOCK=PUSH_BLOCK, num_warps=4,
        )

    def _new_table(self) -> tuple:
        """``(table, weights)``: a fresh int32 ``[W * T_max, k]`` for the dispatch's table and an fp32 one for the
        route weights that come with its entries, in one allocation (planes of ``[2, W * T_max, k]``)."""
        e = self.e
        pair = torch.empty(2, e.world * e.config.max_tokens_per_rank, e.config.topk, dtype=torch.int32,
                           device=e.device)
        return pair[0], pair[1].view(torch.float32)

    def _table_from_list(self) -> tuple:
        """The dispatch's table and its weights (:meth:`_new_table`) from this rank's pull list (entries of this
        epoch)."""
        from .nvshmem_kernels import entries_table_kernel

        e = self.e
        k = e.config.topk
        table, wtab = self._new_table()
        n = table.shape[0]
        fast_kernel(entries_table_kernel)[(min(n, e.dispatch_programs),)](
            self.pull_list.local, table, wtab.view(torch.int32), e.d_epoch, n, K=k, K_POW2=next_pow2(k),
            EW=self.pull_list.local.shape[-1])
        return table, wtab


class LocalPath(EnginePath):
    """One rank: nothing leaves the GPU. Dispatch: the id check, counts and plan (captured once per token count and
    replayed), then ``dispatch_kernel`` reads each token row once, quantizes it once and stores it straight into the
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
        ids = e.checked_ids(topk_idx, sync=False, store=store, counts_out=counts_buf[0])
        po = e.compute_plan(counts_buf, ids, store=store)
        return PlanOutputs(plan=po.plan, extra={**po.extra, "ids": ids})

    def _out(self, x: torch.Tensor, plan: RoutingPlan, R: int, mx: bool, w: torch.Tensor, weighted: bool):
        """Fresh uint8 ``[R, H]`` (MX) / ``[R, 2H]`` (bf16 bytes) written by ``dispatch_kernel`` itself: each row of
        ``x`` (bf16 ``[T, H]``; ``weighted``: times ``w[t, j]`` per slot) read once, quantized (MX), stored at every
        selection's expert-major row, its scale row into ``recv_s``; padding rows zeroed by the same launch
        (``ZERO_PAD``). No symmetric buffer holds the payload and nothing is copied afterwards."""
        from .nvshmem_kernels import dispatch_kernel

        e = self.e
        T, H = x.shape
        out = torch.empty(R, H if mx else 2 * H, dtype=torch.uint8, device=e.device)
        if R:
            fast_kernel(dispatch_kernel)[(e.output_programs(T),)](
                x, T, plan.dest_rank, plan.dest_row, out if mx else out.view(torch.bfloat16), self.recv_s.peer_ptrs,
                e.flags.peer_ptrs, 0, 1, w, plan.offs, plan.expert_counts, plan.num_rows, R, e.El, H=H,
                K=e.config.topk, CHUNK=e.launch.row_chunk(H, weighted), MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round,
                WEIGHTED=weighted, ARRIVE=False, ZERO_PAD=True, OUT_DIRECT=True, num_warps=e.dispatch_warps(weighted),
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
        from ..kernels.route_grad import route_weight_grad

        e = self.e
        q = self._out(g, handle.plan, handle.num_rows, mx, w, weighted=True)  # no handshake, nothing to wait for
        grad_w = None
        if expert_out is not None:  # <grad_y[t], out[row(t, j)]> where the rows are (here)
            grad_w = route_weight_grad(g, expert_out, handle.plan.dest_row, programs=e.route_grad_programs)
        return BackwardRows(q=q, scale_rows=self.recv_s.local, grad_w=grad_w)


class PullPath(EnginePath):
    """Several ranks with peer pointers (the default). Dispatch, captured once per token count and replayed: the id
    check and counts, epoch += 1, the counts exchange (with every rank's refusal word; the pack, each token row read
    once, quantized once, into this rank's send copy ``epoch % 2``, runs while the peers' counts arrive), the
    routing plan, one pull-list entry per (token, destination rank) on the destination, with the token's route
    weights, and the bounded wait for every source's entries - three launches with the Triton plan (:meth:`_head`:
    check to pack; :meth:`_scan_and_wait`: the slot table and the counts wait; the plan with the entries and their
    wait, :meth:`_make_plan_jobs`); then, after the call's one host sync, ``pull_rows_kernel`` reads each listed
    token's row once from its source's send copy into the fresh output at all its rows and keeps the entries, and
    their route weights, as the handle's table. Combine weights its partial sums with those weights and exchanges none
    when it is given the tensor this rank dispatched with (unchanged; see :meth:`EnginePath.combine_weights`).
    Buffers: ``ep.send_q``, ``ep.send_s``, ``ep.send_w``, ``ep.pull_list`` and the combine buffers; no symmetric
    receive buffer (the receivers write fresh tensors)."""

    name = "pull"

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.send_s = bufs["ep.send_s"]
        # the captured middle reads this call's x by address and its route weights from w_in (fixed-address inputs
        # of the graph; the weights are copied there as fp32: the entries carry them)
        self.x_slot = torch.zeros(1, dtype=torch.int64, device=engine.device)
        self.w_in = torch.zeros(engine.config.max_tokens_per_rank, engine.config.topk, dtype=torch.float32,
                                device=engine.device)
        # this rank's send copies as the packing kernels take them (fixed per engine): the rows (MX: bytes, 2H a row;
        # else bf16), the scale rows (MX; a placeholder otherwise) and the values from copy 0 to copy 1
        T_max, H = engine.config.max_tokens_per_rank, engine.config.hidden
        self._send_rows = self.send_q.local if engine.mx else self.send_q.local.view(torch.bfloat16)
        self._send_scales = self.send_s.local if engine.mx else engine.err
        self._send_copy = T_max * 2 * H if engine.mx else T_max * H
        self._plan_jobs = self._make_plan_jobs()

    def _make_plan_jobs(self):
        """The pull-list entries and the wait for every source's as jobs of the plan's launch
        (``plan_entries_kernel``, :class:`~mxcomm.ep.plan_kernels.PlanJobs`; every argument fixed per engine: made
        once, in ``__init__``)."""
        from .nvshmem_kernels import plan_entries_kernel
        from .plan_kernels import PlanJobs

        e = self.e
        return PlanJobs(kernel=plan_entries_kernel, extra=dict(
            w_ptr=self.w_in, list_peers=self.pull_list.peer_ptrs, flags_peers=e.flags.peer_ptrs, epoch_ptr=e.d_epoch,
            T_max=e.config.max_tokens_per_rank, ticket_ptr=e.tickets[2:3], flags_row_ptr=e.flag_rows[1],
            expect_row_ptr=e.expect_rows[1], err_ptr=e.err, timeout_ns=e.timeout_ns, K=e.config.topk,
            EW=self.pull_list.local.shape[-1]))

    def _pack(self, T: int) -> None:
        """This rank's ``T`` token rows (bf16 ``[T, H]`` at the address in ``x_slot``), quantized once (MX), into this
        epoch's send copy (the pull dispatch with the torch plan; with the Triton plan the head kernel packs)."""
        from .nvshmem_kernels import pack_rows_kernel

        e = self.e
        H = e.config.hidden
        if not T:
            return
        fast_kernel(pack_rows_kernel)[(min(T, e.dispatch_programs),)](
            self.x_slot, T, self._send_rows, self._send_scales, e.d_epoch, e.config.max_tokens_per_rank,
            self._send_copy, H=H, CHUNK=e.launch.row_chunk(H), MX=e.mx, MODE=e.mode_id, INT_ROUND=e.int_round,
            X_SLOT=True, num_warps=e.launch.dispatch_warps,
        )

    def _head(self, topk_idx: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
        """Triton plan: ``pull_head_kernel`` - the id check and this rank's counts (into ``counts_in[:E]``; the block
        counts into the engine's ``slot_prefix``), the refusal word (``counts_in[E]``), epoch += 1, the publish of both
        to every rank, and the pack of ``x`` (from ``x_slot``) into this epoch's send copy, in one launch that waits
        for nothing. Returns the checked int32 ids ``[T, k]`` (the head of ``store``)."""
        from .nvshmem_kernels import pull_head_kernel
        from .plan_kernels import tokens_per_block

        e = self.e
        T, k = topk_idx.shape
        E, H = e.config.num_experts, e.config.hidden
        ids = store.view(-1)[:T * k].view(T, k)
        fast_kernel(pull_head_kernel)[(max(1, min(T, e.dispatch_programs)),)](
            topk_idx.contiguous(), ids, e.slot_prefix, e.input_err, T, E, e.count_totals, e.counts_in, e.tickets[0:1],
            e.counts.peer_ptrs, e.flags.peer_ptrs, _ROW_FLAGS["counts"], e.world, e.rank, e.d_epoch, self.x_slot,
            self._send_rows, self._send_scales, e.config.max_tokens_per_rank, self._send_copy,
            K=k, K_POW2=next_pow2(k), TOK=tokens_per_block(k), KEYS=min(1024, next_pow2(E + 1)),
            PUB_BLOCK=_PUBLISH_BLOCK, H=H, CHUNK=e.launch.row_chunk(H), MX=e.mx, MODE=e.mode_id,
            INT_ROUND=e.int_round, num_warps=e.launch.dispatch_warps,
        )
        return ids

    def _scan_and_wait(self, T: int) -> None:
        """Triton plan, after :meth:`_head`: ``scan_and_wait_kernel`` - the block counts of ``T`` tokens into the
        plan's table (``slot_prefix``), then the bounded wait for every rank's counts."""
        from .nvshmem_kernels import scan_and_wait_kernel
        from .plan_kernels import scan_tile, slot_blocks

        e = self.e
        E = e.config.num_experts
        nb = slot_blocks(T, e.config.topk)
        tile = scan_tile(nb, E + 1)
        fast_kernel(scan_and_wait_kernel)[(cdiv(E + 1, tile.keys),)](
            e.slot_prefix, e.counts_in, nb, E + 1, e.tickets[1:2], e.flags.local, _ROW_FLAGS["counts"], e.world,
            e.d_epoch, e.err, e.timeout_ns, BLOCK_B=tile.blocks, BLOCK_K=tile.keys,
        )

    def _middle(self, counts_buf: torch.Tensor, topk_idx: torch.Tensor) -> PlanOutputs:
        """Everything before the receivers' gather: the id check of the caller's ``topk_idx`` and this rank's counts
        (into the engine's ``counts_in``; a refusal is read at the call's one host sync), epoch += 1, the counts
        exchange (counts and refusal word) with the pack (``x`` from ``x_slot``) between its publish and its wait,
        the plan of the checked ids on the exchanged ``counts_buf``, the pull-list entries and the bounded wait for
        every source's; the refusals into the status words. ``extra["ids"]``: the checked ids. With the Triton plan,
        three launches: :meth:`_head` (check to pack), :meth:`_scan_and_wait` (the slot table and the counts wait),
        then the plan with the entries and their wait (:meth:`_make_plan_jobs`)."""
        e = self.e
        store = e.plan_store(topk_idx)
        if store is not None:
            ids = self._head(topk_idx, store)
            self._scan_and_wait(ids.shape[0])
            # (and the refusals into the status words)
            po = e.compute_plan(counts_buf, ids, refusals=True, store=store, jobs=self._plan_jobs)
            return PlanOutputs(plan=po.plan, extra={**po.extra, "ids": ids})
        # counts into counts_in[:E], the refusal word (bad ids seen by the id check) into counts_in[E]; epoch += 1
        ids = e.checked_ids(topk_idx, sync=False, store=store, refusal_word=True, new_epoch=True)
        self.exchange(e.counts_in, wait=False)
        # the pack runs while the peers' counts arrive: its copy is not being read (see nvshmem_kernels, send_q), and
        # no peer reads it before this rank's entries, pushed after it in stream order
        self._pack(ids.shape[0])
        self.wait_for_counts()
        po = e.compute_plan(counts_buf, ids, refusals=True, store=store)
        self._push_entries(po.plan, self.w_in, self.pull_list.peer_ptrs, e.flags.peer_ptrs)
        self._wait_arrivals(1, e.push_programs)
        return PlanOutputs(plan=po.plan, extra={**po.extra, "ids": ids})

    def _pull_out(self, plan: RoutingPlan, R: int, row_bytes: int, table: torch.Tensor, wtab: torch.Tensor):
        """``(rows, scale_rows)``: fresh uint8 ``[R, row_bytes]`` of the received rows, each listed token read once
        from its source's send copy and stored at all its rows, padding rows zero; (MX) a fresh uint8 ``[R, H/32]``
        of their scale rows, row-major (unfilled rows undefined). The pull list's entries go to ``table`` (int32
        ``[W * T_max, k]``: the dispatch's table), their route weights to ``wtab`` (fp32, the same shape)."""
        from .nvshmem_kernels import pull_rows_kernel

        e = self.e
        out = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
        words = row_bytes // 8
        C, k, T_max = e.config.hidden // 32, e.config.topk, e.config.max_tokens_per_rank
        srows = self._scale_rows(R, e.mx)
        fast_kernel(pull_rows_kernel)[(e.output_programs(e.world * T_max),)](
            out.view(torch.int64), srows, plan.offs, plan.expert_counts, plan.num_rows, e.El, R, self.send_q.peer_ptrs,
            self.send_s.peer_ptrs, self.pull_list.local, table, wtab.view(torch.int32), e.d_epoch, T_max, e.world,
            T_max * 2 * e.config.hidden // 8, ROW_WORDS=words, CHUNK=min(512, next_pow2(words)), C=C,
            C_POW2=next_pow2(C), K=k, K_POW2=next_pow2(k), EW=self.pull_list.local.shape[-1], MX=e.mx,
            num_warps=4,
        )
        return out, srows

    def dispatch(self, x, topk_idx, topk_weights):
        e = self.e
        if x.data_ptr() % 16:  # the pack reads x by address in 16-byte vectors (pack_rows_kernel, X_SLOT)
            x = x.clone()
        self.x_slot.fill_(x.data_ptr())
        self.w_in[:x.shape[0]].copy_(topk_weights.detach())  # (no autograd history into the fixed buffer)
        po = e.run_middle(self._middle, topk_idx)  # (copies of a replay's outputs: made before the sync)
        table, wtab = self._new_table()
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        q, srows = self._pull_out(po.plan, R, e.config.hidden * (1 if e.mx else 2), table, wtab)
        return DispatchRows(q=q, scale_rows=srows, kept=po, ids=po.extra["ids"], num_rows=R,
                            origins=e.origins_from(po, R), table=table,
                            weights=DeliveredWeights.of(wtab, topk_weights))


class PushPath(EnginePath):
    """Several ranks, ``transport="push"``: after the counts exchange and the plan, ``dispatch_kernel`` reads each
    token row once, quantizes it once and stores it into each destination's ``recv_q`` at its expert-major rows
    (scale rows into ``recv_s``), and ``push_entries_kernel`` lists each (token, destination) in the destination's
    pull list; after the bounded arrival wait the receiver copies the rows out into a fresh tensor (the buffer is
    reused by the next call) and keeps its pull list's entries as the table. ``recv_q`` / ``recv_s`` hold a window
    of ``self.window`` expert-major rows (:func:`mxcomm.ep.plan.recv_window_rows`): a dispatch that brings some rank
    more moves in rounds of that many rows. Combine, dispatch backward and combine backward as the pull path (peer
    pointers). Buffers: ``ep.recv_q``, ``ep.recv_s`` and the combine buffers."""

    name = "push"

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.recv_q, self.recv_s = bufs["ep.recv_q"], bufs["ep.recv_s"]
        self.window = recv_window_rows(engine.config, engine.world, self.name == "put")  # rows of recv_q / recv_s
        self._window_epoch = torch.zeros(1, dtype=torch.int64, device=engine.device)  # handshakes between rounds

    # -- the steps of a dispatch's rounds (the put path overrides them) ------------------------------
    def _prepare(self, x: torch.Tensor, plan: RoutingPlan, w: torch.Tensor, mx: bool) -> None:
        """Before the rounds: nothing here (each round's kernel reads ``x`` itself)."""

    def _send_round(self, x: torch.Tensor, plan: RoutingPlan, w: torch.Tensor, mx: bool, window: Optional[tuple],
                    first: bool) -> None:
        """Each row of ``x`` (bf16 ``[T, H]``) to its slots' expert-major rows on the destinations (MXFP8 when
        ``mx``; with ``window = (lo, hi)`` only the slots whose rows fall in it, at ``row - lo``), with ``first`` one
        pull-list entry per (token, destination) and its route weights ``w`` (fp32 ``[T, k]``); then wait for every
        source's."""
        from .nvshmem_kernels import dispatch_kernel

        e = self.e
        ranks, rows = plan.dest_rank, plan.dest_row
        if window is not None:
            lo, hi = window
            inside = (rows >= lo) & (rows < hi)
            ranks, rows = torch.where(inside, ranks, -1), torch.where(inside, rows - lo, 0)
        self._dispatch_kernel(dispatch_kernel, x, plan, ranks, rows, self.recv_q.peer_ptrs, self.recv_s.peer_ptrs,
                              mx, arrive=True)
        if first:
            self._push_entries(plan, w, self.pull_list.peer_ptrs, e.flags.peer_ptrs)
        self._wait_arrivals(1, e.sender_programs + (e.push_programs if first else 0))

    def _window_free(self) -> None:
        """Between two rounds: tell every rank this one copied the window out, and wait (bounded) until every rank
        did (``publish_kernel`` on the ``window`` flag row, its own epoch)."""
        e = self.e
        self._window_epoch.add_(1)
        self._publish(e.err, 0, e.counts.peer_ptrs, 0, "window", self._window_epoch)

    def _after_rounds(self) -> None:
        """After the last round: nothing here."""

    def _dispatch_kernel(self, kernel, x, plan, ranks, rows, q_ptrs, s_ptrs, mx, arrive):
        e = self.e
        T, H = x.shape
        fast_kernel(kernel)[(e.sender_programs,)](
            x, T, ranks, rows, q_ptrs, s_ptrs, e.flags.peer_ptrs, e.rank, e.world, x,
            plan.offs, plan.expert_counts, plan.num_rows, 0, 0, H=H, K=e.config.topk, CHUNK=e.launch.row_chunk(H),
            MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round, WEIGHTED=False, ARRIVE=arrive,
            num_warps=e.dispatch_warps(False),
        )

    def _copy_rows(self, src: torch.Tensor, dst: torch.Tensor, plan: RoutingPlan, origins: RowOrigins,
                   row0: int) -> None:
        """Rows ``[row0, row0 + n)`` of the fresh ``dst`` (uint8 ``[R, B]``) from rows ``[0, n)`` of the receive
        buffer ``src`` (uint8 ``[n, B]``): padding rows zero, rows past the plan's ``n_rows`` not written
        (``copy_out_rows_kernel``)."""
        from .nvshmem_kernels import copy_out_rows_kernel

        e = self.e
        R, B = dst.shape
        n = min(R - row0, src.shape[0])
        if n <= 0:
            return
        words, view = (B // 8, torch.int64) if B % 8 == 0 else (B, torch.uint8)
        fast_kernel(copy_out_rows_kernel)[(min(n, e.programs * 4),)](
            src.view(view), dst.view(view), plan.num_rows, origins.src, R, row0, src.shape[0],
            ROW_WORDS=words, CHUNK=min(512, next_pow2(words)), num_warps=4,
        )

    def _rounds(self, plan: RoutingPlan) -> tuple:
        """``(R, rounds)``: this rank's output rows and the dispatch's rounds through the receive window. Exact
        sizes: read at a host sync (with the error words of the counts exchange, :meth:`output_rows`), the rounds
        from the most rows any rank receives; no-sync mode: the worst case of both."""
        e = self.e
        most = received_rows(plan).max() if e.config.exact_sizes else None
        R = e.output_rows("dispatch counts")
        need = e.R_max if most is None else min(int(most), e.R_max)
        return R, max(1, -(-need // self.window))

    def dispatch(self, x, topk_idx, topk_weights):
        """Counts exchange and plan, then the rows into the receivers' window in rounds (:meth:`_send_round`: one
        when the worst case fits the window; else as many as the most rows a rank receives needs), each copied out
        of ``recv_q`` / ``recv_s`` into fresh tensors before :meth:`_window_free` lets the next round in. Exact sizes
        sync with the host after the id check's sync once when the worst case fits the window, else twice (the rows
        and the rounds before the sends; the arrival waits' errors after the last round)."""
        e = self.e
        ids = e.checked_ids(topk_idx)  # (its counts into counts_in; a refusal raises here, before the epoch moves)
        e.d_epoch.add_(1)
        self.exchange(e.counts_in)
        po = e.plan_from_counts(ids)
        plan, mx, H = po.plan, e.mx, e.config.hidden
        w = fp32_weights(topk_weights.detach())
        self._prepare(x, plan, w, mx)
        row_bytes = H * (1 if mx else 2)
        win_q = self.recv_q.local.view(-1)[: self.window * row_bytes].view(self.window, row_bytes)
        if self.window >= e.R_max:  # every row fits: one round, the host sync after it
            self._send_round(x, plan, w, mx, None, True)
            self._after_rounds()
            table, wtab = self._table_from_list()
            R = e.output_rows("dispatch arrivals")
            o = e.origins_from(po, R)
            q = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
            self._copy_rows(win_q, q, plan, o, 0)
            srows = self.recv_s.local
        else:
            R, rounds = self._rounds(plan)
            o = e.origins_from(po, R)
            q = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
            srows = self._scale_rows(R, mx)
            for r in range(rounds):
                if r:
                    self._window_free()
                lo = r * self.window
                self._send_round(x, plan, w, mx, (lo, lo + self.window), r == 0)
                self._copy_rows(win_q, q, plan, o, lo)
                if mx:
                    self._copy_rows(self.recv_s.local, srows, plan, o, lo)
            self._after_rounds()
            table, wtab = self._table_from_list()
            if e.config.exact_sizes:
                e.output_rows("dispatch arrivals")  # the rounds' waits: their errors raise here
        return DispatchRows(q=q, scale_rows=srows, kept=po, ids=ids, num_rows=R, origins=o, table=table,
                            weights=DeliveredWeights.of(wtab, topk_weights))


class PutPath(PushPath):
    """The push path over NVSHMEM puts with signals (``transport="put"``, or needed because a peer has no peer
    pointer, e.g. on another node). Dispatch: the same kernels write into this rank's staging buffer (in send order)
    and its pull-list entries into a staging list per destination; one put per (destination, expert) block (payload,
    scales) and one per destination (entries), with signals. Combine and dispatch backward: the partials into
    staging, one row per (source, token) entry of the table, then one put per entry into the origin's slot (one
    row per (token, rank), as on the peer-pointer paths) and one signal per destination. Combine backward: one put
    per (token, destination) of the BF16 gradient row and its weights into the destination's ``recv_q`` /
    ``recv_w``, the expert side as the pull path, the route-weight gradients staged and put back. The counts, the
    "ready" handshake and the weights travel as puts too, and every wait is a signal wait. Every rank, itself
    included, is reached through puts. Not tested under CUDA graph capture: capture is refused. Buffers: the push
    path's plus ``ep.stage_q``, ``ep.stage_s``, ``ep.stage_list``, ``ep.stage_gw``, ``ep.recv_w``."""

    name = "put"

    def __init__(self, engine, bufs, puts=None):
        super().__init__(engine, bufs)
        e = engine
        W, E, T, k, H, dev = e.world, e.config.num_experts, e.config.max_tokens_per_rank, e.config.topk, \
            e.config.hidden, e.device
        self.puts = put_path.Puts() if puts is None else puts
        self.put_chunks = 4  # pieces per put entry (same on every rank: the signal count depends on it)
        self.stage_q, self.stage_s = bufs["ep.stage_q"], bufs["ep.stage_s"]
        self.stage_list, self.stage_gw, self.recv_w = bufs["ep.stage_list"], bufs["ep.stage_gw"], bufs["ep.recv_w"]
        self._stage_ptrs = torch.full((W,), self.stage_q.local.data_ptr(), dtype=torch.int64, device=dev)
        self._stage_s_ptrs = torch.full((W,), self.stage_s.local.data_ptr(), dtype=torch.int64, device=dev)
        EW = self.pull_list.local.shape[-1]
        # entries for destination d staged at stage_list[d]: push_entries_kernel writes entry [me, t] of "d's list"
        self._stage_list_ptrs = self._rows_of(self.stage_list.local, T * EW * 4) - e.rank * T * EW * 4
        self._scratch_flags = torch.zeros(len(_ROW_FLAGS), W, dtype=torch.int64, device=dev)
        self._scratch_ptrs = torch.full((W,), self._scratch_flags.data_ptr(), dtype=torch.int64, device=dev)
        self._counts_batch = put_path.row_batch(W, e.rank, 4 * E, dev)
        self._ready_batch = put_path.row_batch(W, e.rank, 0, dev)
        self._weights_batch = put_path.row_batch(W, e.rank, T * k * 4, dev)
        self._gw_batch = put_path.swap_batch(W, e.rank, T * k * 4, dev)
        self._all_src = torch.arange(W, dtype=torch.int32, device=dev)
        # signals expected so far per signal word (every source sends the same number per call)
        self._expect = torch.zeros(len(_ROW_FLAGS), dtype=torch.int64, device=dev)
        # combine backward: the gradient rows of source s arrive in recv_q viewed as [W, T_max, 2H], its weights in
        # recv_w [W, T_max, k]; one copy (copy stride 0); the route-weight gradients are staged per origin
        self.g_src = self._rows_of(self.recv_q.local, T * 2 * H)
        self.w_src = self._rows_of(self.recv_w.local, T * k * 4)
        self.g_copy = self.w_copy = 0
        self.gw_dst = self._rows_of(self.stage_gw.local, T * k * 4)

    gw_arrive = False
    # combine here always exchanges the weights (one put and signal wait per rank, as dispatch backward's "ready"
    # put), although the entries carry them: the partials' block puts are issued by the host whatever the kernel
    # found, so a rank whose weights wait failed (its peers decided otherwise) would still deliver stale partials -
    # the exchange keeps every rank on the same weights
    keeps_dispatch_weights = False

    def refuse_capture(self) -> None:
        if self.e.capturing():
            raise NotImplementedError(
                "the put-with-signal path (transport='put' or peers on other nodes) has not been tested under "
                "CUDA graph capture; capture is refused before any work"
            )

    def _wait(self, row: str, n: int) -> None:
        """Wait (bounded) until every source's ``n`` more signals of this call reached ``flags[row]``."""
        e = self.e
        i = _ROW_FLAGS[row]
        self._expect[i:i + 1].add_(n)
        self.puts.wait(e.flag_rows[i], self._all_src, self._expect[i:i + 1], 1, e.err, e.timeout_ns)

    def exchange(self, my_counts):
        e = self.e
        if my_counts is not None:
            E = e.config.num_experts
            e.counts.local[e.rank * E:(e.rank + 1) * E].copy_(my_counts[:E])
        batch = self._ready_batch if my_counts is None else self._counts_batch
        self.puts.put(e.counts.local, e.counts.local, batch, e.flag_rows[0], e.rank, e.err, 1)
        self._wait("counts", 1)

    def publish_weights(self, w):
        """The weights (or, for dispatch backward, nothing) to every rank as one put each, then the signal wait."""
        e = self.e
        batch = self._ready_batch
        if w is not None:
            self.comb_w.local[e.rank].view(-1)[: w.numel()].copy_(w.reshape(-1))
            batch = self._weights_batch
        self.puts.put(self.comb_w.local, self.comb_w.local, batch, e.flag_rows[3], e.rank, e.err, 1)
        self._wait("weights", 1)

    def _prepare(self, x, plan, w, mx):
        """The rows into staging at their send positions and the entries (with the route weights ``w``) into the
        staging list, once for every round."""
        from .nvshmem_kernels import dispatch_kernel

        self._dispatch_kernel(dispatch_kernel, x, plan, plan.dest_rank, plan.send_pos, self._stage_ptrs,
                              self._stage_s_ptrs, mx, arrive=False)
        self._push_entries(plan, w, self._stage_list_ptrs, self._scratch_ptrs)

    def _send_round(self, x, plan, w, mx, window, first):
        """One put per (destination, expert) block (payload, scales; with ``window``, the part of each block whose
        destination rows fall in it, :func:`put_path.dispatch_blocks`), with ``first`` one put per destination's
        entries, then the wait for every source's signals of this round."""
        e = self.e
        H, C = e.config.hidden, self.put_chunks
        blocks = put_path.dispatch_blocks(plan, H if mx else 2 * H, H // 32 if mx else 0, window)
        sig = e.flag_rows[1]
        self.puts.put(self.recv_q.local, self.stage_q.local, blocks.payload, sig, e.rank, e.err, C)
        self.puts.put(self.recv_s.local, self.stage_s.local, blocks.scales, sig, e.rank, e.err, C)
        if first:
            T, EW = e.config.max_tokens_per_rank, self.pull_list.local.shape[-1]
            batch = put_path.swap_batch(e.world, e.rank, plan.dest_rank.shape[0] * EW * 4, e.device,
                                        stride=T * EW * 4)
            self.puts.put(self.pull_list.local, self.stage_list.local, batch, sig, e.rank, e.err, C)
        self._wait("dispatch", (2 * e.El + (1 if first else 0)) * C)

    def _window_free(self):
        """A signal to every rank on the ``window`` flag row, then the wait for every rank's."""
        e = self.e
        self.puts.put(self.recv_q.local, self.send_q.local, self._ready_batch, e.flag_rows[_ROW_FLAGS["window"]],
                      e.rank, e.err, 1)
        self._wait("window", 1)

    def _after_rounds(self):
        """``quiet``: the staging may be written again."""
        self.puts.quiet()

    def send_partials(self, payload, in_scales, handle, mx, passthrough, weights):
        """The partials into staging at their table entry's index, then one put per (token, rank) entry into the
        origins' ``comb_q`` / ``comb_s`` (signalling a word nobody waits for), ``quiet``, one signal per destination
        and the wait for every source's."""
        e = self.e
        H = e.config.hidden
        self._partials(payload, in_scales, handle, mx, passthrough, weights, self._stage_ptrs, self._stage_s_ptrs,
                       staged=True)
        slot0 = (e.c_epoch % 2) * e.nslot
        rows = put_path.partial_rows(handle.backend_state.table, handle.backend_state.origins.pos, e.rank,
                                     e.config.max_tokens_per_rank, slot0, 2 * H, H if mx else 2 * H,
                                     H // 32 if mx else 0)
        scratch = e.flag_rows[_ROW_FLAGS["scratch"]]
        self.puts.put(e.comb[0].local, self.stage_q.local, rows.payload, scratch, e.rank, e.err, 1)
        self.puts.put(e.comb[1].local, self.stage_s.local, rows.scales, scratch, e.rank, e.err, 1)
        self.puts.quiet()
        self.puts.put(e.comb[0].local, self.stage_q.local, self._ready_batch, e.flag_rows[2], e.rank, e.err, 1)
        self._wait("combine", 1)

    def _deliver_gradients(self, g, w, handle):
        """Epoch += 1, the "ready" handshake (every destination finished with its ``recv_q`` of the previous call in
        this direction), then one put per (token, destination rank) of the gradient row and one of its weights into
        the destination's ``recv_q`` [me, t] / ``recv_w`` [me, t] (signalling a word nobody waits for), ``quiet``, and
        one signal per destination; then wait for every source's signal."""
        e = self.e
        e.d_epoch.add_(1)
        self.exchange(None)
        T, H, k = g.shape[0], e.config.hidden, e.config.topk
        self.send_q.local[0].view(-1)[: T * 2 * H].copy_(g.reshape(-1).view(torch.uint8))
        self.send_w.local[0].view(-1)[: T * k].copy_(w.reshape(-1))
        rows, weights = put_path.token_rows(handle.plan, e.rank, e.config.max_tokens_per_rank, 2 * H, k * 4)
        scratch = e.flag_rows[_ROW_FLAGS["scratch"]]
        self.puts.put(self.recv_q.local, self.send_q.local, rows, scratch, e.rank, e.err, 1)
        self.puts.put(self.recv_w.local, self.send_w.local, weights, scratch, e.rank, e.err, 1)
        self.puts.quiet()
        self.puts.put(self.recv_q.local, self.send_q.local, self._ready_batch, e.flag_rows[1], e.rank, e.err, 1)
        self._wait("dispatch", 1)

    def _route_grads(self, plan, T):
        """The staged route-weight gradients to their origins (one put each, into row ``me`` of their ``comb_gw``),
        the signal wait, then the gather."""
        e = self.e
        self.puts.put(self.comb_gw.local, self.stage_gw.local, self._gw_batch, e.flag_rows[4], e.rank, e.err, 1)
        self._wait("route_grad", 1)
        self.puts.quiet()
        return self._gather_route_grads(plan, T)


PATHS = {"local": LocalPath, "pull": PullPath, "push": PushPath, "put": PutPath}

__all__ = ["EnginePath", "LocalPath", "PullPath", "PushPath", "PutPath", "DispatchRows", "BackwardRows", "PATHS",
           "PUSH_BLOCK", "fp32_weights"]
