"""Turn raw phase results into the benchmark report: statistics, bandwidth in both byte conventions,
ratios to the baselines measured in the same run, a plain-text table, JSON and PNG plots.

Definitions (also written into the JSON under ``conventions`` and ``timing``):

* time statistics over iterations of the per-iteration max over ranks: median, p10, p90 (µs);
* ``bytes.dedup`` = mean over ranks of (rows a rank receives counting a token once per destination
  rank, local included) x bytes per row (DeepEP's convention);
* ``bytes.per_selection`` = mean over ranks of (token, expert) rows received x bytes per row;
* bytes per row: MXFP8 ``H + H/32``, BF16 ``2H``; combine counts the same rows (returned); the backward
  ops count the rows of the forward op moving the same way (``combine_bwd`` as dispatch,
  ``dispatch_bwd`` as combine), at their payload's bytes per row;
* ``gbps[conv][timing] = bytes[conv] / (stats_us[timing].median * 1e-6) / 1e9``;
* ``floor_us``: the traffic floor (:mod:`mxcomm.bench.floor`): the bytes any design must read and write in the
  busiest memory / the copy ceiling of the same run; ``time_over_floor[timing] = median / floor_us``;
* ``ratios["vs_<baseline>"][timing] = baseline median / this case's median`` (speed-up, > 1 = faster),
  same token count, same run, same op - except that the direction-symmetric BF16 all-to-alls (a2a,
  vdev2d) are timed for the forward ops only and a backward op is compared with their forward twin
  (``conventions["backward_baselines"]``).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
from typing import Optional

from ..ep.nvshmem.launch_config import LaunchConfig
from .floor import floor_us as _floor_us
from .floor import world_floor_bytes
from .options import BACKWARD_TWIN, FORWARD_ONLY_IMPLS, OPS
from .timing import KERNEL_DESC, START_DESC, WHOLE_CALL_DESC, summarize

SCHEMA = "mxcomm.bench/1"
BASELINES = ("reference", "a2a", "vdev2d", "mxcomm_bf16")
CONVENTIONS = {
    "dedup": "per-rank deduplicated (DeepEP): rows a rank receives, a token counted once per destination rank "
             "however many of that rank's experts it selected, local traffic included; mean over ranks",
    "per_selection": "per selection (pplx / low-latency style): one row per (token, expert) pair received; "
                     "mean over ranks",
    "bytes_per_row": {"mxfp8": "H + H/32 (E4M3 payload + E8M0 scale bytes)", "bf16": "2H"},
    "combine": "combine counts the same rows as dispatch (returned to their origins), at its payload's bytes per row",
    "backward": "combine_bwd (route-weighted output gradients, token's rank -> expert ranks) counts the rows of "
                "dispatch, dispatch_bwd (input-row gradients back to their origins, summed over k) the rows of "
                "combine, at the op's payload bytes per row (MXFP8 transport with precision mxfp8, BF16 with bf16)",
    "gbps": "1e9 bytes per second: bytes / median time",
    "traffic_floor": "design-independent bytes read + written in device memory: dispatch = each source's BF16 "
                     "token rows read once (T x 2H per rank) + every received row written once per selection in the "
                     "output dtype (MXFP8 H + H/32, BF16 2H); combine = every expert row read once per selection in "
                     "BF16 + each token's output row written once in BF16; combine_bwd like dispatch (grad_y read "
                     "once, per-selection gradient rows written in the transport dtype); dispatch_bwd like combine. "
                     "Ranks sharing one memory (one GPU, or CPU processes of one host) add up; with a memory per rank "
                     "the busiest one counts. floor_us = those bytes / the copy ceiling of the same run (device_copy "
                     "on a GPU - shared_device_copy, all the ranks on one GPU copying at once, when several share it "
                     "-, host_copy on CPU; read + write counted); time_over_floor = median / floor_us",
    "loopback_traffic": "one rank on one GPU (EP = 1) only: bytes = tokens x 2H (the BF16 token rows, read once: "
                        "dispatch's input, combine's output) + bytes.per_selection (the rows written / read per "
                        "selection), compared with the device copy ceiling of the same run (read + write bytes)",
    "loopback_touched": "one rank on one GPU, combine and dispatch backward: bytes = tokens x 2H (the BF16 output) + "
                        "selections x 2H (the BF16 expert rows the benchmark hands in, read whole whatever travels); "
                        "what the call cannot avoid moving, compared with the device copy ceiling",
    "ratios": "speed-up = baseline median time / this case's median time (same tokens and run; same op except "
              "backward_baselines); > 1 = faster",
    "backward_baselines": {
        "note": "a2a and vdev2d are direction-symmetric BF16 all-to-alls, timed for the forward ops only: a "
                "backward op is compared with the forward case moving the same rows the same way (same tokens); "
                "reference and mxcomm_bf16 are compared op for op",
        **{b: dict(BACKWARD_TWIN) for b in FORWARD_ONLY_IMPLS},
    },
}
IMPL_DESC = {
    "mxcomm": "this library: EPGroup.dispatch / combine (whole API call: routing plan, transfer, expert-major "
              "layout, MXFP8 scales in grouped-along-M layout; combine incl. weighted reduction); combine_bwd: "
              "EPGroup.steps.combine_backward with the CombineSaved of an untimed combine_for_backward (route weighting, "
              "gradient quantization, transfer to the experts, route-weight gradient); dispatch_bwd: "
              "EPGroup.steps.dispatch_backward of a BF16 gradient (partial sums per (token, rank), quantize, transfer to origins, "
              "sum of the partials)",
    "reference": "reference path: EPConfig(backend='torch', precision='mxfp8'): quantize + all_gather counts + "
                 "all_to_all_single of payload and scales + permute to expert-major (combine: route weights to the "
                 "experts, partial sums per (token, rank) there, quantize, reverse all_to_all_single, dequantize, "
                 "sum of the partials; backward ops: the same API as mxcomm)",
    "a2a": "plain BF16 all_to_all_single of the routed rows (what a plain MoE does); send buffer built outside "
           "the timed region; no permute, no reduction",
    "vdev2d": "torch NVSHMEM all_to_all_vdev_2d (dispatch) / all_to_all_vdev_2d_offset (combine), BF16, splits on "
              "device; input packed outside the timed region; no reduction",
}


def _case_key(c) -> tuple:
    return (c["impl"], c["precision"], c["op"], c["tokens"])


def _baseline(cases_by_key: dict, name: str, op: str, tokens: int) -> Optional[dict]:
    """The ok case of baseline ``name`` that ``op`` at ``tokens`` is compared with (``backward_baselines``), or None."""
    key = {"reference": ("reference", "mxfp8"), "a2a": ("a2a", "bf16"), "vdev2d": ("vdev2d", "bf16"),
           "mxcomm_bf16": ("mxcomm", "bf16")}[name]
    if key[0] in FORWARD_ONLY_IMPLS:
        op = BACKWARD_TWIN.get(op, op)
    c = cases_by_key.get((key[0], key[1], op, tokens))
    return c if c is not None and c.get("status") == "ok" else None


def finalize_cases(raw_cases: list) -> list:
    """Add ``name``, ``stats_us``, ``bytes``, ``gbps`` and ``ratios`` to each raw record (new list)."""
    cases = []
    for rc in raw_cases:
        c = dict(rc)
        c["name"] = f"{c['impl']}/{c['precision']}/{c['op']}/T{c['tokens']}"
        W = len(c["rows_dedup"])
        rows_d = sum(c["rows_dedup"]) / W
        rows_s = sum(c["rows_sel"]) / W
        c["bytes"] = dict(dedup=rows_d * c["bytes_per_row"], per_selection=rows_s * c["bytes_per_row"],
                          rows_dedup_mean=rows_d, rows_sel_mean=rows_s)
        c["stats_us"], c["gbps"] = None, None
        if c.get("status") == "ok":
            s = c["samples_us"]
            c["stats_us"] = dict(whole_call=summarize(s["whole_call"]),
                                 kernel=summarize(s["kernel"]) if s.get("kernel") else None)
            c["start_skew_us"] = summarize(s["start_skew"]) if s.get("start_skew") else None
            per_rank = s.get("per_rank") or {}
            c["rank_medians_us"] = {t: [statistics.median(r) for r in per_rank[t]] if per_rank.get(t) else None
                                    for t in ("whole_call", "kernel")}
            c["gbps"] = {conv: {t: (c["bytes"][conv] / (st["median"] * 1e-6) / 1e9 if st and st["median"] > 0 else None)
                                for t, st in c["stats_us"].items()}
                         for conv in ("dedup", "per_selection")}
        cases.append(c)
    by_key = {_case_key(c): c for c in cases}
    for c in cases:
        c["ratios"] = {}
        if c.get("status") != "ok":
            continue
        for b in BASELINES:
            base = _baseline(by_key, b, c["op"], c["tokens"])
            if base is None or base is c:
                continue
            r = {}
            for t in ("whole_call", "kernel"):
                mine, theirs = c["stats_us"].get(t), base["stats_us"].get(t)
                r[t] = theirs["median"] / mine["median"] if mine and theirs and mine["median"] > 0 else None
            c["ratios"][f"vs_{b}"] = r
    return cases


def add_floor(case: dict, *, hidden: int, memories: list, ceiling_name: str, ceiling_gbps: float) -> None:
    """``case["floor"]`` (bytes read / written in the busiest memory, how ranks share memories, the ceiling),
    ``case["floor_us"]`` and ``case["time_over_floor"]`` per timing (None where not timed); see
    :mod:`mxcomm.bench.floor`. ``memories[r]``: the memory rank ``r`` uses (equal names share one)."""
    wf = world_floor_bytes(case["op"], precision=case["precision"], hidden=hidden, tokens=case["tokens"],
                           selections=case["rows_sel"], memories=memories)
    fl = _floor_us(wf.bytes, ceiling_gbps)
    shared = max(wf.ranks_per_memory.values())
    case["floor"] = dict(bytes=wf.bytes, bytes_read=wf.bytes_read, bytes_written=wf.bytes_written,
                         ranks_per_memory=shared, memories=len(wf.per_memory), ceiling=ceiling_name,
                         ceiling_gbps=ceiling_gbps,
                         counted=(f"sum over the {shared} ranks sharing one memory" if shared > 1
                                  else "per rank (each rank has its own memory), the busiest rank"))
    case["floor_us"] = fl
    stats = case.get("stats_us") or {}
    case["time_over_floor"] = {t: (st["median"] / fl if st and fl > 0 else None) for t, st in stats.items()} or None


def add_loopback_traffic(case: dict, hidden: int, device_copy_gbps: float) -> None:
    """One rank on one GPU: ``case["loopback_traffic"]`` = the case's bytes (the BF16 token rows
    once, ``tokens * 2 * hidden``, + ``bytes.per_selection``), GB/s at the median times and the fraction of the
    device copy ceiling (``CONVENTIONS["loopback_traffic"]``). Ops towards the origins (combine, dispatch backward)
    also get ``bytes_touched``: their input rows are BF16 (the benchmark's), so the call reads ``2 * hidden`` bytes
    per selection whatever travels, + the BF16 output rows; with its GB/s and fraction
    (``CONVENTIONS["loopback_touched"]``). Cases without timings get nothing."""
    if not case.get("gbps"):
        return

    def rates(nbytes):
        gbps = {t: (nbytes / (s["median"] * 1e-6) / 1e9 if s and s["median"] > 0 else None)
                for t, s in case["stats_us"].items()}
        return gbps, {t: (v / device_copy_gbps if v else None) for t, v in gbps.items()}

    nbytes = case["tokens"] * 2 * hidden + case["bytes"]["per_selection"]
    gbps, frac = rates(nbytes)
    case["loopback_traffic"] = {"bytes": nbytes, "gbps": gbps, "fraction_of_device_copy": frac}
    if case["op"] in ("combine", "dispatch_bwd"):
        sel_rows = case["bytes"]["per_selection"] / case["bytes_per_row"]
        touched = case["tokens"] * 2 * hidden + sel_rows * 2 * hidden
        gbps, frac = rates(touched)
        case["loopback_traffic"].update(bytes_touched=touched, gbps_touched=gbps, fraction_touched_of_device_copy=frac)


def _memories(options: dict, world: dict) -> list:
    """The memory each rank uses: its device (``host:cuda:i`` / ``host:cpu``); without the list, one host memory
    for CPU runs and one GPU per rank otherwise."""
    devs = world.get("devices")
    if devs and len(devs) == options["ranks"]:
        return list(devs)
    if options["device"] != "cuda":
        return ["cpu"] * options["ranks"]
    rpg = max(1, world.get("ranks_per_gpu", 1))
    return [f"gpu{r // rpg}" for r in range(options["ranks"])]


def build_report(*, options: dict, world: dict, meta: dict, phases: list, command: list,
                 mps: Optional[dict] = None) -> dict:
    """The full JSON document of a run from its options, world description, machine/versions meta and phases
    (``mps``: the MPS state of a run with several ranks per GPU, see :func:`mxcomm.bench.launcher.check_mps`)."""
    raw_cases, checks, skipped, ceilings, merged = [], [], [], {}, []
    phase_summary = []
    for ph in phases:
        phase_summary.append({k: ph.get(k) for k in ("phase", "status", "reason", "impls", "ranks", "exit_codes")})
        raw_cases += ph.get("cases", [])
        checks += ph.get("checks", [])
        skipped += ph.get("skipped", [])
        merged += [m for m in ph.get("merged", []) if m not in merged]
        if ph.get("ceilings"):
            ceilings.update(ph["ceilings"])
    cases = finalize_cases(raw_cases)
    on_gpu = options["device"] == "cuda"
    sm_dev = None
    if meta.get("machine", {}).get("gpus"):
        sm_dev = meta["machine"]["gpus"][0]["sm_count"]
    ceiling_gbps = None
    for k in ("all_pairs_copy", "peer_copy", "device_copy", "host_copy"):  # per rank (or GPU) rates
        if ceilings.get(k):
            ceiling_gbps = ceilings[k]["gbps"]
            ceilings["reference_for_fractions"] = k
            break
    for c in cases:
        if c.get("gbps") and ceiling_gbps:
            c["fraction_of_ceiling"] = {t: (v / ceiling_gbps if v else None)
                                        for t, v in c["gbps"]["per_selection"].items()}
    if options["ranks"] == 1 and ceilings.get("device_copy"):
        for c in cases:
            add_loopback_traffic(c, options["hidden"], ceilings["device_copy"]["gbps"])
    # several ranks on one GPU: the copy rate they reach together (one rank alone under MPS has a share of the SMs)
    floor_ceiling = ("shared_device_copy" if ceilings.get("shared_device_copy") else "device_copy") if on_gpu \
        else "host_copy"
    if ceilings.get(floor_ceiling):
        mem = _memories(options, world)
        for c in cases:
            add_floor(c, hidden=options["hidden"], memories=mem, ceiling_name=floor_ceiling,
                      ceiling_gbps=ceilings[floor_ceiling]["gbps"])
    mxcomm_is_reference = any(m["impl"] == "reference" and m["into"] == "mxcomm" for m in merged)
    if mxcomm_is_reference:
        for c in cases:
            if c["impl"] == "mxcomm" and c["precision"] == "mxfp8":
                c["is_reference"] = True
                c["notes"] = list(c.get("notes") or []) + [merged[0]["reason"]]
    rpg = world.get("ranks_per_gpu", 1)
    return {
        "schema": SCHEMA,
        "label": options["label"],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": meta.get("machine"),
        "versions": meta.get("versions"),
        "env": meta.get("env"),
        "config": options,
        "ep_size": options["ranks"],
        "ranks_per_gpu": rpg,
        "world": world,
        "measures_nvlink": bool(on_gpu and options["ranks"] > 1 and rpg == 1),
        "world_note": _world_note(options, rpg),
        "sm_count": {"device": sm_dev, "mxcomm_num_sms": options.get("num_sms") or sm_dev,
                     "baselines": "library defaults (NCCL / torch choose their own SM count)"},
        # the nvshmem kernels' launch settings (None: the reference backend launches none)
        "launch": (dataclasses.asdict(LaunchConfig(**(options.get("launch") or {})))
                   if options.get("backend") == "nvshmem" else None),
        "precisions": options["precisions"],
        "byte_conventions": ["dedup", "per_selection"],
        "conventions": CONVENTIONS,
        "impls": {k: v for k, v in IMPL_DESC.items() if k in options["impls"]},
        "timing": {
            "whole_call": WHOLE_CALL_DESC,
            "kernel": KERNEL_DESC if on_gpu else None,
            "start": START_DESC,
            "start_skew": ("per case: start_skew_us, the spread of the ranks' start instants (latest minus earliest "
                           "t0) per iteration, all ranks on one host; the mode used (config.start: the one asked "
                           "for) and the iterations some rank reached late under start.late_iterations"),
            "whole_call_measured": True,
            "kernel_measured": on_gpu,
            "kernel_is_pure_kernel_sum": False,
            "iters": options["iters"], "warmup": options["warmup"],
            "statistics": "median, p10, p90 over iterations of the per-iteration max over ranks",
            "l2_flushed_before_each_iteration": on_gpu,
        },
        "ceilings": ceilings,
        "floor_ceiling": floor_ceiling if ceilings.get(floor_ceiling) else None,
        "mps": mps,
        "merged": merged,
        "mxcomm_is_reference": mxcomm_is_reference,
        "checks": checks,
        "checks_note": ("one untimed dispatch + combine of mxcomm compared with the reference backend per token count "
                        "and precision (not done with --backend torch: the same code)"),
        "skipped": skipped,
        "phases": phase_summary,
        "cases": cases,
    }


def _world_note(options: dict, rpg: int) -> str:
    if options["device"] != "cuda":
        return (f"CPU run: {options['ranks']} processes over gloo; checks the harness and the reference path, "
                "measures no GPU")
    if rpg > 1:
        return f"{rpg} ranks share each GPU: this run checks the multi-rank protocol and measures no NVLink bandwidth"
    if options["ranks"] == 1:
        return "one rank: loopback through the GPU's own memory, no NVLink"
    return "one rank per GPU"


# ------------------------------------------------------------------------------------------- table ----

def _f(v, nd=1) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if 0 < abs(v) < 1:
        return f"{v:.3g}"
    return f"{v:.{nd}f}"


RATIO_COLUMNS = (("reference", "x ref"), ("a2a", "x a2a"), ("vdev2d", "x vdev2d"), ("mxcomm_bf16", "x bf16"))


def _impl_label(c: dict) -> str:
    return "mxcomm=ref" if c.get("is_reference") else c["impl"]


def format_table(report: dict) -> str:
    """Plain-text aligned table of every case, then notes, skipped baselines, ceilings and checks.

    Ratio columns without a value in any row are left out (e.g. ``x vdev2d`` on CPU)."""
    kernel = report["timing"]["kernel_measured"]
    order = {op: i for i, op in enumerate(OPS)}
    impl_order = {"mxcomm": 0, "reference": 1, "a2a": 2, "vdev2d": 3}
    prec_order = {"mxfp8": 0, "bf16": 1}
    cases = sorted(report["cases"], key=lambda c: (order[c["op"]], c["tokens"], impl_order.get(c["impl"], 9),
                                                   prec_order.get(c["precision"], 9)))
    ok = [c for c in cases if c.get("status") == "ok"]
    ratio_cols = [(b, h) for b, h in RATIO_COLUMNS
                  if any((c["ratios"].get(f"vs_{b}") or {}).get("whole_call") for c in ok)]
    has_floor = any(c.get("time_over_floor") for c in ok)
    hdr = ["op", "impl", "prec", "tokens", "B/row", "whole us", "p10-p90"]
    if kernel:
        hdr += ["kernel us"]
    hdr += ["GB/s dedup", "GB/s sel"]
    if kernel:
        hdr += ["kern GB/s dedup"]
    if has_floor:
        hdr += ["floor us", "x floor"]
    hdr += [h for _, h in ratio_cols]
    rows = []
    for c in cases:
        row = [c["op"], _impl_label(c), c["precision"], str(c["tokens"]), str(c["bytes_per_row"])]
        if c.get("status") != "ok":
            msg = f"{c['status']}: {(c.get('reason') or '').splitlines()[0][:80]}"
            rows.append(row + [msg])
            continue
        w = c["stats_us"]["whole_call"]
        row += [_f(w["median"]), f"{_f(w['p10'])}-{_f(w['p90'])}"]
        if kernel:
            row += [_f(c["stats_us"]["kernel"]["median"]) if c["stats_us"]["kernel"] else "-"]
        row += [_f(c["gbps"]["dedup"]["whole_call"], 2), _f(c["gbps"]["per_selection"]["whole_call"], 2)]
        if kernel:
            row += [_f(c["gbps"]["dedup"]["kernel"], 2)]
        if has_floor:
            tof = c.get("time_over_floor") or {}
            row += [_f(c.get("floor_us"), 2), _f(tof.get("whole_call"), 1)]
        for b, _ in ratio_cols:
            r = c["ratios"].get(f"vs_{b}")
            row.append(_f(r["whole_call"], 2) if r and r.get("whole_call") else "-")
        rows.append(row)
    n_key = 5  # op, impl, prec, tokens, B/row: present in every row; a failed case has a message after them
    widths = [max([len(h)] + [len(r[i]) for r in rows if len(r) == len(hdr) or i < n_key])
              for i, h in enumerate(hdr)]

    def line(r):
        cells = [v.rjust(widths[i]) if i >= 3 else v.ljust(widths[i]) for i, v in enumerate(r[:n_key])]
        if len(r) == len(hdr):
            cells += [v.rjust(widths[i]) for i, v in enumerate(r) if i >= n_key]
        else:
            cells += r[n_key:]
        return "  ".join(cells).rstrip()

    cfg = report["config"]
    head = (f"mxcomm bench [{report['label']}]  EP={report['ep_size']} ranks_per_gpu={report['ranks_per_gpu']}  "
            f"hidden={cfg['hidden']} topk={cfg['topk']} experts={cfg['experts']}  backend={cfg['backend']}  "
            f"side channel={report['world'].get('side_channel')}  iters={cfg['iters']}")
    gpus = (report.get("machine") or {}).get("gpu_names") or ["cpu"]
    notes = ["times: median over iterations of the slowest rank (us), whole Python call"
             + ("; kernel = CUDA events" if kernel else "") + "; GB/s at the median whole-call time"]
    if has_floor:
        ce = report.get("floor_ceiling")
        notes.append(f"x floor = time / floor us; floor = bytes that must be read + written in memory "
                     f"({_floor_counting(report)}) / {ce} (1.0 = at the floor)")
    if ratio_cols:
        notes.append("x <baseline> = baseline time / this time (> 1 = faster)")
    if report.get("mxcomm_is_reference"):
        where = "on CPU" if cfg["device"] != "cuda" else "with --backend torch"
        notes.append(f"{where} the library runs the reference backend: one row (mxcomm=ref), no 'reference' row, "
                     "no x ref, no output check")
    if report.get("mps"):
        notes.append(f"MPS: {report['mps'].get('state')}")
    if cfg.get("cuda_graph"):
        notes.append("mxcomm rows: CUDA graph replays of each call (no-host-sync mode); baselines eager")
    if any(c["op"] in BACKWARD_TWIN for c in report["cases"]) and any(b in ("a2a", "vdev2d") for b, _ in ratio_cols):
        twins = ", ".join(f"{op} vs {fwd}" for op, fwd in BACKWARD_TWIN.items())
        notes.append(f"backward ops: x a2a / x vdev2d compare with the forward op moving the same rows ({twins})")
    out = [head, f"device: {', '.join(gpus)}; {report['world_note']}", *notes, "",
           line(hdr), line(["-" * w for w in widths])]
    prev = None
    for r in rows:
        if prev is not None and (r[0], r[3]) != prev:
            out.append("")
        prev = (r[0], r[3])
        out.append(line(r))
    if report["skipped"]:
        out.append("")
        for s in report["skipped"]:
            out.append(f"skipped {s['impl']}: {s['reason']}")
    ce = report.get("ceilings") or {}
    for k in ("device_copy", "shared_device_copy", "peer_copy", "all_pairs_copy", "host_copy"):
        if ce.get(k):
            out.append(f"ceiling {k}: {_f(ce[k]['gbps'], 1)} GB/s ({ce[k]['convention']})")
    for chk in report.get("checks", []):
        if chk.get("status") == "ok":
            out.append(f"check vs reference ({chk['precision']}, T={chk['tokens']}): dispatch equal="
                       f"{chk['dispatch_equal_all_ranks']}, combine max |diff|={chk['combine_max_abs_diff']}")
        else:
            out.append(f"check vs reference ({chk.get('precision')}, T={chk.get('tokens')}): {chk.get('status')} "
                       f"{chk.get('reason') or ''}")
    return "\n".join(out) + "\n"


def _floor_counting(report: dict) -> str:
    fl = next((c["floor"] for c in report["cases"] if c.get("floor")), None)
    if fl is None:
        return ""
    if fl["ranks_per_memory"] > 1:
        return f"sum over the {fl['ranks_per_memory']} ranks sharing one memory"
    return "per rank, each with its own memory"


def file_stem(report: dict) -> str:
    return f"ep_bench_{report['label']}"


def write_outputs(report: dict, out_dir: str, *, plot: bool = True) -> dict:
    """Write ``<stem>.json``, ``<stem>.txt`` and (if ``plot`` and matplotlib imports) PNGs; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, file_stem(report))
    paths = {"json": stem + ".json", "table": stem + ".txt", "plots": []}
    if plot:
        from .plots import make_plots

        pngs, msg = make_plots(report, stem)
        paths["plots"] = pngs
        if msg:
            report.setdefault("plot_messages", []).append(msg)
    report["files"] = {k: ([os.path.basename(p) for p in v] if isinstance(v, list) else os.path.basename(v))
                       for k, v in paths.items()}
    with open(paths["table"], "w") as f:
        f.write(format_table(report))
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    return paths


__all__ = ["finalize_cases", "build_report", "format_table", "write_outputs", "file_stem", "add_floor",
           "add_loopback_traffic", "SCHEMA", "BASELINES"]
