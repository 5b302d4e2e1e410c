"""Micro-benchmarks, run by hand (`python -m MaxText.benchmarks.<name>`); never part of the test suite."""
