"""``fastattn bench --startup``: first-call times from new processes, as records the readers accept."""

import pytest

from fastattn.bench import startup
from fastattn.bench.results import read_records
from fastattn.cli import main
from fastattn.report.analysis import split_records


def test_startup_records_are_written_read_back_and_passed_over_by_the_report(tmp_path, capsys):
    out = tmp_path / "startup.jsonl"
    # Through the command line, as a user runs it (--threads takes several counts).
    assert main(["bench", "--startup", "--backends", "reference", "auto", "--threads", "1", "2",
                 "--repeats", "2", "--out", str(out)]) == 0
    records = read_records(out)
    assert [r["record"] for r in records] == ["startup"] * 4
    assert [(r["backend"], r["threads"]) for r in records] == [
        ("reference", 1), ("auto", 1), ("reference", 2), ("auto", 2)]
    for r in records:
        assert r["repeats"] == 2 and len(r["times_s"]) == 2
        assert 0 < r["min_s"] <= r["median_s"] <= max(r["times_s"])
        assert 0 < r["numpy_min_s"] <= r["numpy_median_s"]
    table = capsys.readouterr().out
    assert "import numpy" in table and "reference: beyond import numpy" in table
    # The report reads point records only: startup records are neither points nor roofs.
    assert split_records(records) == ([], [], [])


def test_startup_refuses_a_name_that_is_not_a_fastattn_backend(tmp_path, capsys):
    code = main(["bench", "--startup", "--backends", "torch", "--out", str(tmp_path / "s.jsonl")])
    assert code == 2
    assert "--startup times fastattn backends, got 'torch'" in capsys.readouterr().err
    assert not (tmp_path / "s.jsonl").exists()


def test_a_failing_child_is_reported_with_its_error(monkeypatch):
    monkeypatch.setattr(startup, "CHILD", "import sys; sys.exit('boom')")
    with pytest.raises(startup.StartupError, match="boom"):
        startup.measure_startup(["reference"], 1, 1)
