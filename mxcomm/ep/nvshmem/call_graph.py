"""CallGraph: a whole call captured once and replayed with new tensors (the one-rank exact-size dispatch of a few
hundred tokens, whose time is the host's launches, not the device's work).

A CUDA graph replays its kernels with the pointer arguments they were captured with. The call's inputs and outputs
are new tensors at every call, so the captured kernels read their addresses from an int64 table in device memory
(:mod:`mxcomm.ep.nvshmem.kernels.call_io`), which the graph's first node copies from pinned host memory that
:meth:`CallGraph.replay` writes: one graph launch per call, no copy of the inputs and none of the outputs beyond the
small ones the graph itself copies out (``copy_out_kernel``). (Kernels that read the table from pinned memory
themselves, every program over the bus with volatile loads, made the output kernel a hundred times slower:
docs/benchmarks.md.)
"""
from __future__ import annotations

from typing import Callable

import torch


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

    def replay(self, addresses: tuple) -> None:
        """Run the call with ``addresses`` (ints, ``n_addr`` of them, 0 for an unused entry) on the current stream."""
        if self.replayed:
            self.done.synchronize()
        self.table_values[:] = addresses
        self.graph.replay()
        self.done.record(torch.cuda.current_stream(self.stream_device))
        self.replayed = True


__all__ = ["CallGraph"]
