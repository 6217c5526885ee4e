"""One edge-case matrix, run against every backend that can run here.

Every test takes the ``backend`` fixture of ``conftest.py``, so a backend
that lands later is held to the same cases by being available.  Expected
values come from :mod:`oracles` (float64, row by row, written from the
definitions) or from a contiguous copy of the same input, never from another
path through the code under test.  Tolerances are ``conftest.TOLERANCES``,
one table per dtype.

The sizes sit around the fast kernels' block, chunk and segment edges
(``conftest.KERNEL_EDGES``), so a kernel's first, last or partial block, its
causal diagonal, or a state carried across chunks is checked here once for
every backend; each backend's own file keeps only what is its own.
"""

import functools

import numpy as np
import pytest

import fastattn
from conftest import KERNEL_EDGES, assert_close, make_qkv, shape_id
from oracles import linear_oracle, softmax_oracle

FLOATS = [np.float32, np.float64]
FEATURE_MAPS = ["elu", "relu"]

NB, CY = KERNEL_EDGES["numba"], KERNEL_EDGES["cython"]
#: A query block, a key block and a chunk of linear attention (the same in both backends).
BQ, BK, CH = NB["block_q"], CY["block_k"], NB["chunk"]
assert BQ == CY["block_q"] and CH == CY["chunk"] and NB["block_k"] <= BK


def _blind_rows(n_q, n_k, causal):
    """Number of leading query rows that see no key (causal with n_q > n_k)."""
    return max(n_q - n_k, 0) if causal else 0


def _shape_inputs(shape, dtype, seed):
    lead, n_q, n_k, d_k, d_v = shape
    return make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, dtype=dtype, seed=seed)


# ---------------------------------------------------------------------------
# Sizes: n = 0, n = 1, n_q != n_k, d = 1, d_v != d_k, leading dims, and the
# edges of the fast kernels' blocks and chunks.
# ---------------------------------------------------------------------------

SHAPES = [
    # (lead, n_q, n_k, d_k, d_v)
    ((), 0, 0, 3, 2),
    ((), 0, 5, 3, 2),
    ((), 5, 0, 3, 2),
    ((), 1, 1, 1, 1),
    ((), 1, 1, 4, 4),
    ((), 2, 2, 3, 5),
    ((), 1, 6, 4, 4),       # one query sees every key
    ((), 6, 1, 4, 4),       # causal: five rows see no key
    ((), 9, 4, 3, 5),       # causal: five rows see no key, d_v > d_k
    ((), 4, 9, 3, 5),       # decoder with a cache
    ((), 7, 7, 1, 1),       # d = 1
    ((), 7, 7, 2, 9),       # d_v > d_k
    ((), 7, 7, 9, 2),       # d_v < d_k
    ((3,), 5, 8, 4, 3),     # (batch,)
    ((2,), 7, 7, 8, 8),
    ((2,), 7, 7, 5, 3),
    ((2, 3), 8, 5, 4, 3),   # (batch, heads), rows that see no key
    ((0,), 4, 4, 3, 3),     # an empty batch
    ((2, 0), 3, 3, 2, 2),   # no heads
    ((2, 1, 3), 4, 5, 3, 2),  # three leading dims
    ((), 5, 7, 200, 130),   # head dims past any fixed register tile
    ((), 6, 6, 1, 300),
    ((), 1, 200, 8, 8),     # one decoding step over a long cache
    # Around a chunk of linear attention (CH rows) and of the non-causal
    # Cython kernel (2 CH rows).
    ((), 63, 63, 16, 8),
    ((2,), 63, 63, 8, 8),
    ((), CH - 1, CH + 1, 8, 12),
    ((), CH + 1, CH - 1, 12, 8),
    ((2, 3), CH + 1, CH + 1, 8, 4),
    ((2,), 131, 67, 8, 5),  # past two chunks, partial chunks, blind rows
    ((), 67, 131, 5, 8),    # causal offset 64
    ((), 70, 300, 8, 8),    # n_q < n_k: a decoder with a cache
    ((2,), 300, 70, 8, 8),  # n_q > n_k: the first 230 rows see no key when causal
    ((2,), 300, 40, 8, 8),
    # Around a query block (BQ) and a key block (BK, and the Numba kernel's BQ).
    ((), BQ - 1, BQ - 1, 8, 8),
    ((), BQ - 1, BQ - 1, 16, 16),
    ((4,), BQ + 1, BQ + 1, 8, 8),   # enough work items for full-size query blocks
    ((4,), BQ - 1, BQ + 1, 4, 4),
    ((), BQ + 1, BK + 1, 16, 9),
    ((2, 3), BK - 1, BK + 1, 4, 6),
    ((), BK + 1, BQ - 1, 6, 4),
    ((), 1000, 1000, 8, 12),
    ((), 1000, 1000, 32, 24),
    ((), 3, 700, 8, 8),     # n_q << n_k: the queries see a long prefix
    ((), 700, 3, 8, 8),     # n_q >> n_k: most causal rows see no key
    ((), 3, NB["segment"] + 5, 4, 4),  # causal: keys of more than one segment before the first query
]


@functools.lru_cache(maxsize=None)
def _softmax_expected(shape, dtype, causal):
    """The oracle for the inputs of ``test_softmax_sizes``, once for every backend."""
    return softmax_oracle(*_shape_inputs(shape, dtype, seed=11), causal)


@functools.lru_cache(maxsize=None)
def _linear_expected(shape, dtype, causal, feature_map):
    return linear_oracle(*_shape_inputs(shape, dtype, seed=12), feature_map, causal)


