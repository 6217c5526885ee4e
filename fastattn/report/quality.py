"""How far linear attention's output lands from softmax's, computed (never timed) when the
report is built: the seed experiment, Gaussian inputs at a few n, all-MiniLM-L6-v2
activations per layer, and the weights of one Gaussian case and one real head."""

import os
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats
from threadpoolctl import threadpool_limits

from .. import attention_weights, linear_attention, softmax_attention
from ..compare import compare, quality, seed_inputs
from ..data import load_minilm, minilm_provenance
from .frontier import GAUSSIAN_N, compute_frontier_quality

#: Sequence lengths of the Gaussian rows (inputs as in the seed experiment, d = 32).
GAUSSIAN_NS = (64, 128, 512, 1024)
#: Head dimension of the Gaussian rows: MiniLM's, so the two tables compare like with like.
GAUSSIAN_D = 32
SEED = 42
#: The full MiniLM set, preferred over the shipped slice when found.
FULL_MINILM_FILE = "minilm_l6_qkv_n512.npz"


def find_minilm(start=None):
    """The full MiniLM file in ``$FASTATTN_MINILM_DIR``, or in ``shared/data/minilm`` in
    ``start`` (default the current directory), fastattn's source folder or a parent; or None."""
    candidates = [Path(os.environ["FASTATTN_MINILM_DIR"])] \
        if os.environ.get("FASTATTN_MINILM_DIR") else []
    bases = (Path(start or Path.cwd()).resolve(), Path(__file__).resolve().parent)
    candidates += [parent / "shared" / "data" / "minilm"
                   for base in bases for parent in (base, *base.parents)]
    for directory in candidates:
        if (directory / FULL_MINILM_FILE).is_file():
            return directory / FULL_MINILM_FILE
    return None


@dataclass
class QualityRow:
    """Linear against softmax attention on one input set (see :class:`fastattn.Quality`)."""

    label: str
    n: int
    d: int
    cosine_similarity: float
    mse: float
    magnitude_ratio: float
    cos_min: float = float("nan")   # smallest per-head cosine similarity (MiniLM)
    cos_max: float = float("nan")   # largest per-head cosine similarity (MiniLM)
    heads: int = 1


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
    frontier: object = None   # fastattn.report.frontier.FrontierQuality


# One BLAS thread: these are many small products, which a second BLAS thread slowed
# several times over on the busy 2-core development machine (one run: 53 s against 11 s).
@threadpool_limits.wrap(limits=1)
def compute_quality(minilm_path="auto"):
    """The quality section's :class:`QualityResults`, with MiniLM from ``minilm_path``
    (``"auto"``: :func:`find_minilm`, else the shipped slice; None: the slice): rows of
    ``fastattn.compare(64, 32, seed=42)``, its generator at :data:`GAUSSIAN_NS` and each
    MiniLM layer (per-head cosine range), heatmaps of the seed case and of the head with the
    lowest mean softmax row entropy, and ``frontier``: every feature map on the same MiniLM
    arrays and on a Gaussian case (:func:`~fastattn.report.frontier.compute_frontier_quality`).
    Float32 reference calls on one BLAS thread (restored afterwards), ``O(heads n²)`` memory."""
    seed_cmp = compare(64, GAUSSIAN_D, seed=SEED)
    q = seed_cmp.quality
    seed_row = QualityRow("seed experiment", 64, GAUSSIAN_D, q.cosine_similarity, q.mse,
                          q.magnitude_ratio)
    heatmaps = [Heatmap(
        f"Gaussian inputs (seed experiment: n = 64, d = {GAUSSIAN_D}, seed {SEED})",
        seed_cmp.softmax_weights, seed_cmp.linear_weights)]

    gaussian = []
    for n in GAUSSIAN_NS:
        qq, kk, vv = seed_inputs(n, GAUSSIAN_D, SEED)
        q = quality(softmax_attention(qq, kk, vv, backend="reference"),
                    linear_attention(qq, kk, vv, backend="reference"))
        gaussian.append(QualityRow(f"Gaussian n={n}", n, GAUSSIAN_D, q.cosine_similarity,
                                   q.mse, q.magnitude_ratio))

    if minilm_path == "auto":
        minilm_path = find_minilm()
    data = load_minilm(minilm_path)
    full = minilm_path is not None
    layers, heads, n, d = data["q"].shape
    shape = f"({layers} layers × {heads} heads, n = {n}, d = {d})"
    source = (f"full set {Path(minilm_path)} {shape}" if full else f"slice shipped with "
              f"fastattn {shape}; the full set (../shared/data/minilm) was not found")
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
        q = quality(soft, lin)
        per_head = [quality(soft[h], lin[h]).cosine_similarity for h in range(heads)]
        minilm.append(QualityRow(f"layer {layer}", n, d, q.cosine_similarity, q.mse,
                                 q.magnitude_ratio, min(per_head), max(per_head), heads))
        entropy = stats.entropy(weights.astype(np.float64), axis=-1).mean(axis=-1)  # nats
        h = int(np.argmin(entropy))
        if best is None or entropy[h] < best[0]:
            best = (float(entropy[h]), layer, h)

    _, layer, h = best
    qh, kh = data["q"][layer, h], data["k"][layer, h]
    head_title = f"all-MiniLM-L6-v2 layer {layer}, head {h} (n = {n}, d = {d})"
    heatmaps.append(Heatmap(
        head_title,
        attention_weights(qh, kh, kind="softmax"), attention_weights(qh, kh, kind="linear"),
        note=(f"the head with the most concentrated softmax attention of the {layers * heads} "
              f"loaded (mean row entropy {best[0]:.2f} nats; uniform would be "
              f"{np.log(n):.2f})")))
    frontier = compute_frontier_quality(data, seed_inputs(GAUSSIAN_N, d, SEED),  # MiniLM's d
                                        (layer, h, head_title))
    return QualityResults(seed_row, gaussian, minilm, source, full, heatmaps, provenance,
                          frontier)
