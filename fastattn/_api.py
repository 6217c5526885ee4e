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

where ``S0 (B, d_k, d_v)`` and ``z0 (B, d_k)`` are None or arrays of the call's
dtype, and ``S``, ``z`` are the state after the last key.  Importing a
backend's module raises ImportError when it cannot run here.
"""

import importlib
import math
import numbers

import numpy as np

from . import _dispatch, reference

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


def _load(name):
    """The backend module ``name``, or None (with the reason kept) if it cannot run."""
    if name in _loaded:
        return _loaded[name]
    if name in _unavailable:
        return None
    try:
        module = importlib.import_module(BACKEND_MODULES[name])
    except ImportError as exc:
        _unavailable[name] = f"{type(exc).__name__}: {exc}"
        return None
    missing = [fn for fn in ("softmax_forward", "linear_forward") if not hasattr(module, fn)]
    if missing:
        _unavailable[name] = f"{BACKEND_MODULES[name]} does not define {missing}"
        return None
    _loaded[name] = module
    return module


def available_backends():
    """Names of the backends that can run on this machine, fastest first.

    Returns
    -------
    tuple of str
        A subset of ``("cython", "numba", "reference")``; ``"reference"`` is
        always present.  A compiled backend is missing when its extension was
        not built; a JIT backend when Numba cannot be imported.
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

    Raises
    ------
    ValueError
        If ``backend`` is not a known name, or is known but cannot run here
        (the message lists the available backends and why this one is not).
    """
    if backend == "auto":
        return _load(available_backends()[0])
    if not isinstance(backend, str) or backend not in BACKEND_MODULES:
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(BACKEND_MODULES)}, got {backend!r}; "
            f"available here: {list(available_backends())}"
        )
    module = _load(backend)
    if module is None:
        raise ValueError(
            f"backend {backend!r} is not available here ({_unavailable[backend]}); "
            f"available: {list(available_backends())}"
        )
    return module


def _native(dtype):
    """``dtype`` in this machine's byte order (``>f4`` -> ``float32``)."""
    return dtype.newbyteorder("=")


