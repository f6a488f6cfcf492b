"""The command-line options shared by the ``dart`` subcommands, the bench and the UI, and their
translation into a :class:`~dart_client.decoding.config.GenerationConfig` and a model load.
Only argument parsing lives here; loading is :func:`dart_client.dart_model.build_model`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dart_client.errors import DartError
from dart_client.loading import DTYPE_NAMES, NGRAM_OPEN_OPTIONS, check_ngram_open, check_spec

if TYPE_CHECKING:
    from dart_client.decoding.config import GenerationConfig

# Nothing here imports torch at module level (the generation config's module does): ``--help``
# and usage errors answer without loading it.

#: ``--dtype`` choices: the loader's names and ``auto`` (the checkpoint's dtype).
DTYPE_CHOICES = [*DTYPE_NAMES, "auto"]


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
        default="auto",
        help="DART head directory or hub id; 'random' for an untrained head (tau near 1); "
        "'auto' (default): the head shipped for the embedded target",
    )
    g.add_argument(
        "--ngram",
        help="n-gram model (.ngram, .trie, directory or hub id); 'embedded': the ShareGPT "
        "3-gram of the embedded target (the default without --base)",
    )
    g.add_argument("--small-ngram", action="store_true", help="use the directory's small model")
    g.add_argument("--ngram-server", help="host:port of an n-gram daemon instead of --ngram")
    add_ngram_open_argument(g)
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16")
    add_device_argument(g, device_map=True)
    g.add_argument(
        "--template",
        default="auto",
        help="chat template: auto (the tokenizer's), qwen, llama3, chatml, none",
    )
    g.add_argument("--no-thinking", action="store_true", help="Qwen3: disable thinking")
    g.add_argument("--ar", action="store_true", help="plain autoregressive decoding")
    add_prompt_lookup_argument(g)
    add_cpu_kernels_argument(g)


def add_ngram_open_argument(g: Any) -> None:
    """``--ngram-open`` (``args.ngram_open``: a dict of ``NGram.open`` options)."""
    g.add_argument(
        "--ngram-open",
        type=parse_ngram_open,
        default={},
        metavar="OPTION[,OPTION...]",
        help="how --ngram's model is opened: "
        + ", ".join(o.replace("_", "-") for o in NGRAM_OPEN_OPTIONS)
        + "; 'no-' turns one off. A model of many GB: 'no-checksums,prefetch' opens at once "
        "(the large sections are not read to check them) and reads the file in the background",
    )


def parse_ngram_open(text: str) -> dict[str, bool]:
    """``--ngram-open``'s value: ``prefetch,no-checksums`` -> ``{"prefetch": True,
    "checksums": False}``."""
    options: dict[str, bool] = {}
    for word in filter(None, (w.strip() for w in text.split(","))):
        value = not word.startswith("no-")
        name = word.removeprefix("no-").replace("-", "_")
        if name not in NGRAM_OPEN_OPTIONS:
            known = ", ".join(o.replace("_", "-") for o in NGRAM_OPEN_OPTIONS)
            raise argparse.ArgumentTypeError(f"unknown option {word!r} (known: {known})")
        options[name] = value
    return options


def add_prompt_lookup_argument(g: Any) -> None:
    """``--prompt-lookup N`` (``args.prompt_lookup``): see :mod:`dart_client.decoding.lookup`."""
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


def device_spec(spec: str) -> str:
    """``--device``'s argparse type: ``spec`` unchanged once it names a device this machine
    has (a usage error naming the problem otherwise, before any model loads)."""
    from dart_client.devices import check_device  # here: it imports torch, --help does not

    try:
        check_device(spec)
    except DartError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return spec


def _device_map_spec(spec: str) -> str:
    # device_map="auto" lets accelerate place the layers over every device it finds.
    return spec if spec == "auto" else device_spec(spec)


def add_device_argument(g: Any, default: str = "cpu", *, device_map: bool = False) -> None:
    """``--device`` (``args.device``, a validated spec string); ``device_map=True`` also
    takes ``auto`` (accelerate's placement)."""
    g.add_argument(
        "--device",
        type=_device_map_spec if device_map else device_spec,
        default=default,
        help=f"the target's device: cpu, cuda, cuda:1{', auto' if device_map else ''} "
        f"(default {default})",
    )


def add_static_argument(g: Any) -> None:
    """``--static auto|on|off`` (``args.static``): ``GenerationConfig.static``."""
    g.add_argument(
        "--static",
        choices=["auto", "on", "off"],
        default="auto",
        help="verify through fixed-shape buffers, device-side acceptance and (on cuda) CUDA "
        "graphs; auto (default): on cuda only (docs/gpu.md)",
    )


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-length", type=int, default=2048)
    add_tree_budget_arguments(g)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)
    add_static_argument(g)


