//! `dart-ngram build`: corpus in, model file out, within a memory budget.
//!
//! Pipeline: one reader thread reads input files in order and cuts them into batches of
//! lines; `threads` worker threads decode and tokenize batches in parallel; the calling thread
//! aggregates: unigram counts in a dense array, orders `2..=N` in an
//! [`ExternalCounter`](crate::extsort::ExternalCounter) that spills sorted runs when its
//! table is full. The final counts stream (merged) into
//! [`dart_ngram::writer::write_model`], which writes atomically.
//!
//! Counting (DESIGN.md section 3): each document's ids, EOS appended, contribute every
//! k-gram (k = 1..N) lying inside it, once per occurrence; nothing spans two documents.
//! Counts depend only on the corpus, never on batching, thread count or spill points, so the
//! output bytes are the same for any `threads` and `memory`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use dart_ngram::error::{NGramError, Result};
use dart_ngram::fingerprint;
use dart_ngram::key;
use dart_ngram::writer::{self, ModelMeta, WriteOptions, WriteProgress};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::bytelevel;
use crate::corpus::{self, Doc, InputFile, InputKind, RawBatch};
use crate::extsort::{self, DuplicatePolicy, ExternalCounter, SortedCounts};
use crate::tokenize::{self, Encoder, EosChoice, LoadedTokenizer};
use crate::write_bar::WriteBar;

/// Bytes of raw input per batch handed to a worker.
const BATCH_BYTES: usize = 1 << 20;

/// Everything `dart-ngram build` takes.
#[derive(Clone, Debug)]
pub struct BuildOptions {
    pub inputs: Vec<PathBuf>,
    pub output: PathBuf,
    /// `tokenizer.json` (or a directory holding one); needed for text input.
    pub tokenizer: Option<PathBuf>,
    pub order: usize,
    /// Memory budget in bytes for the counts (see [`parse_memory`]).
    pub memory: u64,
    /// Worker threads; `None` = all cores.
    pub threads: Option<usize>,
    pub min_count: u64,
    pub text_field: String,
    pub eos: EosChoice,
    /// Vocabulary size; default: the tokenizer's highest id + 1.
    pub vocab_size: Option<u32>,
    /// Where spill runs go; default: beside the output.
    pub tmp_dir: Option<PathBuf>,
    /// Count and report malformed lines instead of failing on the first.
    pub skip_bad_lines: bool,
    /// Write a model even when no document was counted (an empty corpus, or every line
    /// skipped); otherwise that is an error.
    pub allow_empty: bool,
    /// Draw a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Set to stop the build; it then fails with `Interrupted` and leaves nothing behind.
    pub cancel: Option<Arc<AtomicBool>>,
    pub write: WriteOptions,
}

impl BuildOptions {
    pub fn new(inputs: Vec<PathBuf>, output: PathBuf) -> Self {
        BuildOptions {
            inputs,
            output,
            tokenizer: None,
            order: 3,
            memory: 2 << 30,
            threads: None,
            min_count: 1,
            text_field: "text".into(),
            eos: EosChoice::Auto,
            vocab_size: None,
            tmp_dir: None,
            skip_bad_lines: false,
            allow_empty: false,
            progress: false,
            cancel: None,
            write: WriteOptions::default(),
        }
    }
}

/// What a build did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BuildReport {
    pub output: PathBuf,
    pub input_files: usize,
    pub documents: u64,
    /// Tokens counted (EOS included): the order-0 count.
    pub tokens: u64,
    pub order: usize,
    pub vocab_size: u32,
    pub eos_id: Option<u32>,
    pub tokenizer_fingerprint: String,
    pub min_count: u64,
    /// Distinct n-grams stored per order (index 0 = order 1).
    pub ngrams_per_order: Vec<u64>,
    /// Times the count table was spilled to disk.
    pub spilled_runs: u64,
    /// Malformed lines skipped (`skip_bad_lines`), and where the first one was.
    pub skipped_lines: u64,
    pub first_skipped: Option<String>,
    pub memory_budget: u64,
    pub table_bytes: u64,
    pub threads: usize,
    pub count_seconds: f64,
    pub write_seconds: f64,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub output_bytes: u64,
}

