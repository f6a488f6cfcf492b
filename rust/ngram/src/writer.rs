//! The one place that lays out the on-disk format (see `docs/ngram-format.md`).
//!
//! Producers (build, merge, import) stream, for each order 2..=N, `(key, count)` pairs sorted
//! strictly ascending by key (keys packed by [`crate::key::pack`] with
//! [`crate::key::token_bits`] of the vocabulary), together with the dense unigram counts.
//! The writer checks what it is given (sorted, prefix-closed, counts never above their
//! prefix's count), writes to a temporary file beside the output, syncs it and renames it into
//! place, so an interrupted or failed write never leaves a half-written file under the final
//! name.
//!
//! Memory stays bounded whatever the model size: each order is spooled to an anonymous
//! temporary file beside the output (a few bytes per n-gram: the key's increase and the count
//! as varints, [`varint::encode_pair`]) and re-read sequentially to pack the
//! columns (the child buckets in a second pass, once every order's token keys are known); only
//! the per-order table of distinct counts, the per-token key counts and one context's children
//! are held in RAM.
//!
//! A producer may hand the n-grams over split by first token ([`write_model_in_ranges`]): the
//! ranges are spooled on a thread pool, each order's ranges put together in key order, and the
//! sections written by passes on the same pool; the bytes are the same as from one stream.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::Xxh3;

use crate::bits::{
    best_code_width, code_of, escape_code, escape_width, width_for, CodedWriter, PackedWriter,
};
use crate::error::{NGramError, Result};
use crate::format::{
    BucketSlice, Header, OrderRecord, Section, SectionKind, DEFAULT_BUCKET_STRIDE,
    MAX_BUCKET_WIDTH, MAX_SOURCE, MIN_VERSION, NO_EOS, VERSION,
};
use crate::key;
use crate::varint;

/// What a model says about itself in its header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelMeta {
    /// Highest n-gram order stored (1..=N).
    pub order: usize,
    /// Token ids are `< vocab_size`.
    pub vocab_size: u32,
    /// Fingerprint of the tokenizer the counts were made with; all zeros when unknown
    /// (pre-tokenized input without a tokenizer).
    pub tokenizer_fingerprint: [u8; 32],
    /// The end-of-document token appended to every document, if any.
    pub eos_id: Option<u32>,
    /// n-grams of order >= 2 seen fewer times than this were dropped (1 = none dropped).
    pub min_count: u64,
    /// Number of tokens counted (the order-0 count; EOS tokens included).
    pub total_tokens: u64,
    /// Number of documents counted.
    pub documents: u64,
    /// Free-text provenance, e.g. `"dart-ngram build"`, `"dart-ngram merge"`.
    pub source: String,
}

/// A stream of `(key, count)` pairs of one order, sorted strictly ascending by key.
pub type CountStream<'a> = Box<dyn Iterator<Item = Result<(u64, u64)>> + Send + 'a>;

/// Tuning of the written file.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Contexts with more children than this get a precomputed list of their `top_list_len`
    /// most frequent continuations (smaller contexts are sorted at query time).
    pub top_list_len: u32,
    /// Counters the write keeps up to date for a progress display.
    pub progress: Option<Arc<WriteProgress>>,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            top_list_len: 32,
            progress: None,
        }
    }
}

/// Counters another thread polls to show a long write's progress (`dart-ngram merge`'s bar):
/// the producer's input consumed, then the model's bytes written. Only a display reads them,
/// so they are updated a chunk or a buffer at a time, with relaxed atomics.
#[derive(Debug, Default)]
pub struct WriteProgress {
    /// Items of the producer's input consumed (a merge: its inputs' n-grams of orders >= 2),
    /// of `input_total` (0: not counted).
    pub input_done: AtomicU64,
    pub input_total: AtomicU64,
    /// Bytes of the model written, of `output_total` (0 until the sections are laid out).
    pub output_done: AtomicU64,
    pub output_total: AtomicU64,
}

/// What was written.
#[derive(Clone, Debug, Default)]
pub struct WriteReport {
    /// Distinct n-grams stored per order, index 0 = order 1 (unigrams with a non-zero count).
    pub ngrams_per_order: Vec<u64>,
    pub bytes: u64,
}

const BUF: usize = 1 << 20;
/// Buffer of each spooled file: small enough to stay in the CPU's cache between its records
/// and the kernel's copy (with 1 MiB buffers a merge spent twice the system time).
const SPOOL_BUF: usize = 1 << 16;

/// Refuses an `output` that is one of `inputs` (the same file, also through another path, a
/// symbolic link or a hard link): writing the model would replace what is being read.
pub fn check_not_an_input<'a>(
    output: &Path,
    inputs: impl IntoIterator<Item = &'a Path>,
) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(out) = std::fs::metadata(output) else {
        return Ok(()); // a new file is nobody's input
    };
    for p in inputs {
        if let Ok(m) = std::fs::metadata(p) {
            if m.dev() == out.dev() && m.ino() == out.ino() {
                return Err(NGramError::InvalidArgument(format!(
                    "{}: the output is the input {} (the same file); writing it would destroy \
                     the input, choose another output path",
                    output.display(),
                    p.display()
                )));
            }
        }
    }
    Ok(())
}

/// Writes a model to `path` atomically (temporary file + fsync + rename).
///
/// `unigrams` has `meta.vocab_size` entries; `higher[i]` holds the n-grams of order `i + 2`.
pub fn write_model(
    path: &Path,
    meta: &ModelMeta,
    unigrams: &[u64],
    higher: Vec<CountStream<'_>>,
    opts: &WriteOptions,
) -> Result<WriteReport> {
    write_model_with_stride(path, meta, unigrams, higher, opts, DEFAULT_BUCKET_STRIDE)
}

/// [`write_model`] with `bucket_stride` children per child-bucket entry; 0 writes no buckets
/// (a version-1 file). Kept out of [`WriteOptions`] so its struct literals stay valid.
pub(crate) fn write_model_with_stride(
    path: &Path,
    meta: &ModelMeta,
    unigrams: &[u64],
    higher: Vec<CountStream<'_>>,
    opts: &WriteOptions,
    bucket_stride: u32,
) -> Result<WriteReport> {
    let layout = Layout {
        version: if bucket_stride == 0 {
            MIN_VERSION
        } else {
            VERSION
        },
        bucket_stride,
        code_width: None,
    };
    write_model_as(path, meta, unigrams, higher, opts, &layout)
}

/// The format a file is written in; tests write older versions, and force code widths to
/// reach the escapes in small models.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    /// 1 (no buckets: `bucket_stride` 0), 2 (count ranks at a fixed width) or 3 (count codes).
    pub version: u32,
    pub bucket_stride: u32,
    /// Version 3: this code width for every order instead of the smallest file's.
    pub code_width: Option<u32>,
}

/// [`write_model`] in the given layout.
pub(crate) fn write_model_as(
    path: &Path,
    meta: &ModelMeta,
    unigrams: &[u64],
    higher: Vec<CountStream<'_>>,
    opts: &WriteOptions,
    layout: &Layout,
) -> Result<WriteReport> {
    let whole = vec![KeyRange {
        first: 0..meta.vocab_size,
        streams: higher,
    }];
    write_model_ranges(path, meta, unigrams, whole, opts, layout, 1)
}

/// The n-grams of orders 2..=N whose first token is in `first`: `streams[i]` holds order
/// `i + 2`'s, sorted as [`write_model`] wants them.
pub struct KeyRange<'a> {
    pub first: std::ops::Range<u32>,
    pub streams: Vec<CountStream<'a>>,
}

