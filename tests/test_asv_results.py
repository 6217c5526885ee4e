"""fastattn.report.asv_results against a small asv 0.6 results directory written here.

The directory mirrors what ``asv run`` writes (machine.json, benchmarks.json,
one ``<commit8>-<env>.json`` per commit with ``result_columns`` rows); the
values are chosen by hand so each expectation can be checked by eye.
"""

import json
import sys
from pathlib import Path

import pytest

from fastattn.bench.results import SCHEMA
from fastattn.report import asv_results
from fastattn.report.asv_results import AsvResultsError, load_asv_history, load_asv_points

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a",
           "stats_ci_99_b", "stats_q_25", "stats_q_75", "stats_number", "stats_repeat",
           "samples", "profile"]

TIME = "softmax.SoftmaxAttention.time_forward"
PEAK = "softmax.SoftmaxAttention.track_peak_bytes"
ERR = "softmax.SoftmaxAccuracy.track_max_abs_error"
LTIME = "linear.LinearAttention.time_forward"
THREADS = "threads.Threads.track_threads"

MAIN_PARAMS = [["'reference'", "'numba'"], ["256", "1024"], ["False", "True"], ["'float32'"]]
ERR_PARAMS = [["'reference'", "'numba'"], ["1024"], ["False", "True"], ["'float32'"]]


def _benchmarks_json():
    main = {"param_names": ["backend", "n", "causal", "dtype"], "params": MAIN_PARAMS}
    err = {"param_names": ["backend", "n", "causal", "dtype"], "params": ERR_PARAMS}
    return {
        TIME: {**main, "name": TIME, "type": "time", "unit": "seconds", "version": "1"},
        PEAK: {**main, "name": PEAK, "type": "track", "unit": "bytes", "version": "1"},
        ERR: {**err, "name": ERR, "type": "track", "unit": "abs error", "version": "1"},
        LTIME: {**main, "name": LTIME, "type": "time", "unit": "seconds", "version": "1"},
        THREADS: {"param_names": ["component"], "params": [["'requested'", "'blas'"]],
                  "name": THREADS, "type": "track", "unit": "threads", "version": "1"},
        "version": 2,
    }


def _result_file(commit, date_ms, time_scale, with_samples=False):
    # Order of a parameterised result: itertools.product of the params, i.e.
    # (reference,256,False) (reference,256,True) (reference,1024,False) ...
    # asv writes NaN for a combination skipped in setup, null for one that failed.
    nan = float("nan")
    times = [1e-3, 2e-3, 1.6e-2, 3.2e-2, 1e-4, nan, 4e-4, nan]
    times = [t * time_scale for t in times]
    peaks = [786432, 1048576, 12582912, 16777216, 65536, nan, 262144, None]
    row_time = [times, MAIN_PARAMS, "1", 0, 5.0, None, None,
                [t * 0.9 for t in times], [t * 1.1 for t in times],
                [1] * 8, [4] * 8]
    if with_samples:
        row_time.append([[t, t * 1.2] if t == t else None for t in times])
    return {
        "commit_hash": commit,
        "env_name": "virtualenv-py3.11-OMP_NUM_THREADS2",
        "date": date_ms,
        "params": {"machine": "box", "python": "3.11"},
        "python": "3.11",
        "requirements": {},
        "env_vars": {"OMP_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"},
        "result_columns": COLUMNS,
        "results": {
            TIME: row_time,
            PEAK: [peaks, MAIN_PARAMS, "1", 0, 1.0],
            ERR: [[3e-8, 4e-8, nan, nan], ERR_PARAMS, "1", 0, 1.0],
            THREADS: [[2, 2], [["'requested'", "'blas'"]], "1", 0, 0.5],
        },
        "durations": {},
        "version": 2,
    }


def _machine_json(name):
    return {"machine": name, "arch": "x86_64", "cpu": "AMD EPYC", "num_cpu": "2",
            "os": "Linux", "ram": "25276514304", "version": 1}


@pytest.fixture
def results_dir(tmp_path):
    root = tmp_path / "results"
    box = root / "box"
    box.mkdir(parents=True)
    (root / "benchmarks.json").write_text(json.dumps(_benchmarks_json()))
    (box / "machine.json").write_text(json.dumps(_machine_json("box")))
    # Older commit: everything twice as slow; newer commit with samples.
    (box / "aaaaaaaa-env.json").write_text(json.dumps(_result_file("a" * 40, 1_700_000_000_000, 2.0)))
    (box / "bbbbbbbb-env.json").write_text(
        json.dumps(_result_file("b" * 40, 1_700_086_400_000, 1.0, with_samples=True)))
    return root


