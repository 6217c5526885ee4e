"""How far linear attention's output lands from softmax attention's.

Metrics on two outputs of shape ``(..., n, d_v)``, taken over the rows (one
row per query):

* cosine similarity, the mean over rows of ``cos(out_softmax_i, out_linear_i)``;
* mean squared error, the mean over all elements of ``(out_linear - out_softmax)²``;
* magnitude ratio, ``‖out_linear‖_F / ‖out_softmax‖_F``.

Metrics on two weight matrices of shape ``(..., n_q, n_k)`` (what each
attention applies to ``v``, from :func:`fastattn.attention_weights`), row by
row, each row normalised to a distribution over the keys:

* KL divergence of the approximation's row from the reference's,
  ``KL(P_i ‖ Q_i) = Σ_j P_ij ln(P_ij / Q_ij)`` in nats (:func:`row_kl_divergence`);
* entropy of each row, ``H(P_i) = −Σ_j P_ij ln P_ij`` in nats
  (:func:`row_entropy`), of the approximation against the reference's.
"""

from dataclasses import dataclass

import numpy as np

from . import reference
from ._api import attention_weights, linear_attention, softmax_attention


@dataclass(frozen=True)
class Quality:
    """Output quality of an approximation against a reference output.

    Attributes
    ----------
    cosine_similarity : float
        Mean over rows of the cosine similarity (1 is identical direction).
        A row where either output is all zeros counts as 0.
    mse : float
        Mean squared error over all elements.
    magnitude_ratio : float
        Frobenius norm of the approximation over that of the reference.
    """

    cosine_similarity: float
    mse: float
    magnitude_ratio: float

    def format(self):
        """One line: cosine similarity and magnitude ratio to 4, MSE to 6 significant places."""
        return (
            f"cosine similarity {self.cosine_similarity:.4g}  "
            f"MSE {self.mse:.6g}  "
            f"magnitude ratio {self.magnitude_ratio:.4g}"
        )


def quality(reference_out, approx_out):
    """Cosine similarity, MSE and magnitude ratio of ``approx_out`` against ``reference_out``.

    Parameters
    ----------
    reference_out : ndarray of shape (..., n, d_v)
        Usually softmax attention's output.
    approx_out : ndarray of the same shape
        Usually linear attention's output.

    Returns
    -------
    Quality
        Computed in float64.  A NaN or inf in either output makes the metrics
        it reaches NaN (or inf), never a finite number; a row that is all
        zeros has cosine similarity 0; a zero reference gives ratio inf.

    Raises
    ------
    TypeError
        If an output is not real-valued (complex, object, bool).
    ValueError
        If an output is 0-d or the shapes differ.
    """
    arrays = []
    for x, name in ((reference_out, "reference_out"), (approx_out, "approx_out")):
        x = np.asarray(x)
        if x.dtype.kind not in "fiu":
            raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
        if x.ndim < 1:
            raise ValueError(f"{name} must have at least 1 dimension (..., d_v), got shape {x.shape}")
        arrays.append(x.astype(np.float64))
    a, b = arrays
    if a.shape != b.shape:
        raise ValueError(
            f"reference_out and approx_out must have the same shape, got {a.shape} and {b.shape}"
        )
    if a.size == 0:
        return Quality(float("nan"), float("nan"), float("nan"))
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    dots = np.sum(a * b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # A zero row has no direction (0); a row with NaN or inf stays NaN.
        cos = np.where(norms == 0, 0.0, dots / norms)
        ref_norm = np.linalg.norm(a)
        ratio = np.linalg.norm(b) / ref_norm if ref_norm != 0 else float("inf")
    return Quality(
        cosine_similarity=float(np.mean(cos)),
        mse=float(np.mean((b - a) ** 2)),
        magnitude_ratio=float(ratio),
    )


def _weight_rows(x, name):
    """``x`` as float64 rows normalised to sum 1, and the mask of rows that are distributions."""
    x = np.asarray(x)
    if x.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least 1 dimension (..., n_k), got shape {x.shape}")
    x = x.astype(np.float64)
    if (x < 0).any():
        raise ValueError(f"{name} must be non-negative attention weights; "
                         f"got {np.count_nonzero(x < 0)} negative entries (min {float(x.min()):.6g})")
    total = x.sum(axis=-1, keepdims=True)
    # A row of zeros (a query that sees no key, or relu with no overlap) is no distribution.
    valid = total[..., 0] != 0
    with np.errstate(invalid="ignore", divide="ignore"):
        rows = np.where(total != 0, x / total, np.nan)
    return rows, valid


def _check_same_shape(a, b, names):
    if np.shape(a) != np.shape(b):
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape, got "
                         f"{np.shape(a)} and {np.shape(b)}")


