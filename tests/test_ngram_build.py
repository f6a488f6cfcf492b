"""Building n-gram models from Python: real ShareGPT text with the real SmolLM2 tokenizer
against a plain Python counter, fingerprints, reference-trie import, bad input, Ctrl-C."""

from __future__ import annotations

import _thread
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import sharegpt_texts
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client.ngram import NGram, NGramError
from dart_client.ngram.build import (
    build,
    hf_tokenizer_fingerprint,
    import_dart,
    parse_memory,
    tokenizer_fingerprint,
    tokenizer_json_fingerprint,
    vocab_fingerprint,
    write_reference_trie,
)

ORDER = 3


def count_docs(docs: list[list[int]], order: int) -> tuple[Counter[tuple[int, ...]], int]:
    """Every k-gram (k = 1..order) inside each document, once per occurrence."""
    counts: Counter[tuple[int, ...]] = Counter()
    total = 0
    for d in docs:
        total += len(d)
        for i in range(len(d)):
            for n in range(1, min(order, len(d) - i) + 1):
                counts[tuple(d[i : i + n])] += 1
    return counts, total


def brute_prob(
    counts: Counter[tuple[int, ...]], order: int, context: list[int], c: int
) -> tuple[float, int]:
    """The reference's backoff: longest seen context such that context + c was seen."""
    for n in range(min(order - 1, len(context)), 0, -1):
        ctx = tuple(context[len(context) - n :])
        if ctx in counts and (*ctx, c) in counts:
            return counts[(*ctx, c)] / counts[ctx], n
    return 0.0, 0


