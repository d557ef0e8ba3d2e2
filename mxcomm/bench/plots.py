"""PNG plots of a benchmark report (matplotlib, Agg backend; skipped with a message when not installed).

* ``<stem>_bandwidth.png``: GB/s (per-rank dedup convention, median whole call) of every implementation and
  payload precision. One token count: grouped bars per op with the value on each bar. Several token counts: one
  panel per op, a line per series against tokens per rank (distinct markers and line styles, so that equal values
  stay visible).
* ``<stem>_compare.png``: median time (µs) with p10-p90 bars at the largest token count, grouped per op.

On a GPU a black diamond marks the CUDA-event (kernel) figure of each bar. Titles name the machine, the EP size,
the sizes and the payload precisions; a2a/vdev2d are timed for the forward ops only.
"""
from __future__ import annotations

from typing import Optional

from .options import OPS

_SERIES = (("mxcomm", "mxfp8"), ("mxcomm", "bf16"), ("reference", "mxfp8"), ("a2a", "bf16"), ("vdev2d", "bf16"))
_STYLE = {("mxcomm", "mxfp8"): ("tab:blue", "o", "-"), ("mxcomm", "bf16"): ("tab:cyan", "s", "--"),
          ("reference", "mxfp8"): ("tab:orange", "^", "-."), ("a2a", "bf16"): ("tab:green", "D", ":"),
          ("vdev2d", "bf16"): ("tab:red", "v", (0, (5, 1, 1, 1)))}


