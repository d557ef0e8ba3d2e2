"""One rank of the EP tests under mpirun / torchrun / explicit rank (started by test_mpi_ep.py).

Bootstraps torch.distributed one of three ways, then runs EP cases from tests/ep/ep_cases.py
(dispatch + combine against the single-process oracle, through ``ep_cases.run_case``), hashing
every output byte so launches can be compared. Writes ``<outdir>/rank<r>.json``:
``{rank, world, bootstrap, failures, cases, combine_checks, digests: {case: sha256}, error}``.

    --bootstrap mpi       mxcomm.transport.mpi.init_dist_from_mpi() (under mpirun)
    --bootstrap torchrun  init_process_group("gloo") from torchrun's environment (env://)
    --bootstrap explicit  --rank/--nranks given, FileStore in --outdir
    --backend nvshmem     GPU: rank r on GPU r % device_count; --nvshmem-route mpi (unique id over MPI, needs mpirun)
                          or group (EPGroup starts NVSHMEM over the torch.distributed group)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE.parents[1], HERE.parent, HERE.parent / "ep"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", choices=("mpi", "torchrun", "explicit"), required=True)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--nranks", type=int, default=None)
    ap.add_argument("--suite", choices=("standard", "quick"), default="standard")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--backend", choices=("torch", "nvshmem"), default="torch")
    ap.add_argument("--n-random", type=int, default=2, help="random cases added for the nvshmem backend")
    ap.add_argument("--backward", action="store_true",
                    help="also the backward ops and the exact MoE training cases of tests/ep/autograd_cases.py")
    ap.add_argument("--nvshmem-route", choices=("mpi", "group"), default="mpi",
                    help="nvshmem backend: NVSHMEM by unique id over MPI, or started by EPGroup over the torch group")
    ap.add_argument("--transport", choices=("auto", "put"), default="auto",
                    help="nvshmem backend: peer pointers (auto, one node) or the forced put-with-signal path")
    return ap.parse_args()


def _bootstrap(args) -> tuple[int, int]:
    import torch.distributed as dist

    if args.bootstrap == "mpi":
        from mxcomm.transport.mpi import init_dist_from_mpi

        info = init_dist_from_mpi(backend="gloo", timeout_s=120)
        return info.rank, info.world
    if args.bootstrap == "torchrun":
        dist.init_process_group("gloo")
    else:
        store = os.path.join(args.outdir, "filestore")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=args.rank, world_size=args.nranks)
    return dist.get_rank(), dist.get_world_size()


def _feed(h, t) -> None:
    import torch

    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)};".encode())
    if t.numel():
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes())


class RecordingGroup:
    """Passes dispatch/combine through to an EPGroup and hashes every output (for ep_cases.run_case)."""

    def __init__(self, group):
        self.group = group
        self.config = group.config
        self.hash = hashlib.sha256()

    def dispatch(self, x, topk_idx, topk_weights):
        res = self.group.dispatch(x, topk_idx, topk_weights)
        h = self.hash
        h.update(f"dispatch R={res.num_rows};".encode())
        for t in (res.offs, res.counts):
            _feed(h, t)
        if hasattr(res.x, "qdata"):
            _feed(h, res.x.qdata)
            _feed(h, res.x.scales)
        else:
            _feed(h, res.x)
        return res

    def combine(self, expert_out, handle, *, quantize=None, topk_weights=None):
        y = self.group.combine(expert_out, handle, quantize=quantize, topk_weights=topk_weights)
        self.hash.update(f"combine q={quantize} w={'other' if topk_weights is not None else 'dispatch'};".encode())
        _feed(self.hash, y)
        return y


def _cases(args, world: int):
    import ep_cases

    cases = ep_cases.standard_cases(world, seed=args.seed)
    if args.suite == "quick":  # a few cases covering both precisions, both aligns, drops, empty ranks
        keep = {"random_mx_a32", "random_bf16_a128", "dropped_slots", "zero_tokens_some_ranks", "random_mx_a128_floor"}
        cases = [c for c in cases if c.name in keep]
    if args.backend == "nvshmem":
        cases = cases + ep_cases.random_cases(world, args.n_random, seed=args.seed + 1)
        cases = [replace(c, device=args.cuda_device, backend="nvshmem", transport=args.transport) for c in cases]
    return cases


def _run_backward(args, rank: int, world: int, res: dict) -> None:
    """Backward ops vs the oracle and the exact MoE training steps (tests/ep/autograd_cases.py)."""
    try:
        import autograd_cases as ac
    except ImportError as exc:
        res["backward"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        return
    ops = ac.backward_op_cases(world, seed=args.seed)
    moe = [c for c in ac.moe_cases(world, seed=args.seed) if c.exact]
    if args.backend == "nvshmem":
        nv = dict(device=args.cuda_device, backend="nvshmem", transport=args.transport)
        ops = [ac.matched_transport(replace(c, **nv)) for c in ops]
        moe = [replace(c, **nv) for c in moe]
    a = ac.backward_ops_worker(rank, world, ops)
    b = ac.moe_worker(rank, world, moe)
    res["failures"] += a["failures"] + b["failures"]
    res["backward"] = {"available": True, "op_cases": a["cases"], "checks": a["checks"], "exact": a["exact"],
                       "moe_cases": sorted(b["cases"])}


def _run(args, rank: int, world: int, res: dict) -> None:
    import torch

    import ep_cases
    from mxcomm.ep import EPGroup

    if args.backend == "nvshmem":
        from _dist import bind_rank_gpu

        args.cuda_device = bind_rank_gpu(rank)
        if args.nvshmem_route == "mpi":  # NVSHMEM by unique id over MPI; the backend joins this context
            from mpi4py import MPI

            from mxcomm import transport as tp

            tp.init_nvshmem(mpi_comm=MPI.COMM_WORLD, device=torch.cuda.current_device())
    cases = _cases(args, world)
    fails, exact = [], []
    groups = {}
    for case in cases:
        assert len(case.tokens) == world, case.name
        cfg = case.config()
        try:
            if cfg not in groups:
                groups[cfg] = EPGroup(cfg)
            rec = RecordingGroup(groups[cfg])
            ep_cases.run_case(rec, case, rank, fails, exact)
            res["digests"][case.name] = rec.hash.hexdigest()
        except Exception as e:  # noqa: BLE001 - keep ranks in lockstep; report
            fails.append(f"{case.name}[rank {rank}]: raised {type(e).__name__}: {e}")
    res.update(failures=fails, cases=len(cases), combine_checks=len(exact), combine_exact=sum(exact))
    if args.backward:
        _run_backward(args, rank, world, res)
    if args.backend == "nvshmem":
        from mxcomm import transport as tp

        tp.finalize()


def main() -> int:
    args = _parse()
    res = {"bootstrap": args.bootstrap, "digests": {}, "error": None}
    rank = args.rank
    try:
        import torch

        torch.set_num_threads(1)
        rank, world = _bootstrap(args)
        res.update(rank=rank, world=world)
        _run(args, rank, world, res)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the JSON
        res["error"] = traceback.format_exc()
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    Path(args.outdir, f"rank{rank}.json").write_text(json.dumps(res))
    return 1 if res["error"] else 0


if __name__ == "__main__":
    from worker_exit import hard_exit

    hard_exit(main())