/// Parses a memory size: `"2G"`, `"512M"`, `"1.5GiB"`, `"64k"`, `"1000000"` (binary units).
pub fn parse_memory(s: &str) -> Result<u64> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let num_end = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(num_end);
    let mult: u64 = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => u64::MAX,
    };
    let value: Option<f64> = num.parse().ok();
    match value {
        Some(v) if mult != u64::MAX && v.is_finite() && v > 0.0 && v * (mult as f64) < 1.8e19 => {
            Ok((v * mult as f64) as u64)
        }
        _ => Err(NGramError::InvalidArgument(format!(
            "memory size {s:?} is not valid; expected a positive number with an optional unit \
             K, M, G or T (e.g. 2G, 512M)"
        ))),
    }
}

/// The per-batch output of a worker.
struct TokBatch {
    /// Every document's ids (EOS appended), back to back.
    tokens: Vec<u32>,
    /// End offset in `tokens` of each document.
    ends: Vec<usize>,
    skipped: u64,
    first_skipped: Option<String>,
}

enum Msg {
    Batch(TokBatch),
    Failed(NGramError),
}

/// What workers share.
struct WorkerCtx<'a> {
    tokenizer: Option<&'a LoadedTokenizer>,
    text_field: &'a str,
    vocab_size: u32,
    eos: Option<u32>,
    skip_bad_lines: bool,
}

impl WorkerCtx<'_> {
    fn process(&self, batch: &RawBatch, enc: Option<&mut Encoder<'_>>) -> Result<TokBatch> {
        let mut enc = enc;
        let mut out = TokBatch {
            tokens: Vec::with_capacity(batch.data.len() / 3 + 16),
            ends: Vec::with_capacity(batch.ends.len()),
            skipped: 0,
            first_skipped: None,
        };
        for (line_no, line) in batch.lines() {
            let start = out.tokens.len();
            match self.document(&batch.file, line, enc.as_deref_mut(), &mut out.tokens) {
                Ok(true) => {
                    if let Some(eos) = self.eos {
                        out.tokens.push(eos);
                    }
                    out.ends.push(out.tokens.len());
                }
                Ok(false) => {}
                Err(detail) => {
                    out.tokens.truncate(start);
                    let err = NGramError::Input {
                        path: batch.file.path.clone(),
                        line: line_no,
                        detail,
                    };
                    if !self.skip_bad_lines {
                        return Err(err);
                    }
                    out.skipped += 1;
                    out.first_skipped.get_or_insert_with(|| err.to_string());
                }
            }
        }
        Ok(out)
    }

    /// Appends one document's ids; `Ok(false)` for a blank line.
    fn document(
        &self,
        file: &InputFile,
        line: &[u8],
        enc: Option<&mut Encoder<'_>>,
        out: &mut Vec<u32>,
    ) -> std::result::Result<bool, String> {
        let doc = match file.kind {
            InputKind::JsonLines => match corpus::parse_json_line(line, self.text_field) {
                Ok(Some(d)) => d,
                Ok(None) => return Ok(false),
                Err(e) => return Err(e.0),
            },
            InputKind::Text => corpus::parse_text_file(line).map_err(|e| e.0)?,
        };
        match doc {
            Doc::Ids(ids) => {
                for (i, &id) in ids.iter().enumerate() {
                    if id >= u64::from(self.vocab_size) {
                        return Err(format!(
                            "ids[{i}] = {id} is outside the vocabulary; expected ids below {}",
                            self.vocab_size
                        ));
                    }
                    out.push(id as u32);
                }
            }
            Doc::Text(text) => {
                let enc = enc.ok_or_else(|| {
                    "a text document needs a tokenizer; give --tokenizer tokenizer.json \
                     (or use pre-tokenized \"ids\" lines)"
                        .to_string()
                })?;
                enc.encode_into(&text, out).map_err(|e| e.to_string())?;
            }
        }
        Ok(true)
    }
}

