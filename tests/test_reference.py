"""The NumPy reference against independent formulations of the same maths.

Each oracle is written from the definition, never by calling the reference
another way: softmax row by row with SciPy's softmax (:mod:`oracles`), and
here causal linear attention in its recurrent form, one key at a time.
"""

import numpy as np
import pytest

import fastattn
from conftest import assert_close, make_qkv, shape_id
from oracles import phi, softmax_oracle

SHAPES = [
    # (lead, n_q, n_k, d_k, d_v)
    ((), 1, 1, 1, 1),
    ((), 7, 7, 5, 3),
    ((), 5, 9, 4, 6),    # more keys than queries (decoder with a cache)
    ((), 9, 5, 4, 4),    # more queries than keys: rows that see no key
    ((2,), 6, 6, 3, 2),
    ((2, 3), 8, 11, 4, 5),
]


def linear_recurrent_oracle(q, k, v, feature_map, causal, eps, S0=None, z0=None):
    """Causal linear attention as an RNN: S += φ(k_j)ᵀ v_j, z += φ(k_j), one key at a time."""
    *lead, n_q, d_k = q.shape
    n_k, d_v = v.shape[-2:]
    out = np.zeros((*lead, n_q, d_v))
    S_out = np.zeros((*lead, d_k, d_v))
    z_out = np.zeros((*lead, d_k))
    for idx in np.ndindex(*lead):
        S = np.zeros((d_k, d_v)) if S0 is None else S0[idx].astype(np.float64).copy()
        z = np.zeros(d_k) if z0 is None else z0[idx].astype(np.float64).copy()
        S_all = S + phi(k[idx], feature_map).T @ v[idx]
        z_all = z + phi(k[idx], feature_map).sum(axis=0)
        seen = 0
        for i in range(n_q):
            last = i + n_k - n_q if causal else n_k - 1
            while seen <= last:
                f = phi(k[idx][seen], feature_map)
                S += np.outer(f, v[idx][seen])
                z += f
                seen += 1
            fq = phi(q[idx][i], feature_map)
            den = fq @ z + eps
            out[idx][i] = (fq @ S) / den if den != 0 else 0.0
        S_out[idx], z_out[idx] = S_all, z_all
    return out, S_out, z_out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_softmax_reference_matches_scipy_row_by_row(shape, causal):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, seed=1)
    for scale in (None, 0.3):
        expected = softmax_oracle(q, k, v, causal, scale or d_k ** -0.5)
        actual = fastattn.softmax_attention(q, k, v, causal=causal, scale=scale, backend="reference")
        assert_close(actual, expected)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_linear_reference_matches_recurrent_form(shape, causal, feature_map):
    lead, n_q, n_k, d_k, d_v = shape
    q, k, v = make_qkv((*lead, n_q, d_k), n_k=n_k, d_v=d_v, seed=2)
    expected, S_exp, z_exp = linear_recurrent_oracle(q, k, v, feature_map, causal, 1e-6)
    out, (S, z) = fastattn.linear_attention(
        q, k, v, feature_map=feature_map, causal=causal, return_state=True, backend="reference"
    )
    assert_close(out, expected)
    assert_close(S, S_exp)
    assert_close(z, z_exp)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_linear_initial_state_matches_recurrent_form(feature_map):
    q, k, v = make_qkv((2, 6, 3), n_k=8, d_v=4, seed=3)
    rng = np.random.default_rng(4)
    S0 = rng.random((2, 3, 4))
    z0 = rng.random((2, 3)) + 0.5
    for causal in (False, True):
        expected, S_exp, z_exp = linear_recurrent_oracle(q, k, v, feature_map, causal, 1e-6, S0, z0)
        out, (S, z) = fastattn.linear_attention(
            q, k, v, feature_map=feature_map, causal=causal, initial_state=(S0, z0),
            return_state=True, backend="reference",
        )
        assert_close(out, expected)
        assert_close(S, S_exp)
        assert_close(z, z_exp)


@pytest.mark.parametrize("pieces", [[5, 5, 6], [1, 15], [16], [3, 0, 13]], ids=str)
def test_causal_linear_pieces_with_state_equal_one_pass(pieces):
    q, k, v = make_qkv((2, 16, 4), d_v=3, seed=5)
    whole, (S_whole, z_whole) = fastattn.linear_attention(
        q, k, v, causal=True, return_state=True, backend="reference"
    )
    outs, state, start = [], None, 0
    for size in pieces:
        sl = slice(start, start + size)
        out, state = fastattn.linear_attention(
            q[:, sl], k[:, sl], v[:, sl], causal=True, initial_state=state,
            return_state=True, backend="reference",
        )
        outs.append(out)
        start += size
    assert_close(np.concatenate(outs, axis=1), whole)
    assert_close(state[0], S_whole)
    assert_close(state[1], z_whole)


def test_attention_weights_reproduce_the_outputs():
    q, k, v = make_qkv((3, 10, 4), n_k=12, d_v=5, seed=6)
    for causal in (False, True):
        w_soft = fastattn.attention_weights(q, k, kind="softmax", causal=causal)
        w_lin = fastattn.attention_weights(q, k, kind="linear", causal=causal)
        assert w_soft.shape == w_lin.shape == (3, 10, 12)
        assert_close(w_soft @ v, fastattn.softmax_attention(q, k, v, causal=causal, backend="reference"))
        assert_close(w_lin @ v, fastattn.linear_attention(q, k, v, causal=causal, backend="reference"))
        # Softmax rows that see a key sum to 1; masked weights are exactly 0.
        seen = np.arange(12)[None, :] <= np.arange(10)[:, None] + 2 if causal else np.ones((10, 12), bool)
        assert np.all(w_soft[:, ~seen] == 0) and np.all(w_lin[:, ~seen] == 0)
        np.testing.assert_allclose(w_soft.sum(-1), 1.0, rtol=1e-12)
        assert np.all(w_lin >= 0)


def test_reference_refuses_an_n_by_n_array_that_cannot_fit(monkeypatch):
    import fastattn.reference as ref

    monkeypatch.setattr(ref, "available_memory", lambda: 1 << 20)
    q, k, v = make_qkv((1, 1024, 2), dtype=np.float32)
    with pytest.raises(MemoryError) as info:
        fastattn.softmax_attention(q, k, v, backend="reference")
    needed = 1024 * 1024 * 4  # the one float32 scores array
    assert f"{needed:,} bytes" in str(info.value)
    assert "'numba'" in str(info.value) and "'cython'" in str(info.value)
    with pytest.raises(MemoryError):
        fastattn.linear_attention(q, k, v, causal=True, backend="reference")
    # Non-causal linear attention has no n x n intermediate and still runs.
    assert fastattn.linear_attention(q, k, v, backend="reference").shape == (1, 1024, 2)
