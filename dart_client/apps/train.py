"""``dart-train`` and ``dart-eval-head``: command lines over the trainer and the evaluation."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dart_client.apps.cli import run_command
from dart_client.apps.options import add_device_argument, add_prompt_lookup_argument
from dart_client.data.conversations import Conversation, is_held_out
from dart_client.data.prompt_response import read_conversations
from dart_client.embedded import display_path
from dart_client.errors import DartError
from dart_client.loading import load_target, torch_dtype


def _default_data() -> list[str]:
    from dart_client.embedded import sharegpt_json

    return [str(sharegpt_json())]


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dart-train",
        description="Train a DART draft head on a frozen target (runs under torchrun unchanged).",
    )
    p.add_argument("--target", help="target: HF dir/hub id or .gguf (default: embedded SmolLM2)")
    p.add_argument("--target-dtype", default="bf16", choices=["bf16", "fp32", "fp64"])
    p.add_argument("--data", nargs="+", help="ShareGPT/UltraChat JSON(L) or prompt/response JSONL")
    p.add_argument("--split", default="train", choices=["train", "held_out", "all"])
    p.add_argument("--limit", type=int, help="use at most this many conversations")
    p.add_argument("--max-length", type=int, default=512, help="tokens per training window")
    p.add_argument("--output-dir", required=True)
    p.add_argument(
        "--eagle3",
        action="store_true",
        help="train an EAGLE-3 draft model (training-time test) instead of a DART head",
    )
    p.add_argument(
        "--draft-length",
        type=int,
        help="MASK slots m (rows = m + 1; default 3); with --eagle3 the TTT steps (default 7)",
    )
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--anchors", type=int, default=24, help="MASK blocks per window")
    p.add_argument("--batch-size", type=int, default=1, help="windows per micro-batch")
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--total-steps", type=int, default=1000, help="horizon of the cosine schedule")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument(
        "--gamma", type=float, help="annealed-KL decay per row (default 0.6; --eagle3: 0.8)"
    )
    p.add_argument("--head-dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--double-final-norm", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every-s", type=float, default=600.0)
    p.add_argument("--checkpoint-every-steps", type=int, default=0)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    add_device_argument(p)
    p.add_argument("--resume", default="auto", help="'auto' (latest checkpoint), 'none' or a path")
    p.add_argument(
        "--init-head",
        help="start from this head's weights and draft vocabulary (fresh optimizer); e.g. to "
        "continue a shipped head in a later session",
    )
    p.add_argument("--max-steps", type=int, help="stop after this many steps in this run")
    p.add_argument("--time-limit", type=float, help="stop (with a checkpoint) after N seconds")
    p.add_argument("--export-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true")
    return p


def train_main(argv: Sequence[str] | None = None) -> int:
    return run_command("dart-train", lambda a: _train(_parse(train_parser(), a)), _args(argv))


def _args(argv: Sequence[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments, a device that does not exist being a usage error (exit 2) before
    anything loads."""
    return parser.parse_args(argv)


