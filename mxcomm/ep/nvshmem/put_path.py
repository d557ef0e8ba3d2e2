"""The put-with-signal transfer of the ``nvshmem`` EP backend: the path for peers without a peer pointer
(other nodes), forced on one node with ``EPConfig(transport="put")``.

Instead of storing into peers' buffers, the sending kernels write into this rank's symmetric staging
buffer (``ep.stage_q`` / ``ep.stage_s``); NVSHMEM then moves the rows with non-blocking puts that signal
the destination (``csrc/put_signal.cu`` through :mod:`mxcomm.transport.put_signal`):

* dispatch: the kernel writes slot ``(t, j)`` at its send position (send order = (global expert, t, j),
  so each expert's rows are one block); the block for global expert ``g`` on rank ``p`` lands at its rows
  in ``p``'s expert-major ``recv_q``, one put each; its scale bytes (row-major) land at the same rows of
  ``p``'s ``recv_s``. ``recv_q`` is a window of the expert-major rows: when some rank receives more, the
  rows move in rounds (each round the part of every block that falls in the window, then the receivers
  copy the window out into their fresh outputs and tell every source it is free); ``p`` swizzles the scale
  rows into the grouped-along-M blocked layout after the last round;
* combine backward: one put per (token, destination rank) of the BF16 gradient row, in rounds of
  ``T_c`` tokens (below), and of its route weights (:func:`token_rows`);
* combine direction (combine, dispatch backward): one row per (token, rank), as on the peer-pointer
  paths, in rounds of ``T_c`` tokens of every source (``plan.put_round_tokens``): the kernel writes the
  partial of table entry ``(s, t)`` of the round's tokens ``[t0, t0 + T_c)`` at staging row ``(t - t0) * W
  + s``, and one put per entry carries it to ``s``'s ``comb_q`` / ``comb_s`` at the send position of the
  token's leading slot, in the copy the combine epoch's parity selects. These puts carry no signal (no
  remote atomic per row); a ``quiet`` ends each round, and one signal per destination says they arrived.
  The entries are built once per call, token-major, and each round puts a slice of them.

In the dispatch direction every rank puts exactly ``El`` payload entries and ``El`` scale entries (empty
blocks only signal) to every rank per round, ``chunks`` pieces each, so a receiver expects
``2 * El * chunks`` signals per source and round (plus the entries' in the first): it waits (bounded) for
the running total.
Counts travel the same way, two entries per rank (the ``E`` int32 counts and the refusal word), the "ready"
handshake of combine backward one empty entry per rank.
Self is treated like any other rank (NVSHMEM copies locally), so one GPU exercises the whole path.

Everything here is plain torch on the plan's device (no host sync); :class:`Puts` is the seam
between the backend and the CUDA kernels (tests on CPU substitute an in-process stand-in).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...transport.put_signal import PutBatch
from ..plan import RoutingPlan, padded_group_rows


@dataclass(frozen=True)
class BlockPuts:
    """The two put batches of one call: ``payload`` (rows) and ``scales`` (row-major scale bytes; all
    sizes 0 when the rows carry no scales). Entry ``i`` of both is the same block of rows."""

    payload: PutBatch
    scales: PutBatch

    def entries(self, lo: int, hi: int) -> "BlockPuts":
        """Entries ``[lo, hi)`` of both batches (views)."""
        return BlockPuts(payload=self.payload.entries(lo, hi), scales=self.scales.entries(lo, hi))


def _batch(dst_row: torch.Tensor, src_row: torch.Tensor, n: torch.Tensor, pes: torch.Tensor, row_bytes: int,
           dst_base: torch.Tensor | int = 0) -> PutBatch:
    rb = int(row_bytes)
    return PutBatch(dst_offsets=(dst_base + dst_row * rb).contiguous(), src_offsets=(src_row * rb).contiguous(),
                    nbytes=(n * rb).contiguous(), pes=pes.to(torch.int32).contiguous())


def dispatch_blocks(plan: RoutingPlan, row_bytes: int, scale_bytes: int, window: tuple[int, int] | None = None
                    ) -> BlockPuts:
    """Put entries of the dispatch direction from this rank: one per global expert ``g`` (on rank
    ``g // El``), in global expert order.

    Block ``g``: ``counts[me, g]`` rows from staging row ``sum_{g' < g} counts[me, g']`` (the send order)
    to the destination's expert-major row ``gstart[g] + sum_{s < me} counts[s, g]``. With ``window = (lo, hi)``
    only the block's rows whose destination row is in ``[lo, hi)`` travel, to row ``dest - lo`` (the receive
    window of one round); the entries stay one per expert (empty ones only signal).

    Args:
        plan: this rank's :class:`~mxcomm.ep.plan.RoutingPlan` (needs ``counts`` of the whole group).
        row_bytes: bytes per payload row (H for MXFP8, 2H for BF16), same stride in staging and ``recv_q``.
        scale_bytes: scale bytes per row (H/32 for MXFP8, 0 for BF16).
        window: the destination rows of this round, or None (every row, to its own index).
    Returns:
        :class:`BlockPuts` of ``E`` entries each (int64 offsets/sizes, int32 PEs, plan's device).
    """
    E, El, me = plan.num_experts, plan.num_local_experts, plan.rank
    c = plan.counts.to(torch.int64)
    n = c[me]
    src_row = torch.cumsum(n, 0) - n
    p_re = padded_group_rows(plan)
    gstart = (torch.cumsum(p_re, 1) - p_re).reshape(E)
    dst_row = gstart + (torch.cumsum(c, 0) - c)[me]
    if window is not None:
        lo, hi = window
        first, end = dst_row.clamp(lo, hi), (dst_row + n).clamp(lo, hi)
        n = end - first
        # (an empty entry's offsets at 0: they must pass the put's range check)
        src_row, dst_row = torch.where(n > 0, src_row + (first - dst_row), 0), torch.where(n > 0, first - lo, 0)
    pes = torch.arange(E, device=c.device) // El
    return BlockPuts(payload=_batch(dst_row, src_row, n, pes, row_bytes),
                     scales=_batch(dst_row, src_row, n, pes, scale_bytes))


def partial_rows(table: torch.Tensor, origin_pos: torch.Tensor, rank: int, max_tokens: int, slot0: torch.Tensor,
                 copy_bytes: int, row_bytes: int, scale_bytes: int, round_tokens: int | None = None) -> BlockPuts:
    """Put entries of the combine direction from this rank: one per entry ``(s, t)`` of the dispatch's table, i.e.
    one row per (token, rank), as the peer-pointer paths store them, token-major: entry ``t * W + s``, so that the
    entries of a round of ``T_c = round_tokens`` tokens (None: ``T_max``, one round) starting at token ``t0`` are
    ``[t0 * W, (t0 + n) * W)`` (:meth:`BlockPuts.entries`).

    Entry ``(s, t)`` with a slot here: staging row ``(t * W + s) mod (T_c * W)``, i.e. ``(t - t0) * W + s`` in its
    round (where ``stage_partials_kernel(..., t_lo=t0, t_n=n)`` put the partial), to slot ``slot0 + pos`` of source
    ``s``'s combine buffers, the token's combine slot for this rank (:func:`mxcomm.ep.plan.combine_slots`: ``t * W +
    rank`` when ``W < k``, else ``origin_pos[lead]``, ``lead`` being the row of the token's first slot on this rank);
    one without is an empty entry to this rank.

    Args:
        table: int32 ``[W * T_max, k]``, the handle's table (rows here per slot, -1 elsewhere).
        origin_pos: int32 ``[R]``, each row's send position at its origin.
        rank: this rank; max_tokens: ``T_max``.
        slot0: int64 ``[1]`` device tensor, first slot of this epoch's copy (``(epoch % 2) * nslot``, ``nslot`` =
            :func:`mxcomm.ep.plan.combine_slots`).
        copy_bytes: payload bytes per slot of a copy's stride in ``comb_q`` (2H): copy ``c`` starts at
            ``c * nslot * copy_bytes``; payload rows inside a copy are ``row_bytes`` apart.
        row_bytes: payload bytes per row (H MXFP8, 2H BF16), also the staging's row stride; scale_bytes: H/32 or 0.
        round_tokens: ``T_c``, tokens of every source per round (the staging holds ``T_c * W`` rows).
    Returns:
        :class:`BlockPuts` of ``W * T_max`` entries each, token-major.
    """
    k = table.shape[-1]
    W = table.shape[0] // max_tokens
    table = table.view(W, max_tokens, k).transpose(0, 1).reshape(-1, k)  # token-major: row t * W + s
    tc = max_tokens if round_tokens is None else int(round_tokens)
    n_entries = table.shape[0]
    dev = table.device
    listed = table >= 0
    has = listed.any(1)
    i = torch.arange(n_entries, dtype=torch.int64, device=dev)
    if W < k:  # by (token, rank): entry t * W + s is token t
        pos = i // W * W + rank
    else:  # the send position of the entry's first listed slot (slot 0 for an empty entry)
        first = listed.to(torch.int8).argmax(1, keepdim=True)
        lead = table.gather(1, first).squeeze(1).clamp(min=0).to(torch.int64)
        pos = torch.cat([origin_pos.to(torch.int64), origin_pos.new_zeros(1, dtype=torch.int64)])[lead]
    pos = torch.where(has, pos, 0)  # (an empty entry's offsets must pass the range check: origin_pos may be garbage)
    pes = torch.where(has, i % W, torch.full_like(i, rank))
    n = has.to(torch.int64)
    s0 = slot0.to(torch.int64)
    stage_row = i % (tc * W)
    return BlockPuts(payload=_batch(pos, stage_row, n, pes, row_bytes, dst_base=s0 * int(copy_bytes)),
                     scales=_batch(s0 + pos, stage_row, n, pes, scale_bytes))


def row_batch(world: int, rank: int, row_bytes: int, device) -> PutBatch:
    """One entry per rank ``p``: ``row_bytes`` bytes at offset ``rank * row_bytes`` of a ``[W, *]`` buffer to
    the same offset on ``p`` (0 bytes to self: the row is already there). ``row_bytes = 0``: signals only."""
    off = torch.full((world,), rank * int(row_bytes), dtype=torch.int64, device=device)
    nb = torch.full((world,), int(row_bytes), dtype=torch.int64, device=device)
    nb[rank] = 0
    return PutBatch(dst_offsets=off, src_offsets=off.clone(), nbytes=nb,
                    pes=torch.arange(world, dtype=torch.int32, device=device))


def counts_batch(world: int, rank: int, num_experts: int, device) -> PutBatch:
    """The counts exchange's entries into the ``ep.counts`` buffer (int32 ``[W * E + W]``: the counts matrix, then
    one refusal word per rank): to every rank ``p``, this rank's ``E`` counts (row ``rank``) and its refusal word
    (word ``W * E + rank``), two entries each (0 bytes to self: both are already there)."""
    rows = row_batch(world, rank, 4 * num_experts, device)
    off = torch.full((world,), 4 * (world * num_experts + rank), dtype=torch.int64, device=device)
    nb = torch.full((world,), 4, dtype=torch.int64, device=device)
    nb[rank] = 0
    return PutBatch(dst_offsets=torch.cat([rows.dst_offsets, off]), src_offsets=torch.cat([rows.src_offsets, off]),
                    nbytes=torch.cat([rows.nbytes, nb]), pes=torch.cat([rows.pes, rows.pes]))


def swap_batch(world: int, rank: int, row_bytes: int, device, stride: int | None = None) -> PutBatch:
    """One entry per rank ``p`` (itself included): ``row_bytes`` bytes from row ``p`` of a local ``[W, *]`` staging
    buffer to row ``rank`` of another ``[W, *]`` buffer on ``p`` (rows ``stride`` bytes apart, default
    ``row_bytes``): this rank's share for each rank, into its own row there."""
    st = int(row_bytes if stride is None else stride)
    p = torch.arange(world, dtype=torch.int64, device=device)
    return PutBatch(dst_offsets=torch.full((world,), rank * st, dtype=torch.int64, device=device),
                    src_offsets=(p * st).contiguous(),
                    nbytes=torch.full((world,), int(row_bytes), dtype=torch.int64, device=device),
                    pes=p.to(torch.int32))


