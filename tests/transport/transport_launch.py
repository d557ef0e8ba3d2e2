"""Start N rank processes of nvshmem_worker.py on one machine (mpirun or plain subprocesses), time-bounded.

Each rank writes ``<outdir>/rank<r>.json`` and its output goes to ``<outdir>/rank<r>.log``
(``mpirun.log`` under mpirun). Processes are started in their own sessions and, past the
deadline, killed by their own process-group ids.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from _procs import wait_all
from mxcomm.transport import launcher_env

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("nvshmem_worker.py")


@dataclass
class RankRun:
    """Outcome of one launch: per-rank JSON results, return codes, logs."""

    nranks: int
    outdir: Path
    returncodes: list[int | None]
    timed_out: bool
    results: dict[int, dict] = field(default_factory=dict)

    def logs(self, limit: int = 4000) -> str:
        text = []
        for f in sorted(self.outdir.glob("*.log")):
            body = f.read_text(errors="replace")
            text.append(f"--- {f.name} ---\n{body[-limit:]}")
        for r, res in sorted(self.results.items()):
            if "error" in res:
                text.append(f"--- rank {r} error ---\n{res['error']}")
        return "\n".join(text)


def child_env(buffer_bytes: int, mps_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the rank processes: launcher_env, repo on PYTHONPATH, no interpreter, MPS only if asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_") and k != "TRITON_INTERPRET"}
    env.update(launcher_env(buffer_bytes))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if mps_env:
        env.update(mps_env)
    return env


def _collect(nranks: int, outdir: Path, procs, timed_out: bool) -> RankRun:
    run = RankRun(nranks, outdir, [p.returncode for p in procs], timed_out)
    for r in range(nranks):
        f = outdir / f"rank{r}.json"
        if f.exists():
            run.results[r] = json.loads(f.read_text())
    return run


def spawn(nranks: int, worker_args: list[str], env: dict[str, str], outdir: Path, timeout_s: float) -> RankRun:
    """``nranks`` plain subprocesses ``python nvshmem_worker.py --rank r --nranks n <worker_args>``."""
    outdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(nranks):
        log = open(outdir / f"rank{r}.log", "w")
        cmd = [sys.executable, str(WORKER), "--rank", str(r), "--nranks", str(nranks), "--outdir", str(outdir)]
        procs.append(subprocess.Popen(cmd + worker_args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=str(REPO)))
        log.close()
    timed_out = wait_all(procs, timeout_s)
    return _collect(nranks, outdir, procs, timed_out)


def have_mpirun() -> bool:
    return shutil.which("mpirun") is not None


def mpirun(nranks: int, worker_args: list[str], env: dict[str, str], outdir: Path, timeout_s: float) -> RankRun:
    """``mpirun -np nranks python nvshmem_worker.py <worker_args>`` (OpenMPI), forwarding the environment."""
    outdir.mkdir(parents=True, exist_ok=True)
    names = sorted(set(launcher_env(0)) | {"NVSHMEM_SYMMETRIC_SIZE", "PYTHONPATH", "PYTHONUNBUFFERED", "PATH",
                                            "LD_LIBRARY_PATH"} | {k for k in env if k.startswith("CUDA_MPS_")})
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(nranks)]
    for k in names:
        if k in env:
            cmd += ["-x", k]
    cmd += [sys.executable, str(WORKER), "--outdir", str(outdir)] + worker_args
    with open(outdir / "mpirun.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(REPO))
    timed_out = wait_all([proc], timeout_s)
    run = _collect(nranks, outdir, [proc], timed_out)
    run.returncodes = run.returncodes * nranks
    return run
