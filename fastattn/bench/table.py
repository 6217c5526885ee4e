"""Plain-text tables and CSV export of point records."""

import csv
import io
import os
from pathlib import Path

#: Columns of the CSV written beside a results file, in order.
CSV_COLUMNS = (
    "attention", "backend", "peer", "causal", "dtype", "batch", "heads", "n_q", "n_k",
    "d_k", "d_v", "feature_map", "threads", "status", "reason", "median_s", "min_s",
    "max_s", "repeats", "number", "flops", "gflops", "roof_gflops", "roof_fraction",
    "peak_bytes", "memory_method", "peak_bytes_tracemalloc", "max_abs_err", "check_n",
    "check_ok", "run_id",
)

#: Fields that make one table: points that differ only in n and backend.
CONFIG_KEYS = ("attention", "causal", "dtype", "d_k", "d_v", "batch", "heads",
               "feature_map", "threads")


def format_seconds(seconds):
    """``0.00123`` -> ``"1.23 ms"``."""
    if seconds is None:
        return "-"
    for unit, factor in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= factor:
            return f"{seconds / factor:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_bytes(nbytes):
    """``3 * 2**20`` -> ``"3.0 MiB"``."""
    if nbytes is None:
        return "-"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f} {unit}"
    return f"{nbytes} B"


def config_title(record):
    """Heading of the table a record belongs to."""
    mask = "causal" if record["causal"] else "not causal"
    if record["d_k"] == record["d_v"]:
        dims = f"d={record['d_k']}"
    else:
        dims = f"d_k={record['d_k']} d_v={record['d_v']}"
    fmap = f", feature map {record['feature_map']}" if record.get("feature_map") else ""
    return (f"{record['attention']} attention, {mask}, {record['dtype']}, {dims}, "
            f"batch {record['batch']} x heads {record['heads']}{fmap}, "
            f"{record['threads']} thread{'s' if record['threads'] != 1 else ''}")


def _group(records):
    groups = {}
    for record in records:
        key = tuple(record.get(k) for k in CONFIG_KEYS)
        groups.setdefault(key, []).append(record)
    return groups


def format_tables(records, baseline=None, backend_order=None):
    """One text table per configuration: every backend at every n, side by side.

    Parameters
    ----------
    records : list of dict
        Point records.
    baseline : str, optional
        Backend the ratio column compares with: ``baseline time / time``,
        so above 1 is faster than the baseline.
    backend_order : list of str, optional
        Row order of backends within one n (default: order of appearance).

    Returns
    -------
    str
    """
    out = []
    for group in _group(records).values():
        order = list(backend_order or [])
        for record in group:
            if record["backend"] not in order:
                order.append(record["backend"])
        group = sorted(group, key=lambda r: (r["n_q"], order.index(r["backend"])))
        base = {r["n_q"]: r.get("median_s") for r in group
                if r["backend"] == baseline and r.get("status") == "ok"}
        ratio_title = f"vs {baseline}" if baseline else "ratio"
        header = ("n", "backend", "median (min-max)", "GFLOP/s", "% roof",
                  "peak extra", ratio_title, "max err")
        rows = []
        for r in group:
            if r.get("status") != "ok":
                status = r.get("status", "?")
                rows.append((str(r["n_q"]), r["backend"], f"{status}: {r.get('reason') or ''}"))
                continue
            timing = (f"{format_seconds(r['median_s'])} "
                      f"({format_seconds(r['min_s'])}-{format_seconds(r['max_s'])})")
            gflops = f"{r['gflops']:.3g}" if r.get("gflops") else "-"
            roof = f"{100 * r['roof_fraction']:.1f}%" if r.get("roof_fraction") else "-"
            ref = base.get(r["n_q"])
            ratio = f"{ref / r['median_s']:.2f}x" if ref and r.get("median_s") else "-"
            if r.get("max_abs_err") is None:
                err = "-"
            else:
                err = f"{r['max_abs_err']:.1e}"
                if r.get("check_n") and r["check_n"] != r["n_q"]:
                    err += f" (n={r['check_n']})"
                if r.get("check_ok") is False:
                    err += " MISMATCH"
            rows.append((str(r["n_q"]), r["backend"], timing, gflops, roof,
                         format_bytes(r.get("peak_bytes")), ratio, err))
        widths = [max(len(header[i]), *(len(row[i]) for row in rows if len(row) > 3 or i < 2))
                  for i in range(len(header))]
        lines = [config_title(group[0]),
                 "  ".join(h.rjust(w) if i != 1 else h.ljust(w)
                           for i, (h, w) in enumerate(zip(header, widths)))]
        lines.append("  ".join("-" * w for w in widths))
        for row in rows:
            if len(row) == 3:  # skipped or error: the reason spans the row
                lines.append(f"{row[0].rjust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}")
                continue
            lines.append("  ".join(c.rjust(w) if i != 1 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))))
        out.append("\n".join(lines))
    if baseline:
        out.append(f"{ratio_title}: {baseline}'s median time / this median time "
                   "(above 1 is faster than the baseline).")
    return "\n\n".join(out)


