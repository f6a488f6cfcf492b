"""Per-step costs of the static decoding path on a target of a given shape (random weights).

    python -m dart_client.apps.bench.gpu_shapes [--shape llama3-8b|smollm2|tiny]
        [--base embedded|PATH] [--device cuda] [--dtype bf16] [--context 300] [--tree 61]
        [--steps 30] [--ngram PATH] [--json OUT.json]

What #20's cost goals are about, measured at a cache of ``--context`` tokens (restored after
every timed step, so each runs at the same length), each a median over ``--steps`` runs:

* ``ar_step_ms``: one autoregressive step on the static path (copy in, the one-token graph
  with its greedy pick, copy out); ``ar_kernel_ms``: the GPU kernel time the profiler counts
  for it (cuda only). Goal: wall within 1.25x of kernels.
* ``tree_step_ms`` / ``one_node_step_ms``: a DART step (target forward over a ``--tree``-node
  tree padded to its bucket, acceptance, compaction and the head's draft) against the same
  step over the root alone. Goal: a 60-node tree within 1.3x of one token.
* ``draft_ms``: the head's share of the tree step (the step with the head less the same
  step without it). Goal: under 1 ms.
* ``load_ms``, ``replay_ms``, ``readback_ms``: the tree step's three phases; with
  ``--ngram``, ``prune_ms``: the Rust pruner building the tree from the drafted rows.
  ``host_vs_ar_step``: load + readback + prune against one AR step. Goal: under 10%.
* ``eager_forward_ms``: the dynamic (eager) path's one-token forward, for comparison.
* with ``--batch N`` (N > 1), the static batch program over N rows of the same context
  (``decoding/static_batch.py``): ``batch_ar_step_ms`` (one token per row),
  ``batch_tree_step_ms`` (a tree per row, every row's next draft inside) and without the
  head, their kernel times, and ``batch_ar_vs_ar`` (N rows' AR step against one row's).

Random weights cost what trained ones cost; acceptance is not measured here (``dart bench``
measures it with the trained head). ``--base`` measures a real target instead of a shape
(``embedded``: the embedded SmolLM2, as ``dart bench`` loads it), to tell a cost of the
model from a cost of the decoding loop. On cuda the report also lists the kernels that take
most of an AR step's GPU time (``ar_top_kernels``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dart_client.apps.options import add_device_argument

#: Target shapes (Llama layout). ``llama3-8b`` with the 49k vocabulary of #20's measurements.
SHAPES: dict[str, dict[str, int]] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=49152,
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=384,
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The draft vocabulary of the heads DART ships (at most the target's).
DRAFT_VOCAB = 32000


def build_target(shape: str, dtype: torch.dtype, device: str, seed: int = 0) -> Any:
    """A random-weight Llama causal LM of ``shape``, made directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def kernel_ms(
    run: Callable[[], Any], repeats: int, top: list[dict[str, Any]] | None = None
) -> float | None:
    """GPU kernel time per ``run()`` as the profiler counts it (None off cuda); ``top``
    receives the 12 kernels with the most time per run (name, ms, calls per run)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = float(
            getattr(event, "self_device_time_total", None)
            or getattr(event, "self_cuda_time_total", 0.0)
        )
        rows.append((us, event.key, event.count))
    if top is not None:
        for us, name, count in sorted(rows, reverse=True)[:12]:
            top.append({"kernel": name[:120], "ms": us / 1000 / repeats, "calls": count / repeats})
    return sum(us for us, _, _ in rows) / 1000 / repeats


def measure(
    shape: str,
    device: str,
    dtype: torch.dtype,
    context: int,
    tree_nodes: int,
    steps: int,
    ngram: str | None = None,
    base: str | None = None,
    batch: int = 1,
) -> dict[str, Any]:
    """The figures of the module docstring, in milliseconds (``base``: a real target
    instead of ``shape``'s random one)."""
    from dart_client.decoding.draft import draft_rows
    from dart_client.decoding.prune import PrunerTreeBuilder, build_tree
    from dart_client.decoding.static import StaticVerifier, static_capacity
    from dart_client.decoding.verify import Tree
    from dart_client.models.head import DartHead
    from dart_client.models.target import TargetModel

    if base is None:
        model = build_target(shape, dtype, device)
    else:
        from dart_client.loading import load_target

        model, _ = load_target(None if base == "embedded" else base, dtype=dtype, device_map=device)
        shape = base
    target = TargetModel(model, cpu_kernels=target_device(model).type == "cpu")
    dev = target.device
    vocab = target.vocab_size
    head = DartHead.random_init(
        model.config, draft_length=7, draft_vocab_size=min(DRAFT_VOCAB, vocab), seed=1
    ).to(device=dev, dtype=dtype)
    head.bind_embedding(target.embedding())
    graphs = dev.type == "cuda"
    top_k = 8

    def sync_clock() -> float:
        if graphs:
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    rng = np.random.default_rng(0)
    cache = target.new_cache(static_capacity(context + 1, tree_nodes))
    prompt = torch.tensor([rng.integers(0, vocab, size=context).tolist()], device=dev)
    _, taps = target.forward(prompt, torch.arange(context, device=dev)[None], cache)
    assert taps is not None
    drafting = StaticVerifier(target, cache, tree_nodes, graphs=graphs, head=head, top_k=top_k)
    assert drafting.head_cache is not None
    following = torch.cat([prompt[:, 1:], prompt[:, :1]], dim=1)  # the token after each
    rows = draft_rows(head, drafting.head_cache, taps, following, top_k)
    head_length = drafting.head_cache.length
    plain = StaticVerifier(target, cache, tree_nodes, graphs=graphs)
    one_token = StaticVerifier(target, cache, 1, graphs=graphs)
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, tree_nodes)]
    tree = Tree.build(rng.integers(0, vocab, size=tree_nodes).tolist(), parents)
    root = Tree.root_only(int(rng.integers(0, vocab)))

    def restore() -> None:
        cache.truncate(context)
        drafting.head_cache.length = head_length  # type: ignore[union-attr]

    def timed(run: Callable[[], Any]) -> float:
        run()  # warm: the first run of a bucket captures its graph
        restore()
        samples = []
        for _ in range(steps):
            t0 = sync_clock()
            run()
            samples.append(sync_clock() - t0)
            restore()
        return 1000 * statistics.median(samples)

    phases: dict[str, list[float]] = {"load": [], "replay": [], "readback": []}
    last: dict[str, Any] = {}

    def phased_step() -> None:
        t0 = sync_clock()
        state = drafting.load(tree)
        t1 = sync_clock()
        out = drafting.run_greedy(state)
        t2 = sync_clock()
        last["step"] = drafting.accepted(state, out, tree)
        t3 = sync_clock()
        for key, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[key].append(seconds)

    token = torch.tensor([[1]], device=dev)
    position = torch.tensor([[context]], device=dev)
    report: dict[str, Any] = {
        "shape": shape,
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if graphs else None,
        # The layers' element-wise parts: the Triton kernels (cuda's default) or PyTorch's.
        "gpu_kernels": "triton" if target.gpu_kernels else "torch",
        "gpu_attention": "triton" if target.replaced_attention and graphs else "sdpa",
        "dtype": str(dtype).removeprefix("torch."),
        "context": context,
        "tree_nodes": tree_nodes,
        "bucket": drafting.bucket(tree_nodes),
        "steps": steps,
        "torch": torch.__version__,
        "attention": getattr(model.config, "_attn_implementation", None),
        "capacity": cache.capacity,
        "ar_step_ms": timed(lambda: one_token.greedy_step(root)),
        "one_node_step_ms": timed(lambda: drafting.greedy_step(root)),
        "tree_step_ms": timed(lambda: drafting.greedy_step(tree)),
        "tree_step_without_head_ms": timed(lambda: plain.greedy_step(tree)),
        "eager_forward_ms": timed(
            lambda: target.forward(token, position, cache, logits_to_keep=1, taps=False)
        ),
    }
    timed(phased_step)
    for key, values in phases.items():
        report[f"{key}_ms"] = 1000 * statistics.median(values[1:])  # the warm-up run dropped
    report["draft_ms"] = report["tree_step_ms"] - report["tree_step_without_head_ms"]
    report["tree_vs_one_token"] = report["tree_step_without_head_ms"] / report["ar_step_ms"]
    prune = 0.0
    if ngram is not None:
        from dart_client.ngram import NGram
        from dart_client.ngram.pruner import Pruner

        builder = PrunerTreeBuilder(Pruner(NGram.open(ngram)))
        drafted = last["step"].rows if last["step"].rows is not None else rows
        context_ids = np.asarray(prompt[0, -8:].tolist(), dtype=np.int64)
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter()
            build_tree(builder, context_ids, drafted, tree_nodes - 1, None)
            samples.append(time.perf_counter() - t0)
        prune = 1000 * statistics.median(samples)
        report["prune_ms"] = prune
    host = report["load_ms"] + report["readback_ms"] + prune
    report["host_vs_ar_step"] = host / report["ar_step_ms"]
    top: list[dict[str, Any]] = []
    kernels = kernel_ms(lambda: (one_token.greedy_step(root), restore()), steps, top)
    report["ar_kernel_ms"] = kernels
    report["ar_top_kernels"] = top
    report["ar_wall_vs_kernels"] = report["ar_step_ms"] / kernels if kernels else None
    tree_kernels = kernel_ms(lambda: (plain.greedy_step(tree), restore()), steps)
    report["tree_kernel_ms"] = tree_kernels
    if batch > 1:
        report.update(
            _batch_figures(target, head, cache, drafting, tree, root, batch, context, timed, steps)
        )
    return report


