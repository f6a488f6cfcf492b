//! The crate's one error type. Every message names the offending value and what was expected.

pub type Result<T, E = PrunerError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum PrunerError {
    /// A configuration value outside its domain (checked once, in `Pruner::new`, and for the
    /// per-level weights again per request since they depend on the number of levels).
    #[error("invalid pruner configuration: {0}")]
    InvalidConfig(String),
    /// Arrays whose sizes disagree with the declared shape, or an empty dimension.
    #[error("bad shape: {0}")]
    Shape(String),
    /// A token id outside the n-gram model's vocabulary.
    #[error("{what} = {token} is outside the vocabulary (token ids must be < {vocab_size})")]
    TokenOutOfVocab {
        what: String,
        token: u64,
        vocab_size: u32,
    },
    /// The same token twice in one row of top-k ids (siblings would not be unique).
    #[error("topk_ids row {level} holds token {token} twice (columns {first} and {second}); ids must be unique within a row")]
    DuplicateToken {
        level: usize,
        token: u32,
        first: usize,
        second: usize,
    },
    /// A draft probability that is NaN or outside [0, 1].
    #[error("topk_probs[{level}][{column}] = {value} is not a probability (expected a number in [0, 1])")]
    BadProbability {
        level: usize,
        column: usize,
        value: f32,
    },
    /// A request or configuration larger than the pruner's [`crate::PrunerLimits`].
    #[error("{what} exceeds the limit {limit_name} = {limit} (raise it with the daemon's --{flag} flag or PrunerLimits::{limit_name}, or send a smaller request)", flag = limit_name.replace('_', "-"))]
    LimitExceeded {
        what: String,
        limit_name: &'static str,
        limit: usize,
    },
    /// The caller gave up on the request (the client went away, a deadline passed).
    #[error("cancelled: the caller gave up on the request before it was pruned")]
    Cancelled,
    /// A per-call budget of zero nodes, or an empty context.
    #[error("{0}")]
    InvalidArgument(String),
    /// The weights overflowed so that a score is not a number.
    #[error("score of token {token} at level {level} is not a number: the configured weights overflow (level_exponent = {level_exponent}, logit_decay = {logit_decay}, ngram_weight = {ngram_weight})")]
    NonFiniteScore {
        level: usize,
        token: u32,
        level_exponent: f64,
        logit_decay: f64,
        ngram_weight: f64,
    },
    /// The n-gram model failed to answer (corrupt file found at query time, ...).
    #[error("n-gram lookup failed: {0}")]
    NGram(#[from] dart_ngram::NGramError),
    /// A broken invariant of the search (a bug: please report it).
    #[error("internal pruner error: {0}")]
    Internal(String),
    /// A scorer other than the built-in model failed.
    #[error("n-gram scorer failed: {0}")]
    Scorer(String),
}
