"""Measurement: the engine behind ``fastattn bench``, ``fastattn report`` and the asv suite,
its schema, sweep, results file, flops, peers, machine record and tables."""
