"""Hostile inputs (issue 33): every promise holds on every path and every backend.

Each test here failed before its fix; the issue's item is named in the test.
"""

import fractions
import math

import numpy as np
import pytest

import fastattn
from conftest import make_qkv

Q, K, V = make_qkv((2, 4, 3), n_k=5, d_v=6, dtype=np.float32)


# ---------------------------------------------------------------------------
# 15. A huge Python int as a scalar is a ValueError naming it, never an OverflowError.
# ---------------------------------------------------------------------------

def _cache_attend(backend, **kwargs):
    cache = fastattn.KVCache((2,), capacity=8, d_k=3, d_v=6)
    cache.append(K, V)
    return cache.attend(Q[:, :1], backend=backend, **kwargs)


SCALAR_CALLS = {
    # id: (argument, call taking the value and the backend)
    "softmax_attention-scale": ("scale", lambda x, b: fastattn.softmax_attention(
        Q, K, V, scale=x, backend=b)),
    "linear_attention-eps": ("eps", lambda x, b: fastattn.linear_attention(
        Q, K, V, eps=x, backend=b)),
    "linear_attention-favor-eps": ("eps", lambda x, b: fastattn.linear_attention(
        Q, K, V, feature_map="favor", eps=x, backend=b)),
    "attention_weights-scale": ("scale", lambda x, b: fastattn.attention_weights(Q, K, scale=x)),
    "attention_weights-eps": ("eps", lambda x, b: fastattn.attention_weights(
        Q, K, kind="linear", eps=x)),
    "attention_weights-softmax-eps": ("eps", lambda x, b: fastattn.attention_weights(Q, K, eps=x)),
    "KVCache.attend-scale": ("scale", lambda x, b: _cache_attend(b, scale=x)),
    "LinearAttentionState-eps": ("eps", lambda x, b: fastattn.LinearAttentionState(
        (2,), 3, 6, eps=x)),
}

HUGE = {"10**400": 10**400, "-10**400": -10**400, "10**5000": 10**5000,
        "Fraction(10**400)": fractions.Fraction(10**400, 3)}


@pytest.mark.parametrize("value", HUGE.values(), ids=HUGE)
@pytest.mark.parametrize("call", SCALAR_CALLS)
def test_a_huge_int_scalar_is_a_value_error_naming_it(backend, call, value):
    name, fn = SCALAR_CALLS[call]
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number") as info:
        fn(value, backend)
    message = str(info.value)
    assert len(message) < 200, message       # not 401 digits
    if isinstance(value, int):
        assert f"an int of about {'-' if value < 0 else ''}10**" in message


def test_a_large_int_that_is_a_float_is_still_a_scale(backend):
    """10**300 is a finite float64 (and refused as inf in float32, naming float32)."""
    q, k, v = (x.astype(np.float64) for x in (Q, K, V))
    out = fastattn.softmax_attention(q * 1e-300, k, v, scale=10**300, backend=backend)
    np.testing.assert_allclose(out, fastattn.softmax_attention(q, k, v, scale=1.0,
                                                               backend=backend), rtol=1e-9)
    with pytest.raises(ValueError, match="scale must be finite in the computation dtype float32"):
        fastattn.softmax_attention(Q, K, V, scale=10**300, backend=backend)


DIM_CALLS = {
    "KVCache-capacity": ("capacity", lambda x: fastattn.KVCache((2,), capacity=x, d_k=3)),
    "KVCache-d_k": ("d_k", lambda x: fastattn.KVCache((2,), capacity=4, d_k=x)),
    "KVCache-d_v": ("d_v", lambda x: fastattn.KVCache((2,), capacity=4, d_k=3, d_v=x)),
    "KVCache-batch_shape": ("every entry of batch_shape",
                            lambda x: fastattn.KVCache((2, x), capacity=4, d_k=3)),
    "LinearAttentionState-d_k": ("d_k", lambda x: fastattn.LinearAttentionState((2,), x)),
    "LinearAttentionState-d_v": ("d_v", lambda x: fastattn.LinearAttentionState((2,), 3, x)),
    "LinearAttentionState-batch_shape": ("every entry of batch_shape",
                                         lambda x: fastattn.LinearAttentionState((x,), 3)),
    "FavorFeatures-d_k": ("d_k", lambda x: fastattn.FavorFeatures(x)),
    "FavorFeatures-num_features": ("num_features",
                                   lambda x: fastattn.FavorFeatures(3, num_features=x)),
}


