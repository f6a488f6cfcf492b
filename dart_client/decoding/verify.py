"""Tree verification inputs: node tokens, positions ``cache_len + depth``, the tree mask.

A :class:`Tree` is the Python view of a draft tree, built from the pruner's ``DraftTree``
(zero-copy through ``torch.from_numpy``) or from explicit root-to-leaf paths. Node 0 is the
root: the token just sampled, not yet in the target's cache. Nodes are ordered so that a
parent precedes its children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

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


class TreeBatch(Sequence[Tree]):
    """Every row's draft tree of a batched step, padded to the largest (``width`` nodes), in
    one set of arrays the batched verifiers read at once: ``tokens``, ``parents``, ``depths``
    (B, S) int64, ``mask`` (B, S, S) bool, ``sizes`` (B,) int64. Row b's first ``sizes[b]``
    nodes are its tree; a padding node has token 0, parent 0 and depth 0 and sees only itself
    (as :class:`~dart_client.ngram.pruner.PaddedTrees`, which the pruner fills in one call).
    ``batch[b]`` is row b's :class:`Tree`, built on first use (the static path's device-side
    acceptance never needs one). The arrays are shared with those trees: never changed."""

    def __init__(
        self,
        tokens: np.ndarray,
        parents: np.ndarray,
        depths: np.ndarray,
        mask: np.ndarray,
        sizes: np.ndarray,
        trees: Sequence[Tree | None] | None = None,
    ) -> None:
        self.tokens, self.parents, self.depths, self.mask = tokens, parents, depths, mask
        self.sizes = sizes
        self._trees: list[Tree | None] = list(trees) if trees is not None else [None] * len(sizes)

    @classmethod
    def of(cls, trees: TreeBatch | Sequence[Tree]) -> TreeBatch:
        """``trees`` as a batch (packed here, one row at a time, unless it is one)."""
        if isinstance(trees, TreeBatch):
            return trees
        rows, width = len(trees), max(len(t) for t in trees)
        tokens = np.zeros((rows, width), dtype=np.int64)
        parents = np.zeros((rows, width), dtype=np.int64)
        depths = np.zeros((rows, width), dtype=np.int64)
        mask = np.broadcast_to(np.eye(width, dtype=np.bool_), (rows, width, width)).copy()
        sizes = np.zeros(rows, dtype=np.int64)
        for b, tree in enumerate(trees):
            n = sizes[b] = len(tree)
            tokens[b, :n] = tree.tokens
            parents[b, :n] = tree.parents
            depths[b, :n] = tree.depths.numpy()
            mask[b, :n, :n] = tree.mask.numpy()
        return cls(tokens, parents, depths, mask, sizes, trees)

    @classmethod
    def from_padded(cls, padded: Any) -> TreeBatch:
        """From the pruner's :class:`~dart_client.ngram.pruner.PaddedTrees` (no copy)."""
        return cls(padded.tokens, padded.parents, padded.depths, padded.mask, padded.sizes)

    @classmethod
    def roots(cls, roots: Sequence[int]) -> TreeBatch:
        """Every row its root alone (a batched autoregressive step)."""
        rows = len(roots)
        return cls(
            np.asarray(roots, dtype=np.int64).reshape(rows, 1),
            np.full((rows, 1), -1, dtype=np.int64),
            np.zeros((rows, 1), dtype=np.int64),
            np.ones((rows, 1, 1), dtype=np.bool_),
            np.ones(rows, dtype=np.int64),
        )

    def spread(self, at: Sequence[int], roots: Sequence[int]) -> TreeBatch:
        """A batch of ``len(roots)`` rows: this batch's row i as row ``at[i]``, every other row
        its root alone (``roots[b]``)."""
        out = TreeBatch.roots(roots).widened(self.width)
        index = np.asarray(at, dtype=np.intp)
        for name in ("tokens", "parents", "depths", "mask", "sizes"):
            getattr(out, name)[index] = getattr(self, name)
        for i, b in enumerate(at):
            out._trees[b] = self._trees[i]
        return out

    def widened(self, width: int) -> TreeBatch:
        """The same trees padded to ``width`` nodes (at least ``self.width``)."""
        rows, pad = len(self), width - self.width
        eye = np.broadcast_to(np.eye(width, dtype=np.bool_), (rows, width, width)).copy()
        eye[:, : self.width, : self.width] = self.mask
        wide = [np.pad(a, ((0, 0), (0, pad))) for a in (self.tokens, self.parents, self.depths)]
        return TreeBatch(*wide, eye, self.sizes.copy(), self._trees)

    @property
    def width(self) -> int:
        """Nodes per row (the largest tree's)."""
        return int(self.tokens.shape[1])

    def size(self, b: int) -> int:
        return int(self.sizes[b])

    def __len__(self) -> int:
        return len(self._trees)

    @overload
    def __getitem__(self, b: int) -> Tree: ...

    @overload
    def __getitem__(self, b: slice) -> list[Tree]: ...

    def __getitem__(self, b: int | slice) -> Tree | list[Tree]:
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        tree = self._trees[b]
        if tree is None:
            n = int(self.sizes[b])
            tree = Tree(
                tokens=self.tokens[b, :n].tolist(),
                parents=self.parents[b, :n].tolist(),
                depths=torch.from_numpy(self.depths[b, :n]),
                mask=torch.from_numpy(np.ascontiguousarray(self.mask[b, :n, :n])),
            )
            self._trees[b] = tree
        return tree


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
    target: TargetModel,
    cache: TargetCache,
    trees: TreeBatch | Sequence[Tree],
    taps: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over the trees of every live row of a batched cache.

    Row b's tree is padded to the largest tree; its node i sits at position
    ``rows[b] + depth[i]`` and sees row b's own cache and its ancestors and itself (a padding
    node sees only itself). Returns logits (b, n, V) and, when ``taps``, taps (b, n, 3H);
    the cache grows by n entries per row at its frontier (kept by ``cache.keep_rows``).
    Root-only trees make this one autoregressive step for every row.
    """
    device = target.device
    batch = TreeBatch.of(trees)
    n = batch.width
    ids = torch.from_numpy(batch.tokens)
    depths = torch.from_numpy(batch.depths)
    mask = torch.from_numpy(batch.mask)
    lengths = torch.tensor(cache.rows.lengths, dtype=torch.long).unsqueeze(1)
    return target.forward(
        ids.to(device),
        (depths + lengths).to(device),
        cache,
        tree_mask=mask if n > 1 else None,
        logits_to_keep=0 if n > 1 else 1,
        taps=taps,
    )
