"""Assemble the HTML report from results records (and the quality numbers).

:func:`build_report` is the one entry point: records in, one self-contained
HTML page out (figures embedded as base64 PNG, CSS inline, no external
asset).  It reads results only; nothing is timed here.
"""

import datetime as _dt
import math
from dataclasses import dataclass
from importlib import resources

import jinja2
import numpy as np

from .. import __version__
from . import analysis, figures

#: Marker written into every report; an existing file at the output path is
#: only replaced when it carries it.
REPORT_MARKER = '<meta name="generator" content="fastattn report">'

#: The exponent each attention type should show on time (and on memory for the
#: reference softmax, whose n×n intermediates dominate).
EXPECTED_TIME_EXPONENT = {"softmax": 2, "linear": 1}

PEER_HELP = (
    "No peer implementation was measured: these results hold no PyTorch points (torch was not "
    "installed where they were measured). To put torch.nn.functional.scaled_dot_product_attention "
    "and a PyTorch linear attention beside fastattn's kernels, install torch and run "
    "fastattn report again:"
)


@dataclass
class Report:
    """A built report.

    Attributes
    ----------
    html : str
        The self-contained page.
    scaling_png : bytes or None
        The time-against-n figure (non-causal and causal panels) of the first
        machine, for the README.
    """

    html: str
    scaling_png: bytes | None


# --------------------------------------------------------------------- format
def fmt_time(seconds):
    """Seconds to ``"812 µs"``, ``"12.3 ms"``, ``"1.41 s"``; ``"–"`` for missing."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def fmt_bytes(nbytes):
    """Bytes to ``"72.0 MiB"``, ``"1023 MiB"``; ``"–"`` for missing."""
    if nbytes is None or not math.isfinite(nbytes):
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            value = nbytes / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{nbytes:.0f} B"


def fmt_percent(fraction):
    """A fraction to ``"43%"``, ``"0.11%"``; ``""`` for missing."""
    if fraction is None or not math.isfinite(fraction):
        return ""
    return f"{100 * fraction:.0f}%" if fraction >= 0.095 else f"{100 * fraction:.2g}%"


def fmt_num(value, digits=3):
    """A float to ``digits`` significant places; ``"–"`` for missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}g}"


# ---------------------------------------------------------------- environment
_ENV_FIELDS = (
    # label, candidate keys (dotted paths) of fastattn.bench.environment.collect(); first found wins
    ("CPU", ("cpu_model", "cpu.model")),
    ("CPU features", ("cpu_flags",)),
    ("Cores (logical)", ("cores_logical", "cpu.logical_cores")),
    ("Cores usable by this process", ("cores_usable",)),
    ("Threads used", ("threads", "threads.requested")),
    ("Thread counts in force", ("thread_counts",)),
    ("BLAS", ("blas",)),
    ("NumPy's BLAS (build)", ("numpy_config_blas",)),
    ("Memory", ("memory_total_bytes",)),
    ("Operating system", ("platform",)),
    ("Host", ("hostname", "machine")),
    ("Python", ("python", "versions.python")),
    ("NumPy", ("versions.numpy",)),
    ("SciPy", ("versions.scipy",)),
    ("Numba", ("versions.numba",)),
    ("Cython", ("versions.cython",)),
    ("threadpoolctl", ("versions.threadpoolctl",)),
    ("PyTorch", ("versions.torch",)),
    ("fastattn", ("versions.fastattn",)),
    ("fastattn commit", ("git_commit",)),
    ("Backends available", ("backends",)),
    ("Peers available", ("peers",)),
)


