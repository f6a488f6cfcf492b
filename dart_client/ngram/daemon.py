"""A ``dart-ngram serve`` child process on loopback: for benchmarks, demos and tests.

:func:`dart_ngram_binary` finds the binary, :class:`LocalDaemon` starts it on an ephemeral
port and reads the address from its ``listening`` log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from dart_client.errors import MissingResourceError

REPO_ROOT = Path(__file__).resolve().parents[2]


def dart_ngram_binary() -> Path | None:
    """``dart-ngram``: beside this interpreter (``make native`` links it into the venv, which
    need not be on PATH), on PATH, or the release build under ``$CARGO_TARGET_DIR`` (default
    ``target/``); None when there is none."""
    beside = Path(sys.executable).parent / "dart-ngram"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("dart-ngram")
    if found:
        return Path(found)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO_ROOT / "target"))
    path = target / "release" / "dart-ngram"
    return path if path.is_file() else None


class LocalDaemon:
    """``dart-ngram serve --model MODEL`` on 127.0.0.1 with an ephemeral port, plus
    ``extra_args``. Once it listens: ``addr``, ``url``, ``metrics_addr`` (None unless
    ``--metrics-listen`` was passed); its log is kept (``lines`` raw, ``logs`` parsed).
    :meth:`close` stops it gracefully (SIGTERM: requests in flight finish)."""

    def __init__(self, model_path: str | Path, *extra_args: str, timeout: float = 60.0) -> None:
        binary = dart_ngram_binary()
        if binary is None:
            raise MissingResourceError(
                "dart-ngram not found beside the interpreter, on PATH nor under "
                "$CARGO_TARGET_DIR/release (build it with `make native`)"
            )
        self.args = [str(binary), "serve", "--model", str(model_path), "--listen", "127.0.0.1:0"]
        self.args += ["--log-format", "json", *extra_args]
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.logs: list[dict[str, Any]] = []
        self._done = threading.Event()  # "listening" was logged, or the log ended
        self._reader = threading.Thread(target=self._read_logs, daemon=True)
        self._reader.start()
        listening = None
        if self._done.wait(timeout):
            listening = next((r for r in self.logs if r.get("message") == "listening"), None)
        if listening is None:
            self.kill()
            raise MissingResourceError(
                f"dart-ngram serve did not start within {timeout:.0f} s "
                f"(exit status {self.proc.poll()}):\n" + "".join(self.lines[-20:])
            )
        self.addr = str(listening["addr"])
        self.url = f"grpc://{self.addr}"
        metrics = listening.get("metrics")
        self.metrics_addr: str | None = None if metrics in (None, "off") else str(metrics)

    def _read_logs(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.logs.append(record)
            if record.get("message") == "listening":
                self._done.set()
        self._done.set()

    def log_messages(self) -> list[str]:
        return [str(r.get("message")) for r in self.logs]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (the daemon drains), then its exit status; killed after ``timeout``."""
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

    def close(self) -> None:
        """Stops it gracefully (killed if it does not exit within 15 s)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.terminate(15.0)

    def __enter__(self) -> LocalDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
