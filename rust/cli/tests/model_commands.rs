//! `dart-ngram info`, `query` and `merge` run as a user would, on models written here.

use std::path::Path;
use std::process::Command;

use dart_ngram::{key, write_model, CountStream, ModelMeta, NGramModel, WriteOptions};

/// Writes the 3-gram model of one document `1 2 3 1 2 4` (+ EOS 5), vocabulary 6.
fn model(path: &Path) {
    let doc = [1u32, 2, 3, 1, 2, 4, 5];
    let bits = key::token_bits(6);
    let mut uni = vec![0u64; 6];
    let mut grams: [std::collections::BTreeMap<u64, u64>; 2] = Default::default();
    for i in 0..doc.len() {
        uni[doc[i] as usize] += 1;
        for n in 2..=3 {
            if i + n <= doc.len() {
                *grams[n - 2]
                    .entry(key::pack(&doc[i..i + n], bits))
                    .or_default() += 1;
            }
        }
    }
    let streams: Vec<CountStream<'static>> = grams
        .into_iter()
        .map(|m| Box::new(m.into_iter().map(Ok)) as CountStream<'static>)
        .collect();
    let meta = ModelMeta {
        order: 3,
        vocab_size: 6,
        tokenizer_fingerprint: [0xab; 32],
        eos_id: Some(5),
        min_count: 1,
        total_tokens: doc.len() as u64,
        documents: 1,
        source: "cli test".into(),
    };
    write_model(path, &meta, &uni, streams, &WriteOptions::default()).unwrap();
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dart-ngram"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn info_query_and_merge() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.ngram");
    model(&a);
    let a_s = a.to_str().unwrap();

    let (ok, out, err) = run(&["info", a_s, "--json", "--verify"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["order"], 3);
    assert_eq!(v["ngrams_per_order"], serde_json::json!([5, 5, 5]));
    assert_eq!(v["tokenizer_fingerprint"], "ab".repeat(32));
    assert_eq!(v["eos_id"], 5);
    assert_eq!(v["verified"], true);
    let (ok, out, _) = run(&["info", a_s]);
    assert!(
        ok && out.contains("bytes / n-gram") && out.contains("3-grams"),
        "{out}"
    );

    // P(c | 1 2): 3 and 4 seen once each after (1, 2), which was seen twice.
    let (ok, out, err) = run(&[
        "query",
        a_s,
        "--context",
        "1",
        "2",
        "--candidates",
        "3",
        "4",
        "1",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"probs": [0.5, 0.5, 0.0], "matched": [2, 2, 0]})
    );
    let (ok, out, _) = run(&[
        "query",
        a_s,
        "--context",
        "9",
        "2",
        "--candidates",
        "3",
        "--json",
    ]);
    assert!(!ok && out.is_empty());
    let (ok, out, _) = run(&["query", a_s, "--context", "1", "2", "--top", "1", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v, serde_json::json!({"ids": [3], "probs": [0.5]}));

    let b = dir.path().join("b.ngram");
    model(&b);
    let c = dir.path().join("c.ngram");
    let (ok, _, err) = run(&[
        "merge",
        a_s,
        b.to_str().unwrap(),
        "--output",
        c.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let m = NGramModel::open(&c).unwrap();
    assert_eq!(m.count(&[1, 2]).unwrap(), 4);
    assert_eq!(m.total_tokens(), 14);

    let junk = dir.path().join("junk.ngram");
    std::fs::write(&junk, b"definitely not a model, just some bytes here").unwrap();
    let (ok, _, err) = run(&["info", junk.to_str().unwrap()]);
    assert!(
        !ok && err.contains("junk.ngram") && err.contains("not a DART n-gram model"),
        "{err}"
    );
}
