"""OpenAI's request fields and response shapes, as ``dart serve`` speaks them.

Requests are validated by pydantic models (unknown fields are accepted and ignored, as
OpenAI's clients send some, except the features DART does not have: those are refused by
name); :func:`sampling_of` turns a request into the engine's :class:`Sampling`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from dart_client.apps.serve.generation import Outcome, Sampling
from dart_client.apps.serve.scheduler import JobError
from dart_client.decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob

#: Request fields OpenAI defines that DART does not implement: refused when set to anything
#: but their neutral value, never silently ignored.
UNSUPPORTED = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


#: Most choices one request may ask for (``n``); each is a generation of its own.
MAX_CHOICES = 64


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    # 0 only with ``echo`` (completions): the prompt scored, no new token.
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    # DART's own options.
    tree_budget: StrictInt | None = Field(default=None, ge=0)
    speculative: StrictBool = True
    # vLLM's: generate past end-of-sequence tokens (benchmarks fix output lengths so), and
    # more tokens that end the output as end-of-sequence does.
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    # vLLM's: new tokens before end-of-sequence or a stop_token_ids token may come.
    min_tokens: StrictInt = Field(default=0, ge=0)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    #: The prompt comes back before the completion (with ``logprobs``: scored, its first
    #: token unscored), as evaluation harnesses ask to score a continuation.
    echo: StrictBool = False


def logprobs_of(req: _Common) -> int | None:
    """Alternatives per token the request asks for, None when it asks no log probabilities
    (chat: ``logprobs: true`` with ``top_logprobs`` alternatives; completions: ``logprobs``
    alternatives)."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    assert isinstance(req, CompletionRequest)
    return req.logprobs


def bad_request(message: str, param: str | None = None, code: str | None = None) -> JobError:
    err = JobError(400, message, "invalid_request_error", code)
    err.param = param  # type: ignore[attr-defined]
    return err


def check_request(req: _Common, served: str) -> None:
    """What pydantic's field checks cannot say: the model name, ``n``, unsupported fields."""
    if req.model != served:
        err = JobError(
            404,
            f"The model `{req.model}` does not exist; this server serves `{served}`",
            "invalid_request_error",
            "model_not_found",
        )
        err.param = "model"  # type: ignore[attr-defined]
        raise err
    extra = req.model_extra or {}
    for name, neutral in UNSUPPORTED.items():
        if name in extra and extra[name] not in neutral:
            raise bad_request(f"{name} is not supported by dart serve", name, "unsupported")


