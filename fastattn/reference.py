"""NumPy reference kernels: the specification every fast backend is held to.

These functions take already validated arrays (see :mod:`fastattn._checks`):
``q (B, n_q, d_k)``, ``k (B, n_k, d_k)``, ``v (B, n_k, d_v)`` of one float
dtype, C-contiguous, with every size at least 1.  They favour being obviously
right over being fast: softmax attention materialises the ``n_q x n_k`` score
matrix, and causal linear attention its masked ``n_q x n_k`` kernel matrix.

The causal mask is aligned at the bottom right: query ``i`` sees key ``j``
when ``j <= i + (n_k - n_q)``.  A product with a masked entry never touches
the value behind it, so a NaN or inf in a key or value only reaches the rows
that see it.
"""

import math
import os

import numpy as np

from . import _overflow

#: Elementwise feature maps of linear attention, by name.  ``elu`` is
#: ``elu(x) + 1`` (Katharopoulos et al. 2020), which is positive for every
#: finite input; ``relu`` is ``max(x, 0)``.  The kernels also take
#: ``"identity"``: the inputs are already features (FAVOR+, Taylor, a user's
#: map; see :mod:`fastattn.feature_maps`).
FEATURE_MAPS = ("elu", "relu")

#: Backends that compute attention without any n_q x n_k array.
TILED_BACKENDS = ("numba", "cython")


def feature_map(x, name):
    """Apply the linear-attention feature map ``name`` to ``x`` elementwise.

    Parameters
    ----------
    x : ndarray of float32 or float64
    name : {"elu", "relu", "identity"}
        ``"elu"`` is ``elu(x) + 1`` (``x + 1`` for ``x > 0``, ``exp(x)``
        otherwise; strictly positive unless ``exp`` underflows), ``"relu"`` is
        ``max(x, 0)``, ``"identity"`` is ``x`` itself (features computed
        beforehand).

    Returns
    -------
    ndarray of the same shape and dtype as ``x``.
    """
    if name == "identity":
        return x
    if name == "elu":
        # exp is only evaluated where it is used, so large x raises no warning.
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    if name == "relu":
        return np.maximum(x, 0)
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {name!r}")


def favor_query_features(x, w, key_shift):
    """FAVOR+ query features ``exp(x w + c − max_r (x w + c)_r) / √m``, one shift per row.

    ``x (B, n, d_k)``, ``w = (ω / d_k^¼)ᵀ (d_k, m)`` of ``x``'s dtype, and
    ``key_shift = c (B, m)`` float64, the keys' frame of each feature (from
    :func:`favor_key_features`).  Moving ``c_r`` from the key features to the
    query features leaves every product ``φ(q)·φ(k)`` unchanged, and makes
    the row's largest term ``1/m``: its denominator cannot underflow.  The
    row's largest feature is ``1/√m``; ``‖x'‖²/2``, constant along the row,
    is part of the shift.  Choromanski et al. (2021); see
    :class:`fastattn.FavorFeatures`.
    """
    e = x @ w
    e += key_shift.astype(e.dtype)[:, None, :]
    e -= e.max(axis=-1, keepdims=True)
    e -= 0.5 * math.log(w.shape[1])
    return np.exp(e, out=e)


def favor_key_features(x, w):
    """FAVOR+ key features ``exp(x w − ‖x‖²/(2√d_k) − c_br) / √m`` and the shifts ``c (B, m)``.

    ``c_br`` is the largest exponent of feature ``r`` over the keys of head
    ``b`` (NaN ignored; 0 when none is finite), so each feature's largest
    value is ``1/√m`` and nothing overflows.  Returns ``(features (B, n, m),
    c)`` with ``c`` float64.
    """
    d_k, m = w.shape
    e = x @ w
    e -= (np.einsum("bnd,bnd->bn", x, x) / (2 * math.sqrt(d_k)))[..., None]
    with np.errstate(invalid="ignore"):
        peak = np.where(np.isnan(e), -np.inf, e).max(axis=1, initial=-np.inf)
    shift = np.where(np.isfinite(peak), peak, 0.0).astype(np.float64)
    e -= (shift + 0.5 * math.log(m)).astype(e.dtype)[:, None, :]
    return np.exp(e, out=e), shift


