"""The put-with-signal path (:class:`PutPath`): peers on other nodes."""
from __future__ import annotations

import torch

from ....kernels.launch import fast_kernel
from .. import put_path
from ...plan import put_round_tokens
from .base import FLAG_ROW, BackwardRows
from .push import PushPath


class PutPath(PushPath):
    """The push path over NVSHMEM puts with signals (``transport="put"``, or needed because a peer has no peer
    pointer, e.g. on another node). Dispatch: the same kernels write into this rank's staging buffer (in send order)
    and its pull-list entries into a staging list per destination; one put per (destination, expert) block (payload,
    scales) and one per destination (entries), with signals, into the receivers' window (the push path's rounds, the
    blocks clipped to each round's rows). Combine and dispatch backward: the partials into
    staging, one row per (source, token) entry of the table, then one put per entry into the origin's slot (one
    row per (token, rank), as on the peer-pointer paths) and one signal per destination. Combine backward: one put
    per (token, destination) of the BF16 gradient row into the destination's ``recv_q`` (its weights into
    ``recv_w``), the expert side as the pull path, the route-weight gradients staged and put back. Both directions
    move ``T_c`` tokens of every source per round (``put_round_tokens``: all of them up to ``W = k``), so the
    staging and ``recv_q`` stay ``T_max * k`` rows at any world size. The counts, the
    "ready" handshake and the weights travel as puts too, and every wait is a signal wait. Every rank, itself
    included, is reached through puts. Not tested under CUDA graph capture: capture is refused. Buffers: the push
    path's plus ``ep.stage_q``, ``ep.stage_s``, ``ep.stage_list``, ``ep.stage_gw``, ``ep.recv_w``."""

    name = "put"
    recv_q_holds_gradients = True

    def __init__(self, engine, bufs, puts=None):
        super().__init__(engine, bufs)
        e = engine
        W, E, T, k, H, dev = e.world, e.config.num_experts, e.config.max_tokens_per_rank, e.config.topk, \
            e.config.hidden, e.device
        self.puts = put_path.Puts(blocks=e.sms * e.launch.put_per_sm) if puts is None else puts
        self.stage_q, self.stage_s = bufs["ep.stage_q"], bufs["ep.stage_s"]
        self.stage_list, self.stage_gw, self.recv_w = bufs["ep.stage_list"], bufs["ep.stage_gw"], bufs["ep.recv_w"]
        self._stage_ptrs = torch.full((W,), self.stage_q.local.data_ptr(), dtype=torch.int64, device=dev)
        self._stage_s_ptrs = torch.full((W,), self.stage_s.local.data_ptr(), dtype=torch.int64, device=dev)
        EW = self.pull_list.local.shape[-1]
        # entries for destination d staged at stage_list[d]: push_entries_kernel writes entry [me, t] of "d's list"
        self._stage_list_ptrs = self._rows_of(self.stage_list.local, T * EW * 4) - e.rank * T * EW * 4
        self._scratch_flags = torch.zeros(len(FLAG_ROW), W, dtype=torch.int64, device=dev)
        self._scratch_ptrs = torch.full((W,), self._scratch_flags.data_ptr(), dtype=torch.int64, device=dev)
        self._counts_batch = put_path.counts_batch(W, e.rank, E, dev)
        self._ready_batch = put_path.row_batch(W, e.rank, 0, dev)
        self._weights_batch = put_path.row_batch(W, e.rank, T * k * 4, dev)
        self._gw_batch = put_path.swap_batch(W, e.rank, T * k * 4, dev)
        self._all_src = torch.arange(W, dtype=torch.int32, device=dev)
        self.round_tokens = put_round_tokens(e.config, W)  # T_c: tokens of every source per round
        # signals expected so far per signal word (every source sends the same number per call)
        self._expect = torch.zeros(len(FLAG_ROW), dtype=torch.int64, device=dev)
        # combine backward: a round's gradient rows of source s arrive in recv_q viewed as [W, T_c, 2H], its weights
        # in recv_w [W, T_max, k]; one copy (copy stride 0); the route-weight gradients are staged per origin
        self.g_src = self._rows_of(self.recv_q.local, self.round_tokens * 2 * H)
        self.w_src = self._rows_of(self.recv_w.local, T * k * 4)
        self.gw_dst = self._rows_of(self.stage_gw.local, T * k * 4)

    # combine here always exchanges the weights (one put and signal wait per rank, as dispatch backward's "ready"
    # put), although the entries carry them: the partials' row puts are issued by the host whatever the kernel
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
        i = FLAG_ROW[row]
        self._expect[i:i + 1].add_(n)
        self.puts.wait(e.flag_rows[i], self._all_src, self._expect[i:i + 1], 1, e.err, e.timeout_ns)

    def exchange(self, my_counts):
        """This rank's int32 ``[E + 1]`` counts and refusal word to every rank (two puts each), or (``None``) the
        "ready" handshake (one empty put each); then the signal wait."""
        e = self.e
        if my_counts is None:
            self.puts.put(e.counts.local, e.counts.local, self._ready_batch, e.flag_rows[0], e.rank, e.err, 1)
            self._wait("counts", 1)
            return
        E = e.config.num_experts
        e.counts.local[e.rank * E:(e.rank + 1) * E].copy_(my_counts[:E])
        e.refusal_words[e.rank:e.rank + 1].copy_(my_counts[E:E + 1])
        self.puts.put(e.counts.local, e.counts.local, self._counts_batch, e.flag_rows[0], e.rank, e.err, 1)
        self._wait("counts", 2)

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
        from ..kernels.dispatch import stage_rows_kernel

        e = self.e
        T, H = x.shape
        fast_kernel(stage_rows_kernel)[(e.sender_programs,)](
            x, T, plan.dest_rank, plan.send_pos, self._stage_ptrs, self._stage_s_ptrs, H=H, K=e.config.topk,
            CHUNK=e.launch.row_chunk(H), MX=mx, MODE=e.mode_id, INT_ROUND=e.int_round,
            num_warps=e.dispatch_warps(False),
        )
        self._push_entries(plan, w, self._stage_list_ptrs, self._scratch_ptrs)

    def _send_round(self, x, plan, w, mx, window, first):
        """One put per (destination, expert) block (payload, scales; with ``window``, the part of each block whose
        destination rows fall in it, :func:`put_path.dispatch_blocks`), with ``first`` one put per destination's
        entries, then the wait for every source's signals of this round."""
        e = self.e
        H, C = e.config.hidden, e.launch.put_chunks
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

    def _window_free(self, live=None):
        """A signal to every rank on the ``window`` flag row, then the wait for every rank's (every round, ``live``
        or not: the signals' count is the host's)."""
        e = self.e
        self.puts.put(self.recv_q.local, self.send_q.local, self._ready_batch, e.flag_rows[FLAG_ROW["window"]],
                      e.rank, e.err, 1)
        self._wait("window", 1)

    def _after_rounds(self):
        """``quiet``: the staging may be written again."""
        self.puts.quiet()

    def _token_rounds(self) -> list:
        """The tokens of every round of the combine direction and combine backward (``range`` objects of
        :data:`round_tokens` tokens each, the last one shorter)."""
        T, Tc = self.e.config.max_tokens_per_rank, self.round_tokens
        return [range(t0, min(t0 + Tc, T)) for t0 in range(0, T, Tc)]

    def send_partials(self, payload, in_scales, handle, mx, passthrough, weights):
        """Per round (``T_c`` tokens of every source): the partials into staging at their entry's index in the round,
        one put per (token, rank) entry into the origins' ``comb_q`` / ``comb_s`` (no signal), ``quiet`` (the staging
        may be written again); then one signal per destination and the wait for every source's."""
        from ..kernels.combine import stage_partials_kernel

        e = self.e
        H, W = e.config.hidden, e.world
        slot0 = (e.c_epoch % 2) * e.nslot
        st = handle.backend_state
        entries = put_path.partial_rows(st.table, st.origins.pos, e.rank, e.config.max_tokens_per_rank, slot0, 2 * H,
                                        H if mx else 2 * H, H // 32 if mx else 0, self.round_tokens)
        for tokens in self._token_rounds():
            fast_kernel(stage_partials_kernel)[(e.programs,)](
                payload, in_scales, st.table, e.err if weights is None else weights, self._stage_ptrs,
                self._stage_s_ptrs, W, e.config.max_tokens_per_rank, e.err, tokens.start, len(tokens),
                **self._partials_consts(mx, passthrough, weights),
            )
            rows = entries.entries(tokens.start * W, tokens.stop * W)
            self.puts.put(e.comb[0].local, self.stage_q.local, rows.payload, None, None, e.err, 1)
            if mx:  # (BF16 partials carry no scale bytes)
                self.puts.put(e.comb[1].local, self.stage_s.local, rows.scales, None, None, e.err, 1)
            self.puts.quiet()
        self.puts.put(e.comb[0].local, self.stage_q.local, self._ready_batch, e.flag_rows[2], e.rank, e.err, 1)
        self._wait("combine", 1)

    def combine_backward(self, g, w, handle, mx, expert_out):
        """Epoch += 1, the "ready" handshake (every destination finished with its ``recv_q`` of the previous call in
        this direction); this rank's gradient rows and weights into its send copy and the weights to every
        destination's ``recv_w`` [me, t]; then per round (``T_c`` tokens of every source, a ``window`` handshake
        between rounds): one put per (token, destination rank) of the round's gradient rows into the destination's
        ``recv_q`` [me, t - t0] (no signal), ``quiet``, one signal per destination, the wait for every source's, and
        the expert side's weighted rows (and route-weight gradients, staged) of the round's entries; finally the
        route-weight gradients go home."""
        from ..kernels.combine_backward import round_weighted_kernel

        e = self.e
        e.d_epoch.add_(1)
        self.exchange(None)
        T, H, k = g.shape[0], e.config.hidden, e.config.topk
        self.send_q.local[0].view(-1)[: T * 2 * H].copy_(g.reshape(-1).view(torch.uint8))
        self.send_w.local[0].view(-1)[: T * k].copy_(w.reshape(-1))
        plan = handle.plan
        slots = put_path.TokenSlots.of(plan, e.rank)  # (one row per (token, rank): the weights, then the rows)
        weights = slots.rows(e.config.max_tokens_per_rank, k * 4)
        self.puts.put(self.recv_w.local, self.send_w.local, weights, None, None, e.err, 1)
        out = self._new_backward_rows(handle, mx)
        grads = slots.rows(self.round_tokens, 2 * H)  # (a round's: a slice)
        for r, tokens in enumerate(self._token_rounds()):
            if r:
                self._window_free()  # every rank's weighted rows of the round before read its recv_q
            rows = grads.entries(tokens.start * k, tokens.stop * k)
            self.puts.put(self.recv_q.local, self.send_q.local, rows, None, None, e.err, 1)
            self.puts.quiet()
            self.puts.put(self.recv_q.local, self.send_q.local, self._ready_batch, e.flag_rows[1], e.rank, e.err, 1)
            self._wait("dispatch", 1)
            fast_kernel(round_weighted_kernel)[(e.programs,)](
                *self._weighted_head(out, handle, mx), e.config.max_tokens_per_rank, e.world,
                e.err if expert_out is None else expert_out, self.gw_dst, tokens.start, len(tokens),
                **self._weighted_consts(mx, expert_out is not None),
            )
        grad_w = self._route_grads(plan, T) if expert_out is not None else None
        return BackwardRows(q=out.q, scale_rows=out.scale_rows, grad_w=grad_w)

    def _route_grads(self, plan, T):
        """The staged route-weight gradients to their origins (one put each, into row ``me`` of their ``comb_gw``),
        the signal wait, then the gather."""
        e = self.e
        self.puts.put(self.comb_gw.local, self.stage_gw.local, self._gw_batch, e.flag_rows[4], e.rank, e.err, 1)
        self._wait("route_grad", 1)
        self.puts.quiet()
        return self._gather_route_grads(plan, T)
