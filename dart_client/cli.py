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

from dart_client.errors import DartError

#: name -> ("module:function", one-line help). Other parts of the project add theirs here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dart_client.cli:generate_main", "generate a reply to one prompt"),
    "chat": ("dart_client.cli:chat_main", "interactive chat with streamed replies"),
    "train": ("dart_client.train.cli:train_main", "train a DART head"),
    "eval-head": ("dart_client.train.cli:eval_main", "measure a head's acceptance"),
    "demo": ("dart_client.cli:demo_main", "the embedded-default demo (--ui: side-by-side page)"),
    "bench": ("dart_client.bench.cli:main", "benchmark DART against the baselines (dart-bench)"),
    "serve": ("dart_client.serve.app:serve_main", "an OpenAI-compatible HTTP server"),
}

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
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
    try:
        status = func(rest)
    except DartError as err:
        print(f"dart {name}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(status or 0)


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"  {n:<{width}}  {h}" for n, (_, h) in SUBCOMMANDS.items()]
    return "usage: dart COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(lines)


# -- shared model options ---------------------------------------------------------------------


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--base",
        help="target model: local path, hub id or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--head",
        help="DART head directory or hub id; 'random' for an untrained "
        "head (tau near 1); omit with --ar",
    )
    g.add_argument(
        "--ngram",
        help="n-gram model (.ngram, .trie, directory or hub id); "
        "'embedded' for the ShareGPT 3-gram of the embedded default",
    )
    g.add_argument("--small-ngram", action="store_true", help="use the directory's small model")
    g.add_argument("--ngram-server", help="host:port of an n-gram daemon instead of --ngram")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    g.add_argument("--device", default="cpu", help="device_map for the target (default cpu)")
    g.add_argument(
        "--template",
        default="auto",
        help="chat template: auto (the tokenizer's), qwen, llama3, chatml, none",
    )
    g.add_argument("--no-thinking", action="store_true", help="Qwen3: disable thinking")
    g.add_argument("--ar", action="store_true", help="plain autoregressive decoding")
    add_prompt_lookup_argument(g)
    add_cpu_kernels_argument(g)


def add_prompt_lookup_argument(g: Any) -> None:
    """``--prompt-lookup N`` (``args.prompt_lookup``): see :mod:`dart_client.lookup`."""
    g.add_argument(
        "--prompt-lookup",
        type=int,
        default=8,
        metavar="N",
        help="merge a prompt-lookup path of up to N tokens (what followed the context's last "
        "tokens earlier in it) into every draft tree; 0 = off, the paper's trees (default 8)",
    )


def add_cpu_kernels_argument(g: Any) -> None:
    """``--no-cpu-kernels`` (``args.cpu_kernels``): see :class:`TargetModel`."""
    g.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="run the target on PyTorch's plain CPU kernels, not the decoding ones (oneDNN-"
        "packed weights, which take a second copy of them, and small-query attention)",
    )


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-length", type=int, default=2048)
    g.add_argument(
        "--tree-budget",
        type=_tree_budget,
        default=None,
        help="draft nodes per step, or 'auto' (measured on this machine)",
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)


def _tree_budget(value: str) -> int | str | None:
    from dart_client.autotune import parse_tree_budget

    try:
        return parse_tree_budget(value)
    except DartError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def demo_main(argv: Sequence[str]) -> int:
    """``dart demo``: the n-gram demo; ``dart demo --ui [--port N]``: the side-by-side page."""
    args = list(argv)
    if "--ui" in args:
        args.remove("--ui")
        from dart_client.ui.app import main as ui_main

        return ui_main(args)
    from dart_client.demo import main as ngram_demo_main

    ngram_demo_main(args)
    return 0


def load_model(args: argparse.Namespace) -> Any:
    """Build the DartModel the command-line options describe."""
    return build_model(
        args.base,
        args.head,
        args.ngram,
        dtype=args.dtype,
        device=args.device,
        template=args.template,
        small_ngram=args.small_ngram,
        ngram_server=args.ngram_server,
        ar=args.ar,
        cpu_kernels=args.cpu_kernels,
        prompt_lookup=args.prompt_lookup,
    )


