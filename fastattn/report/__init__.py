"""HTML scaling reports built from results files.

* :func:`build_report` (:mod:`~fastattn.report.build`) -- records (and quality
  numbers) to one self-contained HTML page; :mod:`~fastattn.report.analysis`
  -- curves, exponent fits, crossovers; :mod:`~fastattn.report.figures` -- the
  PNGs; :mod:`~fastattn.report.quality` -- linear against softmax attention;
  :mod:`~fastattn.report.asv_results` -- asv results as records;
* ``fastattn report`` (:mod:`fastattn.report.cli`) -- measure, then build.

Nothing is imported here, so ``fastattn`` commands do not load matplotlib.
"""