def _check_float_array(x, name):
    """``x`` is a plain ndarray of float16, float32 or float64 (any byte order)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} must be a plain numpy.ndarray, got a numpy.ma.MaskedArray whose "
            f"mask would be ignored; pass e.g. {name}.filled(0.0)"
        )
    if _native(x.dtype) not in _COMPUTE_DTYPES:
        raise TypeError(
            f"{name} must have dtype float16, float32 or float64, got {x.dtype} "
            f"(cast it explicitly, e.g. {name}.astype(np.float32))"
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
    result = np.result_type(_native(q.dtype), _native(k.dtype), _native(v.dtype))
    return q.shape[:-2], _COMPUTE_DTYPES[result], result


def _as_kernel_input(x, dtype):
    """``x`` as a C-contiguous, aligned, writeable array of ``dtype`` with one batch dim."""
    x = np.asarray(x)  # a subclass (np.matrix, np.memmap) computes as the plain array
    if x.ndim != 3:
        x = x.reshape((math.prod(x.shape[:-2]),) + x.shape[-2:])
    return np.require(x, dtype=dtype, requirements=["C", "A", "W"])


def _check_positive_scalar(value, name, allow_zero):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def _check_bool(value, name):
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
        finite and positive, or ``backend`` is unknown or unavailable.
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
    d_k = q.shape[-1]
    scale = reference.default_scale(d_k) if scale is None else _check_positive_scalar(
        scale, "scale", allow_zero=False
    )
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


def _check_state(initial_state, batch_shape, d_k, d_v, dtype):
    if initial_state is None:
        return None, None
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise TypeError(
            "initial_state must be a pair (S, z) with S of shape "
            f"{batch_shape + (d_k, d_v)} and z of shape {batch_shape + (d_k,)}, "
            f"got {type(initial_state).__name__}"
        )
    S, z = initial_state
    for x, name, shape, dims in (
        (S, "initial_state[0] (S)", batch_shape + (d_k, d_v), "(..., d_k, d_v)"),
        (z, "initial_state[1] (z)", batch_shape + (d_k,), "(..., d_k)"),
    ):
        _check_float_array(x, name)
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} {dims}, got {x.shape}")
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
    eps=1e-6,
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
    feature_map : {"elu", "relu"}, default "elu"
        ``"elu"``: ``φ(x) = elu(x) + 1`` (always positive); ``"relu"``:
        ``φ(x) = max(x, 0)``.
    causal : bool, default False
        Bottom-right aligned mask, as in :func:`softmax_attention`.
    eps : float, default 1e-6
        Added to the denominator; finite and >= 0.
    initial_state : tuple (S, z), optional
        State of keys that came before this call, seen by every query:
        ``S`` of shape ``(..., d_k, d_v)`` and ``z`` of shape ``(..., d_k)``.
        Default: no earlier keys (zeros).
    return_state : bool, default False
        Also return the state after the last key of this call.  Running a
        sequence in pieces, passing each piece's state to the next, equals
        one pass over the whole sequence.
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
        ``S`` of shape ``(..., d_k, d_v)``, ``z`` of shape ``(..., d_k)``, in
        the computation dtype (float32 or float64).

    Raises
    ------
    TypeError
        Non-array or non-float inputs, a malformed ``initial_state``, or
        non-bool flags.
    ValueError
        Shapes that disagree (named in the message), an unknown
        ``feature_map`` or ``backend``, a negative or non-finite ``eps``, or a
        state of the wrong shape.
    MemoryError
        With ``backend="reference"`` and ``causal=True``, before allocating,
        when the ``n_q x n_k`` intermediates exceed the available memory.

    Notes
    -----
    Non-causal: ``O(B · n · d_k · d_v)`` time, ``4 · n · d_k · d_v`` flops per
    head.  Causal, chunked with chunk ``c``: ``O(B · n · (c + d_k) · d_v)``.
    Memory ``O(B · (n · d + d_k · d_v))`` for the fast backends.

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
    if feature_map not in reference.FEATURE_MAPS:
        raise ValueError(
            f"feature_map must be one of {list(reference.FEATURE_MAPS)}, got {feature_map!r}"
        )
    eps = _check_positive_scalar(eps, "eps", allow_zero=True)
    d_k, d_v, n_q, n_k = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    S0, z0 = _check_state(initial_state, batch_shape, d_k, d_v, dtype)
    module = _dispatch.backend_for_call(backend, "linear", q, k, v, causal, dtype, feature_map)
    out_shape = batch_shape + (n_q, d_v)
    # With an empty dimension the reference is exact and forms no large array.
    kernel = reference if 0 in batch_shape or 0 in (n_q, n_k, d_v) else module
    out, S, z = kernel.linear_forward(
        _as_kernel_input(q, dtype), _as_kernel_input(k, dtype), _as_kernel_input(v, dtype),
        feature_map, causal, eps, S0, z0,
    )
    out = out.reshape(out_shape).astype(result, copy=False)
    if not return_state:
        return out
    return out, (S.reshape(batch_shape + (d_k, d_v)), z.reshape(batch_shape + (d_k,)))


def attention_weights(
    q, k, *, kind="softmax", causal=False, scale=None, feature_map="elu", eps=1e-6
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
        Softmax only; default ``1 / sqrt(d_k)``.
    feature_map : {"elu", "relu"}, default "elu"
        Linear only.
    eps : float, default 1e-6
        Linear only.

    Returns
    -------
    weights : ndarray of shape (..., n_q, n_k)
        In the computation dtype (float32 or float64).

    Raises
    ------
    TypeError, ValueError
        As :func:`softmax_attention` and :func:`linear_attention`, and for an
        unknown ``kind``.
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
    if kind == "softmax":
        scale = reference.default_scale(q.shape[-1]) if scale is None else _check_positive_scalar(
            scale, "scale", allow_zero=False
        )
    else:
        if feature_map not in reference.FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be one of {list(reference.FEATURE_MAPS)}, got {feature_map!r}"
            )
        eps = _check_positive_scalar(eps, "eps", allow_zero=True)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out_shape = batch_shape + (n_q, n_k)
    if 0 in out_shape:
        return np.zeros(out_shape, dtype)
    qq, kk = _as_kernel_input(q, dtype), _as_kernel_input(k, dtype)
    if kind == "softmax":
        weights, _ = reference.softmax_weights(qq, kk, causal, scale)
    else:
        weights = reference.linear_weights(qq, kk, feature_map, causal, eps)
    return weights.reshape(out_shape)
