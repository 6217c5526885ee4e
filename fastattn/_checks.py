"""The checks shared by the attention functions and the generation classes.

Everything a user passes is checked here, once; the kernels behind
:mod:`fastattn._backends` receive plain arrays they can trust:

* ``q (B, n_q, d_k)``, ``k (B, n_k, d_k)``, ``v (B, n_k, d_v)``, the leading
  dims of the call flattened into ``B``;
* one dtype, float32 or float64 (float16 is computed in float32);
* C-contiguous, aligned and writeable (copies are made when needed; a kernel
  must never write into its inputs);
* Python ``bool`` / ``float`` scalars, already checked.

Used by :mod:`fastattn._api` and :mod:`fastattn.generation`; imports only
:mod:`fastattn.reference` (the memory check and the default scale).
"""

import math
import numbers

import numpy as np

from . import reference

COMPUTE_DTYPES = {
    np.dtype(np.float16): np.dtype(np.float32),
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float64): np.dtype(np.float64),
}


def native(dtype):
    """``dtype`` in this machine's byte order (``>f4`` -> ``float32``)."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def check_float_array(x, name, code=None):
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
    if native(x.dtype) not in COMPUTE_DTYPES:
        raise TypeError(
            f"{name} must have dtype float16, float32 or float64, got {x.dtype} "
            f"(cast it explicitly, e.g. {code}.astype(np.float32))"
        )


def check_array(x, name):
    """``x`` is a float array of rank >= 2, ``(..., n, d)``."""
    check_float_array(x, name)
    if x.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., n, d), got shape {x.shape}"
        )


#: The dtypes whose arrays :func:`check_qkv` passes in a few comparisons (NumPy's own
#: float32 and float64 dtype objects, which its arrays of those types share).
_FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_qkv(q, k, v=None):
    """Validate q, k, v (``v=None``: q and k alone, for weights); return (batch_shape,
    compute dtype, result dtype)."""
    if v is not None and type(q) is np.ndarray and type(k) is np.ndarray \
            and type(v) is np.ndarray:
        # The usual call, passed in a few comparisons (a decode step's checks are part of its
        # cost): plain arrays of one native float32 or float64 dtype whose shapes agree.  Any
        # other call takes the checks below, which say what is wrong.
        dtype, q_shape, k_shape, v_shape = q.dtype, q.shape, k.shape, v.shape
        if (k.dtype is dtype and v.dtype is dtype
                and (dtype is _FAST_DTYPES[0] or dtype is _FAST_DTYPES[1])
                and len(q_shape) == len(k_shape) == len(v_shape) >= 2
                and q_shape[:-2] == k_shape[:-2] == v_shape[:-2]
                and q_shape[-1] == k_shape[-1] > 0 and k_shape[-2] == v_shape[-2]):
            return q_shape[:-2], dtype, dtype
    named = ((q, "q"), (k, "k")) + (((v, "v"),) if v is not None else ())
    for x, name in named:
        check_array(x, name)
    if len({x.shape[:-2] for x, _ in named}) > 1:
        raise ValueError(
            f"{'q, k and v' if v is not None else 'q and k'} "
            f"must have the same leading (batch, head) dims; got "
            + ", ".join(f"{name} {x.shape}" for x, name in named)
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dim d_k; got q {q.shape} (d_k={q.shape[-1]}) "
            f"and k {k.shape} (d_k={k.shape[-1]})"
        )
    if v is None:
        v = k
    elif k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same sequence length n_k; got k {k.shape} "
            f"(n_k={k.shape[-2]}) and v {v.shape} (n_k={v.shape[-2]})"
        )
    if q.shape[-1] == 0:
        raise ValueError(f"d_k must be at least 1; got q {q.shape} and k {k.shape}")
    if q.dtype == k.dtype == v.dtype:
        result = native(q.dtype)
    else:
        result = np.result_type(native(q.dtype), native(k.dtype), native(v.dtype))
    return q.shape[:-2], COMPUTE_DTYPES[result], result


def as_kernel_input(x, dtype, name="an input"):
    """``x`` as a C-contiguous, aligned, writeable array of ``dtype`` with one batch dim;
    MemoryError naming ``name`` when a copy it needs (a broadcast view, another dtype) would
    not fit in the memory available."""
    if type(x) is not np.ndarray:
        x = np.asarray(x)  # a subclass (np.matrix, np.memmap) computes as the plain array
    shape = (math.prod(x.shape[:-2]),) + x.shape[-2:]
    flags = x.flags
    if x.dtype == dtype and flags.c_contiguous and flags.aligned and flags.writeable:
        return x if x.ndim == 3 else x.reshape(shape)   # a view
    # A copy: checked before the reshape too, which copies a view whose batch dims do not merge.
    reference.check_fits_in_memory(
        x.size * np.dtype(dtype).itemsize,
        f"a C-contiguous {np.dtype(dtype).name} copy of {name} (of {x.size:,} elements)",
        advice=f"pass a smaller {name}: a broadcast or strided view, and an array of "
               f"another dtype, is copied to compute")
    return np.require(x.reshape(shape), dtype=dtype, requirements=["C", "A", "W"])


def shape_text(*dims):
    """A shape with named dims, as a reader writes it: ``(2, 8, D)``, not ``(2, 8, 'D')``."""
    return "(" + ", ".join(map(str, dims)) + ")"


def check_positive_scalar(value, name, allow_zero):
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        value = value[()]   # a 0-d array (np.array(0.125), a scalar tensor's .numpy()) is its value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        got = (f"an array of shape {value.shape} and dtype {value.dtype}"
               if isinstance(value, np.ndarray) else type(value).__name__)
        raise TypeError(f"{name} must be a real number, got {got}")
    bound = ">= 0" if allow_zero else "> 0"
    try:
        value = float(value)
    except OverflowError:   # an int (or Fraction) beyond float64: 10**400
        raise ValueError(f"{name} must be a finite number {bound}, got {beyond_float(value)}, "
                         "which is inf as a float") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def beyond_float(value):
    """How a message writes a real number too large for a float: ``an int of about 10**400``
    (its 401 digits would be unreadable, and past 4,300 digits ``repr`` itself raises)."""
    if isinstance(value, numbers.Integral):
        return number_text(value)
    return f"a {type(value).__name__} beyond the float range"


def number_text(value):
    """``repr(value)``, but ``an int of about 10**400`` for an int of more than 30 digits."""
    if isinstance(value, numbers.Integral) and not -10**30 < value < 10**30:
        sign = "-" if value < 0 else ""
        return f"an int of about {sign}10**{int(math.log10(abs(int(value))))}"
    return repr(value)


#: The largest size of an array dimension: a larger one is refused as a ValueError naming it
#: (as a size that cannot be allocated would be a MemoryError), never an OverflowError.
LARGEST_DIM = int(np.iinfo(np.intp).max)


def check_eps(eps, fmap, dtype):
    """``eps`` as a float >= 0, finite in the computation ``dtype``; None gives the feature
    map's default (``fmap.default_eps``)."""
    if eps is None:
        return fmap.default_eps
    return finite_in(check_positive_scalar(eps, "eps", allow_zero=True), "eps", dtype)


