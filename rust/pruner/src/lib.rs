//! DART's draft-tree pruner: an n-gram-guided beam search over the draft head's top-k rows.
//!
//! Given the context (its last token is the root, the token just sampled) and, for each of
//! `L` levels, the draft's top-`k` token ids and probabilities, [`Pruner::prune`] extends every
//! beam path by every candidate of the next level, scores it (see [`PrunerConfig`]), keeps the
//! best `beam_width` paths of each level (paths ending in EOS last) for the next level, and
//! finally keeps the best `max_nodes` of all scored paths as a [`DraftTree`]. A request may
//! also carry a lookup path (a continuation proposed from the context itself, e.g. by
//! [`PromptLookup`]): the tree then holds that path and as many of the beam's best nodes as
//! the budget leaves room for.
//!
//! Guarantees: the same input gives the same tree (every ranking is a total order: score
//! descending, then depth ascending, then the path's token ids ascending); the tree is
//! prefix-closed (a node's score never exceeds its parent's: the only positive score term,
//! `ln(1 + eps)` at `p == 1`, is clamped to 0); it never holds more than the budget; siblings
//! are distinct tokens; bad input is an error, never a panic or a wrong tree.

mod beam;
pub mod config;
pub mod error;
pub mod limits;
pub mod lookup;
pub mod rows;
pub mod scorer;
mod shared;
pub mod tree;
pub mod workload;

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

pub use config::PrunerConfig;
pub use error::{PrunerError, Result};
pub use limits::PrunerLimits;
pub use lookup::PromptLookup;
pub use rows::{top_k_rows, Logit, TopKRows};
pub use scorer::NGramScorer;
pub use tree::DraftTree;

/// One pruning request. `topk_ids` and `topk_probs` are `levels x k`, row-major; row `l`
/// holds the candidates for the token `l + 1` positions after the root.
#[derive(Clone, Copy, Debug, Default)]
pub struct DraftRequest<'a> {
    /// Token ids so far; its last token is the root. Only the last `order - 1` tokens (and the
    /// root) are read.
    pub context: &'a [u32],
    pub topk_ids: &'a [u32],
    /// Probabilities of `topk_ids`, in [0, 1] (softmaxed over the top-k).
    pub topk_probs: &'a [f32],
    pub levels: usize,
    pub k: usize,
    /// Nodes to keep (the root not counted) instead of the configured `max_nodes`.
    pub budget: Option<usize>,
    /// Tokens after the root that the tree must hold as one path (empty: none), whatever
    /// the beam thinks of them; it may be deeper than `levels`. Its nodes count against the
    /// budget (those the beam kept anyway count once), the beam's best nodes fill the rest,
    /// and a path longer than the budget is cut to it. New nodes score `-inf`.
    pub lookup_path: &'a [u32],
}

/// A [`DraftRequest`] that owns its inputs: what [`Pruner::prune_shared`] hands to threads
/// that may outlive the caller's borrows.
#[derive(Clone, Debug, Default)]
pub struct OwnedRequest {
    pub context: Vec<u32>,
    pub topk_ids: Vec<u32>,
    pub topk_probs: Vec<f32>,
    pub levels: usize,
    pub k: usize,
    pub budget: Option<usize>,
    pub lookup_path: Vec<u32>,
}

impl OwnedRequest {
    pub fn request(&self) -> DraftRequest<'_> {
        DraftRequest {
            context: &self.context,
            topk_ids: &self.topk_ids,
            topk_probs: &self.topk_probs,
            levels: self.levels,
            k: self.k,
            budget: self.budget,
            lookup_path: &self.lookup_path,
        }
    }
}

/// The pruner: a scorer (an n-gram model, possibly behind an `Arc`) and a configuration.
#[derive(Clone, Debug)]
pub struct Pruner<S> {
    scorer: S,
    config: PrunerConfig,
    limits: PrunerLimits,
    eos: Option<u32>,
}

impl<S: NGramScorer> Pruner<S> {
    /// A pruner with the default [`PrunerLimits`].
    pub fn new(scorer: S, config: PrunerConfig) -> Result<Self> {
        Self::with_limits(scorer, config, PrunerLimits::default())
    }

    /// A pruner that refuses configurations and requests beyond `limits`.
    pub fn with_limits(scorer: S, config: PrunerConfig, limits: PrunerLimits) -> Result<Self> {
        config.validate()?;
        limits.validate()?;
        limits.check_config(config.beam_width, config.max_nodes)?;
        let vocab_size = scorer.vocab_size();
        if let Some(eos) = config.eos_id {
            if eos >= vocab_size {
                return Err(PrunerError::TokenOutOfVocab {
                    what: "eos_id".into(),
                    token: eos.into(),
                    vocab_size,
                });
            }
        }
        let eos = config.eos_id.or_else(|| scorer.eos_id());
        Ok(Pruner {
            scorer,
            config,
            limits,
            eos,
        })
    }

    pub fn limits(&self) -> &PrunerLimits {
        &self.limits
    }

    pub fn config(&self) -> &PrunerConfig {
        &self.config
    }

    pub fn scorer(&self) -> &S {
        &self.scorer
    }

    /// The EOS token whose paths rank last in the beam (configured, else the model's).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// How many trailing context tokens a request needs: the n-gram history and the root.
    pub fn context_tail_len(&self) -> usize {
        self.scorer.order().saturating_sub(1).max(1)
    }

    /// Prunes one request into a draft tree.
    pub fn prune(&self, req: &DraftRequest<'_>) -> Result<DraftTree> {
        let search = self.validate(req)?;
        beam::run(&self.scorer, &self.config, &search)
    }

