"""The static verification path (``dart_client.decoding.static``): fixed-shape buffers,
trees padded to buckets, greedy acceptance and K/V compaction on the device, CUDA graphs on
cuda. On the CPU the same program runs eagerly; it must decode exactly as the dynamic path
and the target's greedy decoding (float64), and padding must never change an output.
``DART_TEST_DEVICE=cuda`` runs the graph tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    TEST_DEVICE,
    PlantedContinuation,
    assert_divergence_is_a_near_tie,
    generate_tracked,
    make_tiny_target,
    make_tiny_tokenizer,
)
from test_batch import drain
from test_generate import OracleTree, hf_greedy, random_prompts, run_oracle

from dart_client import DartModel, ar_generate, dart_generate
from dart_client.decoding.accept import accept_greedy
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.loop import PrefixCache
from dart_client.decoding.static import (
    KEEP_FREE_STATIC_CACHES,
    PREFILL_BUCKETS,
    WINDOW_ALIGN,
    StaticVerifier,
    attention_window,
    bucket_sizes,
    lend_cache,
    resolve_static,
    return_cache,
    static_capacity,
    verifier_for,
)
from dart_client.decoding.verify import Tree, verify_tree
from dart_client.errors import InvalidArgumentError
from dart_client.models.head import DartHead
from dart_client.models.target import TargetModel

cuda_only = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA graphs: DART_TEST_DEVICE=cuda")


def test_buckets_and_capacity() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(8) == (1, 8)
    assert bucket_sizes(9) == (1, 8, 16)
    assert bucket_sizes(61) == (1, 8, 16, 32, 64)
    assert bucket_sizes(100) == (1, 8, 16, 32, 64, 128)
    assert bucket_sizes(513) == (1, 8, 16, 32, 64, 544)
    with pytest.raises(InvalidArgumentError, match="at least one node"):
        bucket_sizes(0)
    capacity = static_capacity(300, 61)
    assert capacity % 256 == 0 and capacity >= 300 + 64 + 1
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert resolve_static("auto", {cpu}) is False
    assert resolve_static("auto", {gpu0}) is True
    assert resolve_static("auto", {gpu0, gpu1}) is False  # a target split over GPUs
    assert resolve_static(True, {cpu}) is True and resolve_static(False, {gpu0}) is False
    assert resolve_static("off", {gpu0}) is False and resolve_static("on", {cpu}) is True
    assert GenerationConfig(static="off").static is False
    assert GenerationConfig(static="ON").static is True
    with pytest.raises(InvalidArgumentError, match="static"):
        GenerationConfig(static="sometimes")


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, DartHead]:
    model = make_tiny_target("llama", seed=0)
    head = DartHead.random_init(model.config, draft_length=3, seed=11).double().to(model.device)
    return model, head


def random_tree(size: int, rng: np.random.Generator, vocab: int) -> Tree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
    tokens = rng.integers(3, vocab, size=size).tolist()
    return Tree.build(tokens, parents)


def prefilled(target: TargetModel, prompt: list[int], capacity: int) -> Any:
    cache = target.new_cache(capacity)
    ids = torch.tensor([prompt], device=target.device)
    target.forward(ids, torch.arange(len(prompt), device=target.device)[None], cache)
    return cache


@pytest.mark.usefixtures("one_thread")
def test_padded_forward_is_the_dynamic_forward_at_every_bucket(tiny: Any) -> None:
    """The same tree verified dynamically and padded to several buckets: the same logits
    and taps for the real nodes, and the same K/V kept after the same acceptance."""
    model, _ = tiny
    target = TargetModel(model)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 300, size=23).tolist()
    for size in (1, 5, 13):
        tree = random_tree(size, rng, 300)
        dyn = prefilled(target, prompt, 256)
        want_logits, want_taps = verify_tree(target, dyn, tree)
        for buckets in ((size,), (size + 3, 64)):
            cache = prefilled(target, prompt, 256)
            static = StaticVerifier(target, cache, size, graphs=False, buckets=buckets)
            logits, taps = static.forward(tree)
            torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(taps, want_taps, rtol=1e-10, atol=1e-10)
            assert cache.length == len(prompt) + size


@pytest.mark.usefixtures("one_thread")
def test_attention_reads_a_window_that_follows_the_length(tiny: Any) -> None:
    """Attention reads the cache up to the next window boundary past the tree, not the
    whole capacity: a generation that crosses a boundary takes a second window (its own
    buffers and graphs) and still decodes exactly as the target's greedy (float64), long
    accepted runs and the head's draft included."""
    assert attention_window(1, 4096) == WINDOW_ALIGN
    assert attention_window(WINDOW_ALIGN, 4096) == WINDOW_ALIGN
    assert attention_window(WINDOW_ALIGN + 1, 4096) == 2 * WINDOW_ALIGN
    assert attention_window(4000, 1024) == 1024
    model, head = tiny
    rng = np.random.default_rng(5)
    # A tree that crosses a boundary: every node's logits and taps as the dynamic path's.
    target = TargetModel(model)
    near = rng.integers(3, 300, size=WINDOW_ALIGN - 5).tolist()
    tree = random_tree(13, rng, 300)
    want_logits, want_taps = verify_tree(target, prefilled(target, near, 4 * WINDOW_ALIGN), tree)
    cache = prefilled(target, near, 4 * WINDOW_ALIGN)
    logits, taps = StaticVerifier(target, cache, 13, graphs=False).forward(tree)
    torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(taps, want_taps, rtol=1e-10, atol=1e-10)
    prompt = rng.integers(3, 300, size=WINDOW_ALIGN - 40).tolist()
    want = hf_greedy(model, prompt, max_new_tokens=48)
    oracle = OracleTree(want, seed=2, depth=6)
    dm = DartModel(model, head, tree_builder=oracle)
    got = run_oracle(dm, oracle, input_ids=prompt, max_new_tokens=48, static=True, max_length=4096)
    assert got.tokens == want
    assert max(got.accept_lengths) >= 4
    (cache,) = dm.target.__dict__["_static_caches"]
    assert cache.capacity > 2 * WINDOW_ALIGN  # room the windows did not read
    (verifier,) = cache.static_verifiers.values()
    # The prompt's prefill chunk (its own size: the trees' buckets are smaller), then the steps.
    chunk = PREFILL_BUCKETS[-1]
    prefills = {(size, window) for size, window, _ in verifier._state if size == chunk}
    assert prefills == {(chunk, WINDOW_ALIGN)}
    windows = {(w, hw) for size, w, hw in verifier._state if size != chunk}
    assert {w for w, _ in windows} == {WINDOW_ALIGN, 2 * WINDOW_ALIGN}
    assert all(WINDOW_ALIGN <= hw <= 2 * WINDOW_ALIGN for _, hw in windows)


