"""dart-bench: workloads from the real datasets, every method on a tiny float64 target (where
greedy outputs must all equal autoregressive decoding), the metrics, and the written report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import make_tiny_target, make_tiny_tokenizer

from dart_client import DartModel
from dart_client.apps.bench import harness
from dart_client.apps.bench.cli import parser, run
from dart_client.apps.bench.harness import BenchError, Prompt, PromptRuns, Run, Settings, Workload
from dart_client.data import is_held_out
from dart_client.decoding.autotune import DEFAULT_EAGLE3_GRID
from dart_client.models.head import DartHead
from dart_client.ngram import daemon as local_daemon

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smol_tok_model(smollm2_tokenizer_dir: Path) -> DartModel:
    """A tiny target over SmolLM2's real vocabulary and tokenizer (chat template included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    return DartModel(make_tiny_target("llama", vocab_size=len(tok), layers=4), tokenizer=tok)


@pytest.fixture(scope="module")
def tiny_model(tiny_ngram_path: Path) -> DartModel:
    from dart_client.ngram import NGram

    target = make_tiny_target("llama", seed=1)
    head = DartHead.random_init(target.config, draft_length=3, seed=2).double()
    return DartModel(
        target, head, tokenizer=make_tiny_tokenizer(), ngram=NGram.open(str(tiny_ngram_path))
    )


# -- workloads -----------------------------------------------------------------------------------


def test_humaneval_chat_and_raw(smol_tok_model: DartModel) -> None:
    tok = smol_tok_model.tokenizer
    chat = harness.humaneval_workload(smol_tok_model, 3)
    raw = harness.humaneval_workload(smol_tok_model, 3, fmt="raw")
    assert [p.id for p in chat.prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    text = tok.decode(chat.prompts[0].ids)
    assert "<|im_start|>user" in text and "Complete the following Python function" in text
    assert "def has_close_elements" in text and text.rstrip().endswith("assistant")
    assert tok.decode(raw.prompts[0].ids).lstrip().startswith("from typing import List")
    with pytest.raises(ValueError, match="expected 'chat' or 'raw'"):
        harness.humaneval_workload(smol_tok_model, 3, fmt="plain")


def test_sharegpt_is_held_out_first_user_turns(smol_tok_model: DartModel) -> None:
    w = harness.sharegpt_workload(smol_tok_model, 4, max_prompt_tokens=400)
    assert len(w.prompts) == 4
    assert all(is_held_out(p.id) for p in w.prompts)
    for p in w.prompts:
        assert len(p.ids) <= 400
        assert smol_tok_model.tokenizer.decode(p.ids).count("<|im_start|>user") == 1


def test_jsonl_forms_and_errors(smol_tok_model: DartModel, tmp_path: Path) -> None:
    good = tmp_path / "mine.jsonl"
    rows = [
        {"id": "a", "prompt": "Say hi."},
        {"question_id": 7, "turns": ["What is 2+2?", "And 3+3?"]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "Name a color."},
                {"from": "gpt", "value": "x"},
            ]
        },
    ]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = harness.jsonl_workload(good, smol_tok_model, 10)
    assert [p.id for p in w.prompts] == ["a", "7", "mine:3", "mine:4"]
    tok = smol_tok_model.tokenizer
    assert "What is 2+2?" in tok.decode(w.prompts[1].ids) and "3+3" not in tok.decode(
        w.prompts[1].ids
    )
    assert "Be brief." in tok.decode(w.prompts[2].ids)
    assert "Name a color." in tok.decode(w.prompts[3].ids)
    assert harness.jsonl_workload(good, smol_tok_model, 2).prompts[-1].id == "7"
    short = harness.jsonl_workload(good, smol_tok_model, 10, max_prompt_tokens=20)
    assert len(short.prompts) < 4 and "skipped" in short.notes[0]

    cases = {
        '{"prompt": "ok"}\n{"prompt": \n': r"bad\.jsonl:2: not valid JSON",
        '["a"]\n': r"bad\.jsonl:1: expected a JSON object, got list",
        '{"text": "x"}\n': r"bad\.jsonl:1: expected a 'prompt' string.*got keys \['text'\]",
        '{"prompt": "  "}\n': r"bad\.jsonl:1: the prompt is empty",
        '{"messages": [{"role": "robot", "content": "x"}]}\n': r"bad\.jsonl:1: .*'robot'",
        '{"messages": [{"role": "system", "content": "x"}]}\n': r"bad\.jsonl:1: .*no user",
    }
    bad = tmp_path / "bad.jsonl"
    for content, pattern in cases.items():
        bad.write_text(content)
        with pytest.raises(BenchError, match=pattern):
            harness.jsonl_workload(bad, smol_tok_model, 10)
    with pytest.raises(BenchError, match="no such workload file"):
        harness.jsonl_workload(tmp_path / "missing.jsonl", smol_tok_model, 10)
    with pytest.raises(BenchError, match="expected 'humaneval', 'sharegpt' or a path"):
        harness.load_workloads(["mmlu"], smol_tok_model, 3)


