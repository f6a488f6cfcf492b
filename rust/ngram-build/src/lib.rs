//! Building DART n-gram models.
//!
//! * [`build::build`] counts a corpus (JSON lines with text or pre-tokenized ids, plain text,
//!   `.gz`, directories) into a model file, tokenizing in parallel with a `tokenizer.json`
//!   ([`tokenize`]) and counting within a memory budget ([`extsort`]).
//! * [`import::import_dart`] converts the reference implementation's `.trie` file with bounded
//!   memory; [`reference`] writes and naively reads that format (for tests).
//! * [`synth::synth`] writes a synthetic pre-tokenized corpus (Zipf unigrams, long-tailed
//!   continuations) for measuring the engine at scale.
//!
//! Both stream sorted counts into [`dart_ngram::writer::write_model`]; errors are
//! [`dart_ngram::NGramError`].

pub mod build;
pub mod bytelevel;
pub mod corpus;
pub mod extsort;
pub mod import;
pub mod reference;
pub mod synth;
pub mod tokenize;
pub mod write_bar;

pub use build::{build, parse_memory, BuildOptions, BuildReport};
pub use import::{import_dart, ImportOptions, ImportReport};
pub use tokenize::EosChoice;
