"""The n-gram query API from Python: exact agreement with a plain-Python counter, batched
forms, bad files and bad ids."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client.ngram import (
    CorruptModelError,
    NGram,
    NGramError,
    Pruner,
    PrunerConfig,
    TokenizerMismatchError,
    TokenOutOfVocabError,
)


def count_corpus(docs: list[list[int]], order: int, eos: int | None) -> Counter[tuple[int, ...]]:
    """The reference's counting (docs/design.md, "The n-gram model"): EOS appended, k-grams
    never cross documents."""
    counts: Counter[tuple[int, ...]] = Counter()
    for doc in docs:
        d = [*doc, eos] if eos is not None else list(doc)
        for n in range(1, order + 1):
            for i in range(len(d) - n + 1):
                counts[tuple(d[i : i + n])] += 1
    return counts


def brute_prob(
    counts: Counter[tuple[int, ...]], order: int, ctx: list[int], c: int
) -> tuple[float, int]:
    ctx = ctx[max(0, len(ctx) - (order - 1)) :] if order > 1 else []
    for n in range(len(ctx), 0, -1):
        s = tuple(ctx[len(ctx) - n :])
        if counts.get(s, 0) > 0 and counts.get((*s, c), 0) > 0:
            return counts[(*s, c)] / counts[s], n
    return 0.0, 0


def write(
    tmp: Path,
    docs: list[list[int]],
    order: int,
    vocab: int,
    name: str = "m.ngram",
    top_list_len: int = 2,
    eos: int | None = None,
) -> tuple[Path, Counter[tuple[int, ...]]]:
    eos = vocab - 1 if eos is None else eos
    counts = count_corpus(docs, order, eos)
    path = tmp / name
    NGram.write_counts(
        path,
        dict(counts),
        order=order,
        vocab_size=vocab,
        eos_id=eos,
        documents=len(docs),
        fingerprint="ab" * 32,
        top_list_len=top_list_len,
    )
    return path, counts


DOCS = [[1, 2, 3, 1, 2, 4, 1, 2, 3, 5], [2, 3, 1, 2, 3, 6, 6, 1], [1, 2, 6, 1, 2, 3]]


@pytest.fixture(params=[False, True], ids=["mapped", "in_memory"])
def small(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[NGram, Counter[tuple[int, ...]]]:
    """The model mapped from its file, and copied into anonymous memory: same answers."""
    path, counts = write(tmp_path, DOCS, 3, 8)
    return NGram.open(path, verify=True, in_memory=request.param), counts


def test_attributes_and_info(small: tuple[NGram, Counter[tuple[int, ...]]]) -> None:
    ng, counts = small
    assert (ng.order, ng.vocab_size, ng.eos_id, ng.fingerprint) == (3, 8, 7, "ab" * 32)
    assert ng.path.endswith("m.ngram")
    info = ng.info()
    assert info["ngrams_per_order"] == [sum(1 for g in counts if len(g) == n) for n in (1, 2, 3)]
    assert info["bytes"] == Path(ng.path).stat().st_size
    assert info["total_tokens"] == ng.count([]) == sum(len(d) + 1 for d in DOCS)
    ng.check_fingerprint("ab" * 32)
    with pytest.raises(TokenizerMismatchError, match="cd"):
        ng.check_fingerprint("cd" * 32)
    with pytest.raises(NGramError, match="hexadecimal"):
        ng.check_fingerprint("xyz")


def test_prob_count_and_top_k_match_the_counter(
    small: tuple[NGram, Counter[tuple[int, ...]]],
) -> None:
    ng, counts = small
    cands = np.arange(8)
    for a in range(8):
        for b in range(8):
            for ctx in ([a, b], [b], [], [5, a, b]):
                probs, matched = ng.prob(ctx, cands)
                assert probs.dtype == np.float32 and matched.dtype == np.uint8
                want = [brute_prob(counts, 3, ctx, int(c)) for c in cands]
                assert probs.tolist() == [np.float32(p) for p, _ in want]
                assert matched.tolist() == [m for _, m in want]
                ids, p = ng.top_k(ctx, 3)
                ranked = sorted(((-pr, c) for c, (pr, _) in enumerate(want) if pr > 0))[:3]
                assert ids.tolist() == [c for _, c in ranked]
                assert p.tolist() == [np.float32(-q) for q, _ in ranked]
            assert ng.count([a, b]) == counts.get((a, b), 0)
            for c in range(8):
                assert ng.count([a, b, c]) == counts.get((a, b, c), 0)


def test_batched_forms_equal_single_calls(small: tuple[NGram, Counter[tuple[int, ...]]]) -> None:
    ng, _ = small
    rng = np.random.default_rng(0)
    contexts = rng.integers(0, 8, size=(64, 4))
    cands = rng.integers(0, 8, size=(64, 5)).astype(np.uint32)
    probs, matched = ng.prob_batch(contexts, cands)
    assert probs.shape == matched.shape == (64, 5)
    for i in range(64):
        p, m = ng.prob(contexts[i], cands[i])
        assert np.array_equal(probs[i], p) and np.array_equal(matched[i], m)
    ids, tp = ng.top_k_batch(contexts, 6)
    assert ids.shape == tp.shape == (64, 6) and ids.dtype == np.int64
    for i in range(64):
        one_ids, one_p = ng.top_k(contexts[i], 6)
        n = len(one_ids)
        assert ids[i, :n].tolist() == one_ids.tolist() and (ids[i, n:] == -1).all()
        assert tp[i, :n].tolist() == one_p.tolist() and (tp[i, n:] == 0).all()
    with pytest.raises(NGramError, match="rows"):
        ng.prob_batch(contexts, cands[:3])
    assert ng.prob_batch(np.zeros((0, 2), int), np.zeros((0, 3), int))[0].shape == (0, 3)


def test_fortran_order_arrays_read_row_major(
    small: tuple[NGram, Counter[tuple[int, ...]]],
) -> None:
    """The wrapper reads any layout in row-major order; the native method refuses a layout
    it would otherwise read transposed."""
    from dart_client import _native

    ng, _ = small
    rng = np.random.default_rng(1)
    contexts = rng.integers(0, 8, size=(6, 3))
    cands = rng.integers(0, 8, size=(6, 4))
    want = ng.prob_batch(contexts, cands)[0]
    got = ng.prob_batch(np.asfortranarray(contexts), np.asfortranarray(cands))[0]
    assert np.array_equal(got, want)
    with pytest.raises(NGramError, match="C-contiguous"):
        _native.NGram.prob_batch(ng, np.asfortranarray(contexts), cands)


def test_torch_tensors_and_lists_are_accepted(
    small: tuple[NGram, Counter[tuple[int, ...]]],
) -> None:
    torch = pytest.importorskip("torch")
    ng, _ = small
    p1, _ = ng.prob(torch.tensor([1, 2]), torch.tensor([3, 4]))
    p2, _ = ng.prob([1, 2], np.array([3, 4], dtype=np.int16))
    assert p1.tolist() == p2.tolist()


def test_bad_ids(small: tuple[NGram, Counter[tuple[int, ...]]]) -> None:
    ng, _ = small
    for ctx, cands in (
        ([1, 8], [1]),
        ([1, 2], [8]),
        ([1, -1], [1]),
        ([1, 2], [-5]),
        ([1], [2**40]),
    ):
        with pytest.raises(TokenOutOfVocabError):
            ng.prob(ctx, cands)
    assert issubclass(TokenOutOfVocabError, ValueError)
    with pytest.raises(TokenOutOfVocabError):
        ng.top_k([9], 2)
    with pytest.raises(NGramError, match="integer"):
        ng.prob([1.5], [1])
    with pytest.raises(NGramError, match="dimensional"):
        ng.prob([[1]], [1])
    with pytest.raises(NGramError, match="k must be"):
        ng.top_k([1], -1)
    with pytest.raises(NGramError, match="4-gram"):
        ng.count([1, 2, 3, 4])


def test_huge_k_is_refused_before_allocating(
    small: tuple[NGram, Counter[tuple[int, ...]]],
) -> None:
    """k beyond the vocabulary, or rows x k beyond the answer cap, is a clear error (it used
    to abort the process allocating rows x k answers)."""
    ng, _ = small
    for k in (9, 10**9):
        with pytest.raises(NGramError, match="exceeds the vocabulary size 8"):
            ng.top_k_batch([[1], [2]], k)
        with pytest.raises(NGramError, match="exceeds the vocabulary size 8"):
            ng.top_k([1], k)
    with pytest.raises(NGramError, match="split the batch"):
        ng.top_k_batch(np.ones((2**23 + 1, 1), dtype=np.int64), 8)
    ids, probs = ng.top_k_batch([[1], [2]], 8)  # k = vocabulary size is fine
    assert ids.shape == probs.shape == (2, 8)


def test_bad_files(tmp_path: Path) -> None:
    path, _ = write(tmp_path, DOCS, 3, 8)
    data = path.read_bytes()
    bad = tmp_path / "bad.ngram"
    for cut in (0, 5, 50, 200, len(data) - 1):
        bad.write_bytes(data[:cut])
        for in_memory in (False, True):
            with pytest.raises(CorruptModelError, match=r"bad\.ngram"):
                NGram.open(bad, in_memory=in_memory)
    bad.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(CorruptModelError, match="not a DART n-gram model"):
        NGram.open(bad)
    flipped = bytearray(data)
    flipped[-20] ^= 0xFF
    bad.write_bytes(bytes(flipped))
    for in_memory in (False, True):  # every section checksum is checked on open
        with pytest.raises(CorruptModelError, match="checksum"):
            NGram.open(bad, in_memory=in_memory)
        with pytest.raises(CorruptModelError, match="checksum"):
            NGram.open(bad, verify=True, in_memory=in_memory)
    with pytest.raises(CorruptModelError, match="count-values"):  # a count table: always
        NGram.open(bad, checksums=False)
    tokens = next(
        s for s in NGram.open(path).info()["sections"] if s["kind"] == "tokens" and s["order"] == 3
    )
    flipped = bytearray(data)
    flipped[tokens["offset"]] ^= 0x01
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CorruptModelError, match="tokens of order 3 fails its checksum"):
        NGram.open(bad)
    NGram.open(bad, checksums=False)  # a large section: then checked by verify only ...
    with pytest.raises(CorruptModelError, match="checksum"):
        NGram.open(bad, checksums=False).verify()
    bad.write_bytes(data + b"\0" * 1000)  # ... junk appended is refused either way
    for checksums in (True, False):
        with pytest.raises(CorruptModelError, match="1000 bytes after the last section"):
            NGram.open(bad, checksums=checksums)
    for in_memory in (False, True):
        with pytest.raises(NGramError, match=r"missing\.ngram"):
            NGram.open(tmp_path / "missing.ngram", in_memory=in_memory)
    with pytest.raises(NGramError, match="prefix"):
        NGram.write_counts(tmp_path / "x.ngram", {(1,): 1, (1, 2, 3): 1}, order=3, vocab_size=8)
    assert not (tmp_path / "x.ngram").exists()


def test_unigram_bit_flip_is_refused_even_without_checksums(tmp_path: Path) -> None:
    """One flipped bit of a unigram count used to change probabilities silently; the small
    sections are checked on every open."""
    path, _ = write(tmp_path, DOCS, 3, 8)
    ng = NGram.open(path)
    assert ng.info()["integrity"] == "checksums"
    unigrams = next(s for s in ng.info()["sections"] if s["kind"] == "unigram-counts")
    del ng
    data = bytearray(path.read_bytes())
    data[unigrams["offset"]] ^= 0x01
    path.write_bytes(bytes(data))
    for checksums in (True, False):
        with pytest.raises(CorruptModelError, match="unigram-counts of order 1 fails its checksum"):
            NGram.open(path, checksums=checksums)


def test_a_file_rewritten_in_place_fails_clearly(tmp_path: Path) -> None:
    """A mapped model whose file is rewritten in place reports it instead of reading the new
    bytes (or dying of SIGBUS); an in-memory copy keeps answering; a rename is safe."""
    path, counts = write(tmp_path, DOCS, 3, 8)
    data = path.read_bytes()
    mapped, copied = NGram.open(path), NGram.open(path, in_memory=True)
    other, _ = write(tmp_path, DOCS[:1], 3, 8, name="other.ngram")
    other.replace(path)  # renamed over it: the mapping keeps the old file
    assert mapped.count([1, 2]) == counts[(1, 2)]
    mapped = NGram.open(path)
    pruner = Pruner(mapped, PrunerConfig(top_k=2, beam_width=2, max_nodes=4))
    ids, probs = np.array([[3, 4]]), np.array([[0.6, 0.4]], dtype=np.float32)
    pruner.prune([1, 2], ids, probs)
    with path.open("r+b") as f:  # rewritten in place, as `cp` over it does
        f.truncate(len(data) // 2)
    with pytest.raises(CorruptModelError, match="modified in place"):
        pruner.prune([1, 2], ids, probs)
    for query in (
        lambda m: m.count([1, 2]),
        lambda m: m.prob([1, 2], [3]),
        lambda m: m.top_k([1], 2),
        lambda m: m.top_k_batch([[1]], 2),
        lambda m: m.prob_batch([[1, 2]], [[3]]),
    ):
        with pytest.raises(CorruptModelError, match="modified in place"):
            query(mapped)
        query(copied)
    assert copied.count([1, 2]) == counts[(1, 2)]


def test_merge_equals_the_whole(tmp_path: Path) -> None:
    a, _ = write(tmp_path, DOCS[:2], 3, 8, "a.ngram")
    b, _ = write(tmp_path, DOCS[2:], 3, 8, "b.ngram")
    whole_path, counts = write(tmp_path, DOCS, 3, 8, "whole.ngram")
    report = NGram.merge([a, b], tmp_path / "ab.ngram")
    ab, whole = NGram.open(tmp_path / "ab.ngram", verify=True), NGram.open(whole_path)
    assert report["ngrams_per_order"] == whole.info()["ngrams_per_order"]
    for g in counts:
        assert ab.count(list(g)) == whole.count(list(g)) == counts[g]
    other = tmp_path / "other.ngram"
    NGram.write_counts(other, dict(counts), order=3, vocab_size=8, eos_id=7, fingerprint="cd" * 32)
    with pytest.raises(TokenizerMismatchError):
        NGram.merge([a, other], tmp_path / "bad.ngram")
    a_bytes = a.read_bytes()
    with pytest.raises(NGramError, match="the output is the input"):
        NGram.merge([a, b], a)
    (tmp_path / "link.ngram").hardlink_to(a)
    with pytest.raises(NGramError, match="the output is the input"):
        NGram.merge([b, a], tmp_path / "link.ngram")
    assert a.read_bytes() == a_bytes


def test_queries_run_in_parallel_threads(small: tuple[NGram, Counter[tuple[int, ...]]]) -> None:
    ng, _ = small
    want = ng.prob([1, 2], list(range(8)))[0].tolist()
    results: list[list[float]] = []

    def work() -> None:
        for _ in range(200):
            results.append(ng.prob([1, 2], list(range(8)))[0].tolist())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 800 and all(r == want for r in results)


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 10), max_size=25), max_size=6),
    order=st.integers(1, 4),
    top=st.integers(1, 3),
    ctx=st.lists(st.integers(0, 11), max_size=5),
)
def test_random_corpora_match_the_counter(
    tmp_path_factory: pytest.TempPathFactory,
    docs: list[list[int]],
    order: int,
    top: int,
    ctx: list[int],
) -> None:
    tmp = tmp_path_factory.mktemp("h")
    path, counts = write(tmp, docs, order, 12, top_list_len=top, eos=11)
    ng = NGram.open(path, verify=True)
    probs, matched = ng.prob(ctx, np.arange(12))
    want = [brute_prob(counts, order, ctx, c) for c in range(12)]
    assert probs.tolist() == [np.float32(p) for p, _ in want]
    assert matched.tolist() == [m for _, m in want]
    ranked = sorted((-p, c) for c, (p, _) in enumerate(want) if p > 0)[:4]
    ids, _ = ng.top_k(ctx, 4)
    assert ids.tolist() == [c for _, c in ranked]


def test_open_advice_changes_no_answer(tmp_path: Path) -> None:
    """``random_access`` (MADV_RANDOM), ``huge_pages`` and ``prefetch`` (a background read)
    are advice to the kernel about paging: the answers are those of a plain open."""
    path, counts = write(tmp_path, DOCS, 3, 8)
    plain = NGram.open(path)
    for advised in (
        NGram.open(path, random_access=True),
        NGram.open(path, huge_pages=True),
        NGram.open(path, prefetch=True, random_access=True),
    ):
        for gram, n in counts.items():
            assert advised.count(list(gram)) == n
        for ctx in ([1], [1, 2], [2, 3]):
            assert advised.top_k(ctx, 3)[0].tolist() == plain.top_k(ctx, 3)[0].tolist()
    with pytest.raises(TypeError):
        NGram.open(path, random_acess=True)  # type: ignore[call-arg]