# -- metrics ---------------------------------------------------------------------------------------


def test_summarize_medians_speedup_tau_and_equality() -> None:
    def r(tokens: list[int], elapsed: float, lengths: list[int] | None = None) -> Run:
        timings = {"prefill": 0.1 * elapsed, "verify": 0.5 * elapsed} if lengths else {}
        return Run(tokens, elapsed, lengths or [], timings, [1] * len(lengths or []))

    prompts = [
        PromptRuns(
            Prompt("p0", [1, 2], ""),
            {
                "ar": [r([5, 6, 7, 8], 4.0), r([5, 6, 7, 8], 2.0), r([5, 6, 7, 8], 3.0)],
                "dart": [
                    r([5, 6, 7, 8], 1.0, [1, 3]),
                    r([5, 6, 7, 8], 9.0, [1, 3]),
                    r([5, 6, 7, 8], 1.0, [1, 3]),
                ],
            },
        ),
        PromptRuns(
            Prompt("p1", [3], ""),
            {
                "ar": [r([9, 9], 1.0)] * 3,
                "dart": [r([9, 8], 1.0, [1, 1])] * 3,  # a divergence: must be counted
            },
        ),
    ]
    s = harness.summarize([harness.WorkloadRuns(Workload("w", "src", []), prompts)], Settings())
    ar, dart = s["w"]["methods"]["ar"], s["w"]["methods"]["dart"]
    assert ar["tokens"] == 6 and ar["seconds"] == pytest.approx(3.0 + 1.0)
    assert dart["seconds"] == pytest.approx(1.0 + 1.0)
    assert ar["speedup"] == 1.0 and dart["speedup"] == pytest.approx((6 / 2) / (6 / 4))
    assert dart["tau"] == pytest.approx((3 * 3 + 1 * 3) / 6)
    assert dart["accept_histogram"] == {"1": 3, "3": 3}
    assert ar["greedy_equal_ar"] == 2 and dart["greedy_equal_ar"] == 1
    assert ar["greedy_first_difference"] == [] and dart["greedy_first_difference"] == [1]
    assert ar["tau"] is None and ar["stage_share"] is None
    shares = dart["stage_share"]
    assert shares["verify"] == pytest.approx(0.5) and sum(shares.values()) == pytest.approx(1.0)
    sampled = harness.summarize(
        [harness.WorkloadRuns(Workload("w", "src", []), prompts)], Settings(temperature=0.7)
    )
    assert sampled["w"]["methods"]["dart"]["greedy_equal_ar"] is None


