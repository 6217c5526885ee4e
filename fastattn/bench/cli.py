"""``fastattn bench``: every kernel side by side with its peers and the machine's roof."""

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from .. import _api
from .._argtypes import positive_int, thread_count
from .._threads import default_num_threads
from ..feature_maps import NAMES as FEATURE_MAPS
from . import limits, peers, sweep, table
from .results import ResultsFileError, check_writable, point_key, read_records
from .schema import ATTENTIONS, DECODE_NS, DEFAULT_NS, DTYPES, REGIMES
from .table import SIDE_FILES, plural


def add_parser(subparsers):
    """Register ``fastattn bench`` and its options."""
    parser = subparsers.add_parser(
        "bench", help="time every kernel side by side with its peers and the GEMM roof",
        description="Measure attention on every available backend and peer over a grid of n: "
                    "time (median, min-max), GFLOP/s and % of the GEMM roof (also paired with "
                    "the roof's GEMM timed each round), peak extra memory, the ratio to a "
                    "baseline and the error against the float64 reference, appended to a "
                    "JSON-lines file as each point finishes (the same --out resumes).")
    add = parser.add_argument
    add("--kind", nargs="+", choices=ATTENTIONS + ("both",), default=["both"],
        help="attention type(s) (default both)")
    add("--backends", nargs="+", metavar="NAME",
        help="backends and peers to measure (default: every available one)")
    add("--regime", nargs="+", choices=REGIMES, default=["prefill"],
        help="prefill: a whole sequence, n_q = n_k = n; decode: one generated token, one "
             "query against n keys (causal) (default prefill)")
    add("--n", nargs="+", type=positive_int, metavar="N",
        help=f"sequence lengths (default {' '.join(map(str, DEFAULT_NS))}; decode: "
             f"{' '.join(map(str, DECODE_NS))})")
    add("--shape", nargs="+", type=shape_arg, metavar="[KIND:][REGIME:]BxHxNxD",
        help="shapes, e.g. 1x8x2048x64 (batch x heads x n x d_k), overriding --batch, "
             "--heads, --n and --d-k, in every --regime and --kind or in the one prefixed "
             "(decode:1x8x32768x64, linear:1x8x16384x64); in decode N is the context n_k")
    add("--d-k", type=positive_int, default=64, help="key head dim (default 64)")
    add("--d-v", type=positive_int, default=None, help="value head dim (default: d_k)")
    add("--batch", type=positive_int, default=1, help="batch size (default 1)")
    add("--heads", type=positive_int, default=1, help="heads (default 1)")
    add("--dtype", nargs="+", choices=DTYPES, default=["float32"],
        help="dtype(s) (default float32)")
    add("--causal", choices=("yes", "no", "both"), default="both",
        help="causal mask (default both)")
    add("--feature-map", nargs="+", choices=FEATURE_MAPS, default=[FEATURE_MAPS[0]],
        help=f"feature map(s) of linear attention (default {FEATURE_MAPS[0]})")
    add("--num-features", nargs="+", type=positive_int, metavar="M",
        help="FAVOR+ feature counts m, with --feature-map favor (default: FavorFeatures')")
    add("--threads", nargs="+", type=thread_count, default=None, metavar="N",
        help="threads for every backend, BLAS and peer (default: usable cores); several "
             "(--threads 1 2) measure every point at each")
    add("--repeats", type=positive_int, default=5, metavar="R",
        help="timed repeats per point after a warm-up (default 5; fewer if they would take "
             "over 5 s, never under 3 or R if smaller; a fast call is repeated for 0.25 s, "
             "up to 100 times); the backends of a shape take turns over R rounds (a call "
             "under 50 ms starts each turn with 10 ms of untimed calls)")
    add("--baseline", default=None, metavar="NAME",
        help="backend the ratio column compares with (default reference)")
    add("--out", type=Path, default=None,
        help="results file (JSON lines; default results/bench-<time>.jsonl; resumed if it "
             "exists), with a CSV (.csv), JSON summary (.summary.json) and Markdown table "
             "(.md) of this command's points beside it")
    add("--fresh", action="store_true", help="start --out afresh instead of resuming it")
    add("--no-memory", action="store_true", help="skip the memory probe")
    add("--no-check", action="store_true", help="skip the check against the float64 reference")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--versus", type=Path, metavar="RESULTS",
        help="instead of the sweep: print the best fastattn / best peer table and the roof "
             "of the results file RESULTS")
    add("--startup", action="store_true",
        help="instead of the sweep: time import fastattn, set_num_threads and a first call "
             "beyond import numpy in --repeats new processes per backend (--backends, "
             "default all and auto)")
    parser.set_defaults(func=run)
    return parser


