"""Joining a benchmark world: detect how the rank processes were started and set up torch.distributed.

Three ways a rank process starts:

* ``launcher``: spawned by ``mxcomm bench`` itself (env ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
  ``MASTER_PORT`` plus a spec file argument);
* ``torchrun``: env ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (``env://`` rendezvous);
* ``mpirun`` (OpenMPI): env ``OMPI_COMM_WORLD_RANK``/``SIZE``; rendezvous over TCP at
  ``MASTER_ADDR:MASTER_PORT`` if set, else rank 0's host and a free port sent with mpi4py, else a
  file store in the temp folder named after the MPI job.

Nothing here writes ``os.environ``. torch is imported where a world is set up, so :func:`detect_launch` is cheap.
"""
from __future__ import annotations

import datetime
import math
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class LaunchInfo:
    """How this process was started: kind (``torchrun``/``mpirun``/``launcher``), rank, world, local rank/size."""

    kind: str
    rank: int
    world: int
    local_rank: int
    local_world: int


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for n in names:
        v = env.get(n, "")
        if v.strip().lstrip("-").isdigit():
            return int(v)
    return None


def detect_launch(environ: Optional[Mapping[str, str]] = None) -> Optional[LaunchInfo]:
    """The world this process belongs to, or None when started plainly (then ``mxcomm bench`` launches ranks)."""
    env = os.environ if environ is None else environ
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        local = _int(env, "LOCAL_RANK")
        lw = _int(env, "LOCAL_WORLD_SIZE")
        kind = "launcher" if env.get("MXCOMM_BENCH_LAUNCHED") == "1" else "torchrun"
        return LaunchInfo(kind, rank, world, rank if local is None else local, world if lw is None else lw)
    rank, world = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank is not None and world is not None:
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
        lw = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
        return LaunchInfo("mpirun", rank, world, rank if local is None else local, world if lw is None else lw)
    return None


def _mpi_init_method(info: LaunchInfo, env: Mapping[str, str]) -> str:
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    try:
        from mpi4py import MPI  # noqa: F401 - initialises MPI under mpirun
    except ImportError:
        MPI = None
    if MPI is not None and MPI.COMM_WORLD.Get_size() == info.world:
        payload = None
        if info.rank == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            payload = (socket.gethostname(), port)
        host, port = MPI.COMM_WORLD.bcast(payload, root=0)
        return f"tcp://{host}:{port}"
    job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or env.get("OMPI_MCA_orte_ess_jobid")
    if not job:
        raise RuntimeError(
            "mpirun world without MASTER_ADDR/MASTER_PORT, mpi4py or an MPI job id: cannot rendezvous "
            "(export MASTER_ADDR and MASTER_PORT, or install mpi4py)"
        )
    safe = "".join(c if c.isalnum() else "_" for c in job)
    return "file://" + os.path.join(tempfile.gettempdir(), f"mxcomm_bench_store_{safe}")


@dataclass
class BenchWorld:
    """This rank's place in the benchmark world.

    Attributes:
        launch: how the process started (:class:`LaunchInfo`).
        rank, world: rank and EP size.
        device: this rank's device (``cuda:<local_rank % visible GPUs>`` or cpu).
        side_channel: backend of the world group (``nccl`` or ``gloo``); the EP groups, the
            reference path and the all-to-all baselines run over it.
        ctrl: a gloo group (the world group itself when that is gloo) for barriers and small
            object exchange.
        ranks_per_gpu: most ranks on one physical GPU (measured: all-gather of device UUIDs).
        devices: per rank ``"host:cuda:i"`` / ``"host:cpu"``.
    """

    launch: LaunchInfo
    rank: int
    world: int
    device: torch.device
    side_channel: str
    ctrl: object
    ranks_per_gpu: int
    devices: list

    @property
    def one_host(self) -> bool:
        """Every rank runs on this rank's host (``devices`` name one host)."""
        return len({d.rsplit(":", 2)[0] for d in self.devices}) == 1

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.ctrl)

    def all_gather_object(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out


def init_world(info: LaunchInfo, *, device: str, side_channel: str, pg_timeout_s: float,
               environ: Optional[Mapping[str, str]] = None) -> BenchWorld:
    """Initialise torch.distributed for this rank and return its :class:`BenchWorld` (collective).

    ``side_channel`` ``"auto"`` picks nccl when every local rank has a GPU of its own, else gloo.
    """
    import torch
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    if device == "cuda":
        ngpu = torch.cuda.device_count()
        idx = info.local_rank % ngpu
        torch.cuda.set_device(idx)
        dev = torch.device("cuda", idx)
    else:
        ngpu, dev = 0, torch.device("cpu")
    if side_channel == "auto":
        side_channel = "nccl" if device == "cuda" and math.ceil(info.local_world / ngpu) == 1 else "gloo"
    timeout = datetime.timedelta(seconds=pg_timeout_s)
    if info.kind == "mpirun":
        init_method = _mpi_init_method(info, env)
    else:
        init_method = "env://"
    dist.init_process_group(side_channel, init_method=init_method, rank=info.rank, world_size=info.world,
                            timeout=timeout)
    ctrl = dist.new_group(backend="gloo", timeout=timeout) if side_channel != "gloo" else dist.group.WORLD
    host = socket.gethostname()
    if dev.type == "cuda":
        uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", "")) or f"{host}:{dev.index}"
        me = (host, uuid, f"{host}:cuda:{dev.index}")
    else:
        me = (host, None, f"{host}:cpu")
    everyone = [None] * info.world
    dist.all_gather_object(everyone, me, group=ctrl)
    per_gpu: dict = {}
    for h, u, _ in everyone:
        if u is not None:
            per_gpu[(h, u)] = per_gpu.get((h, u), 0) + 1
    return BenchWorld(
        launch=info, rank=info.rank, world=info.world, device=dev, side_channel=side_channel, ctrl=ctrl,
        ranks_per_gpu=max(per_gpu.values()) if per_gpu else 1, devices=[d for _, _, d in everyone],
    )


def close_world(world: BenchWorld) -> None:
    """Finalise NVSHMEM if this process initialised it, then destroy the process groups (collective)."""
    import torch.distributed as dist

    try:
        from .. import transport as tp

        if tp.is_initialized():
            tp.finalize()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["LaunchInfo", "detect_launch", "BenchWorld", "init_world", "close_world"]
