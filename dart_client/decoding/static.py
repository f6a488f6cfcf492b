"""The static verification path: fixed shapes, device-side acceptance, CUDA graphs on a GPU.

On a GPU a decoding step of a small model is dominated by the host: hundreds of kernel
launches from Python, a new attention plan and new allocations for every new cache length.
:class:`StaticVerifier` makes every verification forward one of a few fixed shapes, so
that on cuda each is captured once as a CUDA graph and a step is

1. one host-to-device copy: the tree (tokens, depths, parents, ancestor mask) and the
   cache length, packed in one pinned buffer;
2. one graph replay: positions, write slots and the attention mask made from those on the
   device, the target's forward over the tree padded to its bucket, greedy acceptance, the
   accepted nodes' K/V compacted into place, the accepted rows' taps gathered;
3. one device-to-host copy: the accepted count, the bonus token and the accepted path.

Shapes: the tree is padded to the smallest of a few bucket sizes (:func:`bucket_sizes`);
padded nodes see only themselves, no real node sees them, and they are never accepted. The
KV cache is the preallocated :class:`~dart_client.models.target.TargetCache` in static mode
(:meth:`~dart_client.models.target.TargetCache.set_slots`): keys are written at slots given
by a device tensor and attention reads a *window* of the buffer, its first positions up to
the next multiple of :data:`WINDOW_ALIGN` past the tree, under an additive float mask
``(bucket, window)``. That is the attention path chosen on purpose: SDPA with a padded
static mask has one shape per bucket and window, so no per-length plan (cuDNN), no allocator
growth and no new cuBLAS heuristics inside the loop, it runs on every SDPA backend that takes
an arbitrary mask (the memory-efficient kernel on cuda is preferred; math is the fallback),
and it goes through transformers' own attention path unchanged (one code path for every
supported target). The window keeps attention's cost with the used length, not the
capacity: on an H200 one query over 2,304 positions took 113 us per layer in that kernel,
over 512 positions 28 us (docs/gpu.md); a generation captures one graph per bucket and
window it reaches. The static path is the default on cuda and not on the CPU
(``GenerationConfig.static``).

On the CPU (and on cuda with ``graphs=False``) the same buffers and the same program run
eagerly, which is what the CPU tests check against the dynamic path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dart_client.decoding.accept import Acceptance
from dart_client.decoding.config import parse_static
from dart_client.decoding.draft import DraftRows, draft_rows
from dart_client.decoding.verify import Tree
from dart_client.errors import InvalidArgumentError
from dart_client.models.attention import decoding_sdpa

if TYPE_CHECKING:
    from dart_client.models.head import DartHead, HeadCache
    from dart_client.models.target import TargetCache, TargetModel

#: Tree sizes (root included) the verification forward is padded to, up to the largest tree.
BASE_BUCKETS = (1, 8, 16, 32, 64)
#: Larger trees are padded to a multiple of this.
BUCKET_STEP = 32
#: The static cache's capacity is rounded up to a multiple of this (aligned rows for the
#: memory-efficient attention kernel's mask, and fewer distinct capacities to capture).
CAPACITY_ALIGN = 256
#: Attention reads the cache up to the next multiple of this past the tree (each window is
#: one more graph per bucket; a larger step captures fewer, a smaller one attends over less).
WINDOW_ALIGN = 256


def bucket_sizes(max_tree: int) -> tuple[int, ...]:
    """The buckets for trees of at most ``max_tree`` nodes (root included): the base
    sizes below it and the first size (a base one or a multiple of :data:`BUCKET_STEP`)
    that holds it."""
    if max_tree < 1:
        raise InvalidArgumentError(f"a tree has at least one node, got {max_tree}")
    sizes = [b for b in BASE_BUCKETS if b < max_tree]
    top = next((b for b in BASE_BUCKETS if b >= max_tree), None)
    sizes.append(top if top is not None else math.ceil(max_tree / BUCKET_STEP) * BUCKET_STEP)
    return tuple(sizes)


def static_capacity(max_length: int, max_tree: int) -> int:
    """A static cache's capacity for ``max_length`` tokens: room for a padded tree after
    the last position and one trash slot (where compaction sends the rejected nodes)."""
    return _aligned(max_length + bucket_sizes(max_tree)[-1] + 1)


def static_head_capacity(capacity: int, masks: int) -> int:
    """The head cache's capacity next to a static target cache of ``capacity``: the head's
    length never exceeds the target's, so a padded draft (a tree's worth of rows, then
    ``masks`` mask slots) and a trash slot fit after it."""
    return _aligned(capacity + masks + 1)


def _aligned(positions: int) -> int:
    return math.ceil(positions / CAPACITY_ALIGN) * CAPACITY_ALIGN


def attention_window(end: int, capacity: int) -> int:
    """The positions attention reads when the last one written is ``end - 1``: ``end``
    rounded up to :data:`WINDOW_ALIGN`, at most the capacity."""
    return min(capacity, math.ceil(end / WINDOW_ALIGN) * WINDOW_ALIGN)


#: The chunk sizes a static prefill pads to (:meth:`StaticVerifier.prefill`): a short prompt
#: one small program, a long one chunks of the largest.
PREFILL_BUCKETS = (64, 256)

#: Words of the packed input before the tree: the target cache's length, the tree's node
#: count, the head cache's length, and for a prefill chunk the positions the head reads and
#: the token after the last of them.
HEADER = 5


@dataclass
class _Bucket:
    """One bucket's static buffers at one attention window and, on cuda, its graphs."""

    size: int
    #: Positions of the target's cache that attention reads (:func:`attention_window`).
    window: int
    #: The same for the head's cache (0 without a head).
    head_window: int
    #: Pinned on cuda: [HEADER, tokens, depths, parents, mask bytes] (int64 words).
    host_in: torch.Tensor
    device_in: torch.Tensor
    slots: torch.Tensor  # the target cache positions the forward writes
    #: [count, bonus, path nodes, draft ids, draft probs] (float64: exact for all of them).
    host_out: torch.Tensor
    outputs: dict[str, Any]
    graphs: dict[str, Any]
    #: The last forward's taps (1, size, 3H): what a sampling step's draft reads.
    last_taps: torch.Tensor | None = None
    #: The kind of program whose output ``last_taps`` is ("forward" or "prefill"): a draft
    #: graph reads the buffer it was captured with, so each source has its own.
    taps_from: str = "forward"
    #: A sampling step's draft inputs, [count, bonus, head length, path nodes] (pinned on
    #: cuda), their device copy, and its output [draft ids, draft probs] (float64).
    draft_host: torch.Tensor | None = None
    draft_in: torch.Tensor | None = None
    draft_out: torch.Tensor | None = None


