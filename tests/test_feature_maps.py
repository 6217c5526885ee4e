"""Feature maps FAVOR+, Taylor and a user's callable, on every backend (issue 13).

Every expected value is written here in float64 from the definitions, never
taken from fastattn: FAVOR+ from ``ω`` (which the API exposes as
``FavorFeatures.omega``), Taylor from its kernel ``1 + s + s²/2``, a callable
by calling it.  The linear attention around the features is the explicit
row-by-row sum of :func:`oracles.linear_oracle`'s definition.
"""

import copy
import math
import pickle

import numpy as np
import pytest

import fastattn
from conftest import FAST_BACKENDS, TOLERANCES, assert_close, make_qkv
from fastattn import feature_maps as fm
from fastattn.data import load_minilm
from oracles import last_visible

FLOATS = [np.float32, np.float64]


# ---------------------------------------------------------------------------
# Float64 formulas, from the definitions.
# ---------------------------------------------------------------------------

def favor_exponents(x, omega):
    """``ω x' − ‖x'‖²/2`` with ``x' = x / d_k^¼``: ``(..., n, m)`` float64."""
    x = np.asarray(x, np.float64) / x.shape[-1] ** 0.25
    return x @ omega.T - 0.5 * (x * x).sum(axis=-1, keepdims=True)


def favor_formula(q, k, v, omega, causal, eps):
    """Stabilised FAVOR+ linear attention in float64, as documented.

    Keys: one shift ``c_r`` per feature and head (the feature's largest
    exponent over the head's keys); queries: ``c_r`` added, then one shift per
    row (the row's largest); features ``exp(· − shift) / √m``.  Returns
    ``out`` and the state in the fixed frame ``max_r ‖ω_r‖²/2``.
    """
    m = omega.shape[0]
    eq, ek = favor_exponents(q, omega), favor_exponents(k, omega)
    c = ek.max(axis=-2, keepdims=True)
    fk = np.exp(ek - c) / math.sqrt(m)
    fq = np.exp(eq + c - (eq + c).max(axis=-1, keepdims=True)) / math.sqrt(m)
    out = _ratio(fq, fk, v, causal, eps)
    fixed = (omega ** 2).sum(axis=1).max() / 2
    f_state = np.exp(ek - fixed) / math.sqrt(m)
    return out, _state(f_state, v)


def taylor_phi(x):
    """``[1, x / d^¼, x_a x_b / √d (a < b), x_a² / (√2 √d)]``, written with loops."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    cols = [np.ones(x.shape[:-1]), *(x[..., a] / d ** 0.25 for a in range(d))]
    for a in range(d):
        for b in range(a, d):
            w = 1 / math.sqrt(2 * d) if a == b else 1 / math.sqrt(d)
            cols.append(x[..., a] * x[..., b] * w)
    return np.stack(cols, axis=-1)


def taylor_formula(q, k, v, causal, eps):
    """Linear attention with the kernel ``1 + s + s²/2``, ``s = qᵀk / √d_k``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    kernel = 1 + s + s * s / 2
    return _kernel_ratio(kernel, v, causal, eps), _state(taylor_phi(k), v)


def _kernel_ratio(kernel, v, causal, eps):
    n_q, n_k = kernel.shape[-2:]
    out = np.zeros(kernel.shape[:-1] + v.shape[-1:])
    for idx in np.ndindex(*kernel.shape[:-2]):
        for i in range(n_q):
            seen = max(last_visible(i, n_q, n_k, causal) + 1, 0)
            if seen == 0:
                continue  # a row that sees no key is 0 (documented), whatever eps
            w = kernel[idx][i, :seen]
            out[idx][i] = w @ v[idx][:seen] / (w.sum() + eps)
    return out


def _ratio(fq, fk, v, causal, eps):
    return _kernel_ratio(fq @ np.swapaxes(fk, -1, -2), np.asarray(v, np.float64), causal, eps)


def _state(fk, v):
    return np.swapaxes(fk, -1, -2) @ np.asarray(v, np.float64), fk.sum(axis=-2)


def softplus_and_square(x):
    """A user's map with D = 2 d_k: ``[log(1 + e^x), x²]`` (non-negative)."""
    return np.concatenate([np.logaddexp(0, x), x * x], axis=-1)


def user_formula(q, k, v, causal, eps):
    fq, fk = softplus_and_square(q.astype(np.float64)), softplus_and_square(k.astype(np.float64))
    return _ratio(fq, fk, v, causal, eps), _state(fk, v)


MAPS = ["favor-m24", "favor-default", "taylor", "callable"]


def default_eps(name):
    """``linear_attention``'s default eps for a map of :data:`MAPS`: 0 for FAVOR+, else 1e-6."""
    return 0.0 if name.startswith("favor") else 1e-6


def _map_and_formula(name, d_k):
    """``(feature_map argument, formula(q, k, v, causal, eps) -> (out, (S, z)))``."""
    if name == "favor-m24":
        favor = fastattn.FavorFeatures(d_k, num_features=24, random_state=3)
        return favor, lambda *a: favor_formula(*a[:3], favor.omega, *a[3:])
    if name == "favor-default":
        # "favor" is documented as FavorFeatures(d_k) with its default m and seed.
        omega = fastattn.FavorFeatures(d_k).omega
        return "favor", lambda *a: favor_formula(*a[:3], omega, *a[3:])
    if name == "taylor":
        return "taylor", taylor_formula
    return softplus_and_square, user_formula


def _sid(shape):
    lead, n_q, n_k, d_k, d_v = shape
    return f"B{'x'.join(map(str, lead)) or '-'}-nq{n_q}-nk{n_k}-dk{d_k}-dv{d_v}"


SHAPES = [
    ((2,), 37, 37, 5, 3),
    ((), 131, 131, 4, 6),     # past the 64-row chunk and the 128-row feature block
    ((2, 2), 9, 70, 3, 2),    # a decoder with a cache: causal offset 61
    ((), 70, 9, 3, 2),        # causal: rows that see no key
]


