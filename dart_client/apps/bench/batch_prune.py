"""What building a batch's draft trees costs the host, per decoding step.

    python -m dart_client.apps.bench.batch_prune --model MODEL.ngram [--rows 8 32]
        [--budgets 1 4 11 31] [--gap-ms 3] [--calls 200]

A batched DART step drafts on the device, then prunes every row's tree on the host
(:func:`~dart_client.decoding.prune.build_trees`, one ``prune_batch`` call), then verifies on
the device: the pruning is on the step's critical path, and between two steps the host waits
for the device for a few milliseconds, long enough for the pruner's pool threads to fall
asleep. Each call here follows such an idle gap (``--gap-ms``, spent spinning as a host thread
waiting on the device does), on the same draft-like requests as ``pruner_overhead`` (the
model's own continuations topped up with random ids, k = 25, ``--levels`` rows as the shipped
head drafts), and reports p50 and p90 per call of:

* ``build_trees``: the step's prune stage as the batch loop calls it (inputs checked, one
  ``prune_batch`` call, the trees as the verifier takes them);
* ``prune_batch``: the native call alone, with ready arrays;
* ``one_by_one``: the same rows pruned one after another on the calling thread (no pool), the
  floor a batch call should never be above.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from dart_client.apps.bench.pruner_overhead import K, draft_requests
from dart_client.decoding.draft import DraftRows
from dart_client.decoding.prune import PrunerTreeBuilder, build_trees
from dart_client.ngram import NGram
from dart_client.ngram.pruner import Pruner


def _idle(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _one_by_one(
    native: Any,
    tails: list[np.ndarray],
    ids: np.ndarray,
    probs: np.ndarray,
    budget: int,
    offsets: list[int],
) -> list[Any]:
    return [
        native.prune(tails[b], ids[b], probs[b], budget, offsets[b], None)
        for b in range(len(tails))
    ]


def timed(calls: int, gap: float, fn: Callable[[], Any]) -> list[float]:
    """Seconds per call of ``fn``, each after ``gap`` seconds of idling."""
    fn()
    times = []
    for _ in range(calls):
        _idle(gap)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .ngram model")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="rows per batch")
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 4, 11, 31])
    ap.add_argument("--levels", type=int, default=3, help="draft rows per tree (the head's)")
    ap.add_argument("--gap-ms", type=float, default=3.0, help="idle time before each call")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per figure")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    ng = NGram.open(args.model, populate=True)
    pruner = Pruner(ng)
    native = pruner._native
    builder = PrunerTreeBuilder(pruner)
    tail = native.context_tail_len
    reqs = draft_requests(ng, max(args.rows))
    gap = args.gap_ms / 1e3
    print(f"model: {args.model} (order {ng.order}, vocab {ng.vocab_size})")
    print(
        f"k = {K}, {args.levels} levels, {args.gap_ms} ms idle before each of {args.calls} "
        f"calls; {os.cpu_count()} CPUs\n"
    )
    print("| rows | budget | build_trees p50 / p90 (us) | prune_batch | one_by_one |")
    print("|---:|---:|---:|---:|---:|")
    figures = []
    for rows in args.rows:
        contexts = [np.asarray(c[-8:], dtype=np.int64) for c, _, _ in reqs[:rows]]
        drafts = [
            DraftRows(ids=i[: args.levels].copy(), probs=p[: args.levels].copy())
            for _, i, p in reqs[:rows]
        ]
        tails = [c[-tail:] for c in contexts]
        ids = np.stack([d.ids for d in drafts])
        probs = np.stack([d.probs for d in drafts])
        offsets = [len(c) - len(t) for c, t in zip(contexts, tails, strict=True)]
        for budget in args.budgets:
            budgets = [budget] * rows
            calls: dict[str, Callable[[], Any]] = {
                "build_trees": partial(
                    build_trees, builder, contexts, drafts, budgets, [None] * rows
                ),
                "prune_batch": partial(
                    native.prune_batch, tails, ids, probs, budgets, offsets, None
                ),
                "one_by_one": partial(_one_by_one, native, tails, ids, probs, budget, offsets),
            }
            row: dict[str, Any] = {"rows": rows, "budget": budget}
            for name, fn in calls.items():
                t = np.asarray(timed(args.calls, gap, fn)) * 1e6
                row[name] = {
                    "p50_us": float(np.percentile(t, 50)),
                    "p90_us": float(np.percentile(t, 90)),
                }
            figures.append(row)
            cells = [f"{row[n]['p50_us']:.0f} / {row[n]['p90_us']:.0f}" for n in calls]
            print(f"| {rows} | {budget} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"levels": args.levels, "gap_ms": args.gap_ms, "figures": figures}, f, indent=1
            )


if __name__ == "__main__":
    main()
