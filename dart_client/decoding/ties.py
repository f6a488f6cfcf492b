"""Where a greedy decoding leaves another of the same target: the target's top-2 margin there,
and whether it is a numerical near-tie.

Greedy DART promises the target's own greedy output. In bf16 or fp32 on kernels that round
a tree forward differently from a one-token forward (a GPU's, transformers' own), the two can
part only where the target's two best logits are within the dtype's rounding: a near-tie.
:func:`divergence` measures that margin with one plain forward of the target, so that a
benchmark or a test can tell a tie from a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: A divergence is a near-tie when the top-2 margin is within this many units of the
#: dtype's resolution at the logits' scale (bf16 and fp16 keep 8-11 mantissa bits, fp32 24).
NEAR_TIE_ULPS = {torch.bfloat16: 4.0, torch.float16: 4.0, torch.float32: 4096.0}


def first_divergence(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first token where ``got`` and ``want`` differ (None if equal)."""
    if list(got) == list(want):
        return None
    return next(
        (j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
        min(len(got), len(want)),
    )


def top2_margin(model: Any, ids: Sequence[int]) -> tuple[float, float]:
    """The target's top-2 logit margin after ``ids`` (one plain forward of the transformers
    ``model``) and the top logit's magnitude (the scale its rounding works at)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]), float(top[0].abs())


@dataclass(frozen=True)
class Divergence:
    """Where two decodings part: the token index, the target's top-2 margin there and the
    largest margin that counts as a near-tie (``ulps`` units of the dtype's resolution at
    the logits' scale)."""

    index: int
    margin: float
    threshold: float

    @property
    def near_tie(self) -> bool:
        return self.margin <= self.threshold

    def to_dict(self) -> dict[str, Any]:
        """The record benchmarks write (``token`` is the index)."""
        return {
            "token": self.index,
            "margin": self.margin,
            "threshold": self.threshold,
            "near_tie": self.near_tie,
        }


def divergence(
    model: Any,
    prompt: Sequence[int],
    got: Sequence[int],
    want: Sequence[int],
    ulps: float | None = None,
) -> Divergence | None:
    """Where ``got`` leaves ``want`` (both continuations of ``prompt``), with the target's
    top-2 margin after ``prompt + want[:index]``; None when they are equal. ``ulps``: the
    tie threshold in units of the model's dtype resolution (default :data:`NEAR_TIE_ULPS`)."""
    index = first_divergence(got, want)
    if index is None:
        return None
    dtype = model.dtype
    if ulps is None:
        ulps = NEAR_TIE_ULPS.get(dtype, 4096.0)
    margin, scale = top2_margin(model, [*prompt, *want[:index]])
    return Divergence(index, margin, ulps * torch.finfo(dtype).eps * max(scale, 1.0))
