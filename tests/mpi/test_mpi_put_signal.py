"""NVSHMEM put-with-signal kernels (csrc/put_signal.cu) between ranks on ONE GPU, remote path forced.

Each rank puts random byte ranges (empty, odd, up to 2.5 MB, 1..12 chunks) into every other rank's
symmetric buffer with ``put_signal`` (some rounds on a few CUDA blocks, some as plain ``put`` +
``quiet`` + signal) and waits with ``wait_signals``; every received byte is
checked, as is every byte that must stay untouched. An out-of-range entry must be refused on the
device (error code 2, nothing written or signalled), bad host arguments must raise before a launch,
a wait whose error word is already set must return at once (recording nothing), and a rank that skips
a peer must make that peer's bounded wait raise PeerTimeout naming it.

Run on the GPU machine: ``python -m pytest -m nvshmem tests/mpi`` (nvshmem4py importable; builds
the cubin with nvcc on first use, cached in $MXCOMM_CACHE or ~/.cache/mxcomm).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import mpi_launch

pytestmark = pytest.mark.nvshmem

WORKER = Path(__file__).with_name("put_signal_worker.py")
SHORT_TIMEOUT_S = 2.0
SKIPPER, VICTIM = 1, 0


def _env(mps: dict | None = None) -> dict:
    from mxcomm.transport import launcher_env

    extra = launcher_env((4 << 20) * 8)
    env = mpi_launch.child_env(extra)
    env.pop("TRITON_INTERPRET", None)
    if mps:
        env.update(mps)
    else:
        for k in [k for k in env if k.startswith("CUDA_MPS_")]:
            env.pop(k)
    return env


def _launch(route: str, nranks: int, tmp_path: Path, mps: dict | None = None) -> mpi_launch.Launch:
    args = ["--route", route, "--skipper", SKIPPER, "--victim", VICTIM, "--short-timeout-s", SHORT_TIMEOUT_S]
    env = _env(mps)
    if route == "mpi":
        ok, why = mpi_launch.have_mpi()
        if not ok:
            pytest.skip(why)
        fwd = tuple(k for k in env if k.startswith(("NVSHMEM_", "CUDA_MPS_")) or k in (
            "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "MXCOMM_CACHE", "MXCOMM_NVSHMEM_HOME"))
        return mpi_launch.mpirun(nranks, WORKER, args, env=env, outdir=tmp_path / "out", timeout_s=400, forward=fwd)
    return mpi_launch.spawn(nranks, WORKER, args, env=env, outdir=tmp_path / "out", timeout_s=400)


def _check(run: mpi_launch.Launch, nranks: int, route: str) -> None:
    from mxcomm.transport.put_signal import BAD_ENTRY_CODE

    run.check()
    info = f"\n{run.logs()}"
    import put_signal_worker as w

    per = w.PER_EPOCH
    for r, res in run.results.items():
        assert (res["rank"], res["world"], res["route"]) == (r, nranks, route), info
        assert res["steps"] == ["bootstrap", "heap", "cubin", "rounds", "bad_entry", "gives_up", "timeout",
                                "finalize"], info
        assert res["gives_up"]["err_unchanged"] and res["gives_up"]["elapsed_s"] < 10, res["gives_up"]
        assert res["host_checks"] and all(v is True for v in res["host_checks"].values()), res["host_checks"]
        rounds = res["rounds"]
        assert len(rounds) == len(w.ROUNDS) + 1, info
        for e, rd in enumerate(rounds[:-1], start=1):
            assert rd["timeout"] is None, f"rank {r} round {e}: unexpected timeout {rd['timeout']}{info}"
            assert rd["bytes_ok"], (f"rank {r} round {e} (chunks {rd['chunks']}, blocks {rd['blocks']}, plain "
                                    f"{rd['plain']}): wrong bytes at {rd['first_bad']}")
            assert rd["signals"] == [0 if s == r else e * per for s in range(nranks)], (r, e, rd["signals"])
        assert sum(rd["bytes_sent"] for rd in rounds) > 0
        bad = res["bad_entry"]
        assert bad["error_word"] == bad["expected_word"] == (BAD_ENTRY_CODE << 32) | ((r + 1) % nranks), bad
        assert bad["message"] and "TransportError" in bad["message"] and "code 2" in bad["message"], bad
        assert bad["untouched"] and bad["signals_unchanged"], bad
        last = rounds[-1]
        e = len(w.ROUNDS) + 1
        assert last["bytes_ok"], f"rank {r}: bytes of the signalling peers wrong in the timeout round{info}"
        if r == VICTIM:
            t = last["timeout"]
            assert t is not None, f"rank {VICTIM} should have timed out waiting for {SKIPPER}{info}"
            assert t["peer"] == SKIPPER and t["peers"] == [SKIPPER], t
            assert f"peer {SKIPPER}" in t["message"] and f"rank {VICTIM}" in t["message"], t
            assert SHORT_TIMEOUT_S * 0.9 <= last["elapsed_s"] < SHORT_TIMEOUT_S + 30, last["elapsed_s"]
            want = [0 if s == r else e * per for s in range(nranks)]
            want[SKIPPER] = (e - 1) * per  # never signalled in the last round
            assert last["signals"] == want, last["signals"]
        else:
            assert last["timeout"] is None, f"rank {r}: unexpected timeout {last['timeout']}{info}"
            assert last["signals"] == [0 if s == r else e * per for s in range(nranks)]


@pytest.mark.parametrize("route", ["uid", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_put_signal_two_ranks_one_gpu(route, tmp_path):
    _check(_launch(route, 2, tmp_path), 2, route)


def _mps_env() -> dict | None:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe and os.path.exists(os.path.join(pipe, "control")) and shutil.which("nvidia-cuda-mps-control"):
        return {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": os.environ.get("CUDA_MPS_LOG_DIRECTORY", pipe),
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    return None


@pytest.mark.skipif(_mps_env() is None, reason="4 ranks on one GPU need a running MPS daemon (CUDA_MPS_PIPE_DIRECTORY)")
def test_put_signal_four_ranks_one_gpu_mps(tmp_path):
    _check(_launch("uid", 4, tmp_path, _mps_env()), 4, "uid")
