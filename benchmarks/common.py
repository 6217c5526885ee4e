"""Shared pieces of the asv suite: grids, parameters, thread counts, inputs, memory.

The suite measures with fastattn's one engine (:mod:`fastattn.bench.engine`:
input factory, memory probe, accuracy check), imported defensively: asv runs
these benchmarks from the working tree against older commits too, and a commit
from before the engine still gets its times (memory and accuracy are then
skipped, asv's ``n/a``).

Environment variables read here (all optional):

``FASTATTN_ASV_QUICK=1``
    Development smoke pass: only the smallest n, float32 (and, for FAVOR+,
    the smallest m) runs; every other combination is skipped first thing in
    setup, before any input or kernel.  The parameters stay those of the full
    suite, so ``benchmarks.json`` (which ``asv run`` rewrites) stays that of
    the recorded results and ``asv publish`` keeps every graph.  Each skipped
    combination still costs asv a process: forked from asv's server
    (``"launch_method": "forkserver"`` in asv.conf.json), about 0.03 s.
``OMP_NUM_THREADS``
    Thread count of every backend and of BLAS (:func:`fastattn.set_num_threads`
    in each setup); asv.conf.json sets it, with the other thread variables, to
    :data:`DEFAULT_THREADS`, which is also the default without it.
``FASTATTN_ASV_REFERENCE_MAX_N``
    Largest ``n`` at which the quadratic reference kernels (softmax, causal
    linear) run; default 4096.
"""

import functools
import importlib.util
import os
from pathlib import Path

import numpy as np

import fastattn

try:
    from fastattn.bench import engine
except ImportError:  # a commit from before the one engine
    engine = None

#: Threads used when OMP_NUM_THREADS is unset; asv.conf.json uses the same.
#: One thread: on a busy 2-core machine OpenBLAS with 2 threads turned a
#: 0.4 ms reference call (n=256) into 48 ms.  Change both places together.
DEFAULT_THREADS = 1

QUICK = os.environ.get("FASTATTN_ASV_QUICK", "") not in ("", "0")

# Load every backend now: asv's forkserver imports the suite once and forks each
# benchmark process from it, so no process (nor a skipped combination) pays the
# import of Numba again (0.6 s here).  Nothing runs, so no thread pool is started.
fastattn.available_backends()


class Name(str):
    """A text parameter asv shows with its name: ``regime=decode``."""

    def __new__(cls, name, value):
        self = super().__new__(cls, value)
        self.name = name
        return self

    def __repr__(self):
        return f"{self.name}={str(self)}"

    def __reduce__(self):
        return Name, (self.name, str(self))


class Param(int):
    """An int parameter asv shows with its name: ``causal=True``, ``n=01024``.

    asv keeps a parameter as its ``repr``: a bare ``False`` does not say what
    it is, and n compares as text in asv's pages, so n is zero-padded.
    """

    def __new__(cls, name, value, width=0):
        self = super().__new__(cls, int(value))
        self.name, self.text = name, (str(bool(value)) if width is None
                                      else str(int(value)).zfill(width))
        return self

    def __repr__(self):
        return f"{self.name}={self.text}"

    def __reduce__(self):
        return Param, (self.name, int(self), None if self.text in ("True", "False") else
                       len(self.text))


