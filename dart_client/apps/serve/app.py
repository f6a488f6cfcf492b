"""The FastAPI app of ``dart serve`` and its command line.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (with
``--api-key``: a ``Authorization: Bearer KEY`` header is required, else 401), ``GET /health``
and ``GET /metrics`` (Prometheus; both open). SIGTERM / Ctrl-C: new requests get 503, the
queued and running ones finish within ``--shutdown-grace`` seconds, the rest end with a 503
error (in the stream, for streamed ones), then the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dart_client.apps.serve.generation import Engine, Outcome, PromptScores, Step
from dart_client.apps.serve.metrics import Metrics
from dart_client.apps.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    Reply,
    bad_request,
    check_request,
    choices_of,
    error_body,
    sampling_of,
)
from dart_client.apps.serve.scheduler import Job, JobError, QueueFull, Scheduler, timeout_error
from dart_client.errors import DartError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

#: How often a waiting request checks that its client is still there.
POLL_SECONDS = 0.25
#: ``--keep-alive``'s default. uvicorn's own (5 s) closes a pooled connection while clients
#: that queue behind a busy server wait longer than that between requests: a request sent
#: on it as it closes fails with "server disconnected" (a client without retries sees it).
KEEP_ALIVE_SECONDS = 75.0


@dataclass
class Prompt:
    """One prompt of a request: its token ids and, with ``echo``, its text."""

    ids: list[int]
    echo: str | None = None


def create_app(
    engine: Engine, scheduler: Scheduler, metrics: Metrics, api_key: str | None = None
) -> FastAPI:
    app = FastAPI(title="dart serve", docs_url=None, redoc_url=None)

    @app.exception_handler(JobError)
    async def _job_error(_: Request, err: JobError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        message = first.get("msg", "invalid request")
        text = f"{where}: {message}" if where else message
        return error_response(bad_request(text, where or None))

    @app.exception_handler(DartError)
    async def _dart_error(_: Request, err: DartError) -> JSONResponse:
        return error_response(bad_request(str(err)))

    app.add_middleware(AuthAndCount, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health() -> Response:
        if scheduler.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "queue_depth": scheduler.depth})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.model_id,
                    "object": "model",
                    "created": started,
                    "owned_by": "dart",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    started = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Response:
        check_request(req, engine.model_id)
        if not engine.has_chat_template:
            raise bad_request("this model has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = engine.encode_chat(messages)
        return await run(req, [Prompt(ids)], request, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        check_request(req, engine.model_id)
        given = req.prompt
        # One prompt (text or ids) or a batch of them (texts or id lists), as OpenAI's API.
        if isinstance(given, list) and given and isinstance(given[0], (str, list)):
            batch = list(given)
        else:
            batch = [given]
        prompts = []
        for prompt in batch:
            if isinstance(prompt, str):
                ids = engine.encode_text(prompt)
            else:
                if not prompt:
                    raise bad_request("the prompt is empty", "prompt")
                ids = engine.check_ids([int(x) for x in prompt])
            echo = None
            if req.echo:
                echo = prompt if isinstance(prompt, str) else engine.decode(ids)
            prompts.append(Prompt(ids, echo))
        return await run(req, prompts, request, chat=False)

    async def run(
        req: ChatRequest | CompletionRequest, prompts: list[Prompt], request: Request, chat: bool
    ) -> Response:
        """Queue the request's generations (``n`` choices of each prompt; choice ``i`` is
        prompt ``i // n``'s) and answer."""
        n = req.n
        samplings = [
            sampling_of(req, len(p.ids), engine.max_model_len, engine.speculative) for p in prompts
        ]
        if samplings[0].stop_token_ids:
            try:
                engine.check_ids(list(samplings[0].stop_token_ids))
            except DartError as err:
                raise bad_request(f"stop_token_ids: {err}", "stop_token_ids") from None
        if n * len(prompts) > scheduler.max_queue:
            raise bad_request(
                f"{len(prompts)} prompt(s) x n = {n} generations, but this server queues at "
                f"most {scheduler.max_queue} (--max-queue)",
                "n" if len(prompts) == 1 else "prompt",
            )
        # One job per choice, queued together: they decode side by side when batching.
        jobs = scheduler.submit_all(
            [(p.ids, c) for p, s in zip(prompts, samplings, strict=True) for c in choices_of(s, n)]
        )
        reply = Reply(chat, engine.model_id, sum(len(p.ids) for p in prompts), engine.token_piece)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                stream(jobs, reply, usage, prompts, n),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        merged, pumps = merge(jobs)
        outcomes: dict[int, Outcome] = {}
        scores: dict[int, PromptScores] = {}  # by prompt
        checked = time.monotonic()
        try:
            while len(outcomes) < len(jobs):
                try:
                    index, message = await asyncio.wait_for(merged.get(), POLL_SECONDS)
                except asyncio.TimeoutError:
                    index, message = -1, None
                if isinstance(message, JobError):
                    return error_response(message)
                if isinstance(message, PromptScores):
                    scores[index // n] = message
                if isinstance(message, Outcome):
                    outcomes[index] = message
                # Look at the connection every POLL_SECONDS, steps coming or not.
                if index < 0 or time.monotonic() - checked >= POLL_SECONDS:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return Response(status_code=499)

            def echoed(index: int) -> tuple[str, dict[str, Any] | None] | None:
                prompt = prompts[index // n]
                if prompt.echo is None:
                    return None
                got = scores.get(index // n)
                logprobs = None
                if got is not None:
                    logprobs = reply.echo_logprobs(prompt.ids, got.logprobs, index)
                return prompt.echo, logprobs

            return JSONResponse(reply.full([outcomes[i] for i in range(len(jobs))], echoed))
        finally:
            end(jobs, pumps)  # a no-op for jobs that have ended

    def merge(jobs: list[Job]) -> tuple[asyncio.Queue[tuple[int, Any]], list[asyncio.Task[None]]]:
        """The messages of a request's jobs as they come, each with its choice's index (a
        task per job forwards them); a job's last message is its outcome or error."""
        merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int, job: Job) -> None:
            while True:
                message = await next_message(job)
                merged.put_nowait((index, message))
                if isinstance(message, (Outcome, JobError)):
                    return

        return merged, [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]

    def end(jobs: list[Job], pumps: list[asyncio.Task[None]]) -> None:
        for job in jobs:
            job.cancel()
        for task in pumps:
            task.cancel()

    async def next_message(job: Job) -> PromptScores | Step | Outcome | JobError:
        """The job's next message; a timeout error past its deadline."""
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            job.cancel()
            return timeout_error(scheduler.timeout)
        try:
            return await asyncio.wait_for(job.messages.get(), remaining)
        except asyncio.TimeoutError:
            job.cancel()
            return timeout_error(scheduler.timeout)

    async def stream(
        jobs: list[Job], reply: Reply, include_usage: bool, prompts: list[Prompt], n: int
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects: `finally` then tells
        # the worker, which drops the jobs at their next step.
        merged, pumps = merge(jobs)
        try:
            if reply.chat:
                for index in range(len(jobs)):
                    yield sse(reply.chunk("", first=True, index=index))

            def echoed(p: int, scores: PromptScores | None) -> Iterator[str]:
                """The first chunk of each choice of prompt ``p``: the echoed prompt (scored
                when asked)."""
                prompt = prompts[p]
                assert prompt.echo is not None
                for index in range(p * n, p * n + n):
                    chunk = reply.chunk(prompt.echo, index=index)
                    if scores is not None:
                        logprobs = reply.echo_logprobs(prompt.ids, scores.logprobs, index)
                        chunk["choices"][0]["logprobs"] = logprobs
                    yield sse(chunk)

            for p, prompt in enumerate(prompts):
                if prompt.echo is not None and jobs[p * n].sampling.prompt_logprobs is None:
                    for chunk in echoed(p, None):
                        yield chunk
            outcomes: dict[int, Outcome] = {}
            while len(outcomes) < len(jobs):
                index, message = await merged.get()
                if isinstance(message, PromptScores):
                    for chunk in echoed(index // n, message):
                        yield chunk
                    continue
                if isinstance(message, JobError):
                    yield sse(error_body(message))
                    break
                if isinstance(message, Outcome):
                    outcomes[index] = message
                    text = None if reply.chat else ""
                    yield sse(reply.chunk(text, message.finish_reason, index=index))
                elif message.text or message.logprobs:
                    yield sse(reply.chunk(message.text, logprobs=message.logprobs, index=index))
            else:
                if include_usage:
                    yield sse(reply.usage_chunk([outcomes[i] for i in range(len(jobs))]))
            yield "data: [DONE]\n\n"
        finally:
            end(jobs, pumps)

    return app


def error_response(err: JobError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if isinstance(err, QueueFull) else None
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


class AuthAndCount:
    """ASGI middleware: the API key on ``/v1/``, and requests counted by endpoint and status.

    A plain ASGI middleware (not ``@app.middleware``): the endpoints then read the client's
    own ``receive``, so a waiting non-streamed request sees its client disconnect."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        # Known paths only as label values: a scan of random paths must not grow the metrics.
        endpoint = path if path in ENDPOINTS else "other"
        if self.expected is not None and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                self.metrics.request(endpoint, 401)
                denied = JobError(
                    401, "Invalid or missing API key", "authentication_error", "invalid_api_key"
                )
                await error_response(denied)(scope, receive, send)
                return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -- dart serve ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from dart_client.apps.serve.generation import add_engine_arguments

    p = argparse.ArgumentParser(
        prog="dart serve",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics) in front of one DART model.",
    )
    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=os.environ.get("DART_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ (default: $DART_API_KEY; none: open)",
    )
    g.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)"
    )
    g.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="requests decoded together, fused, joining and leaving between steps "
        "(default 1: one at a time)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a request may take, waiting included, before a 504 (default 600)",
    )
    g.add_argument(
        "--keep-alive",
        type=float,
        default=KEEP_ALIVE_SECONDS,
        help="seconds an idle client connection stays open (default "
        f"{KEEP_ALIVE_SECONDS:g}): longer than a client's gaps between requests, so it does not "
        "reuse a connection the server is closing",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to finish the requests in flight before ending them with 503",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--log-level", default="info", help="uvicorn's log level")
    return p


def serve_main(argv: Sequence[str]) -> int:
    """``dart serve``."""
    from dart_client.apps.options import check_model_arguments
    from dart_client.apps.serve.generation import load_engine

    parser = build_parser()
    args = parser.parse_args(list(argv))
    check_model_arguments(args, parser)  # usage errors (paths, --head auto) before any load
    for flag, value, minimum in (
        ("--max-queue", args.max_queue, 1),
        ("--max-batch", args.max_batch, 1),
        ("--port", args.port, 0),
    ):
        if value < minimum:
            raise DartError(f"{flag} must be >= {minimum}, got {value}")
    if args.timeout <= 0 or args.shutdown_grace < 0 or args.keep_alive <= 0:
        raise DartError("--timeout and --keep-alive must be > 0, --shutdown-grace >= 0")
    if args.threads:
        import torch  # after parsing: `dart serve --help` answers without it

        torch.set_num_threads(args.threads)
    engine = load_engine(args)
    metrics = Metrics()
    scheduler = Scheduler(
        engine,
        max_queue=args.max_queue,
        timeout=args.timeout,
        observer=metrics,
        max_batch=args.max_batch,
    )
    app = create_app(engine, scheduler, metrics, api_key=args.api_key or None)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=args.keep_alive,
    )
    server = _Server(config, scheduler, args.shutdown_grace)
    print(
        f"dart serve: {engine.model_id} ({'DART' if engine.speculative else 'autoregressive'}"
        f", context {engine.max_model_len}) on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM / Ctrl-C drains the scheduler before the HTTP
    side stops (a second one stops at once)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.grace = grace
        self.draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        print("dart serve: shutting down, finishing the requests in flight", file=sys.stderr)
        threading.Thread(target=self._drain, name="dart-serve-drain", daemon=True).start()

    def _drain(self) -> None:
        self.scheduler.shutdown(self.grace)
        # Every job has its final message: uvicorn now waits for the responses to be written.
        self.should_exit = True
