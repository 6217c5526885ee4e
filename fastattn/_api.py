"""Public attention functions: validation, normalisation and backend dispatch.

Everything a user passes is checked here, once; the kernels behind the
dispatch table receive plain arrays they can trust:

* ``q (B, n_q, d_k)``, ``k (B, n_k, d_k)``, ``v (B, n_k, d_v)``, the leading
  dims of the call flattened into ``B``;
* one dtype, float32 or float64 (float16 is computed in float32);
* C-contiguous, aligned and writeable (copies are made when needed; a kernel
  must never write into its inputs);
* ``B, n_q, n_k, d_k, d_v >= 1`` (calls with an empty dimension are answered
  here without calling a kernel);
* Python ``bool`` / ``float`` scalars, already checked.

A backend is a module exposing::

    softmax_forward(q, k, v, causal, scale) -> out (B, n_q, d_v)
    linear_forward(q, k, v, feature_map, causal, eps, S0, z0) -> (out, S, z)
    favor_key_features(x, w) -> (features, c), favor_query_features(x, w, c),
    taylor_features(x)

where ``S0 (B, d_k, d_v)`` and ``z0 (B, d_k)`` are None or arrays of the call's
dtype, and ``S``, ``z`` are the state after the last key.  ``feature_map`` is
``"elu"``, ``"relu"`` or ``"identity"`` (``q`` and ``k`` are features of
dimension D, computed first by :mod:`fastattn.feature_maps`).  Importing a
backend's module raises ImportError when it cannot run here; a module that
runs but should not be picked by ``backend="auto"`` (Numba without a
writable disk cache) says why in ``AUTO_UNSUITABLE``.  A backend may expose
``set_num_threads``/``get_num_threads``; :mod:`fastattn._threads` applies
the process-wide count when it loads.
"""

import importlib
import math
import numbers

import numpy as np

from . import _dispatch, _threads, feature_maps, reference

#: Backend name -> module that implements it.  One lookup dispatches a call.
BACKEND_MODULES = {
    "reference": "fastattn.reference",
    "numba": "fastattn._numba",
    "cython": "fastattn._cython",
}

#: Order in which ``backend="auto"`` tries the backends: fastest first, as
#: measured by ``fastattn bench`` on the development machine.
AUTO_ORDER = ("cython", "numba", "reference")

_COMPUTE_DTYPES = {
    np.dtype(np.float16): np.dtype(np.float32),
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float64): np.dtype(np.float64),
}

_loaded = {}
_unavailable = {}
_not_for_auto = {}   # name -> why ``auto`` passes over a backend that runs (e.g. no disk cache)


def _load(name):
    """The backend module ``name``, or None (with the reason kept) if it cannot run."""
    if name in _loaded:
        return _loaded[name]
    if name in _unavailable:
        return None
    try:
        module = importlib.import_module(BACKEND_MODULES[name])
    except (ImportError, Warning) as exc:  # a Warning: raised under -W error / filterwarnings
        _unavailable[name] = f"{type(exc).__name__}: {exc}"
        return None
    missing = [fn for fn in ("softmax_forward", "linear_forward") if not hasattr(module, fn)]
    if missing:
        _unavailable[name] = f"{BACKEND_MODULES[name]} does not define {missing}"
        return None
    _loaded[name] = module
    _threads.backend_loaded(module)
    reason = getattr(module, "AUTO_UNSUITABLE", None)
    if reason:
        _not_for_auto[name] = reason
    return module


def loaded_backends():
    """The backend modules imported so far (importing none)."""
    return list(_loaded.values())


def available_backends():
    """Names of the backends that can run on this machine, fastest first.

    Returns
    -------
    tuple of str
        A subset of ``("cython", "numba", "reference")``; ``"reference"`` is
        always present.  A compiled backend is missing when its extension was
        not built; a JIT backend when Numba cannot be imported.  This imports
        every backend.
    """
    return tuple(name for name in AUTO_ORDER if _load(name) is not None)


