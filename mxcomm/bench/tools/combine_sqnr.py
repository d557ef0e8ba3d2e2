"""SQNR of the combine output against float64: the transport rounding per selection vs per (token, rank).

    python -m mxcomm.bench.tools.combine_sqnr [--out FILE] [--tokens 256] [--seeds 3] [--hidden 7168 2048]
                                              [--worlds 1 2 4 8] [--experts 256] [--topk 8] [--scale-mode rceil]

CPU, one process, no communication: for each world size ``W`` the experts are spread over ``W`` ranks (expert ``e``
on rank ``e // (E / W)``) and the tool computes what each math gives for ``T`` tokens of one origin rank (every
origin rank sees the same statistics). Inputs, fresh per seed:

* routing, two kinds: a softmax router (softmax over standard normal logits ``[T, E]``, top-k, the k weights
  renormalised to sum 1), and uniform random weights ``U(0, 1)`` on ``k`` distinct random experts;
* expert output rows, one per selection: bf16 of ``randn(H) * 2**u``, ``u ~ U(-2, 2)`` per row;
* for the dispatch backward (every weight 1, the experts of the uniform routing): gradient rows drawn the same way.

Per case the SQNR ``10 log10(sum ref^2 / sum (y - ref)^2)`` over all tokens and seeds, ``ref`` the float64
``sum_j w[t, j] * out[t, j]`` (``w`` the fp32 weights), for

* ``before``: the per-selection math: ``y = bf16(sum_j w[t, j] * Tq(out[t, j]))``, each row rounded by the transport
  on its own, the sum in fp32 with ``j`` ascending (independent of ``W``);
* ``after``: the per-(token, rank) math of :mod:`mxcomm.ep.reference.backward`: the fp32 partial of each (token,
  rank), rounded once (``Tq``), the partials summed in fp32 in order of first appearance, bf16 result;

with ``Tq`` the MXFP8 row-wise round trip (the scale mode given, decoded saturated at the BF16 range) or BF16 (BF16
transport of a bf16 row is exact, so "before" BF16 only has the final bf16 rounding). ``delta_db = after - before``.
The JSON holds the command, versions, the machine, the configuration, every case (with per-seed values) and the worst
delta; a table goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ...ep.reference.backward import sum_to_bf16, transport_round
from ..env_info import versions

SCHEMA = "mxcomm.bench.combine_sqnr/1"
REQUIRED_DB = -0.5  # the per-(token, rank) math may lose at most 0.5 dB against the per-selection math


def per_selection(out: torch.Tensor, w: torch.Tensor, mx: bool, mode: str) -> torch.Tensor:
    """``bf16(sum_j w[t, j] * Tq(out[t, j]))``, fp32, ``j`` ascending. ``out`` bf16 ``[T, k, H]``, ``w`` ``[T, k]``."""
    T, k, H = out.shape
    v = transport_round(out.reshape(T * k, H), mx, mode).view(T, k, H)
    w = w.to(torch.float32)
    acc = torch.zeros(T, H, dtype=torch.float32)
    for j in range(k):
        acc = acc + w[:, j:j + 1] * v[:, j]
    return acc.to(torch.bfloat16)


def per_rank(out: torch.Tensor, w: torch.Tensor, dest: torch.Tensor, mx: bool, mode: str) -> torch.Tensor:
    """The per-(token, rank) math: ``P_d[t] = sum_j w[t, j] * out[t, j]`` over the slots of ``t`` on rank ``d`` (fp32,
    ``j`` ascending, product then add), ``y[t] = bf16(sum_i Tq(P_{d_i}[t]))`` over the ranks in order of first
    appearance over ``j``. ``dest`` int ``[T, k]``: the rank of each slot (all valid).

    Vectorised in ``k`` steps whatever the world size: each token's slots sorted by (rank, j) form one run per rank;
    the partial is accumulated along the run, rounded at its end, and the rounded partials are summed at the first
    slot of each rank, ``j`` ascending."""
    T, k, H = out.shape
    tok = torch.arange(T)
    prod = w.to(torch.float32).unsqueeze(-1) * out.to(torch.float32)       # [T, k, H], each product rounded to fp32
    order = torch.argsort(dest.to(torch.int64) * k + torch.arange(k), dim=1)  # slots by (rank, j)
    ds = torch.gather(dest, 1, order)
    cut = ds[:, 1:] != ds[:, :-1]
    start = torch.cat([torch.ones(T, 1, dtype=torch.bool), cut], 1)         # a run (one rank) starts here
    end = torch.cat([cut, torch.ones(T, 1, dtype=torch.bool)], 1)           # ... ends here
    zero = torch.zeros((), dtype=torch.float32)
    part = torch.empty(T, k, H, dtype=torch.float32)
    acc = torch.zeros(T, H, dtype=torch.float32)
    for p in range(k):
        acc = torch.where(start[:, p:p + 1], zero, acc) + prod[tok, order[:, p]]
        part[:, p] = acc
    sent = torch.zeros(T, k, H, dtype=torch.float32)
    sent[end] = transport_round(part[end], mx, mode)                               # one rounding per (token, rank)
    run_end = torch.empty(T, k, dtype=torch.int64)                           # position of the end of p's run
    run_end[:, k - 1] = k - 1
    for p in range(k - 2, -1, -1):
        run_end[:, p] = torch.where(end[:, p], torch.full((T,), p), run_end[:, p + 1])
    at = torch.empty_like(order)
    at.scatter_(1, order, torch.arange(k).expand(T, k).contiguous())        # sorted position of slot j
    first = start.gather(1, at)                                              # slot j is its rank's first
    y = torch.zeros(T, H, dtype=torch.float32)
    fin = torch.ones(T, H, dtype=torch.bool)
    for j in range(k):
        v = sent[tok, run_end[tok, at[:, j]]]
        y = y + torch.where(first[:, j:j + 1], v, zero)
        fin &= ~first[:, j:j + 1] | torch.isfinite(v)
    return sum_to_bf16(y, fin)


def exact(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 ``sum_j w[t, j] * out[t, j]``."""
    return (w.to(torch.float32).to(torch.float64).unsqueeze(-1) * out.to(torch.float64)).sum(1)


