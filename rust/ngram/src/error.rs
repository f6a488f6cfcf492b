//! The crate's one error type. Every message names the file, the value and what was expected.

use std::path::PathBuf;

pub type Result<T, E = NGramError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum NGramError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a DART n-gram model at all (bad magic).
    #[error("{path}: not a DART n-gram model ({detail})")]
    NotAModel { path: PathBuf, detail: String },
    /// A model written by a newer (or unknown) version of the format.
    #[error(
        "{path}: format version {found} is not supported (this build reads versions \
         {min}..={max}); read it with a newer dart-ngram (or dart_client), or rewrite it as a \
         version this build reads with the build that wrote it"
    )]
    UnsupportedVersion {
        path: PathBuf,
        found: u32,
        min: u32,
        max: u32,
    },
    /// Truncated, checksum mismatch, inconsistent sections, out-of-range offsets.
    #[error("{path}: corrupt model: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    /// The mapped model file was modified in place after it was opened.
    #[error(
        "{path}: the model file was modified in place after it was opened ({detail}); reopen \
         it (replace model files by renaming a new file over them), or open it in memory"
    )]
    Changed { path: PathBuf, detail: String },
    /// The model was built with another tokenizer than the one in use.
    #[error("tokenizer mismatch: {detail}")]
    TokenizerMismatch { detail: String },
    /// A token id outside the model's vocabulary.
    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfVocab { token: u64, vocab_size: u32 },
    /// A count that does not fit (e.g. the reference's i32 frequencies wrapped negative).
    #[error("{path}: count overflow: {detail}")]
    CountOverflow { path: PathBuf, detail: String },
    /// Malformed corpus input (bad JSON line, missing field, bad id).
    #[error("{path}:{line}: {detail}")]
    Input {
        path: PathBuf,
        line: u64,
        detail: String,
    },
    #[error("tokenizer {path}: {detail}")]
    Tokenizer { path: PathBuf, detail: String },
    #[error("{0}")]
    InvalidArgument(String),
    /// A long job (build, import) stopped on request (Ctrl-C, KeyboardInterrupt).
    #[error("interrupted: {detail}")]
    Interrupted { detail: String },
}

impl NGramError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        NGramError::Io {
            path: path.into(),
            source,
        }
    }
}
