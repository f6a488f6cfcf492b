"""The training-time forwards: taps and restricted logits from the frozen target, and the
head over a prefix-shared layout (every real position plus the MASK blocks of its anchors).

The head's own ``forward`` serves inference (the last real row + the mask rows, causal); here
the same submodules run over the whole layout with an arbitrary mask and position ids, and
every row is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dart_client.models.head import DartHead


def tap_layers(num_layers: int) -> tuple[int, int, int]:
    """0-based target layers whose inputs the head reads: low, middle, high."""
    if num_layers < 4:
        raise ValueError(f"a target with {num_layers} layers has no taps 2, N//2, N-3")
    return (2, num_layers // 2, num_layers - 3)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers``)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: expected `.model.layers` (a decoder-only LM)")
    return layers


@dataclass
class TargetOutputs:
    taps: torch.Tensor  # (B, T, 3H) inputs of the tap layers, concatenated low/mid/high
    logits: torch.Tensor  # (B, T, N) logits restricted to the draft vocabulary
    embeds: torch.Tensor  # (B, T, H) the target's input embeddings


@torch.no_grad()
def target_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    draft_to_target: torch.Tensor,
) -> TargetOutputs:
    """One frozen target forward: its taps and its logits over the draft vocabulary only
    (computing just those rows of the output projection saves most of the lm_head cost)."""
    layers = decoder_layers(model)
    wanted = tap_layers(len(layers))
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for idx in wanted:

        def hook(_mod: nn.Module, args: tuple, kwargs: dict, idx: int = idx) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[idx] = hidden

        handles.append(layers[idx].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state
    weight = model.get_output_embeddings().weight[draft_to_target]
    logits = final @ weight.T
    bias = getattr(model.get_output_embeddings(), "bias", None)
    if bias is not None:
        logits = logits + bias[draft_to_target]
    taps = torch.cat([captured[i] for i in wanted], dim=-1)
    embeds = model.get_input_embeddings()(input_ids)
    return TargetOutputs(taps=taps, logits=logits, embeds=embeds)


def head_forward_layout(
    head: DartHead,
    taps: torch.Tensor,
    next_embeds: torch.Tensor,
    num_mask_slots: int,
    mask: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Draft logits ``(B, n + S, N)`` for ``n`` real positions followed by ``S`` MASK slots.

    ``taps`` ``(B, n, 3H)`` and ``next_embeds`` ``(B, n, H)`` (the embedding of the token after
    each real position); ``mask`` ``(B, 1, L, L)`` float and ``positions`` ``(B, L)`` from
    :func:`dart_client.train.masks.batch_layout`, ``L = n + S``.
    """
    layer = head.midlayer
    projected = head.fc(taps)
    x = torch.cat(
        (layer.input_layernorm(next_embeds.to(projected.dtype)), layer.hidden_norm(projected)),
        dim=-1,
    )
    residual = projected
    b = x.shape[0]
    if num_mask_slots:
        mask_in = layer.mask_rep.to(x.dtype).view(1, 1, -1).expand(b, num_mask_slots, -1)
        x = torch.cat((x, mask_in), dim=1)
        residual = torch.cat((residual, mask_in[..., : layer.hidden_size]), dim=1)
    cos_sin = head.rotary(projected, positions)
    h = residual + layer.self_attn(x, cos_sin, None, mask.to(x.dtype))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = head.norm(h)
    if head.config.double_final_norm:
        h = head.norm(h)
    return head.lm_head(h)


@dataclass
class TargetIndex:
    """For every trained line of the head output: where it is, its row, the target index."""

    batch: torch.Tensor  # (K,)
    line: torch.Tensor  # (K,) index into the head's L axis
    row: torch.Tensor  # (K,) 0..m
    target_pos: torch.Tensor  # (K,) index into the target's T axis (its logits there)


def training_targets(
    lengths: Sequence[int],
    loss_masks: Sequence[torch.Tensor],
    anchors: Sequence[Sequence[int]],
    n_real: int,
    m: int,
) -> TargetIndex:
    """Lines to train: real position ``t`` (row 0) and slot ``i`` of anchor ``a`` (row ``i``).

    Row ``j`` at anchor ``t`` learns the target's distribution at position ``t + 1 + j``
    (which predicts token ``t + 2 + j``); a line counts when that token is in the window and
    under the loss mask.
    """
    bs, lines, rows, tpos = [], [], [], []
    for b, (length, lm, anc) in enumerate(zip(lengths, loss_masks, anchors, strict=True)):
        lm = torch.as_tensor(lm, dtype=torch.bool)
        t = torch.arange(max(length - 2, 0))
        keep = lm[t + 2]
        t = t[keep]
        bs.append(torch.full_like(t, b))
        lines.append(t)
        rows.append(torch.zeros_like(t))
        tpos.append(t + 1)
        for k, a in enumerate(anc):
            for i in range(1, m + 1):
                if a + 2 + i < length and bool(lm[a + 2 + i]):
                    bs.append(torch.tensor([b]))
                    lines.append(torch.tensor([n_real + k * m + (i - 1)]))
                    rows.append(torch.tensor([i]))
                    tpos.append(torch.tensor([a + 1 + i]))
    return TargetIndex(
        batch=torch.cat(bs),
        line=torch.cat(lines),
        row=torch.cat(rows),
        target_pos=torch.cat(tpos),
    )