def _points(records):
    return {(r["attention"], r["backend"], r["causal"], r["dtype"], r["n_q"]): r
            for r in records if r["record"] == "point"}


def test_points_come_from_latest_commit_and_join_time_memory_error(results_dir):
    records = load_asv_points(results_dir)
    assert all(r["schema"] == SCHEMA for r in records)
    envs = [r for r in records if r["record"] == "environment"]
    assert [(e["machine"], e["commit"]) for e in envs] == [("box", "b" * 40)]
    assert envs[0]["cores_logical"] == 2 and envs[0]["threads"] == 2
    assert envs[0]["thread_counts"] == {"requested": 2, "blas": 2}
    assert envs[0]["env_vars"]["NUMBA_NUM_THREADS"] == "2"

    points = _points(records)
    p = points[("softmax", "reference", True, "float32", 1024)]
    assert p["commit"] == "b" * 40 and p["machine"] == "box"
    assert p["median_s"] == pytest.approx(3.2e-2)          # not the old commit's 6.4e-2
    assert p["peak_bytes"] == 16777216
    assert p["max_abs_err"] == pytest.approx(4e-8)
    assert p["times_s"] == pytest.approx([3.2e-2, 3.84e-2])
    assert (p["min_s"], p["max_s"]) == pytest.approx((3.2e-2, 3.84e-2))
    assert p["status"] == "ok" and p["threads"] == 2
    assert (p["d_k"], p["d_v"], p["batch"], p["heads"], p["feature_map"]) == (64, 64, 1, 1, None)
    try:  # flops come from the bench's one formula once that module is there
        import fastattn.bench.flops  # noqa: F401
    except ImportError:
        assert p["flops"] is None and p["gflops"] is None
    else:
        # Causal softmax: n(n+1)/2 visible pairs, 2 * (d_k + d_v) flops each.
        assert p["flops"] == 1024 * 1025 // 2 * 2 * 128
        assert p["gflops"] == pytest.approx(p["flops"] / 3.2e-2 / 1e9)
    # Error only at the accuracy n.
    assert points[("softmax", "reference", True, "float32", 256)]["max_abs_err"] is None


def test_skipped_and_failed_combinations(results_dir):
    points = _points(load_asv_points(results_dir))
    p = points[("softmax", "numba", True, "float32", 256)]
    assert p["status"] == "skipped" and p["median_s"] is None
    assert p["reason"] == asv_results.SKIPPED_BY_SUITE
    failed = points[("softmax", "numba", True, "float32", 1024)]
    assert failed["status"] == "error" and PEAK in failed["reason"]
    assert points[("softmax", "numba", False, "float32", 256)]["median_s"] == pytest.approx(1e-4)


QUICK_PARAMS = [["'reference'", "'numba'", "'cython'"], ["n=00256", "n=01024", "n=16384"],
                ["causal=False"], ["'float32'", "'float64'"]]


