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
    return ModelStudy(rows, seconds, Fit(), True, 40, 2)


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


def test_without_the_extra_the_section_says_how_to_add_it():
    html = build_report(synthetic_records(), model='the model extra is not installed: '
                        'pip install -e ".[model]"').html
    assert "Not measured here: the model extra is not installed" in html


def test_no_section_when_not_asked():
    assert 'id="model"' not in build_report(synthetic_records()).html
