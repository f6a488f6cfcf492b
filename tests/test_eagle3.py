"""EAGLE-3: the published layout and its loader, training-time test, the dynamic tree, and
generation through the project's one loop (greedy exact, sampling lossless)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generate import PARAMS, SMALL_VOCAB, chi_square_pvalue, exact_joint, total_variation
from test_train import tiny_config, tiny_data, tiny_target

from dart_client.dart_model import DartModel
from dart_client.decoding.autotune import tune_eagle3_tree
from dart_client.decoding.eagle3 import Eagle3Drafter, Eagle3TreeConfig
from dart_client.decoding.loop import PrefixCache
from dart_client.errors import CheckpointError, IncompatibleHeadError, InvalidArgumentError
from dart_client.models.eagle3 import ARCHITECTURE, EAGLE3_KEYS, Eagle3Head
from dart_client.models.target import TargetModel
from dart_client.train.eagle3 import Eagle3Trainer, ttt_forward, ttt_targets


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_head(target: Any, *, vocab: int = 200, seed: int = 0, std: float = 0.2) -> Eagle3Head:
    head = Eagle3Head.random_init(target.config, draft_vocab_size=vocab, seed=seed, std=std)
    return head.to(torch.float64)


# -- layout and loader ----------------------------------------------------------------------


def published_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The tensors a published checkpoint holds (+ the embedding some of them carry)."""
    state = {k: v.clone() for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = torch.zeros(head.config.vocab_size, head.config.hidden_size)
    return state


def write_published(
    directory: Path, head: Eagle3Head, state: dict[str, torch.Tensor], fmt: str
) -> Path:
    """A checkpoint directory as EAGLE-3 publishes them: its config.json fields (no
    draft_length, no double_final_norm) and pytorch_model.bin or model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    config = {
        "architectures": [ARCHITECTURE],
        "bias": False,
        "draft_vocab_size": cfg.draft_vocab_size,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": cfg.vocab_size,
    }
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        config["head_dim"] = cfg.head_dim
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors")
        )
    return directory


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_published_checkpoint_loads_exactly(tmp_path: Path, arch: str, fmt: str) -> None:
    target = make_tiny_target(arch)
    head = tiny_head(target, seed=3)
    head.set_draft_vocab(torch.arange(184, 384))
    state = published_state(head)
    loaded = Eagle3Head.from_pretrained(write_published(tmp_path / arch, head, state, fmt))
    assert sorted(loaded.state_dict()) == sorted(EAGLE3_KEYS)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key].to(value.dtype), value), key
    assert not loaded.config.double_final_norm
    assert torch.equal(loaded.draft_to_target, torch.arange(184, 384))
    loaded.check_compatible(target.config)
    # Saved and read back in this project's layout: the same tensors, marked EAGLE-3.
    loaded.save_pretrained(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    again = Eagle3Head.from_pretrained(tmp_path / "again")
    for key, value in loaded.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_loader_names_every_bad_key(tmp_path: Path) -> None:
    target = make_tiny_target("llama")
    head = tiny_head(target)
    state = published_state(head)
    del state["midlayer.hidden_norm.weight"], state["norm.weight"]
    state["midlayer.mask_rep"] = torch.zeros(2 * head.config.hidden_size)  # a DART head's
    state["fc.weight"] = state["fc.weight"][:, :-1]
    state["lm_head.weight"] = state["lm_head.weight"][:-3]
    with pytest.raises(CheckpointError) as err:
        Eagle3Head.from_pretrained(write_published(tmp_path, head, state, "bin"))
    message = str(err.value)
    for fragment in (
        "missing keys ['midlayer.hidden_norm.weight', 'norm.weight']",
        "unexpected keys ['midlayer.mask_rep']",
        "fc.weight: shape (64, 191), expected (64, 192)",
        "lm_head.weight: shape (197, 64), expected (200, 64)",
    ):
        assert fragment in message


def test_loader_rejects_corrupt_and_foreign_files(tmp_path: Path) -> None:
    target = make_tiny_target("llama")
    head = tiny_head(target)
    directory = write_published(tmp_path / "bin", head, published_state(head), "bin")
    weights = directory / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cannot read a torch checkpoint"):
        Eagle3Head.from_pretrained(directory)
    torch.save([torch.zeros(3)], weights)
    with pytest.raises(CheckpointError, match=r"cannot read a torch checkpoint|dict of named"):
        Eagle3Head.from_pretrained(directory)
    (directory / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="head weights not found"):
        Eagle3Head.from_pretrained(directory)
    state = published_state(head)
    state["d2t"] = torch.full_like(state["d2t"], 1000)
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside"):
        Eagle3Head.from_pretrained(write_published(tmp_path / "d2t", head, state, "safetensors"))


def test_a_head_for_another_target_is_refused() -> None:
    head = tiny_head(make_tiny_target("llama"))
    other = make_tiny_target("llama", vocab_size=TINY_VOCAB + 8)
    with pytest.raises(IncompatibleHeadError, match="vocab_size: head 384, target 392"):
        head.check_compatible(other.config)


# -- training-time test ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ttt_step_j_is_the_drafters_depth_j(arch: str) -> None:
    """Step j of the unrolled training at index t computes exactly what drafting computes
    at depth j after the real prefix 0..t (float64): training trains what inference runs."""
    target = make_tiny_target(arch)
    head = tiny_head(target, std=0.3)
    head.bind_embedding(target.get_input_embeddings())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_VOCAB, (1, 14), generator=gen)
    taps = torch.randn(1, 13, 3 * 64, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        steps = ttt_forward(head, taps, ids, 3)
        for t in (0, 6, 10):
            cache = head.new_cache(64)
            hidden = head(taps[:, : t + 1], ids[:, 1 : t + 2], cache)[0, -1:]
            torch.testing.assert_close(hidden[0], steps[0][0, t], rtol=0, atol=1e-12)
            visible = torch.zeros((1, 0), dtype=torch.bool)
            for j in (1, 2):
                token = ids[0, t + 1 + j : t + 2 + j]
                hidden = head.expand(hidden, token, t + j, cache, visible)
                visible = torch.ones((1, j), dtype=torch.bool)
                torch.testing.assert_close(hidden[0], steps[j][0, t], rtol=0, atol=1e-12)


@given(
    lengths=st.lists(st.integers(3, 30), min_size=1, max_size=3),
    steps=st.integers(1, 7),
    seed=st.integers(0, 1000),
)
@settings(max_examples=60, deadline=None)
def test_ttt_lines_predict_masked_tokens_inside_the_window(
    lengths: list[int], steps: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    masks = [torch.from_numpy(rng.random(n) < 0.6) for n in lengths]
    n_real = max(lengths) - 1
    index = ttt_targets(lengths, masks, n_real, steps)
    want = {
        (b, t, j)
        for b, (n, mask) in enumerate(zip(lengths, masks, strict=True))
        for j in range(steps)
        for t in range(n_real)
        if t + 2 + j < n and bool(mask[t + 2 + j])
    }
    got = list(zip(index.batch.tolist(), index.line.tolist(), index.row.tolist(), strict=True))
    assert len(got) == len(set(got)) and set(got) == want
    assert torch.equal(index.target_pos, index.line + 1 + index.row)


def test_eagle3_training_learns_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    data = tiny_data()

    def config(out: Path) -> Any:
        return tiny_config(out, draft_length=3, gamma=0.8, anchors=0, total_steps=10)

    full = Eagle3Trainer(config(tmp_path / "full"), tiny_target(torch.float32), data)
    logs = full.train()
    assert isinstance(full.head, Eagle3Head) and len(logs[0].acc) == 3
    assert logs[-1].loss < logs[0].loss
    first = Eagle3Trainer(config(tmp_path / "split"), tiny_target(torch.float32), data)
    first.train(max_steps=4)
    ckpt = first.save_checkpoint()
    resumed = Eagle3Trainer(config(tmp_path / "split"), tiny_target(torch.float32), data)
    resumed.load_checkpoint(ckpt)
    resumed.train()
    assert resumed.step == full.step == 10
    for (name, a), (_, b) in zip(
        full.head.state_dict().items(), resumed.head.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    exported = Eagle3Head.from_pretrained(full.export(tmp_path / "export", dtype="fp32"))
    for key, value in full.head.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value.cpu()), key


# -- the dynamic tree -----------------------------------------------------------------------


def fed_drafter(seed: int, tree: Eagle3TreeConfig) -> tuple[Eagle3Drafter, Any]:
    target = make_tiny_target("llama", vocab_size=64, seed=seed % 3)
    head = tiny_head(target, vocab=48, seed=seed, std=0.5)
    head.bind_embedding(target.get_input_embeddings())
    drafter = Eagle3Drafter(head, tree)
    cache = drafter.new_cache(drafter.cache_capacity(32))
    gen = torch.Generator().manual_seed(seed)
    taps = torch.randn(1, 6, 3 * 64, generator=gen, dtype=torch.float64)
    drafter.feed(cache, taps, torch.randint(0, 64, (1, 6), generator=gen))
    return drafter, cache


def brute_force_candidates(drafter: Eagle3Drafter) -> list[tuple[float, tuple[int, ...]]]:
    """Every candidate of the published growth, recomputed path by path (a full head
    forward over each path from scratch): (cumulative log-prob, draft-id path)."""
    head, cfg = drafter.head, drafter.config
    cache = drafter.cache
    assert cache is not None and drafter.last is not None
    base = cache.length

    def step(hidden_path: list[torch.Tensor], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and output after the path (re-drafted node by node on a copy)."""
        visible = torch.zeros((1, 0), dtype=torch.bool)
        hidden = drafter.last[None]
        for depth, token in enumerate(ids):
            target_id = head.draft_to_target[torch.tensor([token])]
            hidden = head.expand(hidden, target_id, base + depth, cache, visible)
            visible = torch.ones((1, depth + 1), dtype=torch.bool)
        cache.truncate(base)
        return torch.log_softmax(head.logits(hidden).float(), -1)[0], hidden

    k = cfg.top_k
    out: list[tuple[float, tuple[int, ...]]] = []
    logp, _ = step([], [])
    top = torch.topk(logp, k)
    frontier = [(float(s), (int(i),)) for s, i in zip(top.values, top.indices, strict=True)]
    out += frontier
    for _ in range(cfg.depth):
        children = []
        for score, path in frontier:
            logp, _ = step([], list(path))
            top = torch.topk(logp, k)
            children += [
                (score + float(s), (*path, int(i)))
                for s, i in zip(top.values, top.indices, strict=True)
            ]
        out += children
        order = sorted(range(len(children)), key=lambda i: -children[i][0])
        frontier = [children[i] for i in order[:k]]
    return out


@given(
    seed=st.integers(0, 50),
    top_k=st.integers(1, 4),
    depth=st.integers(1, 3),
    budget=st.integers(0, 40),
)
@settings(max_examples=25, deadline=None)
def test_tree_is_the_best_budget_of_the_published_growth(
    seed: int, top_k: int, depth: int, budget: int
) -> None:
    drafter, cache = fed_drafter(seed, Eagle3TreeConfig(top_k=top_k, depth=depth))
    length = cache.length
    with torch.no_grad():
        tree = drafter.tree(np.array([11, 7]), budget)
        candidates = brute_force_candidates(drafter)
    assert cache.length == length, "growing a tree must leave only real positions cached"
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    assert len(tree) - 1 == min(budget, len(candidates))
    # Prefix-closed, parents first, siblings distinct.
    for i in range(1, len(tree)):
        assert 0 <= tree.parents[i] < i
    for children in tree.children:
        tokens = [tree.tokens[c] for c in children]
        assert len(tokens) == len(set(tokens))
    # The chosen paths are the best-scoring ones (scores from scratch, float tolerance).
    d2t = drafter.head.draft_to_target
    scored = {tuple(int(d2t[t]) for t in path): s for s, path in candidates}
    paths = []
    for i in range(1, len(tree)):
        path, node = [], i
        while node > 0:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        paths.append(tuple(reversed(path)))
    assert all(p in scored for p in paths), "a node that the published growth never produces"
    if paths and len(paths) < len(scored):
        worst_in = min(scored[p] for p in paths)
        best_out = max(s for p, s in scored.items() if p not in set(paths))
        assert worst_in >= best_out - 1e-9


# -- generation -----------------------------------------------------------------------------


def distilled_head(target: Any, out: Path, steps: int = 100) -> tuple[Eagle3Head, list[list[int]]]:
    """A head trained (TTT) on the target's own greedy continuations of 16 prompts, and
    the prompts: from them it drafts well enough that multi-token paths get accepted, which
    is what makes the tests below able to fail."""
    from dart_client.train.data import TrainingSet

    gen = torch.Generator().manual_seed(0)
    items = []
    prompts = []
    with torch.no_grad():
        for _ in range(16):
            prompt = torch.randint(3, TINY_VOCAB, (1, 4), generator=gen)
            continued = target.generate(
                prompt, max_new_tokens=28, do_sample=False, min_new_tokens=28
            )
            ids = continued[0].numpy().astype(np.int32)
            prompts.append(prompt[0].tolist())
            mask = np.zeros(len(ids), dtype=bool)
            mask[4:] = True
            items.append((ids, mask))
    data = TrainingSet.from_windows(items)
    config = tiny_config(
        out,
        draft_length=3,
        gamma=0.8,
        anchors=0,
        draft_vocab_size=TINY_VOCAB,
        total_steps=steps,
        lr=1e-2,
        log_every=50,
        batch_size=2,
    )
    trainer = Eagle3Trainer(config, target.float(), data)
    trainer.train()
    target.double()
    head = Eagle3Head(trainer.head.config)
    head.load_state_dict(trainer.head.state_dict())
    return head.double(), prompts


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Eagle3Head, list]:
    torch.set_num_threads(1)
    target = make_tiny_target("llama", seed=2)
    return target, *distilled_head(target, tmp_path_factory.mktemp("distilled"))


