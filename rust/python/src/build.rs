//! Python binding of `dart_ngram_build`: building models, importing reference tries, writing
//! small reference tries (for tests) and tokenizer fingerprints.
//!
//! Long jobs run on a Rust thread with the GIL released; the calling thread wakes every
//! 100 ms to let Python handle signals, so Ctrl-C cancels the job (temporary files removed,
//! no output written) and raises `KeyboardInterrupt`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use dart_ngram::fingerprint;
use dart_ngram_build::tokenize::LoadedTokenizer;
use dart_ngram_build::{reference, BuildOptions, EosChoice, ImportOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{to_py, NGramError};

fn json_to_py(py: Python<'_>, v: &impl serde::Serialize) -> PyResult<Py<PyAny>> {
    let s = serde_json::to_string(v).map_err(|e| NGramError::new_err(e.to_string()))?;
    Ok(py.import("json")?.call_method1("loads", (s,))?.unbind())
}

/// A memory size given as bytes (int) or a string like "2G".
fn memory_arg(v: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = v.extract::<u64>() {
        if n == 0 {
            return Err(NGramError::new_err(
                "memory 0 is not valid; expected a positive size",
            ));
        }
        return Ok(n);
    }
    match v.extract::<String>() {
        Ok(s) => dart_ngram_build::parse_memory(&s).map_err(to_py),
        Err(_) => Err(NGramError::new_err(format!(
            "memory {v} is not valid; expected a byte count or a size string like \"2G\""
        ))),
    }
}

/// Runs `job` on its own thread without the GIL; a pending Python signal (Ctrl-C) sets
/// `cancel`, waits for the job to wind down, and re-raises the signal's exception.
fn run_interruptible<T: Send + 'static>(
    py: Python<'_>,
    cancel: Arc<AtomicBool>,
    job: impl FnOnce() -> dart_ngram::Result<T> + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("dart-build".into())
        .spawn(move || {
            let _ = tx.send(job());
        })
        .map_err(|e| NGramError::new_err(format!("cannot start the build thread: {e}")))?;
    let mut rx = Some(rx);
    loop {
        // The receiver moves in and out of the GIL-free closure (it is Send, not Sync).
        let (res, back) = py.detach(move || {
            let rx = rx.take().expect("receiver present");
            (rx.recv_timeout(Duration::from_millis(100)), rx)
        });
        rx = Some(back);
        match res {
            Ok(res) => {
                let _ = py.detach(move || handle.join());
                return res.map_err(to_py);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(signal) = py.check_signals() {
                    cancel.store(true, Ordering::SeqCst);
                    let _ = py.detach(move || handle.join());
                    return Err(signal);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = py.detach(move || handle.join());
                return Err(NGramError::new_err(
                    "the build thread stopped without a result (it panicked)",
                ));
            }
        }
    }
}

/// Builds a model from corpus files; returns the build report as a dict.
#[pyfunction]
#[pyo3(signature = (
    inputs, output, *, tokenizer=None, order=3, memory=None, threads=None, min_count=1,
    text_field=String::from("text"), eos_id=None, eos_token=None, no_eos=false, vocab_size=None,
    tmp_dir=None, skip_bad_lines=false, allow_empty=false, progress=false
))]
#[allow(clippy::too_many_arguments)]
fn build(
    py: Python<'_>,
    inputs: Vec<PathBuf>,
    output: PathBuf,
    tokenizer: Option<PathBuf>,
    order: usize,
    memory: Option<&Bound<'_, PyAny>>,
    threads: Option<usize>,
    min_count: u64,
    text_field: String,
    eos_id: Option<u32>,
    eos_token: Option<String>,
    no_eos: bool,
    vocab_size: Option<u32>,
    tmp_dir: Option<PathBuf>,
    skip_bad_lines: bool,
    allow_empty: bool,
    progress: bool,
) -> PyResult<Py<PyAny>> {
    let mut o = BuildOptions::new(inputs, output);
    o.tokenizer = tokenizer;
    o.order = order;
    if let Some(m) = memory {
        o.memory = memory_arg(m)?;
    }
    o.threads = threads;
    o.min_count = min_count;
    o.text_field = text_field;
    o.eos = match (eos_id, eos_token, no_eos) {
        (Some(_), _, true) | (_, Some(_), true) | (Some(_), Some(_), _) => {
            return Err(NGramError::new_err(
                "give at most one of eos_id, eos_token and no_eos",
            ))
        }
        (_, _, true) => EosChoice::NoEos,
        (Some(id), None, false) => EosChoice::Id(id),
        (None, Some(t), false) => EosChoice::Token(t),
        (None, None, false) => EosChoice::Auto,
    };
    o.vocab_size = vocab_size;
    o.tmp_dir = tmp_dir;
    o.skip_bad_lines = skip_bad_lines;
    o.allow_empty = allow_empty;
    o.progress = progress;
    let cancel = Arc::new(AtomicBool::new(false));
    o.cancel = Some(cancel.clone());
    let report = run_interruptible(py, cancel, move || dart_ngram_build::build(&o))?;
    json_to_py(py, &report)
}

