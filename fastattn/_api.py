"""The public attention functions: validate, choose the backend, call it.

The checks are in :mod:`fastattn._checks` (shared with :mod:`fastattn.generation`),
the backends and ``backend="auto"`` in :mod:`fastattn._backends`, the feature
maps of linear attention in :mod:`fastattn.feature_maps`.
"""

import contextlib
import math

import numpy as np

from . import _backends, _checks, _overflow, feature_maps, reference
from ._backends import (  # noqa: F401  (the registry's names, as callers know them here)
    AUTO_ORDER,
    BACKEND_MODULES,
    available_backends,
    get_backend,
    unavailable_backends,
)


def softmax_attention(q, k, v, *, causal=False, scale=None, backend="auto"):
    """Softmax (scaled dot-product) attention.

    ``out = softmax(q kᵀ · scale) v``, the softmax taken over keys with the
    row maximum subtracted first, so no finite input overflows (Vaswani et al.,
    "Attention is all you need", 2017).

    Parameters
    ----------
    q : ndarray of shape (..., n_q, d_k)
        Queries.  float16, float32 or float64, any memory layout.
    k : ndarray of shape (..., n_k, d_k)
        Keys; the leading dims ``...`` (batch, heads) equal those of ``q``.
    v : ndarray of shape (..., n_k, d_v)
        Values; ``d_v`` may differ from ``d_k``.
    causal : bool, default False
        Mask aligned at the bottom right: query ``i`` sees key ``j`` when
        ``j <= i + (n_k - n_q)``, as in a decoder with a key/value cache.
        A query that sees no key (``n_q > n_k``) gets a row of zeros.
    scale : float, optional
        Multiplies the logits; finite and > 0.  Default ``1 / sqrt(d_k)``.
    backend : {"auto", "reference", "numba", "cython"}, default "auto"
        ``"reference"`` is the NumPy specification (``O(n_q n_k)`` memory);
        ``"numba"`` and ``"cython"`` are tiled online-softmax kernels
        (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) with
        ``O(n d)`` memory.  ``"auto"`` takes the fastest available, see
        :func:`available_backends`.

    Returns
    -------
    out : ndarray of shape (..., n_q, d_v)
        float32 for float16/float32 inputs computed in float32 (float16 inputs
        get a float16 result), float64 when any input is float64.

    Raises
    ------
    TypeError
        If an input is not a NumPy array or not of a float dtype, or ``causal``
        is not a bool, or ``scale`` is not a real number.
    ValueError
        If the shapes disagree (the message names them), ``scale`` is not
        finite and positive (in the computation dtype: ``1e39`` is inf in
        float32), or ``backend`` is unknown or unavailable.
    MemoryError
        With ``backend="reference"``, before allocating, when the ``n_q x n_k``
        intermediates (about ``3 · B · n_q · n_k · itemsize`` bytes) exceed the
        available memory; the message gives the bytes and names the tiled
        backends.

    Notes
    -----
    Time ``O(B · n_q · n_k · (d_k + d_v))``: ``4 · n_q · n_k · d`` flops per
    head for ``d_k = d_v = d`` (about half of that when causal with
    ``n_q = n_k``).  Memory ``O(B · n · d)`` for the tiled backends.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 128, 64), dtype=np.float32) for _ in range(3))
    >>> fastattn.softmax_attention(q, k, v, causal=True).shape
    (2, 128, 64)
    """
    batch_shape, dtype, result = _checks.check_qkv(q, k, v)
    causal = _checks.check_bool(causal, "causal")
    scale = _checks.check_scale(scale, q.shape[-1], dtype)
    module = _backends.kernel_module(backend, "softmax", q.shape[-2], k.shape[-2])
    out_shape = batch_shape + (q.shape[-2], v.shape[-1])
    if 0 in out_shape or k.shape[-2] == 0:
        return np.zeros(out_shape, dtype=result)
    out = _overflow.finite_softmax(
        lambda q, k, v: module.softmax_forward(q, k, v, causal, scale),
        _checks.as_kernel_input(q, dtype, "q"), _checks.as_kernel_input(k, dtype, "k"),
        _checks.as_kernel_input(v, dtype, "v"))
    if out.shape == out_shape and out.dtype is result:   # (B, n_q, d_v) as computed
        return out
    return out.reshape(out_shape).astype(result, copy=False)


