"""mxcomm as a torchtitan (0.3) expert-parallel token dispatcher: :class:`MXCommTokenDispatcher`.

torchtitan's ``RoutedExperts`` runs ``dispatch -> GroupedExperts -> combine`` through a pluggable
``BaseEPTokenDispatcher`` (``torchtitan/models/common/token_dispatcher.py``); a model picks one with
``MoE.Config.routed_experts.token_dispatcher``. This module plugs mxcomm's dispatch/combine in::

    from mxcomm.integrations.torchtitan import MXCommTokenDispatcher

    moe_cfg.routed_experts.token_dispatcher = MXCommTokenDispatcher.Config(
        num_experts=E, top_k=K, precision="mxfp8", backend="nvshmem",
        hidden_dim=model_dim,                        # torchtitan does not fill these two for this dispatcher
        num_max_tokens_per_rank=local_batch_size * seq_len,
    )

torchtitan then calls ``wire_meshes(ep_mesh=...)`` from ``RoutedExperts.parallelize`` (collective: it builds
the :class:`mxcomm.ep.EPGroup`). Without torchtitan's parallelize (a hand-built model) call
``dispatcher.wire_meshes(ep_mesh=mesh_or_None)`` yourself on every rank.

All mxcomm calls go through :func:`_dispatch` and :func:`_combine` below (``EPGroup.dispatch`` / ``EPGroup.combine``,
the autograd-aware public pair).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher

from ..ep.config import EPConfig
from ..ep.group import EPGroup
from ..ep.config import ALIGNS, BACKENDS, PRECISIONS, SCALE_MODES, TRANSPORTS


# --- the two calls into mxcomm's EP API --------------------------------------------------------------------
def _dispatch(group: EPGroup, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """Differentiable dispatch: bfloat16 ``x [T, H]``, int ``topk_idx [T, k]``, float ``topk_weights [T, k]``
    -> ``Dispatched`` (``x`` ``[R, H]`` MXFP8Tensor or bfloat16, ``offs``/``counts`` int32 ``[El]``, ``handle``)."""
    return group.dispatch(x, topk_idx, topk_weights)


def _combine(group: EPGroup, expert_out: torch.Tensor, handle, topk_weights: torch.Tensor) -> torch.Tensor:
    """Differentiable combine: bfloat16 ``expert_out [R, H]`` -> bfloat16 ``[T, H]``,
    ``y[t] = sum_j topk_weights[t, j] * expert_out[row(t, j)]`` (fp32 sum, j ascending)."""
    return group.combine(expert_out, handle, topk_weights=topk_weights)


# --- process groups and EP groups shared by all layers ------------------------------------------------------
# One EPGroup per (EPConfig, process group): every MoE layer of a model builds a dispatcher, and they share
# the group (the nvshmem backend allocates its symmetric buffers once per group).
_EP_GROUPS: dict = {}
_SELF_GROUP: list = []  # the cached one-rank process group of this process (EP off)


def _one_rank_group():
    """A process group holding only this rank (for EP off: every rank keeps all experts).

    Needs torch.distributed initialised. A world of 1 is its own WORLD group; in a larger world
    ``dist.new_subgroups(group_size=1)`` is called once per process (collective over WORLD: every rank builds
    the dispatchers, so every rank gets here in the same order) and cached.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "MXCommTokenDispatcher needs torch.distributed initialised, also with EP off (ep_mesh=None): "
            "launch with torchrun, or for one process call mxcomm.nn.init_single_process() (a gloo world of 1 "
            "over an in-memory store) before building the model"
        )
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    if not _SELF_GROUP:
        sub, _ = dist.new_subgroups(group_size=1)
        _SELF_GROUP.append(sub)
    return _SELF_GROUP[0]


def _shared_ep_group(config: EPConfig, pg) -> EPGroup:
    key = (config, pg)
    group = _EP_GROUPS.get(key)
    if group is None:
        group = EPGroup(config, pg)
        _EP_GROUPS[key] = group
    return group