def hidden_entries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def sharegpt_build(smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A model built from 200 real ShareGPT conversations, and the Python-side counts."""
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("sharegpt")
    texts = sharegpt_texts(200)
    corpus = d / "sharegpt.jsonl"
    with corpus.open("w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "other": [1, {"x": None}]}) + "\n")
    tok_json = smollm2_tokenizer_dir / "tokenizer.json"
    out = d / "sharegpt.ngram"
    # A 1 MiB budget forces many spills and merges on this ~0.5M-token corpus.
    report = build([corpus], out, tokenizer=tok_json, order=ORDER, memory="1M", threads=2)
    tok = Tokenizer.from_file(str(tok_json))
    eos = tok.token_to_id("<|im_end|>")
    docs = [[*tok.encode(t, add_special_tokens=True).ids, eos] for t in texts]
    counts, total = count_docs(docs, ORDER)
    return report, out, counts, total, docs, eos


def test_sharegpt_counts_match_python_counter(sharegpt_build) -> None:
    report, out, counts, total, docs, eos = sharegpt_build
    ng = NGram.open(out)
    info = ng.info()
    assert report["documents"] == len(docs) == info["documents"]
    assert report["tokens"] == total == ng.count([]) == info["total_tokens"]
    assert report["eos_id"] == eos == ng.eos_id
    assert report["spilled_runs"] > 0
    per_order = [sum(1 for g in counts if len(g) == n) for n in range(1, ORDER + 1)]
    assert report["ngrams_per_order"] == per_order == list(info["ngrams_per_order"])
    rng = random.Random(0)
    sample = rng.sample(sorted(counts), 20000)
    for g in sample:
        assert ng.count(list(g)) == counts[g], g
    # Absent n-grams count 0.
    present = set(counts)
    for _ in range(2000):
        g = tuple(rng.randrange(ng.vocab_size) for _ in range(3))
        if g not in present:
            assert ng.count(list(g)) == 0


def test_sharegpt_probabilities_match_python_counter(sharegpt_build) -> None:
    _, out, counts, _, docs, _ = sharegpt_build
    ng = NGram.open(out)
    rng = random.Random(1)
    for _ in range(300):
        d = rng.choice(docs)
        i = rng.randrange(len(d))
        context = d[max(0, i - 2) : i]
        # Real continuations plus random tokens (mostly unseen: p = 0 or backoff).
        candidates = [*d[i : i + 3], *(rng.randrange(ng.vocab_size) for _ in range(22))]
        probs, matched = ng.prob(context, candidates)
        for c, p, m in zip(candidates, probs, matched, strict=True):
            want_p, want_m = brute_prob(counts, ORDER, context, c)
            assert int(m) == want_m, (context, c)
            assert p == pytest.approx(want_p, rel=1e-6, abs=1e-12), (context, c)
            assert 0.0 <= p <= 1.0


def test_fingerprint_equals_hf_tokenizer(sharegpt_build, smollm2_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    _, out, *_ = sharegpt_build
    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    fp = hf_tokenizer_fingerprint(tok)
    ng = NGram.open(out)
    assert ng.fingerprint == fp
    assert tokenizer_json_fingerprint(smollm2_tokenizer_dir / "tokenizer.json") == fp
    assert tokenizer_json_fingerprint(smollm2_tokenizer_dir) == fp
    vocab = tok.get_vocab()
    by_id = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        by_id[i] = t
    assert tokenizer_fingerprint(by_id) == fp
    ng.check_fingerprint(fp)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.lists(st.text(max_size=4), min_size=1, max_size=30),
    holes=st.sets(st.integers(0, 40), max_size=5),
)
def test_python_and_rust_fingerprints_agree(tokens: list[str], holes: set[int]) -> None:
    vocab = {}
    next_id = 0
    for t in dict.fromkeys(tokens):
        while next_id in holes:
            next_id += 1
        vocab[t] = next_id
        next_id += 1
    by_id = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        by_id[i] = t
    assert vocab_fingerprint(vocab) == tokenizer_fingerprint(by_id)


def test_fingerprint_rejects_conflicting_ids() -> None:
    with pytest.raises(ValueError, match="id 0"):
        vocab_fingerprint([("a", 0), ("b", 0)])


@settings(max_examples=25, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 19), max_size=30), min_size=1, max_size=15),
    order=st.integers(1, 4),
    seed=st.none() | st.integers(0, 2**32),
)
def test_import_round_trip(
    docs: list[list[int]], order: int, seed: int | None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    d = tmp_path_factory.mktemp("imp")
    counts, total = count_docs(docs, order)
    trie = d / "full.trie"
    write_reference_trie(trie, dict(counts), total, order, shuffle_seed=seed)
    out = d / "m.ngram"
    if total == 0:
        with pytest.raises(NGramError, match="holds no n-gram"):
            import_dart(trie, out, vocab_size=20, memory="1M")
        assert not out.exists() and hidden_entries(d) == []
        return
    report = import_dart(trie, out, vocab_size=20, memory="1M")
    assert report["nodes"] == len(counts) + 1
    ng = NGram.open(out)
    assert ng.count([]) == total
    for g, c in counts.items():
        assert ng.count(list(g)) == c
    contexts = [*[list(g) for g in counts if len(g) < order][:50], [19, 19], []]
    cands = np.arange(20)
    for ctx in contexts:
        probs, matched = ng.prob(ctx, cands)
        for c in range(20):
            p, m = brute_prob(counts, order, ctx, c)
            assert int(matched[c]) == m
            assert probs[c] == pytest.approx(p, rel=1e-6, abs=1e-12)
    assert hidden_entries(d) == []


def test_import_reports_count_overflow(tmp_path: Path) -> None:
    # The reference stores counts as i32; write a file whose count wrapped negative.
    counts = {(1,): 3, (2,): 2, (1, 2): 2}
    trie = tmp_path / "wrapped.trie"
    write_reference_trie(trie, counts, 5, 2)
    raw = bytearray(trie.read_bytes())
    # Node 0 (root) starts at byte 16; its freq sits after token (4) and parent (8).
    raw[16 + 12 : 16 + 16] = (-7).to_bytes(4, "little", signed=True)
    trie.write_bytes(bytes(raw))
    with pytest.raises(NGramError, match=r"count overflow.*node 0"):
        import_dart(trie, tmp_path / "m.ngram")
    assert not (tmp_path / "m.ngram").exists()
    with pytest.raises(NGramError, match="prefix"):
        write_reference_trie(tmp_path / "x.trie", {(1, 2): 1}, 1, 2)


def test_ids_input_directories_and_min_count(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    docs = [[1, 2, 3, 1, 2], [2, 3], [4], []]
    lines = [json.dumps({"ids": d}) + "\n" for d in docs]
    (corpus / "a.jsonl").write_text("".join(lines[:2]))
    (corpus / "sub" / "b.jsonl").write_text("".join(lines[2:]))
    out = tmp_path / "m.ngram"
    report = build(corpus, out, vocab_size=8, eos_id=7, min_count=2, memory=1 << 20)
    full = [[*d, 7] for d in docs]
    counts, total = count_docs(full, 3)
    assert report["documents"] == 4 and report["tokens"] == total
    ng = NGram.open(out)
    for g, c in counts.items():
        assert ng.count(list(g)) == (c if len(g) == 1 or c >= 2 else 0), g
    assert ng.fingerprint == "0" * 64


def test_bad_input_errors_name_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text('{"ids": [1]}\n{"ids": [1, 2}\n')
    out = tmp_path / "m.ngram"
    with pytest.raises(NGramError, match=r"c\.jsonl:2: malformed JSON"):
        build([p], out, vocab_size=4, no_eos=True)
    p.write_text('{"text": "hello"}\n')
    with pytest.raises(NGramError, match="--tokenizer"):
        build([p], out, vocab_size=4, no_eos=True)
    with pytest.raises(NGramError, match="--vocab-size"):
        build([p], out, no_eos=True)
    with pytest.raises(NGramError, match="eos"):
        build([p], out, vocab_size=4)
    with pytest.raises(NGramError, match="at most one"):
        build([p], out, vocab_size=4, eos_id=1, no_eos=True)
    with pytest.raises(NGramError, match="memory"):
        build([p], out, vocab_size=4, no_eos=True, memory="lots")
    with pytest.raises(NGramError, match=r"every line was malformed.*--allow-empty"):
        build([p], out, vocab_size=4, no_eos=True, skip_bad_lines=True)
    assert not out.exists()
    report = build([p], out, vocab_size=4, no_eos=True, skip_bad_lines=True, allow_empty=True)
    assert report["skipped_lines"] == 1 and "c.jsonl:1" in report["first_skipped"]
    assert report["documents"] == 0
    with pytest.raises(NGramError, match="the output is the input"):
        build([p], p, vocab_size=4, no_eos=True, skip_bad_lines=True, allow_empty=True)
    assert p.read_text() == '{"text": "hello"}\n'
    assert parse_memory("2G") == 2 << 30


def test_keyboard_interrupt_cancels_and_cleans_up(tmp_path: Path) -> None:
    """Ctrl-C during a build raises KeyboardInterrupt and leaves neither output nor runs.

    The input is a FIFO, so the build is provably running when the signal lands: the signal
    is sent once the build has opened the FIFO (a non-blocking open for writing fails until a
    reader has it), and the data arrives only a while after.
    """
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "m.ngram"

    def interrupt_then_feed() -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:  # ENXIO: no reader yet
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w") as f:
            _thread.interrupt_main()
            time.sleep(1.0)
            for i in range(1000):
                f.write(json.dumps({"ids": [i % 5, (i + 1) % 5]}) + "\n")

    # A shell starts background jobs with SIGINT ignored, and Python then installs no Ctrl-C
    # handler (interrupt_main does nothing): the test needs Python's own.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    feeder = threading.Thread(target=interrupt_then_feed)
    feeder.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            build([fifo], out, vocab_size=5, no_eos=True, memory="1M")
    finally:
        feeder.join()
        signal.signal(signal.SIGINT, previous)
    assert not out.exists()
    assert hidden_entries(tmp_path) == []


@pytest.fixture
def tiny_filesystem(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 1 MiB tmpfs: a disk that fills up (needs permission to mount)."""
    import subprocess

    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_import_on_a_full_disk_fails_clearly_and_leaves_nothing(
    tmp_path: Path, tiny_filesystem: Path
) -> None:
    """The importer's scratch and output on a disk too small for them: an error naming the
    problem (not SIGBUS from a sparse file mapped and written), and nothing left behind."""
    import subprocess

    from _daemon_util import dart_ngram_binary

    rng = random.Random(0)
    docs = [[rng.randrange(2000) for _ in range(200)] for _ in range(400)]
    counts, total = count_docs(docs, 3)
    assert len(counts) > 60_000  # scratch records far beyond 1 MiB
    trie = tmp_path / "big.trie"
    write_reference_trie(trie, dict(counts), total, 3)
    done = subprocess.run(
        [
            str(dart_ngram_binary()),
            "import-dart",
            str(trie),
            "--output",
            str(tiny_filesystem / "m.ngram"),
            "--tmp-dir",
            str(tiny_filesystem),
            "--vocab-size",
            "2000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, (done.returncode, done.stderr)  # < 0: killed by a signal
    assert "No space left" in done.stderr or "space" in done.stderr.lower(), done.stderr
    assert list(tiny_filesystem.iterdir()) == []
