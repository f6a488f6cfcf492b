//! Tests of `import_dart` against the naive reading of reference files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dart_ngram::model::NGramModel;
use proptest::prelude::*;

use super::*;
use crate::reference::{
    count_documents, nodes_from_counts, write_nodes, write_reference_trie, RefNode, RefTrie,
};

fn opts(trie: &Path, out: &Path) -> ImportOptions {
    let mut o = ImportOptions::new(trie.to_path_buf(), out.to_path_buf());
    o.memory = 1 << 20;
    o
}

/// The imported model answers every query as the reference file does.
fn check_import(trie: &Path, model: &Path, vocab: u32) {
    let reference = RefTrie::read(trie).unwrap();
    let all = reference.all_ngrams();
    let m = NGramModel::open(model).unwrap();
    assert_eq!(m.total_tokens(), reference.nodes[0].freq as u64);
    assert_eq!(m.order() as u64, reference.order);
    for (g, &c) in &all {
        assert_eq!(m.count(g).unwrap(), c, "count of {g:?}");
    }
    let per_order: Vec<u64> = (1..=m.order())
        .map(|n| all.keys().filter(|g| g.len() == n).count() as u64)
        .collect();
    assert_eq!(m.ngrams_per_order(), per_order);
    // Every seen context plus some unseen ones, against every token.
    let mut contexts: Vec<Vec<u32>> = all
        .keys()
        .filter(|g| g.len() < m.order())
        .take(200)
        .cloned()
        .collect();
    contexts.push(vec![vocab - 1, vocab - 1]);
    contexts.push(vec![]);
    let candidates: Vec<u32> = (0..vocab).collect();
    let mut probs = vec![0f32; candidates.len()];
    let mut matched = vec![0u8; candidates.len()];
    for ctx in &contexts {
        m.prob_many(ctx, &candidates, &mut probs, &mut matched)
            .unwrap();
        for (i, &c) in candidates.iter().enumerate() {
            let (p, l) = reference.prob(ctx, c);
            assert_eq!(matched[i], l, "matched of {c} after {ctx:?}");
            assert!(
                (f64::from(probs[i]) - p).abs() <= 1e-6 * p.max(1e-30),
                "P({c}|{ctx:?})"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn import_round_trip(
        docs in prop::collection::vec(prop::collection::vec(0u32..30, 0..50), 1..30),
        order in 1usize..=4,
        seed in prop::option::of(any::<u64>()),
        memory in prop::sample::select(vec![1u64, 1 << 20]),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (counts, total) = count_documents(&docs, order);
        let trie = dir.path().join("full.trie");
        write_reference_trie(&trie, order as u64, total, &counts, seed).unwrap();
        let out = dir.path().join("m.ngram");
        let mut o = opts(&trie, &out);
        o.memory = memory;
        o.vocab_size = Some(30);
        if total == 0 {
            let e = import_dart(&o).unwrap_err().to_string();
            prop_assert!(e.contains("holds no n-gram") && e.contains("full.trie"), "{}", e);
            let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            prop_assert_eq!(left, vec![std::ffi::OsString::from("full.trie")]);
            return Ok(());
        }
        let r = import_dart(&o).unwrap();
        prop_assert_eq!(r.nodes, counts.len() as u64 + 1);
        check_import(&trie, &out, 30);
        // Nothing left behind but the input and the model.
        let mut names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        prop_assert_eq!(names, vec!["full.trie".to_string(), "m.ngram".to_string()]);
    }
}

#[test]
fn vocab_from_file_or_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let (counts, total) = count_documents(&[vec![1, 2, 3, 2, 3, 9]], 3);
    let trie = dir.path().join("t.trie");
    write_reference_trie(&trie, 3, total, &counts, Some(7)).unwrap();
    let out = dir.path().join("m.ngram");
    let r = import_dart(&opts(&trie, &out)).unwrap();
    assert_eq!(r.vocab_size, 10, "highest token + 1");
    check_import(&trie, &out, 10);

    let tok = crate::tokenize::tests::write_word_tokenizer(dir.path(), None);
    let mut o = opts(&trie, &out);
    o.tokenizer = Some(tok.clone());
    o.eos_id = Some(2);
    let r = import_dart(&o).unwrap();
    let t = crate::tokenize::LoadedTokenizer::load(&tok).unwrap();
    assert_eq!(r.vocab_size, 12);
    let m = NGramModel::open(&out).unwrap();
    assert_eq!(m.tokenizer_fingerprint(), t.fingerprint());
    assert_eq!(m.eos_id(), Some(2));

    let mut o = opts(&trie, &out);
    o.vocab_size = Some(5);
    let e = import_dart(&o).unwrap_err().to_string();
    assert!(e.contains("token 9") && e.contains("size 5"), "{e}");
}

fn sample_nodes() -> Vec<RefNode> {
    let (counts, total) = count_documents(&[vec![1, 2, 3, 1, 2], vec![2, 3, 4]], 3);
    nodes_from_counts(3, total, &counts, None).unwrap()
}

fn import_nodes(dir: &Path, order: u64, nodes: &[RefNode]) -> String {
    let trie = dir.join("bad.trie");
    write_nodes(&trie, order, nodes).unwrap();
    let out = dir.join("m.ngram");
    let e = import_dart(&opts(&trie, &out)).unwrap_err();
    assert!(!out.exists());
    let msg = e.to_string();
    assert!(msg.contains("bad.trie"), "{msg}");
    msg
}

fn id_of(nodes: &[RefNode], path: &[u32]) -> usize {
    let mut id = 0usize;
    for &t in path {
        id = nodes[id]
            .children
            .iter()
            .find(|c| c.0 == t as i32)
            .unwrap()
            .1 as usize;
    }
    id
}

#[test]
fn corrupted_reference_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = sample_nodes();
    let n12 = id_of(&good, &[1, 2]);

    let mut nodes = good.clone();
    nodes[n12].freq = -5;
    let e = import_nodes(d, 3, &nodes);
    assert!(
        e.contains("count overflow") && e.contains(&format!("node {n12}")),
        "{e}"
    );

    let mut nodes = good.clone();
    nodes[0].freq = i32::MIN;
    assert!(import_nodes(d, 3, &nodes).contains("count overflow"));

    let mut nodes = good.clone();
    nodes[n12].token = -1;
    assert!(import_nodes(d, 3, &nodes).contains(&format!("node {n12} has token -1")));

    let mut nodes = good.clone();
    nodes[n12].parent = 999;
    assert!(import_nodes(d, 3, &nodes).contains("parent 999"));

    let mut nodes = good.clone();
    nodes[0].children[0].1 = 999;
    assert!(import_nodes(d, 3, &nodes).contains("id 999"));

    // A child list naming the wrong token for a child.
    let mut nodes = good.clone();
    let p = id_of(&good, &[1]);
    let k = nodes[p]
        .children
        .iter()
        .position(|c| c.1 == n12 as u64)
        .unwrap();
    nodes[p].children[k].0 = 3;
    let e = import_nodes(d, 3, &nodes);
    assert!(
        e.contains("disagree") && e.contains(&format!("child {n12}")),
        "{e}"
    );

    // A node missing from its parent's list, and listed by another node instead.
    let mut nodes = good.clone();
    let (c, owner) = (nodes[p].children.remove(k), id_of(&good, &[2]));
    nodes[owner].children.push(c);
    let e = import_nodes(d, 3, &nodes);
    assert!(e.contains("disagree"), "{e}");

    // A child listed twice and another not at all.
    let mut nodes = good.clone();
    let dup = nodes[0].children[0];
    nodes[0].children[1] = dup;
    let e = import_nodes(d, 3, &nodes);
    assert!(
        e.contains("disagree") || e.contains("twice") || e.contains("no child list"),
        "{e}"
    );

    // A child list with one entry too many.
    let mut nodes = good.clone();
    let first = nodes[0].children[0];
    nodes[0].children.push(first);
    assert!(import_nodes(d, 3, &nodes).contains("twice"));

    // Deeper than the order, a parent loop, a frequency above the parent's.
    let nodes = good.clone();
    assert!(import_nodes(d, 2, &nodes).contains("deeper than the header's order 2"));
    let mut nodes = good.clone();
    let a = id_of(&good, &[1]);
    let b = n12;
    nodes[a].parent = b as u64;
    let e = import_nodes(d, 3, &nodes);
    assert!(e.contains("disagree") || e.contains("loop"), "{e}");
    let mut nodes = good.clone();
    nodes[n12].freq = 100;
    assert!(import_nodes(d, 3, &nodes).contains("above its parent"));
    let mut nodes = good.clone();
    nodes[n12].freq = 0;
    assert!(import_nodes(d, 3, &nodes).contains("frequency 0"));
    let mut nodes = good.clone();
    nodes[0].freq = 1;
    let e = import_nodes(d, 3, &nodes);
    assert!(
        e.contains("above its parent") || e.contains("sum to"),
        "{e}"
    );

    // Two nodes for one n-gram (consistent links, so only the duplicate check sees it).
    let mut nodes = good.clone();
    let uni = id_of(&good, &[4]);
    nodes[uni].token = 3;
    let k0 = nodes[0]
        .children
        .iter()
        .position(|c| c.1 == uni as u64)
        .unwrap();
    nodes[0].children[k0].0 = 3;
    let e = import_nodes(d, 3, &nodes);
    assert!(
        e.contains("repeats the 1-gram [3]") || e.contains("occurs twice"),
        "{e}"
    );

    // Header problems.
    assert!(import_nodes(d, 0, &good).contains("order 0"));
    let e = import_nodes(d, 3, &[]);
    assert!(e.contains("node count is 0"), "{e}");
}

#[test]
fn duplicate_higher_order_ngram_across_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut counts = BTreeMap::new();
    for a in 0..40u32 {
        counts.insert(vec![a], 1000);
        for b in 0..40u32 {
            counts.insert(vec![a, b], 1);
        }
    }
    let mut nodes = nodes_from_counts(2, 40_000, &counts, Some(3)).unwrap();
    // Re-point one bigram node (and its list entry) at a sibling's token.
    let a5 = nodes[0].children.iter().find(|c| c.0 == 5).unwrap().1 as usize;
    let (t0, id0) = nodes[a5].children[0];
    let t1 = nodes[a5].children[1].0;
    nodes[a5].children[0].0 = t1;
    nodes[id0 as usize].token = t1;
    assert_ne!(t0, t1);
    let trie = dir.path().join("bad.trie");
    write_nodes(&trie, 2, &nodes).unwrap();
    let out = dir.path().join("m.ngram");
    let mut o = opts(&trie, &out);
    o.memory = 1; // minimum table: several runs, so the twin may be met in a merge
    let e = import_dart(&o).unwrap_err().to_string();
    assert!(
        e.contains("bad.trie") && e.contains(&format!("[5, {t1}]")) && e.contains("twice"),
        "{e}"
    );
    assert!(!out.exists());
}

