"""mxcomm.kernels.launch.fast_kernel: the same launches as ``kernel[grid](...)``.

Without a GPU the kernels are the interpreter's and the wrapper hands every launch to it (the results must equal the
plain launch's). With a GPU (``gpu`` tests): the compiled kernel it picks is the one the plain launch picks, across
arguments whose specialization changes (ints equal to 1 / divisible by 16 / neither, pointers 16-byte aligned or not,
constexprs, launch options), the fast path is taken from the second launch of a specialization on, and launch hooks,
callable grids and CUDA graph capture behave as with the plain launch.
"""
import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from mxcomm.kernels.launch import FastKernel, cdiv, fast_kernel, next_pow2

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _add_body(x_ptr, out_ptr, n, a, BLOCK: tl.constexpr, TWICE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0) + a
    if TWICE:
        v = v * 2
    tl.store(out_ptr + offs, v, mask=m)


def _jit(fn):
    """A JITFunction on a GPU (even if an earlier test module left TRITON_INTERPRET=1 set), else the interpreter's."""
    return JITFunction(fn) if CUDA else triton.jit(fn)


def _cases():
    """(x, n, a, TWICE) launches whose specializations differ: a = 1, 16, 17; x aligned and at a 4-byte offset."""
    base = torch.arange(70, dtype=torch.int32, device=DEV)
    out = []
    for a in (1, 16, 17):
        for x in (base[:64], base[1:65]):  # data_ptr 16-byte aligned, then not
            out.append((x, 64, a, False))
    out.append((base[:48], 48, 16, True))
    return out


def _run(launch, x, n, a, twice, grid=None):
    out = torch.full((64,), -1, dtype=torch.int32, device=DEV)
    k = launch[grid or (triton.cdiv(n, 32),)](x, out, n, a, BLOCK=32, TWICE=twice)
    return out, k


def test_host_grid_helpers_match_triton():
    """cdiv / next_pow2 compute what triton.cdiv / triton.next_power_of_2 do for grid sizes, and next_pow2 gives 1
    (not 2) for 0 and 1 (a tile of one)."""
    for n in range(1, 2050):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 32, 128):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert next_pow2(0) == 1 and next_pow2(1) == 1 and cdiv(0, 32) == 0


def test_fast_kernel_is_one_wrapper_per_function():
    fn = _jit(_add_body)
    k = fast_kernel(fn)
    assert isinstance(k, FastKernel) and k.fn is fn
    assert fast_kernel(fn) is k and fast_kernel(k) is k


