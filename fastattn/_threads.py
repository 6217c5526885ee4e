"""One place that fixes the thread counts of every backend and of BLAS.

The count is process-wide.  :func:`apply` (behind
:func:`fastattn.set_num_threads`) records it and applies it to the backends
already loaded and to the BLAS libraries (OpenBLAS/MKL of NumPy and SciPy,
through threadpoolctl); a backend loaded later gets it when it loads
(:func:`backend_loaded`, called by :mod:`fastattn._backends`), so setting a
count never imports a backend.  This module imports nothing of fastattn: the
kernels import it.  A backend module may expose ``set_num_threads(n)``
and ``get_num_threads()``; the count it reports when it loads is its default.

Per call, a fast backend asks :func:`kernel_threads` how many threads its
kernel may use: one (a serial run, no thread pool woken, BLAS untouched)
when the work is too small to split or the process was forked from one whose
OpenMP pool had started; otherwise it runs in parallel inside
:func:`single_threaded_blas`, which holds BLAS at one thread through a cached
list of the libraries (no threadpoolctl scan and no limit object per call).

Fork: GNU OpenMP (which both the Cython kernels and Numba's ``omp``
threading layer use) cannot start threads again in a child forked after its
pool started -- the child hangs, or Numba terminates it.  A child forked from
such a process (see :func:`os.register_at_fork`) therefore runs every fast
kernel serially: correct, on one thread.  Use the ``spawn`` or
``forkserver`` start method for children that should use every core.
"""

import numbers
import os
import sys
import threading

import numpy as np

_requested = None

#: Multiply-adds below which a kernel call runs serially: splitting less than
#: about 10 microseconds of work costs more (waking the pool) than it saves.
SERIAL_WORK = 1 << 15

#: Most threads per usable core that set_num_threads accepts: more only
#: oversubscribes the cores (and each Cython thread gets a workspace).
MAX_THREADS_PER_CORE = 4

_pool_started = False   # a parallel kernel ran in this process (GNU OpenMP's pool exists)
_forked_pool = False    # this process was forked from one whose pool had started


def _numba_openmp_launched():
    """Whether Numba's GNU OpenMP threading layer has started in this process."""
    numba = sys.modules.get("numba")
    if numba is None:
        return False
    try:
        layer = numba.threading_layer()
    except ValueError:  # not launched yet
        return False
    if layer != "omp":
        return False     # tbb and workqueue survive a fork (Numba's documentation)
    omppool = sys.modules.get("numba.np.ufunc.omppool")
    return getattr(omppool, "openmp_vendor", "GNU") != "Intel"


def _after_fork_in_child():
    global _forked_pool, _blas_lock, _blas_calls
    if _pool_started or _numba_openmp_launched():
        _forked_pool = True
    # Another thread of the parent may have held the lock or been inside a
    # kernel at the fork: neither exists in the child.
    _blas_lock = threading.Lock()
    if _blas_calls:
        _blas_calls = 0
        for lib, count in _blas_libraries():
            if count != 1:
                lib.set_num_threads(count)


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked_from_running_pool():
    """Whether this process was forked after an OpenMP pool started (fast kernels run serially)."""
    return _forked_pool


def kernel_threads(n_threads, work_items, work):
    """Threads one kernel call runs on.

    Parameters
    ----------
    n_threads : int
        The backend's thread count.
    work_items : int
        Units the kernel shares out (heads times query blocks, chunks, ...).
    work : int
        Multiply-adds of the call, roughly.

    Returns
    -------
    int
        1 when ``work < SERIAL_WORK``, when there is one work item, or in a
        child forked after an OpenMP pool started; else
        ``min(n_threads, work_items)``.
    """
    global _pool_started
    if work < SERIAL_WORK or work_items < 2 or n_threads < 2 or _forked_pool:
        return 1
    _pool_started = True
    return min(n_threads, work_items)


# ---------------------------------------------------------------------------
# BLAS: the libraries, found once (and again when a backend loads), and the
# thread count each had when fastattn last looked or set it.
# ---------------------------------------------------------------------------

_blas_lock = threading.Lock()
_blas_libs = None        # [[LibController, count]], None until scanned
_blas_original = {}      # filepath -> count when first seen (restored by num_threads)
_blas_calls = 0          # kernel calls inside single_threaded_blas right now
_backend_defaults = {}   # backend module loaded -> its thread count when it loaded


def _scan_blas():
    """Find the BLAS libraries loaded now (threadpoolctl scans the process: not per call)."""
    global _blas_libs
    from threadpoolctl import ThreadpoolController

    libs = []
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        count = lib.get_num_threads()
        if count is None:
            continue
        _blas_original.setdefault(lib.filepath, count)
        libs.append([lib, count])
    _blas_libs = libs


def _blas_libraries():
    if _blas_libs is None:
        _scan_blas()
    return _blas_libs


