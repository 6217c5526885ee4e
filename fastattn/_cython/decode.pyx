"""Decode kernels: split-key softmax (Flash-Decoding) and the recurrent linear step.

With few queries (a generated token) over many keys (a KV cache), the tiled
kernel of :mod:`fastattn._cython.softmax` has one work item per head, and
one GEMM per 256 keys with a single row.  Here each head's keys are cut in
``n_splits`` contiguous ranges; one work item runs the online softmax of
every query of its head over its range only (Milakov & Gimelshein 2018),
keeping its own running maximum ``m``, sum ``l`` and unnormalised output
``acc``, in key blocks of :data:`SPLIT_KEYS_BLOCK_K` keys (one GEMM for the
scores and one for ``p v`` each, GEMVs for a single query, which read the
block in place where a one-row GEMM would first pack it; every key and value
is read from memory once).  The partial results are merged with the usual rescaling (Dao, Haziza,
Massa & Sizov, "Flash-Decoding for long-context inference", 2023)::

    M   = max_s m_s
    out = Σ_s exp(m_s - M) acc_s / Σ_s exp(m_s - M) l_s

Causal stays bottom-right aligned (query ``i`` sees key ``j <= i + n_k - n_q``).
In a key block the diagonal crosses, masked scores are replaced by 0 and, if
a masked value row is not finite, ``p v`` is formed row by row over the
visible keys only, so a NaN or inf behind the mask never reaches a row.  A
row that sees no key is 0.

:func:`recurrent_linear_step` is linear attention for one query and one key
(a generated token) from a state: one serial pass over ``S`` that updates it
and reads it, with no BLAS call and no thread pool woken.
"""

import numpy as np

from cython cimport floating
from cython.parallel cimport parallel, prange, threadid

from fastattn._cython._blas cimport gemm
from fastattn._cython._vmath cimport exp_sum, feature_map, fexp, row_max
from scipy.linalg.cython_blas cimport dgemv, sgemv

from fastattn._cython._openmp import get_num_threads
from fastattn._dispatch import split_count
from fastattn._threads import kernel_threads, single_threaded_blas

#: Keys per block inside a split (one scores product and one ``p v`` product).
#: Measured here (float32, n_q=1, d=64, 2 threads, min of repeats, one
#: process, loaded machine): with one-row GEMMs, n_k=32768 one head 0.31 ms
#: at 512 or 1024 keys, 0.63 at 2048; with GEMV (now), 0.37-0.39 ms from 512
#: to 4096 keys, and n_k=8192 eight heads 0.72-0.78 ms.
SPLIT_KEYS_BLOCK_K = 1024

cdef double NEG_INF = -float("inf")


cdef inline void _gemv(bint trans, int m, int n, floating alpha, const floating *a,
                       const floating *x, floating beta, floating *y) noexcept nogil:
    """``y = alpha · op(A) x + beta · y`` for a column-major ``m x n`` matrix ``A`` (lda = m).

    With one query, the scores (``trans``: ``k_blk q``) and ``p v_blk`` are
    matrix-vector products; a GEMM of one row would pack the key block first.
    """
    cdef char t = b'T' if trans else b'N'
    cdef int one = 1
    if floating is float:
        sgemv(&t, &m, &n, &alpha, <float *> a, &m, <float *> x, &one, &beta, y, &one)
    else:
        dgemv(&t, &m, &n, &alpha, <double *> a, &m, <double *> x, &one, &beta, y, &one)


cdef inline bint _all_finite(const floating *x, Py_ssize_t count) noexcept nogil:
    """Whether ``count`` consecutive values are all finite (no NaN, no inf)."""
    cdef Py_ssize_t t
    cdef floating acc = 0
    for t in range(count):
        acc = acc + x[t] * 0      # inf * 0 and NaN * 0 are NaN
    return acc == 0


