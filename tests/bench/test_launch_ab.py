"""The launch A/B tool's timing loop and summary (``mxcomm.bench.tools.launch_ab``; its GPU part needs a GPU): the
settings alternate call by call, each selected before its own call, the warm-up iterations are dropped, and the
summary's percentiles are nearest-rank."""
from types import SimpleNamespace

import pytest
import torch

from mxcomm.bench.tools.launch_ab import WARMUP, alternate, check_same, result_bytes, summary


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


def _dispatched(qdata, scales, offs):
    return SimpleNamespace(x=SimpleNamespace(qdata=qdata, scales=scales), offs=offs, counts=offs.diff(prepend=offs[:1]))


def test_check_same_passes_equal_outputs_and_names_the_first_difference():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(64, 32, generator=g).to(torch.float8_e4m3fn)
    s = torch.randint(0, 255, (128, 4), dtype=torch.uint8, generator=g)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    a = result_bytes(_dispatched(q, s, offs))
    assert set(a) == {"qdata", "scales", "offs", "counts"}
    check_same({"a": a, "b": result_bytes(_dispatched(q.clone(), s.clone(), offs.clone()))})
    s2 = s.clone()
    s2[127, 3] ^= 1  # one scale bit of the last row
    with pytest.raises(AssertionError, match="setting b's scales differs"):
        check_same({"a": a, "b": result_bytes(_dispatched(q, s2, offs))})
    with pytest.raises(AssertionError, match="setting b's qdata differs"):
        check_same({"a": a, "b": result_bytes(_dispatched(q[:63], s, offs))})  # one row fewer
    y = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    y2 = y.clone()
    y2[3, 5] = -y2[3, 5] if y2[3, 5] != 0 else 1.0
    check_same({"a": result_bytes(y), "b": result_bytes(y.clone())})
    with pytest.raises(AssertionError, match="setting b's y differs"):
        check_same({"a": result_bytes(y), "b": result_bytes(y2)})
