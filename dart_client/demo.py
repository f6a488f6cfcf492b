"""The README's main job on the embedded default.

Builds (once, then cached) a 3-gram model of ShareGPT's training split with SmolLM2's
tokenizer, then shows its size, build time and a few queries.
"""

from __future__ import annotations

import argparse
import time

from dart_client import embedded
from dart_client.embedded_ngram import ensure_ngram

EXAMPLE_CONTEXTS = [
    "<|im_start|>assistant\n",
    "Here is a Python function that",
    "Thank you for",
    "def __init__(self",
]


def ngram_demo(memory: str = "2G") -> None:
    from transformers import AutoTokenizer

    from dart_client.ngram import NGram

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
    for key in ("order", "vocab_size", "total_tokens", "documents", "ngrams_per_order", "bytes",
                "bytes_per_ngram"):
        if key in info:
            print(f"  {key}: {info[key]}")

    tokenizer = AutoTokenizer.from_pretrained(str(embedded.smollm2_tokenizer_dir()))
    for text in EXAMPLE_CONTEXTS:
        context = tokenizer.encode(text, add_special_tokens=False)
        ids, probs = ng.top_k(context, 5)
        shown = ", ".join(
            f"{tokenizer.decode([int(t)])!r} {float(p):.3f}" for t, p in zip(ids, probs)
        )
        print(f"{text!r} -> {shown}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memory", default="2G", help="memory budget of the n-gram build")
    args = parser.parse_args(argv)
    ngram_demo(memory=args.memory)


if __name__ == "__main__":
    main()
