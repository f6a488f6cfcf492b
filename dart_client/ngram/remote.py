"""The n-gram model and the pruner served by a ``dart-ngram serve`` daemon, over gRPC.

:func:`connect` returns a :class:`RemoteNGram` with the same methods and results as the
in-process :class:`dart_client.ngram.NGram`; its :meth:`RemoteNGram.pruner` returns a
:class:`RemotePruner` with the same methods as :class:`dart_client.ngram.pruner.Pruner`, producing
the same :class:`dart_client.ngram.pruner.DraftTree`. Code picks local or remote by configuration::

    ngram = connect("grpc://127.0.0.1:50051", expected_fingerprint=tok_fingerprint)
    pruner = ngram.pruner(PrunerConfig())
    tree = pruner.prune(context, topk_ids, topk_probs)

The transport is native (``dart_client._native.DaemonClient``, Rust and tonic): messages are
built from numpy arrays and the call runs with the GIL released, so a prune over loopback costs
little more than the prune (grpcio's Python call alone costs about as much as a prune). This
module validates inputs, classifies failures, retries and raises its exception family.

Every call has a deadline (``timeout``); calls that fail with a transient status (UNAVAILABLE:
the daemon restarts or drains; RESOURCE_EXHAUSTED because it is saturated) are retried a
bounded number of times with exponential backoff and jitter. Errors keep the in-process
exception types where there is one (an out-of-vocabulary id is a ``ValueError`` either way).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from dart_client import _native
from dart_client._native import (
    DaemonStatusError,
    NGramError,
    PrunerError,
    TokenizerMismatchError,
    TokenOutOfVocabError,
)
from dart_client.errors import DartError
from dart_client.ngram import inputs

if TYPE_CHECKING:
    from dart_client.ngram.pruner import DraftTree, PrunerConfig

__all__ = [
    "DaemonError",
    "DaemonOverloadedError",
    "DaemonUnavailableError",
    "RemoteInvalidArgumentError",
    "RemoteNGram",
    "RemotePruner",
    "RemoteTokenOutOfVocabError",
    "RemoteTokenizerMismatchError",
    "RetryPolicy",
    "connect",
]

SERVICE_NAME = "dart.ngram.v1.NGramService"
# grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING
_SERVING = 1
# The native client reports status codes as the protocol's numbers.
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
T = TypeVar("T")


class DaemonError(DartError):
    """A call to the n-gram daemon failed. ``code`` is the gRPC status code (if any)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class DaemonUnavailableError(DaemonError, ConnectionError):
    """No daemon answers at the address (not running, wrong port, or still starting)."""


class DaemonOverloadedError(DaemonError):
    """The daemon refused the call: too many in flight, or the request is too large."""


class RemoteInvalidArgumentError(DaemonError, NGramError, PrunerError):
    """The daemon refused the arguments (bad shape, bad probability, bad configuration); the
    message is the model's or pruner's own. A ``ValueError``, and an ``NGramError`` and a
    ``PrunerError`` like the in-process errors, so the same ``except`` clauses work."""


class RemoteTokenOutOfVocabError(RemoteInvalidArgumentError, TokenOutOfVocabError):
    """A token id outside the served model's vocabulary (also a ``TokenOutOfVocabError``)."""


class RemoteTokenizerMismatchError(DaemonError, TokenizerMismatchError):
    """The daemon serves a model built with another tokenizer than the expected one (also a
    ``TokenizerMismatchError``)."""


