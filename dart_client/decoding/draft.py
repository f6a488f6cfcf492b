"""Drafting: one head forward -> the top-k draft tokens of every row, in target ids.

Row 0 sits at the last real position and predicts the token after the one just sampled;
row j predicts the one j further. Per row the top-k logits over the draft vocabulary are
kept, softmaxed over those k only (as the reference does), and mapped to target ids with
``d2t``. The rows are returned on the CPU, contiguous, ready for the Rust pruner. Equal
logits rank by the lower draft id (the native top-k's order; a GPU's ``torch.topk`` may
order ties differently, which changes the draft, never the output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dart_client._native import top_k_rows
from dart_client.models.head import DartHead, HeadCache
from dart_client.models.native import bf16_bits

#: Logit dtypes the native top-k reads on the CPU (bf16 as its bits).
NATIVE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class DraftRows:
    """Top-k draft candidates per level: ``ids`` (L, k) int64 target ids, ``probs`` (L, k)."""

    ids: np.ndarray
    probs: np.ndarray

    @property
    def levels(self) -> int:
        return int(self.ids.shape[0])


@torch.no_grad()
def draft_rows(
    head: DartHead,
    cache: HeadCache,
    taps: torch.Tensor,
    next_ids: torch.Tensor,
    k: int,
    num_masks: int | None = None,
) -> DraftRows:
    """Run the head over r new real positions (+ mask slots) and keep the top-k per row.

    ``taps`` (1, r, 3H) are the target's tapped states at those positions and ``next_ids``
    (1, r) the token following each (the last is the token just sampled).
    """
    logits = head(taps.to(head.fc.weight.dtype), next_ids, cache, num_masks=num_masks)[0]
    return top_k_draft(head, logits, k)


def left_padded(
    pads: Sequence[int], n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths in one ``(b, n)`` block, each right-aligned after ``pads[b]``
    padding slots (so every row's last entries are the block's last columns): each slot's
    offset from its row's first real slot ``(b, n)`` (0 on padding), and who sees whom
    ``(b, query, key)``: a real slot sees its row's real slots up to itself, a padding slot
    only itself (a well-defined softmax), and nothing sees a padding slot."""
    pad = torch.tensor(list(pads), dtype=torch.long, device=device).unsqueeze(1)
    slot = torch.arange(n, device=device).unsqueeze(0)
    real = slot >= pad
    sees = (slot.unsqueeze(2) >= slot.unsqueeze(1)) & real.unsqueeze(1)
    sees |= torch.eye(n, dtype=torch.bool, device=device)
    return (slot - pad).clamp_min(0), sees


def top_k_draft(head: DartHead, logits: torch.Tensor, k: int) -> DraftRows:
    """The top-k of draft ``logits`` (rows, draft_vocab) as :class:`DraftRows`."""
    k = min(k, logits.shape[-1])
    d2t = head.draft_to_target_numpy
    if logits.device.type == "cpu" and logits.dtype in NATIVE_DTYPES:
        # One native pass (top-k, softmax over k, target ids) instead of five PyTorch and
        # numpy calls, each slow with the caches cold after the verify.
        array = logits.contiguous()
        raw = bf16_bits(array) if array.dtype == torch.bfloat16 else array.numpy()
        ids, probs = top_k_rows(raw, k, d2t)
        return DraftRows(ids=ids, probs=probs)
    # On a GPU the rows are reduced where they are; only k per row come back.
    top = torch.topk(logits, k, dim=-1)
    probs = torch.softmax(top.values.float(), dim=-1)
    ids = d2t[top.indices.cpu().numpy()].astype(np.int64)
    return DraftRows(ids=ids, probs=probs.cpu().numpy())


@torch.no_grad()
def draft_rows_batch(
    head: DartHead,
    cache: HeadCache,
    taps: Sequence[torch.Tensor],
    next_ids: Sequence[Sequence[int]],
    k: int,
) -> list[DraftRows]:
    """:func:`draft_rows` for every live row of a batched head cache in one head forward.

    Row b brings ``taps[b]`` (r_b, 3H) and ``next_ids[b]`` (r_b tokens). The rows are
    left-padded to the longest r, so that each row's last real position and mask slots are
    the forward's last ``m + 1`` rows; a padding entry sees only itself and nothing sees it.
    Each row's positions continue its own length; afterwards the cache holds each row's
    real positions only.
    """
    device = cache_device = taps[0].device
    lengths = torch.tensor(cache.rows.lengths, dtype=torch.long, device=device)
    b = len(taps)
    m = head.config.draft_length
    width = max(t.shape[0] for t in taps)
    n = width + m
    pads = [width - t.shape[0] for t in taps]
    dtype = head.fc.weight.dtype
    padded = torch.zeros((b, width, taps[0].shape[-1]), dtype=dtype, device=device)
    ids = torch.zeros((b, width), dtype=torch.long, device=device)
    for row, (t, nxt, pad) in enumerate(zip(taps, next_ids, pads, strict=True)):
        padded[row, pad:] = t.to(dtype)
        ids[row, pad:] = torch.tensor(list(nxt), dtype=torch.long)
    offsets, sees = left_padded(pads, n, device)
    positions = lengths.unsqueeze(1) + offsets
    past = cache.length
    blocked = torch.finfo(dtype).min
    mask = torch.zeros((b, n, past + n), dtype=dtype, device=cache_device)
    mask[:, :, past:].masked_fill_(~sees, blocked)
    mask[:, :, :past].masked_fill_(cache.rows.stale(past, device).unsqueeze(1), blocked)
    logits = head(padded, ids, cache, positions=positions, mask=mask.unsqueeze(1))
    cache.keep_rows(past, [range(p, width) for p in pads], device)
    rows = top_k_draft(head, logits.reshape(b * (m + 1), -1), k)
    kk = rows.ids.shape[-1]
    ids3, probs3 = rows.ids.reshape(b, m + 1, kk), rows.probs.reshape(b, m + 1, kk)
    return [DraftRows(ids=ids3[i], probs=probs3[i]) for i in range(b)]
