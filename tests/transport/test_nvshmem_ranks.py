"""Multi-rank NVSHMEM transport tests on ONE GPU (ranks as separate processes).

1 and 2 ranks run without MPS (NVSHMEM's limited multi-process-per-GPU mode); 4 ranks run under an
MPS daemon at 25 % each (an existing one named by CUDA_MPS_PIPE_DIRECTORY, else one started here
in a private directory and stopped afterwards), or are skipped with the reason.

Run on the GPU machine:  source bench/gpu/env.sh && python3 -m pytest -m nvshmem tests/transport
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import transport_launch as tl_launch

pytestmark = pytest.mark.nvshmem

H = 256  # keep equal to nvshmem_worker.H
LAUNCH_TIMEOUT_S = 150
SHORT_TIMEOUT_S = 2.0


def _buffer_bytes(world: int) -> int:
    return world * H * 4 + world * 8 + 8


def _check_common(run: tl_launch.RankRun, route: str, nranks: int, with_timeout: bool) -> None:
    info = f"\n{run.logs()}"
    assert not run.timed_out, f"ranks did not finish within {LAUNCH_TIMEOUT_S} s{info}"
    assert sorted(run.results) == list(range(nranks)), f"missing rank results{info}"
    for r, res in run.results.items():
        assert "error" not in res, f"rank {r} failed{info}"
        steps = ["bootstrap", "heap", "handshake"] + (["timeout"] if with_timeout else []) + ["finalize"]
        assert res["steps"] == steps, info
        assert (res["rank"], res["world"], res["route"]) == (r, nranks, route)
        assert res["idempotent"] and res["initialized"] and res["finalized"]
        assert res["device"].startswith("cuda")
        assert res["local_peers"] == list(range(nranks))  # one GPU: every peer has a peer pointer
        assert res["heap_report"] == {"data": nranks * H * 4, "flags": nranks * 8, "err": 8}
        assert res["heap_nbytes"] == _buffer_bytes(nranks)
        assert res["realloc_same"] and res["realloc_refused"] and res["zeroed"]
        assert res["has_peer_pointer"] == [True] * nranks and res["peer_ptrs_nonzero"] == [True] * nranks
        assert res["own_ptr_ok"] and res["peer_copy_ok"], info
        hs = res["handshake"]
        assert hs["timeout"] is None, f"rank {r}: unexpected timeout {hs['timeout']}{info}"
        assert hs["rows_ok"], f"rank {r}: rows from peers wrong{info}"
        assert hs["flags"] == [1] * nranks


def _check_skip(run: tl_launch.RankRun, nranks: int, skipper: int, victim: int) -> None:
    info = f"\n{run.logs()}"
    for r, res in run.results.items():
        sk = res["skip"]
        assert sk["rows_ok"], f"rank {r}: rows of signalling peers wrong{info}"
        if r == victim:
            t = sk["timeout"]
            assert t is not None, f"rank {victim} should have timed out waiting for {skipper}{info}"
            assert t["peer"] == skipper and t["peers"] == [skipper], info
            assert f"peer {skipper}" in t["message"] and f"rank {victim}" in t["message"]
            assert SHORT_TIMEOUT_S * 0.9 <= sk["elapsed_s"] < SHORT_TIMEOUT_S + 30, sk["elapsed_s"]
            want = [2] * nranks
            want[skipper] = 1  # never signalled for epoch 2
            assert sk["flags"] == want
        else:
            assert sk["timeout"] is None, f"rank {r}: unexpected timeout {sk['timeout']}{info}"
            assert sk["flags"] == [2] * nranks


def _launch(route: str, nranks: int, tmp_path: Path, extra: list[str], mps_env=None) -> tl_launch.RankRun:
    env = tl_launch.child_env(_buffer_bytes(nranks), mps_env)
    args = ["--route", route, "--short-timeout-s", str(SHORT_TIMEOUT_S)] + extra
    if route == "mpi":
        if not tl_launch.have_mpirun():
            pytest.skip("mpirun not found")
        if importlib.util.find_spec("mpi4py") is None:
            pytest.skip("mpi4py not installed")
        return tl_launch.mpirun(nranks, args, env, tmp_path / "out", LAUNCH_TIMEOUT_S)
    return tl_launch.spawn(nranks, args, env, tmp_path / "out", LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.parametrize("route", ["uid", "torch", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_bootstrap_heap_handshake(route, nranks, tmp_path):
    """Every route bootstraps; heap, peer pointers and the Triton store+signal handshake are right."""
    run = _launch(route, nranks, tmp_path, [])
    _check_common(run, route, nranks, with_timeout=False)


def test_bounded_wait_names_silent_peer(tmp_path):
    """Rank 1 never signals rank 0: rank 0's wait ends after its deadline with PeerTimeout(peer=1)."""
    run = _launch("uid", 2, tmp_path, ["--skipper", "1", "--victim", "0"])
    _check_common(run, "uid", 2, with_timeout=True)
    _check_skip(run, 2, skipper=1, victim=0)


def _mps_alive(ctl: str, env: dict[str, str]) -> bool:
    try:
        r = subprocess.run([ctl], input="get_server_list\n", env=env, capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


@pytest.fixture(scope="module")
def mps_env():
    """MPS client environment for 4 ranks at 25 % each; starts (and stops) a private daemon if needed."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        pytest.skip("4 ranks on one GPU need MPS, and nvidia-cuda-mps-control is not on PATH")
    pct = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe and _mps_alive(ctl, dict(os.environ)):
        yield {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": os.environ.get("CUDA_MPS_LOG_DIRECTORY", pipe),
               **pct}
        return
    root = tempfile.mkdtemp(prefix="mxmps", dir="/tmp")  # short path: the pipe is a unix socket
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{root}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{root}/log"}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    full = {**os.environ, **env}
    start = subprocess.run([ctl, "-d"], env=full, capture_output=True, text=True, timeout=30)
    if start.returncode != 0:
        pytest.skip(f"could not start an MPS daemon: {start.stdout}{start.stderr}")
    deadline = time.monotonic() + 20
    while not _mps_alive(ctl, full):
        if time.monotonic() > deadline:
            subprocess.run([ctl], input="quit\n", env=full, capture_output=True, text=True, timeout=30)
            pytest.skip("MPS daemon started but does not answer")
        time.sleep(0.2)
    try:
        yield {**env, **pct}
    finally:
        subprocess.run([ctl], input="quit\n", env=full, capture_output=True, text=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("route", ["uid", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_four_ranks_under_mps(route, mps_env, tmp_path):
    """4 ranks on one GPU under MPS: bootstrap, heap, handshake, and a timeout naming the silent peer."""
    run = _launch(route, 4, tmp_path, ["--skipper", "3", "--victim", "1"], mps_env)
    _check_common(run, route, 4, with_timeout=True)
    _check_skip(run, 4, skipper=3, victim=1)
