"""The target's warpers equal transformers' (temperature -> top-k -> top-p), row by row."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dart_client.decoding.sampling import (
    SamplingParams,
    make_generator,
    sample,
    target_probs,
    top_p_filter,
    warp_logits,
)
from dart_client.errors import InvalidArgumentError, InvalidTypeError


def hf_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' own sampling processors, in the order ``generate`` builds them."""
    procs = LogitsProcessorList()
    if p.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    return procs(None, logits)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(2, 40),
    seed=st.integers(0, 2**31),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    ties=st.booleans(),
)
def test_warpers_equal_transformers(
    rows: int, vocab: int, seed: int, temperature: float, top_k: int, top_p: float, ties: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    if ties:  # repeated values exercise top-k's "keep every tie" rule
        logits = logits.round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = warp_logits(logits, params)
    theirs = hf_warp(logits.clone(), params)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])
    probs = target_probs(logits, params)
    torch.testing.assert_close(probs.sum(-1), torch.ones(rows, dtype=torch.float64))
    # A most likely token always survives (with ties, one of them).
    kept_max = logits.masked_fill(probs == 0, -math.inf).max(-1).values
    assert torch.equal(kept_max, logits.max(-1).values)


def test_bf16_logits_are_promoted() -> None:
    logits = torch.randn(3, 10).to(torch.bfloat16)
    out = warp_logits(logits, SamplingParams(temperature=0.7, top_k=3))
    assert out.dtype == torch.float32
    assert int((~torch.isinf(out)).sum(-1).min()) >= 3


def test_sample_follows_the_distribution_and_the_seed() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    a = [sample(probs, make_generator(5)) for _ in range(3)]
    gen = make_generator(5)
    b = [sample(probs, gen) for _ in range(3000)]
    assert a == [a[0]] * 3  # same seed, same first draw
    assert 1 not in b
    assert abs(b.count(2) / 3000 - 0.6) < 0.04


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"temperature": -0.1}, InvalidArgumentError, "temperature"),
        ({"temperature": math.nan}, InvalidArgumentError, "finite"),
        ({"temperature": "1"}, InvalidTypeError, "temperature"),
        ({"top_p": 0.0}, InvalidArgumentError, "top_p"),
        ({"top_p": 1.5}, InvalidArgumentError, "top_p"),
        ({"top_k": -1}, InvalidArgumentError, "top_k"),
        ({"top_k": 2.0}, InvalidTypeError, "top_k"),
        ({"top_k": True}, InvalidTypeError, "top_k"),
    ],
)
def test_bad_params(kwargs: dict, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        SamplingParams(**kwargs)


def test_greedy_has_no_distribution() -> None:
    assert SamplingParams().greedy
    with pytest.raises(InvalidArgumentError, match="greedy"):
        warp_logits(torch.zeros(1, 3), SamplingParams())
    with pytest.raises(InvalidTypeError, match="seed"):
        make_generator("1")  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    peak=st.floats(0.0, 25.0),
    spread=st.integers(1, 300),
    top_p=st.floats(0.05, 0.999),
    temperature=st.floats(0.3, 1.5),
)
def test_top_p_over_a_large_vocabulary_equals_transformers(
    rows: int, seed: int, peak: float, spread: int, top_p: float, temperature: float
) -> None:
    """A vocabulary large enough for the probe of the likeliest tokens: nuclei inside it
    (peaked rows) and wider than it (flat rows, the full sort) both give transformers' set."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 4096, generator=g, dtype=torch.float64) * 2
    boosted = torch.randint(0, 4096, (rows, spread), generator=g)
    logits.scatter_add_(1, boosted, torch.full((rows, spread), peak, dtype=torch.float64))
    params = SamplingParams(temperature=temperature, top_p=top_p)
    ours = warp_logits(logits, params)
    theirs = hf_warp(logits.clone(), params)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])
    # A small probe (rows whose nucleus is wider fall back) gives the full sort's answer.
    by_probe = top_p_filter(logits, top_p, probe=64)
    assert torch.equal(by_probe, top_p_filter(logits, top_p, probe=4096))