#: Words of a sampling step's draft input before the path: count, bonus, head length.
DRAFT_HEADER = 3


@dataclass
class StaticStep:
    """What one greedy static step returns: the acceptance, the accepted rows' taps
    ``(1, len(nodes), 3H)`` (a view of a static buffer: read it before the next step) and,
    with a head, the next step's draft rows (drafted in the same replay)."""

    acceptance: Acceptance
    taps: torch.Tensor
    rows: DraftRows | None = None


def greedy_acceptance(
    best: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    sees: torch.Tensor,
    real: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of padded trees on the device, a row of trees at once: a node is
    accepted when its token is the target's argmax (``best``) at its parent, it is the first
    such child (as the host walk takes it), and so are all of its ancestors; a node that is
    not ``real`` (padding) never is. ``best``, ``tokens``, ``parents``, ``depths``, ``real``
    ``(rows, size)``, ``sees`` ``(rows, size, size)`` (row i: node i's ancestors and itself).
    Returns the accepted nodes ``(rows, size)``, their count and the bonus token ``(rows,)``
    and the accepted path in depth order ``(rows, size)``."""
    rows, size = tokens.shape
    nodes = torch.arange(size, device=tokens.device).unsqueeze(0)
    is_root = nodes == 0
    match = ((tokens == best.gather(1, parents)) & real) | is_root
    candidate = torch.where(match & ~is_root, nodes, size)
    first = torch.full((rows, size), size, dtype=torch.int64, device=tokens.device)
    first = first.scatter_reduce(1, parents, candidate, "amin")
    match = match & ((first.gather(1, parents) == nodes) | is_root)
    accepted = ~(sees & ~match.unsqueeze(1)).any(2) & real
    count = accepted.sum(1)
    last = torch.where(accepted, depths, -1).argmax(1, keepdim=True)
    bonus = best.gather(1, last).squeeze(1)
    # Rejected nodes land in a spare last entry.
    path = torch.zeros((rows, size + 1), dtype=torch.int64, device=tokens.device)
    path = path.scatter(1, torch.where(accepted, depths, size), nodes.expand(rows, size))
    return accepted, count, bonus, path[:, :size]


class StaticPrograms:
    """What the static verifiers share: their fixed-shape programs run eagerly or, on cuda,
    captured once per bucket and kind as a CUDA graph and replayed; and the head's draft
    inside a greedy program (:meth:`_draft`), set up by :meth:`_draft_with`."""

    device: torch.device
    graphs: bool
    _pool: Any
    buckets: tuple[int, ...]
    head: DartHead | None
    head_cache: HeadCache | None

    def _program(self, state: Any, kind: str) -> dict[str, Any]:
        raise NotImplementedError

    def bucket(self, n: int) -> int:
        """The bucket a tree of ``n`` nodes is padded to."""
        for size in self.buckets:
            if size >= n:
                return size
        raise InvalidArgumentError(
            f"a tree of {n} nodes exceeds the largest static bucket ({self.buckets[-1]})"
        )

    def _take(self, target: TargetModel, graphs: bool) -> None:
        """Run on ``target``'s device (one device; CUDA graphs on cuda only)."""
        device = target.device
        if graphs and device.type != "cuda":
            raise InvalidArgumentError(f"CUDA graphs need a cuda target, not {device}")
        devices = target.layer_devices()
        if len(devices) != 1:
            where = ", ".join(sorted(map(str, devices)))
            raise InvalidArgumentError(
                f"the static path needs the target on one device, not on {where} "
                "(pass static=False)"
            )
        self.device, self.graphs = device, graphs
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def _execute(self, state: Any, kind: str) -> dict[str, Any]:
        if not self.graphs:
            with decoding_sdpa(self.device):
                return self._program(state, kind)
        graph = state.graphs.get(kind)
        if graph is None:
            graph = self._capture(state, kind)
        graph.replay()
        return state.outputs[kind]

    def _capture(self, state: Any, kind: str) -> Any:
        """Capture ``kind``'s program for this bucket, after warm-up runs on a side stream
        (as CUDA graphs require). The warm-ups run on the inputs just loaded, which is
        harmless: the program is idempotent (it rewrites every node's K/V at and after the
        length before it compacts, and reads nothing else there), so the replay that
        follows leaves what one run would."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), decoding_sdpa(self.device):
            for _ in range(2):
                self._program(state, kind)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), decoding_sdpa(self.device):
            state.outputs[kind] = self._program(state, kind)
        state.graphs[kind] = graph
        return graph

    def _draft_with(self, head: DartHead, head_cache: HeadCache, top_k: int) -> None:
        """Draft with ``head`` over ``head_cache`` (static) in the greedy programs."""
        if top_k < 1:
            raise InvalidArgumentError(f"draft top-k must be >= 1, got {top_k}")
        self.head, self.head_cache = head, head_cache
        self.top_k = min(top_k, head.config.draft_vocab_size)
        self.masks = head.config.draft_length
        self.head_trash = head_cache.capacity - 1
        self._head_columns = torch.arange(head_cache.capacity, device=self.device)
        dtype = head.fc.weight.dtype
        # Every position's RoPE rows computed once (the graphs read this table).
        cos, sin = head.rope(
            0, head_cache.capacity, torch.empty((), dtype=dtype, device=self.device)
        )
        self._rope = (cos[0], sin[0])
        self._draft_to_target = head.draft_to_target

    def _draft(
        self,
        window: int,
        taps: torch.Tensor,
        tokens: torch.Tensor,
        path: torch.Tensor,
        count: torch.Tensor,
        bonus: torch.Tensor,
        head_lengths: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next draft from its accepted nodes, in fixed shapes: row b's ``count_b``
        real rows right-aligned in ``size`` rows (so the last real row and the mask slots are
        the layer's last rows, as :meth:`DartHead.forward` has them), the rows before them
        padding (they see position 0 only, write to a trash slot, and nothing sees them).
        Real row d sits at position ``head_length_b + d``, mask slot i at ``head_length_b +
        count_b + i`` (its key stored after the padded block); the masks see the row's cache,
        its real rows and the slots before them, as in the dynamic draft. ``taps`` ``(rows,
        size, 3H)``, ``tokens`` and ``path`` ``(rows, size)``, ``count``, ``bonus`` and
        ``head_lengths`` ``(rows,)``; attention reads the head cache's first ``window``
        positions. Returns the top-k target ids and probabilities ``(rows, masks + 1, k)``."""
        head, head_cache = self.head, self.head_cache
        assert head is not None and head_cache is not None
        rows, size = path.shape
        masks = self.masks
        column = torch.arange(size, device=self.device).unsqueeze(0)
        depth = column - (size - count.unsqueeze(1))  # the real row's accepted depth; < 0: padding
        real = depth >= 0
        at = depth.clamp(min=0)
        nodes = path.gather(1, at)
        width = taps.shape[-1]
        row_taps = taps.gather(1, nodes.unsqueeze(2).expand(rows, size, width))
        path_tokens = tokens.gather(1, path)
        # The token after accepted node d: the next accepted one, the bonus after the last.
        following = path_tokens.gather(1, (at + 1).clamp(max=size - 1))
        next_ids = torch.where(depth < count.unsqueeze(1) - 1, following, bonus.unsqueeze(1))
        base = head_lengths.unsqueeze(1)
        slot = torch.arange(masks, device=self.device).unsqueeze(0)
        positions = torch.cat(
            [torch.where(real, base + depth, 0), base + count.unsqueeze(1) + slot], 1
        )
        slots = torch.cat([torch.where(real, base + depth, self.head_trash), base + size + slot], 1)
        columns = self._head_columns[:window].view(1, 1, -1)
        real_sees = torch.where(
            real.unsqueeze(2), columns <= (base + depth).unsqueeze(2), columns == 0
        )
        mask_sees = (columns < (base + count.unsqueeze(1)).unsqueeze(2)) | (
            (columns >= (base + size).unsqueeze(2)) & (columns <= (base + size + slot).unsqueeze(2))
        )
        visible = torch.cat([real_sees, mask_sees], 1)
        dtype = head.fc.weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min).unsqueeze(1)
        cos, sin = self._rope
        head_cache.slots, head_cache.window = slots, window
        try:
            projected = head.project_taps(row_taps.to(dtype))
            logits = head.draft_logits(
                projected, next_ids, head_cache, (cos[positions], sin[positions]), mask, masks
            )
        finally:
            head_cache.slots, head_cache.window = None, None
        top = torch.topk(logits, self.top_k, dim=-1)
        probs = torch.softmax(top.values.float(), dim=-1)
        return self._draft_to_target[top.indices], probs


class StaticVerifier(StaticPrograms):
    """Fixed-shape verification over one :class:`TargetCache` (see the module docstring).

    ``graphs``: capture each bucket's program as a CUDA graph the first time it runs (cuda
    only); otherwise it runs eagerly, buffers and all. With a ``head``, a greedy step also
    drafts the next step's rows (top ``top_k`` per row) from the accepted nodes, in the same
    program and the same copy out, over :attr:`head_cache` (the head's static cache).
    """

    def __init__(
        self,
        target: TargetModel,
        cache: TargetCache,
        max_tree: int,
        *,
        graphs: bool,
        buckets: tuple[int, ...] | None = None,
        head: DartHead | None = None,
        top_k: int = 0,
        head_cache: HeadCache | None = None,
    ) -> None:
        """``buckets``: the padded sizes (default :func:`bucket_sizes` of ``max_tree``);
        ``head_cache``: the head's cache to use (a conversation's), else a new one."""
        self._take(target, graphs)
        device = self.device
        self.target = target
        self.cache = cache
        # A new cache's buffers exist before the first program (its prefill) reads them.
        cache.materialize(target.kv_heads, target.head_dim, target.dtype, device)
        self.buckets = tuple(sorted(buckets)) if buckets else bucket_sizes(max_tree)
        if self.buckets[-1] < max_tree:
            raise InvalidArgumentError(
                f"static buckets {self.buckets} cannot hold a tree of {max_tree} nodes"
            )
        self.capacity = cache.capacity
        #: Rejected nodes' K/V are "compacted" here, never into a live position.
        self.trash = self.capacity - 1
        self._state: dict[tuple[int, int, int], _Bucket] = {}
        #: The bucket the last :meth:`forward` (or prefill chunk) ran: what :meth:`draft`
        #: drafts from.
        self._forwarded: _Bucket | None = None
        #: After :meth:`prefill`: the prompt's length and its last position's taps.
        self._prefill_end: tuple[int, torch.Tensor] | None = None
        self._columns = torch.arange(self.capacity, device=device)
        self.head = None
        self.head_cache = None
        if head is not None:
            # The head's length never exceeds the target's: room for a padded draft (the
            # accepted rows, then the mask slots) after it, and a trash slot.
            head_capacity = static_head_capacity(self.capacity, head.config.draft_length)
            if head_cache is not None and head_cache.capacity != head_capacity:
                raise InvalidArgumentError(
                    f"a static head cache holds {head_capacity} positions here, not "
                    f"{head_cache.capacity}"
                )
            self._draft_with(head, head_cache or head.new_cache(head_capacity), top_k)
        self.clear_tail()

    def clear_tail(self) -> None:
        """Zero every K/V position from the cache's length on: the static forward attends
        over the whole buffer, and a masked key must weigh exactly 0 (0 x an uninitialised
        NaN is not 0). Once per generation; what a step leaves there later is finite."""
        caches: list[Any] = [self.cache, self.head_cache]
        for cache in caches:
            if cache is None:
                continue
            length = cache.length
            for buffer, batch_axis in cache.buffers():
                dim = batch_axis + 2  # the sequence axis
                buffer.narrow(dim, length, buffer.shape[dim] - length).zero_()

    @property
    def max_tree(self) -> int:
        return self.buckets[-1]

    # -- the step -------------------------------------------------------------------------

    def greedy_step(self, tree: Tree) -> StaticStep:
        """Verify ``tree`` at the cache's length, accept greedily and compact on the device;
        the cache's length then counts the accepted nodes. The three phases (copy in,
        replay, copy out) are :meth:`load`, :meth:`run_greedy` and :meth:`accepted`."""
        state = self.load(tree)
        out = self.run_greedy(state)
        return self.accepted(state, out, tree)

    def run_greedy(self, state: _Bucket) -> dict[str, Any]:
        """The loaded bucket's forward, acceptance and compaction (one graph on cuda)."""
        return self._execute(state, "greedy")

    def accepted(self, state: _Bucket, out: dict[str, Any], tree: Tree) -> StaticStep:
        """The one device-to-host copy of a greedy step (count, bonus, path) and its
        reading; moves the cache's length past the accepted nodes."""
        host = state.host_out
        host.copy_(out["result"], non_blocking=host.is_pinned())  # the one copy out
        if host.is_pinned():
            torch.cuda.current_stream(self.device).synchronize()
        values = host.numpy()
        size = state.size
        count, bonus = int(values[0]), int(values[1])
        nodes = values[2 : 2 + count].astype(np.int64).tolist()
        self.cache.truncate(self.cache.length + count)
        acceptance = Acceptance(
            nodes=nodes, tokens=[tree.tokens[i] for i in nodes[1:]], bonus=bonus
        )
        rows = None
        if self.head_cache is not None:
            self.head_cache.length += count
            rows = self._rows(values[2 + size :])
        return StaticStep(acceptance, out["taps"][:, :count], rows)

    def forward(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded forward alone (sampling accepts on the host): logits (n, V) and taps
        (1, n, 3H) of the tree's own nodes; the cache's length grows by n, as the dynamic
        verification's does, for the caller's :meth:`TargetCache.keep`."""
        state = self.load(tree)
        out = self._execute(state, "forward")
        state.last_taps, state.taps_from = out["taps"], "forward"
        self._forwarded = state
        n = len(tree)
        self.cache.truncate(self.cache.length + n)
        return out["logits"][0, :n], out["taps"][:, :n]

    def prefill(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ``tokens`` at the cache's length in fixed-shape chunks, each a chain tree
        padded to a :data:`PREFILL_BUCKETS` size (on cuda a graph per size and window),
        instead of one eager forward (a GPU step of a small model's eager forward is its
        kernels' launches: 38 ms for SmolLM2-135M on an H200, a graph's replay 3 ms). With a
        head, each chunk's program also runs the head over the chunk's positions whose next
        token is known (all but the last token's: :meth:`first_draft` reads that one once the
        first token is picked). A chunk with no room for its bucket before the trash slot
        runs eagerly. Returns the last token's logits ``(V,)`` and every token's taps
        ``(1, n, 3H)``."""
        if not tokens:
            raise InvalidArgumentError("nothing to prefill")
        chunk_limit = PREFILL_BUCKETS[-1]
        head, head_cache = self.head, self.head_cache
        logits = None
        taps: list[torch.Tensor] = []
        for start in range(0, len(tokens), chunk_limit):
            chunk = list(tokens[start : start + chunk_limit])
            n = len(chunk)
            # The head reads a position with the token after it: every one but the prompt's last.
            fed = min(n, len(tokens) - 1 - start)
            size = next(b for b in PREFILL_BUCKETS if b >= n)
            length = self.cache.length
            # The first draft runs from the last chunk's bucket after its fed positions.
            reserve = fed if start + n == len(tokens) else 0
            room = head_cache is None or (
                head_cache.length + reserve + size + self.masks <= self.head_trash
            )
            if length + size > self.trash or not room:
                ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
                positions = torch.arange(length, length + n, device=self.device).unsqueeze(0)
                out_logits, out_taps = self.target.forward(
                    ids, positions, self.cache, logits_to_keep=1, taps=True
                )
                assert out_taps is not None
                if head is not None and head_cache is not None and fed:
                    after = torch.tensor(
                        [tokens[start + 1 : start + 1 + fed]], dtype=torch.long, device=self.device
                    )
                    head(out_taps[:, :fed].to(head.fc.weight.dtype), after, head_cache, num_masks=0)
                logits = out_logits[0, -1]
                taps.append(out_taps)
                self._forwarded = None
                continue
            feed = None if head is None else (fed, tokens[start + fed])
            state = self.load(
                Tree.chain(chunk),
                size=size,
                draft=head is not None,
                feed=feed,
                head_reserve=reserve,
            )
            out = self._execute(state, "forward" if head is None else "prefill")
            self.cache.truncate(length + n)
            if head_cache is not None:
                head_cache.length += fed
            # Views of the program's buffers, which the next chunk overwrites.
            logits = out["logits"][0, n - 1].clone()
            taps.append(out["taps"][:, :n].clone())
            state.last_taps, state.taps_from = out["taps"], "prefill"
            self._forwarded = state
        assert logits is not None
        all_taps = torch.cat(taps, 1)
        self._prefill_end = (len(tokens), all_taps[:, -1:])
        return logits, all_taps

    def first_draft(self, first: int) -> DraftRows:
        """After :meth:`prefill` (with a head): the head reads the prompt's last position with
        the ``first`` token after it and drafts the first tree's rows, in the draft program
        over the last chunk (:meth:`draft`), or eagerly where that chunk ran eagerly."""
        if self.head is None or self.head_cache is None or self._prefill_end is None:
            raise InvalidArgumentError("first_draft() follows prefill() on a verifier with a head")
        prompt_len, last_taps = self._prefill_end
        self._prefill_end = None
        state = self._forwarded
        if state is not None:
            last = (prompt_len - 1) % PREFILL_BUCKETS[-1]
            return self.draft(Acceptance(nodes=[last], tokens=[], bonus=first))
        ids = torch.tensor([[first]], dtype=torch.long, device=self.device)
        return draft_rows(self.head, self.head_cache, last_taps, ids, self.top_k)

    def draft(self, acceptance: Acceptance) -> DraftRows:
        """After a sampling step (:meth:`forward`, then acceptance and compaction on the
        host): the head's next draft from the accepted nodes, in a program of its own over
        the forward's taps (on cuda a graph per bucket), as a greedy step drafts in its
        replay; one small copy in, one out. The head cache's length then counts the
        accepted nodes."""
        state, head_cache = self._forwarded, self.head_cache
        if state is None or head_cache is None or self.head is None:
            raise InvalidArgumentError("draft() follows forward() on a verifier with a head")
        size = state.size
        if state.draft_host is None:
            pinned = self.device.type == "cuda"
            cells = 2 * (self.masks + 1) * self.top_k
            state.draft_host = torch.zeros(
                DRAFT_HEADER + size, dtype=torch.int64, pin_memory=pinned
            )
            state.draft_in = torch.zeros(DRAFT_HEADER + size, dtype=torch.int64, device=self.device)
            state.draft_out = torch.zeros(cells, dtype=torch.float64, pin_memory=pinned)
        assert state.draft_in is not None and state.draft_out is not None
        count = len(acceptance.nodes)
        words = state.draft_host.numpy()
        words[:] = 0
        words[0], words[1], words[2] = count, acceptance.bonus, head_cache.length
        words[DRAFT_HEADER : DRAFT_HEADER + count] = acceptance.nodes
        state.draft_in.copy_(state.draft_host, non_blocking=state.draft_host.is_pinned())
        out = self._execute(state, f"draft:{state.taps_from}")
        host = state.draft_out
        host.copy_(out["result"], non_blocking=host.is_pinned())
        if host.is_pinned():
            torch.cuda.current_stream(self.device).synchronize()
        head_cache.length += count
        return self._rows(host.numpy())

    def _rows(self, values: np.ndarray) -> DraftRows:
        """Draft rows from a program's output: ids, then probabilities, ``(masks + 1, k)``."""
        shape = (self.masks + 1, self.top_k)
        cells = shape[0] * shape[1]
        return DraftRows(
            ids=values[:cells].astype(np.int64).reshape(shape),
            probs=values[cells : 2 * cells].astype(np.float32).reshape(shape),
        )

    # -- buffers ---------------------------------------------------------------------------

    def load(
        self,
        tree: Tree,
        size: int | None = None,
        draft: bool = True,
        feed: tuple[int, int] | None = None,
        head_reserve: int = 0,
    ) -> _Bucket:
        """Pack the tree into its bucket's host buffer (``size``: this one, not the tree's
        bucket) and send it in one copy. ``draft=False``: for a forward the head reads
        nothing of (a prefill's without a head): its window does not pick the program.
        ``feed``: a prefill chunk's (positions the head reads, the token after them);
        ``head_reserve``: head positions written before a draft from this bucket (the last
        chunk's, before :meth:`first_draft`)."""
        n = len(tree)
        size = self.bucket(n) if size is None else size
        head = self.head_cache if draft else None
        if self.cache.length + size > self.trash or (
            head is not None and head.length + head_reserve + size + self.masks > self.head_trash
        ):
            raise InvalidArgumentError(
                f"static cache overflow: a {size}-node bucket at length {self.cache.length} "
                f"needs more than the capacity of {self.capacity}"
            )
        window = attention_window(self.cache.length + size, self.capacity)
        head_window = 0
        if head is not None:
            head_end = head.length + head_reserve + size + self.masks
            head_window = attention_window(head_end, head.capacity)
        key = (size, window, head_window)
        state = self._state.get(key) or self._new_bucket(size, window, head_window)
        self._pack(state, tree, feed)
        state.device_in.copy_(state.host_in, non_blocking=state.host_in.is_pinned())
        return state

    def _new_bucket(self, size: int, window: int, head_window: int) -> _Bucket:
        words = HEADER + 3 * size + math.ceil(size * size / 8)
        pinned = self.device.type == "cuda"
        host_in = torch.zeros(words, dtype=torch.int64, pin_memory=pinned)
        drafted = 0 if self.head is None else 2 * (self.masks + 1) * self.top_k
        state = _Bucket(
            size=size,
            window=window,
            head_window=head_window,
            host_in=host_in,
            device_in=torch.zeros(words, dtype=torch.int64, device=self.device),
            slots=torch.zeros(size, dtype=torch.int64, device=self.device),
            host_out=torch.zeros(2 + size + drafted, dtype=torch.float64, pin_memory=pinned),
            outputs={},
            graphs={},
        )
        self._state[(size, window, head_window)] = state
        return state

    def _pack(self, state: _Bucket, tree: Tree, feed: tuple[int, int] | None = None) -> None:
        size, n = state.size, len(tree)
        words = state.host_in.numpy()
        words[:] = 0
        words[0], words[1] = self.cache.length, n
        words[2] = 0 if self.head_cache is None else self.head_cache.length
        if feed is not None:
            words[3], words[4] = feed
        words[HEADER : HEADER + n] = tree.tokens
        words[HEADER + size : HEADER + size + n] = tree.depths.numpy()
        parents = np.asarray(tree.parents, dtype=np.int64)
        words[HEADER + 2 * size + 1 : HEADER + 2 * size + n] = parents[1:]
        mask = words[HEADER + 3 * size :].view(np.uint8)[: size * size].reshape(size, size)
        mask[:n, :n] = tree.mask.numpy()
        # A padded node sees only itself (a well-defined softmax); nothing sees it.
        pad = np.arange(n, size)
        mask[pad, pad] = 1

    # -- the device program ------------------------------------------------------------------

    @torch.no_grad()
    def _program(self, state: _Bucket, kind: str) -> dict[str, Any]:
        """Everything between the two copies, in fixed shapes: read the packed inputs, run
        the padded forward, and for ``kind == "greedy"`` accept and compact; ``"prefill"``: a
        prompt chunk's forward and the head's pass over it (:meth:`prefill`);
        ``"draft:forward"`` / ``"draft:prefill"``: the draft from the accepted nodes of the
        forward or prefill program before it (:meth:`draft`)."""
        size = state.size
        words = state.device_in
        if kind.startswith("draft"):
            assert state.draft_in is not None and state.last_taps is not None
            given = state.draft_in
            ids, probs = self._draft(
                state.head_window,
                state.last_taps,
                words[HEADER : HEADER + size].unsqueeze(0),
                given[DRAFT_HEADER:].unsqueeze(0),
                given[0:1],
                given[1:2],
                given[2:3],
            )
            return {"result": torch.cat([ids.flatten().double(), probs.flatten().double()])}
        length, n, head_length = words[0], words[1], words[2]
        tokens = words[HEADER : HEADER + size]
        depths = words[HEADER + size : HEADER + 2 * size]
        parents = words[HEADER + 2 * size : HEADER + 3 * size]
        mask_words = words[HEADER + 3 * size :]
        sees = mask_words.view(torch.uint8)[: size * size].view(size, size).bool()
        nodes = torch.arange(size, device=self.device)
        state.slots.copy_(nodes + length)
        mask = self._mask(sees, length, size, state.window)
        self.cache.set_slots(state.slots, state.window)
        try:
            logits, taps = self.target.run(
                tokens.unsqueeze(0), (depths + length).unsqueeze(0), mask, self.cache
            )
        finally:
            self.cache.set_slots(None)
        assert taps is not None
        if kind == "forward":
            return {"logits": logits, "taps": taps}
        if kind == "prefill":
            # The head reads the chunk's first words[3] positions (its draft is not used).
            self._draft(
                state.head_window,
                taps,
                tokens.unsqueeze(0),
                nodes.unsqueeze(0),
                words[3:4],
                words[4:5],
                words[2:3],
            )
            return {"logits": logits, "taps": taps}
        accepted, count, bonus, paths = greedy_acceptance(
            logits.argmax(-1),
            tokens.unsqueeze(0),
            parents.unsqueeze(0),
            depths.unsqueeze(0),
            sees.unsqueeze(0),
            (nodes < n).unsqueeze(0),
        )
        accepted, path = accepted[0], paths[0]
        # Compaction: accepted node i moves from length + i to length + depth(i).
        source = nodes + length
        target = torch.where(accepted, depths + length, self.trash)
        for buffer, batch_axis in self.cache.buffers():
            dim = batch_axis + 2  # the sequence axis
            buffer.index_copy_(dim, target, buffer.index_select(dim, source))
        parts = [count, bonus, path]
        if self.head is not None:
            ids, probs = self._draft(
                state.head_window,
                taps,
                tokens.unsqueeze(0),
                paths,
                count,
                bonus,
                head_length.unsqueeze(0),
            )
            parts += [ids.flatten(), probs.flatten()]
        return {
            "result": torch.cat([p.double() for p in parts]),
            "taps": taps.index_select(1, path),
        }

    def _mask(
        self, sees: torch.Tensor, length: torch.Tensor, size: int, window: int
    ) -> torch.Tensor:
        """Float mask (1, 1, size, window): every node sees the cache below ``length``
        and, from ``length`` on, the tree nodes its row of ``sees`` allows; nothing else."""
        offset = self._columns[:window] - length
        in_tree = (offset >= 0) & (offset < size)
        tree_part = sees[:, offset.clamp(0, size - 1)] & in_tree
        visible = (offset < 0) | tree_part
        dtype = self.target.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)
        return mask.view(1, 1, size, window)


def verifier_for(
    target: TargetModel,
    cache: TargetCache,
    max_tree: int,
    *,
    graphs: bool,
    head: DartHead | None = None,
    top_k: int = 0,
    head_cache: HeadCache | None = None,
) -> StaticVerifier:
    """The cache's static verifier for this head (kept on the cache, one per head and
    setting, so AR and DART runs on one cache keep their graphs: those hold the cache's
    buffers), made anew when the trees outgrow its buckets or ``head_cache`` (a
    conversation's, to continue) is not its own."""
    key = (id(head) if head is not None else None, top_k if head is not None else 0, graphs)
    held = cache.static_verifiers.get(key)
    if (
        isinstance(held, StaticVerifier)
        and held.target is target
        and held.head is head
        and held.max_tree >= max_tree
        and (head_cache is None or held.head_cache is head_cache)
    ):
        return held
    verifier = StaticVerifier(
        target, cache, max_tree, graphs=graphs, head=head, top_k=top_k, head_cache=head_cache
    )
    cache.static_verifiers[key] = verifier
    return verifier


#: ``GenerationConfig.static`` values.
STATIC_CHOICES: tuple[Any, ...] = (True, False, "auto")


def resolve_static(value: bool | str, devices: set[torch.device]) -> bool:
    """Whether a target whose weights are on ``devices`` takes the static path. ``value``:
    True, False, ``"auto"`` (or ``"on"``/``"off"``, as command lines give it). ``"auto"``:
    on one cuda device (on the CPU the padded trees and windows cost more than they save; a
    target split over devices has no single place for the cache and the graphs)."""
    value = parse_static(value)
    if value == "auto":
        return len(devices) == 1 and next(iter(devices)).type == "cuda"
    return bool(value)


#: Free static caches a target keeps for later generations, per kind (lone, or batched of a
#: given row count): the largest ones, each serving any shorter context, graphs included.
#: Concurrent generations beyond it allocate, and on return the smallest free caches beyond
#: it are dropped, so a burst of long contexts does not pin their memory for the target's
#: lifetime.
KEEP_FREE_STATIC_CACHES = 2


def _static_pool(target: TargetModel, batch: int | None = None) -> list[TargetCache]:
    if batch is None:
        return target.__dict__.setdefault("_static_caches", [])
    pools = target.__dict__.setdefault("_static_batch_caches", {})
    return pools.setdefault(batch, [])


def lend_cache(target: TargetModel, capacity: int, batch: int | None = None) -> TargetCache:
    """A static cache of at least ``capacity`` for one generation (``batch``: for a batch of
    that many rows, ``dart_client.decoding.batch``): a free one the target holds (its
    captured graphs come with it) or a new one it then holds. Give it back with
    :func:`return_cache`; a cache still lent (a generation in progress) is never shared."""
    pool = _static_pool(target, batch)
    free = [c for c in pool if not getattr(c, "lent", False) and c.capacity >= capacity]
    cache = min(free, key=lambda c: c.capacity) if free else None
    if cache is None:
        cache = target.new_cache(capacity, batch or 1)
        cache.pool = batch  # type: ignore[attr-defined]
        pool.append(cache)
    cache.truncate(0)
    cache.lent = True  # type: ignore[attr-defined]
    return cache


def return_cache(target: TargetModel, cache: TargetCache) -> None:
    """``cache`` free again; the target keeps the :data:`KEEP_FREE_STATIC_CACHES` largest
    free caches of its kind and lets the others go."""
    cache.lent = False  # type: ignore[attr-defined]
    pool = _static_pool(target, getattr(cache, "pool", None))
    free = sorted((c for c in pool if not c.lent), key=lambda c: c.capacity, reverse=True)
    for dropped in free[KEEP_FREE_STATIC_CACHES:]:
        pool.remove(dropped)
