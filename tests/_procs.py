"""Bounded waiting for rank processes started in their own sessions (shared by the test launchers)."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def kill_all(procs: list[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to the process group of every process still running (own session: pgid == pid)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for all; past ``timeout_s`` stop them (SIGTERM - mpirun forwards it to its ranks -, 10 s
    grace, SIGKILL) and return True (timed out)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            kill_all(procs, signal.SIGTERM)
            grace = time.monotonic() + 10
            for q in procs:
                try:
                    q.wait(timeout=max(grace - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
            kill_all(procs, signal.SIGKILL)
            for q in procs:
                q.wait()
            return True
    return False
