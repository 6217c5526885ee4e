"""The asv history section: one benchmark's values across commits (``--asv --history``)."""

import numpy as np

from ..bench.table import format_bytes, format_number, format_seconds
from . import figures
from .figures import plt  # pyplot once figures has selected Agg
from .environment import value_text

NAV = "asv history"


def history_figure(history, title):
    """PNG of ``load_asv_history`` rows across commits, a line per machine and parameters,
    coloured by backend (else :data:`figures.NO_BACKEND_COLOUR`)."""
    series = {}
    for row in history:
        params = ", ".join(f"{k}={v}" for k, v in sorted((row.get("params") or {}).items()))
        series.setdefault((row.get("machine"), params), []).append(row)
    fig, ax = plt.subplots(figsize=(11, 4.5), layout="constrained")
    dates = sorted({row.get("date") or "" for row in history})
    position = {d: i for i, d in enumerate(dates)}
    markers, dashes = "os^Dv<>ph*", ("-", "--", ":", "-.")
    seen = {}   # series drawn so far per colour: they differ by marker and line style
    for (machine, params), rows in sorted(series.items(), key=lambda kv: str(kv[0])):
        rows = sorted(rows, key=lambda r: r.get("date") or "")
        backend = (rows[0].get("params") or {}).get("backend")
        colour = figures.colour(backend) if isinstance(backend, str) else figures.NO_BACKEND_COLOUR
        i = seen[colour] = seen.get(colour, -1) + 1
        ax.plot([position[r.get("date") or ""] for r in rows],
                [np.nan if r.get("value") is None else r["value"] for r in rows],
                linestyle=dashes[(i // len(markers)) % len(dashes)],
                marker=markers[i % len(markers)], color=colour, markersize=5,
                label=f"{machine}: {params}")
    commits = {row.get("date") or "": str(row.get("commit") or "")[:8] for row in history[::-1]}
    ax.set_xticks(range(len(dates)))
    ax.set_xticklabels([f"{commits[d]}\n{d[:10]}" for d in dates], fontsize=7, rotation=0)
    ax.set_yscale("log")
    ax.set_ylabel(next((r.get("unit") for r in history if r.get("unit")), "") or "value")
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    if len(series) <= 40:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5),
                  ncol=1 if len(series) <= 20 else 2)
    return figures.to_png(fig)


def section(page):
    """The history block of ``page.history``, ``load_asv_history`` rows (None: no block)."""
    if page.history is None:
        return None
    title = page.history_benchmark or "asv benchmark history"
    rows = sorted(page.history, key=lambda r: (str(r.get("benchmark")), str(r.get("machine")),
                                               str(r.get("params")), r.get("date") or ""))
    value = {"seconds": format_seconds, "bytes": format_bytes}
    return {"benchmark": title,
            "png": figures.data_uri(history_figure(page.history, title)) if rows else None,
            "rows": [{**r, "commit": str(r.get("commit") or "")[:8],
                      "params": value_text(r.get("params") or {}),
                      "value": value.get(r.get("unit"), format_number)(r.get("value"))}
                     for r in rows]}
