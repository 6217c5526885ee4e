"""Vectorisable ``exp`` for the Numba kernels.

Numba's ``math.exp`` / ``np.exp`` call the scalar libm ``exp`` (the llvmlite
wheels ship no SVML), about 0.2-0.3 G elements/s; LLVM cannot vectorise a
loop around it.  :func:`fast_exp` is written in arithmetic LLVM vectorises:

    exp(x) = 2**n * exp(r),  n = round(x / ln 2),  r = x - n ln 2,  |r| <= ln(2)/2

with ``ln 2`` split in a high and a low part (Cody-Waite) so ``r`` is nearly
exact, ``exp(r)`` a polynomial (degree 7 in float32, Taylor degree 13 in
float64: about 1 ulp), and ``2**n`` built from exponent bits as the product
of two powers of two (so neither overflows nor goes subnormal).  Special
values follow IEEE: ``exp(-inf) = 0``, ``exp(+inf) = inf``, ``exp(nan) = nan``;
above the largest finite result it is ``inf``.

Measured here (float32, 1 thread, loaded machine): ``fast_exp`` 1.5 and
``fast_exp_nonpositive`` 1.9 G elements/s against 0.2-0.5 for NumPy's exp;
float64 about 0.2 and 0.4.

The kernels' disk caches do not see an edit of this module: see
:mod:`fastattn._numba.config`.
"""


import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .config import JIT_ELEMENTARY, JIT_SERIAL


@intrinsic
def _int_bits_as_float(typingctx, bits):
    """Reinterpret the bits of an int32 (int64) as a float32 (float64)."""
    if bits == types.int32:
        sig, lltype = types.float32(types.int32), ir.FloatType()
    elif bits == types.int64:
        sig, lltype = types.float64(types.int64), ir.DoubleType()
    else:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], lltype)

    return sig, codegen


@intrinsic
def _float_bits_as_int(typingctx, x):
    """Reinterpret the bits of a float64 as an int64."""
    if x != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


_ROUND_64 = 6755399441055744.0  # 1.5 * 2**52: adding it leaves an integer in the low mantissa bits


@njit(inline="always", **JIT_ELEMENTARY)  # inlined only into the float64 exp functions
def _expm_taylor13(r):
    """``exp(r)`` by its Taylor polynomial of degree 13, for ``|r| <= ln(2) / 2``.

    Truncation error below 1e-17 relative at ``|r| <= 0.347``.
    """
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    return p * (r * r) + r + 1.0


@njit(inline="always", **JIT_ELEMENTARY)  # inlined only into the exp functions below
def _pow2_64(n):
    """``2**n`` for an integer-valued float64 ``n`` in [-1022, 1023].

    The integer is read from the mantissa of ``n + 1.5 * 2**52`` and shifted
    into the exponent field in int64 lanes (AVX2 has no vector
    float64 -> int64 conversion, so ``int64(n)`` would not vectorise).
    """
    return _int_bits_as_float((_float_bits_as_int(n + _ROUND_64) + 1023) << 52)


f32 = np.float32
_LOG2E_32 = f32(1.4426950408889634)
_LN2_HI_32 = f32(0.693359375)  # 0x3f318000: n * _LN2_HI_32 is exact for |n| < 2**15
_LN2_LO_32 = f32(-2.12194440e-4)
_HALF_32 = f32(0.5)
_ONE_32 = f32(1.0)
_LO_32 = f32(-103.972084)  # ln(2**-150): below it the result rounds to 0
_HI_32 = f32(88.72283)  # ln(max float32)
_ZERO_32 = f32(0.0)
_BIAS_32 = f32(127.0)
_MANT_32 = f32(2.0**23)
_INF_32 = f32(np.inf)
# Minimax coefficients of (exp(r) - 1 - r) / r**2 on |r| <= ln(2)/2.
_P0 = f32(5.0000001201e-1)
_P1 = f32(1.6666665459e-1)
_P2 = f32(4.1665795894e-2)
_P3 = f32(8.3334519073e-3)
_P4 = f32(1.3981999507e-3)
_P5 = f32(1.9875691500e-4)

_NORMAL_32 = f32(-86.643397)  # ln(2**-125): below it results are flushed to 0

_LOG2E_64 = 1.4426950408889634
_LN2_HI_64 = 6.93147180369123816490e-01  # high 32 bits of ln 2: n * hi exact
_LN2_LO_64 = 1.90821492927058770002e-10
_LO_64 = -745.1332191019412  # ln(2**-1075): below it the result rounds to 0
_HI_64 = 709.782712893384  # ln(max float64)
_NORMAL_64 = -707.7032713517042  # ln(2**-1021): below it results are flushed to 0


def fast_exp(x):
    """``exp(x)`` for a float32 or float64 scalar, vectorisable in Numba kernels.

    Parameters
    ----------
    x : float32 or float64 scalar

    Returns
    -------
    float of the same type
        Within about 1 ulp of ``exp(x)`` where the result is normal (subnormal
        results lose the bits a subnormal lacks); ``inf`` above the overflow threshold;
        ``exp(-inf) == 0``, ``exp(nan)`` is nan.

    Notes
    -----
    This Python body runs only with ``NUMBA_DISABLE_JIT=1``; compiled code
    uses the overload below.
    """
    with np.errstate(over="ignore", under="ignore"):
        return type(x)(np.exp(x))


