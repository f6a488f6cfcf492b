"""The target's sampling distribution: temperature, top-k and top-p as transformers applies them.

Lossless speculative sampling must reproduce exactly the distribution that plain sampling
from the target would use, so these warpers follow transformers' ``generate`` semantics:
the order is temperature -> top-k -> top-p, top-k keeps every token tied with the k-th
logit, top-p removes the tokens whose ascending cumulative probability is ``<= 1 - top_p``
and always keeps the most likely token. ``temperature == 0`` means greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dart_client.errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings (``temperature == 0`` is greedy; ``top_k == 0`` is off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise InvalidArgumentError(f"{name} must be finite, got {value}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InvalidTypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if self.temperature < 0:
            raise InvalidArgumentError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to ``logits`` (..., V); filtered entries become -inf.

    Works on any number of rows at once (every tree node in one call). Computes in the
    logits' dtype promoted to at least float32.
    """
    if params.greedy:
        raise InvalidArgumentError("warp_logits is for sampling; temperature 0 means greedy")
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        scores = top_p_filter(scores, params.top_p)
    return scores


def top_p_filter(scores: torch.Tensor, top_p: float, probe: int = 256) -> torch.Tensor:
    """``scores`` with every token outside the nucleus set to -inf (transformers' rule: drop
    the tokens whose ascending cumulative probability is ``<= 1 - top_p``, keep the top one).

    Sorting a whole vocabulary per row costs milliseconds, a noticeable part of a step.
    Usually the nucleus lies within the ``probe`` most likely tokens: when the probability
    left outside them is itself ``<= 1 - top_p``, every token outside is dropped by the rule
    and the cumulative sums of those inside are their own suffix sums plus that remainder, so
    the rule is applied to them alone. Rows where that does not hold take the full sort.
    """
    vocab = scores.shape[-1]
    if 4 * probe >= vocab or scores.dim() == 0:
        return _top_p_by_sort(scores, top_p)
    top = torch.topk(scores, probe, dim=-1)  # descending
    probs = (top.values - torch.logsumexp(scores, dim=-1, keepdim=True)).exp()
    outside = (1.0 - probs.sum(dim=-1, keepdim=True)).clamp_min(0.0)
    ascending = probs.flip(-1).cumsum(-1).flip(-1) + outside
    remove = ascending <= 1.0 - top_p
    remove[..., :1] = False  # the most likely token always survives
    kept = top.values.masked_fill(remove, -math.inf)
    out = torch.full_like(scores, -math.inf).scatter(-1, top.indices, kept)
    wide = (outside > 1.0 - top_p).squeeze(-1)
    if bool(wide.any()):  # a nucleus wider than the probe: those rows take the full sort
        out[wide] = _top_p_by_sort(scores[wide], top_p)
    return out


def _top_p_by_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1.0 - top_p)
    remove_sorted[..., -1:] = False  # the most likely token always survives
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, -math.inf)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution per row: softmax of the warped logits."""
    return torch.softmax(warp_logits(logits, params), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D (possibly unnormalised) probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``seed`` (or from OS entropy when None), on ``device``."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidTypeError(f"seed must be an int or None, got {type(seed).__name__}")
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
