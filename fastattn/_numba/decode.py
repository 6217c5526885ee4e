"""Decode kernels in Numba: split-key softmax (Flash-Decoding) and the recurrent linear step.

When a call has few queries (a generated token, see :func:`fastattn._policy.use_split_keys`)
and many keys (a KV cache), the tiled kernel of :mod:`.softmax` has one work
item per head and leaves cores idle when there are fewer heads than threads.
Here the keys of each head are cut in ``n_splits`` contiguous ranges; one
work item runs the online softmax of every query of its head over its range
only, keeping its own running maximum ``m``, sum ``l`` and unnormalised output
``acc`` (Milakov & Gimelshein 2018), in key blocks of ``block_k`` keys (one
BLAS product each for the scores and for ``p v``).  The partial results are
then merged with the usual rescaling (Dao et al., "Flash-Decoding for
long-context inference", 2023)::

    M   = max_s m_s
    out = Σ_s exp(m_s - M) acc_s / Σ_s exp(m_s - M) l_s

Causal stays bottom-right aligned (query ``i`` sees key ``j <= i + n_k - n_q``);
in a key block the diagonal crosses, each row forms only the terms it sees
(``p v`` is then formed row by row if a masked value is not finite, so a
NaN or inf behind the mask never reaches a row), and a row that sees no key
is 0.

:func:`recurrent_linear_step` is linear attention for one query and one key
(a generated token) from a state: one serial pass over ``S`` that updates it
and reads it, with no BLAS call and no thread pool woken.
"""

import numpy as np
from numba import njit, prange

from .._overflow import kernel_query
from .._policy import split_count
from .config import JIT_PARALLEL, JIT_SERIAL, SPLIT_KEYS_BLOCK_K
from ._exp import fast_exp_nonpositive
from .linear import row_scale
from ._online import online_softmax_block
from ._threads import get_num_threads, launch