def row_kl_divergence(reference_weights, approx_weights):
    """KL divergence ``KL(P_i ‖ Q_i)`` of each row of ``approx_weights`` from ``reference_weights``.

    Parameters
    ----------
    reference_weights : ndarray of shape (..., n_q, n_k)
        Usually softmax attention's weights; non-negative.
    approx_weights : ndarray of the same shape
        Usually linear attention's weights; non-negative.

    Returns
    -------
    ndarray of shape (..., n_q), float64, in nats
        ``Σ_j P_ij ln(P_ij / Q_ij)`` with each row normalised to sum 1
        (``0 ln 0 = 0``).  ``inf`` where the approximation gives 0 weight to
        a key the reference weighs (or its row is all zeros); NaN where the
        reference row is all zeros (no distribution) or holds a NaN.

    Raises
    ------
    TypeError
        If the weights are not real-valued.
    ValueError
        If a matrix is 0-d, has negative entries, or the shapes differ.
    """
    _check_same_shape(reference_weights, approx_weights, ("reference_weights", "approx_weights"))
    p, p_valid = _weight_rows(reference_weights, "reference_weights")
    q, q_valid = _weight_rows(approx_weights, "approx_weights")
    q = np.where(q_valid[..., None], q, 0.0)  # an all-zero approximation puts 0 everywhere
    from scipy.special import rel_entr   # deferred: 0.1 s of import fastattn

    kl = rel_entr(p, q).sum(axis=-1)
    return np.where(p_valid, kl, np.nan)


def row_entropy(weights):
    """Entropy ``H_i = −Σ_j P_ij ln P_ij`` of each row of ``weights``, in nats.

    Parameters
    ----------
    weights : ndarray of shape (..., n_q, n_k)
        Non-negative; each row is normalised to sum 1 first.

    Returns
    -------
    ndarray of shape (..., n_q), float64
        Between 0 (all weight on one key) and ``ln n_k`` (uniform); NaN for
        a row of zeros (no distribution) or a row holding a NaN.

    Raises
    ------
    TypeError, ValueError
        As :func:`row_kl_divergence`.
    """
    p, valid = _weight_rows(weights, "weights")
    from scipy.special import entr       # deferred: 0.1 s of import fastattn

    return np.where(valid, entr(p).sum(axis=-1), np.nan)


@dataclass(frozen=True)
class WeightQuality:
    """How an approximation's attention rows differ from the reference's.

    Attributes
    ----------
    kl_divergence : float
        Mean over the reference's rows (those that are distributions) of
        :func:`row_kl_divergence`, in nats; 0 is identical, ``inf`` when a
        row gives 0 weight to a key the reference weighs.
    entropy : float
        Mean :func:`row_entropy` of the approximation's rows (those that are
        distributions), in nats.
    reference_entropy : float
        The same for the reference's rows; higher ``entropy`` means flatter
        (more uniform) rows than the reference.
    """

    kl_divergence: float
    entropy: float
    reference_entropy: float

    def format(self):
        """One line: KL divergence and both entropies, to 4 significant places."""
        return (f"row KL {self.kl_divergence:.4g} nats  row entropy {self.entropy:.4g} "
                f"(reference {self.reference_entropy:.4g}) nats")


