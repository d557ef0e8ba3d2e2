"""Top-k token router (softmax or sigmoid scores) and the Switch-Transformer load-balancing loss.

The router always runs in fp32 (autocast disabled): ``logits = x.float() @ W.float()^T``. Selection is
``torch.topk`` over the scores (ties: torch's order), so the k experts of a token are distinct and no slot
is ever dropped (dropless routing: every token reaches k experts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import RouterConfig


@dataclass(frozen=True)
class RouterOutput:
    """Result of :class:`Router` for ``T`` tokens.

    Attributes:
        topk_idx: int64 ``[T, k]`` global expert ids (distinct per row), in descending score order.
        topk_weights: float32 ``[T, k]`` route weights (differentiable w.r.t. the router weight and x).
        scores: float32 ``[T, E]`` softmax probabilities or sigmoid scores (differentiable).
        aux_loss: float32 scalar ``aux_loss_coef * E * sum_e f_e P_e`` (differentiable through ``P``), or
            None when ``aux_loss_coef == 0``.
        tokens_per_expert: int64 ``[E]`` assignments per expert on this rank (for logging / balancing).
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    scores: torch.Tensor
    aux_loss: Optional[torch.Tensor]
    tokens_per_expert: torch.Tensor


def load_balancing_loss(scores: torch.Tensor, topk_idx: torch.Tensor, score_func: str = "softmax") -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``E * sum_e f_e * P_e`` (without the coefficient).

    Args:
        scores: float ``[T, E]`` router scores (softmax probabilities, or sigmoid scores).
        topk_idx: int ``[T, k]`` selected experts (ids < 0 are ignored).
        score_func: ``"softmax"`` (``P_e = mean_t scores[t, e]``) or ``"sigmoid"`` (scores normalized per token
            first: ``P_e = mean_t scores[t, e] / sum_j scores[t, j]``).
    Returns:
        float32 scalar; ``f_e`` = fraction of the valid (token, slot) assignments that chose ``e`` (no gradient),
        so the gradient flows through ``P`` only. 1.0 for a perfectly uniform router; 0 (still attached to the
        graph) when there are no tokens.
    """
    if scores.dim() != 2 or topk_idx.dim() != 2 or scores.shape[0] != topk_idx.shape[0]:
        raise ValueError(f"scores [T, E] and topk_idx [T, k] must agree in T, got {tuple(scores.shape)} and "
                         f"{tuple(topk_idx.shape)}")
    T, E = scores.shape
    s = scores.float()
    if score_func == "sigmoid":
        s = s / s.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    elif score_func != "softmax":
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    idx = topk_idx.reshape(-1)
    idx = idx[idx >= 0]
    if T == 0 or idx.numel() == 0:
        return s.sum() * 0.0
    f = torch.bincount(idx.to(torch.int64), minlength=E).to(torch.float32) / idx.numel()
    p = s.mean(dim=0)
    return E * (f * p).sum()


class Router(nn.Module):
    """Linear gate ``[E, H]`` + score function + top-k.

    Args:
        dim: H. num_experts: E. topk: k. config: :class:`RouterConfig`.
        device / dtype: of the gate weight (fp32 recommended: it is the master; compute is fp32 regardless).

    Parameters:
        weight: ``[E, H]`` (``logits = x @ weight^T``), replicated on every rank (average its gradient across
            data-parallel ranks like any dense weight).
    """

    def __init__(self, dim: int, num_experts: int, topk: int, config: Optional[RouterConfig] = None, *,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.config = config or RouterConfig()
        if not isinstance(self.config, RouterConfig):
            raise TypeError(f"config must be a RouterConfig, got {type(self.config).__name__}")
        if not (1 <= topk <= num_experts):
            raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
        self.dim, self.num_experts, self.topk = dim, num_experts, topk
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x [T, H]`` (any float dtype); see :class:`RouterOutput`."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"Router expects x of shape [T, {self.dim}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"Router expects a floating x, got {x.dtype}")
        cfg = self.config
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
            scores = torch.softmax(logits, dim=-1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
            top_s, idx = torch.topk(scores, self.topk, dim=-1)
            w = top_s
            if cfg.normalize:
                w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            if cfg.route_scale != 1.0:
                w = w * cfg.route_scale
            aux = None
            if cfg.aux_loss_coef > 0:
                aux = cfg.aux_loss_coef * load_balancing_loss(scores, idx, cfg.score_func)
        counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
        return RouterOutput(topk_idx=idx, topk_weights=w, scores=scores, aux_loss=aux, tokens_per_expert=counts)

    def extra_repr(self) -> str:
        c = self.config
        return (f"dim={self.dim}, num_experts={self.num_experts}, topk={self.topk}, score_func={c.score_func}, "
                f"normalize={c.normalize}, route_scale={c.route_scale}, aux_loss_coef={c.aux_loss_coef}")


__all__ = ["Router", "RouterOutput", "load_balancing_loss"]