def test_quick_grid_skips_are_not_blamed_on_the_backend_or_the_reference_bound(tmp_path):
    # What FASTATTN_ASV_QUICK=1 records: only n = 256 float32 measured, every other
    # combination NaN (skipped in setup); here cython is not built, so it measured nothing.
    root = tmp_path / "results"
    (root / "box").mkdir(parents=True)
    meta = {TIME: {"param_names": ["backend", "n", "causal", "dtype"], "params": QUICK_PARAMS,
                   "unit": "seconds"}, "version": 2}
    (root / "benchmarks.json").write_text(json.dumps(meta))
    (root / "box" / "machine.json").write_text(json.dumps(_machine_json("box")))
    nan = float("nan")
    values = [(1e-3 if (b != "'cython'" and n == "n=00256" and d == "'float32'") else nan)
              for b in QUICK_PARAMS[0] for n in QUICK_PARAMS[1] for d in QUICK_PARAMS[3]]
    result = {"commit_hash": "d" * 40, "env_name": "env", "date": 1_700_000_000_000,
              "params": {}, "python": "3.11", "requirements": {}, "env_vars": {},
              "result_columns": ["result", "params"],
              "results": {TIME: [values, QUICK_PARAMS]}, "version": 2}
    (root / "box" / "dddddddd-env.json").write_text(json.dumps(result))
    by = {(r["backend"], r["n_q"], r["dtype"]): r for r in load_asv_points(root)
          if r["record"] == "point"}
    assert by["numba", 256, "float32"]["status"] == "ok"
    for key in [("numba", 1024, "float32"), ("numba", 256, "float64"),
                ("reference", 1024, "float64"), ("numba", 16384, "float32")]:
        assert by[key]["status"] == "skipped"
        assert by[key]["reason"] == asv_results.SKIPPED_BY_SUITE, key
    # the old reason only where it is true: the backend measured nothing, or softmax's
    # reference past its bound of n (4096 unless the run's env_vars say otherwise)
    assert "'cython'" in by["cython", 256, "float32"]["reason"]
    assert "not built" in by["cython", 256, "float32"]["reason"]
    assert "quadratic reference (n > 4096" in by["reference", 16384, "float32"]["reason"]
    result["env_vars"] = {"FASTATTN_ASV_REFERENCE_MAX_N": "20000"}
    (root / "box" / "dddddddd-env.json").write_text(json.dumps(result))
    by = {(r["backend"], r["n_q"], r["dtype"]): r for r in load_asv_points(root)
          if r["record"] == "point"}
    assert by["reference", 16384, "float32"]["reason"] == asv_results.SKIPPED_BY_SUITE


def test_machines_side_by_side(results_dir):
    other = results_dir / "other"
    other.mkdir()
    (other / "machine.json").write_text(json.dumps(_machine_json("other")))
    (other / "cccccccc-env.json").write_text(json.dumps(_result_file("c" * 40, 1_600_000_000_000, 3.0)))
    records = load_asv_points(results_dir)
    by_machine = {(r["machine"], r["commit"]) for r in records}
    assert by_machine == {("box", "b" * 40), ("other", "c" * 40)}
    p = _points([r for r in records if r["machine"] == "other"])
    assert p[("softmax", "reference", False, "float32", 256)]["median_s"] == pytest.approx(3e-3)


def test_history_of_one_benchmark_across_commits(results_dir):
    history = load_asv_history(results_dir, TIME)
    assert {h["benchmark"] for h in history} == {TIME}
    ref = [h for h in history
           if h["params"] == {"backend": "reference", "n": 1024, "causal": False, "dtype": "float32"}]
    assert [h["commit"] for h in ref] == ["a" * 40, "b" * 40]
    assert [h["value"] for h in ref] == pytest.approx([3.2e-2, 1.6e-2])
    assert ref[0]["date"].startswith("2023-11-14") and ref[0]["unit"] == "seconds"
    # 6 values per commit (2 skipped combinations left out).
    assert len(history) == 12


def test_history_regex_and_all(results_dir):
    assert {h["benchmark"] for h in load_asv_history(results_dir, r"track_peak")} == {PEAK}
    assert {h["benchmark"] for h in load_asv_history(results_dir)} == {TIME, PEAK, ERR, THREADS}
    with pytest.raises(AsvResultsError, match="no benchmark named or matching"):
        load_asv_history(results_dir, "nope.Nope.time_nope")


def test_not_an_asv_directory(tmp_path):
    with pytest.raises(AsvResultsError, match="no asv results directory"):
        load_asv_points(tmp_path / "missing")
    with pytest.raises(AsvResultsError, match="machine.json"):
        load_asv_points(tmp_path)
    box = tmp_path / "box"
    box.mkdir()
    (box / "machine.json").write_text("{}")
    (box / "x.json").write_text("[1, 2]")
    with pytest.raises(AsvResultsError, match="not an asv result file"):
        load_asv_points(tmp_path)


def _suite_params(quick):
    import os
    import subprocess

    code = ("import json; from benchmarks import common, softmax, linear, threads, decode, "
            "feature_maps\n"
            "print(json.dumps([repr(c.params) for c in (softmax.SoftmaxAttention, "
            "softmax.SoftmaxAccuracy, linear.LinearAttention, threads.Threads, decode.Decode, "
            "feature_maps.FeatureMaps, feature_maps.Favor)]))")
    env = dict(os.environ, FASTATTN_ASV_QUICK="1" if quick else "0")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def test_quick_mode_keeps_the_recorded_suite_description():
    # asv rewrites benchmarks.json from the parameters on every run: a quick run must
    # describe the same suite, or asv publish drops the recorded results.
    quick, full = _suite_params(True), _suite_params(False)
    assert quick == full
    assert "causal=True" in full[0] and "n=01024" in full[0] and "n=16384" in full[0]
    assert "regime=decode" in full[4] and "n=00128" in full[4] and "n=65536" in full[4]
    assert "'taylor'" in full[5] and "n=16384" in full[5]
    assert "m=0064" in full[6] and "m=4096" in full[6] and "n=04096" in full[6]


