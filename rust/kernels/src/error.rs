use thiserror::Error;

/// What a kernel call was given that does not fit.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A buffer's length is not what the shapes say.
    #[error("{what} has {got} elements, expected {expected}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A dimension is zero or too large.
    #[error("{what} must be between 1 and {max}, got {got}")]
    Dimension {
        what: &'static str,
        max: usize,
        got: usize,
    },
    /// A tensor's shape does not fit the others.
    #[error("{what} has shape {shape:?}, expected {expected}")]
    Shape {
        what: &'static str,
        shape: Vec<usize>,
        expected: &'static str,
    },
    /// A tensor's memory layout cannot be read.
    #[error("{what}: {problem}")]
    Layout {
        what: &'static str,
        problem: &'static str,
    },
    /// The requested backend cannot run on this CPU.
    #[error("the {0} backend is not available on this CPU")]
    Unavailable(&'static str),
    /// `DART_MAX_CPU_ISA` names no backend.
    #[error("DART_MAX_CPU_ISA={0:?}: expected one of amx, avx512bf16, avx512, avx2, scalar")]
    MaxIsa(String),
}

pub type Result<T> = std::result::Result<T, KernelError>;

/// `got` elements where the shapes say `expected`: a [`KernelError::Length`] naming `what`.
pub(crate) fn check_len(what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            what,
            expected,
            got,
        })
    }
}
