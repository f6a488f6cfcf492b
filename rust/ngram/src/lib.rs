//! DART's n-gram engine.
//!
//! * [`model::NGramModel`] opens a `.ngram` file with `mmap` in O(1) and answers
//!   `P(c | context)` (longest-context backoff, DESIGN.md section 3), raw counts and top-K
//!   continuations without copying anything out of the file.
//! * [`merge`] adds models built from disjoint shards of a corpus.
//! * [`writer`] is the one place that lays out the on-disk format (documented in
//!   `docs/ngram-format.md`); everything that produces a model streams sorted
//!   `(key, count)` pairs into it.
//!
//! Building from a corpus and importing the reference's `.trie` files live in the
//! `dart-ngram-build` crate, which streams into [`writer`] too. No Python here: the bindings
//! live in `rust/python`.

pub mod error;
pub mod key;
pub mod writer;

pub use error::{NGramError, Result};
