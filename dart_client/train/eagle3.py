"""EAGLE-3's training-time test (TTT): the draft model unrolled over its own outputs.

Step 0 runs the layer over every real position ``t`` of a window with input
``(fc(taps_t), embed(x_{t+1}))`` at position ``t``, causal. Step ``j >= 1`` runs it again at
every ``t`` with input ``(g_t^{j-1}, embed(x_{t+1+j}))`` at position ``t + j``, where
``g^{j-1}`` is the layer's own output one step before: the state the drafter feeds itself at
depth ``j``. A query of step ``j`` at ``t`` sees the step-0 keys at ``<= t`` (the real prefix)
and the keys of steps ``1..j`` at ``t`` only (its own drafted chain), as the published
training code computes it. Step ``j`` at ``t`` learns the target's distribution at
``t + 1 + j`` (over the draft vocabulary); a line counts when the token it predicts,
``x_{t+2+j}``, is in the window and under the loss mask. The loss is
:func:`~dart_client.train.loss.annealed_kl` over the steps with decay ``gamma`` (0.8 in the
published training; its cross-entropy differs from this KL by the target's entropy, a
constant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dart_client.models.eagle3 import Eagle3Head
from dart_client.models.head import HeadAttention, rotate_half
from dart_client.models.linear import project
from dart_client.train.forward import TargetIndex
from dart_client.train.loss import annealed_kl, distinct_targets
from dart_client.train.trainer import Trainer

#: Per-step loss decay of the published EAGLE-3 training.
EAGLE3_GAMMA = 0.8


def ttt_attention(
    attn: HeadAttention,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    earlier: Sequence[tuple[torch.Tensor, torch.Tensor]],
    causal: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention of one TTT step over ``x`` (b, n, 2H): the step-0 keys causally (``causal``
    a float (n, n) mask), every later step's key at the query's own index. ``earlier``: the
    (k, v) of the steps before, step 0 first (empty at step 0). Returns the attention
    output (b, n, H) and this step's (k, v)."""
    b, n, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = project(attn, attn.QKV, x).view(b, n, nh + 2 * nkv, hd)
    cos, sin = (t.unsqueeze(2) for t in cos_sin)
    qk = qkv[:, :, : nh + nkv]
    qk = qk * cos + rotate_half(qk) * sin
    groups = nh // nkv
    q = qk[:, :, :nh].transpose(1, 2)
    k = qk[:, :, nh:].transpose(1, 2).repeat_interleave(groups, dim=1)
    v = qkv[:, :, nh + nkv :].transpose(1, 2).repeat_interleave(groups, dim=1)
    keys = [*earlier, (k, v)]
    k0, v0 = keys[0]
    scale = 1.0 / math.sqrt(hd)
    scores = [torch.matmul(q, k0.transpose(2, 3)) * scale + causal]
    scores += [(q * ki).sum(-1, keepdim=True) * scale for ki, _ in keys[1:]]
    # Half precision softmaxes in float32 (as the published code does); float64 stays.
    upcast = torch.promote_types(q.dtype, torch.float32)
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=upcast).to(q.dtype)
    out = torch.matmul(weights[..., :n], v0)
    for i, (_, vi) in enumerate(keys[1:]):
        out = out + weights[..., n + i : n + i + 1] * vi
    out = out.transpose(1, 2).reshape(b, n, nh * hd)
    return project(attn, ("o_proj",), out), (k, v)