def _batch_figures(
    target: Any,
    head: Any,
    single: Any,
    drafting: Any,
    tree: Any,
    root: Any,
    batch: int,
    context: int,
    timed: Callable[[Callable[[], Any]], float],
    steps: int,
) -> dict[str, Any]:
    """The static batch program's step over ``batch`` copies of ``single``'s context."""
    from dart_client.decoding.static import static_capacity
    from dart_client.decoding.static_batch import StaticBatchVerifier

    graphs = target.device.type == "cuda"
    cache = target.new_cache(static_capacity(context + 1, len(tree)), batch)
    head_cache = head.new_cache(drafting.head_cache.capacity, batch)
    for row in range(batch):
        cache.put_row(row, single)
        head_cache.put_row(row, drafting.head_cache)
    plain = StaticBatchVerifier(target, cache, len(tree), graphs=graphs)
    with_head = StaticBatchVerifier(
        target,
        cache,
        len(tree),
        graphs=graphs,
        head=head,
        head_cache=head_cache,
        top_k=drafting.top_k,
    )
    rows, heads = list(cache.rows.lengths), list(head_cache.rows.lengths)

    def restore() -> None:
        cache.grow_rows([n - now for n, now in zip(rows, cache.rows.lengths, strict=True)])
        head_cache.grow_rows(
            [n - now for n, now in zip(heads, head_cache.rows.lengths, strict=True)]
        )

    def run(verifier: Any, trees: list[Any]) -> Callable[[], Any]:
        return lambda: (verifier.greedy_step(trees), restore())

    ar = run(plain, [root] * batch)
    trees = run(with_head, [tree] * batch)
    without_head = run(plain, [tree] * batch)
    out: dict[str, Any] = {
        "batch": batch,
        "batch_ar_step_ms": timed(ar),
        "batch_tree_step_ms": timed(trees),
        "batch_tree_step_without_head_ms": timed(without_head),
    }
    out["batch_draft_ms"] = out["batch_tree_step_ms"] - out["batch_tree_step_without_head_ms"]
    out["batch_ar_kernel_ms"] = kernel_ms(ar, steps)
    out["batch_tree_kernel_ms"] = kernel_ms(trees, steps)
    return out