def taylor_features(x):
    """Second-order Taylor features ``[1, x / d_k^¼, sym(x xᵀ) / (√2 √d_k)]`` ``(B, n, D)``.

    ``sym`` is the upper triangle of ``x xᵀ`` row by row, ``x_a x_b`` for
    ``a <= b``, the off-diagonal terms times ``√2`` (they stand for both
    ``x_a x_b`` and ``x_b x_a``), so ``φ(q)·φ(k) = 1 + s + s²/2`` exactly with
    ``s = qᵀk / √d_k``.  ``D = 1 + d_k + d_k (d_k + 1) / 2``.  Based (Arora
    et al., "Simple linear attention language models balance the
    recall-throughput tradeoff", 2024).
    """
    d_k = x.shape[-1]
    a, b = np.triu_indices(d_k)
    weight = np.where(a == b, 1 / math.sqrt(2 * d_k), 1 / math.sqrt(d_k)).astype(x.dtype)
    with np.errstate(over="ignore"):   # an inf feature sends a float32 call to float64
        return np.concatenate(
            [np.ones(x.shape[:-1] + (1,), x.dtype), x * x.dtype.type(d_k ** -0.25),
             x[..., a] * x[..., b] * weight], axis=-1)


def causal_mask(n_q, n_k):
    """Boolean ``(n_q, n_k)`` mask, True where query ``i`` sees key ``j``.

    Bottom-right aligned: ``j <= i + (n_k - n_q)``.
    """
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + (n_k - n_q)


def quadratic_bytes(batch, n_q, n_k, itemsize, arrays=1):
    """Bytes of the ``arrays`` n_q x n_k intermediates a reference call holds."""
    return int(batch) * int(n_q) * int(n_k) * int(itemsize) * int(arrays)


#: Bytes below which no memory check is made: any machine has them, and
#: asking the system costs more than a small call itself.
MEMORY_CHECK_FLOOR = 1 << 20


def available_memory():
    """Bytes of memory that new allocations can take without swapping, or None if unknown.

    Linux's ``MemAvailable`` (``/proc/meminfo``, what ``psutil`` reports as
    available there); elsewhere the free physical pages (``os.sysconf``), or
    psutil when it is installed; None when none of these answers (no check is
    then made).

    Returns
    -------
    int or None
    """
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024   # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        pass
    try:
        import psutil   # not a dependency: used where it is installed and the above fail
    except ImportError:
        return None
    return psutil.virtual_memory().available


def _size_text(size):
    """Digits a reader can take in: ``1,234,567``; an absurd size in e-notation (``1.2e+19``,
    not 20 digits), also one beyond the float range (``1e+400``, from a huge int)."""
    if isinstance(size, int) and size < 10**15:
        return f"{size:,}"
    if size < 10**300:
        return f"{float(size):.3g}"
    exponent = int(math.log10(size))
    mantissa = size / 10**(exponent - 2) / 100   # int / int: exact enough, never inf
    if mantissa >= 10:
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.3g}e+{exponent}"


def check_fits_in_memory(nbytes, what, advice=None):
    """Raise MemoryError, before allocating, when ``nbytes`` exceed available RAM.

    ``what`` names the computation; ``advice`` ends the message (default: use
    a tiled backend).
    """
    if nbytes < MEMORY_CHECK_FLOOR:
        return
    available = available_memory()
    if available is not None and nbytes > available:
        if advice is None:
            advice = (f"use a tiled backend ({', '.join(repr(b) for b in TILED_BACKENDS)}), "
                      "which needs O(n d) memory")
        raise MemoryError(
            f"{what} needs {_size_text(nbytes)} bytes ({_size_text(nbytes / 2**30 if nbytes < 10**300 else nbytes // 2**30)} GiB) "
            f"but only {available:,} bytes are available; {advice}"
        )