def test_divergences_are_checked_against_the_target_and_reported() -> None:
    """check_divergences measures the target's margin where a greedy output leaves AR's;
    the summary keeps it and the report says whether every one is a near-tie."""
    from dart_client.apps.bench import report

    target = make_tiny_target("llama", seed=7)
    prompt = [5, 9, 11, 40]
    want = DartModel(target).generate(input_ids=prompt, mode="ar", max_new_tokens=6).tokens
    import torch

    with torch.no_grad():
        logits = target(torch.tensor([prompt + want[:2]])).logits[0, -1]
    second = int(torch.topk(logits, 2).indices[1])
    got = [*want[:2], second, *want[3:]]
    prompts = [
        PromptRuns(
            Prompt("p0", prompt, ""),
            {"ar": [Run(want, 1.0, [], {}, [])], "dart": [Run(got, 1.0, [1], {}, [1])]},
        )
    ]
    results = [harness.WorkloadRuns(Workload("w", "src", []), prompts)]
    harness.check_divergences(results, target)
    assert set(prompts[0].divergences) == {"dart"}
    summary = harness.summarize(results, Settings())
    (found,) = summary["w"]["methods"]["dart"]["greedy_divergences"]
    assert found["token"] == 2 and found["margin"] > found["threshold"] and not found["near_tie"]
    assert summary["w"]["methods"]["ar"]["greedy_divergences"] == []
    text = report._ties([found])
    assert "1 NOT at a near-tie (token 2" in text
    assert "each at a near-tie" in report._ties([{**found, "near_tie": True}])


# -- the whole benchmark on a tiny model ---------------------------------------------------------


