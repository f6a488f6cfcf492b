"""Tree building: the :class:`TreeBuilder` the generation loop calls, and the pruning backends
behind it (the Rust pruner in process, ``dart_client.ngram.Pruner``, or served by the n-gram
daemon, ``dart_client.ngram.RemotePruner``) through one interface, :class:`PruningBackend`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dart_client.decoding.draft import DraftRows
from dart_client.decoding.verify import Tree, TreeBatch
from dart_client.ngram.pruner import DraftTree, PrunerConfig

__all__ = [
    "PrunerTreeBuilder",
    "PruningBackend",
    "TreeBuilder",
    "build_tree",
    "build_trees",
    "pruner_max_nodes",
]


@runtime_checkable
class PruningBackend(Protocol):
    """What a pruner offers: ``Pruner`` (in process) and ``RemotePruner`` (gRPC) both do. The
    inputs are coerced by :mod:`dart_client.ngram.inputs` and validated by the Rust core."""

    config: PrunerConfig

    def prune(
        self,
        context: Any,
        topk_ids: Any,
        topk_probs: Any,
        budget: int | None = None,
        lookup_path: Any = None,
    ) -> DraftTree: ...

    def prune_batch(
        self,
        contexts: Any,
        topk_ids: Any,
        topk_probs: Any,
        budgets: Any = None,
        lookup_paths: Any = None,
    ) -> list[DraftTree]: ...


def pruner_max_nodes(pruner: Any) -> int | None:
    """The ``max_nodes`` of a pruning backend's configuration (None without one)."""
    config = getattr(pruner, "config", None)
    value = getattr(config, "max_nodes", None)
    return None if value is None else int(value)


class TreeBuilder(Protocol):
    """Turns draft rows into a draft tree (the Rust pruner in-process or over gRPC).

    ``lookup_path`` (passed only when the model's ``prompt_lookup`` proposes one): tokens
    after the root the tree should hold (:mod:`dart_client.decoding.lookup`)."""

    def build(
        self,
        context: np.ndarray,
        rows: DraftRows,
        budget: int,
        lookup_path: np.ndarray | None = None,
    ) -> Tree: ...


class PrunerTreeBuilder:
    """A :class:`TreeBuilder` over any object with the pruner's ``prune`` method."""

    def __init__(self, pruner: PruningBackend) -> None:
        self.pruner = pruner

    def build(
        self,
        context: np.ndarray,
        rows: DraftRows,
        budget: int,
        lookup_path: np.ndarray | None = None,
    ) -> Tree:
        tree = self.pruner.prune(
            context, rows.ids, rows.probs, budget=budget, lookup_path=lookup_path
        )
        return Tree.from_draft_tree(tree)

    def build_batch(
        self,
        contexts: Sequence[np.ndarray],
        rows: Sequence[DraftRows],
        budgets: Sequence[int],
        lookup_paths: Sequence[np.ndarray | None] | None = None,
    ) -> TreeBatch:
        """Every sequence's tree in one ``prune_batch`` call (the Rust pruner builds them in
        parallel), padded into one batch where the pruner can (in process)."""
        args = (
            list(contexts),
            np.stack([r.ids for r in rows]),
            np.stack([r.probs for r in rows]),
        )
        kwargs = {
            "budgets": list(budgets),
            "lookup_paths": None if lookup_paths is None else list(lookup_paths),
        }
        padded = getattr(self.pruner, "prune_batch_padded", None)
        if callable(padded):
            return TreeBatch.from_padded(padded(*args, **kwargs))
        trees = self.pruner.prune_batch(*args, **kwargs)
        return TreeBatch.of([Tree.from_draft_tree(t) for t in trees])


def build_tree(
    builder: TreeBuilder,
    context: np.ndarray,
    rows: DraftRows,
    budget: int,
    lookup_path: np.ndarray | None,
) -> Tree:
    """``builder.build``, passing ``lookup_path`` only when there is one (a builder written
    before prompt lookup need not take it)."""
    if lookup_path is None or not lookup_path.size:
        return builder.build(context, rows, budget)
    return builder.build(context, rows, budget, lookup_path=lookup_path)


def build_trees(
    builder: TreeBuilder,
    contexts: Sequence[np.ndarray],
    rows: Sequence[DraftRows],
    budgets: Sequence[int],
    lookup_paths: Sequence[np.ndarray | None],
) -> TreeBatch:
    """The trees of a batch of sequences: one ``build_batch`` call where the builder has one
    (:class:`PrunerTreeBuilder`), else :func:`build_tree` per sequence. A sequence with no
    room for a draft node (budget 0) gets its root alone."""
    todo = [i for i, b in enumerate(budgets) if b > 0]
    roots = [int(c[-1]) for c in contexts]
    if not todo:
        return TreeBatch.roots(roots)
    batch = getattr(builder, "build_batch", None)
    if callable(batch):
        paths = [lookup_paths[i] for i in todo]
        paths = [p if p is not None and p.size else None for p in paths]
        built = TreeBatch.of(
            batch(
                [contexts[i] for i in todo],
                [rows[i] for i in todo],
                [budgets[i] for i in todo],
                None if all(p is None for p in paths) else paths,
            )
        )
    else:
        built = TreeBatch.of(
            [build_tree(builder, contexts[i], rows[i], budgets[i], lookup_paths[i]) for i in todo]
        )
    return built if len(todo) == len(contexts) else built.spread(todo, roots)
