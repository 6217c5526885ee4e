"""Real activations: every backend reproduces all-MiniLM-L6-v2's own attention output."""

import numpy as np
import pytest

import fastattn
from fastattn.data import load_minilm, minilm_provenance
from conftest import minilm_dir

SHARED = minilm_dir()


def _datasets():
    yield pytest.param(None, id="shipped-n128")
    for n in (128, 512):
        yield pytest.param(
            None if SHARED is None else SHARED / f"minilm_l6_qkv_n{n}.npz",
            id=f"shared-n{n}",
            marks=pytest.mark.skipif(SHARED is None, reason="../shared/data/minilm not found"),
        )


@pytest.mark.parametrize("path", list(_datasets()))
def test_softmax_reproduces_the_model_context(path, backend):
    data = load_minilm(path)
    out = fastattn.softmax_attention(data["q"], data["k"], data["v"], backend=backend)
    # Every layer and head within 1e-5 of the model's own output.
    err = np.abs(out - data["context"]).max(axis=(-2, -1))
    assert err.shape == data["q"].shape[:2]
    assert err.max() < 1e-5, f"max abs error per (layer, head):\n{err}"


def test_shipped_slice_has_provenance():
    meta = minilm_provenance()
    assert "all-MiniLM-L6-v2" in meta["model"]
    assert "Apache-2.0" in meta["model_license"]
    data = load_minilm()
    assert list(meta["arrays"]["q"]) == list(data["q"].shape) == [6, 2, 128, 32]


def test_load_minilm_refuses_a_missing_or_foreign_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MiniLM activations file"):
        load_minilm(tmp_path / "nope.npz")
    np.savez(tmp_path / "other.npz", q=np.zeros((1, 1, 2, 2)))
    with pytest.raises(ValueError, match=r"lacks the arrays \['k', 'v', 'context'\]"):
        load_minilm(tmp_path / "other.npz")


def test_load_minilm_refuses_a_file_that_is_not_an_npz(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    with pytest.raises(ValueError, match="is not an .npz archive of MiniLM activations"):
        load_minilm(text)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(ValueError, match="holds a single array, not an .npz archive"):
        load_minilm(single)


def test_report_refuses_a_bad_minilm_file_before_measuring(tmp_path, capsys, monkeypatch):
    from fastattn.bench import sweep
    from fastattn.cli import main

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured before checking --minilm")

    monkeypatch.setattr(sweep, "run_sweep", must_not_measure)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("my notes\n")
    assert main(["report", "--quick", "--minilm", str(tmp_path / "notes.txt")]) == 2
    assert "--minilm" in capsys.readouterr().err


def _save(path, **changes):
    arrays = {name: np.ones((1, 2, 4, 8), dtype=np.float32) for name in ("q", "k", "v", "context")}
    arrays.update(changes)
    np.savez(path, **arrays)
    return path


def test_load_minilm_refuses_arrays_that_are_not_finite_floats(tmp_path):
    bad_q = np.ones((1, 2, 4, 8), dtype=np.float32)
    bad_q[0, 1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="array q has 1 values that are not finite"):
        load_minilm(_save(tmp_path / "nan.npz", q=bad_q))
    big_v = np.ones((1, 2, 4, 8))
    big_v[0, 0, 1, 5] = 1e300        # finite in float64, inf in float32
    with pytest.raises(ValueError, match="array v has 1 values that are not finite"):
        load_minilm(_save(tmp_path / "big.npz", v=big_v))
    with pytest.raises(ValueError, match="array k has dtype int32; expected floating point"):
        load_minilm(_save(tmp_path / "int.npz", k=np.ones((1, 2, 4, 8), dtype=np.int32)))
    with pytest.raises(ValueError, match="the arrays are empty"):
        load_minilm(_save(tmp_path / "empty.npz", **{name: np.ones((1, 2, 0, 8)) for name in
                                                      ("q", "k", "v", "context")}))
    # float64 and float16 files load as float32, the dtype the docstring promises.
    data = load_minilm(_save(tmp_path / "f64.npz", q=np.ones((1, 2, 4, 8)),
                             k=np.ones((1, 2, 4, 8), dtype=np.float16)))
    assert {a.dtype for a in data.values()} == {np.dtype(np.float32)}


def test_report_quality_takes_minilm_of_any_head_dim(tmp_path):
    from fastattn.map_quality import compute_quality

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 16, 64), dtype=np.float32) for _ in range(3))
    path = _save(tmp_path / "d64.npz", q=q, k=k, v=v,
                 context=fastattn.softmax_attention(q, k, v, backend="reference"))
    quality = compute_quality(path)
    assert quality.frontier.d_k == 64 and quality.frontier.minilm_shape == (2, 2, 16, 64)
