"""Tree-budget auto-tuning: the acceptance replay must be what greedy generation does.

On a tiny float64 target the replayed accepted lengths per step equal those of
``dart_generate`` with the same budget, step for step, with the real pruner (random head: short
runs) and with a planted builder whose trees hold the target's true continuation only when the
budget is large enough (long runs, strongly budget-dependent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_target

from dart_client import DartModel, ar_generate, dart_generate
from dart_client.decoding.autotune import (
    TreeBudgetTuning,
    _batch_prune_ms,
    _Calibration,
    _Clock,
    auto_budget,
    autotune,
    tune_cached,
)
from dart_client.decoding.config import parse_tree_budget
from dart_client.decoding.draft import DraftRows
from dart_client.decoding.verify import Tree
from dart_client.errors import InvalidArgumentError
from dart_client.models.head import DartHead

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Any:
    return make_tiny_target("llama", seed=3)


@pytest.fixture(scope="module")
def head(target: Any) -> DartHead:
    return DartHead.random_init(target.config, draft_length=3, seed=5).double()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY_VOCAB, size=int(rng.integers(4, 20))).tolist() for _ in range(n)]


class PlantedBuilder:
    """Trees where wrong branches come first (in creation order, which the budget cuts) and
    the true greedy continuation last: small budgets accept little, large ones a lot."""

    def __init__(self, truths: Sequence[Sequence[int]]) -> None:
        self.truths = [list(t) for t in truths]
        self.calls: list[int] = []

    def build(self, context: np.ndarray, rows: DraftRows, budget: int) -> Tree:
        self.calls.append(budget)
        ctx = [int(x) for x in context]
        for seq in self.truths:
            for end in range(len(ctx), len(seq) + 1):
                if seq[end - len(ctx) : end] == ctx:
                    root = ctx[-1]
                    true = seq[end : end + 4]
                    first = true[0] if true else 3
                    # Three 3-node branches whose first tokens differ from the truth's.
                    wrong = [[3 + (first - 3 + j) % (TINY_VOCAB - 3)] * 3 for j in (1, 2, 3)]
                    tree = Tree.from_paths(root, [*wrong, true])
                    n = min(len(tree), budget + 1)
                    return Tree.build(tree.tokens[:n], tree.parents[:n])
        return Tree.root_only(ctx[-1])


def planted(
    target: Any, head: DartHead, n: int, seed: int, new: int, **kwargs: Any
) -> tuple[DartModel, list[list[int]], list[list[int]]]:
    """A DartModel whose trees hold each of ``n`` prompts' greedy continuation (``new``
    tokens), the prompts and prompt + continuation."""
    base = DartModel(target)
    ps = prompts(n, seed=seed)
    truths = [p + ar_generate(base, input_ids=p, max_new_tokens=new).tokens for p in ps]
    return DartModel(target, head, tree_builder=PlantedBuilder(truths), **kwargs), ps, truths


@pytest.mark.parametrize("lookup", [8, 0], ids=["lookup", "no-lookup"])
def test_replay_equals_generation_with_the_real_pruner(
    target: Any, head: DartHead, tiny_ngram_path: Any, lookup: int
) -> None:
    from dart_client.ngram import NGram

    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)), prompt_lookup=lookup)
    clock = _Clock(dm.target.device)
    # Prompts that repeat themselves give prompt lookup something to propose.
    for prompt in [*prompts(2, seed=1), *(p * 3 for p in prompts(2, seed=7))]:
        cal = _Calibration(dm, prompt, 20, clock)
        for budget in (1, 3, 10, 40):
            lengths, _ = cal.replay(budget)
            got = dart_generate(dm, input_ids=prompt, max_new_tokens=20, tree_budget=budget)
            assert lengths == got.accept_lengths[1:], (prompt, budget)
        # A batch's pruning takes every step's inputs in turn, more rows than steps included.
        assert _batch_prune_ms(dm, [cal], 10, len(cal.roots) + 3, 3, clock) > 0
    assert len(cal.roots) == 19  # 20 tokens: the prefill's first, then a root before each


def test_replay_equals_generation_with_long_accepted_runs(target: Any, head: DartHead) -> None:
    base = DartModel(target)
    ps = prompts(3, seed=2)
    truths = [p + ar_generate(base, input_ids=p, max_new_tokens=30).tokens for p in ps]
    builder = PlantedBuilder(truths)
    dm = DartModel(target, head, tree_builder=builder)
    clock = _Clock(dm.target.device)
    taus = {}
    for budget in (2, 9, 13):
        lengths_all: list[int] = []
        for prompt in ps:
            cal = _Calibration(dm, prompt, 30, clock)
            lengths, seconds = cal.replay(budget)
            got = dart_generate(dm, input_ids=prompt, max_new_tokens=30, tree_budget=budget)
            assert lengths == got.accept_lengths[1:], (prompt, budget)
            assert got.tokens == truths[ps.index(prompt)][len(prompt) :]
            assert 0 < len(seconds) <= len(lengths)
            lengths_all += lengths
        taus[budget] = sum(lengths_all) / len(lengths_all)
    # 9 wrong nodes precede the truth: up to 9 nothing is accepted, 13 reaches depth 4 (less
    # near the length limit, where generation shrinks the tree).
    assert taus[2] == taus[9] == 1.0
    assert taus[13] > 2.0


def test_autotune_curve_and_choice(target: Any, head: DartHead) -> None:
    dm, ps, _ = planted(target, head, 2, 4, 24)
    tuning = autotune(
        dm, prompts=ps, budgets=(13, 2, 9), continuation_tokens=24, context_tokens=32, repeats=2
    )
    assert isinstance(tuning, TreeBudgetTuning)
    assert [p.budget for p in tuning.curve] == [2, 9, 13]
    for p in tuning.curve:
        assert p.verify_ms > 0 and p.draft_ms > 0 and p.prune_ms >= 0
        assert p.tokens_per_s == pytest.approx(1e3 * p.tau / p.step_ms)
        assert p.speedup == pytest.approx(p.tokens_per_s * tuning.ar_forward_ms / 1e3)
    assert tuning.point(2).tau == 1.0
    assert tuning.point(9).tau == 1.0
    assert tuning.point(13).tau > 1.5
    best = max(tuning.curve, key=lambda p: p.tokens_per_s)
    assert tuning.best_budget == best.budget
    assert tuning.calibration_prompts == 2 and tuning.calibration_tokens == 48
    table = tuning.table()
    assert "**(chosen)**" in table and table.count("\n|") == 4
    d = tuning.to_dict()
    assert d["best_budget"] == tuning.best_budget and len(d["curve"]) == 3
    assert d["curve"][0]["step_ms"] == pytest.approx(tuning.curve[0].step_ms)


def test_on_the_static_path_the_draft_is_timed_inside_the_replay(
    target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where generation takes the static path (cuda; forced here, eagerly), a DART step is
    one replay that verifies and drafts: the tuning times that replay with the head in it
    (each tree bucket drafts), books no separate draft (on a GPU the dynamic draft's new
    shapes cost 50 ms a call, which no static step pays), and says so."""
    import dart_client.decoding.autotune as autotune_module
    from dart_client.decoding.static import StaticVerifier

    monkeypatch.setattr(autotune_module, "resolve_static", lambda value, devices: True)
    drafted: list[bool] = []
    greedy_step = StaticVerifier.greedy_step

    def recording(self: Any, tree: Any) -> Any:
        drafted.append(self.head is not None)
        return greedy_step(self, tree)

    monkeypatch.setattr(StaticVerifier, "greedy_step", recording)
    dm, ps, _ = planted(target, head, 2, 4, 16)
    tuning = autotune(
        dm, prompts=ps, budgets=(2, 9), continuation_tokens=16, context_tokens=32, repeats=2
    )
    assert all(p.draft_ms == 0 and p.verify_ms > 0 for p in tuning.curve)
    assert any("drafts inside each verification replay" in n for n in tuning.notes)
    # Trees replay with the head (2 budgets, warm-up + 2 rounds); AR's one token without.
    assert drafted.count(True) == 2 * 3 and drafted.count(False) == 3


