"""The feature-map frontier of the report: quality (computed) against cost (measured points).

Cost records are written with the results-file writer and read back, as a
sweep's would be: softmax times ``A · n²``, each map's linear times
``B · (D + 64) · n`` (so its crossover is at ``n = B · (D + 64) / A``); the
fastest backend (numba) at 0.8 of the reference's time.  Quality is checked
against formulas written here in float64.  Nothing depends on how fast
anything runs.
"""

import base64
import re

import numpy as np
import pytest

from conftest import TOLERANCES
from fastattn import FavorFeatures
from fastattn.bench.results import ResultsWriter, read_records
from fastattn.compare import seed_inputs
from fastattn.data import load_minilm
from fastattn.report import analysis, frontier
from fastattn.report.build import build_report
from fastattn.bench.schema import FAVOR_MULTIPLES
from fastattn.map_quality import (FAVOR_SEED, MAPS, ROW_SAMPLE, compute_frontier_quality,
                                  mean_quality)

A = 1e-9          # softmax seconds per n²
B = 2e-8          # linear seconds per n per feature (D + 64)
SPEED = {"reference": 1.0, "numba": 0.8}
D_K = 64
F32 = TOLERANCES[np.dtype(np.float32)]


def _linear_time(D, n):
    return B * (D + D_K) * n


def write_records(path, maps, softmax_ns=(1024, 2048, 4096, 8192, 16384), map_ns=(4096, 16384),
                  extra=()):
    """A results file: environment, softmax points and linear points of ``maps``.

    ``maps``: (feature_map, num_features) pairs as a sweep records them (num_features
    None for elu and relu).  ``extra``: (feature_map, num_features, n) points to drop.
    """
    writer = ResultsWriter(path)
    writer.write("environment", cpu_model="Synthetic CPU", cores_logical=2, threads=2)
    base = dict(causal=False, dtype="float32", batch=1, heads=1, d_k=D_K, d_v=D_K, threads=2,
                peer=False, regime="prefill")

    def point(attention, backend, n, t, **fields):
        writer.write("point", attention=attention, backend=backend, n_q=n, n_k=n, status="ok",
                     times_s=[t, 1.1 * t], median_s=1.05 * t, min_s=t, max_s=1.1 * t,
                     **base, **fields)

    for backend, speed in SPEED.items():
        for n in softmax_ns:
            point("softmax", backend, n, speed * A * n * n, feature_map=None, num_features=None)
        for name, m in maps:
            D = m if m is not None else D_K
            for n in map_ns:
                if (name, m, n) not in extra:
                    point("linear", backend, n, speed * _linear_time(D, n), feature_map=name,
                          num_features=m)
    return read_records(path)


