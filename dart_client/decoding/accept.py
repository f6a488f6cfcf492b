"""Acceptance: which draft-tree path the target agrees with, and the bonus token after it.

Greedy: follow the target's argmax down the tree; the bonus token is the argmax at the last
accepted node. The output is exactly the target's greedy decoding.

Sampling (recursive rejection over siblings): at a node with warped target distribution p,
the children are deterministic draft candidates (point masses). Try them in tree order:
accept child x with probability ``p(x) / sum(p)``; on rejection set ``p(x) = 0`` and try the
next sibling. If one is accepted, continue from it with its own fresh distribution; if none
is, the bonus token is sampled from what is left of p. For a candidate set that does not
depend on the target's own draws this yields exactly p at every position, i.e. lossless
sampling (each rejection conditions the residual on "not x", which is what zeroing and
renormalising computes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dart_client.decoding.sampling import SamplingParams, target_probs
from dart_client.decoding.verify import Tree


@dataclass
class Acceptance:
    """The accepted path: ``nodes`` (tree indices, root first), its tokens, and the bonus."""

    nodes: list[int]
    tokens: list[int]  # accepted draft tokens, root excluded
    bonus: int

    @property
    def new_tokens(self) -> list[int]:
        """Tokens this step adds after the root: accepted drafts plus the bonus token."""
        return [*self.tokens, self.bonus]


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of one row of logits, first index on ties (as transformers' greedy search).

    In float32: the exact upcast of bf16/fp16 keeps every comparison and tie. On the CPU
    numpy's vectorised argmax (same rule: first maximum, NaN wins) is several times faster than
    torch's for a whole vocabulary (an argmax per visited node and per AR token).
    """
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    if logits.device.type == "cpu":
        return int(logits.detach().numpy().argmax())
    return int(logits.argmax())


def mask_end_tokens(
    logits: torch.Tensor,
    depths: torch.Tensor,
    generated: int,
    min_tokens: int,
    end_ids: frozenset[int],
) -> torch.Tensor:
    """``logits`` (a row per tree node; row i's token would be new token number
    ``generated + depths[i]``) with the end tokens at -inf in the rows whose token comes
    before ``min_tokens``: the distribution vLLM's ``min_tokens`` samples from. The same
    tensor when no row is early; a copy otherwise."""
    if generated >= min_tokens or not end_ids:
        return logits
    early = torch.nonzero(depths.cpu() + generated < min_tokens).flatten()
    rows = early.to(logits.device)
    cols = torch.tensor(sorted(end_ids), dtype=torch.long, device=logits.device)
    out = logits.clone()
    out[rows.unsqueeze(1), cols.unsqueeze(0)] = float("-inf")
    return out


def accept_greedy(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Longest path whose every token equals the target's argmax at its parent.

    Only the rows the walk visits are reduced (one full-vocabulary argmax per node).
    """
    node = 0
    nodes = [0]
    tokens: list[int] = []
    while True:
        want = greedy_token(logits[node])
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return Acceptance(nodes=nodes, tokens=tokens, bonus=want)
        node = nxt
        nodes.append(node)
        tokens.append(want)


def accept_sampling(
    tree: Tree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Acceptance:
    """Recursive rejection over siblings against the target's warped distribution."""
    node = 0
    nodes = [0]
    tokens: list[int] = []
    while True:
        # Distributions are computed only for the nodes the walk visits.
        p = target_probs(logits[node], params).double()
        accepted = None
        for child in tree.children[node]:
            x = tree.tokens[child]
            px = float(p[x])
            if px <= 0.0:
                continue  # impossible under the target: rejected with certainty
            total = float(p.sum())
            u = float(torch.rand((), generator=generator, device=p.device, dtype=torch.float64))
            # Dividing by the running sum (not a renormalised copy): when x is the only
            # token left, px / total is exactly 1 and x is always accepted.
            if u * total < px:
                accepted = child
                break
            p[x] = 0.0
        if accepted is None:
            bonus = int(torch.multinomial(p, 1, generator=generator).item())
            return Acceptance(nodes=nodes, tokens=tokens, bonus=bonus)
        node = accepted
        nodes.append(node)
        tokens.append(tree.tokens[node])
