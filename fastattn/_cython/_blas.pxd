# Row-major GEMM over scipy.linalg.cython_blas: the one BLAS the kernels use.
from cython cimport floating


cdef void gemm(bint trans_a, bint trans_b, int m, int n, int k,
               floating alpha, const floating *a, int lda,
               const floating *b, int ldb,
               floating beta, floating *c, int ldc) noexcept nogil
