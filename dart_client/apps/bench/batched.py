"""Batched decoding throughput: ``python -m dart_client.apps.bench.batched``.

Aggregate tokens per second of four ways to answer the same groups of ``--batch`` prompts,
side by side (every group and repetition runs them in a rotated order, so a busy machine
slows them alike):

* ``dart-x1`` -- each prompt alone with DART, one after the other (``DartModel.generate``);
* ``ar-x1``   -- each prompt alone, autoregressive;
* ``ar-xN``   -- the group at once, fused autoregressive decoding (one (N, 1) forward a step);
* ``dart-xN`` -- the group at once, fused DART (``DartModel.generate_batch``).

A method's figure is its tokens over its seconds, summed over the groups (each group's
median repetition). Greedy outputs of the batched runs are compared with the lone ones;
where one leaves the other, the target's top-2 margin there says whether it is a numerical
near-tie (a batch's kernels round unlike a lone sequence's in bf16) or a bug.
``--batch-tree-budget auto`` is ``DartModel.tune(batch=N)``: the per-row node budget whose
fused steps are estimated fastest (the verify grows with every row's tree).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dart_client.apps.bench.cli import load
from dart_client.errors import DartError

METHODS = ("dart-x1", "ar-x1", "ar-xN", "dart-xN")


#: ``--admission``'s choices as ``BatchGenerator(admit_together=...)`` takes them.
ADMISSION: dict[str, bool | str] = {"auto": "auto", "together": True, "alone": False}


def parser() -> argparse.ArgumentParser:
    from dart_client.apps.options import (
        add_cpu_kernels_argument,
        add_device_argument,
        add_ngram_open_argument,
        add_prompt_lookup_argument,
    )

    p = argparse.ArgumentParser(
        prog="python -m dart_client.apps.bench.batched",
        description="aggregate tokens/s of N prompts decoded together vs one at a time",
    )
    p.add_argument("--base", help="target (default: embedded SmolLM2)")
    p.add_argument("--head", default="auto", help="DART head ('auto': the shipped one)")
    p.add_argument("--ngram", default="embedded")
    add_ngram_open_argument(p)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    add_device_argument(p)
    add_cpu_kernels_argument(p)
    add_prompt_lookup_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--batch", type=int, default=4, help="prompts decoded together")
    p.add_argument("--workloads", nargs="+", default=["sharegpt", "humaneval"])
    p.add_argument("--groups", type=int, default=2, help="groups of --batch prompts per workload")
    p.add_argument(
        "--continuous",
        action="store_true",
        help="a workload's prompts as one queue: --batch of them decoded at once, the next "
        "joining as soon as one ends (concurrent requests), instead of groups run to the end",
    )
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every answer runs to --max-new-tokens (EOS does not end it), as vLLM's benchmark",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--tree-budget", default="4", help="draft nodes of a lone DART sequence")
    p.add_argument(
        "--batch-tree-budget", default="4", help="draft nodes per row of a batch, or 'auto'"
    )
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="'thread': this thread's CPU time (blind to waits for a core on a shared machine; "
        "needs --threads 1; the pruner's worker threads are not counted)",
    )
    p.add_argument(
        "--admission",
        choices=list(ADMISSION),
        default="auto",
        help="prompts joining at one step prefilled 'together' in one forward or each 'alone' "
        "('auto': together on cuda)",
    )
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    return p


#: The clock of the measurements (``--clock``).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
_clock = time.perf_counter


def _timed(fn: Any) -> tuple[list[Any], float]:
    start = _clock()
    results = fn()
    return results, _clock() - start


def run_method(
    model: Any,
    method: str,
    prompts: Sequence[list[int]],
    config: Any,
    batch_budget: Any,
    max_batch: int | None = None,
    admit_together: bool | str = "auto",
) -> tuple[list[Any], float]:
    """One method over one group: (results, seconds on the chosen clock). The batched ones
    decode at most ``max_batch`` prompts at once (the rest join as rows free up), prefilling
    the prompts that join at one step together or each alone (``admit_together``)."""
    if method == "dart-x1":
        return _timed(lambda: [model.generate(input_ids=p, config=config) for p in prompts])
    if method == "ar-x1":
        return _timed(lambda: [model.ar_generate(input_ids=p, config=config) for p in prompts])
    if method == "ar-xN":
        return _timed(
            lambda: model.generate_batch(
                prompts, config, mode="ar", max_batch=max_batch, admit_together=admit_together
            )
        )
    batched = config.replace(tree_budget=batch_budget)
    return _timed(
        lambda: model.generate_batch(
            prompts, batched, max_batch=max_batch, admit_together=admit_together
        )
    )


def divergences(
    target: Any, prompts: Sequence[Sequence[int]], alone: Sequence[Any], batched: Sequence[Any]
) -> tuple[int, list[dict[str, Any]]]:
    """How many batched outputs equal the lone ones, and for each that does not, where it
    leaves and the target's top-2 margin there (one plain forward of the transformers
    ``target``; :class:`~dart_client.decoding.ties.Divergence`)."""
    from dart_client.decoding.ties import divergence

    same, found = 0, []
    for prompt, want, got in zip(prompts, alone, batched, strict=True):
        where = divergence(target, prompt, got.tokens, want.tokens)
        if where is None:
            same += 1
        else:
            found.append(where.to_dict())
    return same, found


@dataclass
class StageTotals:
    """Where batched runs' time went, summed over groups decoded together: each step's stage
    seconds and the prompts' prefill seconds."""

    seconds: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    prefill: float = 0.0
    prompts: int = 0

    def add(self, results: Sequence[Any]) -> None:
        """One group's results: its longest row lived through every step of the group, so its
        timings (each step's stages, charged to every live row) are the batch's."""
        longest = max(results, key=lambda r: len(r.accept_lengths))
        for name, value in longest.timings.items():
            if name != "prefill":
                self.seconds[name] = self.seconds.get(name, 0.0) + value
        self.steps += max(len(longest.accept_lengths) - 1, 0)
        self.prefill += sum(r.timings.get("prefill", 0.0) for r in results)
        self.prompts += len(results)

    def ms_per_step(self) -> dict[str, float]:
        return {k: round(1e3 * v / self.steps, 3) for k, v in self.seconds.items() if v}


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(args)
    except DartError as err:
        print(f"bench.batched: error: {err}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace, model: Any = None) -> int:
    import torch

    from dart_client.apps.bench import harness

    global _clock
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        raise harness.BenchError("--clock thread measures one thread: use it with --threads 1")
    _clock = CLOCKS[args.clock]
    for name in ("batch", "groups", "max_new_tokens", "repetitions"):
        if getattr(args, name) < 1:
            raise harness.BenchError(f"--{name.replace('_', '-')} must be >= 1")
    notes: list[str] = []
    if model is None:
        model = load(args, notes)
    # The tuner measures on the target's clock: the same as the runs' (put back after).
    target_clock, model.target.clock = model.target.clock, _clock
    try:
        summary, groups = _measure(args, model, notes)
    finally:
        model.target.clock = target_clock
    print(json.dumps(summary, indent=2))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"summary": summary, "groups": groups}, indent=2) + "\n")
    return 0