def test_readable_parameters_are_decoded():
    assert asv_results._decode_param("causal=True") is True
    assert asv_results._decode_param("n=01024") == 1024
    assert asv_results._decode_param("'numba'") == "numba"
    assert asv_results._decode_param("256") == 256


def _git(repo, *args):
    import subprocess

    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                          "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
                                          "HOME": str(repo)}).stdout.strip()


def test_report_takes_the_newest_commit_on_the_configured_branch(results_dir, tmp_path):
    repo = tmp_path
    _git(repo, "init", "-q", "-b", "main")
    (repo / "asv.conf.json").write_text('{\n// comment\n"repo": ".", "branches": ["main"]}')
    _git(repo, "add", "asv.conf.json")
    _git(repo, "commit", "-qm", "one")
    on_main = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-qb", "scratch")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "two")
    scratch = _git(repo, "rev-parse", "HEAD")
    box = results_dir / "box"
    for path, commit, date in ((box / "aaaaaaaa-env.json", on_main, 1_700_000_000_000),
                               (box / "bbbbbbbb-env.json", scratch, 1_700_086_400_000)):
        data = json.loads(path.read_text())
        path.write_text(json.dumps(dict(data, commit_hash=commit, date=date)))
    env, = [r for r in load_asv_points(results_dir) if r["record"] == "environment"]
    assert env["commit"] == on_main and "newest on branch main" in env["chosen"]
    env, = [r for r in load_asv_points(results_dir, commit=scratch[:8])
            if r["record"] == "environment"]
    assert env["commit"] == scratch and "as asked" in env["chosen"]
    with pytest.raises(AsvResultsError, match="no results of commit"):
        load_asv_points(results_dir, commit="0000000")


def test_library_versions_are_read_from_the_suite(results_dir):
    path = results_dir / "box" / "bbbbbbbb-env.json"
    data = json.loads(path.read_text())
    data["results"]["threads.Versions.track_version"] = [[2.004006], [["'numpy'"]], "1", 0, 0.1]
    path.write_text(json.dumps(data))
    meta = json.loads((results_dir / "benchmarks.json").read_text())
    meta["threads.Versions.track_version"] = {"param_names": ["library"],
                                              "params": [["'numpy'"]], "unit": "version"}
    (results_dir / "benchmarks.json").write_text(json.dumps(meta))
    env, = [r for r in load_asv_points(results_dir) if r["record"] == "environment"]
    assert env["versions"]["numpy"] == "2.4.6"


