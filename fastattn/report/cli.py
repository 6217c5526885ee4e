"""``fastattn report``: run the bench's sweep into ``reports/fastattn-<time>.jsonl``, then write
the HTML report beside it; ``--from`` only builds, ``--resume`` continues, ``--asv`` reads asv."""

import contextlib
import datetime as _dt
import importlib
import shlex
import signal
import sys
import zipfile
from pathlib import Path

from .._argtypes import positive_int, thread_count
from .._threads import default_num_threads
from ..bench import results as res, sweep
from ..bench.results import ResultsFileError, point_key
from ..bench.table import plural

DEFAULT_REPEATS = 5
#: Seconds of timed repeats a point may take (slower calls get fewer, never under 3).
MAX_POINT_S = 3.0
#: Rounds the backends of a shape take turns in: two keep the default report in 5 min on 2 cores.
ROUNDS = 2
#: A point still running after this long is recorded as an error.
POINT_TIMEOUT_S = 300.0
#: ``--quick``: a tiny grid for tests and CI (two points at n >= 1024 for every fit).
QUICK_NS = (128, 512, 1024, 2048)
QUICK_REPEATS, QUICK_MAX_POINT_S = 2, 0.5
REPORTS_DIR = Path("reports")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BESIDE = "the figure beside the report"


class ReportError(Exception):
    """A problem the user can fix (bad path, foreign file); printed without a traceback."""


def add_parser(subparsers):
    """Register ``fastattn report`` and its options."""
    parser = subparsers.add_parser(
        "report",
        help="measure time and memory against n, then write one self-contained HTML report",
        description="Measure softmax and linear attention (every backend and peer, causal and "
                    "not, d=64, float32, n 128 to 8192; the fast backends' non-causal "
                    "attention also at 16384, with every feature map) into a JSON-lines "
                    "results file, then write one self-contained HTML report (scaling, fits, "
                    "crossover, roof, quality, environment) and print its path.")
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group()
    no_measuring = "measuring (so without --n, --threads, --repeats or --quick)"
    source.add_argument("--from", dest="from_", metavar="RESULTS", type=Path,
                        help=f"build the report from this results file without {no_measuring}")
    source.add_argument("--resume", metavar="RESULTS", type=Path,
                        help="continue an interrupted run: measure only the points missing "
                             "from this results file, then build the report")
    source.add_argument("--asv", metavar="DIR", type=Path,
                        help="build the report from an asv results directory instead of "
                             f"{no_measuring}: the newest commit on asv.conf.json's branch")
    add("--asv-commit", metavar="REV",
        help="with --asv: the commit (a hash or its prefix) to report instead")
    add("--history", metavar="BENCHMARK",
        help="with --asv: also plot this benchmark across commits")
    add("--out", metavar="HTML", type=Path,
        help="where to write the report (default: beside the results file, under reports/)")
    add("--n", metavar="N", type=positive_int, nargs="+",
        help=f"sequence lengths to measure (default {' '.join(map(str, sweep.DEFAULT_NS))})")
    add("--threads", metavar="N", type=thread_count,
        help="threads for every backend and BLAS (default: the usable cores, or those "
             "other work leaves idle)")
    add("--repeats", metavar="R", type=positive_int,
        help=f"timed repeats per point (default {DEFAULT_REPEATS}, {QUICK_REPEATS} with "
             f"--quick; fewer for a call whose repeats would take over {MAX_POINT_S:g} s "
             f"({QUICK_MAX_POINT_S:g} s with --quick), never under 3 or R if smaller; more "
             f"for a fast one, timed for 0.25 s), the backends of one shape taking turns "
             f"over {ROUNDS} rounds")
    add("--quick", action="store_true",
        help=f"a tiny grid (n = {' '.join(map(str, QUICK_NS))}, {QUICK_REPEATS} repeats, no "
             "memory probe): for tests and CI")
    add("--readme-image", metavar="PNG", type=Path,
        help="also write the time-against-n figure to this PNG (a copy is always written "
             "beside the report)")
    add("--minilm", metavar="NPZ", type=Path,
        help="MiniLM activations for the quality section (default: the full set when found, "
             "else the shipped slice)")
    parser.set_defaults(func=run)
    return parser


