"""The n-gram layer: the model (``NGram``, in process or served by ``dart-ngram serve``), the
draft-tree pruner over it, building models, and the local daemon helper.

The lowest layer of ``dart_client`` above ``errors`` and the native module: nothing here
imports the decoding loop, the target/head models or the applications.
"""

from dart_client.ngram.model import (
    CorruptModelError,
    NGram,
    NGramError,
    TokenizerMismatchError,
    TokenOutOfVocabError,
)
from dart_client.ngram.pruner import DraftTree, Pruner, PrunerConfig, PrunerError
from dart_client.ngram.remote import (
    DaemonError,
    DaemonOverloadedError,
    DaemonUnavailableError,
    RemoteNGram,
    RemotePruner,
    RetryPolicy,
    connect,
)

__all__ = [
    "CorruptModelError",
    "DaemonError",
    "DaemonOverloadedError",
    "DaemonUnavailableError",
    "DraftTree",
    "NGram",
    "NGramError",
    "Pruner",
    "PrunerConfig",
    "PrunerError",
    "RemoteNGram",
    "RemotePruner",
    "RetryPolicy",
    "TokenOutOfVocabError",
    "TokenizerMismatchError",
    "connect",
]
