"""The annealed KL loss: row ``j`` of the draft against the target, weighted ``gamma**j``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RowStats:
    """Per-row sums over one batch, reduced across processes before use."""

    kl_sum: torch.Tensor  # (d,) float64
    correct: torch.Tensor  # (d,) float64, top-1 agreement with the target
    count: torch.Tensor  # (d,) float64, targets per row


def distinct_targets(
    logits: torch.Tensor, batch: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits at each distinct ``(batch, pos)`` once, and for every line the row
    of its own there: ``(logits[ub, up], inverse)``. Lines share targets (a position is the
    target of several anchors' rows, or of every TTT step), so the loss's softmax, exp and
    argmax over the vocabulary then run once per target, not once per line."""
    key = batch * logits.shape[1] + pos
    distinct, inverse = torch.unique(key, sorted=True, return_inverse=True)
    return logits[distinct // logits.shape[1], distinct % logits.shape[1]], inverse


def annealed_kl(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    num_rows: int,
    gamma: float,
    target_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RowStats]:
    """Loss ``sum_j gamma**j * mean_{targets of row j} KL(p_target || p_draft)``.

    ``draft_logits`` and ``target_logits`` are ``(N, V)`` over the same (draft) vocabulary,
    one line per target; ``rows`` ``(N,)`` gives each line's row ``j`` in ``[0, num_rows)``;
    ``weights`` ``(N,)`` is 1 for a real target and 0 for padding. The target's distribution
    is the softmax over the draft vocabulary, i.e. renormalised after restriction.

    Each row is averaged over its own targets, so the rows' relative weights are exactly the
    ``gamma**j`` of the paper whatever the number of anchors.

    With ``target_rows`` (``(N,)``, from :func:`distinct_targets`), ``target_logits`` holds
    each distinct target once and line ``i``'s is row ``target_rows[i]``: the same values,
    with the target's softmax computed once per distinct target.
    """
    shared = target_rows is not None
    want = (draft_logits.shape[0], target_logits.shape[1]) if shared else tuple(target_logits.shape)
    if tuple(draft_logits.shape) != want or (shared and target_rows.shape != rows.shape):
        raise ValueError(
            f"draft logits {tuple(draft_logits.shape)} vs target logits "
            f"{tuple(target_logits.shape)}"
            + (f" with {tuple(target_rows.shape)} target rows" if shared else "")
            + "; expected the same shape"
        )
    # At least float32 (bf16 logits lose the small KL terms); float64 stays float64.
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    log_q = F.log_softmax(draft_logits.to(dtype), dim=-1)
    log_p = F.log_softmax(target_logits.to(dtype), dim=-1)
    p = log_p.exp()
    target_argmax = target_logits.argmax(-1)
    if shared:
        log_p, p, target_argmax = log_p[target_rows], p[target_rows], target_argmax[target_rows]
    kl = (p * (log_p - log_q)).sum(-1) * weights.to(dtype)
    one_hot = F.one_hot(rows, num_rows).to(kl.dtype) * weights[:, None]
    per_row_sum = one_hot.T @ kl
    count = one_hot.sum(0)
    per_row_mean = per_row_sum / count.clamp_min(1.0)
    gammas = gamma ** torch.arange(num_rows, dtype=kl.dtype, device=kl.device)
    loss = (gammas * per_row_mean).sum()
    with torch.no_grad():
        agree = (draft_logits.argmax(-1) == target_argmax).to(kl.dtype) * weights
        stats = RowStats(
            kl_sum=per_row_sum.detach().double(),
            correct=(one_hot.T @ agree).double(),
            count=count.double(),
        )
    return loss, stats
