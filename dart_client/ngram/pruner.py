"""The draft-tree pruner: n-gram-guided beam search over the draft head's top-k rows.

``Pruner(ngram, PrunerConfig()).prune(context, topk_ids, topk_probs)`` turns one draft step's
``(L, k)`` candidate ids (target vocabulary, unique per row) and their probabilities (softmaxed
over the top-k) into a :class:`DraftTree` whose node 0 is the root, ``context[-1]``. The search
runs in Rust with the GIL released (``prune_batch`` runs requests in parallel).

Scoring (the reference's): a candidate ``t`` at level ``l`` below path ``P`` scores
``score(P) + (l+1)^-level_exponent * (logit_decay^l * ln(p + eps) + ngram_weight *
ln(p_ngram + eps))``, where ``p_ngram = P(t | last order-1 tokens of context ++ P)``; the
n-gram term is left out at level 0 unless ``ngram_at_level0`` and everywhere when
``ngram_weight == 0``. Each level keeps its ``beam_width`` best paths (EOS-ending paths last);
the tree keeps the ``max_nodes`` best of all scored paths (``budget`` overrides per call).
Every ranking is total (score descending, then depth ascending, then token ids ascending), so
trees are deterministic, prefix-closed and never above the budget. The one deviation from the
reference: a score increment above 0 (only ``ln(1 + eps)`` at ``p == 1``) is clamped to 0, so
a child never outranks its parent.

Errors: ``PrunerError`` (a ``ValueError``) for bad shapes, probabilities, duplicate ids,
budgets and configurations; ``TokenOutOfVocabError`` for ids outside the model's vocabulary;
the ``NGramError`` family if the model fails.

``dart_client.ngram.remote.RemotePruner`` offers the same methods over gRPC and returns the same
:class:`DraftTree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from dart_client import _native
from dart_client._native import PrunerError, TokenOutOfVocabError
from dart_client.ngram import inputs
from dart_client.ngram.inputs import as_numpy

if TYPE_CHECKING:
    from dart_client.ngram.model import NGram

__all__ = ["DraftTree", "PaddedTrees", "Pruner", "PrunerConfig", "PrunerError"]


@dataclass(frozen=True)
class PrunerConfig:
    """Every constant of the beam search; the defaults are the reference's.

    ``top_k`` is the number of draft candidates per level callers should pass (the pruner uses
    whatever ``k`` the arrays have); ``max_nodes`` does not count the root; ``eos_id=None``
    means the n-gram model's EOS token.
    """

    top_k: int = 25
    beam_width: int = 20
    max_nodes: int = 60
    level_exponent: float = 0.7
    logit_decay: float = 0.9
    ngram_weight: float = 0.5
    ngram_at_level0: bool = False
    eos_id: int | None = None
    eps: float = 1e-10


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree as arrays, nodes ordered by depth (then score, then path); node 0 = root.

    - ``tokens`` (n,) int64: node tokens, ``tokens[0]`` = the last context token;
    - ``parents`` (n,) int64: parent index, -1 for the root (a parent precedes its children);
    - ``depths`` (n,) int64: depth = position offset after the root (root 0);
    - ``attention_mask`` (n, n) bool: ``[i, j]`` true when node ``i`` may attend to node ``j``
      (itself, its ancestors, the root);
    - ``retrieve_indices`` (leaves, max_depth + 1) int64: one row per leaf (a node without
      children) in node order, node indices root to leaf, padded with -1;
    - ``scores`` (n,) float64: cumulative scores (root 0).

    ``len(tree)`` is ``n``, the root included. All arrays work with ``torch.from_numpy``.
    """

    tokens: npt.NDArray[np.int64]
    parents: npt.NDArray[np.int64]
    depths: npt.NDArray[np.int64]
    attention_mask: npt.NDArray[np.bool_]
    retrieve_indices: npt.NDArray[np.int64]
    scores: npt.NDArray[np.float64]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_draft_nodes(self) -> int:
        """Nodes below the root."""
        return len(self) - 1

    @property
    def max_depth(self) -> int:
        return int(self.retrieve_indices.shape[1]) - 1

    def path(self, node: int) -> list[int]:
        """Token ids from the root's child down to ``node`` (empty for the root)."""
        out: list[int] = []
        while node > 0:
            out.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return out[::-1]


def _ids(x: Any, ndim: int, what: str) -> npt.NDArray[np.int64]:
    return inputs.ids(x, ndim, what, PrunerError, TokenOutOfVocabError)


def _probs(x: Any, ndim: int, what: str) -> npt.NDArray[np.float32]:
    return inputs.probs(x, ndim, what, PrunerError)


def _budget(b: Any, what: str) -> int | None:
    return inputs.budget(b, what, PrunerError)


def _path(path: Any, what: str) -> npt.NDArray[np.int64] | None:
    return inputs.lookup_path(path, what, PrunerError, TokenOutOfVocabError)