def shape_arg(text):
    """argparse type: ``[KIND:][REGIME:]BxHxNxD`` (prefixes in either order) as ``(batch,
    heads, n, d_k, regime, kind)``, regime and kind None where not given."""
    *prefixes, dims = text.lower().split(":")
    try:
        values = tuple(positive_int(p) for p in dims.replace("×", "x").split("x"))
    except argparse.ArgumentTypeError:
        values = ()
    regimes = [p for p in prefixes if p in REGIMES]
    kinds = [p for p in prefixes if p in ATTENTIONS]
    unknown = [p for p in prefixes if p not in REGIMES + ATTENTIONS]
    why = (f"{unknown[0]!r} is neither a regime ({', '.join(REGIMES)}) nor an attention "
           f"({', '.join(ATTENTIONS)})" if unknown else
           "more than one regime" if len(regimes) > 1 else
           "more than one attention" if len(kinds) > 1 else
           f"{dims!r} is not four positive integers" if len(values) != 4 else None)
    if why:
        raise argparse.ArgumentTypeError(
            f"{why}: expected [KIND:][REGIME:]BxHxNxD, four positive integers (batch x heads "
            f"x n x d_k, e.g. 1x8x2048x64) after at most one regime (e.g. "
            f"decode:1x8x32768x64) and one attention (e.g. linear:1x8x16384x64), got {text!r}")
    return values + ((regimes or [None])[0], (kinds or [None])[0])


class BenchUsageError(ValueError):
    """A bad combination of options (exit code 2, message on stderr)."""


def backend_names(requested, known=None, available=()):
    """The names of ``--backends`` (split by commas too), once each, or None when not given;
    BenchUsageError for none, or (given ``known``) one unknown or not ``available``."""
    if requested is None:
        return None
    names = list(dict.fromkeys(n.strip() for item in requested for n in item.split(",")
                               if n.strip()))
    if not names:
        raise BenchUsageError(f"--backends names no backend (got {' '.join(map(repr, requested))})"
                              "; give names such as: --backends numba cython torch")
    if known is None:
        return names
    here, absent = f"available here: {', '.join(available)}", peers.absent_peers()
    gone = ", ".join(sorted(set(known) - set(available)))
    for name in names:
        if name not in known:
            raise BenchUsageError(f"unknown backend {name!r}; {here}"
                                  + (f" (known but absent: {gone})" if gone else ""))
        if name in absent:
            raise BenchUsageError(f"peer {name!r} is not installed ({here}); add it, in the "
                                  f"fastattn checkout, with: {absent[name]}")
        if name not in available:
            reason = _api.unavailable_backends().get(name, "not available")
            raise BenchUsageError(f"backend {name!r} cannot run here ({reason}); {here}")
    return names


def _out(args, kind):
    """``--out`` (refused when its folder is missing), or ``results/<kind>-<time>.jsonl``."""
    if args.out is None:
        return Path("results") / time.strftime(f"{kind}-%Y%m%d-%H%M%S.jsonl")
    check_writable(args.out, "results file")
    if not args.out.parent.is_dir():
        raise BenchUsageError(f"--out {args.out}: the folder {args.out.parent} does not exist; "
                              "create it, or give --out a file in an existing folder")
    return args.out


def run(args):
    """Run ``fastattn bench`` with parsed ``args``; return the exit code."""
    try:
        if args.versus:
            return print_versus(args.versus)
        if not args.startup:
            return _run(args)
        from .startup import run_startup, startup_backends
        try:
            backends = startup_backends(backend_names(args.backends))
        except ValueError as exc:
            raise BenchUsageError(str(exc)) from None
        return run_startup(args, _out(args, "startup"), backends)
    except (BenchUsageError, ResultsFileError) as exc:
        print(f"fastattn bench: error: {exc}", file=sys.stderr)
        return 2


def print_versus(path):
    """``fastattn bench --versus RESULTS``: the versus table and the roof of a results file."""
    if path.is_dir():
        raise BenchUsageError(f"--versus {path} is a directory; a results file (the JSON "
                              "lines a run writes, e.g. results/bench-<time>.jsonl) was expected")
    try:
        records = read_records(path)
    except FileNotFoundError as exc:
        raise BenchUsageError(str(exc)) from None
    rows = table.versus_rows([r for r in records if r["record"] == "point"])
    if not any(r["peer"] for r in rows):
        raise BenchUsageError(f"{path} holds no point of a peer beside a fastattn backend")
    probes = [r for r in records if r["record"] == "roof"]
    print(table.format_versus(rows, table.roof_statements(probes)))
    if limit_text := limits.statements(probes):
        print("\nlimits (probed in the run, on the same threads):\n  " + "\n  ".join(limit_text))
    return 0


