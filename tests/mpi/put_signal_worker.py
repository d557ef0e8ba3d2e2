"""One rank of the put-with-signal GPU test (csrc/put_signal.cu through mxcomm.transport.put_signal).

Started by test_mpi_put_signal.py under mpirun (``--route mpi``) or as plain processes (``--route
uid``: rank 0 writes the NVSHMEM unique id to a file). Every rank forces the remote path to every
other rank (``put_path_peers(ctx, force_remote=True)``), so one GPU stands in for several nodes.

Rounds (epoch = round + 1): each source ``s`` sends ``pieces`` entries of random sizes (0, odd,
up to ``max_bytes``) to every destination ``p``, from random places in its staging buffer to
random, non-overlapping places in region ``s`` of ``p``'s receive buffer, split into ``chunks``
(some rounds on a few CUDA blocks, which then take turns over the pieces; some as plain puts, a
``quiet`` and one signal-only entry per piece); ``p`` waits for ``signals[s] >= epoch * pieces *
chunks``, then checks every byte of the buffer (entries exact, everything else untouched). All data comes from seeds, so every rank knows what
every other rank sent. Then: an out-of-range entry must be refused on the device (error code 2,
nothing written, no signal); and with ``--skipper S --victim V`` rank S skips V in one round, so
V's bounded wait must end with PeerTimeout naming S. Results go to ``<outdir>/rank<r>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))

REGION = 3 << 20          # bytes of a destination's receive region per source rank
STAGE = 4 << 20           # bytes of a source's staging buffer
FILL = 0xEE               # receive buffer fill before each round


@dataclass(frozen=True)
class Round:
    """One round: ``pieces`` entries per destination of up to ``max_bytes`` each, ``chunks`` pieces each, on at
    most ``blocks`` CUDA blocks (None: one per piece); ``plain``: put without signals, ``quiet``, then
    ``pieces`` empty signalled entries per destination (the same count the signalled puts add)."""

    chunks: int
    pieces: int
    max_bytes: int
    blocks: int | None = None
    plain: bool = False


# chunks * pieces is the same in every round, so each round (epoch e) ends with every signal word at e * PER_EPOCH.
ROUNDS = [Round(1, 12, 4096), Round(4, 3, 100_000), Round(12, 1, 2_500_000), Round(3, 4, 0), Round(6, 2, 333_333),
          Round(4, 3, 100_000, blocks=1), Round(2, 6, 50_000, blocks=5), Round(12, 1, 2_500_000, blocks=7),
          Round(4, 3, 100_000, blocks=3, plain=True), Round(1, 12, 4096, plain=True)]
TIMEOUT_ROUND = Round(2, 6, 50_000)
PER_EPOCH = 12
assert all(r.chunks * r.pieces == PER_EPOCH for r in ROUNDS + [TIMEOUT_ROUND])


def _parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--route", choices=("mpi", "uid"), required=True)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--nranks", type=int, default=None)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--skipper", type=int, default=-1)
    ap.add_argument("--victim", type=int, default=-1)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--short-timeout-s", type=float, default=2.0)
    return ap.parse_args()


def _bootstrap(args, tp):
    if args.route == "mpi":
        from mpi4py import MPI

        return tp.init_nvshmem(mpi_comm=MPI.COMM_WORLD)  # GPU: local rank % device_count
    path = os.path.join(args.outdir, "uid.bin")
    if args.rank == 0:
        with open(path + ".tmp", "wb") as f:
            f.write(tp.new_unique_id())
        os.replace(path + ".tmp", path)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("no NVSHMEM unique id from rank 0 within 60 s")
        time.sleep(0.05)
    with open(path, "rb") as f:
        uid = f.read()
    return tp.init_nvshmem(uid=uid, rank=args.rank, nranks=args.nranks)  # GPU: rank % device_count


def _staging(seed: int, rnd: int, src: int):
    """Source ``src``'s staging bytes in round ``rnd`` (CPU uint8 [STAGE])."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + rnd * 1009 + src)
    return torch.randint(0, 256, (STAGE,), dtype=torch.uint8, generator=g)


def _entries(seed: int, rnd: int, src: int, dst: int, pieces: int, max_bytes: int):
    """``pieces`` entries (src_off, dst_off inside region src, nbytes) from ``src`` to ``dst``; no overlap."""
    import random

    rng = random.Random(seed * 7919 + rnd * 101 + src * 13 + dst)
    sizes = [0 if max_bytes == 0 else rng.choice([0, 1, 15, 17, rng.randint(0, max_bytes), max_bytes])
             for _ in range(pieces)]
    out, pos = [], 0
    for n in sizes:
        pos += rng.randint(0, 64)                      # gap (unaligned starts)
        assert pos + n <= REGION
        out.append((rng.randint(0, STAGE - n), src * REGION + pos, n))
        pos += n
    return out


