"""mxcomm.transport.mpi: launcher variables, argument checks, and the rendezvous itself under mpirun
(idempotent second call, all-reduce over the resulting gloo group, local ranks)."""
from __future__ import annotations

from pathlib import Path

import pytest

import mpi_launch
from mxcomm.transport import mpi as tmpi

HAVE_MPI, NO_MPI_REASON = mpi_launch.have_mpi()
WORKER = Path(__file__).with_name("bootstrap_worker.py")


def test_launcher_rank_reads_common_launchers():
    assert tmpi.launcher_rank({}) is None
    assert tmpi.launcher_rank({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
                               "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == (3, 8, 1)
    assert tmpi.launcher_rank({"PMI_RANK": "2", "PMI_SIZE": "4"}) == (2, 4, -1)
    assert tmpi.launcher_rank({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0"}) == (5, 6, 0)
    # OpenMPI wins over Slurm when both are set (mpirun inside an allocation).
    both = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert tmpi.launcher_rank(both) == (1, 2, -1)
    assert tmpi.launcher_rank({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}) is None


def test_bad_arguments_raise_before_mpi():
    with pytest.raises(TypeError, match="backend"):
        tmpi.init_dist_from_mpi(backend="")
    with pytest.raises(ValueError, match="timeout_s"):
        tmpi.init_dist_from_mpi(timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        tmpi.init_dist_from_mpi(timeout_s=True)
    with pytest.raises(TypeError, match="host"):
        tmpi.init_dist_from_mpi(host="")
    with pytest.raises(TypeError, match="mpi4py communicator"):
        tmpi.init_dist_from_mpi(comm=object())


@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_MPI, reason=NO_MPI_REASON)
def test_rendezvous_under_mpirun(tmp_path):
    run = mpi_launch.mpirun(3, WORKER, [], env=mpi_launch.child_env(), outdir=tmp_path / "out", timeout_s=90)
    run.check()
    ports = {res["port"] for res in run.results.values()}
    assert len(ports) == 1 and ports != {0}
    for r, res in run.results.items():
        assert (res["rank"], res["world"], res["created"]) == (r, 3, True)
        assert res["host"] == "127.0.0.1"  # one host
        assert res["allreduce"] == 0 + 1 + 2
        assert res["again_created"] is False and res["again_rank"] == r
        assert res["local_rank"] == res["env_local_rank"]
