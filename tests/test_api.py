"""The public contract: dtypes, dispatch, thread control, the command line."""

import warnings

import numpy as np
import pytest

import fastattn
from conftest import BACKENDS, assert_close, make_qkv, reference64


@pytest.mark.parametrize("fn", [fastattn.softmax_attention, fastattn.linear_attention],
                         ids=["softmax", "linear"])
@pytest.mark.parametrize(
    "dtypes, result",
    [
        ((np.float32,) * 3, np.float32),
        ((np.float64,) * 3, np.float64),
        ((np.float16,) * 3, np.float16),
        ((np.float32, np.float32, np.float64), np.float64),
        ((np.float16, np.float32, np.float32), np.float32),
    ],
    ids=["f32", "f64", "f16", "f32+f64", "f16+f32"],
)
def test_result_dtype_follows_the_inputs(fn, dtypes, result, backend):
    q, k, v = make_qkv((2, 9, 4), seed=7)
    q, k, v = (x.astype(dt) for x, dt in zip((q, k, v), dtypes))
    out = fn(q, k, v, backend=backend)
    assert out.dtype == result
    compute = np.float64 if result == np.float64 else np.float32
    expected = reference64(fn, q, k, v)
    # float16 results are rounded once at the end: half-precision tolerance.
    assert_close(out, expected.astype(out.dtype), dtype=result if result == np.float16 else compute)


def test_float16_is_computed_in_float32():
    # exp(12) overflows float16 (max 65504) but not float32: the result must be finite.
    q = np.full((4, 2), 8.0, np.float16)
    k = np.full((4, 2), 8.0, np.float16)
    v = np.arange(8, dtype=np.float16).reshape(4, 2)
    out = fastattn.softmax_attention(q, k, v, scale=1.0, backend="reference")
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), np.tile(v.mean(axis=0), (4, 1)), rtol=1e-3)


def test_unknown_backend_lists_the_available_ones():
    q, k, v = make_qkv((3, 2))
    with pytest.raises(ValueError, match="backend must be") as info:
        fastattn.softmax_attention(q, k, v, backend="cuda")
    for name in BACKENDS:
        assert repr(name) in str(info.value)


def test_unavailable_backend_says_why(monkeypatch):
    from fastattn import _backends

    monkeypatch.setitem(_backends.BACKEND_MODULES, "numba", "fastattn._no_such_module")
    monkeypatch.setattr(_backends, "_loaded", {})
    monkeypatch.setattr(_backends, "_unavailable", {})
    q, k, v = make_qkv((3, 2))
    with pytest.raises(ValueError, match="'numba' is not available here"):
        fastattn.linear_attention(q, k, v, backend="numba")
    assert "numba" not in fastattn.available_backends()
    assert "No module named" in fastattn.unavailable_backends()["numba"]


