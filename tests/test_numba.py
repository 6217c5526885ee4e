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
    # Where the CPU has AVX-512, LLVM vectorises the marked loop in 512-bit registers;
    # unmarked, LLVM's Intel tuning keeps 256 bits (AMD's may not: only the marked one is
    # asserted).
    import llvmlite.binding as llvm
    from numba import njit

    from fastattn._numba.config import wide_vectors

    if "+avx512f" not in llvm.get_host_cpu_features().flatten().split(","):
        pytest.skip("no AVX-512 on this CPU")

    @njit(fastmath=set(config.FASTMATH))
    def scale_into(x, out):
        wide_vectors()
        for i in range(x.size):
            out[i] = x[i] * np.float32(3) + np.float32(1)

    x = np.arange(4096, dtype=np.float32)
    out = np.empty_like(x)
    scale_into(x, out)
    np.testing.assert_array_equal(out, x * np.float32(3) + np.float32(1))
    (asm,) = scale_into.inspect_asm().values()
    assert "zmm" in asm
