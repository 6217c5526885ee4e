"""The memory part of a machine's Scaling block: peak extra bytes per call against n."""

import numpy as np

from . import figures
from .scaling import joined


def section(m):
    """The memory block of machine ``m`` (:class:`~.analysis.Machine`): the figure (None when
    no point recorded memory) and the probes' methods."""
    curve_list = m.scaling_curves
    drawn = any(np.isfinite(c.peak_bytes).any() for c in curve_list)
    return {"png": figures.data_uri(figures.scaling_figure(m.panels, "memory")) if drawn else None,
            "methods": joined(meth for c in curve_list for meth in c.memory_method)}
