"""Faults on the nvshmem backend, several ranks on ONE GPU under MPS (rank processes of ``fault_worker.py``):

* a rank killed right before a dispatch, or between its dispatch and its combine: every survivor raises
  ``PeerTimeout`` naming it within ``timeout_s + 1 s`` (the dispatch at its host sync; the combine, which never
  syncs, at the ``check_errors()`` that follows it) and then shuts down through the normal interpreter exit;
* bad expert ids on one rank only (exact sizes): that rank raises ValueError at once, before it sends anything; the
  others raise ``PeerTimeout`` naming it;
* a soak of random token counts (0..max), routings (random, a subset, all to one expert) and dropped slots on 2 and
  4 ranks, a new random case every call: all of each rank's dispatch output (every payload and scale byte of every
  row, offs, counts) and its combine output compared against the expected results (ep_cases' rank-local reference,
  cross-checked against the full oracle every 50 calls), no device or host memory growth.

Run on the GPU machine with an MPS daemon: ``bash bench/gpu/run.sh tests`` (or ``source bench/gpu/env.sh;
mxcomm_mps_start 4; python -m pytest -m nvshmem tests/ep/test_faults_gpu.py; mxcomm_mps_stop``).
``MXCOMM_SOAK_CALLS`` sets the soak's calls per world (default 10000), ``MXCOMM_SOAK_S`` a time budget per world
(default 600 s; the ranks stop together when it is spent). The test prints, per rank: calls done, failed calls, rows
checked, wall time, calls/s (and the time at every 1000 calls), where the time went, the memory samples.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.nvshmem

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 3.0


def _mps_running() -> bool:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    return bool(pipe) and os.path.exists(os.path.join(pipe, "control")) and bool(shutil.which("nvidia-cuda-mps-control"))


needs_mps = pytest.mark.skipif(not _mps_running(), reason="several timed ranks on one GPU need an MPS daemon")


def _run(tmp_path, nranks: int, phase: str, *, victim: int = 1, iters: int = 0, limit_s: float = 300.0,
         max_s: float = 1e9):
    """Start ``nranks`` rank processes; returns ({rank: result dict}, {rank: returncode}, seconds each took)."""
    from mxcomm.transport import launcher_env

    env = dict(os.environ, **launcher_env(1 << 30), CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 // nranks),
               PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "fault_worker.py"), "--rank", str(r), "--nranks",
                               str(nranks), "--outdir", str(tmp_path), "--phase", phase, "--victim", str(victim),
                               "--timeout-s", str(TIMEOUT_S), "--iters", str(iters), "--max-s", str(max_s)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(nranks)]
    t0 = time.monotonic()
    codes, took, logs = {}, {}, {}
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            codes[r] = "hung"
        else:
            codes[r] = p.returncode
        took[r] = time.monotonic() - t0
        logs[r] = out[-3000:]
    res = {}
    for r in range(nranks):
        f = tmp_path / f"rank{r}.json"
        res[r] = json.loads(f.read_text()) if f.exists() else {"error": "no result file", "log": logs[r]}
        res[r]["log"] = logs[r]
    return res, codes, took


def _check_survivors(res, codes, victim: int, nranks: int, phase: str):
    for r in range(nranks):
        if r == victim:
            continue
        got = res[r]
        assert "error" not in got, f"rank {r}: {got.get('error')}\n{got['log']}"
        assert not got["warm_failures"], got["warm_failures"]
        assert got.get("raised") == "PeerTimeout", f"rank {r} after the {phase} fault: {got}"
        assert victim in got["peers"], f"rank {r}: PeerTimeout names {got['peers']}, not rank {victim}: {got['message']}"
        assert got["elapsed_s"] <= TIMEOUT_S + 1.0, f"rank {r} raised after {got['elapsed_s']:.2f} s"
        assert codes[r] == 0, f"rank {r} did not shut down cleanly: {codes[r]}\n{got['log']}"


@needs_mps
@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_killed_rank_is_named_by_every_survivor(tmp_path, nranks, phase):
    victim = nranks - 1
    res, codes, _ = _run(tmp_path, nranks, phase, victim=victim, limit_s=45)
    assert codes[victim] == -9, f"the victim should have been killed: {codes[victim]}\n{res[victim]['log']}"
    _check_survivors(res, codes, victim, nranks, phase)


@needs_mps
def test_bad_ids_on_one_rank(tmp_path):
    res, codes, _ = _run(tmp_path, 2, "bad_ids", victim=1, limit_s=45)
    bad = res[1]
    assert bad.get("raised") == "ValueError" and "topk_idx[0, 0]" in bad["message"], bad
    assert bad["elapsed_s"] < 1.0, bad  # raised before sending anything, not after a wait
    _check_survivors(res, codes, 1, 2, "bad_ids")


@needs_mps
@pytest.mark.parametrize("nranks", [2, 4])
def test_soak_random_shapes_no_corruption_no_growth(tmp_path, nranks):
    iters = int(os.environ.get("MXCOMM_SOAK_CALLS", "10000"))
    max_s = float(os.environ.get("MXCOMM_SOAK_S", 600))  # a time budget: the calls done are reported
    res, codes, took = _run(tmp_path, nranks, "soak", iters=iters, limit_s=max_s + 150, max_s=max_s)
    keys = ("soak_calls", "soak_failed", "rows_checked", "real_rows_checked", "tokens_combined", "crosschecks",
            "distinct_shapes", "soak_wall_s", "calls_per_s", "warm_s", "checkpoints", "time_s", "memory")
    print(json.dumps({r: {k: res[r].get(k) for k in keys} for r in res}))
    for r in range(nranks):
        got = res[r]
        assert "error" not in got and codes[r] == 0, f"rank {r}: {got.get('error')} {codes[r]}\n{got['log']}"
        assert not got["warm_failures"], got["warm_failures"]
        assert got["soak_failed"] == 0, got["soak_failures"]
        assert got["soak_calls"] == res[0]["soak_calls"] > 0, "the ranks did not stop at the same call"
        assert got["real_rows_checked"] > 0 and got["tokens_combined"] > 0, got
        assert got["crosschecks"] == len(range(100, 100 + got["soak_calls"], 50)), got
        m0, m1 = got["memory"]
        assert m1["device"] <= m0["device"] + (64 << 20), f"rank {r}: device memory grew {m0} -> {m1}"
        assert m1["rss"] <= m0["rss"] + (256 << 20), f"rank {r}: host memory grew {m0} -> {m1}"
    done = res[0]["soak_calls"]
    print(f"soak, {nranks} ranks: {done} of {iters} calls in {res[0]['soak_wall_s']:.1f} s "
          f"({res[0]['calls_per_s']:.1f} calls/s)" + ("" if done >= iters else ", stopped by MXCOMM_SOAK_S"))