def _plan(args):
    """``(points, out, backends, baseline, absent peers)``; refuses first what cannot be written."""
    available = sweep.default_backends()
    backends = backend_names(args.backends, sweep.known_backends(), available) or available
    absent = {} if args.backends else peers.absent_peers()  # peers not asked for: not news
    baseline = args.baseline or ("reference" if "reference" in backends else backends[0])
    if baseline not in backends:
        raise BenchUsageError(
            f"--baseline {baseline!r} is not among the measured backends: {', '.join(backends)}")
    out = _out(args, "bench")
    # Any case: X.MD and X.md are one file on a case-insensitive filesystem.
    if beside := next((s for s, _, _ in SIDE_FILES.values() if out.name.lower().endswith(s)),
                      None):  # the results file would be overwritten by its own side file
        stem = out.name[:-len(beside)]
        raise BenchUsageError(
            f"--out names the JSON-lines results file, got {out}: a {beside} file is written "
            f"beside it; give e.g. --out "
            f"{out.with_name(stem if stem.endswith('.jsonl') else stem + '.jsonl')}")
    try:
        if out.exists():
            read_records(out)
    except ResultsFileError as exc:
        raise ResultsFileError(
            f"{exc}; --out resumes this file (--fresh replaces it), and neither is done to a "
            "file that is not sound: repair or remove that line, or give another --out") from None
    for kind, (suffix, _, _) in SIDE_FILES.items():
        if (side := out.with_suffix(suffix)).is_dir():   # check_target would advise a file in it
            raise ResultsFileError(f"--out {out} writes its {kind} beside it, at {side}, which "
                                   "is a directory; give another --out")
        table.check_target(side, kind)
    if args.num_features and "favor" not in args.feature_map:
        raise BenchUsageError("--num-features sets FAVOR+'s m: give --feature-map favor too")
    shapes = args.shape or [(args.batch, args.heads, None, args.d_k, None, None)]
    kinds = tuple(k for k in ATTENTIONS if k in args.kind or "both" in args.kind)
    points = list(dict.fromkeys(  # softmax points are the same for every feature map
        p for batch, heads, n, d_k, regime_of, kind_of in dict.fromkeys(shapes)
        for regime in ([regime_of] if regime_of else args.regime)
        for fmap in args.feature_map
        for m in (args.num_features or [None] if fmap == "favor" else [None])
        for p in sweep.default_grid(
            attentions=(kind_of,) if kind_of else kinds, backends=backends,
            ns=(n,) if n else sorted(set(args.n or (DECODE_NS if regime == "decode"
                                                     else DEFAULT_NS))),
            d_k=d_k, d_v=args.d_v or d_k, batch=batch, heads=heads,
            causal={"yes": (True,), "no": (False,), "both": (False, True)}[args.causal],
            dtype=args.dtype, feature_map=fmap, regime=regime, num_features=m)))
    measured = {p.backend for p in points}
    idle = [next((why for kind in kinds for regime in args.regime for fmap in args.feature_map
                  if (why := peers.why_not(name, kind, regime=regime,
                                           feature_map=fmap if kind == "linear" else None))),
                 f"{name} has no call for these points")
            for name in backends if name not in measured]   # a peer without the call
    if not points:
        raise BenchUsageError("nothing to measure: " + "; ".join(idle))
    notes = [f"{why}, so it is not measured" for why in idle] + [note for given, note in (
        (args.shape and args.n, "--shape sets n for its points; --n is ignored"),
        (args.causal == "no" and any(p.regime == "decode" for p in points),
         "a decode point is causal (its query is the newest token); --causal no applies to the "
         "prefill points only"),
        (kinds == ("softmax",) and args.feature_map != ["elu"],
         "--feature-map applies to linear attention; --kind softmax ignores it"),
        (any(kind_of not in (None, *kinds) for *_, kind_of in shapes),
         "a --shape prefixed with its kind (linear:..., softmax:...) measures that kind "
         "whatever --kind says")) if given]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return points, out, backends, baseline, absent


