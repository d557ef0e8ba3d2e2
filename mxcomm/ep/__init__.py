"""Expert-parallel dispatch/combine (MXFP8 or BF16 payload, expert-major aligned layout).

Public API: :class:`EPConfig`, :class:`EPGroup` (``dispatch`` / ``combine``), the values
:class:`DispatchResult` / :class:`EPHandle`, and the shared routing plan (:mod:`mxcomm.ep.plan`).
Backends: ``"torch"`` reference (:mod:`mxcomm.ep.reference`), ``"nvshmem"`` (GPU).
The single-process oracle for tests lives in :mod:`mxcomm.ep.oracle`.
"""
from .config import EPConfig
from .group import EPGroup
from .handle import DispatchResult, EPHandle
from .plan import BufferSizes, RoutingPlan, build_plan, buffer_sizes, local_counts, max_recv_rows, recv_rows

__all__ = [
    "EPConfig", "EPGroup", "DispatchResult", "EPHandle", "RoutingPlan", "build_plan", "local_counts",
    "recv_rows", "max_recv_rows", "buffer_sizes", "BufferSizes",
]
