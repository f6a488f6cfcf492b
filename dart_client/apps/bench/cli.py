"""``dart-bench`` (also ``dart bench``): DART against the baselines, one run, one report.

    dart-bench [--workloads humaneval sharegpt [FILE.jsonl ...]] [--methods ar hf pld dart ...]
        [--max-prompts 10] [--max-new-tokens 128] [--repetitions 3] [--dtype bf16]
        [--threads N] [--tree-budget auto|N] [--remote auto|HOST:PORT] [--temperature T]
        [--output-dir bench-results]

Defaults: the embedded SmolLM2-135M-Instruct (bf16 on CPU), the head shipped for it in
``dart_client/heads/smollm2-135m-dart`` (an untrained random head when none is there, said so
in the report: tau near 1), the embedded ShareGPT 3-gram, greedy decoding. Writes results.json,
results.md and PNG plots under ``--output-dir`` and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dart_client.apps.bench import METHODS
from dart_client.apps.options import (
    add_cpu_kernels_argument,
    add_device_argument,
    add_ngram_open_argument,
    add_prompt_lookup_argument,
    add_static_argument,
)
from dart_client.embedded import display_path
from dart_client.errors import DartError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dart-bench",
        description="Benchmark DART against autoregressive decoding, "
        "transformers' generate and prompt lookup decoding on the same target.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--base", help="target: path, hub id or .gguf (default: embedded SmolLM2)")
    g.add_argument(
        "--head",
        default="auto",
        help="DART head directory; 'random' for an untrained head; 'auto' (default): the "
        "head shipped for the embedded SmolLM2 when the target is the embedded one, else random",
    )
    g.add_argument("--ngram", default="embedded", help="n-gram model, or 'embedded'")
    add_ngram_open_argument(g)
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    add_device_argument(g)
    add_static_argument(g)
    add_cpu_kernels_argument(g)
    add_prompt_lookup_argument(g)
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g.add_argument(
        "--eagle3-head",
        default="auto",
        help="the eagle3 method's EAGLE-3 checkpoint (directory or hub id, published layout); "
        "'auto' (default): the one shipped for the embedded SmolLM2, else random",
    )
    g.add_argument("--eagle3-top-k", type=int, default=10, help="EAGLE-3 tree: top-k per node")
    g.add_argument("--eagle3-depth", type=int, default=7, help="EAGLE-3 tree: expansion steps")
    g.add_argument(
        "--eagle3-total-tokens",
        type=int,
        default=60,
        help="EAGLE-3 tree: nodes incl. the root (its own budget; an int --tree-budget wins)",
    )
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--workloads",
        nargs="+",
        default=["humaneval", "sharegpt"],
        help="humaneval, sharegpt and/or .jsonl files of prompts or conversations",
    )
    g.add_argument(
        "--methods",
        nargs="+",
        default=[m for m in METHODS if not m.startswith("eagle3")],
        choices=list(METHODS),
        help="methods to compare (ar is required: the baseline); eagle3 runs EAGLE-3's "
        "drafter (--eagle3-head) on the same target with the --eagle3-* tree, eagle3-auto "
        "with the tree tuned on this machine (top-k, depth, size)",
    )
    g.add_argument("--max-prompts", type=int, default=10, help="prompts per workload")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts skipped")
    g.add_argument("--repetitions", type=int, default=3)
    g.add_argument("--warmup", type=int, default=1, help="warm-up rounds of every method")
    g.add_argument("--tree-budget", default="auto", help="draft nodes per step: N or 'auto'")
    g.add_argument(
        "--compare-budgets",
        nargs="*",
        type=int,
        default=[],
        metavar="N",
        help="also run DART with these fixed budgets (as dart@N), e.g. 60, the reference's "
        "(and EAGLE-3 as eagle3@N when eagle3 is among the methods)",
    )
    g.add_argument(
        "--calibration-prompts",
        type=int,
        default=2,
        metavar="N",
        help="--tree-budget auto calibrates on the N prompts after the measured ones in each "
        "workload (0: the tuner's built-in prompts)",
    )
    g.add_argument(
        "--remote",
        default=None,
        help="dart-remote's daemon: 'auto' starts dart-ngram serve on 127.0.0.1 (ephemeral "
        "port), or HOST:PORT of a running one; without it dart-remote is skipped",
    )
    g.add_argument("--pld-tokens", type=int, default=10, help="prompt lookup: tokens per draft")
    g.add_argument("--humaneval-format", choices=["chat", "raw"], default="chat")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def load(args: argparse.Namespace, notes: list[str]) -> Any:
    from dart_client.dart_model import build_model

    return build_model(
        args.base,
        args.head,
        args.ngram,
        dtype=args.dtype,
        device=args.device,
        ngram_open=args.ngram_open,
        cpu_kernels=args.cpu_kernels,
        prompt_lookup=args.prompt_lookup,
        notes=notes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(args)
    except DartError as err:
        print(f"dart-bench: error: {err}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace, model: Any = None) -> int:
    """The benchmark the arguments describe (``model``: an already loaded DartModel)."""
    import torch  # here, not at import: `dart bench --help` answers without it

    from dart_client.apps.bench import harness, report
    from dart_client.decoding.autotune import MAX_CONTINUATION_TOKENS
    from dart_client.decoding.config import parse_tree_budget

    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("max_prompts", "max_new_tokens", "repetitions", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise harness.BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if args.calibration_prompts < 0:
        raise harness.BenchError("--calibration-prompts must be >= 0")
    budget = parse_tree_budget(args.tree_budget)
    notes: list[str] = []
    if model is None:
        model = load(args, notes)
    settings = harness.Settings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        repetitions=args.repetitions,
        warmup=args.warmup,
        pld_tokens=args.pld_tokens,
        static=args.static,
    )
    calibrate = budget == "auto" and args.calibration_prompts > 0
    workloads = harness.load_workloads(
        args.workloads,
        model,
        args.max_prompts + (args.calibration_prompts if calibrate else 0),
        args.max_prompt_tokens,
        args.humaneval_format,
    )
    workloads, calibration = harness.split_calibration(workloads, args.max_prompts)
    if calibrate:
        notes.append(
            f"tree budget tuned on {len(calibration)} prompts that are not measured (the "
            f"{args.calibration_prompts} after the measured ones in each workload)"
            if calibration
            else "tree budget tuned on the built-in prompts: no workload has prompts left over"
        )
    eagle3 = eagle3_tree = None
    if any(m.startswith("eagle3") for m in args.methods):
        from dart_client.decoding.eagle3 import Eagle3TreeConfig
        from dart_client.loading import load_eagle3_head

        eagle3_tree = Eagle3TreeConfig(
            top_k=args.eagle3_top_k, depth=args.eagle3_depth, total_tokens=args.eagle3_total_tokens
        )
        eagle3 = load_eagle3_head(
            args.eagle3_head,
            model.target.config,
            embedded_target=args.base is None,
            notes=notes,
        )
    closers: list[Callable[[], None]] = []
    try:
        methods = harness.build_methods(
            model,
            args.methods,
            tree_budget=budget,
            remote=args.remote,
            pld_tokens=args.pld_tokens,
            compare_budgets=args.compare_budgets,
            calibration=calibration or None,
            # As long as the measured generations (tau depends on the length), within reason.
            calibration_tokens=min(args.max_new_tokens, MAX_CONTINUATION_TOKENS),
            notes=notes,
            closers=closers,
            eagle3=eagle3,
            eagle3_tree=eagle3_tree,
        )
        tuning = model.tree_tuning
        if tuning is not None:
            print(tuning.table(), file=sys.stderr)
        eagle3_tuning = next(
            (m.model.eagle3_tuning for m in methods if m.name == "eagle3-auto"), None
        )
        if eagle3_tuning is not None:
            print(eagle3_tuning.table(rows=12), file=sys.stderr)
        results = harness.run_benchmark(methods, workloads, settings, progress=not args.no_progress)
        if settings.greedy:
            harness.check_divergences(results, model.target.model)
    finally:
        for close in reversed(closers):
            close()
    summary = harness.summarize(results, settings)
    ngram_path = getattr(getattr(model.pruner, "ngram", None), "path", None)
    env = harness.environment(
        model,
        {
            "tree_budget": (
                f"auto -> {tuning.best_budget}" if budget == "auto" and tuning else budget
            ),
            "ngram": display_path(str(ngram_path)) if ngram_path else None,
        },
    )
    record = report.build_record(
        summary,
        results,
        env,
        asdict(settings),
        {m.name: m.description for m in methods},
        notes,
        tuning.to_dict() if tuning is not None else None,
        eagle3_tuning.to_dict() if eagle3_tuning is not None else None,
    )
    paths = report.write_report(record, args.output_dir)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
