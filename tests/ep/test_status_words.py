"""The status words of the nvshmem backend (``mxcomm.ep.nvshmem.status_words``): what the host raises at its one sync of
an exact-size dispatch and, without a sync, one call later; on CPU (the copies are plain reads off CUDA)."""
import pytest
import torch

from mxcomm.ep.nvshmem.status_words import HostWords, StatusWords, SyncedSizes
from mxcomm.transport import PeerTimeout
from mxcomm.transport.errors import TIMEOUT_CODE, error_word


def _words(exact_sizes=True, capturing=False):
    return StatusWords(torch.device("cpu"), rank=1, num_experts=4, exact_sizes=exact_sizes,
                       capturing=lambda: capturing)


def test_the_views_are_the_words():
    """The one-word views the kernels write are the words the host reads."""
    sw = _words()
    sw.err.fill_(7)
    sw.input_err.fill_(1)
    sw.rows.fill_(96)
    sw.refused.fill_(3)
    sw.most.fill_(160)
    assert sw.words.tolist() == [7, 1, 96, 3, 160]
    assert sw.err_words.tolist() == [7, 1]


def test_check_returns_the_row_count_and_raises_in_order():
    """A clean read returns the plan's row count and the most rows any rank receives; bad ids of this call raise the
    detailed id error (and are cleared); a peer's refusal raises PeerTimeout naming it (cleared: the group stays
    usable); a wait's timeout raises PeerTimeout naming the peer and stays set."""
    sw = _words()
    sw.rows.fill_(96)
    sw.most.fill_(128)
    assert sw.check("dispatch") == SyncedSizes(rows=96, most=128)
    sw.input_err.fill_(1)
    bad = torch.tensor([[0, 4]])  # expert 4 of 4 is out of range
    with pytest.raises(ValueError, match="expert"):
        sw.check("dispatch", ids=bad)
    assert sw.input_err.item() == 0
    sw.refused.fill_(1 + 2)
    with pytest.raises(PeerTimeout, match="peer 2 refused its input"):
        sw.check("dispatch")
    assert sw.refused.item() == 0
    assert sw.check("dispatch").rows == 96
    sw.err.fill_(error_word(TIMEOUT_CODE, 3))
    for _ in range(2):
        with pytest.raises(PeerTimeout) as e:
            sw.check("combine")
        assert e.value.peer == 3


def test_bad_ids_of_an_earlier_call_are_reported_once():
    """Without the call's ids (a later check) bad ids raise the generic error once."""
    sw = _words()
    sw.input_err.fill_(1)
    with pytest.raises(ValueError, match="an earlier dispatch"):
        sw.check("device error words")
    assert sw.check("device error words").rows == 0


def test_refusals_abandon_only_exact_size_calls():
    """In the no-sync mode bad ids are dropped and the call goes on: a refusal word does not raise."""
    sw = _words(exact_sizes=False)
    sw.refused.fill_(1)
    assert sw.check("dispatch").rows == 0


def test_check_async_checks_at_once_off_cuda_and_nothing_while_capturing():
    """Off CUDA the no-sync check reads at once (the interpreter runs synchronously); inside a capture it reads
    nothing (the replays' report is ``check_errors``)."""
    sw = _words()
    sw.err.fill_(error_word(TIMEOUT_CODE, 0))
    with pytest.raises(PeerTimeout):
        sw.check_async("combine")
    cap = _words(capturing=True)
    cap.err.fill_(error_word(TIMEOUT_CODE, 0))
    cap.check_async("combine")  # nothing read, nothing raised


def test_status_copy_of_a_middle_is_read_only_by_its_own_sync():
    """The words copied at the end of a dispatch's middle are read by that dispatch's sync alone: a sync that did not
    start one (``check_errors``, a read after an error in between) copies the words afresh, and a started copy is
    used at most once (a stale copy would hide an error recorded after it, or report one already cleared)."""

    class Done:  # the copy's event, already complete
        def query(self):
            return True

    sw = _words()
    sw.words.copy_(torch.tensor([0, 0, 96, 0, 0]))
    stale = torch.tensor([0, 0, 32, 0, 0])
    sw._host = HostWords(tensor=stale, values=stale.numpy(), event=None)
    sw.note_copy_enqueued(Done())
    assert sw.read(started=False) == [0, 0, 96, 0, 0]  # not the dispatch's sync: fresh words
    assert sw.read(started=True) == [0, 0, 96, 0, 0]  # the copy was dropped by the read before
    sw.note_copy_enqueued(Done())
    assert sw.read(started=True) == [0, 0, 32, 0, 0]  # the dispatch's own sync reads its middle's copy
    assert sw.read(started=True) == [0, 0, 96, 0, 0]  # once
    sw.start_read()  # off CUDA: nothing enqueued, nothing marked
    assert not sw._started


