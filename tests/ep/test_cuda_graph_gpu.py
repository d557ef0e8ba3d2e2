"""CUDA graphs: a whole MoE block forward + backward through
the nvshmem backend captured once and replayed with new inputs and routings, bit-identical to eager
steps on the same inputs; capture of the exact-size mode refused with a clear error. 1 and 2 ranks
(2 ranks: on two GPUs when there are two, else sharing one)."""
import pytest

from _dist import run_world
from graph_cases import graph_worker
from mxcomm.transport import launcher_env

pytestmark = pytest.mark.nvshmem

ENV = launcher_env(1 << 30)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_moe_block_forward_backward_cuda_graph_replays_equal_eager(world, precision):
    results = run_world(world, graph_worker, precision, env=ENV, timeout=600)
    fails = [f for r in results for f in r["failures"]]
    assert not fails, "\n".join(fails[:30])
    assert all(r["replays"] == 4 for r in results)
