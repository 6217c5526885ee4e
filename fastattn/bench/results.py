"""The one results format: JSON lines, one record a line, each checked on reading.

Every measurement (``fastattn bench``, ``fastattn report``) appends records to
a ``.jsonl`` file as each finishes, so an interrupted run keeps what it
measured; reports only ever read these files.  Each line is a JSON object with
``"schema": SCHEMA`` and a ``"record"`` type:

``"environment"``
    Written first by each run: CPU, cores, threads, BLAS, library versions
    (:func:`fastattn.bench.environment.collect`).
``"roof"``
    One throughput probe of the run: ``probe`` (``"gemm"`` with ``shape``
    ``[n, d, n]`` and ``gflops``, or ``"exp"`` with ``size`` and ``gelem_s``),
    ``dtype``, ``threads``, ``repeats``, ``load_avg_1m``.
``"point"``
    One measured call: its identity (:data:`POINT_KEYS`; ``regime`` is
    ``"prefill"`` where a file does not say) and its outcome: ``status``,
    ``reason``, ``times_s`` (seconds per call, one per repeat), ``median_s``,
    ``min_s``, ``max_s``, ``flops``, ``gflops``, ``peak_bytes``,
    ``max_abs_err`` and the rest of :data:`FIELD_TYPES`.

Every record a run writes carries that run's ``run_id``.  :func:`read_records`
checks every field it knows (:data:`FIELD_TYPES`) and refuses a bad record
with its file and line; unknown fields are kept as they are.
"""

import json
import math
import os
import tempfile
from pathlib import Path

SCHEMA = "fastattn.results/1"
RECORD_TYPES = ("environment", "roof", "point")
STATUSES = ("ok", "skipped", "error")

#: Keys that identify a point: two records with equal values measure the same thing.
POINT_KEYS = (
    "attention", "backend", "regime", "causal", "dtype", "batch", "heads",
    "n_q", "n_k", "d_k", "d_v", "feature_map", "num_features", "threads",
)

#: The regime of a point record that does not say (files written before regimes).
DEFAULT_REGIME = "prefill"

_COUNT = "a positive int"
_NUMBER = "a number"
#: What each known field of a point or roof record must hold (None is allowed
#: for optional fields: those not in :data:`REQUIRED`).
FIELD_TYPES = {
    "attention": "a name", "backend": "a name", "regime": "a name", "dtype": "a name",
    "causal": "true or false", "peer": "true or false", "check_ok": "true or false",
    "batch": _COUNT, "heads": _COUNT, "n_q": _COUNT, "n_k": _COUNT, "d_k": _COUNT,
    "d_v": _COUNT, "threads": _COUNT, "num_features": _COUNT, "number": _COUNT,
    "repeats": _COUNT, "check_n": _COUNT,
    "feature_map": "a name", "status": "one of " + ", ".join(STATUSES),
    "median_s": _NUMBER, "min_s": _NUMBER, "max_s": _NUMBER, "flops": _NUMBER,
    "gflops": _NUMBER, "roof_gflops": _NUMBER, "roof_fraction": _NUMBER,
    "peak_bytes": _NUMBER, "peak_bytes_tracemalloc": _NUMBER, "max_abs_err": _NUMBER, "check_tol": _NUMBER,
    "load_avg_1m": _NUMBER, "gelem_s": _NUMBER, "started": _NUMBER, "warmup_s": _NUMBER,
    "times_s": "a list of numbers", "shape": "a list of positive ints",
}
REQUIRED = {
    "point": ("attention", "backend", "causal", "dtype", "batch", "heads", "n_q", "n_k",
              "d_k", "d_v", "threads", "status"),
    "roof": ("dtype",),
    "environment": (),
}
#: Fields a point with status "ok" must hold.
REQUIRED_OK = ("median_s",)


class ResultsFileError(ValueError):
    """A results file that is not fastattn's, is corrupt, or cannot be written; never overwritten."""


def point_key(record):
    """The identity of a point record: its :data:`POINT_KEYS` values (``regime`` defaulted)."""
    return tuple(record.get(k, DEFAULT_REGIME if k == "regime" else None) for k in POINT_KEYS)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _holds(kind, value):
    if kind == _COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == _NUMBER:
        return _is_number(value)
    if kind == "true or false":
        return isinstance(value, bool)
    if kind == "a name":
        return isinstance(value, str) and bool(value)
    if kind.startswith("one of"):
        return value in STATUSES
    if kind == "a list of numbers":
        return isinstance(value, list) and all(_is_number(v) for v in value)
    return isinstance(value, list) and all(_holds(_COUNT, v) for v in value)


