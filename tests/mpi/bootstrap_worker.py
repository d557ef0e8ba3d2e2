"""One rank of test_mpi_bootstrap.py: init_dist_from_mpi twice, an all-reduce, results to JSON."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outdir", required=True)
    args = ap.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    res = {"error": None}
    try:
        import torch
        import torch.distributed as dist

        from mxcomm.transport.mpi import init_dist_from_mpi

        info = init_dist_from_mpi(timeout_s=60)
        rank = info.rank
        again = init_dist_from_mpi(timeout_s=60)
        t = torch.tensor([info.rank], dtype=torch.int64)
        dist.all_reduce(t)
        env_local = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID"))
        res.update(rank=info.rank, world=info.world, host=info.host, port=info.port, created=info.created,
                   local_rank=info.local_rank, env_local_rank=int(env_local) if env_local else info.local_rank,
                   again_created=again.created, again_rank=again.rank, allreduce=int(t.item()))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    Path(args.outdir, f"rank{rank}.json").write_text(json.dumps(res))
    return 1 if res["error"] else 0


if __name__ == "__main__":
    from worker_exit import hard_exit

    hard_exit(main())
