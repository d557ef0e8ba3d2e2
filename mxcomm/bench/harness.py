"""One phase of a benchmark run inside a joined world: build the groups, sweep the token counts, time
every case, return raw records (every rank returns the same dict).

Phases: ``main`` (this library, the reference path, the plain all-to-all) and ``symm`` (torch's NVSHMEM
``all_to_all_vdev_2d``), kept in separate processes because torch symmetric memory and nvshmem4py
are not known to coexist in one process. A raw record (see :func:`run_phase`) holds per-iteration
samples; :mod:`mxcomm.bench.report` turns them into statistics, bandwidths and ratios.
"""
from __future__ import annotations

import sys
import traceback
from typing import Optional

import torch

from . import symm
from .cases import (CaseCall, a2a_combine_case, a2a_dispatch_case, check_against_reference, ep_combine_bwd_case,
                    ep_combine_case, ep_dispatch_bwd_case, ep_dispatch_case)
from .ceiling import measure_ceilings
from .options import OPS, BenchOptions, ops_for
from .routing import bytes_per_row, exchange_routing, make_inputs
from .timing import L2Flusher, measure

MERGED_REASON = ("--backend torch: the library runs the reference backend itself, so its mxfp8 cases are the "
                 "reference measurement; timed once, reported once (as mxcomm), no output check")


def reference_is_mxcomm(opts: BenchOptions, impls) -> bool:
    """With ``--backend torch`` (the CPU default) the mxcomm mxfp8 cases and the reference cases are one
    measurement: the reference impl is then not run separately."""
    return opts.backend == "torch" and "mxcomm" in impls and "reference" in impls and "mxfp8" in opts.precisions


# EPGroup cases taking a seed (random expert rows / gradients); dispatch takes none.
_EP_SEEDED_CASES = {"combine": ep_combine_case, "combine_bwd": ep_combine_bwd_case,
                    "dispatch_bwd": ep_dispatch_bwd_case}


def steps_for(opts: BenchOptions, impls) -> list[tuple]:
    """``(tokens, impl, payload precision, op)`` in run order (ops per impl: :func:`mxcomm.bench.options.ops_for`)."""
    out = []
    for T in opts.tokens:
        for impl in ("mxcomm", "reference", "a2a", "vdev2d"):
            if impl not in impls:
                continue
            precs = opts.precisions if impl == "mxcomm" else (["mxfp8"] if impl == "reference" else ["bf16"])
            for p in precs:
                for op in ops_for(opts, impl):
                    out.append((T, impl, p, op))
    return out


