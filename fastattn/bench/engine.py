"""The measuring engine of ``fastattn bench``, ``fastattn report`` and ``benchmarks/``: inputs,
call, timing, memory probe, roof and check of one point (a record's fields)."""

import ctypes
import ctypes.util
import datetime
import gc
import math
import statistics
import time
import timeit
import tracemalloc
import traceback

import numpy as np

from .. import _api, feature_maps, reference
from ..compare import gaussian_qkv
from ..feature_maps import FavorFeatures
from . import environment, limits, peers
from .flops import attention_flops

#: Seed of every sweep's inputs (each point derives its own stream from it).
DEFAULT_SEED = 20260
#: A point is flagged when ``max_abs_err > CHECK_TOL[dtype] * max(1, max |reference|)``.
CHECK_TOL = {"float32": 1e-4, "float64": 1e-9}
#: Bytes (and at most a quarter of the free memory) the check's reference may take.
CHECK_MAX_BYTES = 5 * 2**29
#: Fraction of the available memory a measured call may be predicted to need.
MEMORY_HEADROOM = 0.7
#: Idle seconds before each point, so spinning pools (OpenBLAS ~0.1 s) are asleep.
SETTLE_S = 0.2
#: Idle seconds before each turn when the backends of one shape take turns on 2+ threads.
TURN_SETTLE_S = 0.1
#: A turn of a call under TURN_WARM_S starts with TURN_WARMUP_S of untimed calls (warm caches).
TURN_WARM_S, TURN_WARMUP_S = 0.05, 0.01
#: A timed repeat lasts at least this long (``number`` calls of a fast kernel).
MIN_REPEAT_S = 2e-4
#: A fast call is repeated for MIN_TIME_S (at most MAX_REPEATS times): one may escape load.
MIN_TIME_S, MAX_REPEATS = 0.25, 100


def make_inputs(spec, seed=DEFAULT_SEED):
    """Seeded Gaussian ``q, k, v`` of a point, the same for every backend and dtype."""
    b, n_q, n_k, d_k, d_v = (spec["batch"] * spec["heads"], spec["n_q"], spec["n_k"],
                             spec["d_k"], spec["d_v"])
    return gaussian_qkv((b, n_q, d_k), n_k, d_v, dtype=spec["dtype"],
                        seed=[seed, b, n_q, n_k, d_k, d_v])


def make_call(spec, q, k, v):
    """The no-argument call of point ``spec`` (a linear decode point: one step)."""
    attention, backend, causal = spec["attention"], spec["backend"], spec["causal"]
    decode, scale = spec.get("regime") == "decode", reference.default_scale(q.shape[-1])
    if backend in peers.PEERS:
        build = peers.PEERS[backend].calls[attention, "decode" if decode else "prefill"]
        option = scale if attention == "softmax" else spec.get("feature_map") or "elu"
        return build(q, k, v, causal, option, heads=spec.get("heads", 1))
    feature_map = _feature_map(spec)
    if attention == "softmax":
        return lambda: _api.softmax_attention(q, k, v, causal=causal, scale=scale,
                                              backend=backend)
    if decode:
        k1, v1 = k[..., -1:, :].copy(), v[..., -1:, :].copy()
        _, state = _api.linear_attention(k1, k[..., :-1, :], v[..., :-1, :], return_state=True,
                                         feature_map=feature_map, backend="reference")
        return lambda: _api.linear_attention(q, k1, v1, causal=True, feature_map=feature_map,
                                             initial_state=state, return_state=True,
                                             backend=backend)[0]
    return lambda: _api.linear_attention(q, k, v, causal=causal, feature_map=feature_map,
                                         backend=backend)


def _feature_map(spec):
    """The ``feature_map=`` of a linear point: FAVOR+ with ``num_features`` as an object."""
    name = spec.get("feature_map") or "elu"
    if name == "favor" and spec.get("num_features"):
        return FavorFeatures(spec["d_k"], num_features=spec["num_features"])
    return name


def feature_dim(spec):
    """``D``, the features of a linear point's map (``d_k`` for elu and relu)."""
    return feature_maps.feature_dim(spec.get("feature_map") or "elu", spec["d_k"],
                                    spec.get("num_features"))