def test_greedy_equals_the_target_and_drafts_get_accepted(distilled: Any) -> None:
    target, head, prompts = distilled
    dm = DartModel(
        TargetModel(target, cpu_kernels=False),
        eagle3=head,
        eagle3_tree=Eagle3TreeConfig(top_k=4, depth=4, total_tokens=16),
    )
    taus = []
    for ids in prompts[:4]:
        got = dm.generate(input_ids=ids, max_new_tokens=40)
        want = dm.generate(input_ids=ids, max_new_tokens=40, mode="ar")
        assert got.tokens == want.tokens
        assert max(got.tree_sizes) == 16 and got.timings["prune"] == 0.0
        taus.append(got.tau)
    assert np.mean(taus) > 1.5, f"drafts hardly accepted (tau {taus}): the test would be vacuous"
    # The static path drafts with DART's head: asked for explicitly, EAGLE-3 is refused by name.
    with pytest.raises(InvalidArgumentError, match="Eagle3Drafter drafts on the dynamic path"):
        dm.generate(input_ids=prompts[0], max_new_tokens=4, static=True)


def test_the_head_cache_after_generation_equals_a_fresh_prefill(distilled: Any) -> None:
    """What the drafter fed its cache step by step (the accepted nodes' taps) is what one
    pass over the final sequence computes: no position lost, duplicated or misplaced."""
    target, head, prompts = distilled
    dm = DartModel(TargetModel(target, cpu_kernels=False), eagle3=head)
    kept = PrefixCache()
    ids = prompts[5]
    result = dm.generate(input_ids=ids, max_new_tokens=30, prefix_cache=kept)
    assert result.tau > 1.2
    sequence = ids + result.tokens
    cache = kept.head_cache
    # The last step's accepted tokens are never fed: generation ended after it.
    n = cache.length
    assert len(ids) <= n < len(sequence) - 1 and len(result.accept_lengths) > 3
    fresh_target = dm.target.new_cache(len(sequence) + 1)
    positions = torch.arange(n)[None]
    _, taps = dm.target.forward(torch.tensor([sequence[:n]]), positions, fresh_target)
    fresh = head.new_cache(n + 1)
    with torch.no_grad():
        head(taps, torch.tensor([sequence[1 : n + 1]]), fresh)
    # Not to 1e-12: transformers' RMSNorm computes in float32 even for a float64 model, and
    # its reduction order changes with the number of rows (a tree's vs. one pass's): ~1e-6.
    # A lost or misplaced position differs by O(1).
    torch.testing.assert_close(cache._k[:, :, :n], fresh._k[:, :, :n], rtol=0, atol=1e-4)
    torch.testing.assert_close(cache._v[:, :, :n], fresh._v[:, :, :n], rtol=0, atol=1e-4)


