"""mxcomm: MXFP8 expert-parallel communication.

Layers (imports point down only): ``mx`` (format) -> ``kernels`` -> ``transport`` -> ``ep`` -> ``gemm`` -> ``nn``.
``import mxcomm`` works on a CPU-only machine; GPU extras (nvshmem4py, cuda-python) load lazily. The names below
are loaded on first use (PEP 562), so ``import mxcomm`` (and the ``mxcomm`` command's ``--help``) does not import
torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["MXTensor", "ScaleLayout", "quantize", "dequantize", "__version__"]

_LAZY = {"MXTensor": ".mx", "ScaleLayout": ".mx", "quantize": ".mx", "dequantize": ".mx"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