def held_bytes(spec):
    """Bytes per head a decode step keeps: the KV cache, or the state ``S, z``."""
    item = np.dtype(spec["dtype"]).itemsize
    if spec["attention"] == "softmax":
        return (spec["d_k"] + spec["d_v"]) * spec["n_k"] * item
    return (feature_dim(spec) * (spec["d_v"] + 1)) * item


def point_flops(spec):
    """Flops of a point's call: linear with its ``D`` features, a decode step over one key."""
    linear = spec["attention"] == "linear"
    n_k = 1 if linear and spec.get("regime") == "decode" else spec["n_k"]
    return attention_flops(spec["attention"], spec["n_q"], n_k,
                           feature_dim(spec) if linear else spec["d_k"], spec["d_v"],
                           spec["causal"], spec["batch"], spec["heads"])


def point_bytes(spec):
    """Bytes a point's call moves at least (:func:`~.limits.point_bytes` with its ``D``)."""
    return limits.point_bytes(spec, feature_dim(spec))


def warm_up(call, seconds=TURN_WARMUP_S):
    """Untimed calls for ``seconds`` after the first (which may stall); returns how many."""
    call()
    made, deadline = 1, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        call()
        made += 1
    return made


def time_call(call, repeats, estimate_s, min_time_s=None, max_repeats=None):
    """Timing of ``repeats`` (up to ``max_repeats`` while ``min_time_s`` lasts) repeats of a
    warmed-up ``call()``, each of ``number`` calls."""
    min_time_s = MIN_TIME_S if min_time_s is None else min_time_s
    max_repeats = max(repeats, MAX_REPEATS if max_repeats is None else max_repeats)
    number = 1
    while estimate_s * number < MIN_REPEAT_S and number < 1024:
        number *= 2
    timer, times = timeit.Timer(call), []
    deadline = time.perf_counter() + min_time_s
    while len(times) < repeats or (len(times) < max_repeats and time.perf_counter() < deadline):
        times.append(timer.timeit(number) / number)
    return _timing(times, number)


def _timing(times, number):
    return {"times_s": times, "median_s": float(np.median(times)), "min_s": min(times),
            "max_s": max(times), "number": number, "repeats": len(times)}


try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
    _LIBC.mallopt, _LIBC.malloc_trim  # glibc only
except (OSError, AttributeError, TypeError):
    _LIBC = None

#: glibc's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD: the probe's arrays are fresh pages (in the peak
#: RSS), a timed call's reuse the heap as in a user's process (fresh pages are slower).
_PROBE_MALLOC = {-3: 64 * 1024, -1: 128 * 1024}
_TIMING_MALLOC = {-3: 32 * 2**20, -1: 64 * 2**20}


def _mallopt(settings, trim=False):
    if _LIBC is not None:
        for param, value in settings.items():
            _LIBC.mallopt(param, value)
        if trim:
            _LIBC.malloc_trim(0)


def _status_bytes(field):
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise OSError(f"/proc/self/status has no {field}")


def hwm_available():
    """Reset the peak RSS (Linux ``/proc/self/clear_refs``); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return _status_bytes("VmHWM") > 0
    except OSError:
        return False


def peak_extra_bytes(call, method="auto"):
    """``(bytes, method, seconds)``: the peak a warmed-up ``call()`` adds, by the peak RSS
    (``"hwm"``, Linux) or ``"tracemalloc"`` (Python-tracked only)."""
    gc.collect(1)
    _mallopt(_PROBE_MALLOC, trim=True)
    hwm = method in ("auto", "hwm") and hwm_available()
    started_here = not hwm and not tracemalloc.is_tracing()
    if started_here:
        tracemalloc.start()
    try:
        if not hwm:
            tracemalloc.reset_peak()
        before = _status_bytes("VmRSS") if hwm else tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        result = call()
        elapsed = time.perf_counter() - start
        peak = _status_bytes("VmHWM") if hwm else tracemalloc.get_traced_memory()[1]
        del result
    finally:
        if started_here:
            tracemalloc.stop()
        _mallopt(_TIMING_MALLOC)
    return max(0, int(peak - before)), "hwm" if hwm else "tracemalloc", elapsed


#: GEMM shapes above this n are probed at this n (the rate is flat, the output huge).
MAX_PROBE_N = 16384
#: Lengths probed at every d besides the run's n, where the GEMM runs fastest (not memory-bound).
PEAK_PROBE_N = (512, 1024)
#: BLAS libraries the roof may be probed through (torch's in the peers' process).
ROOF_LIBRARIES = ("numpy", "torch")
#: Calls a probe times at most (over all its rounds).
MAX_PROBE_CALLS = 1000
#: Seconds of GEMM a round of a comparison times for its paired roof (at least 3 calls).
PAIRED_ROOF_BUDGET_S = 0.02


def _task(kind, dtype, n, d, library="numpy"):
    """A probe's call and its work (flops of ``n x d @ d x n``, or n exps)."""
    rng = np.random.default_rng(0)
    if kind == "exp":
        x, out = rng.standard_normal(n).astype(dtype), np.empty(n, dtype=dtype)
        return (lambda: np.exp(x, out=out)), float(n)
    return limits.gemm_call(dtype, n, d, n, library)


