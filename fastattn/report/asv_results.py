"""The adapter from asv's results to fastattn's records: an environment record per machine
and a point record (:data:`~fastattn.bench.schema.POINT_FIELDS`) per combination, which the
report reads as it reads a results file.

asv 0.6 keeps ``benchmarks.json``, ``<machine>/machine.json`` and per commit
``<machine>/<commit8>-<env>.json``: a row per benchmark in ``result_columns`` order, a
value per combination of ``itertools.product(*params)`` (NaN: skipped, null: failed)."""

import ast
import contextlib
import datetime
import itertools
import json
import math
import re
import subprocess
from pathlib import Path

from ..bench.engine import point_flops
from ..bench.results import SCHEMA, is_number
from ..bench.schema import (ASV_BATCH, ASV_D, ASV_DECODE_HEADS as SUITE_DECODE_HEADS,
                            ASV_HEADS, POINT_FIELDS, point_key)
from ..bench.sweep import Point
from ..bench.table import plural

#: The suite's feature map of each attention (asv results do not carry it).
SUITE_FEATURE_MAP = {"softmax": None, "linear": "elu"}
#: asv benchmark method -> the point field it fills.
_METHOD_FIELDS = {"time_forward": "median_s", "time_token": "median_s",
                  "track_peak_bytes": "peak_bytes", "track_max_abs_error": "max_abs_err",
                  "track_bytes_per_head": "held_bytes"}
#: Modules of the suite whose benchmarks are points (benchmarks/).
POINT_MODULES = ("softmax", "linear", "decode", "feature_maps")
_THREADS_BENCHMARK, _VERSIONS_BENCHMARK = ("threads.Threads.track_threads",
                                           "threads.Versions.track_version")
#: The suite's default bound on n of the quadratic reference kernels (benchmarks/common.py
#: REFERENCE_MAX_N), which FASTATTN_ASV_REFERENCE_MAX_N in a run's env_vars overrides.
SUITE_REFERENCE_MAX_N = 4096
#: Why asv skipped a combination (NaN) when nothing more is known (FASTATTN_ASV_QUICK is not kept).
SKIPPED_BY_SUITE = "skipped by the asv suite (its quick grid, or a combination it does not run)"
_STATS = ("stats_q_25", "stats_q_75", "samples")
#: The order of a file's points.
_ORDER = ("attention", "regime", "feature_map", "num_features", "heads", "backend", "causal",
          "dtype", "n_k")


class AsvResultsError(ValueError):
    """A directory that is not an asv results directory, or a file asv did not write."""


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise AsvResultsError(f"cannot read asv file {path}: {exc}") from None


def _decode_param(text):
    """An asv parameter repr (``"'reference'"``, ``"256"``, ``"causal=True"``) as a Python value."""
    name, sep, value = str(text).partition("=")
    value = value if sep and name.isidentifier() else text
    try:
        return int(value) if value.isdigit() else ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return text


def _run(machine, data):
    """A result file's machine, commit, ISO date (asv's is ms since the epoch, UTC) and env."""
    ms = data.get("date")
    return {"machine": machine, "commit": data.get("commit_hash"), "date": None if ms is None
            else datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc).isoformat(),
            "env_name": data.get("env_name")}


def _count(value):
    return int(value) if str(value).isdigit() or is_number(value) and value == int(value) \
        else None


def _machines(results_dir):
    """``root, benchmarks.json or {}, [(machine, machine.json, [(data, path) oldest first])]``."""
    root = Path(results_dir)
    if not root.is_dir():
        raise AsvResultsError(f"no asv results directory at {root}")
    folders = sorted(p for p in root.iterdir() if (p / "machine.json").is_file())
    if not folders:
        raise AsvResultsError(f"{root} holds no asv machine directory (<machine>/machine.json); "
                              "run `asv run` first, or pass asv's results_dir (.asv/results)")
    meta = _read_json(root / "benchmarks.json") if (root / "benchmarks.json").is_file() else {}
    machines = []
    for folder in folders:
        runs = [(_read_json(path), path) for path in sorted(folder.glob("*.json"))
                if path.name != "machine.json"]
        for data, path in runs:
            if not isinstance(data, dict) or "results" not in data or "commit_hash" not in data:
                raise AsvResultsError(f"{path} is not an asv result file (no results/commit_hash)")
        runs.sort(key=lambda run: (run[0].get("date") or 0, run[1].name))
        machines.append((folder.name, _read_json(folder / "machine.json"), runs))
    return root, {k: v for k, v in meta.items() if isinstance(v, dict)}, machines


