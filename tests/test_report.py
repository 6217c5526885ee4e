"""The HTML report: numbers from synthetic records with known answers, the page, the command.

Synthetic point records follow fastattn/bench/results.py: softmax times
``a · n²`` and linear times ``b · n`` (so the exponents are 2 and 1 and the
crossover is at ``n = b / a``), memory ``12 n²`` bytes for the reference
softmax and ``512 n`` for the rest.  No test here depends on how fast
anything runs.
"""

import base64
import hashlib
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fastattn.bench.peers import INSTALL_HINT
from fastattn.bench.results import SCHEMA, read_records
from fastattn.cli import main
from fastattn.report import analysis
from fastattn.report.build import REPORT_MARKER, build_report
from fastattn.map_quality import compute_quality
from fastattn.report.environment import LABELS, environment_rows

A_SOFTMAX = 1e-9      # seconds per n² (non-causal); causal is half
B_LINEAR = 2e-6       # seconds per n
CROSSOVER = B_LINEAR / A_SOFTMAX            # 2000 non-causal
CROSSOVER_CAUSAL = B_LINEAR / (A_SOFTMAX / 2)  # 4000 causal
NS = (128, 256, 512, 1024, 2048, 4096, 8192)


def _record(record_type, **fields):
    return {"schema": SCHEMA, "record": record_type, **fields}


def synthetic_records(backends=("reference", "numba"), peers=(), ns=NS, machine=None,
                      noise=0.0, seed=0):
    """Environment, roof and point records with known exponents and crossover."""
    rng = np.random.default_rng(seed)
    extra = {} if machine is None else {"machine": machine}
    records = [
        # Keys as fastattn.bench.environment.collect() writes them.
        _record("environment", **extra, cpu_model="Synthetic CPU 9000", cores_logical=2,
                cores_usable=2, threads=2, thread_counts={"requested": 2, "blas": 2},
                blas=[{"internal_api": "openblas", "version": "0.3.27",
                       "architecture": "Haswell", "num_threads": 2}],
                python="3.11.7",
                versions={"numpy": "2.4.6", "numba": "0.68.1", "cython": "3.1.2",
                          "torch": None},
                absent_peers={} if peers else {"torch": 'pip install "fastattn[torch]"'}),
        _record("roof", **extra, probe="exp", dtype="float32", threads=2, gelem_s=0.47),
    ]
    for n in (1024, 4096):   # GEMM roof probed at two attention shapes
        records.append(_record("roof", **extra, probe="gemm", dtype="float32", threads=2,
                               gflops=98.0 * n / 4096, shape=[n, 64, n]))
    for attention in ("softmax", "linear"):
        for backend in tuple(backends) + tuple(peers):
            for causal in (False, True):
                for n in ns:
                    base = dict(extra, attention=attention, backend=backend,
                                peer=backend in peers, causal=causal, dtype="float32",
                                batch=1, heads=1, n_q=n, n_k=n, d_k=64, d_v=64,
                                feature_map="elu" if attention == "linear" else None,
                                threads=2)
                    if backend == "reference" and attention == "softmax" and n > 4096:
                        records.append(_record("point", **base, status="skipped",
                                               reason="needs 805,306,368 bytes"))
                        continue
                    if attention == "softmax":
                        t = A_SOFTMAX * n * n * (0.5 if causal else 1.0)
                    else:
                        t = B_LINEAR * n
                    t *= float(np.exp(noise * rng.standard_normal()))
                    flops = 4 * n * n * 64 if attention == "softmax" else 4 * n * 64 * 64
                    mem = 12 * n * n if (backend == "reference" and attention == "softmax") else 512 * n
                    records.append(_record(
                        "point", **base, status="ok", times_s=[0.98 * t, t, 1.05 * t],
                        median_s=t, min_s=0.98 * t, max_s=1.05 * t, flops=flops,
                        gflops=flops / t / 1e9, peak_bytes=mem, memory_method="tracemalloc",
                        max_abs_err=1e-6))
    return records


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def quality():
    # The shipped slice: the same in every checkout.
    return compute_quality(None)


@pytest.fixture(scope="module")
def report_html(quality):
    return build_report(synthetic_records(), source="synthetic", quality=quality).html


# ----------------------------------------------------------------- analysis
@pytest.mark.parametrize("exponent", [1.0, 2.0])
def test_fit_recovers_known_exponent(exponent):
    n = np.array(NS, dtype=float)
    t = 3e-7 * n ** exponent
    fit = analysis.fit_exponent(n, t)
    assert fit.slope == pytest.approx(exponent, abs=1e-9)
    assert fit.stderr == pytest.approx(0.0, abs=1e-9)
    assert (fit.points, fit.n_min, fit.n_max) == (4, 1024, 8192)


def test_fit_ignores_points_below_1024():
    n = np.array(NS, dtype=float)
    t = 1e-9 * n ** 2
    t[n < 1024] = 1.0  # a fixed cost that dominates small n must not bend the fit
    assert analysis.fit_exponent(n, t).slope == pytest.approx(2.0, abs=1e-9)


def test_fit_standard_error_matches_scipy_linregress():
    rng = np.random.default_rng(1)
    n = np.array([1024, 1536, 2048, 3072, 4096, 8192], dtype=float)
    t = 2e-9 * n ** 2 * np.exp(0.1 * rng.standard_normal(len(n)))
    fit = analysis.fit_exponent(n, t)
    ref = stats.linregress(np.log(n), np.log(t))
    assert fit.slope == pytest.approx(ref.slope, rel=1e-12)
    assert fit.stderr == pytest.approx(ref.stderr, rel=1e-9)


def test_fit_needs_two_points():
    assert analysis.fit_exponent([512, 1024], [1.0, 2.0]) is None
    fit = analysis.fit_exponent([1024, 2048], [1.0, 4.0])
    assert fit.slope == pytest.approx(2.0) and np.isnan(fit.stderr)


def test_crossover_at_known_length():
    n = np.array(NS, dtype=float)
    x = analysis.crossover(n, A_SOFTMAX * n ** 2, n, B_LINEAR * n)
    assert x.status == "crossover"
    assert x.n == pytest.approx(CROSSOVER, rel=1e-9)  # exact: both lines are straight in log-log


def test_crossover_none_in_range_and_throughout():
    n = np.array(NS, dtype=float)
    none = analysis.crossover(n, A_SOFTMAX * n ** 2, n, 1.0 * n)
    assert none.n is None and none.status == "none-in-range"
    assert "none in range" in none.describe() and "8192" in none.describe()
    always = analysis.crossover(n, A_SOFTMAX * n ** 2, n, 1e-12 * n)
    assert always.n is None and always.status == "linear-faster-throughout"
    apart = analysis.crossover([128, 256], [1, 2], [1024, 2048], [1, 2])
    assert apart.status == "no-common-range"
    # One n in common is a comparison at that n, not "the whole common range".
    touching = analysis.crossover([128, 256], [2, 4], [256, 512], [1, 2])
    assert touching.describe() == ("linear faster at the only n measured for both (n = 256); "
                                   "no range to cross over in")
    slower = analysis.crossover([128, 256], [2, 4], [256, 512], [8, 9])
    assert slower.describe().startswith("softmax not slower at the only n measured for both")