# ---------------------------------------------------------------------------
# Every map, every backend, against the float64 formula, with its state.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=_sid)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", MAPS)
def test_every_map_matches_its_float64_formula(backend, name, dtype, causal, shape):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, dtype=dtype, seed=7)
    feature_map, formula = _map_and_formula(name, d_k)
    out, (S, z) = fastattn.linear_attention(q, k, v, feature_map=feature_map, causal=causal,
                                            return_state=True, backend=backend)
    expected, (S_exp, z_exp) = formula(q, k, v, causal, default_eps(name))
    assert out.dtype == dtype
    assert_close(out, expected, dtype=dtype)
    D = {"favor-m24": 24, "favor-default": fastattn.FavorFeatures(d_k).num_features,
         "taylor": 1 + d_k + d_k * (d_k + 1) // 2, "callable": 2 * d_k}[name]
    assert S.shape == (*lead, D, d_v) and z.shape == (*lead, D)
    assert_close(S, S_exp, dtype=dtype)
    assert_close(z, z_exp, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", MAPS)
def test_attention_weights_of_every_map_match_the_formula(name, causal):
    q, k, v = make_qkv((2, 13, 4), n_k=17, d_v=3, seed=11)
    feature_map, formula = _map_and_formula(name, 4)
    weights = fastattn.attention_weights(q, k, kind="linear", causal=causal,
                                         feature_map=feature_map)
    assert weights.shape == (2, 13, 17)
    # The formula's weights: its output for one-hot values is each row of weights.
    eye = np.broadcast_to(np.eye(17), (2, 17, 17))
    expected, _ = formula(q, k, eye, causal, default_eps(name))
    assert_close(weights, expected)
    assert_close(weights @ v, fastattn.linear_attention(
        q, k, v, feature_map=feature_map, causal=causal, backend="reference"))


# ---------------------------------------------------------------------------
# FAVOR+: ω, unbiasedness, quality at large m.
# ---------------------------------------------------------------------------

def test_favor_omega_is_orthogonal_blocks_with_chi_norms_and_reproducible():
    favor = fastattn.FavorFeatures(8, num_features=20, random_state=5)
    omega = favor.omega
    assert omega.shape == (20, 8) and omega.dtype == np.float64
    assert not omega.flags.writeable
    directions = omega / np.linalg.norm(omega, axis=1, keepdims=True)
    for block in (directions[:8], directions[8:16], directions[16:]):
        gram = block @ block.T
        np.testing.assert_allclose(gram, np.eye(len(block)), atol=1e-12)
    np.testing.assert_array_equal(omega, fastattn.FavorFeatures(8, 20, random_state=5).omega)
    assert not np.array_equal(omega, fastattn.FavorFeatures(8, 20, random_state=6).omega)
    # Squared norms chi²(d_k): mean d_k over many rows.
    big = fastattn.FavorFeatures(8, num_features=8000, random_state=0).omega
    np.testing.assert_allclose(np.mean(np.sum(big ** 2, axis=1)), 8, rtol=0.03)
    assert favor.state_shift == pytest.approx(np.max(np.sum(omega ** 2, axis=1)) / 2)


@pytest.mark.parametrize("d_k, expected", [(1, 1), (2, 2), (32, 111), (64, 266)])
def test_favor_default_num_features_is_dk_ln_dk(d_k, expected):
    assert fastattn.FavorFeatures(d_k).num_features == expected


def test_favor_features_are_unbiased_over_many_seeds():
    rng = np.random.default_rng(0)
    d_k = 4
    q, k = rng.standard_normal(d_k) * 0.8, rng.standard_normal(d_k) * 0.8
    target = math.exp(q @ k / math.sqrt(d_k))
    estimates = []
    for seed in range(4000):
        favor = fastattn.FavorFeatures(d_k, num_features=4 * d_k, random_state=seed)
        estimates.append(favor(q) @ favor(k))
    estimates = np.array(estimates)
    stderr = estimates.std() / math.sqrt(len(estimates))
    assert stderr < 0.01 * target  # enough draws to see a bias of a few per cent
    assert abs(estimates.mean() - target) < 4 * stderr, (estimates.mean(), target, stderr)


def _cosine(a, b):
    return float(np.mean(np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_favor_at_64_dk_beats_elu_on_gaussian_inputs(backend, seed):
    # Gaussian inputs as in the seed experiment (q, k ~ N(0, 0.5²), v ~ N(0, 1)),
    # n=256, d=32.  (At unit variance and d=32, FAVOR+'s variance, which grows
    # as exp(‖q'‖² + ‖k'‖²), needs more than 64·d_k features to win.)
    q, k, v = make_qkv((256, 32), seed=seed, scale=0.5)
    soft = fastattn.softmax_attention(q, k, v, backend="reference")
    elu = fastattn.linear_attention(q, k, v, feature_map="elu", backend=backend)
    favor = fastattn.linear_attention(
        q, k, v, feature_map=fastattn.FavorFeatures(32, num_features=64 * 32, random_state=seed),
        backend=backend)
    assert _cosine(soft, favor) > _cosine(soft, elu) + 0.01


def test_favor_is_stabilised_where_the_plain_features_underflow():
    # ‖x‖ = 60 at d_k = 6: the plain features exp(ω x' − ‖x'‖²/2) underflow
    # to 0 in float64; the shifted ones do not, and match the formula.
    rng = np.random.default_rng(3)
    q, k = (60 * x / np.linalg.norm(x, axis=-1, keepdims=True)
            for x in rng.standard_normal((2, 40, 6)))
    v = rng.standard_normal((40, 3))
    favor = fastattn.FavorFeatures(6, num_features=30, random_state=0)
    with np.errstate(under="ignore"):
        assert (favor(q) == 0).any() and (favor(k) == 0).any()
    expected, _ = favor_formula(q, k, v, favor.omega, False, 0.0)
    for backend in fastattn.available_backends():
        out = fastattn.linear_attention(q, k, v, feature_map=favor, eps=0.0, backend=backend)
        assert np.isfinite(out).all()
        assert_close(out, expected, scale=1e3)  # exponents of ~1e3 carry ~1e-13 relative error


# ---------------------------------------------------------------------------
# Taylor: the kernel is 1 + s + s²/2.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("d_k", [1, 3, 16])
def test_taylor_kernel_is_one_plus_s_plus_half_s_squared(d_k):
    q, k, _ = make_qkv((23, d_k), n_k=19, seed=d_k, scale=2.0)
    s = q @ k.T / math.sqrt(d_k)
    kernel = 1 + s + s * s / 2
    assert kernel.min() >= 0.5
    weights = fastattn.attention_weights(q, k, kind="linear", feature_map="taylor", eps=0.0)
    np.testing.assert_allclose(weights, kernel / kernel.sum(axis=1, keepdims=True), rtol=1e-12)
    # The features themselves (independent of the ratio): φ(q)·φ(k) = 1 + s + s²/2.
    phi_q = fastattn.reference.taylor_features(q[None])[0]
    phi_k = fastattn.reference.taylor_features(k[None])[0]
    assert phi_q.shape == (23, 1 + d_k + d_k * (d_k + 1) // 2)
    np.testing.assert_allclose(phi_q @ phi_k.T, kernel, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_fast_taylor_and_favor_features_match_the_formulas(fast_backend, dtype):
    from fastattn._api import get_backend

    module = get_backend(fast_backend)
    x = make_qkv((2, 150, 5), seed=2, dtype=dtype)[0]
    tol = TOLERANCES[np.dtype(dtype)]
    np.testing.assert_allclose(module.taylor_features(x), taylor_phi(x), **tol)
    favor = fastattn.FavorFeatures(5, num_features=17, random_state=1)
    e = favor_exponents(x, favor.omega)
    phi_k, shift = module.favor_key_features(x, favor.projection(dtype))
    assert shift.shape == (2, 17) and shift.dtype == np.float64
    np.testing.assert_allclose(shift, e.max(axis=1), rtol=1e-5)
    np.testing.assert_allclose(phi_k, np.exp(e - shift[:, None, :]) / math.sqrt(17), **tol)
    # Queries in a frame of the test's own (any c (B, m) float64).
    c = np.random.default_rng(3).uniform(-5, 5, (2, 17))
    phi_q = module.favor_query_features(x, favor.projection(dtype), c)
    ec = e + c[:, None, :]
    np.testing.assert_allclose(phi_q, np.exp(ec - ec.max(-1, keepdims=True)) / math.sqrt(17),
                               **tol)


# ---------------------------------------------------------------------------
# Large logits: ‖q‖, ‖k‖ up to 1e3 in float32 stay finite, for every map.
# ---------------------------------------------------------------------------

def _large_norm_inputs(n, d_k, seed):
    """Two heads of float32 q, k with norms log-uniform in [1, 1e3] (both ends present)."""
    rng = np.random.default_rng(seed)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) * 10.0 ** rng.uniform(0, 3, (2, n, 1))
            for x in rng.standard_normal((2, 2, n, d_k)))
    q[0, 0] *= 1e3 / np.linalg.norm(q[0, 0])
    k[0, 1] *= 1e3 / np.linalg.norm(k[0, 1])
    k[1, 2] /= np.linalg.norm(k[1, 2])
    v = rng.standard_normal((2, n, 3))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", ["elu", "relu", "favor", "taylor", "callable"])
def test_large_logits_give_finite_outputs_for_every_map(backend, name, causal):
    q, k, v = _large_norm_inputs(150, 8, seed=4)
    assert np.linalg.norm(q, axis=-1).max() == pytest.approx(1e3, rel=1e-6)
    feature_map = softplus_and_square if name == "callable" else name
    out, (S, z) = fastattn.linear_attention(q, k, v, feature_map=feature_map, causal=causal,
                                            return_state=True, backend=backend)
    assert out.dtype == np.float32
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} non-finite outputs"
    assert np.isfinite(S).all() and np.isfinite(z).all()
    if name != "taylor":
        # Non-negative features: every row is a weighted mean of the values it
        # sees, shrunk towards 0 by eps, so it stays inside their range.
        lo = np.minimum(v.min(axis=1, keepdims=True), 0) - 1e-3
        hi = np.maximum(v.max(axis=1, keepdims=True), 0) + 1e-3
        assert ((out >= lo) & (out <= hi)).all()


# ---------------------------------------------------------------------------
# FAVOR+ at norms where features underflow: the exact kernel, without features.
# ---------------------------------------------------------------------------

def favor_exact_weights(q, k, omega, causal):
    """FAVOR+'s attention weights ``K_ij / Σ_j K_ij`` with ``K_ij = Σ_r exp(e_q,ir + e_k,jr)``.

    Taken in log space (``log K_ij`` by log-sum-exp over the features), so it
    holds where every feature of a key a row sees is far below the float
    range; float64, ``(..., n_q, n_k)``.
    """
    from scipy.special import logsumexp

    eq, ek = favor_exponents(q, omega), favor_exponents(k, omega)
    log_k = logsumexp(eq[..., :, None, :] + ek[..., None, :, :], axis=-1)
    n_q, n_k = log_k.shape[-2:]
    seen = np.arange(n_k)[None, :] <= np.array(
        [last_visible(i, n_q, n_k, causal) for i in range(n_q)])[:, None]
    log_k = np.where(seen, log_k, -np.inf)
    w = np.exp(log_k - log_k.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True)


def _far_apart_qkv(scale, dtype, n_q=70, n_k=70):
    """Two heads, d_k = 16, q and k ``scale`` times N(0, 1): ``‖k‖²/√d_k`` near ``4 scale²``."""
    q, k, v = make_qkv((2, n_k, 16), seed=21)
    q = q[:, n_k - n_q:]
    return (q * scale).astype(dtype), (k * scale).astype(dtype), v.astype(dtype)


FAR_APART = [(np.float64, 30), (np.float64, 300), (np.float32, 10)]


@pytest.mark.parametrize("n_q", [70, 41], ids=lambda n: f"nq{n}-nk70")
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype, scale", FAR_APART,
                         ids=[f"{np.dtype(d).name}-x{s}" for d, s in FAR_APART])
def test_favor_where_features_underflow_equals_the_exact_kernel(backend, dtype, scale, causal,
                                                                n_q):
    # Each key's exponents spread over ~4 scale² (float64: 3600, 360000), far
    # beyond exp's range, so the features of most keys underflow in any one
    # frame; the kernel must still come out right (it is, in exact arithmetic).
    q, k, v = _far_apart_qkv(scale, dtype, n_q=n_q)
    favor = fastattn.FavorFeatures(16, num_features=48, random_state=5)
    expected = favor_exact_weights(q, k, favor.omega, causal) @ v.astype(np.float64)
    out = fastattn.linear_attention(q, k, v, feature_map=favor, causal=causal, backend=backend)
    assert out.dtype == dtype
    assert_close(out, expected)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype, scale", FAR_APART,
                         ids=[f"{np.dtype(d).name}-x{s}" for d, s in FAR_APART])
def test_favor_weights_where_features_underflow_are_the_exact_kernel(dtype, scale, causal):
    q, k, _ = _far_apart_qkv(scale, dtype)
    favor = fastattn.FavorFeatures(16, num_features=48, random_state=5)
    weights = fastattn.attention_weights(q, k, kind="linear", feature_map=favor, causal=causal)
    assert_close(weights, favor_exact_weights(q, k, favor.omega, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("far", ["first", "second"])
def test_favor_pieces_where_features_underflow_equal_the_exact_kernel(backend, far, causal):
    # One piece's keys are 300x longer than the other's: their features sit
    # ~1e5 below the other piece's frame, and the state must carry them.
    q, k, v = make_qkv((2, 40, 16), seed=22)
    part = slice(0, 20) if far == "first" else slice(20, 40)
    q[:, part] *= 300.0
    k[:, part] *= 300.0
    favor = fastattn.FavorFeatures(16, num_features=48, random_state=5)
    kwargs = dict(feature_map=favor, causal=causal, backend=backend)
    _, state = fastattn.linear_attention(q[:, :20], k[:, :20], v[:, :20], return_state=True,
                                         **kwargs)
    second = fastattn.linear_attention(q[:, 20:], k[:, 20:], v[:, 20:], initial_state=state,
                                       **kwargs)
    expected = favor_exact_weights(q, k, favor.omega, causal) @ v
    assert_close(second, expected[:, 20:])


@pytest.mark.parametrize("n_q", [200, 150], ids=lambda n: f"nq{n}-nk200")
@pytest.mark.parametrize("dtype, scale", [(np.float64, 30), (np.float32, 10)],
                         ids=["float64-x30", "float32-x10"])
def test_favor_long_run_of_far_keys_equals_the_exact_kernel(backend, dtype, scale, n_q):
    # All but the last 20 keys far out: nearly every causal row loses its denominator
    # in the call's frame, over several chunks of keys whose frame keeps rising.
    q, k, v = make_qkv((2, 200, 16), seed=25)
    k[:, :180] *= scale
    q, k, v, = (x.astype(dtype) for x in (q[:, 200 - n_q:], k, v))
    favor = fastattn.FavorFeatures(16, num_features=48, random_state=5)
    out = fastattn.linear_attention(q, k, v, feature_map=favor, causal=True, backend=backend)
    assert_close(out, favor_exact_weights(q, k, favor.omega, True) @ v.astype(np.float64))


@pytest.mark.parametrize("backend_", ["reference"] + list(FAST_BACKENDS))
def test_favor_faint_state_where_features_underflow_equals_the_exact_kernel(backend_):
    # The first 15 queries and keys 30x longer than the last 15, and a state
    # whose key sums lie 680 below the largest key of each feature: the early
    # rows see keys and a state that underflow in the call's frame (e^-680 =
    # 5e-296), and the state still counts, as exp(ω q' + c) z0 √m a feature
    # with the values' mean S0 / z0 behind it.
    q, k, v = make_qkv((2, 30, 16), seed=24)
    q[:, :15] *= 30.0
    k[:, :15] *= 30.0
    favor = fastattn.FavorFeatures(16, num_features=48, random_state=5)
    eq, ek = favor_exponents(q, favor.omega), favor_exponents(k, favor.omega)
    z0 = np.exp(ek.max(axis=1) - favor.state_shift - 680)
    assert (z0 > 0).all()
    means = np.random.default_rng(23).standard_normal((2, 48, v.shape[-1]))
    out = fastattn.linear_attention(q, k, v, feature_map=favor, causal=True,
                                    initial_state=(means * z0[..., None], z0), backend=backend_)
    from scipy.special import logsumexp
    log_k = logsumexp(eq[:, :, None, :] + ek[:, None, :, :], axis=-1)          # (2, n_q, n_k)
    log_k = np.where(np.tril(np.ones((30, 30), bool)), log_k, -np.inf)
    log_s = eq + favor.state_shift + np.log(z0 * math.sqrt(48))[:, None, :]    # (2, n_q, m)
    top = np.maximum(log_k.max(-1), log_s.max(-1))[..., None]
    w_k, w_s = np.exp(log_k - top), np.exp(log_s - top)
    expected = (w_k @ v + w_s @ means) / (w_k.sum(-1) + w_s.sum(-1))[..., None]
    assert_close(out, expected)


# ---------------------------------------------------------------------------
# The state carried across pieces equals one pass, for every map.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("pieces", [[5, 0, 7, 4], [1] * 16, [15, 1]], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", MAPS)
def test_state_across_pieces_equals_one_pass(backend, name, dtype, pieces):
    q, k, v = make_qkv((2, 3, 16, 4), d_v=5, dtype=dtype, seed=61)
    feature_map, formula = _map_and_formula(name, 4)
    # FAVOR+'s pieces work in frames of their own keys, which would shift a
    # non-zero eps (documented); its default eps, 0, makes the ratio exactly
    # frame-free.  The pieces run on the default eps.
    expected, (S_exp, z_exp) = formula(q, k, v, True, default_eps(name))
    outs, state, start = [], None, 0
    for size in pieces:
        sl = slice(start, start + size)
        out, state = fastattn.linear_attention(
            q[..., sl, :], k[..., sl, :], v[..., sl, :], feature_map=feature_map, causal=True,
            initial_state=state, return_state=True, backend=backend,
        )
        outs.append(out)
        start += size
    assert_close(np.concatenate(outs, axis=-2), expected, dtype=dtype)
    assert_close(state[0], S_exp, dtype=dtype)
    assert_close(state[1], z_exp, dtype=dtype)


# The default eps: 0 for FAVOR+ (no eps, as the Performer papers and code), 1e-6 otherwise.
DEFAULT_EPS_CASES = {"favor": 0.0, "favor-object": 0.0, "elu": 1e-6, "relu": 1e-6,
                     "taylor": 1e-6, "callable": 1e-6}


def _default_eps_map(name, d_k):
    if name == "favor-object":
        return fastattn.FavorFeatures(d_k, num_features=32, random_state=5)
    return softplus_and_square if name == "callable" else name


def _eps_sensitive_qkv():
    # Long keys put most of FAVOR+'s shifted denominators far below 1 (and
    # relu's near 0), so eps = 1e-6 and eps = 0 give visibly different rows.
    q, k, v = make_qkv((2, 24, 6), d_v=3, dtype=np.float64, seed=19)
    return q, k * 4.0, v


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", list(DEFAULT_EPS_CASES))
def test_default_eps_is_zero_for_favor_and_1e6_for_every_other_map(backend, name, causal):
    q, k, v = _eps_sensitive_qkv()
    fm, eps = _default_eps_map(name, 6), DEFAULT_EPS_CASES[name]
    other = 1e-6 if eps == 0 else 0.0
    run = lambda **kw: fastattn.linear_attention(q, k, v, feature_map=fm, causal=causal,  # noqa: E731
                                                 backend=backend, **kw)
    default = run()
    np.testing.assert_array_equal(default, run(eps=eps))
    assert not np.array_equal(default, run(eps=other)), f"eps={other} gives the same output"
    weights = lambda **kw: fastattn.attention_weights(q, k, kind="linear", feature_map=fm,  # noqa: E731
                                                      causal=causal, **kw)
    np.testing.assert_array_equal(weights(), weights(eps=eps))
    assert not np.array_equal(weights(), weights(eps=other))


def test_favor_default_eps_restores_the_magnitude_that_eps_1e6_loses_in_the_shifted_frame():
    # The issue-13 symptom in miniature: with eps = 1e-6 applied in the shifted
    # frame, rows whose shifted denominator is small shrink (a smaller norm,
    # off the eps = 0 formula by far more than float64 rounding); the default
    # is the eps = 0 formula.
    q, k, v = _eps_sensitive_qkv()
    favor = fastattn.FavorFeatures(6, num_features=32, random_state=5)
    expected, _ = favor_formula(q, k, v, favor.omega, False, 0.0)
    default = fastattn.linear_attention(q, k, v, feature_map=favor)
    shrunk = fastattn.linear_attention(q, k, v, feature_map=favor, eps=1e-6)
    assert_close(default, expected)
    assert np.linalg.norm(shrunk) < np.linalg.norm(expected)
    assert np.max(np.abs(shrunk - expected)) > 1e3 * TOLERANCES[np.dtype(np.float64)]["atol"]


@pytest.mark.parametrize("name", ["favor", "elu", "taylor"])
def test_linear_attention_state_steps_equal_one_pass_with_the_default_eps(name):
    q, k, v = _eps_sensitive_qkv()
    state = fastattn.LinearAttentionState((2,), 6, 3, feature_map=name, dtype=np.float64)
    steps = np.concatenate([state.step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1])
                            for i in range(q.shape[1])], axis=1)
    assert_close(steps, fastattn.linear_attention(q, k, v, feature_map=name, causal=True))


@pytest.mark.parametrize("dominant", ["first", "second"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_favor_state_carries_the_key_shift_between_pieces_of_different_scale(
        backend, dominant, causal):
    # The keys of one piece are 5x longer, so their exponents sit ~10 below
    # the other piece's and the two pieces' frames differ; two pieces still
    # equal one pass.  "dominant" is the piece of ordinary keys.
    q, k, v = make_qkv((2, 40, 6), d_v=3, seed=8)
    k[:, 20:] *= 5.0 if dominant == "first" else 1.0
    k[:, :20] *= 5.0 if dominant == "second" else 1.0
    favor = fastattn.FavorFeatures(6, num_features=40, random_state=2)
    kwargs = dict(feature_map=favor, causal=causal, eps=0.0, backend=backend)
    first, state = fastattn.linear_attention(q[:, :20], k[:, :20], v[:, :20], return_state=True,
                                             **kwargs)
    second = fastattn.linear_attention(q[:, 20:], k[:, 20:], v[:, 20:], initial_state=state,
                                       **kwargs)
    expected, _ = favor_formula(q, k, v, favor.omega, causal, 0.0)
    assert_close(fastattn.linear_attention(q, k, v, **kwargs), expected)
    # The second piece sees the first's keys (through the state) and its own:
    # causally its rows of the one pass; non-causally every key.
    assert_close(second, expected[:, 20:])
    if causal:
        assert_close(first, expected[:, :20])


# ---------------------------------------------------------------------------
# Real activations: FAVOR+ at large m and Taylor against elu+1.
# ---------------------------------------------------------------------------

def test_minilm_favor_at_large_m_lands_closer_to_softmax_than_elu():
    data = load_minilm()  # the shipped slice: 6 layers x 2 heads, n=128, d=32
    q, k, v = data["q"], data["k"], data["v"]
    soft = data["context"]
    soft_w = fastattn.attention_weights(q, k)
    cos, kl = {}, {}
    maps = {"elu": "elu", "favor-64dk": fastattn.FavorFeatures(32, 64 * 32, random_state=0),
            "taylor": "taylor"}
    for name, fm in maps.items():
        cos[name] = _cosine(soft, fastattn.linear_attention(q, k, v, feature_map=fm))
        kl[name] = fastattn.weight_quality(
            soft_w, fastattn.attention_weights(q, k, kind="linear", feature_map=fm)).kl_divergence
    print(f"MiniLM shipped slice, mean cosine similarity {cos}, mean row KL {kl}")
    assert cos["favor-64dk"] > cos["elu"] + 0.05
    assert kl["favor-64dk"] < kl["elu"] / 2
    # Taylor's rows are closer to softmax's than elu+1's (KL), but its output
    # is not: on these heads 1 + s + s²/2 overweights strongly negative
    # logits, and its cosine similarity ties elu+1's (0.7085 against 0.7087).
    assert kl["taylor"] < kl["elu"] - 0.2
    assert abs(cos["taylor"] - cos["elu"]) < 0.02


# ---------------------------------------------------------------------------
# Validation: every bad feature_map gets an error naming it.
# ---------------------------------------------------------------------------

Q, K, V = make_qkv((2, 5, 3), seed=1)


@pytest.mark.parametrize("kind", ["linear", "weights"])
def test_unknown_name_lists_every_map(kind):
    call = (lambda: fastattn.linear_attention(Q, K, V, feature_map="performer")) if kind == "linear" \
        else (lambda: fastattn.attention_weights(Q, K, kind="linear", feature_map="performer"))
    with pytest.raises(ValueError) as info:
        call()
    for word in ("feature_map", "'elu'", "'relu'", "'favor'", "'taylor'", "FavorFeatures",
                 "callable", "'performer'"):
        assert word in str(info.value)


def test_favor_features_of_another_dk_are_refused():
    with pytest.raises(ValueError, match=r"feature_map is FavorFeatures\(d_k=4.*d_k=3"):
        fastattn.linear_attention(Q, K, V, feature_map=fastattn.FavorFeatures(4))


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"d_k": 0}, ValueError, "d_k must be a positive int"),
    ({"d_k": 2.0}, TypeError, "d_k must be a positive int"),
    ({"d_k": 3, "num_features": 0}, ValueError, "num_features must be a positive int"),
    ({"d_k": 3, "num_features": True}, TypeError, "num_features must be a positive int"),
    ({"d_k": 3, "random_state": -1}, ValueError, "random_state must be an int >= 0"),
    ({"d_k": 3, "random_state": "x"}, TypeError, "random_state must be an int or a numpy"),
], ids=["dk0", "dk-float", "m0", "m-bool", "seed-negative", "seed-str"])
def test_favor_features_arguments_are_validated(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fastattn.FavorFeatures(**kwargs)


BAD_CALLABLES = {
    "list": (lambda x: x.tolist(), TypeError, r"feature_map\(q\) must return a numpy.ndarray"),
    "int": (lambda x: (x > 0).astype(np.int64), TypeError, "must return float features"),
    "rows": (lambda x: np.abs(x[..., :-1, :]), ValueError, r"shape \(2, 5, D\)"),
    "rank": (lambda x: np.abs(x)[..., None], ValueError, "must return features of shape"),
    "D0": (lambda x: x[..., :0], ValueError, "D >= 1"),
    "nan": (lambda x: np.where(x > 1, np.nan, np.abs(x)), ValueError, "non-finite"),
    "negative": (lambda x: x, ValueError, "negative values"),
}


@pytest.mark.parametrize("case", list(BAD_CALLABLES))
@pytest.mark.parametrize("kind", ["linear", "weights"])
def test_a_bad_callable_is_refused_with_a_message_naming_feature_map(backend, case, kind):
    fn, exc, match = BAD_CALLABLES[case]
    with pytest.raises(exc, match=match):
        if kind == "linear":
            fastattn.linear_attention(Q, K, V, feature_map=fn, backend=backend)
        else:
            fastattn.attention_weights(Q, K, kind="linear", feature_map=fn)


def test_a_callable_with_different_dims_for_q_and_k_is_refused():
    def by_length(x):
        return np.abs(x) if x.shape[-2] == 5 else np.abs(np.concatenate([x, x], -1))

    with pytest.raises(ValueError, match="D=3 features for q but D=6 for k"):
        fastattn.linear_attention(Q, K[:, :4], V[:, :4], feature_map=by_length)


def test_a_callable_sees_the_leading_dims_and_the_computation_dtype():
    seen = []

    def spy(x):
        seen.append((x.shape, x.dtype))
        return np.abs(x)

    q, k, v = make_qkv((2, 3, 5, 4), dtype=np.float16)
    fastattn.linear_attention(q, k, v, feature_map=spy)
    assert seen == [((2, 3, 5, 4), np.float32)] * 2


@pytest.mark.parametrize("name, D", [("favor", 3), ("taylor", 10)])
def test_state_of_another_feature_dimension_is_refused_naming_D(backend, name, D):
    q, k, v = make_qkv((2, 5, 3), seed=1)
    bad = (np.zeros((2, 3, 3)), np.zeros((2, 3)))
    if D == 3:
        bad = (np.zeros((2, 4, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match=rf"initial_state\[0\] \(S\) must have shape \(2, {D}, 3\) "
                                         r"\(\.\.\., D, d_v\)"):
        fastattn.linear_attention(q, k, v, feature_map=name, initial_state=bad, backend=backend)


@pytest.mark.parametrize("shape", [((), 0, 5, 3, 2), ((), 5, 0, 3, 2), ((0,), 4, 4, 3, 3),
                                   ((), 4, 4, 3, 0), ((2,), 1, 1, 1, 1)], ids=_sid)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", MAPS)
def test_empty_and_unit_sizes_for_every_map(backend, name, causal, shape):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, seed=2)
    feature_map, formula = _map_and_formula(name, d_k)
    out, (S, z) = fastattn.linear_attention(q, k, v, feature_map=feature_map, causal=causal,
                                            return_state=True, backend=backend)
    assert out.shape == (*lead, n_q, d_v)
    if 0 in (n_k, math.prod(lead)):
        assert not out.any() and not S.any() and not z.any()
        return
    expected, (S_exp, z_exp) = formula(q, k, v, causal, default_eps(name))
    assert_close(out, expected)
    assert_close(S, S_exp)
    assert_close(z, z_exp)


@pytest.mark.parametrize("name", MAPS)
def test_float16_and_any_layout_for_every_map(backend, name):
    q, k, v = make_qkv((3, 20, 4), d_v=3, seed=9)
    feature_map, formula = _map_and_formula(name, 4)
    expected, _ = formula(q, k, v, True, default_eps(name))
    half = fastattn.linear_attention(*(x.astype(np.float16) for x in (q, k, v)),
                                     feature_map=feature_map, causal=True, backend=backend)
    assert half.dtype == np.float16
    assert_close(half.astype(np.float32), expected, dtype=np.float16)
    strided = [np.asfortranarray(x)[:, ::-1][:, ::-1] for x in (q, k, v)]
    assert_close(fastattn.linear_attention(*strided, feature_map=feature_map, causal=True,
                                           backend=backend), expected)


# Found by a fresh-user trial: float32 FAVOR+ at large norms (‖q‖, ‖k‖ ~ 60 at d_k = 8).
def _large_norm_qkv(scale):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 16, 8)).astype(np.float32) for _ in range(3))
    return q * scale, k * scale, v


