/* A vector of 16 float or 8 double as a pair of AVX2 registers (lo: lanes
 * 0..7 or 0..3, hi: the rest), with the operations _microkernel_ops.h maps
 * FA_V... to on CPUs with AVX2 and FMA but no AVX-512F (AMD Zen 1 to 3,
 * most Intel client cores).  Keeping the AVX-512 vector's width keeps its panels of
 * keys, its scratch and its lane rule.  Masks are pairs too: a lane of all
 * ones is in, of zeros out.  Included by _microkernel.pxd, which defines
 * FA_INLINE.
 */
#define FA_AVX2 __attribute__((target("avx2,fma")))

/* X: f or d; T: float or double; V: __m256 or __m256d; S: ps or pd */
#define FA_PAIR_OPS(X, T, V, S, N)                                                       \
typedef struct { V lo, hi; } fa_pair_t_##X;                                              \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_make_##X(V lo, V hi) {                           \
    fa_pair_t_##X r; r.lo = lo; r.hi = hi; return r;                                     \
}                                                                                        \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_zero_##X(void) {                                 \
    return fa_pair_make_##X(_mm256_setzero_##S(), _mm256_setzero_##S());                 \
}                                                                                        \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_set1_##X(T x) {                                  \
    return fa_pair_make_##X(_mm256_set1_##S(x), _mm256_set1_##S(x));                     \
}                                                                                        \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_load_##X(const T *p) {                           \
    return fa_pair_make_##X(_mm256_loadu_##S(p), _mm256_loadu_##S(p + N));               \
}                                                                                        \
FA_AVX2 FA_INLINE void fa_pair_store_##X(T *p, fa_pair_t_##X x) {                        \
    _mm256_storeu_##S(p, x.lo);                                                          \
    _mm256_storeu_##S(p + N, x.hi);                                                      \
}                                                                                        \
/* lanes of m stored (the others' memory untouched), loaded (others 0) */               \
FA_AVX2 FA_INLINE void fa_pair_mask_store_##X(T *p, fa_pair_t_##X m, fa_pair_t_##X x) {  \
    _mm256_maskstore_##S(p, _mm256_cast##S##_si256(m.lo), x.lo);                        \
    _mm256_maskstore_##S(p + N, _mm256_cast##S##_si256(m.hi), x.hi);                    \
}                                                                                        \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_maskz_load_##X(fa_pair_t_##X m, const T *p) {    \
    return fa_pair_make_##X(_mm256_maskload_##S(p, _mm256_cast##S##_si256(m.lo)),      \
                            _mm256_maskload_##S(p + N, _mm256_cast##S##_si256(m.hi)));  \
}                                                                                        \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_fmadd_##X(fa_pair_t_##X a, fa_pair_t_##X b,      \
                                                  fa_pair_t_##X c) {                     \
    return fa_pair_make_##X(_mm256_fmadd_##S(a.lo, b.lo, c.lo),                         \
                            _mm256_fmadd_##S(a.hi, b.hi, c.hi));                         \
}                                                                                        \
FA_PAIR_BINARY(X, V, S, mul)                                                             \
FA_PAIR_BINARY(X, V, S, sub)                                                             \
FA_PAIR_BINARY(X, V, S, add)                                                             \
/* vminps, vmaxps: the second operand where either is NaN, as _mm512_min, max */      \
FA_PAIR_BINARY(X, V, S, min)                                                             \
FA_PAIR_BINARY(X, V, S, max)                                                             \
/* src where m is out, a + b where it is in */                                          \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_mask_add_##X(fa_pair_t_##X src, fa_pair_t_##X m, \
                                                     fa_pair_t_##X a, fa_pair_t_##X b) { \
    return fa_pair_make_##X(                                                             \
        _mm256_blendv_##S(src.lo, _mm256_add_##S(a.lo, b.lo), m.lo),                     \
        _mm256_blendv_##S(src.hi, _mm256_add_##S(a.hi, b.hi), m.hi));                    \
}                                                                                        \
/* x where m is in, 0 where it is out */                                                \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_maskz_##X(fa_pair_t_##X m, fa_pair_t_##X x) {    \
    return fa_pair_make_##X(_mm256_and_##S(m.lo, x.lo), _mm256_and_##S(m.hi, x.hi));      \
}

#define FA_PAIR_BINARY(X, V, S, op)                                                      \
FA_AVX2 FA_INLINE fa_pair_t_##X fa_pair_##op##_##X(fa_pair_t_##X a, fa_pair_t_##X b) {   \
    return fa_pair_make_##X(_mm256_##op##_##S(a.lo, b.lo), _mm256_##op##_##S(a.hi, b.hi)); \
}

FA_PAIR_OPS(f, float, __m256, ps, 8)
FA_PAIR_OPS(d, double, __m256d, pd, 4)
#undef FA_PAIR_OPS
#undef FA_PAIR_BINARY

/* The lane comparison, a pair of masks ('pred' an immediate, as _CMP_GT_OQ) */
#define fa_pair_cmp_f(a, b, pred) \
    fa_pair_make_f(_mm256_cmp_ps((a).lo, (b).lo, pred), _mm256_cmp_ps((a).hi, (b).hi, pred))
#define fa_pair_cmp_d(a, b, pred) \
    fa_pair_make_d(_mm256_cmp_pd((a).lo, (b).lo, pred), _mm256_cmp_pd((a).hi, (b).hi, pred))

/* The first n lanes, 0 <= n <= 16 (8) */
FA_AVX2 FA_INLINE fa_pair_t_f fa_pair_prefix_f(int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return fa_pair_make_f(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane)),
                          _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane)));
}
FA_AVX2 FA_INLINE fa_pair_t_d fa_pair_prefix_d(int n) {
    const __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
    return fa_pair_make_d(_mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(n), lane)),
                          _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(n - 4), lane)));
}

