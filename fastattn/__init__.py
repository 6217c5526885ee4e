"""fastattn: softmax and linear attention kernels, and what they cost as n grows.

Public names:

* :func:`softmax_attention`, :func:`linear_attention` -- the kernels, with
  ``backend="reference" | "numba" | "cython" | "auto"``;
* :func:`attention_weights` -- the explicit weight matrix of either;
* :func:`compare`, :func:`compare_attention`, :func:`quality` -- how far
  linear attention lands from softmax attention;
* :func:`weight_quality`, :func:`row_kl_divergence`, :func:`row_entropy` --
  how its rows of weights differ from softmax's;
* :class:`FavorFeatures` -- FAVOR+ random features with a chosen ``m`` and
  seed, for ``feature_map=`` (see :mod:`fastattn.feature_maps`);
* :class:`HedgehogFeatures` -- feature maps learned from a model's own softmax
  attention (Hedgehog; fitted by :func:`fastattn.model.fit_hedgehog`);
* :func:`available_backends`, :func:`set_num_threads`,
  :func:`get_num_threads`, :func:`num_threads` -- what runs here, on how many
  threads.
* :class:`KVCache`, :class:`LinearAttentionState` -- what a decoder keeps
  between generated tokens.
"""

from ._api import attention_weights, linear_attention, softmax_attention
from ._backends import (
    available_backends,
    get_num_threads,
    num_threads,
    set_num_threads,
    unavailable_backends,
)
from .compare import Comparison, Quality, compare, compare_attention, quality
from .compare import WeightQuality, row_entropy, row_kl_divergence, weight_quality
from .feature_maps import FavorFeatures
from .generation import KVCache, LinearAttentionState
from .model.hedgehog import HedgehogFeatures

__version__ = "0.1.0"

__all__ = [
    "softmax_attention",
    "linear_attention",
    "attention_weights",
    "available_backends",
    "unavailable_backends",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "compare",
    "compare_attention",
    "quality",
    "Comparison",
    "Quality",
    "FavorFeatures",
    "HedgehogFeatures",
    "weight_quality",
    "WeightQuality",
    "row_kl_divergence",
    "row_entropy",
    "KVCache",
    "LinearAttentionState",
]
