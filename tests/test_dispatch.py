"""backend="auto" and the choice of kernel module for a call.

``auto`` takes the first of cython, numba, reference that runs here and is
suitable (Numba without a disk cache is not).  The expected names are written
here, not read from fastattn._backends.
"""

import importlib

import numpy as np
import pytest

import fastattn
from fastattn import _backends, feature_maps

from conftest import BACKENDS, assert_close, make_qkv, reference64

#: The order auto follows, written out: the fastest backend first.
EXPECTED_ORDER = ("cython", "numba", "reference")

MODULES = {"reference": "fastattn.reference", "numba": "fastattn._numba",
           "cython": "fastattn._cython"}
DECODE_MODULES = {"numba": "fastattn._numba.decode", "cython": "fastattn._cython.decode"}


@pytest.fixture
def pretend(monkeypatch):
    """``pretend(unavailable=..., unsuitable=...)``: the registry sees those backends so."""
    def setup(unavailable=(), unsuitable=()):
        loaded = {name: object() for name in EXPECTED_ORDER if name not in unavailable}
        monkeypatch.setattr(_backends, "_loaded", loaded)
        monkeypatch.setattr(_backends, "_unavailable", {name: "ImportError: pretend"
                                                        for name in unavailable})
        monkeypatch.setattr(_backends, "_not_for_auto", {name: "pretend" for name in unsuitable})
    return setup


@pytest.mark.parametrize("unavailable, unsuitable, want", [
    ((), (), "cython"),
    (("cython",), (), "numba"),
    (("cython", "numba"), (), "reference"),
    ((), ("cython",), "numba"),
    (("cython",), ("numba",), "reference"),
    (("numba",), (), "cython"),
], ids=["all", "no-cython", "reference-only", "cython-unsuitable", "numba-unsuitable",
        "no-numba"])
def test_auto_takes_the_first_available_suitable_backend(pretend, unavailable, unsuitable, want):
    pretend(unavailable, unsuitable)
    assert _backends.auto_backend() == want
    assert _backends.backend_name("auto") == want
    assert fastattn.available_backends() == tuple(b for b in EXPECTED_ORDER
                                                  if b not in unavailable)


def test_auto_is_the_same_for_every_shape_and_dtype(pretend):
    """One auto: no shape classes, the first suitable backend for a step and for n = 8192."""
    pretend(unavailable=("cython",))
    for kind in ("softmax", "linear"):
        for n_q, n_k in ((1, 1), (1, 32768), (16, 1024), (8192, 8192)):
            assert _backends.kernel_module("auto", kind, n_q, n_k) is _backends._loaded["numba"]


@pytest.mark.parametrize("kind, n_q, n_k, causal", [
    ("linear", 1, 1, True), ("softmax", 1, 1, False), ("softmax", 64, 64, True),
    ("softmax", 1, 4096, False), ("linear", 16, 2048, True), ("softmax", 300, 300, True),
    ("linear", 512, 512, False),
], ids=lambda x: str(x))
def test_auto_calls_run_the_first_backend_here(kind, n_q, n_k, causal):
    """softmax_attention / linear_attention(backend="auto") run the first backend of the order."""
    want = next(b for b in EXPECTED_ORDER if b in fastattn.available_backends()
                and b not in _backends._not_for_auto)
    assert _backends.backend_name("auto") == want
    module = _backends.kernel_module("auto", kind, n_q, n_k, "elu")
    if kind == "linear" and n_q == n_k == 1 and want != "reference":
        assert module is importlib.import_module(DECODE_MODULES[want])
    else:
        assert module is importlib.import_module(MODULES[want])
    q, k, v = make_qkv((2, n_q, 8), n_k=n_k, dtype=np.float32, seed=n_q)
    fn = fastattn.softmax_attention if kind == "softmax" else fastattn.linear_attention
    assert_close(fn(q, k, v, causal=causal), reference64(fn, q, k, v, causal=causal), np.float32)


def test_explicit_backends_are_not_overridden():
    q, k, v = make_qkv((2, 128, 8), dtype=np.float32)
    for name in BACKENDS:
        assert _backends.backend_name(name) == name
        module = _backends.kernel_module(name, "softmax", 128, 128)
        assert module is importlib.import_module(MODULES[name])
    with pytest.raises(ValueError, match="backend must be"):
        fastattn.softmax_attention(q, k, v, backend="fortran")
    with pytest.raises(ValueError, match="backend must be"):
        fastattn.linear_attention(q[:, :1], k[:, :1], v[:, :1], backend=["cython"])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_recurrent_step_only_for_one_token_and_elementwise_maps(backend):
    step = importlib.import_module(DECODE_MODULES[backend])
    whole = importlib.import_module(MODULES[backend])
    for name in ("elu", "relu"):
        assert _backends.kernel_module(backend, "linear", 1, 1, name) is step
    for n_q, n_k in ((1, 2), (2, 2), (2, 1)):
        assert _backends.kernel_module(backend, "linear", n_q, n_k, "elu") is whole
    assert _backends.kernel_module(backend, "softmax", 1, 1) is whole
    assert _backends.kernel_module(backend, "linear", 1, 1, None) is whole


def test_only_elu_and_relu_are_applied_inside_the_kernels():
    """What the step rule above is given: a map's ``elementwise`` name."""
    assert feature_maps.resolve("elu", 4).elementwise == "elu"
    assert feature_maps.resolve("relu", 4).elementwise == "relu"
    for fmap in ("favor", "taylor", lambda x: x):
        assert feature_maps.resolve(fmap, 4).elementwise is None


def test_reference_has_no_decode_module():
    assert _backends.decode_module("reference") is None
    assert _backends.kernel_module("reference", "linear", 1, 1, "elu") is fastattn.reference
