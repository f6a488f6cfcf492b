"""Prometheus metrics of ``dart serve`` (one registry per app, served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dart_client.apps.serve.generation import Outcome, Step
from dart_client.apps.serve.scheduler import Job, Observer

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 5.0, 10.0, 30.0)
STAGE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class Metrics(Observer):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dart_serve_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.depth = Gauge("dart_serve_queue_depth", "requests waiting for the worker", registry=r)
        self.ttft = Histogram(
            "dart_serve_time_to_first_token_seconds",
            "from a request's submission to its first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "dart_serve_inter_token_latency_seconds",
            "time between a request's tokens (a step's time shared by the tokens it made)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "dart_serve_generated_tokens", "tokens generated", ["mode"], registry=r
        )
        self.prompt_tokens = Counter(
            "dart_serve_prompt_tokens", "prompt tokens of the requests run", registry=r
        )
        self.tau = Histogram(
            "dart_serve_tau",
            "a speculative request's mean tokens per target forward",
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0),
            registry=r,
        )
        self.accept_length = Histogram(
            "dart_serve_accept_length",
            "tokens a speculative step produced (accepted drafts + the bonus token)",
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16),
            registry=r,
        )
        self.stage = Histogram(
            "dart_serve_step_stage_seconds",
            "a step's time in each stage (prefill, draft, prune, inputs, verify, ...)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.abandoned_jobs = Counter(
            "dart_serve_abandoned",
            "requests ended before their outcome, by reason",
            ["reason"],
            registry=r,
        )

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    # -- Observer -------------------------------------------------------------------------------

    def queue_depth(self, depth: int) -> None:
        self.depth.set(depth)

    def step(self, job: Job, step: Step, seconds_since_last: float, first: bool) -> None:
        self.tokens.labels("dart" if job.sampling.speculative else "ar").inc(step.tokens)
        if first:
            self.ttft.observe(seconds_since_last)
            self.prompt_tokens.inc(len(job.ids))
        elif step.tokens:
            per_token = seconds_since_last / step.tokens
            for _ in range(step.tokens):
                self.itl.observe(per_token)
        if not first and job.sampling.speculative:
            self.accept_length.observe(step.accept_length)
        for stage, seconds in step.timings.items():
            self.stage.labels(stage).observe(seconds)

    def outcome(self, job: Job, outcome: Outcome) -> None:
        if outcome.mode == "dart" and outcome.steps:
            self.tau.observe(outcome.tau)

    def abandoned(self, job: Job, reason: str) -> None:
        self.abandoned_jobs.labels(reason).inc()
