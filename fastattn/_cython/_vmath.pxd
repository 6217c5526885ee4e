# The exponential of the kernels' inner loops, declared so that gcc may call
# glibc's vector math library (libmvec) from a vectorised loop.
#
# glibc only declares the SIMD variants of exp/expf under -ffast-math, which
# would also assume there is no inf or NaN and break the causal mask and the
# propagation of non-finite inputs.  Declaring the variants here instead lets
# the build keep IEEE semantics (-O3 -fno-math-errno) and still get
# _ZGV?N?v_expf / _ZGV?N?v_exp calls.  FASTATTN_SCALAR_EXP (a macro) turns it
# off, for measuring the gain.
from cython cimport floating

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
    """
    float expf(float) nogil
    double exp(double) nogil
    const int FASTATTN_VECTOR_EXP


cdef inline floating fexp(floating x) noexcept nogil:
    """``exp`` in the precision of ``x`` (expf for float32)."""
    if floating is float:
        return expf(x)
    else:
        return exp(x)
