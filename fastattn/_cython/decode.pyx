"""Decode kernels: split-key softmax (Flash-Decoding) and the recurrent linear step.

With few queries (a generated token) over many keys (a KV cache), the tiled
kernel of :mod:`fastattn._cython.softmax` has one work item per head, and
one GEMM per 256 keys with a single row.  Here each head's keys are cut in
``n_splits`` contiguous ranges; one work item runs the online softmax of
every query of its head over its range only (Milakov & Gimelshein 2018),
keeping its own running maximum ``m``, sum ``l`` and unnormalised output
``acc``, in key blocks of :data:`SPLIT_KEYS_BLOCK_K` keys.  A decode step is
bound by reading K and V, so with up to :data:`FUSED_MAX_N_Q` queries there
is no BLAS call.  When ``d_k`` and ``d_v`` are whole AVX-512 vectors (16
float32, 8 float64) and the CPU has AVX-512, each query's scores are taken
16 (8) keys at a time, each key's products in one vector and the 16 vectors
summed across lanes by one transpose-and-add tree, and ``p v`` adds value
rows into accumulators held in registers (:file:`_microkernel_t.h`).  With one
query and ``d_k = d_v`` of 1 to 16 such vectors (up to 256 float32, 128 float64),
a range's whole groups of 16 (8) keys run in one pass with the online softmax in
registers: a group's key rows, then the value rows of the group before, so K and
V stream by turns and no block pauses for its softmax (``query_attend``); the
keys left run as a block.  Without AVX-512, or with rows that are not whole
vectors, a key block's scores are SIMD dot products of each key row with
every query (the row read once, while it is in L1), then ``p v`` adds each
value row into the accumulators, both in C loops compiled for AVX-512, AVX2
and the baseline (picked at load time).  With more queries the scores, and
``p v`` of a block every row sees whole, are GEMMs.
The partial results are merged with the usual rescaling (Dao, Haziza,
Massa & Sizov, "Flash-Decoding for long-context inference", 2023)::

    M   = max_s m_s
    out = Σ_s exp(m_s - M) acc_s / Σ_s exp(m_s - M) l_s

Causal stays bottom-right aligned (query ``i`` sees key ``j <= i + n_k - n_q``).
In a key block the diagonal crosses, each row folds in and adds ``p v`` of
the keys it sees only, so a NaN or inf behind the mask never reaches it.  A
row that sees no key is 0.

:func:`recurrent_linear_step` is linear attention for one query and one key
(a generated token) from a state: one serial pass over ``S`` that updates it
and reads it, with no BLAS call and no thread pool woken.
"""

import numpy as np

cimport numpy as cnp
from cython cimport floating
from libc.limits cimport INT_MAX
from libc.math cimport isfinite
from libc.stdlib cimport free, malloc
from cython.parallel cimport parallel, prange, threadid

from fastattn._cython._blas cimport gemm
from fastattn._cython._microkernel cimport (
    products_isa,
    fastattn_microkernel_isa, simd_rows, query_scores, query_values, query_attend,
)
from fastattn._cython._online cimport online_softmax_row
from fastattn._cython._vmath cimport feature_map, fexp, row_scale

cnp.import_array()

from fastattn._cython._openmp import get_num_threads
import fastattn._policy as _policy
from fastattn._threads import kernel_threads, single_threaded_blas

#: Keys per block inside a split: one pass of scores, one of ``p v`` (one query's one pass
#: leaves at most a group of keys to a block).  Measured here before that pass (fused loops,
#: float32, n_q=1, n_k=32768, H=8, d=64, 1 thread, min of 20 interleaved calls, loaded
#: machine): 128 keys 22.8 ms, 256 to 4096 keys 13.3-14.0 ms, beside 13.6 ms for torch to
#: sum K and V.
SPLIT_KEYS_BLOCK_K = 1024

#: Queries up to which a key block's scores are the fused SIMD dots; with
#: more, each key row's dots cost more than a GEMM (side by side, H=8,
#: n_k=8192, 2 threads, loaded machine: against Numba's BLAS kernel 0.8-1.0x
#: at 2 and 4 queries, 1.5-1.6x at 8 and 16), so the scores, and the ``p v``
#: of blocks every row sees whole, are BLAS GEMMs (BLAS held at one thread
#: while several run).
FUSED_MAX_N_Q = 2
cdef int FUSED_ROWS = FUSED_MAX_N_Q

