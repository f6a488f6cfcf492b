//! `dart-ngram info`, `query` and `merge` run as a user would, on models written here.

mod common;

use std::path::Path;

use common::run;

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
        serde_json::json!({"context": [1, 2], "ids": [3, 4, 1], "probs": [0.5, 0.5, 0.0], "matched": [2, 2, 0]})
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
    assert_eq!(
        v,
        serde_json::json!({"context": [1, 2], "scores": "distribution", "ids": [3], "probs": [0.5], "matched": [2]})
    );
    // After "2 4" (seen once, followed by EOS 5) the backoff scores come from the 3-gram.
    let (ok, out, _) = run(&[
        "query",
        a_s,
        "--context",
        "2",
        "4",
        "--top",
        "3",
        "--backoff",
        "--json",
    ]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["scores"].as_str(), &v["ids"], &v["matched"]),
        (
            Some("backoff"),
            &serde_json::json!([5]),
            &serde_json::json!([2])
        )
    );

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

/// A word-level `tokenizer.json`: ids 0 `<unk>`, 1 `</s>`, then the words in order.
fn word_tokenizer(dir: &Path, words: &[&str]) -> std::path::PathBuf {
    let vocab: serde_json::Map<String, serde_json::Value> = ["<unk>", "</s>"]
        .iter()
        .chain(words)
        .enumerate()
        .map(|(i, w)| (w.to_string(), i.into()))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 1, "content": "</s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    path
}

#[test]
fn query_takes_text_and_prints_tokens_and_one_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let tok = word_tokenizer(dir.path(), &["the", "cat", "sat", "dog", "ran", "on"]);
    let corpus = dir.path().join("c.jsonl");
    // After "the": cat x2, dog x1. After "cat": sat x1, ran x1.
    std::fs::write(
        &corpus,
        "{\"text\": \"the cat sat\"}\n{\"text\": \"the cat ran\"}\n{\"text\": \"the dog on\"}\n",
    )
    .unwrap();
    let model = dir.path().join("m.ngram");
    let (t, c, m) = (
        tok.to_str().unwrap(),
        corpus.to_str().unwrap(),
        model.to_str().unwrap(),
    );
    let (ok, _, err) = run(&[
        "build",
        "-i",
        c,
        "-o",
        m,
        "--tokenizer",
        t,
        "--eos-token",
        "</s>",
        "-q",
    ]);
    assert!(ok, "{err}");

    // One distribution after "the" (order 2: the 3-gram context "on the" was never seen).
    let (ok, out, err) = run(&[
        "query",
        m,
        "--tokenizer",
        t,
        "--text",
        "on the",
        "--top",
        "5",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["context"], serde_json::json!([7, 2]));
    assert_eq!(v["ids"], serde_json::json!([3, 5]));
    assert_eq!(v["tokens"], serde_json::json!(["cat", "dog"]));
    let probs: Vec<f64> = serde_json::from_value(v["probs"].clone()).unwrap();
    assert!((probs[0] - 2.0 / 3.0).abs() < 1e-6 && (probs[1] - 1.0 / 3.0).abs() < 1e-6);
    assert_eq!(v["matched"], serde_json::json!([1, 1]));
    let (ok, out, _) = run(&[
        "query",
        m,
        "--tokenizer",
        t,
        "--text",
        "on the",
        "--top",
        "5",
    ]);
    assert!(
        ok && out.contains("order-2 distribution") && out.contains("3\t\"cat\"\t0.666667"),
        "{out}"
    );

    // An empty context answers from the unigrams ("the" and "</s>" tie at 3: the lower id).
    let (ok, out, _) = run(&["query", m, "--context", "--top", "1", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["ids"][0].as_u64(), v["matched"][0].as_u64()),
        (Some(1), Some(0))
    );

    // Candidates as tokens; a candidate that is not one token, and another tokenizer, fail clearly.
    let (ok, out, err) = run(&[
        "query",
        m,
        "--tokenizer",
        t,
        "--text",
        "the cat",
        "--candidate-tokens",
        "sat",
        "dog",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ids"], serde_json::json!([4, 5]));
    assert_eq!(v["matched"], serde_json::json!([2, 0]));
    let (ok, _, err) = run(&[
        "query",
        m,
        "--tokenizer",
        t,
        "--text",
        "the",
        "--candidate-tokens",
        "cat sat",
    ]);
    assert!(!ok && err.contains("not one"), "{err}");
    let other = tempfile::tempdir().unwrap();
    let wrong = word_tokenizer(other.path(), &["a", "b"]);
    let (ok, _, err) = run(&[
        "query",
        m,
        "--tokenizer",
        wrong.to_str().unwrap(),
        "--text",
        "a",
        "--top",
        "1",
    ]);
    assert!(!ok && err.contains("was built with tokenizer"), "{err}");
}
