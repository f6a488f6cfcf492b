"""The draft vocabulary: the most frequent target tokens of the training data.

Draft ids are assigned in increasing target-id order, so ``d2t[i] = target_id(i) - i`` is
non-decreasing and ``target_id = draft_id + d2t[draft_id]`` as in the published layout;
``t2d[target_id]`` is true for target ids in the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from dart_client.errors import DartError


class DraftVocabError(DartError):
    """A draft vocabulary that cannot be built as asked."""


def token_counts(sequences: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """Frequencies of the target tokens (tokens under the loss mask) over all sequences."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in sequences:
        targets = ids[mask]
        if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
            raise DraftVocabError(
                f"token id {int(targets.max())} outside the target vocabulary of {vocab_size}"
            )
        counts += np.bincount(targets, minlength=vocab_size)
    return counts


def build_draft_vocab(
    counts: np.ndarray, draft_vocab_size: int, always: Iterable[int] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(draft_to_target_ids, d2t, t2d)`` for the ``draft_vocab_size`` most frequent ids.

    ``always`` (e.g. the EOS id) is included whatever its count; ties break toward the lower
    id so the result is deterministic. Ids never seen fill the tail by id order.
    """
    vocab_size = len(counts)
    if not 0 < draft_vocab_size <= vocab_size:
        raise DraftVocabError(
            f"draft vocabulary size {draft_vocab_size}; expected 1..{vocab_size} "
            "(the target's vocabulary size)"
        )
    forced = sorted({int(t) for t in always})
    for t in forced:
        if not 0 <= t < vocab_size:
            raise DraftVocabError(f"forced token id {t} outside the vocabulary of {vocab_size}")
    if len(forced) > draft_vocab_size:
        raise DraftVocabError(f"{len(forced)} forced ids exceed the draft size {draft_vocab_size}")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = np.argsort(-counts, kind="stable")
    chosen = list(forced)
    taken = set(forced)
    for t in order:
        if len(chosen) == draft_vocab_size:
            break
        if int(t) not in taken:
            chosen.append(int(t))
            taken.add(int(t))
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d


def coverage(counts: np.ndarray, ids: torch.Tensor) -> float:
    """Share of target-token occurrences the draft vocabulary covers."""
    total = counts.sum()
    return float(counts[ids.numpy()].sum() / total) if total else 0.0