def linear_attention(
    q,
    k,
    v,
    *,
    feature_map="elu",
    causal=False,
    eps=None,
    initial_state=None,
    return_state=False,
    backend="auto",
):
    """Linear attention with a positive feature map (Katharopoulos et al. 2020).

    ``out_i = φ(q_i) S_i / (φ(q_i) · z_i + eps)`` with ``S_i = S0 + Σ_j φ(k_j)ᵀ v_j``
    and ``z_i = z0 + Σ_j φ(k_j)``, the sums over the keys query ``i`` sees (all
    of them, or ``j <= i + n_k - n_q`` when causal).  There is no scale.  Where
    the denominator is exactly 0 (``relu`` with ``eps=0``) the row is 0; where it
    overflows, NaN (a float32 call is then computed in float64, see Notes).

    Parameters
    ----------
    q : ndarray of shape (..., n_q, d_k)
        Queries.  float16, float32 or float64, any memory layout.
    k : ndarray of shape (..., n_k, d_k)
        Keys; the leading dims ``...`` equal those of ``q``.
    v : ndarray of shape (..., n_k, d_v)
        Values.
    feature_map : {"elu", "relu", "favor", "taylor"}, FavorFeatures or callable, default "elu"
        ``φ`` of ``d_k`` to ``D`` features (:mod:`fastattn.feature_maps`):

        * ``"elu"``: ``elu(x) + 1`` (always positive), ``D = d_k``;
        * ``"relu"``: ``max(x, 0)``, ``D = d_k``;
        * ``"favor"``: FAVOR+ positive orthogonal random features,
          ``exp(ω x' − ‖x'‖²/2) / √m`` with ``x' = x / d_k^¼``, unbiased for
          ``exp(qᵀk / √d_k)`` (Choromanski et al. 2021), with the default
          ``m`` and seed of :class:`fastattn.FavorFeatures`, ``D = m``;
          pass a ``FavorFeatures(d_k, num_features=m, random_state=seed)``
          to choose them.  Stabilised by a shift per feature for the keys,
          carried into the query features with a shift per row, which
          cancel in the ratio (see :class:`fastattn.FavorFeatures`, Notes);
        * ``"taylor"``: ``[1, x / d_k^¼, sym(x xᵀ) / (√2 √d_k)]``, whose kernel
          is ``1 + s + s²/2 >= 1/2`` with ``s = qᵀk / √d_k`` (Based, Arora et
          al. 2024), ``D = 1 + d_k + d_k (d_k + 1) / 2``;
        * a callable ``f``: ``f(x)`` for ``x`` of shape ``(..., n, d_k)`` (the
          leading dims of the call, computation dtype) returns finite,
          non-negative float features of shape ``(..., n, D)``, a plain
          ndarray (a ``numpy.ma.MaskedArray`` is refused); it is applied to
          ``q`` and to ``k``, each a read-only view (possibly of the
          caller's array, which a map cannot change: one that writes into
          its input is refused, whatever the layout);
        * the name of a map added with :func:`fastattn.feature_maps.register`
          (or the :class:`fastattn.feature_maps.FeatureMap` itself).
    causal : bool, default False
        Bottom-right aligned mask, as in :func:`softmax_attention`.
    eps : float, optional
        Added to the denominator; finite and >= 0.  Default (None): ``1e-6``
        for ``"elu"``, ``"relu"``, ``"taylor"`` and callables, and ``0`` for
        FAVOR+ (``"favor"`` or a :class:`fastattn.FavorFeatures`), as in the
        Performer papers and code: its features are positive, and no
        row's denominator is left to underflow.  FAVOR+ applies a non-zero
        ``eps`` in its shifted frame (see
        :class:`fastattn.FavorFeatures`, Notes), which shrinks rows whose
        shifted denominator is small; with the default, chaining pieces by
        ``initial_state`` equals one pass for every map.
    initial_state : tuple (S, z), optional
        State of keys that came before this call, seen by every query:
        ``S`` of shape ``(..., D, d_v)`` and ``z`` of shape ``(..., D)``
        (``D = d_k`` for ``"elu"`` and ``"relu"``).  Default: no earlier
        keys (zeros).  It is cast to the computation dtype, which ``q``,
        ``k`` and ``v`` alone decide (a float64 state with float32 inputs is
        used in float32).  A non-finite entry is taken as given, in every
        backend alike: a NaN makes the rows that see it NaN, an inf in ``S``
        makes them non-finite, and an inf in ``z`` makes them NaN (an
        infinite denominator, see Notes).
    return_state : bool, default False
        Also return the state after the last key of this call.  Running a
        sequence in pieces, passing each piece's state to the next, equals
        one pass over the whole sequence.  FAVOR+ keeps its state in a fixed
        reference frame, ``FavorFeatures.state_shift``, so states of pieces
        add and never overflow (see :class:`fastattn.FavorFeatures`).
    backend : {"auto", "reference", "numba", "cython"}, default "auto"
        ``"reference"`` is the NumPy specification (its causal form is the
        masked ``n_q x n_k`` quadratic form); ``"numba"`` and ``"cython"``
        use the chunked causal form (quadratic inside a chunk, a running
        ``d_k x d_v`` state across chunks) in ``O(n d)`` memory.

    Returns
    -------
    out : ndarray of shape (..., n_q, d_v)
        Same dtype rules as :func:`softmax_attention`.
    state : tuple (S, z), only if ``return_state``
        ``S`` of shape ``(..., D, d_v)``, ``z`` of shape ``(..., D)``, in
        the computation dtype (float32 or float64).

    Raises
    ------
    TypeError
        Non-array or non-float inputs, a malformed ``initial_state``,
        non-bool flags, or a callable ``feature_map`` that returns no array,
        a masked array or no float array.
    ValueError
        Shapes that disagree (named in the message), an unknown
        ``feature_map`` or ``backend``, a ``FavorFeatures`` of another
        ``d_k``, a callable ``feature_map`` whose features have the wrong
        shape or are negative or not finite (or that writes into its
        read-only input), a negative or non-finite
        ``eps`` (or one that is inf in the computation dtype), or a state of the wrong shape or (for every map but
        ``"taylor"``, whose features may be negative) with a negative ``z``.
    MemoryError
        Before any work, when the ``(D, d_v)`` states (about three of them at
        the peak, ``B · D · d_v`` values each), or with ``backend="reference"``
        and ``causal=True`` the ``n_q x n_k`` intermediates (one array of the
        computation dtype and a 2-byte mask per entry) with the features,
        exceed the available memory: before the features are formed.

    Notes
    -----
    Non-causal: ``O(B · n · D · d_v)`` time, ``4 · n · D · d_v`` flops per
    head.  Causal, chunked with chunk ``c``: ``O(B · n · (c + D) · d_v)``.
    Memory ``O(B · (n · d + D · d_v))`` for the fast backends with ``"elu"``
    and ``"relu"`` (applied chunk by chunk inside the kernels), and
    ``O(B · n · (D + d_v))`` with the other maps, whose features are
    computed first (FAVOR+: one ``n x d_k x m`` GEMM and ``n · m`` exps).
    Causal on the Cython backend with fewer heads than threads, the chunks
    of a head share the threads by keeping a state a chunk of 64 queries:
    at most the size of ``q``, ``k``, ``v`` and the output together (larger
    states, e.g. ``D = d_v`` above 255, run a head a thread instead).

    A float32 call whose output comes out non-finite (its numerator
    ``φ(q) · S``, its state or its denominator ``φ(q) · z`` overflows:
    ``q`` of 1e15 against ``v`` of 1e30, or ``q`` and ``k`` of 1e20 against
    ``v`` of 1e-6) is computed again in float64 and rounded, on every
    backend and for every map: the answer is float64's (inf only beyond
    3.4e38).  A row whose denominator overflows is NaN, never the finite
    ``x / inf = 0``, so that it shows.  The ordinary call pays one pass over
    its output, ``O(n · d_v)``.  With ``"elu"`` and ``"relu"`` the features
    grow like the inputs, and in float64 a row whose denominator overflows
    (inputs of about ``1e153`` at ``d_k = 64``) is that NaN.  Rescale such
    inputs first (relu attention does not change when ``q`` is scaled).
    With ``"elu"`` or ``"relu"`` and an ``eps`` below ``2**-23`` (``0``
    included), a float32 call whose output has a row of zeros (a
    denominator or numerator that underflowed: relu inputs near 1e-40) is
    computed again in float64 too, the whole call; so is one with an empty
    output (no queries, or ``d_v = 0``) whose state is not finite.  An
    entry that underflows alone, or only partly, is not caught (see
    docs/numerics.md).
    A float32 call whose state products ``φ(k)ᵀ v`` may fall below float32's
    normal range (keys and values both near 1e-30; the bound, one pass over
    ``k`` and ``v``, is in :meth:`FeatureMap.state_may_underflow`) is also
    computed in float64 and rounded; a float32 state returned still holds
    float32 numbers.

    An inf in ``v`` makes every row that sees its key non-finite, but
    which of inf and NaN it gets is not specified: a feature or weight of
    exactly 0 meets it as ``0 · inf`` (NaN) in the state ``φ(k)ᵀ v`` of
    the fast backends, and not in the reference's ``n_q x n_k`` weights,
    so backends (and, for the chunked causal kernels, the key's place in
    its chunk) may differ.  A NaN anywhere gives NaN in every backend.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((64, 32)) for _ in range(3))
    >>> out, (S, z) = fastattn.linear_attention(q, k, v, causal=True, return_state=True)
    >>> out.shape, S.shape, z.shape
    ((64, 32), (32, 32), (32,))
    """
    batch_shape, dtype, result = _checks.check_qkv(q, k, v)
    causal = _checks.check_bool(causal, "causal")
    return_state = _checks.check_bool(return_state, "return_state")
    d_k, d_v, n_q, n_k = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    fmap = feature_maps.resolve(feature_map, d_k)
    eps = _checks.check_eps(eps, fmap, dtype)
    D = fmap.feature_dim(d_k)
    S0 = z0 = None
    if D is not None:   # a callable's D is known once it has run, below
        S0, z0 = _checks.check_state(initial_state, batch_shape, D, d_v, dtype,
                                     _checks.dim_name(fmap), fmap)
        _checks.check_state_fits(batch_shape, D, d_v, n_q, n_k, dtype, fmap)
    module = _backends.kernel_module(backend, "linear", n_q, n_k, fmap.elementwise)
    # With an empty dimension the non-causal reference is exact (with no keys,
    # no queries or no values causal and non-causal agree) and costs
    # O(size of the inputs): no n_q x n_k array, whatever backend was asked.
    empty = 0 in batch_shape or 0 in (n_q, n_k, d_v)
    if empty:
        module, causal = reference, False
    if causal and module is reference:
        # Before the features: a Taylor map's are gigabytes where the n_q x n_k arrays
        # cannot fit, and took 23 s to form before this refusal.
        reference.check_causal_linear_fits(math.prod(batch_shape), n_q, n_k, d_v,
                                           np.dtype(dtype).itemsize, D or 0, fmap.elementwise)
    qq, kk = _checks.as_kernel_input(q, dtype, "q"), _checks.as_kernel_input(k, dtype, "k")
    feats = fmap.features(module, qq, kk, batch_shape, z0)
    if D is None:
        D = feats.num_features
        S0, z0 = _checks.check_state(initial_state, batch_shape, D, d_v, dtype,
                                     _checks.dim_name(fmap), fmap)
        _checks.check_state_fits(batch_shape, D, d_v, 0, 0, dtype, fmap)
    vv = _checks.as_kernel_input(v, dtype, "v")
    out, S, z = fmap.forward(module, feats, qq, kk, vv, causal, eps, S0, z0)
    out = out.reshape(batch_shape + (n_q, d_v)).astype(result, copy=False)
    if not return_state:
        return out
    return out, (S.reshape(batch_shape + (D, d_v)), z.reshape(batch_shape + (D,)))


