"""The report's section "What a whole model keeps" (fastattn.report.model), from a study
made by hand: no model extra needed."""

import re

from fastattn.model.evaluate import Agreement
from fastattn.model.study import ModelStudy, StudyRow
from fastattn.report.build import build_report

from test_report import synthetic_records


def _study():
    def row(name, cosine, spearman):
        return StudyRow(name, spearman, Agreement(cosine, 1.0, 0.9, 0.9, cosine, 40), 1.0)
    rows = [row("softmax", 1.0, 0.508), row("elu+1", 0.45, 0.389), row("hedgehog", 0.93, 0.513),
            row("hedgehog in layers 2, 3, 4, 5 (softmax in 2)", 0.976, 0.522)]
    seconds = {n: {r.name: 1e-3 * n / 64 * (i + 1) for i, r in enumerate(rows)}
               for n in (128, 512)}
    for n in seconds:
        seconds[n]["sentence-transformers"] = 1e-3 * n / 80

    class Fit:
        num_texts, seconds = 64, 212.0
    attention = {n: {r.name: {"softmax" if r.name == "softmax" else "linear":
                              seconds[n][r.name] / 2} for r in rows} for n in seconds}
    return ModelStudy(rows, seconds, Fit(), True, 40, 2, attention)


def test_the_section_lists_what_stays_usable_and_the_costs():
    html = build_report(synthetic_records(), model=_study()).html
    assert 'id="model"' in html and "What a whole model keeps" in html
    text = re.sub(r">\s+<", "><", " ".join(html.split()))
    # Usable: cosine >= 0.97 and Spearman within 0.03 of softmax's; hedgehog alone is not.
    assert "<b>Usable</b> (held-out cosine ≥ 0.97, Spearman within 0.03 of softmax's): " \
           "hedgehog in layers 2, 3, 4, 5 (softmax in 2)." in text
    assert "<td>hedgehog</td><td>0.513</td><td>0.930</td>" in text
    assert "<td>sentence-transformers (PyTorch)</td>" in text
    assert "read from the cache, fitted on 64 calibration texts in 212 s" in text


def test_the_attention_share_is_projected_by_each_kinds_exponent():
    from fastattn.report.model import projected_shares
    exponents = {"softmax": (2.0, ""), "linear": (1.0, "")}
    # Half of a 1 s pass at n = 512 is attention; 4x the tokens: softmax 16x, the rest 4x.
    assert projected_shares((512, 1.0), {"softmax": 0.5}, exponents, ns=(2048,)) == [0.8]
    assert projected_shares((512, 1.0), {"linear": 0.5}, exponents, ns=(2048,)) == [0.5]
    # A hybrid: 0.25 s of each kind; at 2048: 4 + 1 of attention, 2 of the rest.
    assert projected_shares((512, 1.0), {"softmax": 0.25, "linear": 0.25}, exponents,
                            ns=(2048,)) == [5 / 7]


def test_the_section_shows_the_projection_with_the_exponents_it_used():
    text = " ".join(build_report(synthetic_records(), model=_study()).html.split())
    assert "The attention's share of the forward pass, projected to long n" in text
    assert "<td>softmax</td><td>50%</td>" in text.replace("> <", "><")
    # the exponent comes from the scaling section's fits of these records, and says so
    assert re.search(r"softmax \d\.\d\d, fitted \(\d+ curves\)", text)


def test_a_study_without_attention_seconds_still_loads():
    import json
    d = json.loads(_real_study().to_json())
    del d["attention_seconds"]
    study = ModelStudy.from_json(json.dumps(d))
    assert study.attention_seconds == {}
    assert "projected to long n" not in build_report(synthetic_records(), model=study).html


def test_without_the_extra_the_section_says_how_to_add_it():
    html = build_report(synthetic_records(), model='the model extra is not installed: '
                        'pip install -e ".[model]"').html
    assert "Not measured here: the model extra is not installed" in html


def test_no_section_when_not_asked():
    assert 'id="model"' not in build_report(synthetic_records()).html


def _real_study():
    """A study with the fit's own dataclasses, as report_study returns it."""
    from fastattn.model.hedgehog import HedgehogFit, LayerFit
    study = _study()
    study.fit = HedgehogFit([LayerFit(0, 0.7, 0.2, 50, False, "limit", 10.0, 20.0)],
                            65.0, 126.0, num_texts=64)
    return study


def test_a_study_survives_its_json():
    from fastattn.model.study import ModelStudy
    study = _real_study()
    assert ModelStudy.from_json(study.to_json()) == study


def test_a_rebuild_reads_the_study_kept_beside_the_results(tmp_path, capsys):
    """A rebuild (--from) replaced a measured section with 'not measured'."""
    from fastattn.cli import main
    from fastattn.report.cli import model_study_path
    from test_report import write_jsonl

    results = tmp_path / "run.jsonl"
    write_jsonl(results, synthetic_records())
    out = tmp_path / "a.html"
    assert main(["report", "--from", str(results), "--out", str(out)]) == 0
    assert "kept no whole-model study (run.model.json)" in out.read_text()
    model_study_path(results).write_text(_real_study().to_json())
    assert main(["report", "--from", str(results), "--out", str(out)]) == 0
    text = re.sub(r">\s+<", "><", " ".join(out.read_text().split()))
    assert "<td>hedgehog</td><td>0.513</td><td>0.930</td>" in text
    model_study_path(results).write_text("{not json")
    assert main(["report", "--from", str(results), "--out", str(out)]) == 2
    assert "run.model.json: not a whole-model study" in capsys.readouterr().err
