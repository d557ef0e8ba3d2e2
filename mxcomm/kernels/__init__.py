"""Kernels layer: Triton MXFP8 kernels (quantize / dequantize) and reusable device functions.

``mxcomm.kernels.mx_device`` holds the ``@triton.jit`` building blocks (scale bytes, E4M3 rounding,
tile quantize, blocked scale offsets) that other kernels import to quantize in registers;
``mxcomm.kernels.launch.fast_kernel`` launches a kernel for less host time than ``kernel[grid](...)``.

CPU tensors run only under Triton's interpreter: set ``TRITON_INTERPRET=1`` before this package is
first imported.
"""
from . import mx_device
from .launch import FastKernel, fast_kernel
from .mx_device import SCALE_MODE_FLOOR, SCALE_MODE_IDS, SCALE_MODE_RCEIL
from .quantize import (
    QuantizeConfig,
    default_cols_config,
    default_rows_config,
    dequantize,
    interpret_mode,
    quantize_cols,
    quantize_rows,
)

__all__ = [
    "mx_device", "SCALE_MODE_IDS", "SCALE_MODE_RCEIL", "SCALE_MODE_FLOOR", "QuantizeConfig",
    "quantize_rows", "quantize_cols", "dequantize", "default_rows_config", "default_cols_config",
    "interpret_mode", "fast_kernel", "FastKernel",
]
