"""Row metrics of attention weights: KL divergence from softmax's rows and entropy.

Expected values are written by hand or computed by :func:`scipy.stats.entropy`
(an implementation independent of fastattn's).
"""

import math

import numpy as np
import pytest
from scipy.stats import entropy as scipy_entropy

import fastattn
from conftest import make_qkv


def test_kl_and_entropy_of_a_small_example_by_hand():
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[0.25, 0.25, 0.5], [0.4, 0.3, 0.3]]) * 2  # rows normalised before use
    kl = fastattn.row_kl_divergence(p, q)
    np.testing.assert_allclose(kl, [math.log(2),
                                    0.2 * math.log(0.5) + 0.5 * math.log(5 / 3)], rtol=1e-14)
    np.testing.assert_allclose(fastattn.row_entropy(p), [math.log(2), -(
        0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5))], rtol=1e-14)


def test_identical_rows_have_zero_kl_and_uniform_rows_entropy_ln_n():
    w = np.random.default_rng(0).random((2, 5, 7))
    np.testing.assert_allclose(fastattn.row_kl_divergence(w, w), 0, atol=1e-15)
    np.testing.assert_allclose(fastattn.row_entropy(np.ones((3, 9))), math.log(9), rtol=1e-14)


def test_zero_weight_where_the_reference_weighs_is_infinite_kl():
    p = np.array([[0.5, 0.5], [0.5, 0.5]])
    q = np.array([[1.0, 0.0], [0.0, 0.0]])  # a relu row with no overlap is all zeros
    assert np.isinf(fastattn.row_kl_divergence(p, q)).all()
    np.testing.assert_array_equal(np.isnan(fastattn.row_entropy(q)), [False, True])


def test_rows_that_are_no_distribution_are_nan_and_left_out_of_the_means():
    # Causal with n_q > n_k: the first rows see no key and are all zeros.
    q, k, _ = make_qkv((2, 9, 4), n_k=5, seed=3)
    soft = fastattn.attention_weights(q, k, causal=True)
    lin = fastattn.attention_weights(q, k, kind="linear", causal=True)
    kl = fastattn.row_kl_divergence(soft, lin)
    assert np.isnan(kl[:, :4]).all() and np.isfinite(kl[:, 4:]).all()
    summary = fastattn.weight_quality(soft, lin)
    assert summary.kl_divergence == pytest.approx(np.mean(kl[:, 4:]), rel=1e-12)
    # The row that sees one key has entropy 0 in both.
    np.testing.assert_allclose(fastattn.row_entropy(soft)[:, 4], 0, atol=1e-12)


def test_a_nan_weight_makes_its_row_and_the_means_nan():
    p = np.full((3, 4), 0.25)
    q = p.copy()
    q[1, 2] = np.nan
    assert np.isnan(fastattn.row_kl_divergence(p, q)).tolist() == [False, True, False]
    assert math.isnan(fastattn.weight_quality(p, q).kl_divergence)
    assert math.isnan(fastattn.weight_quality(p, q).entropy)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor", "taylor"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_compare_attention_reports_the_row_metrics_of_its_weights(feature_map, causal):
    q, k, v = make_qkv((2, 24, 8), seed=5)
    result = fastattn.compare_attention(q, k, v, feature_map=feature_map, causal=causal)
    sw, lw = result.softmax_weights, result.linear_weights
    kl, h, h_ref = [], [], []
    for p_row, q_row in zip(sw.reshape(-1, 24), lw.reshape(-1, 24)):
        kl.append(scipy_entropy(p_row, q_row))
        h.append(scipy_entropy(q_row))
        h_ref.append(scipy_entropy(p_row))
    wq = result.weight_quality
    assert isinstance(wq, fastattn.WeightQuality)
    assert wq.kl_divergence == pytest.approx(np.mean(kl), rel=1e-10)
    assert wq.entropy == pytest.approx(np.mean(h), rel=1e-10)
    assert wq.reference_entropy == pytest.approx(np.mean(h_ref), rel=1e-10)
    assert "row KL" in wq.format()


@pytest.mark.parametrize("args, exc, match", [
    ((np.ones((2, 3)), np.ones((3, 2))), ValueError, "same shape"),
    ((np.ones((2, 3)), -np.ones((2, 3))), ValueError, "approx_weights must be non-negative"),
    ((np.ones((2, 3)).astype(complex), np.ones((2, 3))), TypeError, "reference_weights must hold real"),
    ((np.float64(1.0), np.float64(1.0)), ValueError, "at least 1 dimension"),
], ids=["shapes", "negative", "complex", "0-d"])
def test_bad_weights_are_refused(args, exc, match):
    with pytest.raises(exc, match=match):
        fastattn.weight_quality(*args)
