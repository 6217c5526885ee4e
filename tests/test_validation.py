"""Every refusal, with a clear error: the message names the argument and what was expected.

Validation happens once, in :mod:`fastattn._api`, before any backend runs,
so each refusal is checked for every available backend (and for an empty
input, where no kernel is called at all).
"""

import re
import tracemalloc

import numpy as np
import pytest

import fastattn
from conftest import BACKENDS, FAST_BACKENDS, make_qkv

Q, K, V = make_qkv((2, 4, 3), n_k=5, d_v=6)   # d_k = 3, d_v = 6, n_q = 4, n_k = 5


def _call(which, q=Q, k=K, v=V, **kwargs):
    if which == "softmax":
        return fastattn.softmax_attention(q, k, v, **kwargs)
    if which == "linear":
        return fastattn.linear_attention(q, k, v, **kwargs)
    return fastattn.attention_weights(q, k, **kwargs)


def _raises(exc, fn, *fragments):
    """``fn()`` raises ``exc`` whose message contains every fragment (literally)."""
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from the message: {message}"
    return message


KINDS = ["softmax", "linear", "weights"]


# ---------------------------------------------------------------------------
# Arrays: type, dtype, rank, shapes.
# ---------------------------------------------------------------------------

BAD_ARRAYS = {
    # id: (argument, replacement, exception, fragments)
    "list": ("q", Q.tolist(), TypeError, ["q must be a numpy.ndarray", "list"]),
    "none": ("k", None, TypeError, ["k must be a numpy.ndarray", "NoneType"]),
    "scalar": ("q", 1.0, TypeError, ["q must be a numpy.ndarray", "float"]),
    "int64": ("q", Q.astype(np.int64), TypeError, ["q must have dtype", "float32", "int64"]),
    "int8": ("k", K.astype(np.int8), TypeError, ["k must have dtype", "float32", "int8"]),
    "bool": ("k", K > 0, TypeError, ["k must have dtype", "float64", "bool"]),
    "complex": ("q", Q.astype(np.complex128), TypeError, ["q must have dtype", "complex128"]),
    "object": ("k", K.astype(object), TypeError, ["k must have dtype", "object"]),
    "longdouble": ("q", Q.astype(np.longdouble), TypeError, ["q must have dtype", "float16, float32 or float64"]),
    "masked": ("q", np.ma.masked_array(Q, mask=Q > 1), TypeError,
               ["q must be a plain numpy.ndarray", "MaskedArray", "mask would be ignored"]),
    "rank0": ("q", np.array(1.0), ValueError, ["q must have at least 2 dimensions", "(..., n, d)", "()"]),
    "rank1": ("k", K[0, 0], ValueError, ["k must have at least 2 dimensions", "(..., n, d)", "(3,)"]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", BAD_ARRAYS)
def test_bad_array_is_refused(backend, kind, case):
    name, bad, exc, fragments = BAD_ARRAYS[case]
    if kind == "weights" and name == "v":
        pytest.skip("attention_weights takes no v")
    kwargs = {"backend": backend} if kind != "weights" else {}
    _raises(exc, lambda: _call(kind, **{name: bad}, **kwargs), *fragments)


class _Subclass(np.ndarray):
    """An ndarray subclass: the checks' fast path takes plain arrays only."""


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shapes", [((4, 3), (5, 3), (5, 6)), ((2, 2, 1, 8), (2, 2, 7, 8),
                                                               (2, 2, 7, 2))],
                         ids=["2d", "4d"])
def test_usual_call_checks_give_what_the_full_checks_give(dtype, shapes, monkeypatch):
    """check_qkv passes three plain arrays of one float32 or float64 dtype in a few
    comparisons, and its checks for any other call (here the same arrays as a subclass, which
    takes them) return the same batch shape and dtypes; so do the scale's two ways."""
    from fastattn import _checks
    q, k, v = (np.ones(shape, dtype=dtype) for shape in shapes)
    full = _checks.check_qkv(*(x.view(_Subclass) for x in (q, k, v)))
    monkeypatch.setattr(_checks, "check_array", None)   # the fast path returns before it
    fast = _checks.check_qkv(q, k, v)
    assert fast == full == (shapes[0][:-2], np.dtype(dtype), np.dtype(dtype))
    assert _checks.check_scale(0.125, 8, np.dtype(dtype)) == \
        _checks.check_scale(np.float64(0.125), 8, np.dtype(dtype)) == 0.125


