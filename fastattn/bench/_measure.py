"""Measuring one point: inputs, warm-up, memory, timing, accuracy check.

Runs in the sweep's worker process (see :mod:`fastattn.bench.sweep`), or in
the calling process when the sweep is not isolated.  Everything here returns
plain dicts that become fields of the point record.
"""

import math
import os
import time
import traceback

import numpy as np
import psutil
from threadpoolctl import threadpool_limits

from .. import _api, reference
from . import memory as memory_probe
from . import peers
from .flops import attention_flops
from .timers import time_call

#: Seed of every sweep's inputs (each point derives its own stream from it).
DEFAULT_SEED = 20260

#: Flag tolerance of the accuracy check, per dtype: a point is flagged when
#: ``max_abs_err > CHECK_TOL[dtype] * max(1, max |reference|)``.
CHECK_TOL = {"float32": 1e-4, "float64": 1e-9}

#: The float64 reference used for the check may take at most this many bytes
#: of intermediates (and a quarter of the available memory); above it the
#: point is checked at a smaller n (``check_n``).
CHECK_MAX_BYTES = 5 * 2**29  # 2.5 GiB

#: Fraction of the available memory a measured call may be predicted to need.
MEMORY_HEADROOM = 0.7

#: Seconds of idling before each point, so worker threads of other runtimes
#: (OpenBLAS spins ~0.1 s after a job) are asleep when the timing starts.
SETTLE_S = 0.2


def make_inputs(n, d_k, d_v, batch_heads, dtype, seed=DEFAULT_SEED):
    """Seeded Gaussian ``q, k (B, n, d_k)`` and ``v (B, n, d_v)``.

    Drawn in float64 from a stream keyed by ``(seed, n, d_k, d_v, B)`` and then
    cast, so every backend and dtype of a point sees the same numbers.
    """
    rng = np.random.default_rng([seed, n, d_k, d_v, batch_heads])
    q = rng.standard_normal((batch_heads, n, d_k))
    k = rng.standard_normal((batch_heads, n, d_k))
    v = rng.standard_normal((batch_heads, n, d_v))
    return tuple(np.ascontiguousarray(x, dtype=dtype) for x in (q, k, v))


def _quadratic_need(spec, itemsize):
    """Bytes of n x n intermediates a reference call makes (0 if it makes none)."""
    B, n = spec["batch"] * spec["heads"], spec["n"]
    if spec["attention"] == "softmax":
        # scores (exp in place), weights / row_sum, weights * 0 and the where() result
        return reference.quadratic_bytes(B, n, n, itemsize, arrays=4)
    if spec["causal"]:
        # kernel matrix, its mask copy, the normalised result
        return reference.quadratic_bytes(B, n, n, itemsize, arrays=3)
    return 0


def make_call(spec, q, k, v):
    """The no-argument callable that computes point ``spec`` on ``q, k, v``.

    fastattn backends are called through the public functions (validation
    and dispatch included, as a user calls them); peers through
    :mod:`fastattn.bench.peers`.
    """
    attention, backend, causal = spec["attention"], spec["backend"], spec["causal"]
    feature_map = spec.get("feature_map") or "elu"
    scale = reference.default_scale(q.shape[-1])
    if backend in peers.PEERS:
        heads = spec.get("heads", 1)
        if attention == "softmax":
            return peers.SOFTMAX_CALLS[backend](q, k, v, causal, scale, heads=heads)
        return peers.LINEAR_CALLS[backend](q, k, v, causal, feature_map, heads=heads)
    if attention == "softmax":
        return lambda: _api.softmax_attention(q, k, v, causal=causal, scale=scale, backend=backend)
    return lambda: _api.linear_attention(
        q, k, v, causal=causal, feature_map=feature_map, backend=backend
    )


def why_skip(spec):
    """Reason a point cannot run here, or None."""
    backend = spec["backend"]
    if backend in peers.PEERS:
        if backend not in peers.available_peers():
            return f"{backend} is not installed; add it with: {peers.INSTALL_HINT[backend]}"
        unsupported = peers.why_not(backend, spec["attention"], spec["dtype"], spec["d_k"],
                                    spec["d_v"])
        if unsupported:
            return unsupported
    elif backend not in _api.available_backends():
        reasons = _api.unavailable_backends()
        return f"backend {backend!r} is not available here ({reasons.get(backend, 'unknown')})"
    itemsize = np.dtype(spec["dtype"]).itemsize
    B = spec["batch"] * spec["heads"]
    available = psutil.virtual_memory().available
    if backend == "reference":
        need = _quadratic_need(spec, itemsize)
    elif backend in peers.PEERS:
        need = peers.peer_extra_bytes(backend, spec["attention"], spec["causal"], B,
                                      spec["n"], spec["d_k"], spec["d_v"], itemsize)
    else:
        need = 0
    need += 4 * B * spec["n"] * max(spec["d_k"], spec["d_v"]) * itemsize  # inputs, output
    if need > MEMORY_HEADROOM * available:
        return (f"needs about {need / 2**20:,.0f} MiB but {available / 2**20:,.0f} MiB "
                f"are available")
    return None


