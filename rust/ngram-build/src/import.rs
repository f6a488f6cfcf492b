//! `dart-ngram import-dart`: converts the reference's `.trie` file (format in
//! [`crate::reference`]) into a model, with bounded memory.
//!
//! The published file is 43.5 GB (about 1.3e9 nodes), far more than RAM, and nodes may name
//! parents and children anywhere in the file. So:
//!
//! 1. Stream the file once, validating every field, and store each node's
//!    `(token, freq, parent)` in a temporary file mapped into memory and indexed by node id
//!    (16 bytes per node, paged by the OS, not held in RAM). Child lists are checked against
//!    the parent links with an order-independent multiset hash (a second, diagnostic pass
//!    names the first disagreeing entry when the hashes differ).
//! 2. Walk the records in id order; each node's n-gram is rebuilt by following parent links
//!    (at most `order` steps) and fed to the external sorter, which rejects duplicates.
//! 3. Stream the sorted counts into the model writer.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dart_ngram::error::{NGramError, Result};
use dart_ngram::fingerprint;
use dart_ngram::key;
use dart_ngram::writer::{self, ModelMeta, WriteOptions};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use memmap2::MmapMut;
use serde::Serialize;

use crate::extsort::{self, DuplicatePolicy, ExternalCounter};
use crate::reference::{CHILD_BYTES, NODE_HEAD_BYTES};
use crate::tokenize::LoadedTokenizer;

/// Highest order accepted in a header (keys must fit 64 bits anyway).
const MAX_ORDER: u64 = 16;
/// Bytes per node in the temporary record file: token u32, freq u32, parent u64.
const RECORD_BYTES: u64 = 16;

#[derive(Clone, Debug)]
pub struct ImportOptions {
    pub trie: PathBuf,
    pub output: PathBuf,
    /// Vocabulary size; default: the tokenizer's, else the highest token in the file + 1.
    pub vocab_size: Option<u32>,
    /// `tokenizer.json`: gives the fingerprint (and the vocabulary size).
    pub tokenizer: Option<PathBuf>,
    /// End-of-document token to record in the header (the reference file does not say).
    pub eos_id: Option<u32>,
    pub memory: u64,
    pub tmp_dir: Option<PathBuf>,
    pub progress: bool,
    pub cancel: Option<Arc<AtomicBool>>,
    pub write: WriteOptions,
}

