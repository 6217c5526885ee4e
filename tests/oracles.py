"""Independent oracles for the edge-case, property and thread tests.

Written from the definitions, one query row at a time in float64, never by
calling fastattn: softmax attention through :func:`scipy.special.softmax`
over the keys a row sees, linear attention as the explicit sums
``Σ_j φ(q_i)·φ(k_j) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)`` over the same keys.
A masked key is left out of the row's sums (never multiplied by 0), so a NaN
or inf in a key or value reaches exactly the rows that see it.
"""

import numpy as np
from scipy.special import softmax as scipy_softmax


def last_visible(i, n_q, n_k, causal):
    """Index of the last key query ``i`` sees (-1: none); bottom-right aligned mask."""
    return i + n_k - n_q if causal else n_k - 1


def phi(x, name):
    """Feature map in float64: ``elu(x) + 1`` or ``max(x, 0)``."""
    x = np.asarray(x, dtype=np.float64)
    if name == "elu":
        with np.errstate(over="ignore"):
            return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if name == "relu":
        return np.maximum(x, 0.0)
    raise ValueError(name)


def softmax_oracle(q, k, v, causal=False, scale=None):
    """``softmax(q kᵀ · scale) v`` row by row in float64; rows that see no key are 0."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    *lead, n_q, d_k = q.shape
    n_k, d_v = v.shape[-2:]
    scale = d_k ** -0.5 if scale is None else scale
    out = np.zeros((*lead, n_q, d_v))
    for idx in np.ndindex(*lead):
        for i in range(n_q):
            last = last_visible(i, n_q, n_k, causal)
            if last < 0:
                continue
            logits = (k[idx][: last + 1] @ q[idx][i]) * scale
            out[idx][i] = scipy_softmax(logits) @ v[idx][: last + 1]
    return out


def linear_oracle(q, k, v, feature_map="elu", causal=False, eps=1e-6, S0=None, z0=None):
    """Linear attention row by row in float64, with the state after the last key.

    Returns ``out (..., n_q, d_v)``, ``S (..., d_k, d_v)``, ``z (..., d_k)``.
    A row whose denominator is exactly 0 is 0.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    *lead, n_q, d_k = q.shape
    n_k, d_v = v.shape[-2:]
    out = np.zeros((*lead, n_q, d_v))
    S_out = np.zeros((*lead, d_k, d_v))
    z_out = np.zeros((*lead, d_k))
    for idx in np.ndindex(*lead):
        S_prev = np.zeros((d_k, d_v)) if S0 is None else np.asarray(S0[idx], np.float64)
        z_prev = np.zeros(d_k) if z0 is None else np.asarray(z0[idx], np.float64)
        fk = phi(k[idx], feature_map)
        for i in range(n_q):
            last = last_visible(i, n_q, n_k, causal)
            fq = phi(q[idx][i], feature_map)
            w = fk[: max(last + 1, 0)] @ fq          # one weight per visible key
            numerator = fq @ S_prev + w @ v[idx][: max(last + 1, 0)]
            denominator = fq @ z_prev + w.sum() + eps
            out[idx][i] = numerator / denominator if denominator != 0 else 0.0
        S_out[idx] = S_prev + fk.T @ v[idx]
        z_out[idx] = z_prev + fk.sum(axis=0)
    return out, S_out, z_out
