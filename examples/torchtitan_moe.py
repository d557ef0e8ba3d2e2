#!/usr/bin/env python3
"""Train a tiny model built from torchtitan's ``MoE`` layer with mxcomm's token dispatcher, BF16 vs MXFP8.

Model: token embedding -> L x [RMSNorm -> torchtitan ``MoE`` (top-k router, ``GroupedExperts``, dispatch/combine
by :class:`mxcomm.integrations.torchtitan.MXCommTokenDispatcher`) -> residual] -> RMSNorm -> head. Data: synthetic
sequences from a fixed random first-order Markov chain over ``--vocab`` tokens (seeded; every step a new batch),
so the loss falls toward the chain's entropy (printed). Both runs start from the same weights and see the same
batches; only the dispatcher's ``precision`` differs. AdamW, constant learning rate after a short warmup.

Runs on CPU in one process: a gloo world of 1 (``mxcomm.nn.init_single_process``) with EP off
(``ep_mesh=None``: the dispatcher runs mxcomm over a one-rank group holding all experts; the reference backend).

    python examples/torchtitan_moe.py --out bench/results/cpu          # ~2 minutes on 2 cores

Outputs in ``--out``: ``torchtitan_moe_cpu.json`` (config, per-step losses of both runs, summary) and
``torchtitan_moe_cpu.png`` (loss curves and their difference).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
import torch.nn as nn


def build_model(a, precision: str) -> nn.Module:
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter

    from mxcomm.integrations.torchtitan import MXCommTokenDispatcher

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(a.dim)
            cfg = MoE.Config(
                num_experts=a.experts,
                routed_experts=RoutedExperts.Config(
                    inner_experts=GroupedExperts.Config(dim=a.dim, hidden_dim=a.ffn, num_experts=a.experts),
                    token_dispatcher=MXCommTokenDispatcher.Config(
                        num_experts=a.experts, top_k=a.topk, precision=precision, hidden_dim=a.dim,
                        num_max_tokens_per_rank=a.batch * a.seq, backend="torch"),
                ),
                router=TokenChoiceTopKRouter.Config(
                    num_experts=a.experts, gate=Linear.Config(in_features=a.dim, out_features=a.experts),
                    top_k=a.topk, score_func="softmax"),
                load_balance_coeff=None,
            )
            self.moe = cfg.build()
            self.moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=None)

        def forward(self, h):
            return h + self.moe(self.norm(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(a.vocab, a.dim)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.norm = nn.RMSNorm(a.dim)
            self.head = nn.Linear(a.dim, a.vocab, bias=False)

        def forward(self, tok):
            h = self.emb(tok)
            for b in self.blocks:
                h = b(h)
            return self.head(self.norm(h))

    g = torch.Generator().manual_seed(a.seed)
    m = Model()
    with torch.no_grad():
        for name, p in sorted(m.named_parameters()):
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 if name.endswith("gate.weight") else fan_in ** -0.5))
    return m


def markov_chain(a):
    g = torch.Generator().manual_seed(a.seed + 1)
    logits = torch.randn(a.vocab, a.vocab, generator=g) * a.peak
    P = torch.softmax(logits, -1)
    pi = torch.ones(a.vocab) / a.vocab
    for _ in range(200):
        pi = pi @ P
    entropy = float(-(pi[:, None] * P * P.clamp_min(1e-30).log()).sum())
    return P, entropy


def batches(a, P):
    g = torch.Generator().manual_seed(a.seed + 2)
    while True:
        tok = torch.empty(a.batch, a.seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(a.vocab, (a.batch,), generator=g)
        for t in range(a.seq):
            tok[:, t + 1] = torch.multinomial(P[tok[:, t]], 1, generator=g).squeeze(1)
        yield tok[:, :-1], tok[:, 1:]


def train(a, precision: str, P) -> dict:
    torch.manual_seed(a.seed)
    model = build_model(a, precision)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup))
    data = batches(a, P)
    losses, t0 = [], time.time()
    for step in range(a.steps):
        x, y = next(data)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, a.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))
        if step % 50 == 0 or step == a.steps - 1:
            print(f"{precision:6s} step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return {"losses": losses, "seconds": time.time() - t0}


def plot(res: dict, entropy: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    for name, r in res.items():
        ax.plot(r["losses"], label=name, lw=1.2, alpha=0.9)
    ax.axhline(entropy, color="k", ls=":", lw=1, label=f"chain entropy {entropy:.3f}")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("torchtitan MoE with mxcomm's token dispatcher (CPU, reference backend)")
    ax.legend()
    ax.grid(alpha=0.3)
    d = [m - b for m, b in zip(res["mxfp8"]["losses"], res["bf16"]["losses"])]
    bx.plot(d, color="tab:red", lw=1)
    bx.axhline(0, color="k", lw=0.8)
    bx.set_ylabel("mxfp8 - bf16")
    bx.set_xlabel("step")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--peak", type=float, default=2.5, help="logit scale of the Markov chain (higher: lower entropy)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torchtitan

    from mxcomm.nn import init_single_process

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    init_single_process()
    P, entropy = markov_chain(a)
    res = {prec: train(a, prec, P) for prec in ("bf16", "mxfp8")}
    last = {k: sum(r["losses"][-50:]) / len(r["losses"][-50:]) for k, r in res.items()}
    summary = {
        "chain_entropy": entropy, "first_loss": {k: r["losses"][0] for k, r in res.items()},
        "mean_last_50": last, "mean_last_50_diff_mxfp8_minus_bf16": last["mxfp8"] - last["bf16"],
        "seconds": {k: r["seconds"] for k, r in res.items()},
        "finite": all(math.isfinite(v) for r in res.values() for v in r["losses"]),
    }
    print(json.dumps(summary, indent=1))
    os.makedirs(a.out, exist_ok=True)
    out = {"config": vars(a), "versions": {"torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", "0.3.0"),
                                           "python": platform.python_version(), "machine": platform.machine()},
           "summary": summary, "losses": {k: r["losses"] for k, r in res.items()}}
    with open(os.path.join(a.out, "torchtitan_moe_cpu.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(res, entropy, os.path.join(a.out, "torchtitan_moe_cpu.png"))
    print("wrote", os.path.join(a.out, "torchtitan_moe_cpu.{json,png}"))


if __name__ == "__main__":
    main()