impl ImportOptions {
    pub fn new(trie: PathBuf, output: PathBuf) -> Self {
        ImportOptions {
            trie,
            output,
            vocab_size: None,
            tokenizer: None,
            eos_id: None,
            memory: 2 << 30,
            tmp_dir: None,
            progress: false,
            cancel: None,
            write: WriteOptions::default(),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ImportReport {
    pub trie: PathBuf,
    pub output: PathBuf,
    pub nodes: u64,
    pub order: usize,
    pub vocab_size: u32,
    pub total_tokens: u64,
    pub tokenizer_fingerprint: String,
    pub ngrams_per_order: Vec<u64>,
    pub spilled_runs: u64,
    pub seconds: f64,
    pub input_bytes: u64,
    pub output_bytes: u64,
}

/// Order-independent hash of one parent→child link, summed over child lists and over parent
/// links: equal multisets give equal sums.
#[inline]
fn link_hash(parent: u64, token: u32, child: u64) -> u64 {
    let mut x = parent
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(token).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        ^ child.rotate_left(29);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Sequential little-endian reader that reports truncation with the byte offset.
struct Cursor<'p> {
    path: &'p Path,
    input: BufReader<File>,
    pos: u64,
    len: u64,
}

impl<'p> Cursor<'p> {
    fn open(path: &'p Path) -> Result<Self> {
        let f = File::open(path).map_err(|e| NGramError::io(path, e))?;
        let len = f.metadata().map_err(|e| NGramError::io(path, e))?.len();
        Ok(Cursor {
            path,
            input: BufReader::with_capacity(1 << 20, f),
            pos: 0,
            len,
        })
    }

    fn corrupt(&self, detail: String) -> NGramError {
        NGramError::Corrupt {
            path: self.path.to_path_buf(),
            detail,
        }
    }

    fn bytes<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        match self.input.read_exact(&mut b) {
            Ok(()) => {
                self.pos += N as u64;
                Ok(b)
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(self.corrupt(format!(
                "truncated: {} needs bytes {}..{} but the file has {} bytes",
                what(),
                self.pos,
                self.pos + N as u64,
                self.len
            ))),
            Err(e) => Err(NGramError::io(self.path, e)),
        }
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    fn i32(&mut self, what: &dyn Fn() -> String) -> Result<i32> {
        self.bytes::<4>(what).map(i32::from_le_bytes)
    }

    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }
}

/// Allocates `len` bytes of disk for `file` (not a sparse `set_len`): a full disk is then
/// an error here, not a SIGBUS when a page of the mapping is first written.
fn reserve(file: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| std::io::Error::other("file too large"))?;
    if len == 0 {
        return Ok(());
    }
    // SAFETY: a plain syscall on an open descriptor.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        // Filesystems without fallocate: write the zeros, which fails as cleanly when full.
        libc::EOPNOTSUPP => {
            use std::io::{Seek, SeekFrom, Write};
            let mut f = file;
            f.seek(SeekFrom::Start(0))?;
            let zeros = vec![0u8; 1 << 20];
            let mut left = len as u64;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                f.write_all(&zeros[..n])?;
                left -= n as u64;
            }
            f.flush()
        }
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// The mapped record file: `(token u32, freq u32, parent u64)` per node id.
struct Records {
    map: MmapMut,
    _file: tempfile::NamedTempFile,
}

impl Records {
    fn create(dir: &Path, nodes: u64) -> Result<Self> {
        let bytes = nodes.checked_mul(RECORD_BYTES).ok_or_else(|| {
            NGramError::InvalidArgument(format!("{nodes} nodes do not fit a record file"))
        })?;
        dart_ngram::scratch::clean_stale(dir);
        let file = dart_ngram::scratch::tempfile(dir, "import")?;
        reserve(file.as_file(), bytes).map_err(|e| {
            let hint = if e.raw_os_error() == Some(libc::ENOSPC) {
                format!(
                    ": the {nodes} nodes' records need {bytes} bytes in {}; free space or \
                     point the temporary directory elsewhere (--tmp-dir)",
                    dir.display()
                )
            } else {
                String::new()
            };
            NGramError::io(
                file.path(),
                std::io::Error::new(e.kind(), format!("{e}{hint}")),
            )
        })?;
        // SAFETY: the file is a private temporary that nothing else maps or truncates.
        let map = unsafe { MmapMut::map_mut(file.as_file()) }
            .map_err(|e| NGramError::io(file.path(), e))?;
        Ok(Records { map, _file: file })
    }

    #[inline]
    fn set(&mut self, id: u64, token: u32, freq: u32, parent: u64) {
        let o = (id * RECORD_BYTES) as usize;
        let r = &mut self.map[o..o + RECORD_BYTES as usize];
        r[0..4].copy_from_slice(&token.to_le_bytes());
        r[4..8].copy_from_slice(&freq.to_le_bytes());
        r[8..16].copy_from_slice(&parent.to_le_bytes());
    }

    /// `(token, freq, parent)` of node `id` (already range-checked).
    #[inline]
    fn get(&self, id: u64) -> (u32, u32, u64) {
        let o = (id * RECORD_BYTES) as usize;
        let r = &self.map[o..o + RECORD_BYTES as usize];
        (
            u32::from_le_bytes(r[0..4].try_into().expect("4 bytes")),
            u32::from_le_bytes(r[4..8].try_into().expect("4 bytes")),
            u64::from_le_bytes(r[8..16].try_into().expect("8 bytes")),
        )
    }
}

struct Scan {
    order: u64,
    nodes: u64,
    total: u64,
    max_token: Option<(u32, u64)>,
}

fn check_cancel(cancel: Option<&AtomicBool>) -> Result<()> {
    if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
        return Err(extsort::interrupted());
    }
    Ok(())
}

/// Pass 1: validates the file and fills the records.
fn scan(
    path: &Path,
    tmp: &Path,
    bar: &ProgressBar,
    cancel: Option<&AtomicBool>,
) -> Result<(Scan, Records)> {
    let mut cur = Cursor::open(path)?;
    let order = cur.u64(&|| "the header's order".into())?;
    let nodes = cur.u64(&|| "the header's node count".into())?;
    if order == 0 || order > MAX_ORDER {
        return Err(cur.corrupt(format!(
            "header order {order} is not valid; expected 1..={MAX_ORDER}"
        )));
    }
    if nodes == 0 {
        return Err(cur.corrupt("header node count is 0; expected at least the root".into()));
    }
    // Every node takes at least NODE_HEAD_BYTES: a count the file cannot hold is caught
    // before anything is allocated for it.
    let room = cur.remaining() / NODE_HEAD_BYTES;
    if nodes > room {
        return Err(cur.corrupt(format!(
            "header claims {nodes} nodes but the file's {} bytes hold at most {room}; \
             the file is truncated or not a reference trie",
            cur.len
        )));
    }
    let mut rec = Records::create(tmp, nodes)?;
    let mut total = 0u64;
    let mut max_token: Option<(u32, u64)> = None;
    let (mut child_links, mut child_hash, mut parent_hash) = (0u64, 0u64, 0u64);
    for id in 0..nodes {
        if id % (1 << 16) == 0 {
            check_cancel(cancel)?;
            bar.set_position(cur.pos);
        }
        let at = |f: &'static str| move || format!("node {id}'s {f}");
        let token = cur.i32(&at("token"))?;
        let parent = cur.u64(&at("parent"))?;
        let freq = cur.i32(&at("freq"))?;
        let n_children = cur.u64(&at("child count"))?;
        if freq < 0 {
            return Err(NGramError::CountOverflow {
                path: path.to_path_buf(),
                detail: format!(
                    "node {id} has frequency {freq}: the reference's i32 count wrapped \
                     (the true count is above {}); this file cannot be converted exactly",
                    i32::MAX
                ),
            });
        }
        if id == 0 {
            total = freq as u64;
        } else {
            if token < 0 {
                return Err(cur.corrupt(format!(
                    "node {id} has token {token}; expected a token id >= 0"
                )));
            }
            if parent >= nodes || parent == id {
                return Err(cur.corrupt(format!(
                    "node {id} has parent {parent}; expected another node id below {nodes}"
                )));
            }
            if freq == 0 {
                return Err(cur.corrupt(format!("node {id} has frequency 0; expected at least 1")));
            }
            let t = token as u32;
            if max_token.is_none_or(|(m, _)| t > m) {
                max_token = Some((t, id));
            }
            parent_hash = parent_hash.wrapping_add(link_hash(parent, t, id));
        }
        if n_children > cur.remaining() / CHILD_BYTES {
            return Err(cur.corrupt(format!(
                "node {id} claims {n_children} children but only {} bytes remain in the file: \
                 it is truncated or corrupt",
                cur.remaining()
            )));
        }
        for j in 0..n_children {
            let ct = cur.i32(&|| format!("node {id}'s child {j} token"))?;
            let cid = cur.u64(&|| format!("node {id}'s child {j} id"))?;
            if ct < 0 {
                return Err(cur.corrupt(format!(
                    "node {id}'s child {j} has token {ct}; expected >= 0"
                )));
            }
            if cid == 0 || cid >= nodes {
                return Err(cur.corrupt(format!(
                    "node {id}'s child {j} has id {cid}; expected a node id in 1..{nodes}"
                )));
            }
            child_links += 1;
            child_hash = child_hash.wrapping_add(link_hash(id, ct as u32, cid));
        }
        rec.set(id, token as u32, freq as u32, parent);
    }
    if cur.remaining() > 0 {
        return Err(cur.corrupt(format!(
            "{} trailing bytes after the last of {nodes} nodes (byte {} of {})",
            cur.remaining(),
            cur.pos,
            cur.len
        )));
    }
    bar.set_position(cur.pos);
    if child_links != nodes - 1 || child_hash != parent_hash {
        return Err(diagnose_links(path, &rec, nodes, child_links));
    }
    Ok((
        Scan {
            order,
            nodes,
            total,
            max_token,
        },
        rec,
    ))
}

/// Finds the first child entry that disagrees with the node it names (the file was already
/// validated structurally, so this re-read only looks at links).
fn diagnose_links(path: &Path, rec: &Records, nodes: u64, child_links: u64) -> NGramError {
    let inner = || -> Result<NGramError> {
        let mut cur = Cursor::open(path)?;
        cur.u64(&String::new)?;
        cur.u64(&String::new)?;
        // A bitset: this pass may run on files of 1e9+ nodes.
        let mut seen = vec![0u64; nodes.div_ceil(64) as usize];
        let mut mark = |i: u64| {
            let (w, b) = ((i / 64) as usize, 1u64 << (i % 64));
            let was = seen[w] & b != 0;
            seen[w] |= b;
            was
        };
        for id in 0..nodes {
            cur.i32(&String::new)?;
            cur.u64(&String::new)?;
            cur.i32(&String::new)?;
            let n = cur.u64(&String::new)?;
            for _ in 0..n {
                let ct = cur.i32(&String::new)? as u32;
                let cid = cur.u64(&String::new)?;
                let (t, _, p) = rec.get(cid);
                if p != id || t != ct {
                    return Ok(cur.corrupt(format!(
                        "node {id} lists child {cid} with token {ct}, but node {cid} has \
                         parent {p} and token {t}; child lists disagree with parent links"
                    )));
                }
                if mark(cid) {
                    return Ok(cur.corrupt(format!("node {cid} is listed as a child twice")));
                }
            }
        }
        if let Some(orphan) = (1..nodes).find(|&i| !mark(i)) {
            let (_, _, p) = rec.get(orphan);
            return Ok(cur.corrupt(format!(
                "node {orphan} names parent {p} but no child list contains it"
            )));
        }
        Ok(cur.corrupt(format!(
            "{child_links} child entries for {} non-root nodes; child lists disagree with \
             parent links",
            nodes - 1
        )))
    };
    inner().unwrap_or_else(|e| e)
}

/// Imports a reference `.trie` file into a model at `opts.output`.
pub fn import_dart(opts: &ImportOptions) -> Result<ImportReport> {
    let start = Instant::now();
    crate::build::check_output(&opts.output)?;
    let cancel = opts.cancel.as_deref();
    let tokenizer = opts
        .tokenizer
        .as_deref()
        .map(LoadedTokenizer::load)
        .transpose()?;
    writer::check_not_an_input(
        &opts.output,
        std::iter::once(opts.trie.as_path()).chain(tokenizer.as_ref().map(|t| t.path())),
    )?;
    let input_bytes = std::fs::metadata(&opts.trie)
        .map_err(|e| NGramError::io(&opts.trie, e))?
        .len();
    let tmp = match &opts.tmp_dir {
        Some(d) => d.clone(),
        None => match opts.output.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        },
    };
    let bar = ProgressBar::with_draw_target(
        Some(input_bytes),
        if opts.progress {
            ProgressDrawTarget::stderr_with_hz(4)
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("reading nodes");
    let (scan, rec) = scan(&opts.trie, &tmp, &bar, cancel)?;

    let vocab_size = match (opts.vocab_size, &tokenizer) {
        (Some(v), Some(t)) if v < t.vocab_size() => {
            return Err(NGramError::InvalidArgument(format!(
                "--vocab-size {v} is smaller than the tokenizer's vocabulary ({})",
                t.vocab_size()
            )))
        }
        (Some(v), _) => v,
        (None, Some(t)) => t.vocab_size(),
        (None, None) => scan.max_token.map_or(1, |(t, _)| t + 1),
    };
    if let Some((t, id)) = scan.max_token {
        if t >= vocab_size {
            return Err(NGramError::Corrupt {
                path: opts.trie.clone(),
                detail: format!(
                    "node {id} has token {t}, outside the vocabulary (size {vocab_size})"
                ),
            });
        }
    }
    if let Some(eos) = opts.eos_id {
        if eos >= vocab_size {
            return Err(NGramError::InvalidArgument(format!(
                "--eos-id {eos} is outside the vocabulary (size {vocab_size})"
            )));
        }
    }
    let order = scan.order as usize;
    key::check_order_fits(order, vocab_size)?;
    let bits = key::token_bits(vocab_size);
    let unigram_bytes = crate::build::check_vocab_fits(vocab_size, opts.memory)?;
    let mut counter = ExternalCounter::new(
        opts.memory
            .saturating_sub(unigram_bytes)
            .max(opts.memory / 2),
        order.max(2),
        bits,
        DuplicatePolicy::Reject,
        &tmp,
    )?
    .duplicates_name(&opts.trie);
    let mut unigrams = vec![0u64; vocab_size as usize];
    let corrupt = |detail: String| NGramError::Corrupt {
        path: opts.trie.clone(),
        detail,
    };
    if scan.total == 0 {
        // An empty model would leave every draft unguided, silently.
        return Err(NGramError::InvalidArgument(format!(
            "{} holds no n-gram (its root counts 0 tokens): nothing to import",
            opts.trie.display()
        )));
    }
    bar.set_length(scan.nodes);
    bar.set_position(0);
    bar.set_message("sorting n-grams");
    let mut tokens = Vec::with_capacity(order);
    for id in 1..scan.nodes {
        if id % (1 << 16) == 0 {
            check_cancel(cancel)?;
            bar.set_position(id);
        }
        let (token, freq, parent) = rec.get(id);
        let parent_freq = if parent == 0 {
            scan.total
        } else {
            u64::from(rec.get(parent).1)
        };
        if u64::from(freq) > parent_freq {
            return Err(corrupt(format!(
                "node {id} has frequency {freq}, above its parent {parent}'s {parent_freq}; \
                 expected an n-gram to occur at most as often as its prefix"
            )));
        }
        tokens.clear();
        tokens.push(token);
        let mut p = parent;
        while p != 0 {
            if tokens.len() as u64 >= scan.order {
                return Err(corrupt(format!(
                    "node {id} lies deeper than the header's order {} (or its parent links loop)",
                    scan.order
                )));
            }
            let (t, _, pp) = rec.get(p);
            tokens.push(t);
            p = pp;
        }
        tokens.reverse();
        if tokens.len() == 1 {
            let slot = &mut unigrams[token as usize];
            if *slot != 0 {
                return Err(corrupt(format!("node {id} repeats the 1-gram [{token}]")));
            }
            *slot = u64::from(freq);
        } else {
            counter.add(tokens.len(), key::pack(&tokens, bits), u64::from(freq))?;
        }
    }
    drop(rec);
    let unigram_sum = unigrams.iter().try_fold(0u64, |a, &c| a.checked_add(c));
    if unigram_sum.is_none_or(|s| s > scan.total) {
        return Err(corrupt(format!(
            "the 1-gram frequencies sum to {}, more than the root's total of {} tokens",
            unigram_sum.map_or("over 2^64".into(), |s| s.to_string()),
            scan.total
        )));
    }
    bar.set_message("merging runs and writing the model");
    let sorted = counter.finish(cancel)?;
    let meta = ModelMeta {
        order,
        vocab_size,
        tokenizer_fingerprint: tokenizer
            .as_ref()
            .map_or(fingerprint::UNKNOWN, |t| t.fingerprint()),
        eos_id: opts.eos_id,
        min_count: 1,
        total_tokens: scan.total,
        documents: 0,
        source: "dart-ngram import-dart".into(),
    };
    let streams = if order == 1 {
        Vec::new()
    } else {
        sorted.streams(1)?
    };
    let written = writer::write_model(&opts.output, &meta, &unigrams, streams, &opts.write)?;
    bar.finish_and_clear();
    Ok(ImportReport {
        trie: opts.trie.clone(),
        output: opts.output.clone(),
        nodes: scan.nodes,
        order,
        vocab_size,
        total_tokens: scan.total,
        tokenizer_fingerprint: fingerprint::to_hex(&meta.tokenizer_fingerprint),
        ngrams_per_order: written.ngrams_per_order,
        spilled_runs: sorted.spills(),
        seconds: start.elapsed().as_secs_f64(),
        input_bytes,
        output_bytes: written.bytes,
    })
}

#[cfg(test)]
#[path = "import_tests.rs"]
mod tests;