def _lookup(record, path):
    value = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _blas_text(value):
    """threadpoolctl-style BLAS entries to ``"openblas 0.3.27, Haswell kernel, 2 threads"``."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return str(value)
    parts = []
    for info in value:
        if not isinstance(info, dict):
            parts.append(str(info))
            continue
        name = info.get("internal_api") or info.get("vendor") or info.get("name") or "BLAS"
        text = f"{name} {info.get('version') or ''}".strip()
        kernel = info.get("architecture") or info.get("kernel") or info.get("corename")
        if kernel:
            text += f", {kernel} kernel"
        if info.get("num_threads") is not None:
            text += f", {info['num_threads']} threads"
        owner = info.get("prefix") or info.get("filepath") or info.get("library")
        if owner:
            text += f" ({str(owner).rsplit('/', 1)[-1]})"
        parts.append(text)
    return "; ".join(parts) or "–"


def _value_text(value):
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_value_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_value_text(v) for v in value)
    return str(value)


def _flatten(record, prefix=""):
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and "blas" not in key.lower():
            yield from _flatten(value, path + ".")
        else:
            yield path, value


def environment_rows(env):
    """The environment block: known fields first, then every other recorded field.

    Parameters
    ----------
    env : dict
        An environment record.

    Returns
    -------
    rows, rest : list of (str, str)
        ``rows``: CPU, cores, threads, BLAS, versions ... as found;
        ``rest``: every other field by its dotted path.
    """
    rows, used = [], set()
    for label, paths in _ENV_FIELDS:
        for path in paths:
            value = _lookup(env, path)
            if value is None and path.startswith("versions.") and path.split(".")[1] in env.get("versions", {}):
                value = "not installed"
            elif isinstance(value, (list, tuple)) and not value:
                value = "none"
            if value is None:
                continue
            if label == "BLAS":
                text = _blas_text(value)
            elif label == "Memory":
                text = f"{fmt_bytes(value)} total"
                if env.get("memory_available_bytes"):
                    text += f", {fmt_bytes(env['memory_available_bytes'])} available at the start"
                    used.add("memory_available_bytes")
            else:
                text = _value_text(value)
            rows.append((label, text))
            used.add(path)
            break
    rest = []
    for path, value in _flatten(env):
        if path in ("schema", "record") or any(path == u or path.startswith(u + ".") for u in used):
            continue
        rest.append((path, _blas_text(value) if "blas" in path.lower() else _value_text(value)))
    return rows, rest


# ------------------------------------------------------------------- sections
def _label_curves(curve_list):
    """Give each curve a display label that tells apart what varies (dtype, threads, shape)."""
    for c in curve_list:
        same = [o for o in curve_list if o.attention == c.attention]
        varying = [k for k in ("dtype", "threads", "d_k", "d_v", "batch", "heads", "feature_map")
                   if len({o.key.get(k) for o in same}) > 1]
        extra = ", ".join(f"{k}={c.key.get(k)}" for k in varying if c.key.get(k) is not None)
        c.display = c.label + (f" [{extra}]" if extra else "")
    return curve_list


def _causal_title(causal):
    return "causal" if causal else "non-causal"


def _exponent_rows(curve_list):
    """One row per kernel (backend, attention, setting): time and memory exponents, non-causal and causal."""
    rows, index = [], {}
    for c in curve_list:
        key = (c.display or c.label, c.attention)
        if key not in index:
            index[key] = {"label": key[0], "attention": c.attention,
                          "expected": EXPECTED_TIME_EXPONENT.get(c.attention), "cells": {}}
            rows.append(index[key])
        row = index[key]
        time_fit = analysis.fit_exponent(c.n, c.median_s)
        mem_fit = analysis.fit_exponent(c.n, c.peak_bytes)
        expected = row["expected"]
        row["cells"][_causal_title(c.causal)] = {
            "time": time_fit.format() if time_fit else "–",
            "slope": time_fit.slope if time_fit else None,
            "points": (f"{time_fit.points} points, n {time_fit.n_min}–{time_fit.n_max}"
                       if time_fit else f"fewer than 2 points with n ≥ {analysis.FIT_MIN_N}"),
            "memory": mem_fit.format() if mem_fit else "–",
            "off": (time_fit is not None and expected is not None
                    and abs(time_fit.slope - expected) > 0.35),
        }
    return rows


def _crossover_rows(curve_list):
    """Crossover of each backend's softmax and linear curves, and of the fastest of each type.

    Curves are compared within one dtype and thread count; the "fastest"
    rows (lower envelope over backends) appear when at least two fastattn
    backends measured both types.
    """
    rows = []
    for causal in (False, True):
        group = [c for c in curve_list if c.causal == causal]
        settings = sorted({(str(c.key.get("dtype")), str(c.key.get("threads"))) for c in group})
        for dtype, threads in settings:
            same = [c for c in group
                    if (str(c.key.get("dtype")), str(c.key.get("threads"))) == (dtype, threads)]
            suffix = f" [{dtype}, {threads} threads]" if len(settings) > 1 else ""
            soft = {c.backend: c for c in same if c.attention == "softmax"}
            lin = {c.backend: c for c in same if c.attention == "linear"}
            for backend in [b for b in soft if b in lin]:
                s, l_ = soft[backend], lin[backend]
                x = analysis.crossover(s.n, s.median_s, l_.n, l_.median_s)
                rows.append({"causal": _causal_title(causal),
                             "pair": f"{s.label.replace(' softmax', '')}{suffix}: softmax vs linear",
                             "text": x.describe(), "n": x.n, "status": x.status})
            for name, pool in (("fastest fastattn kernel of each type",
                                [c for c in same if not c.peer]),
                               ("fastest of all, peers included", same)):
                if name.startswith("fastest of all") and not any(c.peer for c in same):
                    continue
                s_list = [c for c in pool if c.attention == "softmax"]
                l_list = [c for c in pool if c.attention == "linear"]
                both = {c.backend for c in s_list} & {c.backend for c in l_list}
                if len({c.backend for c in pool}) < 2 or not both or not s_list or not l_list:
                    continue
                ns, ts = analysis.envelope(s_list)
                nl, tl = analysis.envelope(l_list)
                x = analysis.crossover(ns, ts, nl, tl)
                rows.append({"causal": _causal_title(causal), "pair": name + suffix,
                             "text": x.describe(), "n": x.n, "status": x.status})
    return rows


def _point_tables(curve_list, roofs, machine):
    """One wide table per (attention, causal): rows n, a column group per backend."""
    tables = []
    for attention in ("softmax", "linear"):
        for causal in (False, True):
            group = [c for c in curve_list if c.attention == attention and c.causal == causal]
            if not group:
                continue
            ns = sorted({int(n) for c in group for n in c.n})
            rows = []
            for n in ns:
                cells = []
                for c in group:
                    idx = np.flatnonzero(c.n == n)
                    if len(idx) == 0:
                        cells.append(None)
                        continue
                    i = int(idx[0])
                    g, fraction = c.gflops[i], c.roof_fraction[i]
                    if not math.isfinite(fraction):   # not recorded: the best roof of its dtype
                        roof, _ = analysis.roof_gflops(roofs, c.key.get("dtype"),
                                                       c.key.get("threads"), machine)
                        fraction = g / roof if roof else float("nan")
                    cells.append({
                        "median": fmt_time(c.median_s[i]),
                        "range": f"{fmt_time(c.min_s[i])}–{fmt_time(c.max_s[i])}",
                        "repeats": int(c.repeats[i]),
                        "gflops": fmt_num(g),
                        "roof_pct": fmt_percent(fraction),
                        "check_failed": n in c.check_failed,
                        "memory": fmt_bytes(c.peak_bytes[i]),
                        "err": fmt_num(c.max_abs_err[i], 2),
                    })
                rows.append({"n": n, "cells": cells})
            tables.append({"title": f"{attention} attention, {_causal_title(causal)}",
                           "columns": [c.display for c in group], "rows": rows})
    return tables


def _roof_lines(roofs, curve_list, machine):
    """``[(label, n, gflops)]``: the GEMM roof of each (dtype, threads, d_k) of the curves."""
    lines, seen = [], set()
    for c in curve_list:
        key = (c.key.get("dtype"), c.key.get("threads"), c.key.get("d_k"))
        if key in seen:
            continue
        seen.add(key)
        ns, values = analysis.roof_curve(roofs, key[0], key[1], d=key[2], machine=machine)
        if len(ns):
            shape = f"n×{key[2]} @ {key[2]}×n" if len(ns) > 1 else f"{ns[0]}×{key[2]} @ {key[2]}×{ns[0]}"
            lines.append((f"GEMM roof, {shape} ({key[0]}, {key[1]} threads)", ns, values))
    return lines


def _machine_section(name, env, roofs, points, all_curves):
    curve_list = _label_curves([c for c in all_curves if c.machine == name])
    panels = [(_causal_title(causal), [c for c in curve_list if c.causal == causal])
              for causal in (False, True)]
    panels = [p for p in panels if p[1]] or [("no measured points", [])]
    roof_lines = _roof_lines(roofs, curve_list, name)
    not_ok = [p for p in points if p.get("machine") == name and p.get("status") != "ok"]
    env_rows, env_rest = environment_rows(env or {})
    roofs = [r for r in roofs if r.get("machine") in (None, name)]
    threads = sorted({c.key.get("threads") for c in curve_list if c.key.get("threads") is not None})
    dtypes = sorted({str(c.key.get("dtype")) for c in curve_list})
    methods = sorted({m for c in curve_list for m in c.memory_method})
    repeats = sorted({int(r) for c in curve_list for r in c.repeats if r})
    has_memory = any(np.isfinite(c.peak_bytes).any() for c in curve_list)
    time_png = figures.scaling_figure(panels, "time")
    cpu = (env or {}).get("cpu_model")
    readme_png = figures.scaling_figure(
        panels, "time",
        title=(f"fastattn: median time per call against n (d = 64, "
               f"{', '.join(sorted({str(c.key.get('dtype')) for c in curve_list})) or 'float32'}, "
               f"{', '.join(str(t) for t in sorted({c.key.get('threads') for c in curve_list if c.key.get('threads')})) or '?'} threads"
               + (f", {cpu}" if cpu else "") + ")"))
    exponents = _exponent_rows(curve_list)
    loads = np.concatenate([c.load_avg for c in curve_list]) if curve_list else np.array([])
    loads = loads[np.isfinite(loads)]
    env = env or {}
    section = {
        "name": name,
        "env_rows": env_rows,
        "env_rest": env_rest,
        "threads": ", ".join(str(t) for t in threads) or "not recorded",
        "dtypes": ", ".join(dtypes),
        "repeats": ", ".join(str(r) for r in repeats) or "not recorded",
        "memory_methods": ", ".join(methods) or "not recorded",
        "time_png": figures.data_uri(time_png),
        "memory_png": (figures.data_uri(figures.scaling_figure(panels, "memory"))
                       if has_memory else None),
        "roof_png": (figures.data_uri(figures.roofline_figure(panels, roof_lines))
                     if any(np.isfinite(c.gflops).any() for c in curve_list) else None),
        "roof_lines": [label for label, _, _ in roof_lines],
        "roofs": roofs,
        "exponents": exponents,
        "fit_points": "; ".join(sorted({cell["points"] for r in exponents
                                        for cell in r["cells"].values()})) or "none",
        "crossovers": _crossover_rows(curve_list),
        "tables": _point_tables(curve_list, roofs, name),
        "not_ok": not_ok,
        "backends": sorted({c.backend for c in curve_list if not c.peer}),
        "peers": sorted({c.backend for c in curve_list if c.peer}),
        "n_points": sum(len(c.n) for c in curve_list),
        "fastest": _fastest_lines(curve_list),
        "load": (f"{loads.min():.1f} to {loads.max():.1f}" if len(loads) else None),
        "busy": bool(len(loads) and env.get("cores_logical")
                     and loads.max() > env["cores_logical"]),
        "cores": env.get("cores_logical"),
        "check_failures": [f"{c.display} at n = {n}" for c in curve_list for n in c.check_failed],
        "unavailable": env.get("unavailable_backends") or {},
        "absent_peers": env.get("absent_peers") or {},
    }
    return section, readme_png


def _summary(sections, quality):
    """Plain sentences with the headline numbers, computed from the first machine's section."""
    out = []
    s = sections[0] if sections else None
    if s and s["exponents"]:
        parts = []
        for attention in ("softmax", "linear"):
            fits = [cell["slope"] for r in s["exponents"] if r["attention"] == attention
                    for cell in r["cells"].values() if cell["slope"] is not None]
            if fits:
                lo, hi = min(fits), max(fits)
                span = f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f} to {hi:.2f}"
                parts.append(f"{attention} {span} over {len(fits)} curves (expected about "
                             f"{EXPECTED_TIME_EXPONENT[attention]})")
        if parts:
            out.append(f"Fitted time exponents (n ≥ {analysis.FIT_MIN_N}, causal and not): "
                       + "; ".join(parts) + ".")
        rows = [r for r in s["crossovers"] if r["pair"].startswith("fastest fastattn")]
        if not rows:   # a single fastattn backend: its own pair
            rows = [r for r in s["crossovers"]
                    if not r["pair"].startswith("fastest") and "(peer)" not in r["pair"]]
        for causal in ("non-causal", "causal"):
            mine = [r for r in rows if r["causal"] == causal]
            if mine:
                out.append(f"Crossover ({causal}), where linear attention becomes faster: "
                           + "; ".join(f"{r['pair'].replace(': softmax vs linear', '')}: {r['text']}"
                                       for r in mine) + ".")
        if s["busy"]:
            out.append(f"The machine was busy while measuring (1-minute load average {s['load']} "
                       f"on {s['cores']} cores): times are inflated and noisy; compare the kernels "
                       f"side by side rather than with other runs.")
        for line in s["fastest"]:
            out.append(line)
    if quality is not None and quality.gaussian and quality.minilm:
        g, m = quality.gaussian, quality.minilm
        out.append(
            f"Linear attention's output against softmax's: mean cosine similarity "
            f"{min(r.cosine_similarity for r in g):.3f} to {max(r.cosine_similarity for r in g):.3f} "
            f"on Gaussian inputs, but {min(r.cosine_similarity for r in m):.3f} to "
            f"{max(r.cosine_similarity for r in m):.3f} per layer on real MiniLM activations.")
    return out