def add_tree_budget_arguments(g: Any) -> None:
    """``--tree-budget`` (default ``auto``) and ``--tune-prompts``: ``dart generate``'s and
    ``dart serve``'s."""
    g.add_argument(
        "--tree-budget",
        type=_tree_budget,
        default="auto",
        help="draft nodes per step, or 'auto' (default): the fastest size measured for this "
        "model and device (and, serving batches, per row of --max-batch) the first time, then "
        "cached",
    )
    g.add_argument(
        "--tune-prompts",
        type=Path,
        default=None,
        metavar="JSONL",
        help="calibration prompts for --tree-budget auto, one per line (a JSON string or "
        '{"prompt": ...}): requests like the ones served (default: a few built-in ones)',
    )


def _tree_budget(value: str) -> int | str | None:
    from dart_client.decoding.config import parse_tree_budget

    try:
        return parse_tree_budget(value)
    except DartError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def generation_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> GenerationConfig:
    """The config the sampling options describe; a bad value is a usage error (exit 2), found
    before any model loads."""
    from dart_client.decoding.config import GenerationConfig

    try:
        return GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            max_length=args.max_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=tuple(args.stop or ()),
            seed=args.seed,
            tree_budget=args.tree_budget,
            static=args.static,
            logprobs=getattr(args, "logprobs", None),
            ignore_eos=getattr(args, "ignore_eos", False),
            min_tokens=getattr(args, "min_tokens", 0),
        )
    except DartError as err:
        parser.error(str(err))


def check_model_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Usage errors of the model options (exit 2) before anything loads."""
    if args.prompt_lookup < 0:
        parser.error(f"--prompt-lookup {args.prompt_lookup}: expected a path length >= 0")
    if args.template not in ("auto", "none"):
        from dart_client.templates import TEMPLATE_REGISTRY

        if args.template not in TEMPLATE_REGISTRY:
            parser.error(f"--template {args.template!r}: unknown chat template")
    if args.base is not None:
        _check(parser, "--base", "target", args.base, suffixes=(".gguf",))
    if args.ar:
        return
    if args.head == "auto" and args.base is not None:
        parser.error(
            "--head auto: a head is shipped for the embedded target only; pass --head DIR "
            f"(a head trained for {args.base}, see dart train), --head random, or use --ar"
        )
    if args.head not in ("auto", "random"):
        _check(parser, "--head", "head", args.head)
        from dart_client.loading import is_eagle3_spec

        try:
            if is_eagle3_spec(args.head):
                return  # an EAGLE-3 head drafts without an n-gram
        except DartError as err:
            parser.error(f"--head {err}")
    if args.ngram is None and not args.ngram_server:
        if args.base is not None:
            parser.error(
                "pass --ngram PATH (an n-gram built with the target's tokenizer: "
                "dart-ngram build, or a reference .trie), --ngram-server, or use --ar"
            )
        args.ngram = "embedded"
    if args.ngram and args.ngram != "embedded" and not args.ngram.startswith("grpc"):
        _check(parser, "--ngram", "n-gram model", args.ngram, suffixes=(".ngram", ".trie"))
    daemon = args.ngram_server or (args.ngram if (args.ngram or "").startswith("grpc") else None)
    try:
        check_ngram_open(args.ngram_open, daemon=daemon)
    except DartError as err:
        parser.error(f"--ngram-open: {err}")


def _check(
    parser: argparse.ArgumentParser, option: str, kind: str, spec: str, **kwargs: Any
) -> None:
    try:
        check_spec(kind, spec, **kwargs)
    except DartError as err:
        parser.error(f"{option} {err}")


def load_model(args: argparse.Namespace) -> Any:
    """The DartModel the model options describe."""
    from dart_client.dart_model import build_model
    from dart_client.decoding.autotune import read_tune_prompts

    prompts_file = getattr(args, "tune_prompts", None)
    tune_prompts = None if prompts_file is None else read_tune_prompts(prompts_file)

    return build_model(
        args.base,
        args.head,
        args.ngram,
        dtype=args.dtype,
        device=args.device,
        template=args.template,
        small_ngram=args.small_ngram,
        ngram_server=args.ngram_server,
        ngram_open=args.ngram_open,
        ar=args.ar,
        cpu_kernels=args.cpu_kernels,
        prompt_lookup=args.prompt_lookup,
        tree_budget=getattr(args, "tree_budget", None),
        tune_batch=getattr(args, "max_batch", 1),
        tune_prompts=tune_prompts,
    )
