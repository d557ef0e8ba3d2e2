#!/usr/bin/env python3
"""Train a small byte-level MoE language model with mxcomm's MoE layer, BF16 and MXFP8, same seed; compare.

The corpus is real text that is available offline everywhere: the Python standard library's own ``.py``
sources (``sysconfig.get_paths()["stdlib"]``, files in sorted path order, concatenated, first
``--corpus-bytes`` bytes; the last 5% are held out for a validation loss). Tokens are bytes (vocabulary 256).

Model: byte embedding + learned positions -> L x [RMSNorm -> causal self-attention -> residual;
RMSNorm -> mxcomm.nn.MoE (top-k router, SwiGLU experts, optional shared expert) -> residual] -> RMSNorm -> head.
Only the MoE layers change between the two runs (``precision="bf16"`` vs ``"mxfp8"``); the rest of the model runs
in fp32 on CPU (BF16 autocast on CUDA with ``--amp``, the default there). Both runs see the same initial weights
(global expert weights drawn from a seeded generator, independent of the EP world size), the same batches in the
same order, and the same optimizer (AdamW, warmup + cosine, gradient clipping).

Noise floor: two runs of a small model drift apart from ANY numerical difference (the loss curves are chaotic).
With ``--control-jitter J`` (default 1e-3 on the CPU preset; 0 disables) a third run, ``bf16_jitter``, repeats
the BF16 run with the initial expert weights multiplied by ``1 + J * N(0, 1)`` - a perturbation below the bf16
rounding the BF16 GEMMs apply to those weights anyway - and its distance from the BF16 run is reported next to
MXFP8's, so that the BF16-vs-MXFP8 difference can be read against the run-to-run drift.

    python examples/train_moe.py                              # small CPU config, both modes, ~minutes on 2 cores
    python examples/train_moe.py --device cuda --preset gpu   # larger config on one GPU
    torchrun --nproc-per-node 8 examples/train_moe.py --device cuda --preset gpu --ep-backend nvshmem

Outputs (``--out``, default ``bench/results``; file stem ``--label``): ``<label>.csv`` (per-step losses of both
modes), ``<label>.png`` (loss curves and their difference), ``<label>.json`` (config, versions, results).
Printed: mean training loss of the last 50 steps per run and ``|difference|`` to BF16, validation losses, tokens/s
(on CPU the MXFP8 layer runs plain-torch reference quantization and GEMMs: its tokens/s says nothing about GPUs).

Under torchrun (or any launcher that sets ``WORLD_SIZE``) every rank takes its own slice of each global batch
(data parallel) and the experts are sharded over all ranks (expert parallel): replicated parameters
(attention, embeddings, routers, shared experts) have their gradients averaged over ranks, expert gradients
(which already hold every rank's tokens) are divided by the world size.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent

from mxcomm.ep.collectives import collective_device  # noqa: E402
from mxcomm.ep.config import PRECISIONS  # noqa: E402
from mxcomm.nn import MoE, MoEConfig, RouterConfig, attach_optimizer, init_single_process, make_ep_group  # noqa: E402
from mxcomm.nn import moe_aux_loss  # noqa: E402


# ================================================================================ config ====
@dataclass
class TrainConfig:
    """Everything that defines a run (recorded in the JSON)."""

    device: str = "cpu"
    steps: int = 300
    batch: int = 8                 # sequences per rank per step
    seq: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 256             # per expert
    num_experts: int = 8
    topk: int = 2
    shared_ffn_dim: int = 0
    score_func: str = "softmax"
    aux_loss_coef: float = 0.01
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    corpus_bytes: int = 2_000_000
    eval_batches: int = 8
    seed: int = 0
    amp: bool = False              # BF16 autocast for the non-MoE parts (CUDA)
    ep_backend: str = "torch"
    precisions: tuple = PRECISIONS
    control_jitter: float = 1e-3   # >0: one more BF16 run with expert weights jittered by this relative amount
    tail: int = 50                 # steps averaged for the final-loss comparison
    timing_skip: int = 5           # first steps left out of tokens/s (warm-up)


PRESETS = {
    "cpu": dict(),
    "tiny": dict(steps=5, batch=2, seq=32, d_model=32, n_layers=1, n_heads=2, ffn_dim=32, num_experts=4, topk=2,
                 corpus_bytes=200_000, eval_batches=1, warmup=1, tail=2, timing_skip=1, control_jitter=0.0),
    "gpu": dict(device="cuda", steps=1000, batch=32, seq=256, d_model=512, n_layers=6, n_heads=8, ffn_dim=1024,
                num_experts=16, topk=2, shared_ffn_dim=512, lr=6e-4, warmup=100, corpus_bytes=8_000_000,
                eval_batches=32, amp=True),
}


# ================================================================================ corpus ====
def stdlib_corpus(n_bytes: int) -> torch.Tensor:
    """The first ``n_bytes`` bytes of the concatenated ``.py`` files of the standard library (sorted relative
    paths, site-packages excluded) as uint8 ``[n]``; deterministic for a given Python build."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    chunks, total = [], 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= n_bytes:
            break
    data = b"".join(chunks)[:n_bytes]
    if len(data) < n_bytes:
        raise RuntimeError(f"the standard library under {root} holds only {len(data)} bytes of .py files; "
                           f"use a smaller --corpus-bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


class Batches:
    """Seeded random windows of the corpus: step ``i`` draws the same global batch in every run."""

    def __init__(self, data: torch.Tensor, seq: int, batch: int, rank: int, world: int, seed: int):
        self.data, self.seq, self.batch, self.rank, self.world = data, seq, batch, rank, world
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.batch * self.world
        starts = torch.randint(0, self.data.numel() - self.seq - 1, (n,), generator=self.gen)
        mine = starts[self.rank * self.batch:(self.rank + 1) * self.batch]
        win = torch.stack([self.data[s:s + self.seq + 1] for s in mine.tolist()]).to(torch.int64)
        return win[:, :-1], win[:, 1:]


# ================================================================================= model ====
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        if d % heads:
            raise ValueError(f"d_model ({d}) must be a multiple of n_heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig, moe_cfg: MoEConfig, ep):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.moe = MoE(moe_cfg, ep_group=ep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class ByteMoELM(nn.Module):
    """Byte-level causal LM with an MoE layer in every block (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, moe_cfg: MoEConfig, ep):
        super().__init__()
        self.emb = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg, moe_cfg, ep) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def moe_config(cfg: TrainConfig, precision: str) -> MoEConfig:
    return MoEConfig(
        dim=cfg.d_model, ffn_dim=cfg.ffn_dim, num_experts=cfg.num_experts, topk=cfg.topk, precision=precision,
        shared_ffn_dim=cfg.shared_ffn_dim, max_tokens_per_rank=cfg.batch * cfg.seq, ep_backend=cfg.ep_backend,
        router=RouterConfig(score_func=cfg.score_func, aux_loss_coef=cfg.aux_loss_coef),
    )


def build_model(cfg: TrainConfig, precision: str, ep=None, jitter: float = 0.0) -> ByteMoELM:
    """The model for one run. Initial weights depend only on ``cfg.seed`` (not on precision or world size):
    dense parameters from ``torch.manual_seed(seed)`` (the same on every rank), every MoE layer's global expert
    weights from a generator seeded per layer, of which each rank loads its shard. ``jitter > 0`` multiplies the
    expert weights by ``1 + jitter * N(0, 1)`` (the noise-floor control run)."""
    dev = torch.device(cfg.device)
    mcfg = moe_config(cfg, precision)
    if ep is None:
        ep = make_ep_group(mcfg)
    torch.manual_seed(cfg.seed)
    model = ByteMoELM(cfg, mcfg, ep)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    torch.manual_seed(cfg.seed)  # again: construction drew a world-size dependent amount (the local experts)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".moe." in name:
                continue
            if p.dim() >= 2:
                nn.init.normal_(p, std=out_std if name.endswith("proj.weight") else std)
    E, F_, H, Fs = cfg.num_experts, cfg.ffn_dim, cfg.d_model, cfg.shared_ffn_dim
    for i, blk in enumerate(model.blocks):
        g = torch.Generator().manual_seed(cfg.seed * 1000 + i + 1)

        def tn(*shape, s):
            return torch.nn.init.trunc_normal_(torch.empty(*shape), std=s, a=-3 * s, b=3 * s, generator=g)

        w = dict(router=tn(E, H, s=std), w13=tn(E, 2 * F_, H, s=std), w2=tn(E, H, F_, s=out_std))
        if Fs:
            w.update(shared_w13=tn(2 * Fs, H, s=std), shared_w2=tn(H, Fs, s=out_std))
        if jitter:
            gj = torch.Generator().manual_seed(cfg.seed * 1000 + 500 + i)
            w = {k: v * (1 + jitter * torch.randn(v.shape, generator=gj)) if k != "router" else v
                 for k, v in w.items()}
        blk.moe.load_global_weights(**w)
    return model.to(dev)


# ============================================================================== training ====
def _world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def sync_gradients(model: nn.Module, world: int) -> None:
    """Data parallel over the EP world: average replicated parameters' gradients, scale expert gradients."""
    if world == 1:
        return
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name.endswith(".moe.w13") or name.endswith(".moe.w2"):
            p.grad.div_(world)  # sharded experts: gradient already summed over every rank's tokens
        else:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of a small tensor, staged on the device the process group's backend needs (NCCL: CUDA)."""
    dev = collective_device(None, t.device)
    out = t.detach().to(dev).clone()
    dist.all_reduce(out)
    return (out / dist.get_world_size()).to(t.device)


def clip_grad_norm(model: nn.Module, max_norm: float, world: int) -> float:
    """Global gradient norm over the sharded model (replicated grads counted once), clipped to ``max_norm``."""
    rep, shard = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (shard if name.endswith(".moe.w13") or name.endswith(".moe.w2") else rep).append(p.grad)
    sq_rep = sum((g.float() ** 2).sum() for g in rep) if rep else torch.zeros(())
    sq_shard = sum((g.float() ** 2).sum() for g in shard) if shard else torch.zeros(())
    if world > 1:
        sq_shard = all_reduce_mean(sq_shard.detach().reshape(1).float()) * world
    total = math.sqrt(float(sq_rep) + float(sq_shard))
    if max_norm > 0 and total > max_norm:
        for g in rep + shard:
            g.mul_(max_norm / (total + 1e-6))
    return total


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class RunResult:
    """One training run."""

    label: str                                       # "bf16", "mxfp8" or "bf16_jitter" (control)
    precision: str
    losses: list = field(default_factory=list)       # cross-entropy per step (mean over ranks)
    aux: list = field(default_factory=list)          # summed load-balancing loss per step
    lrs: list = field(default_factory=list)
    final_loss: float = float("nan")                 # mean of the last `tail` steps
    val_loss: float = float("nan")
    tokens_per_s: float = float("nan")
    wall_s: float = float("nan")


def train_one(cfg: TrainConfig, precision: str, data: torch.Tensor, log_every: int = 50, jitter: float = 0.0,
              label: Optional[str] = None) -> RunResult:
    """One training run of ``cfg.steps`` steps; returns its losses, final/validation loss and tokens/s."""
    rank, world = _world()
    dev = torch.device(cfg.device)
    label = label or precision
    model = build_model(cfg, precision, jitter=jitter)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    attach_optimizer(model, opt)  # weight caches (MXFP8 / BF16) rebuilt after every step
    n_val = max(cfg.seq + 2, data.numel() // 20)
    train_data, val_data = data[:-n_val], data[-n_val:]
    batches = Batches(train_data, cfg.seq, cfg.batch, rank, world, cfg.seed)
    res = RunResult(label=label, precision=precision)
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cfg.amp)
    t_start = None
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        if step == cfg.timing_skip:
            _sync(dev)
            t_start = time.perf_counter()
        lr = lr_at(cfg, step)
        for gr in opt.param_groups:
            gr["lr"] = lr
        x, y = batches.next()
        x, y = x.to(dev), y.to(dev)
        with amp:
            logits = model(x)
        ce = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        aux = moe_aux_loss(model)
        loss = ce + aux if aux is not None else ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_gradients(model, world)
        clip_grad_norm(model, cfg.grad_clip, world)
        opt.step()
        stats = torch.stack([ce.detach().float(), (aux.detach().float() if aux is not None else ce.new_zeros(()))])
        if world > 1:
            stats = all_reduce_mean(stats)
        ce_v, aux_v = (float(v) for v in stats)
        res.losses.append(ce_v)
        res.aux.append(aux_v)
        res.lrs.append(lr)
        if rank == 0 and log_every and (step % log_every == 0 or step == cfg.steps - 1):
            print(f"[{label}] step {step:4d}  loss {ce_v:.4f}  aux {aux_v:.4f}  lr {lr:.2e}", flush=True)
    _sync(dev)
    t_end = time.perf_counter()
    res.wall_s = t_end - t0
    timed = cfg.steps - cfg.timing_skip
    if t_start is not None and timed > 0:
        res.tokens_per_s = timed * cfg.batch * cfg.seq * world / (t_end - t_start)
    tail = res.losses[-cfg.tail:]
    res.final_loss = sum(tail) / len(tail)
    res.val_loss = evaluate(cfg, model, val_data, rank, world)
    return res


@torch.no_grad()
def evaluate(cfg: TrainConfig, model: nn.Module, val: torch.Tensor, rank: int, world: int) -> float:
    """Mean cross-entropy on ``eval_batches`` seeded batches of held-out bytes (the same in every run)."""
    dev = torch.device(cfg.device)
    b = Batches(val, cfg.seq, cfg.batch, rank, world, cfg.seed + 12345)
    tot = torch.zeros((), dtype=torch.float64)
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=cfg.amp)
    for _ in range(cfg.eval_batches):
        x, y = b.next()
        with amp:
            logits = model(x.to(dev))
        tot += float(F.cross_entropy(logits.float().reshape(-1, 256), y.to(dev).reshape(-1)))
    if world > 1:
        tot = all_reduce_mean(tot)
    return float(tot) / max(cfg.eval_batches, 1)


# =============================================================================== outputs ====
def versions(cfg: TrainConfig) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no",
                                     "mxcomm", "examples"], capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    dev = torch.device(cfg.device)
    return {
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
        "platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "mxcomm_commit": commit,
        "mxcomm_modified_since_commit": dirty,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "cuda": torch.version.cuda, "world_size": dist.get_world_size(),
    }


