"""The Python exception family of dart_client.

Every error a user can cause derives from :class:`DartError`; the native module's n-gram
errors (``dart_client.ngram.NGramError``) are a separate family, raised by the Rust core.
"""


class DartError(Exception):
    """Base of every dart_client error."""


class MissingResourceError(DartError):
    """A model, corpus or package the requested job needs is not installed or not found."""
