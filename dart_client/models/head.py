"""The DART draft head: one Llama-style layer that predicts ``m + 1`` future tokens at once.

Layout (docs/design.md, "The DART head": the published ``fvliang/qwen*-dart`` checkpoints):

* ``fc`` (3H_target -> H, no bias) projects the three tapped target hidden states;
* a real position t feeds ``cat(input_layernorm(embed(x_{t+1})), hidden_norm(fc(h_t)))``
  (2H, embedding first) with residual ``fc(h_t)``; each of the ``m = draft_length`` MASK
  slots feeds the learned ``mask_rep`` (2H) with residual ``mask_rep[:H]``;
* ``midlayer``: attention whose q/k/v take 2H (GQA, the target's head_dim, RoPE, no q/k
  norm, causal over cache + real + masks), then the post-attention norm and a gated MLP on
  the last ``m + 1`` rows only;
* ``norm`` (applied twice when ``double_final_norm``, as the reference does at inference),
  ``lm_head`` to the reduced draft vocabulary; ``target_id = draft_id + d2t[draft_id]``.

The token embedding is the target's own (frozen, never stored in the checkpoint). The head's
KV cache keeps real positions only: the mask slots' keys are dropped after every forward.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from dart_client import _native
from dart_client.errors import CheckpointError, IncompatibleHeadError
from dart_client.models.attention import MAX_QUERIES, decoding_sdpa, mask_bits
from dart_client.models.elementwise import is_silu, rotary_bits
from dart_client.models.linear import (
    derived_weight,
    hooks_anywhere,
    project,
    projection_matrix,
    prompt_block,
)
from dart_client.models.native import bf16_bits, from_bits
from dart_client.models.target import RaggedRows, compact_rows, copy_row

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: The other weights file published EAGLE-3 checkpoints come as (DART heads never do).
BIN_WEIGHTS_NAME = "pytorch_model.bin"

#: Keys the published checkpoints carry (``embed_tokens.weight`` may also appear: ignored,
#: the target's embedding is used).
CHECKPOINT_KEYS = (
    "fc.weight",
    "midlayer.mask_rep",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
IGNORED_KEYS = ("embed_tokens.weight",)


@dataclass
class DartHeadConfig:
    """The head's ``config.json`` (field names as the published checkpoints use them)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    draft_length: int = 7
    head_dim: int | None = None
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    double_final_norm: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        checks = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "draft_length": self.draft_length,
            "head_dim": self.head_dim,
        }
        for name, value in checks.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"head config: {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"head config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise CheckpointError(
                f"head config: draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size "
                f"({self.vocab_size})"
            )
        if self.hidden_act not in ACT2FN:
            raise CheckpointError(f"head config: unknown hidden_act {self.hidden_act!r}")

    @property
    def num_rows(self) -> int:
        """Rows of draft logits per forward: the last real position plus the mask slots."""
        return self.draft_length + 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> DartHeadConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        # transformers >= 5 writes rope settings as `rope_parameters`.
        rope = extra.get("rope_parameters")
        if isinstance(rope, Mapping):
            known.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
            if rope.get("rope_type", "default") != "default":
                known.setdefault(
                    "rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"}
                )
        missing = [
            n
            for n in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
            if n not in known
        ]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {missing}")
        known.setdefault("num_key_value_heads", known["num_attention_heads"])
        if "draft_vocab_size" not in known:
            known["draft_vocab_size"] = known["vocab_size"]
        try:
            return cls(**known, extra=extra)
        except CheckpointError as err:
            raise CheckpointError(f"{source}: {err}") from None
        except TypeError as err:
            raise CheckpointError(f"{source}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        out.update({k: v for k, v in self.extra.items() if k not in out})
        out.setdefault("architectures", ["LlamaForCausalLMDart"])
        out.setdefault("model_type", "llama")
        return out

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        draft_length: int = 7,
        draft_vocab_size: int | None = None,
        double_final_norm: bool = True,
    ) -> DartHeadConfig:
        """A head config shaped for ``target_config`` (a transformers decoder config)."""
        tc = (
            target_config.get_text_config()
            if hasattr(target_config, "get_text_config")
            else target_config
        )
        heads = tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope else None
        if scaling is not None and scaling.get("rope_type", "default") == "default":
            scaling = None
        return cls(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size or tc.vocab_size,
            draft_length=draft_length,
            target_hidden_size=tc.hidden_size,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            hidden_act=getattr(tc, "hidden_act", "silu"),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 40960),
            rope_theta=float(theta),
            rope_scaling=scaling,
            double_final_norm=double_final_norm,
        )

    def rope_config(self) -> LlamaConfig:
        """A LlamaConfig carrying only what transformers' rotary embedding reads."""
        kwargs: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
        }
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            params.update(self.rope_scaling)
            params.setdefault("rope_type", params.pop("type", "default"))
        kwargs["rope_parameters"] = params
        return LlamaConfig(**kwargs)


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension of ``x``: normalise in float32 (for half
    inputs), cast back, scale by ``weight`` (broadcast against ``x``)."""
    dtype = x.dtype
    h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    h = F.rms_norm(h, (h.shape[-1],), eps=eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HeadAttention(nn.Module):
    QKV = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: DartHeadConfig) -> None:
        super().__init__()
        h2 = 2 * config.hidden_size
        hd = config.head_dim
        assert hd is not None
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(h2, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h2, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h2, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: HeadCache | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention over ``cache`` + the n rows of ``x`` (b, n, 2H); ``cos_sin`` (b, n, d).

        ``mask`` is float (0 = attend): (b, 1, n, keys), or (b, 1, groups * n, keys) with
        the n rows repeated once per query head sharing a K/V head (:func:`causal_mask` with
        ``groups``); then those query heads are computed as extra query rows of their K/V
        head, which reads the cache as is (decoding: few queries, a long cache). ``None``
        is causal attention over the n rows, for a cache holding nothing before them.
        """
        b, n, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # One matmul for q, k and v; RoPE once over the q and k heads together.
        qkv = project(self, self.QKV, x).view(b, n, nh + 2 * nkv, hd)
        cos, sin = (t.unsqueeze(2) for t in cos_sin)
        qk = qkv[:, :, : nh + nkv]
        qk = qk * cos + rotate_half(qk) * sin
        q = qk[:, :, :nh].transpose(1, 2)
        k = qk[:, :, nh:].transpose(1, 2)
        v = qkv[:, :, nh + nkv :].transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)
        groups = nh // nkv
        with decoding_sdpa(x.device):
            if mask is None:
                if k.shape[2] != n:
                    raise RuntimeError(f"causal attention over {n} rows, but {k.shape[2]} keys")
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
            elif groups == 1:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            elif mask.shape[-2] == groups * n:
                qg = q.reshape(b, nkv, groups * n, hd)
                # reshape, not view: some backends (CUDA's efficient / flash kernels) return
                # the output in (b, n, heads, d) memory order, which a view cannot regroup.
                out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
                out = out.reshape(b, nh, n, hd)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, n, nh * hd)
        return project(self, ("o_proj",), out)