def _state_scale(n_k):
    """S and z sum n_k terms: their tolerance widens with the length of the sum."""
    return max(1.0, n_k / 100)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_softmax_sizes(backend, shape, dtype, causal):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = _shape_inputs(shape, dtype, seed=11)
    copies = [x.copy() for x in (q, k, v)]
    out = fastattn.softmax_attention(q, k, v, causal=causal, backend=backend)
    assert out.shape == (*lead, n_q, d_v)
    assert out.dtype == dtype
    assert_close(out, _softmax_expected(shape, dtype, causal), dtype=dtype)
    for x, x0 in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, x0, err_msg="the kernel wrote into its input")
    blind = _blind_rows(n_q, n_k, causal)
    assert np.all(out[..., :blind, :] == 0), "a row that sees no key must be exactly 0"


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_linear_sizes(backend, shape, dtype, causal, feature_map):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = _shape_inputs(shape, dtype, seed=12)
    copies = [x.copy() for x in (q, k, v)]
    out, (S, z) = fastattn.linear_attention(
        q, k, v, feature_map=feature_map, causal=causal, return_state=True, backend=backend
    )
    for x, x0 in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, x0, err_msg="the kernel wrote into its input")
    expected, S_exp, z_exp = _linear_expected(shape, dtype, causal, feature_map)
    assert out.shape == (*lead, n_q, d_v)
    assert S.shape == (*lead, d_k, d_v) and z.shape == (*lead, d_k)
    assert out.dtype == S.dtype == z.dtype == dtype
    assert_close(out, expected, dtype=dtype)
    assert_close(S, S_exp, dtype=dtype, scale=_state_scale(n_k))
    assert_close(z, z_exp, dtype=dtype, scale=_state_scale(n_k))
    blind = _blind_rows(n_q, n_k, causal)
    assert np.all(out[..., :blind, :] == 0), "a row that sees no key must be exactly 0"


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [((), 6, 2, 3, 4), ((2,), 5, 9, 3, 2), ((), 4, 0, 3, 2),
                                   ((2,), 150, 170, 8, 6)], ids=shape_id)
def test_linear_initial_state_reaches_every_row(backend, shape, dtype):
    """Rows that see no key of this call still see the keys before it (the state)."""
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, dtype=dtype, seed=13)
    rng = np.random.default_rng(14)
    S0 = rng.standard_normal((*lead, d_k, d_v)).astype(dtype)
    z0 = (rng.random((*lead, d_k)) + 0.5).astype(dtype)
    for causal in (False, True):
        out, (S, z) = fastattn.linear_attention(
            q, k, v, causal=causal, initial_state=(S0, z0), return_state=True, backend=backend
        )
        expected, S_exp, z_exp = linear_oracle(q, k, v, "elu", causal, 1e-6, S0, z0)
        assert_close(out, expected, dtype=dtype)
        assert_close(S, S_exp, dtype=dtype, scale=_state_scale(n_k))
        assert_close(z, z_exp, dtype=dtype, scale=_state_scale(n_k))
        assert np.all(np.abs(out) > 0), "every row sees the state, so none is 0"


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_linear_blind_rows_with_eps_zero_are_zero_not_nan(backend, dtype, feature_map):
    """Causal, n_q > n_k, eps = 0: a row that sees no key has denominator 0 -> 0, not 0/0."""
    q, k, v = make_qkv((2, 9, 3), n_k=4, d_v=2, dtype=dtype, seed=15)
    out = fastattn.linear_attention(q, k, v, feature_map=feature_map, causal=True, eps=0.0,
                                    backend=backend)
    np.testing.assert_array_equal(out[:, :5], 0)
    assert_close(out, linear_oracle(q, k, v, feature_map, True, 0.0)[0], dtype=dtype)


@pytest.mark.parametrize("shape", [((), 0, 4, 3, 2), ((), 4, 0, 3, 2), ((0, 2), 3, 3, 3, 2)], ids=shape_id)
def test_empty_float16_keeps_its_dtype(backend, shape):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, dtype=np.float16)
    out = fastattn.softmax_attention(q, k, v, causal=True, backend=backend)
    assert out.dtype == np.float16 and out.shape == (*lead, n_q, d_v)
    np.testing.assert_array_equal(out, 0)
    out, (S, z) = fastattn.linear_attention(q, k, v, causal=True, return_state=True, backend=backend)
    assert out.dtype == np.float16 and out.shape == (*lead, n_q, d_v)
    assert S.dtype == z.dtype == np.float32
    assert S.shape == (*lead, d_k, d_v) and z.shape == (*lead, d_k)


# ---------------------------------------------------------------------------
# Memory layouts: the result equals that of a C-contiguous copy.
# ---------------------------------------------------------------------------

def _fortran(x):
    return np.asfortranarray(x)


def _transposed(x):
    return np.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)


def _batch_major(x):
    """(B, n, d) stored as (n, B, d): a transposed view over the leading dims."""
    return np.ascontiguousarray(x.swapaxes(0, -2)).swapaxes(0, -2)


def _strided(x):
    """A view taking every 2nd row and 3rd column of a NaN-filled buffer."""
    big = np.full(x.shape[:-2] + (2 * x.shape[-2], 3 * x.shape[-1]), np.nan, x.dtype)
    big[..., ::2, ::3] = x
    return big[..., ::2, ::3]


def _negative(x):
    flipped = np.ascontiguousarray(x[..., ::-1, ::-1])
    return flipped[..., ::-1, ::-1]


def _readonly(x):
    x = x.copy()
    x.setflags(write=False)
    return x


def _unaligned(x):
    """The values of ``x`` in a buffer at byte offset 1 of a uint8 array."""
    buf = np.zeros(x.nbytes + 1, np.uint8)
    view = buf[1:].view(x.dtype).reshape(x.shape)
    view[...] = x
    assert not view.flags.aligned
    return view


def _broadcast(x):
    """Every batch entry the same: zero stride over the leading dim, read-only."""
    return np.broadcast_to(x[:1], x.shape)


def _byteswapped(x):
    """The same values stored in the other byte order (``>f4`` on a little-endian machine)."""
    return x.astype(x.dtype.newbyteorder("S"))


LAYOUTS = {
    "fortran": _fortran,
    "transposed": _transposed,
    "batch-major": _batch_major,
    "strided": _strided,
    "negative-stride": _negative,
    "read-only": _readonly,
    "unaligned": _unaligned,
    "broadcast": _broadcast,
    "byte-swapped": _byteswapped,
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [((3,), 9, 11, 5, 4), ((2,), CH + 6, CH + 11, 16, 6)],
                         ids=shape_id)
