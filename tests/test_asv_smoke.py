"""CI smoke pass of the asv suite: a broken benchmark fails this test.

Runs, in this (installed, development) environment, ``asv check
--python=same`` and the documented quick run, ``FASTATTN_ASV_QUICK=1 asv run
--python=same --quick`` (one tiny n, float32 only), with asv.conf.json's own
launch method (its forkserver: asv's default starts an interpreter for each of
the suite's 686 combinations, about 10 minutes here), so it takes well under a
minute (:data:`QUICK_RUN_TIMEOUT_S` only guards against a hang).  asv drops
``PYTHONPATH`` from its benchmark processes; ``ASV_PYTHONPATH`` makes them
import the fastattn of this checkout.
asv exits 1 when the suite cannot be imported or a benchmark's signature is
wrong (check) and 2 when any benchmark, or any parameter combination of one,
raises (run); a combination skipped in setup (NotImplementedError) is not a
failure.  The run uses a throw-away copy of asv.conf.json whose results, html
and env dirs are in a temporary directory, so the developer's .asv/results
(and its benchmarks.json) are left alone.

The decode and feature-map benchmarks are also called here directly, at their
smallest n on the reference backend: that each measures what it names (a
token that sees n keys, the bytes of the KV cache or of the state, the map and
m it says) and that what an older commit lacks is skipped in setup.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fastattn
from conftest import assert_close

pytest.importorskip("asv", reason="asv is not installed (pip install -e '.[bench]')")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import common, decode, feature_maps  # noqa: E402

sys.path.remove(str(ROOT))

#: Every benchmark of the suite; each must run ("ok"), not fail or vanish.
EXPECTED = (
    "decode.Decode.time_token",
    "decode.Decode.track_bytes_per_head",
    "decode.Decode.track_peak_bytes",
    "feature_maps.Favor.time_forward",
    "feature_maps.Favor.track_peak_bytes",
    "feature_maps.FeatureMaps.time_forward",
    "feature_maps.FeatureMaps.track_peak_bytes",
    "linear.LinearAccuracy.track_max_abs_error",
    "linear.LinearAttention.time_forward",
    "linear.LinearAttention.track_peak_bytes",
    "softmax.SoftmaxAccuracy.track_max_abs_error",
    "softmax.SoftmaxAttention.time_forward",
    "softmax.SoftmaxAttention.track_peak_bytes",
    "threads.Threads.track_threads",
)


def _strip_json_comments(text):
    """asv.conf.json allows // comments (asv reads it as JSON5-ish); drop them."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))


@pytest.fixture(scope="module")
def asv_config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("asv")
    conf = json.loads(_strip_json_comments((ROOT / "asv.conf.json").read_text()))
    conf.update(
        repo=str(ROOT),
        benchmark_dir=str(ROOT / "benchmarks"),
        results_dir=str(tmp / "results"),
        html_dir=str(tmp / "html"),
        env_dir=str(tmp / "env"),
    )
    path = tmp / "asv.conf.json"
    path.write_text(json.dumps(conf))
    # asv keeps machine descriptions in ~/.asv-machine.json; a private HOME
    # keeps CI non-interactive and the developer's file untouched.
    home = tmp / "home"
    home.mkdir()
    code, out = _asv(path, "machine", "--yes", "--machine", "ci-smoke", timeout=60)
    assert code == 0, out
    return path


#: A guard against a hung run, not a speed target (its duration is in docs/asv.md).
QUICK_RUN_TIMEOUT_S = 900


def _asv(config, *args, timeout):
    # asv drops PYTHONPATH in its benchmark processes and passes ASV_PYTHONPATH on as it.
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, FASTATTN_ASV_QUICK="1", HOME=str(Path(config).parent / "home"),
               ASV_PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-m", "asv", "--config", str(config), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_asv_check(asv_config):
    code, out = _asv(asv_config, "check", "--python=same", timeout=120)
    assert code == 0, out
    assert "No problems found" in out, out


def test_asv_conf_forks_each_benchmark_process_from_one_server():
    conf = json.loads(_strip_json_comments((ROOT / "asv.conf.json").read_text()))
    assert conf.get("launch_method") == "forkserver"


def test_asv_quick_run_has_no_failed_benchmark(asv_config):
    # The documented command, with its launch method from asv.conf.json.
    code, out = _asv(
        asv_config, "run", "--python=same", "--quick", "--show-stderr",
        "--machine", "ci-smoke", timeout=QUICK_RUN_TIMEOUT_S,
    )
    assert code == 0, f"asv run exited {code} (2: a benchmark failed)\n{out}"
    assert not re.search(r"\bfailed\b", out), out
    for name in EXPECTED:
        assert re.search(re.escape(name) + r"\s+ok\b", out), f"{name} did not run ok:\n{out}"


# --- the decode and feature-map benchmarks, called directly ----------------
N0 = int(common.DECODE_N[0])