def test_a_backend_whose_import_warns_under_warnings_as_errors_is_unavailable(
        monkeypatch, tmp_path):
    """``python -W error``: a backend's import-time warning (Numba without a writable
    cache warns) marks it unavailable with the reason; listing the backends never raises."""
    import warnings

    from fastattn import _backends

    (tmp_path / "_warns_on_import.py").write_text(
        "import warnings\nwarnings.warn('no disk cache here', RuntimeWarning)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_backends.BACKEND_MODULES, "numba", "_warns_on_import")
    monkeypatch.setattr(_backends, "_loaded", {})
    monkeypatch.setattr(_backends, "_unavailable", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "numba" not in fastattn.available_backends()
    assert "RuntimeWarning: no disk cache here" in fastattn.unavailable_backends()["numba"]


def test_auto_picks_the_first_available_in_order():
    from fastattn import _api

    assert fastattn.available_backends()[0] in ("cython", "numba", "reference")
    assert _api.get_backend("auto") is _api.get_backend(fastattn.available_backends()[0])
    assert fastattn.available_backends()[-1] == "reference"


def test_thread_control_sets_blas_and_restores():
    from threadpoolctl import threadpool_info

    before = fastattn.get_num_threads()
    with fastattn.num_threads(1):
        counts = fastattn.get_num_threads()
        assert counts["requested"] == 1
        assert counts["blas"] == 1
        assert all(info["num_threads"] == 1 for info in threadpool_info() if info["user_api"] == "blas")
    assert fastattn.get_num_threads() == before
    with pytest.raises(ValueError, match="n_threads"):
        fastattn.set_num_threads(0)


def test_cli_compare_prints_the_seed_experiment(capsys):
    from fastattn.cli import main

    assert main(["compare", "--n", "16", "--d", "8", "--seed", "3"]) == 0
    text = capsys.readouterr().out
    expected = fastattn.compare(16, 8, seed=3).quality
    assert f"{expected.cosine_similarity:.4g}" in text
    assert f"{expected.mse:.6g}" in text
    assert f"{expected.magnitude_ratio:.4g}" in text


@pytest.mark.parametrize("argv, why", [
    (["--n", "0"], "positive integer"),
    (["--seed", "-1"], "expected a seed from 0 to 2**32 - 1, got -1"),   # as --help says
    (["--seed", "4294967296"], "expected a seed from 0 to 2**32 - 1, got 4294967296"),
    (["--seed", "x"], "expected a seed, an integer from 0 to 2**32 - 1, got 'x'"),
])
def test_cli_refuses_a_bad_size_or_seed(argv, why, capsys):
    from fastattn.cli import main

    with pytest.raises(SystemExit) as info:
        main(["compare", *argv])
    assert info.value.code == 2
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("argv, why", [
    (["--n", "3", "--d", "100000"], "n=3, d=100000"),   # a d x d state of 40 GB
])
def test_cli_compare_refuses_what_cannot_run_with_a_message(argv, why, capsys):
    from fastattn.cli import main

    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastattn compare: error:") and why in err, err


def test_thread_counts_are_bounded_and_numpy_ints_accepted():
    from fastattn._threads import MAX_THREADS_PER_CORE, default_num_threads

    before = fastattn.get_num_threads()
    with pytest.raises(ValueError, match=r"n_threads must be an integer from 1 to"):
        fastattn.set_num_threads(10**6)
    with pytest.raises(ValueError, match="n_threads"):
        fastattn.set_num_threads(MAX_THREADS_PER_CORE * default_num_threads() + 1)
    with fastattn.num_threads(np.int64(1)):
        assert fastattn.get_num_threads()["requested"] == 1
    assert fastattn.get_num_threads() == before
    for wrong in ("2", 2.0, True, None):
        with pytest.raises(TypeError, match=r"n_threads must be an integer from 1 to .*, got"):
            fastattn.set_num_threads(wrong)
        with pytest.raises(TypeError, match="n_threads"):
            fastattn.num_threads(wrong)
    assert fastattn.get_num_threads() == before


def test_cli_refuses_absurd_thread_counts(capsys):
    from fastattn.cli import main

    for command in (["bench", "--threads", "100000"], ["report", "--threads", "100000"]):
        with pytest.raises(SystemExit) as info:
            main(command)
        assert info.value.code == 2
        assert "n_threads must be an integer from 1 to" in capsys.readouterr().err


def test_available_memory_is_the_systems_without_psutil():
    """The memory check's figure: Linux's MemAvailable, as psutil reports it (where installed)."""
    from fastattn.reference import available_memory

    got = available_memory()
    assert isinstance(got, int) and got > 0
    psutil = pytest.importorskip("psutil")
    want = psutil.virtual_memory().available
    assert abs(got - want) < 0.1 * want


@pytest.mark.parametrize("call", [
    lambda q, v: fastattn.softmax_attention(q, q, v, backend="reference"),
    lambda q, v: fastattn.linear_attention(q, q, v, feature_map="taylor", backend="reference"),
], ids=["softmax", "taylor"])
def test_the_reference_is_quiet_about_a_float32_overflow_the_float64_call_repairs(call):
    # q kᵀ of 1e40 (softmax) and q_a q_b of 1e40 (Taylor's features) overflow float32; the
    # answer, computed again in float64, is finite, as on the compiled backends.
    q = np.full((1, 4, 8), 1e20, np.float32)
    v = np.arange(32, dtype=np.float32).reshape(1, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = call(q, v)
    wide = call(q.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(out, wide, rtol=1e-6)