def _masked_matmul(w, v, visible):
    """``w @ v`` where terms with ``visible[i, j]`` False are left out entirely.

    A plain matmul would form ``0 * v[j]`` for a masked term, which is NaN when
    ``v[j]`` is inf or NaN; the masked terms must not be formed at all.
    ``w`` is ``(B, n_q, n_k)`` and already zero where not visible, ``v`` is
    ``(B, n_k, d_v)``, ``visible`` is ``(n_q, n_k)`` or None (all visible).
    """
    finite = np.isfinite(v)
    if visible is None or finite.all():
        return w @ v
    out = w @ np.where(finite, v, 0)
    # Add back the non-finite values, each only into the rows that see it.
    for b, j in zip(*np.nonzero(~finite.all(axis=-1))):
        rows = np.flatnonzero(visible[:, j])
        cols = np.flatnonzero(~finite[b, j])
        out[b][np.ix_(rows, cols)] += w[b, rows, j][:, None] * v[b, j, cols][None, :]
    return out


def softmax_weights(q, k, causal, scale):
    """Softmax attention weights ``(B, n_q, n_k)``, with their visibility mask.

    ``softmax(q kᵀ · scale)`` row by row, the row maximum subtracted first so
    no finite input overflows.  Masked entries and rows that see no key are 0.
    """
    batch, n_q, _ = q.shape
    n_k = k.shape[1]
    # One float scores array, plus the boolean mask (and its negation) when causal.
    check_fits_in_memory(
        quadratic_bytes(batch, n_q, n_k, q.itemsize, arrays=1)
        + (2 * n_q * n_k if causal else 0),
        "the reference softmax attention, for its n_q x n_k intermediates,",
    )
    scores = q @ k.transpose(0, 2, 1)
    scores *= scale
    visible = causal_mask(n_q, n_k) if causal else None
    if visible is not None:
        np.copyto(scores, -np.inf, where=~visible)  # no index arrays, unlike scores[:, ~visible]
    row_max = scores.max(axis=-1, keepdims=True)
    # A row that sees no key has max -inf; shift it by 0 so it stays all zeros.
    row_max[np.isneginf(row_max)] = 0
    # In place: the scores array is the only n_q x n_k float array at any time.
    with np.errstate(invalid="ignore"):  # inf - inf where a logit is inf: NaN, as it should
        np.subtract(scores, row_max, out=scores)
    weights = np.exp(scores, out=scores)
    row_sum = weights.sum(axis=-1, keepdims=True)
    # A row that sees no key sums to 0 and is all zeros: divide it by 1.
    row_sum[row_sum == 0] = 1
    weights /= row_sum
    return weights, visible


def softmax_forward(q, k, v, causal, scale):
    """Softmax attention ``softmax(q kᵀ · scale) v`` as an explicit n_q x n_k product, a scale
    below 1 applied to ``q`` first (:func:`fastattn._overflow.kernel_query`).

    Time ``O(B n_q n_k (d_k + d_v))``, memory ``O(B n_q n_k)``.
    """
    q, scale = _overflow.kernel_query(q, scale)
    # Quiet, as the compiled backends: a float32 product that overflows here is computed
    # again in float64 by the caller (fastattn._overflow.finite_softmax).
    with np.errstate(over="ignore", invalid="ignore"):
        weights, visible = softmax_weights(q, k, causal, scale)
        return _masked_matmul(weights, v, visible)


#: Bytes of scratch a reference call holds beyond its arrays (NumPy's ufunc buffers of
#: 8,192 elements, the row maxima and sums): measured at most 84 kB with tracemalloc.
SCRATCH_BYTES = 1 << 17


