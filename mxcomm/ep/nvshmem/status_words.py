"""StatusWords: what the ``nvshmem`` backend's host learns from the device, and when it raises.

Five int64 words on the device, read in one transfer:

* ``err`` (word 0): a bounded wait's timeout or a bad put entry (``mxcomm.transport.errors``: code and peer);
* ``input_err`` (word 1): bad expert ids seen by the device-side id check (out of range, or repeated in a token);
* ``rows`` (word 2): the row count of the last routing plan (an exact-size dispatch's output size);
* ``refused`` (word 3): 1 + the lowest rank that refused its input of the last dispatch (0: none);
* ``most`` (word 4): the most expert-major rows any rank receives in the last dispatch (written by the push and put
  paths before their sync: the number of rounds through their receive window).

An exact-size dispatch reads them at its ONE host sync (:meth:`StatusWords.check`), from a copy into pinned host
memory enqueued right after its middle (:meth:`StatusWords.start_read`), so the host's work before the sync overlaps
the transfer. The host waits for that copy itself, not for the stream: before the copy is enqueued every host word is
set to :data:`NOT_LANDED` (a value no word takes), and the sync spins until none is left (:func:`landed_words`), so a
call whose copy comes before its last kernels (a dispatch run as one call) returns while those still run.
Calls that do not sync (combine, the backward passes, every call in the no-sync mode) start a non-blocking copy of
the error words and raise what an EARLIER call recorded once its copy has landed (:meth:`StatusWords.check_async`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ... import transport as tp
from ...kernels.launch import current_stream
from ..ids import check_expert_ids

#: what the host copy of every word holds from :meth:`StatusWords.arm` until the device's copy lands (int64 min: no word
#: takes it - error words are codes with a peer, the others counts and ranks)
NOT_LANDED = int(np.iinfo(np.int64).min)


def landed_words(host: np.ndarray, done: Callable[[], bool], reads_per_ask: int = 64) -> list:
    """The words of ``host`` (int64, a copy's destination in pinned memory) once the copy has landed: spins on host
    memory until no word is :data:`NOT_LANDED`, asking ``done`` (an event's query: the work that holds the copy is
    complete) once every ``reads_per_ask`` reads (a query enters the driver, a read does not: several ranks'
    processes querying in a tight loop slowed each other's launches), so the wait ends when the copy lands, and at
    the latest when that work is done. Raises RuntimeError if the work is done and a word is still
    :data:`NOT_LANDED` (the copy was not in it)."""
    reads = 0
    while True:
        words = host.tolist()
        if NOT_LANDED not in words:
            return words
        reads += 1
        if reads % reads_per_ask == 0 and done():
            words = host.tolist()
            if NOT_LANDED in words:
                raise RuntimeError("the status words' copy was not in the work the host waited for")
            return words


@dataclass(frozen=True)
class HostWords:
    """A pinned host copy of status words (the exact-size sync's five, the no-sync check's two error words):
    ``tensor`` int64 (pinned, the copy's destination), ``values`` its numpy view (read without a torch op),
    ``event`` one the backend records after a copy that no replayed graph's event covers."""

    tensor: torch.Tensor
    values: np.ndarray
    event: Optional[torch.cuda.Event]

    @staticmethod
    def pinned(n: int) -> HostWords:
        """``n`` pinned words and a fresh event (made once per backend: pinned allocations cost milliseconds)."""
        tensor = torch.empty(n, dtype=torch.int64, pin_memory=True)
        return HostWords(tensor=tensor, values=tensor.numpy(), event=torch.cuda.Event())


@dataclass(frozen=True)
class SyncedSizes:
    """What an exact-size dispatch learns at its one host sync: ``rows`` its output's row count (word 2) and ``most``
    the most rows any rank receives (word 4: the push and put paths' rounds; those paths write it right before their
    sync, the others leave it as it was)."""

    rows: int
    most: int


class StatusWords:
    """The status words of one backend (see module doc).

    Args:
        device: the backend's device (off CUDA every read is a plain copy: interpreter runs are synchronous).
        rank: this rank (named in the errors); num_experts: E (named in the id errors).
        exact_sizes: the config's size mode (peers' refusals abandon a call only in exact-size mode).
        capturing: True while the current stream is being captured (nothing is read or checked then).
    Attributes:
        words: int64 ``[5]`` on ``device``; ``err`` / ``input_err`` / ``rows`` / ``refused`` / ``most``: its
        one-word views (the kernels' arguments); ``err_words``: words 0-1.
    """

    def __init__(self, device: torch.device, rank: int, num_experts: int, exact_sizes: bool,
                 capturing: Callable[[], bool]):
        self.device, self.rank, self.num_experts, self.exact_sizes = device, rank, num_experts, exact_sizes
        self.capturing = capturing
        self.words = torch.zeros(5, dtype=torch.int64, device=device)
        self.err_words = self.words[0:2]
        self.err, self.input_err = self.words[0:1], self.words[1:2]
        self.rows, self.refused, self.most = self.words[2:3], self.words[3:4], self.words[4:5]
        self._pending = None  # (pinned host error words, event, what) of the no-sync mode
        self._pinned = None  # HostWords of the error words (no-sync mode)
        self._host = None  # HostWords: made at the first copy, for the exact-size sync
        self._started = False  # a copy of the words was enqueued for a dispatch's own sync
        self._landing = None  # the event after which the last copy enqueued has landed (None: it was read)

    def check(self, what: str, ids: Optional[torch.Tensor] = None, started: bool = False) -> SyncedSizes:
        """Raise now if a bounded wait (or the device-side input check) recorded an error: ONE host sync, which
        reads the words (one transfer). Returns the sizes words 2 and 4 hold (:class:`SyncedSizes`). ``ids``: the
        caller's ``topk_idx`` of this call, whose id check was deferred to this sync (bad ids raise the detailed error
        of :func:`mxcomm.ep.ids.check_expert_ids`). ``started``: a dispatch's own sync, which reads the copy its middle
        enqueued (:meth:`start_read`) where there is one."""
        self._pending = None
        words = self.read(started)
        if ids is not None and words[1]:
            self.raise_bad_ids(ids)
        if words[3] and self.exact_sizes:
            self._raise_refusal(words[3] - 1, what)
        self._raise_errors(words, what)
        return SyncedSizes(rows=words[2], most=words[4])

    def start_read(self) -> None:
        """Enqueue the copy of the words into pinned host memory now (the end of an exact-size dispatch's middle,
        where they are final for its sync), so that the host's remaining work before the sync (the plan's copies and
        views) overlaps the device's middle and the transfer; :meth:`check` of the same call reads it. No-op off
        CUDA, in the no-sync mode and inside a capture."""
        if self.device.type != "cuda" or not self.exact_sizes or self.capturing():
            return
        self.arm()
        self.enqueue_copy()
        self.note_copy_enqueued()

    def enqueue_copy(self) -> None:
        """The copy of :meth:`start_read` alone (CUDA, exact sizes), also inside a capture: a captured call
        (:class:`~mxcomm.ep.nvshmem.call_graph.CallGraph`) holds it, and :meth:`arm` before each of its runs and
        :meth:`note_copy_enqueued` after let :meth:`check` read it. No-op off CUDA (interpreter runs read the words
        themselves)."""
        if self.device.type == "cuda":
            self._host_words().tensor.copy_(self.words, non_blocking=True)

    def arm(self) -> None:
        """Before a copy of the words is enqueued or replayed (CUDA, outside a capture): set every host word to
        :data:`NOT_LANDED`, after waiting for a copy enqueued earlier and never read (a call that raised before its
        sync), which would otherwise land on top."""
        host = self._host_words()
        if self._landing is not None:
            self._landing.synchronize()
        host.values.fill(NOT_LANDED)

    def note_copy_enqueued(self, done: Optional[torch.cuda.Event] = None) -> None:
        """The copy of the words into pinned memory is on the current stream (:meth:`enqueue_copy`, or a replay that
        holds it): ``done``, an event the caller recorded after it (a replayed graph's), else one recorded here, is
        what :meth:`read` asks while it waits."""
        if done is None:
            done = self._host_words().event
            done.record(current_stream(self.device.index))
        self._landing = done
        self._started = True

    def _host_words(self) -> HostWords:
        """The pinned host copy of the words (made once)."""
        if self._host is None:
            self._host = HostWords.pinned(len(self.words))
        return self._host

    def read(self, started: bool) -> list:
        """The words as host ints: the copy :meth:`start_read` enqueued (``started``: the dispatch's own sync, right
        after its middle) as soon as it has landed (:func:`landed_words`), else a copy made now. A started copy not
        consumed by that sync (an error between the two) is dropped: every other read copies afresh."""
        use = started and self._started
        self._started = False
        if not use:
            return self.words.tolist()
        words = landed_words(self._host.values, self._landing.query)
        self._landing = None
        return words

    def check_async(self, what: str) -> None:
        """No-host-sync check: raise an error recorded by an EARLIER call (if its copy has landed), and start the
        non-blocking copy of this call's error words; a later call raises it. While capturing a CUDA graph nothing
        is checked (``EPGroup.check_errors`` after the replays is their report)."""
        if self.capturing():
            return
        if self._pending is not None and self._pending[1].query():
            host, _, pwhat = self._pending
            self._pending = None
            self._raise_errors(host.tolist(), pwhat)
        if self.device.type != "cuda":  # interpreter runs are synchronous anyway
            self.check(what)
            return
        if self._pending is None:
            if self._pinned is None:  # made once: pinned allocations cost milliseconds, events microseconds
                self._pinned = HostWords.pinned(2)
            host, ev = self._pinned.tensor, self._pinned.event
            host.copy_(self.err_words, non_blocking=True)
            ev.record(current_stream(self.device.index))
            self._pending = (host, ev, what)

    def raise_bad_ids(self, topk_idx: torch.Tensor) -> None:
        """The device saw bad expert ids in this call's ``topk_idx``: clear the word, raise the detailed error."""
        self.input_err.zero_()
        check_expert_ids(topk_idx, self.num_experts)  # raises the detailed error
        raise AssertionError("the device id check and check_expert_ids disagree")  # not reached

    def _raise_refusal(self, peer: int, what: str) -> None:
        """A peer refused its input of this dispatch (its device id check found bad expert ids; it raises the
        detailed ValueError itself): every rank abandons the call at the same sync, before anything is gathered, so
        the group stays usable."""
        self.refused.zero_()
        raise tp.PeerTimeout(
            peer, what, rank=self.rank, message=(
                f"rank {self.rank}: peer {peer} refused its input of this dispatch (expert ids outside [-1, "
                f"{self.num_experts}) or listed twice in one token) and raised; every rank abandoned the call "
                "before any row was gathered, and the group stays usable"))

    def _raise_errors(self, words: list, what: str) -> None:
        """Raise for the host copy of words 0-1 (ints): bad expert ids (reported once), then a wait's error."""
        if words[1]:
            self.input_err.zero_()
            raise ValueError(
                f"rank {self.rank}: an earlier dispatch got topk_idx with an expert id outside [-1, "
                f"{self.num_experts}) or listed twice in one token; those slots were dropped (sent nowhere)"
            )
        tp.raise_error_words(words[:1], what=what, rank=self.rank)


__all__ = ["StatusWords", "SyncedSizes", "HostWords", "NOT_LANDED", "landed_words"]
