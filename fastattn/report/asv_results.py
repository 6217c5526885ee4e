"""The asv suite's results as fastattn records.

asv 0.6 keeps ``benchmarks.json``, ``<machine>/machine.json`` and per commit
``<machine>/<commit8>-<env>.json``: a row per benchmark in ``result_columns`` order, a
value per combination of ``itertools.product(*params)`` (NaN: skipped, null: failed)."""


import ast
import datetime
import itertools
import json
import math
import re
import subprocess
from pathlib import Path

from ..bench.results import SCHEMA, is_number
from ..bench.schema import (ASV_BATCH as SUITE_BATCH, ASV_D as SUITE_D,
                            ASV_DECODE_HEADS as SUITE_DECODE_HEADS, ASV_HEADS as SUITE_HEADS)

#: The suite's feature map of each attention (asv results do not carry it).
SUITE_FEATURE_MAP = {"softmax": None, "linear": "elu"}

#: asv benchmark name ``<module>.<Class>.<method>`` -> the point field it fills.
_METHOD_FIELDS = {"time_forward": "median_s", "time_token": "median_s",
                  "track_peak_bytes": "peak_bytes", "track_max_abs_error": "max_abs_err",
                  "track_bytes_per_head": "held_bytes"}
#: Modules of the suite whose benchmarks are points: softmax, linear (prefill), decode
#: (one token after n keys: benchmarks/decode.py) and feature_maps (benchmarks/feature_maps.py).
POINT_MODULES = ("softmax", "linear", "decode", "feature_maps")
_THREADS_BENCHMARK = "threads.Threads.track_threads"
_VERSIONS_BENCHMARK = "threads.Versions.track_version"


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


def _is_number(value):
    return is_number(value) and math.isfinite(value)


def _iso(ms):
    """asv's commit date (milliseconds since the epoch, UTC) in ISO 8601."""
    return None if ms is None else \
        datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc).isoformat()


def _results_root(results_dir):
    root = Path(results_dir)
    if not root.is_dir():
        raise AsvResultsError(f"no asv results directory at {root}")
    machines = sorted(p for p in root.iterdir() if (p / "machine.json").is_file())
    if not machines:
        raise AsvResultsError(f"{root} holds no asv machine directory (<machine>/machine.json); "
                              "run `asv run` first, or pass asv's results_dir (.asv/results)")
    return root, machines


def _benchmark_meta(root):
    """benchmarks.json without its version key (empty when the file is missing)."""
    path = root / "benchmarks.json"
    meta = _read_json(path) if path.is_file() else {}
    return {k: v for k, v in meta.items() if isinstance(v, dict)}


def _result_files(machine_dir):
    """Every result file of a machine as (data, path), oldest commit first."""
    runs = []
    for path in sorted(machine_dir.glob("*.json")):
        if path.name == "machine.json":
            continue
        data = _read_json(path)
        if not isinstance(data, dict) or "results" not in data or "commit_hash" not in data:
            raise AsvResultsError(f"{path} is not an asv result file (no results/commit_hash)")
        runs.append((data, path))
    runs.sort(key=lambda run: (run[0].get("date") or 0, run[1].name))
    return runs


#: Stand-ins for a combination without a value: skipped (NaN in asv) or failed (null).
SKIPPED, FAILED = "skipped", "failed"
_STATS = ("stats_q_25", "stats_q_75", "stats_ci_99_a", "stats_ci_99_b", "stats_number",
          "stats_repeat", "samples")


def _rows(data, name, meta):
    """``(params, value, stats)`` per combination of a benchmark; a missing value is None
    with ``stats["missing"]`` :data:`SKIPPED` or :data:`FAILED`."""
    row = data["results"].get(name)
    if row is None:
        return []
    columns = data.get("result_columns") or ["result", "params"]
    cells = dict(zip(columns, row))
    values = cells.get("result")
    param_lists = cells.get("params") or []
    names = _param_names(data, name, meta)[0]
    if names is None:
        # benchmarks.json describes the current suite; an older result file
        # may have had other parameters.
        names = [f"param{i + 1}" for i in range(len(param_lists))]
    combos = list(itertools.product(*param_lists)) if param_lists else [()]
    if not isinstance(values, list):
        values = [values]
    out = []
    for index, combo in enumerate(combos):
        value = values[index] if index < len(values) else None
        stats = {column: cells[column][index] for column in _STATS
                 if isinstance(cells.get(column), list) and index < len(cells[column])}
        params = {pname: _decode_param(p) for pname, p in zip(names, combo)}
        if not _is_number(value):
            stats["missing"] = FAILED if value is None else SKIPPED
            value = None
        out.append((params, value, stats))
    return out