def _rows(data, name, meta):
    """``(rows, why)`` of benchmark ``name``: ``(params, value, stats)`` per combination (a
    missing value None, ``stats["failed"]`` True for asv's null, False for NaN), and why
    benchmarks.json cannot name its parameters (then ``param1``, ... by position)."""
    row = data["results"].get(name)
    cells = dict(zip(data.get("result_columns") or ["result", "params"], row)) \
        if isinstance(row, list) else {}
    param_lists = cells.get("params") or []
    names = (meta.get(name) or {}).get("param_names")
    why = ("benchmarks.json is missing, so nothing names their parameters" if not meta
           else "benchmarks.json does not describe them" if names is None
           else "their parameters are not the ones benchmarks.json gives (a result file of "
                "another version of the suite)" if len(names) != len(param_lists) else None)
    names = [f"param{i + 1}" for i in range(len(param_lists))] if why else names
    values = cells.get("result") if isinstance(cells.get("result"), list) else [cells.get("result")]
    rows = []
    for i, combo in enumerate(itertools.product(*param_lists) if row is not None else ()):
        value = values[i] if i < len(values) else None
        stats = {c: cells[c][i] for c in _STATS if isinstance(cells.get(c), list)
                 and i < len(cells[c])}
        if not (is_number(value) and math.isfinite(value)):
            value, stats["failed"] = None, value is None
        rows.append(({p: _decode_param(v) for p, v in zip(names, combo)}, value, stats))
    return rows, why


def _by_param(data, name, meta, param):
    return {p[param]: v for p, v, _ in _rows(data, name, meta)[0]
            if v is not None and param in p}


def _environment_record(info, data, meta, run, counts, threads, chosen):
    """An environment record; key names follow fastattn.bench.environment.collect()."""
    codes = {lib: round(value * 1e6) for lib, value in
             _by_param(data, _VERSIONS_BENCHMARK, meta, "library").items()}
    versions = {lib: f"{c // 10**6}.{c // 1000 % 1000}.{c % 1000}" for lib, c in codes.items()}
    return {"schema": SCHEMA, "record": "environment", **run, "git_commit": run["commit"],
            "cpu_model": info.get("cpu"), "arch": info.get("arch"), "platform": info.get("os"),
            "cores_logical": _count(info.get("num_cpu")),
            "memory_total_bytes": _count(info.get("ram")), "python": data.get("python"),
            "versions": {**(data.get("requirements") or {}), **versions},
            "env_vars": data.get("env_vars") or {}, "threads": threads, "thread_counts": counts,
            "chosen": chosen}


def _fields(module, cls, params):
    """The :class:`Point` fields of a benchmark's combination, or None if Point refuses it."""
    regime = "decode" if module == "decode" else "prefill"
    attention = params.get("attention") if regime == "decode" else module
    fmap, m = SUITE_FEATURE_MAP.get(attention), None
    if module == "feature_maps":
        attention, fmap = "linear", "favor" if cls == "Favor" else params.get("feature_map")
        m = params.get("m") if cls == "Favor" else None
    try:
        return Point(attention, params.get("backend"),
                     True if regime == "decode" else params.get("causal"), params.get("n"),
                     ASV_D, ASV_D, ASV_BATCH, SUITE_DECODE_HEADS if regime == "decode"
                     else ASV_HEADS, params.get("dtype"), fmap, regime, m).record_fields()
    except (TypeError, ValueError):
        return None


