"""Small-query attention against a direct float64 computation, and its use in a target."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client.models.attention import NAME, small_query_attention
from dart_client.models.target import TargetModel


class Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per head, in float64: softmax(q k^T * scale over the allowed keys) v; (b, n, h, d)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 40),
    past=st.integers(0, 70),
    kv=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 3]),
    kind=st.sampled_from(["float", "bool", "none", "per_head"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_small_query_attention_matches_a_direct_computation(
    n: int, past: int, kv: int, groups: int, kind: str, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    h, d, length = kv * groups, 8, past + n
    q = torch.randn(1, n, h, d, generator=g).to(dtype).transpose(1, 2)  # as transformers does
    k = torch.randn(1, kv, length, d, generator=g).to(dtype)
    v = torch.randn(1, kv, length, d, generator=g).to(dtype)
    # A random tree-like mask: every query sees the cache, itself and some earlier new keys.
    allowed = torch.ones(n, length, dtype=torch.bool)
    allowed[:, past:] = (torch.rand(n, n, generator=g) < 0.5).tril()
    allowed[:, past:] |= torch.eye(n, dtype=torch.bool)
    if kind == "none":
        allowed[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        mask = None
        want_mask = allowed.view(1, 1, n, length)
    elif kind == "bool":
        mask = allowed.view(1, 1, n, length)
        want_mask = mask
    elif kind == "per_head":
        per_head = allowed.expand(h, n, length).clone()
        per_head[0, :, 0] = False if past else per_head[0, :, 0]
        mask = torch.zeros(1, h, n, length, dtype=dtype).masked_fill(
            ~per_head, torch.finfo(dtype).min
        )
        want_mask = per_head.view(1, h, n, length)
    else:
        # Longer than the keys, as static caches give it: only the first `length` count.
        wide = torch.cat([allowed, torch.zeros(n, 5, dtype=torch.bool)], dim=1)
        mask = torch.zeros(1, 1, n, length + 5, dtype=dtype).masked_fill(
            ~wide, torch.finfo(dtype).min
        )
        want_mask = allowed.view(1, 1, n, length)
    got, weights = small_query_attention(Attn(groups), q, k, v, mask, scaling=d**-0.5)
    assert weights is None and got.dtype == dtype and got.shape == (1, n, h, d)
    assert got.is_contiguous()
    want = reference(q, k, v, want_mask, d**-0.5)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("n", [1, 65])
def test_one_query_and_long_blocks_go_to_sdpa(n: int) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, 4, n, 8, generator=g)
    k = torch.randn(1, 2, n + 3, 8, generator=g)
    v = torch.randn(1, 2, n + 3, 8, generator=g)
    mask = torch.zeros(1, 1, n, n + 3)
    mask[..., 3:] = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
    got, _ = small_query_attention(Attn(2), q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(Attn(2), q, k, v, mask, scaling=0.3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_target_forward_with_small_query_attention_is_the_sdpa_one(arch: str) -> None:
    """A tree-sized forward over a cache: switched on by TargetModel, the same logits as
    SDPA in float64 (transformers' eager attention is no reference: its softmax runs in
    float32 even for float64 models), switched back by close()."""
    model = make_tiny_target(arch, seed=3, attn="sdpa")
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    target = TargetModel(model)
    assert model.config._attn_implementation == NAME and target.replaced_attention == "sdpa"
    cache = target.new_cache(64)
    first, _ = target.forward(ids[:, :28], torch.arange(28).unsqueeze(0), cache, taps=False)
    rest, _ = target.forward(ids[:, 28:], torch.arange(28, 40).unsqueeze(0), cache, taps=False)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), want, rtol=0, atol=1e-10)
    target.close()
    assert model.config._attn_implementation == "sdpa"
    plain = TargetModel(make_tiny_target(arch), cpu_kernels=False)
    assert plain.model.config._attn_implementation == "eager"
    assert plain.replaced_attention is None
