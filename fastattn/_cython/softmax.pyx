"""Tiled online-softmax forward: softmax attention without an n_q x n_k array.

Queries are cut into blocks of :data:`BLOCK_Q` rows and keys into blocks of
:data:`BLOCK_K`.  For a query block, each key block's scores
``s = scale · q_blk k_blkᵀ`` come from one product; every row keeps a running
maximum ``m`` and sum ``l`` of ``exp(s - m)`` (online softmax, Milakov &
Gimelshein 2018) and its output is rescaled by ``exp(m_old - m_new)`` before
the next block's ``p v_blk`` GEMM adds to it, as in FlashAttention (Dao et al.
2022).  Causal: key blocks wholly above the diagonal are never visited; a key
block the diagonal crosses ("partial" block) has its masked scores replaced by
0 and, when a masked value row is not finite, its ``p v`` product formed row
by row over the visible keys only, so a NaN or inf behind the mask never
reaches a row (a GEMM would form ``0 · NaN``).

The two products of a tile are the register-blocked kernels of
:file:`_microkernel.pxd` when the CPU has AVX-512F, or AVX2 with FMA, and
``d_k``, ``d_v`` are multiples of 16 (float32) or 8 (float64): each head's
keys are packed once into panels of keys and its values into panels of
columns, q and p are read as they lie, and the scores' exp is a polynomial
scaled by its exponent.  Otherwise they are BLAS GEMMs.  The packed keys and
values add ``O(B n_k (d_k + d_v))`` memory, the size of the inputs.

Work items are (batch, query block) pairs shared out by OpenMP with dynamic
scheduling, the longest causal blocks first; with :data:`HEAD_ITEMS` heads a
thread or more (and the register-blocked products), a work item is a whole head whose
keys and values the thread packs into a buffer of its own just before its
query blocks use them.  BLAS runs single-threaded inside (the caller limits it, see
:mod:`fastattn._cython`).
"""

import numpy as np

from fastattn._cython._aligned import aligned_empty

from cython cimport floating
from cython.parallel cimport parallel, prange, threadid

from fastattn._cython._blas cimport gemm
from fastattn._cython._microkernel cimport (
    products_isa,
    FASTATTN_MICROKERNEL, simd_rows, output, pack_keys, pack_values, scores,
)
from fastattn._cython._vmath cimport (
    FASTATTN_CLONES, FASTATTN_VECTOR_EXP, all_finite,
)
from fastattn._cython._online cimport online_softmax_row


#: Query rows per block (one work item).
BLOCK_Q = 256
#: Keys per block (one scores product).  A (256, 512) score tile is 512 KiB in
#: float32: it, the query block, the packed keys and the output rows stay in
#: a 2 MiB L2; 512 against 256 keys halves the per-tile work of every row
#: (its maximum, alpha, rescaling), about 2 % at d=64 in a side-by-side run
#: (1 thread, CPU time, loaded machine).
BLOCK_K = 512
#: Heads per thread from which a work item is a whole head (its keys packed by
#: the thread that uses them) rather than one query block of a head.
HEAD_ITEMS = 8
#: Rows per tile where the causal diagonal crosses a key block.
cdef int DIAGONAL_ROWS = 32
#: Keys per work item when packing k for the register-blocked products (a multiple of 16).
cdef int PACK_KEYS = 1024

cdef double NEG_INF = -float("inf")


cdef inline int _visible_end(int i, int n_q, int n_k, bint causal) noexcept nogil:
    """Keys ``[0, end)`` seen by query ``i``: all, or ``j <= i + n_k - n_q`` (clipped)."""
    cdef int end
    if not causal:
        return n_k
    end = i + n_k - n_q + 1
    if end < 0:
        return 0
    if end > n_k:
        return n_k
    return end


