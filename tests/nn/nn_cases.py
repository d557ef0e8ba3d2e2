"""Shared helpers of the mxcomm.nn tests: cases, global weights, one training step of the layer, the world-1
process-group fixture and the world worker (imported by spawned ranks: keep it importable, no pytest at import).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from mxcomm.nn import MoE, MoEConfig, RouterConfig, init_single_process, make_ep_group, moe_reference

try:  # present in the spawned ranks (tests/ is on sys.path)
    from _dist import progress
except ImportError:  # pragma: no cover
    def progress(msg):
        pass


@dataclass(frozen=True)
class NNCase:
    """One MoE layer configuration plus data: ``tokens[r]`` tokens on rank r of a world of ``len(tokens)``."""

    name: str
    precision: str
    tokens: tuple = (48,)
    dim: int = 64
    ffn_dim: int = 96
    num_experts: int = 8
    topk: int = 2
    shared_ffn_dim: int = 0
    score_func: str = "softmax"
    norm_topk_prob: Optional[bool] = None
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    scale_mode: str = "rceil"
    weight_std: float = 0.1
    seed: int = 0
    bf16_weight_cache: bool = True

    def config(self, **kw) -> MoEConfig:
        c = MoEConfig(
            dim=self.dim, ffn_dim=self.ffn_dim, num_experts=self.num_experts, topk=self.topk,
            precision=self.precision, shared_ffn_dim=self.shared_ffn_dim, scale_mode=self.scale_mode,
            bf16_weight_cache=self.bf16_weight_cache,
            router=RouterConfig(score_func=self.score_func, norm_topk_prob=self.norm_topk_prob,
                                route_scale=self.route_scale, aux_loss_coef=self.aux_loss_coef),
            max_tokens_per_rank=max(max(self.tokens), 1),
        )
        return replace(c, **kw) if kw else c


def global_weights(case: NNCase) -> dict:
    """fp32 global weights of the whole layer (all experts), from the case's seed."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    E, H, F, Fs, s = case.num_experts, case.dim, case.ffn_dim, case.shared_ffn_dim, case.weight_std

    def rn(*shape):
        return torch.randn(*shape, generator=g) * s

    w = dict(router=rn(E, H) * 3, w13=rn(E, 2 * F, H), w2=rn(E, H, F))
    if Fs:
        w.update(shared_w13=rn(2 * Fs, H), shared_w2=rn(H, Fs))
    return w


def inputs(case: NNCase) -> dict:
    """Per rank: x fp32 ``[T_r, H]`` holding bf16 values (so every precision sees the same input) and an upstream
    gradient ``G`` ``[T_r, H]`` (loss = sum(y * G))."""
    g = torch.Generator().manual_seed(2000 + case.seed)
    xs = [torch.randn(T, case.dim, generator=g).to(torch.bfloat16).float() for T in case.tokens]
    gs = [torch.randn(T, case.dim, generator=g) for T in case.tokens]
    return {"xs": xs, "gs": gs}


def step(moe: MoE, x: torch.Tensor, G: torch.Tensor) -> dict:
    """Forward + backward of ``loss = sum(y * G) (+ aux)`` on the layer's device; returns y, grads (CPU)."""
    for p in moe.parameters():
        p.grad = None
    dev = moe.w13.device
    x, G = x.to(dev).clone().requires_grad_(), G.to(dev)
    y = moe(x)
    loss = (y.float() * G).sum()
    if moe.aux_loss is not None:
        loss = loss + moe.aux_loss
    loss.backward()
    out = {"y": y.detach().cpu(), "gx": x.grad.detach().cpu(), "idx": moe.last_routing.topk_idx.detach().cpu(),
           "aux": None if moe.aux_loss is None else float(moe.aux_loss.detach())}
    for n, p in moe.named_parameters():
        out["g_" + n.replace(".", "_")] = None if p.grad is None else p.grad.detach().cpu().clone()
    return out


