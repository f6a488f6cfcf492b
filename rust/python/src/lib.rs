//! `dart_client._native`: thin PyO3 bindings over the n-gram engine and the pruner.
//! One module per core concept (`ngram.rs`, `pruner.rs`), mirroring the Rust crates; errors
//! become Python exceptions here and nowhere else (`errors.rs`).

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
