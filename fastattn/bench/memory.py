"""Peak extra memory of one call: what the call itself adds, never the interpreter.

Two methods, best first:

``"hwm"`` (Linux)
    In a process that has already made the call once (warm-up), free what
    can be freed (``gc.collect``, glibc ``malloc_trim(0)`` so pages the
    allocator kept are really returned), reset the peak resident set size by
    writing ``5`` to ``/proc/self/clear_refs``, read ``VmRSS``, make the call
    and read ``VmHWM``.  Peak extra = ``VmHWM - VmRSS before``.  It sees every
    allocation (NumPy, Numba's runtime, OpenMP buffers, PyTorch), page by page.
``"tracemalloc"``
    Peak of Python-tracked allocations during the call (NumPy registers its
    buffers with tracemalloc; Numba and compiled code do not).  A cross-check
    for the NumPy reference, and a fallback where ``clear_refs`` is missing.

The sweep runs the probe in a worker process, one point after another; a
fresh process per point is not needed where ``clear_refs`` works.
"""

import ctypes
import ctypes.util
import gc
import os
import time
import tracemalloc

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_bytes(*fields):
    """Values of ``fields`` (e.g. ``"VmRSS"``) of /proc/self/status, in bytes."""
    values = {}
    with open(_STATUS, encoding="ascii") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in fields:
                values[name] = int(rest.split()[0]) * 1024  # reported in kB
    return values


def _malloc_trim():
    """Return free heap pages to the OS (glibc); a no-op elsewhere."""
    path = ctypes.util.find_library("c")
    if not path:
        return
    try:
        libc = ctypes.CDLL(path)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def hwm_available():
    """True if the peak RSS can be reset here (Linux ``/proc/self/clear_refs``)."""
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as handle:
            handle.write("5")
        _status_bytes("VmHWM", "VmRSS")["VmHWM"]
    except (OSError, KeyError):
        return False
    return True


def _settle():
    # The young generations hold any cyclic garbage of the warm-up; a full
    # collection would walk every object of the interpreter (slow, pointless).
    gc.collect(1)
    _malloc_trim()


def peak_extra_hwm(fn, return_elapsed=False):
    """Peak extra resident bytes of ``fn()`` by resetting the peak RSS.

    Parameters
    ----------
    fn : callable
        Called once.  Call it once before (warm-up) so compilation and
        one-time caches are not counted.
    return_elapsed : bool, default False
        Also return the seconds the call took (the probe's own work excluded).

    Returns
    -------
    int, or (int, float) with ``return_elapsed``
        ``VmHWM`` after the call minus ``VmRSS`` just before it, in bytes (at
        least 0); includes the call's output.

    Raises
    ------
    OSError
        If ``/proc/self/clear_refs`` cannot be written (not Linux).
    """
    _settle()
    with open(_CLEAR_REFS, "w", encoding="ascii") as handle:
        handle.write("5")
    before = _status_bytes("VmRSS")["VmRSS"]
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    peak = _status_bytes("VmHWM")["VmHWM"]
    del result
    extra = max(0, peak - before)
    return (extra, elapsed) if return_elapsed else extra


def peak_extra_tracemalloc(fn):
    """Peak bytes traced by tracemalloc during ``fn()`` (NumPy buffers included).

    Returns
    -------
    int
        Peak traced bytes minus the traced bytes before the call.
    """
    _settle()
    started_here = not tracemalloc.is_tracing()
    if started_here:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
        del result
    finally:
        if started_here:
            tracemalloc.stop()
    return max(0, peak - before)


def peak_extra(fn):
    """Peak extra bytes of ``fn()`` by the best method here.

    Returns
    -------
    (int, str)
        Bytes and the method name (``"hwm"`` or ``"tracemalloc"``).
    """
    if os.path.exists(_CLEAR_REFS) and hwm_available():
        return peak_extra_hwm(fn), "hwm"
    return peak_extra_tracemalloc(fn), "tracemalloc"