def unavailable_backends():
    """Backends that cannot run here, mapped to the reason (the ImportError text).

    Returns
    -------
    dict of str to str
    """
    available_backends()
    return dict(_unavailable)


def get_backend(backend):
    """The module implementing ``backend`` (``"auto"`` resolves to the fastest).

    ``"auto"`` passes over a backend that runs but says it should not be
    picked (its ``AUTO_UNSUITABLE``, e.g. Numba without a disk cache, which
    would compile in every process).

    Raises
    ------
    ValueError
        If ``backend`` is not a known name, or is known but cannot run here
        (the message lists the available backends and why this one is not).
    """
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKEND_MODULES):
        got = (f"an array of shape {backend.shape}" if isinstance(backend, np.ndarray)
               else repr(backend))
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(BACKEND_MODULES)}, got {got}; "
            f"available here: {list(available_backends())}"
        )
    if backend == "auto":
        return _load(next(b for b in available_backends() if b not in _not_for_auto))
    module = _load(backend)
    if module is None:
        raise ValueError(
            f"backend {backend!r} is not available here ({_unavailable[backend]}); "
            f"available: {list(available_backends())}"
        )
    return module


def _native(dtype):
    """``dtype`` in this machine's byte order (``>f4`` -> ``float32``)."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _check_float_array(x, name, code=None):
    """``x`` is a plain ndarray of float16, float32 or float64 (any byte order).

    ``code`` is how the argument is written in the advice's code (default ``name``).
    """
    code = name if code is None else code
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} must be a plain numpy.ndarray, got a numpy.ma.MaskedArray whose "
            f"mask would be ignored; pass e.g. {code}.filled(0.0)"
        )
    if _native(x.dtype) not in _COMPUTE_DTYPES:
        raise TypeError(
            f"{name} must have dtype float16, float32 or float64, got {x.dtype} "
            f"(cast it explicitly, e.g. {code}.astype(np.float32))"
        )


def _check_array(x, name):
    """``x`` is a float array of rank >= 2, ``(..., n, d)``."""
    _check_float_array(x, name)
    if x.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., n, d), got shape {x.shape}"
        )


def _check_qkv(q, k, v):
    """Validate q, k, v; return (batch_shape, compute dtype, result dtype)."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_array(x, name)
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            "q, k and v must have the same leading (batch, head) dims; got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dim d_k; got q {q.shape} (d_k={q.shape[-1]}) "
            f"and k {k.shape} (d_k={k.shape[-1]})"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same sequence length n_k; got k {k.shape} "
            f"(n_k={k.shape[-2]}) and v {v.shape} (n_k={v.shape[-2]})"
        )
    if q.shape[-1] == 0:
        raise ValueError(f"d_k must be at least 1; got q {q.shape} and k {k.shape}")
    if q.dtype == k.dtype == v.dtype:
        result = _native(q.dtype)
    else:
        result = np.result_type(_native(q.dtype), _native(k.dtype), _native(v.dtype))
    return q.shape[:-2], _COMPUTE_DTYPES[result], result


def _as_kernel_input(x, dtype):
    """``x`` as a C-contiguous, aligned, writeable array of ``dtype`` with one batch dim."""
    x = np.asarray(x)  # a subclass (np.matrix, np.memmap) computes as the plain array
    if x.ndim != 3:
        x = x.reshape((math.prod(x.shape[:-2]),) + x.shape[-2:])
    flags = x.flags
    if x.dtype == dtype and flags.c_contiguous and flags.aligned and flags.writeable:
        return x
    return np.require(x, dtype=dtype, requirements=["C", "A", "W"])


def _shape_text(*dims):
    """A shape with named dims, as a reader writes it: ``(2, 8, D)``, not ``(2, 8, 'D')``."""
    return "(" + ", ".join(map(str, dims)) + ")"


