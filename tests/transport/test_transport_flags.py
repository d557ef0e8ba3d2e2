"""Flags and bounded waits.

* Under Triton's CPU interpreter (``flags`` then reads the host clock instead of ``%globaltimer``):
  signal/wait with epochs, timeouts recording the peer, PeerTimeout from the error word.
* The GPU build (inline PTX) compiled for sm_90 on the CPU machine (no launch): the flag
  accesses are release/acquire at system scope and the timer is read.
Cross-process signalling runs in test_nvshmem_ranks.py on the GPU.
"""
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def iflags():
    """``mxcomm.transport.flags`` built for the interpreter, plus test kernels; restored afterwards."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import mxcomm.transport.flags as flags

        if not flags.INTERPRETED:
            flags = importlib.reload(flags)
        assert flags.INTERPRETED
        yield flags, _kernels(flags)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
        import mxcomm.transport.flags as flags

        if flags.INTERPRETED != flags._interpreting():
            importlib.reload(flags)


_F = None  # the interpreted flags module, as a global: the interpreter resolves names in module globals


def _kernels(flags):
    import triton
    import triton.language as tl

    global _F
    _F = flags

    @triton.jit
    def signal_k(flag_ptr, value):
        p = tl.program_id(0)
        _F.signal_peer(flag_ptr + p, value)

    @triton.jit
    def wait_k(flag_ptr, err_ptr, ok_ptr, data_ptr, out_ptr, expected, timeout, N: tl.constexpr):
        # program p waits for flag[p] (from "peer" p); reads the peer's row only if it arrived
        p = tl.program_id(0)
        ok = _F.wait_flag_geq(flag_ptr + p, expected, _F.deadline_after(timeout), err_ptr, p)
        tl.store(ok_ptr + p, ok.to(tl.int32))
        offs = tl.arange(0, N)
        row = tl.load(data_ptr + p * N + offs, mask=(offs < N) & ok, other=-1.0)
        tl.store(out_ptr + p * N + offs, row)

    return signal_k, wait_k


def _run_wait(wait_k, flags_t, expected, timeout_s, timeout_ns):
    n = flags_t.numel()
    err = torch.zeros(1, dtype=torch.int64)
    ok = torch.full((n,), -1, dtype=torch.int32)
    data = torch.randn(n, 16)
    out = torch.empty_like(data)
    t0 = time.monotonic()
    wait_k[(n,)](flags_t, err, ok, data, out, expected, timeout_ns(timeout_s), N=16)
    return err, ok, data, out, time.monotonic() - t0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_signal_then_wait(iflags, dtype):
    flags, (signal_k, wait_k) = iflags
    n = 3
    f = torch.zeros(n, dtype=dtype)
    signal_k[(n,)](f, 5)
    assert f.tolist() == [5] * n
    err, ok, data, out, _ = _run_wait(wait_k, f, 5, 5.0, flags.timeout_ns)
    assert ok.tolist() == [1] * n and err.item() == 0
    assert torch.equal(out, data)
    import mxcomm.transport as tp

    tp.check_errors(err)
    # an older epoch is already satisfied: flags are never reset
    err, ok, _, _, _ = _run_wait(wait_k, f, 3, 5.0, flags.timeout_ns)
    assert ok.tolist() == [1] * n and err.item() == 0


def test_wait_times_out_and_names_peer(iflags):
    import mxcomm.transport as tp

    flags, (signal_k, wait_k) = iflags
    n = 4
    f = torch.full((n,), 6, dtype=torch.int64)  # everyone at epoch 6 ...
    silent = [1, 2]
    for p in silent:
        f[p] = 5  # ... except peers 1 and 2, one epoch behind
    timeout_s = 0.05
    err, ok, data, out, elapsed = _run_wait(wait_k, f, 6, timeout_s, flags.timeout_ns)
    assert ok.tolist() == [0 if p in silent else 1 for p in range(n)]
    # the interpreter runs programs one after another: the first silent peer's wait times out and records it; the
    # next wait sees the error word set and gives up at once, recording nothing (concurrent waits on a GPU time out
    # together, and atomic_max keeps the largest peer)
    assert tp.decode_error_word(err.item()) == (tp.TIMEOUT_CODE, silent[0])
    assert elapsed >= timeout_s
    for p in range(n):
        want = torch.full((16,), -1.0) if p in silent else data[p]
        assert torch.equal(out[p], want)
    with pytest.raises(tp.PeerTimeout) as ei:
        tp.check_errors(err, what="rows", rank=0)
    assert ei.value.peer == silent[0] and f"peer {silent[0]}" in str(ei.value)


def test_wait_gives_up_at_once_when_an_earlier_wait_timed_out(iflags):
    """A call's later waits end as soon as one wait has recorded a timeout: the call fails after one timeout_s, and
    the error word keeps naming the peer that did not arrive."""
    import mxcomm.transport as tp

    flags, (signal_k, wait_k) = iflags
    f = torch.zeros(3, dtype=torch.int64)  # nobody signalled
    err = torch.full((1,), tp.error_word(tp.TIMEOUT_CODE, 7), dtype=torch.int64)  # an earlier wait timed out on 7
    ok = torch.full((3,), -1, dtype=torch.int32)
    data = torch.randn(3, 16)
    out = torch.empty_like(data)
    t0 = time.monotonic()
    wait_k[(3,)](f, err, ok, data, out, 1, flags.timeout_ns(30.0), N=16)
    assert time.monotonic() - t0 < 10.0  # not 3 x 30 s
    assert ok.tolist() == [0, 0, 0]
    assert tp.decode_error_word(err.item()) == (tp.TIMEOUT_CODE, 7)


def test_timeout_ns_validation(iflags):
    flags, _ = iflags
    assert flags.timeout_ns(1.5) == 1_500_000_000 and flags.timeout_ns(2) == 2_000_000_000
    for bad, exc in [(0, ValueError), (-1.0, ValueError), (1e7, ValueError), ("1", TypeError), (True, TypeError)]:
        with pytest.raises(exc):
            flags.timeout_ns(bad)


_COMPILE = r'''
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import mxcomm.transport.flags as flags
assert not flags.INTERPRETED

@triton.jit
def k(flag, peer_flag, err, epoch, timeout, peer):
    flags.signal_peer(peer_flag, epoch)
    flags.wait_flag_geq(flag, epoch, flags.deadline_after(timeout), err, peer)

sig = {"flag": "*i64", "peer_flag": "*i64", "err": "*i64", "epoch": "i64", "timeout": "i64", "peer": "i32"}
ptx = triton.compile(ASTSource(fn=k, signature=sig, constexprs={}), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(ptx)
'''


def test_gpu_build_compiles_for_sm90(tmp_path):
    import triton.backends

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("triton has no nvidia backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    script = tmp_path / "compile_flags.py"  # @triton.jit needs its source in a file
    script.write_text(_COMPILE)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = r.stdout
    assert "%globaltimer" in ptx
    assert "atom.global.sys.release.exch.b64" in ptx  # signal_peer
    assert "ld.global.sys.acquire.b64" in ptx  # load_acquire (Triton turns the add-of-0 into an acquire load)
    assert "atom.global.gpu.relaxed.max.s64" in ptx  # error word
