"""Measurement: one engine (:mod:`.engine`) behind ``fastattn bench``, ``fastattn report``
and the asv suite; the one schema of a point, its grids and the environment record
(:mod:`.schema`); the grid and worker processes (:mod:`.sweep`), the results file
(:mod:`.results`), flop counts (:mod:`.flops`), peers, one record each (:mod:`.peers`), the
machine (:mod:`.environment`) and units, tables, CSV and summary (:mod:`.table`)."""
