"""The ``dart`` command line: ``dart generate``, ``dart chat`` and the other subcommands.

Each subcommand is an entry ``name -> "module:function"`` in :data:`SUBCOMMANDS`; the
function takes the remaining arguments and returns an exit status. Modules are imported only
when their subcommand runs, so ``dart --help`` stays fast and a missing optional part only
affects its own subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dart_client._native import DaemonStatusError, KernelError, NGramError, PrunerError
from dart_client.apps.options import (
    add_model_arguments,
    add_sampling_arguments,
    check_model_arguments,
    generation_config,
    load_model,
)
from dart_client.errors import DartError

#: Errors a user can cause, native ones included: one line on stderr and exit status 1.
USER_ERRORS = (DartError, NGramError, PrunerError, KernelError, DaemonStatusError, OSError)

#: The exit status after Ctrl-C (128 + SIGINT), as shells report it.
INTERRUPTED = 130

#: name -> ("module:function", one-line help). Other parts of the project add theirs here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dart_client.apps.cli:generate_main", "generate a reply to one prompt"),
    "chat": ("dart_client.apps.cli:chat_main", "interactive chat with streamed replies"),
    "train": ("dart_client.apps.train:train_main", "train a DART head"),
    "eval-head": ("dart_client.apps.train:eval_main", "measure a head's acceptance"),
    "demo": (
        "dart_client.apps.cli:demo_main",
        "the embedded-default demo (--ui: side-by-side page)",
    ),
    "bench": (
        "dart_client.apps.bench.cli:main",
        "benchmark DART against the baselines (dart-bench)",
    ),
    "serve": ("dart_client.apps.serve.app:serve_main", "an OpenAI-compatible HTTP server"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from dart_client._native import __version__

        print(f"dart {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"dart: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        func: Callable[[list[str]], int | None] = getattr(
            importlib.import_module(module_name), func_name
        )
    except (ImportError, AttributeError) as err:
        print(f"dart {name}: not available in this installation ({err})", file=sys.stderr)
        return 2
    return run_command(f"dart {name}", func, rest)


def run_command(prog: str, func: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """``func(argv)``'s status; a user error (native ones too) prints one line and gives 1,
    Ctrl-C gives 130, a usage error argparse's 2."""
    try:
        status = func(argv)
    except USER_ERRORS as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except SystemExit as exit_:  # argparse's usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else 1
    return int(status or 0)


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"  {n:<{width}}  {h}" for n, (_, h) in SUBCOMMANDS.items()]
    return (
        "usage: dart COMMAND [ARGS...]   (dart COMMAND --help: its options; dart --version)\n\n"
        "commands:\n" + "\n".join(lines)
    )


def demo_main(argv: Sequence[str]) -> int:
    """``dart demo``: the n-gram demo; ``dart demo --ui [--port N]``: the side-by-side page."""
    args = list(argv)
    if "--ui" in args:
        args.remove("--ui")
        from dart_client.apps.ui.app import main as ui_main

        return ui_main(args)
    from dart_client.apps.demo import main as demo

    demo(args)
    return 0


def _format_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"enable_thinking": False} if args.no_thinking else {}


def _stats(result: Any) -> str:
    t = result.timings
    stages = " ".join(f"{k}={v * 1000:.0f}ms" for k, v in t.items())
    return (
        f"[{result.mode}] {len(result.tokens)} tokens in {result.elapsed:.2f}s "
        f"({result.tokens_per_second:.1f} tok/s), tau={result.tau:.2f}, "
        f"steps={result.steps}, finish={result.finish_reason}; {stages}"
    )


# -- dart generate --------------------------------------------------------------------------------