@pytest.mark.usefixtures("one_thread")
def test_the_prompt_prefills_in_chunks_and_eagerly_where_a_bucket_has_no_room(tiny: Any) -> None:
    """The static path prefills the prompt in padded chain chunks: the last token's logits and
    every token's taps as one eager forward's (float64), across chunks; a chunk whose bucket
    would run past the trash slot (a prompt near the capacity) prefills eagerly instead. With
    a head, the chunks' programs (or the eager fallback) feed it the prompt, and the first
    draft gives the dynamic path's rows over the same head cache contents."""
    from dart_client.decoding.draft import draft_rows

    model, head = tiny
    rng = np.random.default_rng(9)
    target = TargetModel(model)
    chunk = PREFILL_BUCKETS[-1]
    head.bind_embedding(model.get_input_embeddings())
    # One full chunk (the first draft's mask slots then lie past the chunk's head window
    # unless the window counts the positions the chunk feeds), and two chunks.
    for length in (chunk - 1, chunk):
        prompt = rng.integers(3, 300, size=length).tolist()
        cache = target.new_cache(1024)
        static = StaticVerifier(target, cache, 8, graphs=False, head=head, top_k=5)
        static.prefill(prompt)
        device = target.device
        want_taps = target.forward(
            torch.tensor([prompt], device=device),
            torch.arange(length, device=device)[None],
            target.new_cache(1024),
            taps=True,
        )[1]
        after = torch.tensor([[*prompt[1:], 77]], device=device)
        want = draft_rows(head, head.new_cache(length + 8), want_taps, after, 5)
        got = static.first_draft(77)
        np.testing.assert_allclose(got.probs, want.probs, rtol=1e-6, atol=1e-7)
    prompt = rng.integers(3, 300, size=chunk + 30).tolist()
    ids = torch.tensor([prompt], device=target.device)
    want_logits, want_taps = target.forward(
        ids, torch.arange(len(prompt), device=target.device)[None], target.new_cache(512),
        taps=True,
    )  # fmt: skip
    eager = []
    forward = target.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        eager.append(args[0].shape[1])
        return forward(*args, **kwargs)

    first = 77
    dyn_cache = head.new_cache(len(prompt) + 8)
    after = torch.tensor([[*prompt[1:], first]], device=target.device)
    want_rows = draft_rows(head, dyn_cache, want_taps, after, 5)
    target.forward = counted  # type: ignore[method-assign]
    for capacity, eager_chunks in ((1024, []), (chunk + 64, [30])):
        for with_head in (False, True):
            eager.clear()
            cache = target.new_cache(capacity)
            kwargs = {"head": head, "top_k": 5} if with_head else {}
            static = StaticVerifier(target, cache, 8, graphs=False, **kwargs)
            last, taps = static.prefill(prompt)
            assert eager == eager_chunks and cache.length == len(prompt)
            torch.testing.assert_close(last, want_logits[0, -1], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(taps, want_taps, rtol=1e-10, atol=1e-10)
            if not with_head:
                continue
            kinds: list[str] = []

            def recorded(
                state: Any, kind: str, run: Any = static._execute, seen: Any = kinds
            ) -> Any:
                seen.append(kind)
                return run(state, kind)

            static._execute = recorded  # type: ignore[method-assign]
            rows = static.first_draft(first)
            # A graph reads the buffers it was captured with: the draft after a prefill chunk
            # is its own program, not the one after a sampling step's forward.
            assert kinds == ([] if eager_chunks else ["draft:prefill"])
            np.testing.assert_array_equal(rows.ids, want_rows.ids)
            np.testing.assert_allclose(rows.probs, want_rows.probs, rtol=1e-6, atol=1e-7)
            assert static.head_cache is not None
            assert static.head_cache.length == dyn_cache.length == len(prompt)
            for got, exp in zip(static.head_cache.buffers(), dyn_cache.buffers(), strict=True):
                n = len(prompt)
                torch.testing.assert_close(got[0][..., :n, :], exp[0][..., :n, :])
    target.forward = forward  # type: ignore[method-assign]


@pytest.mark.usefixtures("one_thread")
def test_device_acceptance_and_compaction_match_the_host(tiny: Any) -> None:
    """greedy_step (acceptance and compaction on the device) against accept_greedy and
    TargetCache.keep on the dynamic path; trees that hold the target's argmax path, with
    a duplicate sibling (the first one is the one accepted) and padding."""
    model, _ = tiny
    target = TargetModel(model)
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 300, size=17).tolist()
    truth = hf_greedy(model, prompt, max_new_tokens=8)
    root = truth[0]
    for depth in (0, 1, 3, 5):
        wrong = rng.integers(3, 300, size=5).tolist()
        paths = [truth[1 : 1 + depth] + wrong[:2], wrong, truth[1:2] + wrong[2:]]
        tree = Tree.from_paths(root, paths)
        if depth:  # a second child equal to the first accepted one, later in the tree
            tree = Tree.build([*tree.tokens, truth[1]], [*tree.parents, 0])
        dyn = prefilled(target, prompt, 256)
        logits, _ = verify_tree(target, dyn, tree)
        want = accept_greedy(tree, logits)
        dyn.keep(len(prompt), want.nodes, target.device)
        cache = prefilled(target, prompt, 256)
        static = StaticVerifier(target, cache, len(tree), graphs=False, buckets=(32,))
        step = static.greedy_step(tree)
        assert step.acceptance == want
        assert len(want.nodes) >= depth + 1  # the planted path is accepted
        assert step.acceptance.new_tokens == truth[1 : 1 + len(want.nodes)]
        assert cache.length == dyn.length == len(prompt) + len(want.nodes)
        n = cache.length
        for (got, axis), (exp, _) in zip(cache.buffers(), dyn.buffers(), strict=True):
            torch.testing.assert_close(got.narrow(axis + 2, 0, n), exp.narrow(axis + 2, 0, n))
        assert step.taps.shape[1] == len(want.nodes)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_greedy_is_the_dynamic_and_the_target_greedy(arch: str, tiny: Any) -> None:
    """float64: static DART == dynamic DART == AR (static and not) == transformers'
    greedy, token for token, with long accepted runs (oracle trees) and pruner-less
    budgets that change the bucket from step to step."""
    model = tiny[0] if arch == "llama" else make_tiny_target("qwen3", seed=1)
    head = DartHead.random_init(model.config, draft_length=3, seed=11).double().to(model.device)
    longest = 0
    for i, prompt in enumerate(random_prompts(4, seed=8)):
        want = hf_greedy(model, prompt, max_new_tokens=24)
        results = {}
        for static in (False, True):
            oracle = OracleTree(want, seed=i, depth=[5, 9][i % 2])
            dm = DartModel(model, head, tree_builder=oracle)
            budget = [None, 3, 9, 20][i]
            results[static] = run_oracle(
                dm, oracle, input_ids=prompt, max_new_tokens=24, tree_budget=budget, static=static
            )
        assert results[True].tokens == results[False].tokens == want, f"prompt {i}"
        assert results[True].accept_lengths == results[False].accept_lengths
        longest = max(longest, max(results[True].accept_lengths))
        ar = ar_generate(dm, input_ids=prompt, max_new_tokens=24, static=True)
        assert ar.tokens == want
    assert longest >= 4, "no long accepted run: compaction untested"


