//! The one Python exception family. Every `dart_ngram::NGramError` becomes an
//! `NGramError(ValueError)` or one of its subclasses, with the Rust message (which names the
//! file, the value and what was expected) as its text. Bindings convert with [`to_py`].

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pyo3::create_exception!(
    dart_client._native,
    NGramError,
    PyValueError,
    "Base of every n-gram engine error (a ValueError)."
);
pyo3::create_exception!(
    dart_client._native,
    CorruptModelError,
    NGramError,
    "The file is not a model, has an unsupported version, is truncated or fails a check."
);
pyo3::create_exception!(
    dart_client._native,
    TokenizerMismatchError,
    NGramError,
    "The model was built with another tokenizer than the one in use."
);
pyo3::create_exception!(
    dart_client._native,
    TokenOutOfVocabError,
    NGramError,
    "A token id outside the model's vocabulary (or negative)."
);

/// Maps an engine error to its Python exception.
pub fn to_py(err: dart_ngram::NGramError) -> PyErr {
    use dart_ngram::NGramError as E;
    let msg = err.to_string();
    // Exhaustive on purpose: a new variant must choose its Python class here.
    match err {
        E::NotAModel { .. }
        | E::UnsupportedVersion { .. }
        | E::Corrupt { .. }
        | E::Changed { .. } => CorruptModelError::new_err(msg),
        E::TokenizerMismatch { .. } => TokenizerMismatchError::new_err(msg),
        E::TokenOutOfVocab { .. } => TokenOutOfVocabError::new_err(msg),
        E::Io { .. }
        | E::CountOverflow { .. }
        | E::Input { .. }
        | E::Tokenizer { .. }
        | E::InvalidArgument(_)
        | E::Interrupted { .. } => NGramError::new_err(msg),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("NGramError", py.get_type::<NGramError>())?;
    m.add("CorruptModelError", py.get_type::<CorruptModelError>())?;
    m.add(
        "TokenizerMismatchError",
        py.get_type::<TokenizerMismatchError>(),
    )?;
    m.add(
        "TokenOutOfVocabError",
        py.get_type::<TokenOutOfVocabError>(),
    )?;
    Ok(())
}
