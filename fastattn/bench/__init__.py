"""Measurement: sweeps, timers, the memory probe and the roof probe.

* :mod:`~fastattn.bench.sweep` -- :class:`~fastattn.bench.sweep.Point`,
  :func:`~fastattn.bench.sweep.default_grid`,
  :func:`~fastattn.bench.sweep.run_sweep` (what ``fastattn bench`` and
  ``fastattn report`` run);
* :mod:`~fastattn.bench.results` -- the JSON-lines results format;
* :mod:`~fastattn.bench.timers` -- median of repeats after a warm-up;
* :mod:`~fastattn.bench.memory` -- peak extra bytes of one call (VmHWM reset,
  tracemalloc);
* :mod:`~fastattn.bench.roof` -- GEMM GFLOP/s and exp throughput of this machine;
* :mod:`~fastattn.bench.flops` -- the one flop-count formula;
* :mod:`~fastattn.bench.peers` -- PyTorch's attention as a peer, when installed;
* :mod:`~fastattn.bench.environment` -- CPU, BLAS, threads, versions;
* :mod:`~fastattn.bench.table` -- text tables, CSV and JSON summary.
"""
