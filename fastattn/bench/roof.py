"""The roof: what this machine's BLAS and NumPy reach at attention shapes.

Attention is two GEMM-like products, ``q kᵀ`` (``n x d @ d x n``) and the
weighted sum of ``v``; the GEMM rate at the shape ``n x d @ d x n`` on the
sweep's thread count is the natural ceiling of a kernel's GFLOP/s.  The exp
throughput bounds the softmax's elementwise part.
"""

import math
import time

import numpy as np

#: GEMM shapes above this n are probed at this n: the rate is flat beyond it
#: and the ``n x n`` output would cost memory and time for nothing.
MAX_PROBE_N = 4096


def _best_rate(fn, work, budget_s, min_repeats=3, warmup=True):
    """Best ``work / seconds`` of ``fn()`` over repeats within ``budget_s``."""
    if warmup:
        fn()  # first touch of the output, thread pool start
    best = 0.0
    deadline = time.perf_counter() + budget_s
    repeats = 0
    while repeats < min_repeats or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if elapsed > 0:
            best = max(best, work / elapsed)
        repeats += 1
        if repeats >= 1000:
            break
    return best, repeats


def gemm_gflops(n, d, dtype, budget_s=0.1, seed=0):
    """GFLOP/s of ``a @ b`` with ``a (n, d)``, ``b (d, n)`` (2 n² d flops).

    Parameters
    ----------
    n, d : int
    dtype : str or dtype
        float32 or float64.
    budget_s : float, default 0.1
        Time spent on repeats; the best repeat is the rate.

    Returns
    -------
    dict
        ``probe`` ("gemm"), ``dtype``, ``shape`` ([n, d, n]), ``gflops``,
        ``repeats``.
    """
    fn, work = _gemm_task(n, d, dtype, seed)
    rate, repeats = _best_rate(fn, work, budget_s)
    return {"probe": "gemm", "dtype": np.dtype(dtype).name, "shape": [n, d, n],
            "gflops": rate / 1e9, "repeats": repeats}


def _gemm_task(n, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, d)).astype(dtype)
    b = rng.standard_normal((d, n)).astype(dtype)
    out = np.empty((n, n), dtype=dtype)
    return (lambda: np.matmul(a, b, out=out)), 2.0 * n * n * d


def _exp_task(dtype, size=1 << 22, seed=0):
    x = np.random.default_rng(seed).standard_normal(size).astype(dtype)
    out = np.empty_like(x)
    return (lambda: np.exp(x, out=out)), float(size)


def exp_throughput(dtype, size=1 << 22, budget_s=0.1, seed=0):
    """NumPy ``exp`` throughput in G elements/s (one thread: NumPy's ufuncs are serial).

    Returns
    -------
    dict
        ``probe`` ("exp"), ``dtype``, ``size``, ``gelem_s``, ``repeats``.
    """
    fn, work = _exp_task(dtype, size, seed)
    rate, repeats = _best_rate(fn, work, budget_s)
    return {"probe": "exp", "dtype": np.dtype(dtype).name, "size": size,
            "gelem_s": rate / 1e9, "repeats": repeats}


def _probe_n(n):
    """The n a shape is probed at: the nearest power of 2, at most :data:`MAX_PROBE_N`."""
    return min(2 ** max(0, round(math.log2(max(int(n), 1)))), MAX_PROBE_N)


def probe(shapes=((4096, 64),), dtypes=("float32", "float64"), threads=None, budget_s=0.1,
          rounds=3):
    """Measure the roof: GEMM GFLOP/s at each attention shape and dtype, and exp throughput.

    Run it in the process (and on the thread count) of the sweep it bounds.
    Each measurement is the best repeat over ``rounds`` rounds that visit
    every shape in turn, so a burst of load from other processes does not
    sink one shape's whole measurement.

    Parameters
    ----------
    shapes : iterable of (n, d)
        Attention shapes ``n x d @ d x n``; n is rounded to a power of 2
        (so a fine grid costs a few probes) and capped at :data:`MAX_PROBE_N`.
    dtypes : iterable of str
    threads : int, optional
        Fix the thread count (:func:`fastattn.set_num_threads`) first;
        default: as set.
    budget_s : float, default 0.1
        Seconds of repeats per measurement (over all rounds).
    rounds : int, default 3

    Returns
    -------
    dict
        ``threads`` (int or None), ``gemm``: list of :func:`gemm_gflops`
        dicts, ``exp``: list of :func:`exp_throughput` dicts; ``repeats``
        sums the rounds.
    """
    if threads is not None:
        from .._threads import set_num_threads

        set_num_threads(threads)
    probed = sorted({(_probe_n(n), int(d)) for n, d in shapes})
    rounds = max(1, int(rounds))
    tasks = [("gemm", np.dtype(dt).name, n, d) for dt in dtypes for n, d in probed]
    tasks += [("exp", np.dtype(dt).name, 1 << 22, None) for dt in dtypes]
    best = {task: 0.0 for task in tasks}
    repeats = {task: 0 for task in tasks}
    for round_ in range(rounds):
        for task in tasks:
            kind, dtype, n, d = task
            # Built per visit, so only one n x n output is alive at a time.
            fn, work = _gemm_task(n, d, dtype) if kind == "gemm" else _exp_task(dtype, n)
            rate, count = _best_rate(fn, work, budget_s / rounds, min_repeats=1,
                                     warmup=True)
            best[task] = max(best[task], rate)
            repeats[task] += count
    gemm = [{"probe": "gemm", "dtype": t[1], "shape": [t[2], t[3], t[2]],
             "gflops": best[t] / 1e9, "repeats": repeats[t]} for t in tasks if t[0] == "gemm"]
    exp = [{"probe": "exp", "dtype": t[1], "size": t[2], "gelem_s": best[t] / 1e9,
            "repeats": repeats[t]} for t in tasks if t[0] == "exp"]
    return {"threads": threads, "gemm": gemm, "exp": exp}


def roof_for(gemm_records, dtype, n, d):
    """The GEMM GFLOP/s that bounds a point: the best probed at its dtype and nearest ``d``.

    A roof is an upper bound: the best GEMM throughput this run measured at
    the attention shapes (``n x d @ d x n``) of the point's head dimension,
    over every probed ``n``.  Taking the probe at the point's own ``n`` alone
    let one probe slowed by a busy machine read as a roof far below what the
    kernels achieved (``% of roof`` in the thousands).

    Parameters
    ----------
    gemm_records : list of dict
        Roof records with ``dtype``, ``shape`` ([n, d, n]) and ``gflops``.
    dtype : str
    n : int
        Unused beyond documentation: every probed ``n`` counts.
    d : int

    Returns
    -------
    float or None
        GFLOP/s; None when nothing of that dtype was probed.
    """
    candidates = [r for r in gemm_records if r.get("dtype") == dtype and r.get("gflops")]
    if not candidates:
        return None
    nearest = min(abs(np.log2(r["shape"][1] / int(d))) for r in candidates)
    same_d = [r for r in candidates if abs(np.log2(r["shape"][1] / int(d))) == nearest]
    return max(r["gflops"] for r in same_d)
