"""The Scaling section of one machine: time against n, fits, crossovers, every point measured
or not, and the peers."""

import numpy as np

from ..bench.peers import INSTALL_HINT, PEERS
from ..bench.table import (format_bytes, format_number, format_percent, format_seconds, mask_name,
                           plural)
from . import analysis, figures

#: The peers the page says to install when the results record no install hints of their own.
PREFILL_PEERS = tuple(name for name, peer in PEERS.items()
                      if ("softmax", "prefill") in peer.calls)
NAV = "Scaling"


def _exponent_rows(curve_list):
    """A row per kernel: time and memory exponents per mask and the expected time exponent
    ("non-causal 1, causal 2" where the masks differ)."""
    rows = {}
    for c in curve_list:
        row = rows.setdefault(c.label, {"label": c.label, "cells": {}, "by_mask": {}})
        row["by_mask"][mask_name(c.causal)] = c.expected
        row["cells"][mask_name(c.causal)] = {
            "time": c.fit_text("time"), "memory": c.fit_text("memory"), "off": c.off,
            "points": (f"{c.time_fit.points} points, n {c.time_fit.n_min}–{c.time_fit.n_max}"
                       if c.time_fit else f"fewer than 2 points with n ≥ {analysis.FIT_MIN_N}")}
    for row in rows.values():
        found = {mask: e for mask, e in row.pop("by_mask").items() if e is not None}
        row["expected"] = (next(iter(found.values())) if len(set(found.values())) == 1 else
                           ", ".join(f"{mask} {e}" for mask, e in found.items()) or None)
    return list(rows.values())


def peer_notes(curves):
    """What a peer's records say beyond its times: its compile (never timed) and the path that
    ran (``compile_s``, ``peer_path``), one line per peer."""
    notes = {}
    for c in curves:
        for p in c.points if c.peer else ():
            note = notes.setdefault(c.backend, {"compile": [], "paths": set()})
            if isinstance(p.get("compile_s"), (int, float)):
                note["compile"].append(p["compile_s"])
            if p.get("peer_path"):
                note["paths"].add(p["peer_path"])
    return [f"{name}: " + "; ".join(
        ([f"compiled per shape in {format_seconds(min(n['compile']))}–"
          f"{format_seconds(max(n['compile']))} (not timed)"] if n["compile"] else [])
        + sorted(n["paths"])) for name, n in sorted(notes.items()) if n["compile"] or n["paths"]]


def point_cell(c, i):
    """The table cell of curve ``c``'s ``i``-th point."""
    return {"median": format_seconds(c.median_s[i]),
            "range": f"{format_seconds(c.min_s[i])}–{format_seconds(c.max_s[i])}",
            "repeats": int(c.repeats[i]), "gflops": format_number(c.gflops[i]),
            "roof_pct": format_percent(c.roof_fraction[i]), "above_roof": bool(c.above_roof[i]),
            "limit": c.limit_text(i),
            "check_failed": int(c.n[i]) in c.check_failed, "stalled": bool(c.stalled[i]),
            "memory": format_bytes(c.peak_bytes[i]), "err": format_number(c.max_abs_err[i], 2)}


def _point_tables(curve_list):
    """A table per (attention, mask): a row per n, a column group per curve."""
    groups = [(f"{a} attention, {mask_name(causal)}",
               [c for c in curve_list if c.attention == a and c.causal == causal])
              for a in ("softmax", "linear") for causal in (False, True)]
    return [{"title": title, "columns": [c.label for c in group],
             "limits": any(np.isfinite(c.limit_s).any() for c in group),
             "rows": analysis.rows_by_n(group, point_cell)} for title, group in groups if group]


def _fastest_lines(curve_list):
    """Per mask, the fastest kernel of each type at the largest n measured."""
    lines = []
    for causal in (False, True):
        if not (group := [c for c in curve_list if c.causal == causal]):
            continue
        n = max(int(c.n[-1]) for c in group)
        best = [(a, *analysis.fastest_at([c for c in group if c.attention == a], n))
                for a in ("softmax", "linear")]
        if parts := [f"{a}: {c.backend}{' (peer)' if c.peer else ''} {format_seconds(t)}"
                     for a, t, c in best if c is not None]:
            lines.append(f"Fastest at n = {n} ({mask_name(causal)}): " + "; ".join(parts)
                         + f" ({statistic_text(group)}).")
    return lines


def statistic_text(curve_list):
    """Which statistic the fits of ``curve_list`` used, in words."""
    stats_ = {c.statistic for c in curve_list}
    if stats_ <= {"min"}:
        return "fastest repeat"
    return "median" if stats_ == {"median"} else (
        "fastest repeat; median where a point recorded none (asv keeps none without samples)")


def joined(values, most=None):
    """The distinct values sorted and joined by commas (over ``most``: "3 to 100"), or None."""
    distinct = sorted({v for v in values if v is not None})
    if most is not None and len(distinct) > most:
        return f"{distinct[0]} to {distinct[-1]}"
    return ", ".join(str(v) for v in distinct) or None


def not_measured(points):
    """The points not measured, a row per kernel and reason: masks, count and n."""
    groups = {}
    for p in points:
        if p.get("status") != "ok":
            key = (p.get("attention"), p.get("backend"), p.get("status"), p.get("reason") or "")
            groups.setdefault(key, []).append(p)
    return [{"attention": a, "backend": b, "status": status, "reason": why, "points": len(ps),
             "mask": ", ".join(dict.fromkeys(mask_name(p.get("causal")) for p in ps)),
             "n": joined((p.get("n_k") for p in ps), most=3)}
            for (a, b, status, why), ps in groups.items()]


