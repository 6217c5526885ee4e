"""Shared pieces of the asv suite: grids, thread counts, input factories, memory probe.

Environment variables read here (all optional):

``FASTATTN_ASV_QUICK=1``
    Shrink every grid to one tiny ``n`` and float32 only, for the CI smoke
    pass (``tests/test_asv_smoke.py``).  Never used for recorded results.
``OMP_NUM_THREADS``
    Thread count of every backend and of BLAS (set through
    :func:`fastattn.set_num_threads` in each benchmark's setup).  asv.conf.json
    sets it, with ``NUMBA_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS``, to
    :data:`DEFAULT_THREADS`; without it (``--python=same``) the same default
    is used, so a development run measures what ``asv run`` measures.
``FASTATTN_ASV_REFERENCE_MAX_N``
    Largest ``n`` at which the quadratic reference kernels (softmax, causal
    linear) are run; default :data:`REFERENCE_MAX_N`.

Inputs come from :func:`qkv`, a seeded factory cached per process: a given
``(n, d, dtype, seed)`` always yields the same arrays, on every machine and
commit.
"""

import ctypes
import ctypes.util
import functools
import gc
import os
import tracemalloc

import numpy as np
import psutil

import fastattn
from fastattn import reference

#: Threads used when OMP_NUM_THREADS is unset; asv.conf.json uses the same.
#: One thread: on a busy 2-core machine OpenBLAS with 2 threads turned a
#: 0.4 ms reference call (n=256) into 48 ms; one thread per benchmark keeps the
#: history comparable across commits and machines.  Change both places together.
DEFAULT_THREADS = 1

QUICK = os.environ.get("FASTATTN_ASV_QUICK", "") not in ("", "0")

#: Every backend fastattn defines; those not built here are skipped in setup.
BACKENDS = ("reference", "numba", "cython")

#: Sequence lengths n = n_q = n_k: powers of 4, so each step multiplies an
#: O(n^2) cost by 16 and an O(n) cost by 4.
N_GRID = (128,) if QUICK else (256, 1024, 4096, 16384)
DTYPES = ("float32",) if QUICK else ("float32", "float64")
CAUSAL = (False, True)

#: Head dimension d_k = d_v, batch x heads of every benchmark call.
D = 64
BATCH = 1

#: The quadratic reference kernels are bounded here: at n = 16384 a float64
#: reference softmax holds ~6 GiB of n x n intermediates and takes seconds per
#: call, which would dominate the run.  Their n^2 growth is plain by 4096.
REFERENCE_MAX_N = int(os.environ.get("FASTATTN_ASV_REFERENCE_MAX_N", "4096"))

#: n of the accuracy benchmarks (max abs error against the float64 reference).
ERROR_N = 128 if QUICK else 1024

#: Small n of the warm-up call that loads/compiles a kernel before any timing.
WARMUP_N = 64


