"""One generation's settings, validated once: :class:`GenerationConfig`.

The names are the ones transformers users know (``max_new_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop``, ``seed``) plus DART's ``tree_budget`` and ``prompt_lookup``.
The CLI, the bench and the UI build a config; ``DartModel.generate`` takes one (or keyword
overrides of one) and hands it, with ``tree_budget`` resolved, to the generation loop.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dart_client.decoding.logprobs import check_logprobs
from dart_client.decoding.lookup import PromptLookupConfig, parse_prompt_lookup
from dart_client.decoding.sampling import SamplingParams
from dart_client.errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "DEPRECATED_NAMES",
    "GenerationConfig",
    "config_from",
    "parse_static",
    "parse_tree_budget",
    "resolve_tree_budget",
]

#: Old keyword names of ``dart_generate``/``ar_generate`` -> the config's field.
DEPRECATED_NAMES = {"max_new_token_num": "max_new_tokens"}

#: ``prompt_lookup``'s "not set for this call: the model's setting".
_MODEL_DEFAULT: Any = None


@dataclass(frozen=True)
class GenerationConfig:
    """Settings of one generation.

    - ``max_new_tokens``: new tokens at most (>= 1);
    - ``max_length``: prompt + new tokens at most (>= 2; the KV caches never exceed it; the
      target's ``max_position_embeddings`` caps it);
    - ``temperature``/``top_p``/``top_k``: ``temperature == 0`` is greedy; otherwise lossless
      sampling with transformers' warpers (``top_k == 0``: off);
    - ``stop``: a string or strings ending the output (cut before them);
    - ``seed``: the sampling generator's seed (None: nondeterministic);
    - ``tree_budget``: draft-tree nodes (an int >= 0, ``"auto"`` for the budget
      ``DartModel.tune()`` measures fastest, None for the model's default; see
      :func:`resolve_tree_budget`);
    - ``prompt_lookup``: None for the model's setting, else a path length (0: off) or a
      :class:`~dart_client.decoding.lookup.PromptLookupConfig` for this call;
    - ``static``: verify through fixed-shape buffers with device-side greedy acceptance
      and, on cuda, CUDA graphs (:mod:`dart_client.decoding.static`); ``"auto"``: on cuda
      only. The outputs are the same either way (up to floating-point rounding);
    - ``logprobs``: None, or report each new token's log probability under the target's raw
      distribution with that many likeliest alternatives (0..20;
      :mod:`dart_client.decoding.logprobs`): ``GenerationResult.logprobs``;
    - ``ignore_eos``: generate past end-of-sequence tokens (as vLLM's ``ignore_eos``: fixed
      output lengths for benchmarks); only ``max_new_tokens``, ``max_length``, stop strings
      and ``stop_token_ids`` end the output;
    - ``stop_token_ids``: more tokens that end the output as end-of-sequence does (kept as
      its last token; vLLM's ``stop_token_ids``), with or without ``ignore_eos``;
    - ``min_tokens``: new tokens before EOS or a ``stop_token_ids`` token may come (vLLM's
      ``min_tokens``; <= ``max_new_tokens``): until then those tokens have probability 0 in
      the target's distribution that greedy picks from and sampling keeps (stop strings
      still end the output where they appear).
    """

    max_new_tokens: int = 512
    max_length: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    tree_budget: int | str | None = None
    prompt_lookup: int | PromptLookupConfig | None = _MODEL_DEFAULT
    static: bool | str = "auto"
    logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _check_int("max_length", self.max_length, minimum=2)
        self.sampling  # noqa: B018  (validates temperature, top_p, top_k)
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        object.__setattr__(self, "tree_budget", parse_tree_budget(self.tree_budget))
        if self.prompt_lookup is not None:
            parse_prompt_lookup(self.prompt_lookup)
        object.__setattr__(self, "static", parse_static(self.static))
        object.__setattr__(self, "logprobs", check_logprobs(self.logprobs))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidTypeError(
                f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}"
            )
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_new_tokens:
            raise InvalidArgumentError(
                f"min_tokens = {self.min_tokens} is more than max_new_tokens = "
                f"{self.max_new_tokens}"
            )

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with ``changes`` (validated again; deprecated names accepted)."""
        return dataclasses.replace(self, **_renamed(changes))

    def for_prompt(self, prompt_tokens: int) -> GenerationConfig:
        """This config with ``max_length`` just large enough for a prompt of that many tokens
        (caches sized to the request, as the bench and the UI want)."""
        return self.replace(max_length=prompt_tokens + self.max_new_tokens + 1)


def config_from(
    config: GenerationConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any]
) -> GenerationConfig:
    """``config`` (default: ``GenerationConfig()``) with keyword ``overrides``; unknown names
    are an error naming them, renamed ones warn (:data:`DEPRECATED_NAMES`)."""
    if config is None:
        config = GenerationConfig()
    elif isinstance(config, Mapping):
        config = GenerationConfig(**_renamed(dict(config)))
    elif not isinstance(config, GenerationConfig):
        raise InvalidTypeError(
            f"config must be a GenerationConfig or a dict, got {type(config).__name__}"
        )
    if not overrides:
        return config
    return config.replace(**overrides)


