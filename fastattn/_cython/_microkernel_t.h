/* The products of the online-softmax tile, written once for one instruction
 * set and element type and included by _microkernel_ops.h once per pair, with
 * FA_T (float or double), FA_L (lanes: 16 or 8), FA_NAME(x) (x_f512, x_d256,
 * ...), FA_BLOCK_V and FA_QUERY_V (vectors of a row a block holds) defined,
 * and the vector operations FA_V... mapped to that pair's intrinsics.  See
 * _microkernel.pxd for what each function does and why.
 */

/* dst[c lddst + t] = src[t ld + c] for t, c < L: one L x L tile transposed in
 * registers (unpack, then in-lane and 128-bit-lane shuffles: 64 shuffles a
 * 16 x 16 float32 tile, 24 an 8 x 8 float64 one), in place of L gathers of one
 * column each (pack_keys went from 6.0 to 4.7 % of a causal linear call, 1 thread,
 * n = 4096). */
FA_TARGET FA_INLINE void FA_NAME(fa_transpose_tile)(const FA_T *src, long ld, FA_T *dst,
                                                    long lddst) {
#if FA_ISA == 512
    FA_VT r[FA_L], t[FA_L];
    for (int i = 0; i < FA_L; i++) r[i] = FA_VLOAD(src + i * ld);
#if FA_L == 16
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
    for (int i = 0; i < 16; i++) FA_VSTORE(dst + i * lddst, r[i]);
#else
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_pd(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_pd(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 8; g += 4)
        for (int i = g; i < g + 2; i++) {
            r[i] = _mm512_shuffle_f64x2(t[i], t[i + 2], 0x88);
            r[i + 2] = _mm512_shuffle_f64x2(t[i], t[i + 2], 0xDD);
        }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f64x2(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f64x2(r[i], r[i + 4], 0xDD);
    }
    for (int i = 0; i < 8; i++) FA_VSTORE(dst + i * lddst, t[i]);
#endif
#elif !FA_DOUBLE
    /* four 8 x 8 tiles of ymm: unpack, shuffle within 128-bit lanes, swap them */
    for (int rb = 0; rb < 16; rb += 8)
        for (int cb = 0; cb < 16; cb += 8) {
            __m256 r[8], t[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (rb + i) * ld + cb);
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
            }
            for (int c = 0; c < 4; c++) {
                _mm256_storeu_ps(dst + (cb + c) * lddst + rb, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
                _mm256_storeu_ps(dst + (cb + c + 4) * lddst + rb, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
            }
        }
#else
    /* four 4 x 4 tiles of ymm */
    for (int rb = 0; rb < 8; rb += 4)
        for (int cb = 0; cb < 8; cb += 4) {
            __m256d r[4], t[4];
            for (int i = 0; i < 4; i++) r[i] = _mm256_loadu_pd(src + (rb + i) * ld + cb);
            t[0] = _mm256_unpacklo_pd(r[0], r[1]);
            t[1] = _mm256_unpackhi_pd(r[0], r[1]);
            t[2] = _mm256_unpacklo_pd(r[2], r[3]);
            t[3] = _mm256_unpackhi_pd(r[2], r[3]);
            for (int c = 0; c < 2; c++) {
                _mm256_storeu_pd(dst + (cb + c) * lddst + rb, _mm256_permute2f128_pd(t[c], t[c + 2], 0x20));
                _mm256_storeu_pd(dst + (cb + c + 2) * lddst + rb, _mm256_permute2f128_pd(t[c], t[c + 2], 0x31));
            }
        }
#endif
}

#if FA_ISA != 512
/* the column src[t ldk], t < L, as a vector (AVX2: element by element) */
FA_TARGET FA_INLINE FA_VT FA_NAME(fa_gather_column)(const FA_T *src, int ldk) {
    FA_T column[FA_L];
    for (int t = 0; t < FA_L; t++) column[t] = src[(size_t) t * ldk];
    return FA_VLOAD(column);
}
#endif

/* kp[(p d + c) L + t] = k[(L p + t) ldk + c]: keys [0, width) in panels of L, zero past width.
 * A whole panel's columns are L x L tiles transposed in registers, the last d % L
 * columns one gather each (L keys ldk apart); the last, partial panel is copied
 * element by element. */
FA_TARGET static void FA_NAME(fastattn_pack_keys)(const FA_T *k, int ldk, int width, int d, FA_T *kp) {
    int panels = (width + FA_L - 1) / FA_L, full = width / FA_L, tiles = d / FA_L * FA_L;
#if FA_ISA != 512
#define FA_GATHER_COLUMN(src) FA_NAME(fa_gather_column)(src, ldk)
#elif FA_L == 16
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(ldk));
#define FA_GATHER_COLUMN(src) _mm512_i32gather_ps(rows, src, sizeof(FA_T))
#else
    const __m256i rows = _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm256_set1_epi32(ldk));
#define FA_GATHER_COLUMN(src) _mm512_i32gather_pd(rows, src, sizeof(FA_T))
#endif
    for (int p = 0; p < full; p++) {
        const FA_T *src = k + (size_t) p * FA_L * ldk;
        FA_T *dst = kp + (size_t) p * d * FA_L;
        for (int c = 0; c < tiles; c += FA_L)
            FA_NAME(fa_transpose_tile)(src + c, ldk, dst + (size_t) c * FA_L, FA_L);
        for (int c = tiles; c < d; c++) FA_VSTORE(dst + (size_t) c * FA_L, FA_GATHER_COLUMN(src + c));
    }
#undef FA_GATHER_COLUMN
    for (int p = full; p < panels; p++) {
        for (int t = 0; t < FA_L; t++) {
            int j = FA_L * p + t;
            FA_T *dst = kp + (size_t) p * d * FA_L + t;
            if (j < width) {
                const FA_T *src = k + (size_t) j * ldk;
                for (int c = 0; c < d; c++) dst[(size_t) c * FA_L] = src[c];
            } else {
                for (int c = 0; c < d; c++) dst[(size_t) c * FA_L] = 0;
            }
        }
    }
}

