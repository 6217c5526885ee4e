"""The machine's limits, probed in the run: the compute peak (GFLOP/s of a square GEMM of
``PEAK_N`` per BLAS library and dtype) and the memory floor (GB/s of a streaming read at the
points' sizes).  A point's limit is the roofline's: the larger of its flops at the peak and its
:func:`point_bytes` at the floor nearest its size; ``limit_fraction`` is that time over its
median time (1 = at the limit)."""

import math
import time

import numba
import numpy as np

from .. import _threads
from .._numba import _threads as numba_threads
from .._numba.config import JIT_PARALLEL
from . import peers
from .table import plural

#: Size of the square GEMM of the compute peak (float32: 17 GFLOP a call).
PEAK_N = 2048
#: Sizes of the floor's reads: each point's bytes, clipped to this range.
FLOOR_MIN_BYTES, FLOOR_MAX_BYTES = 2**16, 2**29
#: Operations per score of online softmax besides the products' ``2 d`` multiply-adds: max,
#: subtract, exp (a short polynomial), rescale and sum, counted in multiply-add slots.
SOFTMAX_EXTRA_OPS = 12


def softmax_ceiling(d):
    """Softmax's fraction of the GEMM peak at head dimension ``d`` if its extra operations do
    not overlap its products: ``2 d / (2 d + SOFTMAX_EXTRA_OPS)`` (91 % at d = 64)."""
    return 2 * d / (2 * d + SOFTMAX_EXTRA_OPS)


#: Operations per element of q and k of linear attention's elu+1 map, in the same slots: an exp
#: by polynomial (15 vector operations a vector, as compiled), the keys' sums, the denominator.
LINEAR_ELU_OPS = 16


def linear_ceiling(d):
    """Non-causal elu+1 linear attention's fraction of the GEMM peak at ``d_k = d_v = d`` when
    its map's operations take the FMA units too (Intel's AVX-512 cores: ports 0 and 5 run every
    512-bit operation): its products are ``d`` multiply-adds per mapped element (``2 n d²`` a
    head), so ``d / (d + LINEAR_ELU_OPS)`` (67 % at d = 32, 80 % at 64)."""
    return d / (d + LINEAR_ELU_OPS)


def point_bytes(spec, feature_dim=None):
    """Bytes a point's call moves at least: ``q``, ``k``, ``v`` read and the output written
    once; a linear decode step reads and writes its state (``D`` features) instead of the
    keys before it."""
    bh_item = spec["batch"] * spec["heads"] * np.dtype(spec["dtype"]).itemsize
    n_q, n_k, d_k, d_v = spec["n_q"], spec["n_k"], spec["d_k"], spec["d_v"]
    if spec["attention"] == "linear" and spec.get("regime") == "decode":
        return bh_item * (2 * n_q * (d_k + d_v) + 2 * (feature_dim or d_k) * (d_v + 1))
    return bh_item * (n_q + n_k) * (d_k + d_v)


def fastest_rate(call, work, budget_s, min_calls, max_calls=math.inf):
    """``(work / fastest call's seconds, calls)`` of a warmed-up ``call``: ``min_calls``, then
    more while ``budget_s`` lasts, ``max_calls`` at most.  The one timing loop of the probes."""
    best, calls, deadline = 0.0, 0, time.perf_counter() + budget_s
    while calls < max_calls and (calls < min_calls or time.perf_counter() <= deadline):
        start = time.perf_counter()
        call()
        best = max(best, work / max(time.perf_counter() - start, 1e-12))
        calls += 1
    return best, calls


def _fastest(call, work, budget_s, min_calls=3):
    """Work per second of the fastest call after one untimed first touch."""
    call()
    return fastest_rate(call, work, budget_s, min_calls)[0]


