//! End-to-end tests of `build`: corpus files in, model file out, compared with brute force.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use dart_ngram::model::NGramModel;
use proptest::prelude::*;

use super::*;
use crate::import::{import_dart, ImportOptions};
use crate::reference::{
    count_documents, prob_from_counts, write_reference_trie_from_model, RefTrie,
};
use crate::tokenize::tests::write_word_tokenizer;

/// Writes documents as `{"ids": [...]}` lines, split over `files` files.
fn write_ids_corpus(dir: &Path, docs: &[Vec<u32>], files: usize) -> Vec<PathBuf> {
    let paths: Vec<PathBuf> = (0..files.max(1))
        .map(|i| dir.join(format!("part{i}.jsonl")))
        .collect();
    let mut outs: Vec<std::fs::File> = paths
        .iter()
        .map(|p| std::fs::File::create(p).unwrap())
        .collect();
    for (i, d) in docs.iter().enumerate() {
        let n = outs.len();
        writeln!(outs[i % n], "{}", serde_json::json!({ "ids": d })).unwrap();
    }
    paths
}

fn with_eos(docs: &[Vec<u32>], eos: Option<u32>) -> Vec<Vec<u32>> {
    docs.iter()
        .map(|d| d.iter().copied().chain(eos).collect())
        .collect()
}

/// Checks a built model against brute-force counts of `docs` (EOS already appended).
fn check_model(path: &Path, docs: &[Vec<u32>], order: usize, vocab: u32, min_count: u64) {
    let (mut want, total) = count_documents(docs, order);
    want.retain(|g, c| g.len() == 1 || *c >= min_count);
    let m = NGramModel::open(path).unwrap();
    assert_eq!(m.total_tokens(), total);
    assert_eq!(m.documents(), docs.len() as u64);
    assert_eq!(m.order(), order);
    assert_eq!(m.vocab_size(), vocab);
    let per_order: Vec<u64> = (1..=order)
        .map(|n| want.keys().filter(|g| g.len() == n).count() as u64)
        .collect();
    assert_eq!(m.ngrams_per_order(), per_order);
    for (g, &c) in &want {
        assert_eq!(m.count(g).unwrap(), c, "count of {g:?}");
    }
    // Every context that occurs, against every token: probabilities and matched lengths.
    let contexts: Vec<Vec<u32>> = want.keys().filter(|g| g.len() < order).cloned().collect();
    let candidates: Vec<u32> = (0..vocab).collect();
    let mut probs = vec![0f32; candidates.len()];
    let mut matched = vec![0u8; candidates.len()];
    for ctx in contexts.iter().take(300) {
        m.prob_many(ctx, &candidates, &mut probs, &mut matched)
            .unwrap();
        for (i, &c) in candidates.iter().enumerate() {
            let (p, l) = prob_from_counts(&want, order, ctx, c);
            assert_eq!(matched[i], l, "matched of {c} after {ctx:?}");
            assert!(
                (f64::from(probs[i]) - p).abs() <= 1e-6 * p.max(1e-30),
                "P({c}|{ctx:?})"
            );
            assert!(probs[i] <= 1.0);
        }
    }
}