def test_a_scale_beyond_float32_takes_the_full_check():
    """1e39 is a float below float64's largest but inf in float32: refused there."""
    _raises(ValueError, lambda: _call("softmax", Q.astype(np.float32), K.astype(np.float32),
                                      V.astype(np.float32), scale=1e39),
            "scale must be finite in the computation dtype float32", "1e+39")


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_bad_value_array_is_refused(backend, kind):
    _raises(TypeError, lambda: _call(kind, v=V.astype(np.int32), backend=backend),
            "v must have dtype", "int32")
    _raises(TypeError, lambda: _call(kind, v=[[1.0]], backend=backend), "v must be a numpy.ndarray")


SHAPE_CASES = {
    # id: (q, k, v, fragments)
    "leading-dims": (Q, K[:1], V[:1], ["same leading", "q (2, 4, 3)", "k (1, 5, 3)", "v (1, 5, 6)"]),
    "rank-mismatch": (Q[0], K, V, ["same leading", "q (4, 3)", "k (2, 5, 3)"]),
    "extra-head-dim": (Q[None], K, V, ["same leading", "q (1, 2, 4, 3)"]),
    "d_k": (Q, K[..., :2], V, ["d_k", "q (2, 4, 3)", "d_k=3", "k (2, 5, 2)", "d_k=2"]),
    "n_k": (Q, K, V[:, :4], ["n_k", "k (2, 5, 3)", "n_k=5", "v (2, 4, 6)", "n_k=4"]),
    "d_k-zero": (Q[..., :0], K[..., :0], V, ["d_k must be at least 1", "(2, 4, 0)"]),
}


@pytest.mark.parametrize("kind", ["softmax", "linear"])
@pytest.mark.parametrize("case", SHAPE_CASES)
def test_shape_mismatch_names_the_shapes(backend, kind, case):
    q, k, v, fragments = SHAPE_CASES[case]
    _raises(ValueError, lambda: _call(kind, q, k, v, backend=backend), *fragments)


@pytest.mark.parametrize("case", ["leading-dims", "d_k", "d_k-zero"])
def test_attention_weights_checks_shapes_too(case):
    q, k, _, fragments = SHAPE_CASES[case]
    _raises(ValueError, lambda: fastattn.attention_weights(q, k), *fragments[:2])


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_shapes_are_checked_when_a_size_is_zero(backend, kind):
    """An empty call is answered without a kernel, but not without validation."""
    q, k, v = Q[:, :0], K[:, :0], V[:, :0]
    _raises(ValueError, lambda: _call(kind, q, k[..., :2], v, backend=backend), "d_k")
    _raises(ValueError, lambda: _call(kind, q, k, v[:1], backend=backend), "same leading")
    _raises(TypeError, lambda: _call(kind, q.astype(np.int32), k, v, backend=backend), "int32")


# ---------------------------------------------------------------------------
# Scalars and names.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1.0, 0.0, np.nan, np.inf, -np.inf], ids=str)
@pytest.mark.parametrize("kind", ["softmax", "weights"])
def test_scale_must_be_finite_and_positive(backend, kind, value):
    kwargs = {"backend": backend} if kind != "weights" else {}
    message = _raises(ValueError, lambda: _call(kind, scale=value, **kwargs), "scale", "> 0")
    assert repr(float(value)) in message
    # Also when there is nothing to compute.
    _raises(ValueError, lambda: _call(kind, Q[:, :0], K[:, :0], V[:, :0], scale=value, **kwargs),
            "scale")


@pytest.mark.parametrize("value", ["0.5", [1.0], True, 1j, np.array([0.5]), np.array(True)],
                         ids=repr)
def test_scale_must_be_a_real_number(backend, value):
    message = _raises(TypeError, lambda: _call("softmax", scale=value, backend=backend),
                      "scale must be a real number")
    if isinstance(value, np.ndarray):
        assert f"shape {value.shape}" in message