def weights_bytes(batch, n_q, n_k, itemsize, causal, D=0):
    """Peak bytes of the reference's ``n_q x n_k`` weights (:func:`softmax_weights`,
    :func:`linear_weights`, as :func:`fastattn.attention_weights` runs them), measured
    with tracemalloc: the weights themselves (normalised in place), the causal mask
    and its negation (``2 · n_q · n_k`` bytes, for all heads), and for linear attention
    the features ``φ(q) (B, n_q, D)``, ``φ(k) (B, n_k, D)`` (``D = d_k`` for elu and
    relu; 0 when unknown), which are held while the weights are formed, and while
    they are formed take up to twice their size more (Taylor's products).
    """
    quadratic = quadratic_bytes(batch, n_q, n_k, itemsize) + (2 * n_q * n_k if causal else 0)
    rows = 4 * int(batch) * int(n_q) * int(itemsize)
    if not D:
        return quadratic + rows + SCRATCH_BYTES
    held = int(batch) * (int(n_q) + int(n_k)) * int(D) * int(itemsize)
    forming = held + 2 * int(batch) * max(int(n_q), int(n_k)) * int(D) * int(itemsize)
    return max(forming, held + quadratic) + rows + SCRATCH_BYTES


def causal_linear_bytes(batch, n_q, n_k, d_v, itemsize, D, elementwise):
    """Peak bytes of :func:`linear_forward` causal (the masked ``n_q x n_k`` form), features
    included, measured with tracemalloc: the kernel matrix and its mask, the features
    (``D`` of them; an elementwise map forms ``φ(q)`` and ``φ(k)`` twice, features formed
    beforehand are taken as they are), and the ``O(n · d_v + D · d_v)`` rest."""
    B, n_q, n_k, d_v, itemsize, D = (int(x) for x in (batch, n_q, n_k, d_v, itemsize, D))
    features = (2 if elementwise else 1) * B * (n_q + n_k) * D * itemsize
    rest = B * (4 * n_q * d_v + n_k * d_v + 3 * D * d_v + 4 * n_q) * itemsize
    return (weights_bytes(B, n_q, n_k, itemsize, causal=True) + features
            + (2 * B * max(n_q, n_k) * D * itemsize if not elementwise else 0) + rest)


def check_causal_linear_fits(batch, n_q, n_k, d_v, itemsize, D, elementwise=None):
    """MemoryError unless causal linear attention on the reference fits (see
    :func:`causal_linear_bytes`): made before any features are formed, so a call that
    cannot fit is refused at once (a Taylor call used to form gigabytes of features
    first).  ``D`` is 0 when not known yet (a callable's)."""
    check_fits_in_memory(
        causal_linear_bytes(batch, n_q, n_k, d_v, itemsize, D, elementwise),
        "the reference causal linear attention, for its n_q x n_k intermediates"
        + (" and its features," if D else ","),
    )


def _check_kernel_matrix_fits(q, k):
    """MemoryError unless the ``n_q x n_k`` kernel matrix (and its mask) fit."""
    check_fits_in_memory(
        quadratic_bytes(q.shape[0], q.shape[1], k.shape[1], q.itemsize, arrays=2),
        "the reference causal linear attention, for its n_q x n_k intermediates,",
    )


def linear_kernel_matrix(q, k, feature_map_name, causal):
    """``φ(q) φ(k)ᵀ`` ``(B, n_q, n_k)``, zero where masked, with the mask."""
    batch, n_q, _ = q.shape
    n_k = k.shape[1]
    _check_kernel_matrix_fits(q, k)
    kernel = feature_map(q, feature_map_name) @ feature_map(k, feature_map_name).transpose(0, 2, 1)
    visible = causal_mask(n_q, n_k) if causal else None
    if visible is not None:
        np.copyto(kernel, 0, where=~visible)
    return kernel, visible


