"""The report's shared drawing: PNG bytes (Agg) of analysis objects as they are; colour by
backend, line style by attention (softmax solid, linear dashed)."""

import base64
import io
import textwrap

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
#: The colour of a line that belongs to no backend (the asv history of threads, versions).
NO_BACKEND_COLOUR = "#333333"
_EXTRA_COLOURS = ["#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
STYLES = {"softmax": {"linestyle": "-", "marker": "o"},
          "linear": {"linestyle": "--", "marker": "s"}}
DPI = 100
_colours = dict(BACKEND_COLOURS)


def colour(backend):
    """The colour of ``backend``: fixed for the known ones, else assigned once."""
    extra = _EXTRA_COLOURS[(len(_colours) - len(BACKEND_COLOURS)) % len(_EXTRA_COLOURS)]
    return _colours.setdefault(backend, extra)


def style(curve):
    """Colour by backend, line by attention; float64 hollow and fainter than float32."""
    return {"color": colour(curve.backend), "markersize": 4, "linewidth": 1.6,
            **STYLES.get(curve.attention, {"linestyle": ":", "marker": "^"}),
            **({"markerfacecolor": "white", "alpha": 0.75}
               if curve.key.get("dtype") == "float64" else {})}


#: Most legend entries below a panel (the tables name more); labels over LEGEND_WIDE_LABEL
#: characters go one to a row; a row's inches, and the rows a panel leaves room for.
LEGEND_MAX, LEGEND_WIDE_LABEL, LEGEND_ROW_IN, LEGEND_ROWS_IN_PANEL = 16, 44, 0.16, 6
#: Characters of a legend line: a longer label (the backends of an "equal" line) is wrapped,
#: as a legend wider than its panel collapses the constrained layout.
LEGEND_LINE = 80


def _legend_columns(labels):
    return 1 if max(map(len, labels)) > LEGEND_WIDE_LABEL else 2


def finish(ax, title, xlabel=None):
    """The n axis, the title and the legend below the panel (the curves stay visible)."""
    n_axis(ax, xlabel)
    ax.set_title(title, fontsize=11)
    handles, labels = ax.get_legend_handles_labels()
    if len(labels) > LEGEND_MAX:
        ax.text(0.5, -0.16, f"{len(labels)} curves: too many to label here; the tables below "
                "name them", transform=ax.transAxes, ha="center", va="top", fontsize=8)
    elif labels:
        ax.legend(handles, [textwrap.fill(label, LEGEND_LINE) for label in labels], fontsize=7.5,
                  loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncol=_legend_columns(labels), frameon=False)


def to_png(fig):
    """PNG bytes of ``fig`` (then closed), taller where a legend below a panel needs room."""
    rows = [-(-sum(label.count("\n") + 1 for label in labels) // _legend_columns(labels))
            for ax in fig.axes if (legend := ax.get_legend()) is not None
            and (labels := [t.get_text() for t in legend.get_texts()])]
    if (extra := max(rows, default=0) - LEGEND_ROWS_IN_PANEL) > 0:
        grid_rows = max(ax.get_subplotspec().get_gridspec().nrows for ax in fig.axes)
        width, height = fig.get_size_inches()
        fig.set_size_inches(width, height + grid_rows * extra * LEGEND_ROW_IN)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    return buffer.getvalue()


def data_uri(png):
    """``data:image/png;base64,...`` for an ``<img src>`` that needs no file or server."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def n_axis(ax, xlabel=None):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x)}" if x >= 1 else ""))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel or "sequence length n (n_q = n_k)")
    ax.grid(True, which="major", alpha=0.3)


def panel_grid(panels, ncols, height=5.4, width=5.6):
    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows),
                             squeeze=False, sharey=True, layout="constrained")
    flat = axes.ravel()
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    return fig, flat


#: What each metric of :func:`scaling_figure` draws: the values, fit and y label.
METRICS = {"time": ("median_s", "time_fit", "median time per call"),
           "memory": ("peak_bytes", "memory_fit", "peak extra memory per call"),
           "held": ("held_bytes", "held_fit", "memory held between tokens, per head"),
           "gflops": ("gflops", None, "achieved GFLOP/s (at the median time)")}
ABOVE_ROOF = "above its roof (see the note)"


def _equal_groups(curve_list, values):
    """``(curve, label, use)`` per line: a curve, or (memory only) the curves of one attention
    with equal ``values`` as one line "linear: reference, numba — equal"."""
    groups = {}
    for c in curve_list:
        y = getattr(c, values)
        use = np.isfinite(y) & (y > 0)
        key = (c.attention, tuple(c.n[use].tolist()), tuple(y[use].tolist()),
               id(c) if values in ("median_s", "gflops") else 0)
        if use.any():
            groups.setdefault(key, (c, [], use))[1].append(c)
    return [(c, c.label if len(members) == 1 else f"{c.attention}: " + ", ".join(
        m.label.replace(f" {c.attention}", "", 1) for m in members) + " — equal", use)
        for c, members, use in groups.values()]


def _y_axis(ax, metric):
    """Log y, its ticks read as GFLOP/s, seconds or (powers of two) whole KiB / MiB / GiB."""
    ax.set_yscale("log")
    if metric == "gflops":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    elif metric == "time":
        ax.yaxis.set_major_locator(LogLocator(base=10))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: format_seconds(x)))
    else:
        ax.yaxis.set_major_locator(LogLocator(base=2, numticks=8))
        ax.yaxis.set_minor_locator(LogLocator(base=2, subs=(), numticks=8))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: format_bytes(x)))


def scaling_figure(panels, metric="time", ncols=2, title=None, xlabel=None, empty=None,
                   roofs=()):
    """PNG of log-log ``metric`` (:data:`METRICS`) against n, a panel per ``(title, curves)``:
    fits in the legend and dotted, time with the band of the middle half of its repeats,
    GFLOP/s with the ``(label, n, gflops)`` ``roofs`` in black and points above their roof
    ringed in red; with nothing to draw, the words ``empty`` (else "no data")."""
    values, fit_name, ylabel = METRICS[metric]
    fig, axes = panel_grid(panels, ncols)
    if title:
        fig.suptitle(title, fontsize=12)
    lines = [_equal_groups(curve_list, values) for _, curve_list in panels]
    if not any(lines):   # words, not empty axes
        for ax in axes:
            ax.set_axis_off()
        axes[0].text(0.5, 0.5, empty or "no data", transform=axes[0].transAxes, ha="center",
                     va="center", wrap=True)
        return to_png(fig)
    for ax, (panel_title, _), groups in zip(axes, panels, lines):
        for c, label, use in groups:
            y, fit = getattr(c, values), fit_name and getattr(c, fit_name)
            ax.plot(c.n[use], y[use], label=label + (f"  n^{fit.format()}" if fit else ""),
                    **{**style(c), **({"color": NO_BACKEND_COLOUR} if label != c.label else {})})
            band = use & np.isfinite(c.q25_s) & np.isfinite(c.q75_s) & (metric == "time")
            if band.any():   # not min-max: that is as wide as the worst stall
                ax.fill_between(c.n[band], c.q25_s[band], c.q75_s[band],
                                color=colour(c.backend), alpha=0.15, linewidth=0)
            if fit:
                xs = np.array([fit.n_min, fit.n_max], dtype=float)
                ax.plot(xs, fit.predict(xs), color="black", linewidth=0.8, linestyle=":",
                        alpha=0.7)
            if metric == "gflops" and (over := use & c.above_roof).any():
                ringed = ABOVE_ROOF in ax.get_legend_handles_labels()[1]
                ax.plot(c.n[over], y[over], linestyle="none", marker="o", markersize=11,
                        markerfacecolor="none", markeredgecolor="#d00000", markeredgewidth=1.6,
                        label=None if ringed else ABOVE_ROOF)
        for i, (label, ns, gflops) in enumerate(roofs):   # one n: a horizontal line
            line = {"color": "black", "linewidth": 2.2 - 0.6 * i,
                    "linestyle": ["-", "-.", ":"][i % 3], "label": label}
            if len(ns) == 1:
                ax.axhline(gflops[0], **line)
            else:
                ax.plot(ns, gflops, **line)
        _y_axis(ax, metric)
        finish(ax, panel_title, xlabel)
        if fit_name:
            ax.axvspan(FIT_MIN_N, ax.get_xlim()[1], color="#f3f3f3", zorder=0)
    axes[0].set_ylabel(ylabel)
    return to_png(fig)


def machine_figure(m, metric, **kwargs):
    """Data URI of :func:`scaling_figure` of machine ``m``'s panels; None if no value to draw."""
    if any(np.isfinite(getattr(c, METRICS[metric][0])).any() for c in m.scaling_curves):
        return data_uri(scaling_figure(m.panels, metric, **kwargs))
    return None


def weights_figure(title, panels, ncols=4):
    """PNG of attention weights ``(label, (n_q, n_k) array)`` per panel, on one log colour
    scale from a hundredth of a uniform weight to the largest."""
    vmax = float(max(w.max() for _, w in panels))
    norm = LogNorm(vmin=min(0.01 / panels[0][1].shape[-1], vmax / 10), vmax=vmax, clip=True)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(12, 3.1 * nrows + 0.6) if ncols > 2
                             else (10.5, 4.6), layout="constrained", squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax, (label, weights) in zip(axes.ravel(), panels):
        image = ax.imshow(np.clip(weights, 0, None), cmap="magma", norm=norm,
                          interpolation="nearest")
        ax.set_title(label, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=axes, shrink=0.8, label="weight (log colour scale)")
    fig.suptitle(title + " — rows: queries, columns: keys", fontsize=11)
    return to_png(fig)