def test_layout_gives_the_contiguous_answer(backend, shape, layout, dtype, causal):
    """The same values in another layout give the contiguous copy's answer, bit for bit."""
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = _shape_inputs(shape, dtype, seed=21)
    make = LAYOUTS[layout]
    qv, kv, vv = make(q), make(k), make(v)
    qc, kc, vc = (np.ascontiguousarray(x, dtype=dtype) for x in (qv, kv, vv))
    np.testing.assert_array_equal(qc, qv)
    before = [x.copy() for x in (qv, kv, vv)]

    out = fastattn.softmax_attention(qv, kv, vv, causal=causal, scale=0.6, backend=backend)
    assert out.dtype == dtype   # native byte order
    np.testing.assert_array_equal(
        out, fastattn.softmax_attention(qc, kc, vc, causal=causal, scale=0.6, backend=backend))
    assert_close(out, softmax_oracle(qc, kc, vc, causal, 0.6), dtype=dtype)

    rng = np.random.default_rng(22)
    S0 = make(rng.standard_normal((*lead, d_k, d_v)).astype(dtype))
    z0 = rng.random((*lead, d_k)).astype(dtype) + 1
    z0 = _strided(z0[:, None, :])[:, 0, :] if layout == "strided" else z0
    S0c, z0c = np.ascontiguousarray(S0, dtype=dtype), np.ascontiguousarray(z0, dtype=dtype)
    for fm in FEATURE_MAPS:
        out, (S, z) = fastattn.linear_attention(
            qv, kv, vv, feature_map=fm, causal=causal, initial_state=(S0, z0),
            return_state=True, backend=backend,
        )
        contiguous = fastattn.linear_attention(
            qc, kc, vc, feature_map=fm, causal=causal, initial_state=(S0c, z0c),
            return_state=True, backend=backend,
        )
        np.testing.assert_array_equal(out, contiguous[0], err_msg=fm)
        np.testing.assert_array_equal(S, contiguous[1][0], err_msg=fm)
        np.testing.assert_array_equal(z, contiguous[1][1], err_msg=fm)
        expected, S_exp, z_exp = linear_oracle(qc, kc, vc, fm, causal, 1e-6, S0, z0)
        assert_close(out, expected, dtype=dtype)
        assert_close(S, S_exp, dtype=dtype)
        assert_close(z, z_exp, dtype=dtype)
    for x, saved in zip((qv, kv, vv), before):
        np.testing.assert_array_equal(x, saved)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")   # np.matrix
def test_array_subclasses_compute_as_plain_arrays(backend, tmp_path):
    """np.matrix (2-D only) and np.memmap give the answer of their plain data."""
    q, k, v = make_qkv((9, 4), n_k=11, d_v=3, seed=25)
    mats = [np.matrix(x) for x in (q, k, v)]
    maps = []
    for name, x in zip("qkv", (q, k, v)):
        m = np.memmap(tmp_path / f"{name}.dat", dtype=x.dtype, mode="w+", shape=x.shape)
        m[...] = x
        maps.append(m)
    for causal in (False, True):
        expected = softmax_oracle(q, k, v, causal)
        for args in (mats, maps):
            out = fastattn.softmax_attention(*args, causal=causal, backend=backend)
            assert type(out) is np.ndarray
            assert_close(out, expected)
        expected, S_exp, z_exp = linear_oracle(q, k, v, "elu", causal)
        state = (np.matrix(np.zeros((4, 3))), np.zeros(4))
        for args in (mats, maps):
            out, (S, z) = fastattn.linear_attention(*args, causal=causal, initial_state=state,
                                                    return_state=True, backend=backend)
            assert_close(np.asarray(out), expected)
            assert_close(np.asarray(S), S_exp)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_inputs_are_never_written(backend, dtype):
    """C-contiguous inputs of the compute dtype reach the kernel uncopied: it must not write them."""
    q, k, v = make_qkv((2, 70, 6), n_k=75, d_v=5, dtype=dtype, seed=23)
    rng = np.random.default_rng(24)
    S0 = rng.standard_normal((2, 6, 5)).astype(dtype)
    z0 = rng.random((2, 6)).astype(dtype)
    arrays = (q, k, v, S0, z0)
    saved = [x.copy() for x in arrays]
    for causal in (False, True):
        fastattn.softmax_attention(q, k, v, causal=causal, backend=backend)
        for fm in FEATURE_MAPS:
            fastattn.linear_attention(q, k, v, feature_map=fm, causal=causal,
                                      initial_state=(S0, z0), return_state=True, backend=backend)
    for name, x, copy in zip(("q", "k", "v", "S0", "z0"), arrays, saved):
        np.testing.assert_array_equal(x, copy, err_msg=f"{name} was written by the kernel")


# ---------------------------------------------------------------------------
# Large logits: the max is subtracted, nothing overflows.
# ---------------------------------------------------------------------------

