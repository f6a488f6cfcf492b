"""Per-stage timings of DART steps, and DART vs autoregressive tokens/s.

    python -m dart_client.apps.bench.step_profile [--base MODEL] [--head DIR|random]
        [--ngram PATH|embedded] [--dtype bf16] [--prompts 8] [--questions question.jsonl]
        [--max-new 64] [--device cpu|cuda] [--static auto|on|off] [--threads N]
        [--clock wall|cpu] [--json OUT.json]

Defaults: the embedded SmolLM2-135M-Instruct in bf16 on CPU, an untrained random head
(tau near 1 is expected; the trained head comes with the training issue), the embedded
ShareGPT 3-gram, Spec-Bench questions (``--questions``; else built-in ones) formatted with the
tokenizer's chat template, greedy.

Every step's time is in exactly one stage of :data:`dart_client.decoding.loop.STAGES` (draft,
prune, inputs, verify, accept, compact, emit; ``verify`` is only the time inside the target's
forward call). Reported per stage: the median and the mean over all steps; then the
non-forward overhead of a DART step, ``step time - verify``, relative to one AR target
forward (``verify`` of ``ar_generate`` on the same prompts, run interleaved with DART in the
same process; goal: under 10%), as medians and as means over steps, and relative to the
step's own forward over the tree (which a GPU runs in about the time of one AR forward, a CPU
not); and tokens/s of
``dart_generate`` against ``ar_generate``.

On a shared machine a short stage is either not preempted or waits a whole scheduler slice,
so wall-time medians jump between modes; means stay proportional. ``--clock cpu`` (with
``--threads 1``) times every stage in this thread's CPU time instead, which ignores waiting
for a core (not the cache misses other processes cause).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dart_client.apps.options import (
    add_cpu_kernels_argument,
    add_device_argument,
    add_static_argument,
)
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.loop import STAGES, GenerationResult, GenerationStream

#: The per-step stages (``prefill`` is once per generation).
STEP_STAGES = tuple(s for s in STAGES if s != "prefill")


def questions(n: int, path: Path | None = None) -> list[str]:
    """The first turn of ``n`` questions of a Spec-Bench ``question.jsonl`` spread over its
    categories; without one, built-in questions."""
    if path is not None:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        step = max(1, len(rows) // n)
        return [rows[i]["turns"][0] for i in range(0, len(rows), step)][:n]
    return [
        "Explain speculative decoding in two sentences.",
        "Write a Python function that checks whether a number is prime.",
        "What are the three states of matter?",
        "Give me a short recipe for pancakes.",
    ][:n]


def run_steps(stream: GenerationStream) -> tuple[GenerationResult, list[dict[str, float]]]:
    """Drain a streamed generation; its result and each step's stage timings (seconds)."""
    steps = [dict(event.timings) for event in stream]
    assert stream.result is not None
    return stream.result, [s for s in steps if "prefill" not in s]


def profile(
    model: Any,
    prompts: Sequence[str],
    max_new: int,
    tree_budget: int | None = None,
    log: Any = None,
    static: bool | str = "auto",
) -> dict[str, Any]:
    """DART and AR on each prompt (interleaved), their per-step stage timings and the
    overhead figures; times in milliseconds."""
    # Warm-up: first calls allocate and select kernels (and capture the static path's
    # graphs, in a cache of the measured runs' size, which they then borrow).
    warm = GenerationConfig(max_new_tokens=4, static=static)
    run_steps(model.generate(prompts[0], warm, stream=True))
    run_steps(model.generate(prompts[0], warm, mode="ar", stream=True))

    dart_runs: list[GenerationResult] = []
    ar_runs: list[GenerationResult] = []
    dart_steps: list[dict[str, float]] = []
    ar_steps: list[dict[str, float]] = []
    for i, prompt in enumerate(prompts):
        config = GenerationConfig(max_new_tokens=max_new, tree_budget=tree_budget, static=static)
        d, ds = run_steps(model.generate(prompt, config, stream=True))
        a, as_ = run_steps(model.generate(prompt, config, mode="ar", stream=True))
        dart_runs.append(d)
        ar_runs.append(a)
        dart_steps += ds
        ar_steps += as_
        if log is not None:
            same = "same" if d.tokens == a.tokens else "DIFFERENT"
            print(
                f"prompt {i}: {len(d.tokens)} tokens, tau {d.tau:.2f}, dart "
                f"{d.tokens_per_second:.1f} tok/s, ar {a.tokens_per_second:.1f} tok/s, {same}",
                file=log,
            )
    return summarise(dart_runs, ar_runs, dart_steps, ar_steps)


def _stats(steps: list[dict[str, float]], key: Any) -> dict[str, float]:
    values = [1000 * key(s) for s in steps] or [0.0]
    return {"median": statistics.median(values), "mean": statistics.fmean(values)}


