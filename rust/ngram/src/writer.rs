//! The one place that lays out the on-disk format (see `docs/ngram-format.md`).
//!
//! Producers (build, merge, import) stream, for each order 2..=N, `(key, count)` pairs sorted
//! strictly ascending by key (keys packed by [`crate::key::pack`] with
//! [`crate::key::token_bits`] of the vocabulary), together with the dense unigram counts.
//! The writer checks what it is given (sorted, prefix-closed, counts never above their
//! prefix's count), writes to a temporary file beside the output, syncs it and renames it into
//! place, so an interrupted or failed write never leaves a half-written file under the final
//! name.

use std::path::Path;

use crate::error::Result;

/// What a model says about itself in its header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelMeta {
    /// Highest n-gram order stored (1..=N).
    pub order: usize,
    /// Token ids are `< vocab_size`.
    pub vocab_size: u32,
    /// Fingerprint of the tokenizer the counts were made with; all zeros when unknown
    /// (pre-tokenized input without a tokenizer).
    pub tokenizer_fingerprint: [u8; 32],
    /// The end-of-document token appended to every document, if any.
    pub eos_id: Option<u32>,
    /// n-grams of order >= 2 seen fewer times than this were dropped (1 = none dropped).
    pub min_count: u64,
    /// Number of tokens counted (the order-0 count; EOS tokens included).
    pub total_tokens: u64,
    /// Number of documents counted.
    pub documents: u64,
    /// Free-text provenance, e.g. `"dart-ngram build"`, `"dart-ngram merge"`.
    pub source: String,
}

/// A stream of `(key, count)` pairs of one order, sorted strictly ascending by key.
pub type CountStream<'a> = Box<dyn Iterator<Item = Result<(u64, u64)>> + Send + 'a>;

/// Tuning of the written file.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Contexts with more children than this get a precomputed list of their `top_list_len`
    /// most frequent continuations (smaller contexts are sorted at query time).
    pub top_list_len: u32,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions { top_list_len: 32 }
    }
}

/// What was written.
#[derive(Clone, Debug, Default)]
pub struct WriteReport {
    /// Distinct n-grams stored per order, index 0 = order 1 (unigrams with a non-zero count).
    pub ngrams_per_order: Vec<u64>,
    pub bytes: u64,
}

/// Writes a model to `path` atomically (temporary file + fsync + rename).
///
/// `unigrams` has `meta.vocab_size` entries; `higher[i]` holds the n-grams of order `i + 2`.
pub fn write_model(
    path: &Path,
    meta: &ModelMeta,
    unigrams: &[u64],
    higher: Vec<CountStream<'_>>,
    opts: &WriteOptions,
) -> Result<WriteReport> {
    let _ = (path, meta, unigrams, higher, opts);
    todo!("format writer: being written")
}
