"""Prompt lookup (``dart_client.decoding.lookup``): the native index against the definition,
searched from scratch in plain Python, and its configuration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client.decoding.lookup import PromptLookup, PromptLookupConfig, parse_prompt_lookup
from dart_client.errors import InvalidArgumentError
from dart_client.ngram import TokenOutOfVocabError


def brute_force(tokens: list[int], min_n: int, max_n: int, m: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + m]
    return []


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(0, 5), max_size=7), min_size=1, max_size=8),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    m=st.integers(0, 9),
)
def test_index_matches_the_definition(chunks: list[list[int]], sizes: tuple, m: int) -> None:
    min_n = sizes[0]
    max_n = min(4, min_n + sizes[1])
    index = PromptLookup(min_n, max_n)
    seen: list[int] = []
    for chunk in chunks:
        index.extend(chunk)
        seen += chunk
        assert len(index) == len(seen)
        assert index.propose(m) == brute_force(seen, min_n, max_n, m)
    index.clear()
    assert len(index) == 0 and index.propose(m) == []


def test_config_cuts_the_path_to_leave_the_beam_a_node() -> None:
    config = PromptLookupConfig(max_tokens=4)
    index = config.new_index()
    index.extend([1, 2, 3, 4, 5, 6, 7, 1, 2])
    np.testing.assert_array_equal(config.path(index, 60), [3, 4, 5, 6])
    np.testing.assert_array_equal(config.path(index, 3), [3, 4])
    assert config.path(index, 1) is None
    index.extend([9])
    assert config.path(index, 60) is None  # "9" never occurred before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens = 0"),
        ({"min_ngram": 0}, "n-gram sizes 0..3"),
        ({"min_ngram": 3, "max_ngram": 2}, "n-gram sizes 3..2"),
        ({"max_ngram": 5}, "n-gram sizes 1..5"),
        ({"max_tokens": 2.5}, "max_tokens = 2.5"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace(".", r"\.")):
        PromptLookupConfig(**kwargs)


def test_parse_and_bad_tokens() -> None:
    assert parse_prompt_lookup(None) is None
    assert parse_prompt_lookup(0) is None
    assert parse_prompt_lookup(5) == PromptLookupConfig(max_tokens=5)
    config = PromptLookupConfig(min_ngram=2)
    assert parse_prompt_lookup(config) is config
    for bad in (-1, True, "8"):
        with pytest.raises(InvalidArgumentError, match="prompt_lookup"):
            parse_prompt_lookup(bad)  # type: ignore[arg-type]
    with pytest.raises(TokenOutOfVocabError, match=r"tokens\[1\] = -3"):
        PromptLookup().extend([4, -3])
    with pytest.raises(ValueError, match="n-gram sizes"):
        PromptLookup(2, 1)