def _fastest_lines(curve_list):
    """For each mask: the fastest kernel of each type at the largest n measured by all."""
    lines = []
    for causal in (False, True):
        group = [c for c in curve_list if c.causal == causal]
        if not group:
            continue
        n = max(int(c.n[-1]) for c in group)
        parts = []
        for attention in ("softmax", "linear"):
            at_n = [(float(c.median_s[c.n == n][0]), c) for c in group
                    if c.attention == attention and (c.n == n).any()]
            if at_n:
                t, c = min(at_n, key=lambda tc: tc[0])
                parts.append(f"{attention}: {c.display.replace(' ' + attention, '')} {fmt_time(t)}")
        if parts:
            lines.append(f"Fastest at n = {n} ({_causal_title(causal)}): " + "; ".join(parts)
                         + " (median).")
    return lines


def _history_section(history, benchmark):
    if history is None:
        return None
    if not history:
        return {"benchmark": benchmark, "png": None, "rows": []}
    title = benchmark or "asv benchmark history"
    rows = sorted(history, key=lambda r: (str(r.get("benchmark")), str(r.get("machine")),
                                          str(r.get("params")), r.get("date") or ""))
    return {
        "benchmark": title,
        "png": figures.data_uri(figures.history_figure(history, title)),
        "rows": [{"benchmark": r.get("benchmark"), "machine": r.get("machine"),
                  "commit": str(r.get("commit") or "")[:8], "date": r.get("date"),
                  "params": _value_text(r.get("params") or {}),
                  "value": (fmt_time(r["value"]) if r.get("unit") == "seconds"
                            else fmt_bytes(r["value"]) if r.get("unit") == "bytes"
                            else fmt_num(r.get("value"))),
                  "unit": r.get("unit")} for r in rows],
    }


