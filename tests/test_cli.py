"""The ``dart`` command line as users meet it: usage errors exit 2 before any model loads,
user errors (native ones included) print one line and exit 1, an empty prompt is refused,
Ctrl-C keeps what was generated and exits 130; and DartModel refuses an n-gram built for
another tokenizer."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_EOS, TINY_VOCAB, make_tiny_target, make_tiny_tokenizer

from dart_client import DartModel
from dart_client.apps.cli import INTERRUPTED, main
from dart_client.errors import IncompatibleNGramError
from dart_client.models.head import DartHead
from dart_client.ngram import NGram
from dart_client.ngram.build import build


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + its word-level tokenizer: a real transformers model directory."""
    root = tmp_path_factory.mktemp("tiny-model")
    make_tiny_target("llama", seed=0).save_pretrained(root)
    make_tiny_tokenizer().save_pretrained(root)
    return root


def _one_line_error(err: str, fragment: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and fragment in lines[-1], err
    assert "Traceback" not in err, err


def test_bad_arguments_exit_2_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # tmp_path is no model: loading it first would fail with exit 1, not 2.
    cases = [
        ["--temperature", "-1", "--ar"],
        ["--top-p", "0", "--ar"],
        ["--max-new-tokens", "0", "--ar"],
        ["--tree-budget", "lots", "--ar"],
        ["--static", "sometimes", "--ar"],
        ["--template", "nonesuch", "--ar"],
        ["--prompt-lookup", "-3", "--ar"],
        ["--device", "bogus", "--ar"],
        ["--ngram-open", "prefetch,nonesuch", "--ar"],
        ["--head", "random", "--ngram-server", "localhost:1", "--ngram-open", "prefetch"],
        [],  # neither --head/--ngram nor --ar
    ]
    for extra in cases:
        assert main(["generate", "--base", str(tmp_path), *extra, "hello"]) == 2, extra
        err = capsys.readouterr().err
        assert "usage:" in err and "not a model" not in err, (extra, err)


def test_non_model_directory_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["generate", "--base", str(tmp_path), "--ar", "hello"]) == 1
    _one_line_error(capsys.readouterr().err, f"{tmp_path}: not a model directory")


