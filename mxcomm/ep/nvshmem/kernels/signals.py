"""Flags, publishing and bounded waits of the ``nvshmem`` EP backend's kernels: ``publish_kernel`` (counts + refusal
word, "ready", route weights), ``wait_published_kernel``, ``wait_arrivals_kernel``, ``first_refusal_kernel``, and the
device helpers the kernels of the other modules signal and wait with (``publish_to``, ``raise_flag``,
``wait_every_source``, ``_arrive``, ``_arrive_all``). Every wait is bounded (``mxcomm.transport.flags.wait_flag_geq``).

Flags (``ep.flags`` ``[len(FLAG_ROWS), W]``, :data:`mxcomm.ep.plan.FLAG_ROWS`): entry ``[i, s]`` is written by rank
``s``; flags only grow (epochs or running totals), never reset. Arrival protocol: every program of a sending kernel,
after all its stores, adds 1 to ``flags[i, me]`` on every peer (release, sys). A receiver keeps the running total it
expects per (row, sender) on the device (``expect``) and waits for it. All ranks launch the same number of programs
in a call (it follows from the config).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ....transport.flags import deadline_after, signal_peer, wait_flag_geq


@triton.jit
def publish_to(p, src_ptr, n_words, dst_peers, dst_word0, tail_word, flags_peers, row, W, me, epoch,
               BLOCK: tl.constexpr):
    """Copy my ``n_words`` int32 words into rank ``p``'s buffer at word ``dst_word0`` (and, when ``tail_word >= 0``,
    word ``src[n_words]`` to word ``tail_word`` there), then raise ``flags[row, me]`` there to ``epoch`` (release,
    sys). ``dst_peers`` / ``flags_peers``: int64 ``[W]`` peer base pointers (the destination buffer viewed as
    int32; the int64 ``flags``)."""
    offs = tl.arange(0, BLOCK)
    base = tl.load(dst_peers + p).to(tl.pointer_type(tl.int32))
    db = base + dst_word0
    c0 = 0
    while c0 < n_words:
        m = c0 + offs < n_words
        tl.store(db + c0 + offs, tl.load(src_ptr + c0 + offs, mask=m, other=0), mask=m)
        c0 += BLOCK
    if tail_word >= 0:
        tl.store(base + tail_word, tl.load(src_ptr + n_words))
    tl.debug_barrier()
    raise_flag(p, flags_peers, row, W, me, epoch)


@triton.jit
def raise_flag(p, flags_peers, row, W, me, epoch):
    """Raise ``flags[row, me]`` on rank ``p`` to ``epoch`` (release, sys; ``flags_peers``: int64 ``[W]`` base
    pointers of every rank's int64 ``flags``). Call after ``tl.debug_barrier()`` when several threads stored."""
    fb = tl.load(flags_peers + p).to(tl.pointer_type(tl.int64))
    signal_peer(fb + row * W + me, epoch)


@triton.jit
def publish_kernel(src_ptr, n_words, dst_peers, dst_word0, tail_word, flags_peers, flags_local, row, W, epoch_ptr,
                   err_ptr, timeout_ns, me, BLOCK: tl.constexpr, WAIT: tl.constexpr = True):
    """Program ``p``: :func:`publish_to` rank ``p`` with this epoch, then (``WAIT``) wait (bounded) until rank ``p``
    has published to me (``flags[row, p]`` here; without ``WAIT`` a later :func:`wait_published_kernel` does, so
    that work can run between the two). The counts exchange (my ``[E]`` counts into every ``counts[me]``, my refusal
    word into every refusal row), the "ready" handshake (``n_words = 0``) and combine's route weights (my ``[T, k]``
    into every ``comb_w[me]``).

    Args: src_ptr int32 words; dst_peers / flags_peers int64 ``[W]`` peer base pointers (the destination buffer
    viewed as int32); flags_local this rank's int64 ``flags``; epoch_ptr int64 scalar; err_ptr int64 error word.
    Grid: (W,).
    """
    p = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    publish_to(p, src_ptr, n_words, dst_peers, dst_word0, tail_word, flags_peers, row, W, me, epoch, BLOCK)
    if WAIT:
        wait_flag_geq(flags_local + row * W + p, epoch, deadline_after(timeout_ns), err_ptr, p)


@triton.jit
def wait_published_kernel(flags_local, row, W, epoch_ptr, err_ptr, timeout_ns):
    """Program ``p``: wait (bounded) until rank ``p`` has published this epoch to me (``flags[row, p] >= epoch``
    here), the wait :func:`publish_kernel` leaves out without ``WAIT``. Args as there. Grid: (W,)."""
    p = tl.program_id(0)
    wait_flag_geq(flags_local + row * W + p, tl.load(epoch_ptr), deadline_after(timeout_ns), err_ptr, p)


@triton.jit
def wait_arrivals_kernel(flags_row_ptr, expect_row_ptr, per_call, err_ptr, timeout_ns):
    """Program ``s``: add ``per_call`` (the sender's program count) to ``expect_row[s]``, then wait
    (bounded) until ``flags_row[s]`` reaches it. The running total lives on the device, so the program
    count may change between calls and CUDA graph replays stay correct. Grid: (W,)."""
    s = tl.program_id(0)
    expected = tl.load(expect_row_ptr + s) + per_call
    tl.store(expect_row_ptr + s, expected)
    wait_flag_geq(flags_row_ptr + s, expected, deadline_after(timeout_ns), err_ptr, s)


@triton.jit
def wait_every_source(flags_row_ptr, expect_row_ptr, per_call, W, err_ptr, timeout_ns):
    """One program: what :func:`wait_arrivals_kernel` does with one program per source - for every source ``s``,
    add ``per_call`` to ``expect_row[s]`` and wait (bounded) until ``flags_row[s]`` reaches it - one source after the
    other under one deadline. For the last program of a sending launch (its ticket), so that no wait kernel follows."""
    deadline = deadline_after(timeout_ns)
    s = 0
    while s < W:
        expected = tl.load(expect_row_ptr + s) + per_call
        tl.store(expect_row_ptr + s, expected)
        wait_flag_geq(flags_row_ptr + s, expected, deadline, err_ptr, s)
        s += 1


@triton.jit
def _arrive(flags_peers, p, row, me, W):
    """Add 1 to ``flags[row, me]`` on rank ``p`` (release, sys; ``flags_peers``: int64 ``[W]`` base pointers of the
    int64 ``flags`` on every rank). Call after ``tl.debug_barrier()`` when several threads stored the payload."""
    fb = tl.load(flags_peers + p).to(tl.pointer_type(tl.int64))
    tl.atomic_add(fb + row * W + me, 1, sem="release", scope="sys")


@triton.jit
def _arrive_all(flags_peers, row, me, W):
    """After this program's stores: add 1 to ``flags[row, me]`` on every rank (release, sys)."""
    tl.debug_barrier()
    p = 0
    while p < W:
        _arrive(flags_peers, p, row, me, W)
        p += 1


@triton.jit
def first_refusal_kernel(words_ptr, W, out_ptr, W_POW2: tl.constexpr):
    """``out = 1 + the lowest rank whose refusal word is non-zero`` (0: none): the refusals of a dispatch's counts
    exchange, read at the call's host sync. Grid: (1,)."""
    r = tl.arange(0, W_POW2)
    w = tl.load(words_ptr + r, mask=r < W, other=0)
    first = tl.min(tl.where(w != 0, r, W_POW2), axis=0)
    tl.store(out_ptr, tl.where(first < W, first + 1, 0).to(tl.int64))
