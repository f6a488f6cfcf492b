"""Batched generation (``dart_client.decoding.batch``): fused steps over many sequences are
lossless per sequence, rows join and leave between steps, and the batched caches keep each
row's K/V where a lone sequence's would be."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, LikeliestSiblings, make_tiny_target, make_tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generate import (
    COMPARED,
    PROMPT,
    SIBLING_PARAMS,
    SMALL_VOCAB,
    chi_square_pvalue,
    exact_joint,
    random_prompts,
)

from dart_client import DartModel
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.draft import DraftRows
from dart_client.decoding.static import PREFILL_BUCKETS
from dart_client.decoding.verify import Tree
from dart_client.errors import ContextTooLongError
from dart_client.models.head import DartHead
from dart_client.models.target import TargetCache, _at

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Any:
    return make_tiny_target("llama", seed=0)


@pytest.fixture(scope="module")
def head(target: Any) -> DartHead:
    return DartHead.random_init(target.config, draft_length=3, seed=11).double()


class Truths:
    """A tree builder that plants each sequence's true continuation (found by its last
    tokens in ``truths``: prompt + the target's greedy output) under wrong branches, so
    greedy steps accept several nodes and compaction moves rows by different amounts."""

    def __init__(self, truths: Sequence[Sequence[int]], seed: int = 0, depth: int = 5) -> None:
        self.truths = [list(t) for t in truths]
        self.rng = np.random.default_rng(seed)
        self.depth = depth
        self.batches = 0
        #: The draft rows each context was first pruned with (what the head drafted there).
        self.drafts: dict[tuple[int, ...], DraftRows] = {}

    def continuation(self, context: np.ndarray) -> list[int]:
        tail = [int(t) for t in context]
        for truth in self.truths:
            for end in range(len(truth), len(tail) - 1, -1):
                if truth[end - len(tail) : end] == tail:
                    return truth[end : end + self.depth]
        return []

    def build(self, context: np.ndarray, rows: DraftRows, budget: int) -> Tree:
        self.drafts.setdefault(tuple(int(t) for t in context), rows)
        true = self.continuation(context)
        k = int(self.rng.integers(0, len(true) + 1))
        wrong = self.rng.integers(3, TINY_VOCAB, size=self.depth).tolist()
        paths = [true[:k] + wrong[: self.depth - k], rows.ids[:, 0].tolist(), true[: k + 1]]
        tree = Tree.from_paths(int(context[-1]), [p for p in paths if p])
        n = min(len(tree), budget + 1)
        return Tree.build(tree.tokens[:n], tree.parents[:n])

    def build_batch(
        self, contexts: Any, rows: Any, budgets: Any, lookup_paths: Any = None
    ) -> list[Tree]:
        self.batches += 1
        return [self.build(c, r, b) for c, r, b in zip(contexts, rows, budgets, strict=True)]


def drain(batch: Any) -> dict[int, Any]:
    """Step a batch generator until nothing is live or waiting: the results by request."""
    results: dict[int, Any] = {}
    while not batch.done:
        batch.step()
        results.update(batch.pop_finished())
    return results


def alone(dm: DartModel, prompt: Sequence[int], mode: str, **kwargs: Any) -> list[int]:
    return dm.generate(input_ids=list(prompt), mode=mode, **kwargs).tokens


#: The dynamic path, and the static one (cuda's default; eager here) with its fixed-shape
#: program, device-side acceptance and compaction.
STATIC = pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])


def forward_shapes(dm: DartModel, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The input shape of every target forward from now on (the real forward runs)."""
    shapes: list[tuple[int, ...]] = []
    forward = type(dm.target).forward

    def counted(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(input_ids.shape))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(dm.target), "forward", counted)
    return shapes


#: Requests joining at one step prefilled each alone (the CPU's default) or together in one
#: forward (cuda's).
ADMISSION = pytest.mark.parametrize("admit", [False, True], ids=["alone", "together"])


@STATIC
@ADMISSION
@pytest.mark.parametrize("mode", ["ar", "dart"])
def test_greedy_batch_equals_each_prompt_alone_with_the_pruner(
    mode: str, admit: bool, static: bool, target: Any, head: DartHead, tiny_ngram_path: Any
) -> None:
    from dart_client.ngram import NGram

    dm = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)), prompt_lookup=8)
    # Ragged prompts (1 to 39 tokens); max_new 1 ends a row at its first token.
    prompts = random_prompts(6, seed=3)
    for max_new in (1, 9, 30):
        got = dm.generate_batch(
            prompts, mode=mode, max_new_tokens=max_new, static=static, admit_together=admit
        )
        for prompt, result in zip(prompts, got, strict=True):
            assert result.tokens == alone(dm, prompt, mode, max_new_tokens=max_new)
            assert result.mode == mode


