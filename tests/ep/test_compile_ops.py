"""torch.compile without graph breaks: the custom ops of mxcomm.ep.compiled (EPConfig.exact_sizes=False).

A small MoE block (router softmax + top-k gather, dispatch, SwiGLU experts written with static
shapes over the worst-case R rows, combine) is run

* eagerly through ``EPGroup.dispatch`` / ``combine`` (the reference here: the eager implementation),
* eagerly through the ops (:func:`mxcomm.ep.compiled.dispatch`; combine follows the handle into the ops),
* under ``torch.compile(fullgraph=True)`` through ``EPGroup.dispatch`` / ``combine`` (which route to the ops),

and outputs and all gradients (x, route weights / router, expert parameters) must be bit-identical;
``torch._dynamo.explain`` must report one graph and zero graph breaks. Both precisions, worlds 1
and 2 (gloo, reference backend), dropped slots and a zero-token rank included.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from _dist import progress, run_world

COMPILE_BACKEND = os.environ.get("MXCOMM_COMPILE_BACKEND", "aot_eager")


def moe_block(group, x, idx, w_leaf, Wr, params, router: bool, use_ops: bool, grad_format: str = "dense"):
    """Router -> dispatch -> static-shape SwiGLU experts over all R rows (masked per expert) -> combine."""
    from mxcomm.ep import compiled

    if router:
        probs = torch.softmax(x.float() @ Wr, dim=-1)
        w = torch.gather(probs, 1, idx.clamp(min=0).to(torch.int64))
    else:
        w = w_leaf
    d = compiled.dispatch(group, x, idx, w, None) if use_ops else group.dispatch(x, idx, w)
    h = d.dense(torch.float32)
    R = h.shape[0]
    r = torch.arange(R, device=h.device).view(R, 1)
    # rows past offs[-1] are not written in the no-sync mode: select them away (a multiply by 0 in the experts'
    # backward would turn a NaN there into NaN gradients)
    h = torch.where(r < d.offs[-1].to(torch.int64), h, 0.0)
    out = torch.zeros_like(h)
    start = torch.zeros((), dtype=torch.int64, device=h.device)
    for le in range(group.num_local_experts):
        end = start + d.counts[le].to(torch.int64)
        w1, w3, w2 = (p[le] for p in params)
        e = (F.silu(h @ w1) * (h @ w3)) @ w2
        out = torch.where((r >= start) & (r < end), e, out)
        start = d.offs[le].to(torch.int64)
    return group.combine(out.to(torch.bfloat16), d.handle, grad_format=grad_format)


def make_inputs(rank: int, world: int, case: dict, device="cpu") -> dict:
    g = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    El, H, Fd, k = case["El"], case["H"], case["F"], case["k"]
    T = case["tokens"][rank]
    E = El * world
    idx = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :k]
    if case.get("drop_p", 0) > 0:
        idx = torch.where(torch.rand(T, k, generator=g) < case["drop_p"], torch.full_like(idx, -1), idx)
    gp = torch.Generator().manual_seed(case["seed"])  # same expert/router params everywhere
    params = [torch.randn(E, H, Fd, generator=gp) / H ** 0.5, torch.randn(E, H, Fd, generator=gp) / H ** 0.5,
              torch.randn(E, Fd, H, generator=gp) / Fd ** 0.5]
    lo = rank * El
    return {
        "x": torch.randn(T, H, generator=g).to(torch.bfloat16).to(device),
        "idx": idx.to(device),
        "w": (torch.rand(T, k, generator=g) * 0.9 + 0.1).to(device),
        "G": torch.randn(T, H, generator=g).to(device),
        "Wr": (torch.randn(H, E, generator=gp) / H ** 0.5).to(device),
        "params": [p[lo:lo + El].contiguous().to(device) for p in params],
    }


def run_step(group, inp: dict, case: dict, mode: str) -> dict:
    x = inp["x"].clone().requires_grad_()
    w = inp["w"].clone().requires_grad_()
    Wr = inp["Wr"].clone().requires_grad_()
    params = [p.clone().requires_grad_() for p in inp["params"]]
    router = case["router"]

    def f(x, idx, w, Wr, params):
        return moe_block(group, x, idx, w, Wr, params, router, use_ops=(mode == "ops"))

    if mode == "compiled":
        f = torch.compile(f, backend=COMPILE_BACKEND, fullgraph=True)
    y = f(x, inp["idx"], w, Wr, params)
    (y.float() * inp["G"]).sum().backward()

    def grad(t):
        return None if t.grad is None else t.grad.detach().cpu()

    return {"y": y.detach().cpu(), "gx": grad(x), "gw": grad(w), "gWr": grad(Wr), "gparams": [grad(p) for p in params]}


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def compile_ops_worker(rank: int, world: int, cases: list, device: str = "cpu", backend: str = "torch") -> dict:
    from mxcomm.ep import EPConfig, EPGroup

    if device == "cuda":
        from _dist import bind_rank_gpu

        device = bind_rank_gpu(rank)
    fails, explained = [], {}
    for case in cases:
        name = case["name"]
        progress(name)
        cfg = EPConfig(
            num_experts=case["El"] * world, hidden=case["H"], topk=case["k"],
            max_tokens_per_rank=max(max(case["tokens"]), 1), precision=case["precision"], align=case.get("align", 32),
            exact_sizes=False, backend=backend, timeout_s=60.0,
        )
        group = EPGroup(cfg)
        inp = make_inputs(rank, world, case, device)
        torch._dynamo.reset()
        runs = {m: run_step(group, inp, case, m) for m in ("eager", "ops", "compiled")}
        ref = runs["eager"]
        if ref["y"].shape != (case["tokens"][rank], case["H"]):
            fails.append(f"{name}[rank {rank}]: eager y shape {tuple(ref['y'].shape)}")
        if float(ref["y"].float().abs().sum()) == 0 and case["tokens"][rank] > 0:
            fails.append(f"{name}[rank {rank}]: eager output is all zero (test data too weak)")
        for m in ("ops", "compiled"):
            got = runs[m]
            for key in ("y", "gx", "gw", "gWr"):
                if not _same(ref[key], got[key]):
                    fails.append(f"{name}[rank {rank}]: {m} {key} differs from eager")
            for i, (a, b) in enumerate(zip(ref["gparams"], got["gparams"])):
                if not _same(a, b):
                    fails.append(f"{name}[rank {rank}]: {m} expert param {i} gradient differs from eager")
        # graph breaks (explain runs the forward: a collective on every rank, no backward)
        x, w = inp["x"].clone().requires_grad_(), inp["w"].clone().requires_grad_()
        Wr, params = inp["Wr"].clone().requires_grad_(), [p.clone().requires_grad_() for p in inp["params"]]
        router = case["router"]
        torch._dynamo.reset()
        ex = torch._dynamo.explain(lambda x, idx, w, Wr, params: moe_block(group, x, idx, w, Wr, params, router, False))(
            x, inp["idx"], w, Wr, params
        )
        explained[name] = (ex.graph_count, ex.graph_break_count)
        if ex.graph_break_count != 0 or ex.graph_count != 1:
            fails.append(f"{name}[rank {rank}]: {ex.graph_count} graphs, {ex.graph_break_count} breaks: "
                         f"{[str(b.reason) for b in ex.break_reasons]}")
    if backend == "nvshmem":
        from mxcomm import transport as tp

        tp.finalize()
    return {"failures": fails, "explained": explained}


def mx_grad_worker(rank: int, world: int) -> dict:
    """An MXFP8Tensor gradient reaching the dispatch op travels as it is (dispatch_backward_mx), equal to
    the eager group API's result; bad uses raise clear errors."""
    from mxcomm.ep import EPConfig, EPGroup
    from mxcomm.ep import compiled
    from mxcomm.mx import ScaleLayout, quantize
    from mxcomm.mx.subclass import MXFP8Tensor

    fails = []
    case = dict(El=2, H=64, F=32, k=2, tokens=(20, 13), seed=7)
    cfg = EPConfig(num_experts=2 * world, hidden=64, topk=2, max_tokens_per_rank=20, exact_sizes=False)
    group = EPGroup(cfg)
    inp = make_inputs(rank, world, case)
    res = group.dispatch(inp["x"], inp["idx"], inp["w"])
    h = res.handle
    d = compiled.dispatch(group, inp["x"], inp["idx"], inp["w"], None)
    if not isinstance(d.x, MXFP8Tensor) or not torch.equal(d.x.qdata.view(torch.uint8), res.x.qdata.view(torch.uint8)):
        fails.append(f"rank {rank}: dispatch_op payload differs from EPGroup.dispatch")
    if not torch.equal(d.x.scales, res.x.scales) or not torch.equal(d.offs, res.offs):
        fails.append(f"rank {rank}: dispatch_op scales/offs differ from EPGroup.dispatch")
    if not torch.equal(d.dense(torch.float32), res.x.dequantize(torch.float32)):
        fails.append(f"rank {rank}: mask-free grouped dense differs from MXTensor.dequantize")
    g = torch.randn(res.num_rows, 64, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    gmx = quantize(g, mode=cfg.scale_mode).with_layout(ScaleLayout.GROUPED_M, res.offs)
    want = group.steps.dispatch_backward(gmx, h)
    got = torch.ops.mxcomm_ep.dispatch_backward(MXFP8Tensor(gmx), h.topk_idx, compiled.op_tensors(d.handle),
                                                d.handle.group_id, 1)
    if not torch.equal(want, got):
        fails.append(f"rank {rank}: MX gradient through the dispatch_backward op differs from the group API")
    want_dense = group.steps.dispatch_backward(g, h)
    got_dense = torch.ops.mxcomm_ep.dispatch_backward(g, h.topk_idx, compiled.op_tensors(d.handle), d.handle.group_id, 1)
    if not torch.equal(want_dense, got_dense):
        fails.append(f"rank {rank}: dense gradient through the dispatch_backward op differs from the group API")
    # errors (no collective is started by any of these)
    bad_cfg = EPConfig(num_experts=2 * world, hidden=64, topk=2, max_tokens_per_rank=20, exact_sizes=True)
    exact_group = EPGroup(bad_cfg)
    other = EPGroup(cfg)  # same config, another group
    zeros = torch.zeros(res.num_rows, 64, dtype=torch.bfloat16)
    checks = [
        (ValueError, "exact_sizes=False", lambda: compiled.dispatch(exact_group, inp["x"], inp["idx"], inp["w"], None)),
        (TypeError, "EPHandle", lambda: group.combine(zeros, (1, 2))),
        (ValueError, "another EPGroup", lambda: other.combine(zeros, h)),
        (ValueError, "another EPGroup", lambda: other.combine(zeros, d.handle)),
        (ValueError, "expert_out", lambda: group.combine(torch.zeros(3, 64, dtype=torch.bfloat16), d.handle)),
        (ValueError, "no live EPGroup", lambda: compiled.GROUPS.get(10 ** 9)),
    ]
    for exc, needle, fn in checks:
        try:
            fn()
        except exc as e:
            if needle not in str(e):
                fails.append(f"rank {rank}: {exc.__name__} without {needle!r}: {e}")
        except Exception as e:  # noqa: BLE001
            fails.append(f"rank {rank}: expected {exc.__name__} ({needle}), got {type(e).__name__}: {e}")
        else:
            fails.append(f"rank {rank}: expected {exc.__name__} ({needle}), nothing raised")
    return {"failures": fails}


def cases(world: int) -> list:
    def T(*per):
        return tuple(per[i % len(per)] for i in range(world))

    return [
        dict(name="mx_router", precision="mxfp8", El=2, H=64, F=32, k=2, tokens=T(24, 17), router=True, seed=1),
        dict(name="bf16_leaf_w", precision="bf16", El=2, H=64, F=32, k=2, tokens=T(20, 11), router=False, seed=2),
        dict(name="mx_dropped_zero_tokens", precision="mxfp8", El=3, H=32, F=32, k=3, align=128,
             tokens=T(19, 0) if world > 1 else T(19), router=False, drop_p=0.3, seed=3),
    ]


def _check(results):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:30])