fn ids_opts(inputs: Vec<PathBuf>, output: PathBuf, vocab: u32, eos: Option<u32>) -> BuildOptions {
    let mut o = BuildOptions::new(inputs, output);
    o.vocab_size = Some(vocab);
    o.eos = eos.map_or(EosChoice::NoEos, EosChoice::Id);
    // The table is allocated whole; a small budget keeps tests light.
    o.memory = 8 << 20;
    o
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn corpus_strategy() -> impl Strategy<Value = (Vec<Vec<u32>>, u32)> {
    (2u32..40).prop_flat_map(|vocab| {
        (
            prop::collection::vec(prop::collection::vec(0..vocab, 0..60), 0..40),
            Just(vocab),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Counts equal brute force for random corpora with document boundaries, whatever the
    /// thread count and however tiny the memory budget (forcing spills and merges).
    #[test]
    fn counts_equal_brute_force(
        (docs, vocab) in corpus_strategy(),
        order in 1usize..=4,
        threads in 1usize..=3,
        memory in prop::sample::select(vec![1u64, 16 << 10, 1 << 20]),
        files in 1usize..4,
        eos in prop::option::of(0u32..2),
        min_count in 1u64..3,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let inputs = write_ids_corpus(dir.path(), &docs, files);
        let out = dir.path().join("m.ngram");
        let mut o = ids_opts(inputs, out.clone(), vocab, eos);
        o.order = order;
        o.threads = Some(threads);
        o.memory = memory;
        o.min_count = min_count;
        if docs.is_empty() {
            // No document: refused unless asked for, and then written.
            let e = build(&o).unwrap_err().to_string();
            prop_assert!(e.contains("no document") && e.contains("--allow-empty"), "{}", e);
            prop_assert!(!out.exists());
            o.allow_empty = true;
        }
        let report = build(&o).unwrap();
        let docs = with_eos(&docs, eos);
        prop_assert_eq!(report.documents, docs.len() as u64);
        check_model(&out, &docs, order, vocab, min_count);
        // Only the model and the corpus remain: spill runs are gone.
        prop_assert_eq!(dir_entries(dir.path()).iter().filter(|n| n.starts_with('.')).count(), 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A built model written as a reference `.trie` (streaming) and imported back answers
    /// every count and probability as the model does.
    #[test]
    fn reference_trie_of_a_model_imports_to_the_same_answers(
        (docs, vocab) in corpus_strategy(),
        order in 1usize..=4,
        min_count in 1u64..3,
    ) {
        prop_assume!(docs.iter().any(|d| !d.is_empty()));
        let dir = tempfile::tempdir().unwrap();
        let inputs = write_ids_corpus(dir.path(), &docs, 1);
        let built = dir.path().join("m.ngram");
        let mut o = ids_opts(inputs, built.clone(), vocab, Some(0));
        o.order = order;
        o.min_count = min_count;
        build(&o).unwrap();
        let m = NGramModel::open(&built).unwrap();
        let trie = dir.path().join("m.trie");
        let nodes = write_reference_trie_from_model(&trie, &m).unwrap();
        let reference = RefTrie::read(&trie).unwrap();
        prop_assert_eq!(reference.nodes.len() as u64, nodes);
        let mut io = ImportOptions::new(trie, dir.path().join("back.ngram"));
        io.vocab_size = Some(vocab);
        io.memory = 1 << 20;
        import_dart(&io).unwrap();
        let back = NGramModel::open(&io.output).unwrap();
        prop_assert_eq!(back.total_tokens(), m.total_tokens());
        prop_assert_eq!(back.ngrams_per_order(), m.ngrams_per_order());
        for n in 1..=order {
            let a: Vec<_> = m.iter_order(n).map(|g| g.unwrap()).collect();
            let b: Vec<_> = back.iter_order(n).map(|g| g.unwrap()).collect();
            prop_assert_eq!(a, b, "order {}", n);
        }
        let candidates: Vec<u32> = (0..vocab).collect();
        let mut want = (vec![0f32; candidates.len()], vec![0u8; candidates.len()]);
        let mut got = want.clone();
        let contexts = docs.iter().flat_map(|d| (0..d.len()).map(|i| &d[i.saturating_sub(3)..=i]));
        for ctx in contexts.take(200).chain([&[][..], &[vocab - 1, vocab - 1][..]]) {
            m.prob_many(ctx, &candidates, &mut want.0, &mut want.1).unwrap();
            back.prob_many(ctx, &candidates, &mut got.0, &mut got.1).unwrap();
            prop_assert_eq!(&want, &got, "after {:?}", ctx);
        }
    }
}

/// One node per n-gram plus the root, and the counts read back by the reference walk.
#[test]
fn reference_trie_of_a_small_model_has_a_node_per_ngram() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = write_ids_corpus(dir.path(), &[vec![1, 2, 1, 2]], 1);
    let built = dir.path().join("m.ngram");
    build(&ids_opts(inputs, built.clone(), 3, Some(0))).unwrap();
    let m = NGramModel::open(&built).unwrap();
    let trie = dir.path().join("m.trie");
    assert_eq!(
        write_reference_trie_from_model(&trie, &m).unwrap(),
        1 + 3 + 3 + 3
    );
    assert_eq!(RefTrie::read(&trie).unwrap().count(&[1, 2]), Some(2));
}

/// Counts the reference format cannot hold (i32) are refused, naming the model, and leave
/// no file behind.
#[test]
fn reference_trie_refuses_counts_past_i32() {
    let dir = tempfile::tempdir().unwrap();
    let built = dir.path().join("big-counts.ngram");
    let meta = dart_ngram::writer::ModelMeta {
        order: 2,
        vocab_size: 3,
        tokenizer_fingerprint: [0; 32],
        eos_id: None,
        min_count: 1,
        total_tokens: 3_000_000_001,
        documents: 1,
        source: "test".into(),
    };
    let bigrams = vec![Ok((dart_ngram::key::pack(&[1, 1], 2), 2_999_999_999u64))];
    dart_ngram::writer::write_model(
        &built,
        &meta,
        &[0, 3_000_000_000, 1],
        vec![Box::new(bigrams.into_iter())],
        &Default::default(),
    )
    .unwrap();
    let m = NGramModel::open(&built).unwrap();
    let trie = dir.path().join("m.trie");
    let e = write_reference_trie_from_model(&trie, &m)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("3000000001 tokens") && e.contains("i32") && e.contains("big-counts.ngram"),
        "{e}"
    );
    assert!(!trie.exists());
}

/// Many spills and intermediate merges: a corpus whose model is several times larger than
/// the budget.
#[test]
fn model_larger_than_memory() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = 4000u32;
    let mut x = 12345u64;
    let docs: Vec<Vec<u32>> = (0..300)
        .map(|_| {
            (0..400)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    // Skewed: small ids are frequent, like real text.
                    let r = (x >> 33) % u64::from(vocab);
                    ((r * r) / u64::from(vocab)) as u32
                })
                .collect()
        })
        .collect();
    let inputs = write_ids_corpus(dir.path(), &docs, 3);
    let out = dir.path().join("m.ngram");
    let mut o = ids_opts(inputs, out.clone(), vocab, Some(vocab - 1));
    o.memory = 64 << 10;
    o.threads = Some(2);
    let report = build(&o).unwrap();
    assert!(report.spilled_runs > 20, "{report:?}");
    assert!(report.output_bytes > 4 * o.memory, "{report:?}");
    let docs = with_eos(&docs, Some(vocab - 1));
    let (want, total) = count_documents(&docs, 3);
    let m = NGramModel::open(&out).unwrap();
    assert_eq!(m.total_tokens(), total);
    for (g, &c) in want.iter().step_by(7) {
        assert_eq!(m.count(g).unwrap(), c, "{g:?}");
    }
    assert_eq!(m.ngrams_per_order().iter().sum::<u64>(), want.len() as u64);
}

#[test]
fn same_bytes_for_any_threads_and_budget() {
    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Vec<u32>> = (0..200u32)
        .map(|i| (0..(i % 50)).map(|j| (i * 7 + j * j) % 97).collect())
        .collect();
    let inputs = write_ids_corpus(dir.path(), &docs, 2);
    let mut outputs = Vec::new();
    for (threads, memory) in [(1, 16u64 << 20), (2, 16 << 20), (2, 8 << 10), (3, 64 << 10)] {
        let out = dir.path().join(format!("m{threads}-{memory}.ngram"));
        let mut o = ids_opts(inputs.clone(), out.clone(), 97, Some(0));
        o.threads = Some(threads);
        o.memory = memory;
        build(&o).unwrap();
        outputs.push(std::fs::read(&out).unwrap());
    }
    assert!(
        outputs.windows(2).all(|w| w[0] == w[1]),
        "outputs differ across threads/budgets"
    );
}

/// Text JSONL, ids JSONL, plain text, `.gz` and directories, all in one build.
#[test]
fn every_input_kind() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok_dir = d.join("tok");
    std::fs::create_dir(&tok_dir).unwrap();
    let tok_path = write_word_tokenizer(&tok_dir, Some("</s>"));
    let tok = LoadedTokenizer::load(&tok_path).unwrap();
    let corpus = d.join("corpus");
    std::fs::create_dir_all(corpus.join("sub")).unwrap();
    std::fs::write(
        corpus.join("a.jsonl"),
        "{\"text\": \"the cat sat on the mat\"}\n\n{\"ids\": [3, 9, 10]}\r\n{\"text\": \"a dog .\", \"x\": 1}\n",
    )
    .unwrap();
    std::fs::write(corpus.join("sub/b.txt"), "the dog sat\non a mat .").unwrap();
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(corpus.join("sub/c.jsonl.gz")).unwrap(),
        flate2::Compression::default(),
    );
    gz.write_all(b"{\"text\": \"the cat\"}\n{\"text\": \"\"}\n")
        .unwrap();
    gz.finish().unwrap();
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(d.join("d.md.gz")).unwrap(),
        flate2::Compression::default(),
    );
    gz.write_all(b"a cat on a dog").unwrap();
    gz.finish().unwrap();

    let texts_and_ids: Vec<Vec<u32>> = vec![
        tok.encode("the cat sat on the mat").unwrap(),
        vec![3, 9, 10],
        tok.encode("a dog .").unwrap(),
        tok.encode("the dog sat\non a mat .").unwrap(),
        tok.encode("the cat").unwrap(),
        tok.encode("").unwrap(),
        tok.encode("a cat on a dog").unwrap(),
    ];
    let docs = with_eos(&texts_and_ids, Some(2));
    let out = d.join("m.ngram");
    let mut o = BuildOptions::new(vec![corpus, d.join("d.md.gz")], out.clone());
    o.memory = 8 << 20;
    o.tokenizer = Some(tok_path);
    o.threads = Some(2);
    let report = build(&o).unwrap();
    assert_eq!(report.input_files, 4);
    assert_eq!(report.eos_id, Some(2), "EOS from tokenizer_config.json");
    assert_eq!(
        report.tokenizer_fingerprint,
        dart_ngram::fingerprint::to_hex(&tok.fingerprint())
    );
    check_model(&out, &docs, 3, 12, 1);
    let m = NGramModel::open(&out).unwrap();
    assert_eq!(m.tokenizer_fingerprint(), tok.fingerprint());
    assert_eq!(m.eos_id(), Some(2));
}

