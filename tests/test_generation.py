"""Generation one token at a time: the recurrent linear step, KVCache, LinearAttentionState.

Every step is held to the plain calls (and through them to the reference).
"""

import importlib

import numpy as np
import psutil
import pytest

import fastattn
from fastattn import _policy

from conftest import BACKENDS, FAST_BACKENDS, assert_close, make_qkv, reference64

DTYPES = [pytest.param(np.float32, id="f32"), pytest.param(np.float64, id="f64")]

#: Each fast backend's decode module: the recurrent step and the KV cache's split-key kernel.
DECODE_MODULES = {"numba": "fastattn._numba.decode", "cython": "fastattn._cython.decode"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_1000_one_token_linear_steps_equal_one_causal_pass(backend, dtype):
    """B2-H3-n1000-dk8-dv6: the state carried through 1,000 calls of one token."""
    n = 1000
    q, k, v = make_qkv((2, 3, n, 8), d_v=6, dtype=dtype, seed=11)
    want_out, (want_S, want_z) = reference64(
        fastattn.linear_attention, q, k, v, causal=True, return_state=True
    )
    state = None
    outs = []
    for t in range(n):
        sl = slice(t, t + 1)
        out, state = fastattn.linear_attention(
            q[..., sl, :], k[..., sl, :], v[..., sl, :], causal=True,
            initial_state=state, return_state=True, backend=backend,
        )
        assert out.dtype == dtype and state[0].dtype == dtype
        outs.append(out)
    assert_close(np.concatenate(outs, axis=-2), want_out, dtype)
    # S and z are sums of 1,000 positive terms: relative tolerance holds, scale by their size.
    assert_close(state[0], want_S, dtype, scale=10)
    assert_close(state[1], want_z, dtype, scale=10)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_recurrent_step_kernel_matches_reference(backend, dtype, feature_map):
    """B5-dk7-dv4, with and without a state; eps=0 with relu gives a zero row where φ(q)=0."""
    module = importlib.import_module(DECODE_MODULES[backend])
    rng = np.random.default_rng(5)
    q, k, v = make_qkv((5, 1, 7), d_v=4, dtype=dtype, seed=2)
    q[0] = -1.0  # relu: φ(q) = 0, denominator 0 with eps = 0
    S0 = np.abs(rng.standard_normal((5, 7, 4))).astype(dtype)
    z0 = np.abs(rng.standard_normal((5, 7))).astype(dtype)
    S0_before = S0.copy()
    for state in ((S0, z0), (None, None)):
        for eps in (1e-6, 0.0):
            got = module.linear_forward(q, k, v, feature_map, True, eps, *state)
            want = fastattn.reference.linear_forward(
                q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), feature_map,
                True, eps, *(None if s is None else s.astype(np.float64) for s in state),
            )
            for g, w in zip(got, want):
                assert g.dtype == dtype
                assert_close(g, w, dtype, err_msg=f"eps={eps} state={state[0] is not None}")
    np.testing.assert_array_equal(S0, S0_before)  # the state passed in is not modified


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_linear_step_runs_the_recurrent_step_kernel(backend, monkeypatch):
    module = importlib.import_module(DECODE_MODULES[backend])
    calls = []
    real = module.recurrent_linear_step

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(module, "recurrent_linear_step", spy)
    q, k, v = make_qkv((4, 1, 8), dtype=np.float32)
    fastattn.linear_attention(q, k, v, causal=True, backend=backend)
    q2, k2, v2 = make_qkv((4, 2, 8), dtype=np.float32)
    fastattn.linear_attention(q2, k2, v2, causal=True, backend=backend)
    assert calls == [(4, 1, 8)]