cdef void _key_range(
    const floating *q, const floating *k, const floating *v,
    int n_q, int n_k, int d_k, int d_v, int j_lo, int j_hi, bint causal,
    floating scale, int block_k, floating *s_buf, floating *m, floating *l, floating *acc,
) noexcept nogil:
    """Online softmax of all ``n_q`` rows of one head over keys ``[j_lo, j_hi)``.

    Leaves the unnormalised partial result in ``m (n_q)``, ``l (n_q)`` and
    ``acc (n_q, d_v)``; ``q, k, v`` point at the head.
    """
    cdef int off = n_k - n_q
    cdef int r, j, c, j0, width, w, w_min
    cdef bint full
    cdef floating mx, m_new, shift, alpha, p
    cdef floating *srow
    cdef floating *arow
    cdef const floating *vrow

    for r in range(n_q):
        m[r] = NEG_INF
        l[r] = 0
    for c in range(n_q * d_v):
        acc[c] = 0
    j0 = j_lo
    while j0 < j_hi:
        width = min(block_k, j_hi - j0)
        if n_q == 1:
            _gemv(True, d_k, width, scale, k + <Py_ssize_t> j0 * d_k, q, 0, s_buf)
        else:
            gemm(False, True, n_q, width, d_k, scale, q, d_k, k + <Py_ssize_t> j0 * d_k, d_k,
                 0, s_buf, width)
        # Every row sees every key of the block: row 0 sees keys j <= off.
        full = not causal or j0 + width - 1 <= off
        w_min = width
        for r in range(n_q):
            srow = s_buf + <Py_ssize_t> r * width
            w = width
            if not full:
                w = min(max(r + off + 1 - j0, 0), width)
                w_min = min(w_min, w)
                for j in range(w, width):
                    srow[j] = 0          # masked: p = 0, whatever the score was
            if w == 0:
                continue
            mx = row_max(srow, w)
            m_new = mx if mx > m[r] else m[r]
            # All scores -inf so far: shift by 0 so exp gives 0, not NaN.
            shift = m_new if m_new != NEG_INF else 0
            alpha = fexp(m[r] - shift)
            l[r] = l[r] * alpha + exp_sum(srow, w, shift)
            m[r] = m_new
            if alpha != 1:
                arow = acc + <Py_ssize_t> r * d_v
                for c in range(d_v):
                    arow[c] = arow[c] * alpha
        # p v: one GEMM, unless a masked value row is not finite (0 * inf is NaN).
        if full or _all_finite(v + <Py_ssize_t> (j0 + w_min) * d_v,
                               <Py_ssize_t> (width - w_min) * d_v):
            if n_q == 1:
                _gemv(False, d_v, width, 1, v + <Py_ssize_t> j0 * d_v, s_buf, 1, acc)
            else:
                gemm(False, False, n_q, d_v, width, 1, s_buf, width,
                     v + <Py_ssize_t> j0 * d_v, d_v, 1, acc, d_v)
        else:
            for r in range(n_q):
                w = min(max(r + off + 1 - j0, 0), width)
                srow = s_buf + <Py_ssize_t> r * width
                arow = acc + <Py_ssize_t> r * d_v
                for j in range(w):
                    p = srow[j]
                    vrow = v + <Py_ssize_t> (j0 + j) * d_v
                    for c in range(d_v):
                        arow[c] = arow[c] + p * vrow[c]
        j0 = j0 + width


cdef void _merge(const floating *part_m, const floating *part_l, const floating *part_acc,
                 int n_splits, int n_q, int d_v, floating *out) noexcept nogil:
    """``out (n_q, d_v)`` of one head from its ``n_splits`` partial results."""
    cdef int i, sp, c
    cdef floating mx, pm, w, total
    cdef const floating *arow
    cdef floating *orow
    for i in range(n_q):
        orow = out + <Py_ssize_t> i * d_v
        mx = NEG_INF
        for sp in range(n_splits):
            pm = part_m[sp * n_q + i]
            if pm > mx:
                mx = pm
        total = 0
        for c in range(d_v):
            orow[c] = 0
        for sp in range(n_splits):
            pm = part_m[sp * n_q + i]
            # A range where the row saw no key (l = 0) adds nothing; a NaN
            # logit made its l or m NaN, and so the row, as in the reference.
            if part_l[sp * n_q + i] == 0:
                continue
            w = fexp(pm - mx)
            total = total + w * part_l[sp * n_q + i]
            arow = part_acc + (<Py_ssize_t> sp * n_q + i) * d_v
            for c in range(d_v):
                orow[c] = orow[c] + w * arow[c]
        # total == 0: the row saw no key (or only -inf logits): 0.
        if total != 0:
            w = 1 / total
            for c in range(d_v):
                orow[c] = orow[c] * w


