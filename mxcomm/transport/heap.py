"""Symmetric heap: named NVSHMEM symmetric torch tensors, allocated once, with peer views and pointers.

Every rank allocates the same buffers in the same order (allocation and free are collective).
For each buffer the heap keeps

* ``local``: this rank's tensor;
* ``peers[p]``: rank ``p``'s tensor mapped into this process (NVSHMEM peer pointer), or ``None``
  when ``p`` has no peer pointer (another node) — reported in ``has_peer_pointer[p]``;
* ``peer_ptrs``: int64 device tensor ``[world]`` of the peers' base addresses (0 where no peer
  pointer), for Triton kernels that store straight into peers
  (``tl.load(peer_ptrs + p).to(tl.pointer_type(tl.float32))``).

Buffers are zeroed and fenced by an all-PE barrier at allocation, so no peer can write into a
buffer before its owner zeroed it. ``finalize()`` frees every open heap.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from .bootstrap import (
    NvshmemContext,
    _register_heap,
    _sync_device,
    _unregister_heap,
    current_context,
    import_nvshmem,
)
from .env import parse_size
from .errors import TransportError

__all__ = ["BufferSpec", "SymmetricBuffer", "SymmetricHeap"]


@dataclass(frozen=True)
class BufferSpec:
    """Name, shape and dtype of one symmetric buffer.

    Raises:
        TypeError / ValueError: empty name, non-int or non-positive dimensions, not a torch.dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"buffer name must be a non-empty str, got {self.name!r}")
        if isinstance(self.shape, int):
            object.__setattr__(self, "shape", (self.shape,))
        shape = tuple(self.shape)
        if not shape or any(isinstance(d, bool) or not isinstance(d, int) for d in shape):
            raise TypeError(f"buffer {self.name!r}: shape must be a non-empty tuple of ints, got {self.shape!r}")
        if any(d <= 0 for d in shape):
            raise ValueError(f"buffer {self.name!r}: every dimension must be > 0, got {shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"buffer {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class SymmetricBuffer:
    """One symmetric buffer as this process sees it (see module docstring).

    Attributes:
        spec: name, shape, dtype.
        local: this rank's tensor, ``spec.shape`` / ``spec.dtype``, on the context's device.
        peers: ``world`` entries; ``peers[rank] is local``; ``None`` where no peer pointer.
        peer_ptrs: int64 ``[world]`` device tensor of base addresses (``0`` where no peer pointer).
        has_peer_pointer: ``world`` booleans.
    """

    spec: BufferSpec
    local: torch.Tensor
    peers: tuple[torch.Tensor | None, ...]
    peer_ptrs: torch.Tensor
    has_peer_pointer: tuple[bool, ...]
    _raw: torch.Tensor = field(repr=False)  # the uint8 tensor nvshmem4py allocated (what free_tensor takes)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def peer(self, p: int) -> torch.Tensor:
        """Rank ``p``'s tensor; ``TransportError`` if ``p`` has no peer pointer."""
        t = self.peers[p]
        if t is None:
            raise TransportError(f"buffer {self.name!r}: rank {p} has no peer pointer (another node?)")
        return t


class SymmetricHeap:
    """Registry of named symmetric buffers of one NVSHMEM context.

    Args:
        ctx: context from ``init_nvshmem``; default the process's current one.

    All ranks must call :meth:`alloc` / :meth:`free` in the same order with the same specs.
    """

    def __init__(self, ctx: NvshmemContext | None = None):
        self.ctx = current_context() if ctx is None else ctx
        self._buffers: dict[str, SymmetricBuffer] = {}
        self._open = True
        _register_heap(self)

    @staticmethod
    def plan_bytes(specs: Iterable[BufferSpec]) -> int:
        """Bytes the given buffers take (for ``launcher_env`` / ``symmetric_size_for`` before init)."""
        return sum(s.nbytes for s in specs)

    def alloc(self, name: str, shape: tuple[int, ...] | int, dtype: torch.dtype) -> SymmetricBuffer:
        """Allocate (collectively) a zeroed symmetric buffer, or return the one already named ``name``.

        Args:
            name: key of the buffer in this heap.
            shape: tensor shape (all dims > 0).
            dtype: any torch dtype (the heap allocates bytes and views them).

        Returns:
            The :class:`SymmetricBuffer`.

        Raises:
            ValueError: ``name`` exists with another shape/dtype; bad shape.
            TypeError: bad name / shape / dtype types.
            RuntimeError: the heap was freed.
            TransportError: NVSHMEM could not allocate (heap too small: see ``NVSHMEM_SYMMETRIC_SIZE``).
        """
        spec = BufferSpec(name, shape if isinstance(shape, int) else tuple(shape), dtype)
        if not self._open:
            raise RuntimeError("this SymmetricHeap was freed")
        old = self._buffers.get(spec.name)
        if old is not None:
            if old.spec != spec:
                raise ValueError(f"buffer {spec.name!r} already allocated as {old.spec}, asked for {spec}")
            return old
        nvshmem_core = import_nvshmem()
        try:
            raw = nvshmem_core.tensor((spec.nbytes,), dtype=torch.uint8)
        except nvshmem_core.NvshmemError as exc:
            raise TransportError(self._oom_message(spec, exc)) from exc
        if raw.data_ptr() % 16:  # the EP kernels promise the compiler 16-byte aligned rows
            raise TransportError(f"NVSHMEM returned a buffer not 16-byte aligned for {spec} ({raw.data_ptr():#x})")
        local = raw.view(spec.dtype).view(spec.shape)
        peers: list[torch.Tensor | None] = []
        for p in range(self.ctx.world):
            if p == self.ctx.rank:
                peers.append(local)  # nvshmem_ptr(self) is the local address; no extra tracked view
            elif self.ctx.has_peer_pointer(p):
                try:
                    peers.append(nvshmem_core.get_peer_tensor(raw, p).view(spec.dtype).view(spec.shape))
                except nvshmem_core.NvshmemError:
                    peers.append(None)
            else:
                peers.append(None)
        ptrs = [0 if t is None else t.data_ptr() for t in peers]
        buf = SymmetricBuffer(
            spec=spec,
            local=local,
            peers=tuple(peers),
            peer_ptrs=torch.tensor(ptrs, dtype=torch.int64, device=self.ctx.device),
            has_peer_pointer=tuple(t is not None for t in peers),
            _raw=raw,
        )
        raw.zero_()
        self.ctx.barrier()  # every owner has zeroed before anyone may store into it
        self._buffers[spec.name] = buf
        return buf

    def alloc_all(self, specs: Iterable[BufferSpec]) -> dict[str, SymmetricBuffer]:
        """:meth:`alloc` each spec in order; returns name -> buffer."""
        return {s.name: self.alloc(s.name, s.shape, s.dtype) for s in specs}

    def _oom_message(self, spec: BufferSpec, exc: Exception) -> str:
        size = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
        have = f"NVSHMEM_SYMMETRIC_SIZE={size} ({parse_size(size)} bytes)" if size else "NVSHMEM_SYMMETRIC_SIZE unset"
        return (
            f"NVSHMEM could not allocate symmetric buffer {spec} ({spec.nbytes} bytes) with {self.nbytes} bytes "
            f"already in this heap; {have}. Start the ranks with mxcomm.transport.launcher_env(total_bytes) "
            f"(NVSHMEM_SYMMETRIC_SIZE from symmetric_size_for). NVSHMEM said: {getattr(exc, 'msg', exc)}"
        )

    def __getitem__(self, name: str) -> SymmetricBuffer:
        try:
            return self._buffers[name]
        except KeyError:
            raise KeyError(f"no symmetric buffer {name!r}; have {sorted(self._buffers)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._buffers

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers in this heap (what each rank holds in its symmetric heap)."""
        return sum(b.nbytes for b in self._buffers.values())

    def report(self) -> dict[str, int]:
        """Bytes per buffer name, in allocation order."""
        return {n: b.nbytes for n, b in self._buffers.items()}

    def free(self) -> None:
        """Free (collectively) every buffer, newest first; tensors handed out before become invalid."""
        if not self._open:
            return
        nvshmem_core = import_nvshmem()
        _sync_device(self.ctx.device)
        for buf in reversed(list(self._buffers.values())):
            nvshmem_core.free_tensor(buf._raw)
        self._buffers.clear()
        self._open = False
        _unregister_heap(self)

    def __enter__(self) -> "SymmetricHeap":
        return self

    def __exit__(self, *exc) -> None:
        self.free()