def test_sampling_is_lossless() -> None:
    """The first tokens of EAGLE-3 sampling follow the target's exact joint distribution."""
    model = make_tiny_target("llama", vocab_size=SMALL_VOCAB, seed=5, init_range=0.3)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    head = Eagle3Head.random_init(model.config, seed=3, std=0.5).double()
    dm = DartModel(model, eagle3=head, eagle3_tree=Eagle3TreeConfig(top_k=6, depth=2))
    prompt = [5, 7, 3, 9]
    exact = exact_joint(model, prompt, 3, PARAMS)
    counts: Counter = Counter()
    accepted = 0
    n = 400
    for seed in range(n):
        r = dm.generate(
            input_ids=prompt,
            max_new_tokens=8,  # room for trees; the first 3 tokens are compared
            tree_budget=10,
            seed=seed,
            temperature=PARAMS.temperature,
            top_k=PARAMS.top_k,
            top_p=PARAMS.top_p,
        )
        counts[tuple(r.tokens[:3])] += 1
        accepted += sum(a - 1 for a in r.accept_lengths[1:])
    print(f"accepted drafts {accepted} over {n} generations")
    assert accepted > n // 2, "drafts were hardly ever accepted: the test would be vacuous"
    pvalue = chi_square_pvalue(counts, exact, n)
    tv = total_variation(counts, exact, n)
    assert pvalue > 1e-3, f"EAGLE-3 samples differ from the target (p={pvalue:.2e}, TV={tv:.3f})"


