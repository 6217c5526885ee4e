"""Shared test fixtures: the backends under test, tolerances, input factories.

Every parity test compares a kernel with a float64 answer, within the
tolerance of the kernel's dtype from :data:`TOLERANCES` (the one table): the
shared, backend-parametrized files with the independent oracles of
:mod:`oracles`, the per-backend files with the NumPy reference evaluated in
float64 (:func:`reference64`).
"""

import os
from pathlib import Path

import numpy as np
import pytest

import fastattn
from fastattn.compare import gaussian_qkv as make_qkv  # noqa: F401  (the one input factory)

#: One tolerance table per dtype (computation dtype of the kernel under test).
TOLERANCES = {
    np.dtype(np.float64): {"rtol": 1e-9, "atol": 1e-10},
    np.dtype(np.float32): {"rtol": 2e-4, "atol": 2e-5},
    np.dtype(np.float16): {"rtol": 2e-2, "atol": 2e-3},
}

def _backends_under_test():
    """Every backend that can run here; a new backend is tested by being available.

    ``FASTATTN_TEST_BACKENDS=cython`` (names separated by commas or blanks)
    narrows the backend-parametrized files to those backends, as the Cython
    tests' child runs under each ``FASTATTN_SIMD`` setting do.
    """
    available = fastattn.available_backends()
    wanted = os.environ.get("FASTATTN_TEST_BACKENDS", "").replace(",", " ").split()
    return tuple(b for b in available if b in wanted) if wanted else available


BACKENDS = _backends_under_test()
FAST_BACKENDS = tuple(b for b in BACKENDS if b != "reference")

#: The block, chunk and segment sizes of the fast kernels that the shared
#: matrices (``test_edge_cases.py``) place their sizes around, written out
#: here rather than read from the kernels so a test never takes its cases from
#: the code under test; each backend's own file checks they are still the
#: kernel's (``test_numba.py``, ``test_cython.py``).
KERNEL_EDGES = {
    "numba": {"block_q": 256, "block_k": 512, "chunk": 64, "segment": 1024},
    "cython": {"block_q": 256, "block_k": 512, "chunk": 64, "noncausal_chunk": 128},
}


def shape_id(shape):
    """Test id of a ``(lead, n_q, n_k, d_k, d_v)`` case: ``B2x3-nq65-nk65-dk8-dv4``."""
    lead, n_q, n_k, d_k, d_v = shape
    batch = f"B{'x'.join(map(str, lead))}-" if lead else ""
    return f"{batch}nq{n_q}-nk{n_k}-dk{d_k}-dv{d_v}"


def assert_close(actual, desired, dtype=None, err_msg="", scale=1.0):
    """``actual`` equals ``desired`` within the tolerance of ``dtype`` (default: actual's).

    ``scale`` widens the tolerance for sums that are long by construction.
    """
    dtype = np.dtype(dtype or actual.dtype)
    tol = TOLERANCES[dtype]
    assert actual.shape == desired.shape, f"shape {actual.shape} != {desired.shape} {err_msg}"
    np.testing.assert_allclose(
        actual, desired, rtol=tol["rtol"] * scale, atol=tol["atol"] * scale, err_msg=err_msg
    )


def reference64(fn, q, k, v, **kwargs):
    """``fn`` (softmax_attention or linear_attention) by the reference, in float64."""
    return fn(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
              backend="reference", **kwargs)


def minilm_dir():
    """The full MiniLM activations shipped in ../shared, or None.

    ``FASTATTN_MINILM_DIR`` overrides the location.
    """
    candidates = [os.environ.get("FASTATTN_MINILM_DIR")]
    here = Path(__file__).resolve().parent
    candidates += [str(p / "shared" / "data" / "minilm") for p in here.parents[:3]]
    for candidate in candidates:
        if candidate and Path(candidate, "minilm_l6_qkv_n128.npz").is_file():
            return Path(candidate)
    return None


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=FAST_BACKENDS or [pytest.param(None, marks=pytest.mark.skip("no fast backend built"))])
def fast_backend(request):
    return request.param