class HeadMLP(nn.Module):
    GATE_UP = ("gate_proj", "up_proj")

    def __init__(self, config: DartHeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, self.GATE_UP, x).chunk(2, dim=-1)
        return project(self, ("down_proj",), self.act(gate) * up)


class HeadLayer(nn.Module):
    """``midlayer``: the one decoder layer, with the MASK representation it appends."""

    INPUT_NORMS = ("input_layernorm", "hidden_norm")

    def __init__(self, config: DartHeadConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.draft_length = config.draft_length
        self.mask_rep = nn.Parameter(torch.randn(2 * config.hidden_size))
        self.self_attn = HeadAttention(config)
        self.mlp = HeadMLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        projected: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: HeadCache | None,
        mask: torch.Tensor | None,
        num_masks: int,
    ) -> torch.Tensor:
        b, r, hs = projected.shape
        # cat(input_layernorm(embeds), hidden_norm(projected)) as one norm over both halves.
        weight = derived_weight(self, "stack", self.INPUT_NORMS, _stack)
        x = torch.cat((embeds, projected), dim=-1).view(b, r, 2, hs)
        x = rms_norm(x, weight, self.input_layernorm.eps).view(b, r, 2 * hs)
        residual = projected
        if num_masks:
            mask_in = self.mask_rep.to(x.dtype).view(1, 1, -1).expand(b, num_masks, -1)
            x = torch.cat((x, mask_in), dim=1)
            mask_res = mask_in[..., : self.hidden_size]
            residual = torch.cat((residual, mask_res), dim=1)
        native = _native_head_layer(self, x, residual, cos_sin, cache, mask)
        if native is not None:
            return native[:, -(num_masks + 1) :]
        h = residual + self.self_attn(x, cos_sin, cache, mask)
        # Only the last real position and the mask slots produce draft rows.
        h = h[:, -(num_masks + 1) :]
        return h + self.mlp(self.post_attention_layernorm(h))


