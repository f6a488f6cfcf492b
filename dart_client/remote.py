"""The n-gram model and the pruner served by a ``dart-ngram serve`` daemon, over gRPC.

:func:`connect` returns a :class:`RemoteNGram` with the same methods and results as the
in-process :class:`dart_client.ngram.NGram`; its :meth:`RemoteNGram.pruner` returns a
:class:`RemotePruner` with the same methods as :class:`dart_client.pruner.Pruner`, producing
the same :class:`dart_client.pruner.DraftTree`. Code picks local or remote by configuration::

    ngram = connect("grpc://127.0.0.1:50051", expected_fingerprint=tok_fingerprint)
    pruner = ngram.pruner(PrunerConfig())
    tree = pruner.prune(context, topk_ids, topk_probs)

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
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from dart_client._native import (
    NGramError,
    PrunerError,
    TokenizerMismatchError,
    TokenOutOfVocabError,
)
from dart_client.errors import DartError
from dart_client.proto import ngram_pb2 as pb
from dart_client.proto import ngram_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from dart_client.pruner import DraftTree, PrunerConfig

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
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
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


def _ids(values: Any, what: str) -> np.ndarray:
    """A 1-D array of token ids as uint32, refusing negative or fractional values."""
    arr = np.asarray(_cpu(values))
    if arr.ndim != 1:
        raise RemoteInvalidArgumentError(
            f"{what} has shape {arr.shape}; expected a 1-D sequence of token ids"
        )
    if arr.size and arr.dtype.kind not in "iu":
        raise RemoteInvalidArgumentError(f"{what} has dtype {arr.dtype}; expected integer ids")
    if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise RemoteInvalidArgumentError(
            f"{what} holds the negative id {int(arr.min())}; expected ids >= 0"
        )
    if arr.size and int(arr.max()) > 0xFFFFFFFF:
        # The daemon reports the vocabulary bound; only values that do not fit the wire
        # format are caught here.
        raise RemoteInvalidArgumentError(
            f"{what} holds the id {int(arr.max())}, beyond 2**32 - 1; expected vocabulary ids"
        )
    return arr.astype(np.uint32, copy=False)


def _cpu(values: Any) -> Any:
    """Torch tensors (on any device) to numpy; anything else unchanged."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        return values.detach().cpu().numpy()
    return values


def _rows(rows: Any, what: str) -> pb.TokenRows:
    """Token rows (a 2-D array or a list of 1-D sequences) as the wire's ragged form."""
    rows = _cpu(rows)
    if isinstance(rows, np.ndarray):
        if rows.ndim != 2:
            raise RemoteInvalidArgumentError(
                f"{what} has shape {rows.shape}; expected 2-D (rows, tokens)"
            )
        flat = _ids(rows.reshape(-1), what)
        return pb.TokenRows(tokens=flat.tolist(), lengths=[rows.shape[1]] * rows.shape[0])
    out = pb.TokenRows()
    for i, row in enumerate(rows):
        ids = _ids(row, f"{what}[{i}]")
        out.tokens.extend(ids.tolist())
        out.lengths.append(len(ids))
    return out