@pytest.mark.parametrize("value", [10**400, 10**5000, 2**63], ids=["10**400", "10**5000", "2**63"])
@pytest.mark.parametrize("call", DIM_CALLS)
def test_a_huge_int_size_is_a_value_error_naming_it(call, value):
    """A size beyond any array dimension: a ValueError naming it (it was an OverflowError
    from the memory check's message, or from the default number of FAVOR+ features)."""
    name, fn = DIM_CALLS[call]
    with pytest.raises(ValueError, match=rf"^{name} must be a") as info:
        fn(value)
    assert len(str(info.value)) < 200, str(info.value)


def test_a_size_beyond_the_float_range_is_a_memory_error_with_its_bytes():
    """Dims each an array dimension whose product is beyond float64: the memory check says
    so in e-notation (its message used to raise OverflowError)."""
    with pytest.raises(MemoryError, match=r"needs \d\.\d+e\+3\d\d bytes \(\d\.\d+e\+3\d\d GiB\)"):
        fastattn.KVCache((2**62,) * 17, capacity=4, d_k=3)


# ---------------------------------------------------------------------------
# 16. A callable feature map: a masked result is refused alike on every backend, and the
#     map never changes the caller's q or k.
# ---------------------------------------------------------------------------

def _masked_features(x):
    return np.ma.masked_array(np.abs(x), mask=x > 1)


def _linear_call(kind, backend, feature_map, q=Q, k=K, v=V):
    if kind == "linear":
        return fastattn.linear_attention(q, k, v, feature_map=feature_map, backend=backend)
    if kind == "causal":
        return fastattn.linear_attention(q, k, v, feature_map=feature_map, causal=True,
                                         backend=backend)
    if kind == "weights":
        return fastattn.attention_weights(q, k, kind="linear", feature_map=feature_map)
    state = fastattn.LinearAttentionState(q.shape[:-2], q.shape[-1], v.shape[-1],
                                          feature_map=feature_map)
    return state.step(q[..., :1, :], k[..., :1, :], v[..., :1, :], backend=backend)


LINEAR_KINDS = ["linear", "causal", "weights", "state-step"]


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_a_callable_returning_a_masked_array_is_refused_naming_feature_map(backend, kind):
    """It computed on Cython (the mask ignored), raised NumbaTypeError on Numba and a
    broadcasting ValueError on the reference."""
    with pytest.raises(TypeError, match=r"^feature_map\(q\) must return a plain numpy.ndarray, "
                                        r"got a numpy.ma.MaskedArray"):
        _linear_call(kind, backend, _masked_features)


def _in_place_relu(x):
    np.maximum(x, 0, out=x)
    return x


def _sneaky_in_place(x):
    x.flags.writeable = True    # a view of a writeable array could be made writeable again
    x[...] = np.abs(x)
    return x


@pytest.mark.parametrize("fn", [_in_place_relu, _sneaky_in_place], ids=["out=x", "writeable"])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_a_callable_cannot_change_the_callers_q_and_k(backend, kind, order, fn):
    """The map received a writeable view of a C-contiguous q (so an in-place map changed
    the user's array) but a copy of a Fortran-ordered one: it now gets a read-only view
    whatever the layout, and writing into it is refused alike."""
    q, k = np.array(Q, order=order), np.array(K, order=order)
    q0, k0 = q.copy(), k.copy()
    with pytest.raises(ValueError, match=r"read-only|WRITEABLE"):
        _linear_call(kind, backend, fn, q, k)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)


def test_a_map_that_writes_into_its_input_is_told_so():
    with pytest.raises(ValueError, match=r"^feature_map\(q\) wrote into its input, which is "
                                        r"read-only .* return new features"):
        fastattn.linear_attention(Q, K, V, feature_map=_in_place_relu)


def test_a_callable_may_return_its_input_or_a_view_of_it(backend):
    """Returning the (read-only) input itself is fine: the features are copied."""
    q, k = np.abs(Q), np.abs(K)
    out = fastattn.linear_attention(q, k, V, feature_map=lambda x: x, backend=backend)
    want = fastattn.linear_attention(q, k, V, feature_map="relu", backend=backend)
    np.testing.assert_allclose(out, want, rtol=1e-5)