@pytest.mark.parametrize("value", [np.array(0.5), np.array(2, dtype=np.int64),
                                   np.array(0.5, dtype=np.float32)], ids=repr)
def test_scale_and_eps_may_be_0d_arrays(backend, value):
    """A 0-d real array is its value, as numpy takes it."""
    want = _call("softmax", scale=float(value), backend=backend)
    np.testing.assert_array_equal(_call("softmax", scale=value, backend=backend), want)
    want = _call("linear", eps=float(value), backend=backend)
    np.testing.assert_array_equal(_call("linear", eps=value, backend=backend), want)


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_causal_may_be_a_numpy_bool(backend, kind):
    want = _call(kind, causal=True, backend=backend)
    for value in (np.bool_(True), np.array(True)):
        np.testing.assert_array_equal(_call(kind, causal=value, backend=backend), want)


@pytest.mark.parametrize("value", [-1e-6, np.nan, np.inf], ids=str)
@pytest.mark.parametrize("kind", ["linear", "weights"])
def test_eps_must_be_finite_and_non_negative(backend, kind, value):
    kwargs = {"backend": backend} if kind == "linear" else {"kind": "linear"}
    _raises(ValueError, lambda: _call(kind, eps=value, **kwargs), "eps", ">= 0", repr(float(value)))


def test_eps_must_be_a_real_number(backend):
    _raises(TypeError, lambda: _call("linear", eps="1e-6", backend=backend), "eps must be a real number")


@pytest.mark.parametrize("kind", ["softmax", "linear", "weights"])
@pytest.mark.parametrize("value", ["yes", 1, None, np.array([True])], ids=repr)
def test_causal_must_be_a_bool(backend, kind, value):
    kwargs = {"backend": backend} if kind != "weights" else {}
    _raises(TypeError, lambda: _call(kind, causal=value, **kwargs), "causal must be True or False")


def test_return_state_must_be_a_bool(backend):
    _raises(TypeError, lambda: _call("linear", return_state="yes", backend=backend),
            "return_state must be True or False")


@pytest.mark.parametrize("kind", ["linear", "weights"])
@pytest.mark.parametrize("value", ["gelu", "ELU", None, ""], ids=repr)
def test_unknown_feature_map_lists_the_known_ones(backend, kind, value):
    kwargs = {"backend": backend} if kind == "linear" else {"kind": "linear"}
    _raises(ValueError, lambda: _call(kind, feature_map=value, **kwargs),
            "feature_map must be one of", "'elu'", "'relu'", repr(value))


@pytest.mark.parametrize("kind", ["softmax", "linear"])
@pytest.mark.parametrize("value", ["cuda", "Numba", None, ""], ids=repr)
def test_unknown_backend_lists_the_available_ones(kind, value):
    message = _raises(ValueError, lambda: _call(kind, backend=value), "backend must be", repr(value))
    for name in BACKENDS:
        assert repr(name) in message
    # Also when there is nothing to compute.
    _raises(ValueError, lambda: _call(kind, Q[:, :0], K[:, :0], V[:, :0], backend=value), "backend")


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_an_array_as_backend_is_named_not_compared(kind):
    # backend == "auto" on an array is an array: its truth was numpy's error, not ours.
    cache = fastattn.KVCache((), capacity=2, d_k=3, d_v=6, dtype=Q.dtype)
    cache.append(K[0, :2], V[0, :2])
    for value in (np.array(["numba", "cython"]), np.array("auto")):
        _raises(ValueError, lambda: _call(kind, backend=value), "backend must be",
                f"got an array of shape {value.shape}")
        _raises(ValueError, lambda: cache.attend(Q[0, :1], backend=value), "backend must be",
                f"got an array of shape {value.shape}")


def test_unknown_weights_kind():
    _raises(ValueError, lambda: fastattn.attention_weights(Q, K, kind="cosine"),
            "kind must be 'softmax' or 'linear'", "'cosine'")


# ---------------------------------------------------------------------------
# The linear attention state.
# ---------------------------------------------------------------------------

S_OK = np.zeros((2, 3, 6))
Z_OK = np.zeros((2, 3))