ALL_MAPS = [("favor", f * D_K) for f in FAVOR_MULTIPLES] + [
    ("taylor", 1 + D_K + D_K * (D_K + 1) // 2), ("elu", None), ("relu", None)]


@pytest.fixture(scope="module")
def slice_data():
    return load_minilm(None)


@pytest.fixture(scope="module")
def fq(slice_data):
    """Frontier quality on the shipped MiniLM slice (6 layers x 2 heads, n = 128, d = 32)."""
    return compute_frontier_quality(slice_data, seed_inputs(128, 32, 42), (3, 1, "layer 3 head 1"))


def _curves(records):
    return analysis.curves(analysis.split_records(records)[2])


def test_the_maps_are_every_feature_map_name_favor_at_each_multiple_first():
    from fastattn.feature_maps import NAMES

    assert [m.key for m in MAPS] == ["favor-1", "favor-4", "favor-16", "favor-64", "taylor",
                                     "elu", "relu"]
    assert {m.feature_map for m in MAPS} == set(NAMES)
    assert [m.num_features(32) for m in MAPS] == [32, 128, 512, 2048, 1 + 32 + 32 * 33 // 2,
                                                  32, 32]
    assert [m.label for m in MAPS][3:] == ["FAVOR+ m = 64·d_k", "Taylor (2nd order)", "elu+1",
                                           "relu"]


# ------------------------------------------------------------------- costs
def test_every_map_costs_from_its_measured_points(tmp_path, fq):
    fr = frontier.frontier(fq, _curves(write_records(tmp_path / "r.jsonl", ALL_MAPS)))
    assert fr.missing == [] and fr.unmatched == []
    assert [r.spec.key for r in fr.rows] == ["favor-1", "favor-4", "favor-16", "favor-64",
                                             "taylor", "elu", "relu"]
    for r, (name, m) in zip(fr.rows, ALL_MAPS):
        D = m if m is not None else D_K
        assert r.cost_num_features == D
        for n in (4096, 16384):
            t = r.time_at(n)
            assert t.backend == "numba"                                # the fastest backend
            assert t.seconds == pytest.approx(0.8 * _linear_time(D, n), rel=1e-12)  # its min
        assert r.state_bytes == (D * D_K + D) * 4                    # float32 S and z
        n_cross = B * (D + D_K) / A
        if 4096 < n_cross < 16384:
            assert r.crossover.status == "crossover"
            assert r.crossover.n == pytest.approx(n_cross, rel=1e-9)
        elif n_cross <= 4096:
            assert r.crossover.status == "linear-faster-throughout"
        else:
            assert r.crossover.status == "none-in-range"
    assert [t.seconds for t in fr.softmax_times] == pytest.approx(
        [0.8 * A * 4096 ** 2, 0.8 * A * 16384 ** 2])


def test_missing_points_say_not_measured_instead_of_a_number(tmp_path, fq):
    present = [m for m in ALL_MAPS if m[0] != "taylor"]
    records = write_records(tmp_path / "r.jsonl", present + [("favor", 266)],
                            extra={("favor", 16 * D_K, 16384)})
    fr = frontier.frontier(fq, _curves(records))
    rows = {r.spec.key: r for r in fr.rows}
    taylor = rows["taylor"]
    assert not taylor.measured and taylor.crossover is None
    assert [t.seconds for t in taylor.times] == [None, None]
    assert taylor.time_at(16384).describe() == "not measured at n = 16384"
    assert fr.missing == ["Taylor (2nd order)"]
    assert rows["favor-16"].time_at(4096).seconds is not None
    assert rows["favor-16"].time_at(16384).seconds is None          # only that n is missing
    assert any("num_features=266" in label for label in fr.unmatched)   # measured, not matched
    assert any("No measured point for Taylor" in line for line in fr.headline)
    # The state is a formula of the shape, so it is shown even without a point.
    assert taylor.state_bytes == (2145 * D_K + 2145) * 4


def test_no_feature_map_points_at_all(fq):
    fr = frontier.frontier(fq, [])
    assert len(fr.missing) == len(MAPS)
    assert all(t.seconds is None for r in fr.rows for t in r.times)
    assert frontier.frontier_figure(fr)[:8] == b"\x89PNG\r\n\x1a\n"   # draws "no point"


# ----------------------------------------------------------------- quality
def _softmax64(q, k):
    s = q @ k.T / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True)


def _favor64(x, omega, shift):
    """``exp(ω x' − ‖x'‖²/2 − c) / √m``, ``x' = x / d_k^¼``; ``c`` the largest exponent of
    each row (``"row"``, queries) or of all (``"all"``, keys), as FavorFeatures documents."""
    xs = x / x.shape[-1] ** 0.25
    e = xs @ omega.T - 0.5 * (xs * xs).sum(-1, keepdims=True)
    e -= e.max(axis=-1, keepdims=True) if shift == "row" else e.max()
    return np.exp(e) / np.sqrt(len(omega))


def _elu1(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def _linear64(phi_q, phi_k, eps=1e-6):
    kern = phi_q @ phi_k.T
    return kern / (kern.sum(axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("key", ["elu", "favor-16"])
def test_minilm_metrics_match_formulas_written_here(slice_data, fq, key):
    layer = 2
    q, k, v = (slice_data[x][layer].astype(np.float64) for x in "qkv")   # (2 heads, 128, 32)
    cos, sq, num, den, kl, ent, ent_ref = [], [], 0.0, 0.0, [], [], []
    stride = max(1, q.shape[1] // ROW_SAMPLE)
    for h in range(q.shape[0]):
        if key == "elu":
            phi_q, phi_k = _elu1(q[h]), _elu1(k[h])
        else:
            omega = FavorFeatures(32, num_features=16 * 32, random_state=FAVOR_SEED).omega
            # FAVOR+'s default eps is 0 (any other would be measured in the shifted frame).
            phi_q, phi_k = _favor64(q[h], omega, "row"), _favor64(k[h], omega, "all")
        P, Q = _softmax64(q[h], k[h]), _linear64(phi_q, phi_k, 1e-6 if key == "elu" else 0.0)
        a, b = P @ v[h], Q @ v[h]
        cos += list((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1))
        sq.append(((a - b) ** 2).ravel())
        num, den = num + (b ** 2).sum(), den + (a ** 2).sum()
        P, Q = P[::stride], Q[::stride]
        P, Q = P / P.sum(-1, keepdims=True), Q / Q.sum(-1, keepdims=True)
        kl += list((P * np.log(P / Q)).sum(-1))
        ent += list(-(Q * np.log(Q)).sum(-1))
        ent_ref += list(-(P * np.log(P)).sum(-1))
    got = fq.minilm[key][layer]
    tol = dict(rel=F32["rtol"] * 10, abs=F32["atol"])
    assert got.output.cosine_similarity == pytest.approx(np.mean(cos), **tol)
    assert got.output.mse == pytest.approx(np.mean(np.concatenate(sq)), rel=1e-3)
    assert got.output.magnitude_ratio == pytest.approx(np.sqrt(num / den), **tol)
    assert got.rows.kl_divergence == pytest.approx(np.mean(kl), rel=1e-3)
    assert got.rows.entropy == pytest.approx(np.mean(ent), **tol)
    assert got.rows.reference_entropy == pytest.approx(np.mean(ent_ref), **tol)
    # The frontier row of the map is the mean over the layers.
    row = next(r for r in frontier.frontier(fq, []).rows if r.spec.key == key)
    assert row.minilm.output.cosine_similarity == pytest.approx(
        np.mean([m.output.cosine_similarity for m in fq.minilm[key]]), rel=1e-12)
    assert row.minilm.rows.kl_divergence == pytest.approx(
        np.mean([m.rows.kl_divergence for m in fq.minilm[key]]), rel=1e-12)


def test_relu_rows_that_miss_a_key_have_infinite_kl(fq):
    assert np.isinf(fq.minilm["relu"][0].rows.kl_divergence)
    assert frontier.kl_text(mean_quality(fq.minilm["relu"]).rows.kl_divergence) == "∞"
    assert frontier.kl_text(0.12345) == "0.123"
    assert np.isfinite(fq.minilm["elu"][0].rows.kl_divergence)


def test_favor_quality_improves_with_m_on_minilm(fq):
    # One fixed seed on the real activations: more features, closer to softmax.
    cos = [mean_quality(fq.minilm[f"favor-{f}"]).output.cosine_similarity
           for f in FAVOR_MULTIPLES]
    kl = [mean_quality(fq.minilm[f"favor-{f}"]).rows.kl_divergence for f in FAVOR_MULTIPLES]
    assert all(a < b for a, b in zip(cos, cos[1:])), cos
    assert all(a > b for a, b in zip(kl, kl[1:])), kl
    # ... and at m = 64·d_k FAVOR+ beats elu+1 on the output.
    assert cos[-1] > mean_quality(fq.minilm["elu"]).output.cosine_similarity


def test_heatmaps_hold_softmax_and_every_map(slice_data, fq):
    head = fq.head
    assert [label for label, _ in head.maps] == [m.label for m in MAPS]
    np.testing.assert_allclose(head.softmax, _softmax64(
        slice_data["q"][3, 1].astype(np.float64), slice_data["k"][3, 1].astype(np.float64)),
        rtol=F32["rtol"] * 10, atol=F32["atol"])
    assert all(w.shape == (128, 128) for _, w in head.maps)


# -------------------------------------------------------------------- page
def test_page_has_the_frontier_section_chart_and_numbers(tmp_path, fq):
    from fastattn.map_quality import compute_quality

    quality = compute_quality(None)
    records = write_records(tmp_path / "r.jsonl", [m for m in ALL_MAPS if m[0] != "taylor"])
    html = build_report(records, source="synthetic", quality=quality).html
    assert 'id="frontier"' in html
    chart = re.search(r'alt="quality against time per call[^"]*" src="data:image/png;base64,'
                      r'([^"]+)"', html)
    assert chart and base64.b64decode(chart.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'alt="FAVOR+ quality against the number of random features"' in html
    assert 'alt="attention weights of one MiniLM head, softmax and every feature map"' in html
    fr = frontier.frontier(quality.frontier, _curves(records))
    for r in fr.rows:    # each map's MiniLM cosine similarity as the page prints it
        assert f"{r.minilm.output.cosine_similarity:.3f}" in html
    assert "No measured point for <b>Taylor (2nd order)</b>" in html
    assert "not measured at n = 4096" in html
    assert f"random_state={FAVOR_SEED}" in html


def test_page_without_quality_has_no_frontier(tmp_path):
    records = write_records(tmp_path / "r.jsonl", ALL_MAPS[:1])
    assert 'id="frontier"' not in build_report(records, quality=None).html


def test_every_section_of_the_page_has_a_navigation_link(tmp_path):
    from fastattn.map_quality import compute_quality

    records = write_records(tmp_path / "r.jsonl", ALL_MAPS)
    records += [dict(r, regime="decode", n_q=1) for r in records  # a Generation section too
                if r["record"] == "point" and r["attention"] == "softmax"]
    html = build_report(records, source="synthetic", quality=compute_quality(None)).html
    sections = re.findall(r'<h2 id="([^"]+)"', html)
    nav = re.findall(r'<a href="#([^"]+)"', html.split("<nav>", 1)[1].split("</nav>", 1)[0])
    assert {"scaling", "generation", "quality", "frontier", "environment", "method"} <= set(
        sections)
    assert sorted(nav) == sorted(sections)


def test_the_default_report_grid_times_softmax_where_the_frontier_needs_it():
    from fastattn.bench.sweep import default_backends
    from fastattn.report.cli import sweep_points

    fast = [b for b in default_backends(peers_too=False) if b != "reference"]
    if not fast:
        pytest.skip("no fast backend built here")
    points = sweep_points(None)
    for n in frontier.COST_NS:
        timed = {p.backend for p in points if p.attention == "softmax" and not p.causal
                 and p.n == n and p.regime == "prefill" and p.d_k == 64}
        assert set(fast) <= timed, f"softmax at n = {n}: {timed}"
        maps = {(p.feature_map, p.num_features) for p in points if p.attention == "linear"
                and p.n == n and not p.causal}
        assert {("elu", None), ("relu", None), ("taylor", None)} <= maps
        assert {("favor", f * 64) for f in FAVOR_MULTIPLES} <= maps
    assert not any(p.n > max(frontier.COST_NS) for p in points if p.regime == "prefill")


def test_every_point_label_of_the_frontier_stays_inside_its_panel(tmp_path, fq, monkeypatch):
    """Issue 33, item 7: the label of the slowest map ("FAVOR+ m = 64·d_k") ran out of the
    plot on the right."""
    kept = []

    def keep(fig):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            box = ax.get_window_extent(renderer)
            for text in ax.texts:
                if text.get_text() and text.get_transform() is not ax.transAxes:
                    extent = text.get_window_extent(renderer)
                    kept.append((text.get_text(), extent.x0 >= box.x0 - 1
                                 and extent.x1 <= box.x1 + 1))
        frontier.plt.close(fig)
        return b""

    monkeypatch.setattr(frontier, "to_png", keep)
    frontier.frontier_figure(frontier.frontier(
        fq, _curves(write_records(tmp_path / "r.jsonl", ALL_MAPS))))
    assert "FAVOR+ m = 64·d_k" in dict(kept)
    assert [label for label, inside in kept if not inside] == []
