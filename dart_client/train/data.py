"""Tokenised training sequences with loss masks on the assistant's tokens.

Conversations (any format :func:`dart_client.data.prompt_response.read_conversations` reads)
are rendered with the target's chat template, tokenised once, cut into windows of at most
``max_length`` tokens, and stored as one ``.npz`` (flat ids + offsets + mask) so every epoch
and every process reads the same bytes. ``loss_mask[i]`` is true when token ``i`` belongs to
an assistant turn: only those tokens are ever targets of the head.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dart_client.data.conversations import Conversation, ReadReport, is_held_out
from dart_client.data.prompt_response import read_conversations
from dart_client.errors import DartError


class TrainingDataError(DartError):
    """Training data that cannot be used as asked (empty, wrong shapes, corrupt cache)."""


@dataclass
class TokenizeReport:
    conversations: int = 0
    windows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        parts = [
            f"{self.conversations} conversations -> {self.windows} windows, "
            f"{self.tokens} tokens ({self.loss_tokens} in assistant turns)"
        ]
        parts += [f"{n} skipped ({why})" for why, n in sorted(self.skipped.items())]
        return ", ".join(parts)


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def assistant_char_spans(
    conversation: Conversation, tokenizer: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its assistant turns.

    A turn's span runs from the end of the rendered history plus generation prompt to the end
    of the history including the turn (its end-of-turn token included, trailing whitespace
    excluded). Raises :class:`TrainingDataError` when the template is not prefix-consistent,
    since the spans would then be wrong.
    """
    messages = conversation.messages()
    text = _render(tokenizer, messages, False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True) if i > 0 else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(prefix) and text.startswith(upto)):
            raise TrainingDataError(
                f"conversation {conversation.id}: the chat template renders turn {i} "
                "differently inside a longer history; cannot locate assistant tokens"
            )
        end = len(upto)
        while end > len(prefix) and upto[end - 1].isspace():
            end -= 1
        if end > len(prefix):
            spans.append((len(prefix), end))
    return text, spans


