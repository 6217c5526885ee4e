"""Wall-clock timing of one call: warm-up, then the median of repeats."""

import statistics
import time


def time_call(fn, repeats=5, min_repeat_s=2e-3, max_number=1000, warmup=True,
              estimate_s=None):
    """Time ``fn()`` after one warm-up call.

    Parameters
    ----------
    fn : callable
        Called with no arguments.  The warm-up call (JIT compilation, first
        touch of buffers) is never timed.
    repeats : int, default 5
        Number of timed repeats; the median is the result.
    min_repeat_s : float, default 2e-3
        A call faster than this is run ``number`` times per repeat (the
        smallest power of 2 that makes one repeat last this long, at most
        ``max_number``) so the clock's resolution does not dominate.
    max_number : int, default 1000
    warmup : bool, default True
        Make the warm-up call first (its result is returned).
    estimate_s : float, optional
        Seconds one call is known to take (e.g. from an untimed-for-the-record
        call just made); saves the calibration call.

    Returns
    -------
    dict
        ``times_s`` (seconds per call, one entry per repeat), ``median_s``,
        ``min_s``, ``max_s``, ``number`` (calls per repeat), ``repeats``,
        ``warmup_s`` (the warm-up call, seconds) and ``result`` (the warm-up
        call's return value, or None).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    clock = time.perf_counter
    result = None
    warmup_s = None
    if warmup:
        start = clock()
        result = fn()
        warmup_s = clock() - start
    # Calibrate: one call decides how many calls a repeat holds.
    if estimate_s is None:
        start = clock()
        fn()
        first = clock() - start
    else:
        first = float(estimate_s)
    number = 1
    while first * number < min_repeat_s and number < max_number:
        number *= 2
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(number):
            fn()
        times.append((clock() - start) / number)
    return {
        "times_s": times,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "number": number,
        "repeats": repeats,
        "warmup_s": warmup_s,
        "result": result,
    }