def probe_roof(shapes, dtypes=("float32", "float64"), budget_s=0.1, rounds=3, library="numpy"):
    """Roof records: GEMM GFLOP/s of ``n x d @ d x n`` at each ``(n, d)`` of ``shapes`` and
    :data:`PEAK_PROBE_N` through ``library`` (and NumPy's exp rate), per dtype, the best of
    ``rounds`` rounds."""
    if library not in ROOF_LIBRARIES:
        raise ValueError(f"library must be one of {ROOF_LIBRARIES}, got {library!r}")
    sizes = sorted({(max(1, min(int(n), MAX_PROBE_N)), int(d)) for n, d in shapes}
                   | {(n, int(d)) for _, d in shapes for n in PEAK_PROBE_N})
    room = MEMORY_HEADROOM * available_bytes() / 2  # the output, and slack
    tasks = [("gemm", np.dtype(dt).name, n, d) for dt in dtypes for n, d in sizes
             if n * n * np.dtype(dt).itemsize <= room]  # a probe that cannot fit is left out
    if library == "numpy":
        tasks += [("exp", np.dtype(dt).name, 1 << 22, None) for dt in dtypes]
    best, count = dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, 0)
    for round_ in range(max(1, int(rounds))):
        for task in tasks:
            fn, work = _task(*task, library=library)
            if round_ == 0:
                fn()  # first touch, thread pool start
            rate, calls = limits.fastest_rate(fn, work, budget_s / rounds, 1,
                                              MAX_PROBE_CALLS - count[task])
            best[task], count[task] = max(best[task], rate), count[task] + calls
    blas = environment.roof_blas(library)
    exp_label = f"np.exp of NumPy {np.__version__}, one thread"  # not the GEMMs' BLAS
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return [{"probe": kind, "dtype": dtype, "repeats": count[t], "library": library,
             **(blas if kind == "gemm" else {"blas": exp_label}), "probed_at": when,
             **({"shape": [n, d, n], "gflops": best[t] / 1e9} if kind == "gemm"
                else {"size": n, "gelem_s": best[t] / 1e9})}
            for t in tasks for kind, dtype, n, d in [t]]


def time_gemm(dtype, n, d, library, cache):
    """One round's roof: GFLOP/s of the fastest of 3+ GEMM calls; ``cache`` keeps arrays."""
    key = (np.dtype(dtype).name, int(n), int(d), library)
    if key not in cache:
        cache[key] = _task("gemm", *key[:3], library=library)
        cache[key][0]()  # first touch
    return limits.fastest_rate(*cache[key], PAIRED_ROOF_BUDGET_S, 3, MAX_PROBE_CALLS)[0] / 1e9


def gemm_probes(roofs, dtype=None, threads=None, machine=None):
    """The GEMM probes of ``roofs`` (of ``dtype``, ``threads``, ``machine`` if given)."""
    return [r for r in roofs if r.get("probe", "gemm") == "gemm" and r.get("gflops")
            and dtype in (None, r.get("dtype")) and len(r.get("shape") or ()) == 3
            and (threads is None or r.get("threads") in (None, threads))
            and (machine is None or r.get("machine") in (None, machine))]


