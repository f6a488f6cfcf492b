"""Plain prompt/response JSON lines, and one entry point that reads any supported format.

A prompt/response line is ``{"prompt": str, "response": str}`` with optional ``id`` and
``system``; it becomes a two- (or three-) turn :class:`Conversation`. Lines that are
conversations (``conversations``/``messages``) are read by :func:`read_sharegpt`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from dart_client.data.conversations import Conversation, ReadReport, Turn, read_sharegpt
from dart_client.errors import DartError


class CorpusFormatError(DartError):
    """A corpus file is in no format the readers know."""


def _prompt_response(record: object, line_no: int, report: ReadReport) -> Conversation | None:
    if not isinstance(record, dict):
        report.skip("not an object")
        return None
    prompt, response = record.get("prompt"), record.get("response")
    if not isinstance(prompt, str) or not isinstance(response, str):
        report.skip("prompt/response not both strings")
        return None
    turns: list[Turn] = []
    system = record.get("system")
    if isinstance(system, str) and system:
        turns.append(Turn("system", system))
    turns += [Turn("user", prompt), Turn("assistant", response)]
    conv_id = record.get("id")
    return Conversation(str(conv_id) if conv_id is not None else f"#{line_no}", tuple(turns))


def read_prompt_response(
    path: str | Path, report: ReadReport | None = None
) -> Iterator[Conversation]:
    """Yields one conversation per ``{"prompt", "response"}`` JSON line.

    A cut-off last line (an interrupted writer) is reported as a truncated tail; a malformed
    line elsewhere is skipped and counted.
    """
    path = Path(path)
    report = report if report is not None else ReadReport(str(path))
    with path.open("r", encoding="utf-8", errors="replace") as lines:
        pending: str | None = None
        for line_no, line in enumerate(lines):
            if pending is not None:
                report.skip("malformed JSON line")
                pending = None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                pending = line
                continue
            conversation = _prompt_response(record, line_no, report)
            if conversation is not None:
                report.kept += 1
                yield conversation
        if pending is not None:
            report.truncated_tail_bytes = len(pending.encode("utf-8"))


def _sniff(path: Path) -> str:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if not head:
        raise CorpusFormatError(f"{path}: the file is empty; expected JSON or JSON lines")
    if head.startswith("["):
        return "conversations"
    if not head.startswith("{"):
        raise CorpusFormatError(
            f"{path}: starts with {head[:20]!r}; expected a JSON array or JSON lines"
        )
    first_line = head.split("\n", 1)[0]
    try:
        record = json.loads(first_line)
    except json.JSONDecodeError:
        return "conversations"  # one pretty-printed object spanning lines
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        return "prompt_response"
    if isinstance(record, dict) and ("conversations" in record or "messages" in record):
        return "conversations"
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise CorpusFormatError(
        f"{path}: first record has {keys}; expected `conversations`, `messages` or "
        "`prompt`+`response`"
    )


HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def read_humaneval(path: str | Path, report: ReadReport | None = None) -> Iterator[Conversation]:
    """HumanEval (``HumanEval.jsonl.gz``) as conversations: the user asks for the function,
    the assistant answers with the canonical solution in a code block."""
    import gzip

    path = Path(path)
    report = report if report is not None else ReadReport(str(path))
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            prompt, solution = record.get("prompt"), record.get("canonical_solution")
            if not isinstance(prompt, str) or not isinstance(solution, str):
                report.skip("no prompt/canonical_solution")
                continue
            report.kept += 1
            yield Conversation(
                str(record.get("task_id", f"#{report.kept}")),
                (
                    Turn("user", HUMANEVAL_INSTRUCTION.format(prompt=prompt)),
                    Turn("assistant", f"```python\n{prompt}{solution}```"),
                ),
            )


def read_conversations(
    path: str | Path, report: ReadReport | None = None
) -> Iterator[Conversation]:
    """Reads ShareGPT JSON/JSONL, UltraChat ``messages``, prompt/response JSONL, or
    HumanEval's ``.jsonl.gz``."""
    path = Path(path)
    if not path.is_file():
        raise CorpusFormatError(f"{path}: no such file")
    if path.suffix == ".gz":
        return read_humaneval(path, report)
    if _sniff(path) == "prompt_response":
        return read_prompt_response(path, report)
    return read_sharegpt(path, report)
