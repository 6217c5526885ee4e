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


class _WideVectorAttributes(ir.values.FunctionAttributes):
    """A function's attributes, admitting :data:`WIDE_VECTORS` (llvmlite only
    admits the attributes it names, none of which carries a value)."""

    _known = ir.values.FunctionAttributes._known | {WIDE_VECTORS}


def _add_wide_vectors(function):
    """Give an llvmlite function :data:`WIDE_VECTORS`; False if this llvmlite cannot."""
    old = function.attributes
    if WIDE_VECTORS in old:
        return True
    try:
        new = _WideVectorAttributes(sorted(old))
        new.alignstack, new.personality = old.alignstack, old.personality
        new.add(WIDE_VECTORS)
    except (AttributeError, TypeError, ValueError):     # another llvmlite: keep its width
        return False
    function.attributes = new
    return True


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM vectorise the calling kernel's loops in 512-bit vectors (a hint; no value).

    LLVM tunes its Intel AVX-512 targets to prefer 256-bit vectors (``prefer-256-bit``,
    for the clock a 512-bit instruction once cost), so Numba's loops use half the
    registers' width there; the Cython kernels, written with 512-bit intrinsics, do not.
    A call at the top of a kernel sets the function attribute :data:`WIDE_VECTORS` on the
    function being compiled, and on no other code of the process (``NUMBA_CPU_FEATURES=
    -prefer-256-bit`` would set it for every Numba function a user compiles).  Code
    inlined into the kernel at Numba's level is vectorised with it; a function compiled
    apart (an ``@njit`` it calls) keeps LLVM's width unless it calls this too.  On a CPU
    without AVX-512, LLVM keeps its widest vectors.  Measured on an Intel Xeon (AVX-512,
    1 thread, float32): the fast exp over an array in L1, 0.22 against 0.31 ns an
    element; a softmax call at (1, 1, 4096, 64), 3-5 % less time.
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
#: v stay in the 2 MiB L2 of one core for d <= 128, as the Cython kernel's.
#: 512 against 256 keys halves the BLAS calls and their packing of the query
#: block per key: measured on the Intel Xeon (AVX-512), 1 and 2 threads,
#: float32, d = 64, three turns of separate processes, 3-10 % less time
#: (1 x 1 x 4096 and 1 x 8 x 2048, causal and not).
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
