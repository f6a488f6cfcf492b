//! Build throughput, stage by stage.
//!
//! * `count`: the aggregator alone (unigrams + orders 2..3 into the bounded table), on a
//!   synthetic Zipf-like token stream.
//! * `build_ids`: a whole build of pre-tokenized JSON lines with a 1 MiB budget, so the
//!   model written is several times larger than the budget (spills and merges).
//! * `tokenize`: one thread encoding real text, when `DART_BENCH_TOKENIZER` (tokenizer.json)
//!   and `DART_BENCH_CORPUS` (JSON lines with a `text` field) are set: the `tokenizers`
//!   crate's own `encode`, and the build's [`Encoder`](dart_ngram_build::tokenize::Encoder)
//!   (the byte-level BPE fast path with its word cache, when the tokenizer allows it).

use std::io::Write;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dart_ngram::key;
use dart_ngram_build::extsort::{DuplicatePolicy, ExternalCounter};
use dart_ngram_build::tokenize::LoadedTokenizer;
use dart_ngram_build::{build, BuildOptions, EosChoice};

fn zipf_tokens(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((x >> 11) as f64) / ((1u64 << 53) as f64);
            // Inverse CDF of a 1/rank law over the vocabulary.
            ((f64::from(vocab).powf(u) - 1.0) as u32).min(vocab - 1)
        })
        .collect()
}

fn bench_count(c: &mut Criterion) {
    let vocab = 49152;
    let tokens = zipf_tokens(2_000_000, vocab, 7);
    let bits = key::token_bits(vocab);
    let dir = tempfile::tempdir().unwrap();
    let mut g = c.benchmark_group("count");
    g.throughput(Throughput::Elements(tokens.len() as u64));
    g.sample_size(10);
    g.bench_function("zipf_2M_tokens_order3_256MiB", |b| {
        b.iter(|| {
            let mut counter =
                ExternalCounter::new(256 << 20, 3, bits, DuplicatePolicy::Sum, dir.path()).unwrap();
            let mut uni = vec![0u64; vocab as usize];
            for doc in tokens.chunks(500) {
                for (i, &t) in doc.iter().enumerate() {
                    uni[t as usize] += 1;
                    let mut k = u64::from(t);
                    for (n, &next) in (2..=3).zip(&doc[i + 1..]) {
                        k = (k << bits) | u64::from(next);
                        counter.add(n, k, 1).unwrap();
                    }
                }
            }
            counter.finish(None).unwrap().spills()
        })
    });
    g.finish();
}

fn bench_build_ids(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("ids.jsonl");
    let tokens = zipf_tokens(1_000_000, 49152, 11);
    let mut f = std::io::BufWriter::new(std::fs::File::create(&corpus).unwrap());
    for doc in tokens.chunks(400) {
        writeln!(f, "{}", serde_json::json!({ "ids": doc })).unwrap();
    }
    f.flush().unwrap();
    drop(f);
    let out = dir.path().join("m.ngram");
    let mut o = BuildOptions::new(vec![corpus], out);
    o.vocab_size = Some(49152);
    o.eos = EosChoice::Id(0);
    o.memory = 1 << 20;
    o.threads = Some(2);
    let mut g = c.benchmark_group("build_ids");
    g.throughput(Throughput::Elements(tokens.len() as u64));
    g.sample_size(10);
    g.bench_function("1M_tokens_1MiB_budget", |b| {
        b.iter(|| {
            let r = build(&o).unwrap();
            assert!(
                r.output_bytes > 3 * o.memory,
                "model not larger than the budget"
            );
            r.spilled_runs
        })
    });
    g.finish();
}

fn bench_tokenize(c: &mut Criterion) {
    let (Some(tok), Some(corpus)) = (
        std::env::var_os("DART_BENCH_TOKENIZER").map(PathBuf::from),
        std::env::var_os("DART_BENCH_CORPUS").map(PathBuf::from),
    ) else {
        eprintln!("tokenize: set DART_BENCH_TOKENIZER and DART_BENCH_CORPUS to run");
        return;
    };
    let tok = LoadedTokenizer::load(&tok).unwrap();
    let text = std::fs::read_to_string(&corpus).unwrap();
    let docs: Vec<String> = text
        .lines()
        .take(300)
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let n: usize = docs.iter().map(|d| tok.encode(d).unwrap().len()).sum();
    let mut g = c.benchmark_group("tokenize");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    g.bench_function("one_thread_300_docs", |b| {
        b.iter(|| {
            docs.iter()
                .map(|d| tok.encode(d).unwrap().len())
                .sum::<usize>()
        })
    });
    // A fresh encoder per iteration: its word cache starts empty, as a build's does.
    g.bench_function("one_thread_300_docs_encoder", |b| {
        b.iter(|| {
            let mut enc = tok.encoder();
            let mut ids = Vec::new();
            for d in &docs {
                enc.encode_into(d, &mut ids).unwrap();
            }
            ids.len()
        })
    });
    g.finish();
}

criterion_group!(benches, bench_count, bench_build_ids, bench_tokenize);
criterion_main!(benches);