def _large_logit_inputs(dtype, big):
    """q·k = ±big·k0 + small integer offsets, exactly representable in ``dtype``.

    Each row's logits are all near +big·100 or all near -big·100 (q·k about
    ±1e4 for big = 100), with offsets -2..2 between keys so the softmax is
    not one-hot; a few keys far below make weights that underflow to 0.
    """
    n_k = 12
    q = np.array([[big, 1], [big, -1], [-big, 1], [-big, -1], [big, 0.5], [-big, 2]], np.float64)
    k = np.stack([np.full(n_k, 100.0), (np.arange(n_k) % 5) - 2.0], axis=1)
    k[[3, 8], 0] = 60.0   # logits far from the row's top: weight exp(-big·40·scale)
    v = np.arange(n_k * 3, dtype=np.float64).reshape(n_k, 3) % 7 - 3
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@pytest.mark.parametrize("scale", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_softmax_large_logits_are_finite_and_right(backend, dtype, scale):
    q, k, v = _large_logit_inputs(dtype, big=100.0)          # q·k about ±1e4
    for causal in (False, True):
        out = fastattn.softmax_attention(q, k, v, causal=causal, scale=scale, backend=backend)
        assert np.all(np.isfinite(out))
        assert_close(out, softmax_oracle(q, k, v, causal, scale), dtype=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_softmax_large_logits_across_blocks(backend, dtype, causal):
    """|q·k · scale| up to about 1e4 over 300 keys: past a block, every logit exact.

    Integer q and k make every float32 logit exact (|q·k| < 2**24), so the
    float32 kernels are held to the float64 answer at the table's tolerance.
    """
    rng = np.random.default_rng(9)
    q, k = (rng.integers(-50, 51, (2, BQ + 44, 16)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((2, BQ + 44, 16)).astype(dtype)
    assert np.abs(q[0] @ k[0].T * 2.0).max() > 1e4
    out = fastattn.softmax_attention(q, k, v, causal=causal, scale=2.0, backend=backend)
    assert np.all(np.isfinite(out))
    assert_close(out, softmax_oracle(q, k, v, causal, 2.0), dtype=dtype)


#: (dtype, scale) where |q| · scale overflows the dtype but every logit q·k · scale is finite.
SCALE_OVERFLOW = [(np.float32, 1e36), (np.float64, 1e306)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, scale", SCALE_OVERFLOW,
                         ids=[f"{np.dtype(d).name}-scale{s:.0e}" for d, s in SCALE_OVERFLOW])
def test_softmax_scale_times_q_may_overflow_where_the_logits_do_not(backend, dtype, scale, causal):
    """Issue 14.1: q = 1000, so 1000 · scale is inf, while q·k · scale is at most 4.6e31 (4.6e301).

    Such logits are one-hot on the largest (the next is 4e30 below it): rows
    0 and 1 (whose largest logit is tied between keys 2 and 3) are the mean of
    v[2] and v[3]; under the causal mask row 0 sees keys 0-2 only and is v[2].
    """
    q = np.full((2, 4), 1000.0)
    k = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11.5], [8, 9, 10, 11.5]]) * 1e-9
    v = np.arange(12.0).reshape(4, 3)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    with np.errstate(over="ignore"):
        assert np.isinf(q[0, 0] * dtype(scale))    # what scaling q first would form
    out = fastattn.softmax_attention(q, k, v, causal=causal, scale=scale, backend=backend)
    expected = np.array([[7.5, 8.5, 9.5], [7.5, 8.5, 9.5]])
    if causal:
        expected[0] = v[2]
    np.testing.assert_array_equal(out, expected.astype(dtype))
    assert_close(out, softmax_oracle(q, k, v, causal, scale), dtype=dtype)


def test_float16_large_values_do_not_overflow(backend):
    """Logits of 8e4 overflow float16 (max 65504): they must be formed in float32."""
    q, k, v = _large_logit_inputs(np.float16, big=200.0)     # q·k up to 2e4, scale 4 -> 8e4
    for causal in (False, True):
        out = fastattn.softmax_attention(q, k, v, causal=causal, scale=4.0, backend=backend)
        assert out.dtype == np.float16
        assert np.all(np.isfinite(out))
        assert_close(out, softmax_oracle(q, k, v, causal, 4.0).astype(np.float16), dtype=np.float16)
    # Linear attention: φ(q)·φ(k) about 200·100·2 = 4e4 per term, sums past 65504.
    out = fastattn.linear_attention(q, k, v, feature_map="elu", backend=backend)
    assert out.dtype == np.float16 and np.all(np.isfinite(out))
    assert_close(out, linear_oracle(q, k, v, "elu")[0].astype(np.float16), dtype=np.float16)


# ---------------------------------------------------------------------------
# Feature maps at their extremes.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_elu_at_very_negative_inputs_stays_positive(backend, dtype, causal):
    """φ(x) = exp(x) for x <= 0, which elu(x) + 1 computed as (exp(x) - 1) + 1 loses.

    In float32, (exp(-20) - 1) + 1 == 0 while exp(-20) = 2e-9; with eps = 0
    a kernel that loses it returns 0 rows (zero denominator) instead of the
    weighted mean of v.
    """
    far = {np.float32: (-20.0, -30.0), np.float64: (-300.0, -330.0)}[dtype]
    n = 8
    q = np.full((n, 1), far[0])
    k = np.where(np.arange(n) % 2 == 0, far[0], far[1])[:, None]
    k[5] = far[0] + 3
    v = np.arange(n * 2, dtype=np.float64).reshape(n, 2) - 5
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    ones = np.ones_like(v)
    out_ones = fastattn.linear_attention(q, k, ones, causal=causal, eps=0.0, backend=backend)
    assert_close(out_ones, np.ones((n, 2)), dtype=dtype)
    out = fastattn.linear_attention(q, k, v, causal=causal, eps=0.0, backend=backend)
    assert_close(out, linear_oracle(q, k, v, "elu", causal, 0.0)[0], dtype=dtype)
    # Past a chunk, random inputs shifted far below 0: φ = exp(x), tiny but positive.
    q, k, v = make_qkv((CH + 16, 6), dtype=dtype, seed=11)
    q, k = q + dtype(far[0] - 10), k + dtype(far[0] - 10)
    out = fastattn.linear_attention(q, k, v, causal=causal, eps=0.0, backend=backend)
    assert np.isfinite(out).all() and np.abs(out).sum(axis=-1).min() > 0
    assert_close(out, linear_oracle(q, k, v, "elu", causal, 0.0)[0], dtype=dtype)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [((2,), 7, 9, 3, 4), ((), 2 * CH + 2, 2 * CH + 2, 8, 6)],
                         ids=shape_id)
def test_relu_with_every_key_negative_gives_zero_not_nan(backend, shape, dtype, causal, eps):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = _shape_inputs(shape, dtype, seed=31)
    k = -np.abs(k) - 0.1
    out, (S, z) = fastattn.linear_attention(
        q, k, v, feature_map="relu", causal=causal, eps=eps, return_state=True, backend=backend
    )
    np.testing.assert_array_equal(out, np.zeros((*lead, n_q, d_v), dtype))
    np.testing.assert_array_equal(S, np.zeros((*lead, d_k, d_v), dtype))
    np.testing.assert_array_equal(z, np.zeros((*lead, d_k), dtype))
    # Queries with every entry negative: φ(q) = 0, the same zero rows.
    q_neg = -np.abs(q) - 0.1
    out = fastattn.linear_attention(q_neg, -k, v, feature_map="relu", causal=causal, eps=eps,
                                    backend=backend)
    np.testing.assert_array_equal(out, np.zeros((*lead, n_q, d_v), dtype))


# ---------------------------------------------------------------------------
# Long sums: float32 over 2^20 keys.
# ---------------------------------------------------------------------------

LONG_DATA = ["gaussian", "near-constant"]


