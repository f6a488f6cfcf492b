//! Criterion benchmarks of the pruner on the workload it is built for: k = 25 candidates per
//! level, 8 levels, beam 20, 60 nodes, with n-gram lookups in a real mmap'd `.ngram` model.
//!
//! The model is `DART_BENCH_MODEL` when that points to a file (e.g. the ShareGPT model),
//! otherwise one written here from a synthetic corpus (2M tokens, 49152-token vocabulary,
//! Zipfian unigrams with Markov structure so trigram contexts branch like text). Requests are
//! draft-like: each row holds the corpus' true next token near the top, the model's own best
//! continuations and Zipfian filler, with decaying softmax probabilities.
//!
//! Benches: `single/*` (one request, one thread; `no_ngram` leaves lookups out),
//! `lookups/replay` (exactly the n-gram lookups of one `single/ngram` request, replayed, so
//! their share of the time is `replay / single`), `batch/*` (`prune_batch` of 1, 8, 32, 64
//! requests vs a sequential loop), `top_k_rows/*` (the draft rows the pruner reads, from
//! the head's logits).

use std::collections::HashMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dart_ngram::{key, write_model, CountStream, ModelMeta, NGramModel, WriteOptions};
use dart_pruner::workload::{draft_requests, walk_documents, OwnedRequest, Rng, Zipf};
use dart_pruner::{NGramScorer, Pruner, PrunerConfig, PrunerError};

const VOCAB: u32 = 49152;
const LEVELS: usize = 8;
const K: usize = 25;

/// Documents of Zipfian tokens where, half of the time, the next token is one of a few
/// preferred successors of the previous one (so contexts have skewed continuations).
fn synthetic_corpus(tokens: usize, rng: &mut Rng) -> Vec<Vec<u32>> {
    let zipf = Zipf::new(VOCAB - 1, 1.1);
    let succ = Zipf::new(8, 1.5);
    let mut docs = vec![];
    let mut total = 0;
    while total < tokens {
        let len = 50 + (rng.next_u64() % 450) as usize;
        let mut doc = Vec::with_capacity(len);
        let mut prev = zipf.sample(rng);
        for _ in 0..len {
            let t = if rng.unit() < 0.5 {
                let r = u64::from(succ.sample(rng));
                ((u64::from(prev) * 2_654_435_761 + r * 40_503) % u64::from(VOCAB - 1)) as u32
            } else {
                zipf.sample(rng)
            };
            doc.push(t);
            prev = t;
        }
        total += len + 1;
        docs.push(doc);
    }
    docs
}

fn write_synthetic_model(docs: &[Vec<u32>], path: &std::path::Path) {
    let eos = VOCAB - 1;
    let bits = key::token_bits(VOCAB);
    let mut unigrams = vec![0u64; VOCAB as usize];
    let mut maps: Vec<HashMap<u64, u64>> = vec![HashMap::new(), HashMap::new()];
    for doc in docs {
        let mut d = doc.clone();
        d.push(eos);
        for &t in &d {
            unigrams[t as usize] += 1;
        }
        for n in 2..=3 {
            for g in d.windows(n) {
                *maps[n - 2].entry(key::pack(g, bits)).or_insert(0) += 1;
            }
        }
    }
    let streams: Vec<CountStream<'static>> = maps
        .into_iter()
        .map(|m| {
            let mut v: Vec<(u64, u64)> = m.into_iter().collect();
            v.sort_unstable();
            Box::new(v.into_iter().map(Ok)) as CountStream<'static>
        })
        .collect();
    let meta = ModelMeta {
        order: 3,
        vocab_size: VOCAB,
        tokenizer_fingerprint: [0; 32],
        eos_id: Some(eos),
        min_count: 1,
        total_tokens: unigrams.iter().sum(),
        documents: docs.len() as u64,
        source: "dart-pruner bench (synthetic)".into(),
    };
    write_model(path, &meta, &unigrams, streams, &WriteOptions::default()).unwrap();
}