def _load_schema():
    """fastattn's one schema (``fastattn/bench/schema.py``, plain constants) of this working
    tree: asv runs the suite against older commits too, whose installed fastattn may not
    have it, and the parameters must be the same for every commit."""
    path = Path(__file__).resolve().parents[1] / "fastattn" / "bench" / "schema.py"
    spec_ = importlib.util.spec_from_file_location("_fastattn_asv_schema", path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


schema = _load_schema()

#: Every backend fastattn defines; those not built here are skipped in setup.
BACKENDS = ("reference", "numba", "cython")
#: n = n_q = n_k (the schema's ASV_NS).
N_GRID = tuple(Param("n", n, 5) for n in schema.ASV_NS)
DTYPES = ("float32", "float64")
CAUSAL = (Param("causal", False, None), Param("causal", True, None))
#: Head dimension d_k = d_v and batch of every benchmark call.
D, BATCH = schema.ASV_D, schema.ASV_BATCH
REFERENCE_MAX_N = int(os.environ.get("FASTATTN_ASV_REFERENCE_MAX_N", "4096"))
#: n of the accuracy benchmarks (max abs error against the float64 reference).
ERROR_N = (Param("n", 1024, 5),)

#: Decode (benchmarks/decode.py): the schema's context lengths, and the heads of each step.
REGIME_DECODE = Name("regime", "decode")
DECODE_N = tuple(Param("n", n, 5) for n in schema.DECODE_NS)
DECODE_HEADS = schema.ASV_DECODE_HEADS

#: Feature maps of linear attention (benchmarks/feature_maps.py): fastattn's maps
#: (a commit without its registry has elu and relu) at n in FEATURE_N, and FAVOR+'s
#: feature count m (the schema's multiples of d_k) at n in FAVOR_N.
FEATURE_MAPS = tuple(getattr(getattr(fastattn, "feature_maps", None), "NAMES", ("elu", "relu")))
FEATURE_N = tuple(Param("n", n, 5) for n in schema.ASV_FEATURE_MAP_NS)
FAVOR_M = tuple(Param("m", m * D, 4) for m in schema.FAVOR_MULTIPLES)
FAVOR_N = FEATURE_N[:2]
#: The reference's causal linear form is the masked n x n one, n^2 D work: it
#: runs while n^2 D <= this (about 1 s a call), up to FASTATTN_ASV_REFERENCE_MAX_N.
FEATURE_REFERENCE_MAX_WORK = 2**34


def threads():
    """Thread count of the run: ``OMP_NUM_THREADS`` or :data:`DEFAULT_THREADS`."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else DEFAULT_THREADS


@functools.lru_cache(maxsize=1)
def fix_threads():
    """Set every backend and BLAS to :func:`threads` threads (once per process)."""
    fastattn.set_num_threads(threads())


def spec(attention, backend, n, causal, dtype):
    """The point of one benchmark call, as the engine takes it."""
    return {"attention": attention, "backend": backend, "causal": bool(causal), "n_q": int(n),
            "n_k": int(n), "d_k": D, "d_v": D, "batch": BATCH, "heads": schema.ASV_HEADS,
            "dtype": dtype,
            "feature_map": "elu" if attention == "linear" else None}


@functools.lru_cache(maxsize=8)
def qkv(n, dtype="float32", seed=0):
    """Seeded Gaussian ``q, k, v`` of shape ``(BATCH, n, D)`` (cached: never write into them)."""
    if engine is None:
        return tuple(np.random.RandomState(seed).standard_normal((3, BATCH, n, D)).astype(dtype))
    return engine.make_inputs(spec("softmax", "reference", n, False, dtype), seed)


def skip_unless_built(backend):
    """Raise NotImplementedError (asv's skip) if ``backend`` is not available here."""
    if backend not in fastattn.available_backends():
        reason = fastattn.unavailable_backends().get(backend, "unknown backend")
        raise NotImplementedError(f"backend {backend!r} is not available here: {reason}")


def skip_if_no_memory(point):
    """Raise NotImplementedError if the engine says ``point`` does not fit here (or cannot run)."""
    reason = engine.why_skip(point) if engine is not None else None
    if reason:
        raise NotImplementedError(reason)


def skip_if_quick(n, smallest, dtype="float32", also=True):
    """Raise NotImplementedError under ``FASTATTN_ASV_QUICK`` unless ``n`` is ``smallest``, the
    dtype float32 and ``also`` holds: the first thing each ``setup`` does, so a combination
    the quick run leaves out costs its process and nothing more (no inputs, no kernel)."""
    if QUICK and (int(n) != int(smallest) or dtype != "float32" or not also):
        raise NotImplementedError("FASTATTN_ASV_QUICK: only the smallest n, float32")


def skip_unless_runs(attention, backend, n, causal, dtype):
    """Raise NotImplementedError (asv's skip) for what cannot or should not run here."""
    skip_unless_built(backend)
    quadratic = backend == "reference" and (attention == "softmax" or causal)
    if quadratic and int(n) > REFERENCE_MAX_N:
        raise NotImplementedError(f"reference {attention} attention holds n x n arrays; "
                                  f"bounded at n <= {REFERENCE_MAX_N} "
                                  "(FASTATTN_ASV_REFERENCE_MAX_N)")
    skip_if_no_memory(spec(attention, backend, n, causal, dtype))


def peak_bytes(call):
    """Peak extra bytes of ``call()`` by the engine's probe (asv's skip on a commit without it)."""
    if engine is None:
        raise NotImplementedError("this commit has no fastattn.bench.engine memory probe")
    return engine.peak_extra_bytes(call)[0]


def attention_call(attention, backend, causal):
    """The public fastattn function for ``attention``, bound to ``backend`` and ``causal``."""
    function = fastattn.softmax_attention if attention == "softmax" else \
        functools.partial(fastattn.linear_attention, feature_map="elu")
    return functools.partial(function, causal=bool(causal), backend=backend)


# --- benchmark bases (leading underscore: asv does not collect them) -------
class _AttentionSuite:
    """Time and peak extra memory of one attention as backend x n x causal x dtype.

    ``setup`` skips what cannot run here, fixes the threads and warms the kernel
    up at n = 64, so the timed call is the steady-state cost of the public function.
    """

    attention = None
    params = (BACKENDS, N_GRID, CAUSAL, DTYPES)
    param_names = ("backend", "n", "causal", "dtype")
    # One process per combination, 2 to 10 samples stopping after ~4 s; asv's
    # warm-up off (setup has run the kernel already).
    rounds = 1
    repeat = (2, 10, 4.0)
    warmup_time = 0
    timeout = 300

    def setup(self, backend, n, causal, dtype):
        skip_if_quick(n, N_GRID[0], dtype)
        skip_unless_runs(self.attention, backend, n, causal, dtype)
        fix_threads()
        self.call = attention_call(self.attention, backend, causal)
        self.call(*qkv(64, dtype, seed=1))
        self.inputs = qkv(int(n), dtype)

    def time_forward(self, backend, n, causal, dtype):
        self.call(*self.inputs)

    def track_peak_bytes(self, backend, n, causal, dtype):
        if engine is None:
            raise NotImplementedError("this commit has no fastattn.bench.engine memory probe")
        return engine.peak_extra_bytes(lambda: self.call(*self.inputs))[0]

    track_peak_bytes.unit = "bytes"


class _AccuracySuite:
    """Max abs error of each kernel against the float64 reference, at n = ERROR_N."""

    attention = None
    params = (BACKENDS, ERROR_N, CAUSAL, DTYPES)
    param_names = ("backend", "n", "causal", "dtype")

    def setup(self, backend, n, causal, dtype):
        skip_if_quick(n, ERROR_N[0], dtype)
        skip_unless_runs(self.attention, backend, n, causal, dtype)
        if engine is None:
            raise NotImplementedError("this commit has no fastattn.bench.engine check")
        fix_threads()

    def track_max_abs_error(self, backend, n, causal, dtype):
        point = spec(self.attention, backend, n, causal, dtype)
        out = attention_call(self.attention, backend, causal)(*engine.make_inputs(point))
        return engine.check_accuracy(point, out, engine.ReferenceCache())["max_abs_err"]

    track_max_abs_error.unit = "abs error"