@dataclass(frozen=True)
class TokenSlots:
    """The slots of a dispatch as combine backward's puts on the put path see them, slot ``(t, j)`` at ``t * k + j``:
    ``token`` int64 ``[T * k]`` (``t``), ``lead`` bool ``[T * k]`` (the token's first slot on its destination rank:
    the one slot of the (token, rank) that carries a row), ``pes`` int32 ``[T * k]`` (that rank; this rank for the
    others), ``rank`` this rank. Made once per call (:meth:`of`); each buffer's entries from it by :meth:`rows`."""

    rank: int
    token: torch.Tensor
    lead: torch.Tensor
    pes: torch.Tensor

    @staticmethod
    def of(plan: RoutingPlan, rank: int) -> "TokenSlots":
        d = plan.dest_rank.to(torch.int64)
        T, k = d.shape
        dev = d.device
        earlier = torch.tril(torch.ones(k, k, dtype=torch.bool, device=dev), diagonal=-1)  # [j, j'] j' < j
        same = (d[:, :, None] == d[:, None, :]) & earlier
        lead = ((d >= 0) & ~same.any(-1)).reshape(-1)
        t = torch.arange(T, dtype=torch.int64, device=dev).view(T, 1).expand(T, k).reshape(-1)
        pes = torch.where(lead, d.reshape(-1), torch.full_like(t, rank)).to(torch.int32)
        return TokenSlots(rank=rank, token=t, lead=lead, pes=pes)

    def rows(self, dst_tokens: int, row_bytes: int) -> PutBatch:
        """Put entries of one row per (token, destination rank), entry ``t * k + j`` for slot ``(t, j)``, so that a
        round's tokens ``[t0, t0 + n)`` are entries ``[t0 * k, (t0 + n) * k)`` (:meth:`PutBatch.entries`): for a
        slot that leads its rank, row ``t`` (``row_bytes`` bytes) of a local ``[T, *]`` buffer to row ``rank *
        dst_tokens + t mod dst_tokens`` of the destination's ``[W * dst_tokens, *]`` buffer (``dst_tokens``:
        ``T_c``, the rounds' tokens, or ``T_max``: every token at its own row); the other slots are empty entries to
        this rank."""
        t, nb = self.token, int(row_bytes)
        return PutBatch(dst_offsets=((self.rank * dst_tokens + t % dst_tokens) * nb).contiguous(),
                        src_offsets=(t * nb).contiguous(), nbytes=(self.lead.to(torch.int64) * nb).contiguous(),
                        pes=self.pes)