def _split_key_softmax(
    const floating[:, :, ::1] q,
    const floating[:, :, ::1] k,
    const floating[:, :, ::1] v,
    floating[:, :, ::1] out,
    floating[:, :, ::1] part_m,
    floating[:, :, ::1] part_l,
    floating[:, :, :, ::1] part_acc,
    floating[::1] workspace,
    int n_k,
    bint causal,
    double scale,
    int block_k,
    int n_threads,
):
    cdef int n_batch = q.shape[0], n_q = q.shape[1], d_k = q.shape[2]
    cdef int d_v = v.shape[2]
    cdef int n_splits = part_m.shape[1]
    cdef int span = (n_k + n_splits - 1) // n_splits
    cdef int n_items = n_batch * n_splits
    cdef Py_ssize_t per_thread = <Py_ssize_t> n_q * block_k
    cdef int item, b, sp, j_lo, j_hi
    cdef floating *buf = NULL   # per-thread workspace, set in each parallel block
    cdef floating s = <floating> scale

    with nogil, parallel(num_threads=min(n_threads, n_items)):
        buf = &workspace[0] + threadid() * per_thread
        for item in prange(n_items, schedule="dynamic"):
            b = item // n_splits
            sp = item % n_splits
            j_lo = sp * span
            j_hi = min(n_k, j_lo + span)
            _key_range(&q[b, 0, 0], &k[b, 0, 0], &v[b, 0, 0], n_q, n_k, d_k, d_v,
                       j_lo, j_hi, causal, s, block_k, buf,
                       &part_m[b, sp, 0], &part_l[b, sp, 0], &part_acc[b, sp, 0, 0])
    with nogil:
        for b in range(n_batch):
            _merge(&part_m[b, 0, 0], &part_l[b, 0, 0], &part_acc[b, 0, 0, 0],
                   n_splits, n_q, d_v, &out[b, 0, 0])