/// [`write_model`] from the n-grams split by first token into `ranges` (ascending, together
/// covering the vocabulary), spooled on up to `threads` threads at once. The file is the
/// same bytes however the vocabulary is split and whatever the number of threads.
pub fn write_model_in_ranges(
    path: &Path,
    meta: &ModelMeta,
    unigrams: &[u64],
    ranges: Vec<KeyRange<'_>>,
    opts: &WriteOptions,
    threads: usize,
) -> Result<WriteReport> {
    let layout = Layout {
        version: VERSION,
        bucket_stride: DEFAULT_BUCKET_STRIDE,
        code_width: None,
    };
    write_model_ranges(path, meta, unigrams, ranges, opts, &layout, threads)
}

fn write_model_ranges(
    path: &Path,
    meta: &ModelMeta,
    unigrams: &[u64],
    ranges: Vec<KeyRange<'_>>,
    opts: &WriteOptions,
    layout: &Layout,
    threads: usize,
) -> Result<WriteReport> {
    let Layout {
        version,
        bucket_stride,
        code_width,
    } = *layout;
    let bad = |detail: String| {
        NGramError::InvalidArgument(format!("writing {}: {detail}", path.display()))
    };
    key::check_order_fits(meta.order, meta.vocab_size).map_err(|e| bad(e.to_string()))?;
    if !(MIN_VERSION..=VERSION).contains(&version)
        || (version == MIN_VERSION) != (bucket_stride == 0)
    {
        return Err(bad(format!(
            "format version {version} with bucket stride {bucket_stride} (version 1 has no \
             buckets, versions 2 and 3 need them)"
        )));
    }
    let mut next_first = 0;
    for r in &ranges {
        if r.streams.len() + 1 != meta.order {
            return Err(bad(format!(
                "order {} needs {} streams of orders 2..={}, got {}",
                meta.order,
                meta.order - 1,
                meta.order,
                r.streams.len()
            )));
        }
        if r.first.start != next_first || r.first.end < r.first.start {
            return Err(bad(format!(
                "first-token range {:?} does not follow {next_first}",
                r.first
            )));
        }
        next_first = r.first.end;
    }
    if next_first != meta.vocab_size {
        return Err(bad(format!(
            "first-token ranges end at {next_first}, not at the vocabulary's {}",
            meta.vocab_size
        )));
    }
    if unigrams.len() != meta.vocab_size as usize {
        return Err(bad(format!(
            "{} unigram counts, expected one per token of the {}-token vocabulary",
            unigrams.len(),
            meta.vocab_size
        )));
    }
    if let Some(eos) = meta.eos_id {
        if eos >= meta.vocab_size || eos == NO_EOS {
            return Err(bad(format!(
                "eos id {eos} outside the vocabulary of {}",
                meta.vocab_size
            )));
        }
    }
    if meta.min_count == 0 {
        return Err(bad("min_count 0; use 1 for 'nothing dropped'".into()));
    }
    if opts.top_list_len == 0 {
        return Err(bad("top_list_len 0; it must be at least 1".into()));
    }
    let mut sum = 0u64;
    for &c in unigrams {
        sum = sum
            .checked_add(c)
            .ok_or_else(|| bad("the unigram counts overflow 64 bits".into()))?;
    }
    if sum > meta.total_tokens {
        return Err(bad(format!(
            "unigram counts sum to {sum}, more than the {} total tokens",
            meta.total_tokens
        )));
    }

    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let io = |e: io::Error| NGramError::io(path, e);
    let mut spool = Spool {
        path,
        dir: &dir,
        bits: key::token_bits(meta.vocab_size),
        vocab_size: meta.vocab_size,
        min_count: meta.min_count,
        top_list_len: opts.top_list_len as usize,
        bucket_stride,
        levels: Vec::new(),
        unigrams,
        last_tokens: Vec::new(),
    };
    let pool = if threads > 1 {
        Some(
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .map_err(|e| NGramError::InvalidArgument(format!("thread pool: {e}")))?,
        )
    } else {
        None
    };
    spool.spool_ranges(ranges, meta.order, pool.as_ref())?;

    // Per-order records and the section layout.
    let n_max = meta.order;
    let mut orders = Vec::with_capacity(n_max);
    let max_uni = unigrams.iter().copied().max().unwrap_or(0);
    for n in 1..=n_max {
        let ngrams = if n == 1 {
            unigrams.iter().filter(|&&c| c > 0).count() as u64
        } else {
            spool.levels[n - 2].entries
        };
        let (count_values, count_width, count_escapes) = if n == 1 {
            (0, width_for(max_uni), 0)
        } else {
            let level = &spool.levels[n - 2];
            let t = level.table.len() as u64;
            if version >= VERSION {
                let (w, escapes) = match code_width {
                    Some(w) => (w, level.freq.iter().skip(escape_code(w) as usize).sum()),
                    None => best_code_width(&level.freq),
                };
                (t, w, escapes)
            } else {
                (t, width_for(t.saturating_sub(1)), 0)
            }
        };
        let (child_width, top_contexts, top_rel_width, bucket_width) = if n < n_max {
            let child = &spool.levels[n - 1];
            let tw = if child.top_contexts > 0 {
                width_for(child.max_listed_children - 1)
            } else {
                0
            };
            let bw = if bucket_stride > 0 {
                width_for(child.max_bucketed_children)
            } else {
                0
            };
            if bw > MAX_BUCKET_WIDTH {
                return Err(bad(format!(
                    "an order-{n} context has {} children, more than a child-bucket entry holds",
                    child.max_bucketed_children
                )));
            }
            (width_for(child.entries), child.top_contexts, tw, bw)
        } else {
            (0, 0, 0, 0)
        };
        orders.push(OrderRecord {
            ngrams,
            count_values,
            top_contexts,
            count_width,
            child_width,
            top_rel_width,
            bucket_width,
            count_escapes,
        });
    }
    let mut source = meta.source.clone();
    if source.len() > MAX_SOURCE {
        let mut cut = MAX_SOURCE;
        while !source.is_char_boundary(cut) {
            cut -= 1;
        }
        source.truncate(cut);
    }
    let mut header = Header {
        version,
        header_len: 0,
        order: n_max as u32,
        vocab_size: meta.vocab_size,
        token_bits: key::token_bits(meta.vocab_size),
        eos: meta.eos_id.unwrap_or(NO_EOS),
        fingerprint: meta.tokenizer_fingerprint,
        min_count: meta.min_count,
        total_tokens: meta.total_tokens,
        documents: meta.documents,
        top_list_len: opts.top_list_len,
        bucket_stride,
        orders,
        sections: Vec::new(),
        source,
    };
    let layout = header
        .expected_sections()
        .ok_or_else(|| bad("section sizes overflow 64 bits".into()))?;
    header.header_len = Header::byte_len(version, n_max, layout.len(), header.source.len()) as u32;

    crate::scratch::clean_stale(&dir);
    let tmp = crate::scratch::tempfile(&dir, "write")?;
    let mut file = tmp.as_file().try_clone().map_err(io)?;
    // Every section's place is known, so the columns read from one spooled order (its tokens
    // and counts, its parents' child buckets) are written in one pass over it, each at its
    // own offset.
    let mut starts = Vec::with_capacity(layout.len());
    let mut offset = u64::from(header.header_len);
    for &(_, _, len) in &layout {
        starts.push(offset);
        offset += len;
    }
    let written_bytes = opts.progress.as_deref().map(|p| {
        p.output_total.store(offset, Ordering::Relaxed);
        p.output_done
            .store(u64::from(header.header_len), Ordering::Relaxed);
        &p.output_done
    });
    // The passes: a section alone, or the columns of order n read from its spool in one
    // pass (its column groups packed on threads of their own when the write has several).
    let mut passes: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut planned = vec![false; layout.len()];
    for i in 0..layout.len() {
        if planned[i] {
            continue;
        }
        let (kind, order, _) = layout[i];
        let n = match kind {
            SectionKind::ChildBuckets => order as usize + 1,
            k if Spool::is_column(k) => order as usize,
            _ => {
                planned[i] = true;
                passes.push((0, vec![i]));
                continue;
            }
        };
        let mut columns = Vec::new();
        for (j, &(k, o, _)) in layout.iter().enumerate() {
            let ours = match k {
                SectionKind::ChildBuckets => o as usize + 1 == n,
                k if Spool::is_column(k) => o as usize == n,
                _ => false,
            };
            if ours {
                planned[j] = true;
                columns.push(j);
            }
        }
        passes.push((n, columns));
    }
    let run = |(n, sections): &(usize, Vec<usize>)| -> Result<Vec<(usize, (u64, u64))>> {
        let mut writers: Vec<(usize, SectionKind, SectionWriter<'_>)> = sections
            .iter()
            .map(|&j| {
                let w = SectionWriter::new(&file, starts[j], written_bytes);
                (j, layout[j].0, w)
            })
            .collect();
        if *n == 0 {
            let (_, kind, w) = &mut writers[0];
            spool.write_section(w, *kind, layout[sections[0]].1 as usize, &header)?;
        } else {
            spool.write_columns(*n, &header, &mut writers, threads > 1)?;
        }
        writers
            .into_iter()
            .map(|(j, _, w)| Ok((j, w.finish().map_err(io)?)))
            .collect()
    };
    let written: Vec<Vec<(usize, (u64, u64))>> = match &pool {
        None => passes.iter().map(run).collect::<Result<_>>()?,
        Some(pool) => {
            use rayon::prelude::*;
            pool.install(|| passes.par_iter().map(run).collect::<Result<_>>())?
        }
    };
    let mut done: Vec<Option<(u64, u64)>> = vec![None; layout.len()];
    for (j, d) in written.into_iter().flatten() {
        done[j] = Some(d);
    }
    for (i, &(kind, order, len)) in layout.iter().enumerate() {
        let (checksum, written) = done[i].expect("every section written");
        if written != len {
            return Err(NGramError::Corrupt {
                path: path.to_path_buf(),
                detail: format!(
                    "internal: section {} of order {order} came out {written} bytes, expected {len}",
                    kind.name()
                ),
            });
        }
        header.sections.push(Section {
            kind,
            order,
            offset: starts[i],
            length: len,
            checksum,
        });
    }
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    file.write_all(&header.to_bytes()).map_err(io)?;
    // Temporary files are created 0600; a model is meant to be shared (daemon, other users).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(io)?;
    }
    file.sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    // Make the rename itself durable.
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(WriteReport {
        ngrams_per_order: header.orders.iter().map(|r| r.ngrams).collect(),
        bytes: offset,
    })
}

