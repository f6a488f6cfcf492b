"""``dart serve`` against the official ``openai`` client: live servers on loopback with the
embedded default (SmolLM2-135M-Instruct, its shipped head, the ShareGPT 3-gram) in fp32, so
DART's greedy output is token for token the target's own, which the tests compute in-process
with ``ar_generate`` as the reference."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="dart serve needs the `serve` extra (fastapi)")
pytest.importorskip("uvicorn", reason="dart serve needs the `serve` extra (uvicorn)")
pytest.importorskip("prometheus_client", reason="dart serve needs the `serve` extra")
openai = pytest.importorskip("openai", reason="the tests drive the server with `openai`")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parent.parent
API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
#: A prompt the model continues for a long time (it counts on).
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Name a famous physicist.",
    "Give me a synonym for happy.",
]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def client(self, **kwargs: Any) -> Any:
        kwargs.setdefault("api_key", API_KEY)
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.url + "/v1", **kwargs)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` that carry ``labels``."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            head, _, value = line.rpartition(" ")
            key = head[len(name) :]
            if not line.startswith(name) or (key and not key.startswith("{")):
                continue  # a comment or another metric (name_created, name_bucket)
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += float(value)
        return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(tmp: Path, *flags: str) -> Server:
    """Start ``dart serve`` (fp32, the embedded default) on a free loopback port."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DART_API_KEY", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dart_client.apps.cli",
            "serve",
            "--dtype=fp32",
            f"--port={port}",
            f"--max-model-len={MAX_MODEL_LEN}",
            "--log-level=warning",
            *flags,
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
    )
    return Server(proc, f"http://127.0.0.1:{port}", log)