/* One query (a decode step): s[j] = scale q . k_j for j < width, k rows of d_k as
 * they lie.  Each key's d_k/L products go into one vector; FA_L such vectors
 * become one vector of FA_L scores by FA_LANE_SUMS (a transpose-and-add tree,
 * about 3 shuffles and adds a key, in place of a reduction across lanes per
 * key).  Keys past width are never read.  `ahead`: rows ahead to prefetch
 * (K streams from memory), 0 for none. */
FA_TARGET FA_INLINE FA_VT FA_NAME(fa_key_dot)(const FA_T *q, const FA_T *kr, int d_k) {
    FA_VT a = FA_VMUL(FA_VLOAD(q), FA_VLOAD(kr));
    for (int c = FA_L; c < d_k; c += FA_L) a = FA_VFMADD(FA_VLOAD(q + c), FA_VLOAD(kr + c), a);
    return a;
}

FA_TARGET static void FA_NAME(fastattn_query_scores)(const FA_T *q, const FA_T *k, int width,
                                                     int d_k, FA_T scale, FA_T *s, int ahead) {
    const FA_VT sc = FA_VSET1(scale);
    const size_t row_bytes = (size_t) d_k * sizeof(FA_T);
    int j0 = 0;
    if (d_k == 4 * FA_L && !ahead) {
        /* Whole groups of FA_L keys at d_k = 4 vectors: q in four registers, each key a
         * chain of four products, no branch per key.  The rows are read one after the
         * other (not unrolled): unrolled, GCC interleaves the 16 rows' loads, which halved
         * the rate from memory (Zen 4, H = 8, n_k = 65536, one thread: 14.6 against 29.8
         * GB/s); in this order the step went from 51.7 to 56.7-60.7 GB/s in cache
         * (n_k = 4096) and kept the floor out of it. */
        const FA_VT q0 = FA_VLOAD(q), q1 = FA_VLOAD(q + FA_L), q2 = FA_VLOAD(q + 2 * FA_L),
                    q3 = FA_VLOAD(q + 3 * FA_L);
        for (; j0 + FA_L <= width; j0 += FA_L) {
            FA_VT part[FA_L];
            const FA_T *kr = k + (size_t) j0 * d_k;
            _Pragma("GCC unroll 1")
            for (int t = 0; t < FA_L; t++, kr += 4 * FA_L)
                part[t] = FA_VFMADD(q3, FA_VLOAD(kr + 3 * FA_L),
                          FA_VFMADD(q2, FA_VLOAD(kr + 2 * FA_L),
                          FA_VFMADD(q1, FA_VLOAD(kr + FA_L), FA_VMUL(q0, FA_VLOAD(kr)))));
            FA_VSTORE(s + j0, FA_VMUL(FA_LANE_SUMS(part), sc));
        }
    }
    for (; j0 < width; j0 += FA_L) {
        int keys = width - j0 < FA_L ? width - j0 : FA_L;
        FA_VT part[FA_L];
        for (int t = 0; t < FA_L; t++) {
            const FA_T *kr = k + (size_t) (j0 + t) * d_k;
            if (t >= keys) {
                part[t] = FA_VZERO();
                continue;
            }
            if (ahead)
                for (size_t b = 0; b < row_bytes; b += 64)
                    FA_PREFETCH((const char *) (kr + (size_t) ahead * d_k) + b);
            part[t] = d_k == 4 * FA_L ? FA_NAME(fa_key_dot)(q, kr, 4 * FA_L)
                                      : FA_NAME(fa_key_dot)(q, kr, d_k);
        }
        FA_VT x = FA_VMUL(FA_LANE_SUMS(part), sc);
        if (keys == FA_L) FA_VSTORE(s + j0, x);
        else FA_VMSTORE(s + j0, FA_PREFIX(keys), x);
    }
}

