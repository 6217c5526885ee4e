"""One place that fixes the thread counts of every backend and of BLAS.

A backend module may expose ``set_num_threads(n)`` and ``get_num_threads()``
(Numba's threading layer, the OpenMP runtime of the Cython extension); BLAS
(OpenBLAS/MKL of NumPy and SciPy) is limited through threadpoolctl.
"""

import contextlib
import numbers
import os
import threading

import numpy as np

from threadpoolctl import ThreadpoolController, threadpool_info, threadpool_limits

from . import _api

_requested = None


def _load_scipy_blas():
    """Load SciPy's own OpenBLAS, so that threadpoolctl sees it.

    SciPy loads it lazily; Numba's ``np.dot`` and the Cython kernels call it.
    A limit set before it is loaded would not reach it.
    """
    import scipy.linalg.cython_blas  # noqa: F401


_blas_lock = threading.Lock()
_blas_controller = None   # threadpoolctl's view of the BLAS libraries, made once (it scans them)
_blas_limiter = None      # the one-thread limit in force while kernel calls run
_blas_calls = 0


@contextlib.contextmanager
def single_threaded_blas():
    """Context: every BLAS library (NumPy's and SciPy's) runs on one thread inside.

    The fast kernels call BLAS from inside their parallel regions (Numba's
    ``prange``, OpenMP); a multithreaded BLAS there would oversubscribe the
    cores.  Calls from several Python threads overlap: the first to enter sets
    the limit and the last to leave restores the previous thread counts.
    """
    global _blas_controller, _blas_limiter, _blas_calls
    with _blas_lock:
        if _blas_calls == 0:
            if _blas_controller is None:
                _load_scipy_blas()
                _blas_controller = ThreadpoolController().select(user_api="blas")
            _blas_limiter = _blas_controller.limit(limits=1)
        _blas_calls += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_calls -= 1
            if _blas_calls == 0:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None


#: Most threads per usable core that set_num_threads accepts: more only
#: oversubscribes the cores (and each Cython thread gets a workspace).
MAX_THREADS_PER_CORE = 4


def check_num_threads(n_threads):
    """``n_threads`` as an int, if it is a sensible thread count here.

    Raises
    ------
    ValueError
        If ``n_threads`` is not an integer from 1 to
        ``MAX_THREADS_PER_CORE`` times the usable cores.
    """
    limit = MAX_THREADS_PER_CORE * default_num_threads()
    if isinstance(n_threads, (bool, np.bool_)) or not isinstance(n_threads, numbers.Integral) \
            or not 1 <= n_threads <= limit:
        raise ValueError(
            f"n_threads must be an integer from 1 to {limit} ({MAX_THREADS_PER_CORE} per "
            f"usable core; this process may use {default_num_threads()}), got {n_threads!r}"
        )
    return int(n_threads)


def set_num_threads(n_threads):
    """Use ``n_threads`` threads in every available backend and in BLAS.

    Parameters
    ----------
    n_threads : int
        From 1 to 4 per usable core.  Numba cannot use more threads than it
        started with (``NUMBA_NUM_THREADS``, default the core count); larger
        values are clipped there.

    Raises
    ------
    ValueError
        If ``n_threads`` is not an integer in that range.
    """
    global _requested
    n_threads = check_num_threads(n_threads)
    _load_scipy_blas()
    for name in _api.available_backends():
        setter = getattr(_api.get_backend(name), "set_num_threads", None)
        if setter is not None:
            setter(n_threads)
    threadpool_limits(n_threads)
    _requested = n_threads


def get_num_threads():
    """Thread counts in force, by component.

    Returns
    -------
    dict of str to int
        ``{"requested": ..., "blas": ..., "<backend>": ...}``; ``requested``
        is None until :func:`set_num_threads` is called.
    """
    counts = {"requested": _requested}
    for name in _api.available_backends():
        getter = getattr(_api.get_backend(name), "get_num_threads", None)
        if getter is not None:
            counts[name] = getter()
    counts["blas"] = blas_threads()
    return counts


def blas_threads():
    """Threads of the loaded BLAS libraries (the largest count), or None if none is loaded."""
    blas = [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]
    return max(blas) if blas else None


@contextlib.contextmanager
def num_threads(n_threads):
    """Context manager: :func:`set_num_threads` inside, the previous counts restored after."""
    before = get_num_threads()
    set_num_threads(n_threads)
    try:
        yield
    finally:
        for name in _api.available_backends():
            setter = getattr(_api.get_backend(name), "set_num_threads", None)
            if setter is not None and before.get(name):
                setter(before[name])
        if before["blas"]:
            threadpool_limits(before["blas"])
        global _requested
        _requested = before["requested"]


def default_num_threads():
    """Threads a run uses when none is asked for: the cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
