# Row kernels of the online softmax, in C so that gcc vectorises them.
#
# * exp of the softmax scores (exp_sum): written out as 2**t, a polynomial
#   for the fraction and the exponent bits for the integer part, so gcc
#   vectorises it inline with the sum (no call per vector).  The register-
#   blocked tile (_microkernel.pxd) has its own, vscalef with AVX-512.
# * exp of the elu feature map: the same polynomial (its argument is <= 0).
# * exp elsewhere (fexp): glibc only declares the SIMD
#   variants of exp/expf (libmvec) under -ffast-math, which would also assume
#   there is no inf or NaN and break the causal mask and the propagation of
#   non-finite inputs.  Declaring the variants here instead keeps IEEE
#   semantics (-O3 -fno-math-errno) and still gets _ZGV?N?v_expf calls from
#   the loops below.  Defining the macro FASTATTN_SCALAR_EXP turns this off,
#   to measure the gain.
# * max and sum: '#pragma omp simd reduction' (needs -fopenmp-simd, which
#   -fopenmp implies) lets gcc vectorise the reductions without -ffast-math.
#   A NaN score makes the row NaN whichever operand maxps keeps: exp(NaN - m)
#   is NaN, or every exp(s - NaN) is.
# * target_clones: x86-64-v4 (AVX-512) and x86-64-v3 (AVX2 with FMA; plain
#   "avx2" would leave FMA out) copies of each row kernel beside the baseline
#   SSE2 one, picked at load time (glibc ifunc), so the build stays portable.
#   FASTATTN_NO_CLONES turns it off.
from cython cimport floating
from libc.math cimport NAN, isinf

