"""LaunchConfig: the launch settings of the ``nvshmem`` backend's kernels (grids per SM, warps, row chunks).

A frozen dataclass, given as ``EPConfig(launch=...)`` (None: these defaults, chosen on an H200 with
``python -m mxcomm.bench.tools.sweep``; docs/benchmarks.md has the measurements). It is part of the config every
rank must share: receivers count the programs their senders launch, so ranks with different settings would wait for
arrivals that never come (``EPGroup`` refuses such a group at construction, naming the ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of the nvshmem backend's kernels (grids are ``per_sm * SMs``, the SMs being
    ``EPConfig.num_sms`` or the whole GPU). Given as ``EPConfig(launch=LaunchConfig(...))``; every rank of a group
    must use the same settings (receivers count the senders' programs); ``python -m mxcomm.bench.tools.sweep``
    measures them on a GPU.

    Attributes:
        dispatch_per_sm / dispatch_warps / dispatch_chunk: the sending dispatch kernels (``local_rows_kernel``,
            ``push_rows_kernel``, ``stage_rows_kernel``) and ``pack_rows_kernel`` (memory-bound:
            a whole row per chunk at H <= 8192); ``pull_rows_kernel`` uses the same grid.
        weighted_warps / qdq_chunk: kernels that quantize or sum every slot (combine backward's weighted rows, the
            one-rank reduce that rounds in registers; the warps also for the partial sums of combine): their chunk
            divides H where it can (:func:`_qdq_chunk`), since a masked-off tail is computed all the same.
        partials_chunk: ``combine_partials_kernel``'s row chunk (at most ``next_pow2(H)``; a masked tail where it does
            not divide H): its per-chunk scalar work (the listed slots, their rows and weights) is paid per chunk, and
            at 2048 values and 4 warps its MXFP8 stores are 16 bytes a thread.
        partials_per_sm: ``combine_partials_kernel`` and ``pull_weighted_kernel`` (persistent over (token, rank)
            entries; their arrivals are counted).
        partials_rows: rows ``combine_partials_kernel`` loads together per step of a chunk's sum (its ``ROWS``).
        reduce_chunk / reduce_mx_chunk / reduce_warps: ``combine_reduce_kernel`` on BF16 / MXFP8 partials that
            arrived (its loads of a token's partials are issued together: registers bound its occupancy).
        route_grad_per_sm: ``route_weight_grad`` (4 warps per program; one rank).
        push_per_sm: ``push_entries_kernel``.
        put_per_sm: the put path's put launches (``csrc/put_signal.cu``; each block takes every grid-th piece).
        put_chunks: pieces per entry of the put path's dispatch puts (receivers count ``entries * put_chunks``
            signals per source: every rank must use the same).
        call_graph_tokens: one rank, exact sizes: a dispatch of at most this many tokens runs as one captured call
            (``LocalPath``: replayed with the call's tensors; its output's storage holds the most rows the call's
            tokens can fill, ``T k + E (align - 1)``, of which the call's rows are the view it returns); 0: never.
            Above it the output is allocated at its exact size after the sync and its kernels launched then. The
            default covers the sizes measured faster as one call (128 to 8192 tokens, docs/benchmarks.md: 1.3-1.6x at
            2048 tokens, 1.05-1.08x at 8192); the rows the output holds beyond its ``R`` are at most ``E (align -
            1)`` whatever ``T`` (57 MB at hidden 7168, 256 experts, ``align`` 32; about half that with balanced
            routing), held as long as the output is (saved for the backward pass, per layer): where that memory
            matters more than the few percent at thousands of tokens, set it lower (``mxcomm info`` prints the
            storage).
        peer_call_tokens: several ranks on the pull path, exact sizes: when the group's ranks can send at most this
            many tokens together (``world * max_tokens_per_rank``), a dispatch runs as one captured call
            (``PullPath``: the output kernels enqueued before the host sync, not after it; replayed with the call's
            tensors), its output's storage sized for the most rows the ranks' tokens can bring (``R_max``,
            :func:`mxcomm.ep.plan.max_recv_rows`: 6080 rows, 45 MB, at 4 ranks of 128 tokens, hidden 7168, top-8 of
            256 experts), of which the call's rows are the view it returns; 0: never. Above it see
            ``peer_guess_pct``.
        peer_guess_pct: the pull path above ``peer_call_tokens``, exact sizes: a dispatch runs as one captured call
            too, its output's storage sized for the rows the previous call of the same token count brought plus this
            many percent (rounded up to ``align``; the output a view of its first ``R`` rows), so that its output
            kernels run right after the middle rather than after the host sync; a call that brings more rows than
            that gathers them after the sync into an output of their size (the staged form, one Triton launch and the
            device idle meanwhile), as does the first call of a token count. The memory past ``R`` is held as long as
            the output is (saved for the backward pass, per layer). 0: never (the output allocated at its exact size
            after the sync).
        reduce_call_tokens: one rank: a combine or a dispatch backward of at most this many tokens (either size mode)
            runs its reduce as one captured call (``LocalPath.reduce``: one graph launch with the call's tensors'
            addresses instead of a kernel launch; up to ``LocalPath.REDUCE_COPIES`` graphs per token count and mode
            taken in turn, so a host running ahead of the device does not wait for it); 0: never.
        wait_warps: the bounded waits' kernels (``wait_published_kernel``, ``wait_arrivals_kernel``: one program per
            peer spinning on its flag): every poll reads the timer as a block maximum, so fewer warps make each poll
            cheaper and hold fewer of the SM's slots that other kernels (and, under MPS, other ranks) could use.
    """

    dispatch_per_sm: int = 16
    dispatch_warps: int = 8
    dispatch_chunk: int = 8192
    weighted_warps: int = 4
    qdq_chunk: int = 1024
    partials_per_sm: int = 32
    partials_rows: int = 2
    partials_chunk: int = 2048
    reduce_chunk: int = 2048
    reduce_mx_chunk: int = 8192
    reduce_warps: int = 4
    route_grad_per_sm: int = 8
    push_per_sm: int = 1
    put_per_sm: int = 4
    put_chunks: int = 4
    wait_warps: int = 1
    call_graph_tokens: int = 8192
    peer_call_tokens: int = 1024
    peer_guess_pct: int = 12
    reduce_call_tokens: int = 8192

    def __post_init__(self):
        """Refuse settings no launch can take (a zero would leave a kernel without programs, or a persistent loop
        without progress): every field a positive int (the ``*_tokens`` and ``*_pct`` fields may be 0),
        chunks powers of two of at least 32 values, warps powers of two up to 32."""
        for f in fields(self):
            v = getattr(self, f.name)
            low = 0 if f.name.endswith(("_tokens", "_pct")) else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"LaunchConfig.{f.name} must be an int >= {low}, got {v!r}")
            if f.name.endswith("_chunk") and (v < 32 or v & (v - 1)):
                raise ValueError(f"LaunchConfig.{f.name} must be a power of two >= 32, got {v}")
            if f.name.endswith("_warps") and (v > 32 or v & (v - 1)):
                raise ValueError(f"LaunchConfig.{f.name} must be a power of two <= 32, got {v}")

    def row_chunk(self, H: int, weighted: bool = False) -> int:
        """Row chunk (values) of the sending dispatch kernels / pack_rows_kernel (``weighted``: one quantization per
        slot, as in the weighted rows' kernels too)."""
        return _qdq_chunk(H, self.qdq_chunk) if weighted else min(self.dispatch_chunk, _next_pow2(H))

    def partials_row_chunk(self, H: int) -> int:
        """Row chunk (values) of combine_partials_kernel."""
        return min(self.partials_chunk, _next_pow2(H))

    def reduce_row_chunk(self, H: int, own: bool, mx: bool) -> int:
        """Row chunk of the reduce: ``own`` (``local_reduce_kernel``) ``and mx`` quantizes every slot
        (compute-bound); the others read (``combine_reduce_kernel``, or ``local_reduce_kernel`` with BF16)."""
        if own and mx:
            return _qdq_chunk(H, self.qdq_chunk)
        return min(self.reduce_mx_chunk if mx else self.reduce_chunk, _next_pow2(H))


def _next_pow2(n: int) -> int:
    """:func:`mxcomm.kernels.launch.next_pow2` (loaded on first use: importing ``mxcomm.kernels`` loads Triton, and
    :class:`~mxcomm.ep.config.EPConfig`, which imports this module, must not)."""
    from ...kernels.launch import next_pow2

    return next_pow2(n)


def _qdq_chunk(H: int, cap: int = LaunchConfig.qdq_chunk, floor: int = 512) -> int:
    """Row chunk of the kernels that quantize every slot: among the powers of two in ``[floor, cap]`` the one that
    leaves the fewest values of the last chunk masked off (the larger on ties; below ``floor`` a 4-warp program
    holds too few values per thread); ``next_pow2(H)`` when that is smaller."""
    c = min(cap, _next_pow2(H))
    best = c
    while c > floor:
        c //= 2
        if -H % c < -H % best:
            best = c
    return best


__all__ = ["LaunchConfig"]