BAD_STATES = {
    # id: (initial_state, exception, fragments)
    "array-not-pair": (S_OK, TypeError, ["initial_state must be a pair (S, z)", "(2, 3, 6)", "(2, 3)"]),
    "triple": ((S_OK, Z_OK, Z_OK), TypeError, ["initial_state must be a pair"]),
    "S-shape": ((S_OK[:, :, :5], Z_OK), ValueError,
                ["initial_state[0] (S)", "(2, 3, 6)", "(..., d_k, d_v)", "(2, 3, 5)"]),
    "S-no-batch": ((S_OK[0], Z_OK), ValueError, ["initial_state[0] (S)", "(2, 3, 6)", "(3, 6)"]),
    "S-transposed": ((S_OK.transpose(0, 2, 1), Z_OK), ValueError, ["initial_state[0] (S)", "(2, 6, 3)"]),
    "z-shape": ((S_OK, np.zeros((2, 6))), ValueError,
                ["initial_state[1] (z)", "(2, 3)", "(..., d_k)", "(2, 6)"]),
    "S-int": ((S_OK.astype(np.int64), Z_OK), TypeError, ["initial_state[0] (S)", "int64"]),
    "z-complex": ((S_OK, Z_OK.astype(complex)), TypeError, ["initial_state[1] (z)", "complex128"]),
    "S-list": ((S_OK.tolist(), Z_OK), TypeError, ["initial_state[0] (S)", "numpy.ndarray", "list"]),
    "z-none": ((S_OK, None), TypeError, ["initial_state[1] (z)", "numpy.ndarray"]),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", BAD_STATES)
def test_bad_state_is_refused_with_the_expected_shape(backend, case, causal):
    state, exc, fragments = BAD_STATES[case]
    message = _raises(exc, lambda: _call("linear", initial_state=state, causal=causal,
                                         backend=backend), *fragments)
    if case == "z-shape":
        # z has no d_v axis: the message must not describe it with S's layout.
        assert "(..., d_k, d_v)" not in message


def test_state_shape_follows_the_leading_dims(backend):
    q, k, v = make_qkv((2, 3, 4, 5), d_v=2)
    good = (np.zeros((2, 3, 5, 2)), np.zeros((2, 3, 5)))
    assert fastattn.linear_attention(q, k, v, initial_state=good, backend=backend).shape == (2, 3, 4, 2)
    flat = (np.zeros((6, 5, 2)), np.zeros((6, 5)))
    _raises(ValueError, lambda: fastattn.linear_attention(q, k, v, initial_state=flat, backend=backend),
            "initial_state[0] (S)", "(2, 3, 5, 2)", "(6, 5, 2)")


@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor"])
def test_negative_key_sums_in_a_state_are_refused(backend, feature_map):
    q, k, v = make_qkv((2, 4, 3), d_v=6)
    spec_D = 3 if feature_map != "favor" else fastattn.FavorFeatures(3).num_features
    S, z = np.zeros((2, spec_D, 6)), np.ones((2, spec_D))
    z[1, 0] = -0.25
    _raises(ValueError, lambda: fastattn.linear_attention(
        q, k, v, feature_map=feature_map, initial_state=(S, z), backend=backend),
        "initial_state[1] (z)", ">= 0", repr(feature_map), "-0.25")


def test_negative_key_sums_are_allowed_for_taylor_whose_features_may_be_negative(backend):
    q, k, v = make_qkv((2, 4, 3), d_v=6, seed=3)
    D = 1 + 3 + 3 * 4 // 2
    S, z = np.zeros((2, D, 6)), np.zeros((2, D))
    z[:, 1] = -0.25      # as a state of keys with negative first coordinates would have
    out = fastattn.linear_attention(q, k, v, feature_map="taylor", initial_state=(S, z),
                                    backend=backend)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("where, bad, rows", [
    ("S", np.nan, "nan"), ("z", np.nan, "nan"), ("S", np.inf, "non-finite"), ("z", np.inf, "nan"),
])
def test_non_finite_initial_state_is_taken_as_given_by_every_backend(backend, where, bad, rows,
                                                                    causal):
    """As documented: a NaN makes the rows that see it NaN, an inf in S makes
    them non-finite, an inf in z makes them NaN (an infinite denominator, never
    the finite x / inf) -- the same in every backend."""
    q, k, v = make_qkv((2, 5, 4), dtype=np.float32, seed=8)
    S, z = np.ones((2, 4, 4), np.float32), np.ones((2, 4), np.float32)
    (S if where == "S" else z)[0, 1, ...] = bad
    out = fastattn.linear_attention(q, k, v, causal=causal, initial_state=(S, z), backend=backend)
    want = fastattn.linear_attention(q, k, v, causal=causal, initial_state=(S, z),
                                     backend="reference")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)   # NaN where NaN, inf where inf
    assert np.isfinite(out[1]).all()                               # the other head is untouched
    check = {"nan": lambda o: np.isnan(o).all(),
             "non-finite": lambda o: (~np.isfinite(o)).any(axis=-1).all()}[rows]
    assert check(out[0]), out[0]


