"""The trace tool's cProfile table (``mxcomm.bench.tools.trace.profile_rows``): µs per profiled call, sorted by
cumulative time, with how many times each function ran per call (no GPU needed for the table itself)."""
import cProfile
import pstats
import time

from mxcomm.bench.tools.trace import profile_rows


def _leaf():
    time.sleep(2e-4)


def _op():
    for _ in range(3):
        _leaf()


def test_profile_rows_per_call():
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        _op()
    pr.disable()
    rows = profile_rows(pstats.Stats(pr), calls=5, lines=10)
    assert rows[0].split()[:3] == ["cum", "us/call", "own"]
    parsed = [(float(r.split()[0]), float(r.split()[1]), float(r.split()[2]), r.split()[3]) for r in rows[1:]]
    cums = [p[0] for p in parsed]
    assert cums == sorted(cums, reverse=True)
    op = next(p for p in parsed if p[3].endswith("(_op)"))
    leaf = next(p for p in parsed if p[3].endswith("(_leaf)"))
    assert op[2] == 1.0 and leaf[2] == 3.0  # runs per call
    assert leaf[0] >= 3 * 200 * 0.9 and op[0] >= leaf[0] >= leaf[1]  # three 200 µs sleeps a call, in µs
    assert len(rows) <= 11