def reference_step(case: NNCase, w: dict, x: torch.Tensor, G: torch.Tensor, *, topk_idx=None,
                   simulate: bool = False, ep_size: int = 1) -> dict:
    """The float64 reference of :func:`step` (keys as there, parameter gradients global-shaped); ``ep_size``: the
    world the layer ran in (the simulation rounds one partial per (token, rank))."""
    xr = x.double().requires_grad_()
    params = {k: v.double().requires_grad_() for k, v in w.items()}
    ref = moe_reference(xr, case.config(), topk_idx=topk_idx, simulate=simulate, ep_size=ep_size, **params)
    loss = (ref.y * G.double()).sum()
    if ref.aux_loss is not None:
        loss = loss + ref.aux_loss
    loss.backward()
    out = {"y": ref.y.detach(), "gx": xr.grad, "idx": ref.topk_idx,
           "aux": None if ref.aux_loss is None else float(ref.aux_loss.detach())}
    names = {"router": "g_router_weight", "w13": "g_w13", "w2": "g_w2", "shared_w13": "g_shared_w13",
             "shared_w2": "g_shared_w2"}
    for k, p in params.items():
        out[names[k]] = p.grad if p.grad is not None else torch.zeros_like(p)
    return out


def sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(|ref|^2 / |got - ref|^2)`` (shapes must agree; inf when equal)."""
    got, ref = got.detach().double().reshape(ref.shape), ref.detach().double()
    noise = float(((got - ref) ** 2).sum())
    sig = float((ref ** 2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / noise) if sig > 0 else -math.inf


GRAD_KEYS = ("gx", "g_router_weight", "g_w13", "g_w2", "g_shared_w13", "g_shared_w2")


def build_layer(case: NNCase, w: dict, ep=None, device=None, **cfg_kw) -> MoE:
    moe = MoE(case.config(**cfg_kw), ep_group=ep, device=device)
    moe.load_global_weights(**w)
    return moe


# ------------------------------------------------------------------------------ world runs ----
def world_worker(rank: int, world: int, cases: list, device: str = "cpu", ep_backend: str = "torch") -> dict:
    """Each case: the layer over the world's EP group, this rank's tokens; returns its outputs and gradients.

    ``device="cuda"``: rank r uses GPU ``r % device_count`` (on one GPU the ranks share it); ``ep_backend``: ``"torch"`` or ``"nvshmem"``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        from _dist import bind_rank_gpu

        dev = torch.device(bind_rank_gpu(rank))
    out = {}
    for case in cases:
        assert len(case.tokens) == world, case.name
        progress(case.name)
        w = global_weights(case)
        inp = inputs(case)
        ep = make_ep_group(case.config(ep_backend=ep_backend))
        moe = build_layer(case, w, ep, device=dev, ep_backend=ep_backend)
        res = step(moe, inp["xs"][rank], inp["gs"][rank])
        res["local_experts"] = (moe.local_experts.start, moe.local_experts.stop)
        # tensors travel back as numpy arrays (torch tensors would be shared through file descriptors that die
        # with this process)
        out[case.name] = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in res.items()}
    if ep_backend == "nvshmem":
        from mxcomm import transport

        transport.finalize()
    return out


def gather_world(case: NNCase, per_rank: list, key: str) -> torch.Tensor:
    """Results of a world (``world_worker``'s per-rank dicts for ``case``) in single-process shape: token tensors
    concatenated over ranks, sharded expert gradients concatenated over ranks (rank r holds experts
    ``[r*E/W, (r+1)*E/W)``), replicated gradients summed in float64."""
    vals = [torch.from_numpy(r[case.name][key]) for r in per_rank]
    if key in ("y", "gx", "idx", "g_w13", "g_w2"):
        return torch.cat(vals)
    return sum(v.double() for v in vals)