def ready(server: Server) -> Server:
    """Wait until the server answers /health."""
    deadline = time.monotonic() + 600  # the first run builds the embedded n-gram
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(
                f"dart serve exited {server.proc.returncode}:\n{server.log.read_text()}"
            )
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    server.proc.kill()
    raise AssertionError(f"dart serve did not come up:\n{server.log.read_text()}")


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Both servers, started together (they load while the first tests run):

    * ``main``: an API key, a queue for the load test;
    * ``batched``: the same, decoding up to 4 requests together (continuous batching), with
      the default ``--tree-budget auto`` (tuned at its start for 1, 2 and 4 rows);
    * ``small``: a queue of one, an 8 s timeout, a 6 s shutdown grace, no API key."""
    tmp = tmp_path_factory.mktemp("serve")
    # The batched server tunes its trees at start (1, 2 and 4 rows) on one short prompt of
    # its own (--tune-prompts): the built-in four take longer, and that path is tested here.
    tune = tmp / "tune.jsonl"
    tune.write_text(json.dumps({"prompt": QUESTIONS[0]}) + "\n")
    started = {
        "main": spawn(tmp, f"--api-key={API_KEY}", "--max-queue=256", "--tree-budget=60"),
        "batched": spawn(
            tmp,
            f"--api-key={API_KEY}",
            "--max-queue=256",
            "--max-batch=4",
            f"--tune-prompts={tune}",
        ),
        "small": spawn(
            tmp, "--max-queue=1", "--timeout=8", "--shutdown-grace=6", "--tree-budget=60"
        ),
    }
    yield started
    for s in started.values():
        stop(s)


@pytest.fixture(scope="module")
def server(servers: dict[str, Server]) -> Server:
    return ready(servers["main"])


@pytest.fixture(scope="module")
def batched(servers: dict[str, Server]) -> Server:
    return ready(servers["batched"])


@pytest.fixture(scope="module")
def small(servers: dict[str, Server]) -> Server:
    return ready(servers["small"])


@pytest.fixture(scope="module")
def reference() -> Any:
    """The target alone (fp32), loaded in-process the way `dart generate --ar` loads it."""
    import torch

    from dart_client.dart_model import build_model

    torch.set_num_threads(1)
    return build_model(None, None, None, dtype="fp32", ar=True)


def greedy(model: Any, max_tokens: int, **inputs: Any) -> Any:
    from dart_client import ar_generate

    return ar_generate(model, temperature=0.0, max_new_tokens=max_tokens, **inputs)


def chat_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def finish(result: Any) -> str:
    return "length" if result.finish_reason == "length" else "stop"


# -- the main server ------------------------------------------------------------------------------


def test_models_health_and_api_key(server: Server) -> None:
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    (model,) = server.client().models.list().data
    assert model.id == "dart-smollm2-135m-instruct"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    r = httpx.post(server.url + "/v1/completions", json={"model": model.id, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "dart_serve_requests_total" in httpx.get(server.url + "/metrics").text


def test_an_idle_connection_stays_open_past_uvicorns_five_seconds(server: Server) -> None:
    """``--keep-alive`` (75 s): a client that waits longer than uvicorn's default 5 s between
    requests (queued clients of a busy server do) reuses its connection; with the default the
    server closed it, and a request sent as it closed failed with "server disconnected"."""
    host, port = server.url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    def response(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < length(data):
            chunk = conn.recv(4096)
            if not chunk:
                return data  # the server closed the connection
            data += chunk
        return data

    def length(data: bytes) -> int:
        head = data.partition(b"\r\n\r\n")[0].lower()
        return (
            int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            if b"content-length:" in head
            else 0
        )

    with socket.create_connection((host, int(port)), timeout=10) as conn:
        for _ in range(2):
            conn.sendall(request)
            reply = response(conn)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"}"), reply
            time.sleep(6)


@pytest.mark.parametrize("speculative", [True, False])
def test_chat_equals_the_greedy_output_streamed_and_not(
    server: Server, reference: Any, speculative: bool
) -> None:
    client = server.client()
    question = QUESTIONS[0]
    ref = greedy(reference, 40, messages=chat_messages(question))
    extra = {"speculative": speculative}
    resp = client.chat.completions.create(
        model="dart-smollm2-135m-instruct",
        messages=chat_messages(question),
        max_tokens=40,
        temperature=0,
        extra_body=extra,
    )
    choice = resp.choices[0]
    assert choice.message.content == ref.text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == finish(ref)
    assert resp.usage.completion_tokens == len(ref.tokens)
    assert resp.usage.prompt_tokens == ref.prompt_tokens
    assert resp.usage.total_tokens == ref.prompt_tokens + len(ref.tokens)
    assert resp.model_extra["dart"]["mode"] == ("dart" if speculative else "ar")

    chunks = list(
        client.chat.completions.create(
            model="dart-smollm2-135m-instruct",
            messages=chat_messages(question),
            max_completion_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish(ref)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert len({c.id for c in chunks}) == 1


def test_completions_stop_strings_and_max_tokens(server: Server, reference: Any) -> None:
    client = server.client()
    prompt = "The three most common programming languages are"
    ref = greedy(reference, 32, prompt=prompt)
    resp = client.completions.create(
        model="dart-smollm2-135m-instruct", prompt=prompt, max_tokens=32, temperature=0
    )
    assert resp.choices[0].text == ref.text
    assert resp.usage.completion_tokens == len(ref.tokens)
    streamed = client.completions.create(
        model="dart-smollm2-135m-instruct",
        prompt=prompt,
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed) == ref.text

    # A stop string from the middle of the greedy text: the output ends before it.
    words = ref.text.split()
    stop_word = words[len(words) // 2]
    cut = ref.text[: ref.text.find(stop_word)]
    for stream in (False, True):
        out = client.completions.create(
            model="dart-smollm2-135m-instruct",
            prompt=prompt,
            max_tokens=32,
            temperature=0,
            stop=[stop_word, "\u2603never"],
            stream=stream,
        )
        if stream:
            parts = list(out)
            text = "".join(c.choices[0].text for c in parts)
            reason = [c.choices[0].finish_reason for c in parts][-1]
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (cut, "stop"), stream

    short = client.completions.create(
        model="dart-smollm2-135m-instruct", prompt=prompt, max_tokens=5, temperature=0
    )
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    assert ref.text.startswith(short.choices[0].text)


@pytest.mark.parametrize("kind", ["main", "batched"])
def test_logprobs_are_the_targets_own_streamed_and_not(
    kind: str, request: pytest.FixtureRequest, reference: Any
) -> None:
    """Chat (``logprobs``/``top_logprobs``) and completions (``logprobs: k``), streamed and
    not, one request at a time and batched: each token's log probability and alternatives
    are the target's own (the in-process autoregressive reference's, within fp32's rounding
    of a tree forward), the tokens spell the text, and a greedy token is its own first
    alternative."""
    server = request.getfixturevalue("server" if kind == "main" else "batched")
    client = server.client()
    tok = reference.tokenizer
    common = {"model": "dart-smollm2-135m-instruct", "max_tokens": 16, "temperature": 0}

    def check(ref: Any, tokens: list[str], logprobs: list[float], tops: list[Any]) -> None:
        assert len(tokens) == len(ref.tokens)
        assert "".join(tokens) == ref.text
        for i, want in enumerate(ref.logprobs):
            assert tokens[i] == tok.decode([want.token]), i
            assert logprobs[i] == pytest.approx(want.logprob, abs=2e-3), i
            assert [t for t, _ in tops[i]] == [tok.decode([t]) for t, _ in want.top], i
            assert [lp for _, lp in tops[i]] == pytest.approx([lp for _, lp in want.top], abs=2e-3)
            assert tops[i][0] == (tokens[i], logprobs[i])

    messages = chat_messages(QUESTIONS[4])
    ref = reference.generate(messages=messages, max_new_tokens=16, logprobs=3, mode="ar")
    resp = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=3, **common
    )
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == ref.text
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    pairs = [[(t.token, t.logprob) for t in c.top_logprobs] for c in content]
    check(ref, [c.token for c in content], [c.logprob for c in content], pairs)
    chunks = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=3, stream=True, **common
    )
    streamed = [
        c
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(messages=messages, **common)
    assert plain.choices[0].logprobs is None

    prompt = "The three most common programming languages are"
    ref = reference.generate(prompt=prompt, max_new_tokens=16, logprobs=3, mode="ar")
    for stream in (False, True):
        out = client.completions.create(prompt=prompt, logprobs=3, stream=stream, **common)
        parts = list(out) if stream else [out]
        tokens, logprobs, tops, offsets = [], [], [], []
        for part in parts:
            lp = part.choices[0].logprobs
            if lp is None:
                continue
            tokens += lp.tokens
            logprobs += lp.token_logprobs
            tops += [sorted(d.items(), key=lambda kv: -kv[1]) for d in lp.top_logprobs]
            offsets += lp.text_offset
        assert "".join(p.choices[0].text for p in parts) == ref.text
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
        check(ref, tokens, logprobs, tops)


@pytest.mark.parametrize("kind", ["main", "batched"])
def test_n_choices_are_generations_of_their_own(
    kind: str, request: pytest.FixtureRequest, reference: Any
) -> None:
    """``n`` choices, streamed and not: each is a generation (greedy: the greedy output; with a
    seed: choice i is the request with seed + i, decoded one at a time), the chunks carry
    their choice's index, usage counts every choice's tokens."""
    server = request.getfixturevalue("server" if kind == "main" else "batched")
    client = server.client()
    common = {"model": "dart-smollm2-135m-instruct", "max_tokens": 12}
    messages = chat_messages(QUESTIONS[1])
    ref = greedy(reference, 12, messages=messages)
    resp = client.chat.completions.create(messages=messages, n=3, temperature=0, **common)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == [ref.text] * 3
    assert resp.usage.completion_tokens == 3 * len(ref.tokens)
    assert resp.usage.prompt_tokens == ref.prompt_tokens

    sampled = {"temperature": 1.0, "seed": 11, **common}
    many = client.completions.create(prompt="Once upon a time", n=3, **sampled)
    texts = [c.text for c in many.choices]
    assert len(set(texts)) > 1  # three seeds, three samples
    if kind == "main":  # one at a time, a fixed tree: the same draws as alone
        for i, text in enumerate(texts):
            alone = client.completions.create(
                prompt="Once upon a time", **{**sampled, "seed": 11 + i}
            )
            assert alone.choices[0].text == text, i
    chunks = list(
        client.completions.create(
            prompt="Once upon a time",
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            **sampled,
        )
    )
    streamed = ["", "", ""]
    finished = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == many.usage.completion_tokens
    if kind == "main":
        assert streamed == texts


@pytest.mark.parametrize("kind", ["main", "batched"])
def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(
    kind: str, request: pytest.FixtureRequest, reference: Any
) -> None:
    """``echo`` with ``logprobs`` and one new token (lm-evaluation-harness's loglikelihood
    request) or none: the prompt comes back first, its tokens scored by the target (the first
    one unscored), checked against one plain transformers forward; streamed the same; one at
    a time and batched."""
    import torch

    server = request.getfixturevalue("server" if kind == "main" else "batched")
    client = server.client()
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = reference.encode_input(prompt=prompt)
    with torch.no_grad():
        logits = reference.target.model(torch.tensor([ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].tolist()
    ref = greedy(reference, 1, prompt=prompt)
    common = {"model": "dart-smollm2-135m-instruct", "max_tokens": 1, "temperature": 0}
    out = client.completions.create(prompt=prompt, echo=True, logprobs=1, **common)
    choice = out.choices[0]
    assert choice.text == prompt + ref.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert "".join(lp.tokens) == prompt + ref.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=2e-3)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    # The continuation's token: scored like the others, and the greedy one.
    (top,) = lp.top_logprobs[-1].items()
    assert top == (lp.tokens[-1], lp.token_logprobs[-1])
    chunks = list(
        client.completions.create(prompt=prompt, echo=True, logprobs=1, stream=True, **common)
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    plain = client.completions.create(prompt=ids, echo=True, **common)
    assert plain.choices[0].text == reference.tokenizer.decode(ids) + ref.text
    assert plain.choices[0].logprobs is None
    # max_tokens 0 (scoring tools send it): the prompt scored, nothing generated.
    scored = client.completions.create(
        prompt=prompt, echo=True, logprobs=1, **{**common, "max_tokens": 0}
    )
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.tokens == lp.tokens[: len(ids)]
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(prompt=prompt, **{**common, "max_tokens": 0})


def test_ignore_eos_generates_to_max_tokens(server: Server, reference: Any) -> None:
    """vLLM's ``ignore_eos`` (benchmarks fix output lengths with it): the answer runs through
    its end-of-turn token to ``max_tokens``, starting with the answer that stops there."""
    client = server.client()
    messages = chat_messages(QUESTIONS[0])
    ref = greedy(reference, 40, messages=messages)
    assert ref.finish_reason == "eos" and len(ref.tokens) < 40  # what makes the test able to fail
    common = {"model": "dart-smollm2-135m-instruct", "max_tokens": 40, "temperature": 0}
    resp = client.chat.completions.create(messages=messages, **common)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(ref.tokens)
    long = client.chat.completions.create(
        messages=messages, extra_body={"ignore_eos": True}, **common
    )
    assert long.choices[0].finish_reason == "length"
    assert long.usage.completion_tokens == 40
    assert long.choices[0].message.content.startswith(ref.text)
    # vLLM's stop_token_ids: the answer's 3rd token ends it (kept as its last), ignore_eos or not.
    stop = ref.tokens[2]
    cut = client.chat.completions.create(
        messages=messages, extra_body={"ignore_eos": True, "stop_token_ids": [stop]}, **common
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == ref.tokens.index(stop) + 1
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "stop_token_ids": [10**7], **common},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"
    # vLLM's min_tokens: the stop id (the 3rd token) may not end the answer before 6 tokens,
    # so the answer runs past it, as the reference does with the same setting.
    held = client.chat.completions.create(
        messages=messages, extra_body={"stop_token_ids": [stop], "min_tokens": 6}, **common
    )
    want = greedy(reference, 40, messages=messages, stop_token_ids=[stop], min_tokens=6)
    assert held.usage.completion_tokens == len(want.tokens) > ref.tokens.index(stop) + 1
    assert held.choices[0].message.content == want.text
    too_many = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "min_tokens": 41, **common},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize("kind", ["main", "batched"])
def test_a_batch_of_prompts_in_one_completions_request(
    kind: str, request: pytest.FixtureRequest, reference: Any
) -> None:
    """OpenAI's list of prompts (texts or token id lists; evaluation harnesses batch so):
    choice i answers prompt i // n, usage counts every prompt once per request."""
    server = request.getfixturevalue("server" if kind == "main" else "batched")
    client = server.client()
    prompts = ["The three primary colors are", "def add(a, b):"]
    refs = [greedy(reference, 10, prompt=p) for p in prompts]
    common = {"model": "dart-smollm2-135m-instruct", "max_tokens": 10, "temperature": 0}
    out = client.completions.create(prompt=prompts, n=2, **common)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [r.text for r in refs for _ in range(2)]
    assert out.usage.prompt_tokens == sum(r.prompt_tokens for r in refs)
    assert out.usage.completion_tokens == 2 * sum(len(r.tokens) for r in refs)
    ids = [reference.encode_input(prompt=p) for p in prompts]
    by_ids = client.completions.create(prompt=ids, echo=True, **common)
    assert [c.text for c in by_ids.choices] == [
        reference.tokenizer.decode(i) + r.text for i, r in zip(ids, refs, strict=True)
    ]
    chunks = client.completions.create(prompt=prompts, stream=True, **common)
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [r.text for r in refs]


