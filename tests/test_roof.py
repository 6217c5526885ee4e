"""The roof a reader can trust, ``fastattn bench --shape`` / ``--threads`` and the
best-fastattn / best-peer table (issue 12).  No test here asserts a timing."""

import argparse
import json
import re

import numpy as np
import pytest

from fastattn.bench import engine, peers, table
from fastattn.bench.cli import shape_arg
from fastattn.bench.results import SCHEMA, ResultsFileError, read_records
from fastattn.bench.sweep import Options, Point, run_sweep
from fastattn.cli import main
from fastattn.report import analysis, roof
from fastattn.report.build import build_report

from test_report import synthetic_records

HAVE_TORCH = "torch" in peers.available_peers()


# ------------------------------------------------------------------ the probe
def test_probe_roof_probes_every_n_asked_and_labels_library_and_time():
    shapes = [(96, 16), (200, 16), (3 * engine.MAX_PROBE_N, 8)]
    probed = engine.probe_roof(shapes, ["float32"], budget_s=0.003, rounds=1)
    gemm = [r for r in probed if r["probe"] == "gemm"]
    # Each n as asked (not rounded to a power of two), a larger one at MAX_PROBE_N, and
    # the lengths where the GEMM runs fastest at every d of the run.
    peaks = [(n, d, n) for d in (8, 16) for n in engine.PEAK_PROBE_N]
    asked = [(96, 16, 96), (200, 16, 200)]
    assert sorted(tuple(r["shape"]) for r in gemm) in (
        sorted(asked + peaks + [(engine.MAX_PROBE_N, 8, engine.MAX_PROBE_N)]),
        sorted(asked + peaks))  # no room for the largest
    for r in probed:
        assert r["library"] == "numpy"
        # The GEMMs name the BLAS under NumPy; the exp rate is NumPy's own loop.
        assert ("through NumPy" if r["probe"] == "gemm" else "np.exp of NumPy") in r["blas"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", r["probed_at"])
    assert all(r["gflops"] > 0 for r in gemm)


def test_probe_roof_refuses_an_unknown_library():
    with pytest.raises(ValueError, match="library must be one of"):
        engine.probe_roof([(64, 8)], ["float32"], library="blis")


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_probe_is_labelled_mkl_through_torch():
    import torch

    probed = engine.probe_roof([(64, 8)], ["float32"], budget_s=0.003, rounds=1, library="torch")
    # n = 64 and the peak lengths; no exp probe through torch
    assert [r["probe"] for r in probed] == ["gemm"] * (1 + len(engine.PEAK_PROBE_N))
    for r in probed:
        assert r["blas"].endswith(f"through torch {torch.__version__}")
        assert r["blas"].startswith("MKL" if torch.backends.mkl.is_available() else "BLAS")


def _probe(n, gflops, blas, d=64, dtype="float32", threads=2):
    return {"record": "roof", "probe": "gemm", "dtype": dtype, "threads": threads,
            "shape": [n, d, n], "gflops": gflops, "blas": blas,
            "probed_at": "2026-12-01 10:00:00 UTC"}


def test_roof_is_the_faster_library_and_says_which():
    roofs = [_probe(1024, 90.0, "OpenBLAS through NumPy"), _probe(4096, 110.0, "OpenBLAS through NumPy"),
             _probe(1024, 120.0, "MKL through torch"), _probe(4096, 100.0, "MKL through torch")]
    probe = engine.roof_probe(roofs, "float32", 64)
    assert (probe["gflops"], probe["blas"]) == (120.0, "MKL through torch")
    assert engine.roof_for(roofs, "float32", 64) == 120.0
    lines = table.roof_statements(roofs)
    mkl = next(line for line in lines if "4096, MKL through torch" in line)
    openblas = next(line for line in lines if "4096, OpenBLAS through NumPy" in line)
    assert "the roof" in mkl and "not the roof" in openblas
    assert "n = 1024, 4096" in mkl and "GEMM n x 64 @ 64 x n" in mkl
    assert "2 threads" in mkl and "probed 2026-12-01 10:00:00 UTC" in mkl
    assert "best 120.0 GFLOP/s (n = 1024)" in mkl


def test_sweep_probes_the_roof_at_every_n_of_the_points_and_records_the_library(tmp_path):
    points = [Point("softmax", "reference", False, n, d_k=8, d_v=8) for n in (24, 40)]
    path = tmp_path / "r.jsonl"
    records = run_sweep(points, path, Options(repeats=1, memory=False, check=False,
                                              roof_budget_s=0.003, min_time_s=0,
                                              roof_libraries=("numpy",)),
                        threads=1, progress=None, isolate=False)
    roofs = [r for r in read_records(path) if r["record"] == "roof" and r["probe"] == "gemm"]
    assert {tuple(r["shape"]) for r in roofs if r["dtype"] == "float32"} == {
        (24, 8, 24), (40, 8, 40), *((n, 8, n) for n in engine.PEAK_PROBE_N)}
    best = max((r for r in roofs if r["dtype"] == "float32"), key=lambda r: r["gflops"])
    for r in records:
        assert r["roof_gflops"] == best["gflops"]
        assert r["roof_blas"] == best["blas"] and r["roof_shape"] == best["shape"]


def test_options_refuse_an_unknown_roof_library():
    with pytest.raises(ValueError, match="roof_libraries"):
        Options(roof_libraries=("numpy", "accelerate"))


# ------------------------------------------------------- kernels above their roof
def _within_roof_records(**kwargs):
    """Synthetic records whose every kernel runs at 20 GFLOP/s, below the GEMM probed at
    n = 1024 (24.5 GFLOP/s) and 4096 (98): no kernel above its roof."""
    records = synthetic_records(**kwargs)
    for r in records:
        if r.get("record") == "point" and r.get("gflops"):
            r["gflops"] = 20.0
    return records


def _above_roof_records():
    records = _within_roof_records(backends=("numba",), ns=(1024, 2048, 4096))
    for r in records:  # numba's linear attention at n = 2048 beats the roof of 98 GFLOP/s
        if r.get("backend") == "numba" and r.get("attention") == "linear" and \
                r.get("n_k") == 2048 and not r.get("causal"):
            r["gflops"] = 150.0
    return records


def test_a_kernel_above_its_roof_is_flagged_with_the_reason():
    records = _above_roof_records()
    _, roofs, points = analysis.split_records(records)
    curve = next(c for c in analysis.curves(points, roofs)
                 if c.backend == "numba" and c.attention == "linear" and not c.causal)
    assert curve.above_roof.tolist() == [False, True, False]
    html = build_report(records, source="synthetic").html
    note = html.split("<b>Above the roof</b>", 1)[1].split("</div>", 1)[0]
    assert "numba linear, non-causal, at n = 2048" in note and "not a bound" in note
    assert re.search(r'class="bad" title="above its roof[^"]*">150<small>[^<]*!', html)


def test_a_kernel_above_the_probe_at_its_own_n_but_below_the_roof_is_not_flagged():
    # Below the roof (98 GFLOP/s, the probe at n = 4096), above the probe at its own n (24.5
    # at 1024): its % roof is below 100, so no "!" and no ring, as in the bench's table.
    records = _within_roof_records(backends=("numba",), ns=(1024, 2048, 4096))
    for r in records:
        if r.get("backend") == "numba" and r.get("attention") == "softmax" and \
                r.get("n_k") == 1024 and not r.get("causal"):
            r["gflops"] = 50.0
    _, roofs, points = analysis.split_records(records)
    curve = next(c for c in analysis.curves(points, roofs)
                 if c.backend == "numba" and c.attention == "softmax" and not c.causal)
    assert curve.roof_fraction[0] < 1 and curve.above_roof.tolist() == [False, False, False]
    html = build_report(records, source="synthetic").html
    assert "<b>Above the roof</b>" not in html and "above its roof" not in html


def test_a_report_within_its_roof_raises_no_flag():
    html = build_report(_within_roof_records(backends=("numba",)), source="synthetic").html
    assert "<b>Above the roof</b>" not in html and "above its roof" not in html


def test_the_report_states_which_gemm_was_probed():
    records = synthetic_records(backends=("numba",))
    for r in records:
        if r.get("record") == "roof":
            r.update(blas="OpenBLAS 0.3.27 through NumPy 2.4.6", probed_at="2026-12-01 09:00:00 UTC")
    records.append(dict(_probe(4096, 140.0, "MKL 2024.2 through torch 2.13.0"), schema=SCHEMA))
    html = build_report(records, source="synthetic").html
    said = html.split("The GEMM probed for the roof", 1)[1].split("</ul>", 1)[0]
    assert "GEMM n x 64 @ 64 x n at n = 1024, 4096, OpenBLAS 0.3.27 through NumPy 2.4.6" in said
    assert "MKL 2024.2 through torch 2.13.0" in said and "- the roof" in said
    assert "2 threads" in said and "probed 2026-12-01 09:00:00 UTC" in said
    _, roofs, _ = analysis.split_records(records)
    found = roof.libraries(roofs, "float32", 2, 64)   # the roof first
    assert [(blas, names) for blas, (names, _) in found.items()] == [
        ("MKL 2024.2 through torch 2.13.0", ("MKL", "torch")),
        ("OpenBLAS 0.3.27 through NumPy 2.4.6", ("OpenBLAS", "NumPy"))]


# ------------------------------------------------------------ best fastattn / peer
def _point(backend, t, peer=False, run_id="r1", n=512, causal=False, threads=2, **extra):
    return {"schema": SCHEMA, "record": "point", "attention": "softmax", "backend": backend,
            "peer": peer, "causal": causal, "dtype": "float32", "batch": 1, "heads": 8,
            "n_q": n, "n_k": n, "d_k": 64, "d_v": 64, "threads": threads, "regime": "prefill",
            "status": "ok", "median_s": 1.1 * t, "min_s": t, "max_s": 1.2 * t,
            "flops": 4 * 8 * n * n * 64, "roof_gflops": 100.0, "run_id": run_id, **extra}


def test_versus_rows_pick_the_fastest_of_each_side_by_the_fastest_repeat():
    records = [_point("numba", 0.030), _point("cython", 0.020), _point("reference", 0.5),
               _point("torch", 0.025, peer=True), _point("onnxruntime", 0.016, peer=True)]
    (row,) = table.versus_rows(records)
    assert (row["fastattn"], row["fastattn_s"], row["peer"], row["peer_s"]) == \
        ("cython", 0.020, "onnxruntime", 0.016)
    assert row["ratio"] == pytest.approx(0.020 / 0.016)
    assert row["shape"] == "1x8x512x64"
    assert row["gflops"] == pytest.approx(4 * 8 * 512 * 512 * 64 / 0.020 / 1e9)
    assert row["roof_fraction"] == pytest.approx(row["gflops"] / 100.0)


def test_the_paired_ratio_is_the_median_of_the_rounds_ratios():
    """A slow spell in rounds 2-3 slows both sides; the peer's one fast repeat (round 4)
    decides the ratio of fastest repeats, not the paired one."""
    ours = _point("cython", 0.020, round_min_s=[0.020, 0.030, 0.031, 0.021, 0.020])
    theirs = _point("torch", 0.016, peer=True, round_min_s=[0.024, 0.036, 0.037, 0.016, 0.025])
    (row,) = table.versus_rows([ours, theirs])
    assert row["ratio"] == pytest.approx(0.020 / 0.016)
    assert row["paired"] == pytest.approx(0.030 / 0.036)   # median of 0.83, 0.83, 0.84, 1.31, 0.8
    assert "0.83" in table.format_versus([row])
    one_round = _point("torch", 0.016, peer=True, round_min_s=[0.016])
    uneven = _point("torch", 0.016, peer=True, round_min_s=[0.016, 0.02])
    for peer in (one_round, uneven, _point("torch", 0.016, peer=True)):
        assert table.versus_rows([ours, peer])[0]["paired"] is None


def _unpad(line):
    """A Markdown table line without the padding that aligns its columns."""
    return " | ".join(cell.strip() for cell in line.split("|")).strip()


def test_a_paired_fraction_above_the_roof_is_flagged_with_the_reason():
    """Below its roof by the fastest repeat (0.1 s: 86 GFLOP/s of 100), above the GEMM
    timed beside it in its rounds (a slow round's GEMM): the bracket carries the ``!``."""
    ours = _point("cython", 0.1, n=2048, roof_fraction_paired=1.37)
    theirs = _point("torch", 0.105, peer=True, n=2048)
    rows = table.versus_rows([ours, theirs])
    (line,) = [_unpad(x) for x in table.versus_markdown(rows).splitlines()
               if x.startswith("| 1x8")]
    assert line.endswith("| 86% (137%!) |"), line
    assert table.ABOVE_ROOF_NOTE in table.format_versus(rows)
    within = table.versus_rows([_point("cython", 0.1, n=2048, roof_fraction_paired=0.9), theirs])
    assert "!" not in table.format_versus(within)
    assert table.format_roof_percent(0.86, 0.9) == "86% (90%)"
    assert table.format_roof_percent(1.2, 0.9) == "120%! (90%)"


def test_bench_versus_prints_the_table_of_a_results_file(tmp_path, capsys):
    """``fastattn bench --versus`` reads the ratios from a file with the bench's own table
    (what tools/peer_ratios.py re-implemented), and says when there is no peer to race."""
    path = tmp_path / "r.jsonl"
    roof = {"schema": SCHEMA, "record": "roof", "probe": "gemm", "dtype": "float32",
            "threads": 2, "shape": [512, 64, 512], "gflops": 100.0, "blas": "OpenBLAS x",
            "blas_name": "OpenBLAS", "library": "numpy"}
    lines = [roof, _point("cython", 0.020), _point("torch", 0.025, peer=True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["bench", "--versus", str(path)]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("1x8x512x64"))
    assert "cython" in row and "torch" in row and "0.80" in row
    assert "OpenBLAS x" in text
    path.write_text("".join(json.dumps(r) + "\n" for r in lines[:2]))
    assert main(["bench", "--versus", str(path)]) == 2
    assert "no point of a peer" in capsys.readouterr().err


def test_versus_rows_give_no_ratio_across_runs_or_without_a_peer():
    rows = table.versus_rows([_point("cython", 0.02, run_id="a"),
                              _point("torch", 0.01, peer=True, run_id="b"),
                              _point("cython", 0.02, n=1024)])
    assert [r["ratio"] for r in rows] == [None, None]
    assert rows[0]["note"] == "measured in different runs: no ratio"
    assert rows[1]["note"] == "no peer measured"


def test_versus_rows_keep_threads_and_masks_apart():
    records = [_point("cython", 0.02, threads=1), _point("torch", 0.04, peer=True, threads=1),
               _point("cython", 0.01, threads=2), _point("torch", 0.005, peer=True, threads=2),
               _point("cython", 0.01, causal=True), _point("torch", 0.02, peer=True, causal=True)]
    ratios = {(r["threads"], r["causal"]): r["ratio"] for r in table.versus_rows(records)}
    assert ratios == {(1, False): 0.5, (2, False): 2.0, (2, True): 0.5}


def test_versus_markdown_is_a_table_and_refuses_a_foreign_file(tmp_path):
    rows = table.versus_rows([_point("cython", 0.005), _point("torch", 0.025, peer=True)])
    path = table.write_versus_markdown(rows, tmp_path / "t.md", ["roof line"])
    text = path.read_text()
    assert text.startswith(table.VERSUS_MARKER)
    lines = [_unpad(line) for line in text.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| shape BxHxNxD | attention | mask")
    # 4 * 8 heads * 512^2 * 64 flops in 5 ms: 107 GFLOP/s, above the roof of 100
    assert lines[2] == ("| 1x8x512x64 | softmax | non-causal | float32 | 2 | cython | 5 ms "
                        "| torch | 25 ms | 0.20 | – | 107 | 107%! |")   # no rounds: no pairs
    assert "- roof line" in text and "above the roof" in text
    foreign = tmp_path / "README.md"
    foreign.write_text("# my notes\n")
    with pytest.raises(ResultsFileError, match="not a fastattn best-vs-peer table"):
        table.write_versus_markdown(rows, foreign)
    assert foreign.read_text() == "# my notes\n"


# ----------------------------------------------------------- --shape and --threads
@pytest.mark.parametrize("text,expected", [
    ("1x8x2048x64", (1, 8, 2048, 64, None, None)),
    ("4X12X512X32", (4, 12, 512, 32, None, None)),
    ("1×1×1×64", (1, 1, 1, 64, None, None)),
    ("decode:1x8x32768x64", (1, 8, 32768, 64, "decode", None)),
    ("prefill:2x1x8x4", (2, 1, 8, 4, "prefill", None)),
    ("linear:1x8x16384x64", (1, 8, 16384, 64, None, "linear")),
    ("softmax:decode:1x1x8x4", (1, 1, 8, 4, "decode", "softmax")),
    ("decode:linear:1x1x8x4", (1, 1, 8, 4, "decode", "linear"))])
def test_shape_arg_reads_b_h_n_d_and_an_optional_regime_and_attention(text, expected):
    assert shape_arg(text) == expected


@pytest.mark.parametrize("text", ["1x8x2048", "1x8x0x64", "axbxcxd", "1x8x2048x64x2", "",
                                  "prefil:1x8x2048x64", ":1x8x2048x64x1", ":1x8x2048x64",
                                  "linear:softmax:1x8x2048x64", "decode:prefill:1x1x8x4",
                                  "favor:1x1x8x4"])
def test_shape_arg_refuses_what_is_not_four_positive_ints(text):
    with pytest.raises(argparse.ArgumentTypeError, match="BxHxNxD"):
        shape_arg(text)


@pytest.mark.parametrize("text,why", [("favor:1x1x8x4", "'favor' is neither a regime"),
                                      ("linear:softmax:1x1x8x4", "more than one attention"),
                                      ("decode:decode:1x1x8x4", "more than one regime"),
                                      ("1x1x0x16", "'1x1x0x16' is not four positive integers")])
def test_shape_arg_says_what_is_wrong(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(why)):
        shape_arg(text)


def test_shape_arg_reads_prefixes_in_any_case():
    assert shape_arg("LINEAR:Decode:1x1x8x4") == (1, 1, 8, 4, "decode", "linear")


def test_cli_refuses_a_bad_shape_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--shape", "1x8x2048", "--no-progress"])
    assert exit_.value.code == 2
    assert "--shape" in capsys.readouterr().err


def test_bench_shapes_and_thread_counts_in_one_run(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    code = main(["bench", "--kind", "softmax", "--backends", "reference", "numba",
                 "--shape", "1x2x16x8", "2x1x24x4", "--regime", "prefill", "decode",
                 "--causal", "yes", "--threads", "1", "2", "--repeats", "1", "--no-memory",
                 "--no-check", "--no-progress", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    points = [r for r in read_records(out) if r["record"] == "point"]
    got = {(r["batch"], r["heads"], r["n_q"], r["n_k"], r["d_k"], r["regime"], r["threads"])
           for r in points}
    assert got == {(b, h, nq, n, d, regime, t) for b, h, n, d in ((1, 2, 16, 8), (2, 1, 24, 4))
                   for regime, nq in (("prefill", n), ("decode", 1)) for t in (1, 2)}
    assert len({r["run_id"] for r in points}) == 1          # one run, whatever the threads
    roofs = [r for r in read_records(out) if r["record"] == "roof"]
    assert {r["threads"] for r in roofs} == {1, 2}
    assert "1 thread" in text and "2 threads" in text
    assert (tmp_path / "s.md").read_text().startswith(table.VERSUS_MARKER)
    assert "table:" in text


def test_a_shape_with_a_regime_is_measured_in_that_regime_only(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["bench", "--kind", "softmax", "--backends", "reference", "--shape", "1x1x8x4",
                 "decode:1x2x32x4", "--causal", "yes", "--threads", "1", "--repeats", "1",
                 "--no-memory", "--no-check", "--no-progress", "--out", str(out)]) == 0
    got = {(r["regime"], r["heads"], r["n_q"], r["n_k"]) for r in read_records(out)
           if r["record"] == "point"}
    assert got == {("prefill", 1, 8, 8), ("decode", 2, 1, 32)}


def test_a_shape_with_an_attention_is_measured_for_that_attention_only(tmp_path, capsys):
    out = tmp_path / "k.jsonl"
    assert main(["bench", "--backends", "reference", "--shape", "1x1x8x4", "linear:1x2x16x4",
                 "--causal", "yes", "--threads", "1", "--repeats", "1", "--no-memory",
                 "--no-check", "--no-progress", "--out", str(out)]) == 0
    got = {(r["attention"], r["heads"], r["n_q"]) for r in read_records(out)
           if r["record"] == "point"}
    assert got == {("softmax", 1, 8), ("linear", 1, 8), ("linear", 2, 16)}


def test_bench_prints_the_versus_table_and_the_roof_with_a_peer(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "p.jsonl"
    assert main(["bench", "--kind", "softmax", "--backends", "numba", "torch", "--shape",
                 "1x2x32x16", "--causal", "no", "--threads", "1", "--repeats", "1",
                 "--no-memory", "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    table_text = text.split("best fastattn / best peer", 1)[1]
    row = next(line for line in table_text.splitlines() if line.startswith("1x2x32x16"))
    assert "numba" in row and "torch" in row
    assert re.search(r"non-causal\s+float32\s+1\s+numba", row)
    roof = text.split("roof (the GEMM probed in this run", 1)[1]
    assert "through NumPy" in roof and "through torch" in roof and "- the roof" in roof
    md = "\n".join(map(_unpad, (tmp_path / "p.md").read_text().splitlines()))
    assert "| 1x2x32x16 | softmax | non-causal | float32 | 1 | numba |" in md


@pytest.mark.skipif(not __import__("os").path.exists("/dev/null"), reason="no /dev/null here")
def test_bench_refuses_a_results_path_that_is_not_a_file(capsys):
    assert main(["bench", "--shape", "1x1x64x64", "--out", "/dev/null"]) == 2
    assert "/dev/null is not a regular file" in capsys.readouterr().err


def test_bench_refuses_to_overwrite_a_foreign_markdown_file_before_measuring(tmp_path, capsys):
    (tmp_path / "x.md").write_text("notes\n")
    assert main(["bench", "--kind", "softmax", "--backends", "reference", "--n", "8",
                 "--no-progress", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "not a fastattn best-vs-peer table" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
