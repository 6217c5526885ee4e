/* The products of linear attention, included at the end of _microkernel_t.h
 * once per instruction set and element type (FA_T, FA_L, FA_NAME and the
 * FA_V... vector operations defined by _microkernel_ops.h).
 *
 * One register-blocked product o[r, :] (=|+=) sum_j p[r, j] v[j, :], R = 6
 * rows x NC = FA_BLOCK_V vectors of o held in registers over all of j (24
 * zmm with AVX-512, 12 ymm with AVX2), v read in rows as
 * it lies, p read by broadcasts at any strides (prs along r, pjs along j).
 * So with no packing and no copy:
 *
 * * the state      S += phi(k)^T v     p = phi(k) read down its columns
 *                                       (prs = 1, pjs = d_k), rows = d_k;
 * * the queries    o = phi(q) S / den  p = phi(q) (prs = d_k, pjs = 1),
 *                                       the row scale applied at the store;
 * * the diagonal   o += A v            A the masked phi(q) phi(k)^T of the
 *                                       chunk (fastattn_scores), each block
 *                                       of rows only over the keys it sees.
 *
 * Sums run in the order of j, one FMA at a time, in the input's precision,
 * like BLAS.
 *
 * Prefetch: the product and the elu map take the next piece of a stream
 * (`ahead`, `ahead_bytes`: the next chunk's values, queries, keys or
 * output) and touch its 64-byte lines into L2, so that a stream from memory
 * arrives while this chunk computes instead of stalling the next one (a
 * 128-key chunk fold waited as long as it computed at n = 16384, H = 8,
 * 1 thread, before).  The elu map touches a line a vector; the product
 * spreads its lines evenly over all its iterations (a line every `step`,
 * the largest power of two that still reaches the last line): issued in
 * the first iterations instead, they queued behind each other while the
 * product waited on its own loads (in a C harness the fold of 131072 keys
 * ran at 49-56 GFLOP/s with the lines up front, 54-63 spread, 1 thread).
 */
#define FL_PREFETCH(address) __builtin_prefetch((address), 0, 2)

