"""Chat templates: built-in formats, Qwen3's thinking switch, the tokenizer's own template."""

from __future__ import annotations

from pathlib import Path

import pytest

from dart_client import TEMPLATE_REGISTRY
from dart_client.errors import InvalidArgumentError, InvalidTypeError, UnknownTemplateError

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


def test_chatml() -> None:
    text = TEMPLATE_REGISTRY["chatml"].format(messages=CHAT[1:2])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = TEMPLATE_REGISTRY["chatml"].format(messages=CHAT, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_start|>user\n2+2?<|im_end|>\n")
    assert no_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_qwen_thinking_switch() -> None:
    qwen = TEMPLATE_REGISTRY["qwen"]
    thinking = qwen.format(messages=CHAT)
    assert thinking == TEMPLATE_REGISTRY["chatml"].format(messages=CHAT)
    plain = qwen.format(messages=CHAT, enable_thinking=False)
    assert plain == thinking + "<think>\n\n</think>\n\n"
    with pytest.raises(InvalidTypeError, match="enable_thinking"):
        qwen.format(messages=CHAT, enable_thinking="no")


def test_llama3() -> None:
    text = TEMPLATE_REGISTRY["llama3"].format(messages=CHAT[:2])
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize(
    ("messages", "error", "fragment"),
    [
        ("hello", InvalidTypeError, "list of"),
        ([], InvalidArgumentError, "empty"),
        ([{"role": "user"}], InvalidTypeError, "'role' and 'content'"),
        ([{"role": "robot", "content": "x"}], InvalidArgumentError, "unknown role"),
        ([{"role": "user", "content": 5}], InvalidTypeError, "strings"),
    ],
)
def test_bad_messages(messages: object, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        TEMPLATE_REGISTRY["chatml"].format(messages=messages)  # type: ignore[arg-type]


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownTemplateError, match="known: \\['chatml', 'llama3', 'qwen'\\]"):
        TEMPLATE_REGISTRY["vicuna"]
    with pytest.raises(KeyError):  # still a KeyError for dict-minded callers
        TEMPLATE_REGISTRY["vicuna"]
    assert set(TEMPLATE_REGISTRY) >= {"qwen", "llama3", "chatml"}
    with pytest.raises(InvalidArgumentError, match="takes no option"):
        TEMPLATE_REGISTRY["chatml"].format(messages=CHAT, enable_thinking=False)


def test_from_tokenizer_uses_the_real_smollm2_template(smollm2_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    own = TEMPLATE_REGISTRY.from_tokenizer(tok)
    assert own.format(messages=CHAT) == tok.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    # SmolLM2 speaks ChatML: with a system message the built-in template writes the same text.
    assert own.format(messages=CHAT) == TEMPLATE_REGISTRY["chatml"].format(messages=CHAT)
    # Without one, SmolLM2's template adds its default system prompt.
    assert "SmolLM" in own.format(messages=CHAT[1:2])


def test_from_tokenizer_without_template() -> None:
    from conftest import make_tiny_tokenizer

    with pytest.raises(InvalidArgumentError, match="no chat template"):
        TEMPLATE_REGISTRY.from_tokenizer(make_tiny_tokenizer())
