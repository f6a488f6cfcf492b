"""DART generation on tiny random Qwen3 / Llama targets in float64.

Greedy DART must equal ``ar_generate`` and transformers' own ``generate`` token for token;
sampling must be lossless. Trees come from the real pruner (with a random head acceptance
is rare) and from an *oracle* builder that plants the target's true continuation in the
tree, so long accepted runs (and with them the K/V compaction) are exercised.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    TINY_EOS,
    TINY_VOCAB,
    LikeliestSiblings,
    generate_tracked,
    make_tiny_target,
    make_tiny_tokenizer,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import dart_client.decoding.loop as generate_module
from dart_client import DartModel, ar_generate, dart_generate
from dart_client.decoding.accept import Acceptance, accept_sampling
from dart_client.decoding.draft import DraftRows
from dart_client.decoding.sampling import SamplingParams, target_probs
from dart_client.decoding.verify import Tree
from dart_client.errors import (
    ContextTooLongError,
    DartError,
    EmptyPromptError,
    IncompatibleHeadError,
    InvalidArgumentError,
    InvalidTypeError,
)
from dart_client.models.head import DartHead

ARCHS = ("llama", "qwen3")
WORD_TOKENIZER = make_tiny_tokenizer()


@pytest.fixture(scope="module")
def targets() -> dict[str, Any]:
    return {arch: make_tiny_target(arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def heads(targets: dict[str, Any]) -> dict[str, DartHead]:
    return {
        arch: DartHead.random_init(model.config, draft_length=3, seed=11).double().to(model.device)
        for arch, model in targets.items()
    }


def hf_greedy(model: Any, prompt: Sequence[int], **kwargs: Any) -> list[int]:
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


def random_prompts(n: int, seed: int, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(3, TINY_VOCAB, size=int(rng.integers(1, max_len))).tolist() for _ in range(n)
    ]


class OracleTree:
    """Plants the true continuation (cut at a random depth) among wrong branches.

    ``g`` (tokens generated so far) is advanced by the test from the streamed events, so the
    oracle knows where in the true continuation the root sits.
    """

    def __init__(self, truth: Sequence[int], seed: int, depth: int = 5) -> None:
        self.truth = list(truth)
        self.rng = np.random.default_rng(seed)
        self.depth = depth
        self.g = 0

    def build(self, context: np.ndarray, rows: DraftRows, budget: int) -> Tree:
        root = int(context[-1])
        true = self.truth[self.g : self.g + self.depth]
        k = int(self.rng.integers(0, len(true) + 1))
        wrong = self.rng.integers(3, TINY_VOCAB, size=self.depth).tolist()
        paths = [
            true[:k] + wrong[: self.depth - k],
            rows.ids[:, 0].tolist(),
            true[: max(0, k - 1)] + rows.ids[:, 1].tolist(),
        ]
        tree = Tree.from_paths(root, paths)
        n = min(len(tree), budget + 1)  # creation order keeps parents first: prefix-closed
        return Tree.build(tree.tokens[:n], tree.parents[:n])


def run_oracle(dm: DartModel, oracle: OracleTree, **kwargs: Any) -> Any:
    stream = dart_generate(dm, stream=True, **kwargs)
    for event in stream:
        oracle.g += len(event.tokens)
    return stream.result


def record_lookup_paths(dm: DartModel) -> list[list[int]]:
    """Wraps ``dm``'s tree builder; the returned list fills with each step's lookup path."""
    builder = dm.tree_builder
    assert builder is not None
    build = builder.build
    paths: list[list[int]] = []

    def recording(*args: Any, **kwargs: Any) -> Tree:
        path = kwargs.get("lookup_path")
        paths.append([] if path is None else [int(t) for t in path])
        return build(*args, **kwargs)

    builder.build = recording  # type: ignore[method-assign]
    return paths


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lookup", [True, False], ids=["lookup", "no-lookup"])
def test_greedy_matches_ar_and_transformers_with_pruner(
    arch: str,
    lookup: bool,
    targets: dict[str, Any],
    heads: dict[str, DartHead],
    tiny_ngram_path: Any,
) -> None:
    pytest.importorskip("dart_client.ngram.pruner")
    from dart_client.ngram import NGram

    model = targets[arch]
    dm = DartModel(
        model,
        heads[arch],
        ngram=NGram.open(str(tiny_ngram_path)),
        prompt_lookup=8 if lookup else None,
    )
    paths = record_lookup_paths(dm)
    cases = list(zip(random_prompts(12, seed=3), [None, 1, 3, 17, 60, 2] * 2, strict=True))
    total_steps = 0
    for i, (prompt, budget) in enumerate(cases):
        max_new = [1, 7, 30][i % 3]
        want = hf_greedy(model, prompt, max_new_tokens=max_new)
        got = dart_generate(dm, input_ids=prompt, max_new_tokens=max_new, tree_budget=budget)
        ar = ar_generate(dm, input_ids=prompt, max_new_tokens=max_new)
        assert got.tokens == want, f"case {i}: prompt {prompt}, budget {budget}"
        assert ar.tokens == want
        assert len(got.tokens) <= max_new
        assert sum(got.accept_lengths) >= len(got.tokens)
        total_steps += got.steps
        if budget is None and got.steps:
            assert max(got.tree_sizes[1:]) > 1, "the pruner built no tree"
    assert total_steps > 0
    # Tiny random targets repeat themselves now and then: prompt lookup proposes paths.
    proposed = [p for p in paths if p]
    if lookup:
        assert len(proposed) >= 5, (len(proposed), total_steps)
    else:
        assert not proposed


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_oracle_trees_accept_long_runs(
    arch: str, targets: dict[str, Any], heads: dict[str, DartHead]
) -> None:
    model = targets[arch]
    longest = 0
    for i, prompt in enumerate(random_prompts(6, seed=5)):
        max_new = 25
        want = hf_greedy(model, prompt, max_new_tokens=max_new)
        oracle = OracleTree(want, seed=i)
        dm = DartModel(model, heads[arch], tree_builder=oracle)
        got = run_oracle(
            dm, oracle, input_ids=prompt, max_new_tokens=max_new, tree_budget=[None, 4, 9][i % 3]
        )
        assert got.tokens == want, f"prompt {i}"
        longest = max(longest, max(got.accept_lengths))
        assert got.tau >= 1.0
    # Accepted runs longer than the bonus token must occur, or compaction is untested.
    assert longest >= 4


@pytest.mark.usefixtures("one_thread")
def test_eos_inside_an_accepted_run_stops_like_transformers(
    targets: dict[str, Any], heads: dict[str, DartHead]
) -> None:
    model = targets["llama"]
    prompt = random_prompts(1, seed=9)[0]
    free = hf_greedy(model, prompt, max_new_tokens=30, eos_token_id=None)
    eos = free[6]  # a token the greedy run really produces
    first = free.index(eos)
    want = hf_greedy(model, prompt, max_new_tokens=30, eos_token_id=[TINY_EOS, eos])
    assert want == free[: first + 1]
    oracle = OracleTree(free, seed=1, depth=8)
    dm = DartModel(model, heads["llama"], tree_builder=oracle)
    dm.target.eos_token_ids = frozenset({TINY_EOS, eos})
    got = run_oracle(dm, oracle, input_ids=prompt, max_new_tokens=30)
    assert got.tokens == want
    assert got.finish_reason == "eos"
    ar = ar_generate(dm, input_ids=prompt, max_new_tokens=30)
    assert ar.tokens == want and ar.finish_reason == "eos"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("extra", [1, 2, 3, 6])
def test_max_length_edges_never_overflow(
    extra: int, targets: dict[str, Any], heads: dict[str, DartHead]
) -> None:
    model = targets["qwen3"]
    prompt = random_prompts(1, seed=extra, max_len=20)[0]
    max_length = len(prompt) + extra
    want = hf_greedy(model, prompt, max_length=max_length)
    oracle = OracleTree(want + [5] * 10, seed=extra, depth=8)
    dm = DartModel(model, heads["qwen3"], tree_builder=oracle)
    # The caches are exactly max_length long: a tree that did not shrink would overflow.
    got = run_oracle(dm, oracle, input_ids=prompt, max_length=max_length, max_new_tokens=100)
    assert got.tokens == want
    assert len(prompt) + len(got.tokens) <= max_length
    assert all(size <= max_length - len(prompt) for size in got.tree_sizes)


@pytest.mark.usefixtures("one_thread")
def test_max_new_tokens_cuts_a_long_accepted_run(
    targets: dict[str, Any], heads: dict[str, DartHead]
) -> None:
    model = targets["llama"]
    prompt = random_prompts(1, seed=21)[0]
    want = hf_greedy(model, prompt, max_new_tokens=12)
    for max_new in (1, 2, 3, 5, 12):
        oracle = OracleTree(want, seed=max_new, depth=8)
        oracle.rng = np.random.default_rng(0)
        dm = DartModel(model, heads["llama"], tree_builder=oracle)
        got = run_oracle(dm, oracle, input_ids=prompt, max_new_tokens=max_new)
        assert got.tokens == want[:max_new]
        assert got.finish_reason == "length"


@pytest.mark.usefixtures("one_thread")
def test_stop_strings_and_streaming(targets: dict[str, Any], heads: dict[str, DartHead]) -> None:
    model = targets["llama"]
    tok = make_tiny_tokenizer()
    prompt = random_prompts(1, seed=4)[0]
    free = hf_greedy(model, prompt, max_new_tokens=30, eos_token_id=None)
    # A stop string spanning two tokens, cut in the middle of the first word.
    stop = tok.decode(free[8:10])[1:]
    expected_n = next(
        n for n in range(1, len(free) + 1) if stop in tok.decode(free[:n], skip_special_tokens=True)
    )
    oracle = OracleTree(free, seed=2, depth=6)
    dm = DartModel(model, heads["llama"], tokenizer=tok, tree_builder=oracle)
    dm.target.eos_token_ids = frozenset()
    stream = dart_generate(dm, input_ids=prompt, max_new_tokens=30, stop=[stop], stream=True)
    deltas = []
    for event in stream:
        oracle.g += len(event.tokens)
        deltas.append(event.text)
    result = stream.result
    assert result is not None
    assert result.tokens == free[:expected_n]
    assert result.finish_reason == "stop"
    full = tok.decode(free[:expected_n], skip_special_tokens=True)
    assert result.text == full[: full.index(stop)]
    assert stop not in result.text
    assert "".join(deltas) == result.text
    ar = ar_generate(dm, input_ids=prompt, max_new_tokens=30, stop=stop)
    assert ar.tokens == result.tokens and ar.text == result.text
    # A stream read for its tokens and statistics only (``stream_text=False``): the same
    # tokens, events without text, the result's text decoded once at the end.
    oracle.g = 0
    quiet = dm.generate(input_ids=prompt, max_new_tokens=30, stream=True, stream_text=False)
    texts = []
    for event in quiet:
        oracle.g += len(event.tokens)
        texts.append(event.text)
    assert quiet.result is not None and quiet.result.tokens == free
    assert set(texts) == {""}
    assert quiet.result.text == tok.decode(free, skip_special_tokens=True)


@pytest.mark.usefixtures("one_thread")
def test_sdpa_and_text_prompt_paths(heads: dict[str, DartHead]) -> None:
    model = make_tiny_target("llama", seed=0, attn="sdpa")
    tok = make_tiny_tokenizer()
    text = "w5 w17 w200 w33"
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    want = hf_greedy(model, prompt, max_new_tokens=15)
    oracle = OracleTree(want, seed=3)
    dm = DartModel(model, heads["llama"], tokenizer=tok, tree_builder=oracle)
    # The dynamic path (the static one, cuda's default, drafts inside its replay).
    got = run_oracle(dm, oracle, prompt=text, max_new_tokens=15, static=False)
    assert got.tokens == want
    assert got.prompt_tokens == len(prompt)
    assert got.text == tok.decode(want, skip_special_tokens=True)
    assert set(got.timings) == set(generate_module.STAGES)
    assert all(v >= 0 for v in got.timings.values())
    assert got.timings["verify"] > 0 and got.timings["draft"] > 0
    assert got.tau == pytest.approx(sum(got.accept_lengths[1:]) / got.steps)


# ---- stage timings and incremental text ---------------------------------------------------


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["dart", "ar"])
def test_stage_timings_book_every_step_once(
    mode: str, targets: dict[str, Any], heads: dict[str, DartHead]
) -> None:
    """Each step's stages sum to the totals; verify is only the time inside the model's
    forward call (measured around it here as well), everything else is booked elsewhere."""
    model = targets["llama"]
    want = hf_greedy(model, [5, 9, 11], max_new_tokens=20, eos_token_id=None)
    oracle = OracleTree(want, seed=5)
    dm = DartModel(model, heads["llama"], tokenizer=make_tiny_tokenizer(), tree_builder=oracle)
    dm.target.eos_token_ids = frozenset()
    inner: list[float] = []
    forward = model.forward

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            inner.append(time.perf_counter() - start)

    model.forward = timed
    try:
        fn = dart_generate if mode == "dart" else ar_generate
        # The dynamic path: a static step replays a graph instead of calling forward.
        stream = fn(dm, input_ids=[5, 9, 11], max_new_tokens=20, stream=True, static=False)
        events = []
        for event in stream:
            oracle.g += len(event.tokens)
            events.append(event)
    finally:
        del model.forward
    result = stream.result
    assert result is not None and result.tokens == want
    steps = [e.timings for e in events[1:]]
    assert len(steps) == result.steps == len(inner) - 1
    every = set(generate_module.STAGES) - {"prefill"}
    for i, step in enumerate(steps):
        expected = every if mode == "dart" and i > 0 else every - {"draft"}
        assert set(step) == expected, f"step {i}"
        assert all(v >= 0 for v in step.values())
    assert set(events[0].timings) == {"prefill", "emit"}
    for stage in every:
        booked = sum(e.timings.get(stage, 0.0) for e in events)
        assert result.timings[stage] == pytest.approx(booked, rel=1e-9, abs=1e-12), stage
    # The wrapper runs inside the timed calls: verify and prefill enclose them.
    assert result.timings["verify"] >= sum(inner[1:])
    assert result.timings["prefill"] >= events[0].timings["prefill"] >= inner[0]
    assert sum(result.timings.values()) <= result.elapsed


@given(
    ids=st.lists(st.integers(3, TINY_VOCAB - 1), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40),
)
@settings(max_examples=60, deadline=None)
def test_incremental_text_of_word_tokens(ids: list[int], cuts: list[int]) -> None:
    tok = WORD_TOKENIZER
    check_incremental(tok, ids, cuts)


@given(
    ids=st.lists(
        st.one_of(st.integers(3, TINY_VOCAB - 1), st.sampled_from([1, TINY_EOS])),
        min_size=1,
        max_size=40,
    ),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40),
)
@settings(max_examples=60, deadline=None)
def test_incremental_text_across_steps_of_special_tokens_only(
    ids: list[int], cuts: list[int]
) -> None:
    """Steps whose tokens are all special decode to nothing: the words on both sides of them
    still join as in the full decoding."""
    check_incremental(WORD_TOKENIZER, ids, cuts)


def test_incremental_text_special_step_between_words() -> None:
    inc = generate_module.IncrementalText(WORD_TOKENIZER)
    assert inc.update([5]) == "w5"
    assert inc.update([5, TINY_EOS]) == "w5"
    assert (
        inc.update([5, TINY_EOS, 7])
        == "w5 w7"
        == WORD_TOKENIZER.decode([5, TINY_EOS, 7], skip_special_tokens=True)
    )


def check_incremental(tok: Any, ids: list[int], cuts: list[int]) -> None:
    """Feeding ``ids`` in batches of ``cuts`` sizes decodes to the full decoding, and the
    text never loses what it had (streamed deltas are final)."""
    inc = generate_module.IncrementalText(tok)
    done: list[int] = []
    previous = ""
    i = 0
    for size in cuts * (len(ids) // max(1, sum(cuts)) + 1):
        if i >= len(ids):
            break
        done += ids[i : i + size]
        i += size
        text = inc.update(done)
        assert text.startswith(previous)
        previous = text
        full = tok.decode(done, skip_special_tokens=True)
        assert full.startswith(text)
        if not full.endswith("\ufffd"):
            assert text == full


@pytest.fixture(scope="module")
def smol_tok(smollm2_tokenizer_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@pytest.mark.parametrize(
    "text",
    [
        "Plain ASCII with  double spaces, tabs\tand\nnew lines.",
        "naïve café, 漢字とかな, emoji 🙂🚀👩‍💻 and combining e\u0301 marks",
        "<|im_start|>assistant\nSpecial tokens are skipped<|im_end|> in between.",
    ],
)
def test_incremental_text_of_byte_level_bpe(smol_tok: Any, text: str) -> None:
    """The real SmolLM2 tokenizer: multi-byte characters split over tokens, specials."""
    ids = smol_tok(text, add_special_tokens=False)["input_ids"]
    for cuts in ([1], [2, 1, 3], [5], [len(ids)]):
        check_incremental(smol_tok, ids, cuts)


def test_greedy_token_breaks_ties_at_the_first_index() -> None:
    from dart_client.decoding.accept import greedy_token

    row = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.0]).to(torch.bfloat16)
    assert greedy_token(row) == 1 == int(row.float().argmax())
    big = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    big[[100, 3000]] = 10.0
    assert greedy_token(big) == 100
    assert greedy_token(big.double()) == 100
    # The same rule as torch's argmax for every dtype, strided rows, NaN (the first wins).
    grid = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    grid[5, 7] = grid[9, 7] = float("nan")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for row in (grid[3].to(dtype), grid[:, 7].to(dtype), grid[:, 2].to(dtype)[::2]):
            assert greedy_token(row) == int(row.float().argmax())
    assert greedy_token(grid[:, 7]) == 5


# ---- sampling losslessness -------------------------------------------------------------


class FullTree:
    """Every combination of the top-``width`` draft tokens of the first ``depth`` rows, cut
    to the budget in breadth-first order. Records each node's draft probability ``q``."""

    def __init__(self, width: int = 2, depth: int = 2) -> None:
        self.width = width
        self.depth = depth
        self.q: list[float] = []

    def build(self, context: np.ndarray, rows: DraftRows, budget: int) -> Tree:
        tokens, parents, q = [int(context[-1])], [-1], [1.0]
        frontier = [0]
        for level in range(min(self.depth, rows.levels)):
            nxt = []
            for parent in frontier:
                for j in range(self.width):
                    tokens.append(int(rows.ids[level, j]))
                    parents.append(parent)
                    q.append(float(rows.probs[level, j]))
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        n = min(len(tokens), budget + 1)
        self.q = q[:n]
        return Tree.build(tokens[:n], parents[:n])