@pytest.fixture(scope="module", params=LONG_DATA)
def long_inputs(request):
    """4 queries, 2^20 keys, d = 4, float32.

    ``near-constant`` keys and values (a positive mean, spread 1e-3) are the
    worst case for a running float32 sum: each addition rounds the same way,
    so a sum done key after key drifts by about 4e-3; Gaussian data hides it.
    """
    rng = np.random.default_rng(41)
    n_q, n_k, d = 4, 2**20, 4
    q = rng.standard_normal((n_q, d)) * 0.5
    if request.param == "gaussian":
        k = rng.standard_normal((n_k, d)) * 0.5
        v = 1.0 + rng.standard_normal((n_k, 3))
    else:
        k = 0.3 + 1e-3 * rng.standard_normal((n_k, d))
        v = 0.1 + 1e-3 * rng.standard_normal((n_k, 3))
    q, k, v = q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
    # The float64 oracles, once per data set rather than once per backend.
    expected = {
        causal: (softmax_oracle(q, k, v, causal), linear_oracle(q, k, v, "elu", causal))
        for causal in (False, True)
    }
    return q, k, v, expected


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_sums_over_a_million_keys(backend, long_inputs, causal):
    q, k, v, oracle = long_inputs
    soft_exp, (expected, S_exp, z_exp) = oracle[causal]
    out = fastattn.softmax_attention(q, k, v, causal=causal, backend=backend)
    assert_close(out, soft_exp, dtype=np.float32)
    out, (S, z) = fastattn.linear_attention(q, k, v, causal=causal, return_state=True,
                                            backend=backend)
    assert_close(out, expected, dtype=np.float32)
    assert_close(z, z_exp, dtype=np.float32)
    assert_close(S, S_exp, dtype=np.float32)


# ---------------------------------------------------------------------------
# NaN and inf reach only the rows that see them.
# ---------------------------------------------------------------------------

POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def _poisoned(x, j, value):
    x = x.copy()
    x[..., j, :] = value
    return x


def _seeing(n_q, n_k, j, causal):
    """Boolean (n_q,): the rows that see key j (j <= i + n_k - n_q when causal)."""
    if not causal:
        return np.ones(n_q, bool)
    return np.arange(n_q) + (n_k - n_q) >= j


def _without_key(oracle, q, k, v, j, causal):
    """``oracle`` row by row over the keys each row sees, key j left out."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for b in np.ndindex(*q.shape[:-2]):
        for i in range(n_q):
            keys = [m for m in range(n_k) if m != j and (not causal or m <= i + n_k - n_q)]
            if keys:
                out[b][i] = oracle(q[b][i:i + 1], k[b][keys], v[b][keys])[0]
    return out


NAN_SHAPES = [(12, 12, 5), (6, 12, 8), (12, 6, 2)]   # (n_q, n_k, poisoned key j)


#: (dtype, poison): every poison in float32, NaN in float64 too.
POISON_CASES = [(np.float32, "nan"), (np.float32, "inf"), (np.float32, "-inf"), (np.float64, "nan")]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # NaN/inf arithmetic
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sizes", NAN_SHAPES, ids=lambda s: f"nq{s[0]}-nk{s[1]}-j{s[2]}")
@pytest.mark.parametrize("dtype, poison", POISON_CASES,
                         ids=[f"{np.dtype(d).name}-{p}" for d, p in POISON_CASES])
def test_nonfinite_key_or_value_reaches_only_rows_that_see_it(
    backend, dtype, sizes, causal, poison, where
):
    n_q, n_k, j = sizes
    q, k, v = make_qkv((2, n_q, 3), n_k=n_k, d_v=4, dtype=dtype, seed=51)
    if where == "k" and poison != "nan":
        q = np.abs(q) + 0.1      # q > 0: an infinite key gives an infinite logit of one sign
    bad_k = _poisoned(k, j, POISONS[poison]) if where == "k" else k
    bad_v = _poisoned(v, j, POISONS[poison]) if where == "v" else v
    sees = _seeing(n_q, n_k, j, causal)

    oracles = {"softmax": lambda q, k, v, c=False: softmax_oracle(q, k, v, c)}
    results = {"softmax": fastattn.softmax_attention(q, bad_k, bad_v, causal=causal,
                                                     backend=backend)}
    for fm in FEATURE_MAPS:
        oracles[fm] = lambda q, k, v, c=False, fm=fm: linear_oracle(q, k, v, fm, c)[0]
        results[fm] = fastattn.linear_attention(q, bad_k, bad_v, feature_map=fm, causal=causal,
                                                backend=backend)
    for name, out in results.items():
        clean = oracles[name](q, k, v, causal)
        assert out.shape == clean.shape
        # Rows that cannot see key j: finite and equal to the clean result.
        assert np.all(np.isfinite(out[:, ~sees])), f"{name}: a row that cannot see key {j} changed"
        assert_close(out[:, ~sees], clean[:, ~sees], dtype=dtype, err_msg=name)
        # Rows that see it.
        if poison == "nan":
            assert np.all(np.isnan(out[:, sees])), f"{name}: a NaN was lost from a row that sees it"
        elif where == "k" and poison == "-inf":
            # A logit of -inf (softmax) or a feature of 0 (φ(-inf) = 0): key j
            # weighs exactly 0, the result is that of the other keys.
            without = _without_key(oracles[name], q, k, v, j, causal)
            assert_close(out[:, sees], without[:, sees], dtype=dtype, err_msg=name)
        elif where == "v":
            # The infinite value reaches the output: inf where every weight is positive,
            # inf or NaN (unspecified) where a relu feature or weight of 0 meets it.
            assert not np.any(np.isfinite(out[:, sees])), f"{name}: an inf was lost"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # NaN/inf arithmetic
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_nan_query_poisons_only_its_own_row(backend, dtype, causal):
    q, k, v = make_qkv((2, 10, 3), n_k=14, d_v=4, dtype=dtype, seed=52)
    bad_q = _poisoned(q, 4, np.nan)
    others = np.arange(10) != 4
    out = fastattn.softmax_attention(bad_q, k, v, causal=causal, backend=backend)
    assert np.all(np.isnan(out[:, 4]))
    assert_close(out[:, others], softmax_oracle(q, k, v, causal)[:, others], dtype=dtype)
    for fm in FEATURE_MAPS:
        out = fastattn.linear_attention(bad_q, k, v, feature_map=fm, causal=causal, backend=backend)
        assert np.all(np.isnan(out[:, 4]))
        assert_close(out[:, others], linear_oracle(q, k, v, fm, causal)[0][:, others], dtype=dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # NaN/inf arithmetic
def test_nan_in_a_causal_chunk_does_not_reach_earlier_rows(backend):
    """A NaN key late in a long sequence: a chunked kernel must not form 0 · NaN.

    n = 300 spans several query blocks and chunks; the key at j = 250 sits
    inside a chunk whose earlier rows must stay clean.
    """
    q, k, v = make_qkv((1, 300, 4), dtype=np.float32, seed=53)
    j = 250
    for where in ("k", "v"):
        bad_k = _poisoned(k, j, np.nan) if where == "k" else k
        bad_v = _poisoned(v, j, np.nan) if where == "v" else v
        out = fastattn.softmax_attention(q, bad_k, bad_v, causal=True, backend=backend)
        assert np.all(np.isnan(out[:, j:]))
        assert_close(out[:, :j], softmax_oracle(q[:, :j], k[:, :j], v[:, :j], True))
        out, (S, z) = fastattn.linear_attention(q, bad_k, bad_v, causal=True, return_state=True,
                                                backend=backend)
        assert np.all(np.isnan(out[:, j:]))
        assert np.any(np.isnan(S))
        assert_close(out[:, :j], linear_oracle(q[:, :j], k[:, :j], v[:, :j], "elu", True)[0])


#: Past the blocks: n = 2 BK + 7 rows, a poisoned key or value entry at row 5,
#: inside the second query block, and in the middle of the second key block.
LONG_N = 2 * BK + 7
LONG_POSITIONS = [5, BQ + 3, BK + BQ // 2]
LONG_POISONS = {"k-nan": ("k", np.nan), "k-inf": ("k", np.inf), "v-nan": ("v", np.nan),
                "v-inf": ("v", np.inf)}


def _long_poisoned(dtype, what, position, d):
    q, k, v = make_qkv((LONG_N, d), dtype=dtype, seed=7)
    where, value = LONG_POISONS[what]
    (k if where == "k" else v)[position, 1] = value
    return q, k, v


@functools.lru_cache(maxsize=None)
def _long_expected(dtype, what, position, d):
    """The oracles' causal answers, softmax and elu, once for every backend."""
    q, k, v = _long_poisoned(dtype, what, position, d)
    with np.errstate(invalid="ignore", over="ignore"):
        return softmax_oracle(q, k, v, True), linear_oracle(q, k, v, "elu", True)[0]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # NaN/inf arithmetic
