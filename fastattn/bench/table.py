"""Units, text and Markdown tables (by tabulate), CSV and the JSON summary of point records:
fastattn's only formatting."""

import csv
import io
import math
import re
import statistics

from .results import atomic_write, check_replaceable, to_json
from .schema import CONFIG_KEYS, CSV_COLUMNS, SUMMARY_FIELDS, VERSUS_KEYS

#: Schema tag of the JSON summary beside a results file.
SUMMARY_SCHEMA = "fastattn.bench-summary/1"
#: Marker on the first line of the Markdown versus table.
VERSUS_MARKER = "<!-- fastattn bench: best fastattn / best peer -->"
#: The files written beside a results file: suffix, what it is, the marker it holds.
SIDE_FILES = {"csv": (".csv", "results CSV", ",".join(CSV_COLUMNS[:31])),
              "summary": (".summary.json", "bench summary", f'"schema": "{SUMMARY_SCHEMA}"'),
              "markdown": (".md", "best-vs-peer table", VERSUS_MARKER)}
MISSING = "–"


def _missing(value):
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def format_seconds(seconds):
    """Seconds to ``"812 µs"``, ``"12.3 ms"``, ``"1.41 s"``; ``"–"`` for missing."""
    if _missing(seconds):
        return MISSING
    seconds = float(f"{seconds:.3g}")  # rounded first: 999.6 µs is "1 ms", not "1e+03 µs"
    unit, factor = next((u, f) for u, f in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6),
                                            ("ns", 0.0)) if seconds >= f)
    value = seconds / (factor or 1e-9)
    return f"{value:.0f} {unit}" if 1000 <= value < 1e6 else f"{value:.3g} {unit}"


def format_bytes(nbytes):
    """Bytes to ``"72 MiB"``, ``"1.5 GiB"``; ``"–"`` for missing."""
    if _missing(nbytes):
        return MISSING
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            value = nbytes / size
            return f"{value:.3g} {unit}" if not 100 <= value < 1e6 else f"{value:.0f} {unit}"
    return f"{nbytes:.0f} B"


def format_percent(fraction):
    """A fraction to ``"43%"``, ``"0.11%"``; ``""`` for missing."""
    if _missing(fraction):
        return ""
    return f"{100 * fraction:.0f}%" if fraction >= 0.095 else f"{100 * fraction:.2g}%"


def format_number(value, digits=3):
    """A float to ``digits`` significant places; ``"–"`` for missing."""
    return MISSING if _missing(value) else f"{value:.{digits}g}"


def plural(count, word, many=None):
    """``"1 thread"``, ``"2 threads"``; a joined list ("1, 2") is plural."""
    return f"{count} {word if str(count) == '1' else many or word + 's'}"


def mask_name(causal):
    """``"causal"`` or ``"non-causal"``, in every table and figure."""
    return "causal" if causal else "non-causal"


#: Why a kernel can run above its roof.
ABOVE_ROOF_WHY = (
    "the roof is the fastest measured GEMM n x d @ d x n at the kernel's d (the fastest BLAS "
    "probed), not a bound on the machine: a kernel's own register-blocked products can come "
    "closer to the cores' FMA peak than that BLAS call, and a probe slowed by other work "
    "lowers the roof (each probe's and point's load is in the results file); a paired "
    "fraction divides by one round's GEMM, a few calls after an idle turn, slower than the "
    "best probe")
#: The footnote of a table with a ``!`` in its % roof column.
ABOVE_ROOF_NOTE = f"!: above the roof. Why a kernel can be there: {ABOVE_ROOF_WHY}."
#: What the bracketed % roof is.
PAIRED_ROOF_NOTE = ("% roof in brackets: paired, the median over the rounds of the kernel's "
                    "GFLOP/s in the round (its fastest repeat there) over the roof GEMM's, "
                    "timed in a turn of its own in the same round (a slow spell of the machine "
                    "falls on both).")