def token_rows(plan: RoutingPlan, rank: int, dst_tokens: int, row_bytes: int) -> PutBatch:
    """:meth:`TokenSlots.rows` of the dispatch ``plan`` (one buffer's entries; a call that puts several buffers makes
    the :class:`TokenSlots` once)."""
    return TokenSlots.of(plan, rank).rows(dst_tokens, row_bytes)


class Puts:
    """The CUDA kernels of :mod:`mxcomm.transport.put_signal` on torch's current stream, each put launch on at
    most ``blocks`` CUDA blocks (the SM budget; None: one block per piece)."""

    def __init__(self, blocks: int | None = None):
        self.blocks = blocks

    def put(self, dst: torch.Tensor, src: torch.Tensor, batch: PutBatch, signals: torch.Tensor | None,
            signal_index: int | None, err: torch.Tensor, chunks: int) -> None:
        """Each entry's bytes to its PE, ``chunks`` pieces each; with ``signals``, every piece adds 1 to
        ``signals[signal_index]`` there after its bytes; without (None), plain puts (a ``quiet`` completes them)."""
        from ...transport import put_signal as ps

        if signals is None:
            ps.put(dst, src, batch, err, chunks=chunks, blocks=self.blocks)
        else:
            ps.put_signal(dst, src, batch, signals, signal_index, err, chunks=chunks, blocks=self.blocks)

    def wait(self, signals: torch.Tensor, indices: torch.Tensor, epoch: torch.Tensor, per_epoch: int,
             err: torch.Tensor, timeout_ns: int) -> None:
        from ...transport import put_signal as ps

        ps.wait_signals(signals, indices, epoch, per_epoch, err, timeout_ns=timeout_ns)

    def quiet(self) -> None:
        from ...transport import put_signal as ps

        ps.quiet()


__all__ = ["BlockPuts", "dispatch_blocks", "partial_rows", "row_batch", "counts_batch", "swap_batch", "token_rows",
           "TokenSlots", "Puts"]
