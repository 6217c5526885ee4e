"""Tiled online-softmax attention (the FlashAttention forward pass) in Numba.

For one head, queries are cut in blocks of ``SOFTMAX_BLOCK_Q`` rows and keys
in blocks of ``SOFTMAX_BLOCK_K``.  A query block walks over the key blocks it
can see, keeping per row a running maximum ``m``, a running sum ``l`` of
``exp(s - m)`` and an unnormalised output ``acc`` (Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018; Dao et al.,
"FlashAttention", 2022)::

    s     = q_blk k_blkᵀ                             (BLAS gemm, one thread)
    m'    = max(m, rowmax(scale s))                 (the logits, in place)
    p     = exp(scale s - m')                       (vectorised fast exp)
    alpha = exp(m - m')
    l     = alpha l + rowsum(p);  acc = alpha acc + p v_blk
    out   = acc / l

The scale is applied to the scores, in the pass that finds their maximum; a
scale below 1 multiplies q first (:func:`fastattn._overflow.kernel_query`, a
scaled copy of q), so ``q · k`` never overflows where the logits are finite.
No ``n_q x n_k`` array exists: memory is ``O(B n d)`` plus a few blocks per
thread.  Causal: key blocks wholly above the diagonal are skipped; in the
block that crosses it each row only forms the terms it sees when the block's
values hold an inf or NaN (a masked ``0 * v`` would turn it into a NaN in a
row that must not see it; with finite values the masked ``p`` are 0 and one
gemm does), and query blocks are handed out in pairs ``(t, nb - 1 - t)`` so every
work item costs the same.
"""

import numpy as np
from numba import njit, prange

from .config import (
    JIT_PARALLEL, JIT_SERIAL, SOFTMAX_BLOCK_K, SOFTMAX_BLOCK_Q, SOFTMAX_MIN_BLOCK_Q, wide_vectors,
)
from ._online import online_softmax_block
from .. import _overflow, _policy
from .decode import split_key_softmax_forward
from ._threads import get_num_threads, launch


@njit(**JIT_SERIAL)
def _query_block(q, k, v, out, b, qb, causal, consts, sbuf, acc, tmp, m, l, alpha):
    """Online softmax of query block ``qb`` of head ``b`` into ``out[b]``.

    ``m`` holds the running maximum of the logits ``scale s`` (not of ``s``).
    """
    wide_vectors()
    n_q = q.shape[1]
    n_k, d_v = k.shape[1], v.shape[2]
    scale, neg_inf, zero = consts[0], consts[1], consts[2]
    bq, bk = m.shape[0], sbuf.shape[0] // m.shape[0]
    off = n_k - n_q
    i0 = qb * bq
    i1 = min(n_q, i0 + bq)
    rows = i1 - i0
    # Keys the block can see: all of them, or up to the last row's diagonal.
    hi = min(n_k, max(0, i1 + off)) if causal else n_k
    for i in range(rows):
        m[i] = neg_inf
        l[i] = zero
        for c in range(d_v):
            acc[i, c] = zero
    q_rows = q[b, i0:i1]
    for j0 in range(0, hi, bk):
        j1 = min(hi, j0 + bk)
        cols = j1 - j0
        s = sbuf[: rows * cols].reshape((rows, cols))
        np.dot(q_rows, k[b, j0:j1].T, s)
        # Does the block cross the diagonal (some row does not see every key)?
        crosses = causal and j1 - 1 > i0 + off
        online_softmax_block(s, rows, cols, i0 + off + 1 - j0, crosses, scale, m, l, alpha,
                             neg_inf, zero)
        # A block that crosses the diagonal may still use one gemm (its masked
        # p are 0) when its values are all finite, so 0 * v forms no NaN.
        use_gemm = not crosses
        if crosses:
            use_gemm = True
            for j in range(cols):
                for c in range(d_v):
                    if not np.isfinite(v[b, j0 + j, c]):
                        use_gemm = False
        if use_gemm:
            t = tmp[:rows]
            np.dot(s, v[b, j0:j1], t)
            for i in range(rows):
                a = alpha[i]
                for c in range(d_v):
                    acc[i, c] = acc[i, c] * a + t[i, c]
        else:
            for i in range(rows):
                a = alpha[i]
                for c in range(d_v):
                    acc[i, c] *= a
                lim = min(cols, i0 + i + off + 1 - j0)
                for j in range(lim):
                    p = s[i, j]
                    for c in range(d_v):
                        acc[i, c] += p * v[b, j0 + j, c]
    for i in range(rows):
        # l == 0: the row saw no key (or only -inf logits): 0, as the reference.
        li = l[i]
        if li > zero:
            r = 1 / li
            for c in range(d_v):
                out[b, i0 + i, c] = acc[i, c] * r
        else:
            for c in range(d_v):
                out[b, i0 + i, c] = acc[i, c] * zero


