"""Softmax calls kept inside their dtype's range: one rule for the API, the KV cache and
every backend.

The kernels compute ``softmax(scale · q kᵀ) v`` with the scale applied to the
logits (so ``scale · q`` never overflows where the logits do not).  Two finite
inputs can still leave the dtype's range on the way to a finite answer:

* ``q · k`` overflows before a small ``scale`` brings it back (``q``, ``k`` of
  1e30 and ``scale = 1e-59`` in float32: logits of at most 78).  With
  ``scale < 1`` the query is scaled first (:func:`kernel_query`): ``|scale · q|
  <= |q|`` cannot overflow, and ``(scale · q) · k`` overflows only where the
  logits do.  One ``O(n_q · d_k)`` pass, in float64 and rounded once, so a
  scale below float32's smallest number still scales.  Each backend's
  ``softmax_forward`` and ``cache_softmax_forward`` applies it to the ``q`` and
  ``scale`` it is given (the Cython decode step in C, where a NumPy call would cost
  more than a short step's keys).
* The unnormalised output ``Σ_j exp(s_j − m) v_j`` overflows although the
  answer, a weighted average of the values, does not (1,024 keys whose values
  are 1e36 in float32).  That always shows in the output, so
  :func:`finite_softmax` pays one pass over it (:func:`output_finite`), ``O(n_q · d_v)``,
  unless the kernel checked its output itself, and only the rare call whose output
  comes out non-finite from finite inputs is made again: a float32 call in float64
  (which holds every product of float32 numbers), then rounded; a float64 call with
  ``v`` divided by a power of two (exact), the output multiplied back.
"""

import numpy as np


def kernel_query(q, scale, rounded_product=None):
    """``(q, scale)`` for the kernels: ``(scale · q, 1)`` when ``scale < 1``, else as given.

    The product is formed in float64 and rounded once, so a scale below the dtype's
    smallest number (1e-59 in float32, which would be 0 there) still scales ``q``.  A
    scale the dtype holds exactly (``1 / sqrt(64)``) multiplies in the dtype: the same
    bits (a float32 product is the float64 one, rounded once), at the dtype's speed (a
    float32 q of 8 x 4096 x 64: 0.21 ms, where the float64 product and its copy took 2.6).
    ``rounded_product(q, scale)``, when given, forms that float64 product rounded once in
    place of NumPy's casting multiply (the Cython backend's, in one pass on its threads).
    """
    if scale >= 1:
        return q, scale
    narrow = q.dtype.type(scale)
    if float(narrow) == scale:     # compared in float64 (NumPy would compare in the dtype)
        return q * narrow, 1.0
    if rounded_product is not None:
        return rounded_product(q, scale), 1.0
    # In float64, rounded into the dtype in NumPy's buffers: no float64 copy of q.
    return np.multiply(q, np.float64(scale), out=np.empty_like(q), casting="same_kind"), 1.0


#: Outputs up to this many elements are checked element by element (``isfinite``, exact);
#: larger ones by their sum.  Measured here (float32): 786,432 elements, 61 against 122 µs
#: (NumPy's pairwise sum is slower than isfinite in cache); 8,388,608, 1.68 against 1.35
#: ms, before the bool array's page faults.
_SMALL_OUTPUT = 1 << 22


def output_finite(out):
    """Whether every element of a call's output may be taken as finite, from one pass.

    Up to ``_SMALL_OUTPUT`` elements ``isfinite``, exact.  Beyond, a pass that allocates
    nothing: the sum of ``out`` is NaN or inf when an element is, and finite when all are,
    unless the sum itself overflows (elements near the dtype's largest), where this says
    False of finite elements and the caller computes the call again, wider: time, not a
    different answer.  (``isfinite(out).all()`` writes a bool array the size of ``out``: a
    twentieth of a float32 linear call of 8 x 16384 x 64, with its page faults.)"""
    if out.size <= _SMALL_OUTPUT:      # no temporary worth avoiding: exact, and no errstate
        return bool(np.isfinite(out).all())
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.add.reduce(out, axis=None)))


def finite_softmax(call, q, k, v, seen=None):
    """``call(q, k, v)``, made again as the module docstring says when its output is
    non-finite although the inputs (``q`` and ``seen``, the keys and values the call
    reads: default ``(k, v)``) are finite.  A NaN or inf given is taken as given.

    ``call`` returns ``out``, or ``(out, finite)`` when the kernel checked every element of
    ``out`` itself (the Cython decode step, as its merge ends): then no pass here."""
    out, finite = _result(call(q, k, v))
    if finite or (finite is None and output_finite(out)):
        return out
    seen_k, seen_v = (k, v) if seen is None else seen
    if not (np.isfinite(q).all() and np.isfinite(seen_k).all() and np.isfinite(seen_v).all()):
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        if q.dtype == np.float32:
            wide = _result(call(*(x.astype(np.float64) for x in (q, k, v))))[0]
            return wide.astype(np.float32)
        top = float(np.max(np.abs(seen_v))) if seen_v.size else 0.0
        if top == 0.0:
            return out
        c = 2.0 ** np.ceil(np.log2(top))
        return _result(call(q, k, v / c))[0] * c


def _result(returned):
    """``(out, finite)`` of what a softmax call returned: ``finite`` None when it gave
    ``out`` alone."""
    return returned if isinstance(returned, tuple) else (returned, None)
