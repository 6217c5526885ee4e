"""Measurement: one engine behind ``fastattn bench``, ``fastattn report`` and the asv suite.

* :mod:`~fastattn.bench.engine` -- inputs, the call, timing, memory, roof, check;
* :mod:`~fastattn.bench.sweep` -- :class:`~fastattn.bench.sweep.Point`, the grid,
  :func:`~fastattn.bench.sweep.run_sweep` (worker processes, resume);
* :mod:`~fastattn.bench.results` -- the JSON-lines results format, checked on reading;
* :mod:`~fastattn.bench.flops` -- the one flop-count formula;
* :mod:`~fastattn.bench.peers` -- PyTorch (and other peers) when installed;
* :mod:`~fastattn.bench.environment` -- CPU, BLAS, threads, versions;
* :mod:`~fastattn.bench.table` -- units, text tables, CSV and JSON summary.
"""
