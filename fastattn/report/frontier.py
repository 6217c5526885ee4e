"""The feature-map frontier: what a better approximation of softmax costs (issue 13).

For each feature map of linear attention (FAVOR+ at ``m = d_k, 4·d_k, 16·d_k,
64·d_k``, Taylor, elu+1, relu) the report sets its quality against its cost:

* **quality**, computed (never timed) in the report's quality step by
  :func:`compute_frontier_quality`: on Gaussian inputs and on the real MiniLM
  activations layer by layer, the output metrics of :func:`fastattn.compare.quality`
  (cosine similarity, MSE, magnitude ratio) and the attention-row metrics of
  :mod:`fastattn.compare` (KL divergence of each row of weights from
  softmax's, entropy of the rows against softmax's), FAVOR+ with a fixed seed
  (:data:`FAVOR_SEED`);
* **cost**, read by :func:`frontier` from the measured points of the results
  file (records carrying ``feature_map`` and ``num_features``): time per call
  at :data:`COST_NS`, the state's bytes and the crossover length against
  softmax attention.  A map without a measured point says so; nothing is
  estimated in its place.

As in the rest of the report, the analysis returns finished, labelled objects
(:class:`Frontier`), the figures only draw them, and the page
(``templates/_frontier.html.j2``) only fills them in.
"""

import math
from dataclasses import dataclass, field, fields

import numpy as np

from .. import FavorFeatures, attention_weights, linear_attention, softmax_attention
from ..bench.schema import FAVOR_MULTIPLES, FEATURE_MAP_NS
from ..bench.table import format_bytes, format_seconds
from ..compare import quality, row_entropy, row_kl_divergence
from ..feature_maps import taylor_num_features
from .analysis import crossover, envelope
from .figures import data_uri, to_png

import matplotlib.pyplot as plt  # noqa: E402  (after .figures, which selects the Agg backend)
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

#: Seed of FAVOR+'s random features (``FavorFeatures(..., random_state=FAVOR_SEED)``).
FAVOR_SEED = 0
#: FAVOR+ on the frontier: ``m = factor · d_k``.
FAVOR_FACTORS = FAVOR_MULTIPLES
#: FAVOR+ convergence: ``m = factor · d_k`` (the frontier's, so nothing is computed twice).
CONVERGENCE_FACTORS = FAVOR_FACTORS
#: The row metrics (KL, entropy) take every ``n // ROW_SAMPLE``-th query of a head (all of
#: them up to n = ROW_SAMPLE): each row is exact, and the n x n weights stay cheap.
ROW_SAMPLE = 64
#: Sequence lengths whose measured time per call the frontier shows.
COST_NS = FEATURE_MAP_NS
#: Sequence length of the Gaussian quality case (the seed experiment's generator).
GAUSSIAN_N = 512


@dataclass(frozen=True)
class MapSpec:
    """One feature map of the frontier.

    Attributes
    ----------
    key : str
        ``"favor-16"``, ``"taylor"``, ``"elu"``, ``"relu"``.
    label : str
        For the page, e.g. ``"FAVOR+ m = 16·d_k"``.
    feature_map : str
        The name a results record carries in ``feature_map``.
    factor : int or None
        FAVOR+'s ``m / d_k``; None for the other maps.
    """

    key: str
    label: str
    feature_map: str
    factor: int | None = None

    def num_features(self, d_k):
        """The feature dimension ``D`` at key dimension ``d_k``."""
        if self.feature_map == "favor":
            return self.factor * d_k
        return taylor_num_features(d_k) if self.feature_map == "taylor" else d_k

    def argument(self, d_k):
        """The ``feature_map=`` argument of the API for inputs of key dimension ``d_k``."""
        if self.feature_map == "favor":
            return FavorFeatures(d_k, num_features=self.num_features(d_k),
                                 random_state=FAVOR_SEED)
        return self.feature_map

    def measured_by(self, key):
        """True when a curve's key (``feature_map``, ``num_features``, ``d_k``) is this map."""
        name = key.get("feature_map") or "elu"   # linear points before feature maps: elu
        if name != self.feature_map:
            return False
        if self.feature_map == "favor":
            return key.get("num_features") == self.factor * key.get("d_k")
        return True


