//! One prune request over loopback gRPC (tonic client) against the same prune in process.
//!
//! The model is `DART_BENCH_MODEL` if set (e.g. a ShareGPT model from `dart-ngram build`),
//! else a synthetic Zipfian 3-gram model written to a temporary directory. The Python client's
//! figures (and 1/4/16 concurrent clients) come from `python -m dart_client.apps.bench.daemon_bench`.

use std::collections::BTreeMap;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use dart_daemon::proto::n_gram_service_client::NGramServiceClient;
use dart_daemon::proto::{self};
use dart_daemon::{bind, ServeOptions};
use dart_ngram::{key, write_model, CountStream, ModelMeta, NGramModel, WriteOptions};
use dart_pruner::{DraftRequest, Pruner, PrunerConfig};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn zipf(&mut self, vocab: u32) -> u32 {
        let r = (self.next() % (1 << 20)) as f64 / (1u64 << 20) as f64;
        ((vocab as f64).powf(r) as u32).min(vocab - 1)
    }
}

fn synthetic_model(dir: &std::path::Path) -> std::path::PathBuf {
    const VOCAB: u32 = 32_000;
    let path = dir.join("bench.ngram");
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut grams: BTreeMap<Vec<u32>, u64> = BTreeMap::new();
    let mut uni = vec![0u64; VOCAB as usize];
    let mut total = 0;
    let docs = 2000u64;
    for _ in 0..docs {
        let mut d: Vec<u32> = (0..500).map(|_| rng.zipf(VOCAB)).collect();
        d.push(2);
        total += d.len() as u64;
        for i in 0..d.len() {
            uni[d[i] as usize] += 1;
            for n in 2..=3 {
                if i + n <= d.len() {
                    *grams.entry(d[i..i + n].to_vec()).or_insert(0) += 1;
                }
            }
        }
    }
    let bits = key::token_bits(VOCAB);
    let streams: Vec<CountStream<'static>> = (2..=3)
        .map(|n| {
            let mut v: Vec<(u64, u64)> = grams
                .iter()
                .filter(|(g, _)| g.len() == n)
                .map(|(g, &c)| (key::pack(g, bits), c))
                .collect();
            v.sort_unstable();
            Box::new(v.into_iter().map(Ok)) as CountStream<'static>
        })
        .collect();
    let meta = ModelMeta {
        order: 3,
        vocab_size: VOCAB,
        tokenizer_fingerprint: [0; 32],
        eos_id: Some(2),
        min_count: 1,
        total_tokens: total,
        documents: docs,
        source: "dart-daemon bench".into(),
    };
    write_model(&path, &meta, &uni, streams, &WriteOptions::default()).unwrap();
    path
}

/// Drafts whose ids are the model's own continuations (so lookups hit), topped up at random.
fn drafts(model: &NGramModel, n: usize) -> Vec<proto::Draft> {
    let mut rng = Rng(99);
    let vocab = model.vocab_size();
    (0..n)
        .map(|_| {
            let mut ctx = vec![rng.zipf(vocab), rng.zipf(vocab)];
            let mut ids = Vec::new();
            for _ in 0..8 {
                let mut row: Vec<u32> = model
                    .top_k(&ctx, 12)
                    .unwrap()
                    .into_iter()
                    .map(|(t, _)| t)
                    .collect();
                while row.len() < 25 {
                    let t = rng.zipf(vocab);
                    if !row.contains(&t) {
                        row.push(t);
                    }
                }
                ctx.push(row[0]);
                ids.extend(row);
            }
            let probs: Vec<f32> = (0..8 * 25)
                .map(|i| {
                    let w = 1.0 / (1.0 + (i % 25) as f32);
                    w / 3.816
                })
                .collect();
            proto::Draft {
                context: ctx[..2].to_vec(),
                topk_ids: ids,
                topk_probs: probs,
                levels: 8,
                k: 25,
                budget: None,
                lookup_path: Vec::new(),
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = std::env::var_os("DART_BENCH_MODEL")
        .map(Into::into)
        .unwrap_or_else(|| synthetic_model(dir.path()));
    let model = Arc::new(NGramModel::open(&path).unwrap());
    let drafts = drafts(&model, 256);

    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let bound = server_rt
        .block_on(bind(
            Arc::clone(&model),
            ServeOptions {
                listen: "127.0.0.1:0".parse().unwrap(),
                ..ServeOptions::default()
            },
        ))
        .unwrap();
    let addr = bound.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = server_rt.spawn(bound.serve(async {
        let _ = stopped.await;
    }));

    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut client = client_rt
        .block_on(NGramServiceClient::connect(format!("http://{addr}")))
        .unwrap();

    let pruner = Pruner::new(Arc::clone(&model), PrunerConfig::default()).unwrap();
    let mut group = c.benchmark_group("prune_k25_l8_beam20_60nodes");
    let mut i = 0;
    group.bench_function("in_process", |b| {
        b.iter(|| {
            let d = &drafts[i % drafts.len()];
            i += 1;
            pruner
                .prune(&DraftRequest {
                    context: &d.context,
                    topk_ids: &d.topk_ids,
                    topk_probs: &d.topk_probs,
                    levels: 8,
                    k: 25,
                    budget: None,
                    lookup_path: &[],
                })
                .unwrap()
        })
    });
    group.bench_function("grpc_loopback", |b| {
        b.iter(|| {
            let d = drafts[i % drafts.len()].clone();
            i += 1;
            client_rt
                .block_on(client.prune(proto::PruneRequest {
                    draft: Some(d),
                    config: None,
                }))
                .unwrap()
        })
    });
    group.finish();

    let _ = stop.send(());
    let _ = server_rt.block_on(served);
}

criterion_group!(benches, bench);
criterion_main!(benches);
