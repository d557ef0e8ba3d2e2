"""Shared helpers of the torchtitan integration tests (imported by spawned ranks: no pytest at import).

A case is one torchtitan ``MoE`` layer (its own module, router and ``GroupedExperts``) plus data: global weights
and ``tokens[r]`` tokens on rank r. :func:`world_worker` runs the layer with :class:`MXCommTokenDispatcher`
on each rank of a world (rank r holds experts ``[r*E/W, (r+1)*E/W)``); :func:`reference_step` runs the same
layer in one process with torchtitan's ``LocalTokenDispatcher`` holding all experts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

try:  # present in the spawned ranks (tests/ is on sys.path)
    from _dist import progress
except ImportError:  # pragma: no cover
    def progress(msg):
        pass

GRAD_KEYS = ("gx", "gx_router", "g_router", "g_w1", "g_w2", "g_w3")


@dataclass(frozen=True)
class TTCase:
    name: str
    precision: str = "bf16"
    tokens: tuple = (40,)      # per rank; B = 1, L = tokens
    dim: int = 64
    ffn_dim: int = 96
    num_experts: int = 8
    topk: int = 2
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    dead_experts: tuple = ()   # experts that never get a token (expert_bias_E = -1e4 there)
    align: int = 32
    scale_mode: str = "rceil"
    seed: int = 0
    extra: dict = field(default_factory=dict)


def patch_torchtitan_for_cpu() -> None:
    """Test-only fixes for running torchtitan 0.3 on a CPU machine.

    * ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` without an accelerator; modules that
      imported it by name keep that string. Set it to ``"cpu"`` everywhere it was imported.
    * spmd_types sends uneven all-to-alls as a list-form ``dist.all_to_all``, which gloo refuses: route its
      collectives through a wrapper that does them with ``all_to_all_single``.
    """
    import sys

    import torchtitan.tools.utils as tt_utils

    if torch.cuda.is_available():
        return
    tt_utils.device_type = "cpu"
    tt_utils.device_module = torch.cpu
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "") or ""
        if name.startswith("torchtitan") and getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
            if hasattr(mod, "device_module"):
                mod.device_module = torch.cpu
    try:
        from spmd_types import _dist as spmd_dist
    except ImportError:  # pragma: no cover - spmd_types layout changed
        return
    if getattr(spmd_dist, "_mxcomm_gloo_patch", False):
        return
    base = spmd_dist.dist

    class _GlooDist:
        def __getattr__(self, name):
            return getattr(base, name)

        @staticmethod
        def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
            inp = torch.cat([t.reshape(-1) for t in input_tensor_list]) if input_tensor_list else torch.empty(0)
            out = torch.empty(sum(t.numel() for t in output_tensor_list), dtype=inp.dtype, device=inp.device)
            dist.all_to_all_single(out, inp, [t.numel() for t in output_tensor_list],
                                   [t.numel() for t in input_tensor_list], group=group)
            off = 0
            for t in output_tensor_list:
                t.copy_(out[off:off + t.numel()].view_as(t))
                off += t.numel()
            return None

    spmd_dist.set_dist(_GlooDist())
    spmd_dist._mxcomm_gloo_patch = True


def global_weights(case: TTCase) -> dict:
    g = torch.Generator().manual_seed(1000 + case.seed)
    E, D, F = case.num_experts, case.dim, case.ffn_dim

    def rn(*shape, std):
        return (torch.randn(*shape, generator=g) * std).float()

    return {"gate": rn(E, D, std=0.2), "w1": rn(E, F, D, std=D ** -0.5), "w2": rn(E, D, F, std=F ** -0.5),
            "w3": rn(E, F, D, std=D ** -0.5)}


def inputs(case: TTCase) -> dict:
    """Per-rank tokens ``xs[r]`` float32 ``[1, T_r, D]`` and upstream gradients ``gs[r]`` (bf16-representable
    values, so the BF16 rounding of the output gradient inside mxcomm's combine backward is exact)."""
    g = torch.Generator().manual_seed(2000 + case.seed)
    xs = [torch.randn(1, t, case.dim, generator=g) for t in case.tokens]
    gs = [torch.randn(1, t, case.dim, generator=g).bfloat16().float() for t in case.tokens]
    return {"xs": xs, "gs": gs}


def build_moe(case: TTCase, dispatcher_cfg, expert_slice: slice):
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter

    E = case.num_experts
    e_local = len(range(E)[expert_slice])
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=case.dim, hidden_dim=case.ffn_dim, num_experts=e_local),
            token_dispatcher=dispatcher_cfg,
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=case.dim, out_features=E), top_k=case.topk,
            score_func=case.score_func, route_norm=case.route_norm, route_scale=case.route_scale,
        ),
        load_balance_coeff=1e-3,
    )
    moe = cfg.build()
    w = global_weights(case)
    with torch.no_grad():
        moe.router.gate.weight.copy_(w["gate"])
        ie = moe.routed_experts.inner_experts
        ie.w1_EFD.copy_(w["w1"][expert_slice])
        ie.w2_EDF.copy_(w["w2"][expert_slice])
        ie.w3_EFD.copy_(w["w3"][expert_slice])
        for e in case.dead_experts:
            moe.expert_bias_E[e] = -1e4
    moe.train()
    return moe


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float()


def step(moe, x: torch.Tensor, G: torch.Tensor) -> dict:
    """Forward + backward of ``(y * G).sum()``; outputs and gradients as float32 CPU tensors."""
    x = x.clone().requires_grad_(True)
    # The router reads its own leaf copy of x, so the input gradient comes back in two exact parts: through the
    # experts (dispatch backward, rounded to bfloat16 by mxcomm) and through the router gate (fp32 in both).
    x_r = x.detach().clone().requires_grad_(True)
    router_fwd = moe.router.forward
    moe.router.forward = lambda x_BLD, bias=None: router_fwd(x_r, bias)
    try:
        y = moe(x)
    finally:
        moe.router.forward = router_fwd
    (y.float() * G).sum().backward()
    ie = moe.routed_experts.inner_experts
    D = x.shape[-1]
    out = {"y": y.detach().float().reshape(-1, D), "gx": x.grad.float().reshape(-1, D),
           "gx_router": _grad(x_r).reshape(-1, D),
           "g_router": _grad(moe.router.gate.weight), "g_w1": _grad(ie.w1_EFD),
           "g_w2": _grad(ie.w2_EDF), "g_w3": _grad(ie.w3_EFD), "tokens_per_expert": moe.tokens_per_expert_E.clone()}
    return out


def reference_step(case: TTCase) -> dict:
    """All ranks' tokens in one process through torchtitan's ``LocalTokenDispatcher`` with all E experts."""
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    moe = build_moe(case, LocalTokenDispatcher.Config(num_experts=case.num_experts, top_k=case.topk), slice(None))
    inp = inputs(case)
    return step(moe, torch.cat(inp["xs"], dim=1), torch.cat(inp["gs"], dim=1))


def mxcomm_dispatcher_cfg(case: TTCase, backend: str = "torch"):
    from mxcomm.integrations.torchtitan import MXCommTokenDispatcher

    return MXCommTokenDispatcher.Config(
        num_experts=case.num_experts, top_k=case.topk, precision=case.precision, hidden_dim=case.dim,
        num_max_tokens_per_rank=max(max(case.tokens), 1), backend=backend, align=case.align,
        scale_mode=case.scale_mode, **case.extra,
    )


def apply_mutation(mutation: str) -> None:
    """Break the adapter on purpose (negative controls: the comparisons must then fail).

    ``"real_counts"``: dispatch returns the real row counts instead of the padded ones (grouped-GEMM offsets off);
    ``"no_scores"``: combine ignores the routing scores (weights 1)."""
    import mxcomm.integrations.torchtitan as tt

    if mutation == "real_counts":
        orig = tt.MXCommTokenDispatcher.dispatch

        def dispatch(self, *args):
            rows, _, meta = orig(self, *args)
            return rows, meta.counts, meta

        tt.MXCommTokenDispatcher.dispatch = dispatch
    elif mutation == "no_scores":
        orig_c = tt._combine
        tt._combine = lambda group, out, handle, w: orig_c(group, out, handle, torch.ones_like(w))
    elif mutation:
        raise ValueError(mutation)


def dispatch_rows(case: TTCase, ep_mesh, rank: int, world: int, dev) -> dict:
    """The routed rows of this rank's tokens through the mxcomm dispatcher at ``case.precision`` and at BF16
    (same routing), for the elementwise MX error check."""
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: F401 - import check

    out = {}
    el = case.num_experts // world
    for prec in (case.precision, "bf16"):
        moe = build_moe(replace(case, precision=prec), mxcomm_dispatcher_cfg(replace(case, precision=prec)),
                        slice(rank * el, (rank + 1) * el)).to(dev)
        td = moe.routed_experts.token_dispatcher
        td.wire_meshes(ep_mesh=ep_mesh)
        x = inputs(case)["xs"][rank].to(dev)
        with torch.no_grad():
            scores, ids, _ = moe.router(x, moe.expert_bias_E)
            K = ids.shape[-1]
            rows, counts, _meta = td.dispatch(x.view(-1, case.dim), scores.view(-1, K), ids.view(-1, K), None)
        out[prec] = rows.float().cpu().numpy()
        out[prec + "_counts"] = counts.cpu().numpy()
    return out


def world_worker(rank: int, world: int, cases: list, backend: str = "torch", device: str = "cpu",
                 mesh: bool = True, mutation: str = "") -> dict:
    """Each case on this rank with :class:`MXCommTokenDispatcher`; returns numpy outputs and gradients.

    ``mesh=False`` wires ``ep_mesh=None`` (EP off: every rank holds all experts; only valid with world 1).
    ``mutation``: see :func:`apply_mutation`. MXFP8 cases also return the dispatched rows at both precisions
    (key ``"rows"``)."""
    patch_torchtitan_for_cpu()
    apply_mutation(mutation)
    dev = torch.device(device)
    if dev.type == "cuda":
        from _dist import bind_rank_gpu

        dev = torch.device(bind_rank_gpu(rank))
    ep_mesh = None
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        # the dispatcher only takes the mesh's process group (gloo here, also for the nvshmem backend)
        ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {}
    for case in cases:
        progress(case.name)
        assert len(case.tokens) == world, case.name
        el = case.num_experts // world
        sl = slice(rank * el, (rank + 1) * el) if mesh else slice(None)
        moe = build_moe(case, mxcomm_dispatcher_cfg(case, backend), sl)
        moe = moe.to(dev)
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
        inp = inputs(case)
        res = step(moe, inp["xs"][rank].to(dev), inp["gs"][rank].to(dev))
        out[case.name] = {k: v.detach().cpu().numpy() for k, v in res.items()}
        if case.precision == "mxfp8" and mesh and backend == "torch":
            out[case.name]["rows"] = dispatch_rows(case, ep_mesh, rank, world, dev)
    if backend == "nvshmem":
        from mxcomm import transport

        transport.finalize()
    return out


def gather_world(case: TTCase, per_rank: list, key: str) -> torch.Tensor:
    """Per-rank results in single-process shape: token tensors and sharded expert grads concatenated over ranks,
    replicated router gradients summed (float64)."""
    vals = [torch.from_numpy(r[case.name][key]) for r in per_rank]
    if key in ("y", "gx", "gx_router", "g_w1", "g_w2", "g_w3"):
        return torch.cat(vals)
    return sum(v.double() for v in vals).float()
