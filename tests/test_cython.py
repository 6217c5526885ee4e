"""What is the Cython backend's own: the built extension, its instruction sets
(``FASTATTN_SIMD``), its register-blocked products, its work items and runs of
chunks, its aligned buffers, its OpenMP and BLAS thread counts.

Each case compares the kernel with the float64 oracles of ``oracles.py``
(written from the definitions, never calling fastattn), within the tolerance of
its dtype (``conftest.TOLERANCES``).  What every
backend must do (sizes around the blocks and chunks, layouts, pieces of a
causal sequence, NaN and inf, rows that see no key, large logits, MiniLM) is
checked once for all of them in ``test_edge_cases.py`` and ``test_minilm.py``;
``test_every_instruction_set_passes_the_kernel_tests`` reruns those for this
backend under each instruction set.
"""

import hashlib
import importlib.machinery
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import fastattn
from conftest import KERNEL_EDGES, assert_close, make_qkv, shape_id
from oracles import linear_oracle, softmax_oracle

try:
    import fastattn._cython as cy
except ImportError as exc:   # not built: the build test fails, the others skip
    cy, BUILD_ERROR = None, exc
else:
    BUILD_ERROR = None

BQ, BK, CH = (cy.BLOCK_Q, cy.BLOCK_K, cy.CHUNK) if cy is not None else (256, 256, 64)
NC = cy._linear.NONCAUSAL_CHUNK if cy is not None else 128
DTYPES = (np.float32, np.float64)

#: Cases that take the register-blocked tile products where the CPU has them
#: (d_k and d_v multiples of 16 in float32, of 8 in float64): sizes around their 6-row
#: groups, panels of 16 (8) keys, groups of 4 panels, 4-vector chunks of v and
#: the 1024-key packing chunks.
PRODUCT_CASES = [
    ((), 1, 1, 16, 16),
    ((2,), 77, 300, 8, 24),      # float64 only: float32 takes BLAS
    ((2,), 7, 70, 16, 32),
    ((), 65, 63, 32, 16),
    ((3,), 300, 517, 64, 64),
    ((), 5, 1100, 48, 80),
    ((), BQ + 1, BK + 17, 64, 128),
    ((), 1000, 1000, 128, 128),
]


def _inputs(case, dtype, seed=0):
    lead, n_q, n_k, d_k, d_v = case
    return make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, dtype=dtype, seed=seed)


_EXPECTED = {}


def _expected(kind, q, k, v, causal, S0=None, z0=None):
    """The float64 oracle of ``kind`` ("softmax", or "linear" with elu and eps 1e-6)
    for these inputs: softmax's output, or linear attention's ``(out, S, z)``.

    Computed once per distinct input, however many thread counts or modes a
    test runs it under.
    """
    key = (kind, bool(causal)) + tuple(
        None if x is None else (x.shape, x.dtype.str, hashlib.sha1(np.ascontiguousarray(x)).digest())
        for x in (q, k, v, S0, z0))
    if key not in _EXPECTED:
        with np.errstate(invalid="ignore", over="ignore"):
            _EXPECTED[key] = (softmax_oracle(q, k, v, causal) if kind == "softmax"
                              else linear_oracle(q, k, v, "elu", causal, 1e-6, S0, z0))
    return _EXPECTED[key]


@pytest.fixture(autouse=True)
def _needs_the_extension(request):
    if cy is None and request.node.originalname != "test_imported_module_is_the_compiled_extension":
        pytest.skip(f"Cython extensions not built: {BUILD_ERROR}")


def test_imported_module_is_the_compiled_extension():
    assert cy is not None, f"fastattn._cython cannot be imported: {BUILD_ERROR}"
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for name in ("softmax", "linear", "_blas", "_openmp"):
        module = getattr(cy, name)
        assert module.__file__.endswith(suffixes), f"{name} is not compiled: {module.__file__}"
        assert module.__file__.endswith(".so") or module.__file__.endswith(".pyd")
    assert "cython" in fastattn.available_backends()
    # Calls through the public API have loaded every .pyx of the package as its
    # compiled extension (no pure-Python or pyximport stand-in).
    q = np.ones((2, 3, 4))
    fastattn.softmax_attention(q, q, q, backend="cython")
    fastattn.linear_attention(q, q, q, causal=True, backend="cython")
    sources = sorted(Path(cy.__file__).parent.glob("*.pyx"))
    assert sources
    for source in sources:
        module = sys.modules.get(f"fastattn._cython.{source.stem}")
        assert module is not None, f"{source.name} was not loaded by the calls"
        assert module.__file__.endswith(suffixes), f"{source.stem} is not compiled: {module.__file__}"