def ttt_forward(
    head: Eagle3Head,
    taps: torch.Tensor,
    input_ids: torch.Tensor,
    steps: int,
) -> list[torch.Tensor]:
    """The layer's outputs (b, n, H) of every TTT step, n = T - 1 real positions.

    ``taps`` (b, n, 3H): the target's states at positions 0..n-1; ``input_ids`` (b, T): the
    window (tokens past its end embed as id 0, as the published training pads them).
    """
    b, n, _ = taps.shape
    layer = head.midlayer
    hidden = head.fuse(taps)
    padded = torch.cat((input_ids, input_ids.new_zeros(b, steps)), dim=1)
    dtype = hidden.dtype
    causal = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=hidden.device).triu(1)
    base = torch.arange(n, device=hidden.device).expand(b, n)
    earlier: list[tuple[torch.Tensor, torch.Tensor]] = []
    outputs = []
    for j in range(steps):
        with torch.no_grad():
            embeds = head.embed(padded[:, 1 + j : 1 + j + n])
        x = layer.layer_input(embeds, hidden)
        cos_sin = head.rotary(hidden, base + j)
        attended, kv = ttt_attention(layer.self_attn, x, cos_sin, earlier, causal)
        earlier.append(kv)
        hidden = layer.finish(hidden, attended)
        outputs.append(hidden)
    return outputs


def ttt_targets(
    lengths: Sequence[int], loss_masks: Sequence[torch.Tensor], n_real: int, steps: int
) -> TargetIndex:
    """The trained lines of every step: ``line`` is the index ``t``, ``row`` the step ``j``,
    ``target_pos`` = ``t + 1 + j`` (the target's logits there predict ``x_{t+2+j}``)."""
    bs, lines, rows, tpos = [], [], [], []
    for b, (length, lm) in enumerate(zip(lengths, loss_masks, strict=True)):
        lm = torch.as_tensor(lm, dtype=torch.bool)
        for j in range(steps):
            t = torch.arange(max(min(length - 2 - j, n_real), 0))
            t = t[lm[t + 2 + j]]
            bs.append(torch.full_like(t, b))
            lines.append(t)
            rows.append(torch.full_like(t, j))
            tpos.append(t + 1 + j)
    return TargetIndex(
        batch=torch.cat(bs), line=torch.cat(lines), row=torch.cat(rows), target_pos=torch.cat(tpos)
    )


def ttt_loss(
    head: Eagle3Head,
    outputs: Sequence[torch.Tensor],
    target_logits: torch.Tensor,
    index: TargetIndex,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The annealed KL of the counted lines only (``lm_head`` runs on those rows alone) and
    the per-step stats ``(3, steps)``: KL sums, top-1 agreements, counts."""
    steps = len(outputs)
    stacked = torch.stack(list(outputs))  # (steps, b, n, H)
    hidden = stacked[index.row, index.batch, index.line]
    draft = head.logits(hidden)
    # Each position is the target of up to `steps` lines: its softmax is taken once.
    target, target_rows = distinct_targets(target_logits, index.batch, index.target_pos)
    weights = torch.ones(draft.shape[0], device=draft.device)
    loss, stats = annealed_kl(draft, target, index.row, weights, steps, gamma, target_rows)
    return loss, torch.stack([stats.kl_sum, stats.correct, stats.count]).cpu()


class Eagle3Trainer(Trainer):
    """The project's trainer (data order, schedule, checkpoints, exact resume) over an
    :class:`Eagle3Head` with TTT; ``config.draft_length`` is the number of TTT steps and
    ``config.gamma`` the per-step decay."""

    head_class = Eagle3Head

    @property
    def num_rows(self) -> int:
        return self.config.draft_length

    def _micro_step(self, globals_: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        steps = cfg.draft_length
        seqs, lengths, input_ids, tgt = self._target_batch(globals_)
        t_max = max(lengths)
        n_real = t_max - 1
        head = self.head
        assert isinstance(head, Eagle3Head)
        autocast = cfg.head_dtype == "bf16"
        index = ttt_targets(lengths, [torch.from_numpy(mk) for _, mk in seqs], n_real, steps)
        index = TargetIndex(*(t.to(self.device) for t in vars(index).values()))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            outputs = ttt_forward(head, tgt.taps[:, :n_real].float(), input_ids, steps)
            loss, stats = ttt_loss(head, outputs, tgt.logits.float(), index, cfg.gamma)
        tokens = torch.full((1, steps), float(sum(lengths)), dtype=stats.dtype)
        return loss / cfg.grad_accum, torch.cat((stats, tokens))


__all__ = ["EAGLE3_GAMMA", "Eagle3Trainer", "ttt_attention", "ttt_forward", "ttt_targets"]
