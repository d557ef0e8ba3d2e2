"""Faults on the reference backend (CPU, gloo worlds; the rank processes of ``fault_worker.py``): every wait is
bounded by ``EPConfig.timeout_s`` and every rank that waited raises ``PeerTimeout`` naming the peer - a peer that died
before a dispatch or a combine, one that sleeps past the timeout, one that calls another step, one whose input was
refused - and a config that is invalid on one rank only makes every rank raise a ValueError naming it. Also the
soak of the GPU fault tests on this backend (every call checked, and the checks catch a corrupted value), and its
rank-local reference against the oracle."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 2.0
CENSUS_S = 1.5  # BoundedGroup's default census window


def _run(tmp_path, nranks: int, phase: str, victim: int, limit_s: float = 50.0, extra: tuple = ()):
    procs = [subprocess.Popen([sys.executable, str(HERE / "fault_worker.py"), "--rank", str(r), "--nranks", str(nranks),
                               "--outdir", str(tmp_path), "--phase", phase, "--victim", str(victim), "--backend", "torch",
                               "--timeout-s", str(TIMEOUT_S), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(nranks)]
    t0, codes, logs = time.monotonic(), {}, {}
    for r, p in enumerate(procs):
        try:
            logs[r] = p.communicate(timeout=max(1.0, limit_s - (time.monotonic() - t0)))[0][-2000:]
            codes[r] = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            logs[r], codes[r] = p.communicate()[0][-2000:], "hung"
    res = {}
    for r in range(nranks):
        f = tmp_path / f"rank{r}.json"
        res[r] = json.loads(f.read_text()) if f.exists() else {"error": "no result"}
        res[r]["log"] = logs[r]
    return res, codes


def _named(res, codes, victim, nranks, needle=None):
    for r in range(nranks):
        if r == victim:
            continue
        got = res[r]
        assert "error" not in got, got
        assert codes[r] == 0, f"rank {r} exit {codes[r]}: {got['log']}"
        assert got.get("raised") == "PeerTimeout", f"rank {r}: {got}"
        assert victim in got["peers"], got["message"]
        assert got["elapsed_s"] <= TIMEOUT_S + CENSUS_S + 1.5, f"rank {r} raised after {got['elapsed_s']:.1f} s"
        if needle:
            assert needle in got["message"], got["message"]


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_dead_peer_is_named(tmp_path, phase):
    res, codes = _run(tmp_path, 3, phase, victim=2)
    assert codes[2] == -9
    _named(res, codes, 2, 3)


def test_sleeping_peer_is_named_and_raises_itself(tmp_path):
    res, codes = _run(tmp_path, 2, "sleep", victim=1)
    _named(res, codes, 1, 2, needle="did not arrive")
    late = res[1]
    assert late.get("raised") == "PeerTimeout" and 0 in late["peers"], late  # it names the rank that gave up


def test_ranks_calling_different_steps_say_who_called_what(tmp_path):
    res, codes = _run(tmp_path, 2, "mismatch", victim=1)
    for r in (0, 1):
        got = res[r]
        assert got.get("raised") == "PeerTimeout", got
        assert "called different operations" in got["message"], got["message"]
        assert "dispatch" in got["message"] and "combine" in got["message"], got["message"]


def test_refused_input_is_named_by_the_peers(tmp_path):
    res, codes = _run(tmp_path, 2, "bad_ids", victim=1)
    assert res[1].get("raised") == "ValueError" and "topk_idx[0, 0]" in res[1]["message"], res[1]
    _named(res, codes, 1, 2, needle="refused its input")


def test_config_invalid_on_one_rank_raises_on_every_rank(tmp_path):
    res, codes = _run(tmp_path, 3, "bad_config", victim=1)
    for r in range(3):
        got = res[r]
        assert got.get("raised") == "ValueError", got
        assert "rank 1" in got["message"] and "hidden (48)" in got["message"], got["message"]
        assert got["elapsed_s"] < TIMEOUT_S, got  # a vote, not a timeout


def test_soak_checks_every_call(tmp_path):
    iters = 300
    res, codes = _run(tmp_path, 2, "soak", victim=-1, limit_s=120, extra=("--iters", str(iters), "--timeout-s", "30"))
    for r in range(2):
        got = res[r]
        assert "error" not in got and codes[r] == 0, f"rank {r}: {got.get('error')} {codes[r]}\n{got['log']}"
        assert not got["warm_failures"], got["warm_failures"]
        assert got["soak_failed"] == 0, got["soak_failures"]
        assert got["soak_calls"] == iters and got["corrupted"] == 0, got
        assert got["tokens_combined"] > iters and got["real_rows_checked"] > iters, got
        assert got["rows_checked"] >= got["real_rows_checked"] and got["rows_checked"] % 32 == 0, got
        assert got["crosschecks"] == iters // 50, got  # the full oracle ran too, and agreed
        assert got["distinct_shapes"] > iters // 3, got  # the calls keep varying
        assert len(got["memory"]) == 2 and got["memory"][0]["calls"] < got["memory"][1]["calls"] == iters, got
        assert got["calls_per_s"] > 0 and got["soak_wall_s"] > 0, got
    assert res[0]["tokens_combined"] != res[1]["tokens_combined"], "both ranks had the same token counts throughout"


def test_soak_reports_every_corrupted_call(tmp_path):
    """The soak's checks are not vacuous: one expected value flipped every 5 calls (a payload byte, a scale byte, a
    count, a combine value, in turn) makes exactly those calls fail."""
    res, codes = _run(tmp_path, 2, "soak", victim=-1, limit_s=120,
                      extra=("--iters", "60", "--timeout-s", "30", "--corrupt-every", "5", "--crosscheck-every", "0"))
    for r in range(2):
        got = res[r]
        assert "error" not in got and codes[r] == 0, f"rank {r}: {got.get('error')} {codes[r]}\n{got['log']}"
        assert got["corrupted"] >= 6, got  # 12 calls picked; a call without rows/tokens skips the kinds needing them
        assert got["soak_failed"] == got["corrupted"], got["soak_failures"]
        assert all(i % 5 == 0 for i in got["failed_call_ids"]), got["failed_call_ids"]
        text = "\n".join(got["soak_failures"])
        for needle in ("payload", "grouped scales", "counts", "combine differs"):
            assert needle in text, f"rank {r}: no {needle!r} failure among {got['soak_failures']}"


def _raw(t):
    return t.contiguous().view(__import__("torch").uint8)


def _reference_vs_oracle(case) -> None:
    import torch
    from ep_cases import make_expert_outs, make_inputs, rank_combine_expected, rank_dispatch_expected, soak_routes

    from mxcomm.ep.reference.oracle import oracle_combine, oracle_dispatch

    W = len(case.tokens)
    cfg = case.config()
    xs, idxs, ws = make_inputs(case)
    exp, routes = oracle_dispatch(cfg, xs, idxs)
    mine = soak_routes(cfg, idxs)
    for s in range(W):
        assert torch.equal(mine.dest[s], routes.dest[s]), (case.name, s)
    outs = make_expert_outs(case, exp)
    for a, b in zip(outs, make_expert_outs(case, mine.rows)):
        assert torch.equal(_raw(a), _raw(b)), case.name
    for r in range(W):
        got, want = rank_dispatch_expected(cfg, xs, mine, r), exp[r]
        assert got.num_rows == want.num_rows, (case.name, r)
        for name in ("offs", "counts"):
            assert getattr(got, name).dtype == torch.int32, (case.name, name)
            assert torch.equal(getattr(got, name), getattr(want, name)), (case.name, r, name)
        if cfg.precision == "mxfp8":
            assert (got.x.layout, got.x.axis, got.x.mode) == (want.x.layout, want.x.axis, want.x.mode), case.name
            assert torch.equal(got.x.group_offs, want.x.group_offs), (case.name, r)
            assert torch.equal(_raw(got.x.qdata), _raw(want.x.qdata)), (case.name, r)
            assert torch.equal(got.x.scales, want.x.scales), (case.name, r)
        else:
            assert got.x.dtype == want.x.dtype and torch.equal(_raw(got.x), _raw(want.x)), (case.name, r)
    for q in (True, False):
        ys = oracle_combine(cfg, outs, routes, ws, q)
        for r in range(W):
            assert torch.equal(_raw(rank_combine_expected(cfg, outs, mine, ws, r, q)), _raw(ys[r])), (case.name, r, q)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_reference_matches_the_oracle(world):
    """The soak's rank-local reference (ep_cases.soak_routes / rank_dispatch_expected / rank_combine_expected) gives
    the oracle's results bit for bit (routes, every rank's dispatch and combine, both transports), over the standard
    and random case matrices."""
    import torch
    from ep_cases import random_cases, standard_cases

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: more intra-op threads only slow this down on a shared host
    try:
        for case in standard_cases(world, seed=3) + random_cases(world, 30, seed=world):
            _reference_vs_oracle(case)
    finally:
        torch.set_num_threads(threads)
