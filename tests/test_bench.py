"""The bench: sweep records, resume, refusing foreign files, flops, memory probe, CLI.

No test here asserts a timing: speed lives in the benchmarks and reports.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import fastattn
from fastattn.bench import engine, peers, sweep
from fastattn.bench.flops import attention_flops, visible_pairs
from fastattn.bench.results import SCHEMA, ResultsFileError, read_records
from fastattn.bench.sweep import Options, Point, default_grid, run_sweep
from fastattn.cli import main

HAVE_TORCH = "torch" in peers.available_peers()


# ---------------------------------------------------------------- flops

def _mask(n_q, n_k, causal):
    """Visibility by the definition, one pair at a time."""
    m = np.zeros((n_q, n_k), dtype=bool)
    for i in range(n_q):
        for j in range(n_k):
            m[i, j] = (not causal) or j <= i + (n_k - n_q)
    return m


@pytest.mark.parametrize("n_q,n_k", [(1, 1), (7, 7), (5, 9), (9, 5), (64, 64), (33, 100)])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_softmax_flops_count_visible_pairs(n_q, n_k, causal):
    d_k, d_v = 3, 5
    pairs = int(_mask(n_q, n_k, causal).sum())
    assert visible_pairs(n_q, n_k, causal) == pairs
    # logits: one d_k dot product per pair; output: one d_v axpy per pair; 2 flops each
    expected = 2 * pairs * d_k + 2 * pairs * d_v
    assert attention_flops("softmax", n_q, n_k, d_k, d_v, causal, batch=2, heads=3) == 6 * expected


def test_softmax_flops_headline_numbers():
    n, d = 4096, 64
    assert attention_flops("softmax", n, n, d, d, False) == 4 * n * n * d
    causal = attention_flops("softmax", n, n, d, d, True)
    assert causal == 2 * (n * (n + 1) // 2) * 2 * d  # about half


@pytest.mark.parametrize("n_q,n_k,chunk", [(10, 10, 4), (64, 64, 64), (100, 100, 16),
                                           (7, 13, 4), (13, 7, 4)])
def test_linear_flops_against_a_loop_over_chunks(n_q, n_k, chunk):
    d_k, d_v = 4, 6
    assert attention_flops("linear", n_q, n_k, d_k, d_v, False) == \
        2 * n_k * d_k * d_v + 2 * n_q * d_k * d_v
    # Chunked causal form, counted by walking the chunks of keys: each query
    # forms every visible pair inside its own chunk (the quadratic part) and
    # reads the state of earlier chunks (2 d_k d_v); each key updates the state.
    intra = 0
    for i in range(n_q):
        p = i + n_k - n_q
        if p < 0:
            continue
        start = (p // chunk) * chunk
        intra += sum(1 for j in range(start, n_k) if j <= p)
    expected = 2 * n_k * d_k * d_v + 2 * n_q * d_k * d_v + 2 * intra * (d_k + d_v)
    assert attention_flops("linear", n_q, n_k, d_k, d_v, True, chunk=chunk) == expected


def test_flops_refuses_unknown_attention():
    with pytest.raises(ValueError, match="attention"):
        attention_flops("cosine", 4, 4, 2, 2, False)


# ---------------------------------------------------------------- Point

def test_point_normalises_and_validates():
    assert Point("linear", "reference", True, 8).feature_map == "elu"
    assert Point("softmax", "reference", True, 8).feature_map is None
    with pytest.raises(ValueError, match="attention"):
        Point("cosine", "reference", True, 8)
    with pytest.raises(ValueError, match="feature_map"):
        Point("softmax", "reference", True, 8, feature_map="elu")
    with pytest.raises(ValueError, match="n must be"):
        Point("softmax", "reference", True, 0)
    with pytest.raises(ValueError, match="dtype"):
        Point("softmax", "reference", True, 8, dtype="float16")


def test_point_labels_say_non_causal_not_full():
    assert Point("softmax", "reference", False, 8).label().startswith("softmax non-causal n=8")
    assert " full " not in Point("linear", "reference", False, 8).label()


def test_default_grid_puts_backends_of_one_shape_together():
    grid = default_grid(backends=["reference", "torch"], ns=(8, 16))
    assert len(grid) == 2 * 2 * 2 * 2
    assert [p.backend for p in grid[:4]] == ["reference", "torch"] * 2
    assert [p.n for p in grid[:4]] == [8, 8, 16, 16]


# ---------------------------------------------------------------- sweep

def _points(ns=(8, 16), backends=("reference",)):
    return default_grid(backends=list(backends), ns=ns, d_k=8, d_v=4)


def test_sweep_writes_environment_roof_then_points(tmp_path):
    path = tmp_path / "r.jsonl"
    points = _points()
    records = run_sweep(points, path, Options(repeats=2, roof_budget_s=0.01, min_time_s=0),
                        threads=1, progress=None, isolate=False)
    assert len(records) == len(points)
    stored = read_records(path)
    assert stored[0]["record"] == "environment"
    assert stored[0]["cpu_model"] and stored[0]["versions"]["numpy"] == np.__version__
    # The schema names every field of the record: a new one is declared there first.
    from fastattn.bench.schema import ENVIRONMENT_KEYS

    assert set(stored[0]) - {"schema", "record"} <= set(ENVIRONMENT_KEYS)
    roofs = [r for r in stored if r["record"] == "roof"]
    assert {r["dtype"] for r in roofs if r["probe"] == "gemm"} == {"float32", "float64"}
    assert all(r["gflops"] > 0 for r in roofs if r["probe"] == "gemm")
    assert all(r["gelem_s"] > 0 for r in roofs if r["probe"] == "exp")
    # The exp rate is NumPy's own loop, labelled as such, not as the GEMMs' BLAS.
    assert all(r["blas"].startswith("np.exp of NumPy") for r in roofs if r["probe"] == "exp")
    # Each GEMM roof names the library it ran through (torch's too, when torch is installed).
    label = {"numpy": "through NumPy", "torch": "through torch"}
    assert all(label[r["library"]] in r["blas"] and "np.exp" not in r["blas"]
               for r in roofs if r["probe"] == "gemm")
    assert "numpy" in {r["library"] for r in roofs if r["probe"] == "gemm"}
    for point, record in zip(points, records):
        assert record["status"] == "ok", record.get("reason")
        assert (record["attention"], record["causal"], record["n_q"]) == \
            (point.attention, point.causal, point.n)
        assert record["threads"] == 1
        assert record["thread_counts"]["blas"] == 1 and record["thread_counts"]["requested"] == 1
        assert len(record["times_s"]) == 2
        assert record["min_s"] <= record["median_s"] <= record["max_s"]
        assert record["flops"] == attention_flops(point.attention, point.n, point.n, 8, 4,
                                                  point.causal)
        assert record["check_ok"] is True and record["max_abs_err"] < 1e-5
        assert record["peak_bytes"] is not None and record["memory_method"]


def test_the_paired_roof_fraction_is_the_median_of_the_rounds(tmp_path):
    import statistics

    points = _points(ns=(32,), backends=("reference", "numba"))
    records = run_sweep(points, tmp_path / "p.jsonl", Options(repeats=3, roof_budget_s=0.01,
                                                               min_time_s=0),
                        threads=1, progress=None, isolate=False)
    for record in records:
        assert record["status"] == "ok", record.get("reason")
        rounds, roofs = record["round_min_s"], record["roof_round_gflops"]
        # The roof's GEMM took a turn in every round the point was timed in.
        assert len(rounds) == len(roofs) == record["rounds"] >= 2
        assert all(g > 0 for g in roofs)
        expected = statistics.median(record["flops"] / t / 1e9 / g for t, g in zip(rounds, roofs))
        assert record["roof_fraction_paired"] == pytest.approx(expected, rel=1e-12)
    # The table shows it beside the fraction of the fastest roof probe, and says what it is.
    from fastattn.bench.table import PAIRED_ROOF_NOTE, format_percent, format_tables

    text = format_tables(records)
    assert PAIRED_ROOF_NOTE in text
    for record in records:
        assert f"({format_percent(record['roof_fraction_paired'])})" in text


def test_a_run_without_a_roof_has_no_paired_fraction(tmp_path):
    record, = run_sweep(_points(ns=(16,))[:1], tmp_path / "n.jsonl",
                        Options(repeats=2, roof=False, min_time_s=0), threads=1, progress=None,
                        isolate=False)
    assert record["status"] == "ok"
    assert "roof_fraction_paired" not in record and record["roof_fraction"] is None


def test_fast_calls_get_more_repeats_for_their_minimum(tmp_path):
    # A fast call keeps being repeated for min_time_s (up to 100 repeats): the more
    # repeats, the likelier one that load left alone.
    record, = run_sweep([Point("linear", "reference", False, 8, d_k=4)], tmp_path / "f.jsonl",
                        Options(repeats=2, roof=False, check=False, min_time_s=0.2),
                        threads=1, progress=None, isolate=False)
    assert 2 < record["repeats"] == len(record["times_s"]) <= 100
    assert record["min_s"] == min(record["times_s"])


def test_sweep_in_worker_process(tmp_path):
    # (the worker with a peer is exercised by test_cli_shows_torch_beside_the_reference)
    points = default_grid(backends=["reference"], ns=(16,), d_k=8)
    records = run_sweep(points, tmp_path / "w.jsonl", Options(repeats=1, roof_budget_s=0.01), threads=1, progress=None)
    assert [r["backend"] for r in records] == [p.backend for p in points]
    for r in records:
        assert r["status"] == "ok", r.get("reason")
        assert r["check_ok"] is True, (r["backend"], r["max_abs_err"])
        assert r["peer"] is False
        # The reference keeps the larger of the peak RSS and tracemalloc's peak.
        assert r["memory_method"] in (("hwm", "tracemalloc") if HWM else ("tracemalloc",))
        if r["memory_method"] == "tracemalloc" and HWM:
            assert r["peak_bytes"] == r["peak_bytes_tracemalloc"]


def test_skips_what_cannot_run_and_says_why(tmp_path):
    points = [Point("softmax", "numba", False, 8), Point("softmax", "reference", False, 8)]
    if "numba" in fastattn.available_backends():
        points[0] = Point("softmax", "reference", False, 2**22)  # 3 n^2 floats: 192 TiB
    records = run_sweep(points, tmp_path / "s.jsonl", Options(repeats=1, roof_budget_s=0.01), threads=1, progress=None,
                        isolate=False)
    assert records[0]["status"] == "skipped" and records[0]["reason"]
    assert records[1]["status"] == "ok"


def test_absent_peer_is_skipped_with_install_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "available_peers", lambda: ())
    records = run_sweep([Point("softmax", "torch", False, 8)], tmp_path / "p.jsonl", Options(repeats=1, roof_budget_s=0.01),
                        threads=1, progress=None, isolate=False)
    assert records[0]["status"] == "skipped"
    assert "pip install" in records[0]["reason"]


def test_resume_keeps_finished_points_and_drops_a_cut_line(tmp_path):
    path = tmp_path / "r.jsonl"
    points = _points(ns=(8, 16, 32))
    first = run_sweep(points, path, Options(repeats=1, roof_budget_s=0.01), threads=1, progress=None, isolate=False)
    # Simulate a run killed after 3 points, in the middle of writing the 4th.
    lines = path.read_text().splitlines(keepends=True)
    header = [ln for ln in lines if json.loads(ln)["record"] != "point"]
    kept = [ln for ln in lines if json.loads(ln)["record"] == "point"][:3]
    path.write_text("".join(header + kept) + '{"schema": "fastattn.res')
    second = run_sweep(points, path, Options(repeats=1, roof_budget_s=0.01), threads=1, progress=None, isolate=False)
    assert len(second) == len(points)
    assert [r["started"] for r in second[:3]] == [r["started"] for r in first[:3]]
    assert len({r["run_id"] for r in second[:3]}) == 1
    assert second[3]["run_id"] != second[0]["run_id"]  # measured again, by the new run
    stored = [r for r in read_records(path) if r["record"] == "point"]
    assert len(stored) == len(points)  # nothing measured twice
    # A third run finds everything and measures nothing.
    before = path.read_bytes()
    run_sweep(points, path, Options(repeats=1), threads=1, progress=None, isolate=False)
    assert path.read_bytes() == before


def test_resume_after_a_real_interrupt(tmp_path):
    path = tmp_path / "i.jsonl"
    script = textwrap.dedent(f"""
        from fastattn.bench.sweep import Options, default_grid, run_sweep
        points = default_grid(backends=["reference"], ns=[8 * i for i in range(1, 200)], d_k=4)
        run_sweep(points, {str(path)!r}, Options(repeats=1, memory=False, roof=False), threads=1,
                  progress=None, isolate=False)
    """)
    # Ctrl-C must reach the child whatever disposition this process passes on (an
    # ignored SIGINT is inherited, and Python then installs no handler).
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while time.time() < deadline:
        if path.exists() and path.read_text().count('"record": "point"') >= 3:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the sweep wrote no point within 60 s")
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode != 0, "the sweep finished before it was interrupted"
    assert b"KeyboardInterrupt" in err
    done = [r for r in read_records(path) if r["record"] == "point"]
    assert 3 <= len(done) < 4 * 199
    points = default_grid(backends=["reference"], ns=[8 * i for i in range(1, 200)], d_k=4)
    records = run_sweep(points[: len(done) + 2], path, Options(repeats=1, memory=False, roof_budget_s=0.01), threads=1,
                        progress=None, isolate=False)
    assert [r["started"] for r in records[: len(done)]] == [r["started"] for r in done]
    assert all(r["status"] == "ok" for r in records)


@pytest.mark.parametrize("content", [
    "hello, not json\n",
    json.dumps({"schema": "someone.else/2", "record": "point"}) + "\n",
    "n,time\n1,2\n",
])
def test_refuses_a_foreign_results_file_and_leaves_it(tmp_path, content):
    path = tmp_path / "foreign.jsonl"
    path.write_text(content)
    with pytest.raises(ResultsFileError, match="not a fastattn"):
        run_sweep(_points(ns=(8,)), path, threads=1, progress=None, isolate=False)
    assert path.read_text() == content
    with pytest.raises(ResultsFileError):
        run_sweep(_points(ns=(8,)), path, threads=1, progress=None, isolate=False,
                  resume=False)
    assert path.read_text() == content


def test_refuses_a_corrupt_line_in_the_middle(tmp_path):
    path = tmp_path / "c.jsonl"
    run_sweep(_points(ns=(8,)), path, Options(repeats=1, roof_budget_s=0.01), threads=1,
              progress=None, isolate=False)
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(1, "{broken\n")
    path.write_text("".join(lines))
    before = path.read_bytes()
    with pytest.raises(ResultsFileError, match=":2"):
        run_sweep(_points(ns=(8, 16)), path, threads=1, progress=None, isolate=False)
    assert path.read_bytes() == before


def test_points_of_one_shape_take_turns_and_others_are_timed_alone(tmp_path, monkeypatch):
    """The backends of one shape are timed in rounds, one repeat each, the first of each
    round one further on (load then falls on every backend alike); a shape measured on
    one backend only gets its repeats in one go."""
    from conftest import FAST_BACKENDS

    if not FAST_BACKENDS:
        pytest.skip("no fast backend built")
    fast = FAST_BACKENDS[0]
    turns, make_call, time_call = [], engine.make_call, engine.time_call

    def tagged(spec, q, k, v):
        call = make_call(spec, q, k, v)
        return lambda: (turns.append(spec["backend"]), call())[1]

    timed = []

    def logged(call, repeats, *args, **kwargs):
        first = len(turns)
        timing = time_call(call, repeats, *args, **kwargs)
        timed.append(turns[first])
        return timing

    monkeypatch.setattr(engine, "make_call", tagged)
    monkeypatch.setattr(engine, "time_call", logged)
    points = [Point("softmax", "reference", False, 64, d_k=8, d_v=8),
              Point("softmax", fast, False, 64, d_k=8, d_v=8),
              Point("softmax", "reference", False, 32, d_k=8, d_v=8)]
    records = run_sweep(points, tmp_path / "turns.jsonl",
                        Options(repeats=3, memory=False, check=False, roof=False, min_time_s=0),
                        threads=1, progress=None, isolate=False)
    assert timed == ["reference", fast, fast, "reference", "reference", fast, "reference"]
    together, alone = records[:2], records[2]
    for record in together:
        assert record["status"] == "ok"
        assert record["rounds"] == 3 and record["repeats"] == len(record["times_s"]) == 3
        assert record["round_min_s"] == record["times_s"]   # one repeat a round
        assert record["min_s"] == min(record["times_s"]) <= record["median_s"]
    assert alone["rounds"] == 1 and alone["repeats"] == 3
    # Fewer rounds than repeats (the report's): a turn times several, 3 = 2 + 1.
    timed.clear()
    records = run_sweep(points[:2], tmp_path / "rounds.jsonl",
                        Options(repeats=3, rounds=2, memory=False, check=False, roof=False,
                                min_time_s=0),
                        threads=1, progress=None, isolate=False)
    assert timed == ["reference", fast, fast, "reference"]
    assert [(r["rounds"], r["repeats"]) for r in records] == [(2, 3), (2, 3)]
    with pytest.raises(ValueError, match="rounds"):
        Options(rounds=0)


@pytest.mark.parametrize("estimate_s, warms", [(1e-3, True), (engine.TURN_WARM_S, False)])
def test_a_turn_of_a_short_call_starts_with_untimed_calls(estimate_s, warms):
    """The previous turn (another implementation, the roof's GEMM) leaves the caches
    holding its data, and a core waking from idle runs slow for its first milliseconds:
    a short call's turn first makes TURN_WARMUP_S of calls it does not time (one at
    least); a call of TURN_WARM_S or more is timed at once."""
    from fastattn.bench.sweep import _serve

    made = []   # the start of each call
    state = {"calls": {"p": (lambda: made.append(time.perf_counter()), estimate_s)},
             "peers_only": True}
    timing = _serve(("time", {"key": "p", "repeats": 3, "min_time_s": 0, "max_repeats": 3}),
                    state)
    assert timing["repeats"] == 3
    timed = timing["number"] * timing["repeats"]
    warm = made[:len(made) - timed]
    if warms:
        assert warm and made[-timed] - warm[0] >= engine.TURN_WARMUP_S
    else:
        assert warm == []


def test_warm_up_makes_one_call_at_least():
    made = []
    assert engine.warm_up(lambda: made.append(1), 0) == len(made) == 1
    assert engine.warm_up(lambda: made.append(1), 0.005) == len(made) - 1 > 1


def test_a_first_call_that_stalls_does_not_use_up_the_warm_up(monkeypatch):
    # Right after an idle turn the first call may stall longer than the whole
    # warm-up: the warm-up's clock starts after it, so fast calls still follow.
    # A fake clock that moves only in calls (the first stalls for twice the warm-up,
    # then 1 ms a call) keeps the test free of the machine's load.
    clock = [0.0]

    def call():
        clock[0] += 2 * engine.TURN_WARMUP_S if clock[0] == 0 else 1e-3

    monkeypatch.setattr(engine.time, "perf_counter", lambda: clock[0])
    made = engine.warm_up(call)
    assert made - 1 == pytest.approx(engine.TURN_WARMUP_S / 1e-3, abs=1)


def test_bench_says_a_kind_prefixed_shape_overrides_kind(tmp_path, capsys):
    argv = ["bench", "--kind", "softmax", "--shape", "linear:1x1x8x4", "--causal", "no",
            "--backends", "reference", "--repeats", "1", "--no-memory", "--no-progress",
            "--out", str(tmp_path / "k.jsonl")]
    assert main(argv) == 0
    assert "a --shape prefixed with its kind (linear:..., softmax:...) measures that kind " \
        "whatever --kind says" in capsys.readouterr().err
    records = [r for r in read_records(tmp_path / "k.jsonl") if r["record"] == "point"]
    assert records and {r["attention"] for r in records} == {"linear"}


def test_bench_says_which_options_its_points_ignore(tmp_path, capsys):
    argv = ["bench", "--kind", "softmax", "--regime", "decode", "--causal", "no",
            "--feature-map", "relu", "--n", "8", "--backends", "reference", "--repeats", "1",
            "--no-memory", "--no-progress", "--out", str(tmp_path / "notes.jsonl")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "a decode point is causal" in err and "--causal no applies to the prefill" in err
    assert "--kind softmax ignores it" in err and "whatever --kind says" not in err
    records = [r for r in read_records(tmp_path / "notes.jsonl") if r["record"] == "point"]
    assert records and all(r["causal"] for r in records)


def test_bench_refuses_a_run_with_nothing_to_measure(tmp_path, capsys, monkeypatch):
    from fastattn.bench import sweep

    # The numpy peer times linear attention's recurrent step only: softmax gives no point.
    out = tmp_path / "empty.jsonl"
    for regime in ("prefill", "decode"):
        assert main(["bench", "--backends", "numpy", "--kind", "softmax", "--regime", regime,
                     "--n", "8", "--no-progress", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"nothing to measure: numpy has no softmax attention ({regime})" in err
    assert not out.exists()
    # Beside a backend that has the points, the idle peer is named, not dropped silently.
    swept = []

    def sweep_then_stop(points, *args, **kwargs):
        swept.extend(points)
        raise KeyboardInterrupt
    monkeypatch.setattr(sweep, "run_sweep", sweep_then_stop)
    assert main(["bench", "--backends", "reference", "numpy", "--kind", "softmax", "--n", "8",
                 "--causal", "no", "--no-progress", "--out", str(out)]) == 130
    assert "note: numpy has no softmax attention (prefill) to race, so it is not measured" \
        in capsys.readouterr().err
    assert swept and {p.backend for p in swept} == {"reference"}


def test_an_interrupted_bench_names_its_results_file(tmp_path, capsys, monkeypatch):
    from fastattn.bench import sweep

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    out = tmp_path / "cut short.jsonl"
    argv = ["bench", "--kind", "softmax", "--n", "8", "--threads", "1", "--repeats", "1",
            "--backends", "reference", "--no-progress", "--out", str(out)]
    with monkeypatch.context() as patch:
        patch.setattr(sweep, "run_sweep", interrupted)
        assert main(argv + ["--fresh"]) == 130
    err = capsys.readouterr().err
    assert "no point was measured yet" in err and "so far" not in err   # none is there
    assert f"--out '{out}'" in err and "without --fresh" in err
    assert main(argv) == 0   # one point measured, then a resumed run interrupted
    capsys.readouterr()
    monkeypatch.setattr(sweep, "run_sweep", interrupted)
    assert main(argv[:4] + ["8", "16"] + argv[5:]) == 130
    assert f"the points measured so far are in {out}" in capsys.readouterr().err


def test_a_full_disk_is_said_with_the_results_file_not_a_traceback(tmp_path, capsys, monkeypatch):
    import errno

    from fastattn.bench import sweep

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    (tmp_path / "Runs").mkdir()
    out = tmp_path / "Runs" / "My Run.jsonl"   # named as given, capitals and all
    monkeypatch.setattr(sweep, "run_sweep", disk_full)
    assert main(["bench", "--kind", "softmax", "--n", "8", "--backends", "reference",
                 "--no-progress", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "fastattn bench: No space left on device: the points written before it are in " \
        f"{out}" in err and "Traceback" not in err
    assert f"--out '{out}'" in err


def test_run_sweep_validates_arguments(tmp_path):
    with pytest.raises(TypeError, match="Point"):
        run_sweep([("softmax", "reference")], tmp_path / "x.jsonl", progress=None)
    with pytest.raises(ValueError, match="threads"):
        run_sweep(_points(), tmp_path / "x.jsonl", threads=0, progress=None)
    assert not (tmp_path / "x.jsonl").exists()


# ---------------------------------------------------------------- accuracy check

def test_check_flags_an_output_that_disagrees():
    spec = Point("softmax", "reference", True, 16, d_k=8, d_v=8).spec()
    q, k, v = engine.make_inputs(spec)
    good = fastattn.softmax_attention(q, k, v, causal=True, backend="reference")
    refs = engine.ReferenceCache()
    assert engine.check_accuracy(spec, good, refs)["check_ok"]
    bad = good.copy()
    bad[0, 5, 3] += 0.01
    result = engine.check_accuracy(spec, bad, refs)
    assert result["check_ok"] is False
    assert result["max_abs_err"] == pytest.approx(0.01, rel=1e-3)


def test_check_at_a_smaller_n_when_the_reference_does_not_fit():
    spec = Point("softmax", "reference", False, 64, d_k=4, d_v=4, dtype="float64").spec()
    q, k, v = engine.make_inputs(spec)
    out = fastattn.softmax_attention(q, k, v, backend="reference")
    # 4 arrays of n^2 float64: 32 KiB at n=32 fits 40 KiB, 128 KiB at n=64 does not
    result = engine.check_accuracy(spec, out, engine.ReferenceCache(), max_bytes=40 * 2**10)
    assert result["check_n"] == 32
    assert result["check_ok"] and result["max_abs_err"] < 1e-12


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_torch_peers_agree_with_the_reference(attention, causal):
    spec = Point(attention, "torch", causal, 33, d_k=8, d_v=5, batch=2, heads=3,
                 dtype="float64").spec()
    q, k, v = engine.make_inputs(spec)
    out = engine.make_call(spec, q, k, v)()
    if attention == "softmax":
        ref = fastattn.softmax_attention(q, k, v, causal=causal, backend="reference")
    else:
        ref = fastattn.linear_attention(q, k, v, causal=causal, backend="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------- memory probe

def _warm(call):
    call()  # warm-up
    return call


def _reference_softmax_call(n):
    q, k, v = engine.make_inputs(Point("softmax", "reference", False, n).spec())
    return _warm(lambda: fastattn.softmax_attention(q, k, v, backend="reference"))


HWM = engine.hwm_available()


@pytest.mark.skipif(not HWM, reason="no /proc/self/clear_refs here")
def test_memory_probe_sees_the_quadratic_reference_grow_as_n_squared():
    # Large enough that the n x n arrays dwarf what earlier tests leave in the heap.
    small, large = 2048, 4096
    peak_small, method, _ = engine.peak_extra_bytes(_reference_softmax_call(small))
    peak_large, _, _ = engine.peak_extra_bytes(_reference_softmax_call(large))
    assert method == "hwm"
    matrix = large * large * 4  # one float32 n x n array
    # The reference holds between 1 and 6 such arrays at its peak, never the interpreter.
    assert matrix <= peak_large <= 6 * matrix
    assert 3.0 <= peak_large / peak_small <= 5.0
    # tracemalloc sees the same NumPy buffers
    peak_traced, method, _ = engine.peak_extra_bytes(_reference_softmax_call(large),
                                                     "tracemalloc")
    assert method == "tracemalloc"
    assert peak_traced == pytest.approx(peak_large, rel=0.25)


@pytest.mark.skipif(not HWM, reason="no /proc/self/clear_refs here")
def test_memory_probe_sees_linear_attention_stay_linear():
    n = 4096
    q, k, v = engine.make_inputs(Point("linear", "reference", False, n).spec())
    peak, _, _ = engine.peak_extra_bytes(
        _warm(lambda: fastattn.linear_attention(q, k, v, backend="reference")))
    assert peak >= n * 64 * 4  # at least the output
    assert peak < n * n * 4 / 4  # far below one n x n array


@pytest.mark.skipif(not HWM, reason="no /proc/self/clear_refs here")
def test_the_sweep_worker_probe_agrees_on_the_quadratic_reference(tmp_path):
    # (was: the fresh-process probe; the one probe now runs in the sweep's worker)
    n = 4096
    record, = run_sweep([Point("softmax", "reference", False, n)], tmp_path / "m.jsonl",
                        Options(repeats=1, check=False, roof=False), threads=1, progress=None)
    assert record["memory_method"] in ("hwm", "tracemalloc")   # the larger of the two
    assert 0.5 * n * n * 4 <= record["peak_bytes"] <= 6 * n * n * 4


def test_a_small_reference_point_holds_at_least_its_scores(tmp_path):
    # n = 256: the 256 x 256 float32 scores alone are 256 KiB, about what the peak RSS can
    # miss (Linux adds a thread's pages in steps); the reference keeps tracemalloc's figure
    # when it is the larger.
    n = 256
    records = run_sweep([Point("softmax", "reference", False, n)], tmp_path / "s.jsonl",
                        Options(repeats=1, check=False, roof=False), threads=1, progress=None)
    record, = records
    assert record["peak_bytes"] >= n * n * 4
    assert record["peak_bytes"] >= (record.get("peak_bytes_tracemalloc") or 0)


def test_a_point_past_its_timeout_is_an_error_and_the_sweep_goes_on(tmp_path):
    # 100 repeats of a ~0.1 s call cannot finish in 2 s; of a ~2 ms repeat they can.
    points = [Point("softmax", "reference", False, 4096),
              Point("softmax", "reference", False, 8)]
    records = run_sweep(points, tmp_path / "t.jsonl", Options(repeats=100, memory=False, check=False, roof=False, point_timeout_s=2.0), threads=1, progress=None)
    assert records[0]["status"] == "error" and "timed out" in records[0]["reason"]
    assert records[1]["status"] == "ok"


def test_tracemalloc_probe_counts_an_allocation():
    nbytes = 8 * 2**20
    peak, _, _ = engine.peak_extra_bytes(lambda: np.ones(nbytes // 8), "tracemalloc")
    assert nbytes <= peak < nbytes + 2**20


# ---------------------------------------------------------------- CLI

def test_cli_unknown_backend_lists_the_available_ones(capsys):
    assert main(["bench", "--backends", "nope", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown backend 'nope'" in err and "reference" in err


@pytest.mark.parametrize("argv", [
    ["bench", "--n", "0"],
    ["bench", "--n", "ten"],
    ["bench", "--kind", "cosine"],
    ["bench", "--causal", "maybe"],
    ["bench", "--dtype", "float16"],
    ["bench", "--threads", "-1"],
])
def test_cli_bad_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_baseline_must_be_measured(capsys, tmp_path):
    code = main(["bench", "--backends", "reference", "--baseline", "cython",
                 "--out", str(tmp_path / "b.jsonl")])
    assert code == 2
    assert "--baseline" in capsys.readouterr().err
    assert not (tmp_path / "b.jsonl").exists()


def test_cli_refuses_to_overwrite_a_foreign_csv_beside_out(capsys, tmp_path):
    csv_path = tmp_path / "r.csv"
    csv_path.write_text("my,own\n1,2\n")
    code = main(["bench", "--kind", "softmax", "--causal", "no", "--n", "8", "--threads", "1",
                 "--repeats", "1", "--backends", "reference", "--out", str(tmp_path / "r.jsonl"),
                 "--no-progress", "--no-memory"])
    assert code == 2
    assert "not a fastattn results CSV" in capsys.readouterr().err
    assert csv_path.read_text() == "my,own\n1,2\n"
    assert not (tmp_path / "r.jsonl").exists()  # refused before measuring


def test_cli_refuses_foreign_out(capsys, tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text("my notes\n")
    assert main(["bench", "--kind", "softmax", "--n", "8", "--backends", "reference",
                 "--out", str(path), "--no-progress"]) == 2
    assert "not a fastattn" in capsys.readouterr().err
    assert path.read_text() == "my notes\n"


@pytest.mark.parametrize("fresh", [[], ["--fresh"]])
def test_cli_refuses_a_corrupt_out_and_says_what_to_do(capsys, tmp_path, fresh):
    out = tmp_path / "run.jsonl"
    assert main(["bench", "--kind", "softmax", "--n", "8", "--backends", "reference",
                 "--repeats", "1", "--no-memory", "--out", str(out), "--no-progress"]) == 0
    lines = out.read_text().splitlines()
    lines.insert(1, '{"schema": "fastattn.results/1", "rec')   # a line overwritten
    out.write_text("\n".join(lines) + "\n")
    before = out.read_text()
    capsys.readouterr()
    assert main(["bench", "--kind", "softmax", "--n", "16", "--backends", "reference",
                 "--repeats", "1", "--no-memory", "--out", str(out), "--no-progress",
                 *fresh]) == 2
    err = capsys.readouterr().err
    assert f"{out}:2 is corrupt" in err and "repair or remove that line" in err
    assert "another --out" in err
    assert out.read_text() == before   # neither resumed nor replaced


def test_cli_says_what_a_resumed_out_keeps_and_drops(capsys, tmp_path):
    out = tmp_path / "run.jsonl"
    base = ["bench", "--kind", "softmax", "--causal", "no", "--backends", "reference",
            "--threads", "1", "--repeats", "1", "--no-memory", "--no-progress", "--out", str(out)]
    assert main(base + ["--n", "8", "16"]) == 0
    capsys.readouterr()
    # Cut the last point short, as a run killed mid-write leaves it.
    data = out.read_bytes()
    out.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 1] + b'{"schema": "fastattn.res')
    assert main(base + ["--n", "8", "16", "32"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "cut short by an interrupted write" in err and "byte(s) were dropped" in err
    assert f"resuming {out}: 1 of this command's 3 points on 1 thread are there already" in err
    assert "measuring the other 2" in err
    assert "earlier commands" not in captured.out
    # Another grid into the same file: the side files hold this command's points, and it says so.
    assert main(base + ["--n", "64"]) == 0
    text = capsys.readouterr().out
    assert f"{out} also holds 3 point(s) of earlier commands" in text
    csv_rows = out.with_suffix(".csv").read_text().splitlines()[1:]
    assert len(csv_rows) == 1 and len([r for r in read_records(out) if r["record"] == "point"]) == 4
    # --fresh says nothing of resuming.
    assert main(base + ["--n", "8", "--fresh"]) == 0
    assert "resuming" not in capsys.readouterr().err


def test_cli_without_torch_says_how_to_add_it(capsys, tmp_path, monkeypatch):
    # every peer but numpy's absent, whatever is installed here
    monkeypatch.setattr(peers, "_findable", lambda module: module == "numpy")
    out = tmp_path / "b.jsonl"
    code = main(["bench", "--kind", "softmax", "--n", "8", "16", "--threads", "1",
                 "--repeats", "1", "--d-k", "8", "--out", str(out), "--no-progress"])
    assert code == 0
    text = capsys.readouterr().out
    assert "torch is not installed" in text and peers.INSTALL_HINT["torch"] in text
    # Once for each absent peer, before the run; not again after the tables.
    assert text.count("add it, in the fastattn checkout, with") == len(peers.absent_peers()) >= 1
    assert "to compare with it" not in text
    assert "vs reference" in text and "GFLOP/s" in text
    csv_lines = out.with_suffix(".csv").read_text().splitlines()
    assert csv_lines[0].startswith("attention,backend")
    # full and causal at two n, for every backend built here (no peers)
    assert len(csv_lines) == 1 + 2 * 2 * len(fastattn.available_backends())
    assert all(r["schema"] == SCHEMA for r in read_records(out))
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert [c["config"]["causal"] for c in summary["configurations"]] == [False, True]
    assert all(row["vs_baseline"] == 1.0 for c in summary["configurations"]
               for row in c["rows"] if row["backend"] == "reference")  # against itself


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_cli_shows_torch_beside_the_reference(capsys, tmp_path):
    code = main(["bench", "--kind", "both", "--causal", "yes", "--n", "16", "--threads", "1",
                 "--repeats", "1", "--d-k", "8", "--out", str(tmp_path / "t.jsonl"),
                 "--no-progress"])
    assert code == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("16 ")]
    assert {row[1] for row in rows} >= {"reference", "torch"}
    assert "MISMATCH" not in text


def test_cli_refuses_a_directory_as_out(capsys, tmp_path):
    assert main(["bench", "--kind", "softmax", "--n", "8", "--backends", "reference",
                 "--out", str(tmp_path), "--no-progress"]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("startup", [[], ["--startup"]])
def test_cli_refuses_an_out_in_a_missing_folder_and_makes_none(capsys, tmp_path, startup):
    out = tmp_path / "no" / "such" / "r.jsonl"
    assert main(["bench", *startup, "--kind", "softmax", "--n", "8", "--backends", "reference",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error: --out" in err and f"the folder {out.parent} does not exist" in err
    assert not (tmp_path / "no").exists()


def test_cli_takes_several_kinds(tmp_path):
    argv = ["bench", "--kind", "softmax", "linear", "--causal", "no", "--n", "8",
            "--threads", "1", "--repeats", "1", "--backends", "reference", "--no-memory",
            "--no-check", "--no-progress", "--out", str(tmp_path / "k.jsonl")]
    assert main(argv) == 0
    points = [r for r in read_records(tmp_path / "k.jsonl") if r["record"] == "point"]
    assert sorted(r["attention"] for r in points) == ["linear", "softmax"]


def test_cli_versus_of_a_directory_says_a_results_file_was_expected(capsys, tmp_path):
    assert main(["bench", "--versus", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--versus {tmp_path} is a directory" in err and "results file" in err
    assert "no results file" not in err


def test_roof_is_the_best_probe_of_the_dtype_not_a_slow_one():
    roof_for = engine.roof_for
    probes = [{"dtype": "float32", "shape": [n, 64, n], "gflops": g}
              for n, g in ((256, 0.5), (1024, 90.0), (4096, 110.0))]
    probes.append({"dtype": "float64", "shape": [4096, 64, 4096], "gflops": 50.0})
    probes.append({"dtype": "float32", "shape": [4096, 128, 4096], "gflops": 300.0})
    assert roof_for(probes, "float32", 64) == 110.0
    assert roof_for(probes, "float64", 64) == 50.0
    assert roof_for(probes, "float16", 64) is None


def test_idle_cores_leaves_out_the_cores_other_work_keeps_busy(monkeypatch):
    import psutil

    from fastattn.bench import environment, sweep

    monkeypatch.setattr(environment, "default_num_threads", lambda: 2)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 2)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False: [100.0, 3.0])
    assert sweep.idle_cores() == 1          # one core kept busy by another process
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False: [2.0, 5.0])
    assert sweep.idle_cores() == 2
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False: [100., 100.])
    assert sweep.idle_cores() == 1          # never fewer than one thread


_FAULTS_CHILD = r"""
import resource, sys
import numpy as np
from fastattn.bench import engine

