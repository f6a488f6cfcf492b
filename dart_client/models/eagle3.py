"""The EAGLE-3 draft model (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", 2025), in the layout of its published checkpoints.

* ``fc`` (3H_target -> H, no bias) fuses the target's low/mid/high hidden states (the inputs
  of 0-based layers ``2, N//2, N-3``, the same taps the DART head reads);
* ``midlayer``: one decoder layer whose input is
  ``cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))`` (2H, embedding first), with
  residual ``g_t``; ``g_t`` is ``fc(taps_t)`` at a real position and the layer's own previous
  output (pre-norm) at a drafted one; attention with q/k/v over 2H, RoPE, a gated MLP;
* ``norm`` (once) and ``lm_head`` to a reduced draft vocabulary,
  ``target_id = draft_id + d2t[draft_id]``; ``t2d`` marks the target ids drafted.

Keys: those of the DART head less ``midlayer.mask_rep`` (DART's head grew out of this one);
``embed_tokens.weight``, which some published checkpoints carry, is ignored: the target's own
embedding is used. Weights come as ``model.safetensors`` or ``pytorch_model.bin``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dart_client.errors import IncompatibleHeadError
from dart_client.models.head import (
    BIN_WEIGHTS_NAME,
    CHECKPOINT_KEYS,
    WEIGHTS_NAME,
    DartHead,
    DartHeadConfig,
    HeadAttention,
    HeadCache,
    HeadMLP,
    RMSNorm,
    causal_mask,
)
from dart_client.models.linear import project

ARCHITECTURE = "LlamaForCausalLMEagle3"
#: The published EAGLE-3 keys: the DART layout without the MASK representation.
EAGLE3_KEYS = tuple(k for k in CHECKPOINT_KEYS if k != "midlayer.mask_rep")
#: Training-time-test unroll of the published training (``length = 7``).
DEFAULT_TTT_STEPS = 7


class Eagle3Layer(nn.Module):
    """``midlayer``: the one decoder layer; its input is the token embedding and a hidden
    state (the fused target states, or the layer's own output one step before)."""

    def __init__(self, config: DartHeadConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = HeadAttention(config)
        self.mlp = HeadMLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The attention input ``cat(input_layernorm(embeds), hidden_norm(hidden))``."""
        return torch.cat(
            (self.input_layernorm(embeds.to(hidden.dtype)), self.hidden_norm(hidden)), dim=-1
        )

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual over the attention output, then the MLP block: the layer's output."""
        h = hidden + attended
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: HeadCache | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = self.layer_input(embeds, hidden)
        return self.finish(hidden, self.self_attn(x, cos_sin, cache, mask))


class Eagle3Head(DartHead):
    """The EAGLE-3 draft model; ``config.draft_length`` is its training-time-test unroll
    (unused at inference, where the tree's depth is the drafter's). Loading, saving, the
    draft vocabulary and the binding to the target's embedding are the DART head's."""

    checkpoint_keys = EAGLE3_KEYS
    weight_files = (WEIGHTS_NAME, BIN_WEIGHTS_NAME)
    kind = "EAGLE-3 head"
    other_kind = "a DART head"

    def __init__(self, config: DartHeadConfig) -> None:
        # EAGLE-3 normalises once before lm_head; its configs carry no such field.
        config.double_final_norm = False
        config.extra.setdefault("architectures", [ARCHITECTURE])
        super().__init__(config)
        self.midlayer: Eagle3Layer

    def _make_layer(self, config: DartHeadConfig) -> nn.Module:
        return Eagle3Layer(config)

    @classmethod
    def random_init(  # type: ignore[override]
        cls, target_config: Any, *, draft_length: int = DEFAULT_TTT_STEPS, **kwargs: Any
    ) -> Eagle3Head:
        kwargs["double_final_norm"] = False
        head = super().random_init(target_config, draft_length=draft_length, **kwargs)
        assert isinstance(head, Eagle3Head)
        return head

    def check_compatible(self, target_config: Any) -> None:
        """The target must share the head's hidden size (its embedding feeds the layer) and
        vocabulary; the head's attention is its own (any head_dim)."""
        tc = (
            target_config.get_text_config()
            if hasattr(target_config, "get_text_config")
            else target_config
        )
        cfg = self.config
        pairs = [
            ("hidden_size", cfg.hidden_size, tc.hidden_size),
            ("target_hidden_size", cfg.target_hidden_size, tc.hidden_size),
            ("vocab_size", cfg.vocab_size, tc.vocab_size),
        ]
        diffs = [f"{n}: head {a}, target {b}" for n, a, b in pairs if a != b]
        if diffs:
            raise IncompatibleHeadError(
                "the EAGLE-3 head does not fit the target model: " + "; ".join(diffs)
            )

    # -- forwards -------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise RuntimeError("bind_embedding(target embedding) before running the head")
        return self._embed(ids)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``fc`` over the target's concatenated low/mid/high states (…, 3H) -> (…, H)."""
        return project(self, ("fc",), taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary of the layer's (pre-norm) outputs."""
        return project(self, ("lm_head",), self.norm(hidden))

    def forward(  # type: ignore[override]
        self,
        taps: torch.Tensor,
        next_ids: torch.Tensor,
        cache: HeadCache | None = None,
    ) -> torch.Tensor:
        """The layer's outputs (batch, r, H) at r new real positions, appended to ``cache``.

        ``taps`` (batch, r, 3H): the target's tapped states there; ``next_ids`` (batch, r):
        the token following each (the last is the token just sampled). Positions continue
        the cache, whose length grows by r.
        """
        hidden = self.fuse(taps)
        r = hidden.shape[1]
        past = cache.length if cache is not None else 0
        mask = causal_mask(r, past, hidden.dtype, hidden.device) if past else None
        return self.midlayer(self.embed(next_ids), hidden, self.rope(past, r, hidden), cache, mask)

    def expand(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        position: int,
        cache: HeadCache,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """One drafting step over ``n`` tree nodes at the same depth (position ``position``).

        ``hidden`` (n, H): each node's parent's output; ``ids`` (n,): the nodes' tokens;
        ``visible`` (n, T) bool: which of the ``T`` tree nodes already in ``cache`` (after its
        real positions) each node sees (its ancestors). Every node sees all real positions
        and itself. The nodes' keys are appended to ``cache``; returns their outputs (n, H).
        """
        n = ids.shape[0]
        dtype, device = hidden.dtype, hidden.device
        past = cache.length
        blocked = torch.finfo(dtype).min
        mask = torch.zeros((n, past + n), dtype=dtype, device=device)
        tree = visible.shape[1]
        allowed = torch.cat((visible, torch.eye(n, dtype=torch.bool, device=device)), dim=1)
        mask[:, past - tree :].masked_fill_(~allowed, blocked)
        cos, sin = self.rope(position, 1, hidden)
        cos_sin = (cos.expand(1, n, -1), sin.expand(1, n, -1))
        out = self.midlayer(
            self.embed(ids)[None], hidden[None], cos_sin, cache, mask.view(1, 1, n, past + n)
        )
        return out[0]
