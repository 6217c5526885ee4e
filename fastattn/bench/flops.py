"""Floating-point operation counts of one attention call: the one formula.

Throughput (GFLOP/s) and the fraction of the GEMM roof are both derived from
:func:`attention_flops`; nothing else in fastattn counts flops.
"""

import numpy as np

#: Chunk length of the nominal chunked causal linear attention whose work
#: :func:`attention_flops` counts (the same for every backend, so GFLOP/s
#: compare like with like whatever chunk a kernel really uses).
CAUSAL_LINEAR_CHUNK = 64


def visible_pairs(n_q, n_k, causal):
    """Number of (query, key) pairs a call forms.

    Parameters
    ----------
    n_q, n_k : int
        Query and key counts.
    causal : bool
        Bottom-right aligned mask: query ``i`` sees key ``j`` when
        ``j <= i + (n_k - n_q)``.

    Returns
    -------
    int
        ``n_q * n_k`` when not causal, else
        ``sum_i clip(i + n_k - n_q + 1, 0, n_k)`` (``n (n + 1) / 2`` for
        ``n_q = n_k = n``).
    """
    n_q, n_k = int(n_q), int(n_k)
    if not causal:
        return n_q * n_k
    seen = np.clip(np.arange(n_q, dtype=np.int64) + (n_k - n_q + 1), 0, n_k)
    return int(seen.sum())


def _intra_chunk_pairs(n_q, n_k, chunk):
    """Visible (query, key) pairs whose key lies in the query's own key chunk.

    Query ``i`` sits at key position ``p = i + n_k - n_q``; its chunk is keys
    ``[c * (p // c), p]``, so it forms ``p - c * (p // c) + 1 = p % c + 1``
    pairs there (none when ``p < 0``).
    """
    p = np.arange(n_q, dtype=np.int64) + (n_k - n_q)
    p = p[p >= 0]
    return int((p % chunk + 1).sum())


def attention_flops(attention, n_q, n_k, d_k, d_v, causal, batch=1, heads=1,
                    chunk=CAUSAL_LINEAR_CHUNK):
    """Flops of one attention call, counting a multiply-add as 2.

    Parameters
    ----------
    attention : {"softmax", "linear"}
    n_q, n_k, d_k, d_v : int
        Query count, key count, key and value head dimensions.
    causal : bool
        Bottom-right aligned mask (see :func:`visible_pairs`).
    batch, heads : int, default 1
        The count is multiplied by ``batch * heads``.
    chunk : int, default :data:`CAUSAL_LINEAR_CHUNK`
        Chunk length of causal linear attention.

    Returns
    -------
    int

    Notes
    -----
    Per head, with ``P`` the visible pairs (:func:`visible_pairs`):

    * softmax: ``2 P d_k`` for the logits ``q kᵀ`` plus ``2 P d_v`` for the
      weighted sum of ``v``, i.e. ``4 n_q n_k d`` when not causal and
      ``d_k = d_v = d``, about half that when causal.  The exp and the
      normalisation (``O(P)``) are not counted.
    * linear, not causal: ``2 n_k d_k d_v`` for the state ``φ(k)ᵀ v`` plus
      ``2 n_q d_k d_v`` for ``φ(q) S``, i.e. ``4 n d_k d_v``.
    * linear, causal, chunked with chunk ``c`` (the chunk form of
      flash-linear-attention): the same ``4 n d_k d_v`` (state updates and
      query-state products across chunks) plus, inside each chunk, the masked
      quadratic part ``2 P_c (d_k + d_v)`` where ``P_c`` counts the visible
      pairs whose key lies in the query's own chunk (about ``n (c + 1) / 2``).

    The feature map, the denominators (``O(n d_k)``) and the row maximum are
    lower order and not counted.
    """
    if attention == "softmax":
        per_head = 2 * visible_pairs(n_q, n_k, causal) * (d_k + d_v)
    elif attention == "linear":
        per_head = 2 * (n_k + n_q) * d_k * d_v
        if causal:
            per_head += 2 * _intra_chunk_pairs(n_q, n_k, int(chunk)) * (d_k + d_v)
    else:
        raise ValueError(f"attention must be 'softmax' or 'linear', got {attention!r}")
    return int(per_head) * int(batch) * int(heads)