def _atomic_write_text(path, text):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def check_csv_target(path):
    """Raise ResultsFileError if ``path`` exists and is not a CSV :func:`write_csv` wrote."""
    from .results import ResultsFileError

    path = Path(path)
    if path.exists():
        with open(path, encoding="utf-8", errors="replace") as handle:
            first = handle.readline().strip()
        if first and first != ",".join(CSV_COLUMNS):
            raise ResultsFileError(
                f"{path} exists and is not a fastattn results CSV; not overwriting it"
            )


def check_summary_target(path):
    """Raise ResultsFileError if ``path`` exists and is not a summary :func:`write_summary` wrote."""
    import json

    from .results import ResultsFileError

    path = Path(path)
    if path.exists():
        try:
            ours = json.loads(path.read_text(encoding="utf-8")).get("schema") == SUMMARY_SCHEMA
        except (ValueError, AttributeError):
            ours = False
        if not ours:
            raise ResultsFileError(
                f"{path} exists and is not a fastattn bench summary; not overwriting it"
            )


def write_csv(records, path):
    """Write point records as CSV (:data:`CSV_COLUMNS`), atomically.

    Raises
    ------
    ResultsFileError
        If ``path`` exists and is not a CSV this module wrote (its header
        differs); it is left unchanged.
    """
    path = Path(path)
    check_csv_target(path)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({k: record.get(k) for k in CSV_COLUMNS})
    _atomic_write_text(path, buffer.getvalue())
    return path


#: Schema tag of the JSON summary ``fastattn bench`` writes beside its results.
SUMMARY_SCHEMA = "fastattn.bench-summary/1"


def summarise(records, baseline=None):
    """The tables of :func:`format_tables` as data: one entry per configuration.

    Returns
    -------
    dict
        ``schema``, ``baseline`` and ``configurations``: a list of
        ``{"title", "config": {...}, "rows": [...]}`` where each row has
        ``n``, ``backend``, ``status``, ``reason``, ``median_s``, ``min_s``,
        ``max_s``, ``gflops``, ``roof_fraction``, ``peak_bytes``,
        ``vs_baseline`` (baseline median / median) and ``max_abs_err``,
        ``check_ok``.
    """
    configurations = []
    for group in _group(records).values():
        base = {r["n_q"]: r.get("median_s") for r in group
                if r["backend"] == baseline and r.get("status") == "ok"}
        rows = []
        for r in sorted(group, key=lambda r: r["n_q"]):
            ref = base.get(r["n_q"])
            rows.append({
                "n": r["n_q"], "backend": r["backend"], "status": r.get("status"),
                "reason": r.get("reason"), "median_s": r.get("median_s"),
                "min_s": r.get("min_s"), "max_s": r.get("max_s"), "gflops": r.get("gflops"),
                "roof_fraction": r.get("roof_fraction"), "peak_bytes": r.get("peak_bytes"),
                "vs_baseline": (ref / r["median_s"]) if ref and r.get("median_s") else None,
                "max_abs_err": r.get("max_abs_err"), "check_ok": r.get("check_ok"),
            })
        configurations.append({
            "title": config_title(group[0]),
            "config": {k: group[0].get(k) for k in CONFIG_KEYS},
            "rows": rows,
        })
    return {"schema": SUMMARY_SCHEMA, "baseline": baseline, "configurations": configurations}


def write_summary(records, path, baseline=None):
    """Write :func:`summarise` as JSON, atomically; refuse to replace a foreign file.

    Raises
    ------
    ResultsFileError
        If ``path`` exists and is not a summary this module wrote.
    """
    import json

    from .results import _clean

    path = Path(path)
    check_summary_target(path)
    text = json.dumps(_clean(summarise(records, baseline)), indent=1, sort_keys=True)
    _atomic_write_text(path, text + "\n")
    return path
