//! Test helpers: a brute-force n-gram scorer over explicit counts and a slow, obviously
//! correct pruner that keeps every path as a vector of tokens.

#![allow(dead_code)]

use std::collections::HashMap;

use dart_pruner::{DraftRequest, NGramScorer, PrunerConfig, PrunerError};

/// Counts of every k-gram (k = 1..=order) of a corpus of documents, nothing spanning two
/// documents; `P(c | ctx)` by longest-context backoff, no smoothing (DESIGN.md section 3).
#[derive(Debug)]
pub struct BruteScorer {
    pub order: usize,
    pub vocab_size: u32,
    pub eos: Option<u32>,
    pub counts: HashMap<Vec<u32>, u64>,
}

impl BruteScorer {
    pub fn from_documents(
        order: usize,
        vocab_size: u32,
        eos: Option<u32>,
        docs: &[Vec<u32>],
    ) -> Self {
        let mut counts = HashMap::new();
        for doc in docs {
            for n in 1..=order {
                for gram in doc.windows(n) {
                    *counts.entry(gram.to_vec()).or_insert(0) += 1;
                }
            }
        }
        BruteScorer {
            order,
            vocab_size,
            eos,
            counts,
        }
    }

    pub fn prob(&self, context: &[u32], c: u32) -> f32 {
        let h = self.order - 1;
        let ctx = &context[context.len().saturating_sub(h)..];
        for start in 0..ctx.len() {
            let sub = &ctx[start..];
            let mut gram = sub.to_vec();
            gram.push(c);
            if let Some(&n) = self.counts.get(&gram) {
                let d = self.counts[sub];
                return (n as f64 / d as f64) as f32;
            }
        }
        0.0
    }
}

impl NGramScorer for BruteScorer {
    fn order(&self) -> usize {
        self.order
    }
    fn vocab_size(&self) -> u32 {
        self.vocab_size
    }
    fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    fn prob_many(
        &self,
        context: &[u32],
        candidates: &[u32],
        probs: &mut [f32],
    ) -> Result<(), PrunerError> {
        assert_eq!(candidates.len(), probs.len());
        for (p, &c) in probs.iter_mut().zip(candidates) {
            *p = self.prob(context, c);
        }
        Ok(())
    }
}

/// What the slow reference returns: nodes in output order as (path, score); root excluded.
pub type SlowTree = Vec<(Vec<u32>, f64)>;

/// The algorithm written the plain way: paths as vectors, full sorts, lookups per candidate.
pub fn slow_prune(scorer: &BruteScorer, config: &PrunerConfig, req: &DraftRequest<'_>) -> SlowTree {
    let eos = config.eos_id.or(scorer.eos);
    let budget = req.budget.unwrap_or(config.max_nodes);
    let k = req.k;
    let mut beam: Vec<(Vec<u32>, f64)> = vec![(vec![], 0.0)];
    let mut pool: Vec<(Vec<u32>, f64)> = vec![];
    for l in 0..req.levels {
        let w_level = ((l + 1) as f64).powf(-config.level_exponent);
        let w_logit = config.logit_decay.powf(l as f64);
        let mut ext = vec![];
        for (path, score) in &beam {
            for j in 0..k {
                let t = req.topk_ids[l * k + j];
                let p = req.topk_probs[l * k + j] as f64;
                let mut inner = w_logit * (p + config.eps).ln();
                if config.ngram_weight != 0.0 && (l > 0 || config.ngram_at_level0) {
                    let mut full = req.context.to_vec();
                    full.extend(path);
                    let q = scorer.prob(&full, t) as f64;
                    inner += config.ngram_weight * (q + config.eps).ln();
                }
                let delta = (w_level * inner).min(0.0);
                let mut child = path.clone();
                child.push(t);
                ext.push((child, score + delta));
            }
        }
        pool.extend(ext.iter().cloned());
        let is_eos = |p: &Vec<u32>| eos.is_some() && p.last().copied() == eos;
        ext.sort_by(|a, b| {
            is_eos(&a.0)
                .cmp(&is_eos(&b.0))
                .then(b.1.partial_cmp(&a.1).unwrap())
                .then(a.0.cmp(&b.0))
        });
        ext.truncate(config.beam_width);
        beam = ext;
    }
    pool.sort_by(|a, b| {
        b.1.partial_cmp(&a.1)
            .unwrap()
            .then(a.0.len().cmp(&b.0.len()))
            .then(a.0.cmp(&b.0))
    });
    pool.truncate(budget);
    pool.sort_by(|a, b| {
        a.0.len()
            .cmp(&b.0.len())
            .then(b.1.partial_cmp(&a.1).unwrap())
            .then(a.0.cmp(&b.0))
    });
    pool
}

/// Writes the scorer's counts as a real `.ngram` model (the format's own writer) and opens it.
pub fn write_real_model(
    scorer: &BruteScorer,
    docs: u64,
    path: &std::path::Path,
) -> dart_ngram::NGramModel {
    use dart_ngram::{key, write_model, CountStream, ModelMeta, WriteOptions};
    let bits = key::token_bits(scorer.vocab_size);
    let mut unigrams = vec![0u64; scorer.vocab_size as usize];
    let mut higher: Vec<Vec<(u64, u64)>> = vec![vec![]; scorer.order - 1];
    for (gram, &c) in &scorer.counts {
        if gram.len() == 1 {
            unigrams[gram[0] as usize] = c;
        } else {
            higher[gram.len() - 2].push((key::pack(gram, bits), c));
        }
    }
    let streams: Vec<CountStream<'static>> = higher
        .into_iter()
        .map(|mut v| {
            v.sort_unstable();
            Box::new(v.into_iter().map(Ok)) as CountStream<'static>
        })
        .collect();
    let meta = ModelMeta {
        order: scorer.order,
        vocab_size: scorer.vocab_size,
        tokenizer_fingerprint: [0; 32],
        eos_id: scorer.eos,
        min_count: 1,
        total_tokens: unigrams.iter().sum(),
        documents: docs,
        source: "dart-pruner tests".into(),
    };
    write_model(path, &meta, &unigrams, streams, &WriteOptions::default()).unwrap();
    dart_ngram::NGramModel::open(path).unwrap()
}