/// n-grams ending in each token id, of one range: 32-bit counters (half the cache lines of
/// 64-bit ones: the increment at a random id was the spool's costliest step), each wrap
/// noted apart.
struct LastTokens {
    low: Vec<u32>,
    wraps: Vec<u32>,
}

impl LastTokens {
    fn new(vocab: usize) -> Self {
        LastTokens {
            low: vec![0; vocab],
            wraps: Vec::new(),
        }
    }

    #[inline(always)]
    fn add(&mut self, t: usize) {
        let c = &mut self.low[t];
        *c = c.wrapping_add(1);
        if *c == 0 {
            self.wraps.push(t as u32);
        }
    }

    fn add_to(&self, sums: &mut [u64]) {
        for (a, &b) in sums.iter_mut().zip(&self.low) {
            *a += u64::from(b);
        }
        for &t in &self.wraps {
            sums[t as usize] += 1 << 32;
        }
    }
}

/// One spooled order n >= 2, plus what its parents (order n-1) learned from it.
struct Level {
    entries: u64,
    /// The order's n-grams by first-token range, in key order.
    parts: Vec<Part>,
    /// Distinct counts, ascending.
    table: Vec<u64>,
    /// n-grams with each count of `table` (the frequency of each rank).
    freq: Vec<u64>,
    /// Parents with a top list.
    top_contexts: u64,
    max_listed_children: u64,
    /// Most children of a parent that has child-bucket entries (bounds their values).
    max_bucketed_children: u64,
}

/// One first-token range of a spooled order n >= 2. Its parents are the range's entries of
/// order n-1; offsets and parent ids in its files count from the range's first ones.
struct Part {
    /// Parents (entries of order n-1) and n-grams in the range.
    parents: u64,
    entries: u64,
    /// `(key, count)` pairs, each key after the previous one ([`varint::encode_pair`]).
    raw: File,
    /// Each parent's number of children, in order, as varints (the CSR offsets of the parents
    /// into this order are their running sums).
    parent_offsets: File,
    /// Parent ids with a top list (u64 each) and their lists (`top_list_len` u64 each).
    top_contexts: u64,
    top_ids: File,
    top_lists: File,
}

/// What spooling one range of one order found, before the ranges are put together.
struct PartOut {
    part: Part,
    /// `(count, n-grams with it)`, ascending by count.
    counts: Vec<(u64, u64)>,
    max_listed: u64,
    /// Most children of a parent with at least `bucket_stride` of them (0: none), which has
    /// child-bucket entries wherever its range starts.
    max_big: u64,
    /// Most children of a parent with child-bucket entries, counted as if the range began at
    /// entry 0 (true for the first range).
    max_bucketed_rel: u64,
}

impl Level {
    /// Rank of each distinct count in the table.
    fn rank_of(&self) -> RankOf<'_> {
        let top = self.table.partition_point(|&c| (c as usize) < DENSE_COUNTS);
        let mut dense = vec![0u32; self.table[..top].last().map_or(0, |&c| c as usize + 1)];
        for (r, &c) in self.table[..top].iter().enumerate() {
            dense[c as usize] = r as u32;
        }
        RankOf {
            dense,
            table: &self.table,
        }
    }
}

struct Spool<'p> {
    path: &'p Path,
    dir: &'p Path,
    bits: u32,
    vocab_size: u32,
    min_count: u64,
    top_list_len: usize,
    bucket_stride: u32,
    levels: Vec<Level>,
    unigrams: &'p [u64],
    /// Stored n-grams of orders >= 2 ending in each token id (for the token keys).
    last_tokens: Vec<u64>,
}

/// What closing a parent writes: its CSR end offset and its top list if it has many
/// children. (Child buckets need every order's token keys, so they are written later.)
struct ParentSink {
    offs: BufWriter<File>,
    /// Where the last closed parent's children end.
    closed: u64,
    top_ids: BufWriter<File>,
    top_lists: BufWriter<File>,
    top_list_len: usize,
    bucket_stride: u32,
    top_contexts: u64,
    max_listed: u64,
    max_bucketed: u64,
    max_big: u64,
    /// Children of the current parent: (count, relative index).
    kids: Vec<(u64, u64)>,
}

impl ParentSink {
    /// The next parent's children end at `entries`.
    fn end_at(&mut self, entries: u64) -> io::Result<()> {
        let mut b = [0u8; varint::MAX_LEN];
        let n = varint::encode(entries - self.closed, &mut b);
        self.closed = entries;
        self.offs.write_all(&b[..n])
    }

