"""The report's matplotlib figures as PNG bytes (Agg), drawn from analysis objects as they
are (nothing here measures, fits or labels).  Colour follows the backend, line style the
attention type: softmax solid with circles, linear dashed with squares."""

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402
import numpy as np  # noqa: E402

from ..bench.table import format_bytes, format_seconds  # noqa: E402
from .analysis import FIT_MIN_N  # noqa: E402

BACKEND_COLOURS = {"reference": "#6b6b6b", "numba": "#1f77b4", "cython": "#2ca02c",
                   "torch": "#d62728"}
_EXTRA_COLOURS = ["#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
STYLES = {"softmax": {"linestyle": "-", "marker": "o"},
          "linear": {"linestyle": "--", "marker": "s"}}
DPI = 100
_colours = dict(BACKEND_COLOURS)


def colour(backend):
    """The colour of ``backend``: fixed for fastattn's backends and torch, else assigned once."""
    extra = _EXTRA_COLOURS[(len(_colours) - len(BACKEND_COLOURS)) % len(_EXTRA_COLOURS)]
    return _colours.setdefault(backend, extra)


def _style(curve):
    """Colour by backend, line by attention; float64 hollow and fainter than float32."""
    return {"color": colour(curve.backend), "markersize": 4, "linewidth": 1.6,
            **STYLES.get(curve.attention, {"linestyle": ":", "marker": "^"}),
            **({"markerfacecolor": "white", "alpha": 0.75}
               if curve.key.get("dtype") == "float64" else {})}


#: Most legend entries drawn below a panel; a panel of more (a run of many shapes) names
#: its curves in the page's tables instead, as a legend that long would crowd out the axes.
LEGEND_MAX = 16
#: Labels longer than this go one to a legend row, shorter ones two.
LEGEND_WIDE_LABEL = 44
#: Inches of figure height a legend row takes (fontsize 7.5), and the legend rows a panel
#: of :func:`_panel_grid`'s height leaves room for below its axes.
LEGEND_ROW_IN, LEGEND_ROWS_IN_PANEL = 0.16, 6


def _legend_columns(labels):
    return 1 if max(map(len, labels)) > LEGEND_WIDE_LABEL else 2


def _finish(ax, title, xlabel=None):
    """The n axis, the panel title and the legend below the panel (the curves stay visible)."""
    _n_axis(ax, xlabel)
    ax.set_title(title, fontsize=11)
    labels = ax.get_legend_handles_labels()[1]
    if len(labels) > LEGEND_MAX:
        ax.text(0.5, -0.16, f"{len(labels)} curves: too many to label here; the tables below "
                "name them", transform=ax.transAxes, ha="center", va="top", fontsize=8)
    elif labels:
        ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncol=_legend_columns(labels), frameon=False)