@pytest.mark.skipif(CUDA, reason="the interpreter's delegation (a GPU runs the gpu tests)")
def test_interpreter_launch_delegates_with_the_same_results():
    plain, fast = _jit(_add_body), fast_kernel(_jit(_add_body))
    for x, n, a, twice in _cases():
        got, _ = _run(fast, x, n, a, twice)
        want, _ = _run(plain, x, n, a, twice)
        assert torch.equal(got, want)
        assert torch.equal(got[:n], (x[:n] + a) * (2 if twice else 1))
    got, _ = _run(fast, *_cases()[0], grid=lambda meta: (64 // meta["BLOCK"],))  # the interpreter: constexprs only
    assert torch.equal(got, _run(plain, *_cases()[0])[0])
    assert fast.fast_launches == 0 and fast.slow_launches == len(_cases()) + 1


@pytest.mark.gpu
def test_fast_path_picks_the_plain_launch_kernel():
    plain = _jit(_add_body)
    fast = fast_kernel(plain)
    for i, (x, n, a, twice) in enumerate(_cases()):
        slow_before = fast.slow_launches
        got1, k1 = _run(fast, x, n, a, twice)  # first launch of this specialization: Triton's (compiles)
        assert fast.slow_launches == slow_before + 1, f"case {i}: a new specialization must go through Triton"
        fast_before = fast.fast_launches
        got2, k2 = _run(fast, x, n, a, twice)
        assert fast.fast_launches == fast_before + 1, f"case {i}: the second launch must take the fast path"
        want, kp = _run(plain, x, n, a, twice)
        assert k2 is kp and k1 is kp, f"case {i}: another compiled kernel than the plain launch's"
        assert torch.equal(got1, want) and torch.equal(got2, want)
        assert torch.equal(want[:n], (x[:n] + a) * (2 if twice else 1))
    kernels = {id(_run(fast, *c)[1]) for c in _cases()}
    assert len(kernels) == len(_cases())  # every case is its own specialization
    assert len(fast._direct) == len(_cases()) and all(fast._direct.values())  # through the compiled launch each time


@pytest.mark.gpu
def test_launch_options_and_callable_grid():
    fast = fast_kernel(_jit(_add_body))
    x = torch.arange(64, dtype=torch.int32, device=DEV)
    outs = []
    for nw in (4, 2, 4):
        out = torch.zeros(64, dtype=torch.int32, device=DEV)
        k = fast[(2,)](x, out, 64, 5, BLOCK=32, TWICE=False, num_warps=nw)
        assert k.metadata.num_warps == nw
        outs.append(out)
    assert fast.fast_launches == 1 and fast.slow_launches == 2  # num_warps=4 compiled once, reused
    out = torch.zeros(64, dtype=torch.int32, device=DEV)
    for _ in range(2):
        fast[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, out, 64, 5, BLOCK=32, TWICE=False)
    assert fast.fast_launches == 2
    for o in outs + [out]:
        assert torch.equal(o, x + 5)


@pytest.mark.gpu
def test_launch_hooks_are_honoured():
    fast = fast_kernel(_jit(_add_body))
    x = torch.arange(64, dtype=torch.int32, device=DEV)
    _run(fast, x, 64, 3, False)  # compiled
    seen = []

    def enter(meta):
        seen.append(("enter", meta.get()["name"]))

    def leave(meta):
        seen.append(("exit", meta.get()["name"]))

    knobs.runtime.launch_enter_hook.add(enter)
    knobs.runtime.launch_exit_hook.add(leave)
    try:
        before = fast.fast_launches
        _run(fast, x, 64, 3, False)
        assert fast.fast_launches == before + 1
    finally:
        knobs.runtime.launch_enter_hook.remove(enter)
        knobs.runtime.launch_exit_hook.remove(leave)
    assert seen == [("enter", "_add_body"), ("exit", "_add_body")]
    _run(fast, x, 64, 3, False)
    assert len(seen) == 2  # removed: not called again


@pytest.mark.gpu
def test_fast_launch_is_captured_in_a_cuda_graph():
    fast = fast_kernel(_jit(_add_body))
    x = torch.arange(64, dtype=torch.int32, device=DEV)
    out = torch.zeros(64, dtype=torch.int32, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fast[(2,)](x, out, 64, 7, BLOCK=32, TWICE=False)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    before = fast.fast_launches
    with torch.cuda.graph(g):
        fast[(2,)](x, out, 64, 7, BLOCK=32, TWICE=False)
    assert fast.fast_launches == before + 1
    out.zero_()
    x.add_(100)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x + 7)


@pytest.mark.gpu
def test_current_stream_is_the_current_stream():
    """``current_stream(i)`` is the stream ``torch.cuda.current_stream(i)`` names - the default stream, a side stream
    made current, an external stream - the same object at each call for one stream, and an event recorded on it
    completes after the work queued on that stream."""
    from mxcomm.kernels.launch import current_stream

    i = torch.cuda.current_device()
    side = torch.cuda.Stream()
    ext = torch.cuda.ExternalStream(side.cuda_stream)
    for s in (None, side, ext):
        with torch.cuda.stream(s if s is not None else torch.cuda.current_stream()):
            got, want = current_stream(i), torch.cuda.current_stream(i)
            assert got.cuda_stream == want.cuda_stream and got.device == want.device, s
            assert current_stream(i) is got
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)
        ev = torch.cuda.Event()
        ev.record(current_stream(i))
    assert not ev.query()  # (queued behind the sleep on the side stream, not on the default stream)
    ev.synchronize()
