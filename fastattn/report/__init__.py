"""HTML reports from results files: records -> :mod:`.analysis` -> :mod:`.figures` ->
page (:mod:`.build`); :mod:`.quality`, :mod:`.asv_results`; ``fastattn report``
(:mod:`.cli`).  Nothing is imported here, so commands do not load matplotlib."""

