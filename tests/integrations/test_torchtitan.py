"""torchtitan's own ``MoE`` layer with :class:`mxcomm.integrations.torchtitan.MXCommTokenDispatcher`, against
torchtitan's ``LocalTokenDispatcher`` in one process holding all experts.

CPU (gloo, reference backend ``"torch"``): a world of 2 (EP=2) and a world of 1 with ``ep_mesh=None`` (EP off).
GPU (``-m nvshmem``): the nvshmem backend on 1 rank, 2 ranks on one GPU, 4 ranks on one GPU under MPS.

Compared: the output ``y``; the input gradient in its two exact parts, through the experts (``gx``) and through
the router gate (``gx_router``; the router reads its own leaf copy of x); the router-gate weight gradient summed
over ranks; the expert weight gradients concatenated over ranks. The upstream gradient has bfloat16-representable
values (so mxcomm's BF16 cast of it is exact).

* ``precision="bf16"``: the same values reduced in another fp32 order, then rounded to bfloat16 (the reference keeps
  fp32 in this float32 model). mxcomm's combine sums each token's rows per rank in fp32, rounds that partial to
  bfloat16 for transport, sums the partials in fp32 and rounds once more: with one rank (one partial, rounded
  twice to the same value) and for the expert weight gradients ``|got - ref| <= ulp_bf16(ref) + 1e-5 * max|ref|``:
  one bfloat16 ulp of the value (two fp32 values a few fp32 ulps apart round to the same or adjacent bfloat16
  numbers) plus fp32 reduction-order slack; ``y`` of several ranks (one more bfloat16 rounding per partial, whose
  magnitude may exceed the sum's) normwise ``<= 2**-7``.
  Gradients that never meet a bfloat16 rounding in mxcomm (router gate, ``gx_router``): ``<= 1e-5 * max|ref|``.
  ``gx``: one extra bfloat16 rounding per routed row (see :func:`compare`), normwise ``<= 2**-7``.
  On a GPU (its grouped GEMMs accumulate in another order) BF16 results are compared normwise at ``2**-7``.
* ``precision="mxfp8"``: E4M3 keeps 3 fraction bits, so round-to-nearest has relative error at most ``u = 2**-4``
  for values in the normal range; the rceil power-of-two scale per 32 values puts the block max in ``(224, 448]``
  (never saturates), so values more than ``2**14`` below their block max land in the subnormal range, with
  absolute error at most ``2**-10 * scale <= 2**-17.8 * amax(block)``. With the floor rule block maxima that
  scale into ``(448, 512)`` saturate to 448: ``u = 2**-3``. Per element ``|q - x| <= u * |x| + 2**-17 * amax(block)``
  - checked exactly on the dispatched rows. For a whole tensor one quantization has normwise relative error at
  most ``u`` (plus the negligible subnormal term); errors of the quantizations on a value's path add to first
  order (well-conditioned experts: weights ~ 1/sqrt(fan_in)): ``y``: dispatch payload + combine transport (2);
  expert weight gradients: dispatched rows + gradient transport (2); router gradients: ``<grad_y, expert output row>``,
  the row as the expert computed it from its dispatched input (one quantization on the path; bound 2 kept);
  ``gx``: gradient transport in combine backward and dispatch backward plus the quantized rows in the expert
  backward (3). Bound: ``||got - ref|| / ||ref|| <= n * u``.

Negative controls: the same comparisons with the adapter broken on purpose (real instead of padded counts; scores
dropped) must fail.
"""
import os
import shutil

import pytest
import torch

pytest.importorskip("torchtitan.models.common.token_dispatcher", reason="torchtitan (mxcomm[torchtitan]) not installed")

from _dist import run_world  # noqa: E402
from tt_cases import GRAD_KEYS, TTCase, gather_world, patch_torchtitan_for_cpu, reference_step, world_worker  # noqa: E402

MX_TERMS = {"y": 2, "gx": 3, "gx_router": 2, "g_router": 2, "g_w1": 2, "g_w2": 2, "g_w3": 2}
KEYS = ("y",) + GRAD_KEYS
FP32_KEYS = ("g_router", "gx_router")  # gradients that never pass through a bfloat16 rounding of mxcomm


