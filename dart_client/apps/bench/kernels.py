"""The target's forward cost per tree size, with and without the CPU decoding kernels.

    python -m dart_client.apps.bench.kernels [--base MODEL] [--dtype bf16] [--context 300]
        [--sizes 1 2 4 8 16 32 64] [--repeats 7] [--threads N] [--json OUT.json]

One model is loaded; for every tree size it times the target forward (``verify``: inside
the model call only) over ``n`` new tokens on a cache of ``--context`` tokens, alternating
PyTorch's own kernels (``plain``) and the decoding kernels of
:class:`~dart_client.models.target.TargetModel` (packed linear layers, small-query attention)
with oneDNN's matmul (``onednn``) and with DART's (``dart``, bf16 on AVX-512/AVX2 CPUs), so all
see the same machine state. Reported: the median milliseconds and the
cost relative to one token with the same kernels -- the ratio that decides how large a tree
pays off (see :mod:`dart_client.decoding.autotune`).
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

from dart_client import _native
from dart_client.models.linear import set_cpu_matmul
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


def kernel_sets(target: TargetModel) -> list[str]:
    """The kernel sets worth timing on this target: PyTorch's own (``plain``), oneDNN-packed
    linear layers, and DART's matmul where it applies (bf16 on an AVX-512 or AVX2 CPU)."""
    kinds = ["plain", "onednn"]
    if target.model.dtype == torch.bfloat16 and _native.decoding_matmul_simd():
        kinds.append("dart")
    return kinds


def use_kernels(target: TargetModel, kind: str) -> None:
    """Switch ``target`` to the kernel set ``kind`` (see :func:`kernel_sets`)."""
    if kind == "plain":
        target.set_cpu_kernels(False)
        return
    set_cpu_matmul("dart" if kind == "dart" else "onednn")
    target.set_cpu_kernels(True)


def measure(
    target: TargetModel, sizes: list[int], context: int, repeats: int
) -> dict[str, dict[int, float]]:
    """Median forward milliseconds per size for every kernel set, interleaved (after one
    warm-up forward of each); the target is left on the default decoding kernels."""
    kinds = kernel_sets(target)
    times: dict[str, dict[int, list[float]]] = {kind: {} for kind in kinds}
    for kind in kinds:
        use_kernels(target, kind)
        forward_ms(target, max(sizes), context, seed=0)
    for r in range(repeats):
        for n in sizes:
            for kind in kinds if r % 2 == 0 else reversed(kinds):
                use_kernels(target, kind)
                # Untimed: a switch repacks the weights at the first decoding forward.
                forward_ms(target, 1, 4, seed=r)
                times[kind].setdefault(n, []).append(forward_ms(target, n, context, seed=r))
    set_cpu_matmul("auto")
    target.set_cpu_kernels(True)
    return {k: {n: statistics.median(v) for n, v in d.items()} for k, d in times.items()}


def markdown(result: dict[str, dict[int, float]]) -> str:
    kinds = list(result)
    lines = [
        "| tokens | "
        + " | ".join(f"{k} ms" for k in kinds)
        + " | "
        + " | ".join(f"{k} / 1 token" for k in kinds)
        + " |",
        "|---:|" + "---:|" * (2 * len(kinds)),
    ]
    first = min(result[kinds[0]])
    for n in sorted(result[kinds[0]]):
        ms = " | ".join(f"{result[k][n]:.1f}" for k in kinds)
        ratio = " | ".join(f"{result[k][n] / result[k][first]:.2f}x" for k in kinds)
        lines.append(f"| {n} | {ms} | {ratio} |")
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

    from dart_client.dart_model import build_model

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
