"""Numba backend: tiled online-softmax and chunked linear attention kernels.

Implements the backend interface of :mod:`fastattn._api`::

    softmax_forward(q, k, v, causal, scale) -> out (B, n_q, d_v)
    linear_forward(q, k, v, feature_map, causal, eps, S0, z0) -> (out, S, z)
    favor_query_features(x, w), favor_key_features(x, w), taylor_features(x)

plus :func:`set_num_threads` / :func:`get_num_threads`.  The kernels are
compiled once per dtype (float32, float64) and cached on disk
(``cache=True``), so a new process does not recompile them.  BLAS calls made
inside the parallel kernels run on one thread each (threadpoolctl), so the
Numba threads and BLAS threads do not oversubscribe the cores.

Importing this module raises ImportError when Numba is not installed.
"""

import numba  # noqa: F401  (ImportError here marks the backend unavailable)

from ._threads import get_num_threads, set_num_threads
from .linear import favor_key_features, favor_query_features, linear_forward, taylor_features
from .softmax import softmax_forward

__all__ = ["softmax_forward", "linear_forward", "set_num_threads", "get_num_threads",
           "favor_query_features", "favor_key_features", "taylor_features"]