def test_auto_budget_is_tuned_once_and_used_by_generation(
    target: Any, head: DartHead, tiny_ngram_path: Any
) -> None:
    from dart_client.ngram import NGram

    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)), tree_budget="auto")
    assert dm.tree_tuning is None
    prompt = prompts(1, seed=6)[0]
    got = dart_generate(dm, input_ids=prompt, max_new_tokens=12)
    tuning = dm.tree_tuning
    assert tuning is not None
    assert max(got.tree_sizes[1:]) <= tuning.best_budget + 1
    assert got.tokens == ar_generate(dm, input_ids=prompt, max_new_tokens=12).tokens
    # Cached: a second call does not tune again.
    assert auto_budget(dm) == tuning.best_budget and dm.tree_tuning is tuning
    explicit = dart_generate(dm, input_ids=prompt, max_new_tokens=12, tree_budget="auto")
    assert explicit.tokens == got.tokens


def test_the_tuning_cache_is_keyed_by_the_cpu_matmul(
    target: Any,
    head: DartHead,
    tiny_ngram_path: Any,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tree's cost depends on which CPU matmul multiplies (``DART_MAX_CPU_ISA``,
    ``set_cpu_matmul``): a tuning cached under one kernel is not reused under another."""
    from dart_client.models import linear
    from dart_client.ngram import NGram

    monkeypatch.setenv("DART_CACHE", str(tmp_path))
    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)), tree_budget="auto")
    key = {"target": "tiny"}
    assert "tuned in" in tune_cached(dm, key)
    assert "tuned earlier" in tune_cached(dm, key)
    monkeypatch.setattr(linear, "_cpu_matmul", "onednn")
    assert "tuned in" in tune_cached(dm, key)
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 2


def test_bad_arguments(target: Any, head: DartHead, tiny_ngram_path: Any) -> None:
    from dart_client.ngram import NGram

    with pytest.raises(InvalidArgumentError, match="head and a pruner"):
        autotune(DartModel(target))
    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)))
    with pytest.raises(InvalidArgumentError, match="budgets must be integers >= 1"):
        autotune(dm, budgets=(4, 0))
    with pytest.raises(InvalidArgumentError, match="continuation_tokens"):
        autotune(dm, continuation_tokens=1)
    with pytest.raises(InvalidArgumentError, match="tree budget 'big'"):
        DartModel(target, head, tree_budget="big")
    assert parse_tree_budget("auto") == "auto"
    assert parse_tree_budget("AUTO") == "auto"
    assert parse_tree_budget("24") == 24
    assert parse_tree_budget(None) is None
    for bad in ("-1", "sixty", "1.5"):
        with pytest.raises(InvalidArgumentError, match="expected an integer >= 0 or 'auto'"):
            parse_tree_budget(bad)


def test_verify_costs_warm_every_shape_before_timing(
    target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tree size (and the one-token forward) runs once before the first timed run:
    a first run pays for new shapes (on cuda, plans and graph capture) that no step does."""
    import time

    import dart_client.decoding.autotune as autotune
    from dart_client.decoding.static import StaticVerifier

    events: list[Any] = []
    verify, greedy_step = autotune.verify_tree, StaticVerifier.greedy_step

    def counting_verify(t: Any, cache: Any, tree: Any) -> Any:
        events.append(len(tree))
        return verify(t, cache, tree)

    def counting_step(self: Any, tree: Any) -> Any:
        events.append(len(tree))
        return greedy_step(self, tree)

    monkeypatch.setattr(autotune, "verify_tree", counting_verify)
    monkeypatch.setattr(StaticVerifier, "greedy_step", counting_step)

    def clock() -> float:
        events.append("clock")
        return time.perf_counter()

    dm = DartModel(target, head)
    verify_ms, ar_ms, _ = autotune._verify_costs(dm, [1, 4, 9], 20, 2, clock, 0)  # type: ignore[arg-type]
    assert set(verify_ms) == {1, 4, 9} and ar_ms > 0
    warm = events[: events.index("clock")]
    assert {2, 5, 10} <= set(warm), warm
    assert events.count("clock") == 2 * 2 * 4  # start and end of each timed run


