"""The n-gram model: exact backoff probabilities, counts and top continuations.

``NGram`` maps a ``.ngram`` file (written by ``dart-ngram build``/``merge``/``import-dart``),
checks it (header and every section checksum by default) and answers queries in place; the work
runs in Rust with the GIL released. Probabilities follow the reference's semantics: for a
candidate ``c`` after a context, the context is its last ``order - 1`` tokens; the longest
suffix ``s`` of it such that ``s + c`` was seen gives ``count(s + c) / count(s)`` and ``matched
= len(s)``; if none, ``p = 0`` and ``matched = 0``.
No unigram level, no smoothing.

Errors are ``NGramError`` (a ``ValueError``) or one of its subclasses:
``CorruptModelError`` (not a model, wrong version, truncated, failed check),
``TokenizerMismatchError`` and ``TokenOutOfVocabError``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from dart_client import _native
from dart_client._native import (
    CorruptModelError,
    NGramError,
    TokenizerMismatchError,
    TokenOutOfVocabError,
)
from dart_client.ngram import inputs

__all__ = [
    "CorruptModelError",
    "NGram",
    "NGramError",
    "TokenOutOfVocabError",
    "TokenizerMismatchError",
]

IdsLike = Sequence[int] | npt.NDArray[np.integer[Any]]


def _ids(x: IdsLike | Any, ndim: int, what: str) -> npt.NDArray[np.int64]:
    return inputs.ids(x, ndim, what, NGramError, TokenOutOfVocabError)


class NGram(_native.NGram):
    """A mapped n-gram model. Open with :meth:`NGram.open`; thread-safe, shareable."""

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        verify: bool = False,
        populate: bool = False,
        lock: bool = False,
        huge_pages: bool = False,
        in_memory: bool = False,
        checksums: bool = True,
        random_access: bool = False,
        prefetch: bool = False,
    ) -> NGram:
        """Maps a model file and checks it: header, section table and every section's
        checksum (one read of the file; ``checksums=False`` checks only the header, the section
        table and the small sections every query reads, for models too large to read at open).

        ``verify`` also checks every invariant (a full scan);
        ``populate`` reads it into the page cache now; ``lock`` pins it in RAM (mlock);
        ``huge_pages`` advises transparent huge pages; ``in_memory`` copies the file into
        anonymous memory on huge pages instead of mapping it (RAM for the whole model; random
        lookups then rarely miss the TLB, which makes a prune faster when caches are cold);
        ``random_access`` advises the kernel that page faults should read only their page
        (``MADV_RANDOM``), for models much larger than RAM or queried cold; ``prefetch``
        starts reading the file into the page cache in the background and returns at once
        (the non-blocking ``populate``: queries wait on the disk only until it reaches their
        pages).
        """
        return cls(
            os.fspath(path),
            verify=verify,
            populate=populate,
            lock=lock,
            huge_pages=huge_pages,
            in_memory=in_memory,
            checksums=checksums,
            random_access=random_access,
            prefetch=prefetch,
        )

    def prob(
        self, context: IdsLike, candidates: IdsLike
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8]]:
        """``P(c | context)`` for each candidate, and the matched context length (0..order-1)."""
        return super().prob(_ids(context, 1, "context"), _ids(candidates, 1, "candidates"))

    def prob_batch(
        self, contexts: IdsLike, candidates: IdsLike
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8]]:
        """Row ``i`` of the (B, C) results scores ``candidates[i]`` after ``contexts[i]``.

        ``contexts`` is (B, T) (each row one whole context; only its last ``order - 1``
        tokens are used), ``candidates`` is (B, C). Rows run in parallel.
        """
        return super().prob_batch(_ids(contexts, 2, "contexts"), _ids(candidates, 2, "candidates"))

    def count(self, tokens: IdsLike) -> int:
        """Raw count of an n-gram of at most ``order`` tokens; ``count([])`` = total tokens."""
        return int(super().count(_ids(tokens, 1, "tokens")))

    def top_k(
        self, context: IdsLike, k: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """The ``k`` most probable next tokens (best first, ties by id), exact under the same
        backoff as :meth:`prob`. Tokens of probability 0 are left out, so fewer may return."""
        return super().top_k(_ids(context, 1, "context"), _check_k(k))

    def top_k_batch(
        self, contexts: IdsLike, k: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """:meth:`top_k` for each row of (B, T) ``contexts``: (B, k) ids padded with -1 and
        (B, k) probabilities padded with 0."""
        return super().top_k_batch(_ids(contexts, 2, "contexts"), _check_k(k))

    def info(self) -> dict[str, Any]:
        """Order, vocabulary, fingerprint, totals, n-grams per order, size, sections."""
        return dict(super().info())

    def check_fingerprint(self, expected_hex: str) -> None:
        """Raises ``TokenizerMismatchError`` unless the model was built with that tokenizer."""
        super().check_fingerprint(expected_hex)

    def verify(self) -> None:
        """Checks every section checksum and structural invariant (reads the whole file)."""
        super().verify()

    @staticmethod
    def merge(
        inputs: Sequence[str | os.PathLike[str]],
        output: str | os.PathLike[str],
        *,
        min_count: int = 1,
        allow_pruned: bool = False,
        top_list_len: int = 32,
    ) -> dict[str, Any]:
        """Adds models built from disjoint shards (same order, vocabulary, tokenizer, EOS)
        into ``output``, written atomically. Pruned inputs are refused unless
        ``allow_pruned``; ``min_count`` prunes the output."""
        return dict(
            _native.NGram.merge(
                [os.fspath(p) for p in inputs],
                os.fspath(output),
                min_count=min_count,
                allow_pruned=allow_pruned,
                top_list_len=top_list_len,
            )
        )

    @staticmethod
    def write_counts(
        path: str | os.PathLike[str],
        counts: dict[tuple[int, ...], int],
        *,
        order: int,
        vocab_size: int,
        eos_id: int | None = None,
        total_tokens: int | None = None,
        documents: int = 0,
        min_count: int = 1,
        fingerprint: str | None = None,
        top_list_len: int = 32,
        source: str | None = None,
    ) -> dict[str, Any]:
        """Writes a model from explicit counts (token tuples of orders 1..``order`` -> count),
        atomically. The counts must be prefix-closed and consistent (an n-gram never counted
        more than its prefix); ``total_tokens`` defaults to the sum of the unigram counts."""
        return dict(
            _native.NGram.write_counts(
                os.fspath(path),
                {tuple(int(t) for t in g): int(c) for g, c in counts.items()},
                order=order,
                vocab_size=vocab_size,
                eos_id=eos_id,
                total_tokens=total_tokens,
                documents=documents,
                min_count=min_count,
                fingerprint=fingerprint,
                top_list_len=top_list_len,
                source=source,
            )
        )


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise NGramError(f"k must be a non-negative integer, got {k!r}")
    return int(k)
