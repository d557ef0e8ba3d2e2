"""The launch glue of put_signal / cubin on CPU, against stand-ins for cuda.core and nvshmem4py.

Checks what reaches ``cuda.core.launch`` (grid, block, kernel, argument tuple, stream protocol),
that a cubin is loaded and ``library_init``-ed once per NVSHMEM context, that empty batches launch
nothing, and that buffers outside the (fake) symmetric heap are refused before any launch. The
real kernels run in tests/mpi/test_mpi_put_signal.py on the GPU.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from mxcomm.transport import NvshmemContext, bootstrap, cubin
from mxcomm.transport import put_signal as ps


class _Fakes:
    def __init__(self):
        self.launches, self.loads, self.inits, self.finals = [], [], [], []
        self.heap = []  # (lo, hi) address ranges that count as symmetric


def _install(monkeypatch, tmp_path):
    f = _Fakes()

    class ObjectCode:
        def __init__(self, data):
            self.data = data

        @staticmethod
        def from_cubin(data, name=""):
            f.loads.append((bytes(data), name))
            return ObjectCode(data)

        def get_kernel(self, name):
            return ("kernel", name, id(self))

    class LaunchConfig:
        def __init__(self, grid=None, block=None):
            self.grid, self.block = grid, block

    class Device:
        def __init__(self, idx=None):
            self.idx = idx

        def set_current(self):
            return None

    def launch(stream, config, kernel, *args):
        f.launches.append({"stream": stream.__cuda_stream__(), "grid": config.grid, "block": config.block,
                           "kernel": kernel[1], "args": args})

    cuda_pkg = types.ModuleType("cuda")
    core = types.ModuleType("cuda.core")
    core.ObjectCode, core.LaunchConfig, core.Device, core.launch = ObjectCode, LaunchConfig, Device, launch
    cuda_pkg.core = core

    class NvshmemKernelObject:
        def __init__(self, obj):
            self.obj = obj

        @staticmethod
        def from_obj(obj):
            return NvshmemKernelObject(obj)

    nv_pkg = types.ModuleType("nvshmem")
    nv_core = types.ModuleType("nvshmem.core")
    nv_core.NvshmemKernelObject = NvshmemKernelObject
    nv_core.library_init = lambda k: f.inits.append(k)
    nv_core.library_finalize = lambda k: f.finals.append(k)
    nv_bind = types.ModuleType("nvshmem.bindings")
    nv_bind.ptr = lambda addr, pe: addr if any(lo <= addr < hi for lo, hi in f.heap) else 0
    nv_pkg.core, nv_pkg.bindings = nv_core, nv_bind
    for name, mod in (("cuda", cuda_pkg), ("cuda.core", core), ("nvshmem", nv_pkg), ("nvshmem.core", nv_core),
                      ("nvshmem.bindings", nv_bind)):
        monkeypatch.setitem(sys.modules, name, mod)

    fake_cubin = tmp_path / "fake.cubin"
    fake_cubin.write_bytes(b"\x7fELF fake cubin")
    monkeypatch.setattr(cubin, "arch_for", lambda device=None: "sm_90")
    monkeypatch.setattr(cubin, "build_cubin", lambda sources=None, *, arch, name="x", **kw:
                        cubin.CubinBuild(fake_cubin, "k", True))
    monkeypatch.setattr(cubin, "_MODULES", {})
    ctx = NvshmemContext(rank=1, world=3, device=torch.device("cpu"), route="uid", local_peers=(0, 1, 2))
    monkeypatch.setattr(bootstrap._REGISTRY, "ctx", ctx)
    return f, ctx


def _sym(f, t):
    f.heap.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    return t


class _Stream:
    cuda_stream = 0xABC


def test_put_signal_launch(monkeypatch, tmp_path):
    f, ctx = _install(monkeypatch, tmp_path)
    dst = _sym(f, torch.zeros(4096, dtype=torch.uint8))
    src = _sym(f, torch.zeros(1024, dtype=torch.uint8))
    sig = _sym(f, torch.zeros(3, dtype=torch.int64))
    err = torch.zeros(1, dtype=torch.int64)
    batch = ps.PutBatch.from_lists([0, 100, 2000], [0, 10, 20], [5, 0, 900], [0, 2, 0], "cpu")
    ps.put_signal(dst, src, batch, sig, ctx.rank, err, chunks=4, threads=128, stream=_Stream())
    (call,) = f.launches
    assert call["kernel"] == "mx_put_signal" and call["grid"] == 12 and call["block"] == 128  # a block per piece
    assert call["stream"] == (0, 0xABC)
    assert [int(a) for a in call["args"]] == [int(a) for a in ps.put_args(dst, src, batch, sig, ctx.rank, 3, err,
                                                                          chunks=4)]
    assert len(f.loads) == 1 and len(f.inits) == 1 and f.loads[0][0] == b"\x7fELF fake cubin"
    # Second call: same module, no new load / library_init.
    ps.put_signal(dst, src, batch, sig, ctx.rank, err, stream=_Stream())
    assert len(f.launches) == 2 and f.launches[1]["grid"] == 3 and f.launches[1]["block"] == 256
    assert len(f.loads) == 1 and len(f.inits) == 1
    # A block budget bounds the grid; put() launches the same kernel with a null signal pointer.
    ps.put(dst, src, batch, err, chunks=4, blocks=5, stream=_Stream())
    plain = f.launches[2]
    assert plain["kernel"] == "mx_put_signal" and plain["grid"] == 5
    assert [int(a) for a in plain["args"]] == [int(a) for a in ps.put_args(dst, src, batch, None, None, 3, err,
                                                                           chunks=4)]
    assert int(plain["args"][10]) == 0
    # Empty batch: validated, nothing launched.
    ps.put_signal(dst, src, ps.PutBatch.from_lists([], [], [], [], "cpu"), sig, 0, err, stream=_Stream())
    assert len(f.launches) == 3


def test_wait_and_quiet_launch(monkeypatch, tmp_path):
    f, ctx = _install(monkeypatch, tmp_path)
    sig = _sym(f, torch.zeros(200, dtype=torch.int64))
    idx = torch.arange(130, dtype=torch.int32)
    ep = torch.tensor([3])
    err = torch.zeros(1, dtype=torch.int64)
    ps.wait_signals(sig, idx, ep, 12, err, timeout_ns=5_000_000, stream=_Stream())
    ps.wait_signals(sig, idx[:0], ep, 12, err, timeout_ns=5_000_000, stream=_Stream())  # nothing to wait for
    ps.quiet(stream=_Stream())
    assert [c["kernel"] for c in f.launches] == ["mx_wait_signals", "mx_quiet"]
    w, q = f.launches
    assert w["grid"] == 2 and w["block"] == 128
    assert [int(a) for a in w["args"]] == [int(a) for a in ps.wait_args(sig, idx, ep, 12, err, 5_000_000)]
    assert q["grid"] == 1 and q["block"] == 1 and q["args"] == ()
    assert len(f.inits) == 1


def test_non_symmetric_buffers_are_refused_before_launch(monkeypatch, tmp_path):
    f, ctx = _install(monkeypatch, tmp_path)
    dst = _sym(f, torch.zeros(64, dtype=torch.uint8))
    src = _sym(f, torch.zeros(64, dtype=torch.uint8))
    sig = _sym(f, torch.zeros(3, dtype=torch.int64))
    err = torch.zeros(1, dtype=torch.int64)
    batch = ps.PutBatch.from_lists([0], [0], [8], [0], "cpu")
    plain = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dst .*symmetric heap"):
        ps.put_signal(plain, src, batch, sig, 0, err, stream=_Stream())
    with pytest.raises(ValueError, match="signals .*symmetric heap"):
        ps.put_signal(dst, src, batch, torch.zeros(3, dtype=torch.int64), 0, err, stream=_Stream())
    with pytest.raises(ValueError, match="signals .*symmetric heap"):
        ps.wait_signals(torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), torch.tensor([1]), 1,
                        err, timeout_ns=10, stream=_Stream())
    big = torch.zeros(128, dtype=torch.uint8)
    f.heap.append((big.data_ptr(), big.data_ptr() + 64))  # only the first half in the heap
    with pytest.raises(ValueError, match="src .*symmetric heap"):
        ps.put_signal(dst, big, batch, sig, 0, err, stream=_Stream())
    assert f.launches == [] and f.inits == []


def test_module_reloads_for_a_new_context_and_release(monkeypatch, tmp_path):
    f, ctx = _install(monkeypatch, tmp_path)
    m1 = cubin.nvshmem_module(ps.KERNEL_NAMES)
    assert cubin.nvshmem_module(["mx_quiet"]) is m1 and len(f.inits) == 1
    assert m1.kernel("mx_put_signal")[1] == "mx_put_signal"
    with pytest.raises(KeyError, match="no kernel"):
        m1.kernel("nope")
    new_ctx = NvshmemContext(rank=1, world=3, device=torch.device("cpu"), route="uid", local_peers=(0, 1, 2))
    monkeypatch.setattr(bootstrap._REGISTRY, "ctx", new_ctx)  # NVSHMEM finalised and started again
    m2 = cubin.nvshmem_module(ps.KERNEL_NAMES)
    assert m2 is not m1 and m2.ctx is new_ctx and len(f.inits) == 2
    cubin.release_modules()
    assert f.finals == [m2.nvshmem_obj]  # only the live context's module
    assert cubin.nvshmem_module(["mx_quiet"]) is not m2 and len(f.inits) == 3
