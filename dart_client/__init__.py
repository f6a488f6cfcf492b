"""DART: lossless speculative decoding with a parallel draft head and an n-gram-guided tree."""

from dart_client._native import __version__
from dart_client.dart_model import DartModel, ar_generate, dart_generate
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.loop import GenerationResult, GenerationStream
from dart_client.templates import TEMPLATE_REGISTRY

__all__ = [
    "TEMPLATE_REGISTRY",
    "DartModel",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStream",
    "__version__",
    "ar_generate",
    "dart_generate",
]
