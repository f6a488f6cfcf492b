"""GenerationConfig: validated once, frozen; the tree budget's precedence (call > model >
pruner configuration), resolved in one function and honoured by generation; the old keyword
names of dart_generate/ar_generate still work, with a deprecation warning."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import make_tiny_target

from dart_client import DartModel, GenerationConfig, ar_generate, dart_generate
from dart_client.decoding.config import parse_tree_budget, resolve_tree_budget
from dart_client.errors import InvalidArgumentError, InvalidTypeError
from dart_client.models.head import DartHead
from dart_client.ngram import NGram, PrunerConfig


@pytest.mark.parametrize(
    ("fields", "error", "fragment"),
    [
        ({"max_new_tokens": 0}, InvalidArgumentError, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, InvalidTypeError, "max_new_tokens"),
        ({"max_length": 1}, InvalidArgumentError, "max_length"),
        ({"temperature": -0.5}, InvalidArgumentError, "temperature"),
        ({"top_p": 1.5}, InvalidArgumentError, "top_p"),
        ({"top_k": -1}, InvalidArgumentError, "top_k"),
        ({"stop": [""]}, InvalidArgumentError, "stop"),
        ({"stop": 3}, InvalidTypeError, "stop"),
        ({"seed": "x"}, InvalidTypeError, "seed"),
        ({"tree_budget": -2}, InvalidArgumentError, "tree_budget"),
        ({"tree_budget": "many"}, InvalidArgumentError, "tree budget"),
        ({"tree_budget": 2.0}, InvalidTypeError, "tree_budget"),
        ({"prompt_lookup": -1}, InvalidArgumentError, "prompt_lookup"),
        ({"ignore_eos": 1}, InvalidTypeError, "ignore_eos"),
        ({"stop_token_ids": "5"}, InvalidTypeError, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, InvalidArgumentError, "stop token id"),
        ({"stop_token_ids": [1.5]}, InvalidTypeError, "stop token id"),
    ],
)
def test_bad_settings_fail_at_construction(
    fields: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        GenerationConfig(**fields)
    # replace() validates the same way.
    with pytest.raises(error, match=fragment):
        GenerationConfig().replace(**fields)


def test_config_is_frozen_and_normalised() -> None:
    config = GenerationConfig(stop="END", tree_budget="AUTO")
    assert config.stop == ("END",)
    assert config.tree_budget == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = 1.0  # type: ignore[misc]
    assert config.for_prompt(10).max_length == 10 + config.max_new_tokens + 1
    assert config.sampling.greedy and not config.replace(temperature=0.7).sampling.greedy


def test_parse_tree_budget() -> None:
    assert parse_tree_budget(" 12 ") == 12
    assert parse_tree_budget("auto") == "auto"
    assert parse_tree_budget(None) is None
    assert parse_tree_budget(0) == 0


def test_budget_precedence_call_model_pruner() -> None:
    assert resolve_tree_budget(3, 7, 60) == 3
    assert resolve_tree_budget(None, 7, 60) == 7
    assert resolve_tree_budget(None, None, 60) == 60
    assert resolve_tree_budget(0, 7, 60) == 0  # 0 is a budget (root only), not "unset"
    assert resolve_tree_budget(None, None, None) is None
    with pytest.raises(InvalidArgumentError, match="tune"):
        resolve_tree_budget("auto", None, 60)


@pytest.fixture(scope="module")
def parts() -> tuple[Any, DartHead]:
    target = make_tiny_target("llama", seed=3)
    head = DartHead.random_init(target.config, draft_length=3, seed=5, std=0.5).double()
    return target, head.to(target.device)


def _largest_tree(dm: DartModel, **kwargs: Any) -> int:
    result = dm.generate(input_ids=[5, 9, 11, 40], max_new_tokens=24, **kwargs)
    return max(result.tree_sizes[1:]) - 1  # nodes below the root


def test_generation_honours_the_budget_precedence(
    parts: tuple[Any, DartHead], tiny_ngram_path: Path
) -> None:
    target, head = parts
    ngram = NGram.open(str(tiny_ngram_path))
    config = PrunerConfig(max_nodes=5)
    by_pruner = DartModel(target, head, ngram=ngram, pruner_config=config, prompt_lookup=0)
    # The pruner configuration's max_nodes holds when nothing else is set (the room left,
    # 23 tokens here, only caps it).
    assert by_pruner.resolved_tree_budget() == 5
    assert _largest_tree(by_pruner) == 5
    by_model = DartModel(
        target, head, ngram=ngram, pruner_config=config, prompt_lookup=0, tree_budget=9
    )
    assert _largest_tree(by_model) == 9
    assert _largest_tree(by_model, tree_budget=2) == 2
    assert _largest_tree(by_model, config=GenerationConfig(tree_budget=3)) == 3


def test_room_caps_the_budget(parts: tuple[Any, DartHead], tiny_ngram_path: Path) -> None:
    target, head = parts
    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)), prompt_lookup=0)
    result = dm.generate(input_ids=[5, 9, 11], max_new_tokens=4, tree_budget=50)
    # Step 1 has 3 tokens of room: at most 2 draft nodes + the bonus token.
    assert result.tree_sizes[1] - 1 <= 2


def test_deprecated_names_warn_and_work(parts: tuple[Any, DartHead], tiny_ngram_path: Path) -> None:
    target, head = parts
    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)))
    for fn in (dart_generate, ar_generate):
        with pytest.warns(DeprecationWarning, match="max_new_token_num"):
            old = fn(dm, input_ids=[5, 9], max_new_token_num=5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = fn(dm, input_ids=[5, 9], max_new_tokens=5)
        assert old.tokens == new.tokens and len(new.tokens) == 5
    with pytest.raises(InvalidArgumentError, match="not both"), pytest.warns(DeprecationWarning):
        dart_generate(dm, input_ids=[5], max_new_token_num=5, max_new_tokens=5)
    with pytest.raises(InvalidArgumentError, match="unknown generation setting 'temp'"):
        dm.generate(input_ids=[5], temp=0.5)


def test_generate_takes_a_config_and_overrides(
    parts: tuple[Any, DartHead], tiny_ngram_path: Path
) -> None:
    target, head = parts
    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)))
    config = GenerationConfig(max_new_tokens=6)
    a = dm.generate([5, 9, 11], config)
    b = dm.generate(input_ids=[5, 9, 11], config=config)
    c = dm.generate([5, 9, 11], config, max_new_tokens=3)
    ar = dm.generate([5, 9, 11], config, mode="ar")
    assert a.tokens == b.tokens == ar.tokens  # greedy DART is the target's greedy output
    assert c.tokens == a.tokens[:3]
    assert config.max_new_tokens == 6  # the override made a copy
    with pytest.raises(InvalidArgumentError, match=r"stop_token_ids .* outside"):
        dm.generate([5, 9, 11], config, stop_token_ids=[10**6])
