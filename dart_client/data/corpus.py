"""Rendering conversations into corpus files for `dart-ngram build`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dart_client.data.conversations import Conversation


def render(conversation: Conversation, tokenizer: Any) -> str:
    """The conversation as the target sees it: its own chat template, no generation prompt."""
    return tokenizer.apply_chat_template(
        conversation.messages(), tokenize=False, add_generation_prompt=False
    )


def export_text_jsonl(
    conversations: Iterable[Conversation],
    tokenizer: Any,
    path: str | Path,
    *,
    progress: bool = True,
) -> int:
    """Writes one ``{"text": ...}`` line per conversation (atomically); returns the count."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    count = 0
    with tmp.open("w", encoding="utf-8") as out:
        for conversation in tqdm(conversations, desc="render", unit="conv", disable=not progress):
            out.write(json.dumps({"id": conversation.id, "text": render(conversation, tokenizer)}))
            out.write("\n")
            count += 1
    tmp.replace(path)
    return count