class ReferenceCache:
    """The float64 reference output of the last few inputs (shared by every backend)."""

    def __init__(self, size=4):
        self.size = size
        self._store = {}

    def get(self, spec, n, q, k, v):
        key = (spec["attention"], spec["causal"], spec.get("feature_map"), spec["dtype"],
               n, spec["d_k"], spec["d_v"], spec["batch"] * spec["heads"])
        if key not in self._store:
            q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
            ref_spec = dict(spec, backend="reference")
            self._store[key] = make_call(ref_spec, q64, k64, v64)()
            while len(self._store) > self.size:
                self._store.pop(next(iter(self._store)))
        return self._store[key]


def _check_n(spec, max_bytes):
    """Largest n (the point's, halved as needed) whose float64 reference fits ``max_bytes``."""
    n = spec["n"]
    while n > 1 and _quadratic_need(dict(spec, n=n), 8) > max_bytes:
        n //= 2
    return n


def check_accuracy(spec, out, references, seed, max_bytes=None):
    """``max_abs_err`` of ``out`` against the float64 reference, at the point's n if it fits.

    Returns
    -------
    dict
        ``max_abs_err``, ``check_n`` (the n it was measured at; smaller than
        the point's when the reference would not fit), ``check_tol`` and
        ``check_ok`` (False flags a kernel or peer that disagrees).
    """
    if max_bytes is None:
        max_bytes = min(CHECK_MAX_BYTES, psutil.virtual_memory().available // 4)
    n = _check_n(spec, max_bytes)
    q, k, v = make_inputs(n, spec["d_k"], spec["d_v"], spec["batch"] * spec["heads"],
                          spec["dtype"], seed)
    if n != spec["n"]:
        out = make_call(spec, q, k, v)()
    ref = references.get(spec, n, q, k, v)
    err = np.abs(np.asarray(out, dtype=np.float64) - ref)
    max_abs_err = float(np.max(err)) if err.size else 0.0
    if not np.all(np.isfinite(np.asarray(out))):
        max_abs_err = math.inf
    tol = CHECK_TOL[spec["dtype"]] * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    return {"max_abs_err": max_abs_err, "check_n": n, "check_tol": tol,
            "check_ok": bool(max_abs_err <= tol)}


def _max_rss_bytes():
    """Peak resident set size of this process so far, in bytes.

    ``VmHWM`` where /proc exists: Linux's ``getrusage`` maximum survives
    ``exec`` and so would report the parent's peak in a spawned child.
    """
    import resource
    import sys

    try:
        return memory_probe._status_bytes("VmHWM")["VmHWM"]
    except (OSError, KeyError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports kB


def _fresh_probe(conn, spec, seed, threads):
    """In a fresh process: peak RSS of one call of ``spec`` above the RSS before it."""
    try:
        from .._threads import set_num_threads

        set_num_threads(threads)
        peers.set_peer_threads(threads)
        small = dict(spec, n=min(spec["n"], 16))
        q, k, v = make_inputs(small["n"], spec["d_k"], spec["d_v"],
                              spec["batch"] * spec["heads"], spec["dtype"], seed)
        make_call(small, q, k, v)()  # compiles a JIT kernel at a size that costs no memory
        q, k, v = make_inputs(spec["n"], spec["d_k"], spec["d_v"],
                              spec["batch"] * spec["heads"], spec["dtype"], seed)
        call = make_call(spec, q, k, v)
        memory_probe._settle()
        before = max(psutil.Process().memory_info().rss, _max_rss_bytes())
        result = call()
        peak = _max_rss_bytes()
        del result
        conn.send(("ok", max(0, peak - before)))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def peak_extra_fresh_process(spec, seed=DEFAULT_SEED, threads=1, timeout_s=600):
    """Peak extra bytes of one call of ``spec``, measured in a fresh process.

    The fallback where the peak RSS cannot be reset: a new process imports,
    compiles at a tiny n, records its RSS (or its peak so far, if higher),
    makes the call once and reads its peak RSS.  A call whose peak stays below
    the process's start-up peak reads as less than it is, so small calls are
    a lower bound.

    Returns
    -------
    int
    """
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_fresh_probe, args=(child, spec, seed, threads),
                              daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"the fresh-process memory probe took over {timeout_s} s")
        status, value = parent.recv()
    except EOFError:
        raise RuntimeError(
            f"the fresh-process memory probe died (exit code {process.exitcode})"
        ) from None
    finally:
        process.join(timeout=5)
        if process.is_alive():
            process.terminate()
    if status != "ok":
        raise RuntimeError(value)
    return value


#: Memory methods :func:`measure_point` accepts.
MEMORY_METHODS = ("auto", "hwm", "fresh", "tracemalloc")


def measure_point(spec, repeats=5, memory=True, check=True, seed=DEFAULT_SEED,
                  references=None, memory_method="auto", threads=None, max_point_s=None):
    """Measure one point; return the outcome fields of its record.

    Parameters
    ----------
    spec : dict
        The :class:`~fastattn.bench.sweep.Point` fields.
    repeats : int
    memory : bool
        Measure the peak extra memory (``peak_bytes``, ``memory_method``;
        for the NumPy reference also ``peak_bytes_tracemalloc``, the
        tracemalloc cross-check, when a call takes under a second).
    check : bool
        Compare with the float64 reference (``max_abs_err`` and friends).
    seed : int
    references : ReferenceCache, optional
    memory_method : {"auto", "hwm", "fresh", "tracemalloc"}
        ``"auto"``: ``"hwm"`` (reset the peak RSS in this process, after the
        warm-up) where Linux allows it, else ``"fresh"`` (a fresh process per
        point, :func:`peak_extra_fresh_process`).
    threads : int, optional
        Threads of the fresh process (``"fresh"`` only).
    max_point_s : float, optional
        Cap on the seconds of timed repeats: a slow call gets fewer repeats
        (never fewer than 3, nor more than ``repeats``).

    Returns
    -------
    dict
        ``status`` ("ok", "skipped" or "error"), ``reason`` and, when ok,
        the timing fields of :func:`~fastattn.bench.timers.time_call`,
        ``flops``, ``gflops`` and the memory and check fields.
    """
    reason = why_skip(spec)
    if reason:
        return {"status": "skipped", "reason": reason}
    references = references or ReferenceCache()
    fields = {"status": "ok", "reason": None, "seed": seed,
              "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    try:
        q, k, v = make_inputs(spec["n"], spec["d_k"], spec["d_v"],
                              spec["batch"] * spec["heads"], spec["dtype"], seed)
        call = make_call(spec, q, k, v)
        # Let the thread pools of the previous point go to sleep first: OpenBLAS
        # and OpenMP workers spin for a while after their last job, and on 2
        # cores a spinning worker of another runtime made a 1 ms kernel read
        # 8 ms, call after call.
        time.sleep(SETTLE_S)
        start = time.perf_counter()
        out = call()  # warm-up: compilation and first touch are never timed
        fields["warmup_s"] = time.perf_counter() - start
        method = memory_method
        if method == "auto":
            method = "hwm" if memory_probe.hwm_available() else "fresh"
        estimate = None
        if memory:
            if method == "hwm":
                fields["peak_bytes"], estimate = memory_probe.peak_extra_hwm(
                    call, return_elapsed=True)
            elif method == "fresh":
                fields["peak_bytes"] = peak_extra_fresh_process(spec, seed, threads or 1)
            elif method == "tracemalloc":
                fields["peak_bytes"] = memory_probe.peak_extra_tracemalloc(call)
            else:
                raise ValueError(f"memory_method must be one of {MEMORY_METHODS}, got {method!r}")
            fields["memory_method"] = method
        else:
            fields["peak_bytes"], fields["memory_method"] = None, None
        if estimate is None:
            start = time.perf_counter()
            call()
            estimate = time.perf_counter() - start
        n_repeats = repeats
        if max_point_s is not None and estimate > 0:
            n_repeats = max(min(3, repeats), min(repeats, int(max_point_s / estimate)))
        timing = time_call(call, repeats=n_repeats, warmup=False, estimate_s=estimate)
        timing.pop("result")
        timing.pop("warmup_s")
        fields.update(timing)
        if memory and spec["backend"] == "reference" and method != "tracemalloc" \
                and estimate < 1.0:
            fields["peak_bytes_tracemalloc"] = memory_probe.peak_extra_tracemalloc(call)
        flops = attention_flops(spec["attention"], spec["n"], spec["n"], spec["d_k"],
                                spec["d_v"], spec["causal"], spec["batch"], spec["heads"])
        fields["flops"] = flops
        fields["gflops"] = flops / fields["median_s"] / 1e9 if fields["median_s"] > 0 else None
        if check:
            # One BLAS thread: the float64 reference leaves no spinning pool behind.
            with threadpool_limits(1):
                fields.update(check_accuracy(spec, out, references, seed))
    except MemoryError as exc:
        return {"status": "skipped", "reason": f"MemoryError: {exc}"}
    except Exception as exc:  # a failing kernel is a result, not the end of the sweep
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=6)}
    return fields
