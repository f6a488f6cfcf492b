//! Writes a model as a reference-format `.trie` (streaming), for import benchmarks:
//! `cargo run --release -p dart-ngram-build --example write_reference_trie -- M.ngram OUT.trie`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use dart_ngram::model::NGramModel;
use dart_ngram_build::reference::write_reference_trie_from_model;

fn main() -> ExitCode {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [model, trie] = args.as_slice() else {
        eprintln!("usage: write_reference_trie MODEL.ngram OUT.trie");
        return ExitCode::from(2);
    };
    let start = Instant::now();
    let written = NGramModel::open(model).and_then(|m| write_reference_trie_from_model(trie, &m));
    match written {
        Ok(nodes) => {
            println!(
                "{nodes} nodes written to {} in {:.1} s",
                trie.display(),
                start.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("write_reference_trie: {e}");
            ExitCode::FAILURE
        }
    }
}
