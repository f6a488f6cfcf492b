"""The Rust pruner against a slow, obviously correct pruner written here in plain Python (f64),
on thousands of random cases over real models written by the real builder, plus every
guarantee, the input/output forms, the errors, and trees on draft-like distributions over a
model built from real ShareGPT text."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dart_client import _native
from dart_client.ngram import NGram, TokenOutOfVocabError
from dart_client.ngram.build import build
from dart_client.ngram.pruner import DraftTree, Pruner, PrunerConfig, PrunerError

# ---- the reference ----------------------------------------------------------------------


@dataclass
class Counts:
    """Plain n-gram counts of a corpus: every k-gram (k <= order) inside one document."""

    order: int
    vocab: int
    eos: int | None
    grams: Counter[tuple[int, ...]]

    @classmethod
    def of(cls, docs: list[list[int]], order: int, vocab: int, eos: int | None) -> Counts:
        grams: Counter[tuple[int, ...]] = Counter()
        for doc in docs:
            d = [*doc, eos] if eos is not None else list(doc)
            for n in range(1, order + 1):
                for i in range(len(d) - n + 1):
                    grams[tuple(d[i : i + n])] += 1
        return cls(order, vocab, eos, grams)

    def prob(self, history: list[int], t: int) -> float:
        """Longest-context backoff, no smoothing; f64 ratio rounded to f32 like the model."""
        h = history[max(0, len(history) - (self.order - 1)) :] if self.order > 1 else []
        for s in range(len(h)):
            ctx = tuple(h[s:])
            n = self.grams.get((*ctx, t), 0)
            if n:
                return float(np.float32(n / self.grams[ctx]))
        return 0.0


def reference_prune(
    prob: Any,
    eos: int | None,
    cfg: PrunerConfig,
    context: list[int],
    ids: np.ndarray,
    probs: np.ndarray,
    budget: int | None,
    lookup_path: list[int] | tuple[int, ...] = (),
) -> list[tuple[tuple[int, ...], float]]:
    """The algorithm the plain way: every path a tuple, full sorts. Returns the kept nodes in
    output order (depth, then score descending, then path) as (path, score), root excluded.
    With a lookup path: the most best nodes that fit beside the path's missing nodes, plus
    those (score -inf)."""
    levels, k = ids.shape
    beam: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    pool: list[tuple[tuple[int, ...], float]] = []
    for level in range(levels):
        w_level = float(level + 1) ** -cfg.level_exponent
        w_logit = cfg.logit_decay ** float(level)
        use_ngram = cfg.ngram_weight != 0 and (level > 0 or cfg.ngram_at_level0)
        ext = []
        for path, score in beam:
            for j in range(k):
                t = int(ids[level, j])
                inner = w_logit * math.log(float(probs[level, j]) + cfg.eps)
                if use_ngram:
                    q = prob([*context, *path], t)
                    inner = inner + cfg.ngram_weight * math.log(q + cfg.eps)
                # The only positive increment is ln(1 + eps) at p == 1: clamped to 0.
                delta = min(w_level * inner, 0.0)
                ext.append(((*path, t), score + delta))
        pool += ext
        ext.sort(key=lambda e: (eos is not None and e[0][-1] == eos, -e[1], e[0]))
        beam = ext[: cfg.beam_width]
    pool.sort(key=lambda e: (-e[1], len(e[0]), e[0]))
    limit = budget if budget is not None else cfg.max_nodes
    kept = pool[:limit]
    path = tuple(lookup_path[:limit])
    if path:
        prefixes = [path[:d] for d in range(1, len(path) + 1)]
        for j in range(len(kept), -1, -1):
            have = {p for p, _ in kept[:j]}
            missing = [p for p in prefixes if p not in have]
            if j + len(missing) <= limit:
                break
        kept = kept[:j] + [(p, -math.inf) for p in missing]
    kept.sort(key=lambda e: (len(e[0]), -e[1], e[0]))
    return kept


def tree_from_reference(root: int, kept: list[tuple[tuple[int, ...], float]]) -> dict[str, Any]:
    """The arrays a DraftTree must hold for these nodes, computed the slow way."""
    index = {(): 0}
    tokens, parents, depths, scores = [root], [-1], [0], [0.0]
    for i, (path, score) in enumerate(kept, start=1):
        index[path] = i
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        depths.append(len(path))
        scores.append(score)
    n = len(tokens)
    paths = [()] + [p for p, _ in kept]
    mask = np.array(
        [[paths[i][: len(paths[j])] == paths[j] for j in range(n)] for i in range(n)], dtype=bool
    )
    leaves = [i for i in range(n) if i not in set(parents)]
    width = max(depths) + 1
    retrieve = np.full((len(leaves), width), -1, dtype=np.int64)
    for r, leaf in enumerate(leaves):
        p = paths[leaf]
        for d in range(len(p) + 1):
            retrieve[r, d] = index[p[:d]]
    return {
        "tokens": np.array(tokens, dtype=np.int64),
        "parents": np.array(parents, dtype=np.int64),
        "depths": np.array(depths, dtype=np.int64),
        "attention_mask": mask,
        "retrieve_indices": retrieve,
        "scores": np.array(scores, dtype=np.float64),
    }


def assert_same_tree(tree: DraftTree, expected: dict[str, Any]) -> None:
    for name, want in expected.items():
        got = getattr(tree, name)
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, (name, got.shape, want.shape)
        if name == "scores":  # bit for bit
            assert got.tobytes() == want.tobytes(), (got, want)
        else:
            assert np.array_equal(got, want), (name, got, want)


def check_guarantees(tree: DraftTree, root: int, budget: int) -> None:
    """Every structural guarantee, checked directly on the arrays."""
    n = len(tree)
    assert 1 <= n <= budget + 1
    assert tree.tokens[0] == root and tree.parents[0] == -1 and tree.depths[0] == 0
    siblings: dict[int, set[int]] = {}
    for i in range(1, n):
        p = int(tree.parents[i])
        assert 0 <= p < i
        assert tree.depths[i] == tree.depths[p] + 1
        assert tree.scores[i] <= tree.scores[p]
        assert int(tree.tokens[i]) not in siblings.setdefault(p, set())
        siblings[p].add(int(tree.tokens[i]))
    for i in range(n):
        anc = set()
        x = i
        while x >= 0:
            anc.add(x)
            x = int(tree.parents[x])
        assert set(np.flatnonzero(tree.attention_mask[i]).tolist()) == anc
    leaves = [i for i in range(n) if i not in siblings]
    assert tree.retrieve_indices.shape == (len(leaves), int(tree.depths.max()) + 1)
    for row, leaf in zip(tree.retrieve_indices, leaves, strict=True):
        d = int(tree.depths[leaf])
        assert row[d] == leaf and row[0] == 0
        assert all(tree.parents[row[c]] == row[c - 1] for c in range(1, d + 1))
        assert (row[d + 1 :] == -1).all()


# ---- small real models over random corpora ------------------------------------------------

MODELS = [  # (order, vocab, eos)
    (3, 12, 11),
    (2, 8, None),
    (4, 10, 9),
]


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[NGram, Counts]]:
    """Models written by the real builder from random token documents, with their counts."""
    out = []
    rng = np.random.default_rng(7)
    for i, (order, vocab, eos) in enumerate(MODELS):
        d = tmp_path_factory.mktemp(f"small{i}")
        top = vocab - 1 if eos is not None else vocab
        # Few distinct tokens per document position: contexts repeat, probabilities vary.
        docs = [rng.integers(0, top, size=int(rng.integers(1, 40))).tolist() for _ in range(30)]
        with (d / "c.jsonl").open("w") as f:
            for doc in docs:
                f.write(json.dumps({"ids": doc}) + "\n")
        kwargs: dict[str, Any] = {"eos_id": eos} if eos is not None else {"no_eos": True}
        build([d / "c.jsonl"], d / "m.ngram", order=order, vocab_size=vocab, **kwargs)
        ng = NGram.open(d / "m.ngram")
        assert (ng.order, ng.vocab_size, ng.eos_id) == (order, vocab, eos)
        out.append((ng, Counts.of(docs, order, vocab, eos)))
    return out


PROBS = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.125, 0.1, 0.05]),  # ties, and the p == 1 clamp
    st.floats(0.0, 1.0, width=32),
)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    m = draw(st.integers(0, len(MODELS) - 1))
    _, vocab, eos = MODELS[m]
    levels = draw(st.integers(1, 5))
    k = draw(st.integers(1, min(vocab, 6)))
    rows = [draw(st.permutations(range(vocab)))[:k] for _ in range(levels)]
    # Draft rows love EOS: put it in front of some rows.
    if eos is not None and draw(st.booleans()):
        for r in rows:
            if eos not in r and draw(st.booleans()):
                r[0] = eos
    cfg = PrunerConfig(
        beam_width=draw(st.integers(1, 6)),
        max_nodes=draw(st.integers(1, 30)),
        level_exponent=draw(st.sampled_from([0.0, 0.7, 1.3])),
        logit_decay=draw(st.sampled_from([0.9, 1.0, 0.5])),
        ngram_weight=draw(st.sampled_from([0.0, 0.5, 2.0])),
        ngram_at_level0=draw(st.booleans()),
        eps=draw(st.sampled_from([1e-10, 1e-3])),
        eos_id=draw(st.sampled_from([None, None, 0])),
    )
    return {
        "model": m,
        "context": draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6)),
        "ids": np.array(rows, dtype=np.int64),
        "probs": np.array(
            draw(st.lists(PROBS, min_size=levels * k, max_size=levels * k)), dtype=np.float32
        ).reshape(levels, k),
        "config": cfg,
        "budget": draw(st.one_of(st.none(), st.integers(1, 40))),
        "lookup": draw(
            st.one_of(st.just([]), st.lists(st.integers(0, vocab - 1), min_size=1, max_size=9))
        ),
    }


@settings(
    max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
def test_agrees_exactly_with_the_python_reference(small_models, case) -> None:
    ng, counts = small_models[case["model"]]
    cfg = case["config"]
    tree = Pruner(ng, cfg).prune(
        case["context"], case["ids"], case["probs"], case["budget"], lookup_path=case["lookup"]
    )
    eos = cfg.eos_id if cfg.eos_id is not None else counts.eos
    kept = reference_prune(
        counts.prob,
        eos,
        cfg,
        case["context"],
        case["ids"],
        case["probs"],
        case["budget"],
        case["lookup"],
    )
    assert_same_tree(tree, tree_from_reference(case["context"][-1], kept))
    check_guarantees(tree, case["context"][-1], case["budget"] or cfg.max_nodes)


@st.composite
def batches(
    draw: st.DrawFn,
) -> tuple[int, PrunerConfig, list[Any], np.ndarray, np.ndarray, list[Any], list[Any]]:
    """One model and config, B requests of a common shape (L, k), budgets and lookup paths
    per request."""
    m = draw(st.integers(0, len(MODELS) - 1))
    vocab = MODELS[m][1]
    levels, k, b = (
        draw(st.integers(1, 4)),
        draw(st.integers(1, min(vocab, 5))),
        draw(st.integers(1, 8)),
    )
    ids = np.array(
        [[draw(st.permutations(range(vocab)))[:k] for _ in range(levels)] for _ in range(b)],
        dtype=np.int64,
    )
    probs = np.array(
        draw(st.lists(PROBS, min_size=b * levels * k, max_size=b * levels * k)), dtype=np.float32
    ).reshape(b, levels, k)
    contexts = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5)) for _ in range(b)]
    budgets = [draw(st.one_of(st.none(), st.integers(1, 20))) for _ in range(b)]
    paths = [
        draw(st.one_of(st.none(), st.lists(st.integers(0, vocab - 1), max_size=6)))
        for _ in range(b)
    ]
    cfg = PrunerConfig(beam_width=draw(st.integers(1, 5)), max_nodes=draw(st.integers(1, 20)))
    return m, cfg, contexts, ids, probs, budgets, paths


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=batches())
def test_prune_batch_equals_prune(small_models, batch) -> None:
    m, cfg, contexts, ids, probs, budgets, paths = batch
    pruner = Pruner(small_models[m][0], cfg)
    trees = pruner.prune_batch(contexts, ids, probs, budgets, lookup_paths=paths)
    assert len(trees) == len(contexts)
    for i, t in enumerate(trees):
        one = pruner.prune(contexts[i], ids[i], probs[i], budgets[i], lookup_path=paths[i])
        for f in fields(DraftTree):
            assert np.array_equal(getattr(t, f.name), getattr(one, f.name)), f.name


# ---- forms of input and output -------------------------------------------------------------


@pytest.fixture(scope="module")
def small(small_models) -> NGram:
    return small_models[0][0]


IDS = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
PROBS2 = np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], dtype=np.float32)


def test_outputs_are_typed_arrays_torch_takes_without_copy(small) -> None:
    import torch

    tree = Pruner(small).prune([0, 1, 2], IDS, PROBS2)
    assert len(tree) == 1 + 3 + 9 and tree.num_draft_nodes == 12 and tree.max_depth == 2
    assert tree.tokens.dtype == np.int64 and tree.parents.dtype == np.int64
    assert tree.depths.dtype == np.int64 and tree.retrieve_indices.dtype == np.int64
    assert tree.attention_mask.dtype == np.bool_ and tree.attention_mask.shape == (13, 13)
    assert tree.scores.dtype == np.float64
    for f in fields(DraftTree):
        a = getattr(tree, f.name)
        assert a.flags.c_contiguous
        # The buffers are Rust's, handed over (the array does not own a numpy copy).
        assert not a.flags.owndata
        t = torch.from_numpy(a)
        assert t.data_ptr() == a.ctypes.data
    assert tree.path(12) == [int(tree.tokens[tree.parents[12]]), int(tree.tokens[12])]
    # remote.py builds the same class by keyword.
    again = DraftTree(**{f.name: getattr(tree, f.name) for f in fields(DraftTree)})
    assert len(again) == len(tree)


def test_lists_numpy_and_torch_inputs_give_the_same_tree(small) -> None:
    import torch

    p = Pruner(small)
    base = p.prune([0, 1, 2], IDS, PROBS2)
    variants = [
        p.prune(np.array([0, 1, 2], dtype=np.int32), IDS.tolist(), PROBS2.tolist()),
        p.prune(torch.tensor([0, 1, 2]), torch.from_numpy(IDS), torch.from_numpy(PROBS2)),
        p.prune((0, 1, 2), IDS.astype(np.uint16), PROBS2.astype(np.float64)),
        # A long context: only its tail is read, and the result is the same.
        p.prune([5] * 10_000 + [0, 1, 2], IDS, PROBS2),
    ]
    # bf16 probabilities (a draft head in bf16) are accepted; values round like the model's.
    bf = torch.from_numpy(PROBS2).to(torch.bfloat16)
    t_bf = p.prune(torch.tensor([0, 1, 2]), torch.from_numpy(IDS), bf)
    assert np.array_equal(t_bf.tokens, p.prune([0, 1, 2], IDS, bf.float().numpy()).tokens)
    for v in variants:
        for f in fields(DraftTree):
            assert np.array_equal(getattr(v, f.name), getattr(base, f.name)), f.name


def test_matching_inputs_are_not_copied() -> None:
    from dart_client.ngram.pruner import _ids, _probs

    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    b = np.full((2, 3), 0.1, dtype=np.float32)
    assert _ids(a, 2, "x") is a
    assert _probs(b, 2, "x") is b
    import torch

    t = torch.arange(6).reshape(2, 3)
    assert np.shares_memory(_ids(t, 2, "x"), t.numpy())


def test_config_defaults_are_the_rust_defaults() -> None:
    assert asdict(PrunerConfig()) == _native.pruner_config_defaults()
    c = PrunerConfig()
    with pytest.raises(AttributeError):
        c.beam_width = 3  # type: ignore[misc]  # frozen: the native pruner could not follow


def test_budget_and_eos_settings(small_models) -> None:
    ng, _ = small_models[0]  # eos 11
    p = Pruner(ng, PrunerConfig(max_nodes=5))
    assert p.eos_id == 11
    assert len(p.prune([0, 1], IDS, PROBS2)) == 6
    assert len(p.prune([0, 1], IDS, PROBS2, budget=2)) == 3
    assert len(p.prune([0, 1], IDS, PROBS2, budget=np.int64(100))) == 13
    assert Pruner(ng, PrunerConfig(eos_id=3)).eos_id == 3
    no_eos_model = small_models[1][0]
    assert Pruner(no_eos_model).eos_id is None


def test_results_are_identical_across_threads(small) -> None:
    p = Pruner(small)
    rng = np.random.default_rng(1)
    reqs = []
    for _ in range(40):
        ids = np.stack([rng.permutation(12)[:6] for _ in range(4)])
        probs = rng.dirichlet(np.ones(6), size=4).astype(np.float32)
        reqs.append((rng.integers(0, 12, size=3).tolist(), ids, probs))
    expected = [p.prune(*r).tokens for r in reqs]
    results: dict[int, list[np.ndarray]] = {}

    def work(w: int) -> None:
        results[w] = [p.prune(*r).tokens for r in reqs]

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in range(4):
        assert all(np.array_equal(a, b) for a, b in zip(results[w], expected, strict=True))


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "exc", "message"),
    [
        (([], IDS, PROBS2), PrunerError, "context is empty"),
        (([1], IDS, PROBS2[:, :2]), PrunerError, "expected the same (levels, k)"),
        (([1], IDS[0], PROBS2[0]), PrunerError, "topk_ids must be 2-dimensional"),
        (([1], IDS.astype(float), PROBS2), PrunerError, "must hold integer token ids"),
        (([1], IDS, IDS), PrunerError, "must hold floating-point probabilities"),
        (([1], [[1, 2, 12], [4, 5, 6]], PROBS2), TokenOutOfVocabError, "topk_ids[0][2] = 12"),
        (([1], [[1, 2, -3], [4, 5, 6]], PROBS2), TokenOutOfVocabError, "topk_ids[0][2] = -3"),
        (([1, 99, 1], IDS, PROBS2), TokenOutOfVocabError, "context[1] = 99"),
        (([-1], IDS, PROBS2), TokenOutOfVocabError, "context[0] = -1"),
        (([1], [[1, 2, 1], [4, 5, 6]], PROBS2), PrunerError, "row 0 holds token 1 twice"),
        (([1], IDS, [[0.5, 0.3, 1.5], [0.6, 0.3, 0.1]]), PrunerError, "topk_probs[0][2] = 1.5"),
        (([1], IDS, [[0.5, 0.3, 0.2], [0.6, float("nan"), 0.1]]), PrunerError, "= NaN"),
        (([1], IDS, [[0.5, 0.3, 0.2], [0.6, -0.1, 0.1]]), PrunerError, "topk_probs[1][1] = -0.1"),
        (
            ([1], np.zeros((0, 3), np.int64), np.zeros((0, 3), np.float32)),
            PrunerError,
            "at least one level",
        ),
    ],
)
def test_bad_input_is_a_clear_error(small, args, exc, message) -> None:
    with pytest.raises(exc) as e:
        Pruner(small).prune(*args)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("path", "exc", "message"),
    [
        ([3, 12], TokenOutOfVocabError, "lookup_path[1] = 12"),
        ([-4], TokenOutOfVocabError, "lookup_path[0] = -4"),
        ([[1, 2]], PrunerError, "lookup_path must be 1-dimensional"),
        ([1.5], PrunerError, "lookup_path must hold integer token ids"),
    ],
)
def test_bad_lookup_path_is_a_clear_error(small, path, exc, message) -> None:
    with pytest.raises(exc) as e:
        Pruner(small).prune([1], IDS, PROBS2, lookup_path=path)
    assert message in str(e.value)


def test_lookup_path_is_held_within_the_budget(small) -> None:
    pruner = Pruner(small)
    plain = pruner.prune([1], IDS, PROBS2, budget=4)
    # A path the beam would not keep: it takes 3 of the 4 nodes, the beam's best the rest.
    tree = pruner.prune([1], IDS, PROBS2, budget=4, lookup_path=[9, 9, 9])
    assert len(tree) == 5
    assert [tree.path(i) for i in range(1, 5) if np.isfinite(tree.scores[i])] == [plain.path(1)]
    assert max(tree.path(i) for i in range(1, 5) if not np.isfinite(tree.scores[i])) == [9] * 3
    # Empty and None paths change nothing.
    for empty in (None, [], np.zeros(0, np.int64)):
        again = pruner.prune([1], IDS, PROBS2, budget=4, lookup_path=empty)
        assert all(
            np.array_equal(getattr(again, f.name), getattr(plain, f.name))
            for f in fields(DraftTree)
        )
    # A path longer than the budget is cut to it.
    assert [
        tree.path(4) for tree in [pruner.prune([1], IDS, PROBS2, budget=4, lookup_path=[7] * 9)]
    ] == [[7] * 4]


@pytest.mark.parametrize(
    ("budget", "message"),
    [(0, "budget = 0"), (-2, "budget = -2"), (1.5, "budget = 1.5"), (True, "budget = True")],
)
def test_bad_budget(small, budget, message) -> None:
    with pytest.raises(PrunerError, match=message.replace(".", r"\.")):
        Pruner(small).prune([1], IDS, PROBS2, budget=budget)


@pytest.mark.parametrize(
    ("config", "exc", "message"),
    [
        (PrunerConfig(beam_width=0), PrunerError, "beam_width = 0"),
        (PrunerConfig(max_nodes=-1), PrunerError, "max_nodes = -1"),
        (PrunerConfig(eps=0.0), PrunerError, "eps = 0"),
        (PrunerConfig(logit_decay=float("nan")), PrunerError, "logit_decay = NaN"),
        (PrunerConfig(ngram_weight=-1.0), PrunerError, "ngram_weight = -1"),
        (PrunerConfig(eos_id=12), TokenOutOfVocabError, "eos_id = 12"),
        (PrunerConfig(eos_id=-1), TokenOutOfVocabError, "eos_id = -1"),
    ],
)
def test_bad_config(small, config, exc, message) -> None:
    with pytest.raises(exc, match=message):
        Pruner(small, config)


def test_batch_errors_name_the_request(small) -> None:
    p = Pruner(small)
    ids = np.stack([IDS, IDS, IDS])
    probs = np.stack([PROBS2, PROBS2, PROBS2])
    bad = ids.copy()
    bad[2, 1, 0] = 40
    with pytest.raises(
        TokenOutOfVocabError,
        match=r"request 2: topk_ids\[1\]\[0\] = 40|topk_ids\[2\]\[1\]\[0\] = 40",
    ):
        p.prune_batch([[1], [1], [1]], bad, probs)
    with pytest.raises(PrunerError, match="request 1: budget = 0"):
        p.prune_batch([[1], [1], [1]], ids, probs, budgets=[None, 0, 3])
    with pytest.raises(PrunerError, match="2 contexts for a batch of 3"):
        p.prune_batch([[1], [1]], ids, probs)
    with pytest.raises(PrunerError, match="1 budgets for a batch of 3"):
        p.prune_batch([[1], [1], [1]], ids, probs, budgets=[1])
    with pytest.raises(PrunerError, match="topk_ids must be 3-dimensional"):
        p.prune_batch([[1]], IDS, PROBS2)
    assert p.prune_batch([], np.zeros((0, 2, 3), np.int64), np.zeros((0, 2, 3), np.float32)) == []


# ---- a real model and draft-like distributions ----------------------------------------------


@pytest.fixture(scope="module")
def sharegpt_model(smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A 3-gram model built from 300 real ShareGPT conversations with the SmolLM2 tokenizer,
    and 20 further conversations (tokenized) that the model has not seen."""
    from conftest import sharegpt_texts
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("sharegpt_pruner")
    texts = sharegpt_texts(320)
    with (d / "train.jsonl").open("w", encoding="utf-8") as f:
        for t in texts[:300]:
            f.write(json.dumps({"text": t}) + "\n")
    tok_json = smollm2_tokenizer_dir / "tokenizer.json"
    build([d / "train.jsonl"], d / "sharegpt.ngram", tokenizer=tok_json, order=3, threads=2)
    tok = Tokenizer.from_file(str(tok_json))
    held_out = [tok.encode(t, add_special_tokens=True).ids for t in texts[300:]]
    return NGram.open(d / "sharegpt.ngram"), [h for h in held_out if len(h) > 64]