cdef void _tile(
    const floating *q, const floating *k, const floating *v, floating *out,
    int n_q, int n_k, int d_k, int d_v, int i0, int r0, int r1, int j0, int width,
    bint full, bint causal, floating scale, floating *s_buf, floating *m, floating *l,
    floating *kp, const floating *vp, bint v_finite,
) noexcept nogil:
    """Fold keys ``[j0, j0 + width)`` into rows ``i0 + [r0, r1)`` (online softmax step).

    ``full``: every row sees every key of the tile; otherwise each row sees a
    prefix of it (the causal diagonal) and the rest is never formed.
    ``kp``: the key block from ``j0`` packed by ``pack_keys`` (the register-blocked
    products), else NULL (BLAS); ``vp``: then the head's values packed by
    ``pack_values``.  ``v_finite``:
    every value of the head is finite, so masked rows of v need no check.
    """
    cdef int rows = r1 - r0
    cdef int r, ri, j, c, w, w_min
    cdef floating p
    cdef floating *srow
    cdef floating *orow
    cdef const floating *vrow

    if kp != NULL:
        scores(q + <Py_ssize_t> (i0 + r0) * d_k, d_k, kp, rows, width, d_k, scale, s_buf, width)
    else:
        gemm(False, True, rows, width, d_k, scale, q + <Py_ssize_t> (i0 + r0) * d_k, d_k,
             k + <Py_ssize_t> j0 * d_k, d_k, 0, s_buf, width)
    w_min = width
    for r in range(rows):
        ri = r0 + r
        srow = s_buf + <Py_ssize_t> r * width
        if full:
            w = width
        else:
            w = min(max(_visible_end(i0 + ri, n_q, n_k, causal) - j0, 0), width)
            w_min = min(w_min, w)
            for j in range(w, width):
                srow[j] = 0              # masked: p = 0, whatever the score was
        if w == 0:
            continue
        online_softmax_row(srow, w, &m[ri], &l[ri], out + <Py_ssize_t> (i0 + ri) * d_v, d_v,
                           kp != NULL)

    # p v: one GEMM, unless a masked value row is not finite (0 * inf is NaN).
    if full or v_finite or all_finite(v + <Py_ssize_t> (j0 + w_min) * d_v,
                                      <Py_ssize_t> (width - w_min) * d_v):
        if kp != NULL:
            output(s_buf, width, vp, n_k, j0, rows, width, d_v,
                   out + <Py_ssize_t> (i0 + r0) * d_v, d_v)
        else:
            gemm(False, False, rows, d_v, width, 1, s_buf, width,
                 v + <Py_ssize_t> j0 * d_v, d_v, 1, out + <Py_ssize_t> (i0 + r0) * d_v, d_v)
    else:
        for r in range(rows):
            ri = r0 + r
            w = min(max(_visible_end(i0 + ri, n_q, n_k, causal) - j0, 0), width)
            srow = s_buf + <Py_ssize_t> r * width
            orow = out + <Py_ssize_t> (i0 + ri) * d_v
            for j in range(w):
                p = srow[j]
                vrow = v + <Py_ssize_t> (j0 + j) * d_v
                for c in range(d_v):
                    orow[c] = orow[c] + p * vrow[c]


