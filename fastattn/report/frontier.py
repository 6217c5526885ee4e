"""The feature-map frontier: each map's computed quality against its measured cost (time at
:data:`COST_NS`, state bytes, crossover against softmax); nothing is estimated."""

import math
from dataclasses import astuple, dataclass

import numpy as np
from matplotlib.ticker import FuncFormatter

from ..bench.schema import FEATURE_MAP_NS
from ..bench.table import format_bytes, format_seconds, plural
from ..map_quality import MAPS, MapQuality, mean_quality
from .analysis import crossover, envelope, fastest_at
from .figures import data_uri, plt, to_png, weights_figure  # figures selects Agg first

COST_NS = FEATURE_MAP_NS   # the n whose time per call the frontier shows
NAV = "Feature maps"


def kl_text(kl):
    """A row KL divergence: 3 decimals, or ``"∞"``."""
    return "∞" if math.isinf(kl) else f"{kl:.3f}"


@dataclass(frozen=True)
class TimeAt:
    """The time per call at ``n`` of the fastest fastattn backend there."""

    n: int
    seconds: float | None        # None: no point measured at this n
    backend: str | None = None

    def describe(self):
        return (f"{format_seconds(self.seconds)} ({self.backend})" if self.seconds is not None
                else f"not measured at n = {self.n}")


@dataclass
class FrontierRow:
    """One map's quality (``minilm``: the mean of ``minilm_layers``) and cost: a :class:`TimeAt`
    per :data:`COST_NS`, state bytes per head and the crossover (None: not measured)."""

    spec: object
    num_features: int
    cost_num_features: int
    gaussian: MapQuality
    minilm: MapQuality
    minilm_layers: list
    times: list
    state_bytes: int
    crossover: object = None
    measured: bool = False

    label = property(lambda self: self.spec.label)
    state_text = property(lambda self: format_bytes(self.state_bytes))

    def time_at(self, n):
        return next(t for t in self.times if t.n == n)


@dataclass
class Setting:
    """The configuration the costs come from."""

    machine: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    d_k: int = 64
    d_v: int = 64

    def describe(self):
        return (f"non-causal, d_k = {self.d_k}, d_v = {self.d_v}, {self.dtype}, "
                f"{plural(self.threads if self.threads is not None else '?', 'thread')}, "
                "batch 1, one head" + (f", machine {self.machine}" if self.machine else ""))


@dataclass
class Frontier:
    """The section: a :class:`FrontierRow` per map of :data:`MAPS`, softmax's times, the maps not
    measured, the feature-map curves not on the frontier and the opening sentences."""

    rows: list
    softmax_times: list
    setting: Setting
    quality: object
    unmatched: list

    convergence = property(lambda self: [r for r in self.rows if r.spec.factor])
    missing = property(lambda self: [r.label for r in self.rows if not r.measured])

    def softmax_at(self, n):
        return next(t for t in self.softmax_times if t.n == n)

    @property
    def headline(self):
        """The sentences the section opens with."""
        lines = [f"Output cosine similarity to softmax attention on the real MiniLM activations "
                 f"(n = {self.quality.minilm_shape[2]}, mean over layers): " + "; ".join(
                     f"{r.label} {r.minilm.output.cosine_similarity:.3f}" for r in self.rows)
                 + " (Gaussian inputs: " + "; ".join(
                     f"{r.label} {r.gaussian.output.cosine_similarity:.3f}" for r in self.rows)
                 + ")."]
        for n in COST_NS:
            timed = [r for r in self.rows if r.time_at(n).seconds is not None]
            soft = self.softmax_at(n).seconds
            if timed:
                lines.append(f"Time per call at n = {n} ({self.setting.describe()}): " + "; ".join(
                    f"{r.label} {format_seconds(r.time_at(n).seconds)}" for r in timed)
                    + (f"; softmax {format_seconds(soft)}" if soft is not None
                       else "; softmax not measured") + ".")
        if self.missing:
            lines.append("No measured point for " + ", ".join(self.missing)
                         + ": their cost is not shown (no cost is estimated in its place).")
        return lines


