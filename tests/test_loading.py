"""Loading the embedded target: the GGUF is unpacked once into the cache directory and read
from there afterwards, with the weights of a direct GGUF load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dart_client.loading import load_target, unpacked_gguf


def test_gguf_is_unpacked_once_then_read_from_the_cache(
    smollm2_fp32: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import smollm2_gguf_path
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("DART_CACHE", str(tmp_path))
    gguf = smollm2_gguf_path()
    direct, direct_tok = smollm2_fp32

    first, _ = load_target(gguf, dtype=torch.float32)
    cached = unpacked_gguf(gguf, torch.float32)
    assert cached.parent == tmp_path / "gguf" and (cached / "config.json").is_file()
    assert not list(cached.parent.glob("*.tmp-*"))  # written aside, renamed into place

    # The second load reads the safetensors: transformers never sees the GGUF again.
    calls: list[dict[str, Any]] = []
    real = AutoModelForCausalLM.from_pretrained.__func__  # type: ignore[attr-defined]

    def recorded(cls: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recorded))
    second, tokenizer = load_target(gguf, dtype=torch.float32)
    assert calls and all("gguf_file" not in kw for kw in calls), calls

    expected = direct.state_dict()
    for model in (first, second):
        state = model.state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name
    text = "<|im_start|>user\nHello there<|im_end|>\n"
    assert tokenizer(text)["input_ids"] == direct_tok(text)["input_ids"]
    assert tokenizer.chat_template == direct_tok.chat_template


def test_recorded_paths_name_no_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sysconfig

    from dart_client.embedded import display_path

    monkeypatch.setenv("DART_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    site = Path(sysconfig.get_paths()["purelib"])
    assert display_path(tmp_path / "cache" / "m.ngram") == "<cache>/m.ngram"
    assert display_path(site / "pkg" / "f.json") == "<site-packages>/pkg/f.json"
    assert display_path(tmp_path / "data" / "x.jsonl") == "data/x.jsonl"
    assert display_path("relative/y") == "relative/y"
    assert display_path("/elsewhere/z") == "/elsewhere/z"


def test_ngram_open_options_are_checked(tiny_ngram_path: Path) -> None:
    from dart_client.errors import InvalidArgumentError
    from dart_client.loading import load_ngram

    opened = load_ngram(tiny_ngram_path, open_options={"checksums": False, "prefetch": True})
    assert opened.info()["order"] == 3
    with pytest.raises(InvalidArgumentError, match=r"unknown n-gram open option.*mmap.*known: "):
        load_ngram(tiny_ngram_path, open_options={"mmap": True})
    with pytest.raises(InvalidArgumentError, match="prefetch='yes': expected True/False"):
        load_ngram(tiny_ngram_path, open_options={"prefetch": "yes"})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match="apply to a local model"):
        load_ngram("grpc://localhost:1", open_options={"prefetch": True})
    # Refused before any model is loaded ("nope" is no model: loading it would fail otherwise).
    from dart_client import DartModel
    from dart_client.dart_model import build_model

    served = {"ngram_server": "localhost:1", "ngram_open": {"prefetch": True}}
    with pytest.raises(InvalidArgumentError, match="the daemon at localhost:1 opens its own"):
        DartModel.from_pretrained("nope", "nope", **served)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="the daemon at localhost:1 opens its own"):
        build_model("nope", "random", None, **served)  # type: ignore[arg-type]


def test_ngram_open_options_are_ngram_opens_keywords() -> None:
    """The names users may pass are exactly ``NGram.open``'s options (a new one there must
    be offered here, a removed one refused)."""
    import inspect

    from dart_client.loading import NGRAM_OPEN_OPTIONS
    from dart_client.ngram.model import NGram

    keywords = [
        name
        for name, p in inspect.signature(NGram.open).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert sorted(NGRAM_OPEN_OPTIONS) == sorted(keywords)