@STATIC
def test_greedy_batch_with_long_accepted_paths_equals_alone(
    static: bool, target: Any, head: DartHead
) -> None:
    dm = DartModel(target, head, tree_builder=None)
    prompts = random_prompts(5, seed=8)
    truths = [p + alone(dm, p, "ar", max_new_tokens=40) for p in prompts]
    builder = Truths(truths)
    dm.tree_builder = builder
    got = dm.generate_batch(prompts, max_new_tokens=40, tree_budget=12, static=static)
    for prompt, truth, result in zip(prompts, truths, got, strict=True):
        assert result.tokens == truth[len(prompt) :]
    # What makes the test able to fail: several rows, long and uneven accepted paths.
    steps = [a for r in got for a in r.accept_lengths[1:]]
    assert max(steps) >= 4 and min(steps) == 1
    assert builder.batches < sum(r.steps for r in got)


@STATIC
@pytest.mark.parametrize("mode", ["ar", "dart"])
def test_requests_joining_together_are_prefilled_in_one_forward(
    mode: str, static: bool, target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several requests joining at one step (ragged prompts, one of a single token, one that
    ends at its first token) take one prefill forward, into free rows beside live ones
    (whose caches reach further: the new rows' positions start at 0 all the same); every
    output equals its prompt alone, and the head's cache rows hold what the head reading
    each prompt alone would."""
    dm = DartModel(target, head, tree_builder=None)
    prompts = [*random_prompts(5, seed=21), [7]]
    news = [20, 12, 1, 16, 9, 14]
    truths = [p + alone(dm, p, "ar", max_new_tokens=n) for p, n in zip(prompts, news, strict=True)]
    dm.tree_builder = Truths(truths, seed=4)
    batch = dm.batch_generator(
        mode=mode, max_batch=5, max_length=96, static=static, admit_together=True
    )
    widths = forward_shapes(dm, monkeypatch)
    config = dm.resolve_config(GenerationConfig(max_new_tokens=news[0], tree_budget=8))
    ids = {batch.add(config, input_ids=prompts[0]): 0}
    batch.step()
    batch.step()
    for i in range(1, len(prompts)):
        config = dm.resolve_config(GenerationConfig(max_new_tokens=news[i], tree_budget=8))
        ids[batch.add(config, input_ids=prompts[i])] = i
    widths.clear()
    events = batch.step()
    # The four that fit joined in one prefill of the longest prompt's width.
    joined = [len(p) for p in prompts[1:5]]
    assert (4, max(joined)) in widths
    assert not any(shape[0] == 1 and shape[1] > 1 for shape in widths if shape != (4, max(joined)))
    assert {request for request, _ in events} >= {r for r, i in ids.items() if 1 <= i <= 4}
    results = drain(batch)
    assert len(results) == len(prompts)
    for request, result in results.items():
        i = ids[request]
        assert result.tokens == truths[i][len(prompts[i]) :], f"request {i}"
    if mode == "dart":
        # The head read each prompt as alone: every context drafts what it drafts alone.
        together = dm.tree_builder.drafts
        lone = Truths(truths, seed=4)
        dm.tree_builder = lone
        for prompt, new in zip(prompts, news, strict=True):
            dm.generate(input_ids=prompt, max_new_tokens=new, tree_budget=8, static=static)
        shared = together.keys() & lone.drafts.keys()
        assert len(shared) >= 5
        for context in shared:
            assert np.array_equal(together[context].ids, lone.drafts[context].ids), context
            np.testing.assert_allclose(together[context].probs, lone.drafts[context].probs, 1e-9)


def test_an_admission_forward_takes_at_most_its_token_budget(
    target: Any, head: DartHead, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts padded to the longest cost their count times its length: the waiting ones
    are admitted in order, a forward taking as many as fit ADMIT_TOGETHER_TOKENS (a prompt
    that fits with none is prefilled alone), and the outputs still equal each alone."""
    from dart_client.decoding import batch as batch_module

    dm = DartModel(target, head, tree_builder=None)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (10, 3, 12, 5, 30)]
    truths = [p + alone(dm, p, "ar", max_new_tokens=6) for p in prompts]
    dm.tree_builder = Truths(truths, seed=2)
    monkeypatch.setattr(batch_module, "ADMIT_TOGETHER_TOKENS", 24)
    shapes = forward_shapes(dm, monkeypatch)
    got = dm.generate_batch(prompts, max_new_tokens=6, tree_budget=4, admit_together=True)
    # [10, 3] (2 x 10), [12, 5] (2 x 12), then 30 alone (its own prefill).
    assert shapes[:3] == [(2, 10), (2, 12), (1, 30)]
    for prompt, truth, result in zip(prompts, truths, got, strict=True):
        assert result.tokens == truth[len(prompt) :]


@STATIC
def test_rows_join_and_leave_between_steps(static: bool, target: Any, head: DartHead) -> None:
    """Continuous batching: 2 slots, 6 requests added at different steps, rows ending at
    different times (EOS, length, their first token); each output equals its prompt alone;
    a request longer than the context is refused and the others go on."""
    dm = DartModel(target, head, tree_builder=None)
    prompts = random_prompts(6, seed=12)
    news = [25, 1, 14, 30, 3, 18]
    truths = [p + alone(dm, p, "ar", max_new_tokens=n) for p, n in zip(prompts, news, strict=True)]
    dm.tree_builder = Truths(truths, seed=1)
    batch = dm.batch_generator(max_batch=2, max_length=64, static=static)
    ids: dict[int, int] = {}
    results: dict[int, Any] = {}
    live_counts = []
    for i, (prompt, new) in enumerate(zip(prompts, news, strict=True)):
        config = dm.resolve_config(GenerationConfig(max_new_tokens=new, tree_budget=8))
        ids[batch.add(config, input_ids=prompt)] = i
        if i == 2:
            with pytest.raises(ContextTooLongError, match="max_length"):
                batch.add(config, input_ids=list(range(3, 70)))
        batch.step()
        live_counts.append(batch.live)
        results.update(batch.pop_finished())
    while not batch.done:
        batch.step()
        live_counts.append(batch.live)
        results.update(batch.pop_finished())
    assert max(live_counts) == 2 and live_counts[-1] == 0
    assert len(results) == len(prompts)
    assert not batch.cancel(0)  # finished: nothing to cancel
    # No autograd history kept in the caches (it chained every request to the next: a leak).
    assert batch.head_cache is not None and batch.head_cache._k is not None
    assert not batch.head_cache._k.requires_grad
    for request, result in results.items():
        i = ids[request]
        assert result.tokens == truths[i][len(prompts[i]) :], f"request {i}"
    if static:
        # One program per (rows, tree bucket, window): one row and two rows both ran.
        assert batch.verifier is not None
        assert {key[0] for key in batch.verifier._state} == {1, 2}
    else:
        assert batch.verifier is None


@STATIC
def test_a_cancelled_row_frees_its_slot_and_the_others_go_on(
    static: bool, target: Any, head: DartHead
) -> None:
    dm = DartModel(target, head, tree_builder=None)
    prompts = random_prompts(4, seed=31)
    truths = [p + alone(dm, p, "ar", max_new_tokens=20) for p in prompts]
    dm.tree_builder = Truths(truths, seed=2)
    batch = dm.batch_generator(max_batch=3, max_length=64, static=static)
    config = GenerationConfig(max_new_tokens=20, tree_budget=6)
    ids = [batch.add(config, input_ids=p) for p in prompts]
    batch.step()
    assert batch.live == 3 and len(batch.waiting) == 1
    assert batch.cancel(ids[0]) and batch.live == 2  # a live row (the first: others move)
    assert batch.cancel(ids[3]) and not batch.waiting  # a waiting one
    assert not batch.cancel(ids[3])
    results: dict[int, Any] = {}
    while not batch.done:
        batch.step()
        results.update(batch.pop_finished())
    assert set(results) == {ids[1], ids[2]}
    for i in (1, 2):
        assert results[ids[i]].tokens == truths[i][len(prompts[i]) :]


def test_static_batches_keep_their_caches_and_programs_for_the_next(
    target: Any, head: DartHead
) -> None:
    """A static batch borrows its caches from the target and gives them back, its verifier
    (and on cuda the graphs it captured) with them: the next batch of that size decodes on
    the same ones, also after a batch dropped in the middle of its run."""
    dm = DartModel(target, head, tree_builder=None)
    prompts = random_prompts(3, seed=41)
    # Dynamic (cuda's default is static): the lone static cache then holds only the batch's
    # prefill programs.
    truths = [p + alone(dm, p, "ar", max_new_tokens=16, static=False) for p in prompts]
    dm.tree_builder = Truths(truths, seed=4)
    want = [t[len(p) :] for p, t in zip(prompts, truths, strict=True)]
    config = {"max_new_tokens": 16, "tree_budget": 6, "max_length": 64}
    first = dm.generate_batch(prompts, static=True, **config)
    assert [r.tokens for r in first] == want
    (cache,) = dm.target.__dict__["_static_batch_caches"][3]
    (verifier,) = cache.static_verifiers.values()
    # Each prompt was prefilled alone on the static path too: chunk programs over a lone
    # static cache the target keeps (a graph each on cuda), then copied into its row.
    (lone,) = dm.target.__dict__["_static_caches"]
    (prefill,) = lone.static_verifiers.values()
    assert not lone.lent and {size for size, _, _ in prefill._state} == {PREFILL_BUCKETS[0]}
    assert not cache.lent and not len(cache.rows)
    abandoned = dm.batch_generator(max_batch=3, max_length=64, static=True)
    assert abandoned.cache is cache and abandoned.verifier is verifier
    for prompt in prompts:
        abandoned.add(GenerationConfig(**config), input_ids=prompt)
    abandoned.step()
    abandoned.step()
    assert abandoned.live == 3
    del abandoned  # mid-run: its rows are still in the caches
    again = dm.batch_generator(max_batch=3, max_length=64, static=True)
    ids = [again.add(GenerationConfig(**config), input_ids=p) for p in prompts[:0:-1]]
    results = drain(again)
    assert [results[i].tokens for i in ids] == want[:0:-1]
    assert again.cache is cache and again.verifier is verifier
    again.close()
    assert dm.target.__dict__["_static_batch_caches"][3] == [cache]
    assert list(cache.static_verifiers.values()) == [verifier]


@STATIC
def test_all_rows_ending_together_and_a_bad_prompt(
    static: bool, target: Any, head: DartHead
) -> None:
    dm = DartModel(target, head, tree_builder=Truths([]))
    prompts = random_prompts(4, seed=21)
    got = dm.generate_batch(prompts, mode="ar", max_new_tokens=5, static=static)
    assert all(len(r.tokens) <= 5 for r in got)
    assert [r.tokens for r in got] == [alone(dm, p, "ar", max_new_tokens=5) for p in prompts]
    # Two rows at a time: the others join as rows free up.
    two = dm.generate_batch(prompts, mode="ar", max_new_tokens=5, max_batch=2, static=static)
    assert [r.tokens for r in two] == [r.tokens for r in got]
    with pytest.raises(ContextTooLongError, match="prompt 1"):
        dm.generate_batch([[5, 6], list(range(3, 300))], max_new_tokens=4, max_length=100)


def test_stop_strings_inside_a_batch_end_their_row_as_alone(target: Any, head: DartHead) -> None:
    """A stop string met inside an accepted run ends its row where a lone generation ends
    (tokens, text, reason); the other rows (another stop, none) go on to their own ends."""
    tok = make_tiny_tokenizer()
    plain = DartModel(target, head, tokenizer=tok, tree_builder=None)
    plain.target.eos_token_ids = frozenset()  # this wrapper's: runs to the stop or length
    prompts = random_prompts(3, seed=41)
    free = [alone(plain, p, "ar", max_new_tokens=24) for p in prompts]
    # Row 0 stops inside a word spanning tokens 6 and 7, row 1 at token 12's text, row 2
    # never (a string no output holds).
    stops = [tok.decode(free[0][6:8])[1:], tok.decode(free[1][12:13]), "no such text"]
    plain.tree_builder = Truths([p + f for p, f in zip(prompts, free, strict=True)], depth=6)
    batch = plain.batch_generator(max_batch=3, max_length=64)
    ids = [
        batch.add(GenerationConfig(max_new_tokens=24, tree_budget=8, stop=[s]), input_ids=p)
        for p, s in zip(prompts, stops, strict=True)
    ]
    results: dict[int, Any] = {}
    while not batch.done:
        batch.step()
        results.update(batch.pop_finished())
    got = [results[i] for i in ids]
    for prompt, stop, result in zip(prompts, stops, got, strict=True):
        lone = plain.generate(input_ids=prompt, max_new_tokens=24, tree_budget=8, stop=[stop])
        assert (result.tokens, result.text, result.finish_reason) == (
            lone.tokens,
            lone.text,
            lone.finish_reason,
        )
        assert stop not in result.text
    assert [r.finish_reason for r in got] == ["stop", "stop", "length"]
    assert len(got[0].tokens) < 24 and len(got[1].tokens) < 24 == len(got[2].tokens)
    # What makes the test able to fail: a step whose accepted run goes past the stop (the
    # row keeps only its tokens up to the stop).
    assert any(sum(r.accept_lengths) > len(r.tokens) for r in got[:2])


def test_text_is_the_same_streamed_or_decoded_at_the_end(target: Any, head: DartHead) -> None:
    """``generate_batch`` (which returns only results) decodes each row's text once at the
    end; a batch generator's events stream it step by step (a delta each); both give the
    tokenizer's decoding of the tokens."""
    tok = make_tiny_tokenizer()
    prompts = random_prompts(3, seed=43)
    dm = DartModel(target, head, tokenizer=tok, tree_builder=None)
    free = [alone(dm, p, "ar", max_new_tokens=20) for p in prompts]
    dm.tree_builder = Truths([p + f for p, f in zip(prompts, free, strict=True)], depth=5)
    config = GenerationConfig(max_new_tokens=20, tree_budget=8)
    results = dm.generate_batch(prompts, config)
    batch = dm.batch_generator(max_batch=3, max_length=64)
    ids = [batch.add(config, input_ids=p) for p in prompts]
    deltas: dict[int, str] = dict.fromkeys(ids, "")
    streamed: dict[int, Any] = {}
    while not batch.done:
        for request, event in batch.step():
            deltas[request] += event.text
        streamed.update(batch.pop_finished())
    for request, result in zip(ids, results, strict=True):
        want = tok.decode(result.tokens, skip_special_tokens=True)
        assert want and result.text == want == streamed[request].text == deltas[request]
        assert streamed[request].tokens == result.tokens


@pytest.fixture(scope="module")
def sampling_model() -> Any:
    model = make_tiny_target("llama", vocab_size=SMALL_VOCAB, layers=4, seed=5, init_range=0.3)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    return model


class LikeliestBatch(LikeliestSiblings):
    """:class:`LikeliestSiblings` for rows of a batch: the contexts hold each row's whole
    sequence (it stays under the pruner's context length), so no tracking is needed."""

    def __init__(self, model: Any, width: int = 3, depth: int = 2) -> None:
        super().__init__(model, SIBLING_PARAMS, width, depth)

    def build(self, context: np.ndarray, rows: DraftRows, budget: int) -> Tree:
        return self.grow(int(context[-1]), tuple(int(t) for t in context), budget)


def test_sampling_rows_keep_the_target_distribution_beside_greedy_rows(
    sampling_model: Any,
) -> None:
    """Batches of 6 sampling rows (own seeds) and 2 greedy rows: the sampled rows' first
    tokens follow the target's joint distribution (chi-square), the greedy rows equal
    greedy decoding alone."""
    head = DartHead.random_init(sampling_model.config, draft_length=2, seed=3, std=0.5).double()
    dm = DartModel(sampling_model, head, tree_builder=LikeliestBatch(sampling_model))
    exact = exact_joint(sampling_model, PROMPT, COMPARED, SIBLING_PARAMS)
    p = SIBLING_PARAMS
    greedy_want = alone(dm, PROMPT, "ar", max_new_tokens=COMPARED)
    counts: Counter = Counter()
    runs = 0
    accepted = 0
    for batch_no in range(150):
        batch = dm.batch_generator(max_batch=8, max_length=16)
        ids = {}
        for j in range(8):
            sampling = j < 6
            config = GenerationConfig(
                max_new_tokens=COMPARED,
                temperature=p.temperature if sampling else 0.0,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=batch_no * 8 + j,
                tree_budget=12,
            )
            ids[batch.add(config, input_ids=PROMPT)] = sampling
        results: dict[int, Any] = {}
        while not batch.done:
            batch.step()
            results.update(batch.pop_finished())
        for request, result in results.items():
            if ids[request]:
                counts[tuple(result.tokens)] += 1
                runs += 1
                accepted += sum(a - 1 for a in result.accept_lengths[1:])
            else:
                assert result.tokens == greedy_want
    assert accepted >= runs // 2, "drafts were hardly accepted: the test would be vacuous"
    pvalue = chi_square_pvalue(counts, exact, runs)
    assert pvalue > 1e-3, f"batched samples differ from the target (p={pvalue:.2e})"


# ---- the batched caches ---------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.data(), stacked=st.booleans())
def test_batched_cache_rows_hold_what_lone_caches_would(data: st.DataObject, stacked: bool) -> None:
    layers, heads, dim = 3, 2, 4
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float64)

    batch = TargetCache(layers, capacity=40, stacked=stacked, batch=3)
    want: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for row in range(3):
        n = data.draw(st.integers(1, 8))
        lone = TargetCache(layers, capacity=n)
        kv = [(rand(1, heads, n, dim), rand(1, heads, n, dim)) for _ in range(layers)]
        for layer, (k, v) in zip(lone.layers, kv, strict=True):
            layer.update(k, v)
        batch.put_row(row, lone)
        want.append(kv)
        if row == 0:
            # The buffers are not initialised: make what no row holds NaN, as such memory may be.
            for buffer, axis in batch.buffers():
                held = buffer[_at(axis, 0, slice(None), slice(0, n))].clone()
                buffer.fill_(float("nan"))
                buffer[_at(axis, 0, slice(None), slice(0, n))] = held
        assert_readable_is_finite(batch)
    for _ in range(data.draw(st.integers(1, 3))):
        n = data.draw(st.integers(1, 5))
        start = batch.length
        new = [(rand(3, heads, n, dim), rand(3, heads, n, dim)) for _ in range(layers)]
        for layer, (k, v) in zip(batch.layers, new, strict=True):
            layer.update(k[: len(batch.rows)], v[: len(batch.rows)])
        keeps = [
            sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
            for _ in range(len(batch.rows))
        ]
        batch.keep_rows(start, keeps, torch.device("cpu"))
        for row, keep in enumerate(keeps):
            want[row] = [
                (
                    torch.cat((k0, k[row : row + 1, :, keep]), 2),
                    torch.cat((v0, v[row : row + 1, :, keep]), 2),
                )
                for (k0, v0), (k, v) in zip(want[row], new, strict=True)
            ]
        if len(batch.rows) > 1 and data.draw(st.booleans()):
            drop = data.draw(st.integers(0, len(batch.rows) - 1))
            batch.drop_row(drop)
            want[drop] = want[-1]
            want.pop()
        assert_readable_is_finite(batch)
    assert batch.length == max(batch.rows.lengths)
    for row, kv in enumerate(want):
        n = batch.rows.lengths[row]
        for layer, (k, v) in zip(batch.layers, kv, strict=True):
            assert torch.equal(layer.keys[row, :, :n], k[0])
            assert torch.equal(layer.values[row, :, :n], v[0])


