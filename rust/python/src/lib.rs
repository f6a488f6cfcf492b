//! `dart_client._native`: thin PyO3 bindings over the n-gram engine, the pruner and the CPU
//! decoding kernels.
//! One module per core concept (`ngram.rs`, `pruner.rs`), mirroring the Rust crates; errors
//! become Python exceptions here and nowhere else (`errors.rs`).

use pyo3::prelude::*;

mod arrays;
pub mod build;
pub mod config;
pub mod errors;
pub mod kernels;
pub mod ngram;
pub mod pruner;
pub mod remote;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    ngram::register(m)?;
    build::register(m)?;
    pruner::register(m)?;
    kernels::register(m)?;
    remote::register(m)?;
    Ok(())
}