def _set_blas(lib, count):
    lib.set_num_threads(count)
    # threadpoolctl lets only one Python thread set OpenBLAS's shared pool;
    # fastattn serialises its own calls under _blas_lock, so release it.
    clear = getattr(lib, "clear_controlling_thread", None)
    if clear is not None:
        clear()


def _apply_blas(n_threads):
    """Every BLAS library on ``n_threads`` (None: the count it had when first seen)."""
    with _blas_lock:
        _scan_blas()
        for entry in _blas_libs:
            lib, _ = entry
            count = _blas_original[lib.filepath] if n_threads is None else n_threads
            entry[1] = count
            if _blas_calls == 0:   # else the last kernel call to finish sets it
                _set_blas(lib, count)


class _SingleThreadedBlas:
    """Context: every BLAS library runs on one thread inside (see :func:`single_threaded_blas`)."""

    def __enter__(self):
        global _blas_calls
        with _blas_lock:
            if _blas_calls == 0:
                for entry in _blas_libraries():
                    # The count now, given back on exit: a limit set outside fastattn
                    # (threadpoolctl's threadpool_limits) holds after the call too.
                    found = entry[0].get_num_threads()
                    if found is not None:
                        entry[1] = found
                    if entry[1] != 1:
                        _set_blas(entry[0], 1)
            _blas_calls += 1
        return self

    def __exit__(self, *exc):
        global _blas_calls
        with _blas_lock:
            _blas_calls -= 1
            if _blas_calls == 0:
                for lib, count in _blas_libs:
                    if count != 1:
                        _set_blas(lib, count)
        return False


_SINGLE_THREADED_BLAS = _SingleThreadedBlas()


def single_threaded_blas():
    """Context: every BLAS library (NumPy's and SciPy's) runs on one thread inside.

    The fast kernels call BLAS from inside their parallel regions (Numba's
    ``prange``, OpenMP); a multithreaded BLAS there would oversubscribe the
    cores.  Calls from several Python threads overlap: the first to enter sets
    the limit and the last to leave restores the counts it found (so a limit the
    caller set with threadpoolctl still holds after the call).  Costs a lock, a
    call into each library to read its count and, when BLAS is not already on one
    thread, two more.
    """
    return _SINGLE_THREADED_BLAS


def backend_loaded(module):
    """Apply the recorded thread count to a backend that has just loaded.

    Also forgets the list of BLAS libraries: loading a fast backend loads
    SciPy's BLAS, which the next parallel call must find.
    """
    global _blas_libs
    getter = getattr(module, "get_num_threads", None)
    _backend_defaults[module] = getter() if getter is not None else None
    if _requested is not None:
        setter = getattr(module, "set_num_threads", None)
        if setter is not None:
            setter(_requested)
        _apply_blas(_requested)
    else:
        with _blas_lock:
            if _blas_calls == 0:
                _blas_libs = None


# ---------------------------------------------------------------------------
# The count: recorded here, applied to what is loaded.  The public functions
# (fastattn.set_num_threads, get_num_threads, num_threads) are in
# fastattn._backends, which owns the backends.
# ---------------------------------------------------------------------------

def check_num_threads(n_threads):
    """``n_threads`` as an int, if it is a sensible thread count here.

    Raises
    ------
    TypeError
        If ``n_threads`` is not an integer (a bool is not).
    ValueError
        If it is not from 1 to ``MAX_THREADS_PER_CORE`` times the usable cores.
    """
    limit = MAX_THREADS_PER_CORE * default_num_threads()
    if isinstance(n_threads, (bool, np.bool_)) or not isinstance(n_threads, numbers.Integral):
        raise TypeError(f"n_threads must be an integer from 1 to {limit}, got "
                        f"{type(n_threads).__name__} {n_threads!r}")
    if not 1 <= n_threads <= limit:
        raise ValueError(
            f"n_threads must be an integer from 1 to {limit} ({MAX_THREADS_PER_CORE} per "
            f"usable core; this process may use {default_num_threads()}), got {n_threads!r}"
        )
    return int(n_threads)


def requested():
    """The count recorded by :func:`apply` (None: each component's default)."""
    return _requested


def apply(n_threads):
    """Record ``n_threads`` (None: each component's default) and apply it to every backend
    loaded so far (those :func:`backend_loaded` was told of) and to BLAS."""
    global _requested
    _requested = n_threads
    for module, default in _backend_defaults.items():
        setter = getattr(module, "set_num_threads", None)
        if setter is not None:
            setter(default if n_threads is None else n_threads)
    _apply_blas(n_threads)


def blas_threads():
    """Threads of the loaded BLAS libraries (the largest count), or None if none is loaded."""
    with _blas_lock:
        if _blas_calls == 0:   # else the libraries are held at one thread: keep their counts
            _scan_blas()
        counts = [count for _, count in _blas_libraries()]
    return max(counts) if counts else None


def default_num_threads():
    """Threads a run uses when none is asked for: the cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
