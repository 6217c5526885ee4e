"""Units, text tables, CSV and the JSON summary of point records: fastattn's only formatting."""

import csv
import io
import math

from .results import atomic_write, check_replaceable, to_json

#: Columns of the CSV written beside a results file, in order.
CSV_COLUMNS = (
    "attention", "backend", "peer", "causal", "dtype", "batch", "heads", "n_q", "n_k",
    "d_k", "d_v", "feature_map", "threads", "status", "reason", "median_s", "min_s",
    "max_s", "repeats", "number", "flops", "gflops", "roof_gflops", "roof_fraction",
    "peak_bytes", "memory_method", "peak_bytes_tracemalloc", "max_abs_err", "check_n",
    "check_ok", "run_id", "regime", "num_features", "held_bytes",
)
#: Schema tag of the JSON summary ``fastattn bench`` writes beside its results.
SUMMARY_SCHEMA = "fastattn.bench-summary/1"

#: Fields that make one table: points that differ only in n and backend.
CONFIG_KEYS = ("attention", "regime", "causal", "dtype", "d_k", "d_v", "batch", "heads",
               "feature_map", "num_features", "threads")

MISSING = "–"


def _missing(value):
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def format_seconds(seconds):
    """Seconds to ``"812 µs"``, ``"12.3 ms"``, ``"1.41 s"``; ``"–"`` for missing."""
    if _missing(seconds):
        return MISSING
    unit, factor = next((u, f) for u, f in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6),
                                            ("ns", 0.0)) if seconds >= f)
    return f"{seconds / (factor or 1e-9):.3g} {unit}"


def format_bytes(nbytes):
    """Bytes to ``"72 MiB"``, ``"1.5 GiB"``; ``"–"`` for missing."""
    if _missing(nbytes):
        return MISSING
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            value = nbytes / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{nbytes:.0f} B"


def format_percent(fraction):
    """A fraction to ``"43%"``, ``"0.11%"``; ``""`` for missing."""
    if _missing(fraction):
        return ""
    return f"{100 * fraction:.0f}%" if fraction >= 0.095 else f"{100 * fraction:.2g}%"


def format_number(value, digits=3):
    """A float to ``digits`` significant places; ``"–"`` for missing."""
    return MISSING if _missing(value) else f"{value:.{digits}g}"


def mask_name(causal):
    """``"causal"`` or ``"non-causal"``: the one word for a mask in every table and figure."""
    return "causal" if causal else "non-causal"


def config_title(record):
    """Heading of the table a record belongs to."""
    dims = (f"d={record['d_k']}" if record["d_k"] == record["d_v"]
            else f"d_k={record['d_k']} d_v={record['d_v']}")
    fmap = f", feature map {record['feature_map']}" if record.get("feature_map") else ""
    fmap += f" (m = {record['num_features']})" if record.get("num_features") else ""
    regime = ", decode: one token after n keys" if record.get("regime") == "decode" else ""
    threads = record["threads"]
    return (f"{record['attention']} attention{regime}, {mask_name(record['causal'])}, "
            f"{record['dtype']}, {dims}, batch {record['batch']} x heads {record['heads']}"
            f"{fmap}, {threads} thread{'s' if threads != 1 else ''}")


