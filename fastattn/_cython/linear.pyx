"""Linear attention (Katharopoulos et al. 2020): non-causal and chunked causal.

``out_i = φ(q_i) S_i / (φ(q_i) · z_i + eps)`` with the state
``S_i = S0 + Σ_j φ(k_j)ᵀ v_j`` and ``z_i = z0 + Σ_j φ(k_j)`` over the keys
query ``i`` sees.

* Non-causal: the state over all keys is two small products per chunk of
  :data:`NONCAUSAL_CHUNK` keys (``φ(k)ᵀ v`` by GEMM), then every query chunk
  is one GEMM ``φ(q) S`` and a dot product with ``z``.  The feature map is applied
  chunk by chunk into a small buffer, never to the whole sequence.
* Causal, chunked (the chunk form of flash-linear-attention): queries are
  taken :data:`CHUNK` at a time; the keys every query of the chunk sees are
  folded into the running state first, then the few keys only some of them
  see (the diagonal) are added as a masked quadratic term, row by row over
  the visible keys only, so a NaN or inf behind the mask is never formed.
  The state is carried in from ``(S0, z0)`` and returned after the last key.

Heads are shared out by OpenMP, one parallel region a call.  With fewer
heads than threads a head is cut into segments: non-causal (fewer than
:data:`SEGMENTS_PER_THREAD` heads a thread), the segments' keys are folded into
partial states, summed behind a barrier, then the query chunks run; causal,
the chunks are cut into runs that go in parallel, a run's chunks in order: the
first whole, the later ones (:data:`RUN_CHUNKS` chunks) from a state of their
own keys only, leaving their queries' product with the earlier keys' state to
a last step, after a prefix sum over the runs (see :func:`_causal`).  Each chunk
prefetches the rows the next one reads.  With AVX-512 or AVX2 and ``d_v`` a
multiple of the lanes every product is a register-blocked kernel of ``_linear_t.h``
(no packing, the row scales applied at its store); otherwise BLAS,
single-threaded inside (the caller limits it, see :mod:`fastattn._cython`).
"""

import threading

import numpy as np

from fastattn._cython._aligned import aligned_empty

from cython cimport floating
from cython.parallel cimport parallel, prange, threadid

from libc.math cimport log, sqrt
from libc.string cimport memcpy, memset

from fastattn._cython._blas cimport gemm
from fastattn._cython._microkernel cimport (
    products_isa,
    FASTATTN_MICROKERNEL, simd_rows, pack_keys, query_scores, scores,
)
from fastattn._cython._vmath cimport all_finite, exp_sum, row_max, row_scale
from fastattn._cython._vmath cimport feature_map as _feature_map

#: Rows per chunk: the width of the causal diagonal term and of the buffers.
CHUNK = 64
#: Rows per chunk of the non-causal kernel (no diagonal term): each chunk is
#: one ``φ(k)ᵀ v`` or ``φ(q) S`` GEMM, and 128 rows make it large enough that
#: the call overheads of BLAS are a small part of it while the feature
#: buffer (``128 d_k`` elements) stays in L1 (256 rows measured slower, 1 thread).
NONCAUSAL_CHUNK = 128

#: Causal, fewer heads than threads: chunks a run after the first (see :func:`_causal`).
#: Short runs share the work out evenly (the thread of the first run takes later runs
#: when it is done); each costs a state written and summed.
RUN_CHUNKS = 4

#: Causal, fewer heads than threads: the first run's share of a head's first step
#: against what the cost in flops makes even (see :func:`_run_starts`): its thread,
#: if slower than counted, is then not the last; if faster, it takes later runs.
FIRST_RUN_SHARE = 0.9

#: Non-causal, fewer than this many heads a thread: segments of keys a thread:
#: with several a thread, shared out dynamically, a thread slowed by other
#: work (another process, a BLAS thread still spinning) leaves its share to
#: the others.
SEGMENTS_PER_THREAD = 4

#: Elements a thread checks at a time in :func:`all_finite_parallel` (64 KiB of float32).
FINITE_BLOCK = 16384

#: Scratch arrays up to this many bytes are kept for the next call of the same Python
#: thread (:func:`_scratch`).
SCRATCH_BYTES = 8 << 20

_scratch_arrays = threading.local()


def _scratch(name, shape, dtype, aligned=True):
    """An uninitialised array for one call's own use (never returned): the one the last
    call of this Python thread used under ``name`` when shape and dtype match, else a new
    one, kept for the next call when at most :data:`SCRATCH_BYTES`.

    A fresh array's pages are faulted in as the kernel threads first write them, two
    threads at once, and glibc hands a freed array of a few hundred KiB back to the system
    when the output freed beside it tops the heap: at (1, 1, 4096, 64), causal, on two
    threads, page faults, memory-cgroup charging and their locks took about a quarter of
    the samples, and the call 1.16 against 0.56 ms with the arrays kept.  A thread keeps
    up to :data:`SCRATCH_BYTES` an array (seven arrays) after its call.
    """
    arrays = getattr(_scratch_arrays, "arrays", None)
    if arrays is None:
        arrays = _scratch_arrays.arrays = {}
    kept = arrays.get(name)
    if kept is not None and kept.shape == shape and kept.dtype == dtype:
        return kept
    fresh = aligned_empty(shape, dtype) if aligned else np.empty(shape, dtype)
    if fresh.nbytes <= SCRATCH_BYTES:
        arrays[name] = fresh
    else:
        arrays.pop(name, None)
    return fresh

cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) \
        && defined(__linux__) && !defined(FASTATTN_NO_CLONES)
    #define FASTATTN_LINEAR_TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
    #else
    #define FASTATTN_LINEAR_TARGETS
    #endif
    /* The reductions of linear attention, written so that gcc vectorises them
       ('omp simd reduction', or independent sums along the contiguous axis):
       a plain loop summing into one scalar is a chain of dependent adds. */
    #define FASTATTN_LINEAR_REDUCTIONS(T, X) \
    /* z[a] += sum_{j < rows} x[j d + a], each column summed in double */ \
    FASTATTN_LINEAR_TARGETS static void fastattn_column_sums_##X(const T *x, int rows, int d, T *z) { \
        double acc[256]; \
        for (int a0 = 0; a0 < d; a0 += 256) { \
            int w = d - a0 < 256 ? d - a0 : 256; \
            for (int a = 0; a < w; a++) acc[a] = 0; \
            for (int j = 0; j < rows; j++) { \
                const T *row = x + (long) j * d + a0; \
                _Pragma("omp simd") \
                for (int a = 0; a < w; a++) acc[a] += row[a]; \
            } \
            for (int a = 0; a < w; a++) z[a0 + a] += (T) acc[a]; \
        } \
    } \
    /* den[r] = x[r] . z for r < rows (rows of length d) */ \
    FASTATTN_LINEAR_TARGETS static void fastattn_row_dots_##X(const T *x, int rows, int d, const T *z, T *den) { \
        for (int r = 0; r < rows; r++) { \
            const T *row = x + (long) r * d; \
            T acc = 0; \
            _Pragma("omp simd reduction(+:acc)") \
            for (int a = 0; a < d; a++) acc += row[a] * z[a]; \
            den[r] = acc; \
        } \
    } \
    /* y[0:n] += x[0:n] */ \
    FASTATTN_LINEAR_TARGETS static void fastattn_add_##X(const T *x, long n, T *y) { \
        _Pragma("omp simd") \
        for (long j = 0; j < n; j++) y[j] += x[j]; \
    } \
    /* sum x[0:n] */ \
    FASTATTN_LINEAR_TARGETS static T fastattn_sum_##X(const T *x, int n) { \
        T acc = 0; \
        _Pragma("omp simd reduction(+:acc)") \
        for (int j = 0; j < n; j++) acc += x[j]; \
        return acc; \
    }
    FASTATTN_LINEAR_REDUCTIONS(float, f)
    FASTATTN_LINEAR_REDUCTIONS(double, d)
    #if !FASTATTN_MICROKERNEL
    #define FASTATTN_LINEAR_STUBS(T, X) \
    static void fastattn_linear_product_##X(const T *p, long prs, long pjs, const T *v, int ldv, \
                                            int rows, int width, const int *seen, int d_v, T *o, \
                                            int ldo, int accumulate, const T *scale, \
                                            const void *ahead, long ahead_bytes) {} \
    static void fastattn_linear_mask_##X(T *a, int lda, int rows, const int *seen, T *den) {} \
    static void fastattn_linear_elu_##X(const T *x, long n, T *out, const T *ahead) {} \
    static void fastattn_linear_elu_sums_##X(const T *x, int rows, int d, T *out, const T *ahead, \
                                             T *z, int accumulate) {}
    FASTATTN_LINEAR_STUBS(float, f)
    FASTATTN_LINEAR_STUBS(double, d)
    #define FASTATTN_LINEAR_SUM_VECTORS 0   /* no fused sums without the register-blocked loops */
    #endif
    """
    void fastattn_linear_product_f(const float *p, long prs, long pjs, const float *v, int ldv,
                                   int rows, int width, const int *seen, int d_v, float *o,
                                   int ldo, int accumulate, const float *scale,
                                   const void *ahead, long ahead_bytes) nogil
    void fastattn_linear_product_d(const double *p, long prs, long pjs, const double *v, int ldv,
                                   int rows, int width, const int *seen, int d_v, double *o,
                                   int ldo, int accumulate, const double *scale,
                                   const void *ahead, long ahead_bytes) nogil
    void fastattn_linear_mask_f(float *a, int lda, int rows, const int *seen, float *den) nogil
    void fastattn_linear_mask_d(double *a, int lda, int rows, const int *seen, double *den) nogil
    void fastattn_linear_elu_f(const float *x, long n, float *out, const float *ahead) nogil
    void fastattn_linear_elu_d(const double *x, long n, double *out, const double *ahead) nogil
    void fastattn_linear_elu_sums_f(const float *x, int rows, int d, float *out, const float *ahead,
                                    float *z, int accumulate) nogil
    void fastattn_linear_elu_sums_d(const double *x, int rows, int d, double *out,
                                    const double *ahead, double *z, int accumulate) nogil
    void fastattn_column_sums_f(const float *x, int rows, int d, float *z) nogil
    void fastattn_column_sums_d(const double *x, int rows, int d, double *z) nogil
    void fastattn_row_dots_f(const float *x, int rows, int d, const float *z, float *den) nogil
    void fastattn_row_dots_d(const double *x, int rows, int d, const double *z, double *den) nogil
    void fastattn_add_f(const float *x, long n, float *y) nogil
    void fastattn_add_d(const double *x, long n, double *y) nogil
    float fastattn_sum_f(const float *x, int n) nogil
    double fastattn_sum_d(const double *x, int n) nogil
    const int FASTATTN_LINEAR_SUM_VECTORS    # vectors a row fastattn_linear_elu_sums takes


cdef inline void _column_sums(const floating *x, int rows, int d, floating *z) noexcept nogil:
    """``z[a] += Σ_{j < rows} x[j, a]`` (rows of length ``d``), each column summed in double."""
    if floating is float:
        fastattn_column_sums_f(x, rows, d, z)
    else:
        fastattn_column_sums_d(x, rows, d, z)


cdef inline void _row_dots(const floating *x, int rows, int d, const floating *z,
                           floating *den) noexcept nogil:
    """``den[r] = x[r] · z`` for ``r < rows`` (rows of length ``d``)."""
    if floating is float:
        fastattn_row_dots_f(x, rows, d, z, den)
    else:
        fastattn_row_dots_d(x, rows, d, z, den)


cdef inline void _add(const floating *x, Py_ssize_t n, floating *y) noexcept nogil:
    """``y[0:n] += x[0:n]``."""
    if floating is float:
        fastattn_add_f(x, n, y)
    else:
        fastattn_add_d(x, n, y)


cdef inline floating _sum(const floating *x, int n) noexcept nogil:
    """``Σ x[0:n]``."""
    if floating is float:
        return fastattn_sum_f(x, n)
    else:
        return fastattn_sum_d(x, n)

cdef enum:
    ELU = 0
    RELU = 1
    IDENTITY = 2
    ELU_SIMD = 3     # elu by fastattn_linear_elu (internal: the kernels pick it)
    _FEATURE_BLOCK = 128
    _PREFIX_ROWS = 8   # rows of the state a work item of the causal prefix sum
    _QUERY_RUN = 4     # consecutive query chunks a thread takes (non-causal)

#: Rows per work item of the feature kernels (FAVOR+, Taylor).
FEATURE_BLOCK = _FEATURE_BLOCK

#: Feature map name -> code passed to the kernels.  ``identity``: the inputs
#: are features already (FAVOR+, Taylor, a user's map), of any dimension D.
FEATURE_MAP_CODES = {"elu": ELU, "relu": RELU, "identity": IDENTITY}


cdef inline const floating *_features(const floating *x, Py_ssize_t n, floating *buf,
                                      int code, const floating *ahead=NULL) noexcept nogil:
    """``φ(x[0:n])``: ``x`` itself for the identity map, else written into ``buf``;
    ``ahead`` (the next ``n`` elements to map, or NULL) prefetched by the register-blocked elu."""
    if code == IDENTITY:
        return x
    if code == ELU_SIMD:
        if floating is float:
            fastattn_linear_elu_f(x, n, buf, ahead)
        else:
            fastattn_linear_elu_d(x, n, buf, ahead)
        return buf
    _feature_map(x, n, buf, code == RELU)
    return buf


cdef inline bint _sums_with_features(int code, int d_k, const floating *tag) noexcept nogil:
    """Whether the keys' column sums ``z`` come with their features in one pass
    (:func:`_key_features`): the register-blocked elu on rows of whole vectors, at most
    ``FASTATTN_LINEAR_SUM_VECTORS`` (16) of them."""
    cdef int lanes = 16 if floating is float else 8
    return (code == ELU_SIMD and simd_rows(d_k, tag)
            and d_k <= FASTATTN_LINEAR_SUM_VECTORS * lanes)


cdef inline floating *_key_features(const floating *k, int rows, int d_k, floating *buf,
                                    const floating *ahead, floating *z,
                                    bint accumulate) noexcept nogil:
    """``buf = φ(k[0:rows])`` (elu) and ``z (+)= Σ φ``, the rows summed in the input's
    precision (``fastattn_linear_elu_sums``; see :func:`_sums_with_features`)."""
    if floating is float:
        fastattn_linear_elu_sums_f(k, rows, d_k, buf, ahead, z, accumulate)
    else:
        fastattn_linear_elu_sums_d(k, rows, d_k, buf, ahead, z, accumulate)
    return buf


cdef inline void _product(const floating *p, long prs, long pjs, const floating *v, int ldv,
                          int rows, int width, const int *seen, int d_v, floating *o, int ldo,
                          bint accumulate, const floating *scale, const void *ahead=NULL,
                          Py_ssize_t ahead_bytes=0) noexcept nogil:
    """``o[r] (+)= Σ_{j < width} p[r prs + j pjs] v[j]``, times ``scale[r]`` (AVX-512 or AVX2).

    See ``fastattn_linear_product`` in ``_linear_t.h`` (``seen``: the keys
    each block of rows reads, for the masked diagonal; ``ahead_bytes`` from
    ``ahead`` prefetched meanwhile).
    """
    if floating is float:
        fastattn_linear_product_f(p, prs, pjs, v, ldv, rows, width, seen, d_v, o, ldo,
                                  accumulate, scale, ahead, ahead_bytes)
    else:
        fastattn_linear_product_d(p, prs, pjs, v, ldv, rows, width, seen, d_v, o, ldo,
                                  accumulate, scale, ahead, ahead_bytes)


cdef inline void _mask_diagonal(floating *a, int lda, int rows, const int *seen,
                                floating *den) noexcept nogil:
    """``den[r] += Σ_{j < seen[r]} a[r, j]`` and the rest of what :func:`_product`
    reads of the row zeroed (AVX-512 or AVX2, ``fastattn_linear_mask`` in ``_linear_t.h``)."""
    if floating is float:
        fastattn_linear_mask_f(a, lda, rows, seen, den)
    else:
        fastattn_linear_mask_d(a, lda, rows, seen, den)


cdef inline void _scales(floating *den, int rows, floating eps) noexcept nogil:
    """``den[r] = 1 / (den[r] + eps)`` in place, as :func:`row_scale` gives it (0 for a
    denominator of exactly 0, NaN for one that overflowed)."""
    cdef int r
    for r in range(rows):
        den[r] = row_scale(den[r] + eps)


cdef inline void _scale_rows(floating *o, int rows, int d_v, const floating *scale) noexcept nogil:
    """``o[r] *= scale[r]`` for ``r < rows`` (rows of length ``d_v``)."""
    cdef int r, c
    cdef floating *row
    for r in range(rows):
        row = o + <Py_ssize_t> r * d_v
        for c in range(d_v):
            row[c] = row[c] * scale[r]


cdef inline void _fold_features(const floating *phi, const floating *v, int rows, int d_k,
                                int d_v, floating *S, floating *z, bint micro,
                                const floating *v_ahead=NULL, int ahead_rows=0,
                                bint overwrite=False, bint z_formed=False) noexcept nogil:
    """``S += φᵀ v``, ``z += Σ φ`` over ``rows`` keys whose features ``φ`` are formed
    (``ahead_rows`` of values from ``v_ahead`` prefetched meanwhile); ``overwrite``:
    ``S = φᵀ v``, ``z = Σ φ`` (neither read); ``z_formed``: ``z`` has them already
    (:func:`_key_features`), only ``S`` gains them."""
    if micro:
        # φᵀ read down the columns of φ: no transpose.
        _product(phi, 1, d_k, v, d_v, d_k, rows, NULL, d_v, S, d_v, not overwrite, NULL,
                 v_ahead, <Py_ssize_t> ahead_rows * d_v * sizeof(floating))
    else:
        gemm(True, False, d_k, d_v, rows, 1, phi, d_k, v, d_v, 0 if overwrite else 1, S, d_v)
    if z_formed:
        return
    if overwrite:
        memset(z, 0, d_k * sizeof(floating))
    # z gains one chunk sum (taken in double here, in the input's precision by
    # _key_features) per chunk, not one key at a time: adding 2^20 keys one by
    # one in float32 drifts by ~4e-3.
    _column_sums(phi, rows, d_k, z)


cdef void _fold_keys(const floating *k, const floating *v, int j0, int j1,
                     int d_k, int d_v, int code, int chunk,
                     floating *S, floating *z, floating *buf, bint micro,
                     int ahead_to=0, bint overwrite=False) noexcept nogil:
    """``S += φ(k[j0:j1])ᵀ v[j0:j1]``, ``z += Σ φ(k[j0:j1])``, ``chunk`` keys at a time,
    each chunk prefetching the keys and values of the chunk after the next (up to key
    ``ahead_to`` when that is past ``j1``: the next work item's).  ``overwrite``: ``=``
    instead of ``+=`` (``(S, z)`` not read; zeros when there are no keys)."""
    cdef int t, c0, rows, next_rows
    cdef bint z_formed = _sums_with_features(code, d_k, buf)
    cdef const floating *phi
    cdef const floating *k_ahead
    if overwrite and j1 <= j0:
        memset(S, 0, <Py_ssize_t> d_k * d_v * sizeof(floating))
        memset(z, 0, d_k * sizeof(floating))
    for t in range((j1 - j0 + chunk - 1) // chunk if j1 > j0 else 0):
        c0 = j0 + t * chunk
        rows = min(chunk, j1 - c0)
        # The chunk after the next: its rows have a whole chunk's time to arrive.
        next_rows = max(0, min(chunk, max(j1, ahead_to) - c0 - rows - chunk))
        k_ahead = k + <Py_ssize_t> (c0 + rows + chunk) * d_k if next_rows else NULL
        if z_formed:
            phi = _key_features(k + <Py_ssize_t> c0 * d_k, rows, d_k, buf, k_ahead, z,
                                not (overwrite and t == 0))
        else:
            phi = _features(k + <Py_ssize_t> c0 * d_k, <Py_ssize_t> rows * d_k, buf, code, k_ahead)
        _fold_features(phi, v + <Py_ssize_t> c0 * d_v, rows, d_k, d_v, S, z, micro,
                       v + <Py_ssize_t> (c0 + rows + chunk) * d_v, next_rows, overwrite and t == 0,
                       z_formed)


cdef const floating *_query_chunk(const floating *q, int i0, int i1, int d_k, int d_v,
                                  int code, const floating *S, const floating *z,
                                  floating *out, floating *buf, floating *den,
                                  bint normalise, floating eps, bint micro,
                                  int ahead_rows=0, const floating *den_add=NULL,
                                  bint accumulate=False) noexcept nogil:
    """``out[i0:i1] = φ(q) S`` and ``den = φ(q) · z``; returns ``φ(q[i0:i1])``.

    ``normalise``: the rows are divided by ``den + eps`` too and ``den``
    holds the row scales (:func:`_scales`) on return.  ``ahead_rows``: the
    next chunk's rows of ``q`` and ``out`` from ``i1`` prefetched meanwhile.
    ``accumulate``: ``out[i0:i1] += φ(q) S`` (before the scales), and ``den``
    gains ``den_add[0:i1 - i0]`` (not NULL) before them: the rows' diagonal
    term, formed earlier (:func:`_causal_segment` keeping its state).
    """
    cdef int rows = i1 - i0
    cdef const floating *phi = _features(q + <Py_ssize_t> i0 * d_k, <Py_ssize_t> rows * d_k,
                                         buf, code,
                                         q + <Py_ssize_t> i1 * d_k if ahead_rows else NULL)
    if micro and simd_rows(d_k, phi):
        # A lane-sum tree a vector of rows, not a reduction across lanes a row.
        query_scores(z, phi, rows, d_k, 1, den, 0)
    else:
        _row_dots(phi, rows, d_k, z, den)
    if den_add != NULL:
        _add(den_add, rows, den)
    if normalise:
        _scales(den, rows, eps)
    if micro:
        _product(phi, d_k, 1, S, d_v, rows, d_k, NULL, d_v, out + <Py_ssize_t> i0 * d_v, d_v,
                 accumulate, den if normalise else NULL, out + <Py_ssize_t> i1 * d_v,
                 <Py_ssize_t> ahead_rows * d_v * sizeof(floating))
        return phi
    gemm(False, False, rows, d_v, d_k, 1, phi, d_k, S, d_v, 1 if accumulate else 0,
         out + <Py_ssize_t> i0 * d_v, d_v)
    if normalise:
        _scale_rows(out + <Py_ssize_t> i0 * d_v, rows, d_v, den)
    return phi


cdef inline void _note_nonfinite(const floating *rows, Py_ssize_t n, int *bad) noexcept nogil:
    """``bad[0] = 1`` when ``rows[0:n]`` (finished rows of an output) hold an inf or NaN;
    no check when ``bad`` is NULL."""
    if bad != NULL and not all_finite(rows, n):
        bad[0] = 1


cdef inline Py_ssize_t _noncausal_workspace(int chunk, int d_k) noexcept nogil:
    """Elements a thread of :func:`_noncausal` uses: a chunk's features (``chunk d_k``)
    and its denominators (``chunk``)."""
    return <Py_ssize_t> chunk * d_k + chunk


def _noncausal(
    const floating[:, :, ::1] q,
    const floating[:, :, ::1] k,
    const floating[:, :, ::1] v,
    floating[:, :, ::1] out,
    floating[:, :, :, ::1] S_seg,
    floating[:, :, ::1] z_seg,
    floating[:, :, ::1] S,
    floating[:, ::1] z,
    floating[::1] workspace,
    int code,
    double eps,
    int chunk,
    int n_threads,
    int[::1] nonfinite,
):
    """Non-causal linear attention; writes the state over all keys into ``(S, z)``.

    One parallel region: the keys of each head are cut into ``S_seg.shape[1]``
    segments folded into ``S_seg[b, s]`` (``S_seg[b, 0]`` holds the initial
    state), summed into ``(S, z)`` row by row, then every query chunk is one
    product with ``S`` (each step behind the loop's barrier).  ``nonfinite``: empty, or
    an int a thread, set to 1 by a thread that wrote an inf or NaN into ``out`` (each
    chunk's rows checked as they are written).
    """
    cdef int n_batch = q.shape[0], n_q = q.shape[1], d_k = q.shape[2]
    cdef int n_k = k.shape[1], d_v = v.shape[2]
    cdef int n_seg = S_seg.shape[1]
    cdef int n_chunks = (n_q + chunk - 1) // chunk
    cdef Py_ssize_t per_thread = _noncausal_workspace(chunk, d_k)
    cdef int b, s, item, i0, i1, a
    cdef floating *buf = NULL   # per-thread workspace, set in the parallel block
    cdef floating total
    cdef int *bad = &nonfinite[0] if nonfinite.shape[0] > 0 else NULL
    cdef int *thread_bad = NULL
    cdef bint micro = simd_rows(d_v, buf)   # the register-blocked products, else BLAS
    if micro and code == ELU:
        code = ELU_SIMD

    # No more threads than work items: an idle thread only spins at the barriers.
    with nogil, parallel(num_threads=max(1, min(n_threads, n_batch * max(n_seg, n_chunks)))):
        buf = &workspace[0] + threadid() * per_thread
        thread_bad = bad + threadid() if bad != NULL else NULL
        for item in prange(n_batch * n_seg, schedule="dynamic"):
            b = item // n_seg
            s = item % n_seg
            # Segment 0 adds to the initial state, the others are written afresh.
            _fold_keys(&k[b, 0, 0], &v[b, 0, 0], s * n_k // n_seg, (s + 1) * n_k // n_seg,
                       d_k, d_v, code, chunk, &S_seg[b, s, 0, 0], &z_seg[b, s, 0], buf, micro,
                       0, s > 0)
        for item in prange(n_batch * d_k, schedule="static"):
            b = item // d_k
            a = item % d_k
            # Row a of the segments' states, summed in the segments' order.
            memcpy(&S[b, a, 0], &S_seg[b, 0, a, 0], d_v * sizeof(floating))
            for s in range(1, n_seg):
                _add(&S_seg[b, s, a, 0], d_v, &S[b, a, 0])
            total = 0
            for s in range(n_seg):
                total = total + z_seg[b, s, a]
            z[b, a] = total
        # Runs of _QUERY_RUN chunks a thread, each prefetching the next of its run.
        for item in prange(n_batch * n_chunks, schedule="dynamic", chunksize=_QUERY_RUN):
            b = item // n_chunks
            i0 = (item % n_chunks) * chunk
            i1 = min(i0 + chunk, n_q)
            _query_chunk(&q[b, 0, 0], i0, i1, d_k, d_v, code, &S[b, 0, 0], &z[b, 0],
                         &out[b, 0, 0], buf, buf + chunk * d_k, True, <floating> eps, micro,
                         min(chunk, n_q - i1) if (item + 1) % _QUERY_RUN else 0)
            _note_nonfinite(&out[b, i0, 0], <Py_ssize_t> (i1 - i0) * d_v, thread_bad)


cdef inline Py_ssize_t _segment_buffer(int chunk, int d_k) noexcept nogil:
    """Elements of :func:`_causal_segment`'s ``buf``: ``φ(q)`` and ``φ(k)`` of a chunk
    (``chunk d_k`` each), its weights (``chunk²``), denominators (``chunk``) and packed
    keys (``chunk d_k``, the chunk rounded up to whole panels of 16 keys)."""
    return (2 * <Py_ssize_t> chunk + (chunk + 15) // 16 * 16) * d_k + chunk * chunk + chunk


cdef inline Py_ssize_t _causal_workspace(int chunk, int d_k, int d_v) noexcept nogil:
    """Elements a thread of :func:`_causal` uses: a segment's ``buf`` and its own state
    ``(d_k, d_v)`` and ``(d_k,)``."""
    return _segment_buffer(chunk, d_k) + <Py_ssize_t> d_k * d_v + d_k


cdef inline int _keys_before(int c, int chunk, int n_q, int n_k) noexcept nogil:
    """Keys every query of chunk ``c`` sees (bottom-right aligned: query ``i`` sees key
    ``j <= i + n_k - n_q``), ``n_k`` past the last chunk."""
    return min(max(c * chunk + n_k - n_q, 0), n_k)


cdef void _causal_segment(const floating *q, const floating *k, const floating *v,
                          floating *out, floating *S, floating *z,
                          int n_q, int n_k, int d_k, int d_v, int code, floating eps,
                          int chunk, int c_begin, int c_end, int folded, bint last, bint fold,
                          floating *buf, int *seen, bint micro,
                          bint ahead_last=False, floating *S_keep=NULL,
                          floating *z_keep=NULL, floating *den_keep=NULL,
                          int *bad=NULL) noexcept nogil:
    """Query chunks ``[c_begin, c_end)`` of one head, in order, from the state ``(S, z)``.

    ``(S, z)`` holds the keys ``[0, folded)`` on entry; keys are folded in as
    the chunks advance (to ``n_k`` at the end when ``last``); not ``fold``: a
    single chunk whose state is formed already, ``(S, z)`` only read.  ``buf``:
    :func:`_segment_buffer` elements of scratch.  ``micro``: the register-blocked products,
    and when the chunk's values are all finite the diagonal is a product over each
    block of rows' visible keys; else BLAS.  Each chunk prefetches the next
    one's rows (queries, keys, values, output), the last one when ``ahead_last``.

    ``S_keep`` not NULL: the chunks' products with the state are left for later
    (:func:`_causal`, step 3): chunk ``t`` keeps the state its queries see in
    ``S_keep[t - c_begin]`` (``d_k d_v`` elements each) and ``z_keep[t - c_begin]``
    (``d_k``), its rows of ``out`` hold only the diagonal term, not normalised, and
    ``den_keep[i]`` (indexed by query row) that term's part of row ``i``'s denominator.

    ``bad`` not NULL (and no ``S_keep``): set to 1 when a chunk's finished rows of ``out``
    hold an inf or NaN, checked as each chunk ends, while its rows are in cache.
    """
    cdef floating *q_buf = buf
    cdef floating *k_buf = q_buf + chunk * d_k
    cdef floating *a_buf = k_buf + chunk * d_k
    cdef floating *den = a_buf + chunk * chunk
    cdef floating *kp = den + chunk      # the chunk's keys packed in panels
    cdef int off = n_k - n_q
    cdef int i0, i1, rows, p0, p1, width, r, r0, j, c, t, w, next_rows
    cdef floating a
    cdef floating *arow
    cdef floating *orow
    cdef const floating *vrow
    cdef const floating *phi_q
    cdef const floating *phi_k
    cdef bint v_finite, diag_product, z_formed
    cdef bint keep = S_keep != NULL
    cdef Py_ssize_t state = <Py_ssize_t> d_k * d_v
    for t in range(c_begin, c_end):
        i0 = t * chunk
        i1 = min(i0 + chunk, n_q)
        rows = i1 - i0
        # Keys [0, p0) are seen by every query of the chunk, [p0, p1) by some
        # (the diagonal, each query's own key included), then folded in.
        p0 = _keys_before(t, chunk, n_q, n_k)
        p1 = _keys_before(t + 1, chunk, n_q, n_k)
        _fold_keys(k, v, folded, p0, d_k, d_v, code, chunk, S, z, k_buf, micro)
        folded = p0
        width = p1 - p0
        next_rows = min(chunk, n_q - i1) if t + 1 < c_end or ahead_last else 0
        # The diagonal's values all finite (checked here, where they are in
        # cache): its term may be one product over weights zeroed where masked.
        v_finite = width > 0 and all_finite(v + <Py_ssize_t> p0 * d_v, <Py_ssize_t> width * d_v)
        diag_product = micro and v_finite
        if keep:
            # The state for step 3; the rows start at 0, the diagonal's denominators too.
            memcpy(S_keep + (t - c_begin) * state, S, state * sizeof(floating))
            memcpy(z_keep + (t - c_begin) * d_k, z, d_k * sizeof(floating))
            phi_q = _features(q + <Py_ssize_t> i0 * d_k, <Py_ssize_t> rows * d_k, q_buf, code,
                              q + <Py_ssize_t> i1 * d_k if next_rows else NULL)
            memset(den, 0, rows * sizeof(floating))
            if not diag_product:
                # The diagonal term (if any) is added to the rows below, not written.
                memset(out + <Py_ssize_t> i0 * d_v, 0, <Py_ssize_t> rows * d_v * sizeof(floating))
        else:
            # Without a diagonal, or when its product applies the row scales, the
            # rows are normalised there; else below.
            phi_q = _query_chunk(q, i0, i1, d_k, d_v, code, S, z, out, q_buf, den,
                                 width == 0, eps, micro, next_rows)
        if width > 0:
            # Folding them at the end: z gains the diagonal's keys with their features
            # (the chunk's denominators have read z already).
            z_formed = fold and _sums_with_features(code, d_k, k_buf)
            if z_formed:
                phi_k = _key_features(k + <Py_ssize_t> p0 * d_k, width, d_k, k_buf,
                                      k + <Py_ssize_t> p1 * d_k if next_rows else NULL, z, True)
            else:
                phi_k = _features(k + <Py_ssize_t> p0 * d_k, <Py_ssize_t> width * d_k, k_buf,
                                  code, k + <Py_ssize_t> p1 * d_k if next_rows else NULL)
            for r in range(rows):
                seen[r] = min(max(i0 + r + off + 1, 0), n_k) - p0
            if micro:
                pack_keys(phi_k, d_k, width, d_k, kp)
                # Each block of 6 rows (the product's) only over the keys it sees.
                for r0 in range(0, rows, 6):
                    w = seen[min(r0 + 6, rows) - 1]
                    if w > 0:
                        scores(phi_q + <Py_ssize_t> r0 * d_k, d_k, kp, min(6, rows - r0), w,
                               d_k, 1, a_buf + <Py_ssize_t> r0 * width, width)
            else:
                gemm(False, True, rows, width, d_k, 1, phi_q, d_k, phi_k, d_k, 0, a_buf, width)
            if diag_product:
                _mask_diagonal(a_buf, width, rows, seen, den)
            for r in range(rows if not diag_product else 0):
                arow = a_buf + <Py_ssize_t> r * width
                den[r] = den[r] + _sum(arow, seen[r])
                if v_finite:
                    for j in range(seen[r], width):
                        arow[j] = 0
                else:
                    # Form only the terms the row sees: 0 * inf must not reach it.
                    orow = out + <Py_ssize_t> (i0 + r) * d_v
                    for j in range(seen[r]):
                        a = arow[j]
                        vrow = v + <Py_ssize_t> (p0 + j) * d_v
                        for c in range(d_v):
                            orow[c] = orow[c] + a * vrow[c]
            if keep:
                memcpy(den_keep + i0, den, rows * sizeof(floating))
            else:
                _scales(den, rows, eps)
            if diag_product:
                _product(a_buf, width, 1, v + <Py_ssize_t> p0 * d_v, d_v, rows, width, seen,
                         d_v, out + <Py_ssize_t> i0 * d_v, d_v, not keep, NULL if keep else den,
                         v + <Py_ssize_t> p1 * d_v, <Py_ssize_t> next_rows * d_v * sizeof(floating))
            else:
                if v_finite:
                    # Masked weights are 0 and every value is finite: one GEMM.
                    gemm(False, False, rows, d_v, width, 1, a_buf, width,
                         v + <Py_ssize_t> p0 * d_v, d_v, 1, out + <Py_ssize_t> i0 * d_v, d_v)
                if not keep:
                    _scale_rows(out + <Py_ssize_t> i0 * d_v, rows, d_v, den)
            # The diagonal's keys join the state, their features formed once.
            if fold:
                _fold_features(phi_k, v + <Py_ssize_t> p0 * d_v, width, d_k, d_v, S, z, micro,
                               NULL, 0, False, z_formed)
                folded = p1
        elif keep:
            memset(den_keep + i0, 0, rows * sizeof(floating))   # and the rows are 0
        if not keep:
            _note_nonfinite(out + <Py_ssize_t> i0 * d_v, <Py_ssize_t> rows * d_v, bad)
    if last:
        _fold_keys(k, v, folded, n_k, d_k, d_v, code, chunk, S, z, k_buf, micro)


def _causal(
    const floating[:, :, ::1] q,
    const floating[:, :, ::1] k,
    const floating[:, :, ::1] v,
    floating[:, :, ::1] out,
    floating[:, :, :, ::1] S_r,
    floating[:, :, ::1] z_r,
    const int[::1] run_starts,
    floating[:, :, :, ::1] S_keep,
    floating[:, :, ::1] z_keep,
    floating[:, ::1] den_keep,
    floating[::1] workspace,
    int[::1] seen,
    int code,
    double eps,
    int chunk,
    int n_threads,
    int[::1] nonfinite,
):
    """Chunked causal linear attention, one parallel region.

    ``S_r.shape[1] == 1``: a head a work item, its chunks in order from
    ``(S_r[b, 0], z_r[b, 0])`` (the initial state on entry, the state after
    the last key on return).  Else (fewer heads than threads) a head's chunks
    are cut into ``G = S_r.shape[1] - 1`` runs of consecutive chunks, run ``g``
    the chunks ``[run_starts[g], run_starts[g + 1])`` (the later runs all as long
    as run 1 but the last), and no key is folded twice:

    1. the runs in parallel, each folding its own keys as it goes into the thread's
       own state.  Run 0 starts from ``(S_r[b, 0], z_r[b, 0])`` and is done whole.
       Every later run starts from zeros and does what needs no earlier key: it keeps
       the state of its own keys each chunk's queries see (in ``S_keep``, ``z_keep``,
       a chunk from ``run_starts[1]`` on) and forms the diagonal term, not normalised,
       in ``out`` (its denominators in ``den_keep``).  Run ``g``'s state after its keys
       is written to entry ``g + 1``;
    2. a prefix sum over the runs, by blocks of rows of the state: entry ``g + 1``
       gains entry ``g`` (``g >= 1``), so entry ``g`` is the state run ``g`` starts
       from and entry ``G`` the state after the last key;
    3. the chunks of the later runs in parallel: ``out += φ(q) (S_r[b, g] + S_keep)``,
       then normalised.

    A later run's chunk costs step 1 all but its product with the state: run 0 is a
    head's share of step 1 or a little less, and the later runs are short
    (:data:`RUN_CHUNKS`), so that the threads share step 1 out evenly whatever a
    chunk costs each (:func:`_run_starts`).  Extra work
    against one thread: a state copied a chunk, the queries' features formed twice
    and their rows written twice; each step is behind a loop's barrier.  ``seen``:
    ``chunk`` ints a thread.  ``nonfinite``: empty, or an int a thread, set to 1 by a
    thread that finished rows of ``out`` holding an inf or NaN (each chunk's rows checked
    as they are finished).
    """
    cdef int n_batch = q.shape[0], n_q = q.shape[1], d_k = q.shape[2]
    cdef int n_k = k.shape[1], d_v = v.shape[2]
    cdef int n_chunks = (n_q + chunk - 1) // chunk
    cdef int n_runs = S_r.shape[1] - 1
    cdef bint by_runs = n_runs > 1
    cdef int first = run_starts[1] if by_runs else n_chunks   # the first chunk kept for step 3
    cdef int n_late = n_chunks - first
    cdef int run_chunks = run_starts[2] - run_starts[1] if by_runs else 1   # a later run's
    cdef int n_items = n_batch * max(n_runs, 1)
    cdef int row_blocks = (d_k + _PREFIX_ROWS - 1) // _PREFIX_ROWS
    cdef Py_ssize_t state = <Py_ssize_t> d_k * d_v
    cdef Py_ssize_t per_thread = _causal_workspace(chunk, d_k, d_v)
    cdef int item, b, g, t, a, a1, c_begin, c_end, i0, i1
    cdef floating *buf = NULL   # per-thread workspace, set in the parallel block
    cdef floating *own = NULL   # the thread's own state in steps 1 and 3
    cdef floating e = <floating> eps
    cdef int *bad = &nonfinite[0] if nonfinite.shape[0] > 0 else NULL
    cdef int *thread_bad = NULL
    cdef bint micro = simd_rows(d_v, buf)   # the register-blocked products, else BLAS
    if micro and code == ELU:
        code = ELU_SIMD

    with nogil, parallel(num_threads=max(1, min(n_threads, n_items))):
        buf = &workspace[0] + threadid() * per_thread
        own = buf + _segment_buffer(chunk, d_k)
        thread_bad = bad + threadid() if bad != NULL else NULL
        if not by_runs:
            for item in prange(n_batch, schedule="dynamic"):
                _causal_segment(&q[item, 0, 0], &k[item, 0, 0], &v[item, 0, 0], &out[item, 0, 0],
                                &S_r[item, 0, 0, 0], &z_r[item, 0, 0], n_q, n_k, d_k, d_v, code,
                                e, chunk, 0, n_chunks, 0, True, True, buf,
                                &seen[threadid() * chunk], micro, False, NULL, NULL, NULL,
                                thread_bad)
        else:
            # (1) the runs: run 0 of every head first, whole, then the later runs,
            # keeping their states and diagonals, to whichever thread is free
            for item in prange(n_batch * n_runs, schedule="dynamic"):
                b = item % n_batch
                g = item // n_batch
                c_begin = run_starts[g]
                c_end = run_starts[g + 1]
                if g == 0:
                    memcpy(own, &S_r[b, 0, 0, 0], state * sizeof(floating))
                    memcpy(own + state, &z_r[b, 0, 0], d_k * sizeof(floating))
                    _causal_segment(&q[b, 0, 0], &k[b, 0, 0], &v[b, 0, 0], &out[b, 0, 0],
                                    own, own + state, n_q, n_k, d_k, d_v, code, e, chunk,
                                    c_begin, c_end, 0, False, True, buf,
                                    &seen[threadid() * chunk], micro, False, NULL, NULL,
                                    NULL, thread_bad)
                else:
                    memset(own, 0, (state + d_k) * sizeof(floating))
                    _causal_segment(&q[b, 0, 0], &k[b, 0, 0], &v[b, 0, 0], &out[b, 0, 0],
                                    own, own + state, n_q, n_k, d_k, d_v, code, e, chunk,
                                    c_begin, c_end,
                                    _keys_before(c_begin, chunk, n_q, n_k),
                                    g == n_runs - 1, True, buf, &seen[threadid() * chunk], micro,
                                    False, &S_keep[b, c_begin - first, 0, 0],
                                    &z_keep[b, c_begin - first, 0], &den_keep[b, 0])
                memcpy(&S_r[b, g + 1, 0, 0], own, state * sizeof(floating))
                memcpy(&z_r[b, g + 1, 0], own + state, d_k * sizeof(floating))
            # (2) the prefix sum over the runs, _PREFIX_ROWS rows of the state at a time
            for item in prange(n_batch * row_blocks, schedule="static"):
                b = item // row_blocks
                a = item % row_blocks * _PREFIX_ROWS
                a1 = min(a + _PREFIX_ROWS, d_k)
                for g in range(1, n_runs):
                    _add(&S_r[b, g, a, 0], <Py_ssize_t> (a1 - a) * d_v, &S_r[b, g + 1, a, 0])
                    _add(&z_r[b, g, a], a1 - a, &z_r[b, g + 1, a])
            # (3) the later runs' chunks: the state of the keys before the run and of the
            # run's own keys, then the product; runs of _QUERY_RUN chunks a thread
            for item in prange(n_batch * n_late, schedule="dynamic", chunksize=_QUERY_RUN):
                b = item // n_late
                t = first + item % n_late
                g = 1 + (t - first) // run_chunks
                memcpy(own, &S_r[b, g, 0, 0], state * sizeof(floating))
                _add(&S_keep[b, t - first, 0, 0], state, own)
                memcpy(own + state, &z_r[b, g, 0], d_k * sizeof(floating))
                _add(&z_keep[b, t - first, 0], d_k, own + state)
                i0 = t * chunk
                i1 = min(i0 + chunk, n_q)
                _query_chunk(&q[b, 0, 0], i0, i1, d_k, d_v, code, own, own + state,
                             &out[b, 0, 0], buf, buf + chunk * d_k, True, e, micro,
                             min(chunk, n_q - i1) if (item + 1) % _QUERY_RUN else 0,
                             &den_keep[b, i0], True)
                _note_nonfinite(&out[b, i0, 0], <Py_ssize_t> (i1 - i0) * d_v, thread_bad)


def _takes_products(int d_v, dtype):
    """Whether a call with values ``d_v`` wide in ``dtype`` (float32 or float64)
    takes the register-blocked products (else BLAS)."""
    cdef float f32 = 0
    cdef double f64 = 0
    if np.dtype(dtype) == np.float32:
        return bool(simd_rows(d_v, &f32))
    return bool(simd_rows(d_v, &f64))


def _run_starts(n_chunks, threads, chunk, prefix, d_k, d_v):
    """The first chunk of each run of a head that ``threads`` threads share (``threads``
    may be fractional: the threads over the heads), and ``n_chunks`` after them.

    Step 1 of :func:`_causal` costs run 0 its ``prefix`` keys before the first chunk
    and whole chunks, the later runs chunks without their product with the state:
    counted in flops (a chunk ``4 C d_k d_v + C (C + 1) (d_k + d_v)``, its product
    ``2 C d_k d_v``, a key folded ``2 d_k d_v``), run 0 takes :data:`FIRST_RUN_SHARE`
    of the chunks that make it one thread's share, a chunk at least and all but one
    at most; the rest are runs of :data:`RUN_CHUNKS`.  A single thread or chunk, or
    a state a chunk larger than the chunk's rows of ``q``, ``k``, ``v`` and the
    output (``d_k d_v + d_k > 2 C (d_k + d_v)``: ``d_k = d_v`` above about
    ``4 C``, where the kept states would outgrow the inputs): ``[0, n_chunks]``,
    each head on one thread.
    """
    if threads <= 1 or n_chunks < 2 or d_k * d_v + d_k > 2 * chunk * (d_k + d_v):
        return np.array([0, n_chunks], np.intc)
    whole = 4 * chunk * d_k * d_v + chunk * (chunk + 1) * (d_k + d_v)
    later = whole - 2 * chunk * d_k * d_v
    even = (n_chunks * later - (threads - 1) * prefix * 2 * d_k * d_v) / (
        threads * whole - (whole - later))
    first = min(max(1, round(FIRST_RUN_SHARE * even)), n_chunks - 1)
    return np.array([0, *range(first, n_chunks, RUN_CHUNKS), n_chunks], np.intc)


def linear_attention_forward(q, k, v, feature_map, bint causal, double eps, S0=None, z0=None,
                             int n_threads=1, bint check_finite=False):
    """Linear attention with state: non-causal by two products, causal by chunks.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k), float32 or float64, C-contiguous
    k : ndarray of shape (B, n_k, d_k), same dtype
    v : ndarray of shape (B, n_k, d_v), same dtype
    feature_map : {"elu", "relu", "identity"}
        ``elu(x) + 1``, ``max(x, 0)``, or ``x`` (``q`` and ``k`` are
        features already, of any dimension ``D`` in place of ``d_k``).
    causal : bool
        Bottom-right aligned mask (query ``i`` sees key ``j <= i + n_k - n_q``).
    eps : float
        Added to the denominator; a row whose denominator is exactly 0 is 0, one
        whose denominator overflowed NaN.
    S0 : ndarray of shape (B, d_k, d_v), optional
        State of earlier keys (default zeros); read, never written.
    z0 : ndarray of shape (B, d_k), optional
    n_threads : int, default 1
        OpenMP threads (the package's ``get_num_threads()`` when called
        through the backend); ignored in a build without OpenMP.
    check_finite : bool, default False
        Check every element of ``out`` as its rows are finished, while they are in
        cache, and return the verdict too.

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v)
    S : ndarray of shape (B, d_k, d_v)
        ``S0 + φ(k)ᵀ v`` over all keys.
    z : ndarray of shape (B, d_k)
        ``z0 + Σ_j φ(k_j)``.
    finite : bool
        Only with ``check_finite``: whether every element of ``out`` is finite.

    Notes
    -----
    Non-causal ``4 · B · n · d_k · d_v`` flops; causal adds the diagonal
    term, ``O(B · n · CHUNK · (d_k + d_v))``.  Extra memory besides the
    outputs: ``T · (3 CHUNK d_k + CHUNK² + CHUNK + d_k d_v + d_k)`` elements
    and ``T · CHUNK`` ints for ``T`` threads when causal,
    ``T · NONCAUSAL_CHUNK · (d_k + 1)`` otherwise, and a ``(d_k, d_v)`` state a
    segment of keys (non-causal, fewer than ``SEGMENTS_PER_THREAD`` heads a
    thread).  Causal with fewer heads than threads: for each chunk after the
    first run a state, ``d_k d_v + d_k`` elements, for each run (one and a
    :data:`RUN_CHUNKS` th of them) another, and a denominator a query: at most
    ``B (1.25 ⌈n_q / CHUNK⌉ (d_k d_v + d_k) + n_q)`` elements, about 1.25 times
    the output when ``d_k = CHUNK``, and never more than ``q``, ``k``, ``v`` and
    the output together (with larger states each head runs on one thread).  These
    arrays, up to :data:`SCRATCH_BYTES` each, are kept by the calling Python thread for
    its next call of the same shape (:func:`_scratch`).
    Katharopoulos et al., "Transformers are RNNs" (ICML 2020).
    """
    if feature_map not in FEATURE_MAP_CODES:
        raise ValueError(f"feature_map must be one of {list(FEATURE_MAP_CODES)}, got {feature_map!r}")
    n_threads = max(1, n_threads)
    n_batch, n_q, d_k = q.shape
    d_v = v.shape[2]
    dtype = q.dtype
    # Features, states and output rows on cache lines (see fastattn._cython._aligned).
    out = aligned_empty((n_batch, n_q, d_v), dtype)
    chunk = CHUNK if causal else NONCAUSAL_CHUNK
    per_thread = _causal_workspace(chunk, d_k, d_v) if causal else _noncausal_workspace(chunk, d_k)
    workspace = _scratch("workspace", (n_threads * per_thread,), dtype)
    code = FEATURE_MAP_CODES[feature_map]
    nonfinite = np.zeros(n_threads if check_finite else 0, np.intc)
    n_chunks = -(-(n_q if causal else k.shape[1]) // chunk)
    if causal:
        # Fewer heads than threads: each head's chunks in runs (see _causal).
        starts = _run_starts(n_chunks, n_threads / n_batch, chunk,
                             max(0, min(k.shape[1] - n_q, k.shape[1])), d_k, d_v)
        n_runs = len(starts) - 1 if len(starts) > 2 else 0
        n_seg = n_runs + 1
    else:
        # Fewer than SEGMENTS_PER_THREAD heads a thread: each head's keys
        # folded in segments (that cost only their sum); one thread folds in order.
        spread = SEGMENTS_PER_THREAD * n_threads
        n_seg = (max(1, min(-(-spread // n_batch), n_chunks))
                 if n_threads > 1 and n_batch < spread else 1)
    # The entries after the first are written by the threads that fold into them.
    S_seg = _scratch("S_seg", (n_batch, n_seg, d_k, d_v), dtype)
    z_seg = _scratch("z_seg", (n_batch, n_seg, d_k), dtype, aligned=False)
    S_seg[:, 0] = 0 if S0 is None else S0
    z_seg[:, 0] = 0 if z0 is None else z0
    if causal:
        n_late = n_chunks - starts[1] if n_runs else 0
        # Written before they are read, for the chunks after the first run only.
        S_keep = _scratch("S_keep", (n_batch, n_late, d_k, d_v), dtype)
        z_keep = _scratch("z_keep", (n_batch, n_late, d_k), dtype, aligned=False)
        den_keep = _scratch("den_keep", (n_batch, n_q if n_runs else 0), dtype, aligned=False)
        _causal(q, k, v, out, S_seg, z_seg, starts, S_keep, z_keep, den_keep, workspace,
                _scratch("seen", (n_threads * chunk,), np.dtype(np.intc), aligned=False),
                code, eps, chunk, n_threads, nonfinite)
        result = out, S_seg[:, -1].copy(), z_seg[:, -1].copy()
    else:
        S = aligned_empty((n_batch, d_k, d_v), dtype)
        z = np.empty((n_batch, d_k), dtype)
        _noncausal(q, k, v, out, S_seg, z_seg, S, z, workspace, code, eps, chunk, n_threads,
                   nonfinite)
        result = out, S, z
    return (*result, not nonfinite.any()) if check_finite else result


def _favor_exponents(
    const floating[:, :, ::1] x,
    const floating[:, ::1] w,
    const floating[:, ::1] key_shift,
    floating[:, :, ::1] out,
    floating[:, :, ::1] peaks,
    int n_threads,
):
    """``out = x w`` block by block (GEMM); then queries (``key_shift`` given, ``c (B, m)``):
    ``exp(out + c − row max − ln(m)/2)``; keys (``key_shift`` None): ``out −= ‖x‖²/(2√d_k)``
    and ``peaks[b, t, r]`` = the largest exponent of feature ``r`` in block ``t`` (NaN ignored)."""
    cdef int B = x.shape[0], n = x.shape[1], d_k = x.shape[2], m = w.shape[1]
    cdef int nblk = (n + _FEATURE_BLOCK - 1) // _FEATURE_BLOCK
    cdef bint is_query = key_shift is not None
    cdef int item, b, t, i0, rows, i, r, a
    cdef floating half_ln_m = <floating> (0.5 * log(m))
    cdef floating norm_coef = <floating> (0.5 / sqrt(d_k))
    cdef floating sq, er
    cdef floating *row
    cdef floating *peak
    cdef const floating *xrow
    cdef const floating *c
    # The loops below trust these shapes (a w of another d_k would be read past its end).
    if w.shape[0] != d_k:
        raise ValueError(f"w must have shape (d_k, m) = ({d_k}, m) for x of d_k = {d_k}, "
                         f"got ({w.shape[0]}, {m})")
    if out.shape[0] != B or out.shape[1] != n or out.shape[2] != m:
        raise ValueError(f"out must have shape ({B}, {n}, {m}), got {tuple(out.shape)[:3]}")
    if is_query and (key_shift.shape[0] != B or key_shift.shape[1] != m):
        raise ValueError(f"key_shift must have shape ({B}, {m}), got {tuple(key_shift.shape)[:2]}")
    if not is_query and (peaks is None or peaks.shape[0] != B or peaks.shape[1] != nblk
                         or peaks.shape[2] != m):
        raise ValueError(f"peaks must have shape ({B}, {nblk}, {m})")
    with nogil, parallel(num_threads=max(1, min(n_threads, B * nblk))):
        for item in prange(B * nblk, schedule="static"):
            b = item // nblk
            t = item % nblk
            i0 = t * _FEATURE_BLOCK
            rows = min(n, i0 + _FEATURE_BLOCK) - i0
            gemm(False, False, rows, m, d_k, 1, &x[b, i0, 0], d_k, &w[0, 0], m, 0,
                 &out[b, i0, 0], m)
            for i in range(rows):
                row = &out[b, i0 + i, 0]
                if is_query:
                    c = &key_shift[b, 0]
                    for r in range(m):
                        row[r] = row[r] + c[r]
                    exp_sum(row, m, row_max(row, m) + half_ln_m)
                else:
                    xrow = &x[b, i0 + i, 0]
                    peak = &peaks[b, t, 0]
                    sq = 0
                    for a in range(d_k):
                        sq = sq + xrow[a] * xrow[a]
                    sq = sq * norm_coef
                    for r in range(m):  # branch-free, so it vectorises; a NaN is passed over
                        er = row[r] - sq
                        row[r] = er
                        peak[r] = er if er > peak[r] else peak[r]


def _favor_shift_exp(floating[:, :, ::1] out, const floating[:, ::1] shift, double half_ln_m,
                     int n_threads):
    """``out[b, :, r] = exp(out[b, :, r] − shift[b, r] − ln(m)/2)`` in place (vector exp)."""
    cdef int B = out.shape[0], n = out.shape[1], m = out.shape[2]
    cdef int item, b, r
    cdef floating *row
    cdef const floating *c
    if shift.shape[0] != B or shift.shape[1] != m:
        raise ValueError(f"shift must have shape ({B}, {m}), got {tuple(shift.shape)[:2]}")
    with nogil, parallel(num_threads=max(1, min(n_threads, B * n))):
        for item in prange(B * n, schedule="static"):
            b = item // n
            row = &out[b, item % n, 0]
            c = &shift[b, 0]
            for r in range(m):
                row[r] = row[r] - c[r]
            exp_sum(row, m, <floating> half_ln_m)


def favor_query_features(x, w, key_shift, int n_threads=1):
    """FAVOR+ query features ``(B, n, m)``: ``exp(x w + c − row max) / √m``.

    ``x (B, n, d_k)``, ``w = (ω / d_k^¼)ᵀ (d_k, m)`` of ``x``'s dtype, both
    C-contiguous, and the keys' frame ``key_shift = c (B, m)`` float64; see
    :func:`fastattn.reference.favor_query_features`.
    """
    B, n, _ = x.shape
    out = np.empty((B, n, w.shape[1]), x.dtype)
    _favor_exponents(x, w, np.ascontiguousarray(key_shift, x.dtype), out, None, n_threads)
    return out


def favor_key_features(x, w, int n_threads=1):
    """FAVOR+ key features ``(B, n, m)`` and the shift of each feature ``c (B, m)`` float64.

    ``exp(x w − ‖x‖²/(2√d_k) − c_br) / √m`` with ``c_br`` the largest exponent
    of feature ``r`` over the keys of head ``b``; see
    :func:`fastattn.reference.favor_key_features`.
    """
    B, n, _ = x.shape
    m = w.shape[1]
    out = np.empty((B, n, m), x.dtype)
    peaks = np.full((B, -(-n // FEATURE_BLOCK), m), -np.inf, x.dtype)
    _favor_exponents(x, w, None, out, peaks, n_threads)
    peak = peaks.max(axis=1, initial=-np.inf)
    shift = np.where(np.isfinite(peak), peak, 0).astype(x.dtype)
    _favor_shift_exp(out, shift, 0.5 * np.log(m), n_threads)
    return out, shift.astype(np.float64)


def _taylor(const floating[:, :, ::1] x, floating[:, :, ::1] out, int n_threads):
    cdef int B = x.shape[0], n = x.shape[1], d_k = x.shape[2]
    cdef int item, a, a2, p
    cdef floating c1 = <floating> (d_k ** -0.25)
    cdef floating c_diag = <floating> (1 / sqrt(2.0 * d_k))
    cdef floating c_off = <floating> (1 / sqrt(<double> d_k))
    cdef floating xa, xs
    cdef const floating *row
    cdef floating *o
    with nogil, parallel(num_threads=max(1, min(n_threads, B * n))):
        for item in prange(B * n, schedule="static"):
            row = &x[item // n, item % n, 0]
            o = &out[item // n, item % n, 0]
            o[0] = 1
            for a in range(d_k):
                o[1 + a] = row[a] * c1
            p = 1 + d_k
            for a in range(d_k):
                xa = row[a]
                o[p] = xa * xa * c_diag
                xs = xa * c_off
                for a2 in range(a + 1, d_k):
                    o[p + a2 - a] = xs * row[a2]
                p = p + d_k - a


def taylor_features(x, int n_threads=1):
    """Second-order Taylor features ``(B, n, 1 + d_k + d_k (d_k + 1) / 2)``.

    See :func:`fastattn.reference.taylor_features` (the specification).
    """
    B, n, d_k = x.shape
    out = np.empty((B, n, 1 + d_k + d_k * (d_k + 1) // 2), x.dtype)
    _taylor(x, out, n_threads)
    return out


def all_finite_parallel(const floating[::1] x, int n_threads=1):
    """Whether every element of ``x`` is finite: blocks of :data:`FINITE_BLOCK` elements
    on ``n_threads`` OpenMP threads, each checked in SIMD lanes; nothing is allocated.

    Parameters
    ----------
    x : ndarray of shape (n,), float32 or float64, contiguous
        An output, flattened (``out.reshape(-1)``).
    n_threads : int

    Returns
    -------
    bool
        True for ``n == 0``.
    """
    cdef Py_ssize_t n = x.shape[0], block = FINITE_BLOCK, b
    cdef Py_ssize_t blocks = (n + block - 1) // block
    cdef int bad = 0
    if n == 0:
        return True
    if n_threads <= 1 or blocks < 2:
        with nogil:
            bad = not all_finite(&x[0], n)
        return bad == 0
    with nogil:
        for b in prange(blocks, schedule="static", num_threads=min(n_threads, blocks)):
            if not all_finite(&x[0] + b * block, min(block, n - b * block)):
                bad += 1
    return bad == 0


def _products_isa():
    """The instruction set of this extension's register-blocked products (see
    ``products_isa`` in _microkernel.pxd)."""
    return products_isa()