def inputs(seed: int, tokens: int, experts: int, topk: int, hidden: int) -> dict:
    """One seed's routings (softmax router, uniform) and expert output / gradient rows, CPU."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1)
    sw, sidx = torch.topk(probs, topk, dim=-1)
    sw = sw / sw.sum(-1, keepdim=True)
    uidx = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :topk]
    uw = torch.rand(tokens, topk, generator=g)

    def rows():
        mag = torch.exp2(torch.rand(tokens, topk, 1, generator=g) * 4 - 2)
        return (torch.randn(tokens, topk, hidden, generator=g) * mag).to(torch.bfloat16)

    return {"softmax": (sidx, sw.to(torch.float32)), "uniform": (uidx, uw), "out": rows(), "grad": rows()}


def sqnr_db(sig: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / noise)


def energies(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return float((ref ** 2).sum()), float(((y.to(torch.float64) - ref) ** 2).sum())


def run(tokens: int = 256, seeds: int = 3, hiddens=(7168, 2048), worlds=(1, 2, 4, 8), experts: int = 256,
        topk: int = 8, scale_mode: str = "rceil", log=print) -> list[dict]:
    """Every case (see the module doc): a list of dicts with op, weights, transport, hidden, world, before_db,
    after_db, delta_db, pairs_per_token and per_seed."""
    for W in worlds:
        if experts % W:
            raise ValueError(f"experts {experts} is not a multiple of world size {W}")
    acc: dict = {}
    pairs: dict = {}
    for H in hiddens:
        for s in range(seeds):
            seed = 1000 * H + s
            t0 = time.monotonic()
            inp = inputs(seed, tokens, experts, topk, H)
            kinds = [("combine", "softmax", inp["softmax"], inp["out"]),
                     ("combine", "uniform", inp["uniform"], inp["out"]),
                     ("dispatch_backward", "ones", (inp["uniform"][0], torch.ones(tokens, topk)), inp["grad"])]
            for op, wname, (idx, w), rows in kinds:
                ref = exact(rows, w)
                for tname, mx in (("mxfp8", True), ("bf16", False)):
                    before = energies(per_selection(rows, w, mx, scale_mode), ref)
                    for W in worlds:
                        dest = idx // (experts // W)
                        after = energies(per_rank(rows, w, dest, mx, scale_mode), ref)
                        key = (op, wname, tname, H, W)
                        acc.setdefault(key, []).append((seed, before, after))
                        n_pairs = sum(int((dest == d).any(1).sum()) for d in range(W))
                        pairs.setdefault(key, []).append(n_pairs / max(tokens, 1))
            log(f"  hidden {H} seed {s}: {time.monotonic() - t0:.1f} s")
    cases = []
    for key, runs in acc.items():
        op, wname, tname, H, W = key
        b = sqnr_db(sum(r[1][0] for r in runs), sum(r[1][1] for r in runs))
        a = sqnr_db(sum(r[2][0] for r in runs), sum(r[2][1] for r in runs))
        cases.append({
            "op": op, "weights": wname, "transport": tname, "hidden": H, "world": W,
            "before_db": round(b, 3), "after_db": round(a, 3), "delta_db": round(a - b, 3),
            "pairs_per_token": round(sum(pairs[key]) / len(pairs[key]), 3),
            "per_seed": [{"seed": seed, "before_db": round(sqnr_db(*bf), 3), "after_db": round(sqnr_db(*af), 3)}
                         for seed, bf, af in runs],
        })
    return cases


def table(cases: list[dict]) -> str:
    head = f"{'op':<18}{'weights':<9}{'transport':<10}{'hidden':>7}{'world':>6}{'pairs/t':>8}" \
           f"{'before dB':>11}{'after dB':>10}{'delta dB':>10}"
    lines = [head, "-" * len(head)]
    for c in cases:
        lines.append(f"{c['op']:<18}{c['weights']:<9}{c['transport']:<10}{c['hidden']:>7}{c['world']:>6}"
                     f"{c['pairs_per_token']:>8.2f}{c['before_db']:>11.2f}{c['after_db']:>10.2f}"
                     f"{c['delta_db']:>+10.2f}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m mxcomm.bench.tools.combine_sqnr", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the origin rank per seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 2048])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--scale-mode", default="rceil", choices=["rceil", "floor"])
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    with torch.no_grad():  # (not a global switch: callers in the same process keep their grad mode)
        cases = run(args.tokens, args.seeds, tuple(args.hidden), tuple(args.worlds), args.experts, args.topk,
                    args.scale_mode, log=lambda m: print(m, file=sys.stderr))
    worst = min(cases, key=lambda c: c["delta_db"])
    result = {
        "schema": SCHEMA,
        "command": "python -m mxcomm.bench.tools.combine_sqnr " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": versions(),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "config": {
            "tokens": args.tokens, "seeds": args.seeds, "hidden": args.hidden, "worlds": args.worlds,
            "experts": args.experts, "topk": args.topk, "scale_mode": args.scale_mode,
            "routing": {"softmax": "softmax over N(0, 1) logits [T, E], top-k, renormalised to sum 1",
                        "uniform": "k distinct uniformly random experts, weights U(0, 1)",
                        "ones": "the uniform routing's experts, every weight 1 (dispatch backward)"},
            "rows": "bf16(randn(H) * 2**u), u ~ U(-2, 2) per row, one row per selection",
            "reference": "float64 sum_j w[t, j] * out[t, j]",
            "before": "bf16(sum_j w * Tq(out_j)): each row rounded on its own, fp32 sum, j ascending",
            "after": "bf16(sum over ranks in order of first appearance of Tq(fp32 partial of the token's slots on "
                     "that rank))",
            "required_delta_db": REQUIRED_DB,
        },
        "cases": cases,
        "worst_delta_db": worst["delta_db"],
        "worst_case": {k: worst[k] for k in ("op", "weights", "transport", "hidden", "world")},
        "meets_requirement": bool(worst["delta_db"] >= REQUIRED_DB),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(table(cases))
    print(f"worst delta {worst['delta_db']:+.2f} dB ({result['worst_case']}); required >= {REQUIRED_DB} dB: "
          f"{'met' if result['meets_requirement'] else 'NOT met'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
