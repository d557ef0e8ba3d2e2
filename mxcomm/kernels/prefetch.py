"""Bring whole rows into L2 before a program reads them (``cp.async.bulk.prefetch.L2``, sm_90 and later).

A memory-bound kernel that loads a row chunk, works on it in registers and stores the result keeps only a few
kilobytes in flight per program: its registers bound how many programs an SM holds, so the rate it reaches is set by
the memory latency, not by the bandwidth. A bulk prefetch asks the copy engine of the SM to fetch a whole row into L2
without a register: a persistent kernel issues it for the rows of its next work item, and by the time it gets there
its loads hit L2.

A prefetch changes no value a kernel computes. Under Triton's CPU interpreter the helper does nothing.
"""
from __future__ import annotations

import triton
import triton.language as tl


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


if _interpreting():

    @triton.jit
    def prefetch_rows_l2(base_ptr, rows_ptr, n, ROW_BYTES: tl.constexpr):
        """Interpreter stand-in of :func:`prefetch_rows_l2`: nothing to prefetch."""
        return

    @triton.jit
    def prefetch_bytes_l2(ptr, NBYTES: tl.constexpr):
        """Interpreter stand-in of :func:`prefetch_bytes_l2`: nothing to prefetch."""
        return

else:

    @triton.jit
    def _bulk_prefetch_l2(addr, size):
        """One ``cp.async.bulk.prefetch.L2`` per element: int64 global addresses and int32 sizes (a multiple of 16; 0
        issues nothing). An address is rounded down to 16 bytes (the instruction's alignment; a tensor view may start
        anywhere): the prefetch then starts up to 15 bytes early, inside the same allocation, and may stop up to 15
        bytes short of the span's end."""
        addr = addr & -16
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
        )

    @triton.jit
    def prefetch_rows_l2(base_ptr, rows_ptr, n, ROW_BYTES: tl.constexpr):
        """Prefetch rows of a row-major tensor into L2, one bulk prefetch per row (each from its own thread).

        Args:
            base_ptr: scalar pointer (any element type) to row 0 of the tensor.
            rows_ptr: scalar pointer to ``n`` int32 row indices; a negative index is skipped.
            n: how many indices (at most the program's thread count; further ones are not prefetched).
            ROW_BYTES: bytes per row, a multiple of 16.
        """
        lane = tl.arange(0, tl.extra.cuda.num_threads())
        r = tl.load(rows_ptr + lane, mask=lane < n, other=-1)
        base = base_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        addr = (base + tl.maximum(r, 0).to(tl.int64) * ROW_BYTES).to(tl.int64, bitcast=True)
        _bulk_prefetch_l2(addr, tl.where(r >= 0, ROW_BYTES, 0).to(tl.int32))

    @triton.jit
    def prefetch_bytes_l2(ptr, NBYTES: tl.constexpr):
        """Prefetch the ``NBYTES`` bytes (a multiple of 16) at the scalar pointer ``ptr`` into L2: one bulk
        prefetch."""
        lane = tl.arange(0, tl.extra.cuda.num_threads())
        addr = ptr.to(tl.pointer_type(tl.uint8), bitcast=True).to(tl.int64, bitcast=True) + lane * 0
        _bulk_prefetch_l2(addr, tl.where(lane == 0, NBYTES, 0).to(tl.int32))