SMALL_VOCAB = 12
PARAMS = SamplingParams(temperature=0.9, top_k=8, top_p=0.97)
PROMPT = [5, 7, 3, 9]


def exact_joint(
    model: Any, prompt: list[int], n: int, params: SamplingParams, masked: Sequence[int] = ()
) -> dict[tuple, float]:
    """The target's exact distribution of its first ``n`` sampled tokens (enumerated);
    ``masked`` tokens get probability 0 at each (their logits -inf before the warpers)."""
    dist: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        prefixes = list(dist)
        batch = torch.tensor([prompt + list(p) for p in prefixes], device=model.device)
        with torch.no_grad():
            logits = model(batch).logits[:, -1]
        logits[:, list(masked)] = float("-inf")
        probs = target_probs(logits, params)
        nxt: dict[tuple, float] = {}
        for row, prefix in enumerate(prefixes):
            for tok in range(probs.shape[1]):
                p = float(probs[row, tok]) * dist[prefix]
                if p > 0:
                    nxt[(*prefix, tok)] = p
        dist = nxt
    return dist


def chi_square_pvalue(counts: Counter, probs: dict[tuple, float], n: int) -> float:
    """Pearson chi-square, cells with expectation < 5 pooled; p-value by Wilson-Hilferty."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in probs.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    outside = sum(c for k, c in counts.items() if k not in probs)
    assert outside == 0, "sampled a sequence the target gives probability 0"
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    k = max(1, cells - 1)
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def total_variation(counts: Counter, probs: dict[tuple, float], n: int) -> float:
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


N_SAMPLES = 1200


class SiblingCounts:
    """Wraps the acceptance ``generate`` calls and counts, over every sampled step, how
    often a sibling after the first was tried and accepted (read off the accepted path:
    reaching child j of a node means its j earlier siblings were rejected; at the path's
    last node every child was tried and rejected)."""

    def __init__(self, accept: Any) -> None:
        self.accept = accept
        self.later_tried = 0
        self.later_accepted = 0
        self.drafts_accepted = 0
        self.depth_two_accepted = 0

    def __call__(self, tree: Tree, logits: torch.Tensor, params: Any, gen: Any) -> Acceptance:
        acc = self.accept(tree, logits, params, gen)
        for parent, child in zip(acc.nodes, acc.nodes[1:], strict=False):
            j = tree.children[parent].index(child)
            self.later_tried += j
            self.later_accepted += j > 0
        self.later_tried += max(0, len(tree.children[acc.nodes[-1]]) - 1)
        self.drafts_accepted += len(acc.tokens)
        self.depth_two_accepted += len(acc.tokens) >= 2
        return acc


#: Sampling warpers for the sibling tests: a support of 6 of the 12 tokens keeps the joint
#: of three tokens at <= 216 cells, so the chi-square test has power at a few thousand runs.
SIBLING_PARAMS = SamplingParams(temperature=0.8, top_k=6, top_p=0.98)
SIBLING_SAMPLES = 1200
COMPARED = 3  # tokens compared: the first comes from prefill, the next from the trees


@pytest.fixture(scope="module")
def sampling_setup() -> tuple[DartModel, LikeliestSiblings, dict[tuple, float]]:
    model = make_tiny_target("llama", vocab_size=SMALL_VOCAB, layers=4, seed=5, init_range=0.3)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    head = DartHead.random_init(model.config, draft_length=2, seed=3, std=0.5).double()
    builder = LikeliestSiblings(model, SIBLING_PARAMS, width=3, depth=2)
    dm = DartModel(model, head.to(model.device), tree_builder=builder)
    assert not dm.target.eos_token_ids
    return dm, builder, exact_joint(model, PROMPT, COMPARED, SIBLING_PARAMS)


def sample_siblings(
    dm: DartModel,
    builder: LikeliestSiblings,
    n: int,
    monkeypatch: pytest.MonkeyPatch,
    static: bool | str = "auto",
    **options: Any,
) -> tuple[Counter, SiblingCounts]:
    """``n`` seeded DART runs, each stopped once ``COMPARED`` tokens are out: with room for
    64 tokens the length limit never cuts a tree (all 12 nodes are verified every step)."""
    spy = SiblingCounts(generate_module.accept_sampling)
    monkeypatch.setattr(generate_module, "accept_sampling", spy)
    counts: Counter = Counter()
    p = SIBLING_PARAMS
    for seed in range(n):
        tokens, _ = generate_tracked(
            dart_generate, dm, builder, until=COMPARED, input_ids=PROMPT, max_new_tokens=64,
            seed=seed, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, static=static,
            **options,
        )  # fmt: skip
        counts[tuple(tokens[:COMPARED])] += 1
    return counts, spy


def check_sibling_power(spy: SiblingCounts, n: int) -> None:
    """What makes the test able to fail: later siblings tried and accepted at both levels."""
    print(
        f"later siblings tried {spy.later_tried}, accepted {spy.later_accepted}; "
        f"drafts accepted {spy.drafts_accepted}, depth-2 paths {spy.depth_two_accepted}"
    )
    assert spy.later_tried >= n, "later siblings were hardly tried: the test would be vacuous"
    assert spy.later_accepted >= n // 5, "later siblings were hardly accepted"
    assert spy.depth_two_accepted >= n // 5, "the second level was hardly reached"


@pytest.mark.usefixtures("one_thread")
def test_sampling_is_lossless(sampling_setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    dm, builder, exact = sampling_setup
    counts, spy = sample_siblings(dm, builder, SIBLING_SAMPLES, monkeypatch)
    pvalue = chi_square_pvalue(counts, exact, SIBLING_SAMPLES)
    tv = total_variation(counts, exact, SIBLING_SAMPLES)
    print(f"lossless: p={pvalue:.3g} TV={tv:.3f}")
    check_sibling_power(spy, SIBLING_SAMPLES)
    assert pvalue > 1e-3, f"DART samples differ from the target (p={pvalue:.2e}, TV={tv:.3f})"
    # ar_generate with the same warpers samples the same distribution.
    p = SIBLING_PARAMS
    ar_counts: Counter = Counter()
    for s in range(400):
        r = ar_generate(
            dm, input_ids=PROMPT, max_new_tokens=COMPARED, seed=s,
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        )  # fmt: skip
        ar_counts[tuple(r.tokens)] += 1
    assert chi_square_pvalue(ar_counts, exact, 400) > 1e-3


@pytest.mark.usefixtures("one_thread")
def test_sampling_with_min_tokens_is_the_target_with_its_end_token_masked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``min_tokens`` (vLLM's): until then EOS has probability 0. DART's first three sampled
    tokens follow the target's distribution with EOS masked at each (enumerated exactly); EOS
    is the target's likeliest first token here, so a sampler that ignored the mask (in the
    prefill's pick or in the trees' acceptance) would be caught."""
    model = make_tiny_target("llama", vocab_size=SMALL_VOCAB, layers=4, seed=5, init_range=0.3)
    with torch.no_grad():
        eos = int(model(torch.tensor([PROMPT], device=model.device)).logits[0, -1].argmax())
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    head = DartHead.random_init(model.config, draft_length=2, seed=3, std=0.5).double()
    builder = LikeliestSiblings(model, SIBLING_PARAMS, width=3, depth=2)
    dm = DartModel(model, head.to(model.device), tree_builder=builder)
    assert dm.target.eos_token_ids == frozenset({eos})
    exact = exact_joint(model, PROMPT, COMPARED, SIBLING_PARAMS, masked=[eos])
    counts, _ = sample_siblings(dm, builder, SIBLING_SAMPLES, monkeypatch, min_tokens=COMPARED)
    assert all(eos not in seq for seq in counts)
    pvalue = chi_square_pvalue(counts, exact, SIBLING_SAMPLES)
    assert pvalue > 1e-3, f"DART samples differ from the masked target (p={pvalue:.2e})"


