"""Benchmarks of the pass, run from the repository root as modules: ``python -m benchmarks.NAME``."""
