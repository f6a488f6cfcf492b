"""The server's one door into the model: loading it, encoding inputs, running a generation.

Everything else in :mod:`dart_client.apps.serve` talks to :class:`Engine` only, so a change in how
models load or how generation is called stays in this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dart_client.errors import InvalidArgumentError

#: ``--max-model-len``'s default: the context a request may use, capped by the target's own.
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Sampling:
    """What one request asks of a generation (already validated by the protocol layer)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    tree_budget: int | None = None
    speculative: bool = True
    #: None, or report each token's log probability with that many alternatives.
    logprobs: int | None = None
    #: None, or score the prompt's tokens first, with that many alternatives (``echo``).
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    #: The client reads each step's text (a streamed reply); False: only the outcome's text
    #: is sent, decoded once at the end (a batched row then skips the per-step decoding).
    stream: bool = True


@dataclass
class Step:
    """One generation step: its text delta and tokens, and DART's statistics of it."""

    text: str
    tokens: int
    accept_length: int
    timings: dict[str, float]
    #: With ``Sampling.logprobs``: a :class:`~dart_client.decoding.logprobs.TokenLogprob`
    #: per token of the step.
    logprobs: list[Any] | None = None


@dataclass
class PromptScores:
    """The log probabilities of a prompt's tokens after the first (sent before any step)."""

    logprobs: list[Any]


@dataclass
class Outcome:
    """The end of a generation."""

    text: str
    completion_tokens: int
    finish_reason: str  # OpenAI's: "stop" | "length"
    mode: str  # "dart" | "ar"
    tau: float
    steps: int
    #: With ``Sampling.logprobs``: one per completion token.
    logprobs: list[Any] | None = None