def test_bad_tree_settings_are_clear_errors(distilled: Any) -> None:
    target, head, _ = distilled
    with pytest.raises(InvalidArgumentError, match="top_k = 0"):
        Eagle3TreeConfig(top_k=0)
    dm = DartModel(TargetModel(target, cpu_kernels=False), eagle3=head)
    with pytest.raises(InvalidArgumentError, match="DART head only"):
        dm.tune(batch=4)
    with pytest.raises(InvalidArgumentError, match="at least one tree"):
        tune_eagle3_tree(dm, grid=[])


def test_the_tuned_tree_replays_generation_and_auto_decodes_with_it(distilled: Any) -> None:
    """EAGLE-3's own tuned tree: every tree's replayed acceptance is what greedy generation
    with that tree accepts, step for step (float64); the fastest estimate is chosen; and
    ``tree_budget="auto"`` decodes with the chosen tree, still the target's greedy output."""
    target, head, prompts = distilled
    shared = TargetModel(target, cpu_kernels=False)
    grid = [(2, 1, 3), (4, 2, 8), (4, 4, 16)]
    dm = DartModel(shared, eagle3=head)
    tuning = tune_eagle3_tree(dm, prompts=prompts[:3], grid=grid, continuation_tokens=24, repeats=1)
    assert [(p.top_k, p.depth, p.total_tokens) for p in tuning.curve] == grid
    fastest = max(tuning.curve, key=lambda p: p.tokens_per_s)
    assert tuning.best == (fastest.top_k, fastest.depth, fastest.total_tokens)
    for point in tuning.curve:
        tree = Eagle3TreeConfig(point.top_k, point.depth, point.total_tokens)
        alone = DartModel(shared, eagle3=head, eagle3_tree=tree)
        steps = []
        for ids in prompts[:3]:
            steps += alone.generate(input_ids=ids, max_new_tokens=24).accept_lengths[1:]
        assert point.tau == pytest.approx(statistics.fmean(steps)), (point, steps)
    taus = sorted(p.tau for p in tuning.curve)
    assert taus[-1] > taus[0] + 0.2, f"trees accept alike ({taus}): the replay check is vacuous"
    auto = DartModel(shared, eagle3=head, tree_budget="auto")
    assert auto.tune(prompts=prompts[:3], grid=grid, continuation_tokens=24, repeats=1) == (
        auto.eagle3_tree.budget
    )
    # Its own tuning's choice (timings differ run to run: not necessarily the one above).
    assert auto.eagle3_tree == auto.eagle3_tuning.best_config()
    assert auto.eagle3_tuning.best in grid
    for ids in prompts[3:6]:
        got = auto.generate(input_ids=ids, max_new_tokens=24)
        assert got.tokens == auto.generate(input_ids=ids, max_new_tokens=24, mode="ar").tokens
        assert max(got.tree_sizes) <= auto.eagle3_tree.total_tokens


