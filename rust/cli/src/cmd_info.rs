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
    /// List every section: bytes, bytes per stored n-gram, share of the file.
    #[arg(long)]
    pub sections: bool,
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
    if args.sections {
        print_sections(&info);
    }
    Ok(())
}

/// Where the bytes go: per section, and per kind over all orders.
fn print_sections(info: &dart_ngram::Info) {
    let per = |b: u64| b as f64 / info.total_ngrams.max(1) as f64;
    let share = |b: u64| 100.0 * b as f64 / info.bytes.max(1) as f64;
    println!();
    println!(
        "{:<16} {:>5} {:>15} {:>10} {:>7}",
        "section", "order", "bytes", "B/n-gram", "share"
    );
    let mut kinds: Vec<(&str, u64)> = Vec::new();
    let mut covered = 0;
    for s in &info.sections {
        println!(
            "{:<16} {:>5} {:>15} {:>10.3} {:>6.1}%",
            s.kind,
            s.order,
            s.length,
            per(s.length),
            share(s.length)
        );
        covered += s.length;
        match kinds.iter_mut().find(|(k, _)| *k == s.kind) {
            Some((_, b)) => *b += s.length,
            None => kinds.push((s.kind, s.length)),
        }
    }
    let header = info.bytes - covered;
    println!(
        "{:<16} {:>5} {:>15} {:>10.3} {:>6.1}%",
        "header",
        "",
        header,
        per(header),
        share(header)
    );
    println!();
    println!(
        "{:<16} {:>15} {:>10} {:>7}",
        "kind (all orders)", "bytes", "B/n-gram", "share"
    );
    kinds.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
    for (k, b) in kinds {
        println!("{:<16} {:>15} {:>10.3} {:>6.1}%", k, b, per(b), share(b));
    }
}
