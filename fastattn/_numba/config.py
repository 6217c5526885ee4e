"""The one place that holds the compilation flags and block sizes of the Numba kernels.

Every ``@njit`` in :mod:`fastattn._numba` takes its options from here; no other
module of the package names a fastmath flag.

``FASTMATH`` lets LLVM contract multiply-adds into FMAs, reassociate sums
(needed to vectorise reductions) and use approximate reciprocals and
functions.  It deliberately leaves out ``nnan`` and ``ninf``: masks produce
``-inf`` logits and inputs may hold NaN or inf, and a kernel compiled under
"no inf/NaN" may fold the very comparisons that handle them.

Numba's disk cache keys a kernel on its own source file only: after editing a
module a kernel uses (this one, ``_exp``, ``_online``, ``linear.row_scale``),
delete the kernels' caches (``*.nbi``/``*.nbc`` under
``fastattn/_numba/__pycache__``, or under ``NUMBA_CACHE_DIR``) or they keep the
old code.
"""

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


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

#: The LLVM function attribute :func:`wide_vectors` sets: LLVM vectorises the
#: function's loops in vectors of up to 512 bits where the CPU has them.
WIDE_VECTORS = '"prefer-vector-width"="512"'


def _add_wide_vectors(function):
    """Give an llvmlite function :data:`WIDE_VECTORS`; False if this llvmlite cannot.

    llvmlite admits only the function attributes it names (``FunctionAttributes._known``,
    none of which carries a value): the function gets a copy of its attributes whose class
    admits this one too.  On an llvmlite built otherwise, the function keeps LLVM's width.
    """
    old = function.attributes
    if WIDE_VECTORS in old:
        return True
    try:
        base = type(old)
        wide = type("WideVectorAttributes", (base,), {"_known": base._known | {WIDE_VECTORS}})
        new = wide(sorted(old))
        new.__dict__.update(vars(old))          # alignstack, personality, and any other state
        new.add(WIDE_VECTORS)
    except (AttributeError, TypeError, ValueError):
        return False
    function.attributes = new
    return True


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM vectorise the calling function's loops in 512-bit vectors (a hint; no value).

    LLVM tunes its Intel AVX-512 targets to prefer 256-bit vectors (``prefer-256-bit``,
    for the clock a 512-bit instruction once cost), so Numba's loops use half the
    registers' width there; the Cython kernels, written with 512-bit intrinsics, do not.
    A call sets the function attribute :data:`WIDE_VECTORS` on the function being
    compiled, and on no other code of the process (``NUMBA_CPU_FEATURES=...,-prefer-256-bit``
    would set it for every Numba function a user compiles).  Code Numba inlines into that
    function is vectorised with it; a function compiled apart keeps LLVM's width unless
    it calls this too: an ``@njit`` it calls, and the body of a ``prange`` loop, which
    Numba compiles as a function of its own (call it inside the loop's body).  On a CPU
    without AVX-512, LLVM keeps its widest vectors.  Measured on an Intel Xeon (AVX-512,
    1 thread, float32): the fast exp over an array in L1, 0.22 against 0.31 ns an
    element.
    """
    def codegen(context, builder, signature, args):
        _add_wide_vectors(builder.function)
        return context.get_dummy_value()

    return types.none(), codegen


#: Options of the parallel kernels.
JIT_PARALLEL = {"cache": DISK_CACHE, "nogil": True, "parallel": True, "fastmath": set(FASTMATH)}

#: Options of the serial helpers (inlined into the kernels by LLVM).
JIT_SERIAL = {"cache": DISK_CACHE, "nogil": True, "fastmath": set(FASTMATH)}

#: Options of the elementary functions.
JIT_ELEMENTARY = {"cache": DISK_CACHE, "nogil": True, "fastmath": set(FASTMATH_ELEMENTARY)}

#: Softmax: rows of q per block (one thread works on one query block at a
#: time) and keys per block.  A (BLOCK_Q, BLOCK_K) score tile (512 KiB in
#: float32), the (BLOCK_Q, d_v) accumulator and (BLOCK_K, d) slices of k and
#: v (about 1 MiB in float32 at d = 64, 1.4 MiB at d = 128, twice that in
#: float64) stay in the 2 MiB L2 of a core of the Intel Xeon these were
#: measured on in float32, as the Cython kernel's do; not measured on a core
#: with 1 MiB of L2, nor in float64 at d = 128, which outgrows 2 MiB.  512
#: against 256 keys halves the BLAS calls and their packing of the query block
#: per key: float32, d = 64, three turns of separate processes, (1, 1, 4096)
#: and (1, 8, 2048): 2-9 % less time on one thread; on two, 7-9 % non-causal
#: and within 5 % either way causal.
SOFTMAX_BLOCK_Q = 256
SOFTMAX_BLOCK_K = 512

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
