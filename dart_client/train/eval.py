"""Teacher-forced acceptance of a head: alpha-1 .. alpha-d against the target's greedy tokens.

For every position ``a`` of held-out text, one head forward (prefix-shared layout, all
anchors) gives rows ``0..m``; row ``j`` is right when its top-1 token (mapped to a target id)
equals the target's own greedy token for position ``a + 2 + j`` given the true text. alpha-k
below is row ``k - 1``'s accuracy; ``chain-k`` is the accuracy of row ``k - 1`` given rows
``0..k-2`` were right (how a single-path draft would fare).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from dart_client.models.head import DartHead
from dart_client.train.data import TrainingSet
from dart_client.train.forward import head_forward_layout, target_outputs
from dart_client.train.masks import batch_layout


@dataclass
class HeadEval:
    alpha: list[float]
    chain: list[float]
    positions: int
    windows: int
    tokens: int
    extra: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        a = " ".join(f"a{k + 1}={v:.3f}" for k, v in enumerate(self.alpha))
        c = " ".join(f"c{k + 1}={v:.3f}" for k, v in enumerate(self.chain))
        return f"{self.windows} windows, {self.positions} positions: {a} | chain: {c}"


@torch.no_grad()
def evaluate_head(
    head: DartHead,
    target: nn.Module,
    data: TrainingSet,
    *,
    max_windows: int | None = None,
    anchors_per_forward: int = 64,
    device: str = "cpu",
    progress: bool = False,
) -> HeadEval:
    """alpha-1 .. alpha-(m+1) on the assistant tokens of ``data`` (teacher-forced);
    ``progress`` shows a bar over the windows."""
    m = head.config.draft_length
    rows = m + 1
    head = head.eval()
    dtype = head.fc.weight.dtype
    full_vocab = torch.arange(target.get_input_embeddings().weight.shape[0], device=device)
    d2t = head.draft_to_target.to(device)
    correct = np.zeros(rows)
    total = np.zeros(rows)
    chain_ok = np.zeros(rows)
    chain_n = np.zeros(rows)
    n_windows = min(len(data), max_windows) if max_windows else len(data)
    tokens = 0
    for w in tqdm(range(n_windows), desc="eval windows", unit="win", disable=not progress):
        ids_np, mask_np = data[w]
        length = len(ids_np)
        if length < 3:
            continue
        tokens += length
        ids = torch.from_numpy(ids_np.astype(np.int64))[None].to(device)
        tgt = target_outputs(target, ids, torch.ones_like(ids), full_vocab)
        greedy = tgt.logits[0].argmax(-1)  # greedy[p] = the target's token for position p+1
        n_real = length - 1
        taps = tgt.taps[:, :n_real].to(dtype)
        emb = tgt.embeds[:, 1 : n_real + 1].to(dtype)
        # hits[a, j]: row j at anchor a right; valid[a, j]: its token is an assistant token.
        hits = torch.zeros(n_real, rows, dtype=torch.bool)
        valid = torch.zeros(n_real, rows, dtype=torch.bool)
        for lo in range(0, n_real, anchors_per_forward):
            anchors = list(range(lo, min(n_real, lo + anchors_per_forward)))
            mask4d, positions, _ = batch_layout([n_real], [anchors], m, dtype)
            logits = head_forward_layout(
                head, taps, emb, len(anchors) * m, mask4d.to(device), positions.to(device)
            )[0]
            top = d2t[logits.argmax(-1)]
            for k, a in enumerate(anchors):
                lines = [a] + [n_real + k * m + i for i in range(m)]
                for j, line in enumerate(lines):
                    pos = a + 2 + j
                    if pos < length and mask_np[pos]:
                        valid[a, j] = True
                        hits[a, j] = bool(top[line] == greedy[a + 1 + j])
        for j in range(rows):
            correct[j] += float(hits[:, j][valid[:, j]].sum())
            total[j] += float(valid[:, j].sum())
            prior = valid[:, j] & hits[:, :j].all(dim=1) & valid[:, :j].all(dim=1)
            chain_ok[j] += float((hits[:, j] & prior).sum())
            chain_n[j] += float(prior.sum())
    alpha = (correct / np.maximum(total, 1)).tolist()
    chain = (chain_ok / np.maximum(chain_n, 1)).tolist()
    return HeadEval(alpha, chain, int(total[0]), n_windows, tokens)


class TopPathTreeBuilder:
    """The simplest tree: the top-1 token of every draft row, one chain. A lower bound on
    what a pruned tree accepts; needs no n-gram model."""

    def build(self, context: np.ndarray, rows: object, budget: int) -> object:
        from dart_client.decoding.verify import Tree

        ids = rows.ids  # type: ignore[attr-defined]
        depth = min(budget, int(ids.shape[0]))
        tokens = [int(context[-1])] + [int(ids[i, 0]) for i in range(depth)]
        return Tree.build(tokens, [-1, *range(depth)])


@dataclass
class TauEval:
    tau: float
    prompts: int
    new_tokens: int
    identical: int
    dart_tokens_per_s: float
    ar_tokens_per_s: float
    tree: str


def generation_tau(
    model: object,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 64,
    tree: str = "chain",
) -> TauEval:
    """tau (mean tokens per target forward) of greedy DART generation over ``prompts``,
    with the speed of both DART and autoregressive decoding and how many outputs match."""
    steps = 0
    accepted = 0
    new = 0
    identical = 0
    dart_s = ar_s = 0.0
    ar_new = 0
    for ids in prompts:
        max_length = len(ids) + max_new_tokens + 1
        dart = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, max_length=max_length)  # type: ignore[attr-defined]
        ar = model.ar_generate(input_ids=ids, max_new_tokens=max_new_tokens, max_length=max_length)  # type: ignore[attr-defined]
        spec = dart.accept_lengths[1:]
        steps += len(spec)
        accepted += sum(spec)
        new += len(dart.tokens)
        ar_new += len(ar.tokens)
        identical += int(dart.tokens == ar.tokens)
        dart_s += dart.elapsed
        ar_s += ar.elapsed
    return TauEval(
        tau=accepted / max(steps, 1),
        prompts=len(prompts),
        new_tokens=new,
        identical=identical,
        dart_tokens_per_s=new / max(dart_s, 1e-9),
        ar_tokens_per_s=ar_new / max(ar_s, 1e-9),
        tree=tree,
    )
