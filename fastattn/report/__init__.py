"""HTML scaling reports built from results files.

* :func:`build_report` -- results records (and quality numbers) to one
  self-contained HTML page;
* :func:`compute_quality` -- the quality section: linear against softmax
  attention on Gaussian inputs and real MiniLM activations;
* :mod:`fastattn.report.analysis` -- exponent fits, crossover, roof lookup;
* ``fastattn report`` (:mod:`fastattn.report.cli`) -- measure, then build.

The names are imported on first use, so ``import fastattn.report.cli`` (every
``fastattn`` command) does not load matplotlib.
"""

__all__ = ["Report", "build_report", "compute_quality"]


def __getattr__(name):
    if name in ("Report", "build_report"):
        from . import build

        return getattr(build, name)
    if name == "compute_quality":
        from .quality import compute_quality

        return compute_quality
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
