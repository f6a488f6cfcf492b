"""The static path for batched decoding: many rows' trees verified in one fixed-shape program.

What :class:`~dart_client.decoding.static.StaticVerifier` does for one sequence, for the
live rows of a batched :class:`~dart_client.models.target.TargetCache`
(:mod:`dart_client.decoding.batch`): one host-to-device copy (every row's tree, its length and
the frontier, packed in one pinned buffer), one program (on cuda a CUDA graph), one
device-to-host copy (every row's accepted count, bonus token and accepted path).

Shapes: the live rows are padded to a power of two (at most the cache's batch), every tree to
the bucket of the largest (:func:`~dart_client.decoding.static.bucket_sizes`), and attention
reads a window of the cache (:func:`~dart_client.decoding.static.attention_window`) past the
frontier (the longest row, where every row's tree is written, as on the dynamic path); one
graph per (rows, bucket, window). Row b's node i sits at position ``length_b + depth_i`` and
sees row b's first ``length_b`` positions and its ancestors; a padding node (or a padding
row's) sees only itself and is never accepted.

Greedy acceptance and compaction run in the program, per row: accepted node i of row b moves
from ``frontier + i`` to ``length_b + depth_i``, rejected ones to a trash slot. With a
sampling row in the batch the program is the padded forward alone and acceptance runs on the
host (:meth:`StaticBatchVerifier.forward`), as on the lone static path.

With a ``head``, a greedy step also drafts every row's next rows in the same program, from
its accepted nodes, over the batched head cache: row b's accepted rows right-aligned in a
bucket of rows (so its last real row and the mask slots are the layer's last rows, as the
dynamic draft has them) at positions ``head_length_b + depth``, its mask slots after them,
each row writing its own cache positions; the top-k ids and probabilities come back in the
same copy out. A step with a sampling row drafts on the dynamic path
(:func:`~dart_client.decoding.draft.draft_rows_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dart_client.decoding.accept import Acceptance
from dart_client.decoding.draft import DraftRows
from dart_client.decoding.static import (
    StaticPrograms,
    attention_window,
    bucket_sizes,
    greedy_acceptance,
)
from dart_client.decoding.verify import Tree, TreeBatch
from dart_client.errors import InvalidArgumentError
from dart_client.models.target import compact_rows

if TYPE_CHECKING:
    from dart_client.models.head import DartHead, HeadCache
    from dart_client.models.target import TargetCache, TargetModel

#: Words of the packed input before the rows: the frontier, the live row count.
HEADER = 2


def _layout(words: Any, rows: int, size: int) -> dict[str, Any]:
    """The packed input's fields (after the header), as views of ``words`` (a numpy array on
    the host, a tensor on the device): per row its length, tree size and head length, then
    tokens, depths and parents ``(rows, size)``, then the mask bytes' words."""
    block = HEADER + 3 * rows
    cells = rows * size
    return {
        "lengths": words[HEADER : HEADER + rows],
        "sizes": words[HEADER + rows : HEADER + 2 * rows],
        "head_lengths": words[HEADER + 2 * rows : block],
        "tokens": words[block : block + cells].reshape(rows, size),
        "depths": words[block + cells : block + 2 * cells].reshape(rows, size),
        "parents": words[block + 2 * cells : block + 3 * cells].reshape(rows, size),
        "mask_words": words[block + 3 * cells :],
    }


def row_bucket(live: int, batch: int) -> int:
    """The rows a program over ``live`` rows runs: the next power of two, at most ``batch``."""
    if not 1 <= live <= batch:
        raise InvalidArgumentError(f"{live} live rows in a batch of {batch}")
    return min(batch, 1 << (live - 1).bit_length())


