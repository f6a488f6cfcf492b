"""Prompt lookup inside the DART tree: what the context repeats, beside what the head predicts.

Text often repeats its own context: code restates a signature or a variable name, an answer
quotes its question, a summary reuses the document's phrases. The draft head and the corpus
3-gram do not see that; prompt lookup (transformers' ``prompt_lookup_num_tokens``, the
"n-gram" drafter of vLLM and SGLang) does: it finds the latest earlier occurrence of the
context's last ``n`` tokens (``max_ngram`` down to ``min_ngram``) and proposes the tokens that
followed it. DART merges that path into its tree: the pruner keeps it and fills the rest of
the budget with the beam's best nodes (``lookup_path`` of :meth:`Pruner.prune`). The
proposal is a function of the context alone, so greedy output stays the target's own and
sampling stays lossless.

The index (Rust, ``dart_client._native.PromptLookup``) is incremental: each step adds only the
accepted tokens, and a proposal costs the same at any context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dart_client import _native
from dart_client.errors import InvalidArgumentError

PromptLookup = _native.PromptLookup

__all__ = ["PromptLookup", "PromptLookupConfig"]

#: The longest suffix the index matches (four 32-bit ids per key), from the Rust side.
MAX_NGRAM: int = _native.PROMPT_LOOKUP_MAX_NGRAM


@dataclass(frozen=True)
class PromptLookupConfig:
    """``max_tokens``: the longest path proposed (it also leaves at least one node of the
    budget to the beam); ``min_ngram``..``max_ngram``: the suffix lengths matched, longest
    first. The defaults were chosen on development prompts (Spec-Bench's questions and
    ShareGPT's training split), not on the benchmark's workloads."""

    max_tokens: int = 8
    min_ngram: int = 1
    max_ngram: int = 3

    def __post_init__(self) -> None:
        for name in ("max_tokens", "min_ngram", "max_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"prompt lookup {name} = {value!r}: expected an int")
        if self.max_tokens < 1:
            raise InvalidArgumentError(
                f"prompt lookup max_tokens = {self.max_tokens}: expected >= 1 (or no lookup)"
            )
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
            raise InvalidArgumentError(
                f"prompt lookup n-gram sizes {self.min_ngram}..{self.max_ngram}: expected "
                f"1 <= min_ngram <= max_ngram <= {MAX_NGRAM}"
            )

    def new_index(self) -> PromptLookup:
        return PromptLookup(self.min_ngram, self.max_ngram)

    def path_length(self, budget: int) -> int:
        """The longest path merged into a tree of ``budget`` nodes: one node stays the beam's."""
        return max(0, min(self.max_tokens, budget - 1))

    def path(self, index: PromptLookup, budget: int) -> npt.NDArray[np.int64] | None:
        """The path to merge into a tree of ``budget`` nodes (None when there is none)."""
        tokens = index.propose(self.path_length(budget))
        return np.asarray(tokens, dtype=np.int64) if tokens else None


def parse_prompt_lookup(value: int | PromptLookupConfig | None) -> PromptLookupConfig | None:
    """``DartModel``'s ``prompt_lookup``: a config, a max path length (0 = off), or None."""
    if value is None or isinstance(value, PromptLookupConfig):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(
            f"prompt_lookup = {value!r}: expected a PromptLookupConfig, a path length >= 0 "
            "(0 = off) or None"
        )
    return PromptLookupConfig(max_tokens=int(value)) if value else None
