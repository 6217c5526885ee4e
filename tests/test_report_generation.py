"""The decode regime (bench) and the Generation section (report), and the bench's feature maps.

Numbers come from the reference or from synthetic records with known answers: a softmax
token costing ``a · n`` and a linear token costing ``c`` (so the exponents are 1 and 0 and
a linear token is cheaper beyond ``n = c / a``).  No test depends on how fast anything runs.
"""

import re

import numpy as np
import pytest

import fastattn
from fastattn.bench import engine, sweep
from fastattn.bench.results import SCHEMA, read_records
from fastattn.bench.sweep import Options, Point, default_grid, run_sweep
from fastattn.cli import main
from fastattn.report import generation
from fastattn.report.analysis import curves
from fastattn.report.build import build_report

FAST = [b for b in ("numba", "cython") if b in fastattn.available_backends()]


def test_a_decode_point_is_one_query_against_n_keys():
    spec = Point("softmax", "reference", True, 64, regime="decode").spec()
    assert (spec["n_q"], spec["n_k"], spec["regime"]) == (1, 64, "decode")
    with pytest.raises(ValueError, match="causal"):
        Point("softmax", "reference", False, 64, regime="decode")
    with pytest.raises(ValueError, match="regime"):
        Point("softmax", "reference", True, 64, regime="verify")


def test_feature_maps_of_a_point():
    favor = Point("linear", "numba", False, 8, feature_map="favor", num_features=256)
    assert favor.num_features == 256 and favor.spec()["num_features"] == 256
    assert Point("linear", "numba", False, 8, feature_map="taylor").num_features is None
    with pytest.raises(ValueError, match="num_features applies to feature_map='favor'"):
        Point("linear", "numba", False, 8, feature_map="relu", num_features=8)
    with pytest.raises(ValueError, match="num_features must be a positive int"):
        Point("linear", "numba", False, 8, feature_map="favor", num_features=0)


@pytest.mark.parametrize("backend", ["reference", *FAST, "numpy"])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("n", [1, 2, 65], ids=lambda n: f"n{n}")
def test_a_linear_decode_step_is_the_last_row_of_one_causal_pass(backend, feature_map, n):
    spec = Point("linear", backend, True, n, d_k=8, d_v=4, heads=2, dtype="float64",
                 feature_map=feature_map, regime="decode").spec()
    q, k, v = engine.make_inputs(spec)
    out = engine.make_call(spec, q, k, v)()
    expected = fastattn.linear_attention(q, k, v, causal=True, feature_map=feature_map,
                                         backend="reference")
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)
    assert out.shape == (2, 1, 4)


@pytest.mark.parametrize("backend", ["reference", *FAST])
def test_a_softmax_decode_step_sees_every_key(backend):
    spec = Point("softmax", backend, True, 300, d_k=16, d_v=16, regime="decode").spec()
    q, k, v = engine.make_inputs(spec)
    out = engine.make_call(spec, q, k, v)()
    w = np.exp((q @ k.swapaxes(-1, -2)) / 4.0)           # scale 1/sqrt(16), no mask
    np.testing.assert_allclose(out, (w / w.sum(-1, keepdims=True)) @ v, rtol=2e-5, atol=2e-6)


def test_torch_decode_peer_agrees_with_the_reference():
    pytest.importorskip("torch")
    spec = Point("softmax", "torch", True, 200, d_k=16, d_v=16, heads=2, regime="decode").spec()
    q, k, v = engine.make_inputs(spec)
    result = engine.check_accuracy(spec, engine.make_call(spec, q, k, v)(),
                                   engine.ReferenceCache())
    assert result["check_ok"] and result["check_n"] == 200