@njit(**JIT_PARALLEL)
def online_softmax_forward(q, k, v, causal, consts, bq, bk):
    """Tiled online-softmax attention; see the module docstring.

    ``consts`` holds ``(scale, -inf, 0)`` in the dtype of ``q`` so every
    constant of the kernel has that dtype; ``bq``, ``bk`` are the query and
    key block sizes.  Returns ``out (B, n_q, d_v)``.
    """
    B, n_q, d_k = q.shape
    d_v = v.shape[2]
    nb = (n_q + bq - 1) // bq
    # Causal: work item t runs query blocks t and nb - 1 - t (equal cost);
    # non-causal: one block per item.
    npairs = (nb + 1) // 2 if causal else nb
    out = np.empty((B, n_q, d_v), dtype=q.dtype)
    for item in prange(B * npairs):
        b = item // npairs
        t = item % npairs
        sbuf = np.empty(bq * bk, dtype=q.dtype)
        acc = np.empty((bq, d_v), dtype=q.dtype)
        tmp = np.empty((bq, d_v), dtype=q.dtype)
        m = np.empty(bq, dtype=q.dtype)
        l = np.empty(bq, dtype=q.dtype)
        alpha = np.empty(bq, dtype=q.dtype)
        _query_block(q, k, v, out, b, t, causal, consts, sbuf, acc, tmp, m, l, alpha)
        if causal and nb - 1 - t != t:
            _query_block(q, k, v, out, b, nb - 1 - t, causal, consts, sbuf, acc, tmp, m, l, alpha)
    return out


def softmax_forward(q, k, v, causal, scale):
    """Softmax attention ``softmax(q kᵀ · scale) v`` by tiled online softmax.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k)
        float32 or float64, C-contiguous (validated by :mod:`fastattn._checks`).
    k : ndarray of shape (B, n_k, d_k)
    v : ndarray of shape (B, n_k, d_v)
    causal : bool
        Bottom-right aligned mask: query ``i`` sees key ``j`` when
        ``j <= i + n_k - n_q``; a row that sees no key is 0.
    scale : float
        Multiplies the logits; below 1 it multiplies ``q`` first
        (:func:`fastattn._overflow.kernel_query`).

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v), dtype of ``q``

    Notes
    -----
    Time ``O(B n_q n_k (d_k + d_v))`` (``4 n_q n_k d`` flops per head, about
    half when causal), extra memory ``O(threads · BLOCK_Q · BLOCK_K)`` besides
    the output.  Milakov & Gimelshein (2018); Dao et al., FlashAttention (2022).
    """
    q, scale = _overflow.kernel_query(q, scale)
    if _policy.use_split_keys(q.shape[1]):
        return split_key_softmax_forward(q, k, v, causal, scale)
    consts = np.array([scale, -np.inf, 0.0], dtype=q.dtype)
    batch, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    # Smaller query blocks when there are too few work items (pairs of
    # blocks) to keep every thread busy.
    block_q = SOFTMAX_BLOCK_Q
    def work_items(block_q):
        blocks = -(-n_q // block_q)
        return batch * ((blocks + 1) // 2 if causal else blocks)

    while block_q > SOFTMAX_MIN_BLOCK_Q and work_items(block_q) < 2 * get_num_threads():
        block_q //= 2
    # Few queries (decoding): longer key blocks keep the gemms and the score
    # tile the same size, so BLAS is not called for tiny products.
    block_k = SOFTMAX_BLOCK_K * max(1, block_q // n_q)
    block_k = min(block_k, max(SOFTMAX_BLOCK_K, n_k))
    work = batch * n_q * n_k * (q.shape[2] + v.shape[2])
    with launch(work_items(block_q), work) as pick:
        return pick(online_softmax_forward)(q, k, v, bool(causal), consts, block_q, block_k)