def _decode(monkeypatch, attention, dtype, backend="reference"):
    monkeypatch.setattr(common, "QUICK", False)
    bench = decode.Decode()
    bench.setup(common.REGIME_DECODE, attention, backend, common.DECODE_N[0], dtype)
    return bench


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decode_holds_a_kv_cache_of_n_keys_or_a_state(monkeypatch, dtype):
    item = np.dtype(dtype).itemsize
    d = common.D
    args = (common.REGIME_DECODE, None, None, None, None)
    softmax = _decode(monkeypatch, "softmax", dtype)
    assert softmax.track_bytes_per_head(*args) == 2 * N0 * d * item       # k and v: 2 n d
    linear = _decode(monkeypatch, "linear", dtype)
    assert linear.track_bytes_per_head(*args) == (d * d + d) * item       # S and z: d_k d_v + d_k
    for bench in (softmax, linear):   # the engine's probe of the timed step, as it says
        probed = []
        monkeypatch.setattr(common.engine, "peak_extra_bytes",
                            lambda call: probed.append(call) or (12345, "hwm", 0.0))
        assert bench.track_peak_bytes(*args) == 12345 and probed == [bench.step]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decode_step_is_a_token_that_sees_n_keys(monkeypatch, dtype):
    # The timed step, against formulas written here over the same n keys in float64.
    q, k, v = (x.astype(np.float64) for x in decode.decode_qkv(
        decode.decode_spec("softmax", "reference", N0, dtype)))
    assert q.shape == (common.DECODE_HEADS, 1, common.D) and k.shape[1] == N0
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(common.D)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    expected = (weights / weights.sum(axis=-1, keepdims=True)) @ v
    assert_close(_decode(monkeypatch, "softmax", dtype).step(), expected, dtype)

    def phi(x):
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))

    S, z = phi(k).transpose(0, 2, 1) @ v, phi(k).sum(axis=1)
    expected = (phi(q) @ S) / ((phi(q) @ z[:, :, None]) + 1e-6)
    out, (S_out, z_out) = _decode(monkeypatch, "linear", dtype).step()
    assert_close(out, expected, dtype)
    assert_close(S_out, S, dtype, scale=N0)   # a sum of n terms
    assert_close(z_out, z, dtype, scale=N0)


def test_decode_skips_in_quick_mode_and_on_a_commit_without_state(monkeypatch):
    bench = decode.Decode()
    monkeypatch.setattr(common, "QUICK", True)
    with pytest.raises(NotImplementedError, match="QUICK"):
        bench.setup(common.REGIME_DECODE, "softmax", "reference", common.DECODE_N[1], "float32")
    with pytest.raises(NotImplementedError, match="QUICK"):
        bench.setup(common.REGIME_DECODE, "softmax", "reference", common.DECODE_N[0], "float64")
    monkeypatch.setattr(fastattn, "linear_attention", lambda q, k, v, *, causal=False: q)
    with pytest.raises(NotImplementedError, match="carries no state"):
        bench.setup(common.REGIME_DECODE, "linear", "reference", common.DECODE_N[0], "float32")


def _feature_bench(monkeypatch, cls, first, causal=False, n=None):
    monkeypatch.setattr(common, "QUICK", False)
    bench = cls()
    bench.setup(first, "reference", n or common.FEATURE_N[0], causal, "float32")
    return bench