def _quality_section(quality):
    if quality is None:
        return None
    # The figures depend on the quality numbers only: rendered once per QualityResults.
    if not quality.rendered:
        quality.rendered.update(
            figure=figures.data_uri(figures.quality_figure(quality.gaussian, quality.minilm)),
            heatmaps=[{"title": h.title, "note": h.note,
                       "png": figures.data_uri(figures.heatmap_figure(h))}
                      for h in quality.heatmaps])
    return {"r": quality, **quality.rendered}


def _environment():
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(
            lambda name: (resources.files(__package__) / "templates" / name).read_text("utf-8")),
        autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(time=fmt_time, bytes=fmt_bytes, num=fmt_num)
    return env


def build_report(records, *, source="", quality=None, history=None, history_benchmark=None,
                 generated=None):
    """Build the HTML report from results records.

    Parameters
    ----------
    records : list of dict
        Records of the results format (:mod:`fastattn.bench.results`):
        environment, roof and point records.  Records carrying ``"machine"``
        (asv results) are grouped per machine; otherwise one machine.
    source : str
        Where the records came from (shown in the report).
    quality : QualityResults, optional
        From :func:`fastattn.report.quality.compute_quality`; the quality
        section is left out when None.
    history : list of dict, optional
        asv history rows (``load_asv_history``); adds a history section.
    history_benchmark : str, optional
        The benchmark the history is of (its title).
    generated : datetime, optional
        Timestamp printed in the report (default now, UTC).

    Returns
    -------
    Report

    Raises
    ------
    ValueError
        If ``records`` holds no environment, roof or point record at all.
    """
    environments, roofs, points = analysis.split_records(records)
    if not (environments or roofs or points):
        raise ValueError(f"{source or 'the records'} hold no fastattn environment, roof or point record")
    all_curves = analysis.curves(points)
    names = []
    for item in environments + points:
        if item.get("machine") not in names:
            names.append(item.get("machine"))
    if not names:
        names = [None]
    env_of = {}
    for env in environments:
        env_of.setdefault(env.get("machine"), env)   # first environment record of each machine
    sections, readme_png = [], None
    for name in names:
        section, png = _machine_section(name, env_of.get(name), roofs, points, all_curves)
        if name is None:
            section["name"] = "this machine"
        sections.append(section)
        readme_png = readme_png or png
    comparison_png = None
    if len(sections) > 1:
        panels = []
        for causal in (False, True):
            for name in names:
                panels.append((f"{name}: {_causal_title(causal)}",
                               _label_curves([c for c in all_curves
                                              if c.machine == name and c.causal == causal])))
        comparison_png = figures.data_uri(
            figures.scaling_figure(panels, "time", ncols=min(len(names), 3)))
    peers = sorted({p for s in sections for p in s["peers"]})
    generated = generated or _dt.datetime.now(_dt.timezone.utc)
    context = {
        "marker": REPORT_MARKER,
        "version": __version__,
        "generated": generated.strftime("%Y-%m-%d %H:%M UTC"),
        "source": source,
        "sections": sections,
        "comparison_png": comparison_png,
        "peers": peers,
        "peer_help": PEER_HELP,
        "summary": _summary(sections, quality),
        "quality": _quality_section(quality),
        "history": _history_section(history, history_benchmark),
        "fit_min_n": analysis.FIT_MIN_N,
        "from_asv": any(p.get("source") == "asv" for p in points),
        "n_records": len(records),
    }
    page = _environment().get_template("report.html.j2").render(**context)
    return Report(page, readme_png)
