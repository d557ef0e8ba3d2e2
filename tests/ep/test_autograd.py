"""Backward of dispatch/combine and the autograd API, reference backend over gloo (CPU).

One spawn per world size runs every backward-op case (against the single-process oracle) and every
MoE training case; see ``autograd_cases.py``. MoE outputs and gradients are compared over the whole
world with two float64 single-process references:

* "ref": the plain MoE, no quantization. MXFP8 E4M3 has 3 mantissa bits: one row-wise quantization
  of Gaussian data is ~31.5 dB (rceil) / ~30.6 dB (floor). The forward quantizes twice (dispatch,
  combine) and SwiGLU roughly doubles the noise power of its input (both the gate and the up
  projection see it), so y lands at ~26 dB and the gradients at ~24-27 dB (measured on these
  cases, worlds 1/2/4: y 25.8-26.9 dB rceil, 25.3-26.2 dB floor; gradients 24.6-27.5 dB rceil,
  24.0-26 dB floor). The thresholds below sit 1-2 dB under that (floor mode 1 dB lower).
  The 30 / 28 dB first asked for are not reachable by any MXFP8 transport of a SwiGLU MoE: even the
  DeepEP-style recipe (MXFP8 dispatch and its backward to the experts, BF16 combine and dispatch
  backward; case ``moe_swiglu_mx_dispatch_bf16_combine``) quantizes the SwiGLU input once and lands
  at y 27.4 dB, grad_x 28.1 dB, expert weight gradients 25.6-26.6 dB, router 28.0 dB (world 2).
* "sim": the same float64 MoE with the transport roundings applied at the documented points
  (``moe_reference(simulate=True)``). Against it every quantity must be >= 45 dB (measured:
  y ~55 dB and grad_x ~54-64 dB, i.e. the bf16 rounding of the outputs; weight gradients ~130 dB):
  the implementation adds no error of its own.
* "exact" cases (small-integer data: every transport, product and sum is exact) must match the plain
  float64 reference bit for bit, in both precisions.
"""
import math

import pytest

from _dist import run_world
from autograd_cases import backward_edge_cases, backward_op_cases, backward_ops_worker, compile_worker, moe_cases, \
    world_worker
from ep_cases import random_cases

FWD_SQNR_DB = 24.5     # vs "ref", MXFP8 (rceil) transport both ways, SwiGLU experts
GRAD_SQNR_DB = 23.0    # vs "ref", MXFP8 (rceil)
FLOOR_PENALTY_DB = 1.0  # floor scales lose ~0.9 dB per quantization
BF16_SQNR_DB = 40.0    # vs "ref", BF16 transport
SIM_SQNR_DB = 45.0     # vs "sim", any precision


def sqnr_db(sig: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / noise)


def _want(case, kind, name):
    if case.exact:
        return math.inf
    if kind == "sim":
        return SIM_SQNR_DB
    if case.precision == "bf16":
        return BF16_SQNR_DB
    base = FWD_SQNR_DB if name == "y" else GRAD_SQNR_DB
    return base - (FLOOR_PENALTY_DB if case.scale_mode == "floor" else 0.0)


def _check_world(results, moe):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:30])
    for r in results:
        assert r["ops"]["checks"] > 0
        if r["ops"].get("backend") == "torch":  # the oracle's formula with the same fp32 operations: bit for bit
            assert r["ops"]["exact"] == r["ops"]["checks"], r["ops"]
    report, bad = [], []
    for case in moe:
        per_rank = [r["moe"][case.name] for r in results]
        keys = sorted({key for pr in per_rank for key in pr["metrics"]})
        assert {("ref", "y"), ("ref", "grad_x"), ("sim", "grad_expert_param0")} <= set(keys), keys
        for kind, name in keys:
            sig = sum(pr["metrics"][(kind, name)][0] for pr in per_rank if (kind, name) in pr["metrics"])
            noise = sum(pr["metrics"][(kind, name)][1] for pr in per_rank if (kind, name) in pr["metrics"])
            db, want = sqnr_db(sig, noise), _want(case, kind, name)
            report.append(f"{case.name}.{name} vs {kind}: {db:.1f} dB (want >= {want})")
            if sig <= 0:
                bad.append(f"{case.name}.{name}: reference is all zero (test data too weak)")
            if db < want:
                bad.append(report[-1])
        if case.router:
            got = sum(pr["gWr"] for pr in per_rank)
            for kind in ("ref", "sim"):
                ref = per_rank[0]["gWr_ref"][kind]
                db, want = sqnr_db(float((ref ** 2).sum()), float(((got - ref) ** 2).sum())), _want(case, kind, "")
                report.append(f"{case.name}.grad_router vs {kind}: {db:.1f} dB (want >= {want})")
                if db < want:
                    bad.append(report[-1])
    print("\n".join(report))
    assert not bad, "SQNR too low:\n" + "\n".join(bad) + "\nall:\n" + "\n".join(report)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_backward_and_autograd(world):
    ops = backward_op_cases(world)
    moe = moe_cases(world)
    results = run_world(world, world_worker, ops, moe, world == 2, timeout=240)
    _check_world(results, moe)


@pytest.mark.parametrize("world", [2, 3])
def test_backward_ops_edge_and_random_cases(world):
    """combine_for_backward / combine_backward / dispatch_backward of the reference backend against the oracle on
    edge cases and fresh random routings: y, grad_x, grad_expert_out bit for bit, grad_w within fp32 tolerance."""
    cases = backward_edge_cases(world) + random_cases(world, 8, seed=4000 + world)
    results = run_world(world, backward_ops_worker, cases, timeout=240)
    fails = [f for res in results for f in res["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:30])
    for res in results:
        assert res["cases"] == len(cases) and res["checks"] > 0
        assert res["exact"] == res["checks"], res


def test_moe_block_under_torch_compile_matches_eager():
    """torch.compile around the whole block (graph breaks at the communication calls) changes nothing."""
    results = run_world(2, compile_worker, timeout=240)
    fails = [f for r in results for f in r["failures"]]
    assert not fails, "\n".join(fails)
