"""Where a fused verification's time goes: the target's forward over ``rows`` x ``nodes``
tree tokens on a batched cache, split into DART's matmul, DART's attention and the rest
(transformers' per-layer code, element-wise ops, the mask), on this thread's CPU time.

    python bench/batch_verify_parts.py [--shapes 1x1 1x12 4x1 4x5 4x8] [--context 256]
        [--lengths 39 95 462 31] [--repeats 8]

``--lengths`` gives each row its own cached length (ragged rows, as prompts of a batch have):
the shapes then use as many rows as lengths. The embedded SmolLM2-135M in bf16, 1 thread,
with DART's CPU kernels (figures: docs/benchmarks.md, "Batches").
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import numpy as np
import torch

import dart_client.models.attention as attention
import dart_client.models.linear as linear
from dart_client.dart_model import build_model
from dart_client.decoding.autotune import _prefilled, _random_tree
from dart_client.decoding.verify import verify_trees


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1x1", "1x12", "4x1", "4x5", "4x8"])
    p.add_argument("--context", type=int, default=256, help="cached tokens of every row")
    p.add_argument("--lengths", type=int, nargs="+", help="cached tokens per row (ragged)")
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_model(None, "auto", "embedded", dtype="bf16", device="cpu", notes=[])
    target = model.target
    clock = time.thread_time
    spent: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = clock()
            out = fn(*a, **k)
            spent[name] += clock() - t
            return out

        return wrapper

    attention._native_attention = timed("attention", attention._native_attention)
    call = linear.DartMatmul.__call__
    linear.DartMatmul.__call__ = lambda self, x, b: timed("matmul", call)(self, x, b)
    prefilled: dict[int, Any] = {}
    rng = np.random.default_rng(1)
    print("| rows x nodes | cached | forward ms | matmul | attention | rest |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in args.shapes:
        rows, nodes = (int(x) for x in shape.split("x"))
        lengths = args.lengths or [args.context] * rows
        cache = target.new_cache(max(lengths) + nodes + 1, len(lengths))
        for row, n in enumerate(lengths):
            if n not in prefilled:
                prefilled[n] = _prefilled(model, n, 0)[0]
            cache.put_row(row, prefilled[n])
        frontier = cache.length
        trees = [_random_tree(nodes, rng, target.vocab_size)] * len(lengths)
        samples: dict[str, list[float]] = collections.defaultdict(list)
        for i in range(args.repeats + 1):
            spent.clear()
            t = clock()
            verify_trees(target, cache, trees, taps=nodes > 1)
            total = clock() - t
            cache.truncate(frontier)
            if i:  # the first pays for new shapes
                samples["forward"].append(total)
                for name in ("matmul", "attention"):
                    samples[name].append(spent[name])
                samples["rest"].append(total - spent["matmul"] - spent["attention"])
        ms = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
        cached = "/".join(map(str, lengths)) if args.lengths else str(args.context)
        print(
            f"| {len(lengths)} x {nodes} | {cached} | {ms['forward']:.1f} | {ms['matmul']:.1f} "
            f"| {ms['attention']:.1f} | {ms['rest']:.1f} |"
        )


if __name__ == "__main__":
    main()