def faults_per_call(call, calls=50):
    for _ in range(5):
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        call()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls

call = lambda: np.empty(256 * 1024 // 8).fill(1.0)   # a kernel's 256 KiB output, written
print(faults_per_call(call))
engine.peak_extra_bytes(call)                          # the memory probe, then timing again
print(faults_per_call(call))
"""


@pytest.mark.skipif(engine._LIBC is None, reason="glibc's mallopt is not available here")
def test_timed_calls_reuse_heap_pages_before_and_after_the_memory_probe():
    # The probe serves every block >= 64 KiB by its own mmap; set process-wide (as it
    # once was, on importing the engine), every timed call faulted its arrays in afresh.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS_CHILD], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    pages = 256 // 4
    assert [float(x) < pages / 4 for x in out] == [True, True], out


def test_a_point_far_above_its_roof_is_called_a_slowed_probe():
    from fastattn.bench.table import FAR_ABOVE_ROOF, far_above_roof

    records = [{"roof_fraction": 1.2}, {"roof_fraction": FAR_ABOVE_ROOF * 1.5},
               {"roof_fraction": None}, {}]
    assert far_above_roof(records) == [records[1]]


@pytest.mark.parametrize("seconds, text", [
    (812e-6, "812 µs"), (12.34e-3, "12.3 ms"), (1.414, "1.41 s"), (3e-8, "30 ns"),
    (999.6e-6, "1 ms"), (0.99996, "1 s"), (999.96e-9, "1 µs"), (1234.0, "1230 s"),
    (None, "–"), (1e308, "1e+308 s"), (2.5e6, "2.5e+06 s"),
], ids=lambda x: repr(x))
def test_times_are_written_in_the_unit_they_round_to(seconds, text):
    from fastattn.bench.table import format_seconds

    assert format_seconds(seconds) == text


@pytest.mark.parametrize("nbytes, text", [
    (512, "512 B"), (1536, "1.5 KiB"), (72 * 2**20, "72 MiB"), (150 * 2**30, "150 GiB"),
    (1e308, "9.31e+298 GiB"), (None, "–"),
], ids=lambda x: repr(x))
def test_sizes_are_written_short_even_when_absurd(nbytes, text):
    from fastattn.bench.table import format_bytes

    assert format_bytes(nbytes) == text


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_cli_backends_naming_no_backend_is_a_usage_error(value, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["bench", "--backends", value, "--out", str(out), "--no-progress"]) == 2
    assert "--backends names no backend" in capsys.readouterr().err
    assert main(["bench", "--startup", "--backends", value, "--out", str(out)]) == 2
    assert "--backends names no backend" in capsys.readouterr().err
    assert not out.exists()


def test_cli_backends_are_split_on_commas_and_spaces_trimmed(tmp_path):
    from fastattn.bench.cli import backend_names
    assert backend_names(["reference, numpy", "reference"]) == ["reference", "numpy"]
    assert backend_names(None) is None


@pytest.mark.parametrize("name", ["x.md", "x.csv", "x.summary.json", "X.MD", "x.jsonl.md"])
def test_cli_out_naming_a_file_written_beside_the_results_is_refused_first(name, tmp_path,
                                                                           capsys):
    out = tmp_path / name
    assert main(["bench", "--kind", "softmax", "--n", "8", "--backends", "reference",
                 "--threads", "1", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out names the JSON-lines results file" in err
    assert f"--out {tmp_path / (name[0] + '.jsonl')}" in err
    assert ".jsonl.jsonl" not in err
    assert not any(tmp_path.iterdir())  # refused before anything was measured or written


@pytest.mark.parametrize("command", ["bench", "report"])
def test_help_names_the_repeats_it_speaks_of(command, capsys):
    # "never under 3 or R if smaller": R must be the option's own placeholder.
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "or R if smaller" in text and "--repeats R " in text


def test_cli_names_no_absent_peer_when_the_backends_are_named(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "available_peers", lambda: ())
    assert main(["bench", "--kind", "softmax", "--n", "8", "--threads", "1", "--repeats", "1",
                 "--d-k", "8", "--backends", "reference", "--out", str(tmp_path / "b.jsonl"),
                 "--no-progress"]) == 0
    assert "pip install" not in capsys.readouterr().out   # no peer was asked for


def test_ctrl_c_while_the_worker_starts_leaves_nothing_to_join(monkeypatch):
    # Found by a new-user trial: close() joined a process whose start() was interrupted
    # ("AssertionError: can only join a started process" after the KeyboardInterrupt).
    import multiprocessing.context

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", interrupted)
    worker = sweep._Worker(1)
    with pytest.raises(KeyboardInterrupt):
        worker.request("environment", {"threads": 1})
    assert worker.process is None
    worker.close()   # no AssertionError


# --- issue 33 item 12: SIGTERM while measuring ------------------------------------------
def _terminate_while_measuring(tmp_path, argv, results_glob, group=False):
    """Run ``fastattn argv`` in a subprocess, SIGTERM it (or its process group) once its
    results file holds a point; returns (exit code, stderr, the file's records)."""
    code = f"import sys; from fastattn.cli import main; sys.exit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=group)
    deadline = time.time() + 180
    while time.time() < deadline:
        found = sorted(tmp_path.glob(results_glob))
        if found and found[0].read_text().count('"record": "point"') >= 1:
            break
        if proc.poll() is not None:
            pytest.fail(f"ended before it was signalled:\n{proc.communicate()[1]}")
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("no point within 180 s")
    if group:
        os.killpg(proc.pid, signal.SIGTERM)   # as a service manager or `timeout` does
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)   # also waits for a worker holding stderr
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err, read_records(found[0])


BENCH_ARGV = ["bench", "--n", *map(str, range(8, 8 * 80, 8)), "--backends", "reference",
              "--repeats", "3", "--no-progress", "--threads", "1", "--out", "t.jsonl"]


@pytest.mark.parametrize("group", [False, True], ids=["process", "process-group"])
def test_sigterm_to_bench_stops_quietly_keeps_the_points_and_says_how_to_resume(tmp_path, group):
    code, err, records = _terminate_while_measuring(tmp_path, BENCH_ARGV, "t.jsonl", group)
    assert code == 143, err   # 128 + SIGTERM, not killed by it (-15)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "terminated (SIGTERM): the points measured so far are in t.jsonl; to measure the " \
           "rest, run the same command with --out t.jsonl" in err
    done = [r for r in records if r["record"] == "point"]
    assert 1 <= len(done) < 79 and all(r["status"] == "ok" for r in done)


def test_sigterm_to_report_while_measuring_prints_the_resume_command(tmp_path):
    argv = ["report", "--quick", "--threads", "1", "--out", "r.html"]
    code, err, records = _terminate_while_measuring(tmp_path, argv, "reports/*.jsonl")
    assert code not in (0, -signal.SIGTERM), err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert "interrupted: the points measured so far are in reports/" in err
    assert re.search(r"continue with\n  .* report --resume reports/\S+\.jsonl --quick", err), err
    assert any(r["record"] == "point" for r in records)
    assert not (tmp_path / "r.html").exists()


def test_sigterm_handler_is_only_in_place_while_measuring(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    run_sweep(_points(ns=(8,)), tmp_path / "s.jsonl", Options(repeats=1, roof=False),
              threads=1, progress=None, isolate=False)
    assert signal.getsignal(signal.SIGTERM) is before

    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)   # a caller's own handler is left be
    try:
        with sweep._terminate_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


# openvino: a causal mask in prefill; onnxruntime: a square array of weights (its record has
# no decode call: why_not is replaced to ask for the estimate alone).
@pytest.mark.parametrize("peer", ["openvino", "onnxruntime"])
def test_a_peer_decode_step_is_not_skipped_for_an_n_k_by_n_k_array(peer, monkeypatch):
    """A decode step's scores are one row per head, and its call is unmasked: a peer's memory
    estimate counts n_q x n_k, not the n_k x n_k of a prefill (OpenVINO's 65536-key step was
    skipped as needing 132,096 MiB)."""
    monkeypatch.setattr(peers, "available_peers", lambda: (peer,))
    monkeypatch.setattr(peers, "why_not", lambda *args: None)
    monkeypatch.setattr(engine, "available_bytes", lambda: 8 * 2**30)
    spec = {"attention": "softmax", "backend": peer, "causal": True, "dtype": "float32",
            "batch": 1, "heads": 8, "n_q": 1, "n_k": 65536, "d_k": 64, "d_v": 64,
            "regime": "decode"}
    assert engine.why_skip(spec) is None
    prefill = dict(spec, regime="prefill", n_q=65536)
    assert "needs about" in engine.why_skip(prefill)
    record = peers.PEERS[peer]
    step = record.extra_bytes("softmax", True, 8, 1, 65536, 64, 64, 4, "decode")
    assert step == record.extra_bytes("softmax", False, 8, 1, 65536, 64, 64, 4, "decode")
    assert step < 8 * 65536 * 65536 * 4 / 100      # far below one n_k x n_k array of scores