/* NC column vectors of acc += sum_{j < width} p[j] v_j, two keys at a time into two sets of
 * accumulators (the FMAs' latency) */
FA_TARGET FA_INLINE void FA_NAME(fa_query_values_block)(const FA_T *p, const FA_T *v, int ldv,
                                                        int width, FA_T *acc, int ahead,
                                                        const int NC) {
    FA_VT a[4], b[4];
    for (int c = 0; c < NC; c++) {
        a[c] = FA_VLOAD(acc + FA_L * c);
        b[c] = FA_VZERO();
    }
    int j = 0;
    for (; j + 2 <= width; j += 2) {
        const FA_T *v0 = v + (size_t) j * ldv, *v1 = v0 + ldv;
        if (ahead) {
            for (int c = 0; c < ldv / FA_L; c++) {      /* the whole row: a vector is a 64-byte line */
                FA_PREFETCH(v0 + (size_t) ahead * ldv + FA_L * c);
                FA_PREFETCH(v1 + (size_t) ahead * ldv + FA_L * c);
            }
        }
        FA_VT p0 = FA_VSET1(p[j]), p1 = FA_VSET1(p[j + 1]);
        for (int c = 0; c < NC; c++) {
            a[c] = FA_VFMADD(p0, FA_VLOAD(v0 + FA_L * c), a[c]);
            b[c] = FA_VFMADD(p1, FA_VLOAD(v1 + FA_L * c), b[c]);
        }
    }
    if (j < width) {
        FA_VT p0 = FA_VSET1(p[j]);
        for (int c = 0; c < NC; c++) a[c] = FA_VFMADD(p0, FA_VLOAD(v + (size_t) j * ldv + FA_L * c), a[c]);
    }
    for (int c = 0; c < NC; c++) FA_VSTORE(acc + FA_L * c, FA_VADD(a[c], b[c]));
}