def _points_of(data, meta, run, threads):
    """The point records of one result file, and ``{why: [benchmark, ...]}`` of those left out."""
    points, unplaced = {}, {}
    for name in sorted(data["results"]):
        module, _, rest = name.partition(".")
        field = _METHOD_FIELDS.get(name.rsplit(".", 1)[-1])
        if field is None or module not in POINT_MODULES:
            continue
        rows, why = _rows(data, name, meta)
        for params, value, stats in [] if why else rows:
            fields = _fields(module, rest.partition(".")[0], params)
            if fields is None:
                why = ("a combination without a backend or an n, or an attention the report "
                       "does not know")
                continue
            key = point_key(fields)
            if key not in points and value is None and field == "max_abs_err":
                continue  # a point only for a skipped accuracy check is noise
            point = points.setdefault(key, {
                "schema": SCHEMA, "record": "point", **dict.fromkeys(f for f, *_ in POINT_FIELDS),
                **fields, "threads": threads, "flops": point_flops(fields),
                "memory_method": "rss-hwm", **run, "benchmarks": {}, "failed": []})
            if value is None:
                point["failed"] += [name] if stats["failed"] else []
                continue
            point[field], point["benchmarks"][field] = value, name
            if field == "median_s":
                point.update(q25_s=stats.get("stats_q_25"), q75_s=stats.get("stats_q_75"))
                if isinstance(samples := stats.get("samples"), list) and samples:
                    point.update(times_s=samples, min_s=min(samples), max_s=max(samples))
        if why:
            unplaced.setdefault(why, set()).add(name)
    values = list(_METHOD_FIELDS.values())
    measured = {p["backend"] for p in points.values() if any(p[f] is not None for f in values)}
    for point in points.values():
        failed = point.pop("failed")
        if failed:
            point.update(status="error", reason=f"failed in asv: {', '.join(failed)} "
                                                "(see the asv run log)")
        elif any(point[f] is not None for f in values):
            point["status"] = "ok"
        else:
            point.update(status="skipped", reason=_skip_reason(point, data, measured))
        if point["median_s"] and point["flops"]:
            point["gflops"] = point["flops"] / point["median_s"] / 1e9
    def order(p):   # None last; values of different types are never compared
        return tuple((p[k] is None, str(type(p[k])), 0 if p[k] is None else p[k]) for k in _ORDER)
    return (sorted(points.values(), key=order),
            {why: sorted(names) for why, names in unplaced.items()})


def _skip_reason(point, data, measured):
    """Why asv skipped ``point`` (all its values NaN), as far as the result file tells."""
    backend = point["backend"]
    if measured and backend not in measured:
        return (f"skipped by the asv suite: no benchmark of backend {backend!r} has a result "
                "in this run (not built on that machine)")
    bound = str((data.get("env_vars") or {}).get("FASTATTN_ASV_REFERENCE_MAX_N", ""))
    bound = int(bound) if bound.isdigit() else SUITE_REFERENCE_MAX_N
    if (backend == "reference" and point["regime"] == "prefill" and point["n_k"] > bound
            and (point["attention"] == "softmax" or point["causal"])):
        return (f"skipped by the asv suite: past the bound of the quadratic reference "
                f"(n > {bound}, FASTATTN_ASV_REFERENCE_MAX_N; benchmarks/common.py)")
    return SKIPPED_BY_SUITE


def branch_commits(results_dir):
    """``(branch, full hashes on it)``: the first ``branches`` entry of the asv.conf.json in
    a parent of ``results_dir``, listed by git; ``(None, None)`` when either fails."""
    conf = next((folder / "asv.conf.json" for folder in Path(results_dir).resolve().parents
                 if (folder / "asv.conf.json").is_file()), None)
    if conf is None:
        return None, None
    try:
        config = json.loads("\n".join(  # asv.conf.json allows // comment lines
            line for line in conf.read_text("utf-8").splitlines()
            if not line.lstrip().startswith("//")))
        branch = (config.get("branches") or ["main"])[0]
        repo = (conf.parent / config.get("repo", ".")).resolve()
        out = subprocess.run(["git", "-C", str(repo), "rev-list", branch], text=True,
                             capture_output=True, timeout=30, check=True).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        return None, None
    return branch, set(out.split())


