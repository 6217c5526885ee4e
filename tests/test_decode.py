"""Split-key softmax (Flash-Decoding) against the reference, on both fast backends.

The kernels are called directly with a chosen number of key ranges, so every
split and block boundary is crossed whatever the machine's thread count; a
call through :func:`fastattn.softmax_attention` checks the routing.
"""

import importlib

import numpy as np
import pytest

import fastattn
from fastattn import _policy

from conftest import FAST_BACKENDS, assert_close, make_qkv, reference64

DECODE_MODULES = {"numba": "fastattn._numba.decode", "cython": "fastattn._cython.decode"}
SOFTMAX_MODULES = {"numba": "fastattn._numba.softmax", "cython": "fastattn._cython.softmax"}

pytestmark = pytest.mark.skipif(not FAST_BACKENDS, reason="no fast backend built")


def _decode(backend):
    return importlib.import_module(DECODE_MODULES[backend])


def _block_k(backend):
    if backend == "numba":
        from fastattn._numba.config import SPLIT_KEYS_BLOCK_K
    else:
        SPLIT_KEYS_BLOCK_K = _decode(backend).SPLIT_KEYS_BLOCK_K
    return SPLIT_KEYS_BLOCK_K


def _split_key(backend, q, k, v, causal, scale, n_splits):
    fn = _decode(backend).split_key_softmax_forward
    if backend == "cython":
        return fn(q, k, v, causal, scale, 2, n_splits)
    return fn(q, k, v, causal, scale, n_splits)


def _key_counts(backend, n_q):
    """n_k one below, at and one above each split and block size, and below n_q."""
    block = _block_k(backend)
    split = _policy.SPLIT_KEYS_MIN_KEYS
    sizes = {1, max(1, n_q - 1)}
    for size in (split, block, 2 * block):
        sizes |= {size - 1, size, size + 1}
    return sorted(sizes)


@pytest.mark.parametrize("n_q", range(1, 17), ids=lambda n: f"nq{n}")
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_split_key_softmax_matches_reference(backend, n_q):
    # Batch dims (2, 3), d_k=8, d_v=5; n_splits 1, 2, 3 and the default.
    for dtype in (np.float32, np.float64):
        for n_k in _key_counts(backend, n_q):
            q, k, v = make_qkv((2, 3, n_q, 8), n_k=n_k, d_v=5, dtype=dtype, seed=n_q + n_k)
            for causal in (False, True):
                want = reference64(fastattn.softmax_attention, q, k, v, causal=causal)
                args = [x.reshape((6,) + x.shape[2:]) for x in (q, k, v)]
                for n_splits in (1, 2, 3, None):
                    got = _split_key(backend, *args, causal, 8 ** -0.5, n_splits)
                    assert got.dtype == dtype
                    assert_close(got.reshape(want.shape), want, dtype,
                                 err_msg=f"n_k={n_k} causal={causal} n_splits={n_splits}")