@pytest.mark.parametrize("world", [1, 2])
def test_moe_block_compiles_without_graph_breaks(world):
    cs = cases(world)
    results = run_world(world, compile_ops_worker, cs, timeout=240)
    _check(results)
    for r in results:
        assert set(r["explained"]) == {c["name"] for c in cs}
        assert all(v == (1, 0) for v in r["explained"].values()), r["explained"]


def test_dispatch_op_mx_gradient_and_errors():
    _check(run_world(2, mx_grad_worker, timeout=120))


# GPU (run by the lead): python -m pytest -m "gpu or nvshmem" tests/ep/test_compile_ops.py
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.gpu
def test_compile_ops_cuda_reference_one_rank_nccl():
    _check(run_world(1, compile_ops_worker, cases(1), "cuda", "torch", backend="nccl", env=GPU_ENV, timeout=600))


@pytest.mark.gpu
def test_compile_ops_cuda_reference_two_ranks_gloo_one_gpu():
    _check(run_world(2, compile_ops_worker, cases(2), "cuda", "torch", backend="gloo", env=GPU_ENV, timeout=600))


@pytest.mark.nvshmem
@pytest.mark.parametrize("world", [1, 2])
def test_compile_ops_nvshmem(world):
    from mxcomm.transport import launcher_env

    _check(run_world(world, compile_ops_worker, cases(world), "cuda", "nvshmem", env=launcher_env(2 << 30), timeout=900))