def _times(curve_list):
    """A :class:`TimeAt` per :data:`COST_NS`."""
    found = [(n, *fastest_at(curve_list, n)) for n in COST_NS]
    return [TimeAt(n, t, c.backend if c else None) for n, t, c in found]


def _setting(curve_list):
    """The setting most non-causal linear fastattn curves share (float32 first)."""
    linear = [c for c in curve_list if c.attention == "linear" and not c.causal and not c.peer]
    pool = linear or [c for c in curve_list if not c.causal and not c.peer]
    if not pool:
        return Setting()
    keys = [_setting_of(c) for c in pool]
    return Setting(*max(set(keys), key=lambda k: (keys.count(k), k[1] == "float32", str(k))))


def _setting_of(c):
    return (c.machine, str(c.key.get("dtype")), c.key.get("threads"), c.key.get("d_k"),
            c.key.get("d_v"))


def _in_setting(c, setting):
    """Whether ``c`` is a non-causal single-head fastattn prefill curve in ``setting``."""
    return (not c.causal and not c.peer and _setting_of(c) == astuple(setting)
            and c.key.get("batch", 1) == 1 and c.key.get("heads", 1) == 1
            and c.key.get("regime") in (None, "prefill"))


def frontier(fq, curve_list):
    """The :class:`Frontier` of quality ``fq`` (a ``FrontierQuality``) and the curves of one
    :class:`Setting`."""
    setting = _setting(curve_list)
    mine = [c for c in curve_list if _in_setting(c, setting)]
    softmax, linear = ([c for c in mine if c.attention == a] for a in ("softmax", "linear"))
    itemsize = np.dtype(setting.dtype).itemsize
    rows = []
    for spec in MAPS:
        measured = [c for c in linear if spec.measured_by(c.key)]
        D = spec.num_features(setting.d_k)
        cross = (crossover(*envelope(softmax), *envelope(measured))
                 if measured and softmax else None)
        layers = fq.minilm[spec.key]
        rows.append(FrontierRow(spec, spec.num_features(fq.d_k), D, fq.gaussian[spec.key],
                                mean_quality(layers), layers, _times(measured),
                                (D * setting.d_v + D) * itemsize, cross, bool(measured)))
    return Frontier(rows, _times(softmax), setting, fq, sorted(
        {c.label for c in linear if not any(s.measured_by(c.key) for s in MAPS)}))


#: FAVOR+ from light to dark as m grows.
MAP_COLOURS = {"favor-1": "#c9b3e6", "favor-4": "#a27fd1", "favor-16": "#7b4bb8",
               "favor-64": "#4b1d8c", "taylor": "#2ca02c", "elu": "#1f77b4", "relu": "#ff7f0e"}
SOFTMAX_COLOUR = "#222222"
#: A point past this share of its panel's log time range is labelled on its left.
LABEL_LEFT_FROM = 0.7


def _label_points(ax, labels):
    """Write each ``(text, t, y, colour)`` of ``labels`` beside its point."""
    if not labels:
        return
    logs = np.log10([t for _, t, _, _ in labels])
    lo, hi = logs.min(), logs.max()
    for (text, t, y, colour_), x in zip(labels, logs):
        left = hi > lo and (x - lo) / (hi - lo) > LABEL_LEFT_FROM
        ax.annotate(text, (t, y), textcoords="offset points", xytext=(-7 if left else 6, -3),
                    ha="right" if left else "left", fontsize=8, color=colour_)