def assert_readable_is_finite(cache: TargetCache) -> None:
    """What attention reads of a batched cache (every live row up to the frontier, its own
    stale positions masked) is finite: a masked NaN would still poison the weighted sum."""
    for layer in cache.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


@STATIC
def test_autoregressive_sampling_rows_equal_each_seeded_run_alone(
    static: bool, target: Any
) -> None:
    """AR rows draw from their own generators in a lone run's order: mixed greedy and
    seeded sampling rows (own temperatures) equal each request run alone, token for token."""
    dm = DartModel(target)
    prompts = random_prompts(5, seed=40)
    configs = [
        GenerationConfig(max_new_tokens=12, temperature=t, top_p=0.9, seed=s)
        for t, s in zip((0.0, 0.7, 1.0, 0.0, 1.3), (1, 2, 3, 4, 5), strict=True)
    ]
    batch = dm.batch_generator(mode="ar", max_batch=3, max_length=64, static=static)
    ids = [batch.add(c, input_ids=p) for c, p in zip(configs, prompts, strict=True)]
    results: dict[int, Any] = {}
    while not batch.done:
        batch.step()
        results.update(batch.pop_finished())
    for i, (config, prompt) in enumerate(zip(configs, prompts, strict=True)):
        want = dm.generate(input_ids=prompt, config=config, mode="ar").tokens
        assert results[ids[i]].tokens == want, f"request {i}"
    assert len({tuple(r.tokens) for r in results.values()}) == len(prompts)


