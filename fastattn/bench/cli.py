"""``fastattn bench``: every kernel side by side with its peers and the machine's roof."""

import argparse
import sys
import time
from pathlib import Path

from .. import _api
from .._argtypes import positive_int as _positive_int
from .._argtypes import thread_count


def add_parser(subparsers):
    """Register ``fastattn bench`` and its options."""
    from .sweep import DEFAULT_NS

    parser = subparsers.add_parser(
        "bench",
        help="time every kernel side by side with its peers and the GEMM roof",
        description=(
            "Measure softmax and/or linear attention on every available backend and "
            "peer (PyTorch when installed) over a grid of sequence lengths: median "
            "time (min-max) after a warm-up call, GFLOP/s, fraction of the GEMM roof "
            "measured in the same run, peak extra memory of the call, the ratio to a "
            "baseline backend and the error against the float64 reference. Results "
            "are appended to a JSON-lines file as each point finishes (a CSV is "
            "written beside it); running again with the same --out resumes."
        ),
    )
    parser.add_argument("--kind", choices=("softmax", "linear", "both"), default="both",
                        help="attention type (default both)")
    parser.add_argument("--backends", nargs="+", metavar="NAME",
                        help="fastattn backends and peers to measure (default: every "
                             "available backend and installed peer)")
    parser.add_argument("--n", nargs="+", type=_positive_int, metavar="N",
                        default=list(DEFAULT_NS),
                        help=f"sequence lengths n_q = n_k (default {' '.join(map(str, DEFAULT_NS))})")
    parser.add_argument("--d-k", type=_positive_int, default=64, help="key head dim (default 64)")
    parser.add_argument("--d-v", type=_positive_int, default=None,
                        help="value head dim (default: d_k)")
    parser.add_argument("--batch", type=_positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--heads", type=_positive_int, default=1, help="heads (default 1)")
    parser.add_argument("--dtype", nargs="+", choices=("float32", "float64"),
                        default=["float32"], help="dtype(s) (default float32)")
    parser.add_argument("--causal", choices=("yes", "no", "both"), default="both",
                        help="causal mask (default both)")
    parser.add_argument("--feature-map", choices=("elu", "relu"), default="elu",
                        help="feature map of linear attention (default elu)")
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="threads for every backend, BLAS and peers (default: usable cores)")
    parser.add_argument("--repeats", type=_positive_int, default=5,
                        help="timed repeats per point after a warm-up (default 5)")
    parser.add_argument("--baseline", default=None, metavar="NAME",
                        help="backend the ratio column compares with (default reference)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (JSON lines; default results/bench-<time>.jsonl); "
                             "an existing one is resumed; a CSV (.csv) and a JSON summary "
                             "(.summary.json) of the tables are written beside it")
    parser.add_argument("--fresh", action="store_true",
                        help="start --out afresh instead of resuming it")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probe")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the check against the float64 reference")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
    return parser


def _usable_cores():
    from .._threads import default_num_threads

    return default_num_threads()


class BenchUsageError(ValueError):
    """A bad combination of options (exit code 2, message on stderr)."""


def resolve_backends(requested):
    """Check ``--backends`` against what runs here.

    Returns
    -------
    (list of str, dict of str to str)
        The backends to measure, and the absent peers with how to add them.

    Raises
    ------
    BenchUsageError
        For an unknown name, a backend that cannot run here or a peer that is
        not installed; the message lists what is available.
    """
    from . import peers
    from .sweep import default_backends, known_backends

    available = default_backends()
    absent = peers.absent_peers()
    if not requested:
        return available, absent
    names = []
    for item in requested:
        names += [name for name in item.split(",") if name]
    for name in names:
        if name not in known_backends():
            raise BenchUsageError(
                f"unknown backend {name!r}; available here: {', '.join(available)}"
                + (f" (known but absent: {', '.join(sorted(set(known_backends()) - set(available)))})"
                   if set(known_backends()) - set(available) else "")
            )
        if name in absent:
            raise BenchUsageError(
                f"peer {name!r} is not installed; add it with: {absent[name]}; "
                f"available here: {', '.join(available)}"
            )
        if name not in available:
            reason = _api.unavailable_backends().get(name, "not available")
            raise BenchUsageError(
                f"backend {name!r} cannot run here ({reason}); available here: "
                f"{', '.join(available)}"
            )
    return list(dict.fromkeys(names)), {k: v for k, v in absent.items() if k not in names}


