"""The pull path (:class:`PullPath`): the default with several ranks on one node."""
from __future__ import annotations

from typing import Optional

import torch

from ....kernels.launch import cdiv, fast_kernel, next_pow2
from ....mx import round_up
from ..state import DeliveredWeights
from ...plan import RoutingPlan
from ..call_graph import CallOutputs, CallShape, CallTensors, copy_in, copy_out
from ..plan_graph import PlanOutputs
from .base import FLAG_ROW, PUBLISH_BLOCK, DispatchRows, EnginePath, fp32_weights

# the entries of a captured dispatch's address table (mxcomm.ep.nvshmem.kernels.call_io): x, topk_idx, the route
# weights (fp32), the output, its grouped scales (MX), the copy of the checked ids and the plan, the dispatch's table
# with its weights (one allocation), the row-major scale rows (MX), the output's rows (its capacity: a value)
_X, _IDS, _W, _OUT, _SCALES, _PLAN, _TABLE, _SROWS, _ROWS = range(9)
# token counts whose last output size a pull path remembers (the capacity of the next call's output, _call_rows)
_ROWS_SEEN = 64
# the plan tensors a dispatch as one call and the combine after it read (viewed before the call's host sync)
_READ_PLAN = ("offs", "expert_counts", "num_rows", "send_pos", "dest_rank")


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
    With exact sizes the whole dispatch, the gather and the scale layout included, is one captured call instead
    (:meth:`_dispatch_call`), its output sized for the worst case when ``world * max_tokens_per_rank <=
    LaunchConfig.peer_call_tokens``, else for the rows the last call of the same token count brought plus
    ``LaunchConfig.peer_guess_pct`` percent (a call that brings more gathers its rows after the sync, as the staged
    form; the first call of a token count is staged). Buffers: ``ep.send_q``, ``ep.send_s``, ``ep.send_w``,
    ``ep.pull_list`` and the combine buffers; no symmetric receive buffer (the receivers write fresh tensors)."""

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
        self._rows_seen: dict = {}  # token count -> the output rows of its last exact-size dispatch (_call_rows)

    def _make_plan_jobs(self):
        """The pull-list entries and the wait for every source's as jobs of the plan's launch
        (``plan_entries_kernel``, :class:`~mxcomm.ep.nvshmem.plan_kernels.PlanJobs`; every argument fixed per engine:
        made once, in ``__init__``)."""
        from ..kernels.pull import plan_entries_kernel
        from ..plan_kernels import PlanJobs

        e = self.e
        return PlanJobs(kernel=plan_entries_kernel, extra=dict(
            w_ptr=self.w_in, list_peers=self.pull_list.peer_ptrs, flags_peers=e.flags.peer_ptrs, epoch_ptr=e.d_epoch,
            T_max=e.config.max_tokens_per_rank, ticket_ptr=e.tickets[2:3], flags_row_ptr=e.flag_rows[1],
            expect_row_ptr=e.expect_rows[1], err_ptr=e.err, timeout_ns=e.timeout_ns, K=e.config.topk,
            EW=self.pull_list.local.shape[-1]))

    def _pack(self, T: int) -> None:
        """This rank's ``T`` token rows (bf16 ``[T, H]`` at the address in ``x_slot``), quantized once (MX), into this
        epoch's send copy (the pull dispatch with the torch plan; with the Triton plan the head kernel packs)."""
        from ..kernels.pull import pack_rows_kernel

        e = self.e
        H = e.config.hidden
        if not T:
            return
        fast_kernel(pack_rows_kernel)[(min(T, e.dispatch_programs),)](
            self.x_slot, T, self._send_rows, self._send_scales, e.d_epoch, e.config.max_tokens_per_rank,
            self._send_copy, H=H, CHUNK=e.launch.row_chunk(H), MX=e.mx, MODE=e.mode_id, INT_ROUND=e.int_round,
            num_warps=e.launch.dispatch_warps,
        )

    def _head(self, topk_idx: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
        """Triton plan: ``pull_head_kernel`` - the id check and this rank's counts (into ``counts_in[:E]``; the block
        counts into the engine's ``slot_prefix``), the refusal word (``counts_in[E]``), epoch += 1, the publish of both
        to every rank, and the pack of ``x`` (from ``x_slot``) into this epoch's send copy, in one launch that waits
        for nothing. Returns the checked int32 ids ``[T, k]`` (the head of ``store``)."""
        from ..kernels.pull import pull_head_kernel
        from ..plan_kernels import tokens_per_block

        e = self.e
        T, k = topk_idx.shape
        E, H = e.config.num_experts, e.config.hidden
        ids = store.view(-1)[:T * k].view(T, k)
        fast_kernel(pull_head_kernel)[(max(1, min(T, e.dispatch_programs)),)](
            topk_idx.contiguous(), ids, e.slot_prefix, e.input_err, T, E, e.count_totals, e.counts_in, e.tickets[0:1],
            e.counts.peer_ptrs, e.flags.peer_ptrs, FLAG_ROW["counts"], e.world, e.rank, e.d_epoch, self.x_slot,
            self._send_rows, self._send_scales, e.config.max_tokens_per_rank, self._send_copy,
            K=k, K_POW2=next_pow2(k), TOK=tokens_per_block(k), KEYS=min(1024, next_pow2(E + 1)),
            PUB_BLOCK=PUBLISH_BLOCK, H=H, CHUNK=e.launch.row_chunk(H), MX=e.mx, MODE=e.mode_id,
            INT_ROUND=e.int_round, num_warps=e.launch.dispatch_warps,
        )
        return ids

    def _scan_and_wait(self, T: int) -> None:
        """Triton plan, after :meth:`_head`: ``scan_and_wait_kernel`` - the block counts of ``T`` tokens into the
        plan's table (``slot_prefix``), then the bounded wait for every rank's counts."""
        from ..kernels.pull import scan_and_wait_kernel
        from ..plan_kernels import scan_tile, slot_blocks

        e = self.e
        E = e.config.num_experts
        nb = slot_blocks(T, e.config.topk)
        tile = scan_tile(nb, E + 1)
        fast_kernel(scan_and_wait_kernel)[(cdiv(E + 1, tile.keys),)](
            e.slot_prefix, e.counts_in, nb, E + 1, e.tickets[1:2], e.flags.local, FLAG_ROW["counts"], e.world,
            e.d_epoch, e.err, e.timeout_ns, BLOCK_B=tile.blocks, BLOCK_K=tile.keys,
        )

    def _middle(self, counts_buf: torch.Tensor, topk_idx: torch.Tensor,
                store: Optional[torch.Tensor] = None) -> PlanOutputs:
        """Everything before the receivers' gather: the id check of the caller's ``topk_idx`` and this rank's counts
        (into the engine's ``counts_in``; a refusal is read at the call's one host sync), epoch += 1, the counts
        exchange (counts and refusal word) with the pack (``x`` from ``x_slot``) between its publish and its wait,
        the plan of the checked ids on the exchanged ``counts_buf``, the pull-list entries and the bounded wait for
        every source's; the refusals into the status words. ``extra["ids"]``: the checked ids. With the Triton plan,
        three launches: :meth:`_head` (check to pack), :meth:`_scan_and_wait` (the slot table and the counts wait),
        then the plan with the entries and their wait (:meth:`_make_plan_jobs`). ``store``: the buffer of the ids and
        the plan (:meth:`NvshmemBackend.plan_store`; a fresh one when None)."""
        e = self.e
        if store is None:
            store = e.plan_store(topk_idx)
        if store is not None:
            ids = self._head(topk_idx, store)
            self._scan_and_wait(ids.shape[0])
            # (and the refusals into the status words)
            po = e.compute_plan(counts_buf, ids, refusals=True, store=store, jobs=self._plan_jobs)
            return PlanOutputs(plan=po.plan, extra={**po.extra, "ids": ids})
        # counts into counts_in[:E], the refusal word (bad ids seen by the id check) into counts_in[E]; epoch += 1
        ids = e.checked_ids(topk_idx, store=store, refusal_word=True, new_epoch=True)
        self.exchange(e.counts_in, wait=False)
        # the pack runs while the peers' counts arrive: its copy is not being read (see kernels.pull, send_q),
        # and no peer reads it before this rank's entries, pushed after it in stream order
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
        from ..kernels.pull import pull_rows_kernel

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
        if x.data_ptr() % 16:  # the pack reads x by address in 16-byte vectors (pack_rows_kernel, pull_head_kernel)
            x = x.clone()
        T = x.shape[0]
        one_call = e.config.exact_sizes and T > 0 and e.plan_impl == "triton" and not e.capturing()
        rows = self._call_rows(T) if one_call else None
        if rows is not None:
            return self._dispatch_call(x, topk_idx.contiguous(), topk_weights, rows)
        self.x_slot.fill_(x.data_ptr())
        self.w_in[:T].copy_(topk_weights.detach())  # (no autograd history into the fixed buffer)
        po = e.run_middle(self._middle, topk_idx)  # (copies of a replay's outputs: made before the sync)
        table, wtab = self._new_table()
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        if one_call:
            self._note_rows(T, R)
        return self._gathered(po, R, table, wtab, topk_weights)

    def _gathered(self, po: PlanOutputs, R: int, table: torch.Tensor, wtab: torch.Tensor,
                  topk_weights: torch.Tensor) -> DispatchRows:
        """After the host sync: the gather of the ``R`` received rows into an output of their size
        (:meth:`_pull_out`) and the dispatch's rows, for the middle's outputs ``po``."""
        e = self.e
        q, srows = self._pull_out(po.plan, R, e.config.hidden * (1 if e.mx else 2), table, wtab)
        return DispatchRows(q=q, scale_rows=srows, kept=po, ids=po.extra["ids"], num_rows=R,
                            origins=e.origins_from(po, R), table=table,
                            weights=DeliveredWeights.of(wtab, topk_weights))

    # -- the output's rows of a dispatch as one call ---------------------------------------------
    def _call_rows(self, T: int) -> Optional[int]:
        """The rows of the output an exact-size dispatch of ``T`` tokens run as one call gets: the worst case
        ``R_max`` when ``world * max_tokens_per_rank <= LaunchConfig.peer_call_tokens``; else the rows of the last
        exact-size dispatch of ``T`` tokens plus ``LaunchConfig.peer_guess_pct`` percent, rounded up to ``align`` (at
        most ``R_max``); None (staged) for the first call of a token count, or with ``peer_guess_pct = 0``."""
        e = self.e
        if e.world * e.config.max_tokens_per_rank <= e.launch.peer_call_tokens:
            return e.R_max
        last = self._rows_seen.get(T)
        if last is None or not e.launch.peer_guess_pct:
            return None
        return min(e.R_max, round_up(last + cdiv(last * e.launch.peer_guess_pct, 100), e.config.align))

    def _note_rows(self, T: int, R: int) -> None:
        """Remember that an exact-size dispatch of ``T`` tokens brought ``R`` rows (the newest ``_ROWS_SEEN``
        token counts)."""
        self._rows_seen.pop(T, None)
        while len(self._rows_seen) >= _ROWS_SEEN:
            self._rows_seen.pop(next(iter(self._rows_seen)))
        self._rows_seen[T] = R

    # -- a dispatch as one call ------------------------------------------------------------------
    def _call_body(self, table: torch.Tensor, shape: CallShape) -> CallOutputs:
        """Enqueue the whole dispatch of ``shape.T`` tokens reading its tensors' addresses from ``table`` (int64, the
        ``_X`` .. ``_ROWS`` entries; ``_ROWS`` the output's rows, a value): the address of ``x`` into ``x_slot``,
        ``topk_idx`` copied into a buffer of the call's own (``[T, k]``, its dtype; inside a capture, the graph's:
        kept with the outputs, since the graph writes it at every replay), the route weights (fp32 ``[T, k]``) into
        ``w_in``, the middle (:meth:`_middle`: check, pack, counts exchange, plan, entries and their wait), then
        (CUDA) the copy of the status words read at the call's sync (final after the middle, which holds every wait:
        the sync returns while the rest runs), its checked ids, plan and row origins copied out (``shape.plan_words``
        int32 words), the rows (``pull_rows_at_kernel``: the output, the dispatch's table and weights, the scale rows
        row-major) and their grouped scales (``scale_rows_to_grouped_at_kernel``), the two output kernels' grids
        sized for ``shape.rows`` rows and writing nothing when the call brings more rows than its output holds."""
        from ..kernels.pull import pull_rows_at_kernel

        e = self.e
        cfg = e.config
        H, k, T, T_max, W = cfg.hidden, cfg.topk, shape.T, cfg.max_tokens_per_rank, e.world
        self.x_slot.copy_(table[_X:_X + 1])
        idx = torch.empty(T, k, dtype=shape.dtype, device=e.device)
        copy_in(table, _IDS, idx)
        copy_in(table, _W, self.w_in[:T])
        store = e.plan_store(idx)
        po = self._middle(e.counts_mat, idx, store=store)
        e.status_words.enqueue_copy()  # final here (the waits are the middle's): the host sync returns at its landing
        copy_out(store, table, _PLAN)
        plan = po.plan
        row_words = H // 8 if e.mx else H // 4
        C = H // 32
        fast_kernel(pull_rows_at_kernel)[(e.output_programs(W * T_max),)](
            table, _OUT, _TABLE, _SROWS, _ROWS, plan.offs, plan.expert_counts, plan.num_rows, e.El,
            self.send_q.peer_ptrs, self.send_s.peer_ptrs, self.pull_list.local, e.d_epoch, T_max, W,
            T_max * 2 * H // 8, ROW_WORDS=row_words, CHUNK=min(512, next_pow2(row_words)), C=C, C_POW2=next_pow2(C),
            K=k, K_POW2=next_pow2(k), EW=self.pull_list.local.shape[-1], MX=e.mx, num_warps=4,
        )
        if e.mx:
            e.grouped_scales_at(table, _SROWS, _SCALES, _ROWS, plan, shape.scale_rows)
        return CallOutputs(middle=po, buffers=(idx,))

    def _dispatch_call(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       rows: int) -> DispatchRows:
        """An exact-size dispatch as one call into an output of ``rows`` rows (:meth:`_call_rows`): on the GPU the
        whole of :meth:`_call_body` replayed from a :class:`CallGraph` captured per token count and id dtype (at a
        key's second call), with fresh output tensors whose addresses (and ``rows``) go in the graph's table; eager
        elsewhere and at a key's first two calls. Then the call's one host sync (the output size, the id check and
        the peers' refusals: it waits for the status words' copy, which comes before the rows' kernels, so the call
        returns while they run) and views: the output's first ``R`` rows, its scales likewise. A call that brings
        more than ``rows`` rows (its output kernels wrote nothing) gathers them after the sync into an output of
        their size, as the staged form does."""
        e = self.e
        T, H = x.shape
        shape = e.call_shape(T, topk_idx.dtype)
        w = fp32_weights(topk_weights.detach())
        t = CallTensors.alloc(rows, shape, H, e.El, e.mx, e.device, scale_rows=True)
        table, wtab = self._new_table()
        addresses = (x.data_ptr(), topk_idx.data_ptr(), w.data_ptr(), t.out.data_ptr(), CallTensors.address(t.scales),
                     t.plan_copy.data_ptr(), table.data_ptr(), CallTensors.address(t.scale_rows), t.rows)
        layout = e.run_call(("pull-call", T, topk_idx.dtype), addresses, lambda tb: self._call_body(tb, shape))
        kept = layout.read(t.plan_copy, now=_READ_PLAN)
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        self._note_rows(T, R)
        if R > t.rows:
            return self._gathered(kept, R, table, wtab, topk_weights)
        return DispatchRows(q=t.out[:R], scale_rows=None, kept=kept, ids=kept.extra["ids"], num_rows=R,
                            origins=e.origins_from(kept, R), table=table,
                            weights=DeliveredWeights.of(wtab, topk_weights), grouped_scales=t.grouped_scales(R, e.El))
