"""Benchmarks of DART components, each runnable as ``python -m dart_client.apps.bench.NAME``."""