/// Counts of a corpus, ready to write: unigrams in memory, higher orders sorted (possibly on
/// disk).
pub struct CorpusCounts {
    pub meta: ModelMeta,
    pub unigrams: Vec<u64>,
    pub sorted: SortedCounts,
    pub skipped_lines: u64,
    pub first_skipped: Option<String>,
    pub input_files: usize,
    pub table_bytes: u64,
    pub threads: usize,
}

struct Progress {
    bar: ProgressBar,
    start: Instant,
}

impl Progress {
    fn new(enabled: bool, total_bytes: u64) -> Self {
        let target = if enabled {
            ProgressDrawTarget::stderr_with_hz(4)
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total_bytes), target);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Progress {
            bar,
            start: Instant::now(),
        }
    }

    fn update(&self, bytes: u64, tokens: u64, docs: u64, spills: u64) {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_position(bytes);
        self.bar.set_message(format!(
            "{docs} docs, {:.2}M tokens, {:.2}M tok/s, {spills} spills",
            tokens as f64 / 1e6,
            tokens as f64 / secs / 1e6
        ));
    }
}

fn resolve_threads(threads: Option<usize>) -> Result<usize> {
    match threads {
        Some(0) => Err(NGramError::InvalidArgument(
            "--threads 0 is not valid; expected at least 1".into(),
        )),
        Some(n) => Ok(n),
        None => Ok(std::thread::available_parallelism().map_or(2, |n| n.get())),
    }
}

/// The directory where temporary runs go: `--tmp-dir`, else the output's directory.
fn tmp_parent(output: &Path, tmp_dir: Option<&Path>) -> PathBuf {
    match tmp_dir {
        Some(d) => d.to_path_buf(),
        None => match output.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        },
    }
}

/// Dense per-token arrays up to this size are allowed whatever the budget (tiny budgets, as
/// tests use, still count).
const DENSE_FLOOR: u64 = 64 << 20;

/// Bytes of the dense per-token array a build or import holds (the unigram counts, u64 per
/// id), checked against the memory budget before it is allocated: a vocabulary inferred from
/// one huge token id must not allocate gigabytes beyond `--memory`.
pub(crate) fn check_vocab_fits(vocab_size: u32, memory: u64) -> Result<u64> {
    let bytes = u64::from(vocab_size) * 8;
    if bytes > memory.max(DENSE_FLOOR) {
        return Err(NGramError::InvalidArgument(format!(
            "a vocabulary of {vocab_size} ids needs {bytes} bytes of unigram counts, more than \
             the memory budget ({memory} bytes): give the real vocabulary (--tokenizer or \
             --vocab-size) or a larger --memory"
        )));
    }
    Ok(bytes)
}

/// Checks the output can be written before spending time counting.
pub(crate) fn check_output(output: &Path) -> Result<()> {
    if output.is_dir() {
        return Err(NGramError::InvalidArgument(format!(
            "{}: the output is a directory; expected a model file path",
            output.display()
        )));
    }
    let parent = tmp_parent(output, None);
    if !parent.is_dir() {
        return Err(NGramError::InvalidArgument(format!(
            "{}: the output's directory {} does not exist",
            output.display(),
            parent.display()
        )));
    }
    Ok(())
}