def test_the_shared_matrix_straddles_these_blocks():
    """``test_edge_cases.py`` places its sizes around these block and chunk sizes."""
    assert {"block_q": BQ, "block_k": BK, "chunk": CH, "noncausal_chunk": NC} == \
        KERNEL_EDGES["cython"]


def _expected_tile_products():
    """The instruction set the register-blocked products should take here, from
    /proc/cpuinfo and FASTATTN_SIMD, or skip."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    best = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else None
    cap = os.environ.get("FASTATTN_SIMD", "").strip().lower()
    if cap == "off":
        return None
    if cap == "avx2" and best == "avx512":
        return "avx2"
    return best


def test_tiles_take_the_best_products_the_cpu_has():
    from fastattn._cython.softmax import _build_features

    features = _build_features()
    if not features["tile_products_built"]:
        pytest.skip("built without the register-blocked products (not gcc on x86-64 Linux)")
    assert features["tile_products"] == _expected_tile_products()


_PRODUCTS_IN_A_CHILD = (
    "import warnings, json\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    import fastattn\n"
    "    fastattn.available_backends()   # imports the backends, as a user's first call\n"
    "import fastattn._cython as cy\n"
    "print(json.dumps({'isa': [m._products_isa() for m in (cy.softmax, cy.linear, cy.decode)],\n"
    "                  'warnings': [str(w.message) for w in caught],\n"
    "                  'sources': [w.filename for w in caught]}))\n"
)


@pytest.mark.parametrize("value, held", [
    ("off", None), ("OFF", None), (" Off ", None), ("off\n", None), ("avx2", "avx2"),
    ("AVX2", "avx2"),
    ("banana", "default"), ("", "default"),
])
def test_simd_cap_is_read_alike_by_every_extension(value, held):
    """FASTATTN_SIMD in any case and with blanks; an unknown value is ignored with a
    warning that names it; every extension holds the same set."""
    import json

    if "FASTATTN_SIMD" in os.environ:
        pytest.skip("this is a child run with FASTATTN_SIMD set")
    default = _expected_tile_products()
    if held == "avx2" and default != "avx512":
        held = default            # the cap only lowers: without AVX-512 it changes nothing
    if held == "default":
        held = default
    run = subprocess.run([sys.executable, "-c", _PRODUCTS_IN_A_CHILD],
                         env=dict(os.environ, FASTATTN_SIMD=value), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["isa"] == [held] * 3
    unknown = value.strip() != "" and value.strip().lower() not in ("off", "avx2")
    assert any("banana" in w and "FASTATTN_SIMD" in w for w in got["warnings"]) == unknown
    # Attributed to the user's import (the child's -c script), not a line of fastattn.
    assert all(source == "<string>" for source in got["sources"]), got["sources"]


@pytest.mark.parametrize("cap", ["avx2", "off"])
def test_every_instruction_set_passes_the_kernel_tests(cap):
    """This file, the decode tests and the shared edge-case and MiniLM tests
    (for this backend alone), rerun in a child held to the AVX2 loops (on an
    AVX-512 CPU) or to BLAS (``FASTATTN_SIMD``), so every path a CPU can take is
    tested on the one that runs the suite."""
    if os.environ.get("FASTATTN_SIMD"):
        pytest.skip("this is the child run")
    default = _expected_tile_products()
    if cap == "avx2" and default != "avx512":
        pytest.skip("the AVX2 loops are this CPU's own (or it has none): the suite ran them")
    if cap == "off" and default is None:
        pytest.skip("BLAS is this CPU's own path: the suite ran it")
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(os.path.join(here, name) for name in ("test_cython.py", "test_decode.py",
                                                  "test_edge_cases.py", "test_minilm.py"))],
        env=dict(os.environ, FASTATTN_SIMD=cap, FASTATTN_TEST_BACKENDS="cython"), cwd=here,
        capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("case", PRODUCT_CASES, ids=shape_id)
def test_softmax_tile_products_match_the_oracle(case, dtype, causal):
    q, k, v = _inputs(case, dtype, seed=3)
    before = cy.get_num_threads()
    for threads in (1, 2):
        cy.set_num_threads(threads)
        try:
            got = fastattn.softmax_attention(q, k, v, causal=causal, backend="cython")
        finally:
            cy.set_num_threads(before)
        assert_close(got, _expected("softmax", q, k, v, causal), dtype,
                     err_msg=f"{threads} threads")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.intc], ids=["f32", "f64", "intc"])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5, 7), (2, 0, 4), (1000,)], ids=str)
def test_aligned_empty_starts_on_a_cache_line(shape, dtype):
    from fastattn._cython._aligned import ALIGNMENT, aligned_empty

    for _ in range(4):            # a few allocations: the allocator's offsets vary
        a = aligned_empty(shape, dtype)
        assert a.size == 0 or a.ctypes.data % ALIGNMENT == 0    # no element, no boundary
        assert a.shape == shape and a.dtype == np.dtype(dtype)
        assert a.flags.c_contiguous and a.flags.writeable
        a[...] = 1
        assert (a == 1).all()


def test_kernel_outputs_start_on_a_cache_line():
    q = make_qkv((3, 130, 64), dtype=np.float32, seed=5)[0]
    for got in (fastattn.softmax_attention(q, q, q, backend="cython"),
                fastattn.linear_attention(q, q, q, backend="cython"),
                fastattn.linear_attention(q, q, q, causal=True, backend="cython")):
        assert got.ctypes.data % 64 == 0


def _copy_at(x, offset):
    """A C-contiguous copy of ``x`` starting ``offset`` bytes past a 64-byte boundary."""
    raw = np.empty(x.nbytes + 128, dtype=np.uint8)
    start = -raw.ctypes.data % 64 + offset
    out = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    assert out.ctypes.data % 64 == offset
    return out


@pytest.mark.parametrize("head_items", [1, 10 ** 9], ids=["head-items", "block-items"])
@pytest.mark.parametrize("offset", [0, 16], ids=["v64", "v16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("n_q,n_k", [(BQ + 44, 517), (70, 1100)], ids=lambda n: str(n))
def test_softmax_work_items_of_whole_heads(n_q, n_k, dtype, causal, offset, head_items,
                                           monkeypatch):
    # With HEAD_ITEMS heads a thread or more, a work item is a whole head whose
    # keys and values the thread packs into its own buffer; else the keys and
    # values are packed 1024 keys at a time, shared out by the threads.  17
    # heads of 2 query blocks (one partial) or of 1100 keys (two packing
    # chunks), each mode forced, 1 and 2 threads; v on and off a 64-byte
    # boundary, 48 columns (three panels of AVX2's 16, a part of AVX-512's 64).
    # Causal: head 5's last value is inf, seen only by its last query; the
    # head's other rows must not meet 0 * inf (its values are not all finite).
    monkeypatch.setattr(cy.softmax, "HEAD_ITEMS", head_items)
    q, k, v = make_qkv((17, n_q, 32), n_k=n_k, d_v=48, dtype=dtype, seed=34)
    if causal:
        v[5, -1, 0] = np.inf
    v_off = _copy_at(v, offset)
    want = _expected("softmax", q, k, v, causal)
    before = cy.get_num_threads()
    try:
        for threads in (1, 2):
            cy.set_num_threads(threads)
            got = fastattn.softmax_attention(q, k, v_off, causal=causal, backend="cython")
            assert np.isfinite(got[:, :-1]).all()
            assert_close(got[:, :-1], want[:, :-1], dtype, err_msg=f"{threads} threads")
            assert_close(got[:, -1], want[:, -1], dtype, err_msg=f"{threads} threads, last row")
    finally:
        cy.set_num_threads(before)


# --- linear attention's chunks and runs ----------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lead,n", [((), 1), ((1,), NC - 1), ((1,), NC), ((2,), NC + 1),
                                    ((1,), 2 * NC + 3), ((2, 3), 3 * NC - 5)],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else f"n{x}")
def test_noncausal_linear_around_its_chunk_edges(lead, n, dtype, threads):
    # The non-causal kernel takes NONCAUSAL_CHUNK rows at a time; one head on
    # two threads folds two segments of keys; n_q != n_k as well.
    q, k, v = make_qkv((*lead, n, 64), n_k=n + 7, d_v=40, dtype=dtype, seed=31)
    before = cy.get_num_threads()
    try:
        cy.set_num_threads(threads)
        got, (S, z) = fastattn.linear_attention(q, k, v, return_state=True, backend="cython")
    finally:
        cy.set_num_threads(before)
    want, S_want, z_want = _expected("linear", q, k, v, False)
    assert_close(got, want, dtype)
    assert_close(S, S_want, dtype, scale=max(1.0, (n + 7) / 100))
    assert_close(z, z_want, dtype, scale=max(1.0, (n + 7) / 100))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_causal_linear_finds_an_inf_in_a_later_chunk_of_values(dtype):
    # The values are checked for inf/NaN chunk by chunk: an inf in a later
    # chunk of the second head must still keep that chunk's diagonal term off
    # the one product (0 * inf would make earlier rows of its chunk NaN), and
    # the chunks before it keep the product.
    q, k, v = make_qkv((2, 1100, 8), d_v=32, dtype=dtype, seed=32)
    v[1, 1050, 3] = np.inf        # chunk 16 of head 1
    got = fastattn.linear_attention(q, k, v, causal=True, backend="cython")
    want = _expected("linear", q, k, v, True)[0]
    assert np.isfinite(got[1, :1050]).all()
    assert_close(got[:, :1050], want[:, :1050], dtype)
    assert_close(got[0], want[0], dtype)
    assert not np.isfinite(got[1, 1050:, 3]).any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_output_finite_finds_one_inf_or_nan_in_any_block(dtype, threads):
    # The backend's output check (blocks of FINITE_BLOCK on the kernel threads) against
    # NumPy's, for one non-finite element at the ends of the array and of its blocks.
    block = cy._linear.FINITE_BLOCK
    before = cy.get_num_threads()
    try:
        cy.set_num_threads(threads)
        info = np.finfo(dtype)
        # every sign and size a finite number comes in: the largest, subnormal, -0
        extremes = np.array([info.max, -info.max, info.smallest_subnormal, -0.0, -1], dtype)
        for n in (0, 1, block - 1, block, block + 1, 5 * block + 3):
            x = np.resize(extremes, n)
            assert cy.output_finite(x.reshape(1, 1, -1)) is True
            assert cy._linear.all_finite_parallel(x, threads) is True    # the blocks, always
            for pos in sorted({0, n - 1, block - 1, block, n // 2, 4 * block} & set(range(n))):
                for bad in (np.inf, -np.inf, np.nan, -np.nan):
                    keep, x[pos] = x[pos], bad
                    assert cy.output_finite(x.reshape(1, 1, -1)) is False, (n, pos, bad)
                    assert cy._linear.all_finite_parallel(x, threads) is False, (n, pos, bad)
                    x[pos] = keep
        # Not the kernels' own layout: a strided view, read-only, another dtype.
        x = np.ones((4, 2 * block), dtype)
        x[1, 2 * block - 1] = np.inf
        assert cy.output_finite(x[:, ::2]) is True and cy.output_finite(x[:, 1::2]) is False
        x.flags.writeable = False
        assert cy.output_finite(x) is False
        assert cy.output_finite(np.ones(3 * block, np.float16)) is True
    finally:
        cy.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_parallel_query_scale_gives_kernel_querys_bits(threads):
    # A float32 q whose scale float32 does not hold is scaled in C on the kernel threads:
    # the same bits as _overflow.kernel_query's float64 product rounded once, for every
    # element (NaN, inf, 1e30, subnormal results) and around the blocks.
    from fastattn import _overflow

    block = cy._softmax.SCALE_BLOCK
    rng = np.random.default_rng(34)
    q = rng.standard_normal((3, block + 5, 16)).astype(np.float32)
    q[0, 0, :4] = np.nan, np.inf, -np.inf, 0.0
    q[1, 7, :3] = 1e30, -1e30, np.finfo(np.float32).tiny
    for scale in (32 ** -0.5, 48 ** -0.5, 0.1, 1e-59, 2.0 ** -149, 0.99999999):
        want, want_scale = _overflow.kernel_query(q, scale)
        got, got_scale = cy._kernel_query(q, scale, threads)
        assert got_scale == want_scale == 1.0 and got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert cy._kernel_query(q, 2.0, threads)[0] is q                       # scale >= 1: as given
    assert cy._kernel_query(q[:0], 0.1, threads)[0].shape == (0, block + 5, 16)


def test_float32_linear_overflow_is_found_on_two_threads(monkeypatch):
    # An output large enough for the check's blocks to run on two threads, whose float32
    # numerator overflows in one late row only: the call is made again in float64.
    q, k, v = make_qkv((2, 3000, 16), d_v=16, dtype=np.float32, seed=33)
    v[1, -1, :] = 3e38             # the last key's value: its row of the last head overflows
    before = cy.get_num_threads()
    try:
        cy.set_num_threads(2)
        got = fastattn.linear_attention(q, k, v, causal=True, backend="cython")
    finally:
        cy.set_num_threads(before)
    want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True,
                                     backend="reference")
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want.astype(np.float32)))
    assert_close(got, want.astype(np.float32), np.float32)


@pytest.mark.parametrize("d_v", [16, 12], ids=["products", "blas"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("heads", [1, 3], ids=["1head", "3heads"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_linear_kernel_finds_an_overflowed_row_wherever_it_finishes(
        causal, heads, threads, d_v, monkeypatch):
    # A float32 linear call's output is checked by the kernel as each chunk's rows are
    # finished: in a non-causal query chunk, in a causal head's own chunks, in the first
    # run of a head cut in runs (fewer heads than threads) and in a later run's last step.
    # One query row of 1e37 overflows that row's float32 numerator and denominator (NaN)
    # and no other; the call must be made again in float64, with no pass of its own.
    monkeypatch.setattr(cy._linear, "all_finite_parallel",
                        lambda *a: pytest.fail("the output was checked again after the call"))
    n = 64 * 40
    base = make_qkv((heads, n, 16), d_v=d_v, dtype=np.float32, seed=35)
    before = cy.get_num_threads()
    try:
        cy.set_num_threads(threads)
        for row in (10, n // 2 + 3, n - 1):
            q, k, v = (x.copy() for x in base)
            q[heads - 1, row] = 1e37
            got = fastattn.linear_attention(q, k, v, causal=causal, backend="cython")
            want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                             causal=causal, backend="reference")
            assert np.isfinite(want).all()
            assert np.isfinite(got).all(), row
            assert_close(got, want.astype(np.float32), np.float32)
        # A state too large for float32 only once the state product adds the early keys (in
        # a later run: its last step): an early value of 1e36 and a later query of 100.
        q, k, v = (x.copy() for x in base)
        v[heads - 1, 2] = 1e36
        q[heads - 1, n - 5] = 100
        got = fastattn.linear_attention(q, k, v, causal=causal, backend="cython")
        want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                         causal=causal, backend="reference")
        assert np.isfinite(want.astype(np.float32)).all() and np.isfinite(got).all()
        assert_close(got, want.astype(np.float32), np.float32)
        # Finite throughout: the kernel's verdict, and no call again (a spy on the wide call).
        wide = []
        monkeypatch.setattr(fastattn.feature_maps.FeatureMap, "_forward_wide",
                            lambda self, *a: wide.append(1))
        fastattn.linear_attention(*base, causal=causal, backend="cython")
        assert not wide
    finally:
        cy.set_num_threads(before)


def test_causal_linear_runs_share_the_first_step_by_its_cost():
    # Fewer heads than threads: run 0 is done whole, the later runs (RUN_CHUNKS
    # chunks) without their product with the state, 2 C d_k d_v of a chunk's
    # 4 C d_k d_v + C (C + 1) (d_k + d_v) flops: at d = C = 64 a later chunk costs
    # 0.668 of a whole one, so on 2 threads run 0 takes 0.9 x 0.4 of the chunks.
    starts = cy._linear._run_starts(64, 2, 64, 0, 64, 64)
    run_chunks = cy._linear.RUN_CHUNKS
    assert starts[0] == 0 and starts[-1] == 64
    assert starts[1] == round(cy._linear.FIRST_RUN_SHARE * 64 * 0.668 / 1.668)
    assert set(np.diff(starts[1:-1])) == {run_chunks} and 1 <= starts[-1] - starts[-2] <= run_chunks
    # One thread a head, or one chunk: a single run.
    assert list(cy._linear._run_starts(64, 1, 64, 0, 64, 64)) == [0, 64]
    assert list(cy._linear._run_starts(1, 2, 64, 0, 64, 64)) == [0, 1]
    # Many keys before the first chunk (n_k > n_q): run 0 folds them, so it keeps
    # one chunk; and it never takes them all.
    assert list(cy._linear._run_starts(6, 2, 64, 10_000, 64, 64)) == [0, 1, 5, 6]
    assert cy._linear._run_starts(2, 8, 64, 0, 64, 64)[1] == 1
    # A state a chunk larger than the chunk's q, k, v and output rows (d = 512 > 4 C):
    # no runs, so the kept states never outgrow the inputs; d_k = d_v = 255 is the last
    # that splits (255² + 255 = 2 C (255 + 255)).
    assert list(cy._linear._run_starts(64, 2, 64, 0, 512, 512)) == [0, 64]
    assert len(cy._linear._run_starts(64, 2, 64, 0, 255, 255)) > 2
    assert list(cy._linear._run_starts(64, 2, 64, 0, 256, 256)) == [0, 64]


@pytest.mark.parametrize("chunk", [24, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_causal_linear_runs_with_a_chunk_not_a_whole_number_of_panels(monkeypatch, dtype, chunk):
    # The diagonal's keys are packed in panels of 16 (float32) or 8: a chunk
    # that is not a multiple of the panel rounds its packed keys up, and with
    # fewer heads than threads (runs of chunks) they lie just before the
    # thread's own state, which they must not overwrite.
    monkeypatch.setattr(cy._linear, "CHUNK", chunk)
    q, k, v = make_qkv((1, 10 * chunk + 5, 64), d_v=64, dtype=dtype, seed=chunk)
    want = _expected("linear", q, k, v, True)[0]
    for threads in (1, 2):
        out, S, z = cy._linear.linear_attention_forward(q, k, v, "elu", True, 1e-6,
                                                        n_threads=threads)
        assert_close(out, want, dtype, err_msg=f"{threads} threads")


def _linear_direct(q, k, v, causal, threads, feature_map="elu", S0=None, z0=None):
    """The Cython kernel on ``threads`` OpenMP threads (even more than the cores:
    the segment plan follows the count), leading dims flattened."""
    lead = q.shape[:-2]
    flat = [np.ascontiguousarray(x.reshape(-1, *x.shape[-2:])) for x in (q, k, v)]
    if S0 is not None:
        S0, z0 = S0.reshape(-1, *S0.shape[-2:]), z0.reshape(-1, z0.shape[-1])
    out, S, z = cy._linear.linear_attention_forward(*flat, feature_map, causal, 1e-6, S0, z0,
                                                    threads)
    return (out.reshape(*lead, *out.shape[1:]), S.reshape(*lead, *S.shape[1:]),
            z.reshape(*lead, z.shape[-1]))


def test_linear_takes_the_register_blocked_products_where_the_cpu_has_them():
    from fastattn._cython.softmax import _build_features

    if not _build_features()["tile_products"]:
        pytest.skip("no register-blocked products in this build or on this CPU")
    assert cy._linear._takes_products(64, np.float32)
    assert cy._linear._takes_products(8, np.float64)
    assert not cy._linear._takes_products(40, np.float32)     # BLAS
    assert not cy._linear._takes_products(20, np.float64)


# (leading dims, n_q, n_k, d_k, d_v): around the causal CHUNK and NONCAUSAL_CHUNK,
# n_q != n_k both ways, d_k not a multiple of the lanes (any d_k takes the
# products), d_v of 1, 4 and 5 vectors (float32; twice as many in float64), and
# d_v = 40 (float32: BLAS) / 20 (both: BLAS).
LINEAR_PRODUCT_CASES = [
    ((), CH - 1, CH - 1, 64, 64),
    ((), CH, CH, 64, 64),
    ((2,), CH + 1, CH + 1, 64, 64),
    ((), 2 * CH + 5, 2 * CH + 12, 24, 16),
    ((2, 3), NC - 1, NC + 1, 64, 80),
    ((), NC + 1, NC - 7, 16, 32),
    ((3,), 5 * CH + 3, 5 * CH + 3, 64, 64),
    ((), 700, 3, 32, 32),
    ((2,), 4 * NC + 9, 4 * NC + 2, 64, 40),
    ((), 3 * CH + 1, 3 * CH + 1, 12, 20),
    # the keys' column sums with their features up to 16 vectors a row (float64: d_k 128), past it apart
    ((), 2 * CH + 3, 2 * CH + 3, 128, 16),
    ((2,), CH + 9, NC + 9, 256, 16),
    ((), NC + 5, NC + 5, 272, 16),
]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("case", LINEAR_PRODUCT_CASES, ids=shape_id)
def test_linear_products_match_the_oracle(case, dtype, causal, threads):
    # With the register-blocked products (d_v a multiple of the lanes) or BLAS, with an
    # initial state; causal with fewer heads than the 2-8 threads: runs of chunks
    # whose starting states are folded in pieces (8 threads: pieces of a few keys,
    # some empty) and prefix-summed.
    q, k, v = _inputs(case, dtype, seed=41)
    lead, n_q, n_k, d_k, d_v = case
    rng = np.random.default_rng(42)
    S0 = rng.standard_normal((*lead, d_k, d_v)).astype(dtype)
    z0 = rng.uniform(1, 5, (*lead, d_k)).astype(dtype)
    got, S, z = _linear_direct(q, k, v, causal, threads, S0=S0, z0=z0)
    want, S_want, z_want = _expected("linear", q, k, v, causal, S0, z0)
    assert_close(got, want, dtype, err_msg=shape_id(case))
    assert_close(S, S_want, dtype, scale=max(1.0, n_k / 100), err_msg="S " + shape_id(case))
    assert_close(z, z_want, dtype, scale=max(1.0, n_k / 100), err_msg="z " + shape_id(case))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("where", ["value", "key"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_causal_linear_products_keep_a_masked_inf_out(dtype, where, threads):
    # An inf value or key at row 2 CH + 3 (inside its chunk's diagonal, and
    # inside the block of 6 rows the diagonal product reads for rows
    # 2 CH..2 CH + 5): every earlier row stays finite and right, the later rows
    # of the head see it.  d_v = 64: the register-blocked products where the CPU has them;
    # 3 threads for 2 heads: runs of chunks (the inf lies in the second run).
    q, k, v = make_qkv((2, 4 * CH, 64), d_v=64, dtype=dtype, seed=43)
    bad = 2 * CH + 3
    (v if where == "value" else k)[1, bad, 5] = np.inf
    got, _, _ = _linear_direct(q, k, v, True, threads)
    want = _expected("linear", q, k, v, True)[0]
    assert np.isfinite(got[1, :bad]).all()
    assert_close(got[:, :bad], want[:, :bad], dtype)
    assert_close(got[0], want[0], dtype)
    assert not np.isfinite(got[1, bad:]).all(axis=-1).any()


# --- threads -------------------------------------------------------------------

def test_thread_count_is_settable_and_does_not_change_results():
    # One head: the linear kernels cut it into one segment per thread.
    q, k, v = make_qkv((1, 2 * BQ + 5, 8), dtype=np.float32, seed=12)
    before = cy.get_num_threads()
    try:
        results = []
        for n_threads in (1, 2, 3):
            cy.set_num_threads(n_threads)
            expected = n_threads if cy.openmp_enabled() else 1
            assert cy.get_num_threads() == expected
            results.append([
                fastattn.softmax_attention(q, k, v, causal=True, backend="cython"),
                fastattn.linear_attention(q, k, v, causal=True, backend="cython"),
                fastattn.linear_attention(q, k, v, causal=False, backend="cython"),
            ])
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert_close(a, b.astype(np.float64), np.float32)
    finally:
        cy.set_num_threads(before)
    with pytest.raises(ValueError, match="n_threads"):
        cy.set_num_threads(0)


def test_thread_count_holds_in_every_python_thread():
    before = cy.get_num_threads()
    try:
        cy.set_num_threads(1)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(cy.get_num_threads).result() == 1
    finally:
        cy.set_num_threads(before)


def test_calls_from_python_threads_match_serial_calls():
    inputs = [make_qkv((2, 150 + 13 * i, 8), dtype=np.float32, seed=20 + i) for i in range(4)]

    def run(qkv):
        q, k, v = qkv
        return (fastattn.softmax_attention(q, k, v, causal=True, backend="cython"),
                fastattn.linear_attention(q, k, v, causal=True, backend="cython"))

    serial = [run(x) for x in inputs]
    barrier = threading.Barrier(4)

    def run_together(qkv):
        barrier.wait()
        return run(qkv)

    blas_before = _blas_threads()
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(run_together, inputs))
    assert _blas_threads() == blas_before, "overlapping calls left BLAS at another thread count"
    for (a1, b1), (a2, b2) in zip(serial, parallel):
        np.testing.assert_array_equal(a1, a2)
        np.testing.assert_array_equal(b1, b2)


def _blas_threads():
    return sorted((i["filepath"], i["num_threads"]) for i in threadpool_info()
                  if i["user_api"] == "blas")


def test_blas_thread_count_is_restored_after_a_call():
    before = _blas_threads()
    q, k, v = make_qkv((1, 64, 8), dtype=np.float32)
    cy.softmax_forward(q, k, v, False, 0.5)
    cy.linear_forward(q, k, v, "elu", True, 1e-6)
    assert _blas_threads() == before


def test_a_workspace_beyond_memory_is_refused_before_allocating(monkeypatch):
    """A map of 10**7 features: the causal workspace (3 x 64 x D per thread) failed inside
    NumPy with a raw MemoryError of 29.4 GiB."""
    from fastattn import reference
    monkeypatch.setattr(reference, "available_memory", lambda: 10**9)
    z = np.zeros((2, 5, 4))
    with pytest.raises(MemoryError, match="the Cython linear kernel, for the workspace"):
        fastattn.linear_attention(z, z, z, causal=True, backend="cython",
                                  feature_map=lambda x: np.ones(x.shape[:-1] + (10**6,)))


@pytest.mark.skipif(cy is None, reason="Cython backend not built")
def test_decode_prefetches_key_and_value_rows_on_intel_only():
    # Software prefetch helps a decode step from memory on Intel and slows it on AMD
    # (measured both ways; decode.pyx): the default follows the CPU's vendor.
    from fastattn._cython import decode

    vendor = next((line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text()
                   .splitlines() if line.startswith("vendor_id")), None)
    if vendor is None:
        pytest.skip("no vendor_id in /proc/cpuinfo")
    default = decode._set_prefetch_rows(0)
    decode._set_prefetch_rows(default)
    assert default == (16 if vendor == "GenuineIntel" else 0)
    q, k, v = (np.random.default_rng(0).standard_normal((2, n, 64)).astype(np.float32)
               for n in (1, 3000, 3000))
    expected = softmax_oracle(q, k, v)
    for rows in (0, 16):
        decode._set_prefetch_rows(rows)
        try:
            assert_close(fastattn.softmax_attention(q, k, v, backend="cython"), expected,
                         np.float32)
        finally:
            decode._set_prefetch_rows(default)


def test_linear_scratch_arrays_are_kept_per_thread_and_never_change_an_answer():
    # The kernel's own arrays (its states and workspace) are kept for the next call of the
    # same Python thread when shape and dtype match: calls of other shapes in between, a
    # call of the same shape with NaN and inf in between, an initial state given and then
    # not, and two Python threads calling at once, give the answers of fresh arrays; each
    # Python thread keeps its own arrays.
    shapes = [((1, 1000, 16), True), ((3, 700, 16), False), ((2, 300, 32), True)]
    inputs = [make_qkv(shape, d_v=shape[-1], dtype=np.float32, seed=40 + i)
              for i, (shape, _) in enumerate(shapes)]
    wants = [fastattn.linear_attention(*(x.astype(np.float64) for x in qkv), causal=causal,
                                       backend="reference").astype(np.float32)
             for qkv, (_, causal) in zip(inputs, shapes)]
    before = cy.get_num_threads()
    try:
        cy.set_num_threads(2)
        first = [fastattn.linear_attention(*qkv, causal=causal, backend="cython")
                 for qkv, (_, causal) in zip(inputs, shapes)]
        for got, want in zip(first, wants):
            assert_close(got, want, np.float32)
        for qkv, (shape, causal), want in zip(inputs, shapes, first):
            kept = cy._linear._scratch_arrays.arrays.get("workspace")
            poisoned = [x.copy() for x in qkv]
            poisoned[1][..., ::7, :] = np.nan
            poisoned[2][..., 3::5, :] = np.inf
            fastattn.linear_attention(*poisoned, causal=causal, backend="cython")
            state = (np.ones((shape[0], 16, shape[-1]), np.float32),
                     np.ones((shape[0], 16), np.float32))
            if shape[-1] == 16:
                fastattn.linear_attention(*qkv, causal=causal, initial_state=state,
                                          backend="cython")
            got = fastattn.linear_attention(*qkv, causal=causal, backend="cython")
            np.testing.assert_array_equal(got, want)
            now = cy._linear._scratch_arrays.arrays["workspace"]
            if kept is not None and kept.shape == now.shape:
                assert now is kept                                          # reused

        errors, held = [], []

        def worker(order):
            try:
                for _ in range(20):
                    for i in order:
                        got = fastattn.linear_attention(*inputs[i], causal=shapes[i][1],
                                                        backend="cython")
                        np.testing.assert_array_equal(got, first[i])
                held.append(cy._linear._scratch_arrays.arrays["workspace"])
            except AssertionError as exc:       # pragma: no cover - reported below
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(order,))
                   for order in ([0, 1, 2], [2, 1, 0])]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert not errors, errors[0]
        assert len(held) == 2 and held[0] is not held[1]          # each thread its own
        assert cy._linear._scratch_arrays.arrays["workspace"] is not held[0]
    finally:
        cy.set_num_threads(before)


@pytest.mark.skipif(cy is None, reason="Cython backend not built")
@pytest.mark.parametrize("w_shape", [(1, 5), (1, 1), (5, 8), (16, 5)])
def test_favor_kernels_refuse_a_projection_of_another_d_k(w_shape):
    # The loops trust the shapes: a w of another d_k would be read past its end.
    x = np.random.default_rng(0).standard_normal((2, 10, 8)).astype(np.float32)
    w = np.ones(w_shape, np.float32)
    with pytest.raises(ValueError, match=r"w must have shape \(d_k, m\) = \(8, m\)"):
        cy._linear.favor_key_features(x, w)
    with pytest.raises(ValueError, match=r"w must have shape \(d_k, m\) = \(8, m\)"):
        cy._linear.favor_query_features(x, w, np.zeros((2, w_shape[1])))
    with pytest.raises(ValueError, match=r"key_shift must have shape \(2, 5\)"):
        cy._linear.favor_query_features(x, np.ones((8, 5), np.float32), np.zeros((2, 4)))
