"""The launch A/B tool's timing loop and summary (``mxcomm.bench.tools.launch_ab``; its GPU part needs a GPU): the
settings alternate call by call, each selected before its own call, the warm-up iterations are dropped, and the
summary's percentiles are nearest-rank."""
from mxcomm.bench.tools.launch_ab import WARMUP, alternate, summary


def test_alternate_selects_each_setting_before_its_call_and_drops_the_warmup():
    log, clock = [], iter(range(10_000))
    state = {}

    def chooser(name):
        return lambda: state.update(current=name)

    def caller(name):
        def call():
            assert state["current"] == name  # the setting of this call was selected right before it
            log.append(name)
        return call

    calls = {n: (chooser(n), caller(n)) for n in ("a", "b")}
    times = alternate(calls, iters=7, before=lambda: log.append("before"), clock=lambda: next(clock))
    assert log[:6] == ["before", "a", "before", "b", "before", "a"]
    assert log.count("a") == log.count("b") == 7 + WARMUP
    assert {n: len(v) for n, v in times.items()} == {"a": 7, "b": 7}
    assert all(t == 1e6 for v in times.values() for t in v)  # one clock tick per timed call, in µs


def test_summary_nearest_rank():
    s = summary([float(v) for v in range(1, 101)])
    assert s == dict(median_us=50.5, p10_us=11.0, p90_us=91.0, n=100)
