//! `dart-ngram merge A.ngram B.ngram ... --output C.ngram [--min-count N] [--allow-pruned]
//! [--threads N] [--quiet]`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use dart_ngram::writer::WriteProgress;
use dart_ngram::{merge_models, MergeOptions, WriteOptions};
use dart_ngram_build::write_bar::WriteBar;

#[derive(clap::Args)]
pub struct Args {
    /// Models built from disjoint shards of one corpus with the same tokenizer.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Where to write the merged model (written atomically).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Drop n-grams of order >= 2 whose summed count is below N.
    #[arg(long, default_value_t = 1)]
    pub min_count: u64,
    /// Accept inputs that were themselves pruned (the sum then differs from the model of the
    /// concatenated corpus).
    #[arg(long)]
    pub allow_pruned: bool,
    /// Length of the precomputed top-continuation lists.
    #[arg(long, default_value_t = 32)]
    pub top_list_len: u32,
    /// Threads (default: all cores). 1 merges on one thread; more split the n-grams by first
    /// token into ranges of similar size (4 per thread) merged that many at a time. The
    /// output is the same bytes whatever the number.
    #[arg(long)]
    pub threads: Option<usize>,
    /// No progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let progress = Arc::new(WriteProgress::default());
    let inputs: Vec<&Path> = args.inputs.iter().map(|p| p.as_path()).collect();
    let opts = MergeOptions {
        allow_pruned: args.allow_pruned,
        min_count: args.min_count,
        write: WriteOptions {
            top_list_len: args.top_list_len,
            progress: Some(progress.clone()),
        },
        source: None,
        threads: args
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    let bar = (!args.quiet).then(|| WriteBar::start(progress, "input n-grams merged"));
    let report = merge_models(&inputs, &args.output, &opts);
    drop(bar);
    let report = report?;
    eprintln!(
        "merged {} models into {}: n-grams per order {:?}, {} bytes, {:.1} s",
        inputs.len(),
        args.output.display(),
        report.ngrams_per_order,
        report.bytes,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