@contextlib.contextmanager
def _as_report_error(prefix):
    """Turn the bench's ResultsFileError into a ReportError starting with ``prefix``."""
    try:
        yield
    except ResultsFileError as exc:
        raise ReportError(f"{prefix}{exc}") from None


def _check_folder(path, option):
    """Refuse a path the user gave whose folder does not exist: nothing makes it."""
    if path is not None and not path.parent.is_dir():
        raise ReportError(f"{option} {path}: the folder {path.parent} does not exist; create "
                          "it first, or give a path in an existing folder")


def _figure_beside(out):
    """The scaling figure written beside the report ``out``."""
    return out.with_name(out.stem + "-scaling.png")


def _check_output(out, results):
    """Refuse to write over anything that is not an earlier fastattn report, before any work."""
    from .build import REPORT_MARKER

    if results is not None and out.resolve() == Path(results).resolve():
        raise ReportError(f"--out {out} is the results file; choose another path for the report")
    if out.suffix.lower() not in (".html", ".htm"):   # rep.png would get HTML
        example = f", e.g. --out {out.with_suffix('.html')}" if out.name else ""
        raise ReportError(f"--out names the HTML report, got {str(out)!r}; give a name "
                          f"ending in .html{example}")
    res.check_replaceable(out, "report", REPORT_MARKER)
    _check_image(_figure_beside(out), BESIDE)


def _check_image(path, label="--readme-image"):
    """Refuse a figure path that cannot be written, or a file there that is not a PNG."""
    with _as_report_error(f"{label}: "):
        res.check_writable(path, "figure")
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as handle:
            if handle.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
                raise ReportError(f"{label} {path} exists and is not a PNG; not overwriting it")


def _check_args(args, out, results):
    """Refuse, before any work, options that do not go together and paths that cannot be used."""
    if (args.history or args.asv_commit) is not None and args.asv is None:
        raise ReportError(f"{'--history' if args.history else '--asv-commit'} needs --asv DIR")
    source_flag = "--from" if args.from_ is not None else "--asv" if args.asv is not None else None
    measuring = [flag for flag, value in (("--quick", args.quick or None), ("--n", args.n),
                                          ("--threads", args.threads),
                                          ("--repeats", args.repeats)) if value is not None]
    if source_flag and measuring:
        one = len(measuring) == 1
        raise ReportError(f"{', '.join(measuring)} set{'s' if one else ''} what is measured, "
                          f"and {source_flag} measures nothing: drop {'it' if one else 'them'}"
                          ", or measure with --resume RESULTS or without a source")
    if (image := args.readme_image) is not None:
        _check_image(image)
        _check_folder(image, "--readme-image")
        taken = {out: "the report", _figure_beside(out): BESIDE,
                 **({Path(results): "the results file"} if results is not None else {})}
        if what := next((what for path, what in taken.items()
                         if image.resolve() == path.resolve()), None):
            raise ReportError(f"--readme-image {image} is {what}; give the figure a path of "
                              "its own")
        if image.suffix.lower() != ".png":
            raise ReportError(f"--readme-image {image}: the figure is written as a PNG; give a "
                              "path ending in .png")
    if args.minilm is not None:   # an .npz of MiniLM activations
        from ..data import load_minilm

        if args.minilm.is_file() and not zipfile.is_zipfile(args.minilm):
            raise ReportError(f"--minilm {args.minilm}: not an .npz archive; --minilm expects "
                              "NumPy's .npz of MiniLM activations (arrays q, k, v), or leave it "
                              "out to use the slice shipped with fastattn")
        try:
            load_minilm(args.minilm)
        except (OSError, ValueError) as exc:
            raise ReportError(f"--minilm: {exc}") from None
    _check_output(out, results)
    _check_folder(args.out, "--out")
    if args.resume is not None:
        if not args.resume.exists():
            raise ReportError(f"--resume {results}: no such results file")
        _read_results(args.resume)
        with _as_report_error("--resume: "):
            res.check_writable(args.resume, "results file")


