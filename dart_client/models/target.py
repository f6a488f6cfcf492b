"""The target model: transformers' own decoder, driven with explicit masks, positions and taps.

One code path for every decoder-only model transformers builds with a ``model.layers`` stack
(Llama family, Qwen3, ...): a custom 4D float attention mask (0 = attend, dtype-min =
blocked) and explicit position ids pass through transformers unchanged, so tree
verification needs no copy of any modeling file. The taps are the inputs of 0-based layers
``2, N//2, N-3`` (captured by forward pre-hooks), concatenated low/mid/high.

The KV cache is preallocated (:class:`TargetCache`): new keys/values are written in place,
accepted tree nodes are compacted with ``index_select`` and rejected ones dropped, and it
can never grow past its capacity.

On the CPU the model runs on kernels chosen for decoding: its linear layers multiply with
oneDNN-packed weights (:mod:`dart_client.models.linear`) and its attention computes a few
queries over a long cache directly (:mod:`dart_client.models.attention`). Both make a
forward cheaper, a tree's most of all.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from dart_client.errors import UnsupportedTargetError
from dart_client.models import elementwise, gpu_kernels
from dart_client.models.attention import (
    decoding_sdpa,
    restore_attention,
    use_small_query_attention,
)
from dart_client.models.linear import PackReport, pack_linear_layers, unpack_linear_layers
from dart_client.models.native import bf16_bits

log = logging.getLogger(__name__)


class PreallocatedLayer(DynamicLayer):
    """One layer's K/V in a fixed-capacity buffer; ``keys``/``values`` are views of the prefix.

    The views are made when read (``update`` returns them), so moving the length -- once per
    layer per step -- costs an integer store, not two tensor slices.
    """

    def __init__(self, capacity: int, storage: StackedStorage | None = None) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        super().__init__()
        self.capacity = capacity
        self.length = 0
        #: Where the buffers come from: one block for every layer of a cache (so that
        #: compaction is one copy, not two per layer), or None for a buffer of its own.
        self.storage = storage
        #: Static mode (:meth:`TargetCache.set_slots`): the cache positions, a device tensor,
        #: that the next keys are written to; attention then reads the buffer's first
        #: ``window`` positions (every forward of a window has the same shapes, as a CUDA
        #: graph needs) and a mask hides what it must not see.
        self.slots: torch.Tensor | None = None
        self.window: int | None = None
        #: A batched cache's live rows (its first ``rows`` batch entries); None: every entry.
        self.rows: int | None = None
        #: :meth:`writable_bits`' views: (rows, K bits, V bits).
        self._bits: tuple[int | None, np.ndarray, np.ndarray] | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[: self.rows, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _views_only(value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[: self.rows, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _views_only(value)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        views = None if self.storage is None else self.storage.views(key_states, value_states)
        if views is None:
            b, h, _, d = key_states.shape
            views = (
                key_states.new_empty((b, h, self.capacity, d)),
                value_states.new_empty(
                    (b, value_states.shape[1], self.capacity, value_states.shape[3])
                ),
            )
        self._k, self._v = views
        self._bits = None
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._k is not None and self._v is not None
        if self.slots is not None:
            # No host-side length: the caller moves it once it knows what was accepted. A
            # batched cache's program runs its first rows (a power of two of them).
            rows = key_states.shape[0]
            k, v = self._k[:rows], self._v[:rows]
            k.index_copy_(2, self.slots, key_states)
            v.index_copy_(2, self.slots, value_states)
            window = self.window
            return k[:, :, :window], v[:, :, :window]
        end = self._end(key_states.shape[-2])
        rows = self.rows
        self._k[:rows, :, self.length : end] = key_states
        self._v[:rows, :, self.length : end] = value_states
        self.length = end
        return self._k[:rows, :, :end], self._v[:rows, :, :end]

    def writable_bits(self, batch: int, tokens: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """For a kernel that appends ``tokens`` positions of ``batch`` rows itself
        (``_native.decoder_layer``): the live rows' bf16 K and V buffers as uint16 arrays
        (full capacity, written in place; the views are kept while the live rows stay) and
        the first position to write; the caller then moves the length with
        :meth:`set_length`. None where :meth:`update` must run (static slots, buffers not
        allocated yet or not bf16, another row count); an overflow is the error ``update``
        raises."""
        if self.slots is not None or self._k is None or self._v is None:
            return None
        bits = self._bits
        if bits is None or bits[0] != self.rows:
            k, v = self._k[: self.rows], self._v[: self.rows]
            if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
                return None
            bits = self._bits = (self.rows, bf16_bits(k), bf16_bits(v))
        if bits[1].shape[0] != batch:
            return None
        self._end(tokens)
        return bits[1], bits[2], self.length

    def _end(self, tokens: int) -> int:
        """The length after appending ``tokens`` positions; an error past the capacity."""
        end = self.length + tokens
        if end > self.capacity:
            raise RuntimeError(
                f"target KV cache overflow: {end} positions for a capacity of {self.capacity}"
            )
        return end

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def set_length(self, length: int) -> None:
        self.length = length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.set_length(self.length + tokens_to_remove)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move positions ``keep`` (absolute, ascending, all >= start) to ``start..`` in place."""
        if self._k is None or self._v is None:
            return
        n = int(keep.numel())
        # index_select copies first, so overlapping source and destination are safe.
        self._k[:, :, start : start + n] = self._k.index_select(2, keep)
        self._v[:, :, start : start + n] = self._v.index_select(2, keep)
        self.set_length(start + n)

    def reset(self) -> None:
        self.set_length(0)

    def allocate_rows(self, batch: int, like: PreallocatedLayer) -> None:
        """Buffers for ``batch`` rows shaped like ``like``'s (a one-sequence layer), not
        initialised: :meth:`TargetCache.put_row` zeroes what a row may read before anything
        is written there."""
        assert like._k is not None and like._v is not None
        shape = (batch, *like._k.shape[1:2], 0, like._k.shape[3])
        vshape = (batch, *like._v.shape[1:2], 0, like._v.shape[3])
        self.lazy_initialization(like._k.new_empty(shape), like._v.new_empty(vshape))


