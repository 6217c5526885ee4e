"""``fastattn report``: measure the scaling sweep, then write one self-contained HTML report.

By default it runs the bench sweep (:func:`fastattn.bench.sweep.run_sweep`)
over every available backend and peer, both attention types, causal and not,
writing each point to ``reports/fastattn-<timestamp>.jsonl`` as it finishes,
then renders ``reports/fastattn-<timestamp>.html`` from that file and prints
its path.  ``--from`` rebuilds a report from a results file without
measuring, ``--resume`` continues an interrupted run, ``--asv`` reads an asv
results directory instead.
"""

import argparse
import datetime as _dt
import importlib
import sys
from pathlib import Path

from .._argtypes import positive_int as _positive_int
from .._argtypes import thread_count

#: The default sweep: n from 128 to 8192 (every power of two), sized so that
#: the whole run takes a few minutes on a 2-core machine.
DEFAULT_NS = (128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_REPEATS = 5
#: Seconds of timed repeats a point may take: slower calls (the reference at
#: n = 8192) get fewer repeats, never fewer than 3, so the run stays in budget.
MAX_POINT_S = 3.0
#: A point still running after this long is recorded as an error (a hung or
#: swapping kernel costs one point, not the run).
POINT_TIMEOUT_S = 300.0
#: ``--quick``: a tiny grid for tests and CI (still reaches n >= 1024 twice,
#: so every exponent has a two-point fit).
QUICK_NS = (128, 512, 1024, 2048)
QUICK_REPEATS = 2
QUICK_MAX_POINT_S = 0.5
REPORTS_DIR = Path("reports")


class ReportError(Exception):
    """A problem the user can fix (bad path, foreign file); printed without a traceback."""


def add_parser(subparsers):
    """Register ``fastattn report`` and its options."""
    parser = subparsers.add_parser(
        "report",
        help="measure time and memory against n, then write one self-contained HTML report",
        description=(
            "Measure softmax and linear attention (every available backend and peer, causal "
            "and not, d=64, float32) for n from 128 to 8192, writing each point to a JSON "
            "lines results file as it finishes, then write one self-contained HTML report "
            "(scaling plots with fitted exponents, crossover, GFLOP/s against the GEMM roof, "
            "output quality on Gaussian and real MiniLM inputs, environment) and print its "
            "path."
        ),
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--from", dest="from_", metavar="RESULTS", type=Path,
                        help="build the report from this results file without measuring")
    source.add_argument("--resume", metavar="RESULTS", type=Path,
                        help="continue an interrupted run: measure only the points missing "
                             "from this results file, then build the report")
    source.add_argument("--asv", metavar="DIR", type=Path,
                        help="build the report from an asv results directory (latest commit "
                             "of each machine) instead of measuring")
    parser.add_argument("--history", metavar="BENCHMARK",
                        help="with --asv: also plot this benchmark across commits")
    parser.add_argument("--out", metavar="HTML", type=Path,
                        help="where to write the report (default: beside the results file, "
                             "under reports/)")
    parser.add_argument("--n", metavar="N", type=_positive_int, nargs="+",
                        help=f"sequence lengths to measure (default {' '.join(map(str, DEFAULT_NS))})")
    parser.add_argument("--threads", metavar="N", type=thread_count,
                        help="threads for every backend and BLAS (default: all cores)")
    parser.add_argument("--repeats", metavar="R", type=_positive_int,
                        help=f"timed repeats per point (default {DEFAULT_REPEATS}, "
                             f"{QUICK_REPEATS} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a tiny grid (n = {' '.join(map(str, QUICK_NS))}, "
                             f"{QUICK_REPEATS} repeats, no memory probe): for tests and CI")
    parser.add_argument("--readme-image", metavar="PNG", type=Path,
                        help="also write the time-against-n figure to this PNG "
                             "(a copy is always written beside the report)")
    parser.add_argument("--minilm", metavar="NPZ", type=Path,
                        help="MiniLM activations for the quality section (default: "
                             "../shared/data/minilm when found, else the shipped slice)")
    parser.set_defaults(func=run)
    return parser


def _timestamp():
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _check_output(out, protected=()):
    """Refuse to write over anything that is not an earlier fastattn report."""
    from .build import REPORT_MARKER

    out = Path(out)
    for path in protected:
        if path is not None and out.resolve() == Path(path).resolve():
            raise ReportError(f"--out {out} is the results file; choose another path for the report")
    if out.exists():
        if out.is_dir():
            raise ReportError(f"--out {out} is a directory; give a file name such as {out / 'report.html'}")
        with open(out, "rb") as handle:
            head = handle.read(4096).decode("utf-8", errors="replace")
        if REPORT_MARKER not in head:
            raise ReportError(f"{out} exists and is not a fastattn report; refusing to overwrite it")


def _read_results(path):
    from ..bench.results import ResultsFileError, read_records

    try:
        records = read_records(path)
    except FileNotFoundError:
        raise ReportError(f"no results file at {path}") from None
    except ResultsFileError as exc:
        raise ReportError(f"refusing {path}: {exc}") from None
    if not records:
        raise ReportError(f"{path} holds no fastattn records (an empty results file)")
    return records


def sweep_points(ns, quick=False):
    """The default grid of the report's sweep.

    Parameters
    ----------
    ns : sequence of int or None
        Sequence lengths; None for the default (:data:`DEFAULT_NS`, or
        :data:`QUICK_NS` with ``quick``).
    quick : bool

    Returns
    -------
    list of fastattn.bench.sweep.Point
        Every available backend and peer, softmax and linear (elu+1), causal
        and not, d_k = d_v = 64, float32, batch 1, one head.
    """
    from ..bench import sweep

    ns = tuple(ns) if ns else (QUICK_NS if quick else DEFAULT_NS)
    return sweep.default_grid(ns=ns)


def _measure(args):
    """Run (or resume) the sweep; returns the results path."""
    from ..bench import sweep
    from ..bench.results import ResultsFileError

    if args.resume is not None:
        results = args.resume
        if not results.is_file():
            raise ReportError(f"--resume {results}: no such results file")
    else:
        results = REPORTS_DIR / f"fastattn-{_timestamp()}.jsonl"
    points = sweep_points(args.n, args.quick)
    repeats = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    print(f"fastattn report: measuring {len(points)} points into {results} "
          f"(up to {repeats} timed repeats each{', quick grid' if args.quick else ''})", file=sys.stderr)
    # The resume command repeats the grid options, so it finishes the same grid.
    resume = f"fastattn report --resume {results}" + "".join(
        option for option, given in (
            (" --quick", args.quick),
            (f" --n {' '.join(map(str, args.n or ()))}", args.n),
            (f" --threads {args.threads}", args.threads),
            (f" --repeats {args.repeats}", args.repeats),
        ) if given
    )
    print(f"  interrupted? continue with: {resume}", file=sys.stderr)
    try:
        sweep.run_sweep(points, results, threads=args.threads, repeats=repeats,
                        memory=not args.quick, check=True, resume=True, progress=True,
                        max_point_s=QUICK_MAX_POINT_S if args.quick else MAX_POINT_S,
                        point_timeout_s=POINT_TIMEOUT_S)
    except ResultsFileError as exc:
        raise ReportError(f"refusing {results}: {exc}") from None
    except KeyboardInterrupt:
        print(f"\ninterrupted: the points measured so far are in {results}; continue with\n"
              f"  {resume}", file=sys.stderr)
        raise
    return results


def _asv_records(directory, history_benchmark):
    try:
        # import_module looks in sys.modules first, unlike `from . import`,
        # which would take the package attribute of an earlier import.
        asv_results = importlib.import_module("fastattn.report.asv_results")
    except ImportError as exc:
        raise ReportError(
            "--asv needs fastattn.report.asv_results (it comes with the asv suite) and it "
            f"cannot be imported here: {exc}") from None
    if not Path(directory).is_dir():
        raise ReportError(f"--asv {directory}: no such directory (asv writes its results to "
                          ".asv/results by default)")
    from ..bench.results import SCHEMA

    try:
        loaded = asv_results.load_asv_points(directory)
        history = (None if history_benchmark is None
                   else asv_results.load_asv_history(directory, history_benchmark))
    except (OSError, ValueError) as exc:   # asv_results.AsvResultsError is a ValueError
        raise ReportError(f"cannot read asv results in {directory}: {exc}") from None
    records = []
    for record in loaded:
        record = dict(record)
        record.setdefault("schema", SCHEMA)
        record.setdefault("record", "point" if "attention" in record else "environment")
        records.append(record)
    if not records:
        raise ReportError(f"no asv results found in {directory}")
    return records, history


def run(args):
    """Carry out ``fastattn report``; returns the exit code."""
    try:
        return _run(args)
    except ReportError as exc:
        print(f"fastattn report: error: {exc}", file=sys.stderr)
        return 2


def _run(args):
    if args.history is not None and args.asv is None:
        raise ReportError("--history needs --asv DIR")
    if args.minilm is not None:
        # Refuse a bad file before measuring, not after.
        from ..data import load_minilm

        try:
            load_minilm(args.minilm)
        except (OSError, ValueError) as exc:
            raise ReportError(f"--minilm: {exc}") from None
    if args.out is not None:
        _check_output(args.out, (args.from_, args.resume))
    history = None
    if args.asv is not None:
        records, history = _asv_records(args.asv, args.history)
        source = f"asv results in {args.asv}"
        out = args.out or REPORTS_DIR / f"fastattn-asv-{_timestamp()}.html"
    else:
        results = args.from_ if args.from_ is not None else _measure(args)
        records = _read_results(results)
        source = str(results)
        out = args.out or Path(results).with_suffix(".html")
    out = Path(out)
    _check_output(out, (args.from_, args.resume))

    from .build import build_report
    from .quality import compute_quality

    try:
        quality = compute_quality("auto" if args.minilm is None else args.minilm)
    except (OSError, ValueError) as exc:
        raise ReportError(f"quality section: {exc}") from None
    try:
        report = build_report(records, source=source, quality=quality, history=history,
                              history_benchmark=args.history)
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(report.html, encoding="utf-8")
    tmp.replace(out)
    images = [out.with_name(out.stem + "-scaling.png")]
    if args.readme_image is not None:
        images.append(args.readme_image)
    if report.scaling_png:
        for image in images:
            image.parent.mkdir(parents=True, exist_ok=True)
            image.write_bytes(report.scaling_png)
            print(f"scaling figure: {image}", file=sys.stderr)
    print(out)
    return 0