@pytest.mark.parametrize("d", [5, 8, 16])   # widths that take BLAS or register-blocked products
@pytest.mark.parametrize("position", LONG_POSITIONS, ids=lambda j: f"j{j}")
@pytest.mark.parametrize("what", LONG_POISONS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_causal_nonfinite_past_the_blocks_reaches_only_the_rows_that_see_it(
    backend, dtype, what, position, d
):
    """One entry of a key or value made NaN or inf: rows before it are finite and right;
    from it on, each entry is finite exactly where the oracle's is, and then close to it."""
    q, k, v = _long_poisoned(dtype, what, position, d)
    expected = dict(zip(("softmax", "elu"), _long_expected(dtype, what, position, d)))
    results = {"softmax": fastattn.softmax_attention(q, k, v, causal=True, backend=backend),
               "elu": fastattn.linear_attention(q, k, v, causal=True, backend=backend)}
    for name, out in results.items():
        want = expected[name]
        assert np.isfinite(out[:position]).all(), f"{name}: a row before the bad entry changed"
        assert not np.isfinite(out[position:]).all(axis=-1).all(), f"{name}: the bad entry was lost"
        np.testing.assert_array_equal(np.isfinite(out), np.isfinite(want), err_msg=name)
        finite = np.isfinite(want)
        assert_close(out[finite], want[finite], dtype=dtype, err_msg=name)


# ---------------------------------------------------------------------------
# The causal linear state carried across pieces equals one pass.
# ---------------------------------------------------------------------------

#: (lead, d_k, d_v, pieces): short pieces, empty ones, and pieces that end one
#: row past a chunk's start, in the middle of a chunk and past two chunks.
PIECES = [
    ((2, 3), 4, 5, [5, 0, 7, 4]),
    ((2, 3), 4, 5, [1] * 16),
    ((2, 3), 4, 5, [15, 1]),
    ((2,), 8, 6, [1, CH + 1, 150 - CH - 2, 51]),
    ((2,), 8, 5, [1, CH + 1, CH + 7, CH + 8]),
]


def _pieces_id(case):
    lead, d_k, d_v, pieces = case
    sizes = "+".join(map(str, pieces)) if len(set(pieces)) > 1 else f"{len(pieces)}x{pieces[0]}"
    return f"B{'x'.join(map(str, lead))}-n{sum(pieces)}-dk{d_k}-dv{d_v}-pieces{sizes}"


@pytest.mark.parametrize("case", PIECES, ids=_pieces_id)
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_causal_linear_state_across_pieces_equals_one_pass(backend, dtype, feature_map, case):
    lead, d_k, d_v, pieces = case
    n = sum(pieces)
    q, k, v = make_qkv((*lead, n, d_k), d_v=d_v, dtype=dtype, seed=61)
    expected, S_exp, z_exp = linear_oracle(q, k, v, feature_map, True)
    whole, (S_whole, z_whole) = fastattn.linear_attention(
        q, k, v, feature_map=feature_map, causal=True, return_state=True, backend=backend
    )
    assert_close(whole, expected, dtype=dtype)
    outs, state, start = [], None, 0
    for size in pieces:
        sl = slice(start, start + size)
        out, state = fastattn.linear_attention(
            q[..., sl, :], k[..., sl, :], v[..., sl, :], feature_map=feature_map, causal=True,
            initial_state=state, return_state=True, backend=backend,
        )
        assert state[0].shape == (*lead, d_k, d_v) and state[1].shape == (*lead, d_k)
        outs.append(out)
        start += size
    assert_close(np.concatenate(outs, axis=-2), whole, dtype=dtype)
    assert_close(np.concatenate(outs, axis=-2), expected, dtype=dtype)
    assert_close(state[0], S_exp, dtype=dtype, scale=_state_scale(n))
    assert_close(state[1], z_exp, dtype=dtype, scale=_state_scale(n))
    assert_close(state[0], S_whole, dtype=dtype, scale=_state_scale(n))
    assert_close(state[1], z_whole, dtype=dtype, scale=_state_scale(n))


# ---------------------------------------------------------------------------
# elu and relu features grow like the inputs: where the denominator overflows the
# dtype the row is NaN in every backend (documented in linear_attention, Notes),
# never a finite x / inf.  In float32 such a call is computed in float64 and
# rounded (issue 33, item 8).
# ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("dtype,finite,overflows", [(np.float32, 1e17, 1e19),
                                                    (np.float64, 1e150, 1e154)],
                         ids=["float32", "float64"])
