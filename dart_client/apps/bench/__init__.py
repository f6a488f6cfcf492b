"""Benchmarks of DART components, each runnable as ``python -m dart_client.apps.bench.NAME``."""

#: The methods ``dart-bench`` compares (``ar`` is every speedup's baseline). Here, not in the
#: harness, so that the command line lists them without importing torch.
METHODS = (
    "ar",
    "hf",
    "pld",
    "dart",
    "dart-no-ngram",
    "dart-no-lookup",
    "dart-remote",
    "eagle3",
    "eagle3-auto",
)
