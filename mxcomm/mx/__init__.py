"""Format layer: E4M3/E8M0 rules, the MXTensor value type, reference quantize/dequantize, scale layouts.

Knows nothing of kernels or communication.
"""
from .layouts import (
    blocked_index,
    blocked_shape,
    from_blocked,
    from_grouped_k,
    from_grouped_m,
    grouped_k_cols,
    grouped_k_index,
    grouped_k_placement,
    grouped_m_row_map,
    grouped_m_rows,
    round_up,
    to_blocked,
    to_grouped_k,
    to_grouped_m,
)
from .reference import check_quantizable, quantize
from .scales import (BLOCK, E4M3_MAX, SCALE_MODES, finite_max, saturate_finite, scale_bytes_from_amax, scale_reciprocal,
                     scale_value)
from .tensor import MXTensor, ScaleLayout, dequantize

__all__ = [
    "BLOCK", "E4M3_MAX", "SCALE_MODES", "MXTensor", "ScaleLayout", "quantize", "dequantize",
    "check_quantizable", "finite_max", "saturate_finite", "scale_bytes_from_amax", "scale_reciprocal", "scale_value",
    "to_blocked", "from_blocked", "to_grouped_m", "from_grouped_m", "to_grouped_k", "from_grouped_k",
    "grouped_m_rows", "grouped_m_row_map", "grouped_k_cols", "grouped_k_index", "grouped_k_placement", "blocked_index", "blocked_shape", "round_up",
]
