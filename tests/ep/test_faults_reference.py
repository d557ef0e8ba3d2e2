"""Faults on the reference backend (CPU, gloo worlds; the rank processes of ``fault_worker.py``): every wait is
bounded by ``EPConfig.timeout_s`` and every rank that waited raises ``PeerTimeout`` naming the peer - a peer that died
before a dispatch or a combine, one that sleeps past the timeout, one that calls another step, one whose input was
refused - and a config that is invalid on one rank only makes every rank raise a ValueError naming it."""
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


def _run(tmp_path, nranks: int, phase: str, victim: int, limit_s: float = 50.0):
    procs = [subprocess.Popen([sys.executable, str(HERE / "fault_worker.py"), "--rank", str(r), "--nranks", str(nranks),
                               "--outdir", str(tmp_path), "--phase", phase, "--victim", str(victim), "--backend", "torch",
                               "--timeout-s", str(TIMEOUT_S)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
