"""The ``torch`` reference EP backend against the single-process oracle, in spawned gloo worlds.

Each world runs many cases in one spawn (process start-up is the slow part); every world is
time-bounded by ``run_world`` so a hang fails the test instead of blocking CI.
Soak iterations: ``MXCOMM_EP_SOAK_ITERS`` (default 200 on one rank; a fifth of that on two ranks).
"""
import os

import pytest

from _dist import run_world
from ep_cases import (
    bad_inputs_worker,
    config_mismatch_worker,
    random_cases,
    run_cases,
    soak_worker,
    standard_cases,
)


def _assert_clean(results, min_cases=1):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:40])
    for r in results:
        if "cases" in r:
            assert r["cases"] >= min_cases
            assert r["combine_checks"] > 0
            # the reference backend computes the oracle's formula with the same fp32 operations: bit for bit
            assert r["combine_exact"] == r["combine_checks"], r


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reference_matches_oracle(world):
    cases = standard_cases(world, seed=world) + random_cases(world, 6, seed=100 + world)
    results = run_world(world, run_cases, cases, timeout=150)
    _assert_clean(results, min_cases=len(cases))


def test_bad_inputs_raise_before_communicating():
    _assert_clean(run_world(2, bad_inputs_worker, timeout=90))


@pytest.mark.parametrize("world", [2, 4])
def test_config_mismatch_raises_on_every_rank(world):
    _assert_clean(run_world(world, config_mismatch_worker, timeout=90))


SOAK_ITERS = int(os.environ.get("MXCOMM_EP_SOAK_ITERS", "200"))


def test_soak_one_rank():
    """Random shapes/routings/configs, every row compared (row checksums locate a mismatch)."""
    results = run_world(1, soak_worker, SOAK_ITERS, 1234, timeout=60 + 2 * SOAK_ITERS)
    _assert_clean(results, min_cases=SOAK_ITERS)


def test_soak_two_ranks():
    iters = max(1, SOAK_ITERS // 5)
    results = run_world(2, soak_worker, iters, 4321, timeout=60 + 5 * iters)
    _assert_clean(results, min_cases=iters)