def test_empty_prompt_is_refused(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--base", str(tiny_dir), "--dtype", "fp32", "--ar", "--raw"]
    assert main([*argv, "   "]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("\n\n"))
    assert main(argv) == 2
    assert "prompt is empty (read from stdin)" in capsys.readouterr().err


def test_corrupt_ngram_is_one_line_exit_1(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt = tmp_path / "bad.ngram"
    corrupt.write_bytes(b"DARTNGRM" + bytes(range(256)) * 4)
    argv = ["generate", "--base", str(tiny_dir), "--dtype", "fp32", "--head", "random",
            "--ngram", str(corrupt), "--raw", "w5 w6"]  # fmt: skip
    assert main(argv) == 1
    _one_line_error(capsys.readouterr().err, str(corrupt))


def test_ctrl_c_keeps_the_tokens_so_far(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C arrives after the third step of a real generation (injected there, so the test
    does not race a timer): the text of those steps is printed, the exit status is 130."""
    real_generate = DartModel.generate
    seen: list[str] = []

    def interrupted_after_three_steps(self: DartModel, *args: Any, **kwargs: Any) -> Any:
        stream = real_generate(self, *args, **kwargs)

        def events() -> Any:
            for i, event in enumerate(stream):
                seen.append(event.text)
                yield event
                if i == 2:
                    raise KeyboardInterrupt

        return events()

    monkeypatch.setattr(DartModel, "generate", interrupted_after_three_steps)
    argv = ["generate", "--base", str(tiny_dir), "--dtype", "fp32", "--ar", "--raw",
            "--max-new-tokens", "50", "w5 w17 w200"]  # fmt: skip
    assert main(argv) == INTERRUPTED
    out, err = capsys.readouterr()
    so_far = "".join(seen)
    assert so_far.strip() and out.strip() == so_far.strip()
    assert "interrupted" in err


def test_generate_prints_json(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--base", str(tiny_dir), "--dtype", "fp32", "--ar", "--raw",
            "--max-new-tokens", "5", "--json", "w5 w17 w200"]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["tokens"]) <= 5 and record["finish_reason"] in ("eos", "length")
    # --static on (the cuda default, chosen here on the CPU) decodes the same tokens.
    assert main([*argv[:-1], "--static", "on", argv[-1]]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == record["tokens"]
    # --logprobs: the same tokens, each with its log probability and alternatives (greedy:
    # the token is its own likeliest), as JSON or as a table on stderr.
    assert main([*argv[:-1], "--logprobs", "2", argv[-1]]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["tokens"] == record["tokens"]
    assert [lp["token"] for lp in scored["logprobs"]] == record["tokens"]
    for lp in scored["logprobs"]:
        assert len(lp["top"]) == 2 and lp["top"][0] == [lp["token"], lp["logprob"]]
    plain = [a for a in argv if a != "--json"]
    assert main([*plain[:-1], "--logprobs", "0", plain[-1]]) == 0
    err = capsys.readouterr().err
    assert sum("%)" in line for line in err.splitlines()) == len(record["tokens"])
    assert main([*argv[:-1], "--logprobs", "21", argv[-1]]) == 2  # a usage error
    assert "logprobs" in capsys.readouterr().err
    # --min-tokens reaches the generation (checked against --max-new-tokens there).
    assert main([*argv[:-1], "--min-tokens", "6", argv[-1]]) == 2
    assert "min_tokens = 6 is more than max_new_tokens = 5" in capsys.readouterr().err
    assert main([*argv[:-1], "--min-tokens", "5", argv[-1]]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 5


# ---- the n-gram's tokenizer ------------------------------------------------------------------


def _text_ngram(root: Path, tokenizer: Any, name: str) -> Path:
    """A real 2-gram over a few word documents, built with ``tokenizer``'s tokenizer.json."""
    tok_dir = root / f"{name}-tokenizer"
    tokenizer.save_pretrained(tok_dir)
    docs = root / f"{name}.jsonl"
    docs.write_text(
        "\n".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2}"}) for i in range(3, 300)) + "\n"
    )
    out = root / f"{name}.ngram"
    build([str(docs)], str(out), tokenizer=str(tok_dir / "tokenizer.json"), order=2,
          eos_id=TINY_EOS)  # fmt: skip
    return out


def _renamed_tokenizer() -> Any:
    """The tiny tokenizer with two words swapped: same size, other token -> id map."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    vocab.update({f"w{i}": i for i in range(3, TINY_VOCAB)})
    vocab["w3"], vocab["w4"] = 4, 3
    tk = Tokenizer(WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


def test_ngram_of_another_tokenizer_is_refused(tmp_path: Path) -> None:
    target = make_tiny_target("llama", layers=4)
    head = DartHead.random_init(target.config, draft_length=2, seed=1).double()
    tokenizer = make_tiny_tokenizer()
    own = NGram.open(str(_text_ngram(tmp_path, tokenizer, "own")))
    other = NGram.open(str(_text_ngram(tmp_path, _renamed_tokenizer(), "other")))
    assert own.fingerprint != other.fingerprint

    DartModel(target, head, tokenizer=tokenizer, ngram=own)  # its own tokenizer: accepted
    with pytest.raises(IncompatibleNGramError, match="built with tokenizer") as exc:
        DartModel(target, head, tokenizer=tokenizer, ngram=other)
    assert str(other.path) in str(exc.value) and "check_tokenizer=False" in str(exc.value)
    # Experts may override.
    DartModel(target, head, tokenizer=tokenizer, ngram=other, check_tokenizer=False)


def test_ngram_with_a_larger_vocabulary_is_refused(tmp_path: Path) -> None:
    target = make_tiny_target("llama", layers=4)
    head = DartHead.random_init(target.config, draft_length=2, seed=1).double()
    docs = tmp_path / "ids.jsonl"
    docs.write_text(json.dumps({"ids": [5, 6, 7, 5, 6]}) + "\n")
    path = tmp_path / "big.ngram"
    build([str(docs)], str(path), order=2, vocab_size=TINY_VOCAB * 4, eos_id=TINY_EOS)
    with pytest.raises(IncompatibleNGramError, match=f"more than the target's {TINY_VOCAB}"):
        DartModel(target, head, ngram=NGram.open(str(path)))


# ---- the front door: fast help, defaults, checks before loading --------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
        check=False,
    )


def test_the_command_line_imports_no_torch() -> None:
    """``dart --help``, ``dart --version`` and every ``dart SUB --help`` answer without
    importing torch or transformers (they take seconds to import): checked in a fresh
    interpreter, by what is in sys.modules afterwards."""
    code = (
        "import sys, contextlib, io\n"
        "from dart_client.apps.cli import main, SUBCOMMANDS\n"
        "assert 'torch' not in sys.modules, 'import'\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0 and main(['--version']) == 0\n"
        "    for name in SUBCOMMANDS:\n"
        "        assert main([name, '--help']) == 0, name\n"
        "        assert 'torch' not in sys.modules, name\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    # The public API still imports from the package root (loaded on first use).
    done = _python(
        "from dart_client import DartModel, GenerationConfig, dart_generate, ar_generate\n"
        "import dart_client; print(DartModel.__name__, 'DartModel' in dir(dart_client))"
    )
    assert done.returncode == 0 and done.stdout.split() == ["DartModel", "True"], done.stderr


def test_version_and_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    from dart_client import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dart {__version__}"
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dart demo") and "--ui" in out and "side-by-side" in out


def test_paths_and_defaults_are_checked_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad paths are usage errors (exit 2) found before anything loads; so is --head auto
    (the default) with a target it was not trained for, and a missing --ngram there."""
    missing = str(tmp_path / "nowhere")
    cases = {
        ("--base", f"{missing}.gguf"): "target file not found",
        ("--base", missing): "neither a local path nor a hub id",
        ("--head", missing): "no such head",
        ("--ngram", f"{missing}.ngram"): "n-gram model file not found",
        ("--base", str(tmp_path)): "--head auto: a head is shipped for the embedded target",
        ("--base", str(tmp_path), "--head", "random"): "pass --ngram PATH",
    }
    for extra, fragment in cases.items():
        assert main(["generate", *extra, "hello"]) == 2, extra
        err = capsys.readouterr().err
        assert "usage:" in err and fragment in err, (extra, err)


def test_unreachable_hub_id_is_one_line() -> None:
    """A hub id that cannot be fetched (here: offline) fails with one line and exit 1."""
    done = _python(
        "import sys\nfrom dart_client.apps.cli import main\n"
        "sys.exit(main(['generate', '--base', 'no-such-owner/no-such-model', '--ar', 'hi']))",
        HF_HUB_OFFLINE="1",
    )
    assert done.returncode == 1, done.stderr
    _one_line_error(done.stderr, "no-such-owner/no-such-model: not a local path, and loading")


@pytest.fixture
def tunings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """Every tree-budget tuning run from now on, by its keyword arguments (the real one runs);
    the tuning cache in ``tmp_path / "cache"``."""
    import dart_client.decoding.autotune as autotune

    monkeypatch.setenv("DART_CACHE", str(tmp_path / "cache"))
    calls: list[dict[str, Any]] = []
    real = autotune.autotune

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(autotune, "autotune", recorded)
    return calls


def test_auto_tree_budget_is_tuned_once_and_cached(
    tiny_dir: Path,
    tiny_ngram_path: Path,
    tunings: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    one_thread: None,
) -> None:
    """The default --tree-budget auto tunes at the first start and reads the cached result
    at the next: the same budget, no second tuning."""
    argv = ["generate", "--base", str(tiny_dir), "--dtype", "fp32", "--head", "random",
            "--ngram", str(tiny_ngram_path), "--raw", "--max-new-tokens", "4", "--json",
            "w5 w17 w200"]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "tuned in" in first.err and len(tunings) == 1, first.err
    assert len(list((tmp_path / "cache" / "tuning").glob("*.json"))) == 1
    assert main(argv) == 0
    second = capsys.readouterr()
    assert "tuned earlier" in second.err and len(tunings) == 1, second.err
    budget = re.search(r"tree budget (\d+),", first.err)
    assert budget and f"tree budget {budget.group(1)}," in second.err
    assert json.loads(second.out)["tokens"] == json.loads(first.out)["tokens"]


def test_tune_prompts_calibrate_the_auto_budget_and_key_its_cache(
    tiny_dir: Path,
    tiny_ngram_path: Path,
    tunings: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    one_thread: None,
) -> None:
    """--tune-prompts FILE: the tuner calibrates on the file's prompts (JSON strings or
    {"prompt": ...} lines), and its cache entry is apart from the built-in prompts' one; a bad
    file is a one-line error naming the file and line, before any tuning."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"w5 w17 w200"\n\n{"prompt": "w9 w31", "source": "log"}\n')
    argv = ["generate", "--base", str(tiny_dir), "--dtype", "fp32", "--head", "random",
            "--ngram", str(tiny_ngram_path), "--raw", "--max-new-tokens", "4",
            "w5 w17"]  # fmt: skip
    assert main([*argv, "--tune-prompts", str(prompts)]) == 0
    assert [t.get("prompts") for t in tunings] == [["w5 w17 w200", "w9 w31"]], tunings
    assert "tuned in" in capsys.readouterr().err
    assert main(argv) == 0  # built-in prompts: another cache entry, tuned anew
    assert len(tunings) == 2 and tunings[1].get("prompts") is None
    assert len(list((tmp_path / "cache" / "tuning").glob("*.json"))) == 2
    capsys.readouterr()
    for text, fragment in [
        ('"w5"\n{"text": "w9"}\n', "prompts.jsonl:2: expected a non-empty JSON string"),
        ('"w5"\nw9\n', "prompts.jsonl:2: not JSON"),
        ("\n", "prompts.jsonl: no prompts"),
    ]:
        prompts.write_text(text)
        assert main([*argv, "--tune-prompts", str(prompts)]) == 1
        _one_line_error(capsys.readouterr().err, fragment)
    assert main([*argv, "--tune-prompts", str(tmp_path / "absent.jsonl")]) == 1
    _one_line_error(capsys.readouterr().err, "absent.jsonl: cannot read")
    assert len(tunings) == 2


def test_ngram_open_options_reach_the_model(
    tiny_dir: Path, tiny_ngram_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ngram-open no-checksums opens a model whose large section is damaged (the default
    refuses it by its checksum); prefetch decodes the same tokens."""
    damaged = tmp_path / "damaged.ngram"
    data = bytearray(tiny_ngram_path.read_bytes())
    tokens = next(
        s
        for s in NGram.open(str(tiny_ngram_path)).info()["sections"]
        if s["kind"] == "tokens" and s["order"] == 3
    )
    # The last byte of the section: a position padding may occupy, so every node stays valid.
    data[tokens["offset"] + tokens["length"] - 1] ^= 0x80
    damaged.write_bytes(bytes(data))
    argv = ["generate", "--base", str(tiny_dir), "--dtype", "fp32", "--head", "random",
            "--tree-budget", "8", "--raw", "--max-new-tokens", "6", "--json",
            "w5 w17 w200"]  # fmt: skip
    assert main([*argv[:-1], "--ngram", str(damaged), argv[-1]]) == 1
    _one_line_error(capsys.readouterr().err, "fails its checksum")
    assert main([*argv[:-1], "--ngram", str(tiny_ngram_path), argv[-1]]) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    opened = ["--ngram", str(tiny_ngram_path), "--ngram-open", "prefetch,no-checksums"]
    assert main([*argv[:-1], *opened, argv[-1]]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == plain
    assert main([*argv[:-1], "--ngram", str(damaged), "--ngram-open", "no-checksums",
                 argv[-1]]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["tokens"] == plain  # lossless whatever the drafts


# ---- dart chat: the conversation's caches between turns ---------------------------------------


@pytest.mark.parametrize("mode", ["dart", "ar"])
def test_prefix_cache_prefills_only_the_new_turn(
    tiny_ngram_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """A conversation's next turn reuses the caches of the previous one (only the new tokens
    are prefilled) and generates exactly what a fresh full prefill does (fp32, greedy), the
    head drafting the same rows from its reused cache; a prompt that parts from the cached
    tokens midway reuses only the shared part."""
    import numpy as np
    import torch

    import dart_client.decoding.loop as loop
    from dart_client.decoding.loop import PrefixCache

    drafts: list[Any] = []
    real_draft_rows = loop.draft_rows

    def recorded(*args: Any, **kwargs: Any) -> Any:
        rows = real_draft_rows(*args, **kwargs)
        drafts.append(rows.ids.copy())
        return rows

    monkeypatch.setattr(loop, "draft_rows", recorded)

    target = make_tiny_target("llama", dtype=torch.float32, seed=3)
    head = DartHead.random_init(target.config, draft_length=2, seed=1)
    model = DartModel(target, head, ngram=NGram.open(str(tiny_ngram_path)), tree_budget=8)
    kept = PrefixCache()
    turn, shared = [1, 5, 17, 200, 33, 41, 9], 0
    for n in range(3):
        drafts.clear()
        kept_result = model.generate(turn, mode=mode, max_new_tokens=10, prefix_cache=kept)
        kept_drafts = list(drafts)
        drafts.clear()
        fresh = model.generate(turn, mode=mode, max_new_tokens=10)
        assert kept_result.tokens == fresh.tokens, n
        assert len(kept_drafts) == len(drafts) and bool(drafts) == (mode == "dart")
        for a, b in zip(kept_drafts, drafts, strict=True):  # the head read the same states
            assert np.array_equal(a, b), n
        if n == 0:
            assert kept.reused == 0
        else:  # everything cached but the last shared token, whose taps the head reads again
            assert kept.reused == shared - 1, (n, kept.reused, shared)
        assert kept.tokens == (turn + kept_result.tokens)[: len(kept.tokens)]
        history = turn + kept_result.tokens
        if n == 0:  # the next turn: the whole history and a new message
            turn, shared = [*history, 11, 12, 13], len(kept.tokens)
        else:  # an edited history: parts from the cached tokens after 4 tokens
            turn, shared = [*history[:4], 77, 78, 79], 4
    kept.reset()
    model.generate(turn, mode=mode, max_new_tokens=3, prefix_cache=kept)
    assert kept.reused == 0


def test_chat_reads_turns_from_stdin(
    tiny_dir: Path,
    tiny_ngram_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    one_thread: None,
) -> None:
    """Driven through stdin: an empty line does not quit, a trailing backslash continues the
    message, /paste takes lines up to '.', /reset starts over (nothing reused), the second
    turn of a conversation reuses the first's caches, /exit quits (later lines unread)."""
    script = "w5 w6 \\\nw7\n\n/reset\nw9 w10\n/paste\nw11\nw12\n.\n/exit\nw99 w98\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    seen: list[str] = []
    real_generate = DartModel.generate

    def recorded(self: DartModel, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(prompt)
        return real_generate(self, prompt, *args, **kwargs)

    monkeypatch.setattr(DartModel, "generate", recorded)
    argv = ["chat", "--base", str(tiny_dir), "--dtype", "fp32", "--head", "random",
            "--ngram", str(tiny_ngram_path), "--template", "chatml", "--tree-budget", "8",
            "--max-new-tokens", "6", "--stats"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert len(seen) == 3, seen
    assert "w5 w6 \nw7<|im_end|>" in seen[0]
    assert "w9 w10<|im_end|>" in seen[1] and "w5" not in seen[1]  # after /reset
    assert seen[2].startswith(seen[1][: seen[1].rindex("<|im_start|>assistant")])
    assert "w11\nw12<|im_end|>" in seen[2] and "w99" not in "".join(seen)
    assert "(new conversation)" in err
    reused = [int(n) for n in re.findall(r"(\d+) cached prompt tokens reused", err)]
    assert reused[:2] == [0, 0] and reused[2] > 0, err
