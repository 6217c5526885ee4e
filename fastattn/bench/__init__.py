"""Measurement: sweeps, timers, the memory probe and the roof probe."""