def _native_head_layer(
    layer: HeadLayer,
    normed: torch.Tensor,
    residual: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    cache: HeadCache | None,
    mask: torch.Tensor | None,
) -> torch.Tensor | None:
    """The layer after its input norm as one native call (``_native.decoder_layer`` with
    ``normed``: q/k/v over the 2H-wide input, the attention's output added to ``residual``,
    then the MLP, every row), where it runs on DART's CPU kernels: bf16 on the CPU, no
    gradient, a decoding step's rows, packed weights, a SiLU MLP, a preallocated cache with
    room (written in place, its length moved as :meth:`HeadCache.append` would). The draft's
    bits differ from PyTorch's attention in the last places (each query on its own, in f32),
    not the outputs, which verification decides. None: the caller runs the modules."""
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    batch, tokens = normed.shape[:2]
    if (
        cache is None
        or tokens > MAX_QUERIES
        or normed.dtype != torch.bfloat16
        or normed.device.type != "cpu"
        or torch.is_grad_enabled()
        or not is_silu(mlp.act)
        or prompt_block(normed)
        or hooks_anywhere()
        # Modules the PyTorch path calls as modules: their hooks must see the call.
        or any(m._forward_hooks or m._forward_pre_hooks for m in (attn, mlp, norm))
    ):
        return None
    packed = [
        matrix
        for matrix in (
            projection_matrix(attn, HeadAttention.QKV, normed),
            projection_matrix(attn, ("o_proj",), residual),
            projection_matrix(mlp, HeadMLP.GATE_UP, residual),
            projection_matrix(mlp, ("down_proj",), residual),
        )
        if matrix is not None
    ]
    buffers = None if len(packed) != 4 else cache.writable_bits(batch, tokens)
    if buffers is None:
        return None
    keys, values, start = buffers
    if mask is not None and mask.shape[-2] != tokens:
        # DartHead.forward's causal mask, its rows repeated per query head of a group (the
        # grouped-query trick of the PyTorch path): the kernel's own causal order.
        mask = None
    out = _native.decoder_layer(
        bf16_bits(residual.contiguous()),
        None,  # the input is normed: no input norm
        bf16_bits(norm.weight),
        float(norm.eps),
        *packed,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim**-0.5,
        *rotary_bits(*cos_sin, batch),
        keys,
        values,
        start,
        None if mask is None else mask_bits(mask, start + tokens),
        torch.get_num_threads(),
        bf16_bits(normed.contiguous()),
    )
    return from_bits(out)


def _stack(weights: list[torch.Tensor], live: bool) -> torch.Tensor:
    return torch.stack(weights)