cdef double NEG_INF = -float("inf")


cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) \
        && defined(__linux__) && !defined(FASTATTN_NO_CLONES)
    #define FASTATTN_DECODE_TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
    #else
    #define FASTATTN_DECODE_TARGETS
    #endif
    /* Rows ahead that the one-query loops prefetch (K and V stream from
       memory); 0: none.  16 on Intel CPUs, none elsewhere; _set_prefetch_rows
       sets it, to measure.  Side by side (one query, H = 8, d = 64, float32):
       on an Ice Lake-SP 16 rows took a 32768-key step from memory from 16.6 to
       10.5 ms on one thread; on an AMD EPYC with AVX-512 (Zen 4) every
       distance tried (4 to 128 rows) was slower, in cache and out (65536 keys: 28.1
       GB/s without, 22.8 with 16 on one thread, 50.9 and 42.0 on two). */
    static int fastattn_prefetch_rows = 0;
    static int fastattn_default_prefetch_rows(void) {
    #if defined(__GNUC__) && defined(__x86_64__)
        __builtin_cpu_init();
        return __builtin_cpu_is("intel") ? 16 : 0;
    #else
        return 0;
    #endif
    }
    /* Prefetch the four rows of `len` elements fastattn_prefetch_rows rows
       after `row`, one 64-byte cache line at a time. */
    #define FASTATTN_PREFETCH_AHEAD(row, len)                                       \
        if (fastattn_prefetch_rows) {                                               \
            const char *ahead_ = (const char *) ((row) + (long) fastattn_prefetch_rows * (len)); \
            for (long b_ = 0; b_ < (long) (4 * (len) * sizeof(*(row))); b_ += 64)   \
                __builtin_prefetch(ahead_ + b_);                                    \
        }
    /* s[r * ld + j] = (q_r . k_j) scale for r < n_q, j < width: each key row is
       read once (from memory) and dotted with every query while it is in L1.
       The scale multiplies the dot, not q: scale q may overflow where the
       logits do not. */
    #define FASTATTN_KEY_SCORES(X, T)                                              \
    FASTATTN_DECODE_TARGETS static void fastattn_key_scores_##X(                     \
            const T *restrict q, int n_q, const T *restrict k, int width, int d_k,  \
            T scale, T *restrict s, int ld) {                                       \
        int j0 = 0;                                                                 \
        if (n_q == 1) {                                                             \
            /* Four keys at a time: four independent sums hide the latency of   \
               the FMAs and of each sum's final reduction across lanes. */        \
            for (; j0 + 4 <= width; j0 += 4) {                                      \
                const T *k0 = k + (long) j0 * d_k, *k1 = k0 + d_k;                  \
                const T *k2 = k1 + d_k, *k3 = k2 + d_k;                             \
                FASTATTN_PREFETCH_AHEAD(k0, d_k);                                   \
                T t0 = 0, t1 = 0, t2 = 0, t3 = 0;                                   \
                _Pragma("omp simd reduction(+:t0,t1,t2,t3)")                        \
                for (int c = 0; c < d_k; c++) {                                     \
                    T x = q[c];                                                     \
                    t0 += x * k0[c]; t1 += x * k1[c];                               \
                    t2 += x * k2[c]; t3 += x * k3[c];                               \
                }                                                                   \
                s[j0] = t0 * scale; s[j0 + 1] = t1 * scale;                         \
                s[j0 + 2] = t2 * scale; s[j0 + 3] = t3 * scale;                     \
            }                                                                       \
        }                                                                           \
        for (int j = j0; j < width; j++) {                                          \
            const T *kr = k + (long) j * d_k;                                       \
            for (int r = 0; r < n_q; r++) {                                         \
                const T *qr = q + (long) r * d_k;                                   \
                T t = 0;                                                            \
                _Pragma("omp simd reduction(+:t)")                                  \
                for (int c = 0; c < d_k; c++) t += qr[c] * kr[c];                   \
                s[(long) r * ld + j] = t * scale;                                   \
            }                                                                       \
        }                                                                           \
    }
    /* acc_r += sum_{j < lim[r]} p[r * ld + j] v_j: each value row is read once;
       a row never reads a value it does not see (a NaN behind the mask). */
    #define FASTATTN_WEIGHTED_VALUES(X, T)                                          \
    FASTATTN_DECODE_TARGETS static void fastattn_weighted_values_##X(                \
            const T *restrict p, int n_q, int ld, const T *restrict v, int width,   \
            int d_v, const int *restrict lim, T *restrict acc) {                    \
        if (n_q == 1) {                                                             \
            int j = 0;                                                              \
            /* Four value rows at a time: one load and store of acc per four.  */ \
            for (; j + 4 <= lim[0]; j += 4) {                                       \
                const T *v0 = v + (long) j * d_v, *v1 = v0 + d_v;                   \
                const T *v2 = v1 + d_v, *v3 = v2 + d_v;                             \
                FASTATTN_PREFETCH_AHEAD(v0, d_v);                                   \
                T p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];           \
                _Pragma("omp simd")                                                 \
                for (int c = 0; c < d_v; c++)                                       \
                    acc[c] += (p0 * v0[c] + p1 * v1[c]) + (p2 * v2[c] + p3 * v3[c]); \
            }                                                                       \
            for (; j < lim[0]; j++) {                                               \
                const T *vr = v + (long) j * d_v;                                   \
                T pj = p[j];                                                        \
                _Pragma("omp simd")                                                 \
                for (int c = 0; c < d_v; c++) acc[c] += pj * vr[c];                 \
            }                                                                       \
            return;                                                                 \
        }                                                                           \
        for (int j = 0; j < width; j++) {                                           \
            const T *vr = v + (long) j * d_v;                                       \
            for (int r = 0; r < n_q; r++) {                                         \
                if (j >= lim[r]) continue;                                          \
                T pj = p[(long) r * ld + j];                                        \
                T *ar = acc + (long) r * d_v;                                       \
                _Pragma("omp simd")                                                 \
                for (int c = 0; c < d_v; c++) ar[c] += pj * vr[c];                  \
            }                                                                       \
        }                                                                           \
    }
    FASTATTN_KEY_SCORES(f, float)
    FASTATTN_KEY_SCORES(d, double)
    FASTATTN_WEIGHTED_VALUES(f, float)
    FASTATTN_WEIGHTED_VALUES(d, double)
    """
    int fastattn_prefetch_rows
    int fastattn_default_prefetch_rows()
    void fastattn_key_scores_f(const float *q, int n_q, const float *k, int width, int d_k,
                               float scale, float *s, int ld) nogil
    void fastattn_key_scores_d(const double *q, int n_q, const double *k, int width, int d_k,
                               double scale, double *s, int ld) nogil
    void fastattn_weighted_values_f(const float *p, int n_q, int ld, const float *v, int width,
                                    int d_v, const int *lim, float *acc) nogil
    void fastattn_weighted_values_d(const double *p, int n_q, int ld, const double *v, int width,
                                    int d_v, const int *lim, double *acc) nogil


def _set_prefetch_rows(int rows):
    """Rows ahead (0: none) that the one-query loops prefetch; for measuring only.
    Returns the distance it replaces."""
    global fastattn_prefetch_rows
    earlier = fastattn_prefetch_rows
    fastattn_prefetch_rows = rows
    return earlier


_set_prefetch_rows(fastattn_default_prefetch_rows())


cdef inline void _key_scores(const floating *q, int n_q, const floating *k, int width, int d_k,
                             floating scale, floating *s, int ld) noexcept nogil:
    if floating is float:
        fastattn_key_scores_f(q, n_q, k, width, d_k, scale, s, ld)
    else:
        fastattn_key_scores_d(q, n_q, k, width, d_k, scale, s, ld)


cdef inline void _weighted_values(const floating *p, int n_q, int ld, const floating *v,
                                  int width, int d_v, const int *lim,
                                  floating *acc) noexcept nogil:
    if floating is float:
        fastattn_weighted_values_f(p, n_q, ld, v, width, d_v, lim, acc)
    else:
        fastattn_weighted_values_d(p, n_q, ld, v, width, d_v, lim, acc)


cdef void _key_range(
    const floating *q, const floating *k, const floating *v,
    int n_q, int n_k, int d_k, int d_v, int j_lo, int j_hi, bint causal,
    floating scale, int block_k, floating *s_buf, int *lim,
    floating *m, floating *l, floating *acc, bint micro, bint one_pass,
) noexcept nogil:
    """Online softmax of all ``n_q`` rows of one head over keys ``[j_lo, j_hi)``.

    Leaves the unnormalised partial result in ``m (n_q)``, ``l (n_q)`` and
    ``acc (n_q, d_v)``; ``q, k, v`` point at the head.  ``s_buf`` holds
    ``n_q · block_k`` scores and ``lim`` ``n_q`` ints.  Up to ``FUSED_ROWS`` queries, a key
    block's scores and its ``p v`` are SIMD loops over the key and value rows (``micro``: the
    AVX-512 ones of :file:`_microkernel.pxd`, one query at a time); with more, GEMMs.
    ``one_pass`` (one query, ``micro``, ``d_k = d_v`` of 1 to 16 vectors): the range's whole
    groups of 16 (8) keys run in one pass (:func:`query_attend`), the keys left in a block.
    """
    cdef int off = n_k - n_q
    cdef int r, c, j0, width, w
    cdef int lanes = 16 if floating is float else 8
    cdef floating *srow

    for r in range(n_q):
        m[r] = NEG_INF
        l[r] = 0
    for c in range(n_q * d_v):
        acc[c] = 0
    j0 = j_lo
    if one_pass and j_hi > j_lo:
        # One query sees every key of its range (the mask is bottom-right aligned).
        width = (j_hi - j_lo) // lanes * lanes
        query_attend(q, k + <Py_ssize_t> j0 * d_k, v + <Py_ssize_t> j0 * d_v, width, d_k, scale,
                     m, l, acc, fastattn_prefetch_rows)
        j0 = j0 + width
    while j0 < j_hi:
        width = min(block_k, j_hi - j0)
        # Row r sees keys j <= r + off: the block's first w of them.
        for r in range(n_q):
            lim[r] = min(max(r + off + 1 - j0, 0), width) if causal else width
        if lim[n_q - 1] == 0:
            break                      # no row sees this block, nor any later one
        if micro and n_q <= FUSED_ROWS:
            for r in range(n_q):
                w = lim[r]
                if w > 0:
                    srow = s_buf + <Py_ssize_t> r * width
                    query_scores(q + <Py_ssize_t> r * d_k, k + <Py_ssize_t> j0 * d_k, w, d_k,
                                 scale, srow, fastattn_prefetch_rows)
                    online_softmax_row(srow, w, &m[r], &l[r], acc + <Py_ssize_t> r * d_v, d_v,
                                       True)
                    query_values(srow, v + <Py_ssize_t> j0 * d_v, w, d_v,
                                 acc + <Py_ssize_t> r * d_v, fastattn_prefetch_rows)
            j0 = j0 + width
            continue
        if n_q <= FUSED_ROWS:
            _key_scores(q, n_q, k + <Py_ssize_t> j0 * d_k, width, d_k, scale, s_buf, width)
        else:
            gemm(False, True, n_q, width, d_k, scale, q, d_k, k + <Py_ssize_t> j0 * d_k, d_k,
                 0, s_buf, width)
        for r in range(n_q):
            w = lim[r]
            if w > 0:
                srow = s_buf + <Py_ssize_t> r * width
                online_softmax_row(srow, w, &m[r], &l[r], acc + <Py_ssize_t> r * d_v, d_v,
                                   False)
        if n_q > FUSED_ROWS and lim[0] == width:
            # Every row sees the whole block: one GEMM (no masked p, no masked v).
            gemm(False, False, n_q, d_v, width, 1, s_buf, width, v + <Py_ssize_t> j0 * d_v,
                 d_v, 1, acc, d_v)
        else:
            _weighted_values(s_buf, n_q, width, v + <Py_ssize_t> j0 * d_v, width, d_v, lim, acc)
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


cdef int _split_key_softmax(
    const floating *q, const floating *k, const floating *v, floating *out, int n_batch,
    int n_q, int capacity, int d_k, int d_v, int n_splits, int n_k, bint causal, double scale,
    int block_k, int n_threads,
) except -1 nogil:
    """Fill ``out (n_batch, n_q, d_v)`` from ``q (n_batch, n_q, d_k)`` and the first ``n_k``
    rows of ``k (n_batch, capacity, d_k)`` and ``v (n_batch, capacity, d_v)``, all
    C-contiguous; return 1 when every element of ``out`` is finite, else 0.  One allocation
    holds the partial results, each thread's scores and the scaled queries."""
    cdef int span = (n_k + n_splits - 1) // n_splits
    cdef int n_items = n_batch * n_splits
    cdef Py_ssize_t n_parts = <Py_ssize_t> n_items * n_q
    cdef Py_ssize_t per_thread = <Py_ssize_t> n_q * block_k
    cdef Py_ssize_t i, n_out = <Py_ssize_t> n_batch * n_q * d_v
    # the scaled queries only when the scale is below 1
    cdef Py_ssize_t n_query = <Py_ssize_t> n_batch * n_q * d_k if scale < 1 else 0
    cdef floating *workspace = <floating *> malloc(
        (n_parts * (d_v + 2) + n_threads * per_thread + n_query) * sizeof(floating))
    cdef int *limits = <int *> malloc(<size_t> n_threads * n_q * sizeof(int) + 1)
    if workspace == NULL or limits == NULL:
        free(workspace)
        free(limits)
        with gil:
            raise MemoryError(f"the split-key kernel's workspace for {n_items} work items of "
                              f"{n_q} queries and d_v={d_v}")
    cdef floating *part_m = workspace
    cdef floating *part_l = part_m + n_parts
    cdef floating *part_acc = part_l + n_parts
    cdef floating *scratch = part_acc + n_parts * d_v
    cdef floating *scaled = scratch + n_threads * per_thread
    cdef int item, b
    cdef int t = 0              # the thread, set in each parallel block
    cdef floating s = <floating> scale
    if scale < 1:
        # fastattn._overflow.kernel_query's rule: q scaled first, in double, rounded once
        for i in range(n_query):
            scaled[i] = <floating> (<double> q[i] * scale)
        q = scaled
        s = 1
    # The register-blocked one-query loops when the rows are whole vectors, with
    # AVX-512 only: their AVX2 form (pairs of ymm, a lane-sum tree of 16 pairs)
    # took about 1.2x the time of the C loops below against a copy of the same
    # build held to those (EPYC Zen 3, 2 threads, one process, turns alternated:
    # H = 8, n_k = 8192 and 32768; two copies of one build differed by 0.9-1.0).
    cdef bint micro = (simd_rows(d_k, part_m) and simd_rows(d_v, part_m)
                       and fastattn_microkernel_isa() == 512)
    cdef int lanes = 16 if floating is float else 8
    # The one pass holds q and acc in registers: one query, d_k = d_v of at most 16 vectors.
    cdef bint one_pass = micro and n_q == 1 and d_k == d_v and d_k <= 16 * lanes

    # One thread runs the items in a plain loop: an OpenMP region costs about 1 us even of one
    # thread (8 heads of 16 keys: 3.2 us in one, 2.4 without).
    if n_threads == 1 or n_items == 1:
        for item in range(n_items):
            _work_item(item, q, k, v, n_q, n_k, capacity, d_k, d_v, n_splits, span, causal, s,
                       block_k, scratch, limits, part_m, part_l, part_acc, micro, one_pass)
    else:
        # A static schedule gives each thread the same heads at every decode step, so the K
        # and V rows it read the step before are still in its own core's caches: the same C
        # loop took 113 us dynamic against 95 static (Zen 4, 2 threads, H = 8, n_k = 4096).
        with parallel(num_threads=min(n_threads, n_items)):
            t = threadid()
            for item in prange(n_items, schedule="static"):
                _work_item(item, q, k, v, n_q, n_k, capacity, d_k, d_v, n_splits, span, causal,
                           s, block_k, scratch + t * per_thread, limits + t * n_q, part_m,
                           part_l, part_acc, micro, one_pass)
    for b in range(n_batch):
        _merge(part_m + <Py_ssize_t> b * n_splits * n_q, part_l + <Py_ssize_t> b * n_splits * n_q,
               part_acc + <Py_ssize_t> b * n_splits * n_q * d_v, n_splits, n_q, d_v,
               out + <Py_ssize_t> b * n_q * d_v)
    free(workspace)
    free(limits)
    for i in range(n_out):
        if not isfinite(out[i]):
            return 0
    return 1