/* 2**t = 2**f 2**e, e = round(t), f = t - e, for -127 <= t < 128 (-1023 <= t < 1024):
 * split returns y = t + M, M = 1.5 2**23 + 127 (1.5 2**52 + 1023), whose low mantissa bits
 * are then e + 127 (e + 1023), and writes f = t - (y - M), exact; scale returns p 2**e with
 * 2**e those bits shifted into the exponent field (e = -127 (-1023): 0, as 2**t is 0 at
 * the floor the callers raise t to, or mask below).  Three integer and float operations
 * in place of round, convert, clamp, add and shift (the exps of _microkernel_t.h and
 * _linear_t.h; vscalef with AVX-512).  A NaN t gives a NaN f, so p and the result are NaN. */
FA_AVX2 FA_INLINE fa_pair_t_f fa_pair_exp2_split_f(fa_pair_t_f t, fa_pair_t_f *f) {
    const __m256 m = _mm256_set1_ps(12582912.0f + 127.0f);
    __m256 lo = _mm256_add_ps(t.lo, m), hi = _mm256_add_ps(t.hi, m);
    *f = fa_pair_make_f(_mm256_sub_ps(t.lo, _mm256_sub_ps(lo, m)),
                        _mm256_sub_ps(t.hi, _mm256_sub_ps(hi, m)));
    return fa_pair_make_f(lo, hi);
}
FA_AVX2 FA_INLINE __m256 fa_exp2_bits_f(__m256 y) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(y), 23));
}
FA_AVX2 FA_INLINE fa_pair_t_f fa_pair_exp2_scale_f(fa_pair_t_f p, fa_pair_t_f y) {
    return fa_pair_make_f(_mm256_mul_ps(p.lo, fa_exp2_bits_f(y.lo)),
                          _mm256_mul_ps(p.hi, fa_exp2_bits_f(y.hi)));
}
FA_AVX2 FA_INLINE fa_pair_t_d fa_pair_exp2_split_d(fa_pair_t_d t, fa_pair_t_d *f) {
    const __m256d m = _mm256_set1_pd(6755399441055744.0 + 1023.0);
    __m256d lo = _mm256_add_pd(t.lo, m), hi = _mm256_add_pd(t.hi, m);
    *f = fa_pair_make_d(_mm256_sub_pd(t.lo, _mm256_sub_pd(lo, m)),
                        _mm256_sub_pd(t.hi, _mm256_sub_pd(hi, m)));
    return fa_pair_make_d(lo, hi);
}
FA_AVX2 FA_INLINE __m256d fa_exp2_bits_d(__m256d y) {
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(y), 52));
}
FA_AVX2 FA_INLINE fa_pair_t_d fa_pair_exp2_scale_d(fa_pair_t_d p, fa_pair_t_d y) {
    return fa_pair_make_d(_mm256_mul_pd(p.lo, fa_exp2_bits_d(y.lo)),
                          _mm256_mul_pd(p.hi, fa_exp2_bits_d(y.hi)));
}

/* fa_pair_reduce_add_X: the sum of all lanes; fa_pair_reduce_max_X: the largest (no lane
 * NaN: vmaxps gives the second operand where either is) */
#define FA_PAIR_REDUCE(op)                                                                \
FA_AVX2 FA_INLINE float fa_pair_reduce_##op##_f(fa_pair_t_f x) {                          \
    __m256 v = _mm256_##op##_ps(x.lo, x.hi);                                              \
    __m128 s = _mm_##op##_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));     \
    s = _mm_##op##_ps(s, _mm_movehl_ps(s, s));                                            \
    s = _mm_##op##_ss(s, _mm_movehdup_ps(s));                                             \
    return _mm_cvtss_f32(s);                                                              \
}                                                                                         \
FA_AVX2 FA_INLINE double fa_pair_reduce_##op##_d(fa_pair_t_d x) {                         \
    __m256d v = _mm256_##op##_pd(x.lo, x.hi);                                             \
    __m128d s = _mm_##op##_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));   \
    return _mm_cvtsd_f64(_mm_##op##_sd(s, _mm_unpackhi_pd(s, s)));                        \
}
FA_PAIR_REDUCE(add)
FA_PAIR_REDUCE(max)
#undef FA_PAIR_REDUCE

/* Lane sums of 16 (8) pairs: lane t of the result is the sum of the lanes of
 * x[t].  Each pair's halves are added, then the 8 (4) registers a half are
 * summed across their lanes by horizontal adds and one swap of 128-bit lanes. */
FA_AVX2 FA_INLINE __m256 fa_sums8_f(const fa_pair_t_f *x) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_add_ps(x[t].lo, x[t].hi);
    __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
FA_AVX2 FA_INLINE fa_pair_t_f fa_pair_lane_sums_f(const fa_pair_t_f *x) {
    return fa_pair_make_f(fa_sums8_f(x), fa_sums8_f(x + 8));
}
FA_AVX2 FA_INLINE __m256d fa_sums4_d(const fa_pair_t_d *x) {
    __m256d a[4];
    for (int t = 0; t < 4; t++) a[t] = _mm256_add_pd(x[t].lo, x[t].hi);
    __m256d h01 = _mm256_hadd_pd(a[0], a[1]), h23 = _mm256_hadd_pd(a[2], a[3]);
    return _mm256_add_pd(_mm256_permute2f128_pd(h01, h23, 0x20), _mm256_permute2f128_pd(h01, h23, 0x31));
}
FA_AVX2 FA_INLINE fa_pair_t_d fa_pair_lane_sums_d(const fa_pair_t_d *x) {
    return fa_pair_make_d(fa_sums4_d(x), fa_sums4_d(x + 4));
}