class Engine:
    """A loaded model and the context limit requests must fit.

    ``max_model_len`` bounds prompt + new tokens (each request's KV cache is sized to what it
    asks for, never more than this); ``static``: ``GenerationConfig.static`` for every
    request, lone or batched (``"auto"``: the static path on one cuda device)."""

    def __init__(
        self, model: Any, model_id: str, max_model_len: int, static: bool | str = "auto"
    ) -> None:
        self.model = model
        self.model_id = model_id
        from dart_client.decoding.config import parse_static

        self.static = parse_static(static)
        limit = model.target.max_positions
        self.max_model_len = min(max_model_len, limit) if limit else max_model_len
        # A DART head with its pruner, or an EAGLE-3 head.
        self.speculative = model.new_drafter() is not None
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    @property
    def has_chat_template(self) -> bool:
        return self.model.template is not None

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.model.encode_input(messages=messages)

    def encode_text(self, prompt: str) -> list[int]:
        return self.model.encode_input(prompt=prompt)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (an echoed prompt given as ids)."""
        return str(self.model.tokenizer.decode(ids))

    def check_ids(self, ids: list[int]) -> list[int]:
        """Token ids given by the client, checked against the vocabulary."""
        return self.model.encode_input(input_ids=ids)

    def prompt_scores(self, ids: list[int], top: int) -> PromptScores:
        """The target's log probability of each prompt token after the first."""
        from dart_client.decoding.logprobs import prompt_logprobs

        return PromptScores(prompt_logprobs(self.model.target, ids, top))

    def no_completion(self, sampling: Sampling) -> Outcome:
        """The outcome of a request for no new token (``max_tokens: 0`` with ``echo``: the
        prompt scored, nothing generated)."""
        logprobs = None if sampling.logprobs is None else []
        return Outcome("", 0, "length", self.mode(sampling), 0.0, 0, logprobs)

    def token_piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes as OpenAI's ``logprobs`` show them: the token's own bytes
        (byte-level BPE and SentencePiece byte tokens map back exactly; a token that is part
        of a character has those bytes, its text the replacement character)."""
        piece = self._pieces.get(token)
        if piece is None:
            raw = token_bytes(self.model.tokenizer, token)
            piece = (raw.decode("utf-8", errors="replace"), list(raw))
            self._pieces[token] = piece
        return piece

    def mode(self, sampling: Sampling) -> str:
        """How a request is decoded: ``"dart"``, or ``"ar"`` (asked for, or no head)."""
        return "dart" if sampling.speculative and self.speculative else "ar"

    def config(self, ids: list[int], sampling: Sampling, batch: int = 1) -> Any:
        """The request's :class:`GenerationConfig` (tree budget resolved for ``batch`` rows
        decoded together; a batch's ``auto`` budget stays ``"auto"``: the batch sizes it to
        the rows live at each step)."""
        from dart_client.decoding.config import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            # The KV caches are sized to this request: prompt + new tokens (+ the bonus slot).
            max_length=min(self.max_model_len, len(ids) + sampling.max_new_tokens + 1),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop=sampling.stop,
            seed=sampling.seed,
            tree_budget=sampling.tree_budget,
            static=self.static,
            logprobs=sampling.logprobs,
            ignore_eos=sampling.ignore_eos,
            stop_token_ids=sampling.stop_token_ids,
            min_tokens=sampling.min_tokens,
        )
        return self.model.resolve_config(config, self.mode(sampling), batch)

    def generate(self, ids: list[int], sampling: Sampling) -> Iterator[Step | Outcome]:
        """Steps of one generation, then its :class:`Outcome`. Stop iterating to cancel."""
        stream = self.model.generate(
            ids,
            self.config(ids, sampling),
            stream=True,
            mode=self.mode(sampling),
            stream_text=sampling.stream,
        )
        for event in stream:
            yield step_of(event)
        result = stream.result
        assert result is not None
        yield outcome_of(result)

    def batch_generator(self, mode: str, max_batch: int) -> Any:
        """A :class:`~dart_client.decoding.batch.BatchGenerator` for requests of ``mode``:
        up to ``max_batch`` decoded together, each within ``max_model_len``."""
        return self.model.batch_generator(
            mode=mode, max_batch=max_batch, max_length=self.max_model_len, static=self.static
        )


def step_of(event: Any) -> Step:
    """A generation's stream event as the server's :class:`Step`."""
    return Step(event.text, len(event.tokens), event.accept_length, event.timings, event.logprobs)


def outcome_of(result: Any) -> Outcome:
    """A generation's result as the server's :class:`Outcome`."""
    return Outcome(
        text=result.text,
        completion_tokens=len(result.tokens),
        finish_reason="length" if result.finish_reason == "length" else "stop",
        mode=result.mode,
        tau=result.tau,
        steps=result.steps,
        logprobs=result.logprobs,
    )


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token ``token`` stands for: a byte-level BPE token's (GPT-2's byte-to-
    character table reversed), a SentencePiece byte token's (``<0xAB>``), else the UTF-8 of its
    decoding."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        table = _byte_decoder()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if "\u2581" in piece:  # SentencePiece's word boundary
            return piece.replace("\u2581", " ").encode("utf-8")
    return str(tokenizer.decode([token])).encode("utf-8")


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed, character -> byte (transformers' table)."""
    if not _BYTE_DECODER:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        _BYTE_DECODER.update({c: b for b, c in bytes_to_unicode().items()})
    return _BYTE_DECODER


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model options of ``dart serve`` (those of ``dart generate``, plus the served name
    and context)."""
    from dart_client.apps.options import (
        add_model_arguments,
        add_static_argument,
        add_tree_budget_arguments,
    )

    add_model_arguments(p)
    g = p.add_argument_group("served model")
    add_static_argument(g)
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: 'dart-' + the target's file or hub name)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help=f"prompt + completion tokens a request may use (default {DEFAULT_MAX_MODEL_LEN}, "
        "capped by the target's positions)",
    )
    add_tree_budget_arguments(g)


def load_engine(args: argparse.Namespace) -> Engine:
    """The :class:`Engine` the command-line options describe. With no ``--base`` the embedded
    default is served: SmolLM2-135M-Instruct, its shipped head and the ShareGPT 3-gram."""
    from pathlib import Path

    from dart_client.apps.options import load_model

    if args.max_model_len < 2:
        raise InvalidArgumentError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.base is None and not args.ar:
        from dart_client.embedded import shipped_head

        if args.head is None:
            args.head = str(shipped_head())
        from dart_client.loading import is_eagle3_spec

        if args.ngram is None and args.ngram_server is None and not is_eagle3_spec(args.head):
            args.ngram = "embedded"
    model = load_model(args)
    name = args.served_model_name
    if name is None:
        base = Path(args.base).stem if args.base else "smollm2-135m-instruct"
        name = f"dart-{base.split('/')[-1].lower()}"
    return Engine(model, name, args.max_model_len, static=args.static)
