"""The Python exception family of dart_client.

Every error a user can cause derives from :class:`DartError`; the native module's n-gram
errors (``dart_client.ngram.NGramError``) are a separate family, raised by the Rust core.
Errors that are also a classic Python category (a bad value, a bad type, an unknown key)
derive from that builtin too, so ``except ValueError`` keeps working for callers who expect it.
"""


class DartError(Exception):
    """Base of every dart_client error."""


class MissingResourceError(DartError):
    """A model, corpus or package the requested job needs is not installed or not found."""


class InvalidArgumentError(DartError, ValueError):
    """An argument has the wrong value (a negative temperature, top_p outside (0, 1], ...)."""


class InvalidTypeError(DartError, TypeError):
    """An argument has the wrong type (a prompt that is not a string, ids that are floats, ...)."""


class EmptyPromptError(InvalidArgumentError):
    """The prompt tokenizes to zero tokens: there is nothing to condition generation on."""


class ContextTooLongError(InvalidArgumentError):
    """The prompt (plus at least one new token) does not fit ``max_length``."""


class IncompatibleHeadError(DartError, ValueError):
    """A DART head does not fit its target (hidden size, head_dim, vocabulary, ...)."""


class CheckpointError(DartError, ValueError):
    """A head checkpoint is malformed: missing or unexpected keys, wrong shapes, bad config."""


class UnsupportedTargetError(DartError, ValueError):
    """The target model's architecture cannot be driven by DART (too few layers, no decoder)."""


class UnknownTemplateError(DartError, KeyError):
    """A chat template name that the registry does not know."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class IncompatibleNGramError(DartError, ValueError):
    """An n-gram model was built for another tokenizer than the target's (fingerprint or
    vocabulary differ)."""