def test_benchmark_end_to_end(tiny_model: DartModel, tmp_path: Path, capsys: Any) -> None:
    prompts = tmp_path / "tiny.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p}) for p in ("w5 w9 w17 w5 w9", "w40 w41", "w7 w7 w7"))
    )
    out = tmp_path / "out"
    args = parser().parse_args(
        [
            "--workloads", str(prompts),
            "--max-new-tokens", "12",
            "--max-prompts", "2",
            "--calibration-prompts", "1",
            "--repetitions", "2",
            "--tree-budget", "auto",
            "--remote", "auto",
            "--compare-budgets", "5",
            "--output-dir", str(out),
            "--no-progress",
        ]
    )  # fmt: skip
    assert run(args, model=tiny_model) == 0
    record = json.loads((out / "results.json").read_text())
    methods = record["workloads"]["tiny"]["methods"]
    expected = set(harness.METHODS) - {"eagle3", "eagle3-auto"}  # they need their own head
    if local_daemon.dart_ngram_binary() is None:
        expected.discard("dart-remote")
        assert any("dart-remote: skipped" in n for n in record["notes"])
    expected.add("dart@5")
    # A binary that is present must serve (a stale one, older than the model format, fails).
    assert set(methods) == expected, record["notes"]
    assert methods["dart@5"]["mean_tree_nodes"] <= 6
    for name, m in methods.items():
        # float64: every greedy method reproduces autoregressive decoding exactly.
        assert m["greedy_equal_ar"] == 2, name
        assert m["tokens"] > 0 and m["tokens_per_s"] > 0 and m["speedup"] > 0
    for name in expected - {"ar", "hf", "pld"}:
        assert methods[name]["tau"] >= 1.0
        assert sum(methods[name]["accept_histogram"].values()) > 0
        assert sum(methods[name]["stage_share"].values()) == pytest.approx(1.0)
        if "@" not in name:
            best = record["tree_budget_tuning"]["best_budget"]
            assert methods[name]["mean_tree_nodes"] <= best + 1
    assert methods["ar"]["speedup"] == 1.0
    assert record["settings"]["repetitions"] == 2
    assert record["environment"]["dtype"] == "float64"
    assert record["environment"]["tree_budget"].startswith("auto -> ")
    # Two prompts measured; the tuner calibrated on the third, which no method ran.
    assert len(record["per_prompt"]["tiny"]) == 2
    assert record["tree_budget_tuning"]["calibration_prompts"] == 1
    assert any("tuned on 1 prompts that are not measured" in n for n in record["notes"])
    md = (out / "results.md").read_text()
    assert "| dart |" in md and "## Tree budget (auto)" in md and "2/2" in md
    assert md in capsys.readouterr().out
    for name in ("speedup", "time_breakdown", "tau_histogram", "tree_budget"):
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_eagle3_method_end_to_end(tiny_model: DartModel, tmp_path: Path) -> None:
    """``--methods eagle3``: EAGLE-3's drafter on the same target, at its own budget and at a
    compared one, with tau, the draft cost per step and greedy equality in the report."""
    prompts = tmp_path / "tiny.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("w5 w9 w17", "w40 w41")))
    out = tmp_path / "out"
    args = parser().parse_args(
        [
            "--workloads", str(prompts),
            "--methods", "ar", "eagle3", "eagle3-auto",
            "--eagle3-head", "random",
            "--eagle3-top-k", "3",
            "--eagle3-depth", "2",
            "--eagle3-total-tokens", "8",
            "--max-new-tokens", "10",
            "--repetitions", "1",
            "--compare-budgets", "4",
            "--output-dir", str(out),
            "--no-progress",
        ]
    )  # fmt: skip
    assert run(args, model=tiny_model) == 0
    record = json.loads((out / "results.json").read_text())
    methods = record["workloads"]["tiny"]["methods"]
    # A compared budget runs both drafters at it, side by side.
    assert set(methods) == {"ar", "eagle3", "eagle3-auto", "eagle3@4", "dart@4"}
    assert methods["dart@4"]["greedy_equal_ar"] == 2
    assert any("EAGLE-3 head: an untrained random" in n for n in record["notes"])
    for name in ("eagle3", "eagle3-auto", "eagle3@4"):
        assert methods[name]["greedy_equal_ar"] == 2, name
        assert methods[name]["tau"] >= 1.0 and methods[name]["draft_ms_per_step"] > 0
        assert methods[name]["stage_share"]["prune"] == 0.0  # its tree is draft forwards
    # Trees of at most 8 nodes (7 + the root), or 5 at budget 4; fewer near the length cap.
    assert methods["eagle3"]["mean_tree_nodes"] <= 8
    assert methods["eagle3@4"]["mean_tree_nodes"] <= 5
    assert methods["eagle3@4"]["mean_tree_nodes"] < methods["eagle3"]["mean_tree_nodes"]
    # eagle3-auto decodes with the tree its tuning measured fastest.
    tuning = record["eagle3_tree_tuning"]
    assert len(tuning["curve"]) == len(DEFAULT_EAGLE3_GRID)
    fastest = max(tuning["curve"], key=lambda p: p["tokens_per_s"])
    assert tuning["best"] == [fastest["top_k"], fastest["depth"], fastest["total_tokens"]]
    assert methods["eagle3-auto"]["mean_tree_nodes"] <= fastest["total_tokens"]
    assert f"depth {fastest['depth']}" in record["methods"]["eagle3-auto"]
    md = (out / "results.md").read_text()
    assert "| eagle3@4 |" in md and "## EAGLE-3 tree (eagle3-auto)" in md


def test_split_calibration_never_hands_the_tuner_a_measured_prompt() -> None:
    def workload(name: str, n: int) -> Workload:
        return Workload(name, "src", [Prompt(f"{name}{i}", [i, i + 1], "") for i in range(n)])

    kept, calibration = harness.split_calibration([workload("a", 5), workload("b", 2)], 3)
    assert [[p.id for p in w.prompts] for w in kept] == [["a0", "a1", "a2"], ["b0", "b1"]]
    assert calibration == [[3, 4], [4, 5]]  # a3 and a4; b has none left over
    assert harness.split_calibration([workload("a", 2)], 2)[1] == []