def _train(args: argparse.Namespace) -> int:
    import torch  # here, not at import: `dart train --help` answers without it

    from dart_client.train.data import cached_training_set
    from dart_client.train.trainer import TrainConfig, Trainer, init_distributed

    trainer_class = Trainer
    if args.eagle3:
        from dart_client.models.eagle3 import DEFAULT_TTT_STEPS
        from dart_client.train.eagle3 import EAGLE3_GAMMA, Eagle3Trainer

        trainer_class = Eagle3Trainer
        draft_length = DEFAULT_TTT_STEPS if args.draft_length is None else args.draft_length
        gamma = EAGLE3_GAMMA if args.gamma is None else args.gamma
    else:
        draft_length = 3 if args.draft_length is None else args.draft_length
        gamma = 0.6 if args.gamma is None else args.gamma

    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world = init_distributed(args.device)
    out = Path(args.output_dir)
    config = TrainConfig(
        output_dir=str(out),
        draft_length=draft_length,
        draft_vocab_size=args.draft_vocab_size,
        anchors=args.anchors,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        total_steps=args.total_steps,
        min_lr_ratio=args.min_lr_ratio,
        clip=args.clip,
        gamma=gamma,
        head_dtype=args.head_dtype,
        seed=args.seed,
        double_final_norm=args.double_final_norm,
        checkpoint_every_s=args.checkpoint_every_s,
        checkpoint_every_steps=args.checkpoint_every_steps,
        keep_checkpoints=args.keep_checkpoints,
        log_every=args.log_every,
        device=args.device,
        progress=not args.no_progress,
    )
    model, tokenizer = load_target(args.target, dtype=torch_dtype(args.target_dtype))
    target_desc = args.target or "the embedded SmolLM2-135M-Instruct"
    data_paths = args.data or _default_data()
    cache = out / "data-cache"
    # Rank 0 tokenises; the others wait and read the same cached file.
    if rank == 0:
        train_set = cached_training_set(
            data_paths,
            tokenizer,
            cache,
            max_length=args.max_length,
            split=args.split,
            limit=args.limit,
            progress=config.progress,
        )
    if world > 1:
        torch.distributed.barrier()
    if rank != 0:
        train_set = cached_training_set(
            data_paths,
            tokenizer,
            cache,
            max_length=args.max_length,
            split=args.split,
            limit=args.limit,
            progress=False,
        )
    always = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    init_head = None
    if args.init_head:
        init_head = trainer_class.head_class.from_pretrained(args.init_head)
        if init_head.config.draft_vocab_size != config.draft_vocab_size:
            raise DartError(
                f"{args.init_head}: draft_vocab_size {init_head.config.draft_vocab_size}, "
                f"but --draft-vocab-size is {config.draft_vocab_size}"
            )
        init_head.config.double_final_norm = config.double_final_norm
    trainer = trainer_class(config, model, train_set, always_in_vocab=always, head=init_head)
    resumed = None
    if args.resume == "auto":
        resumed = trainer.latest_checkpoint()
    elif args.resume != "none":
        resumed = Path(args.resume)
    if resumed is not None:
        trainer.load_checkpoint(resumed)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        run = {
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "world_size": world,
            "target": display_path(target_desc),
            "target_dtype": args.target_dtype,
            "data": [display_path(p) for p in data_paths],
            "data_meta": train_set.meta,
            "windows": len(train_set),
            "tokens_per_epoch": train_set.num_tokens,
            "resumed_from": display_path(resumed) if resumed else None,
            "config": {**config.to_dict(), "output_dir": display_path(config.output_dir)},
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        with (out / "runs.jsonl").open("a") as f:
            f.write(json.dumps(run) + "\n")
        print(
            f"dart-train: {len(train_set)} windows, {train_set.num_tokens} tokens/epoch; "
            f"draft vocab coverage {trainer.vocab_coverage:.4f}; step {trainer.step}",
            file=sys.stderr,
        )
    trainer.train(max_steps=args.max_steps, time_limit_s=args.time_limit)
    trainer.save_checkpoint()
    trainer.export(out / "head", dtype=args.export_dtype)
    if rank == 0:
        summary = {"step": trainer.step, "tokens": trainer.tokens, "elapsed_s": trainer.elapsed}
        (out / "head" / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(
            f"dart-train: step {trainer.step}, {trainer.tokens} tokens, "
            f"{trainer.elapsed:.0f}s; head in {out / 'head'}",
            file=sys.stderr,
        )
    return 0


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dart-eval-head",
        description="Per-row top-1 agreement of a DART head with the target's greedy tokens "
        "(alpha-1 .. alpha-d, teacher-forced) on held-out conversations.",
    )
    p.add_argument("--head", required=True, help="head directory (config.json + model.safetensors)")
    p.add_argument("--target", help="target: HF dir/hub id or .gguf (default: embedded SmolLM2)")
    p.add_argument("--target-dtype", default="bf16", choices=["bf16", "fp32", "fp64"])
    p.add_argument("--data", nargs="+", help="conversation files (default: embedded ShareGPT)")
    p.add_argument("--split", default="held_out", choices=["train", "held_out", "all"])
    p.add_argument("--max-windows", type=int, default=40)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--cache-dir", help="where the tokenised held-out set is cached")
    p.add_argument("--json", help="also write the result as JSON here")
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--tau-prompts", type=int, default=0, help="also measure tau by generating for N prompts"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--ngram",
        help="n-gram model for the pruner (tree); without it the draft is the top-1 chain",
    )
    p.add_argument(
        "--tree-budget", type=int, default=None, help="tau: draft nodes per step (default 60)"
    )
    add_prompt_lookup_argument(p)
    return p


def eval_main(argv: Sequence[str] | None = None) -> int:
    return run_command("dart-eval-head", lambda a: _eval(_parse(eval_parser(), a)), _args(argv))