def _measure(
    args: argparse.Namespace, model: Any, notes: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Tune (if asked), warm up and measure every method: the summary and each group's
    figures."""
    import torch

    from dart_client.apps.bench import harness
    from dart_client.decoding.config import GenerationConfig, parse_tree_budget

    budget = parse_tree_budget(args.tree_budget)
    batch_budget = parse_tree_budget(args.batch_tree_budget)
    per_workload = args.batch * args.groups
    workloads = harness.load_workloads(args.workloads, model, per_workload, args.max_prompt_tokens)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, tree_budget=budget, ignore_eos=args.ignore_eos
    )
    config = model.resolve_config(config)
    tuning = None
    if batch_budget == "auto":
        batch_budget = model.tune(batch=args.batch)
        tuning = model.batch_tree_tunings[args.batch]
        print(tuning.table(), file=sys.stderr)
    # Warm-up: every method once on a short run.
    warm = config.replace(max_new_tokens=min(8, args.max_new_tokens))
    first = [workloads[0].prompts[0].ids] * min(args.batch, 2)
    for method in args.methods:
        run_method(model, method, first, warm, batch_budget, None, ADMISSION[args.admission])
    totals = {m: [0, 0.0] for m in args.methods}
    identical = {m: [0, 0] for m in args.methods if m.endswith("xN")}
    margins: dict[str, list[dict[str, Any]]] = {m: [] for m in identical}
    stages = {m: StageTotals() for m in identical}
    rows = []
    methods = list(args.methods)
    for w in workloads:
        prompts = [p.ids for p in w.prompts[:per_workload]]
        size = len(prompts) if args.continuous else args.batch
        for g in range(0, len(prompts), size):
            group = prompts[g : g + size]
            runs: dict[str, list[tuple[list[Any], float]]] = {m: [] for m in methods}
            for rep in range(args.repetitions):
                shift = (g // size + rep) % len(methods)
                for method in [*methods[shift:], *methods[:shift]]:
                    runs[method].append(
                        run_method(
                            model,
                            method,
                            group,
                            config,
                            batch_budget,
                            args.batch,
                            ADMISSION[args.admission],
                        )
                    )
            row: dict[str, Any] = {"workload": w.name, "group": g // size}
            medians = {}
            for method, measured in runs.items():
                results, seconds = sorted(measured, key=lambda r: r[1])[(len(measured) - 1) // 2]
                medians[method] = results
                tokens = sum(len(r.tokens) for r in results)
                totals[method][0] += tokens
                totals[method][1] += seconds
                row[method] = {"tokens": tokens, "seconds": round(seconds, 3)}
            alone = medians.get("dart-x1") or medians.get("ar-x1")
            for method in identical:
                if alone is not None:
                    same, found = divergences(model.target.model, group, alone, medians[method])
                    identical[method][0] += same
                    identical[method][1] += len(group)
                    margins[method].extend(found)
                if not args.continuous:
                    stages[method].add(medians[method])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    rate = {m: t / s if s else 0.0 for m, (t, s) in totals.items()}
    summary: dict[str, Any] = {
        "batch": args.batch,
        "tokens_per_second": {
            m.replace("N", str(args.batch)): round(r, 2) for m, r in rate.items()
        },
        "identical_to_alone": {
            m.replace("N", str(args.batch)): f"{a}/{n}" for m, (a, n) in identical.items()
        },
        # Each output that leaves the lone one: where, the target's margin, a near-tie or not.
        "greedy_divergences": {m.replace("N", str(args.batch)): d for m, d in margins.items()},
        "divergences_at_near_ties": {
            m.replace("N", str(args.batch)): f"{sum(x['near_tie'] for x in d)}/{len(d)}"
            for m, d in margins.items()
        },
        # Where a batched step's time goes (groups decoded together; not with --continuous).
        "stage_ms_per_step": {
            m.replace("N", str(args.batch)): s.ms_per_step() for m, s in stages.items() if s.steps
        },
        "prefill_ms_per_prompt": {
            m.replace("N", str(args.batch)): round(1e3 * s.prefill / s.prompts, 3)
            for m, s in stages.items()
            if s.prompts
        },
        "tree_budget": config.tree_budget,
        "batch_tree_budget": batch_budget,
        "batch_budget_tuning": None if tuning is None else tuning.to_dict(),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "continuous": args.continuous,
        "ignore_eos": args.ignore_eos,
        "admission": args.admission,
        "notes": notes,
    }
    if "dart-xN" in rate and "dart-x1" in rate and rate["dart-x1"]:
        summary[f"dart-x{args.batch} over dart-x1"] = round(rate["dart-xN"] / rate["dart-x1"], 2)
    if "dart-xN" in rate and "ar-xN" in rate and rate["ar-xN"]:
        summary[f"dart-x{args.batch} over ar-x{args.batch}"] = round(
            rate["dart-xN"] / rate["ar-xN"], 2
        )
    if "ar-xN" in rate and "ar-x1" in rate and rate["ar-x1"]:
        summary[f"ar-x{args.batch} over ar-x1"] = round(rate["ar-xN"] / rate["ar-x1"], 2)
    return summary, rows


if __name__ == "__main__":
    raise SystemExit(main())