def test_a_state_of_integers_gets_advice_that_is_code():
    q, k, v = make_qkv((2, 5, 4), dtype=np.float32, seed=9)
    S, z = np.ones((2, 4, 4), np.int64), np.ones((2, 4), np.float32)
    with pytest.raises(TypeError, match=r"initial_state\[0\] \(S\) must have dtype .* "
                                        r"e\.g\. S\.astype\(np\.float32\)"):
        fastattn.linear_attention(q, k, v, initial_state=(S, z))
    with pytest.raises(TypeError, match=r"e\.g\. z\.astype\(np\.float32\)"):
        fastattn.linear_attention(q, k, v, initial_state=(S.astype(np.float32), z.astype(int)))


# ---------------------------------------------------------------------------
# The reference refuses an n x n allocation that cannot fit.
# ---------------------------------------------------------------------------

AVAILABLE = 1 << 18     # what the monkeypatched machine has left: 256 KiB


@pytest.fixture
def little_memory(monkeypatch):
    import fastattn.reference as ref

    monkeypatch.setattr(ref, "available_memory", lambda: AVAILABLE)
    return AVAILABLE


def _bytes(message):
    """Every integer written with thousands separators in ``message``, and every size in
    bytes written in e-notation (an absurd one: 1.2e+19 bytes), in order."""
    found = re.findall(r"\d{1,3}(?:,\d{3})+|\d(?:\.\d+)?e\+\d+(?= bytes)", message)
    return [float(m) if "e" in m else int(m.replace(",", "")) for m in found]


MEMORY_CASES = {
    # id: (lead, n_q, n_k, dtype, call, itemsize of the computation)
    "softmax-f32": ((), 1024, 1024, np.float32, "softmax", 4),
    "softmax-causal-f32": ((), 1024, 1000, np.float32, "softmax-causal", 4),
    "softmax-f64-batch": ((2, 3), 256, 300, np.float64, "softmax", 8),
    "softmax-f16-in-f32": ((), 1024, 512, np.float16, "softmax", 4),
    "linear-causal-f32": ((4,), 512, 512, np.float32, "linear-causal", 4),
    "weights-f64": ((), 700, 600, np.float64, "weights", 8),
}