def _fit_legends(fig):
    """Make ``fig`` taller for legends of more rows than a panel leaves room for."""
    rows = [-(-len(labels) // _legend_columns(labels)) for ax in fig.axes
            if (legend := ax.get_legend()) is not None
            and (labels := [t.get_text() for t in legend.get_texts()])]
    extra = max(rows, default=0) - LEGEND_ROWS_IN_PANEL
    if extra > 0:
        grid_rows = max(ax.get_subplotspec().get_gridspec().nrows for ax in fig.axes)
        width, height = fig.get_size_inches()
        fig.set_size_inches(width, height + grid_rows * extra * LEGEND_ROW_IN)


def to_png(fig):
    """Render ``fig`` to PNG bytes and close it."""
    _fit_legends(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)  # layout="constrained": one draw, no tight bbox pass
    plt.close(fig)
    return buffer.getvalue()


def data_uri(png):
    """``data:image/png;base64,...`` for an ``<img src>`` that needs no file or server."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _n_axis(ax, xlabel=None):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x)}" if x >= 1 else ""))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel or "sequence length n (n_q = n_k)")
    ax.grid(True, which="major", alpha=0.3)


def _panel_grid(panels, ncols, height=5.4, width=5.6):
    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows),
                             squeeze=False, sharey=True, layout="constrained")
    flat = axes.ravel()
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    return fig, flat


#: What each metric of :func:`scaling_figure` draws: the curve's values, fit and y label.
METRICS = {"time": ("median_s", "time_fit", "median time per call"),
           "memory": ("peak_bytes", "memory_fit", "peak extra memory per call"),
           "held": ("held_bytes", "held_fit", "memory held between tokens, per head")}


def scaling_figure(panels, metric="time", ncols=2, title=None, xlabel=None):
    """PNG of log-log time (median, min-max band), peak extra memory or memory held (a
    :data:`METRICS` key) against n, a panel per ``(title, curves)`` of ``panels``, each
    curve's fitted exponent in the legend and drawn dotted."""
    values, fit_name, ylabel = METRICS[metric]
    fig, axes = _panel_grid(panels, ncols)
    drawn = False
    for ax, (panel_title, curve_list) in zip(axes, panels):
        for c in curve_list:
            y = getattr(c, values)
            use = np.isfinite(y) & (y > 0) if y is not None else np.zeros(len(c.n), bool)
            if not use.any():
                continue
            drawn = True
            fit = getattr(c, fit_name)
            ax.plot(c.n[use], y[use], label=c.label + (f"  n^{fit.format()}" if fit else ""),
                    **_style(c))
            if metric == "time":
                ax.fill_between(c.n[use], c.min_s[use], c.max_s[use], color=colour(c.backend),
                                alpha=0.12, linewidth=0)
            if fit:
                xs = np.array([fit.n_min, fit.n_max], dtype=float)
                ax.plot(xs, fit.predict(xs), color="black", linewidth=0.8, linestyle=":",
                        alpha=0.7)
        ax.set_yscale("log")
        if metric == "time":
            ax.yaxis.set_major_locator(LogLocator(base=10))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: format_seconds(x)))
        else:  # powers of two read as whole KiB / MiB / GiB
            ax.yaxis.set_major_locator(LogLocator(base=2, numticks=8))
            ax.yaxis.set_minor_locator(LogLocator(base=2, subs=(), numticks=8))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: format_bytes(x)))
        _finish(ax, panel_title, xlabel)
        ax.axvspan(FIT_MIN_N, ax.get_xlim()[1], color="#f3f3f3", zorder=0)
    axes[0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=12)
    if not drawn:
        axes[0].text(0.5, 0.5, "no data", transform=axes[0].transAxes, ha="center")
    return to_png(fig)


def roofline_figure(panels, roofs, ncols=2):
    """PNG of GFLOP/s against n per panel, with each ``(label, n, gflops)`` of ``roofs`` as a
    line (horizontal when probed at one n); a point above its roof (``Curve.above_roof``) is
    ringed in red."""
    fig, axes = _panel_grid(panels, ncols)
    for ax, (panel_title, curve_list) in zip(axes, panels):
        for c in curve_list:
            use = np.isfinite(c.gflops) & (c.gflops > 0)
            if not use.any():
                continue
            ax.plot(c.n[use], c.gflops[use], label=c.label, **_style(c))
            over = use & c.above_roof if c.above_roof is not None else np.zeros_like(use)
            if over.any():  # flagged: the page says why a kernel can pass its roof
                ringed = "above its roof (see the note)" in ax.get_legend_handles_labels()[1]
                ax.plot(c.n[over], c.gflops[over], linestyle="none", marker="o", markersize=11,
                        markerfacecolor="none", markeredgecolor="#d00000", markeredgewidth=1.6,
                        label=None if ringed else "above its roof (see the note)")
        for i, (label, ns, values) in enumerate(roofs):
            style = {"color": "black", "linewidth": 2.2 - 0.6 * i,
                     "linestyle": ["-", "-.", ":"][i % 3]}
            if len(ns) == 1:
                ax.axhline(values[0], label=label, **style)
            else:
                ax.plot(ns, values, label=label, **style)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        _finish(ax, panel_title)
    axes[0].set_ylabel("achieved GFLOP/s (at the median time)")
    return to_png(fig)


