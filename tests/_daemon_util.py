"""Helpers shared by the daemon and deploy tests: finding the ``dart-ngram`` binary, starting
``dart-ngram serve`` on an ephemeral loopback port and stopping it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def dart_ngram_binary() -> Path:
    """The ``dart-ngram`` binary: on PATH (``make native`` links it into the venv), else the
    release build under ``$CARGO_TARGET_DIR`` (default ``target/``)."""
    found = shutil.which("dart-ngram")
    if found:
        return Path(found)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    path = target / "release" / "dart-ngram"
    if path.is_file():
        return path
    pytest.fail(
        f"dart-ngram binary not found on PATH nor at {path}: build it with `make native` "
        "(or `cargo build --release -p dart-ngram-cli`)"
    )


class Daemon:
    """A running ``dart-ngram serve`` on 127.0.0.1 with an ephemeral port (read from its log)."""

    def __init__(self, model: Path, *extra: str, timeout: float = 30.0) -> None:
        self.args = [
            str(dart_ngram_binary()),
            "serve",
            "--model",
            str(model),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            *extra,
        ]
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.logs: list[dict] = []
        self.raw: list[str] = []
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read_logs, daemon=True)
        self._reader.start()
        if not self._listening.wait(timeout):
            self.kill()
            raise RuntimeError(
                f"dart-ngram serve did not start within {timeout} s:\n" + "".join(self.raw)
            )
        line = next(r for r in self.logs if r.get("message") == "listening")
        self.addr: str = line["addr"]
        self.url = f"grpc://{self.addr}"
        metrics = line.get("metrics")
        self.metrics_addr: str | None = None if metrics in (None, "off") else str(metrics)

    def _read_logs(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.raw.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.logs.append(record)
            if record.get("message") == "listening":
                self._listening.set()

    def log_messages(self) -> list[str]:
        return [str(r.get("message")) for r in self.logs]

    def metrics(self) -> str:
        import urllib.request

        assert self.metrics_addr
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=5) as r:
            return r.read().decode()

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit status (killed after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def __enter__(self) -> Daemon:
        return self

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
