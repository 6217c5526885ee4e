"""The seed experiment and the quality metrics, against a from-scratch computation."""

import numpy as np
import pytest
from scipy.special import softmax as scipy_softmax

import fastattn


def _seed_inputs(n, d, seed):
    np.random.seed(seed)
    q = np.random.randn(n, d).astype(np.float32) * 0.5
    k = np.random.randn(n, d).astype(np.float32) * 0.5
    v = np.random.randn(n, d).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("n, d, seed", [(64, 32, 42), (17, 5, 0)])
def test_seed_experiment_matches_a_direct_computation(n, d, seed):
    q, k, v = (x.astype(np.float64) for x in _seed_inputs(n, d, seed))
    soft = scipy_softmax(q @ k.T / np.sqrt(d), axis=1) @ v
    fq = np.where(q > 0, q + 1, np.exp(q))
    fk = np.where(k > 0, k + 1, np.exp(k))
    lin = (fq @ (fk.T @ v)) / (fq @ fk.sum(axis=0) + 1e-6)[:, None]
    cos = np.mean(np.sum(soft * lin, 1) / np.linalg.norm(soft, axis=1) / np.linalg.norm(lin, axis=1))

    result = fastattn.compare(n, d, seed=seed)
    np.testing.assert_allclose(result.quality.cosine_similarity, cos, rtol=1e-5)
    np.testing.assert_allclose(result.quality.mse, np.mean((lin - soft) ** 2), rtol=1e-4)
    np.testing.assert_allclose(
        result.quality.magnitude_ratio, np.linalg.norm(lin) / np.linalg.norm(soft), rtol=1e-5
    )
    assert result.softmax_weights.shape == result.linear_weights.shape == (n, n)
    np.testing.assert_allclose(result.softmax_weights, scipy_softmax(q @ k.T / np.sqrt(d), axis=1),
                               rtol=1e-4, atol=1e-7)


def test_quality_of_identical_outputs_is_perfect():
    x = np.random.default_rng(0).standard_normal((5, 7, 3))
    q = fastattn.quality(x, x)
    assert q.cosine_similarity == pytest.approx(1.0)
    assert q.mse == 0.0
    assert q.magnitude_ratio == pytest.approx(1.0)


def test_quality_of_scaled_and_flipped_outputs():
    x = np.random.default_rng(1).standard_normal((6, 4))
    q = fastattn.quality(x, -2 * x)
    assert q.cosine_similarity == pytest.approx(-1.0)
    assert q.magnitude_ratio == pytest.approx(2.0)
    assert q.mse == pytest.approx(9 * np.mean(x ** 2))


def test_quality_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"same shape.*\(2, 3\).*\(3, 2\)"):
        fastattn.quality(np.zeros((2, 3)), np.zeros((3, 2)))


def test_compare_refuses_bad_sizes():
    with pytest.raises(ValueError, match="n must be a positive int"):
        fastattn.compare(0, 4)
    with pytest.raises(ValueError, match="d must be a positive int"):
        fastattn.compare(4, -1)
    with pytest.raises(ValueError, match=r"seed must be an int from 0 to 2\*\*32 - 1"):
        fastattn.compare(4, 4, seed=2**32)
    for args, name in (((4, 2.5), "d"), (("8", 4), "n"), ((4, 4, 1.0), "seed"), ((True, 4), "n")):
        with pytest.raises(TypeError, match=f"{name} must be an int, got"):
            fastattn.compare(*args)


def test_quality_never_turns_nan_or_inf_into_a_finite_number():
    ones = np.ones((3, 4))
    nan = np.full((3, 4), np.nan)
    q = fastattn.quality(nan, ones)
    assert np.isnan(q.cosine_similarity) and np.isnan(q.mse) and np.isnan(q.magnitude_ratio)
    with_inf = ones.copy()
    with_inf[0, 0] = np.inf
    q = fastattn.quality(ones, with_inf)
    assert np.isnan(q.cosine_similarity) and q.mse == np.inf and q.magnitude_ratio == np.inf


def test_quality_refuses_complex_and_scalar_outputs():
    with pytest.raises(TypeError, match="reference_out must hold real numbers"):
        fastattn.quality(np.ones(3) + 1j, np.ones(3))
    with pytest.raises(ValueError, match=r"approx_out must have at least 1 dimension"):
        fastattn.quality(np.ones(1), np.float64(1.0))


def test_an_interrupted_compare_claims_no_results_file(monkeypatch, capsys):
    import importlib

    from fastattn.cli import main

    module = importlib.import_module("fastattn.compare")   # fastattn.compare is the function

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "compare", interrupted)
    assert main(["compare", "--n", "8", "--d", "4"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "fastattn compare: interrupted"   # compare keeps no results file


def test_compare_memory_estimate_covers_its_measured_peak():
    # The check before compare() must count what it then allocates: it estimated 12
    # bytes per score and peaked at 41, so a call that passed the check failed in NumPy.
    import tracemalloc

    from fastattn.compare import COMPARE_BYTES_PER_SCORE, seed_experiment_bytes

    n, d = 1024, 32
    fastattn.compare(8, d)   # imports and first-call allocations out of the measurement
    tracemalloc.start()
    try:
        fastattn.compare(n, d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    estimate = seed_experiment_bytes(n, d, COMPARE_BYTES_PER_SCORE)
    assert peak <= estimate <= 1.5 * peak, (peak, estimate)