def _round(ctx, tp, ps, bufs, args, rnd, how: Round, skip, timeout_s, res):
    """One round; ``skip = (S, V)``: rank S sends nothing to rank V (V must time out naming S)."""
    import torch

    chunks, pieces, max_bytes = how.chunks, how.pieces, how.max_bytes

    me, W = ctx.rank, ctx.world
    recv, stage, sig = bufs["recv"], bufs["stage"], bufs["sig"]
    err = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    stage.local.copy_(_staging(args.seed, rnd, me).to(ctx.device))
    recv.local.fill_(FILL)
    ctx.barrier()  # every receive buffer is filled before anyone puts into it
    peers = ps.put_path_peers(ctx, force_remote=True)
    skipped = {(skip[0], skip[1])} if skip else set()
    ents = [(p, e) for p in peers if (me, p) not in skipped
            for e in _entries(args.seed, rnd, me, p, pieces, max_bytes)]
    batch = ps.PutBatch.from_lists([e[1] for _, e in ents], [e[0] for _, e in ents], [e[2] for _, e in ents],
                                   [p for p, _ in ents], ctx.device)
    epoch = torch.full((1,), rnd + 1, dtype=torch.int64, device=ctx.device)
    t0 = time.monotonic()
    if how.plain:
        ps.put(recv.local, stage.local, batch, err, chunks=chunks, blocks=how.blocks)
        ps.quiet()
        dests = [p for p, _ in ents]  # one empty signalled entry per piece sent
        ps.put_signal(recv.local, stage.local, ps.PutBatch.from_lists([0] * len(dests), [0] * len(dests),
                                                                     [0] * len(dests), dests, ctx.device),
                      sig.local, me, err, chunks=chunks)
    else:
        ps.put_signal(recv.local, stage.local, batch, sig.local, me, err, chunks=chunks, blocks=how.blocks)
    srcs = torch.tensor([s for s in range(W) if s != me], dtype=torch.int32, device=ctx.device)
    ps.wait_signals(sig.local, srcs, epoch, ps.signals_per_call(pieces, chunks), err,
                    timeout_ns=tp.timeout_ns(timeout_s))
    ps.quiet()
    torch.cuda.synchronize()
    out = {"chunks": chunks, "pieces": pieces, "blocks": how.blocks, "plain": how.plain, "elapsed_s": time.monotonic() - t0, "timeout": None,
           "bytes_sent": sum(e[2] for _, e in ents)}
    try:
        tp.check_errors(err, what=f"put_signal round {rnd}", rank=me)
    except tp.PeerTimeout as exc:
        out["timeout"] = {"peer": exc.peer, "peers": list(exc.peers), "message": str(exc)}
    # Expected receive buffer: FILL except every entry every source sent here (skipped sources excepted).
    got = recv.local.cpu()
    want = torch.full_like(got, FILL)
    for s in range(W):
        if s == me or (s, me) in skipped:
            continue
        data = _staging(args.seed, rnd, s)
        for so, do, n in _entries(args.seed, rnd, s, me, pieces, max_bytes):
            want[do:do + n] = data[so:so + n]
    bad = torch.nonzero(got != want).view(-1)
    out["bytes_ok"] = bad.numel() == 0
    out["first_bad"] = bad[:8].tolist()
    out["signals"] = sig.local.cpu().tolist()
    res["rounds"].append(out)
    ctx.barrier()  # nobody refills before everyone checked


def _bad_entry(ctx, tp, ps, bufs, res):
    """An entry past the end of dst must be refused on the device: error code 2, nothing written or signalled."""
    import torch

    me, W = ctx.rank, ctx.world
    recv, stage, sig = bufs["recv"], bufs["stage"], bufs["sig"]
    err = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    recv.local.fill_(FILL)
    before = sig.local.cpu().tolist()
    ctx.barrier()
    p = (me + 1) % W
    batch = ps.PutBatch.from_lists([recv.nbytes - 8], [0], [64], [p], ctx.device)
    ps.put_signal(recv.local, stage.local, batch, sig.local, me, err)
    ps.quiet()
    torch.cuda.synchronize()
    ctx.barrier()
    msg = None
    try:
        tp.check_errors(err, what="bad entry", rank=me)
    except tp.TransportError as exc:
        msg = f"{type(exc).__name__}: {exc}"
    res["bad_entry"] = {
        "error_word": int(err.item()), "expected_word": (ps.BAD_ENTRY_CODE << 32) | p, "message": msg,
        "untouched": bool((recv.local == FILL).all()), "signals_unchanged": sig.local.cpu().tolist() == before,
    }


