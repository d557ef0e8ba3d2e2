"""What every path of the ``nvshmem`` backend shares (:class:`EnginePath`: the peer-pointer combine direction,
combine backward and the handshakes) and what a path returns per call (:class:`DispatchRows`, :class:`BackwardRows`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ....kernels.launch import cdiv, fast_kernel, next_pow2
from ...handle import EPHandle
from ...plan import FLAG_ROWS, RoutingPlan
from ..state import DeliveredWeights, RowOrigins
from ..plan_graph import PlanOutputs

PUSH_BLOCK = 64  # tokens per block of push_entries_kernel

PUBLISH_BLOCK = 1024  # int32 words per step of publish_kernel
FLAG_ROW = {name: i for i, name in enumerate(FLAG_ROWS)}  # rows of ep.flags


def fp32_weights(w: torch.Tensor) -> torch.Tensor:
    """Route weights ``w`` (float ``[T, k]``) as the contiguous fp32 tensor the kernels read (``w`` itself when it
    is one)."""
    return w if w.dtype == torch.float32 and w.is_contiguous() else w.to(torch.float32).contiguous()


@dataclass(frozen=True)
class DispatchRows:
    """What a path's dispatch produced: ``q`` fresh uint8 ``[R, H]`` (MX payload) / ``[R, 2H]`` (bf16 bytes) rows,
    ``scale_rows`` their row-major uint8 ``[>= R, H/32]`` scale rows (MX; None when the path wrote
    ``grouped_scales``), ``kept`` the plan outputs the handle keeps,
    ``ids`` the checked expert ids ``[T, k]``, ``num_rows`` R, ``origins`` the row origins and ``table`` the dispatch's
    table (both None on the local path), ``weights`` the sources' route weights that came with the pull-list entries
    (None on the local path), ``grouped_scales`` the scales already in the grouped blocked layout when the path wrote
    them so (else None: the engine swizzles ``scale_rows``)."""

    q: torch.Tensor
    scale_rows: Optional[torch.Tensor]
    kept: PlanOutputs
    ids: torch.Tensor
    num_rows: int
    origins: Optional[RowOrigins]
    table: Optional[torch.Tensor] = None
    weights: Optional[DeliveredWeights] = None
    grouped_scales: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class BackwardRows:
    """Combine backward's result: ``q`` fresh uint8 ``[R, H]`` / ``[R, 2H]`` rows at the expert rank, ``scale_rows``
    their row-major scale rows (MX), ``grad_w`` fp32 ``[T, k]`` route-weight gradient at the origin (None when not
    asked for)."""

    q: torch.Tensor
    scale_rows: torch.Tensor
    grad_w: Optional[torch.Tensor]


class EnginePath:
    """One way of moving rows (see the module doc). ``engine``: the :class:`~mxcomm.ep.nvshmem.backend.NvshmemBackend`
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
        from ..kernels.signals import publish_kernel

        e = self.e
        fast_kernel(publish_kernel)[(e.world,)](
            src, n_words, dst_peers, dst_word0, tail_word, e.flags.peer_ptrs, e.flags.local, FLAG_ROW[row], e.world,
            epoch, e.err, e.timeout_ns, e.rank, BLOCK=PUBLISH_BLOCK, WAIT=wait,
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
        from ..kernels.signals import wait_published_kernel

        e = self.e
        fast_kernel(wait_published_kernel)[(e.world,)](e.flags.local, FLAG_ROW["counts"], e.world, e.d_epoch, e.err,
                                                       e.timeout_ns, num_warps=e.launch.wait_warps)

    def _wait_arrivals(self, row: int, per_call: int) -> None:
        """The bounded wait for every source's ``per_call`` arrivals of this call on flag row ``row``
        (``wait_arrivals_kernel``; each source's programs add 1 there when done)."""
        from ..kernels.signals import wait_arrivals_kernel

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
        from ..kernels.combine import combine_partials_kernel

        e = self.e
        st = handle.backend_state
        # (the wait for every rank's partials: in the launch's last program)
        fast_kernel(combine_partials_kernel)[(e.programs,)](
            payload, in_scales, st.table, st.origins.pos, e.err if weights is None else weights, e.comb[0].peer_ptrs,
            e.comb[1].peer_ptrs, e.flags.peer_ptrs, e.rank, e.world, e.config.max_tokens_per_rank, e.c_epoch,
            e.nslot, e.err, P=min(e.config.topk, e.world), **self._partials_consts(mx, passthrough, weights),
            **self._partials_wait,
        )

    def _partials_consts(self, mx: bool, passthrough: bool, weights: Optional[torch.Tensor]) -> dict:
        """The constexprs and launch options of the partial sums' kernels (``combine_partials_kernel``, the put path's
        ``stage_partials_kernel``): each product rounded, then added (no FMA)."""
        e = self.e
        H = e.config.hidden
        return dict(H=H, K=e.config.topk, CHUNK=e.launch.partials_row_chunk(H), MX=mx, PASS=passthrough,
                    WEIGHTED=weights is not None, MODE=e.mode_id, INT_ROUND=e.int_round, ROWS=e.launch.partials_rows,
                    num_warps=e.launch.weighted_warps, enable_fp_fusion=False)

    # -- combine backward (the dispatch direction) -------------------------------------------
    def _deliver_gradients(self, g: torch.Tensor, w: torch.Tensor, handle: EPHandle) -> None:
        """Epoch += 1, then make every source's BF16 gradient rows and weights readable at ``g_src`` / ``w_src``: pack
        them into this rank's send copy and publish "ready" in one launch (``pack_ready_kernel``), then wait for every
        rank's "ready" (every rank packed; every rank finished reading the copy of the previous call in this
        direction)."""
        from ..kernels.combine_backward import pack_ready_kernel

        e = self.e
        T, H, k = g.shape[0], e.config.hidden, e.config.topk
        fast_kernel(pack_ready_kernel)[(max(1, min(T, e.dispatch_programs)),)](
            g, T, self.send_q.local.view(torch.bfloat16), e.d_epoch, e.config.max_tokens_per_rank, self.g_copy, w,
            self.send_w.local, e.tickets[5:6], e.flags.peer_ptrs,
            FLAG_ROW["counts"], e.world, e.rank, H=H, CHUNK=e.launch.row_chunk(H), K=k,
            K_POW2=next_pow2(k), num_warps=e.launch.dispatch_warps,
        )
        self.wait_for_counts()  # (the "ready" flags are the counts row's)

    def combine_backward(self, g: torch.Tensor, w: torch.Tensor, handle: EPHandle, mx: bool,
                         expert_out: Optional[torch.Tensor]) -> BackwardRows:
        """Every (source, token) of the handle's table gets its BF16 gradient row once; the expert rank weights and
        quantizes it per slot into fresh tensors and, with ``expert_out`` (the rows the forward combine was given),
        forms the route-weight gradient, which goes back to the origins' ``comb_gw``."""
        self._deliver_gradients(g, w, handle)  # (epoch += 1 first)
        rows = self._new_backward_rows(handle, mx)
        rg = expert_out is not None
        self._weighted_rows(rows, handle, mx, expert_out)
        grad_w = self._route_grads(handle.plan, g.shape[0]) if rg else None
        return BackwardRows(q=rows.q, scale_rows=rows.scale_rows, grad_w=grad_w)

    def _new_backward_rows(self, handle: EPHandle, mx: bool) -> BackwardRows:
        """Fresh tensors for combine backward's rows at this rank: uint8 ``[R, H]`` (MX) / ``[R, 2H]`` (bf16 bytes)
        and their scale rows (:meth:`_scale_rows`)."""
        e = self.e
        R, H = handle.num_rows, e.config.hidden
        q = torch.empty(R, H if mx else 2 * H, dtype=torch.uint8, device=e.device)
        return BackwardRows(q=q, scale_rows=self._scale_rows(R, mx), grad_w=None)

    def _weighted_rows(self, rows: BackwardRows, handle: EPHandle, mx: bool,
                       expert_out: Optional[torch.Tensor]) -> None:
        """``pull_weighted_kernel`` over the handle's table: the gradient rows at ``self.g_src`` / weights at
        ``self.w_src`` (two copies each), weighted and quantized per slot into ``rows``; with ``expert_out`` the
        route-weight gradients into ``self.gw_dst``, raising ``flags[4]`` on every rank, and the launch's last
        program waits for every rank's."""
        from ..kernels.combine_backward import pull_weighted_kernel

        e = self.e
        rg = expert_out is not None
        fast_kernel(pull_weighted_kernel)[(e.programs,)](
            *self._weighted_head(rows, handle, mx), e.d_epoch, e.config.max_tokens_per_rank, e.world, self.g_copy,
            self.w_copy, expert_out if rg else e.err, self.gw_dst, e.flags.peer_ptrs, e.rank,
            **self._weighted_consts(mx, rg), **(self._gradients_wait if rg else {}),
        )

    def _weighted_head(self, rows: BackwardRows, handle: EPHandle, mx: bool) -> tuple:
        """The leading arguments of the weighted rows' kernels (``pull_weighted_kernel``, the put path's
        ``round_weighted_kernel``): the output and its scale rows, the plan's group tables, the sources' rows,
        weights and the dispatch's table."""
        e = self.e
        plan = handle.plan
        return (rows.q if mx else rows.q.view(torch.bfloat16), rows.scale_rows, plan.offs, plan.expert_counts,
                plan.num_rows, e.El, handle.num_rows, self.g_src, self.w_src, handle.backend_state.table)

    def _weighted_consts(self, mx: bool, route_grad: bool) -> dict:
        """The constexprs and launch options of the weighted rows' kernels."""
        e = self.e
        H, k = e.config.hidden, e.config.topk
        row_bytes = H if mx else 2 * H
        return dict(H=H, CHUNK=e.launch.row_chunk(H, True), K=k, K_POW2=next_pow2(k), MX=mx, MODE=e.mode_id,
                    INT_ROUND=e.int_round, ZCHUNK=min(512, next_pow2(row_bytes // 8)), ROUTE_GRAD=route_grad,
                    num_warps=e.dispatch_warps(True))

    def _route_grads(self, plan: RoutingPlan, T: int) -> torch.Tensor:
        """This rank's fp32 ``[T, k]`` route-weight gradients, gathered once every rank's arrived (the wait: in
        ``pull_weighted_kernel``'s last program)."""
        return self._gather_route_grads(plan, T)

    def _gather_route_grads(self, plan: RoutingPlan, T: int) -> torch.Tensor:
        from ..kernels.combine_backward import gather_route_grad_kernel

        e = self.e
        k = e.config.topk
        gw = torch.empty(T, k, dtype=torch.float32, device=e.device)
        if T:
            fast_kernel(gather_route_grad_kernel)[(min(cdiv(T * k, 1024), e.dispatch_programs),)](
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
        from ..kernels.pull import push_entries_kernel

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
        from ..kernels.pull import entries_table_kernel

        e = self.e
        k = e.config.topk
        table, wtab = self._new_table()
        n = table.shape[0]
        fast_kernel(entries_table_kernel)[(min(n, e.dispatch_programs),)](
            self.pull_list.local, table, wtab.view(torch.int32), e.d_epoch, n, K=k, K_POW2=next_pow2(k),
            EW=self.pull_list.local.shape[-1])
        return table, wtab