@dataclass(frozen=True, eq=False)
class PaddedTrees:
    """Many draft trees padded to the largest, ``S`` nodes: ``tokens``, ``parents``,
    ``depths`` (B, S) int64, ``mask`` (B, S, S) bool, ``sizes`` (B,) int64. Row b's first
    ``sizes[b]`` nodes are its tree, as :class:`DraftTree` holds it; a padding node has token
    0, parent 0 and depth 0 and sees only itself."""

    tokens: npt.NDArray[np.int64]
    parents: npt.NDArray[np.int64]
    depths: npt.NDArray[np.int64]
    mask: npt.NDArray[np.bool_]
    sizes: npt.NDArray[np.int64]


class Pruner:
    """The in-process pruner over an :class:`dart_client.ngram.NGram` model."""

    def __init__(self, ngram: NGram, config: PrunerConfig | None = None) -> None:
        self.ngram = ngram
        self.config = config if config is not None else PrunerConfig()
        if not isinstance(self.config, PrunerConfig):
            raise PrunerError(f"config must be a PrunerConfig, got {type(self.config).__name__}")
        self._native = _native.Pruner(ngram, asdict(self.config))
        # Only the n-gram history and the root are read: converting a long context whole
        # would cost more than pruning.
        self._tail: int = self._native.context_tail_len

    def __repr__(self) -> str:
        return f"Pruner(ngram={self.ngram.path!r}, config={self.config!r})"

    @property
    def eos_id(self) -> int | None:
        """The token whose paths rank last in the beam (configured, else the model's)."""
        return self._native.eos_id

    def _context(self, context: Any, what: str) -> tuple[npt.NDArray[np.int64], int]:
        """The tail of ``context`` the search reads, and where it starts in ``context``."""
        c = context if type(context) is np.ndarray else as_numpy(context)
        if not isinstance(c, (list, tuple, np.ndarray)):
            c = list(c)
        offset = max(len(c) - self._tail, 0)
        return _ids(c[offset:], 1, what), offset

    def prune(
        self,
        context: Any,
        topk_ids: Any,
        topk_probs: Any,
        budget: int | None = None,
        lookup_path: Any = None,
    ) -> DraftTree:
        """One draft tree. ``context``: token ids so far (its last is the root);
        ``topk_ids``/``topk_probs``: (L, k); ``budget``: nodes to keep instead of
        ``config.max_nodes`` (the root not counted); ``lookup_path``: tokens after the root
        the tree must hold as one path, e.g. a prompt-lookup proposal (its new nodes count
        against the budget and score ``-inf``; cut to the budget). Numpy arrays, lists or CPU
        tensors."""
        ctx, offset = self._context(context, "context")
        out = self._native.prune(
            ctx,
            _ids(topk_ids, 2, "topk_ids"),
            _probs(topk_probs, 2, "topk_probs"),
            _budget(budget, "budget"),
            offset,
            _path(lookup_path, "lookup_path"),
        )
        return DraftTree(*out)

    def prune_batch(
        self,
        contexts: Any,
        topk_ids: Any,
        topk_probs: Any,
        budgets: Sequence[int | None] | None = None,
        lookup_paths: Sequence[Any] | None = None,
    ) -> list[DraftTree]:
        """Many trees in one call, in parallel: ``contexts`` B sequences (or a (B, T) array),
        ``topk_ids``/``topk_probs`` (B, L, k), ``budgets`` B values (int or None) or None,
        ``lookup_paths`` B paths (or None each) or None. Results equal
        ``[prune(...) for each request]``; an error names the request."""
        out = self._native.prune_batch(
            *self._batch_args(contexts, topk_ids, topk_probs, budgets, lookup_paths)
        )
        return [DraftTree(*t) for t in out]

    def prune_batch_padded(
        self,
        contexts: Any,
        topk_ids: Any,
        topk_probs: Any,
        budgets: Sequence[int | None] | None = None,
        lookup_paths: Sequence[Any] | None = None,
    ) -> PaddedTrees:
        """:meth:`prune_batch`'s trees padded to the largest, in one set of arrays (see
        :class:`PaddedTrees`): what a batched decoding step verifies, without a Python object
        per tree."""
        out = self._native.prune_batch(
            *self._batch_args(contexts, topk_ids, topk_probs, budgets, lookup_paths), padded=True
        )
        return PaddedTrees(*out)

    def _batch_args(
        self,
        contexts: Any,
        topk_ids: Any,
        topk_probs: Any,
        budgets: Sequence[int | None] | None,
        lookup_paths: Sequence[Any] | None,
    ) -> tuple[Any, ...]:
        """A batch's inputs as the native calls take them."""
        tails = [self._context(c, f"contexts[{i}]") for i, c in enumerate(as_numpy(contexts))]
        if budgets is not None:
            budgets = [_budget(b, f"budgets[{i}]") for i, b in enumerate(budgets)]
        paths = None
        if lookup_paths is not None:
            paths = [_path(p, f"lookup_paths[{i}]") for i, p in enumerate(lookup_paths)]
        return (
            [t[0] for t in tails],
            _ids(topk_ids, 3, "topk_ids"),
            _probs(topk_probs, 3, "topk_probs"),
            budgets,
            [t[1] for t in tails],
            paths,
        )
