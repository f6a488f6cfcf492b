"""The embedded default's n-gram model: a 3-gram over ShareGPT's training split, built once
with SmolLM2's tokenizer and cached (rebuilt when missing)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dart_client import embedded
from dart_client.data import ReadReport, export_text_jsonl, is_held_out, read_sharegpt


@dataclass
class EmbeddedNGram:
    path: Path
    corpus: Path
    built_now: bool
    build_seconds: float | None
    report: dict | None


def corpus_jsonl(*, progress: bool = True) -> Path:
    """ShareGPT's training split rendered with SmolLM2's chat template (cached JSONL)."""
    out = embedded.cache_dir() / "sharegpt-train.smollm2.jsonl"
    if not out.is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(embedded.smollm2_tokenizer_dir()))
        report = ReadReport(str(embedded.sharegpt_json()))
        conversations = (
            c for c in read_sharegpt(embedded.sharegpt_json(), report) if not is_held_out(c.id)
        )
        export_text_jsonl(conversations, tokenizer, out, progress=progress)
        # stderr: callers read the model's path from stdout (deploy/gpu/pack.sh).
        print(report.summary(), file=sys.stderr)
    return out


def ensure_ngram(*, memory: str = "2G", progress: bool = True) -> EmbeddedNGram:
    """The embedded 3-gram model, built now if it is not cached yet."""
    from dart_client.ngram.build import build

    path = embedded.cache_dir() / "sharegpt-train.smollm2.3gram.ngram"
    corpus = corpus_jsonl(progress=progress)
    if path.is_file():
        return EmbeddedNGram(path, corpus, False, None, None)
    start = time.perf_counter()
    report = build(
        [str(corpus)],
        str(path),
        tokenizer=str(embedded.smollm2_tokenizer_dir() / "tokenizer.json"),
        order=3,
        memory=memory,
        eos_id=embedded.smollm2_eos_id(),
        progress=progress,
    )
    return EmbeddedNGram(path, corpus, True, time.perf_counter() - start, report)