def split_key_softmax_forward(q, k, v, bint causal, double scale, n_threads=None, n_splits=None,
                              n_k=None):
    """Softmax attention ``softmax(q kᵀ · scale) v`` with the keys split across threads.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k), float32 or float64, C-contiguous
        Meant for few queries (see :func:`fastattn._dispatch.use_split_keys`);
        correct for any ``n_q``.
    k : ndarray of shape (B, n_k, d_k), same dtype
    v : ndarray of shape (B, n_k, d_v), same dtype
    causal : bool
        Bottom-right aligned mask: query ``i`` sees key ``j`` when
        ``j <= i + n_k - n_q``; a row that sees no key is 0.
    scale : float
        Multiplies the logits.
    n_threads : int, optional
        OpenMP threads at most; default the backend's count.  Fewer run when
        the call is too small to split (:func:`fastattn._threads.kernel_threads`),
        with BLAS held at one thread while several do; ignored in a build
        without OpenMP.
    n_splits : int, optional
        Key ranges per head, from 1 to ``n_k``; default
        :func:`fastattn._dispatch.split_count` for ``n_threads``.
    n_k : int, optional
        Attend over the first ``n_k`` keys and values only (from 1 to
        ``k.shape[1]``, default all): a preallocated KV cache passes its whole
        buffer and the filled length, and nothing is copied.

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v), the dtype of ``q``

    Notes
    -----
    ``4 · B · n_q · n_k · d`` flops; extra memory ``B · n_splits · n_q ·
    (d_v + 2)`` elements for the partial results and ``T · n_q ·
    SPLIT_KEYS_BLOCK_K`` for the scores of ``T`` threads.  Flash-Decoding
    (Dao et al. 2023) over the online softmax of Milakov & Gimelshein (2018).
    """
    n_threads = get_num_threads() if n_threads is None else max(1, n_threads)
    n_batch, n_q, d_k = q.shape
    n_k = k.shape[1] if n_k is None else n_k
    d_v = v.shape[2]
    if n_splits is None:
        n_splits = split_count(n_batch, n_k, n_threads)
    n_splits = max(1, min(int(n_splits), n_k))
    n_threads = kernel_threads(n_threads, n_batch * n_splits, n_batch * n_q * n_k * (d_k + d_v))
    block_k = min(SPLIT_KEYS_BLOCK_K, (n_k + n_splits - 1) // n_splits)
    dtype = q.dtype
    out = np.empty((n_batch, n_q, d_v), dtype=dtype)
    part_m = np.empty((n_batch, n_splits, n_q), dtype=dtype)
    part_l = np.empty((n_batch, n_splits, n_q), dtype=dtype)
    part_acc = np.empty((n_batch, n_splits, n_q, d_v), dtype=dtype)
    workspace = np.empty(n_threads * n_q * block_k, dtype=dtype)
    if n_threads == 1:
        _split_key_softmax(q, k, v, out, part_m, part_l, part_acc, workspace, n_k, causal,
                           scale, block_k, 1)
    else:
        with single_threaded_blas():
            _split_key_softmax(q, k, v, out, part_m, part_l, part_acc, workspace, n_k, causal,
                               scale, block_k, n_threads)
    return out


cdef void _step(const floating *q, const floating *k, const floating *v,
                const floating *S0, const floating *z0, int d_k, int d_v, bint relu,
                floating eps, floating *S, floating *z, floating *out, floating *phi) noexcept nogil:
    """One head: ``S = S0 + φ(k)ᵀ v``, ``z = z0 + φ(k)``, ``out = φ(q) S / (φ(q)·z + eps)``."""
    cdef int a, c
    cdef floating fk, fq, den = 0
    cdef floating *srow
    cdef const floating *s0row
    feature_map(k, d_k, phi, relu)
    feature_map(q, d_k, phi + d_k, relu)
    for c in range(d_v):
        out[c] = 0
    for a in range(d_k):
        fk = phi[a]
        fq = phi[d_k + a]
        z[a] = z0[a] + fk
        den = den + fq * z[a]
        srow = S + <Py_ssize_t> a * d_v
        s0row = S0 + <Py_ssize_t> a * d_v
        for c in range(d_v):
            srow[c] = s0row[c] + fk * v[c]
            out[c] = out[c] + fq * srow[c]
    den = den + eps
    # A zero denominator (relu with eps = 0) gives a zero row, as the reference.
    fq = 1 / den if den != 0 else 0
    for c in range(d_v):
        out[c] = out[c] * fq


def _recurrent_step(const floating[:, :, ::1] q, const floating[:, :, ::1] k,
                    const floating[:, :, ::1] v, const floating[:, :, ::1] S0,
                    const floating[:, ::1] z0, bint relu, double eps,
                    floating[:, :, ::1] S, floating[:, ::1] z, floating[:, :, ::1] out,
                    floating[::1] phi):
    cdef int b, d_k = q.shape[2], d_v = v.shape[2]
    with nogil:
        for b in range(q.shape[0]):
            _step(&q[b, 0, 0], &k[b, 0, 0], &v[b, 0, 0], &S0[b, 0, 0], &z0[b, 0], d_k, d_v,
                  relu, <floating> eps, &S[b, 0, 0], &z[b, 0], &out[b, 0, 0], &phi[0])


def recurrent_linear_step(q, k, v, feature_map, double eps, S0=None, z0=None):
    """One generated token of linear attention: ``(out, S, z)`` from the state ``(S0, z0)``.

    ``q, k (B, 1, d_k)`` and ``v (B, 1, d_v)`` of one dtype (float32 or
    float64), C-contiguous; ``feature_map`` "elu" or "relu" (checked by
    :mod:`fastattn._api`); ``S0 (B, d_k, d_v)`` and ``z0 (B, d_k)`` are
    read, not written, and None means zeros.  Computes ``S = S0 + φ(k)ᵀ v``,
    ``z = z0 + φ(k)``, ``out (B, 1, d_v) = φ(q) S / (φ(q)·z + eps)`` (0 where
    the denominator is 0) in one serial pass over the state, ``4 · B · d_k ·
    d_v`` flops; Katharopoulos et al. (2020).
    """
    n_batch, _, d_k = q.shape
    d_v = v.shape[2]
    dtype = q.dtype
    if S0 is None:
        S0 = np.zeros((n_batch, d_k, d_v), dtype=dtype)
        z0 = np.zeros((n_batch, d_k), dtype=dtype)
    S = np.empty((n_batch, d_k, d_v), dtype=dtype)
    z = np.empty((n_batch, d_k), dtype=dtype)
    out = np.empty((n_batch, 1, d_v), dtype=dtype)
    phi = np.empty(2 * d_k, dtype=dtype)
    _recurrent_step(q, k, v, S0, z0, feature_map == "relu", eps, S, z, out, phi)
    return out, S, z


def linear_forward(q, k, v, feature_map, causal, eps, S0=None, z0=None):
    """The backend interface's ``linear_forward`` for one query and one key: :func:`recurrent_linear_step`."""
    return recurrent_linear_step(q, k, v, feature_map, eps, S0, z0)


def cache_softmax_forward(q, k, v, causal, scale, n_k):
    """Softmax attention over the first ``n_k`` keys of ``k (B, capacity, d_k)`` (a KV cache), no copy."""
    return split_key_softmax_forward(q, k, v, causal, scale, None, None, n_k)
