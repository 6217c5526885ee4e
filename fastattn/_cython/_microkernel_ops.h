/* The vector operations of one instruction set and one element type, then the
 * products written on them (_microkernel_t.h, which includes _linear_t.h).
 * Included by _microkernel.pxd four times, with
 *
 *   FA_ISA     512 (AVX-512F) or 256 (AVX2 with FMA)
 *   FA_DOUBLE  0 (float) or 1 (double)
 *
 * defined; everything it defines is undefined again at its end.
 *
 * The panel of keys and the vector FA_VT are FA_L = 16 float or 8 double wide
 * in both instruction sets, so the packed keys, the scratch sizes and the
 * lane rule (d a multiple of FA_L) are one for both: one zmm, or a pair of
 * ymm (the structs fa_pair_t_f / fa_pair_t_d of _avx2_pair.h, which gcc
 * keeps in registers once the blocks are unrolled).  What
 * differs is how many of them a block holds: AVX-512 has 32 registers, AVX2
 * 16, so a block of 6 rows holds FA_BLOCK_V = 4 vectors of a row there and
 * 1 (two ymm) here.  A mask FA_MT is a bit a lane (AVX-512) or a pair of
 * lane masks (AVX2); FA_PREFIX(n) selects the first n lanes, 0 <= n <= FA_L.
 */
#if FA_ISA == 512
#define FA_TARGET __attribute__((target("avx512f")))
#define FA_BLOCK_V 4
#define FA_QUERY_V 4
#if !FA_DOUBLE
#define FA_T float
#define FA_L 16
#define FA_NAME(x) x##_f512
#define FA_VT __m512
#define FA_MT __mmask16
#define FA_S(op) _mm512_##op##_ps
#define FA_LANE_SUMS fa_lane_sums_f
#define FA_VCMP _mm512_cmp_ps_mask
#else
#define FA_T double
#define FA_L 8
#define FA_NAME(x) x##_d512
#define FA_VT __m512d
#define FA_MT __mmask8
#define FA_S(op) _mm512_##op##_pd
#define FA_LANE_SUMS fa_lane_sums_d
#define FA_VCMP _mm512_cmp_pd_mask
#endif
#define FA_PREFIX(n) ((FA_MT) ((1u << (n)) - 1u))
/* Where exp's 2**t is 0 in the dtype: t is raised to it (vscalef gives 0 below 2**-149) */
#if !FA_DOUBLE
#define FA_EXP_LOWEST (-160.0f)
#else
#define FA_EXP_LOWEST (-1100.0)
#endif
#define FA_VZERO FA_S(setzero)
#define FA_VSET1 FA_S(set1)
#define FA_VLOAD FA_S(loadu)
#define FA_VSTORE FA_S(storeu)
#define FA_VMSTORE FA_S(mask_storeu)
#define FA_VMLOADZ FA_S(maskz_loadu)
#define FA_VFMADD FA_S(fmadd)
#define FA_VMUL FA_S(mul)
#define FA_VSUB FA_S(sub)
#define FA_VADD FA_S(add)
#define FA_VMIN FA_S(min)
#define FA_VMAX FA_S(max)
#define FA_VMADD FA_S(mask_add)
#define FA_VMASKZ FA_S(maskz_mov)
#define FA_VREDUCE_ADD FA_S(reduce_add)
#define FA_VREDUCE_MAX FA_S(reduce_max)
/* 2**t = 2**f 2**e: e (here round(t)) and f = t - round(t), then p 2**e by vscalef */
#define FA_EXP2_SPLIT(e, f, t) do { \
    e = FA_S(roundscale)(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
    f = FA_VSUB(t, e); \
} while (0)
#define FA_EXP2_SCALE FA_S(scalef)
#else   /* FA_ISA == 256 */
#define FA_TARGET FA_AVX2
#define FA_BLOCK_V 1
#define FA_QUERY_V 2
#if !FA_DOUBLE
#define FA_T float
#define FA_L 16
#define FA_NAME(x) x##_f256
#define FA_P(op) fa_pair_##op##_f
#else
#define FA_T double
#define FA_L 8
#define FA_NAME(x) x##_d256
#define FA_P(op) fa_pair_##op##_d
#endif
/* Where exp's 2**t is 0: t is raised to it (the split's lowest exponent, whose bits are 0) */
#if !FA_DOUBLE
#define FA_EXP_LOWEST (-127.0f)
#else
#define FA_EXP_LOWEST (-1023.0)
#endif
#define FA_VT FA_P(t)
#define FA_MT FA_P(t)
#define FA_PREFIX FA_P(prefix)
#define FA_VZERO FA_P(zero)
#define FA_VSET1 FA_P(set1)
#define FA_VLOAD FA_P(load)
#define FA_VSTORE FA_P(store)
#define FA_VMSTORE FA_P(mask_store)
#define FA_VMLOADZ FA_P(maskz_load)
#define FA_VFMADD FA_P(fmadd)
#define FA_VMUL FA_P(mul)
#define FA_VSUB FA_P(sub)
#define FA_VADD FA_P(add)
#define FA_VMIN FA_P(min)
#define FA_VMAX FA_P(max)
#define FA_VMADD FA_P(mask_add)
#define FA_VMASKZ FA_P(maskz)
#define FA_VCMP FA_P(cmp)
#define FA_VREDUCE_ADD FA_P(reduce_add)
#define FA_VREDUCE_MAX FA_P(reduce_max)
#define FA_LANE_SUMS FA_P(lane_sums)
/* e encodes round(t) in its low bits (_avx2_pair.h): -127 <= t < 128 (-1023 <= t < 1024) */
#define FA_EXP2_SPLIT(e, f, t) do { e = FA_P(exp2_split)(t, &(f)); } while (0)
#define FA_EXP2_SCALE FA_P(exp2_scale)
#endif
#define FA_ALL FA_PREFIX(FA_L)