#[test]
fn min_count_keeps_unigrams_and_probabilities_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let docs = vec![vec![1, 2, 3, 1, 2, 4], vec![1, 2, 3], vec![5, 6]];
    let inputs = write_ids_corpus(dir.path(), &docs, 1);
    let out = dir.path().join("m.ngram");
    let mut o = ids_opts(inputs, out.clone(), 8, Some(7));
    o.min_count = 2;
    build(&o).unwrap();
    let docs = with_eos(&docs, Some(7));
    check_model(&out, &docs, 3, 8, 2);
    let m = NGramModel::open(&out).unwrap();
    assert_eq!(m.count(&[5]).unwrap(), 1, "unigrams are never dropped");
    assert_eq!(m.count(&[5, 6]).unwrap(), 0);
    assert_eq!(m.count(&[1, 2, 3]).unwrap(), 2);
    // count(1 2) = 3 (end of document 2 included), count(1 2 3) = 2.
    assert_eq!(m.prob(&[1, 2], 3).unwrap(), (2.0 / 3.0, 2));
    assert_eq!(m.min_count(), 2);
}

fn err_of(o: &BuildOptions) -> String {
    build(o).unwrap_err().to_string()
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("m.ngram");
    let lines = |name: &str, body: &str| {
        let p = d.join(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    let malformed = lines("bad.jsonl", "{\"ids\": [1]}\n{\"ids\": [1,\n");
    let e = err_of(&ids_opts(vec![malformed.clone()], out.clone(), 10, None));
    assert!(
        e.contains("bad.jsonl:2") && e.contains("malformed JSON"),
        "{e}"
    );

    let missing = lines("missing.jsonl", "{\"ids\": [1]}\n{\"body\": \"x\"}\n");
    let e = err_of(&ids_opts(vec![missing], out.clone(), 10, None));
    assert!(
        e.contains("missing.jsonl:2") && e.contains("\"text\""),
        "{e}"
    );

    let oov = lines("oov.jsonl", "{\"ids\": [1, 2]}\n{\"ids\": [3, 10]}\n");
    let e = err_of(&ids_opts(vec![oov], out.clone(), 10, None));
    assert!(
        e.contains("oov.jsonl:2") && e.contains("ids[1] = 10"),
        "{e}"
    );

    let text = lines("text.jsonl", "{\"text\": \"hello\"}\n");
    let e = err_of(&ids_opts(vec![text.clone()], out.clone(), 10, None));
    assert!(
        e.contains("text.jsonl:1") && e.contains("--tokenizer"),
        "{e}"
    );

    // No vocabulary size, no EOS, a missing tokenizer, a missing input.
    let mut o = ids_opts(vec![text.clone()], out.clone(), 10, None);
    o.vocab_size = None;
    assert!(err_of(&o).contains("--vocab-size"));
    let mut o = ids_opts(vec![text.clone()], out.clone(), 10, None);
    o.eos = EosChoice::Auto;
    assert!(err_of(&o).contains("--eos-id"));
    let mut o = ids_opts(vec![text.clone()], out.clone(), 10, None);
    o.tokenizer = Some(d.join("nope/tokenizer.json"));
    assert!(err_of(&o).contains("nope/tokenizer.json"));
    let tok_dir = d.join("tok");
    std::fs::create_dir(&tok_dir).unwrap();
    let tok = write_word_tokenizer(&tok_dir, None);
    let mut o = BuildOptions::new(vec![text.clone()], out.clone());
    o.tokenizer = Some(tok.clone());
    let e = err_of(&o);
    assert!(e.contains("eos_token") && e.contains("--eos-id"), "{e}");
    o.vocab_size = Some(5);
    assert!(err_of(&o).contains("smaller than the tokenizer"));
    let e = err_of(&ids_opts(
        vec![d.join("absent.jsonl")],
        out.clone(),
        10,
        None,
    ));
    assert!(e.contains("absent.jsonl"), "{e}");
    let mut o = ids_opts(vec![text.clone()], out.clone(), 10, None);
    o.order = 5;
    o.vocab_size = Some(1 << 20);
    assert!(err_of(&o).contains("order 5"));
    let e = err_of(&ids_opts(vec![text.clone()], d.to_path_buf(), 10, None));
    assert!(e.contains("is a directory"), "{e}");
    let mut o = ids_opts(vec![text], out.clone(), 10, None);
    o.threads = Some(0);
    assert!(err_of(&o).contains("--threads 0"));

    let badutf = d.join("bin.txt");
    std::fs::write(&badutf, b"ok \xff\xfe").unwrap();
    let mut o = BuildOptions::new(vec![badutf], out.clone());
    o.tokenizer = Some(tok);
    o.eos = EosChoice::Id(2);
    let e = err_of(&o);
    assert!(e.contains("bin.txt:1") && e.contains("UTF-8"), "{e}");

    assert!(!out.exists(), "no output after failures");
    assert!(
        dir_entries(d).iter().all(|n| !n.starts_with('.')),
        "{:?}",
        dir_entries(d)
    );
}

#[test]
fn skip_bad_lines_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.jsonl");
    std::fs::write(
        &p,
        "{\"ids\": [1, 2]}\nnot json\n{\"ids\": [99]}\n{\"ids\": [2, 1]}\n",
    )
    .unwrap();
    let out = dir.path().join("m.ngram");
    let mut o = ids_opts(vec![p], out.clone(), 10, None);
    o.skip_bad_lines = true;
    let r = build(&o).unwrap();
    assert_eq!((r.documents, r.skipped_lines, r.tokens), (2, 2, 4));
    assert!(
        r.first_skipped.as_deref().unwrap().contains("c.jsonl:2"),
        "{r:?}"
    );
    check_model(&out, &[vec![1, 2], vec![2, 1]], 3, 10, 1);
}

/// A failure late in a build (after spills) and an interrupted build leave neither a
/// model under the final name nor temporary files; an existing model is not clobbered.
#[test]
fn failed_and_interrupted_builds_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = d.join("c.jsonl");
    let mut body = String::new();
    for i in 0..20_000u32 {
        body.push_str(&format!(
            "{{\"ids\": [{}, {}, {}, {}]}}\n",
            i % 1000,
            (i * 7) % 1000,
            (i * 13) % 1000,
            i % 3
        ));
    }
    body.push_str("{\"ids\": [1, 1000]}\n");
    std::fs::write(&p, body).unwrap();
    let out = d.join("m.ngram");
    std::fs::write(&out, b"previous model").unwrap();
    let mut o = ids_opts(vec![p.clone()], out.clone(), 1000, None);
    o.memory = 32 << 10;
    let e = err_of(&o);
    assert!(e.contains("c.jsonl:20001"), "{e}");
    assert_eq!(std::fs::read(&out).unwrap(), b"previous model");
    assert_eq!(dir_entries(d), vec!["c.jsonl", "m.ngram"]);

    let cancel = Arc::new(AtomicBool::new(true));
    o.cancel = Some(cancel);
    let err = build(&o).unwrap_err();
    assert!(matches!(err, NGramError::Interrupted { .. }), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"previous model");
    assert_eq!(dir_entries(d), vec!["c.jsonl", "m.ngram"]);
}