def build_model(
    base: str | None,
    head_dir: str | None,
    ngram_path: str | None,
    *,
    dtype: str,
    device: str = "cpu",
    template: str = "auto",
    small_ngram: bool = False,
    ngram_server: str | None = None,
    ar: bool = False,
    cpu_kernels: bool = True,
    prompt_lookup: int = 8,
) -> Any:
    """The DartModel of a target (None = embedded SmolLM2), a head directory (or "random")
    and an n-gram (a path, "embedded", or a daemon URL in ``ngram_server``);
    ``prompt_lookup``: the longest prompt-lookup path merged into each tree (0 = off)."""
    import torch

    from dart_client.dart_model import DartModel, load_ngram
    from dart_client.devices import check_device
    from dart_client.models.head import DartHead

    if device != "auto":  # device_map="auto" lets accelerate place the layers
        check_device(device)
    if base is None:
        from dart_client.embedded import smollm2_gguf

        base = str(smollm2_gguf())
    dtype = DTYPES[dtype]
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    model = DartModel.from_pretrained(
        base,
        None,
        torch_dtype=torch_dtype,
        device_map=None if device == "cpu" else device,
        cpu_kernels=cpu_kernels,
    )
    if template == "none":
        model.template = None
    elif template != "auto":
        from dart_client.templates import TEMPLATE_REGISTRY

        model.template = TEMPLATE_REGISTRY[template]
    if ar:
        return model
    if head_dir is None:
        raise DartError("pass --head DIR (or --head random for an untrained head), or use --ar")
    if head_dir == "random":
        head = DartHead.random_init(
            model.target.config, draft_vocab_size=min(8192, model.target.vocab_size)
        )
        print("note: an untrained random head drafts nothing useful (tau near 1)", file=sys.stderr)
    else:
        head = DartHead.from_pretrained(head_dir)
    ngram = None
    pruner = None
    if ngram_server:
        from dart_client.dart_model import _remote_pruner

        pruner = _remote_pruner(ngram_server, None)
    elif ngram_path == "embedded":
        from dart_client.embedded_ngram import ensure_ngram
        from dart_client.ngram import NGram

        ngram = NGram.open(str(ensure_ngram().path))
    elif ngram_path:
        ngram = load_ngram(ngram_path, is_small=small_ngram)
    else:
        raise DartError("pass --ngram PATH (or --ngram embedded), --ngram-server, or use --ar")
    return DartModel(
        model.target,
        head,
        tokenizer=model.tokenizer,
        ngram=ngram,
        pruner=pruner,
        template=model.template,
        prompt_lookup=prompt_lookup,
    )


def _gen_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_token_num=args.max_new_tokens,
        max_length=args.max_length,
        stop=args.stop,
        tree_budget=args.tree_budget,
        seed=args.seed,
    )


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
    args = p.parse_args(list(argv))
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    model = load_model(args)
    from dart_client.generate import ar_generate, dart_generate

    fn = ar_generate if args.ar else dart_generate
    if args.raw or model.template is None:
        result = fn(model, prompt=prompt, **_gen_kwargs(args))
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = model.template.format(messages=messages, **_format_options(args))
        result = fn(model, prompt=text, **_gen_kwargs(args))
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
                }
            )
        )
    else:
        print(result.text)
        print(_stats(result), file=sys.stderr)
    return 0


# -- dart chat ------------------------------------------------------------------------------------


def chat_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="dart chat", description="Interactive chat, streamed.")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--system", help="system message")
    p.add_argument("--stats", action="store_true", help="print tau and speed after each reply")
    args = p.parse_args(list(argv))
    model = load_model(args)
    if model.template is None:
        raise DartError("chat needs a chat template (--template qwen|llama3|chatml)")
    from dart_client.generate import ar_generate, dart_generate

    fn = ar_generate if args.ar else dart_generate
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("dart chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        text = model.template.format(messages=history, **_format_options(args))
        stream = fn(model, prompt=text, stream=True, **_gen_kwargs(args))
        for event in stream:
            print(event.text, end="", flush=True)
        print()
        result = stream.result
        history.append({"role": "assistant", "content": result.text})
        if args.stats:
            print(_stats(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