def write_outputs(cfg: TrainConfig, results: list, out_dir: Path, label: str, summary: dict) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / f"{label}.csv", "json": out_dir / f"{label}.json", "png": out_dir / f"{label}.png"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "lr"] + [f"loss_{r.label}" for r in results] + [f"aux_{r.label}" for r in results])
        for i in range(cfg.steps):
            w.writerow([i, f"{results[0].lrs[i]:.6g}"] + [f"{r.losses[i]:.6f}" for r in results]
                       + [f"{r.aux[i]:.6f}" for r in results])
    doc = {
        "config": dataclasses.asdict(cfg), "versions": versions(cfg), "summary": summary,
        "runs": {r.label: {k: v for k, v in dataclasses.asdict(r).items() if k not in ("lrs",)} for r in results},
    }
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    try:
        plot(cfg, results, paths["png"], summary)
    except ImportError as e:  # matplotlib is optional (pip install '.[bench]')
        print(f"no PNG written: {e}")
        paths.pop("png")
    return paths


def plot(cfg: TrainConfig, results: list, path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    k = max(1, min(20, cfg.steps // 15))

    def smooth(v):
        t = torch.tensor(v, dtype=torch.float64)
        if len(v) < k:
            return t
        c = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.float64), t]), 0)
        return torch.cat([t[: k - 1], (c[k:] - c[:-k]) / k])

    steps = list(range(cfg.steps))
    colors = {"bf16": "tab:blue", "mxfp8": "tab:red", "bf16_jitter": "tab:green"}
    for r in results:
        col = colors.get(r.label, "tab:gray")
        a1.plot(steps, r.losses, color=col, alpha=0.25, lw=0.8)
        a1.plot(steps, smooth(r.losses).tolist(), color=col, lw=1.6,
                label=f"{r.label}: last-{cfg.tail} mean {r.final_loss:.4f}, {r.tokens_per_s:,.0f} tok/s")
    a1.set_ylabel("train cross-entropy (nats/byte)")
    a1.legend()
    a1.grid(alpha=0.3)
    a1.set_title(f"byte-level MoE LM, stdlib corpus: d={cfg.d_model}, L={cfg.n_layers}, E={cfg.num_experts} "
                 f"top-{cfg.topk}, F={cfg.ffn_dim}, seq {cfg.seq} x batch {cfg.batch}, {cfg.device}", fontsize=9)
    by = {r.label: r for r in results}
    if "bf16" in by and len(by) > 1:
        for other, col in (("mxfp8", "black"), ("bf16_jitter", "tab:green")):
            if other not in by:
                continue
            d = [b - a for a, b in zip(by["bf16"].losses, by[other].losses)]
            a2.plot(steps, d, color=col, alpha=0.3, lw=0.8)
            a2.plot(steps, smooth(d).tolist(), color=col, lw=1.4,
                    label=f"{other} - bf16 (smoothed); |last-{cfg.tail} diff| = "
                          f"{abs(by[other].final_loss - by['bf16'].final_loss):.4f}")
        a2.axhline(0, color="k", lw=0.5)
        a2.legend(fontsize=8)
        a2.set_ylabel("loss difference")
    a2.set_xlabel("step")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ================================================================================== main ====