# ---------------------------------------------------------------------------
# 10. The reference's memory checks cover what it allocates, and come before the work.
# ---------------------------------------------------------------------------

import tracemalloc  # noqa: E402

from fastattn import reference  # noqa: E402


def _checked_and_peak(monkeypatch, prefix, fn):
    """``(bytes the first check whose message starts with prefix asked for, tracemalloc peak)``."""
    asked = []
    check = reference.check_fits_in_memory

    def spy(nbytes, what, advice=None):
        if what.startswith(prefix):
            asked.append(nbytes)
        return check(nbytes, what, advice)

    monkeypatch.setattr(reference, "check_fits_in_memory", spy)
    fn()   # warm: FAVOR+'s projections, scipy's import
    asked.clear()
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert asked, f"no memory check named {prefix!r}"
    return asked[0], peak


WEIGHT_CASES = ["softmax", "elu", "relu", "favor", "taylor"]


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("fmap", WEIGHT_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_attention_weights_estimate_covers_its_measured_peak(monkeypatch, fmap, causal, dtype):
    """linear, FAVOR+, causal peaked at 17.7 bytes per n² element against an estimate of
    10: the weights were normalised through three more n x n arrays."""
    q, k, _ = make_qkv((2, 384, 16), n_k=320, dtype=dtype, seed=1)
    kwargs = {} if fmap == "softmax" else {"kind": "linear", "feature_map": fmap}
    asked, peak = _checked_and_peak(monkeypatch, "attention_weights", lambda: (
        fastattn.attention_weights(q, k, causal=causal, **kwargs)))
    assert peak <= asked, f"peak {peak:,} bytes, estimate {asked:,}"
    assert asked <= 1.5 * peak, f"estimate {asked:,} bytes, far above the peak {peak:,}"


@pytest.mark.parametrize("fmap", ["elu", "relu", "favor", "taylor"])
def test_causal_linear_reference_estimate_covers_its_measured_peak(monkeypatch, fmap):
    """Its features (Taylor's are D = 2,145 a row at d_k = 64) count too."""
    q, k, v = make_qkv((1, 256, 32), dtype=np.float32, seed=2)
    asked, peak = _checked_and_peak(monkeypatch, "the reference causal linear", lambda: (
        fastattn.linear_attention(q, k, v, feature_map=fmap, causal=True, backend="reference")))
    assert peak <= asked, f"peak {peak:,} bytes, estimate {asked:,}"
    assert asked <= 2.5 * peak, f"estimate {asked:,} bytes, far above the peak {peak:,}"


@pytest.mark.parametrize("fmap", ["taylor", "favor"])
def test_causal_linear_reference_refuses_before_forming_the_features(monkeypatch, fmap):
    """q (100000, 64) with Taylor formed 3.2 GiB of features in 23 s before its
    MemoryError (elu refused at once): here the features fit and the n x n arrays do not."""
    q, k, v = make_qkv((2048, 8), dtype=np.float32, seed=3)
    D = fastattn.feature_maps.feature_dim(fmap, 8)
    features = 2 * 2048 * D * 4
    available = 4 * features
    assert 2048 * 2048 * 4 > 2 * available          # one n x n array does not fit
    monkeypatch.setattr(reference, "available_memory", lambda: available)
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError, match=r"the reference causal linear attention, for its "
                                              r"n_q x n_k intermediates and its features"):
            fastattn.linear_attention(q, k, v, feature_map=fmap, causal=True, backend="reference")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < features / 4, f"allocated {peak:,} bytes (features {features:,}) before refusing"


# ---------------------------------------------------------------------------
# 8. A float32 linear attention whose numerator overflows is computed in float64 and
#    rounded: every backend gives the float64 answer, never inf or NaN for a finite one.
# ---------------------------------------------------------------------------

from conftest import assert_close  # noqa: E402


