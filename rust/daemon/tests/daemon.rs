//! The real daemon on an ephemeral loopback port, queried through the generated gRPC client and
//! compared with the same model and pruner called in process.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dart_daemon::proto::n_gram_service_client::NGramServiceClient;
use dart_daemon::proto::{self, TokenRows};
use dart_daemon::{bind, ServeOptions};
use dart_ngram::{key, write_model, CountStream, ModelMeta, NGramModel, WriteOptions};
use dart_pruner::{DraftRequest, Pruner, PrunerConfig};
use tonic::transport::Channel;
use tonic::Code;

const VOCAB: u32 = 300;
const EOS: u32 = 2;

/// A small xorshift generator: deterministic inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Zipf-like token: small ids are much more frequent, so contexts repeat.
    fn token(&mut self) -> u32 {
        let r = self.below(1 << 20) as f64 / (1u64 << 20) as f64;
        ((VOCAB as f64).powf(r) as u32).min(VOCAB - 1)
    }
}

/// Writes a 3-gram model of a synthetic corpus (EOS appended to every document, n-grams never
/// crossing documents).
fn write_test_model(path: &Path) {
    write_model_with(path, 3, 0x9E37_79B9_7F4A_7C15);
}

/// A model of `order` over a corpus drawn from `seed` (another seed: another model for the
/// same tokenizer and vocabulary).
fn write_model_with(path: &Path, order: usize, seed: u64) {
    let mut rng = Rng(seed);
    let mut grams: BTreeMap<Vec<u32>, u64> = BTreeMap::new();
    let mut uni = vec![0u64; VOCAB as usize];
    let mut total = 0;
    let docs = 400;
    for _ in 0..docs {
        let len = 5 + rng.below(60) as usize;
        let mut d: Vec<u32> = (0..len).map(|_| rng.token()).collect();
        d.push(EOS);
        total += d.len() as u64;
        for i in 0..d.len() {
            uni[d[i] as usize] += 1;
            for n in 2..=order {
                if i + n <= d.len() {
                    *grams.entry(d[i..i + n].to_vec()).or_insert(0) += 1;
                }
            }
        }
    }
    let bits = key::token_bits(VOCAB);
    let streams: Vec<CountStream<'static>> = (2..=order)
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
        order,
        vocab_size: VOCAB,
        tokenizer_fingerprint: [0xAB; 32],
        eos_id: Some(EOS),
        min_count: 1,
        total_tokens: total,
        documents: docs,
        source: "dart-daemon test".into(),
    };
    write_model(path, &meta, &uni, streams, &WriteOptions::default()).unwrap();
}

struct Fixture {
    dir: tempfile::TempDir,
    model: Arc<NGramModel>,
    addr: std::net::SocketAddr,
    metrics_addr: std::net::SocketAddr,
    metrics: Arc<dart_daemon::metrics::Metrics>,
    server: Arc<dart_daemon::service::NGramServer>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<dart_daemon::Result<()>>,
}

async fn start(options: ServeOptions) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("test.ngram");
    write_test_model(&path);
    let model = Arc::new(NGramModel::open(&path).unwrap());
    let options = ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..options
    };
    let bound = bind(Arc::clone(&model), options).await.unwrap();
    let addr = bound.local_addr();
    let metrics_addr = bound.metrics_addr().unwrap();
    let metrics = bound.metrics();
    let server = bound.server();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(bound.serve(async {
        let _ = rx.await;
    }));
    Fixture {
        dir,
        model,
        addr,
        metrics_addr,
        metrics,
        server,
        stop: Some(tx),
        served,
    }
}

async fn client(addr: std::net::SocketAddr) -> NGramServiceClient<Channel> {
    NGramServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

fn rows(rows: &[Vec<u32>]) -> TokenRows {
    TokenRows {
        tokens: rows.iter().flatten().copied().collect(),
        lengths: rows.iter().map(|r| r.len() as u32).collect(),
    }
}

/// A draft like the head's: `levels` rows of `k` distinct ids, probabilities summing to 1.
fn random_draft(rng: &mut Rng, levels: usize, k: usize) -> proto::Draft {
    let ctx_len = 1 + rng.below(6) as usize;
    let context: Vec<u32> = (0..ctx_len).map(|_| rng.token()).collect();
    let mut ids = Vec::with_capacity(levels * k);
    let mut probs = Vec::with_capacity(levels * k);
    for _ in 0..levels {
        let mut row: Vec<u32> = Vec::with_capacity(k);
        while row.len() < k {
            let t = rng.token();
            if !row.contains(&t) {
                row.push(t);
            }
        }
        let w: Vec<f64> = (0..k).map(|_| (rng.below(1000) + 1) as f64).collect();
        let s: f64 = w.iter().sum();
        ids.extend(row);
        probs.extend(w.iter().map(|x| (x / s) as f32));
    }
    proto::Draft {
        context,
        topk_ids: ids,
        topk_probs: probs,
        levels: levels as u32,
        k: k as u32,
        budget: if rng.below(3) == 0 {
            Some(1 + rng.below(40) as u32)
        } else {
            None
        },
        // A prompt-lookup continuation on half of the drafts.
        lookup_path: if rng.below(2) == 0 {
            (0..rng.below(9)).map(|_| rng.token()).collect()
        } else {
            Vec::new()
        },
    }
}

/// The daemon's tree for `d` with its default configuration.
async fn remote_tree(c: &mut NGramServiceClient<Channel>, d: &proto::Draft) -> proto::DraftTree {
    c.prune(proto::PruneRequest {
        draft: Some(d.clone()),
        config: None,
    })
    .await
    .unwrap()
    .into_inner()
    .tree
    .unwrap()
}

fn local_request(d: &proto::Draft) -> DraftRequest<'_> {
    DraftRequest {
        context: &d.context,
        topk_ids: &d.topk_ids,
        topk_probs: &d.topk_probs,
        levels: d.levels as usize,
        k: d.k as usize,
        budget: d.budget.map(|b| b as usize),
        lookup_path: &d.lookup_path,
    }
}

async fn stop(mut f: Fixture) {
    f.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), f.served)
        .await
        .expect("the daemon drains within 30 s")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_reports_the_model_and_its_tokenizer() {
    let f = start(ServeOptions::default()).await;
    let mut c = client(f.addr).await;
    let info = c.info(proto::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.order, 3);
    assert_eq!(info.vocab_size, VOCAB);
    assert_eq!(info.tokenizer_fingerprint, vec![0xAB; 32]);
    assert_eq!(info.eos_id, Some(EOS));
    assert_eq!(info.total_tokens, f.model.total_tokens());
    let json: serde_json::Value = serde_json::from_str(&info.info_json).unwrap();
    assert_eq!(json["vocab_size"], VOCAB);
    stop(f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_queries_equal_local_ones() {
    let f = start(ServeOptions::default()).await;
    let mut c = client(f.addr).await;
    let mut rng = Rng(42);
    for round in 0..20 {
        // Alternate small batches (answered inline) and large ones (spread over rayon).
        let n_rows = if round % 2 == 0 {
            1 + rng.below(8)
        } else {
            100 + rng.below(50)
        } as usize;
        let contexts: Vec<Vec<u32>> = (0..n_rows)
            .map(|_| (0..rng.below(5)).map(|_| rng.token()).collect())
            .collect();
        let candidates: Vec<Vec<u32>> = (0..n_rows)
            .map(|_| (0..rng.below(30)).map(|_| rng.token()).collect())
            .collect();
        let remote = c
            .prob(proto::ProbRequest {
                contexts: Some(rows(&contexts)),
                candidates: Some(rows(&candidates)),
            })
            .await
            .unwrap()
            .into_inner();
        let mut at = 0;
        for (ctx, cands) in contexts.iter().zip(&candidates) {
            let mut p = vec![0f32; cands.len()];
            let mut m = vec![0u8; cands.len()];
            f.model.prob_many(ctx, cands, &mut p, &mut m).unwrap();
            assert_eq!(&remote.probs[at..at + cands.len()], &p[..]);
            assert_eq!(&remote.matched[at..at + cands.len()], &m[..]);
            at += cands.len();
        }
        assert_eq!(at, remote.probs.len());

        let k = 1 + rng.below(40) as u32;
        let top = c
            .top_k(proto::TopKRequest {
                contexts: Some(rows(&contexts)),
                k,
            })
            .await
            .unwrap()
            .into_inner();
        let mut at = 0;
        for (i, ctx) in contexts.iter().enumerate() {
            let local = f.model.top_k(ctx, k as usize).unwrap();
            let n = top.lengths[i] as usize;
            let remote: Vec<(u32, f32)> = top.ids[at..at + n]
                .iter()
                .copied()
                .zip(top.probs[at..at + n].iter().copied())
                .collect();
            assert_eq!(remote, local);
            at += n;
        }

        let seqs: Vec<Vec<u32>> = (0..n_rows)
            .map(|_| (0..rng.below(4)).map(|_| rng.token()).collect())
            .collect();
        let counts = c
            .count(proto::CountRequest {
                sequences: Some(rows(&seqs)),
            })
            .await
            .unwrap()
            .into_inner()
            .counts;
        let local: Vec<u64> = seqs.iter().map(|s| f.model.count(s).unwrap()).collect();
        assert_eq!(counts, local);
    }
    stop(f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prunes_equal_local_ones() {
    let f = start(ServeOptions::default()).await;
    let mut c = client(f.addr).await;
    let mut rng = Rng(7);
    let pruner = Pruner::new(Arc::clone(&f.model), PrunerConfig::default()).unwrap();
    for _ in 0..30 {
        let levels = 1 + rng.below(8) as usize;
        let k = 1 + rng.below(25) as usize;
        let d = random_draft(&mut rng, levels, k);
        let remote = remote_tree(&mut c, &d).await;
        let local = pruner.prune(&local_request(&d)).unwrap();
        assert_eq!(remote, dart_daemon::service::tree_to_proto(&local));
        assert_eq!(remote.tokens.len(), local.len());
        assert_eq!(
            remote.attention_mask.len(),
            local.len() * local.len(),
            "the mask is n x n"
        );
    }
    // A configuration override prunes exactly as a local pruner with that configuration.
    let overrides = proto::PrunerConfig {
        beam_width: Some(5),
        max_nodes: Some(17),
        ngram_weight: Some(0.0),
        ..Default::default()
    };
    let custom = Pruner::new(
        Arc::clone(&f.model),
        PrunerConfig {
            beam_width: 5,
            max_nodes: 17,
            ngram_weight: 0.0,
            ..PrunerConfig::default()
        },
    )
    .unwrap();
    let drafts: Vec<proto::Draft> = (0..12).map(|_| random_draft(&mut rng, 8, 25)).collect();
    let batch = c
        .prune_batch(proto::PruneBatchRequest {
            drafts: drafts.clone(),
            config: Some(overrides),
        })
        .await
        .unwrap()
        .into_inner()
        .trees;
    assert_eq!(batch.len(), drafts.len());
    for (d, remote) in drafts.iter().zip(&batch) {
        let local = custom.prune(&local_request(d)).unwrap();
        assert_eq!(remote, &dart_daemon::service::tree_to_proto(&local));
    }
    stop(f).await;
}

/// Busy polling (one serving thread, as `dart-ngram serve --busy-poll-us` runs it) answers
/// exactly as the default daemon does, and does not keep a shutdown from finishing.
#[tokio::test(flavor = "current_thread")]
async fn a_busy_polling_daemon_answers_the_same_and_shuts_down() {
    let f = start(ServeOptions {
        busy_poll: Duration::from_millis(50),
        ..ServeOptions::default()
    })
    .await;
    let mut c = client(f.addr).await;
    let mut rng = Rng(11);
    let pruner = Pruner::new(Arc::clone(&f.model), PrunerConfig::default()).unwrap();
    for i in 0..20 {
        if i == 10 {
            // Past the polling window: the poller sleeps, and the next request wakes it.
            tokio::time::sleep(Duration::from_millis(120)).await;
        }
        let (levels, k) = (1 + rng.below(8) as usize, 1 + rng.below(25) as usize);
        let d = random_draft(&mut rng, levels, k);
        let remote = remote_tree(&mut c, &d).await;
        let local = pruner.prune(&local_request(&d)).unwrap();
        assert_eq!(remote, dart_daemon::service::tree_to_proto(&local));
    }
    drop(c);
    stop(f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_their_status_and_the_daemon_keeps_serving() {
    let f = start(ServeOptions {
        max_request_bytes: 64 * 1024,
        ..ServeOptions::default()
    })
    .await;
    let mut c = client(f.addr).await;
    let mut rng = Rng(3);

    // Out of vocabulary.
    let err = c
        .prob(proto::ProbRequest {
            contexts: Some(rows(&[vec![1, 2]])),
            candidates: Some(rows(&[vec![5, VOCAB + 7]])),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains(&(VOCAB + 7).to_string()), "{err:?}");

    // Ragged rows that do not add up.
    let err = c
        .prob(proto::ProbRequest {
            contexts: Some(TokenRows {
                tokens: vec![1, 2, 3],
                lengths: vec![2, 2],
            }),
            candidates: Some(rows(&[vec![1], vec![2]])),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("contexts"), "{err:?}");

    // Row count mismatch.
    let err = c
        .prob(proto::ProbRequest {
            contexts: Some(rows(&[vec![1]])),
            candidates: Some(rows(&[vec![1], vec![2]])),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // Bad probability, bad shape, duplicate ids, missing draft, bad config.
    let mut d = random_draft(&mut rng, 4, 10);
    d.topk_probs[3] = 1.5;
    let err = c
        .prune(proto::PruneRequest {
            draft: Some(d),
            config: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("1.5"), "{err:?}");
    let mut d = random_draft(&mut rng, 4, 10);
    d.k = 11;
    let err = c
        .prune(proto::PruneRequest {
            draft: Some(d),
            config: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .prune(proto::PruneRequest {
            draft: None,
            config: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .prune(proto::PruneRequest {
            draft: Some(random_draft(&mut rng, 2, 3)),
            config: Some(proto::PrunerConfig {
                beam_width: Some(0),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("beam_width"), "{err:?}");
    // A bad draft inside a batch names its index.
    let mut drafts: Vec<proto::Draft> = (0..3).map(|_| random_draft(&mut rng, 3, 5)).collect();
    drafts[2].topk_ids[0] = VOCAB;
    let err = c
        .prune_batch(proto::PruneBatchRequest {
            drafts,
            config: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().starts_with("drafts[2]"), "{err:?}");

    // Oversized: 100k candidates is ~300 KB on the wire, above the 64 KiB limit.
    let big: Vec<u32> = (0..100_000).map(|i| i % VOCAB).collect();
    let err = c
        .prob(proto::ProbRequest {
            contexts: Some(rows(&[vec![1]])),
            candidates: Some(rows(&[big])),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("--max-request-bytes"), "{err:?}");

    // Still serving, on the same connection and on a new one.
    let ok = c
        .prob(proto::ProbRequest {
            contexts: Some(rows(&[vec![1, 2]])),
            candidates: Some(rows(&[vec![3]])),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.probs.len(), 1);
    let mut c2 = client(f.addr).await;
    c2.info(proto::InfoRequest {}).await.unwrap();

    // The metrics endpoint counted the errors by code.
    let text = http_get(f.metrics_addr, "/metrics").await;
    assert!(
        text.contains(
            "dart_ngram_errors_total{method=\"/dart.ngram.v1.NGramService/Prob\",code=\"RESOURCE_EXHAUSTED\"} 1"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "dart_ngram_errors_total{method=\"/dart.ngram.v1.NGramService/Prune\",code=\"INVALID_ARGUMENT\"} 4"
        ),
        "{text}"
    );
    assert!(text.contains("dart_ngram_request_duration_seconds_bucket{method=\"/dart.ngram.v1.NGramService/Prob\",le=\"+Inf\"}"));
    // The served model is in the page cache (it was just written and read): resident, and
    // never more than the file.
    let gauge = |name: &str| -> u64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in {text}"));
        line[name.len() + 1..].parse().unwrap()
    };
    let (resident, bytes) = (
        gauge("dart_ngram_model_resident_bytes"),
        gauge("dart_ngram_model_bytes"),
    );
    assert!(resident > 0 && resident <= bytes, "{resident} of {bytes}");
    stop(f).await;
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_serving_for_the_server_and_the_service() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let f = start(ServeOptions::default()).await;
    let channel = Channel::from_shared(format!("http://{}", f.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", dart_daemon::SERVICE_NAME] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, 1, "SERVING for {service:?}");
    }
    let err = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    stop(f).await;
}

/// Waits (bounded) until `cond` holds.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting until {what}");
}

fn limit_status(err: &tonic::Status, limit: &str) {
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains(limit), "{err:?} should name {limit}");
}

/// The abuse cases: a budget of 2^32 - 1 on a 64 x 256 draft (a 10^11-cell mask),
/// overrides of beam_width and max_nodes = 10^7, a TopK of 10^9 entries. Each is refused by
/// name and the daemon keeps answering correctly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_refused_by_their_limit() {
    let f = start(ServeOptions::default()).await;
    let mut c = client(f.addr).await;
    let mut rng = Rng(3);
    let mut big = random_draft(&mut rng, 64, 256);
    big.budget = Some(u32::MAX);
    let err = c
        .prune(proto::PruneRequest {
            draft: Some(big.clone()),
            config: None,
        })
        .await
        .unwrap_err();
    limit_status(&err, "max_nodes");
    assert!(err.message().contains("--max-nodes"), "{err:?}");
    for (o, limit) in [
        (
            proto::PrunerConfig {
                beam_width: Some(10_000_000),
                ..Default::default()
            },
            "max_beam_width",
        ),
        (
            proto::PrunerConfig {
                max_nodes: Some(10_000_000),
                ..Default::default()
            },
            "max_nodes",
        ),
    ] {
        let small = random_draft(&mut rng, 4, 8);
        let err = c
            .prune_batch(proto::PruneBatchRequest {
                drafts: vec![small.clone(); 4],
                config: Some(o),
            })
            .await
            .unwrap_err();
        limit_status(&err, limit);
        let err = c
            .prune(proto::PruneRequest {
                draft: Some(small),
                config: Some(o),
            })
            .await
            .unwrap_err();
        limit_status(&err, limit);
    }
    let levels = random_draft(&mut rng, 65, 4);
    let err = c
        .prune(proto::PruneRequest {
            draft: Some(levels),
            config: None,
        })
        .await
        .unwrap_err();
    limit_status(&err, "max_levels");
    // 2 rows x k = vocab is fine; 2^20 rows x 300 is beyond max_top_k_entries.
    let ok = c
        .top_k(proto::TopKRequest {
            contexts: Some(rows(&[vec![5], vec![6]])),
            k: VOCAB,
        })
        .await
        .unwrap();
    assert_eq!(ok.into_inner().lengths.len(), 2);
    let many = vec![vec![]; 1 << 20];
    let err = c
        .top_k(proto::TopKRequest {
            contexts: Some(rows(&many)),
            k: VOCAB,
        })
        .await
        .unwrap_err();
    limit_status(&err, "max_top_k_entries");
    // Correct requests still get the in-process answer.
    let pruner = Pruner::new(Arc::clone(&f.model), PrunerConfig::default()).unwrap();
    for _ in 0..20 {
        let d = random_draft(&mut rng, 6, 25);
        let local = pruner.prune(&local_request(&d)).unwrap();
        assert_eq!(remote_tree(&mut c, &d).await.tokens, {
            local.tokens.iter().map(|&t| t as u32).collect::<Vec<_>>()
        });
    }
    stop(f).await;
}

/// Lower limits from the options apply (the `--max-*` flags).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_limits_apply() {
    let limits = dart_daemon::service::ServiceLimits {
        pruner: dart_pruner::PrunerLimits {
            max_k: 8,
            ..Default::default()
        },
        ..Default::default()
    };
    let f = start(ServeOptions {
        limits,
        ..Default::default()
    })
    .await;
    let mut c = client(f.addr).await;
    let mut rng = Rng(4);
    let err = c
        .prune(proto::PruneRequest {
            draft: Some(random_draft(&mut rng, 2, 9)),
            config: None,
        })
        .await
        .unwrap_err();
    limit_status(&err, "max_k");
    remote_tree(&mut c, &random_draft(&mut rng, 2, 8)).await;
    stop(f).await;
}

/// A batch whose deadline passes is abandoned: the drafts not yet pruned are skipped and
/// counted (without the cancellation the whole batch runs to the end for nobody).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_its_deadline_is_abandoned() {
    let f = start(ServeOptions::default()).await;
    let mut c = client(f.addr).await;
    let mut rng = Rng(12);
    // ~35,000 scored paths per draft: seconds of work for the batch.
    let drafts: Vec<proto::Draft> = (0..1500).map(|_| random_draft(&mut rng, 8, 25)).collect();
    let mut req = tonic::Request::new(proto::PruneBatchRequest {
        drafts,
        config: Some(proto::PrunerConfig {
            beam_width: Some(200),
            ..Default::default()
        }),
    });
    req.set_timeout(Duration::from_millis(100));
    let err = c.prune_batch(req).await.unwrap_err();
    // tonic's server answers a passed deadline CANCELLED "Timeout expired".
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{err:?}"
    );
    let metrics = Arc::clone(&f.metrics);
    until("the batch is abandoned", || metrics.cancelled_work() > 0).await;
    assert!(metrics.cancelled_work() < 1500);
    assert!(http_get(f.metrics_addr, "/metrics")
        .await
        .contains("dart_ngram_cancelled_work_total "));
    // The daemon answers the next caller at once.
    remote_tree(&mut c, &random_draft(&mut rng, 4, 8)).await;
    stop(f).await;
}

/// Connections beyond --max-connections are closed at accept; connections that send nothing
/// are closed after the handshake timeout; the daemon keeps serving real clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_surplus_connections_are_closed() {
    use tokio::io::AsyncReadExt;
    let f = start(ServeOptions {
        max_connections: 3,
        timeouts: dart_daemon::linger::Timeouts {
            handshake: Duration::from_millis(300),
            idle: Duration::from_secs(300),
        },
        ..Default::default()
    })
    .await;
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(tokio::net::TcpStream::connect(f.addr).await.unwrap());
    }
    let metrics = Arc::clone(&f.metrics);
    until("3 connections are open", || metrics.connections_open() == 3).await;
    // The fourth is accepted and closed at once.
    let mut surplus = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), surplus.read(&mut buf))
        .await
        .expect("the surplus connection is closed")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert!(http_get(f.metrics_addr, "/metrics")
        .await
        .contains("dart_ngram_connections_refused_total 1"));
    // The silent ones are closed after the handshake timeout (the server's preface, then EOF).
    for s in &mut silent {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
            .await
            .expect("a silent connection is closed")
            .ok();
    }
    until("the silent connections are gone", || {
        metrics.connections_open() == 0
    })
    .await;
    assert_eq!(metrics.connections_timed_out(), 3);
    let mut c = client(f.addr).await;
    remote_tree(&mut c, &random_draft(&mut Rng(9), 4, 8)).await;
    stop(f).await;
}

/// A reload serves the new model; one that changes the order (or vocabulary, tokenizer, EOS)
/// is refused and the old model stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_swaps_a_compatible_model_and_refuses_another() {
    let f = start(ServeOptions::default()).await;
    let mut c = client(f.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let ask = || proto::ProbRequest {
        contexts: Some(rows(&[vec![5, 6], vec![7]])),
        candidates: Some(rows(&[(0..VOCAB).collect(), (0..VOCAB).collect()])),
    };
    let before = c.prob(ask()).await.unwrap().into_inner().probs;

    let other_order = dir.path().join("order2.ngram");
    write_model_with(&other_order, 2, 0x9E37_79B9_7F4A_7C15);
    let err = f
        .server
        .reload(Arc::new(NGramModel::open(&other_order).unwrap()))
        .unwrap_err();
    assert!(err.contains("order 3 -> 2"), "{err}");
    assert_eq!(c.prob(ask()).await.unwrap().into_inner().probs, before);

    let other_corpus = dir.path().join("other.ngram");
    write_model_with(&other_corpus, 3, 77);
    let new_model = Arc::new(NGramModel::open(&other_corpus).unwrap());
    f.server.reload(Arc::clone(&new_model)).unwrap();
    let after = c.prob(ask()).await.unwrap().into_inner().probs;
    assert_ne!(after, before);
    let mut expected = vec![0f32; VOCAB as usize];
    let mut matched = vec![0u8; VOCAB as usize];
    let all: Vec<u32> = (0..VOCAB).collect();
    new_model
        .prob_many(&[5, 6], &all, &mut expected, &mut matched)
        .unwrap();
    assert_eq!(after[..VOCAB as usize], expected[..]);
    stop(f).await;
}

/// The drain, without timing: the request is held in flight by its client (headers sent,
/// message not yet), the daemon is told to stop, and only once it is observed draining
/// (health NOT_SERVING, new connections refused, new requests UNAVAILABLE) does the client
/// send the message. The drained request's tree must equal the in-process one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_finishes_a_request_in_flight_and_refuses_newcomers() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let mut f = start(ServeOptions::default()).await;
    let channel = Channel::from_shared(format!("http://{}", f.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    let mut other = NGramServiceClient::new(channel.clone());
    let (tx, rx) = tokio::sync::mpsc::channel::<proto::PruneRequest>(1);
    let mut grpc = tonic::client::Grpc::new(channel);
    let held = tokio::spawn(async move {
        grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static("/dart.ngram.v1.NGramService/Prune");
        grpc.client_streaming::<_, proto::PruneRequest, proto::PruneResponse, _>(
            tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            path,
            tonic_prost::ProstCodec::default(),
        )
        .await
    });
    let metrics = Arc::clone(&f.metrics);
    until("the held request is in flight", || metrics.in_flight() == 1).await;

    f.stop.take().unwrap().send(()).unwrap();
    let addr = f.addr;
    for _ in 0..2000 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "new connections are still accepted while draining"
    );
    let status = health
        .check(HealthCheckRequest {
            service: dart_daemon::SERVICE_NAME.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(status, 2, "NOT_SERVING while draining");
    let mut rng = Rng(21);
    let err = other
        .prune(proto::PruneRequest {
            draft: Some(random_draft(&mut rng, 4, 8)),
            config: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(
        metrics.in_flight(),
        1,
        "the held request is still in flight"
    );

    let d = random_draft(&mut rng, 8, 25);
    tx.send(proto::PruneRequest {
        draft: Some(d.clone()),
        config: None,
    })
    .await
    .unwrap();
    drop(tx);
    let tree = held
        .await
        .unwrap()
        .expect("the request in flight is answered")
        .into_inner()
        .tree
        .unwrap();
    let pruner = Pruner::new(Arc::clone(&f.model), PrunerConfig::default()).unwrap();
    let local = pruner.prune(&local_request(&d)).unwrap();
    assert_eq!(
        tree.tokens,
        local.tokens.iter().map(|&t| t as u32).collect::<Vec<_>>()
    );
    assert_eq!(tree.scores, local.scores);
    assert_eq!(
        tree.parents,
        local.parents.iter().map(|&p| p as i32).collect::<Vec<_>>()
    );
    tokio::time::timeout(Duration::from_secs(30), f.served)
        .await
        .expect("the daemon stops after the drain")
        .unwrap()
        .unwrap();
}

/// A model file written over in place while served (not replaced by a rename) is refused with
/// DATA_LOSS naming it, never read half old, half new; a reload of the file serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_rewritten_in_place_is_refused_until_reloaded() {
    let f = start(ServeOptions::default()).await;
    let mut c = client(f.addr).await;
    let ask = || proto::ProbRequest {
        contexts: Some(rows(&[vec![5, 6]])),
        candidates: Some(rows(&[(0..VOCAB).collect()])),
    };
    let before = c.prob(ask()).await.unwrap().into_inner().probs;
    let path = f.dir.path().join("test.ngram");
    {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        file.write_all(b"junk appended in place").unwrap();
    }
    let err = c.prob(ask()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");
    assert!(
        err.message().contains("modified in place"),
        "{}",
        err.message()
    );
    // The same file, made whole again and reopened (what SIGHUP does), serves as before.
    write_test_model(&path);
    f.server
        .reload(Arc::new(NGramModel::open(&path).unwrap()))
        .unwrap();
    assert_eq!(c.prob(ask()).await.unwrap().into_inner().probs, before);
    stop(f).await;
}
