"""One rank of the GPU fault tests (started by test_faults_gpu.py, one process per rank, all on one GPU).

Phases (``--phase``), each after a few good dispatch + combine rounds, results in ``<outdir>/rank<r>.json``:

* ``dispatch``: rank ``--victim`` kills itself (SIGKILL) right before a dispatch; every survivor's dispatch must
  raise ``PeerTimeout`` naming it, within ``timeout_s + 1 s``;
* ``combine``: the victim dispatches, then dies before the combine; the survivors' combine records the bounded
  wait's timeout on the device (a combine never syncs with the host) and their next sync, ``check_errors()``, must
  raise the same within the same bound;
* ``bad_ids``: the victim passes an expert id out of range (exact-size mode): it raises ValueError at once, before
  it sends anything; the others must raise ``PeerTimeout`` naming it (they wait for its counts);
* ``soak``: ``--iters`` calls, each a new random case (no pool: a seeded stream draws every call's token counts
  0..max per rank, routing - random, a subset of experts, every token to one expert - dropped slots and data), until
  ``--max-s`` is spent (every 100 calls the ranks agree whether to stop). Every call checks ALL of this rank's
  dispatch output against the expected result (every payload byte and scale byte of every row, padding included;
  offs, counts, num_rows, layout) and its combine output against the expected sum. The expected results come from
  the rank-local reference of ep_cases (``soak_routes`` / ``rank_dispatch_expected`` / ``rank_combine_expected``:
  the oracle's contract computed for this rank only, vectorized; bit-identical to the oracle, which
  test_faults_reference.py checks over the case matrices), and every ``--crosscheck-every`` calls the full
  single-process oracle (mxcomm.ep.reference.oracle) is run as well and must agree with it bit for bit. Host RSS and
  device memory are sampled after call min(200, iters/4) and at the end. The result has the calls done, failed
  calls, rows checked, wall time, calls/s (with checkpoints every 1000 calls) and where the time went.
  ``--corrupt-every N`` (a self-test of the checks) flips one expected value every N calls (a payload byte, a scale
  byte, a count, a combine value, in turn): each such call must be reported as a failure.

Survivors then exit through the normal interpreter shutdown (the test measures that they do, within a bound).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _real_rows(exp):
    """bool [num_rows]: the rows of a DispatchResult inside its groups' counts (not padding)."""
    import torch

    real = torch.zeros(exp.num_rows, dtype=torch.bool)
    start = 0
    for end, n in zip(exp.offs.tolist(), exp.counts.tolist()):
        real[start:start + n] = True
        start = end
    return real


def _parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--nranks", type=int, required=True)
    ap.add_argument("--outdir", required=True)
    ap.add_argument("--phase", choices=("dispatch", "combine", "bad_ids", "soak", "sleep", "mismatch", "bad_config"),
                    required=True)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--max-s", type=float, default=1e9, help="soak: stop after this many seconds (calls done reported)")
    ap.add_argument("--backend", default="nvshmem", help="'torch': the same steps on the reference backend, CPU (a dry run)")
    ap.add_argument("--crosscheck-every", type=int, default=50,
                    help="soak: run the full oracle too every this many calls (0: never)")
    ap.add_argument("--corrupt-every", type=int, default=0,
                    help="soak self-test: corrupt one expected value every this many calls (0: never)")
    return ap.parse_args()


