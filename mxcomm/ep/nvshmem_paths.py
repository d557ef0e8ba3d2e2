"""The ways the ``nvshmem`` backend moves rows, one class per path (:func:`mxcomm.ep.plan.dispatch_path`):

* :class:`LocalPath` (one rank): nothing leaves the GPU; dispatch and combine backward write the output directly;
* :class:`PullPath` (several ranks with peer pointers, the default): senders pack each token row once into their send
  copy; receivers read each listed row once per (token, rank) through the peer pointer into fresh tensors;
* :class:`PushPath` (``transport="push"``): senders store the rows into the receivers' symmetric buffer at their
  expert-major rows; receivers copy them out;
* :class:`PutPath` (``transport="put"``, or peers on other nodes): the push path's kernels write into a staging
  buffer and NVSHMEM puts one block per (destination, expert) with a signal (``csrc/put_signal.cu``).

Each path owns its buffers (taken by name from the symmetric heap's allocation of
:func:`mxcomm.ep.plan.buffer_regions`) and launches its own kernels; the engine (:class:`NvshmemBackend
<mxcomm.ep.nvshmem_backend.NvshmemBackend>`) holds what every path shares: the epochs, flags and counts, the error
words and bounded waits, the routing plan and its captured graphs, the output formatting and the reduce at the
origin. What a path does per call:

* :meth:`EnginePath.dispatch` -> :class:`DispatchRows` (the received rows and their scale rows, the plan the handle
  keeps, the row origins);
* :meth:`EnginePath.combine_backward` -> :class:`BackwardRows` (the weighted gradient rows at the expert ranks);
* :meth:`EnginePath.send_to_origins`: combine's and dispatch backward's rows back to their origin slots in ``comb_q``
  (the peer-pointer paths share one implementation; the put path stages and puts);
* :meth:`EnginePath.exchange`: the counts exchange or the "ready" handshake.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import put_path
from .handle import EPHandle
from .plan import RoutingPlan
from .nvshmem_state import RowOrigins, handle_origins
from .plan_graph import PlanOutputs


@dataclass(frozen=True)
class DispatchRows:
    """What a path's dispatch produced: ``q`` fresh uint8 ``[R, H]`` (MX payload) / ``[R, 2H]`` (bf16 bytes) rows,
    ``scale_rows`` their row-major uint8 ``[>= R, H/32]`` scale rows (MX), ``kept`` the plan outputs the handle keeps,
    ``ids`` the checked expert ids ``[T, k]``, ``num_rows`` R, ``origins`` the row origins (None on the local path)."""

    q: torch.Tensor
    scale_rows: torch.Tensor
    kept: PlanOutputs
    ids: torch.Tensor
    num_rows: int
    origins: Optional[RowOrigins]


@dataclass(frozen=True)
class BackwardRows:
    """Combine backward's rows at the expert rank: ``q`` fresh uint8 ``[R, H]`` / ``[R, 2H]``, ``scale_rows`` their
    row-major scale rows (MX); ``waited``: the call waited for peers (its error words must be read)."""

    q: torch.Tensor
    scale_rows: torch.Tensor
    waited: bool


class EnginePath:
    """One way of moving rows (see the module doc). ``engine``: the :class:`~mxcomm.ep.nvshmem_backend.NvshmemBackend`
    that owns this path (this module does not import it: the engine imports the paths); ``bufs``: its symmetric
    buffers by name."""

    name = ""

    def __init__(self, engine, bufs: dict):
        self.e = engine

    def refuse_capture(self) -> None:
        """Raise before any work if the current stream is being captured and this path cannot be."""

    # -- the counts exchange / ready handshake ------------------------------------------------
    def exchange(self, my_counts: Optional[torch.Tensor]) -> None:
        """Publish this rank's int32 ``[E]`` counts to every rank and wait (bounded) for everybody's (``None``: the
        "ready" handshake only), through peer pointers. The dispatch epoch must already be advanced."""
        from .nvshmem_kernels import exchange_counts_kernel

        e = self.e
        E = 0 if my_counts is None else e.config.num_experts
        exchange_counts_kernel[(e.world,)](
            e.err if my_counts is None else my_counts, e.counts.peer_ptrs, e.flags.peer_ptrs,
            e.flag_rows[0], e.d_epoch, e.err, e.timeout_ns, e.rank, E, E_POW2=e.next_pow2(max(E, 1)),
        )

    # -- combine direction ------------------------------------------------------------------
    def send_to_origins(self, payload: torch.Tensor, in_scales: torch.Tensor, handle: EPHandle, mx: bool,
                        passthrough: bool, comb_q, comb_s) -> None:
        """Every real expert-major row of ``payload`` (bf16 ``[R, H]``, quantized in the kernel when ``mx``; or MXFP8
        bytes ``[R, H]`` with row scales ``in_scales`` when ``passthrough``) to its origin's ``comb_q`` at its send
        position (copy ``c_epoch % 2``), then wait (bounded) for every source's rows."""
        from .nvshmem_kernels import combine_send_kernel, wait_arrivals_kernel

        e = self.e
        origins = handle_origins(handle)
        self._combine_send(payload, in_scales, handle, origins, comb_q.peer_ptrs, comb_s.peer_ptrs, mx, passthrough,
                           staged=False, kernel=combine_send_kernel)
        wait_arrivals_kernel[(e.world,)](e.flag_rows[2], e.expect_rows[2], e.programs, e.err, e.timeout_ns)

    def _combine_send(self, payload, in_scales, handle, origins, q_ptrs, s_ptrs, mx, passthrough, staged, kernel):
        e = self.e
        H = e.config.hidden
        kernel[(e.programs,)](
            payload, handle.backend_state.num_rows_dev, origins.src, origins.pos, q_ptrs, s_ptrs, e.flags.peer_ptrs,
            e.rank, e.world, e.c_epoch, e.nslot, in_scales, H=H, BR=e.launch.send_rows,
            CHUNK=min(e.launch.send_chunk, e.next_pow2(H)), MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round,
            PASS=passthrough, STAGED=staged, num_warps=e.launch.send_warps,
        )

    # -- per path ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> DispatchRows:
        raise NotImplementedError

    def combine_backward(self, g: torch.Tensor, w: torch.Tensor, handle: EPHandle, mx: bool) -> BackwardRows:
        raise NotImplementedError