    /// Closes parent `ctx`, whose children end at `entries`.
    fn close(&mut self, ctx: u64, entries: u64) -> io::Result<()> {
        self.end_at(entries)?;
        let n_kids = self.kids.len();
        if n_kids > self.top_list_len {
            let l = self.top_list_len;
            let better = |a: &(u64, u64), b: &(u64, u64)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
            self.kids.select_nth_unstable_by(l - 1, better);
            self.kids[..l].sort_unstable_by(better);
            self.top_ids.write_all(&ctx.to_le_bytes())?;
            for &(_, rel) in &self.kids[..l] {
                self.top_lists.write_all(&rel.to_le_bytes())?;
            }
            self.top_contexts += 1;
            self.max_listed = self.max_listed.max(n_kids as u64);
        }
        if BucketSlice::new(entries - n_kids as u64, entries, self.bucket_stride).entries > 0 {
            self.max_bucketed = self.max_bucketed.max(n_kids as u64);
        }
        if self.bucket_stride > 0 && n_kids as u64 >= u64::from(self.bucket_stride) {
            self.max_big = self.max_big.max(n_kids as u64);
        }
        self.kids.clear();
        Ok(())
    }
}

/// Sequential reader of the parent order's `(key, count)` pairs.
enum Parents<'a> {
    /// Unigrams `first..first + counts.len()`.
    Dense {
        counts: &'a [u64],
        first: u64,
        next: u64,
    },
    Spooled {
        r: SpoolReader<'a>,
        left: u64,
        /// The key of the last pair read (0 before the first).
        last: u64,
    },
}

impl Parents<'_> {
    fn next(&mut self) -> io::Result<Option<(u64, u64)>> {
        match self {
            Parents::Dense {
                counts,
                first,
                next,
            } => {
                let i = *next as usize;
                if i >= counts.len() {
                    return Ok(None);
                }
                *next += 1;
                Ok(Some((*first + i as u64, counts[i])))
            }
            Parents::Spooled { r, left, last } => {
                if *left == 0 {
                    return Ok(None);
                }
                *left -= 1;
                let (k, c) = varint::read_pair(r, *last)?;
                *last = k;
                Ok(Some((k, c)))
            }
        }
    }
}

/// n-grams per chunk handed from an order's spool decoder to its column writers.
const DECODED_CHUNK: usize = 1 << 15;

/// A chunk of an order's n-grams, in order: last tokens and count ranks.
#[derive(Default)]
struct Decoded {
    tokens: Vec<u32>,
    ranks: Vec<u64>,
}

/// A column group of one order, written from its decoded n-grams a chunk at a time.
trait ColumnSink {
    fn take(&mut self, chunk: &Decoded) -> io::Result<()>;
}

impl<W: Write> ColumnSink for PackedWriter<W> {
    /// The tokens.
    fn take(&mut self, chunk: &Decoded) -> io::Result<()> {
        for &t in &chunk.tokens {
            self.push(u64::from(t))?;
        }
        Ok(())
    }
}

/// The counts: ranks at a fixed width (versions 1 and 2), or codes and their escapes.
struct CountSink<W: Write> {
    ranks: Option<PackedWriter<W>>,
    codes: Option<CodedWriter<W>>,
    escapes: Option<PackedWriter<W>>,
    width: u32,
    escaped: u64,
}

impl<W: Write> ColumnSink for CountSink<W> {
    fn take(&mut self, chunk: &Decoded) -> io::Result<()> {
        for &r in &chunk.ranks {
            if let Some(p) = self.ranks.as_mut() {
                p.push(r)?;
            }
            if let Some(p) = self.codes.as_mut() {
                p.push(r)?;
            }
            if let (Some(p), (_, Some(e))) = (self.escapes.as_mut(), code_of(r, self.width)) {
                p.push(e)?;
                self.escaped += 1;
            }
        }
        Ok(())
    }
}

impl<W: Write> CountSink<W> {
    /// Flushes; returns the escaped counts the codes and the escapes each saw.
    fn finish(self) -> io::Result<Vec<u64>> {
        if let Some(p) = self.ranks {
            p.finish()?;
        }
        let mut seen = Vec::new();
        if let Some(p) = self.codes {
            seen.push(p.finish()?.2);
        }
        if let Some(p) = self.escapes {
            p.finish()?;
            seen.push(self.escaped);
        }
        Ok(seen)
    }
}

/// The parent order's child buckets, from the children's tokens: each parent's children
/// are read from the chunks in turn (a parent's may span chunks), its slice of the bucket
/// table written once they are all in.
struct BucketSink<'a, W: Write> {
    out: PackedWriter<W>,
    keys: Vec<u32>,
    stride: u32,
    parts: std::slice::Iter<'a, Part>,
    /// The current part's spooled children counts and its parents not yet begun.
    offsets: Option<SpoolReader<'a>>,
    parents_left: u64,
    /// The current parent's first child and, once begun, the children it still needs.
    lo: u64,
    need: Option<u64>,
    kid_keys: Vec<u32>,
}

impl<W: Write> BucketSink<'_, W> {
    /// Begins the next parent; `false` when there is none.
    fn next_parent(&mut self) -> io::Result<bool> {
        while self.parents_left == 0 {
            let Some(part) = self.parts.next() else {
                return Ok(false);
            };
            self.offsets = Some(rewind(&part.parent_offsets));
            self.parents_left = part.parents;
        }
        let offsets = self.offsets.as_mut().expect("a part is open");
        self.need = Some(varint::read(offsets)?);
        self.parents_left -= 1;
        self.kid_keys.clear();
        Ok(true)
    }

    /// Writes the bucket entries of the parent whose children are all in.
    fn close_parent(&mut self) -> io::Result<()> {
        let hi = self.lo + self.kid_keys.len() as u64;
        let b = BucketSlice::new(self.lo, hi, self.stride);
        // Entry j: the first child in bucket j + 1 or later (keys ascend with the tokens, so
        // buckets do too).
        let mut r = 0usize;
        for j in 0..b.entries {
            while r < self.kid_keys.len() && b.bucket(self.kid_keys[r]) <= j {
                r += 1;
            }
            self.out.push(r as u64)?;
        }
        self.lo = hi;
        self.need = None;
        Ok(())
    }

    fn finish(mut self) -> io::Result<()> {
        // Parents after the last child have none.
        loop {
            if self.need.is_none() && !self.next_parent()? {
                break;
            }
            if self.need != Some(0) {
                return Err(io::Error::other(
                    "internal: the spooled children counts exceed the spooled n-grams",
                ));
            }
            self.close_parent()?;
        }
        self.out.finish()?;
        Ok(())
    }
}

impl<W: Write> ColumnSink for BucketSink<'_, W> {
    fn take(&mut self, chunk: &Decoded) -> io::Result<()> {
        let mut tokens = &chunk.tokens[..];
        while !tokens.is_empty() {
            let need = match self.need {
                Some(need) => need,
                None => {
                    if !self.next_parent()? {
                        return Err(io::Error::other(
                            "internal: more spooled n-grams than their parents' children",
                        ));
                    }
                    continue;
                }
            };
            let take = (need as usize).min(tokens.len());
            for &t in &tokens[..take] {
                self.kid_keys.push(self.keys[t as usize]);
            }
            tokens = &tokens[take..];
            self.need = Some(need - take as u64);
            if need as usize == take {
                self.close_parent()?;
            }
        }
        Ok(())
    }
}

/// An order's spooled `(key, count)` pairs ([`varint::encode_pair`]), encoded straight into
/// its buffer (a few bytes each: through `BufWriter::write_all` every record was a call to
/// `memmove`).
struct PairSpool {
    file: File,
    buf: Box<[u8]>,
    len: usize,
    /// The key of the last pair (0 before the first), which the next is stored after.
    prev: u64,
}

