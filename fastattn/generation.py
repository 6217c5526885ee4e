"""Generation, one token at a time: what a decoder keeps between steps.

* :class:`KVCache` -- the keys and values of softmax attention, preallocated
  for ``capacity`` tokens.  A step appends the new token's ``k, v`` and
  attends over the filled part; with few queries (a generated token) the
  split-key kernels read the cache in place, nothing is copied.  Memory:
  ``B · capacity · (d_k + d_v)`` values, growing work ``O(n · d)`` per token.
* :class:`LinearAttentionState` -- the state ``(S, z)`` of causal linear
  attention (Katharopoulos et al., "Transformers are RNNs", 2020):
  ``B · (d_k · d_v + d_k)`` values whatever the length, ``O(d_k · d_v)`` work
  per token.

Both validate what they are given as :func:`fastattn.softmax_attention` and
:func:`fastattn.linear_attention` do (the same checks, in :mod:`fastattn._checks`).
"""

import contextlib
import math
import numbers

import numpy as np

from . import _api, _backends, _checks, _overflow, _policy, feature_maps, reference

_STORAGE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

#: The advice of a KVCache too large for the memory: it is batch x capacity x (d_k + d_v).
_SMALLER_CACHE = "give a smaller capacity, d_k, d_v or batch_shape"


@contextlib.contextmanager
def _refusing_overflow(what, whose, dtype, advice):
    """Inside: a cast into ``dtype`` that overflows (float64 beyond 3.4e38 into float32) is a
    ValueError naming ``what`` holds the values and ``whose`` dtype it is, not a silent inf."""
    try:
        with np.errstate(over="raise"):
            yield
    except FloatingPointError:
        raise ValueError(
            f"{what} holds finite values beyond the range of {whose} dtype {dtype} (largest "
            f"{np.finfo(dtype).max:.4g}), which would be stored as inf; {advice}") from None


def _check_batch_shape(batch_shape):
    if isinstance(batch_shape, numbers.Integral) and not isinstance(batch_shape, bool):
        batch_shape = (batch_shape,)
    if not isinstance(batch_shape, (tuple, list)):
        raise TypeError(
            f"batch_shape must be a tuple of ints (the leading batch, head dims), "
            f"got {type(batch_shape).__name__}"
        )
    return tuple(_checks.check_dim(b, "every entry of batch_shape", 0) for b in batch_shape)


def _check_storage_dtype(dtype):
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dtype not in _STORAGE_DTYPES:
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