/* One query: acc[0:d_v] += sum_{j < width} p[j] v[j, 0:d_v] (d_v a multiple of L), value rows
 * as they lie; rows past width are never read.  `ahead` as for fastattn_query_scores. */
FA_TARGET static void FA_NAME(fastattn_query_values)(const FA_T *p, const FA_T *v, int width,
                                                     int d_v, FA_T *acc, int ahead) {
    for (int c0 = 0; c0 < d_v; c0 += FA_QUERY_V * FA_L) {
        int nc = (d_v - c0) / FA_L < FA_QUERY_V ? (d_v - c0) / FA_L : FA_QUERY_V;
        int pf = c0 == 0 ? ahead : 0;      /* the first pass brings the rows in */
        if (nc == 4) FA_NAME(fa_query_values_block)(p, v + c0, d_v, width, acc + c0, pf, 4);
        else if (nc == 3) FA_NAME(fa_query_values_block)(p, v + c0, d_v, width, acc + c0, pf, 3);
        else if (nc == 2) FA_NAME(fa_query_values_block)(p, v + c0, d_v, width, acc + c0, pf, 2);
        else FA_NAME(fa_query_values_block)(p, v + c0, d_v, width, acc + c0, pf, 1);
    }
}

/* R rows x NP panels of scores; 'left' keys remain from this panel group's first */
FA_TARGET FA_INLINE void FA_NAME(fa_scores_block)(const FA_T *q, int ldq, const FA_T *kp, int d,
                                                  FA_VT scale, FA_T *s, int lds, int left,
                                                  const int R, const int NP) {
    FA_VT acc[6][4];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) acc[r][p] = FA_VZERO();
    for (int c = 0; c < d; c++) {
        FA_VT kv[4];
        for (int p = 0; p < NP; p++) kv[p] = FA_VLOAD(kp + ((size_t) p * d + c) * FA_L);
        for (int r = 0; r < R; r++) {
            FA_VT qb = FA_VSET1(q[(size_t) r * ldq + c]);
            for (int p = 0; p < NP; p++) acc[r][p] = FA_VFMADD(qb, kv[p], acc[r][p]);
        }
    }
    for (int r = 0; r < R; r++) {
        for (int p = 0; p < NP; p++) {
            int rest = left - FA_L * p;
            FA_VT x = FA_VMUL(acc[r][p], scale);
            FA_T *dst = s + (size_t) r * lds + FA_L * p;
            if (rest >= FA_L) FA_VSTORE(dst, x);
            else FA_VMSTORE(dst, FA_PREFIX(rest), x);
        }
    }
}

#define FA_SCORES_R(NP) \
    switch (R) { \
    case 6: FA_NAME(fa_scores_block)(q, ldq, kp, d, sc, s, lds, left, 6, NP); break; \
    case 5: FA_NAME(fa_scores_block)(q, ldq, kp, d, sc, s, lds, left, 5, NP); break; \
    case 4: FA_NAME(fa_scores_block)(q, ldq, kp, d, sc, s, lds, left, 4, NP); break; \
    case 3: FA_NAME(fa_scores_block)(q, ldq, kp, d, sc, s, lds, left, 3, NP); break; \
    case 2: FA_NAME(fa_scores_block)(q, ldq, kp, d, sc, s, lds, left, 2, NP); break; \
    default: FA_NAME(fa_scores_block)(q, ldq, kp, d, sc, s, lds, left, 1, NP); break; \
    }