impl PairSpool {
    fn new(file: File) -> Self {
        PairSpool {
            file,
            buf: vec![0u8; SPOOL_BUF + varint::MAX_PAIR_LEN].into_boxed_slice(),
            len: 0,
            prev: 0,
        }
    }

    #[inline(always)]
    fn push(&mut self, key: u64, count: u64) -> io::Result<()> {
        let slot = &mut self.buf[self.len..self.len + varint::MAX_PAIR_LEN];
        self.len += varint::encode_pair(self.prev, key, count, slot.try_into().expect("room"));
        self.prev = key;
        if self.len >= SPOOL_BUF {
            self.file.write_all(&self.buf[..self.len])?;
            self.len = 0;
        }
        Ok(())
    }

    fn finish(mut self) -> io::Result<File> {
        self.file.write_all(&self.buf[..self.len])?;
        Ok(self.file)
    }
}

/// Reads a spooled `u64`, straight from the buffer when it holds it (the generic `read_exact`
/// costs more than the decode on these 8-byte records).
#[inline(always)]
fn read_u64(r: &mut SpoolReader<'_>) -> io::Result<u64> {
    let mut b = [0u8; 8];
    if let Some(s) = r.buffer().get(..8) {
        b.copy_from_slice(s);
        r.consume(8);
    } else {
        r.read_exact(&mut b)?;
    }
    Ok(u64::from_le_bytes(b))
}

/// Counts below this index dense tables (rank, frequency); the rare larger ones a sorted
/// search or a hash map. Most n-grams are seen a few times, so a hash per n-gram was the
/// writer's biggest cost.
const DENSE_COUNTS: usize = 1 << 16;

/// Rank of each distinct count of a level in its table.
struct RankOf<'t> {
    dense: Vec<u32>,
    table: &'t [u64],
}

impl RankOf<'_> {
    #[inline(always)]
    fn get(&self, c: u64) -> u64 {
        match self.dense.get(c as usize) {
            Some(&r) => u64::from(r),
            // Counts come from the table this was built from: the search always finds them.
            None => self.table.partition_point(|&v| v < c) as u64,
        }
    }
}

/// A spooled file read from its start with `pread`: passes on several threads read one file
/// at once (a cloned descriptor would share its offset).
struct Spooled<'f> {
    file: &'f File,
    at: u64,
}

impl Read for Spooled<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

type SpoolReader<'f> = BufReader<Spooled<'f>>;

fn rewind(file: &File) -> SpoolReader<'_> {
    BufReader::with_capacity(SPOOL_BUF, Spooled { file, at: 0 })
}

