//! `dart-ngram import-dart full.trie --output MODEL.ngram`: convert the reference's trie.

use std::path::PathBuf;

use dart_ngram_build::{import_dart, parse_memory, ImportOptions};

#[derive(clap::Args)]
pub struct Args {
    /// The reference implementation's `.trie` file (e.g. `full.trie`, `small.trie`).
    pub trie: PathBuf,
    /// The model file to write (atomically).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Vocabulary size (default: the tokenizer's, else the highest token in the file + 1).
    #[arg(long)]
    pub vocab_size: Option<u32>,
    /// The tokenizer the trie was counted with: records its fingerprint in the model.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// End-of-document token id to record (the trie does not say).
    #[arg(long)]
    pub eos_id: Option<u32>,
    /// Memory budget for sorting the n-grams (e.g. 2G).
    #[arg(long, default_value = "2G")]
    pub memory: String,
    /// Directory for temporary files (node records, sorted runs); default: beside the output.
    #[arg(long)]
    pub tmp_dir: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut o = ImportOptions::new(args.trie, args.output);
    o.vocab_size = args.vocab_size;
    o.tokenizer = args.tokenizer;
    o.eos_id = args.eos_id;
    o.memory = parse_memory(&args.memory)?;
    o.tmp_dir = args.tmp_dir;
    o.progress = !args.quiet;
    o.cancel = Some(crate::cmd_build::interrupt_flag());
    let r = import_dart(&o)?;
    if args.json {
        return crate::cmd_build::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    }
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "imported         {} -> {}",
        r.trie.display(),
        r.output.display()
    );
    let _ = writeln!(s, "nodes            {}", r.nodes);
    let _ = writeln!(s, "order            {}", r.order);
    let _ = writeln!(s, "vocabulary       {}", r.vocab_size);
    let _ = writeln!(s, "total tokens     {}", r.total_tokens);
    let _ = writeln!(s, "tokenizer        {}", r.tokenizer_fingerprint);
    for (i, n) in r.ngrams_per_order.iter().enumerate() {
        let _ = writeln!(s, "{}-grams{:9} {n}", i + 1, "");
    }
    let _ = writeln!(s, "spilled runs     {}", r.spilled_runs);
    let _ = writeln!(s, "time             {:.2} s", r.seconds);
    let _ = writeln!(
        s,
        "bytes            {} in, {} out",
        r.input_bytes, r.output_bytes
    );
    crate::cmd_build::emit(&s)
}