def frontier_figure(fr):
    """PNG of quality (filled MiniLM, hollow Gaussian) against time, a panel per n."""
    fig, axes = plt.subplots(1, len(COST_NS), figsize=(12, 5.2), sharey=True,
                             layout="constrained")
    axes = np.atleast_1d(axes)
    for ax, n in zip(axes, COST_NS):
        missing, labels = [], []
        for r in fr.rows:
            t = r.time_at(n).seconds
            if t is None:
                missing.append(r.label)
                continue
            c = MAP_COLOURS.get(r.spec.key, "#8c564b")
            y, yg = r.minilm.output.cosine_similarity, r.gaussian.output.cosine_similarity
            ax.plot([t, t], [y, yg], color=c, linewidth=0.8, alpha=0.6)
            ax.plot(t, yg, "o", markerfacecolor="white", markeredgecolor=c, markersize=7)
            ax.plot(t, y, "o", color=c, markersize=8, label=r.label)
            labels.append((r.label, t, y, c))
        if (soft := fr.softmax_at(n).seconds) is not None:
            ax.plot(soft, 1.0, "*", color=SOFTMAX_COLOUR, markersize=13, label="softmax (exact)")
            labels.append(("softmax", soft, 1.0, SOFTMAX_COLOUR))
        else:
            missing.append("softmax")
        _label_points(ax, labels)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_seconds(x)))
        ax.set_xlabel(f"time per call at n = {n} (fastest repeat, fastest fastattn backend)")
        ax.set_title(f"n = {n}", fontsize=11)
        ax.grid(True, which="major", alpha=0.3)
        if missing:
            ax.text(0.02, 0.02, "no measured point: " + ", ".join(missing),
                    transform=ax.transAxes, fontsize=8, va="bottom", wrap=True,
                    bbox={"facecolor": "#fff8e5", "edgecolor": "#e0a800"})
        if len(missing) == len(fr.rows) + 1:
            ax.set_xticks([])
            ax.text(0.5, 0.5, f"nothing measured at n = {n}", transform=ax.transAxes,
                    ha="center", fontsize=11, color="#666")
    axes[0].set_ylabel("cosine similarity to softmax output\n(filled: MiniLM, mean over layers; "
                       "hollow: Gaussian)")
    lowest = min(min(r.minilm.output.cosine_similarity, r.gaussian.output.cosine_similarity)
                 for r in fr.rows)
    axes[0].set_ylim(max(0.0, lowest - 0.05), 1.02)
    return to_png(fig)


def convergence_figure(fr):
    """PNG of FAVOR+'s cosine similarity and row KL against m, other maps as lines."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    ms = np.array([r.num_features for r in fr.convergence])
    for ax, part, metric, ylabel in (
            (axes[0], "output", "cosine_similarity", "output cosine similarity"),
            (axes[1], "rows", "kl_divergence", "mean row KL(softmax ‖ map), nats")):
        def values(items):
            return np.array([getattr(getattr(x, part), metric) for x in items])
        layers = np.array([values(r.minilm_layers) for r in fr.convergence])
        ax.fill_between(ms, layers.min(axis=1), layers.max(axis=1), color="#7b4bb8", alpha=0.15,
                        linewidth=0, label="MiniLM, range over layers")
        ax.plot(ms, values([r.minilm for r in fr.convergence]), "o-", color="#7b4bb8",
                label="FAVOR+, MiniLM (mean over layers)")
        ax.plot(ms, values([r.gaussian for r in fr.convergence]), "s--", color="#7b4bb8",
                markerfacecolor="white", label="FAVOR+, Gaussian")
        for r in fr.rows:
            value = getattr(getattr(r.minilm, part), metric)
            if not r.spec.factor and math.isfinite(value):
                ax.axhline(value, color=MAP_COLOURS.get(r.spec.key, "#8c564b"), linestyle=":",
                           linewidth=1.4, label=f"{r.label}, MiniLM")
        if metric == "cosine_similarity":
            ax.axhline(1.0, color=SOFTMAX_COLOUR, linewidth=0.8, label="softmax (exact)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([f"{r.num_features}\n({r.spec.factor}·d_k)" if r.spec.factor > 1
                            else f"{r.num_features}\n(d_k)" for r in fr.convergence], fontsize=8)
        ax.set_xlabel(f"number of random features m (d_k = {fr.quality.d_k}, "
                      f"seed {fr.quality.seed})")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7.5, loc="best")
    return to_png(fig)


def section(page):
    """The :class:`Frontier` and its figures; None without frontier quality."""
    fq = page.quality and page.quality.frontier
    if fq is None:
        return None
    fr = frontier(fq, page.curves)
    return {"f": fr, "cost_ns": COST_NS, "chart": data_uri(frontier_figure(fr)),
            "convergence": data_uri(convergence_figure(fr)),
            "heatmaps": data_uri(weights_figure(fq.head.title, [("softmax", fq.head.softmax)]
                                                + list(fq.head.maps)))}
