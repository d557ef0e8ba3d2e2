"""Initialise NVSHMEM (through nvshmem4py) by unique id, once per process.

Rank 0 creates an NVSHMEM unique id; it reaches the other ranks by one of three routes:

* ``group=``: a ``torch.distributed`` process group (gloo or nccl), ``broadcast_object_list``;
* ``mpi_comm=``: an mpi4py communicator, ``comm.bcast``;
* ``uid=, rank=, nranks=``: the caller already distributed it (bytes from :func:`new_unique_id`,
  e.g. through a file or a pipe of its own launcher).

nvshmem4py and cuda-python are imported lazily: ``import mxcomm.transport`` works on a CPU
machine without them, and :func:`init_nvshmem` then raises :class:`NvshmemUnavailable`.

The process-wide registry (the context and the open symmetric heaps) is the only global state.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .env import check_env
from .errors import NvshmemUnavailable, TransportError

__all__ = [
    "NvshmemContext",
    "init_nvshmem",
    "finalize",
    "current_context",
    "is_initialized",
    "new_unique_id",
    "import_nvshmem",
]

_INSTALL_HINT = (
    "mxcomm's NVSHMEM transport needs nvshmem4py and cuda-python: pip install 'mxcomm[gpu]' "
    "(packages nvshmem4py-cu13 and cuda-python, with the nvidia-nvshmem-cu13 library)"
)
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def import_nvshmem():
    """Return the ``nvshmem.core`` module, or raise :class:`NvshmemUnavailable` saying what to install."""
    try:
        import nvshmem.core as nvshmem_core
    except (ImportError, OSError) as exc:
        raise NvshmemUnavailable(f"{_INSTALL_HINT}; importing nvshmem.core failed: {exc}") from exc
    return nvshmem_core


def _import_device_cls():
    """``cuda.core.Device`` (``cuda.core.experimental.Device`` on older cuda-python)."""
    try:
        from cuda.core import Device
    except ImportError:
        try:
            from cuda.core.experimental import Device
        except ImportError as exc:
            raise NvshmemUnavailable(f"{_INSTALL_HINT}; importing cuda.core failed: {exc}") from exc
    return Device


@dataclass(frozen=True)
class NvshmemContext:
    """This process's place in the NVSHMEM job.

    Attributes:
        rank: NVSHMEM PE of this process (== its rank in the bootstrap group/communicator).
        world: number of PEs.
        device: the CUDA device bound to this process.
        route: how the unique id was distributed: ``"torch"``, ``"mpi"`` or ``"uid"``.
        local_peers: PEs this process can load/store through a peer pointer (same node), incl. itself.
    """

    rank: int
    world: int
    device: torch.device
    route: str
    local_peers: tuple[int, ...]

    def has_peer_pointer(self, peer: int) -> bool:
        """Whether ``peer``'s symmetric buffers are directly addressable from this process."""
        if not 0 <= peer < self.world:
            raise ValueError(f"peer {peer} out of range for world {self.world}")
        return peer in self.local_peers

    @property
    def remote_peers(self) -> tuple[int, ...]:
        """PEs without a peer pointer (other nodes): reached by NVSHMEM put/signal only."""
        return tuple(p for p in range(self.world) if p not in self.local_peers)

    @property
    def all_local(self) -> bool:
        """True when every PE has a peer pointer (single node)."""
        return len(self.local_peers) == self.world

    def barrier(self, stream: torch.cuda.Stream | None = None) -> None:
        """All-PE barrier: ``nvshmem barrier_all`` on ``stream`` (default: current), then host wait.

        Orders every PE's prior work on its stream (incl. stores into peers) before anything after.
        Works in NVSHMEM's limited multi-process-per-GPU mode too (host collectives do not).
        """
        nvshmem_core = import_nvshmem()
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        nvshmem_core.barrier_all(stream=nvshmem_core.NvshmemStream(s))
        s.synchronize()


@dataclass
class _Registry:
    ctx: NvshmemContext | None = None
    heaps: list = field(default_factory=list)  # open SymmetricHeap objects, freed by finalize()


_REGISTRY = _Registry()


def is_initialized() -> bool:
    """Whether :func:`init_nvshmem` ran in this process (and :func:`finalize` not since)."""
    return _REGISTRY.ctx is not None


def current_context() -> NvshmemContext:
    """The context of :func:`init_nvshmem`; ``RuntimeError`` if NVSHMEM is not initialised."""
    if _REGISTRY.ctx is None:
        raise RuntimeError("NVSHMEM is not initialised in this process: call mxcomm.transport.init_nvshmem(...) first")
    return _REGISTRY.ctx