class LocalPath(EnginePath):
    """One rank: nothing leaves the GPU. Dispatch: the id check, counts and plan (captured once per token count and
    replayed), then ``dispatch_kernel`` reads each token row once, quantizes it once and stores it straight into the
    fresh output at every selection's row (scale rows into ``recv_s``), padding rows zeroed by the same launch; one
    host sync (the output size, with the id check). Combine backward: the same kernel with per-slot weighting. Buffer:
    ``ep.recv_s`` (scale rows)."""

    name = "local"

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.recv_s = bufs["ep.recv_s"]

    def _middle(self, counts_buf: torch.Tensor, topk_idx: torch.Tensor) -> PlanOutputs:
        """Everything before the output kernel: the id check of the caller's ``topk_idx`` and the counts (read at the
        call's one host sync), epoch += 1, the counts as the counts matrix, the plan of the checked ids on it.
        ``extra["ids"]``: the checked ids."""
        e = self.e
        ids, my_counts = e.checked_ids(topk_idx, sync=False)
        e.d_epoch.add_(1)
        counts_buf[0].copy_(my_counts)
        po = e.compute_plan(counts_buf, ids)
        return PlanOutputs(plan=po.plan, extra={**po.extra, "ids": ids})

    def _out(self, x: torch.Tensor, plan: RoutingPlan, R: int, mx: bool, w: torch.Tensor, weighted: bool):
        """Fresh uint8 ``[R, H]`` (MX) / ``[R, 2H]`` (bf16 bytes) written by ``dispatch_kernel`` itself: each row of
        ``x`` (bf16 ``[T, H]``; ``weighted``: times ``w[t, j]`` per slot) read once, quantized (MX), stored at every
        selection's expert-major row, its scale row into ``recv_s``; padding and tail rows zeroed by the same launch
        (``ZERO_PAD``). No symmetric buffer holds the payload and nothing is copied afterwards."""
        from .nvshmem_kernels import dispatch_kernel

        e = self.e
        T, H = x.shape
        out = torch.empty(R, H if mx else 2 * H, dtype=torch.uint8, device=e.device)
        if R:
            dispatch_kernel[(e.dispatch_programs,)](
                x, T, plan.dest_rank, plan.dest_row, out if mx else out.view(torch.bfloat16), self.recv_s.peer_ptrs,
                e.flags.peer_ptrs, 0, 1, w, plan.offs, plan.expert_counts, plan.num_rows, R, e.El, H=H,
                K=e.config.topk, CHUNK=e.chunk(H, weighted), MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round,
                WEIGHTED=weighted, ARRIVE=False, ZERO_PAD=True, OUT_DIRECT=True, num_warps=e.dispatch_warps(weighted),
            )
        return out

    def dispatch(self, x, topk_idx):
        e = self.e
        mid = e.run_middle(self._middle, topk_idx)  # sends nothing: the id check is read at the output size sync
        R = e.output_rows("dispatch arrivals", ids=topk_idx)
        q = self._out(x, mid.live.plan, R, e.mx, x, weighted=False)  # the output kernel first, then the copies
        po = mid.keep()
        return DispatchRows(q=q, scale_rows=self.recv_s.local, kept=po, ids=po.extra["ids"], num_rows=R,
                            origins=None)

    def combine_backward(self, g, w, handle, mx):
        q = self._out(g, handle.plan, handle.num_rows, mx, w, weighted=True)  # no handshake, nothing to wait for
        return BackwardRows(q=q, scale_rows=self.recv_s.local, waited=False)