def generate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="dart generate", description="Generate a reply to one prompt.")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("prompt", nargs="?", help="the user message (default: read stdin)")
    p.add_argument("--system", help="system message")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="also print each token's log probability under the target and its N likeliest "
        "alternatives (0-20; in --json: a 'logprobs' list)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate through end-of-sequence tokens to --max-new-tokens (fixed lengths)",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="no end-of-sequence token before N new tokens (vLLM's min_tokens)",
    )
    args = p.parse_args(list(argv))
    config = generation_config(args, p)
    check_model_arguments(args, p)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        p.error("the prompt is empty" + (" (read from stdin)" if args.prompt is None else ""))
    model = load_model(args)
    mode = "ar" if args.ar else "dart"
    if args.raw or model.template is None:
        text = prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = model.template.format(messages=messages, **_format_options(args))
    stream = model.generate(text, config, mode=mode, stream=True)
    pieces: list[str] = []
    try:
        for event in stream:
            pieces.append(event.text)
    except KeyboardInterrupt:
        # What was generated before Ctrl-C is the user's: print it, then report.
        print("".join(pieces), flush=True)
        raise
    result = stream.result
    assert result is not None
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "tau": result.tau,
                    "accept_lengths": result.accept_lengths,
                    "timings": result.timings,
                    "elapsed": result.elapsed,
                    "finish_reason": result.finish_reason,
                    **({} if result.logprobs is None else {"logprobs": _logprobs_json(result)}),
                }
            )
        )
    else:
        print(result.text)
        if result.logprobs is not None:
            print(_logprobs_table(model.tokenizer, result.logprobs), file=sys.stderr)
        print(_stats(result), file=sys.stderr)
    return 0


def _logprobs_json(result: Any) -> list[dict[str, Any]]:
    return [
        {"token": lp.token, "logprob": lp.logprob, "top": [list(alt) for alt in lp.top]}
        for lp in result.logprobs
    ]


def _logprobs_table(tokenizer: Any, logprobs: Sequence[Any]) -> str:
    """One line per token: its text, log probability and probability, its alternatives."""
    import math

    def show(token: int) -> str:
        return repr(tokenizer.decode([token])) if tokenizer is not None else str(token)

    lines = []
    for lp in logprobs:
        alternatives = "  ".join(f"{show(t)} {v:.3f}" for t, v in lp.top)
        lines.append(
            f"{show(lp.token):>16} {lp.logprob:9.4f} ({math.exp(lp.logprob):6.1%})  {alternatives}"
        )
    return "\n".join(lines)


# -- dart chat ------------------------------------------------------------------------------------

CHAT_HELP = (
    "dart chat: /exit (or Ctrl-D) quits, /reset starts a new conversation; end a line with \\ "
    "to continue the message on the next line, or type /paste and end the pasted text with "
    "a line holding only '.'"
)


def chat_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dart chat",
        description="Interactive chat, streamed. " + CHAT_HELP.removeprefix("dart chat: ") + ".",
    )
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--system", help="system message")
    p.add_argument("--stats", action="store_true", help="print tau and speed after each reply")
    args = p.parse_args(list(argv))
    config = generation_config(args, p)
    check_model_arguments(args, p)
    if args.template == "none":
        p.error("chat needs a chat template (--template auto|qwen|llama3|chatml)")
    model = load_model(args)
    if model.template is None:
        raise DartError("chat needs a chat template (--template qwen|llama3|chatml)")
    from dart_client.decoding.loop import PrefixCache

    mode = "ar" if args.ar else "dart"
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    # The conversation's KV caches: each turn prefills only what the template added since.
    kept = PrefixCache()
    print(CHAT_HELP, file=sys.stderr)
    while True:
        message = _read_message()
        if message is None or message.strip() == "/exit":
            break
        if message.strip() == "/reset":
            history, kept = list(start), PrefixCache()
            print("(new conversation)", file=sys.stderr)
            continue
        if not message.strip():
            continue
        history.append({"role": "user", "content": message})
        text = model.template.format(messages=history, **_format_options(args))
        stream = model.generate(text, config, mode=mode, stream=True, prefix_cache=kept)
        for event in stream:  # Ctrl-C: the text so far is already printed
            print(event.text, end="", flush=True)
        print()
        result = stream.result
        assert result is not None
        history.append({"role": "assistant", "content": result.text})
        if args.stats:
            print(f"{_stats(result)}; {kept.reused} cached prompt tokens reused", file=sys.stderr)
    return 0


def _read_message() -> str | None:
    """One user message from stdin: a line, continued while it ends with a backslash, or a
    pasted block between ``/paste`` and a line holding only ``.``; None at end of input."""
    try:
        line = input("> ")
        if line.strip() == "/paste":
            lines: list[str] = []
            while (line := input()) != ".":
                lines.append(line)
            return "\n".join(lines)
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = input("... ")
        return "\n".join([*lines, line])
    except EOFError:
        return None


if __name__ == "__main__":
    sys.exit(main())