cdef inline void _work_item(
    int item, const floating *q, const floating *k, const floating *v, int n_q, int n_k,
    int capacity, int d_k, int d_v, int n_splits, int span, bint causal, floating scale,
    int block_k, floating *buf, int *lim, floating *part_m, floating *part_l,
    floating *part_acc, bint micro, bint one_pass,
) noexcept nogil:
    """Work item ``item``: head ``item // n_splits`` (of ``capacity`` key rows, the first
    ``n_k`` read), its key range ``item % n_splits``, into the item's partial results."""
    cdef Py_ssize_t b = item // n_splits
    cdef int j_lo = (item % n_splits) * span
    _key_range(q + b * n_q * d_k, k + b * capacity * d_k, v + b * capacity * d_v, n_q, n_k,
               d_k, d_v, j_lo, min(n_k, j_lo + span), causal, scale, block_k, buf, lim,
               part_m + <Py_ssize_t> item * n_q, part_l + <Py_ssize_t> item * n_q,
               part_acc + <Py_ssize_t> item * n_q * d_v, micro, one_pass)


def split_key_softmax_forward(q, k, v, bint causal, double scale, n_threads=None, n_splits=None,
                              n_k=None, check_finite=False):
    """Softmax attention ``softmax(q kᵀ · scale) v`` with the keys split across threads.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k), float32 or float64, C-contiguous
        Meant for few queries (see :func:`fastattn._policy.use_split_keys`);
        correct for any ``n_q``.
    k : ndarray of shape (B, n_k, d_k), same dtype
    v : ndarray of shape (B, n_k, d_v), same dtype
    causal : bool
        Bottom-right aligned mask: query ``i`` sees key ``j`` when
        ``j <= i + n_k - n_q``; a row that sees no key is 0.
    scale : float
        Multiplies the logits, finite and > 0.  Below 1 it multiplies ``q`` first, in
        double and rounded once (:func:`fastattn._overflow.kernel_query`'s rule, here in C:
        no NumPy call), so ``q · k`` cannot overflow where the logits do not.
    n_threads : int, optional
        OpenMP threads at most; default the backend's count.  Fewer run when
        the call is too small to split (:func:`fastattn._threads.kernel_threads`);
        ignored in a build without OpenMP.  BLAS is called (held at one thread
        while several run) only with more than :data:`FUSED_MAX_N_Q` queries.
    n_splits : int, optional
        Key ranges per head, from 1 to ``n_k``; default
        :func:`fastattn._policy.split_count` for ``n_threads``.
    n_k : int, optional
        Attend over the first ``n_k`` keys and values only (from 1 to
        ``k.shape[1]``, default all): a preallocated KV cache passes its whole
        buffer and the filled length, and nothing is copied.
    check_finite : bool, default False
        Also return whether every element of ``out`` is finite, checked in C as the merge
        ends (for :func:`fastattn._overflow.finite_softmax`, which then makes no pass of
        its own: two NumPy calls, about 4 us after a step has streamed K and V through the
        caches).

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v), the dtype of ``q``
    finite : bool
        With ``check_finite`` only.

    Raises
    ------
    TypeError
        If ``q``, ``k`` or ``v`` is not a C-contiguous, aligned 3-d float32 or float64 array
        in native byte order, or their dtypes differ.
    ValueError
        If their shapes do not match, a dim passes ``INT_MAX``, or ``n_k`` is not from 1 to
        ``k.shape[1]``.
    MemoryError
        If the workspace cannot be allocated.

    Notes
    -----
    ``4 · B · n_q · n_k · d`` flops; extra memory ``B · n_splits · n_q ·
    (d_v + 2)`` elements for the partial results, ``T · n_q · SPLIT_KEYS_BLOCK_K`` for the
    scores of ``T`` threads and ``B · n_q · d_k`` for the scaled queries, in one allocation.
    Flash-Decoding (Dao et al. 2023) over the online softmax of Milakov & Gimelshein (2018).
    """
    cdef cnp.ndarray q_a = _kernel_array(q, "q"), k_a = _kernel_array(k, "k")
    cdef cnp.ndarray v_a = _kernel_array(v, "v")
    cdef int typenum = cnp.PyArray_TYPE(q_a)
    cdef cnp.npy_intp dims[3]
    if cnp.PyArray_TYPE(k_a) != typenum or cnp.PyArray_TYPE(v_a) != typenum:
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # The shapes as C integers (a tuple of Python ints would be built and read back)
    cdef cnp.npy_intp *qs = cnp.PyArray_DIMS(q_a)
    cdef cnp.npy_intp *ks = cnp.PyArray_DIMS(k_a)
    cdef cnp.npy_intp *vs = cnp.PyArray_DIMS(v_a)
    cdef int a
    for a in range(3):
        if qs[a] > INT_MAX or ks[a] > INT_MAX or vs[a] > INT_MAX:
            raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape}: a dim beyond "
                             f"{INT_MAX:,}, the kernel's int sizes")
    cdef int n_batch = qs[0], n_q = qs[1], d_k = qs[2], capacity = ks[1], d_v = vs[2]
    cdef int keys = capacity if n_k is None else n_k
    cdef int threads, splits, block_k
    if ks[0] != n_batch or vs[0] != n_batch or ks[2] != d_k or vs[1] != capacity \
            or not 1 <= keys <= capacity:
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} are not (B, n_q, d_k), "
                         f"(B, n, d_k) and (B, n, d_v) with n_k={n_k} from 1 to n")
    threads = get_num_threads() if n_threads is None else max(1, n_threads)
    splits = _policy.split_count(n_batch, keys, threads) if n_splits is None else n_splits
    splits = max(1, min(splits, keys))
    threads = kernel_threads(threads, n_batch * splits,
                             <Py_ssize_t> n_batch * n_q * keys * (d_k + d_v))
    block_k = min(SPLIT_KEYS_BLOCK_K, (keys + splits - 1) // splits)
    dims[0], dims[1], dims[2] = n_batch, n_q, d_v
    out = cnp.PyArray_EMPTY(3, dims, typenum, 0)
    if threads > 1 and n_q > FUSED_ROWS:
        with single_threaded_blas():
            finite = _run(q_a, k_a, v_a, out, splits, keys, causal, scale, block_k, threads)
    else:
        finite = _run(q_a, k_a, v_a, out, splits, keys, causal, scale, block_k, threads)
    return (out, bool(finite)) if check_finite else out


cdef cnp.ndarray _kernel_array(x, str name):
    """``x`` if it is a C-contiguous, aligned 3-d float32 or float64 ndarray in this machine's
    byte order, else TypeError."""
    if not (cnp.PyArray_Check(x) and cnp.PyArray_NDIM(<cnp.ndarray> x) == 3
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray> x)
            and cnp.PyArray_ISALIGNED(<cnp.ndarray> x)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray> x)
            and cnp.PyArray_TYPE(<cnp.ndarray> x) in (cnp.NPY_FLOAT32, cnp.NPY_FLOAT64)):
        raise TypeError(f"{name} must be a C-contiguous, aligned 3-d float32 or float64 array "
                        f"in native byte order")
    return <cnp.ndarray> x