@pytest.mark.parametrize("scale", [12, 20], ids=lambda s: f"scale={s}-n=16-d=8")
def test_favor_float32_piece_after_an_underflowed_state_is_finite(scale):
    # Every key of the first piece underflows in the returned (fixed-frame) state; the
    # factor into the second piece's frame then exceeded float32 and 0 * inf gave NaN.
    q, k, v = _large_norm_qkv(scale)
    _, state = fastattn.linear_attention(q[:, :8], k[:, :8], v[:, :8], feature_map="favor",
                                         causal=True, return_state=True)
    second = fastattn.linear_attention(q[:, 8:], k[:, 8:], v[:, 8:], feature_map="favor",
                                       causal=True, initial_state=state)
    assert np.isfinite(second).all()


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_favor_float32_subnormal_denominators_give_finite_rows_on_every_backend(causal):
    # At this norm a row's float32 denominator is subnormal: Numba and Cython returned
    # -inf rows where the float64 computation is finite; now such a call is redone in float64.
    q, k, v = _large_norm_qkv(20)
    want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                     feature_map="favor", causal=causal, backend="reference")
    for backend in ("numba", "cython"):
        if backend not in fastattn.available_backends():
            continue
        got = fastattn.linear_attention(q, k, v, feature_map="favor", causal=causal,
                                        backend=backend)
        assert got.dtype == np.float32 and np.isfinite(got).all(), backend
        assert_close(got, want.astype(np.float32), "float32")