#: The largest finite value of each computation dtype.
LARGEST = {dt: float(np.finfo(dt).max) for dt in (np.dtype(np.float32), np.dtype(np.float64))}


def check_scale(scale, d_k, dtype):
    """``scale`` as a float (default ``1 / sqrt(d_k)``), finite and > 0 in the computation ``dtype``."""
    if scale is None:
        return reference.default_scale(d_k)
    if type(scale) is float and 0.0 < scale <= LARGEST[dtype]:   # the usual call, at once
        return scale
    return finite_in(check_positive_scalar(scale, "scale", allow_zero=False), "scale", dtype)


def finite_in(value, name, dtype):
    """``value`` (a float >= 0), if it is finite in the computation ``dtype``; else ValueError."""
    if value > LARGEST[dtype]:
        raise ValueError(
            f"{name} must be finite in the computation dtype {dtype} (at most "
            f"{LARGEST[dtype]:.8g}), got {value!r}, which is inf in {dtype}"
        )
    return value


def check_dim(value, name, minimum):
    """``value`` as an int from ``minimum`` to :data:`LARGEST_DIM`; else ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or not minimum <= value <= LARGEST_DIM:
        raise ValueError(f"{name} must be an integer from {minimum} to {LARGEST_DIM:,}, "
                         f"got {number_text(value)}")
    return int(value)


def check_bool(value, name):
    if value is True or value is False:
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype == bool:
        value = value[()]   # a 0-d boolean array is its value, as for the scalars
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def beyond_dtype(x, dtype):
    """The largest finite ``|x|`` when it is inf in the narrower ``dtype`` (float64 values
    bound for float32), else None."""
    x = np.asarray(x)
    if x.dtype.itemsize <= np.dtype(dtype).itemsize or not x.size:
        return None
    with np.errstate(invalid="ignore"):
        top = float(np.max(np.abs(x), initial=0.0, where=np.isfinite(x)))
    return top if top > LARGEST[np.dtype(dtype)] else None


def check_state(initial_state, batch_shape, d_k, d_v, dtype, dim_name="d_k", fmap=None):
    """``initial_state`` as kernel arrays; ``d_k`` is the feature dimension, named ``dim_name``.

    For a map whose features are non-negative (``fmap.nonnegative``: all but Taylor) ``z``, a sum
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
        check_float_array(x, name, code)
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} {dims}, got {x.shape}")
    if fmap is not None and fmap.nonnegative and np.any(np.asarray(z) < 0):
        raise ValueError(
            f"initial_state[1] (z) must be >= 0 with the {fmap.name!r} feature map: it is a sum "
            f"of non-negative features; got min {float(np.min(z)):.6g}"
        )
    for x, name in ((S, "initial_state[0] (S)"), (z, "initial_state[1] (z)")):
        top = beyond_dtype(x, dtype)
        if top is not None:
            raise ValueError(
                f"{name} holds {top:.4g}, which is inf in the computation dtype {dtype} "
                f"(at most {LARGEST[dtype]:.8g}; q, k and v decide it): pass float64 q, k "
                f"and v to compute in float64")
    B = math.prod(batch_shape)
    S = np.require(np.asarray(S).reshape(B, d_k, d_v), dtype=dtype, requirements=["C", "A", "W"])
    z = np.require(np.asarray(z).reshape(B, d_k), dtype=dtype, requirements=["C", "A", "W"])
    return S, z


