"""GEMM layer: grouped MXFP8 GEMMs for MoE experts, MXFP8 weight caches, autograd for the expert projection.

* :func:`grouped_mm` (MXFP8 activations x cached MXFP8 / dense weights), :func:`grouped_mm_bf16`,
  :func:`grouped_wgrad` (fp32 expert weight gradient), fp32 oracles :func:`reference_grouped_mm` /
  :func:`reference_grouped_wgrad`.
* Backends (:mod:`mxcomm.gemm.backend`): ``native`` (``torch._scaled_grouped_mm``, sm_100/sm_103 only - never
  launched on sm_90, where it kills the CUDA context), ``dequant`` (dequantize + BF16 ``torch._grouped_mm``;
  the Hopper default), ``triton`` (Triton grouped GEMM decoding E4M3 in its load path), ``reference`` (CPU).
  On Hopper MXFP8 is emulated: the arithmetic is BF16 on the dequantized values.
* :class:`MXWeightCache`: forward (blocks along K) and dgrad (blocks along N) MXFP8 copies of the fp32 master,
  ``refresh()`` after each optimizer step; stale use raises. :class:`BF16WeightCache`: the BF16 copy of the master
  (the BF16 path's weight, cast once per refresh instead of in every forward and backward), same rules.
* :class:`MXGroupedLinear` / :func:`grouped_linear`: autograd Function.
"""
from .autograd import GroupedLinearConfig, MXGroupedLinear, grouped_linear
from .backend import (
    EMULATED_DEFAULT,
    GemmBackend,
    check_native_allowed,
    device_capability,
    native_mxfp8_supported,
    select_backend,
)
from .grouped import (
    grouped_mm,
    grouped_mm_bf16,
    grouped_wgrad,
    native_args,
    reference_grouped_mm,
    reference_grouped_wgrad,
)
from .triton_gemm import (
    GroupedGemmConfig,
    default_gemm_config,
    fit_k_step,
    triton_grouped_mm,
    triton_grouped_wgrad,
    zero_rows_past_end,
)
from .weights import BF16WeightCache, MXWeight, MXWeightCache, StaleWeightCacheError

__all__ = [
    "grouped_mm", "grouped_mm_bf16", "grouped_wgrad", "reference_grouped_mm", "reference_grouped_wgrad",
    "native_args", "GemmBackend", "EMULATED_DEFAULT", "select_backend", "native_mxfp8_supported",
    "check_native_allowed", "device_capability", "BF16WeightCache", "MXWeight", "MXWeightCache", "StaleWeightCacheError",
    "MXGroupedLinear", "GroupedLinearConfig", "grouped_linear", "GroupedGemmConfig", "default_gemm_config",
    "fit_k_step",
    "triton_grouped_mm", "triton_grouped_wgrad", "zero_rows_past_end",
]
