"""Draft rows: the native top-k over the head's logits (bf16 bits or float32) and
``draft_rows`` on a real head forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dart_client.decoding.draft import draft_rows, top_k_rows
from dart_client.models.head import DartHead
from dart_client.ngram.pruner import PrunerError


def reference_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k largest values, largest first, equal values by lower index."""
    cols = np.arange(logits.shape[1])
    return np.stack([np.lexsort((cols, -row))[:k] for row in logits])


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


@settings(max_examples=300, deadline=None)
@given(
    values=hnp.arrays(
        np.int8,
        st.tuples(st.integers(1, 5), st.integers(1, 200)),
        elements=st.integers(-6, 6),
    ),
    k_frac=st.floats(0, 1),
    scale=st.sampled_from([0.25, 1.0, 3.5]),
    bf16=st.booleans(),
)
def test_native_top_k_is_the_definition(
    values: np.ndarray, k_frac: float, scale: float, bf16: bool
) -> None:
    # Few distinct values: ties everywhere, as in bf16 logits.
    logits = torch.from_numpy(values.astype(np.float32) * scale)
    if bf16:
        logits = logits.to(torch.bfloat16)
    rows, vocab = logits.shape
    k = 1 + int((vocab - 1) * k_frac)
    d2t = np.random.default_rng(0).permutation(100_000)[:vocab].astype(np.uint32)
    raw = bf16_bits(logits) if bf16 else logits.numpy()
    ids, probs = top_k_rows(raw, k, d2t)

    exact = logits.float().numpy()
    want = reference_top_k(exact, k)
    assert ids.dtype == np.int64 and ids.shape == (rows, k)
    np.testing.assert_array_equal(ids, d2t[want].astype(np.int64))
    chosen = torch.from_numpy(np.take_along_axis(exact, want, axis=1))
    np.testing.assert_allclose(probs, torch.softmax(chosen, dim=-1).numpy(), rtol=1e-5, atol=1e-7)
    # Without a map the ids are the columns.
    np.testing.assert_array_equal(top_k_rows(raw, k)[0], want)


def test_native_top_k_rejects_bad_input() -> None:
    logits = np.zeros((2, 5), dtype=np.float32)
    with pytest.raises(PrunerError, match="k = 6"):
        top_k_rows(logits, 6)
    with pytest.raises(PrunerError, match="k = 0"):
        top_k_rows(logits, 0)
    with pytest.raises(PrunerError, match="float32, or of uint16"):
        top_k_rows(logits.astype(np.int32), 2)
    with pytest.raises(PrunerError, match="contiguous"):
        top_k_rows(np.zeros((5, 2), dtype=np.float32).T, 2)
    with pytest.raises(PrunerError, match="draft_to_target has 3 entries"):
        top_k_rows(logits, 2, np.arange(3, dtype=np.uint32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_draft_rows_are_the_top_k_of_the_heads_logits(dtype: torch.dtype) -> None:
    """bf16/fp32 take the native path, fp64 PyTorch's: both give the definition's rows."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=500, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=4,
    )  # fmt: skip
    vocab = torch.randperm(500, generator=torch.Generator().manual_seed(0))[:200].sort().values
    head = DartHead.random_init(config, draft_length=3, draft_vocab=vocab, seed=1).to(dtype)
    head.bind_embedding(torch.nn.Embedding(500, 32).to(dtype))
    g = torch.Generator().manual_seed(2)
    taps = torch.randn((1, 6, 96), generator=g).to(dtype)
    nxt = torch.randint(0, 500, (1, 6), generator=g)

    cache = head.new_cache(16)
    with torch.no_grad():
        logits = head(taps, nxt, head.new_cache(16))[0]
    rows = draft_rows(head, cache, taps, nxt, k=7)

    exact = logits.double().numpy()
    want = reference_top_k(exact, 7)
    np.testing.assert_array_equal(rows.ids, vocab.numpy()[want])
    chosen = torch.from_numpy(np.take_along_axis(exact, want, axis=1))
    np.testing.assert_allclose(rows.probs, torch.softmax(chosen, dim=-1).numpy(), rtol=1e-4)
    assert rows.ids.dtype == np.int64 and rows.levels == 4 and cache.length == 6
