"""Configs of the drop-in MoE layer: :class:`RouterConfig` and :class:`MoEConfig` (frozen dataclasses).

Both validate themselves at construction (ValueError listing every problem) so a bad config fails before
any parameter is allocated or any collective runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..ep import EPConfig
from ..ep.config import ALIGNS, BACKENDS, PRECISIONS, SCALE_MODES
from ..gemm import GemmBackend

SCORE_FUNCS = ("softmax", "sigmoid")
SWIGLU_IMPLS = ("auto", "kernel", "reference")
CACHE_REFRESH = ("check", "auto")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class RouterConfig:
    """Top-k router options.

    Attributes:
        score_func: ``"softmax"`` (scores = softmax over all experts of the fp32 logits; Switch / Mixtral /
            DeepSeek-V2 style) or ``"sigmoid"`` (scores = sigmoid of each logit; DeepSeek-V3 style).
        norm_topk_prob: divide the k selected scores by their sum (so each token's route weights sum to 1).
            None = the usual default of the score function: False for softmax (weights are the raw softmax
            probabilities of the chosen experts), True for sigmoid. Softmax + ``True`` equals Mixtral's
            "top-k, then softmax over the k logits".
        route_scale: multiplies the final route weights (DeepSeek-V3 uses 2.5 with sigmoid); default 1.
        aux_loss_coef: coefficient ``alpha`` of the Switch-Transformer load-balancing loss
            ``alpha * E * sum_e f_e * P_e`` (``f_e``: fraction of this rank's (token, slot) assignments that
            went to expert ``e``, no gradient; ``P_e``: mean over this rank's tokens of the normalized score of
            ``e`` - the softmax probability, or for sigmoid ``s_e / sum_j s_j``). 0 = not computed. Equals
            ``alpha`` for a perfectly uniform router.
    """

    score_func: str = "softmax"
    norm_topk_prob: Optional[bool] = None
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0

    def __post_init__(self):
        errs = []
        if self.score_func not in SCORE_FUNCS:
            errs.append(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.norm_topk_prob is not None and not isinstance(self.norm_topk_prob, bool):
            errs.append(f"norm_topk_prob must be None or a bool, got {self.norm_topk_prob!r}")
        if not _is_real(self.route_scale) or self.route_scale <= 0:
            errs.append(f"route_scale must be a positive finite number, got {self.route_scale!r}")
        if not _is_real(self.aux_loss_coef) or self.aux_loss_coef < 0:
            errs.append(f"aux_loss_coef must be a finite number >= 0, got {self.aux_loss_coef!r}")
        if errs:
            raise ValueError("invalid RouterConfig: " + "; ".join(errs))

    @property
    def normalize(self) -> bool:
        """Whether the selected scores are renormalized (``norm_topk_prob`` with its default resolved)."""
        if self.norm_topk_prob is None:
            return self.score_func == "sigmoid"
        return self.norm_topk_prob


@dataclass(frozen=True)
class MoEConfig:
    """Configuration of one :class:`mxcomm.nn.MoE` layer (identical on every rank of its EP group).

    Attributes:
        dim: model width H (token rows); a multiple of 32 (one MX block).
        ffn_dim: hidden width F of each routed SwiGLU expert; a multiple of 32.
        num_experts: E, global number of routed experts (a multiple of the EP world size).
        topk: k, experts per token.
        precision: ``"bf16"``: BF16 dispatch/combine transport and BF16 grouped GEMMs (fp32 accumulation) on
            cached BF16 copies of the fp32 master weights (see ``bf16_weight_cache``);
            ``"mxfp8"``: MXFP8 transport, MXFP8 grouped GEMMs against cached MXFP8 copies of the fp32 master
            weights, fused SwiGLU + quantize (Triton on CUDA, plain-torch reference elsewhere), MXFP8 dgrad.
        shared_ffn_dim: hidden width of an always-on shared SwiGLU expert (0 = none); a multiple of 32.
        router: :class:`RouterConfig`.
        max_tokens_per_rank: the most tokens one rank passes per call (EP buffer capacity).
        scale_mode: MX scale rule, ``"rceil"`` (default) or ``"floor"``.
        align: expert groups in the dispatch output are padded to this many rows (32 or 128).
        ep_backend: ``"torch"`` (torch.distributed all-to-all: CPU/gloo or GPU/NCCL) or ``"nvshmem"`` (GPU).
        exact_sizes: see :class:`mxcomm.ep.EPConfig` (False = no host sync on the nvshmem backend).
        gemm_backend: forward/dgrad grouped-GEMM backend of the MXFP8 path (None = by device: native on
            sm_100/103, ``dequant`` on other GPUs, ``reference`` on CPU; see :mod:`mxcomm.gemm.backend`).
        quantize_dgrad: MXFP8 dgrad GEMMs (``grad_y`` quantized); False = BF16 dgrad on the dequantized copy.
        swiglu_impl: fused SwiGLU + quantize of the MXFP8 path: ``"auto"`` (Triton kernel for CUDA tensors,
            plain-torch reference math otherwise), ``"kernel"`` (always the Triton kernel: a CUDA tensor, or a
            CPU tensor under ``TRITON_INTERPRET=1``), ``"reference"``.
        bf16_weight_cache: ``precision="bf16"`` only: keep a BF16 copy of each fp32 expert master
            (:class:`mxcomm.gemm.weights.BF16WeightCache`, 2 bytes per weight), cast once per refresh (after
            each optimizer step) instead of in every forward and again in every backward. Outputs and
            gradients are bit-identical either way. False = cast per call (no extra memory, no refresh needed).
            Not built for bfloat16 masters (nothing to cast).
        cache_refresh: what the weight caches (MXFP8, and BF16 with ``bf16_weight_cache``) do when the master
            weights changed since their last refresh: ``"check"`` (default) raises
            :class:`mxcomm.gemm.StaleWeightCacheError`; ``"auto"`` rebuilds them. Either way, call
            :meth:`MoE.attach_optimizer` (or :meth:`MoE.refresh_caches` after each step): only that also sees
            updates the version counter misses (fused optimizers, ``p.data``).
        ep_timeout_s: bound on every wait of the nvshmem backend.
    """

    dim: int
    ffn_dim: int
    num_experts: int
    topk: int
    precision: str = "bf16"
    shared_ffn_dim: int = 0
    router: RouterConfig = field(default_factory=RouterConfig)
    max_tokens_per_rank: int = 8192
    scale_mode: str = "rceil"
    align: int = 32
    ep_backend: str = "torch"
    exact_sizes: bool = True
    gemm_backend: Optional[str] = None
    quantize_dgrad: bool = True
    swiglu_impl: str = "auto"
    bf16_weight_cache: bool = True
    cache_refresh: str = "check"
    ep_timeout_s: float = 30.0

    def __post_init__(self):
        errs = []
        for name in ("dim", "ffn_dim", "num_experts", "topk", "max_tokens_per_rank"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                errs.append(f"{name} must be a positive int, got {v!r}")
        if not _is_int(self.shared_ffn_dim) or self.shared_ffn_dim < 0:
            errs.append(f"shared_ffn_dim must be an int >= 0, got {self.shared_ffn_dim!r}")
        for name in ("dim", "ffn_dim", "shared_ffn_dim"):
            v = getattr(self, name)
            if _is_int(v) and v % 32:
                errs.append(f"{name} ({v}) must be a multiple of 32 (the MX block size)")
        if _is_int(self.topk) and _is_int(self.num_experts) and self.topk > self.num_experts:
            errs.append(f"topk ({self.topk}) must not exceed num_experts ({self.num_experts})")
        if self.precision not in PRECISIONS:
            errs.append(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.router, RouterConfig):
            errs.append(f"router must be a RouterConfig, got {type(self.router).__name__}")
        if self.scale_mode not in SCALE_MODES:
            errs.append(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        if self.align not in ALIGNS:
            errs.append(f"align must be one of {ALIGNS}, got {self.align!r}")
        if self.ep_backend not in BACKENDS:
            errs.append(f"ep_backend must be one of {BACKENDS}, got {self.ep_backend!r}")
        if not isinstance(self.exact_sizes, bool):
            errs.append(f"exact_sizes must be a bool, got {self.exact_sizes!r}")
        if self.gemm_backend is not None:
            try:
                GemmBackend(self.gemm_backend)
            except ValueError:
                errs.append(f"gemm_backend must be None or one of {[b.value for b in GemmBackend]}, "
                            f"got {self.gemm_backend!r}")
        if not isinstance(self.quantize_dgrad, bool):
            errs.append(f"quantize_dgrad must be a bool, got {self.quantize_dgrad!r}")
        if self.swiglu_impl not in SWIGLU_IMPLS:
            errs.append(f"swiglu_impl must be one of {SWIGLU_IMPLS}, got {self.swiglu_impl!r}")
        if not isinstance(self.bf16_weight_cache, bool):
            errs.append(f"bf16_weight_cache must be a bool, got {self.bf16_weight_cache!r}")
        if self.cache_refresh not in CACHE_REFRESH:
            errs.append(f"cache_refresh must be one of {CACHE_REFRESH}, got {self.cache_refresh!r}")
        if not _is_real(self.ep_timeout_s) or self.ep_timeout_s <= 0:
            errs.append(f"ep_timeout_s must be a positive finite number, got {self.ep_timeout_s!r}")
        if errs:
            raise ValueError("invalid MoEConfig: " + "; ".join(errs))

    def ep_config(self) -> EPConfig:
        """The :class:`mxcomm.ep.EPConfig` of this layer's dispatch/combine (transport precision = ``precision``)."""
        return EPConfig(
            num_experts=self.num_experts, hidden=self.dim, topk=self.topk,
            max_tokens_per_rank=self.max_tokens_per_rank, align=self.align, precision=self.precision,
            scale_mode=self.scale_mode, backend=self.ep_backend, timeout_s=float(self.ep_timeout_s),
            exact_sizes=self.exact_sizes,
        )


__all__ = ["RouterConfig", "MoEConfig", "SCORE_FUNCS", "PRECISIONS", "SWIGLU_IMPLS", "CACHE_REFRESH"]
