"""SymmetricHeap and finalize bookkeeping on CPU, against a stand-in for nvshmem.core.

The stand-in allocates CPU tensors (filled with garbage, to check zeroing), hands out a separate
"peer memory" tensor for each reachable peer, and raises its NvshmemError for the others, as
nvshmem4py's get_peer_tensor does when nvshmem_ptr returns NULL. The real thing runs in
test_nvshmem_ranks.py on the GPU.
"""
import sys
import types
from dataclasses import dataclass

import pytest
import torch

import mxcomm.transport as tp
from mxcomm.transport import bootstrap


class _FakeCore(types.ModuleType):
    class NvshmemError(Exception):
        def __init__(self, msg):
            super().__init__(msg)
            self.msg = msg

    def __init__(self, local_peers, rank, capacity=1 << 20):
        super().__init__("nvshmem.core")
        self.local_peers, self.rank, self.capacity = set(local_peers), rank, capacity
        self.allocated, self.freed, self.finalized, self.used = [], [], 0, 0
        self.peer_mem = {}  # (data_ptr, peer) -> tensor standing for the peer's copy

    def tensor(self, shape, dtype):
        n = shape[0]
        if self.used + n > self.capacity:
            raise self.NvshmemError(f"Failed to allocate memory of bytes {n}")
        self.used += n
        t = torch.randint(1, 255, shape, dtype=torch.int16).to(dtype)  # garbage, never zero
        self.allocated.append(t)
        return t

    def get_peer_tensor(self, t, peer):
        if peer not in self.local_peers:
            raise self.NvshmemError("Failed to retrieve peer buffer")
        return self.peer_mem.setdefault((t.data_ptr(), peer), torch.zeros_like(t))

    def free_tensor(self, t):
        self.freed.append(t)

    def finalize(self):
        self.finalized += 1


_BARRIERS = []


@dataclass(frozen=True)
class _CpuContext(tp.NvshmemContext):
    def barrier(self, stream=None):
        _BARRIERS.append(self.rank)


@pytest.fixture
def fake(monkeypatch):
    world, rank, local = 4, 1, (0, 1)
    core = _FakeCore(local, rank)
    pkg = types.ModuleType("nvshmem")
    pkg.core = core
    monkeypatch.setitem(sys.modules, "nvshmem", pkg)
    monkeypatch.setitem(sys.modules, "nvshmem.core", core)
    ctx = _CpuContext(rank=rank, world=world, device=torch.device("cpu"), route="uid", local_peers=local)
    monkeypatch.setattr(bootstrap, "_REGISTRY", bootstrap._Registry(ctx=ctx))
    _BARRIERS.clear()
    return core, ctx


def test_alloc_peers_pointers_and_zeroing(fake):
    core, ctx = fake
    heap = tp.SymmetricHeap()
    assert heap.ctx is ctx and bootstrap._REGISTRY.heaps == [heap]
    buf = heap.alloc("rows", (ctx.world, 8), torch.bfloat16)
    assert buf.local.shape == (4, 8) and buf.local.dtype == torch.bfloat16
    assert bool((buf.local == 0).all())  # garbage from the allocator was zeroed
    assert _BARRIERS == [ctx.rank]  # ... and fenced before anyone may write
    assert buf.has_peer_pointer == (True, True, False, False)
    assert buf.peers[1] is buf.local and buf.peers[2] is None and buf.peers[3] is None
    assert buf.peer(0).data_ptr() == core.peer_mem[(buf._raw.data_ptr(), 0)].data_ptr()
    with pytest.raises(tp.TransportError, match="rank 3 has no peer pointer"):
        buf.peer(3)
    assert buf.peer_ptrs.dtype == torch.int64 and buf.peer_ptrs.device == ctx.device
    assert buf.peer_ptrs.tolist() == [buf.peers[0].data_ptr(), buf.local.data_ptr(), 0, 0]
    # writes through the typed view land in the raw allocation that free_tensor will get
    buf.local[1, 2] = 3.0
    assert buf._raw.view(torch.bfloat16)[1 * 8 + 2].item() == 3.0


def test_alloc_once_report_and_free(fake):
    core, ctx = fake
    heap = tp.SymmetricHeap(ctx)
    specs = [tp.BufferSpec("a", (3, 5), torch.float32), tp.BufferSpec("f", (4,), torch.int64),
             tp.BufferSpec("q", (2, 64), torch.float8_e4m3fn)]
    bufs = heap.alloc_all(specs)
    assert list(heap) == ["a", "f", "q"] and len(heap) == 3 and "f" in heap and "z" not in heap
    assert heap.report() == {s.name: s.nbytes for s in specs}
    assert heap.nbytes == tp.SymmetricHeap.plan_bytes(specs) == 60 + 32 + 128
    assert heap.alloc("a", (3, 5), torch.float32) is bufs["a"] and len(core.allocated) == 3
    with pytest.raises(ValueError, match="already allocated"):
        heap.alloc("a", (3, 6), torch.float32)
    with pytest.raises(ValueError):
        heap.alloc("a", (3, 5), torch.float16)
    with pytest.raises(KeyError, match="'nope'"):
        heap["nope"]
    assert heap["q"] is bufs["q"]
    heap.free()
    assert [t.data_ptr() for t in core.freed] == [bufs[n]._raw.data_ptr() for n in ("q", "f", "a")]  # newest first
    assert not heap.is_open and len(heap) == 0 and bootstrap._REGISTRY.heaps == []
    heap.free()  # idempotent
    assert len(core.freed) == 3
    with pytest.raises(RuntimeError, match="freed"):
        heap.alloc("b", (1,), torch.int32)


def test_out_of_heap_is_a_clear_error(fake, monkeypatch):
    core, ctx = fake
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1M")
    heap = tp.SymmetricHeap(ctx)
    heap.alloc("small", (1024,), torch.uint8)
    with pytest.raises(tp.TransportError) as ei:
        heap.alloc("huge", (1 << 20,), torch.uint8)
    msg = str(ei.value)
    assert "NVSHMEM_SYMMETRIC_SIZE=1M" in msg and "launcher_env" in msg and "1024 bytes already" in msg
    assert "huge" not in heap


def test_finalize_frees_every_open_heap(fake):
    core, ctx = fake
    h1, h2 = tp.SymmetricHeap(ctx), tp.SymmetricHeap(ctx)
    a = h1.alloc("x", (2,), torch.int64)
    b = h2.alloc("y", (3,), torch.int64)
    h3 = tp.SymmetricHeap(ctx)
    h3.free()
    assert tp.is_initialized()
    tp.finalize()
    assert [t.data_ptr() for t in core.freed] == [b._raw.data_ptr(), a._raw.data_ptr()]
    assert core.finalized == 1 and not h1.is_open and not h2.is_open
    assert not tp.is_initialized() and bootstrap._REGISTRY.heaps == []
    tp.finalize()  # no-op now
    assert core.finalized == 1


def test_second_init_returns_context_or_refuses(fake):
    core, ctx = fake
    assert tp.init_nvshmem(uid=b"\0" * 128, rank=ctx.rank, nranks=ctx.world) is ctx
    with pytest.raises(RuntimeError, match="already initialised"):
        tp.init_nvshmem(uid=b"\0" * 128, rank=0, nranks=ctx.world)
