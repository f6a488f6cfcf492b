"""EAGLE-3's drafter: its dynamic draft tree, verified like any other draft tree.

After the head has read the newly accepted positions (:meth:`Eagle3Drafter.feed`), the tree
grows as the published ``topK_genrate`` grows it:

1. the top-``k`` tokens of the last position's draft distribution are the root's children,
   scored by their log-probability, and the first frontier;
2. ``depth`` times: one head forward over the ``k`` frontier nodes (each sees the real
   positions, its ancestors and itself, at position ``base + level``; its hidden input is
   its parent's output); each node's top-``k`` children are scored by their cumulative
   log-probability, and the ``k`` best of those ``k * k`` are the next frontier;
3. of every candidate produced (``k + depth * k * k``), the ``budget`` best by cumulative
   score form the tree (ties to the earlier candidate, so a parent always precedes its
   children and the tree is prefix-closed).

The tree is a draft only: verification, acceptance (greedy exact, sampling by recursive
rejection) and the KV compaction are the generation loop's, the same as for DART's trees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dart_client.decoding.verify import Tree
from dart_client.errors import InvalidArgumentError
from dart_client.models.eagle3 import Eagle3Head
from dart_client.models.head import HeadCache


@dataclass(frozen=True)
class Eagle3TreeConfig:
    """The published defaults: ``total_tokens=60`` (the root included, so 59 draft nodes),
    ``depth=7``, ``top_k=10``."""

    top_k: int = 10
    depth: int = 7
    total_tokens: int = 60

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"EAGLE-3 tree {name} = {value!r}; expected an int >= 1")

    @property
    def budget(self) -> int:
        """Draft nodes per tree, the root not counted (the loop's ``tree_budget``)."""
        return self.total_tokens - 1


class Eagle3Drafter:
    """The :class:`~dart_client.decoding.loop.Drafter` of an :class:`Eagle3Head`: one per
    generation (it holds the last position's hidden state between steps)."""

    #: Growing the tree is draft-model forwards: timed as drafting, not as pruning.
    tree_stage = "draft"

    def __init__(self, head: Eagle3Head, config: Eagle3TreeConfig | None = None) -> None:
        self.head = head
        self.config = config or Eagle3TreeConfig()
        self.last: torch.Tensor | None = None
        self.cache: HeadCache | None = None

    def cache_capacity(self, max_length: int) -> int:
        """Real positions plus the nodes one tree's growth appends."""
        return max_length + self.config.depth * self.config.top_k

    def new_cache(self, capacity: int) -> HeadCache:
        return self.head.new_cache(capacity)

    @torch.no_grad()
    def feed(self, cache: HeadCache, taps: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Read r new real positions: ``taps`` (1, r, 3H), ``next_ids`` (1, r)."""
        out = self.head(taps.to(self.head.fc.weight.dtype), next_ids, cache)
        self.last = out[0, -1]
        self.cache = cache

    @torch.no_grad()
    def tree(self, context: np.ndarray, budget: int, lookup_path: Any = None) -> Tree:
        """The dynamic tree under root ``context[-1]`` with at most ``budget`` draft nodes
        (``lookup_path`` is not used: EAGLE-3 drafts from its head alone)."""
        root = int(context[-1])
        if budget <= 0:
            return Tree.root_only(root)
        if self.last is None or self.cache is None:
            raise RuntimeError("feed() the accepted positions before growing a tree")
        head, cache = self.head, self.cache
        draft_to_target = head.draft_to_target
        k = min(self.config.top_k, head.config.draft_vocab_size)
        base = cache.length
        logp = torch.log_softmax(head.logits(self.last[None]).float(), dim=-1)[0]
        top = torch.topk(logp, k)
        scores = [top.values]
        tokens = [top.indices]
        parents = [torch.full((k,), -1, dtype=torch.long, device=logp.device)]
        front = torch.arange(k, device=logp.device)  # candidate indices of the frontier
        front_scores, front_ids = top.values, top.indices
        front_hidden = self.last[None].expand(k, -1)
        visible = torch.zeros((k, 0), dtype=torch.bool, device=logp.device)
        produced = k
        eye = torch.eye(k, dtype=torch.bool, device=logp.device)
        try:
            for level in range(self.config.depth):
                if produced >= budget and float(front_scores.max()) < _kth(scores, budget):
                    # No frontier node's descendants can outscore the budget-th candidate
                    # (a child never scores above its parent): the tree cannot change.
                    break
                out = head.expand(
                    front_hidden, draft_to_target[front_ids], base + level, cache, visible
                )
                logp = torch.log_softmax(head.logits(out).float(), dim=-1)
                top = torch.topk(logp, k)
                cumulative = (top.values + front_scores[:, None]).flatten()
                scores.append(cumulative)
                tokens.append(top.indices.flatten())
                parents.append(front.repeat_interleave(k))
                best = _best(cumulative, k)
                rows = best // k
                front = produced + best
                produced += k * k
                front_scores = cumulative[best]
                front_ids = top.indices.flatten()[best]
                front_hidden = out[rows]
                visible = torch.cat((visible[rows], eye[rows]), dim=1)
        finally:
            cache.truncate(base)
        all_scores = torch.cat(scores)
        chosen = torch.sort(_best(all_scores, min(budget, all_scores.numel()))).values
        all_tokens = draft_to_target[torch.cat(tokens)][chosen].tolist()
        all_parents = torch.cat(parents)[chosen].tolist()
        node_of = {int(c): i + 1 for i, c in enumerate(chosen.tolist())}
        tree_parents = [-1] + [0 if p < 0 else node_of[p] for p in all_parents]
        return Tree.build([root, *all_tokens], tree_parents)


def _best(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` highest scores, equal scores in index order (a stable sort:
    a parent, earlier than its children and never below them, always comes first)."""
    return torch.sort(scores, descending=True, stable=True).indices[:n]


def _kth(scores: list[torch.Tensor], n: int) -> float:
    """The ``n``-th highest score among the candidates so far."""
    return float(torch.topk(torch.cat(scores), n).values[-1])