def _read_results(path):
    """The records of the results file ``path``, refusing a missing, unsound or empty one."""
    try:
        records = res.read_records(path)
    except FileNotFoundError as exc:
        if Path(path).is_dir():
            raise ReportError(f"{path} is a directory, not a results file: give the .jsonl "
                              "file that fastattn bench or fastattn report wrote") from None
        raise ReportError(str(exc)) from None
    except ResultsFileError as exc:
        advice = ("; repair or remove that line, or give another results file"
                  if isinstance(exc, res.CorruptLineError) else "")
        raise ReportError(f"refusing {path}: {exc}{advice}") from None
    if not records:
        raise ReportError(f"{path} holds no fastattn records (an empty results file)")
    return records


def sweep_points(ns, quick=False):
    """The report's grid of the bench's :class:`~fastattn.bench.sweep.Point`, d = 64: every
    backend and peer, softmax and linear, causal and not, at ``ns`` (default ``DEFAULT_NS``,
    :data:`QUICK_NS` if ``quick``); decode at ``DECODE_NS`` (or those); and, on the default
    grid, the fast backends' every feature map and non-causal softmax at ``FEATURE_MAP_NS``."""
    prefill = tuple(ns) if ns else (QUICK_NS if quick else sweep.DEFAULT_NS)
    decode = tuple(ns) if ns else (QUICK_NS if quick else sweep.DECODE_NS)
    fast = [b for b in sweep.default_backends(peers_too=False) if b != "reference"]
    return list(dict.fromkeys(  # the feature-map grid's elu points are on the main grid
        sweep.default_grid(ns=prefill) + sweep.default_grid(ns=decode, regime="decode")
        + ([] if ns or quick else sweep.feature_map_grid(fast) + sweep.default_grid(
            ("softmax",), fast, sweep.FEATURE_MAP_NS, (False,)))))


def _resume_command(args, results):
    """The command that finishes this run's grid, as the user invoked this one."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "fastattn"
    command = (f"{shlex.quote(sys.executable)} -m fastattn.cli"
               if argv0.endswith(".py") or argv0 in ("-c", "-m") else shlex.quote(argv0))
    options = [("--quick", args.quick), (f"--n {' '.join(map(str, args.n or ()))}", args.n),
               (f"--threads {args.threads}", args.threads),
               (f"--repeats {args.repeats}", args.repeats),
               (f"--out {shlex.quote(str(args.out))}", args.out)]
    return " ".join([command, "report", "--resume", shlex.quote(str(results))]
                    + [text for text, given in options if given])


def _threads(args, earlier):
    """The thread count of the run and why (the resumed file's, else the idle cores)."""
    if args.threads is not None:
        return args.threads, "as asked (--threads)"
    threads = next((r["threads"] for r in earlier if r["record"] == "point"), None)
    if threads is not None:   # finish the grid on its own threads
        first = next((r["threads_reason"] for r in earlier if r["record"] == "environment"
                      and r.get("threads_reason")), None)
        return threads, (f"{first} (when the resumed run started)" if first
                         else "the thread count of the resumed results file")
    threads, cores = sweep.idle_cores(), default_num_threads()
    if threads >= cores:
        return threads, f"every usable core ({cores})"
    why = (f"other work kept {cores - threads} of {cores} cores busy when the run started, so "
           f"it measured on the {plural(threads, 'idle one')}: no kernel waits for a thread "
           "the scheduler put aside (--threads N to choose)")
    print(f"fastattn report: {why}", file=sys.stderr)
    return threads, why


def _measure(args, results):
    """Run (or resume) the bench's sweep of :func:`sweep_points` into ``results``."""
    repeats = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    resume = _resume_command(args, results)

    def announce(todo, done):
        print(f"fastattn report: measuring {todo} points into {results}"
              + (f" ({done} already there)" if done else "")
              + f" ({repeats} timed repeats each, more for fast calls, fewer for slow ones"
              + f"{'; quick grid' if args.quick else ''})", file=sys.stderr)
        print(f"  interrupted? continue with: {resume}", file=sys.stderr)

    earlier = _read_results(results) if args.resume is not None else []
    threads, why = _threads(args, earlier)
    points = sweep_points(args.n, args.quick)
    grid = {point_key(p.record_fields(threads)) for p in points}
    if foreign := [r for r in earlier if r["record"] == "point" and point_key(r) not in grid]:
        r = foreign[0]   # a file of another grid is not finished by this one
        raise ReportError(
            f"--resume {results}: it holds {plural(len(foreign), 'point')} outside this run's "
            f"grid (e.g. {r['attention']} n={r['n_k']} {r['backend']}), so it was measured "
            "with other options (--quick, --n, --threads); resume it with the options it was "
            "started with, or give a new results file")
    options = sweep.Options(repeats=repeats, rounds=ROUNDS, memory=not args.quick,
                            max_point_s=QUICK_MAX_POINT_S if args.quick else MAX_POINT_S,
                            point_timeout_s=POINT_TIMEOUT_S)
    try:
        with _as_report_error(f"refusing {results}: "):
            sweep.run_sweep(points, results, options, threads=threads, threads_reason=why,
                            progress="fastattn report", announce=announce)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the points measured so far are in {results}; continue with\n"
              f"  {resume}", file=sys.stderr)
        raise
    except OSError as exc:   # a full disk while writing a point
        raise ReportError(f"{exc.strerror or exc}: the points written before it are in "
                          f"{results}; free space and continue with\n  {resume}") from None


