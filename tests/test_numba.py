"""Checks specific to the Numba backend: its polynomial exp, its fastmath flags,
its thread count and its disk cache.

What every backend must do (sizes around the blocks and chunks, layouts, pieces
of a causal sequence, NaN and inf, rows that see no key, large logits, MiniLM)
is checked once for all of them in ``test_edge_cases.py`` and ``test_minilm.py``.
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

from conftest import KERNEL_EDGES, assert_close, make_qkv  # noqa: E402

DTYPES = [np.float32, np.float64]


def test_the_shared_matrix_straddles_these_blocks():
    """``test_edge_cases.py`` places its sizes around these block and chunk sizes."""
    assert {
        "block_q": config.SOFTMAX_BLOCK_Q,
        "block_k": config.SOFTMAX_BLOCK_K,
        "chunk": config.LINEAR_CHUNK,
        "segment": config.LINEAR_SEGMENT,
    } == KERNEL_EDGES["numba"]


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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_order_keys_sort_as_the_floats_and_come_back(dtype):
    # The online softmax takes a row's maximum over these integer keys (a reduction LLVM
    # vectorises): their order must be the floats' and the round trip exact.
    from numba import njit

    from fastattn._numba._online import _from_order_key, _order_key

    @njit
    def keys(x):
        out = np.empty(x.size, dtype=np.int64)
        back = np.empty_like(x)
        for i in range(x.size):
            out[i] = _order_key(x[i])
            back[i] = _from_order_key(_order_key(x[i]), x[i])
        return out, back

    info = np.finfo(dtype)
    ordered = np.array([-np.inf, -info.max, -1.5, -info.tiny, -info.smallest_subnormal, -0.0,
                        0.0, info.smallest_subnormal, info.tiny, 1.0, info.max, np.inf, np.nan],
                       dtype=dtype)
    got, back = keys(ordered)
    assert np.all(np.diff(got) > 0)
    assert np.array_equal(back.view(f"u{dtype().itemsize}"), ordered.view(f"u{dtype().itemsize}"))
    assert keys(-ordered[-1:])[0][0] < got[0]        # a NaN with its sign bit: below -inf


def test_wide_vectors_marks_the_function_that_calls_it():
    # The hint is an LLVM function attribute on the kernel compiled with it, and on no other.
    from numba import njit

    from fastattn._numba.config import WIDE_VECTORS, wide_vectors

    def total(x):
        s = x.dtype.type(0)
        for i in range(x.size):
            s += x[i] * x[i]
        return s

    def wide_total(x):
        wide_vectors()
        return total_jit(x)

    total_jit = njit(fastmath=set(config.FASTMATH))(total)
    wide = njit(fastmath=set(config.FASTMATH))(wide_total)
    x = np.arange(1000, dtype=np.float32)
    assert wide(x) == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-5)
    (ir_wide,) = wide.inspect_llvm().values()
    (ir_plain,) = total_jit.inspect_llvm().values()
    assert WIDE_VECTORS in ir_wide
    # The function it calls, compiled apart, keeps LLVM's width.
    assert WIDE_VECTORS not in ir_plain


def test_wide_vectors_reach_the_registers_on_avx512():
    # Where LLVM's tuning keeps an unmarked loop at 256 bits (Intel's AVX-512 CPUs), the
    # marked twin runs in 512-bit registers.
    import llvmlite.binding as llvm
    from numba import njit

    features = (numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()).split(",")
    if "+avx512f" not in features:
        pytest.skip("no AVX-512 on this CPU")

    def scale_into(x, out):
        for i in range(x.size):
            out[i] = x[i] * np.float32(3) + np.float32(1)

    def wide_scale_into(x, out):
        config.wide_vectors()
        for i in range(x.size):
            out[i] = x[i] * np.float32(3) + np.float32(1)

    x = np.arange(4096, dtype=np.float32)
    asm = {}
    for name, f in (("plain", scale_into), ("wide", wide_scale_into)):
        jitted = njit(fastmath=set(config.FASTMATH))(f)
        out = np.empty_like(x)
        jitted(x, out)
        np.testing.assert_array_equal(out, x * np.float32(3) + np.float32(1))
        (asm[name],) = jitted.inspect_asm().values()
    if "zmm" in asm["plain"]:
        pytest.skip("LLVM's tuning for this CPU already takes 512-bit vectors")
    assert "zmm" in asm["wide"]


def _serial_helper_args(name):
    """Arguments of the types the kernels pass their serial helpers."""
    f32 = np.float32
    rows, cols, d = 256, 512, 16
    if name == "online_softmax_block":
        vec = [np.zeros(rows, f32) for _ in range(3)]
        return (np.zeros((rows, cols), f32), rows, cols, 1, True, f32(1), *vec,
                f32(-np.inf), f32(0))
    if name == "_query_block":
        q = np.ones((1, 300, d), f32)
        return (q, q, q, np.empty_like(q), 0, 0, False, np.array([1, -np.inf, 0], f32),
                np.empty(rows * cols, f32), np.empty((rows, d), f32), np.empty((rows, d), f32),
                np.empty(rows, f32), np.empty(rows, f32), np.empty(rows, f32))
    return (np.ones((64, d), f32), np.empty((64, d), f32), 0, f32(1), f32(0))    # _feature_map


@pytest.mark.parametrize("module, name", [
    ("_online", "online_softmax_block"),
    ("softmax", "_query_block"),
    ("linear", "_feature_map"),
    ("linear", "segment_states"),      # parallel: the hint sits in the prange body
    ("linear", "chunk_outputs"),
])
def test_the_kernels_ask_for_wide_vectors(module, name):
    # A fresh, uncached compilation of each kernel (a cached one cannot be inspected)
    # carries the attribute.
    import importlib

    from numba import njit

    kernel = getattr(importlib.import_module(f"fastattn._numba.{module}"), name)
    options = {key: value for key, value in kernel.targetoptions.items() if key != "nopython"}
    fresh = njit(**{**options, "cache": False})(kernel.py_func)
    if not kernel.targetoptions.get("parallel"):
        fresh(*_serial_helper_args(name))
        (llvm_ir,) = fresh.inspect_llvm().values()
    else:
        # The signature the parallel kernel ran with (two threads, enough work to split).
        if numba.config.NUMBA_NUM_THREADS < 2:
            pytest.skip("the parallel kernels run only on two threads or more")
        q, k, v = make_qkv((4, 600, 16), dtype=np.float32, seed=3)
        before = get_num_threads()
        try:
            set_num_threads(2)
            fastattn.linear_attention(q, k, v, backend="numba")
        finally:
            set_num_threads(before)
        assert kernel.signatures, f"{name} did not run"
        fresh.compile(kernel.signatures[0])
        llvm_ir = fresh.inspect_llvm(kernel.signatures[0])
    assert config.WIDE_VECTORS in llvm_ir