class KVCache:
    """Preallocated keys and values for softmax-attention decoding.

    Parameters
    ----------
    batch_shape : tuple of int
        Leading dims of every ``q, k, v`` (e.g. ``(batch, heads)``); ``()``
        for a single head.  A list, or one int for one leading dim, is
        taken too.
    capacity : int
        Most tokens the cache can hold, >= 1.
    d_k : int
        Key (and query) head dimension, >= 1.
    d_v : int, optional
        Value head dimension; default ``d_k``.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        Storage dtype; appended keys and values are cast to it.

    Attributes
    ----------
    length : int
        Tokens held so far; read-only (:meth:`append` and :meth:`reset`
        change it).
    capacity : int
        Read-only, as ``batch_shape``, ``d_k``, ``d_v`` and ``dtype``.
    nbytes : int
        Bytes of the preallocated buffers, ``B · capacity · (d_k + d_v) ·
        itemsize`` for ``B = prod(batch_shape)``.

    Raises
    ------
    TypeError
        If ``batch_shape`` is not an int, tuple or list, or ``dtype`` is not
        float32 or float64.
    ValueError
        If ``capacity``, ``d_k`` or ``d_v`` is not a positive integer, or an
        entry of ``batch_shape`` is not an integer >= 0 (any of them beyond an
        array dimension, ``2**63 - 1``, too).
    MemoryError
        If the buffers for ``capacity`` keys and values cannot be allocated.

    Notes
    -----
    A generation step costs ``O(B · n · (d_k + d_v))`` time for ``n`` cached
    tokens (``4 · n · d`` flops per head and token) and reads the whole cache
    once; the memory held grows as ``2 · n · d`` values per head.  For the
    split-key kernels see Dao et al., "Flash-Decoding for long-context
    inference" (2023).

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> cache = fastattn.KVCache((2, 4), capacity=128, d_k=16)
    >>> for _ in range(3):
    ...     q, k, v = (rng.standard_normal((2, 4, 1, 16), dtype=np.float32) for _ in range(3))
    ...     cache.append(k, v)
    ...     out = cache.attend(q)
    >>> cache.length, out.shape
    (3, (2, 4, 1, 16))
    """

    def __init__(self, batch_shape, capacity, d_k, d_v=None, *, dtype=np.float32):
        self._batch_shape = _check_batch_shape(batch_shape)
        self._capacity = _checks.check_dim(capacity, "capacity", 1)
        self._d_k = _checks.check_dim(d_k, "d_k", 1)
        self._d_v = self._d_k if d_v is None else _checks.check_dim(d_v, "d_v", 1)
        self._dtype = _check_storage_dtype(dtype)
        self._length = 0
        need = math.prod(self.batch_shape) * self.capacity * (self.d_k + self.d_v) \
            * self.dtype.itemsize
        what = (f"KVCache: capacity={self.capacity}, for the keys and values of batch shape "
                f"{self.batch_shape},")
        # Checked before allocating: np.empty of more than the RAM can succeed (the pages
        # are only promised) and fail later, in the middle of a generation.
        reference.check_fits_in_memory(need, what, advice=_SMALLER_CACHE)
        try:
            self._k = np.empty(self.batch_shape + (self.capacity, self.d_k), self.dtype)
            self._v = np.empty(self.batch_shape + (self.capacity, self.d_v), self.dtype)
        except (MemoryError, ValueError) as exc:  # numpy: "array is too big" or no memory
            raise MemoryError(f"{what} needs {need:,} bytes, more than this machine can "
                              f"allocate ({exc}); {_SMALLER_CACHE}") from None

    # Read-only: the kernels index the buffers by these, so a length or shape
    # set from outside would read past the buffers; append and reset change them.
    batch_shape = property(lambda self: self._batch_shape)
    capacity = property(lambda self: self._capacity)
    d_k = property(lambda self: self._d_k)
    d_v = property(lambda self: self._d_v)
    dtype = property(lambda self: self._dtype)
    length = property(lambda self: self._length)

    @property
    def nbytes(self):
        return self._k.nbytes + self._v.nbytes

    def _filled(self, buffer):
        view = buffer[..., : self.length, :]
        view.flags.writeable = False
        return view

    @property
    def keys(self):
        """Read-only view of the cached keys, shape ``batch_shape + (length, d_k)``."""
        return self._filled(self._k)

    @property
    def values(self):
        """Read-only view of the cached values, shape ``batch_shape + (length, d_v)``."""
        return self._filled(self._v)

    def reset(self):
        """Forget every token (the buffers are kept)."""
        self._length = 0

    def append(self, k, v):
        """Add the keys and values of ``t`` new tokens.

        Parameters
        ----------
        k : ndarray of shape batch_shape + (t, d_k)
        v : ndarray of shape batch_shape + (t, d_v)
            float16, float32 or float64, any layout; cast to the cache's dtype.

        Raises
        ------
        TypeError
            If ``k`` or ``v`` is not a float ndarray.
        ValueError
            If a shape does not match the cache, the cache has no room for
            ``t`` more tokens (the message gives length and capacity), or a
            finite value would overflow the cache's dtype (float64 values
            beyond 3.4e38 in a float32 cache).  The cache is unchanged.
        """
        for x, name, d in ((k, "k", self.d_k), (v, "v", self.d_v)):
            _checks.check_array(x, name)
            want = self.batch_shape + (x.shape[-2], d)
            if x.shape != want:
                raise ValueError(
                    f"{name} must have shape batch_shape + (t, {d}) = "
                    f"{_checks.shape_text(*self.batch_shape, 't', d)}, got {x.shape}"
                )
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(f"k and v must hold the same number of tokens; got k {k.shape}, v {v.shape}")
        t = k.shape[-2]
        if self.length + t > self.capacity:
            raise ValueError(
                f"KVCache is full: it holds {self.length} of {self.capacity} tokens and cannot "
                f"append {t} more; create it with a larger capacity"
            )
        for buffer, x, name in ((self._k, k, "k"), (self._v, v, "v")):
            with _refusing_overflow(name, "this cache's", self.dtype, "rescale them, or make "
                                    "the cache with dtype=np.float64"):
                buffer[..., self.length : self.length + t, :] = x
        self._length += t

    def attend(self, q, *, causal=True, scale=None, backend="auto"):
        """Softmax attention of ``q`` over the cached keys and values.

        Equals ``softmax_attention(q, cache.keys, cache.values, causal=causal,
        scale=scale, backend=backend)``.  When the queries are few enough for
        the split-key kernel (:func:`fastattn._policy.use_split_keys`, the rule
        of the backends' own ``softmax_forward``), computed in the cache's
        dtype, on the Numba or Cython backend, that kernel reads the
        buffers in place; otherwise the filled part is passed to
        :func:`fastattn.softmax_attention` (which copies it when
        ``batch_shape`` has more than one element).

        Parameters
        ----------
        q : ndarray of shape batch_shape + (n_q, d_k)
        causal : bool, default True
            Bottom-right aligned: query ``i`` sees the cached keys up to
            ``length - n_q + i``, so the queries of the last ``n_q`` appended
            tokens see themselves and what came before.
        scale : float, optional
            Default ``1 / sqrt(d_k)``.
        backend : {"auto", "reference", "numba", "cython"}, default "auto"

        Returns
        -------
        out : ndarray of shape batch_shape + (n_q, d_v)
            dtypes as :func:`fastattn.softmax_attention`.

        Raises
        ------
        TypeError, ValueError
            As :func:`fastattn.softmax_attention` (shapes named in the message).
        """
        keys, values = self.keys, self.values
        batch_shape, dtype, result = _checks.check_qkv(q, keys, values)
        causal = _checks.check_bool(causal, "causal")
        n_q = q.shape[-2]
        name = _backends.backend_name(backend)
        decode = _backends.decode_module(name)
        if (decode is None or dtype != self.dtype or not _policy.use_split_keys(n_q)
                or 0 in q.shape or self.length == 0):
            return _api.softmax_attention(q, keys, values, causal=causal, scale=scale, backend=name)
        scale = _checks.check_scale(scale, self.d_k, dtype)
        B = math.prod(batch_shape)
        k = self._k.reshape(B, self.capacity, self.d_k)
        v = self._v.reshape(B, self.capacity, self.d_v)
        out = _overflow.finite_softmax(
            lambda q, k, v: decode.cache_softmax_forward(q, k, v, causal, scale, self.length),
            _checks.as_kernel_input(q, dtype, "q"), k, v,
            seen=(k[:, :self.length], v[:, :self.length]))
        return out.reshape(batch_shape + (n_q, self.d_v)).astype(result, copy=False)