#[test]
fn every_truncation_and_trailing_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let good = sample_nodes();
    let trie = dir.path().join("t.trie");
    write_nodes(&trie, 3, &good).unwrap();
    let bytes = std::fs::read(&trie).unwrap();
    let out = dir.path().join("m.ngram");
    let cut: PathBuf = dir.path().join("cut.trie");
    for len in 0..bytes.len() {
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let e = import_dart(&opts(&cut, &out)).unwrap_err().to_string();
        assert!(
            e.contains("cut.trie") && (e.contains("truncated") || e.contains("hold at most")),
            "{len}: {e}"
        );
    }
    let mut long = bytes.clone();
    long.extend_from_slice(&[0, 0, 0]);
    std::fs::write(&cut, &long).unwrap();
    let e = import_dart(&opts(&cut, &out)).unwrap_err().to_string();
    assert!(e.contains("3 trailing bytes"), "{e}");
    // A header claiming far more nodes than the file holds fails before allocating.
    let mut huge = bytes.clone();
    huge[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    std::fs::write(&cut, &huge).unwrap();
    let e = import_dart(&opts(&cut, &out)).unwrap_err().to_string();
    assert!(e.contains("hold at most"), "{e}");
    // A child count larger than the rest of the file.
    let mut kids = bytes;
    kids[16 + 16..16 + 24].copy_from_slice(&(1u64 << 62).to_le_bytes());
    std::fs::write(&cut, &kids).unwrap();
    let e = import_dart(&opts(&cut, &out)).unwrap_err().to_string();
    assert!(e.contains("children but only"), "{e}");
    assert!(!out.exists());
}