def _issue8_inputs(case):
    if case == "random":
        rng = np.random.default_rng(8)
        q = 1e15 * rng.standard_normal((2, 50, 16))
        k = rng.standard_normal((2, 53, 16))
        v = 1e30 * rng.standard_normal((2, 53, 16))
    else:
        q, k, v = np.full((1, 5, 4), 1e15), np.ones((1, 5, 4)), np.full((1, 5, 4), 1e30)
    return tuple(x.astype(np.float32) for x in (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor", "callable"])
@pytest.mark.parametrize("case", ["random", "ones"])
def test_a_float32_numerator_that_overflows_gives_the_float64_answer(backend, case,
                                                                      feature_map, causal):
    """Reference and Cython gave inf, Numba NaN and inf; float64 gives finite values up
    to 1.37e30 (1e30 for the ones)."""
    q, k, v = _issue8_inputs(case)
    fmap = (lambda x: np.abs(x) + 1) if feature_map == "callable" else feature_map
    out, (S, z) = fastattn.linear_attention(q, k, v, feature_map=fmap, causal=causal,
                                            return_state=True, backend=backend)
    want, (S64, z64) = fastattn.linear_attention(
        *(x.astype(np.float64) for x in (q, k, v)), feature_map=fmap, causal=causal,
        return_state=True, backend="reference")
    assert np.isfinite(want).all() and out.dtype == np.float32
    top = float(np.abs(want).max())
    assert_close(out / np.float32(top), want / top, dtype=np.float32)   # relative to the largest
    if case == "ones" and feature_map != "taylor":
        np.testing.assert_allclose(out, 1e30, rtol=1e-5)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(S, S64.astype(np.float32), rtol=1e-4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the reference forms 0 · inf
def test_the_float64_recomputation_keeps_a_given_nan_or_inf(backend):
    """Non-finite inputs are taken as given (no float64 call): the rows that see them."""
    q, k, v = _issue8_inputs("ones")
    v[0, 2, 1] = np.inf
    out = fastattn.linear_attention(q, k, v, causal=True, backend=backend)
    assert np.isfinite(out[0, :2]).all() and not np.isfinite(out[0, 2:, 1]).any()


def test_the_chained_float32_state_after_an_overflow_equals_one_pass(backend):
    q, k, v = _issue8_inputs("random")
    whole = fastattn.linear_attention(q, k, v, causal=True, backend=backend)
    first, state = fastattn.linear_attention(q[:, :20], k[:, :23], v[:, :23], causal=True,
                                             return_state=True, backend=backend)
    rest = fastattn.linear_attention(q[:, 20:], k[:, 23:], v[:, 23:], causal=True,
                                     initial_state=state, backend=backend)
    top = np.float32(np.abs(whole).max())
    assert_close(np.concatenate([first, rest], axis=1) / top, whole / top, dtype=np.float32)


# ---------------------------------------------------------------------------
# Products φ(k)ᵀ v below float32's range: computed in float64, never silently lost.

def _issue9_inputs():
    rng = np.random.default_rng(9)
    q = 1e30 * np.abs(rng.standard_normal((1, 4, 8)))
    k = 1e-30 * np.abs(rng.standard_normal((1, 6, 8)))
    v = 1e-30 * rng.standard_normal((1, 6, 8))
    return tuple(x.astype(np.float32) for x in (q, k, v))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # Taylor's q², ref.
@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("feature_map", ["relu", "elu", "taylor", "callable"])
def test_float32_products_below_the_range_give_the_float64_answer(backend, feature_map, causal):
    """Non-causal relu gave zeros on every backend (true values 5e-31 to 1e-30); causal, the
    fast kernels' last row differed from the reference's."""
    q, k, v = _issue9_inputs()
    fmap = (lambda x: np.abs(x)) if feature_map == "callable" else feature_map
    out = fastattn.linear_attention(q, k, v, feature_map=fmap, causal=causal, backend=backend)
    want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                     feature_map=fmap, causal=causal, backend="reference")
    assert out.dtype == np.float32 and np.abs(want).min() > 0
    top = float(np.abs(want).max())
    assert_close(out / np.float32(top), want / top, dtype=np.float32)


def test_elu_keys_whose_features_underflow_float32_give_the_float64_answer(backend):
    """elu(k) + 1 = exp(k) is 4e-44 at k = -100: below float32's normal numbers."""
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((1, 7, 4)).astype(np.float32) for _ in range(3))
    k -= 100
    out = fastattn.linear_attention(q, k, v, causal=True, eps=0.0, backend=backend)
    want = fastattn.linear_attention(q.astype(np.float64), k.astype(np.float64),
                                     v.astype(np.float64), causal=True, eps=0.0,
                                     backend="reference")
    assert_close(out, want, dtype=np.float32)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor", "favor"])
def test_ordinary_float32_inputs_are_not_computed_again(monkeypatch, feature_map):
    """The check costs a pass over k and v; ordinary inputs (here of scale 1e-9 to 1e3)
    never take the float64 path."""
    from fastattn import feature_maps

    def refuse(*args):
        raise AssertionError("computed again in float64")
    monkeypatch.setattr(feature_maps.FeatureMap, "_forward_wide", refuse)
    rng = np.random.default_rng(11)
    for scale in (1e-9, 1.0, 1e3 if feature_map != "taylor" else 10.0):
        q, k, v = (scale * rng.standard_normal((2, 300, 16)).astype(np.float32)
                   for _ in range(3))
        for causal in (False, True):
            fastattn.linear_attention(q, k, v, feature_map=feature_map, causal=causal)


# ---------------------------------------------------------------------------
# Softmax whose finite answer passes beyond the dtype's range on the way.

@pytest.mark.parametrize("dtype, n_k, value", [(np.float32, 1024, 1e36), (np.float64, 1000, 1e306)])
def test_softmax_of_values_near_the_dtype_limit_is_their_average(backend, dtype, n_k, value):
    """The unnormalised sum of 1,024 values of 1e36 is 1e39 (inf in float32); the answer, a
    weighted average of the values, is 1e36.  The fast backends gave inf."""
    q = np.zeros((1, 2, 16), dtype)
    k = np.zeros((1, n_k, 16), dtype)
    v = np.full((1, n_k, 4), value, dtype)
    for causal in (False, True):
        out = fastattn.softmax_attention(q, k, v, causal=causal, backend=backend)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, value, rtol=1e-5)


