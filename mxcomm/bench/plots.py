"""PNG plots of a benchmark report (matplotlib, Agg backend; skipped with a message when not installed).

* ``<stem>_bandwidth.png``: GB/s (dedup convention, whole call; dashed: CUDA-event time) against tokens
  per rank, one panel per op (forward and backward, two panels a row), one line per implementation and
  payload precision.
* ``<stem>_compare.png``: median time with p10-p90 bars at the largest token count, one panel per op:
  MXFP8 vs BF16 vs the baselines (a2a/vdev2d appear in the forward panels only: they are not timed again
  for the backward ops).
"""
from __future__ import annotations

from typing import Optional

from .options import OPS

_COLORS = {("mxcomm", "mxfp8"): "tab:blue", ("mxcomm", "bf16"): "tab:cyan", ("reference", "mxfp8"): "tab:orange",
           ("a2a", "bf16"): "tab:green", ("vdev2d", "bf16"): "tab:red"}


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
    title = (f"{report['label']}: EP={report['ep_size']}, H={report['config']['hidden']}, "
             f"top-{report['config']['topk']}, {report['config']['experts']} experts")
    paths = []

    fig, axes = _panels(plt, len(ops))
    for ax, op in zip(axes, ops):
        series = sorted({(c["impl"], c["precision"]) for c in ok if c["op"] == op})
        for s in series:
            pts = sorted((c["tokens"], c["gbps"]["dedup"]) for c in ok if c["op"] == op and (c["impl"], c["precision"]) == s)
            xs = [t for t, _ in pts]
            col = _COLORS.get(s)
            ax.plot(xs, [g["whole_call"] for _, g in pts], "o-", color=col, label=f"{s[0]} {s[1]} (whole call)")
            if all(g.get("kernel") for _, g in pts):
                ax.plot(xs, [g["kernel"] for _, g in pts], "x--", color=col, alpha=0.7, label=f"{s[0]} {s[1]} (events)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("GB/s (per-rank dedup convention)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save(plt, fig, title, stem + "_bandwidth.png"))

    tmax = max(c["tokens"] for c in ok)
    fig, axes = _panels(plt, len(ops))
    for ax, op in zip(axes, ops):
        cs = sorted((c for c in ok if c["op"] == op and c["tokens"] == tmax), key=lambda c: (c["impl"], c["precision"]))
        names = [f"{c['impl']}\n{c['precision']}" for c in cs]
        med = [c["stats_us"]["whole_call"]["median"] for c in cs]
        lo = [m - c["stats_us"]["whole_call"]["p10"] for m, c in zip(med, cs)]
        hi = [c["stats_us"]["whole_call"]["p90"] - m for m, c in zip(med, cs)]
        ax.bar(range(len(cs)), med, yerr=[lo, hi], capsize=3,
               color=[_COLORS.get((c["impl"], c["precision"]), "gray") for c in cs])
        ax.set_xticks(range(len(cs)))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel("µs (median, p10-p90; whole call)")
        ax.set_title(f"{op}, {tmax} tokens per rank")
        ax.grid(True, axis="y", alpha=0.3)
    paths.append(_save(plt, fig, title, stem + "_compare.png"))
    return paths, None


def _panels(plt, n: int) -> tuple:
    """``(figure, [n axes])``: one panel per op, two a row (one row for n <= 2); spare panels hidden."""
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _save(plt, fig, title: str, path: str) -> str:
    """Title, lay out, write ``path`` (PNG) and close ``fig``; return ``path``."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["make_plots"]
