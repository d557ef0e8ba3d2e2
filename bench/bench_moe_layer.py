"""The drop-in MoE layer's own speed: ``mxcomm.nn.MoE`` (EP = 1, one process) against a plain-torch MoE of the same
math, forward + backward, eager.

    python bench/bench_moe_layer.py [--device cuda] [--dim 4096 --ffn 2048 --experts 64 --topk 8 --tokens 8192]

Implementations (same router, same SwiGLU experts, same weighted sum):

* ``torch bf16 weights``: router top-k, argsort by expert, gather, two ``torch._grouped_mm``, SwiGLU, weighted
  ``index_add_`` back to the tokens; the expert weights are BF16 parameters;
* ``torch fp32 masters``: the same with fp32 master weights cast to BF16 in every step (what mixed-precision
  training does without a weight cache);
* ``mxcomm bf16`` / ``mxcomm mxfp8``: ``mxcomm.nn.MoE`` with ``precision="bf16"`` / ``"mxfp8"`` (fp32 masters; the
  MXFP8 path reads cached MXFP8 weights refreshed after each optimizer step; on Hopper its GEMMs are emulated).

Each step: forward, ``loss = y.float().square().mean()``, backward; median over ``--iters`` after ``--warmup``
(CUDA events on a GPU, ``perf_counter`` on the CPU). Writes a JSON (machine, versions, config, medians, ratios
against ``torch bf16 weights`` of the same run) to ``--out``. Several ranks (EP > 1) are measured by ``mxcomm bench``
(dispatch/combine alone), not here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def plain_moe_step(x, router_w, w13, w2, topk: int, cast: bool):
    """One forward + backward of the plain-torch MoE. ``w13 [E, H, 2F]`` / ``w2 [E, F, H]`` (``torch._grouped_mm``
    layout: ``b[g]`` is ``[K, N]``), BF16 parameters or fp32 masters cast per step (``cast``)."""
    T, H = x.shape
    E = w13.shape[0]
    logits = x.float() @ router_w.float().t()
    probs = torch.softmax(logits, dim=-1)
    w, idx = torch.topk(probs, topk, dim=-1)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // topk
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = x.to(torch.bfloat16)[tok]
    b13 = w13.to(torch.bfloat16) if cast else w13
    b2 = w2.to(torch.bfloat16) if cast else w2
    gu = torch._grouped_mm(a, b13, offs=offs)
    g, u = gu.chunk(2, dim=-1)
    h = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
    out = torch._grouped_mm(h, b2, offs=offs)
    wsel = w.reshape(-1)[order].unsqueeze(1)
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tok, out.float() * wsel)
    loss = y.square().mean()
    loss.backward()
    return loss


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1e3
    else:
        def run(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dim", type=int, default=None, help="model dim (GPU 4096, CPU 128)")
    ap.add_argument("--ffn", type=int, default=None, help="expert ffn dim (GPU 2048, CPU 64)")
    ap.add_argument("--experts", type=int, default=None, help="experts (GPU 64, CPU 8)")
    ap.add_argument("--topk", type=int, default=None, help="experts per token (GPU 8, CPU 2)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (GPU 8192, CPU 256)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (GPU 20, CPU 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--impls", default="torch_bf16,torch_fp32,mxcomm_bf16,mxcomm_mxfp8")
    ap.add_argument("--out", default=str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                         / "mxcomm" / "bench" / "moe_layer.json"))
    a = ap.parse_args()
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    D = a.dim or (4096 if gpu else 128)
    Fd = a.ffn or (2048 if gpu else 64)
    E = a.experts or (64 if gpu else 8)
    k = a.topk or (8 if gpu else 2)
    T = a.tokens or (8192 if gpu else 256)
    iters = a.iters or (20 if gpu else 5)

    from mxcomm.nn import MoE, MoEConfig, RouterConfig, init_single_process, make_ep_group

    init_single_process()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, D, generator=g).to(dev)
    router_w = (torch.randn(E, D, generator=g) * 0.02).to(dev)
    w13_t = (torch.randn(E, D, 2 * Fd, generator=g) * 0.02).to(dev)
    w2_t = (torch.randn(E, Fd, D, generator=g) * 0.02).to(dev)
    timer = _timer(dev)
    results = {}

    def measure(name, step):
        for _ in range(a.warmup):
            step()
        samples = [timer(step) for _ in range(iters)]
        results[name] = {"median_us": statistics.median(samples), "samples_us": samples}
        print(f"{name:22s} {statistics.median(samples):12.1f} us", flush=True)

    impls = a.impls.split(",")
    for cast, name in ((False, "torch_bf16"), (True, "torch_fp32")):
        if name not in impls:
            continue
        dt = torch.float32 if cast else torch.bfloat16
        p13 = w13_t.to(dt).requires_grad_()
        p2 = w2_t.to(dt).requires_grad_()
        pr = router_w.clone().requires_grad_()
        measure(name, lambda: plain_moe_step(x, pr, p13, p2, k, cast))
    for prec in ("bf16", "mxfp8"):
        name = f"mxcomm_{prec}"
        if name not in impls:
            continue
        cfg = MoEConfig(dim=D, ffn_dim=Fd, num_experts=E, topk=k, precision=prec, max_tokens_per_rank=T,
                        router=RouterConfig(score_func="softmax"),
                        ep_backend="nvshmem" if gpu else "torch")
        moe = MoE(cfg, ep_group=make_ep_group(cfg), device=dev)

        def step(moe=moe):
            moe(x).float().square().mean().backward()

        measure(name, step)
    base = results.get("torch_bf16", {}).get("median_us")
    for r in results.values():
        r["x_torch_bf16"] = base / r["median_us"] if base else None
    import triton

    report = dict(
        benchmark="moe_layer", device=str(dev), gpu=torch.cuda.get_device_name(dev) if gpu else None,
        machine=dict(platform=platform.platform(), cpu_count=os.cpu_count()),
        versions=dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda),
        config=dict(dim=D, ffn=Fd, experts=E, topk=k, tokens=T, iters=iters, warmup=a.warmup, ep=1),
        timing="forward + backward of one step, eager, median; x_torch_bf16 = torch_bf16 time / this time",
        results=results,
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
