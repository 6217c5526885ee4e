"""asv benchmarks of fastattn (see asv.conf.json and docs/asv.md)."""
