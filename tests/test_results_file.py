"""The results file (fastattn/bench/results.py): nothing lost, nothing foreign overwritten.

A results file is JSON lines written one whole line at a time.  An
interrupted write can leave only a last line without its newline, which is
dropped (or completed, if it is a whole record); anything else that is not
a fastattn record (a corrupt line, a foreign file) is refused with an error
naming the file and line, and the file is left byte for byte as it was.
"""

import contextlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from fastattn.bench import results
from fastattn.bench.results import SCHEMA, ResultsFileError, ResultsWriter, read_records


def _point(n, status="ok", **extra):
    return dict(attention="softmax", backend="reference", peer=False, causal=False,
                dtype="float32", batch=1, heads=1, n_q=n, n_k=n, d_k=64, d_v=64,
                feature_map=None, threads=1, status=status, median_s=1e-3 * n, **extra)


def _line(record_type, **fields):
    return json.dumps({"schema": SCHEMA, "record": record_type, **fields}, sort_keys=True) + "\n"


@pytest.fixture
def good_file(tmp_path):
    """A results file with an environment, a roof and two points."""
    path = tmp_path / "results.jsonl"
    writer = ResultsWriter(path)
    writer.write("environment", cpu="test cpu", cores=2)
    writer.write("roof", dtype="float32", threads=1, gflops=50.0)
    writer.write("point", **_point(128))
    writer.write("point", **_point(256))
    return path


def _strict_json(line):
    """json.loads refusing NaN/Infinity, which are not JSON."""
    def refuse(token):
        raise ValueError(f"{token} is not valid JSON")
    return json.loads(line, parse_constant=refuse)


# ---------------------------------------------------------------------------
# Writing: whole lines, valid JSON.
# ---------------------------------------------------------------------------

def test_records_round_trip_in_order(good_file):
    records = read_records(good_file)
    assert [r["record"] for r in records] == ["environment", "roof", "point", "point"]
    assert all(r["schema"] == SCHEMA for r in records)
    assert [r["n_q"] for r in records[2:]] == [128, 256]
    assert records[0]["cpu"] == "test cpu" and records[1]["gflops"] == 50.0


def test_each_record_is_one_write_of_one_whole_line(tmp_path, monkeypatch):
    writes = []
    real_open = open

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def write(self, text):
            writes.append(text)
            return self.handle.write(text)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def spy_open(*args, **kwargs):
        return Spy(real_open(*args, **kwargs))

    path = tmp_path / "r.jsonl"
    writer = ResultsWriter(path)
    monkeypatch.setattr(results, "open", spy_open, raising=False)
    for n in (1, 2, 3):
        writer.write("point", **_point(n), note="a\nmultiline\nnote")
    assert len(writes) == 3
    for text in writes:
        assert text.endswith("\n") and text.count("\n") == 1
        _strict_json(text)
    assert path.read_text().count("\n") == 3


def test_write_returns_the_record_as_stored(tmp_path):
    writer = ResultsWriter(tmp_path / "r.jsonl")
    stored = writer.write("point", **_point(8), times_s=(1.0, 2.0))
    assert stored == read_records(tmp_path / "r.jsonl")[0]
    assert stored["times_s"] == [1.0, 2.0]


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, np.float64("nan"), np.float32("nan"), np.float32("inf"),
     np.array([1.0, np.nan]), [1.0, math.inf], {"x": np.float16("nan")}],
    ids=["nan", "inf", "-inf", "np.float64-nan", "np.float32-nan", "np.float32-inf",
         "array-with-nan", "list-with-inf", "dict-with-f16-nan"],
)
def test_non_finite_values_are_stored_as_null(tmp_path, value):
    path = tmp_path / "r.jsonl"
    ResultsWriter(path).write("point", **_point(8), max_abs_err=value)
    line = path.read_text()
    stored = _strict_json(line)["max_abs_err"]
    flat = stored if isinstance(stored, list) else list(stored.values()) if isinstance(stored, dict) else [stored]
    assert None in flat


