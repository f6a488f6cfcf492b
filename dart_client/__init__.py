"""DART: lossless speculative decoding with a parallel draft head and an n-gram-guided tree.

The public names below load on first use (PEP 562), so importing a submodule such as the
command line (``dart --help``) does not import torch or transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dart_client._native import __version__

if TYPE_CHECKING:
    from dart_client.dart_model import DartModel, ar_generate, dart_generate
    from dart_client.decoding.config import GenerationConfig
    from dart_client.decoding.loop import GenerationResult, GenerationStream, PrefixCache
    from dart_client.templates import TEMPLATE_REGISTRY

#: public name -> the module that defines it.
_LAZY = {
    "DartModel": "dart_client.dart_model",
    "ar_generate": "dart_client.dart_model",
    "dart_generate": "dart_client.dart_model",
    "GenerationConfig": "dart_client.decoding.config",
    "GenerationResult": "dart_client.decoding.loop",
    "GenerationStream": "dart_client.decoding.loop",
    "PrefixCache": "dart_client.decoding.loop",
    "TEMPLATE_REGISTRY": "dart_client.templates",
}

__all__ = [
    "TEMPLATE_REGISTRY",
    "DartModel",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStream",
    "PrefixCache",
    "__version__",
    "ar_generate",
    "dart_generate",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dart_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