def test_the_tuning_clock_synchronises_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On cuda the clock waits for the queued kernels before reading the time (else it
    times their launch); on the CPU there is nothing to wait for."""
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    _Clock(torch.device("cuda"))()
    assert calls == [torch.device("cuda")]
    _Clock(torch.device("cpu"))()
    assert len(calls) == 1


def test_batch_budget_is_tuned_per_batch_size_and_used_by_generate_batch(
    target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's pruning is timed as batched generation runs it: one build_trees call over
    every row's inputs (in parallel in Rust), not a lone call times the rows."""
    import dart_client.decoding.autotune as autotune_module

    calls: list[tuple[int, ...]] = []
    build_trees = autotune_module.build_trees

    def recording(builder: Any, contexts: Any, rows: Any, budgets: Any, paths: Any) -> Any:
        calls.append(tuple(budgets))
        return build_trees(builder, contexts, rows, budgets, paths)

    monkeypatch.setattr(autotune_module, "build_trees", recording)
    dm, ps, truths = planted(target, head, 3, 9, 24, tree_budget="auto")
    tuning = autotune(
        dm, prompts=ps, budgets=(2, 13), continuation_tokens=24, context_tokens=32, repeats=2,
        batch=3,
    )  # fmt: skip
    assert tuning.batch == 3 and "of 3 rows" in tuning.table()
    assert sorted(set(calls)) == [(2, 2, 2), (13, 13, 13)] and len(calls) == 2 * 3
    for p in tuning.curve:
        # Every row's tokens count; the speedup is over fused AR of the same rows.
        assert p.tokens_per_s == pytest.approx(3e3 * p.tau / p.step_ms)
        assert p.speedup == pytest.approx(p.tokens_per_s * tuning.ar_forward_ms / 3e3)
        # A real step's bookkeeping, measured once, is in every budget's step.
        assert p.step_ms == pytest.approx(p.verify_ms + p.prune_ms + p.draft_ms + p.overhead_ms)
    assert len({p.overhead_ms for p in tuning.curve}) == 1 and tuning.curve[0].overhead_ms > 0
    assert tuning.point(13).tau > 1.5
    got = dm.generate_batch(ps, max_new_tokens=20)
    assert set(dm.batch_tree_tunings) == {3} and dm.tree_tuning is None
    best = dm.batch_tree_tunings[3].best_budget
    assert all(max(r.tree_sizes[1:]) <= best + 1 for r in got)
    assert [r.tokens for r in got] == [
        t[len(p) : len(p) + 20] for p, t in zip(ps, truths, strict=True)
    ]
    with pytest.raises(InvalidArgumentError, match="batch must be"):
        autotune(dm, batch=0)