def main() -> int:
    args = _parse()
    sys.path.insert(0, str(HERE))  # ep_cases (the oracle helpers of the EP tests)
    sys.path.insert(0, str(HERE.parent))
    res = {"rank": args.rank, "phase": args.phase, "steps": []}
    out = Path(args.outdir) / f"rank{args.rank}.json"

    def save():
        out.write_text(json.dumps(res))

    try:
        import torch
        import torch.distributed as dist

        # the per-call host work is small tensors: intra-op threads of several rank processes sharing the host's
        # cores only oversubscribe it (measured on 2 cores, 2 ranks: 2.5x the calls/s with one thread each)
        torch.set_num_threads(1)

        from ep_cases import (Case, check_combine, check_dispatch, make_expert_outs, make_inputs, rank_combine_expected,
                              rank_dispatch_expected, soak_routes)
        from mxcomm.ep import EPConfig, EPGroup
        from mxcomm.ep.reference.oracle import oracle_combine, oracle_dispatch
        from mxcomm.transport import PeerTimeout

        dev = "cuda" if args.backend == "nvshmem" else "cpu"
        if dev == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(args.outdir, 'store')}",
                                rank=args.rank, world_size=args.nranks, timeout=datetime.timedelta(seconds=120))
        W, r = args.nranks, args.rank
        E, H, k, Tmax = 4 * W, 256, 3, 64
        base = Case("fault", tuple([Tmax] * W), E, H, k, max_tokens=Tmax, device=dev, backend=args.backend)
        cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=Tmax, backend=args.backend,
                       timeout_s=args.timeout_s)
        if args.phase == "bad_config":  # the victim's config is invalid (hidden not a multiple of 32)
            from dataclasses import replace as _replace

            t0 = time.monotonic()
            try:
                EPGroup(_replace(cfg, hidden=48) if r == args.victim else cfg)
                res["raised"] = None
            except ValueError as e:
                res.update(raised="ValueError", message=str(e))
            res["elapsed_s"] = time.monotonic() - t0
            save()
            return 0
        group = EPGroup(cfg)
        res["steps"].append("group")
        rng = random.Random(11)
        clock = {"inputs": 0.0, "reference": 0.0, "dispatch": 0.0, "check_dispatch": 0.0, "combine": 0.0,
                 "check_combine": 0.0, "oracle_crosscheck": 0.0}
        tally = {"rows_checked": 0, "real_rows_checked": 0, "tokens_combined": 0, "combine_exact": 0,
                 "crosschecks": 0, "corrupted": 0, "failed_calls": 0, "failed_call_ids": []}

        def random_case(i):
            """A new case per call (own seed: own data; token counts, routing, drops and hot expert drawn)."""
            return Case(f"c{i}", tuple(rng.choice([0, 1, 7, rng.randint(0, Tmax)]) for _ in range(W)), E, H, k,
                        max_tokens=Tmax, seed=7919 * i + 3, drop_p=rng.choice([0.0, 0.3]),
                        routing=rng.choice(["random", "random", "subset", "one_expert"]),
                        hot_expert=rng.randrange(E), used_experts=k + 1, device=dev, backend=args.backend)

        def corrupt(i, exp, y_exp):
            """Flip one expected value (payload byte, scale byte, count, combine value, in turn); False if this
            call has nothing of that kind (no real row / no token)."""
            kind = (i // max(args.corrupt_every, 1)) % 4
            real = int(exp.counts.sum())
            if kind == 0 and real:
                row = int(torch.nonzero(_real_rows(exp)).view(-1)[-1])
                exp.x.qdata.view(torch.uint8)[row, H // 2] ^= 1
            elif kind == 1 and real:
                exp.x.scales[0, 0] ^= 1
            elif kind == 2:
                exp.counts[-1] += 1
            elif kind == 3 and y_exp.shape[0]:
                y_exp[-1, 1] += 1.0 + abs(float(y_exp[-1, 1]))
            else:
                return False
            return True

        def one_call(i, case, fails: list):
            """Dispatch + combine of ``case`` (call ``i``; the soak's calls are i >= 100), every output checked."""
            t = time.perf_counter()
            xs, idxs, ws = make_inputs(case)
            t1 = time.perf_counter()
            routes = soak_routes(cfg, idxs)
            exp = rank_dispatch_expected(cfg, xs, routes, r)
            outs = make_expert_outs(case, routes.rows)
            y_exp = rank_combine_expected(cfg, outs, routes, ws, r, quantize_rows=True)
            t2 = time.perf_counter()
            if args.corrupt_every and i >= 100 and i % args.corrupt_every == 0 and corrupt(i, exp, y_exp):
                tally["corrupted"] += 1
            n_fails = len(fails)
            d = group.steps.dispatch(xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev))
            if dev == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            check_dispatch(f"call {i} dispatch", d, exp, cfg, fails)
            tally["rows_checked"] += d.num_rows
            tally["real_rows_checked"] += int(exp.counts.sum())
            t4 = time.perf_counter()
            y = group.steps.combine(outs[r].to(dev), d.handle).cpu()
            t5 = time.perf_counter()
            exact: list = []
            check_combine(f"call {i} combine", y, y_exp, fails, exact)
            tally["combine_exact"] += sum(exact)
            tally["tokens_combined"] += y.shape[0]
            t6 = time.perf_counter()
            if args.crosscheck_every and i % args.crosscheck_every == 0:  # the reference against the oracle itself
                o_exp, o_routes = oracle_dispatch(cfg, xs, idxs)
                check_dispatch(f"call {i}: rank reference vs oracle dispatch", exp, o_exp[r], cfg, fails)
                o_y = oracle_combine(cfg, make_expert_outs(case, o_exp), o_routes, ws, quantize_rows=True)[r]
                if not torch.equal(o_y.view(torch.int16), y_exp.view(torch.int16)):
                    fails.append(f"call {i}: rank reference vs oracle combine differ")
                tally["crosschecks"] += 1
            t7 = time.perf_counter()
            for key, dt in (("inputs", t1 - t), ("reference", t2 - t1), ("dispatch", t3 - t2),
                            ("check_dispatch", t4 - t3), ("combine", t5 - t4), ("check_combine", t6 - t5),
                            ("oracle_crosscheck", t7 - t6)):
                clock[key] += dt
            if len(fails) > n_fails:
                tally["failed_calls"] += 1
                if len(tally["failed_call_ids"]) < 100:
                    tally["failed_call_ids"].append(i)
            return d

        # warm-up, checked like the soak's calls: a few random cases; before a soak also fixed token counts first
        # (the kernel specializations the soak meets are compiled outside its clock)
        warm_fails: list = []
        t_warm = time.monotonic()
        for i, T in enumerate((1, 7, 16, 33, 64, 0) if args.phase == "soak" else ()):
            case = Case(f"w{i}", tuple([T] * W), E, H, k, max_tokens=Tmax, seed=104729 + i, drop_p=0.3,
                        device=dev, backend=args.backend)
            last = one_call(-1 - i, case, warm_fails)
        for i in range(3):
            last = one_call(i, random_case(i), warm_fails)
        res["warm_failures"] = warm_fails
        res["warm_s"] = time.monotonic() - t_warm
        res["steps"].append("warm")
        save()

        if args.phase == "soak":
            for key in clock:
                clock[key] = 0.0
            tally.update(rows_checked=0, real_rows_checked=0, tokens_combined=0, combine_exact=0, crosschecks=0,
                         corrupted=0, failed_calls=0, failed_call_ids=[])
            fails: list = []
            mem, checkpoints = [], []
            t0 = time.monotonic()
            deadline = t0 + args.max_s
            done = 0

            def sample():
                if dev == "cuda":
                    torch.cuda.synchronize()
                mem.append({"calls": done, "device": torch.cuda.memory_allocated() if dev == "cuda" else 0,
                            "rss": _rss_bytes()})

            # every rank stops at the same call: every 100 calls the ranks agree (over the gloo side channel) whether
            # any of them has passed its time budget
            shapes = set()
            while done < args.iters:
                i = 100 + done
                case = random_case(i)
                shapes.add((case.tokens, case.routing, case.drop_p))
                one_call(i, case, fails)
                done += 1
                if done == min(200, args.iters // 4 or 1):
                    sample()
                if done % 1000 == 0:
                    checkpoints.append([done, round(time.monotonic() - t0, 3)])
                if done % 100 == 0:
                    stop = torch.tensor([int(time.monotonic() > deadline)])
                    dist.all_reduce(stop)
                    if int(stop):
                        break
            wall = time.monotonic() - t0
            sample()
            res.update(soak_failures=fails[:50], soak_failed=tally["failed_calls"], soak_failure_lines=len(fails),
                       soak_calls=done, soak_wall_s=round(wall, 3), calls_per_s=round(done / max(wall, 1e-9), 2),
                       checkpoints=checkpoints, memory=[mem[0], mem[-1]], distinct_shapes=len(shapes),
                       time_s={key: round(v, 3) for key, v in clock.items()},
                       **{key: v for key, v in tally.items() if key != "failed_calls"})
        else:
            xs, idxs, ws = make_inputs(base)
            x, idx, w = xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev)
            victim = r == args.victim
            if args.phase == "dispatch" and victim:
                save()
                os.kill(os.getpid(), signal.SIGKILL)
            if args.phase == "bad_ids" and victim:
                idx = idx.clone()
                idx[0, 0] = E  # out of range
            if args.phase == "sleep" and victim:
                time.sleep(args.timeout_s + 3.0)
            t0 = time.monotonic()
            try:
                if args.phase == "mismatch" and victim:  # combines the last good dispatch while the others dispatch
                    group.steps.combine(torch.zeros(last.num_rows, H, dtype=torch.bfloat16, device=dev), last.handle)
                    raise AssertionError("not reached: the peers dispatch")
                d = group.steps.dispatch(x, idx, w)
                if args.phase == "combine":
                    if victim:
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        save()
                        os.kill(os.getpid(), signal.SIGKILL)
                    t0 = time.monotonic()
                    group.steps.combine(torch.zeros(d.num_rows, H, dtype=torch.bfloat16, device=dev), d.handle)
                    group.check_errors()  # combine never syncs with the host: its timeout is raised at the next sync
                if args.phase == "sleep" and victim:  # a late rank may see its call complete: the next one raises
                    group.steps.dispatch(x, idx, w)
                res["raised"] = None
            except PeerTimeout as e:
                res.update(raised="PeerTimeout", peer=e.peer, peers=list(e.peers), message=str(e))
            except ValueError as e:
                res.update(raised="ValueError", message=str(e))
            res["elapsed_s"] = time.monotonic() - t0
        res["steps"].append("done")
        res["exit_started"] = time.time()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    save()
    return 0


def _destroy_group() -> None:
    """Destroy the process group (as the other rank workers do) rather than leave it to the interpreter's exit: left
    to it, a gloo rank once aborted at exit after its result was saved ("terminate called without an active
    exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    _destroy_group()
    sys.exit(code)
