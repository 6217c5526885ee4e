from cython cimport floating

# Register-blocked products of the online softmax tile and of linear attention
# (float32 and float64), with AVX-512 or with AVX2 and FMA.
#
# OpenBLAS's sgemm packs both operands of every call and zero-fills C when
# beta = 0; measured side by side here (1 thread, CPU time, loaded machine)
# its tile GEMMs alone (256 x 256 x 64) took about as long as onnxruntime's
# whole attention, so around them the tile could not reach the peers.  These
# two products need no packing of q or of p (k and v are packed once per head:
# k transposed into panels of 16 keys, v cut into panels of columns) and write
# the scores straight into the tile:
#
# * scores  s[r, j] = scale * sum_c q[r, c] k[j, c]: 6 rows x 4 panels of
#   keys of accumulators (24 zmm; AVX2: 6 rows x 1 panel, 12 ymm), one
#   broadcast of q per row and one load per panel;
# * output  o[r, :] += sum_j p[r, j] v[j, :]: 6 rows x 4 vectors of columns
#   of o in registers (AVX2: x 1 vector, two ymm) over all the tile's keys,
#   v read from its panel of those columns, one contiguous stream;
# * max      the row's maximum, four vectors of running maxima;
# * exp_sum  the row's exp(s - shift) and its sum, by a polynomial for 2**f
#   and vscalef (AVX2: the exponent bits) for 2**n.
#
# The C is written once, in _microkernel_t.h (and _linear_t.h), on vector
# operations that _microkernel_ops.h maps to one instruction set and element
# type, and included four times: AVX-512F and AVX2 (+FMA, each by a function
# target attribute), float (panels of 16 keys) and double (panels of 8).  An
# AVX2 vector is a pair of ymm (_avx2_pair.h), so the panels, the scratch and
# the lane rule are the same in both.  The public functions below pick the
# instruction set at run time (fastattn_microkernel_isa: the CPU's best, once);
# they run when d_k and d_v are multiples of the lane count, and otherwise
# the tile calls BLAS.  Sums run in the order of c (of j), one FMA at a time,
# in the input's precision like BLAS, in both instruction sets.
#
# FASTATTN_SIMD=avx2 in the environment holds an AVX-512 CPU to the AVX2
# loops, FASTATTN_SIMD=off to BLAS (any case), so both sets of loops can be
# tested and measured on one machine.  Each extension reads it once, and
# fastattn._cython makes every extension read it as it imports them (see
# products_isa), so one process holds one value.
cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) \
        && !defined(FASTATTN_NO_MICROKERNEL)
    #include <ctype.h>
    #include <immintrin.h>
    #include <math.h>
    #include <stdlib.h>
    #include <string.h>
    #include <strings.h>
    #define FASTATTN_MICROKERNEL 1
    #define FA_AVX512 __attribute__((target("avx512f")))
    #define FA_INLINE static inline __attribute__((always_inline))
    #define FA_PREFETCH(address) __builtin_prefetch(address)

    /* Whether the environment variable `name` is `word`, ignoring case and
       surrounding white space (as fastattn._cython's check, str.strip().lower()) */
    static int fastattn_env_is(const char *name, const char *word) {
        const char *value = getenv(name);
        size_t n = strlen(word);
        if (value == NULL) return 0;
        while (isspace((unsigned char) *value)) value++;
        if (strncasecmp(value, word, n) != 0) return 0;
        for (value += n; isspace((unsigned char) *value); value++) {}
        return *value == '\\0';
    }
    /* 512 (AVX-512F), 256 (AVX2 and FMA) or 0 (neither: BLAS), capped by
       FASTATTN_SIMD (avx2, off); fastattn._cython reads it in every extension
       as it imports them, so all of them hold the same */
    static int fastattn_microkernel_isa(void) {
        static int cached = -1;    /* a benign race: every thread finds the same */
        if (cached < 0) {
            int isa;
            __builtin_cpu_init();
            if (__builtin_cpu_supports("avx512f")) isa = 512;
            else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = 256;
            else isa = 0;
            if (fastattn_env_is("FASTATTN_SIMD", "avx2") && isa > 256) isa = 256;
            if (fastattn_env_is("FASTATTN_SIMD", "off")) isa = 0;
            cached = isa;
        }
        return cached;
    }
    static int fastattn_microkernel_ok(void) { return fastattn_microkernel_isa() != 0; }

    /* Lane sums of 16 (float) or 8 (double) vectors: lane t of the result is the sum of
       the lanes of x[t].  Lanes are added in pairs within each 128-bit lane (unpack,
       shuffle), then the 128-bit lanes of four such vectors are transposed and added. */
    #define FA_QUARTER_SUMS(X, VT, SHUF, ADD)                                          \
    /* wi holds, in 128-bit lane L, vector i's partial sums of part L; returns, in     \
       128-bit lane i, wi summed over L */                                             \
    FA_AVX512 FA_INLINE VT fa_quarter_sums_##X(VT w0, VT w1, VT w2, VT w3) {         \
        VT y01 = ADD(SHUF(w0, w1, _MM_SHUFFLE(1, 0, 1, 0)), SHUF(w0, w1, _MM_SHUFFLE(3, 2, 3, 2))); \
        VT y23 = ADD(SHUF(w2, w3, _MM_SHUFFLE(1, 0, 1, 0)), SHUF(w2, w3, _MM_SHUFFLE(3, 2, 3, 2))); \
        return ADD(SHUF(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)), SHUF(y01, y23, _MM_SHUFFLE(3, 1, 3, 1))); \
    }
    FA_QUARTER_SUMS(f, __m512, _mm512_shuffle_f32x4, _mm512_add_ps)
    FA_QUARTER_SUMS(d, __m512d, _mm512_shuffle_f64x2, _mm512_add_pd)
    #undef FA_QUARTER_SUMS
    FA_AVX512 FA_INLINE __m512 fa_pair_sums_f(__m512 a, __m512 b) {
        /* per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3] */
        return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    FA_AVX512 FA_INLINE __m512 fa_quad_sums_f(const __m512 *x) {
        /* per 128-bit lane L, [x0, x1, x2, x3], each summed over its lanes in L */
        __m512 ab = fa_pair_sums_f(x[0], x[1]), cd = fa_pair_sums_f(x[2], x[3]);
        return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    FA_AVX512 FA_INLINE __m512 fa_lane_sums_f(const __m512 *x) {
        return fa_quarter_sums_f(fa_quad_sums_f(x), fa_quad_sums_f(x + 4), fa_quad_sums_f(x + 8),
                                 fa_quad_sums_f(x + 12));
    }
    FA_AVX512 FA_INLINE __m512d fa_pair_sums_d(__m512d a, __m512d b) {
        /* per 128-bit lane [a0+a1, b0+b1] */
        return _mm512_add_pd(_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b));
    }
    FA_AVX512 FA_INLINE __m512d fa_lane_sums_d(const __m512d *x) {
        return fa_quarter_sums_d(fa_pair_sums_d(x[0], x[1]), fa_pair_sums_d(x[2], x[3]),
                                 fa_pair_sums_d(x[4], x[5]), fa_pair_sums_d(x[6], x[7]));
    }
    #include "_avx2_pair.h"

    #define FA_ISA 512
    #define FA_DOUBLE 0
    #include "_microkernel_ops.h"
    #undef FA_DOUBLE
    #define FA_DOUBLE 1
    #include "_microkernel_ops.h"
    #undef FA_DOUBLE
    #undef FA_ISA
    #define FA_ISA 256
    #define FA_DOUBLE 0
    #include "_microkernel_ops.h"
    #undef FA_DOUBLE
    #define FA_DOUBLE 1
    #include "_microkernel_ops.h"
    #undef FA_DOUBLE
    #undef FA_ISA

    /* The public functions: each calls its AVX-512 or its AVX2 loops */
    #define FA_PICK(name, X, args) \
        (fastattn_microkernel_isa() == 512 ? name##_##X##512 args : name##_##X##256 args)
    #define FA_DISPATCHERS(T, X)                                                              \
    static inline void fastattn_pack_keys_##X(const T *k, int ldk, int width, int d, T *kp) { \
        FA_PICK(fastattn_pack_keys, X, (k, ldk, width, d, kp));                               \
    }                                                                                         \
    static inline void fastattn_scores_##X(const T *q, int ldq, const T *kp, int rows,       \
                                           int width, int d, T scale, T *s, int lds) {       \
        FA_PICK(fastattn_scores, X, (q, ldq, kp, rows, width, d, scale, s, lds));             \
    }                                                                                         \
    static inline void fastattn_pack_values_##X(const T *v, int ldv, int j0, int width,      \
                                                int d_v, int n_k, T *vp) {                    \
        FA_PICK(fastattn_pack_values, X, (v, ldv, j0, width, d_v, n_k, vp));                  \
    }                                                                                         \
    static inline void fastattn_output_##X(const T *p, int ldp, const T *vp, int n_k, int j0, \
                                           int rows, int width, int d_v, T *o, int ldo) {    \
        FA_PICK(fastattn_output, X, (p, ldp, vp, n_k, j0, rows, width, d_v, o, ldo));         \
    }                                                                                         \
    static inline T fastattn_tile_max_##X(const T *s, int n) {                                \
        return FA_PICK(fastattn_tile_max, X, (s, n));                                         \
    }                                                                                         \
    static inline T fastattn_tile_exp_sum_##X(T *s, int n, T shift) {                              \
        return FA_PICK(fastattn_tile_exp_sum, X, (s, n, shift));                                   \
    }                                                                                         \
    static inline void fastattn_query_scores_##X(const T *q, const T *k, int width, int d_k, \
                                                 T scale, T *s, int ahead) {                  \
        FA_PICK(fastattn_query_scores, X, (q, k, width, d_k, scale, s, ahead));               \
    }                                                                                         \
    static inline void fastattn_query_values_##X(const T *p, const T *v, int width, int d_v, \
                                                 T *acc, int ahead) {                         \
        FA_PICK(fastattn_query_values, X, (p, v, width, d_v, acc, ahead));                    \
    }                                                                                         \
    /* AVX-512 only: its caller checks fastattn_microkernel_isa() == 512 */                 \
    static inline void fastattn_query_attend_##X(const T *q, const T *k, const T *v, int width, \
                                                 int d, T scale, T *m, T *l, T *acc,          \
                                                 int ahead) {                                 \
        fastattn_query_attend_##X##512(q, k, v, width, d, scale, m, l, acc, ahead);           \
    }                                                                                         \
    static inline void fastattn_linear_product_##X(                                           \
            const T *p, long prs, long pjs, const T *v, int ldv, int rows, int width,        \
            const int *seen, int d_v, T *o, int ldo, int accumulate, const T *scale,         \
            const void *ahead, long ahead_bytes) {                                            \
        FA_PICK(fastattn_linear_product, X, (p, prs, pjs, v, ldv, rows, width, seen, d_v, o, \
                                             ldo, accumulate, scale, ahead, ahead_bytes));   \
    }                                                                                         \
    static inline void fastattn_linear_mask_##X(T *a, int lda, int rows, const int *seen,    \
                                                T *den) {                                     \
        FA_PICK(fastattn_linear_mask, X, (a, lda, rows, seen, den));                          \
    }                                                                                         \
    static inline void fastattn_linear_elu_##X(const T *x, long n, T *out, const T *ahead) { \
        FA_PICK(fastattn_linear_elu, X, (x, n, out, ahead));                                  \
    }                                                                                         \
    static inline void fastattn_linear_elu_sums_##X(const T *x, int rows, int d, T *out,     \
                                                    const T *ahead, T *z, int accumulate) {   \
        FA_PICK(fastattn_linear_elu_sums, X, (x, rows, d, out, ahead, z, accumulate));        \
    }
    FA_DISPATCHERS(float, f)
    FA_DISPATCHERS(double, d)
    #undef FA_DISPATCHERS
    #undef FA_PICK
    #else
    #define FASTATTN_MICROKERNEL 0
    static int fastattn_microkernel_isa(void) { return 0; }
    static int fastattn_microkernel_ok(void) { return 0; }
    #define FA_STUBS(T, X) \
        static void fastattn_pack_keys_##X(const T *k, int ldk, int width, int d, T *kp) {} \
        static void fastattn_scores_##X(const T *q, int ldq, const T *kp, int rows, int width, \
                                        int d, T scale, T *s, int lds) {} \
        static void fastattn_pack_values_##X(const T *v, int ldv, int j0, int width, int d_v, \
                                             int n_k, T *vp) {} \
        static void fastattn_output_##X(const T *p, int ldp, const T *vp, int n_k, int j0, \
                                        int rows, int width, int d_v, T *o, int ldo) {} \
        static T fastattn_tile_max_##X(const T *s, int n) { return 0; } \
        static T fastattn_tile_exp_sum_##X(T *s, int n, T shift) { return 0; } \
        static void fastattn_query_scores_##X(const T *q, const T *k, int width, int d_k, \
                                              T scale, T *s, int ahead) {} \
        static void fastattn_query_values_##X(const T *p, const T *v, int width, int d_v, \
                                              T *acc, int ahead) {} \
        static void fastattn_query_attend_##X(const T *q, const T *k, const T *v, int width, \
                                              int d, T scale, T *m, T *l, T *acc, int ahead) {}
    FA_STUBS(float, f)
    FA_STUBS(double, d)
    #endif
    """
    const int FASTATTN_MICROKERNEL
    int fastattn_microkernel_isa() nogil
    int fastattn_microkernel_ok() nogil
    void fastattn_pack_keys_f(const float *k, int ldk, int width, int d, float *kp) nogil
    void fastattn_pack_keys_d(const double *k, int ldk, int width, int d, double *kp) nogil
    void fastattn_scores_f(const float *q, int ldq, const float *kp, int rows, int width, int d,
                           float scale, float *s, int lds) nogil
    void fastattn_scores_d(const double *q, int ldq, const double *kp, int rows, int width, int d,
                           double scale, double *s, int lds) nogil
    void fastattn_pack_values_f(const float *v, int ldv, int j0, int width, int d_v, int n_k,
                                float *vp) nogil
    void fastattn_pack_values_d(const double *v, int ldv, int j0, int width, int d_v, int n_k,
                                double *vp) nogil
    void fastattn_output_f(const float *p, int ldp, const float *vp, int n_k, int j0, int rows,
                           int width, int d_v, float *o, int ldo) nogil
    void fastattn_output_d(const double *p, int ldp, const double *vp, int n_k, int j0, int rows,
                           int width, int d_v, double *o, int ldo) nogil
    float fastattn_tile_max_f(const float *s, int n) nogil
    double fastattn_tile_max_d(const double *s, int n) nogil
    float fastattn_tile_exp_sum_f(float *s, int n, float shift) nogil
    double fastattn_tile_exp_sum_d(double *s, int n, double shift) nogil
    void fastattn_query_scores_f(const float *q, const float *k, int width, int d_k, float scale,
                                 float *s, int ahead) nogil
    void fastattn_query_scores_d(const double *q, const double *k, int width, int d_k,
                                 double scale, double *s, int ahead) nogil
    void fastattn_query_values_f(const float *p, const float *v, int width, int d_v, float *acc,
                                 int ahead) nogil
    void fastattn_query_values_d(const double *p, const double *v, int width, int d_v,
                                 double *acc, int ahead) nogil
    void fastattn_query_attend_f(const float *q, const float *k, const float *v, int width,
                                 int d, float scale, float *m, float *l, float *acc,
                                 int ahead) nogil
    void fastattn_query_attend_d(const double *q, const double *k, const double *v, int width,
                                 int d, double scale, double *m, double *l, double *acc,
                                 int ahead) nogil


cdef inline bint simd_rows(int width, const floating *dtype_tag) noexcept nogil:
    """Whether the register-blocked loops run on rows of ``width`` elements of
    ``floating``: built with them, the CPU has AVX-512F or AVX2 with FMA, and
    ``width`` a multiple of the lanes (16 float32, 8 float64).  ``dtype_tag``:
    any pointer of the element type."""
    cdef int lanes = 16 if floating is float else 8
    return FASTATTN_MICROKERNEL and width % lanes == 0 and fastattn_microkernel_ok()


cdef inline void pack_keys(const floating *k, int ldk, int width, int d, floating *kp) noexcept nogil:
    """``k[0:width]`` in panels of 16 (float32) or 8 (float64) keys for :func:`scores`."""
    if floating is float:
        fastattn_pack_keys_f(k, ldk, width, d, kp)
    else:
        fastattn_pack_keys_d(k, ldk, width, d, kp)


cdef inline void scores(const floating *q, int ldq, const floating *kp, int rows, int width, int d,
                        floating scale, floating *s, int lds) noexcept nogil:
    """``s[r, j] = scale q[r] . k[j]`` for ``r < rows, j < width`` (AVX-512 or AVX2)."""
    if floating is float:
        fastattn_scores_f(q, ldq, kp, rows, width, d, scale, s, lds)
    else:
        fastattn_scores_d(q, ldq, kp, rows, width, d, scale, s, lds)


cdef inline void pack_values(const floating *v, int ldv, int j0, int width, int d_v, int n_k,
                             floating *vp) noexcept nogil:
    """Rows ``j0 + [0, width)`` of a head's ``n_k`` values (``v`` at row ``j0``) into the
    head's panels ``vp`` (``n_k * d_v`` elements) for :func:`output`."""
    if floating is float:
        fastattn_pack_values_f(v, ldv, j0, width, d_v, n_k, vp)
    else:
        fastattn_pack_values_d(v, ldv, j0, width, d_v, n_k, vp)