def test_numpy_values_are_stored_as_plain_json(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsWriter(path).write("point", **_point(8), peak_bytes=np.int64(12),
                              times_s=np.array([0.5, 0.25]), gflops=np.float32(1.5))
    stored = read_records(path)[0]
    assert stored["peak_bytes"] == 12 and stored["times_s"] == [0.5, 0.25] and stored["gflops"] == 1.5


def test_a_record_that_cannot_be_stored_writes_nothing(good_file):
    before = good_file.read_bytes()
    with pytest.raises(TypeError, match="cannot store object"):
        ResultsWriter(good_file).write("point", **_point(512), extra=object())
    assert good_file.read_bytes() == before
    with pytest.raises(ValueError, match="record_type"):
        ResultsWriter(good_file).write("pointless", n=1)
    assert good_file.read_bytes() == before


# ---------------------------------------------------------------------------
# Refusing corrupt and foreign files, without touching them.
# ---------------------------------------------------------------------------

FOREIGN = {
    "text": b"hello world\nthis is my thesis\n",
    "csv": b"n,time\n128,0.1\n",
    "other-schema": b'{"schema": "someone.else/2", "record": "point"}\n',
    "no-schema": b'{"record": "point", "n_q": 4}\n',
    "json-array": b"[1, 2, 3]\n",
    "json-null": b"null\n",
    "unknown-record": _line("measurement", n=1).encode(),
    "binary": bytes(range(256)) * 4,
    "png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00",
    "one-line-no-newline": b"my notes, not results",
    "corrupt-first-line": b"{not json\n" + _line("point", **_point(4)).encode(),
    "corrupt-middle": (_line("environment", cpu="x") + "{broken\n"
                       + _line("point", **_point(4))).encode(),
    "foreign-middle": (_line("environment", cpu="x") + '{"schema": "other/1"}\n'
                       + _line("point", **_point(4))).encode(),
    "garbage-last-line-complete": (_line("environment", cpu="x") + "#### not json ####\n").encode(),
}


@pytest.mark.parametrize("case", FOREIGN)
def test_foreign_or_corrupt_file_is_refused(tmp_path, case):
    path = tmp_path / "results.jsonl"
    path.write_bytes(FOREIGN[case])
    with pytest.raises(ResultsFileError) as info:
        read_records(path)
    message = str(info.value)
    assert str(path) in message
    assert "fastattn" in message or "record type" in message
    assert f"{path}:" in message    # file:line


@pytest.mark.parametrize("resume", [True, False], ids=["resume", "fresh"])
@pytest.mark.parametrize("case", FOREIGN)
def test_foreign_or_corrupt_file_is_never_overwritten(tmp_path, case, resume):
    path = tmp_path / "results.jsonl"
    path.write_bytes(FOREIGN[case])
    stat = os.stat(path)
    with pytest.raises(ResultsFileError):
        ResultsWriter(path, resume=resume)
    assert path.read_bytes() == FOREIGN[case]
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"], "a temporary file was left"


def test_error_gives_the_line_number(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(FOREIGN["corrupt-middle"])
    with pytest.raises(ResultsFileError, match=r"results\.jsonl:2 "):
        read_records(path)


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results file"):
        read_records(tmp_path / "absent.jsonl")
    assert not (tmp_path / "absent.jsonl").exists()


def test_missing_or_empty_file_starts_fresh(tmp_path):
    path = tmp_path / "sub" / "dir" / "results.jsonl"
    writer = ResultsWriter(path)
    assert writer.existing == [] and writer.done() == {}
    writer.write("point", **_point(4))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert ResultsWriter(empty).existing == []
    assert len(read_records(path)) == 1


# ---------------------------------------------------------------------------
# Interrupted writes: nothing finished is lost.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [1, 10, 40, -2], ids=lambda c: f"cut{c}")
def test_partial_last_line_is_dropped_and_the_rest_kept(good_file, cut):
    whole = _line("point", **_point(512))
    with open(good_file, "a") as handle:
        handle.write(whole[:cut])        # the write was interrupted: no newline
    assert [r.get("n_q") for r in read_records(good_file)] == [None, None, 128, 256]
    writer = ResultsWriter(good_file)
    assert len(writer.existing) == 4
    writer.write("point", **_point(512))
    records = read_records(good_file)
    assert [r.get("n_q") for r in records] == [None, None, 128, 256, 512]
    assert good_file.read_text().endswith("}\n")
    assert sorted(p.name for p in good_file.parent.iterdir()) == [good_file.name]


def test_last_record_missing_only_its_newline_is_kept(good_file):
    """The write stopped just before the newline: the record is whole and was read."""
    with open(good_file, "a") as handle:
        handle.write(_line("point", **_point(512)).rstrip("\n"))
    assert [r.get("n_q") for r in read_records(good_file)][-1] == 512
    writer = ResultsWriter(good_file)
    assert results.point_key(_point(512)) in writer.done()
    writer.write("point", **_point(1024))
    assert [r.get("n_q") for r in read_records(good_file)][-2:] == [512, 1024]


def test_resume_reports_finished_points(good_file):
    ResultsWriter(good_file).write("point", **_point(512, status="error", reason="boom"))
    ResultsWriter(good_file).write("point", **_point(1024, status="skipped", reason="memory"))
    keys = set(ResultsWriter(good_file).done())
    assert {key[7] for key in keys} == {128, 256, 1024}      # n_q; the error is retried


def test_fresh_start_replaces_a_results_file_atomically(good_file, monkeypatch):
    before = good_file.read_bytes()

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        ResultsWriter(good_file, resume=False)
    assert good_file.read_bytes() == before       # the crash left the old file whole
    monkeypatch.undo()
    writer = ResultsWriter(good_file, resume=False)
    assert writer.existing == [] and read_records(good_file) == []
    assert sorted(p.name for p in good_file.parent.iterdir()) == [good_file.name]


def test_dropping_a_partial_tail_is_atomic(good_file, monkeypatch):
    with open(good_file, "a") as handle:
        handle.write('{"schema": "fastattn.res')
    before = good_file.read_bytes()
    monkeypatch.setattr(results.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        ResultsWriter(good_file)
    assert good_file.read_bytes() == before
    assert len(read_records(good_file)) == 4


# ---------------------------------------------------------------------------
# The user's files: never deleted, never re-moded, symlinks kept.
# ---------------------------------------------------------------------------

def test_atomic_rewrites_leave_the_users_tmp_file_alone(good_file):
    mine = good_file.with_name(good_file.name + ".tmp")
    mine.write_text("my own notes")
    with open(good_file, "a") as handle:
        handle.write('{"schema": "fastattn.res')     # a partial tail to cut
    ResultsWriter(good_file)
    ResultsWriter(good_file, resume=False)
    assert mine.read_text() == "my own notes"
    assert sorted(p.name for p in good_file.parent.iterdir()) == sorted([good_file.name, mine.name])


def test_a_symlinked_results_file_is_written_through_and_keeps_its_mode(good_file):
    good_file.chmod(0o640)
    link = good_file.with_name("link.jsonl")
    link.symlink_to(good_file)
    with open(good_file, "a") as handle:
        handle.write('{"schema": "fastattn.res')
    writer = ResultsWriter(link)
    writer.write("point", **_point(512))
    ResultsWriter(link, resume=False).write("point", **_point(1024))
    assert link.is_symlink()
    assert [r["n_q"] for r in read_records(good_file)] == [1024]
    assert good_file.stat().st_mode & 0o777 == 0o640


def test_a_read_only_results_file_is_refused_unchanged(good_file):
    good_file.chmod(0o444)
    before = os.stat(good_file)
    data = good_file.read_bytes()
    for resume in (True, False):
        with pytest.raises(ResultsFileError, match="read-only"):
            ResultsWriter(good_file, resume=resume)
    after = os.stat(good_file)
    assert (after.st_mode, after.st_ino, good_file.read_bytes()) == \
        (before.st_mode, before.st_ino, data)


@pytest.mark.parametrize("record,message", [
    ({"record": "point"}, "without attention"),
    ({"record": "point", **_point(4), "n_q": "big"}, "n_q = 'big'"),
    ({"record": "point", **_point(4), "median_s": "fast"}, "median_s = 'fast'"),
    ({"record": "point", **_point(4), "status": "great"}, "status = 'great'"),
    ({"record": "roof", "dtype": "float32", "gflops": "lots"}, "gflops = 'lots'"),
    ({"record": "point", **_point(4), "times_s": [1, "x"]}, "times_s"),
    ({"record": "point", **_point(4), "median_s": -1.0}, "median_s = -1.0"),
    ({"record": "point", **_point(4), "median_s": float("nan")}, "median_s = nan"),
    ({"record": "point", **_point(4), "peak_bytes": float("inf")}, "peak_bytes = inf"),
    ({"record": "point", **_point(4), "times_s": [1e-3, -1e-3]}, "times_s"),
    ({"record": "point", **_point(4), "median_s": 1e308, "max_s": 2e-3},
     r"median_s = 1e\+308 above max_s = 0.002; expected min_s <= median_s <= max_s"),
    ({"record": "point", **_point(4), "min_s": 2.0, "median_s": 1.0},
     "min_s = 2.0 above median_s = 1.0"),
], ids=["no-fields", "n_q-text", "median-text", "bad-status", "roof-gflops", "times-text",
        "median-negative", "median-nan", "peak-inf", "times-negative", "median-above-max",
        "min-above-median"])
def test_every_record_is_checked_on_reading(tmp_path, record, message):
    path = tmp_path / "r.jsonl"
    path.write_text(_line("environment", cpu="x") + json.dumps({"schema": SCHEMA, **record})
                    + "\n")
    with pytest.raises(ResultsFileError, match=f"r.jsonl:2 .*{message}"):
        read_records(path)


# Issue 33 item 14: n_q = n_k = 10**30 passed the check and crashed the report (OverflowError
# in its int64 arrays of n); ints beyond a float or beyond Python's 4300 digits crashed the check.
@pytest.mark.parametrize("field, value, message", [
    ("n_q", 10**30, r"n_q = 1000000000000000000000000000000; expected a positive int <= 2\*\*53"),
    ("n_k", 2**53 + 1, r"n_k = 9007199254740993; expected a positive int <= 2\*\*53"),
    ("heads", 10**400, r"heads = 10\*\*400 or so; expected a positive int <= 2\*\*53"),
    ("peak_bytes", 10**400, r"peak_bytes = 10\*\*400 or so; expected a finite number >= 0"),
    ("median_s", -10**400, r"median_s = -10\*\*400 or so; expected a finite number >= 0"),
    ("roof_shape", [1, 10**30], r"roof_shape = .*; expected a list of positive ints <= 2\*\*53"),
], ids=["n_q-1e30", "n_k-2**53+1", "heads-1e400", "peak-1e400", "median-minus-1e400",
        "roof-shape-1e30"])
def test_huge_ints_are_refused_by_the_check(tmp_path, field, value, message):
    path = tmp_path / "r.jsonl"
    record = {"schema": SCHEMA, "record": "point", **_point(4), field: value}
    if field == "n_q":
        record["n_k"] = value
    path.write_text(_line("environment", cpu="x") + json.dumps(record) + "\n")
    with pytest.raises(ResultsFileError, match=f"r.jsonl:2 has {message}"):
        read_records(path)


def test_the_largest_count_is_read(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(_line("point", **dict(_point(4), n_q=2**53, n_k=2**53)))
    assert read_records(path)[0]["n_q"] == 2**53


def test_an_int_of_thousands_of_digits_is_refused_not_a_traceback(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(_line("environment", cpu="x") + _line("point", **_point(4)).replace(
        '"n_q": 4', '"n_q": 1' + "0" * 5000))
    with pytest.raises(ResultsFileError, match="r.jsonl:2 holds an integer of thousands of digits"):
        read_records(path)


def test_report_from_a_record_with_n_of_10_to_the_30_is_refused_clearly(tmp_path, capsys):
    from fastattn.cli import main
    path = tmp_path / "r.jsonl"
    path.write_text(_line("environment", cpu="x") + "".join(
        _line("point", **_point(n)) for n in (128, 256)) +
        _line("point", **dict(_point(512), n_q=10**30, n_k=10**30)))
    code = main(["report", "--from", str(path), "--out", str(tmp_path / "x.html")])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and "OverflowError" not in err
    assert "r.jsonl:4 has n_q = 1000000000000000000000000000000; expected a positive int" in err
    assert not (tmp_path / "x.html").exists()


# Found by a fresh-user trial: these went out as tracebacks (some after measuring).
@pytest.mark.parametrize("argv, message", [
    (["compare", "--n", "8", "--d", "4", "--seed", "-1"], "--seed: expected a seed from 0 to 2**32 - 1"),
    (["bench", "--n", str(10**20), "--backends", "reference"], "--n: expected a positive integer up to 2**53"),
    (["report", "--n", str(10**20)], "--n: expected a positive integer up to 2**53"),
    (["bench", "--startup", "--backends", "reference", "--repeats", "1", "--out", "{dir}"],
     "is a directory"),
    (["bench", "--n", "8", "--backends", "reference", "--out", "{file}/x.jsonl"],
     "is a file, not a folder"),
    (["bench", "--n", "8", "--backends", "reference", "--out", "/proc/fastattn-x.jsonl"],
     "does not take new files"),
    (["report", "--quick", "--out", "{file}/x.html"], "is a file, not a folder"),
    (["bench", "--n", "8", "--backends", "reference", "--out", "{dir_stem}.jsonl"],
     "writes its csv beside it, at {dir}, which is a directory; give another --out"),
], ids=["compare-negative-seed", "bench-n-beyond-2**53", "report-n-beyond-2**53", "startup-out-dir", "bench-out-under-a-file", "bench-out-in-proc",
        "report-out-under-a-file", "bench-csv-beside-is-a-dir"])
def test_bad_output_paths_and_seeds_are_refused_before_any_work(tmp_path, capsys, argv, message):
    from fastattn.cli import main

    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("mine\n")
    if "{dir_stem}" in argv[-1]:   # the folder is where the results' csv goes
        (tmp_path / "adir").rename(tmp_path / "adir.csv")
    folder = tmp_path / ("adir.csv" if "{dir_stem}" in argv[-1] else "adir")
    fields = dict(dir=folder, file=tmp_path / "afile", dir_stem=tmp_path / "adir")
    argv = [a.format(**fields) for a in argv]
    message = message.format(**fields)
    if argv[-1].startswith("/proc/") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    usage_error = argv[0] == "compare" or "2**53" in message   # argparse: SystemExit(2)
    with pytest.raises(SystemExit) if usage_error else contextlib.nullcontext():
        assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, "afile"])


DATA = Path(__file__).resolve().parent / "data"


def test_a_results_file_written_before_the_schema_module_loads_and_tables_the_same(tmp_path):
    """``data/results-v1.jsonl`` was written by the bench before its keys moved to
    ``schema.py`` and its tables to tabulate (its roof records have no ``blas_name``): it
    loads, and its tables, roof statements and CSV are those that bench gave
    (``results-v1.txt``, compared word by word, and ``results-v1.csv``, byte for byte but
    for the columns added since, empty for it)."""
    from fastattn.bench import schema, table

    records = read_records(DATA / "results-v1.jsonl")
    assert [r["record"] for r in records][0] == "environment"
    points = [r for r in records if r["record"] == "point"]
    roofs = [r for r in records if r["record"] == "roof"]
    assert len({results.point_key(p) for p in points}) == len(points) == 36
    text = "\n\n".join([table.format_tables(points, "reference", ["reference", "cython"]),
                        "\n".join(table.roof_statements(roofs))]) + "\n"

    def words(text):
        return [line.split() for line in text.splitlines() if line.strip("- ")]

    assert words(text) == words((DATA / "results-v1.txt").read_text())
    old = (DATA / "results-v1.csv").read_text().splitlines()
    added = len(schema.CSV_COLUMNS) - len(old[0].split(","))
    new = table.write_csv(points, tmp_path / "x.csv").read_text().splitlines()
    assert new[0] == ",".join([old[0]] + list(schema.CSV_COLUMNS[-added:]))
    assert new[1:] == [line + "," * added for line in old[1:]]
    gemm = next(r for r in roofs if r["probe"] == "gemm")
    assert "blas_name" not in gemm
    assert schema.roof_library(gemm) == (gemm["blas"].split()[0], "NumPy")
    assert schema.roof_library({"blas": "MKL 2024.2 through torch 2.13.0", "blas_name": "MKL",
                                "library": "torch"}) == ("MKL", "torch")
