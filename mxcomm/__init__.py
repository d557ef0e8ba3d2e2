"""mxcomm: MXFP8 expert-parallel communication.

Layers are subpackages, imports point down only: ``mx`` (the format) -> ``kernels`` (Triton) and ``transport``
(NVSHMEM bootstrap, symmetric heap, signals) -> ``ep`` (dispatch/combine) -> ``gemm`` (grouped GEMMs) -> ``nn``
(the MoE layer); ``bench`` and ``cli`` sit on top, ``integrations`` (torchtitan, torchao) beside them.
``import mxcomm`` loads nothing heavy: the names below load on first use (GPU extras such as nvshmem4py and
cuda-python load only when a GPU path needs them).
"""
import importlib

__version__ = "0.1.0"

_NAMES = {"MXTensor": ".mx", "ScaleLayout": ".mx", "quantize": ".mx", "dequantize": ".mx"}

__all__ = ["MXTensor", "ScaleLayout", "quantize", "dequantize", "__version__"]


def __getattr__(name):
    mod = _NAMES.get(name)
    if mod is None:
        raise AttributeError(f"module 'mxcomm' has no attribute {name!r}")
    return getattr(importlib.import_module(mod, __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