def _exp32(x):
    xc = min(max(x, _LO_32), _HI_32)
    n = np.floor(xc * _LOG2E_32 + _HALF_32)
    r = (xc - n * _LN2_HI_32) - n * _LN2_LO_32
    p = (((((_P5 * r + _P4) * r + _P3) * r + _P2) * r + _P1) * r + _P0) * (r * r) + r + _ONE_32
    # 2**n as 2**h * 2**(n - h): both factors normal for every n in range,
    # so the top of the range does not overflow and the bottom rounds once.
    # The exponent fields are built in float arithmetic and converted with one
    # float -> int32 conversion, which AVX2 vectorises (int64 would not).
    h = np.floor(n * _HALF_32)
    y = p * _int_bits_as_float(np.int32((h + _BIAS_32) * _MANT_32))
    y = y * _int_bits_as_float(np.int32((n - h + _BIAS_32) * _MANT_32))
    y = _ZERO_32 if x < _LO_32 else y
    y = _INF_32 if x > _HI_32 else y
    return x if x != x else y


def _exp64(x):
    xc = min(max(x, _LO_64), _HI_64)
    n = np.floor(xc * _LOG2E_64 + 0.5)
    r = (xc - n * _LN2_HI_64) - n * _LN2_LO_64
    p = _expm_taylor13(r)
    h = np.floor(n * 0.5)
    y = p * _pow2_64(h)
    y = y * _pow2_64(n - h)
    y = 0.0 if x < _LO_64 else y
    y = np.inf if x > _HI_64 else y
    return x if x != x else y


def fast_exp_nonpositive(x):
    """``exp(x)`` for ``x <= 0`` (as in online softmax), results below
    ``2**-125`` (float32) or ``2**-1021`` (float64) flushed to 0; ``exp(-inf) == 0``,
    nan stays nan.

    Cheaper than :func:`fast_exp` (one power of two, no overflow branch).
    Positive ``x`` is treated as 0.  This Python body runs only with
    ``NUMBA_DISABLE_JIT=1``.
    """
    if x != x:
        return x
    y = np.exp(min(x, type(x)(0)))
    return type(x)(y if y >= 4 * np.finfo(type(x)).tiny else 0)


def _exp32_nonpositive(x):
    xc = min(max(x, _NORMAL_32), _ZERO_32)
    n = np.floor(xc * _LOG2E_32 + _HALF_32)
    r = (xc - n * _LN2_HI_32) - n * _LN2_LO_32
    p = (((((_P5 * r + _P4) * r + _P3) * r + _P2) * r + _P1) * r + _P0) * (r * r) + r + _ONE_32
    y = p * _int_bits_as_float(np.int32((n + _BIAS_32) * _MANT_32))
    y = _ZERO_32 if x < _NORMAL_32 else y
    return x if x != x else y


def _exp64_nonpositive(x):
    xc = min(max(x, _NORMAL_64), 0.0)
    n = np.floor(xc * _LOG2E_64 + 0.5)
    r = (xc - n * _LN2_HI_64) - n * _LN2_LO_64
    p = _expm_taylor13(r)
    y = p * _pow2_64(n)
    y = 0.0 if x < _NORMAL_64 else y
    return x if x != x else y


# Not inlined at the Numba IR level (that would give the instructions the
# caller's flags); LLVM inlines the compiled function and keeps these flags.
_exp32_jit = njit(**JIT_ELEMENTARY)(_exp32)
_exp64_jit = njit(**JIT_ELEMENTARY)(_exp64)


@overload(fast_exp, jit_options=dict(JIT_ELEMENTARY))
def _fast_exp_overload(x):
    if x == types.float32:
        return lambda x: _exp32_jit(x)
    if x == types.float64:
        return lambda x: _exp64_jit(x)
    return None


_exp32_nonpositive_jit = njit(**JIT_ELEMENTARY)(_exp32_nonpositive)
_exp64_nonpositive_jit = njit(**JIT_ELEMENTARY)(_exp64_nonpositive)


@overload(fast_exp_nonpositive, jit_options=dict(JIT_ELEMENTARY))
def _fast_exp_nonpositive_overload(x):
    if x == types.float32:
        return lambda x: _exp32_nonpositive_jit(x)
    if x == types.float64:
        return lambda x: _exp64_nonpositive_jit(x)
    return None


@njit(**JIT_SERIAL)
def exp_nonpositive_array(x):
    """:func:`fast_exp_nonpositive` over a 1-D array (a new array); for tests."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = fast_exp_nonpositive(x[i])
    return out


@njit(**JIT_SERIAL)
def exp_array(x):
    """:func:`fast_exp` over a 1-D array (a new array); for tests and timing."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = fast_exp(x[i])
    return out