def _unit(case: TTCase) -> float:
    """Largest relative error of one MX quantization: 2**-4 with rceil; floor saturates block maxima that scale
    into (448, 512) to 448, up to 1 - 448/512 = 2**-3."""
    return 2.0 ** -4 if case.scale_mode == "rceil" else 2.0 ** -3


def _ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    a = v.abs().clamp(min=2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def compare(case: TTCase, results: list, ref: dict, gpu: bool = False) -> tuple[list, list]:
    """(report lines, failures) of every compared tensor. ``gpu``: the ranks ran on a GPU (its BF16 grouped GEMMs
    accumulate in another order than the CPU reference, and intermediate bfloat16 values may differ by one ulp,
    so BF16 results are compared normwise: ``||got - ref|| / ||ref|| <= 2**-7``)."""
    report, bad = [], []
    for key in KEYS:
        got, want = gather_world(case, results, key), ref[key]
        if got.shape != want.shape:
            bad.append(f"{case.name}.{key}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
            continue
        diff = (got - want).abs()
        if case.precision == "bf16" and gpu:
            rel = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
            line = f"{case.name}.{key}: rel {rel:.2e} (bound {2.0 ** -7:.2e}), max|diff| {diff.max().item():.3e}"
            report.append(line)
            if not rel <= 2.0 ** -7:
                bad.append(line)
        elif case.precision == "bf16" and (key == "gx" or (key == "y" and len(results) > 1)):
            # gx: the routed rows are bfloat16, so autograd sums each row's two expert-input gradients (w1 and w3
            # paths of GroupedExperts) in bfloat16 before mxcomm's fp32 sum over k: one more bfloat16 rounding
            # per row than in the float32 reference, whose parts may cancel. y over several ranks: each (token,
            # rank) partial is rounded to bfloat16 before the final rounding. Compared normwise at two bfloat16
            # ulps (2**-7 relative).
            rel = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
            line = f"{case.name}.{key}: rel {rel:.2e} (bound {2.0 ** -7:.2e}), max|diff| {diff.max().item():.3e}"
            report.append(line)
            if not rel <= 2.0 ** -7:
                bad.append(line)
        elif case.precision == "bf16":
            slack = 1e-5 * want.abs().max()
            tol = slack if key in FP32_KEYS else _ulp_bf16(want) + slack
            worst = (diff - tol).max().item()
            line = f"{case.name}.{key}: max|diff| {diff.max().item():.3e} (max|ref| {want.abs().max().item():.3e})"
            report.append(line)
            if worst > 0 or not torch.isfinite(got).all():
                bad.append(line + " over the bound")
        else:
            rel = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
            bound = MX_TERMS[key] * _unit(case)
            line = f"{case.name}.{key}: rel {rel:.4f} (bound {bound:.4f}), max|diff| {diff.max().item():.3e}"
            report.append(line)
            if not rel <= bound:
                bad.append(line)
    return report, bad


def mx_row_failures(case: TTCase, results: list) -> list:
    """Elementwise MX bound on the dispatched rows of every rank, against the BF16 dispatch of the same tokens."""
    fails = []
    for r, res in enumerate(results):
        rows = res[case.name]["rows"]
        q, x = torch.from_numpy(rows[case.precision]), torch.from_numpy(rows["bf16"])
        if q.shape != x.shape or (rows[case.precision + "_counts"] != rows["bf16_counts"]).any():
            fails.append(f"rank {r}: MX and BF16 dispatch layouts differ: {tuple(q.shape)} vs {tuple(x.shape)}")
            continue
        amax = x.abs().view(x.shape[0], -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(x.shape)
        excess = (q - x).abs() - (_unit(case) * x.abs() + 2.0 ** -17 * amax)
        if excess.max().item() > 0:
            fails.append(f"rank {r}: dispatched MX rows exceed the E4M3 bound by {excess.max().item():.3e}")
    return fails


def _cases(world: int) -> list:
    def T(*per):
        return tuple(per[r % len(per)] for r in range(world))

    return [
        TTCase("bf16_softmax", "bf16", tokens=T(40, 24), seed=1),
        TTCase("bf16_sigmoid_norm_scale_dead", "bf16", tokens=T(48, 16), num_experts=8, topk=3, score_func="sigmoid",
               route_norm=True, route_scale=2.5, dead_experts=(1, 5, 6), seed=2),
        TTCase("mx_softmax_a128", "mxfp8", tokens=T(40, 24), align=128, seed=3),
        TTCase("mx_floor_dead", "mxfp8", tokens=T(33, 31), dim=96, ffn_dim=64, topk=3, scale_mode="floor",
               dead_experts=(0, 7), seed=4),
    ]


def _check(world: int, results: list, cases: list, gpu: bool = False) -> None:
    patch_torchtitan_for_cpu()
    report, bad = [], []
    for case in cases:
        ref = reference_step(case)
        if case.dead_experts:  # the routing really leaves those experts empty
            assert all(ref["tokens_per_expert"][e] == 0 for e in case.dead_experts), case.name
        rep, b = compare(case, results, ref, gpu)
        report += rep
        bad += b
        if case.precision == "mxfp8" and "rows" in results[0][case.name]:
            bad += [f"{case.name}: {f}" for f in mx_row_failures(case, results)]
    print("\n".join(report))
    assert not bad, "\n".join(bad)


def test_torchtitan_moe_ep2_gloo_matches_local_dispatcher():
    cases = _cases(2)
    _check(2, run_world(2, world_worker, cases, timeout=300), cases)


def test_torchtitan_moe_ep_off_world_of_one():
    """``ep_mesh=None``: the dispatcher runs over a one-rank process group holding all experts."""
    cases = [c for c in _cases(1) if c.name in ("bf16_softmax", "mx_floor_dead")]
    _check(1, run_world(1, world_worker, cases, "torch", "cpu", False, timeout=300), cases)


@pytest.mark.parametrize("mutation", ["real_counts", "no_scores"])
def test_broken_adapter_is_caught(mutation):
    """Negative control: the comparison above fails when the adapter is broken."""
    cases = [_cases(2)[0], _cases(2)[2]]
    results = run_world(2, world_worker, cases, "torch", "cpu", True, mutation, timeout=300)
    patch_torchtitan_for_cpu()
    for case in cases:
        _, bad = compare(case, results, reference_step(case))
        assert bad, f"{mutation}: {case.name} still matched the reference"


def test_config_validation_and_missing_sizes():
    from mxcomm.integrations.torchtitan import MXCommTokenDispatcher

    with pytest.raises(ValueError, match="precision"):
        MXCommTokenDispatcher.Config(num_experts=4, top_k=1, precision="fp8").build()
    with pytest.raises(ValueError, match="align"):
        MXCommTokenDispatcher.Config(num_experts=4, top_k=1, align=64).build()
    d = MXCommTokenDispatcher.Config(num_experts=4, top_k=1).build()
    with pytest.raises(ValueError, match="hidden_dim and num_max_tokens_per_rank"):
        d.ep_config()
    with pytest.raises(RuntimeError, match="wire_meshes"):
        d.dispatch(torch.zeros(1, 32), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), torch.zeros(4))


# ------------------------------------------------------------------------------------------ GPU (nvshmem) ----
def _mps_running() -> bool:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    return bool(pipe) and os.path.exists(os.path.join(pipe, "control")) and bool(shutil.which("nvidia-cuda-mps-control"))


def _nvshmem_env(extra=None) -> dict:
    from mxcomm.transport import launcher_env

    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    env.update(launcher_env(2 << 30))
    env.update(extra or {})
    return env


@pytest.mark.nvshmem
@pytest.mark.parametrize("world", [1, 2])
def test_torchtitan_moe_nvshmem_one_gpu(world):
    cases = _cases(world)
    res = run_world(world, world_worker, cases, "nvshmem", "cuda", True, env=_nvshmem_env(), timeout=900)
    _check(world, res, cases, gpu=True)


@pytest.mark.nvshmem
@pytest.mark.skipif(not _mps_running(), reason="4 ranks on one GPU need an MPS daemon (CUDA_MPS_PIPE_DIRECTORY)")
def test_torchtitan_moe_nvshmem_four_ranks_one_gpu_mps():
    cases = _cases(4)
    env = _nvshmem_env({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})
    _check(4, run_world(4, world_worker, cases, "nvshmem", "cuda", True, env=env, timeout=900), cases, gpu=True)
