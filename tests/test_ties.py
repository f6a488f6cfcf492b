"""``dart_client.decoding.ties``: where two greedy decodings of one target part, the target's
top-2 margin there, and whether that is a numerical near-tie."""

from __future__ import annotations

import copy
from typing import Any

import torch
from conftest import make_tiny_target

from dart_client import DartModel
from dart_client.decoding.ties import Divergence, divergence, first_divergence, top2_margin


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early


def runner_up(model: Any, ids: list[int]) -> tuple[int, int]:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
    top = torch.topk(logits, 2).indices.tolist()
    return top[0], top[1]


def test_a_real_divergence_is_no_tie_and_a_tied_one_is() -> None:
    model = make_tiny_target("llama", seed=7)
    prompt = [5, 9, 11, 40]
    want = DartModel(model).generate(input_ids=prompt, mode="ar", max_new_tokens=8).tokens
    at = 3
    best, second = runner_up(model, prompt + want[:at])
    assert best == want[at]
    got = [*want[:at], second, *want[at + 1 :]]
    found = divergence(model, prompt, got, want)
    assert isinstance(found, Divergence) and found.index == at
    margin, _ = top2_margin(model, prompt + want[:at])
    assert found.margin == margin > 0 and not found.near_tie  # float64: far above rounding
    assert divergence(model, prompt, want, want) is None
    # A target whose two best tokens there have the same output row: an exact tie.
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight[second] = twin.lm_head.weight[best]
    tied = divergence(twin, prompt, got, want)
    assert tied is not None and tied.margin == 0.0 and tied.near_tie