def summarise(
    dart_runs: list[GenerationResult],
    ar_runs: list[GenerationResult],
    dart_steps: list[dict[str, float]],
    ar_steps: list[dict[str, float]],
) -> dict[str, Any]:
    """The report of :func:`profile` from the runs and their per-step timings."""

    def total(s: dict[str, float]) -> float:
        return sum(s.get(k, 0.0) for k in STEP_STAGES)

    def overhead(s: dict[str, float]) -> float:
        return total(s) - s.get("verify", 0.0)

    stages = {k: _stats(dart_steps, lambda s, k=k: s.get(k, 0.0)) for k in STEP_STAGES}
    step = _stats(dart_steps, total)
    over = _stats(dart_steps, overhead)
    ar_forward = _stats(ar_steps, lambda s: s.get("verify", 0.0))
    ar_over = _stats(ar_steps, overhead)
    # What the stage clocks did not see: the loop's own bookkeeping and the final decode.
    booked = sum(sum(r.timings.values()) for r in dart_runs)
    elapsed = sum(r.elapsed for r in dart_runs)
    tree_sizes = [s for r in dart_runs for s in r.tree_sizes[1:]]
    dart_tps = sum(len(r.tokens) for r in dart_runs) / max(sum(r.elapsed for r in dart_runs), 1e-9)
    ar_tps = sum(len(r.tokens) for r in ar_runs) / max(sum(r.elapsed for r in ar_runs), 1e-9)

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    return {
        "prompts": len(dart_runs),
        "steps": len(dart_steps),
        "tau": sum(sum(r.accept_lengths[1:]) for r in dart_runs) / max(len(dart_steps), 1),
        "mean_tree_nodes": statistics.fmean(tree_sizes) if tree_sizes else 0.0,
        "ms_per_step": stages,
        "step_ms": step,
        "overhead_ms": over,
        "ar_forward_ms": ar_forward,
        "ar_overhead_ms": ar_over,
        "overhead_vs_ar_forward": {k: ratio(over[k], ar_forward[k]) for k in ("median", "mean")},
        # The same overhead against the forward of its own step (the tree's verification),
        # which on a GPU costs about one AR forward and on a CPU a few.
        "overhead_vs_own_forward": {
            k: ratio(over[k], stages["verify"][k]) for k in ("median", "mean")
        },
        "unbooked_ms_per_step": 1000 * (elapsed - booked) / max(len(dart_steps), 1),
        "dart_tokens_per_s": dart_tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": ratio(dart_tps, ar_tps),
        "greedy_identical": sum(
            d.tokens == a.tokens for d, a in zip(dart_runs, ar_runs, strict=True)
        ),
    }


def markdown(report: dict[str, Any]) -> str:
    """The per-stage table and the overhead line."""
    lines = ["| stage | median ms / step | mean ms / step |", "|---|---|---|"]
    for k, v in report["ms_per_step"].items():
        lines.append(f"| {k} | {v['median']:.2f} | {v['mean']:.2f} |")
    for label, key in (
        ("whole DART step", "step_ms"),
        ("DART step minus its target forward", "overhead_ms"),
        ("one AR target forward", "ar_forward_ms"),
        ("AR step minus its target forward", "ar_overhead_ms"),
    ):
        v = report[key]
        lines.append(f"| {label} | {v['median']:.2f} | {v['mean']:.2f} |")
    pct = report["overhead_vs_ar_forward"]
    lines.append("")
    lines.append(
        f"tau {report['tau']:.3f}, mean tree {report['mean_tree_nodes']:.1f} nodes, "
        f"{report['steps']} steps; non-forward overhead of a DART step = "
        f"{100 * (pct['median'] or 0):.1f}% of one AR forward (medians; means "
        f"{100 * (pct['mean'] or 0):.1f}%), "
        f"{100 * (report['overhead_vs_own_forward']['median'] or 0):.1f}% of the step's own "
        f"forward over the tree; unbooked {report['unbooked_ms_per_step']:.3f} ms/step; "
        f"DART {report['dart_tokens_per_s']:.1f} tok/s vs AR {report['ar_tokens_per_s']:.1f} "
        f"tok/s ({report['greedy_identical']}/{report['prompts']} greedy outputs identical)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None)
    p.add_argument("--head", default="random")
    p.add_argument("--ngram", default="embedded")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument(
        "--questions", type=Path, default=None, help="a Spec-Bench question.jsonl to draw from"
    )
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--tree-budget", type=int, default=None)
    add_device_argument(p)
    add_static_argument(p)
    add_cpu_kernels_argument(p)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or this thread's CPU time (blind to waiting for a core on a shared "
        "machine; needs --threads 1)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        p.error("--clock cpu counts the calling thread only: use it with --threads 1")

    from dart_client.dart_model import build_model

    model = build_model(
        args.base,
        args.head,
        args.ngram,
        dtype=args.dtype,
        device=args.device,
        cpu_kernels=args.cpu_kernels,
    )
    assert model.template is not None
    if args.clock == "cpu":
        model.target.clock = time.thread_time
    prompts = [
        model.template.format(messages=[{"role": "user", "content": q}])
        for q in questions(args.prompts, args.questions)
    ]
    report = profile(
        model, prompts, args.max_new, args.tree_budget, log=sys.stderr, static=args.static
    )
    report.update(
        machine=f"{platform.machine()} {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}",
        load_average=os.getloadavg(),
        clock=args.clock,
        dtype=args.dtype,
        max_new=args.max_new,
        cpu_kernels=args.cpu_kernels,
        device=str(model.target.device),
        gpu=torch.cuda.get_device_name(model.target.device)
        if model.target.device.type == "cuda"
        else None,
        static=args.static,
    )
    print(markdown(report))
    print(f"clock: {args.clock}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
