"""``tree_budget="auto"``: pick the draft-tree size that maximises tokens/s on this machine.

A bigger tree accepts more tokens per step but costs more to verify, and where the balance
lies depends on the hardware: on a GPU a 61-node forward costs about as much as a 1-token one
(the reference's 60 nodes), on a CPU it costs 2-3x more. :func:`autotune` measures both sides
with the loaded model:

* **cost** -- the target's verification forward over trees of ``budget + 1`` nodes on a
  cache of realistic length (median of a few timed runs), plus the head's draft forward and
  the pruner's call at that budget (both timed during calibration);
* **acceptance** -- calibration drafts: the target's own greedy continuation of a few prompts
  is computed once, the head drafts at every position of it (teacher forced, exactly as
  generation feeds it), and for each budget the greedy generation is replayed step by step
  (tree from the real tree builder, longest path equal to the continuation, bonus token).
  With greedy decoding this replay is what ``dart_generate`` would do, token for token, so the
  expected accepted length per step (tau) is measured rather than modelled.

The chosen budget maximises ``tau(b) / (draft + prune(b) + verify(b))``; the measured curve is
kept in :class:`TreeBudgetTuning` (``model.tree_tuning`` once tuned). The acceptance is the
greedy one: sampling accepts somewhat less, the cost side is the same.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dart_client import _native
from dart_client.data.prompt_response import HUMANEVAL_INSTRUCTION
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.draft import DraftRows, draft_rows, draft_rows_batch
from dart_client.decoding.loop import PRUNER_CONTEXT, generate
from dart_client.decoding.prune import build_tree, build_trees
from dart_client.decoding.static import StaticVerifier, resolve_static, static_capacity
from dart_client.decoding.static_batch import StaticBatchVerifier
from dart_client.decoding.verify import Tree, TreeBatch, verify_tree, verify_trees
from dart_client.errors import InvalidArgumentError
from dart_client.models.linear import cpu_matmul

if TYPE_CHECKING:
    from dart_client.decoding.loop import DecodingModel as DartModel
    from dart_client.models.head import DartHead

#: Budgets (draft nodes, root not counted) measured by default; 60 is the reference's GPU value.
#: 11 and 31 are the largest trees (12 and 32 rows with the root) that DART's CPU matmul
#: multiplies in one pass over the weights with AVX-512 and with AMX tiles
#: (``dart_kernels::MAX_ROWS_PER_PASS``, ``AMX_ROWS_PER_PASS``); 12 and 32 take two.
DEFAULT_BUDGETS = (1, 2, 4, 8, 11, 12, 16, 24, 31, 32, 48, 60, 80)

#: Token rows DART's CPU matmul multiplies in one pass over the weights (AVX-512 / AVX2, AMX).
ROWS_PER_WEIGHT_PASS = (12, 32)


def batch_budgets(batch: int, budgets: Sequence[int] = DEFAULT_BUDGETS) -> list[int]:
    """``budgets`` plus, for a batch, the largest per-row budgets whose trees still fit one
    pass over the weights (``batch * (budget + 1)`` rows of :data:`ROWS_PER_WEIGHT_PASS`): 2
    and 7 for 4 rows. Past them a step costs a second pass (4 rows of 9-node trees verify in
    1.8x the time of 4 rows of 5 on AMX), so they are where a batch's best tree usually is."""
    fits = {rows // batch - 1 for rows in ROWS_PER_WEIGHT_PASS if rows // batch >= 2}
    return sorted(set(budgets) | fits)


#: Calibration prompts used when none are given (chat-formatted when the model has a template):
#: the kinds of request DART serves, including ones whose answer repeats the prompt (code to
#: complete, a passage to summarise), where prompt lookup makes larger trees pay. With only
#: open questions the tuner saw too little of that and chose trees smaller than the best
#: measured on HumanEval and ShareGPT; a deployment should tune on its own prompts.
CALIBRATION_PROMPTS = (
    HUMANEVAL_INSTRUCTION.format(
        prompt="def moving_average(values: list[float], window: int) -> list[float]:\n"
        '    """Return the mean of every run of `window` consecutive values, in order.\n\n'
        "    >>> moving_average([1.0, 2.0, 3.0, 4.0], 2)\n"
        "    [1.5, 2.5, 3.5]\n"
        '    """\n'
    ),
    "Explain in a short paragraph why the sky is blue.",
    "Summarise the following text in two sentences.\n\n"
    "The printing press, developed by Johannes Gutenberg around 1440, made books far cheaper "
    "to produce. Before it, texts were copied by hand, which took months and made every copy "
    "costly and rare. With movable metal type, a workshop could print hundreds of identical "
    "pages a day. Literacy spread, ideas travelled faster across Europe, and scholars could "
    "compare the same text in many places at once.",
    "Give me three tips for writing clear emails at work.",
)

#: Default tokens of the target's continuation replayed per calibration prompt.
CONTINUATION_TOKENS = 64
#: Longest continuation worth replaying (the benchmark calibrates on its own lengths up to it).
MAX_CONTINUATION_TOKENS = 128


@dataclass
class BudgetPoint:
    """One budget's measurements (times in milliseconds per step)."""

    budget: int
    verify_ms: float
    prune_ms: float
    draft_ms: float
    tau: float
    tokens_per_s: float
    speedup: float  # estimated, over one autoregressive forward per token
    #: What a real step spends beyond the three parts (its bookkeeping: accepting, compacting,
    #: emitting, stop checks), measured once per tuning on real steps (alone and in batches).
    overhead_ms: float = 0.0

    @property
    def step_ms(self) -> float:
        return self.verify_ms + self.prune_ms + self.draft_ms + self.overhead_ms


@dataclass
class TreeBudgetTuning:
    """The measured curve and the chosen budget."""

    best_budget: int
    curve: list[BudgetPoint]
    ar_forward_ms: float
    context_tokens: int
    calibration_prompts: int
    calibration_tokens: int
    device: str
    dtype: str
    threads: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    #: Rows decoded together (1: one sequence); tokens/s and the AR forward are the batch's.
    batch: int = 1

    def point(self, budget: int) -> BudgetPoint:
        for p in self.curve:
            if p.budget == budget:
                return p
        raise KeyError(budget)

    def to_dict(self) -> dict[str, Any]:
        return _as_dict(self)

    def table(self) -> str:
        """The curve as a Markdown table (the chosen budget marked)."""
        return budget_tuning_table(self.to_dict())


def budget_tuning_table(t: dict[str, Any]) -> str:
    """A :class:`TreeBudgetTuning` (as its dict, e.g. from a benchmark's JSON) as a Markdown
    table, the chosen budget marked, then what was measured and the tuning's notes."""
    lines = [
        "| budget | verify ms | draft + prune ms | est. tau | est. tok/s | est. speedup |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in t["curve"]:
        mark = " **(chosen)**" if p["budget"] == t["best_budget"] else ""
        lines.append(
            f"| {p['budget']}{mark} | {p['verify_ms']:.2f} | "
            f"{p['draft_ms'] + p['prune_ms']:.2f} | {p['tau']:.2f} | "
            f"{p['tokens_per_s']:.1f} | {p['speedup']:.2f}x |"
        )
    batch = t.get("batch", 1)
    lines.append(
        f"\nOne autoregressive forward{f' of {batch} rows' if batch > 1 else ''}: "
        f"{t['ar_forward_ms']:.2f} ms at {t['context_tokens']} cached tokens ({t['device']}, "
        f"{t['dtype']}, {t['threads']} threads); {t['calibration_tokens']} calibration tokens "
        f"over {t['calibration_prompts']} prompts; tuned in {t['seconds']:.1f} s."
    )
    lines += [f"\n{n}" for n in t.get("notes", [])]
    return "\n".join(lines)


def _as_dict(tuning: Any) -> dict[str, Any]:
    """A tuning dataclass as JSON-ready data, each curve point with its ``step_ms``."""
    out = asdict(tuning)
    for point, raw in zip(tuning.curve, out["curve"], strict=True):
        raw["step_ms"] = point.step_ms
    return out


def autotune(
    model: DartModel,
    *,
    prompts: Sequence[str | Sequence[int]] | None = None,
    budgets: Sequence[int] | None = None,
    continuation_tokens: int = CONTINUATION_TOKENS,
    context_tokens: int = 256,
    repeats: int = 3,
    seed: int = 0,
    batch: int = 1,
) -> TreeBudgetTuning:
    """Measure the cost and the acceptance of each budget and choose the fastest.

    ``batch`` > 1 tunes the per-row budget of fused batched decoding
    (:mod:`dart_client.decoding.batch`): each row accepts what a lone sequence does, and a
    step costs one head forward and one target forward over ``batch`` rows (measured on a
    batched cache) plus ``batch`` pruner calls; tokens/s count every row.

    ``budgets`` default to :data:`DEFAULT_BUDGETS` (with a batch, :func:`batch_budgets`).
    ``prompts`` are text (chat-formatted with the model's template when it has one) or token
    ids; without them a few built-in prompts are used (random token ids for a model without a
    tokenizer). ``continuation_tokens`` of the target's greedy continuation are replayed per
    prompt; verification is timed on a cache of ``context_tokens`` tokens, ``repeats`` times.
    """
    if model.head is None or model.tree_builder is None:
        raise InvalidArgumentError("tree budget tuning needs a DartModel with a head and a pruner")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidArgumentError(f"batch must be an int >= 1, got {batch!r}")
    if budgets is None:
        budgets = DEFAULT_BUDGETS if batch == 1 else batch_budgets(batch)
    clean = sorted({_check_budget(b) for b in budgets})
    if not clean:
        raise InvalidArgumentError("budgets must list at least one budget >= 1")
    if continuation_tokens < 2:
        raise InvalidArgumentError(f"continuation_tokens must be >= 2, got {continuation_tokens}")
    if repeats < 1:
        raise InvalidArgumentError(f"repeats must be >= 1, got {repeats}")
    start = time.perf_counter()
    notes: list[str] = []
    encoded = _calibration_ids(model, prompts, seed)
    clock = _Clock(model.target.device, model.target.clock)

    steps: dict[int, list[int]] = {b: [] for b in clean}
    draft_times: list[float] = []
    prune_times: dict[int, list[float]] = {b: [] for b in clean}
    calibration_tokens = 0
    calibrations = []
    for ids in encoded:
        cal = _Calibration(model, ids, continuation_tokens, clock)
        calibrations.append(cal)
        draft_times.extend(cal.draft_seconds)
        calibration_tokens += cal.generated
        for b in clean:
            lengths, seconds = cal.replay(b)
            steps[b].extend(lengths)
            prune_times[b].extend(seconds)

    if batch == 1:
        verify, ar_ms, drafts_in_verify = _verify_costs(
            model, clean, context_tokens, repeats, clock, seed, model.head
        )
        draft_ms = 1e3 * statistics.median(draft_times) if draft_times else 0.0
        if drafts_in_verify:
            draft_ms = 0.0
    else:
        verify, ar_ms, draft_ms, drafts_in_verify = _batch_costs(
            model, clean, context_tokens, repeats, clock, seed, batch
        )
    if drafts_in_verify:
        notes.append(
            "static path: the head drafts inside each verification replay (its time is in "
            "verify ms)"
        )
    # A step's bookkeeping, the same for every budget, weighs on small trees most: without
    # it the estimate favours the budgets that accept least.
    middle = clean[len(clean) // 2]
    if batch > 1:
        overhead_ms = _batch_step_overhead_ms(model, encoded, middle, batch, clock)
    else:
        overhead_ms = _lone_step_overhead_ms(model, encoded[0], middle)
    notes.append(
        f"each {'batched ' if batch > 1 else ''}step also spends {overhead_ms:.2f} ms on its "
        "bookkeeping (measured on real steps; in every budget's step)"
    )
    curve = []
    for b in clean:
        tau = statistics.fmean(steps[b]) if steps[b] else 1.0
        if batch > 1:
            prune_ms = _batch_prune_ms(model, calibrations, b, batch, repeats, clock)
        else:
            prune_ms = 1e3 * statistics.median(prune_times[b]) if prune_times[b] else 0.0
        step = verify[b] + prune_ms + draft_ms + overhead_ms
        tps = 1e3 * batch * tau / step
        curve.append(
            BudgetPoint(
                budget=b,
                verify_ms=verify[b],
                prune_ms=prune_ms,
                draft_ms=draft_ms,
                tau=tau,
                tokens_per_s=tps,
                speedup=tps * ar_ms / (1e3 * batch),
                overhead_ms=overhead_ms,
            )
        )
    # Ties (e.g. an untrained head, tau 1 everywhere) go to the smaller, cheaper tree.
    best = max(curve, key=lambda p: (p.tokens_per_s, -p.budget))
    if all(p.tau < 1.05 for p in curve):
        notes.append("the head accepts almost nothing (tau near 1): an untrained head?")
    return TreeBudgetTuning(
        best_budget=best.budget,
        curve=curve,
        ar_forward_ms=ar_ms,
        context_tokens=context_tokens,
        calibration_prompts=len(encoded),
        calibration_tokens=calibration_tokens,
        device=str(model.target.device),
        dtype=str(model.target.dtype).replace("torch.", ""),
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - start,
        notes=notes,
        batch=batch,
    )


def auto_budget(model: DartModel, batch: int = 1, **kwargs: Any) -> int:
    """The tuned budget of ``model``, tuning once (the result stays in ``model.tree_tuning``;
    a batch size's in ``model.batch_tree_tunings[batch]``)."""
    tuning = kept_tuning(model, batch)
    if tuning is None:
        tuning = autotune(model, batch=batch, **kwargs)
        keep_tuning(model, batch, tuning)
    return int(tuning.best_budget)


def tuned_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a server decoding up to ``max_batch`` rows tunes for: 1, the powers
    of two below ``max_batch``, and ``max_batch``."""
    sizes = {1, max_batch}
    size = 2
    while size < max_batch:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def budget_for_rows(model: DartModel, rows: int, max_batch: int) -> int:
    """The per-row budget for ``rows`` live rows, from the tunings ``model`` holds: that of
    the smallest tuned batch size >= ``rows`` (its trees cost no more than it measured), else
    of the largest. With none held, ``max_batch`` is tuned now (once)."""
    held = {1: kept_tuning(model, 1), **(getattr(model, "batch_tree_tunings", None) or {})}
    sizes = sorted(size for size, tuning in held.items() if tuning is not None)
    if not sizes:
        return auto_budget(model, batch=max_batch)
    fits = [size for size in sizes if size >= rows]
    tuning = held[fits[0] if fits else sizes[-1]]
    assert tuning is not None
    return int(tuning.best_budget)


def kept_tuning(model: DartModel, batch: int = 1) -> TreeBudgetTuning | None:
    """The tuning ``model`` holds for ``batch`` rows, if any."""
    if batch == 1:
        return getattr(model, "tree_tuning", None)
    return (getattr(model, "batch_tree_tunings", None) or {}).get(batch)


def keep_tuning(model: DartModel, batch: int, tuning: TreeBudgetTuning) -> None:
    """Stores ``tuning`` where :func:`auto_budget` finds it."""
    if batch == 1:
        model.tree_tuning = tuning
        return
    tunings = getattr(model, "batch_tree_tunings", None)
    if tunings is None:
        tunings = {}
        model.batch_tree_tunings = tunings  # type: ignore[attr-defined]
    tunings[batch] = tuning


# -- internals -------------------------------------------------------------------------------


class _Clock:
    """Seconds on ``read`` (the target's clock: wall time unless a profile on a shared
    machine chose its thread's CPU time), after the device's queued work."""

    def __init__(self, device: torch.device, read: Any = time.perf_counter) -> None:
        self.sync = device.type == "cuda"
        self.device = device
        self.read = read

    def __call__(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return float(self.read())


def _check_budget(b: Any) -> int:
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
        raise InvalidArgumentError(f"budgets must be integers >= 1, got {b!r}")
    return int(b)


def _calibration_ids(
    model: DartModel, prompts: Sequence[str | Sequence[int]] | None, seed: int
) -> list[list[int]]:
    if prompts is None:
        if model.tokenizer is None:
            rng = np.random.default_rng(seed)
            high = model.target.vocab_size
            return [rng.integers(3, high, size=24).tolist() for _ in range(3)]
        prompts = CALIBRATION_PROMPTS
    out = []
    for p in prompts:
        if isinstance(p, str):
            if model.template is not None:
                out.append(model.encode_input(messages=[{"role": "user", "content": p}]))
            else:
                out.append(model.encode_input(prompt=p))
        else:
            out.append(model.encode_input(input_ids=list(p)))
    if not out:
        raise InvalidArgumentError("calibration needs at least one prompt")
    return out


class _Calibration:
    """One prompt's greedy continuation and the head's draft rows at every position of it."""

    def __init__(self, model: DartModel, prompt: list[int], new_tokens: int, clock: _Clock):
        self.model = model
        self.prompt_len = len(prompt)
        self.max_new = new_tokens
        self.clock = clock
        self.seq, self.generated = _greedy_continuation(model, prompt, new_tokens)
        self.draft_seconds: list[float] = []
        self.rows = self._draft_all()
        self.lookups = self._lookup_all()
        self._memo: dict[tuple[int, int], tuple[int, float]] = {}

    @torch.no_grad()
    def _draft_all(self) -> list[DraftRows]:
        """rows[i]: the draft after the root ``seq[P + i]`` (as generation would draft it)."""
        model, target, head = self.model, self.model.target, self.model.head
        assert head is not None
        device = target.device
        n = len(self.seq)
        taps = _sequence_taps(target, self.seq)
        p = self.prompt_len
        head_cache = head.new_cache(n + head.config.draft_length + 1)
        nxt = torch.tensor([self.seq[1 : p + 1]], dtype=torch.long, device=device)
        rows = [draft_rows(head, head_cache, taps[:, :p], nxt, model.draft_top_k)]
        # One real position per call: the head's cache then holds exactly what generation's
        # would after any accepted run (it keeps real positions only).
        for t in range(p, n - 1):
            nxt = torch.tensor([[self.seq[t + 1]]], dtype=torch.long, device=device)
            t0 = self.clock()
            rows.append(draft_rows(head, head_cache, taps[:, t : t + 1], nxt, model.draft_top_k))
            self.draft_seconds.append(self.clock() - t0)
        return rows

    def _lookup_all(self) -> list[np.ndarray]:
        """lookups[i]: the prompt-lookup proposal at the root ``seq[P + i]``, as rows[i] (the
        longest the model's config allows; each budget cuts it as generation does)."""
        config = self.model.prompt_lookup
        if config is None:
            return []
        index = config.new_index()
        index.extend(self.seq[: self.prompt_len])
        out = []
        for root in range(self.prompt_len, len(self.seq) - 1):
            index.extend([self.seq[root]])
            out.append(np.asarray(index.propose(config.max_tokens), dtype=np.int64))
        return out

    @property
    def roots(self) -> range:
        """The root indices a step may start at (as :meth:`replay`'s: before the last)."""
        return range(self.prompt_len, len(self.seq) - 1)

    def pruner_inputs(
        self, root: int, budget: int
    ) -> tuple[np.ndarray, DraftRows, np.ndarray | None]:
        """The pruner's context, draft rows and prompt-lookup path at root index ``root``."""
        context = np.asarray(self.seq[: root + 1][-PRUNER_CONTEXT:], dtype=np.int64)
        rows = self.rows[root - self.prompt_len]
        config = self.model.prompt_lookup
        path = None
        if config is not None:
            path = self.lookups[root - self.prompt_len][: config.path_length(budget)]
        return context, rows, path

    def _accept(self, root: int, budget: int) -> tuple[int, float]:
        """Tokens one step at root index ``root`` yields with ``budget``, and the prune time."""
        key = (root, budget)
        if key not in self._memo:
            assert self.model.tree_builder is not None
            context, rows, path = self.pruner_inputs(root, budget)
            t0 = self.clock()
            tree = build_tree(self.model.tree_builder, context, rows, budget, path)
            seconds = self.clock() - t0
            self._memo[key] = (1 + _matched_depth(tree, self.seq, root), seconds)
        return self._memo[key]

    def replay(self, budget: int) -> tuple[list[int], list[float]]:
        """Greedy generation's accepted lengths per step with ``budget`` (as dart_generate
        caps the tree and the step near the length limit), and the prune times."""
        lengths: list[int] = []
        seconds: list[float] = []
        gen = 1  # the prefill's token
        end = len(self.seq)
        while gen < self.generated:
            root = self.prompt_len + gen - 1
            room = self.max_new - gen
            b = min(budget, room - 1)
            if b > 0 and root < end - 1:
                a, s = self._accept(root, b)
                seconds.append(s)
            else:
                a = 1
            a = min(a, room, self.generated - gen)
            lengths.append(a)
            gen += a
        return lengths, seconds


def _batch_prune_ms(
    model: DartModel,
    calibrations: Sequence[_Calibration],
    budget: int,
    batch: int,
    repeats: int,
    clock: _Clock,
) -> float:
    """Median milliseconds of one batched step's trees: ``batch`` rows' pruner inputs (steps
    of the calibration continuations, in turn) in one :func:`build_trees` call, as batched
    generation makes it (the Rust pruner builds them in parallel)."""
    steps = [(cal, root) for cal in calibrations for root in cal.roots]
    if not steps or model.tree_builder is None:
        return 0.0
    times = []
    for group in range(max(3, repeats)):
        inputs = [
            cal.pruner_inputs(root, budget)
            for cal, root in (steps[(group * batch + i) % len(steps)] for i in range(batch))
        ]
        t0 = clock()
        build_trees(
            model.tree_builder,
            [c for c, _, _ in inputs],
            [r for _, r, _ in inputs],
            [budget] * batch,
            [p for _, _, p in inputs],
        )
        times.append(clock() - t0)
    return 1e3 * statistics.median(times)


def _batch_step_overhead_ms(
    model: DartModel,
    prompts: Sequence[list[int]],
    budget: int,
    batch: int,
    clock: _Clock,
    steps: int = 8,
) -> float:
    """Median milliseconds per fused step of a real batch (``batch`` rows of the calibration
    prompts at ``budget`` nodes each) outside the parts the estimate times on their own:
    drafting, pruning and the verification with its inputs (on the static path also its
    acceptance, which the timed program does). The rest is the step's bookkeeping (each row's
    acceptance and cache compaction on the dynamic path, the new tokens, EOS and length
    checks, stop strings, text)."""
    longest = max(len(p) for p in prompts)
    new_tokens = (steps + 2) * (budget + 1)
    # The model's own generator (the batch module imports this one: no import back).
    generator = model.batch_generator(max_batch=batch, max_length=longest + new_tokens + 1)
    modelled = ("draft", "prune", "inputs", "verify") + (("accept",) if generator.static else ())
    config = GenerationConfig(max_new_tokens=new_tokens, tree_budget=budget, ignore_eos=True)
    for row in range(batch):
        generator.add(config, input_ids=prompts[row % len(prompts)])
    extra = []
    try:
        generator.step()  # admission (each prompt's prefill) and a first step, not counted
        while generator.live == batch and len(extra) < steps:
            before = dict(generator.timings)
            start = clock()
            generator.step()
            wall = clock() - start
            parts = sum(generator.timings[k] - before[k] for k in modelled)
            extra.append(max(wall - parts, 0.0))
    finally:
        generator.close()
    return 1e3 * statistics.median(extra) if extra else 0.0


def _lone_step_overhead_ms(
    model: DartModel, prompt: list[int], budget: int, tokens: int = 32
) -> float:
    """Mean milliseconds per step of a real generation of ``tokens`` new tokens after
    ``prompt`` at ``budget`` nodes, outside the parts the estimate times on their own
    (:func:`_batch_step_overhead_ms`' split: on the static path the timed program accepts
    too), read from the generation's own stage timings (the target's clock, as the
    tuning's)."""
    # The path the tuning timed (resolved as generation resolves "auto").
    static = resolve_static("auto", model.target.layer_devices())
    config = GenerationConfig(
        max_new_tokens=tokens, tree_budget=budget, ignore_eos=True, static=static
    )
    result = generate(model, config, mode="dart", input_ids=prompt)
    modelled = ("prefill", "draft", "prune", "inputs", "verify") + (("accept",) if static else ())
    done = len(result.accept_lengths) - 1
    if done < 1:
        return 0.0
    rest = result.elapsed - sum(result.timings[k] for k in modelled)
    return 1e3 * max(rest, 0.0) / done


def _greedy_continuation(
    model: DartModel, prompt: list[int], new_tokens: int
) -> tuple[list[int], int]:
    """The prompt followed by the target's greedy continuation, and that continuation's
    length (EOS may end it before ``new_tokens``)."""
    result = generate(
        model, GenerationConfig(max_new_tokens=new_tokens), mode="ar", input_ids=prompt
    )
    return [*prompt, *result.tokens], len(result.tokens)


@torch.no_grad()
def _sequence_taps(target: Any, seq: list[int]) -> torch.Tensor:
    """The target's draft taps (1, n, 3H) at every position of ``seq``, in one forward."""
    n = len(seq)
    device = target.device
    cache = target.new_cache(n + 1)
    ids = torch.tensor([seq], dtype=torch.long, device=device)
    positions = torch.arange(n, device=device).unsqueeze(0)
    _, taps = target.forward(ids, positions, cache, logits_to_keep=1, taps=True)
    assert taps is not None
    return taps


def _matched_depth(tree: Tree, seq: list[int], root: int) -> int:
    """Depth of the deepest tree path whose tokens equal ``seq[root + 1 ...]``."""
    node, depth = 0, 0
    while root + depth + 1 < len(seq):
        want = seq[root + depth + 1]
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def _prefilled(
    model: DartModel, context_tokens: int, seed: int, max_tree: int = 255
) -> tuple[Any, int]:
    """A cache prefilled with ``context_tokens`` random tokens, room for a tree of
    ``max_tree`` nodes after them (on the static path's terms where generation takes it)."""
    target = model.target
    limit = target.max_positions or 1 << 30
    n = max(1, min(context_tokens, limit - 128))
    rng = np.random.default_rng(seed)
    ids = torch.tensor(
        [rng.integers(0, target.vocab_size, size=n).tolist()],
        dtype=torch.long,
        device=target.device,
    )
    static = resolve_static("auto", target.layer_devices())
    cache = target.new_cache(static_capacity(n + 1, max_tree) if static else n + 1 + max_tree)
    target.forward(ids, torch.arange(n, device=target.device).unsqueeze(0), cache, taps=False)
    return cache, n


def _random_tree(size: int, rng: np.random.Generator, vocab: int) -> Tree:
    """A tree of ``size`` nodes shaped like a pruned one (a few deep paths, bushy near the
    root); the forward's cost depends on the node count, not on the shape."""
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, size)]
    tokens = rng.integers(0, vocab, size=size).tolist()
    return Tree.build(tokens, parents)


@torch.no_grad()
def _verify_costs(
    model: DartModel,
    budgets: Sequence[int],
    context_tokens: int,
    repeats: int,
    clock: _Clock,
    seed: int,
    head: DartHead | None = None,
) -> tuple[dict[int, float], float, bool]:
    """Median milliseconds of one tree verification forward per budget, of one
    autoregressive forward (one token, no taps: what ``ar_generate`` runs), and whether the
    tree steps include the draft: where generation takes the static path (cuda) the DART
    ``head`` drafts inside the verification replay, so that is what is timed; without a
    head (EAGLE-3, which drafts on the dynamic path) trees are timed on the dynamic path."""
    target = model.target
    max_tree = max(budgets) + 1
    cache, n = _prefilled(model, context_tokens, seed, max_tree)
    rng = np.random.default_rng(seed + 1)
    trees = {b: _random_tree(b + 1, rng, target.vocab_size) for b in budgets}
    token = torch.tensor([[1]], dtype=torch.long, device=target.device)
    position = torch.tensor([[n]], dtype=torch.long, device=target.device)
    # Where generation takes the static path (cuda), time what a step runs there: the
    # padded forward, acceptance, compaction and the head's next draft in the tree's bucket
    # (one graph replay); autoregressive decoding's one-token step has no head.
    static = one_token = None
    if resolve_static("auto", target.layer_devices()):
        graphs = target.device.type == "cuda"
        one_token = StaticVerifier(target, cache, 1, graphs=graphs)
        if head is not None:
            static = StaticVerifier(
                target, cache, max_tree, graphs=graphs, head=head, top_k=model.draft_top_k
            )

    def ar_forward() -> None:
        if one_token is not None:
            one_token.greedy_step(Tree.root_only(1))
        else:
            target.forward(token, position, cache, logits_to_keep=1, taps=False)

    def tree_forward(b: int) -> Any:
        if static is not None:
            return lambda: static.greedy_step(trees[b])
        return lambda: verify_tree(target, cache, trees[b])

    def reset() -> None:
        cache.truncate(n)
        if static is not None and static.head_cache is not None:
            static.head_cache.truncate(0)

    runs: dict[int, Any] = {-1: ar_forward, **{b: tree_forward(b) for b in budgets}}
    ms = _median_ms(runs, repeats, clock, reset)
    return {b: ms[b] for b in budgets}, ms[-1], static is not None


def _median_ms(
    runs: dict[int, Callable[[], Any]], repeats: int, clock: _Clock, reset: Callable[[], None]
) -> dict[int, float]:
    """Median milliseconds of each run over ``repeats`` rounds (``reset`` after every run).
    Every run goes once before any is timed: a first run pays for new shapes (attention
    plans, allocations, kernel choices; on cuda the graph capture), which no later step
    does. The runs interleave per round, so a load burst on a shared machine hits them
    alike and the estimated speedups compare like with like."""
    for run in runs.values():
        run()
        reset()
    samples: dict[int, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            t0 = clock()
            run()
            samples[key].append(clock() - t0)
            reset()
    return {key: 1e3 * statistics.median(s) for key, s in samples.items()}


@torch.no_grad()
def _batch_costs(
    model: DartModel,
    budgets: Sequence[int],
    context_tokens: int,
    repeats: int,
    clock: _Clock,
    seed: int,
    batch: int,
) -> tuple[dict[int, float], float, float, bool]:
    """For ``batch`` rows decoded together: median milliseconds of one fused verification
    per budget (a tree of budget + 1 nodes in every row), of one fused autoregressive step,
    and of one fused draft (the head over one new position per row), and whether the
    verifications include the draft. Where batched generation takes the static path (cuda),
    the verifications are its program's, which drafts every row's next rows too (the draft
    is then 0)."""
    target, head = model.target, model.head
    assert head is not None
    max_tree = max(budgets) + 1
    single, n = _prefilled(model, context_tokens, seed, max_tree)
    static = resolve_static("auto", target.layer_devices())
    capacity = static_capacity(n + 1, max_tree) if static else n + 256
    cache = target.new_cache(capacity, batch)
    for row in range(batch):
        cache.put_row(row, single)
    rng = np.random.default_rng(seed + 1)
    # Packed once, as a step's pruner packs them.
    trees = {
        b: TreeBatch.of([_random_tree(b + 1, rng, target.vocab_size)] * batch) for b in budgets
    }
    roots = TreeBatch.roots([1] * batch)
    # The head: its cache holds the context's positions (the taps of one forward over it).
    ids = torch.tensor([rng.integers(0, target.vocab_size, size=n + 1).tolist()])
    ids = ids.to(target.device)
    positions = torch.arange(n, device=target.device).unsqueeze(0)
    _, taps = target.forward(ids[:, :n], positions, target.new_cache(n))
    assert taps is not None
    lone = head.new_cache(n + head.config.draft_length)
    head(taps.to(head.fc.weight.dtype), ids[:, 1:], lone, num_masks=0)
    masks = head.config.draft_length
    head_capacity = n + 4 * repeats + 2 * masks + 8
    if static:  # a padded tree's rows and the mask slots after them, and a trash slot
        head_capacity = static_capacity(n + masks, max_tree)
    head_cache = head.new_cache(head_capacity, batch)
    for row in range(batch):
        head_cache.put_row(row, lone)
    row_taps = [taps[0, -1:]] * batch

    def draft() -> None:
        draft_rows_batch(head, head_cache, row_taps, [[1]] * batch, model.draft_top_k)

    verifier = one_token = None
    if static:
        # Autoregressive steps draft nothing: the roots run a program without the head.
        one_token = StaticBatchVerifier(target, cache, 1, graphs=target.device.type == "cuda")
        verifier = StaticBatchVerifier(
            target,
            cache,
            max_tree,
            graphs=target.device.type == "cuda",
            head=head,
            head_cache=head_cache,
            top_k=model.draft_top_k,
        )

    def ar_forward() -> None:
        if one_token is not None:
            one_token.greedy_step(roots)
        else:
            verify_trees(target, cache, roots, taps=False)

    def tree_forward(b: int) -> Any:
        if verifier is not None:
            return lambda: verifier.greedy_step(trees[b])
        return lambda: verify_trees(target, cache, trees[b])

    def reset() -> None:
        # Every row back to n (the static path moves each row's length, the dynamic one the
        # frontier, which the rows set again), and the head's rows, which the program
        # drafts over.
        cache.grow_rows([n - length for length in cache.rows.lengths])
        if verifier is not None:
            head_cache.grow_rows([n - length for length in head_cache.rows.lengths])

    runs: dict[int, Any] = {-1: ar_forward, **{b: tree_forward(b) for b in budgets}}
    if verifier is None:
        runs[-2] = draft
    ms = _median_ms(runs, repeats, clock, reset)
    return {b: ms[b] for b in budgets}, ms[-1], ms.get(-2, 0.0), verifier is not None


# -- the tuning cache ---------------------------------------------------------------------------

#: Bump when the tuner's measurement or what a tree costs changes (a kernel made faster at some
#: row counts: 4 and 5, the AVX512-BF16 and then the AVX2 matmul streaming the next panel during
#: a panel's passes), so older cached tunings are not reused.
CACHE_VERSION = 5


def tune_cached(
    model: DartModel,
    key: dict[str, Any],
    *,
    batch: int = 1,
    prompts: Sequence[str] | None = None,
) -> str:
    """:func:`auto_budget` with the result cached on disk under ``key`` (what identifies the
    target, head, n-gram, device and dtype: the caller's choice; the thread count, the CPU
    matmul kernel, ``batch`` and the calibration ``prompts`` are added), so that a command line
    tunes once per setup rather than at every start. The cache lives in ``<cache dir>/tuning/``;
    deleting a file there re-tunes. Returns a note saying what happened; the tuning lands where
    :func:`auto_budget` finds it (``model.tree_tuning``, ``model.batch_tree_tunings[batch]``).
    ``prompts`` (default :data:`CALIBRATION_PROMPTS`): the deployment's own kind of request,
    whose acceptance may differ from the built-in prompts'."""
    import hashlib
    import json

    from dart_client.embedded import cache_dir

    full_key = {
        **key,
        "threads": torch.get_num_threads(),
        "version": CACHE_VERSION,
        # The CPU's matmul decides what a tree costs (DART_MAX_CPU_ISA, set_cpu_matmul).
        "cpu_matmul": [_native.decoding_matmul_backend(), cpu_matmul()],
    }
    if batch != 1:
        full_key["batch"] = batch
    if prompts is not None:
        full_key["prompts"] = hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()
    text = json.dumps(full_key, sort_keys=True, default=str)
    path = cache_dir() / "tuning" / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    rows = "" if batch == 1 else f" per row of {batch} decoded together"
    tuning = _read_tuning(path, text)
    if tuning is not None:
        note = f"tree budget {tuning.best_budget}{rows}, tuned earlier for this setup ({path})"
    else:
        tuning = autotune(model, batch=batch, prompts=prompts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": json.loads(text), "tuning": tuning.to_dict()}))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        note = (
            f"tree budget {tuning.best_budget}{rows}, tuned in {tuning.seconds:.1f} s and cached "
            f"in {path} (delete it to re-tune; --tree-budget N skips tuning)"
        )
    keep_tuning(model, batch, tuning)
    return note


def read_tune_prompts(path: str | os.PathLike[str]) -> list[str]:
    """Calibration prompts from a JSON Lines file: one prompt per line, a JSON string or an
    object with a ``"prompt"`` string (blank lines skipped). Errors name the file and line."""
    import json
    from pathlib import Path

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"tune prompts {path}: cannot read: {err}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as err:
            raise InvalidArgumentError(f"tune prompts {path}:{number}: not JSON: {err}") from None
        if isinstance(item, dict):
            item = item.get("prompt")
        if not isinstance(item, str) or not item.strip():
            raise InvalidArgumentError(
                f"tune prompts {path}:{number}: expected a non-empty JSON string or an object "
                'with a "prompt" string'
            )
        out.append(item)
    if not out:
        raise InvalidArgumentError(f"tune prompts {path}: no prompts")
    return out


def _read_tuning(path: Any, key_text: str) -> TreeBudgetTuning | None:
    """The tuning cached at ``path`` for exactly this key; None when absent or unreadable."""
    import json

    try:
        raw = json.loads(path.read_text())
        if json.dumps(raw["key"], sort_keys=True, default=str) != key_text:
            return None
        data = dict(raw["tuning"])
        data["curve"] = [
            BudgetPoint(**{k: v for k, v in p.items() if k != "step_ms"}) for p in data["curve"]
        ]
        return TreeBudgetTuning(**data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- EAGLE-3's tree ----------------------------------------------------------------------------

#: EAGLE-3 trees (top_k, depth, total_tokens) :func:`tune_eagle3_tree` measures by default: the
#: published (10, 7, 60) and smaller ones, which a CPU (where every draft forward and every
#: verified node costs) favours. A total larger than the candidates the growth produces
#: (``k + depth * k * k`` plus the root) is left out: it is the same tree as a smaller total.
DEFAULT_EAGLE3_GRID = tuple(
    (k, d, t)
    for k in (2, 4, 10)
    for d in (1, 2, 3, 5, 7)
    for t in (4, 8, 16, 32, 60)
    if t - 1 <= k + d * k * k
)


@dataclass
class Eagle3TreePoint:
    """One EAGLE-3 tree's measurements (times in milliseconds per step; ``draft_ms`` is the
    head reading the accepted positions plus growing the tree)."""

    top_k: int
    depth: int
    total_tokens: int
    verify_ms: float
    draft_ms: float
    tau: float
    tokens_per_s: float
    speedup: float  # estimated, over one autoregressive forward per token

    @property
    def step_ms(self) -> float:
        return self.verify_ms + self.draft_ms


@dataclass
class Eagle3TreeTuning:
    """The measured EAGLE-3 trees and the fastest one (``best``: top_k, depth, total_tokens)."""

    best: tuple[int, int, int]
    curve: list[Eagle3TreePoint]
    ar_forward_ms: float
    context_tokens: int
    calibration_prompts: int
    calibration_tokens: int
    device: str
    dtype: str
    threads: int
    seconds: float

    def best_config(self) -> Any:
        from dart_client.decoding.eagle3 import Eagle3TreeConfig

        k, d, t = self.best
        return Eagle3TreeConfig(top_k=k, depth=d, total_tokens=t)

    def to_dict(self) -> dict[str, Any]:
        return _as_dict(self)

    def table(self, rows: int | None = None) -> str:
        return eagle3_tuning_table(self.to_dict(), rows)


def eagle3_tuning_table(t: dict[str, Any], rows: int | None = None) -> str:
    """An :class:`Eagle3TreeTuning` (as its dict, e.g. from a benchmark's JSON) as a Markdown
    table: the ``rows`` fastest trees (all by default), the chosen one marked."""
    lines = [
        "| top-k | depth | tokens | verify ms | draft ms | est. tau | est. tok/s | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best = tuple(t["best"])
    for p in sorted(t["curve"], key=lambda p: -p["tokens_per_s"])[:rows]:
        mark = " **(chosen)**" if (p["top_k"], p["depth"], p["total_tokens"]) == best else ""
        lines.append(
            f"| {p['top_k']}{mark} | {p['depth']} | {p['total_tokens']} | {p['verify_ms']:.2f} | "
            f"{p['draft_ms']:.2f} | {p['tau']:.2f} | {p['tokens_per_s']:.1f} | "
            f"{p['speedup']:.2f}x |"
        )
    lines.append(
        "\ntokens: the tree's, the root included (draft nodes + 1). "
        f"One autoregressive forward: {t['ar_forward_ms']:.2f} ms at {t['context_tokens']} "
        f"cached tokens ({t['device']}, {t['dtype']}, {t['threads']} threads); "
        f"{t['calibration_tokens']} calibration tokens over {t['calibration_prompts']} "
        f"prompts; {len(t['curve'])} trees tuned in {t['seconds']:.1f} s."
    )
    return "\n".join(lines)


def tune_eagle3_tree(
    model: DartModel,
    *,
    prompts: Sequence[str | Sequence[int]] | None = None,
    grid: Sequence[tuple[int, int, int]] = DEFAULT_EAGLE3_GRID,
    continuation_tokens: int = CONTINUATION_TOKENS,
    context_tokens: int = 256,
    repeats: int = 3,
    seed: int = 0,
) -> Eagle3TreeTuning:
    """EAGLE-3's own tuned tree on this machine: :func:`autotune` for a model drafting with an
    EAGLE-3 head. Every tree of ``grid`` (top_k, depth, total_tokens) replays greedy generation
    over the target's own continuation of the calibration prompts: the head reads the accepted
    positions (teacher forced, as generation feeds it) and grows its real tree at every step,
    timed; the tree's accepted length is the longest path matching the continuation. The
    verification forward of each tree size is timed as :func:`autotune` times it. The
    fastest estimated tokens/s wins (ties to the smaller tree)."""
    from dart_client.decoding.eagle3 import Eagle3Drafter, Eagle3TreeConfig

    if model.eagle3 is None:
        raise InvalidArgumentError("EAGLE-3 tree tuning needs a DartModel with an EAGLE-3 head")
    configs = [Eagle3TreeConfig(top_k=k, depth=d, total_tokens=t) for k, d, t in grid]
    if not configs:
        raise InvalidArgumentError("the EAGLE-3 grid must list at least one tree")
    if continuation_tokens < 2:
        raise InvalidArgumentError(f"continuation_tokens must be >= 2, got {continuation_tokens}")
    start = time.perf_counter()
    encoded = _calibration_ids(model, prompts, seed)
    clock = _Clock(model.target.device, model.target.clock)
    lengths: dict[Any, list[int]] = {c: [] for c in configs}
    draft_times: dict[Any, list[float]] = {c: [] for c in configs}
    calibration_tokens = 0
    for ids in encoded:
        seq, generated = _greedy_continuation(model, ids, continuation_tokens)
        calibration_tokens += generated
        taps = _sequence_taps(model.target, seq)
        for c in configs:
            drafter = Eagle3Drafter(model.eagle3, c)
            steps, seconds = _replay_eagle3(
                drafter, seq, len(ids), generated, continuation_tokens, taps, clock
            )
            lengths[c].extend(steps)
            draft_times[c].extend(seconds)
    budgets = sorted({c.budget for c in configs})
    verify, ar_ms, _ = _verify_costs(model, budgets, context_tokens, repeats, clock, seed)
    curve = []
    for c in configs:
        tau = statistics.fmean(lengths[c]) if lengths[c] else 1.0
        draft_ms = 1e3 * statistics.median(draft_times[c]) if draft_times[c] else 0.0
        tps = 1e3 * tau / (verify[c.budget] + draft_ms)
        curve.append(
            Eagle3TreePoint(
                top_k=c.top_k,
                depth=c.depth,
                total_tokens=c.total_tokens,
                verify_ms=verify[c.budget],
                draft_ms=draft_ms,
                tau=tau,
                tokens_per_s=tps,
                speedup=tps * ar_ms / 1e3,
            )
        )
    best = max(curve, key=lambda p: (p.tokens_per_s, -p.total_tokens, -p.depth, -p.top_k))
    return Eagle3TreeTuning(
        best=(best.top_k, best.depth, best.total_tokens),
        curve=curve,
        ar_forward_ms=ar_ms,
        context_tokens=context_tokens,
        calibration_prompts=len(encoded),
        calibration_tokens=calibration_tokens,
        device=str(model.target.device),
        dtype=str(model.target.dtype).replace("torch.", ""),
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - start,
    )


@torch.no_grad()
def _replay_eagle3(
    drafter: Any,
    seq: list[int],
    prompt_len: int,
    generated: int,
    max_new: int,
    taps: torch.Tensor,
    clock: _Clock,
) -> tuple[list[int], list[float]]:
    """Greedy generation with ``drafter`` over the known continuation: accepted lengths per
    step and the seconds of each step's drafting (reading the accepted positions, growing the
    tree); near the end the tree is capped as :meth:`_Calibration.replay` caps it."""
    device = taps.device
    ids = torch.tensor([seq], dtype=torch.long, device=device)
    cache = drafter.new_cache(drafter.cache_capacity(len(seq) + 1))
    drafter.feed(cache, taps[:, :prompt_len], ids[:, 1 : prompt_len + 1])
    context = np.asarray(seq, dtype=np.int64)
    lengths: list[int] = []
    seconds: list[float] = []
    fed_seconds = 0.0  # the previous step's reading, counted in this step's drafting
    gen = 1
    while gen < generated:
        root = prompt_len + gen - 1
        room = max_new - gen
        b = min(drafter.config.budget, room - 1)
        if b > 0:
            t0 = clock()
            tree = drafter.tree(context[: root + 1][-PRUNER_CONTEXT:], b)
            seconds.append(fed_seconds + clock() - t0)
            a = 1 + _matched_depth(tree, seq, root)
        else:
            a = 1
        a = min(a, room, generated - gen)
        t0 = clock()
        drafter.feed(cache, taps[:, root : root + a], ids[:, root + 1 : root + a + 1])
        fed_seconds = clock() - t0
        lengths.append(a)
        gen += a
    return lengths, seconds