def heatmap_figure(heatmap):
    """PNG of one head's softmax and linear weights on one log colour scale, from a hundredth
    of a uniform weight to the largest, so peaked and nearly uniform rows both read."""
    n_k = heatmap.softmax.shape[-1]
    vmax = float(max(heatmap.softmax.max(), heatmap.linear.max()))
    norm = LogNorm(vmin=min(0.01 / n_k, vmax / 10), vmax=vmax, clip=True)
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.6), layout="constrained")
    for ax, weights, name in ((axes[0], heatmap.softmax, "softmax"),
                              (axes[1], heatmap.linear, "linear (elu+1)")):
        image = ax.imshow(weights, cmap="magma", norm=norm, interpolation="nearest")
        ax.set_title(f"{name} attention weights", fontsize=10)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    fig.colorbar(image, ax=axes, shrink=0.9, label="weight (log colour scale)")
    fig.suptitle(heatmap.title, fontsize=11)
    return to_png(fig)


def quality_figure(gaussian, minilm):
    """PNG of linear against softmax cosine similarity: Gaussian rows, MiniLM per layer."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.4]},
                             layout="constrained")
    ax = axes[0]
    ax.plot([r.n for r in gaussian], [r.cosine_similarity for r in gaussian], "o-",
            color="#1f77b4")
    _n_axis(ax)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("mean cosine similarity")
    ax.set_title("Gaussian inputs (seed-experiment generator)", fontsize=10)
    ax = axes[1]
    layers = np.arange(len(minilm))
    cos = np.array([r.cosine_similarity for r in minilm])
    lo = np.array([r.cos_min for r in minilm])
    hi = np.array([r.cos_max for r in minilm])
    ax.bar(layers, cos, color="#ff7f0e", alpha=0.8, label="all heads")
    ax.errorbar(layers, cos, yerr=[cos - lo, hi - cos], fmt="none", ecolor="black", capsize=4,
                label="range over heads")
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1.02)
    ax.set_title("all-MiniLM-L6-v2 activations, per layer", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="y", alpha=0.3)
    return to_png(fig)


def history_figure(history, title):
    """PNG of ``load_asv_history`` rows across commits, a line per machine and parameters."""
    series = {}
    for row in history:
        params = ", ".join(f"{k}={v}" for k, v in sorted((row.get("params") or {}).items()))
        series.setdefault((row.get("machine"), params), []).append(row)
    fig, ax = plt.subplots(figsize=(11, 4.5), layout="constrained")
    dates = sorted({row.get("date") or "" for row in history})
    position = {d: i for i, d in enumerate(dates)}
    cmap = plt.get_cmap("tab20")
    markers = "os^Dv<>ph*"
    for i, ((machine, params), rows) in enumerate(sorted(series.items(), key=lambda kv: str(kv[0]))):
        rows = sorted(rows, key=lambda r: r.get("date") or "")
        xs = [position[r.get("date") or ""] for r in rows]
        ys = [np.nan if r.get("value") is None else r["value"] for r in rows]
        ax.plot(xs, ys, "-", marker=markers[(i // 20) % len(markers)], color=cmap(i % 20),
                markersize=5, label=f"{machine}: {params}")
    commits = {row.get("date") or "": str(row.get("commit") or "")[:8] for row in history[::-1]}
    ax.set_xticks(range(len(dates)))
    ax.set_xticklabels([f"{commits[d]}\n{d[:10]}" for d in dates], fontsize=7, rotation=0)
    ax.set_yscale("log")
    unit = next((r.get("unit") for r in history if r.get("unit")), "")
    ax.set_ylabel(unit or "value")
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    if len(series) <= 40:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5),
                  ncol=1 if len(series) <= 20 else 2)
    return to_png(fig)