def attention_weights(
    q, k, *, kind="softmax", causal=False, scale=None, feature_map="elu", eps=None
):
    """The explicit ``n_q x n_k`` weight matrix an attention applies to ``v``.

    For heatmaps and analysis: ``attention(q, k, v) == attention_weights(q, k) @ v``.

    Parameters
    ----------
    q : ndarray of shape (..., n_q, d_k)
    k : ndarray of shape (..., n_k, d_k)
    kind : {"softmax", "linear"}, default "softmax"
        ``"softmax"``: ``softmax(q kᵀ · scale)`` (rows sum to 1).
        ``"linear"``: ``φ(q_i)·φ(k_j) / (Σ_j φ(q_i)·φ(k_j) + eps)``.
    causal : bool, default False
        Bottom-right aligned mask; masked weights are 0.
    scale : float, optional
        Softmax only (refused with ``kind="linear"``, which has no scale);
        default ``1 / sqrt(d_k)``.
    feature_map : {"elu", "relu", "favor", "taylor"}, FavorFeatures or callable, default "elu"
        Linear only, as :func:`linear_attention` (no initial state); checked
        whatever the kind.
    eps : float, optional
        Linear only; checked whatever the kind.  Default (None) as
        :func:`linear_attention`: 0 for FAVOR+, else ``1e-6``.

    Returns
    -------
    weights : ndarray of shape (..., n_q, n_k)
        In the computation dtype (float32 or float64).

    Raises
    ------
    TypeError, ValueError
        As :func:`softmax_attention` and :func:`linear_attention` (every
        option is checked, whatever the kind), for an unknown ``kind``, and
        for a ``scale`` given with ``kind="linear"``.
    MemoryError
        Before any work, when the ``n_q x n_k`` matrix (one array, normalised
        in place, and a 2-byte mask per entry when causal) with the features
        does not fit in available memory; and before a float32 linear call's
        weights are computed again in float64 (see :func:`linear_attention`,
        Notes), when those do not.

    Notes
    -----
    Always computed by the NumPy reference: ``O(B · n_q · n_k)`` memory.
    Float32 linear weights that come out non-finite, or with a row of zeros
    that may be underflow, are computed again in float64 and rounded, as
    :func:`linear_attention`'s output is, so that ``attention == weights @ v``
    holds there too.
    """
    if kind not in ("softmax", "linear"):
        raise ValueError(f"kind must be 'softmax' or 'linear', got {kind!r}")
    batch_shape, dtype, _ = _checks.check_qkv(q, k)
    causal = _checks.check_bool(causal, "causal")
    if kind == "linear" and scale is not None:
        raise ValueError(
            f"scale applies to kind='softmax' only (linear attention has no scale), got {scale!r}"
        )
    # Every option is checked whatever the kind: a bad one is never ignored.
    scale = _checks.check_scale(scale, q.shape[-1], dtype)
    fmap = feature_maps.resolve(feature_map, q.shape[-1])
    eps = _checks.check_eps(eps, fmap, dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out_shape = batch_shape + (n_q, n_k)
    if 0 in out_shape:
        return np.zeros(out_shape, dtype)
    # The reference holds one n_q x n_k array (normalised in place), the causal mask and,
    # for linear attention, the features (a callable's D is known once it has run: 0);
    # refused here, before the features, with advice for this function, which has no
    # tiled backend.
    D = (fmap.feature_dim(q.shape[-1]) or 0) if kind == "linear" else 0
    itemsize = np.dtype(dtype).itemsize
    # Softmax also scales a copy of q (through float64): _overflow.kernel_query.
    scaled_q = math.prod(batch_shape) * n_q * q.shape[-1] * (8 + itemsize) if kind == "softmax" \
        else 0
    reference.check_fits_in_memory(
        reference.weights_bytes(math.prod(batch_shape), n_q, n_k, itemsize, causal, D) + scaled_q,
        f"attention_weights, for its {out_shape} weights and their intermediates,",
        advice="the weights are n_q x n_k: pass fewer queries or keys (a slice of q or k), "
               "or compute the attention itself with softmax_attention or linear_attention, "
               "which need O(n d) memory",
    )
    qq, kk = _checks.as_kernel_input(q, dtype, "q"), _checks.as_kernel_input(k, dtype, "k")
    if kind == "softmax":
        qq, scale = _overflow.kernel_query(qq, scale)
        weights, _ = reference.softmax_weights(qq, kk, causal, scale)
    else:
        # FAVOR+ keys whose float32 norms may overflow: their features in float64, as in
        # linear_attention (FeatureMap.features_may_overflow), the weights rounded.  So are
        # float32 weights that come out non-finite (a product φ(q)·φ(k) or a row's sum past
        # float32's range: NaN, never a 0 that looks like an answer; a NaN or inf given
        # reaches the same rows in float64, the others get their answer), or with a row of
        # zeros that may be underflow (FeatureMap.zero_rows_may_be_lost), as
        # linear_attention's output is: attention == weights @ v holds there too.
        wide = qq.dtype == np.float32 and fmap.features_may_overflow(qq, kk)
        weights = _linear_weights(fmap, qq, kk, batch_shape, causal, eps, wide)
        # Their sum, not isfinite's n_q x n_k bools: a row of weights sums to about 1 (a
        # map's negative features aside: a sum that overflows only costs the float64 call).
        if qq.dtype == np.float32 and not wide and (
                not np.isfinite(weights.sum()) or fmap.zero_rows_may_be_lost(weights, eps)):
            del weights   # the float64 weights and their float32 copy in its place
            reference.check_fits_in_memory(
                reference.weights_bytes(math.prod(batch_shape), n_q, n_k, 8, causal, D)
                + math.prod(out_shape) * 4,
                f"attention_weights, for its {out_shape} weights computed again in float64 "
                "(their float32 ones overflowed or underflowed),", advice="rescale q and k")
            weights = _linear_weights(fmap, qq, kk, batch_shape, causal, eps, True)
    return weights.reshape(out_shape)


def _linear_weights(fmap, q, k, batch_shape, causal, eps, wide):
    """The reference's linear attention weights of ``(B, n, d_k)`` inputs under ``fmap``;
    ``wide``: of float32 inputs, computed in float64 and rounded."""
    if wide:
        q, k = q.astype(np.float64), k.astype(np.float64)
    feats = fmap.features(reference, q, k, batch_shape)
    # Float32 weights that overflow are computed again in float64 by the caller: quiet.
    with np.errstate(over="ignore", invalid="ignore") if q.dtype == np.float32 \
            else contextlib.nullcontext():
        if feats is None:
            weights = reference.linear_weights(q, k, fmap.elementwise, causal, eps)
        else:
            weights = reference.linear_weights(feats.q, feats.k, "identity", causal, eps)
            if causal and feats.key_shift is not None:
                feature_maps.exact_causal_weights(fmap, feats, q, k, eps, weights)
    return weights.astype(np.float32) if wide else weights