/// Converts a reference `.trie` file into a model; returns the import report as a dict.
#[pyfunction]
#[pyo3(signature = (
    trie, output, *, vocab_size=None, tokenizer=None, eos_id=None, memory=None, tmp_dir=None,
    progress=false
))]
#[allow(clippy::too_many_arguments)]
fn import_dart(
    py: Python<'_>,
    trie: PathBuf,
    output: PathBuf,
    vocab_size: Option<u32>,
    tokenizer: Option<PathBuf>,
    eos_id: Option<u32>,
    memory: Option<&Bound<'_, PyAny>>,
    tmp_dir: Option<PathBuf>,
    progress: bool,
) -> PyResult<Py<PyAny>> {
    let mut o = ImportOptions::new(trie, output);
    o.vocab_size = vocab_size;
    o.tokenizer = tokenizer;
    o.eos_id = eos_id;
    if let Some(m) = memory {
        o.memory = memory_arg(m)?;
    }
    o.tmp_dir = tmp_dir;
    o.progress = progress;
    let cancel = Arc::new(AtomicBool::new(false));
    o.cancel = Some(cancel.clone());
    let report = run_interruptible(py, cancel, move || dart_ngram_build::import_dart(&o))?;
    json_to_py(py, &report)
}

/// Writes a reference-format `.trie` file holding `counts` (n-gram tuple -> count, every
/// order 1..=order, prefix-closed), for tests of the importer.
#[pyfunction]
#[pyo3(signature = (path, counts, total_tokens, order, *, shuffle_seed=None))]
fn write_reference_trie(
    py: Python<'_>,
    path: PathBuf,
    counts: &Bound<'_, PyDict>,
    total_tokens: u64,
    order: u64,
    shuffle_seed: Option<u64>,
) -> PyResult<()> {
    let mut map = BTreeMap::new();
    for (k, v) in counts.iter() {
        let ngram: Vec<u32> = k.extract().map_err(|_| {
            NGramError::new_err(format!(
                "n-gram key {k} is not valid; expected a tuple of non-negative token ids"
            ))
        })?;
        let c: u64 = v.extract().map_err(|_| {
            NGramError::new_err(format!(
                "count {v} of {ngram:?} is not a non-negative integer"
            ))
        })?;
        map.insert(ngram, c);
    }
    py.detach(|| reference::write_reference_trie(&path, order, total_tokens, &map, shuffle_seed))
        .map_err(to_py)
}

/// Fingerprint (hex) of a vocabulary given as token strings by id.
#[pyfunction]
fn tokenizer_fingerprint(tokens_by_id: Vec<String>) -> String {
    fingerprint::to_hex(&fingerprint::fingerprint_from_vocab(
        tokens_by_id.iter().map(String::as_str),
    ))
}

/// Fingerprint (hex) of a `tokenizer.json` (or a directory holding one).
#[pyfunction]
fn tokenizer_json_fingerprint(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let tok = py.detach(|| LoadedTokenizer::load(&path)).map_err(to_py)?;
    Ok(fingerprint::to_hex(&tok.fingerprint()))
}

/// Bytes in a memory size string such as "2G" or "512M".
#[pyfunction]
fn parse_memory(size: &str) -> PyResult<u64> {
    dart_ngram_build::parse_memory(size).map_err(to_py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(build, m)?)?;
    m.add_function(wrap_pyfunction!(import_dart, m)?)?;
    m.add_function(wrap_pyfunction!(write_reference_trie, m)?)?;
    m.add_function(wrap_pyfunction!(tokenizer_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(tokenizer_json_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(parse_memory, m)?)?;
    Ok(())
}