# ---------------------------------------------------------------------------
# A map added in one class: registered, it runs on every backend.
# ---------------------------------------------------------------------------

class SquaredRelu(fastattn.feature_maps.FeatureMap):
    """``φ(x) = [relu(x)², relu(−x)²]``, ``D = 2 d_k``: defined only in this test."""

    name = "squared_relu_for_the_test"

    def __init__(self):
        self.calls = 0

    def feature_dim(self, d_k, num_features=None):
        return 2 * d_k

    def numpy_features(self, x):
        self.calls += 1
        return np.concatenate([np.maximum(x, 0) ** 2, np.maximum(-x, 0) ** 2], axis=-1)


def squared_relu_oracle(q, k, v, causal, eps):
    """Linear attention with ``[relu(x)², relu(−x)²]`` in float64, from the n_q x n_k weights."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    phi_q = np.concatenate([np.maximum(q, 0) ** 2, np.maximum(-q, 0) ** 2], axis=-1)
    phi_k = np.concatenate([np.maximum(k, 0) ** 2, np.maximum(-k, 0) ** 2], axis=-1)
    a = phi_q @ np.swapaxes(phi_k, -1, -2)
    if causal:
        n_q, n_k = a.shape[-2:]
        a = np.where(np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q, a, 0.0)
    return (a @ v) / (a.sum(axis=-1, keepdims=True) + eps)


@pytest.fixture
def squared_relu():
    fmap = fastattn.feature_maps.register(SquaredRelu())
    yield fmap
    fastattn.feature_maps.unregister(fmap.name)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", fastattn.available_backends())
def test_a_registered_map_runs_on_every_backend(squared_relu, backend, causal, dtype):
    """B2-H3-n37-dk5-dv4: one pass against the oracle; pieces 11, 1, 25 with the state = one pass."""
    name = squared_relu.name
    assert name in fastattn.feature_maps.NAMES
    assert fastattn.feature_maps.feature_dim(name, 5) == 10
    q, k, v = make_qkv((2, 3, 37, 5), d_v=4, dtype=dtype, seed=11)
    out, (S, z) = fastattn.linear_attention(q, k, v, feature_map=name, causal=causal,
                                            return_state=True, backend=backend)
    assert squared_relu.calls == 2, "features formed once for q and once for k"
    assert out.dtype == dtype and S.shape == (2, 3, 10, 4) and z.shape == (2, 3, 10)
    assert_close(out, squared_relu_oracle(q, k, v, causal, 1e-6), dtype)
    state, outs = None, []
    for i0, i1 in ((0, 11), (11, 12), (12, 37)):
        piece, state = fastattn.linear_attention(
            q[..., i0:i1, :], k[..., i0:i1, :], v[..., i0:i1, :], feature_map=name,
            causal=causal, initial_state=state, return_state=True, backend=backend)
        outs.append(piece)
    assert_close(state[0], S, dtype, scale=10)
    assert_close(state[1], z, dtype, scale=10)
    if causal:
        assert_close(np.concatenate(outs, axis=-2), out, dtype, scale=10)


@pytest.mark.parametrize("backend", fastattn.available_backends())
def test_a_registered_map_steps_in_linear_attention_state(squared_relu, backend):
    """LinearAttentionState takes the map by name: token by token equals one causal pass."""
    q, k, v = make_qkv((2, 9, 5), d_v=3, dtype=np.float64, seed=4)
    state = fastattn.LinearAttentionState((2,), d_k=5, d_v=3, feature_map=squared_relu.name,
                                          dtype=np.float64)
    assert state.num_features == 10
    outs = [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], backend=backend)
            for t in range(9)]
    assert_close(np.concatenate(outs, axis=1), squared_relu_oracle(q, k, v, True, 1e-6),
                 np.float64)


def test_registry_refuses_a_taken_name_and_forgets_an_unregistered_map():
    with pytest.raises(ValueError, match="registered already"):
        fastattn.feature_maps.register(fastattn.feature_maps.Elu())
    with pytest.raises(TypeError):
        fastattn.feature_maps.register(lambda x: x)
    fmap = fastattn.feature_maps.register(SquaredRelu())
    fastattn.feature_maps.unregister(fmap.name)
    assert fmap.name not in fastattn.feature_maps.NAMES
    with pytest.raises(ValueError, match="feature_map must be one of"):
        fastattn.linear_attention(*make_qkv((4, 2)), feature_map=fmap.name)


def test_names_and_feature_dims_of_the_built_in_maps():
    """Written here: the four names, and D at d_k = 64 without drawing FAVOR+ features."""
    assert fastattn.feature_maps.NAMES == ("elu", "relu", "favor", "taylor")
    dims = {name: fastattn.feature_maps.feature_dim(name, 64) for name in ("elu", "relu",
                                                                           "favor", "taylor")}
    assert dims == {"elu": 64, "relu": 64, "favor": 266, "taylor": 1 + 64 + 64 * 65 // 2}
    assert fastattn.feature_maps.feature_dim("favor", 64, num_features=100) == 100
    with pytest.raises(ValueError, match="expected one of elu, relu, favor, taylor"):
        fastattn.feature_maps.feature_dim("softmax", 64)


@pytest.mark.parametrize("name", ["favor", "taylor"])
def test_a_backend_without_a_maps_fused_kernel_takes_its_numpy_form(name, monkeypatch):
    """A stand-in backend with only the linear kernels: the generic path forms the features."""
    import types

    bare = types.SimpleNamespace(linear_forward=fastattn.reference.linear_forward)
    q, k, v = make_qkv((2, 19, 6), d_v=3, dtype=np.float64, seed=2)
    fmap = fastattn.feature_maps.resolve(name, 6)
    for causal in (False, True):
        feats = fmap.features(bare, q, k, (2,))
        got = fmap.forward(bare, feats, q, k, v, causal, 1e-6, None, None)
        want = fastattn.linear_attention(q, k, v, feature_map=name, causal=causal, eps=1e-6,
                                         return_state=True, backend="reference")
        assert_close(got[0], want[0], np.float64)
        assert_close(got[1], want[1][0], np.float64)


# -- a registered map is held to what a callable is (found by a new-user trial) --------
class _Bad(fm.FeatureMap):
    name = "bad_for_test"

    def __init__(self, form, dim=lambda d_k: d_k, **attrs):
        self._form, self._dim = form, dim
        self.__dict__.update(attrs)

    def feature_dim(self, d_k, num_features=None):
        return self._dim(d_k)

    def numpy_features(self, x):
        return self._form(x)


@pytest.mark.parametrize("form, dim, match", [
    (lambda x: x, lambda d: d, "negative values"),
    (lambda x: np.full_like(x, np.nan), lambda d: d, "non-finite"),
    (lambda x: np.abs(x[..., :3]), lambda d: d, "shape"),
    (lambda x: np.concatenate([np.abs(x)] * 2, axis=-1), lambda d: d, "shape"),
], ids=["negative", "nan", "narrow", "wider-than-feature_dim"])
@pytest.mark.parametrize("backend", fastattn.available_backends())
def test_a_registered_map_that_gives_bad_features_is_refused_naming_it(form, dim, match,
                                                                        backend):
    q, k, v = (np.random.default_rng(0).standard_normal((2, 9, 8)) for _ in range(3))
    fm.register(_Bad(form, dim))
    try:
        with pytest.raises(ValueError, match=f"'bad_for_test'.*{match}"):
            fastattn.linear_attention(q, k, v, feature_map="bad_for_test", backend=backend)
    finally:
        fm.unregister("bad_for_test")


@pytest.mark.parametrize("bad, match", [
    (dict(elementwise="sigmoid"), "elementwise"),
    (dict(_dim=lambda d: "x"), "feature_dim"),
], ids=["unknown-elementwise", "feature_dim-not-int"])
def test_register_refuses_a_map_no_backend_can_run(bad, match):
    fmap = _Bad(np.abs)
    fmap.__dict__.update(bad)
    with pytest.raises(ValueError, match=match):
        fm.register(fmap)
    assert "bad_for_test" not in fm.NAMES


def test_register_refuses_a_map_without_a_numpy_form():
    class Formless(fm.FeatureMap):
        name = "formless_for_test"

        def feature_dim(self, d_k, num_features=None):
            return d_k

    with pytest.raises(ValueError, match="numpy_features"):
        fm.register(Formless())


@pytest.mark.parametrize("name", ["elu", "relu", "favor", "taylor"])
def test_fastattns_own_maps_cannot_be_unregistered(name):
    with pytest.raises(ValueError, match="stays registered"):
        fm.unregister(name)
    assert name in fm.NAMES


@pytest.mark.parametrize("make", [lambda x: x.astype(np.complex128), lambda x: (x > 0).astype(int),
                                  lambda x: x.tolist()], ids=["complex", "int", "list"])
def test_a_registered_map_whose_form_returns_no_float_array_is_refused(make):
    """Such features were cast silently; a callable's are refused with a TypeError."""
    from fastattn import feature_maps

    class Odd(feature_maps.FeatureMap):
        name = "odd-test-map"

        def feature_dim(self, d_k, num_features=None):
            return d_k

        def numpy_features(self, x):
            return make(np.abs(x))

    feature_maps.register(Odd())
    try:
        x = np.ones((1, 3, 4))
        with pytest.raises(TypeError, match="feature map 'odd-test-map' on q must return"):
            fastattn.linear_attention(x, x, x, feature_map="odd-test-map", backend="reference")
    finally:
        feature_maps.unregister("odd-test-map")