def make_plots(report: dict, stem: str) -> tuple[list, Optional[str]]:
    """Write the plots next to ``stem``; return (paths, message or None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - plots are optional
        msg = f"plots skipped: matplotlib unavailable ({type(e).__name__}: {e})"
        print(f"mxcomm bench: {msg}")
        return [], msg
    ok = [c for c in report["cases"] if c.get("status") == "ok"]
    if not ok:
        return [], "plots skipped: no successful case"
    ops = [op for op in OPS if any(c["op"] == op for c in ok)]
    series = [s for s in _SERIES if any((c["impl"], c["precision"]) == s for c in ok)]
    series += sorted({(c["impl"], c["precision"]) for c in ok} - set(series))
    tokens = sorted({c["tokens"] for c in ok})
    by = {(c["impl"], c["precision"], c["op"], c["tokens"]): c for c in ok}
    labels = {s: _label(s, ok) for s in series}
    kernel = bool(report["timing"].get("kernel_measured"))
    paths = []

    if len(tokens) == 1:
        fig, ax = plt.subplots(figsize=(max(7.0, 1.2 + 0.75 * len(ops) * len(series)), 4.8))
        _bars(ax, ops, series, labels, lambda s, op: by.get((*s, op, tokens[0])),
              value=lambda c: c["gbps"]["dedup"]["whole_call"],
              kernel=(lambda c: c["gbps"]["dedup"].get("kernel")) if kernel else None, fmt=_fmt,
              ylabel="GB/s per rank (dedup bytes / median time)")
        ax.set_title(f"bandwidth, {tokens[0]} tokens per rank", fontsize=9)
    else:
        fig, axes = _panels(plt, len(ops))
        for ax, op in zip(axes, ops):
            for s in series:
                pts = [(T, by[(*s, op, T)]) for T in tokens if (*s, op, T) in by]
                if not pts:
                    continue
                col, mk, ls = _STYLE.get(s, ("gray", "x", "-"))
                ax.plot([t for t, _ in pts], [c["gbps"]["dedup"]["whole_call"] for _, c in pts], marker=mk,
                        linestyle=ls, color=col, markersize=7, markerfacecolor="none", markeredgewidth=1.5,
                        label=labels[s])
                if kernel and all(c["gbps"]["dedup"].get("kernel") for _, c in pts):
                    ax.plot([t for t, _ in pts], [c["gbps"]["dedup"]["kernel"] for _, c in pts], marker="D",
                            linestyle="none", color="black", markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_xticks(tokens)
            ax.set_xticklabels([str(t) for t in tokens])
            ax.minorticks_off()
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("GB/s per rank (dedup, whole call)")
            ax.set_title(op, fontsize=10)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        fig.legend(*_legend(axes[0].figure, series, labels, kernel), loc="lower center",
                   ncol=min(len(series) + kernel, 4), fontsize=8, frameon=False)
        fig.subplots_adjust(bottom=0.16)
    paths.append(_save(plt, fig, _title(report, "bandwidth"), stem + "_bandwidth.png", legend_below=len(tokens) > 1))

    tmax = tokens[-1]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 + 0.75 * len(ops) * len(series)), 4.8))
    _bars(ax, ops, series, labels, lambda s, op: by.get((*s, op, tmax)),
          value=lambda c: c["stats_us"]["whole_call"]["median"],
          err=lambda c: (c["stats_us"]["whole_call"]["p10"], c["stats_us"]["whole_call"]["p90"]),
          kernel=(lambda c: (c["stats_us"].get("kernel") or {}).get("median")) if kernel else None, fmt=_fmt,
          ylabel="µs per call (median, whiskers p10-p90)")
    ax.set_title(f"time per call, {tmax} tokens per rank (lower is better)", fontsize=9)
    paths.append(_save(plt, fig, _title(report, "time"), stem + "_compare.png"))
    return paths, None


def _label(s: tuple, ok: list) -> str:
    if s == ("mxcomm", "mxfp8") and any(c.get("is_reference") for c in ok):
        return "mxcomm mxfp8 (= reference backend)"
    return f"{s[0]} {s[1]}"


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 1:
        return f"{v:.1f}"
    return f"{v:.2g}"


def _bars(ax, ops, series, labels, case, *, value, fmt, ylabel, err=None, kernel=None) -> None:
    """Grouped bars: one group per op, one bar per series measured for it, the value written on each bar.
    A log y axis when the values span more than 30x (small bars stay visible)."""
    width = 0.8 / max(1, len(series))
    vals, tops = [], []
    seen = set()
    for gi, op in enumerate(ops):
        present = [s for s in series if case(s, op) is not None]
        x0 = gi - width * (len(present) - 1) / 2
        for j, s in enumerate(present):
            c = case(s, op)
            v = value(c)
            if v is None:
                continue
            x = x0 + j * width
            col = _STYLE.get(s, ("gray",))[0]
            yerr = None
            if err is not None:
                lo, hi = err(c)
                yerr = [[max(0.0, v - lo)], [max(0.0, hi - v)]]
            ax.bar(x, v, width * 0.92, color=col, yerr=yerr, capsize=3, ecolor="0.25",
                   label=labels[s] if s not in seen else None)
            seen.add(s)
            top = hi if err is not None else v
            ax.annotate(fmt(v), (x, top), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=7)
            if kernel is not None and kernel(c):
                ax.plot([x], [kernel(c)], marker="D", color="black", markersize=4, linestyle="none",
                        label="CUDA events (kernel)" if "kernel" not in seen else None)
                seen.add("kernel")
            vals.append(v)
            tops.append(max(top, kernel(c) if kernel is not None and kernel(c) else 0.0))
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(ops)
    ax.set_xlim(-0.6, len(ops) - 0.4)
    if vals and min(vals) > 0 and max(vals) / min(vals) > 30:
        ax.set_yscale("log")
        ax.set_ylabel(ylabel + ", log scale")
        ax.set_ylim(min(vals) / 2, max(tops) * 2.5)
    else:
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, max(tops) * 1.15 if tops else 1)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _legend(fig, series, labels, kernel) -> tuple:
    from matplotlib.lines import Line2D

    handles = []
    for s in series:
        col, mk, ls = _STYLE.get(s, ("gray", "x", "-"))
        handles.append(Line2D([], [], color=col, marker=mk, linestyle=ls, markerfacecolor="none", markersize=7))
    names = [labels[s] for s in series]
    if kernel:
        handles.append(Line2D([], [], color="black", marker="D", linestyle="none", markersize=4))
        names.append("CUDA events (kernel)")
    return handles, names


def _machine(report: dict) -> str:
    m = report.get("machine") or {}
    if m.get("gpu_names"):
        n = len({d.split(":cuda:")[-1] for d in (report.get("world") or {}).get("devices") or []}) or m["gpu_count"]
        return f"{n} x {', '.join(m['gpu_names'])}"
    cpus = m.get("cpu_count")
    return f"CPU ({cpus} cores)" if cpus else "CPU"


def _title(report: dict, what: str) -> str:
    cfg = report["config"]
    rpg = report.get("ranks_per_gpu", 1)
    share = f", {rpg} ranks per GPU" if rpg > 1 and cfg["device"] == "cuda" else ""
    back = "reference backend (torch)" if cfg["backend"] == "torch" else f"{cfg['backend']} backend"
    return (f"mxcomm bench {what} - {_machine(report)}, EP={report['ep_size']}{share}, {back}\n"
            f"payload {' / '.join(p.upper() for p in cfg['precisions'])}; hidden {cfg['hidden']}, top-{cfg['topk']}, "
            f"{cfg['experts']} experts")


def _panels(plt, n: int) -> tuple:
    """``(figure, [n axes])``: one panel per op, two a row (one row for n <= 2); spare panels hidden."""
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.8 * rows + 0.8), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _save(plt, fig, title: str, path: str, legend_below: bool = False) -> str:
    """Title, lay out, write ``path`` (PNG) and close ``fig``; return ``path``."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07 if legend_below else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["make_plots"]
