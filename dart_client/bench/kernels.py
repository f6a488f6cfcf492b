"""The target's forward cost per tree size, with and without the CPU decoding kernels.

    python -m dart_client.bench.kernels [--base MODEL] [--dtype bf16] [--context 300]
        [--sizes 1 2 4 8 16 32 64] [--repeats 7] [--threads N] [--json OUT.json]

One model is loaded; for every tree size it times the target forward (``verify``: inside
the model call only) over ``n`` new tokens on a cache of ``--context`` tokens, alternating
the plain PyTorch kernels and the decoding kernels of
:class:`~dart_client.models.target.TargetModel` (oneDNN-packed linear layers, small-query
attention) so both see the same machine state. Reported: the median milliseconds and the
cost relative to one token with the same kernels -- the ratio that decides how large a tree
pays off (see :mod:`dart_client.autotune`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dart_client.models.target import TargetModel


def forward_ms(target: TargetModel, n: int, context: int, seed: int) -> float:
    """Milliseconds of one target forward over ``n`` chained tokens after ``context``."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    cache = target.new_cache(context + n)
    device = target.device
    ids = torch.randint(0, vocab, (1, context), generator=g).to(device)
    target.forward(ids, torch.arange(context, device=device).unsqueeze(0), cache, taps=False)
    new = torch.randint(0, vocab, (1, n), generator=g).to(device)
    mask = torch.ones((n, n), dtype=torch.bool).tril()
    positions = torch.arange(context, context + n, device=device).unsqueeze(0)
    target.forward(new, positions, cache, tree_mask=mask, logits_to_keep=0)
    return 1000 * target.last_forward_seconds


def measure(
    target: TargetModel, sizes: list[int], context: int, repeats: int
) -> dict[str, dict[int, float]]:
    """Median forward milliseconds per size for ``plain`` and ``decoding`` kernels,
    interleaved (after one warm-up forward of each)."""
    times: dict[str, dict[int, list[float]]] = {"plain": {}, "decoding": {}}
    for kind in times:
        target.set_cpu_kernels(kind == "decoding")
        forward_ms(target, max(sizes), context, seed=0)
    for r in range(repeats):
        for n in sizes:
            for kind in ("plain", "decoding") if r % 2 == 0 else ("decoding", "plain"):
                target.set_cpu_kernels(kind == "decoding")
                times[kind].setdefault(n, []).append(forward_ms(target, n, context, seed=r))
    target.set_cpu_kernels(True)
    return {k: {n: statistics.median(v) for n, v in d.items()} for k, d in times.items()}


def markdown(result: dict[str, dict[int, float]]) -> str:
    lines = [
        "| tokens | plain ms | decoding kernels ms | plain / 1 token | decoding / 1 token |",
        "|---:|---:|---:|---:|---:|",
    ]
    plain, fast = result["plain"], result["decoding"]
    first = min(plain)
    for n in sorted(plain):
        lines.append(
            f"| {n} | {plain[n]:.1f} | {fast[n]:.1f} | {plain[n] / plain[first]:.2f}x | "
            f"{fast[n] / fast[first]:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.sizes) < 1 or args.context < 1 or args.repeats < 1:
        p.error("--sizes, --context and --repeats must be positive")

    from dart_client.cli import build_model

    model = build_model(args.base, None, None, dtype=args.dtype, ar=True)
    target: TargetModel = model.target
    result = measure(target, sorted(set(args.sizes)), args.context, args.repeats)
    print(markdown(result))
    load = os.getloadavg()
    print(
        f"{args.dtype}, {torch.get_num_threads()} thread(s), context {args.context}, "
        f"median of {args.repeats}; load average {load[0]:.2f}"
    )
    if args.json:
        report: dict[str, Any] = dict(
            result, dtype=args.dtype, context=args.context, threads=torch.get_num_threads()
        )
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