@pytest.mark.parametrize("case", MEMORY_CASES)
def test_reference_memory_error_before_allocating(little_memory, case):
    lead, n_q, n_k, dtype, call, itemsize = MEMORY_CASES[case]
    q, k, v = make_qkv((*lead, n_q, 2), n_k=n_k, dtype=dtype, seed=3)
    batch = int(np.prod(lead))
    one_array = batch * n_q * n_k * itemsize      # one n_q x n_k array of the computation dtype
    assert one_array > 4 * little_memory
    fn = {
        "softmax": lambda: fastattn.softmax_attention(q, k, v, backend="reference"),
        "softmax-causal": lambda: fastattn.softmax_attention(q, k, v, causal=True,
                                                             backend="reference"),
        "linear-causal": lambda: fastattn.linear_attention(q, k, v, causal=True, backend="reference"),
        "weights": lambda: fastattn.attention_weights(q, k),
    }[call]
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError) as info:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    # The bytes needed: at least one n_q x n_k array in the computation dtype
    # (float16 is computed in float32), at most the few such arrays a
    # reference call holds.
    stated = [b for b in _bytes(message) if b != little_memory]
    assert stated, f"no byte count in: {message}"
    assert one_array <= stated[0] <= 4 * one_array, f"{stated[0]:,} bytes for {one_array:,}: {message}"
    assert f"{little_memory:,}" in message
    if call == "weights":   # it has no backend to switch to: the advice says what to do instead
        assert "backend" not in message and "fewer queries or keys" in message
    else:
        assert "'numba'" in message and "'cython'" in message
    # Refused before the n_q x n_k arrays exist: the call allocated a small
    # fraction of even one of them.
    assert peak < one_array / 4, f"allocated {peak:,} bytes before refusing"


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("fmap, d, n, D", [("elu", 512, 4, 512), ("taylor", 48, 256, 1225)])
def test_linear_state_too_large_is_refused_before_any_work(little_memory, backend, fmap, d, n, D,
                                                           causal):
    """The (D, d_v) state grows as the square of the head dim: a call whose
    states cannot fit is refused before it allocates them (it used to be
    killed by the system at d = 70,000)."""
    q, k, v = make_qkv((2, n, d), dtype=np.float32, seed=7)
    state_bytes = 2 * D * d * 4
    assert state_bytes > little_memory
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError) as info:
            fastattn.linear_attention(q, k, v, feature_map=fmap, causal=causal, backend=backend)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert f"D={D:,} features and d_v={d}" in message and f"(2, {D}, {d})" in message
    assert f"{little_memory:,}" in message and "smaller head dims" in message
    assert peak < state_bytes, f"allocated {peak:,} bytes before refusing"


def test_non_causal_linear_reference_needs_no_n_by_n_array(little_memory):
    q, k, v = make_qkv((1024, 2), dtype=np.float32)
    assert fastattn.linear_attention(q, k, v, backend="reference").shape == (1024, 2)


@pytest.mark.parametrize("fast", FAST_BACKENDS or [pytest.param(None, marks=pytest.mark.skip("no fast backend built"))])
def test_tiled_backends_run_where_the_reference_cannot(little_memory, fast):
    q, k, v = make_qkv((1024, 2), dtype=np.float32, seed=4)
    for causal in (False, True):
        assert np.all(np.isfinite(fastattn.softmax_attention(q, k, v, causal=causal, backend=fast)))
        assert np.all(np.isfinite(fastattn.linear_attention(q, k, v, causal=causal, backend=fast)))


def test_empty_value_dim_never_forms_an_n_by_n_array(little_memory, backend):
    """d_v = 0, causal, with state: O(size of the inputs), whatever backend is asked."""
    from oracles import linear_oracle

    q, k, _ = make_qkv((2048, 4), dtype=np.float32, seed=5)
    v = np.ones((2048, 0), np.float32)
    assert 2048 * 2048 * 4 > 16 * little_memory      # one n x n float32 array would not fit
    tracemalloc.start()
    try:
        out, (S, z) = fastattn.linear_attention(q, k, v, causal=True, return_state=True,
                                                backend=backend)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (2048, 0) and S.shape == (4, 0) and z.shape == (4,)
    _, _, z_exp = linear_oracle(q, k, v, "elu", True)
    np.testing.assert_allclose(z, z_exp, rtol=1e-5)
    assert peak < 8 * q.nbytes, f"allocated {peak:,} bytes for inputs of {q.nbytes:,}"


def test_causal_linear_reference_refuses_before_any_work(little_memory):
    """The n x n check comes before the feature maps (each as large as q)."""
    q, k, v = make_qkv((2048, 64), dtype=np.float32, seed=6)
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError, match="causal linear attention"):
            fastattn.linear_attention(q, k, v, causal=True, backend="reference")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < q.nbytes / 4, f"allocated {peak:,} bytes (q is {q.nbytes:,}) before refusing"


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16-in-float32"])
@pytest.mark.parametrize("kind", ["softmax", "weights"])
def test_scale_infinite_in_the_dtype_is_refused(backend, kind, dtype):
    """1e39 is a finite Python float but inf in float32 (every logit would be NaN)."""
    q, k, v = (x.astype(dtype) for x in (Q, K, V))
    kwargs = {"backend": backend} if kind != "weights" else {}
    _raises(ValueError, lambda: _call(kind, q, k, v, scale=1e39, **kwargs),
            "scale", "float32", "1e+39")
    # The largest float32 is still a valid scale, and float64 takes 1e39.
    assert np.all(np.isfinite(_call(kind, Q, K, V, scale=1e39, **kwargs)))