cdef extern from *:
    """
    #include <math.h>
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) \
        && defined(__linux__) && !defined(FASTATTN_SCALAR_EXP)
    #define FASTATTN_VECTOR_EXP 1
    float expf(float) __attribute__((__simd__("notinbranch")));
    double exp(double) __attribute__((__simd__("notinbranch")));
    #else
    #define FASTATTN_VECTOR_EXP 0
    #endif
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) \
        && defined(__linux__) && !defined(FASTATTN_NO_CLONES)
    #define FASTATTN_CLONES 1
    #define FASTATTN_TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
    #else
    #define FASTATTN_CLONES 0
    #define FASTATTN_TARGETS
    #endif

    /* max(s[0:n]), -inf for n == 0 */
    FASTATTN_TARGETS static float fastattn_row_max_f(const float *s, int n) {
        float mx = -INFINITY;
        #pragma omp simd reduction(max:mx)
        for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        return mx;
    }
    FASTATTN_TARGETS static double fastattn_row_max_d(const double *s, int n) {
        double mx = -INFINITY;
        #pragma omp simd reduction(max:mx)
        for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        return mx;
    }
    /* exp(x) for x <= 0 (a shifted score) as 2**t, t = x log2(e) = n + f,
       n = round(t), |f| <= 1/2: 2**f by a polynomial, 2**n from exponent bits.
       Written in arithmetic gcc vectorises inline (no call, no libmvec), so
       the exp keeps up with the GEMMs.  t <= -126 (float32), -1022
       (float64) gives 0 (flushed, as exp(-inf)); NaN stays NaN.  float32:
       Cephes' exp2f polynomial (about 2e-7 relative); float64: Taylor
       degree 13 of exp(f ln 2) (below 1e-16 relative).  The rounding of
       x log2(e) moves a term p by at most |t| 2**-24 p (float32) relative,
       which is below 2**-24 of the row's largest term. */
    static inline float fastattn_exp_nonpositive_f(float x) {
        float t = x * 1.44269504088896341f;
        float tc = t > -126.0f ? t : -126.0f;
        float n = floorf(tc + 0.5f);
        float f = tc - n;
        float p = 1.535336188319500e-4f;
        p = p * f + 1.339887440266574e-3f;
        p = p * f + 9.618437357674640e-3f;
        p = p * f + 5.550332471162809e-2f;
        p = p * f + 2.402264791363012e-1f;
        p = p * f + 6.931472028550421e-1f;
        p = p * f + 1.0f;
        int bits = ((int) n + 127) << 23;
        float pow2;
        __builtin_memcpy(&pow2, &bits, sizeof pow2);
        float y = t > -126.0f ? p * pow2 : 0.0f;
        return x != x ? x : y;
    }
    static inline double fastattn_exp_nonpositive_d(double x) {
        double t = x * 1.4426950408889634;
        double tc = t > -1022.0 ? t : -1022.0;
        double n = floor(tc + 0.5);
        double r = (tc - n) * 0.6931471805599453;
        double p = 1.0 / 6227020800.0;
        p = p * r + 1.0 / 479001600.0;
        p = p * r + 1.0 / 39916800.0;
        p = p * r + 1.0 / 3628800.0;
        p = p * r + 1.0 / 362880.0;
        p = p * r + 1.0 / 40320.0;
        p = p * r + 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * (r * r) + r + 1.0;
        long long bits = (long long) ((int) n + 1023) << 52;
        double pow2;
        __builtin_memcpy(&pow2, &bits, sizeof pow2);
        double y = t > -1022.0 ? p * pow2 : 0.0;
        return x != x ? x : y;
    }
    /* s[j] = exp(s[j] - shift) in place, s[j] <= shift; returns the sum */
    FASTATTN_TARGETS static float fastattn_exp_sum_f(float *s, int n, float shift) {
        float total = 0;
        #pragma omp simd reduction(+:total)
        for (int j = 0; j < n; j++) {
            float p = fastattn_exp_nonpositive_f(s[j] - shift);
            s[j] = p;
            total += p;
        }
        return total;
    }
    FASTATTN_TARGETS static double fastattn_exp_sum_d(double *s, int n, double shift) {
        double total = 0;
        #pragma omp simd reduction(+:total)
        for (int j = 0; j < n; j++) {
            double p = fastattn_exp_nonpositive_d(s[j] - shift);
            s[j] = p;
            total += p;
        }
        return total;
    }
    /* Whether x[0:n] are all finite: an inf or NaN has every exponent bit set, so its bits
       without the sign are the largest, at or above inf's.  An integer maximum: its one
       running vector waits a cycle a step, where a float sum (x * 0 added up, NaN for an
       inf or a NaN) waited out the add's 4 (a 16th of the loads a cycle could give). */
    typedef unsigned int fastattn_bits_f __attribute__((__may_alias__));
    typedef unsigned long long fastattn_bits_d __attribute__((__may_alias__));
    FASTATTN_TARGETS static int fastattn_all_finite_f(const float *x, long n) {
        const fastattn_bits_f *bits = (const fastattn_bits_f *) x;
        unsigned int top = 0;
        #pragma omp simd reduction(max:top)
        for (long t = 0; t < n; t++) {
            unsigned int a = bits[t] & 0x7fffffffu;
            top = a > top ? a : top;
        }
        return top < 0x7f800000u;
    }
    FASTATTN_TARGETS static int fastattn_all_finite_d(const double *x, long n) {
        const fastattn_bits_d *bits = (const fastattn_bits_d *) x;
        unsigned long long top = 0;
        #pragma omp simd reduction(max:top)
        for (long t = 0; t < n; t++) {
            unsigned long long a = bits[t] & 0x7fffffffffffffffull;
            top = a > top ? a : top;
        }
        return top < 0x7ff0000000000000ull;
    }
    /* Linear attention's feature map: relu max(x, 0) or elu(x) + 1, NaN kept.
       Branch-free so that the loop vectorises (exp of min(x, 0) is always
       computed, then selected).  The exp is the inline polynomial above, not
       libmvec's expf: a call per vector made the elu map cost as much as the
       GEMMs of linear attention at d = 64. */
    FASTATTN_TARGETS static void fastattn_feature_map_f(const float *x, long n, float *out, int relu) {
        if (relu) {
            #pragma omp simd
            for (long t = 0; t < n; t++) out[t] = x[t] <= 0 ? 0.0f : x[t];
        } else {
            #pragma omp simd
            for (long t = 0; t < n; t++) {
                float a = x[t], e = fastattn_exp_nonpositive_f(a > 0 ? 0.0f : a);
                out[t] = a > 0 ? a + 1.0f : e;
            }
        }
    }
    FASTATTN_TARGETS static void fastattn_feature_map_d(const double *x, long n, double *out, int relu) {
        if (relu) {
            #pragma omp simd
            for (long t = 0; t < n; t++) out[t] = x[t] <= 0 ? 0.0 : x[t];
        } else {
            #pragma omp simd
            for (long t = 0; t < n; t++) {
                double a = x[t], e = fastattn_exp_nonpositive_d(a > 0 ? 0.0 : a);
                out[t] = a > 0 ? a + 1.0 : e;
            }
        }
    }
    """
    float expf(float) nogil
    double exp(double) nogil
    const int FASTATTN_VECTOR_EXP
    const int FASTATTN_CLONES
    float fastattn_row_max_f(const float *s, int n) nogil
    double fastattn_row_max_d(const double *s, int n) nogil
    float fastattn_exp_sum_f(float *s, int n, float shift) nogil
    double fastattn_exp_sum_d(double *s, int n, double shift) nogil
    int fastattn_all_finite_f(const float *x, long n) nogil
    int fastattn_all_finite_d(const double *x, long n) nogil
    void fastattn_feature_map_f(const float *x, long n, float *out, int relu) nogil
    void fastattn_feature_map_d(const double *x, long n, double *out, int relu) nogil