def _eval(args: argparse.Namespace) -> int:
    import torch

    from dart_client.embedded import cache_dir
    from dart_client.models.head import DartHead
    from dart_client.train.data import cached_training_set
    from dart_client.train.eval import evaluate_head

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target, dtype=torch_dtype(args.target_dtype))
    target_desc = args.target or "the embedded SmolLM2-135M-Instruct"
    head = DartHead.from_pretrained(args.head)
    head.check_compatible(model.config)
    head = head.to(torch.float32)
    head.bind_embedding(model.get_input_embeddings())
    data_paths = args.data or _default_data()
    cache = Path(args.cache_dir) if args.cache_dir else cache_dir() / "eval-data"
    data = cached_training_set(
        data_paths,
        tokenizer,
        cache,
        max_length=args.max_length,
        split=args.split,
        progress=False,
    )
    t0 = time.perf_counter()
    result = evaluate_head(head, model, data, max_windows=args.max_windows, progress=True)
    seconds = time.perf_counter() - t0
    print(
        f"dart-eval-head: {args.head} on {target_desc} ({args.split}): {result.summary()} "
        f"[{seconds:.0f}s]"
    )
    tau = None
    if args.tau_prompts > 0:
        tau = _tau(args, model, tokenizer, head, data_paths)
        print(
            f"dart-eval-head: tau {tau.tau:.3f} ({tau.tree} tree) over {tau.prompts} prompts, "
            f"{tau.identical}/{tau.prompts} identical to greedy; DART "
            f"{tau.dart_tokens_per_s:.1f} tok/s vs AR {tau.ar_tokens_per_s:.1f} tok/s"
        )
    if args.json:
        payload = {
            "tau": dataclasses.asdict(tau) if tau is not None else None,
            "head": display_path(args.head),
            "target": display_path(target_desc),
            "split": args.split,
            "data": [display_path(p) for p in data_paths],
            "alpha": result.alpha,
            "chain": result.chain,
            "positions": result.positions,
            "windows": result.windows,
            "tokens": result.tokens,
            "seconds": seconds,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def _tau(
    args: argparse.Namespace, model: Any, tokenizer: Any, head: Any, data_paths: list[str]
) -> Any:
    from dart_client.dart_model import DartModel
    from dart_client.loading import load_ngram
    from dart_client.train.eval import TopPathTreeBuilder, generation_tau
    from dart_client.train.regenerate import first_prompt

    prompts: list[list[int]] = []
    for path in data_paths:
        for conv in read_conversations(path):
            held = is_held_out(conv.id)
            if not (args.split == "all" or held == (args.split == "held_out")):
                continue
            messages = first_prompt(conv)
            if messages is None:
                continue
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            if len(ids) <= args.max_length:
                prompts.append(ids)
            if len(prompts) >= args.tau_prompts:
                break
        if len(prompts) >= args.tau_prompts:
            break
    if args.ngram:
        dart = DartModel(
            model,
            head,
            tokenizer=tokenizer,
            ngram=load_ngram(args.ngram),
            tree_budget=args.tree_budget,
            prompt_lookup=args.prompt_lookup,
        )
        tree = "pruner" + (f" + prompt lookup {args.prompt_lookup}" if args.prompt_lookup else "")
    else:
        dart = DartModel(model, head, tokenizer=tokenizer, tree_builder=TopPathTreeBuilder())
        tree = "chain"
    return generation_tau(dart, prompts, max_new_tokens=args.max_new_tokens, tree=tree)


def regenerate_main(argv: Sequence[str] | None = None) -> int:
    return run_command("dart-regenerate", _regenerate, _args(argv))


def _regenerate(argv: list[str]) -> int:
    import torch

    from dart_client.devices import check_device
    from dart_client.models.linear import pack_linear_layers
    from dart_client.train.regenerate import regenerate

    p = argparse.ArgumentParser(
        prog="dart-regenerate",
        description="Regenerate the assistant's answers with the target itself (resumable).",
    )
    p.add_argument("--target", help="HF dir/hub id or .gguf (default: embedded SmolLM2)")
    p.add_argument("--target-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--data", nargs="+", help="conversation files (default: embedded ShareGPT)")
    p.add_argument("--split", default="train", choices=["train", "held_out", "all"])
    p.add_argument("--output", required=True, help="JSONL to append to (resumed if present)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="stop after this many conversations in total")
    p.add_argument("--threads", type=int)
    add_device_argument(p)
    args = _parse(p, argv)
    device = check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target, dtype=torch_dtype(args.target_dtype))
    model.to(device)
    # Batched decoding multiplies a few dozen rows per step: faster with packed weights
    # (a no-op off the CPU).
    pack_linear_layers(model)

    def selected() -> Iterator[Conversation]:
        for path in args.data or _default_data():
            for conv in read_conversations(path):
                held = is_held_out(conv.id)
                if args.split == "all" or held == (args.split == "held_out"):
                    yield conv

    n = regenerate(
        model,
        tokenizer,
        selected(),
        args.output,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        temperature=args.temperature,
        seed=args.seed,
        limit=args.limit,
    )
    print(f"dart-regenerate: {n} conversations written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(train_main())
