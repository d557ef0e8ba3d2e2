"""Spawn small torch.distributed worlds for tests (gloo on CPU by default), time-bounded.

    from _dist import run_world
    results = run_world(2, worker_fn, arg1, arg2, timeout=120)   # worker_fn(rank, world, arg1, arg2)

``worker_fn`` must be importable by the spawned children (defined at module level in a module
on ``sys.path``; spawn copies the parent's ``sys.path``). Each rank's return value comes back
in rank order. A rank that raises makes ``run_world`` raise ``WorkerError`` with that rank's
traceback; if the world does not finish within ``timeout`` seconds every child is killed and
``TimeoutError`` names what each rank was last doing (see :func:`progress`).
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback

import torch.multiprocessing as mp

_progress_queue = None
_progress_rank = None


class WorkerError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress(msg: str) -> None:
    """From a worker: record what this rank is doing (reported if the world times out)."""
    if _progress_queue is not None:
        _progress_queue.put(("progress", _progress_rank, str(msg)))


def _entry(rank, world, port, backend, pg_timeout_s, env, fn, args, q):
    global _progress_queue, _progress_rank
    _progress_queue, _progress_rank = q, rank
    try:
        import faulthandler

        faulthandler.enable()  # a crashing rank prints its Python stack
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(env or {})
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        q.put(("ok", rank, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put(("err", rank, traceback.format_exc()))


_RENDEZVOUS_TRIES = 3


def run_world(
    world: int, fn, *args, timeout: float = 120.0, backend: str = "gloo", pg_timeout_s: float = 60.0,
    env: dict | None = None,
):
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes with an initialised process group.

    ``env``: extra environment variables set in each child before the process group starts.

    The rendezvous port is one that was free when it was picked; when rank 0 then finds it taken (another process,
    e.g. a test world of another pytest worker, got it first: ``EADDRINUSE``) and no rank ran ``fn``, the world
    is started again on another port (at most ``_RENDEZVOUS_TRIES`` times).

    Returns the list of per-rank results. Raises WorkerError / TimeoutError (children killed).
    """
    for _ in range(_RENDEZVOUS_TRIES):
        results, errors = _run_once(world, fn, args, timeout, backend, pg_timeout_s, env)
        if results or not any("EADDRINUSE" in e and "init_process_group" in e for e in errors.values()):
            break  # ran (or failed for another reason): no new start
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise WorkerError(f"{len(errors)} of {world} ranks failed:\n{msg}")
    return [results[r] for r in range(world)]


def _run_once(world, fn, args, timeout, backend, pg_timeout_s, env):
    """One start of the world on a fresh port: ``(results, errors)`` by rank (raises TimeoutError)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, backend, pg_timeout_s, env, fn, args, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors, last = {}, {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                if errors:
                    break
                state = "; ".join(f"rank {r}: {last.get(r, 'starting')}" for r in range(world)
                                  if r not in results and r not in errors)
                raise TimeoutError(f"world of {world} did not finish in {timeout:.0f}s ({state})")
            try:
                kind, rank, payload = q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} (last: {last.get(r, 'starting')})"
                continue
            if kind == "progress":
                last[rank] = payload
            elif kind == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
                # Other ranks may now block in a collective: give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return results, errors


def expect_error(out: dict, name: str, exc: type, needle: str, fn) -> None:
    """Run ``fn`` in a rank process and record in ``out[name]`` whether it raised ``exc`` with ``needle`` in its
    message (``"ok"``), raised something else, or nothing (``"no error"``); the test asserts on ``out``."""
    try:
        fn()
        out[name] = "no error"
    except exc as e:
        out[name] = "ok" if needle in str(e) else f"message: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the test
        out[name] = f"{type(e).__name__}: {e}"


def bind_rank_gpu(rank: int) -> str:
    """From a GPU worker: bind this process to GPU ``rank % device_count`` and return ``"cuda:i"``.

    On one GPU every rank shares GPU 0 (GPU.md); on several the ranks spread over them, so the
    NVSHMEM paths cross real GPU-to-GPU links."""
    import torch

    idx = rank % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"