def test_static_dart_batches_with_sampling_rows_decode_as_the_dynamic_ones(
    target: Any, head: DartHead
) -> None:
    """A batch with seeded sampling rows beside greedy ones takes the static program's
    forward and accepts on the host: the same tokens as the dynamic batch (float64), rows
    joining and leaving; an all-greedy batch of the same prompts takes the device
    acceptance and also decodes as the dynamic one."""
    dm = DartModel(target, head, tree_builder=None)
    prompts = random_prompts(5, seed=41)
    truths = [p + alone(dm, p, "ar", max_new_tokens=16) for p in prompts]
    temperatures = (0.0, 0.8, 1.0, 0.0, 1.2)
    for sampled in (True, False):
        outputs = {}
        for static in (False, True):
            dm.tree_builder = Truths(truths, seed=3)
            batch = dm.batch_generator(max_batch=3, max_length=64, static=static)
            ids = []
            for i, prompt in enumerate(prompts):
                t = temperatures[i] if sampled else 0.0
                config = GenerationConfig(max_new_tokens=16, temperature=t, seed=i, tree_budget=8)
                ids.append(batch.add(config, input_ids=prompt))
            results = drain(batch)
            outputs[static] = [results[i].tokens for i in ids]
            if static:
                assert batch.verifier is not None
        assert outputs[True] == outputs[False], f"sampled={sampled}"
        if not sampled:
            assert outputs[True] == [t[len(p) :] for t, p in zip(truths, prompts, strict=True)]


