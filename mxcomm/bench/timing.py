"""Timing of one benchmark case across ranks.

Per timed iteration, on every rank:

1. (GPU) flush L2 by writing a buffer larger than it, then ``torch.cuda.synchronize``;
2. align the ranks' starts (``start``): ``barrier``, a barrier on the control (gloo) group; ``clock`` (all ranks on
   one host), the ranks exchange their ``perf_counter`` readings and each waits until the same instant, the latest
   reading plus :data:`CLOCK_LEAD_S` (on one host ``perf_counter`` is one system-wide monotonic clock). A barrier
   releases the ranks one after another: on one host under MPS its release skew (tens to hundreds of µs) lands in
   the first rank's time of a call whose kernels wait for every rank;
3. ``t0 = perf_counter()``; (GPU) record CUDA event ``start`` on the current stream;
4. the Python call;
5. (GPU) record event ``end``; ``torch.cuda.synchronize``; ``t1 = perf_counter()``.

``whole_call`` = ``t1 - t0`` (the Python call, host-timed, device-synchronised at the boundary).
``kernel`` (GPU only) = ``start.elapsed_time(end)``: GPU time from the first to the last work the
call enqueued on the current stream (NCCL work is ordered with it), which includes launch gaps and
any host synchronisation inside the call, but not the host time before the first launch.
After the loop the per-iteration times of all ranks are gathered; each iteration counts as the
slowest rank's time (max over ranks), and every rank's own times are kept too (``per_rank``: a median of each rank's
times, and the largest of those, is what a tool that times ranks apart reports). On one host ``start_skew``
records, per iteration, the spread of the ranks' ``t0`` (latest minus earliest): how well step 2 aligned them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .options import START_MODES

WHOLE_CALL_DESC = ("host perf_counter around the Python call; device synchronised before and after; ranks aligned "
                   "before each iteration (see start); per iteration the max over ranks")
KERNEL_DESC = ("CUDA events recorded on the current stream immediately before and after the Python call: GPU time "
               "of the call's kernels including launch gaps and any host synchronisation inside the call; per "
               "iteration the max over ranks")


CLOCK_LEAD_S = 0.005  # the wait before a clock-aligned start: longer than a gloo all-gather's release skew
START_DESC = {
    "barrier": "ranks released by a gloo barrier before each iteration",
    "clock": ("ranks start at one instant of the host's monotonic clock (perf_counter readings exchanged, each rank "
              f"waits until the latest plus {CLOCK_LEAD_S * 1e3:g} ms); all ranks on one host"),
}


@dataclass(frozen=True)
class Samples:
    """Per-iteration times in µs (already max over ranks): ``whole_call`` always, ``kernel`` on GPU else None;
    ``start_skew`` (all ranks on one host, else None): latest minus earliest ``t0`` of the ranks; ``start``: the
    alignment used (``barrier``/``clock``); ``late``: clock-aligned iterations some rank reached after the instant;
    ``per_rank``: ``{"whole_call": [rank 0's times, ...], "kernel": [...] or None}``, each rank's own per-iteration
    times (None when not gathered)."""

    whole_call: list
    kernel: Optional[list]
    start_skew: Optional[list] = None
    start: str = "barrier"
    late: int = 0
    per_rank: Optional[dict] = None


def start_mode(requested: str, one_host: bool, ranks: int) -> str:
    """The start alignment to use: ``auto`` is ``clock`` when several ranks share one host, else ``barrier`` (one
    rank has nobody to wait for); ``clock`` across hosts raises ValueError (their clocks are not one)."""
    if requested not in START_MODES:
        raise ValueError(f"start alignment must be one of {', '.join(START_MODES)}, got {requested!r}")
    if requested == "auto":
        return "clock" if one_host and ranks > 1 else "barrier"
    if requested == "clock" and not one_host:
        raise ValueError("--start clock needs every rank on one host (one monotonic clock); use --start barrier")
    return requested


def wait_for_common_instant(world, lead_s: float = CLOCK_LEAD_S) -> bool:
    """Collective: exchange ``perf_counter`` readings and wait until the latest plus ``lead_s``; True when this rank
    got there after that instant (the exchange released it too late)."""
    deadline = max(world.all_gather_object(time.perf_counter())) + lead_s
    if time.perf_counter() > deadline:
        return True
    while time.perf_counter() < deadline:  # spin: a thread that slept starts its next CUDA calls slower
        pass
    return False


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


def measure(fn: Callable[[], object], *, world, iters: int, warmup: int, flush: Optional[L2Flusher] = None,
            start: str = "auto") -> Samples:
    """Time ``fn`` (see module doc). Collective over ``world`` (a :class:`~mxcomm.bench.world.BenchWorld`);
    ``start``: one of :data:`mxcomm.bench.options.START_MODES`."""
    dev = world.device
    cuda = dev.type == "cuda"
    mode = start_mode(start, world.one_host, world.world)

    def prepare() -> bool:
        """Flush, sync, align; True when this rank reached a clock-aligned start late."""
        if flush is not None:
            flush()
        if cuda:
            torch.cuda.synchronize(dev)
        world.barrier()
        return mode == "clock" and wait_for_common_instant(world)

    for _ in range(warmup):
        prepare()
        fn()
    host, events, starts, late = [], [], [], []
    for _ in range(iters):
        late.append(prepare())
        if cuda:
            start_ev, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        if cuda:
            start_ev.record()
        fn()
        if cuda:
            end.record()
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        starts.append(t0)
        if cuda:
            events.append((start_ev, end))
    kernel = [s.elapsed_time(e) * 1e3 for s, e in events] if cuda else None
    everyone = world.all_gather_object((host, kernel, starts, late))
    host_max = [max(e[0][i] for e in everyone) for i in range(iters)]
    kern_max = [max(e[1][i] for e in everyone) for i in range(iters)] if cuda else None
    skew = None
    if world.one_host:
        skew = [(max(e[2][i] for e in everyone) - min(e[2][i] for e in everyone)) * 1e6 for i in range(iters)]
    per_rank = dict(whole_call=[e[0] for e in everyone], kernel=[e[1] for e in everyone] if cuda else None)
    return Samples(whole_call=host_max, kernel=kern_max, start_skew=skew, start=mode,
                   late=sum(any(e[3][i] for e in everyone) for i in range(iters)), per_rank=per_rank)


__all__ = ["Samples", "measure", "start_mode", "wait_for_common_instant", "START_DESC", "CLOCK_LEAD_S", "summarize",
           "percentile", "L2Flusher", "WHOLE_CALL_DESC", "KERNEL_DESC"]
