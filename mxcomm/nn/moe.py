"""The drop-in expert-parallel MoE layer: router -> dispatch -> grouped SwiGLU experts -> combine (+ shared expert).

    import torch.distributed as dist
    from mxcomm.nn import MoE, MoEConfig, RouterConfig, make_ep_group

    dist.init_process_group("nccl")            # gloo on CPU; mxcomm.nn.init_single_process() for a world of 1
    cfg = MoEConfig(dim=2048, ffn_dim=1408, num_experts=64, topk=6, precision="mxfp8", shared_ffn_dim=2816,
                    router=RouterConfig(score_func="softmax", aux_loss_coef=1e-2), max_tokens_per_rank=8192)
    ep = make_ep_group(cfg)                    # one EPGroup per config, shared by all layers (collective)
    moe = MoE(cfg, ep_group=ep, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    moe.attach_optimizer(opt)                  # weight caches (MXFP8 / BF16) rebuilt after every opt.step()
    y = moe(x)                                 # x [..., dim] any float dtype -> y like x
    loss = task_loss(y) + moe.aux_loss         # aux_loss: None unless router.aux_loss_coef > 0

Expert parallelism: the EP group's world ``W`` splits the ``E`` experts into ``E/W`` local experts per rank
(rank ``r`` holds global experts ``[r*E/W, (r+1)*E/W)``: :attr:`MoE.local_experts`). Each rank passes its own
tokens; dispatch/combine move them to the experts' ranks and back (:meth:`mxcomm.ep.EPGroup.dispatch` / ``combine``), both in forward
and backward (collective: every rank must run every forward and backward of the layer, also with 0 tokens).
The router and the shared expert are replicated: average their gradients across data-parallel ranks as for any
dense weight. Expert weights are sharded: their gradients already hold every rank's tokens.

Memory (per rank): fp32 masters ``4 * (3*E/W*F*H + 3*Fs*H + E*H)`` bytes; ``precision="mxfp8"`` adds the
persistent MXFP8 weight caches, 2 x 33/32 bytes per expert (and shared-expert) weight (forward copy blocked
along K, dgrad copy blocked along N; :class:`mxcomm.gemm.MXWeightCache`); ``precision="bf16"`` with
``bf16_weight_cache=True`` (the default) adds a BF16 copy, 2 bytes per expert (and shared-expert) weight
(:class:`mxcomm.gemm.weights.BF16WeightCache`), in exchange for not casting the fp32 masters in every forward and
backward. The router weight is never cached (it runs in fp32).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..ep import EPGroup
from ..gemm import GroupedLinearConfig, MXWeightCache, StaleWeightCacheError
from ..gemm.weights import BF16WeightCache
from .config import MoEConfig
from .experts import ExpertOptions, grouped_swiglu
from .router import Router, RouterOutput

# EPConfig fields that must agree with the MoEConfig when a user passes their own EPGroup
_EP_FIELDS = ("num_experts", "hidden", "topk", "precision", "scale_mode")


def make_ep_group(config: MoEConfig, process_group=None) -> EPGroup:
    """The :class:`mxcomm.ep.EPGroup` for ``config`` over ``process_group`` (None = WORLD).

    Collective (checks the config on every rank; the nvshmem backend allocates its symmetric buffers). Build it
    once and pass it to every :class:`MoE` layer with this config."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    return EPGroup(config.ep_config(), process_group)


