"""HumanEval-style prompts cut from Python sources (dart_client.data.code_prompts)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dart_client.data.code_prompts import extract_code_tasks, main
from dart_client.data.conversations import ReadReport
from dart_client.data.prompt_response import HUMANEVAL_INSTRUCTION, read_conversations

MODULE = textwrap.dedent(
    '''\
    import math


    @staticmethod
    def documented(x: int,
                   y: int = 2) -> int:
        """Adds two numbers and squares the sum; a docstring long enough to keep.

        >>> documented(1)
        9
        """
        total = x + y
        return total * total


    def undocumented(x):
        return x


    def short_doc(x):
        """Too short."""
        return x


    def doc_only():
        """A docstring with no body after it is no function to complete, so it is skipped."""


    class Holder:
        def method(self):
            """Methods are not module-level functions and are left out of the tasks too."""
            return 1
    '''
)


def test_keeps_documented_module_level_functions_split_at_the_docstring(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(MODULE)
    tasks = list(extract_code_tasks([tmp_path]))
    assert [t.id for t in tasks] == ["pkg/mod.py:documented"]
    task = tasks[0]
    # The decorator is left out; the signature spans its two lines; the split is exact.
    assert task.prompt.startswith("def documented(x: int,\n               y: int = 2) -> int:\n")
    assert task.prompt.rstrip().endswith('"""')
    assert task.body == "    total = x + y\n    return total * total\n"
    assert task.prompt + task.body in MODULE


def test_excluded_directories_duplicates_and_unparsable_files(tmp_path: Path) -> None:
    for sub in ("a", "b", "tests", "site-packages/x"):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "m.py").write_text(MODULE)
    (tmp_path / "a" / "broken.py").write_text("def f(:\n")
    (tmp_path / "a" / "latin.py").write_bytes(b"x = '\xff'\n")
    tasks = list(extract_code_tasks([tmp_path]))
    assert [t.id for t in tasks] == ["a/m.py:documented"]  # b's copy is a duplicate
    everything = list(extract_code_tasks([tmp_path / "tests" / "m.py"], exclude_dirs=()))
    assert len(everything) == 1
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(extract_code_tasks([tmp_path / "missing"]))


def test_written_file_reads_back_as_humaneval_style_conversations(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(MODULE)
    out = tmp_path / "out" / "code.jsonl"
    assert main(["--source", str(tmp_path / "mod.py"), "--output", str(out)]) == 0
    record = json.loads(out.read_text().splitlines()[0])
    report = ReadReport(str(out))
    (conv,) = list(read_conversations(out, report))
    assert report.kept == 1 and conv.id == record["id"] == "mod.py:documented"
    user, assistant = conv.turns
    assert user.role == "user" and assistant.role == "assistant"
    prompt = record["prompt"]
    assert user.content == prompt
    assert prompt == HUMANEVAL_INSTRUCTION.format(prompt=prompt.split("```python\n", 1)[1][:-3])
    assert assistant.content.startswith("```python\ndef documented(")
    assert assistant.content.endswith("return total * total\n```")
