"""One worker thread owns the model; a bounded first-come-first-served queue feeds it.

A :class:`Job` is one request's generation. The HTTP side submits it and reads its
:class:`asyncio.Queue` of messages (``Step``, then ``Outcome``, or a :class:`JobError`);
the worker (``DartModel`` is not thread-safe) runs one job at a time, or with ``max_batch``
> 1 up to that many together, fused (continuous batching,
:class:`~dart_client.decoding.batch.BatchGenerator`: jobs join and leave between steps). It
checks between steps whether a job was cancelled (client gone), timed out, or the server is
shutting down. Every job ends with exactly one final message, so no request is lost silently.
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

from dart_client.apps.serve.generation import (
    Engine,
    Outcome,
    PromptScores,
    Sampling,
    Step,
    outcome_of,
    step_of,
)


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
    messages: asyncio.Queue[PromptScores | Step | Outcome | JobError] = field(
        default_factory=asyncio.Queue
    )
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    number: int = 0

    def cancel(self) -> None:
        """Called when the client goes away: the worker drops the job at its next step."""
        self.cancelled.set()

    def _send(self, message: PromptScores | Step | Outcome | JobError) -> None:
        self.loop.call_soon_threadsafe(self.messages.put_nowait, message)


class Observer:
    """What the scheduler reports (the metrics): no-ops by default."""

    def queue_depth(self, depth: int) -> None: ...
    def step(self, job: Job, step: Step, seconds_since_last: float, first: bool) -> None: ...
    def outcome(self, job: Job, outcome: Outcome) -> None: ...
    def abandoned(self, job: Job, reason: str) -> None: ...


class Scheduler:
    """``submit`` jobs; one worker thread runs them in arrival order.

    ``max_queue``: jobs waiting (not counting the running ones) before ``submit`` raises
    :class:`QueueFull`. ``timeout``: seconds from submission after which a job ends with a
    504 error (waiting or running). ``shutdown(grace)`` refuses new jobs, lets the queued and
    running ones finish for up to ``grace`` seconds, then ends the rest with a 503 error.
    ``max_batch``: jobs decoded together (1: one at a time).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int,
        timeout: float,
        observer: Observer | None = None,
        max_batch: int = 1,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.timeout = timeout
        self.observer = observer or Observer()
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._abort = False  # grace is over: end every job now
        self._running: Job | None = None
        #: Jobs being decoded together (``max_batch`` > 1).
        self._live = 0
        self._numbers = itertools.count(1)
        self._mean_seconds = 5.0  # running mean of a job's time, for Retry-After
        work = self._work if max_batch == 1 else self._work_batched
        self._thread = threading.Thread(target=work, name="dart-serve-worker", daemon=True)
        self._thread.start()

    # -- the HTTP side ----------------------------------------------------------------------

    def submit(self, ids: list[int], sampling: Sampling) -> Job:
        (job,) = self.submit_all([(ids, sampling)])
        return job

    def submit_all(self, generations: list[tuple[list[int], Sampling]]) -> list[Job]:
        """One job per (prompt ids, sampling): a request's prompts and ``n`` choices, queued
        together or not at all (:class:`QueueFull` when the queue has no room for all)."""
        deadline = time.monotonic() + self.timeout
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, sampling, deadline, loop) for ids, sampling in generations]
        with self._cond:
            if self._closing:
                raise ShuttingDown()
            if len(self._queue) + len(jobs) > self.max_queue:
                busy = len(self._queue) + (self._running is not None) + self._live
                raise QueueFull(max(1, round(busy * self._mean_seconds)))
            for job in jobs:
                job.number = next(self._numbers)
                self._queue.append(job)
            self.observer.queue_depth(len(self._queue))
            self._cond.notify()
        return jobs

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
            if self._score_prompt(job):
                return
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
            self._fail(job, err)
        finally:
            close: Callable[[], Any] | None = getattr(events, "close", None)
            if close is not None:
                close()

    def _score_prompt(self, job: Job) -> bool:
        """Send the prompt's log probabilities first when the job asks for them (``echo``);
        True when that was all it asked (no new token: the job has ended)."""
        top = job.sampling.prompt_logprobs
        if top is not None:
            job._send(self.engine.prompt_scores(job.ids, top))
        if job.sampling.max_new_tokens > 0:
            return False
        outcome = self.engine.no_completion(job.sampling)
        self.observer.outcome(job, outcome)
        job._send(outcome)
        return True

    def _abandon(self, job: Job, reason: JobError) -> None:
        self.observer.abandoned(job, reason.code or reason.type)
        job._send(reason)

    # -- the batched worker -----------------------------------------------------------------

    def _admit(self, live: int) -> list[Job] | None:
        """Jobs to start now: as many queued ones as there are free rows (waiting for one
        when nothing runs); None when the worker is to stop."""
        with self._cond:
            while not self._queue and not live:
                if self._closing:
                    return None
                self._cond.wait()
            jobs = []
            while self._queue and live + len(jobs) < self.max_batch:
                jobs.append(self._queue.popleft())
            if jobs:
                self.observer.queue_depth(len(self._queue))
            return jobs

    def _work_batched(self) -> None:
        engine = self.engine
        # One per mode in use (a "dart" one needs the head): made on first use.
        generators: dict[str, Any] = {}
        live: dict[tuple[str, int], Job] = {}
        last: dict[Job, float] = {}
        while (jobs := self._admit(len(live))) is not None:
            for job in jobs:
                reason = self._stopped(job)
                if reason is not None:
                    self._abandon(job, reason)
                    continue
                mode = engine.mode(job.sampling)
                try:
                    # Before it joins: the batch waits for this one forward, as for a prefill.
                    if self._score_prompt(job):
                        continue
                    config = engine.config(job.ids, job.sampling, self.max_batch)
                    if mode not in generators:
                        generators[mode] = engine.batch_generator(mode, self.max_batch)
                    request = generators[mode].add(
                        config, input_ids=job.ids, stream_text=job.sampling.stream
                    )
                except Exception as err:  # a bad input the checks missed: report, serve on
                    self._fail(job, err)
                    continue
                live[(mode, request)] = job
            self._live = len(live)
            for mode, batch in list(generators.items()):
                if batch.done:
                    continue
                try:
                    events = batch.step()
                except Exception as err:  # a bug: every job of this batch gets the error
                    for key in [k for k in live if k[0] == mode]:
                        self._fail(live.pop(key), err)
                    generators[mode] = engine.batch_generator(mode, self.max_batch)
                    continue
                now = time.monotonic()
                for request, event in events:
                    job = live[(mode, request)]
                    step = step_of(event)
                    first = job not in last
                    since = job.submitted if first else last[job]
                    self.observer.step(job, step, now - since, first)
                    last[job] = now
                    job._send(step)
                for request, result in batch.pop_finished().items():
                    job = live.pop((mode, request))
                    last.pop(job, None)
                    outcome = outcome_of(result)
                    self.observer.outcome(job, outcome)
                    job._send(outcome)
                    self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (now - job.submitted)
                for key in [k for k in live if k[0] == mode]:
                    reason = self._stopped(live[key])
                    if reason is not None:
                        batch.cancel(key[1])
                        job = live.pop(key)
                        last.pop(job, None)
                        self._abandon(job, reason)
            self._live = len(live)
        self._live = 0

    def _fail(self, job: Job, err: Exception) -> None:
        status = 400 if isinstance(err, ValueError | TypeError) else 500
        kind = "invalid_request_error" if status == 400 else "server_error"
        self._abandon(job, JobError(status, f"{type(err).__name__}: {err}", kind))
