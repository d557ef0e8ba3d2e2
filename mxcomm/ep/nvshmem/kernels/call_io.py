"""The inputs and outputs of a captured call (:class:`mxcomm.ep.nvshmem.call_graph.CallGraph`) at addresses given per
replay: a CUDA graph records its kernels' pointer arguments once, so a call captured once and replayed with new
tensors reads their addresses from an int64 table in pinned host memory, which the host writes before every replay.
``copy_in_kernel`` copies an input into the graph's own buffer, ``copy_out_kernel`` an output of the graph into a
fresh tensor; the kernels that write the call's large outputs read the address themselves (``local_rows_at_kernel``,
``scale_rows_to_grouped_at_kernel``).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_words(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Program ``pid`` of ``G`` copies the int32 words ``[i * BLOCK, (i + 1) * BLOCK)`` of ``src`` to ``dst`` for
    ``i = pid, pid + G, ...`` below ``n`` words."""
    offs = tl.arange(0, BLOCK)
    i = tl.program_id(0) * BLOCK
    while i < n:
        m = i + offs < n
        tl.store(dst_ptr + i + offs, tl.load(src_ptr + i + offs, mask=m), mask=m)
        i += tl.num_programs(0) * BLOCK


@triton.jit
def copy_in_kernel(addr_ptr, slot, dst_ptr, n, BLOCK: tl.constexpr):
    """``n`` int32 words from the address in ``addr[slot]`` (int64 table) into ``dst`` (int32, the graph's buffer).
    Grid: any number of programs."""
    src = tl.load(addr_ptr + slot).to(tl.pointer_type(tl.int32))
    _copy_words(src, dst_ptr, n, BLOCK)


@triton.jit
def copy_out_kernel(src_ptr, addr_ptr, slot, n, BLOCK: tl.constexpr):
    """``n`` int32 words of ``src`` (the graph's buffer) to the address in ``addr[slot]`` (int64 table).
    Grid: any number of programs."""
    dst = tl.load(addr_ptr + slot).to(tl.pointer_type(tl.int32))
    _copy_words(src_ptr, dst, n, BLOCK)
