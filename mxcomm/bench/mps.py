"""CUDA MPS for several benchmark ranks on one GPU.

Without MPS, processes sharing a GPU time-slice it: a 128-token dispatch of two ranks then reads ~6 ms, which
measures nothing. Under MPS their kernels run concurrently. ``mxcomm bench`` therefore refuses to time several
ranks per GPU unless an MPS daemon answers (:func:`mps_status`), or starts one for the run (``--mps start``,
:class:`MpsDaemon`).

Detection: the control daemon listens on ``control`` (a FIFO or a socket) in ``CUDA_MPS_PIPE_DIRECTORY`` (default
``/tmp/nvidia-mps``); MPS is taken as running when that FIFO exists and ``nvidia-cuda-mps-control`` answers
``get_server_list`` through it (a FIFO left behind by a dead daemon does not answer). Nothing here changes
``os.environ``: the daemon and the ranks get explicit environment dicts.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping, Optional

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class MpsStatus:
    """Whether an MPS control daemon answers: ``active``, the ``pipe_dir`` looked at, and ``detail`` (why)."""

    active: bool
    pipe_dir: str
    detail: str


def pipe_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR


def mps_status(environ: Optional[Mapping[str, str]] = None, timeout_s: float = 10.0) -> MpsStatus:
    """Ask the MPS control daemon of ``environ`` (default ``os.environ``, read only) whether it runs."""
    env = dict(os.environ if environ is None else environ)
    d = pipe_dir(env)
    control = os.path.join(d, "control")
    try:  # a FIFO or a socket, depending on the driver: whether the daemon answers decides
        os.stat(control)
    except OSError:
        return MpsStatus(False, d, f"no MPS control pipe at {control}")
    exe = shutil.which(CONTROL, path=env.get("PATH"))
    if exe is None:
        return MpsStatus(False, d, f"{CONTROL} is not on PATH")
    try:
        r = subprocess.run([exe], input="get_server_list\n", env=env, capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return MpsStatus(False, d, f"{CONTROL} did not answer: {e}")
    if r.returncode != 0:
        return MpsStatus(False, d, f"{CONTROL} get_server_list exited {r.returncode}: {r.stderr.strip()[:200]}")
    return MpsStatus(True, d, f"MPS control daemon answers at {d}")


def how_to_start(ranks_per_gpu: int) -> str:
    """The message telling a user how to run under MPS."""
    pct = 100 // max(1, ranks_per_gpu)
    return (f"{ranks_per_gpu} ranks share a GPU: they must run under CUDA MPS (without it they time-slice the GPU "
            "and the times measure nothing). Either pass --mps start (mxcomm bench starts a daemon for the run and "
            f"stops it at the end), or start one yourself: `{CONTROL} -d` (optionally with "
            f"CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY set, and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct} for "
            f"the ranks), run mxcomm bench, then stop it with `echo quit | {CONTROL}`")


class MpsError(RuntimeError):
    """The MPS daemon could not be started."""


class MpsDaemon:
    """A private MPS control daemon for one run (pipe and log folders in a new temporary folder).

    Use as a context manager; :attr:`client_env` holds the variables the ranks need
    (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``).
    """

    def __init__(self, ranks_per_gpu: int, environ: Optional[Mapping[str, str]] = None, timeout_s: float = 10.0):
        self.ranks_per_gpu = ranks_per_gpu
        self.base = dict(os.environ if environ is None else environ)
        self.timeout_s = timeout_s
        self.root: Optional[str] = None
        self.client_env: dict = {}

    def _env(self) -> dict:
        return dict(self.base, **{k: v for k, v in self.client_env.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"})

    def __enter__(self) -> "MpsDaemon":
        exe = shutil.which(CONTROL, path=self.base.get("PATH"))
        if exe is None:
            raise MpsError(f"--mps start: {CONTROL} is not on PATH")
        self.root = tempfile.mkdtemp(prefix="mxcomm-mps-")
        pipe, log = os.path.join(self.root, "pipe"), os.path.join(self.root, "log")
        os.makedirs(pipe)
        os.makedirs(log)
        self.client_env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log,
                           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // max(1, self.ranks_per_gpu))}
        r = subprocess.run([exe, "-d"], env=self._env(), capture_output=True, text=True, timeout=self.timeout_s)
        if r.returncode != 0:
            shutil.rmtree(self.root, ignore_errors=True)
            raise MpsError(f"--mps start: `{CONTROL} -d` exited {r.returncode}: {r.stderr.strip()[:300]}")
        deadline = time.monotonic() + self.timeout_s
        while True:
            st = mps_status(self._env(), timeout_s=self.timeout_s)
            if st.active:
                return self
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise MpsError(f"--mps start: the MPS daemon does not answer ({st.detail})")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        exe = shutil.which(CONTROL, path=self.base.get("PATH"))
        if exe is not None and self.root is not None:
            try:
                subprocess.run([exe], input="quit\n", env=self._env(), capture_output=True, text=True,
                               timeout=self.timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
            deadline = time.monotonic() + self.timeout_s  # quit returns at once; the daemon leaves shortly after
            while mps_status(self._env(), timeout_s=1.0).active and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


__all__ = ["MpsStatus", "mps_status", "how_to_start", "MpsDaemon", "MpsError", "pipe_dir"]
