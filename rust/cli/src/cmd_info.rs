//! `dart-ngram info MODEL [--json] [--verify]`: what a model is and what it costs on disk.

use std::path::PathBuf;

use dart_ngram::{NGramModel, OpenOptions};

#[derive(clap::Args)]
pub struct Args {
    /// The model file.
    pub model: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Check every section checksum and invariant (reads the whole file).
    #[arg(long)]
    pub verify: bool,
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let opts = OpenOptions {
        verify: args.verify,
        ..Default::default()
    };
    let m = NGramModel::open_with(&args.model, &opts)?;
    let info = m.info();
    if args.json {
        let mut v = serde_json::to_value(&info)?;
        v["verified"] = serde_json::Value::Bool(args.verify);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("model            {}", info.path);
    println!("format version   {}", info.format_version);
    println!("order            {}", info.order);
    println!(
        "vocabulary       {} tokens ({} bits)",
        info.vocab_size, info.token_bits
    );
    println!("tokenizer        {}", info.tokenizer_fingerprint);
    match info.eos_id {
        Some(e) => println!("eos id           {e}"),
        None => println!("eos id           none"),
    }
    println!("total tokens     {}", info.total_tokens);
    println!("documents        {}", info.documents);
    println!("min count        {}", info.min_count);
    for (i, n) in info.ngrams_per_order.iter().enumerate() {
        println!("{}-grams{:9} {n}", i + 1, "");
    }
    println!("n-grams total    {}", info.total_ngrams);
    println!("bytes on disk    {}", info.bytes);
    println!("bytes / n-gram   {:.3}", info.bytes_per_ngram);
    println!("source           {}", info.source);
    if args.verify {
        println!("verified         ok (checksums and structure)");
    }
    Ok(())
}
