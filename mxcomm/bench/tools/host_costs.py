"""Host microseconds of the small things an EP call does, on this machine (calibration for host-overhead work).

    python3 -m mxcomm.bench.tools.host_costs

Each line: median host time per operation over many repetitions (no device sync inside the loop). The launch lines
compare Triton's launcher (``kernel[grid](...)``, the compiled kernel's ``.run``, and ``mxcomm.kernels.launch.
fast_kernel``, for a kernel of 12 arguments and one of 25 with 6 constexprs, the size of the EP kernels) with a CUDA
C++ kernel of the same 12 arguments built to a cubin with ``nvcc`` and launched through cuda-python
(``cuda.core.launch``, as ``mxcomm.transport.put_signal`` launches its kernels); that line is skipped, with the
reason, where ``nvcc`` or ``cuda.core`` is missing. The last lines time whole calls as ``mxcomm bench`` times a
call (an L2 flush, a device sync, then the host clock and CUDA events around the call and a sync): a CUDA-graph replay
of 1 and of 6 empty kernels, the floor of any replayed call timed that way on this machine, and a zero fill of
``8192 x 7168`` bytes, the padding rows (``align`` 32) a one-rank dispatch of 128 tokens to 256 experts writes.
"""
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from mxcomm.kernels.launch import fast_kernel


@triton.jit
def _noop12(a, b, c, d, e, f, n1, n2, n3, n4, n5, n6, BLOCK: tl.constexpr):
    if n1 < 0:
        tl.store(a + tl.arange(0, BLOCK), tl.load(b + tl.arange(0, BLOCK)))


@triton.jit
def _noop25(a, b, c, d, e, f, g, h, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
            BLOCK: tl.constexpr, K: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr,
            CHUNK: tl.constexpr):
    if n1 < 0:
        tl.store(a + tl.arange(0, BLOCK), tl.load(b + tl.arange(0, BLOCK)))


