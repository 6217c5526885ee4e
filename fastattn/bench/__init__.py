"""Measurement: one engine (:mod:`.engine`) behind ``fastattn bench``, ``fastattn report``
and the asv suite; the grid and worker processes (:mod:`.sweep`), the results format
(:mod:`.results`), flop counts (:mod:`.flops`), peers (:mod:`.peers`), the machine
(:mod:`.environment`) and units, tables, CSV and summary (:mod:`.table`)."""