class RecordingTruths(Truths):
    """:class:`Truths` that keeps every batched call's draft rows and budgets, in step
    order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[list[DraftRows]] = []
        self.budgets: list[list[int]] = []

    def build_batch(
        self, contexts: Any, rows: Any, budgets: Any, lookup_paths: Any = None
    ) -> list[Tree]:
        self.seen.append(list(rows))
        self.budgets.append([int(b) for b in budgets])
        return super().build_batch(contexts, rows, budgets, lookup_paths)


@pytest.mark.parametrize("lead", [0, 220], ids=["short", "across-a-window"])
def test_the_static_program_drafts_what_the_dynamic_batch_drafts(
    lead: int, target: Any, head: DartHead
) -> None:
    """Greedy batches on the static path draft every row's next rows inside the program
    (accepted rows right-aligned, each row at its own head length): the same top-k ids and
    probabilities as the dynamic batched draft at every step, rows of ragged lengths joining
    and leaving, long accepted runs included; with 220 more prompt tokens the rows' heads
    cross the 256-position attention window."""
    dm = DartModel(target, head, tree_builder=None)
    dm.draft_top_k = 5
    filler = np.random.default_rng(45).integers(3, TINY_VOCAB, size=lead).tolist()
    prompts = [filler + p for p in random_prompts(5, seed=44)]
    news = [20, 6, 16, 24, 10]
    truths = [p + alone(dm, p, "ar", max_new_tokens=n) for p, n in zip(prompts, news, strict=True)]
    seen = {}
    for static in (False, True):
        builder = RecordingTruths(truths, seed=5)
        dm.tree_builder = builder
        batch = dm.batch_generator(max_batch=3, max_length=lead + 64, static=static)
        ids = [
            batch.add(GenerationConfig(max_new_tokens=n, tree_budget=10), input_ids=p)
            for p, n in zip(prompts, news, strict=True)
        ]
        results = drain(batch)
        for i, truth, prompt in zip(ids, truths, prompts, strict=True):
            assert results[i].tokens == truth[len(prompt) :]
        seen[static] = builder.seen
        if static:
            assert batch.verifier is not None and batch.verifier.head is not None
            head_windows = {key[3] for key in batch.verifier._state}
            assert len(head_windows) == (2 if lead else 1), head_windows
    assert len(seen[True]) == len(seen[False]) >= 6
    steps = 0
    for got_step, want_step in zip(seen[True], seen[False], strict=True):
        assert len(got_step) == len(want_step)
        for got, want in zip(got_step, want_step, strict=True):
            np.testing.assert_array_equal(got.ids, want.ids)
            np.testing.assert_allclose(got.probs, want.probs, rtol=1e-5, atol=1e-6)
            steps += 1
    assert steps > 15


def test_the_static_switch_takes_its_command_line_words(target: Any, head: DartHead) -> None:
    """``static`` as the command lines give it ("on", "off", "auto") reaches batched
    generation and every request of ``dart serve`` (``--static``) as the switch it names;
    a served batch on the static path decodes as each prompt alone."""
    pytest.importorskip("uvicorn", reason="dart serve needs the `serve` extra (uvicorn)")
    from dart_client.apps.serve.app import build_parser
    from dart_client.apps.serve.generation import Engine, Sampling
    from dart_client.errors import InvalidArgumentError

    assert build_parser().parse_args(["--static", "off"]).static == "off"
    assert build_parser().parse_args([]).static == "auto"

    dm = DartModel(target, head, tree_builder=None)
    prompts = random_prompts(3, seed=51)
    truths = [p + alone(dm, p, "ar", max_new_tokens=10) for p in prompts]
    dm.tree_builder = Truths(truths, seed=4)
    assert dm.batch_generator(static="off").static is False
    assert dm.batch_generator(static="on").static is True
    assert dm.batch_generator(static="auto").static is (target.device.type == "cuda")
    with pytest.raises(InvalidArgumentError, match="static"):
        dm.batch_generator(static="sometimes")
    for word, expected in (("on", True), ("off", False)):
        engine = Engine(dm, "tiny", 64, static=word)
        sampling = Sampling(max_new_tokens=10, tree_budget=6)
        assert engine.config(prompts[0], sampling).static is expected
        batch = engine.batch_generator("dart", 2)
        assert batch.static is expected
        ids = [batch.add(engine.config(p, sampling, 2), input_ids=p) for p in prompts]
        results = drain(batch)
        for i, prompt, truth in zip(ids, prompts, truths, strict=True):
            assert results[i].tokens == truth[len(prompt) :]
        assert (batch.verifier is not None) is expected


def tuned(budget: int, batch: int = 1) -> Any:
    """A tuning result choosing ``budget`` (only its choice is read here)."""
    from dart_client.decoding.autotune import TreeBudgetTuning

    return TreeBudgetTuning(budget, [], 1.0, 0, 0, 0, "cpu", "float64", 1, 0.0, batch=batch)


@STATIC
def test_an_auto_budget_follows_the_rows_live_at_each_step(
    static: bool, target: Any, head: DartHead
) -> None:
    """tree_budget="auto" in a batch: at every step each such row takes the budget tuned for
    the smallest tuned batch size holding the rows live then (1 row: the lone one's; 2: the
    2-row one's; 3 and 4: the 4-row one's), so a row left alone drafts a lone sequence's
    tree; an explicit budget is kept; every output is its prompt's alone."""
    dm = DartModel(target, head, tree_builder=None)
    prompts = random_prompts(4, seed=51)
    news = [3, 8, 14, 30]
    truths = [p + alone(dm, p, "ar", max_new_tokens=n) for p, n in zip(prompts, news, strict=True)]
    builder = RecordingTruths(truths, seed=5)
    dm.tree_builder = builder
    dm.tree_tuning = tuned(9)
    dm.batch_tree_tunings = {2: tuned(5, 2), 4: tuned(2, 4)}
    cap = {1: 9, 2: 5, 3: 2, 4: 2}
    batch = dm.batch_generator(max_batch=4, max_length=64, static=static)
    ids = [
        batch.add(GenerationConfig(max_new_tokens=n, tree_budget="auto"), input_ids=p)
        for p, n in zip(prompts, news, strict=True)
    ]
    results = drain(batch)
    for i, request in enumerate(ids):
        assert results[request].tokens == truths[i][len(prompts[i]) :]
    assert builder.budgets and all(max(b) <= cap[len(b)] for b in builder.budgets), builder.budgets
    for rows in (1, 2, 4):  # each row count reached its cap (room was ample at some step)
        assert any(len(b) == rows and max(b) == cap[rows] for b in builder.budgets), builder.budgets

    builder.budgets.clear()
    batch = dm.batch_generator(max_batch=4, max_length=64, static=static)
    auto = batch.add(GenerationConfig(max_new_tokens=30, tree_budget="auto"), input_ids=prompts[3])
    fixed = batch.add(GenerationConfig(max_new_tokens=30, tree_budget=12), input_ids=prompts[3])
    results = drain(batch)
    assert results[auto].tokens == results[fixed].tokens == truths[3][len(prompts[3]) :]
    assert sorted(builder.budgets[0]) == [cap[2], 12], builder.budgets