/// Reads, tokenizes and counts the corpus (everything but writing the model).
pub fn count_corpus(opts: &BuildOptions) -> Result<CorpusCounts> {
    let threads = resolve_threads(opts.threads)?;
    if opts.order < 1 {
        return Err(NGramError::InvalidArgument(
            "--order 0 is not valid; expected 1 or more".into(),
        ));
    }
    if opts.min_count < 1 {
        return Err(NGramError::InvalidArgument(
            "--min-count 0 is not valid; expected 1 or more".into(),
        ));
    }
    let tokenizer = opts
        .tokenizer
        .as_deref()
        .map(LoadedTokenizer::load)
        .transpose()?;
    let vocab_size = match (opts.vocab_size, &tokenizer) {
        (Some(v), Some(t)) if v < t.vocab_size() => {
            return Err(NGramError::InvalidArgument(format!(
                "--vocab-size {v} is smaller than the tokenizer's vocabulary ({} ids in {})",
                t.vocab_size(),
                t.path().display()
            )))
        }
        (Some(0), _) => {
            return Err(NGramError::InvalidArgument(
                "--vocab-size 0 is not valid".into(),
            ))
        }
        (Some(v), _) => v,
        (None, Some(t)) => t.vocab_size(),
        (None, None) => {
            return Err(NGramError::InvalidArgument(
                "no vocabulary size: give --tokenizer tokenizer.json, or --vocab-size N for \
                 pre-tokenized ids"
                    .into(),
            ))
        }
    };
    key::check_order_fits(opts.order, vocab_size)?;
    let eos = tokenize::resolve_eos(&opts.eos, tokenizer.as_ref(), vocab_size)?;
    let files: Vec<Arc<InputFile>> = corpus::collect_inputs(&opts.inputs)?
        .into_iter()
        .map(Arc::new)
        .collect();
    writer::check_not_an_input(
        &opts.output,
        files
            .iter()
            .map(|f| f.path.as_path())
            .chain(tokenizer.as_ref().map(|t| t.path())),
    )?;
    let total_bytes: u64 = files.iter().map(|f| f.bytes).sum();
    let bits = key::token_bits(vocab_size);
    let unigram_bytes = check_vocab_fits(vocab_size, opts.memory)?;
    // The table gets the budget minus the dense unigram array and the batches in flight;
    // never less than half the budget, so tiny budgets still count (the batches are then
    // part of the fixed overhead beside the budget).
    let in_flight = (4 * threads as u64 + 4) * BATCH_BYTES as u64
        + if tokenizer.as_ref().is_some_and(|t| t.has_fast_path()) {
            threads as u64 * bytelevel::CACHE_BYTES as u64
        } else {
            0
        };
    let mut table_bytes = opts
        .memory
        .saturating_sub(unigram_bytes + in_flight)
        .max(opts.memory / 2);
    // A small corpus needs no 2 GiB table (allocating and scanning it costs a second or
    // more). Each token comes from at least one byte of text or of an `ids` line, plus a
    // few special tokens per document, so this bounds the distinct n-grams of uncompressed
    // regular files; a wrong guess would only cause a spill, never a wrong count.
    if files.iter().all(|f| f.regular && !f.gzip) {
        let tokens = 2 * total_bytes + 64 * files.len() as u64;
        let entries = tokens.saturating_mul(opts.order.saturating_sub(1) as u64);
        let needed = entries.saturating_mul(extsort::SLOT_BYTES) / 7 * 10 + (64 << 10);
        table_bytes = table_bytes.min(needed);
    }
    let tmp = tmp_parent(&opts.output, opts.tmp_dir.as_deref());
    let mut counter = ExternalCounter::new(
        table_bytes,
        opts.order.max(2),
        bits,
        DuplicatePolicy::Sum,
        &tmp,
    )?;
    let mut unigrams = vec![0u64; vocab_size as usize];
    let progress = Progress::new(opts.progress, total_bytes);
    let cancel = opts.cancel.as_deref();
    let bytes_read = Arc::new(AtomicU64::new(0));
    let ctx = WorkerCtx {
        tokenizer: tokenizer.as_ref(),
        text_field: &opts.text_field,
        vocab_size,
        eos,
        skip_bad_lines: opts.skip_bad_lines,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("dart-sort-{i}"))
        .build()
        .map_err(|e| NGramError::InvalidArgument(format!("cannot start {threads} threads: {e}")))?;

    let mut totals = Totals::default();
    std::thread::scope(|s| -> Result<()> {
        let (raw_tx, raw_rx) = bounded::<RawBatch>(threads + 1);
        let (tok_tx, tok_rx) = bounded::<Msg>(threads + 1);
        {
            let tok_tx = tok_tx.clone();
            let files = &files;
            let bytes_read = &bytes_read;
            std::thread::Builder::new()
                .name("dart-reader".into())
                .spawn_scoped(s, move || {
                    let res = corpus::read_batches(files, BATCH_BYTES, bytes_read, cancel, |b| {
                        raw_tx.send(b).is_ok()
                    });
                    if let Err(e) = res {
                        let _ = tok_tx.send(Msg::Failed(e));
                    }
                })
                .map_err(|e| {
                    NGramError::InvalidArgument(format!("cannot start the reader thread: {e}"))
                })?;
        }
        for i in 0..threads {
            let (rx, tx): (Receiver<RawBatch>, Sender<Msg>) = (raw_rx.clone(), tok_tx.clone());
            let ctx = &ctx;
            std::thread::Builder::new()
                .name(format!("dart-tokenize-{i}"))
                .spawn_scoped(s, move || {
                    let mut enc = ctx.tokenizer.map(LoadedTokenizer::encoder);
                    for batch in rx {
                        let msg = match ctx.process(&batch, enc.as_mut()) {
                            Ok(b) => Msg::Batch(b),
                            Err(e) => Msg::Failed(e),
                        };
                        if tx.send(msg).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| {
                    NGramError::InvalidArgument(format!("cannot start worker threads: {e}"))
                })?;
        }
        drop((raw_rx, tok_tx));
        // Returning (even early, on error) drops `tok_rx`, which stops workers and reader.
        pool.install(|| {
            aggregate(
                tok_rx,
                &mut counter,
                &mut unigrams,
                opts.order,
                bits,
                cancel,
                &mut totals,
                &progress,
                &bytes_read,
            )
        })
    })?;
    progress.bar.set_message(format!(
        "{} docs, {:.2}M tokens; merging {} spilled runs",
        totals.documents,
        totals.tokens as f64 / 1e6,
        counter.spills()
    ));
    let table_bytes = counter.table_bytes();
    let sorted = pool.install(|| counter.finish(cancel))?;
    progress.bar.finish_and_clear();
    let meta = ModelMeta {
        order: opts.order,
        vocab_size,
        tokenizer_fingerprint: tokenizer
            .as_ref()
            .map_or(fingerprint::UNKNOWN, |t| t.fingerprint()),
        eos_id: eos,
        min_count: opts.min_count,
        total_tokens: totals.tokens,
        documents: totals.documents,
        source: "dart-ngram build".into(),
    };
    Ok(CorpusCounts {
        meta,
        unigrams,
        sorted,
        skipped_lines: totals.skipped,
        first_skipped: totals.first_skipped,
        input_files: files.len(),
        table_bytes,
        threads,
    })
}

#[derive(Default)]
struct Totals {
    documents: u64,
    tokens: u64,
    skipped: u64,
    first_skipped: Option<String>,
}

#[allow(clippy::too_many_arguments)]
fn aggregate(
    rx: Receiver<Msg>,
    counter: &mut ExternalCounter,
    unigrams: &mut [u64],
    order: usize,
    bits: u32,
    cancel: Option<&AtomicBool>,
    totals: &mut Totals,
    progress: &Progress,
    bytes_read: &AtomicU64,
) -> Result<()> {
    let mut last_draw = Instant::now();
    for msg in rx {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(extsort::interrupted());
        }
        let batch = match msg {
            Msg::Batch(b) => b,
            Msg::Failed(e) => return Err(e),
        };
        totals.skipped += batch.skipped;
        if totals.first_skipped.is_none() {
            totals.first_skipped = batch.first_skipped;
        }
        let mut start = 0;
        for &end in &batch.ends {
            let doc = &batch.tokens[start..end];
            start = end;
            count_document(doc, counter, unigrams, order, bits)?;
            totals.documents += 1;
            totals.tokens += doc.len() as u64;
        }
        if last_draw.elapsed() > Duration::from_millis(200) {
            last_draw = Instant::now();
            progress.update(
                bytes_read.load(Ordering::Relaxed),
                totals.tokens,
                totals.documents,
                counter.spills(),
            );
        }
    }
    if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
        return Err(extsort::interrupted());
    }
    progress.update(
        bytes_read.load(Ordering::Relaxed),
        totals.tokens,
        totals.documents,
        counter.spills(),
    );
    Ok(())
}