/// Records every lookup one prune makes, for the replay bench.
struct Recorder<'a> {
    model: &'a NGramModel,
    calls: Mutex<Vec<(Vec<u32>, Vec<u32>)>>,
}
impl NGramScorer for Recorder<'_> {
    fn order(&self) -> usize {
        self.model.order()
    }
    fn vocab_size(&self) -> u32 {
        self.model.vocab_size()
    }
    fn eos_id(&self) -> Option<u32> {
        self.model.eos_id()
    }
    fn prob_many(&self, c: &[u32], cands: &[u32], p: &mut [f32]) -> Result<(), PrunerError> {
        self.calls
            .lock()
            .unwrap()
            .push((c.to_vec(), cands.to_vec()));
        NGramScorer::prob_many(self.model, c, cands, p)
    }
}

struct Setup {
    model: Arc<NGramModel>,
    requests: Vec<OwnedRequest>,
    _dir: Option<tempfile::TempDir>,
}

fn setup() -> Setup {
    let mut rng = Rng(0x5eed);
    let (path, dir, docs) = match std::env::var_os("DART_BENCH_MODEL").map(PathBuf::from) {
        Some(p) if p.is_file() => {
            // Requests from random walks over the real model's own best continuations.
            (p, None, None)
        }
        _ => {
            let dir = tempfile::tempdir().unwrap();
            let docs = synthetic_corpus(2_000_000, &mut rng);
            let path = dir.path().join("synthetic.ngram");
            write_synthetic_model(&docs, &path);
            (path, Some(dir), Some(docs))
        }
    };
    let model = Arc::new(NGramModel::open(&path).unwrap());
    let docs = docs.unwrap_or_else(|| walk_documents(&model, 300, 60, &mut rng));
    let requests = draft_requests(&model, &docs, 256, LEVELS, K, &mut rng);
    eprintln!("bench model: {} ({} bytes)", path.display(), model.bytes());
    Setup {
        model,
        requests,
        _dir: dir,
    }
}