def init_distributed(cfg: TrainConfig) -> None:
    """torchrun-style launch (WORLD_SIZE set): join it; else a world of 1 in this process."""
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            cfg.device = f"cuda:{torch.cuda.current_device()}"
        dist.init_process_group(backend)
    else:
        init_single_process("gloo")


def run(cfg: TrainConfig, out_dir: Optional[Path], label: str, log_every: int = 50) -> dict:
    init_distributed(cfg)
    rank, world = _world()
    torch.manual_seed(cfg.seed)
    data = stdlib_corpus(cfg.corpus_bytes)
    runs = [(p, p, 0.0) for p in cfg.precisions]
    if cfg.control_jitter > 0 and "bf16" in cfg.precisions:
        runs.append(("bf16_jitter", "bf16", cfg.control_jitter))
    results = [train_one(cfg, p, data, log_every, jitter=j, label=lab) for lab, p, j in runs]
    summary = {r.label: {"final_loss": r.final_loss, "val_loss": r.val_loss, "tokens_per_s": r.tokens_per_s,
                         "wall_s": r.wall_s} for r in results}
    by = {r.label: r for r in results}
    for other in ("mxfp8", "bf16_jitter"):
        if "bf16" in by and other in by:
            key = "abs_final_loss_diff" if other == "mxfp8" else "control_abs_final_loss_diff"
            summary[key] = abs(by[other].final_loss - by["bf16"].final_loss)
            summary[key.replace("final", "val")] = abs(by[other].val_loss - by["bf16"].val_loss)
    paths = {}
    if rank == 0:
        for r in results:
            print(f"{r.label:11s}: mean loss of the last {cfg.tail} steps {r.final_loss:.4f}, val loss "
                  f"{r.val_loss:.4f}, {r.tokens_per_s:,.0f} tokens/s ({world} rank(s)), {r.wall_s:.1f} s")
        if "abs_final_loss_diff" in summary:
            print(f"|final loss difference| mxfp8 vs bf16 (mean of last {cfg.tail} steps): "
                  f"{summary['abs_final_loss_diff']:.4f} nats; "
                  f"|val loss difference|: {summary['abs_val_loss_diff']:.4f}")
        if "control_abs_final_loss_diff" in summary:
            print(f"noise floor: bf16 with expert weights jittered by {cfg.control_jitter:g} (relative) vs bf16: "
                  f"|final loss difference| {summary['control_abs_final_loss_diff']:.4f} nats; |val loss difference|: "
                  f"{summary['control_abs_val_loss_diff']:.4f}")
        if out_dir is not None:
            paths = write_outputs(cfg, results, out_dir, label, summary)
            print("wrote " + ", ".join(str(p) for p in paths.values()))
    return {"summary": summary, "results": results, "paths": paths}