def _views_only(value: torch.Tensor | None) -> None:
    """transformers' base classes set ``keys``/``values`` to None on init; nothing may
    replace the views of a preallocated buffer."""
    if value is not None:
        raise RuntimeError(
            "a preallocated K/V layer's keys/values are views of its buffer: write through "
            "update(), move the length with set_length()"
        )


class StackedStorage:
    """The K/V buffers of every layer of one cache in a single block
    ``(layers, 2, batch, kv_heads, capacity, head_dim)``, allocated when the first layer
    first stores keys.

    Compacting accepted tree nodes is then one ``index_select`` and one copy over all layers
    at once instead of four small ops per layer (120 for SmolLM2's 30 layers: half a
    millisecond per step on a CPU, as many kernel launches on a GPU). A layer whose K/V do not
    match the first layer's shape or dtype (no model we know, but nothing forbids it) gets a
    buffer of its own, and compaction falls back to per-layer copies.
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.num_layers = num_layers
        self.capacity = capacity
        self.block: torch.Tensor | None = None
        #: Layers whose buffers are in the block (they take its slots in order).
        self.placed = 0

    @property
    def complete(self) -> bool:
        """Every layer's buffers are in the block (once each layer has stored keys)."""
        return self.placed == self.num_layers

    def views(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next layer's (K, V) buffers in the block, or None when its K/V cannot live
        there."""
        b, h, _, d = keys.shape
        block = self.block
        fits = (
            values.shape == keys.shape
            and values.dtype == keys.dtype
            and self.placed < self.num_layers
            and (
                block is None
                or (
                    (b, h, d) == (block.shape[2], block.shape[3], block.shape[5])
                    and keys.dtype == block.dtype
                    and keys.device == block.device
                )
            )
        )
        if not fits:
            return None
        if block is None:
            block = self.block = keys.new_empty((self.num_layers, 2, b, h, self.capacity, d))
        slot = self.placed
        self.placed += 1
        return block[slot, 0], block[slot, 1]

    def compact(self, start: int, keep: torch.Tensor) -> bool:
        """Move positions ``keep`` to ``start..`` in every layer at once; False when the
        layers do not all live in the block (the caller compacts each layer then)."""
        block = self.block
        if block is None or not self.complete:
            return False
        n = int(keep.numel())
        # index_select copies first, so overlapping source and destination are safe.
        block[:, :, :, :, start : start + n] = block.index_select(4, keep)
        return True


class TargetCache(Cache):
    """A transformers ``Cache`` of :class:`PreallocatedLayer` with tree-compaction helpers.

    A batched cache (``batch`` > 1, :meth:`put_row` ... :meth:`keep_rows`) holds one sequence
    per row, each of its own length (:attr:`rows`). Every forward appends at one frontier,
    the longest row's length; a shorter row's positions between its length and the frontier
    are stale and masked (:func:`attention_mask` with ``row_lengths``), and
    :meth:`keep_rows` moves each row's accepted nodes down to its own length.
    """

    def __init__(
        self, num_layers: int, capacity: int, *, stacked: bool = True, batch: int = 1
    ) -> None:
        """``stacked``: keep every layer's K/V in one block (:class:`StackedStorage`); pass
        False when the layers sit on several devices (the block would hold every layer's
        cache on the first one). ``batch``: rows of a batched cache."""
        self.storage = StackedStorage(num_layers, capacity) if stacked else None
        super().__init__(
            layers=[PreallocatedLayer(capacity, self.storage) for _ in range(num_layers)]
        )
        self.capacity = capacity
        self.batch = batch
        #: The valid length of each live row of a batched cache.
        self.rows = RaggedRows()
        #: The static path's verifiers for this cache (``decoding.static.verifier_for``).
        self.static_verifiers: dict[Any, Any] = {}

    def set_slots(self, slots: torch.Tensor | None, window: int | None = None) -> None:
        """Static mode: every layer writes new keys to positions ``slots`` (a device tensor,
        read at each forward, so a captured graph follows its contents) and attends over
        the buffer's first ``window`` positions (None: all of it;
        ``dart_client.decoding.static``); ``slots=None``: back to appending at the length."""
        for layer in self._layers():
            layer.slots, layer.window = slots, window

    def _layers(self) -> list[PreallocatedLayer]:
        layers = [layer for layer in self.layers if isinstance(layer, PreallocatedLayer)]
        assert len(layers) == len(self.layers)
        return layers

    def buffers(self) -> list[tuple[torch.Tensor, int]]:
        """Every K/V buffer with its batch axis (the sequence axis is two further): the
        stacked block once, else each layer's two buffers."""
        storage = self.storage
        if storage is not None and storage.block is not None and storage.complete:
            return [(storage.block, 2)]
        out: list[tuple[torch.Tensor, int]] = []
        for layer in self._layers():
            if layer._k is not None and layer._v is not None:
                out += [(layer._k, 0), (layer._v, 0)]
        return out

    def materialize(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any) -> None:
        """Allocate every layer's buffers now, zeroed, not at the first forward's write: a
        static program reads a window past what it writes, where a masked key weighs
        exactly 0 only next to finite values."""
        like = torch.empty((self.batch, kv_heads, 0, head_dim), dtype=dtype, device=device)
        fresh = False
        for layer in self._layers():
            if not layer.is_initialized:
                layer.lazy_initialization(like, like)
                fresh = True
        if fresh:
            for buffer, _ in self.buffers():
                buffer.zero_()

    def _set_rows(self) -> None:
        frontier = self.rows.frontier
        for layer in self._layers():
            layer.rows = len(self.rows)
            layer.set_length(frontier)

    def put_row(
        self,
        row: int,
        source: TargetCache,
        *,
        source_row: int = 0,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Copy ``source`` (one sequence, e.g. a prompt prefilled alone) into ``row``: a live
        row (replaced) or the next free one. ``source_row`` and ``span`` (start, length) pick
        one sequence of a source that holds several (prompts prefilled together, each at
        its own offset); by default its first entry's first ``source.length`` positions.

        Every live row's positions below the frontier hold finite values (a copy, a
        forward's write, or zeros put here): attention masks a row's stale ones, and a
        masked zero adds nothing to its weighted sum where uninitialised memory (NaN) would.
        Only the positions that keeps true are zeroed, not the whole buffer."""
        if not 0 <= row <= len(self.rows) or row >= self.batch:
            raise ValueError(f"row {row} of a cache of {len(self.rows)} live rows")
        start, n = (0, source.length) if span is None else span
        if n > self.capacity:
            raise RuntimeError(f"a {n}-position sequence in a cache of capacity {self.capacity}")
        pairs = list(zip(self._layers(), source._layers(), strict=True))
        for mine, theirs in pairs:
            if not mine.is_initialized:
                mine.allocate_rows(self.batch, theirs)
        before = self.rows.frontier
        self.rows.put(row, n)
        after = self.rows.frontier
        for buffer, axis in self.buffers():
            # Where the frontier grew, every live row; then this row up to the frontier
            # (its first n positions are copied next).
            buffer[_at(axis, slice(0, len(self.rows)), slice(None), slice(before, after))] = 0
            buffer[_at(axis, row, slice(None), slice(n, after))] = 0
        for mine, theirs in pairs:
            assert mine._k is not None and mine._v is not None
            assert theirs._k is not None and theirs._v is not None
            mine._k[row, :, :n] = theirs._k[source_row, :, start : start + n]
            mine._v[row, :, :n] = theirs._v[source_row, :, start : start + n]
        self._set_rows()

    def drop_row(self, row: int) -> None:
        """Free ``row``: the last live row moves into it (live rows stay the first ones)."""
        last = self.rows.drop(row)
        if last is not None:
            for buffer, axis in self.buffers():
                copy_row(buffer, axis, row, last, self.rows.lengths[row])
        self._set_rows()

    def keep_rows(self, start: int, nodes: Sequence[Sequence[int]], device: torch.device) -> None:
        """After a forward appended every live row's tree at ``start`` (the frontier): keep
        row b's nodes ``nodes[b]`` (relative to ``start``, ascending) at its own length."""
        plan = self.rows.compaction(start, nodes, device)
        if plan is not None:
            for buffer, axis in self.buffers():
                compact_rows(buffer, axis, plan)
        self._set_rows()

    def clear_tails(self) -> None:
        """Zero each live row's positions from its length on, and every free row's."""
        lengths = self.rows.lengths
        for buffer, axis in self.buffers():
            for row, length in enumerate(lengths):
                buffer[_at(axis, row, slice(None), slice(length, None))] = 0
            buffer[_at(axis, slice(len(lengths), None))] = 0

    def grow_rows(self, counts: Sequence[int]) -> None:
        """After a static batched step compacted every live row's accepted nodes to its own
        length (``dart_client.decoding.static_batch``): row b is ``counts[b]`` longer."""
        self.rows.grow(counts)
        self._set_rows()

    @property
    def length(self) -> int:
        first = self.layers[0]
        assert isinstance(first, PreallocatedLayer)
        return first.length

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            assert isinstance(layer, PreallocatedLayer)
            layer.set_length(length)

    def keep(self, start: int, node_indices: Sequence[int], device: torch.device) -> None:
        """Keep tree nodes ``node_indices`` (relative to ``start``, ascending), drop the rest."""
        n = len(node_indices)
        if list(node_indices) == list(range(n)):
            self.truncate(start + n)  # already in place: a crop suffices
            return
        keep = torch.tensor([start + i for i in node_indices], dtype=torch.long, device=device)
        if self.storage is not None and self.storage.compact(start, keep):
            self.truncate(start + n)
            return
        for layer in self.layers:
            assert isinstance(layer, PreallocatedLayer)
            layer.compact(start, keep)


class RaggedRows:
    """The valid lengths of a batched cache's live rows (rows 0 .. len - 1), and the index
    plans that move their K/V; shared by the target's and the head's caches."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def frontier(self) -> int:
        """Where the next forward appends: the longest row's length."""
        return max(self.lengths, default=0)

    def put(self, row: int, length: int) -> None:
        if row == len(self.lengths):
            self.lengths.append(length)
        else:
            self.lengths[row] = length

    def grow(self, counts: Sequence[int]) -> None:
        """Row b is ``counts[b]`` longer (negative: shorter)."""
        if len(counts) != len(self.lengths):
            raise ValueError(f"{len(counts)} counts for {len(self.lengths)} live rows")
        for b, count in enumerate(counts):
            self.lengths[b] += count

    def drop(self, row: int) -> int | None:
        """Forget ``row``; returns the row whose K/V must move into it (None: it was last)."""
        if not 0 <= row < len(self.lengths):
            raise ValueError(f"row {row} of {len(self.lengths)} live rows")
        last = len(self.lengths) - 1
        self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        return None if row == last else last

    def compaction(
        self, start: int, keeps: Sequence[Sequence[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows, sources, destinations), each (live, widest keep): row b's ``keeps[b]``
        (relative to ``start``) go to ``lengths[b]..``; a shorter keep is padded with
        copies of positions onto themselves. Advances the lengths. None: nothing moves."""
        if len(keeps) != len(self.lengths):
            raise ValueError(f"{len(keeps)} keeps for {len(self.lengths)} live rows")
        width = max((len(k) for k in keeps), default=0)
        if width == 0:
            return None
        src, dst = [], []
        moves = False
        for length, keep in zip(self.lengths, keeps, strict=True):
            to = list(range(length, length + width))
            fro = [start + int(i) for i in keep] + to[len(keep) :]
            moves = moves or fro[: len(keep)] != to[: len(keep)]
            src.append(fro)
            dst.append(to)
        for b, keep in enumerate(keeps):
            self.lengths[b] += len(keep)
        if not moves:
            return None
        rows = torch.arange(len(keeps), device=device).unsqueeze(1)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return rows, as_tensor(src), as_tensor(dst)

    def stale(self, frontier: int, device: torch.device) -> torch.Tensor:
        """(live, frontier) bool: cache positions past each row's length (masked)."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=device).unsqueeze(1)
        return torch.arange(frontier, device=device).unsqueeze(0) >= lengths


def _at(axis: int, *index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + index


def copy_row(buffer: torch.Tensor, axis: int, dst: int, src: int, length: int) -> None:
    """Row ``src``'s first ``length`` positions to row ``dst`` (batch ``axis``, sequence
    ``axis + 2``)."""
    buffer[_at(axis, dst, slice(None), slice(0, length))] = buffer[
        _at(axis, src, slice(None), slice(0, length))
    ]


def compact_rows(
    buffer: torch.Tensor, axis: int, plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """Apply a :meth:`RaggedRows.compaction` plan: one gather and one scatter for all rows
    (the gather copies first, so overlapping sources and destinations are safe)."""
    rows, src, dst = plan
    buffer[_at(axis, rows, slice(None), dst)] = buffer[_at(axis, rows, slice(None), src)]


def cache_keyword(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` from transformers
    5.24 on (``past_key_values`` then warns on every call, and goes in 5.40), else
    ``past_key_values``. Read from the signature, which is what the call must match."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class TargetModel:
    """A transformers causal LM wrapped for DART: taps, tree forwards, a preallocated cache."""

    def __init__(
        self, model: nn.Module, tokenizer: Any = None, *, cpu_kernels: bool = True
    ) -> None:
        """Wrap ``model`` (a transformers causal LM). With ``cpu_kernels``, a model on the
        CPU switches to the decoding kernels: oneDNN-packed linear layers in bf16/fp32
        (:func:`pack_linear_layers`; a second copy of those weights, skipped with a log line
        when memory is short) and :func:`small_query_attention`. The outputs are the same
        up to floating-point rounding; :meth:`close` switches back."""
        self.model = model
        self._cache_keyword = cache_keyword(model)
        self.tokenizer = tokenizer
        config = getattr(model, "config", None)
        if config is None:
            raise UnsupportedTargetError(
                f"{type(model).__name__} has no .config: not a transformers model"
            )
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise UnsupportedTargetError(
                f"{type(model).__name__}: expected a decoder with a `layers` ModuleList"
            )
        self.layers = layers
        self.num_layers = len(layers)
        if self.num_layers < 4:
            raise UnsupportedTargetError(
                f"{type(model).__name__} has {self.num_layers} layers; DART taps layers "
                f"2, N//2 and N-3, so it needs at least 4"
            )
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise UnsupportedTargetError(
                f"{type(model).__name__}: layer types {sorted(set(layer_types))}; only full "
                "attention can verify a tree against a compacted cache"
            )
        n = self.num_layers
        self.tap_layers = (2, n // 2, n - 3)
        self.hidden_size: int = self.config.hidden_size
        heads = self.config.num_attention_heads
        self.head_dim: int = getattr(self.config, "head_dim", None) or self.hidden_size // heads
        self.kv_heads: int = getattr(self.config, "num_key_value_heads", None) or heads
        self.vocab_size: int = self.config.vocab_size
        self.max_positions: int | None = getattr(self.config, "max_position_embeddings", None)
        self._taps: dict[int, torch.Tensor] = {}
        self._capture = False
        #: Seconds the last :meth:`forward` spent inside the model's own forward call (the
        #: mask, the taps and the caller's input tensors excluded).
        self.last_forward_seconds = 0.0
        #: The clock of that figure and of generation's stage timings: wall time; a profile
        #: on a shared machine may use ``time.thread_time`` (this thread's CPU time, blind to
        #: waits for a core; valid with one intra-op thread, the calling one).
        self.clock = time.perf_counter
        self._hooks = [
            layers[i].register_forward_pre_hook(self._make_hook(slot), with_kwargs=True)
            for slot, i in enumerate(self.tap_layers)
        ]
        #: What :func:`~dart_client.models.elementwise.native_forward` needs of the taps:
        #: layer index -> slot, and the hooks that are ours.
        self._tap_slots = {
            layer: tuple(s for s, tapped in enumerate(self.tap_layers) if tapped == layer)
            for layer in self.tap_layers
        }
        self._hook_ids = frozenset(handle.id for handle in self._hooks)
        self.eos_token_ids = self._eos_ids()
        self.packing = PackReport(0, 0, "not requested")
        #: The attention implementation the model had before :func:`use_small_query_attention`
        #: (None: not switched).
        self.replaced_attention: str | None = None
        #: Modules switched to the native element-wise kernels
        #: (:func:`~dart_client.models.elementwise.use_native_elementwise`; 0: none).
        self.native_elementwise = 0
        if cpu_kernels:
            self.set_cpu_kernels(True)
        #: Modules switched to the Triton kernels on cuda (unless ``DART_GPU_KERNELS=torch``,
        #: :mod:`~dart_client.models.gpu_kernels`; 0: none).
        self.gpu_kernels = 0
        if self.device.type == "cuda" and gpu_kernels.available() and gpu_kernels.requested():
            self.gpu_kernels = elementwise.use_native_elementwise(self.model, gpu=True)
        if (
            self.device.type == "cuda"
            and gpu_kernels.available()
            and gpu_kernels.attention_requested(torch.cuda.get_device_capability(self.device))
        ):
            # The Triton tree attention (DART_GPU_ATTENTION=torch keeps SDPA).
            self.replaced_attention = use_small_query_attention(self.model, gpu=True)

    # -- properties -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        dtype = getattr(self.model, "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else next(self.model.parameters()).dtype

    def embedding(self) -> nn.Module:
        emb = self.model.get_input_embeddings()
        if emb is None:
            raise UnsupportedTargetError(f"{type(self.model).__name__} has no input embedding")
        return emb

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        sources: list[Any] = [
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
            getattr(self.config, "eos_token_id", None),
        ]
        if self.tokenizer is not None:
            sources.append(getattr(self.tokenizer, "eos_token_id", None))
        for src in sources:
            if src is None:
                continue
            if isinstance(src, int):
                ids.add(src)
            else:
                ids.update(int(x) for x in src)
        return frozenset(ids)

    def close(self) -> None:
        """Give the wrapped model back as it came: no tap hooks, its own kernels."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.set_cpu_kernels(False)
        if self.gpu_kernels:
            elementwise.restore(self.model)
            self.gpu_kernels = 0

    def set_cpu_kernels(self, enabled: bool) -> None:
        """Switch the model to the CPU decoding kernels (packed linear layers, small-query
        attention, native norms / rotary embedding / SiLU product on CPU models) or back to its
        own; a no-op for what is already in that state."""
        if enabled:
            if not self.packing.layers:
                self.packing = pack_linear_layers(self.model)
                if self.packing.skipped:
                    log.info("linear layers not packed: %s", self.packing.skipped)
            if self.replaced_attention is None:
                self.replaced_attention = use_small_query_attention(self.model)
            if not self.native_elementwise and self.replaced_attention is not None:
                self.native_elementwise = elementwise.use_native_elementwise(self.model)
            return
        if self.native_elementwise:
            elementwise.restore(self.model)
            self.native_elementwise = 0
        if self.packing.layers:
            unpack_linear_layers(self.model)
            self.packing = PackReport(0, 0, "switched off")
        if self.replaced_attention is not None:
            restore_attention(self.model, self.replaced_attention)
            self.replaced_attention = None

    # -- forward ------------------------------------------------------------------------------

    def _make_hook(self, slot: int) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._capture:
                self._taps[slot] = args[0] if args else kwargs["hidden_states"]

        return hook

    def new_cache(self, capacity: int, batch: int = 1) -> TargetCache:
        """A cache of ``capacity`` positions; ``batch`` > 1: a batched one (rows filled by
        :meth:`TargetCache.put_row`)."""
        stacked = len(self.layer_devices()) == 1
        return TargetCache(self.num_layers, capacity, stacked=stacked, batch=batch)

    def layer_devices(self) -> set[torch.device]:
        """The devices the decoder layers' weights are on (several under a device map)."""
        return {p.device for layer in self.layers for p in layer.parameters(recurse=True)}

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: TargetCache,
        tree_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        taps: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over ``input_ids`` (b, n) appended to ``cache``.

        ``tree_mask`` (n, n) or (b, n, n) bool says which new tokens each new token sees
        (None = causal); every new token sees the whole cache, a batched cache's row its
        own valid length of it. Returns logits of the last ``logits_to_keep`` positions
        (0 = all) and, when ``taps``, the tapped states (b, n, 3H).
        """
        n = input_ids.shape[1]
        past = cache.length
        rows = cache.rows if len(cache.rows) else None
        mask = attention_mask(n, past, tree_mask, self.dtype, input_ids.device, rows)
        sync = input_ids.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(input_ids.device)
        start = self.clock()
        logits, tapped = self.run(input_ids, position_ids, mask, cache, logits_to_keep, taps)
        if sync:
            torch.cuda.synchronize(input_ids.device)
        self.last_forward_seconds = self.clock() - start
        return logits, tapped

    @torch.no_grad()
    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: TargetCache,
        logits_to_keep: int = 0,
        taps: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward with a ready 4D float ``mask`` (:func:`attention_mask`, or
        the static path's): no host synchronisation and no timing, so a CUDA graph can
        capture it."""
        self._taps.clear()
        self._capture = taps
        try:
            with decoding_sdpa(input_ids.device):
                logits = None
                if self.native_elementwise:
                    logits = elementwise.native_forward(
                        self.model,
                        input_ids,
                        position_ids,
                        mask,
                        cache,
                        logits_to_keep,
                        self._tap_slots if taps else None,
                        self._taps,
                        self._hook_ids,
                    )
                if logits is None:
                    logits = self.model(
                        input_ids=input_ids,
                        position_ids=position_ids,
                        attention_mask=mask,
                        use_cache=True,
                        **{self._cache_keyword: cache},
                        logits_to_keep=logits_to_keep,
                    ).logits
        finally:
            self._capture = False
        tapped = None
        if taps:
            tapped = torch.cat([self._taps[0], self._taps[1], self._taps[2]], dim=-1)
            self._taps.clear()
        return logits, tapped


def attention_mask(
    n: int,
    past: int,
    tree_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    rows: RaggedRows | None = None,
) -> torch.Tensor:
    """Float mask (b, 1, n, past + n): 0 = attend, dtype-min = blocked.

    ``tree_mask`` (n, n) or (b, n, n); ``rows``: a batched cache's rows, each of which sees
    its own valid length of the ``past`` positions (b = their count; else every cached
    position is seen, and b = 1 or the tree mask's b: sequences prefilled together). A bool
    mask would be simpler but gives silently wrong logits under eager attention.
    """
    blocked = torch.finfo(dtype).min
    if rows is not None:
        b = len(rows)
    else:
        b = 1 if tree_mask is None or tree_mask.dim() == 2 else tree_mask.shape[0]
    mask = torch.zeros((b, n, past + n), dtype=dtype, device=device)
    if tree_mask is None:
        mask[:, :, past:] = torch.full((n, n), blocked, dtype=dtype, device=device).triu(1)
    else:
        allowed = tree_mask.to(device=device, dtype=torch.bool)
        mask[:, :, past:].masked_fill_(~allowed, blocked)
    if rows is not None:
        mask[:, :, :past].masked_fill_(rows.stale(past, device).unsqueeze(1), blocked)
    return mask.view(b, 1, n, past + n)