def summarise(records, baseline=None, backend_order=()):
    """The tables of :func:`format_tables` as data: ``schema``, ``baseline`` and
    ``configurations``, each ``{"title", "config", "rows"}``, a row per point with ``n``,
    ``vs_baseline`` (baseline median / median) and the point's outcome fields."""
    configurations, groups = [], {}
    for record in records:
        groups.setdefault(tuple(record.get(k) for k in CONFIG_KEYS), []).append(record)
    for group in groups.values():
        order = list(backend_order) + [r["backend"] for r in group]
        group = sorted(group, key=lambda r: (r["n_k"], order.index(r["backend"])))
        base = {r["n_k"]: r.get("median_s") for r in group
                if r["backend"] == baseline and r.get("status") == "ok"}
        rows = [{"n": r["n_k"], "vs_baseline": base[r["n_k"]] / r["median_s"]
                 if base.get(r["n_k"]) and r.get("median_s") else None,
                 **{k: r.get(k) for k in ("backend", "status", "reason", "median_s", "min_s",
                                          "max_s", "gflops", "roof_fraction", "peak_bytes",
                                          "max_abs_err", "check_n", "check_ok")}}
                for r in group]
        configurations.append({"title": config_title(group[0]), "rows": rows,
                               "config": {k: group[0].get(k) for k in CONFIG_KEYS}})
    return {"schema": SUMMARY_SCHEMA, "baseline": baseline, "configurations": configurations}


def _cells(row):
    if row["status"] != "ok":
        return [str(row["n"]), row["backend"], f"{row['status']}: {row['reason'] or ''}"]
    err = MISSING if row["max_abs_err"] is None else f"{row['max_abs_err']:.1e}"
    if row["check_n"] and row["check_n"] != row["n"]:
        err += f" (n={row['check_n']})"
    if row["check_ok"] is False:
        err += " MISMATCH"
    return [str(row["n"]), row["backend"],
            f"{format_seconds(row['median_s'])} ({format_seconds(row['min_s'])}-"
            f"{format_seconds(row['max_s'])})", format_number(row["gflops"]),
            format_percent(row["roof_fraction"]) or MISSING, format_bytes(row["peak_bytes"]),
            MISSING if row["vs_baseline"] is None else f"{row['vs_baseline']:.2f}x", err]


def format_tables(records, baseline=None, backend_order=()):
    """One text table per configuration, every backend at every n (in ``backend_order``),
    with the ratio ``baseline time / time`` (above 1: faster than ``baseline``)."""
    ratio_title = f"vs {baseline}" if baseline else "ratio"
    header = ["n", "backend", "median (min-max)", "GFLOP/s", "% roof", "peak extra",
              ratio_title, "max err"]
    out = []
    for config in summarise(records, baseline, backend_order)["configurations"]:
        rows = [_cells(row) for row in config["rows"]]
        widths = [max([len(header[i])] + [len(r[i]) for r in rows if len(r) > 3 or i < 2])
                  for i in range(len(header))]

        def line(cells):
            if len(cells) == 3:  # skipped or error: the reason spans the row
                return f"{cells[0].rjust(widths[0])}  {cells[1].ljust(widths[1])}  {cells[2]}"
            return "  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths)))

        out.append("\n".join([config["title"], line(header), "  ".join("-" * w for w in widths)]
                             + [line(r) for r in rows]))
    if baseline:
        out.append(f"{ratio_title}: {baseline}'s median time / this median time "
                   "(above 1 is faster than the baseline).")
    return "\n\n".join(out)


def check_target(path, kind):
    """Refuse (ResultsFileError) to replace a ``kind`` ("csv" or "summary") file this module
    did not write, or a read-only one."""
    if kind == "csv":
        check_replaceable(path, "results CSV", ",".join(CSV_COLUMNS[:31]), empty_ok=True)
    else:
        check_replaceable(path, "bench summary", f'"schema": "{SUMMARY_SCHEMA}"')


def write_csv(records, path):
    """Write point records as CSV (:data:`CSV_COLUMNS`), atomically; refuse a foreign file."""
    check_target(path, "csv")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: r.get(k) for k in CSV_COLUMNS} for r in records)
    return atomic_write(path, buffer.getvalue())


def write_summary(records, path, baseline=None, backend_order=()):
    """Write :func:`summarise` as JSON, atomically; refuse a foreign file."""
    check_target(path, "summary")
    summary = summarise(records, baseline, backend_order)
    return atomic_write(path, to_json(summary, indent=1, sort_keys=True) + "\n")