def test_elus_quick_underflow_check_agrees_with_the_full_one(monkeypatch):
    """The quick bound (from the first rows) may only say 'no underflow' where the full check
    does, also when the rows it does not read are of other sizes."""
    from fastattn.feature_maps import _BOUND_ROWS, Elu
    fmap, rng, seen = Elu(), np.random.default_rng(3), set()
    for trial in range(400):
        n = (5, 3 * _BOUND_ROWS)[trial % 2]
        rows = 10.0 ** rng.integers(-40, 3, size=(2, 1, 1)) if trial % 4 < 2 else \
            10.0 ** rng.integers(-40, 3, size=(1, n, 1))         # each row its own size
        k = (rng.standard_normal((2, n, 4)) * rows).astype(np.float32)
        v = (rng.standard_normal((2, n, 3)) * 10.0 ** rng.integers(-40, 3)).astype(np.float32)
        if trial % 7 == 0:
            v[1, :, 2] = 0   # a zero column: left out of the bound
        if trial % 11 == 0:
            k -= 120         # elu+1 features of e^-120
        quick = fmap.state_may_underflow(None, k, v)
        with monkeypatch.context() as m:
            m.setattr(Elu, "_clearly_above", staticmethod(lambda k, v: False))
            full = fmap.state_may_underflow(None, k, v)
        assert quick == full
        seen.add(full)
    assert seen == {True, False}   # both answers were exercised


