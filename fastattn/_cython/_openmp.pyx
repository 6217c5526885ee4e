"""The OpenMP runtime of the Cython kernels: thread count, and whether it exists.

Built with ``-fopenmp`` when the compiler supports it; otherwise the kernels'
``prange`` loops run serially and the thread count is fixed at 1.
"""

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
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
        raise ValueError(f"n_threads must be a positive int, got {n_threads!r}")
    omp_set_num_threads(n_threads)


def get_num_threads():
    """Threads the next parallel kernel call uses (1 without OpenMP).

    Returns
    -------
    int
    """
    return omp_get_max_threads()
