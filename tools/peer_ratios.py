"""Ratio table of issue 12: fastattn's fastest softmax against the fastest peer.

Every implementation runs in a process of its own (torch's SDPA slows ~5x in a
process where Numba's OpenMP pool started), kept alive and driven in turns:
each round asks every worker for one timing (the minimum of ``--inner`` calls),
so all of them see the same load.  A worker checks its output against the
float64 reference (at a small n) before it times anything.

    .venv/bin/python tools/peer_ratios.py                       # the issue's table
    .venv/bin/python tools/peer_ratios.py --shapes 1,1,4096,64 --threads 2 --rounds 5

Prints, per shape, causal mask and thread count, the minimum and median of
each implementation and ``best fastattn / best peer`` (by minimum): the issue
asks <= 1.0 non-causal and <= 0.9 causal at float32 (and <= 1.0 against
torch at float64, ``--dtype float64``).  Measure on a quiet machine (uptime).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = ["1,1,4096,64", "1,8,2048,64", "4,12,512,32", "1,8,2048,128", "1,1,16384,64"]
FASTATTN = ("cython", "numba")


def _inputs(batch, heads, n, d, dtype, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch * heads, n, d)).astype(dtype) for _ in range(3)]


def _make_call(impl, q, k, v, causal, heads):
    import fastattn
    from fastattn.bench import peers

    scale = 1.0 / q.shape[-1] ** 0.5
    if impl in FASTATTN:
        return lambda: fastattn.softmax_attention(q, k, v, causal=causal, scale=scale, backend=impl)
    return peers.SOFTMAX_CALLS[impl](q, k, v, causal, scale, heads=heads)


def worker(impl, threads):
    """Answer 'setup B,H,n,d causal dtype' and 'time inner' lines on stdin."""
    import numpy as np

    import fastattn
    from fastattn.bench import peers

    fastattn.set_num_threads(threads)
    peers.set_peer_threads(threads)
    call = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "setup":
            batch, heads, n, d = map(int, args[0].split(","))
            causal, dtype = args[1] == "causal", np.dtype(args[2])
            # the check: a small n against the float64 reference
            small = _inputs(batch, heads, min(n, 256), d, dtype, seed=1)
            out = _make_call(impl, *small, causal, heads)()
            ref = fastattn.softmax_attention(*(x.astype(np.float64) for x in small),
                                             causal=causal, scale=1.0 / d ** 0.5,
                                             backend="reference")
            err = float(np.max(np.abs(out - ref)))
            tol = 1e-4 if dtype == np.float32 else 1e-9
            call = _make_call(impl, *_inputs(batch, heads, n, d, dtype), causal, heads)
            call()  # warm-up
            print(json.dumps({"err": err, "ok": err <= tol}), flush=True)
        elif cmd == "time":
            clock = time.process_time if args[1] == "cpu" else time.perf_counter
            best = float("inf")
            for _ in range(int(args[0])):
                t0 = clock()
                call()
                best = min(best, clock() - t0)
            print(json.dumps({"s": best}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="B,H,n,d")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--causal", nargs="+", default=["full", "causal"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--impls", nargs="+", default=None,
                        help="default: cython numba and every installed peer but jax")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (every thread), steadier on a loaded "
                             "machine for 1 thread; the issue's ratios are wall time")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]))

    from fastattn.bench import peers

    impls = args.impls or [*FASTATTN, *(p for p in peers.available_peers() if p != "jax")]
    if args.dtype != "float32":
        impls = [i for i in impls if not peers.why_not(i, "softmax", args.dtype, 1, 1)
                 or i in FASTATTN]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()}, "
          f"{args.dtype}, {args.clock} clock, rounds {args.rounds} x inner {args.inner}; versions "
          + ", ".join(f"{p} {peers.peer_version(p)}" for p in impls if p not in FASTATTN))
    print("shape(B,H,n,d)  mask    thr  " + "  ".join(f"{i:>17}" for i in impls)
          + "   fastattn/peer")
    for threads in args.threads:
        procs = {i: subprocess.Popen([sys.executable, __file__, "--worker", i, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in impls}

        def ask(i, line):
            procs[i].stdin.write(line + "\n")
            procs[i].stdin.flush()
            answer = procs[i].stdout.readline()
            if not answer:
                raise RuntimeError(f"worker {i} died")
            return json.loads(answer)

        try:
            for shape in args.shapes:
                for mask in args.causal:
                    checks = {i: ask(i, f"setup {shape} {mask} {args.dtype}") for i in impls}
                    times = {i: [] for i in impls}
                    for _ in range(args.rounds):
                        for i in impls:
                            times[i].append(ask(i, f"time {args.inner} {args.clock}")["s"])
                    cells = []
                    for i in impls:
                        flag = "" if checks[i]["ok"] else " BAD"
                        cells.append(f"{1e3 * min(times[i]):7.2f} ({1e3 * statistics.median(times[i]):6.2f}){flag}")
                    ours = min(min(times[i]) for i in impls if i in FASTATTN)
                    theirs = [min(times[i]) for i in impls if i not in FASTATTN]
                    ratio = f"{ours / min(theirs):.3f}" if theirs else "-"
                    print(f"{shape:15} {mask:7} {threads:3}  " + "  ".join(f"{c:>17}" for c in cells)
                          + f"   {ratio}", flush=True)
        finally:
            for p in procs.values():
                p.stdin.close()
                p.wait()


if __name__ == "__main__":
    main()