def test_a_kv_cache_of_values_near_the_float32_limit_attends_to_their_average():
    cache = fastattn.KVCache((), 64, 16, 4)
    cache.append(np.zeros((64, 16), np.float32), np.full((64, 4), 1e38, np.float32))
    for backend in fastattn.available_backends():
        np.testing.assert_allclose(cache.attend(np.zeros((1, 16), np.float32), backend=backend),
                                   1e38, rtol=1e-5)


def test_softmax_whose_q_k_overflows_before_a_small_scale_gives_the_float64_answer(backend):
    """q, k of 1e30 and scale 1e-59 (0 in float32): logits of at most 78.  Cython gave
    finite numbers of scale 0 (a uniform average), the reference and Numba NaN."""
    rng = np.random.default_rng(30)
    q = (rng.standard_normal((6, 8)) * 1e30).astype(np.float32)
    k = (rng.standard_normal((9, 8)) * 1e30).astype(np.float32)
    v = rng.standard_normal((9, 3)).astype(np.float32)
    want = fastattn.softmax_attention(*(x.astype(np.float64) for x in (q, k, v)), scale=1e-59,
                                      backend="reference")
    out = fastattn.softmax_attention(q, k, v, scale=1e-59, backend=backend)
    assert_close(out, want, dtype=np.float32)
    weights = fastattn.attention_weights(q, k, scale=1e-59)
    assert_close(weights @ v.astype(np.float64), want, dtype=np.float32)


def test_a_nan_given_to_softmax_reaches_only_what_it_reaches(backend):
    rng = np.random.default_rng(31)
    q, k, v = (rng.standard_normal((1, 5, 4)).astype(np.float32) for _ in range(3))
    v[0, 3, 1] = np.nan
    out = fastattn.softmax_attention(q, k, v, backend=backend)
    assert np.isnan(out[0, :, 1]).all() and np.isfinite(out[0, :, [0, 2, 3]]).all()