cdef void _query_block(
    const floating *q, const floating *k, const floating *v, floating *out,
    int n_q, int n_k, int d_k, int d_v, int i0, int i1, bint causal,
    floating scale, int block_k, floating *s_buf, floating *m, floating *l, floating *kp,
    const floating *vp, bint v_finite,
) noexcept nogil:
    """Rows ``[i0, i1)`` of one head's output.  ``q, k, v, out`` point at that head.

    A key block wholly visible to the query block is one tile; a block the
    causal diagonal crosses is cut into tiles of :data:`DIAGONAL_ROWS` rows,
    each only as wide as its last row sees, so little masked work is done.
    ``kp``: this head's keys packed for the register-blocked products
    (``pack_keys``), or NULL; ``vp``: then its values packed (``pack_values``).
    ``v_finite``: the head's values are all finite.
    """
    cdef int nr = i1 - i0
    cdef int r, c, kb, j0, bk, hi, lo, t, r0, r1, width
    cdef floating inv
    cdef floating *orow
    cdef floating *kp_block

    hi = _visible_end(i1 - 1, n_q, n_k, causal)   # keys seen by the last row
    lo = _visible_end(i0, n_q, n_k, causal)       # keys seen by every row
    for r in range(nr):
        m[r] = NEG_INF
        l[r] = 0
        orow = out + <Py_ssize_t> (i0 + r) * d_v
        for c in range(d_v):
            orow[c] = 0

    for kb in range((hi + block_k - 1) // block_k):
        j0 = kb * block_k
        bk = min(block_k, hi - j0)
        kp_block = kp + <Py_ssize_t> j0 * d_k if kp != NULL else NULL   # j0 % lanes == 0
        if j0 + bk <= lo:
            _tile(q, k, v, out, n_q, n_k, d_k, d_v, i0, 0, nr, j0, bk, True, causal,
                  scale, s_buf, m, l, kp_block, vp, v_finite)
            continue
        for t in range((nr + DIAGONAL_ROWS - 1) // DIAGONAL_ROWS):
            r0 = t * DIAGONAL_ROWS
            r1 = min(r0 + DIAGONAL_ROWS, nr)
            width = min(_visible_end(i0 + r1 - 1, n_q, n_k, causal) - j0, bk)
            if width > 0:
                _tile(q, k, v, out, n_q, n_k, d_k, d_v, i0, r0, r1, j0, width, False,
                      causal, scale, s_buf, m, l, kp_block, vp, v_finite)

    for r in range(nr):
        orow = out + <Py_ssize_t> (i0 + r) * d_v
        if _visible_end(i0 + r, n_q, n_k, causal) == 0:
            for c in range(d_v):
                orow[c] = 0              # a row that sees no key is 0
        elif l[r] != 0:
            inv = 1 / l[r]
            for c in range(d_v):
                orow[c] = orow[c] * inv


def _online_softmax(
    const floating[:, :, ::1] q,
    const floating[:, :, ::1] k,
    const floating[:, :, ::1] v,
    floating[:, :, ::1] out,
    floating[::1] workspace,
    bint causal,
    double scale,
    int block_q,
    int block_k,
    int n_threads,
    int head_items,
):
    cdef int n_batch = q.shape[0], n_q = q.shape[1], d_k = q.shape[2]
    cdef int n_k = k.shape[1], d_v = v.shape[2]
    cdef int n_blocks = (n_q + block_q - 1) // block_q
    cdef int n_items = n_batch * n_blocks
    cdef Py_ssize_t per_thread = <Py_ssize_t> block_q * block_k + 2 * block_q
    cdef int item, b, blk, i0, i1, j0
    cdef floating *buf = NULL   # per-thread workspace, set in each parallel block
    cdef floating s = <floating> scale
    # With AVX-512 or AVX2 and d_k, d_v multiples of the lanes (16 in float32, 8 in
    # float64): the tile's own products (see _microkernel.pxd); otherwise
    # BLAS.  Key blocks must start on a panel.
    cdef int lanes = 16 if floating is float else 8
    cdef bint micro = (simd_rows(d_k, buf) and simd_rows(d_v, buf)
                       and (block_k % lanes == 0 or block_k >= n_k) and n_k > 0)
    # Every head's keys packed once (panels of lanes keys), and its values (panels of
    # columns), shared by its query blocks.
    cdef Py_ssize_t head_kp = <Py_ssize_t> ((n_k + lanes - 1) // lanes) * lanes * d_k
    cdef Py_ssize_t head_vp = <Py_ssize_t> n_k * d_v
    cdef int n_chunks = (n_k + PACK_KEYS - 1) // PACK_KEYS
    cdef floating[::1] kpack
    cdef floating *kp_all = NULL
    cdef floating *vp_all = NULL
    cdef const floating *v_all = &v[0, 0, 0] if v.shape[0] * n_k * d_v > 0 else NULL
    cdef int width

    # Many heads a thread: a work item is a whole head, whose keys and values the
    # thread packs into a buffer of its own just before using them, while they
    # are in its L2 -- no pass over every head before the tiles, no barrier
    # after it: one parallel region a call.  (Under load a region's end waits
    # for every thread to be given a core again, up to a scheduler period.)
    cdef bint per_head = micro and n_batch >= head_items * n_threads
    cdef Py_ssize_t thread_kp = head_kp + head_vp
    cdef floating *tkp = NULL   # the thread's packed keys, set in each parallel block

    if per_head:
        kpack = aligned_empty(min(n_threads, n_batch) * thread_kp,
                              np.float32 if floating is float else np.float64)
        kp_all = &kpack[0]
    elif micro and head_kp > 0 and head_vp > 0:
        # Keys and values packed in pieces of PACK_KEYS keys shared out by the threads.
        kpack = aligned_empty(n_batch * (head_kp + head_vp),
                              np.float32 if floating is float else np.float64)
        kp_all = &kpack[0]
        vp_all = kp_all + n_batch * head_kp
        with nogil, parallel(num_threads=min(n_threads, n_batch * n_chunks)):
            for item in prange(n_batch * n_chunks, schedule="dynamic"):
                b = item // n_chunks
                j0 = (item % n_chunks) * PACK_KEYS
                width = min(PACK_KEYS, n_k - j0)
                pack_keys(&k[b, j0, 0], d_k, width, d_k,
                          kp_all + b * head_kp + <Py_ssize_t> j0 * d_k)
                pack_values(&v[b, j0, 0], d_v, j0, width, d_v, n_k, vp_all + b * head_vp)
    else:
        micro = False

    # Causal: whether each head's values are all finite, found once (else every
    # tile the diagonal crosses checks its masked rows of v).
    cdef unsigned char[::1] finite = np.zeros(max(n_batch, 1), dtype=np.uint8)
    if causal and not per_head:    # per head: found by the thread that runs the head
        with nogil, parallel(num_threads=min(n_threads, n_batch)):
            for item in prange(n_batch, schedule="dynamic"):
                finite[item] = all_finite(v_all + <Py_ssize_t> item * n_k * d_v,
                                          <Py_ssize_t> n_k * d_v)

    if per_head:
        with nogil, parallel(num_threads=min(n_threads, n_batch)):
            buf = &workspace[0] + threadid() * per_thread
            tkp = kp_all + threadid() * thread_kp
            for b in prange(n_batch, schedule="dynamic"):
                pack_keys(&k[b, 0, 0], d_k, n_k, d_k, tkp)
                pack_values(&v[b, 0, 0], d_v, 0, n_k, d_v, n_k, tkp + head_kp)
                if causal:
                    finite[b] = all_finite(&v[b, 0, 0], <Py_ssize_t> n_k * d_v)
                for blk in range(n_blocks - 1, -1, -1):
                    i0 = blk * block_q
                    i1 = min(i0 + block_q, n_q)
                    _query_block(&q[b, 0, 0], &k[b, 0, 0], &v[b, 0, 0], &out[b, 0, 0],
                                 n_q, n_k, d_k, d_v, i0, i1, causal, s, block_k,
                                 buf, buf + block_q * block_k, buf + block_q * block_k + block_q,
                                 tkp, tkp + head_kp, finite[b])
        return

    # No more threads than work items: an idle thread only spins at the barrier.
    with nogil, parallel(num_threads=min(n_threads, n_items)):
        buf = &workspace[0] + threadid() * per_thread
        for item in prange(n_items, schedule="dynamic"):
            b = item // n_blocks
            # Last query blocks first: under the causal mask they see the most keys.
            blk = n_blocks - 1 - item % n_blocks
            i0 = blk * block_q
            i1 = min(i0 + block_q, n_q)
            _query_block(&q[b, 0, 0], &k[b, 0, 0], &v[b, 0, 0], &out[b, 0, 0],
                         n_q, n_k, d_k, d_v, i0, i1, causal, s, block_k,
                         buf, buf + block_q * block_k, buf + block_q * block_k + block_q,
                         kp_all + b * head_kp if micro else NULL,
                         vp_all + b * head_vp if micro else NULL, finite[b])


def online_softmax_forward(q, k, v, bint causal, double scale, int n_threads=1):
    """Softmax attention ``softmax(q kᵀ · scale) v`` by the tiled online softmax.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k), float32 or float64, C-contiguous
    k : ndarray of shape (B, n_k, d_k), same dtype
    v : ndarray of shape (B, n_k, d_v), same dtype
    causal : bool
        Bottom-right aligned mask: query ``i`` sees key ``j`` when
        ``j <= i + n_k - n_q``; a row that sees no key is 0.
    scale : float
        Multiplies the logits.
    n_threads : int, default 1
        OpenMP threads (the package's ``get_num_threads()`` when called
        through the backend); ignored in a build without OpenMP.

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v), the dtype of ``q``

    Notes
    -----
    ``4 · B · n_q · n_k · d`` flops (about half when causal with
    ``n_q = n_k``); extra memory ``T · (BLOCK_Q · BLOCK_K + 2 BLOCK_Q)``
    elements for ``T`` threads, besides the output, and with the
    register-blocked products the packed keys and values, ``n_k (d_k + d_v)``
    elements for each head (or each thread, with many heads a thread).  Milakov & Gimelshein,
    "Online normalizer calculation for softmax" (2018); Dao et al.,
    "FlashAttention" (2022).
    """
    n_threads = max(1, n_threads)
    n_batch, n_q, _ = q.shape
    block_q = min(BLOCK_Q, n_q)
    block_k = min(BLOCK_K, k.shape[1])
    # The scores' rows and the output's on cache lines (see fastattn._cython._aligned).
    out = aligned_empty((n_batch, n_q, v.shape[2]), q.dtype)
    workspace = aligned_empty(n_threads * (block_q * block_k + 2 * block_q), q.dtype)
    _online_softmax(q, k, v, out, workspace, causal, scale, block_q, block_k, n_threads,
                    HEAD_ITEMS)
    return out


#: Elements of q a thread scales at a time in :func:`scaled_query`.
SCALE_BLOCK = 16384


def scaled_query(const float[::1] q, double scale, int n_threads=1):
    """``(float32)((float64) q · scale)`` of each element: the float64 product rounded
    once, as :func:`fastattn._overflow.kernel_query` forms it for a scale float32 does not
    hold, in one pass on ``n_threads`` OpenMP threads.

    NumPy forms it in three passes on one thread (q cast to float64 in buffers, the
    product, the cast back): 4 % of a 2-thread call at (4, 12, 512, 32), the other thread
    idle.

    Parameters
    ----------
    q : ndarray of shape (n,), float32, contiguous (a query array, flattened)
    scale : float
    n_threads : int

    Returns
    -------
    ndarray of shape (n,), float32
    """
    cdef Py_ssize_t n = q.shape[0], block = SCALE_BLOCK, b, i, end
    cdef Py_ssize_t blocks = (n + block - 1) // block
    out = np.empty(n, np.float32)
    cdef float[::1] o = out
    if n == 0:
        return out
    with nogil:
        for b in prange(blocks, schedule="static", num_threads=max(1, min(n_threads, blocks))):
            end = min(n, (b + 1) * block)
            for i in range(b * block, end):
                o[i] = <float> (<double> q[i] * scale)
    return out


def _build_features():
    """How the row kernels were compiled (vector exp through libmvec, x86-64-v3/v4
    clones), whether the tiles' register-blocked products were built, and the
    instruction set they take on this CPU (``"avx512"``, ``"avx2"``, or ``None``:
    BLAS; ``FASTATTN_SIMD=avx2`` or ``off`` caps it)."""
    return {"vector_exp": bool(FASTATTN_VECTOR_EXP), "avx2_clones": bool(FASTATTN_CLONES),
            "tile_products_built": bool(FASTATTN_MICROKERNEL),
            "tile_products": products_isa()}


def _products_isa():
    """The instruction set of this extension's register-blocked products (see
    ``products_isa`` in _microkernel.pxd)."""
    return products_isa()
