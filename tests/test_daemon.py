"""The real ``dart-ngram serve`` binary on loopback against the in-process model and pruner.

The model is built by ``dart-ngram build`` from real ShareGPT conversations with the real
SmolLM2 tokenizer. Every loop is bounded; every address is 127.0.0.1.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from _daemon_util import Daemon, dart_ngram_binary, wait_for
from conftest import sharegpt_texts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dart_client import _native
from dart_client.ngram import NGram, TokenizerMismatchError, TokenOutOfVocabError, connect
from dart_client.ngram.remote import (
    DaemonError,
    DaemonOverloadedError,
    DaemonUnavailableError,
    RemoteInvalidArgumentError,
    RemoteNGram,
    RemoteTokenizerMismatchError,
    RetryPolicy,
)

# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Path:
    """A 3-gram model of 400 ShareGPT conversations, tokenized with SmolLM2's tokenizer."""
    tmp = tmp_path_factory.mktemp("daemon-model")
    corpus = tmp / "sharegpt.jsonl"
    with corpus.open("w", encoding="utf-8") as f:
        for text in sharegpt_texts(400):
            f.write(json.dumps({"text": text}) + "\n")
    out = tmp / "sharegpt.ngram"
    subprocess.run(
        [
            str(dart_ngram_binary()),
            "build",
            "--input",
            str(corpus),
            "--tokenizer",
            str(smollm2_tokenizer_dir / "tokenizer.json"),
            "--order",
            "3",
            "--output",
            str(out),
            "--quiet",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


@pytest.fixture(scope="module")
def local(model_path: Path) -> NGram:
    return NGram.open(model_path)


@pytest.fixture(scope="module")
def daemon(model_path: Path) -> Iterator[Daemon]:
    with Daemon(model_path, "--threads", "2") as d:
        yield d
        assert d.alive(), "the shared daemon died during the tests:\n" + "".join(d.lines[-20:])


@pytest.fixture(scope="module")
def remote(daemon: Daemon, local: NGram) -> Iterator[RemoteNGram]:
    with connect(daemon.url, timeout=30, expected_fingerprint=local.fingerprint) as r:
        yield r


def corpus_contexts(local: NGram, rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Contexts that the model has seen (walked through its top continuations) and random
    ones, of 0..5 tokens."""
    out = []
    for i in range(n):
        length = int(rng.integers(0, 6))
        if i % 3 == 0:
            out.append(rng.integers(0, local.vocab_size, size=length))
            continue
        ctx = [int(rng.integers(local.vocab_size))]
        while len(ctx) < length:
            ids, _ = local.top_k(ctx, 5)
            ctx.append(int(ids[0]) if len(ids) else int(rng.integers(local.vocab_size)))
        out.append(np.asarray(ctx[:length], dtype=np.int64))
    return out


def random_draft(
    local: NGram, rng: np.random.Generator, levels: int = 8, k: int = 25
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ctx = corpus_contexts(local, rng, 1)[0]
    if len(ctx) == 0:
        ctx = np.asarray([int(rng.integers(local.vocab_size))])
    ids = np.empty((levels, k), dtype=np.int64)
    walk = list(ctx)
    for level in range(levels):
        top, _ = local.top_k(walk, k)
        row = list(dict.fromkeys(int(t) for t in top))[: k // 2]
        while len(row) < k:
            t = int(rng.integers(local.vocab_size))
            if t not in row:
                row.append(t)
        ids[level] = row
        walk.append(row[0])
    logits = rng.normal(size=(levels, k)) * 2
    if rng.random() < 0.3:
        logits = np.round(logits)  # repeated probabilities: ties in the beam
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return ctx, ids, probs.astype(np.float32)


def assert_same_tree(a: object, b: object) -> None:
    for name in ("tokens", "parents", "depths", "attention_mask", "retrieve_indices", "scores"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


# -- results are identical --------------------------------------------------------------------


def test_info_matches_the_local_model(remote: RemoteNGram, local: NGram) -> None:
    assert remote.order == local.order == 3
    assert remote.vocab_size == local.vocab_size
    assert remote.fingerprint == local.fingerprint
    assert remote.eos_id == local.eos_id
    assert remote.info() == local.info()
    assert remote.health()


def test_queries_match_local_on_many_random_inputs(remote: RemoteNGram, local: NGram) -> None:
    rng = np.random.default_rng(1)
    contexts = corpus_contexts(local, rng, 300)
    for ctx in contexts:
        cands = rng.integers(0, local.vocab_size, size=int(rng.integers(0, 30)))
        top, _ = local.top_k(ctx, 10)
        cands = np.concatenate([cands, top])  # candidates that were seen too
        for got, want in zip(remote.prob(ctx, cands), local.prob(ctx, cands), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        k = int(rng.integers(0, 40))
        for got, want in zip(remote.top_k(ctx, k), local.top_k(ctx, k), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        seq = ctx[-3:]
        assert remote.count(seq) == local.count(seq)
    # Batched forms, as 2-D arrays.
    batch_ctx = rng.integers(0, local.vocab_size, size=(200, 2))
    batch_ctx[::2] = np.stack([np.resize(c, 2) for c in contexts[:100] if len(c)][:1] * 100)
    batch_cands = rng.integers(0, local.vocab_size, size=(200, 25))
    for got, want in zip(
        remote.prob_batch(batch_ctx, batch_cands),
        local.prob_batch(batch_ctx, batch_cands),
        strict=True,
    ):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    for got, want in zip(
        remote.top_k_batch(batch_ctx, 7), local.top_k_batch(batch_ctx, 7), strict=True
    ):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_prob_matches_local_for_any_ids(
    remote: RemoteNGram, local: NGram, data: st.DataObject
) -> None:
    ids = st.integers(0, local.vocab_size - 1)
    ctx = data.draw(st.lists(ids, max_size=6))
    cands = data.draw(st.lists(ids, max_size=40))
    got = remote.prob(ctx, cands)
    want = local.prob(ctx, cands)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_prunes_match_local_on_many_random_drafts(remote: RemoteNGram, local: NGram) -> None:
    from dart_client.decoding.draft import DraftRows
    from dart_client.decoding.prune import PrunerTreeBuilder, build_trees
    from dart_client.ngram.pruner import Pruner, PrunerConfig

    rng = np.random.default_rng(2)
    configs = [
        PrunerConfig(),
        PrunerConfig(beam_width=6, max_nodes=24, ngram_weight=0.0),
        PrunerConfig(ngram_at_level0=True, level_exponent=0.5, logit_decay=0.8),
    ]
    for config in configs:
        local_pruner = Pruner(local, config)
        remote_pruner = remote.pruner(config)
        for i in range(60):
            levels = int(rng.integers(1, 9))
            k = int(rng.integers(1, 26))
            ctx, ids, probs = random_draft(local, rng, levels, k)
            budget = int(rng.integers(1, 80)) if i % 4 == 0 else None
            # A prompt-lookup path on every other draft (some beyond the head's levels).
            path = (
                rng.integers(0, local.vocab_size, size=int(rng.integers(1, 12))) if i % 2 else None
            )
            assert_same_tree(
                remote_pruner.prune(ctx, ids, probs, budget=budget, lookup_path=path),
                local_pruner.prune(ctx, ids, probs, budget=budget, lookup_path=path),
            )
        drafts = [random_draft(local, rng) for _ in range(16)]
        contexts = [d[0] for d in drafts]
        ids = np.stack([d[1] for d in drafts])
        probs = np.stack([d[2] for d in drafts])
        budgets = [None if j % 2 else 10 + j for j in range(16)]
        paths = [None if j % 3 else list(contexts[j][-3:]) for j in range(16)]
        got = remote_pruner.prune_batch(contexts, ids, probs, budgets=budgets, lookup_paths=paths)
        want = local_pruner.prune_batch(contexts, ids, probs, budgets=budgets, lookup_paths=paths)
        assert len(got) == len(want) == 16
        for a, b in zip(got, want, strict=True):
            assert_same_tree(a, b)
        # A batched step's trees: padded by the local pruner in its call, packed from the
        # daemon's trees by the client, the same arrays.
        rows = [DraftRows(ids=ids[j], probs=probs[j]) for j in range(16)]
        budgets_now = [b or 0 for b in budgets]  # a row without room gets its root alone
        arrays = [None if p is None else np.asarray(p, dtype=np.int64) for p in paths]
        batches = [
            build_trees(PrunerTreeBuilder(p), contexts, rows, budgets_now, arrays)
            for p in (remote_pruner, local_pruner)
        ]
        for name in ("tokens", "parents", "depths", "mask", "sizes"):
            assert np.array_equal(getattr(batches[0], name), getattr(batches[1], name)), name


@pytest.mark.parametrize("spin", [0.0, 0.0005, 0.05])
def test_answers_are_the_same_whether_a_call_polls_or_sleeps(
    daemon: Daemon, local: NGram, spin: float
) -> None:
    """A call polls for its answer for up to `spin` seconds, then sleeps: a prune (hundreds of
    microseconds) ends within the longest spin, past the shortest, and at once sleeps with 0;
    a deadline shorter than the spin still fires."""
    from dart_client.ngram.pruner import Pruner, PrunerConfig

    rng = np.random.default_rng(11)
    local_pruner = Pruner(local, PrunerConfig())
    with connect(daemon.url, timeout=30, spin=spin) as r:
        assert r.spin == spin
        pruner = r.pruner(PrunerConfig())
        for _ in range(20):
            d = random_draft(local, rng)
            assert_same_tree(pruner.prune(*d), local_pruner.prune(*d))
        assert r.health()
        n = 500
        ids = rng.integers(0, local.vocab_size - 25, size=(n, 8, 1)) + np.arange(25)
        probs = np.full(ids.shape, 0.04, dtype=np.float32)
        r.timeout = 0.001
        with pytest.raises(DaemonUnavailableError, match="no answer within"):
            pruner.prune_batch([[1, 2]] * n, ids, probs)


@pytest.mark.parametrize("spin", [-0.001, 1.5, True, float("nan"), "0"])
def test_a_bad_spin_is_refused(daemon: Daemon, spin: object) -> None:
    with pytest.raises(ValueError, match="spin"):
        connect(daemon.url, timeout=30, spin=spin)  # type: ignore[arg-type]
    target = daemon.url.removeprefix("grpc://")
    if isinstance(spin, float) and spin == spin:
        with pytest.raises(ValueError, match="spin"):
            _native.DaemonClient(target, tls=False, timeout=30.0, spin=spin)


def run_clients(client: Callable[[int], None], seeds: int) -> None:
    """``client(seed)`` in one thread per seed; any failure is re-raised here, a hang fails."""
    errors: list[BaseException] = []

    def guarded(seed: int) -> None:
        try:
            client(seed)
        except BaseException as err:  # collected and re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(seeds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors


def test_several_concurrent_clients_get_correct_answers(daemon: Daemon, local: NGram) -> None:
    from dart_client.ngram.pruner import Pruner, PrunerConfig

    rng = np.random.default_rng(3)
    drafts = [random_draft(local, rng) for _ in range(40)]
    local_pruner = Pruner(local, PrunerConfig())
    expected = [local_pruner.prune(*d) for d in drafts]

    def client(seed: int) -> None:
        with connect(daemon.url, timeout=30) as r:
            pruner = r.pruner(PrunerConfig())
            order = np.random.default_rng(seed).permutation(len(drafts))
            for i in order:
                assert_same_tree(pruner.prune(*drafts[i]), expected[i])
                ctx = drafts[i][0]
                np.testing.assert_array_equal(
                    r.prob(ctx, drafts[i][1][0])[0], local.prob(ctx, drafts[i][1][0])[0]
                )

    run_clients(client, 8)


def test_one_client_shared_by_threads_gets_correct_answers(
    remote: RemoteNGram, local: NGram
) -> None:
    from dart_client.ngram.pruner import Pruner, PrunerConfig

    rng = np.random.default_rng(6)
    drafts = [random_draft(local, rng) for _ in range(24)]
    local_pruner = Pruner(local, PrunerConfig())
    expected = [local_pruner.prune(*d) for d in drafts]
    pruner = remote.pruner(PrunerConfig())

    def client(seed: int) -> None:
        for i in np.random.default_rng(seed).permutation(len(drafts)):
            assert_same_tree(pruner.prune(*drafts[i]), expected[i])
            ctx = drafts[i][0]
            np.testing.assert_array_equal(remote.top_k(ctx, 5)[0], local.top_k(ctx, 5)[0])

    run_clients(client, 6)


# -- errors -----------------------------------------------------------------------------------


def test_bad_requests_get_clear_errors_and_the_daemon_keeps_serving(
    daemon: Daemon, remote: RemoteNGram, local: NGram
) -> None:
    from dart_client.ngram.pruner import PrunerConfig

    v = local.vocab_size
    with pytest.raises(TokenOutOfVocabError, match=str(v + 5)) as exc:
        remote.prob([1, 2], [3, v + 5])
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(TokenOutOfVocabError):
        remote.top_k([v], 3)
    with pytest.raises(TokenOutOfVocabError):
        remote.count([0, v + 1])

    rng = np.random.default_rng(4)
    ctx, ids, probs = random_draft(local, rng, 4, 10)
    pruner = remote.pruner(PrunerConfig())
    bad = probs.copy()
    bad[1, 2] = 1.5
    with pytest.raises(RemoteInvalidArgumentError, match=r"1\.5") as exc:
        pruner.prune(ctx, ids, bad)
    assert isinstance(exc.value, ValueError)
    dup = ids.copy()
    dup[0, 1] = dup[0, 0]
    with pytest.raises(RemoteInvalidArgumentError, match="twice"):
        pruner.prune(ctx, dup, probs)
    with pytest.raises(RemoteInvalidArgumentError, match="beam_width"):
        remote.pruner(PrunerConfig(beam_width=0)).prune(ctx, ids, probs)
    with pytest.raises(RemoteInvalidArgumentError, match="budget"):
        pruner.prune(ctx, ids, probs, budget=0)
    with pytest.raises(TokenOutOfVocabError, match=r"lookup_path\[1\]"):
        pruner.prune(ctx, ids, probs, lookup_path=[1, v + 2])
    two = (np.stack([ids, ids]), np.stack([probs, probs]))
    with pytest.raises(RemoteInvalidArgumentError, match="1 lookup_paths for a batch of 2"):
        pruner.prune_batch([ctx, ctx], *two, lookup_paths=[[1]])
    with pytest.raises(RemoteInvalidArgumentError, match="3 budgets for a batch of 2"):
        pruner.prune_batch([ctx, ctx], *two, budgets=[1, 2, 3])
    with pytest.raises(RemoteInvalidArgumentError, match="drafts\\[1\\]"):
        oov = ids.copy()
        oov[0, 0] = v
        pruner.prune_batch([ctx, ctx], np.stack([ids, oov]), np.stack([probs, probs]))

    # Bytes that are not a protobuf message at all.
    channel = grpc.insecure_channel(daemon.addr)
    raw = channel.unary_unary("/dart.ngram.v1.NGramService/Prune")
    with pytest.raises(grpc.RpcError) as rpc:
        raw(b"\xff\xff\xff\xff\x0f", timeout=10)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in (rpc.value.details() or "")
    unknown = channel.unary_unary("/dart.ngram.v1.NGramService/NoSuchMethod")
    with pytest.raises(grpc.RpcError) as rpc:
        unknown(b"", timeout=10)
    assert rpc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    channel.close()

    # Still serving, correctly.
    assert remote.health()
    np.testing.assert_array_equal(remote.prob(ctx, ids[0])[0], local.prob(ctx, ids[0])[0])
    metrics = daemon.metrics()
    assert 'code="INVALID_ARGUMENT"' in metrics
    assert "dart_ngram_request_duration_seconds_bucket" in metrics


def test_ids_that_do_not_fit_the_wire_are_refused_before_sending(
    remote: RemoteNGram, local: NGram
) -> None:
    from dart_client.ngram.pruner import PrunerConfig

    with pytest.raises(RemoteInvalidArgumentError, match=r"candidates\[0\]\[1\] = -3"):
        remote.prob([1, 2], [4, -3])
    with pytest.raises(RemoteInvalidArgumentError, match="dtype float"):
        remote.prob([1, 2], [0.5])
    rng = np.random.default_rng(7)
    ctx, ids, probs = random_draft(local, rng, 3, 4)
    bad = ids.copy()
    bad[2, 1] = 2**33
    with pytest.raises(RemoteInvalidArgumentError, match=r"topk_ids\[2\]\[1\] = 8589934592"):
        remote.pruner(PrunerConfig()).prune(ctx, bad, probs)
    # Empty inputs are fine, whatever numpy made of them.
    assert remote.prob([], [])[0].shape == (0,)


def test_a_call_past_its_deadline_fails_and_the_daemon_keeps_serving(
    daemon: Daemon, local: NGram
) -> None:
    rng = np.random.default_rng(8)
    n = 3000
    ids = rng.integers(0, local.vocab_size - 25, size=(n, 8, 1)) + np.arange(25)
    probs = np.full(ids.shape, 0.04, dtype=np.float32)
    with connect(daemon.url, timeout=30) as r:
        r.timeout = 0.001
        with pytest.raises(DaemonUnavailableError, match="no answer within") as exc:
            r.pruner().prune_batch([[1, 2]] * n, ids, probs)
        assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        r.timeout = 30
        np.testing.assert_array_equal(r.prob([1, 2], [3, 4])[0], local.prob([1, 2], [3, 4])[0])


def test_a_closed_client_refuses_calls(daemon: Daemon) -> None:
    r = connect(daemon.url, timeout=30)
    assert r.health()
    r.close()
    with pytest.raises(DaemonError, match="closed") as exc:
        r.prob([1], [2])
    assert exc.value.code == grpc.StatusCode.CANCELLED
    assert not r.health()
    r.close()  # twice is fine


def test_oversized_requests_are_refused_with_resource_exhausted(model_path: Path) -> None:
    with Daemon(model_path, "--max-request-bytes", "4096") as d:
        with connect(d.url, timeout=30) as r:
            big = np.arange(20_000) % r.vocab_size
            with pytest.raises(DaemonOverloadedError, match="max-request-bytes") as exc:
                r.prob([1, 2], big)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert r.prob([1, 2], big[:10])[0].shape == (10,)
        assert d.terminate() == 0


def test_tokenizer_mismatch_is_refused(daemon: Daemon, local: NGram) -> None:
    other = "00" * 32 if local.fingerprint != "00" * 32 else "11" * 32
    with pytest.raises(TokenizerMismatchError, match=local.fingerprint) as exc:
        connect(daemon.url, timeout=30, expected_fingerprint=other)
    assert isinstance(exc.value, RemoteTokenizerMismatchError)


def test_daemon_down_is_a_clear_error(model_path: Path) -> None:
    # A port that nothing listens on: bind, note it, close.
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(DaemonUnavailableError, match="dart-ngram serve"):
        connect(f"grpc://127.0.0.1:{port}", timeout=1)
    with pytest.raises(ValueError, match="scheme"):
        connect("http://127.0.0.1:1")
    # A daemon that goes away under a connected client: bounded retries, then a clear error.
    with Daemon(model_path) as d:
        r = connect(d.url, timeout=2, retry=RetryPolicy(attempts=3, backoff=0.01))
        assert d.terminate() == 0
        with pytest.raises(DaemonUnavailableError, match="unavailable after 3 attempt"):
            r.prob([1], [2])
        r.close()


# -- process behaviour ------------------------------------------------------------------------


def test_a_client_killed_mid_call_leaves_the_daemon_healthy(
    daemon: Daemon, remote: RemoteNGram, local: NGram
) -> None:
    script = textwrap.dedent(
        f"""
        import numpy as np
        from dart_client.ngram import connect
        r = connect({daemon.url!r}, timeout=120)
        rng = np.random.default_rng(0)
        # Rows of 25 consecutive ids: distinct within a row, cheap to make.
        ids = rng.integers(0, {local.vocab_size} - 25, size=(3000, 8, 1)) + np.arange(25)
        probs = np.full(ids.shape, 0.04, dtype=np.float32)
        print("calling", flush=True)
        r.pruner().prune_batch([[1, 2]] * len(ids), ids, probs)
        print("done", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "calling", (
            proc.stderr.read() if proc.stderr else ""
        )
        assert wait_for(
            lambda: "dart_ngram_in_flight_requests 1" in daemon.metrics(), timeout=60
        ), "the batch never reached the daemon"
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The daemon finishes (or drops) the orphaned call and keeps answering correctly.
    assert wait_for(lambda: "dart_ngram_in_flight_requests 0" in daemon.metrics(), timeout=60)
    assert daemon.alive()
    assert remote.health()
    np.testing.assert_array_equal(remote.prob([1, 2], [3, 4])[0], local.prob([1, 2], [3, 4])[0])


def test_sigterm_drains_the_request_in_flight_and_exits_zero(
    model_path: Path, local: NGram
) -> None:
    """Timing-free: the request is held in flight by its client (headers sent, message not
    yet: a unary method called as client-streaming), the daemon is signalled, and only once it
    is seen draining (health NOT_SERVING, new connections refused, new calls UNAVAILABLE) is
    the message sent. The drained tree must equal the in-process one."""
    import queue
    import socket

    from dart_client.ngram.proto import ngram_pb2
    from dart_client.ngram.pruner import Pruner, PrunerConfig

    ctx, ids, probs = random_draft(local, np.random.default_rng(5))
    with Daemon(model_path, "--threads", "1") as d:
        channel = grpc.insecure_channel(d.addr)
        # grpc.health.v1 by hand (two one-field messages): HealthCheckRequest{service},
        # HealthCheckResponse{status}, NOT_SERVING = 2.
        service = b"dart.ngram.v1.NGramService"
        health = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda name: b"\x0a" + bytes([len(name)]) + name,
            response_deserializer=lambda raw: raw[1] if raw[:1] == b"\x08" else 0,
        )
        prune = channel.stream_unary(
            "/dart.ngram.v1.NGramService/Prune",
            request_serializer=ngram_pb2.PruneRequest.SerializeToString,
            response_deserializer=ngram_pb2.PruneResponse.FromString,
        )
        release: queue.Queue[ngram_pb2.PruneRequest] = queue.Queue()

        def body() -> Iterator[ngram_pb2.PruneRequest]:
            yield release.get(timeout=60)

        held = prune.future(body(), timeout=60)
        assert wait_for(lambda: "dart_ngram_in_flight_requests 1" in d.metrics(), timeout=30)
        d.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            with socket.socket() as s:
                return s.connect_ex(tuple_addr(d.addr)) != 0

        assert wait_for(refused, timeout=30), "new connections still accepted while draining"
        assert health(service, timeout=10) == 2, "health is not NOT_SERVING while draining"
        late = channel.unary_unary(
            "/dart.ngram.v1.NGramService/Count",
            request_serializer=ngram_pb2.CountRequest.SerializeToString,
            response_deserializer=ngram_pb2.CountResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            late(ngram_pb2.CountRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not held.done()

        draft = ngram_pb2.Draft(
            context=[int(t) for t in ctx],
            topk_ids=[int(t) for t in ids.ravel()],
            topk_probs=[float(p) for p in probs.ravel()],
            levels=ids.shape[0],
            k=ids.shape[1],
        )
        release.put(ngram_pb2.PruneRequest(draft=draft))
        tree = held.result(timeout=60).tree
        expected = Pruner(local, PrunerConfig()).prune(ctx, ids, probs)
        np.testing.assert_array_equal(np.asarray(tree.tokens), expected.tokens)
        np.testing.assert_array_equal(np.asarray(tree.parents), expected.parents)
        np.testing.assert_array_equal(np.asarray(tree.scores), expected.scores)
        assert d.proc.wait(60) == 0, "".join(d.lines[-20:])
        channel.close()
        messages = d.log_messages()
        assert any("shutdown requested" in m for m in messages), messages
        assert messages[-1] == "stopped"


def tuple_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def test_abuse_leaves_a_correct_client_unchanged(model_path: Path, local: NGram) -> None:
    """The issue's abuse, bounded: oversized budgets and overrides, hundreds of idle
    connections and SIGHUPs, while a parallel client's prunes keep equalling the local ones."""
    import socket

    from dart_client.ngram.pruner import Pruner, PrunerConfig

    rng = np.random.default_rng(17)
    drafts = [random_draft(local, rng) for _ in range(30)]
    expected = [Pruner(local, PrunerConfig()).prune(*d) for d in drafts]
    with Daemon(
        model_path, "--threads", "2", "--max-connections", "120", "--handshake-timeout", "1"
    ) as d:
        stop = threading.Event()
        errors: list[BaseException] = []
        rounds = [0]

        def correct_client() -> None:
            try:
                with connect(d.url, timeout=30) as r:
                    pruner = r.pruner(PrunerConfig())
                    while not stop.is_set():
                        for draft, want in zip(drafts, expected, strict=True):
                            assert_same_tree(pruner.prune(*draft), want)
                        rounds[0] += 1
            except BaseException as err:
                errors.append(err)

        t = threading.Thread(target=correct_client)
        t.start()
        try:
            with connect(d.url, timeout=30, retry=RetryPolicy(attempts=1)) as abuser:
                ctx, ids, probs = random_draft(local, rng, levels=64, k=256)
                with pytest.raises(DaemonError, match="max_nodes"):
                    abuser.pruner(PrunerConfig()).prune(ctx, ids, probs, budget=2**32 - 1)
                for override, limit in (
                    (PrunerConfig(beam_width=10**7, max_nodes=60), "max_beam_width"),
                    (PrunerConfig(max_nodes=10**7), "max_nodes"),
                ):
                    with pytest.raises(DaemonError, match=limit):
                        abuser.pruner(override).prune_batch(
                            [drafts[0][0]] * 4, [drafts[0][1]] * 4, [drafts[0][2]] * 4
                        )
            # 300 connections that never speak: beyond the cap and then timed out.
            idle = []
            for _ in range(300):
                s = socket.socket()
                s.settimeout(5)
                try:
                    s.connect(tuple_addr(d.addr))
                except OSError:
                    s.close()
                    continue
                idle.append(s)
            # One at a time: signals that arrive together are delivered once.
            for n in range(1, 4):
                d.proc.send_signal(signal.SIGHUP)
                assert wait_for(
                    lambda n=n: d.log_messages().count("model reloaded") == n, timeout=60
                ), d.lines[-10:]
            assert wait_for(lambda: "dart_ngram_connections_open 1\n" in d.metrics(), timeout=30), (
                "idle connections were never closed"
            )
            for s in idle:
                s.close()
            metrics = d.metrics()
            assert "dart_ngram_connections_refused_total 0" not in metrics
            assert "dart_ngram_connections_timed_out_total 0" not in metrics
        finally:
            stop.set()
            t.join(120)
        assert not errors, errors
        assert rounds[0] >= 1
        assert d.alive()
        assert d.terminate(timeout=60) == 0


def test_sighup_refuses_a_model_of_another_order(
    model_path: Path, tmp_path: Path, smollm2_tokenizer_dir: Path, local: NGram
) -> None:
    import shutil

    served = tmp_path / "served.ngram"
    shutil.copy(model_path, served)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in sharegpt_texts(50)))
    order2 = tmp_path / "order2.ngram"
    subprocess.run(
        [
            str(dart_ngram_binary()),
            "build",
            "--input",
            str(corpus),
            "--tokenizer",
            str(smollm2_tokenizer_dir / "tokenizer.json"),
            "--order",
            "2",
            "--output",
            str(order2),
            "--quiet",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    with Daemon(served) as d, connect(d.url, timeout=30) as r:
        before = r.prob([1, 2], [3, 4])
        (tmp_path / "new.ngram").write_bytes(order2.read_bytes())
        (tmp_path / "new.ngram").replace(served)
        d.proc.send_signal(signal.SIGHUP)
        assert wait_for(
            lambda: any(m.startswith("reload refused") for m in d.log_messages()), timeout=60
        ), d.lines[-10:]
        refused = next(x for x in d.logs if x.get("message", "").startswith("reload refused"))
        assert "order 3 -> 2" in str(refused.get("reason")), refused
        assert r.order == 3
        after = r.prob([1, 2], [3, 4])
        np.testing.assert_array_equal(after[0], before[0])
        assert d.alive()


def test_tls_round_trip_through_a_tls_proxy(
    daemon: Daemon, local: NGram, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``grpcs://`` to the daemon through a TLS-terminating proxy (what docs/daemon.md
    recommends), with a CA and a server certificate generated here by the ``openssl`` CLI."""
    import asyncio
    import shutil
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (needed to generate the certificates)")
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=dart test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr",
            "-subj", "/CN=localhost")  # fmt: skip
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "srv.pem", "-days", "1", "-extfile", "ext.cnf")  # fmt: skip
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "srv.pem", tmp_path / "srv.key")
    context.set_alpn_protocols(["h2"])
    upstream = tuple_addr(daemon.addr)
    loop = asyncio.new_event_loop()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*upstream)
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    # The refused handshake below is expected: keep the loop from reporting it.
    loop.set_exception_handler(lambda _loop, _context: None)
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=context))
    port = [server.sockets[0].getsockname()[1]]
    proxy = threading.Thread(target=loop.run_forever, daemon=True)
    proxy.start()
    try:
        # The client trusts the generated CA through the platform's trust-store variable.
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
        with connect(f"grpcs://localhost:{port[0]}", timeout=30) as r:
            assert r.fingerprint == local.fingerprint
            got = r.prob([1, 2], [3, 4, 5])
            want = local.prob([1, 2], [3, 4, 5])
            np.testing.assert_array_equal(got[0], want[0])
        # Without the CA the certificate is refused: TLS is really checked.
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ext.cnf"))
        with pytest.raises(DaemonError):
            connect(f"grpcs://localhost:{port[0]}", timeout=3, retry=RetryPolicy(attempts=1))
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        proxy.join(10)


def test_an_idle_connected_client_does_not_hold_up_the_drain(model_path: Path) -> None:
    # The client must acknowledge the daemon's GOAWAY while it makes no call; the daemon would
    # otherwise wait out its whole shutdown grace period (30 s) for the connection.
    with Daemon(model_path) as d:
        r = connect(d.url, timeout=30)
        assert r.health()
        started = time.monotonic()
        assert d.terminate(timeout=60) == 0
        assert time.monotonic() - started < 10, "the drain waited for an idle client"
        assert "clients did not close their idle connections; closing them" not in (
            d.log_messages()
        )
        r.close()


def test_numa_placement_is_logged_or_refused(model_path: Path) -> None:
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    with Daemon(model_path, "--numa-node", "0") as d:
        placement = next(r for r in d.logs if r.get("message") == "placement")["placement"]
        if len(nodes) < 2:
            assert "no NUMA on this machine" in placement
        else:
            assert placement.startswith("pinned to NUMA node 0")
        assert d.terminate() == 0
    with Daemon(model_path, "--cpus", "0") as d:
        placement = next(r for r in d.logs if r.get("message") == "placement")["placement"]
        assert placement == "pinned to cpus 0"
        assert d.terminate() == 0
    res = subprocess.run(
        [
            str(dart_ngram_binary()),
            "serve",
            "--model",
            str(model_path),
            "--numa-node",
            "99",
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert "--numa-node 99: no such NUMA node" in res.stderr
