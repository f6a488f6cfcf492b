"""The prefix-shared attention mask of masked training.

One head forward trains many prefixes of one sequence. The head's input is laid out as
``[real_0 .. real_{n-1}, block(a_0), block(a_1), ...]`` where real position ``t`` carries
``(h_t, x_{t+1})`` and ``block(a)`` is ``m`` MASK slots for anchor ``a``. A real position sees
real positions up to itself (causal). Slot ``i`` (1-based) of ``block(a)`` sees real positions
``<= a`` and slots ``1..i`` of its own block, never another block; its position id is
``a + i``, continuing from the anchor as at inference, where the MASK slots follow the last
real position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def prefix_shared_layout(
    n_real: int, anchors: Sequence[int], m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``(L, L)`` attention permission (query, key) and ``(L,)`` position ids,
    ``L = n_real + len(anchors) * m``."""
    anchors_t = torch.as_tensor(list(anchors), dtype=torch.long)
    if anchors_t.numel() and (anchors_t.min() < 0 or anchors_t.max() >= n_real):
        raise ValueError(
            f"anchors must lie in [0, {n_real}); got {anchors_t.min()}..{anchors_t.max()}"
        )
    p = anchors_t.numel()
    total = n_real + p * m
    # Per position: its anchor (real: itself), its block (-1 for real) and slot (0 for real).
    slot = torch.arange(1, m + 1).repeat(p)
    block = torch.arange(p).repeat_interleave(m)
    anchor = torch.cat([torch.arange(n_real), anchors_t.repeat_interleave(m)])
    block = torch.cat([torch.full((n_real,), -1), block])
    slot = torch.cat([torch.zeros(n_real, dtype=torch.long), slot])
    is_real_k = block[None, :] < 0
    # Real keys: visible when at or before the query's anchor.
    see_real = is_real_k & (torch.arange(total)[None, :] <= anchor[:, None])
    # Mask keys: same block as the query and not after it.
    see_mask = (~is_real_k) & (block[None, :] == block[:, None]) & (slot[None, :] <= slot[:, None])
    allowed = see_real | see_mask
    positions = anchor + slot
    return allowed, positions


def batch_layout(
    n_reals: Sequence[int], anchors: Sequence[Sequence[int]], m: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded batch of layouts: float mask ``(B, 1, L, L)`` (0 = attend, dtype-min =
    blocked), positions ``(B, L)`` and a ``(B, L)`` validity mask. Padding queries see
    only themselves so their softmax stays finite; nothing real sees them."""
    layouts = [prefix_shared_layout(n, a, m) for n, a in zip(n_reals, anchors, strict=True)]
    length = max(al.shape[0] for al, _ in layouts)
    b = len(layouts)
    allowed = torch.zeros(b, length, length, dtype=torch.bool)
    positions = torch.zeros(b, length, dtype=torch.long)
    valid = torch.zeros(b, length, dtype=torch.bool)
    eye = torch.eye(length, dtype=torch.bool)
    for i, (al, pos) in enumerate(layouts):
        n = al.shape[0]
        allowed[i] = eye
        allowed[i, :n, :n] = al
        positions[i, :n] = pos
        valid[i, :n] = True
    mask = torch.zeros(b, 1, length, length, dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return mask, positions, valid


def sample_anchors(
    loss_mask: np.ndarray, m: int, count: int, generator: np.random.Generator
) -> list[int]:
    """Up to ``count`` distinct anchors, sorted, each with at least one MASK-row target.

    Anchor ``a``'s row ``j`` predicts token ``a + 2 + j``; rows ``1..m`` need those tokens in
    the window and inside an assistant turn.
    """
    n = len(loss_mask)
    if m == 0 or count <= 0 or n < 4:
        return []
    n_real = n - 1
    candidates = [
        a
        for a in range(n_real)
        if any(a + 2 + j < n and loss_mask[a + 2 + j] for j in range(1, m + 1))
    ]
    if not candidates:
        return []
    k = min(count, len(candidates))
    picked = generator.choice(len(candidates), size=k, replace=False)
    return sorted(candidates[int(i)] for i in picked)
