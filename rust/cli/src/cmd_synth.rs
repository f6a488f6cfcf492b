//! `dart-ngram synth --tokens N --shards S --output DIR`: a synthetic pre-tokenized corpus
//! (Zipf unigrams, long-tailed continuations; see `dart_ngram_build::synth`) for measuring
//! builds, merges and queries at scale. Build it with `--eos-id 0 --vocab-size V`.

use std::path::PathBuf;

use dart_ngram_build::synth::{synth, SynthOptions};

use crate::cmd_build::emit;

#[derive(clap::Args)]
pub struct Args {
    /// Directory to write `shard-00000.jsonl`, ... into (created if missing).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Tokens in all (the build's EOS tokens not included), e.g. 3e9.
    #[arg(long, value_parser = parse_count)]
    pub tokens: u64,
    #[arg(long, default_value_t = 1)]
    pub shards: usize,
    /// Vocabulary size; id 0 is never written (the end-of-document id).
    #[arg(long, default_value_t = 50_000)]
    pub vocab_size: u32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Zipf exponent of the unigram law.
    #[arg(long, default_value_t = SynthOptions::default().unigram_exponent)]
    pub unigram_exponent: f64,
    /// Zipf exponent of a context's continuation ranks.
    #[arg(long, default_value_t = SynthOptions::default().continuation_exponent)]
    pub continuation_exponent: f64,
    /// Distinct continuations a context can have.
    #[arg(long, default_value_t = SynthOptions::default().continuation_ranks)]
    pub continuation_ranks: u32,
    /// Probability that a token ignores its context (the tail of n-grams seen once).
    #[arg(long, default_value_t = SynthOptions::default().fresh)]
    pub fresh: f64,
    /// Probability that a continuing token looks at one previous token instead of two.
    #[arg(long, default_value_t = SynthOptions::default().bigram_share)]
    pub bigram_share: f64,
    /// Mean document length in tokens.
    #[arg(long, default_value_t = SynthOptions::default().doc_tokens)]
    pub doc_tokens: u32,
    /// Shards written at once.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
}

/// A whole number, also written as `3e9` or `1_000_000`.
fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.replace('_', "");
    if let Ok(v) = t.parse::<u64>() {
        return Ok(v);
    }
    match t.parse::<f64>() {
        Ok(v) if (0.0..1.8e19).contains(&v) && v.fract() == 0.0 => Ok(v as u64),
        _ => Err(format!(
            "{s:?} is not a whole number of tokens (e.g. 1000000 or 3e9)"
        )),
    }
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let opts = SynthOptions {
        tokens: args.tokens,
        shards: args.shards,
        vocab_size: args.vocab_size,
        seed: args.seed,
        unigram_exponent: args.unigram_exponent,
        continuation_exponent: args.continuation_exponent,
        continuation_ranks: args.continuation_ranks,
        fresh: args.fresh,
        bigram_share: args.bigram_share,
        doc_tokens: args.doc_tokens,
        threads: args.threads,
    };
    let r = synth(&opts, &args.output)?;
    emit(&format!(
        "wrote {} files to {}: {} tokens, {} documents, {} bytes, {:.1} s ({:.2}M tokens/s)\n",
        r.files.len(),
        args.output.display(),
        r.tokens,
        r.documents,
        r.bytes,
        r.seconds,
        r.tokens as f64 / r.seconds.max(1e-9) / 1e6
    ))
}