def threads():
    """Thread count of the run: ``OMP_NUM_THREADS`` or :data:`DEFAULT_THREADS`."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else DEFAULT_THREADS


_threads_fixed = False


def fix_threads():
    """Set every backend and BLAS to :func:`threads` threads (once per process)."""
    global _threads_fixed
    if not _threads_fixed:
        fastattn.set_num_threads(threads())
        _threads_fixed = True


@functools.lru_cache(maxsize=8)
def qkv(n, d=D, dtype="float32", batch=BATCH, seed=0):
    """Seeded Gaussian ``q, k, v`` of shape ``(batch, n, d)`` and ``dtype``.

    Drawn in float64 from ``numpy.random.default_rng(seed)`` and rounded to
    ``dtype``, so float32 and float64 inputs hold the same numbers.  Cached:
    benchmarks must not write into them.  The arrays stay writeable so the
    public API passes them to the kernel without a copy.
    """
    rng = np.random.default_rng(seed)
    arrays = tuple(rng.standard_normal((batch, n, d)).astype(dtype) for _ in range(3))
    return arrays


def backend_or_skip(backend):
    """Raise NotImplementedError (asv's skip) when ``backend`` is not built here."""
    if backend not in fastattn.available_backends():
        reason = fastattn.unavailable_backends().get(backend, "unknown backend")
        raise NotImplementedError(f"backend {backend!r} is not available here: {reason}")


def is_quadratic(attention, backend, causal):
    """Whether the call holds n x n intermediates (reference softmax, reference causal linear)."""
    return backend == "reference" and (attention == "softmax" or causal)


def reference_fits_or_skip(attention, backend, n, causal, dtype, batch=BATCH):
    """Skip a quadratic reference call past :data:`REFERENCE_MAX_N` or past available memory."""
    if not is_quadratic(attention, backend, causal):
        return
    if n > REFERENCE_MAX_N:
        raise NotImplementedError(
            f"reference {attention} attention holds n x n arrays; bounded at "
            f"n <= {REFERENCE_MAX_N} (FASTATTN_ASV_REFERENCE_MAX_N), got n={n}"
        )
    arrays = 3 if attention == "softmax" else 2
    needed = reference.quadratic_bytes(batch, n, n, np.dtype(dtype).itemsize, arrays)
    available = psutil.virtual_memory().available
    if 2 * needed > available:
        raise NotImplementedError(
            f"reference {attention} attention at n={n} needs ~{needed:,} bytes; "
            f"{available:,} available"
        )


def attention_call(attention, backend, causal):
    """The public fastattn function for ``attention``, bound to ``backend`` and ``causal``."""
    if attention == "softmax":
        return functools.partial(fastattn.softmax_attention, causal=causal, backend=backend)
    if attention == "linear":
        return functools.partial(
            fastattn.linear_attention, feature_map="elu", causal=causal, backend=backend
        )
    raise ValueError(f"attention must be 'softmax' or 'linear', got {attention!r}")


_warmed = set()


def warm_up(attention, backend, causal, dtype):
    """Call the kernel once on small inputs so JIT compilation / cache loading and
    thread-pool start-up happen here, never in a timing (once per process)."""
    key = (attention, backend, causal, dtype)
    if key not in _warmed:
        q, k, v = qkv(WARMUP_N, dtype=dtype, seed=1)
        attention_call(attention, backend, causal)(q, k, v)
        _warmed.add(key)


# --- memory ---------------------------------------------------------------

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def _status_kib(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def rss_probe_available():
    """Whether the peak RSS of this process can be reset (Linux >= 4.0, /proc writable)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        _status_kib("VmHWM")
        return True
    except OSError:
        return False


def peak_extra_bytes(fn):
    """Peak bytes ``fn()`` adds to this process while it runs (its output included).

    On Linux: peak resident set size (``VmHWM``) reset to the current RSS by
    writing ``5`` to ``/proc/self/clear_refs``, minus the RSS before the call;
    this sees NumPy, Numba (NRT) and C/OpenMP allocations alike.  glibc is
    first told to serve every block >= 64 KiB with its own ``mmap`` (fixed
    ``M_MMAP_THRESHOLD``) and to return freed memory, so the call's arrays are
    fresh pages rather than reused, already-resident heap.  Elsewhere:
    :mod:`tracemalloc`'s peak, which sees NumPy's allocations only.

    Not asv's ``peakmem_``, which is the lifetime peak of the whole process
    (interpreter, imports and inputs included).

    Returns
    -------
    int
        Bytes, rounded to the page size (RSS) or exact (tracemalloc).
    """
    gc.collect()
    libc = _libc()
    if libc is not None and rss_probe_available():
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        result = fn()
        peak = _status_kib("VmHWM")
        del result
        return max(0, peak - before) * 1024
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
        del result
        return max(0, peak - start)
    finally:
        tracemalloc.stop()


def max_abs_error(attention, backend, causal, dtype, n=ERROR_N):
    """Max abs difference of ``backend``'s output from the float64 reference.

    Both take the same numbers (the ``dtype`` inputs; the reference computes
    on them cast to float64).
    """
    q, k, v = qkv(n, dtype=dtype, seed=2)
    out = attention_call(attention, backend, causal)(q, k, v)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    expected = attention_call(attention, "reference", causal)(q64, k64, v64)
    return float(np.max(np.abs(out.astype(np.float64) - expected)))


# --- benchmark bases (leading underscore: asv does not collect them) -------


class _AttentionSuite:
    """Time and peak extra memory of one attention as backend x n x causal x dtype.

    Subclasses set :attr:`attention`.  ``setup`` skips (NotImplementedError)
    what cannot run here, fixes the threads and warms the kernel up, so the
    timed call is the steady-state cost of the public function.
    """

    attention = None
    params = (BACKENDS, N_GRID, CAUSAL, DTYPES)
    param_names = ("backend", "n", "causal", "dtype")
    # asv re-runs setup before every sample; it is cheap after the first time
    # (cached inputs, warm-up once per process).  One process per combination,
    # 2 to 10 samples stopping after ~4 s: a tiled softmax at n = 16384 takes
    # 2-8 s a call on one thread, so it gets 2 samples; a 1 ms call gets 10.
    # asv's own warm-up loop is off (warmup_time = 0): setup has already run
    # the kernel, and repeating a seconds-long call only to discard it would
    # double the suite.  Measured: the whole `asv run` stays under 30 minutes
    # on the 2-core development machine with all three backends.
    rounds = 1
    repeat = (2, 10, 4.0)
    warmup_time = 0
    timeout = 300

    def setup(self, backend, n, causal, dtype):
        backend_or_skip(backend)
        reference_fits_or_skip(self.attention, backend, n, causal, dtype)
        fix_threads()
        warm_up(self.attention, backend, causal, dtype)
        self.inputs = qkv(n, dtype=dtype)
        self.call = attention_call(self.attention, backend, causal)

    def time_forward(self, backend, n, causal, dtype):
        self.call(*self.inputs)

    def track_peak_bytes(self, backend, n, causal, dtype):
        return peak_extra_bytes(lambda: self.call(*self.inputs))

    track_peak_bytes.unit = "bytes"
    track_peak_bytes.timeout = 300


class _AccuracySuite:
    """Max abs error of each kernel against the float64 reference, at n = ERROR_N."""

    attention = None
    params = (BACKENDS, (ERROR_N,), CAUSAL, DTYPES)
    param_names = ("backend", "n", "causal", "dtype")

    def setup(self, backend, n, causal, dtype):
        backend_or_skip(backend)
        fix_threads()

    def track_max_abs_error(self, backend, n, causal, dtype):
        return max_abs_error(self.attention, backend, causal, dtype, n)

    track_max_abs_error.unit = "abs error"
