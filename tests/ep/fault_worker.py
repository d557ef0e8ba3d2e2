"""One rank of the GPU fault tests (started by test_faults_gpu.py, one process per rank, all on one GPU).

Phases (``--phase``), each after a few good dispatch + combine rounds, results in ``<outdir>/rank<r>.json``:

* ``dispatch``: rank ``--victim`` kills itself (SIGKILL) right before a dispatch; every survivor's dispatch must
  raise ``PeerTimeout`` naming it, within ``timeout_s + 1 s``;
* ``combine``: the victim dispatches, then dies before the combine; the survivors' combine must raise the same;
* ``bad_ids``: the victim passes an expert id out of range (exact-size mode): it raises ValueError at once, before
  it sends anything; the others must raise ``PeerTimeout`` naming it (they wait for its counts);
* ``soak``: ``--iters`` calls of random token counts (0..max), routings (random, a subset of experts, every token to
  one expert) and dropped slots; every dispatch row checksummed and every combine compared against the
  single-process oracle; host RSS and device memory sampled at a quarter and at the end.

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

        from ep_cases import Case, check_combine, make_expert_outs, make_inputs, row_checksums
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

        def one_call(i, check: bool, fails: list):
            case = Case(f"c{i}", tuple(rng.choice([0, 1, 7, rng.randint(0, Tmax)]) for _ in range(W)), E, H, k,
                        max_tokens=Tmax, seed=7919 * i + 3, drop_p=rng.choice([0.0, 0.3]),
                        routing=rng.choice(["random", "random", "subset", "one_expert"]),
                        hot_expert=rng.randrange(E), used_experts=k + 1, device=dev, backend=args.backend)
            xs, idxs, ws = make_inputs(case)
            d = group.steps.dispatch(xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev))
            if check:
                expected, routes = oracle_dispatch(cfg, xs, idxs)
                got = row_checksums(d.x.qdata.view(torch.uint8)).cpu()
                want = row_checksums(expected[r].x.qdata.view(torch.uint8))
                bad_rows = int((got != want).sum()) if got.shape == want.shape else max(got.numel(), want.numel())
                if bad_rows or not torch.equal(d.x.scales.cpu(), expected[r].x.scales):
                    fails.append(f"call {i}: {bad_rows} dispatch rows (or the scales) differ from the oracle")
                outs = make_expert_outs(case, expected)
                y = group.steps.combine(outs[r].to(dev), d.handle)
                check_combine(f"call {i} combine", y, oracle_combine(cfg, outs, routes, ws, quantize_rows=True)[r],
                              fails, [])
            return d, case

        warm_fails: list = []
        for i in range(3):
            last, _ = one_call(i, True, warm_fails)
        res["warm_failures"] = warm_fails
        res["steps"].append("warm")
        save()

        if args.phase == "soak":
            fails: list = []
            mem = []
            deadline = time.monotonic() + args.max_s
            done = 0

            def sample():
                if dev == "cuda":
                    torch.cuda.synchronize()
                mem.append({"device": torch.cuda.memory_allocated() if dev == "cuda" else 0, "rss": _rss_bytes()})

            # every rank stops at the same call: every 100 calls the ranks agree (over the gloo side channel) whether
            # any of them has passed its time budget
            while done < args.iters:
                one_call(100 + done, True, fails)
                done += 1
                if done == min(200, args.iters // 4 or 1):
                    sample()
                if done % 100 == 0:
                    stop = torch.tensor([int(time.monotonic() > deadline)])
                    dist.all_reduce(stop)
                    if int(stop):
                        break
            sample()
            res.update(soak_failures=fails[:50], soak_failed=len(fails), soak_calls=done, memory=mem[-2:])
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


if __name__ == "__main__":
    sys.exit(main())
