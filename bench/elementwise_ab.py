"""A native CPU path on and off, side by side: one process verifies the same trees with it
switched off and on in turn, forward by forward, so a busy machine slows both alike. Per shape:
the median forward each way (ms of this thread's CPU time) and the median of the pairs' ratios.

    python bench/elementwise_ab.py [--switch elementwise|whole-layer|native-forward]
        [--shapes 1x1 1x12 4x1 4x5] [--context 256] [--pairs 15]

``elementwise``: the native norms, rotary embedding and SiLU product against transformers' ops.
``whole-layer``: a decoder layer in one native call (``_native.decoder_layer``) against the
same kernels called one by one from Python. ``native-forward``: a decoding step's layers looped
by ``elementwise.native_forward`` against transformers' model forward calling them.

The embedded SmolLM2-135M in bf16, 1 thread (figures: docs/performance-notes.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dart_client.dart_model import build_model
from dart_client.decoding.autotune import _prefilled, _random_tree
from dart_client.decoding.verify import verify_trees
from dart_client.models import elementwise


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1x1", "1x12", "4x1", "4x5"])
    p.add_argument("--context", type=int, default=256, help="cached tokens of every row")
    p.add_argument("--pairs", type=int, default=15, help="forwards each way per shape")
    p.add_argument(
        "--switch", choices=["elementwise", "whole-layer", "native-forward"], default="elementwise"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_model(None, "auto", "embedded", dtype="bf16", device="cpu", notes=[])
    target = model.target
    if not target.native_elementwise:
        raise SystemExit("the native element-wise kernels are off here (not a CPU bf16 target)")
    rng = np.random.default_rng(1)
    prefilled = _prefilled(model, args.context, 0)[0]
    whole_layer, native_forward = elementwise._native_layer, elementwise.native_forward
    off, on = {
        "elementwise": ("transformers' ops", "native"),
        "whole-layer": ("kernels one by one", "one call per layer"),
        "native-forward": ("transformers' layer loop", "native_forward"),
    }[args.switch]

    def switch(native: bool) -> None:
        if args.switch == "native-forward":
            elementwise.native_forward = native_forward if native else lambda *a, **k: None
        elif args.switch == "whole-layer":
            elementwise._native_layer = whole_layer if native else lambda *a, **k: None
        elif native:
            elementwise.use_native_elementwise(target.model)
        else:
            elementwise.restore(target.model)

    print(f"| rows x nodes | {off}, ms | {on}, ms | {on} / {off} (pairs) |")
    print("|---|---:|---:|---:|")
    for shape in args.shapes:
        rows, nodes = (int(x) for x in shape.split("x"))
        cache = target.new_cache(args.context + nodes + 1, rows)
        for row in range(rows):
            cache.put_row(row, prefilled)
        frontier = cache.length
        trees = [_random_tree(nodes, rng, target.vocab_size)] * rows
        ms: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.pairs + 1):
            for native in (False, True):
                switch(native)
                start = time.thread_time()
                verify_trees(target, cache, trees, taps=nodes > 1)
                if i:  # the first pair pays for new shapes
                    ms[native].append(1e3 * (time.thread_time() - start))
                cache.truncate(frontier)
        ratios = [b / a for a, b in zip(ms[False], ms[True], strict=True)]
        print(
            f"| {shape} | {statistics.median(ms[False]):.1f} | {statistics.median(ms[True]):.1f} "
            f"| {statistics.median(ratios):.3f} |"
        )


if __name__ == "__main__":
    main()
