"""DART: lossless speculative decoding with a parallel draft head and an n-gram-guided tree."""

from dart_client._native import __version__

__all__ = ["__version__"]