def _param_names(data, name, meta):
    """``(names, None)``: the parameter names benchmarks.json gives benchmark ``name``, when
    they fit its row in the result file ``data``; else ``(None, why not)``."""
    row = data["results"].get(name)
    columns = data.get("result_columns") or ["result", "params"]
    param_lists = (dict(zip(columns, row)).get("params") if isinstance(row, list) else None) or []
    if not meta:
        return None, "benchmarks.json is missing, so nothing names their parameters"
    names = (meta.get(name) or {}).get("param_names")
    if names is None:
        return None, "benchmarks.json does not describe them"
    if len(names) != len(param_lists):
        return None, ("their parameters are not the ones benchmarks.json gives (a result "
                      "file of another version of the suite)")
    return list(names), None


def _threads_of(data, meta):
    """{component: threads} from the threads benchmark of a result file, and the requested count."""
    threads = {p["component"]: v for p, v, _ in _rows(data, _THREADS_BENCHMARK, meta)
               if v is not None and "component" in p}
    requested = threads.get("requested", str((data.get("env_vars") or {}).get("OMP_NUM_THREADS")))
    return threads, int(requested) if str(requested).isdigit() or _is_number(requested) else None


def _environment_record(machine, machine_info, data, meta, chosen):
    """An environment record; key names follow fastattn.bench.environment.collect()."""
    def count(value):
        return int(value) if str(value).isdigit() else None

    thread_counts, threads = _threads_of(data, meta)
    return {"schema": SCHEMA, "record": "environment", "source": "asv", "machine": machine,
            "commit": data.get("commit_hash"), "git_commit": data.get("commit_hash"),
            "date": _iso(data.get("date")), "env_name": data.get("env_name"),
            "cpu_model": machine_info.get("cpu"), "arch": machine_info.get("arch"),
            "platform": machine_info.get("os"), "cores_logical": count(machine_info.get("num_cpu")),
            "memory_total_bytes": count(machine_info.get("ram")), "python": data.get("python"),
            "versions": {**(data.get("requirements") or {}), **_versions_of(data, meta)},
            "env_vars": data.get("env_vars") or {}, "threads": threads,
            "thread_counts": thread_counts, "chosen": chosen}


def _identity(module, cls, params):
    """What a benchmark's combination measures: ``attention, regime, feature_map,
    num_features, heads`` (a point's fields beyond backend, causal, dtype and n), or None."""
    if module in SUITE_FEATURE_MAP:
        return module, "prefill", SUITE_FEATURE_MAP[module], None, SUITE_HEADS
    if module == "decode":
        attention = params.get("attention")
        return (attention, "decode", SUITE_FEATURE_MAP.get(attention), None,
                SUITE_DECODE_HEADS) if attention in SUITE_FEATURE_MAP else None
    if module == "feature_maps":
        if cls == "Favor":
            return "linear", "prefill", "favor", params.get("m"), SUITE_HEADS
        return "linear", "prefill", params.get("feature_map"), None, SUITE_HEADS
    return None


def _placed(params):
    """True when a combination names what a point needs: a backend and a positive int n."""
    n = params.get("n")
    return (isinstance(params.get("backend"), str) and isinstance(n, int)
            and not isinstance(n, bool) and n > 0)


