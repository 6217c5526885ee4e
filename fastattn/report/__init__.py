"""HTML reports from results files: :mod:`.build` calls one module per section (listed in
``build.ORDER``); :mod:`.analysis` holds what several read, :mod:`.figures` the shared drawing,
:mod:`.asv_results` the adapter from asv's results.  Nothing is imported here (no matplotlib)."""
