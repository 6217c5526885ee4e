from cython cimport floating

# AVX-512 register-blocked products of the online softmax tile (float32 and float64).
#
# OpenBLAS's sgemm packs both operands of every call and zero-fills C when
# beta = 0; measured side by side here (1 thread, CPU time, loaded machine)
# its tile GEMMs alone (256 x 256 x 64) took about as long as onnxruntime's
# whole attention, so around them the tile could not reach the peers.  These
# two products need no packing of q, of p or of v (only k is transposed into
# panels of 16 keys, once per key block) and write the scores straight into
# the tile:
#
# * scores  s[r, j] = scale * sum_c q[r, c] k[j, c]: 6 rows x 4 panels of
#   keys of accumulators (24 zmm), one broadcast of q per row and one load
#   per panel;
# * output  o[r, :] += sum_j p[r, j] v[j, :]: 6 rows x 4 vectors of columns
#   of o in registers over all the tile's keys, v read in rows as it lies;
# * exp_sum  the row's exp(s - shift) and its sum, by a polynomial for 2**f
#   and vscalef for 2**n.
#
# The C is written once, in _microkernel_t.h, for one element type and
# included once for float (16 lanes, panels of 16 keys) and once for double
# (8 lanes, panels of 8).  Compiled for AVX-512F only (function target
# attribute), used when the CPU has it (checked once) and d_k and d_v are
# multiples of the lane count; otherwise the tile calls BLAS as before.  Sums
# run in the order of c (of j), one FMA at a time, in the input's precision
# like BLAS.
cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) \
        && !defined(FASTATTN_NO_MICROKERNEL)
    #include <immintrin.h>
    #define FASTATTN_MICROKERNEL 1
    #define FA_AVX512 __attribute__((target("avx512f")))
    #define FA_INLINE static inline __attribute__((always_inline))
    #define FA_PREFETCH(address) __builtin_prefetch(address)

    static int fastattn_microkernel_ok(void) {
        static int cached = -1;    /* a benign race: every thread finds the same */
        if (cached < 0) {
            __builtin_cpu_init();
            cached = __builtin_cpu_supports("avx512f") ? 1 : 0;
        }
        return cached;
    }

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

    #define FA_T float
    #define FA_L 16
    #define FA_NAME(x) x##_f
    #define FA_VT __m512
    #define FA_MT __mmask16
    #define FA_VZERO _mm512_setzero_ps
    #define FA_VSET1 _mm512_set1_ps
    #define FA_VLOAD _mm512_loadu_ps
    #define FA_VSTORE _mm512_storeu_ps
    #define FA_VMSTORE _mm512_mask_storeu_ps
    #define FA_VMLOADZ _mm512_maskz_loadu_ps
    #define FA_VFMADD _mm512_fmadd_ps
    #define FA_VMUL _mm512_mul_ps
    #define FA_VSUB _mm512_sub_ps
    #define FA_VADD _mm512_add_ps
    #define FA_LANE_SUMS fa_lane_sums_f
    #define FA_VMADD _mm512_mask_add_ps
    #define FA_VSCALEF _mm512_scalef_ps
    #define FA_VREDUCE_ADD _mm512_reduce_add_ps
    #define FA_VROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    /* 2**f, |f| <= 1/2: Cephes' exp2f polynomial, about 2e-7 relative */
    #define FA_EXP2_POLY(p, f) do { \
        p = _mm512_set1_ps(1.535336188319500e-4f); \
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f)); \
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f)); \
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f)); \
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f)); \
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f)); \
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f)); \
    } while (0)
    #include "_microkernel_t.h"
    #undef FA_T
    #undef FA_L
    #undef FA_NAME
    #undef FA_VT
    #undef FA_MT
    #undef FA_VZERO
    #undef FA_VSET1
    #undef FA_VLOAD
    #undef FA_VSTORE
    #undef FA_VMSTORE
    #undef FA_VMLOADZ
    #undef FA_VFMADD
    #undef FA_VMUL
    #undef FA_VSUB
    #undef FA_VADD
    #undef FA_LANE_SUMS
    #undef FA_VMADD
    #undef FA_VSCALEF
    #undef FA_VREDUCE_ADD
    #undef FA_VROUND
    #undef FA_EXP2_POLY

    #define FA_T double
    #define FA_L 8
    #define FA_NAME(x) x##_d
    #define FA_VT __m512d
    #define FA_MT __mmask8
    #define FA_VZERO _mm512_setzero_pd
    #define FA_VSET1 _mm512_set1_pd
    #define FA_VLOAD _mm512_loadu_pd
    #define FA_VSTORE _mm512_storeu_pd
    #define FA_VMSTORE _mm512_mask_storeu_pd
    #define FA_VMLOADZ _mm512_maskz_loadu_pd
    #define FA_VFMADD _mm512_fmadd_pd
    #define FA_VMUL _mm512_mul_pd
    #define FA_VSUB _mm512_sub_pd
    #define FA_VADD _mm512_add_pd
    #define FA_LANE_SUMS fa_lane_sums_d
    #define FA_VMADD _mm512_mask_add_pd
    #define FA_VSCALEF _mm512_scalef_pd
    #define FA_VREDUCE_ADD _mm512_reduce_add_pd
    #define FA_VROUND(x) _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    /* 2**f = exp(r), r = f ln 2, |r| <= 0.347: Taylor degree 13, below 1e-16 relative */
    #define FA_EXP2_POLY(p, f) do { \
        __m512d r_ = _mm512_mul_pd(f, _mm512_set1_pd(0.6931471805599453)); \
        p = _mm512_set1_pd(1.0 / 6227020800.0); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 479001600.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 39916800.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 3628800.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 362880.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 40320.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 5040.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 720.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 120.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 24.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(1.0 / 6.0)); \
        p = _mm512_fmadd_pd(p, r_, _mm512_set1_pd(0.5)); \
        p = _mm512_fmadd_pd(p, _mm512_mul_pd(r_, r_), _mm512_add_pd(r_, _mm512_set1_pd(1.0))); \
    } while (0)
    #include "_microkernel_t.h"
    #else
    #define FASTATTN_MICROKERNEL 0
    static int fastattn_microkernel_ok(void) { return 0; }
    #define FA_STUBS(T, X) \
        static void fastattn_pack_keys_##X(const T *k, int ldk, int width, int d, T *kp) {} \
        static void fastattn_scores_##X(const T *q, int ldq, const T *kp, int rows, int width, \
                                        int d, T scale, T *s, int lds) {} \
        static void fastattn_output_##X(const T *p, int ldp, const T *v, int ldv, int rows, \
                                        int width, int d_v, T *o, int ldo) {} \
        static T fastattn_exp_sum_avx512_##X(T *s, int n, T shift) { return 0; } \
        static void fastattn_query_scores_##X(const T *q, const T *k, int width, int d_k, \
                                              T scale, T *s, int ahead) {} \
        static void fastattn_query_values_##X(const T *p, const T *v, int width, int d_v, \
                                              T *acc, int ahead) {}
    FA_STUBS(float, f)
    FA_STUBS(double, d)
    #endif
    """
    const int FASTATTN_MICROKERNEL
    int fastattn_microkernel_ok() nogil
    void fastattn_pack_keys_f(const float *k, int ldk, int width, int d, float *kp) nogil
    void fastattn_pack_keys_d(const double *k, int ldk, int width, int d, double *kp) nogil
    void fastattn_scores_f(const float *q, int ldq, const float *kp, int rows, int width, int d,
                           float scale, float *s, int lds) nogil
    void fastattn_scores_d(const double *q, int ldq, const double *kp, int rows, int width, int d,
                           double scale, double *s, int lds) nogil
    void fastattn_output_f(const float *p, int ldp, const float *v, int ldv, int rows, int width,
                           int d_v, float *o, int ldo) nogil
    void fastattn_output_d(const double *p, int ldp, const double *v, int ldv, int rows, int width,
                           int d_v, double *o, int ldo) nogil
    float fastattn_exp_sum_avx512_f(float *s, int n, float shift) nogil
    double fastattn_exp_sum_avx512_d(double *s, int n, double shift) nogil
    void fastattn_query_scores_f(const float *q, const float *k, int width, int d_k, float scale,
                                 float *s, int ahead) nogil
    void fastattn_query_scores_d(const double *q, const double *k, int width, int d_k,
                                 double scale, double *s, int ahead) nogil
    void fastattn_query_values_f(const float *p, const float *v, int width, int d_v, float *acc,
                                 int ahead) nogil
    void fastattn_query_values_d(const double *p, const double *v, int width, int d_v,
                                 double *acc, int ahead) nogil


cdef inline bint avx512_rows(int width, const floating *dtype_tag) noexcept nogil:
    """Whether the AVX-512 loops run on rows of ``width`` elements of ``floating``:
    built with them, the CPU has AVX-512F, and ``width`` a multiple of the lanes
    (16 float32, 8 float64).  ``dtype_tag``: any pointer of the element type."""
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
    """``s[r, j] = scale q[r] . k[j]`` for ``r < rows, j < width`` (AVX-512)."""
    if floating is float:
        fastattn_scores_f(q, ldq, kp, rows, width, d, scale, s, lds)
    else:
        fastattn_scores_d(q, ldq, kp, rows, width, d, scale, s, lds)


cdef inline void output(const floating *p, int ldp, const floating *v, int ldv, int rows,
                        int width, int d_v, floating *o, int ldo) noexcept nogil:
    """``o[r] += sum_j p[r, j] v[j]`` for ``r < rows, j < width`` (AVX-512)."""
    if floating is float:
        fastattn_output_f(p, ldp, v, ldv, rows, width, d_v, o, ldo)
    else:
        fastattn_output_d(p, ldp, v, ldv, rows, width, d_v, o, ldo)


cdef inline floating exp_sum_avx512(floating *s, int n, floating shift) noexcept nogil:
    """``s[j] = exp(s[j] - shift)`` in place for ``j < n`` (AVX-512); returns ``sum s[j]``."""
    if floating is float:
        return fastattn_exp_sum_avx512_f(s, n, shift)
    else:
        return fastattn_exp_sum_avx512_d(s, n, shift)


cdef inline void query_scores(const floating *q, const floating *k, int width, int d_k,
                              floating scale, floating *s, int ahead) noexcept nogil:
    """One query: ``s[j] = scale q . k[j]`` for ``j < width`` (AVX-512, ``d_k`` a multiple of
    the lanes); prefetches the key row ``ahead`` rows on (0: none)."""
    if floating is float:
        fastattn_query_scores_f(q, k, width, d_k, scale, s, ahead)
    else:
        fastattn_query_scores_d(q, k, width, d_k, scale, s, ahead)


cdef inline void query_values(const floating *p, const floating *v, int width, int d_v,
                              floating *acc, int ahead) noexcept nogil:
    """One query: ``acc += sum_{j < width} p[j] v[j]`` (AVX-512, ``d_v`` a multiple of the
    lanes); prefetches the value row ``ahead`` rows on (0: none)."""
    if floating is float:
        fastattn_query_values_f(p, v, width, d_v, acc, ahead)
    else:
        fastattn_query_values_d(p, v, width, d_v, acc, ahead)