def test_landed_words_waits_for_the_copy_not_for_the_work():
    """The sync returns the words as soon as no host word is NOT_LANDED (the work that holds the copy may still run),
    asks ``done`` between reads, and raises if that work ended without the copy."""
    import numpy as np

    from mxcomm.ep.nvshmem.status_words import NOT_LANDED, landed_words

    host = np.full(5, NOT_LANDED, dtype=np.int64)
    reads = []

    def done():  # the work never ends; the copy lands at the third question
        reads.append(host.tolist())
        if len(reads) == 3:
            host[:] = [0, 0, 96, 0, 128]
        return False

    assert landed_words(host, done, reads_per_ask=1) == [0, 0, 96, 0, 128]
    assert len(reads) == 3 and all(NOT_LANDED in r for r in reads)
    host[:4] = 7  # a copy landing word by word: not done while one word is left
    host[4] = NOT_LANDED
    reads.clear()
    assert landed_words(host, done, reads_per_ask=1) == [0, 0, 96, 0, 128]
    assert len(reads) == 3
    assert landed_words(host, lambda: pytest.fail("asked although landed")) == [0, 0, 96, 0, 128]
    host[2] = NOT_LANDED
    with pytest.raises(RuntimeError, match="not in the work"):
        landed_words(host, lambda: True, reads_per_ask=1)
    asks = []
    with pytest.raises(RuntimeError, match="not in the work"):  # asked once every 64 reads by default
        landed_words(host, lambda: asks.append(1) or len(asks) == 2)
    assert len(asks) == 2


def test_arm_waits_for_an_unread_copy_then_marks_every_word():
    """``arm`` (before a copy is enqueued or replayed) first waits for a copy enqueued earlier and never read, which
    would otherwise land on top of the marks, then sets every host word to NOT_LANDED; a copy that was read is not
    waited for again."""
    from mxcomm.ep.nvshmem.status_words import NOT_LANDED

    class Event:
        def __init__(self):
            self.waits = 0

        def synchronize(self):
            self.waits += 1

        def query(self):
            return True

    sw = _words()
    host = torch.tensor([0, 0, 32, 0, 0])
    sw._host = HostWords(tensor=host, values=host.numpy(), event=None)
    ev = Event()
    sw.note_copy_enqueued(ev)
    assert sw.read(started=False) == [0, 0, 0, 0, 0]  # an error path's fresh read: the copy stays unread
    sw.arm()
    assert ev.waits == 1 and host.tolist() == [NOT_LANDED] * 5
    ev2 = Event()
    sw.note_copy_enqueued(ev2)
    host.copy_(torch.tensor([0, 0, 64, 0, 0]))  # the copy lands
    assert sw.read(started=True) == [0, 0, 64, 0, 0]
    sw.arm()
    assert ev2.waits == 0 and host.tolist() == [NOT_LANDED] * 5


def test_a_one_call_dispatch_sync_reads_the_copy_it_armed():
    """The sequence of an exact-size dispatch run as one call (``NvshmemBackend.run_call``), with a plain host tensor
    for the pinned words (no CUDA here; the test lands the copy itself): arm (every host word NOT_LANDED), the body's
    copy, the replay's event noted, then the call's sync returns the words the copy brought, and the next arm marks
    them again."""
    from mxcomm.ep.nvshmem.status_words import NOT_LANDED

    class Done:
        def query(self):
            return True

        def synchronize(self):
            raise AssertionError("a read copy is not waited for")

    sw = _words()
    host = torch.zeros(5, dtype=torch.int64)
    sw._host = HostWords(tensor=host, values=host.numpy(), event=None)
    for rows in (96, 160):
        sw.arm()
        assert host.tolist() == [NOT_LANDED] * 5
        sw.rows.fill_(rows)
        sw.enqueue_copy()  # off CUDA it enqueues nothing: the marks stay until the copy lands
        assert host.tolist() == [NOT_LANDED] * 5
        host.copy_(sw.words)  # the device's copy landing
        sw.note_copy_enqueued(Done())
        assert sw.check("dispatch", started=True) == SyncedSizes(rows=rows, most=0)
