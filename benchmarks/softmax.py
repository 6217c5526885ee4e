"""Softmax attention: time, peak extra memory and error of every backend as n grows.

Each benchmark calls the public :func:`fastattn.softmax_attention` with
``backend=...``; the reference materialises n x n arrays (O(n^2) memory) and
is bounded at ``common.REFERENCE_MAX_N``; the tiled kernels run to n = 16384.
"""

from .common import _AccuracySuite, _AttentionSuite


class SoftmaxAttention(_AttentionSuite):
    """``softmax_attention(q, k, v, causal=..., backend=...)``, q, k, v of shape (1, n, 64)."""

    attention = "softmax"


class SoftmaxAccuracy(_AccuracySuite):
    """Max abs error of ``softmax_attention`` against the float64 reference, at n = common.ERROR_N (1024)."""

    attention = "softmax"
