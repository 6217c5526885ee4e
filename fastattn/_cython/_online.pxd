# The online-softmax update of one row (Milakov & Gimelshein 2018), shared by
# the tiled prefill kernel (softmax.pyx, _tile) and the split-key decode
# kernel (decode.pyx).
from cython cimport floating
from libc.math cimport INFINITY

from fastattn._cython._microkernel cimport exp_sum_simd, max_simd
from fastattn._cython._vmath cimport exp_sum, fexp, row_max


cdef inline void online_softmax_row(floating *srow, int w, floating *m, floating *l,
                                    floating *orow, int d_v, bint simd) noexcept nogil:
    """Fold the scores ``srow[0:w]`` (``w >= 1``) of one row into its running state.

    ``m`` and ``l`` point at the row's running maximum and sum; ``srow``
    becomes ``p = exp(s - m_new)`` in place and ``orow[0:d_v]`` (the
    unnormalised output) is rescaled by ``exp(m_old - m_new)``, ready for the
    caller to add ``p v``.  ``simd``: the maximum and the exp of the register-blocked
    microkernel, else the vectorised row kernels of :file:`_vmath.pxd`.
    """
    cdef floating mx, m_new, shift, alpha
    cdef int c
    mx = max_simd(srow, w) if simd else row_max(srow, w)
    m_new = mx if mx > m[0] else m[0]
    # All scores -inf so far: shift by 0 so exp gives 0, not NaN.
    shift = m_new if m_new != -INFINITY else 0
    alpha = fexp(m[0] - shift)
    if simd:
        l[0] = l[0] * alpha + exp_sum_simd(srow, w, shift)
    else:
        l[0] = l[0] * alpha + exp_sum(srow, w, shift)
    m[0] = m_new
    if alpha != 1:
        for c in range(d_v):
            orow[c] = orow[c] * alpha