class PullPath(EnginePath):
    """Several ranks with peer pointers (the default). Dispatch: the id check and counts; then, captured once per
    token count and replayed: epoch += 1, ``pack_rows_kernel`` (each token row read once, quantized once, into this
    rank's send copy ``epoch % 2``), the counts exchange, the routing plan, ``push_entries_kernel`` (one pull-list
    entry per (token, destination rank) on the destination) and the bounded wait for every source's entries; then
    ``pull_rows_kernel`` reads each listed token's row once from its source's send copy into the fresh output at all
    its rows. Combine backward mirrors it with BF16 gradient rows and their route weights: the receivers weight and
    quantize per slot where the rows land (``pull_weighted_kernel``). Buffers: ``ep.send_q``, ``ep.send_s``,
    ``ep.send_w``, ``ep.pull_list``; no symmetric receive buffer (the receivers write fresh tensors)."""

    name = "pull"

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.send_q, self.send_s, self.send_w = bufs["ep.send_q"], bufs["ep.send_s"], bufs["ep.send_w"]
        self.pull_list = bufs["ep.pull_list"]
        # the captured middle reads this call's x by address (a fixed-address input of the graph)
        self.x_slot = torch.zeros(1, dtype=torch.int64, device=engine.device)

    def _scale_rows(self, R: int, mx: bool) -> torch.Tensor:
        """A fresh uint8 ``[R, H/32]`` for the scale rows the receiving kernel writes (a placeholder without MX)."""
        e = self.e
        if not mx:
            return e.err.view(torch.uint8)
        return torch.empty(R, e.config.hidden // 32, dtype=torch.uint8, device=e.device)

    def _pack(self, T: int, g: Optional[torch.Tensor] = None, w: Optional[torch.Tensor] = None) -> None:
        """Into this epoch's send copy, either this rank's ``T`` token rows (bf16 ``[T, H]`` at the address in
        ``x_slot``), quantized once (MX), or (combine backward) the BF16 gradient rows ``g`` ``[T, H]`` as they are
        with their fp32 route weights ``w`` ``[T, k]`` (into ``send_w``)."""
        from .nvshmem_kernels import pack_rows_kernel

        e = self.e
        H, T_max, k = e.config.hidden, e.config.max_tokens_per_rank, e.config.topk
        if not T:
            return
        mx = e.mx and g is None
        q = self.send_q.local if mx else self.send_q.local.view(torch.bfloat16)
        pack_rows_kernel[(min(T, e.dispatch_programs),)](
            self.x_slot if g is None else g, T, q, self.send_s.local, e.d_epoch, T_max,
            T_max * 2 * H if mx else T_max * H, e.err if w is None else w, self.send_w.local,
            H=H, CHUNK=e.chunk(H), MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round, X_SLOT=g is None,
            K=k, K_POW2=e.next_pow2(k), WEIGHTS=w is not None, num_warps=e.launch.dispatch_warps,
        )

    def _push_entries(self, plan: RoutingPlan) -> None:
        """One pull-list entry per (token, destination rank) on the destination, then wait (bounded) for every
        source's."""
        from .nvshmem_kernels import push_entries_kernel, wait_arrivals_kernel

        e = self.e
        push_entries_kernel[(e.push_programs,)](
            plan.dest_rank, plan.dest_row, plan.dest_rank.shape[0], self.pull_list.peer_ptrs, e.flags.peer_ptrs,
            e.d_epoch, e.rank, e.world, e.config.max_tokens_per_rank, K=e.config.topk,
            EW=self.pull_list.local.shape[-1], BLOCK=64, num_warps=4,
        )
        wait_arrivals_kernel[(e.world,)](e.flag_rows[1], e.expect_rows[1], e.push_programs, e.err, e.timeout_ns)

    def _middle(self, counts_buf: torch.Tensor, ids: torch.Tensor) -> PlanOutputs:
        """Between the id check and the receivers' gather: epoch += 1, pack (``x`` from ``x_slot``), counts exchange
        (the engine's ``counts_in``), the plan of ``ids`` on the exchanged ``counts_buf``, the pull-list entries and
        the bounded wait for every source's."""
        e = self.e
        e.d_epoch.add_(1)
        self._pack(ids.shape[0])  # before the exchange: its copy is not being read (see nvshmem_kernels, send_q)
        self.exchange(e.counts_in)
        po = e.compute_plan(counts_buf, ids)
        self._push_entries(po.plan)
        return po

    def _pull_out(self, plan: RoutingPlan, origins: RowOrigins, R: int, row_bytes: int):
        """``(rows, scale_rows)``: fresh uint8 ``[R, row_bytes]`` of the received rows, each listed token read once
        from its source's send copy and stored at all its rows, padding and tail rows zero; and (MX) a fresh uint8
        ``[R, H/32]`` of their scale rows, row-major (unfilled rows undefined)."""
        from .nvshmem_kernels import pull_rows_kernel

        e = self.e
        out = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
        words = row_bytes // 8
        C = e.config.hidden // 32
        srows = self._scale_rows(R, e.mx)
        if R:
            T_max = e.config.max_tokens_per_rank
            pull_rows_kernel[(min(max(R, e.world * T_max), e.dispatch_programs),)](
                out.view(torch.int64), srows, plan.num_rows, origins.src, R, self.send_q.peer_ptrs,
                self.send_s.peer_ptrs, self.pull_list.local, e.d_epoch, T_max, e.world,
                T_max * 2 * e.config.hidden // 8, ROW_WORDS=words, CHUNK=min(512, e.next_pow2(words)), C=C,
                C_POW2=e.next_pow2(C), K=e.config.topk, EW=self.pull_list.local.shape[-1], MX=e.mx, num_warps=4,
            )
        return out, srows

    def _pull_weighted(self, plan: RoutingPlan, origins: RowOrigins, R: int, mx: bool):
        """Combine backward, receiver: ``(rows, scale_rows)`` like :meth:`_pull_out`, each listed token's BF16
        gradient row read once from its source's send copy and ``w[t, j] * g[t]`` quantized (MX) or rounded per slot
        into the fresh ``[R, H]`` rows (uint8 MX payload / bf16 bytes); padding and tail rows zero."""
        from .nvshmem_kernels import pull_weighted_kernel

        e = self.e
        H, T_max, k = e.config.hidden, e.config.max_tokens_per_rank, e.config.topk
        row_bytes = H if mx else 2 * H
        out = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
        srows = self._scale_rows(R, mx)
        if R:
            pull_weighted_kernel[(min(max(R, e.world * T_max), e.dispatch_programs),)](
                out if mx else out.view(torch.bfloat16), srows, plan.num_rows, origins.src, R, self.send_q.peer_ptrs,
                self.send_w.peer_ptrs, self.pull_list.local, e.d_epoch, T_max, e.world, T_max * H,
                H=H, CHUNK=e.chunk(H, True), K=k, EW=self.pull_list.local.shape[-1], MX=mx, MODE=e.mode_id,
                INT_ROUND=e.int_round, ZCHUNK=min(512, e.next_pow2(row_bytes // 8)), num_warps=e.dispatch_warps(True),
            )
        return out, srows

    def dispatch(self, x, topk_idx):
        e = self.e
        ids, my_counts = e.checked_ids(topk_idx)
        self.x_slot.fill_(x.data_ptr())
        if my_counts.data_ptr() != e.counts_in.data_ptr():  # (check_and_count writes it in place)
            e.counts_in.copy_(my_counts)
        mid = e.run_middle(self._middle, ids)
        R = e.output_rows("dispatch arrivals")
        live = mid.live
        o = e.origins_from(live, R)
        q, srows = self._pull_out(live.plan, o, R, e.config.hidden * (1 if e.mx else 2))  # first, then the copies
        po = mid.keep()
        return DispatchRows(q=q, scale_rows=srows, kept=po, ids=ids, num_rows=R, origins=e.origins_from(po, R))

    def combine_backward(self, g, w, handle, mx):
        # the BF16 rows and weights into this epoch's send copy; ready handshake (every peer finished reading the copy
        # and the pull list of the last call in this direction); one pull-list entry per (token, rank), as in
        # dispatch; the receivers read each row once and weight + quantize it per slot where it lands
        e = self.e
        e.d_epoch.add_(1)
        self._pack(g.shape[0], g=g, w=w)
        self.exchange(None)
        self._push_entries(handle.plan)
        q, srows = self._pull_weighted(handle.plan, handle.backend_state.origins, handle.num_rows, mx)
        return BackwardRows(q=q, scale_rows=srows, waited=True)


class PushPath(EnginePath):
    """Several ranks, ``transport="push"``: after the counts exchange and the plan, ``dispatch_kernel`` reads each
    token row once, quantizes it once and stores it into each destination's ``recv_q`` at its expert-major rows
    (scale rows into ``recv_s``); after the bounded arrival wait the receiver copies the rows out into a fresh tensor
    (the buffer is reused by the next call). Combine backward: the ready handshake, then the same kernel with per-slot
    weighting. Buffers: ``ep.recv_q``, ``ep.recv_s`` (sized for the worst-case routing)."""

    name = "push"

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.recv_q, self.recv_s = bufs["ep.recv_q"], bufs["ep.recv_s"]

    def _send_to_experts(self, x: torch.Tensor, plan: RoutingPlan, w: torch.Tensor, weighted: bool, mx: bool) -> None:
        """Each row of ``x`` (bf16 ``[T, H]``; ``weighted``: times ``w[t, j]`` per slot) to its slots' expert-major
        rows on the destinations (MXFP8 when ``mx``), then wait for every source's rows."""
        from .nvshmem_kernels import dispatch_kernel, wait_arrivals_kernel

        e = self.e
        self._dispatch_kernel(dispatch_kernel, x, plan, plan.dest_row, self.recv_q.peer_ptrs, self.recv_s.peer_ptrs,
                              w, weighted, mx, arrive=True)
        wait_arrivals_kernel[(e.world,)](e.flag_rows[1], e.expect_rows[1], e.dispatch_programs, e.err, e.timeout_ns)

    def _dispatch_kernel(self, kernel, x, plan, rows, q_ptrs, s_ptrs, w, weighted, mx, arrive):
        e = self.e
        T, H = x.shape
        kernel[(e.dispatch_programs,)](
            x, T, plan.dest_rank, rows, q_ptrs, s_ptrs, e.flags.peer_ptrs, e.rank, e.world, w,
            plan.offs, plan.expert_counts, plan.num_rows, 0, 0, H=H, K=e.config.topk, CHUNK=e.chunk(H, weighted),
            MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round, WEIGHTED=weighted, ARRIVE=arrive,
            num_warps=e.dispatch_warps(weighted),
        )

    def _copy_out(self, plan: RoutingPlan, origins: RowOrigins, R: int, row_bytes: int) -> torch.Tensor:
        """Fresh uint8 ``[R, row_bytes]`` of the received rows, copied out of ``recv_q``; padding and tail rows
        zero."""
        from .nvshmem_kernels import copy_out_rows_kernel

        e = self.e
        out = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
        words = row_bytes // 8
        if R:
            src = self.recv_q.local.view(-1)[: e.R_max * row_bytes].view(torch.int64)
            copy_out_rows_kernel[(min(R, e.programs * 4),)](
                src, out.view(torch.int64), plan.num_rows, origins.src, R,
                ROW_WORDS=words, CHUNK=min(512, e.next_pow2(words)), num_warps=4,
            )
        return out

    def dispatch(self, x, topk_idx):
        e = self.e
        ids, my_counts = e.checked_ids(topk_idx)
        e.d_epoch.add_(1)
        self.exchange(my_counts)
        po = e.plan_from_counts(ids)
        self._send_to_experts(x, po.plan, x, weighted=False, mx=e.mx)
        R = e.output_rows("dispatch arrivals")
        o = e.origins_from(po, R)
        q = self._copy_out(po.plan, o, R, e.config.hidden * (1 if e.mx else 2))
        return DispatchRows(q=q, scale_rows=self.recv_s.local, kept=po, ids=ids, num_rows=R, origins=o)

    def combine_backward(self, g, w, handle, mx):
        e = self.e
        e.d_epoch.add_(1)
        # ready handshake: nobody writes into a peer's receive buffer before it has finished the last copy-out
        self.exchange(None)
        self._send_to_experts(g, handle.plan, w, weighted=True, mx=mx)
        q = self._copy_out(handle.plan, handle.backend_state.origins, handle.num_rows, e.config.hidden * (1 if mx else 2))
        return BackwardRows(q=q, scale_rows=self.recv_s.local, waited=True)


class PutPath(PushPath):
    """The push path over NVSHMEM puts with signals (``transport="put"``, or needed because a peer has no peer
    pointer, e.g. on another node): the same kernels write into this rank's staging buffer (dispatch: in send order;
    combine: in this rank's expert-major order), then one put per (destination, expert) block with a signal; the
    counts and the "ready" handshake travel as puts too, and the arrival waits become signal waits. Every rank, itself
    included, is reached through puts. Not tested under CUDA graph capture: capture is refused. Buffers: the push
    path's plus ``ep.stage_q``, ``ep.stage_s``."""

    name = "put"

    def __init__(self, engine, bufs, puts=None):
        super().__init__(engine, bufs)
        e = engine
        W, E, dev = e.world, e.config.num_experts, e.device
        self.puts = put_path.Puts() if puts is None else puts
        self.put_chunks = 4  # pieces per put entry (same on every rank: the signal count depends on it)
        self.stage_q, self.stage_s = bufs["ep.stage_q"], bufs["ep.stage_s"]
        self._stage_ptrs = torch.full((W,), self.stage_q.local.data_ptr(), dtype=torch.int64, device=dev)
        self._stage_s_ptrs = torch.full((W,), self.stage_s.local.data_ptr(), dtype=torch.int64, device=dev)
        self._counts_batch = put_path.row_batch(W, e.rank, 4 * E, dev)
        self._ready_batch = put_path.row_batch(W, e.rank, 0, dev)
        self._all_src = torch.arange(W, dtype=torch.int32, device=dev)
        self._per_call = 2 * e.El * self.put_chunks  # signals per source and call (payload + scales)

    def refuse_capture(self) -> None:
        if self.e.capturing():
            raise NotImplementedError(
                "the put-with-signal path (transport='put' or peers on other nodes) has not been tested under "
                "CUDA graph capture; capture is refused before any work"
            )

    def exchange(self, my_counts):
        e = self.e
        if my_counts is not None:
            e.counts.local[e.rank].copy_(my_counts)
        batch = self._ready_batch if my_counts is None else self._counts_batch
        sig = e.flag_rows[0]
        self.puts.put(e.counts.local, e.counts.local, batch, sig, e.rank, e.err, 1)
        self.puts.wait(sig, self._all_src, e.d_epoch, 1, e.err, e.timeout_ns)

    def _put_blocks(self, blocks: "put_path.BlockPuts", dst_q, dst_s, row: int, epoch: torch.Tensor) -> None:
        """Put the staged blocks (payload, scales), wait (bounded) for every source's blocks of this epoch in
        ``flags[row]``, then quiet (the staging buffer may be rewritten after it)."""
        e = self.e
        sig, C = e.flag_rows[row], self.put_chunks
        self.puts.put(dst_q.local, self.stage_q.local, blocks.payload, sig, e.rank, e.err, C)
        self.puts.put(dst_s.local, self.stage_s.local, blocks.scales, sig, e.rank, e.err, C)
        self.puts.wait(sig, self._all_src, epoch, self._per_call, e.err, e.timeout_ns)
        self.puts.quiet()

    def _send_to_experts(self, x, plan, w, weighted, mx):
        """The rows into staging at their send positions, then one put per (destination, expert) block, then the
        signal wait for every source's blocks."""
        from .nvshmem_kernels import dispatch_kernel

        e = self.e
        H = x.shape[1]
        self._dispatch_kernel(dispatch_kernel, x, plan, plan.send_pos, self._stage_ptrs, self._stage_s_ptrs, w,
                              weighted, mx, arrive=False)
        blocks = put_path.dispatch_blocks(plan, H if mx else 2 * H, H // 32 if mx else 0)
        self._put_blocks(blocks, self.recv_q, self.recv_s, 1, e.d_epoch)

    def send_to_origins(self, payload, in_scales, handle, mx, passthrough, comb_q, comb_s):
        """The rows into staging at their own index, then one put per (source, expert) block into the origins'
        ``comb_q`` / ``comb_s`` and the signal wait."""
        from .nvshmem_kernels import combine_send_kernel

        e = self.e
        H = e.config.hidden
        self._combine_send(payload, in_scales, handle, handle_origins(handle), self._stage_ptrs, self._stage_s_ptrs, mx,
                           passthrough, staged=True, kernel=combine_send_kernel)
        slot0 = (e.c_epoch % 2) * e.nslot
        blocks = put_path.combine_blocks(handle.plan, slot0, 2 * H, H if mx else 2 * H, H // 32 if mx else 0)
        self._put_blocks(blocks, comb_q, comb_s, 2, e.c_epoch)


PATHS = {"local": LocalPath, "pull": PullPath, "push": PushPath, "put": PutPath}

__all__ = ["EnginePath", "LocalPath", "PullPath", "PushPath", "PutPath", "DispatchRows", "BackwardRows", "PATHS"]