def tokenize_conversation(
    conversation: Conversation, tokenizer: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and the assistant-token mask of one rendered conversation."""
    text, spans = assistant_char_spans(conversation, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return ids, mask


def windows(
    ids: np.ndarray, mask: np.ndarray, max_length: int, min_loss_tokens: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Non-overlapping windows of at most ``max_length`` tokens with enough targets."""
    out = []
    for start in range(0, len(ids), max_length):
        w_ids, w_mask = ids[start : start + max_length], mask[start : start + max_length]
        # Positions 0 and 1 are never targets (row 0 at anchor 0 predicts token 2).
        if len(w_ids) >= 3 and int(w_mask[2:].sum()) >= min_loss_tokens:
            out.append((w_ids, w_mask))
    return out


@dataclass
class TrainingSet:
    """Windows stored flat: ``ids[offsets[i]:offsets[i+1]]`` is window ``i``."""

    ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0:
            raise TrainingDataError("offsets must be a 1-D array starting at 0")
        if self.offsets[-1] != len(self.ids) or len(self.ids) != len(self.loss_mask):
            raise TrainingDataError(
                f"offsets end at {int(self.offsets[-1])}, ids have {len(self.ids)} and the "
                f"mask {len(self.loss_mask)} entries; expected all equal"
            )
        if np.any(np.diff(self.offsets) <= 0):
            raise TrainingDataError("offsets must be strictly increasing (no empty windows)")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[lo:hi], self.loss_mask[lo:hi]

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @classmethod
    def from_windows(
        cls, items: Sequence[tuple[np.ndarray, np.ndarray]], meta: dict[str, Any] | None = None
    ) -> TrainingSet:
        if not items:
            raise TrainingDataError("no training windows: every conversation was skipped")
        lengths = np.asarray([len(i) for i, _ in items], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate([i for i, _ in items]).astype(np.int32)
        mask = np.concatenate([m for _, m in items]).astype(bool)
        return cls(ids, mask, offsets, dict(meta or {}))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npz")
        np.savez(
            tmp,
            ids=self.ids,
            loss_mask=self.loss_mask,
            offsets=self.offsets,
            meta=np.frombuffer(json.dumps(self.meta).encode(), dtype=np.uint8),
        )
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> TrainingSet:
        path = Path(path)
        try:
            with np.load(path) as z:
                meta = json.loads(bytes(z["meta"]).decode()) if "meta" in z else {}
                return cls(z["ids"], z["loss_mask"], z["offsets"], meta)
        except (OSError, ValueError, KeyError) as err:
            raise TrainingDataError(f"{path}: not a training-set file ({err})") from err


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the tokenizer's vocabulary and chat template."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def build_training_set(
    paths: Iterable[str | Path],
    tokenizer: Any,
    *,
    max_length: int = 512,
    split: str = "train",
    limit: int | None = None,
    min_loss_tokens: int = 4,
    progress: bool = True,
) -> tuple[TrainingSet, list[ReadReport], TokenizeReport]:
    """Reads, splits (``train``: ids not held out; ``held_out``; ``all``), tokenises."""
    if split not in ("train", "held_out", "all"):
        raise TrainingDataError(f"split {split!r}; expected 'train', 'held_out' or 'all'")
    if max_length < 3:
        raise TrainingDataError(f"max_length {max_length}; expected at least 3")
    reports: list[ReadReport] = []
    tok_report = TokenizeReport()
    items: list[tuple[np.ndarray, np.ndarray]] = []
    bar = tqdm(desc=f"tokenise ({split})", unit="conv", disable=not progress)
    for path in paths:
        report = ReadReport(str(path))
        reports.append(report)
        for conversation in read_conversations(path, report):
            if limit is not None and tok_report.conversations >= limit:
                break
            held = is_held_out(conversation.id)
            if (split == "train" and held) or (split == "held_out" and not held):
                continue
            if not any(t.role == "assistant" and t.content for t in conversation.turns):
                tok_report.skip("no assistant turn")
                continue
            try:
                ids, mask = tokenize_conversation(conversation, tokenizer)
            except TrainingDataError:
                tok_report.skip("template not prefix-consistent")
                continue
            except Exception as err:  # the chat template rejects some role orders
                tok_report.skip(f"template error: {type(err).__name__}")
                continue
            tok_report.conversations += 1
            bar.update(1)
            for w_ids, w_mask in windows(ids, mask, max_length, min_loss_tokens):
                items.append((w_ids, w_mask))
                tok_report.windows += 1
                tok_report.tokens += len(w_ids)
                tok_report.loss_tokens += int(w_mask.sum())
    bar.close()
    meta = {
        "sources": [str(p) for p in paths] if isinstance(paths, list) else [],
        "split": split,
        "held_out_rule": "dart_client.data.is_held_out (sha256(id) % 1000 < 20)",
        "max_length": max_length,
        "limit": limit,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "report": tok_report.summary(),
        "read": [r.summary() for r in reports],
    }
    return TrainingSet.from_windows(items, meta), reports, tok_report


def cached_training_set(
    paths: Sequence[str | Path],
    tokenizer: Any,
    cache_dir: str | Path,
    *,
    max_length: int = 512,
    split: str = "train",
    limit: int | None = None,
    progress: bool = True,
) -> TrainingSet:
    """:func:`build_training_set`, stored once under ``cache_dir`` keyed by its inputs."""
    key = hashlib.sha256()
    for p in paths:
        st = Path(p).stat()
        key.update(f"{Path(p).resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    key.update(f"{max_length}|{split}|{limit}|{tokenizer_fingerprint(tokenizer)}".encode())
    cache = Path(cache_dir) / f"trainset-{key.hexdigest()[:16]}.npz"
    if cache.is_file():
        return TrainingSet.load(cache)
    data, _, _ = build_training_set(
        list(paths), tokenizer, max_length=max_length, split=split, limit=limit, progress=progress
    )
    cache.parent.mkdir(parents=True, exist_ok=True)
    data.save(cache)
    return data