def test_auto_budgets_come_from_the_tunings_held() -> None:
    """budget_for_rows: the smallest tuned batch size holding the rows, else the largest;
    with none held it tunes max_batch (once); a server tunes 1, the powers of two and its
    batch."""
    from types import SimpleNamespace

    import dart_client.decoding.autotune as autotune

    model = SimpleNamespace(tree_tuning=tuned(9), batch_tree_tunings={2: tuned(5), 8: tuned(1)})
    assert [autotune.budget_for_rows(model, r, 8) for r in (1, 2, 3, 8, 9)] == [9, 5, 1, 1, 1]
    calls: list[int] = []

    def fake_autotune(m: Any, batch: int = 1, **kwargs: Any) -> Any:
        calls.append(batch)
        return tuned(3 + batch, batch)

    bare = SimpleNamespace(tree_tuning=None, batch_tree_tunings={})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune, "autotune", fake_autotune)
        assert autotune.budget_for_rows(bare, 2, 4) == 7
        assert autotune.budget_for_rows(bare, 1, 4) == 7  # 4 rows' tuning: the one held
    assert calls == [4]
    assert [autotune.tuned_batch_sizes(n) for n in (1, 2, 3, 4, 6, 8)] == [
        [1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 6], [1, 2, 4, 8]
    ]  # fmt: skip