class RecordingOracle(OracleTree):
    """An oracle tree builder that keeps the draft rows it was given at every step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[Any] = []

    def build(self, context: np.ndarray, rows: Any, budget: int) -> Tree:
        self.rows.append(rows)
        return super().build(context, rows, budget)


@pytest.mark.usefixtures("one_thread")
def test_static_draft_rows_are_the_dynamic_drafts(tiny: Any) -> None:
    """The draft the static step makes in its replay (accepted rows right-aligned, padded,
    over the head's static cache) gives the dynamic draft's top-k ids and probabilities at
    every step, long accepted runs included."""
    model, head = tiny
    steps = 0
    for i, prompt in enumerate(random_prompts(3, seed=12)):
        want = hf_greedy(model, prompt, max_new_tokens=20)
        drafts = {}
        for static in (False, True):
            oracle = RecordingOracle(want, seed=i, depth=7)
            dm = DartModel(model, head, tree_builder=oracle)
            dm.draft_top_k = 5
            got = run_oracle(dm, oracle, input_ids=prompt, max_new_tokens=20, static=static)
            assert got.tokens == want
            drafts[static] = oracle.rows
        assert len(drafts[True]) == len(drafts[False]) > 1
        for a, b in zip(drafts[True], drafts[False], strict=True):
            assert a.ids.shape == b.ids.shape == (4, 5)
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_allclose(a.probs, b.probs, rtol=1e-5, atol=1e-6)
            steps += 1
    assert steps > 6


@pytest.mark.usefixtures("one_thread")
def test_the_head_window_holds_the_drafted_rows_and_mask_slots(tiny: Any) -> None:
    """Prompts whose first drafts put the mask slots just past a window boundary (the
    accepted rows before it): the static draft still gives the dynamic draft's rows."""
    model, head = tiny
    rng = np.random.default_rng(6)
    for length in range(WINDOW_ALIGN - 12, WINDOW_ALIGN - 7):
        prompt = rng.integers(3, 300, size=length).tolist()
        want = hf_greedy(model, prompt, max_new_tokens=6)
        drafts = {}
        for static in (False, True):
            oracle = RecordingOracle(want, seed=length, depth=3)
            dm = DartModel(model, head, tree_builder=oracle)
            got = run_oracle(
                dm, oracle, input_ids=prompt, max_new_tokens=6, static=static, tree_budget=7
            )
            assert got.tokens == want
            drafts[static] = oracle.rows
        for a, b in zip(drafts[True], drafts[False], strict=True):
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_allclose(a.probs, b.probs, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("one_thread")
def test_a_sampling_step_drafts_in_a_program_of_its_own(tiny: Any) -> None:
    """Sampling on the static path: the padded forward, acceptance on the host, then the
    head's next draft in a program of its own (a graph on cuda): the same draft rows and
    the same sampled tokens as the dynamic path, seed for seed (float64)."""
    from dart_client.decoding import static as static_module

    model, head = tiny
    calls: list[int] = []
    draft = static_module.StaticVerifier.draft

    def counted(self: Any, acceptance: Any) -> Any:
        calls.append(len(acceptance.nodes))
        return draft(self, acceptance)

    steps = 0
    for i, prompt in enumerate(random_prompts(3, seed=23)):
        want = hf_greedy(model, prompt, max_new_tokens=18)
        drafts, tokens = {}, {}
        for static in (False, True):
            oracle = RecordingOracle(want, seed=i, depth=6)
            dm = DartModel(model, head, tree_builder=oracle)
            dm.draft_top_k = 5
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(static_module.StaticVerifier, "draft", counted)
                got = run_oracle(
                    dm, oracle, input_ids=prompt, max_new_tokens=18, static=static,
                    temperature=0.1, seed=i,
                )  # fmt: skip
            drafts[static], tokens[static] = oracle.rows, got.tokens
        assert tokens[True] == tokens[False]
        assert len(drafts[True]) == len(drafts[False]) > 1
        for a, b in zip(drafts[True], drafts[False], strict=True):
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_allclose(a.probs, b.probs, rtol=1e-5, atol=1e-6)
            steps += 1
    assert steps > 6 and len(calls) >= steps - 3 and max(calls) >= 2


@pytest.mark.usefixtures("one_thread")
def test_static_path_with_a_prefix_cache_and_a_reused_cache(tiny: Any) -> None:
    """A conversation's second turn reuses its static cache (and verifier); generations
    without a prefix cache borrow the target's static cache one after another."""
    model, head = tiny
    prompt = random_prompts(1, seed=9)[0]
    want = hf_greedy(model, prompt, max_new_tokens=10)
    oracle = OracleTree(want, seed=0)
    dm = DartModel(model, head, tree_builder=oracle)
    pc = PrefixCache()
    first = run_oracle(
        dm, oracle, input_ids=prompt, max_new_tokens=10, static=True, prefix_cache=pc
    )
    assert first.tokens == want
    turn = [*prompt, *want, 7, 8]
    want2 = hf_greedy(model, turn, max_new_tokens=10)
    oracle2 = OracleTree(want2, seed=1)
    dm.tree_builder = oracle2
    second = run_oracle(
        dm, oracle2, input_ids=turn, max_new_tokens=10, static=True, prefix_cache=pc
    )
    assert pc.reused > 0 and second.tokens == want2
    for _ in range(2):
        oracle = OracleTree(want, seed=3)
        dm.tree_builder = oracle
        assert (
            run_oracle(dm, oracle, input_ids=prompt, max_new_tokens=10, static=True).tokens == want
        )
    held = dm.target.__dict__["_static_caches"]
    assert len(held) == 1 and not held[0].lent


def test_the_static_cache_pool_keeps_only_the_largest_free_caches(tiny: Any) -> None:
    """Concurrent generations each borrow their own cache; once they end, the target keeps
    the largest free ones (each serves any shorter context) and drops the rest."""
    target = TargetModel(tiny[0])
    lent = [lend_cache(target, capacity) for capacity in (16, 64, 32, 128)]
    assert len({id(c) for c in lent}) == 4 and all(c.lent for c in lent)
    for cache in lent:
        return_cache(target, cache)
    held = target.__dict__["_static_caches"]
    assert len(held) == KEEP_FREE_STATIC_CACHES == 2
    assert sorted(c.capacity for c in held) == sorted(c.capacity for c in lent)[-2:]
    # A shorter context reuses the smaller of the two; a lent cache is never handed out twice.
    first, second = lend_cache(target, 20), lend_cache(target, 20)
    assert first is held[0] or first is held[1]
    assert second is not first and second.capacity >= 20
    return_cache(target, first)
    return_cache(target, second)
    assert all(not c.lent for c in held) and len(held) == 2


@pytest.mark.usefixtures("one_thread")
def test_static_greedy_on_a_bf16_target_leaves_ar_only_at_near_ties() -> None:
    """bf16 (the dtype DART serves in): the padded forward attends over the whole
    capacity, so its rounding may differ from AR's; any divergence must sit on a near-tie
    of the target's logits (the margin check of the other bf16 tests)."""
    vocab = 64
    model = make_tiny_target("qwen3", vocab_size=vocab, dtype=torch.bfloat16, seed=13)
    head = DartHead.random_init(model.config, draft_length=3, seed=2).to(torch.bfloat16)
    dm = DartModel(model, head.to(model.device), tokenizer=make_tiny_tokenizer(vocab))
    accepted = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, vocab, (11,), generator=g).tolist()
        want = ar_generate(dm, input_ids=ids, max_new_tokens=30, static=False)
        planted = PlantedContinuation(want.tokens, depth=6)
        tokens, got = generate_tracked(
            dart_generate, dm, planted, input_ids=ids, max_new_tokens=30, static=True
        )
        assert_divergence_is_a_near_tie(model, ids, tokens, want.tokens, 4.0)
        accepted += max(got.accept_lengths)
    assert accepted >= 8


@cuda_only
def test_cuda_graphs_replay_the_eager_program(tiny: Any) -> None:
    """On cuda: the captured graphs (one per bucket and kind) give the eager program's
    outputs (acceptance, taps, the head's draft rows), replayed many times over growing
    caches, and decoding through them is the target's greedy decoding."""
    from dart_client.decoding.draft import draft_rows

    model, head = tiny
    target = TargetModel(model)
    head.bind_embedding(target.embedding())
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, 300, size=19).tolist()
    verifiers = []
    for graphs in (False, True):
        cache = target.new_cache(512)
        ids = torch.tensor([prompt], device=target.device)
        _, taps = target.forward(ids, torch.arange(len(prompt), device=target.device)[None], cache)
        v = verifier_for(target, cache, 20, graphs=graphs, head=head, top_k=4)
        assert v.head_cache is not None
        draft_rows(
            head, v.head_cache, taps, torch.tensor([[*prompt[1:], 5]], device=target.device), 4
        )
        verifiers.append(v)
    eager, graphed = verifiers
    for _ in range(12):
        tree = random_tree(int(rng.integers(1, 21)), rng, 300)
        want = eager.greedy_step(tree)
        got = graphed.greedy_step(tree)
        assert got.acceptance == want.acceptance
        torch.testing.assert_close(got.taps, want.taps)
        assert got.rows is not None and want.rows is not None
        np.testing.assert_array_equal(got.rows.ids, want.rows.ids)
        np.testing.assert_allclose(got.rows.probs, want.rows.probs, rtol=1e-6)
    eager_cache, graph_cache = eager.cache, graphed.cache
    assert {k for s in graphed._state.values() for k in s.graphs} == {"greedy"}
    for _ in range(3):
        tree = random_tree(9, rng, 300)
        torch.testing.assert_close(graphed.forward(tree)[0], eager.forward(tree)[0])
        eager_cache.truncate(eager_cache.length - 9)
        graph_cache.truncate(graph_cache.length - 9)
    for i, ids in enumerate(random_prompts(3, seed=6)):
        want = hf_greedy(model, ids, max_new_tokens=20)
        oracle = OracleTree(want, seed=i)
        dm = DartModel(model, head, tree_builder=oracle)
        assert run_oracle(dm, oracle, input_ids=ids, max_new_tokens=20, static=True).tokens == want