@pytest.mark.parametrize("attention, feature_map, num_features, per_head", [
    ("softmax", None, None, lambda n, d, D: 2 * n * d),
    ("linear", "elu", None, lambda n, d, D: d * d + d),
    ("linear", "favor", 96, lambda n, d, D: D * d + D),
    ("linear", "taylor", None, lambda n, d, D: D * d + D),
], ids=["softmax-kv-cache", "linear-elu-state", "linear-favor-m96-state", "linear-taylor-state"])
def test_held_bytes_are_the_arrays_a_step_keeps(attention, feature_map, num_features, per_head):
    n, d = 100, 16
    spec = Point(attention, "reference", True, n, d_k=d, d_v=d, dtype="float32",
                 feature_map=feature_map, num_features=num_features, regime="decode").spec()
    q, k, v = engine.make_inputs(spec)
    if attention == "softmax":
        kept = k.nbytes + v.nbytes                        # the KV cache of one head
    else:
        _, (S, z) = fastattn.linear_attention(q, k, v, feature_map=engine._feature_map(spec),
                                              return_state=True, backend="reference")
        kept = S.nbytes + z.nbytes
    D = engine.feature_dim(spec)
    assert engine.held_bytes(spec) == kept == per_head(n, d, D) * 4


def test_favor_points_reach_the_call_with_their_m():
    spec = Point("linear", "reference", False, 32, d_k=8, d_v=8, feature_map="favor",
                 num_features=24).spec()
    q, k, v = engine.make_inputs(spec)
    expected = fastattn.linear_attention(
        q, k, v, feature_map=fastattn.FavorFeatures(8, num_features=24), backend="reference")
    np.testing.assert_array_equal(engine.make_call(spec, q, k, v)(), expected)
    assert engine.point_flops(spec) == 4 * 32 * 24 * 8       # the state has m rows


def test_decode_sweep_records_held_bytes_and_checks_every_peer(tmp_path):
    points = default_grid(("softmax", "linear"), ["reference", "numpy", "torch"], (8, 64),
                          d_k=8, d_v=8, regime="decode")
    assert {(p.attention, p.backend) for p in points} >= {("linear", "numpy")}
    assert ("softmax", "numpy") not in {(p.attention, p.backend) for p in points}
    assert all(p.causal for p in points)
    records = run_sweep(points, tmp_path / "d.jsonl", Options(repeats=1, min_time_s=0,
                                                              roof=False),
                        threads=1, isolate=False, progress=None)
    ok = [r for r in records if r["status"] == "ok"]
    assert {r["backend"] for r in ok} >= {"reference", "numpy"}
    assert all(r["regime"] == "decode" and r["n_q"] == 1 and r["check_ok"] for r in ok)
    assert {r["n_k"]: r["held_bytes"] for r in ok if r["attention"] == "softmax"} == \
        {8: 2 * 8 * 8 * 4, 64: 2 * 64 * 8 * 4}
    assert read_records(tmp_path / "d.jsonl")[-1]["schema"] == SCHEMA


def test_bench_cli_measures_decode_and_every_feature_map(tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    assert main(["bench", "--kind", "linear", "--regime", "decode", "--backends", "reference",
                 "numpy", "--n", "8", "16", "--d-k", "8", "--threads", "1", "--repeats", "1",
                 "--out", str(out), "--no-progress", "--no-memory"]) == 0
    text = capsys.readouterr().out
    assert "decode: one token after n keys" in text and "numpy" in text
    rows = [r for r in read_records(out) if r["record"] == "point"]
    assert {(r["backend"], r["n_k"]) for r in rows} == {
        (b, n) for b in ("reference", "numpy") for n in (8, 16)}
    assert "regime" in out.with_suffix(".csv").read_text().splitlines()[0]


def test_bench_cli_grid_of_feature_maps():
    from fastattn.bench.cli import _plan, add_parser
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--kind", "linear", "--backends", "reference",
                              "--feature-map", "elu", "relu", "favor", "taylor",
                              "--num-features", "64", "256", "--n", "16", "--causal", "no"])
    points = _plan(args)[0]
    assert sorted({(p.feature_map, p.num_features) for p in points}, key=str) == sorted(
        {("elu", None), ("relu", None), ("favor", 64), ("favor", 256), ("taylor", None)},
        key=str)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--feature-map", "cosine"])


