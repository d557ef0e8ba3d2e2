"""Smoke run of the nvshmem EP backend in one process or under mpirun (debugging aid for the GPU machine).

    python3 scripts/ep_smoke.py                 # world of 1
    mpirun -np 2 python3 scripts/ep_smoke.py    # ranks on one GPU (gloo side channel over a file store)
"""
import faulthandler
import os
import sys
import tempfile

faulthandler.enable()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "ep"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
store = os.environ.get("SMOKE_STORE", os.path.join(tempfile.gettempdir(), "mxcomm_smoke_store"))
if rank == 0 and os.path.exists(store) and world == 1:
    os.remove(store)
torch.cuda.set_device(0)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
print(rank, "pg up", flush=True)
from ep_cases import run_cases, standard_cases  # noqa: E402
from dataclasses import replace  # noqa: E402

names = sys.argv[1:] or None
cases = [replace(c, device="cuda:0", backend="nvshmem") for c in standard_cases(world, seed=7)]
if names:
    cases = [c for c in cases if c.name in names]
for c in cases:
    print(rank, "case", c.name, flush=True)
    r = run_cases(rank, world, [c])
    print(rank, c.name, "failures:", r["failures"][:3], flush=True)
from mxcomm import transport as tp  # noqa: E402

tp.finalize()
dist.destroy_process_group()
print(rank, "done", flush=True)
