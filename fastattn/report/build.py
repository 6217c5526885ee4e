"""The HTML report: records -> :mod:`.analysis` -> :mod:`.figures` (PNG, base64) -> the
Jinja2 template, which only fills in what it is given."""

import datetime as _dt
from dataclasses import dataclass

import jinja2
import numpy as np

from .. import __version__
from ..bench.engine import MAX_PROBE_N, PEAK_PROBE_N
from ..bench.peers import INSTALL_HINT
from ..bench.table import (ABOVE_ROOF_WHY, format_bytes, format_number, format_percent,
                           format_seconds, mask_name, roof_statements)
from . import analysis, figures, frontier, generation

#: Marker written into every report; an existing file at the output path is
#: only replaced when it carries it.
REPORT_MARKER = '<meta name="generator" content="fastattn report">'

PEER_HELP = ("No peer ran the prefill points: these results hold none (no peer was installed "
             "where they were measured). To put PyTorch's SDPA, onnxruntime's and JAX's "
             "attention beside fastattn's kernels, install them and run fastattn report again:")


@dataclass
class Report:
    """A built report: the self-contained ``html`` and the first machine's ``scaling_png``
    (time against n, for the README)."""

    html: str
    scaling_png: bytes | None


#: Environment rows: label, then the keys of fastattn.bench.environment.collect()
#: it may come from (dotted paths; the first present wins).
_ENV_FIELDS = (
    ("CPU", "cpu_model"), ("CPU features", "cpu_flags"), ("Cores (logical)", "cores_logical"),
    ("Cores usable by this process", "cores_usable"), ("Threads used", "threads"),
    ("Why this thread count", "threads_reason"), ("Thread counts in force", "thread_counts"),
    ("Thread variables set", "thread_env"),
    ("BLAS", "blas"), ("NumPy's BLAS (build)", "numpy_config_blas"),
    ("Memory", "memory_total_bytes"), ("Operating system", "platform"),
    ("Host", "hostname"), ("Python", "python"), ("NumPy", "versions.numpy"),
    ("SciPy", "versions.scipy"), ("Numba", "versions.numba"),
    ("Cython (compiler, needed only to build)", "versions.cython"),
    ("threadpoolctl", "versions.threadpoolctl"), ("PyTorch", "versions.torch"),
    ("fastattn", "versions.fastattn"), ("fastattn commit", "git_commit"),
    ("asv commit", "commit"), ("Backends available", "backends"),
    ("Cython products' instruction set", "cython_products"),
    ("Peers available", "peers"),
)


def _lookup(record, path):
    for part in path.split("."):
        if not isinstance(record, dict) or part not in record:
            return None, False
        record = record[part]
    return record, True


def _blas_text(value):
    """threadpoolctl BLAS entries to ``"openblas 0.3.27, Haswell kernel, 2 threads (lib.so)"``."""
    parts = []
    for info in value if isinstance(value, list) else [value]:
        if not isinstance(info, dict):
            parts.append(str(info))
            continue
        text = f"{info.get('internal_api') or 'BLAS'} {info.get('version') or ''}".strip()
        if info.get("architecture"):
            text += f", {info['architecture']} kernel"
        if info.get("num_threads") is not None:
            text += f", {info['num_threads']} threads"
        owner = info.get("prefix") or info.get("filepath")
        parts.append(text + (f" ({str(owner).rsplit('/', 1)[-1]})" if owner else ""))
    return "; ".join(parts) or "–"


