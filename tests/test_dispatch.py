"""backend="auto" resolves by the call's shape to the backend its written rule names.

The expected names are written here from the rule in fastattn/_dispatch.py's
comments (the measurements), not read from the table under test.
"""

import importlib

import numpy as np
import pytest

import fastattn
from fastattn import _api, _dispatch

from conftest import BACKENDS, assert_close, make_qkv, reference64

ALL = ("cython", "numba", "reference")

# (kind, n_q, n_k, causal) -> (shape class, backend with all three available)
RULE = [
    (("linear", 1, 1, True), "step", "cython"),
    (("linear", 1, 1, False), "step", "cython"),
    (("softmax", 1, 1, False), "step", "cython"),
    (("softmax", 64, 64, True), "tiny", "cython"),
    (("softmax", 16, 256, False), "tiny", "cython"),
    (("linear", 8, 8, True), "tiny", "cython"),
    (("linear", 64, 64, False), "tiny", "cython"),
    (("softmax", 1, 32768, False), "decode", "cython"),
    (("softmax", 1, 8192, True), "decode", "cython"),
    (("softmax", 16, 1024, True), "decode", "cython"),
    (("linear", 1, 8192, False), "decode", "cython"),
    (("linear", 16, 4096, True), "decode", "cython"),
    (("softmax", 128, 128, True), "short", "cython"),
    (("softmax", 512, 512, True), "short", "cython"),
    (("softmax", 256, 256, False), "short", "cython"),
    (("linear", 128, 128, True), "short", "cython"),
    (("linear", 512, 512, False), "short", "cython"),
    (("softmax", 513, 513, True), "long", "cython"),
    (("softmax", 8192, 8192, False), "long", "cython"),
    (("linear", 1024, 1024, True), "long", "cython"),
    (("linear", 4096, 4096, False), "long", "cython"),
]
IDS = [f"{k}-nq{nq}-nk{nk}-{'causal' if c else 'full'}" for (k, nq, nk, c), _, _ in RULE]


@pytest.mark.parametrize("call, regime, want", RULE, ids=IDS)
def test_auto_follows_the_written_rule(call, regime, want):
    kind, n_q, n_k, causal = call
    assert _dispatch.shape_class(kind, n_q, n_k, causal) == (kind, regime, causal)
    for dtype in (np.float32, np.float64):
        assert _dispatch.auto_backend(kind, 8, n_q, n_k, 64, 64, causal, np.dtype(dtype), ALL) == want
    # Falls through to what is available, the reference last.
    other = "numba" if want == "cython" else "cython"
    assert _dispatch.auto_backend(kind, 1, n_q, n_k, 64, 64, causal, np.float32,
                                  (other, "reference")) == other
    assert _dispatch.auto_backend(kind, 1, n_q, n_k, 64, 64, causal, np.float32,
                                  ("reference",)) == "reference"


def test_every_shape_class_has_a_rule_ending_in_the_reference():
    classes = {(k, r, c) for k in ("softmax", "linear") for c in (False, True)
               for r in ("step", "tiny", "decode", "short", "long")}
    assert set(_dispatch.AUTO_RULE) == classes
    assert all(rule[-1] == "reference" for rule in _dispatch.AUTO_RULE.values())


@pytest.mark.parametrize("call, regime, want", [r for r in RULE if r[0][1] * r[0][2] <= 256 * 256],
                         ids=[i for i, r in zip(IDS, RULE) if r[0][1] * r[0][2] <= 256 * 256])
def test_auto_calls_run_the_rule_backend(call, regime, want, monkeypatch):
    """softmax_attention / linear_attention(backend="auto") run the backend the rule names."""
    kind, n_q, n_k, causal = call
    available = fastattn.available_backends()
    expected = next(b for b in _dispatch.AUTO_RULE[(kind, regime, causal)] if b in available)
    q, k, v = make_qkv((2, n_q, 8), n_k=n_k, dtype=np.float32, seed=n_q)
    resolved = _dispatch.backend_name_for_call("auto", kind, q, k, v, causal, np.float32)
    assert resolved == expected
    module = _dispatch.backend_for_call("auto", kind, q, k, v, causal, np.float32, "elu")
    if regime == "step" and kind == "linear" and expected != "reference":
        assert module is importlib.import_module(_dispatch.RECURRENT_STEP_MODULES[expected])
    else:
        assert module is _api.get_backend(expected)
    fn = fastattn.softmax_attention if kind == "softmax" else fastattn.linear_attention
    assert_close(fn(q, k, v, causal=causal), reference64(fn, q, k, v, causal=causal), np.float32)


def test_explicit_backends_are_not_overridden():
    q, k, v = make_qkv((2, 128, 8), dtype=np.float32)
    for name in BACKENDS:
        for kind in ("softmax", "linear"):
            assert _dispatch.backend_name_for_call(name, kind, q, k, v, True, np.float32) == name
    with pytest.raises(ValueError, match="backend must be"):
        fastattn.softmax_attention(q, k, v, backend="fortran")
    with pytest.raises(ValueError, match="backend must be"):
        fastattn.linear_attention(q[:, :1], k[:, :1], v[:, :1], backend=["cython"])


def test_recurrent_step_only_for_one_token_and_its_feature_maps():
    assert _dispatch.use_recurrent_step("cython", "linear", 1, 1, "elu")
    assert _dispatch.use_recurrent_step("numba", "linear", 1, 1, "relu")
    assert not _dispatch.use_recurrent_step("reference", "linear", 1, 1, "elu")
    assert not _dispatch.use_recurrent_step("cython", "linear", 1, 2, "elu")
    assert not _dispatch.use_recurrent_step("cython", "linear", 2, 2, "elu")
    assert not _dispatch.use_recurrent_step("cython", "softmax", 1, 1, None)
    assert not _dispatch.use_recurrent_step("cython", "linear", 1, 1, "favor")
    assert not _dispatch.use_recurrent_step("cython", "linear", 1, 1, lambda x: x)