impl Spool<'_> {
    fn scratch_file(&self) -> Result<File> {
        tempfile::tempfile_in(self.dir).map_err(|e| NGramError::io(self.dir, e))
    }

    fn scratch(&self) -> Result<BufWriter<File>> {
        Ok(BufWriter::with_capacity(SPOOL_BUF, self.scratch_file()?))
    }

    fn io(&self, e: io::Error) -> NGramError {
        NGramError::io(self.path, e)
    }

    fn bad(&self, n: usize, detail: String) -> NGramError {
        NGramError::InvalidArgument(format!(
            "writing {}: order-{n} stream: {detail}",
            self.path.display()
        ))
    }

    /// Token keys: the share of stored n-grams of orders >= 2 ending in a smaller token id,
    /// scaled to 2^32, so a context's children spread evenly over its buckets.
    fn token_keys(&self) -> Vec<u32> {
        let total: u64 = self.last_tokens.iter().sum();
        let mut below = 0u64;
        self.last_tokens
            .iter()
            .map(|&c| {
                // below == total past the last id that ends an n-gram: saturate there.
                let k = ((u128::from(below) << 32) / u128::from(total.max(1)))
                    .min(u128::from(u32::MAX)) as u32;
                below += c;
                k
            })
            .collect()
    }

    /// Spools every order of every range (up to `threads` ranges at once), then puts each
    /// order's ranges together: `self.levels` and `self.last_tokens`.
    fn spool_ranges(
        &mut self,
        ranges: Vec<KeyRange<'_>>,
        order: usize,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<()> {
        let this = &*self;
        let one = |r: KeyRange<'_>| -> Result<(Vec<PartOut>, LastTokens)> {
            let mut last_tokens = LastTokens::new(this.vocab_size as usize);
            let mut parts: Vec<PartOut> = Vec::with_capacity(r.streams.len());
            for (i, stream) in r.streams.into_iter().enumerate() {
                let prev = parts.last().map(|p| &p.part);
                let out =
                    this.spool_order(i + 2, r.first.clone(), prev, stream, &mut last_tokens)?;
                parts.push(out);
            }
            Ok((parts, last_tokens))
        };
        let spooled: Vec<(Vec<PartOut>, LastTokens)> = match pool {
            Some(pool) if ranges.len() > 1 => {
                use rayon::prelude::*;
                pool.install(|| ranges.into_par_iter().map(one).collect::<Result<_>>())?
            }
            _ => ranges.into_iter().map(one).collect::<Result<_>>()?,
        };
        let mut last_tokens = vec![0u64; self.vocab_size as usize];
        let mut by_order: Vec<Vec<PartOut>> = (2..=order).map(|_| Vec::new()).collect();
        for (parts, lt) in spooled {
            lt.add_to(&mut last_tokens);
            for (i, p) in parts.into_iter().enumerate() {
                by_order[i].push(p);
            }
        }
        self.last_tokens = last_tokens;
        for outs in by_order {
            let level = self.join_parts(outs)?;
            self.levels.push(level);
        }
        Ok(())
    }

    /// One order's level from its ranges, in key order.
    fn join_parts(&self, outs: Vec<PartOut>) -> Result<Level> {
        let mut counts: Vec<(u64, u64)> = Vec::new();
        let (mut max_listed, mut max_big) = (0, 0);
        let single = outs.len() == 1;
        let mut max_bucketed = 0;
        let mut parts = Vec::with_capacity(outs.len());
        for o in outs {
            counts.extend(o.counts);
            max_listed = max_listed.max(o.max_listed);
            max_big = max_big.max(o.max_big);
            if single {
                max_bucketed = o.max_bucketed_rel;
            }
            parts.push(o.part);
        }
        counts.sort_unstable();
        let mut table: Vec<u64> = Vec::new();
        let mut freq: Vec<u64> = Vec::new();
        for (c, f) in counts {
            if table.last() == Some(&c) {
                *freq.last_mut().expect("same length") += f;
            } else {
                table.push(c);
                freq.push(f);
            }
        }
        if !single {
            // A parent with `bucket_stride` children or more has entries wherever it starts,
            // and is above every smaller one; without one, where the ranges start decides.
            max_bucketed = if max_big > 0 {
                max_big
            } else {
                self.max_bucketed_children(&parts).map_err(|e| self.io(e))?
            };
        }
        Ok(Level {
            entries: parts.iter().map(|p| p.entries).sum(),
            top_contexts: parts.iter().map(|p| p.top_contexts).sum(),
            parts,
            table,
            freq,
            max_listed_children: max_listed,
            max_bucketed_children: max_bucketed,
        })
    }

    /// Most children of a parent with child-bucket entries, from the spooled offsets.
    fn max_bucketed_children(&self, parts: &[Part]) -> io::Result<u64> {
        let mut most = 0;
        let mut base = 0u64;
        for p in parts {
            let mut offs = rewind(&p.parent_offsets);
            let mut lo = 0;
            for _ in 0..p.parents {
                let hi = lo + varint::read(&mut offs)?;
                if BucketSlice::new(base + lo, base + hi, self.bucket_stride).entries > 0 {
                    most = most.max(hi - lo);
                }
                lo = hi;
            }
            base += p.entries;
        }
        Ok(most)
    }

    /// Spools order `n`'s n-grams of first tokens `first` (whose order n-1 is `prev`, the
    /// unigrams for order 2), checking them.
    fn spool_order(
        &self,
        n: usize,
        first: std::ops::Range<u32>,
        prev: Option<&Part>,
        stream: CountStream<'_>,
        last_tokens: &mut LastTokens,
    ) -> Result<PartOut> {
        let bits = self.bits;
        let tok_mask = (1u64 << bits) - 1;
        let key_bits = n as u32 * bits;
        let (mut parents, n_parents) = match prev {
            None => (
                Parents::Dense {
                    counts: &self.unigrams[first.start as usize..first.end as usize],
                    first: u64::from(first.start),
                    next: 0,
                },
                u64::from(first.end - first.start),
            ),
            Some(prev) => (
                Parents::Spooled {
                    r: rewind(&prev.raw),
                    left: prev.entries,
                    last: 0,
                },
                prev.entries,
            ),
        };
        let mut raw = PairSpool::new(self.scratch_file()?);
        let mut sink = ParentSink {
            offs: self.scratch()?,
            closed: 0,
            top_ids: self.scratch()?,
            top_lists: self.scratch()?,
            top_list_len: self.top_list_len,
            bucket_stride: self.bucket_stride,
            top_contexts: 0,
            max_listed: 0,
            max_bucketed: 0,
            max_big: 0,
            kids: Vec::new(),
        };
        // Distinct counts and how many n-grams have each (dense below DENSE_COUNTS).
        let mut small = vec![0u64; DENSE_COUNTS];
        let mut table: FxHashMap<u64, u64> = FxHashMap::default();
        let mut entries = 0u64;
        // The parent whose children are being read: (index, key, count).
        let mut cur: Option<(u64, u64, u64)> = None;
        let mut parent_index = 0u64;
        let mut prev_key: Option<u64> = None;

        for item in stream {
            let (k, count) = item?;
            if let Some(p) = prev_key {
                if k <= p {
                    return Err(self.bad(
                        n,
                        format!(
                            "keys must be strictly ascending, but {:?} follows {:?}",
                            key::unpack(k, n, bits),
                            key::unpack(p, n, bits)
                        ),
                    ));
                }
            }
            prev_key = Some(k);
            if key_bits < 64 && k >> key_bits != 0 {
                return Err(self.bad(
                    n,
                    format!("key {k:#x} has more than {n} tokens of {bits} bits"),
                ));
            }
            let last = k & tok_mask;
            if last >= u64::from(self.vocab_size) {
                return Err(self.bad(
                    n,
                    format!(
                        "n-gram {:?} has token {last}, outside the vocabulary of {}",
                        key::unpack(k, n, bits),
                        self.vocab_size
                    ),
                ));
            }
            if count == 0 || count < self.min_count {
                return Err(self.bad(
                    n,
                    format!(
                        "n-gram {:?} has count {count}, below min_count {} (and 0 is never stored)",
                        key::unpack(k, n, bits),
                        self.min_count.max(1)
                    ),
                ));
            }
            let pk = k >> bits;
            // Advance the parent cursor to the prefix of this n-gram.
            loop {
                match cur {
                    Some((_, ck, _)) if ck == pk => break,
                    Some((ci, ck, _)) if ck < pk => {
                        sink.close(ci, entries).map_err(|e| self.io(e))?;
                        cur = None;
                    }
                    Some(_) => {
                        return Err(self.bad(
                            n,
                            format!(
                                "n-gram {:?} has no prefix in order {} (input not prefix-closed)",
                                key::unpack(k, n, bits),
                                n - 1
                            ),
                        ))
                    }
                    None => match parents.next().map_err(|e| self.io(e))? {
                        Some((pkey, pcount)) => {
                            cur = Some((parent_index, pkey, pcount));
                            parent_index += 1;
                        }
                        None => {
                            return Err(self.bad(
                                n,
                                format!(
                                "n-gram {:?} has no prefix in order {} (input not prefix-closed)",
                                key::unpack(k, n, bits),
                                n - 1
                            ),
                            ))
                        }
                    },
                }
            }
            let (_, _, pcount) = cur.expect("parent located");
            if pcount == 0 {
                return Err(self.bad(
                    n,
                    format!(
                        "n-gram {:?} has no prefix in order {} (its count is 0: input not prefix-closed)",
                        key::unpack(k, n, bits),
                        n - 1
                    ),
                ));
            }
            if count > pcount {
                return Err(self.bad(
                    n,
                    format!(
                        "n-gram {:?} has count {count}, above its prefix's count {pcount}",
                        key::unpack(k, n, bits)
                    ),
                ));
            }
            sink.kids.push((count, sink.kids.len() as u64));
            last_tokens.add(last as usize);
            match small.get_mut(count as usize) {
                Some(f) => *f += 1,
                None => *table.entry(count).or_insert(0) += 1,
            }
            raw.push(k, count).map_err(|e| self.io(e))?;
            entries += 1;
        }
        // Close the current parent and every parent after it.
        if let Some((ci, _, _)) = cur {
            sink.close(ci, entries).map_err(|e| self.io(e))?;
        }
        while parents.next().map_err(|e| self.io(e))?.is_some() {
            sink.end_at(entries).map_err(|e| self.io(e))?;
        }
        let mut counts: Vec<(u64, u64)> = table.into_iter().collect();
        counts.extend((0..DENSE_COUNTS as u64).zip(small).filter(|&(_, f)| f > 0));
        counts.sort_unstable();
        let done = |b: BufWriter<File>| b.into_inner().map_err(|e| e.into_error());
        Ok(PartOut {
            part: Part {
                parents: n_parents,
                entries,
                raw: raw.finish().map_err(|e| self.io(e))?,
                parent_offsets: done(sink.offs).map_err(|e| self.io(e))?,
                top_contexts: sink.top_contexts,
                top_ids: done(sink.top_ids).map_err(|e| self.io(e))?,
                top_lists: done(sink.top_lists).map_err(|e| self.io(e))?,
            },
            counts,
            max_listed: sink.max_listed,
            max_big: sink.max_big,
            max_bucketed_rel: sink.max_bucketed,
        })
    }

    /// The sections of order `n >= 2` read from its spooled `(key, count)` pairs (the child
    /// buckets being order n-1's).
    fn is_column(kind: SectionKind) -> bool {
        matches!(
            kind,
            SectionKind::Tokens
                | SectionKind::CountCodes
                | SectionKind::CountEscapes
                | SectionKind::CountRanks
        )
    }

    /// Writes, in one pass over order `n`'s spooled pairs, every section `writers` holds: its
    /// tokens and counts (ranks, or codes and escapes) and order n-1's child buckets. With
    /// `fan_out`, the pairs are decoded on this thread and each column group packed on a
    /// thread of its own (the groups take a chunk of decoded n-grams at a time; the output is
    /// the same bytes).
    fn write_columns(
        &self,
        n: usize,
        header: &Header,
        writers: &mut [(usize, SectionKind, SectionWriter<'_>)],
        fan_out: bool,
    ) -> Result<()> {
        let io = |e: io::Error| self.io(e);
        let level = &self.levels[n - 2];
        let rec = &header.orders[n - 1];
        let mut tokens = None;
        let mut counts = CountSink {
            ranks: None,
            codes: None,
            escapes: None,
            width: rec.count_width,
            escaped: 0,
        };
        let mut buckets = None;
        for (_, kind, w) in writers.iter_mut() {
            match kind {
                SectionKind::Tokens => tokens = Some(PackedWriter::new(w, self.bits)),
                SectionKind::CountRanks => {
                    counts.ranks = Some(PackedWriter::new(w, rec.count_width));
                }
                SectionKind::CountCodes => {
                    counts.codes = Some(CodedWriter::new(w, rec.count_width));
                }
                SectionKind::CountEscapes => {
                    let ew = escape_width(rec.count_values, rec.count_width);
                    counts.escapes = Some(PackedWriter::new(w, ew));
                }
                SectionKind::ChildBuckets => {
                    buckets = Some(BucketSink {
                        out: PackedWriter::new(w, header.orders[n - 2].bucket_width),
                        keys: self.token_keys(),
                        stride: self.bucket_stride,
                        parts: level.parts.iter(),
                        offsets: None,
                        parents_left: 0,
                        lo: 0,
                        need: None,
                        kid_keys: Vec::new(),
                    });
                }
                _ => unreachable!("not a column section"),
            }
        }
        let has_counts = counts.ranks.is_some() || counts.codes.is_some();
        let rank = level.rank_of();
        let decode = |send: &mut dyn FnMut(Decoded) -> io::Result<()>| -> io::Result<()> {
            let tok_mask = (1u64 << self.bits) - 1;
            let mut chunk = Decoded::default();
            for part in &level.parts {
                let mut raw = rewind(&part.raw);
                let mut last = 0u64;
                for _ in 0..part.entries {
                    let (k, c) = varint::read_pair(&mut raw, last)?;
                    last = k;
                    chunk.tokens.push((k & tok_mask) as u32);
                    chunk.ranks.push(rank.get(c));
                    if chunk.tokens.len() == DECODED_CHUNK {
                        send(std::mem::take(&mut chunk))?;
                    }
                }
            }
            if !chunk.tokens.is_empty() {
                send(chunk)?;
            }
            Ok(())
        };
        let mut sinks: Vec<&mut (dyn ColumnSink + Send)> = Vec::new();
        if let Some(t) = tokens.as_mut() {
            sinks.push(t);
        }
        if has_counts {
            sinks.push(&mut counts);
        }
        if let Some(b) = buckets.as_mut() {
            sinks.push(b);
        }
        if fan_out && sinks.len() > 1 {
            std::thread::scope(|scope| -> io::Result<()> {
                let mut queues = Vec::new();
                let mut handles = Vec::new();
                for sink in sinks {
                    let (tx, rx) = std::sync::mpsc::sync_channel::<Arc<Decoded>>(4);
                    queues.push(tx);
                    handles.push(scope.spawn(move || -> io::Result<()> {
                        for chunk in rx {
                            sink.take(&chunk)?;
                        }
                        Ok(())
                    }));
                }
                // A sink that failed drops its queue: the decoding stops, its error is reported.
                let decoded = decode(&mut |chunk| {
                    let chunk = Arc::new(chunk);
                    for q in &queues {
                        q.send(chunk.clone())
                            .map_err(|_| io::Error::other("a column writer stopped"))?;
                    }
                    Ok(())
                });
                drop(queues);
                for h in handles {
                    h.join()
                        .map_err(|_| io::Error::other("a column writer panicked"))??;
                }
                decoded
            })
            .map_err(io)?;
        } else {
            decode(&mut |chunk| {
                for sink in sinks.iter_mut() {
                    sink.take(&chunk)?;
                }
                Ok(())
            })
            .map_err(io)?;
        }
        if let Some(p) = tokens {
            p.finish().map_err(io)?;
        }
        if let Some(b) = buckets {
            b.finish().map_err(io)?;
        }
        for got in counts.finish().map_err(io)? {
            if got != rec.count_escapes {
                return Err(NGramError::Corrupt {
                    path: self.path.to_path_buf(),
                    detail: format!(
                        "internal: order {n} has {got} escaped counts, {} were planned",
                        rec.count_escapes
                    ),
                });
            }
        }
        Ok(())
    }

    fn write_section<W: Write>(
        &self,
        out: &mut W,
        kind: SectionKind,
        n: usize,
        header: &Header,
    ) -> Result<()> {
        let io = |e: io::Error| self.io(e);
        let rec = &header.orders[n - 1];
        match kind {
            SectionKind::UnigramCounts => {
                let mut p = PackedWriter::new(out, rec.count_width);
                for &c in self.unigrams {
                    p.push(c).map_err(io)?;
                }
                p.finish().map_err(io)?;
            }
            SectionKind::CountValues => {
                for &c in &self.levels[n - 2].table {
                    out.write_all(&c.to_le_bytes()).map_err(io)?;
                }
            }
            SectionKind::ChildOffsets => {
                // The running sum of every part's children counts, in order.
                let mut p = PackedWriter::new(out, rec.child_width);
                p.push(0).map_err(io)?;
                let mut end = 0;
                for part in &self.levels[n - 1].parts {
                    let mut r = rewind(&part.parent_offsets);
                    for _ in 0..part.parents {
                        end += varint::read(&mut r).map_err(io)?;
                        p.push(end).map_err(io)?;
                    }
                }
                p.finish().map_err(io)?;
            }
            SectionKind::TopContexts => {
                let width = width_for(header.entries(n).saturating_sub(1));
                let mut p = PackedWriter::new(out, width);
                let mut base = 0;
                for part in &self.levels[n - 1].parts {
                    let mut r = rewind(&part.top_ids);
                    for _ in 0..part.top_contexts {
                        p.push(base + read_u64(&mut r).map_err(io)?).map_err(io)?;
                    }
                    base += part.parents;
                }
                p.finish().map_err(io)?;
            }
            SectionKind::TokenKeys => {
                let keys = self.token_keys();
                for k in &keys {
                    out.write_all(&k.to_le_bytes()).map_err(io)?;
                }
                if keys.len() % 2 == 1 {
                    out.write_all(&[0u8; 4]).map_err(io)?;
                }
            }
            SectionKind::Tokens
            | SectionKind::CountCodes
            | SectionKind::CountEscapes
            | SectionKind::CountRanks
            | SectionKind::ChildBuckets => {
                unreachable!("{} is written by write_columns", kind.name())
            }
            SectionKind::TopLists => {
                let mut p = PackedWriter::new(out, rec.top_rel_width);
                for part in &self.levels[n - 1].parts {
                    let mut r = rewind(&part.top_lists);
                    for _ in 0..part.top_contexts * u64::from(header.top_list_len) {
                        p.push(read_u64(&mut r).map_err(io)?).map_err(io)?;
                    }
                }
                p.finish().map_err(io)?;
            }
        }
        Ok(())
    }
}

/// One section written at its offset in the output: buffered, hashed for the section table,
/// and handed to the disk a buffer at a time (Linux `sync_file_range`, which does not wait),
/// so the disk writes while the model is still being packed instead of all of it in the
/// final fsync.
struct SectionWriter<'f> {
    file: &'f File,
    /// Bytes drained, added here for a progress display.
    progress: Option<&'f AtomicU64>,
    /// File offset of `buf[0]`.
    at: u64,
    buf: Vec<u8>,
    hash: Xxh3,
    written: u64,
}

