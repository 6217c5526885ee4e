"""MiniLM's GELU (fastattn.model.minilm._gelu_bias): the float32 Numba kernel against the
exact erf form in float64; no model extra needed."""

import numpy as np
import pytest
from scipy.special import erf

from fastattn.model.minilm import _gelu_bias


def exact(x):
    x = x.astype(np.float64)
    return x / 2 * (1 + erf(x / np.sqrt(2)))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (np.float64, 1e-15)])
def test_gelu_of_h_plus_b_in_place_matches_the_erf_form(dtype, tol):
    rng = np.random.default_rng(0)
    h = (rng.standard_normal((37, 1536)) * 4).astype(dtype)
    h[0, :8] = [0, -0.0, 1e-30, -1e-30, 30, -30, 1e4, -1e4]   # zeros, tiny, saturated
    b = (rng.standard_normal(1536) * 0.1).astype(dtype)
    x = h.astype(np.float64) + b
    want = exact(x)
    out = _gelu_bias(h, b)
    assert out is h and h.dtype == dtype
    # erf within ``tol`` (absolute), scaled by x/2, plus the output's own rounding
    assert (np.abs(h - want) <= tol * np.abs(x) + np.finfo(dtype).eps * np.abs(want)).all()


def test_gelu_keeps_nan_and_saturates_inf():
    h = np.array([[np.nan, np.inf, -np.inf, 0.0]], dtype=np.float32)
    out = _gelu_bias(h, np.zeros(4, np.float32))
    assert np.isnan(out[0, 0]) and out[0, 1] == np.inf and out[0, 3] == 0
    assert out[0, 2] == 0 or np.isnan(out[0, 2])   # -inf * 0: the erf form gives NaN too
