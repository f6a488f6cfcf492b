//! `dart-ngram build`: count a corpus into a model file within a memory budget.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use dart_ngram_build::{build, parse_memory, BuildOptions, BuildReport, EosChoice};

#[derive(clap::Args)]
pub struct Args {
    /// Corpus files or directories (walked recursively): JSON lines with a text field or an
    /// `ids` field, plain text (one document per file), optionally `.gz`.
    #[arg(long, short, num_args = 1.., required = true)]
    pub input: Vec<PathBuf>,
    /// The model file to write (atomically: nothing appears under this name on failure).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Hugging Face `tokenizer.json` (or its directory); needed for text input.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Highest n-gram order counted.
    #[arg(long, default_value_t = 3)]
    pub order: usize,
    /// Memory budget for the counts (e.g. 2G, 512M); beyond it, sorted runs spill to disk.
    #[arg(long, default_value = "2G")]
    pub memory: String,
    /// Tokenizer threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Drop n-grams of order >= 2 seen fewer times than this (unigrams are kept).
    #[arg(long, default_value_t = 1)]
    pub min_count: u64,
    /// JSON field holding a document's text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// End-of-document token id appended to every document.
    #[arg(long, conflicts_with_all = ["eos_token", "no_eos"])]
    pub eos_id: Option<u32>,
    /// End-of-document token, looked up in the tokenizer.
    #[arg(long, conflicts_with = "no_eos")]
    pub eos_token: Option<String>,
    /// Append no end-of-document token.
    #[arg(long)]
    pub no_eos: bool,
    /// Vocabulary size (default: the tokenizer's highest id + 1); required for `ids` input
    /// without a tokenizer.
    #[arg(long)]
    pub vocab_size: Option<u32>,
    /// Directory for spilled runs (default: beside the output).
    #[arg(long)]
    pub tmp_dir: Option<PathBuf>,
    /// Skip and count malformed lines instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Write the model even when no document was counted (an empty corpus, or every line
    /// skipped); otherwise that is an error.
    #[arg(long)]
    pub allow_empty: bool,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
    /// Print the final report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

static INTERRUPT: OnceLock<Arc<AtomicBool>> = OnceLock::new();

extern "C" fn on_signal(sig: libc::c_int) {
    if let Some(flag) = INTERRUPT.get() {
        flag.store(true, Ordering::SeqCst);
    }
    // A second Ctrl-C kills at once. signal() is async-signal-safe.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
    }
}

/// Turns SIGINT/SIGTERM into a cancellation flag, so an interrupted job removes its
/// temporary files and leaves no output behind.
pub(crate) fn interrupt_flag() -> Arc<AtomicBool> {
    let flag = INTERRUPT
        .get_or_init(|| Arc::new(AtomicBool::new(false)))
        .clone();
    let handler: extern "C" fn(libc::c_int) = on_signal;
    // SAFETY: the handler only stores to an atomic and resets its own disposition.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
    flag
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut o = BuildOptions::new(args.input, args.output);
    o.tokenizer = args.tokenizer;
    o.order = args.order;
    o.memory = parse_memory(&args.memory)?;
    o.threads = args.threads;
    o.min_count = args.min_count;
    o.text_field = args.text_field;
    o.eos = match (args.eos_id, args.eos_token, args.no_eos) {
        (_, _, true) => EosChoice::NoEos,
        (Some(id), _, _) => EosChoice::Id(id),
        (None, Some(t), _) => EosChoice::Token(t),
        (None, None, false) => EosChoice::Auto,
    };
    o.vocab_size = args.vocab_size;
    o.tmp_dir = args.tmp_dir;
    o.skip_bad_lines = args.skip_bad_lines;
    o.allow_empty = args.allow_empty;
    o.progress = !args.quiet;
    o.cancel = Some(interrupt_flag());
    let report = build(&o)?;
    if args.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&report)?))
    } else {
        emit(&summary(&report))
    }
}

/// Writes to stdout; a closed pipe (`| head`) is not an error worth a panic.
pub(crate) fn emit(text: &str) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn summary(r: &BuildReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "built            {}", r.output.display());
    let _ = writeln!(s, "input files      {}", r.input_files);
    let _ = writeln!(s, "documents        {}", r.documents);
    let _ = writeln!(s, "tokens           {}", r.tokens);
    if r.skipped_lines > 0 {
        let _ = writeln!(
            s,
            "skipped lines    {} (first: {})",
            r.skipped_lines,
            r.first_skipped.as_deref().unwrap_or("?")
        );
    }
    let _ = writeln!(s, "order            {}", r.order);
    let _ = writeln!(s, "vocabulary       {}", r.vocab_size);
    let eos = r
        .eos_id
        .map_or_else(|| "none".to_string(), |e| e.to_string());
    let _ = writeln!(s, "eos id           {eos}");
    let _ = writeln!(s, "tokenizer        {}", r.tokenizer_fingerprint);
    for (i, n) in r.ngrams_per_order.iter().enumerate() {
        let _ = writeln!(s, "{}-grams{:9} {n}", i + 1, "");
    }
    if r.min_count > 1 {
        let _ = writeln!(s, "min count        {}", r.min_count);
    }
    let _ = writeln!(
        s,
        "memory           budget {} MiB, count table {} MiB, {} spilled runs",
        r.memory_budget >> 20,
        r.table_bytes >> 20,
        r.spilled_runs
    );
    let _ = writeln!(s, "threads          {}", r.threads);
    let _ = writeln!(
        s,
        "time             {:.2} s ({:.2} s counting, {:.2} s writing)",
        r.seconds, r.count_seconds, r.write_seconds
    );
    let _ = writeln!(s, "speed            {:.0} tokens/s", r.tokens_per_second);
    let _ = writeln!(s, "output bytes     {}", r.output_bytes);
    s
}
