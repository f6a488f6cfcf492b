"""The ``dart`` command line as users meet it: usage errors exit 2 before any model loads,
user errors (native ones included) print one line and exit 1, an empty prompt is refused,
Ctrl-C keeps what was generated and exits 130; and DartModel refuses an n-gram built for
another tokenizer."""

from __future__ import annotations

import io
import json
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
        ["--template", "nonesuch", "--ar"],
        ["--prompt-lookup", "-3", "--ar"],
        ["--device", "bogus", "--ar"],
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