def test_bench_cli_refuses_num_features_without_favor(capsys, tmp_path):
    assert main(["bench", "--kind", "linear", "--feature-map", "relu", "--num-features", "8",
                 "--n", "8", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--num-features" in capsys.readouterr().err


def test_the_default_report_grid_has_decode_and_feature_map_points():
    from fastattn.report.cli import sweep_points

    grid = sweep_points(None)
    decode = [p for p in grid if p.regime == "decode"]
    assert {p.n for p in decode} == set(sweep.DECODE_NS) and max(sweep.DECODE_NS) >= 65536
    assert {("linear", "numpy")} <= {(p.attention, p.backend) for p in decode}
    maps = {(p.backend, p.feature_map, p.num_features, p.n) for p in grid
            if p.attention == "linear" and p.n in (4096, 16384) and p.regime == "prefill"
            and not p.causal and p.feature_map != "elu" or (p.feature_map == "elu"
                                                             and p.n == 16384)}
    for backend in FAST:
        assert {(m, k) for b, m, k, _ in maps if b == backend} == {
            ("elu", None), ("relu", None), ("favor", 64), ("favor", 256), ("favor", 1024),
            ("favor", 4096), ("taylor", None)}
    assert not {b for b, *_ in maps} - set(FAST)          # fast backends only
    assert all(p.regime == "prefill" for p in sweep_points(None, quick=True)
               if p.feature_map not in (None, "elu"))


# ------------------------------------------------------------------ the report

A, C = 2e-9, 1e-5          # softmax token a·n, linear token c: cheaper beyond n = 5000
NS = (128, 512, 2048, 8192, 32768, 65536)


def _record(**fields):
    return {"schema": SCHEMA, "record": "point", "status": "ok", "batch": 1, "heads": 1,
            "d_k": 64, "d_v": 64, "dtype": "float32", "threads": 2, "peer": False, **fields}


def synthetic_generation(backends=("numba",)):
    records = [{"schema": SCHEMA, "record": "environment", "threads": 2,
                "threads_reason": "every usable core (2)"}]
    for backend in backends:
        for n in NS:
            for attention, t, held in (("softmax", A * n, 2 * n * 64 * 4),
                                       ("linear", C, (64 * 64 + 64) * 4)):
                records.append(_record(
                    attention=attention, backend=backend, causal=True, regime="decode",
                    n_q=1, n_k=n, feature_map="elu" if attention == "linear" else None,
                    median_s=t, min_s=t, max_s=1.1 * t, times_s=[t, 1.1 * t],
                    held_bytes=held))
        for n in (128, 1024, 8192):    # causal prefill: softmax b·n², linear e·n
            for attention, t in (("softmax", 1e-10 * n * n), ("linear", 1e-7 * n)):
                records.append(_record(
                    attention=attention, backend=backend, causal=True, regime="prefill",
                    n_q=n, n_k=n, feature_map="elu" if attention == "linear" else None,
                    median_s=t, min_s=t, max_s=t, times_s=[t]))
    return records


def test_end_to_end_adds_measured_prefill_and_per_token_times():
    every = curves([r for r in synthetic_generation() if r["record"] == "point"])
    decode = [c for c in every if c.key["regime"] == "decode"]
    prefill = [c for c in every if c.key["regime"] == "prefill"]
    rows = {(r.attention, r.prompt, r.generated): r for r in generation.end_to_end(
        prefill, decode, prompts=(1024, 8192), generated=(128, 1024))}
    soft = rows[("softmax", 1024, 128)]
    assert soft.prefill_s == pytest.approx(1e-10 * 1024 ** 2)
    assert soft.decode_s == pytest.approx(A * sum(range(1025, 1153)), rel=1e-9)
    lin = rows[("linear", 8192, 1024)]
    assert lin.total_s == pytest.approx(1e-7 * 8192 + 1024 * C, rel=1e-9)
    assert ("softmax", 128, 128) not in rows            # no prefill measured at P = 128


def test_per_token_time_is_never_extrapolated():
    curve = curves([r for r in synthetic_generation() if r["record"] == "point"
                    and r.get("regime") == "decode" and r["attention"] == "softmax"])[0]
    assert generation.per_token_seconds(curve, [65537]) is None
    assert generation.per_token_seconds(curve, [100]) is None
    assert generation.per_token_seconds(curve, [4096])[0] == pytest.approx(A * 4096)


def test_report_has_a_generation_section_with_the_known_answers():
    html = build_report(synthetic_generation(("numba", "cython")), source="t").html
    assert 'id="generation"' in html and "Time per generated token" in html
    section = html[html.index('id="generation"'):]
    assert "<td class=\"nw\">1.00 ± 0.00</td><td>1</td>" in section   # fitted exponents
    assert "<td class=\"nw\">0.00 (4 points)</td><td>0</td>" in section  # exact: no spread
    assert "n ≈ 5,000" in section                       # c / a, where linear gets cheaper
    assert "End to end" in section and "Memory held per head" in section
    assert "A linear-attention token is cheaper than a softmax one" in html   # the summary
    assert f"{1 / (A * 65536):.3g}/s" in section        # tokens per second at 65536
    scaling = html[html.index('id="scaling"'):html.index('id="generation"')]
    assert "decode" not in scaling                      # decode curves stay out of scaling


def test_generation_headline_exponents_say_when_they_rest_on_two_points():
    headline = re.search(r"Generation, time per token[^<]*",
                         build_report(synthetic_generation(), source="t").html).group(0)
    assert "softmax 1.00 over 1 curve (expected" in headline and "2 points" not in headline
    two = [r for r in synthetic_generation()
           if r.get("regime") != "decode" or r["n_k"] in (128, 2048, 8192)]
    headline = re.search(r"Generation, time per token[^<]*",
                         build_report(two, source="t").html).group(0)
    assert headline.count("each fitted to 2 points only: too few to judge") == 2


def test_peers_seen_only_in_generation_are_named_not_denied():
    records = synthetic_generation(("numba",))
    records += [dict(r, backend="numpy", peer=True) for r in records
                if r.get("regime") == "decode" and r.get("attention") == "linear"]
    html = build_report(records, source="t").html
    peers = html[html.index("<h4>Peers</h4>"):html.index("<h4>All measured points</h4>")]
    assert "in the Generation section only" in peers and "numpy" in peers
    assert "No peer ran the prefill points" in peers     # torch is still absent there


def test_memory_held_chart_has_its_own_title_and_one_line_per_equal_curves(monkeypatch):
    """Issue 33, item 2: the "Memory held per head" chart was titled "time per generated
    token", and the backends' equal held bytes were drawn on top of one another, so their
    legend entries pointed at nothing visible."""
    from fastattn.report import figures

    drawn = []

    def keep(fig):
        drawn.append([(ax.get_title(), ax.get_ylabel(), ax.get_legend_handles_labels()[1],
                       len(ax.get_lines())) for ax in fig.axes if ax.get_visible()])
        figures.plt.close(fig)
        return b""

    monkeypatch.setattr(figures, "to_png", keep)
    records = synthetic_generation(("numba", "cython"))
    generation.section(type("M", (), {
        "decode": [c for c in curves([r for r in records if r["record"] == "point"])
                   if c.key["regime"] == "decode"], "prefill": []})())
    (time_panel,), (held_panel,) = drawn
    assert "time" in time_panel[0] and len(time_panel[2]) == 4
    title, ylabel, labels, _ = held_panel
    assert "time" not in title and "memory held" in title and "memory held" in ylabel
    # numba and cython hold the same bytes: one line (and legend entry) per attention type
    assert [label.split("  n^")[0] for label in labels] == \
        ["softmax: cython, numba — equal", "linear: cython, numba — equal"]
