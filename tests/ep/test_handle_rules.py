"""What a handle refuses (reference backend, a gloo world of 1): route weights modified in place between dispatch
and combine (combine raises; so does the backward when they change between combine and its backward), and a handle
passed to another group with the same config."""
from __future__ import annotations

from _dist import expect_error, run_world


def worker(rank: int, world: int) -> dict:
    import torch

    from mxcomm.ep import EPConfig, EPGroup

    out = {}
    cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=8)
    group, other = EPGroup(cfg), EPGroup(cfg)
    x = torch.randn(6, 64).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0], [0, 2], [-1, -1]])

    def expect(name, exc, needle, fn):
        expect_error(out, name, exc, needle, fn)

    # 1. weights changed in place between dispatch and combine
    w = torch.rand(6, 2)
    d = group.dispatch(x, idx, w)
    rows = d.dense()
    w.mul_(2.0)
    expect("inplace_before_combine", RuntimeError, "modified in place", lambda: group.combine(rows, d.handle))
    expect("inplace_steps_combine", RuntimeError, "modified in place", lambda: group.steps.combine(rows, d.handle))
    # fresh weights passed explicitly are fine
    y = group.combine(rows, d.handle, topk_weights=w.clone())
    out["explicit_weights_ok"] = bool(torch.isfinite(y.float()).all())
    # 2. weights that need a gradient, changed in place between combine and its backward
    wg = torch.rand(6, 2, requires_grad=True)
    w2 = wg * 1.0  # a non-leaf, as a router's output is
    d2 = group.dispatch(x, idx, w2)
    y2 = group.combine(d2.dense(), d2.handle)
    with torch.no_grad():
        w2.add_(1.0)
    expect("inplace_before_backward", RuntimeError, "modified by an inplace operation",
           lambda: y2.float().sum().backward())
    # 3. a handle of another group (same config)
    d3 = group.dispatch(x, idx, torch.rand(6, 2))
    expect("other_group", ValueError, "belongs to another EPGroup", lambda: other.combine(d3.dense(), d3.handle))
    out["same_group_after"] = bool(torch.isfinite(group.combine(d3.dense(), d3.handle).float()).all())
    return out


def test_handle_rules():
    (res,) = run_world(1, worker, timeout=120)
    assert res == {"inplace_before_combine": "ok", "inplace_steps_combine": "ok", "explicit_weights_ok": True,
                   "inplace_before_backward": "ok", "other_group": "ok", "same_group_after": True}, res
