"""MPS detection and the daemon the launcher starts for several ranks on one GPU, against a stand-in
``nvidia-cuda-mps-control`` (a shell script) so that it runs without a GPU."""
from __future__ import annotations

import os
import stat

import pytest

from mxcomm.bench.launcher import check_mps, needs_mps
from mxcomm.bench.mps import MpsDaemon, mps_status
from mxcomm.bench.options import BenchOptions, OptionError

FAKE = """#!/bin/sh
# stand-in MPS control: -d makes the control FIFO, quit removes it, get_server_list answers while it exists
if [ "$1" = "-d" ]; then mkfifo "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read cmd
if [ "$cmd" = "quit" ]; then rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
[ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ] && exit ${FAKE_MPS_RC:-0}
exit 1
"""


@pytest.fixture
def fake_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "nvidia-cuda-mps-control"
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(d)


def _env(fake_bin, pipe, **extra):
    return {"PATH": f"{fake_bin}:{os.environ.get('PATH', '')}", "CUDA_MPS_PIPE_DIRECTORY": str(pipe), **extra}


def test_status_without_a_control_pipe(tmp_path, fake_bin):
    st = mps_status(_env(fake_bin, tmp_path))
    assert not st.active and "no MPS control pipe" in st.detail and st.pipe_dir == str(tmp_path)


def test_status_with_a_pipe_that_answers_or_not(tmp_path, fake_bin):
    os.mkfifo(tmp_path / "control")
    assert mps_status(_env(fake_bin, tmp_path)).active
    dead = mps_status(_env(fake_bin, tmp_path, FAKE_MPS_RC="3"))  # a FIFO left behind by a dead daemon
    assert not dead.active and "exited 3" in dead.detail
    assert not mps_status({"PATH": "/nonexistent", "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}).active


def test_daemon_started_for_a_run_and_stopped(fake_bin):
    base = {"PATH": f"{fake_bin}:{os.environ.get('PATH', '')}"}
    with MpsDaemon(4, environ=base) as d:
        env = d.client_env
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert mps_status(dict(base, **env)).active
        root = d.root
    assert not os.path.exists(root)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ or os.environ["CUDA_MPS_PIPE_DIRECTORY"] != env[
        "CUDA_MPS_PIPE_DIRECTORY"]


def _opts(**kw):
    base = dict(tokens=[8], hidden=64, topk=2, experts=4, precisions=["bf16"], mode="throughput", backend="nvshmem",
                device="cuda", ranks=2, ranks_per_gpu=2, side_channel="gloo", iters=1, warmup=0, out="x", label="x",
                impls=["a2a"])
    base.update(kw)
    return BenchOptions(**base)


def test_several_ranks_per_gpu_refused_without_mps(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # nothing listens there
    assert needs_mps(_opts()) and not needs_mps(_opts(ranks_per_gpu=1)) and not needs_mps(_opts(device="cpu"))
    with pytest.raises(OptionError, match="must run under CUDA MPS") as e:
        check_mps(_opts())
    assert "--mps start" in str(e.value) and "nvidia-cuda-mps-control -d" in str(e.value)
    assert check_mps(_opts(mps="start")) == {"state": "start", "detail": f"no MPS control pipe at {tmp_path}/control"}
    with pytest.raises(OptionError, match="plain start only"):
        check_mps(_opts(mps="start"), joined=True)
    assert check_mps(_opts(ranks_per_gpu=1)) is None and check_mps(_opts(device="cpu", ranks_per_gpu=1)) is None
