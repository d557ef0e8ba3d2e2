"""Host time of the four public EP calls on the ``nvshmem`` backend's call path, on one rank without NVSHMEM: what
the Python between the kernels (argument checks, handles, autograd wrappers, launches) costs per call.

    TRITON_INTERPRET=1 python -m mxcomm.bench.tools.host_glue [--tokens 128] [--profile combine]   # CPU
    TRITON_INTERPRET=1 python -m mxcomm.bench.tools.host_glue --world 4 [--transport push]      # CPU, rank 0 of 4
    TRITON_INTERPRET=1 python -m mxcomm.bench.tools.host_glue --replayed [--profile dispatch]   # CPU, replays skipped
    python -m mxcomm.bench.tools.host_glue --device cuda [--hidden 7168 --experts 256 --topk 8]   # GPU

The backend is built over a loopback stand-in for the symmetric heap (:class:`LoopbackHeap`: plain tensors, a peer
pointer is the tensor's own address; no NVSHMEM) and put into an :class:`~mxcomm.ep.EPGroup` of one rank (a gloo
world of 1 in this process). The calls are those of ``mxcomm.bench.tools.trace``:

* ``dispatch``: ``group.dispatch(x, topk_idx, topk_weights)``;
* ``combine``: ``group.combine(expert_out, handle)``;
* ``combine_bwd``: ``group.steps.combine_backward(grad_y, handle, saved)`` (``saved``: the expert output, as
  ``combine_for_backward`` keeps it);
* ``dispatch_bwd``: ``group.steps.dispatch_backward(expert_out, handle)``.

``--device cpu`` (needs ``TRITON_INTERPRET=1`` in the environment, set before the start: Triton decides when a kernel
is defined): each call runs once for real in Triton's interpreter, then every kernel launch is stubbed out
(``InterpretedFunction.run`` does nothing) and the calls are timed again: what is left is the host's own work, the
torch ops included (on CPU tensors). The stub writes the one value the host reads back from a kernel - a dispatch
plan's row count, read at the exact-size dispatch's sync - so stubbed dispatches keep the real run's output size.
``--world N`` (CPU, N > 1): this process plays rank 0 of N whose peers are itself (every peer pointer is its own
buffer's), so the multi-rank paths' host code runs (``--transport``: ``auto`` - the pull path - or ``push``);
no peer would ever signal, so every kernel is stubbed from the first call and the dispatch's row count is ``T k``.
On the GPU a multi-rank dispatch replays its middle (pack, exchange, plan) from a captured graph, and an exact-size
dispatch replays the whole call on one rank (at most ``LaunchConfig.call_graph_tokens`` tokens) and on the pull path
(above ``LaunchConfig.peer_call_tokens`` from a token count's second call), and a one-rank combine or dispatch backward
its reduce (at most ``LaunchConfig.reduce_call_tokens``): on the CPU they run eagerly (every launch of the captured
work, stubbed), so their share here is larger than there.
``--replayed`` (CPU): the calls that the GPU replays whole (an exact-size dispatch as one call, a one-rank reduce)
skip their captured work after their first run, as a replay does on the host: ``NvshmemBackend.run_call`` returns the
layout of the key's first run without running the body again, ``run_ring_call`` runs nothing after a key's first
call (:func:`stand_in_replays`) - what is left is the host work around the replay, what the GPU path pays per call.
``--device cuda``: the same calls with CUDA tensors and real kernel launches (the GPU runs them; the time per call is
the host's while the GPU keeps up, as at a few hundred tokens on one rank).

Prints, per call, the median (and the minimum) over ``--rounds`` rounds of ``--calls`` calls of the time per call
(µs) on ``--clock``: ``wall``, or ``thread`` (this thread's CPU time: steadier on a machine other processes keep
busy); ``--profile OP`` (repeatable) adds the cProfile of ``--calls`` calls of that op (sorted by ``--sort``).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

OPS = ("dispatch", "combine", "combine_bwd", "dispatch_bwd")


@dataclass
class LoopbackCtx:
    """The NVSHMEM context of rank 0 of ``world`` on ``device`` (the peers are this process)."""

    device: torch.device
    rank: int = 0
    world: int = 1


@dataclass
class LoopbackBuf:
    """A symmetric buffer of a world of 1: ``local`` the tensor, ``peer_ptrs`` int64 ``[1]`` its own address."""

    local: torch.Tensor
    peer_ptrs: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


class LoopbackHeap:
    """Stand-in for ``mxcomm.transport.SymmetricHeap`` of rank 0 of ``world`` on ``device`` (CPU under the
    interpreter, or a GPU): zeroed tensors, every peer pointer of a buffer its own address."""

    def __init__(self, device: torch.device, world: int = 1):
        self.ctx = LoopbackCtx(device, 0, world)
        self.bufs: dict = {}

    def alloc(self, name: str, shape, dtype: torch.dtype) -> LoopbackBuf:
        t = torch.zeros(shape, dtype=dtype, device=self.ctx.device)
        ptrs = torch.tensor([t.data_ptr()] * self.ctx.world, dtype=torch.int64, device=t.device)
        self.bufs[name] = LoopbackBuf(t, ptrs)
        return self.bufs[name]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs.values())


def loopback_group(cfg, device: torch.device, world: int = 1):
    """An :class:`~mxcomm.ep.EPGroup` whose backend is the ``nvshmem`` backend of rank 0 of ``world`` over a
    :class:`LoopbackHeap` (the group is made with the ``torch`` backend - no NVSHMEM needed - and its config, backend
    and steps swapped). Needs a torch.distributed world of 1."""
    from mxcomm.ep import EPGroup
    from mxcomm.ep.nvshmem.backend import NvshmemBackend
    from mxcomm.ep.steps import EPSteps

    g = EPGroup(dataclasses.replace(cfg, backend="torch"))
    be = NvshmemBackend(cfg, None, 0, world, heap=LoopbackHeap(device, world), group_id=g.op_id)
    g.config, g.backend = cfg, be
    g.steps = EPSteps(cfg, g.op_id, be)
    return g


def make_calls(g, tokens: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """The four calls (see the module doc) on random inputs, each run once here (untimed)."""
    from mxcomm.ep.handle import CombineSaved

    cfg = g.config
    T, H, E, k = tokens, cfg.hidden, cfg.num_experts, cfg.topk
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, generator=gen, device=device), dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, generator=gen, device=device)
    res = g.dispatch(x, idx, w)
    h = res.handle
    out = torch.randn(res.num_rows, H, generator=gen, device=device).to(torch.bfloat16)
    saved = CombineSaved(rows=out)  # what combine_for_backward keeps: the expert output
    gy = torch.randn(T, H, generator=gen, device=device).to(torch.bfloat16)
    calls = {
        "dispatch": lambda: g.dispatch(x, idx, w),
        "combine": lambda: g.combine(out, h),
        "combine_bwd": lambda: g.steps.combine_backward(gy, h, saved),
        "dispatch_bwd": lambda: g.steps.dispatch_backward(out, h),
    }
    for fn in calls.values():
        fn()
    return calls


def stub_kernels(rows: int) -> Callable[[], None]:
    """Make every interpreted kernel launch a no-op, except that the plan kernel writes ``rows`` as the plan's row
    count (what an exact-size dispatch reads back). Returns the function that undoes it."""
    from triton.runtime.interpreter import InterpretedFunction

    from mxcomm.ep.nvshmem import plan_kernels

    real = InterpretedFunction.run
    plan = plan_kernels.plan_kernel
    names = plan.arg_names

    def run(self, *args, grid, warmup, **kwargs):
        if self is plan:  # recv[2 El + 2 W] is the row count
            a = dict(zip(names, args))
            a["recv_ptr"][2 * a["El"] + 2 * a["W"]] = rows
        return None

    InterpretedFunction.run = run

    def undo() -> None:
        InterpretedFunction.run = real

    return undo


def stand_in_replays(backend) -> Callable[[], None]:
    """Make ``backend`` (an ``NvshmemBackend`` on the CPU) run its whole-call graphs as a replay costs the host:
    ``run_call`` returns the plan layout of the key's first run (which runs its body, as a capture does) and later
    runs nothing; ``run_ring_call`` runs the body at a key's first call only. Returns the function that undoes it."""
    layouts, rings = {}, set()
    real_call, real_ring = backend.run_call, backend.run_ring_call

    def run_call(key, addresses, body):
        if key not in layouts:
            layouts[key] = real_call(key, addresses, body)
        return layouts[key]

    def run_ring_call(key, addresses, body, copies):
        if key not in rings:
            rings.add(key)
            real_ring(key, addresses, body, copies)

    backend.run_call, backend.run_ring_call = run_call, run_ring_call

    def undo() -> None:
        del backend.run_call, backend.run_ring_call

    return undo


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def time_call(fn: Callable[[], object], device: torch.device, calls: int, rounds: int,
              clock: str = "wall") -> tuple[float, float]:
    """(median, min) over ``rounds`` of the µs per call of ``calls`` back-to-back calls (synchronised per round) on
    ``clock``: ``"wall"`` (``time.perf_counter``) or ``"thread"`` (``time.thread_time``, this thread's CPU time: what
    the host spent on the calls itself, unaffected by other processes on a busy machine; with CUDA tensors it misses
    the time the host waits for the device)."""
    now = CLOCKS[clock]
    for _ in range(max(5, calls // 10)):
        fn()
    per = []
    for _ in range(rounds):
        _sync(device)
        t0 = now()
        for _ in range(calls):
            fn()
        _sync(device)
        per.append((now() - t0) / calls * 1e6)
    return statistics.median(per), min(per)


def profile_call(fn: Callable[[], object], calls: int, sort: str, lines: int) -> None:
    """cProfile of ``calls`` calls, printed (``sort``: a pstats key)."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    pstats.Stats(pr).sort_stats(sort).print_stats(lines)


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=None, help="default: 256 on cpu, 7168 on cuda")
    ap.add_argument("--experts", type=int, default=None, help="default: 16 on cpu, 256 on cuda")
    ap.add_argument("--topk", type=int, default=None, help="default: 4 on cpu, 8 on cuda")
    ap.add_argument("--precision", choices=("mxfp8", "bf16"), default="mxfp8")
    ap.add_argument("--world", type=int, default=1, help="CPU: play rank 0 of this many (peers = this process)")
    ap.add_argument("--transport", choices=("auto", "push"), default="auto",
                    help="the path of a world > 1: auto (pull) or push (the put path needs NVSHMEM's puts)")
    ap.add_argument("--no-sync", action="store_true", help="EPConfig(exact_sizes=False) (default: exact sizes)")
    ap.add_argument("--replayed", action="store_true",
                    help="CPU: the calls the GPU replays whole skip their captured work after their first run")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    ap.add_argument("--profile", action="append", default=[], choices=OPS)
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--lines", type=int, default=30)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    """Run the tool (see the module doc); returns ``{op: µs per call}``."""
    a = _args(argv)
    cpu = a.device == "cpu"
    if a.replayed and not cpu:
        raise SystemExit("--replayed stands in for the GPU's replays on the CPU; on the GPU they are real")
    from triton import knobs

    if cpu and not knobs.runtime.interpret:
        raise SystemExit("--device cpu runs the kernels in Triton's interpreter: start it with TRITON_INTERPRET=1")
    if not cpu and (knobs.runtime.interpret or not torch.cuda.is_available()):
        raise SystemExit("--device cuda needs a CUDA GPU and TRITON_INTERPRET unset")
    if a.world < 1 or (a.world > 1 and not cpu):
        raise SystemExit("--world N > 1 runs on the CPU only (no peer would ever signal a GPU kernel)")
    from mxcomm.ep import EPConfig

    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    H = a.hidden or (256 if cpu else 7168)
    E = a.experts or (16 if cpu else 256)
    k = a.topk or (4 if cpu else 8)
    if E % a.world:
        raise SystemExit(f"--experts {E} must be divisible by --world {a.world}")
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=max(a.tokens, 1), precision=a.precision,
                   backend="nvshmem", exact_sizes=not a.no_sync, num_sms=1 if cpu else None, timeout_s=10.0,
                   transport=a.transport)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    g = loopback_group(cfg, device, a.world)
    undo = stub_kernels(a.tokens * k) if a.world > 1 else None  # no peer: nothing may wait for one
    calls = make_calls(g, a.tokens, device)
    if cpu and undo is None:
        undo = stub_kernels(_rows(calls))
    undo_replays = stand_in_replays(g.backend) if a.replayed else None
    ops = [o for o in a.ops.split(",") if o]
    print(f"host_glue: {a.device}, path {g.path}, rank 0 of {a.world}, T={a.tokens} H={H} E={E} k={k} {a.precision}, "
          f"exact_sizes={cfg.exact_sizes}{', kernels stubbed' if cpu else ''}"
          f"{', whole-call graphs stood in for' if a.replayed else ''}, {a.clock} clock")
    result = {}
    try:
        for op in ops:
            med, low = time_call(calls[op], device, a.calls, a.rounds, a.clock)
            result[op] = med
            print(f"  {op:14s} {med:8.1f} us per call (min {low:.1f})")
        for op in a.profile:
            print(f"--- cProfile of {a.calls} calls of {op}")
            profile_call(calls[op], a.calls, a.sort, a.lines)
    finally:
        if undo_replays is not None:
            undo_replays()
        if undo is not None:
            undo()
    return result


def _rows(calls) -> int:
    """The row count of the dispatch the calls were made with (its real run)."""
    return int(calls["dispatch"]().num_rows)


if __name__ == "__main__":
    main()