cdef int _run(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, int n_splits,
              int n_k, bint causal, double scale, int block_k, int n_threads) except -1:
    """_split_key_softmax on the arrays' data, for their dtype: 1 when ``out`` is finite."""
    if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT32:
        return _run_on(<float *> NULL, q, k, v, out, n_splits, n_k, causal, scale, block_k,
                       n_threads)
    return _run_on(<double *> NULL, q, k, v, out, n_splits, n_k, causal, scale, block_k,
                   n_threads)


cdef int _run_on(const floating *dtype_tag, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                 cnp.ndarray out, int n_splits, int n_k, bint causal, double scale,
                 int block_k, int n_threads) except -1:
    """_run for arrays of the element type of ``dtype_tag`` (which is not read)."""
    cdef const floating *q_data = <const floating *> cnp.PyArray_DATA(q)
    cdef const floating *k_data = <const floating *> cnp.PyArray_DATA(k)
    cdef const floating *v_data = <const floating *> cnp.PyArray_DATA(v)
    cdef floating *out_data = <floating *> cnp.PyArray_DATA(out)
    cdef int finite
    with nogil:
        finite = _split_key_softmax(q_data, k_data, v_data, out_data, q.shape[0], q.shape[1],
                                    k.shape[1], q.shape[2], v.shape[2], n_splits, n_k, causal,
                                    scale, block_k, n_threads)
    return finite


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
    fq = row_scale(den + eps)   # 0 for a zero denominator, NaN for one that overflowed
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
    """Softmax attention over the first ``n_k`` keys of ``k (B, capacity, d_k)`` (a KV cache),
    no copy: ``(out, finite)``, as :func:`split_key_softmax_forward` with ``check_finite``."""
    return split_key_softmax_forward(q, k, v, causal, scale, None, None, n_k, True)


def _products_isa():
    """The instruction set of this extension's register-blocked products (see
    ``products_isa`` in _microkernel.pxd)."""
    return products_isa()
