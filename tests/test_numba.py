"""Checks specific to the Numba backend (the shared edge-case matrix covers the rest).

Every kernel is held to the NumPy reference evaluated in float64, within the
tolerance of its dtype from ``conftest.TOLERANCES``.  Sizes are chosen
around the block and chunk edges of :mod:`fastattn._numba.config`.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import fastattn  # noqa: E402
from fastattn._numba import config, get_num_threads, set_num_threads  # noqa: E402
from fastattn._numba._exp import exp_array, exp_nonpositive_array  # noqa: E402
from fastattn.data import load_minilm  # noqa: E402

from conftest import assert_close, make_qkv, minilm_dir, reference64  # noqa: E402

DTYPES = [np.float32, np.float64]
BQ, BK, C, SEG = config.SOFTMAX_BLOCK_Q, config.SOFTMAX_BLOCK_K, config.LINEAR_CHUNK, config.LINEAR_SEGMENT

# (batch dims, n_q, n_k, d_k, d_v)
SOFTMAX_SHAPES = [
    ((), 1, 1, 4, 4),
    ((), 2, 2, 3, 5),
    ((2,), 7, 7, 8, 8),
    ((), 63, 63, 16, 8),
    ((), BQ - 1, BQ - 1, 8, 8),
    ((4,), BQ + 1, BQ + 1, 8, 8),  # enough work items for full-size query blocks
    ((4,), BQ - 1, BK + 1, 4, 4),
    ((), 1000, 1000, 8, 12),
    ((2, 3), 65, 65, 8, 4),
    ((), 70, 300, 8, 8),  # n_q < n_k: a decoder with a cache
    ((2,), 300, 70, 8, 8),  # n_q > n_k: the first rows see no key when causal
]
LINEAR_SHAPES = SOFTMAX_SHAPES + [
    ((), C - 1, C - 1, 8, 8),
    ((), C + 1, C + 1, 8, 8),
    ((), 3, SEG + 5, 4, 4),  # causal: more than one segment of keys before the first query
]


def _id(shape):
    lead, n_q, n_k, d_k, d_v = shape
    b = "x".join(map(str, lead)) or "1"
    return f"B{b}-nq{n_q}-nk{n_k}-dk{d_k}-dv{d_v}"


def _inputs(shape, dtype, seed=0, scale=1.0):
    lead, n_q, n_k, d_k, d_v = shape
    return make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, dtype=dtype, seed=seed, scale=scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=_id)
def test_softmax_matches_reference(shape, dtype, causal):
    q, k, v = _inputs(shape, dtype)
    copies = [x.copy() for x in (q, k, v)]
    out = fastattn.softmax_attention(q, k, v, causal=causal, backend="numba")
    assert out.dtype == dtype
    assert_close(out, reference64(fastattn.softmax_attention, q, k, v, causal=causal), dtype)
    for x, x0 in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, x0, err_msg="the kernel wrote into its input")


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=_id)
def test_linear_matches_reference(shape, dtype, causal, feature_map):
    q, k, v = _inputs(shape, dtype)
    kw = dict(causal=causal, feature_map=feature_map, return_state=True)
    out, (S, z) = fastattn.linear_attention(q, k, v, backend="numba", **kw)
    ref, (S_ref, z_ref) = reference64(fastattn.linear_attention, q, k, v, **kw)
    assert out.dtype == S.dtype == z.dtype == dtype
    assert_close(out, ref, dtype)
    n_k = shape[2]
    # S and z are sums over n_k keys: widen the tolerance with the length.
    assert_close(S, S_ref, dtype, scale=max(1.0, n_k / 100))
    assert_close(z, z_ref, dtype, scale=max(1.0, n_k / 100))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_non_contiguous_inputs(dtype):
    q, k, v = make_qkv((2, 40, 16), n_k=50, dtype=dtype, seed=3)
    qf, kf, vf = (np.asfortranarray(x) for x in (q, k, v))
    vs = np.repeat(v, 2, axis=-1)[..., ::2]  # a strided view equal to v
    assert not vs.flags.c_contiguous and np.array_equal(vs, v)
    for fn in (fastattn.softmax_attention, fastattn.linear_attention):
        a = fn(qf, kf, vs, causal=True, backend="numba")
        b = fn(q, k, v, causal=True, backend="numba")
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_state_carried_across_pieces_equals_one_pass(dtype, feature_map):
    q, k, v = make_qkv((2, 201, 8), d_v=6, dtype=dtype, seed=4)
    whole, (S_whole, z_whole) = fastattn.linear_attention(
        q, k, v, causal=True, feature_map=feature_map, return_state=True, backend="numba"
    )
    state, outs = None, []
    for lo, hi in [(0, 1), (1, C + 2), (C + 2, 150), (150, 201)]:
        out, state = fastattn.linear_attention(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], causal=True, feature_map=feature_map,
            initial_state=state, return_state=True, backend="numba",
        )
        outs.append(out)
    assert_close(np.concatenate(outs, axis=1), whole, dtype)
    assert_close(state[0], S_whole, dtype, scale=2)
    assert_close(state[1], z_whole, dtype, scale=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_non_finite_key_or_value_reaches_only_rows_that_see_it(kind, dtype):
    # Position j sits inside a diagonal block / chunk, not on its edge.
    n, j = 2 * BQ + 9, BQ + 5
    q, k, v = make_qkv((n, 8), dtype=dtype, seed=5)
    fn = fastattn.softmax_attention if kind == "softmax" else fastattn.linear_attention
    for bad_k, bad_v in [(np.nan, None), (None, np.inf), (None, np.nan)]:
        kk, vv = k.copy(), v.copy()
        if bad_k is not None:
            kk[j, 3] = bad_k
        if bad_v is not None:
            vv[j, 2] = bad_v
        out = fn(q, kk, vv, causal=True, backend="numba")
        assert np.isfinite(out[:j]).all(), "a row before the bad key was poisoned"
        assert_close(out[:j], fn(q[:j], k[:j], v[:j], causal=True, backend="reference"), dtype)
        assert not np.isfinite(out[j:]).all(axis=-1).any(), "a row that sees the bad key stayed finite"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_rows_that_see_no_key_are_zero(dtype):
    q, k, v = make_qkv((300, 8), n_k=70, dtype=dtype, seed=6)
    for fn in (fastattn.softmax_attention, fastattn.linear_attention):
        out = fn(q, k, v, causal=True, backend="numba")
        np.testing.assert_array_equal(out[: 300 - 70], 0)
        assert np.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_relu_zero_denominator_gives_zero(causal):
    q, k, v = make_qkv((130, 8), dtype=np.float32, seed=7)
    k = -np.abs(k) - 0.1  # every key negative: φ(k) = 0
    out = fastattn.linear_attention(q, k, v, feature_map="relu", causal=causal, eps=0.0, backend="numba")
    np.testing.assert_array_equal(out, 0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits_stay_finite_and_correct(causal):
    # |q·k| around 1e4 in float32, and scale > 1.
    q, k, v = make_qkv((300, 16), dtype=np.float32, seed=8, scale=25.0)
    out = fastattn.softmax_attention(q, k, v, causal=causal, scale=2.0, backend="numba")
    assert np.isfinite(out).all()
    ref = reference64(fastattn.softmax_attention, q, k, v, causal=causal, scale=2.0)
    # A logit's float32 rounding error is ~1e-3 here, so weights near a tie
    # move by that much: compare with the float32 tolerance widened 10x.
    assert_close(out, ref, np.float32, scale=10)


def test_minilm_shipped_slice_reproduces_context():
    acts = load_minilm()
    q, k, v = acts["q"], acts["k"], acts["v"]
    out = fastattn.softmax_attention(q, k, v, backend="numba")
    assert_close(out, acts["context"], np.float32)
    assert_close(out, reference64(fastattn.softmax_attention, q, k, v), np.float32)


def test_minilm_full_reproduces_context():
    path = minilm_dir()
    if path is None:
        pytest.skip("full MiniLM activations not found (set FASTATTN_MINILM_DIR)")
    acts = load_minilm(path / "minilm_l6_qkv_n512.npz")  # (6, 12, 512, 32)
    out = fastattn.softmax_attention(acts["q"], acts["k"], acts["v"], backend="numba")
    assert_close(out, acts["context"], np.float32)


def test_results_do_not_depend_on_thread_count():
    q, k, v = make_qkv((3, 300, 16), dtype=np.float32, seed=9)
    before = get_num_threads()
    try:
        results = []
        for n in (1, 2):
            set_num_threads(n)
            assert get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
            results.append([
                fastattn.softmax_attention(q, k, v, causal=True, backend="numba"),
                fastattn.linear_attention(q, k, v, causal=True, backend="numba"),
            ])
    finally:
        set_num_threads(before)
    for a, b in zip(*results):
        assert_close(a, b, np.float32)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_set_num_threads_refuses_non_positive_int(bad):
    with pytest.raises(ValueError, match="n_threads"):
        set_num_threads(bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_fast_exp_accuracy_and_special_values(dtype):
    lo, hi = (-103.0, 88.5) if dtype == np.float32 else (-740.0, 709.0)
    x = np.linspace(lo, hi, 200_001).astype(dtype)
    y = exp_array(x)
    exact = np.exp(x.astype(np.longdouble))
    normal = exact >= np.finfo(dtype).tiny
    ulps = np.abs(y[normal] - exact[normal]) / np.spacing(exact[normal].astype(dtype))
    assert ulps.max() <= 2.0, f"fast_exp is {ulps.max():.2f} ulp off"
    assert np.all(np.abs(y[~normal] - exact[~normal]) <= np.finfo(dtype).tiny)
    special = exp_array(np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1000.0, -1000.0], dtype))
    np.testing.assert_array_equal(special, np.array([0, np.inf, np.nan, 1, 1, np.inf, 0], dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_fast_exp_nonpositive_accuracy_and_special_values(dtype):
    lo = -103.0 if dtype == np.float32 else -745.0
    x = np.linspace(lo, 0.0, 200_001).astype(dtype)
    y = exp_nonpositive_array(x)
    exact = np.exp(x.astype(np.longdouble))
    normal = exact >= 8 * np.finfo(dtype).tiny  # below 2**-125 / 2**-1021 it flushes to 0
    ulps = np.abs(y[normal] - exact[normal]) / np.spacing(exact[normal].astype(dtype))
    assert ulps.max() <= 2.0, f"fast_exp_nonpositive is {ulps.max():.2f} ulp off"
    assert np.all(y[~normal] <= 8 * np.finfo(dtype).tiny)
    special = exp_nonpositive_array(np.array([-np.inf, np.nan, 0.0, -0.0, -1e30], dtype))
    np.testing.assert_array_equal(special, np.array([0, np.nan, 1, 1, 0], dtype))


def test_fastmath_flags_live_only_in_config():
    package = Path(config.__file__).parent
    for path in package.glob("*.py"):
        if path.name == "config.py":
            continue
        text = path.read_text()
        assert "fastmath" not in text.replace("fastmath flags", ""), f"{path.name} names fastmath"
        assert not re.search(r"\b(nnan|ninf)\b", text), path.name
    assert "nnan" not in config.FASTMATH and "ninf" not in config.FASTMATH


def test_cache_makes_a_new_process_load_instead_of_compile():
    # This process has compiled (or loaded) the float32 kernels by now.
    # A small call runs the kernels' serial twins, a larger one (with 2
    # threads) the parallel kernels: both are cached.
    for shape in ((1, 20, 8), (4, 300, 16)):
        q, k, v = make_qkv(shape, dtype=np.float32)
        fastattn.softmax_attention(q, k, v, backend="numba")
        fastattn.linear_attention(q, k, v, causal=True, backend="numba")
    code = (
        "import numpy as np, fastattn\n"
        "from fastattn._numba import softmax, linear\n"
        "from fastattn._numba._threads import serial_twin\n"
        "for shape in ((1, 20, 8), (4, 300, 16)):\n"
        "    q = np.ones(shape, np.float32)\n"
        "    fastattn.softmax_attention(q, q, q, backend='numba')\n"
        "    fastattn.linear_attention(q, q, q, causal=True, backend='numba')\n"
        "parallel = [softmax.online_softmax_forward, linear.segment_states, linear.chunk_outputs]\n"
        "kernels = parallel + [serial_twin(d) for d in parallel] + [linear.prefix_states]\n"
        "used = [d for d in kernels if d.signatures]\n"
        "print(sum(sum(d.stats.cache_hits.values()) for d in kernels),\n"
        "      sum(sum(d.stats.cache_misses.values()) for d in kernels), len(used))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )
    assert result.returncode == 0, result.stderr
    hits, misses, used = map(int, result.stdout.split())
    # At least the serial twins and the prefix sum ran; every kernel that ran was loaded.
    assert used >= 4, f"only {used} kernels ran"
    assert misses == 0 and hits == used, f"cache hits {hits}, misses {misses}, kernels run {used}"