def _register_heap(heap: Any) -> None:
    _REGISTRY.heaps.append(heap)


def _unregister_heap(heap: Any) -> None:
    _REGISTRY.heaps[:] = [h for h in _REGISTRY.heaps if h is not heap]


def _sync_device(device: torch.device) -> None:
    """Wait for all work on ``device`` (no-op for a non-CUDA device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _uid_to_bytes(uid: Any) -> bytes:
    import numpy as np

    return np.asarray(uid._data).view(np.uint8).tobytes()


def _uid_from(nvshmem_core, uid: Any):
    """An nvshmem4py ``UniqueID`` from bytes (or the object itself)."""
    if not isinstance(uid, (bytes, bytearray, memoryview)):
        return uid
    import numpy as np

    out = nvshmem_core.get_unique_id(empty=True)
    raw = out._data.view(np.uint8)
    data = np.frombuffer(bytes(uid), dtype=np.uint8)
    if data.size != raw.size:
        raise ValueError(f"uid has {data.size} bytes, an NVSHMEM unique id has {raw.size}")
    raw[...] = data.reshape(raw.shape)
    return out


def new_unique_id() -> bytes:
    """A fresh NVSHMEM unique id as bytes (call on ONE rank, hand the bytes to all, pass as ``uid=``)."""
    return _uid_to_bytes(import_nvshmem().get_unique_id())


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _route_rank_world(group, mpi_comm, uid, rank, nranks) -> tuple[str, int, int]:
    """Validate the arguments (before any import or communication); return (route, rank, world)."""
    chosen = [name for name, v in (("group", group), ("mpi_comm", mpi_comm), ("uid", uid)) if v is not None]
    if len(chosen) != 1:
        raise ValueError(
            "init_nvshmem needs exactly one of group= (torch.distributed), mpi_comm= (mpi4py) or "
            f"uid=+rank=+nranks=; got {chosen or 'none'}"
        )
    if uid is None and (rank is not None or nranks is not None):
        raise ValueError("rank=/nranks= go with uid= only; with group=/mpi_comm= they come from the group")
    if group is not None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group= given but torch.distributed is not initialised (init_process_group first)")
        grank = dist.get_rank(group)
        if grank < 0:
            raise ValueError("this process is not a member of the given torch.distributed group")
        return "torch", grank, dist.get_world_size(group)
    if mpi_comm is not None:
        if not all(hasattr(mpi_comm, a) for a in ("Get_rank", "Get_size", "bcast")):
            raise TypeError(f"mpi_comm must be an mpi4py communicator, got {type(mpi_comm).__name__}")
        return "mpi", mpi_comm.Get_rank(), mpi_comm.Get_size()
    if not isinstance(uid, (bytes, bytearray, memoryview)) and not hasattr(uid, "_data"):
        raise TypeError(f"uid must be bytes from new_unique_id() or an nvshmem UniqueID, got {type(uid).__name__}")
    if rank is None or nranks is None:
        raise ValueError("uid= needs rank= and nranks=")
    rank, nranks = _check_int("rank", rank), _check_int("nranks", nranks)
    if nranks < 1 or not 0 <= rank < nranks:
        raise ValueError(f"need 0 <= rank < nranks, got rank={rank} nranks={nranks}")
    return "uid", rank, nranks


def _pick_device(device, rank: int) -> int:
    if device is not None:
        if isinstance(device, int) and not isinstance(device, bool):
            idx = device
        else:
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"device must be a CUDA device, got {device!r}")
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if not 0 <= idx < torch.cuda.device_count():
            raise ValueError(f"CUDA device {idx} does not exist ({torch.cuda.device_count()} visible)")
        return idx
    local = rank
    for var in _LOCAL_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            local = int(os.environ[var])
            break
    return local % torch.cuda.device_count()


def _exchange_uid(route: str, rank: int, group, mpi_comm, nvshmem_core) -> bytes:
    payload = _uid_to_bytes(nvshmem_core.get_unique_id()) if rank == 0 else None
    if route == "torch":
        import torch.distributed as dist

        box = [payload]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        payload = box[0]
    else:
        payload = mpi_comm.bcast(payload, root=0)
    if not isinstance(payload, bytes):
        raise TransportError(f"rank {rank}: received no NVSHMEM unique id from rank 0 (got {type(payload).__name__})")
    return payload


def _probe_local_peers(nvshmem_core, rank: int, world: int) -> tuple[int, ...]:
    """PEs with a peer pointer: one tiny symmetric allocation, nvshmem_ptr for each PE, freed again."""
    probe = nvshmem_core.tensor((1,), dtype=torch.int64)
    try:
        local = [rank]
        for p in range(world):
            if p == rank:
                continue
            try:
                nvshmem_core.get_peer_tensor(probe, p)
                local.append(p)
            except nvshmem_core.NvshmemError:
                pass
    finally:
        nvshmem_core.free_tensor(probe)
    return tuple(sorted(local))


def init_nvshmem(
    *,
    group=None,
    mpi_comm=None,
    uid: bytes | Any = None,
    rank: int | None = None,
    nranks: int | None = None,
    device: int | str | torch.device | None = None,
) -> NvshmemContext:
    """Initialise NVSHMEM in this process by unique id; idempotent.

    Collective: every rank of the group / communicator / job calls it. Pass exactly one route:

    Args:
        group: a ``torch.distributed`` ProcessGroup (e.g. ``dist.group.WORLD``; gloo or nccl).
            Rank 0 of the group creates the id; ``broadcast_object_list`` sends it.
        mpi_comm: an mpi4py communicator; rank 0 creates the id; ``comm.bcast`` sends it.
        uid: id bytes from :func:`new_unique_id` (or an nvshmem4py ``UniqueID``) the caller already
            distributed; needs ``rank`` and ``nranks``.
        device: CUDA device for this process; default ``local_rank % device_count`` with the local
            rank from ``LOCAL_RANK`` / ``OMPI_COMM_WORLD_LOCAL_RANK`` / ``MPI_LOCALRANKID`` /
            ``SLURM_LOCALID`` (else the rank). Several ranks may share one GPU.

    Returns:
        The process's :class:`NvshmemContext`. A second call returns the same context if it names
        the same rank and world, else raises ``RuntimeError``.

    Raises:
        ValueError / TypeError: bad arguments (checked before anything is imported or sent).
        RuntimeError: NVLink multicast not disabled (:func:`~mxcomm.transport.env.check_env`), no CUDA,
            or already initialised differently.
        NvshmemUnavailable: nvshmem4py / cuda-python missing.
        TransportError: NVSHMEM came up with a different PE number / size than the bootstrap said.
    """
    route, my_rank, world = _route_rank_world(group, mpi_comm, uid, rank, nranks)
    if _REGISTRY.ctx is not None:
        ctx = _REGISTRY.ctx
        if (ctx.rank, ctx.world) != (my_rank, world):
            raise RuntimeError(
                f"NVSHMEM already initialised as rank {ctx.rank} of {ctx.world}; asked for rank {my_rank} of {world}"
            )
        return ctx
    check_env()
    nvshmem_core = import_nvshmem()
    Device = _import_device_cls()
    if not torch.cuda.is_available():
        raise RuntimeError("init_nvshmem needs a CUDA GPU, and torch sees none")

    idx = _pick_device(device, my_rank)
    torch.cuda.set_device(idx)
    dev = Device(idx)
    dev.set_current()

    uid_bytes = uid if route == "uid" else _exchange_uid(route, my_rank, group, mpi_comm, nvshmem_core)
    nvshmem_core.init(
        device=dev, uid=_uid_from(nvshmem_core, uid_bytes), rank=my_rank, nranks=world, initializer_method="uid"
    )
    pe, npes = nvshmem_core.my_pe(), nvshmem_core.n_pes()
    if (pe, npes) != (my_rank, world):
        raise TransportError(f"NVSHMEM started as PE {pe} of {npes}, but the bootstrap said rank {my_rank} of {world}")
    ctx = NvshmemContext(
        rank=my_rank,
        world=world,
        device=torch.device("cuda", idx),
        route=route,
        local_peers=_probe_local_peers(nvshmem_core, my_rank, world),
    )
    _REGISTRY.ctx = ctx
    return ctx


def finalize() -> None:
    """Free every open symmetric heap, then finalise NVSHMEM. Collective; no-op if not initialised."""
    if _REGISTRY.ctx is None:
        return
    nvshmem_core = import_nvshmem()
    _sync_device(_REGISTRY.ctx.device)
    for heap in list(reversed(_REGISTRY.heaps)):
        heap.free()
    _REGISTRY.heaps.clear()
    nvshmem_core.finalize()
    _REGISTRY.ctx = None
