"""Start ``torch.distributed`` inside an ``mpirun`` job, so EP code written for torchrun runs unchanged.

``EPGroup`` takes a torch.distributed group. Under torchrun the process group comes from the
environment (``env://``); under ``mpirun`` (OpenMPI, MPICH, Slurm ``srun --mpi=pmix``) nothing sets
``MASTER_ADDR``/``RANK``, so :func:`init_dist_from_mpi` does the rendezvous over MPI itself:

1. rank and world size from the MPI communicator (cross-checked against ``OMPI_COMM_WORLD_RANK`` /
   ``PMI_RANK`` / ``SLURM_PROCID`` when the launcher sets them);
2. rank 0 opens a ``torch.distributed.TCPStore`` on a free port and broadcasts ``(host, port)``
   with ``comm.bcast``; every other rank connects to it;
3. ``dist.init_process_group(backend, store=..., rank=..., world_size=...)``.

The environment is never modified. The store host is ``host=`` if given, else ``$MASTER_ADDR``,
else ``127.0.0.1`` when every rank runs on one host, else rank 0's fully qualified host name.

Example (every rank, e.g. ``mpirun -np 8 python train.py``)::

    from mxcomm.transport.mpi import init_dist_from_mpi
    info = init_dist_from_mpi()                       # gloo process group over MPI.COMM_WORLD
    torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    ep = EPGroup(EPConfig(...))                       # same code as under torchrun

mpi4py is imported only when this function runs (``pip install mpi4py``).
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Mapping

__all__ = ["DistInit", "launcher_rank", "init_dist_from_mpi"]

# (rank, size, local rank) variables of common MPI launchers, in order of preference.
_LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # OpenMPI
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),                                   # MPICH / Intel MPI (hydra)
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),                             # srun
)


@dataclass(frozen=True)
class DistInit:
    """What :func:`init_dist_from_mpi` set up.

    Attributes:
        rank, world: this process's rank and the number of ranks (of the MPI communicator).
        local_rank: rank among the processes on this host (for ``torch.cuda.set_device``).
        host, port: the TCPStore rendezvous address (``port`` 0 when the group already existed).
        backend: torch.distributed backend of the default group.
        created: False when torch.distributed was already initialised (nothing was done).
    """

    rank: int
    world: int
    local_rank: int
    host: str
    port: int
    backend: str
    created: bool


def launcher_rank(environ: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(rank, world, local_rank)`` from an MPI launcher's environment variables, or None.

    Reads OpenMPI (``OMPI_COMM_WORLD_*``), MPICH/Hydra (``PMI_RANK``/``PMI_SIZE``) and Slurm
    (``SLURM_PROCID``/``SLURM_NTASKS``); ``local_rank`` is -1 when the launcher does not say.
    """
    env = os.environ if environ is None else environ
    for rv, sv, lv in _LAUNCHER_VARS:
        r, s = env.get(rv, ""), env.get(sv, "")
        if r.isdigit() and s.isdigit():
            loc = env.get(lv, "")
            return int(r), int(s), int(loc) if loc.isdigit() else -1
    return None


def _local_rank(comm, rank: int) -> int:
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def init_dist_from_mpi(
    comm=None,
    *,
    backend: str = "gloo",
    host: str | None = None,
    timeout_s: float = 300.0,
) -> DistInit:
    """Initialise the default torch.distributed process group from an MPI communicator. Collective.

    Args:
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``); its ranks become the torch ranks.
        backend: ``"gloo"`` (CPU tensors; several ranks per GPU), ``"nccl"``, or e.g. ``"cpu:gloo,cuda:nccl"``.
        host: rendezvous host that every rank can reach (default: see module docstring).
        timeout_s: store / process-group timeout in seconds.

    Returns:
        :class:`DistInit`. If torch.distributed is already initialised with the same rank and world
        size, returns at once (``created=False``).

    Raises:
        TypeError / ValueError: bad arguments, or the launcher's rank variables disagree with MPI.
        RuntimeError: torch.distributed already initialised differently; rank 0 could not open
            the store (every rank raises, none hangs).
        ImportError: mpi4py is not installed.
    """
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a non-empty str, got {backend!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
        raise ValueError(f"timeout_s must be a number of seconds in (0, 86400], got {timeout_s!r}")
    if host is not None and (not isinstance(host, str) or not host):
        raise TypeError(f"host must be a non-empty str or None, got {host!r}")
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    elif not all(hasattr(comm, a) for a in ("Get_rank", "Get_size", "bcast", "allgather")):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    import torch.distributed as dist

    rank, world = comm.Get_rank(), comm.Get_size()
    env_rank = launcher_rank()
    if env_rank is not None and comm.Get_size() == env_rank[1] and env_rank[0] != rank:
        raise ValueError(f"MPI says rank {rank} of {world}, the launcher's environment says {env_rank[:2]}")
    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but MPI says rank {rank} of {world}"
            )
        return DistInit(rank, world, _local_rank(comm, rank), "", 0, str(dist.get_backend()), False)

    hosts = comm.allgather(socket.gethostname())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if rank == 0:
        where = host or os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn()
        )
        try:
            store = dist.TCPStore(where, 0, world, True, timeout=timeout, wait_for_workers=False)
            msg = ("ok", where, int(store.port))
        except Exception as exc:  # noqa: BLE001 - tell the other ranks instead of letting them hang
            msg = ("error", where, f"{type(exc).__name__}: {exc}")
    else:
        msg = None
    msg = comm.bcast(msg, root=0)
    status, where, detail = msg
    if status != "ok":
        raise RuntimeError(f"rank 0 could not open the rendezvous TCPStore on {where}: {detail}")
    if rank != 0:
        store = dist.TCPStore(where, detail, world, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistInit(rank, world, _local_rank(comm, rank), where, detail, backend, True)
