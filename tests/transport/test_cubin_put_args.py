"""CPU tests of the put-with-signal Python wrappers: argument checks (before any launch), the
argument tuples against the C kernel signatures in csrc/put_signal.cu, peer selection."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mxcomm.transport import NvshmemContext, cubin, is_initialized
from mxcomm.transport import put_signal as ps

# C parameter type -> numpy scalar type cuda.core must receive.
_C_TO_NP = {"int": np.int32, "int64_t": np.int64, "uint64_t": np.uint64}


def _c_params(kernel: str) -> list:
    src = (cubin.csrc_dir() / "put_signal.cu").read_text()
    m = re.search(rf'extern "C" __global__ void {kernel}\((.*?)\)\s*\{{', src, re.S)
    assert m, f"{kernel} not found in csrc/put_signal.cu"
    types = []
    for p in m.group(1).split(","):
        p = " ".join(p.split())
        if "*" in p:
            types.append(np.uint64)
        else:
            types.append(_C_TO_NP[p.rsplit(" ", 1)[0].replace("const ", "")])
    return types


def _batch(n=3, dev="cpu"):
    g = torch.Generator().manual_seed(n)
    return ps.PutBatch(
        dst_offsets=torch.randint(0, 100, (n,), generator=g), src_offsets=torch.randint(0, 100, (n,), generator=g),
        nbytes=torch.randint(0, 50, (n,), generator=g), pes=torch.randint(0, 4, (n,), generator=g).int(),
    ) if dev == "cpu" else None


def _bufs():
    dst = torch.zeros(1000, dtype=torch.uint8)
    src = torch.zeros(250, dtype=torch.float32)
    sig = torch.zeros(4, dtype=torch.int64)
    err = torch.zeros(1, dtype=torch.int64)
    return dst, src, sig, err


def test_put_args_match_the_kernel_signature():
    dst, src, sig, err = _bufs()
    b = _batch()
    args = ps.put_args(dst, src, b, sig, 2, 4, err, chunks=5)
    assert [type(a) for a in args] == _c_params("mx_put_signal")
    assert int(args[0]) == dst.data_ptr() and int(args[1]) == 1000
    assert int(args[2]) == src.data_ptr() and int(args[3]) == 1000  # capacities in bytes
    assert [int(a) for a in args[4:8]] == [b.dst_offsets.data_ptr(), b.src_offsets.data_ptr(), b.nbytes.data_ptr(),
                                           b.pes.data_ptr()]
    assert int(args[8]) == 3 and int(args[9]) == 5 and int(args[10]) == sig.data_ptr() + 16 and int(args[11]) == 4
    assert int(args[12]) == err.data_ptr()
    # without signal words (put): a null signal pointer, the rest the same
    plain = ps.put_args(dst, src, b, None, None, 4, err)
    assert [type(a) for a in plain] == _c_params("mx_put_signal")
    assert int(plain[9]) == 1 and int(plain[10]) == 0
    assert [int(a) for a in plain[:9]] == [int(a) for a in args[:9]] and int(plain[12]) == err.data_ptr()
    with pytest.raises(ValueError, match="signal_index given without signal words"):
        ps.put_args(dst, src, b, None, 0, 4, err)


def test_batch_entries_are_views_of_a_range():
    b = ps.PutBatch.from_lists([0, 10, 20, 30], [1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3], "cpu")
    mid = b.entries(1, 3)
    assert mid.n == 2 and mid.dst_offsets.tolist() == [10, 20] and mid.pes.tolist() == [1, 2]
    assert mid.nbytes.data_ptr() == b.nbytes.data_ptr() + 8  # a view, no copy
    assert b.entries(3, 99).n == 1 and b.entries(5, 9).n == 0 and b.entries(2, 1).n == 0 and b.entries(-4, 1).n == 1


def test_put_blocks_bound_the_grid():
    assert ps.put_blocks(3, 4, None) == 12  # one block per piece
    assert ps.put_blocks(3, 4, 5) == 5 and ps.put_blocks(3, 4, 64) == 12 and ps.put_blocks(0, 4, 8) == 0
    assert ps.put_blocks(2**30, 4, None) == 2**31 - 1  # the grid's limit
    with pytest.raises(ValueError, match="blocks"):
        ps.put_blocks(3, 4, 0)
    with pytest.raises(TypeError, match="blocks"):
        ps.put_blocks(3, 4, 2.0)


def test_wait_args_match_the_kernel_signature():
    sig = torch.zeros(5, dtype=torch.int64)
    idx = torch.tensor([0, 3], dtype=torch.int32)
    ep = torch.tensor([7])
    err = torch.zeros(1, dtype=torch.int64)
    args = ps.wait_args(sig, idx, ep, 12, err, 10**9)
    assert [type(a) for a in args] == _c_params("mx_wait_signals")
    assert [int(a) for a in args] == [sig.data_ptr(), 5, idx.data_ptr(), 2, ep.data_ptr(), 12, 10**9, err.data_ptr()]


def test_error_constants_match_the_source():
    from mxcomm.transport.errors import ERR_CODE_SHIFT, TIMEOUT_CODE

    src = (cubin.csrc_dir() / "put_signal.cu").read_text()
    consts = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define MX_(\w+) (\d+)", src)}
    assert consts["TIMEOUT_CODE"] == TIMEOUT_CODE
    assert consts["BAD_ENTRY_CODE"] == ps.BAD_ENTRY_CODE
    assert consts["ERR_CODE_SHIFT"] == ERR_CODE_SHIFT


def test_kernel_names_exist_in_the_source():
    src = (cubin.csrc_dir() / "put_signal.cu").read_text()
    for name in ps.KERNEL_NAMES:
        assert f'extern "C" __global__ void {name}(' in src


@pytest.mark.parametrize("field,value,exc,needle", [
    ("dst_offsets", torch.zeros(3, dtype=torch.int32), TypeError, "torch.int64"),
    ("pes", torch.zeros(3, dtype=torch.int64), TypeError, "torch.int32"),
    ("nbytes", torch.zeros(3, 1, dtype=torch.int64), ValueError, "1-D"),
    ("src_offsets", torch.zeros(4, dtype=torch.int64), ValueError, "entries"),
    ("nbytes", torch.zeros(6, dtype=torch.int64)[::2], ValueError, "contiguous"),
    ("pes", [0, 1, 2], TypeError, "torch.Tensor"),
    ("nbytes", torch.zeros(3, dtype=torch.int64, device="meta"), ValueError, "meta"),
])
def test_put_batch_rejects_bad_fields(field, value, exc, needle):
    good = dict(dst_offsets=torch.zeros(3, dtype=torch.int64), src_offsets=torch.zeros(3, dtype=torch.int64),
                nbytes=torch.zeros(3, dtype=torch.int64), pes=torch.zeros(3, dtype=torch.int32))
    good[field] = value
    with pytest.raises(exc, match=needle):
        ps.PutBatch(**good)


def test_put_batch_from_lists():
    b = ps.PutBatch.from_lists([1, 2], [3, 4], [5, 0], [1, 0], "cpu")
    assert b.n == 2 and b.device == torch.device("cpu")
    assert b.nbytes.tolist() == [5, 0] and b.pes.dtype == torch.int32
    with pytest.raises(ValueError, match="length"):
        ps.PutBatch.from_lists([1], [3, 4], [5, 0], [1, 0], "cpu")
    empty = ps.PutBatch.from_lists([], [], [], [], "cpu")
    assert empty.n == 0


def test_put_args_rejects_bad_arguments():
    dst, src, sig, err = _bufs()
    b = _batch()
    cases = [
        (lambda: ps.put_args(dst.tolist(), src, b, sig, 0, 4, err), TypeError, "dst must be a torch.Tensor"),
        (lambda: ps.put_args(dst, src, (1, 2), sig, 0, 4, err), TypeError, "PutBatch"),
        (lambda: ps.put_args(dst, src, b, sig.int(), 0, 4, err), TypeError, "signals must be torch.int64"),
        (lambda: ps.put_args(dst, src, b, sig, 4, 4, err), ValueError, "signal_index"),
        (lambda: ps.put_args(dst, src, b, sig, -1, 4, err), ValueError, "signal_index"),
        (lambda: ps.put_args(dst, src, b, sig, True, 4, err), TypeError, "signal_index"),
        (lambda: ps.put_args(dst, src, b, sig, 0, 0, err), ValueError, "n_pes"),
        (lambda: ps.put_args(dst, src, b, sig, 0, 4, torch.zeros(2, dtype=torch.int64)), ValueError, "one int64"),
        (lambda: ps.put_args(dst, src, b, sig, 0, 4, err.int()), TypeError, "err"),
        (lambda: ps.put_args(dst[::2], src, b, sig, 0, 4, err), ValueError, "contiguous"),
        (lambda: ps.put_args(dst, src.to("meta"), b, sig, 0, 4, err), ValueError, "src is on meta"),
    ]
    for fn, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            fn()


def test_wait_args_rejects_bad_arguments():
    sig = torch.zeros(5, dtype=torch.int64)
    idx = torch.tensor([0, 3], dtype=torch.int32)
    ep = torch.tensor([1])
    err = torch.zeros(1, dtype=torch.int64)
    cases = [
        (lambda: ps.wait_args(sig, idx.long(), ep, 1, err, 10), TypeError, "indices must be torch.int32"),
        (lambda: ps.wait_args(sig.view(1, 5), idx, ep, 1, err, 10), ValueError, "1-D"),
        (lambda: ps.wait_args(sig, idx, torch.tensor([1, 2]), 1, err, 10), ValueError, "one int64"),
        (lambda: ps.wait_args(sig, idx, ep, 0, err, 10), ValueError, "per_epoch"),
        (lambda: ps.wait_args(sig, idx, ep, 1, err, 0), ValueError, "timeout_ns"),
        (lambda: ps.wait_args(sig, idx, ep, 1.5, err, 10), TypeError, "per_epoch"),
        (lambda: ps.wait_args(sig, idx.to("meta"), ep, 1, err, 10), ValueError, "indices is on meta"),
    ]
    for fn, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            fn()


def test_launchers_check_arguments_then_need_nvshmem():
    dst, src, sig, err = _bufs()
    b = _batch()
    with pytest.raises(ValueError, match="chunks"):
        ps.put_signal(dst, src, b, sig, 0, err, chunks=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        ps.put_signal(dst, src, b, sig, 0, err, threads=100)
    with pytest.raises(ValueError, match="blocks"):
        ps.put(dst, src, b, err, blocks=0)
    with pytest.raises(TypeError, match="needs signal words"):
        ps.put_signal(dst, src, b, None, None, err)
    with pytest.raises(TypeError, match="indices"):
        ps.wait_signals(sig, torch.zeros(1, dtype=torch.int64), torch.tensor([1]), 1, err, timeout_ns=10)
    assert not is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        ps.put_signal(dst, src, b, sig, 0, err)
    with pytest.raises(RuntimeError, match="not initialised"):
        ps.put(dst, src, b, err)
    with pytest.raises(RuntimeError, match="not initialised"):
        ps.wait_signals(sig, torch.zeros(1, dtype=torch.int32), torch.tensor([1]), 1, err, timeout_ns=10)


def test_signals_per_call():
    assert ps.signals_per_call(3, 4) == 12
    assert ps.signals_per_call(0, 4) == 0
    with pytest.raises(ValueError, match="chunks"):
        ps.signals_per_call(1, 0)
    with pytest.raises(TypeError, match="entries_for_pe"):
        ps.signals_per_call(1.0, 2)


def test_put_path_peers():
    ctx = NvshmemContext(rank=1, world=4, device=torch.device("cpu"), route="uid", local_peers=(0, 1))
    assert ps.put_path_peers(ctx) == (2, 3)
    assert ps.put_path_peers(ctx, force_remote=True) == (0, 2, 3)
    one_node = NvshmemContext(rank=0, world=2, device=torch.device("cpu"), route="uid", local_peers=(0, 1))
    assert ps.put_path_peers(one_node) == ()
    assert ps.put_path_peers(one_node, force_remote=True) == (1,)
    with pytest.raises(TypeError, match="force_remote"):
        ps.put_path_peers(ctx, force_remote=1)