def _value_text(value):
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_value_text(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(_value_text(v) for v in value) or "none"
    return "–" if value is None else str(value)


def environment_rows(env):
    """``rows, rest``: (label, text) of the known fields (an absent library "not
    installed"), and of every other recorded field by its dotted path."""
    rows, used = [], {"schema", "record", "memory_available_bytes"}
    for label, path in _ENV_FIELDS:
        value, present = _lookup(env, path)
        if not present:
            continue
        used.add(path)
        if path == "blas":
            text = _blas_text(value)
        elif path == "memory_total_bytes":
            text = f"{format_bytes(value)} total" + (
                f", {format_bytes(env['memory_available_bytes'])} available at the start"
                if env.get("memory_available_bytes") else "")
        else:
            text = "not installed" if value is None and path.startswith("versions.") \
                else _value_text(value)
        rows.append((label, text))
    rest = []
    for key, value in env.items():
        items = value.items() if isinstance(value, dict) and key != "blas" else [(None, value)]
        for sub, item in items:
            path = key if sub is None else f"{key}.{sub}"
            if path not in used and key not in used:
                rest.append((path, _value_text(item)))
    return rows, rest


def _exponent_rows(curve_list):
    """One row per kernel: time and memory exponents, non-causal and causal."""
    rows = {}
    for c in curve_list:
        row = rows.setdefault(c.label, {"label": c.label, "attention": c.attention, "cells": {},
                                        "expected": None, "by_mask": {}})
        row["by_mask"][mask_name(c.causal)] = c.expected
        row["cells"][mask_name(c.causal)] = {
            "time": c.time_fit.format() if c.time_fit else "–",
            "memory": c.memory_fit.format() if c.memory_fit else "–", "off": c.off,
            "points": (f"{c.time_fit.points} points, n {c.time_fit.n_min}–{c.time_fit.n_max}"
                       if c.time_fit else f"fewer than 2 points with n ≥ {analysis.FIT_MIN_N}")}
    for row in rows.values():
        # "1", or "1, causal 2" where the masks differ (the reference's causal linear form)
        found = {mask: e for mask, e in row.pop("by_mask").items() if e is not None}
        if len(set(found.values())) == 1:
            row["expected"] = next(iter(found.values()))
        elif found:
            row["expected"] = ", ".join(f"{mask} {e}" for mask, e in found.items())
    return list(rows.values())


def _point_cell(c, i):
    """The table cell of curve ``c``'s ``i``-th point: time, throughput, memory, error."""
    return {"median": format_seconds(c.median_s[i]),
            "range": f"{format_seconds(c.min_s[i])}–{format_seconds(c.max_s[i])}",
            "repeats": int(c.repeats[i]), "gflops": format_number(c.gflops[i]),
            "roof_pct": format_percent(c.roof_fraction[i]), "above_roof": bool(c.above_roof[i]),
            "check_failed": int(c.n[i]) in c.check_failed,
            "memory": format_bytes(c.peak_bytes[i]), "err": format_number(c.max_abs_err[i], 2)}


def _point_tables(curve_list):
    """One wide table per (attention, causal): rows n, a column group per curve."""
    tables = []
    for attention in ("softmax", "linear"):
        for causal in (False, True):
            group = [c for c in curve_list if c.attention == attention and c.causal == causal]
            if group:
                tables.append({"title": f"{attention} attention, {mask_name(causal)}",
                               "columns": [c.label for c in group],
                               "rows": analysis.rows_by_n(group, _point_cell)})
    return tables


def _other_point_rows(curve_list):
    """A row per point of the curves too short to scale (a bench run's single shapes, the
    feature-map grid's two n), which the wide tables leave out."""
    return [{"label": c.label, "attention": c.attention, "mask": mask_name(c.causal),
             "n": int(n), **_point_cell(c, i)}
            for c in curve_list for i, n in enumerate(c.n.tolist())]


def _fastest_lines(curve_list):
    """For each mask: the fastest kernel of each type at the largest n measured."""
    lines = []
    for causal in (False, True):
        group = [c for c in curve_list if c.causal == causal]
        if not group:
            continue
        n = max(int(c.n[-1]) for c in group)
        parts = []
        for attention in ("softmax", "linear"):
            at_n = [(float(c.fit_s[c.n == n][0]), c) for c in group
                    if c.attention == attention and (c.n == n).any()]
            if at_n:
                t, c = min(at_n, key=lambda tc: tc[0])
                parts.append(f"{attention}: {c.backend}{' (peer)' if c.peer else ''} "
                             f"{format_seconds(t)}")
        if parts:
            lines.append(f"Fastest at n = {n} ({mask_name(causal)}): " + "; ".join(parts)
                         + f" ({_statistic_text(group)}).")
    return lines


def _statistic_text(curve_list):
    stats_ = {c.statistic for c in curve_list}
    if stats_ <= {"min"}:   # no curve: nothing fitted, and nothing to explain
        return "fastest repeat"
    return "median" if stats_ == {"median"} else (
        "fastest repeat; median where a point recorded none (asv keeps none without samples)")


def _input_shapes(points):
    """The inputs' batch and heads, as the methods text says them: "batch 1, one head", or
    each (batch, heads) measured ("batch x heads 1 x 1, 1 x 2") for a run of several shapes."""
    pairs = sorted({(p.get("batch") or 1, p.get("heads") or 1) for p in points})
    if pairs in ([], [(1, 1)]):
        return "batch 1, one head"
    return "batch × heads " + ", ".join(f"{b} × {h}" for b, h in pairs)


def _joined(values):
    return ", ".join(str(v) for v in sorted({v for v in values if v is not None})) or None


def _span(values):
    """A few distinct counts joined ("3, 5"), many as their range ("3 to 100"); None if none."""
    distinct = sorted({v for v in values if v is not None})
    if len(distinct) > 3:
        return f"{distinct[0]} to {distinct[-1]}"
    return ", ".join(str(v) for v in distinct) or None


def _machine_section(name, env, roofs, points, every_curve):
    """The page's block of one machine: the prefill scaling curves (at least three n; the
    feature-map points at two n are for their own section) and the Generation block."""
    env = env or {}
    prefill = [c for c in every_curve if c.key.get("regime") != "decode"]
    curve_list = [c for c in prefill if len(c.n) >= 3]
    panels = [(mask_name(c), [x for x in curve_list if x.causal == c]) for c in (False, True)]
    panels = [p for p in panels if p[1]] or [("no measured points", [])]
    roof_lines = []
    for dtype, threads, d in sorted({(str(c.key.get("dtype")), c.key.get("threads"),
                                      c.key.get("d_k")) for c in curve_list}, key=str):
        # The roof (one value: the fastest probe at this d, at any n) as a horizontal line,
        # then each library's probes against n, which fall below it where the GEMM's n x n
        # output bounds them.
        for blas, is_roof in analysis.roof_libraries(roofs, dtype, threads, d, machine=name):
            ns, values = analysis.roof_curve(roofs, dtype, threads, d=d, machine=name, blas=blas)
            shape = f"n×{d} @ {d}×n" if len(ns) > 1 else f"{ns[0]}×{d} @ {d}×{ns[0]}"
            # The library's name only (versions are in the roof statements): the legend fits.
            library = blas.split(" (")[0].split(" through ")[0].split()[0]
            via = blas.split(" through ")[1].split()[0] if " through " in blas else ""
            series = library + (f" via {via}" if via else "") + f", {dtype}"
            if is_roof:
                best = int(np.argmax(values))
                roof_lines.insert(0, (f"roof: {values[best]:.0f} GFLOP/s ({series}, n = {ns[best]})",
                                      ns[best:best + 1], values[best:best + 1]))
            if len(ns) > 1:
                roof_lines.append((f"GEMM {shape}, {series}", ns, values))
    above = [f"{c.label}, {mask_name(c.causal)}, at n = {n}" for c in curve_list
             for n, flag in zip(c.n.tolist(), c.above_roof.tolist()) if flag]
    loads = np.concatenate([c.load_avg for c in curve_list] or [np.array([])])
    loads = loads[np.isfinite(loads)]
    threads, dtypes = _joined(c.key.get("threads") for c in every_curve), \
        _joined(c.key.get("dtype") for c in every_curve)
    env_rows, env_rest = environment_rows(env)
    title = (f"fastattn: time per call against n (d = 64, {dtypes or 'float32'}, "
             f"{threads or '?'} threads" + (f", {env['cpu_model']}" if env.get("cpu_model")
                                            else "") + ")")
    section = {
        "name": name or "this machine", "env_rows": env_rows, "env_rest": env_rest,
        "threads": threads, "threads_reason": env.get("threads_reason"),
        "dtypes": dtypes, "repeats": _span(
            int(r) for c in curve_list for r in c.repeats if r),
        "statistic": _statistic_text(curve_list),
        "memory_methods": _joined(m for c in curve_list for m in c.memory_method),
        "time_png": figures.data_uri(figures.scaling_figure(panels, "time")),
        "memory_png": (figures.data_uri(figures.scaling_figure(panels, "memory"))
                       if any(np.isfinite(c.peak_bytes).any() for c in curve_list) else None),
        "roof_png": (figures.data_uri(figures.roofline_figure(panels, roof_lines))
                     if any(np.isfinite(c.gflops).any() for c in curve_list) else None),
        "roof_lines": [label for label, _, _ in roof_lines],
        "roof_statements": roof_statements([r for r in roofs
                                            if r.get("machine") in (None, name)]),
        "above_roof": above, "above_roof_why": ABOVE_ROOF_WHY,
        "roofs": [r for r in roofs if r.get("machine") in (None, name)],
        "exponents": _exponent_rows(curve_list),
        "crossovers": analysis.crossover_rows(curve_list),
        "tables": _point_tables(curve_list),
        "other_points": _other_point_rows([c for c in prefill if len(c.n) < 3]),
        "not_ok": [p for p in points if p.get("machine") == name and p.get("status") != "ok"],
        "backends": sorted({c.backend for c in curve_list if not c.peer}),
        "peers": sorted({c.backend for c in curve_list if c.peer}),
        "all_peers": sorted({c.backend for c in every_curve if c.peer}),
        "n_points": sum(len(c.n) for c in curve_list), "fastest": _fastest_lines(curve_list),
        # Prefill points measured at fewer than three n: no curve, and said so (not "no point").
        "short": {"points": sum(len(c.n) for c in prefill if len(c.n) < 3),
                  "ns": _joined(int(n) for c in prefill if len(c.n) < 3 for n in c.n)},
        "load": f"{loads.min():.1f} to {loads.max():.1f}" if len(loads) else None,
        "busy": bool(len(loads) and env.get("cores_logical")
                     and loads.max() > env["cores_logical"]),
        "cores": env.get("cores_logical"),
        "check_failures": [f"{c.label} at n = {n}" for c in curve_list for n in c.check_failed],
        "unavailable": env.get("unavailable_backends") or {},
        "absent_peers": env.get("absent_peers") or {},
        "curves": curve_list, "all_curves": every_curve,
        "generation": generation.section(
            [c for c in every_curve if c.key.get("regime") == "decode"], prefill),
    }
    readme_png = figures.scaling_figure(panels, "time", title=title)
    return section, readme_png


def _summary(section, quality):
    """Plain sentences with the headline numbers of the first machine."""
    out = []
    curves_ = section["curves"] if section else []
    parts = []
    for attention, expected in analysis.EXPECTED_TIME_EXPONENT.items():
        text = analysis.exponent_range(
            attention, [c.time_fit for c in curves_
                        if c.attention == attention and c.expected == expected], expected)
        if text:
            parts.append(text)
    quadratic = [c.time_fit for c in curves_ if c.attention == "linear" and c.expected == 2]
    text = analysis.exponent_range("causal linear by the masked n×n form (reference)",
                                   quadratic, 2)
    if text:
        parts.append(text)
    if parts:
        out.append(f"Fitted time exponents (n ≥ {analysis.FIT_MIN_N}, causal and not, on the "
                   f"{section['statistic']}): " + "; ".join(parts) + ".")
    rows = section["crossovers"] if section else []
    headline = [r for r in rows if r.kind == "fastattn"] or \
        [r for r in rows if r.kind == "backend" and not r.peer]
    for causal in (False, True):
        mine = [r for r in headline if r.causal == causal]
        if mine:
            out.append(f"Crossover ({mask_name(causal)}), where linear attention becomes "
                       "faster: " + "; ".join(f"{r.label}: {r.crossover.describe()}"
                                              for r in mine) + ".")
    if section and section["busy"]:
        out.append(f"The machine was busy while measuring (1-minute load average "
                   f"{section['load']} on {section['cores']} cores): times are inflated and "
                   "noisy; compare the kernels side by side rather than with other runs.")
    if section and section["threads_reason"] and section["threads"]:
        out.append(f"Measured on {section['threads']} thread(s): "
                   f"{section['threads_reason']}.")
    out += section["fastest"] if section else []
    out += section["generation"]["summary"] if section and section["generation"] else []
    if quality is not None and quality.gaussian and quality.minilm:
        g = [r.cosine_similarity for r in quality.gaussian]
        m = [r.cosine_similarity for r in quality.minilm]
        out.append(f"Linear attention's output against softmax's: mean cosine similarity "
                   f"{min(g):.3f} to {max(g):.3f} on Gaussian inputs, but {min(m):.3f} to "
                   f"{max(m):.3f} per layer on real MiniLM activations.")
    return out


def _history_section(history, benchmark):
    if history is None:
        return None
    title = benchmark or "asv benchmark history"
    rows = sorted(history, key=lambda r: (str(r.get("benchmark")), str(r.get("machine")),
                                          str(r.get("params")), r.get("date") or ""))
    value = {"seconds": format_seconds, "bytes": format_bytes}
    return {"benchmark": title,
            "png": figures.data_uri(figures.history_figure(history, title)) if history else None,
            "rows": [{**r, "commit": str(r.get("commit") or "")[:8],
                      "params": _value_text(r.get("params") or {}),
                      "value": value.get(r.get("unit"), format_number)(r.get("value"))}
                     for r in rows]}


def _quality_section(quality, curve_list=()):
    if quality is None:
        return None
    return {"r": quality, "frontier": frontier.section(quality.frontier, curve_list),
            "figure": figures.data_uri(figures.quality_figure(quality.gaussian, quality.minilm)),
            "heatmaps": [{"title": h.title, "note": h.note,
                          "png": figures.data_uri(figures.heatmap_figure(h))}
                         for h in quality.heatmaps]}


def _template():
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=format_number, mask=mask_name)
    return env.get_template("report.html.j2")


