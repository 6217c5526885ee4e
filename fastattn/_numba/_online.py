"""The online-softmax update of a block of scores, shared by the prefill and decode kernels.

Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018).

The softmax and decode kernels' disk caches do not see an edit of this module: see
:mod:`fastattn._numba.config`.
"""

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .config import JIT_SERIAL, wide_vectors
from ._exp import fast_exp_nonpositive

_WIDTH = {types.float32: 32, types.float64: 64}
_INT = {32: types.int32, 64: types.int64}


def _flip(builder, bits, width):
    """``bits`` with its low ``width - 1`` bits flipped where the sign bit is set."""
    sign = builder.ashr(bits, ir.Constant(bits.type, width - 1))
    return builder.xor(bits, builder.and_(sign, ir.Constant(bits.type, (1 << (width - 1)) - 1)))


@intrinsic
def _order_key(typingctx, x):
    """A float32 (float64) as an int32 (int64) in the same order: its bits, with the bits
    after the sign flipped when the sign is set.  -inf < finite < inf < a NaN without its
    sign bit; a NaN with it comes below -inf.  The maximum of the keys is an integer
    reduction LLVM vectorises, where a float ``max`` that must keep NaN semantics stays scalar
    (measured: a 256 x 256 float32 tile's max, exp and sum at 0.41 against 0.85 ns a
    score)."""
    if x not in _WIDTH:
        return None
    width = _WIDTH[x]

    def codegen(context, builder, signature, args):
        return _flip(builder, builder.bitcast(args[0], ir.IntType(width)), width)

    return _INT[width](x), codegen


@intrinsic
def _from_order_key(typingctx, key, like):
    """The float of type ``like`` whose :func:`_order_key` is ``key``."""
    if like not in _WIDTH or key != _INT[_WIDTH[like]]:
        return None
    width = _WIDTH[like]

    def codegen(context, builder, signature, args):
        lltype = ir.FloatType() if width == 32 else ir.DoubleType()
        return builder.bitcast(_flip(builder, args[0], width), lltype)

    return like(key, like), codegen


@njit(**JIT_SERIAL)
def online_softmax_block(s, rows, cols, first_lim, crosses, scale, m, l, alpha, neg_inf, zero):
    """Fold a key block's scores ``s (rows, cols)`` into the running state of its rows.

    Row ``i`` sees the block's first ``lim = min(cols, first_lim + i)`` keys where the
    causal diagonal ``crosses`` the block, else all ``cols``.  ``s[i, :lim]`` becomes
    ``p = exp(scale s - m_new)`` (the rest 0); ``m[i]`` (the running maximum of the logits
    ``scale s``) and ``l[i]`` (the running sum of ``p``) are updated and ``alpha[i] =
    exp(m_old - m_new)`` is left for the caller to rescale its accumulator by, before
    adding ``p v``.  A row that sees no key of the block (``lim <= 0``) keeps its state
    (``alpha = 1``, ``p = 0``).

    One call a block, not a row: a call passes its four arrays with a reference count
    taken and dropped, atomic instructions that took 3 % of a prefill call when made for
    every row.
    """
    wide_vectors()
    for i in range(rows):
        lim = min(cols, first_lim + i) if crosses else cols
        if lim <= 0:
            alpha[i] = 1
            for j in range(cols):
                s[i, j] = zero
            continue
        # The logits, rounded once and stored: the largest then shifts to
        # exactly 0 (an FMA of s * scale - max would keep the product's rounding
        # error, which at |logit| ~ 1e300 is not small).
        # Their maximum by order keys (vectorised): a NaN logit (with no sign bit) becomes the
        # maximum, and the row NaN, as through its p.
        key = _order_key(m[i])
        if scale == 1:      # the scores are the logits (a scale below 1 scaled q): read only
            for j in range(lim):
                key = max(key, _order_key(s[i, j]))
        else:
            for j in range(lim):
                x = s[i, j] * scale
                s[i, j] = x
                key = max(key, _order_key(x))
        mx = _from_order_key(key, zero)
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
