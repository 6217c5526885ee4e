"""The HTML report: read the records, call each section, fill the template.  A section is one
module (``section(...)``: its finished object and figures, or None; ``NAV``: its link) and one
partial ``templates/_<name>.html.j2``, named in :data:`ORDER`.  Nothing here computes or draws."""

import datetime as _dt
from dataclasses import dataclass

import jinja2

from .. import __version__
from ..bench.engine import MAX_PROBE_N, PEAK_PROBE_N
from ..bench.table import format_number, format_seconds, mask_name
from . import (analysis, environment, frontier, generation, history, memory, model, quality, roof,
               scaling)

#: Written into every report: an existing file at the output path is replaced only if it has it.
REPORT_MARKER = '<meta name="generator" content="fastattn report">'

#: Sections of each machine (``section(machine)``: ``s.<name>`` in the templates).
MACHINE_SECTIONS = {"scaling": scaling, "memory": memory, "roof": roof,
                    "generation": generation, "environment": environment}
#: Sections of the page (``section(page)``: ``<name>`` in the templates).
PAGE_SECTIONS = {"quality": quality, "frontier": frontier, "model": model, "history": history}
#: The page's order of the top-level sections (memory and roof sit inside scaling).
ORDER = ("scaling", "generation", "quality", "frontier", "model", "environment", "history")


@dataclass
class Page:
    """What a section of the page reads: every machine's curves, quality, the whole-model
    study and asv history."""

    curves: list
    quality: object = None
    history: list = None
    history_benchmark: str = None
    model: object = None


@dataclass
class Report:
    """The self-contained ``html`` and the first machine's ``scaling_png`` (for the README)."""

    html: str
    scaling_png: bytes | None


def _input_shapes(points):
    """The inputs' batch and heads: "batch 1, one head", or "batch × heads 1 × 1, 1 × 2"."""
    pairs = sorted({(p.get("batch") or 1, p.get("heads") or 1) for p in points})
    if pairs in ([], [(1, 1)]):
        return "batch 1, one head"
    return "batch × heads " + ", ".join(f"{b} × {h}" for b, h in pairs)


def _template():
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=format_number, mask=mask_name, kl=frontier.kl_text,
                       seconds=format_seconds)
    return env.get_template("report.html.j2")


def build_report(records, *, source="", quality=None, history=None, history_benchmark=None,
                 model=None, generated=None):
    """The :class:`Report` of results ``records`` (a results file's or
    :func:`~.asv_results.load_asv_points`', grouped by ``machine``) from ``source`` (for the
    header); ``quality`` (:class:`fastattn.map_quality.QualityResults`) adds the Quality and
    Feature maps sections, ``history`` (``load_asv_history`` rows of ``history_benchmark``)
    the asv history, ``model`` (a ``ModelStudy``, or why there is none) the whole-model
    study; ``generated`` (default now) dates the page.  ValueError: no record of a known type.
    """
    environments, roofs, points = analysis.split_records(records)
    if not (environments or roofs or points):
        raise ValueError(f"{source or 'the records'} hold no fastattn environment, roof or "
                         "point record")
    all_curves = analysis.curves(points, roofs)
    names = list(dict.fromkeys(item.get("machine") for item in environments + points)) or [None]
    env_of = {env.get("machine"): env for env in environments}  # the last: the latest run
    machines = [analysis.Machine(name, env_of.get(name) or {}, roofs,
                                 [p for p in points if p.get("machine") == name],
                                 [c for c in all_curves if c.machine == name]) for name in names]
    sections = [{"name": m.name or "this machine",
                 **{key: module.section(m) for key, module in MACHINE_SECTIONS.items()}}
                for m in machines]
    page = Page(all_curves, quality, history, history_benchmark, model)
    parts = {key: module.section(page) for key, module in PAGE_SECTIONS.items()}
    nav = [(key, module.NAV) for key in ORDER
           for module in [MACHINE_SECTIONS.get(key) or PAGE_SECTIONS[key]]
           if parts.get(key) or any(s.get(key) for s in sections)]
    summary = [line for key in ORDER for line in (
        (sections[0].get(key) or parts.get(key) or {}).get("summary", []))]
    html = _template().render(
        marker=REPORT_MARKER, version=__version__, source=source, sections=sections,
        generated=(generated or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC"),
        comparison_png=scaling.side_by_side(sections), summary=summary, order=ORDER, nav=nav,
        **parts,
        fit_min_n=analysis.FIT_MIN_N, max_probe_n=MAX_PROBE_N, peak_probe_n=PEAK_PROBE_N,
        from_asv=any(p.get("source") == "asv" for p in points), n_records=len(records),
        input_shapes=_input_shapes(points))
    return Report(html, sections[0]["scaling"]["readme_png"])