impl<'f> SectionWriter<'f> {
    fn new(file: &'f File, at: u64, progress: Option<&'f AtomicU64>) -> Self {
        SectionWriter {
            file,
            progress,
            at,
            buf: Vec::new(),
            hash: Xxh3::new(),
            written: 0,
        }
    }

    fn drain(&mut self) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        if self.buf.is_empty() {
            return Ok(());
        }
        self.hash.update(&self.buf);
        self.file.write_all_at(&self.buf, self.at)?;
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::io::AsRawFd;
            // SAFETY: a plain syscall on an open descriptor; it reads no memory of ours.
            // Only a hint: the final fsync makes the file durable, so its result is ignored.
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    self.at as libc::off64_t,
                    self.buf.len() as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
        }
        self.at += self.buf.len() as u64;
        if let Some(p) = self.progress {
            p.fetch_add(self.buf.len() as u64, Ordering::Relaxed);
        }
        self.buf.clear();
        Ok(())
    }

    /// Writes what is buffered; returns (checksum, bytes written).
    fn finish(mut self) -> io::Result<(u64, u64)> {
        self.drain()?;
        Ok((self.hash.digest(), self.written))
    }
}

impl Write for SectionWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(BUF);
        }
        self.buf.extend_from_slice(buf);
        self.written += buf.len() as u64;
        if self.buf.len() >= BUF {
            self.drain()?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.drain()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::NGramModel;
    use crate::testutil::count_corpus;

    fn meta(order: usize, vocab: u32) -> ModelMeta {
        ModelMeta {
            order,
            vocab_size: vocab,
            tokenizer_fingerprint: [0; 32],
            eos_id: None,
            min_count: 1,
            total_tokens: 100,
            documents: 1,
            source: "t".into(),
        }
    }

    fn stream(v: Vec<(u64, u64)>) -> CountStream<'static> {
        Box::new(v.into_iter().map(Ok))
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// Each bad stream is refused with a message naming the file and the n-gram, the
    /// existing model under the final name is untouched and no temporary file is left.
    #[test]
    fn bad_streams_are_refused_without_clobbering() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.ngram");
        let c = count_corpus(&[vec![1, 2, 3, 1, 2]], 3, 5, None, 1);
        c.write(&path, 32).unwrap();
        let good = std::fs::read(&path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(
                mode & 0o777,
                0o644,
                "a model is readable by the daemon's user"
            );
        }
        let bits = key::token_bits(5);
        let k = |t: &[u32]| key::pack(t, bits);
        let mut uni = vec![10u64; 5];
        uni[0] = 0;
        type Case = (&'static str, Vec<(u64, u64)>, Vec<(u64, u64)>);
        let cases: Vec<Case> = vec![
            (
                "strictly ascending",
                vec![(k(&[1, 2]), 2), (k(&[1, 1]), 1)],
                vec![],
            ),
            (
                "strictly ascending",
                vec![(k(&[1, 2]), 2), (k(&[1, 2]), 1)],
                vec![],
            ),
            ("not prefix-closed", vec![(k(&[0, 2]), 1)], vec![]),
            (
                "not prefix-closed",
                vec![(k(&[1, 2]), 2)],
                vec![(k(&[1, 3, 1]), 1)],
            ),
            (
                "not prefix-closed",
                vec![(k(&[1, 2]), 2)],
                vec![(k(&[4, 4, 1]), 1)],
            ),
            ("above its prefix", vec![(k(&[1, 2]), 11)], vec![]),
            (
                "above its prefix",
                vec![(k(&[1, 2]), 2)],
                vec![(k(&[1, 2, 3]), 3)],
            ),
            ("outside the vocabulary", vec![(k(&[1, 6]), 1)], vec![]),
            ("below min_count", vec![(k(&[1, 2]), 0)], vec![]),
            (
                "more than 3 tokens",
                vec![(k(&[1, 2]), 1)],
                vec![(1 << 20, 1)],
            ),
        ];
        for (want, s2, s3) in cases {
            let err = write_model(
                &path,
                &meta(3, 5),
                &uni,
                vec![stream(s2), stream(s3)],
                &WriteOptions::default(),
            )
            .unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(want) && msg.contains("out.ngram"),
                "{want}: {msg}"
            );
            assert_eq!(std::fs::read(&path).unwrap(), good);
            assert_eq!(leftovers(dir.path()), vec!["out.ngram".to_string()]);
        }
        // A producer's own error comes through unchanged, and nothing is written.
        let failing: CountStream<'static> = Box::new(
            vec![
                Ok((k(&[1, 2]), 2)),
                Err(NGramError::InvalidArgument("disk on fire".into())),
            ]
            .into_iter(),
        );
        let err = write_model(
            &path,
            &meta(3, 5),
            &uni,
            vec![failing, stream(vec![])],
            &WriteOptions::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("disk on fire"));
        assert_eq!(std::fs::read(&path).unwrap(), good);
        assert_eq!(leftovers(dir.path()), vec!["out.ngram".to_string()]);
        NGramModel::open(&path).unwrap().verify().unwrap();
    }

    #[test]
    fn bad_arguments_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.ngram");
        let w = |m: ModelMeta, uni: Vec<u64>, n: usize, top: u32| {
            let streams = (0..n).map(|_| stream(vec![])).collect();
            write_model(
                &path,
                &m,
                &uni,
                streams,
                &WriteOptions {
                    top_list_len: top,
                    ..Default::default()
                },
            )
        };
        assert!(w(meta(3, 5), vec![1; 4], 2, 32)
            .unwrap_err()
            .to_string()
            .contains("unigram counts"));
        assert!(w(meta(3, 5), vec![1; 5], 1, 32)
            .unwrap_err()
            .to_string()
            .contains("streams"));
        assert!(w(meta(0, 5), vec![1; 5], 0, 32).is_err());
        assert!(w(meta(5, 151_936), vec![0; 151_936], 4, 32)
            .unwrap_err()
            .to_string()
            .contains("64"));
        assert!(w(
            ModelMeta {
                eos_id: Some(5),
                ..meta(3, 5)
            },
            vec![1; 5],
            2,
            32
        )
        .is_err());
        assert!(w(
            ModelMeta {
                min_count: 0,
                ..meta(3, 5)
            },
            vec![1; 5],
            2,
            32
        )
        .is_err());
        assert!(w(meta(3, 5), vec![1; 5], 2, 0).is_err());
        assert!(w(
            ModelMeta {
                total_tokens: 4,
                ..meta(3, 5)
            },
            vec![1; 5],
            2,
            32
        )
        .unwrap_err()
        .to_string()
        .contains("total"));
        assert!(!path.exists());
        // Order 1 and an empty higher order are fine.
        w(meta(1, 5), vec![1; 5], 0, 32).unwrap();
        assert_eq!(NGramModel::open(&path).unwrap().count(&[3]).unwrap(), 1);
        w(meta(2, 5), vec![0; 5], 1, 32).unwrap();
        let m = NGramModel::open(&path).unwrap();
        m.verify().unwrap();
        assert_eq!(m.prob(&[1], 2).unwrap(), (0.0, 0));
        assert!(m.top_k(&[1], 3).unwrap().is_empty());
    }

    #[test]
    fn last_token_counts_carry_past_32_bits() {
        let mut lt = LastTokens::new(4);
        lt.low[2] = u32::MAX - 1;
        for _ in 0..3 {
            lt.add(2);
        }
        lt.add(0);
        let mut sums = vec![5u64; 4];
        lt.add_to(&mut sums);
        assert_eq!(sums, [6, 5, 5 + (1 << 32) + 1, 5]);
    }

    #[test]
    fn writing_into_a_missing_directory_is_an_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/dir/m.ngram");
        let c = count_corpus(&[vec![1, 2]], 2, 4, None, 1);
        let err = c.write(&path, 32).unwrap_err();
        assert!(
            matches!(err, NGramError::Io { .. }) && err.to_string().contains("no/such/dir"),
            "{err}"
        );
    }
}