# -- one --head for both kinds ----------------------------------------------------------------


def test_a_checkpoint_loads_as_its_own_kind_and_the_other_is_named(tmp_path: Path) -> None:
    """``load_drafter`` (``--head``, ``DartModel.from_pretrained``) tells the kinds apart by
    the weights (a DART head has the MASK embedding; published DART heads name EAGLE-3's
    architecture in their config too); each class names the other kind when given it."""
    from dart_client.loading import load_drafter
    from dart_client.models.head import DartHead

    target = make_tiny_target("llama")
    eagle = tiny_head(target)
    for fmt in ("safetensors", "bin"):
        published = write_published(tmp_path / fmt, eagle, published_state(eagle), fmt)
        assert type(load_drafter(published)) is Eagle3Head
    dart = tmp_path / "dart"
    DartHead.random_init(target.config, draft_vocab_size=64).save_pretrained(dart)
    config = json.loads((dart / "config.json").read_text())
    (dart / "config.json").write_text(json.dumps({**config, "architectures": [ARCHITECTURE]}))
    assert type(load_drafter(dart)) is DartHead
    with pytest.raises(CheckpointError, match=r"mask_rep.*looks like an EAGLE-3 draft model"):
        DartHead.from_pretrained(tmp_path / "safetensors")
    with pytest.raises(CheckpointError, match=r"mask_rep.*looks like a DART head"):
        Eagle3Head.from_pretrained(dart)
    with pytest.raises(InvalidArgumentError, match="double_final_norm"):
        load_drafter(tmp_path / "bin", double_final_norm=True)


