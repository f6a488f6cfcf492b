"""Tree verification inputs: node tokens, positions ``cache_len + depth``, the tree mask.

A :class:`Tree` is the Python view of a draft tree, built from the pruner's ``DraftTree``
(zero-copy through ``torch.from_numpy``) or from explicit root-to-leaf paths. Node 0 is the
root: the token just sampled, not yet in the target's cache. Nodes are ordered so that a
parent precedes its children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dart_client.models.target import TargetCache, TargetModel

#: A root alone's depths (its row is the next token's: the prefill's last, a step's root).
ROOT_DEPTHS = torch.zeros(1, dtype=torch.int64)
_ROOT_MASK = torch.ones((1, 1), dtype=torch.bool)


@dataclass
class Tree:
    """A draft tree: ``tokens[0]`` is the root; ``mask[i, j]`` = node i sees node j."""

    tokens: list[int]
    parents: list[int]
    depths: torch.Tensor  # (n+1,) int64
    mask: torch.Tensor  # (n+1, n+1) bool
    # Built on first use: a batch builds every row's tree each step, and the device's
    # acceptance (the static path) never walks them.
    _children: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def children(self) -> list[list[int]]:
        """Each node's children, in node order."""
        if self._children is None:
            children: list[list[int]] = [[] for _ in self.parents]
            for i in range(1, len(self.parents)):
                children[self.parents[i]].append(i)
            self._children = children
        return self._children

    @classmethod
    def build(cls, tokens: Sequence[int], parents: Sequence[int]) -> Tree:
        """From node tokens and parent indices (root's parent -1, parents before children)."""
        n = len(tokens)
        if n == 0 or len(parents) != n or parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per node")
        children: list[list[int]] = [[] for _ in range(n)]
        depths = [0] * n
        mask = torch.zeros((n, n), dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, n):
            p = int(parents[i])
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must precede it")
            children[p].append(i)
            depths[i] = depths[p] + 1
            mask[i] = mask[p]
            mask[i, i] = True
        return cls(
            tokens=[int(t) for t in tokens],
            parents=[int(p) for p in parents],
            depths=torch.tensor(depths, dtype=torch.int64),
            mask=mask,
            _children=children,
        )

    @classmethod
    def root_only(cls, root: int) -> Tree:
        """The root alone: autoregressive decoding makes one per row and step, so it shares
        its two constant tensors (trees are never changed in place)."""
        return cls(
            tokens=[int(root)], parents=[-1], depths=ROOT_DEPTHS, mask=_ROOT_MASK, _children=[[]]
        )

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> Tree:
        """One path: each node the child of the one before (a prompt chunk to prefill)."""
        n = len(tokens)
        if n == 0:
            raise ValueError("a chain needs at least one token")
        return cls(
            tokens=[int(t) for t in tokens],
            parents=list(range(-1, n - 1)),
            depths=torch.arange(n, dtype=torch.int64),
            mask=torch.ones((n, n), dtype=torch.bool).tril(),
        )

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]]) -> Tree:
        """The prefix-closed tree of ``paths`` (token sequences after the root), merged."""
        tokens = [root]
        parents = [-1]
        index: dict[tuple[int, ...], int] = {(): 0}
        for path in paths:
            for d in range(1, len(path) + 1):
                key = tuple(int(t) for t in path[:d])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(key[-1])
                    parents.append(index[key[:-1]])
        return cls.build(tokens, parents)

    @classmethod
    def from_draft_tree(cls, tree: Any) -> Tree:
        """From the pruner's ``DraftTree`` (numpy arrays; the mask is used without a copy)."""
        tokens = np.asarray(tree.tokens).tolist()
        parents = np.asarray(tree.parents).tolist()
        n = len(tokens)
        mask = torch.from_numpy(np.asarray(tree.attention_mask))
        if mask.dim() != 2:
            mask = mask.reshape(n, n)
        if mask.dtype != torch.bool:
            mask = mask.bool()
        depths = torch.from_numpy(np.asarray(tree.depths, dtype=np.int64))
        return cls(tokens=tokens, parents=parents, depths=depths, mask=mask)


def verify_tree(
    target: TargetModel, cache: TargetCache, tree: Tree
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over every tree node. Returns logits (n+1, V) and taps (1, n+1, 3H).

    Node i sits at position ``cache.length + depth[i]`` and sees the whole cache plus its
    ancestors and itself; the cache grows by n+1 entries (compacted by the caller).
    """
    device = target.device
    ids = torch.tensor([tree.tokens], dtype=torch.long, device=device)
    positions = (tree.depths.to(device) + cache.length).unsqueeze(0)
    mask = tree.mask if len(tree) > 1 else None
    logits, taps = target.forward(ids, positions, cache, tree_mask=mask, logits_to_keep=0)
    assert taps is not None
    return logits[0], taps


def verify_trees(
    target: TargetModel, cache: TargetCache, trees: Sequence[Tree], taps: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over the trees of every live row of a batched cache.

    Row b's tree is padded to the largest tree; its node i sits at position
    ``rows[b] + depth[i]`` and sees row b's own cache and its ancestors and itself (a padding
    node sees only itself). Returns logits (b, n, V) and, when ``taps``, taps (b, n, 3H);
    the cache grows by n entries per row at its frontier (kept by ``cache.keep_rows``).
    Root-only trees make this one autoregressive step for every row.
    """
    device = target.device
    b = len(trees)
    n = max(len(t) for t in trees)
    ids = torch.zeros((b, n), dtype=torch.long)
    depths = torch.zeros((b, n), dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1)
    for row, tree in enumerate(trees):
        size = len(tree)
        ids[row, :size] = torch.tensor(tree.tokens, dtype=torch.long)
        depths[row, :size] = tree.depths
        mask[row, :size, :size] = tree.mask
    lengths = torch.tensor(cache.rows.lengths, dtype=torch.long).unsqueeze(1)
    return target.forward(
        ids.to(device),
        (depths + lengths).to(device),
        cache,
        tree_mask=mask if n > 1 else None,
        logits_to_keep=0 if n > 1 else 1,
        taps=taps,
    )