@pytest.mark.parametrize("cls, first, D", [
    (feature_maps.FeatureMaps, "elu", 64), (feature_maps.FeatureMaps, "relu", 64),
    (feature_maps.FeatureMaps, "taylor", 1 + 64 + 64 * 65 // 2),
    (feature_maps.FeatureMaps, "favor", 266),   # round(64 ln 64), fastattn's default m
    (feature_maps.Favor, common.FAVOR_M[0], 64), (feature_maps.Favor, common.FAVOR_M[-1], 4096)],
    ids=["elu-D64", "relu-D64", "taylor-D2145", "favor-D266", "favor-m64-D64",
         "favor-m4096-D4096"])
def test_feature_map_benchmark_calls_the_map_and_m_it_names(monkeypatch, cls, first, D):
    bench = _feature_bench(monkeypatch, cls, first)
    arg = bench.call.keywords["feature_map"]
    if cls is feature_maps.Favor:
        assert isinstance(arg, fastattn.FavorFeatures) and arg.num_features == int(first)
        assert arg.random_state == 0
    else:
        assert arg == first
    assert feature_maps.feature_dim(arg) == D
    _, (S, z) = fastattn.linear_attention(*bench.inputs, feature_map=arg, return_state=True)
    assert S.shape == (1, D, 64) and z.shape == (1, D)
    # The reference forms the features of q and k (n x D each) and the output: the probe
    # sees at least one feature array (a probe that saw nothing, or the map's features
    # not formed, fails here).
    n = int(common.FEATURE_N[0])
    assert bench.track_peak_bytes(first, "reference", None, False, "float32") >= n * D * 4


def test_feature_map_benchmark_skips_what_cannot_or_should_not_run(monkeypatch):
    # The masked n x n reference at n^2 D beyond its bound (taylor, n = 4096).
    with pytest.raises(NotImplementedError, match="masked n x n"):
        _feature_bench(monkeypatch, feature_maps.FeatureMaps, "taylor", True, common.FEATURE_N[1])
    monkeypatch.setattr(common, "QUICK", True)
    with pytest.raises(NotImplementedError, match="QUICK"):
        feature_maps.FeatureMaps().setup("elu", "reference", common.FEATURE_N[1], False, "float32")
    with pytest.raises(NotImplementedError, match="QUICK"):
        feature_maps.Favor().setup(common.FAVOR_M[1], "reference", common.FEATURE_N[0], False,
                                   "float32")
    # A commit from before FAVOR+ and the Taylor map (issue 13).
    monkeypatch.delattr(fastattn, "FavorFeatures")
    with pytest.raises(NotImplementedError, match="no fastattn.FavorFeatures"):
        _feature_bench(monkeypatch, feature_maps.Favor, common.FAVOR_M[0])
    monkeypatch.setattr(fastattn.feature_maps, "NAMES", ("elu", "relu"))
    for name in ("taylor", "favor"):
        with pytest.raises(NotImplementedError, match=f"no feature map '{name}'"):
            _feature_bench(monkeypatch, feature_maps.FeatureMaps, name)


# --- the quick run: what it leaves out costs nothing but its process -----------------
def _classes():
    from benchmarks import linear, softmax, threads
    return [softmax.SoftmaxAttention, softmax.SoftmaxAccuracy, linear.LinearAttention,
            linear.LinearAccuracy, decode.Decode, feature_maps.FeatureMaps, feature_maps.Favor,
            threads.Threads, threads.Versions]


def test_quick_run_skips_first_thing_in_setup_before_any_work(monkeypatch):
    import itertools

    monkeypatch.setattr(common, "QUICK", True)

    class Worked(Exception):
        pass

    def work(*args, **kwargs):
        raise Worked()

    # What a setup does past its skips: inputs, the kernels, FAVOR+'s features, the
    # backends and the memory check; none may run for a combination the quick run leaves out.
    for owner, name in [(fastattn, "softmax_attention"), (fastattn, "linear_attention"),
                        (fastattn, "FavorFeatures"), (fastattn, "available_backends"),
                        (common, "qkv"), (common.engine, "make_inputs"),
                        (common.engine, "why_skip")]:
        monkeypatch.setattr(owner, name, work)
    ran, total = [], 0
    for cls in _classes():
        if cls.__module__.endswith("threads"):
            continue   # one process per component or library: nothing to leave out
        for params in itertools.product(*cls.params):
            total += 1
            try:
                cls().setup(*params)
            except NotImplementedError as exc:
                assert "FASTATTN_ASV_QUICK" in str(exc), (cls, params, exc)
            except Worked:
                ran.append((cls.__name__,) + tuple(map(repr, params)))
            else:
                pytest.fail(f"{cls.__name__}{params} neither skipped nor worked")
    # Left in: the smallest n, float32, each backend and causal (FAVOR+ its smallest m;
    # the accuracy benchmarks their one n), every feature map.
    per_class = {}
    for row in ran:
        per_class[row[0]] = per_class.get(row[0], 0) + 1
    assert per_class == {"SoftmaxAttention": 6, "SoftmaxAccuracy": 6, "LinearAttention": 6,
                         "LinearAccuracy": 6, "Decode": 6,
                         "FeatureMaps": 6 * len(common.FEATURE_MAPS), "Favor": 6}, per_class
    assert all("float32" in row[-1] for row in ran)
    assert len(ran) <= total // 5, (len(ran), total)


# --- the docs: every asv command says how long it takes; continuous compares two commits --
def _asv_command_lines():
    """``(file, line)`` of each shell line in a code block of docs/asv.md or the README that
    runs asv (``asv ...``, ``VAR=1 asv ...``, ``... && asv ...``)."""
    found = []
    for name in ("docs/asv.md", "README.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                command = line.split("#", 1)[0]
                if re.search(r"(^|&&|\s)(\w+=\S+\s+)*asv\s+[a-z]", command):
                    found.append((name, line))
    return found


def test_every_asv_command_in_the_docs_states_its_duration():
    lines = _asv_command_lines()
    assert len(lines) >= 10, lines
    duration = re.compile(r"\d(\.\d+)?\s*(ms|s|min)\b|until Ctrl-C|~\d+ min")
    missing = [f"{name}: {line}" for name, line in lines
               if "#" not in line or not duration.search(line.split("#", 1)[1])]
    assert not missing, "asv commands without a duration:\n" + "\n".join(missing)


def test_asv_continuous_in_the_docs_compares_two_different_commits():
    # In a fresh clone main is HEAD: `asv continuous main HEAD` compares a commit with itself.
    continuous = [line for _, line in _asv_command_lines() if "asv continuous" in line]
    assert continuous
    for line in continuous:
        base, head = line.split("#", 1)[0].split()[-2:]
        assert {base, head} != {"main", "HEAD"} and base != head, line


def test_asv_conf_installs_what_the_suites_checks_import():
    # fastattn.bench.engine's memory and accuracy checks import psutil, which is not a core
    # dependency of fastattn: without it in asv's environments every benchmark fails.
    conf = json.loads(_strip_json_comments((ROOT / "asv.conf.json").read_text()))
    assert any("psutil" in command.split() for command in conf["install_command"])
