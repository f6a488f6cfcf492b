"""Drafting: one head forward -> the top-k draft tokens of every row, in target ids.

Row 0 sits at the last real position and predicts the token after the one just sampled;
row j predicts the one j further. Per row the top-k logits over the draft vocabulary are
kept, softmaxed over those k only (as the reference does), and mapped to target ids with
``d2t``. The rows are returned on the CPU, contiguous, ready for the Rust pruner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dart_client.models.head import DartHead, HeadCache


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
    # top-k in the head's own dtype (no float copy of every row), softmax over k in float32.
    top = torch.topk(logits, k, dim=-1)
    probs = torch.softmax(top.values.float(), dim=-1)
    ids = head.draft_to_target_numpy[top.indices.cpu().numpy()]
    return DraftRows(ids=ids, probs=probs.cpu().numpy())