def test_linear_overflowing_features_give_nan_rows_in_float64_and_float64_answers_in_float32(backend, dtype, finite, overflows,
                                                   feature_map, causal):
    q, k, v = make_qkv((70, 64), dtype=dtype, seed=67)
    q, k = np.abs(q) + 0.5, np.abs(k) + 0.5     # every feature grows with the scale
    small = fastattn.linear_attention(q * dtype(finite), k * dtype(finite), v, causal=causal,
                                      feature_map=feature_map, backend=backend)
    assert np.isfinite(small).all()
    # φ(q)·φ(k) ~ x² d_k: past the dtype's largest number at x = overflows
    big = fastattn.linear_attention(q * dtype(overflows), k * dtype(overflows), v,
                                    causal=causal, feature_map=feature_map, backend=backend)
    if dtype == np.float64:
        assert np.isnan(big).all(axis=-1).all()
        return
    wide = fastattn.linear_attention(*(x.astype(np.float64) for x in (
        q * dtype(overflows), k * dtype(overflows), v)), causal=causal,
        feature_map=feature_map, backend="reference")
    assert big.dtype == np.float32 and np.isfinite(wide).all()
    assert_close(big, wide, dtype=np.float32)


def _overflowing_denominator(dtype, scale, n=70, seed=68):
    """q and k of about ``scale`` (every feature large), v of about 1e-6: φ(q)·z is past
    the dtype's largest number (64 · scale² · n), φ(q)·S is not (a millionth of it).  In
    float32 at 5e17 no one product φ(q_i)·φ(k_j) is (a causal diagonal forms them)."""
    rng = np.random.default_rng(seed)
    q, k = ((np.abs(rng.standard_normal((2, n, 64))) + 0.5) * scale for _ in range(2))
    v = 1e-6 * rng.standard_normal((2, n, 16))
    return tuple(x.astype(dtype) for x in (q, k, v))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the float64 reference overflows
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_a_float32_row_whose_denominator_alone_overflows_gets_the_float64_answer(
        backend, feature_map, causal):
    """The answer is a weighted average of values of 1e-6; x / inf gave 0 on every backend."""
    q, k, v = _overflowing_denominator(np.float32, 5e17)
    out = fastattn.linear_attention(q, k, v, causal=causal, feature_map=feature_map,
                                    backend=backend)
    want = fastattn.linear_attention(*(x.astype(np.float64) for x in (q, k, v)),
                                     causal=causal, feature_map=feature_map,
                                     backend="reference")
    top = np.abs(want).max()
    assert out.dtype == np.float32 and np.isfinite(want).all() and top > 1e-8
    assert_close(out / np.float32(top), want / top, dtype=np.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_a_float64_row_whose_denominator_overflows_is_nan_on_every_backend(backend,
                                                                           feature_map):
    """Non-causal every row's denominator overflows.  Causal, at a scale where about half of
    the rows' do: NaN exactly in the rows whose denominator is past the largest float64, and
    the others keep their answer.  At these magnitudes
    elu+1 and relu are the inputs themselves (x + 1 == x), so the answer is that of the
    scaled inputs with the identity as features, formed here."""
    q, k, v = _overflowing_denominator(np.float64, 1e153)
    full = fastattn.linear_attention(q, k, v, feature_map=feature_map, backend=backend)
    assert np.isnan(full).all()
    q, k, v = _overflowing_denominator(np.float64, 1.0)
    weights = np.tril(q @ k.transpose(0, 2, 1))           # (2, 70, 70), positive below
    den = weights.sum(axis=-1)
    # A scale at which about half of the rows overflow (a row's denominator grows with the
    # keys it sees, and with its query), none within 1e-6 of the largest float64.
    x = np.sqrt(np.finfo(np.float64).max / np.median(den))
    out = fastattn.linear_attention(q * x, k * x, v, causal=True, feature_map=feature_map,
                                    backend=backend)
    past = den * x * x / np.finfo(np.float64).max
    assert (np.abs(past - 1) > 1e-6).all()
    overflowed = past > 1
    assert 0.3 < overflowed.mean() < 0.7
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), overflowed)
    assert np.isfinite(out[~overflowed]).all()
    want = (weights @ v) / den[..., None]
    np.testing.assert_allclose(out[~overflowed], want[~overflowed], rtol=1e-9)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype,scale", [(np.float32, 1e20), (np.float64, 1e153)])
def test_a_step_whose_denominator_overflows_is_the_float64_answer_or_nan(backend, dtype,
                                                                         scale):
    """One query and one key (each backend's recurrent step) after a state whose ``z``
    is past the overflow: float32 gets float64's answer, float64 NaN; so does a
    LinearAttentionState's step."""
    q = np.full((3, 1, 64), scale, dtype)
    v = np.full((3, 1, 16), 1e-6, dtype)
    state = (np.zeros((3, 64, 16), dtype), np.full((3, 64), 100 * scale, dtype))
    out = fastattn.linear_attention(q, q, v, initial_state=state, backend=backend)
    generator = fastattn.LinearAttentionState((3,), 64, 16, dtype=dtype)
    generator.step(*(np.repeat(a, 100, axis=1) for a in (q, q, 0 * v)), backend=backend)
    np.testing.assert_allclose(generator.z, state[1], rtol=1e-6)   # and S = 0
    stepped = generator.step(q, q, v, backend=backend)
    if dtype == np.float64:
        assert np.isnan(out).all() and np.isnan(stepped).all()
        return
    # φ(q)·S / φ(q)·z = (x · 1e-6) / (x · 101 x) = 1e-6 / 101 a column (x = q + 1 or q)
    want = fastattn.linear_attention(*(a.astype(np.float64) for a in (q, q, v)),
                                     initial_state=tuple(a.astype(np.float64) for a in state),
                                     backend="reference")
    np.testing.assert_allclose(want, 1e-6 / 101, rtol=1e-6)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_allclose(stepped, want, rtol=1e-5)


