"""The one results format: JSON lines, one record a line.

Every measurement (``fastattn bench``, ``fastattn report``) appends records to
a ``.jsonl`` file as each finishes, so an interrupted run keeps what it
measured; reports only ever read these files.

Each line is a JSON object with ``"schema": SCHEMA`` and a ``"record"`` type:

``"environment"``
    Written first: CPU, cores, threads, BLAS, library versions.
``"roof"``
    A GEMM/exp throughput probe: ``dtype``, ``threads``, ``gflops``
    (GFLOP/s), ``shape`` and anything else the probe reports.
``"point"``
    One measured call.  Keys (see :data:`POINT_KEYS`): ``attention``
    (``"softmax"``/``"linear"``), ``backend`` (fastattn's or a peer's such as
    ``"torch"``), ``peer`` (bool), ``causal``, ``dtype``, ``batch``, ``heads``,
    ``n_q``, ``n_k``, ``d_k``, ``d_v``, ``feature_map`` (None for softmax),
    ``threads``, then the outcome: ``status`` (``"ok"``, ``"skipped"``,
    ``"error"``), ``reason`` (why not ok), ``times_s`` (seconds, each
    repeat), ``median_s``, ``min_s``, ``max_s``, ``flops``, ``gflops``,
    ``peak_bytes`` (peak extra bytes of the call), ``memory_method``,
    ``max_abs_err`` (against the float64 reference, when checked).

Keys added by :func:`fastattn.bench.sweep.run_sweep` (readers may rely on
them when present; older files may lack them):

* every record of a run: ``run_id`` (the same for the environment, roof and
  point records one run wrote);
* environment: the keys of :func:`fastattn.bench.environment.collect`;
* roof: ``probe`` (``"gemm"`` with ``shape`` [n, d, n] and ``gflops``, or
  ``"exp"`` with ``size`` and ``gelem_s``, G elements/s), ``repeats``,
  ``load_avg_1m``;
* point: ``started`` (Unix time), ``seed``, ``load_avg_1m``, ``warmup_s``,
  ``number`` (calls per timed repeat), ``repeats``, ``roof_gflops`` and
  ``roof_fraction`` (``gflops / roof_gflops``), ``peak_bytes_tracemalloc``
  (NumPy reference cross-check), ``check_n`` (n the check ran at),
  ``check_tol`` and ``check_ok`` (False flags a kernel or peer that
  disagrees with the reference), ``traceback`` (status ``"error"``).
"""

import json
import math
import os
from pathlib import Path

SCHEMA = "fastattn.results/1"
RECORD_TYPES = ("environment", "roof", "point")

#: Keys that identify a point: two records with equal values measure the same thing.
POINT_KEYS = (
    "attention", "backend", "causal", "dtype", "batch", "heads",
    "n_q", "n_k", "d_k", "d_v", "feature_map", "threads",
)


class ResultsFileError(ValueError):
    """A results file that is not fastattn's, or is corrupt; it is never overwritten."""


def point_key(record):
    """The identity of a point record: a tuple of its :data:`POINT_KEYS` values."""
    return tuple(record.get(key) for key in POINT_KEYS)


def _json_default(value):
    # NumPy scalars and arrays that slip into a record.
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
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


def read_records(path):
    """All records of a results file, in order.

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
        If a line is not JSON or not a fastattn record (the message gives the
        file and line number).  A last line cut short by an interrupted write
        is ignored rather than refused.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and records:
                break  # the tail of a write that was interrupted
            raise ResultsFileError(
                f"{path}:{number} is not a fastattn results file (not JSON: {exc.msg})"
            ) from None
        if not isinstance(record, dict) or record.get("schema") != SCHEMA:
            raise ResultsFileError(
                f"{path}:{number} is not a fastattn results record "
                f"(expected \"schema\": \"{SCHEMA}\")"
            )
        if record.get("record") not in RECORD_TYPES:
            raise ResultsFileError(
                f"{path}:{number} has unknown record type {record.get('record')!r}; "
                f"expected one of {RECORD_TYPES}"
            )
        records.append(record)
    return records


class ResultsWriter:
    """Append records to a results file, one line each, flushed and fsynced as written.

    Opening an existing file first reads it whole (:func:`read_records`), so
    a foreign or corrupt file is refused before anything is written to it.
    A write is one ``write`` of one complete line; a crash can at worst leave
    a partial last line, which :func:`read_records` ignores.

    Parameters
    ----------
    path : str or Path
        Created (with its folder) if missing.
    resume : bool, default True
        Keep existing records (and report them through :attr:`existing`);
        with False an existing results file is replaced atomically by an
        empty one (it must still be a valid results file).

    Raises
    ------
    ResultsFileError
        If ``path`` exists and is not a fastattn results file.
    """

    def __init__(self, path, resume=True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.existing = read_records(self.path) if self.path.exists() else []
        if not resume and self.path.exists():
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("")
            os.replace(tmp, self.path)
            self.existing = []
        elif self.path.exists() and self.path.stat().st_size:
            self._drop_partial_tail()

    def _drop_partial_tail(self):
        """Cut a last line left half-written by an interrupted run."""
        data = self.path.read_bytes()
        if data.endswith(b"\n"):
            return
        keep = data[: data.rfind(b"\n") + 1]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(keep)
        os.replace(tmp, self.path)

    def done_keys(self):
        """Keys (:func:`point_key`) of the points already measured with status ok or skipped."""
        return {
            point_key(r) for r in self.existing
            if r["record"] == "point" and r.get("status") in ("ok", "skipped")
        }

    def write(self, record_type, **fields):
        """Append one record and return it (as stored)."""
        if record_type not in RECORD_TYPES:
            raise ValueError(f"record_type must be one of {RECORD_TYPES}, got {record_type!r}")
        record = _clean({"schema": SCHEMA, "record": record_type, **fields})
        line = json.dumps(record, default=_json_default, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        return json.loads(line)
