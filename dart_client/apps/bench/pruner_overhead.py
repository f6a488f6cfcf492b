"""What calling the Rust pruner from Python costs on top of the pruning itself.

    python -m dart_client.apps.bench.pruner_overhead --model MODEL.ngram [--requests 200]
        [--repeats 20]

On the same draft requests (k = 25, 8 levels, default configuration: beam 20, 60 nodes) it
times, per call, p50 and p90 over all calls:

* ``rust``: the prune alone, timed inside Rust (``_native.Pruner.time_prune``);
* ``native``: the binding called with ready int64/float32 arrays (conversion to u32,
  GIL release, numpy arrays built around the Rust buffers);
* ``python``: ``Pruner.prune`` as callers use it, from a context list of 512 tokens and
  numpy rows (tail slicing, dtype checks, the ``DraftTree``);
* ``torch``: the same from torch tensors (what the generation loop passes).

The overhead is ``native - rust`` and ``python - rust``. Draft rows come from the model's own
continuations of contexts drawn from it, topped up with random ids, with softmaxed decaying
noisy logits as probabilities (so the n-gram lookups hit as they would on real text).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dart_client.ngram import NGram
from dart_client.ngram.pruner import Pruner

LEVELS, K = 8, 25


def draft_requests(
    ng: NGram, n: int, seed: int = 0
) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """``n`` draft-like requests (context of 512 tokens, (L, k) ids, (L, k) probs)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        walk = [int(rng.integers(ng.vocab_size))]
        while len(walk) < 512 + LEVELS:
            nxt, _ = ng.top_k(walk[-2:], 8)
            if not len(nxt):  # an unseen token or pair: restart from a seen token
                nxt, _ = ng.top_k(walk[-1:], 8)
            walk.append(int(rng.choice(nxt)) if len(nxt) else int(rng.integers(ng.vocab_size)))
        context = walk[:512]
        ids = np.zeros((LEVELS, K), dtype=np.int64)
        for level in range(LEVELS):
            top, _ = ng.top_k(walk[: 512 + level], 12)
            row = [int(t) for t in top]
            while len(row) < K:
                t = int(rng.integers(ng.vocab_size))
                if t not in row:
                    row.append(t)
            ids[level] = rng.permutation(row[:K])
        logits = -0.35 * np.arange(K)[None, :] + rng.random((LEVELS, K))
        probs = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).astype(np.float32)
        out.append((context, ids, probs))
    return out


def per_call(repeats: int, fn: Callable[..., Any], *args: Any) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .ngram model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=20, help="calls per request and method")
    args = ap.parse_args(argv)

    ng = NGram.open(args.model, populate=True)
    pruner = Pruner(ng)
    native = pruner._native
    reqs = draft_requests(ng, args.requests)
    import torch

    results: dict[str, list[float]] = {"rust": [], "native": [], "python": [], "torch": []}
    for context, ids, probs in reqs:
        tail = np.asarray(context[-native.context_tail_len :], dtype=np.int64)
        results["rust"] += native.time_prune(tail, ids, probs, args.repeats).tolist()
        results["native"] += per_call(args.repeats, native.prune, tail, ids, probs)
        results["python"] += per_call(args.repeats, pruner.prune, context, ids, probs)
        tc, ti, tp = torch.tensor(context), torch.from_numpy(ids), torch.from_numpy(probs)
        results["torch"] += per_call(args.repeats, pruner.prune, tc, ti, tp)

    p50 = {k: float(np.percentile(v, 50)) * 1e6 for k, v in results.items()}
    p90 = {k: float(np.percentile(v, 90)) * 1e6 for k, v in results.items()}
    print(f"model: {args.model} (order {ng.order}, vocab {ng.vocab_size})")
    print(f"{args.requests} requests x {args.repeats} calls, k = {K}, {LEVELS} levels\n")
    print("| call | p50 (us) | p90 (us) | overhead over rust, p50 (us) |")
    print("|---|---:|---:|---:|")
    for k in results:
        print(f"| {k} | {p50[k]:.1f} | {p90[k]:.1f} | {p50[k] - p50['rust']:.1f} |")


if __name__ == "__main__":
    main()