#: A point this many times above its roof says more about the probe than the kernel.
FAR_ABOVE_ROOF = 2.0


def above_roof(fraction):
    """True for a fraction of the roof above 1."""
    return not _missing(fraction) and fraction > 1.0


def far_above_roof(records):
    """The records more than :data:`FAR_ABOVE_ROOF` times above their roof."""
    return [r for r in records if not _missing(r.get("roof_fraction"))
            and r["roof_fraction"] > FAR_ABOVE_ROOF]


def _flagged(fraction):
    return format_percent(fraction) + ("!" if above_roof(fraction) else "")


def _paired(fraction):
    return "" if _missing(fraction) else f" ({_flagged(fraction)})"


def format_roof_percent(fraction, paired=None):
    """:func:`format_percent`, ``"!"`` above the roof, and ``paired`` in brackets."""
    return (_flagged(fraction) or MISSING) + _paired(paired)


def _roof_notes(rows):
    paired = [r.get("roof_fraction_paired") for r in rows]
    return ([PAIRED_ROOF_NOTE] if any(not _missing(p) for p in paired) else []) + (
        [ABOVE_ROOF_NOTE] if any(above_roof(r.get("roof_fraction")) or above_roof(p)
                                 for r, p in zip(rows, paired)) else [])


def config_title(record):
    """Heading of the table a record belongs to."""
    dims = (f"d={record['d_k']}" if record["d_k"] == record["d_v"]
            else f"d_k={record['d_k']} d_v={record['d_v']}")
    fmap = f", feature map {record['feature_map']}" if record.get("feature_map") else ""
    fmap += f" (m = {record['num_features']})" if record.get("num_features") else ""
    regime = ", decode: one token after n keys" if record.get("regime") == "decode" else ""
    return (f"{record['attention']} attention{regime}, {mask_name(record['causal'])}, "
            f"{record['dtype']}, {dims}, batch {record['batch']} x heads {record['heads']}"
            f"{fmap}, {plural(record['threads'], 'thread')}")


def summarise(records, baseline=None, backend_order=()):
    """The tables of :func:`format_tables` as data (the JSON summary)."""
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
                 **{k: r.get(k) for k in SUMMARY_FIELDS}} for r in group]
        configurations.append({"title": config_title(group[0]), "rows": rows,
                               "config": {k: group[0].get(k) for k in CONFIG_KEYS}})
    return {"schema": SUMMARY_SCHEMA, "baseline": baseline, "configurations": configurations}


def _error_cell(row):
    err = MISSING if row["max_abs_err"] is None else f"{row['max_abs_err']:.1e}"
    if row["check_n"] and row["check_n"] != row["n"]:
        err += f" (n={row['check_n']})"
    return err + (" MISMATCH" if row["check_ok"] is False else "")


def _attention_cell(row):
    fmap = "" if row["attention"] == "softmax" or row["feature_map"] in (None, "elu") \
        else f" {row['feature_map']}"
    m = f" m={row['num_features']}" if row.get("num_features") else ""
    return row["attention"] + fmap + m + (" decode" if row.get("regime") == "decode" else "")


def _ratio_cell(value, text=MISSING, unit=""):
    return text if value is None else f"{value:.2f}{unit}"


def _roof_cell(row):
    return format_roof_percent(row["roof_fraction"], row.get("roof_fraction_paired"))


def format_limit(fraction, limit, paired=None):
    """``"92% peak"``, ``"3400%! floor (90%)"``: the binding limit's fraction, flagged, and the
    paired one in brackets; ``""`` for missing."""
    return "" if _missing(fraction) else f"{_flagged(fraction)} {limit}{_paired(paired)}"


def _limit_cell(row):
    return format_limit(row.get("limit_fraction"), row.get("limit"),
                        row.get("limit_fraction_paired")) or MISSING