def _cost(name, fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    print(f"{name:48s} {statistics.median(ts):7.2f} us")


_NOOP12_CU = r"""
extern "C" __global__ void noop12(long long *a, long long *b, long long *c, int *d, int *e, int *f,
                                  int n1, int n2, int n3, int n4, int n5, int n6) {
    if (n1 < 0) a[threadIdx.x] = b[threadIdx.x];
}
"""


def build_noop_cubin(arch: str, out_dir: Path) -> Path:
    """``noop12`` (the CUDA C++ twin of the Triton kernel timed here) compiled with ``nvcc -cubin -arch=<arch>`` into
    ``out_dir``; raises FileNotFoundError without ``nvcc``, CalledProcessError when it fails."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        raise FileNotFoundError("nvcc not found")
    src, out = out_dir / "noop12.cu", out_dir / "noop12.cubin"
    src.write_text(_NOOP12_CU)
    subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


def _cubin_launch_cost(t, u) -> None:
    """The 12-argument no-op kernel as a cubin launched through ``cuda.core.launch`` (numpy scalars, as the put path
    passes them)."""
    import numpy as np

    try:
        import cuda.core as cc

        cc.ObjectCode  # noqa: B018 - cuda.core >= 0.4 exports it at the top level
    except (ImportError, AttributeError) as exc:
        print(f"{'cuda.core launch of a cubin, 12 args':48s} skipped: cuda.core missing ({exc})")
        return
    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = build_noop_cubin(f"sm_{major}{minor}", Path(tmp))
        except (FileNotFoundError, subprocess.CalledProcessError) as exc:
            print(f"{'cuda.core launch of a cubin, 12 args':48s} skipped: nvcc build failed ({exc})")
            return
        cc.Device(torch.cuda.current_device()).set_current()
        kernel = cc.ObjectCode.from_cubin(path.read_bytes(), name="noop12.cubin").get_kernel("noop12")

    class _Stream:  # torch's current stream as cuda.core takes it (the __cuda_stream__ protocol)
        def __init__(self, handle):
            self.handle = handle

        def __cuda_stream__(self):
            return (0, self.handle)

    stream = _Stream(int(torch.cuda.current_stream().cuda_stream))
    cfg = cc.LaunchConfig(grid=1, block=128)
    ptrs = [np.uint64(x.data_ptr()) for x in (t, t, t, u, u, u)]
    ints = [np.int32(v) for v in (1, 2, 3, 4, 5, 6)]
    _cost("cuda.core launch of a cubin, 12 args", lambda: cc.launch(stream, cfg, kernel, *ptrs, *ints))
    _cost("cuda.core launch, args converted per call", lambda: cc.launch(
        stream, cfg, kernel, *[np.uint64(x.data_ptr()) for x in (t, t, t, u, u, u)],
        *[np.int32(v) for v in (1, 2, 3, 4, 5, 6)]))


def _launch25_costs(t, u) -> None:
    """The three Triton launch lines for a kernel of 25 arguments, 6 of them constexprs (8 pointers, 11 ints)."""
    ptrs, ints = (t, t, t, t, u, u, u, u), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
    consts = dict(BLOCK=128, K=8, MX=True, MODE=0, INT_ROUND=False, CHUNK=2048)
    _cost("triton launch, 25 args (kernel[grid](...))", lambda: _noop25[(1,)](*ptrs, *ints, **consts))
    k = _noop25[(1,)](*ptrs, *ints, **consts)
    stream = torch.cuda.current_stream().cuda_stream
    args = (*ptrs, *ints, *consts.values())
    _cost("compiled kernel .run, 25 args", lambda: k.run(1, 1, 1, stream, k.function, k.packed_metadata, None, None,
                                                         None, *args))
    _cost("fast_kernel launch, 25 args", lambda: fast_kernel(_noop25)[(1,)](*ptrs, *ints, **consts))


def main():
    d = torch.device("cuda")
    t = torch.zeros(1024, dtype=torch.int64, device=d)
    u = torch.zeros(1024, dtype=torch.int32, device=d)
    _cost("triton launch, 12 args (kernel[grid](...))",
          lambda: _noop12[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, BLOCK=128))
    k = _noop12[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, BLOCK=128)
    stream = torch.cuda.current_stream().cuda_stream
    args = (t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, 128)
    _cost("compiled kernel .run (no binder)", lambda: k.run(1, 1, 1, stream, k.function, k.packed_metadata, None, None,
                                                            None, *args))
    _cost("fast_kernel launch, 12 args", lambda: fast_kernel(_noop12)[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6,
                                                                            BLOCK=128))
    _launch25_costs(t, u)
    _cubin_launch_cost(t, u)
    _cost("torch.empty(65536, 7168, uint8)", lambda: torch.empty(65536, 7168, dtype=torch.uint8, device=d))
    _cost("tensor slice t[0:1]", lambda: t[0:1])
    _cost("tensor.view(int32)", lambda: t.view(torch.int32))
    _cost("t.add_(1)", lambda: t.add_(1))
    _cost("t.fill_(123456789)", lambda: t.fill_(123456789))
    _cost("u.copy_(u2)", lambda: u.copy_(u))
    _cost("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    _cost("x.device != dev", lambda: t.device != d)
    n = 200
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        t[:2].cpu()
    print(f"{'sync read of 2 words (.cpu(), idle GPU)':48s} {(time.perf_counter() - t0) / n * 1e6:7.2f} us")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _noop12[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, BLOCK=128)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(6):
            _noop12[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, BLOCK=128)
    _cost("CUDAGraph.replay() of 6 kernels", g.replay, n=500)
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        _noop12[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, BLOCK=128)
    pad = torch.empty(8192 * 7168, dtype=torch.uint8, device=d)
    for name, fn in (("graph replay of 1 empty kernel", g1.replay), ("graph replay of 6 empty kernels", g.replay),
                     ("zero fill of 8192 x 7168 bytes (eager)", pad.zero_)):
        whole, events = _timed_like_bench(fn)
        print(f"{'whole call: ' + name:48s} {whole:7.2f} us (CUDA events {events:.2f} us)")


def _timed_like_bench(fn, iters: int = 200) -> tuple:
    """Medians (µs) of the whole-call host time and the CUDA-event time of ``fn``, timed by the benchmark's own
    :func:`mxcomm.bench.timing.measure` in a world of this one process (an L2 flush and a sync before each call)."""
    from types import SimpleNamespace

    from mxcomm.bench.timing import L2Flusher, measure

    dev = torch.device("cuda", torch.cuda.current_device())
    alone = SimpleNamespace(device=dev, one_host=True, world=1, barrier=lambda: None,
                            all_gather_object=lambda obj: [obj])
    s = measure(fn, world=alone, iters=iters, warmup=10, flush=L2Flusher(dev))
    return statistics.median(s.whole_call), statistics.median(s.kernel)


if __name__ == "__main__":
    main()
