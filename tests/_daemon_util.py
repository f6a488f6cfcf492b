"""Helpers shared by the daemon and deploy tests: finding the ``dart-ngram`` binary, starting
``dart-ngram serve`` on an ephemeral loopback port and stopping it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dart_client.ngram import daemon as local_daemon
from dart_client.ngram.daemon import LocalDaemon

REPO = Path(__file__).resolve().parent.parent


def dart_ngram_binary() -> Path:
    """The ``dart-ngram`` binary (see :func:`dart_client.ngram.daemon.dart_ngram_binary`)."""
    found = local_daemon.dart_ngram_binary()
    if found is None:
        pytest.fail(
            "dart-ngram binary not found beside the interpreter, on PATH nor under "
            "$CARGO_TARGET_DIR/release: build it with `make native` "
            "(or `cargo build --release -p dart-ngram-cli`)"
        )
    return found


class Daemon(LocalDaemon):
    """:class:`LocalDaemon` with a metrics endpoint on an ephemeral port; killed on exit."""

    def __init__(self, model: Path, *extra: str, timeout: float = 30.0) -> None:
        dart_ngram_binary()  # a missing binary fails the test with the build command
        super().__init__(model, "--metrics-listen", "127.0.0.1:0", *extra, timeout=timeout)

    def metrics(self) -> str:
        import urllib.request

        assert self.metrics_addr
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=5) as r:
            return r.read().decode()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Polls ``predicate`` until true or ``timeout`` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
