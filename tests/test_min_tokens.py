"""``GenerationConfig.min_tokens`` (vLLM's ``min_tokens``): no end token (EOS, a
``stop_token_ids`` token) before that many new tokens. Greedy DART, alone and batched, on the
dynamic and the static path, equals an independent greedy loop over the target with the end
tokens masked (float64); the sampled distribution is checked in test_generate.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import make_tiny_target

from dart_client import DartModel
from dart_client.decoding.config import GenerationConfig
from dart_client.errors import InvalidArgumentError
from dart_client.models.head import DartHead

PROMPT = [5, 9, 17, 5, 9, 40, 41]


def masked_greedy(
    model: Any, prompt: list[int], new: int, end: set[int], min_tokens: int
) -> list[int]:
    """The reference: plain greedy decoding, the end tokens' logits -inf before
    ``min_tokens`` new tokens, stopping at an end token after."""
    ids = list(prompt)
    out: list[int] = []
    for k in range(new):
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].clone()
        if k < min_tokens:
            logits[sorted(end)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token in end:
            break
    return out


@pytest.fixture(scope="module")
def setup(tiny_ngram_path: Any) -> tuple[DartModel, Any, int]:
    """A tiny target whose EOS is the token its greedy continuation picks second, and DART
    over it with the real pruner."""
    from dart_client.ngram import NGram

    model = make_tiny_target("llama", seed=3)
    plain = masked_greedy(model, PROMPT, 3, set(), 0)
    eos = plain[1]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    head = DartHead.random_init(model.config, draft_length=3, seed=2).double()
    dm = DartModel(model, head, ngram=NGram.open(str(tiny_ngram_path)))
    return dm, model, eos


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("mode", ["dart", "ar"])
def test_greedy_with_min_tokens_is_the_masked_greedy_decoding(
    setup: Any, static: bool, mode: str
) -> None:
    dm, model, eos = setup
    plain = dm.generate(input_ids=PROMPT, max_new_tokens=20, mode=mode, static=static)
    assert plain.tokens[-1] == eos and len(plain.tokens) == 2  # EOS ends it at once
    for min_tokens in (1, 2, 7, 20):
        want = masked_greedy(model, PROMPT, 20, {eos}, min_tokens)
        got = dm.generate(
            input_ids=PROMPT, max_new_tokens=20, mode=mode, static=static, min_tokens=min_tokens
        )
        assert got.tokens == want, min_tokens
        assert eos not in got.tokens[:min_tokens] and len(got.tokens) >= min_tokens
    # A stop id that is the first token: masked at the prefill's pick too.
    first = plain.tokens[0]
    want = masked_greedy(model, PROMPT, 20, {eos, first}, 3)
    got = dm.generate(
        input_ids=PROMPT, max_new_tokens=20, mode=mode, static=static, min_tokens=3,
        stop_token_ids=[first],
    )  # fmt: skip
    assert got.tokens == want and want[0] != first


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_batched_rows_keep_their_own_min_tokens(setup: Any, static: bool) -> None:
    """Rows with different ``min_tokens`` in one batch, each with a stop id its plain greedy
    continuation picks third (in a tree step): each row is its own masked greedy decoding (a
    row past its minimum and rows before theirs share the steps)."""
    dm, model, eos = setup
    prompts = [PROMPT, PROMPT[2:], PROMPT[:4]]
    stops = [masked_greedy(model, p, 3, set(), 0)[2] for p in prompts]
    configs = [
        GenerationConfig(max_new_tokens=16, min_tokens=m, stop_token_ids=(stop,))
        for m, stop in zip((0, 9, 5), stops, strict=True)
    ]
    generator = dm.batch_generator(max_batch=3, max_length=64, static=static)
    ids = [generator.add(c, input_ids=p) for c, p in zip(configs, prompts, strict=True)]
    results: dict[int, Any] = {}
    while len(results) < 3:
        generator.step()
        results.update(generator.pop_finished())
    for i, (p, c, stop) in enumerate(zip(prompts, configs, stops, strict=True)):
        want = masked_greedy(model, p, 16, {eos, stop}, c.min_tokens)
        assert results[ids[i]].tokens == want, i
        if c.min_tokens:
            assert len(want) > 3  # the mask mattered: unmasked, the row ends by its third


def test_min_tokens_is_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="min_tokens = 9 is more than max_new_tokens"):
        GenerationConfig(max_new_tokens=8, min_tokens=9)
    with pytest.raises(InvalidArgumentError, match="min_tokens"):
        GenerationConfig(min_tokens=-1)
    assert GenerationConfig(max_new_tokens=8, min_tokens=8).min_tokens == 8