def gpu_extras_worker(rank: int, world: int) -> dict:
    """CUDA-only checks in one process: the Triton SwiGLU+quantize path (auto on CUDA) against the reference math,
    MXFP8 and BF16 caches following optimizer steps (attach_optimizer) on the GPU, and the BF16 cache against the
    cast-per-call path (forward bit-identical; gradients >= 100 dB, which allows for atomics in the GPU reductions).
    Returns failure strings."""
    fails = []
    dev = torch.device("cuda", torch.cuda.current_device())
    case = NNCase("gpu_extras", "mxfp8", tokens=(200,), dim=128, ffn_dim=256, shared_ffn_dim=64, seed=31)
    w, inp = global_weights(case), inputs(case)
    a = step(build_layer(case, w, device=dev), inp["xs"][0], inp["gs"][0])
    b = step(build_layer(case, w, device=dev, swiglu_impl="reference"), inp["xs"][0], inp["gs"][0])
    for key in ("y",) + GRAD_KEYS:
        if a.get(key) is not None and sqnr_db(a[key], b[key]) < 50.0:
            fails.append(f"kernel vs reference swiglu: {key} {sqnr_db(a[key], b[key]):.1f} dB")
    moe = build_layer(case, w, device=dev)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
    moe.attach_optimizer(opt)
    x = inp["xs"][0].to(dev)
    for _ in range(2):
        opt.zero_grad()
        moe(x).float().square().mean().backward()
        opt.step()
    cur = {"router": moe.router.weight, "w13": moe.w13, "w2": moe.w2, "shared_w13": moe.shared_w13,
           "shared_w2": moe.shared_w2}
    fresh = build_layer(case, {k: v.detach().clone() for k, v in cur.items()}, device=dev)
    with torch.no_grad():
        if not torch.equal(moe(x), fresh(x)):
            fails.append("after optimizer steps the layer's output differs from a fresh layer with the same weights")
    fails += _gpu_bf16_cache_checks(dev)
    return {"failures": fails}


def _gpu_bf16_cache_checks(dev) -> list:
    fails = []
    case = NNCase("gpu_bf16_cache", "bf16", tokens=(200,), dim=128, ffn_dim=256, shared_ffn_dim=64, seed=32)
    w, inp = global_weights(case), inputs(case)
    cached = build_layer(case, w, device=dev)
    plain = build_layer(case, w, device=dev, bf16_weight_cache=False)
    a, b = step(cached, inp["xs"][0], inp["gs"][0]), step(plain, inp["xs"][0], inp["gs"][0])
    if set(cached.caches()) != {"w13", "w2", "shared_w13", "shared_w2"} or plain.caches():
        fails.append(f"bf16 caches: {sorted(cached.caches())} (cached layer), {sorted(plain.caches())} (plain)")
    if not torch.equal(a["y"], b["y"]):
        fails.append("bf16 cache: y differs from the cast-per-call layer")
    for key in GRAD_KEYS:
        if a.get(key) is not None and sqnr_db(a[key], b[key]) < 100.0:
            fails.append(f"bf16 cache: {key} {sqnr_db(a[key], b[key]):.1f} dB against the cast-per-call layer")
    opt = torch.optim.AdamW(cached.parameters(), lr=1e-2)
    cached.attach_optimizer(opt)
    x = inp["xs"][0].to(dev)
    for _ in range(2):
        opt.zero_grad()
        cached(x).float().square().mean().backward()
        opt.step()
    cur = {"router": cached.router.weight, "w13": cached.w13, "w2": cached.w2, "shared_w13": cached.shared_w13,
           "shared_w2": cached.shared_w2}
    fresh = build_layer(case, {k: v.detach().clone() for k, v in cur.items()}, device=dev, bf16_weight_cache=False)
    with torch.no_grad():
        if not torch.equal(cached(x), fresh(x)):
            fails.append("bf16 cache: after optimizer steps the output differs from a cast-per-call layer with the "
                         "same weights")
    return fails


def world1_pg():
    """Generator for a pytest fixture: a torch.distributed world of 1 in this process, torn down afterwards
    when it was not already up."""
    created = not dist.is_initialized()
    init_single_process()
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