fn benches(c: &mut Criterion) {
    let s = setup();
    let pruner = Pruner::new(s.model.clone(), PrunerConfig::default()).unwrap();
    let no_ngram = Pruner::new(
        s.model.clone(),
        PrunerConfig {
            ngram_weight: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    let reqs: Vec<dart_pruner::DraftRequest<'_>> =
        s.requests.iter().map(OwnedRequest::request).collect();
    let sizes: Vec<usize> = reqs
        .iter()
        .map(|r| pruner.prune(r).unwrap().len() - 1)
        .collect();
    assert!(
        sizes.iter().all(|&n| n == 60),
        "every tree should fill the budget"
    );

    // Per-request latency percentiles (criterion reports means; the goal is about p50). The
    // minimum shows the cost without interference from other processes on the machine.
    for (name, p) in [("ngram", &pruner), ("no_ngram", &no_ngram)] {
        let mut t: Vec<f64> = (0..4000)
            .map(|i| {
                let start = std::time::Instant::now();
                black_box(p.prune(&reqs[i % reqs.len()]).unwrap());
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        t.sort_by(f64::total_cmp);
        let q = |f: f64| t[((t.len() - 1) as f64 * f) as usize];
        eprintln!(
            "single/{name}: p50 {:.1} us, p90 {:.1} us, min {:.1} us",
            q(0.5),
            q(0.9),
            t[0]
        );
    }

    let mut g = c.benchmark_group("single");
    let mut i = 0;
    g.bench_function("ngram", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            black_box(pruner.prune(&reqs[i]).unwrap())
        })
    });
    g.bench_function("no_ngram", |b| {
        b.iter(|| {
            i = (i + 1) % reqs.len();
            black_box(no_ngram.prune(&reqs[i]).unwrap())
        })
    });
    g.finish();

    // Smaller trees: the CPU's lone 12-node trees and a batch row's 4 (the beam stops at the
    // paths that can still lead to a kept node, so these make fewer lookups than 60).
    let mut g = c.benchmark_group("budget");
    for budget in [12usize, 4] {
        let small: Vec<dart_pruner::DraftRequest<'_>> = reqs
            .iter()
            .map(|r| dart_pruner::DraftRequest {
                budget: Some(budget),
                ..*r
            })
            .collect();
        g.bench_with_input(BenchmarkId::new("ngram", budget), &budget, |b, _| {
            b.iter(|| {
                i = (i + 1) % small.len();
                black_box(pruner.prune(&small[i]).unwrap())
            })
        });
    }
    g.finish();

    // The lookups of all 256 requests, replayed one request at a time.
    let recorded: Vec<Vec<(Vec<u32>, Vec<u32>)>> = reqs
        .iter()
        .map(|r| {
            let rec = Recorder {
                model: &s.model,
                calls: Mutex::new(vec![]),
            };
            Pruner::new(&rec, PrunerConfig::default())
                .unwrap()
                .prune(r)
                .unwrap();
            rec.calls.into_inner().unwrap()
        })
        .collect();
    let calls: usize = recorded.iter().map(Vec::len).sum();
    let distinct: usize = recorded
        .iter()
        .map(|r| {
            let mut c: Vec<&(Vec<u32>, Vec<u32>)> = r.iter().collect();
            c.sort();
            c.dedup();
            c.len()
        })
        .sum();
    eprintln!(
        "distinct (context, row) lookups per request: {:.1}",
        distinct as f64 / recorded.len() as f64
    );
    eprintln!(
        "lookups per request: {:.1} prob_many calls of {K} candidates (mean of {})",
        calls as f64 / recorded.len() as f64,
        recorded.len()
    );
    let mut probs = vec![0f32; K];
    let mut g = c.benchmark_group("lookups");
    g.bench_function("replay", |b| {
        b.iter(|| {
            i = (i + 1) % recorded.len();
            for (ctx, cands) in &recorded[i] {
                NGramScorer::prob_many(&*s.model, ctx, cands, &mut probs).unwrap();
            }
            black_box(&probs);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("batch");
    for n in [1usize, 8, 32, 64] {
        g.throughput(Throughput::Elements(n as u64));
        let batch = &reqs[..n];
        g.bench_with_input(BenchmarkId::new("prune_batch", n), &n, |b, _| {
            b.iter(|| black_box(pruner.prune_batch(batch)))
        });
        g.bench_with_input(BenchmarkId::new("sequential", n), &n, |b, _| {
            b.iter(|| black_box(batch.iter().map(|r| pruner.prune(r)).collect::<Vec<_>>()))
        });
    }
    g.finish();
}

/// `top_k_rows` on the shipped SmolLM2 head's shape: 4 rows of an 8192-token draft
/// vocabulary, k = 25, bf16 bits and f32.
fn draft_rows(c: &mut Criterion) {
    let mut rng = Rng(7);
    let (rows, vocab) = (4usize, 8192usize);
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|_| (rng.unit() * 12.0 - 6.0) as f32)
        .collect();
    let bits: Vec<u16> = logits.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    let d2t: Vec<u32> = (0..vocab as u32).map(|i| i * 5).collect();
    let mut g = c.benchmark_group("top_k_rows");
    g.throughput(Throughput::Elements((rows * vocab) as u64));
    g.bench_function("bf16_4x8192_k25", |b| {
        b.iter(|| black_box(dart_pruner::top_k_rows(&bits, rows, K, Some(&d2t))))
    });
    g.bench_function("f32_4x8192_k25", |b| {
        b.iter(|| black_box(dart_pruner::top_k_rows(&logits, rows, K, Some(&d2t))))
    });
    g.finish();
}

criterion_group!(pruner_benches, benches, draft_rows);
criterion_main!(pruner_benches);