@pytest.mark.usefixtures("one_thread")
def test_sampling_is_lossless_on_the_static_path(
    sampling_setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The static path's padded forward (decoding.static) feeds the same recursive
    rejection: the samples still follow the target's distribution."""
    dm, builder, exact = sampling_setup
    counts, spy = sample_siblings(dm, builder, SIBLING_SAMPLES, monkeypatch, static=True)
    pvalue = chi_square_pvalue(counts, exact, SIBLING_SAMPLES)
    check_sibling_power(spy, SIBLING_SAMPLES)
    assert pvalue > 1e-3, f"static-path samples differ from the target (p={pvalue:.2e})"


def uniform(gen: torch.Generator) -> float:
    return float(torch.rand((), generator=gen, dtype=torch.float64, device=gen.device))


def wrong_sampler(bug: str) -> Any:
    """Recursive rejection over siblings with one deliberate bug (see WRONG_SAMPLERS)."""

    def accept(tree: Tree, logits: torch.Tensor, params: SamplingParams, gen: Any) -> Acceptance:
        node, nodes, tokens = 0, [0], []
        while True:
            p = target_probs(logits[node], params).double()
            original = p.clone()
            chosen = None
            for child in tree.children[node]:
                x = tree.tokens[child]
                if float(p[x]) <= 0.0:
                    continue
                u = uniform(gen)
                if bug == "over_acceptance":
                    ok = u * float(p.sum()) < 1.5 * float(p[x])
                elif bug == "p_of_x_for_later_siblings":
                    ok = u < float(original[x])  # not p(x) / the mass left after rejections
                else:
                    ok = u * float(p.sum()) < float(p[x])
                if ok:
                    chosen = child
                    break
                p[x] = 0.0
            if chosen is None:
                if bug == "no_residual":  # the bonus from p, rejected tokens included
                    bonus = int(torch.multinomial(original, 1, generator=gen))
                elif bug == "unnormalised_residual":
                    # Inverse CDF of the residual without dividing by its mass: a u past the
                    # mass left falls on the last token still possible.
                    cdf = p.cumsum(0)
                    u = torch.tensor(uniform(gen), dtype=cdf.dtype, device=cdf.device)
                    bonus = int(torch.searchsorted(cdf, u))
                    bonus = min(bonus, int(p.nonzero().max()))
                else:
                    # Under-accepting siblings can reject the whole support: then from p.
                    left = p if float(p.sum()) > 0 else original
                    bonus = int(torch.multinomial(left, 1, generator=gen))
                return Acceptance(nodes=nodes, tokens=tokens, bonus=bonus)
            node = chosen
            nodes.append(node)
            tokens.append(tree.tokens[node])

    return accept


WRONG_SAMPLERS = [
    "no_residual",
    "unnormalised_residual",
    "over_acceptance",
    "p_of_x_for_later_siblings",
]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("bug", WRONG_SAMPLERS)
def test_a_wrong_sampler_is_caught(
    bug: str, sampling_setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statistical test of ``test_sampling_is_lossless``, same runs, same threshold
    side: each deliberately wrong acceptance rule must be rejected."""
    dm, builder, exact = sampling_setup
    monkeypatch.setattr(generate_module, "accept_sampling", wrong_sampler(bug))
    counts, spy = sample_siblings(dm, builder, SIBLING_SAMPLES, monkeypatch)
    pvalue = chi_square_pvalue(counts, exact, SIBLING_SAMPLES)
    tv = total_variation(counts, exact, SIBLING_SAMPLES)
    print(f"{bug}: p={pvalue:.3g} TV={tv:.3f}; later siblings tried {spy.later_tried}")
    assert pvalue < 1e-6, f"the {bug} variant went unnoticed (p={pvalue:.2e}, TV={tv:.3f})"


LOOKUP_PROMPT = [5, 7, 3, 9, 5, 7, 3, 9, 5, 7, 4]


@pytest.mark.usefixtures("one_thread")
def test_sampling_with_the_pruner_and_prompt_lookup_is_lossless(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The real pruner over a real 3-gram, prompt-lookup paths merged into every tree: the
    first tokens are distributed exactly as the target's own."""
    import json

    from dart_client.ngram import NGram
    from dart_client.ngram.build import build

    model = make_tiny_target("llama", vocab_size=SMALL_VOCAB, seed=5, init_range=0.3)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    head = DartHead.random_init(model.config, draft_length=2, seed=3, std=0.5).double()
    root = tmp_path_factory.mktemp("small-vocab-ngram")
    rng = np.random.default_rng(1)
    with (root / "docs.jsonl").open("w") as f:
        for _ in range(200):
            ids = rng.integers(0, SMALL_VOCAB, size=int(rng.integers(3, 30))).tolist()
            f.write(json.dumps({"ids": ids}) + "\n")
    build([root / "docs.jsonl"], root / "m.ngram", order=3, vocab_size=SMALL_VOCAB, no_eos=True)
    dm = DartModel(
        model, head.to(model.device), ngram=NGram.open(root / "m.ngram"), prompt_lookup=3
    )
    paths = record_lookup_paths(dm)
    exact = exact_joint(model, LOOKUP_PROMPT, 3, PARAMS)
    counts: Counter = Counter()
    accepted = 0
    for seed in range(N_SAMPLES):
        r = dart_generate(
            dm,
            input_ids=LOOKUP_PROMPT,
            max_new_tokens=6,  # room for lookup paths; the first 3 tokens are compared
            tree_budget=5,
            seed=seed,
            temperature=PARAMS.temperature,
            top_k=PARAMS.top_k,
            top_p=PARAMS.top_p,
        )
        counts[tuple(r.tokens[:3])] += 1
        accepted += sum(a - 1 for a in r.accept_lengths[1:])
    assert sum(1 for p in paths if p) > N_SAMPLES, "prompt lookup proposed too little to test"
    assert accepted > N_SAMPLES // 2, "drafts were hardly ever accepted: the test is vacuous"
    pvalue = chi_square_pvalue(counts, exact, N_SAMPLES)
    tv = total_variation(counts, exact, N_SAMPLES)
    print(f"pruner + lookup: p={pvalue:.3g} TV={tv:.3f} accepted drafts={accepted}")
    assert pvalue > 1e-3, f"DART samples differ from the target (p={pvalue:.2e}, TV={tv:.3f})"


def test_accept_sampling_first_token_is_exact() -> None:
    """Unit level: the first produced token is distributed exactly as p at the root."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]] * 5, dtype=torch.float64)
    params = SamplingParams(temperature=1.0)
    tree = Tree.build([0, 1, 5, 3, 2], [-1, 0, 0, 0, 1])
    p = target_probs(logits[0], params)
    n = 20000
    counts: Counter = Counter()
    for _ in range(n):
        acc = accept_sampling(tree, logits, params, gen)
        counts[(acc.new_tokens[0],)] += 1
    exact = {(i,): float(p[i]) for i in range(6)}
    assert chi_square_pvalue(counts, exact, n) > 1e-3


# ---- bad inputs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_dm(targets: dict[str, Any], heads: dict[str, DartHead]) -> DartModel:
    return DartModel(
        targets["llama"],
        heads["llama"],
        tokenizer=make_tiny_tokenizer(),
        tree_builder=FullTree(),
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"input_ids": []}, EmptyPromptError, "empty"),
        ({"prompt": ""}, EmptyPromptError, "empty"),
        ({"input_ids": [5] * 50, "max_length": 50}, ContextTooLongError, "50 tokens"),
        (
            {"input_ids": [5] * 600, "max_length": 4096},
            ContextTooLongError,
            "max_position_embeddings",
        ),
        ({"prompt": 123}, InvalidTypeError, "prompt must be a str"),
        ({"input_ids": [1.5, 2.0]}, InvalidTypeError, "ints"),
        ({"input_ids": torch.tensor([[1.0, 2.0]])}, InvalidTypeError, "integers"),
        ({"input_ids": torch.ones((2, 3), dtype=torch.long)}, InvalidArgumentError, "batch"),
        ({"input_ids": [5, TINY_VOCAB]}, InvalidArgumentError, "outside the target vocabulary"),
        ({"input_ids": "w5"}, InvalidTypeError, "input_ids"),
        ({"input_ids": [5], "prompt": "w5"}, InvalidArgumentError, "exactly one"),
        ({}, InvalidArgumentError, "exactly one"),
        ({"input_ids": [5], "temperature": -1.0}, InvalidArgumentError, "temperature"),
        ({"input_ids": [5], "temperature": "hot"}, InvalidTypeError, "temperature"),
        ({"input_ids": [5], "top_p": 0.0}, InvalidArgumentError, "top_p"),
        ({"input_ids": [5], "top_k": -2}, InvalidArgumentError, "top_k"),
        ({"input_ids": [5], "max_new_tokens": 0}, InvalidArgumentError, "max_new_tokens"),
        ({"input_ids": [5], "max_new_tokens": 2.5}, InvalidTypeError, "max_new_tokens"),
        ({"input_ids": [5], "tree_budget": -1}, InvalidArgumentError, "tree_budget"),
        ({"input_ids": [5], "stop": [""]}, InvalidArgumentError, "stop"),
        ({"input_ids": [5], "stop": 7}, InvalidTypeError, "stop"),
        ({"input_ids": [5], "seed": "x"}, InvalidTypeError, "seed"),
        ({"messages": "hello"}, DartError, "template"),
    ],
)
def test_bad_inputs_are_clear_errors(
    plain_dm: DartModel, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    for fn in (dart_generate, ar_generate):
        with pytest.raises(error, match=fragment):
            fn(plain_dm, **kwargs)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"hidden_size": 96, "head_dim": 16}, "hidden_size: head 64, target 96"),
        ({"head_dim": 32}, "head_dim: head 16, target 32"),
        ({"vocab_size": 500}, f"vocab_size: head {TINY_VOCAB}, target 500"),
    ],
)
def test_mismatched_head_and_target(
    heads: dict[str, DartHead], change: dict[str, int], fragment: str
) -> None:
    base = make_tiny_target("llama", layers=4)
    config = base.config.__class__(**{**base.config.to_dict(), **change})
    with pytest.raises(IncompatibleHeadError, match=fragment):
        DartModel(type(base)(config), heads["llama"])


def test_target_needs_four_layers() -> None:
    from dart_client.errors import UnsupportedTargetError

    with pytest.raises(UnsupportedTargetError, match="at least 4"):
        DartModel(make_tiny_target("llama", layers=3))


def test_dart_generate_without_head_is_an_error(targets: dict[str, Any]) -> None:
    dm = DartModel(targets["llama"])
    with pytest.raises(InvalidArgumentError, match="ar_generate"):
        dart_generate(dm, input_ids=[5, 6])
    assert len(ar_generate(dm, input_ids=[5, 6], max_new_tokens=3).tokens) == 3


# ---- command line -------------------------------------------------------------------------


def test_cli_generate_json(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dart_client.apps.cli import main

    model = make_tiny_target("llama", seed=0)
    tok = make_tiny_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    argv = ["generate", "--base", str(tmp_path / "tiny"), "--dtype", "fp32", "--ar", "--raw",
            "--max-new-tokens", "6", "--json", "w5 w17 w200"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    reloaded = type(model).from_pretrained(tmp_path / "tiny", dtype=torch.float32).eval()
    reloaded.config._attn_implementation = "eager"
    want = hf_greedy(reloaded, tok("w5 w17 w200")["input_ids"], max_new_tokens=6)
    assert out["tokens"] == want
    assert out["text"] == tok.decode(want, skip_special_tokens=True)
    assert out["finish_reason"] in ("length", "eos")

    assert main(["no-such-command"]) == 2
    assert main([]) == 2
    # A missing head is a usage error (exit 2), found before the model loads.
    no_ar = [a for a in argv[:-2] if a != "--ar"]
    missing = ["--head", str(tmp_path / "missing"), "--ngram", str(tmp_path / "missing.ngram")]
    assert main([*no_ar, *missing, "w5"]) == 2
    err = capsys.readouterr().err
    assert "--head" in err and "no such head" in err and "Traceback" not in err
