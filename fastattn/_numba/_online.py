"""The online-softmax update of one row of scores, shared by the prefill and decode kernels.

Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018).
"""

from numba import njit

from .config import JIT_SERIAL
from ._exp import fast_exp_nonpositive


@njit(inline="always", **JIT_SERIAL)
def online_softmax_row(s, i, lim, cols, scale, m, l, alpha, neg_inf, zero):
    """Fold row ``i`` of a key block's scores ``s (rows, cols)`` into its running state.

    The row sees the block's first ``lim`` keys.  ``s[i, :lim]`` becomes
    ``p = exp(scale s - m_new)`` (the rest 0); ``m[i]`` (the running maximum
    of the logits ``scale s``) and ``l[i]`` (the running sum of ``p``) are
    updated and ``alpha[i] = exp(m_old - m_new)`` is left for the caller to
    rescale its accumulator by, before adding ``p v``.  A row that sees no
    key of the block (``lim <= 0``) keeps its state (``alpha = 1``, ``p = 0``).
    """
    if lim <= 0:
        alpha[i] = 1
        for j in range(cols):
            s[i, j] = zero
        return
    # The logits, rounded once and stored: the largest then shifts to
    # exactly 0 (an FMA of s * scale - max would keep the product's rounding
    # error, which at |logit| ~ 1e300 is not small).
    mx = m[i]
    for j in range(lim):
        x = s[i, j] * scale
        s[i, j] = x
        mx = max(mx, x)
    # A row whose logits are all -inf so far keeps shift 0 (its p are 0).
    shift = mx if mx > neg_inf else zero
    total = zero
    for j in range(lim):
        p = fast_exp_nonpositive(s[i, j] - shift)
        s[i, j] = p
        total += p
    for j in range(lim, cols):
        s[i, j] = zero
    a = fast_exp_nonpositive(m[i] - shift)
    alpha[i] = a
    l[i] = l[i] * a + total
    m[i] = mx
