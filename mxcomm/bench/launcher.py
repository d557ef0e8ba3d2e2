"""Starting the benchmark: launch rank processes (plain start) or join a torchrun/mpirun world.

Plain start (:func:`launch`): the parent process never initialises CUDA, NVSHMEM or a process group.
It runs up to two phases, each a fresh set of rank processes ``python -m mxcomm bench --_spec FILE``
with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, on a GPU also the NVSHMEM
environment of :func:`mxcomm.transport.launcher_env` sized from :func:`mxcomm.ep.plan.buffer_sizes`:

* ``main``: this library, the reference path and the plain all-to-all;
* ``symm``: torch's NVSHMEM ``all_to_all_vdev_2d`` (GPU, one rank per GPU) in processes of its own,
  because torch symmetric memory and nvshmem4py are not known to coexist in one process.

Rank 0's output goes to the terminal (progress bar), the others' to log files whose tails are printed
when a rank fails. A phase that overruns ``timeout_s`` is killed (each rank is its own process group).
The parent merges the phases and writes the report. Environment variables are only set for the
children, never in the parent.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from . import symm
from .mps import MpsDaemon, MpsError, how_to_start, mps_status
from .options import BenchOptions, OptionError
from .world import LaunchInfo

SYMM_TIMEOUT_S = 300.0  # the optional torch baseline phase never holds the run longer than this
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BenchError(RuntimeError):
    """The benchmark could not produce results (a phase failed); the message carries the ranks' log tails."""


@dataclass
class PhaseRun:
    """Outcome of one launched phase."""

    phase: str
    impls: list
    ranks: int
    exit_codes: list
    timed_out: bool
    result: Optional[dict]
    logs: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result is not None

    def log_tail(self, n_chars: int = 3000) -> str:
        parts = []
        for r, text in sorted(self.logs.items()):
            if text.strip():
                parts.append(f"--- rank {r} (exit {self.exit_codes[r]}) ---\n{text[-n_chars:]}")
        return "\n".join(parts)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def symmetric_bytes(opts: BenchOptions, phase: str) -> int:
    """Symmetric-heap bytes one rank of ``phase`` allocates (sum over the groups it opens)."""
    if phase == "symm":
        return symm.symmetric_bytes(max_tokens=opts.max_tokens, topk=opts.topk, hidden=opts.hidden,
                                    experts=opts.experts, world=opts.ranks, align=opts.align)
    if opts.backend != "nvshmem" or "mxcomm" not in opts.impls:
        return 0
    from ..ep.plan import buffer_sizes

    return sum(buffer_sizes(opts.ep_config(p), opts.ranks).total for p in opts.precisions)


