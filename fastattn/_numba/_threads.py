"""Thread control of the Numba backend: one process-wide count, and how each call runs.

Numba's own thread count (``numba.set_num_threads``) belongs to the Python
thread that sets it; the backend keeps one count for the whole process and
gives it to Numba in whichever Python thread launches a parallel kernel.

A call too small to split, or made in a child forked after GNU OpenMP's pool
started (where a parallel kernel would be terminated), runs the kernel's
serial twin: the same function compiled without ``parallel=True`` (``prange``
runs as ``range``), which wakes no thread pool.  See
:func:`fastattn._threads.kernel_threads`.
"""

import functools
import types

import numba

from .._threads import kernel_threads, single_threaded_blas
from .config import JIT_SERIAL

_n_threads = numba.config.NUMBA_NUM_THREADS


def set_num_threads(n_threads):
    """Run the Numba kernels on ``n_threads`` threads, whichever Python thread calls them.

    Parameters
    ----------
    n_threads : int
        At least 1; values above ``numba.config.NUMBA_NUM_THREADS`` (the pool
        size fixed at start-up, by default the core count) are clipped to it.

    Raises
    ------
    ValueError
        If ``n_threads`` is not a positive int.
    """
    global _n_threads
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
        raise ValueError(f"n_threads must be a positive int, got {n_threads!r}")
    _n_threads = min(n_threads, numba.config.NUMBA_NUM_THREADS)


def get_num_threads():
    """Number of threads the next Numba kernel call may use, from any Python thread (int)."""
    return _n_threads


@functools.cache
def serial_twin(kernel):
    """``kernel`` (a ``parallel=True`` dispatcher) compiled serially, cached on disk apart.

    The twin gets its own qualified name, so Numba's disk cache (keyed by the
    name, not by the flags) keeps the two compilations apart.
    """
    py = kernel.py_func
    twin = types.FunctionType(py.__code__, py.__globals__, py.__name__ + "_serial",
                              py.__defaults__, py.__closure__)
    twin.__qualname__ = py.__qualname__ + "_serial"
    twin.__module__ = py.__module__
    twin.__doc__ = py.__doc__
    return numba.njit(**JIT_SERIAL)(twin)


def _parallel(kernel):
    return kernel


class _Serial:
    """A call on one thread: kernels are swapped for their serial twins, BLAS left alone."""

    def __enter__(self):
        return serial_twin

    def __exit__(self, *exc):
        return False


class _Parallel:
    """A parallel call: Numba's count set for this Python thread, BLAS on one thread."""

    def __enter__(self):
        single_threaded_blas().__enter__()
        return _parallel

    def __exit__(self, *exc):
        return single_threaded_blas().__exit__(*exc)


_SERIAL, _PARALLEL = _Serial(), _Parallel()


def launch(work_items, work):
    """Context for one call: ``with launch(items, work) as pick: pick(kernel)(...)``.

    Parameters
    ----------
    work_items : int
        Units the kernels' ``prange`` loops share out.
    work : int
        Multiply-adds of the call, roughly.

    ``pick(kernel)`` is the parallel kernel, or its serial twin when the call
    runs on one thread (see :func:`fastattn._threads.kernel_threads`).
    """
    n_threads = kernel_threads(_n_threads, work_items, work)
    if n_threads == 1:
        return _SERIAL
    if numba.get_num_threads() != n_threads:
        numba.set_num_threads(n_threads)
    return _PARALLEL