@pytest.mark.parametrize("kind", ["linear", "weights"])
def test_eps_infinite_in_the_dtype_is_refused(backend, kind):
    """1e300 is a finite Python float but inf in float32: every row would be 0 (the trial
    found cython silent and the others warning of an overflowing cast)."""
    q, k, v = (x.astype(np.float32) for x in (Q, K, V))
    kwargs = {"backend": backend} if kind != "weights" else {"kind": "linear"}
    _raises(ValueError, lambda: _call(kind, q, k, v, eps=1e300, **kwargs),
            "eps", "float32", "1e+300")
    assert np.all(np.isfinite(_call(kind, Q, K, V, eps=1e300, **kwargs)))   # float64 takes it


@pytest.mark.parametrize("options, fragments", [
    ({"kind": "softmax", "feature_map": "bogus"}, ["feature_map must be one of", "'bogus'"]),
    ({"kind": "softmax", "eps": -1.0}, ["eps", ">= 0"]),
    ({"kind": "softmax", "eps": "small"}, ["eps must be a real number"]),
    ({"kind": "linear", "scale": 2.0}, ["scale applies to kind='softmax' only", "2.0"]),
    ({"kind": "linear", "scale": np.inf}, ["scale applies to kind='softmax' only"]),
], ids=["softmax-feature_map", "softmax-eps", "softmax-eps-type", "linear-scale", "linear-scale-inf"])
def test_attention_weights_checks_options_of_the_other_kind(options, fragments):
    exc = TypeError if options.get("eps") == "small" else ValueError
    _raises(exc, lambda: fastattn.attention_weights(Q, K, **options), *fragments)


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "42", None, True, [1, 2]], ids=repr)
def test_compare_refuses_a_bad_seed_naming_it(seed):
    # Out of range: ValueError; not an int at all (a bool is not): TypeError.
    exc = ValueError if isinstance(seed, int) and not isinstance(seed, bool) else TypeError
    _raises(exc, lambda: fastattn.compare(8, 4, seed=seed), "seed must be an int", repr(seed))


@pytest.mark.parametrize("n, d", [(10**9, 8), (10**6, 4)], ids=["n1e9-d8-inputs", "n1e6-d4-n-by-n"])
def test_compare_refuses_a_size_that_cannot_fit_before_drawing(n, d):
    tracemalloc.start()
    try:
        message = _raises(MemoryError, lambda: fastattn.compare(n, d), f"n={n}", f"d={d}",
                          "choose a smaller n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert _bytes(message)[0] >= 4 * n * n, message
    assert peak < 1 << 20, f"allocated {peak:,} bytes before refusing"


def test_attention_weights_names_only_the_arrays_it_was_given():
    """A batch mismatch named a v (2, 7, 1) the caller never passed."""
    with pytest.raises(ValueError, match=r"^q and k must have the same leading \(batch, head\) "
                                         r"dims; got q \(2, 3, 4\), k \(3, 7, 4\)$"):
        fastattn.attention_weights(np.ones((2, 3, 4)), np.ones((3, 7, 4)))


def test_a_feature_map_class_instead_of_a_map_is_told_to_make_one():
    x = np.ones((2, 5, 4))
    with pytest.raises(TypeError, match=r"got the class FavorFeatures: make one first, e\.g\. "
                                        r"FavorFeatures\(4\)"):
        fastattn.linear_attention(x, x, x, feature_map=fastattn.FavorFeatures)


def test_favor_features_too_large_by_d_k_names_d_k():
    with pytest.raises(MemoryError, match="or d_k"):
        fastattn.FavorFeatures(10**7)


def test_a_callable_whose_features_exceed_float32_says_so():
    """It was told its features were non-finite, with a RuntimeWarning of the cast."""
    x = np.ones((1, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"feature_map\(q\) returned 1e\+39, beyond the "
                                         r"computation dtype float32"):
        fastattn.linear_attention(x, x, x, feature_map=lambda a: np.full(a.shape, 1e39))
