"""CI smoke pass of the asv suite: a broken benchmark fails this test.

Runs, in this (installed, development) environment, ``asv check
--python=same`` and ``asv run --python=same --quick`` over every benchmark
with ``FASTATTN_ASV_QUICK=1`` (one tiny n, float32 only), so it takes seconds.
asv exits 1 when the suite cannot be imported or a benchmark's signature is
wrong (check) and 2 when any benchmark, or any parameter combination of one,
raises (run); a combination skipped in setup (NotImplementedError) is not a
failure.  The run uses a throw-away copy of asv.conf.json whose results, html
and env dirs are in a temporary directory, so the developer's .asv/results
(and its benchmarks.json) are left alone.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("asv", reason="asv is not installed (pip install -e '.[bench]')")

ROOT = Path(__file__).resolve().parents[1]

#: Every benchmark of the suite; each must run ("ok"), not fail or vanish.
EXPECTED = (
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


def _asv(config, *args, timeout):
    env = dict(os.environ, FASTATTN_ASV_QUICK="1", HOME=str(Path(config).parent / "home"))
    proc = subprocess.run(
        [sys.executable, "-m", "asv", "--config", str(config), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_asv_check(asv_config):
    code, out = _asv(asv_config, "check", "--python=same", timeout=120)
    assert code == 0, out
    assert "No problems found" in out, out


def test_asv_quick_run_has_no_failed_benchmark(asv_config):
    code, out = _asv(
        asv_config, "run", "--python=same", "--quick", "--show-stderr",
        "--machine", "ci-smoke", "--launch-method", "forkserver", timeout=240,
    )
    assert code == 0, f"asv run exited {code} (2: a benchmark failed)\n{out}"
    assert not re.search(r"\bfailed\b", out), out
    for name in EXPECTED:
        assert re.search(re.escape(name) + r"\s+ok\b", out), f"{name} did not run ok:\n{out}"
