"""The one results format: JSON lines of the records of :mod:`.schema`, appended as measured."""

import json
import math
import os
import uuid
from pathlib import Path

from .schema import (AMOUNT, AMOUNTS, COUNT, COUNTS, FIELD_TYPES, FLAG,  # noqa: F401
                     MAX_COUNT, NAME, RECORD_TYPES, REQUIRED, REQUIRED_OK, SCHEMA, STATUS,
                     STATUSES, point_key)


class ResultsFileError(ValueError):
    """A results file that is not fastattn's, is corrupt, or cannot be written."""


class CorruptLineError(ResultsFileError):
    """A line of a fastattn results file, not its last, cut short or overwritten."""


def is_number(value):
    """True for an int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_COUNT


def _is_amount(value):
    try:
        return is_number(value) and math.isfinite(value) and value >= 0
    except OverflowError:  # an int beyond any float (10**400): no amount a machine measures
        return False


_HOLDS = {COUNT: _is_count, AMOUNT: _is_amount, FLAG: lambda v: isinstance(v, bool),
          NAME: lambda v: isinstance(v, str) and bool(v), STATUS: lambda v: v in STATUSES,
          AMOUNTS: lambda v: isinstance(v, list) and all(map(_is_amount, v)),
          COUNTS: lambda v: isinstance(v, list) and all(map(_is_count, v))}


def check_record(record):
    """The first problem of one parsed line, as a sentence, or None when it is sound."""
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        return f'is not a fastattn results record (expected "schema": "{SCHEMA}")'
    kind = record.get("record")
    if kind not in RECORD_TYPES:
        return f"has unknown record type {kind!r}; expected one of {RECORD_TYPES}"
    required = REQUIRED[kind] + (REQUIRED_OK if kind == "point" and
                                 record.get("status") == "ok" else ())
    missing = [name for name in required if record.get(name) is None]
    if missing:
        return f"is a {kind} record without {', '.join(missing)}"
    if kind == "environment":
        return None
    for name, kind_of in FIELD_TYPES.items():
        value = record.get(name)
        if value is not None and not _HOLDS[kind_of](value):
            return f"has {name} = {_shown(value)}; expected {kind_of}"
    given = [(name, record[name]) for name in ("min_s", "median_s", "max_s")
             if record.get(name) is not None]
    for (low, a), (high, b) in zip(given, given[1:]):
        if a > b:
            return f"has {low} = {a!r} above {high} = {b!r}; expected min_s <= median_s <= max_s"
    return None


def _shown(value):
    """``repr`` of a value in a message; a huge int as a power of ten."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 128:
        return f"{'-' if value < 0 else ''}10**{math.log10(abs(value)):.0f} or so"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_records(path):
    """All records of a results file, each checked (a last line cut short ignored)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}" if not path.exists() else
                                f"{path} is not a regular file (a device or a pipe): give the "
                                ".jsonl file that fastattn bench or fastattn report wrote")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and records and not text.endswith("\n"):
                break  # the tail of a write that was interrupted
            what = ("is not a fastattn results file" if not records else
                    "is corrupt: a line of this fastattn results file was cut short or "
                    "overwritten")
            error = CorruptLineError if records else ResultsFileError
            raise error(f"{path}:{number} {what} (not JSON: {exc.msg})") from None
        except ValueError:  # JSON, but an int of more digits than Python converts (4300)
            raise ResultsFileError(f"{path}:{number} holds an integer of thousands of digits; "
                                   "no measurement is that large") from None
        problem = check_record(record)
        if problem:
            raise ResultsFileError(f"{path}:{number} {problem}")
        records.append(record)
    return records


def cut_tail_bytes(path, data=None):
    """Bytes of a last line of ``path`` (or ``data``) cut short by an interrupted write."""
    data = Path(path).read_bytes() if data is None else data
    tail = b"" if data.endswith(b"\n") else data[data.rfind(b"\n") + 1:]
    if not tail.strip():
        return 0   # none, or blank as read_records skips it
    try:
        json.loads(tail)
    except ValueError:
        return len(tail)
    return 0   # a whole record but for its newline: read


def _json_default(value):  # NumPy scalars and arrays that slip into a record
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _clean(value.item())
    if hasattr(value, "tolist"):
        return _clean(value.tolist())
    raise TypeError(f"cannot store {type(value).__name__} in a results record")


def _clean(value):
    """NaN and inf (not valid JSON) as None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def to_json(value, **kwargs):
    """``json.dumps`` of a record or summary: NaN and inf as null, NumPy values as plain JSON."""
    return json.dumps(_clean(value), default=_json_default, **kwargs)


def check_writable(path, what="file"):
    """Raise ResultsFileError if ``path`` cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise ResultsFileError(f"{path} is a directory; give a file name, e.g. {path / 'out'}")
    if path.exists() and not path.is_file():
        raise ResultsFileError(f"{path} is not a regular file (a device, pipe or socket); "
                               "give the path of a file")
    if path.exists() and not (os.access(path, os.W_OK) and path.stat().st_mode & 0o222):
        raise ResultsFileError(f"{path} is read-only; not changing this {what} (make it "
                               "writable, or choose another path)")
    if not path.exists():
        _check_creatable(path, what)


def _check_creatable(path, what):
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ResultsFileError(f"cannot write the {what} {path}: {folder} is a file, not a "
                               "folder")
    probe = folder / f".fastattn-{uuid.uuid4().hex}.probe"
    try:
        probe.open("xb").close()
    except OSError as exc:
        raise ResultsFileError(f"cannot write the {what} {path}: {folder} does not take new "
                               f"files ({exc.strerror or exc})") from None
    probe.unlink(missing_ok=True)


def check_replaceable(path, what, marker, empty_ok=False):
    """Refuse to replace a ``path`` that is read-only or lacks ``marker``."""
    path = Path(path)
    check_writable(path, what)
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else None
    if text is not None and marker not in text and not (empty_ok and not text.strip()):
        raise ResultsFileError(f"{path} exists and is not a fastattn {what}; not overwriting it")


def atomic_write(path, data):
    """Replace ``path`` by ``data`` in one step (a temporary file renamed over it)."""
    target = Path(os.path.realpath(path))
    check_writable(target)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as handle:  # a new file: the umask's mode
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Path(path)


class ResultsWriter:
    """Append records to a results file (refused untouched if unsound), one fsynced line
    each; ``resume`` keeps its records (:attr:`existing`)."""

    def __init__(self, path, resume=True):
        self.path = Path(path)
        check_writable(self.path, "results file")
        exists = self.path.exists()
        self.existing = read_records(self.path) if exists else []
        #: Bytes of a last line cut short by an interrupted write, dropped on resuming.
        self.dropped_tail = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if exists and not resume:
            atomic_write(self.path, b"")
            self.existing = []
        elif exists:
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):  # a last record whole but its newline: kept
                self.dropped_tail = cut_tail_bytes(self.path, data)
                atomic_write(self.path, data[:len(data) - self.dropped_tail]
                             if self.dropped_tail else data + b"\n")

    def done(self):
        """The points already measured with status ok or skipped, by :func:`point_key`."""
        return {point_key(r): r for r in self.existing
                if r["record"] == "point" and r.get("status") in ("ok", "skipped")}

    def write(self, record_type, **fields):
        """Append one record and return it (as stored)."""
        if record_type not in RECORD_TYPES:
            raise ValueError(f"record_type must be one of {RECORD_TYPES}, got {record_type!r}")
        line = to_json({"schema": SCHEMA, "record": record_type, **fields}, sort_keys=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return json.loads(line)