def test_generate_batch_sizes_the_tail_from_the_tunings_held(target: Any, head: DartHead) -> None:
    """generate_batch with tree_budget="auto": tuned for the batch (held here: 3 rows, 2
    nodes), and once rows finish (they accept different amounts per step) the rest take the
    smallest tuned size holding them (2 rows: still the 3-row tuning; 1 row: the lone
    tuning's 9). An int budget stays fixed. Every output is its prompt's alone."""
    dm = DartModel(target, head, tree_builder=None)
    rng = np.random.default_rng(61)
    # One max_length, prompts of 4, 30 and 46 tokens: 56, 30 and 14 new tokens each.
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (4, 30, 46)]
    limits = {"max_new_tokens": 64, "max_length": 60}
    truths = [p + alone(dm, p, "ar", **limits) for p in prompts]
    want = [t[len(p) :] for t, p in zip(truths, prompts, strict=True)]
    assert [len(w) for w in want] == [56, 30, 14]
    builder = RecordingTruths(truths, seed=6)
    dm.tree_builder = builder
    dm.tree_tuning = tuned(9)
    dm.batch_tree_tunings = {3: tuned(2, 3)}
    outs = dm.generate_batch(prompts, tree_budget="auto", **limits)
    assert [o.tokens for o in outs] == want
    seen = list(builder.budgets)
    assert all(max(b) <= 2 for b in seen if len(b) > 1), seen
    assert any(len(b) == 1 and max(b) == 9 for b in seen), seen
    builder.budgets.clear()
    outs = dm.generate_batch(prompts, tree_budget=5, **limits)
    assert [o.tokens for o in outs] == want
    assert all(max(b) <= 5 for b in builder.budgets), builder.budgets
    assert any(len(b) == 1 and max(b) == 5 for b in builder.budgets), builder.budgets


