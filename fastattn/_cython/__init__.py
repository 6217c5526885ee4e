"""Cython backend: compiled online-softmax and linear attention kernels.

Built by ``pip install`` from ``fastattn/_cython/*.pyx``; importing this
package raises ImportError when the extensions were not built, so the
registry in :mod:`fastattn._backends` falls back to another backend.

The kernels parallelise over heads and blocks with OpenMP and call SciPy's
BLAS (``scipy.linalg.cython_blas``) from inside the parallel region where their
register-blocked products do not apply, so such a parallel call holds BLAS at
one thread (see :mod:`fastattn._threads`) to keep the OpenMP threads and the
BLAS threads from oversubscribing the cores.  A
call too small to split, or made in a child forked after the OpenMP pool
started, runs on one thread without waking the pool.
"""

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import weakref

import numpy as np

from .. import _overflow, reference
from .._threads import kernel_threads, single_threaded_blas
from .._warnings import warn_user


@contextlib.contextmanager
def _scipy_cython_blas_alone():
    """While the extensions load, ``scipy.linalg.cython_blas`` is loaded without ``scipy.linalg``.

    The extensions import that module when they load, to take the BLAS
    function pointers from its table; importing it the usual way first runs
    ``scipy/linalg/__init__.py``, which imports most of SciPy's linear algebra
    (0.15-0.5 s, most of a first Cython call's cost) for a table that needs
    none of it.  Here the module is loaded from its file under its own name
    for the extensions, then taken out of ``sys.modules`` again (the pointers
    stay valid: the shared library stays loaded), so that a later ``import
    scipy.linalg.cython_blas`` (Numba's) is the usual, complete import.  If
    SciPy is laid out otherwise, nothing is done and the usual import runs.
    """
    name = "scipy.linalg.cython_blas"
    module = None
    if name not in sys.modules and "scipy.linalg" not in sys.modules:
        try:
            import scipy

            found = importlib.machinery.PathFinder.find_spec(
                "cython_blas", [os.path.join(os.path.dirname(scipy.__file__), "linalg")])
            if found is not None and isinstance(found.loader,
                                                importlib.machinery.ExtensionFileLoader):
                spec = importlib.util.spec_from_file_location(name, found.origin)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[name] = module
        except Exception:  # noqa: BLE001  (any failure: the usual import runs instead)
            module = None
    try:
        yield
    finally:
        if module is not None and sys.modules.get(name) is module:
            del sys.modules[name]


try:
    with _scipy_cython_blas_alone():
        from . import _blas, _openmp, decode, linear, softmax  # noqa: F401  (compiled extensions)
except ImportError as exc:
    raise ImportError(
        "the Cython kernels of fastattn are not built here (install the package "
        f"with `pip install .`, which compiles them): {exc}"
    ) from exc
from ._openmp import get_num_threads, openmp_enabled, set_num_threads

#: Values of ``FASTATTN_SIMD`` (any case, blanks around ignored): ``avx2`` holds an
#: AVX-512 CPU to the AVX2 products, ``off`` every CPU to BLAS.
SIMD_CAPS = ("avx2", "off")


def _read_simd_cap():
    """Make every extension read ``FASTATTN_SIMD`` now, so that all of them hold the
    value this process imported them with; warn about a value that is neither
    of :data:`SIMD_CAPS` (it is ignored)."""
    cap = os.environ.get("FASTATTN_SIMD")
    if cap is not None and cap.strip() and cap.strip().lower() not in SIMD_CAPS:
        warn_user(f"FASTATTN_SIMD={cap!r} is ignored: expected one of {list(SIMD_CAPS)} "
                  "(or unset)", RuntimeWarning)
    for module in (softmax, linear, decode):
        module._products_isa()


_read_simd_cap()
from . import linear as _linear
from . import softmax as _softmax
from .linear import CHUNK, linear_attention_forward
from .softmax import BLOCK_K, BLOCK_Q, _build_features, online_softmax_forward
from .decode import split_key_softmax_forward
from .. import _policy