@pytest.fixture(scope="module")
def served_eagle3() -> Any:
    """The embedded target (fp32) with the shipped EAGLE-3 head, loaded as ``dart serve
    --head <its directory>`` loads it."""
    from dart_client.apps.serve.generation import Engine
    from dart_client.dart_model import build_model
    from dart_client.embedded import SHIPPED_EAGLE3_DIR

    notes: list[str] = []
    model = build_model(
        None, str(SHIPPED_EAGLE3_DIR), "embedded", dtype="fp32", tree_budget=8, notes=notes
    )
    return Engine(model, "eagle3", 256), notes


def test_the_server_decodes_with_an_eagle3_head(served_eagle3: Any) -> None:
    """An EAGLE-3 head given as ``--head``: speculative requests draft with it (no n-gram),
    and greedy output is the target's own."""
    from dart_client.apps.serve.generation import Outcome, Sampling

    engine, notes = served_eagle3
    assert engine.model.eagle3 is not None and engine.model.head is None
    assert engine.speculative
    assert any("n-gram: not used" in n for n in notes)
    ids = engine.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    outcomes = {}
    for speculative in (True, False):
        sampling = Sampling(max_new_tokens=24, speculative=speculative)
        (outcome,) = [m for m in engine.generate(ids, sampling) if isinstance(m, Outcome)]
        outcomes[speculative] = outcome
    assert outcomes[True].mode == "dart" and outcomes[False].mode == "ar"
    assert outcomes[True].text == outcomes[False].text
    assert outcomes[True].tau > 1.0  # the EAGLE-3 head's drafts were accepted


def test_an_eagle3_head_refuses_batched_serving_by_name() -> None:
    from dart_client.dart_model import build_model
    from dart_client.embedded import SHIPPED_EAGLE3_DIR
    from dart_client.errors import DartError

    with pytest.raises(DartError, match="EAGLE-3 head: batched decoding"):
        build_model(None, str(SHIPPED_EAGLE3_DIR), None, tune_batch=4)
