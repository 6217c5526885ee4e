"""Linear attention (elu + 1 feature map): time, peak extra memory and error as n grows.

Each benchmark calls the public :func:`fastattn.linear_attention` with
``backend=...``.  The reference's causal form is the masked quadratic one
(O(n^2) memory, bounded at ``common.REFERENCE_MAX_N``); its non-causal form is
two O(n d^2) products and runs over the whole grid.
"""

from .common import _AccuracySuite, _AttentionSuite


class LinearAttention(_AttentionSuite):
    """``linear_attention(q, k, v, feature_map="elu", causal=..., backend=...)``, shape (1, n, 64)."""

    attention = "linear"


class LinearAccuracy(_AccuracySuite):
    """Max abs error of ``linear_attention`` against the float64 reference, at n = common.ERROR_N (1024)."""

    attention = "linear"
