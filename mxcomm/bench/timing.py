"""Timing of one benchmark case across ranks.

Per timed iteration, on every rank:

1. (GPU) flush L2 by writing a buffer larger than it, then ``torch.cuda.synchronize``;
2. barrier on the control (gloo) group, so ranks start aligned;
3. ``t0 = perf_counter()``; (GPU) record CUDA event ``start`` on the current stream;
4. the Python call;
5. (GPU) record event ``end``; ``torch.cuda.synchronize``; ``t1 = perf_counter()``.

``whole_call`` = ``t1 - t0`` (the Python call, host-timed, device-synchronised at the boundary).
``kernel`` (GPU only) = ``start.elapsed_time(end)``: GPU time from the first to the last work the
call enqueued on the current stream (NCCL work is ordered with it), which includes launch gaps and
any host synchronisation inside the call, but not the host time before the first launch.
After the loop the per-iteration times of all ranks are gathered; each iteration counts as the
slowest rank's time (max over ranks).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

WHOLE_CALL_DESC = ("host perf_counter around the Python call; device synchronised before and after; ranks aligned "
                   "by a gloo barrier before each iteration; per iteration the max over ranks")
KERNEL_DESC = ("CUDA events recorded on the current stream immediately before and after the Python call: GPU time "
               "of the call's kernels including launch gaps and any host synchronisation inside the call; per "
               "iteration the max over ranks")


@dataclass(frozen=True)
class Samples:
    """Per-iteration times in µs (already max over ranks): ``whole_call`` always, ``kernel`` on GPU else None."""

    whole_call: list
    kernel: Optional[list]


def percentile(values, q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    v = sorted(float(x) for x in values)
    if not v:
        raise ValueError("percentile of no values")
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(values) -> dict:
    """``{median, p10, p90, mean, min, max, n}`` of a list of µs values."""
    v = [float(x) for x in values]
    return dict(median=statistics.median(v), p10=percentile(v, 10), p90=percentile(v, 90),
                mean=statistics.fmean(v), min=min(v), max=max(v), n=len(v))


class L2Flusher:
    """Writes a buffer of ``max(2 x L2, 256 MiB)`` bytes (GPU) before each timed iteration; no-op on CPU."""

    def __init__(self, device: torch.device):
        self.buf = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (60 << 20)
            self.buf = torch.empty(max(2 * l2, 256 << 20), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()

    @property
    def active(self) -> bool:
        return self.buf is not None


def measure(fn: Callable[[], object], *, world, iters: int, warmup: int, flush: Optional[L2Flusher] = None) -> Samples:
    """Time ``fn`` (see module doc). Collective over ``world`` (a :class:`~mxcomm.bench.world.BenchWorld`)."""
    dev = world.device
    cuda = dev.type == "cuda"

    def prepare():
        if flush is not None:
            flush()
        if cuda:
            torch.cuda.synchronize(dev)
        world.barrier()

    for _ in range(warmup):
        prepare()
        fn()
    host, events = [], []
    for _ in range(iters):
        prepare()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        if cuda:
            start.record()
        fn()
        if cuda:
            end.record()
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        if cuda:
            events.append((start, end))
    kernel = [s.elapsed_time(e) * 1e3 for s, e in events] if cuda else None
    everyone = world.all_gather_object((host, kernel))
    host_max = [max(h[i] for h, _ in everyone) for i in range(iters)]
    kern_max = [max(k[i] for _, k in everyone) for i in range(iters)] if cuda else None
    return Samples(whole_call=host_max, kernel=kern_max)


__all__ = ["Samples", "measure", "summarize", "percentile", "L2Flusher", "WHOLE_CALL_DESC", "KERNEL_DESC"]