def _gives_up(ctx, tp, ps, bufs, res):
    """A wait whose error word is already set (an earlier wait of the call failed) returns at once, recording
    nothing, however far its signals are from arriving and however long its timeout."""
    import torch

    sig = bufs["sig"]
    word = (1 << 32) | 7
    err = torch.full((1,), word, dtype=torch.int64, device=ctx.device)
    srcs = torch.tensor([s for s in range(ctx.world) if s != ctx.rank], dtype=torch.int32, device=ctx.device)
    epoch = torch.full((1,), 10**6, dtype=torch.int64, device=ctx.device)  # never reached
    torch.cuda.synchronize()
    t0 = time.monotonic()
    ps.wait_signals(sig.local, srcs, epoch, PER_EPOCH, err, timeout_ns=tp.timeout_ns(60.0))
    torch.cuda.synchronize()
    res["gives_up"] = {"elapsed_s": time.monotonic() - t0, "err_unchanged": int(err.item()) == word}


def _host_checks(ctx, ps, bufs, res):
    """Bad arguments raise before any launch."""
    import torch

    recv, stage, sig = bufs["recv"], bufs["stage"], bufs["sig"]
    err = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    batch = ps.PutBatch.from_lists([0], [0], [8], [0], ctx.device)
    plain = torch.zeros(64, dtype=torch.uint8, device=ctx.device)
    checks = {}

    def expect(name, exc, needle, fn):
        try:
            fn()
        except exc as e:
            checks[name] = needle.lower() in str(e).lower()
            return
        except Exception as e:  # noqa: BLE001
            checks[name] = f"raised {type(e).__name__}: {e}"
            return
        checks[name] = "did not raise"

    expect("dst not symmetric", ValueError, "symmetric heap",
           lambda: ps.put_signal(plain, stage.local, batch, sig.local, 0, err))
    expect("signals not symmetric", ValueError, "symmetric heap",
           lambda: ps.wait_signals(torch.zeros(4, dtype=torch.int64, device=ctx.device),
                                   torch.zeros(1, dtype=torch.int32, device=ctx.device),
                                   torch.ones(1, dtype=torch.int64, device=ctx.device), 1, err, timeout_ns=1000))
    expect("signals int32", TypeError, "torch.int64",
           lambda: ps.put_signal(recv.local, stage.local, batch, sig.local.view(torch.int32), 0, err))
    expect("cpu batch", ValueError, "device",
           lambda: ps.put_signal(recv.local, stage.local, ps.PutBatch.from_lists([0], [0], [8], [0], "cpu"),
                                 sig.local, 0, err))
    res["host_checks"] = checks


def main() -> int:
    args = _parse()
    res = {"rank": args.rank, "rounds": [], "error": None, "steps": []}
    rank = args.rank
    try:
        import torch

        from mxcomm import transport as tp
        from mxcomm.transport import cubin
        from mxcomm.transport import put_signal as ps

        ctx = _bootstrap(args, tp)
        rank = ctx.rank
        res.update(rank=ctx.rank, world=ctx.world, route=ctx.route)
        res["steps"].append("bootstrap")
        heap = tp.SymmetricHeap(ctx)
        bufs = {
            "recv": heap.alloc("recv", (ctx.world * REGION,), torch.uint8),
            "stage": heap.alloc("stage", (STAGE,), torch.uint8),
            "sig": heap.alloc("sig", (ctx.world,), torch.int64),
        }
        res["steps"].append("heap")
        t0 = time.monotonic()
        mod = cubin.nvshmem_module(ps.KERNEL_NAMES)
        res["cubin"] = {"path": str(mod.path), "load_s": time.monotonic() - t0}
        res["steps"].append("cubin")
        _host_checks(ctx, ps, bufs, res)
        for rnd, how in enumerate(ROUNDS):
            _round(ctx, tp, ps, bufs, args, rnd, how, None, args.timeout_s, res)
        res["steps"].append("rounds")
        _bad_entry(ctx, tp, ps, bufs, res)
        res["steps"].append("bad_entry")
        _gives_up(ctx, tp, ps, bufs, res)
        res["steps"].append("gives_up")
        if args.skipper >= 0:
            _round(ctx, tp, ps, bufs, args, len(ROUNDS), TIMEOUT_ROUND, (args.skipper, args.victim),
                   args.short_timeout_s, res)
            res["steps"].append("timeout")
        cubin.release_modules()
        tp.finalize()
        res["steps"].append("finalize")
    except BaseException:  # noqa: BLE001 - reported through the JSON
        res["error"] = traceback.format_exc()
    if rank is None:
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    Path(args.outdir, f"rank{rank}.json").write_text(json.dumps(res))
    return 1 if res["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
