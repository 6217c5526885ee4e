"""The peers' call builders (fastattn.bench.peers): each output against the float64 reference.

Every test that runs a peer skips when that peer is not installed; the
registry tests run everywhere and import no peer.
"""

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fastattn
from fastattn.bench import peers

from conftest import TOLERANCES, make_qkv, reference64

SOFTMAX_PEERS = {
    "torch": ("torch", (np.float32, np.float64)),
    "onnxruntime": ("onnxruntime", (np.float32,)),
    "jax": ("jax", (np.float32,)),  # its softmax is always float32
    "torch_flex": ("torch", (np.float32,)),  # FlexAttention on the CPU: no float64
    "openvino": ("openvino", (np.float32,)),  # its CPU plugin computes f64 in f32
}

def _softmax(name):
    """Peer ``name``'s builder of prefill softmax attention."""
    return peers.PEERS[name].calls["softmax", "prefill"]


CASES = [
    pytest.param(name, np.dtype(dtype), causal, batch, heads, n, d_k, d_v,
                 id=f"{name}-{np.dtype(dtype).name}-{'causal' if causal else 'full'}"
                    f"-B{batch}-H{heads}-n{n}-dk{d_k}-dv{d_v}")
    for name, (_, dtypes) in SOFTMAX_PEERS.items()
    for dtype in dtypes
    for causal in (False, True)
    # jax.nn.dot_product_attention takes d_v == d_k only
    for batch, heads, n, d_k, d_v in ((1, 1, 37, 16, 16), (2, 3, 33, 8, 8 if name == "jax" else 5))
]


@pytest.mark.parametrize("name, dtype, causal, batch, heads, n, d_k, d_v", CASES)
def test_peer_softmax_agrees_with_the_reference(name, dtype, causal, batch, heads, n, d_k, d_v):
    pytest.importorskip(SOFTMAX_PEERS[name][0])
    q, k, v = make_qkv((batch * heads, n, d_k), d_v=d_v, dtype=dtype, seed=batch + heads)
    scale = 0.3
    out = _softmax(name)(q, k, v, causal, scale, heads=heads)()
    ref = reference64(fastattn.softmax_attention, q, k, v, causal=causal, scale=scale)
    assert out.shape == (batch * heads, n, d_v) and out.dtype == dtype
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol["rtol"], atol=tol["atol"])
    # heads are kept apart: the same inputs as one head per batch entry agree too
    if heads > 1:
        single = _softmax(name)(q, k, v, causal, scale, heads=1)()
        np.testing.assert_allclose(single, ref, rtol=tol["rtol"], atol=tol["atol"])


@pytest.mark.parametrize("name", list(SOFTMAX_PEERS))
def test_peer_softmax_refuses_a_causal_mask_it_aligns_differently(name):
    pytest.importorskip(SOFTMAX_PEERS[name][0])
    q, k, v = make_qkv((1, 4, 8), n_k=6, dtype=np.float32)
    with pytest.raises(ValueError, match="n_q == n_k"):
        _softmax(name)(q, k, v, True, 0.5)


