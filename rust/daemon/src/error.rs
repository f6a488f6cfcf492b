//! The crate's one error type, and how model and pruner errors become gRPC statuses.

use dart_ngram::NGramError;
use dart_pruner::error::PrunerError;
use tonic::{Code, Status};

pub type Result<T, E = DaemonError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A bad flag value or a placement the machine cannot honour.
    #[error("{0}")]
    Config(String),
    /// The model could not be opened.
    #[error(transparent)]
    Model(#[from] NGramError),
    /// The default pruner configuration was refused.
    #[error(transparent)]
    Pruner(#[from] PrunerError),
    /// Binding or serving a socket failed.
    #[error("{what} {addr}: {source}")]
    Io {
        what: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("gRPC transport: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The status a model error deserves: the caller's fault is INVALID_ARGUMENT, a bad file is
/// DATA_LOSS, anything else INTERNAL. The message is the model's own.
pub fn ngram_status(err: &NGramError) -> Status {
    let code = match err {
        NGramError::TokenOutOfVocab { .. } | NGramError::InvalidArgument(_) => {
            Code::InvalidArgument
        }
        NGramError::TokenizerMismatch { .. } => Code::FailedPrecondition,
        NGramError::Corrupt { .. }
        | NGramError::Changed { .. }
        | NGramError::NotAModel { .. }
        | NGramError::UnsupportedVersion { .. }
        | NGramError::CountOverflow { .. } => Code::DataLoss,
        // I/O, corpus and tokenizer errors come from building, not serving; and variants
        // added later default to the daemon's fault until mapped here.
        _ => Code::Internal,
    };
    Status::new(code, err.to_string())
}

/// The status a pruner error deserves (same rules as [`ngram_status`]).
pub fn pruner_status(err: &PrunerError) -> Status {
    let code = match err {
        PrunerError::InvalidConfig(_)
        | PrunerError::Shape(_)
        | PrunerError::TokenOutOfVocab { .. }
        | PrunerError::DuplicateToken { .. }
        | PrunerError::BadProbability { .. }
        | PrunerError::InvalidArgument(_)
        | PrunerError::NonFiniteScore { .. } => Code::InvalidArgument,
        PrunerError::LimitExceeded { .. } => Code::ResourceExhausted,
        PrunerError::Cancelled => Code::Cancelled,
        PrunerError::NGram(inner) => return ngram_status(inner),
        PrunerError::Internal(_) | PrunerError::Scorer(_) => Code::Internal,
    };
    Status::new(code, err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_faults_are_invalid_argument_and_file_faults_data_loss() {
        let oov = NGramError::TokenOutOfVocab {
            token: 70000,
            vocab_size: 49152,
        };
        assert_eq!(ngram_status(&oov).code(), Code::InvalidArgument);
        assert!(ngram_status(&oov).message().contains("70000"));
        let corrupt = NGramError::Corrupt {
            path: "m.ngram".into(),
            detail: "offset out of range".into(),
        };
        assert_eq!(ngram_status(&corrupt).code(), Code::DataLoss);
        assert_eq!(
            pruner_status(&PrunerError::NGram(corrupt)).code(),
            Code::DataLoss
        );
        assert_eq!(
            pruner_status(&PrunerError::Shape("rows".into())).code(),
            Code::InvalidArgument
        );
        assert_eq!(
            pruner_status(&PrunerError::Internal("bug".into())).code(),
            Code::Internal
        );
    }
}
