"""HTML reports from results files.  :mod:`.build` reads the records and calls the sections
in the page's order: per machine :mod:`.scaling` (with :mod:`.memory` and :mod:`.roof`),
:mod:`.generation` and :mod:`.environment`; for the page :mod:`.quality`, :mod:`.frontier`
and :mod:`.history`; each returns its finished object and figures, its partial in
``templates/`` fills them in.  :mod:`.analysis` holds what several sections read (curves,
fits, crossovers), :mod:`.figures` the shared drawing, :mod:`.asv_results` the adapter from
asv's results to fastattn's records; ``fastattn report`` is :mod:`.cli`.  Nothing is
imported here, so commands do not load matplotlib."""