def test_elus_quick_underflow_bound_clears_from_the_first_row_or_the_first_sixteen():
    """A NaN in rows 1-15 would stop the sixteen-row bound: the first row clears alone.  A
    value of 0 in the first row stops the first-row bound: the sixteen rows clear it."""
    from fastattn.feature_maps import _BOUND_ROWS, Elu
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((3, 4 * _BOUND_ROWS, 8)).astype(np.float32) for _ in range(2))
    nan_after_first = k.copy()
    nan_after_first[:, 1:_BOUND_ROWS, 0] = np.nan
    assert Elu._clearly_above(nan_after_first, v)
    zero_first = v.copy()
    zero_first[1, 0, 3] = 0
    assert Elu._clearly_above(k, zero_first)
    zero_first[1, :_BOUND_ROWS, 3] = 0   # neither bound clears: the full check decides
    assert not Elu._clearly_above(k, zero_first)


# --- a map is fixed once made: its kernels' arrays are cached from its attributes ----------
@pytest.mark.parametrize("attribute, value", [
    ("omega", np.ones((5, 8))), ("omega", np.ones((1, 1))), ("num_features", 32),
    ("d_k", 4), ("state_shift", 0.0),
])
def test_favor_features_refuse_a_new_attribute_and_keep_their_answer(attribute, value):
    favor = fastattn.FavorFeatures(8, num_features=16, random_state=3)
    q, k, v = make_qkv((2, 12, 8), dtype=np.float32, seed=4)
    before = fastattn.linear_attention(q, k, v, feature_map=favor, backend="reference")
    with pytest.raises(AttributeError, match=f"FavorFeatures.{attribute} is read-only"):
        setattr(favor, attribute, value)
    with pytest.raises(AttributeError, match="read-only"):
        delattr(favor, attribute)
    for backend in ("reference", *FAST_BACKENDS):
        assert_close(fastattn.linear_attention(q, k, v, feature_map=favor, backend=backend),
                     before)


