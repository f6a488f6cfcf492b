//! DART's n-gram engine.
//!
//! * [`model::NGramModel`] opens a `.ngram` file with `mmap` (checking its header and,
//!   by default, every section checksum: one read of the file) and answers
//!   `P(c | context)` (longest-context backoff, DESIGN.md section 3), raw counts and top-K
//!   continuations without copying anything out of the file.
//! * [`merge`] adds models built from disjoint shards of a corpus.
//! * [`writer`] is the one place that lays out the on-disk format (documented in
//!   `docs/ngram-format.md`); everything that produces a model streams sorted
//!   `(key, count)` pairs into it. [`format`] parses and checks the header, [`bits`] holds
//!   the bit-packed columns.
//!
//! ```no_run
//! use dart_ngram::NGramModel;
//! let m = NGramModel::open("sharegpt.ngram".as_ref())?;
//! let (mut p, mut matched) = ([0f32; 3], [0u8; 3]);
//! m.prob_many(&[13, 2097], &[314, 28, 11], &mut p, &mut matched)?;
//! let best = m.top_k(&[13, 2097], 5)?; // [(token, prob)], best first
//! # Ok::<(), dart_ngram::NGramError>(())
//! ```
//!
//! Building from a corpus and importing the reference's `.trie` files live in the
//! `dart-ngram-build` crate, which streams into [`writer`] too. No Python here: the bindings
//! live in `rust/python`.

pub mod bits;
pub mod error;
pub mod fingerprint;
pub mod format;
pub mod key;
pub mod merge;
pub mod model;
pub mod scratch;
pub mod varint;
pub mod writer;

#[cfg(test)]
mod testutil;

pub use error::{NGramError, Result};
pub use merge::{merge_models, MergeOptions};
pub use model::{Eviction, Info, Integrity, NGramModel, OpenOptions};
pub use writer::{write_model, CountStream, ModelMeta, WriteOptions, WriteReport};
