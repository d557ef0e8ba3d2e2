"""CallGraph: a whole call captured once and replayed with new tensors (the exact-size dispatch of the one-rank path
and, where its output's worst case is small, of the pull path: its eager form would launch its output kernels after
the host sync, the device idle meanwhile), and what the paths that capture their dispatch so share
(:class:`CallShape`, :class:`CallTensors`, :class:`CallOutputs`, :class:`PlanLayout`, :class:`CapturedCall`,
:func:`copy_in`, :func:`copy_out`).

A CUDA graph replays its kernels with the pointer arguments they were captured with. The call's inputs and outputs
are new tensors at every call, so the captured kernels read their addresses from an int64 table in device memory
(:mod:`mxcomm.ep.nvshmem.kernels.call_io`), which the graph's first node copies from pinned host memory that
:meth:`CallGraph.replay` writes: one graph launch per call, no copy of the inputs and none of the outputs beyond the
small ones the graph itself copies out (``copy_out_kernel``). (Kernels that read the table from pinned memory
themselves, every program over the bus with volatile loads, made the output kernel a hundred times slower:
docs/benchmarks.md.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...kernels.launch import cdiv, current_stream, fast_kernel
from ...mx import grouped_m_rows, round_up
from .plan_graph import OutputCopier, OutputsCopy, PlanOutputs

COPY_BLOCK = 1024  # int32 words per step of copy_in_kernel / copy_out_kernel


class CallGraph:
    """``body(table)`` captured once; :meth:`replay` runs it with the addresses of this call's tensors in ``table``.

    Args:
        device: the CUDA device.
        n_addr: entries of the address table (int64 ``[n_addr]`` on the device, what ``body`` reads).
        body: enqueues the call's work on the current stream, reading its tensors' addresses from the table; what it
            returns is kept as :attr:`outputs`: every tensor the graph writes besides the table's must be allocated
            inside ``body`` (the graph's own memory) and held there, since a tensor freed after the capture gives
            its memory to other tensors while every replay still writes it.

    The table's pinned host copy is written by :meth:`replay` while no earlier replay can still be copying it: each
    replay records an event, and the next waits for it before it writes (a call that synchronises with the host in
    between, as an exact-size dispatch does, finds it done).
    """

    def __init__(self, device: torch.device, n_addr: int, body: Callable[[torch.Tensor], object]):
        self.stream_device = device.index  # (an int: the cheapest current-stream lookup)
        self.host = torch.zeros(n_addr, dtype=torch.int64, pin_memory=True)
        self.table_values = self.host.numpy()  # written without a torch op per call
        self.table = torch.zeros(n_addr, dtype=torch.int64, device=device)
        self.done = torch.cuda.Event()
        self.replayed = False
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        # captured on a side stream without ``torch.cuda.graph``'s entry work (as PlanGraph; the caller has run the
        # body eagerly before, so every kernel is compiled and loaded)
        cap = torch.cuda.Stream(device)
        cap.wait_stream(current)
        with torch.cuda.stream(cap):
            self.graph.capture_begin()
            try:
                self.table.copy_(self.host, non_blocking=True)
                self.outputs = body(self.table)
            finally:
                self.graph.capture_end()
        current.wait_stream(cap)

    def replay(self, addresses: tuple, free: bool = False) -> None:
        """Run the call with ``addresses`` (ints, ``n_addr`` of them, 0 for an unused entry) on the current stream.
        ``free``: the caller found the last replay done (:meth:`busy`), so it is not waited for again."""
        if self.replayed and not free:
            self.done.synchronize()
        self.table_values[:] = addresses
        self.graph.replay()
        self.done.record(current_stream(self.stream_device))
        self.replayed = True

    def busy(self) -> bool:
        """Whether a replay of this graph may still be running (its table then cannot be written without a wait)."""
        return self.replayed and not self.done.query()


class CallGraphRing:
    """Up to ``copies`` :class:`CallGraph` of one body, replayed in turn: for calls with no host sync between them (a
    combine, a dispatch backward), where a single graph would make each replay wait on the host for the one before it
    to finish (its table is rewritten). A busy graph gets a new copy captured beside it while there are fewer than
    ``copies``; then a replay waits only for the call ``copies`` replays back. Arguments as :class:`CallGraph`'s (the
    body is captured once per copy: what it allocates, each copy holds its own)."""

    def __init__(self, device: torch.device, n_addr: int, body: Callable[[torch.Tensor], object], copies: int):
        self.device, self.n_addr, self.body, self.copies = device, n_addr, body, copies
        self.graphs = [CallGraph(device, n_addr, body)]
        self.turn = 0

    def replay(self, addresses: tuple) -> None:
        """Run the call with ``addresses`` on the current stream (:meth:`CallGraph.replay`) with the next copy."""
        g = self.graphs[self.turn]
        free = not g.busy()
        if not free and len(self.graphs) < self.copies:
            g = CallGraph(self.device, self.n_addr, self.body)
            self.graphs.insert(self.turn, g)
            free = True
        g.replay(addresses, free)
        self.turn = (self.turn + 1) % len(self.graphs)


@dataclass(frozen=True)
class CallShape:
    """What a dispatch of ``T`` tokens (ids of ``dtype``) run as one call is captured for: ``rows`` output rows (the
    most the call can bring: its output kernels' grids are sized for them, the output a call passes may hold fewer),
    ``scale_rows`` rows of their grouped scales, ``plan_words`` int32 words of the checked ids and the plan (the plan's
    store)."""

    T: int
    dtype: torch.dtype
    rows: int
    scale_rows: int
    plan_words: int


@dataclass(frozen=True)
class CallTensors:
    """The fresh tensors one call returns its results in (their addresses go in the graph's table), for an output of
    ``rows`` rows (its capacity: the call's ``R`` rows are its first): ``out`` uint8 ``[rows, H]`` (MX payload) /
    ``[rows, 2H]`` (bf16 bytes), ``scales`` uint8 ``[grouped_m_rows(rows, El), round_up(H/32, 4)]`` grouped blocked
    scales (MX; None otherwise), ``scale_rows`` uint8 ``[rows, H/32]`` row-major scale rows for the kernel that
    writes them (MX, when the path has no buffer of its own for them; else None), ``plan_copy`` int32
    ``[plan_words]``."""

    rows: int
    out: torch.Tensor
    scales: Optional[torch.Tensor]
    scale_rows: Optional[torch.Tensor]
    plan_copy: torch.Tensor

    @staticmethod
    def alloc(rows: int, shape: CallShape, hidden: int, n_groups: int, mx: bool, device: torch.device,
              scale_rows: bool = False) -> "CallTensors":
        """Fresh tensors of a call of ``shape`` whose output holds ``rows`` rows (at most ``shape.rows``);
        ``scale_rows``: with the row-major scale rows (MX)."""
        if rows > shape.rows:
            raise ValueError(f"an output of {rows} rows exceeds the {shape.rows} the call is captured for")
        out = torch.empty(rows, hidden if mx else 2 * hidden, dtype=torch.uint8, device=device)
        scales = (torch.empty(grouped_m_rows(rows, n_groups), round_up(hidden // 32, 4), dtype=torch.uint8,
                              device=device) if mx else None)
        srows = torch.empty(rows, hidden // 32, dtype=torch.uint8, device=device) if mx and scale_rows else None
        return CallTensors(rows=rows, out=out, scales=scales, scale_rows=srows,
                           plan_copy=torch.empty(shape.plan_words, dtype=torch.int32, device=device))

    @staticmethod
    def address(t: Optional[torch.Tensor]) -> int:
        """The address of ``t`` (0 for None: an unused table entry)."""
        return 0 if t is None else t.data_ptr()

    def grouped_scales(self, R: int, n_groups: int) -> Optional[torch.Tensor]:
        """The grouped scales of an output of ``R`` rows in ``n_groups`` groups (a view of ``scales``; None without
        MX)."""
        return None if self.scales is None else self.scales[:grouped_m_rows(R, n_groups)]


@dataclass(frozen=True)
class CallOutputs:
    """What a captured call's body enqueued that outlives it: ``middle``, the outputs of the dispatch's middle (the
    checked ids and the plan, in their store), and ``buffers``, the other tensors of its own it writes (the buffer
    the caller's ids are copied into, scale rows). A captured call's are the graph's memory, written at every replay:
    the graph keeps them (:attr:`CallGraph.outputs`), so that no other tensor is given their memory while the graph
    can still write it."""

    middle: PlanOutputs
    buffers: tuple


@dataclass(frozen=True)
class PlanLayout:
    """How a call's copy of its checked ids and plan is read: ``copier`` lays the copy out as views, ``scalars`` the
    plan's fields that are not tensors (the same for every call of a shape)."""

    copier: OutputCopier
    scalars: dict

    @staticmethod
    def of(po: PlanOutputs) -> "PlanLayout":
        """The layout of the plan tensors and the extra outputs of ``po`` (the checked ids; the row origins where the
        path has them) in their store (all of them: the Triton plan writes every output there, and the store is all
        a call copies out)."""
        copier = OutputCopier(po.named())
        if copier.aux_names:
            raise RuntimeError(f"the dispatch's outputs {copier.aux_names} are not in the plan's store, which is all "
                               "a call copies out")
        return PlanLayout(copier=copier, scalars=PlanOutputs.scalars_of(po.plan))

    def read(self, plan_copy: torch.Tensor, now: tuple = ()) -> PlanOutputs:
        """The plan and the extra outputs (``extra["ids"]``: the checked ids) as views of ``plan_copy`` (int32, a copy
        of the store; the plan a :class:`~mxcomm.ep.nvshmem.plan_graph.CopiedPlan`: the tensors named in ``now``
        viewed here, the others at their first read)."""
        return PlanOutputs.of_copy(OutputsCopy(self.copier, plan_copy.view(torch.uint8), self.copier.aux), self.scalars,
                                   now)


@dataclass(frozen=True)
class CapturedCall:
    """A dispatch captured for one :class:`CallShape`: the graph and the layout of its plan copy."""

    graph: CallGraph
    layout: PlanLayout


def copy_in(table: torch.Tensor, slot: int, dst: torch.Tensor) -> None:
    """Enqueue the copy of ``dst.numel()`` values (4 or 8 bytes each) from the address in ``table[slot]`` into
    ``dst`` (contiguous: the graph's buffer, or a fixed one of the engine)."""
    from .kernels.call_io import copy_in_kernel

    n = dst.numel() * dst.element_size() // 4
    if n:
        fast_kernel(copy_in_kernel)[(min(cdiv(n, COPY_BLOCK), 64),)](table, slot, dst.view(-1).view(torch.int32), n,
                                                                     BLOCK=COPY_BLOCK)


def copy_out(src: torch.Tensor, table: torch.Tensor, slot: int) -> None:
    """Enqueue the copy of ``src`` (int32, contiguous) to the address in ``table[slot]``."""
    from .kernels.call_io import copy_out_kernel

    n = src.numel()
    fast_kernel(copy_out_kernel)[(min(cdiv(n, COPY_BLOCK), 64),)](src, table, slot, n, BLOCK=COPY_BLOCK)


__all__ = ["CallGraph", "CallGraphRing", "CallShape", "CallTensors", "CallOutputs", "PlanLayout", "CapturedCall",
           "copy_in", "copy_out"]