def test_asv_conf_links_to_no_invented_url():
    """The project has no public repository URL: asv.conf.json names none (docs/asv.md says
    how to add ``show_commit_url`` where the repository is hosted)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "asv.conf.json").read_text()
    config = json.loads("\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//")))
    assert "show_commit_url" not in config and "://" not in json.dumps(config)
    assert "show_commit_url" in (root / "docs" / "asv.md").read_text()


DECODE = "decode.Decode.time_token"
HELD = "decode.Decode.track_bytes_per_head"
FMAP = "feature_maps.FeatureMaps.time_forward"
FAVOR = "feature_maps.Favor.time_forward"
DECODE_PARAMS = [["regime='decode'"], ["'softmax'", "'linear'"], ["'numba'"], ["n=00128", "n=65536"],
                 ["'float32'"]]
FMAP_PARAMS = [["'elu'", "'taylor'"], ["'numba'"], ["n=04096"], ["causal=False"], ["'float32'"]]
FAVOR_PARAMS = [["m=0064", "m=4096"], ["'numba'"], ["n=04096"], ["causal=False"], ["'float32'"]]


@pytest.fixture
def decode_and_feature_map_results(tmp_path):
    root = tmp_path / "results"
    box = root / "box"
    box.mkdir(parents=True)
    meta = {
        DECODE: {"param_names": ["regime", "attention", "backend", "n", "dtype"],
                 "params": DECODE_PARAMS, "unit": "seconds"},
        HELD: {"param_names": ["regime", "attention", "backend", "n", "dtype"],
               "params": DECODE_PARAMS, "unit": "bytes"},
        FMAP: {"param_names": ["feature_map", "backend", "n", "causal", "dtype"],
               "params": FMAP_PARAMS, "unit": "seconds"},
        FAVOR: {"param_names": ["m", "backend", "n", "causal", "dtype"], "params": FAVOR_PARAMS,
                "unit": "seconds"},
        "version": 2}
    (root / "benchmarks.json").write_text(json.dumps(meta))
    (box / "machine.json").write_text(json.dumps(_machine_json("box")))
    # product order: (softmax, 128) (softmax, 65536) (linear, 128) (linear, 65536)
    result = {"commit_hash": "c" * 40, "env_name": "env", "date": 1_700_000_000_000,
              "params": {}, "python": "3.11", "requirements": {}, "env_vars": {},
              "result_columns": ["result", "params"],
              "results": {DECODE: [[1e-5, 5e-3, 2e-5, 2.1e-5], DECODE_PARAMS],
                          HELD: [[32768, 16777216, 16640, 16640], DECODE_PARAMS],
                          FMAP: [[1e-3, 9e-3], FMAP_PARAMS], FAVOR: [[2e-3, 3e-2], FAVOR_PARAMS]},
              "version": 2}
    (box / "cccccccc-env.json").write_text(json.dumps(result))
    return root


def test_decode_and_feature_map_benchmarks_are_read_as_points(decode_and_feature_map_results):
    points = [r for r in load_asv_points(decode_and_feature_map_results) if r["record"] == "point"]
    by = {(r["attention"], r["regime"], r["feature_map"], r["num_features"], r["n_k"]): r
          for r in points}
    assert len(by) == len(points) == 8
    soft = by["softmax", "decode", None, None, 65536]
    assert (soft["n_q"], soft["causal"], soft["heads"], soft["median_s"], soft["held_bytes"]) == \
        (1, True, asv_results.SUITE_DECODE_HEADS, 5e-3, 16777216)
    # one query over n keys, 8 heads of d = 64: 4 n d flops a head
    assert soft["flops"] == 4 * 65536 * 64 * 8
    lin = by["linear", "decode", "elu", None, 128]
    assert (lin["n_q"], lin["median_s"], lin["held_bytes"]) == (1, 2e-5, 16640)
    taylor = by["linear", "prefill", "taylor", None, 4096]
    assert (taylor["median_s"], taylor["causal"], taylor["heads"]) == (9e-3, False, 1)
    # Taylor's D = 1 + 64 + 64 * 65 / 2 = 2145 features: 4 n D d_v flops
    assert taylor["flops"] == 4 * 4096 * 2145 * 64
    favor = by["linear", "prefill", "favor", 4096, 4096]
    assert favor["median_s"] == 3e-2 and favor["flops"] == 4 * 4096 * 4096 * 64
    # The feature-map frontier takes its costs from these points: FAVOR+ m = 64 d_k, Taylor.
    from fastattn.map_quality import MAPS

    assert [s.key for s in MAPS if s.measured_by(favor)] == ["favor-64"]
    assert [s.key for s in MAPS if s.measured_by(taylor)] == ["taylor"]
    assert by["linear", "prefill", "elu", None, 4096]["median_s"] == 1e-3


def test_suite_decode_heads_agree_with_benchmarks():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import common
    finally:
        sys.path.remove(str(ROOT))
    assert common.DECODE_HEADS == asv_results.SUITE_DECODE_HEADS


# Issue 33, item 13: a result file whose parameters benchmarks.json does not describe (a
# file of another version of the suite, or no benchmarks.json at all) was read with
# parameters "param1".."param4", giving points without n that crashed the report with
# "TypeError: int() argument must be ... not 'NoneType'".

def test_benchmarks_of_another_suite_version_are_left_out_and_named(results_dir):
    meta = json.loads((results_dir / "benchmarks.json").read_text())
    meta[PEAK]["param_names"] = meta[PEAK]["param_names"][:3]   # the suite's PEAK has 3 now
    meta[PEAK]["params"] = meta[PEAK]["params"][:3]
    (results_dir / "benchmarks.json").write_text(json.dumps(meta))
    records = load_asv_points(results_dir)
    points = [r for r in records if r["record"] == "point"]
    assert points and all(isinstance(p["n_k"], int) and p["backend"] for p in points)
    assert all(p["peak_bytes"] is None for p in points)          # PEAK's rows are left out
    assert _points(records)[("softmax", "reference", True, "float32", 1024)]["median_s"] \
        == pytest.approx(3.2e-2)                                 # TIME's are read
    (env,) = [r for r in records if r["record"] == "environment"]
    (note,) = env["left_out"]
    assert "bbbbbbbb-env.json" in note and PEAK in note and TIME not in note
    assert "another version of the suite" in note
    from fastattn.report.build import build_report

    html = build_report(records, source="asv").html             # no TypeError
    assert PEAK in html


def test_no_benchmarks_json_is_refused_naming_the_file(results_dir, tmp_path, capsys):
    from fastattn.cli import main

    (results_dir / "benchmarks.json").unlink()
    with pytest.raises(AsvResultsError, match=r"bbbbbbbb-env\.json.*benchmarks\.json is missing"):
        load_asv_points(results_dir)
    capsys.readouterr()
    assert main(["report", "--asv", str(results_dir), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "bbbbbbbb-env.json" in err and "benchmarks.json is missing" in err
    assert "Traceback" not in err and not (tmp_path / "r.html").exists()
    # the history of a file without benchmarks.json is still read, by position
    assert {h["benchmark"] for h in load_asv_history(results_dir, TIME)} == {TIME}


def test_report_asv_reads_what_it_can_place_and_says_what_it_left_out(results_dir, tmp_path,
                                                                      capsys):
    from fastattn.cli import main

    meta = json.loads((results_dir / "benchmarks.json").read_text())
    del meta[PEAK]
    (results_dir / "benchmarks.json").write_text(json.dumps(meta))
    out = tmp_path / "r.html"
    assert main(["report", "--asv", str(results_dir), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"note: {results_dir / 'box' / 'bbbbbbbb-env.json'}: 1 benchmark left out, " \
           f"benchmarks.json does not describe them: {PEAK}" in err
    assert "left out" in out.read_text()


def test_a_quick_asv_report_groups_the_points_not_measured(tmp_path):
    # Found by a new-user trial: a report of quick asv results (one n per kernel) listed
    # every skipped combination, one row each.  One row per kernel and reason now, with
    # the n it covers, and a note saying the quick grid measured only n = 256.
    from fastattn.report.build import build_report

    root = tmp_path / "results"
    (root / "box").mkdir(parents=True)
    params = [["'reference'", "'numba'", "'cython'"],
              ["n=00256", "n=01024", "n=04096", "n=16384", "n=65536"],
              ["causal=False", "causal=True"], ["'float32'", "'float64'"]]
    meta = {TIME: {"param_names": ["backend", "n", "causal", "dtype"], "params": params,
                   "unit": "seconds"}, "version": 2}
    (root / "benchmarks.json").write_text(json.dumps(meta))
    (root / "box" / "machine.json").write_text(json.dumps(_machine_json("box")))
    values = [1e-3 if (n, d) == ("n=00256", "'float32'") else float("nan")
              for b in params[0] for n in params[1] for c in params[2] for d in params[3]]
    (root / "box" / "dddddddd-env.json").write_text(json.dumps(
        {"commit_hash": "d" * 40, "env_name": "env", "date": 1_700_000_000_000, "params": {},
         "python": "3.11", "requirements": {}, "env_vars": {},
         "result_columns": ["result", "params"], "results": {TIME: [values, params]},
         "version": 2}))
    records = load_asv_points(root)
    skipped = [r for r in records if r["record"] == "point" and r["status"] != "ok"]
    assert len(skipped) == 3 * 2 * 2 * 5 - 6   # 54 points not measured
    html = build_report(records, source="asv").html
    table = html[html.index("<h4>Points not measured</h4>"):]
    table = table[:table.index("</table>")]
    # the header, a row per backend and reason (the reference's past its bound of n too)
    assert table.count("<tr>") == 1 + 4
    assert "256, 1024, 4096, 16384, 65536" not in table and "256 to 65536" in table
    assert "measured only at n = 256 (the asv suite's quick grid)" in table
    assert "<code>fastattn bench</code> (or <code>fastattn report</code>) measures" in table
