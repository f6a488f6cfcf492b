"""A decoder layer's element-wise parts on the CPU in bf16: RMS norm, rotary embedding and
the SiLU-gated product, each one native call (``dart_kernels::{rms_norm, rotary, silu_mul}``).

transformers spends 5-14 tensor operations on each (every one dispatched from Python and
allocating its result): about 45 us per RMS norm and 45-65 us per rotary embedding on a
decoding step's rows, 61 norms and 30 embeddings per SmolLM2 forward. One native pass costs a
few microseconds. Every kernel works row by row, in the same order whatever the number of
rows, so a tree node's values stay one-token decoding's bit for bit. ``rotary`` and
``silu_mul`` round where PyTorch's bf16 operations round; ``rms_norm`` sums its squares in
its own fixed order (PyTorch's depends on the CPU), so its result may differ from PyTorch's in
the last bit, for DART and for autoregressive decoding alike.

Only code that is Llama's own is replaced: a norm, MLP or ``apply_rotary_pos_emb`` whose
source is ``LlamaRMSNorm.forward``'s, ``LlamaMLP.forward``'s (with a SiLU) or Llama's
``apply_rotary_pos_emb`` (Qwen2/3, Mistral and most Llama-like models copy them). Anything
else, other dtypes and devices, and inputs that need a gradient keep transformers' code.

A decoder layer whose code and attention's code are Llama's also gets a lean forward
(:func:`_lean_layer_forward`): the same operations in the same order (the same bits), called
directly instead of through 12 ``nn.Module`` calls and transformers' keyword plumbing per
layer, 7-10% of a SmolLM2 forward on the CPU. It runs only where the plain one would call
exactly these kernels (DART's small-query attention, CPU bf16, no gradient, not training,
no hooks on the layer's parts); otherwise the layer's own forward runs.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from dart_client import _native
from dart_client.models import gpu_kernels
from dart_client.models.attention import MAX_QUERIES, mask_bits, small_query_attention
from dart_client.models.attention import NAME as SMALL_QUERY_ATTENTION
from dart_client.models.linear import (
    cpu_matmul,
    decoding_matrix,
    fused_projection,
    hooks_anywhere,
    prompt_block,
)
from dart_client.models.native import bf16_bits, from_bits

#: Set on a module whose forward this module replaced: its own forward, for :func:`restore`.
_PLAIN = "_dart_plain_forward"
#: Set on a module switched for cuda (:func:`use_native_elementwise` with ``gpu``): its
#: cuda inputs take :mod:`dart_client.models.gpu_kernels`.
_GPU = "_dart_gpu_kernels"


@functools.cache
def _llama_sources() -> dict[str, str]:
    from transformers.models.llama import modeling_llama

    return {
        "norm": inspect.getsource(modeling_llama.LlamaRMSNorm.forward),
        "mlp": inspect.getsource(modeling_llama.LlamaMLP.forward),
        "rotary": inspect.getsource(modeling_llama.apply_rotary_pos_emb),
        "layer": inspect.getsource(modeling_llama.LlamaDecoderLayer.forward),
        "attention": inspect.getsource(modeling_llama.LlamaAttention.forward),
        "model": inspect.getsource(modeling_llama.LlamaModel.forward),
        "causal_lm": inspect.getsource(modeling_llama.LlamaForCausalLM.forward),
    }


@functools.lru_cache(maxsize=256)
def _same_source(obj: Any, kind: str) -> bool:
    """Whether ``obj``'s source is Llama's ``kind`` (cached: a model has one class per kind,
    and reading sources costs about a millisecond each)."""
    try:
        return inspect.getsource(obj) == _llama_sources()[kind]
    except (OSError, TypeError):
        return False


def _native_bf16(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these: bf16 CPU tensors, no gradient wanted."""
    grad = torch.is_grad_enabled()
    return all(
        t.dtype == torch.bfloat16 and t.device.type == "cpu" and not (grad and t.requires_grad)
        for t in tensors
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm`` in bf16 (``x`` of any shape ending in ``weight``'s length)."""
    return from_bits(_native.rms_norm(bf16_bits(x.contiguous()), bf16_bits(weight), eps))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in bf16, rounded as PyTorch's two operations round."""
    return from_bits(_native.silu_mul(bf16_bits(gate.contiguous()), bf16_bits(up.contiguous())))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding of ``x`` ``(b, heads, n, d)`` with ``cos``/``sin``
    ``(b | 1, n, d)``, in bf16 with transformers' rounding; the result as transformers lays
    it out (a (b, heads, n, d) view of (b, n, heads, d) memory)."""
    cos, sin = _rotary_tables(cos, sin, x.shape[0])
    return rotary_tokens_first(x.transpose(1, 2), cos, sin).transpose(1, 2)


def _rotary_tables(
    cos: torch.Tensor, sin: torch.Tensor, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``(b | 1, n, d)`` as the kernel reads them: ``(batch, n, d)``, contiguous."""
    if cos.shape[0] != batch:
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    return cos.contiguous(), sin.contiguous()


def rotary_bits(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_rotary_tables` as bf16 bits. Every layer of a forward gets the same tables:
    the last conversion is kept, keyed by the tensors themselves and their versions."""
    global _last_rotary
    key = (cos, sin, cos._version, sin._version, batch)
    last = _last_rotary
    if last is not None and last[0][0] is cos and last[0][1] is sin and last[0][2:] == key[2:]:
        return last[1]
    tables = _rotary_tables(cos, sin, batch)
    bits = (bf16_bits(tables[0]), bf16_bits(tables[1]))
    _last_rotary = (key, bits)
    return bits


#: :func:`rotary_bits`' last conversion: ((cos, sin, versions, batch), bits).
_last_rotary: tuple[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] | None = None


def rotary_tokens_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotary` of ``x`` laid out ``(b, n, heads, d)`` (a projection's output), with
    tables from :func:`_rotary_tables`; the result ``(b, n, heads, d)``, contiguous."""
    return from_bits(_native.rotary(bf16_bits(x.contiguous()), bf16_bits(cos), bf16_bits(sin)))


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if _native_bf16(x, weight):
        return rms_norm(x, weight, float(self.variance_epsilon))
    if _GPU in self.__dict__ and gpu_kernels.applies(x, weight):
        return gpu_kernels.rms_norm(x, weight, float(self.variance_epsilon))
    return self.__dict__[_PLAIN](x)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate_up = fused_projection(self, _GATE_UP, x)
    if gate_up is not None:
        gate, up = gate_up.chunk(2, -1)
        return self.down_proj(silu_mul(gate, up))
    gate, up = self.gate_proj(x), self.up_proj(x)
    if _native_bf16(gate, up):
        return self.down_proj(silu_mul(gate, up))
    if _GPU in self.__dict__ and gpu_kernels.applies(gate, up):
        return self.down_proj(gpu_kernels.silu_mul(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def _lean_layer_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` with ``LlamaAttention.forward`` inlined, for CPU bf16
    inference on DART's kernels: the same operations in the same order."""
    attn, mlp = self.self_attn, self.mlp
    norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
    if (
        "past_key_values" in kwargs  # the old name of `cache`: transformers' code maps it
        or cache is None
        or position_embeddings is None
        or attn.training
        or attn.config._attn_implementation != SMALL_QUERY_ATTENTION
        or not _native_bf16(hidden_states, norm_in.weight, norm_post.weight)
        or any(self.__dict__[_PART_HOOKS])
        or hooks_anywhere()
    ):
        return self.__dict__[_PLAIN](
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    whole = _native_layer(self, hidden_states, attention_mask, cache, position_embeddings, kwargs)
    if whole is not None:
        return whole
    h = rms_norm(hidden_states, norm_in.weight, float(norm_in.variance_epsilon))
    batch, tokens = h.shape[:2]
    tokens_first = (batch, tokens, -1, attn.head_dim)
    projections = attn._modules
    qkv = fused_projection(attn, _QKV, h)
    if qkv is None:
        query, key, value = (projections[name].forward(h) for name in _QKV)
    else:
        query, key, value = qkv.split([projections[name].out_features for name in _QKV], -1)
    cos, sin = _rotary_tables(*position_embeddings, batch)
    query = rotary_tokens_first(query.view(tokens_first), cos, sin).transpose(1, 2)
    key = rotary_tokens_first(key.view(tokens_first), cos, sin).transpose(1, 2)
    value = value.view(tokens_first).transpose(1, 2)
    key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
    out, _ = small_query_attention(
        attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs
    )
    hidden_states = hidden_states + projections["o_proj"].forward(out.reshape(batch, tokens, -1))
    h = rms_norm(hidden_states, norm_post.weight, float(norm_post.variance_epsilon))
    projections = mlp._modules
    gate_up = fused_projection(mlp, _GATE_UP, h)
    if gate_up is None:
        gate, up = (projections[name].forward(h) for name in _GATE_UP)
    else:
        gate, up = gate_up.chunk(2, -1)
    return hidden_states + projections["down_proj"].forward(silu_mul(gate, up))


def _native_layer(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The lean layer's operations in one native call (``_native.decoder_layer``: the same
    kernels in the same order, so the same bits) where every part runs DART's kernels: its
    four matmuls packed for decoding (a decoding step's rows, no biases), a cache that takes
    the new keys in place (``PreallocatedLayer.writable_bits``), attention that would run DART's
    kernel (no soft-capping, sliding window or position bias). None: the caller runs them
    one by one."""
    if (
        hidden_states.dim() != 3
        or any(kwargs.get(name) is not None for name in _UNSUPPORTED)
        or prompt_block(hidden_states)
    ):
        return None
    plan = _layer_plan(layer, hidden_states)
    if plan is None:
        return None
    return _run_plan(plan, hidden_states, attention_mask, cache, position_embeddings)


def _run_plan(
    plan: _LayerPlan,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor | None:
    """:func:`_native_layer`'s call with a current plan; None (nothing written) where the
    cache or the rotary tables do not fit it."""
    layer_cache = cache.layers[plan.layer_idx]
    writable = getattr(layer_cache, "writable_bits", None)
    cos, sin = position_embeddings
    batch, tokens = hidden_states.shape[:2]
    if (
        writable is None
        or cos.dtype != torch.bfloat16
        or sin.dtype != torch.bfloat16
        or tokens > MAX_QUERIES
    ):
        return None
    buffers = writable(batch, tokens)
    if buffers is None:
        return None
    keys, values, start = buffers
    out = _native.decoder_layer(
        bf16_bits(hidden_states.contiguous()),
        *plan.norms,
        plan.eps,
        *plan.packed,
        plan.heads,
        plan.kv_heads,
        plan.scale,
        *rotary_bits(cos, sin, batch),
        keys,
        values,
        start,
        None if attention_mask is None else mask_bits(attention_mask, start + tokens),
        torch.get_num_threads(),
    )
    layer_cache.set_length(start + tokens)
    return from_bits(out)


#: Keyword arguments a layer may get that DART's attention kernel does not compute.
_UNSUPPORTED = ("softcap", "sliding_window", "position_bias")


@dataclass(frozen=True)
class _LayerPlan:
    """What :func:`_native_layer` hands the kernel for one layer, built once and reused
    while the layer stays as it was built from (the same weight tensors at the same
    versions, no biases, its linear layers packed, the same CPU matmul chosen): checking
    that costs a few attribute reads, where building the arguments anew cost a fifth of a
    decoding step's forward, every layer's Python state cold after the weights stream by."""

    layer_idx: int
    packed: tuple[Any, Any, Any, Any]
    norms: tuple[np.ndarray, np.ndarray]
    eps: float
    heads: int
    kv_heads: int
    scale: float
    matmul: str
    #: Per part with parameters: its parameter registry, its weight, and that weight's
    #: version and storage when the plan was built (holding the weight keeps its id from
    #: being reused; the storage changes where ``weight.data`` is assigned).
    weights: tuple[tuple[dict[str, Any], torch.Tensor, int, int], ...]
    #: The linear parts' attribute dicts (a packed layer's holds ``_plain_forward``).
    linears: tuple[dict[str, Any], ...]

    def current(self) -> bool:
        return (
            self.matmul == cpu_matmul()
            and all(
                params.get("weight") is weight
                and weight._version == version
                and weight.data_ptr() == storage
                and params.get("bias") is None
                for params, weight, version, storage in self.weights
            )
            and all("_plain_forward" in attrs for attrs in self.linears)
        )


def _layer_plan(layer: nn.Module, x: torch.Tensor) -> _LayerPlan | None:
    """``layer``'s :class:`_LayerPlan`: the stored one while it is current (and no gradient
    is wanted), else a new one; None where a part does not run DART's kernels."""
    grad = torch.is_grad_enabled()
    plan = layer.__dict__.get(_PLAN)
    if plan is not None and not grad and plan.current():
        return plan
    attn, mlp = layer.self_attn, layer.mlp
    matrices = [
        decoding_matrix(attn, _QKV, x),
        decoding_matrix(attn, ("o_proj",), x),
        decoding_matrix(mlp, _GATE_UP, x),
        decoding_matrix(mlp, ("down_proj",), x),
    ]
    packed = [m[0].packed for m in matrices if m is not None and m[1] is None]
    head_dim = attn.head_dim
    heads = attn.q_proj.out_features // head_dim
    kv_heads = attn.k_proj.out_features // head_dim
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    eps = float(norm_in.variance_epsilon)
    if len(packed) != 4 or heads % kv_heads or float(norm_post.variance_epsilon) != eps:
        return None
    linears = [attn._modules[n] for n in (*_QKV, "o_proj")] + [
        mlp._modules[n] for n in (*_GATE_UP, "down_proj")
    ]
    parts = (norm_in, norm_post, *linears)
    plan = _LayerPlan(
        layer_idx=attn.layer_idx,
        packed=(packed[0], packed[1], packed[2], packed[3]),
        norms=(bf16_bits(norm_in.weight), bf16_bits(norm_post.weight)),
        eps=eps,
        heads=heads,
        kv_heads=kv_heads,
        scale=float(attn.scaling),
        matmul=cpu_matmul(),
        weights=tuple(
            (params, params["weight"], params["weight"]._version, params["weight"].data_ptr())
            for params in (part._parameters for part in parts)
        ),
        linears=tuple(part.__dict__ for part in linears),
    )
    if not grad:
        layer.__dict__[_PLAN] = plan
    return plan


def native_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Any,
    logits_to_keep: int,
    taps: dict[int, tuple[int, ...]] | None,
    tapped: dict[int, torch.Tensor],
    own_hooks: frozenset[int],
) -> torch.Tensor | None:
    """``LlamaForCausalLM.forward`` for a decoding step on the CPU without transformers'
    per-layer plumbing: the embedding, mask, rotary tables, each decoder layer's one native
    call (its :class:`_LayerPlan`), final norm and output projection, the same modules and
    kernels in the same order, so the same logits bit for bit. A layer whose plan is not
    current runs as a module call, as transformers would call it. Returns the logits, with
    each tapped layer's input (``taps``: layer index -> slots) put in ``tapped``; None, with
    nothing run, where it does not apply: another model code, a hook anywhere but
    ``own_hooks`` (pre-hooks on decoder layers), a layer never run in one call yet (its plan
    is built on the model's own path), a cache not allocated yet, a prompt-sized block."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if (
        decoder is None
        or not isinstance(layers, nn.ModuleList)
        or not _same_source(type(model).forward, "causal_lm")
        or not _same_source(type(decoder).forward, "model")
        or len(layers) != decoder.config.num_hidden_layers
        or model.training
        or torch.is_grad_enabled()
        or input_ids.device.type != "cpu"
        or input_ids.shape[1] > MAX_QUERIES
        or hooks_anywhere()
        # A prefill allocates the cache on the model's own path.
        or not all(getattr(layer, "is_initialized", False) for layer in cache.layers)
    ):
        return None
    plans: list[_LayerPlan | None] = []
    for layer in layers:
        attrs = layer.__dict__
        if (
            _PLAN not in attrs
            or layer._forward_hooks
            or any(attrs[_PART_HOOKS])
            or not own_hooks.issuperset(layer._forward_pre_hooks)
        ):
            return None
        plan = attrs[_PLAN]
        plans.append(plan if plan.current() else None)
    modules = (model, decoder, decoder.embed_tokens, decoder.rotary_emb, decoder.norm)
    if any(m._forward_hooks or m._forward_pre_hooks for m in (*modules, model.lm_head)):
        return None
    if layers[0].self_attn.config._attn_implementation != SMALL_QUERY_ATTENTION:
        return None
    modeling = sys.modules[type(decoder).__module__]
    hidden_states = decoder.embed_tokens(input_ids)
    if hidden_states.dtype != torch.bfloat16 or prompt_block(hidden_states):
        return None
    mask = modeling.create_causal_mask(
        config=decoder.config,
        inputs_embeds=hidden_states,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    position_embeddings = decoder.rotary_emb(hidden_states, position_ids=position_ids)
    for index, (layer, plan) in enumerate(zip(layers, plans, strict=True)):
        if taps is not None and index in taps:
            for slot in taps[index]:
                tapped[slot] = hidden_states
        out = None
        if plan is not None:
            out = _run_plan(plan, hidden_states, mask, cache, position_embeddings)
        if out is None:
            out = layer(
                hidden_states,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
        hidden_states = out
    hidden_states = decoder.norm(hidden_states)
    logits: torch.Tensor = model.lm_head(
        modeling.slice_logits_to_keep(hidden_states, logits_to_keep)
    )
    return logits


#: The projections a lean layer multiplies together (:func:`fused_projection`).
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")

#: Set on a lean layer: the modules whose forward it calls directly (their hooks would be
#: skipped, so any hook sends the call to the plain forward), and their hook registries
#: (the dicts that registering a hook adds to: one truth test each per call).
_PARTS = "_dart_lean_parts"
_PART_HOOKS = "_dart_lean_part_hooks"
#: Set on a lean layer by its first native call: its :class:`_LayerPlan`.
_PLAN = "_dart_native_plan"


def _lean_layer_applies(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    )
    return (
        _same_source(type(layer).forward, "layer")
        and attn is not None
        and _same_source(type(attn).forward, "attention")
        and mlp is not None
        and _PLAIN in mlp.__dict__  # a switched (Llama, SiLU) MLP
        and all(n is not None and _PLAIN in n.__dict__ for n in norms)
    )


def _rotary_dispatch(plain: Callable[..., Any], name: str) -> Callable[..., Any]:
    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *args: Any,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        unsqueeze_dim = args[0] if args else kw.get("unsqueeze_dim", 1)
        if (
            unsqueeze_dim == 1
            and q.dim() == k.dim() == 4
            and cos.dim() == sin.dim() == 3
            and cos.shape == sin.shape
        ):
            if _native_bf16(q, k, cos, sin):
                return rotary(q, cos, sin), rotary(k, cos, sin)
            if name in _gpu_rotary and gpu_kernels.applies(q, k, cos, sin):
                return gpu_kernels.rotary(q, cos, sin), gpu_kernels.rotary(k, cos, sin)
        return plain(q, k, cos, sin, *args, **kw)

    apply_rotary_pos_emb.__wrapped__ = plain  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


#: Modeling modules whose ``apply_rotary_pos_emb`` is replaced, with the models using it.
_rotary_users: dict[str, set[int]] = {}
#: Those of them with a model switched for cuda, with those models.
_gpu_rotary: dict[str, set[int]] = {}


def is_silu(activation: Any) -> bool:
    """Whether ``activation`` is a SiLU module (PyTorch's or transformers'), which the
    native SiLU product computes."""
    return type(activation).__name__ in ("SiLU", "SiLUActivation")


def use_native_elementwise(model: nn.Module, gpu: bool = False) -> int:
    """Replace ``model``'s Llama-code norms, SiLU MLPs and rotary embedding with the native
    kernels (only where the inputs are CPU bf16 without gradients; see the module's text), and
    give its Llama-code decoder layers the lean forward. With ``gpu``, the same switch for a
    cuda model: its inputs take :mod:`dart_client.models.gpu_kernels` (no lean forward).
    Returns how many modules (and rotary functions) were switched; :func:`restore` undoes it."""
    switched = 0
    for module in model.modules():
        if _PLAIN in module.__dict__:
            continue
        cls = type(module)
        if cls.__name__.endswith("RMSNorm") and _same_source(cls.forward, "norm"):
            module.__dict__[_PLAIN] = module.forward
            module.forward = types.MethodType(_norm_forward, module)
            switched += 1
        elif (
            cls.__name__.endswith("MLP")
            and is_silu(getattr(module, "act_fn", None))
            and _same_source(cls.forward, "mlp")
        ):
            module.__dict__[_PLAIN] = module.forward
            module.forward = types.MethodType(_mlp_forward, module)
            switched += 1
        else:
            continue
        if gpu:
            module.__dict__[_GPU] = True
    for layer in list(model.modules()):
        if gpu:
            break
        if _PLAIN not in layer.__dict__ and _lean_layer_applies(layer):
            attn, mlp = layer.self_attn, layer.mlp
            layer.__dict__[_PARTS] = (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                attn,
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            )
            layer.__dict__[_PART_HOOKS] = tuple(
                hooks
                for part in layer.__dict__[_PARTS]
                for hooks in (part._forward_hooks, part._forward_pre_hooks)
            )
            layer.__dict__[_PLAIN] = layer.forward
            layer.forward = types.MethodType(_lean_layer_forward, layer)
            switched += 1
    for name in {type(m).__module__ for m in model.modules()}:
        modeling = sys.modules.get(name)
        plain = getattr(modeling, "apply_rotary_pos_emb", None)
        if plain is None:
            continue
        users = _rotary_users.get(name)
        if users is None:
            if not _same_source(plain, "rotary"):
                continue
            modeling.apply_rotary_pos_emb = _rotary_dispatch(plain, name)  # type: ignore[union-attr]
            users = _rotary_users[name] = set()
        users.add(id(model))
        if gpu:
            _gpu_rotary.setdefault(name, set()).add(id(model))
        switched += 1
    return switched


def restore(model: nn.Module) -> None:
    """Undo :func:`use_native_elementwise` for ``model`` (the rotary function goes back when
    no switched model uses its module any more)."""
    for module in model.modules():
        if module.__dict__.pop(_PLAIN, None) is not None:
            module.__dict__.pop(_GPU, None)
            module.__dict__.pop("forward", None)
            module.__dict__.pop(_PARTS, None)
            module.__dict__.pop(_PART_HOOKS, None)
            module.__dict__.pop(_PLAN, None)
    for name, users in list(_gpu_rotary.items()):
        users.discard(id(model))
        if not users:
            del _gpu_rotary[name]
    for name, users in list(_rotary_users.items()):
        users.discard(id(model))
        if not users:
            modeling = sys.modules[name]
            modeling.apply_rotary_pos_emb = modeling.apply_rotary_pos_emb.__wrapped__  # type: ignore[attr-defined]
            del _rotary_users[name]
