"""One worker thread owns the model; a bounded first-come-first-served queue feeds it.

A :class:`Job` is one request's generation. The HTTP side submits it and reads its
:class:`asyncio.Queue` of messages (``Step``, then ``Outcome``, or a :class:`JobError`);
the worker runs one job at a time (``DartModel`` is not thread-safe) and checks between
steps whether the job was cancelled (client gone), timed out, or the server is shutting down.
Every job ends with exactly one final message, so no request is lost silently.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dart_client.apps.serve.generation import Engine, Outcome, Sampling, Step


class JobError(Exception):
    """Why a job ended without an outcome: an OpenAI-style error with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code


class QueueFull(JobError):
    def __init__(self, retry_after: int) -> None:
        super().__init__(
            429,
            "the server's request queue is full; retry later",
            "rate_limit_error",
            "queue_full",
        )
        self.retry_after = retry_after


class ShuttingDown(JobError):
    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down", "server_error", "shutting_down")


def timeout_error(seconds: float) -> JobError:
    return JobError(504, f"the request took longer than {seconds:g} s", "timeout", "timeout")


@dataclass(eq=False)
class Job:
    ids: list[int]
    sampling: Sampling
    deadline: float  # time.monotonic() after which the job is abandoned
    loop: asyncio.AbstractEventLoop
    messages: asyncio.Queue[Step | Outcome | JobError] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    number: int = 0

    def cancel(self) -> None:
        """Called when the client goes away: the worker drops the job at its next step."""
        self.cancelled.set()

    def _send(self, message: Step | Outcome | JobError) -> None:
        self.loop.call_soon_threadsafe(self.messages.put_nowait, message)


class Observer:
    """What the scheduler reports (the metrics): no-ops by default."""

    def queue_depth(self, depth: int) -> None: ...
    def step(self, job: Job, step: Step, seconds_since_last: float, first: bool) -> None: ...
    def outcome(self, job: Job, outcome: Outcome) -> None: ...
    def abandoned(self, job: Job, reason: str) -> None: ...


class Scheduler:
    """``submit`` jobs; one worker thread runs them in arrival order.

    ``max_queue``: jobs waiting (not counting the running one) before ``submit`` raises
    :class:`QueueFull`. ``timeout``: seconds from submission after which a job ends with a
    504 error (waiting or running). ``shutdown(grace)`` refuses new jobs, lets the queued and
    running ones finish for up to ``grace`` seconds, then ends the rest with a 503 error.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int,
        timeout: float,
        observer: Observer | None = None,
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.timeout = timeout
        self.observer = observer or Observer()
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._abort = False  # grace is over: end every job now
        self._running: Job | None = None
        self._numbers = itertools.count(1)
        self._mean_seconds = 5.0  # running mean of a job's time, for Retry-After
        self._thread = threading.Thread(target=self._work, name="dart-serve-worker", daemon=True)
        self._thread.start()

    # -- the HTTP side ----------------------------------------------------------------------

    def submit(self, ids: list[int], sampling: Sampling) -> Job:
        job = Job(ids, sampling, time.monotonic() + self.timeout, asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise ShuttingDown()
            if len(self._queue) >= self.max_queue:
                busy = len(self._queue) + (self._running is not None)
                raise QueueFull(max(1, round(busy * self._mean_seconds)))
            job.number = next(self._numbers)
            self._queue.append(job)
            self.observer.queue_depth(len(self._queue))
            self._cond.notify()
        return job

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def closing(self) -> bool:
        return self._closing

    def shutdown(self, grace: float) -> None:
        """Stop taking jobs, finish what is there within ``grace`` seconds, end the rest with
        an error; returns when the worker has stopped (call it from a thread, not the loop)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(grace)
        if self._thread.is_alive():
            with self._cond:
                self._abort = True
                self._cond.notify_all()
            self._thread.join()

    # -- the worker -------------------------------------------------------------------------

    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            job = self._queue.popleft()
            self._running = job
            self.observer.queue_depth(len(self._queue))
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            start = time.monotonic()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - start)

    def _stopped(self, job: Job) -> JobError | None:
        """Why ``job`` must end now, if it must."""
        if self._abort:
            return ShuttingDown()
        # Before the cancellation: the HTTP side cancels a job whose deadline it saw pass.
        if time.monotonic() > job.deadline:
            return timeout_error(self.timeout)
        if job.cancelled.is_set():
            return JobError(499, "the client closed the request", "cancelled", "client_closed")
        return None

    def _run(self, job: Job) -> None:
        reason = self._stopped(job)
        if reason is not None:
            self._abandon(job, reason)
            return
        last = time.monotonic()
        first = True
        events = self.engine.generate(job.ids, job.sampling)
        try:
            for event in events:
                if isinstance(event, Outcome):
                    self.observer.outcome(job, event)
                    job._send(event)
                    return
                now = time.monotonic()
                self.observer.step(job, event, now - (job.submitted if first else last), first)
                last, first = now, False
                job._send(event)
                reason = self._stopped(job)
                if reason is not None:
                    self._abandon(job, reason)
                    return
        except Exception as err:  # a bug or a bad input the checks missed: report, keep serving
            status = 400 if isinstance(err, ValueError | TypeError) else 500
            kind = "invalid_request_error" if status == 400 else "server_error"
            self._abandon(job, JobError(status, f"{type(err).__name__}: {err}", kind))
        finally:
            close: Callable[[], Any] | None = getattr(events, "close", None)
            if close is not None:
                close()

    def _abandon(self, job: Job, reason: JobError) -> None:
        self.observer.abandoned(job, reason.code or reason.type)
        job._send(reason)