def only_n(points):
    """The one n every ok point has (the asv suite's quick grid), else None."""
    ns = {p.get("n_k") for p in points if p.get("status") == "ok"}
    return ns.pop() if len(ns) == 1 and len(points) > len(ns) else None


def _summary(curve_list, block):
    """The sentences this section adds to the page's "In short", from its ``block``."""
    kinds = [(a, a, e) for a, e in analysis.EXPECTED_TIME_EXPONENT.items()] + [
        ("causal linear by the masked n×n form (reference)", "linear", 2)]
    parts = [part for name, a, e in kinds if (part := analysis.exponent_range(name, [
        c.time_fit for c in curve_list if c.attention == a and c.expected == e], e))]
    out = analysis.sentence(f"Fitted time exponents (n ≥ {analysis.FIT_MIN_N}, causal and "
                            f"not, on the {block['statistic']}): ", parts)
    for causal in (False, True):
        out += analysis.sentence(
            f"Crossover ({mask_name(causal)}), where linear attention becomes faster: ",
            [f"{r.label}: {r.crossover.describe()}" for r in analysis.headline(block["crossovers"])
             if r.causal == causal])
    if block["busy"]:
        out.append(f"The machine was busy while measuring (1-minute load average {block['load']} "
                   f"on {block['cores']} cores): times are inflated and noisy; compare the "
                   "kernels side by side rather than with other runs.")
    if stalled := analysis.stalled_text(curve_list):
        out.append(stalled)
    if block["threads_reason"] and block["threads"]:
        out.append(f"Measured on {plural(block['threads'], 'thread')}: "
                   f"{block['threads_reason']}.")
    return out + _fastest_lines(curve_list)


def section(m):
    """The Scaling block of machine ``m`` (:class:`~.analysis.Machine`)."""
    env, curve_list, short = m.env, m.scaling_curves, m.short_curves
    loads = np.concatenate([c.load_avg for c in curve_list] or [np.array([])])
    loads = loads[np.isfinite(loads)]
    threads = joined(c.key.get("threads") for c in m.curves)
    dtypes = joined(c.key.get("dtype") for c in m.curves)
    short_ns = joined(int(n) for c in short for n in c.n)
    title = (f"fastattn: time per call against n (d = 64, {dtypes or 'float32'}, "
             f"{threads or '?'} threads" + (f", {env['cpu_model']}" if env.get("cpu_model")
                                            else "") + ")")
    # no curve: no axes on the page; the figure beside the report says why in words
    why_empty = None if curve_list else (
        f"No scaling curve: every kernel was measured at fewer than 3 lengths\n"
        f"(n = {short_ns}); a curve needs at least 3, so nothing is drawn." if short
        else "No point was measured successfully: nothing to draw.")
    block = {
        "threads": threads, "threads_reason": env.get("threads_reason"), "dtypes": dtypes,
        "repeats": joined((int(r) for c in curve_list for r in c.repeats if r), most=3),
        "statistic": statistic_text(curve_list), "cores": env.get("cores_logical"),
        "load": f"{loads.min():.1f} to {loads.max():.1f}" if len(loads) else None,
        "busy": bool(len(loads) and env.get("cores_logical")
                     and loads.max() > env["cores_logical"]),
        "time_png": (figures.data_uri(figures.scaling_figure(m.panels, "time"))
                     if curve_list else None),
        "readme_png": figures.scaling_figure(m.panels, "time", title=title, empty=why_empty),
        "exponents": _exponent_rows(curve_list), "crossovers": analysis.crossover_rows(curve_list),
        "tables": _point_tables(curve_list),
        "other_points": [{"label": c.label, "attention": c.attention, "mask": mask_name(c.causal),
                          "n": int(n), **point_cell(c, i)}
                         for c in short for i, n in enumerate(c.n.tolist())],
        "not_ok": not_measured(m.points), "only_n": only_n(m.points),
        "backends": sorted({c.backend for c in curve_list if not c.peer}),
        "peers": sorted({c.backend for c in curve_list + list(short) if c.peer}),
        "all_peers": sorted({c.backend for c in m.curves if c.peer}),
        "peer_notes": peer_notes(m.curves),
        "peer_hints": env.get("absent_peers") or {k: INSTALL_HINT[k] for k in PREFILL_PEERS},
        "n_points": sum(len(c.n) for c in curve_list),
        "short": {"points": sum(len(c.n) for c in short), "ns": short_ns},
        "check_failures": [f"{c.label} at n = {n}" for c in curve_list for n in c.check_failed],
        "unavailable": env.get("unavailable_backends") or {},
        "curves": curve_list,
    }
    block["summary"] = _summary(curve_list, block)
    return block


def side_by_side(sections):
    """The time figure (data URI) of the machines with a scaling curve, a column each; None
    unless two or more have one."""
    drawn = [s for s in sections if s["scaling"]["curves"]]
    if len(drawn) < 2:
        return None
    return figures.data_uri(figures.scaling_figure(
        [(f"{s['name']}: {mask_name(causal)}",
          [c for c in s["scaling"]["curves"] if c.causal == causal])
         for causal in (False, True) for s in drawn], "time", ncols=min(len(drawn), 3)))