def test_methods_validation(tiny_model: DartModel) -> None:
    with pytest.raises(BenchError, match="must include 'ar'"):
        harness.build_methods(tiny_model, ["dart"])
    with pytest.raises(BenchError, match="unknown methods"):
        harness.build_methods(tiny_model, ["ar", "eagle"])
    notes: list[str] = []
    ms = harness.build_methods(tiny_model, ["ar", "dart-remote"], notes=notes)
    assert [m.name for m in ms] == ["ar"] and "pass --remote auto" in notes[0]
    tuned: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DartModel, "tune", lambda self, **kw: tuned.append(kw))
        ms = harness.build_methods(tiny_model, ["ar", "hf"], tree_budget="auto")
        assert [m.name for m in ms] == ["ar", "hf"] and tuned == []  # no DART: nothing to tune
        harness.build_methods(tiny_model, ["ar", "dart"], tree_budget="auto")
        assert len(tuned) == 1
    ar_only = DartModel(tiny_model.target, tokenizer=tiny_model.tokenizer)
    notes = []
    ms = harness.build_methods(ar_only, ["ar", "dart"], notes=notes)
    assert [m.name for m in ms] == ["ar"] and "no DART head" in notes[0]
    bad = argparse.Namespace(**{**vars(parser().parse_args([])), "repetitions": 0})
    with pytest.raises(BenchError, match="--repetitions must be >= 1"):
        run(bad, model=tiny_model)


def test_dart_cli_subcommands(capsys: Any) -> None:
    from dart_client.apps.cli import main

    for argv, text in (
        (["bench", "--help"], "--tree-budget"),
        (["demo", "--ui", "--help"], "--port"),
    ):
        assert main(argv) == 0
        assert text in capsys.readouterr().out
    assert main(["generate", "--tree-budget", "lots", "hi"]) == 2
    assert "expected an integer >= 0 or 'auto'" in capsys.readouterr().err


def test_the_batched_benchmark_runs_from_its_command_line(
    tiny_ngram_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line's own path: its options reach the loader (it once crashed there)."""
    from dart_client.apps.bench import batched

    model_dir = tmp_path / "tiny-model"
    make_tiny_target("llama", seed=0).save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "tiny.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("w5 w9 w17", "w40 w41")))
    argv = [
        "--base", str(model_dir),
        "--head", "random",
        "--ngram", str(tiny_ngram_path),
        "--ngram-open", "no-checksums",
        "--dtype", "fp32",
        "--workloads", str(prompts),
        "--batch", "2",
        "--groups", "1",
        "--max-new-tokens", "4",
        "--repetitions", "1",
        "--methods", "ar-x1", "ar-xN", "dart-xN",
    ]  # fmt: skip
    assert batched.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["tokens_per_second"]) == {"ar-x1", "ar-x2", "dart-x2"}
    assert summary["identical_to_alone"] == {"ar-x2": "2/2", "dart-x2": "2/2"}
    # Where a batched step's time went: DART drafts and prunes, AR does neither.
    stages = summary["stage_ms_per_step"]
    assert {"draft", "prune", "verify"} <= set(stages["dart-x2"])
    assert "prune" not in stages["ar-x2"] and stages["ar-x2"]["verify"] > 0
    assert all(v > 0 for v in summary["prefill_ms_per_prompt"].values())


def test_batched_benchmark_on_a_tiny_model(tiny_model: DartModel, tmp_path: Path) -> None:
    from dart_client.apps.bench import batched

    prompts = tmp_path / "tiny.jsonl"
    texts = ("w5 w9 w17 w5 w9", "w40 w41", "w7 w7 w7", "w8 w30 w8", "w11", "w3 w4 w5 w6")
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in texts))
    out = tmp_path / "batched.json"
    args = batched.parser().parse_args(
        [
            "--workloads", str(prompts),
            "--batch", "2",
            "--groups", "2",
            "--max-new-tokens", "10",
            "--repetitions", "2",
            "--batch-tree-budget", "auto",
            "--clock", "thread",
            "--continuous",
            "--admission", "together",
            "--output", str(out),
        ]
    )  # fmt: skip
    assert batched.run(args, model=tiny_model) == 0
    summary = json.loads(out.read_text())["summary"]
    rates = summary["tokens_per_second"]
    assert set(rates) == {"dart-x1", "ar-x1", "ar-x2", "dart-x2"}
    assert all(r > 0 for r in rates.values())
    # float64: the batched greedy outputs equal each prompt decoded alone.
    assert summary["identical_to_alone"] == {"ar-x2": "4/4", "dart-x2": "4/4"}
    assert summary["greedy_divergences"] == {"ar-x2": [], "dart-x2": []}
    tuning = summary["batch_budget_tuning"]
    assert tuning["batch"] == 2 and summary["batch_tree_budget"] == tuning["best_budget"]
    assert summary["dart-x2 over dart-x1"] > 0 and summary["clock"] == "thread"
    assert summary["continuous"] and len(json.loads(out.read_text())["groups"]) == 1
    assert summary["admission"] == "together"


