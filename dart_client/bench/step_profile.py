"""Per-stage timings of DART steps, and DART vs autoregressive tokens/s.

    python -m dart_client.bench.step_profile [--base MODEL] [--head DIR|random]
        [--ngram PATH|embedded] [--dtype bf16] [--prompts 8] [--max-new 64] [--threads N]
        [--json OUT.json]

Defaults: the embedded SmolLM2-135M-Instruct in bf16 on CPU, an untrained random head
(tau near 1 is expected; the trained head comes with the training issue), the embedded
ShareGPT 3-gram, Spec-Bench questions formatted with the tokenizer's chat template, greedy.

Reports, per step: draft (head forward + top-k), prune (Rust pruner), verify (target forward
over the tree), accept and compact; the overhead of everything that is not a target forward
relative to one verify forward (goal: under 10%); and tokens/s of ``dart_generate`` against
``ar_generate`` on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

SPEC_BENCH = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "spec_bench"


def questions(n: int) -> list[str]:
    """The first turn of ``n`` Spec-Bench questions spread over its categories."""
    for candidate in (
        SPEC_BENCH / "question.jsonl",
        Path("/work/shared/data/spec_bench/question.jsonl"),
    ):
        if candidate.is_file():
            rows = [json.loads(line) for line in candidate.read_text().splitlines() if line]
            step = max(1, len(rows) // n)
            return [rows[i]["turns"][0] for i in range(0, len(rows), step)][:n]
    return [
        "Explain speculative decoding in two sentences.",
        "Write a Python function that checks whether a number is prime.",
        "What are the three states of matter?",
        "Give me a short recipe for pancakes.",
    ][:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None)
    p.add_argument("--head", default="random")
    p.add_argument("--ngram", default="embedded")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--tree-budget", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from dart_client.cli import load_model
    from dart_client.generate import ar_generate, dart_generate

    ns = argparse.Namespace(
        base=args.base,
        head=args.head,
        ngram=args.ngram,
        small_ngram=False,
        ngram_server=None,
        dtype=args.dtype,
        device="cpu",
        template="auto",
        no_thinking=False,
        ar=False,
    )
    model = load_model(ns)
    assert model.template is not None
    prompts = [
        model.template.format(messages=[{"role": "user", "content": q}])
        for q in questions(args.prompts)
    ]
    kwargs = dict(max_new_token_num=args.max_new, tree_budget=args.tree_budget)
    # Warm-up: first calls allocate and select kernels.
    dart_generate(model, prompt=prompts[0], max_new_token_num=4)
    ar_generate(model, prompt=prompts[0], max_new_token_num=4)

    dart_runs, ar_runs = [], []
    for i, prompt in enumerate(prompts):
        d = dart_generate(model, prompt=prompt, **kwargs)
        a = ar_generate(model, prompt=prompt, max_new_token_num=args.max_new)
        dart_runs.append(d)
        ar_runs.append(a)
        same = "same" if d.tokens == a.tokens else "DIFFERENT"
        print(
            f"prompt {i}: {len(d.tokens)} tokens, tau {d.tau:.2f}, dart "
            f"{d.tokens_per_second:.1f} tok/s, ar {a.tokens_per_second:.1f} tok/s, {same}",
            file=sys.stderr,
        )

    steps = sum(r.steps for r in dart_runs)
    per_step = {
        k: 1000 * sum(r.timings[k] for r in dart_runs) / max(steps, 1)
        for k in ("draft", "prune", "verify", "accept", "compact")
    }
    ar_steps = sum(r.steps for r in ar_runs)
    ar_forward = 1000 * sum(r.timings["verify"] for r in ar_runs) / max(ar_steps, 1)
    overhead = per_step["draft"] + per_step["prune"] + per_step["accept"] + per_step["compact"]
    tree_sizes = [s for r in dart_runs for s in r.tree_sizes[1:]]
    dart_tps = sum(len(r.tokens) for r in dart_runs) / sum(r.elapsed for r in dart_runs)
    ar_tps = sum(len(r.tokens) for r in ar_runs) / sum(r.elapsed for r in ar_runs)
    report: dict[str, Any] = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}",
        "dtype": args.dtype,
        "prompts": len(prompts),
        "max_new": args.max_new,
        "steps": steps,
        "tau": sum(sum(r.accept_lengths[1:]) for r in dart_runs) / max(steps, 1),
        "mean_tree_nodes": statistics.fmean(tree_sizes) if tree_sizes else 0.0,
        "ms_per_step": per_step,
        "ar_forward_ms": ar_forward,
        "overhead_ms": overhead,
        "overhead_vs_verify": overhead / per_step["verify"] if per_step["verify"] else None,
        "overhead_vs_ar_forward": overhead / ar_forward if ar_forward else None,
        "dart_tokens_per_s": dart_tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": dart_tps / ar_tps if ar_tps else None,
        "greedy_identical": sum(
            d.tokens == a.tokens for d, a in zip(dart_runs, ar_runs, strict=True)
        ),
    }
    print("| stage | ms / step |\n|---|---|")
    for k, v in per_step.items():
        print(f"| {k} | {v:.2f} |")
    print(f"| one AR target forward | {ar_forward:.2f} |")
    print(
        f"\ntau {report['tau']:.3f}, mean tree {report['mean_tree_nodes']:.1f} nodes; "
        f"non-forward overhead {overhead:.2f} ms/step = "
        f"{100 * (report['overhead_vs_ar_forward'] or 0):.1f}% of one AR forward; "
        f"DART {dart_tps:.1f} tok/s vs AR {ar_tps:.1f} tok/s "
        f"({report['greedy_identical']}/{len(prompts)} greedy outputs identical)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