#: Seconds a call polls for its answer before its thread sleeps; by default none. Waking a
#: sleeping thread costs tens of microseconds on a virtual machine whose idle CPUs halt, so a
#: client with a CPU to itself may pass ``spin=0.002`` (2 ms covers a prune) and save a
#: wake-up per call. Not when clients outnumber the idle CPUs: polling yields the CPU between
#: polls, but it still takes CPU time from the daemon (measurements:
#: ``docs/performance-notes.md``).
DEFAULT_SPIN = 0.0


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries of transient failures: ``attempts`` tries in all, sleeping
    ``backoff * 2**i`` (at most ``max_backoff``, with +-50% jitter) between them."""

    attempts: int = 4
    backoff: float = 0.05
    max_backoff: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts = {self.attempts}; expected at least 1")
        if not (self.backoff >= 0 and self.max_backoff >= 0):
            raise ValueError(
                f"RetryPolicy backoff = {self.backoff}, max_backoff = {self.max_backoff}; "
                "expected numbers >= 0"
            )


def _parse_url(url: str) -> tuple[str, bool]:
    """``grpc://host:port`` (plaintext), ``grpcs://host:port`` (TLS) or ``host:port``."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"daemon url {url!r}: expected 'grpc://host:port'")
    secure = False
    target = url
    if "://" in url:
        scheme, target = url.split("://", 1)
        if scheme not in ("grpc", "grpcs"):
            raise ValueError(
                f"daemon url {url!r}: unknown scheme {scheme!r}; expected grpc:// or grpcs://"
            )
        secure = scheme == "grpcs"
    target = target.rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"daemon url {url!r}: expected host:port with a port in 1..65535")
    return target, secure


def _fingerprint_hex(value: str | bytes) -> str:
    if isinstance(value, bytes):
        return value.hex()
    text = value.lower().removeprefix("0x")
    try:
        bytes.fromhex(text)
    except ValueError as err:
        raise ValueError(
            f"expected_fingerprint {value!r}: expected 64 hex digits or 32 bytes"
        ) from err
    return text


_cpu = inputs.as_numpy


def _ids(values: Any, what: str, ndim: int = 1) -> np.ndarray:
    """Token ids as int64 (the native client checks that each fits the wire and names the one
    that does not; the daemon checks the vocabulary)."""
    return inputs.ids(values, ndim, what, RemoteInvalidArgumentError, RemoteTokenOutOfVocabError)


def _probs(values: Any, what: str, ndim: int) -> np.ndarray:
    return inputs.probs(values, ndim, what, RemoteInvalidArgumentError)


def _rows(rows: Any, what: str) -> tuple[np.ndarray, list[int]]:
    """Token rows (a 2-D array or a list of 1-D sequences) as the wire's ragged form: the
    flat ids and the length of each row."""
    rows = _cpu(rows)
    if isinstance(rows, np.ndarray):
        flat = _ids(rows, what, ndim=2)
        return flat.reshape(-1), [flat.shape[1]] * flat.shape[0]
    parts = [_ids(row, f"{what}[{i}]") for i, row in enumerate(rows)]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return flat, [len(p) for p in parts]