def favor_spec(factor):
    """The :class:`MapSpec` of FAVOR+ at ``m = factor · d_k``."""
    multiple = "d_k" if factor == 1 else f"{factor}·d_k"
    return MapSpec(f"favor-{factor}", f"FAVOR+ m = {multiple}", "favor", factor)


#: The maps of the frontier, in the order of the page.
MAPS = tuple(favor_spec(f) for f in FAVOR_FACTORS) + (
    MapSpec("taylor", "Taylor (2nd order)", "taylor"), MapSpec("elu", "elu+1", "elu"),
    MapSpec("relu", "relu", "relu"))


# ------------------------------------------------------------------ quality
@dataclass(frozen=True)
class Metrics:
    """A map's output and attention-row metrics against softmax attention on one input set.

    Attributes
    ----------
    cosine_similarity, mse, magnitude_ratio : float
        Of the outputs (:class:`fastattn.Quality`).
    kl_divergence : float
        Mean over rows of ``KL(softmax row ‖ map row)``, nats
        (:func:`fastattn.compare.row_kl_divergence`); inf when some row gives 0
        weight to a key softmax weighs (relu does).
    entropy, softmax_entropy : float
        Mean row entropy of the map's weights and of softmax's, nats
        (:func:`fastattn.compare.row_entropy`).
    """

    cosine_similarity: float
    mse: float
    magnitude_ratio: float
    kl_divergence: float
    entropy: float
    softmax_entropy: float

    @property
    def kl_text(self):
        """The row KL divergence for the page: 3 decimals, ``"∞"`` when infinite."""
        return "∞" if math.isinf(self.kl_divergence) else f"{self.kl_divergence:.3f}"

    @classmethod
    def mean(cls, items):
        """The field-wise mean of several (e.g. the layers of MiniLM, equal in rows)."""
        return cls(*(float(np.mean([getattr(m, f.name) for m in items])) for f in fields(cls)))


def _nanmean(values):
    values = values[~np.isnan(values)]  # a NaN row is no distribution (it sees no weight)
    return float(np.mean(values)) if values.size else float("nan")