def test_a_batch_step_s_bookkeeping_weighs_on_small_trees_most(
    target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a real batched step spends beyond drafting, pruning and verifying (each row's
    new tokens: 4 ms more per row and step here) is measured on real steps and added to
    every budget's step: it weighs on the trees that accept least (more steps per token)."""
    import time as time_module

    from dart_client.decoding.loop import _Run

    emit = _Run._emit

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        time_module.sleep(0.004)
        return emit(self, *args, **kwargs)

    dm, ps, _ = planted(target, head, 3, 9, 24)
    plain = autotune(
        dm, prompts=ps, budgets=(1, 13), continuation_tokens=24, context_tokens=32, repeats=2,
        batch=3,
    )  # fmt: skip
    monkeypatch.setattr(_Run, "_emit", slow)
    tuning = autotune(
        dm, prompts=ps, budgets=(1, 13), continuation_tokens=24, context_tokens=32, repeats=2,
        batch=3,
    )  # fmt: skip
    # The sleeps are in every measured step (3 rows x at least 4 ms, on the wall clock): a
    # bound that holds however loaded the machine. Their difference from the plain tuning's
    # overhead is noisier (both are medians of a few steps), so only its upper end is checked.
    assert tuning.curve[0].overhead_ms >= 3 * 4
    assert tuning.curve[0].overhead_ms - plain.curve[0].overhead_ms <= 3 * 4 * 3
    for p in tuning.curve:
        assert p.tokens_per_s == pytest.approx(3e3 * p.tau / p.step_ms)
        assert p.step_ms >= p.verify_ms + p.prune_ms + p.draft_ms + 3 * 4


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_lone_step_s_bookkeeping_is_in_every_budget_s_step(
    static: bool, target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone too, what a real step spends beyond drafting, pruning and verifying (here 4 ms
    of emitting a step's tokens) is measured on a real generation and in every budget's
    step."""
    import time as time_module

    import dart_client.decoding.autotune as autotune_module
    from dart_client.decoding.loop import _Run

    emit = _Run._emit

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        time_module.sleep(0.004)
        return emit(self, *args, **kwargs)

    monkeypatch.setattr(autotune_module, "resolve_static", lambda value, devices: static)
    dm, ps, _ = planted(target, head, 3, 9, 24)
    monkeypatch.setattr(_Run, "_emit", slow)
    tuning = autotune(
        dm, prompts=ps, budgets=(1, 13), continuation_tokens=24, context_tokens=32, repeats=2
    )
    assert len({p.overhead_ms for p in tuning.curve}) == 1
    assert tuning.curve[0].overhead_ms >= 4
    assert any("bookkeeping" in note for note in tuning.notes)
    for p in tuning.curve:
        assert p.step_ms == pytest.approx(p.verify_ms + p.prune_ms + p.draft_ms + p.overhead_ms)
        assert p.tokens_per_s == pytest.approx(1e3 * p.tau / p.step_ms)


def test_a_batch_on_the_static_path_times_the_static_batch_program(
    target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where batched generation takes the static path (cuda; forced here, eagerly), the
    batch tuning times its program: every budget's trees (drafting every row's next rows in
    it, so no separate draft is booked) and the AR roots (no head) go through
    StaticBatchVerifier, all rows at once, and each timed run starts from the same row
    lengths."""
    import dart_client.decoding.autotune as autotune_module
    from dart_client.decoding.static_batch import StaticBatchVerifier

    monkeypatch.setattr(autotune_module, "resolve_static", lambda value, devices: True)
    seen: list[tuple[int, int, bool, tuple[int, ...]]] = []
    greedy_step = StaticBatchVerifier.greedy_step

    def recording(self: Any, trees: Any) -> Any:
        lengths = tuple(self.cache.rows.lengths)
        seen.append((len(trees), max(len(t) for t in trees), self.head is not None, lengths))
        return greedy_step(self, trees)

    monkeypatch.setattr(StaticBatchVerifier, "greedy_step", recording)
    dm, ps, _ = planted(target, head, 2, 9, 12)
    tuning = autotune(
        dm, prompts=ps, budgets=(2, 9), continuation_tokens=12, context_tokens=32, repeats=2,
        batch=3,
    )  # fmt: skip
    assert all(p.verify_ms > 0 and p.draft_ms == 0 for p in tuning.curve)
    assert tuning.ar_forward_ms > 0
    assert any("drafts inside each verification replay" in n for n in tuning.notes)
    # AR roots (no head) and both budgets' trees (drafting), warm-up + 2 rounds each, 3 rows
    # at a time, each from the same row lengths.
    assert sorted({(rows, n, head) for rows, n, head, _ in seen}) == [
        (3, 1, False), (3, 3, True), (3, 10, True)
    ]  # fmt: skip
    assert len(seen) == 3 * 3 and len({lengths for *_, lengths in seen}) == 1


def test_a_batch_measures_the_largest_trees_that_fit_one_weight_pass() -> None:
    from dart_client.decoding.autotune import DEFAULT_BUDGETS, ROWS_PER_WEIGHT_PASS, batch_budgets

    assert batch_budgets(1) == sorted(DEFAULT_BUDGETS)
    four = batch_budgets(4)
    # 4 rows x 3 = 12 and 4 rows x 8 = 32 token rows: one pass each; 9-node trees need two.
    assert {2, 7} <= set(four) and set(DEFAULT_BUDGETS) <= set(four)
    for batch in range(2, 40):
        for b in set(batch_budgets(batch)) - set(DEFAULT_BUDGETS):
            assert any(batch * (b + 1) <= r < batch * (b + 2) for r in ROWS_PER_WEIGHT_PASS)
    assert batch_budgets(32) == sorted(DEFAULT_BUDGETS)  # nothing of 2+ nodes fits 32 rows
    assert batch_budgets(4, budgets=(3,)) == [2, 3, 7]