def _check_positive_scalar(value, name, allow_zero):
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        value = value[()]   # a 0-d array (np.array(0.125), a scalar tensor's .numpy()) is its value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        got = (f"an array of shape {value.shape} and dtype {value.dtype}"
               if isinstance(value, np.ndarray) else type(value).__name__)
        raise TypeError(f"{name} must be a real number, got {got}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def _check_eps(eps, spec, dtype):
    """``eps`` as a float >= 0, finite in the computation ``dtype``; None gives the feature
    map's default (``spec.default_eps()``)."""
    if eps is None:
        return spec.default_eps()
    return _finite_in(_check_positive_scalar(eps, "eps", allow_zero=True), "eps", dtype)


#: The largest finite value of each computation dtype.
_LARGEST = {dt: float(np.finfo(dt).max) for dt in (np.dtype(np.float32), np.dtype(np.float64))}


def _check_scale(scale, d_k, dtype):
    """``scale`` as a float (default ``1 / sqrt(d_k)``), finite and > 0 in the computation ``dtype``."""
    if scale is None:
        return reference.default_scale(d_k)
    return _finite_in(_check_positive_scalar(scale, "scale", allow_zero=False), "scale", dtype)


def _finite_in(value, name, dtype):
    """``value`` (a float >= 0), if it is finite in the computation ``dtype``; else ValueError."""
    if value > _LARGEST[dtype]:
        raise ValueError(
            f"{name} must be finite in the computation dtype {dtype} (at most "
            f"{_LARGEST[dtype]:.8g}), got {value!r}, which is inf in {dtype}"
        )
    return value


def _check_bool(value, name):
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype == bool:
        value = value[()]   # a 0-d boolean array is its value, as for the scalars
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


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
    batch_shape, dtype, result = _check_qkv(q, k, v)
    causal = _check_bool(causal, "causal")
    scale = _check_scale(scale, q.shape[-1], dtype)
    module = _dispatch.backend_for_call(backend, "softmax", q, k, v, causal, dtype)
    n_q, d_v = q.shape[-2], v.shape[-1]
    out_shape = batch_shape + (n_q, d_v)
    if 0 in out_shape or k.shape[-2] == 0:
        return np.zeros(out_shape, dtype=result)
    out = module.softmax_forward(
        _as_kernel_input(q, dtype), _as_kernel_input(k, dtype), _as_kernel_input(v, dtype),
        causal, scale,
    )
    return out.reshape(out_shape).astype(result, copy=False)


def _check_state(initial_state, batch_shape, d_k, d_v, dtype, dim_name="d_k", spec=None):
    """``initial_state`` as kernel arrays; ``d_k`` is the feature dimension, named ``dim_name``.

    For a map whose features are non-negative (all but Taylor) ``z``, a sum
    of features, must be >= 0: a negative one would only come from a state
    of another map or of no call at all, and give wrong rows silently.
    """
    if initial_state is None:
        return None, None
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise TypeError(
            "initial_state must be a pair (S, z) with S of shape "
            f"{batch_shape + (d_k, d_v)} and z of shape {batch_shape + (d_k,)}, "
            f"got {type(initial_state).__name__}"
        )
    S, z = initial_state
    for x, name, code, shape, dims in (
        (S, "initial_state[0] (S)", "S", batch_shape + (d_k, d_v), f"(..., {dim_name}, d_v)"),
        (z, "initial_state[1] (z)", "z", batch_shape + (d_k,), f"(..., {dim_name})"),
    ):
        _check_float_array(x, name, code)
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} {dims}, got {x.shape}")
    if spec is not None and spec.name != "taylor" and np.any(np.asarray(z) < 0):
        raise ValueError(
            f"initial_state[1] (z) must be >= 0 with the {spec.name!r} feature map: it is a sum "
            f"of non-negative features; got min {float(np.min(z)):.6g}"
        )
    B = math.prod(batch_shape)
    S = np.require(np.asarray(S).reshape(B, d_k, d_v), dtype=dtype, requirements=["C", "A", "W"])
    z = np.require(np.asarray(z).reshape(B, d_k), dtype=dtype, requirements=["C", "A", "W"])
    return S, z


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
    the denominator is exactly 0 (``relu`` with ``eps=0``) the row is 0.

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
          non-negative float features of shape ``(..., n, D)``; it is
          applied to ``q`` and to ``k``.
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
        makes them non-finite, and an inf in ``z`` makes them 0 (an
        overflowing denominator, see Notes).
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
        non-bool flags, or a callable ``feature_map`` that returns no array
        or no float array.
    ValueError
        Shapes that disagree (named in the message), an unknown
        ``feature_map`` or ``backend``, a ``FavorFeatures`` of another
        ``d_k``, a callable ``feature_map`` whose features have the wrong
        shape or are negative or not finite, a negative or non-finite
        ``eps`` (or one that is inf in the computation dtype), or a state of the wrong shape or (for every map but
        ``"taylor"``, whose features may be negative) with a negative ``z``.
    MemoryError
        Before any work, when the ``(D, d_v)`` states (about three of them at
        the peak, ``B · D · d_v`` values each), or with ``backend="reference"``
        and ``causal=True`` the ``n_q x n_k`` intermediates, exceed the
        available memory.

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

    With ``"elu"`` and ``"relu"`` the features grow like the inputs, and a
    row whose denominator ``φ(q) · z`` overflows the dtype is wrong, in
    every backend alike: NaN where its numerator ``φ(q) · S`` overflows
    too (``inf / inf``), else 0.  With ``d_k = 64`` that takes ``|q|`` and
    ``|k|`` of about ``1e18`` in float32 (less the more keys there are) and
    ``1e153`` in float64; rescale such inputs first (relu attention does
    not change when ``q`` is scaled).

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
    batch_shape, dtype, result = _check_qkv(q, k, v)
    causal = _check_bool(causal, "causal")
    return_state = _check_bool(return_state, "return_state")
    d_k, d_v, n_q, n_k = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    spec = feature_maps.resolve(feature_map, d_k)
    eps = _check_eps(eps, spec, dtype)
    D = spec.num_features(d_k)
    S0 = z0 = None
    if D is not None:
        S0, z0 = _check_state(initial_state, batch_shape, D, d_v, dtype, _dim_name(spec), spec)
        _check_state_fits(batch_shape, D, d_v, n_q, n_k, dtype, spec)
    module = _dispatch.backend_for_call(backend, "linear", q, k, v, causal, dtype, feature_map)
    out_shape = batch_shape + (n_q, d_v)
    empty = 0 in batch_shape or 0 in (n_q, n_k, d_v)
    # With an empty dimension the non-causal reference is exact (with no keys,
    # no queries or no values causal and non-causal agree) and costs
    # O(size of the inputs): no n_q x n_k array, whatever backend was asked.
    kernel = reference if empty else module
    qq, kk = _as_kernel_input(q, dtype), _as_kernel_input(k, dtype)
    feats = feature_maps.features(kernel, spec, qq, kk, batch_shape, z0)
    if D is None:  # a user's map: D is known once it has run
        D = feats.num_features
        S0, z0 = _check_state(initial_state, batch_shape, D, d_v, dtype, _dim_name(spec), spec)
        _check_state_fits(batch_shape, D, d_v, 0, 0, dtype, spec)
    out, S, z = feature_maps.linear_forward(
        kernel, spec, feats, qq, kk, _as_kernel_input(v, dtype), causal and not empty, eps, S0, z0
    )
    out = out.reshape(out_shape).astype(result, copy=False)
    if not return_state:
        return out
    return out, (S.reshape(batch_shape + (D, d_v)), z.reshape(batch_shape + (D,)))