#: Columns of a configuration's table: header, right-aligned, cell of a summary row.
POINT_COLUMNS = (
    ("n", True, lambda r: str(r["n"])), ("backend", False, lambda r: r["backend"]),
    ("median (min-max)", True, lambda r: f"{format_seconds(r['median_s'])} "
     f"({format_seconds(r['min_s'])}-{format_seconds(r['max_s'])})"),
    ("GFLOP/s", True, lambda r: format_number(r["gflops"])), ("% roof", True, _roof_cell),
    ("% limit", True, _limit_cell), ("peak extra", True, lambda r: format_bytes(r["peak_bytes"])),
    ("ratio", True, lambda r: _ratio_cell(r["vs_baseline"], unit="x")),
    ("max err", True, _error_cell))
#: Columns of the best fastattn / best peer table (a row of :func:`versus_rows`).
VERSUS_COLUMNS = (
    ("shape BxHxNxD", lambda r: r["shape"]), ("attention", _attention_cell),
    ("mask", lambda r: mask_name(r["causal"])), ("dtype", lambda r: r["dtype"]),
    ("threads", lambda r: str(r["threads"])), ("best fastattn", lambda r: r["fastattn"] or MISSING),
    ("time", lambda r: format_seconds(r["fastattn_s"])),
    ("best peer", lambda r: r["peer"] or MISSING), ("time", lambda r: format_seconds(r["peer_s"])),
    ("fastattn / peer", lambda r: _ratio_cell(r["ratio"], r["note"] or MISSING)),
    ("paired", lambda r: _ratio_cell(r.get("paired"))),
    ("GFLOP/s", lambda r: format_number(r["gflops"])), ("% roof", _roof_cell),
    ("% limit", _limit_cell))


def text_table(header, rows, align=None, markdown=False):
    """A table by tabulate, as text or Markdown; a row ``(cells, text)`` ends in ``text``."""
    from tabulate import tabulate
    if markdown:
        cells = [[c.replace("|", "\\|") for c in row] for row in rows]
        return tabulate(cells, header, tablefmt="github", disable_numparse=True)
    cells = [r[0] + [""] * (len(header) - len(r[0])) if isinstance(r, tuple) else r
             for r in rows]
    lines = tabulate(cells, header, tablefmt="simple", colalign=align,
                     disable_numparse=True).splitlines()
    spans = [(i, r[1]) for i, r in enumerate(rows) if isinstance(r, tuple) and r[1] is not None]
    if spans:
        start = [m.start() for m in re.finditer("-+", lines[1])][len(rows[spans[0][0]][0])]
        for i, text in spans:
            lines[2 + i] = lines[2 + i][:start].ljust(start) + text
    return "\n".join(line.rstrip() for line in lines)


def _with_limit(columns, rows):
    """``columns`` and :data:`LIMIT_NOTE`, or both without "% limit" when no row has one
    (runs before the limits probe)."""
    if any(not _missing(r.get("limit_fraction")) for r in rows):
        return list(columns), [LIMIT_NOTE]
    return [c for c in columns if c[0] != "% limit"], []


def format_tables(records, baseline=None, backend_order=()):
    """One text table per configuration, with the ratio ``baseline time / time``."""
    ratio_title = f"vs {baseline}" if baseline else "ratio"
    columns, limit_notes = _with_limit(POINT_COLUMNS, records)
    header = [ratio_title if h == "ratio" else h for h, _, _ in columns]
    align = ["right" if right else "left" for _, right, _ in columns]
    out = []
    for config in summarise(records, baseline, backend_order)["configurations"]:
        rows = [[cell(r) for _, _, cell in columns] if r["status"] == "ok" else
                ([str(r["n"]), r["backend"]], f"{r['status']}: {r['reason'] or ''}")
                for r in config["rows"]]
        out.append(config["title"] + "\n" + text_table(header, rows, align))
    if baseline:
        out.append(f"{ratio_title}: {baseline}'s median time / this median time "
                   "(above 1 is faster than the baseline).")
    out.append("GFLOP/s and % roof: at the median time.")
    return "\n\n".join(out + _roof_notes(records) + limit_notes)


