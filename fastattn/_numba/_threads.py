"""Thread control of the Numba backend: Numba's pool, and BLAS held to one thread."""

import numba

# BLAS held at one thread during a kernel call: shared with the Cython backend.
from .._threads import single_threaded_blas  # noqa: F401


def set_num_threads(n_threads):
    """Run the Numba kernels on ``n_threads`` threads.

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
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
        raise ValueError(f"n_threads must be a positive int, got {n_threads!r}")
    numba.set_num_threads(min(n_threads, numba.config.NUMBA_NUM_THREADS))


def get_num_threads():
    """Number of threads the Numba kernels run on (int)."""
    return numba.get_num_threads()
