"""The one place that holds the compilation flags and block sizes of the Numba kernels.

Every ``@njit`` in :mod:`fastattn._numba` takes its options from here; no other
module of the package names a fastmath flag.

``FASTMATH`` lets LLVM contract multiply-adds into FMAs, reassociate sums
(needed to vectorise reductions) and use approximate reciprocals and
functions.  It deliberately leaves out ``nnan`` and ``ninf``: masks produce
``-inf`` logits and inputs may hold NaN or inf, and a kernel compiled under
"no inf/NaN" may fold the very comparisons that handle them.
"""

import numba


def _probe():  # pragma: no cover - never called, only decorated
    pass


def _disk_cache():
    """Whether Numba can cache kernels of this package on disk, and if not why.

    Numba needs a writable ``__pycache__`` beside the sources, or a writable
    user cache (``NUMBA_CACHE_DIR``, else under ``HOME``); an install that is
    read-only to its user (another user's, a container's) has neither.
    """
    try:
        numba.njit(cache=True)(_probe)
    except RuntimeError as exc:     # "cannot cache function ...: no locator available"
        return False, str(exc)
    return True, None


#: Whether the kernels are cached on disk (``cache=True``); without a
#: writable cache they are compiled in every process instead.
DISK_CACHE, NO_DISK_CACHE_REASON = _disk_cache()

#: LLVM fast-math flags of every kernel (never ``fastmath=True``, which
#: implies ``nnan`` and ``ninf``).
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: Flags of the elementary functions (fast exp): no ``reassoc`` (it would
#: undo the two-part ``ln 2`` reduction and reorder the ``2**n`` scaling) and
#: no ``afn``.  LLVM inlines these functions into the kernels, and each
#: instruction keeps its own flags.
FASTMATH_ELEMENTARY = {"nsz", "arcp", "contract"}

#: Options of the parallel kernels.
JIT_PARALLEL = {"cache": DISK_CACHE, "nogil": True, "parallel": True, "fastmath": set(FASTMATH)}

#: Options of the serial helpers (inlined into the kernels by LLVM).
JIT_SERIAL = {"cache": DISK_CACHE, "nogil": True, "fastmath": set(FASTMATH)}

#: Options of the elementary functions.
JIT_ELEMENTARY = {"cache": DISK_CACHE, "nogil": True, "fastmath": set(FASTMATH_ELEMENTARY)}

#: Softmax: rows of q per block (one thread works on one query block at a
#: time) and keys per block.  A (BLOCK_Q, BLOCK_K) score tile (256 KiB in
#: float32), the (BLOCK_Q, d_v) accumulator and (BLOCK_K, d) slices of k and
#: v stay in the 1 MiB L2 of one core for d <= 128.  Measured on 1 thread at
#: n=4096, d=64, float32 (CPU time, 4 rounds): 128x128 57, 128x256 59,
#: 256x256 62 GF/s against a 61-65 GF/s GEMM roof.
SOFTMAX_BLOCK_Q = 256
SOFTMAX_BLOCK_K = 256

#: Softmax: the query block is halved down to this size while there are
#: fewer than two work items per thread (short sequences, small batches).
SOFTMAX_MIN_BLOCK_Q = 32

#: Linear attention: queries per chunk (the causal form is quadratic inside a
#: chunk) and keys per step of a state update.
LINEAR_CHUNK = 64

#: Linear attention: keys per segment whose state is summed by one work item
#: (non-causal, and the causal keys before the first query's diagonal).
#: One (d_k, d_v) state is kept per segment.
LINEAR_SEGMENT = 1024

#: Linear attention, non-causal: queries per work item of the output pass.
LINEAR_STEP = 256

#: Split-key softmax (decoding, :mod:`.decode`; when it is used and how many
#: splits: :mod:`fastattn._policy`): keys per block inside a split (one scores product and
#: one ``p v`` product each).  Each key and value is read from memory once.
SPLIT_KEYS_BLOCK_K = 1024