def test_the_serving_benchmark_measures_what_the_server_answers(
    server: Server, reference: Any
) -> None:
    """``python -m dart_client.apps.serve.bench``'s load and report against this server:
    the texts are the greedy ones, the counts add up, and ``--ignore-eos`` fixes every
    output at ``max_tokens``."""
    import asyncio

    from dart_client.apps.serve import bench

    model = "dart-smollm2-135m-instruct"
    items = QUESTIONS[:3]
    for ignore_eos in (False, True):
        samples, wall = asyncio.run(
            bench.load(server.url, API_KEY, model, items, 12, 2, True, ignore_eos)
        )
        report = bench.summary(samples, wall)
        assert report["requests"] == 3 and report["output_tokens"] == sum(s.tokens for s in samples)
        assert 0 < report["ttft_p50_s"] <= wall and report["mean_tau"] >= 1.0
        for question, sample in zip(items, samples, strict=True):
            ref = greedy(reference, 12, messages=chat_messages(question))
            if ignore_eos:
                assert sample.tokens == 12 and sample.text.startswith(ref.text)
            else:
                assert sample.text == ref.text and sample.tokens == len(ref.tokens)


def test_raw_stream_ends_with_done(server: Server) -> None:
    body = {
        "model": "dart-smollm2-135m-instruct",
        "messages": chat_messages(QUESTIONS[3]),
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["object"] == "chat.completion.chunk"
    assert last["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server.url + "/v1/chat/completions"
    name = "dart-smollm2-135m-instruct"
    good = {"model": name, "messages": chat_messages("Hi"), "max_tokens": 3, "temperature": 0}
    long_prompt = " ".join(["word"] * (MAX_MODEL_LEN + 50))
    cases: list[tuple[Any, int, str | None]] = [
        ("{not json", 400, None),
        ({**good, "max_tokens": "many"}, 400, "max_tokens"),
        ({**good, "messages": "hello"}, 400, "messages"),
        ({**good, "model": "gpt-4"}, 404, "model"),
        ({**good, "n": 0}, 400, "n"),
        ({**good, "n": 65}, 400, "n"),
        ({**good, "temperature": -0.5}, 400, "temperature"),
        ({**good, "messages": chat_messages(long_prompt)}, 400, "messages"),
        ({**good, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ({**good, "top_logprobs": 3}, 400, "top_logprobs"),  # needs logprobs: true
        ({**good, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({**good, "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({**good, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ]
    for body, status, param in cases:
        if isinstance(body, str):
            r = httpx.post(
                url, content=body, headers={**headers, "content-type": "application/json"}
            )
        else:
            r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == status, (body if not isinstance(body, dict) else param, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text
        if param is not None:
            assert error["param"] == param, r.text
    r = httpx.post(url, json={**good, "messages": chat_messages(long_prompt)}, headers=headers)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # The same through the official client's exception types.
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=chat_messages("x"))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="x", max_tokens=MAX_MODEL_LEN + 1)
    assert httpx.post(url, json=good, headers=headers).status_code == 200
    assert server.metric("dart_serve_requests_total", status="400") >= 8


@pytest.mark.parametrize("kind", ["main", "batched"])
def test_load_every_output_is_the_greedy_one_none_lost(
    kind: str, request: pytest.FixtureRequest, reference: Any
) -> None:
    """32 concurrent clients, 48 requests over 8 prompts (chat and completions, streamed and
    not, DART and plain): every answer is its prompt's greedy output, every request answered
    once, and the server's memory does not grow from one half of the load to the next; one
    request at a time, and 4 decoded together."""
    server = request.getfixturevalue("server" if kind == "main" else "batched")
    max_tokens = 8
    refs = {q: greedy(reference, max_tokens, messages=chat_messages(q)).text for q in QUESTIONS}
    client = server.client(timeout=300)
    name = "dart-smollm2-135m-instruct"

    def one(i: int) -> tuple[int, str, str]:
        q = QUESTIONS[i % len(QUESTIONS)]
        extra = {"speculative": i % 3 != 0}
        if i % 2:
            chunks = client.chat.completions.create(
                model=name,
                messages=chat_messages(q),
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            return i, q, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        resp = client.chat.completions.create(
            model=name,
            messages=chat_messages(q),
            max_tokens=max_tokens,
            temperature=0,
            extra_body=extra,
        )
        return i, q, resp.choices[0].message.content

    rss = []
    seen: list[int] = []
    with ThreadPoolExecutor(32) as pool:
        for half in range(2):
            for i, q, text in pool.map(one, range(half * 24, half * 24 + 24)):
                seen.append(i)
                assert text == refs[q], (i, q)
            rss.append(server.rss_mib())
    assert sorted(seen) == list(range(48))
    assert rss[1] - rss[0] < 64, rss
    assert server.metric("dart_serve_queue_depth") == 0


def test_batched_requests_join_and_leave_while_a_long_one_streams(
    batched: Server, reference: Any
) -> None:
    """Continuous batching: short requests sent while a long one streams are answered (their
    greedy output) before it ends; closing the long stream cancels it and frees its row."""
    long = batched.client().completions.create(
        model="dart-smollm2-135m-instruct",
        prompt=COUNTING,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"speculative": False},
    )
    chunks = iter(long)
    next(chunks)
    client = batched.client()
    q = QUESTIONS[0]
    want = greedy(reference, 6, messages=chat_messages(q)).text
    for _ in range(3):
        resp = client.chat.completions.create(
            model="dart-smollm2-135m-instruct",
            messages=chat_messages(q),
            max_tokens=6,
            temperature=0,
        )
        assert resp.choices[0].message.content == want
        next(chunks)  # the long one is still streaming
    long.close()
    wait_for(lambda: batched.metric("dart_serve_queue_depth") == 0)
    resp = client.chat.completions.create(
        model="dart-smollm2-135m-instruct", messages=chat_messages(q), max_tokens=6, temperature=0
    )
    assert resp.choices[0].message.content == want


def test_the_batched_server_tuned_its_trees_before_serving(batched: Server) -> None:
    """--tree-budget auto (the default) tunes at the start, for a lone request and per row of
    2 and of 4 (--max-batch) rows; each lands in the log (tuned now, or read from the cache)."""
    log = batched.log.read_text()
    assert re.search(r"tree budget \d+, tuned (in|earlier)", log), log
    for rows in (2, 4):
        tuned = rf"tree budget \d+ per row of {rows} decoded together, tuned (in|earlier)"
        assert re.search(tuned, log), log


# -- the small server: queue of one, timeout, cancellation, shutdown -----------------------------


def long_stream(server: Server, max_tokens: int = 400) -> Any:
    return server.client(api_key="unused").completions.create(
        model="dart-smollm2-135m-instruct",
        prompt=COUNTING,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"speculative": False},
    )


def wait_for(predicate: Any, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_full_queue_is_429_and_a_disconnect_cancels(small: Server) -> None:
    # Counters are the server's (module-scoped, shared with the tests pytest-xdist runs on
    # the same worker, in any order): each test checks what it adds.
    closed = small.metric("dart_serve_abandoned_total", reason="client_closed")
    running = long_stream(small)
    first = next(iter(running))  # the long request holds the worker
    assert first.choices[0].text is not None
    queued: dict[str, Any] = {}

    def short() -> None:
        queued["resp"] = small.client(api_key="x").completions.create(
            model="dart-smollm2-135m-instruct", prompt="Hello", max_tokens=4, temperature=0
        )

    t = threading.Thread(target=short)
    t.start()
    wait_for(lambda: httpx.get(small.url + "/health").json()["queue_depth"] == 1)
    r = httpx.post(
        small.url + "/v1/completions",
        json={"model": "dart-smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2},
    )
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    # Closing the stream cancels the long request at its next step: the queued one runs.
    start = time.monotonic()
    running.close()
    t.join(30)
    assert queued["resp"].usage.completion_tokens == 4
    assert time.monotonic() - start < 8
    wait_for(
        lambda: small.metric("dart_serve_abandoned_total", reason="client_closed") == closed + 1
    )


def test_a_non_streamed_request_is_dropped_when_its_client_leaves(small: Server) -> None:
    body = {
        "model": "dart-smollm2-135m-instruct",
        "prompt": COUNTING,
        "max_tokens": 400,
        "temperature": 0,
        "speculative": False,
    }
    closed = small.metric("dart_serve_abandoned_total", reason="client_closed")
    dropped = small.metric("dart_serve_requests_total", status="499")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=2))
    wait_for(
        lambda: small.metric("dart_serve_abandoned_total", reason="client_closed") == closed + 1,
        10,
    )
    assert small.metric("dart_serve_requests_total", status="499") == dropped + 1


def test_timeout_is_a_504_and_the_worker_moves_on(small: Server) -> None:
    timeouts = small.metric("dart_serve_abandoned_total", reason="timeout")
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        small.client(api_key="x").completions.create(
            model="dart-smollm2-135m-instruct",
            prompt=COUNTING,
            max_tokens=400,
            temperature=0,
            extra_body={"speculative": False},
        )
    assert err.value.status_code == 504
    assert 8 <= time.monotonic() - start < 20
    resp = small.client(api_key="x").completions.create(
        model="dart-smollm2-135m-instruct", prompt="Hello", max_tokens=2, temperature=0
    )
    assert resp.usage.completion_tokens == 2
    assert small.metric("dart_serve_abandoned_total", reason="timeout") == timeouts + 1


def test_sigterm_finishes_in_flight_and_ends_the_rest_with_503(small: Server) -> None:
    """SIGTERM with a 6 s grace (3 s failed once on a loaded 2-core machine): the running
    short request finishes, the queued long one runs until the grace is over and ends with a
    shutting-down error; a new request gets 503; the process exits 0. No request is left
    without an answer."""
    name = "dart-smollm2-135m-instruct"
    short = small.client(api_key="x").completions.create(
        model=name, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
    )
    chunks = iter(short)
    first = next(chunks)
    results: dict[str, Any] = {}

    def long() -> None:
        body = {
            "model": name,
            "prompt": COUNTING,
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
            "speculative": False,
        }
        with httpx.stream("POST", small.url + "/v1/completions", json=body, timeout=60) as r:
            results["long"] = [line for line in r.iter_lines() if line]

    t = threading.Thread(target=long)
    t.start()
    wait_for(lambda: httpx.get(small.url + "/health").json()["queue_depth"] == 1)
    small.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(small.url + "/health").status_code == 503, 10)
    r = httpx.post(small.url + "/v1/completions", json={"model": name, "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    rest = [first, *chunks]
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    t.join(60)
    lines = results["long"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert len(lines) > 3  # it ran during the grace
    assert small.proc.wait(30) == 0
