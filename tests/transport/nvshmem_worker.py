"""One rank of the transport GPU tests (started by test_nvshmem_ranks.py through mpirun or a spawner).

Steps, each recorded in ``<outdir>/rank<r>.json`` (written even when a step fails):
  1. bootstrap NVSHMEM by the chosen route (``uid``: rank 0 writes the id to ``<outdir>/uid.bin``;
     ``torch``: gloo group over a file store; ``mpi``: MPI.COMM_WORLD), check idempotency;
  2. symmetric heap: data ``[world, H]`` float32 (a slot per source rank), flags ``[world]`` int64,
     error word; sizes, peer pointers; a torch copy into every peer through its peer tensor;
  3. Triton handshake (epoch 1): each rank stores a row into every peer's slot and signals it,
     then waits (bounded) for every peer's row;
  4. optional timeout (epoch 2, ``--skipper S --victim V``): rank S does not signal rank V, so V's
     bounded wait must end with PeerTimeout naming S, while all other waits succeed;
  5. finalize.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

H = 256  # floats per row


def _parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--route", choices=("uid", "torch", "mpi"), required=True)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--nranks", type=int, default=None)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--skipper", type=int, default=-1)
    ap.add_argument("--victim", type=int, default=-1)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="bound of the normal handshake wait")
    ap.add_argument("--short-timeout-s", type=float, default=2.0, help="bound of the wait that must time out")
    return ap.parse_args()


def _bootstrap(args, tp, res):
    if args.route == "mpi":
        from mpi4py import MPI

        ctx = tp.init_nvshmem(mpi_comm=MPI.COMM_WORLD)
        again = tp.init_nvshmem(mpi_comm=MPI.COMM_WORLD)
    elif args.route == "torch":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(args.outdir, 'store')}", rank=args.rank, world_size=args.nranks
        )
        ctx = tp.init_nvshmem(group=dist.group.WORLD)
        again = tp.init_nvshmem(group=dist.group.WORLD)
    else:
        path = os.path.join(args.outdir, "uid.bin")
        if args.rank == 0:
            uid = tp.new_unique_id()
            with open(path + ".tmp", "wb") as f:
                f.write(uid)
            os.replace(path + ".tmp", path)
        else:
            deadline = time.monotonic() + 120
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {args.rank}: no unique id from rank 0 in {path} after 120 s")
                time.sleep(0.05)
            with open(path, "rb") as f:
                uid = f.read()
        ctx = tp.init_nvshmem(uid=uid, rank=args.rank, nranks=args.nranks)
        again = tp.init_nvshmem(uid=uid, rank=args.rank, nranks=args.nranks)
    res.update(
        rank=ctx.rank, world=ctx.world, route=ctx.route, device=str(ctx.device),
        local_peers=list(ctx.local_peers), idempotent=again is ctx, initialized=tp.is_initialized(),
    )
    return ctx


def _heap(ctx, tp, torch, res):
    heap = tp.SymmetricHeap(ctx)
    data = heap.alloc("data", (ctx.world, H), torch.float32)
    flags = heap.alloc("flags", (ctx.world,), torch.int64)
    err = heap.alloc("err", (1,), torch.int64)
    same = heap.alloc("data", (ctx.world, H), torch.float32)
    try:
        heap.alloc("data", (ctx.world, H + 1), torch.float32)
        realloc_refused = False
    except ValueError:
        realloc_refused = True
    ptrs = data.peer_ptrs.cpu().tolist()
    res.update(
        heap_report=heap.report(), heap_nbytes=heap.nbytes, realloc_same=same is data, realloc_refused=realloc_refused,
        has_peer_pointer=list(data.has_peer_pointer), own_ptr_ok=ptrs[ctx.rank] == data.local.data_ptr(),
        peer_ptrs_nonzero=[p != 0 for p in ptrs], zeroed=bool((data.local == 0).all() and (flags.local == 0).all()),
    )
    ctx.barrier()  # every rank checked `zeroed` before any peer writes into its buffer
    # torch writes through every peer tensor: row `rank` of peer p's data gets 7 + rank + 10 p
    for p in range(ctx.world):
        data.peer(p)[ctx.rank].fill_(7.0 + ctx.rank + 10.0 * p)
    ctx.barrier()
    want = torch.stack([torch.full((H,), 7.0 + s + 10.0 * ctx.rank, device=ctx.device) for s in range(ctx.world)])
    res["peer_copy_ok"] = bool(torch.equal(data.local, want))
    data.local.zero_()
    ctx.barrier()
    return heap, data, flags, err


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    from mxcomm.transport.flags import deadline_after, signal_peer, wait_flag_geq

    @triton.jit
    def exchange(data_ptrs, flag_ptrs, my_flags, err, me, epoch, timeout, skipper, victim, H: tl.constexpr):
        # program p: my row -> slot `me` of peer p's data, signal peer p's flag[me] = epoch; wait my flag[p] >= epoch
        p = tl.program_id(0)
        base = tl.load(data_ptrs + p).to(tl.pointer_type(tl.float32))
        flag = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int64))
        offs = tl.arange(0, H)
        tl.store(base + me * H + offs, (me * 1000 + epoch * 100000 + offs).to(tl.float32))
        tl.debug_barrier()
        if (me != skipper) | (p != victim):
            signal_peer(flag + me, epoch)
        deadline = deadline_after(timeout)
        wait_flag_geq(my_flags + p, epoch, deadline, err, p)

    return exchange


def _expected_rows(torch, ctx, epoch, skip_source=-1):
    rows = []
    for s in range(ctx.world):
        rows.append(torch.arange(H, dtype=torch.float32, device=ctx.device) + 1000 * s + 100000 * epoch)
    out = torch.stack(rows)
    keep = [s for s in range(ctx.world) if s != skip_source]
    return out, keep


def _exchange(args, ctx, tp, torch, bufs, epoch, timeout_s, skipper, victim):
    data, flags, err = bufs
    exchange = _kernel()
    err.local.zero_()
    kargs = (data.peer_ptrs, flags.peer_ptrs, flags.local, err.local, ctx.rank, epoch, tp.timeout_ns(timeout_s),
             skipper, victim)
    exchange.warmup(*kargs, grid=(ctx.world,), H=H)  # compile first: a rank still compiling is not a slow peer
    ctx.barrier()
    t0 = time.monotonic()
    exchange[(ctx.world,)](*kargs, H=H)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    timeout = None
    try:
        tp.check_errors(err.local, what=f"exchange epoch {epoch}", rank=ctx.rank)
    except tp.PeerTimeout as exc:
        timeout = {"peer": exc.peer, "peers": list(exc.peers), "what": exc.what, "message": str(exc)}
    skip_source = skipper if ctx.rank == victim else -1
    want, keep = _expected_rows(torch, ctx, epoch, skip_source)
    rows_ok = bool(torch.equal(data.local[keep], want[keep]))
    flags_seen = flags.local.cpu().tolist()
    ctx.barrier()  # nobody starts the next epoch (or frees) while a peer still writes
    return {"elapsed_s": elapsed, "timeout": timeout, "rows_ok": rows_ok, "flags": flags_seen}


def main():
    args = _parse()
    os.makedirs(args.outdir, exist_ok=True)
    res = {"argv": sys.argv[1:], "steps": []}
    rank_hint = args.rank if args.rank is not None else int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    out = os.path.join(args.outdir, f"rank{rank_hint}.json")

    def dump():
        with open(out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(out + ".tmp", out)

    try:
        import torch

        import mxcomm.transport as tp

        ctx = _bootstrap(args, tp, res)
        res["steps"].append("bootstrap")
        dump()
        heap, data, flags, err = _heap(ctx, tp, torch, res)
        res["steps"].append("heap")
        dump()
        res["handshake"] = _exchange(args, ctx, tp, torch, (data, flags, err), 1, args.timeout_s, -1, -1)
        res["steps"].append("handshake")
        dump()
        if args.skipper >= 0:
            res["skip"] = _exchange(
                args, ctx, tp, torch, (data, flags, err), 2, args.short_timeout_s, args.skipper, args.victim
            )
            res["steps"].append("timeout")
            dump()
        tp.finalize()
        if args.route == "torch":
            import torch.distributed as dist

            dist.destroy_process_group()
        res["finalized"] = not tp.is_initialized() and not heap.is_open
        res["steps"].append("finalize")
    except BaseException:  # noqa: BLE001 - recorded for the test, then re-raised
        res["error"] = traceback.format_exc()
        dump()
        raise
    dump()


if __name__ == "__main__":
    main()
