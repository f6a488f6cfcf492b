"""Training DART heads: data, prefix-shared masks, the annealed KL loss, the loop.

``dart-train`` (:mod:`dart_client.apps.train`) runs it from the command line, under
``torchrun`` unchanged; ``dart-eval-head`` measures a head; ``dart-regenerate`` rewrites a
corpus's answers with the target itself.
"""

from dart_client.train.data import TrainingSet, build_training_set, cached_training_set
from dart_client.train.eval import HeadEval, evaluate_head, generation_tau
from dart_client.train.loss import annealed_kl
from dart_client.train.masks import batch_layout, prefix_shared_layout
from dart_client.train.trainer import TrainConfig, Trainer, TrainError
from dart_client.train.vocab import build_draft_vocab, token_counts

__all__ = [
    "HeadEval",
    "TrainConfig",
    "TrainError",
    "Trainer",
    "TrainingSet",
    "annealed_kl",
    "batch_layout",
    "build_draft_vocab",
    "build_training_set",
    "cached_training_set",
    "evaluate_head",
    "generation_tau",
    "prefix_shared_layout",
    "token_counts",
]