def target_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def markdown(report: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        value = report.get(key)
        return "-" if value is None else f"{value:.3f}"

    def ratio(key: str) -> str:
        value = report.get(key)
        return "-" if value is None else f"{value:.2f}x"

    where = report["gpu"] or report["device"]
    return "\n".join(
        [
            f"{report['shape']} ({report['dtype']}) on {where}, cache of {report['context']} "
            f"tokens, {report['tree_nodes']}-node tree (bucket {report['bucket']}), medians "
            f"of {report['steps']} steps",
            "",
            "| figure | ms | goal |",
            "|---|---:|---|",
            f"| AR step (static path) | {ms('ar_step_ms')} | within 1.25x of kernels |",
            f"| its GPU kernel time | {ms('ar_kernel_ms')} | wall/kernels "
            f"{ratio('ar_wall_vs_kernels')} |",
            f"| tree step without the head | {ms('tree_step_without_head_ms')} | within 1.3x "
            f"of an AR step: {ratio('tree_vs_one_token')} |",
            f"| tree step's kernel time | {ms('tree_kernel_ms')} | |",
            f"| tree step with the head's draft | {ms('tree_step_ms')} | |",
            f"| the draft | {ms('draft_ms')} | under 1 ms |",
            f"| root-only step with the draft | {ms('one_node_step_ms')} | |",
            f"| copy in / replay / copy out | {ms('load_ms')} / {ms('replay_ms')} / "
            f"{ms('readback_ms')} | |",
            f"| pruner | {ms('prune_ms')} | |",
            f"| host work per step / AR step | {ratio('host_vs_ar_step')} | under 0.10x |",
            f"| eager one-token forward (dynamic path) | {ms('eager_forward_ms')} | |",
            *(
                [
                    f"| {report['batch']} rows: AR step / its kernels | "
                    f"{ms('batch_ar_step_ms')} / {ms('batch_ar_kernel_ms')} | |",
                    f"| {report['batch']} rows: tree step with the drafts / its kernels | "
                    f"{ms('batch_tree_step_ms')} / {ms('batch_tree_kernel_ms')} | |",
                    f"| {report['batch']} rows: tree step without the head | "
                    f"{ms('batch_tree_step_without_head_ms')} | |",
                    f"| {report['batch']} rows: the drafts | {ms('batch_draft_ms')} | |",
                ]
                if report.get("batch")
                else []
            ),
            "",
            f"attention: {report.get('attention')}, cache capacity {report.get('capacity')}",
            *(
                f"- {k['ms']:.3f} ms, {k['calls']:.0f} calls: {k['kernel']}"
                for k in report.get("ar_top_kernels") or []
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument(
        "--base",
        default=None,
        help="a real target instead of --shape: 'embedded' (SmolLM2) or a path / hub id",
    )
    add_device_argument(p, "cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--tree", type=int, default=61, help="tree nodes, the root included")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=1, help="also time the batch program over N rows")
    p.add_argument("--ngram", default=None, help="an n-gram file: time the pruner as well")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("context", "tree", "steps", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    report = measure(
        args.shape,
        args.device,
        DTYPES[args.dtype],
        args.context,
        args.tree,
        args.steps,
        args.ngram,
        args.base,
        args.batch,
    )
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
