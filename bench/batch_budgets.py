"""Per-prompt tau and aggregate tokens/s of fused batches under tree budgets that follow the
number of live rows, beside each prompt decoded alone (thread CPU time, 1 thread).

    python bench/batch_budgets.py [--lone 12] [--tables 4,4,4,4 7,7,7,7 12,12,8,7]
        [--groups 2] [--batch 4] [--max-new-tokens 96] [--prompt-lookup 8]

A table ``a,b,c,d`` gives each row budget ``a`` while 1 row is live, ``b`` at 2, and so on
(the last value beyond). Prompts: the benchmark's ShareGPT and HumanEval groups
(``python -m dart_client.apps.bench.batched``); the embedded SmolLM2-135M in bf16. Figures:
docs/benchmarks.md, "Batches".
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from dart_client.apps.bench import harness
from dart_client.dart_model import build_model
from dart_client.decoding.batch import BatchGenerator, generate_batch
from dart_client.decoding.config import GenerationConfig


class LiveBudgets(BatchGenerator):
    """A batch whose rows' budget follows the live rows (``table[live - 1]``)."""

    table: Sequence[int] = ()

    def step(self) -> Any:
        live = min(self.max_batch, len(self.rows) + len(self.waiting))
        budget = self.table[min(live, len(self.table)) - 1]
        for row in self.rows:
            row.run.tree_budget = budget
        for _, run in self.waiting:
            run.tree_budget = budget
        return super().step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lone", type=int, default=12, help="tree budget of a prompt alone")
    p.add_argument("--tables", nargs="+", default=["4,4,4,4", "7,7,7,7", "12,12,8,7"])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompt-lookup", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_model(
        None, "auto", "embedded", dtype="bf16", prompt_lookup=args.prompt_lookup, notes=[]
    )
    model.target.clock = clock = time.thread_time
    n = args.batch * args.groups
    workloads = harness.load_workloads(["sharegpt", "humaneval"], model, n, 512)
    config = model.resolve_config(
        GenerationConfig(max_new_tokens=args.max_new_tokens, tree_budget=args.lone)
    )
    import dart_client.decoding.batch as batch_module

    totals: dict[str, list[Any]] = {}
    for w in workloads:
        for g in range(args.groups):
            prompts = [q.ids for q in w.prompts[g * args.batch : (g + 1) * args.batch]]
            model.generate(input_ids=prompts[0], config=config.replace(max_new_tokens=8))
            runs: list[tuple[str, Any]] = [(f"alone, budget {args.lone}", None)]
            runs += [(f"batch, budgets {t}", [int(x) for x in t.split(",")]) for t in args.tables]
            for name, table in runs:
                start = clock()
                if table is None:
                    results = [model.generate(input_ids=q, config=config) for q in prompts]
                else:
                    LiveBudgets.table = table
                    batch_module.BatchGenerator = LiveBudgets  # type: ignore[misc]
                    try:
                        results = generate_batch(model, prompts, config)
                    finally:
                        batch_module.BatchGenerator = BatchGenerator  # type: ignore[misc]
                seconds = clock() - start
                taus = [round(r.tau, 2) for r in results]
                total = totals.setdefault(name, [0, 0.0, []])
                total[0] += sum(len(r.tokens) for r in results)
                total[1] += seconds
                total[2] += taus
                print(f"{w.name} group {g}: {name}: {seconds:.2f} s, tau per prompt {taus}")
    base = None
    print("| run | tok/s | over alone | mean tau |\n|---|---:|---:|---:|")
    for name, (tokens, seconds, taus) in totals.items():
        rate = tokens / seconds
        base = base or rate
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {sum(taus) / len(taus):.2f} |")


if __name__ == "__main__":
    main()