/* R rows x NC vectors of o: o (= or +=) p v over j < width, then times scale[r] */
FA_TARGET FA_INLINE void FA_NAME(fl_product_block)(const FA_T *p, long prs, long pjs,
                                                   const FA_T *v, int ldv, int width, FA_T *o,
                                                   int ldo, int accumulate, const FA_T *scale,
                                                   const char *ahead, long ahead_lines,
                                                   int step, const int R, const int NC) {
    FA_VT acc[6][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++)
            acc[r][c] = accumulate ? FA_VLOAD(o + (size_t) r * ldo + FA_L * c) : FA_VZERO();
    long line = 0;    /* of this block's share, one every step (a power of two) iterations */
    for (int j = 0; j < width; j++) {
        if ((j & (step - 1)) == 0 && line < ahead_lines) FL_PREFETCH(ahead + 64 * line++);
        FA_VT vv[4];
        for (int c = 0; c < NC; c++) vv[c] = FA_VLOAD(v + (size_t) j * ldv + FA_L * c);
        for (int r = 0; r < R; r++) {
            FA_VT pb = FA_VSET1(p[r * prs + j * pjs]);
            for (int c = 0; c < NC; c++) acc[r][c] = FA_VFMADD(pb, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++) {
        FA_VT sc = scale ? FA_VSET1(scale[r]) : FA_VZERO();
        for (int c = 0; c < NC; c++)
            FA_VSTORE(o + (size_t) r * ldo + FA_L * c, scale ? FA_VMUL(acc[r][c], sc) : acc[r][c]);
    }
}

#define FL_PRODUCT_R(NC) \
    switch (R) { \
    case 6: FA_NAME(fl_product_block)(pr, prs, pjs, v, ldv, w, o, ldo, accumulate, sc, ahead, ahead_lines, step, 6, NC); break; \
    case 5: FA_NAME(fl_product_block)(pr, prs, pjs, v, ldv, w, o, ldo, accumulate, sc, ahead, ahead_lines, step, 5, NC); break; \
    case 4: FA_NAME(fl_product_block)(pr, prs, pjs, v, ldv, w, o, ldo, accumulate, sc, ahead, ahead_lines, step, 4, NC); break; \
    case 3: FA_NAME(fl_product_block)(pr, prs, pjs, v, ldv, w, o, ldo, accumulate, sc, ahead, ahead_lines, step, 3, NC); break; \
    case 2: FA_NAME(fl_product_block)(pr, prs, pjs, v, ldv, w, o, ldo, accumulate, sc, ahead, ahead_lines, step, 2, NC); break; \
    default: FA_NAME(fl_product_block)(pr, prs, pjs, v, ldv, w, o, ldo, accumulate, sc, ahead, ahead_lines, step, 1, NC); break; \
    }

/* For r < rows: o[r, :d_v] (= or, when accumulate, +=) sum_{j < w_r} p[r prs + j pjs] v[j, :d_v],
 * then times scale[r] when scale is not NULL.  w_r = width, or when seen is not
 * NULL seen[r0 + R - 1] for the block of rows [r0, r0 + R) holding r (seen
 * nondecreasing, p zero past each row's own seen[r]).  d_v a multiple of FA_L.
 * ahead_bytes of ahead (NULL, 0: none) are prefetched, spread over the iterations. */
FA_TARGET __attribute__((unused)) static void FA_NAME(fastattn_linear_product)(const FA_T *p, long prs, long pjs,
                                                       const FA_T *v, int ldv, int rows,
                                                       int width, const int *seen, int d_v,
                                                       FA_T *o0, int ldo, int accumulate,
                                                       const FA_T *scale, const void *ahead_to,
                                                       long ahead_bytes) {
    const char *ahead = (const char *) ahead_to;
    long ahead_lines = ahead ? (ahead_bytes + 63) / 64 : 0;
    int step = 1;
    if (ahead_lines > 0) {
        long iterations = 0;    /* over every panel and block of rows */
        for (int r0 = 0; r0 < rows; r0 += 6)
            iterations += seen ? seen[(r0 + 6 < rows ? r0 + 6 : rows) - 1] : width;
        iterations *= (d_v + FA_BLOCK_V * FA_L - 1) / (FA_BLOCK_V * FA_L);
        while ((long) step * 2 * ahead_lines <= iterations) step *= 2;
    }
    for (int c0 = 0; c0 < d_v; c0 += FA_BLOCK_V * FA_L) {
        int nc = (d_v - c0) / FA_L < FA_BLOCK_V ? (d_v - c0) / FA_L : FA_BLOCK_V;
        for (int r0 = 0; r0 < rows; r0 += 6) {
            int R = rows - r0 < 6 ? rows - r0 : 6;
            int w = seen ? seen[r0 + R - 1] : width;
            const FA_T *pr = p + r0 * prs;
            const FA_T *sc = scale ? scale + r0 : NULL;
            FA_T *o = o0 + (size_t) r0 * ldo + c0;
            v += c0;
            if (nc == 4) { FL_PRODUCT_R(4) }
            else if (nc == 3) { FL_PRODUCT_R(3) }
            else if (nc == 2) { FL_PRODUCT_R(2) }
            else { FL_PRODUCT_R(1) }
            v -= c0;
            if (ahead_lines > 0) {
                long done = (w + step - 1) / step < ahead_lines ? (w + step - 1) / step : ahead_lines;
                ahead += 64 * done;
                ahead_lines -= done;
            }
        }
    }
}
#undef FL_PRODUCT_R

/* The masked diagonal of a causal chunk: for r < rows, den[r] += sum_{j < seen[r]} a[r, j]
 * and a[r, seen[r]:w_r] = 0, w_r = seen[r0 + R - 1] the keys fastattn_linear_product
 * reads for the block of 6 rows holding r (seen nondecreasing, a[r, :w_r] formed). */
FA_TARGET __attribute__((unused)) static void FA_NAME(fastattn_linear_mask)(FA_T *a, int lda, int rows, const int *seen,
                                                    FA_T *den) {
    for (int r = 0; r < rows; r++) {
        int r_last = r - r % 6 + 5 < rows - 1 ? r - r % 6 + 5 : rows - 1;
        int w = seen[r_last], s = seen[r];
        FA_T *row = a + (size_t) r * lda;
        FA_VT total = FA_VZERO();
        for (int j = 0; j < w; j += FA_L) {
            int in = s - j < 0 ? 0 : (s - j < FA_L ? s - j : FA_L);
            int all = w - j < FA_L ? w - j : FA_L;
            /* x is 0 past the row's keys, so plain adds sum only what it sees; whole
             * vectors take plain loads and stores (AVX2's masked store is slow on AMD) */
            FA_VT x = in == FA_L ? FA_VLOAD(row + j) : FA_VMLOADZ(FA_PREFIX(in), row + j);
            total = FA_VADD(total, x);
            if (all == FA_L) FA_VSTORE(row + j, x);
            else FA_VMSTORE(row + j, FA_PREFIX(all), x);
        }
        den[r] += FA_VREDUCE_ADD(total);
    }
}

#if !FA_DOUBLE
#define FL_EXP_FLOOR (-126.0f)
#else
#define FL_EXP_FLOOR (-1022.0)
#endif
/* elu(a) + 1 = a > 0 ? a + 1 : exp(a) = max(a, 0) + exp(min(a, 0)), NaN kept: the feature
 * map of _vmath.pxd (fastattn_feature_map, elu), with exp(a) = 2**t as in
 * fastattn_tile_exp_sum (2**0 is exactly 1, so a > 0 gives a + 1 as rounded) and 0 for
 * t <= the smallest normal exponent, as there. */
FA_TARGET FA_INLINE FA_VT FA_NAME(fl_elu)(FA_VT a) {
    const FA_VT log2e = FA_VSET1((FA_T) 1.4426950408889634);
    const FA_VT zero = FA_VZERO(), lowest = FA_VSET1(FL_EXP_FLOOR);
    /* min(0, a) keeps a NaN a (vminps returns its second operand then), max(a, 0) drops it */
    FA_VT t = FA_VMUL(FA_VMIN(zero, a), log2e);
    FA_VT e, f, p;
    FA_EXP2_SPLIT(e, f, t);
    FA_EXP2_POLY(p, f);
    /* below the floor (where the split's e may be out of range, t = -inf included): 0 */
    p = FA_VMASKZ(FA_VCMP(t, lowest, _CMP_NLE_UQ), FA_EXP2_SCALE(p, e));
    return FA_VADD(FA_VMAX(a, zero), p);
}

/* out[0:n] = elu(x[0:n]) + 1 (fl_elu).  ahead (NULL: none): n elements
 * prefetched, a vector an iteration. */
FA_TARGET __attribute__((unused)) static void FA_NAME(fastattn_linear_elu)(const FA_T *x, long n, FA_T *out,
                                                                          const FA_T *ahead) {
    long j = 0;
    for (; j + FA_L <= n; j += FA_L) {
        if (ahead) FL_PREFETCH(ahead + j);
        FA_VSTORE(out + j, FA_NAME(fl_elu)(FA_VLOAD(x + j)));
    }
    if (j < n) {
        FA_MT m = FA_PREFIX((int) (n - j));
        if (ahead) FL_PREFETCH(ahead + j);
        FA_VMSTORE(out + j, m, FA_NAME(fl_elu)(FA_VMLOADZ(m, x + j)));
    }
}

/* The keys' features and their column sums in one pass: out = elu(x) + 1 over
 * rows x d (d a multiple of FA_L, at most FASTATTN_LINEAR_SUM_VECTORS FA_L: one
 * register of sums a vector of the row; linear.pyx takes the two passes beyond), and
 * z[a] (= or, when accumulate, +=) sum_r out[r, a], the rows summed in the
 * input's precision (a chunk's keys: error ~ rows eps) before z gains them.
 * ahead as in fastattn_linear_elu. */
#ifndef FASTATTN_LINEAR_SUM_VECTORS
#define FASTATTN_LINEAR_SUM_VECTORS 16
#endif
FA_TARGET __attribute__((unused)) static void FA_NAME(fastattn_linear_elu_sums)(const FA_T *x, int rows, int d,
                                                                               FA_T *out, const FA_T *ahead,
                                                                               FA_T *z, int accumulate) {
    FA_VT sums[FASTATTN_LINEAR_SUM_VECTORS];
    int nv = d / FA_L;
    for (int c = 0; c < nv; c++) sums[c] = FA_VZERO();
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < nv; c++) {
            long j = (long) r * d + (long) c * FA_L;
            FA_VT a = FA_VLOAD(x + j);
            if (ahead) FL_PREFETCH(ahead + j);
            FA_VT p = FA_NAME(fl_elu)(a);
            FA_VSTORE(out + j, p);
            sums[c] = FA_VADD(sums[c], p);
        }
    }
    for (int c = 0; c < nv; c++)
        FA_VSTORE(z + c * FA_L, accumulate ? FA_VADD(FA_VLOAD(z + c * FA_L), sums[c]) : sums[c]);
}
#undef FL_EXP_FLOOR
#undef FL_PREFETCH