/// Adds every k-gram (k = 1..=order) lying inside `doc`.
#[inline]
fn count_document(
    doc: &[u32],
    counter: &mut ExternalCounter,
    unigrams: &mut [u64],
    order: usize,
    bits: u32,
) -> Result<()> {
    // The table is probed at random, far beyond the caches: the keys of a block of positions
    // are computed and their slots prefetched first, so that the adds overlap their misses.
    const BLOCK: usize = 16;
    let mut keys: Vec<(usize, u64)> = Vec::with_capacity(BLOCK * order);
    for (b, block) in doc.chunks(BLOCK).enumerate() {
        keys.clear();
        for (j, &t) in block.iter().enumerate() {
            unigrams[t as usize] += 1;
            let i = b * BLOCK + j;
            let mut k = u64::from(t);
            for (n, &next) in (2..=order).zip(&doc[i + 1..]) {
                k = (k << bits) | u64::from(next);
                counter.prefetch(n, k);
                keys.push((n, k));
            }
        }
        for &(n, k) in &keys {
            counter.add(n, k, 1)?;
        }
    }
    Ok(())
}

/// Builds a model: counts the corpus and writes it atomically to `opts.output`.
pub fn build(opts: &BuildOptions) -> Result<BuildReport> {
    let start = Instant::now();
    check_output(&opts.output)?;
    let counts = count_corpus(opts)?;
    if counts.meta.documents == 0 && !opts.allow_empty {
        let why = if counts.skipped_lines > 0 {
            format!(
                "every line was malformed and skipped ({} lines; the first: {})",
                counts.skipped_lines,
                counts.first_skipped.as_deref().unwrap_or("?")
            )
        } else {
            "the corpus holds no document".to_string()
        };
        return Err(NGramError::InvalidArgument(format!(
            "{}: not written: {why}; pass --allow-empty to write an empty model anyway",
            opts.output.display()
        )));
    }
    let count_seconds = start.elapsed().as_secs_f64();
    let write_start = Instant::now();
    let streams = counts.sorted.streams(opts.min_count)?;
    let streams = if opts.order == 1 { Vec::new() } else { streams };
    let mut write = opts.write.clone();
    let bar = opts.progress.then(|| {
        let progress = Arc::new(WriteProgress::default());
        write.progress = Some(progress.clone());
        WriteBar::start(progress, "merging the sorted counts into the model")
    });
    let written = writer::write_model(
        &opts.output,
        &counts.meta,
        &counts.unigrams,
        streams,
        &write,
    );
    drop(bar);
    let written = written?;
    let seconds = start.elapsed().as_secs_f64();
    let m = &counts.meta;
    Ok(BuildReport {
        output: opts.output.clone(),
        input_files: counts.input_files,
        documents: m.documents,
        tokens: m.total_tokens,
        order: m.order,
        vocab_size: m.vocab_size,
        eos_id: m.eos_id,
        tokenizer_fingerprint: fingerprint::to_hex(&m.tokenizer_fingerprint),
        min_count: m.min_count,
        ngrams_per_order: written.ngrams_per_order,
        spilled_runs: counts.sorted.spills(),
        skipped_lines: counts.skipped_lines,
        first_skipped: counts.first_skipped,
        memory_budget: opts.memory,
        table_bytes: counts.table_bytes,
        threads: counts.threads,
        count_seconds,
        write_seconds: write_start.elapsed().as_secs_f64(),
        seconds,
        tokens_per_second: m.total_tokens as f64 / count_seconds.max(1e-9),
        output_bytes: written.bytes,
    })
}

#[cfg(test)]
#[path = "build_tests.rs"]
mod tests;
