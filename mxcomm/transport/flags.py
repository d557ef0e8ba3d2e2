"""Triton device functions for peer signalling: release/acquire flags and BOUNDED waits.

Protocol (no flag is ever reset, so there is no reset race):

* A flag is an int64 (or int32) word in the *receiver's* symmetric buffer, zero at allocation.
* Each operation call carries an *epoch*: a number the caller increases every call (1, 2, 3, ...),
  the same on every rank.
* The sender stores its payload into the receiver's buffer through the peer pointer, then
  ``signal_peer(peer_flag_ptr, epoch)`` (``atomic_xchg``, ``sem="release"``, ``scope="sys"``).
* The receiver ``wait_flag_geq(flag_ptr, epoch, deadline_ns, err_ptr, peer)``: spins with an
  acquire/sys atomic read until ``flag >= epoch``, or until the GPU global timer passes
  ``deadline_ns``; then it records ``(TIMEOUT_CODE << 32) | peer`` into ``err_ptr`` (``atomic_max``)
  and returns False. The host turns that into :class:`~mxcomm.transport.errors.PeerTimeout`
  with :func:`~mxcomm.transport.errors.check_errors`.

``globaltimer()`` reads ``%globaltimer`` (ns) through inline PTX, which runs on an NVIDIA GPU only.
Under ``TRITON_INTERPRET=1`` (decided when this module is imported) the same functions read the
host clock instead, so the wait/record logic is also testable on a CPU, across processes too when
they map one shared-memory heap at the same address (the tests' stand-in for the symmetric heap).
"""
from __future__ import annotations

import time

import triton
import triton.language as tl

from .errors import ERR_CODE_SHIFT, TIMEOUT_CODE

__all__ = [
    "INTERPRETED",
    "globaltimer",
    "deadline_after",
    "signal_peer",
    "load_acquire",
    "wait_flag_geq",
    "last_to_arrive",
    "timeout_ns",
]

_TIMEOUT_WORD = tl.constexpr(TIMEOUT_CODE << ERR_CODE_SHIFT)


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


#: True when this module's kernels were built for Triton's CPU interpreter (host clock, no PTX).
INTERPRETED = _interpreting()


def timeout_ns(seconds: float) -> int:
    """Timeout in whole nanoseconds for :func:`deadline_after`; ``ValueError`` unless ``0 < seconds <= 1e6``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(seconds).__name__}")
    if not 0 < seconds <= 1e6:
        raise ValueError(f"timeout must be in (0, 1e6] seconds, got {seconds}")
    return int(seconds * 1e9)


if INTERPRETED:

    def _host_clock_ns() -> int:
        return time.monotonic_ns()

    @triton.jit
    def globaltimer():
        """Interpreter stand-in for ``%globaltimer``: host monotonic clock (int64 ns)."""
        return tl.full((), _host_clock_ns(), tl.int64)

else:

    @triton.jit
    def globaltimer():
        """GPU global timer, int64 nanoseconds (``mov.u64 %globaltimer``), the SAME value in every thread.

        Every thread reads the timer (one element each of a ``[num_threads]`` block) and the block
        max is taken: a plain scalar read would differ between warps, and a loop condition built on
        it would let warps leave a spin loop at different iterations (divergent ``bar.sync``).
        NVIDIA GPUs only.
        """
        NT: tl.constexpr = tl.extra.cuda.num_threads()
        per_thread = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,l", [tl.zeros([NT], tl.int64)], dtype=tl.int64, is_pure=False, pack=1
        )
        return tl.max(per_thread, axis=0)


@triton.jit
def deadline_after(timeout):
    """Absolute deadline ``globaltimer() + timeout`` (int64 ns) for :func:`wait_flag_geq`."""
    return globaltimer() + timeout


@triton.jit
def signal_peer(flag_ptr, value):
    """Publish ``value`` into the (peer's) flag with release semantics at system scope.

    Everything this program stored before (incl. stores into the peer's buffers) is visible to a
    reader that acquires the flag and sees ``value``. Call after ``tl.debug_barrier()`` when
    several threads of the program stored the payload. ``flag_ptr``: scalar pointer to int32/int64.
    """
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def load_acquire(flag_ptr):
    """Read a flag with acquire semantics at system scope (an atomic add of 0)."""
    return tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def wait_flag_geq(flag_ptr, expected, deadline_ns, err_ptr, peer):
    """Spin until ``*flag_ptr >= expected`` or the global timer passes ``deadline_ns``.

    Args:
        flag_ptr: scalar pointer to an int32/int64 flag written by ``peer`` with :func:`signal_peer`.
        expected: epoch to wait for (flags only grow: no reset needed between calls).
        deadline_ns: absolute int64 deadline from :func:`deadline_after`.
        err_ptr: scalar pointer to an int64 error word; on timeout gets ``atomic_max`` of
            ``(TIMEOUT_CODE << 32) | peer``. A wait also gives up as soon as the word is non-zero (an earlier wait
            of the same call timed out: the call fails once, after one ``timeout_s``, not once per wait), without
            recording anything itself (the peer named stays the one that did not arrive).
        peer: rank that was waited for (recorded in the error word).

    Returns:
        True (scalar int1) when the flag arrived; False after a timeout. Reads after a True
        return see everything the peer stored before signalling (acquire at system scope).
    """
    v = load_acquire(flag_ptr)
    now = globaltimer()
    e = tl.load(err_ptr, volatile=True)
    while (v < expected) & (now <= deadline_ns) & (e == 0):
        v = load_acquire(flag_ptr)
        now = globaltimer()
        e = tl.load(err_ptr, volatile=True)
    ok = v >= expected
    if (v < expected) & (e == 0):  # this wait's own deadline passed (not given up for an earlier wait's error)
        word = (tl.zeros((), tl.int64) + peer) | _TIMEOUT_WORD
        tl.atomic_max(err_ptr, word, sem="relaxed", scope="gpu")
    return ok


@triton.jit
def last_to_arrive(counter_ptr, n_programs, SYS: tl.constexpr = False):
    """True in exactly one program of a launch of ``n_programs``: the last to call this (once per program), after
    every other program's stores before its call are visible to it (acquire/release at GPU scope; ``SYS``: at system
    scope, so that stores the programs made into peers' memory are ordered before what the last program signals
    next). Lets one launch finish with work that needs all its programs' results, with no program waiting for another.

    ``counter_ptr``: int32 scalar, 0 before the launch; the last program sets it back to 0 (for the next launch in
    stream order, and a CUDA graph's next replay). Reads in the last program of data other programs wrote in this
    launch should be volatile (another program on the same SM may hold an older copy of the line in its L1)."""
    tl.debug_barrier()  # every thread's stores before the one release below
    if SYS:
        old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    else:
        old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == n_programs - 1
    if last:
        tl.store(counter_ptr, 0)
    tl.debug_barrier()
    return last