/// A tiny order-2 trie naming token 2^31 - 1 with no vocabulary given: refused before the
/// 2^31-entry unigram array is allocated, and nothing left behind.
#[test]
fn huge_token_ids_stay_within_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let big = i32::MAX;
    let nodes = vec![
        RefNode {
            token: crate::reference::ROOT_TOKEN,
            parent: 0,
            freq: 2,
            children: vec![(big, 1)],
        },
        RefNode {
            token: big,
            parent: 0,
            freq: 2,
            children: vec![],
        },
    ];
    let trie = d.join("t.trie");
    write_nodes(&trie, 2, &nodes).unwrap();
    let out = d.join("m.ngram");
    let e = import_dart(&opts(&trie, &out)).unwrap_err().to_string();
    assert!(
        e.contains("2147483648 ids") && e.contains("memory budget"),
        "{e}"
    );
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(d).unwrap().count(),
        1,
        "only the trie is left"
    );
}

/// The output may not be the trie or the tokenizer (same file by any path).
#[test]
fn output_that_is_an_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let trie = dir.path().join("t.trie");
    write_nodes(&trie, 3, &sample_nodes()).unwrap();
    let before = std::fs::read(&trie).unwrap();
    let link = dir.path().join("link.trie");
    std::fs::hard_link(&trie, &link).unwrap();
    for out in [&trie, &link] {
        let e = import_dart(&opts(&trie, out)).unwrap_err().to_string();
        assert!(e.contains("the output is the input"), "{e}");
    }
    assert_eq!(std::fs::read(&trie).unwrap(), before);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random damage to a valid `.trie` (overwritten bytes, truncation, junk appended): the
    /// import either succeeds with a model that opens, or fails with a clean error naming the
    /// file; it never panics, and a failure leaves no output and no scratch behind.
    #[test]
    fn damaged_tries_fail_cleanly(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        cut in proptest::option::of(any::<usize>()),
        junk in proptest::collection::vec(any::<u8>(), 0..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let trie = d.join("t.trie");
        write_nodes(&trie, 3, &sample_nodes()).unwrap();
        let mut bytes = std::fs::read(&trie).unwrap();
        for (i, v) in edits {
            let n = bytes.len();
            bytes[i % n] = v;
        }
        if let Some(c) = cut {
            let n = bytes.len();
            bytes.truncate(c % n);
        }
        bytes.extend(junk);
        std::fs::write(&trie, &bytes).unwrap();
        let out = d.join("m.ngram");
        let mut o = opts(&trie, &out);
        o.vocab_size = Some(64);
        match import_dart(&o) {
            Ok(_) => {
                NGramModel::open(&out).unwrap();
            }
            Err(e) => {
                prop_assert!(e.to_string().contains("t.trie") || matches!(e, NGramError::InvalidArgument(_)), "{}", e);
                prop_assert!(!out.exists());
                prop_assert_eq!(std::fs::read_dir(d).unwrap().count(), 1, "scratch left: {}", e);
            }
        }
    }
}