def _choose(runs, commit, branch, on_branch):
    """The result files of the commit to report, and a sentence saying which and why."""
    if commit is not None:
        chosen = [r for r in runs if str(r[0].get("commit_hash", "")).startswith(commit)]
        if not chosen:
            raise AsvResultsError(f"no results of commit {commit!r} here; recorded: "
                                  + ", ".join(sorted({r[0]["commit_hash"][:8] for r in runs})))
        why = "as asked (--asv-commit)"
    elif on_branch is not None:
        chosen = [r for r in runs if r[0].get("commit_hash") in on_branch]
        if not chosen:
            raise AsvResultsError(f"no results of a commit on branch {branch!r}; pass "
                                  "--asv-commit to pick one")
        why = f"the newest on branch {branch}"
    else:
        chosen, why = runs, "the newest by date (the configured branch could not be read)"
    latest = chosen[-1][0]["commit_hash"]
    return ([(data, path) for data, path in chosen if data["commit_hash"] == latest],
            f"commit {latest[:8]}, {why}")


def load_asv_points(results_dir, commit=None):
    """Per machine of asv's ``results_dir``, an environment record (``chosen``: which commit
    and why; ``left_out``: benchmarks whose parameters cannot be placed) and the point records
    of one commit: ``commit`` (a hash or prefix), else the newest on the configured branch
    (:func:`branch_commits`), else the newest.  Points carry the schema's fields, ``source``
    "asv", ``machine``, ``commit``, ``date``, ``env_name`` and ``benchmarks``.  Raises
    AsvResultsError for no machine.json, a foreign file, an unknown commit, or no point."""
    root, meta, machines = _machines(results_dir)
    branch, on_branch = (None, None) if commit is not None else branch_commits(root)
    records, refused = [], []
    for machine, info, runs in machines:
        latest, chosen = _choose(runs, commit, branch, on_branch) if runs else ([], None)
        for data, path in latest:
            run = {"source": "asv", **_run(machine, data)}
            counts = _by_param(data, _THREADS_BENCHMARK, meta, "component")
            threads = _count(counts.get("requested",
                                        (data.get("env_vars") or {}).get("OMP_NUM_THREADS")))
            env = _environment_record(info, data, meta, run, counts, threads, chosen)
            points, unplaced = _points_of(data, meta, run, threads)
            if unplaced:
                env["left_out"] = [f"{path}: {plural(len(names), 'benchmark')} left out, {why}: "
                                   + ", ".join(names) for why, names in unplaced.items()]
                refused += [] if points else env["left_out"]
            records += [env] + points
    if refused and not any(r["record"] == "point" for r in records):
        raise AsvResultsError("no result can be placed: " + "; ".join(refused)
                              + f" (asv writes benchmarks.json beside the machine "
                              f"directories in {root}: run `asv run` with the suite that "
                              "made these files, or report a commit measured with this one)")
    return records


def load_asv_history(results_dir, benchmark=None):
    """Every value of ``benchmark`` (a name, else a regular expression; None: all) across
    commits: rows ``machine``, ``commit``, ``date``, ``env_name``, ``benchmark``,
    ``params``, ``value``, ``unit``, sorted by machine, benchmark, params and date.
    Raises AsvResultsError as :func:`load_asv_points`, or when nothing matches."""
    root, meta, machines = _machines(results_dir)
    seen = {name for _, _, runs in machines for data, _ in runs for name in data["results"]}
    names = _select(sorted(seen), benchmark)
    if benchmark is not None and not names:
        raise AsvResultsError(f"no benchmark named or matching {benchmark!r} in {root}; "
                              f"benchmarks there: {sorted(seen)}")
    history = [{**_run(machine, data), "benchmark": name, "params": params, "value": value,
                "unit": (meta.get(name) or {}).get("unit")}
               for machine, _, runs in machines for data, _ in runs
               for name in names if name in data["results"]
               for params, value, _ in _rows(data, name, meta)[0] if value is not None]
    return sorted(history, key=lambda h: (h["machine"], h["benchmark"], json.dumps(
        h["params"], sort_keys=True, default=str), h["date"] or ""))


def _select(names, benchmark):
    """The benchmarks of ``names`` that ``benchmark`` names or matches (None: all)."""
    if benchmark is None or benchmark in names:
        return list(names) if benchmark is None else [benchmark]
    with contextlib.suppress(re.error):
        return [name for name in names if re.search(benchmark, name)]
    return []