    /// Prunes many requests, in parallel across requests (rayon). Results are in request
    /// order and identical to calling [`Pruner::prune`] on each.
    pub fn prune_batch(&self, reqs: &[DraftRequest<'_>]) -> Vec<Result<DraftTree>> {
        if reqs.len() <= 1 {
            // A lone request gains nothing from a hop to the thread pool.
            return reqs.iter().map(|r| self.prune(r)).collect();
        }
        reqs.par_iter().map(|r| self.prune(r)).collect()
    }

    /// [`Pruner::prune_batch`] that gives up once `cancelled` is set: requests not started by
    /// then get [`PrunerError::Cancelled`] (one request is bounded by the limits, so the work
    /// left after cancellation is at most one request per thread).
    pub fn prune_batch_until(
        &self,
        reqs: &[DraftRequest<'_>],
        cancelled: &AtomicBool,
    ) -> Vec<Result<DraftTree>> {
        let one = |r: &DraftRequest<'_>| {
            if cancelled.load(Ordering::Relaxed) {
                Err(PrunerError::Cancelled)
            } else {
                self.prune(r)
            }
        };
        if reqs.len() <= 1 {
            return reqs.iter().map(one).collect();
        }
        reqs.par_iter().map(one).collect()
    }

    fn validate<'a>(&self, req: &DraftRequest<'a>) -> Result<beam::Search<'a>> {
        let vocab_size = self.scorer.vocab_size();
        let &DraftRequest {
            context,
            topk_ids,
            topk_probs,
            levels,
            k,
            budget,
            lookup_path,
        } = req;
        if context.is_empty() {
            return Err(PrunerError::InvalidArgument(
                "context is empty; expected at least the token just sampled (the root)".into(),
            ));
        }
        if levels == 0 || k == 0 {
            return Err(PrunerError::Shape(format!(
                "topk_ids has shape ({levels}, {k}); expected at least one level and one \
                 candidate per level"
            )));
        }
        let budget = budget.unwrap_or(self.config.max_nodes);
        // Before anything scales with the request: the shape, the budget and the paths the
        // search would score.
        self.limits
            .check_request(levels, k, budget, self.config.beam_width)?;
        let cells = levels
            .checked_mul(k)
            .ok_or_else(|| PrunerError::Shape(format!("shape ({levels}, {k}) overflows")))?;
        if topk_ids.len() != cells || topk_probs.len() != cells {
            return Err(PrunerError::Shape(format!(
                "topk_ids has {} elements and topk_probs {}; expected levels x k = {levels} x \
                 {k} = {cells} each",
                topk_ids.len(),
                topk_probs.len()
            )));
        }
        // The arena indexes nodes with u32.
        let max_nodes = cells.saturating_mul(self.config.beam_width.min(cells)) + 1;
        if max_nodes > u32::MAX as usize {
            return Err(PrunerError::Shape(format!(
                "levels x k x beam_width = {levels} x {k} x {} is too large (at most {} \
                 scored paths)",
                self.config.beam_width,
                u32::MAX
            )));
        }
        if budget == 0 {
            return Err(PrunerError::InvalidArgument(
                "budget = 0; expected at least 1 node".into(),
            ));
        }
        let tail = &context[context.len().saturating_sub(self.context_tail_len())..];
        let tail_start = context.len() - tail.len();
        for (i, &t) in tail.iter().enumerate() {
            if t >= vocab_size {
                return Err(PrunerError::TokenOutOfVocab {
                    what: format!("context[{}]", tail_start + i),
                    token: t.into(),
                    vocab_size,
                });
            }
        }
        for (i, (&t, &p)) in topk_ids.iter().zip(topk_probs).enumerate() {
            if t >= vocab_size {
                return Err(PrunerError::TokenOutOfVocab {
                    what: format!("topk_ids[{}][{}]", i / k, i % k),
                    token: t.into(),
                    vocab_size,
                });
            }
            if !(0.0..=1.0).contains(&p) {
                return Err(PrunerError::BadProbability {
                    level: i / k,
                    column: i % k,
                    value: p,
                });
            }
        }
        for (level, row) in topk_ids.chunks_exact(k).enumerate() {
            check_unique(level, row)?;
        }
        if let Some((i, &t)) = lookup_path
            .iter()
            .enumerate()
            .find(|(_, &t)| t >= vocab_size)
        {
            return Err(PrunerError::TokenOutOfVocab {
                what: format!("lookup_path[{i}]"),
                token: t.into(),
                vocab_size,
            });
        }
        Ok(beam::Search {
            context,
            ids: topk_ids,
            probs: topk_probs,
            levels,
            k,
            budget,
            eos: self.eos,
            lookup_path: &lookup_path[..lookup_path.len().min(budget)],
        })
    }
}

/// Bytes of per-thread scratch the calling thread keeps between calls (at most a few MiB:
/// a larger scratch, left by a large request, is freed when the call ends).
pub fn scratch_bytes_of_this_thread() -> usize {
    beam::scratch_bytes()
}

/// Rejects a row holding the same token twice.
fn check_unique(level: usize, row: &[u32]) -> Result<()> {
    let dup = |token, first, second| PrunerError::DuplicateToken {
        level,
        token,
        first,
        second,
    };
    if row.len() <= 64 {
        // Quadratic but branch-light: cheaper than sorting for the usual k = 25.
        for (j, &t) in row.iter().enumerate().skip(1) {
            if let Some(i) = row[..j].iter().position(|&u| u == t) {
                return Err(dup(t, i, j));
            }
        }
        return Ok(());
    }
    let mut sorted: Vec<(u32, usize)> = row.iter().copied().zip(0..).collect();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(dup(w[0].0, w[0].1, w[1].1)),
        None => Ok(()),
    }
}
