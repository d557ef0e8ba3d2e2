"""Benchmark inputs (activations, top-k routing) and the traffic they cause (row counts per convention).

Inputs are a pure function of (seed, rank, tokens, sizes, device): every phase of a run (and
every implementation measured) sees the same rows and the same routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ep.plan import RoutingPlan, build_plan, local_counts, send_tokens


@dataclass(frozen=True)
class BenchInputs:
    """One rank's dispatch inputs.

    x: bfloat16 ``[T, H]`` (normal values times a per-row power-of-two-ish magnitude, never zeros);
    topk_idx: int64 ``[T, k]`` distinct experts per token (uniformly random), no dropped slots;
    topk_weights: float32 ``[T, k]`` softmax weights.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def make_inputs(*, seed: int, rank: int, tokens: int, hidden: int, topk: int, experts: int,
                device: torch.device) -> BenchInputs:
    """Deterministic random inputs for one rank (generated on ``device``)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + rank * 7919 + tokens * 31 + hidden) % (2**63))
    scale = torch.exp2(torch.randint(-6, 7, (tokens, 1), generator=g, device=device).to(torch.float32))
    x = (torch.randn(tokens, hidden, generator=g, device=device) * scale).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=g, device=device)
    idx = torch.topk(scores, topk, dim=1).indices.to(torch.int64)
    w = torch.softmax(torch.randn(tokens, topk, generator=g, device=device), dim=1)
    return BenchInputs(x=x.contiguous(), topk_idx=idx.contiguous(), topk_weights=w.contiguous())


@dataclass(frozen=True)
class Traffic:
    """Rows each rank receives in dispatch (and sends back in combine), by byte convention.

    rows_dedup: ``[W]`` per destination rank: (source token, destination rank) pairs, a token counted
        once per destination rank however many of its experts there (DeepEP's convention), local included.
    rows_sel: ``[W]`` per destination rank: (token, expert) selections routed to it (per-selection convention).
    """

    rows_dedup: list
    rows_sel: list

    @property
    def mean_rows_dedup(self) -> float:
        return sum(self.rows_dedup) / len(self.rows_dedup)

    @property
    def mean_rows_sel(self) -> float:
        return sum(self.rows_sel) / len(self.rows_sel)


def dedup_dest_counts(topk_idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """int64 ``[W]``: this rank's tokens with at least one valid expert on each rank (CPU tensor)."""
    idx = topk_idx.to(torch.int64).cpu()
    T = idx.shape[0]
    el = num_experts // world
    hit = torch.zeros(T, world + 1, dtype=torch.bool)
    dest = torch.where(idx >= 0, idx // el, torch.full_like(idx, world))
    hit.scatter_(1, dest, True)
    return hit[:, :world].sum(0)


@dataclass(frozen=True)
class RoutingInfo:
    """Routing of one token count as every rank sees it (host side, for the baselines).

    plan: this rank's :class:`RoutingPlan` (CPU tensors).
    send_splits / recv_splits: python lists ``[W]`` of rows (per selection).
    send_tok: int64 ``[n_send]`` token of each row in send order (CPU).
    traffic: :class:`Traffic` of the whole world.
    """

    plan: RoutingPlan
    send_splits: list
    recv_splits: list
    send_tok: torch.Tensor
    traffic: Traffic


def exchange_routing(world, inputs: BenchInputs, *, experts: int, align: int) -> RoutingInfo:
    """All-gather counts over the world's control group and build this rank's plan (collective)."""
    W = world.world
    mine = (local_counts(inputs.topk_idx, experts).cpu().tolist(), dedup_dest_counts(inputs.topk_idx, experts, W).tolist())
    allv = world.all_gather_object(mine)
    counts = torch.tensor([c for c, _ in allv], dtype=torch.int64)       # [W, E]
    dedup = torch.tensor([d for _, d in allv], dtype=torch.int64)        # [W_src, W_dst]
    plan = build_plan(counts, inputs.topk_idx.cpu(), world.rank, align)
    send_splits = plan.send_splits.tolist()
    recv_splits = plan.recv_splits.tolist()
    el = experts // W
    rows_sel = counts.view(W, W, el).sum(dim=(0, 2)).tolist()             # per destination rank
    traffic = Traffic(rows_dedup=dedup.sum(0).tolist(), rows_sel=rows_sel)
    return RoutingInfo(plan=plan, send_splits=send_splits, recv_splits=recv_splits,
                       send_tok=send_tokens(plan, sum(send_splits)), traffic=traffic)


def bytes_per_row(precision: str, hidden: int) -> int:
    """Bytes one row carries: MXFP8 ``H + H/32`` (E4M3 payload + E8M0 scales), BF16 ``2H``."""
    if precision == "mxfp8":
        return hidden + hidden // 32
    if precision == "bf16":
        return 2 * hidden
    raise ValueError(f"unknown precision {precision!r}")


__all__ = ["BenchInputs", "make_inputs", "Traffic", "RoutingInfo", "exchange_routing", "bytes_per_row",
           "dedup_dest_counts"]
