"""How far linear attention lands from softmax attention, by feature map: the quality
the report shows, computed here (never timed) from :mod:`fastattn.compare`'s metrics.

* :func:`compute_quality`: elu+1 against softmax on the seed experiment, on its
  Gaussian generator at a few n and on all-MiniLM-L6-v2's activations layer by
  layer, the weights of two heads, and :func:`compute_frontier_quality`;
* :func:`compute_frontier_quality`: every feature map (:data:`MAPS`: FAVOR+ at
  ``m = factor · d_k``, then every other map of :data:`fastattn.feature_maps.NAMES`)
  by :func:`fastattn.compare.quality` (outputs) and
  :func:`fastattn.compare.weight_quality` (rows of weights), on Gaussian inputs
  and on MiniLM layer by layer.
"""

import os
from collections import namedtuple
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from ._api import attention_weights, linear_attention, softmax_attention
from .bench.schema import FAVOR_MULTIPLES
from .compare import compare, quality, row_entropy, seed_inputs, weight_quality
from .data import load_minilm, minilm_provenance
from .feature_maps import NAMES, FavorFeatures, feature_dim

#: Sequence lengths of the Gaussian rows (inputs as in the seed experiment, d = 32).
GAUSSIAN_NS = (64, 128, 512, 1024)
#: Head dimension of the Gaussian rows: MiniLM's, so the two tables compare like with like.
GAUSSIAN_D = 32
SEED = 42
#: The full MiniLM set, preferred over the shipped slice when found.
FULL_MINILM_FILE = "minilm_l6_qkv_n512.npz"
#: Seed of FAVOR+'s random features (``FavorFeatures(..., random_state=FAVOR_SEED)``).
FAVOR_SEED = 0
#: The row metrics take every ``n // ROW_SAMPLE``-th query of a head (all of them up to
#: n = ROW_SAMPLE): each row is exact, and the n x n weights stay cheap.
ROW_SAMPLE = 64
#: Sequence length of the frontier's Gaussian case (the seed experiment's generator).
GAUSSIAN_N = 512
#: Page labels of the maps whose name is not label enough.
LABELS = {"favor": "FAVOR+", "taylor": "Taylor (2nd order)", "elu": "elu+1"}


def find_minilm(start=None):
    """The full MiniLM file in ``$FASTATTN_MINILM_DIR``, or in ``shared/data/minilm`` in
    ``start`` (default the current directory), fastattn's source folder or a parent; or None."""
    candidates = [Path(os.environ["FASTATTN_MINILM_DIR"])] \
        if os.environ.get("FASTATTN_MINILM_DIR") else []
    bases = (Path(start or Path.cwd()).resolve(), Path(__file__).resolve().parent)
    candidates += [parent / "shared" / "data" / "minilm"
                   for base in bases for parent in (base, *base.parents)]
    return next((d / FULL_MINILM_FILE for d in candidates if (d / FULL_MINILM_FILE).is_file()),
                None)


def mean_of(items):
    """The field-wise mean of dataclasses of one type (e.g. one map's layers of MiniLM)."""
    return type(items[0])(*(float(np.mean([getattr(x, f.name) for x in items]))
                            for f in fields(items[0])))


# ------------------------------------------------------------------ the maps
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
        return feature_dim(self.feature_map, d_k, self.factor and self.factor * d_k)

    def argument(self, d_k):
        """The ``feature_map=`` argument of the API for inputs of key dimension ``d_k``."""
        if self.feature_map == "favor":
            return FavorFeatures(d_k, num_features=self.num_features(d_k),
                                 random_state=FAVOR_SEED)
        return self.feature_map

    def measured_by(self, key):
        """True when a point's or curve's ``key`` (``feature_map``, ``num_features``,
        ``d_k``) is this map; a linear point without ``feature_map`` is elu."""
        if (key.get("feature_map") or "elu") != self.feature_map:
            return False
        return self.factor is None or key.get("num_features") == self.factor * key.get("d_k")


def favor_spec(factor):
    """The :class:`MapSpec` of FAVOR+ at ``m = factor · d_k``."""
    return MapSpec(f"favor-{factor}", f"FAVOR+ m = {'' if factor == 1 else f'{factor}·'}d_k",
                   "favor", factor)