#if !FA_DOUBLE
/* 2**f, |f| <= 1/2: Cephes' exp2f polynomial, about 2e-7 relative */
#define FA_EXP2_POLY(p, f) do { \
    p = FA_VSET1(1.535336188319500e-4f); \
    p = FA_VFMADD(p, f, FA_VSET1(1.339887440266574e-3f)); \
    p = FA_VFMADD(p, f, FA_VSET1(9.618437357674640e-3f)); \
    p = FA_VFMADD(p, f, FA_VSET1(5.550332471162809e-2f)); \
    p = FA_VFMADD(p, f, FA_VSET1(2.402264791363012e-1f)); \
    p = FA_VFMADD(p, f, FA_VSET1(6.931472028550421e-1f)); \
    p = FA_VFMADD(p, f, FA_VSET1(1.0f)); \
} while (0)
#else
/* 2**f = exp(r), r = f ln 2, |r| <= 0.347: Taylor degree 13, below 1e-16 relative */
#define FA_EXP2_POLY(p, f) do { \
    FA_VT r_ = FA_VMUL(f, FA_VSET1(0.6931471805599453)); \
    p = FA_VSET1(1.0 / 6227020800.0); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 479001600.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 39916800.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 3628800.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 362880.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 40320.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 5040.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 720.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 120.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 24.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(1.0 / 6.0)); \
    p = FA_VFMADD(p, r_, FA_VSET1(0.5)); \
    p = FA_VFMADD(p, FA_VMUL(r_, r_), FA_VADD(r_, FA_VSET1(1.0))); \
} while (0)
#endif

#include "_microkernel_t.h"

#undef FA_TARGET
#undef FA_BLOCK_V
#undef FA_QUERY_V
#undef FA_T
#undef FA_L
#undef FA_NAME
#undef FA_VT
#undef FA_MT
#undef FA_S
#undef FA_P
#undef FA_PREFIX
#undef FA_ALL
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
#undef FA_VMIN
#undef FA_VMAX
#undef FA_VMADD
#undef FA_VMASKZ
#undef FA_VCMP
#undef FA_VREDUCE_ADD
#undef FA_VREDUCE_MAX
#undef FA_EXP2_SPLIT
#undef FA_EXP2_SCALE
#undef FA_EXP_LOWEST
#undef FA_LANE_SUMS
#undef FA_EXP2_POLY
