"""Chat templates: ``TEMPLATE_REGISTRY["qwen"].format(messages=[...])`` and friends.

Built-in templates write the model family's prompt format directly (no tokenizer needed);
:meth:`TemplateRegistry.from_tokenizer` uses a tokenizer's own Jinja chat template.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from dart_client.errors import InvalidArgumentError, InvalidTypeError, UnknownTemplateError

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate(Protocol):
    name: str

    def format(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> str: ...


def _check_messages(messages: Any) -> list[tuple[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidTypeError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidArgumentError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidTypeError(f"messages[{i}] must be a dict with 'role' and 'content'")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidTypeError(f"messages[{i}]: role and content must be strings")
        if role not in ROLES:
            raise InvalidArgumentError(f"messages[{i}]: unknown role {role!r} (expected {ROLES})")
        out.append((role, content))
    return out


class ChatMLTemplate:
    """``<|im_start|>role\\ncontent<|im_end|>\\n`` turns (SmolLM2, Qwen, many others)."""

    name = "chatml"

    def __init__(self, default_system: str | None = None) -> None:
        self.default_system = default_system

    def format(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> str:
        _reject_options(self.name, options)
        turns = _check_messages(messages)
        if self.default_system is not None and turns[0][0] != "system":
            turns.insert(0, ("system", self.default_system))
        text = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text


class QwenTemplate:
    """Qwen3: ChatML, plus the thinking switch (``enable_thinking=False`` pre-closes the think
    block, as Qwen3's own template does)."""

    name = "qwen"

    def format(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        **options: Any,
    ) -> str:
        _reject_options(self.name, options)
        if not isinstance(enable_thinking, bool):
            raise InvalidTypeError("enable_thinking must be a bool")
        text = ChatMLTemplate().format(messages, add_generation_prompt)
        if add_generation_prompt and not enable_thinking:
            text += "<think>\n\n</think>\n\n"
        return text


class Llama3Template:
    """Llama 3 headers: ``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>``."""

    name = "llama3"

    def format(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> str:
        _reject_options(self.name, options)
        turns = _check_messages(messages)
        text = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{r}<|end_header_id|>\n\n{c.strip()}<|eot_id|>" for r, c in turns
        )
        if add_generation_prompt:
            text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
        return text


class TokenizerTemplate:
    """A tokenizer's own chat template (``tokenizer.apply_chat_template``)."""

    name = "tokenizer"

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgumentError(
                f"{type(tokenizer).__name__} has no chat template; pick one of the built-in "
                "templates instead"
            )
        self.tokenizer = tokenizer

    def format(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> str:
        turns = _check_messages(messages)
        text = self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in turns],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **options,
        )
        return str(text)


def _reject_options(name: str, options: Mapping[str, Any]) -> None:
    if options:
        raise InvalidArgumentError(f"template {name!r} takes no option(s) {sorted(options)}")


class TemplateRegistry(Mapping[str, ChatTemplate]):
    """Name -> template; an unknown name raises :class:`UnknownTemplateError` listing names."""

    def __init__(self, templates: Mapping[str, ChatTemplate]) -> None:
        self._templates = dict(templates)

    def __getitem__(self, name: str) -> ChatTemplate:
        try:
            return self._templates[name]
        except KeyError:
            raise UnknownTemplateError(
                f"unknown chat template {name!r}; known: {sorted(self._templates)} "
                "(or TEMPLATE_REGISTRY.from_tokenizer(tokenizer))"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._templates)

    def __len__(self) -> int:
        return len(self._templates)

    def register(self, name: str, template: ChatTemplate) -> None:
        self._templates[name] = template

    @staticmethod
    def from_tokenizer(tokenizer: Any) -> ChatTemplate:
        return TokenizerTemplate(tokenizer)


TEMPLATE_REGISTRY = TemplateRegistry(
    {
        "qwen": QwenTemplate(),
        "llama3": Llama3Template(),
        "chatml": ChatMLTemplate(),
    }
)