def weight_quality(reference_weights, approx_weights):
    """Mean row KL divergence and entropies of ``approx_weights`` against ``reference_weights``.

    Parameters
    ----------
    reference_weights, approx_weights : ndarray of shape (..., n_q, n_k)
        As :func:`row_kl_divergence`.

    Returns
    -------
    WeightQuality
        Means over rows that are distributions; a NaN weight makes its
        row's metrics NaN, and the means then NaN as well.

    Raises
    ------
    TypeError, ValueError
        As :func:`row_kl_divergence`.
    """
    kl = row_kl_divergence(reference_weights, approx_weights)
    _, p_valid = _weight_rows(reference_weights, "reference_weights")
    _, q_valid = _weight_rows(approx_weights, "approx_weights")
    h_ref, h_approx = row_entropy(reference_weights), row_entropy(approx_weights)

    def mean(values, valid):
        return float(np.mean(values[valid])) if valid.any() else float("nan")

    return WeightQuality(kl_divergence=mean(kl, p_valid), entropy=mean(h_approx, q_valid),
                         reference_entropy=mean(h_ref, p_valid))


@dataclass(frozen=True)
class Comparison:
    """Softmax against linear attention on one set of q, k, v.

    Attributes
    ----------
    quality : Quality
        Linear attention's output measured against softmax attention's.
    softmax_output, linear_output : ndarray of shape (..., n_q, d_v)
    softmax_weights, linear_weights : ndarray of shape (..., n_q, n_k)
        The weight matrices each mechanism applies to ``v``.
    weight_quality : WeightQuality
        Linear attention's rows of weights against softmax attention's.
    """

    quality: Quality
    softmax_output: np.ndarray
    linear_output: np.ndarray
    softmax_weights: np.ndarray
    linear_weights: np.ndarray
    weight_quality: WeightQuality = None


def compare_attention(q, k, v, *, causal=False, scale=None, feature_map="elu", eps=None,
                      backend="auto"):
    """Compare linear attention with softmax attention on the given q, k, v.

    Parameters
    ----------
    q, k, v : ndarray
        As for :func:`fastattn.softmax_attention` (any leading dims).
    causal, scale, feature_map, eps, backend
        Passed to :func:`fastattn.softmax_attention` (``scale``) and
        :func:`fastattn.linear_attention` (``feature_map``, ``eps``; its
        default ``eps=None`` is 0 for FAVOR+, else ``1e-6``).

    Returns
    -------
    Comparison
        The weights come from :func:`fastattn.attention_weights` and take
        ``O(n_q · n_k)`` memory; ``.weight_quality`` compares their rows.

    Raises
    ------
    TypeError, ValueError, MemoryError
        As the attention functions.
    """
    soft = softmax_attention(q, k, v, causal=causal, scale=scale, backend=backend)
    lin = linear_attention(q, k, v, feature_map=feature_map, causal=causal, eps=eps,
                           backend=backend)
    soft_w = attention_weights(q, k, kind="softmax", causal=causal, scale=scale)
    lin_w = attention_weights(q, k, kind="linear", causal=causal, feature_map=feature_map, eps=eps)
    return Comparison(
        quality=quality(soft, lin),
        softmax_output=soft,
        linear_output=lin,
        softmax_weights=soft_w,
        linear_weights=lin_w,
        weight_quality=weight_quality(soft_w, lin_w),
    )


#: Peak bytes of :func:`compare` per score (``n x n`` element), measured with tracemalloc:
#: the two float32 weight matrices it returns (8) and :func:`weight_quality`'s float64
#: rows, ``np.where`` and ``rel_entr`` temporaries (about 32); 40.2-42.8 for n >= 256.
COMPARE_BYTES_PER_SCORE = 41


def seed_experiment_bytes(n, d, per_score):
    """Bytes the seed experiment needs at ``n``, ``d``: one input's float64 draws, the three
    float32 inputs and the outputs (about ``28 n d``), and, when it compares (``per_score``
    bytes per element of its ``n x n`` arrays; 0: none are formed), linear attention's
    ``d x d`` state and its product."""
    return n * d * 28 + (per_score * n * n + 8 * d * d + 2**17 if per_score else 0)


