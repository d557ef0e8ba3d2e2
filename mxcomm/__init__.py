"""mxcomm: MXFP8 expert-parallel communication.

Layers (imports point down only): ``mx`` (format) -> ``kernels`` -> ``transport`` -> ``ep`` -> ``gemm`` -> ``nn``.
``import mxcomm`` works on a CPU-only machine; GPU extras (nvshmem4py, cuda-python) load lazily.
"""
from .mx import MXTensor, ScaleLayout, dequantize, quantize

__version__ = "0.1.0"
__all__ = ["MXTensor", "ScaleLayout", "quantize", "dequantize", "__version__"]
