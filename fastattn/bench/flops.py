"""Flops of one attention call: the one formula behind every GFLOP/s and roof fraction."""

import numpy as np

#: Chunk of the nominal chunked causal linear attention counted, for every backend alike.
CAUSAL_LINEAR_CHUNK = 64


def visible_pairs(n_q, n_k, causal):
    """(query, key) pairs a call forms: ``n_q n_k``, or causal (bottom-right: query ``i``
    sees key ``j <= i + n_k - n_q``) ``sum_i clip(i + n_k - n_q + 1, 0, n_k)``."""
    n_q, n_k = int(n_q), int(n_k)
    if not causal:
        return n_q * n_k
    return int(np.clip(np.arange(n_q, dtype=np.int64) + (n_k - n_q + 1), 0, n_k).sum())


def attention_flops(attention, n_q, n_k, d_k, d_v, causal, batch=1, heads=1,
                    chunk=CAUSAL_LINEAR_CHUNK):
    """Flops of one call (a multiply-add is 2) per head times heads: softmax ``2 P (d_k +
    d_v)``, ``P`` the visible pairs; linear ``2 (n_k + n_q) d_k d_v``, causal (chunked) plus
    ``2 P_c (d_k + d_v)`` within chunks.  Exp, maps and denominators are not counted."""
    if attention == "softmax":
        per_head = 2 * visible_pairs(n_q, n_k, causal) * (d_k + d_v)
    elif attention == "linear":
        per_head = 2 * (n_k + n_q) * d_k * d_v
        if causal:  # query i at key position p = i + n_k - n_q >= 0 sees p % chunk + 1 keys
            p = np.arange(n_q, dtype=np.int64) + (n_k - n_q)
            per_head += 2 * int((p[p >= 0] % int(chunk) + 1).sum()) * (d_k + d_v)
    else:
        raise ValueError(f"attention must be 'softmax' or 'linear', got {attention!r}")
    return int(per_head) * int(batch) * int(heads)