#: Copies of the ``(D, d_v)`` state a fast call holds at its peak: the
#: kernel's working states, the initial state and the one returned (measured:
#: Cython 2x, Numba 3x the state at d_k = d_v = 16384).
STATE_COPIES = 3


def check_state_fits(batch_shape, D, d_v, n_q, n_k, dtype, fmap):
    """MemoryError, before any work, when the ``(D, d_v)`` states (and the
    features of a map computed up front) cannot fit in available memory."""
    B = math.prod(batch_shape)
    itemsize = np.dtype(dtype).itemsize
    nbytes = STATE_COPIES * B * D * d_v * itemsize
    if fmap.elementwise is None:
        nbytes += B * (n_q + n_k) * D * itemsize
    reference.check_fits_in_memory(
        nbytes,
        f"linear attention with D={D:,} features and d_v={d_v:,}, for its "
        f"{batch_shape + (D, d_v)} states{'' if fmap.elementwise else ' and features'},",
        advice="the state grows as D x d_v (D = d_k for elu and relu, "
               "1 + d_k + d_k (d_k + 1) / 2 for taylor): give smaller head dims or fewer features",
    )


def dim_name(fmap):
    """How the state's feature dimension is named in messages: ``d_k`` or ``D``."""
    return "d_k" if fmap.elementwise else "D"
