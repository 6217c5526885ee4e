# AVX-512 register-blocked products of the float32 online softmax tile.
#
# OpenBLAS's sgemm packs both operands of every call, zero-fills C when
# beta = 0 and runs at about 117 GFLOP/s on these tile shapes (256 x 256 x
# 64), so around it the tile could not reach the peers' fused kernels.  These
# two products need no packing of q, of p or of v (only k is transposed into
# panels of 16 keys, once per key block) and write the scores straight into
# the tile:
#
# * scores  s[r, j] = scale * sum_c q[r, c] k[j, c]: 6 rows x 64 keys of
#   accumulators (24 zmm), one broadcast of q per row and one load per panel;
# * output  o[r, :] += sum_j p[r, j] v[j, :]: 6 rows x 64 columns of o in
#   registers, v read in rows as it lies, blocks of 64 keys so a block of v
#   stays in L1.
#
# Compiled for AVX-512F only (function target attribute), used when the CPU
# has it (checked once) and d_k and d_v are multiples of 16; otherwise the
# tile calls BLAS as before.  Sums run in the order of c (of j), one FMA at a
# time, in float32 like sgemm.
cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) \
        && !defined(FASTATTN_NO_MICROKERNEL)
    #include <immintrin.h>
    #define FASTATTN_MICROKERNEL 1
    #define FA_AVX512 __attribute__((target("avx512f")))
    #define FA_INLINE static inline __attribute__((always_inline))
    #ifndef FA_PV_KEYS
    #define FA_PV_KEYS 256
    #endif

    static int fastattn_microkernel_ok(void) {
        static int cached = -1;    /* a benign race: every thread finds the same */
        if (cached < 0) {
            __builtin_cpu_init();
            cached = __builtin_cpu_supports("avx512f") ? 1 : 0;
        }
        return cached;
    }

    /* kp[(p d + c) 16 + t] = k[(16 p + t) ldk + c]: keys [0, width) in panels of 16, zero past width */
    static void fastattn_pack_keys_f(const float *k, int ldk, int width, int d, float *kp) {
        int panels = (width + 15) / 16;
        for (int p = 0; p < panels; p++) {
            for (int t = 0; t < 16; t++) {
                int j = 16 * p + t;
                float *dst = kp + (size_t) p * d * 16 + t;
                if (j < width) {
                    const float *src = k + (size_t) j * ldk;
                    for (int c = 0; c < d; c++) dst[(size_t) c * 16] = src[c];
                } else {
                    for (int c = 0; c < d; c++) dst[(size_t) c * 16] = 0.0f;
                }
            }
        }
    }

    /* R rows x NP panels of scores; 'left' keys remain from this panel group's first */
    FA_AVX512 FA_INLINE void fa_scores_block(const float *q, int ldq, const float *kp, int d,
                                             __m512 scale, float *s, int lds, int left,
                                             const int R, const int NP) {
        __m512 acc[6][4];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();
        for (int c = 0; c < d; c++) {
            __m512 kv[4];
            for (int p = 0; p < NP; p++) kv[p] = _mm512_loadu_ps(kp + ((size_t) p * d + c) * 16);
            for (int r = 0; r < R; r++) {
                __m512 qb = _mm512_set1_ps(q[(size_t) r * ldq + c]);
                for (int p = 0; p < NP; p++) acc[r][p] = _mm512_fmadd_ps(qb, kv[p], acc[r][p]);
            }
        }
        for (int r = 0; r < R; r++) {
            for (int p = 0; p < NP; p++) {
                int rest = left - 16 * p;
                __m512 x = _mm512_mul_ps(acc[r][p], scale);
                float *dst = s + (size_t) r * lds + 16 * p;
                if (rest >= 16) _mm512_storeu_ps(dst, x);
                else _mm512_mask_storeu_ps(dst, (__mmask16) ((1u << rest) - 1u), x);
            }
        }
    }

    #define FA_SCORES_R(NP) \\
        switch (R) { \\
        case 6: fa_scores_block(q, ldq, kp, d, sc, s, lds, left, 6, NP); break; \\
        case 5: fa_scores_block(q, ldq, kp, d, sc, s, lds, left, 5, NP); break; \\
        case 4: fa_scores_block(q, ldq, kp, d, sc, s, lds, left, 4, NP); break; \\
        case 3: fa_scores_block(q, ldq, kp, d, sc, s, lds, left, 3, NP); break; \\
        case 2: fa_scores_block(q, ldq, kp, d, sc, s, lds, left, 2, NP); break; \\
        default: fa_scores_block(q, ldq, kp, d, sc, s, lds, left, 1, NP); break; \\
        }

    /* s[r, j] = scale q[r, :] . k[j, :] for r < rows, j < width (kp from fastattn_pack_keys_f) */
    FA_AVX512 static void fastattn_scores_f(const float *q0, int ldq, const float *kp0, int rows,
                                            int width, int d, float scale, float *s0, int lds) {
        __m512 sc = _mm512_set1_ps(scale);
        for (int j = 0; j < width; j += 64) {
            int left = width - j;
            int np = (left + 15) / 16;
            const float *kp = kp0 + (size_t) (j / 16) * d * 16;
            for (int r0 = 0; r0 < rows; r0 += 6) {
                int R = rows - r0 < 6 ? rows - r0 : 6;
                const float *q = q0 + (size_t) r0 * ldq;
                float *s = s0 + (size_t) r0 * lds + j;
                if (np >= 4) { FA_SCORES_R(4) }
                else if (np == 3) { FA_SCORES_R(3) }
                else if (np == 2) { FA_SCORES_R(2) }
                else { FA_SCORES_R(1) }
            }
        }
    }

    /* R rows x NC column vectors of o += p v over keys [0, width) */
    FA_AVX512 FA_INLINE void fa_output_block(const float *p, int ldp, const float *v, int ldv,
                                             int width, float *o, int ldo, const int R, const int NC) {
        __m512 acc[6][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_loadu_ps(o + (size_t) r * ldo + 16 * c);
        for (int j = 0; j < width; j++) {
            __m512 vv[4];
            for (int c = 0; c < NC; c++) vv[c] = _mm512_loadu_ps(v + (size_t) j * ldv + 16 * c);
            for (int r = 0; r < R; r++) {
                __m512 pb = _mm512_set1_ps(p[(size_t) r * ldp + j]);
                for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(pb, vv[c], acc[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + (size_t) r * ldo + 16 * c, acc[r][c]);
    }

    #define FA_OUTPUT_R(NC) \\
        switch (R) { \\
        case 6: fa_output_block(p, ldp, v, ldv, w, o, ldo, 6, NC); break; \\
        case 5: fa_output_block(p, ldp, v, ldv, w, o, ldo, 5, NC); break; \\
        case 4: fa_output_block(p, ldp, v, ldv, w, o, ldo, 4, NC); break; \\
        case 3: fa_output_block(p, ldp, v, ldv, w, o, ldo, 3, NC); break; \\
        case 2: fa_output_block(p, ldp, v, ldv, w, o, ldo, 2, NC); break; \\
        default: fa_output_block(p, ldp, v, ldv, w, o, ldo, 1, NC); break; \\
        }

    /* o[r, :d_v] += sum_{j < width} p[r, j] v[j, :d_v] for r < rows (d_v a multiple of 16) */
    FA_AVX512 static void fastattn_output_f(const float *p0, int ldp, const float *v0, int ldv,
                                            int rows, int width, int d_v, float *o0, int ldo) {
        for (int j = 0; j < width; j += FA_PV_KEYS) {
            int w = width - j < FA_PV_KEYS ? width - j : FA_PV_KEYS;
            for (int c0 = 0; c0 < d_v; c0 += 64) {
                int nc = (d_v - c0) / 16 < 4 ? (d_v - c0) / 16 : 4;
                const float *v = v0 + (size_t) j * ldv + c0;
                for (int r0 = 0; r0 < rows; r0 += 6) {
                    int R = rows - r0 < 6 ? rows - r0 : 6;
                    const float *p = p0 + (size_t) r0 * ldp + j;
                    float *o = o0 + (size_t) r0 * ldo + c0;
                    if (nc == 4) { FA_OUTPUT_R(4) }
                    else if (nc == 3) { FA_OUTPUT_R(3) }
                    else if (nc == 2) { FA_OUTPUT_R(2) }
                    else { FA_OUTPUT_R(1) }
                }
            }
        }
    }
    /* s[j] = exp(s[j] - shift) in place for j < n, s[j] <= shift; returns the sum.
       exp(x) = 2**t, t = x log2(e) = n + f: 2**f by Cephes' exp2f polynomial
       (about 2e-7 relative), then vscalefps multiplies by 2**n, which also
       gives 0 for t = -inf or far below the float32 range and keeps NaN, so
       no clamp and no select are needed. */
    FA_AVX512 static float fastattn_exp_sum_avx512_f(float *s, int n, float shift) {
        const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), sh = _mm512_set1_ps(shift);
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 16) {
            __mmask16 k = n - j >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << (n - j)) - 1u);
            __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), sh), log2e);
            __m512 e = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512 f = _mm512_sub_ps(t, e);
            __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
            p = _mm512_scalef_ps(p, e);
            _mm512_mask_storeu_ps(s + j, k, p);
            total = _mm512_mask_add_ps(total, k, total, p);
        }
        return _mm512_reduce_add_ps(total);
    }
    #else
    #define FASTATTN_MICROKERNEL 0
    static float fastattn_exp_sum_avx512_f(float *s, int n, float shift) { return 0; }
    static int fastattn_microkernel_ok(void) { return 0; }
    static void fastattn_pack_keys_f(const float *k, int ldk, int width, int d, float *kp) {}
    static void fastattn_scores_f(const float *q0, int ldq, const float *kp0, int rows,
                                  int width, int d, float scale, float *s0, int lds) {}
    static void fastattn_output_f(const float *p0, int ldp, const float *v0, int ldv,
                                  int rows, int width, int d_v, float *o0, int ldo) {}
    #endif
    """
    const int FASTATTN_MICROKERNEL
    int fastattn_microkernel_ok() nogil
    void fastattn_pack_keys_f(const float *k, int ldk, int width, int d, float *kp) nogil
    void fastattn_scores_f(const float *q, int ldq, const float *kp, int rows, int width, int d,
                           float scale, float *s, int lds) nogil
    void fastattn_output_f(const float *p, int ldp, const float *v, int ldv, int rows, int width,
                           int d_v, float *o, int ldo) nogil
    float fastattn_exp_sum_avx512_f(float *s, int n, float shift) nogil