cdef inline floating row_scale(floating den) noexcept nogil:
    """Linear attention's row scale ``1 / den``: 0 where ``den`` is exactly 0 (relu with
    ``eps = 0``: the row becomes ``row * 0``), NaN where it overflowed (the row NaN, never a
    finite ``row / inf`` that looks like an answer: a float32 call is then made again in
    float64), as the reference's ``_normalise``."""
    return 0 if den == 0 else (<floating> NAN if isinf(den) else 1 / den)


cdef inline floating fexp(floating x) noexcept nogil:
    """``exp`` in the precision of ``x`` (expf for float32)."""
    if floating is float:
        return expf(x)
    else:
        return exp(x)


cdef inline floating row_max(const floating *s, int n) noexcept nogil:
    """``max(s[0:n])`` (vectorised), ``-inf`` when ``n == 0``."""
    if floating is float:
        return fastattn_row_max_f(s, n)
    else:
        return fastattn_row_max_d(s, n)


cdef inline floating exp_sum(floating *s, int n, floating shift) noexcept nogil:
    """``s[j] = exp(s[j] - shift)`` in place (vector exp); returns ``Σ s[j]``."""
    if floating is float:
        return fastattn_exp_sum_f(s, n, shift)
    else:
        return fastattn_exp_sum_d(s, n, shift)


cdef inline bint all_finite(const floating *x, Py_ssize_t n) noexcept nogil:
    """Whether ``x[0:n]`` holds no inf and no NaN (vectorised)."""
    if floating is float:
        return fastattn_all_finite_f(x, n)
    else:
        return fastattn_all_finite_d(x, n)


cdef inline void feature_map(const floating *x, Py_ssize_t n, floating *out,
                             bint relu) noexcept nogil:
    """``out = φ(x)``: ``max(x, 0)`` (relu) or ``elu(x) + 1`` (vector exp); NaN stays NaN."""
    if floating is float:
        fastattn_feature_map_f(x, n, out, relu)
    else:
        fastattn_feature_map_d(x, n, out, relu)