@STATIC
def test_ignore_eos_generates_past_the_end_alone_and_batched(
    static: bool, target: Any, head: DartHead
) -> None:
    """``ignore_eos``: the output runs to ``max_new_tokens`` through end-of-sequence tokens,
    the same alone and in a batch, DART and AR; without it the output ends at the first."""
    prompts = random_prompts(3, seed=30)
    dm = DartModel(target, head, tree_builder=None)
    truths = [p + alone(dm, p, "ar", max_new_tokens=24) for p in prompts]
    dm.tree_builder = Truths(truths)
    # The 5th token of the first output ends a sequence from now on.
    eos = truths[0][len(prompts[0]) + 4]
    dm.target.eos_token_ids = {eos}
    try:
        for mode in ("ar", "dart"):
            ended = alone(dm, prompts[0], mode, max_new_tokens=24, tree_budget=12)
            assert ended[-1] == eos and len(ended) <= 5
            config = {"max_new_tokens": 24, "tree_budget": 12, "ignore_eos": True}
            full = [alone(dm, p, mode, static=static, **config) for p in prompts]
            assert full[0] == truths[0][len(prompts[0]) :]
            assert all(len(f) == 24 for f in full)
            got = dm.generate_batch(prompts, mode=mode, static=static, **config)
            assert [r.tokens for r in got] == full
            assert all(r.finish_reason == "length" for r in got)
            # A stop token id ends the output as end-of-sequence does, ignored or not.
            stop = truths[1][len(prompts[1]) + 6]
            for ignore in (False, True):
                cut = dm.generate_batch(
                    prompts[1:2], mode=mode, static=static,
                    **{**config, "ignore_eos": ignore, "stop_token_ids": [stop]},
                )[0].tokens  # fmt: skip
                want = full[1][: full[1].index(stop) + 1]
                if not ignore and eos in want:
                    want = want[: want.index(eos) + 1]
                assert cut == want
    finally:
        dm.target.eos_token_ids = dm.target._eos_ids()