def _renamed(kwargs: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(GenerationConfig)}
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        new = DEPRECATED_NAMES.get(name)
        if new is not None:
            warnings.warn(f"{name}= is deprecated; use {new}=", DeprecationWarning, stacklevel=4)
            if new in kwargs:
                raise InvalidArgumentError(f"give {new}= or {name}=, not both")
            name = new
        if name not in known:
            raise InvalidArgumentError(
                f"unknown generation setting {name!r}; expected one of {sorted(known)}"
            )
        out[name] = value
    return out


def parse_tree_budget(value: str | int | None) -> int | str | None:
    """A tree budget as given (a command-line string too): an int >= 0, ``"auto"`` or None."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgumentError(f"tree_budget = {value!r}; expected an int >= 0 or 'auto'")
        return int(value)
    if not isinstance(value, str):
        raise InvalidTypeError(
            f"tree_budget = {value!r}; expected an int >= 0, 'auto' or None, got "
            f"{type(value).__name__}"
        )
    text = value.strip().lower()
    if text == "auto":
        return "auto"
    try:
        budget = int(text)
    except ValueError:
        raise InvalidArgumentError(
            f"tree budget {value!r}: expected an integer >= 0 or 'auto'"
        ) from None
    if budget < 0:
        raise InvalidArgumentError(f"tree budget {value!r}: expected an integer >= 0 or 'auto'")
    return budget


def parse_static(value: bool | str) -> bool | str:
    """``static`` as given (a command-line string too): True, False or ``"auto"``."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, str) else None
    choices = {"auto": "auto", "on": True, "true": True, "off": False, "false": False}
    if text not in choices:
        raise InvalidArgumentError(
            f"static = {value!r}; expected True, False or 'auto' ('on'/'off' as text)"
        )
    return choices[text]


def resolve_tree_budget(
    call: int | str | None, model: int | str | None, pruner_max_nodes: int | None
) -> int | None:
    """The draft tree's node budget: the call's, else the model's, else the pruner
    configuration's ``max_nodes`` (None: the tree builder's own limit). ``"auto"`` must have
    been resolved to the tuned int first (``DartModel.tune()``). The generation loop caps the
    result by the room left (``max_new_tokens``, ``max_length``); it never raises it."""
    for value in (call, model, pruner_max_nodes):
        budget = parse_tree_budget(value)
        if budget == "auto":
            raise InvalidArgumentError(
                "tree_budget 'auto' is resolved by DartModel.tune() before generation"
            )
        if budget is not None:
            return int(budget)
    return None


def _normalise_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise InvalidTypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(not s for s in stop):
        raise InvalidArgumentError("stop strings must be non-empty")
    return tuple(stop)


def _token_ids(ids: Any) -> tuple[int, ...]:
    """``stop_token_ids`` as a tuple of ints >= 0 (the vocabulary bound is the target's,
    checked where it is known)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidTypeError(f"stop_token_ids must be a list of ints, got {ids!r}")
    for t in ids:
        _check_int("a stop token id", t, minimum=0)
    return tuple(int(t) for t in ids)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