def _underflowing_rows(case, n=5, seed=69):
    """Relu inputs whose float32 rows underflow to 0: keys of 1e-40 against queries of 1e-20
    (φ(q)·z of 3e-60) and values of 1e30; or queries of 1e-40 against keys of 1e17 and values
    of 1e-30 (a numerator of 2e-53)."""
    q_x, k_x, v_x = (1e-20, 1e-40, 1e30) if case == "denominator" else (1e-40, 1e17, 1e-30)
    rng = np.random.default_rng(seed)
    q, k = (x * (1 + rng.random((2, n, 3))) for x in (q_x, k_x))
    v = v_x * (1 + rng.random((2, n, 2)))
    return tuple(a.astype(np.float32) for a in (q, k, v)), v_x


@pytest.mark.parametrize("eps", [0.0, 1e-60, 1e-30])   # 1e-60 is 0 in float32
@pytest.mark.parametrize("case", ["denominator", "numerator"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_float32_relu_row_that_underflows_to_zero_with_a_tiny_eps_gets_the_float64_answer(
        backend, case, causal, eps):
    """Every backend gave rows of 0 (eps of 0 and 1e-60 both cases, 1e-30 the numerator);
    with eps = 0 the answer is an average of the values."""
    (q, k, v), v_x = _underflowing_rows(case)
    out = fastattn.linear_attention(q, k, v, feature_map="relu", eps=eps, causal=causal,
                                    backend=backend)
    want = fastattn.linear_attention(*(a.astype(np.float64) for a in (q, k, v)),
                                     feature_map="relu", eps=eps, causal=causal,
                                     backend="reference")
    assert (want != 0).all()
    if eps == 0:
        assert (np.abs(want) > v_x / 2).all()
    np.testing.assert_allclose(out, want, rtol=1e-5)


def test_a_float32_row_of_relu_with_no_overlap_stays_zero_with_eps_0(backend):
    """Computed again in float64 (a row of zeros), it is zeros there too."""
    q = np.array([[[1.0, -1.0], [2.0, -3.0]]], np.float32)
    k = np.array([[[-1.0, 2.0], [-2.0, 1.0]]], np.float32)
    v = np.ones((1, 2, 3), np.float32)
    out = fastattn.linear_attention(q, k, v, feature_map="relu", eps=0, backend=backend)
    np.testing.assert_array_equal(out, np.zeros((1, 2, 3), np.float32))


def test_with_no_queries_an_overflowed_float32_state_is_float64s_rounded():
    """Each key's φ(k)ᵀ v (1e20 · ±1e19) overflows float32, their sum is 0; with no output
    to show it, the state came back inf.  (With no queries every backend runs the
    reference, fastattn._api.)"""
    k = np.full((1, 2, 4), 1e20, np.float32)
    v = np.array([[[1e19], [-1e19]]], np.float32)
    out, (S, z) = fastattn.linear_attention(np.zeros((1, 0, 4), np.float32), k, v,
                                            return_state=True)
    assert out.shape == (1, 0, 1) and S.dtype == np.float32
    np.testing.assert_array_equal(S, np.zeros((1, 4, 1), np.float32))
    np.testing.assert_allclose(z, np.full((1, 4), 2e20), rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_linear_weights_whose_row_sums_overflow_are_float64s_rounded(causal):
    """Each weight φ(q_i)·φ(k_j) fits float32, a row's sum of 70 of them does not."""
    q, k, _ = _overflowing_denominator(np.float32, 5e17)
    weights = fastattn.attention_weights(q, k, kind="linear", causal=causal)
    want = fastattn.attention_weights(q.astype(np.float64), k.astype(np.float64),
                                      kind="linear", causal=causal)
    assert weights.dtype == np.float32
    assert_close(weights, want.astype(np.float32), dtype=np.float32)
    np.testing.assert_allclose(weights.sum(axis=-1), 1, rtol=1e-5)


def test_float32_linear_weights_keep_the_other_heads_answers_beside_a_given_nan():
    q, k, _ = _overflowing_denominator(np.float32, 5e17)
    q[1, 0, 0] = np.nan
    weights = fastattn.attention_weights(q, k, kind="linear")
    want = fastattn.attention_weights(q[:1].astype(np.float64), k[:1].astype(np.float64),
                                      kind="linear")
    assert_close(weights[:1], want.astype(np.float32), dtype=np.float32)
    assert np.isnan(weights[1, 0]).all() and np.isfinite(weights[1, 1:]).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_relu_weights_that_underflow_to_zero_with_eps_0_are_float64s(causal):
    """attention == weights @ v holds where linear_attention repairs the row."""
    (q, k, v), _ = _underflowing_rows("denominator")
    weights = fastattn.attention_weights(q, k, kind="linear", feature_map="relu", eps=0,
                                         causal=causal)
    want = fastattn.attention_weights(q.astype(np.float64), k.astype(np.float64),
                                      kind="linear", feature_map="relu", eps=0, causal=causal)
    assert weights.dtype == np.float32
    np.testing.assert_allclose(weights.sum(axis=-1), 1, rtol=1e-6)
    np.testing.assert_allclose(weights, want, rtol=1e-5)
    out = fastattn.linear_attention(q, k, v, feature_map="relu", eps=0, causal=causal)
    np.testing.assert_allclose(out, weights @ v, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_a_row_whose_every_logit_is_minus_inf_is_zero(backend, causal):
    # Keys of -inf against a positive query: every logit -inf, no key of any weight, so the
    # row is 0 as a row that sees no key (docs/numerics.md); one finite key takes it all.
    q = np.ones((2, 5, 4), np.float32)
    k = np.full((2, 5, 4), -np.inf, np.float32)
    v = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3) + 1
    out = fastattn.softmax_attention(q, k, v, causal=causal, backend=backend)
    np.testing.assert_array_equal(out, np.zeros((2, 5, 3), np.float32))
    k[:, 2] = 0.0   # rows that see key 2 take its value; the rows before it stay 0
    out = fastattn.softmax_attention(q, k, v, causal=causal, backend=backend)
    seen = slice(2, None) if causal else slice(None)
    np.testing.assert_array_equal(out[:, seen], np.broadcast_to(v[:, 2:3], out[:, seen].shape))
    if causal:
        np.testing.assert_array_equal(out[:, :2], 0)
