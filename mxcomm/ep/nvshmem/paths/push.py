"""The push path (:class:`PushPath`): dispatch stores into the receivers' window, in rounds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ....kernels.launch import fast_kernel, next_pow2
from ..state import DeliveredWeights, RowOrigins
from ...plan import RoutingPlan, received_rows, recv_window_rows
from .base import DispatchRows, EnginePath, fp32_weights


@dataclass(frozen=True)
class DispatchRounds:
    """A dispatch's rounds through the receive window: ``rows`` this rank's output rows, ``count`` the rounds it
    runs, ``carrying`` (no-sync mode) the rounds that carry rows, int64 ``[1]`` on the device (the same on every
    rank; None in exact-size mode, where ``count`` is that number)."""

    rows: int
    count: int
    carrying: Optional[torch.Tensor] = None


class PushPath(EnginePath):
    """Several ranks, ``transport="push"``: after the counts exchange and the plan, ``push_rows_kernel`` reads each
    token row once, quantizes it once and stores it into each destination's ``recv_q`` at its expert-major rows
    (scale rows into ``recv_s``), and ``push_entries_kernel`` lists each (token, destination) in the destination's
    pull list; after the bounded arrival wait the receiver copies the rows out into a fresh tensor (the buffer is
    reused by the next call) and keeps its pull list's entries as the table. ``recv_q`` / ``recv_s`` hold a window
    of ``self.window`` expert-major rows (:func:`mxcomm.ep.plan.recv_window_rows`): a dispatch that brings some rank
    more moves in rounds of that many rows. Combine, dispatch backward and combine backward as the pull path (peer
    pointers). Buffers: ``ep.recv_q``, ``ep.recv_s`` and the combine buffers."""

    name = "push"
    recv_q_holds_gradients = False  # (the put path's recv_q also takes combine backward's gradient rows)

    def __init__(self, engine, bufs):
        super().__init__(engine, bufs)
        self.recv_q, self.recv_s = bufs["ep.recv_q"], bufs["ep.recv_s"]
        # rows of the receive window (recv_q, recv_s)
        self.window = recv_window_rows(engine.config, engine.world, self.recv_q_holds_gradients)
        self._window_epoch = torch.zeros(1, dtype=torch.int64, device=engine.device)  # handshakes between rounds

    # -- the steps of a dispatch's rounds (the put path overrides them) ------------------------------
    def _prepare(self, x: torch.Tensor, plan: RoutingPlan, w: torch.Tensor, mx: bool) -> None:
        """Before the rounds: nothing here (each round's kernel reads ``x`` itself)."""

    def _send_round(self, x: torch.Tensor, plan: RoutingPlan, w: torch.Tensor, mx: bool, window: Optional[tuple],
                    first: bool) -> None:
        """Each row of ``x`` (bf16 ``[T, H]``) to its slots' expert-major rows on the destinations (MXFP8 when
        ``mx``; with ``window = (lo, hi)`` only the slots whose rows fall in it, at ``row - lo``, and a token with none
        there is not read), with ``first`` one pull-list entry per (token, destination) and its route weights ``w``
        (fp32 ``[T, k]``); then wait for every source's."""
        from ..kernels.dispatch import push_rows_kernel

        e = self.e
        ranks, rows = plan.dest_rank, plan.dest_row
        if window is not None:
            lo, hi = window
            inside = (rows >= lo) & (rows < hi)
            ranks, rows = torch.where(inside, ranks, -1), torch.where(inside, rows - lo, 0)
        T, H = x.shape
        fast_kernel(push_rows_kernel)[(e.sender_programs,)](
            x, T, ranks, rows, self.recv_q.peer_ptrs, self.recv_s.peer_ptrs, e.flags.peer_ptrs, e.rank, e.world, H=H,
            K=e.config.topk, CHUNK=e.launch.row_chunk(H), MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round,
            SKIP_EMPTY=window is not None, num_warps=e.dispatch_warps(False),
        )
        if first:
            self._push_entries(plan, w, self.pull_list.peer_ptrs, e.flags.peer_ptrs)
        self._wait_arrivals(1, e.sender_programs + (e.push_programs if first else 0))

    def _window_free(self, live: Optional[torch.Tensor] = None) -> None:
        """Between two rounds: tell every rank this one copied the window out, and wait (bounded) until every rank
        did (``publish_kernel`` on the ``window`` flag row, its own epoch). ``live`` (no-sync mode: int64 ``[1]``, 1
        when the next round carries rows, the same on every rank): an empty round's handshake leaves the epoch where
        it is, so its publish and wait are satisfied at once (nothing is written into the window after it)."""
        e = self.e
        self._window_epoch.add_(1 if live is None else live)
        self._publish(e.err, 0, e.counts.peer_ptrs, 0, "window", self._window_epoch)

    def _after_rounds(self) -> None:
        """After the last round: nothing here."""

    def _copy_rows(self, src: torch.Tensor, dst: torch.Tensor, plan: RoutingPlan, origins: RowOrigins,
                   row0: int) -> None:
        """Rows ``[row0, row0 + n)`` of the fresh ``dst`` (uint8 ``[R, B]``) from rows ``[0, n)`` of the receive
        buffer ``src`` (uint8 ``[n, B]``): padding rows zero, rows past the plan's ``n_rows`` not written
        (``copy_out_rows_kernel``)."""
        from ..kernels.layout import copy_out_rows_kernel

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

    def _rounds(self, plan: RoutingPlan, topk_idx: torch.Tensor) -> DispatchRounds:
        """This rank's output rows and the dispatch's rounds through the receive window. Exact sizes: both read at the
        call's one host sync, before any row is sent (the most rows any rank receives travels in the status words,
        ``most``, beside the row count), where bad ids of this rank raise the detailed ValueError (``topk_idx``), a
        peer's refusal PeerTimeout naming it and a failed counts exchange PeerTimeout too. No-sync mode: the worst
        case of both, and the rounds that carry rows counted on the device."""
        e = self.e
        most = received_rows(plan).max()
        if e.config.exact_sizes:
            e.status_words.most.copy_(most.view(1))
            sizes = e.status_words.check("dispatch counts", ids=topk_idx)
            return DispatchRounds(rows=sizes.rows, count=max(1, -(-min(sizes.most, e.R_max) // self.window)))
        R = e.output_rows("dispatch counts", ids=topk_idx)
        return DispatchRounds(rows=R, count=max(1, -(-e.R_max // self.window)),
                              carrying=(most + self.window - 1).view(1) // self.window)

    def dispatch(self, x, topk_idx, topk_weights):
        """Id check and counts exchange (every rank's refusal word with its counts), the plan, then the rows into the
        receivers' window in rounds (:meth:`_send_round`; one when every rank's rows fit the window), each copied
        out of ``recv_q`` / ``recv_s`` into fresh tensors before :meth:`_window_free` lets the next round in. Exact
        sizes sync with the host once, before any row is sent (the rows and the rounds; bad ids, refusals and a
        failed counts exchange raise there on every rank, so the group stays usable); a bounded wait of the rounds
        that timed out is raised without a sync, as combine's are (:meth:`NvshmemBackend.after_call`: by the next
        call that finds its error word on the host, the next dispatch's sync or ``check_errors``)."""
        e = self.e
        ids = e.checked_ids(topk_idx, refusal_word=True)  # (counts and refusal word into counts_in)
        e.d_epoch.add_(1)
        self.exchange(e.counts_in)
        po = e.plan_from_counts(ids)
        plan, mx, H = po.plan, e.mx, e.config.hidden
        w = fp32_weights(topk_weights.detach())
        rounds = self._rounds(plan, topk_idx)
        R = rounds.rows
        self._prepare(x, plan, w, mx)
        row_bytes = H * (1 if mx else 2)
        win_q = self.recv_q.local.view(-1)[: self.window * row_bytes].view(self.window, row_bytes)
        o = e.origins_from(po, R)
        q = torch.empty(R, row_bytes, dtype=torch.uint8, device=e.device)
        srows = self._scale_rows(R, mx)
        for r in range(rounds.count):
            if r:
                self._window_free(None if rounds.carrying is None else (rounds.carrying > r).to(torch.int64))
            lo = r * self.window
            # (one round: every rank's rows fit the window, nothing to clip)
            self._send_round(x, plan, w, mx, (lo, lo + self.window) if rounds.count > 1 else None, r == 0)
            self._copy_rows(win_q, q, plan, o, lo)
            if mx:
                self._copy_rows(self.recv_s.local, srows, plan, o, lo)
        self._after_rounds()
        table, wtab = self._table_from_list()
        if e.config.exact_sizes:  # (no-sync mode: the check at the start of the call started the copy)
            e.after_call("dispatch arrivals", waited=True)
        return DispatchRows(q=q, scale_rows=srows, kept=po, ids=ids, num_rows=R, origins=o, table=table,
                            weights=DeliveredWeights.of(wtab, topk_weights))
