//! `dart-ngram info MODEL [--json] [--verify]`: what a model is and what it costs on disk.

use std::path::PathBuf;

use std::fmt::Write;

use dart_ngram::{NGramModel, OpenOptions};

use crate::cmd_build::emit;

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
        return emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
    }
    let mut s = String::new();
    let _ = writeln!(s, "model            {}", info.path);
    let _ = writeln!(s, "format version   {}", info.format_version);
    let _ = writeln!(s, "order            {}", info.order);
    let _ = writeln!(
        s,
        "vocabulary       {} tokens ({} bits)",
        info.vocab_size, info.token_bits
    );
    let _ = writeln!(s, "tokenizer        {}", info.tokenizer_fingerprint);
    let _ = match info.eos_id {
        Some(e) => writeln!(s, "eos id           {e}"),
        None => writeln!(s, "eos id           none"),
    };
    let _ = writeln!(s, "total tokens     {}", info.total_tokens);
    let _ = writeln!(s, "documents        {}", info.documents);
    let _ = writeln!(s, "min count        {}", info.min_count);
    for (i, n) in info.ngrams_per_order.iter().enumerate() {
        let _ = writeln!(s, "{}-grams{:9} {n}", i + 1, "");
    }
    let _ = writeln!(s, "n-grams total    {}", info.total_ngrams);
    let _ = writeln!(s, "bytes on disk    {}", info.bytes);
    let _ = writeln!(s, "bytes / n-gram   {:.3}", info.bytes_per_ngram);
    let _ = writeln!(s, "source           {}", info.source);
    if args.verify {
        let _ = writeln!(s, "verified         ok (checksums and structure)");
    }
    if args.sections {
        write_sections(&mut s, &info);
    }
    // Through `emit`: `dart-ngram info M | head` ends quietly, not with a panic.
    emit(&s)
}

/// Where the bytes go: per section, and per kind over all orders.
fn write_sections(s: &mut String, info: &dart_ngram::Info) {
    let per = |b: u64| b as f64 / info.total_ngrams.max(1) as f64;
    let share = |b: u64| 100.0 * b as f64 / info.bytes.max(1) as f64;
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<16} {:>5} {:>15} {:>10} {:>7}",
        "section", "order", "bytes", "B/n-gram", "share"
    );
    let mut kinds: Vec<(&str, u64)> = Vec::new();
    let mut covered = 0;
    for sec in &info.sections {
        let _ = writeln!(
            s,
            "{:<16} {:>5} {:>15} {:>10.3} {:>6.1}%",
            sec.kind,
            sec.order,
            sec.length,
            per(sec.length),
            share(sec.length)
        );
        covered += sec.length;
        match kinds.iter_mut().find(|(k, _)| *k == sec.kind) {
            Some((_, b)) => *b += sec.length,
            None => kinds.push((sec.kind, sec.length)),
        }
    }
    let header = info.bytes - covered;
    let _ = writeln!(
        s,
        "{:<16} {:>5} {:>15} {:>10.3} {:>6.1}%",
        "header",
        "",
        header,
        per(header),
        share(header)
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<16} {:>15} {:>10} {:>7}",
        "kind (all orders)", "bytes", "B/n-gram", "share"
    );
    kinds.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
    for (k, b) in kinds {
        let _ = writeln!(s, "{:<16} {:>15} {:>10.3} {:>6.1}%", k, b, per(b), share(b));
    }
}