def test_a_target_split_over_devices_is_refused_clearly(tiny: Any) -> None:
    """static=True on a target whose layers sit on several devices: a clear error, not a
    device mismatch deep in a kernel (``"auto"`` never chooses it there)."""
    model, _ = tiny
    target = TargetModel(model)
    two = {torch.device("cuda", 0), torch.device("cuda", 1)}
    target.layer_devices = lambda: two  # type: ignore[method-assign]
    with pytest.raises(InvalidArgumentError, match="on one device"):
        StaticVerifier(target, target.new_cache(256), 8, graphs=False)


@cuda_only
def test_batched_cuda_graphs_decode_as_the_dynamic_batch(tiny: Any, tiny_ngram_path: Any) -> None:
    """On cuda: batched decoding through the static batch program's graphs (rows joining
    and leaving: one graph per rows bucket, tree bucket and window) gives the dynamic
    batch's tokens, greedy DART and AR alike (float64)."""
    from dart_client.ngram import NGram

    model, head = tiny
    dm = DartModel(model, head, ngram=NGram.open(str(tiny_ngram_path)))
    prompts = random_prompts(5, seed=17)
    for mode in ("dart", "ar"):
        outputs = {}
        for static in (False, True):
            batch = dm.batch_generator(mode=mode, max_batch=3, max_length=96, static=static)
            ids = [
                batch.add(GenerationConfig(max_new_tokens=24, tree_budget=12), input_ids=p)
                for p in prompts
            ]
            results = drain(batch)
            outputs[static] = [results[i].tokens for i in ids]
            if static:
                assert batch.verifier is not None and batch.verifier.graphs
                assert any(s.graphs for s in batch.verifier._state.values())
        assert outputs[True] == outputs[False], mode


@cuda_only
def test_sampling_through_cuda_graphs_decodes_as_the_dynamic_path(tiny: Any) -> None:
    """On cuda: sampling steps through the graphs (the padded forward, then the draft's own
    graph) give the dynamic path's tokens, seed for seed (float64)."""
    model, head = tiny
    for i, prompt in enumerate(random_prompts(3, seed=29)):
        want = hf_greedy(model, prompt, max_new_tokens=16)
        outputs = []
        for static in (False, True):
            oracle = OracleTree(want, seed=i, depth=6)
            dm = DartModel(model, head, tree_builder=oracle)
            got = run_oracle(
                dm, oracle, input_ids=prompt, max_new_tokens=16, static=static,
                temperature=0.1, seed=i,
            )  # fmt: skip
            outputs.append(got.tokens)
        assert outputs[0] == outputs[1]