def test_crossover_on_different_grids():
    # Linear measured on a coarser grid than softmax: interpolation in log-log space.
    ns = np.array(NS, dtype=float)
    nl = np.array([128, 8192], dtype=float)
    x = analysis.crossover(ns, A_SOFTMAX * ns ** 2, nl, B_LINEAR * nl)
    assert x.n == pytest.approx(CROSSOVER, rel=1e-9)


def test_last_record_of_a_point_wins():
    records = synthetic_records(backends=("numba",), ns=(1024, 2048))
    retry = dict(records[-1], median_s=123.0)
    _, _, points = analysis.split_records(records + [retry])
    same = [p for p in points if analysis.point_key(p) == analysis.point_key(retry)]
    assert len(same) == 1 and same[0]["median_s"] == 123.0


# --------------------------------------------------------------------- page
SECTIONS = ('id="scaling"', 'id="quality"', 'id="environment"', 'id="method"',
            "Fitted exponents", "Crossover", "Peak extra memory", "GEMM roof",
            "The seed experiment", "Gaussian inputs", "all-MiniLM-L6-v2", "Attention weights")


@pytest.mark.parametrize("needle", SECTIONS)
def test_report_has_every_section(report_html, needle):
    assert needle in report_html


def test_report_is_self_contained(report_html):
    assert REPORT_MARKER in report_html
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", report_html, re.I)
    assert "<link" not in report_html and "<script" not in report_html
    images = re.findall(r'<img[^>]*src="([^"]+)"', report_html)
    assert len(images) >= 6  # time, memory, roofline, quality, two heatmaps
    for src in images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def _table_rows(html, title):
    table = html.split(title, 1)[1].split("</table>", 1)[0]
    return [re.sub(r"<[^>]+>", "|", row) for row in table.split("<tr")[2:]]


def test_report_states_exponents_and_crossover(report_html):
    rows = _table_rows(report_html, "Fitted exponents")[1:]   # after the two header rows
    softmax = [r for r in rows if "softmax" in r]
    linear = [r for r in rows if "linear" in r]
    assert len(softmax) == 2 and len(linear) == 2   # 2 backends; columns non-causal, causal
    # time: 2 for softmax, 1 for linear; memory: 2 for the reference softmax (n x n
    # intermediates), 1 for everything else (cells: time x2, memory x2).
    cells = {r.split("|")[1]: re.findall(r"\d\.\d\d ± \d\.\d\d", r) for r in rows}
    assert cells["reference softmax"] == ["2.00 ± 0.00"] * 4
    assert cells["numba softmax"] == ["2.00 ± 0.00"] * 2 + ["1.00 ± 0.00"] * 2
    assert cells["reference linear"] == ["1.00 ± 0.00"] * 4
    assert cells["numba linear"] == ["1.00 ± 0.00"] * 4
    crossovers = _table_rows(report_html, "Crossover: where")
    assert any("non-causal" in r and "n ≈ 2,000" in r for r in crossovers)
    assert any("|causal" in r and "n ≈ 4,000" in r for r in crossovers)


def test_headline_exponents_say_when_they_rest_on_two_points(quality, report_html):
    """The "In short" exponents come from fits of 3+ points; a grid with only two n >= 1024
    (``--quick``) still quotes them, saying they rest on 2 points."""
    headline = re.search(r"Fitted time exponents[^<]*", report_html).group(0)
    assert "softmax 2.00 over" in headline and "2 points" not in headline
    two = build_report(synthetic_records(ns=(128, 512, 1024, 2048)), source="synthetic",
                       quality=quality).html
    headline = re.search(r"Fitted time exponents[^<]*", two).group(0)
    # softmax, linear, and the reference's causal linear attention (its n x n form)
    assert headline.count("each fitted to 2 points only") == 3


def test_causal_linear_by_the_quadratic_form_is_expected_to_grow_as_n_squared(report_html):
    """The reference computes causal linear attention as the masked n x n form, so 2 is
    its expected exponent (the helper's trial saw 1.86 shaded as far from 1); the chunked
    kernels and the cumulative-sum peer stay at 1, a decode token at 0."""
    expect = analysis.expected_exponent
    assert expect({"attention": "linear", "causal": True, "backend": "reference"}) == 2
    assert expect({"attention": "linear", "causal": False, "backend": "reference"}) == 1
    assert expect({"attention": "linear", "causal": True, "backend": "cython"}) == 1
    assert expect({"attention": "linear", "causal": True, "backend": "torch", "peer": True}) == 1
    assert expect({"attention": "linear", "causal": True, "backend": "reference",
                   "regime": "decode"}) == 0
    assert expect({"attention": "softmax", "causal": True, "backend": "reference"}) == 2
    text = " ".join(re.sub(r"<[^>]+>", " ", report_html).split())
    assert "reference linear 1.00 ± 0.00 1.00 ± 0.00 1.00 ± 0.00 1.00 ± 0.00 " \
        "non-causal 1, causal 2" in text
    assert "causal linear by the masked n×n form (reference) 1.00 over 1 curve " \
        "(expected about 2)" in text


def test_report_numbers_are_medians_with_range(report_html):
    # numba softmax non-causal at n=1024: 1e-9 * 1024² s = 1.05 ms, range 0.98x..1.05x.
    assert "1.05 ms<small>1.03 ms–1.1 ms (3×)</small>" in report_html
    assert "median" in report_html and "Synthetic CPU 9000" in report_html
    assert "Haswell kernel" in report_html and "0.68.1" in report_html and "3.1.2" in report_html
    assert "needs 805,306,368 bytes" in report_html   # the skipped reference points, with why


def test_report_quality_matches_seed_experiment(report_html):
    from fastattn import compare

    q = compare(64, 32, seed=42).quality
    assert f"{q.cosine_similarity:.4g}" in report_html
    assert f"{q.mse:.6g}" in report_html
    assert f"{q.magnitude_ratio:.4g}" in report_html


def test_report_says_which_minilm_data(quality, report_html):
    assert not quality.minilm_full
    assert "slice shipped with fastattn" in report_html
    assert "fastattn report --minilm FILE" in report_html   # no developers' folder named
    assert len(quality.minilm) == 6  # one row per layer


def test_peers_note_when_absent_and_shown_when_present(quality, report_html):
    assert "No peer ran the prefill points" in report_html
    assert 'pip install &#34;fastattn[torch]&#34;' in report_html   # the hint from the record
    records = synthetic_records(peers=("torch",))
    for r in records:
        if r["record"] == "point" and r.get("status") == "ok":
            r["load_avg_1m"] = 1.0
            if r["backend"] == "torch" and r["n_q"] == 2048 and r["attention"] == "linear":
                r["check_ok"] = False      # a peer that disagrees with the reference
    first_point = next(r for r in records if r["record"] == "point" and r["status"] == "ok")
    first_point["load_avg_1m"] = 7.5       # one point measured on a busy machine (2 cores)
    with_torch = build_report(records, quality=None).html
    assert "torch softmax (peer)" in with_torch
    assert "No peer ran the prefill points" not in with_torch
    assert "Output check failed" in with_torch
    assert "torch linear (peer) at n = 2048" in with_torch
    assert "machine was busy" in with_torch and "1.0 to 7.5" in with_torch
    assert "machine was busy" not in report_html   # no load recorded: no claim either way


