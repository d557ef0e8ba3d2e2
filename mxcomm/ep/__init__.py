"""Expert-parallel dispatch/combine (MXFP8 or BF16 payload, expert-major aligned layout).

Public API: :class:`EPConfig` (with the GPU backend's :class:`LaunchConfig`), :class:`EPGroup` (``dispatch`` /
``combine``, autograd-aware; ``steps``: the collectives without autograd), the values :class:`Dispatched` /
:class:`EPHandle` (and, for a call on a communication stream, :class:`EPEvent` / :class:`Combined`), and the shared
routing plan (:mod:`mxcomm.ep.plan`). Backends: ``"torch"`` (the reference, :mod:`mxcomm.ep.reference`, which
also holds the single-process oracles the tests use) and ``"nvshmem"`` (GPU, :mod:`mxcomm.ep.nvshmem`). Names load on
first use, so ``import mxcomm.ep`` costs nothing until one is touched.
"""
import importlib

_NAMES = {
    "EPConfig": ".config", "PATHS": ".config", "TRANSPORTS": ".config", "PRECISIONS": ".config",
    "LaunchConfig": ".nvshmem.launch_config",
    "EPGroup": ".group", "EPSteps": ".steps",
    "Dispatched": ".handle", "EPHandle": ".handle", "CombineSaved": ".handle", "CombineGrads": ".handle",
    "RoutingPlan": ".plan", "build_plan": ".plan", "local_counts": ".plan", "recv_rows": ".plan",
    "max_recv_rows": ".plan", "buffer_sizes": ".plan", "BufferSizes": ".plan",
    "EPEvent": ".streams", "Combined": ".streams",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    mod = _NAMES.get(name)
    if mod is None:
        raise AttributeError(f"module 'mxcomm.ep' has no attribute {name!r}")
    return getattr(importlib.import_module(mod, __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