/// Cancelling from another thread mid-build stops it promptly.
#[test]
fn cancel_from_another_thread() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.jsonl");
    let line = format!(
        "{}\n",
        serde_json::json!({ "ids": (0..500).collect::<Vec<u32>>() })
    );
    std::fs::write(&p, line.repeat(4000)).unwrap();
    let out = dir.path().join("m.ngram");
    let mut o = ids_opts(vec![p], out.clone(), 500, None);
    o.memory = 64 << 10;
    let cancel = Arc::new(AtomicBool::new(false));
    o.cancel = Some(cancel.clone());
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        cancel.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let res = build(&o);
    stopper.join().unwrap();
    match res {
        Err(NGramError::Interrupted { .. }) => assert!(!out.exists()),
        // A fast machine may finish first; then the model must be complete.
        Ok(_) => assert_eq!(NGramModel::open(&out).unwrap().documents(), 4000),
        Err(e) => panic!("{e}"),
    }
    assert!(dir_entries(dir.path()).iter().all(|n| !n.starts_with('.')));
}

#[test]
fn memory_sizes() {
    assert_eq!(parse_memory("2G").unwrap(), 2 << 30);
    assert_eq!(parse_memory("512m").unwrap(), 512 << 20);
    assert_eq!(parse_memory("1.5GiB").unwrap(), 3 << 29);
    assert_eq!(parse_memory("64K").unwrap(), 64 << 10);
    assert_eq!(parse_memory(" 1000 ").unwrap(), 1000);
    for bad in ["", "G", "-1G", "2X", "0", "1e400", "2 G B"] {
        assert!(parse_memory(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn order_one_and_empty_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.jsonl");
    std::fs::write(&p, "{\"ids\": [1, 2, 2]}\n").unwrap();
    let out = dir.path().join("m.ngram");
    let mut o = ids_opts(vec![p.clone()], out.clone(), 4, Some(3));
    o.order = 1;
    build(&o).unwrap();
    let m = NGramModel::open(&out).unwrap();
    assert_eq!(
        (m.order(), m.count(&[2]).unwrap(), m.total_tokens()),
        (1, 2, 4)
    );

    // No document: an error naming the option that allows it, and nothing written.
    std::fs::write(&p, "\n\n").unwrap();
    let out = dir.path().join("empty.ngram");
    let mut o = ids_opts(vec![p.clone()], out.clone(), 4, Some(3));
    let e = err_of(&o);
    assert!(
        e.contains("no document") && e.contains("--allow-empty"),
        "{e}"
    );
    assert!(!out.exists());
    o.allow_empty = true;
    let r = build(&o).unwrap();
    assert_eq!((r.documents, r.tokens), (0, 0));

    // Every line dropped by skip_bad_lines: the same error, saying why.
    std::fs::write(&p, "not json\n{\"ids\": [99]}\n").unwrap();
    let out = dir.path().join("skipped.ngram");
    let mut o = ids_opts(vec![p], out.clone(), 4, Some(3));
    o.skip_bad_lines = true;
    let e = err_of(&o);
    assert!(
        e.contains("every line was malformed") && e.contains("2 lines"),
        "{e}"
    );
    assert!(!out.exists());
}

/// The output may not be one of the inputs or the tokenizer, by any path to the same file.
#[test]
fn output_that_is_an_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let corpus = write_ids_corpus(d, &[vec![1, 2, 3]], 1);
    let before = std::fs::read(&corpus[0]).unwrap();
    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let link = sub.join("hard.jsonl");
    std::fs::hard_link(&corpus[0], &link).unwrap();
    let dotted = sub.join("..").join("part0.jsonl");
    for out in [corpus[0].clone(), link.clone(), dotted] {
        let o = ids_opts(corpus.clone(), out.clone(), 4, None);
        let e = err_of(&o);
        assert!(e.contains("the output is the input"), "{e}");
        // Also when the input is the directory holding it.
        let o = ids_opts(vec![d.to_path_buf()], out, 4, None);
        assert!(err_of(&o).contains("the output is the input"));
    }
    assert_eq!(std::fs::read(&corpus[0]).unwrap(), before);

    let tok = write_word_tokenizer(d, Some("</s>"));
    let text = d.join("t.txt");
    std::fs::write(&text, "the cat sat").unwrap();
    let tok_before = std::fs::read(&tok).unwrap();
    let mut o = BuildOptions::new(vec![text], tok.clone());
    o.tokenizer = Some(tok.clone());
    let e = err_of(&o);
    assert!(
        e.contains("the output is the input") && e.contains("tokenizer"),
        "{e}"
    );
    assert_eq!(std::fs::read(&tok).unwrap(), tok_before);
}

/// A model left in a corpus directory (an earlier build's output) is skipped, not read as
/// text; given by name it is a clear error.
#[test]
fn models_in_the_corpus_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let docs = vec![vec![1, 2, 3, 1, 2]];
    write_ids_corpus(d, &docs, 1);
    let first = d.join("first.ngram");
    build(&ids_opts(vec![d.to_path_buf()], first.clone(), 4, None)).unwrap();
    let second = d.join("second.ngram");
    let r = build(&ids_opts(vec![d.to_path_buf()], second.clone(), 4, None)).unwrap();
    assert_eq!(r.input_files, 1);
    check_model(&second, &docs, 3, 4, 1);
    let e = err_of(&ids_opts(vec![first], d.join("third.ngram"), 4, None));
    assert!(e.contains("is a DART n-gram model, not corpus text"), "{e}");
}

/// Scratch that killed builds left (unlocked, old) is removed by the next build; a live
/// build's scratch (locked) and other hidden files are not.
#[test]
fn leftovers_of_killed_builds_are_cleaned() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let corpus = d.join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    let docs = vec![vec![1, 2, 3]];
    let inputs = write_ids_corpus(&corpus, &docs, 1);
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let set_old = |p: &Path| {
        std::fs::File::open(p).unwrap().set_modified(old).unwrap();
    };
    // What a SIGKILLed build leaves: a runs directory and a model temp file, lock released.
    let (runs, lock) = dart_ngram::scratch::tempdir(d, "runs").unwrap();
    drop(lock);
    let runs = runs.keep();
    std::fs::write(runs.join("order2-000001.run"), b"x").unwrap();
    set_old(&runs);
    let tmp = dart_ngram::scratch::tempfile(d, "write")
        .unwrap()
        .into_temp_path()
        .keep()
        .unwrap();
    set_old(&tmp);
    // A build still running (its lock held) and someone else's hidden file.
    let live = dart_ngram::scratch::tempfile(d, "write").unwrap();
    set_old(live.path());
    std::fs::write(d.join(".keep.tmp"), b"x").unwrap();
    build(&ids_opts(inputs, d.join("m.ngram"), 4, None)).unwrap();
    assert!(!runs.exists() && !tmp.exists());
    assert!(live.path().exists() && d.join(".keep.tmp").exists());
    check_model(&d.join("m.ngram"), &docs, 3, 4, 1);
}
