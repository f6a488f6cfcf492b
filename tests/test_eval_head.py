"""``dart-eval-head``: teacher-forced alpha against the head as it drafts at inference, and
the command line end to end on a tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_target, make_tiny_tokenizer

from dart_client.apps.train import eval_main
from dart_client.decoding.draft import draft_rows
from dart_client.models.head import DartHead
from dart_client.models.target import TargetModel
from dart_client.train.eval import evaluate_head

CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> {% endif %}"
)


def inference_alpha(
    head: DartHead, target: torch.nn.Module, windows: list[tuple[np.ndarray, np.ndarray]]
) -> tuple[list[float], list[float]]:
    """alpha and chain from the head's inference path: for every anchor ``a``, a fresh
    head cache fed the target's taps of positions ``0..a`` (as a prompt is), top-1 of each
    draft row against the target's own greedy tokens."""
    rows = head.config.draft_length + 1
    wrapped = TargetModel(target, cpu_kernels=False)
    hit = np.zeros(rows)
    seen = np.zeros(rows)
    chain_hit = np.zeros(rows)
    chain_seen = np.zeros(rows)
    try:
        for ids_np, mask in windows:
            length = len(ids_np)
            ids = torch.from_numpy(ids_np.astype(np.int64))[None]
            cache = wrapped.new_cache(length)
            logits, taps = wrapped.forward(ids, torch.arange(length)[None], cache)
            assert taps is not None
            greedy = logits[0].argmax(-1)
            for a in range(length - 1):
                top = draft_rows(
                    head, head.new_cache(length + rows), taps[:, : a + 1], ids[:, 1 : a + 2], 1
                ).ids[:, 0]
                # Row j counts where its token (position a + 2 + j) is an assistant token;
                # in the chain only while every earlier row counted and was right.
                chained = True
                for j in range(rows):
                    pos = a + 2 + j
                    valid = pos < length and bool(mask[pos])
                    right = valid and bool(top[j] == int(greedy[a + 1 + j]))
                    seen[j] += valid
                    hit[j] += right
                    if valid and chained:
                        chain_seen[j] += 1
                        chain_hit[j] += right
                    chained = chained and right
    finally:
        wrapped.close()
    return (hit / np.maximum(seen, 1)).tolist(), (chain_hit / np.maximum(chain_seen, 1)).tolist()


def test_teacher_forced_alpha_is_what_the_head_drafts_at_inference() -> None:
    """evaluate_head (one prefix-shared forward per chunk of anchors) against the inference
    path (one draft per anchor). A small vocabulary makes hits frequent enough that an
    off-by-one in either the rows or the target's tokens changes the counts."""
    torch.manual_seed(0)
    target = make_tiny_target("llama", vocab_size=24, layers=4)
    head = DartHead.random_init(
        target.config, draft_length=3, double_final_norm=False, seed=3, std=0.3
    ).to(torch.float64)
    head.bind_embedding(target.get_input_embeddings())
    rng = np.random.default_rng(0)
    windows = []
    for length in (37, 52, 9):
        ids = rng.integers(3, 24, size=length)
        mask = rng.random(length) < 0.8
        mask[:3] = False
        windows.append((ids, mask))

    # 16 anchors per forward: several chunks per window, as a long window has.
    got = evaluate_head(head, target, windows, anchors_per_forward=16)
    alpha, chain = inference_alpha(head, target, windows)

    assert got.alpha == pytest.approx(alpha, abs=1e-12)
    assert got.chain == pytest.approx(chain, abs=1e-12)
    assert got.positions == sum(int(m[2:].sum()) for _, m in windows)
    assert got.windows == 3 and got.tokens == 37 + 52 + 9
    assert 0.01 < got.alpha[0] < 0.99  # neither vacuous nor trivial


@pytest.fixture
def tiny_target_dir(tmp_path: Path) -> Path:
    model = make_tiny_target("llama", vocab_size=TINY_VOCAB, layers=4).to("cpu")
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path / "target"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_prompts(path: Path, n: int) -> None:
    rng = np.random.default_rng(1)

    def words(k: int) -> str:
        return " ".join(f"w{t}" for t in rng.integers(3, TINY_VOCAB, size=k))

    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": words(12), "response": words(30)}) + "\n")


@pytest.mark.usefixtures("one_thread")
def test_eval_head_command_end_to_end(
    tmp_path: Path, tiny_target_dir: Path, tiny_ngram_path: Path
) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_target_dir)
    head_dir = tmp_path / "head"
    DartHead.random_init(
        config, draft_length=3, draft_vocab_size=64, double_final_norm=False, seed=0
    ).save_pretrained(head_dir)
    data = tmp_path / "prompts.jsonl"
    write_prompts(data, 4)
    report = tmp_path / "eval.json"
    argv = [
        "--target", str(tiny_target_dir), "--target-dtype", "fp64", "--head", str(head_dir),
        "--data", str(data), "--split", "all", "--max-windows", "3",
        "--cache-dir", str(tmp_path / "cache"), "--tau-prompts", "2", "--max-new-tokens", "12",
        "--ngram", str(tiny_ngram_path), "--tree-budget", "6", "--json", str(report),
    ]  # fmt: skip
    assert eval_main(argv) == 0
    result = json.loads(report.read_text())
    assert len(result["alpha"]) == len(result["chain"]) == 4
    assert all(0.0 <= a <= 1.0 for a in result["alpha"])
    assert result["windows"] == 3 and result["positions"] > 0
    tau = result["tau"]
    # float64: DART's greedy output is the target's, token for token.
    assert tau["prompts"] == 2 and tau["identical"] == 2
    assert tau["tau"] >= 1.0 and tau["tree"].startswith("pruner")


def test_eval_head_names_what_does_not_fit(
    tmp_path: Path, tiny_target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import LlamaConfig

    other = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1
    )
    head_dir = tmp_path / "head"
    DartHead.random_init(other, draft_length=3, double_final_norm=False).save_pretrained(head_dir)
    data = tmp_path / "prompts.jsonl"
    write_prompts(data, 2)
    argv = ["--target", str(tiny_target_dir), "--target-dtype", "fp64", "--head", str(head_dir),
            "--data", str(data), "--split", "all", "--tau-prompts", "0"]  # fmt: skip
    assert eval_main(argv) == 1  # a user error: one line, exit 1 (as every dart command)
    err = capsys.readouterr().err
    assert "does not fit the target" in err and "hidden_size: head 32, target 64" in err