class _Reference:
    """Softmax attention on one input set, computed once and shared by every map.

    The output over every query; the weights (and their row entropy) over
    every ``stride``-th query only, against every key: a row of weights
    depends on its own query alone, so each sampled row is exact.
    """

    def __init__(self, q, k, v):
        self.q, self.k, self.v = q, k, v
        self.stride = max(1, q.shape[-2] // ROW_SAMPLE)
        self.rows = q[..., ::self.stride, :]
        self.output = softmax_attention(q, k, v, backend="reference")
        self.weights = attention_weights(self.rows, k, kind="softmax")
        self.entropy = _nanmean(row_entropy(self.weights))

    def metrics(self, feature_map):
        """A map's :class:`Metrics` against this reference."""
        out = linear_attention(self.q, self.k, self.v, feature_map=feature_map,
                               backend="reference")
        weights = attention_weights(self.rows, self.k, kind="linear", feature_map=feature_map)
        q = quality(self.output, out)
        return Metrics(q.cosine_similarity, q.mse, q.magnitude_ratio,
                       _nanmean(row_kl_divergence(self.weights, weights)),
                       _nanmean(row_entropy(weights)), self.entropy)


@dataclass
class HeadWeights:
    """The weights of one real head: softmax's and each map's, for the heatmap grid."""

    title: str
    softmax: np.ndarray                          # (n, n)
    maps: list = field(default_factory=list)     # (label, (n, n) weights)


@dataclass
class FrontierQuality:
    """What :func:`compute_frontier_quality` computes (no timing in it).

    Attributes
    ----------
    d_k : int
        Key dimension of the quality inputs (MiniLM's head dimension).
    gaussian : dict of str to Metrics
        Per map key (and ``"favor-<factor>"`` for every convergence factor).
    minilm : dict of str to list of Metrics
        The same per layer of MiniLM (each over all its heads and rows).
    head : HeadWeights
    gaussian_n, seed : int
    minilm_shape : tuple
        ``(layers, heads, n, d)``.
    """

    d_k: int
    gaussian: dict
    minilm: dict
    head: HeadWeights
    gaussian_n: int
    seed: int
    minilm_shape: tuple


def compute_frontier_quality(minilm, gaussian, head):
    """Every map's quality on Gaussian inputs and on MiniLM, layer by layer.

    Parameters
    ----------
    minilm : dict
        :func:`fastattn.data.load_minilm` arrays ``q``, ``k``, ``v`` of shape
        ``(layers, heads, n, d)``.
    gaussian : (q, k, v)
        One Gaussian case of shape ``(n, d)`` with the same ``d``.
    head : (int, int, str)
        Layer, head and title of the real head whose weights the heatmaps show.

    Returns
    -------
    FrontierQuality

    Notes
    -----
    All by the NumPy reference in the inputs' dtype (float32), non-causal,
    softmax at scale ``1/√d``, linear attention with the default ``eps``
    (``1e-6``; 0 for FAVOR+, see :func:`fastattn.linear_attention`); FAVOR+
    with ``random_state = FAVOR_SEED`` at every ``m`` of
    :data:`CONVERGENCE_FACTORS`.  Output metrics over every query; row
    metrics over every ``n // ROW_SAMPLE``-th query of each head (every
    query up to ``n = ROW_SAMPLE``) against all keys.  Each layer's softmax
    attention is computed once and shared by every map.  Work
    ``O(layers · heads · n · ROW_SAMPLE · Σ D)``, memory
    ``O(heads · n · (ROW_SAMPLE + D))``.
    """
    d = minilm["q"].shape[-1]
    specs = [favor_spec(f) for f in CONVERGENCE_FACTORS] + [m for m in MAPS
                                                             if m.feature_map != "favor"]
    arguments = {s.key: s.argument(d) for s in specs}
    ref = _Reference(*gaussian)
    gaussian_metrics = {s.key: ref.metrics(arguments[s.key]) for s in specs}
    per_layer = {s.key: [] for s in specs}
    for layer in range(minilm["q"].shape[0]):
        ref = _Reference(minilm["q"][layer], minilm["k"][layer], minilm["v"][layer])
        for s in specs:
            per_layer[s.key].append(ref.metrics(arguments[s.key]))
    layer, h, title = head
    qh, kh = minilm["q"][layer, h], minilm["k"][layer, h]
    weights = HeadWeights(title, attention_weights(qh, kh, kind="softmax"),
                          [(m.label, attention_weights(qh, kh, kind="linear",
                                                       feature_map=arguments[m.key]))
                           for m in MAPS])
    return FrontierQuality(d, gaussian_metrics, per_layer, weights, len(gaussian[0]),
                           FAVOR_SEED, tuple(minilm["q"].shape))


# --------------------------------------------------------------------- cost
@dataclass(frozen=True)
class TimeAt:
    """The measured time per call of a map at one n: the fastest fastattn backend there."""

    n: int
    seconds: float | None        # None: no point measured at this n
    backend: str | None = None

    def describe(self):
        return (f"{format_seconds(self.seconds)} ({self.backend})" if self.seconds is not None
                else f"not measured at n = {self.n}")


@dataclass
class FrontierRow:
    """One map on the frontier: its quality (computed) beside its cost (measured).

    Attributes
    ----------
    spec : MapSpec
    num_features : int
        ``D`` at the quality inputs' ``d_k``.
    cost_num_features : int
        ``D`` at the measured points' ``d_k``.
    gaussian : Metrics
    minilm : Metrics
        Mean over the layers; ``minilm_layers`` holds each layer.
    minilm_layers : list of Metrics
    times : list of TimeAt
        One per :data:`COST_NS`.
    state_bytes : int
        ``(D · d_v + D) · itemsize`` per head at the measured points' shape and
        dtype: the state ``(S, z)`` causal linear attention carries.
    crossover : Crossover or None
        Against softmax attention (same setting); None without a measured point.
    measured : bool
        Whether any point of this map was measured.
    """

    spec: MapSpec
    num_features: int
    cost_num_features: int
    gaussian: Metrics
    minilm: Metrics
    minilm_layers: list
    times: list
    state_bytes: int
    crossover: object = None
    measured: bool = False

    label = property(lambda self: self.spec.label)
    state_text = property(lambda self: format_bytes(self.state_bytes))

    def time_at(self, n):
        """The :class:`TimeAt` of ``n``."""
        return next(t for t in self.times if t.n == n)


@dataclass
class Setting:
    """The configuration the costs come from (the one most feature-map points share)."""

    machine: str | None = None
    dtype: str = "float32"
    threads: int | None = None
    d_k: int = 64
    d_v: int = 64

    def describe(self):
        return (f"non-causal, d_k = {self.d_k}, d_v = {self.d_v}, {self.dtype}, "
                f"{self.threads if self.threads is not None else '?'} thread(s), batch 1, "
                "one head" + (f", machine {self.machine}" if self.machine else ""))


@dataclass
class Frontier:
    """Everything the frontier section shows: final and labelled.

    Attributes
    ----------
    rows : list of FrontierRow
        In the order of :data:`MAPS`.
    convergence : list of (int, int, Metrics, Metrics, list of Metrics)
        FAVOR+ at each :data:`CONVERGENCE_FACTORS`: factor, ``m``, Gaussian,
        MiniLM mean, MiniLM per layer.
    softmax_times : list of TimeAt
        Softmax attention in the same setting, at :data:`COST_NS`.
    setting : Setting
    quality : FrontierQuality
    missing : list of str
        Maps without any measured point.
    unmatched : list of str
        Feature-map curves measured but not on the frontier (e.g. FAVOR+ at
        another ``m``).
    headline : list of str
        Sentences quoting the per-map MiniLM cosine similarities and times.
    """

    rows: list
    convergence: list
    softmax_times: list
    setting: Setting
    quality: FrontierQuality
    missing: list
    unmatched: list
    headline: list


def _times(curve_list):
    """:class:`TimeAt` per :data:`COST_NS`: the fastest curve (``fit_s``) measured at each n."""
    out = []
    for n in COST_NS:
        best = min(((float(c.fit_s[c.n == n][0]), c.backend) for c in curve_list
                    if (c.n == n).any() and math.isfinite(c.fit_s[c.n == n][0])),
                   default=(None, None))
        out.append(TimeAt(n, *best))
    return out


def _setting(curve_list):
    """The setting most non-causal linear curves of fastattn's backends share (float32 first)."""
    linear = [c for c in curve_list if c.attention == "linear" and not c.causal and not c.peer]
    pool = linear or [c for c in curve_list if not c.causal and not c.peer]
    if not pool:
        return Setting()
    keys = [(c.machine, str(c.key.get("dtype")), c.key.get("threads"), c.key.get("d_k"),
             c.key.get("d_v")) for c in pool]
    best = max(set(keys), key=lambda k: (keys.count(k), k[1] == "float32", str(k)))
    return Setting(*best)


def _in_setting(c, setting):
    return (not c.causal and not c.peer and c.machine == setting.machine
            and str(c.key.get("dtype")) == setting.dtype
            and c.key.get("threads") == setting.threads and c.key.get("d_k") == setting.d_k
            and c.key.get("d_v") == setting.d_v and c.key.get("batch", 1) == 1
            and c.key.get("heads", 1) == 1 and c.key.get("regime") in (None, "prefill"))


def frontier(fq, curve_list):
    """The frontier of :data:`MAPS` from computed quality and measured curves.

    Parameters
    ----------
    fq : FrontierQuality
        From :func:`compute_frontier_quality`.
    curve_list : list of Curve
        :func:`fastattn.report.analysis.curves` of the results records.  Costs
        come from the non-causal curves of fastattn's backends in one
        :class:`Setting`: the one most non-causal linear curves share.

    Returns
    -------
    Frontier
        A map's time at ``n`` is the fastest repeat of the fastest fastattn
        backend measured there; its crossover compares the lower envelopes of
        its curves and of softmax's (:func:`fastattn.report.analysis.crossover`).
    """
    setting = _setting(curve_list)
    mine = [c for c in curve_list if _in_setting(c, setting)]
    softmax = [c for c in mine if c.attention == "softmax"]
    linear = [c for c in mine if c.attention == "linear"]
    itemsize = np.dtype(setting.dtype).itemsize
    rows = []
    for spec in MAPS:
        measured = [c for c in linear if spec.measured_by(c.key)]
        D = spec.num_features(setting.d_k)
        cross = (crossover(*envelope(softmax), *envelope(measured))
                 if measured and softmax else None)
        layers = fq.minilm[spec.key]
        rows.append(FrontierRow(spec, spec.num_features(fq.d_k), D, fq.gaussian[spec.key],
                                Metrics.mean(layers), layers, _times(measured),
                                (D * setting.d_v + D) * itemsize, cross, bool(measured)))
    unmatched = sorted({c.label for c in linear if not any(s.measured_by(c.key) for s in MAPS)})
    convergence = [(f, f * fq.d_k, fq.gaussian[f"favor-{f}"],
                    Metrics.mean(fq.minilm[f"favor-{f}"]), fq.minilm[f"favor-{f}"])
                   for f in CONVERGENCE_FACTORS]
    softmax_times = _times(softmax)
    result = Frontier(rows, convergence, softmax_times, setting, fq,
                      [r.label for r in rows if not r.measured], unmatched, [])
    result.headline = _headline(result)
    return result


def _headline(fr):
    """The sentences the section opens with (and the closing note can quote)."""
    n = fr.quality.minilm_shape[2]
    lines = [f"Output cosine similarity to softmax attention on the real MiniLM activations "
             f"(n = {n}, mean over layers): " + "; ".join(
                 f"{r.label} {r.minilm.cosine_similarity:.3f}" for r in fr.rows)
             + " (Gaussian inputs: " + "; ".join(
                 f"{r.label} {r.gaussian.cosine_similarity:.3f}" for r in fr.rows) + ")."]
    for n_cost in COST_NS:
        timed = [r for r in fr.rows if r.time_at(n_cost).seconds is not None]
        soft = next(t for t in fr.softmax_times if t.n == n_cost)
        if timed:
            lines.append(f"Time per call at n = {n_cost} ({fr.setting.describe()}): " + "; ".join(
                f"{r.label} {format_seconds(r.time_at(n_cost).seconds)}" for r in timed)
                + (f"; softmax {format_seconds(soft.seconds)}" if soft.seconds is not None
                   else "; softmax not measured") + ".")
    if fr.missing:
        lines.append("No measured point for " + ", ".join(fr.missing)
                     + ": their cost is not shown (no cost is estimated in its place).")
    return lines


# ------------------------------------------------------------------ figures
#: One colour per map: FAVOR+ from light to dark as m grows.
MAP_COLOURS = {"favor-1": "#c9b3e6", "favor-4": "#a27fd1", "favor-16": "#7b4bb8",
               "favor-64": "#4b1d8c", "taylor": "#2ca02c", "elu": "#1f77b4", "relu": "#ff7f0e"}
SOFTMAX_COLOUR = "#222222"


def frontier_figure(fr):
    """Quality against time per call, one point per map, a panel per n of :data:`COST_NS`.

    Filled markers: MiniLM (mean cosine similarity over layers); hollow: the
    Gaussian case, joined by a thin line.  Softmax attention (exact: 1) is
    the star.  Maps without a measured point at that n are named in the panel.

    Returns
    -------
    bytes
        The PNG.
    """
    fig, axes = plt.subplots(1, len(COST_NS), figsize=(12, 5.2), sharey=True,
                             layout="constrained")
    for ax, n in zip(np.atleast_1d(axes), COST_NS):
        missing = []
        for r in fr.rows:
            t = r.time_at(n).seconds
            if t is None:
                missing.append(r.label)
                continue
            c = MAP_COLOURS[r.spec.key]
            y, yg = r.minilm.cosine_similarity, r.gaussian.cosine_similarity
            ax.plot([t, t], [y, yg], color=c, linewidth=0.8, alpha=0.6)
            ax.plot(t, yg, "o", markerfacecolor="white", markeredgecolor=c, markersize=7)
            ax.plot(t, y, "o", color=c, markersize=8, label=r.label)
            ax.annotate(r.label, (t, y), textcoords="offset points", xytext=(6, -3),
                        fontsize=8, color=c)
        soft = next(s for s in fr.softmax_times if s.n == n)
        if soft.seconds is not None:
            ax.plot(soft.seconds, 1.0, "*", color=SOFTMAX_COLOUR, markersize=13,
                    label="softmax (exact)")
            ax.annotate("softmax", (soft.seconds, 1.0), textcoords="offset points",
                        xytext=(6, -3), fontsize=8)
        else:
            missing.append("softmax")
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
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("cosine similarity to softmax output\n(filled: MiniLM, mean over layers; "
                     "hollow: Gaussian)")
    lowest = min(min(r.minilm.cosine_similarity, r.gaussian.cosine_similarity) for r in fr.rows)
    first.set_ylim(max(0.0, lowest - 0.05), 1.02)
    return to_png(fig)


def convergence_figure(fr):
    """FAVOR+'s quality against m: output cosine similarity and row KL, with the other maps as lines.

    Returns
    -------
    bytes
        The PNG.
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    ms = np.array([m for _, m, *_ in fr.convergence])
    for ax, metric, ylabel in ((axes[0], "cosine_similarity", "output cosine similarity"),
                               (axes[1], "kl_divergence", "mean row KL(softmax ‖ map), nats")):
        minilm = np.array([getattr(mean, metric) for _, _, _, mean, _ in fr.convergence])
        layers = np.array([[getattr(x, metric) for x in per] for *_, per in fr.convergence])
        gauss = np.array([getattr(g, metric) for _, _, g, _, _ in fr.convergence])
        ax.fill_between(ms, layers.min(axis=1), layers.max(axis=1), color="#7b4bb8", alpha=0.15,
                        linewidth=0, label="MiniLM, range over layers")
        ax.plot(ms, minilm, "o-", color="#7b4bb8", label="FAVOR+, MiniLM (mean over layers)")
        ax.plot(ms, gauss, "s--", color="#7b4bb8", markerfacecolor="white",
                label="FAVOR+, Gaussian")
        for r in fr.rows:
            value = getattr(r.minilm, metric)
            if r.spec.feature_map != "favor" and math.isfinite(value):
                ax.axhline(value, color=MAP_COLOURS[r.spec.key], linestyle=":", linewidth=1.4,
                           label=f"{r.label}, MiniLM")
        if metric == "cosine_similarity":
            ax.axhline(1.0, color=SOFTMAX_COLOUR, linewidth=0.8, label="softmax (exact)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([f"{m}\n({f}·d_k)" if f > 1 else f"{m}\n(d_k)"
                            for (f, m, *_) in fr.convergence], fontsize=8)
        ax.set_xlabel(f"number of random features m (d_k = {fr.quality.d_k}, "
                      f"seed {fr.quality.seed})")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7.5, loc="best")
    return to_png(fig)


def weights_figure(head):
    """Softmax's and each map's weights of one real head, on one logarithmic colour scale.

    Returns
    -------
    bytes
        The PNG.
    """
    panels = [("softmax", head.softmax)] + list(head.maps)
    n_k = head.softmax.shape[-1]
    vmax = float(max(w.max() for _, w in panels))
    norm = LogNorm(vmin=min(0.01 / n_k, vmax / 10), vmax=vmax, clip=True)
    ncols = 4
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(12, 3.1 * nrows + 0.6),
                             layout="constrained", squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax, (label, weights) in zip(axes.ravel(), panels):
        image = ax.imshow(np.clip(weights, 0, None), cmap="magma", norm=norm,
                          interpolation="nearest")
        ax.set_title(label, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=axes, shrink=0.8, label="weight (log colour scale)")
    fig.suptitle(head.title + " — rows: queries, columns: keys", fontsize=11)
    return to_png(fig)


# --------------------------------------------------------------------- page
def section(fq, curve_list):
    """The frontier part of the page: the :class:`Frontier` and its figures as data URIs.

    Returns
    -------
    dict or None
        None when no frontier quality was computed.
    """
    if fq is None:
        return None
    fr = frontier(fq, curve_list)
    return {"f": fr, "cost_ns": COST_NS,
            "chart": data_uri(frontier_figure(fr)),
            "convergence": data_uri(convergence_figure(fr)),
            "heatmaps": data_uri(weights_figure(fq.head))}
