"""Drafting: one head forward -> the top-k draft tokens of every row, in target ids.

Row 0 sits at the last real position and predicts the token after the one just sampled;
row j predicts the one j further. Per row the top-k logits over the draft vocabulary are
kept, softmaxed over those k only (as the reference does), and mapped to target ids with
``d2t``. The rows are returned on the CPU, contiguous, ready for the Rust pruner. Equal
logits rank by the lower draft id (the native top-k's order; a GPU's ``torch.topk`` may
order ties differently, which changes the draft, never the output).
"""

from __future__ import annotations

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
