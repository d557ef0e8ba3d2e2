"""Stand-ins for mxcomm.transport's NVSHMEM context and symmetric buffers, for CPU runs of the nvshmem
backend's kernels under the Triton interpreter (tests/ep)."""
import math
from dataclasses import dataclass

import torch


@dataclass
class FakeCtx:
    device: torch.device
    rank: int = 0
    world: int = 1


@dataclass
class FakeBuf:
    local: torch.Tensor
    peer_ptrs: torch.Tensor

    @property
    def nbytes(self):
        return self.local.numel() * self.local.element_size()


class SharedHeap:
    """One rank's symmetric heap for the nvshmem backend in a CPU process: a file in shared memory mapped at the
    SAME virtual address in every rank's process (``base``), rank ``r``'s buffers in bytes ``[r * per_rank, (r + 1)
    * per_rank)`` of it. A peer pointer is then a plain address that every process can load from and store to, as
    NVSHMEM's are between the GPUs of a node, and the interpreter's atomics (real atomic instructions) work across
    processes. Allocation is by name in the backend's order, the same on every rank, into zeroed memory; the caller
    starts the first call only after every rank built its backend (a barrier), as NVSHMEM's collective allocation
    does."""

    PROT_RW, MAP_SHARED, MAP_PRIVATE_ANON, MAP_FIXED_NOREPLACE = 0x3, 0x01, 0x22, 0x100000

    @staticmethod
    def _mmap(base: int, size: int, flags: int, fd: int) -> int:
        """libc ``mmap(base, size, PROT_READ | PROT_WRITE, flags | MAP_FIXED_NOREPLACE, fd, 0)``: the address it
        returned (``base`` when the range was free)."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        got = libc.mmap(base, size, SharedHeap.PROT_RW, flags | SharedHeap.MAP_FIXED_NOREPLACE, fd, 0)
        return -1 if got is None or got == ctypes.c_void_p(-1).value else got

    def __init__(self, path: str, base: int, rank: int, world: int, per_rank: int):
        import ctypes
        import os

        self.ctx = FakeCtx(torch.device("cpu"), rank, world)
        self.base, self.rank, self.world, self.per_rank = base, rank, world, per_rank
        self.bufs = {}
        self._used = 0
        size = world * per_rank
        fd = os.open(path, os.O_RDWR)
        try:
            got = self._mmap(base, size, self.MAP_SHARED, fd)
        finally:
            os.close(fd)
        if got != base:  # (-1: the range is taken; another address: a kernel without MAP_FIXED_NOREPLACE)
            raise RuntimeError(f"rank {rank}: could not map the shared heap at {base:#x} (got {got}, errno "
                               f"{ctypes.get_errno()})")
        self._keep = (ctypes.c_char * size).from_address(base)  # the buffer the tensors view (never unmapped)

    @staticmethod
    def free(base: int, size: int) -> bool:
        """True when ``[base, base + size)`` is unmapped in this process (probed with an anonymous mapping)."""
        import ctypes

        got = SharedHeap._mmap(base, size, SharedHeap.MAP_PRIVATE_ANON, -1)
        if got == -1:
            return False
        libc = ctypes.CDLL(None)
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(got, size)
        return got == base

    def alloc(self, name, shape, dtype):
        nbytes = math.prod(int(d) for d in shape) * torch.empty(0, dtype=dtype).element_size()
        off = (self._used + 255) // 256 * 256
        if off + nbytes > self.per_rank:
            raise MemoryError(f"shared heap: {name} needs {nbytes} bytes, {self.per_rank - off} left")
        self._used = off + nbytes
        mine = self.rank * self.per_rank + off
        local = torch.frombuffer(self._keep, dtype=torch.uint8, count=nbytes, offset=mine).view(dtype).view(shape)
        peers = torch.tensor([self.base + p * self.per_rank + off for p in range(self.world)], dtype=torch.int64)
        self.bufs[name] = FakeBuf(local, peers)
        return self.bufs[name]

    @property
    def nbytes(self):
        return sum(b.nbytes for b in self.bufs.values())
