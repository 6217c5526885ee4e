"""Row-major GEMM over ``scipy.linalg.cython_blas`` (the BLAS SciPy ships).

The kernels keep their blocks in C (row-major) order; BLAS is column-major.
A row-major ``m x n`` matrix is the column-major ``n x m`` matrix of its
transpose, so ``C = op(A) op(B)`` in row-major order is computed as the
column-major ``Cᵀ = op(B)ᵀ op(A)ᵀ``: the operands swap and keep their flags.
"""

from cython cimport floating
from scipy.linalg.cython_blas cimport dgemm, sgemm


cdef void gemm(bint trans_a, bint trans_b, int m, int n, int k,
               floating alpha, const floating *a, int lda,
               const floating *b, int ldb,
               floating beta, floating *c, int ldc) noexcept nogil:
    """``C = alpha · op(A) op(B) + beta · C`` for row-major buffers.

    ``op(A)`` is ``m x k`` (``A`` is ``k x m`` when ``trans_a``), ``op(B)`` is
    ``k x n``, ``C`` is ``m x n``; ``lda``, ``ldb``, ``ldc`` are the row
    strides in elements.  The inputs are only read (BLAS takes them as
    non-const pointers, hence the casts).
    """
    cdef char ta = b'T' if trans_a else b'N'
    cdef char tb = b'T' if trans_b else b'N'
    if floating is float:
        sgemm(&tb, &ta, &n, &m, &k, &alpha, <float *> b, &ldb,
              <float *> a, &lda, &beta, c, &ldc)
    else:
        dgemm(&tb, &ta, &n, &m, &k, &alpha, <double *> b, &ldb,
              <double *> a, &lda, &beta, c, &ldc)
