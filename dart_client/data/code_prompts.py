"""HumanEval-style code prompts mined from Python source trees, for training heads on code.

HumanEval asks for a function given its signature and docstring. The same shape can be cut
from any documented Python function: this module walks source files, keeps module-level
functions whose docstring says enough, and writes each as a prompt/response JSON line (the
prompt in HumanEval's instruction, the response the function as written). Those files feed
``dart-regenerate`` (the target answers them itself) and ``dart-train``; HumanEval itself stays
untouched for evaluation.

    python -m dart_client.data.code_prompts --source /usr/lib/python3.11 --output code.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dart_client.data.prompt_response import HUMANEVAL_INSTRUCTION

# Installed third-party packages and test suites: a stdlib walk means the library itself.
DEFAULT_EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests")


@dataclass(frozen=True)
class CodeTask:
    """One documented function: ``prompt`` is its signature and docstring, ``body`` the rest."""

    id: str
    prompt: str
    body: str

    def record(self) -> dict[str, str]:
        """The prompt/response JSON line ``read_conversations`` reads."""
        return {
            "id": self.id,
            "prompt": HUMANEVAL_INSTRUCTION.format(prompt=self.prompt),
            "response": f"```python\n{self.prompt}{self.body}```",
        }


def _tasks_in_module(
    source: str, name: str, min_doc_chars: int, max_doc_chars: int, max_body_lines: int
) -> Iterator[CodeTask]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=True)
        if doc is None or not min_doc_chars <= len(doc) <= max_doc_chars:
            continue
        doc_node = node.body[0]
        if len(node.body) < 2 or doc_node.end_lineno is None or node.end_lineno is None:
            continue  # a docstring and nothing else: no function to complete
        body_lines = node.end_lineno - doc_node.end_lineno
        if body_lines > max_body_lines:
            continue
        # Decorators are left out, as in HumanEval; the def line may span several lines.
        head = "".join(lines[node.lineno - 1 : doc_node.end_lineno])
        body = "".join(lines[doc_node.end_lineno : node.end_lineno])
        if not body.strip():
            continue
        yield CodeTask(f"{name}:{node.name}", head, body if body.endswith("\n") else body + "\n")


def extract_code_tasks(
    sources: Iterable[str | Path],
    *,
    min_doc_chars: int = 60,
    max_doc_chars: int = 1200,
    max_body_lines: int = 60,
    exclude_dirs: Sequence[str] = DEFAULT_EXCLUDED_DIRS,
) -> Iterator[CodeTask]:
    """Documented module-level functions under ``sources`` (files or directories), in path
    order, skipping directories named in ``exclude_dirs``; duplicates (same prompt text) are
    kept once."""
    excluded = set(exclude_dirs)
    seen: set[str] = set()
    for root in sources:
        root = Path(root)
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(
                f
                for f in root.rglob("*.py")
                if not excluded.intersection(f.relative_to(root).parts[:-1])
            )
        else:
            raise FileNotFoundError(f"{root}: no such file or directory")
        for path in files:
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            name = str(path.relative_to(root)) if root.is_dir() else path.name
            for task in _tasks_in_module(
                textwrap.dedent(source), name, min_doc_chars, max_doc_chars, max_body_lines
            ):
                digest = hashlib.sha256(task.prompt.encode()).hexdigest()
                if digest not in seen:
                    seen.add(digest)
                    yield task


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dart_client.data.code_prompts",
        description="Write HumanEval-style prompts cut from documented Python functions.",
    )
    p.add_argument("--source", nargs="+", required=True, help="Python files or directories")
    p.add_argument("--output", required=True, help="prompt/response JSONL to write")
    p.add_argument("--limit", type=int, help="keep at most this many tasks")
    p.add_argument("--min-doc-chars", type=int, default=60)
    p.add_argument("--max-doc-chars", type=int, default=1200)
    p.add_argument("--max-body-lines", type=int, default=60)
    p.add_argument(
        "--exclude-dirs",
        nargs="*",
        default=list(DEFAULT_EXCLUDED_DIRS),
        help="directory names to skip (default: %(default)s)",
    )
    args = p.parse_args(argv)
    written = 0
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as out:
        for task in extract_code_tasks(
            args.source,
            min_doc_chars=args.min_doc_chars,
            max_doc_chars=args.max_doc_chars,
            max_body_lines=args.max_body_lines,
            exclude_dirs=args.exclude_dirs,
        ):
            if args.limit is not None and written >= args.limit:
                break
            out.write(json.dumps(task.record(), ensure_ascii=False) + "\n")
            written += 1
    print(f"{written} code tasks -> {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