@dataclass
class _Bucket:
    """One (rows, tree bucket, window)'s buffers and, on cuda, its graphs."""

    rows: int
    size: int
    window: int
    #: Positions of the head's cache its attention reads (0 without a head).
    head_window: int
    #: Pinned on cuda: [HEADER, lengths, tree sizes, head lengths, tokens, depths, parents,
    #: mask bytes].
    host_in: torch.Tensor
    device_in: torch.Tensor
    slots: torch.Tensor
    #: [counts, bonuses, paths (rows x size), draft ids, draft probabilities (rows x
    #: (masks + 1) x k each)] (float64: exact for all of them).
    host_out: torch.Tensor
    outputs: dict[str, Any]
    graphs: dict[str, Any]


@dataclass
class BatchStep:
    """A greedy batched step's acceptances (one per live row) and, with a head, each row's
    next draft rows (drafted in the same program, from the accepted nodes' taps: the host
    never reads the taps)."""

    acceptances: list[Acceptance]
    rows: list[DraftRows] | None = None


class StaticBatchVerifier(StaticPrograms):
    """Fixed-shape verification of every live row's tree over one batched cache."""

    def __init__(
        self,
        target: TargetModel,
        cache: TargetCache,
        max_tree: int,
        *,
        graphs: bool,
        head: DartHead | None = None,
        head_cache: HeadCache | None = None,
        top_k: int = 0,
    ) -> None:
        """``head`` / ``head_cache`` / ``top_k``: draft every row's next rows in the greedy
        program, over the batched ``head_cache`` (its rows those of ``cache``)."""
        self._take(target, graphs)
        device = self.device
        if not cache.buffers():
            raise InvalidArgumentError("the batched cache holds no row yet (put_row first)")
        self.target = target
        self.cache = cache
        self.buckets = bucket_sizes(max_tree)
        self.capacity = cache.capacity
        self.trash = self.capacity - 1
        self.batch = cache.batch
        self._state: dict[tuple[int, int, int, int], _Bucket] = {}
        self._columns = torch.arange(self.capacity, device=device)
        self.head = None
        self.head_cache = None
        if head is not None:
            if head_cache is None:
                raise InvalidArgumentError("drafting in the program needs the batched head cache")
            self._draft_with(head, head_cache, top_k)
        # Attention reads every row of a program up to the window, and a masked key weighs
        # exactly 0 only next to finite values: zero each row's positions from its length on,
        # once (what later forwards and copies leave there is finite; the head's cache is
        # allocated zeroed).
        self.cache.clear_tails()

    # -- the step ---------------------------------------------------------------------------

    def greedy_step(self, trees: TreeBatch | Sequence[Tree]) -> BatchStep:
        """Verify every live row's tree (``trees[b]`` for row b), accept greedily and compact
        on the device; the rows' lengths then count their accepted nodes."""
        batch = TreeBatch.of(trees)
        state = self.load(batch)
        out = self.run_greedy(state)
        return self.accepted(state, out, batch)

    def run_greedy(self, state: _Bucket) -> dict[str, Any]:
        return self._execute(state, "greedy")

    def accepted(
        self, state: _Bucket, out: dict[str, Any], trees: TreeBatch | Sequence[Tree]
    ) -> BatchStep:
        """The one copy out and its reading; moves each live row's length."""
        batch = TreeBatch.of(trees)
        host = state.host_out
        host.copy_(out["result"], non_blocking=host.is_pinned())
        if host.is_pinned():
            torch.cuda.current_stream(self.device).synchronize()
        values = host.numpy()
        rows, size = state.rows, state.size
        counts = values[:rows].astype(np.int64)
        bonuses = values[rows : 2 * rows].astype(np.int64)
        paths = values[2 * rows : 2 * rows + rows * size].astype(np.int64).reshape(rows, size)
        drafted = None
        if self.head is not None:
            shape = (rows, self.masks + 1, self.top_k)
            cells = shape[0] * shape[1] * shape[2]
            start = 2 * rows + rows * size
            ids = values[start : start + cells].astype(np.int64).reshape(shape)
            probs = values[start + cells : start + 2 * cells].astype(np.float32).reshape(shape)
            drafted = [DraftRows(ids=ids[b], probs=probs[b]) for b in range(len(batch))]
        acceptances = []
        for b in range(len(batch)):
            count = int(counts[b])
            nodes = paths[b, :count]
            acceptances.append(
                Acceptance(
                    nodes=nodes.tolist(),
                    tokens=batch.tokens[b, nodes[1:]].tolist(),
                    bonus=int(bonuses[b]),
                )
            )
        counts_live = [len(a.nodes) for a in acceptances]
        self.cache.grow_rows(counts_live)
        if self.head_cache is not None and drafted is not None:
            self.head_cache.grow_rows(counts_live)
        return BatchStep(acceptances, drafted)

    def forward(self, trees: TreeBatch | Sequence[Tree]) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded forward alone (a batch with sampling rows accepts on the host): logits
        ``(live, n, V)`` and taps ``(live, n, 3H)`` of the largest tree's ``n`` nodes per row
        (a smaller tree's padding after its own), written at the frontier as
        :func:`~dart_client.decoding.verify.verify_trees` does, for ``cache.keep_rows``."""
        batch = TreeBatch.of(trees)
        state = self.load(batch)
        out = self._execute(state, "forward")
        live, n = len(batch), batch.width
        return out["logits"][:live, :n], out["taps"][:live, :n]

    # -- buffers ----------------------------------------------------------------------------

    def load(self, trees: TreeBatch | Sequence[Tree]) -> _Bucket:
        """Pack every live row's tree into its bucket's host buffer; one copy to the device."""
        batch = TreeBatch.of(trees)
        live = len(batch)
        lengths = self.cache.rows.lengths
        if live != len(lengths):
            raise InvalidArgumentError(f"{live} trees for {len(lengths)} live rows")
        rows = row_bucket(live, self.batch)
        size = self.bucket(batch.width)
        frontier = max(lengths)
        if frontier + size > self.trash:
            raise InvalidArgumentError(
                f"static cache overflow: a {size}-node bucket at the frontier {frontier} needs "
                f"more than the capacity of {self.capacity}"
            )
        window = attention_window(frontier + size, self.capacity)
        head_window = 0
        if self.head_cache is not None:
            head_end = max(self.head_cache.rows.lengths) + size + self.masks
            if head_end > self.head_trash:
                raise InvalidArgumentError(
                    f"static head cache overflow: {head_end} positions for a capacity of "
                    f"{self.head_cache.capacity}"
                )
            head_window = attention_window(head_end, self.head_cache.capacity)
        key = (rows, size, window, head_window)
        state = self._state.get(key) or self._new_bucket(rows, size, window, head_window)
        self._pack(state, batch, frontier)
        state.device_in.copy_(state.host_in, non_blocking=state.host_in.is_pinned())
        return state

    def _new_bucket(self, rows: int, size: int, window: int, head_window: int) -> _Bucket:
        words = HEADER + 3 * rows + 3 * rows * size + math.ceil(rows * size * size / 8)
        pinned = self.device.type == "cuda"
        drafted = 0 if self.head is None else 2 * rows * (self.masks + 1) * self.top_k
        state = _Bucket(
            rows=rows,
            size=size,
            window=window,
            head_window=head_window,
            host_in=torch.zeros(words, dtype=torch.int64, pin_memory=pinned),
            device_in=torch.zeros(words, dtype=torch.int64, device=self.device),
            slots=torch.zeros(size, dtype=torch.int64, device=self.device),
            host_out=torch.zeros(
                2 * rows + rows * size + drafted, dtype=torch.float64, pin_memory=pinned
            ),
            outputs={},
            graphs={},
        )
        self._state[(rows, size, window, head_window)] = state
        return state

    def _pack(self, state: _Bucket, batch: TreeBatch, frontier: int) -> None:
        rows, size = state.rows, state.size
        words = state.host_in.numpy()
        words[:] = 0
        live, width = len(batch), batch.width
        words[0], words[1] = frontier, live
        fields = _layout(words, rows, size)
        mask = fields["mask_words"].view(np.uint8)[: rows * size * size].reshape(rows, size, size)
        # A padded node sees only itself (a well-defined softmax); nothing sees it.
        pad = np.arange(size)
        mask[:, pad, pad] = 1
        fields["lengths"][:live] = self.cache.rows.lengths
        if self.head_cache is not None:
            fields["head_lengths"][:live] = self.head_cache.rows.lengths
        fields["sizes"][:live] = batch.sizes
        fields["tokens"][:live, :width] = batch.tokens
        fields["depths"][:live, :width] = batch.depths
        # The root's parent stays 0, as a padded node's.
        fields["parents"][:live, 1:width] = batch.parents[:, 1:]
        mask[:live, :width, :width] = batch.mask

    # -- the device program -----------------------------------------------------------------

    @torch.no_grad()
    def _program(self, state: _Bucket, kind: str) -> dict[str, Any]:
        rows, size, window = state.rows, state.size, state.window
        words = state.device_in
        frontier = words[0]
        fields = _layout(words, rows, size)
        lengths, sizes, head_lengths = fields["lengths"], fields["sizes"], fields["head_lengths"]
        tokens, depths, parents = fields["tokens"], fields["depths"], fields["parents"]
        sees = fields["mask_words"].view(torch.uint8)[: rows * size * size]
        sees = sees.view(rows, size, size).bool()
        nodes = torch.arange(size, device=self.device)
        state.slots.copy_(nodes + frontier)
        mask = self._mask(sees, lengths, frontier, rows, size, window)
        self.cache.set_slots(state.slots, window)
        try:
            logits, taps = self.target.run(
                tokens, depths + lengths.unsqueeze(1), mask, self.cache, taps=True
            )
        finally:
            self.cache.set_slots(None)
        assert taps is not None
        if kind == "forward":
            return {"logits": logits, "taps": taps}
        real = nodes.unsqueeze(0) < sizes.unsqueeze(1)
        accepted, count, bonus, path = greedy_acceptance(
            logits.argmax(-1), tokens, parents, depths, sees, real
        )
        # Compaction: row b's accepted node i moves from frontier + i to length_b + depth_i.
        plan = (
            torch.arange(rows, device=self.device).unsqueeze(1),
            (nodes + frontier).expand(rows, size),
            torch.where(accepted, depths + lengths.unsqueeze(1), self.trash),
        )
        for buffer, axis in self.cache.buffers():
            compact_rows(buffer, axis, plan)
        width = taps.shape[-1]
        parts = [count.double(), bonus.double(), path.flatten().double()]
        if self.head is not None:
            ids, probs = self._draft(
                state.head_window, taps, tokens, path, count, bonus, head_lengths
            )
            parts += [ids.flatten().double(), probs.flatten().double()]
        return {
            "result": torch.cat(parts),
            "taps": taps.gather(1, path.unsqueeze(2).expand(rows, size, width)),
        }

    def _mask(
        self,
        sees: torch.Tensor,
        lengths: torch.Tensor,
        frontier: torch.Tensor,
        rows: int,
        size: int,
        window: int,
    ) -> torch.Tensor:
        """Float mask (rows, 1, size, window): row b's nodes see its first ``length_b``
        positions and, at the frontier, the tree nodes their row of ``sees`` allows."""
        columns = self._columns[:window]
        offset = columns - frontier
        in_tree = (offset >= 0) & (offset < size)
        tree_part = sees[:, :, offset.clamp(0, size - 1)] & in_tree
        cached = (columns.unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(1)
        visible = cached | tree_part
        dtype = self.target.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)
        return mask.view(rows, 1, size, window)