def _run(args):
    points, out, backends, baseline, absent = _plan(args)
    for name, hint in absent.items():
        print(f"{name} is not installed, so it is not compared; add it, in the fastattn "
              f"checkout, with: {hint}")
    options = sweep.Options(repeats=args.repeats, memory=not args.no_memory,
                            check=not args.no_check)
    run_id, records, resume = sweep.new_run_id(), [], not args.fresh
    resumed = resume and out.is_file() and out.stat().st_size > 0

    def announce(todo, done):
        if resumed and done:
            on = f" on {plural(threads, 'thread')}" if threads else ""
            print(f"fastattn bench: resuming {out}: {done} of this command's {todo + done} "
                  f"points{on} are there already and are kept, not measured again; measuring "
                  f"the other {todo} (--fresh starts the file afresh)", file=sys.stderr)

    try:
        for threads in dict.fromkeys(args.threads or [None]):  # one sweep per thread count
            records += sweep.run_sweep(points, out, options, threads=threads, resume=resume,
                                       threads_reason="as asked (--threads)" if threads else None,
                                       progress=None if args.no_progress else "fastattn bench",
                                       run_id=run_id, announce=announce)
            resume = True  # the next thread count adds to this run's file
    except OSError as exc:   # a full disk while writing a point: said, with the file
        print(f"\nfastattn bench: {exc.strerror or exc}: the points written before it are in "
              f"{out} (a cut last line is dropped when it is read); to measure the rest, free "
              f"space and run the same command with --out {shlex.quote(str(out))}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:   # Ctrl-C, or SIGTERM while measuring (Terminated)
        try:
            kept = out.exists() and any(r["record"] == "point" for r in read_records(out))
        except (OSError, ResultsFileError):
            kept = True
        terminated = isinstance(exc, sweep.Terminated)
        where = f"the points measured so far are in {out}" if kept else "no point was measured yet"
        print(f"\n{'terminated (SIGTERM)' if terminated else 'interrupted'}: {where}; to measure "
              f"the rest, run the same command with --out {shlex.quote(str(out))}"
              + (" and without --fresh" if args.fresh else ""), file=sys.stderr)
        return 128 + signal.SIGTERM if terminated else 130
    print("\n" + table.format_tables(records, baseline=baseline, backend_order=backends))
    runs, stored = {r.get("run_id") for r in records}, read_records(out)
    probes = [r for r in stored if r.get("record") == "roof" and r.get("run_id") in runs]
    if roof_text := table.roof_statements(probes):
        print("\nroof (the GEMM probed in this run, on the same threads):\n  "
              + "\n  ".join(roof_text))
    if limit_text := limits.statements(probes):
        print("\nlimits (probed in this run, on the same threads):\n  " + "\n  ".join(limit_text))
    if far := table.far_above_roof(records):
        print(f"\nwarning: {len(far)} point(s) ran at more than {table.FAR_ABOVE_ROOF:g}x the "
              "GEMM roof probed beside them: the probe was most likely slowed by other work "
              "(each probe's load is in the results file), so their % roof means little; "
              "measure again on a quiet machine.", file=sys.stderr)
    rows = table.versus_rows(records)
    if any(r["peer"] for r in rows):
        print("\n" + table.format_versus(rows))
    load = max((r["load_avg_1m"] for r in records if r.get("load_avg_1m") is not None),
               default=0)
    if load > (cores := default_num_threads()):
        print(f"\nnote: the machine was busy while measuring (1-minute load average up to "
              f"{load:.1f} on {cores} usable cores): times are noisy; compare the ratios "
              "measured side by side in one run (and the min column), and repeat."
              + (" With more threads than idle cores, multi-threaded BLAS and OpenMP wait "
                 "for descheduled threads: --threads 1 gives steadier numbers."
                 if max(args.threads or [cores]) > 1 else ""))
    if mismatched := sum(r.get("check_ok") is False for r in records):
        print(f"\n{mismatched} point(s) disagree with the float64 reference (MISMATCH).")
    csv_path = table.write_csv(records, out.with_suffix(".csv"))
    summary_path = table.write_summary(records, out.with_suffix(".summary.json"), baseline,
                                       backends)
    table_path = table.write_versus_markdown(rows, out.with_suffix(".md"), roof_text)
    print(f"\nresults: {out}\ncsv:     {csv_path}\nsummary: {summary_path}\n"
          f"table:   {table_path}")
    mine = {point_key(r) for r in records}
    if others := sum(r.get("record") == "point" and point_key(r) not in mine for r in stored):
        print(f"note: {out} also holds {others} point(s) of earlier commands with other "
              "options; the csv, summary and table above are this command's points only "
              "(every point stays in the results file)")
    return 0