cdef inline void output(const floating *p, int ldp, const floating *vp, int n_k, int j0,
                        int rows, int width, int d_v, floating *o, int ldo) noexcept nogil:
    """``o[r] += sum_j p[r, j] v[j0 + j]`` for ``r < rows, j < width`` (AVX-512 or AVX2),
    ``vp`` the head's values packed by :func:`pack_values`."""
    if floating is float:
        fastattn_output_f(p, ldp, vp, n_k, j0, rows, width, d_v, o, ldo)
    else:
        fastattn_output_d(p, ldp, vp, n_k, j0, rows, width, d_v, o, ldo)


cdef inline floating max_simd(const floating *s, int n) noexcept nogil:
    """``max(s[0:n])`` (AVX-512 or AVX2), ``-inf`` for ``n == 0``; a NaN is passed over."""
    if floating is float:
        return fastattn_tile_max_f(s, n)
    else:
        return fastattn_tile_max_d(s, n)


cdef inline floating exp_sum_simd(floating *s, int n, floating shift) noexcept nogil:
    """``s[j] = exp(s[j] - shift)`` in place for ``j < n`` (AVX-512 or AVX2); returns ``sum s[j]``."""
    if floating is float:
        return fastattn_tile_exp_sum_f(s, n, shift)
    else:
        return fastattn_tile_exp_sum_d(s, n, shift)