class RemoteNGram:
    """An n-gram model served by a daemon; the same interface as ``NGram``.

    Use :func:`connect` to make one. Thread-safe: one instance (one HTTP/2 connection) can
    serve many threads at once. Not to be shared across ``fork``: connect in each process.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        expected_fingerprint: str | bytes | None = None,
        spin: float = DEFAULT_SPIN,
    ) -> None:
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout = {timeout!r}; expected a number of seconds > 0")
        if isinstance(spin, bool) or not (isinstance(spin, (int, float)) and 0 <= spin <= 1):
            raise ValueError(f"spin = {spin!r}; expected seconds, 0 <= spin <= 1")
        self.url = url
        self.timeout = float(timeout)
        self.spin = float(spin)
        self.retry = retry or RetryPolicy()
        target, secure = _parse_url(url)
        try:
            self._client = _native.DaemonClient(
                target, tls=secure, timeout=self.timeout, spin=self.spin
            )
        except DaemonStatusError as err:
            raise DaemonUnavailableError(
                f"no n-gram daemon answers at {url} within {self.timeout:g} s ({err.args[1]}): "
                "is `dart-ngram serve` running there?",
                grpc.StatusCode.UNAVAILABLE,
            ) from None
        info = self._call("Info", self._client.info)
        order, vocab_size, fingerprint, eos_id, _total, info_json, version = info
        self._order = int(order)
        self._vocab_size = int(vocab_size)
        self._fingerprint = bytes(fingerprint).hex()
        self._eos_id = None if eos_id is None else int(eos_id)
        self._info: dict[str, Any] = json.loads(info_json) if info_json else {}
        self.server_version = version
        if expected_fingerprint is not None:
            self.check_fingerprint(expected_fingerprint)

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, name: str, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``method(*args, timeout, **kwargs)`` with bounded retries of transient failures."""
        policy = self.retry
        for attempt in range(policy.attempts):
            try:
                return method(*args, self.timeout, **kwargs)
            except DaemonStatusError as err:
                code = _STATUS.get(err.args[0], grpc.StatusCode.UNKNOWN)
                details = str(err.args[1])
                # Every daemon method is a pure read, so a call lost with its connection (a
                # daemon draining or closing an idle connection: UNAVAILABLE, or tonic's
                # UNKNOWN "transport error") is safe to send again.
                transient = (
                    code == grpc.StatusCode.UNAVAILABLE
                    or (code == grpc.StatusCode.UNKNOWN and "transport error" in details)
                    or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in details)
                )
                if transient and attempt + 1 < policy.attempts:
                    delay = min(policy.max_backoff, policy.backoff * 2**attempt)
                    time.sleep(delay * random.uniform(0.5, 1.5))
                    continue
                raise self._error(name, code, details, attempt + 1) from None
        raise AssertionError("unreachable: the retry loop returns or raises")

    def _error(self, name: str, code: grpc.StatusCode, details: str, attempts: int) -> DaemonError:
        where = f"{name} on the n-gram daemon at {self.url}"
        if code == grpc.StatusCode.UNAVAILABLE:
            return DaemonUnavailableError(
                f"{where}: unavailable after {attempts} attempt(s): {details} (is `dart-ngram "
                "serve` running?)",
                code,
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DaemonUnavailableError(
                f"{where}: no answer within {self.timeout:g} s (timeout=)", code
            )
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            if "outside the vocabulary" in details:
                return RemoteTokenOutOfVocabError(details, code)
            return RemoteInvalidArgumentError(details, code)
        if code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer" in details:
            return RemoteTokenizerMismatchError(details, code)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return DaemonOverloadedError(f"{where}: {details}", code)
        return DaemonError(f"{where} failed with {code.name}: {details}", code)

    def close(self) -> None:
        """Closes the connection; further calls fail."""
        self._client.close()

    def __enter__(self) -> RemoteNGram:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RemoteNGram(url={self.url!r}, order={self._order}, vocab_size={self._vocab_size}, "
            f"fingerprint={self._fingerprint[:16]}...)"
        )

    # -- the NGram interface ----------------------------------------------------------------

    @property
    def order(self) -> int:
        return self._order

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def fingerprint(self) -> str:
        """The tokenizer fingerprint of the served model, as hex."""
        return self._fingerprint

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def path(self) -> str:
        """Where the daemon's model lies (on the daemon's host)."""
        return str(self._info.get("path", self.url))

    def info(self) -> dict[str, Any]:
        """The served model's ``info`` record (what ``NGram.info()`` returns in process)."""
        return dict(self._info)

    def check_fingerprint(self, expected: str | bytes) -> None:
        """Raises :class:`RemoteTokenizerMismatchError` unless the model was built with the
        tokenizer whose fingerprint is ``expected``."""
        want = _fingerprint_hex(expected)
        if want != self._fingerprint:
            raise RemoteTokenizerMismatchError(
                f"the n-gram daemon at {self.url} serves a model built with tokenizer "
                f"{self._fingerprint}, expected {want}: point the client at a daemon whose "
                "model was built with this tokenizer",
                grpc.StatusCode.FAILED_PRECONDITION,
            )

    def health(self) -> bool:
        """Whether the daemon reports itself SERVING (standard gRPC health check)."""
        try:
            return self._client.health(SERVICE_NAME, self.timeout) == _SERVING
        except DaemonStatusError:
            return False

    def prob(self, context: Any, candidates: Any) -> tuple[np.ndarray, np.ndarray]:
        """``P(c | context)`` for each candidate: ``(probs float32, matched uint8)``."""
        ctx = _ids(context, "context")
        cands = _ids(candidates, "candidates")
        return self._call("Prob", self._client.prob, ctx, [len(ctx)], cands, [len(cands)])

    def prob_batch(self, contexts: Any, candidates: Any) -> tuple[np.ndarray, np.ndarray]:
        """One context per row, one candidate row per context: ``(probs, matched)`` of the
        candidates' shape (2-D arrays in, 2-D arrays out)."""
        cands = _ids(candidates, "candidates", ndim=2)
        ctx, ctx_lengths = _rows(contexts, "contexts")
        probs, matched = self._call(
            "Prob",
            self._client.prob,
            ctx,
            ctx_lengths,
            cands.reshape(-1),
            [cands.shape[1]] * cands.shape[0],
        )
        return probs.reshape(cands.shape), matched.reshape(cands.shape)

    def count(self, tokens: Any) -> int:
        """How often the token sequence was seen (an empty one: all tokens)."""
        ids = _ids(tokens, "tokens")
        return int(self._call("Count", self._client.count, ids, [len(ids)])[0])

    def top_k(self, context: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most probable next tokens: ``(ids, probs float32)``, by probability
        descending then id ascending (fewer when fewer continuations were seen)."""
        ctx = _ids(context, "context")
        ids, probs, _ = self._call("TopK", self._client.top_k, ctx, [len(ctx)], _k(k))
        return ids, probs

    def top_k_batch(self, contexts: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`top_k` per row: ``(ids (B, k) int64, probs (B, k) float32)``, rows with
        fewer continuations padded with id -1 and probability 0."""
        ctx, lengths = _rows(contexts, "contexts")
        flat_ids, flat_probs, got = self._call("TopK", self._client.top_k, ctx, lengths, _k(k))
        n = len(got)
        ids = np.full((n, k), -1, dtype=np.int64)
        probs = np.zeros((n, k), dtype=np.float32)
        # Row i's entries fill its first got[i] columns.
        filled = np.arange(k) < got[:, None]
        ids[filled] = flat_ids
        probs[filled] = flat_probs
        return ids, probs

    def pruner(self, config: PrunerConfig | None = None) -> RemotePruner:
        """A pruner that runs on the daemon, over this model."""
        return RemotePruner(self, config)


def _k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < 2**32:
        raise RemoteInvalidArgumentError(f"k = {k!r}; expected an integer >= 0")
    return int(k)


def _per_draft(
    values: Sequence[Any] | None, name: str, batch: int, convert: Callable[[Any, str], T]
) -> list[T] | None:
    """One converted value per draft of a batch (None: none given)."""
    if values is None:
        return None
    if len(values) != batch:
        raise RemoteInvalidArgumentError(
            f"{len(values)} {name} for a batch of {batch} drafts; expected one per draft "
            f"(or {name}=None)"
        )
    return [convert(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _path(path: Any, what: str) -> np.ndarray | None:
    return inputs.lookup_path(path, what, RemoteInvalidArgumentError, RemoteTokenOutOfVocabError)


def _budget(budget: Any, what: str) -> int | None:
    return inputs.budget(budget, what, RemoteInvalidArgumentError, maximum=2**32 - 1)


def _wire_config(config: PrunerConfig) -> _native.DaemonPrunerConfig:
    """The configuration as the daemon's overrides (every field; ``eos_id=None``: the model's
    EOS), deserialized natively into the pruner's own configuration type first."""
    try:
        return _native.DaemonPrunerConfig(asdict(config))  # type: ignore[call-overload]
    except PrunerError as err:
        raise RemoteInvalidArgumentError(f"{config!r}: {err}") from None


class RemotePruner:
    """The draft-tree pruner run by the daemon; the same interface as ``Pruner``."""

    def __init__(self, ngram: RemoteNGram, config: PrunerConfig | None = None) -> None:
        from dart_client.ngram.pruner import PrunerConfig

        self.ngram = ngram
        self.config = config if config is not None else PrunerConfig()
        self._wire = _wire_config(self.config)
        # The pruner reads only the n-gram history and the root: send no more.
        self._tail = max(ngram.order - 1, 1)

    def __repr__(self) -> str:
        return f"RemotePruner(url={self.ngram.url!r}, config={self.config!r})"

    def _context(self, context: Any, what: str) -> np.ndarray:
        c = _cpu(context)
        if not isinstance(c, (list, tuple, np.ndarray)):
            c = list(c)
        return _ids(c[-self._tail :], what)

    def prune(
        self,
        context: Any,
        topk_ids: Any,
        topk_probs: Any,
        budget: int | None = None,
        lookup_path: Any = None,
    ) -> DraftTree:
        """One draft tree (see ``Pruner.prune``)."""
        from dart_client.ngram.pruner import DraftTree

        ngram = self.ngram
        out = ngram._call(
            "Prune",
            ngram._client.prune,
            self._wire,
            self._context(context, "context"),
            _ids(topk_ids, "topk_ids", ndim=2),
            _probs(topk_probs, "topk_probs", ndim=2),
            _budget(budget, "budget"),
            lookup_path=_path(lookup_path, "lookup_path"),
        )
        return DraftTree(*out)

    def prune_batch(
        self,
        contexts: Any,
        topk_ids: Any,
        topk_probs: Any,
        budgets: Sequence[int | None] | None = None,
        lookup_paths: Sequence[Any] | None = None,
    ) -> list[DraftTree]:
        """Many trees in one call (see ``Pruner.prune_batch``): ``topk_ids``/``topk_probs``
        are (B, L, k), ``contexts`` B sequences, ``budgets`` B values or None,
        ``lookup_paths`` B paths (or None each) or None."""
        from dart_client.ngram.pruner import DraftTree

        ids = _ids(topk_ids, "topk_ids", ndim=3)
        probs = _probs(topk_probs, "topk_probs", ndim=3)
        if probs.shape != ids.shape:
            raise RemoteInvalidArgumentError(
                f"topk_ids has shape {ids.shape} and topk_probs {probs.shape}; expected the "
                "same 3-D shape (batch, levels, k)"
            )
        ctxs = [self._context(c, f"contexts[{i}]") for i, c in enumerate(_cpu(contexts))]
        if len(ctxs) != ids.shape[0]:
            raise RemoteInvalidArgumentError(
                f"{len(ctxs)} contexts for a batch of {ids.shape[0]} drafts; expected one "
                "context per draft"
            )
        batch = ids.shape[0]
        wire_budgets = _per_draft(budgets, "budgets", batch, _budget)
        wire_paths = _per_draft(lookup_paths, "lookup_paths", batch, _path)
        ngram = self.ngram
        out = ngram._call(
            "PruneBatch",
            ngram._client.prune_batch,
            self._wire,
            ctxs,
            ids,
            probs,
            wire_budgets,
            lookup_paths=wire_paths,
        )
        return [DraftTree(*t) for t in out]


def connect(
    url: str,
    *,
    timeout: float = 5.0,
    expected_fingerprint: str | bytes | None = None,
    retry: RetryPolicy | None = None,
    spin: float = DEFAULT_SPIN,
) -> RemoteNGram:
    """Connects to a ``dart-ngram serve`` daemon at ``url`` (``grpc://host:port``, or
    ``grpcs://`` through a TLS proxy).

    Raises :class:`DaemonUnavailableError` when nothing answers within ``timeout`` seconds, and
    :class:`RemoteTokenizerMismatchError` when ``expected_fingerprint`` (hex or 32 bytes: the
    fingerprint of the tokenizer in use) differs from the served model's.

    ``spin``: seconds a call polls for its answer before its thread sleeps (yielding the CPU
    to any other runnable thread between polls); 0 sleeps at once. See :data:`DEFAULT_SPIN`
    for when polling pays.
    """
    return RemoteNGram(
        url, timeout=timeout, retry=retry, expected_fingerprint=expected_fingerprint, spin=spin
    )