@njit(**JIT_PARALLEL)
def split_key_softmax(q, k, v, n_k, causal, consts, n_splits, block_k):
    """Split-key online softmax over the first ``n_k`` keys; see the module docstring.

    ``consts`` holds ``(scale, -inf, 0)`` in the dtype of ``q``.  Returns
    ``out (B, n_q, d_v)``.
    """
    B, n_q, d_k = q.shape
    d_v = v.shape[2]
    scale, neg_inf, zero = consts[0], consts[1], consts[2]
    off = n_k - n_q
    span = -(-n_k // n_splits)
    part_m = np.empty((B, n_splits, n_q), dtype=q.dtype)
    part_l = np.empty((B, n_splits, n_q), dtype=q.dtype)
    part_acc = np.empty((B, n_splits, n_q, d_v), dtype=q.dtype)
    for item in prange(B * n_splits):
        b = item // n_splits
        sp = item % n_splits
        m = part_m[b, sp]
        l = part_l[b, sp]
        acc = part_acc[b, sp]
        qs = np.empty((n_q, d_k), dtype=q.dtype)
        sbuf = np.empty(n_q * block_k, dtype=q.dtype)
        tmp = np.empty((n_q, d_v), dtype=q.dtype)
        alpha = np.empty(n_q, dtype=q.dtype)
        for i in range(n_q):
            m[i] = neg_inf
            l[i] = zero
            for c in range(d_v):
                acc[i, c] = zero
            for c in range(d_k):
                qs[i, c] = q[b, i, c]
        j_lo = sp * span
        # Keys of this range that the last query sees (all of them: the
        # mask is aligned at the bottom right).
        j_hi = min(n_k, j_lo + span)
        for j0 in range(j_lo, j_hi, block_k):
            j1 = min(j_hi, j0 + block_k)
            cols = j1 - j0
            s = sbuf[: n_q * cols].reshape((n_q, cols))
            np.dot(qs, k[b, j0:j1].T, s)
            # Does the block cross the diagonal (row 0 does not see every key)?
            crosses = causal and j1 - 1 > off
            online_softmax_block(s, n_q, cols, off + 1 - j0, crosses, scale, m, l, alpha,
                                 neg_inf, zero)
            use_gemm = True
            if crosses:
                for j in range(cols):
                    for c in range(d_v):
                        if not np.isfinite(v[b, j0 + j, c]):
                            use_gemm = False
            if use_gemm:
                np.dot(s, v[b, j0:j1], tmp)
                for i in range(n_q):
                    a = alpha[i]
                    for c in range(d_v):
                        acc[i, c] = acc[i, c] * a + tmp[i, c]
            else:
                for i in range(n_q):
                    a = alpha[i]
                    for c in range(d_v):
                        acc[i, c] *= a
                    lim = min(cols, i + off + 1 - j0)
                    for j in range(lim):
                        p = s[i, j]
                        for c in range(d_v):
                            acc[i, c] += p * v[b, j0 + j, c]
    out = np.empty((B, n_q, d_v), dtype=q.dtype)
    for item in prange(B * n_q):
        b = item // n_q
        i = item % n_q
        mx = neg_inf
        for sp in range(n_splits):
            if part_m[b, sp, i] > mx:
                mx = part_m[b, sp, i]
        total = zero
        for c in range(d_v):
            out[b, i, c] = zero
        for sp in range(n_splits):
            pm = part_m[b, sp, i]
            # A range where the row saw no key (l = 0) adds nothing; a NaN
            # logit made its l or m NaN, and so the row, as in the reference.
            if part_l[b, sp, i] == zero:
                continue
            w = fast_exp_nonpositive(pm - mx)
            total += w * part_l[b, sp, i]
            for c in range(d_v):
                out[b, i, c] += w * part_acc[b, sp, i, c]
        # total == 0: the row saw no key (or only -inf logits): 0.
        if total != zero:
            r = 1 / total
            for c in range(d_v):
                out[b, i, c] *= r
    return out


def split_key_softmax_forward(q, k, v, causal, scale, n_splits=None, n_k=None):
    """Softmax attention ``softmax(q kᵀ · scale) v`` with the keys split across threads.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k)
        float32 or float64, C-contiguous (validated by :mod:`fastattn._checks`);
        meant for few queries (:func:`fastattn._policy.use_split_keys`), correct for any ``n_q``.
    k : ndarray of shape (B, n_k, d_k)
    v : ndarray of shape (B, n_k, d_v)
    causal : bool
        Bottom-right aligned mask: query ``i`` sees key ``j`` when
        ``j <= i + n_k - n_q``; a row that sees no key is 0.
    scale : float
        Multiplies the logits.
    n_splits : int, optional
        Key ranges per head, from 1 to ``n_k``; default
        :func:`fastattn._policy.split_count` for the threads in use.
    n_k : int, optional
        Keys in use, ``1 <= n_k <= k.shape[1]`` (default all): the filled
        length of a KV cache whose whole buffer is passed, uncopied.

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v), dtype of ``q``

    Notes
    -----
    Time ``O(B n_q n_k (d_k + d_v))``; extra memory
    ``O(B · n_splits · n_q · d_v)`` for the partial results plus a
    ``n_q x SPLIT_KEYS_BLOCK_K`` score block per work item.  Flash-Decoding
    (Dao, Haziza, Massa, Sizov 2023) over the online softmax of Milakov &
    Gimelshein (2018).
    """
    batch = q.shape[0]
    n_k = k.shape[1] if n_k is None else int(n_k)
    if n_splits is None:
        n_splits = split_count(batch, n_k, get_num_threads())
    n_splits = max(1, min(int(n_splits), n_k))
    consts = np.array([scale, -np.inf, 0.0], dtype=q.dtype)
    block_k = min(SPLIT_KEYS_BLOCK_K, -(-n_k // n_splits))
    work = batch * q.shape[1] * n_k * (q.shape[2] + v.shape[2])
    with launch(batch * n_splits, work) as pick:
        return pick(split_key_softmax)(q, k, v, n_k, bool(causal), consts, n_splits, block_k)


@njit(**JIT_SERIAL)
def _recurrent_step(q, k, v, relu, eps, nan, S0, z0):
    """``S = S0 + φ(k)ᵀ v``, ``z = z0 + φ(k)``, ``out = φ(q) S / (φ(q)·z + eps)`` per head
    (``nan``: a NaN of the dtype, for an overflowed denominator)."""
    B, _, d_k = q.shape
    d_v = v.shape[2]
    zero = q.dtype.type(0)
    S = np.empty_like(S0)
    z = np.empty_like(z0)
    out = np.empty((B, 1, d_v), dtype=q.dtype)
    phi_k = np.empty(d_k, dtype=q.dtype)
    phi_q = np.empty(d_k, dtype=q.dtype)
    for b in range(B):
        for a in range(d_k):
            x = k[b, 0, a]
            y = q[b, 0, a]
            if relu:
                phi_k[a] = max(x, zero) if x == x else x
                phi_q[a] = max(y, zero) if y == y else y
            else:
                phi_k[a] = x + 1 if x > zero else fast_exp_nonpositive(x)
                phi_q[a] = y + 1 if y > zero else fast_exp_nonpositive(y)
        den = zero
        for c in range(d_v):
            out[b, 0, c] = zero
        for a in range(d_k):
            fk = phi_k[a]
            fq = phi_q[a]
            z[b, a] = z0[b, a] + fk
            den += fq * z[b, a]
            for c in range(d_v):
                S[b, a, c] = S0[b, a, c] + fk * v[b, 0, c]
                out[b, 0, c] += fq * S[b, a, c]
        r = row_scale(den + eps, 1, zero, nan)   # 1 / den in float64, as it always was
        for c in range(d_v):
            out[b, 0, c] *= r
    return out, S, z


def recurrent_linear_step(q, k, v, feature_map, eps, S0=None, z0=None):
    """Linear attention for one query and one key from a state (a generated token).

    ``S = S0 + φ(k)ᵀ v``, ``z = z0 + φ(k)``, ``out = φ(q) S / (φ(q)·z + eps)``
    (Katharopoulos et al., "Transformers are RNNs", 2020), 0 where the
    denominator is exactly 0, NaN where it overflowed.  With one query and one
    key, causal and non-causal attention are the same.

    Parameters
    ----------
    q : ndarray of shape (B, 1, d_k)
        float32 or float64, C-contiguous (validated by :mod:`fastattn._checks`).
    k : ndarray of shape (B, 1, d_k)
    v : ndarray of shape (B, 1, d_v)
    feature_map : {"elu", "relu"}
    eps : float
        Added to the denominator.
    S0 : ndarray of shape (B, d_k, d_v), optional
        State before the token (not modified); default zeros.
    z0 : ndarray of shape (B, d_k), optional

    Returns
    -------
    out : ndarray of shape (B, 1, d_v)
    S : ndarray of shape (B, d_k, d_v)
    z : ndarray of shape (B, d_k)

    Notes
    -----
    ``4 · B · d_k · d_v`` flops, serial (too little work to wake the
    threads), one pass over the state.  ``feature_map`` is checked by
    :mod:`fastattn.feature_maps`, not here.
    """
    if S0 is None:
        S0 = np.zeros((q.shape[0], q.shape[2], v.shape[2]), dtype=q.dtype)
        z0 = np.zeros((q.shape[0], q.shape[2]), dtype=q.dtype)
    return _recurrent_step(q, k, v, feature_map == "relu", q.dtype.type(eps),
                           q.dtype.type(np.nan), S0, z0)


def linear_forward(q, k, v, feature_map, causal, eps, S0=None, z0=None):
    """The backend interface's ``linear_forward`` for one query and one key: :func:`recurrent_linear_step`."""
    return recurrent_linear_step(q, k, v, feature_map, eps, S0, z0)


def cache_softmax_forward(q, k, v, causal, scale, n_k):
    """Softmax attention over the first ``n_k`` keys of ``k (B, capacity, d_k)`` (a KV cache), no
    copy; a scale below 1 multiplies ``q`` first (:func:`fastattn._overflow.kernel_query`)."""
    q, scale = kernel_query(q, scale)
    return split_key_softmax_forward(q, k, v, causal, scale, n_k=n_k)