def _blas_guard(n_threads, dtype, *widths):
    """The context a parallel call runs in: :func:`single_threaded_blas`, unless the
    register-blocked products take every product of it (rows of ``widths`` elements of
    ``dtype``, see ``linear._takes_products``), so that it calls no BLAS.

    Holding BLAS at one thread and giving its threads back costs calls into each BLAS
    library, about 24 us a call with OpenBLAS on 2 threads; timed side by side in one
    process, 2-thread linear calls at (1, 4096, 64) took 2-3 % less without it.  A call
    that never reaches BLAS need not pay that.
    """
    if n_threads > 1 and not all(linear._takes_products(w, dtype) for w in widths):
        return single_threaded_blas()
    return contextlib.nullcontext()


__all__ = [
    "softmax_forward",
    "linear_forward",
    "output_finite",
    "set_num_threads",
    "get_num_threads",
    "openmp_enabled",
    "vector_exp_enabled",
    "BLOCK_Q",
    "BLOCK_K",
    "CHUNK",
    "favor_query_features",
    "favor_key_features",
    "taylor_features",
]

def vector_exp_enabled():
    """Whether the softmax inner loop was compiled to call a vector ``exp`` (libmvec).

    Returns
    -------
    bool
    """
    return _build_features()["vector_exp"]


