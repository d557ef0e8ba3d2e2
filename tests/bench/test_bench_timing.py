"""mxcomm.bench.timing: how the ranks' starts are aligned (the helpers; the whole loop runs in tests/test_cli.py)."""
import time

import pytest

from mxcomm.bench.timing import CLOCK_LEAD_S, start_mode, wait_for_common_instant


class _Readings:
    """A world whose all-gather returns this rank's reading with the others' given offsets (s) from it."""

    def __init__(self, offsets):
        self.offsets = offsets
        self.gathered = None

    def all_gather_object(self, obj):
        self.gathered = [obj + o for o in self.offsets]
        return self.gathered


@pytest.mark.parametrize("requested,one_host,ranks,want", [
    ("auto", True, 4, "clock"), ("auto", True, 1, "barrier"), ("auto", False, 4, "barrier"),
    ("barrier", True, 4, "barrier"), ("barrier", False, 2, "barrier"), ("clock", True, 2, "clock"),
    ("clock", True, 1, "clock"),
])
def test_start_mode(requested, one_host, ranks, want):
    assert start_mode(requested, one_host, ranks) == want


def test_start_mode_refuses_clock_across_hosts_and_unknown_modes():
    with pytest.raises(ValueError, match="one host"):
        start_mode("clock", False, 2)
    with pytest.raises(ValueError, match="one of auto, barrier, clock"):
        start_mode("now", True, 2)


def test_waits_until_the_latest_reading_plus_the_lead():
    w = _Readings([0.0, 0.004, -0.002])  # another rank read its clock 4 ms after this one
    late = wait_for_common_instant(w)
    done = time.perf_counter()
    assert late is False
    assert done >= max(w.gathered) + CLOCK_LEAD_S


def test_a_rank_released_after_the_instant_reports_late_and_does_not_wait():
    w = _Readings([-10.0, -10.0])  # every reading long past: the instant is over before this rank looks
    t0 = time.perf_counter()
    assert wait_for_common_instant(w) is True
    assert time.perf_counter() - t0 < 1.0