def _check_seed_experiment(n, d, seed, per_score):
    """Validate the seed experiment's arguments; MemoryError if it cannot fit."""
    for value, name in ((n, "n"), (d, "d"), (seed, "seed")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    for value, name in ((n, "n"), (d, "d")):
        if value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int from 0 to 2**32 - 1, got {seed!r}")
    n, d = int(n), int(d)
    reference.check_fits_in_memory(
        seed_experiment_bytes(n, d, per_score), f"the seed experiment with n={n}, d={d}",
        advice="choose a smaller n" + (" (it holds n x n weight matrices)" if per_score else "")
        + " or d",
    )


def gaussian_qkv(shape_q, n_k=None, d_v=None, dtype=np.float64, seed=0, scale=1.0):
    """Seeded Gaussian ``q, k, v``: the one input factory of fastattn's experiments,
    tests, bench and benchmarks.

    Parameters
    ----------
    shape_q : tuple of int
        ``(..., n_q, d_k)``, the shape of ``q``.
    n_k, d_v : int, optional
        Default ``n_q`` and ``d_k``; ``k`` is ``(..., n_k, d_k)``, ``v`` ``(..., n_k, d_v)``.
    dtype : dtype, default float64
    seed : int or sequence of int
        Seed of ``numpy.random.RandomState`` (the stream ``np.random.seed``
        gives); NumPy's global random state is not touched.
    scale : float, default 1.0
        Multiplies ``q`` and ``k`` (not ``v``).

    Returns
    -------
    q, k, v : ndarray of ``dtype``
        Drawn in float64 in the order q, k, v, scaled, then rounded to
        ``dtype``, so every dtype holds the same numbers.
    """
    rng = np.random.RandomState(seed)
    *lead, n_q, d_k = shape_q
    n_k = n_q if n_k is None else n_k
    d_v = d_k if d_v is None else d_v
    q = rng.standard_normal((*lead, n_q, d_k)) * scale
    k = rng.standard_normal((*lead, n_k, d_k)) * scale
    v = rng.standard_normal((*lead, n_k, d_v))
    return tuple(np.ascontiguousarray(x, dtype=dtype) for x in (q, k, v))


def seed_inputs(n, d, seed=42):
    """The seed experiment's inputs: ``(q, k, v)``, each float32 of shape ``(n, d)``.

    The numbers of ``np.random.seed(seed)``, then ``q = randn(n, d) * 0.5``,
    ``k`` the same, ``v = randn(n, d)``, in float32 (:func:`gaussian_qkv`).

    Raises
    ------
    TypeError, ValueError
        For a bad ``n``, ``d`` or ``seed``, as :func:`compare` does.
    MemoryError
        Before drawing, when the inputs cannot fit, as :func:`compare` does.
    """
    _check_seed_experiment(n, d, seed, per_score=0)
    return gaussian_qkv((n, d), dtype=np.float32, seed=seed, scale=0.5)


def compare(n=64, d=32, seed=42):
    """The seed experiment: softmax against elu+1 linear attention on Gaussian inputs.

    Inputs from :func:`seed_inputs`; softmax attention with scale
    ``1/sqrt(d)``; linear attention with ``φ = elu + 1``, unscaled, ``eps = 1e-6``;
    both non-causal, computed by the NumPy reference.

    Parameters
    ----------
    n : int, default 64
        Sequence length.
    d : int, default 32
        Head dimension (``d_k = d_v = d``).
    seed : int, default 42

    Returns
    -------
    Comparison
        ``.quality`` holds the mean cosine similarity, MSE and magnitude
        ratio; ``.softmax_weights`` and ``.linear_weights`` are ``(n, n)``.

    Raises
    ------
    TypeError
        If ``n``, ``d`` or ``seed`` is not an int (a bool is not).
    ValueError
        If ``n`` or ``d`` is below 1, or ``seed`` not from 0 to ``2**32 - 1``.
    MemoryError
        Before any work, when the inputs, the ``n x n`` weight matrices and
        the metrics' temporaries (about ``41 n²`` bytes) cannot fit in the available memory; the
        message names ``n`` and ``d`` and the bytes needed.
    """
    _check_seed_experiment(n, d, seed, per_score=COMPARE_BYTES_PER_SCORE)
    q, k, v = seed_inputs(n, d, seed)
    return compare_attention(q, k, v, backend="reference")
