"""Load a ``dart serve`` server and measure it: requests/s, time to first token, tokens/s.

    python -m dart_client.apps.serve.bench [--url http://HOST:PORT | --server-args "..."]
        [--requests 48] [--concurrency 8] [--max-tokens 64] [--out FILE.json]

Without ``--url`` it starts ``dart serve`` itself (the embedded default unless
``--server-args`` say otherwise) on a free loopback port and stops it afterwards. The same
load (held-out ShareGPT first turns, greedy, streamed) runs twice: DART and
``speculative: false``; greedy outputs must be identical, and the report counts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dart_client.errors import DartError


@dataclass
class Sample:
    ttft: float
    seconds: float
    tokens: int
    text: str
    tau: float


def prompts(count: int, max_chars: int) -> list[str]:
    """First user turns of held-out ShareGPT conversations (never used for training)."""
    from dart_client import embedded
    from dart_client.data import is_held_out, read_sharegpt

    out: list[str] = []
    for conv in read_sharegpt(embedded.sharegpt_json()):
        if not is_held_out(conv.id) or not conv.turns:
            continue
        first = conv.turns[0]
        if first.role == "user" and 0 < len(first.content.strip()) <= max_chars:
            out.append(first.content)
            if len(out) == count:
                return out
    raise DartError(f"only {len(out)} held-out ShareGPT prompts of <= {max_chars} characters")


async def one(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    max_tokens: int,
    speculative: bool,
    ignore_eos: bool = False,
) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": speculative,
        "ignore_eos": ignore_eos,
    }
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise DartError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise DartError(f"error in the stream: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(content)
    seconds = time.perf_counter() - start
    return Sample(
        ttft if ttft is not None else seconds,
        seconds,
        usage["usage"]["completion_tokens"],
        "".join(parts),
        usage["dart"]["tau"],
    )


async def load(
    url: str,
    api_key: str | None,
    model: str,
    items: list[str],
    max_tokens: int,
    concurrency: int,
    speculative: bool,
    ignore_eos: bool = False,
) -> tuple[list[Sample], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=None, limits=limits
    ) as client:
        queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        for item in enumerate(items):
            queue.put_nowait(item)
        results: list[Sample | None] = [None] * len(items)

        async def worker() -> None:
            while not queue.empty():
                i, prompt = queue.get_nowait()
                results[i] = await one(client, model, prompt, max_tokens, speculative, ignore_eos)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    assert all(r is not None for r in results)
    return [r for r in results if r is not None], wall


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(samples: list[Sample], wall: float) -> dict[str, Any]:
    tokens = sum(s.tokens for s in samples)
    ttft = [s.ttft for s in samples]
    return {
        "requests": len(samples),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(samples) / wall, 4),
        "ttft_p50_s": round(percentile(ttft, 0.5), 4),
        "ttft_p99_s": round(percentile(ttft, 0.99), 4),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "mean_tau": round(sum(s.tau for s in samples) / len(samples), 3),
    }


def stage_seconds(url: str) -> dict[str, float]:
    """The server's total step time per stage so far (``dart_serve_step_stage_seconds``)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('dart_serve_step_stage_seconds_sum{stage="'):
            head, value = line.rsplit(" ", 1)
            out[head.split('"')[1]] = float(value)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launched:
    proc: subprocess.Popen[bytes]
    url: str


def launch(server_args: Sequence[str]) -> Launched:
    port = free_port()
    cmd = [sys.executable, "-m", "dart_client.apps.cli", "serve", f"--port={port}", *server_args]
    print("starting:", shlex.join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise DartError(f"dart serve exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Launched(proc, url)
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dart_client.apps.serve.bench", description=__doc__)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("DART_API_KEY"))
    p.add_argument(
        "--server-args",
        default="--dtype=fp32",
        help="arguments of the `dart serve` this starts (default '--dtype=fp32')",
    )
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=600)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request generates --max-tokens (through end-of-turn), as vLLM's serving "
        "benchmark fixes output lengths",
    )
    p.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = p.parse_args(argv)
    if min(args.requests, args.concurrency, args.max_tokens) < 1:
        raise DartError("--requests, --concurrency and --max-tokens must be >= 1")
    items = prompts(args.requests, args.max_prompt_chars)
    server = None if args.url else launch(shlex.split(args.server_args))
    url = args.url or (server.url if server else "")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        report: dict[str, Any] = {
            "machine": machine(),
            "model": model,
            "server_args": None if args.url else args.server_args,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "workload": "held-out ShareGPT first turns, chat, greedy, streamed",
        }
        texts = {}
        for name, speculative in (("dart", True), ("ar", False)):
            # Warm-up: the first requests pay for lazy initialisation.
            asyncio.run(load(url, args.api_key, model, items[:2], 8, 2, speculative))
            before = stage_seconds(url)
            samples, wall = asyncio.run(
                load(
                    url,
                    args.api_key,
                    model,
                    items,
                    args.max_tokens,
                    args.concurrency,
                    speculative,
                    args.ignore_eos,
                )
            )
            report[name] = summary(samples, wall)
            after = stage_seconds(url)
            # Where the worker's time went (seconds over the whole run, per stage).
            report[name]["stage_seconds"] = {
                k: round(v - before.get(k, 0.0), 3) for k, v in after.items()
            }
            texts[name] = [s.text for s in samples]
            print(name, json.dumps(report[name]), file=sys.stderr)
        report["identical_outputs"] = sum(
            a == b for a, b in zip(texts["dart"], texts["ar"], strict=True)
        )
        report["speedup_tokens_per_s"] = round(
            report["dart"]["tokens_per_s"] / report["ar"]["tokens_per_s"], 3
        )
    finally:
        if server is not None:
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(120)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