def gemm_call(dtype, m, k, n, library="numpy"):
    """``(call, flops)``: the GEMM ``(m, k) @ (k, n)`` of seeded Gaussian arrays into a
    preallocated output, through NumPy's BLAS or torch's (with the peers' thread count)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    out, matmul = np.empty((m, n), dtype=dtype), np.matmul
    if library == "torch":
        torch = peers._torch()
        (a, b, out), matmul = map(torch.from_numpy, (a, b, out)), torch.matmul
    return (lambda: matmul(a, b, out=out)), 2.0 * m * k * n


@numba.njit(**JIT_PARALLEL)
def _sum_rows(a):
    """The sum of ``a``, a row per thread, each row in SIMD lanes: one read of ``a`` (faster
    here than NumPy's sum, a BLAS GEMV or dot, measured side by side)."""
    sums = np.zeros(a.shape[0], dtype=a.dtype)
    for i in numba.prange(a.shape[0]):
        acc = a.dtype.type(0)
        for j in range(a.shape[1]):
            acc += a[i, j]
        sums[i] = acc
    return sums.sum()


def _read(nbytes):
    """``(calls, bytes)``: reads of ``nbytes`` (rows of 4 KiB summed) on fastattn's Numba
    threads and on one; the floor is the faster (a parallel loop waits for a descheduled
    thread, and can read a hundred times slower)."""
    a = np.ones((max(1, int(nbytes) // 4096), 1024), dtype=np.float32)
    # fastattn's recorded count: the Numba threads module imported directly does not apply it
    threads = min(_threads.requested() or numba_threads.get_num_threads(),
                  numba.config.NUMBA_NUM_THREADS)

    def parallel():
        if numba.get_num_threads() != threads:
            numba.set_num_threads(threads)
        return _sum_rows(a)

    serial = numba_threads.serial_twin(_sum_rows)
    return [parallel, lambda: serial(a)] if threads > 1 else [lambda: serial(a)], float(a.nbytes)


def probe_limits(sizes, dtypes, library="numpy", budget_s=0.3, blas=None):
    """Limit records: ``"peak"`` (``gflops`` of the square GEMM per dtype through ``library``)
    and, for NumPy, ``"floor"`` (``gbs`` of a read of each of ``sizes`` clipped to
    [FLOOR_MIN_BYTES, FLOOR_MAX_BYTES], a power of two); ``blas``: label fields of each."""
    records = []
    for dtype in sorted({np.dtype(d).name for d in dtypes}):
        rate = _fastest(*gemm_call(dtype, PEAK_N, PEAK_N, PEAK_N, library), budget_s, min_calls=5)
        records.append({"probe": "peak", "dtype": dtype, "library": library, **(blas or {}),
                        "shape": [PEAK_N] * 3, "gflops": rate / 1e9})
    if library == "numpy":
        clipped = {2 ** round(math.log2(min(max(s, FLOOR_MIN_BYTES), FLOOR_MAX_BYTES)))
                   for s in sizes if s > 0}
        for nbytes in sorted(clipped):
            calls, work = _read(nbytes)
            records.append({"probe": "floor", "dtype": "float32", "library": library,
                            "bytes": int(work), "gbs": max(
                                _fastest(c, work, budget_s / 6) for c in calls) / 1e9})
    return records


def time_read(nbytes, cache, budget_s=0.02):
    """One round's floor beside a memory-bound comparison: GB/s of the fastest of 3+ reads of
    ``nbytes`` within ``budget_s``; ``cache`` keeps the array between rounds."""
    if nbytes not in cache:
        cache[nbytes] = _read(nbytes)
    calls, work = cache[nbytes]
    return max(_fastest(c, work, budget_s / len(calls)) for c in calls) / 1e9


def paired_fraction(nbytes, round_floor, round_min_s):
    """The median over rounds of ``nbytes`` at the round's floor (GB/s) over the point's fastest
    repeat in it: a fraction of the floor that a slow spell moves less."""
    pairs = sorted(nbytes / g / 1e9 / t for g, t in zip(round_floor, round_min_s)
                   if g and t and t > 0)
    return float(np.median(pairs)) if pairs else None


def _nearest(records, probe, **match):
    value = {"peak": "gflops", "floor": "gbs"}[probe]
    return [r for r in records if r.get("probe") == probe
            and isinstance(r.get(value), (int, float)) and r[value] > 0
            and (probe == "peak" or isinstance(r.get("bytes"), int))
            and all(v is None or r.get(k) in (None, v) for k, v in match.items())]


def binding_limit(spec, flops, nbytes, limits, threads=None):
    """``peak_gflops``, ``floor_gbs``, ``floor_bytes``, ``limit`` (the one that binds: ``"peak"``
    or ``"floor"``) and ``limit_s`` of a point from ``limits`` records; {} lacking either."""
    peaks = _nearest(limits, "peak", dtype=spec["dtype"], threads=threads)
    floors = _nearest(limits, "floor", threads=threads)
    if not peaks or not floors:
        return {}
    peak = max(r["gflops"] for r in peaks)
    size = min(floors, key=lambda r: abs(math.log2(max(nbytes, 1) / r["bytes"])))["bytes"]
    floor = max(r["gbs"] for r in floors if r["bytes"] == size)
    compute_s, memory_s = flops / peak / 1e9, nbytes / floor / 1e9
    return {"peak_gflops": peak, "floor_gbs": floor, "floor_bytes": size,
            "limit": "peak" if compute_s >= memory_s else "floor",
            "limit_s": max(compute_s, memory_s)}


def limit_fields(spec, flops, nbytes, median_s, limits, threads=None):
    """:func:`binding_limit` and ``limit_fraction`` (``limit_s / median_s``) of a point timed at
    ``median_s``; {} without both probes or a time."""
    if not median_s or median_s <= 0 or not (
            fields := binding_limit(spec, flops, nbytes, limits, threads)):
        return {}
    return {**fields, "limit_fraction": fields["limit_s"] / median_s}


def statements(records):
    """Sentences naming the limits probed in a run: the peak per dtype and threads, the floor
    per size, and softmax's ceiling."""
    lines, probed = [], _nearest(records, "peak") + _nearest(records, "floor")
    for (dtype, threads) in sorted({(r.get("dtype"), r.get("threads")) for r in probed
                                    if r["probe"] == "peak"}, key=str):
        peaks = _nearest(records, "peak", dtype=dtype, threads=threads)
        best = max(peaks, key=lambda r: r["gflops"])
        others = ", ".join(f"{r.get('blas') or r.get('library')} {r['gflops']:.1f}"
                           for r in peaks if r is not best)
        lines.append(f"compute peak, {dtype}, {plural(threads, 'thread')}: "
                     f"{best['gflops']:.1f} GFLOP/s, GEMM {PEAK_N}³, "
                     f"{best.get('blas') or best.get('library')}"
                     + (f" (also probed: {others})" if others else ""))
    for threads in sorted({r.get("threads") for r in probed if r["probe"] == "floor"}, key=str):
        floors = sorted(_nearest(records, "floor", threads=threads), key=lambda r: r["bytes"])
        lines.append(f"memory floor, {plural(threads, 'thread')}: " + ", ".join(
            f"{r['gbs']:.0f} GB/s at {r['bytes'] / 2**20:.3g} MiB" for r in floors))
    if lines:
        lines.append(f"A point's limit is the larger of its flops at the peak and its bytes at "
                     f"the floor nearest its size. Softmax attention's flops count its two "
                     f"products (2·d multiply-adds per score); its max, exp and rescale add "
                     f"about {SOFTMAX_EXTRA_OPS} operations per score, so done apart from the "
                     f"products they would hold it to {softmax_ceiling(64):.0%} of the peak at "
                     f"d = 64 ({softmax_ceiling(128):.0%} at 128); a kernel overlapping them with "
                     f"the products goes higher, and the peak is the fastest GEMM measured, not "
                     f"the cores' FMA peak, which a register-blocked kernel can pass. Linear "
                     f"attention's flops count its products, d multiply-adds per element of q "
                     f"and k; its elu+1 map adds about {LINEAR_ELU_OPS} operations per element, "
                     f"so where they take the FMA units too (as every 512-bit operation does on "
                     f"Intel's AVX-512 cores) it would reach at most {linear_ceiling(32):.0%} "
                     f"of the FMA peak at d = 32, {linear_ceiling(64):.0%} at 64 "
                     f"({linear_ceiling(128):.0%} at 128), non-causal.")
    return lines