#: The maps of the frontier, in the order of the page: FAVOR+ at each
#: :data:`~fastattn.bench.schema.FAVOR_MULTIPLES`, then the other maps of NAMES, those
#: that approximate exp (D ≠ d_k) before the elementwise ones.
MAPS = tuple(favor_spec(f) for f in FAVOR_MULTIPLES) + tuple(
    MapSpec(name, LABELS.get(name, name), name)
    for name in sorted((n for n in NAMES if n != "favor"), key=lambda n: feature_dim(n, 64) == 64))


# --------------------------------------------------------------- the frontier
#: A map's quality on one input set: ``output`` (:class:`fastattn.compare.Quality`) and
#: ``rows`` (:class:`fastattn.compare.WeightQuality`, the reference being softmax's rows).
MapQuality = namedtuple("MapQuality", "output rows")


def mean_quality(items):
    """The :class:`MapQuality` whose metrics are the means of ``items`` (layers equal in rows)."""
    return MapQuality(mean_of([m.output for m in items]), mean_of([m.rows for m in items]))


class _Reference:
    """Softmax attention on one input set, computed once and shared by every map: the output
    over every query, the weights over every ``stride``-th query only (each row is exact)."""

    def __init__(self, q, k, v):
        self.q, self.k, self.v = q, k, v
        self.rows = q[..., ::max(1, q.shape[-2] // ROW_SAMPLE), :]
        self.output = softmax_attention(q, k, v, backend="reference")
        self.weights = attention_weights(self.rows, k, kind="softmax")

    def metrics(self, feature_map):
        """A map's :class:`MapQuality` against this reference."""
        out = linear_attention(self.q, self.k, self.v, feature_map=feature_map,
                               backend="reference")
        weights = attention_weights(self.rows, self.k, kind="linear", feature_map=feature_map)
        return MapQuality(quality(self.output, out), weight_quality(self.weights, weights))


#: One real head's weights: softmax's ``(n, n)`` and ``maps``, ``(label, (n, n))`` per map.
HeadWeights = namedtuple("HeadWeights", "title softmax maps")


@dataclass
class FrontierQuality:
    """What :func:`compute_frontier_quality` computes (no timing in it).

    Attributes
    ----------
    d_k : int
        Key dimension of the quality inputs (MiniLM's head dimension).
    gaussian : dict of str to MapQuality
        Per :attr:`MapSpec.key` of :data:`MAPS`.
    minilm : dict of str to list of MapQuality
        The same per layer of MiniLM (each over all its heads and sampled rows).
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
    (``1e-6``; 0 for FAVOR+); FAVOR+ with ``random_state = FAVOR_SEED``.
    Output metrics over every query; row metrics over every ``n // ROW_SAMPLE``-th
    query of each head against all keys.  Each layer's softmax attention is
    computed once and shared by every map.  Work
    ``O(layers · heads · n · ROW_SAMPLE · Σ D)``, memory
    ``O(heads · n · (ROW_SAMPLE + D))``.
    """
    d = minilm["q"].shape[-1]
    arguments = {s.key: s.argument(d) for s in MAPS}
    ref = _Reference(*gaussian)
    gaussian_metrics = {s.key: ref.metrics(arguments[s.key]) for s in MAPS}
    per_layer = {s.key: [] for s in MAPS}
    for layer in range(minilm["q"].shape[0]):
        ref = _Reference(minilm["q"][layer], minilm["k"][layer], minilm["v"][layer])
        for s in MAPS:
            per_layer[s.key].append(ref.metrics(arguments[s.key]))
    layer, h, title = head
    qh, kh = minilm["q"][layer, h], minilm["k"][layer, h]
    weights = HeadWeights(title, attention_weights(qh, kh, kind="softmax"),
                          [(m.label, attention_weights(qh, kh, kind="linear",
                                                       feature_map=arguments[m.key]))
                           for m in MAPS])
    return FrontierQuality(d, gaussian_metrics, per_layer, weights, len(gaussian[0]),
                           FAVOR_SEED, tuple(minilm["q"].shape))


# ---------------------------------------------------------- the quality study
@dataclass
class QualityRow:
    """Linear against softmax attention on one input set (see :class:`fastattn.Quality`);
    ``cos_min``, ``cos_max``: the smallest and largest per-head cosine similarity (MiniLM)."""

    label: str
    n: int
    d: int
    cosine_similarity: float
    mse: float
    magnitude_ratio: float
    cos_min: float = float("nan")
    cos_max: float = float("nan")
    heads: int = 1


def _row(label, n, d, q, *rest):
    return QualityRow(label, n, d, q.cosine_similarity, q.mse, q.magnitude_ratio, *rest)


#: The softmax and linear ``(n_q, n_k)`` weight matrices of one head, for a heatmap pair.
Heatmap = namedtuple("Heatmap", "title softmax linear note", defaults=("",))


@dataclass
class QualityResults:
    """Everything the quality section shows."""

    seed: QualityRow
    gaussian: list
    minilm: list
    minilm_source: str
    minilm_full: bool
    heatmaps: list = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    frontier: FrontierQuality = None


def compute_quality(minilm_path="auto"):
    """The quality section's :class:`QualityResults`.

    Parameters
    ----------
    minilm_path : path, "auto" or None
        MiniLM activations; ``"auto"``: :func:`find_minilm`, else the shipped
        slice; None: the slice.

    Returns
    -------
    QualityResults
        Rows of ``fastattn.compare(64, 32, seed=42)``, of its generator at
        :data:`GAUSSIAN_NS` and of each MiniLM layer (per-head cosine range);
        heatmaps of the seed case and of the head with the lowest mean softmax
        row entropy (:func:`fastattn.compare.row_entropy`); ``frontier``: every
        feature map on the same MiniLM arrays and on a Gaussian case
        (:func:`compute_frontier_quality`).

    Notes
    -----
    Float32 reference calls on one BLAS thread (restored afterwards: these are
    many small products, which a second thread only slows), ``O(heads n²)``
    memory.
    """
    with threadpool_limits(limits=1):
        return _compute_quality(minilm_path)


def _compute_quality(minilm_path):
    seed_cmp = compare(64, GAUSSIAN_D, seed=SEED)
    heatmaps = [Heatmap(
        f"Gaussian inputs (seed experiment: n = 64, d = {GAUSSIAN_D}, seed {SEED})",
        seed_cmp.softmax_weights, seed_cmp.linear_weights)]
    gaussian = []
    for n in GAUSSIAN_NS:
        q, k, v = seed_inputs(n, GAUSSIAN_D, SEED)
        gaussian.append(_row(f"Gaussian n={n}", n, GAUSSIAN_D, quality(
            softmax_attention(q, k, v, backend="reference"),
            linear_attention(q, k, v, backend="reference"))))

    if minilm_path == "auto":
        minilm_path = find_minilm()
    data = load_minilm(minilm_path)
    layers, heads, n, d = data["q"].shape
    shape = f"({layers} layers × {heads} heads, n = {n}, d = {d})"
    source = (f"full set {Path(minilm_path)} {shape}" if minilm_path is not None else
              f"slice shipped with fastattn {shape}; the full set (../shared/data/minilm) was "
              "not found")
    try:
        provenance = minilm_provenance()
    except (OSError, ValueError):
        provenance = {}

    minilm, best = [], None
    for layer in range(layers):
        ql, kl, vl = data["q"][layer], data["k"][layer], data["v"][layer]
        weights = attention_weights(ql, kl, kind="softmax")   # (heads, n, n)
        soft = np.matmul(weights, vl)                          # softmax attention's output
        lin = linear_attention(ql, kl, vl, backend="reference")
        per_head = [quality(soft[h], lin[h]).cosine_similarity for h in range(heads)]
        minilm.append(_row(f"layer {layer}", n, d, quality(soft, lin), min(per_head),
                           max(per_head), heads))
        entropy = row_entropy(weights).mean(axis=-1)           # nats, per head
        h = int(np.argmin(entropy))
        if best is None or entropy[h] < best[0]:
            best = (float(entropy[h]), layer, h)

    _, layer, h = best
    qh, kh = data["q"][layer, h], data["k"][layer, h]
    title = f"all-MiniLM-L6-v2 layer {layer}, head {h} (n = {n}, d = {d})"
    heatmaps.append(Heatmap(
        title, attention_weights(qh, kh, kind="softmax"), attention_weights(qh, kh, kind="linear"),
        note=(f"the head with the most concentrated softmax attention of the {layers * heads} "
              f"loaded (mean row entropy {best[0]:.2f} nats; uniform would be "
              f"{np.log(n):.2f})")))
    return QualityResults(
        _row("seed experiment", 64, GAUSSIAN_D, seed_cmp.quality), gaussian, minilm, source,
        minilm_path is not None, heatmaps, provenance,
        compute_frontier_quality(data, seed_inputs(GAUSSIAN_N, d, SEED), (layer, h, title)))