def _points_of(machine, data, meta):
    """Point records of one result file, keyed by their identity (attention, regime,
    feature map, m, backend, causal, dtype, n), and ``{reason: [benchmark, ...]}`` of the
    point benchmarks left out because their parameters cannot be placed (no
    benchmarks.json, or one of another version of the suite)."""
    _, threads = _threads_of(data, meta)
    points, unplaced = {}, {}
    for name in sorted(data["results"]):
        module, _, rest = name.partition(".")
        cls = rest.partition(".")[0]
        field = _METHOD_FIELDS.get(name.rsplit(".", 1)[-1])
        if field is None or module not in POINT_MODULES:
            continue
        names, why = _param_names(data, name, meta)
        if names is None:
            unplaced.setdefault(why, []).append(name)
            continue
        for params, value, stats in _rows(data, name, meta):
            identity = _identity(module, cls, params)
            if identity is None or not _placed(params):
                unplaced.setdefault("a combination without a backend or an n, or an "
                                    "attention the report does not know", []).append(name)
                continue
            causal = True if identity[1] == "decode" else params.get("causal")
            key = identity + (params.get("backend"), causal, params.get("dtype"),
                              params.get("n"))
            if key not in points:
                if value is None and field == "max_abs_err":
                    continue  # a point only for a skipped accuracy check is noise
                points[key] = _new_point(machine, data, identity, causal, params, threads)
            point = points[key]
            if value is None:
                if stats["missing"] == FAILED:
                    point["failed"].append(name)
                continue
            point[field] = value
            point["benchmarks"][field] = name
            samples = stats.get("samples") if field == "median_s" else None
            if isinstance(samples, list) and samples:
                point.update(times_s=samples, min_s=min(samples), max_s=max(samples))
            if field == "median_s":
                point.update(q25_s=stats.get("stats_q_25"), q75_s=stats.get("stats_q_75"))
    measured = {p["backend"] for p in points.values()
                if any(p.get(f) is not None for f in _METHOD_FIELDS.values())}
    for point in points.values():
        failed = point.pop("failed")
        has_value = any(point.get(f) is not None for f in _METHOD_FIELDS.values())
        if failed:
            point.update(status="error", reason=f"failed in asv: {', '.join(failed)} "
                                                "(see the asv run log)")
        elif has_value:
            point["status"] = "ok"
        else:
            point.update(status="skipped", reason=_skip_reason(point, data, measured))
        if point["median_s"] and point["flops"]:
            point["gflops"] = point["flops"] / point["median_s"] / 1e9
    return points, {why: sorted(set(names)) for why, names in unplaced.items()}


#: The suite's default bound on n of the quadratic reference kernels (benchmarks/common.py
#: REFERENCE_MAX_N), which FASTATTN_ASV_REFERENCE_MAX_N in a run's env_vars overrides.
SUITE_REFERENCE_MAX_N = 4096
#: Why asv skipped a combination (NaN) when nothing more is known: asv does not record
#: FASTATTN_ASV_QUICK, and the suite skips in setup for several reasons.
SKIPPED_BY_SUITE = "skipped by the asv suite (its quick grid, or a combination it does not run)"


def _skip_reason(point, data, measured):
    """Why asv skipped ``point`` (all its values NaN), as far as the result file tells:
    its backend measured nothing in the run (not built on that machine), the quadratic
    reference past its bound of n, else :data:`SKIPPED_BY_SUITE`."""
    backend, n = point["backend"], point["n_k"]
    if measured and backend not in measured:
        return (f"skipped by the asv suite: no benchmark of backend {backend!r} has a result "
                "in this run (not built on that machine)")
    bound = str((data.get("env_vars") or {}).get("FASTATTN_ASV_REFERENCE_MAX_N", ""))
    bound = int(bound) if bound.isdigit() else SUITE_REFERENCE_MAX_N
    quadratic = (backend == "reference" and point["regime"] == "prefill"
                 and (point["attention"] == "softmax" or point["causal"]))
    if quadratic and n > bound:
        return (f"skipped by the asv suite: past the bound of the quadratic reference "
                f"(n > {bound}, FASTATTN_ASV_REFERENCE_MAX_N; benchmarks/common.py)")
    return SKIPPED_BY_SUITE


