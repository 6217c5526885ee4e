"""The OpenMP runtime of the Cython kernels: thread count, and whether it exists.

Built with ``-fopenmp`` when the compiler supports it; otherwise the kernels'
``prange`` loops run serially and the thread count is fixed at 1.
"""

# The thread count of every kernel call, whichever Python thread makes it:
# omp_set_num_threads only sets the calling thread's default, so the count is
# kept here and handed to each parallel region explicitly.
_n_threads = omp_get_max_threads()


def openmp_enabled():
    """Whether the extensions were compiled with OpenMP (parallel ``prange``).

    Returns
    -------
    bool
    """
    return bool(FASTATTN_OPENMP)


def set_num_threads(n_threads):
    """Use ``n_threads`` OpenMP threads in the Cython kernels.

    Parameters
    ----------
    n_threads : int
        At least 1.  Ignored (the kernels run on one thread) in a build
        without OpenMP.

    Raises
    ------
    ValueError
        If ``n_threads`` is not a positive int.
    """
    global _n_threads
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
        raise ValueError(f"n_threads must be a positive int, got {n_threads!r}")
    omp_set_num_threads(n_threads)
    _n_threads = n_threads if FASTATTN_OPENMP else 1


def get_num_threads():
    """Threads the next kernel call uses, from any Python thread (1 without OpenMP).

    Returns
    -------
    int
    """
    return _n_threads