def run(args):
    """Run ``fastattn bench`` with parsed ``args``; return the exit code."""
    try:
        return _run(args)
    except BenchUsageError as exc:
        print(f"fastattn bench: error: {exc}", file=sys.stderr)
        return 2


def _run(args):
    from .results import ResultsFileError, read_records
    from .sweep import default_grid, run_sweep
    from .table import check_csv_target, check_summary_target, format_tables, write_csv, \
        write_summary

    backends, absent = resolve_backends(args.backends)
    baseline = args.baseline
    if baseline is None:
        baseline = "reference" if "reference" in backends else backends[0]
    elif baseline not in backends:
        raise BenchUsageError(
            f"--baseline {baseline!r} is not among the measured backends: {', '.join(backends)}"
        )
    attentions = ("softmax", "linear") if args.kind == "both" else (args.kind,)
    causal = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    points = default_grid(
        attentions=attentions, backends=backends, ns=sorted(set(args.n)), causal=causal,
        d_k=args.d_k, d_v=args.d_v or args.d_k, batch=args.batch, heads=args.heads,
        dtype=args.dtype, feature_map=args.feature_map,
    )
    out = args.out or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S.jsonl")
    if out.suffix == ".csv":
        raise BenchUsageError(f"--out names the JSON-lines results file, got {out}")
    if out.is_dir():
        raise BenchUsageError(f"--out {out} is a directory; give a file name, e.g. {out / 'bench.jsonl'}")
    try:  # refuse foreign files before measuring anything
        if out.exists():
            read_records(out)
        check_csv_target(out.with_suffix(".csv"))
        check_summary_target(out.with_suffix(".summary.json"))
    except ResultsFileError as exc:
        print(f"fastattn bench: error: {exc}", file=sys.stderr)
        return 2
    for name, hint in absent.items():
        print(f"{name} is not installed, so it is not compared; add it with: {hint}")
    try:
        records = run_sweep(points, out, threads=args.threads, repeats=args.repeats,
                            memory=not args.no_memory, check=not args.no_check,
                            resume=not args.fresh, progress=not args.no_progress)
    except ResultsFileError as exc:
        print(f"fastattn bench: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(format_tables(records, baseline=baseline, backend_order=backends))
    roofs = [r for r in read_records(out) if r["record"] == "roof"]
    gemm = {}
    for r in roofs:  # the latest run's probe of each kind wins
        key = (r.get("probe"), r.get("dtype"), tuple(r.get("shape") or ()))
        gemm[key] = r
    lines = []
    for (probe, dtype, shape), r in sorted(gemm.items(), key=lambda kv: str(kv[0])):
        if probe == "gemm":
            lines.append(f"{dtype} GEMM {shape[0]}x{shape[1]} @ {shape[1]}x{shape[2]}: "
                         f"{r['gflops']:.1f} GFLOP/s")
        elif probe == "exp":
            lines.append(f"{dtype} exp (NumPy, 1 thread): {r['gelem_s']:.2f} G elem/s")
    if lines:
        print("\nroof (same run, same threads):\n  " + "\n  ".join(lines))
    loads = [r["load_avg_1m"] for r in records if r.get("load_avg_1m") is not None]
    cores = _usable_cores()
    if loads and max(loads) > cores:
        print(f"\nnote: the machine was busy while measuring (1-minute load average up to "
              f"{max(loads):.1f} on {cores} usable cores): times are noisy; compare the "
              "ratios measured side by side in one run, and repeat."
              + (" With more threads than idle cores, multi-threaded BLAS and OpenMP wait "
                 "for descheduled threads: --threads 1 gives steadier numbers."
                 if (args.threads or cores) > 1 else ""))
    mismatched = [r for r in records if r.get("check_ok") is False]
    if mismatched:
        print(f"\n{len(mismatched)} point(s) disagree with the float64 reference (MISMATCH).")
    all_points = [r for r in read_records(out) if r["record"] == "point"]
    try:
        csv_path = write_csv(all_points, out.with_suffix(".csv"))
        summary_path = write_summary(records, out.with_suffix(".summary.json"), baseline)
    except ResultsFileError as exc:
        print(f"fastattn bench: error: {exc}", file=sys.stderr)
        return 2
    print(f"\nresults: {out}\ncsv:     {csv_path}\nsummary: {summary_path}")
    for name, hint in absent.items():
        print(f"note: {name} is absent; to compare with it: {hint}")
    return 0
