//! `dart-ngram synth`, `info --sections` and `bench`: the commands of the at-scale pipeline
//! (bench/ngram_scale.sh), run as a user would on a corpus small enough for CI.

mod common;

use common::run;

#[test]
fn synth_build_info_sections_and_bench() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus");
    let c = corpus.to_str().unwrap();
    let (ok, out, err) = run(&[
        "synth",
        "--output",
        c,
        "--tokens",
        "2e5",
        "--shards",
        "2",
        "--vocab-size",
        "3000",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("200000 tokens"), "{out}");
    let (ok, _, err) = run(&["synth", "--output", c, "--tokens", "lots"]);
    assert!(!ok && err.contains("not a whole number"), "{err}");

    // The shards build into models and merge, as the scale pipeline runs them.
    let mut shards = Vec::new();
    for i in 0..2 {
        let input = corpus.join(format!("shard-{i:05}.jsonl"));
        let output = dir.path().join(format!("s{i}.ngram"));
        let (ok, _, err) = run(&[
            "build",
            "-i",
            input.to_str().unwrap(),
            "-o",
            output.to_str().unwrap(),
            "--eos-id",
            "0",
            "--vocab-size",
            "3000",
            "--memory",
            "1M",
            "--threads",
            "1",
            "-q",
        ]);
        assert!(ok, "{err}");
        shards.push(output.to_str().unwrap().to_string());
    }
    let merged = dir.path().join("m.ngram");
    let m = merged.to_str().unwrap();
    let (ok, _, err) = run(&["merge", &shards[0], &shards[1], "-o", m]);
    assert!(ok, "{err}");

    // --sections: every section and the header, adding up to the file's size.
    let (ok, out, err) = run(&["info", "--sections", m]);
    assert!(ok, "{err}");
    let size = std::fs::metadata(&merged).unwrap().len();
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("section"))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    assert!(
        table.iter().any(|l| l.starts_with("child-buckets")),
        "{out}"
    );
    let sum: u64 = table
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "kind order bytes per share" or "header bytes per share"
            f[f.len() - 3].parse::<u64>().unwrap()
        })
        .sum();
    assert_eq!(sum, size, "{out}");

    let (ok, out, err) = run(&[
        "bench",
        m,
        "--requests",
        "20",
        "--cold",
        "--cold-mapping",
        "--prefetch",
        "--cold-queries",
        "5",
        "--json",
    ]);
    assert!(ok, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["bytes"].as_u64(), Some(size));
    assert_eq!(r["prune_budget"].as_u64(), Some(60), "{out}");
    for key in ["prob25_warm", "prob25_repeat", "prune_warm"] {
        assert_eq!(
            r[key]["n"].as_u64(),
            Some(if key.starts_with("prob") { 160 } else { 10 }),
            "{key}: {out}"
        );
        assert!(r[key]["p50_us"].as_f64().unwrap() > 0.0, "{key}: {out}");
        assert!(
            r[key]["p99_us"].as_f64() >= r[key]["p50_us"].as_f64(),
            "{out}"
        );
    }
    assert_eq!(r["prob25_cold"]["n"].as_u64(), Some(5), "{out}");
    assert_eq!(r["prune_cold"]["n"].as_u64(), Some(5), "{out}");
    assert!(r["open_ms_cold"].as_f64().is_some(), "{out}");
    // With only the mapping dropped, a lookup's pages are minor faults, and none is read
    // from disk.
    // Small trees (a batch row's), and a budget no tree has.
    let (ok, out, err) = run(&["bench", m, "--requests", "20", "--budget", "4", "--json"]);
    assert!(ok, "{err}");
    let small: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(small["prune_budget"].as_u64(), Some(4), "{out}");
    assert_eq!(small["prune_warm"]["n"].as_u64(), Some(10), "{out}");
    let (ok, _, err) = run(&["bench", m, "--budget", "0"]);
    assert!(!ok && err.contains("--budget"), "{err}");
    for key in ["prob25_cold_mapping", "prune_cold_mapping"] {
        assert_eq!(r[key]["n"].as_u64(), Some(5), "{key}: {out}");
        assert!(
            r[key]["minor_faults"].as_f64().unwrap() > 0.0,
            "{key}: {out}"
        );
        assert_eq!(r[key]["major_faults"].as_f64(), Some(0.0), "{key}: {out}");
    }
    assert_eq!(r["prob25_prefetching"]["n"].as_u64(), Some(5), "{out}");
    assert!(r["prefetch_seconds"].as_f64().unwrap() >= 0.0, "{out}");
    assert!(r["open_ms_prefetch"].as_f64().is_some(), "{out}");

    let (ok, _, err) = run(&["bench", dir.path().join("missing.ngram").to_str().unwrap()]);
    assert!(!ok && err.contains("missing.ngram"), "{err}");
}
