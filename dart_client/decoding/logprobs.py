"""Log probabilities of the generated tokens, as OpenAI's ``logprobs`` reports them.

Each token's log probability under the target's *raw* distribution at its position (the
log-softmax of the target's logits, before temperature, top-k and top-p: what vLLM reports
by default), and optionally the ``top`` likeliest tokens there. A DART step verifies the
whole tree in one forward, so the logits that produced every accepted token (and the bonus
token) are already at hand: reporting them costs a log-softmax per new token, no forward.
The values are the target's own, whichever drafter ran: a token's log probability is the
same as autoregressive decoding's (up to the rounding of a tree forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dart_client.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    import torch

#: Most alternatives a token may report (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token, its log probability, and the ``top`` likeliest tokens at its
    position (``(token, logprob)``, likeliest first, ties by token id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of ``tokens[i]`` under ``logits[i]`` (rows of raw target
    logits, one per token), each with its ``top`` alternatives (0: none). Computed in
    float32 at least (bf16/fp16 logits upcast first), one transfer to the host."""
    import torch  # here: the server's protocol layer imports this module without torch

    if len(tokens) == 0:
        return []
    rows = logits[: len(tokens)]
    if rows.dtype in (torch.bfloat16, torch.float16):
        rows = rows.float()
    logp = torch.log_softmax(rows, dim=-1)
    index = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, index.unsqueeze(1)).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    out = []
    for t, lp, vs, ts in zip(tokens, chosen, values.tolist(), ids.tolist(), strict=True):
        # topk orders equal values arbitrarily: ties go by token id, as greedy's argmax.
        alternatives = tuple(sorted(zip(ts, vs, strict=True), key=lambda p: (-p[1], p[0])))
        out.append(TokenLogprob(t, lp, alternatives))
    return out


def check_logprobs(value: object) -> int | None:
    """``logprobs`` as a generation setting: None (off) or the alternatives per token,
    0..:data:`MAX_TOP_LOGPROBS` (0: the generated tokens' own only)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(
            f"logprobs must be None or an int (alternatives per token), got {type(value).__name__}"
        )
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError(
            f"logprobs = {value}: expected 0..{MAX_TOP_LOGPROBS} alternatives per token (or None)"
        )
    return value


#: Prompt positions scored per forward by :func:`prompt_logprobs` (bounds the logits held:
#: positions x vocabulary floats).
PROMPT_CHUNK = 256


def prompt_logprobs(target: Any, ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of every prompt token after the first under the target
    (``target``: a :class:`~dart_client.models.target.TargetModel`): the prompt read in
    chunks of :data:`PROMPT_CHUNK` positions into a cache of its own, each chunk's logits
    scored and dropped. What OpenAI's ``echo`` with ``logprobs`` reports for the prompt
    (evaluation harnesses score continuations this way)."""
    import torch

    ids = list(ids)
    cache = target.new_cache(len(ids))
    out: list[TokenLogprob] = []
    for start in range(0, len(ids) - 1, PROMPT_CHUNK):
        chunk = ids[start : start + PROMPT_CHUNK]
        x = torch.tensor([chunk], dtype=torch.long, device=target.device)
        positions = torch.arange(start, start + len(chunk), device=target.device).unsqueeze(0)
        logits, _ = target.forward(x, positions, cache, logits_to_keep=0, taps=False)
        # Position p's logits score token p + 1 (the last chunk has no next token to score).
        following = ids[start + 1 : start + 1 + len(chunk)]
        out.extend(token_logprobs(logits[0], following, top))
    return out