@dataclass(frozen=True, kw_only=True)
class MXCommDispatchMetadata:
    """What :meth:`MXCommTokenDispatcher.dispatch` hands to ``combine``.

    Attributes:
        handle: the mxcomm ``EPHandle`` of the dispatch.
        topk_scores_TK: float ``[T, K]`` routing scores as the router returned them (attached to the autograd
            graph: combine applies them, so the router's gradient flows through them).
        offs: int32 ``[e]`` END offsets of the local experts' padded row groups.
        counts: int32 ``[e]`` real (unpadded) rows per local expert.
        num_rows: R, rows of the dispatch output (``offs[-1]``).
    """

    handle: object
    topk_scores_TK: torch.Tensor
    offs: torch.Tensor
    counts: torch.Tensor
    num_rows: int


class MXCommTokenDispatcher(BaseEPTokenDispatcher):
    """torchtitan EP token dispatcher backed by mxcomm (MXFP8 or BF16 payload).

    Contract (the one of torchtitan's ``BaseEPTokenDispatcher`` / ``AllToAllTokenDispatcher``):

    ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)``
        -> ``(routed_input_RD, num_tokens_per_local_expert_e, metadata)``.

        * ``routed_input_RD``: bfloat16 ``[R, D]``, the rows for this rank's ``e = E / ep`` local experts,
          expert-major (expert ``i``'s rows are ``[offs[i-1], offs[i])``; inside a group by source rank, then
          token, then slot), each group padded to a multiple of ``align`` with ZERO rows.
          ``x_TD`` may be any float dtype; it is cast to bfloat16 first (torchtitan's ``GroupedExperts`` runs
          its grouped GEMMs on ``x.bfloat16()`` anyway, so the experts see the same values).
        * ``num_tokens_per_local_expert_e``: int32 ``[e]``, the PADDED group sizes (``diff`` of mxcomm's group end
          offsets): ``GroupedExperts`` takes their ``cumsum`` as ``torch._grouped_mm`` offsets, so they sum to
          ``R``. Padding rows are zero, so the experts map them to zero (no bias in ``GroupedExperts``) and
          combine never reads them; their gradients are zero.
        * ``num_local_tokens_per_expert_E`` is not used (mxcomm computes the counts from the expert ids, as
          torchtitan's DeepEP / HybridEP dispatchers do).
        * Expert ids must be valid (``0 <= id < E``, no repeated expert in one token's row; torchtitan's router
          never drops a slot), ``T <= num_max_tokens_per_rank``.

    ``combine(routed_output_RD, metadata, x_TD)`` -> ``[T, D]`` in ``x_TD``'s dtype:
        ``out[t] = sum_k topk_scores_TK[t, k] * routed_output[row(t, k)]``, products and sum in fp32 (k
        ascending), rounded once to bfloat16, then cast to ``x_TD``'s dtype. Padding rows are ignored.
        As in torchtitan 0.3 the scores are applied here, after the experts (0.3 has no
        ``score_before_experts``; ``route_scale`` / ``route_norm`` are already folded into the scores by the
        router). Differentiable in ``routed_output_RD`` (-> the experts), ``topk_scores_TK`` (-> the router:
        ``grad_score[t, k] = <grad_out[t], routed_output[row(t, k)]>``, its only gradient path) and ``x_TD``
        (through dispatch). ``x_TD`` itself is only used for the output dtype. ``routed_output_RD`` must have
        ``routed_input_RD``'s shape; it is cast to bfloat16 (mxcomm moves BF16 / MXFP8 rows).

    Differences to torchtitan's ``AllToAllTokenDispatcher`` (all within its contract): the output is rounded to
    bfloat16 once after an fp32 sum (torchtitan rounds each scored row to the routed output's dtype and
    scatter-adds in ``x_TD``'s dtype); the padded counts (like ``TorchAOTokenDispatcher``).

    MXFP8 (``precision="mxfp8"``): rows travel as E4M3 + one E8M0 scale per 32 values (``33/32`` bytes per value
    instead of 2), combine returns them MXFP8-quantized too, and both backward passes move MXFP8 gradients.
    torchtitan's experts on Hopper are the BF16 ``GroupedExperts`` (its MXFP8 grouped GEMM needs sm_100), so the
    received rows are dequantized right after the receive (``Dispatched.dense()``): one extra pass over the
    received rows, reading ``R * (H + H/32)`` bytes (payload + scales) and writing ``R * 2H`` bytes of
    bfloat16 (``R = routed_input_RD.shape[0]``, ``H = D``); its backward is a pass-through.
    Handing the MX rows themselves to torchtitan 0.3's MXFP8 grouped GEMM is not possible through its API:
    ``MXFP8GroupedExpertsConverter`` replaces any dispatcher that is not ``AllToAllTokenDispatcher`` /
    ``HybridEPTokenDispatcher`` (``swap_token_dispatcher`` raises ``ValueError`` for this one), its only
    recipe (``mxfp8_rceil``) quantizes ``A`` itself, and torchao 0.18 accepts a pre-quantized ``A`` only with
    ``wgrad_with_hp`` and ROW scales (:func:`mxcomm.integrations.torchao.to_torchao_grouped_mm_input` makes
    such a tensor from the dispatch output for code that calls torchao directly; its emulated forward is
    tested on CPU). In torchao 0.18 that pre-quantized path is itself unfinished: the sm_100 forward reads
    ``A.scales`` (the attribute is ``scale``) and the wgrad dequantizes ``A`` with a Triton kernel.

    EP off (``ep_mesh is None``): every rank holds all ``E`` experts; the dispatcher still runs mxcomm, over a
    process group of this rank alone (same layout, same MXFP8 rounding as with EP, no communication
    beyond the rank itself). torch.distributed must be initialised (see :func:`_one_rank_group`).
    torchtitan's own ``AllToAllTokenDispatcher`` falls back to ``LocalTokenDispatcher`` there;
    ``TorchAOTokenDispatcher`` pads locally; DeepEP / HybridEP / MinimalAsyncEP refuse EP off.

    Collective: ``wire_meshes`` / ``init_buffer``, every dispatch, combine and both backward passes run on all
    ranks of the EP group in the same order (true when all ranks run the same model, as in torchtitan).
    Not supported: ``torch.compile`` of dispatch/combine without graph breaks (exact output sizes), CUDA-graph
    capture, expert tensor parallelism (experts must see whole rows).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        """Config of :class:`MXCommTokenDispatcher` (besides ``num_experts`` / ``top_k``).

        Attributes:
            precision: ``"bf16"`` or ``"mxfp8"`` (dispatch payload, combine transport, gradient transport).
            hidden_dim: D, the model dim (a multiple of 32). Required. torchtitan's
                ``update_ep_token_dispatcher_config`` fills it (and ``num_max_tokens_per_rank``) only for its own
                DeepEP / HybridEP / MinimalAsyncEP dispatchers, so the trainer must set both for this one.
            num_max_tokens_per_rank: the most tokens ``T`` one rank passes to dispatch (buffer capacity; with
                torchtitan's padding ``local_batch_size * seq_len / (cp * tp)``). Required.
            backend: ``"torch"`` (torch.distributed all-to-all; CPU/gloo or GPU/NCCL; the reference) or
                ``"nvshmem"`` (GPU kernels over NVSHMEM symmetric buffers).
            align: 32 or 128: expert groups are padded to a multiple of this (32 is what MXFP8 grouped GEMMs
                need; 128 makes the grouped scales identical to one whole-matrix 128x4 swizzle).
            scale_mode: MX scale rule, ``"rceil"`` (default) or ``"floor"``.
            num_sms: SMs the nvshmem kernels may use (None = backend default).
            transport: nvshmem transport, ``"auto"`` / ``"push"`` / ``"put"`` (see :class:`mxcomm.ep.EPConfig`).
            timeout_s: bound on every wait of the nvshmem backend.
        """

        precision: str = "mxfp8"
        hidden_dim: Optional[int] = None
        num_max_tokens_per_rank: Optional[int] = None
        backend: str = "torch"
        align: int = 32
        scale_mode: str = "rceil"
        num_sms: Optional[int] = None
        transport: str = "auto"
        timeout_s: float = 30.0

    def __init__(self, config: Config):
        super().__init__(config)
        errs = []
        for name, allowed in (("precision", PRECISIONS), ("backend", BACKENDS), ("align", ALIGNS),
                              ("scale_mode", SCALE_MODES), ("transport", TRANSPORTS)):
            if getattr(config, name) not in allowed:
                errs.append(f"{name} must be one of {allowed}, got {getattr(config, name)!r}")
        for name in ("hidden_dim", "num_max_tokens_per_rank"):
            v = getattr(config, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                errs.append(f"{name} must be a positive int or None, got {v!r}")
        if errs:
            raise ValueError("invalid MXCommTokenDispatcher.Config: " + "; ".join(errs))
        self.config = config
        self.group: Optional[EPGroup] = None

    # -- EP group ------------------------------------------------------------------------------------------
    def ep_config(self) -> EPConfig:
        """The :class:`mxcomm.ep.EPConfig` this dispatcher's group uses (``exact_sizes=True``: the row count is
        exact, so the padded counts sum to it)."""
        c = self.config
        missing = [n for n in ("hidden_dim", "num_max_tokens_per_rank") if getattr(c, n) is None]
        if missing:
            raise ValueError(
                f"MXCommTokenDispatcher.Config needs {' and '.join(missing)} (torchtitan fills them only for its "
                "own DeepEP/HybridEP/MinimalAsyncEP dispatchers: set them when building the model config)"
            )
        return EPConfig(
            num_experts=self.num_experts, hidden=c.hidden_dim, topk=self.top_k,
            max_tokens_per_rank=c.num_max_tokens_per_rank, align=c.align, precision=c.precision,
            scale_mode=c.scale_mode, backend=c.backend, num_sms=c.num_sms, timeout_s=c.timeout_s,
            exact_sizes=True, transport=c.transport,
        )

    def init_buffer(self) -> None:
        """Build (or reuse) the :class:`mxcomm.ep.EPGroup` over ``ep_mesh.get_group()``, or over a one-rank
        group when ``ep_mesh is None``. Collective over the EP group (over WORLD the first time EP is off in a
        world of several ranks)."""
        cfg = self.ep_config()
        pg = _one_rank_group() if self.ep_mesh is None else self.ep_mesh.get_group()
        self.group = _shared_ep_group(cfg, pg)

    def _require_group(self) -> EPGroup:
        if self.group is None:
            raise RuntimeError(
                "MXCommTokenDispatcher has no EP group yet: torchtitan calls wire_meshes(ep_mesh=...) from "
                "RoutedExperts.parallelize; without it call dispatcher.wire_meshes(ep_mesh=mesh_or_None) on every rank"
            )
        return self.group

    # -- dispatch / combine --------------------------------------------------------------------------------
    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, MXCommDispatchMetadata]:
        """Send each token to its top-k experts' ranks (see the class docstring for the layout).

        Args:
            x_TD: float ``[T, D]`` local tokens (cast to bfloat16; differentiable).
            topk_scores_TK: float ``[T, K]`` routing scores (kept for combine).
            topk_expert_ids_TK: int ``[T, K]`` global expert ids.
            num_local_tokens_per_expert_E: ``[E]`` (unused).
        Returns:
            ``routed_input_RD`` bfloat16 ``[R, D]`` (expert-major, zero-padded groups),
            ``num_tokens_per_local_expert_e`` int32 ``[e]`` (padded, ``sum == R``), :class:`MXCommDispatchMetadata`.
        """
        del num_local_tokens_per_expert_E
        group = self._require_group()
        d = _dispatch(group, x_TD.to(torch.bfloat16), topk_expert_ids_TK, topk_scores_TK)
        routed_input_RD = d.dense(torch.bfloat16)  # MXFP8: dequantize after the receive; BF16: as received
        offs = d.offs
        padded_counts_e = torch.diff(offs, prepend=offs.new_zeros(1)) if offs.numel() else offs
        meta = MXCommDispatchMetadata(handle=d.handle, topk_scores_TK=topk_scores_TK, offs=offs, counts=d.counts,
                                      num_rows=d.num_rows)
        return routed_input_RD, padded_counts_e, meta

    def combine(
        self,
        routed_output_RD: torch.Tensor,
        metadata: MXCommDispatchMetadata,
        x_TD: torch.Tensor,
    ) -> torch.Tensor:
        """Return expert outputs to their tokens, scaled by the routing scores and summed over k.

        Args:
            routed_output_RD: float ``[R, D]`` in ``routed_input_RD``'s layout (cast to bfloat16).
            metadata: from :meth:`dispatch`.
            x_TD: ``[T, D]`` the dispatch input (only its dtype is used).
        Returns:
            ``[T, D]`` in ``x_TD``'s dtype.
        """
        if not isinstance(metadata, MXCommDispatchMetadata):
            raise TypeError(f"metadata must come from MXCommTokenDispatcher.dispatch, got {type(metadata).__name__}")
        group = self._require_group()
        y = _combine(group, routed_output_RD.to(torch.bfloat16), metadata.handle, metadata.topk_scores_TK)
        return y.to(x_TD.dtype)


__all__ = ["MXCommTokenDispatcher", "MXCommDispatchMetadata"]