def stops_of(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty", "stop")
    return stops


def sampling_of(
    req: _Common, prompt_tokens: int, max_model_len: int, speculative: bool
) -> Sampling:
    """The engine's sampling settings; refuses a prompt or ``max_tokens`` beyond the context."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for a completion",
            "messages" if isinstance(req, ChatRequest) else "prompt",
            "context_length_exceeded",
        )
    max_tokens = req.max_tokens
    name = "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens == 0 and not (isinstance(req, CompletionRequest) and req.echo):
        raise bad_request(
            f"{name} must be >= 1 (0 only with echo, to score the prompt)", name, "invalid_value"
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"{name} is {max_tokens}, but the prompt has {prompt_tokens} tokens and this "
            f"model's maximum context length is {max_model_len}: at most {room} new tokens fit",
            name,
            "context_length_exceeded",
        )
    if req.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens is {req.min_tokens}, more than the {max_tokens} new tokens of {name}",
            "min_tokens",
            "invalid_value",
        )
    return Sampling(
        max_new_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=stops_of(req.stop),
        seed=req.seed,
        tree_budget=req.tree_budget,
        speculative=req.speculative and speculative,
        logprobs=logprobs_of(req),
        ignore_eos=req.ignore_eos,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        min_tokens=req.min_tokens,
        prompt_logprobs=req.logprobs if isinstance(req, CompletionRequest) and req.echo else None,
        stream=bool(req.stream),
    )


def error_body(err: JobError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": getattr(err, "param", None),
            "code": err.code,
        }
    }


def choices_of(sampling: Sampling, n: int) -> list[Sampling]:
    """The settings of a request's ``n`` choices: the request's, each with its own seed when
    it gave one (``seed + i``: reproducible, and different samples)."""
    seeds = [None] * n if sampling.seed is None else [sampling.seed + i for i in range(n)]
    # An echoed prompt is scored once, by the first choice's job.
    return [
        dataclasses.replace(
            sampling, seed=seed, prompt_logprobs=sampling.prompt_logprobs if i == 0 else None
        )
        for i, seed in enumerate(seeds)
    ]


#: What a log probability of minus infinity is sent as (JSON has no infinities; OpenAI's
#: value).
LOGPROB_FLOOR = -9999.0


class Reply:
    """The response (or the stream chunks) of one request; ``piece``: a token's text and
    bytes (:meth:`~dart_client.apps.serve.generation.Engine.token_piece`), for log
    probabilities."""

    def __init__(
        self,
        chat: bool,
        model: str,
        prompt_tokens: int,
        piece: Callable[[int], tuple[str, list[int]]] | None = None,
    ) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.piece = piece
        # Characters of each choice's completion text its log probabilities sent so far
        # cover (completions' ``text_offset``).
        self.text_offsets: dict[int, int] = {}
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, outcomes: Sequence[Outcome]) -> dict[str, int]:
        """The prompt once, the completion tokens of every choice."""
        completion = sum(o.completion_tokens for o in outcomes)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    @staticmethod
    def dart(outcomes: Sequence[Outcome]) -> dict[str, Any]:
        """DART's statistics of the request (an extra field, ignored by OpenAI clients): the
        target forwards of all its choices and the tokens each gave on average."""
        steps = sum(o.steps for o in outcomes)
        tau = sum(o.tau * o.steps for o in outcomes) / steps if steps else 0.0
        return {"mode": outcomes[0].mode, "tau": round(tau, 4), "steps": steps}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(
        self, entries: Sequence[TokenLogprob] | None, index: int = 0, first: int | None = None
    ) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object of some tokens of choice ``index``: chat's ``content``
        list, or the completions API's parallel lists (``text_offset`` counting on from the
        choice's tokens sent before; ``first``: an unscored token before them, an echoed
        prompt's first)."""
        if entries is None:
            return None
        assert self.piece is not None, "log probabilities need the tokenizer's pieces"
        piece = self.piece

        def value(logprob: float) -> float:
            return max(logprob, LOGPROB_FLOOR)

        if self.chat:
            content = []
            for e in entries:
                text, raw = piece(e.token)
                top = []
                for t, lp in e.top:
                    t_text, t_raw = piece(t)
                    top.append({"token": t_text, "logprob": value(lp), "bytes": t_raw})
                content.append(
                    {"token": text, "logprob": value(e.logprob), "bytes": raw, "top_logprobs": top}
                )
            return {"content": content}
        unscored = [] if first is None else [first]
        tokens, offsets = [], []
        offset = self.text_offsets.get(index, 0)
        for token in [*unscored, *(e.token for e in entries)]:
            text = piece(token)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self.text_offsets[index] = offset
        none: list[Any] = [None] * len(unscored)
        return {
            "tokens": tokens,
            "token_logprobs": none + [value(e.logprob) for e in entries],
            "top_logprobs": none + [{piece(t)[0]: value(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def echo_logprobs(
        self, ids: Sequence[int], scores: Sequence[TokenLogprob], index: int = 0
    ) -> dict[str, Any]:
        """The completions API's ``logprobs`` of an echoed prompt: its tokens, the first
        unscored (None, as OpenAI has it), the others with their :class:`TokenLogprob`."""
        rest = self.logprobs(scores, index, first=ids[0])
        assert rest is not None
        return rest

    def full(
        self,
        outcomes: Sequence[Outcome],
        echo: Callable[[int], tuple[str, dict[str, Any] | None] | None] | None = None,
    ) -> dict[str, Any]:
        """The response: one choice per outcome (a request's prompts and ``n``), in order;
        ``echo(index)``: that choice's echoed prompt text and its :meth:`echo_logprobs` (None
        without logprobs) to put first, or None."""
        choices = []
        for index, outcome in enumerate(outcomes):
            choice: dict[str, Any] = {"index": index, "finish_reason": outcome.finish_reason}
            echoed = None if echo is None else echo(index)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": outcome.text}
            else:
                choice["text"] = outcome.text if echoed is None else echoed[0] + outcome.text
            prompt = None if echoed is None else echoed[1]
            logprobs = self.logprobs(outcome.logprobs, index)
            if prompt is not None and logprobs is not None:
                logprobs = {k: prompt[k] + logprobs[k] for k in logprobs}
            choice["logprobs"] = logprobs
            choices.append(choice)
        return {
            **self._head(self.object),
            "choices": choices,
            "usage": self.usage(outcomes),
            "dart": self.dart(outcomes),
        }

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        logprobs: Sequence[TokenLogprob] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self.logprobs(logprobs, index)
        choice["finish_reason"] = finish_reason
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice]}

    def usage_chunk(self, outcomes: Sequence[Outcome]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            **self._head(obj),
            "choices": [],
            "usage": self.usage(outcomes),
            "dart": self.dart(outcomes),
        }