def softmax_forward(q, k, v, causal, scale):
    """Softmax attention by the tiled online softmax (see ``online_softmax_forward``).

    Calls that :func:`fastattn._policy.use_split_keys` names decode steps run
    the split-key kernel (:mod:`fastattn._cython.decode`) instead.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k), float32 or float64, C-contiguous
    k : ndarray of shape (B, n_k, d_k)
    v : ndarray of shape (B, n_k, d_v)
    causal : bool
    scale : float

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v)
        Or ``(out, finite)`` from the split-key kernel, which checks its output itself.

    A scale below 1 multiplies ``q`` first (:func:`fastattn._overflow.kernel_query`; the
    split-key kernel does it in C).
    """
    n_batch, n_q, d_k = q.shape
    n_k, d_v = k.shape[1], v.shape[2]
    if _policy.use_split_keys(n_q):
        return split_key_softmax_forward(q, k, v, causal, scale, check_finite=True)
    n_threads = kernel_threads(get_num_threads(), n_batch * -(-n_q // BLOCK_Q),
                               n_batch * n_q * n_k * (d_k + d_v))
    q, scale = _kernel_query(q, scale, n_threads)
    # The tile's own products need d_k and d_v both whole vectors (and n_k > 0).
    with _blas_guard(n_threads, q.dtype, d_k, d_v):
        return online_softmax_forward(q, k, v, causal, scale, n_threads)


def _kernel_query(q, scale, n_threads):
    """:func:`fastattn._overflow.kernel_query`, its float64 product rounded once (a float32
    ``q`` whose scale float32 does not hold, ``1 / sqrt(32)``) formed in one pass on
    ``n_threads`` threads (``softmax.scaled_query``) instead of NumPy's three on one."""
    return _overflow.kernel_query(q, scale, lambda q, scale: _softmax.scaled_query(
        q.reshape(-1), scale, n_threads).reshape(q.shape))


def linear_forward(q, k, v, feature_map, causal, eps, S0=None, z0=None):
    """Linear attention with state (see ``linear_attention_forward``).

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v)
    S : ndarray of shape (B, d_k, d_v)
    z : ndarray of shape (B, d_k)
    """
    n_batch, n_q, d_k = q.shape
    n_k, d_v = k.shape[1], v.shape[2]
    n_threads = kernel_threads(get_num_threads(), n_batch * -(-(n_q if causal else n_k) // CHUNK),
                               n_batch * (n_q + n_k) * d_k * d_v)
    # Each thread's workspace (linear.pyx, _noncausal_workspace / _causal_workspace, bounded
    # here): a chunk's rows of d_k features, and causal its own (d_k, d_v) state.
    per_thread = (3 * CHUNK + 16) * d_k + CHUNK * CHUNK + CHUNK + (d_k * d_v + d_k if causal else 0)
    reference.check_fits_in_memory(
        n_threads * per_thread * q.dtype.itemsize,
        f"the Cython linear kernel, for the workspace of its {n_threads} thread(s) at "
        f"{d_k:,} features,", advice="give fewer features (D) or use backend='numba'")
    # A float32 output of an elementwise map is checked for inf and NaN (fastattn.feature_maps
    # asks, through output_finite) by the kernel, each chunk's rows as they are finished.  Not
    # "identity": a map may rewrite rows of the output after the call (FAVOR+'s exact causal
    # rows), and a verdict on the kernel's rows would not be one on the answer.
    check = q.dtype == np.float32 and feature_map != "identity"
    # Linear attention's products are register-blocked when d_v is whole vectors.
    with _blas_guard(n_threads, q.dtype, d_v):
        result = linear_attention_forward(q, k, v, feature_map, causal, eps, S0, z0,
                                          n_threads, check)
    if not check:
        return result
    out, S, z, finite = result
    _checked.last = (weakref.ref(out), finite)
    return out, S, z


#: This Python thread's last float32 linear output and whether its kernel found every
#: element finite (see :func:`output_finite`).
_checked = threading.local()


def output_finite(out):
    """Whether every element of ``out`` is finite, exactly.

    The output of this thread's last float32 linear call with an elementwise map (``out``
    itself, not a copy or a view, as the kernel left it): the verdict of its kernel, which
    checked each chunk's rows as it finished them, while they were in cache; no pass here.
    Else, for a C-contiguous float32 or float64 array its blocks are checked on the kernel
    threads (``linear.all_finite_parallel``), with no temporary; else
    :func:`fastattn._overflow.output_finite`.

    The kernel's check took 2.5-6.7 % of a float32 call's time as a pass of its own
    (``all_finite_parallel`` after the call: (1, 1, 4096, 64) to (1, 8, 16384, 64) and
    (4, 12, 512, 32), 1 and 2 threads).

    NumPy's ``isfinite(out).all()`` runs on one thread and writes a bool array the size of
    ``out``: after a 2-thread float32 linear call of (8, 4096, 64) it took a sixth of the
    call's time, the other thread idle.  Its work for :func:`kernel_threads` is the
    element count: from 32,768 elements the blocks are shared out (the threads have just
    run the call; side by side from 262,144 elements up, 6-16 % less time a 2-thread call).
    """
    last = getattr(_checked, "last", None)
    if last is not None and last[0]() is out:
        _checked.last = None
        return last[1]
    if out.dtype not in (np.float32, np.float64) or not out.flags.c_contiguous:
        return _overflow.output_finite(out)
    n_threads = kernel_threads(get_num_threads(), -(-out.size // _linear.FINITE_BLOCK),
                               out.size)
    return _linear.all_finite_parallel(out.reshape(-1), n_threads)


def _feature_call(kernel, x, work, *args):
    """``kernel(x, *args, n_threads)``, sharing ``x``'s rows out, for ``work`` multiply-adds."""
    n_threads = kernel_threads(get_num_threads(), x.shape[0] * x.shape[1], work)
    if n_threads == 1:
        return kernel(x, *args, 1)
    with single_threaded_blas():
        return kernel(x, *args, n_threads)


def favor_query_features(x, w, key_shift):
    """FAVOR+ query features ``(B, n, m)`` in the keys' frame ``key_shift (B, m)``
    (see ``linear.favor_query_features``)."""
    return _feature_call(_linear.favor_query_features, x, x.size * w.shape[1], w, key_shift)


def favor_key_features(x, w):
    """FAVOR+ key features ``(B, n, m)`` and shifts ``(B, m)`` (see ``linear.favor_key_features``)."""
    return _feature_call(_linear.favor_key_features, x, x.size * w.shape[1], w)


def taylor_features(x):
    """Taylor features ``(B, n, D)`` (see ``linear.taylor_features``)."""
    return _feature_call(_linear.taylor_features, x, x.size * x.shape[2])
