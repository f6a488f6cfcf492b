"""Building n-gram models from Python: corpus counting, reference-trie import, fingerprints.

Thin typed wrappers over the Rust builder (``dart_client._native``). Every long call runs
without the GIL on a Rust thread; Ctrl-C (``KeyboardInterrupt``) cancels it, removes its
temporary files and leaves no output file behind. Errors are
:class:`dart_client.ngram.NGramError` (a ``ValueError``) with a message naming the file, the
value and what was expected.

Example::

    from dart_client.ngram.build import build
    report = build(["corpus.jsonl"], "model.ngram", tokenizer="tokenizer.json")
    print(report["tokens"], report["tokens_per_second"])
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from dart_client import _native

StrPath = str | os.PathLike[str]

__all__ = [
    "build",
    "hf_tokenizer_fingerprint",
    "import_dart",
    "parse_memory",
    "tokenizer_fingerprint",
    "tokenizer_json_fingerprint",
    "vocab_fingerprint",
    "write_reference_trie",
]


def build(
    inputs: Sequence[StrPath] | StrPath,
    output: StrPath,
    *,
    tokenizer: StrPath | None = None,
    order: int = 3,
    memory: str | int = "2G",
    threads: int | None = None,
    min_count: int = 1,
    text_field: str = "text",
    eos_id: int | None = None,
    eos_token: str | None = None,
    no_eos: bool = False,
    vocab_size: int | None = None,
    tmp_dir: StrPath | None = None,
    skip_bad_lines: bool = False,
    allow_empty: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Counts the 1..``order``-grams of a corpus into a model file.

    Args:
        inputs: files or directories (walked recursively, sorted): ``.jsonl``/``.json``
            lines with a text field or an ``ids`` field, plain text files (one document per
            file), any of them ``.gz``.
        output: the model file, written atomically.
        tokenizer: a Hugging Face ``tokenizer.json`` (or its directory); needed for text.
        order: highest n-gram order.
        memory: budget for the counts, bytes or a size like ``"2G"``; beyond it sorted runs
            spill to ``tmp_dir`` (default: beside the output) and are merged.
        threads: tokenizer threads (default: all cores).
        min_count: drop n-grams of order >= 2 seen fewer times (unigrams are kept).
        text_field: the JSON field holding a document's text.
        eos_id, eos_token, no_eos: the end-of-document token appended to every document
            (default: ``eos_token`` of the ``tokenizer_config.json`` beside the tokenizer).
        vocab_size: vocabulary size (default: the tokenizer's highest id + 1).
        skip_bad_lines: count malformed lines instead of failing on the first.
        allow_empty: write a model even when no document was counted (otherwise an error).
        progress: draw a progress bar on stderr (when it is a terminal).

    Returns:
        The build report: documents, tokens, ngrams_per_order, spilled_runs, seconds,
        tokens_per_second, output_bytes, tokenizer_fingerprint, ...
    """
    paths = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)
    return _native.build(
        [os.fspath(p) for p in paths],
        os.fspath(output),
        tokenizer=None if tokenizer is None else os.fspath(tokenizer),
        order=order,
        memory=memory,
        threads=threads,
        min_count=min_count,
        text_field=text_field,
        eos_id=eos_id,
        eos_token=eos_token,
        no_eos=no_eos,
        vocab_size=vocab_size,
        tmp_dir=None if tmp_dir is None else os.fspath(tmp_dir),
        skip_bad_lines=skip_bad_lines,
        allow_empty=allow_empty,
        progress=progress,
    )


def import_dart(
    trie: StrPath,
    output: StrPath,
    *,
    vocab_size: int | None = None,
    tokenizer: StrPath | None = None,
    eos_id: int | None = None,
    memory: str | int = "2G",
    tmp_dir: StrPath | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Converts the reference implementation's ``.trie`` file into a model.

    Memory stays within ``memory`` plus a small constant whatever the file size: node
    records go to a temporary mapped file and n-grams through an external sort. Every field
    is validated; a wrapped (negative) i32 count raises an error naming the node.

    Returns:
        The import report: nodes, order, vocab_size, total_tokens, ngrams_per_order, ...
    """
    return _native.import_dart(
        os.fspath(trie),
        os.fspath(output),
        vocab_size=vocab_size,
        tokenizer=None if tokenizer is None else os.fspath(tokenizer),
        eos_id=eos_id,
        memory=memory,
        tmp_dir=None if tmp_dir is None else os.fspath(tmp_dir),
        progress=progress,
    )


def write_reference_trie(
    path: StrPath,
    counts: Mapping[tuple[int, ...], int],
    total_tokens: int,
    order: int,
    *,
    shuffle_seed: int | None = None,
) -> None:
    """Writes a small file in the reference's ``.trie`` format (for tests of the importer).

    ``counts`` maps every n-gram of orders 1..``order`` (a prefix-closed set) to its count;
    ``shuffle_seed`` scatters node ids and child lists as a real file may.
    """
    _native.write_reference_trie(
        os.fspath(path), dict(counts), total_tokens, order, shuffle_seed=shuffle_seed
    )


def parse_memory(size: str) -> int:
    """Bytes in a size string such as ``"2G"``, ``"512M"`` or ``"1.5GiB"`` (binary units)."""
    return _native.parse_memory(size)


def tokenizer_fingerprint(tokens_by_id: Sequence[str]) -> str:
    """The model-header fingerprint (hex) of a vocabulary given as token strings by id."""
    return _native.tokenizer_fingerprint(list(tokens_by_id))


def tokenizer_json_fingerprint(path: StrPath) -> str:
    """The fingerprint (hex) of a ``tokenizer.json`` (or a directory holding one)."""
    return _native.tokenizer_json_fingerprint(os.fspath(path))


def vocab_fingerprint(vocab: Mapping[str, int] | Iterable[tuple[str, int]]) -> str:
    """The fingerprint (hex) of a ``token -> id`` vocabulary, in pure Python.

    SHA-256 over, for each id ``0..max id`` in order, the token's UTF-8 length (u32
    little-endian) and bytes; ids without a token count as empty strings. Equal to the
    fingerprint the Rust builder stores.
    """
    pairs = vocab.items() if isinstance(vocab, Mapping) else vocab
    by_id: dict[int, str] = {}
    for token, idx in pairs:
        if idx < 0:
            raise ValueError(f"token {token!r} has id {idx}; expected ids >= 0")
        prev = by_id.setdefault(idx, token)
        if prev != token:
            raise ValueError(f"vocabulary maps both {prev!r} and {token!r} to id {idx}")
    h = hashlib.sha256()
    for i in range(max(by_id, default=-1) + 1):
        b = by_id.get(i, "").encode("utf-8")
        h.update(struct.pack("<I", len(b)))
        h.update(b)
    return h.hexdigest()


class _HasVocab(Protocol):
    def get_vocab(self) -> dict[str, int]: ...


def hf_tokenizer_fingerprint(tokenizer: _HasVocab) -> str:
    """The fingerprint (hex) of a transformers tokenizer (its vocabulary incl. added tokens).

    Compare with ``NGram.fingerprint`` to check that a model was built with this tokenizer.
    """
    return vocab_fingerprint(tokenizer.get_vocab())