def test_the_batched_benchmark_weighs_each_divergence_against_the_targets_margin(
    tiny_model: DartModel,
) -> None:
    """A batched output that leaves the lone one is reported with the target's top-2 margin
    where it does: in float64 a changed token is no near-tie (a bug, not rounding)."""
    from types import SimpleNamespace

    from dart_client.apps.bench.batched import divergences

    prompt = [5, 9, 17, 5, 9]
    want = tiny_model.generate(input_ids=prompt, max_new_tokens=6).tokens
    changed = [*want[:3], (want[3] + 1) % 300 + 3, *want[4:]]
    alone = [SimpleNamespace(tokens=want)] * 2
    batched = [SimpleNamespace(tokens=want), SimpleNamespace(tokens=changed)]
    same, found = divergences(tiny_model.target.model, [prompt, prompt], alone, batched)
    assert same == 1 and len(found) == 1
    (d,) = found
    assert d["token"] == 3 and not d["near_tie"] and d["margin"] > d["threshold"]


def test_the_batched_benchmark_runs_every_answer_past_eos_when_asked(
    tiny_ngram_path: Path, tmp_path: Path
) -> None:
    """``--ignore-eos``: each answer runs to ``--max-new-tokens`` (fixed lengths, as vLLM's
    benchmark); without it an answer ends at EOS (here the token the target picks second)."""
    from dart_client.apps.bench import batched, harness
    from dart_client.ngram import NGram

    prompts = tmp_path / "tiny.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("w5 w9 w17", "w40 w41")))
    target = make_tiny_target("llama", seed=1)
    head = DartHead.random_init(target.config, draft_length=3, seed=2).double()

    def model() -> DartModel:
        ngram = NGram.open(str(tiny_ngram_path))
        return DartModel(target, head, tokenizer=make_tiny_tokenizer(), ngram=ngram)

    (workload,) = harness.load_workloads([str(prompts)], model(), 2, 512)
    first = model().generate(input_ids=workload.prompts[0].ids, max_new_tokens=3, mode="ar")
    target.generation_config.eos_token_id = first.tokens[1]
    tokens = {}
    for flag in ([], ["--ignore-eos"]):
        out = tmp_path / f"batched{len(flag)}.json"
        args = batched.parser().parse_args(
            [
                "--workloads", str(prompts), "--batch", "2", "--groups", "1",
                "--max-new-tokens", "12", "--repetitions", "1", "--tree-budget", "3",
                "--batch-tree-budget", "3", "--methods", "ar-x1", "ar-xN", "dart-xN",
                "--output", str(out), *flag,
            ]
        )  # fmt: skip
        assert batched.run(args, model=model()) == 0
        (group,) = json.loads(out.read_text())["groups"]
        tokens[bool(flag)] = {m: group[m]["tokens"] for m in ("ar-x1", "ar-xN", "dart-xN")}
        assert json.loads(out.read_text())["summary"]["ignore_eos"] == bool(flag)
    assert tokens[True] == {"ar-x1": 24, "ar-xN": 24, "dart-xN": 24}
    assert all(n < 24 for n in tokens[False].values())
