"""Numba backend: tiled online-softmax and chunked linear attention kernels.

Implements the backend interface of :mod:`fastattn._backends`::

    softmax_forward(q, k, v, causal, scale) -> out (B, n_q, d_v)
    linear_forward(q, k, v, feature_map, causal, eps, S0, z0) -> (out, S, z)
    favor_key_features(x, w) -> (features, c), favor_query_features(x, w, c),
    taylor_features(x)

plus :func:`set_num_threads` / :func:`get_num_threads` (one count for the
whole process).  The kernels are compiled once per dtype (float32, float64)
and cached on disk (``cache=True``), so a new process does not recompile
them.  Where no writable cache exists (a read-only install and ``HOME``) they
are compiled in every process instead, with a warning, and
``backend="auto"`` passes over this backend (:data:`AUTO_UNSUITABLE`).
BLAS calls made inside the parallel kernels run on one thread each, so the
Numba threads and BLAS threads do not oversubscribe the cores; calls too
small to split run serially (see :mod:`fastattn._numba._threads`).

Importing this module raises ImportError when Numba is not installed.
"""

import numba  # noqa: F401  (ImportError here marks the backend unavailable)
# SciPy's BLAS, which Numba's np.dot calls, is loaded now, so that the thread
# limits find it before the first kernel call (Numba would load it lazily).
import scipy.linalg.cython_blas  # noqa: F401

from .._warnings import warn_user
from ._threads import get_num_threads, set_num_threads
from .config import DISK_CACHE, NO_DISK_CACHE_REASON
from .linear import favor_key_features, favor_query_features, linear_forward, taylor_features
from .softmax import softmax_forward

#: Why ``backend="auto"`` passes over this backend here, or None.
AUTO_UNSUITABLE = None
if not DISK_CACHE:
    AUTO_UNSUITABLE = (
        "Numba has no writable cache here, so its kernels compile in every process "
        f"({NO_DISK_CACHE_REASON}); set NUMBA_CACHE_DIR to a writable directory"
    )
    warn_user(f"fastattn's numba backend runs without its disk cache: {AUTO_UNSUITABLE}",
              RuntimeWarning)

__all__ = [
    "softmax_forward",
    "linear_forward",
    "set_num_threads",
    "get_num_threads",
    "AUTO_UNSUITABLE",
    "favor_query_features",
    "favor_key_features",
    "taylor_features",
]