def roof_probe(roofs, dtype, d, threads=None, machine=None):
    """The one roof rule: the fastest GEMM probe at the nearest ``d``, or None."""
    return max(gemm_probes(roofs, dtype, threads, machine), default=None,
               key=lambda r: (-abs(math.log2(r["shape"][1] / d)), r["gflops"]))


def roof_for(roofs, dtype, d, threads=None, machine=None):
    """The roof GFLOP/s of :func:`roof_probe`, or None."""
    return (roof_probe(roofs, dtype, d, threads, machine) or {}).get("gflops")


def quadratic_need(spec, itemsize):
    """Bytes of n_q x n_k intermediates a reference call makes (0 if none)."""
    if spec["attention"] == "linear" and not spec["causal"]:
        return 0
    return reference.quadratic_bytes(spec["batch"] * spec["heads"], spec["n_q"], spec["n_k"],
                                     itemsize, arrays=4 if spec["attention"] == "softmax" else 3)


def available_bytes():
    """The memory free for a point, as the reference's own checks see it (else infinite)."""
    available = reference.available_memory()
    return math.inf if available is None else available


def why_skip(spec):
    """Reason a point cannot run here, or None."""
    backend = spec["backend"]
    if backend in peers.PEERS:
        if backend not in peers.available_peers():
            return (f"{backend} is not installed; add it, in the fastattn checkout, with: "
                    f"{peers.PEERS[backend].install}")
        if unsupported := peers.why_not(backend, spec["attention"], spec["dtype"], spec["d_k"],
                                        spec["d_v"], spec.get("regime") or "prefill",
                                        spec.get("feature_map")):
            return unsupported
    elif backend not in _api.available_backends():
        reason = _api.unavailable_backends().get(backend, "unknown")
        return f"backend {backend!r} is not available here ({reason})"
    itemsize = np.dtype(spec["dtype"]).itemsize
    b, n = spec["batch"] * spec["heads"], max(spec["n_q"], spec["n_k"])
    need = 4 * b * n * max(spec["d_k"], spec["d_v"]) * itemsize  # inputs, output
    if backend == "reference":
        need += quadratic_need(spec, itemsize)
    elif backend in peers.PEERS:
        need += peers.PEERS[backend].extra_bytes(
            spec["attention"], spec["causal"], b, spec["n_q"], spec["n_k"], spec["d_k"],
            spec["d_v"], itemsize, spec.get("regime") or "prefill")
    available = available_bytes()
    if need > MEMORY_HEADROOM * available:
        return f"needs about {need / 2**20:,.0f} MiB but {available / 2**20:,.0f} MiB are available"
    return None


class ReferenceCache:
    """The float64 reference output of the last few inputs (shared by every backend)."""

    def __init__(self, size=4):
        self.size, self._store = size, {}

    def get(self, spec, q, k, v):
        key = tuple(sorted((name, str(value)) for name, value in spec.items()
                           if name not in ("backend", "peer", "threads")))
        if key not in self._store:
            q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
            self._store[key] = make_call(dict(spec, backend="reference"), q64, k64, v64)()
            while len(self._store) > self.size:
                self._store.pop(next(iter(self._store)))
        return self._store[key]


