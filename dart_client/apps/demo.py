"""The README's main job on the embedded default.

1. Builds (once, then cached) a 3-gram model of ShareGPT's training split with SmolLM2's
   tokenizer, and shows its size, build time and a few queries.
2. Generates replies to a few prompts with SmolLM2-135M-Instruct (bf16, CPU) twice: plain
   autoregressive decoding and DART with the shipped head, and prints both speeds, tau and
   whether the outputs are identical. Greedy DART is lossless; in bf16 the tree forward and
   the one-token forward can still round a near-tie of the target's logits differently (the
   tests check that every such divergence is a near-tie; in float32/64 outputs match).
"""

from __future__ import annotations

import argparse
import time

from dart_client import embedded

EXAMPLE_CONTEXTS = [
    "<|im_start|>assistant\n",
    "Here is a Python function that",
    "Thank you for",
    "def __init__(self",
]


def ngram_demo(memory: str = "2G") -> None:
    from transformers import AutoTokenizer

    from dart_client.ngram import NGram
    from dart_client.ngram.embedded import ensure_ngram

    built = ensure_ngram(memory=memory)
    if built.built_now:
        print(f"built {built.path} in {built.build_seconds:.1f} s")
    else:
        print(f"using cached {built.path} (delete it to rebuild)")
    start = time.perf_counter()
    ng = NGram.open(built.path)
    open_ms = (time.perf_counter() - start) * 1e3
    info = ng.info()
    print(f"opened in {open_ms:.2f} ms")
    for key in (
        "order",
        "vocab_size",
        "total_tokens",
        "documents",
        "ngrams_per_order",
        "bytes",
        "bytes_per_ngram",
    ):
        if key in info:
            print(f"  {key}: {info[key]}")

    tokenizer = AutoTokenizer.from_pretrained(str(embedded.smollm2_tokenizer_dir()))
    for text in EXAMPLE_CONTEXTS:
        context = tokenizer.encode(text, add_special_tokens=False)
        ids, probs = ng.top_k(context, 5)
        shown = ", ".join(
            f"{tokenizer.decode([int(t)])!r} {float(p):.3f}"
            for t, p in zip(ids, probs, strict=True)
        )
        print(f"{text!r} -> {shown}")


DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Give me three tips for writing a clear email to a colleague.",
]


def generation_demo(max_new_tokens: int, threads: int | None) -> None:
    import torch

    from dart_client.dart_model import build_model

    if threads:
        torch.set_num_threads(threads)
    # The tree size that is fastest on this machine (a CPU affords far fewer nodes than a
    # GPU): tuned at the first run, then read from the tuning cache.
    notes: list[str] = []
    dart = build_model(None, "auto", "embedded", dtype="bf16", tree_budget="auto", notes=notes)
    budget = dart.tune()
    print(
        f"\nSmolLM2-135M-Instruct bf16 on CPU, head {embedded.shipped_head().name}, greedy, "
        f"{max_new_tokens} new tokens per prompt; tree of {budget} draft nodes "
        f"({notes[-1] if notes else 'tuned now'})"
    )
    # One short warm-up of each, so first-call costs don't count.
    for mode in ("ar", "dart"):
        dart.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=8, mode=mode)
    totals = {"ar": [0, 0.0], "dart": [0, 0.0]}
    steps = accepted = 0
    for prompt in DEMO_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ar = dart.generate(messages=messages, max_new_tokens=max_new_tokens, mode="ar")
        out = dart.generate(messages=messages, max_new_tokens=max_new_tokens)
        for name, result in (("ar", ar), ("dart", out)):
            totals[name][0] += len(result.tokens)
            totals[name][1] += result.elapsed
        steps += out.steps
        accepted += sum(out.accept_lengths[1:])
        same = (
            "identical"
            if list(ar.tokens) == list(out.tokens)
            else "different (a bf16 near-tie: see the docstring)"
        )
        print(
            f"\n> {prompt}\n{out.text.strip()}\n"
            f"[AR {ar.tokens_per_second:.1f} tok/s | DART {out.tokens_per_second:.1f} tok/s, "
            f"tau {out.tau:.2f} | outputs {same}]"
        )
    ar_speed = totals["ar"][0] / totals["ar"][1]
    dart_speed = totals["dart"][0] / totals["dart"][1]
    print(
        f"\noverall: autoregressive {ar_speed:.1f} tok/s, DART {dart_speed:.1f} tok/s "
        f"({dart_speed / ar_speed:.2f}x), tau {accepted / max(steps, 1):.2f}"
    )


def parser() -> argparse.ArgumentParser:
    """``dart demo``'s options (``--ui`` is handled by :func:`dart_client.apps.cli.demo_main`;
    it is listed here so that ``dart demo --help`` shows it)."""
    p = argparse.ArgumentParser(
        prog="dart demo",
        description="The embedded default end to end: builds (once) the ShareGPT 3-gram and "
        "shows a few queries, then generates replies with SmolLM2-135M-Instruct twice, "
        "autoregressive and DART with the shipped head, and compares speed and outputs.",
    )
    p.add_argument(
        "--ui",
        action="store_true",
        help="instead, serve the side-by-side page (DART and autoregressive racing in the "
        "browser); `dart demo --ui --help` lists its options (--port, --host, --base, ...)",
    )
    p.add_argument("--memory", default="2G", help="memory budget of the n-gram build")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--skip-generation", action="store_true", help="the n-gram part only")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    ngram_demo(memory=args.memory)
    if not args.skip_generation:
        generation_demo(args.max_new_tokens, args.threads)


if __name__ == "__main__":
    main()
