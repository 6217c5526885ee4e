"""The memory part of a machine's Scaling block: peak extra bytes per call against n."""

import numpy as np

from ..bench.table import format_bytes, mask_name
from . import figures
from .scaling import joined


def falling(curve_list):
    """Per curve whose peak memory falls as n grows (below what the probe resolves), its drops."""
    out = []
    for c in curve_list:
        drops, top, top_n = [], -np.inf, None
        for n, peak in zip(c.n.tolist(), c.peak_bytes.tolist()):
            if not np.isfinite(peak):
                continue
            if peak < top:
                drops.append(f"{format_bytes(top)} at n = {top_n}, {format_bytes(peak)} at "
                             f"n = {n}")
            elif peak > top:
                top, top_n = peak, n
        if drops:
            out.append(f"{c.label} ({mask_name(c.causal)}): " + "; ".join(drops))
    return out


def section(m):
    """The memory block of machine ``m`` (:class:`~.analysis.Machine`)."""
    png, curve_list = figures.machine_figure(m, "memory"), m.scaling_curves
    return {"png": png, "methods": joined(meth for c in curve_list for meth in c.memory_method),
            "falling": falling(curve_list) if png else []}