cdef inline void query_scores(const floating *q, const floating *k, int width, int d_k,
                              floating scale, floating *s, int ahead) noexcept nogil:
    """One query: ``s[j] = scale q . k[j]`` for ``j < width`` (AVX-512 or AVX2, ``d_k`` a multiple of
    the lanes); prefetches the key row ``ahead`` rows on (0: none).  Decode steps
    (decode.pyx) take it with AVX-512 only."""
    if floating is float:
        fastattn_query_scores_f(q, k, width, d_k, scale, s, ahead)
    else:
        fastattn_query_scores_d(q, k, width, d_k, scale, s, ahead)


cdef inline void query_values(const floating *p, const floating *v, int width, int d_v,
                              floating *acc, int ahead) noexcept nogil:
    """One query: ``acc += sum_{j < width} p[j] v[j]`` (AVX-512 or AVX2, ``d_v`` a multiple of the
    lanes); prefetches the value row ``ahead`` rows on (0: none).  Decode steps
    take it with AVX-512 only."""
    if floating is float:
        fastattn_query_values_f(p, v, width, d_v, acc, ahead)
    else:
        fastattn_query_values_d(p, v, width, d_v, acc, ahead)


cdef inline void query_attend(const floating *q, const floating *k, const floating *v,
                              int width, int d, floating scale, floating *m, floating *l,
                              floating *acc, int ahead) noexcept nogil:
    """One query over ``width`` keys (a multiple of the lanes) with ``d_k = d_v = d`` of 1 to 16
    vectors (16 to 256 float32, 8 to 128 float64), in one pass with the online softmax in
    registers: the running maximum ``m``, sum ``l`` and unnormalised output ``acc (d)``
    updated 16 (8) keys at a time, a group's key rows read before the value rows of the
    group before it; prefetches ``ahead`` rows on (0: none).  AVX-512 only (its loops are
    not built for AVX2)."""
    if floating is float:
        fastattn_query_attend_f(q, k, v, width, d, scale, m, l, acc, ahead)
    else:
        fastattn_query_attend_d(q, k, v, width, d, scale, m, l, acc, ahead)


cdef inline object products_isa():
    """The instruction set this extension's register-blocked products take:
    ``"avx512"``, ``"avx2"``, or None (BLAS: not built with them, no such CPU,
    or ``FASTATTN_SIMD=off``).  The first call reads ``FASTATTN_SIMD``."""
    return {512: "avx512", 256: "avx2"}.get(fastattn_microkernel_isa()) if FASTATTN_MICROKERNEL else None