@pytest.mark.parametrize("copy_of", [copy.copy, copy.deepcopy,
                                     lambda f: pickle.loads(pickle.dumps(f))])
def test_a_copied_or_unpickled_favor_map_stays_fixed(copy_of):
    favor = copy_of(fastattn.FavorFeatures(8, num_features=16, random_state=3))
    with pytest.raises(ValueError, match="read-only"):
        favor.omega[:] = 0    # in place, which the cached projections would not see
    with pytest.raises(AttributeError, match="read-only"):
        favor.omega = np.zeros((16, 8))


def test_a_subclass_of_favor_features_keeps_its_own_attributes_free():
    class Tagged(fastattn.FavorFeatures):
        def __init__(self, d_k):
            super().__init__(d_k)
            self.tag = "mine"

    tagged = Tagged(8)
    tagged.tag = "changed"
    assert tagged.tag == "changed"
    with pytest.raises(AttributeError, match="Tagged.omega is read-only"):
        tagged.omega = None


def test_an_unregistered_map_with_an_elementwise_no_kernel_applies_is_refused_by_name():
    class Sigmoid(fm.FeatureMap):
        name, elementwise = "sigmoid", "sigmoid"

        def feature_dim(self, d_k, num_features=None):
            return d_k

    q, k, v = make_qkv((6, 4))
    for backend in ("reference", *FAST_BACKENDS):
        with pytest.raises(ValueError, match="feature map Sigmoid: elementwise must be None or "
                                             "one of the maps the kernels apply .*got 'sigmoid'"):
            fastattn.linear_attention(q, k, v, feature_map=Sigmoid(), backend=backend)


def test_a_map_without_numpy_features_says_what_to_implement():
    class Bare(fm.FeatureMap):
        name = "bare"

        def feature_dim(self, d_k, num_features=None):
            return d_k

    q, k, v = make_qkv((6, 4))
    with pytest.raises(NotImplementedError, match="Bare must implement numpy_features"):
        fastattn.linear_attention(q, k, v, feature_map=Bare(), backend="reference")