def child_env(opts: BenchOptions, phase: str, rank: int, port: int, base: Optional[dict] = None,
              extra: Optional[dict] = None) -> dict:
    """Environment of one launched rank (a new dict; ``os.environ`` is not changed); ``extra`` (e.g. the MPS
    client variables of a daemon started for the run) is added last."""
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith(("OMPI_COMM_WORLD_", "PMI_")) or k in ("LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"):
            del env[k]
    env.update(RANK=str(rank), WORLD_SIZE=str(opts.ranks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(opts.ranks),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MXCOMM_BENCH_LAUNCHED="1", PYTHONUNBUFFERED="1",
               MXCOMM_BENCH_PARENT_PID=str(os.getpid()))
    env["PYTHONPATH"] = os.pathsep.join([PKG_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if opts.device == "cuda":
        from ..transport import launcher_env

        env.pop("TRITON_INTERPRET", None)  # real kernels on a GPU
        env.update(launcher_env(symmetric_bytes(opts, phase)))
        n_used = -(-opts.ranks // opts.ranks_per_gpu)
        visible = _visible_gpus(env)
        if n_used < len(visible):  # ranks map to GPUs round-robin over the visible ones: show only those used
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:n_used])
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // opts.ranks)))
    env.update(extra or {})
    return env


def _visible_gpus(env: dict) -> list:
    v = env.get("CUDA_VISIBLE_DEVICES")
    if v is not None and v.strip():
        return [s.strip() for s in v.split(",") if s.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def kill_ranks(procs) -> None:
    """Stop rank processes started each in its own session (``start_new_session=True``: the process group id is the
    pid): SIGTERM to each group, then SIGKILL to those still alive 5 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # each rank was started in its own session: its group id is its pid
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.1)


class BenchTerminated(BaseException):
    """Raised in the launching process by SIGTERM/SIGHUP, so that its ranks are killed on the way out."""


def _raise_terminated(signum, frame):
    raise BenchTerminated(f"mxcomm bench: stopped by signal {signum}; its rank processes were killed")


def watch_parent(environ=None, interval_s: float = 1.0) -> None:
    """In a launched rank: exit when the launching process is gone (a daemon thread polls the parent pid)."""
    import threading

    env = os.environ if environ is None else environ
    want = env.get("MXCOMM_BENCH_PARENT_PID", "")
    if not want.isdigit():
        return

    def poll():
        while True:
            if os.getppid() != int(want):
                os._exit(3)
            time.sleep(interval_s)

    threading.Thread(target=poll, name="mxcomm-bench-parent-watch", daemon=True).start()


def run_phase_processes(opts: BenchOptions, phase: str, impls: list, workdir: str,
                        extra_env: Optional[dict] = None) -> PhaseRun:
    """Start ``opts.ranks`` rank processes for one phase and wait for them (bounded by ``opts.timeout_s``);
    ``extra_env`` goes into every rank's environment (:func:`child_env`)."""
    spec_path = os.path.join(workdir, f"spec_{phase}.json")
    result_path = os.path.join(workdir, f"result_{phase}.json")
    with open(spec_path, "w") as f:
        json.dump({"options": opts.to_dict(), "phase": phase, "impls": impls, "result_path": result_path}, f)
    port = free_port()
    cmd = [sys.executable, "-m", "mxcomm", "bench", "--_spec", spec_path]
    procs, logs = [], {}
    old_handlers = {}
    try:
        import threading

        if threading.current_thread() is threading.main_thread():  # `timeout`/kill of the parent kills the ranks too
            for sig in (signal.SIGTERM, signal.SIGHUP):
                old_handlers[sig] = signal.signal(sig, _raise_terminated)
        for r in range(opts.ranks):
            env = child_env(opts, phase, r, port, extra=extra_env)
            if r == 0:
                out = None
            else:
                logs[r] = os.path.join(workdir, f"{phase}_rank{r}.log")
                out = open(logs[r], "w")
            try:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                              start_new_session=True))
            finally:
                if out is not None:
                    out.close()
        limit = opts.timeout_s if phase == "main" else min(opts.timeout_s, SYMM_TIMEOUT_S)
        deadline = time.monotonic() + limit
        timed_out = False
        first_fail = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_fail is None and any(p.poll() not in (None, 0) for p in procs):
                first_fail = now  # the others may wait in a collective: give them a moment, then stop them
            if now > deadline or (first_fail is not None and now - first_fail > 20):
                timed_out = now > deadline
                break
            time.sleep(0.2)
    finally:
        kill_ranks(procs)
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
    codes = [p.returncode for p in procs]
    result = None
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    texts = {}
    for r, path in logs.items():
        try:
            with open(path, errors="replace") as f:
                texts[r] = f.read()
        except OSError:
            texts[r] = ""
    return PhaseRun(phase=phase, impls=impls, ranks=opts.ranks, exit_codes=codes, timed_out=timed_out,
                    result=result, logs=texts)


def plan_phases(opts: BenchOptions) -> tuple[list, list]:
    """``([(phase, impls), ...], skipped)`` for a launched run."""
    skipped = []
    phases = []
    main = [i for i in opts.impls if i != "vdev2d"]
    if main:
        phases.append(("main", main))
    if "vdev2d" in opts.impls:
        reason = symm.unavailable_reason(device=opts.device, ranks_per_gpu=opts.ranks_per_gpu)
        if reason:
            skipped.append(dict(impl="vdev2d", reason=reason))
        else:
            phases.append(("symm", ["vdev2d"]))
    return phases, skipped


def needs_mps(opts: BenchOptions) -> bool:
    """Several ranks share a GPU: they must run under MPS to be timed (see :mod:`mxcomm.bench.mps`)."""
    return opts.device == "cuda" and opts.ranks_per_gpu > 1


def check_mps(opts: BenchOptions, *, joined: bool = False) -> Optional[dict]:
    """None when MPS is not needed; else ``{"state": "running", ...}`` when a daemon answers, ``{"state": "start"}``
    when the launcher is to start one (``--mps start``, plain start only). Raises OptionError otherwise, with how to
    start MPS."""
    if not needs_mps(opts):
        return None
    st = mps_status()
    if st.active:
        return dict(state="running", pipe_dir=st.pipe_dir, detail=st.detail)
    if opts.mps == "start" and not joined:
        return dict(state="start", detail=st.detail)
    if opts.mps == "start":
        raise OptionError(f"--mps start works with a plain start only (the ranks of torchrun/mpirun are already "
                          f"running); {how_to_start(opts.ranks_per_gpu)} ({st.detail})")
    raise OptionError(f"{how_to_start(opts.ranks_per_gpu)} ({st.detail})")


def precheck(opts: BenchOptions) -> None:
    """Environment problems the parent can see before starting ranks (OptionError naming the option).

    Looks for the nvshmem package (``importlib.util.find_spec``: the parent loads no NVSHMEM library) and, with
    several ranks per GPU, for a running MPS daemon (:func:`check_mps`).
    """
    import importlib.util

    check_mps(opts)
    if opts.backend == "nvshmem" and "mxcomm" in opts.impls and importlib.util.find_spec("nvshmem") is None:
        raise OptionError("--backend nvshmem needs nvshmem4py (pip install 'mxcomm[gpu]', or the wheel on PYTHONPATH); "
                          "use --backend torch to benchmark the reference path only")


def launch(opts: BenchOptions, command: list) -> tuple:
    """Run every phase in launched rank processes; return ``(report, paths)`` (files written under opts.out).

    With several ranks per GPU it runs under MPS: a daemon that answers, or (``--mps start``) one it starts for the
    run and stops at the end; else OptionError (:func:`check_mps`)."""
    precheck(opts)
    mps = check_mps(opts)
    daemon = None
    if mps is not None and mps["state"] == "start":
        try:
            daemon = MpsDaemon(opts.ranks_per_gpu).__enter__()
        except MpsError as e:
            raise BenchError(f"mxcomm bench: {e}") from None
        mps = dict(state="started by mxcomm bench for this run", **daemon.client_env)
    try:
        runs, skipped = _run_phases(opts, daemon.client_env if daemon else None)
    finally:
        if daemon is not None:
            daemon.__exit__(None, None, None)
    return _finish(opts, runs, skipped, command, mps)


def _run_phases(opts: BenchOptions, extra_env: Optional[dict]) -> tuple:
    """Run every planned phase; ``(runs, skipped)``. A failed main phase raises BenchError."""
    phases, skipped = plan_phases(opts)
    runs = []
    with tempfile.TemporaryDirectory(prefix="mxcomm-bench-") as workdir:
        for phase, impls in phases:
            run = run_phase_processes(opts, phase, impls, workdir, extra_env)
            runs.append(run)
            if not run.ok:
                why = ("timed out" if run.timed_out
                       else f"ranks exited with codes {run.exit_codes}")
                if phase == "main":
                    raise BenchError(f"mxcomm bench: phase {phase!r} {why}\n{run.log_tail()}")
                tail = run.log_tail(600).strip().splitlines()[-3:]
                skipped.append(dict(impl="vdev2d", reason=f"phase {phase!r} {why}" + (": " + " | ".join(tail)
                                                                                         if tail else "")))
                print(f"mxcomm bench: {skipped[-1]['reason']}", file=sys.stderr)
    return runs, skipped


def _finish(opts: BenchOptions, runs: list, skipped: list, command: list, mps: Optional[dict]) -> tuple:
    """Merge the phases into the report and write it under ``opts.out``; ``(report, paths)``."""
    from .report import build_report, write_outputs

    ok = [r for r in runs if r.ok]
    if not ok:
        raise BenchError("mxcomm bench: no phase produced results: " + "; ".join(s["reason"] for s in skipped))
    meta_src = ok[0].result
    phase_dicts = []
    for r in runs:
        d = dict(r.result) if r.ok else {"phase": r.phase, "cases": []}
        d.update(phase=r.phase, status="ok" if r.ok else "failed", impls=r.impls, ranks=r.ranks,
                 exit_codes=r.exit_codes)
        if not r.ok:
            d["reason"] = "timed out" if r.timed_out else f"exit codes {r.exit_codes}"
        phase_dicts.append(d)
    phase_dicts[0].setdefault("skipped", [])
    phase_dicts[0]["skipped"] = phase_dicts[0]["skipped"] + skipped
    world = dict(meta_src["world"], launch="launcher")
    opts_d = opts.to_dict()
    opts_d["ranks_per_gpu"] = world.get("ranks_per_gpu", opts.ranks_per_gpu)  # measured by the ranks
    report = build_report(options=opts_d, world=world, meta=meta_src.get("meta", {}), phases=phase_dicts,
                          command=command, mps=mps)
    paths = write_outputs(report, opts.out, plot=opts.plot)
    return report, paths


# ------------------------------------------------------------------------------ inside a rank ----

def world_desc(world) -> dict:
    return dict(ep_size=world.world, ranks_per_gpu=world.ranks_per_gpu, side_channel=world.side_channel,
                devices=world.devices, launch=world.launch.kind, device_type=world.device.type)


def rank_main(opts: BenchOptions, info: LaunchInfo, *, phase: str, impls: list,
              result_path: Optional[str] = None) -> Optional[dict]:
    """Body of one rank: join the world, run the phase, (rank 0) attach machine/versions and write the result."""
    from .env_info import machine, relevant_env, versions
    from .harness import run_phase
    from .world import close_world, init_world

    import torch

    if info.kind == "launcher":
        watch_parent()
    if opts.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    world = init_world(info, device=opts.device, side_channel=opts.side_channel, pg_timeout_s=opts.pg_timeout_s)
    try:
        res = run_phase(opts, world, impls, phase=phase)
        res["world"] = world_desc(world)
        if world.rank == 0:
            res["meta"] = dict(machine=machine(), versions=versions(), env=relevant_env())
            if result_path:
                tmp = result_path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(res, f, default=str)
                os.replace(tmp, result_path)
        world.barrier()
    finally:
        close_world(world)
    return res


def run_joined(opts: BenchOptions, info: LaunchInfo, command: list) -> Optional[tuple]:
    """Under torchrun / mpirun: every rank runs the main phase; rank 0 writes the report.

    torch's ``all_to_all_vdev_2d`` runs here only when this process does not use nvshmem4py (no mxcomm
    nvshmem backend in the same run); otherwise it is skipped with the reason. Returns ``(report, paths)``
    on rank 0, None elsewhere.
    """
    from .report import build_report, write_outputs

    mps = check_mps(opts, joined=True)
    impls = list(opts.impls)
    skipped = []
    if "vdev2d" in impls:
        reason = symm.unavailable_reason(device=opts.device, ranks_per_gpu=opts.ranks_per_gpu)
        if reason is None and opts.backend == "nvshmem" and "mxcomm" in impls:
            reason = ("this process runs the mxcomm nvshmem backend (nvshmem4py); torch symmetric memory is not "
                      "started in the same process: run it separately with --impls vdev2d, or start `mxcomm bench` "
                      "without torchrun/mpirun (it then runs it in a separate phase)")
        if reason:
            impls.remove("vdev2d")
            skipped.append(dict(impl="vdev2d", reason=reason))
    if info.rank == 0 and opts.device == "cuda" and opts.backend == "nvshmem" and "mxcomm" in impls:
        _warn_heap(opts)
    res = rank_main(opts, info, phase="main", impls=impls)
    if info.rank != 0:
        return None
    res.update(status="ok", impls=impls, ranks=opts.ranks)
    res["skipped"] = res.get("skipped", []) + skipped
    opts_d = opts.to_dict()
    opts_d["ranks_per_gpu"] = res["world"]["ranks_per_gpu"]
    report = build_report(options=opts_d, world=res["world"], meta=res.get("meta", {}), phases=[res],
                          command=command, mps=mps)
    return report, write_outputs(report, opts.out, plot=opts.plot)


def _warn_heap(opts: BenchOptions) -> None:
    from ..transport import parse_size, symmetric_size_for

    need = symmetric_bytes(opts, "main")
    have = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    want = symmetric_size_for(need)
    try:
        ok = have is not None and parse_size(have) >= parse_size(want)
    except ValueError:
        ok = False
    if not ok:
        print(f"mxcomm bench: WARNING: NVSHMEM_SYMMETRIC_SIZE={have!r}, this run needs {need} bytes of symmetric "
              f"buffers per rank: export NVSHMEM_SYMMETRIC_SIZE={want} (see mxcomm.transport.launcher_env)",
              file=sys.stderr, flush=True)


__all__ = ["launch", "run_joined", "rank_main", "BenchError", "PhaseRun", "child_env", "symmetric_bytes",
           "plan_phases", "run_phase_processes", "precheck", "check_mps", "needs_mps", "BenchTerminated",
           "watch_parent", "kill_ranks"]