def test_report_without_points_still_renders():
    html = build_report(synthetic_records()[:2], quality=None).html
    assert "nothing to plot" in html
    with pytest.raises(ValueError, match="no fastattn"):
        build_report([], quality=None)


# ------------------------------------------------------------------ command
@pytest.fixture(autouse=True)
def _quality_once(request, monkeypatch):
    """Command tests reuse the module's quality numbers (they test the command, not the maths)."""
    if request.node.name.startswith("test_cli"):
        value = request.getfixturevalue("quality")
        monkeypatch.setattr("fastattn.map_quality.compute_quality", lambda *a, **k: value)


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cli_from_builds_report_without_touching_results(tmp_path, capsys):
    results = write_jsonl(tmp_path / "run.jsonl", synthetic_records())
    with open(results, "a") as handle:   # an interrupted run: the last line cut mid-write
        handle.write('{"schema": "fastattn.results/1", "record": "po')
    before = _sha(results)
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()
    out.write_text(f"<!DOCTYPE html>{REPORT_MARKER} an older report")  # may be replaced
    image = tmp_path / "docs" / "scaling.png"
    image.parent.mkdir()
    assert main(["report", "--from", str(results), "--out", str(out),
                 "--readme-image", str(image)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out)
    # The cut line is left out, and said so (it was silent).
    assert f"the last line of {results} was cut short" in printed.err
    assert "its 46 bytes are left out" in printed.err
    html = out.read_text()
    assert REPORT_MARKER in html and "an older report" not in html
    assert "Fitted exponents" in html
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _sha(results) == before


@pytest.mark.parametrize("content", [
    "not json at all\n",
    '{"some": "other tool"}\n',
    json.dumps({"schema": "fastattn.results/99", "record": "point"}) + "\n",
])
def test_cli_refuses_foreign_or_corrupt_results(tmp_path, capsys, content):
    results = tmp_path / "foreign.jsonl"
    results.write_text(content)
    code = main(["report", "--from", str(results)])
    err = capsys.readouterr().err
    assert code == 2
    assert "foreign.jsonl" in err and "not a fastattn results" in err
    assert results.read_text() == content
    assert not (tmp_path / "foreign.html").exists()


def test_cli_refuses_a_readme_image_it_cannot_write_before_measuring(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    for image, why in ((tmp_path, "is a directory"), (notes, "is not a PNG")):
        out = tmp_path / "r.html"
        # --quick would measure for a minute: the refusal comes first, with nothing written
        assert main(["report", "--quick", "--out", str(out), "--readme-image", str(image)]) == 2
        err = capsys.readouterr().err
        assert "--readme-image" in err and why in err, err
        assert not out.exists() and not out.with_suffix(".jsonl").exists()
    assert notes.read_text() == "my notes"
    # The report itself, its figure or its results file: refused before anything is written.
    out = tmp_path / "r.html"
    for image, what in ((out, "the report"), (tmp_path / "r-scaling.png", "the figure beside"),
                        (tmp_path / "new.jsonl", "the results file")):
        assert main(["report", "--quick", "--out", str(out), "--resume",
                     str(tmp_path / "new.jsonl"), "--readme-image", str(image)]) == 2
        assert f"is {what}" in capsys.readouterr().err
        assert not out.exists() and not (tmp_path / "new.jsonl").exists()
    # A name that promises another format: the figure is a PNG whatever the name says.
    assert main(["report", "--quick", "--out", str(out), "--readme-image",
                 str(tmp_path / "figure.jpg")]) == 2
    assert "figure.jpg: the figure is written as a PNG" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "figure.jpg").exists()


def test_a_report_of_points_at_too_few_lengths_says_so(tmp_path):
    """One n per kernel: no curve can be drawn, and the page says why, not that no point
    was measured or that the memory probe was off."""
    records = synthetic_records(ns=(256,))
    html = build_report(records, source="synthetic").html
    text = re.sub(r"<[^>]+>", " ", html)
    assert "only at n = 256" in text and "needs at least 3 lengths" in " ".join(text.split())
    for wrong in ("No point was measured successfully", "No point with status",
                  "memory probe was off", "No GFLOP/s in these results"):
        assert wrong not in text, wrong


def test_cli_refuses_to_overwrite_other_files(tmp_path, capsys):
    results = write_jsonl(tmp_path / "run.jsonl", synthetic_records())
    other = tmp_path / "notes.html"
    other.write_text("<html>my notes</html>")
    assert main(["report", "--from", str(results), "--out", str(other)]) == 2
    assert other.read_text() == "<html>my notes</html>"
    assert main(["report", "--from", str(results), "--out", str(results)]) == 2
    assert "results file" in capsys.readouterr().err
    # A name of another format would hold HTML: refused, with the .html name to give.
    assert main(["report", "--from", str(results), "--out", str(tmp_path / "rep.png")]) == 2
    assert "--out names the HTML report" in capsys.readouterr().err
    assert not (tmp_path / "rep.png").exists()
    assert main(["report", "--from", str(results), "--out", ""]) == 2   # was a ValueError
    assert "--out names the HTML report, got '.'" in capsys.readouterr().err
    # The figure beside the report is checked before the report is written, not after.
    (tmp_path / "k-scaling.png").mkdir()
    assert main(["report", "--from", str(results), "--out", str(tmp_path / "k.html")]) == 2
    assert "the figure beside the report" in capsys.readouterr().err
    assert not (tmp_path / "k.html").exists()
    assert read_records(results)  # still intact


def test_cli_resume_refuses_foreign_file(tmp_path, capsys):
    results = tmp_path / "theirs.jsonl"
    results.write_text('{"rows": [1, 2, 3]}\n')
    assert main(["report", "--resume", str(results), "--quick"]) == 2
    assert "not a fastattn results" in capsys.readouterr().err
    assert results.read_text() == '{"rows": [1, 2, 3]}\n'


def test_cli_quick_end_to_end(tmp_path, monkeypatch, capsys):
    from fastattn.report.cli import QUICK_NS

    monkeypatch.chdir(tmp_path)
    assert main(["report", "--quick"]) == 0
    out = capsys.readouterr().out.strip()
    html_path = tmp_path / out
    assert html_path.parent == tmp_path / "reports" and html_path.suffix == ".html"
    records = read_records(html_path.with_suffix(".jsonl"))
    kinds = {r["record"] for r in records}
    assert kinds == {"environment", "roof", "point"}
    points = [r for r in records if r["record"] == "point" and r["regime"] == "prefill"]
    assert {p["n_q"] for p in points} == set(QUICK_NS)
    assert {(p["attention"], p["causal"]) for p in points} == {
        (a, c) for a in ("softmax", "linear") for c in (False, True)}
    decode = [r for r in records if r["record"] == "point" and r["regime"] == "decode"]
    assert {p["n_k"] for p in decode} == set(QUICK_NS) and {p["n_q"] for p in decode} == {1}
    assert all(p["status"] == "ok" for p in points if p["backend"] == "reference")
    html = html_path.read_text()
    for needle in SECTIONS + ('id="generation"', "End to end"):
        assert needle in html
    assert html_path.with_name(html_path.stem + "-scaling.png").is_file()
    # Resuming the finished run measures nothing new and rebuilds the report.
    before = len(records)
    assert main(["report", "--resume", str(html_path.with_suffix(".jsonl")), "--quick"]) == 0
    assert len(read_records(html_path.with_suffix(".jsonl"))) == before


def test_cli_full_disk_while_measuring_names_the_results_file(tmp_path, capsys, monkeypatch):
    import errno

    from fastattn.bench import sweep

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sweep, "run_sweep", disk_full)
    out = tmp_path / "Full" / "R.html"
    out.parent.mkdir()
    assert main(["report", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device: the points written before it are in " in err
    assert "continue with" in err and "--resume" in err and "Traceback" not in err


def test_cli_missing_results_file(tmp_path, capsys):
    assert main(["report", "--from", str(tmp_path / "nope.jsonl")]) == 2
    assert "no results file" in capsys.readouterr().err
    assert main(["report", "--from", str(tmp_path)]) == 2
    assert f"{tmp_path} is a directory, not a results file" in capsys.readouterr().err
    assert main(["report", "--from", "/dev/null"]) == 2   # there, but not a file
    assert "/dev/null is not a regular file" in capsys.readouterr().err


def test_cli_results_file_with_a_corrupt_line_says_what_to_do(tmp_path, capsys):
    good = json.dumps({"schema": "fastattn.results/1", "record": "environment"})
    path = tmp_path / "mid.jsonl"
    path.write_text(f"{good}\n{{\"cut\n{good}\n", encoding="utf-8")
    assert main(["report", "--from", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2 is corrupt" in err and "repair or remove that line" in err


@pytest.mark.parametrize("source", ["--from", "--asv"])
@pytest.mark.parametrize("measuring", [["--quick"], ["--n", "128"], ["--threads", "1"],
                                       ["--repeats", "3"]])
def test_cli_refuses_measuring_options_with_a_source_that_measures_nothing(
        tmp_path, capsys, source, measuring):
    results = write_jsonl(tmp_path / "results.jsonl", synthetic_records())
    path = results if source == "--from" else tmp_path
    assert main(["report", source, str(path), *measuring, "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert measuring[0] in err and source in err and "measures nothing" in err
    assert not (tmp_path / "r.html").exists()


def test_cli_asv_two_machines_and_history(tmp_path, monkeypatch, capsys):
    box_b = synthetic_records(backends=("numba",), ns=(256, 1024, 4096), machine="box-b")
    for r in box_b:   # asv kept no memory or flop counts for this machine
        if r["record"] == "point":
            r.update(peak_bytes=None, gflops=None, times_s=None)
    records = synthetic_records(machine="box-a") + box_b
    history = [{"machine": m, "commit": c * 40, "date": f"2026-11-2{i}T10:00:00",
                "benchmark": "softmax.time_softmax", "params": {"backend": "numba", "n": 4096},
                "value": 0.02 + 0.001 * i, "unit": "seconds"}
               for m in ("box-a", "box-b") for i, c in enumerate("abc")]
    fake = types.ModuleType("fastattn.report.asv_results")
    fake.load_asv_points = lambda directory, commit=None: [r for r in records
                                                           if r["record"] != "roof"]
    fake.load_asv_history = lambda directory, benchmark=None: history
    monkeypatch.setitem(sys.modules, "fastattn.report.asv_results", fake)
    out = tmp_path / "asv.html"
    assert main(["report", "--asv", str(tmp_path), "--history", "softmax.time_softmax",
                 "--out", str(out)]) == 0
    html = out.read_text()
    assert "Machines side by side" in html and "box-a" in html and "box-b" in html
    assert html.count("No memory was recorded in these results") == 1   # box-b only
    assert 'id="history"' in html and "softmax.time_softmax" in html and "aaaaaaaa" in html


def test_cli_asv_missing_module_is_explained(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastattn.report.asv_results", None)
    assert main(["report", "--asv", str(tmp_path)]) == 2
    assert "fastattn.report.asv_results" in capsys.readouterr().err


def test_cli_asv_given_a_file_says_it_expects_a_directory(tmp_path, capsys):
    # Found by a new-user trial: --asv FILE said "no such directory".
    given = tmp_path / "results.json"
    given.write_text("{}")
    assert main(["report", "--asv", str(given)]) == 2
    err = capsys.readouterr().err
    assert f"--asv {given} is a file; --asv expects an asv results directory" in err
    assert "no such directory" not in err


def test_a_bad_minilm_file_is_refused_without_a_developer_path(tmp_path, capsys):
    # Found by a new-user trial: the message pointed at the developers' ../shared folder.
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert main(["report", "--from", str(tmp_path / "r.jsonl"), "--minilm", str(notes)]) == 2
    err = capsys.readouterr().err
    assert f"--minilm {notes}: not an .npz archive; --minilm expects NumPy's .npz" in err
    assert "shared" not in err


@pytest.mark.parametrize("option", ["--out", "--readme-image"])
def test_a_path_in_a_missing_folder_is_refused_not_created(tmp_path, capsys, option):
    # Found by a new-user trial: --out and --readme-image made any missing parent folders.
    results = write_jsonl(tmp_path / "run.jsonl", synthetic_records(ns=(1024, 2048)))
    missing = tmp_path / "no" / "such"
    path = missing / ("r.html" if option == "--out" else "r.png")
    assert main(["report", "--from", str(results), option, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{option} {path}: the folder {missing} does not exist" in err
    assert not (tmp_path / "no").exists() and not (tmp_path / "run.html").exists()


def test_interrupted_quick_run_prints_a_resume_command_as_invoked(tmp_path, monkeypatch, capsys):
    # The hint repeats the program as it was invoked (a venv need not be active), the
    # grid options and --out.
    from fastattn.bench import sweep

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep, "run_sweep", interrupted)
    monkeypatch.setattr(sys, "argv", [".venv/bin/fastattn", "report"])
    assert main(["report", "--quick", "--threads", "1", "--out", "my report.html"]) == 130
    err = capsys.readouterr().err
    assert "continue with\n  .venv/bin/fastattn report --resume reports/fastattn-" in err
    assert err.rstrip().splitlines()[-2].strip().endswith(
        "--quick --threads 1 --out 'my report.html'")


def test_resume_says_how_many_points_are_left_and_names_the_report(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--quick", "--n", "128", "256"]) == 0
    results = tmp_path / capsys.readouterr().out.strip()
    results = results.with_suffix(".jsonl")
    lines = results.read_text().splitlines(keepends=True)
    points = [ln for ln in lines if '"record": "point"' in ln]
    kept = [ln for ln in lines if ln not in points[-2:]]
    results.write_text("".join(kept))
    assert main(["report", "--resume", str(results), "--quick", "--n", "128", "256"]) == 0
    err = capsys.readouterr().err
    assert f"measuring 2 points into {results} ({len(points) - 2} already there)" in err
    assert "fastattn report:" in err and "fastattn bench:" not in err   # the progress bar


def test_a_record_without_its_fields_is_refused_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    records = synthetic_records(ns=(1024, 2048))
    write_jsonl(bad, records[:3] + [{"schema": SCHEMA, "record": "point"}] + records[3:])
    assert main(["report", "--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4" in err and "without attention" in err and "Traceback" not in err
    assert not bad.with_suffix(".html").exists()


@pytest.mark.parametrize("field,value", [("n_q", "big"), ("median_s", "fast"),
                                         ("causal", "yes"), ("threads", 0)])
def test_a_corrupt_field_is_refused_with_file_line_and_field(tmp_path, capsys, field, value):
    records = synthetic_records(ns=(1024, 2048))
    index = next(i for i, r in enumerate(records) if r["record"] == "point"
                 and r["status"] == "ok")
    records[index] = dict(records[index], **{field: value})
    bad = write_jsonl(tmp_path / "bad.jsonl", records)
    assert main(["report", "--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:{index + 1} has {field} = {value!r}" in err
    assert not bad.with_suffix(".html").exists()


def test_a_truncated_middle_line_is_called_corrupt_not_foreign(tmp_path, capsys):
    lines = [json.dumps(r) + "\n" for r in synthetic_records(ns=(1024, 2048))]
    lines[5] = lines[5][:40] + "\n"
    path = tmp_path / "cut.jsonl"
    path.write_text("".join(lines))
    assert main(["report", "--from", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:6 is corrupt" in err and "not a fastattn results file" not in err


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raising KeyboardInterrupt for the test, as in a terminal: a process started in
    the background by a shell without job control (``nohup cmd &``) ignores it from the
    start, and Python then leaves it ignored."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_drawing_is_an_interrupt_not_an_error(tmp_path, capsys, monkeypatch):
    """matplotlib turns a KeyboardInterrupt inside its C code into a ValueError of its own
    ("Invalid affine transformation matrix"); the report still says it was interrupted."""
    import os
    import signal
    import time

    from fastattn.report import build

    def drawing(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise ValueError("Invalid affine transformation matrix") from None
        pytest.fail("no SIGINT arrived")

    monkeypatch.setattr(build, "build_report", drawing)
    path = write_jsonl(tmp_path / "run.jsonl", synthetic_records(ns=(1024, 2048)))
    assert main(["report", "--from", str(path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "affine" not in err
    assert not path.with_suffix(".html").exists()
    # A ValueError of the drawing without Ctrl-C is still an error, with its message.
    monkeypatch.setattr(build, "build_report",
                        lambda *a, **k: (_ for _ in ()).throw(ValueError("bad figure")))
    assert main(["report", "--from", str(path)]) == 2
    assert "error: bad figure" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_lost_in_a_finalizer_still_interrupts_the_report(tmp_path, capsys,
                                                                 monkeypatch):
    """Issue 33, item 11: a SIGINT whose KeyboardInterrupt is raised inside a finalizer
    is lost there (Python prints "Exception ignored in ... note ... KeyboardInterrupt"), and
    the report was written and the command exited 0."""
    import gc
    import os
    import signal
    import time

    from fastattn.report import build
    from fastattn.report.cli import PNG_SIGNATURE

    class Dying:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)   # the handler runs here, inside the finalizer

    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: lost.append(info.exc_type))

    def drawing(*args, **kwargs):
        Dying()
        gc.collect()
        return build.Report("<html></html>", PNG_SIGNATURE)

    monkeypatch.setattr(build, "build_report", drawing)
    path = write_jsonl(tmp_path / "run.jsonl", synthetic_records(ns=(1024, 2048)))
    assert main(["report", "--from", str(path)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not path.with_suffix(".html").exists()
    assert lost == []   # not printed as "Exception ignored"
    assert sys.unraisablehook is not None and signal.getsignal(signal.SIGINT) is \
        signal.default_int_handler


def test_minilm_that_is_not_an_npz_is_refused_in_plain_words(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# notes\n")
    assert main(["report", "--quick", "--minilm", str(readme)]) == 2
    err = capsys.readouterr().err
    assert "not an .npz archive" in err and "pickle" not in err
    assert not (tmp_path / "reports").exists()


def test_report_without_points_does_not_print_empty_settings():
    html = build_report(synthetic_records()[:2], quality=None).html
    assert "No point was measured" in html
    assert "not recorded thread" not in html and "dtype ," not in html


def _visible_text(html):
    html = re.sub(r"data:image/[^\"']+", "", html)
    return re.sub(r"<[^>]+>", " ", html)


def test_no_python_none_reaches_the_page():
    """A file of environment records alone (an interrupted run), and points that record
    no thread count (an asv result without the threads benchmark), say so in words."""
    env = [dict(r, threads_reason="as asked (--threads)") for r in synthetic_records()
           if r["record"] == "environment"]
    no_threads = [dict(r, threads=None) if r["record"] == "point" else r
                  for r in synthetic_records()]
    for records in (env, no_threads):
        text = _visible_text(build_report(records, quality=None).html)
        assert not re.search(r"\bNone\b", text), re.findall(r".{60}\bNone\b.{20}", text)
    assert "not recorded" in text


def test_many_repeat_counts_are_given_as_their_range():
    records = synthetic_records()
    points = [r for r in records if r["record"] == "point" and r["status"] == "ok"]
    for i, r in enumerate(points):
        r["times_s"] = [r["median_s"]] * (3 + i % 20)
    text = _visible_text(build_report(records, quality=None).html)
    assert "timed over 3 to 22 repeats" in " ".join(text.split())


def test_environment_shows_every_field_of_the_record():
    env = [dict(r, versions={"numpy": "2.0.1", "cython": None}, backends=["reference", "cython"],
                blas=[{"internal_api": "openblas", "version": "0.3.27", "num_threads": 2}],
                zz_new_field={"a": 1, "b": True})
           for r in synthetic_records() if r["record"] == "environment"]
    html = build_report(env + synthetic_records()[1:], quality=None).html
    env_part = html.split('id="environment"', 1)[1].split('id="method"', 1)[0]
    rows = re.findall(r'<tr><th class="l">([^<]+)</th><td class="l">([^<]*)</td></tr>', env_part)
    texts = dict(rows)
    assert texts[LABELS.get("versions.numpy", "versions.numpy")] == "2.0.1"
    assert texts[LABELS.get("backends", "backends")] == "reference, cython"
    assert texts[LABELS.get("blas", "blas")] == "openblas 0.3.27, 2 threads"
    assert texts["Zz new field, a"] == "1" and texts["Zz new field, b"] == "yes"  # never heard of
    assert not any(label in ("schema", "record") for label, _ in rows)


def test_labelled_environment_fields_come_first_and_the_rest_by_path():
    env = {"schema": "x", "record": "environment", "zeta": 1, "cpu_model": "Z80",
           "memory_total_bytes": 2 * 2**30, "memory_available_bytes": 2**30,
           "versions": {"numpy": "2.0", "torch": None, "jax": None}, "empty": {}}
    labels = {"versions.torch": "PyTorch", "cpu_model": "CPU", "memory_total_bytes": "Memory",
              "absent": "Never shown"}
    rows, rest = environment_rows(env, labels)
    assert rows == [("PyTorch", "not installed"), ("CPU", "Z80"),
                    ("Memory", "2 GiB total, 1 GiB available at the start")]
    assert rest == [("Zeta", "1"), ("numpy version", "2.0"), ("jax version", "not installed")]
    # Without a labelled field, every field is a row.
    assert environment_rows({"zeta": 1}, {"cpu_model": "CPU"}) == ([("Zeta", "1")], [])
    # The fields a run records beyond the schema's labels, in words.
    _, rest = environment_rows({"cpu_model": "Z80", "run_id": "6724a6399f46",
                                "absent_peers": {"jax": "pip install jax"}})
    assert rest == [("Run id", "6724a6399f46"), ("How to install the jax peer", "pip install jax")]


def test_busy_machine_fits_use_the_fastest_repeat():
    # Medians dragged by load (x3 at random n), minima clean: the fit follows the minima.
    records = synthetic_records(backends=("numba",))
    rng = np.random.default_rng(3)
    for r in records:
        if r["record"] == "point" and r["status"] == "ok":
            t = r["median_s"]
            r.update(min_s=t, median_s=t * float(rng.uniform(1, 3)), max_s=t * 4,
                     times_s=[t, t * 2, t * 4])
    curves = analysis.curves(analysis.split_records(records)[2])
    assert {c.statistic for c in curves} == {"min"}
    for c in curves:
        assert c.time_fit.slope == pytest.approx(analysis.EXPECTED_TIME_EXPONENT[c.attention],
                                                 abs=1e-9)
    html = build_report(records, quality=None).html
    assert "Fits and crossovers use the fastest repeat" in html


def test_cli_resume_refuses_a_foreign_out_before_measuring(tmp_path, monkeypatch, capsys):
    from fastattn.bench import sweep

    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("measured"))
    results = write_jsonl(tmp_path / "run.jsonl", synthetic_records(ns=(1024, 2048)))
    other = tmp_path / "notes.html"
    other.write_text("<html>my notes</html>")
    assert main(["report", "--resume", str(results), "--out", str(other)]) == 2
    assert "not a fastattn report" in capsys.readouterr().err
    assert other.read_text() == "<html>my notes</html>"
    beside = results.with_suffix(".html")   # the default --out, beside the results
    beside.write_text("<html>my page</html>")
    assert main(["report", "--resume", str(results)]) == 2
    assert "not a fastattn report" in capsys.readouterr().err
    assert beside.read_text() == "<html>my page</html>"


def test_cli_resume_refuses_a_read_only_results_file_before_measuring(tmp_path, monkeypatch,
                                                                      capsys):
    import os

    from fastattn.bench import sweep

    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("measured"))
    results = write_jsonl(tmp_path / "run.jsonl", synthetic_records(ns=(1024, 2048)))
    results.chmod(0o444)
    before = os.stat(results)
    assert main(["report", "--resume", str(results), "--quick"]) == 2
    assert "read-only" in capsys.readouterr().err
    after = os.stat(results)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)


def test_cli_keeps_the_users_tmp_file_and_a_symlinked_report(tmp_path, capsys):
    results = write_jsonl(tmp_path / "run.jsonl", synthetic_records(ns=(1024, 2048)))
    target = tmp_path / "real.html"
    target.write_text(f"<!DOCTYPE html>{REPORT_MARKER} older")
    target.chmod(0o640)
    link = tmp_path / "link.html"
    link.symlink_to(target)
    mine = tmp_path / "link.html.tmp"
    mine.write_text("my own temp file")
    assert main(["report", "--from", str(results), "--out", str(link)]) == 0
    assert link.is_symlink() and "older" not in target.read_text()
    assert oct(target.stat().st_mode & 0o777) == oct(0o640)
    assert mine.read_text() == "my own temp file"


def _measure_args(**given):
    import argparse

    fields = dict(resume=None, repeats=None, quick=True, n=[128], threads=None, out=None)
    return argparse.Namespace(**{**fields, **given})


@pytest.mark.parametrize("threads, idle, expected, warned", [
    (None, 1, "other work kept 1 of 2 cores busy", True),
    (None, 2, "every usable core (2)", False),
    (2, 1, "as asked (--threads)", False),
], ids=["busy-1-of-2-cores", "quiet-2-cores", "threads-2-given-while-busy"])
def test_report_says_how_many_threads_and_why(tmp_path, monkeypatch, capsys, threads, idle,
                                              expected, warned):
    from fastattn.bench import sweep
    from fastattn.report import cli as report_cli

    monkeypatch.setattr(report_cli, "default_num_threads", lambda: 2)
    monkeypatch.setattr(sweep, "idle_cores", lambda: idle)
    seen = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda points, path, options, **kw: seen.update(kw))
    report_cli._measure(_measure_args(threads=threads), tmp_path / "r.jsonl")
    assert seen["threads"] == (threads or idle)
    assert expected in seen["threads_reason"]
    assert ("fastattn report: other work kept" in capsys.readouterr().err) == warned


def test_the_thread_count_and_its_reason_reach_the_header_and_the_page(tmp_path):
    from fastattn.bench.sweep import Options, Point, run_sweep

    results = tmp_path / "r.jsonl"
    run_sweep([Point("softmax", "reference", False, 8)], results,
              Options(repeats=1, memory=False, check=False, roof=False, min_time_s=0),
              threads=1, threads_reason="because a test said so", isolate=False, progress=None)
    env = [r for r in read_records(results) if r["record"] == "environment"]
    assert env[0]["threads"] == 1 and env[0]["threads_reason"] == "because a test said so"
    html = build_report(read_records(results), source="t").html
    label = LABELS.get("threads_reason", "threads_reason")   # the schema's label, if it has one
    assert f"{label}</th><td class=\"l\">because a test said so" in html
    assert "Measured on 1 thread: because a test said so." in html


def test_cli_resume_refuses_a_file_of_another_grid_before_measuring(tmp_path, monkeypatch,
                                                                     capsys):
    """A file measured on the default grid, resumed with --quick, would mix two grids."""
    from fastattn.bench import sweep

    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("measured"))
    results = write_jsonl(tmp_path / "run.jsonl", synthetic_records(ns=(1024, 16384)))
    data = results.read_bytes()
    assert main(["report", "--resume", str(results), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "outside this run's grid" in err and "Traceback" not in err
    assert results.read_bytes() == data


def test_no_peer_and_no_recorded_hint_lists_how_to_add_every_prefill_peer(quality):
    records = synthetic_records()
    records[0]["absent_peers"] = {}   # an older run that recorded no hints
    html = build_report(records, source="synthetic", quality=quality).html
    assert "No peer ran the prefill points" in html
    for name in ("torch", "onnxruntime", "jax"):
        assert f"<br>{name}: <code>{INSTALL_HINT[name]}</code>" in html


def test_roof_probe_table_gives_the_exp_rate_one_thread(report_html):
    probes = report_html[report_html.index("Roof probes"):]
    probes = probes[:probes.index("</table>")]
    exp_row = next(row for row in probes.split("<tr>") if row.startswith('<td class="l">exp'))
    assert "<td>1 (of the run&#39;s 2)</td>" in exp_row or "<td>1 (of the run's 2)</td>" in exp_row
    gemm_row = next(row for row in probes.split("<tr>") if row.startswith('<td class="l">gemm'))
    assert "<td>2</td>" in gemm_row


def test_report_help_and_docs_name_the_largest_prefill_n_measured(capsys):
    from fastattn.report.cli import sweep_points

    largest = max(p.n for p in sweep_points(None) if p.regime == "prefill")
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert f"also at {largest}" in " ".join(capsys.readouterr().out.split())
    docs = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
    assert f"curves of the fast backends reach {largest}" in " ".join(docs.read_text().split())


def test_a_resumed_report_keeps_the_reason_for_its_thread_count(tmp_path, monkeypatch):
    from fastattn.bench import sweep

    records = synthetic_records(backends=("reference",), ns=(128,))
    records[0]["threads_reason"] = "other work kept 1 of 3 cores busy"
    path = write_jsonl(tmp_path / "run.jsonl", records)
    seen = {}

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "run_sweep", capture)
    assert main(["report", "--resume", str(path)]) == 130
    assert seen["threads"] == 2
    assert seen["threads_reason"] == ("other work kept 1 of 3 cores busy "
                                      "(when the resumed run started)")


def test_a_bench_run_of_single_shapes_lists_every_point_and_fits_nothing(quality):
    # fastattn bench --shape measures one n per kernel: no curve scales, every point is shown.
    records = synthetic_records(ns=(2048,))
    html = build_report(records, source="bench.jsonl", quality=quality).html
    assert "No kernel was measured at three or more n here" in html
    other = html[html.index("Points of kernels measured at fewer than three n"):]
    other = other[:other.index("</table>")]
    ok = [r for r in records if r["record"] == "point" and r["status"] == "ok"]
    assert other.count("<tr><td") == len(ok) == 8   # 2 backends x 2 kinds x 2 masks
    assert other.count("<td>2048</td>") == len(ok)
    assert "asv keeps none" not in html
    assert "seeded inputs (batch 1, one head)" in html
    for r in records:
        if r["record"] == "point" and r["backend"] == "numba":
            r["heads"] = 2   # a run of two shapes: the methods text names both
    html = build_report(records, source="bench.jsonl", quality=quality).html
    assert "seeded inputs (batch × heads 1 × 1, 1 × 2)" in html


@pytest.mark.parametrize("count, label", [(4, "numba softmax"), (12, "x" * 60), (40, "cython"),
                                          (3, ", ".join(["torch_flex (peer) [threads=2]"] * 8))])
def test_a_panel_of_many_or_long_labels_keeps_its_axes(count, label):
    # A report from a bench run of many shapes: dozens of curves with long labels made the
    # constrained layout collapse the axes (matplotlib warned and drew no legend).
    import warnings

    import matplotlib.pyplot as plt

    from fastattn.report import figures

    fig, axes = figures.panel_grid([("a", []), ("b", [])], 2)
    for ax in axes:
        for i in range(count):
            ax.plot([1, 2], [i + 1, i + 2], label=f"{label} {i}")
        figures.finish(ax, "panel")
    if count > figures.LEGEND_MAX:
        assert axes[0].get_legend() is None
        assert any(f"{count} curves" in t.get_text() for t in axes[0].texts)
    else:
        assert len(axes[0].get_legend().get_texts()) == count
    height = fig.get_size_inches()[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = figures.to_png(fig)
    assert png.startswith(b"\x89PNG")
    # Grown for 12 rows, or 3 labels of 240 characters wrapped to 9 lines; not for 6 rows.
    assert (height < fig.get_size_inches()[1]) == (count == 12 or len(label) > 200)
    plt.close("all")


def test_the_page_header_and_the_repeat_counts_read_as_sentences(report_html):
    meta = report_html[report_html.index('<div class="meta">'):]
    header = " ".join(meta.split("</div>")[0].split())
    assert "Measured on <b>this machine</b>." in header   # not "this machine</b> ."
    assert "the number of timed repeats" in report_html   # what "(99×)" means


def test_the_real_heatmap_is_the_head_of_lowest_softmax_row_entropy(quality):
    from scipy import stats

    from fastattn.data import load_minilm

    data = load_minilm(None)          # what the quality fixture computed on
    q, k = data["q"].astype(np.float64), data["k"].astype(np.float64)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    entropy = stats.entropy(weights, axis=-1).mean(axis=-1)      # (layers, heads), nats
    layer, head = np.unravel_index(np.argmin(entropy), entropy.shape)
    assert quality.heatmaps[1].title.startswith(f"all-MiniLM-L6-v2 layer {layer}, head {head} ")
    assert f"mean row entropy {entropy.min():.2f} nats" in quality.heatmaps[1].note


# ---------------------------------------------------------------- issue 33, item 7
def test_exponents_that_round_to_zero_have_no_sign():
    assert analysis.fixed(-0.001) == "0.00" and analysis.fixed(-0.0) == "0.00"
    assert analysis.fixed(-0.01) == "-0.01" and analysis.fixed(-1.5) == "-1.50"
    assert analysis.Fit(-0.001, 0.002, 0.0, 4, 1024, 8192).format() == "0.00 ± 0.00"
    assert analysis.Fit(-0.004, float("nan"), 0.0, 2, 1024, 2048).format() == "0.00 (2 points)"
    fits = [analysis.Fit(s, 0.01, 0.0, 4, 1024, 8192) for s in (-0.012, -0.001)]
    assert analysis.exponent_range("linear", fits, 0).startswith("linear -0.01 to 0.00 over")


def test_counts_of_one_are_singular():
    from fastattn.bench.table import plural

    assert plural(1, "thread") == "1 thread"
    assert plural(2, "idle one") == "2 idle ones"
    assert plural("1, 2", "thread") == "1, 2 threads"
    html = build_report([dict(r, threads=1) for r in synthetic_records(ns=(1024, 2048, 4096))],
                        source="t").html
    scaling = html[html.index('id="scaling"'):html.index("<h4>Throughput against the GEMM roof")]
    assert "thread(s)" not in scaling and "on 1 thread," in scaling


def test_time_bands_are_the_middle_half_of_the_repeats_not_min_to_max(monkeypatch):
    """A min-max band is as wide as the worst stalled repeat: below 1 ms the backends' bands
    merged into one grey area."""
    from fastattn.report import figures

    records = [dict(r, times_s=[t, t, t, 1.1 * t, 100 * t], min_s=t, max_s=100 * t)
               if r["record"] == "point" and r.get("status") == "ok" else r
               for r in synthetic_records(backends=("numba",), ns=(1024, 2048, 4096))
               for t in [r.get("median_s")]]
    curve_list = analysis.curves(analysis.split_records(records)[2])
    c = curve_list[0]
    assert c.q25_s == pytest.approx(c.min_s) and c.q75_s == pytest.approx(1.1 * c.min_s)
    tops = []

    def keep(fig):
        for ax in fig.axes:
            tops.extend(max(path.vertices[:, 1]) for coll in ax.collections
                        for path in coll.get_paths() if len(path.vertices))
        figures.plt.close(fig)
        return b""

    monkeypatch.setattr(figures, "to_png", keep)
    figures.scaling_figure([("all", curve_list)], "time")
    top = max(float(np.nanmax(k.q75_s)) for k in curve_list)
    assert tops and max(tops) == pytest.approx(top)      # not 100 × the fastest repeat


def test_a_memory_curve_that_falls_as_n_grows_is_called_below_resolution():
    records = [dict(r, peak_bytes=3 << 20 if r["n_k"] == 2048 else r.get("peak_bytes"))
               if r["record"] == "point" and r["backend"] == "numba" and r["attention"] == "linear"
               and not r["causal"] else r for r in synthetic_records(ns=(1024, 2048, 4096))]
    html = build_report(records, source="t").html
    assert "below what the probe resolves" in html
    assert "numba linear (non-causal): 3 MiB at n = 2048, 2 MiB at n = 4096" in html


def test_the_time_per_token_table_says_what_its_big_number_is():
    from test_report_generation import synthetic_generation

    html = build_report(synthetic_generation(), source="t").html
    assert "the large number is the time of one token, the fastest repeat" in html
    assert "fastest repeat per token [median] · tokens/s · held" in html


# ---------------------------------------------------------------- issue 33, item 3
def test_a_stalled_point_is_flagged_and_kept_out_of_fits_and_crossovers():
    """A --quick report showed causal linear attention at n = 128 about 100x slower than its
    trend on every repeat, and the page's crossover came from that one point."""
    ns = (128, 512, 1024, 2048)
    records = synthetic_records(backends=("numba",), ns=ns)
    stall = 1000.0
    for r in records:
        if (r["record"] == "point" and r["attention"] == "linear" and r["causal"]
                and r["n_k"] == 128):
            r.update({k: r[k] * stall for k in ("median_s", "min_s", "max_s")},
                     times_s=[t * stall for t in r["times_s"]])
    curve_list = analysis.curves(analysis.split_records(records)[2])
    lin = next(c for c in curve_list if c.attention == "linear" and c.causal)
    soft = next(c for c in curve_list if c.attention == "softmax" and c.causal)
    assert lin.stalled_n == [128] and soft.stalled_n == []
    assert not any(c.stalled.any() for c in curve_list if c is not lin)
    assert np.isnan(lin.fit_s[0]) and lin.measured_s[0] == pytest.approx(lin.min_s[0])
    # The crossover is that of the curves without the stall: linear faster throughout here.
    clean = analysis.curves(analysis.split_records(synthetic_records(backends=("numba",),
                                                                     ns=ns))[2])
    lin_clean = next(c for c in clean if c.attention == "linear" and c.causal)
    soft_clean = next(c for c in clean if c.attention == "softmax" and c.causal)
    expected = analysis.crossover(soft_clean.n[1:], soft_clean.fit_s[1:], lin_clean.n[1:],
                                  lin_clean.fit_s[1:])
    assert analysis.crossover(soft.n, soft.fit_s, lin.n, lin.fit_s) == expected
    assert analysis.crossover(soft.n, soft.measured_s, lin.n, lin.measured_s) != expected
    html = build_report(records, source="t").html
    summary = html[html.index('<div class="summary">'):html.index("</div>", html.index(
        '<div class="summary">'))]
    assert "Kept out of the fits and crossovers" in summary
    assert "numba linear (causal) at n = 128" in summary
    assert "(stalled)" in html[html.index('id="scaling"'):]


def test_points_on_their_trend_or_a_last_point_cliff_are_not_stalled():
    assert not analysis.stalled_points([128, 256, 512], [1e-3, 4e-3, 1.6e-2]).any()  # n²
    assert not analysis.stalled_points([1, 2, 4], [1.0, 1.0, 3.9]).any()   # under 4x
    assert not analysis.stalled_points([1, 2, 4], [1.0, 1.0, 100.0]).any()  # the last n
    assert analysis.stalled_points([1, 2, 4], [1.0, 10.0, 1.0]).tolist() == [False, True, False]
    assert analysis.stalled_points([1, 2, 4, 8], [50.0, 1.0, 1.0, 1.0]).tolist() == \
        [True, False, False, False]
    assert not analysis.stalled_points([1, 2, 4], [np.nan, 5.0, 1.0])[0]


def test_asv_history_colours_each_backend_as_the_rest_of_the_report(monkeypatch):
    from matplotlib.colors import to_hex

    from fastattn.report import figures, history as history_section

    rows = [{"machine": "box", "commit": c * 40, "date": f"2026-11-2{i}T10:00:00",
             "benchmark": "softmax.SoftmaxAttention.time_forward",
             "params": {"backend": backend, "n": n}, "value": 1e-3 * (i + 1), "unit": "seconds"}
            for backend in ("reference", "numba", "cython") for n in (256, 1024)
            for i, c in enumerate("ab")]
    rows += [{"machine": "box", "commit": "a" * 40, "date": "2026-11-20T10:00:00",
              "benchmark": "threads.Threads.track_threads", "params": {"component": "blas"},
              "value": 2, "unit": "threads"}]
    drawn = []
    monkeypatch.setattr(figures, "to_png", lambda fig: drawn.append(fig) or b"")
    history_section.history_figure(rows, "history")
    lines = drawn[0].axes[0].get_lines()
    colours = {line.get_label(): to_hex(line.get_color()) for line in lines}
    for backend in ("reference", "numba", "cython"):
        for n in (256, 1024):
            assert colours[f"box: backend={backend}, n={n}"] == figures.BACKEND_COLOURS[backend]
    assert colours["box: component=blas"] == figures.NO_BACKEND_COLOUR
    # two lines of one backend still differ, by marker or line style
    by_label = {line.get_label(): line for line in lines}
    a, b = by_label["box: backend=cython, n=256"], by_label["box: backend=cython, n=1024"]
    assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())


def _drawn_axes(monkeypatch):
    """Every visible axes of every figure the report renders, as (figure, axes) pairs."""
    from fastattn.report import figures

    drawn, to_png = [], figures.to_png

    def capture(fig):
        drawn.extend((fig, ax) for ax in fig.axes if ax.get_visible())
        return to_png(fig)

    monkeypatch.setattr(figures, "to_png", capture)
    return drawn


def test_no_empty_axes_where_no_kernel_has_a_curve(monkeypatch):
    """As from quick asv results: one n per kernel, on two machines.  The page draws no
    empty "no data" axes (its text says why there is no curve); the figure written beside
    the report says so in words."""
    drawn = _drawn_axes(monkeypatch)
    records = synthetic_records(ns=(256,), machine="box-a") + \
        synthetic_records(ns=(256,), machine="box-b")
    report = build_report(records, source="synthetic")
    assert 'alt="time against n' not in report.html
    for fig, ax in drawn:
        texts = [t.get_text() for t in ax.texts]
        assert "no data" not in texts
        assert ax.get_lines() or ax.collections or ax.images or texts, ax.get_title()
        if not (ax.get_lines() or ax.collections or ax.images):   # words only, no frame
            assert not ax.axison and not ax.patches and texts
    words = [t.get_text() for _, ax in drawn for t in ax.texts]
    assert any("fewer than 3 lengths" in w and "n = 256" in w for w in words)
    assert report.scaling_png.startswith(b"\x89PNG")
    text = " ".join(re.sub(r"<[^>]+>", " ", report.html).split())
    assert "only at n = 256" in text and "needs at least 3 lengths" in text