#: Copies of the ``(D, d_v)`` state a fast call holds at its peak: the
#: kernel's working states, the initial state and the one returned (measured:
#: Cython 2x, Numba 3x the state at d_k = d_v = 16384).
STATE_COPIES = 3


def _check_state_fits(batch_shape, D, d_v, n_q, n_k, dtype, spec):
    """MemoryError, before any work, when the ``(D, d_v)`` states (and the
    features of a map computed up front) cannot fit in available memory."""
    B = math.prod(batch_shape)
    itemsize = np.dtype(dtype).itemsize
    nbytes = STATE_COPIES * B * D * d_v * itemsize
    if spec.name not in feature_maps.ELEMENTWISE:
        nbytes += B * (n_q + n_k) * D * itemsize
    reference.check_fits_in_memory(
        nbytes,
        f"linear attention with D={D:,} features and d_v={d_v:,}, for its "
        f"{batch_shape + (D, d_v)} states{'' if spec.name in feature_maps.ELEMENTWISE else ' and features'},",
        advice="the state grows as D x d_v (D = d_k for elu and relu, "
               "1 + d_k + d_k (d_k + 1) / 2 for taylor): give smaller head dims or fewer features",
    )


def _dim_name(spec):
    """How the state's feature dimension is named in messages: ``d_k`` or ``D``."""
    return "d_k" if spec.name in feature_maps.ELEMENTWISE else "D"


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
        When the ``n_q x n_k`` matrix does not fit in available memory.

    Notes
    -----
    Always computed by the NumPy reference: ``O(B · n_q · n_k)`` memory.
    """
    if kind not in ("softmax", "linear"):
        raise ValueError(f"kind must be 'softmax' or 'linear', got {kind!r}")
    for x, name in ((q, "q"), (k, "k")):
        _check_array(x, name)
    # Reuse the full check with a placeholder v of the right shape (no data).
    v = np.broadcast_to(np.zeros((), q.dtype), k.shape[:-1] + (1,))
    batch_shape, dtype, _ = _check_qkv(q, k, v)
    causal = _check_bool(causal, "causal")
    if kind == "linear" and scale is not None:
        raise ValueError(
            f"scale applies to kind='softmax' only (linear attention has no scale), got {scale!r}"
        )
    # Every option is checked whatever the kind: a bad one is never ignored.
    scale = _check_scale(scale, q.shape[-1], dtype)
    spec = feature_maps.resolve(feature_map, q.shape[-1])
    eps = _check_eps(eps, spec, dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out_shape = batch_shape + (n_q, n_k)
    if 0 in out_shape:
        return np.zeros(out_shape, dtype)
    # The reference holds two n_q x n_k arrays at most (and the causal mask);
    # refused here with advice for this function, which has no tiled backend.
    reference.check_fits_in_memory(
        reference.quadratic_bytes(math.prod(batch_shape), n_q, n_k, np.dtype(dtype).itemsize,
                                  arrays=2) + (2 * n_q * n_k if causal else 0),
        f"attention_weights, for its {out_shape} weights and their intermediates,",
        advice="the weights are n_q x n_k: pass fewer queries or keys (a slice of q or k), "
               "or compute the attention itself with softmax_attention or linear_attention, "
               "which need O(n d) memory",
    )
    qq, kk = _as_kernel_input(q, dtype), _as_kernel_input(k, dtype)
    if kind == "softmax":
        weights, _ = reference.softmax_weights(qq, kk, causal, scale)
    else:
        feats = feature_maps.features(reference, spec, qq, kk, batch_shape)
        if feats is None:
            weights = reference.linear_weights(qq, kk, spec.name, causal, eps)
        else:
            weights = reference.linear_weights(feats.q, feats.k, "identity", causal, eps)
            if causal and feats.key_shift is not None:
                feature_maps.exact_causal_weights(spec, feats, qq, kk, eps, weights)
    return weights.reshape(out_shape)