def draft_like(
    ng: NGram, text: list[int], pos: int, rng: np.random.Generator, levels: int = 8, k: int = 25
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """A draft step at ``pos``: each row holds the true next token (near the top, less often
    deeper), the model's best continuations of the true prefix and random filler; the
    probabilities are a softmax over decaying noisy logits, in float32 like a draft head's."""
    context = text[: pos + 1]
    ids = np.zeros((levels, k), dtype=np.int64)
    for level in range(levels):
        row: list[int] = []
        truth = text[pos + 1 + level]
        if rng.random() < 0.8 / math.sqrt(level + 1):
            row.append(truth)
        top, _ = ng.top_k(text[: pos + 1 + level], 10)
        row += [int(t) for t in top if int(t) not in row]
        while len(row) < k:
            t = int(rng.integers(0, ng.vocab_size))
            if t not in row:
                row.append(t)
        ids[level] = row[:k]
    logits = -0.35 * np.arange(k)[None, :] + rng.random((levels, k))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return context, ids, probs.astype(np.float32)


def test_trees_on_real_model_and_draft_like_rows(sharegpt_model) -> None:
    ng, texts = sharegpt_model
    rng = np.random.default_rng(0)
    pruner = Pruner(ng)
    plain = Pruner(ng, PrunerConfig(ngram_weight=0.0))
    differs = 0
    hits_ngram = hits_plain = 0
    steps = 0
    batch = []
    for text in texts:
        for pos in rng.choice(np.arange(16, len(text) - 9), size=3, replace=False):
            context, ids, probs = draft_like(ng, text, int(pos), rng)
            tree = pruner.prune(context, ids, probs)
            check_guarantees(tree, context[-1], 60)
            assert len(tree) == 61

            # The slow reference, with the real model's own probabilities.
            def model_prob(history: list[int], t: int) -> float:
                return float(ng.prob(history[-2:], [t])[0][0])

            kept = reference_prune(model_prob, ng.eos_id, pruner.config, context, ids, probs, None)
            assert_same_tree(tree, tree_from_reference(context[-1], kept))
            other = plain.prune(context, ids, probs)
            differs += not np.array_equal(tree.tokens, other.tokens)
            # How many true next tokens each tree holds as a path from the root.
            truth = text[int(pos) + 1 : int(pos) + 9]
            hits_ngram += accepted_length(tree, truth)
            hits_plain += accepted_length(other, truth)
            steps += 1
            batch.append((context, ids, probs))
    # The n-gram term is live: it reshapes most trees.
    assert differs >= steps // 2, (differs, steps)
    # Batch = one by one on the real model too.
    trees = pruner.prune_batch(
        [b[0] for b in batch], np.stack([b[1] for b in batch]), np.stack([b[2] for b in batch])
    )
    for t, b in zip(trees, batch, strict=True):
        assert np.array_equal(t.tokens, pruner.prune(*b).tokens)
    print(
        f"\n{steps} draft-like steps: mean accepted length with n-gram "
        f"{hits_ngram / steps:.2f}, without {hits_plain / steps:.2f}; "
        f"n-gram changed {differs} trees"
    )


def accepted_length(tree: DraftTree, truth: list[int]) -> int:
    """Length of the longest root path whose tokens equal ``truth``'s prefix."""
    node, n = 0, 0
    for t in truth:
        children = [i for i in range(len(tree)) if tree.parents[i] == node and tree.tokens[i] == t]
        if not children:
            break
        node, n = children[0], n + 1
    return n


def test_a_batch_of_pruned_trees_is_what_the_verifier_takes(tiny_ngram_path: Path) -> None:
    """``build_trees`` of a batch (one ``prune_batch`` call, the calling thread pruning beside
    the pool) gives each row the tree ``prune`` gives it alone, as a ``Tree`` whose lazily
    built children, depths and mask agree with its parents."""
    import torch

    from dart_client.decoding.draft import DraftRows
    from dart_client.decoding.prune import PrunerTreeBuilder, build_trees
    from dart_client.decoding.verify import Tree, TreeBatch

    pruner = Pruner(NGram.open(str(tiny_ngram_path)), PrunerConfig(max_nodes=12))
    rng = np.random.default_rng(3)
    rows = 23  # more rows than pool threads, and budgets that differ per row
    contexts = [rng.integers(3, 300, 8).astype(np.int64) for _ in range(rows)]
    drafts = []
    for _ in range(rows):
        ids = np.stack([rng.choice(np.arange(3, 300), 25, replace=False) for _ in range(3)])
        probs = rng.random((3, 25)).astype(np.float32)
        drafts.append(
            DraftRows(ids=ids.astype(np.int64), probs=probs / probs.sum(1, keepdims=True))
        )
    budgets = [int(b) for b in rng.integers(0, 13, rows)]
    trees = build_trees(PrunerTreeBuilder(pruner), contexts, drafts, budgets, [None] * rows)
    for b, tree in enumerate(trees):
        if budgets[b] == 0:
            assert tree.tokens == [int(contexts[b][-1])]
            continue
        alone = pruner.prune(contexts[b], drafts[b].ids, drafts[b].probs, budget=budgets[b])
        want = Tree.build(alone.tokens.tolist(), alone.parents.tolist())
        assert tree.tokens == want.tokens and tree.parents == want.parents
        assert tree.children == want.children
        assert torch.equal(tree.depths, want.depths) and torch.equal(tree.mask, want.mask)
        assert len(tree) == budgets[b] + 1 == trees.size(b)
    # The padded arrays the verifiers read (filled by the pruner in one call, the rows without
    # a budget spread in after) equal the same trees packed one at a time in Python; a padding
    # node is token 0, parent 0, depth 0 and sees only itself.
    assert isinstance(trees, TreeBatch) and trees.width == max(len(t) for t in trees)
    packed = TreeBatch.of([Tree.build(t.tokens, t.parents) for t in trees])
    for name in ("tokens", "parents", "depths", "mask", "sizes"):
        assert np.array_equal(getattr(trees, name), getattr(packed, name)), name
    short = int(np.argmin(trees.sizes))
    n, width = trees.size(short), trees.width
    assert n < width
    assert not trees.tokens[short, n:].any() and not trees.parents[short, n:].any()
    assert not trees.depths[short, n:].any()
    assert np.array_equal(trees.mask[short, n:], np.eye(width, dtype=bool)[n:])


def test_the_batch_prune_benchmark_reports_every_figure(
    tiny_ngram_path: Path, tmp_path: Path
) -> None:
    from dart_client.apps.bench import batch_prune

    out = tmp_path / "figures.json"
    batch_prune.main(
        ["--model", str(tiny_ngram_path), "--rows", "2", "5", "--budgets", "1", "4",
         "--calls", "3", "--gap-ms", "0.1", "--json", str(out)]
    )  # fmt: skip
    figures = json.loads(out.read_text())["figures"]
    assert [(f["rows"], f["budget"]) for f in figures] == [(2, 1), (2, 4), (5, 1), (5, 4)]
    for f in figures:
        for name in ("build_trees", "prune_batch", "one_by_one"):
            assert 0 < f[name]["p50_us"] <= f[name]["p90_us"]