class HeadCache:
    """The head's KV cache: preallocated, holding real positions only.

    ``append`` writes new keys/values in place and returns views over everything cached so
    far; ``truncate`` drops the tail (the mask slots after a forward). A batched cache
    (``batch`` > 1) keeps one sequence per row as the target's does
    (:class:`~dart_client.models.target.TargetCache`): rows of their own lengths
    (:attr:`rows`), appends at the longest one's, :meth:`keep_rows` after each forward.
    """

    def __init__(self, capacity: int, batch: int = 1) -> None:
        self.capacity = capacity
        self.batch = batch
        self.length = 0
        self.rows = RaggedRows()
        #: Live rows of a batched cache (its first ones); None: every batch entry.
        self._live: int | None = None
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        #: Static mode (``dart_client.decoding.static``): the positions ``(rows, n)``, a
        #: device tensor, that the next keys of each row are written to; attention then
        #: reads the buffer's first ``window`` positions (None: all of it).
        self.slots: torch.Tensor | None = None
        self.window: int | None = None

    def buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The K and V buffers (full capacity; none before the first append) with their
        batch axis, as :meth:`TargetCache.buffers` gives them."""
        return [(b, 0) for b in (self._k, self._v) if b is not None]

    def writable_bits(self, batch: int, tokens: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """For a kernel that appends ``tokens`` positions of ``batch`` live rows itself (the
        native head layer): the K and V buffers as uint16 arrays of bf16 bits (written in
        place) and the first position to write; the length moves to after them. None where
        :meth:`append` must run (static mode, buffers not allocated yet or not bf16, another
        row count, no room: ``append`` raises the overflow)."""
        if self.slots is not None or self._k is None or self._v is None:
            return None
        k, v = self._k[: self._live], self._v[: self._live]
        end = self.length + tokens
        if k.shape[0] != batch or k.dtype != torch.bfloat16 or end > self.capacity:
            return None
        start, self.length = self.length, end
        return bf16_bits(k), bf16_bits(v), start

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        if self._k is None or self._v is None:
            self._allocate(k, v, k.shape[0])
        assert self._k is not None and self._v is not None
        if self.slots is not None:
            # Static mode: no host-side length (the caller sets it once it is known). The
            # program runs the cache's first rows, each writing its own slots (rows, n).
            keys, values = self._k[: k.shape[0]], self._v[: k.shape[0]]
            index = self.slots[:, None, :, None]
            keys.scatter_(2, index.expand(k.shape), k)
            values.scatter_(2, index.expand(v.shape), v)
            return keys[:, :, : self.window], values[:, :, : self.window]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(
                f"draft head cache overflow: {end} positions for a capacity of {self.capacity}"
            )
        live = self._live
        self._k[:live, :, self.length : end] = k
        self._v[:live, :, self.length : end] = v
        self.length = end
        return self._k[:live, :, :end], self._v[:live, :, :end]

    def _allocate(self, k: torch.Tensor, v: torch.Tensor, batch: int) -> None:
        # Zeroed: a batched row's stale tail and the static draft's unused positions are
        # masked, and a masked zero adds nothing (a masked NaN would).
        self._k = k.new_zeros((batch, k.shape[1], self.capacity, k.shape[3]))
        self._v = v.new_zeros((batch, v.shape[1], self.capacity, v.shape[3]))

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise RuntimeError(f"cannot truncate a head cache of {self.length} to {length}")
        self.length = length

    def _set_rows(self) -> None:
        self._live = len(self.rows)
        self.length = self.rows.frontier

    def grow_rows(self, counts: Sequence[int]) -> None:
        """After a static batched draft wrote every live row's new real positions at its own
        length: row b is ``counts[b]`` longer."""
        self.rows.grow(counts)
        self._set_rows()

    def put_row(
        self,
        row: int,
        source: HeadCache,
        *,
        source_row: int = 0,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Copy ``source`` (one sequence) into ``row``: a live row or the next free one;
        ``source_row`` and ``span`` (start, length) as :meth:`TargetCache.put_row` takes them."""
        if not 0 <= row <= len(self.rows) or row >= self.batch:
            raise ValueError(f"row {row} of a head cache of {len(self.rows)} live rows")
        start, n = (0, source.length) if span is None else span
        if source._k is not None and source._v is not None:
            if self._k is None:
                self._allocate(source._k, source._v, self.batch)
            assert self._k is not None and self._v is not None
            self._k[row, :, :n] = source._k[source_row, :, start : start + n]
            self._v[row, :, :n] = source._v[source_row, :, start : start + n]
        self.rows.put(row, n)
        self._set_rows()

    def drop_row(self, row: int) -> None:
        """Free ``row``: the last live row moves into it."""
        last = self.rows.drop(row)
        if last is not None and self._k is not None and self._v is not None:
            for buffer in (self._k, self._v):
                copy_row(buffer, 0, row, last, self.rows.lengths[row])
        self._set_rows()

    def keep_rows(self, start: int, keeps: Sequence[Sequence[int]], device: torch.device) -> None:
        """After a forward appended at ``start``: keep row b's positions ``keeps[b]``
        (relative to ``start``) at its own length, drop the rest."""
        plan = self.rows.compaction(start, keeps, device)
        if plan is not None and self._k is not None and self._v is not None:
            for buffer in (self._k, self._v):
                compact_rows(buffer, 0, plan)
        self._set_rows()


