"""Log probabilities of generated tokens (``GenerationConfig.logprobs``): every path reports
the target's own raw log-softmax at each token's position, whatever the drafter accepted,
aligned with the tokens through EOS, length and stop-string cuts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from conftest import make_tiny_target, make_tiny_tokenizer
from test_batch import STATIC, Truths, alone, drain
from test_generate import random_prompts

from dart_client import DartModel
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from dart_client.errors import InvalidArgumentError, InvalidTypeError
from dart_client.models.head import DartHead

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Any:
    return make_tiny_target("llama", seed=0)


@pytest.fixture(scope="module")
def head(target: Any) -> DartHead:
    return DartHead.random_init(target.config, draft_length=3, seed=11).double()


def teacher_forced(
    target: Any, prompt: Sequence[int], tokens: Sequence[int], top: int
) -> list[TokenLogprob]:
    """The reference: one plain transformers forward over prompt + tokens (float64), the
    log-softmax at the position before each token."""
    ids = torch.tensor([[*prompt, *tokens]], dtype=torch.long, device=target.device)
    with torch.no_grad():
        logits = target(ids).logits[0]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return token_logprobs(rows, tokens, top)


def assert_close(got: Sequence[TokenLogprob], want: Sequence[TokenLogprob]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token == w.token
        assert g.logprob == pytest.approx(w.logprob, abs=1e-9)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=1e-9)


def truths_model(target: Any, head: DartHead, prompts: list[list[int]], n: int) -> DartModel:
    """A model whose trees hold each prompt's true greedy continuation under wrong branches:
    steps accept several nodes, so each token's row is a different tree node's."""
    dm = DartModel(target, head, tree_builder=None)
    truths = [p + alone(dm, p, "ar", max_new_tokens=n) for p in prompts]
    dm.tree_builder = Truths(truths)
    return dm


@STATIC
@pytest.mark.parametrize("mode", ["ar", "dart"])
def test_greedy_logprobs_are_the_targets_own(
    mode: str, static: bool, target: Any, head: DartHead
) -> None:
    prompts = random_prompts(3, seed=5)
    dm = truths_model(target, head, prompts, 24)
    for prompt in prompts:
        plain = dm.generate(input_ids=prompt, mode=mode, max_new_tokens=24, tree_budget=12)
        out = dm.generate(
            input_ids=prompt,
            mode=mode,
            max_new_tokens=24,
            tree_budget=12,
            static=static,
            logprobs=3,
        )
        # Reporting them changes nothing else.
        assert out.tokens == plain.tokens
        assert out.logprobs is not None and plain.logprobs is None
        assert_close(out.logprobs, teacher_forced(target, prompt, out.tokens, 3))
        # Greedy tokens are the argmax: the first alternative, at the same log probability.
        assert all(lp.top[0] == (lp.token, lp.logprob) for lp in out.logprobs)
        if mode == "dart":
            assert max(out.accept_lengths[1:]) >= 3  # several tokens came from one forward


@STATIC
def test_sampled_tokens_get_their_raw_logprobs(
    static: bool, target: Any, head: DartHead, tiny_ngram_path: Any
) -> None:
    """Sampling at a temperature: each token's log probability is under the raw (unwarped)
    distribution, as vLLM reports by default."""
    from dart_client.ngram import NGram

    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)))
    for seed, prompt in enumerate(random_prompts(3, seed=9)):
        out = dm.generate(
            input_ids=prompt,
            max_new_tokens=20,
            temperature=0.8,
            top_p=0.9,
            seed=seed,
            static=static,
            logprobs=0,
        )
        assert out.logprobs is not None
        assert all(lp.top == () for lp in out.logprobs)
        assert_close(out.logprobs, teacher_forced(target, prompt, out.tokens, 0))


@STATIC
def test_batch_rows_report_logprobs_of_their_own(static: bool, target: Any, head: DartHead) -> None:
    """A batch mixes rows with and without log probabilities (the rows without keep their
    outputs), ragged prompts, and rows that end early."""
    prompts = random_prompts(4, seed=12)
    dm = truths_model(target, head, prompts, 20)
    batch = dm.batch_generator(max_batch=3, static=static)
    config = GenerationConfig(max_new_tokens=20, tree_budget=12)
    wanted = {}
    for i, prompt in enumerate(prompts):
        top = 2 if i % 2 == 0 else None
        lengths = 20 if i != 1 else 1  # one row ends at its first token
        request = batch.add(config.replace(logprobs=top, max_new_tokens=lengths), input_ids=prompt)
        wanted[request] = (prompt, top, lengths)
    results = drain(batch)
    for request, (prompt, top, lengths) in wanted.items():
        out = results[request]
        assert out.tokens == alone(dm, prompt, "ar", max_new_tokens=lengths)
        if top is None:
            assert out.logprobs is None
        else:
            assert out.logprobs is not None
            assert_close(out.logprobs, teacher_forced(target, prompt, out.tokens, top))


def test_logprobs_follow_the_tokens_through_stops_and_streaming(
    target: Any, head: DartHead
) -> None:
    tok = make_tiny_tokenizer()
    prompt = random_prompts(1, seed=4)[0]
    dm = truths_model(target, head, [prompt], 30)
    dm.tokenizer = tok
    full = dm.generate(input_ids=prompt, max_new_tokens=30, tree_budget=12)
    # A stop string that ends inside the output: the tokens are cut there, and so are theirs.
    text = tok.decode(full.tokens[:12], skip_special_tokens=True)
    stop = text[-3:]
    stream = dm.generate(
        input_ids=prompt,
        max_new_tokens=30,
        tree_budget=12,
        stop=stop,
        logprobs=1,
        stream=True,
    )
    events = list(stream)
    out = stream.result
    assert out is not None and out.finish_reason == "stop"
    assert out.logprobs is not None and len(out.logprobs) == len(out.tokens) < len(full.tokens)
    assert [lp for e in events for lp in (e.logprobs or [])] == out.logprobs
    assert [t for e in events for t in e.tokens] == out.tokens
    assert_close(out.logprobs, teacher_forced(target, prompt, out.tokens, 1))


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (MAX_TOP_LOGPROBS + 1, InvalidArgumentError),
        (-1, InvalidArgumentError),
        (True, InvalidTypeError),
        (2.0, InvalidTypeError),
        ("3", InvalidTypeError),
    ],
)
def test_bad_logprobs_settings_are_named(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="logprobs"):
        GenerationConfig(logprobs=value)


def test_alternatives_tie_by_token_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], dtype=torch.float64)
    (lp,) = token_logprobs(logits, [2], 4)
    assert [t for t, _ in lp.top] == [1, 2, 4, 3]
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))


@pytest.mark.parametrize("chunk", [4, 256])
def test_prompt_logprobs_in_chunks_are_the_teacher_forced_ones(
    chunk: int, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``echo``'s prompt scores: read in chunks (a chunk's last position scores the next
    chunk's first token), equal to one plain forward over the whole prompt."""
    from dart_client.decoding import logprobs
    from dart_client.models.target import TargetModel

    monkeypatch.setattr(logprobs, "PROMPT_CHUNK", chunk)
    prompt = random_prompts(1, seed=21, max_len=40)[0] + [5, 6, 7, 8, 9, 10, 11, 12, 13]
    got = logprobs.prompt_logprobs(TargetModel(target), prompt, 2)
    assert_close(got, teacher_forced(target, prompt[:1], prompt[1:], 2))