# ---------------------------------------------------------------------------
# KVCache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_shape", [(), (2, 3)], ids=["B0", "B2-H3"])
def test_kv_cache_decode_loop_equals_plain_calls(batch_shape, backend, dtype):
    """A prompt of 5 tokens, 1-token steps to 20 keys, then across 1,024 keys (split keys), d_k=8, d_v=6."""
    n = 2 * _policy.SPLIT_KEYS_MIN_KEYS + 3
    q, k, v = make_qkv(batch_shape + (n, 8), d_v=6, dtype=dtype, seed=7)
    cache = fastattn.KVCache(batch_shape, capacity=n, d_k=8, d_v=6, dtype=dtype)
    cache.append(k[..., :5, :], v[..., :5, :])
    got = cache.attend(q[..., :5, :], backend=backend)
    want = fastattn.softmax_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :], causal=True,
                                      backend=backend)
    assert_close(got, want, dtype)
    for t in list(range(5, 20)) + list(range(n - 6, n)):
        if cache.length < t:
            cache.append(k[..., cache.length:t, :], v[..., cache.length:t, :])
        cache.append(k[..., t:t + 1, :], v[..., t:t + 1, :])
        got = cache.attend(q[..., t:t + 1, :], backend=backend)
        want = fastattn.softmax_attention(q[..., t:t + 1, :], k[..., :t + 1, :], v[..., :t + 1, :],
                                          backend=backend)
        assert got.dtype == dtype and got.shape == batch_shape + (1, 6)
        assert_close(got, want, dtype, err_msg=f"t={t}")
    assert cache.length == n
    assert_close(cache.attend(q[..., -3:, :], backend=backend),
                 reference64(fastattn.softmax_attention, q[..., -3:, :], k, v, causal=True), dtype)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_kv_cache_attends_in_place(backend, monkeypatch):
    """The split-key kernel gets the cache's own buffers, not a copy of the filled part."""
    module = importlib.import_module(DECODE_MODULES[backend])
    seen = []
    real = module.cache_softmax_forward

    def spy(q, k, v, causal, scale, n_k):
        seen.append((k, v, n_k))
        return real(q, k, v, causal, scale, n_k)

    monkeypatch.setattr(module, "cache_softmax_forward", spy)
    cache = fastattn.KVCache((2, 4), capacity=64, d_k=16, dtype=np.float32)
    q, k, v = make_qkv((2, 4, 10, 16), dtype=np.float32)
    cache.append(k, v)
    got = cache.attend(q[..., -1:, :], scale=0.3, backend=backend)
    assert_close(got, reference64(fastattn.softmax_attention, q[..., -1:, :], k, v, scale=0.3),
                 np.float32)
    (k_arg, v_arg, n_k), = seen
    assert n_k == 10
    assert np.shares_memory(k_arg, cache._k) and np.shares_memory(v_arg, cache._v)


def test_kv_cache_float64_queries_on_float32_cache_compute_in_float64():
    cache = fastattn.KVCache((3,), capacity=8, d_k=4, dtype=np.float32)
    q, k, v = make_qkv((3, 6, 4), dtype=np.float64)
    cache.append(k, v)
    got = cache.attend(q[:, -1:])
    assert got.dtype == np.float64
    want = fastattn.softmax_attention(q[:, -1:], k.astype(np.float32).astype(np.float64),
                                      v.astype(np.float32).astype(np.float64), backend="reference")
    assert_close(got, want, np.float64)


def test_kv_cache_views_and_bytes():
    cache = fastattn.KVCache((2,), capacity=10, d_k=4, d_v=3, dtype=np.float64)
    assert cache.nbytes == 2 * 10 * (4 + 3) * 8
    k = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    v = np.ones((2, 3, 3), dtype=np.float16)
    cache.append(k, v)
    assert cache.keys.shape == (2, 3, 4) and cache.values.shape == (2, 3, 3)
    assert cache.keys.dtype == np.float64
    np.testing.assert_array_equal(cache.keys, k)
    with pytest.raises(ValueError):
        cache.keys[0, 0, 0] = 1.0  # read-only view
    cache.reset()
    assert cache.length == 0 and cache.keys.shape == (2, 0, 4)
    assert (cache.attend(np.ones((2, 1, 4))) == 0).all()  # no key: rows of zeros