def build_report(records, *, source="", quality=None, history=None, history_benchmark=None,
                 generated=None):
    """The :class:`Report` of results ``records`` (grouped by ``machine``), from ``source``;
    ``quality`` (:func:`~.quality.compute_quality`) and ``history`` (``load_asv_history``
    rows of ``history_benchmark``) add sections.  ValueError for records of no known type."""
    environments, roofs, points = analysis.split_records(records)
    if not (environments or roofs or points):
        raise ValueError(f"{source or 'the records'} hold no fastattn environment, roof or "
                         "point record")
    all_curves = analysis.curves(points, roofs)
    names = list(dict.fromkeys(item.get("machine") for item in environments + points)) or [None]
    env_of = {env.get("machine"): env for env in environments}  # the last: the latest run
    sections, pngs = zip(*(_machine_section(name, env_of.get(name), roofs, points,
                                            [c for c in all_curves if c.machine == name])
                           for name in names))
    comparison_png = None
    if len(names) > 1:
        panels = [(f"{s['name']}: {mask_name(causal)}",
                   [c for c in s["curves"] if c.causal == causal])
                  for causal in (False, True) for s in sections]
        comparison_png = figures.data_uri(
            figures.scaling_figure(panels, "time", ncols=min(len(names), 3)))
    page = _template().render(
        marker=REPORT_MARKER, version=__version__, source=source, sections=sections,
        generated=(generated or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC"),
        comparison_png=comparison_png, peer_help=PEER_HELP,
        prefill_peer_hints={k: INSTALL_HINT[k] for k in ("torch", "onnxruntime", "jax")},
        summary=_summary(sections[0], quality), quality=_quality_section(quality, all_curves),
        history=_history_section(history, history_benchmark), fit_min_n=analysis.FIT_MIN_N,
        max_probe_n=MAX_PROBE_N, peak_probe_n=PEAK_PROBE_N,
        from_asv=any(p.get("source") == "asv" for p in points), n_records=len(records),
        input_shapes=_input_shapes(points))
    return Report(page, pngs[0])