def parse_args(argv=None) -> tuple[TrainConfig, Path, str, int]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="cpu (default on CPU), gpu (default with --device cuda), tiny (smoke test)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mxcomm"
                                         / "examples"), help="folder for the CSV/JSON/PNG (default: outside the checkout)")
    ap.add_argument("--label", default=None, help="output file stem (default train_moe_<preset>)")
    ap.add_argument("--precisions", default=None, help="comma list of bf16,mxfp8")
    ap.add_argument("--log-every", type=int, default=50)
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("device", "precisions"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            ap.add_argument(flag, type=typ, default=None)
    a = ap.parse_args(argv)
    preset = a.preset or ("gpu" if (a.device or "cpu").startswith("cuda") else "cpu")
    kw = dict(PRESETS[preset])
    if a.device:
        kw["device"] = a.device
    if a.precisions:
        kw["precisions"] = tuple(p.strip() for p in a.precisions.split(","))
        bad = [p for p in kw["precisions"] if p not in PRECISIONS]
        if bad:
            ap.error(f"unknown precision(s) {bad}; choose from {PRECISIONS}")
    for f in dataclasses.fields(TrainConfig):
        v = getattr(a, f.name, None)
        if v is not None and f.name not in ("device", "precisions"):
            kw[f.name] = v
    cfg = TrainConfig(**kw)
    return cfg, Path(a.out), a.label or f"train_moe_{preset}", a.log_every


def main(argv=None) -> int:
    cfg, out, label, log_every = parse_args(argv)
    run(cfg, out, label, log_every)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