@pytest.mark.parametrize("args, kwargs, error, match", [
    (((2,), 0, 4), {}, ValueError, "capacity"),
    (((2,), 8, 0), {}, ValueError, "d_k"),
    (((2,), 8, 4, 2.5), {}, ValueError, "d_v"),
    (("ab", 8, 4), {}, TypeError, "batch_shape"),
    (((2, -1), 8, 4), {}, ValueError, "batch_shape"),
    (((2,), 8, 4), {"dtype": np.int32}, TypeError, "dtype"),
], ids=["capacity0", "dk0", "dv-float", "batch-str", "batch-negative", "dtype-int"])
def test_kv_cache_rejects_bad_construction(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fastattn.KVCache(*args, **kwargs)


def test_kv_cache_rejects_bad_appends_and_queries():
    cache = fastattn.KVCache((2,), capacity=4, d_k=4, d_v=3)
    k, v = np.zeros((2, 3, 4)), np.zeros((2, 3, 3))
    with pytest.raises(ValueError, match=r"k must have shape batch_shape \+ \(t, 4\) = \(2, t, 4\), "):
        cache.append(np.zeros((2, 3, 5)), v)
    with pytest.raises(ValueError, match=r"v must have shape"):
        cache.append(k, np.zeros((3, 3, 3)))
    with pytest.raises(ValueError, match="same number of tokens"):
        cache.append(k, np.zeros((2, 2, 3)))
    with pytest.raises(TypeError, match="k must"):
        cache.append(k.astype(np.int64), v)
    with pytest.raises(TypeError, match="k must be a numpy.ndarray"):
        cache.append(k.tolist(), v)
    cache.append(k, v)
    with pytest.raises(ValueError, match="full: it holds 3 of 4"):
        cache.append(k[:, :2], v[:, :2])
    assert cache.length == 3  # a refused append changes nothing
    with pytest.raises(ValueError, match="d_k"):
        cache.attend(np.zeros((2, 1, 5)))
    with pytest.raises(TypeError, match="causal"):
        cache.attend(np.zeros((2, 1, 4)), causal=1)
    with pytest.raises(ValueError, match="scale"):
        cache.attend(np.zeros((2, 1, 4)), scale=-1.0)
    with pytest.raises(ValueError, match="backend"):
        cache.attend(np.zeros((2, 1, 4)), backend="fortran")


@pytest.mark.parametrize("name, value", [
    ("length", 10**6), ("capacity", 10**6), ("d_k", 8), ("d_v", 8),
    ("batch_shape", (8,)), ("dtype", np.float64),
])
def test_kv_cache_sizes_are_read_only(name, value):
    """A length or shape set from outside would send the kernels past the buffers."""
    cache = fastattn.KVCache((2,), capacity=4, d_k=4, d_v=3)
    k, v = np.ones((2, 3, 4)), np.ones((2, 3, 3))
    cache.append(k, v)
    before = getattr(cache, name)
    with pytest.raises(AttributeError):
        setattr(cache, name, value)
    assert getattr(cache, name) == before and cache.length == 3
    q = np.ones((2, 1, 4))
    for backend in BACKENDS:
        assert_close(cache.attend(q, backend=backend),
                     reference64(fastattn.softmax_attention, q, k, v, causal=True), np.float32)


# ---------------------------------------------------------------------------
# LinearAttentionState


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_state_steps_equal_one_causal_pass(backend, dtype):
    """B2-H2-n60-dk8-dv5: a prompt of 20 tokens in one step, then 40 one-token steps."""
    q, k, v = make_qkv((2, 2, 60, 8), d_v=5, dtype=dtype, seed=4)
    state = fastattn.LinearAttentionState((2, 2), d_k=8, d_v=5, dtype=dtype)
    assert state.nbytes == 4 * (8 * 5 + 8) * np.dtype(dtype).itemsize
    outs = [state.step(q[..., :20, :], k[..., :20, :], v[..., :20, :], backend=backend)]
    for t in range(20, 60):
        outs.append(state.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :],
                               backend=backend))
    want, (S, z) = fastattn.linear_attention(q, k, v, causal=True, return_state=True,
                                             backend=backend)
    assert_close(np.concatenate(outs, axis=-2), want, dtype)
    assert_close(state.S, S, dtype)
    assert_close(state.z, z, dtype)
    assert state.tokens == 60 and state.S.dtype == dtype
    state.reset()
    assert state.tokens == 0 and not state.S.any() and not state.z.any()