def check_record(record):
    """The first problem of a record, as a sentence, or None when it is sound.

    Parameters
    ----------
    record : object
        One parsed line.

    Returns
    -------
    str or None
    """
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
        if value is not None and not _holds(kind_of, value):
            return f"has {name} = {value!r}; expected {kind_of}"
    return None


def read_records(path):
    """All records of a results file, in order, each checked by :func:`check_record`.

    Parameters
    ----------
    path : str or Path

    Returns
    -------
    list of dict

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ResultsFileError
        If a line is not JSON or not a sound fastattn record; the message
        gives ``file:line``.  A last line cut short by an interrupted write
        (no newline) is ignored rather than refused.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}")
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
            raise ResultsFileError(f"{path}:{number} {what} (not JSON: {exc.msg})") from None
        problem = check_record(record)
        if problem:
            raise ResultsFileError(f"{path}:{number} {problem}")
        records.append(record)
    return records


def _json_default(value):
    # NumPy scalars and arrays that slip into a record.
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _clean(value.item())
    if hasattr(value, "tolist"):
        return _clean(value.tolist())
    raise TypeError(f"cannot store {type(value).__name__} in a results record")


def _clean(value):
    """Replace NaN and inf (not valid JSON) by None, recursively."""
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
    """Raise ResultsFileError if an existing ``path`` cannot be written (read-only, not a file)."""
    path = Path(path)
    if path.is_dir():
        raise ResultsFileError(f"{path} is a directory; give a file name, e.g. {path / 'out'}")
    if path.exists() and not (os.access(path, os.W_OK) and path.stat().st_mode & 0o222):
        raise ResultsFileError(f"{path} is read-only; not changing this {what} (make it "
                               "writable, or choose another path)")


def atomic_write(path, data):
    """Replace ``path`` by ``data`` (str or bytes) in one step, keeping its mode and symlinks.

    The data go to a temporary file of a unique name in the same folder,
    which is fsynced and then renamed over the target: a crash leaves either
    the old file or the new one, and no file of ours behind.  A symlink is
    followed (its target is replaced, the link stays); an existing file keeps
    its permission bits.

    Raises
    ------
    ResultsFileError
        If ``path`` exists and is read-only.
    OSError
        If the write fails (the target is then unchanged).
    """
    target = Path(os.path.realpath(path))
    check_writable(target)
    mode = target.stat().st_mode & 0o7777 if target.exists() else None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(path)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ResultsWriter:
    """Append records to a results file, one line each, flushed and fsynced as written.

    Opening an existing file first reads it whole (:func:`read_records`), so
    a foreign, corrupt or read-only file is refused before anything is written
    to it.  A write is one ``write`` of one complete line; a crash can at worst
    leave a partial last line, which is cut off (atomically) on the next open.

    Parameters
    ----------
    path : str or Path
        Created (with its folder) if missing; a symlink is written through.
    resume : bool, default True
        Keep existing records (see :attr:`existing`); with False an existing
        results file is replaced atomically by an empty one.

    Raises
    ------
    ResultsFileError
        If ``path`` exists and is not a fastattn results file, or is read-only.
    """

    def __init__(self, path, resume=True):
        self.path = Path(path)
        exists = self.path.exists()
        self.existing = read_records(self.path) if exists else []
        check_writable(self.path, "results file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if exists and not resume:
            atomic_write(self.path, b"")
            self.existing = []
        elif exists:
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                # A last record whole but for its newline was read: keep it.
                whole = bool(self.existing) and data.rstrip().endswith(b"}") and \
                    _parses(data[data.rfind(b"\n") + 1:])
                atomic_write(self.path, data + b"\n" if whole else
                             data[: data.rfind(b"\n") + 1])

    def done_keys(self):
        """Keys (:func:`point_key`) of the points already measured with status ok or skipped."""
        return {point_key(r) for r in self.existing
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


def _parses(data):
    try:
        json.loads(data)
    except ValueError:
        return False
    return True
