"""Host microseconds of the small things an EP call does, on this machine (calibration for host-overhead work).

    python3 -m mxcomm.bench.tools.host_costs

Each line: median host time per operation over many repetitions (no device sync inside the loop).
"""
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _noop12(a, b, c, d, e, f, n1, n2, n3, n4, n5, n6, BLOCK: tl.constexpr):
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


def main():
    d = torch.device("cuda")
    t = torch.zeros(1024, dtype=torch.int64, device=d)
    u = torch.zeros(1024, dtype=torch.int32, device=d)
    _cost("triton launch, 12 args (kernel[grid](...))", lambda: _noop12[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, BLOCK=128))
    k = _noop12[(1,)](t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, BLOCK=128)
    stream = torch.cuda.current_stream().cuda_stream
    args = (t, t, t, u, u, u, 1, 2, 3, 4, 5, 6, 128)
    _cost("compiled kernel .run (no binder)", lambda: k.run(1, 1, 1, stream, k.function, k.packed_metadata, None, None,
                                                            None, *args))
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


if __name__ == "__main__":
    main()