def _new_point(machine, data, identity, causal, params, threads):
    from ..bench.engine import point_flops

    attention, regime, feature_map, num_features, heads = identity
    n = params.get("n")
    fields = {"attention": attention, "regime": regime, "causal": causal,
              "dtype": params.get("dtype"), "batch": SUITE_BATCH, "heads": heads,
              "n_q": 1 if regime == "decode" else n, "n_k": n, "d_k": SUITE_D, "d_v": SUITE_D,
              "feature_map": feature_map, "num_features": num_features}
    return {"schema": SCHEMA, "record": "point", "source": "asv", "machine": machine,
            "commit": data.get("commit_hash"), "date": _iso(data.get("date")),
            "env_name": data.get("env_name"), "backend": params.get("backend"), "peer": False,
            **fields, "threads": threads, "status": None,
            "reason": None, "times_s": None, "median_s": None, "min_s": None, "max_s": None,
            "flops": point_flops(fields) if n else None, "gflops": None,
            "peak_bytes": None, "memory_method": "rss-hwm", "max_abs_err": None,
            "benchmarks": {}, "failed": []}



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
    and why) and point records of one commit: ``commit`` (a hash or prefix), else the newest
    on the configured branch (:func:`branch_commits`), else the newest of all.

    Points carry ``machine``, ``commit``, ``date``, ``env_name``, ``source`` "asv",
    ``benchmarks``; ``times_s``/``min_s``/``max_s`` only where asv kept samples.  Benchmarks
    whose parameters cannot be placed (benchmarks.json missing, or of another version of the
    suite than a result file) are left out, and the environment record says which in
    ``left_out`` (a sentence per result file).  Raises AsvResultsError for no
    ``<machine>/machine.json``, a foreign file, an unknown commit, or when no point at all
    can be placed (naming the files).
    """
    root, machines = _results_root(results_dir)
    meta = _benchmark_meta(root)
    branch, on_branch = (None, None) if commit is not None else branch_commits(root)
    records, refused = [], []
    for machine_dir in machines:
        machine_info = _read_json(machine_dir / "machine.json")
        runs = _result_files(machine_dir)
        if not runs:
            continue
        latest, chosen = _choose(runs, commit, branch, on_branch)
        for data, path in latest:
            environment = _environment_record(machine_dir.name, machine_info, data, meta,
                                              chosen)
            points, unplaced = _points_of(machine_dir.name, data, meta)
            if unplaced:
                left_out = [f"{path}: {len(names)} benchmark{'' if len(names) == 1 else 's'} left out, {why}: "
                            + ", ".join(names) for why, names in unplaced.items()]
                environment["left_out"] = left_out
                if not points:
                    refused.extend(left_out)
            records.append(environment)
            records.extend(points[key] for key in sorted(points, key=_sort_key))
    if refused and not any(r["record"] == "point" for r in records):
        raise AsvResultsError("no result can be placed: " + "; ".join(refused)
                              + f" (asv writes benchmarks.json beside the machine "
                              f"directories in {root}: run `asv run` with the suite that "
                              "made these files, or report a commit measured with this one)")
    return records


def _versions_of(data, meta):
    """{library: "major.minor.patch"} from the suite's version benchmark."""
    versions = {}
    for params, value, _ in _rows(data, _VERSIONS_BENCHMARK, meta):
        if value is not None and "library" in params:
            major, rest = divmod(round(value * 1e6), 10**6)
            versions[params["library"]] = f"{major}.{rest // 1000}.{rest % 1000}"
    return versions


def _sort_key(key):
    return tuple((value is None, str(type(value)), value if value is not None else 0)
                 for value in key)


def load_asv_history(results_dir, benchmark=None):
    """Every value of ``benchmark`` (a name, else a regular expression; None: all) across
    commits: rows ``machine``, ``commit``, ``date``, ``env_name``, ``benchmark``,
    ``params``, ``value``, ``unit``, sorted by machine, benchmark, params and date.
    Raises AsvResultsError as :func:`load_asv_points`, or when nothing matches."""
    root, machines = _results_root(results_dir)
    meta = _benchmark_meta(root)
    history = []
    seen_names = set()
    for machine_dir in machines:
        for data, _ in _result_files(machine_dir):
            names = list(data["results"])
            seen_names.update(names)
            for name in _select(names, benchmark):
                unit = (meta.get(name) or {}).get("unit")
                for params, value, _ in _rows(data, name, meta):
                    if value is None:
                        continue
                    history.append({"machine": machine_dir.name,
                                    "commit": data.get("commit_hash"),
                                    "date": _iso(data.get("date")),
                                    "env_name": data.get("env_name"), "benchmark": name,
                                    "params": params, "value": value, "unit": unit})
    if benchmark is not None and not history and not _select(sorted(seen_names), benchmark):
        raise AsvResultsError(f"no benchmark named or matching {benchmark!r} in {root}; "
                              f"benchmarks there: {sorted(seen_names)}")
    history.sort(key=lambda h: (h["machine"], h["benchmark"],
                                json.dumps(h["params"], sort_keys=True, default=str),
                                h["date"] or ""))
    return history


def _select(names, benchmark):
    if benchmark is None:
        return list(names)
    if benchmark in names:
        return [benchmark]
    try:
        pattern = re.compile(benchmark)
    except re.error:
        return []
    return [name for name in names if pattern.search(name)]
