"""One EP call under two launch settings, alternating in one process (one rank, the ``nvshmem`` backend on a GPU):
a same-process comparison of host-bound whole calls, where two separate ``mxcomm bench`` runs a minute apart can
differ by more than the change (the host's state moves between runs).

    source bench/gpu/env.sh $((1 << 30)); python3 -m mxcomm.bench.tools.launch_ab --b call_graph_tokens=0 \\
        [--a FIELD=N,...] [--op dispatch] [--tokens 128,8192] [--iters 300] [--out results.json]

The group (``max_tokens_per_rank``: the largest of ``--tokens``; the token counts are timed one after the other, results
by token count) is built with the default :class:`mxcomm.ep.LaunchConfig` with ``--a``'s fields set; before each call
its backend's launch settings are set to ``a`` or ``b`` in turn (the group's one rank: nothing else has to agree). Each
iteration times one call of each (host wall time, the device synchronised before and after, as ``mxcomm bench`` times a
call), under two conditions: ``plain``, and ``flush+sleep`` (before each call an L2 flush, as ``mxcomm bench`` makes,
and 2 ms of host sleep: a call after the host waited, where ``mxcomm bench`` spins to its start instant). The first 5
iterations are not kept. Prints and (``--out``) writes the median, p10 and p90 of each, with the machine, the versions
and the settings. Before the timing, the outputs of a third call under each setting (a replay, where the setting
captures) must be equal byte for byte.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Callable, Optional

WARMUP = 5  # iterations not kept


def alternate(calls: dict, iters: int, before: Optional[Callable[[], None]] = None,
              clock: Callable[[], float] = time.perf_counter) -> dict:
    """``calls``: name -> ``(select, call)``; each of ``iters + WARMUP`` iterations runs, for every name in order,
    ``select()``, ``before()`` (if given), then times ``call()`` (µs on ``clock``). Returns name -> the kept times."""
    times = {n: [] for n in calls}
    for it in range(iters + WARMUP):
        for name, (select, call) in calls.items():
            select()
            if before is not None:
                before()
            t0 = clock()
            call()
            if it >= WARMUP:
                times[name].append((clock() - t0) * 1e6)
    return times


def result_bytes(res) -> dict:
    """The tensors a call returned, by name, as raw bytes: a dispatch's rows (an MX payload and its scales, or bf16),
    offsets and counts; a combine's output."""
    import torch

    if isinstance(res, torch.Tensor):
        return {"y": res.contiguous().view(torch.uint8)}
    x = res.x
    rows = ({"qdata": x.qdata.contiguous().view(torch.uint8), "scales": x.scales.contiguous()}
            if hasattr(x, "qdata") else {"rows": x.contiguous().view(torch.uint8)})
    return {**rows, "offs": res.offs, "counts": res.counts}


def check_same(results: dict) -> None:
    """Raise unless every setting's results (name -> :func:`result_bytes`) are those of the first, byte for byte."""
    import torch

    (first, ref), *rest = results.items()
    for name, got in rest:
        for t, v in ref.items():
            if got[t].shape != v.shape or not torch.equal(got[t], v):
                raise AssertionError(f"setting {name}'s {t} differs from setting {first}'s: the settings do not "
                                     "compute the same call, so their times would not compare")


def summary(values: list) -> dict:
    """Median, p10 and p90 (nearest rank) of ``values`` (µs), and how many."""
    v = sorted(values)
    return dict(median_us=statistics.median(v), p10_us=v[len(v) // 10], p90_us=v[(9 * len(v)) // 10], n=len(v))


def main(argv=None) -> None:
    from ..options import _settings

    ap = argparse.ArgumentParser(prog="python -m mxcomm.bench.tools.launch_ab")
    ap.add_argument("--a", type=_settings, default={}, help="LaunchConfig fields of setting a (default: defaults)")
    ap.add_argument("--b", type=_settings, required=True, help="LaunchConfig fields of setting b")
    ap.add_argument("--op", choices=("dispatch", "combine"), default="dispatch")
    ap.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[128],
                    help="token counts, comma-separated (one group sized for the largest; each timed in turn)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from .. import env_info
    from ..timing import L2Flusher
    from ...ep import EPConfig, EPGroup
    from ...ep.nvshmem.launch_config import LaunchConfig

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    H, E, k = 7168, 256, 8
    settings = {"a": LaunchConfig(**a.a), "b": LaunchConfig(**a.b)}
    grp = EPGroup(EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=max(a.tokens), backend="nvshmem",
                           launch=settings["a"]))
    flush = L2Flusher(torch.device("cuda"))
    args = sys.argv[1:] if argv is None else list(argv)
    report = dict(command=" ".join(["python3 -m mxcomm.bench.tools.launch_ab", *args]), tool="launch_ab",
                  op=a.op, tokens=a.tokens, max_tokens_per_rank=max(a.tokens), hidden=H, experts=E, topk=k,
                  iters=a.iters, settings={n: asdict(s) for n, s in settings.items()}, machine=env_info.machine(),
                  versions=env_info.versions(), env=env_info.relevant_env(), results={})

    def chooser(name):
        def select():
            grp.backend.launch = settings[name]
            torch.cuda.synchronize()
        return select

    for T in a.tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :k].to(torch.int32)
        w = torch.rand(T, k, device="cuda", generator=g)
        res = grp.dispatch(x, idx, w)
        out = torch.randn(res.num_rows, H, device="cuda", generator=g).to(torch.bfloat16)

        def once():
            return grp.dispatch(x, idx, w) if a.op == "dispatch" else grp.combine(out, res.handle)

        def call():
            once()
            torch.cuda.synchronize()

        # before timing, both settings' outputs must be the same bytes (their third call's: at a key's third call
        # the captured graphs replay)
        outs = {}
        for n in settings:
            chooser(n)()
            for _ in range(3):
                r = once()
            outs[n] = result_bytes(r)
        check_same(outs)
        print(f"{T} tokens: outputs of a and b equal ({', '.join(outs['a'])})", flush=True)
        del outs, r
        per_t = report["results"][str(T)] = {}
        for cond, before in (("plain", None), ("flush+sleep", lambda: (flush(), time.sleep(2e-3)))):
            times = alternate({n: (chooser(n), call) for n in settings}, a.iters, before)
            per_t[cond] = {n: summary(v) for n, v in times.items()}
            for n, s in per_t[cond].items():
                fields = ", ".join(f"{f}={v}" for f, v in (a.a if n == "a" else a.b).items()) or "defaults"
                print(f"{T:6d} {cond:12s} {n} ({fields}): median {s['median_us']:7.1f} us  p10 {s['p10_us']:7.1f}  "
                      f"p90 {s['p90_us']:7.1f}  n={s['n']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    from ... import transport as tp

    tp.finalize()


if __name__ == "__main__":
    main()