def _normalise(numerator, denominator):
    """``numerator / denominator``, ``numerator · 0`` where the denominator is exactly 0 (0,
    or NaN for an inf), NaN where it overflowed (``x / inf`` would be a 0 that looks like an
    answer), in place: ``numerator`` is a temporary of the caller's, and an ``n_q x n_k``
    one for the weights, which no second array of that size may join."""
    zero = denominator == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        np.divide(numerator, denominator, out=numerator, where=~zero)
        if zero.any():
            np.multiply(numerator, 0, out=numerator, where=zero)
        overflowed = np.isinf(denominator)
        if overflowed.any():
            np.multiply(numerator, np.nan, out=numerator, where=overflowed)
    return numerator


def linear_forward(q, k, v, feature_map_name, causal, eps, S0=None, z0=None):
    """Linear attention ``φ(q) (S0 + φ(k)ᵀ v) / (φ(q)·(z0 + φ(k)ᵀ 1) + eps)``.

    Katharopoulos et al., "Transformers are RNNs" (ICML 2020).  Non-causal:
    two ``O(B n d_k d_v)`` products.  Causal: the masked quadratic form
    ``(φ(q) φ(k)ᵀ ⊙ M) v``, ``O(B n_q n_k d)`` time and ``O(B n_q n_k)``
    memory, kept quadratic on purpose so it is independent of the recurrent
    and chunked forms the fast kernels use.

    ``S0 (B, d_k, d_v)`` and ``z0 (B, d_k)`` are the state of keys that came
    before (seen by every query), or None for none.  Where the denominator is
    exactly 0 (``relu`` with no positive overlap and ``eps = 0``) the row is 0; where
    it overflows, NaN.
    Causal, an ``n_q x n_k`` matrix that cannot fit is refused (MemoryError)
    before any work is done.

    Returns
    -------
    out : ndarray (B, n_q, d_v)
    S : ndarray (B, d_k, d_v)
        ``S0 + φ(k)ᵀ v`` over all keys: the state to pass to the next piece.
    z : ndarray (B, d_k)
        ``z0 + Σ_j φ(k_j)``.
    """
    if causal:
        _check_kernel_matrix_fits(q, k)
    phi_q = feature_map(q, feature_map_name)
    phi_k = feature_map(k, feature_map_name)
    dtype = q.dtype
    batch, _, d_k = q.shape
    d_v = v.shape[-1]
    S0 = np.zeros((batch, d_k, d_v), dtype) if S0 is None else S0
    z0 = np.zeros((batch, d_k), dtype) if z0 is None else z0
    S = S0 + phi_k.transpose(0, 2, 1) @ v
    # Sum along a contiguous last axis: NumPy sums pairwise there, but adds
    # row after row along axis 1 (a float32 error of 4e-3 over 2^20 keys).
    z = z0 + np.ascontiguousarray(phi_k.transpose(0, 2, 1)).sum(axis=-1)
    if causal:
        kernel, visible = linear_kernel_matrix(q, k, feature_map_name, causal)
        numerator = _masked_matmul(kernel, v, visible) + phi_q @ S0
        denominator = kernel.sum(axis=-1) + (phi_q @ z0[:, :, None])[..., 0]
    else:
        numerator = phi_q @ S
        denominator = (phi_q @ z[:, :, None])[..., 0]
    out = _normalise(numerator, denominator[..., None] + eps)
    return out, S, z


def linear_weights(q, k, feature_map_name, causal, eps):
    """Linear attention weights ``(B, n_q, n_k)``: ``φ(q_i)·φ(k_j) / (Σ_j φ(q_i)·φ(k_j) + eps)``.

    Each row is what linear attention applies to ``v``; it sums to just under
    1 (because of ``eps``), and is 0 where masked.
    """
    kernel, _ = linear_kernel_matrix(q, k, feature_map_name, causal)
    return _normalise(kernel, kernel.sum(axis=-1, keepdims=True) + eps)


def default_scale(d_k):
    """``1 / sqrt(d_k)``, the scale of Vaswani et al. (2017)."""
    return 1.0 / math.sqrt(d_k)