class _Progress:
    """tqdm on rank 0 when installed (else one line per case); silent on other ranks."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar, self.enabled, self.n, self.total = None, enabled, 0, total
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)
            except ImportError:
                pass

    def step(self, text: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.n}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _build_groups(opts: BenchOptions, impls, world) -> tuple[dict, dict]:
    """EP groups of the run: ``({"mxcomm": {prec: EPGroup}, "reference": {prec: EPGroup}}, failures)``.

    ``failures`` maps ``(impl, precision)`` to the reason its group could not be built (agreed by all ranks); its
    cases are then reported failed and the other impls still run.
    """
    from ..ep import EPGroup

    groups: dict = {"mxcomm": {}, "reference": {}}
    failures: dict = {}
    need_ref = set()
    if "reference" in impls:
        need_ref.add("mxfp8")
    if opts.check and opts.backend != "torch" and "mxcomm" in impls:
        need_ref.update(opts.precisions)
    todo = [("mxcomm", p, opts.backend) for p in opts.precisions if "mxcomm" in impls]
    todo += [("reference", p, "torch") for p in sorted(need_ref)]
    for impl, p, backend in todo:
        err = None
        try:
            groups[impl][p] = EPGroup(opts.ep_config(p, backend=backend))
        except Exception as e:  # noqa: BLE001 - reported; the other impls still run
            err = f"EPGroup(backend={backend!r}, precision={p!r}) failed: {type(e).__name__}: {e}"
        errs = [e for e in world.all_gather_object(err) if e]
        if errs:
            failures[(impl, p)] = errs[0]
            groups[impl].pop(p, None)  # identical on every rank, even if the error was on some ranks only
            if world.rank == 0:
                print(f"mxcomm bench: {errs[0]}", file=sys.stderr, flush=True)
    return groups, failures


def run_phase(opts: BenchOptions, world, impls, *, phase: str = "main") -> dict:
    """Run the cases of ``impls`` (subset of mxcomm/reference/a2a/vdev2d) for every token count (collective).

    Returns ``{"phase", "cases": [raw record...], "checks": [...], "ceilings": {...}, "skipped": [...],
    "merged": [...]}`` (``merged``: impls not run because another impl's cases are the same measurement, see
    :func:`reference_is_mxcomm`).
    A raw record: impl, op (one of :data:`OPS`), precision (payload), tokens, status
    (``ok``/``failed``/``skipped``), reason, transport, notes, bytes_per_row, rows_dedup / rows_sel (per
    destination rank), samples_us (``whole_call`` and ``kernel`` per-iteration lists, max over ranks).
    A failing case (an exception on any rank, e.g. a backend's NotImplementedError for a backward op) is
    recorded ``failed`` with the reason; later token counts of that impl, precision and op are ``skipped``.
    """
    impls = [i for i in impls]
    result = {"phase": phase, "cases": [], "checks": [], "skipped": [], "ceilings": {}, "merged": []}
    if reference_is_mxcomm(opts, impls):
        impls.remove("reference")
        result["merged"].append(dict(impl="reference", precision="mxfp8", into="mxcomm", reason=MERGED_REASON))
    steps = steps_for(opts, impls)
    if phase == "main":
        result["ceilings"] = measure_ceilings(world)
    groups, failures = (_build_groups(opts, impls, world) if phase == "main"
                        else ({"mxcomm": {}, "reference": {}}, {}))
    bufs = None
    if "vdev2d" in impls:
        err = None
        try:
            bufs = symm.allocate(world, max_tokens=opts.max_tokens, topk=opts.topk, hidden=opts.hidden,
                                 experts=opts.experts, align=opts.align)
        except Exception as e:  # noqa: BLE001 - the baseline is skipped with the reason, the run goes on
            err = f"{type(e).__name__}: {e}"
        errs = [e for e in world.all_gather_object(err) if e]
        if errs:
            impls = [i for i in impls if i != "vdev2d"]
            steps = steps_for(opts, impls)
            bufs = None
            result["skipped"].append(dict(impl="vdev2d", reason=f"torch symmetric memory setup failed: {errs[0]}"))
    flush = L2Flusher(world.device) if opts.l2_flush else None
    result["l2_flush_bytes"] = flush.buf.numel() if flush is not None and flush.active else 0
    prog = _Progress(len(steps), opts.progress and world.rank == 0, f"mxcomm bench [{phase}]")
    broken: dict = {}  # (impl, precision, op) -> first failure; that op's later cases are skipped
    try:
        for T in opts.tokens:
            inputs = make_inputs(seed=opts.seed, rank=world.rank, tokens=T, hidden=opts.hidden, topk=opts.topk,
                                 experts=opts.experts, device=world.device)
            routing = exchange_routing(world, inputs, experts=opts.experts, align=opts.align)
            if bufs is not None:
                symm.prepare(bufs, inputs, routing)
            if phase == "main" and opts.check and opts.backend != "torch":
                for p, g in groups["mxcomm"].items():
                    if p not in groups["reference"]:
                        continue
                    result["checks"].append(_check(world, g, groups["reference"].get(p), inputs, opts, T))
            for (t, impl, prec, op) in [s for s in steps if s[0] == T]:
                rec = dict(impl=impl, op=op, precision=prec, tokens=T, status="ok", reason=None,
                           bytes_per_row=bytes_per_row(prec, opts.hidden),
                           rows_dedup=routing.traffic.rows_dedup, rows_sel=routing.traffic.rows_sel,
                           backend=opts.backend if impl == "mxcomm" else ("torch" if impl == "reference" else None))
                if (impl, prec) in failures:
                    rec.update(status="failed", reason=failures[(impl, prec)])
                elif (impl, prec, op) in broken:
                    rec.update(status="skipped",
                               reason=f"an earlier {impl} {prec} {op} case failed: {broken[(impl, prec, op)]}")
                else:
                    _run_case(rec, world, opts, groups, inputs, routing, bufs, flush)
                    if rec["status"] == "failed":
                        broken[(impl, prec, op)] = rec["reason"].splitlines()[0] if rec["reason"] else "failed"
                result["cases"].append(rec)
                prog.step(f"{impl} {prec} {op} T={T}")
            del inputs, routing
            if world.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        prog.close()
    return result


def _make_call(rec, world, opts, groups, inputs, routing, bufs) -> CaseCall:
    impl, op, p = rec["impl"], rec["op"], rec["precision"]
    if impl in ("mxcomm", "reference"):
        g = groups[impl][p]
        if op == "dispatch":
            return ep_dispatch_case(g, inputs, world)
        return _EP_SEEDED_CASES[op](g, inputs, world, seed=opts.seed)
    if impl == "a2a":
        return (a2a_dispatch_case(inputs, routing, world) if op == "dispatch"
                else a2a_combine_case(inputs, routing, world, seed=opts.seed))
    if impl == "vdev2d":
        return (symm.dispatch_case(bufs, routing, align=opts.align) if op == "dispatch"
                else symm.combine_case(bufs, routing, seed=opts.seed, rank=world.rank))
    raise ValueError(f"unknown impl {impl!r}")


def capture_graph(fn, world):
    """Capture the collective call ``fn`` into a CUDA graph (2 eager warm-up calls on a side stream
    first, every rank in step) and return its ``replay``."""
    dev = world.device
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    world.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(dev)
    world.barrier()
    return graph.replay


def _run_case(rec, world, opts, groups, inputs, routing, bufs, flush) -> None:
    """Prepare and time one case; on an exception on any rank every rank marks it failed (collective)."""
    err: Optional[str] = None
    samples = None
    try:
        call = _make_call(rec, world, opts, groups, inputs, routing, bufs)
        rec["transport"] = call.transport
        rec["notes"] = list(call.notes)
        fn = call.fn
        graphed = opts.cuda_graph and rec["impl"] == "mxcomm"
        if graphed:
            fn = capture_graph(call.fn, world)
            rec["notes"].append("timed as CUDA graph replays (captured once after 2 eager warm-up calls)")
        samples = measure(fn, world=world, iters=opts.iters, warmup=opts.warmup, flush=flush, start=opts.start)
        if graphed:
            groups[rec["impl"]][rec["precision"]].check_errors()  # replays check nothing themselves
        rec["cuda_graph"] = graphed
    except Exception as e:  # noqa: BLE001 - recorded; the run goes on with other cases
        err = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    errs = world.all_gather_object(err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        rec["status"] = "failed"
        rec["reason"] = "; ".join(f"rank {r}: {e.splitlines()[0]}" for r, e in bad)
        rec["traceback"] = bad[0][1]
        if world.rank == 0:
            print(f"mxcomm bench: {rec['impl']} {rec['precision']} {rec['op']} T={rec['tokens']} failed: "
                  f"{rec['reason']}", file=sys.stderr, flush=True)
    else:
        rec["samples_us"] = dict(whole_call=samples.whole_call, kernel=samples.kernel, start_skew=samples.start_skew,
                                 per_rank=samples.per_rank)
        rec["start"] = dict(mode=samples.start, late_iterations=samples.late)


def _check(world, group, ref, inputs, opts, T) -> dict:
    rec = dict(tokens=T, precision=group.config.precision, backend=group.config.backend)
    if ref is None:
        rec["status"] = "skipped"
        return rec
    err = None
    try:
        rec.update(check_against_reference(group, ref, inputs, seed=opts.seed, rank=world.rank))
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    everyone = world.all_gather_object((err, rec.get("dispatch_equal"), rec.get("combine_max_abs_diff")))
    errs = [e for e, _, _ in everyone if e]
    if errs:
        return dict(tokens=T, precision=group.config.precision, status="failed", reason=errs[0])
    diffs = [d for _, _, d in everyone if d is not None]
    out = dict(tokens=T, precision=group.config.precision, backend=group.config.backend, status="ok",
               dispatch_equal_all_ranks=all(eq for _, eq, _ in everyone),
               combine_max_abs_diff=max(diffs) if diffs else None)
    if world.rank == 0 and not out["dispatch_equal_all_ranks"]:
        print(f"mxcomm bench: WARNING: {group.config.backend} dispatch output differs from the reference "
              f"({group.config.precision}, T={T})", file=sys.stderr, flush=True)
    return out


__all__ = ["run_phase", "steps_for", "reference_is_mxcomm", "OPS"]