@pytest.mark.parametrize("name", list(SOFTMAX_PEERS))
def test_peer_softmax_refuses_heads_that_do_not_divide_the_batch(name):
    pytest.importorskip(SOFTMAX_PEERS[name][0])
    q, k, v = make_qkv((4, 8, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="heads"):
        _softmax(name)(q, k, v, False, 0.5, heads=3)


def test_jax_refuses_d_v_other_than_d_k():
    pytest.importorskip("jax")
    q, k, v = make_qkv((1, 8, 8), d_v=5, dtype=np.float32)
    with pytest.raises(ValueError, match="d_v == d_k"):
        peers.jax_softmax_call(q, k, v, False, 0.5)


@pytest.mark.parametrize("name", ["onnxruntime", "jax", "torch_flex", "openvino"])
def test_float32_only_peers_refuse_float64(name):
    pytest.importorskip(SOFTMAX_PEERS[name][0])
    q, k, v = make_qkv((1, 8, 8), dtype=np.float64)
    with pytest.raises(TypeError, match="float32"):
        _softmax(name)(q, k, v, False, 0.5)


def test_every_peer_has_an_install_hint_and_a_builder():
    assert set(peers.INSTALL_HINT) == set(peers.PEERS)
    assert all(peer.calls and peer.install for peer in peers.PEERS.values())
    assert {name for name, peer in peers.PEERS.items()
            if ("softmax", "prefill") in peer.calls} == set(SOFTMAX_PEERS)
    assert peers.why_not("numpy", "linear", regime="decode") is None
    assert "float32 only" in peers.why_not("onnxruntime", "softmax", "float64", 64, 64)
    assert "no feature map" in peers.why_not("torch", "linear", feature_map="favor")


def test_absent_peers_name_the_command_that_adds_them(monkeypatch):
    monkeypatch.setattr(peers, "_findable", lambda module: module not in ("onnx", "jax",
                                                                           "openvino"))
    assert peers.available_peers() == ("torch", "torch_flex", "numpy")
    absent = peers.absent_peers()
    # onnxruntime needs onnx to build its graph
    assert set(absent) == {"onnxruntime", "jax", "openvino"}
    assert "install onnxruntime onnx" in absent["onnxruntime"] and "jax" in absent["jax"]


def test_listing_the_peers_imports_none_of_them():
    code = ("import sys, json; from fastattn.bench import environment, peers; "
            "peers.set_peer_threads(1); "
            "print(json.dumps([peers.available_peers(), peers.absent_peers(), peers.peer_threads(), "
            "{n: p.version() for n, p in peers.PEERS.items()}, "
            "[m for m in ('torch', 'onnxruntime', 'onnx', 'jax', 'openvino') "
            "if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    available, absent, threads, versions, imported = json.loads(out.stdout)
    assert imported == []
    assert set(available) | set(absent) == set(peers.PEERS)
    assert set(threads) == set(available) and all(threads[n] == 1 for n in available)
    assert all(isinstance(versions[name], str) for name in available)


def _threads_in_a_fresh_process(name, n_threads):
    """``peer_threads()[name]`` and the output check, after running that peer in a new process."""
    code = f"""
import json, numpy as np
from fastattn.bench import peers
peers.set_peer_threads({n_threads})
q = np.random.default_rng(0).standard_normal((2, 16, 8)).astype(np.float32)
out = peers.PEERS[{name!r}].calls["softmax", "prefill"](q, q, q, False, 0.5, heads=2)()
print(json.dumps(peers.peer_threads()[{name!r}]))
"""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# torch_flex has torch's thread count (the same functions), and compiles for a while
@pytest.mark.parametrize("name", [name for name in SOFTMAX_PEERS if name != "torch_flex"])
def test_peer_threads_reports_the_count_set(name):
    pytest.importorskip(SOFTMAX_PEERS[name][0])
    assert _threads_in_a_fresh_process(name, 1) == 1
    assert _threads_in_a_fresh_process(name, 2) == (2 if name != "jax" else fastattn._threads.default_num_threads())


def test_one_jax_thread_goes_into_the_xla_flags_before_jax_starts(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    peers.set_peer_threads(1)
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_dump_to=/nowhere"
    assert set(peers._XLA_ONE_THREAD) <= set(flags)
    peers.set_peer_threads(2)
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/nowhere"]


def test_every_extra_pins_torch_and_the_hints_name_the_venvs_pip():
    # An unpinned torch, or the pinned one from PyPI, pulls a CUDA build of gigabytes: the
    # hints never install the extras (which would take torch from PyPI), and take torch at
    # the extras' pin from PyTorch's CPU index, with the pip of the README's .venv (a bare
    # pip may be another Python's).
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    torch_pins = [req for reqs in extras.values() for req in reqs if req.startswith("torch")]
    assert torch_pins and all(req.startswith("torch==") for req in torch_pins)
    for name in ("torch", "torch_flex", "onnxruntime", "jax", "openvino"):
        hint = peers.INSTALL_HINT[name]
        assert hint.startswith(".venv/bin/pip install ") and "[peers]" not in hint
        assert all(p == ".venv/bin/pip" for p in re.findall(r"\S*pip(?= install)", hint))
    assert peers.INSTALL_HINT["torch"].startswith(
        f".venv/bin/pip install {torch_pins[0]} --index-url https://download.pytorch.org/whl/cpu")


def _reference_softmax(q, k, v, causal, scale, heads=1):
    return lambda: fastattn.softmax_attention(q, k, v, causal=causal, scale=scale,
                                              backend="reference")


def test_a_new_peer_is_one_record_and_an_absent_one_says_how_to_install_it(monkeypatch, tmp_path):
    from fastattn.bench.sweep import Options, Point, run_sweep

    calls = {("softmax", "prefill"): _reference_softmax}
    monkeypatch.setitem(peers.PEERS, "mine", peers.Peer(
        "mine", ("numpy",), ".venv/bin/pip install mine", calls, lambda n: None, lambda: 3))
    monkeypatch.setitem(peers.PEERS, "gone", peers.Peer(
        "gone", ("no_such_module_fastattn",), ".venv/bin/pip install gone", calls,
        lambda n: None, lambda: 1))
    assert "mine" in peers.available_peers() and "gone" not in peers.available_peers()
    assert peers.peer_threads()["mine"] == 3 and "gone" not in peers.peer_threads()
    assert peers.absent_peers()["gone"] == ".venv/bin/pip install gone"
    assert "no linear attention" in peers.why_not("mine", "linear")
    points = [Point("softmax", name, False, 16, 8, 8) for name in ("mine", "gone")]
    mine, gone = run_sweep(points, tmp_path / "r.jsonl", Options(repeats=1, memory=False,
                                                                   roof=False),
                           threads=1, isolate=False, progress=None)
    assert mine["status"] == "ok" and mine["peer"] and mine["check_ok"]
    assert gone["status"] == "skipped" and gone["reason"].endswith(
        "in the fastattn checkout, with: .venv/bin/pip install gone")


def test_install_hints_are_commands_to_paste_as_they_are():
    for hint in peers.INSTALL_HINT.values():
        assert "(" not in hint and "checkout" not in hint, hint


def test_flex_attention_compiles_when_built_and_not_again():
    torch = pytest.importorskip("torch")
    q, k, v = make_qkv((2, 24, 8), dtype=np.float32)
    first = peers.torch_flex_call(q, k, v, True, 0.4)
    assert first.fields["compile_s"] > 0 and "dynamic=False" in first.fields["peer_path"]
    q2, k2, v2 = make_qkv((2, 40, 8), dtype=np.float32)
    second = peers.torch_flex_call(q2, k2, v2, True, 0.4)  # another shape, compiled apart
    assert second.fields["compile_s"] > 0
    with torch.compiler.set_stance("fail_on_recompile"):  # the timed calls compile nothing
        out, out2 = first(), second()
    ref = reference64(fastattn.softmax_attention, q, k, v, causal=True, scale=0.4)
    np.testing.assert_allclose(out, ref, **TOLERANCES[np.dtype(np.float32)])
    assert out2.shape == (2, 40, 8)


def test_openvino_says_which_path_its_graph_took():
    pytest.importorskip("openvino")
    q, k, v = make_qkv((2, 24, 8), dtype=np.float32)
    call = peers.openvino_softmax_call(q.copy(), k.copy(), v.copy(), True, 0.4)
    gc.collect()
    garbage = [np.full(x.shape, 1e3, np.float32) for x in (q, k, v) for _ in range(4)]
    # the request reads inputs whose only owner is the call
    ref = reference64(fastattn.softmax_attention, q, k, v, causal=True, scale=0.4)
    np.testing.assert_allclose(call(), ref, **TOLERANCES[np.dtype(np.float32)])
    fields = call.fields
    assert fields["compile_s"] > 0 and garbage
    path = fields["peer_path"]
    assert path.startswith(("SDPA node: ", "SDPA decomposed: ")) and "/" in path


@pytest.mark.parametrize("name, regime", [("torch_flex", "prefill"), ("torch_flex", "decode"),
                                          ("openvino", "prefill"), ("openvino", "decode")])
def test_new_peers_pass_the_bench_check_and_record_their_compile(name, regime):
    from fastattn.bench import engine, results
    from fastattn.bench.sweep import Point

    pytest.importorskip(SOFTMAX_PEERS[name][0])
    spec = Point("softmax", name, True, 40, d_k=8, d_v=8, heads=2, regime=regime).spec(1)
    call, fields, _, _ = engine.prepare_point(spec, memory=False)
    assert call is not None, fields
    assert fields["check_ok"] and fields["compile_s"] > 0 and fields["peer_path"]
    record = {"schema": results.SCHEMA, "record": "point", **spec, **fields, "median_s": 1.0}
    assert results.check_record(record) is None