@pytest.mark.parametrize("n_q, n_k", [(2, 17), (2, 1025), (4, 1025), (16, 3000), (7, 3)],
                         ids=["nq2-nk17", "nq2-nk1025", "nq4-nk1025", "nq16-nk3000", "nq7-nk3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_split_key_softmax_masked_non_finite_keys(backend, dtype, n_q, n_k):
    """NaN and inf in keys and values a row cannot see never reach it."""
    q, k, v = make_qkv((2, n_q, 16), n_k=n_k, d_v=16, dtype=dtype, seed=3)
    off = n_k - n_q
    # Keys from the first one row 0 cannot see; the last row sees them all.
    first_masked = max(0, off + 1)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[:, first_masked::2] = np.nan
    v_bad[:, first_masked::3] = np.inf
    v_bad[:, first_masked + 1::3] = np.nan
    want = reference64(fastattn.softmax_attention, q, k, v, causal=True)
    for n_splits in (1, 2, 3):
        got = _split_key(backend, q, k_bad, v_bad, True, 16 ** -0.5, n_splits)
        for i in range(n_q):
            sees_bad = i + off + 1 > first_masked
            if sees_bad:
                assert not np.isfinite(got[:, i]).any(), f"row {i} sees a NaN key"
            else:
                assert_close(got[:, i], want[:, i], dtype, err_msg=f"row {i} n_splits={n_splits}")
                if i + off + 1 <= 0:
                    assert (got[:, i] == 0).all(), f"row {i} sees no key and must be 0"


@pytest.mark.parametrize("d_k, d_v", [(16, 16), (64, 48), (64, 80), (128, 128), (24, 64),
                                      (64, 64), (32, 32), (48, 48), (80, 80)],
                         ids=["dk16-dv16", "dk64-dv48", "dk64-dv80", "dk128-dv128", "dk24-dv64",
                              "dk64-dv64", "dk32-dv32", "dk48-dv48", "dk80-dv80"])
@pytest.mark.parametrize("n_q", [1, 2], ids=lambda n: f"nq{n}")
def test_cython_one_query_loops_match_reference(n_q, d_k, d_v):
    """Cython's one- and two-query loops (AVX-512 or AVX2 where d_k and d_v are whole vectors).

    Every key count from 1 to 33 leaves each remainder of a 16- (float32) or
    8-key (float64) group of scores; d_v of 3, 5 and 8 vectors of 16 columns
    leaves each remainder of the 4-vector column groups of ``p v``; d_k = 24
    is not a whole number of vectors (the portable loops).  With one query and
    d_k = d_v of 1 to 16 vectors (16 to 256 float32, 8 to 128 float64) and
    AVX-512, a range's whole groups of keys run in one pass and the keys left
    after them in a block: 1023, 1025, 2049 and 2088 keys leave 15, 1, 1 and
    8 (float32) of them, and cross the 1024-key blocks of the other loops.
    """
    if "cython" not in FAST_BACKENDS:
        pytest.skip("cython backend not built")
    for dtype in (np.float32, np.float64):
        for n_k in list(range(1, 34)) + [1023, 1025, 2049, 2088]:
            q, k, v = make_qkv((3, n_q, d_k), n_k=n_k, d_v=d_v, dtype=dtype, seed=n_k + d_v)
            for causal in (False, True):
                want = reference64(fastattn.softmax_attention, q, k, v, causal=causal)
                for n_splits in (1, 2):
                    got = _split_key("cython", q, k, v, causal, d_k ** -0.5, min(n_splits, n_k))
                    assert_close(got, want, dtype,
                                 err_msg=f"n_k={n_k} causal={causal} n_splits={n_splits}")


def _one_query_logits(dtype, d, n_k, logits):
    """``q (2, 1, d)``, ``k``, ``v (2, n_k, d)`` whose logits at scale ``d ** -0.5`` are
    ``logits`` (n_k), rounded to the dtype: ``q`` the unit vector of the first axis."""
    q, k, v = make_qkv((2, 1, d), n_k=n_k, dtype=dtype, seed=n_k + d)
    q[...] = 0
    q[..., 0] = 1
    with np.errstate(invalid="ignore"):
        k[..., 0] = (np.asarray(logits, dtype=np.float64) * d ** 0.5).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("vectors", [1, 2, 3, 4, 5, 8, 9, 12, 16, 17], ids=lambda n: f"{n}vec")
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_one_query_running_maximum_and_non_finite_logits(backend, vectors, dtype):
    """One query over 200 keys whose logits rise key by key (the running maximum rises in
    every group of keys, rescaling the sums each time), fall, jump to 80 (float32) or 600
    (float64) midway, start with 40 keys of -inf (a shift of 0, then the first finite
    maximum) or with 120 (in two splits, the first sees only -inf), or are -inf but for the
    last 8 (float32 in one split: the one pass ends at -inf, the 8 keys left are finite); a NaN
    or +inf logit makes the row NaN, as in the reference.  Head sizes of 1 to 16 vectors of
    the one-pass loops (Cython with AVX-512) and 17 (the others); valid for every loop."""
    lanes = 16 if dtype == np.float32 else 8
    d, n_k = vectors * lanes, 200
    big = 80.0 if dtype == np.float32 else 600.0
    ramp = np.linspace(-30, 30, n_k)
    jump = np.where(np.arange(n_k) < 100, 0.0, big)
    first = {n: np.where(np.arange(n_k) < n, -np.inf, ramp) for n in (40, 120, n_k - 8)}
    for name, logits in [("rising", ramp), ("falling", ramp[::-1]), ("jump", jump),
                         ("-inf first 40", first[40]), ("-inf first 120", first[120]),
                         ("-inf but the last 8", first[n_k - 8])]:
        q, k, v = _one_query_logits(dtype, d, n_k, logits)
        want = reference64(fastattn.softmax_attention, q, k, v, causal=True)
        assert np.isfinite(want).all()
        for n_splits in (1, 2):
            got = _split_key(backend, q, k, v, True, d ** -0.5, n_splits)
            assert_close(got, want, dtype, err_msg=f"{name} n_splits={n_splits}")
    for name, bad in [("NaN", np.nan), ("+inf", np.inf)]:
        logits = ramp.copy()
        logits[77] = bad
        q, k, v = _one_query_logits(dtype, d, n_k, logits)
        assert np.isnan(reference64(fastattn.softmax_attention, q, k, v, causal=True)).all()
        for n_splits in (1, 2):
            got = _split_key(backend, q, k, v, True, d ** -0.5, n_splits)
            assert np.isnan(got).all(), f"a {name} logit, n_splits={n_splits}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_cython_one_query_cache_reads_only_its_filled_keys(dtype):
    """One query over the first n_k keys of a cache whose other rows are NaN, at d = 64: the
    one pass and the keys left after it stop at n_k (40, 200 and 5 keys, the last in four
    splits of at most 2 keys, the fourth empty)."""
    if "cython" not in FAST_BACKENDS:
        pytest.skip("cython backend not built")
    for n_k, capacity, n_splits in [(40, 64, 1), (40, 64, 2), (200, 256, 3), (5, 8, 4)]:
        q, k, v = make_qkv((3, 1, 64), n_k=capacity, dtype=dtype, seed=n_k)
        want = reference64(fastattn.softmax_attention, q, k[:, :n_k], v[:, :n_k], causal=True)
        k[:, n_k:], v[:, n_k:] = np.nan, np.nan
        got = _decode("cython").split_key_softmax_forward(q, k, v, True, 0.125, 2, n_splits,
                                                          n_k)
        assert_close(got, want, dtype, err_msg=f"n_k={n_k} n_splits={n_splits}")


@pytest.mark.parametrize("n_q, d", [(1, 64), (2, 48)], ids=["nq1-d64", "nq2-d48"])
def test_cython_split_keys_same_bits_on_one_thread_and_two(n_q, d):
    """The work items run in a plain loop on one thread and in an OpenMP region on two (3
    heads of 3000 keys: work enough for kernel_threads to give two); each item's partial
    result and the merge are the same, so the outputs are the same bits (1 to 4 splits,
    causal; up to 2 queries, whose scores are the kernel's own loops, not BLAS)."""
    from fastattn._threads import SERIAL_WORK
    assert 3 * n_q * 3000 * 2 * d >= SERIAL_WORK   # kernel_threads gives 3 items two threads
    if "cython" not in FAST_BACKENDS:
        pytest.skip("cython backend not built")
    q, k, v = make_qkv((3, n_q, d), n_k=3000, dtype=np.float32, seed=n_q + d)
    for n_splits in (1, 2, 3, 4):
        one, two = (_decode("cython").split_key_softmax_forward(q, k, v, True, d ** -0.5, threads,
                                                                 n_splits) for threads in (1, 2))
        np.testing.assert_array_equal(one, two, err_msg=f"n_splits={n_splits}")
        assert_close(one, reference64(fastattn.softmax_attention, q, k, v, causal=True),
                     np.float32, err_msg=f"n_splits={n_splits}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_decode_kernels_scale_the_query_as_kernel_query_does(backend, dtype):
    """Given a scale below 1, the KV cache's split-key kernels (Cython: in C) scale q first as
    fastattn._overflow.kernel_query does, in float64 and rounded once: the same bits as
    that function's query with a scale of 1, for a scale the dtype holds (1/8), one float32
    does not (48 ** -0.5) and one below float32's range (1e-59, with q and k of 1e30, whose
    products overflow unless q is scaled first)."""
    from fastattn._overflow import kernel_query
    q, k, v = make_qkv((3, 2, 48), n_k=300, dtype=dtype, seed=7)
    decode = _decode(backend)
    for scale, magnitude in [(0.125, 1), (48 ** -0.5, 1), (1e-59, 1e30)]:
        qm, km = q * dtype(magnitude), k * dtype(magnitude)
        qq, rest = kernel_query(qm, scale)
        got = decode.cache_softmax_forward(qm, km, v, True, scale, 300)
        want = decode.cache_softmax_forward(qq, km, v, True, rest, 300)
        got, want = (x[0] if isinstance(x, tuple) else x for x in (got, want))
        np.testing.assert_array_equal(got, want, err_msg=f"scale={scale}")
        assert np.isfinite(got).all(), f"scale={scale}"


def test_cython_split_keys_refuses_arrays_it_cannot_read_as_they_are():
    """The split-key kernel reads its arrays' memory directly: a byte-swapped, unaligned or
    non-contiguous k, or mixed dtypes, is a TypeError naming the argument, not a wrong
    number (the API hands it plain arrays, _checks.as_kernel_input)."""
    if "cython" not in FAST_BACKENDS:
        pytest.skip("cython backend not built")
    q, k, v = make_qkv((2, 1, 16), n_k=8, dtype=np.float32, seed=3)
    raw = np.zeros(k.nbytes + 1, dtype=np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(k.shape)
    unaligned[...] = k
    for name, bad in [("swapped", k.astype(k.dtype.newbyteorder())), ("unaligned", unaligned),
                      ("strided", np.repeat(k, 2, axis=1)[:, ::2])]:
        with pytest.raises(TypeError, match="k must be a C-contiguous, aligned"):
            _decode("cython").split_key_softmax_forward(q, bad, v, True, 0.25)
    with pytest.raises(TypeError, match="one dtype"):
        _decode("cython").split_key_softmax_forward(q, k.astype(np.float64), v, True, 0.25)


def _at_offset(x, offset):
    """A copy of ``x`` that starts ``offset`` elements past a 64-byte line, in a buffer whose
    other elements (the rest of the first and last lines) are NaN."""
    lanes = 64 // x.itemsize
    raw = np.full(x.size + 2 * lanes, np.nan, dtype=x.dtype)
    start = (-raw.ctypes.data // x.itemsize) % lanes + offset
    y = raw[start:start + x.size].reshape(x.shape)
    y[...] = x
    return y


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_cython_one_query_rows_at_every_offset_from_a_line(dtype):
    """K and V rows that do not start on a 64-byte line (a vector load then spans two): at
    every offset of K and V (each of the 16 float32 or 8 float64 elements, K and V apart),
    NaN around them in their first and last lines, for 1, 4 and 16 vectors, 16 to 200 keys
    in one or three splits, the one pass matches the reference and no NaN of the lines'
    other elements gets in."""
    if "cython" not in FAST_BACKENDS:
        pytest.skip("cython backend not built")
    lanes = 64 // np.dtype(dtype).itemsize
    for vectors, n_k, n_splits in [(1, 200, 3), (4, 48, 1), (16, 16, 1), (4, 200, 3)]:
        d = vectors * lanes
        q, k, v = make_qkv((2, 1, d), n_k=n_k, dtype=dtype, seed=vectors + n_k)
        want = reference64(fastattn.softmax_attention, q, k, v, causal=True)
        for k_offset in range(lanes):
            v_offset = (k_offset * 5 + 3) % lanes
            ks, vs = _at_offset(k, k_offset), _at_offset(v, v_offset)
            assert ks.ctypes.data % 64 == k_offset * k.itemsize
            got = _decode("cython").split_key_softmax_forward(
                q, ks, vs, True, 1 / np.sqrt(d), 2, n_splits)
            assert_close(got, want, dtype, err_msg=f"d={d} n_k={n_k} K at {k_offset}, "
                                                   f"V at {v_offset} elements past a line")


#: Where each backend's softmax_forward looks up the split-key kernel it routes to.
ROUTING_MODULES = {"numba": "fastattn._numba.softmax", "cython": "fastattn._cython"}


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_softmax_forward_routes_decode_calls_to_split_keys(backend, monkeypatch):
    """softmax_attention sends every call of at most 16 queries to the split-key kernel, at any
    n_k (1, 17, 1024 keys), and a call of 17 queries to the tiled kernel; both backends alike."""
    module = importlib.import_module(ROUTING_MODULES[backend])
    real = module.split_key_softmax_forward
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[1:2] + args[1].shape[1:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "split_key_softmax_forward", spy)
    for n_q, n_k in ((1, 1), (1, 17), (16, 17), (1, 1024), (16, 1024), (17, 1024), (17, 17)):
        q, k, v = make_qkv((3, n_q, 16), n_k=n_k, dtype=np.float32, seed=n_q + n_k)
        got = fastattn.softmax_attention(q, k, v, causal=True, backend=backend)
        assert_close(got, reference64(fastattn.softmax_attention, q, k, v, causal=True),
                     np.float32)
    assert calls == [(1, 1), (1, 17), (16, 17), (1, 1024), (16, 1024)]


@pytest.mark.parametrize("batch, n_k, threads, want", [
    (1, 32768, 2, 4), (8, 32768, 2, 1), (1, 1024, 2, 2), (3, 8192, 4, 3), (1, 600, 2, 1),
], ids=["B1-nk32768-T2", "B8-nk32768-T2", "B1-nk1024-T2", "B3-nk8192-T4", "B1-nk600-T2"])
def test_split_count_gives_two_items_per_thread(batch, n_k, threads, want):
    assert _policy.split_count(batch, n_k, threads) == want


@pytest.mark.parametrize("d_k, d_v", [(64, 64), (33, 17)], ids=["dk64-dv64", "dk33-dv17"])
@pytest.mark.parametrize("n_q", [1, 5, 16], ids=lambda n: f"nq{n}")
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_split_key_softmax_small_blocks_match_reference(backend, n_q, d_k, d_v, monkeypatch):
    """Blocks of 16 keys: every block boundary and the causal diagonal inside and across blocks.

    Head sizes of full SIMD width (64) and odd ones (33, 17) exercise the
    vector loops' bodies and remainders; n_k below n_q leaves whole causal
    rows (and every key block of them) unseen.
    """
    monkeypatch.setattr(_decode(backend), "SPLIT_KEYS_BLOCK_K", 16)
    for dtype in (np.float32, np.float64):
        for n_k in sorted({1, max(1, n_q - 3), 15, 16, 17, 47, 48, 49, 100}):
            q, k, v = make_qkv((2, 3, n_q, d_k), n_k=n_k, d_v=d_v, dtype=dtype, seed=7 * n_k + n_q)
            for causal in (False, True):
                want = reference64(fastattn.softmax_attention, q, k, v, causal=causal)
                args = [x.reshape((6,) + x.shape[2:]) for x in (q, k, v)]
                for n_splits in (1, 3):
                    got = _split_key(backend, *args, causal, d_k ** -0.5, n_splits)
                    assert_close(got.reshape(want.shape), want, dtype,
                                 err_msg=f"n_k={n_k} causal={causal} n_splits={n_splits}")


@pytest.mark.parametrize("rule", [False, True], ids=["never", "always"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_one_split_key_rule_for_both_backends_and_the_kv_cache(backend, rule, monkeypatch):
    """Replacing fastattn._policy.use_split_keys changes softmax_attention and KVCache.attend alike."""
    monkeypatch.setattr(_policy, "use_split_keys", lambda n_q: rule)
    routing = importlib.import_module(ROUTING_MODULES[backend])
    real_split, real_cache = routing.split_key_softmax_forward, _decode(backend).cache_softmax_forward
    calls = []

    def split_spy(*args, **kwargs):
        calls.append("softmax")
        return real_split(*args, **kwargs)

    def cache_spy(*args, **kwargs):
        calls.append("cache")
        return real_cache(*args, **kwargs)

    monkeypatch.setattr(routing, "split_key_softmax_forward", split_spy)
    monkeypatch.setattr(_decode(backend), "cache_softmax_forward", cache_spy)
    for n_q in (1, 40):
        q, k, v = make_qkv((2, n_q, 16), n_k=64, dtype=np.float32, seed=n_q)
        want = reference64(fastattn.softmax_attention, q, k, v, causal=True)
        assert_close(fastattn.softmax_attention(q, k, v, causal=True, backend=backend), want,
                     np.float32)
        cache = fastattn.KVCache((2,), capacity=64, d_k=16)
        cache.append(k, v)
        assert_close(cache.attend(q, backend=backend), want, np.float32)
    assert calls == (["softmax", "cache"] * 2 if rule else [])