def _asv_records(args):
    """The records, history and source text of ``--asv`` (the asv adapter's)."""
    try:   # import_module looks in sys.modules first, unlike `from . import`
        asv_results = importlib.import_module("fastattn.report.asv_results")
    except ImportError as exc:
        raise ReportError("--asv needs fastattn.report.asv_results, which cannot be imported "
                          f"here: {exc}") from None
    directory = args.asv
    if not directory.is_dir():
        why = (" is a file; --asv expects an asv results directory" if directory.is_file()
               else ": no such directory")
        raise ReportError(f"--asv {directory}{why} (asv writes its results to .asv/results by "
                          "default)")
    try:
        records = asv_results.load_asv_points(directory, commit=args.asv_commit)
        history = (None if args.history is None
                   else asv_results.load_asv_history(directory, args.history))
    except (OSError, ValueError) as exc:   # asv_results.AsvResultsError is a ValueError
        raise ReportError(f"cannot read asv results in {directory}: {exc}") from None
    if not records:
        raise ReportError(f"no asv results found in {directory}")
    envs = [r for r in records if r.get("record") == "environment"]
    chosen = "; ".join(dict.fromkeys(f"{r.get('machine')}: {r['chosen']}" for r in envs
                                     if r.get("chosen")))
    print(f"fastattn report: {chosen}", file=sys.stderr)
    left_out = [text for r in envs for text in r.get("left_out") or ()]
    for text in left_out:
        print(f"fastattn report: note: {text}", file=sys.stderr)
    return records, history, f"asv results in {directory}; {chosen}" + (
        "; benchmarks whose parameters cannot be placed are left out (listed under "
        "Environment)" if left_out else "")