/* s[r, j] = scale q[r, :] . k[j, :] for r < rows, j < width (kp from fastattn_pack_keys) */
FA_TARGET static void FA_NAME(fastattn_scores)(const FA_T *q0, int ldq, const FA_T *kp0, int rows,
                                               int width, int d, FA_T scale, FA_T *s0, int lds) {
    FA_VT sc = FA_VSET1(scale);
    for (int j = 0; j < width; j += FA_BLOCK_V * FA_L) {
        int left = width - j;
        int np = (left + FA_L - 1) / FA_L;
        if (np > FA_BLOCK_V) np = FA_BLOCK_V;
        const FA_T *kp = kp0 + (size_t) (j / FA_L) * d * FA_L;
        for (int r0 = 0; r0 < rows; r0 += 6) {
            int R = rows - r0 < 6 ? rows - r0 : 6;
            const FA_T *q = q0 + (size_t) r0 * ldq;
            FA_T *s = s0 + (size_t) r0 * lds + j;
            if (np >= 4) { FA_SCORES_R(4) }
            else if (np == 3) { FA_SCORES_R(3) }
            else if (np == 2) { FA_SCORES_R(2) }
            else { FA_SCORES_R(1) }
        }
    }
}
#undef FA_SCORES_R

/* Values in panels for fastattn_output: the columns [c0, c0 + g) of a head's n_k value
 * rows, g = FA_BLOCK_V FA_L (fewer in the last panel), lie row after row from vp + c0 n_k,
 * so a panel is one contiguous stream of n_k g elements.  Rows [j0, j0 + width) of the head
 * (v points at row j0, ldv apart) are packed.  Read as they lie, the d_v = 128 rows of
 * float32 are 512 bytes apart: the output product's 16 columns of 512 keys fall in 8 of the
 * L1's 64 sets and are reread from L2 for every 6 rows (the product ran at 76 against 86
 * GFLOP/s on panels, 1 thread, in a C harness). */
FA_TARGET static void FA_NAME(fastattn_pack_values)(const FA_T *v, int ldv, int j0, int width,
                                                    int d_v, int n_k, FA_T *vp) {
    for (int c0 = 0; c0 < d_v; c0 += FA_BLOCK_V * FA_L) {
        int g = d_v - c0 < FA_BLOCK_V * FA_L ? d_v - c0 : FA_BLOCK_V * FA_L;
        FA_T *dst = vp + (size_t) c0 * n_k + (size_t) j0 * g;
        for (int j = 0; j < width; j++)
            for (int c = 0; c < g; c += FA_L)
                FA_VSTORE(dst + (size_t) j * g + c, FA_VLOAD(v + (size_t) j * ldv + c0 + c));
    }
}