def check_accuracy(spec, out, references, seed=DEFAULT_SEED, max_bytes=None):
    """The check of ``out`` against the float64 reference, at n halved until it fits."""
    if max_bytes is None:
        max_bytes = min(CHECK_MAX_BYTES, available_bytes() // 4)
    small = dict(spec)
    while small["n_q"] > 1 and quadratic_need(small, 8) > max_bytes:
        small = dict(small, n_q=small["n_q"] // 2, n_k=max(1, small["n_k"] // 2))
    q, k, v = make_inputs(small, seed)
    if small != spec:
        out = make_call(small, q, k, v)()
    ref = references.get(small, q, k, v)
    out = np.asarray(out, dtype=np.float64)
    err = float(np.max(np.abs(out - ref))) if ref.size else 0.0
    if not np.all(np.isfinite(out)):
        err = math.inf
    tol = CHECK_TOL[spec["dtype"]] * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    return {"max_abs_err": err, "check_n": small["n_k"], "check_tol": tol,
            "check_ok": bool(err <= tol)}


def prepare_point(spec, repeats=5, memory=True, check=True, seed=DEFAULT_SEED,
                  references=None, max_point_s=None):
    """One point but its timed repeats (warm-up, memory, check): ``(call, fields, n_repeats,
    estimate_s)``, ``call`` None when skipped or failed."""
    if reason := why_skip(spec):
        return None, {"status": "skipped", "reason": reason}, 0, 0.0
    try:
        call = make_call(spec, *make_inputs(spec, seed))
        time.sleep(SETTLE_S)  # let the previous point's thread pools go to sleep
        start = time.perf_counter()
        out = call()
        fields = {"status": "ok", "reason": None, "seed": seed,
                  "load_avg_1m": environment.load_avg_1m(),
                  "warmup_s": time.perf_counter() - start, "peak_bytes": None,
                  "memory_method": None, **getattr(call, "fields", {})}  # a peer's compile_s
        peak, method, estimate = peak_extra_bytes(call)
        if memory:
            fields.update(peak_bytes=peak, memory_method=method)
            if spec["backend"] == "reference" and method == "hwm" and estimate < 1.0:
                # The peak RSS counts a thread's pages in steps (may miss a few 100 KiB).
                traced = peak_extra_bytes(call, "tracemalloc")[0]
                fields["peak_bytes_tracemalloc"] = traced
                if traced > peak:
                    fields.update(peak_bytes=traced, memory_method="tracemalloc")
        n_repeats = repeats
        if max_point_s is not None and estimate > 0:
            n_repeats = max(min(3, repeats), min(repeats, int(max_point_s / estimate)))
        if check:
            from threadpoolctl import threadpool_limits
            with threadpool_limits(1):  # the float64 reference leaves no spinning pool
                fields.update(check_accuracy(spec, out, references or ReferenceCache(), seed))
        if spec.get("regime") == "decode":
            fields["held_bytes"] = held_bytes(spec)
    except Exception as exc:  # a failing kernel is a result, not the end of the sweep
        return None, failure(exc), 0, 0.0
    return call, fields, n_repeats, estimate


def failure(exc):
    """The outcome of a point whose call raised ``exc``: MemoryError is a skip."""
    if isinstance(exc, MemoryError):
        return {"status": "skipped", "reason": f"MemoryError: {exc}"}
    return {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=6)}


def finish_point(spec, fields, timings, roofs=(), paired_roof=None, rounds=(), paired_floor=()):
    """``fields`` with the ``timings`` merged, GFLOP/s, the fraction of the roof and of the
    binding limit, each also paired: the median over ``rounds`` against the round's roof
    (``paired_roof``) or floor (``paired_floor``)."""
    times = [t for timing in timings for t in timing["times_s"]]
    out = {**fields, **_timing(times, timings[0]["number"]), "rounds": len(timings),
           "round_min_s": [t["min_s"] for t in timings]}
    flops = point_flops(spec)
    gflops = flops / out["median_s"] / 1e9 if out["median_s"] > 0 else None
    probe = roof_probe(roofs, spec["dtype"], spec["d_k"]) or {}
    roof = probe.get("gflops")
    out.update(flops=flops, gflops=gflops, roof_gflops=roof, roof_blas=probe.get("blas"),
               roof_shape=probe.get("shape"),
               roof_fraction=gflops / roof if gflops and roof else None)
    nbytes = point_bytes(spec)
    out.update(limits.limit_fields(spec, flops, nbytes, out["median_s"], roofs,
                                   spec.get("threads")))
    if paired_floor and out.get("limit") == "floor":   # the floor read beside it, each round
        out["limit_fraction_paired"] = limits.paired_fraction(
            nbytes, [paired_floor[r] for r in rounds], out["round_min_s"])
    pairs = [(flops / t["min_s"] / 1e9, paired_roof[r]) for r, t in zip(rounds, timings)
             if paired_roof and flops and t["min_s"] > 0 and paired_roof[r]]
    if pairs:
        out.update(roof_round_gflops=[g for _, g in pairs],
                   roof_fraction_paired=float(statistics.median(k / g for k, g in pairs)))
    return out