class RemoteNGram:
    """An n-gram model served by a daemon; the same interface as ``NGram``.

    Use :func:`connect` to make one. Thread-safe: one instance (one HTTP/2 connection) can
    serve many threads at once.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        retry: RetryPolicy | None = None,
        expected_fingerprint: str | bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout = {timeout!r}; expected a number of seconds > 0")
        self.url = url
        self.timeout = float(timeout)
        self.retry = retry or RetryPolicy()
        target, secure = _parse_url(url)
        opts = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            # This client retries by itself (bounded, classified); no hidden second layer.
            ("grpc.enable_retries", 0),
            *options,
        ]
        if secure:
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(), opts)
        else:
            self._channel = grpc.insecure_channel(target, opts)
        self._stub = pb_grpc.NGramServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            _HEALTH_CHECK,
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response,
        )
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise DaemonUnavailableError(
                f"no n-gram daemon answers at {url} within {self.timeout:g} s: is "
                "`dart-ngram serve` running there?",
                grpc.StatusCode.UNAVAILABLE,
            ) from None
        info = self._call("Info", self._stub.Info, pb.InfoRequest())
        self._order = int(info.order)
        self._vocab_size = int(info.vocab_size)
        self._fingerprint = bytes(info.tokenizer_fingerprint).hex()
        self._eos_id = int(info.eos_id) if info.HasField("eos_id") else None
        self._info: dict[str, Any] = json.loads(info.info_json) if info.info_json else {}
        self.server_version = info.server_version
        if expected_fingerprint is not None:
            self.check_fingerprint(expected_fingerprint)

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, name: str, method: Callable[..., T], request: Any) -> T:
        policy = self.retry
        for attempt in range(policy.attempts):
            try:
                return method(request, timeout=self.timeout)
            except grpc.RpcError as err:
                code = err.code()
                details = err.details() or ""
                transient = code == grpc.StatusCode.UNAVAILABLE or (
                    code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in details
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
        self._channel.close()

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
            return self._health(SERVICE_NAME.encode(), timeout=self.timeout) == 1
        except grpc.RpcError:
            return False

    def prob(self, context: Any, candidates: Any) -> tuple[np.ndarray, np.ndarray]:
        """``P(c | context)`` for each candidate: ``(probs float32, matched uint8)``."""
        ctx = _ids(context, "context")
        cands = _ids(candidates, "candidates")
        req = pb.ProbRequest(
            contexts=pb.TokenRows(tokens=ctx.tolist(), lengths=[len(ctx)]),
            candidates=pb.TokenRows(tokens=cands.tolist(), lengths=[len(cands)]),
        )
        resp = self._call("Prob", self._stub.Prob, req)
        return (
            np.asarray(resp.probs, dtype=np.float32),
            np.frombuffer(resp.matched, dtype=np.uint8).copy(),
        )

    def prob_batch(self, contexts: Any, candidates: Any) -> tuple[np.ndarray, np.ndarray]:
        """One context per row, one candidate row per context: ``(probs, matched)`` of the
        candidates' shape (2-D arrays in, 2-D arrays out)."""
        cands = np.asarray(_cpu(candidates))
        ctx_rows = _rows(contexts, "contexts")
        cand_rows = _rows(cands, "candidates")
        req = pb.ProbRequest(contexts=ctx_rows, candidates=cand_rows)
        resp = self._call("Prob", self._stub.Prob, req)
        probs = np.asarray(resp.probs, dtype=np.float32)
        matched = np.frombuffer(resp.matched, dtype=np.uint8).copy()
        return probs.reshape(cands.shape), matched.reshape(cands.shape)

    def count(self, tokens: Any) -> int:
        """How often the token sequence was seen (an empty one: all tokens)."""
        ids = _ids(tokens, "tokens")
        req = pb.CountRequest(sequences=pb.TokenRows(tokens=ids.tolist(), lengths=[len(ids)]))
        return int(self._call("Count", self._stub.Count, req).counts[0])

    def top_k(self, context: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most probable next tokens: ``(ids, probs float32)``, by probability
        descending then id ascending (fewer when fewer continuations were seen)."""
        ctx = _ids(context, "context")
        req = pb.TopKRequest(
            contexts=pb.TokenRows(tokens=ctx.tolist(), lengths=[len(ctx)]), k=_k(k)
        )
        resp = self._call("TopK", self._stub.TopK, req)
        return (
            np.asarray(resp.ids, dtype=np.int64),
            np.asarray(resp.probs, dtype=np.float32),
        )

    def top_k_batch(self, contexts: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`top_k` per row: ``(ids (B, k) int64, probs (B, k) float32)``, rows with
        fewer continuations padded with id -1 and probability 0."""
        req = pb.TopKRequest(contexts=_rows(contexts, "contexts"), k=_k(k))
        resp = self._call("TopK", self._stub.TopK, req)
        n = len(resp.lengths)
        ids = np.full((n, k), -1, dtype=np.int64)
        probs = np.zeros((n, k), dtype=np.float32)
        flat_ids = np.asarray(resp.ids, dtype=np.int64)
        flat_probs = np.asarray(resp.probs, dtype=np.float32)
        at = 0
        for i, length in enumerate(resp.lengths):
            ids[i, :length] = flat_ids[at : at + length]
            probs[i, :length] = flat_probs[at : at + length]
            at += length
        return ids, probs

    def pruner(self, config: PrunerConfig | None = None) -> RemotePruner:
        """A pruner that runs on the daemon, over this model."""
        return RemotePruner(self, config)


def _k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise RemoteInvalidArgumentError(f"k = {k!r}; expected an integer >= 0")
    return int(k)


def _encode_health_request(service: bytes) -> bytes:
    # grpc.health.v1.HealthCheckRequest { string service = 1; } by hand: one short field
    # (names are far below 128 bytes, so the length is one varint byte).
    if len(service) >= 128:
        raise ValueError("health service name too long")
    return b"\x0a" + bytes([len(service)]) + service if service else b""


def _decode_health_response(data: bytes) -> int:
    # HealthCheckResponse { ServingStatus status = 1; }: absent field = 0 (UNKNOWN).
    if len(data) >= 2 and data[0] == 0x08:
        return data[1]
    return 0


def _config_proto(config: PrunerConfig) -> pb.PrunerConfig:
    out = pb.PrunerConfig()
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if value is None:
            continue  # absent = the daemon's default (for eos_id: the model's EOS)
        if not hasattr(out, f.name):
            raise ValueError(
                f"PrunerConfig.{f.name} is not part of the daemon's protocol; update "
                "proto/dart/ngram/v1/ngram.proto"
            )
        setattr(out, f.name, value)
    return out


def _draft(context: Any, topk_ids: Any, topk_probs: Any, budget: int | None, tail: int) -> pb.Draft:
    ctx = _ids(context, "context")
    # The pruner reads only the n-gram history and the root: send no more.
    ctx = ctx[-tail:]
    ids = np.asarray(_cpu(topk_ids))
    probs = np.asarray(_cpu(topk_probs))
    if ids.ndim != 2 or probs.shape != ids.shape:
        raise RemoteInvalidArgumentError(
            f"topk_ids has shape {ids.shape} and topk_probs {probs.shape}; expected the same "
            "2-D shape (levels, k)"
        )
    draft = pb.Draft(
        context=ctx.tolist(),
        topk_ids=_ids(ids.reshape(-1), "topk_ids").tolist(),
        topk_probs=probs.astype(np.float32, copy=False).reshape(-1).tolist(),
        levels=ids.shape[0],
        k=ids.shape[1],
    )
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise RemoteInvalidArgumentError(f"budget = {budget!r}; expected an integer >= 1")
        draft.budget = int(budget)
    return draft


class RemotePruner:
    """The draft-tree pruner run by the daemon; the same interface as ``Pruner``."""

    def __init__(self, ngram: RemoteNGram, config: PrunerConfig | None = None) -> None:
        from dart_client.pruner import PrunerConfig

        self.ngram = ngram
        self.config = config if config is not None else PrunerConfig()
        self._config_pb = _config_proto(self.config)
        self._tail = max(ngram.order - 1, 1)

    def __repr__(self) -> str:
        return f"RemotePruner(url={self.ngram.url!r}, config={self.config!r})"

    def prune(
        self, context: Any, topk_ids: Any, topk_probs: Any, budget: int | None = None
    ) -> DraftTree:
        """One draft tree (see ``Pruner.prune``)."""
        req = pb.PruneRequest(
            draft=_draft(context, topk_ids, topk_probs, budget, self._tail), config=self._config_pb
        )
        resp = self.ngram._call("Prune", self.ngram._stub.Prune, req)
        return _tree(resp.tree)

    def prune_batch(
        self,
        contexts: Any,
        topk_ids: Any,
        topk_probs: Any,
        budgets: Sequence[int | None] | None = None,
    ) -> list[DraftTree]:
        """Many trees in one call (see ``Pruner.prune_batch``): ``topk_ids``/``topk_probs``
        are (B, L, k), ``contexts`` B sequences, ``budgets`` B values or None."""
        ids = np.asarray(_cpu(topk_ids))
        probs = np.asarray(_cpu(topk_probs))
        if ids.ndim != 3 or probs.shape != ids.shape:
            raise RemoteInvalidArgumentError(
                f"topk_ids has shape {ids.shape} and topk_probs {probs.shape}; expected the "
                "same 3-D shape (batch, levels, k)"
            )
        contexts = list(_cpu(contexts))
        if len(contexts) != ids.shape[0]:
            raise RemoteInvalidArgumentError(
                f"{len(contexts)} contexts for a batch of {ids.shape[0]} drafts; expected one "
                "context per draft"
            )
        if budgets is not None and len(budgets) != ids.shape[0]:
            raise RemoteInvalidArgumentError(
                f"{len(budgets)} budgets for a batch of {ids.shape[0]} drafts; expected one "
                "per draft (or budgets=None)"
            )
        req = pb.PruneBatchRequest(config=self._config_pb)
        for i in range(ids.shape[0]):
            budget = None if budgets is None else budgets[i]
            req.drafts.append(_draft(contexts[i], ids[i], probs[i], budget, self._tail))
        resp = self.ngram._call("PruneBatch", self.ngram._stub.PruneBatch, req)
        return [_tree(t) for t in resp.trees]


def _tree(t: pb.DraftTree) -> DraftTree:
    """The wire tree as the in-process ``DraftTree`` (same dtypes and shapes)."""
    from dart_client.pruner import DraftTree

    n = len(t.tokens)
    return DraftTree(
        tokens=np.asarray(t.tokens, dtype=np.int64),
        parents=np.asarray(t.parents, dtype=np.int64),
        depths=np.asarray(t.depths, dtype=np.int64),
        attention_mask=np.frombuffer(t.attention_mask, dtype=np.uint8)
        .astype(np.bool_)
        .reshape(n, n),
        retrieve_indices=np.asarray(t.retrieve_indices, dtype=np.int64).reshape(
            t.retrieve_rows, t.retrieve_cols
        ),
        scores=np.asarray(t.scores, dtype=np.float64),
    )


def connect(
    url: str,
    *,
    timeout: float = 5.0,
    expected_fingerprint: str | bytes | None = None,
    retry: RetryPolicy | None = None,
) -> RemoteNGram:
    """Connects to a ``dart-ngram serve`` daemon at ``url`` (``grpc://host:port``, or
    ``grpcs://`` through a TLS proxy).

    Raises :class:`DaemonUnavailableError` when nothing answers within ``timeout`` seconds, and
    :class:`RemoteTokenizerMismatchError` when ``expected_fingerprint`` (hex or 32 bytes: the
    fingerprint of the tokenizer in use) differs from the served model's.
    """
    return RemoteNGram(url, timeout=timeout, retry=retry, expected_fingerprint=expected_fingerprint)