class DartHead(nn.Module):
    """The DART draft head. Parameter names match the published checkpoint layout."""

    #: The keys of the published layout (a subclass with another layout names its own).
    checkpoint_keys: tuple[str, ...] = CHECKPOINT_KEYS
    #: Weight files ``from_pretrained`` reads, the first one present.
    weight_files: tuple[str, ...] = (WEIGHTS_NAME,)
    #: What this class is called in error messages, and the other kind of draft model (a
    #: checkpoint of which lacks or has :data:`MASK_KEY`: :func:`is_eagle3_checkpoint`).
    kind = "DART head"
    other_kind = "an EAGLE-3 draft model"

    def __init__(self, config: DartHeadConfig) -> None:
        super().__init__()
        self.config = config
        assert config.target_hidden_size is not None
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = self._make_layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config=config.rope_config())
        self._embed: nn.Module | None = None
        self._draft_to_target: tuple[Any, torch.Tensor, np.ndarray] | None = None

    def _make_layer(self, config: DartHeadConfig) -> nn.Module:
        return HeadLayer(config)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def random_init(
        cls,
        target_config: Any,
        *,
        draft_length: int = 7,
        draft_vocab_size: int | None = None,
        draft_vocab: torch.Tensor | None = None,
        double_final_norm: bool = True,
        seed: int | None = 0,
        std: float = 0.02,
    ) -> DartHead:
        """A freshly initialised head for ``target_config``.

        ``draft_vocab`` (sorted target ids) selects the reduced draft vocabulary; without it
        the first ``draft_vocab_size`` target ids are used (all of them by default).
        """
        if draft_vocab is not None:
            draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.int64).flatten()
            draft_vocab_size = int(draft_vocab.numel())
        config = DartHeadConfig.for_target(
            target_config,
            draft_length=draft_length,
            draft_vocab_size=draft_vocab_size,
            double_final_norm=double_final_norm,
        )
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        head = cls(config)
        with torch.no_grad():
            for name, param in head.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
            if draft_vocab is None:
                draft_vocab = torch.arange(config.draft_vocab_size, dtype=torch.int64)
            head.set_draft_vocab(draft_vocab)
        return head

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Define the draft vocabulary as ``target_ids`` (distinct ids, in draft-id order)."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64).flatten()
        cfg = self.config
        if ids.numel() != cfg.draft_vocab_size:
            raise CheckpointError(
                f"draft vocabulary has {ids.numel()} ids, config says {cfg.draft_vocab_size}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            raise CheckpointError(f"draft vocabulary ids must lie in [0, {cfg.vocab_size})")
        if torch.unique(ids).numel() != ids.numel():
            raise CheckpointError("draft vocabulary ids must be distinct")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel(), dtype=torch.int64))
            self.t2d.zero_()
            self.t2d[ids] = True
        self._draft_to_target = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        double_final_norm: bool | None = None,
        **hub_kwargs: Any,
    ) -> DartHead:
        """Load ``config.json`` + ``model.safetensors`` from a directory (or a hub repo id).

        Keys are checked strictly against the published layout; every mismatch is reported.
        """
        directory = _resolve_head_dir(path, (CONFIG_NAME, *cls.weight_files), **hub_kwargs)
        config_path = directory / CONFIG_NAME
        weights_path = directory / WEIGHTS_NAME
        try:
            raw = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{config_path}: head config not found") from None
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object")
        config = DartHeadConfig.from_dict(raw, source=str(config_path))
        if double_final_norm is not None:
            config.double_final_norm = double_final_norm
        weights_path = next(
            (directory / name for name in cls.weight_files if (directory / name).is_file()),
            weights_path,
        )
        if not weights_path.is_file():
            raise CheckpointError(f"{weights_path}: head weights not found")
        state = read_weights(weights_path)
        head = cls(config)
        head.load_checkpoint_state(state, source=str(weights_path))
        return head

    def load_checkpoint_state(self, state: Mapping[str, torch.Tensor], source: str) -> None:
        """Strictly load a published-layout state dict, naming every problem found."""
        expected = self.state_dict()
        problems: list[str] = []
        keys = self.checkpoint_keys
        missing = [k for k in keys if k not in state]
        unexpected = sorted(k for k in state if k not in expected and k not in IGNORED_KEYS)
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
        for key in keys:
            if key in state and tuple(state[key].shape) != tuple(expected[key].shape):
                problems.append(
                    f"{key}: shape {tuple(state[key].shape)}, expected "
                    f"{tuple(expected[key].shape)} from the config"
                )
        if problems:
            # The one key that tells the two kinds apart (published DART heads, too, name
            # EAGLE-3's architecture in their config).
            if [MASK_KEY] in (missing, unexpected):
                problems.append(
                    f"this looks like {self.other_kind}, not a {self.kind}: `dart generate`/"
                    "`serve` --head and DartModel.from_pretrained load either kind"
                )
            raise CheckpointError(f"{source}: " + "; ".join(problems))
        own = {k: state[k] for k in keys}
        d2t = own["d2t"]
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise CheckpointError(f"{source}: d2t must be an integer tensor, got {d2t.dtype}")
        targets = d2t.to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64)
        if targets.numel() and (
            int(targets.min()) < 0 or int(targets.max()) >= self.config.vocab_size
        ):
            raise CheckpointError(
                f"{source}: d2t maps draft ids outside the target vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        if torch.unique(targets).numel() != targets.numel():
            raise CheckpointError(f"{source}: d2t maps two draft ids to the same target id")
        own["d2t"] = d2t.to(torch.int64)
        own["t2d"] = own["t2d"].to(torch.bool)
        self.load_state_dict(own, strict=True)
        self._draft_to_target = None

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the published layout."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        config = self.config.to_dict()
        config["torch_dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        tmp = out / (WEIGHTS_NAME + ".tmp")
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / WEIGHTS_NAME)
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # -- binding to a target ----------------------------------------------------------------

    def check_compatible(self, target_config: Any) -> None:
        """Raise :class:`IncompatibleHeadError` naming every field that does not fit the target."""
        tc = (
            target_config.get_text_config()
            if hasattr(target_config, "get_text_config")
            else target_config
        )
        cfg = self.config
        heads = tc.num_attention_heads
        t_head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        pairs = [
            ("hidden_size", cfg.hidden_size, tc.hidden_size),
            ("target_hidden_size", cfg.target_hidden_size, tc.hidden_size),
            ("head_dim", cfg.head_dim, t_head_dim),
            ("vocab_size", cfg.vocab_size, tc.vocab_size),
        ]
        diffs = [
            f"{name}: head {mine}, target {theirs}"
            for name, mine, theirs in pairs
            if mine != theirs
        ]
        if diffs:
            raise IncompatibleHeadError(
                "the DART head does not fit the target model: " + "; ".join(diffs)
            )

    def bind_embedding(self, embedding: nn.Module) -> None:
        """Use the target's (frozen) token embedding; it is not a parameter of the head."""
        # Stored outside the module tree so state_dict() never contains it.
        object.__setattr__(self, "_embed", embedding)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of every draft id (``draft_id + d2t[draft_id]``), cached."""
        return self._draft_map()[0]

    @property
    def draft_to_target_numpy(self) -> np.ndarray:
        """:attr:`draft_to_target` as a uint32 numpy array on the CPU (cached), the form the
        native top-k reads."""
        return self._draft_map()[1]

    def _draft_map(self) -> tuple[torch.Tensor, np.ndarray]:
        d2t = self.d2t
        key = (d2t.data_ptr(), d2t._version, d2t.device)
        cached = self._draft_to_target
        if cached is None or cached[0] != key:
            ids = d2t + torch.arange(d2t.numel(), device=d2t.device, dtype=torch.int64)
            cached = (key, ids, ids.cpu().numpy().astype(np.uint32))
            self._draft_to_target = cached
        return cached[1], cached[2]

    def new_cache(self, capacity: int, batch: int = 1) -> HeadCache:
        return HeadCache(capacity, batch)

    def rope(self, start: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin (1, n, head_dim) of positions ``start .. start + n - 1``, in
        ``like``'s dtype: rows of a table the rotary embedding computes once (and regrows by
        doubling), so a draft step slices instead of recomputing. RoPE types whose
        frequencies depend on the sequence length (dynamic, longrope) are computed per call.
        """
        rotary = self.rotary
        end = start + n
        if "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
            return rotary(like, torch.arange(start, end, device=like.device).unsqueeze(0))
        table = self.__dict__.get("_rope_table")
        if (
            table is None
            or table[0].shape[1] < end
            or table[0].dtype != like.dtype
            or table[0].device != like.device
        ):
            size = max(256, 1 << (end - 1).bit_length())
            table = rotary(like, torch.arange(size, device=like.device).unsqueeze(0))
            self.__dict__["_rope_table"] = table
        return table[0][:, start:end], table[1][:, start:end]

    def rope_at(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin (b, n, head_dim) of explicit ``positions`` (b, n): one row per
        sequence of a batch."""
        if "dynamic" in self.rotary.rope_type or self.rotary.rope_type == "longrope":
            return self.rotary(like, positions)
        cos, sin = self.rope(0, int(positions.max()) + 1, like)
        return cos[0][positions], sin[0][positions]

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        taps: torch.Tensor,
        next_ids: torch.Tensor,
        cache: HeadCache | None = None,
        num_masks: int | None = None,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft logits ``(batch, num_masks + 1, draft_vocab)``.

        ``taps`` (batch, r, 3H): the target's tapped hidden states at r new real positions;
        ``next_ids`` (batch, r): the token that follows each of them (the last one is the token
        just sampled). Positions continue the cache; afterwards the cache holds the r real
        positions and none of the mask slots.

        A batch of sequences of their own lengths (a batched cache) passes ``positions``
        (batch, r + m) and the float ``mask`` (batch, 1, r + m, cache + r + m) of every row
        (:func:`dart_client.decoding.draft.draft_rows_batch`); the cache then keeps all
        r + m new entries, for the caller's :meth:`HeadCache.keep_rows`.
        """
        if self._embed is None:
            raise RuntimeError("bind_embedding(target embedding) before running the head")
        m = self.config.draft_length if num_masks is None else num_masks
        r = taps.shape[1]
        past = cache.length if cache is not None else 0
        projected = self.project_taps(taps)
        n = r + m
        if positions is not None:
            cos_sin = self.rope_at(positions, projected)
        else:
            cos_sin = self.rope(past, n, projected)
        if mask is not None:
            mask = mask.to(projected.dtype)
        elif past:
            # A draft step (few new rows over a long cache): query heads of a K/V group as
            # extra rows; a long block (rare) keeps one mask row per position.
            cfg = self.config
            groups = cfg.num_attention_heads // cfg.num_key_value_heads if n <= 64 else 1
            mask = causal_mask(n, past, projected.dtype, taps.device, groups)
        logits = self.draft_logits(projected, next_ids, cache, cos_sin, mask, m)
        if cache is not None and positions is None:
            cache.truncate(past + r)
        return logits

    def project_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """``fc``: the tapped target states (b, r, 3H) projected to the head's width."""
        return project(self, ("fc",), taps)

    def draft_logits(
        self,
        projected: torch.Tensor,
        next_ids: torch.Tensor,
        cache: HeadCache | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        num_masks: int,
    ) -> torch.Tensor:
        """The layer and the output over given RoPE rows and mask (what :meth:`forward`
        computes from the cache's length; the static path gives its own, fixed-shape ones):
        logits of the last real row and the ``num_masks`` mask slots. ``projected``:
        :meth:`project_taps`."""
        if self._embed is None:
            raise RuntimeError("bind_embedding(target embedding) before running the head")
        embeds = self._embed(next_ids).to(projected.dtype)
        h = self.midlayer(embeds, projected, cos_sin, cache, mask, num_masks)
        h = self.norm(h)
        if self.config.double_final_norm:
            h = self.norm(h)
        return project(self, ("lm_head",), h)


def causal_mask(
    n: int, past: int, dtype: torch.dtype, device: torch.device, groups: int = 1
) -> torch.Tensor:
    """Float mask (1, 1, groups * n, past + n): query i sees every cached key and new keys
    0..i; with ``groups`` > 1 the n rows repeat once per query head of a K/V group."""
    mask = torch.zeros((groups * n, past + n), dtype=dtype, device=device)
    mask[:, past:] = _causal_block(n, groups, dtype, device)
    return mask.view(1, 1, groups * n, past + n)


@functools.lru_cache(maxsize=64)
def _causal_block(n: int, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (groups * n, n) block of :func:`causal_mask` over the new keys (read-only)."""
    block = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return block.repeat(groups, 1)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors from ``.safetensors`` or a ``torch.save``d ``.bin`` (read with
    ``weights_only``: no code runs); a file that is neither names the problem."""
    if path.suffix == ".bin":
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for a corrupt pickle
            raise CheckpointError(f"{path}: cannot read a torch checkpoint ({err})") from None
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise CheckpointError(f"{path}: expected a dict of named tensors")
        return state
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: cannot read safetensors ({err})") from None


#: The DART head's MASK embedding: the key only DART checkpoints hold.
MASK_KEY = "midlayer.mask_rep"


def is_eagle3_checkpoint(path: str | Path, **hub_kwargs: Any) -> bool:
    """Whether the draft checkpoint at ``path`` (a directory or hub id) is an EAGLE-3 draft
    model rather than a DART head. Both name EAGLE-3's architecture in their ``config.json``
    (DART's code grew from EAGLE-3's), so the weights decide: a DART head has the MASK
    embedding (:data:`MASK_KEY`, read from the safetensors header alone); a checkpoint with
    only ``pytorch_model.bin`` is EAGLE-3's (DART heads are published as safetensors)."""
    files = (CONFIG_NAME, WEIGHTS_NAME, BIN_WEIGHTS_NAME)
    directory = _resolve_head_dir(path, files, **hub_kwargs)
    weights = directory / WEIGHTS_NAME
    if weights.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(weights), framework="pt") as f:
                return MASK_KEY not in set(f.keys())
        except Exception:  # a corrupt file: loading it as a DART head names the problem
            return False
    return (directory / BIN_WEIGHTS_NAME).is_file()


def _resolve_head_dir(path: str | Path, files: tuple[str, ...], **hub_kwargs: Any) -> Path:
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists():
        raise CheckpointError(f"{local}: expected a directory with {CONFIG_NAME} + {WEIGHTS_NAME}")
    text = str(path)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{path}: no such head directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=list(files), **hub_kwargs))
    except Exception as err:  # hub errors vary by version; report what happened
        raise CheckpointError(
            f"{path}: not a local directory, and downloading it from the hub failed ({err})"
        ) from None