/* R rows x NC column vectors of o += p v over keys [0, width), v a panel NC FA_L wide */
FA_TARGET FA_INLINE void FA_NAME(fa_output_block)(const FA_T *p, int ldp, const FA_T *v,
                                                  int width, FA_T *o, int ldo, const int R,
                                                  const int NC) {
    FA_VT acc[6][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = FA_VLOAD(o + (size_t) r * ldo + FA_L * c);
    for (int j = 0; j < width; j++) {
        FA_VT vv[4];
        for (int c = 0; c < NC; c++) vv[c] = FA_VLOAD(v + (size_t) j * NC * FA_L + FA_L * c);
        for (int r = 0; r < R; r++) {
            FA_VT pb = FA_VSET1(p[(size_t) r * ldp + j]);
            for (int c = 0; c < NC; c++) acc[r][c] = FA_VFMADD(pb, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) FA_VSTORE(o + (size_t) r * ldo + FA_L * c, acc[r][c]);
}

#define FA_OUTPUT_R(NC) \
    switch (R) { \
    case 6: FA_NAME(fa_output_block)(p, ldp, v, width, o, ldo, 6, NC); break; \
    case 5: FA_NAME(fa_output_block)(p, ldp, v, width, o, ldo, 5, NC); break; \
    case 4: FA_NAME(fa_output_block)(p, ldp, v, width, o, ldo, 4, NC); break; \
    case 3: FA_NAME(fa_output_block)(p, ldp, v, width, o, ldo, 3, NC); break; \
    case 2: FA_NAME(fa_output_block)(p, ldp, v, width, o, ldo, 2, NC); break; \
    default: FA_NAME(fa_output_block)(p, ldp, v, width, o, ldo, 1, NC); break; \
    }

/* o[r, :d_v] += sum_{j < width} p[r, j] v[j0 + j, :d_v] for r < rows (d_v a multiple of L),
 * vp a head's n_k values packed by fastattn_pack_values */
FA_TARGET static void FA_NAME(fastattn_output)(const FA_T *p0, int ldp, const FA_T *vp, int n_k,
                                               int j0, int rows, int width, int d_v, FA_T *o0,
                                               int ldo) {
    for (int c0 = 0; c0 < d_v; c0 += FA_BLOCK_V * FA_L) {
        int nc = (d_v - c0) / FA_L < FA_BLOCK_V ? (d_v - c0) / FA_L : FA_BLOCK_V;
        const FA_T *v = vp + (size_t) c0 * n_k + (size_t) j0 * nc * FA_L;
        for (int r0 = 0; r0 < rows; r0 += 6) {
            int R = rows - r0 < 6 ? rows - r0 : 6;
            const FA_T *p = p0 + (size_t) r0 * ldp;
            FA_T *o = o0 + (size_t) r0 * ldo + c0;
            if (nc == 4) { FA_OUTPUT_R(4) }
            else if (nc == 3) { FA_OUTPUT_R(3) }
            else if (nc == 2) { FA_OUTPUT_R(2) }
            else { FA_OUTPUT_R(1) }
        }
    }
}
#undef FA_OUTPUT_R

/* s[j] = exp(s[j] - shift) in place for j < n, s[j] <= shift; returns the sum.
 * exp(x) = 2**t, t = x log2(e) = e + f, e = round(t): 2**f by FA_EXP2_POLY,
 * then FA_EXP2_SCALE multiplies by 2**e.  t is first raised to FA_EXP_LOWEST,
 * where 2**t is 0 (so t = -inf, a masked or -inf score, gives 0, not
 * inf - inf); max(lowest, t) keeps a NaN t, and the NaN. */
FA_TARGET FA_INLINE FA_VT FA_NAME(fa_exp_shifted)(FA_VT x, FA_VT sh) {
    FA_VT t = FA_VMUL(FA_VSUB(x, sh), FA_VSET1((FA_T) 1.4426950408889634));
    t = FA_VMAX(FA_VSET1(FA_EXP_LOWEST), t);
    FA_VT e, f, p;
    FA_EXP2_SPLIT(e, f, t);
    FA_EXP2_POLY(p, f);
    return FA_EXP2_SCALE(p, e);
}

/* max(s[0:n]), -inf for n == 0, a NaN s[j] passed over (as row_max of _vmath.pxd).  Four
 * running maxima, each a chain of its own: gcc's loop for row_max keeps one, and waits out
 * vmaxps's latency (4 cycles) for every vector; the row maximum then took 5 % of a softmax
 * call, now 2.5 % (perf; Intel, AVX-512, 1 thread, n = 4096, d = 64).  Side by side (9 turns
 * of separate processes), softmax calls at d = 32 and 64 took 1-5 % less time (paired
 * medians 0.95-0.99), at d = 128 the same. */
FA_TARGET static FA_T FA_NAME(fastattn_tile_max)(const FA_T *s, int n) {
    const FA_VT lowest = FA_VSET1(-INFINITY);
    FA_VT m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
    FA_T mx;
    int j = 0;
    for (; j + 4 * FA_L <= n; j += 4 * FA_L) {
        m0 = FA_VMAX(FA_VLOAD(s + j), m0);      /* max(NaN, m) is m: the second operand */
        m1 = FA_VMAX(FA_VLOAD(s + j + FA_L), m1);
        m2 = FA_VMAX(FA_VLOAD(s + j + 2 * FA_L), m2);
        m3 = FA_VMAX(FA_VLOAD(s + j + 3 * FA_L), m3);
    }
    for (; j + FA_L <= n; j += FA_L) m0 = FA_VMAX(FA_VLOAD(s + j), m0);
    mx = FA_VREDUCE_MAX(FA_VMAX(FA_VMAX(m0, m1), FA_VMAX(m2, m3)));   /* no lane is NaN */
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

FA_TARGET static FA_T FA_NAME(fastattn_tile_exp_sum)(FA_T *s, int n, FA_T shift) {
    const FA_VT sh = FA_VSET1(shift);
    FA_VT total = FA_VZERO();
    int j = 0;
    for (; j + FA_L <= n; j += FA_L) {
        FA_VT p = FA_NAME(fa_exp_shifted)(FA_VLOAD(s + j), sh);
        FA_VSTORE(s + j, p);
        total = FA_VADD(total, p);
    }
    if (j < n) {
        FA_MT k = FA_PREFIX(n - j);
        FA_VT p = FA_NAME(fa_exp_shifted)(FA_VMLOADZ(k, s + j), sh);
        FA_VMSTORE(s + j, k, p);
        total = FA_VMADD(total, k, total, p);
    }
    return FA_VREDUCE_ADD(total);
}

#if FA_ISA == 512
/* One query over keys [0, width) (width a multiple of FA_L), d_k = d_v = NC vectors, in one
 * pass with the online softmax in registers.  Each FA_L keys' scores (as
 * fastattn_query_scores) raise the running maximum m when they pass it, rescaling acc and
 * the sum by exp(m_old - m_new); they become p = exp(s - m), and their value rows are added
 * as p v after the next group's key rows, so the exp of a group overlaps the loads of the
 * next.  K and V stream by turns of FA_L rows, with no pause for the softmax of a block.
 * Side by side in one process against a read of K and V (Zen 4, H = 8, in cache): d = 64
 * float32 at 92-99 % on one thread where a block's two passes and their softmax took 80-89;
 * d = 128 float32 at 98 against 65-69 %; 16 vectors (d = 128 float64, 256 float32) at 87-123
 * against 47-63 % on one thread and two; float64 d = 32 on two threads at 80-87 against
 * 77-78 %, and 68-70 % with each group's value rows right after its own key rows.  A key
 * row and a value row in turn, and two sets of accumulators for the FMAs' latency, were no
 * faster.  Rows that start off a 64-byte line (NumPy's large arrays start 16 bytes past
 * one) read as aligned lines shifted into place by vpermt2ps, one load a line: 98-99
 * against 106 us at 4096 keys on two threads, but 1.60-1.65 against 1.51 ms at 32768 and
 * 3.74-3.89 against 3.50 ms on one thread (fastest calls, one process): not kept, since a
 * model's step reads most of its caches from memory.  *m, *l and acc[0:d] hold the running
 * state (-inf, 0 and zeros for none yet).  While every score so far is -inf the shift is 0
 * (exp gives 0, not NaN); a NaN score makes l and acc NaN.  `ahead` as for
 * fastattn_query_scores, for K and V.  AVX-512 only: the decode step takes it with no other
 * instruction set (an AVX2 form would hold q and acc in pairs of ymm, twice the
 * registers). */
FA_TARGET FA_INLINE void FA_NAME(fa_query_attend)(
        const FA_T *q, const FA_T *k, const FA_T *v, int width, FA_T scale, FA_T *m, FA_T *l,
        FA_T *acc, int ahead, const int NC) {
    const FA_VT sc = FA_VSET1(scale);
    FA_VT qv[16], a[16];
    for (int c = 0; c < NC; c++) {
        qv[c] = FA_VLOAD(q + FA_L * c);
        a[c] = FA_VLOAD(acc + FA_L * c);
    }
    FA_VT total = FA_VMASKZ(FA_PREFIX(1), FA_VSET1(*l));     /* l in lane 0 */
    FA_T mx = *m;
    FA_VT shift = FA_VSET1(mx == -INFINITY ? 0 : mx);
    FA_T p[FA_L] __attribute__((aligned(64)));
    const FA_T *kr = k, *vr = v;
    /* Group g's scores are taken before group g - 1's p v is added, so the exp of one
     * group overlaps the key rows of the next. */
    for (int j0 = 0; j0 <= width; j0 += FA_L) {
        FA_VT s = FA_VZERO();
        if (j0 < width) {
            FA_VT part[FA_L];
            _Pragma("GCC unroll 1")      /* rows in turn: see fastattn_query_scores */
            for (int t = 0; t < FA_L; t++, kr += NC * FA_L) {
                if (ahead)
                    for (int c = 0; c < NC; c++)
                        FA_PREFETCH(kr + (size_t) ahead * NC * FA_L + FA_L * c);
                FA_VT x = FA_VMUL(qv[0], FA_VLOAD(kr));
                for (int c = 1; c < NC; c++) x = FA_VFMADD(qv[c], FA_VLOAD(kr + FA_L * c), x);
                part[t] = x;
            }
            s = FA_VMUL(FA_LANE_SUMS(part), sc);
        }
        if (j0 > 0) {
            _Pragma("GCC unroll 1")
            for (int t = 0; t < FA_L; t++, vr += NC * FA_L) {
                if (ahead)
                    for (int c = 0; c < NC; c++)
                        FA_PREFETCH(vr + (size_t) ahead * NC * FA_L + FA_L * c);
                const FA_VT pt = FA_VSET1(p[t]);
                for (int c = 0; c < NC; c++) a[c] = FA_VFMADD(pt, FA_VLOAD(vr + FA_L * c), a[c]);
            }
        }
        if (j0 == width) break;
        const FA_T top = FA_VREDUCE_MAX(s);
        if (top > mx) {
            /* exp(m_old - m_new), 0 from m_old = -inf */
            const FA_VT alpha = FA_NAME(fa_exp_shifted)(FA_VSET1(mx), FA_VSET1(top));
            for (int c = 0; c < NC; c++) a[c] = FA_VMUL(a[c], alpha);
            total = FA_VMUL(total, alpha);
            mx = top;
            shift = FA_VSET1(mx == -INFINITY ? 0 : mx);
        }
        const FA_VT e = FA_NAME(fa_exp_shifted)(s, shift);
        total = FA_VADD(total, e);
        FA_VSTORE(p, e);
    }
    *m = mx;
    *l = FA_VREDUCE_ADD(total);
    for (int c = 0; c < NC; c++) FA_VSTORE(acc + FA_L * c, a[c]);
}

/* fa_query_attend at d_k = d_v = d, 1 to 16 vectors */
FA_TARGET static void FA_NAME(fastattn_query_attend)(
        const FA_T *q, const FA_T *k, const FA_T *v, int width, int d, FA_T scale, FA_T *m,
        FA_T *l, FA_T *acc, int ahead) {
#define FA_ATTEND(NC) \
    case NC: FA_NAME(fa_query_attend)(q, k, v, width, scale, m, l, acc, ahead, NC); break;
    switch (d / FA_L) {
    FA_ATTEND(16) FA_ATTEND(15) FA_ATTEND(14) FA_ATTEND(13) FA_ATTEND(12) FA_ATTEND(11)
    FA_ATTEND(10) FA_ATTEND(9) FA_ATTEND(8) FA_ATTEND(7) FA_ATTEND(6) FA_ATTEND(5)
    FA_ATTEND(4) FA_ATTEND(3) FA_ATTEND(2) FA_ATTEND(1)
    default: __builtin_trap();      /* the caller passes 1 to 16 vectors */
    }
#undef FA_ATTEND
}
#endif

/* Linear attention's products, for the same element type. */
#include "_linear_t.h"
