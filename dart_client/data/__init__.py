"""Conversation corpora: tolerant readers, one normalised shape, and the held-out split."""

from dart_client.data.conversations import (
    Conversation,
    ReadReport,
    Turn,
    is_held_out,
    read_sharegpt,
)
from dart_client.data.corpus import export_text_jsonl, render

__all__ = [
    "Conversation",
    "ReadReport",
    "Turn",
    "export_text_jsonl",
    "is_held_out",
    "read_sharegpt",
    "render",
]