def test_a_float64_state_keeps_float32_tokens_beyond_float32s_range(backend):
    """Keys and values of 1e25 (products of 1e50) overflowed the float64 state from the
    second step: the step ran in float32, the tokens' dtype."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((6, 4)).astype(np.float32)
    for scale, fmap in ((1e25, "elu"), (1e-30, "relu")):
        k = (np.abs(rng.standard_normal((6, 4))) * scale).astype(np.float32)
        v = (rng.standard_normal((6, 3)) * scale).astype(np.float32)
        state = fastattn.LinearAttentionState((), d_k=4, d_v=3, feature_map=fmap, eps=0.0,
                                              dtype=np.float64)
        steps = np.concatenate([state.step(q[i:i + 1], k[i:i + 1], v[i:i + 1], backend=backend)
                                for i in range(6)])
        want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                         feature_map=fmap, eps=0.0, causal=True,
                                         backend="reference")
        assert steps.dtype == np.float32 and np.isfinite(state.S).all()
        assert_close(steps / np.float32(scale), want / scale, dtype=np.float32)


def test_a_float64_initial_state_beyond_float32_is_refused_in_a_float32_call():
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) holds 1e\+39, which is inf "
                                         r"in the computation dtype float32"):
        fastattn.linear_attention(x, x, x, causal=True,
                                  initial_state=(np.full((4, 4), 1e39), np.full(4, 1.0)))
    # Within float32's range it is used, cast.
    out = fastattn.linear_attention(x, x, x, causal=True,
                                    initial_state=(np.full((4, 4), 1e30), np.full(4, 1e30)))
    assert np.isfinite(out).all()


@pytest.mark.parametrize("small", [True, False], ids=["elementwise", "by-sum"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_output_is_taken_as_finite_only_when_every_element_is(dtype, small, monkeypatch):
    # One pass (a sum, beyond a small output) decides whether a call is made again: any NaN
    # or inf must say no; finite elements say yes unless their sum overflows (then the call
    # is only repeated).
    from fastattn import _overflow
    from fastattn._overflow import output_finite

    if not small:
        monkeypatch.setattr(_overflow, "_SMALL_OUTPUT", 0)
    out = np.random.default_rng(0).standard_normal((3, 257, 64)).astype(dtype)
    assert output_finite(out)
    for bad in (np.nan, np.inf, -np.inf):
        for where in ((0, 0, 0), (2, 256, 63), (1, 100, 7)):
            broken = out.copy()
            broken[where] = bad
            assert not output_finite(broken)
    both = out.copy()
    both[0, 0, 0], both[0, 0, 1] = np.inf, -np.inf          # inf - inf in the sum: NaN
    assert not output_finite(both)
    huge = np.full((4, 8), np.finfo(dtype).max / 2, dtype=dtype)
    assert output_finite(huge) == small                       # finite, but its sum is not
    assert output_finite(np.empty((0, 3), dtype=dtype))


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_finite_outputs_whose_sum_overflows_keep_their_answer(backend, attention, monkeypatch):
    # Values near float32's largest make every output element finite but their sum inf:
    # the call is made again (wider) and must give the same float64 answer.
    from fastattn import _overflow

    # The check by the sum (Cython's linear calls check exactly: its own output_finite).
    monkeypatch.setattr(_overflow, "_SMALL_OUTPUT", 0)
    q, k = make_qkv((2, 96, 16), dtype=np.float32)[:2]
    v = np.float32(1e37) * (1 + np.abs(make_qkv((2, 96, 16), dtype=np.float32)[2]))
    call = getattr(fastattn, f"{attention}_attention")
    out = call(q, k, v, backend=backend)
    want = call(*(x.astype(np.float64) for x in (q, k, v)), backend="reference")
    assert np.isfinite(out).all() and out.sum(dtype=np.float64) > np.finfo(np.float32).max
    assert_close(out / np.float32(1e37), want / 1e37, dtype=np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [0.125, 0.5, 2.0**-20, 2.0**-149, 1 / math.sqrt(32), 1e-59])
def test_the_scaled_query_is_the_float64_product_rounded_once(dtype, scale):
    # kernel_query multiplies in the dtype when it holds the scale exactly: same bits as the
    # float64 product rounded once, subnormal results included.
    from fastattn._overflow import kernel_query

    rng = np.random.default_rng(1)
    q = (rng.standard_normal(20000) * 10.0 ** rng.integers(-45, 38, 20000)).astype(dtype)
    got, rest = kernel_query(q, scale)
    want = (q.astype(np.float64) * scale).astype(dtype)
    assert rest == 1.0 and got.dtype == dtype
    np.testing.assert_array_equal(got.view(f"u{q.itemsize}"), want.view(f"u{q.itemsize}"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [1e19, 1e30])
def test_favor_keys_whose_norms_overflow_float32_keep_their_answer(backend, size, causal):
    # ‖k‖² of every key beyond float32's range made every FAVOR+ key exponent -inf and the
    # answer 0 and finite on every backend (nothing showed): float64 holds the norms, and
    # its answer, rounded, is the float32 one.  (Causal rows were right by the exact
    # causal recomputation.)  q of the same size: its norms are never formed.
    q, k, v = make_qkv((2, 16, 8), dtype=np.float32, seed=0)
    q, k = q * np.float32(size), np.float32(size) * (1 + np.float32(0.01) * k)
    out = fastattn.linear_attention(q, k, v, feature_map="favor", causal=causal,
                                    backend=backend)
    want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                     feature_map="favor", causal=causal, backend="reference")
    assert out.dtype == np.float32 and np.abs(want).max() > 0.5
    assert_close(out, want, dtype=np.float32)
    weights = fastattn.attention_weights(q, k, kind="linear", feature_map="favor",
                                         causal=causal)
    want = fastattn.attention_weights(q.astype(np.float64), k.astype(np.float64),
                                      kind="linear", feature_map="favor", causal=causal)
    assert weights.dtype == np.float32 and want.max() > 0.5
    assert_close(weights, want, dtype=np.float32)


@pytest.mark.parametrize("d_k", [8, 20, 66, 77])
def test_favor_keys_just_below_the_overflow_bound_stay_in_float32_and_right(backend, d_k):
    # Every key at the largest float32 below the bound: the float32 sum of d_k squares
    # rounds upward, so the bound leaves a factor 2 (at sqrt(3.4e38 / d_k) the sums
    # overflowed for d_k = 20, 66 and 77 and the answer came out 0).
    from fastattn.feature_maps import Favor

    limit = math.sqrt(np.finfo(np.float32).max / (2 * d_k))
    top = np.nextafter(np.float32(limit), np.float32(0))
    q, _, v = make_qkv((1, 12, d_k), dtype=np.float32, seed=1)
    k = np.full((1, 12, d_k), top, np.float32)   # every key's norm at the edge
    assert not Favor().features_may_overflow(q, k)
    out = fastattn.linear_attention(q, k, v, feature_map="favor", backend=backend)
    want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                     feature_map="favor", backend="reference")
    assert np.abs(want).max() > 0.1
    assert_close(out, want, dtype=np.float32)


def test_favor_goes_to_float64_only_where_a_float32_key_norm_may_overflow():
    from fastattn.feature_maps import Favor

    d_k = 8
    limit = math.sqrt(np.finfo(np.float32).max / (2 * d_k))
    x = np.ones((1, 4, d_k), np.float32)
    for top, wide in ((1e3, False), (limit / 2, False), (limit * 1.01, True), (np.inf, True),
                      (-np.inf, True), (np.nan, False), (-limit * 1.01, True)):
        k = x.copy()
        k[0, 2, 3] = top
        assert Favor().features_may_overflow(x, k) is wide, top
        assert Favor().features_may_overflow(k, x) is False, top    # q's norms: never formed
    assert Favor().features_may_overflow(x[:, :0], x[:, :0]) is False

@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("which", ["q", "k"])
def test_a_broadcast_input_too_large_to_copy_is_refused_by_name(attention, which):
    # A 0-stride view of 2**40 rows costs nothing to pass, but the kernels copy it: the
    # refusal names the argument (it came from inside NumPy's asarray, naming none).
    small = np.ones((1, 1, 8), np.float32)
    huge = np.broadcast_to(np.float32(1), (1, 2**40, 8))
    q, k, v = (huge, small, small) if which == "q" else (small, huge, huge)
    call = getattr(fastattn, f"{attention}_attention")
    with pytest.raises(MemoryError, match=f"copy of {which} .* pass a smaller {which}:"):
        call(q, k, v)
    # Batch dims that do not merge into one: the reshape would copy first.
    small4 = np.ones((2, 3, 1, 8), np.float32)
    huge4 = np.broadcast_to(np.ones((2, 1, 1, 8), np.float32), (2, 3, 2**38, 8))
    q, k, v = (huge4, small4, small4) if which == "q" else (small4, huge4, huge4)
    with pytest.raises(MemoryError, match=f"copy of {which} .* pass a smaller {which}:"):
        call(q, k, v)