def run(args):
    """Carry out ``fastattn report``; returns the exit code."""
    try:
        return _run(args)
    except (ReportError, ResultsFileError) as exc:
        print(f"fastattn report: error: {exc}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _noting_interrupts():
    """Yield a function saying whether Ctrl-C came inside (the handler in place still runs), so
    the caller can raise one that matplotlib turned into its error or a finalizer lost."""
    seen, hook, previous = [], sys.unraisablehook, signal.getsignal(signal.SIGINT)

    def unraisable(info):
        if not (seen and isinstance(info.exc_value, KeyboardInterrupt)):
            hook(info)

    def note(signum, frame):
        seen.append(signum)
        previous(signum, frame)

    installed = callable(previous)   # SIG_IGN and SIG_DFL are left be
    try:
        if installed:
            signal.signal(signal.SIGINT, note)
    except ValueError:   # outside the main thread no handler can be set
        installed = False
    sys.unraisablehook = unraisable
    try:
        yield lambda: bool(seen)
    finally:
        if installed:
            signal.signal(signal.SIGINT, previous)
        if sys.unraisablehook is unraisable:
            sys.unraisablehook = hook


def model_study_path(results):
    """Where the whole-model study of a report's run is kept: beside its results file."""
    return Path(results).with_suffix(".model.json")


def _model_study(args, records, results):
    """The section "What a whole model keeps" (fastattn.model.study), or why it is not there:
    measured with the model extra and kept at :func:`model_study_path`, which --from reads."""
    from ..model import MissingExtraError
    from ..model.study import ModelStudy, report_study

    if args.asv is not None:
        return "a report of asv results holds no whole-model study."
    path = model_study_path(results)
    if args.from_ is not None:
        try:
            return ModelStudy.from_json(path.read_text())
        except FileNotFoundError:
            return (f"the run of {Path(results).name} kept no whole-model study ({path.name}): "
                    'fastattn report measures it when the model extra is installed (in the '
                    'checkout of fastattn: pip install -e ".[model]").')
        except (OSError, ValueError) as exc:
            raise ReportError(f"{path}: {exc}") from None
    threads = next((r["threads"] for r in records if r["record"] == "point"), None)
    try:
        print("fastattn report: what a whole model keeps (MiniLM, each attention)",
              file=sys.stderr)
        study = report_study(quick=args.quick, threads=threads or default_num_threads())
    except MissingExtraError as exc:
        print(f"fastattn report: note: the whole-model section is left out: {exc}",
              file=sys.stderr)
        return ('the model extra is not installed; in the checkout of fastattn: '
                'pip install -e ".[model]".')
    res.atomic_write(path, study.to_json())
    return study


def _run(args):
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    results = None if args.asv is not None else (
        args.from_ or args.resume or REPORTS_DIR / f"fastattn-{stamp}.jsonl")
    out = args.out or (REPORTS_DIR / f"fastattn-asv-{stamp}.html" if results is None
                       else Path(results).with_suffix(".html"))
    _check_args(args, out, results)   # before measuring, whichever way out was named
    if args.asv is not None:
        records, history, source = _asv_records(args)
    else:
        if args.from_ is None:
            _measure(args, results)
        records, history, source = _read_results(results), None, str(results)
        if args.from_ is not None and (cut := res.cut_tail_bytes(results)):
            print(f"fastattn report: note: the last line of {results} was cut short by an "
                  f"interrupted write; its {plural(cut, 'byte')} {'is' if cut == 1 else 'are'} "
                  "left out of the report", file=sys.stderr)
    _check_output(out, results)

    from ..map_quality import compute_quality
    from .build import build_report

    model = _model_study(args, records, results)
    with _noting_interrupts() as interrupted:
        try:
            quality = compute_quality("auto" if args.minilm is None else args.minilm)
            report = build_report(records, source=source, quality=quality, history=history,
                                  history_benchmark=args.history, model=model)
        except (OSError, ValueError) as exc:
            if interrupted():   # Ctrl-C inside matplotlib's C code comes out as its ValueError
                raise KeyboardInterrupt from None
            raise ReportError(str(exc)) from None
        if interrupted():   # Ctrl-C lost on the way (in a finalizer: "Exception ignored")
            raise KeyboardInterrupt
    out.parent.mkdir(parents=True, exist_ok=True)   # REPORTS_DIR, the default
    res.atomic_write(out, report.html)
    beside = _figure_beside(out)
    for image in [beside] + ([args.readme_image] if args.readme_image else []):
        try:   # again for --readme-image: the file may have changed while measuring
            _check_image(image, BESIDE if image is beside else "--readme-image")
            res.atomic_write(image, report.scaling_png)
        except (OSError, ResultsFileError, ReportError) as exc:
            raise ReportError(f"the report is written ({out}), but not the figure {image}: "
                              f"{exc}") from None
        print(f"scaling figure: {image}", file=sys.stderr)
    print(out)
    return 0