def _squares(x):
    """A user's feature map of dimension D = 2 d_k: [x², 1 + |x|]."""
    return np.concatenate([x * x, 1 + np.abs(x)], axis=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmap, D", [("favor-m24", 24), ("taylor", 1 + 8 + 36), ("callable", 16)])
def test_linear_state_of_any_feature_dimension_steps_equal_one_causal_pass(fmap, D, backend):
    """B2-n30-dk8-dv5, a state of D features: a 10-token prompt, then 20 one-token steps.

    FAVOR+ with eps = 0: each piece measures eps in its own frame (see FavorFeatures)."""
    feature_map = {"favor-m24": fastattn.FavorFeatures(8, num_features=24, random_state=3),
                   "taylor": "taylor", "callable": _squares}[fmap]
    eps = 0.0 if fmap.startswith("favor") else 1e-6
    q, k, v = make_qkv((2, 30, 8), d_v=5, dtype=np.float64, seed=11)
    state = fastattn.LinearAttentionState((2,), d_k=8, d_v=5, feature_map=feature_map, eps=eps,
                                          dtype=np.float64)
    outs = [state.step(q[:, :10], k[:, :10], v[:, :10], backend=backend)]
    outs += [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], backend=backend)
             for t in range(10, 30)]
    want, (S, z) = fastattn.linear_attention(q, k, v, feature_map=feature_map, eps=eps,
                                             causal=True, return_state=True, backend="reference")
    assert state.S.shape == (2, D, 5) and state.z.shape == (2, D)
    assert state.nbytes == 2 * (D * 5 + D) * 8
    assert_close(np.concatenate(outs, axis=-2), want, np.float64)
    assert_close(state.S, S, np.float64)
    assert_close(state.z, z, np.float64)


def test_linear_state_relu_and_eps_reach_the_kernel():
    q, k, v = make_qkv((3, 1, 4), dtype=np.float64, seed=9)
    state = fastattn.LinearAttentionState((3,), d_k=4, feature_map="relu", eps=0.5,
                                          dtype=np.float64)
    got = state.step(q, k, v)
    want = fastattn.linear_attention(q, k, v, feature_map="relu", eps=0.5, causal=True,
                                     backend="reference")
    assert_close(got, want, np.float64)


def test_linear_state_rejects_bad_input_and_keeps_its_state():
    with pytest.raises(ValueError, match="eps"):
        fastattn.LinearAttentionState((2,), d_k=4, eps=-1.0)
    with pytest.raises(TypeError, match="dtype"):
        fastattn.LinearAttentionState((2,), d_k=4, dtype="int8")
    with pytest.raises(ValueError, match="feature_map"):
        fastattn.LinearAttentionState((2,), d_k=4, feature_map="cosine")
    with pytest.raises(ValueError, match="but this LinearAttentionState has d_k=4") as info:
        fastattn.LinearAttentionState((2,), d_k=4, feature_map=fastattn.FavorFeatures(8))
    assert "q and k" not in str(info.value)   # the caller gave no q or k
    # eps is checked against the state's dtype when the state is made, not at its first step.
    with pytest.raises(ValueError, match="eps must be finite in the computation dtype float32"):
        fastattn.LinearAttentionState((2,), d_k=4, eps=1e39)
    assert fastattn.LinearAttentionState((2,), d_k=4, eps=1e39, dtype=np.float64).eps == 1e39
    q, k, v = make_qkv((2, 1, 4), dtype=np.float32)
    state = fastattn.LinearAttentionState((2,), d_k=4)
    state.step(q, k, v)
    S, z = state.S.copy(), state.z.copy()
    with pytest.raises(ValueError, match="same number of tokens"):
        state.step(np.zeros((2, 2, 4)), k, v)
    # A mismatch with the state names the argument and the state's shape (not
    # initial_state, which the caller never passed).
    with pytest.raises(ValueError, match=r"q must have shape batch_shape \+ \(t, d_k\) = "
                                         r"\(2, t, 4\), this state's, got \(1, 1, 4\)"):
        state.step(q[:1], k[:1], v[:1])
    with pytest.raises(ValueError, match=r"q must have shape .*got \(2, 1, 3\)"):
        state.step(np.zeros((2, 1, 3)), np.zeros((2, 1, 3)), v)
    with pytest.raises(ValueError, match=r"v must have shape batch_shape \+ \(t, d_v\)"):
        state.step(q, k, np.zeros((2, 1, 5)))
    np.testing.assert_array_equal(state.S, S)
    np.testing.assert_array_equal(state.z, z)
    assert state.tokens == 1
    for name, value in (("tokens", 5), ("S", np.zeros_like(S)), ("z", -np.ones_like(z)),
                        ("d_k", 8), ("batch_shape", (3,)), ("feature_map", "relu"),
                        ("eps", 1.0), ("dtype", np.float64)):
        with pytest.raises(AttributeError):
            setattr(state, name, value)
    np.testing.assert_array_equal(state.S, S)
    assert state.tokens == 1 and state.feature_map == "elu"
    # Changed in place, the state is named as the state's, not as an argument never passed.
    state.z[0, 0] = -1.0
    with pytest.raises(ValueError, match=r"this LinearAttentionState's z \(changed in place") as info:
        state.step(q, k, v)
    assert "initial_state" not in str(info.value)
    assert state.tokens == 1