def init_single_process(backend: str = "gloo") -> None:
    """Initialise a torch.distributed world of 1 in this process (an in-memory store, no network), so that
    :class:`MoE` runs without a launcher. No-op if torch.distributed is already initialised."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class MoE(nn.Module):
    """Expert-parallel mixture of SwiGLU experts with a top-k router (see the module docstring).

    Args:
        config: :class:`MoEConfig`.
        ep_group: an :class:`mxcomm.ep.EPGroup` whose config matches ``config`` (num_experts, dim, topk,
            precision, scale_mode); shared by all layers. None: built here over ``process_group``
            (collective; needs torch.distributed initialised).
        process_group: torch.distributed group for a group built here (None = WORLD).
        device: where the parameters live (CPU tensors run the reference backends; CUDA the GPU kernels).

    Parameters (fp32 masters):
        router.weight ``[E, H]``; w13 ``[E_local, 2F, H]`` (gate rows, then up rows); w2 ``[E_local, H, F]``;
        with a shared expert: shared_w13 ``[1, 2Fs, H]``, shared_w2 ``[1, H, Fs]``.

    Forward: ``x [..., H]`` (any float dtype, any device the parameters are on) -> ``y`` with x's shape and
    dtype. The routed output is ``sum_j w[t, j] * expert_{idx[t, j]}(x[t])`` (fp32 sum over j, BF16 result),
    plus ``shared(x)``. Runs with autocast disabled (the layer picks its own precisions). After each forward,
    :attr:`aux_loss` is the router's load-balancing loss (None when disabled) and :attr:`last_routing` the
    :class:`RouterOutput`.

    Weight caches of the expert (and shared-expert) weights: MXFP8 copies for ``precision="mxfp8"``
    (:class:`mxcomm.gemm.MXWeightCache`), BF16 copies for ``precision="bf16"`` with ``bf16_weight_cache=True``
    (the default; :class:`mxcomm.gemm.weights.BF16WeightCache`, bit-identical to casting the masters per call).
    Built at the first forward (and rebuilt when the parameters moved to another device). After the master
    weights change they must be rebuilt: :meth:`attach_optimizer` does it after every ``optimizer.step()``,
    :meth:`refresh_caches` does it by hand; ``load_state_dict`` / :meth:`load_global_weights` on this module
    rebuild them themselves. A forward with stale caches raises :class:`mxcomm.gemm.StaleWeightCacheError`
    (``cache_refresh="check"``) or rebuilds them (``cache_refresh="auto"``); a backward whose weights changed
    since its forward always raises.
    """

    def __init__(self, config: MoEConfig, ep_group: Optional[EPGroup] = None, *, process_group=None,
                 device=None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if ep_group is None:
            ep_group = make_ep_group(config, process_group)
        elif not isinstance(ep_group, EPGroup):
            raise TypeError(f"ep_group must be an mxcomm.ep.EPGroup, got {type(ep_group).__name__}")
        want = config.ep_config()
        bad = [f"{f}: group {getattr(ep_group.config, f)!r} vs layer {getattr(want, f)!r}" for f in _EP_FIELDS
               if getattr(ep_group.config, f) != getattr(want, f)]
        if bad:
            raise ValueError("ep_group's EPConfig does not match the MoEConfig (" + "; ".join(bad) + ")")
        self.config = config
        self.ep_group = ep_group
        self.num_local_experts = ep_group.num_local_experts
        self.local_experts = ep_group.local_experts
        H, F, El, Fs = config.dim, config.ffn_dim, self.num_local_experts, config.shared_ffn_dim
        kw = dict(device=device, dtype=torch.float32)
        self.router = Router(H, config.num_experts, config.topk, config.router, **kw)
        self.w13 = nn.Parameter(torch.empty(El, 2 * F, H, **kw))
        self.w2 = nn.Parameter(torch.empty(El, H, F, **kw))
        if Fs:
            self.shared_w13 = nn.Parameter(torch.empty(1, 2 * Fs, H, **kw))
            self.shared_w2 = nn.Parameter(torch.empty(1, H, Fs, **kw))
        else:
            self.shared_w13 = self.shared_w2 = None
        self.opts = ExpertOptions(
            precision=config.precision, scale_mode=config.scale_mode, swiglu_impl=config.swiglu_impl,
            gemm=GroupedLinearConfig(backend=config.gemm_backend, mode=config.scale_mode,
                                     quantize_dgrad=config.quantize_dgrad),
        )
        self._caches: dict[str, MXWeightCache | BF16WeightCache] = {}
        self.aux_loss: Optional[torch.Tensor] = None
        self.last_routing: Optional[RouterOutput] = None
        self.register_load_state_dict_post_hook(_drop_caches_after_load)
        self.reset_parameters()

    # -- parameters -----------------------------------------------------------------------------
    def _expert_params(self) -> dict:
        out = {"w13": self.w13, "w2": self.w2}
        if self.shared_w13 is not None:
            out.update(shared_w13=self.shared_w13, shared_w2=self.shared_w2)
        return out

    def reset_parameters(self, init_std: float = 0.02, out_std: Optional[float] = None) -> None:
        """Truncated-normal init (``init_std`` for the router and the input projections, ``out_std`` - default
        ``init_std`` - for the down projections, e.g. ``0.02 / sqrt(2 * n_layers)``). Rank-local: for identical
        experts across launches seed each rank the same way, or load global weights
        (:meth:`load_global_weights`)."""
        out_std = init_std if out_std is None else out_std
        self.router.reset_parameters(init_std)
        with torch.no_grad():
            for name, p in self._expert_params().items():
                s = out_std if name.endswith("w2") else init_std
                nn.init.trunc_normal_(p, std=s, a=-3 * s, b=3 * s)
        self._drop_caches()

    @torch.no_grad()
    def load_global_weights(self, *, router: Optional[torch.Tensor] = None, w13: Optional[torch.Tensor] = None,
                            w2: Optional[torch.Tensor] = None, shared_w13: Optional[torch.Tensor] = None,
                            shared_w2: Optional[torch.Tensor] = None) -> None:
        """Copy weights of the whole (unsharded) layer into this rank's parameters.

        Args (each optional): router ``[E, H]``; w13 ``[E, 2F, H]`` and w2 ``[E, H, F]`` for ALL E experts
        (this rank keeps rows :attr:`local_experts`); shared_w13 ``[2Fs, H]`` or ``[1, 2Fs, H]``;
        shared_w2 ``[H, Fs]`` or ``[1, H, Fs]``. The weight caches are rebuilt at the next forward.
        """
        sl = slice(self.local_experts.start, self.local_experts.stop)
        pairs = [(self.router.weight, router, None), (self.w13, w13, sl), (self.w2, w2, sl)]
        if self.shared_w13 is not None:
            pairs += [(self.shared_w13, shared_w13, "shared"), (self.shared_w2, shared_w2, "shared")]
        elif shared_w13 is not None or shared_w2 is not None:
            raise ValueError("this MoE has no shared expert (shared_ffn_dim=0)")
        for p, src, how in pairs:
            if src is None:
                continue
            if how == "shared" and src.dim() == 2:
                src = src.unsqueeze(0)
            full = list(p.shape)
            if isinstance(how, slice):
                full[0] = self.config.num_experts
            if list(src.shape) != full:
                raise ValueError(f"global weight of shape {tuple(src.shape)} given for a parameter of global shape "
                                 f"{tuple(full)}")
            p.copy_(src[how] if isinstance(how, slice) else src)
        self._drop_caches()

    # -- weight caches (MXFP8, or BF16 for the bf16 path) -----------------------------------------
    def _drop_caches(self) -> None:
        self._caches = {}

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() move or convert the masters: caches are rebuilt (or dropped) at the next forward
        out = super()._apply(fn, *args, **kwargs)
        self._drop_caches()
        return out

    def refresh_caches(self) -> None:
        """Rebuild every weight cache (MXFP8, or BF16 for ``precision="bf16"``) from the current fp32 masters (call
        after ``optimizer.step()`` / loading weights, unless :meth:`attach_optimizer` does it). No-op without
        caches (``precision="bf16"`` with ``bf16_weight_cache=False``) or before the first forward."""
        for c in self._caches.values():
            c.refresh()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Rebuild the weight caches after every ``optimizer.step()`` (a step post-hook; covers fused optimizers,
        which the version counter misses). Returns the hook handle (``.remove()`` detaches)."""
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: self.refresh_caches())

    def _cache_kind(self, p: torch.Tensor):
        """The cache class for master ``p`` (None: cast per call)."""
        if self.config.precision == "mxfp8":
            return MXWeightCache
        if self.config.bf16_weight_cache and p.dtype != torch.bfloat16:
            return BF16WeightCache
        return None

    def _cache(self, name: str, p: torch.Tensor):
        """The checked cache of master ``p`` (built on first use; stale -> raise or rebuild per cache_refresh)."""
        kind = self._cache_kind(p)
        if kind is None:
            return None
        c = self._caches.get(name)
        if c is None or c.master is not p or type(c) is not kind:
            c = (MXWeightCache(p, mode=self.config.scale_mode, auto_refresh=False) if kind is MXWeightCache
                 else BF16WeightCache(p, auto_refresh=False))
            self._caches[name] = c
        elif c.is_stale():
            if self.config.cache_refresh == "auto":
                c.refresh()
            else:
                what = "MXFP8" if kind is MXWeightCache else "BF16"
                raise StaleWeightCacheError(
                    f"MoE: the {what} weight cache of {name} is stale (the fp32 master changed since it was built). "
                    "Call moe.attach_optimizer(optimizer) once (refreshes after every step), or moe.refresh_caches() "
                    "after optimizer.step() / weight loading, or build the layer with cache_refresh='auto'"
                    + (" (or bf16_weight_cache=False: cast per call)." if what == "BF16" else "."))
        return c

    def caches(self) -> dict:
        """The weight caches built so far, by parameter name (MXFP8 for mxfp8, BF16 for bf16 with
        ``bf16_weight_cache``; empty otherwise)."""
        return dict(self._caches)

    def cache_bytes(self) -> int:
        """Persistent bytes of the weight caches built so far (MXFP8: 2 x 33/32 per weight plus scale padding;
        BF16: 2 per weight)."""
        return sum(c.nbytes() for c in self._caches.values())

    # -- forward --------------------------------------------------------------------------------
    def _experts(self, a, offs, w13, w2, prefix: str) -> torch.Tensor:
        c13, c2 = self._cache(prefix + "w13", w13), self._cache(prefix + "w2", w2)
        return grouped_swiglu(a, offs, w13, w2, self.opts, cache13=c13, cache2=c2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H = self.config.dim
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"MoE expects x of shape [..., {H}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"MoE expects a floating x, got {x.dtype}")
        if x.device != self.w13.device:
            raise ValueError(f"x is on {x.device} but the MoE parameters are on {self.w13.device}")
        with torch.autocast(device_type=x.device.type, enabled=False):
            x2 = x.reshape(-1, H)
            r = self.router(x2)
            xb = x2.to(torch.bfloat16)
            d = self.ep_group.dispatch(xb, r.topk_idx, r.topk_weights)
            out = self._experts(d.x, d.offs, self.w13, self.w2, "")
            y = self.ep_group.combine(out, d.handle)
            if self.shared_w13 is not None:
                offs = torch.full((1,), xb.shape[0], dtype=torch.int32, device=xb.device)
                y = y + self._experts(xb, offs, self.shared_w13, self.shared_w2, "shared_")
        self.aux_loss = r.aux_loss
        self.last_routing = r
        return y.to(x.dtype).reshape(x.shape)

    def extra_repr(self) -> str:
        c = self.config
        return (f"dim={c.dim}, ffn_dim={c.ffn_dim}, experts={c.num_experts} ({self.num_local_experts} local: "
                f"{self.local_experts.start}..{self.local_experts.stop - 1}), topk={c.topk}, "
                f"precision={c.precision}, shared_ffn_dim={c.shared_ffn_dim}, ep_backend={c.ep_backend}")


def _drop_caches_after_load(module: "MoE", incompatible_keys) -> None:
    """load_state_dict post-hook (module level, so the module stays picklable): caches rebuilt at next forward."""
    module._drop_caches()


def moe_aux_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """Sum of :attr:`MoE.aux_loss` over every :class:`MoE` in ``model`` from their last forward (None if none)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def attach_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """:meth:`MoE.attach_optimizer` for every :class:`MoE` in ``model``; returns the hook handles."""
    return [m.attach_optimizer(optimizer) for m in model.modules() if isinstance(m, MoE)]


__all__ = ["MoE", "make_ep_group", "init_single_process", "moe_aux_loss", "attach_optimizer"]
