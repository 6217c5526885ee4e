"""``fastattn bench --startup``: ``import fastattn``, ``set_num_threads`` and a first call
in a new process beyond ``import numpy``, as ``"startup"`` records."""

import json
import statistics
import subprocess
import sys

from .. import _api

#: The child: prints ``{"numpy_s": ..., "first_call_s": ...}`` (the second given a backend).
CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
import numpy as np
t1 = time.perf_counter()
out = {"numpy_s": t1 - t0}
if len(sys.argv) > 1:
    import fastattn
    fastattn.set_num_threads(int(sys.argv[2]))
    q = np.ones((1, 64), np.float32)
    fastattn.softmax_attention(q, q, q, backend=sys.argv[1])
    out["first_call_s"] = time.perf_counter() - t1
print(json.dumps(out))
"""

#: What the table calls the baseline process.
BASELINE = "import numpy"


class StartupError(RuntimeError):
    """A child process failed (its stderr's tail is in the message)."""


def startup_backends(names):
    """The fastattn backends to time (None: every available one and ``auto``); ValueError
    for any other name."""
    available = list(_api.available_backends()) + ["auto"]
    for name in names or ():
        if name not in available:
            raise ValueError(f"--startup times fastattn backends, got {name!r}; "
                             f"available here: {', '.join(available)}")
    return available if names is None else names


def _child(args):
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise StartupError(f"the start-up child {' '.join(args) or '(numpy)'} failed: "
                           f"{proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_startup(backends, threads, repeats):
    """Seconds of ``repeats`` new processes per name (:data:`BASELINE` and each backend)."""
    for name in backends:           # warm the caches (Numba's, the file system's)
        _child([name, str(threads)])
    times = {BASELINE: [], **{name: [] for name in backends}}
    for _ in range(repeats):
        times[BASELINE].append(_child([])["numpy_s"])
        for name in backends:
            times[name].append(_child([name, str(threads)])["first_call_s"])
    return times


def run_startup(args, out, backends):
    """Measure ``backends`` (:func:`startup_backends`), print the table, append to ``out``."""
    from .._threads import default_num_threads
    from .environment import load_avg_1m
    from .results import ResultsWriter
    from .table import text_table
    writer = ResultsWriter(out, resume=True)
    for threads in args.threads or [default_num_threads()]:
        times = measure_startup(backends, threads, args.repeats)
        load, base = load_avg_1m(), times[BASELINE]
        for name in backends:
            writer.write("startup", backend=name, threads=threads, repeats=args.repeats,
                         min_s=min(times[name]), median_s=statistics.median(times[name]),
                         times_s=times[name], numpy_min_s=min(base),
                         numpy_median_s=statistics.median(base), load_avg_1m=load)
        rows = [[name if name == BASELINE else f"{name}: beyond import numpy",
                 f"{min(values) * 1e3:.1f}ms", f"{statistics.median(values) * 1e3:.1f}ms"]
                for name, values in times.items()]
        print(f"start-up in a new process ({threads} threads; first call: softmax n=1, d=64, "
              "float32)\n" + text_table(["", "min", "median"], rows, ["left", "right", "right"]))
    print(f"\nresults: {out}")
    return 0