def test_kv_cache_too_large_to_allocate_names_capacity():
    with pytest.raises(MemoryError, match=r"capacity=1000000000000000, .* needs 1.02e\+18 bytes"):
        fastattn.KVCache((2,), capacity=10**15, d_k=64)


def test_generation_objects_beyond_the_ram_are_refused_before_allocating():
    # np.empty of more than the RAM can succeed (pages only promised) and fail mid-generation.
    ram = psutil.virtual_memory().total
    capacity = 2 * ram // (2 * 64 * 4) + 1          # keys and values: twice the RAM
    with pytest.raises(MemoryError, match=r"capacity=\d+, .* give a smaller capacity, d_k, "
                                          r"d_v or batch_shape"):
        fastattn.KVCache((1,), capacity=capacity, d_k=64)
    # A small capacity of huge rows: the advice names more than the capacity, and the
    # size is in e-notation, not 40 digits.
    with pytest.raises(MemoryError, match=r"needs 3.2e\+16 bytes \(2.98e\+07 GiB\)"):
        fastattn.KVCache((1,), capacity=8, d_k=4, d_v=10**15 - 4)
    d_k = int((2 * ram / 1000 / 4) ** 0.5) + 1       # S (1000, d_k, d_k): twice the RAM
    with pytest.raises(MemoryError, match=r"LinearAttentionState: the state S \(1000, \d+, \d+\)"
                                          r" .* give a smaller batch_shape, d_k or d_v"):
        fastattn.LinearAttentionState((1000,), d_k=d_k)


def test_kv_cache_refuses_values_that_overflow_its_dtype_and_keeps_its_length():
    cache = fastattn.KVCache((1,), capacity=4, d_k=2)
    k = np.ones((1, 1, 2))
    cache.append(k, k)
    big = np.array([[[1e39, 1.0]]])   # finite in float64, inf in float32
    for args, name in (((big, k), "k"), ((k, big), "v")):
        with pytest.raises(ValueError, match=rf"^{name} holds finite values beyond the range of "
                                             r"this cache's dtype float32"):
            cache.append(*args)
        assert cache.length == 1
    # An inf given is taken as given, as by every kernel.
    cache.append(np.array([[[np.inf, 1.0]]]), k)
    assert cache.length == 2
    assert fastattn.KVCache((1,), capacity=1, d_k=2, dtype=np.float64).append(big, big) is None


def test_linear_state_refuses_a_state_that_overflows_its_dtype_and_keeps_its_state():
    state = fastattn.LinearAttentionState((1,), d_k=8)
    ones = np.ones((1, 1, 8))
    state.step(ones, ones, ones)
    S, z = state.S.copy(), state.z.copy()
    with pytest.raises(ValueError, match=r"beyond the range of this state's dtype float32"):
        state.step(ones, np.full((1, 1, 8), 1e39), ones)   # finite in float64, inf in float32
    assert state.tokens == 1
    assert np.array_equal(state.S, S) and np.array_equal(state.z, z)
    assert np.all(np.isfinite(state.step(ones, ones, ones)))   # the next step is not NaN