class LinearAttentionState:
    """The running state ``(S, z)`` of causal linear attention, for generation.

    ``S = Σ_j φ(k_j)ᵀ v_j`` of shape ``batch_shape + (D, d_v)`` and
    ``z = Σ_j φ(k_j)`` of shape ``batch_shape + (D,)`` over the tokens seen,
    ``D`` the feature map's dimension (``d_k`` for elu and relu);
    a step of one token gives ``out = φ(q) S / (φ(q) · z + eps)`` with the
    token's own key included (Katharopoulos et al., "Transformers are RNNs",
    2020).  Stepping through a sequence token by token equals one causal
    :func:`fastattn.linear_attention` pass (with FAVOR+ when ``eps`` is 0, its
    default: another ``eps`` is measured in each step's shifted frame, see
    :class:`fastattn.FavorFeatures`).

    Parameters
    ----------
    batch_shape : tuple of int
        Leading dims of every ``q, k, v``; ``()`` for a single head.  A
        list, or one int for one leading dim, is taken too.
    d_k : int
        Key (and query) head dimension, >= 1.
    d_v : int, optional
        Value head dimension; default ``d_k``.
    feature_map : {"elu", "relu", "favor", "taylor"}, FavorFeatures or callable, default "elu"
        As :func:`fastattn.linear_attention`; checked here.  A callable's
        ``D`` is known once it has run: ``S`` and ``z`` are None until the
        first step.
    eps : float, optional
        Added to the denominator; finite and >= 0.  Default (None) as
        :func:`fastattn.linear_attention`: 0 for FAVOR+, else ``1e-6``.
    dtype : {numpy.float32, numpy.float64}, default numpy.float32
        Dtype the state is kept in, and each step computed in when it is
        the wider: float32 tokens into a float64 state run in float64 (their
        output is returned as float32).

    Attributes
    ----------
    S : ndarray of shape batch_shape + (D, d_v)
    z : ndarray of shape batch_shape + (D,)
    tokens : int
        Tokens absorbed so far.  These and the parameters above are
        read-only attributes (:meth:`step` and :meth:`reset` change the
        state); to start from a state of your own, pass it to
        :func:`fastattn.linear_attention` as ``initial_state``.
    nbytes : int
        Bytes of the state: ``B · (D · d_v + D) · itemsize``, whatever
        the number of tokens.

    Raises
    ------
    TypeError
        If ``batch_shape`` is not an int, tuple or list, ``dtype`` is not
        float32 or float64, or ``eps`` is not a real number.
    ValueError
        If ``d_k`` or ``d_v`` is not a positive integer, an entry of
        ``batch_shape`` is not an integer >= 0 (any of them beyond an array
        dimension, ``2**63 - 1``, too), ``eps`` is
        negative or not finite, or ``feature_map`` is not a feature map for
        ``d_k``.

    Notes
    -----
    A step costs ``O(B · D · d_v)`` time (``4 · D · d_v`` flops per head
    and token, plus the features) whatever the context length.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> state = fastattn.LinearAttentionState((4,), d_k=16)
    >>> q, k, v = (rng.standard_normal((4, 1, 16), dtype=np.float32) for _ in range(3))
    >>> state.step(q, k, v).shape, state.tokens
    ((4, 1, 16), 1)
    """

    def __init__(self, batch_shape, d_k, d_v=None, *, feature_map="elu", eps=None,
                 dtype=np.float32):
        self._batch_shape = _check_batch_shape(batch_shape)
        self._d_k = _checks.check_dim(d_k, "d_k", 1)
        self._d_v = self._d_k if d_v is None else _checks.check_dim(d_v, "d_v", 1)
        self._dtype = _check_storage_dtype(dtype)
        # eps is checked against the state's dtype now, not only at the first step.
        self._eps = None if eps is None else _checks.finite_in(
            _checks.check_positive_scalar(eps, "eps", allow_zero=True), "eps", self._dtype)
        self._feature_map = feature_map
        self._num_features = feature_maps.resolve(
            feature_map, self._d_k, d_k_of="this LinearAttentionState has").feature_dim(self._d_k)
        self.reset()

    # Read-only: the state's shape and its token count follow from the steps
    # taken; reset and step change them.
    batch_shape = property(lambda self: self._batch_shape)
    d_k = property(lambda self: self._d_k)
    d_v = property(lambda self: self._d_v)
    dtype = property(lambda self: self._dtype)
    eps = property(lambda self: self._eps)
    feature_map = property(lambda self: self._feature_map)
    num_features = property(lambda self: self._num_features)
    S = property(lambda self: self._S)
    z = property(lambda self: self._z)
    tokens = property(lambda self: self._tokens)

    @property
    def nbytes(self):
        return 0 if self.S is None else self.S.nbytes + self.z.nbytes

    def reset(self):
        """Back to no tokens: ``S = 0``, ``z = 0`` (None for a callable's unknown ``D``)."""
        D = self.num_features
        if D is not None:
            need = math.prod(self.batch_shape) * D * (self.d_v + 1) * self.dtype.itemsize
            shape = _checks.shape_text(*self.batch_shape, D, self.d_v)
            reference.check_fits_in_memory(
                need, f"LinearAttentionState: the state S {shape} and z, of D={D} features,",
                advice="give a smaller batch_shape, d_k or d_v")
        self._S = None if D is None else np.zeros(self.batch_shape + (D, self.d_v), self.dtype)
        self._z = None if D is None else np.zeros(self.batch_shape + (D,), self.dtype)
        self._tokens = 0

    def step(self, q, k, v, *, backend="auto"):
        """Absorb ``t`` tokens and return their outputs (causal).

        Parameters
        ----------
        q : ndarray of shape batch_shape + (t, d_k)
        k : ndarray of shape batch_shape + (t, d_k)
        v : ndarray of shape batch_shape + (t, d_v)
            ``t = 1`` for a generated token; a prompt may come in one step.
        backend : {"auto", "reference", "numba", "cython"}, default "auto"

        Returns
        -------
        out : ndarray of shape batch_shape + (t, d_v)
            ``linear_attention(q, k, v, causal=True, initial_state=(S, z))``.

        Raises
        ------
        TypeError, ValueError
            As :func:`fastattn.linear_attention`; ``q``, ``k`` and ``v`` must
            match the state's ``batch_shape``, ``d_k`` and ``d_v`` (the message
            names the argument and the shape expected) and hold the same
            number of tokens; ValueError too if the new state would overflow the
            state's dtype (float64 tokens beyond 3.4e38 into a float32 state).
            The state is unchanged after an error.
        """
        for x, name, dim in ((q, "q", "d_k"), (k, "k", "d_k"), (v, "v", "d_v")):
            _checks.check_array(x, name)
            d = getattr(self, dim)
            if x.shape != self.batch_shape + (x.shape[-2], d):
                raise ValueError(
                    f"{name} must have shape batch_shape + (t, {dim}) = "
                    f"{_checks.shape_text(*self.batch_shape, 't', d)}, this state's, got {x.shape}"
                )
        if not q.shape[-2] == k.shape[-2] == v.shape[-2]:
            raise ValueError(f"q, k and v must hold the same number of tokens; got q {q.shape}, "
                             f"k {k.shape}, v {v.shape}")
        result = np.result_type(*(np.asarray(x).dtype for x in (q, k, v)))
        if self.dtype.itemsize > result.itemsize and result.kind == "f":
            # A float64 state is computed in float64 (tokens of float32 keys and values of
            # 1e25 or 1e-30 would over- or underflow in float32), returned in their dtype.
            q, k, v = (np.asarray(x, dtype=self.dtype) for x in (q, k, v))
        try:
            out, (S, z) = _api.linear_attention(
                q, k, v, feature_map=self.feature_map, causal=True, eps=self.eps,
                initial_state=None if self.S is None else (self.S, self.z), return_state=True,
                backend=backend,
            )
        except ValueError as exc:
            # The caller passed no initial_state: name the state's own arrays,
            # which only a change in place can have made wrong.
            message = str(exc)
            for name, own in (("initial_state[0] (S)", "S"), ("initial_state[1] (z)", "z")):
                message = message.replace(
                    name, f"this LinearAttentionState's {own} (changed in place since the last "
                          f"step, or a callable feature_map whose D changed?)")
            if message == str(exc):
                raise
            raise ValueError(message) from None
        with _refusing_overflow("the state after these tokens", "this state's", self.dtype,
                                "rescale k and v, or make the state with dtype=np.float64. "
                                "The state is unchanged"):
            S, z = S.astype(self.dtype, copy=False), z.astype(self.dtype, copy=False)
        self._S, self._z = S, z
        self._tokens += k.shape[-2]
        if out.dtype != result and result.kind == "f":
            with np.errstate(over="ignore"):   # beyond the tokens' dtype: inf, as it says
                out = out.astype(result)
        return out
