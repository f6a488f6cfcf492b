//! `dart-ngram`: the operator's command line for DART n-gram models.
//!
//! Each subcommand lives in its own module; this file only parses arguments and maps errors
//! to an exit status with a message that names the problem.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd_bench;
mod cmd_build;
mod cmd_import;
mod cmd_info;
mod cmd_merge;
mod cmd_query;
mod cmd_serve;
mod cmd_synth;

#[derive(Parser)]
#[command(
    name = "dart-ngram",
    version,
    about = "Build, inspect, query and serve DART n-gram models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Count 1..N-grams of a corpus into a model file, within a memory budget.
    Build(cmd_build::Args),
    /// Add models built from disjoint shards of a corpus into one model.
    Merge(cmd_merge::Args),
    /// Convert the reference implementation's `.trie` file into a model.
    ImportDart(cmd_import::Args),
    /// Describe a model: order, vocabulary, tokenizer fingerprint, counts, size.
    Info(cmd_info::Args),
    /// Probabilities of candidates after a context, or the top continuations.
    Query(cmd_query::Args),
    /// Serve a model (queries and the draft-tree pruner) over gRPC to every worker on a host.
    Serve(cmd_serve::Args),
    /// Time open, P(c|context) for 25 candidates and 60-node prunes on a model, warm and cold.
    Bench(cmd_bench::Args),
    /// Write a synthetic pre-tokenized corpus (Zipf unigrams, long-tailed continuations).
    Synth(cmd_synth::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<(), Box<dyn std::error::Error>> = match cli.command {
        Command::Build(args) => cmd_build::run(args),
        Command::Merge(args) => cmd_merge::run(args),
        Command::ImportDart(args) => cmd_import::run(args),
        Command::Info(args) => cmd_info::run(args),
        Command::Query(args) => cmd_query::run(args),
        Command::Serve(args) => cmd_serve::run(args),
        Command::Bench(args) => cmd_bench::run(args),
        Command::Synth(args) => cmd_synth::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("dart-ngram: error: {err}");
            ExitCode::FAILURE
        }
    }
}
