//! `dart-ngram build` and `dart-ngram import-dart` as a user runs them.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::process::Stdio;

use dart_ngram::model::NGramModel;
use dart_ngram_build::reference::{count_documents, write_reference_trie};

mod common;
use common::{bin, run};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn build_reports_and_writes_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.jsonl");
    std::fs::write(&corpus, "{\"ids\": [1, 2, 3]}\n{\"ids\": [2, 3]}\n").unwrap();
    let out = dir.path().join("m.ngram");
    let (ok, stdout, stderr) = run(&[
        "build",
        "--input",
        s(&corpus),
        "--output",
        s(&out),
        "--vocab-size",
        "8",
        "--eos-id",
        "7",
        "--memory",
        "1M",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["tokens"], 7);
    assert_eq!(report["ngrams_per_order"], serde_json::json!([4, 3, 2]));
    let m = NGramModel::open(&out).unwrap();
    assert_eq!(m.count(&[2, 3, 7]).unwrap(), 2);

    let (ok, stdout, _) = run(&[
        "build",
        "-i",
        s(&corpus),
        "-o",
        s(&out),
        "--vocab-size",
        "8",
        "--no-eos",
        "-q",
    ]);
    assert!(ok);
    assert!(stdout.contains("tokens           5"), "{stdout}");
}

#[test]
fn build_errors_exit_nonzero_with_the_place() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("bad.jsonl");
    std::fs::write(&corpus, "{\"ids\": [1]}\n{\"ids\": [1,\n").unwrap();
    let out = dir.path().join("m.ngram");
    let (ok, _, stderr) = run(&[
        "build",
        "--input",
        s(&corpus),
        "--output",
        s(&out),
        "--vocab-size",
        "8",
        "--no-eos",
    ]);
    assert!(!ok);
    assert!(stderr.contains("bad.jsonl:2: malformed JSON"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let (ok, _, stderr) = run(&[
        "build",
        "--input",
        s(&corpus),
        "--output",
        s(&out),
        "--memory",
        "lots",
    ]);
    assert!(!ok && stderr.contains("memory size \"lots\""), "{stderr}");
    let (ok, _, _) = run(&[
        "build",
        "--input",
        s(&corpus),
        "--output",
        s(&out),
        "--eos-id",
        "1",
        "--no-eos",
    ]);
    assert!(!ok, "conflicting flags are refused");
    assert!(!out.exists());
}

#[test]
fn closed_stdout_is_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.jsonl");
    std::fs::write(&corpus, "{\"ids\": [1, 2, 3]}\n").unwrap();
    let out = dir.path().join("m.ngram");
    let mut child = bin()
        .args([
            "build",
            "-i",
            s(&corpus),
            "-o",
            s(&out),
            "--vocab-size",
            "8",
            "--no-eos",
            "-q",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(child.wait().unwrap().success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn import_dart_converts_a_reference_trie() {
    let dir = tempfile::tempdir().unwrap();
    let (counts, total): (BTreeMap<Vec<u32>, u64>, u64) =
        count_documents(&[vec![1, 2, 3, 1, 2], vec![4, 2]], 3);
    let trie = dir.path().join("full.trie");
    write_reference_trie(&trie, 3, total, &counts, Some(5)).unwrap();
    let out = dir.path().join("m.ngram");
    let (ok, stdout, stderr) = run(&[
        "import-dart",
        s(&trie),
        "--output",
        s(&out),
        "--memory",
        "1M",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["nodes"], counts.len() + 1);
    let m = NGramModel::open(&out).unwrap();
    for (g, &c) in &counts {
        assert_eq!(m.count(g).unwrap(), c);
    }
    std::fs::write(&trie, b"\x03\0\0\0\0\0\0\0").unwrap();
    let (ok, _, stderr) = run(&["import-dart", s(&trie), "--output", s(&out)]);
    assert!(
        !ok && stderr.contains("full.trie") && stderr.contains("truncated"),
        "{stderr}"
    );
}

/// The clumsy operator's cases: the corpus as the output, an empty corpus.
#[test]
fn build_refuses_its_input_as_output_and_an_empty_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("a.jsonl");
    let body = "{\"ids\": [1, 2, 3]}\n";
    std::fs::write(&corpus, body).unwrap();
    let args = |input: &Path, output: &Path| {
        vec![
            "build".to_string(),
            "-i".into(),
            s(input).into(),
            "-o".into(),
            s(output).into(),
            "--vocab-size".into(),
            "8".into(),
            "--memory".into(),
            "1M".into(),
            "--no-eos".into(),
            "-q".into(),
        ]
    };
    let a = args(&corpus, &corpus);
    let (ok, _, stderr) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        !ok && stderr.contains("the output is the input"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&corpus).unwrap(), body);

    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let out = dir.path().join("m.ngram");
    let mut a = args(&empty, &out);
    let (ok, _, stderr) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        !ok && stderr.contains("no document") && stderr.contains("--allow-empty"),
        "{stderr}"
    );
    assert!(!out.exists());
    a.push("--allow-empty".into());
    let (ok, _, stderr) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{stderr}");
    assert_eq!(NGramModel::open(&out).unwrap().documents(), 0);
}