#: What the "% limit" column is.
LIMIT_NOTE = ("% limit: the time the machine's binding limit allows (its flops at the compute "
              "peak or its bytes at the memory floor, both probed in this run) over the point's "
              "time; in brackets, paired with the floor read timed beside it each round. Above "
              "100 % (!): the probe ran slower than the point, most likely slowed by other work.")


def check_target(path, kind):
    """Refuse to replace a ``kind`` file fastattn did not write, or a read-only one."""
    _, what, marker = SIDE_FILES[kind]
    check_replaceable(path, what, marker, empty_ok=kind == "csv")


def _write(kind, path, text):
    check_target(path, kind)
    return atomic_write(path, text)


def write_csv(records, path):
    """Write point records as CSV, atomically; refuse a foreign file."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: r.get(k) for k in CSV_COLUMNS} for r in records)
    return _write("csv", path, buffer.getvalue())


def write_summary(records, path, baseline=None, backend_order=()):
    """Write :func:`summarise` as JSON, atomically; refuse a foreign file."""
    summary = summarise(records, baseline, backend_order)
    return _write("summary", path, to_json(summary, indent=1, sort_keys=True) + "\n")


def _fastest_s(record):
    """The fastest repeat (the median where none was kept)."""
    value = record.get("min_s")
    return record.get("median_s") if _missing(value) else value


def shape_text(record):
    """``"BxHxNxD"`` of a point (N the context n_k), ``"...xD_k:D_v"`` when they differ."""
    d = f"{record['d_k']}" + (f":{record['d_v']}" if record["d_v"] != record["d_k"] else "")
    return f"{record['batch']}x{record['heads']}x{record['n_k']}x{d}"


def paired_ratio(ours, theirs):
    """The median over 2+ shared rounds of ``ours``' fastest repeat over ``theirs``'."""
    a, b = ours.get("round_min_s"), theirs.get("round_min_s")
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return None
    pairs = [x / y for x, y in zip(a, b) if x > 0 and y > 0]
    return float(statistics.median(pairs)) if pairs else None


def versus_rows(records):
    """Per :data:`VERSUS_KEYS`: the fastest fastattn backend and peer, and their ``ratio``
    when measured in one run (else a ``note``)."""
    groups = {}
    for r in records:
        if r.get("record", "point") == "point" and r.get("status") == "ok" \
                and not _missing(_fastest_s(r)) and _fastest_s(r) > 0:
            groups.setdefault(tuple(r.get(k) for k in VERSUS_KEYS), []).append(r)
    rows = []
    for group in groups.values():
        best = min((r for r in group if not r.get("peer")), key=_fastest_s, default=None)
        peer = min((r for r in group if r.get("peer")), key=_fastest_s, default=None)
        ratio, note = None, None
        if best is None or peer is None:
            note = "no fastattn backend measured" if best is None else "no peer measured"
        elif best.get("run_id") != peer.get("run_id"):
            note = "measured in different runs: no ratio"
        else:
            ratio = _fastest_s(best) / _fastest_s(peer)
        gflops = fraction = None
        if best is not None and best.get("flops"):
            gflops = best["flops"] / _fastest_s(best) / 1e9
            fraction = gflops / best["roof_gflops"] if best.get("roof_gflops") else None
        rows.append({**{k: group[0].get(k) for k in VERSUS_KEYS}, "shape": shape_text(group[0]),
                     "fastattn": best and best["backend"],
                     "fastattn_s": best and _fastest_s(best),
                     "peer": peer and peer["backend"], "peer_s": peer and _fastest_s(peer),
                     "ratio": ratio, "note": note, "gflops": gflops, "roof_fraction": fraction,
                     "paired": paired_ratio(best, peer) if ratio is not None else None,
                     **{k: best and best.get(k) for k in ("roof_fraction_paired", "limit",
                                                          "limit_fraction_paired", "roof_blas")},
                     "limit_fraction": best and best.get("limit_s") and
                     best["limit_s"] / _fastest_s(best)})
    return rows


#: What the versus table shows.
VERSUS_NOTE = (
    "Times: the fastest repeat of each (other work only slows a call down). fastattn / peer "
    "below 1: fastattn's fastest backend is faster; given only for points measured side by "
    "side in one run. paired: the median of that ratio taken round by round, which a slow "
    "spell of the machine moves less. Decode: N is the context length n_k, one query. "
    "GFLOP/s and % roof: of the fastattn kernel at its fastest repeat (the per-point tables "
    "take the median).")


def format_versus(rows, roof_text=(), markdown=False):
    """The table of :func:`versus_rows` with its notes, as text (empty without rows) or
    Markdown (marker first)."""
    if not rows and not markdown:
        return ""
    columns, limit_notes = _with_limit(VERSUS_COLUMNS, rows)
    notes = [VERSUS_NOTE] + _roof_notes(rows) + limit_notes + list(roof_text)
    header = [h for h, _ in columns]
    table = text_table(header, [[c[-1](r) for c in columns] for r in rows],
                       ["left"] * len(header), markdown)
    if markdown:
        return "\n".join([VERSUS_MARKER, "", table, ""] + [f"- {n}" for n in notes]) + "\n"
    return "\n".join(["best fastattn / best peer", table, ""] + [f"  {n}" for n in notes])


def versus_markdown(rows, roof_text=()):
    """:func:`format_versus` as Markdown."""
    return format_versus(rows, roof_text, markdown=True)


def write_versus_markdown(rows, path, roof_text=()):
    """Write :func:`versus_markdown` atomically; refuse a foreign file."""
    return _write("markdown", path, versus_markdown(rows, roof_text))


def roof_statements(roofs):
    """Sentences saying which GEMM was probed, when, how fast, and which is the roof."""
    from .engine import MAX_PROBE_N, PEAK_PROBE_N, gemm_probes
    groups = {}
    for r in gemm_probes(roofs):
        key = (str(r.get("dtype")), r.get("threads"), r["shape"][1])
        groups.setdefault(key, {}).setdefault(r.get("blas") or r.get("library") or
                                              "NumPy's BLAS", []).append(r)
    lines = []
    for (dtype, threads, d), by_library in sorted(groups.items(), key=str):
        best = {lib: max(rs, key=lambda r: r["gflops"]) for lib, rs in by_library.items()}
        roof = max(best, key=lambda lib: best[lib]["gflops"])
        for lib, rs in by_library.items():
            ns = ", ".join(map(str, sorted({r["shape"][0] for r in rs})))
            when = sorted({r.get("probed_at") for r in rs if r.get("probed_at")})
            top = best[lib]
            lines.append(f"{dtype}, {plural(threads, 'thread')}: GEMM n x {d} @ {d} x n at "
                         f"n = {ns}, {lib}" + (f", probed {when[0]}" if when else "")
                         + f": best {top['gflops']:.1f} GFLOP/s (n = {top['shape'][0]})"
                         + (" - the roof" if lib == roof else f" (below {roof}: not the roof)"))
    if lines:
        lines.append("A point's roof is the fastest of these probes at its d, over every n and "
                     f"library: every n of the run (above n = {MAX_PROBE_N} at "
                     f"n = {MAX_PROBE_N}) and n = {' and '.join(map(str, PEAK_PROBE_N))}, "
                     "where the GEMM runs fastest on these machines, so a run of long "
                     "sequences alone is not measured against a GEMM bound by its n x n "
                     "output. The roofs are measured, so they move with the machine's load "
                     "from run to run.")
    return lines
