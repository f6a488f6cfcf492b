"""Attention for a draft tree (a few dozen queries) over a long cache, on the CPU.

Verifying a tree asks attention a different question than a prompt does: a few dozen tokens
against hundreds of cached keys. PyTorch's CPU ``scaled_dot_product_attention`` (a flash
kernel, tiled for long query blocks) is slow at that shape: two matmuls and a softmax take
about half its time (measurements: ``docs/performance-notes.md``).

:func:`small_query_attention` computes those shapes directly. In bf16 on CPUs with AVX-512 or
AVX2+FMA it calls DART's own kernel (``dart_kernels::attention``) for every query count up to
:data:`MAX_QUERIES`, one query included: each query from its own visible keys, in order, so
with DART's matmul (:mod:`dart_client.models.linear`) a tree's logits are one-token
decoding's bit for bit, and greedy DART reproduces greedy decoding exactly on the CPU. It
costs about what the paths below cost. Otherwise (other dtypes, CPUs
without them) it works in float32 (float64 for float64 models), at least as exact as the
flash kernel: the query heads that share a
key/value head become extra query rows of it (no copies of K/V), the mask is broadcast over
them. One query (transformers already packs it well), long query blocks (prompts), dropout,
soft-capping and GPUs go to transformers' own SDPA path. It is registered with transformers'
``AttentionInterface`` under :data:`NAME`, the extension point transformers provides, so no
modeling file is copied.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from dart_client import _native
from dart_client.models import gpu_kernels
from dart_client.models.native import DECODING_ROWS, SIMD_KERNELS, bf16_bits

NAME = "dart_small_query"
#: Longer query blocks (prompts) go to SDPA, which wins there; so does a single query outside
#: DART's kernel.
MAX_QUERIES = DECODING_ROWS


def small_query_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` (b, h, n, d), ``key`` /
    ``value`` (b, kv, L, d), ``attention_mask`` float (0 = attend) or bool (True = attend),
    (b | 1, 1 | h, n, >= L), or None (causal when n > 1). Returns (b, n, h, d)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, n, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    if query.device.type == "cuda" and _gpu_tree_attention(
        query, key, value, attention_mask, dropout, kwargs
    ):
        assert attention_mask is not None
        return gpu_kernels.tree_attention(query, key, value, attention_mask, scaling), None
    # What neither direct path computes: transformers' SDPA path takes it.
    sdpa_only = (
        query.device.type != "cpu"
        or n > MAX_QUERIES
        or h % kv
        or dropout
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("sliding_window") is not None
        or (torch.is_grad_enabled() and query.requires_grad)
    )
    if not sdpa_only and SIMD_KERNELS and query.dtype == key.dtype == value.dtype == torch.bfloat16:
        return _native_attention(query, key, value, attention_mask, scaling), None
    if sdpa_only or n == 1:
        # Static caches hand a mask as long as the cache; SDPA wants it as long as the keys.
        if attention_mask is not None and attention_mask.shape[-1] != length:
            attention_mask = attention_mask[..., :length]
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    groups = h // kv
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    # Query heads 0..groups-1 read K/V head 0, and so on: rows of their K/V head.
    q = query.reshape(b, kv, groups * n, d).to(compute)
    scores = torch.matmul(q, key.to(compute).transpose(-1, -2)).view(b, kv, groups, n, length)
    scores.mul_(scaling if scaling is not None else d**-0.5)
    if attention_mask is None:
        if n > 1:
            blocked = torch.ones((n, n), dtype=torch.bool, device=query.device).triu(1)
            scores[..., length - n :].masked_fill_(blocked, float("-inf"))
    else:
        mask = attention_mask[..., :length]
        shape = (
            (mask.shape[0], 1, 1, n, length)
            if mask.shape[1] == 1
            else (mask.shape[0], kv, groups, n, length)
        )
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask.reshape(shape), float("-inf"))
        else:
            scores.add_(mask.reshape(shape).to(compute))
    probs = torch.softmax(scores, dim=-1).view(b, kv, groups * n, length)
    out = torch.matmul(probs, value.to(compute)).view(b, h, n, d)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def _gpu_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """Whether :func:`~dart_client.models.gpu_kernels.tree_attention` computes this (a cuda
    model switched by :func:`use_small_query_attention` with ``gpu=True``): a float mask of
    4 axes, K/V heads sharing the query heads, a power-of-two head size, no extras."""
    h, kv, d = query.shape[1], key.shape[1], query.shape[3]
    return (
        attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.is_floating_point()
        and not dropout
        and h % kv == 0
        and d >= 16
        and d & (d - 1) == 0
        and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "sliding_window"))
        and gpu_kernels.applies(query, key, value)
    )


def _native_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """``dart_kernels::attention`` (bf16, AVX-512 or AVX2): each query from its own visible keys in
    order, so a tree node's output has the bits of decoding its path one token at a time
    (with DART's matmul, the whole forward does). (b, n, h, d), like transformers' SDPA."""
    b, h, n, d = query.shape
    length = key.shape[2]
    mask = None if attention_mask is None else mask_bits(attention_mask, length)
    out = torch.empty((b, n, h, d), dtype=torch.bfloat16)
    _native.tree_attention(
        bf16_bits(query),
        bf16_bits(key),
        bf16_bits(value),
        out.view(torch.uint16).numpy(),
        mask,
        scaling if scaling is not None else d**-0.5,
        torch.get_num_threads(),
    )
    return out


def mask_bits(attention_mask: torch.Tensor, length: int) -> np.ndarray:
    """The kernel's mask (bf16 bits, 4-D, additive) for ``attention_mask``'s first ``length``
    keys. Every layer of a forward gets the same mask: the last conversion is kept, keyed by
    the tensor itself and its version (an in-place change is a new version)."""
    global _last_mask
    key = (attention_mask, attention_mask._version, length)
    last = _last_mask
    if last is not None and last[0][0] is key[0] and last[0][1:] == key[1:]:
        return last[1]
    mask = attention_mask[..., :length]
    if mask.dtype == torch.bool:
        blocked = torch.finfo(torch.bfloat16).min
        mask = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill_(~mask, blocked)
    elif mask.dtype != torch.bfloat16:
        mask = mask.to(torch.bfloat16)
    if mask.dim() != 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    bits = bf16_bits(mask)
    _last_mask = (key, bits)
    return bits


#: :func:`mask_bits`' last conversion: ((mask, version, length), bits).
_last_mask: tuple[tuple[torch.Tensor, int, int], np.ndarray] | None = None


def register() -> str:
    """Make :data:`NAME` known to transformers (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, small_query_attention)
    # Masks built by transformers itself (its own generate) take SDPA's form, which
    # small_query_attention reads (and hands to SDPA for long blocks).
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_small_query_attention(model: nn.Module, gpu: bool = False) -> str | None:
    """Switch ``model`` (a transformers model on the CPU; ``gpu``: on cuda, for the Triton
    tree attention) to :data:`NAME`; returns the implementation it had (for
    :func:`restore_attention`), or None when left alone (not on that device, or no attention
    implementation to switch)."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    first = next(model.parameters(), None)
    if previous is None or first is None or first.device.type != ("cuda" if gpu else "cpu"):
        return None
    if previous == NAME:
        return None
    _set_implementation(model, register())
    return str(previous)


def restore_attention(model: nn.Module, previous: str) -> None:
    """Undo :func:`use_small_query_attention`."""
    _set_implementation(model, previous)


def _set_implementation(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:  # older transformers: the modules read the config at each call
        model.config._attn_implementation = name


def decoding_sdpa(device: torch.device) -> AbstractContextManager[Any]:
    """The SDPA backends decoding uses on ``device``: on cuda the flash and memory-efficient
    kernels, math as the fallback, never cuDNN's, which PyTorch picks first on Hopper and
    which builds a plan for every new sequence length (50-60 ms each on an H100 and an H200:
    a decoding loop's lengths are always new, and the static path's graphs need kernels that
    take any mask); elsewhere PyTorch's own choice."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )
