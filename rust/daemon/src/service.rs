//! The `dart.ngram.v1.NGramService` handlers: decode, validate, call the model or the pruner,
//! encode. Validation errors name the field, the value and what was expected.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use dart_ngram::NGramModel;
use dart_pruner::{DraftRequest, DraftTree, Pruner, PrunerConfig, PrunerError, PrunerLimits};
use rayon::prelude::*;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::{Request, Response, Status};

use crate::error::{ngram_status, pruner_status};
use crate::metrics::Metrics;
use crate::proto;
use crate::proto::n_gram_service_server::NGramService;

/// Rows above which a batched query is spread over the rayon pool instead of being answered
/// on the tokio worker that received it.
const PARALLEL_ROWS: usize = 64;

/// What one request may ask of the daemon (the `--max-*` flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceLimits {
    /// Requests handled at once (more: RESOURCE_EXHAUSTED).
    pub max_concurrent: usize,
    /// Shape, budget and configuration bounds of a prune (more: RESOURCE_EXHAUSTED).
    pub pruner: PrunerLimits,
    /// `rows x k` of one TopK request (more: RESOURCE_EXHAUSTED).
    pub max_top_k_entries: usize,
}

impl Default for ServiceLimits {
    fn default() -> Self {
        ServiceLimits {
            max_concurrent: 256,
            pruner: PrunerLimits::default(),
            max_top_k_entries: 1 << 22,
        }
    }
}

/// The model being served and the default pruner over it; replaced whole on a reload.
struct Served {
    model: Arc<NGramModel>,
    pruner: Pruner<Arc<NGramModel>>,
    info_json: String,
}

impl Served {
    fn new(
        model: Arc<NGramModel>,
        config: PrunerConfig,
        limits: PrunerLimits,
    ) -> crate::error::Result<Self> {
        let pruner = Pruner::with_limits(Arc::clone(&model), config, limits)?;
        let info_json = serde_json::to_string(&model.info())
            .map_err(|e| crate::error::DaemonError::Config(format!("model info as JSON: {e}")))?;
        Ok(Served {
            model,
            pruner,
            info_json,
        })
    }
}

/// The service state shared by every connection.
pub struct NGramServer {
    served: RwLock<Arc<Served>>,
    limiter: Arc<Semaphore>,
    limits: ServiceLimits,
    metrics: Arc<Metrics>,
}

/// A prune request's scored paths above which the daemon hands freed scratch back to the
/// operating system after the request (glibc keeps freed heap memory otherwise).
const TRIM_ABOVE_PATHS: usize = 1 << 16;

impl NGramServer {
    /// A server for `model`; `default_config` is what requests without overrides get.
    pub fn new(
        model: Arc<NGramModel>,
        default_config: PrunerConfig,
        limits: ServiceLimits,
        metrics: Arc<Metrics>,
    ) -> crate::error::Result<Self> {
        let limits = ServiceLimits {
            max_concurrent: limits.max_concurrent.max(1),
            ..limits
        };
        Ok(NGramServer {
            served: RwLock::new(Arc::new(Served::new(model, default_config, limits.pruner)?)),
            limiter: Arc::new(Semaphore::new(limits.max_concurrent)),
            limits,
            metrics,
        })
    }

    fn served(&self) -> Arc<Served> {
        Arc::clone(&self.served.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The model served now.
    pub fn model(&self) -> Arc<NGramModel> {
        Arc::clone(&self.served().model)
    }

    /// Serves `model` from now on (requests already running finish on the old one). Refused,
    /// with the old model kept, when the new one would change what clients were told at
    /// connect time: its order, vocabulary size, tokenizer fingerprint or EOS id.
    pub fn reload(&self, model: Arc<NGramModel>) -> Result<(), String> {
        let old = self.served();
        let (a, b) = (&old.model, &model);
        let mut changed = Vec::new();
        if a.order() != b.order() {
            changed.push(format!("order {} -> {}", a.order(), b.order()));
        }
        if a.vocab_size() != b.vocab_size() {
            changed.push(format!(
                "vocab_size {} -> {}",
                a.vocab_size(),
                b.vocab_size()
            ));
        }
        if a.tokenizer_fingerprint() != b.tokenizer_fingerprint() {
            changed.push("tokenizer fingerprint".to_string());
        }
        if a.eos_id() != b.eos_id() {
            changed.push(format!("eos_id {:?} -> {:?}", a.eos_id(), b.eos_id()));
        }
        if !changed.is_empty() {
            return Err(format!(
                "the new model changes {}; clients checked these when they connected, so \
                 restart the daemon (and its clients) to serve it",
                changed.join(", ")
            ));
        }
        let served = Served::new(model, old.pruner.config().clone(), *old.pruner.limits())
            .map_err(|e| e.to_string())?;
        *self.served.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(served);
        Ok(())
    }

    /// A slot among `--max-concurrent`, or RESOURCE_EXHAUSTED right away: a caller that waits
    /// on a saturated daemon only adds latency, better it retries with backoff or elsewhere.
    fn admit(&self) -> Result<OwnedSemaphorePermit, Status> {
        // A mapped file written over in place would be read half old, half new (or SIGBUS
        // once truncated): refuse with DATA_LOSS naming it; SIGHUP reopens it. One fstat.
        self.served()
            .model
            .check_unchanged()
            .map_err(|e| ngram_status(&e))?;
        Arc::clone(&self.limiter).try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "daemon overloaded: {} requests already in flight (--max-concurrent {}); retry \
                 with backoff",
                self.limits.max_concurrent, self.limits.max_concurrent
            ))
        })
    }

    /// The pruner for a request: the default one, or one with the request's overrides
    /// (checked against the limits before it is made).
    fn pruner_for(
        served: &Served,
        overrides: Option<&proto::PrunerConfig>,
    ) -> Result<Option<Pruner<Arc<NGramModel>>>, Status> {
        let Some(o) = overrides else {
            return Ok(None);
        };
        let base = served.pruner.config();
        let config = merge_config(base, o);
        if &config == base {
            return Ok(None);
        }
        Pruner::with_limits(Arc::clone(&served.model), config, *served.pruner.limits())
            .map(Some)
            .map_err(|e| pruner_status(&e))
    }
}

/// Sets its flag when dropped unless disarmed: the handler future of a request whose client
/// went away (or whose deadline passed) is dropped, and the work on the pool sees the flag.
struct CancelOnDrop(Option<Arc<AtomicBool>>);

impl CancelOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(flag) = self.0.take() {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

/// Returns freed heap memory to the operating system (after a large request). At most once a
/// second: a trim walks every allocator arena and can take a while on a big heap.
fn release_memory() {
    use std::sync::atomic::AtomicU64;
    use std::time::{SystemTime, UNIX_EPOCH};
    static LAST_SEC: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST_SEC.swap(now, Ordering::Relaxed) == now {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The default configuration with a request's overrides applied.
pub fn merge_config(base: &PrunerConfig, o: &proto::PrunerConfig) -> PrunerConfig {
    let mut c = base.clone();
    if let Some(v) = o.top_k {
        c.top_k = v as usize;
    }
    if let Some(v) = o.beam_width {
        c.beam_width = v as usize;
    }
    if let Some(v) = o.max_nodes {
        c.max_nodes = v as usize;
    }
    if let Some(v) = o.level_exponent {
        c.level_exponent = v;
    }
    if let Some(v) = o.logit_decay {
        c.logit_decay = v;
    }
    if let Some(v) = o.ngram_weight {
        c.ngram_weight = v;
    }
    if let Some(v) = o.ngram_at_level0 {
        c.ngram_at_level0 = v;
    }
    if let Some(v) = o.eos_id {
        c.eos_id = Some(v);
    }
    if let Some(v) = o.eps {
        c.eps = v;
    }
    c
}

/// Splits ragged rows into slices, checking the lengths against the flat tokens.
pub fn split_rows<'a>(rows: &'a proto::TokenRows, field: &str) -> Result<Vec<&'a [u32]>, Status> {
    let mut out = Vec::with_capacity(rows.lengths.len());
    let mut at = 0usize;
    for (i, &len) in rows.lengths.iter().enumerate() {
        let end = at
            .checked_add(len as usize)
            .filter(|&e| e <= rows.tokens.len());
        let Some(end) = end else {
            let total: u64 = rows.lengths.iter().map(|&l| u64::from(l)).sum();
            return Err(Status::invalid_argument(format!(
                "{field}: lengths add up to {total} (row {i} ends past the end) but tokens holds \
                 {}; expected sum(lengths) == len(tokens)",
                rows.tokens.len()
            )));
        };
        out.push(&rows.tokens[at..end]);
        at = end;
    }
    if at != rows.tokens.len() {
        return Err(Status::invalid_argument(format!(
            "{field}: lengths add up to {at} but tokens holds {}; expected sum(lengths) == \
             len(tokens)",
            rows.tokens.len()
        )));
    }
    Ok(out)
}

fn rows_of<'a>(rows: &'a Option<proto::TokenRows>, field: &str) -> Result<Vec<&'a [u32]>, Status> {
    match rows {
        Some(r) => split_rows(r, field),
        None => Ok(Vec::new()),
    }
}

/// Runs `work` on the rayon pool without blocking the tokio worker.
async fn on_pool<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    rayon::spawn(move || {
        let _ = tx.send(work());
    });
    rx.await
        .map_err(|_| Status::internal("a worker thread died while answering the request"))
}

/// The wire form of a draft tree.
pub fn tree_to_proto(tree: &DraftTree) -> proto::DraftTree {
    proto::DraftTree {
        tokens: tree.tokens.iter().map(|&t| t as u32).collect(),
        parents: tree.parents.iter().map(|&p| p as i32).collect(),
        depths: tree.depths.iter().map(|&d| d as u32).collect(),
        attention_mask: tree.attention_mask.iter().map(|&b| u8::from(b)).collect(),
        retrieve_indices: tree.retrieve_indices.iter().map(|&i| i as i32).collect(),
        retrieve_rows: tree.num_leaves() as u32,
        retrieve_cols: tree.retrieve_width() as u32,
        scores: tree.scores.clone(),
    }
}

/// The paths a prune of `d` scores (saturating; 0 for a shape the pruner refuses anyway).
fn scored_paths(pruner: &Pruner<Arc<NGramModel>>, d: &proto::Draft) -> usize {
    dart_pruner::limits::scored_paths(d.levels as usize, d.k as usize, pruner.config().beam_width)
}

fn draft_request(d: &proto::Draft) -> DraftRequest<'_> {
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

fn prob_rows(
    model: &NGramModel,
    contexts: &[&[u32]],
    candidates: &[&[u32]],
    probs: &mut [f32],
    matched: &mut [u8],
) -> Result<(), Status> {
    let mut at = 0;
    for (row, (ctx, cands)) in contexts.iter().zip(candidates).enumerate() {
        let end = at + cands.len();
        model
            .prob_many(ctx, cands, &mut probs[at..end], &mut matched[at..end])
            .map_err(|e| row_status(row, ngram_status(&e)))?;
        at = end;
    }
    Ok(())
}

/// Prefixes a status message with the row it concerns.
fn row_status(row: usize, status: Status) -> Status {
    Status::new(status.code(), format!("row {row}: {}", status.message()))
}

#[tonic::async_trait]
impl NGramService for Arc<NGramServer> {
    async fn info(
        &self,
        _request: Request<proto::InfoRequest>,
    ) -> Result<Response<proto::InfoResponse>, Status> {
        let served = self.served();
        let m = &served.model;
        Ok(Response::new(proto::InfoResponse {
            order: m.order() as u32,
            vocab_size: m.vocab_size(),
            tokenizer_fingerprint: m.tokenizer_fingerprint().to_vec(),
            eos_id: m.eos_id(),
            total_tokens: m.total_tokens(),
            info_json: served.info_json.clone(),
            server_version: env!("CARGO_PKG_VERSION").to_string(),
        }))
    }

    async fn prob(
        &self,
        request: Request<proto::ProbRequest>,
    ) -> Result<Response<proto::ProbResponse>, Status> {
        let _permit = self.admit()?;
        let req = request.into_inner();
        let contexts = rows_of(&req.contexts, "contexts")?;
        let candidates = rows_of(&req.candidates, "candidates")?;
        if contexts.len() != candidates.len() {
            return Err(Status::invalid_argument(format!(
                "contexts has {} rows but candidates has {}; expected one candidate row per \
                 context",
                contexts.len(),
                candidates.len()
            )));
        }
        let total = candidates.iter().map(|c| c.len()).sum::<usize>();
        if contexts.len() <= PARALLEL_ROWS {
            let mut probs = vec![0f32; total];
            let mut matched = vec![0u8; total];
            prob_rows(
                &self.model(),
                &contexts,
                &candidates,
                &mut probs,
                &mut matched,
            )?;
            return Ok(Response::new(proto::ProbResponse { probs, matched }));
        }
        drop((contexts, candidates));
        let model = self.model();
        let out = on_pool(move || {
            let contexts = rows_of(&req.contexts, "contexts")?;
            let candidates = rows_of(&req.candidates, "candidates")?;
            let results: Vec<Result<(Vec<f32>, Vec<u8>), Status>> = contexts
                .par_iter()
                .zip(candidates.par_iter())
                .enumerate()
                .map(|(row, (ctx, cands))| {
                    let mut p = vec![0f32; cands.len()];
                    let mut m = vec![0u8; cands.len()];
                    model
                        .prob_many(ctx, cands, &mut p, &mut m)
                        .map_err(|e| row_status(row, ngram_status(&e)))?;
                    Ok((p, m))
                })
                .collect();
            let mut probs = Vec::with_capacity(total);
            let mut matched = Vec::with_capacity(total);
            for r in results {
                let (p, m) = r?;
                probs.extend_from_slice(&p);
                matched.extend_from_slice(&m);
            }
            Ok::<_, Status>(proto::ProbResponse { probs, matched })
        })
        .await??;
        Ok(Response::new(out))
    }

    async fn count(
        &self,
        request: Request<proto::CountRequest>,
    ) -> Result<Response<proto::CountResponse>, Status> {
        let _permit = self.admit()?;
        let req = request.into_inner();
        let seqs = rows_of(&req.sequences, "sequences")?;
        let model = self.model();
        let counts = seqs
            .iter()
            .enumerate()
            .map(|(row, s)| {
                model
                    .count(s)
                    .map_err(|e| row_status(row, ngram_status(&e)))
            })
            .collect::<Result<Vec<u64>, Status>>()?;
        Ok(Response::new(proto::CountResponse { counts }))
    }

    async fn top_k(
        &self,
        request: Request<proto::TopKRequest>,
    ) -> Result<Response<proto::TopKResponse>, Status> {
        let _permit = self.admit()?;
        let req = request.into_inner();
        let k = req.k as usize;
        let model = self.model();
        let vocab = model.vocab_size() as usize;
        if k > vocab {
            return Err(Status::invalid_argument(format!(
                "k = {k} exceeds the vocabulary size {vocab}; expected 0 < k <= {vocab}"
            )));
        }
        // Before any answer is allocated: rows x k entries at most.
        let n_rows = req.contexts.as_ref().map_or(0, |r| r.lengths.len());
        let entries = n_rows.saturating_mul(k);
        let max_entries = self.limits.max_top_k_entries;
        if entries > max_entries {
            return Err(Status::resource_exhausted(format!(
                "rows x k = {n_rows} x {k} = {entries} entries exceeds the limit \
                 max_top_k_entries = {max_entries} (the daemon's --max-top-k-entries); split \
                 the batch or ask for a smaller k"
            )));
        }
        let answer = move |rows: &[&[u32]]| -> Result<proto::TopKResponse, Status> {
            let results: Vec<Result<Vec<(u32, f32)>, Status>> = if rows.len() <= PARALLEL_ROWS {
                rows.iter()
                    .enumerate()
                    .map(|(row, ctx)| {
                        model
                            .top_k(ctx, k)
                            .map_err(|e| row_status(row, ngram_status(&e)))
                    })
                    .collect()
            } else {
                rows.par_iter()
                    .enumerate()
                    .map(|(row, ctx)| {
                        model
                            .top_k(ctx, k)
                            .map_err(|e| row_status(row, ngram_status(&e)))
                    })
                    .collect()
            };
            let mut out = proto::TopKResponse::default();
            for r in results {
                let r = r?;
                out.lengths.push(r.len() as u32);
                for (id, p) in r {
                    out.ids.push(id);
                    out.probs.push(p);
                }
            }
            Ok(out)
        };
        let rows = rows_of(&req.contexts, "contexts")?;
        if rows.len() <= PARALLEL_ROWS {
            return Ok(Response::new(answer(&rows)?));
        }
        drop(rows);
        let out = on_pool(move || answer(&rows_of(&req.contexts, "contexts")?)).await??;
        Ok(Response::new(out))
    }

    async fn prune(
        &self,
        request: Request<proto::PruneRequest>,
    ) -> Result<Response<proto::PruneResponse>, Status> {
        let _permit = self.admit()?;
        let req = request.into_inner();
        let Some(draft) = req.draft.as_ref() else {
            return Err(Status::invalid_argument(
                "draft is missing; expected a Draft with context, topk_ids, topk_probs, levels, k",
            ));
        };
        let served = self.served();
        let custom = NGramServer::pruner_for(&served, req.config.as_ref())?;
        let pruner = custom.as_ref().unwrap_or(&served.pruner);
        // One prune takes a fraction of a millisecond: answering on this worker is faster than
        // any hop to another thread.
        let tree = pruner
            .prune(&draft_request(draft))
            .map_err(|e| pruner_status(&e))?;
        if scored_paths(pruner, draft) > TRIM_ABOVE_PATHS {
            release_memory();
        }
        Ok(Response::new(proto::PruneResponse {
            tree: Some(tree_to_proto(&tree)),
        }))
    }

    async fn prune_batch(
        &self,
        request: Request<proto::PruneBatchRequest>,
    ) -> Result<Response<proto::PruneBatchResponse>, Status> {
        let _permit = self.admit()?;
        let req = request.into_inner();
        let served = self.served();
        let pruner = NGramServer::pruner_for(&served, req.config.as_ref())?
            .unwrap_or_else(|| served.pruner.clone());
        drop(served);
        let cancelled = Arc::new(AtomicBool::new(false));
        let cancel_on_drop = CancelOnDrop(Some(Arc::clone(&cancelled)));
        let metrics = Arc::clone(&self.metrics);
        let work = move || {
            let reqs: Vec<DraftRequest<'_>> = req.drafts.iter().map(draft_request).collect();
            let trees = pruner.prune_batch_until(&reqs, &cancelled);
            let skipped = trees
                .iter()
                .filter(|t| matches!(t, Err(PrunerError::Cancelled)))
                .count();
            if skipped > 0 {
                metrics.add_cancelled_work(skipped as u64);
                tracing::info!(
                    drafts = reqs.len(),
                    skipped,
                    "client gone or deadline passed: batch abandoned"
                );
            }
            let large = req
                .drafts
                .iter()
                .zip(&trees)
                .any(|(d, t)| t.is_ok() && scored_paths(&pruner, d) > TRIM_ABOVE_PATHS);
            if large {
                release_memory();
            }
            trees
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    t.map(|t| tree_to_proto(&t)).map_err(|e| {
                        let s = pruner_status(&e);
                        Status::new(s.code(), format!("drafts[{i}]: {}", s.message()))
                    })
                })
                .collect::<Result<Vec<_>, Status>>()
        };
        let trees = on_pool(work).await;
        cancel_on_drop.disarm();
        Ok(Response::new(proto::PruneBatchResponse { trees: trees?? }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dart_ngram::{key, write_model, CountStream, ModelMeta, WriteOptions};

    fn tiny_model(dir: &std::path::Path) -> Arc<NGramModel> {
        // Corpus "1 2 3 EOS" twice: every 2- and 3-gram seen twice.
        let path = dir.join("tiny.ngram");
        let bits = key::token_bits(8);
        let doc = [1u32, 2, 3, 0];
        let mut uni = vec![0u64; 8];
        for &t in &doc {
            uni[t as usize] += 2;
        }
        let streams: Vec<CountStream<'static>> = (2..=3)
            .map(|n| {
                let mut v: Vec<(u64, u64)> =
                    doc.windows(n).map(|g| (key::pack(g, bits), 2)).collect();
                v.sort_unstable();
                Box::new(v.into_iter().map(Ok)) as CountStream<'static>
            })
            .collect();
        let meta = ModelMeta {
            order: 3,
            vocab_size: 8,
            tokenizer_fingerprint: [1; 32],
            eos_id: Some(0),
            min_count: 1,
            total_tokens: 8,
            documents: 2,
            source: "test".into(),
        };
        write_model(&path, &meta, &uni, streams, &WriteOptions::default()).unwrap();
        Arc::new(NGramModel::open(&path).unwrap())
    }

    #[tokio::test]
    async fn a_saturated_daemon_answers_resource_exhausted_then_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let limits = ServiceLimits {
            max_concurrent: 1,
            ..Default::default()
        };
        let server = Arc::new(
            NGramServer::new(
                tiny_model(dir.path()),
                PrunerConfig::default(),
                limits,
                Arc::new(Metrics::new()),
            )
            .unwrap(),
        );
        let req = || {
            Request::new(proto::ProbRequest {
                contexts: Some(proto::TokenRows {
                    tokens: vec![1, 2],
                    lengths: vec![2],
                }),
                candidates: Some(proto::TokenRows {
                    tokens: vec![3, 4],
                    lengths: vec![2],
                }),
            })
        };
        let held = server.admit().unwrap();
        let err = server.prob(req()).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("--max-concurrent 1"), "{err:?}");
        drop(held);
        let ok = server.prob(req()).await.unwrap().into_inner();
        assert_eq!(ok.probs, vec![1.0, 0.0]);
        assert_eq!(ok.matched, vec![2, 0]);
    }

    #[test]
    fn overrides_change_only_the_fields_they_name() {
        let base = PrunerConfig::default();
        let merged = merge_config(
            &base,
            &proto::PrunerConfig {
                max_nodes: Some(9),
                eos_id: Some(5),
                ..Default::default()
            },
        );
        assert_eq!(merged.max_nodes, 9);
        assert_eq!(merged.eos_id, Some(5));
        assert_eq!(
            PrunerConfig {
                max_nodes: base.max_nodes,
                eos_id: base.eos_id,
                ..merged
            },
            base
        );
        assert_eq!(merge_config(&base, &proto::PrunerConfig::default()), base);
    }

    #[test]
    fn ragged_rows_are_checked_against_the_flat_tokens() {
        let rows = proto::TokenRows {
            tokens: vec![1, 2, 3],
            lengths: vec![1, 0, 2],
        };
        let split = split_rows(&rows, "x").unwrap();
        assert_eq!(split, vec![&[1u32][..], &[][..], &[2, 3][..]]);
        for lengths in [vec![1, 1], vec![4], vec![u32::MAX, u32::MAX]] {
            let bad = proto::TokenRows {
                tokens: vec![1, 2, 3],
                lengths,
            };
            let err = split_rows(&bad, "contexts").unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
            assert!(err.message().starts_with("contexts: "), "{err:?}");
        }
    }

    /// Fuzzing the request decoding: whatever bytes arrive as a request body, decoding either
    /// fails or yields a message every handler answers with a response or a status, never a
    /// panic, and within the limits (a bounded amount of work).
    mod fuzz {
        use super::*;
        use proptest::prelude::*;
        use prost::Message;

        fn server() -> (tempfile::TempDir, Arc<NGramServer>) {
            let dir = tempfile::tempdir().unwrap();
            let model = tiny_model(dir.path());
            let server = NGramServer::new(
                model,
                PrunerConfig::default(),
                ServiceLimits::default(),
                Arc::new(Metrics::new()),
            )
            .unwrap();
            (dir, Arc::new(server))
        }

        /// Runs every handler whose request type `bytes` decode as.
        fn answer_all(server: &Arc<NGramServer>, bytes: &[u8]) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(m) = proto::ProbRequest::decode(bytes) {
                    let _ = server.prob(Request::new(m)).await;
                }
                if let Ok(m) = proto::CountRequest::decode(bytes) {
                    let _ = server.count(Request::new(m)).await;
                }
                if let Ok(m) = proto::TopKRequest::decode(bytes) {
                    let _ = server.top_k(Request::new(m)).await;
                }
                if let Ok(m) = proto::PruneRequest::decode(bytes) {
                    let _ = server.prune(Request::new(m)).await;
                }
                if let Ok(m) = proto::PruneBatchRequest::decode(bytes) {
                    let _ = server.prune_batch(Request::new(m)).await;
                }
            });
        }

        fn draft() -> impl Strategy<Value = proto::Draft> {
            (
                prop::collection::vec(0u32..12, 0..6),
                prop::collection::vec(0u32..12, 0..40),
                prop::collection::vec(-0.5f32..1.5, 0..40),
                prop_oneof![0u32..8, any::<u32>()],
                prop_oneof![0u32..8, any::<u32>()],
                prop::option::of(prop_oneof![0u32..8, any::<u32>()]),
                prop::collection::vec(0u32..12, 0..10),
            )
                .prop_map(
                    |(context, topk_ids, topk_probs, levels, k, budget, lookup_path)| {
                        proto::Draft {
                            context,
                            topk_ids,
                            topk_probs,
                            levels,
                            k,
                            budget,
                            lookup_path,
                        }
                    },
                )
        }

        fn overrides() -> impl Strategy<Value = Option<proto::PrunerConfig>> {
            prop::option::of(
                (
                    prop::option::of(any::<u32>()),
                    prop::option::of(any::<u32>()),
                    prop::option::of(any::<u32>()),
                    prop::option::of(any::<f64>()),
                    prop::option::of(any::<u32>()),
                )
                    .prop_map(
                        |(top_k, beam_width, max_nodes, logit_decay, eos_id)| proto::PrunerConfig {
                            top_k,
                            beam_width,
                            max_nodes,
                            logit_decay,
                            eos_id,
                            ..Default::default()
                        },
                    ),
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
                let (_dir, server) = server();
                answer_all(&server, &bytes);
            }

            /// Valid messages with hostile fields, then the same bytes cut or with a byte
            /// flipped (wire-level damage inside an otherwise plausible request).
            #[test]
            fn hostile_requests_never_panic(
                drafts in prop::collection::vec(draft(), 0..4),
                config in overrides(),
                cut in any::<prop::sample::Index>(),
                flip in any::<prop::sample::Index>(),
                bit in 0u8..8,
            ) {
                let (_dir, server) = server();
                let single = proto::PruneRequest {
                    draft: drafts.first().cloned(),
                    config,
                }
                .encode_to_vec();
                let batch = proto::PruneBatchRequest { drafts, config }.encode_to_vec();
                for bytes in [single, batch] {
                    answer_all(&server, &bytes);
                    if !bytes.is_empty() {
                        answer_all(&server, &bytes[..cut.index(bytes.len())]);
                        let mut flipped = bytes.clone();
                        flipped[flip.index(bytes.len())] ^= 1 << bit;
                        answer_all(&server, &flipped);
                    }
                }
            }
        }
    }
}
