//! [`NGramModel`]: a `.ngram` file mapped into memory and queried in place.
//!
//! Opening checks the header and section table (O(order)) and, by default, every section's
//! checksum (one sequential read; `skip_checksums` limits that to the small sections, see
//! [`Integrity`]). Queries walk the CSR levels: a context is located once per suffix length, then
//! each candidate is looked up among that context's children (sorted by token id): a jump
//! through the context's child buckets (version 2) to a few entries, then a binary search of
//! those (one vector compare for 16-bit token columns); `prob_many` runs its candidates'
//! binary searches in lockstep. Every offset read from the file is checked before use, so a
//! corrupt file yields [`NGramError::Corrupt`], never a panic; [`NGramModel::verify`] checks
//! the section checksums and every structural invariant with a full scan.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use memmap2::{Advice, Mmap, MmapOptions};
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

use crate::bits::{codes_per_block, escape_width, width_for, CodeShape, Coded, Packed};
use crate::error::{NGramError, Result};
use crate::format::{BucketSlice, Header, Section, SectionKind, FIXED_HEADER, NO_EOS};
use crate::writer::ModelMeta;

/// How to open a model.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Check every section's checksum and invariants (a full scan) before returning.
    pub verify: bool,
    /// Skip the checksums of the large sections on open (see [`Integrity`]): the header, the
    /// section table and the small sections every query reads are still checked. For models
    /// too large to read once at open; their corrupt bytes are then found only where a query's
    /// range checks catch them, or by `verify`.
    pub skip_checksums: bool,
    /// Read the whole file into the page cache now (`MAP_POPULATE`) instead of on first touch.
    pub populate: bool,
    /// Read the whole file into the page cache and map it in the background (a thread's
    /// sequential reads, then `MADV_POPULATE_READ`) and return at once: queries are served
    /// right away, and each waits on the disk only until the thread has reached its pages.
    /// The non-blocking counterpart of `populate`, for a cold start of a large model.
    pub prefetch: bool,
    /// Pin the pages in RAM (`mlock`); needs `RLIMIT_MEMLOCK` to allow it.
    pub lock: bool,
    /// Advise transparent huge pages for the mapping (`MADV_HUGEPAGE`); best effort.
    pub huge_pages: bool,
    /// Copy the file into anonymous memory (advised huge pages) instead of mapping it: RAM
    /// for the whole model, and in exchange 2 MB pages, so the random lookups of a prune stop
    /// missing the TLB (page-cache mappings get 4 KB pages on most kernels).
    pub in_memory: bool,
    /// Advise random access for the mapping (`MADV_RANDOM`): a page fault then reads just
    /// its page instead of the kernel's read-around window (128 KB by default), which helps
    /// queries into a model much larger than RAM or with cold pages, and hurts scans.
    pub random_access: bool,
}

/// What [`NGramModel::evict_pages`] drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eviction {
    /// This process's page-table entries only: the next touches are minor faults on pages
    /// still in the page cache, as in a fresh process (a restarted daemon, a new worker) on a
    /// host that has read the file recently.
    Mapping,
    /// Besides, the file's pages in the page cache: the next touches read from disk, as in a
    /// fresh process on a cold host.
    PageCache,
}

/// How much of a file open checked (see [`OpenOptions`] and `docs/ngram-format.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Integrity {
    /// Header and section table (their checksum), and the checksums of the sections indexed
    /// by token id (order 1, child buckets excepted) and of every count table.
    Small,
    /// Besides, every section's checksum: every byte of the file is covered (the default).
    Checksums,
    /// Besides, every structural invariant ([`NGramModel::verify`]).
    Verified,
}

/// Whether `s` is one of the sections checked on every open: O(vocabulary + distinct counts)
/// bytes, read by nearly every query (unigram counts and token keys, order-1 offsets and top
/// lists, the count tables that turn ranks into counts).
fn always_checked(s: &Section) -> bool {
    match s.kind {
        SectionKind::CountValues => true,
        SectionKind::ChildBuckets => false,
        _ => s.order == 1,
    }
}

/// The file's identity and version at open, to notice it being rewritten in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    mtime: (i64, i64),
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileStamp {
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        }
    }
}

/// A packed column: where it lies in the file and its shape.
#[derive(Clone, Copy, Debug, Default)]
struct Col {
    off: usize,
    bytes: usize,
    len: u64,
    width: u32,
}

/// The columns of one order.
#[derive(Clone, Debug, Default)]
struct Level {
    /// Entries of this order (order 1: `vocab_size`, dense by token id).
    entries: u64,
    /// Order 1: the counts; order >= 2 (versions 1 and 2): ranks into `values`.
    counts: Col,
    /// Order >= 2 (version 3): the ranks into `values` as count codes, and their escapes.
    codes: Option<(Col, Col, CodeShape)>,
    /// Order >= 2: the distinct counts (u64 LE), `(offset, len)`.
    values: (usize, u64),
    /// Order >= 2: last token of each n-gram.
    tokens: Col,
    /// Order < N: CSR offsets into the next order (`entries + 1` values).
    children: Option<Col>,
    /// Order < N: contexts with a top list, and the lists.
    top_ctx: Option<Col>,
    top_lists: Option<Col>,
    /// Order < N, version 2: the child-bucket table.
    buckets: Option<Col>,
}

/// The count ranks of one order >= 2: packed at a fixed width (versions 1 and 2) or coded.
#[derive(Clone, Copy)]
enum Ranks<'a> {
    Plain(Packed<'a>),
    Coded(Coded<'a>),
}

impl Ranks<'_> {
    /// Rank of entry `i`; `Err` with the escape index a corrupt code block points to.
    #[inline(always)]
    fn get(&self, i: u64) -> std::result::Result<u64, u64> {
        match self {
            Ranks::Plain(p) => Ok(p.get(i)),
            Ranks::Coded(c) => c.get(i),
        }
    }

    #[inline(always)]
    fn prefetch(&self, i: u64) {
        match self {
            Ranks::Plain(p) => p.prefetch(i),
            Ranks::Coded(c) => c.prefetch(i),
        }
    }

    /// Starts reading the rank of entry `i`: its code and escape index (version 3), and the
    /// escape's load, without branching on the code ([`Coded::read`]); [`Self::finish`]
    /// gives the rank.
    #[inline(always)]
    fn start(&self, i: u64) -> RankRead {
        match self {
            Ranks::Plain(p) => RankRead {
                code: p.get(i),
                escape: None,
            },
            Ranks::Coded(c) => {
                let (code, e) = c.read(i);
                c.prefetch_escape(e);
                RankRead {
                    code,
                    escape: Some(e),
                }
            }
        }
    }

    /// The rank [`Self::start`] read; `Err` with the escape index past the escapes.
    #[inline(always)]
    fn finish(&self, r: RankRead) -> std::result::Result<u64, u64> {
        match (self, r.escape) {
            (Ranks::Coded(c), Some(e)) => c.pick(r.code, e),
            _ => Ok(r.code),
        }
    }
}

/// A rank being read ([`Ranks::start`]).
#[derive(Clone, Copy, Debug)]
struct RankRead {
    code: u64,
    escape: Option<u64>,
}

/// A context's count being read ([`NGramModel::locate_pending`]): known (order 1), or the
/// rank of order n's entry i being read.
#[derive(Clone, Copy, Debug)]
enum PendingCount {
    Known(u64),
    Rank(usize, u64, RankRead),
}

/// One candidate of `prob_many` being searched among a context's children.
#[derive(Clone, Copy, Default)]
struct Probe {
    /// Candidate range, relative to the context's first child: the child sought is at `lo`
    /// if anywhere (once `len` is 1). A context has at most `vocab_size < 2^32` children.
    lo: u32,
    len: u32,
    token: u32,
    key: u32,
    /// Index in the block of candidates.
    slot: u16,
}

/// Children up to which a single lookup skips the child buckets.
const SMALL_CONTEXT: u64 = 64;

/// Most answers one batched top-k call may ask for (`rows * k`): its output takes 12 bytes
/// per answer, so this bounds it at 768 MiB, checked before anything is allocated.
pub const MAX_TOP_K_ANSWERS: u64 = 1 << 26;

/// Size of the candidate blocks of `prob_many` (their search state lives on the stack).
const BLOCK: usize = 64;

/// A located context: the range of its children in the next order and its count.
#[derive(Clone, Copy, Debug)]
struct Ctx {
    /// 1-based order of the context itself.
    order: usize,
    /// Id of the context within its order (token id for order 1).
    id: u64,
    lo: u64,
    hi: u64,
    count: u64,
}

/// Finds tokens among the children `lo..hi` of one context (order `order`): a jump through the
/// context's child buckets when it has some, then a search inside the bucket.
#[derive(Clone, Copy)]
struct Children<'a> {
    model: &'a NGramModel,
    order: usize,
    toks: Packed<'a>,
    /// The order's bucket table, when this context has a slice of it.
    buckets: Option<Packed<'a>>,
    slice: BucketSlice,
    lo: u64,
    hi: u64,
}

impl Children<'_> {
    /// Starts loading the two bucket entries [`Self::range`] reads for `key`: a batch of
    /// lookups issues every candidate's prefetch before reading any bucket, so that their
    /// cache misses (page faults, when cold) overlap instead of following one another.
    #[inline(always)]
    fn prefetch_range(&self, key: u32) {
        if let Some(b) = self.buckets {
            let at = (self.slice.first + self.slice.bucket(key)).saturating_sub(1);
            b.prefetch(at);
            b.prefetch(at + 1);
        }
    }

    /// The children range that holds the token whose key is `key`, if any child does.
    #[inline(always)]
    fn range(&self, key: u32) -> Result<(u64, u64)> {
        let Some(b) = self.buckets else {
            return Ok((self.lo, self.hi));
        };
        let n = self.hi - self.lo;
        let (first, entries) = (self.slice.first, self.slice.entries);
        let k = self.slice.bucket(key);
        // Bucket k spans entry(k-1)..entry(k), entry(-1) = 0 and entry(entries) = n. The
        // indexes are clamped into the table so both loads are unconditional (cmov, no branch).
        let last = b.len().saturating_sub(1);
        let s = b.get_narrow((first + k).saturating_sub(1).min(last));
        let e = b.get_narrow((first + k).min(last));
        let start = if k == 0 { 0 } else { s };
        let end = if k == entries { n } else { e };
        if start > end || end > n {
            return Err(self.corrupt(k, start, end));
        }
        Ok((self.lo + start, self.lo + end))
    }

    #[cold]
    fn corrupt(&self, k: u64, start: u64, end: u64) -> NGramError {
        self.model.corrupt(format!(
            "order {} child bucket {k} of children {}..{} spans {start}..{end}, outside 0..{}",
            self.order,
            self.lo,
            self.hi,
            self.hi - self.lo
        ))
    }

    /// Index (in order `order + 1`) of the child whose token is `t`, if there is one.
    #[inline]
    fn find(&self, t: u64) -> Result<Option<u64>> {
        // A lone lookup in a small context is faster as a plain binary search than through
        // the token key and bucket loads it would wait on.
        if self.hi - self.lo <= self.model.small_context {
            return Ok(self.toks.find(self.lo, self.hi, t));
        }
        let (lo, hi) = self.range(self.model.token_key(t))?;
        Ok(self.toks.find(lo, hi, t))
    }
}

/// What `info` reports (serialisable for `dart-ngram info --json` and Python).
#[derive(Clone, Debug, Serialize)]
pub struct Info {
    pub path: String,
    pub format_version: u32,
    pub bytes: u64,
    pub order: usize,
    pub vocab_size: u32,
    pub token_bits: u32,
    pub tokenizer_fingerprint: String,
    pub eos_id: Option<u32>,
    pub total_tokens: u64,
    pub documents: u64,
    pub min_count: u64,
    pub top_list_len: u32,
    /// Distinct n-grams per order, index 0 = order 1.
    pub ngrams_per_order: Vec<u64>,
    pub total_ngrams: u64,
    /// Bytes on disk divided by the distinct n-grams of all orders.
    pub bytes_per_ngram: f64,
    pub source: String,
    pub sections: Vec<SectionInfo>,
    /// What open checked.
    pub integrity: Integrity,
}

#[derive(Clone, Debug, Serialize)]
pub struct SectionInfo {
    pub kind: &'static str,
    pub order: u32,
    pub offset: u64,
    pub length: u64,
}

/// An n-gram model mapped from a file. `Send + Sync`: share it behind an `Arc`.
pub struct NGramModel {
    path: PathBuf,
    /// Shared with a `prefetch` thread, which must not outlive the mapping it populates.
    map: Arc<Mmap>,
    /// Set on drop: tells a running `prefetch` thread to stop.
    prefetch_stop: Arc<AtomicBool>,
    header: Header,
    levels: Vec<Level>,
    /// Version 2: byte offset of the token keys (`vocab_size` u32 LE).
    keys: Option<usize>,
    /// Children up to which a single lookup skips the child buckets ([`SMALL_CONTEXT`];
    /// tests lower it to reach the buckets in small models).
    small_context: u64,
    /// What open checked.
    integrity: Integrity,
    /// The mapped file and its stamp at open (`None` for an in-memory copy, which cannot
    /// change under us).
    mapped: Option<(File, FileStamp)>,
}

impl std::fmt::Debug for NGramModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NGramModel")
            .field("path", &self.path)
            .field("order", &self.header.order)
            .field("vocab_size", &self.header.vocab_size)
            .finish_non_exhaustive()
    }
}

impl Drop for NGramModel {
    fn drop(&mut self) {
        self.prefetch_stop.store(true, Ordering::Relaxed);
    }
}

/// The whole file in a read-only anonymous mapping, advised huge pages before it is touched.
fn read_into_anonymous(mut file: &File, len: u64) -> std::io::Result<Mmap> {
    let len = usize::try_from(len).map_err(|_| std::io::Error::other("file too large"))?;
    let mut anon = MmapOptions::new().len(len).map_anon()?;
    // Best effort: without THP the copy still works, on 4 KB pages.
    let _ = anon.advise(Advice::HugePage);
    file.read_exact(&mut anon[..])?;
    anon.make_read_only()
}

/// Reads `file` into the page cache and maps it into this process, from a detached thread,
/// a step at a time: a plain sequential read, which the kernel's read-ahead streams at disk
/// speed (`POSIX_FADV_WILLNEED` would be the obvious call, but Linux caps each one at the
/// read-ahead window), then `MADV_POPULATE_READ` on the step, so that queries find its pages
/// mapped (no minor faults either). Stops when `stop` is set (the model was dropped).
fn prefetch_in_background(file: File, map: Arc<Mmap>, stop: Arc<AtomicBool>) {
    use std::os::unix::fs::FileExt;
    const STEP: usize = 4 << 20;
    let spawned = std::thread::Builder::new()
        .name("ngram-prefetch".into())
        .spawn(move || {
            let mut buf = vec![0u8; STEP];
            let mut at = 0usize;
            // Best effort: a read error just ends it (queries fault their pages in anyway),
            // and kernels without MADV_POPULATE_READ (before 5.14) still get the read.
            let mut populate = true;
            while at < map.len() && !stop.load(Ordering::Relaxed) {
                let n = STEP.min(map.len() - at);
                if file.read_exact_at(&mut buf[..n], at as u64).is_err() {
                    break;
                }
                if populate {
                    populate = map.advise_range(Advice::PopulateRead, at, n).is_ok();
                }
                at += n;
            }
        });
    // Best effort too: without a thread the pages come in on first touch, as without prefetch.
    drop(spawned);
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl NGramModel {
    /// Maps `path` and checks its header (magic, version, checksum, section layout) and every
    /// section's checksum.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, &OpenOptions::default())
    }

    pub fn open_with(path: &Path, opts: &OpenOptions) -> Result<Self> {
        let io = |e: std::io::Error| NGramError::io(path, e);
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(NGramError::io(
                path,
                std::io::Error::other("not a regular file"),
            ));
        }
        let file_len = meta.len();
        if file_len == 0 {
            return Err(NGramError::Corrupt {
                path: path.to_path_buf(),
                detail: format!("empty file (a model starts with a {FIXED_HEADER}-byte header)"),
            });
        }
        let map = if opts.in_memory {
            read_into_anonymous(&file, file_len).map_err(io)?
        } else {
            let mut mo = MmapOptions::new();
            if opts.populate {
                mo.populate();
            }
            // SAFETY: the mapping is read-only; like every mmap reader we rely on the file not
            // being truncated underneath us (model files are written once and renamed into
            // place).
            unsafe { mo.map(&file) }.map_err(io)?
        };
        let header = Header::parse(path, &map, file_len)?;
        let mapped = (!opts.in_memory).then(|| (file, FileStamp::of(&meta)));
        let mut model = NGramModel {
            path: path.to_path_buf(),
            map: Arc::new(map),
            prefetch_stop: Arc::new(AtomicBool::new(false)),
            header,
            levels: Vec::new(),
            keys: None,
            small_context: SMALL_CONTEXT,
            integrity: Integrity::Small,
            mapped,
        };
        // Checksums first: a flipped bit is then named as such, not by whichever range check
        // it trips.
        if opts.skip_checksums && !opts.verify {
            model.check_sections(always_checked)?;
        } else {
            model.check_sections(|_| true)?;
            model.integrity = Integrity::Checksums;
        }
        model.levels = model.build_levels()?;
        model.keys = model
            .header
            .section(SectionKind::TokenKeys, 1)
            .map(|s| s.offset as usize);
        if opts.huge_pages {
            // Best effort: kernels without THP for file mappings just decline.
            let _ = model.map.advise(Advice::HugePage);
        }
        if opts.random_access && !opts.in_memory {
            // Best effort, as huge pages.
            let _ = model.map.advise(Advice::Random);
        }
        if opts.prefetch && !opts.populate {
            if let Some((file, _)) = &model.mapped {
                prefetch_in_background(
                    file.try_clone().map_err(io)?,
                    model.map.clone(),
                    model.prefetch_stop.clone(),
                );
            }
        }
        if opts.lock {
            model.map.lock().map_err(io)?;
        }
        if opts.verify {
            model.verify_invariants()?;
            model.integrity = Integrity::Verified;
        }
        Ok(model)
    }

    /// Checks the checksums of the sections `which` selects (in parallel: one sequential
    /// read of each).
    fn check_sections(&self, which: impl Fn(&Section) -> bool + Sync) -> Result<()> {
        use rayon::prelude::*;
        self.header
            .sections
            .par_iter()
            .filter(|s| which(s))
            .try_for_each(|s| {
                let bytes = &self.map[s.offset as usize..(s.offset + s.length) as usize];
                let sum = xxh3_64(bytes);
                if sum != s.checksum {
                    return Err(self.corrupt(format!(
                        "section {} of order {} fails its checksum (stored {:016x}, computed \
                         {sum:016x})",
                        s.kind.name(),
                        s.order,
                        s.checksum
                    )));
                }
                Ok(())
            })
    }

    /// What open checked.
    pub fn integrity(&self) -> Integrity {
        self.integrity
    }

    /// Fails when the mapped file was modified in place (written, truncated) since open: its
    /// bytes, which every query reads, are no longer the ones checked. One `fstat`; always
    /// `Ok` for a model opened `in_memory` (a private copy). Replacing the file by a rename is
    /// safe and not reported: the mapping keeps the old file.
    pub fn check_unchanged(&self) -> Result<()> {
        let Some((file, stamp)) = &self.mapped else {
            return Ok(());
        };
        let now = file.metadata().map_err(|e| NGramError::io(&self.path, e))?;
        let now = FileStamp::of(&now);
        if now != *stamp {
            return Err(NGramError::Changed {
                path: self.path.clone(),
                detail: if now.len != stamp.len {
                    format!("{} bytes at open, {} now", stamp.len, now.len)
                } else {
                    "its modification time changed".into()
                },
            });
        }
        Ok(())
    }

    fn corrupt(&self, detail: impl Into<String>) -> NGramError {
        NGramError::Corrupt {
            path: self.path.clone(),
            detail: detail.into(),
        }
    }

    fn build_levels(&self) -> Result<Vec<Level>> {
        let h = &self.header;
        let n_max = h.order as usize;
        let col = |kind: SectionKind, n: usize, len: u64, width: u32| -> Result<Col> {
            let s = h.section(kind, n).ok_or_else(|| {
                self.corrupt(format!("missing section {} of order {n}", kind.name()))
            })?;
            let c = Col {
                off: s.offset as usize,
                bytes: s.length as usize,
                len,
                width,
            };
            // Parse already matched the size; this re-check keeps query-time views trusted.
            Packed::new(&self.map[c.off..c.off + c.bytes], len, width).ok_or_else(|| {
                self.corrupt(format!("section {} of order {n} is too short", kind.name()))
            })?;
            Ok(c)
        };
        let mut levels = Vec::with_capacity(n_max);
        for n in 1..=n_max {
            let rec = &h.orders[n - 1];
            let entries = h.entries(n);
            let mut lv = Level {
                entries,
                ..Level::default()
            };
            if n == 1 {
                lv.counts = col(SectionKind::UnigramCounts, 1, entries, rec.count_width)?;
            } else {
                lv.tokens = col(SectionKind::Tokens, n, entries, h.token_bits)?;
                if h.coded_counts() {
                    let s = h.section(SectionKind::CountCodes, n).ok_or_else(|| {
                        self.corrupt(format!("missing section count-codes of order {n}"))
                    })?;
                    let blocks = Col {
                        off: s.offset as usize,
                        bytes: s.length as usize,
                        len: entries,
                        width: rec.count_width,
                    };
                    let escapes = col(
                        SectionKind::CountEscapes,
                        n,
                        rec.count_escapes,
                        escape_width(rec.count_values, rec.count_width),
                    )?;
                    let shape = self
                        .coded(blocks, escapes)
                        .map(|_| CodeShape::new(blocks.width));
                    let shape = shape.flatten().ok_or_else(|| {
                        self.corrupt(format!("section count-codes of order {n} is too short"))
                    })?;
                    lv.codes = Some((blocks, escapes, shape));
                } else {
                    lv.counts = col(SectionKind::CountRanks, n, entries, rec.count_width)?;
                }
                let s = h
                    .section(SectionKind::CountValues, n)
                    .ok_or_else(|| self.corrupt(format!("missing count table of order {n}")))?;
                lv.values = (s.offset as usize, rec.count_values);
            }
            if n < n_max {
                lv.children = Some(col(
                    SectionKind::ChildOffsets,
                    n,
                    entries + 1,
                    rec.child_width,
                )?);
                if h.bucket_stride > 0 {
                    lv.buckets = Some(col(
                        SectionKind::ChildBuckets,
                        n,
                        h.bucket_entries(n + 1),
                        rec.bucket_width,
                    )?);
                }
                if rec.top_contexts > 0 {
                    lv.top_ctx = Some(col(
                        SectionKind::TopContexts,
                        n,
                        rec.top_contexts,
                        width_for(entries.saturating_sub(1)),
                    )?);
                    lv.top_lists = Some(col(
                        SectionKind::TopLists,
                        n,
                        rec.top_contexts * u64::from(h.top_list_len),
                        rec.top_rel_width,
                    )?);
                }
            }
            levels.push(lv);
        }
        // O(1) cross-check of the counts against the data: each CSR column must end exactly
        // at the next order's length.
        for n in 1..n_max {
            let col = levels[n - 1].children.expect("order below N has children");
            let v = Packed::trusted(&self.map[col.off..col.off + col.bytes], col.len, col.width);
            let (first, last) = (v.get(0), v.get(col.len - 1));
            if first != 0 || last != levels[n].entries {
                return Err(self.corrupt(format!(
                    "order {n} child offsets span {first}..{last}, expected 0..{} (the n-grams of order {})",
                    levels[n].entries,
                    n + 1
                )));
            }
        }
        Ok(levels)
    }

    #[inline]
    fn view(&self, c: Col) -> Packed<'_> {
        Packed::trusted(&self.map[c.off..c.off + c.bytes], c.len, c.width)
    }

    fn coded(&self, blocks: Col, escapes: Col) -> Option<Coded<'_>> {
        Coded::new(
            &self.map[blocks.off..blocks.off + blocks.bytes],
            blocks.len,
            blocks.width,
            self.view(escapes),
        )
    }

    /// The count ranks of order `n >= 2`.
    #[inline]
    fn ranks(&self, n: usize) -> Ranks<'_> {
        let lv = &self.levels[n - 1];
        match lv.codes {
            // Open checked the size (`coded` returned `Some`).
            Some((b, escapes, shape)) => Ranks::Coded(Coded::trusted(
                &self.map[b.off..b.off + b.bytes],
                shape,
                self.view(escapes),
            )),
            None => Ranks::Plain(self.view(lv.counts)),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn order(&self) -> usize {
        self.header.order as usize
    }
    pub fn vocab_size(&self) -> u32 {
        self.header.vocab_size
    }
    pub fn tokenizer_fingerprint(&self) -> [u8; 32] {
        self.header.fingerprint
    }
    pub fn eos_id(&self) -> Option<u32> {
        (self.header.eos != NO_EOS).then_some(self.header.eos)
    }
    pub fn total_tokens(&self) -> u64 {
        self.header.total_tokens
    }
    pub fn documents(&self) -> u64 {
        self.header.documents
    }
    pub fn min_count(&self) -> u64 {
        self.header.min_count
    }
    /// Distinct n-grams per order, index 0 = order 1.
    pub fn ngrams_per_order(&self) -> Vec<u64> {
        self.header.orders.iter().map(|r| r.ngrams).collect()
    }
    /// Puts the model's pages back where they are right after a fresh open in a new process:
    /// drops them from this process (`madvise(MADV_DONTNEED)`) and, with
    /// [`Eviction::PageCache`], from the page cache (`posix_fadvise(DONTNEED)`, where nothing
    /// else maps them); then reads again the small sections every open checks (what a fresh
    /// open would have read). For benchmarks; an in-memory model has nothing to evict (an
    /// error).
    pub fn evict_pages(&self, eviction: Eviction) -> Result<()> {
        let Some((file, _)) = &self.mapped else {
            return Err(NGramError::InvalidArgument(
                "an in-memory model has no file pages to evict".into(),
            ));
        };
        let io = |e: std::io::Error| NGramError::io(&self.path, e);
        // SAFETY: the mapping is a read-only, shared file mapping: after DONTNEED its pages
        // are read again from the file on the next touch, with the same contents.
        unsafe {
            self.map
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
        }
        .map_err(io)?;
        use std::os::fd::AsRawFd;
        if eviction == Eviction::PageCache {
            // SAFETY: a valid descriptor; the call only drops clean cached pages.
            let rc =
                unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            if rc != 0 {
                return Err(io(std::io::Error::from_raw_os_error(rc)));
            }
        }
        self.check_sections(always_checked)
    }

    /// Bytes of the model resident in the page cache (`mincore` over the mapping; an
    /// in-memory copy is all resident).
    pub fn resident_bytes(&self) -> Result<u64> {
        if self.mapped.is_none() {
            return Ok(self.bytes());
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let mut vec = vec![0u8; self.map.len().div_ceil(page)];
        // SAFETY: the range is this mapping (page-aligned start), `vec` has one byte per page.
        let rc = unsafe {
            libc::mincore(
                self.map.as_ptr() as *mut libc::c_void,
                self.map.len(),
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(NGramError::io(&self.path, std::io::Error::last_os_error()));
        }
        let pages = vec.iter().filter(|&&b| b & 1 == 1).count();
        Ok(((pages * page) as u64).min(self.bytes()))
    }

    /// File size in bytes.
    pub fn bytes(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn meta(&self) -> ModelMeta {
        ModelMeta {
            order: self.order(),
            vocab_size: self.vocab_size(),
            tokenizer_fingerprint: self.header.fingerprint,
            eos_id: self.eos_id(),
            min_count: self.header.min_count,
            total_tokens: self.header.total_tokens,
            documents: self.header.documents,
            source: self.header.source.clone(),
        }
    }

    pub fn info(&self) -> Info {
        let per = self.ngrams_per_order();
        let total: u64 = per.iter().sum();
        Info {
            path: self.path.display().to_string(),
            format_version: self.header.version,
            bytes: self.bytes(),
            order: self.order(),
            vocab_size: self.vocab_size(),
            token_bits: self.header.token_bits,
            tokenizer_fingerprint: hex(&self.header.fingerprint),
            eos_id: self.eos_id(),
            total_tokens: self.header.total_tokens,
            documents: self.header.documents,
            min_count: self.header.min_count,
            top_list_len: self.header.top_list_len,
            ngrams_per_order: per,
            total_ngrams: total,
            bytes_per_ngram: if total == 0 {
                0.0
            } else {
                self.bytes() as f64 / total as f64
            },
            source: self.header.source.clone(),
            sections: self
                .header
                .sections
                .iter()
                .map(|s| SectionInfo {
                    kind: s.kind.name(),
                    order: s.order,
                    offset: s.offset,
                    length: s.length,
                })
                .collect(),
            integrity: self.integrity,
        }
    }

    /// Fails with [`NGramError::TokenizerMismatch`] unless the model was built with the
    /// tokenizer whose fingerprint is `expected`.
    pub fn check_fingerprint(&self, expected: &[u8; 32]) -> Result<()> {
        if &self.header.fingerprint == expected {
            return Ok(());
        }
        let detail = if self.header.fingerprint == [0u8; 32] {
            format!(
                "{} records no tokenizer (built from pre-tokenized ids); expected tokenizer {}",
                self.path.display(),
                hex(expected)
            )
        } else {
            format!(
                "{} was built with tokenizer {}, but the tokenizer in use is {}",
                self.path.display(),
                hex(&self.header.fingerprint),
                hex(expected)
            )
        };
        Err(NGramError::TokenizerMismatch { detail })
    }

    #[inline]
    fn check_token(&self, t: u32) -> Result<()> {
        if t >= self.header.vocab_size {
            return Err(NGramError::TokenOutOfVocab {
                token: u64::from(t),
                vocab_size: self.header.vocab_size,
            });
        }
        Ok(())
    }

    #[cold]
    fn bad_rank(&self, n: usize, i: u64, rank: u64, len: u64) -> NGramError {
        self.corrupt(format!(
            "order {n} entry {i}: count rank {rank} outside the table of {len}"
        ))
    }

    #[cold]
    fn bad_escape(&self, n: usize, i: u64, escape: u64) -> NGramError {
        self.corrupt(format!(
            "order {n} entry {i}: escaped count {escape} outside the {} escapes",
            self.header.orders[n - 1].count_escapes
        ))
    }

    /// Rank of entry `i` of order `n >= 2` in `ranks` (that order's).
    #[inline(always)]
    fn rank_in(&self, ranks: &Ranks<'_>, n: usize, i: u64) -> Result<u64> {
        ranks.get(i).map_err(|e| self.bad_escape(n, i, e))
    }

    /// Count of entry `i` of order `n` (`i < entries(n)`).
    #[inline]
    fn count_at(&self, n: usize, i: u64) -> Result<u64> {
        if n == 1 {
            return Ok(self.view(self.levels[0].counts).get(i));
        }
        let c = self.rank_in(&self.ranks(n), n, i)?;
        self.count_of_rank(n, i, c)
    }

    /// The count of rank `c` in order `n`'s table (`i`: the entry, for the error).
    #[inline]
    fn count_of_rank(&self, n: usize, i: u64, c: u64) -> Result<u64> {
        let (off, len) = self.levels[n - 1].values;
        if c >= len {
            return Err(self.bad_rank(n, i, c, len));
        }
        let at = off + c as usize * 8;
        Ok(u64::from_le_bytes(
            self.map[at..at + 8].try_into().expect("8 bytes"),
        ))
    }

    /// Children range (in order n+1) of entry `i` of order `n < N`.
    #[inline]
    fn children_of(&self, n: usize, i: u64) -> Result<(u64, u64)> {
        let lv = &self.levels[n - 1];
        let col = lv.children.expect("order below N has children");
        let v = self.view(col);
        let (lo, hi) = (v.get(i), v.get(i + 1));
        let next = self.levels[n].entries;
        if lo > hi || hi > next {
            return Err(self.corrupt(format!(
                "order {n} entry {i}: children {lo}..{hi} outside order {} of {next} entries",
                n + 1
            )));
        }
        Ok((lo, hi))
    }

    /// Bucket key of token `t` (0 in version 1, which has no buckets). Ids past the vocabulary
    /// (only a corrupt token column has them) read the last key rather than another section.
    #[inline]
    fn token_key(&self, t: u64) -> u32 {
        let Some(off) = self.keys else {
            return 0;
        };
        let t = t.min(u64::from(self.header.vocab_size) - 1) as usize;
        let at = off + 4 * t;
        u32::from_le_bytes(self.map[at..at + 4].try_into().expect("4 bytes"))
    }

    /// Searcher of the children `lo..hi` (in order n+1) of a context of order `n < N`.
    #[inline]
    fn children(&self, n: usize, lo: u64, hi: u64) -> Children<'_> {
        let lv = &self.levels[n - 1];
        let slice = BucketSlice::new(lo, hi, self.header.bucket_stride);
        Children {
            model: self,
            order: n,
            toks: self.view(self.levels[n].tokens),
            buckets: lv
                .buckets
                .filter(|_| slice.entries > 0)
                .map(|c| self.view(c)),
            slice,
            lo,
            hi,
        }
    }

    /// Locates `ctx` (1..N-1 tokens, already checked against the vocabulary): its children's
    /// range in the next order and its count; `None` if it was never seen.
    fn locate(&self, ctx: &[u32]) -> Result<Option<Ctx>> {
        let Some((mut c, count)) = self.locate_pending(ctx)? else {
            return Ok(None);
        };
        c.count = self.count_finish(count)?;
        Ok(Some(c))
    }

    /// [`Self::locate`] with the count only started: the returned context's `count` is 0
    /// until [`Self::count_finish`] of the pending count sets it. An escaped count (version
    /// 3) is a second dependent load; started here, it overlaps the search of the children.
    fn locate_pending(&self, ctx: &[u32]) -> Result<Option<(Ctx, PendingCount)>> {
        debug_assert!(!ctx.is_empty() && ctx.len() < self.order());
        let mut id = u64::from(ctx[0]);
        let unigram = self.count_at(1, id)?;
        if unigram == 0 {
            return Ok(None);
        }
        for (i, &t) in ctx.iter().enumerate().skip(1) {
            // `id` is at order i; find t among its children at order i+1 (whose counts are
            // at least 1: only the last one's is read).
            let (lo, hi) = self.children_of(i, id)?;
            match self.children(i, lo, hi).find(u64::from(t))? {
                Some(j) => id = j,
                None => return Ok(None),
            }
        }
        let order = ctx.len();
        let count = if order == 1 {
            PendingCount::Known(unigram)
        } else {
            PendingCount::Rank(order, id, self.ranks(order).start(id))
        };
        let (lo, hi) = self.children_of(order, id)?;
        Ok(Some((
            Ctx {
                order,
                id,
                lo,
                hi,
                count: 0,
            },
            count,
        )))
    }

    /// The count a [`PendingCount`] stands for.
    #[inline]
    fn count_finish(&self, count: PendingCount) -> Result<u64> {
        let (n, i, read) = match count {
            PendingCount::Known(c) => return Ok(c),
            PendingCount::Rank(n, i, read) => (n, i, read),
        };
        let rank = self
            .ranks(n)
            .finish(read)
            .map_err(|e| self.bad_escape(n, i, e))?;
        self.count_of_rank(n, i, rank)
    }

    /// The located suffixes of `context`, longest first (at most `order - 1` of them).
    fn suffixes(&self, context: &[u32], out: &mut Vec<Ctx>) -> Result<()> {
        out.clear();
        let max = self.order() - 1;
        let ctx = &context[context.len().saturating_sub(max)..];
        for &t in ctx {
            self.check_token(t)?;
        }
        for len in (1..=ctx.len()).rev() {
            if let Some(c) = self.locate(&ctx[ctx.len() - len..])? {
                out.push(c);
            }
        }
        Ok(())
    }

    #[inline]
    fn ratio(&self, child: u64, ctx: &Ctx) -> Result<f64> {
        if child > ctx.count {
            return Err(self.bad_ratio(child, ctx));
        }
        Ok(child as f64 / ctx.count as f64)
    }

    #[cold]
    fn bad_ratio(&self, child: u64, ctx: &Ctx) -> NGramError {
        self.corrupt(format!(
            "order {} context {}: a child count {child} exceeds the context count {}",
            ctx.order, ctx.id, ctx.count
        ))
    }

    /// Raw count of an n-gram (`tokens.len() <= order`); the empty n-gram counts all tokens.
    pub fn count(&self, tokens: &[u32]) -> Result<u64> {
        if tokens.len() > self.order() {
            return Err(NGramError::InvalidArgument(format!(
                "count of a {}-gram asked of {}, an order-{} model",
                tokens.len(),
                self.path.display(),
                self.order()
            )));
        }
        for &t in tokens {
            self.check_token(t)?;
        }
        let Some((&last, init)) = tokens.split_last() else {
            return Ok(self.header.total_tokens);
        };
        if init.is_empty() {
            return self.count_at(1, u64::from(last));
        }
        let Some(ctx) = self.locate(init)? else {
            return Ok(0);
        };
        match self
            .children(ctx.order, ctx.lo, ctx.hi)
            .find(u64::from(last))?
        {
            Some(j) => self.count_at(tokens.len(), j),
            None => Ok(0),
        }
    }

    /// `P(c | context)` for every candidate, with the matched context length: the context is
    /// the last `order - 1` tokens of `context` (fewer if shorter); the longest suffix `s` of
    /// it such that `s + c` was seen gives `count(s + c) / count(s)`; if none, `p = 0`,
    /// `matched = 0`. Computed in f64, returned as f32.
    pub fn prob_many(
        &self,
        context: &[u32],
        candidates: &[u32],
        probs: &mut [f32],
        matched: &mut [u8],
    ) -> Result<()> {
        if probs.len() != candidates.len() || matched.len() != candidates.len() {
            return Err(NGramError::InvalidArgument(format!(
                "prob_many: {} candidates but {} prob and {} matched slots",
                candidates.len(),
                probs.len(),
                matched.len()
            )));
        }
        for &c in candidates {
            self.check_token(c)?;
        }
        let max = self.order() - 1;
        let ctx = &context[context.len().saturating_sub(max)..];
        for &t in ctx {
            self.check_token(t)?;
        }
        probs.fill(0.0);
        matched.fill(0);
        if candidates.is_empty() {
            return Ok(());
        }
        // The longest few suffixes are located up front: their lookups are independent, so
        // they overlap (order 3 needs two). Longer ones, if any, are located when reached.
        let mut early_buf = [None; 4];
        for (e, n) in early_buf.iter_mut().zip((1..=ctx.len()).rev()) {
            *e = self.locate_pending(&ctx[ctx.len() - n..])?;
        }
        let early = &early_buf[..ctx.len().min(early_buf.len())];
        // Candidates still unmatched, and the same ordered by the rounds their search needs.
        let mut pend = [Probe::default(); BLOCK];
        // The searches that take the binary-search path, by index in `pend`.
        let mut order_slow = [0u8; BLOCK];
        for (b, cands) in candidates.chunks(BLOCK).enumerate() {
            for (i, (p, &c)) in pend.iter_mut().zip(cands).enumerate() {
                *p = Probe {
                    token: c,
                    key: self.token_key(u64::from(c)),
                    slot: i as u16,
                    ..Probe::default()
                };
            }
            let mut np = cands.len();
            // Suffixes longest first; each candidate takes the first that has it as a child.
            for n in (1..=ctx.len()).rev() {
                if np == 0 {
                    break;
                }
                let c = match early.get(ctx.len() - n) {
                    Some(&c) => c,
                    None => self.locate_pending(&ctx[ctx.len() - n..])?,
                };
                // The context's count is read once its children are searched (below).
                let Some((mut c, count)) = c else {
                    continue;
                };
                if c.hi == c.lo {
                    continue;
                }
                let ch = self.children(c.order, c.lo, c.hi);
                // 16-bit tokens (vocabularies of 32769..=65536 ids): a bucket of up to 16
                // children is one vector compare. Other searches are binary searches that all
                // run the same number of halvings, the most any needs (halving a range of one
                // entry changes nothing): they advance in lockstep, their memory loads
                // overlap, and no step branches.
                let tok16 = ch.toks.width() == 16;
                for p in &pend[..np] {
                    ch.prefetch_range(p.key);
                }
                // Every bucket is then read, and the children it points at prefetched, before
                // any child is compared.
                for p in pend[..np].iter_mut() {
                    let (a, z) = ch.range(p.key)?;
                    ch.toks.prefetch(a);
                    (p.lo, p.len) = ((a - ch.lo) as u32, (z - a) as u32);
                }
                let mut width = 0u32;
                let mut slow = 0;
                for (i, p) in pend[..np].iter_mut().enumerate() {
                    let (a, z) = (ch.lo + u64::from(p.lo), ch.lo + u64::from(p.lo + p.len));
                    let len = z - a;
                    if tok16 && len <= Packed::SCAN16 {
                        if let Some(m) = ch.toks.eq_mask16(a, len, p.token as u16) {
                            // Found (the child at `lo`, `len` 1) or not (`len` 0).
                            p.lo = (a - ch.lo) as u32 + m.trailing_zeros().min(15);
                            p.len = u32::from(m != 0);
                            continue;
                        }
                    }
                    // An empty bucket searches at the context's first child instead (always
                    // a valid index; `len` 0 keeps it from matching).
                    p.lo = if z > a { (a - ch.lo) as u32 } else { 0 };
                    p.len = len as u32;
                    width |= p.len.saturating_sub(1);
                    order_slow[slow] = i as u8;
                    slow += 1;
                }
                for _ in 0..(32 - width.leading_zeros()) {
                    for &i in &order_slow[..slow] {
                        let p = &mut pend[usize::from(i)];
                        let half = p.len / 2;
                        let v = ch.toks.get_narrow(ch.lo + u64::from(p.lo + half));
                        // Keeps the last child <= token in range: it is the token exactly
                        // when the token is a child. A conditional move: a coin flip.
                        p.lo = std::hint::select_unpredictable(
                            v <= u64::from(p.token),
                            p.lo + half,
                            p.lo,
                        );
                        p.len -= half;
                    }
                }
                // The children's count ranks and count table, looked up once; the rank of
                // every child found starts loading before any is read.
                let lv = &self.levels[c.order];
                let ranks = self.ranks(c.order + 1);
                for p in &pend[..np] {
                    ranks.prefetch(ch.lo + u64::from(p.lo));
                }
                let (off, n_values) = lv.values;
                let table = &self.map[off..off + 8 * n_values as usize];
                c.count = self.count_finish(count)?;
                // Found children's ranks in two passes: the codes first, starting the load of
                // every escaped rank, then the escapes, so their cache misses overlap.
                let mut found = [None; BLOCK];
                for (p, f) in pend[..np].iter().zip(found.iter_mut()) {
                    let j = ch.lo + u64::from(p.lo);
                    *f = (p.len > 0 && ch.toks.get_narrow(j) == u64::from(p.token))
                        .then(|| ranks.start(j));
                }
                let mut keep = 0;
                for i in 0..np {
                    let p = pend[i];
                    let j = ch.lo + u64::from(p.lo);
                    let Some(read) = found[i] else {
                        pend[keep] = p;
                        keep += 1;
                        continue;
                    };
                    let r = ranks
                        .finish(read)
                        .map_err(|e| self.bad_escape(c.order + 1, j, e))?;
                    let at = (r as usize).wrapping_mul(8);
                    let Some(v) = table.get(at..at.wrapping_add(8)).filter(|_| r < n_values) else {
                        return Err(self.bad_rank(c.order + 1, j, r, n_values));
                    };
                    let child = u64::from_le_bytes(v.try_into().expect("8 bytes"));
                    let i = b * BLOCK + usize::from(p.slot);
                    probs[i] = self.ratio(child, &c)? as f32;
                    matched[i] = c.order as u8;
                }
                np = keep;
            }
        }
        Ok(())
    }

    /// `P(candidate | context)` and the matched length (see [`Self::prob_many`]).
    pub fn prob(&self, context: &[u32], candidate: u32) -> Result<(f32, u8)> {
        let (mut p, mut m) = ([0f32], [0u8]);
        self.prob_many(context, &[candidate], &mut p, &mut m)?;
        Ok((p[0], m[0]))
    }

    /// The `k` most probable next tokens under the same backoff semantics as
    /// [`Self::prob_many`], exactly: best probability first (compared in f64), ties by token
    /// id ascending. Tokens with probability 0 are never returned, so fewer than `k` may come
    /// back. Contexts with more than `top_list_len` children answer from their precomputed
    /// list; when `k` exceeds it (or continuations seen after a longer context use up the
    /// list), the context's children are partially sorted instead.
    pub fn top_k(&self, context: &[u32], k: usize) -> Result<Vec<(u32, f32)>> {
        // At most `vocab_size` tokens have a probability; a larger k returns the same answer.
        let k = k.min(self.header.vocab_size as usize);
        let mut ctxs = Vec::new();
        self.suffixes(context, &mut ctxs)?;
        let mut found: Vec<(f64, u32)> = Vec::new();
        if k == 0 {
            return Ok(Vec::new());
        }
        for (ci, ctx) in ctxs.iter().enumerate() {
            let longer = &ctxs[..ci];
            let toks = self.view(self.levels[ctx.order].tokens);
            // A child also seen after a longer suffix takes its probability from there.
            let longer_kids: Vec<Children<'_>> = longer
                .iter()
                .map(|l| self.children(l.order, l.lo, l.hi))
                .collect();
            let overridden = |t: u64| -> Result<bool> {
                for l in &longer_kids {
                    if l.find(t)?.is_some() {
                        return Ok(true);
                    }
                }
                Ok(false)
            };
            let n_kids = ctx.hi - ctx.lo;
            let mut taken = 0usize;
            // Whether the context's best children are known without looking at all of them.
            let mut settled = false;
            if n_kids > u64::from(self.header.top_list_len) {
                let q = self.top_list_pos(ctx)?.ok_or_else(|| {
                    self.corrupt(format!(
                        "order {} context {} has {n_kids} children but no top list",
                        ctx.order, ctx.id
                    ))
                })?;
                let lists = self.view(self.levels[ctx.order - 1].top_lists.expect("lists"));
                let l = u64::from(self.header.top_list_len);
                let mut last_count = 0;
                for e in q * l..(q + 1) * l {
                    let rel = lists.get(e);
                    if rel >= n_kids {
                        return Err(self.corrupt(format!(
                            "order {} context {}: top-list entry {rel} outside its {n_kids} children",
                            ctx.order, ctx.id
                        )));
                    }
                    let j = ctx.lo + rel;
                    let c = self.count_at(ctx.order + 1, j)?;
                    last_count = c;
                    let t = toks.get(j);
                    if overridden(t)? {
                        continue;
                    }
                    found.push((self.ratio(c, ctx)?, t as u32));
                    taken += 1;
                    if taken == k {
                        settled = true;
                        break;
                    }
                }
                if !settled {
                    // Every child left out of the list has a probability <= the list's last
                    // one; if k answers already beat it strictly, none of them can enter.
                    let bound = self.ratio(last_count, ctx)?;
                    settled = found.iter().filter(|f| f.0 > bound).count() >= k;
                }
            }
            if !settled {
                // Sorted at query time: best k of every child by count (desc), token (asc).
                found.truncate(found.len() - taken);
                let mut kids: Vec<(u64, u32)> = Vec::with_capacity(n_kids as usize);
                for j in ctx.lo..ctx.hi {
                    let t = toks.get(j);
                    if !longer.is_empty() && overridden(t)? {
                        continue;
                    }
                    kids.push((self.count_at(ctx.order + 1, j)?, t as u32));
                }
                let better = |a: &(u64, u32), b: &(u64, u32)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
                if kids.len() > k {
                    kids.select_nth_unstable_by(k - 1, better);
                    kids.truncate(k);
                }
                for (c, t) in kids {
                    found.push((self.ratio(c, ctx)?, t));
                }
            }
        }
        found.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        found.truncate(k);
        Ok(found.into_iter().map(|(p, t)| (t, p as f32)).collect())
    }

    /// Checks a batched top-k request of `rows` contexts before its `rows x k` answers are
    /// allocated: `k` at most the vocabulary size, `rows * k` at most [`MAX_TOP_K_ANSWERS`].
    pub fn check_top_k(&self, rows: usize, k: usize) -> Result<()> {
        let vocab = self.header.vocab_size;
        if k as u64 > u64::from(vocab) {
            return Err(NGramError::InvalidArgument(format!(
                "top-k: k = {k} exceeds the vocabulary size {vocab} (at most {vocab} tokens can \
                 have a probability)"
            )));
        }
        let answers = (rows as u64).saturating_mul(k as u64);
        if answers > MAX_TOP_K_ANSWERS {
            return Err(NGramError::InvalidArgument(format!(
                "top-k: {rows} contexts x k = {k} is {answers} answers, more than the \
                 {MAX_TOP_K_ANSWERS} one call may ask for (split the batch)"
            )));
        }
        Ok(())
    }

    /// Position of `ctx` in its order's top-context list, if it has a list.
    fn top_list_pos(&self, ctx: &Ctx) -> Result<Option<u64>> {
        let lv = &self.levels[ctx.order - 1];
        let Some(col) = lv.top_ctx else {
            return Ok(None);
        };
        let ids = self.view(col);
        let pos = ids.find(0, ids.len(), ctx.id);
        if pos.is_none() {
            return Err(self.corrupt(format!(
                "order {} context {} has {} children but no top list",
                ctx.order,
                ctx.id,
                ctx.hi - ctx.lo
            )));
        }
        Ok(pos)
    }

    /// One conditional distribution, for people reading a model: the longest suffix `s` of
    /// `context` (at most `order - 1` tokens) that has any continuation — the empty suffix
    /// (unigrams) if none has — and its `k` most probable continuations `count(s c) / count(s)`,
    /// best first, ties by token id. Unlike [`Self::top_k`] (DART's backoff scores, where each
    /// token takes its probability from its own longest match), these sum to at most 1.
    pub fn continuations(&self, context: &[u32], k: usize) -> Result<(usize, Vec<(u32, f32)>)> {
        let mut ctxs = Vec::new();
        self.suffixes(context, &mut ctxs)?;
        let mut found: Vec<(u64, u32)> = Vec::new();
        let (matched, total) = match ctxs.iter().find(|c| c.hi > c.lo) {
            Some(ctx) => {
                let toks = self.view(self.levels[ctx.order].tokens);
                for j in ctx.lo..ctx.hi {
                    let t = u32::try_from(toks.get(j)).map_err(|_| {
                        self.corrupt(format!(
                            "order {} entry {j}: token id past u32",
                            ctx.order + 1
                        ))
                    })?;
                    self.check_token(t)?;
                    found.push((self.count_at(ctx.order + 1, j)?, t));
                }
                (ctx.order, ctx.count)
            }
            None => {
                for t in 0..self.header.vocab_size {
                    let c = self.count_at(1, u64::from(t))?;
                    if c > 0 {
                        found.push((c, t));
                    }
                }
                (0, self.header.total_tokens)
            }
        };
        if found.iter().any(|&(c, _)| c > total) {
            return Err(self.corrupt(format!(
                "a continuation of a {matched}-token context counts more than the context's {total}"
            )));
        }
        found.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        found.truncate(k);
        let probs = found
            .into_iter()
            .map(|(c, t)| (t, (c as f64 / total as f64) as f32))
            .collect();
        Ok((matched, probs))
    }

    /// The `(key, count)` pairs of order `n`, ascending by key (keys as [`crate::key::pack`]);
    /// order 1 yields only tokens with a non-zero count.
    pub fn iter_order(&self, n: usize) -> impl Iterator<Item = Result<(u64, u64)>> + '_ {
        OrderIter::new(self, n)
    }

    /// [`Self::iter_order`] restricted to the n-grams whose first token is in `first`
    /// (a contiguous run of entries at every order: a merge splits its work by these ranges).
    pub fn iter_order_from(
        &self,
        n: usize,
        first: std::ops::Range<u32>,
    ) -> impl Iterator<Item = Result<(u64, u64)>> + '_ {
        OrderIter::in_range(self, n, first)
    }

    /// [`Self::iter_order_from`] a decoded chunk at a time, for `n >= 2`: a k-way merge reads
    /// its heads straight from the chunks.
    pub fn chunks_from(&self, n: usize, first: std::ops::Range<u32>) -> OrderChunks<'_> {
        OrderChunks(OrderIter::in_range(self, n, first))
    }

    /// Index of the first order-`n` entry whose first token is `t` or above (the entries
    /// count when there is none); `t` past the vocabulary counts as its end.
    pub fn first_entry(&self, n: usize, t: u32) -> Result<u64> {
        let mut i = u64::from(t).min(u64::from(self.vocab_size()));
        for d in 1..n.min(self.order()) {
            let v = self.view(
                self.levels[d - 1]
                    .children
                    .expect("order below N has children"),
            );
            i = v.get(i);
            if i > self.levels[d].entries {
                return Err(self.corrupt(format!(
                    "order {d} child offset {i} outside order {} of {} entries",
                    d + 1,
                    self.levels[d].entries
                )));
            }
        }
        Ok(i)
    }

    /// Full check: every section checksum, then every structural invariant (offsets
    /// monotone and in range, children sorted and in the vocabulary, counts consistent, count
    /// tables sorted, top lists exactly the best children). Reads the whole file.
    pub fn verify(&self) -> Result<()> {
        self.check_sections(|_| true)?;
        self.verify_invariants()
    }

    /// [`Self::verify`] but the checksums.
    fn verify_invariants(&self) -> Result<()> {
        let h = &self.header;
        let n_max = self.order();
        let mut sum = 0u64;
        let mut nonzero = 0u64;
        for t in 0..u64::from(h.vocab_size) {
            let c = self.count_at(1, t)?;
            sum = sum.saturating_add(c);
            nonzero += u64::from(c > 0);
        }
        if sum > h.total_tokens || nonzero != h.orders[0].ngrams {
            return Err(self.corrupt(format!(
                "unigram counts sum to {sum} over {nonzero} tokens; the header says at most {} over {}",
                h.total_tokens, h.orders[0].ngrams
            )));
        }
        if self.keys.is_some() {
            for t in 1..u64::from(h.vocab_size) {
                let (a, b) = (self.token_key(t - 1), self.token_key(t));
                if b < a {
                    return Err(self.corrupt(format!(
                        "token key of id {t} is {b}, below the key {a} of id {}",
                        t - 1
                    )));
                }
            }
        }
        for n in 2..=n_max {
            if let Some((blocks, escapes, _)) = self.levels[n - 1].codes {
                let codes = self.coded(blocks, escapes).expect("checked at open");
                let mut before = 0u64;
                for b in 0..blocks.len.div_ceil(codes_per_block(blocks.width)) {
                    if codes.block_base(b) != before {
                        return Err(self.corrupt(format!(
                            "order {n} count-code block {b} counts {} escapes before it, there \
                             are {before}",
                            codes.block_base(b)
                        )));
                    }
                    before += codes.block_escapes(b);
                }
                if before != escapes.len {
                    return Err(self.corrupt(format!(
                        "order {n}: {before} escape codes for {} escaped counts",
                        escapes.len
                    )));
                }
            }
            let (off, len) = self.levels[n - 1].values;
            let mut prev = 0u64;
            for i in 0..len {
                let at = off + i as usize * 8;
                let v = u64::from_le_bytes(self.map[at..at + 8].try_into().expect("8"));
                if v <= prev || v < h.min_count {
                    return Err(self.corrupt(format!(
                        "order {n} count table entry {i} is {v}: not ascending above {prev} and >= min_count {}",
                        h.min_count
                    )));
                }
                prev = v;
            }
        }
        for n in 1..n_max {
            let entries = self.levels[n - 1].entries;
            let toks = self.view(self.levels[n].tokens);
            let offs = self.view(self.levels[n - 1].children.expect("children"));
            if offs.get(0) != 0 || offs.get(entries) != self.levels[n].entries {
                return Err(self.corrupt(format!(
                    "order {n} child offsets span {}..{}, expected 0..{}",
                    offs.get(0),
                    offs.get(entries),
                    self.levels[n].entries
                )));
            }
            let mut n_lists = 0u64;
            let mut kids: Vec<(u64, u64)> = Vec::new();
            for i in 0..entries {
                let (lo, hi) = self.children_of(n, i)?;
                let pc = self.count_at(n, i)?;
                if pc == 0 && lo != hi {
                    return Err(
                        self.corrupt(format!("order {n} entry {i} has count 0 but children"))
                    );
                }
                let mut prev: Option<u64> = None;
                kids.clear();
                for j in lo..hi {
                    let t = toks.get(j);
                    if t >= u64::from(h.vocab_size) || prev.is_some_and(|p| t <= p) {
                        return Err(self.corrupt(format!(
                            "order {} entry {j}: token {t} out of the vocabulary or out of order",
                            n + 1
                        )));
                    }
                    prev = Some(t);
                    let c = self.count_at(n + 1, j)?;
                    if c > pc {
                        return Err(self.corrupt(format!(
                            "order {} entry {j}: count {c} above its prefix's {pc}",
                            n + 1
                        )));
                    }
                    kids.push((c, j - lo));
                }
                if let Some(col) = self.levels[n - 1].buckets {
                    let table = self.view(col);
                    let slice = BucketSlice::new(lo, hi, h.bucket_stride);
                    let mut r = 0u64;
                    for j in 0..slice.entries {
                        // Entry j: the first child in bucket j + 1 or later.
                        while r < hi - lo && slice.bucket(self.token_key(toks.get(lo + r))) <= j {
                            r += 1;
                        }
                        let got = table.get(slice.first + j);
                        if got != r {
                            return Err(self.corrupt(format!(
                                "order {n} context {i}: child bucket entry {j} is {got}, expected {r}"
                            )));
                        }
                    }
                }
                if hi - lo > u64::from(h.top_list_len) {
                    let ctx = Ctx {
                        order: n,
                        id: i,
                        lo,
                        hi,
                        count: pc,
                    };
                    let q = self.top_list_pos(&ctx)?.expect("checked");
                    if q != n_lists {
                        return Err(
                            self.corrupt(format!("order {n} top contexts out of order at {i}"))
                        );
                    }
                    n_lists += 1;
                    let l = h.top_list_len as usize;
                    kids.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
                    let lists = self.view(self.levels[n - 1].top_lists.expect("lists"));
                    for (e, &(_, rel)) in kids[..l].iter().enumerate() {
                        let got = lists.get(q * l as u64 + e as u64);
                        if got != rel {
                            return Err(self.corrupt(format!(
                                "order {n} context {i}: top-list entry {e} is {got}, expected {rel}"
                            )));
                        }
                    }
                }
            }
            if n_lists != h.orders[n - 1].top_contexts {
                return Err(self.corrupt(format!(
                    "order {n}: {} top lists stored, {n_lists} contexts need one",
                    h.orders[n - 1].top_contexts
                )));
            }
        }
        Ok(())
    }
}

/// Entries an [`OrderIter`] decodes at a time: big enough that the per-chunk work vanishes,
/// small enough to stay in L1/L2.
const ORDER_CHUNK: usize = 4096;

/// Walks order `n` in key order, tracking each entry's chain of parents. Decodes a chunk of
/// entries at a time (counts in one sequential sweep of their column), so a whole-order read
/// (merge, import, export) costs a few nanoseconds per n-gram.
struct OrderIter<'m> {
    m: &'m NGramModel,
    n: usize,
    /// Next entry of order n to decode, and the end of the entries to walk.
    next: u64,
    end: u64,
    /// Current parent index at orders 1..n-1 (index 0 = order 1).
    chain: Vec<u64>,
    /// End of the current parent's child range, per order 1..n-1.
    ends: Vec<u64>,
    /// Key of the current parent, per order 1..n-1.
    keys: Vec<u64>,
    /// Decoded entries not yet returned: `buf[pos..]`.
    buf: Vec<(u64, u64)>,
    pos: usize,
    /// Scratch for one chunk's count ranks.
    ranks: Vec<u64>,
    started: bool,
    error: Option<NGramError>,
    done: bool,
}

impl<'m> OrderIter<'m> {
    /// The entries of order `n` whose first token is in `first`.
    fn in_range(m: &'m NGramModel, n: usize, first: std::ops::Range<u32>) -> Self {
        let mut it = OrderIter::new(m, n);
        if it.error.is_none() {
            if n == 1 {
                let v = u64::from(m.vocab_size());
                it.next = u64::from(first.start).min(v);
                it.end = u64::from(first.end).min(v);
            } else {
                match (m.first_entry(n, first.start), m.first_entry(n, first.end)) {
                    (Ok(lo), Ok(hi)) => {
                        it.next = lo;
                        it.end = hi.max(lo);
                    }
                    (Err(e), _) | (_, Err(e)) => it.error = Some(e),
                }
            }
        }
        it
    }

    fn new(m: &'m NGramModel, n: usize) -> Self {
        let error = (n == 0 || n > m.order()).then(|| {
            NGramError::InvalidArgument(format!(
                "order {n} asked of {}, an order-{} model",
                m.path.display(),
                m.order()
            ))
        });
        let parents = n.saturating_sub(1);
        OrderIter {
            m,
            n,
            next: 0,
            end: if (1..=m.order()).contains(&n) {
                m.levels[n - 1].entries
            } else {
                0
            },
            chain: vec![0; parents],
            ends: vec![0; parents],
            keys: vec![0; parents],
            buf: Vec::new(),
            pos: 0,
            ranks: Vec::new(),
            started: false,
            error,
            done: false,
        }
    }

    /// Key of the current parent at order `d` from the one below it.
    fn parent_key(&self, d: usize) -> u64 {
        let i = self.chain[d - 1];
        if d == 1 {
            return i;
        }
        let bits = self.m.header.token_bits;
        (self.keys[d - 2] << bits) | self.m.view(self.m.levels[d - 1].tokens).get_narrow(i)
    }

    /// Moves the parent at order `d` (1-based) forward until its children include `child`
    /// (an entry of order d+1), keeping the parents below it consistent.
    fn seek(&mut self, d: usize, child: u64) -> Result<()> {
        let entries = self.m.levels[d - 1].entries;
        while self.ends[d - 1] <= child {
            let i = self.chain[d - 1] + 1;
            if i >= entries {
                return Err(self.m.corrupt(format!(
                    "order {} entry {child} has no parent in order {d}",
                    d + 1
                )));
            }
            let (_, hi) = self.m.children_of(d, i)?;
            self.chain[d - 1] = i;
            self.ends[d - 1] = hi;
            if d > 1 {
                self.seek(d - 1, i)?;
            }
            self.keys[d - 1] = self.parent_key(d);
        }
        Ok(())
    }

    /// Decodes the next chunk of order `n >= 2` into `buf` (empty at the end).
    fn fill(&mut self) -> Result<()> {
        let m = self.m;
        let n = self.n;
        self.buf.clear();
        self.pos = 0;
        let lo = self.next;
        let hi = self.end.min(lo + ORDER_CHUNK as u64);
        if lo >= hi {
            return Ok(());
        }
        if !self.started {
            // Every parent on the first entry of the walk's first token (entry 0 of order 1
            // for a whole order), then made consistent from order 1 up: entry `lo` exists,
            // so do the first entries of every order below.
            let mut first = vec![lo; n];
            for d in (1..n).rev() {
                let below = &m.levels[d - 1];
                let v = m.view(below.children.expect("order below N has children"));
                // The last entry of order d whose children start at or before first[d].
                let at = v.lower_bound(0, below.entries + 1, first[d] + 1);
                first[d - 1] = at.saturating_sub(1).min(below.entries - 1);
            }
            for d in 1..n {
                let (_, hi) = m.children_of(d, first[d - 1])?;
                self.chain[d - 1] = first[d - 1];
                self.ends[d - 1] = hi;
            }
            for (d, &child) in first.iter().enumerate().skip(1) {
                self.seek(d, child)?;
            }
            for d in 1..n {
                self.keys[d - 1] = self.parent_key(d);
            }
            self.started = true;
        }
        self.ranks.resize((hi - lo) as usize, 0);
        match m.ranks(n) {
            Ranks::Plain(p) => {
                for (j, r) in self.ranks.iter_mut().enumerate() {
                    *r = p.get(lo + j as u64);
                }
            }
            Ranks::Coded(c) => c
                .decode(lo, &mut self.ranks)
                .map_err(|(j, e)| m.bad_escape(n, lo + j as u64, e))?,
        }
        let (off, len) = m.levels[n - 1].values;
        let tokens = m.view(m.levels[n - 1].tokens);
        let bits = m.header.token_bits;
        for i in lo..hi {
            if self.ends[n - 2] <= i {
                self.seek(n - 1, i)?;
            }
            let c = self.ranks[(i - lo) as usize];
            if c >= len {
                return Err(m.bad_rank(n, i, c, len));
            }
            let at = off + c as usize * 8;
            let count = u64::from_le_bytes(m.map[at..at + 8].try_into().expect("8 bytes"));
            let key = (self.keys[n - 2] << bits) | tokens.get_narrow(i);
            self.buf.push((key, count));
        }
        self.next = hi;
        Ok(())
    }
}

impl Iterator for OrderIter<'_> {
    type Item = Result<(u64, u64)>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if let Some(&v) = self.buf.get(self.pos) {
            self.pos += 1;
            return Some(Ok(v));
        }
        if self.done {
            return None;
        }
        if let Some(e) = self.error.take() {
            self.done = true;
            return Some(Err(e));
        }
        let m = self.m;
        if self.n == 1 {
            while self.next < self.end {
                let t = self.next;
                self.next += 1;
                match m.count_at(1, t) {
                    Ok(0) => {}
                    Ok(c) => return Some(Ok((t, c))),
                    Err(e) => {
                        self.done = true;
                        return Some(Err(e));
                    }
                }
            }
            self.done = true;
            return None;
        }
        // An error mid-chunk comes after the entries decoded before it.
        if let Err(e) = self.fill() {
            self.error = Some(e);
        }
        if let Some(&v) = self.buf.first() {
            self.pos = 1;
            return Some(Ok(v));
        }
        self.done = true;
        self.error.take().map(Err)
    }
}

/// The entries of one order >= 2 a decoded chunk at a time ([`NGramModel::chunks_from`]).
pub struct OrderChunks<'m>(OrderIter<'m>);

impl OrderChunks<'_> {
    /// Replaces `buf` with the next entries in key order (empty at the end; an error comes
    /// after the entries decoded before it).
    pub fn refill(&mut self, buf: &mut Vec<(u64, u64)>) -> Result<()> {
        let it = &mut self.0;
        buf.clear();
        if let Some(e) = it.error.take() {
            it.done = true;
            return Err(e);
        }
        if it.done {
            return Ok(());
        }
        if it.n < 2 {
            it.done = true;
            return Err(NGramError::InvalidArgument(
                "order 1 is not read in chunks".into(),
            ));
        }
        std::mem::swap(&mut it.buf, buf);
        let filled = it.fill();
        std::mem::swap(&mut it.buf, buf);
        if let Err(e) = filled {
            if buf.is_empty() {
                it.done = true;
                return Err(e);
            }
            it.error = Some(e);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{VERSION, VERSION_PLAIN_COUNTS};
    use crate::testutil::{count_corpus, patch_header, rechecksum, Counts};
    use crate::writer::Layout;
    use proptest::prelude::*;

    /// `path` opened with every check of `verify` (what each format test reads through).
    fn open_verified(path: &Path) -> NGramModel {
        NGramModel::open_with(
            path,
            &OpenOptions {
                verify: true,
                ..Default::default()
            },
        )
        .unwrap()
    }

    fn corpus() -> impl Strategy<Value = (Vec<Vec<u32>>, u32)> {
        (2u32..24).prop_flat_map(|vocab| {
            (
                prop::collection::vec(prop::collection::vec(0..vocab - 1, 0..40), 0..8),
                Just(vocab),
            )
        })
    }

    fn check_against(m: &NGramModel, c: &Counts, contexts: &[Vec<u32>]) {
        assert_eq!(m.count(&[]).unwrap(), c.total);
        for (g, &n) in &c.grams {
            assert_eq!(m.count(g).unwrap(), n, "count of {g:?}");
        }
        let cands: Vec<u32> = (0..c.vocab).collect();
        let mut probs = vec![0f32; cands.len()];
        let mut matched = vec![0u8; cands.len()];
        for ctx in contexts {
            m.prob_many(ctx, &cands, &mut probs, &mut matched).unwrap();
            for &x in &cands {
                let (p, k) = c.prob(ctx, x);
                assert_eq!(
                    (probs[x as usize], matched[x as usize]),
                    (p as f32, k),
                    "P({x} | {ctx:?})"
                );
                if ctx.len() < c.order {
                    let mut g = ctx.clone();
                    g.push(x);
                    assert_eq!(m.count(&g).unwrap(), c.count(&g), "count of {g:?}");
                }
            }
            for k in [1usize, 2, 5, c.vocab as usize + 1] {
                let got = m.top_k(ctx, k).unwrap();
                let want: Vec<(u32, f32)> = c
                    .top_k(ctx, k)
                    .into_iter()
                    .map(|(t, p)| (t, p as f32))
                    .collect();
                assert_eq!(got, want, "top {k} after {ctx:?}");
                let (len, want) = c.continuations(ctx, k);
                let want: Vec<(u32, f32)> = want.into_iter().map(|(t, p)| (t, p as f32)).collect();
                assert_eq!(
                    m.continuations(ctx, k).unwrap(),
                    (len, want),
                    "continuations after {ctx:?}"
                );
            }
        }
        for n in 1..=c.order {
            let got: Vec<(u64, u64)> = m.iter_order(n).collect::<Result<_>>().unwrap();
            let want = if n == 1 {
                c.uni
                    .iter()
                    .enumerate()
                    .filter(|(_, &x)| x > 0)
                    .map(|(t, &x)| (t as u64, x))
                    .collect()
            } else {
                c.stream(n)
            };
            assert_eq!(got, want, "order {n} iteration");
        }
    }

    /// Contexts worth asking: every seen (order-1)-gram and shorter, plus unseen ones.
    fn contexts_of(c: &Counts) -> Vec<Vec<u32>> {
        let mut v: Vec<Vec<u32>> = c
            .grams
            .keys()
            .filter(|g| g.len() < c.order)
            .cloned()
            .collect();
        v.push(vec![]);
        v.push(vec![c.vocab - 1; c.order + 1]);
        v.push((0..c.order as u32 + 2).map(|i| i % c.vocab).collect());
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn round_trip_matches_brute_force(
            (docs, vocab) in corpus(),
            order in 1usize..=4,
            min_count in 1u64..=3,
            top in 1u32..=4,
            eos in any::<bool>(),
            stride in prop::sample::select(vec![0u32, 1, 2, 3, 8]),
            small_context in prop::sample::select(vec![0u64, 2, SMALL_CONTEXT]),
            plain_counts in any::<bool>(),
            code_width in prop::option::of(1u32..=3),
        ) {
            let eos = eos.then_some(vocab - 1);
            let c = count_corpus(&docs, order, vocab, eos, min_count);
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.ngram");
            // Every version: 1 (no buckets), 2 (plain count ranks), 3 (count codes, at the
            // smallest width or a forced one, so that small models reach the escapes too).
            let version = match (stride, plain_counts) {
                (0, _) => 1,
                (_, true) => VERSION_PLAIN_COUNTS,
                _ => VERSION,
            };
            let layout = Layout { version, bucket_stride: stride, code_width };
            let report = c.write_as(&path, top, &layout).unwrap();
            let mut m = open_verified(&path);
            m.small_context = small_context;
            prop_assert_eq!(report.bytes, m.bytes());
            prop_assert_eq!(m.info().format_version, version);
            prop_assert_eq!(m.order(), order);
            prop_assert_eq!(m.eos_id(), eos);
            prop_assert_eq!(m.meta(), c.meta());
            let per = m.ngrams_per_order();
            for n in 1..=order {
                let want = if n == 1 { c.uni.iter().filter(|&&x| x > 0).count() } else { c.grams.keys().filter(|g| g.len() == n).count() };
                prop_assert_eq!(per[n - 1], want as u64);
            }
            check_against(&m, &c, &contexts_of(&c));
        }

        /// More candidates than one search block, large fan-outs and skewed token ids, so
        /// the bucket jumps, the lockstep searches and the block boundaries all get used.
        #[test]
        fn many_candidates_match_brute_force(
            docs in prop::collection::vec(prop::collection::vec((0u32..12, 0u32..140), 0..300), 1..6),
            stride in prop::sample::select(vec![0u32, 1, 2, 5, 8]),
        ) {
            // Mostly small ids (as in real vocabularies), now and then any id.
            let docs: Vec<Vec<u32>> = docs
                .iter()
                .map(|d| d.iter().map(|&(a, b)| if a < 9 { b % 20 } else { b }).collect())
                .collect();
            let c = count_corpus(&docs, 3, 150, Some(149), 1);
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.ngram");
            c.write_with_stride(&path, 4, stride).unwrap();
            let m = open_verified(&path);
            let cands: Vec<u32> = (0..150).rev().collect();
            let (mut p, mut k) = (vec![0f32; 150], vec![0u8; 150]);
            let mut ctxs: Vec<Vec<u32>> = c.grams.keys().filter(|g| g.len() == 2).take(40).cloned().collect();
            ctxs.push(vec![3]);
            ctxs.push(vec![148, 3]);
            for ctx in &ctxs {
                m.prob_many(ctx, &cands, &mut p, &mut k).unwrap();
                for (i, &x) in cands.iter().enumerate() {
                    let (want, len) = c.prob(ctx, x);
                    prop_assert_eq!((p[i], k[i]), (want as f32, len), "P({} | {:?})", x, ctx);
                }
            }
        }

        /// 16-bit token columns (a vocabulary of 32769..=65536 ids, as SmolLM2's 49152) take
        /// `prob_many`'s vector-compare path for small buckets; the last 16 children of a
        /// column, and larger buckets, take the binary search.
        #[test]
        fn sixteen_bit_tokens_match_brute_force(
            docs in prop::collection::vec(prop::collection::vec((0u32..12, 0u32..140), 0..300), 1..6),
            stride in prop::sample::select(vec![0u32, 1, 2, 5, 8]),
            vocab in prop::sample::select(vec![32769u32, 49152, 65536]),
        ) {
            // Mostly a few ids spread over the whole range (high bits set), now and then any.
            let id = |b: u32| b.wrapping_mul(2_654_435_761) % (vocab - 1);
            let docs: Vec<Vec<u32>> = docs
                .iter()
                .map(|d| d.iter().map(|&(a, b)| if a < 9 { id(b % 20) } else { id(b) }).collect())
                .collect();
            let c = count_corpus(&docs, 3, vocab, Some(vocab - 1), 1);
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.ngram");
            c.write_with_stride(&path, 4, stride).unwrap();
            let m = open_verified(&path);
            prop_assert_eq!(m.header.token_bits, 16);
            let mut cands: Vec<u32> = (0..140).map(id).collect();
            cands.extend([0, 1, vocab - 2, vocab - 1, 40000 % vocab]);
            let (mut p, mut k) = (vec![0f32; cands.len()], vec![0u8; cands.len()]);
            let mut ctxs: Vec<Vec<u32>> = c.grams.keys().filter(|g| g.len() == 2).take(40).cloned().collect();
            ctxs.push(vec![id(3)]);
            ctxs.push(vec![vocab - 1, id(3)]);
            for ctx in &ctxs {
                m.prob_many(ctx, &cands, &mut p, &mut k).unwrap();
                for (i, &x) in cands.iter().enumerate() {
                    let (want, len) = c.prob(ctx, x);
                    prop_assert_eq!((p[i], k[i]), (want as f32, len), "P({} | {:?})", x, ctx);
                }
            }
        }
    }

    /// A small order-3 model; `stride` 1 gives every context of 2+ children bucket entries,
    /// 0 writes version 1 (no buckets).
    fn small_model_with(dir: &Path, stride: u32) -> (PathBuf, Counts) {
        let docs = vec![
            vec![1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 6, 1],
            vec![2, 3, 1, 2, 3, 7, 7, 7, 1, 5],
            vec![1, 2, 6, 6, 1, 2, 3],
        ];
        let c = count_corpus(&docs, 3, 9, Some(8), 1);
        let path = dir.join("small.ngram");
        c.write_with_stride(&path, 2, stride).unwrap();
        (path, c)
    }

    fn small_model(dir: &Path) -> (PathBuf, Counts) {
        small_model_with(dir, 1)
    }

    /// Every query kind over every context and candidate; must not panic whatever the bytes.
    fn exercise(m: &NGramModel) {
        let v = m.vocab_size();
        let mut p = vec![0f32; v as usize];
        let mut k = vec![0u8; v as usize];
        let cands: Vec<u32> = (0..v).collect();
        for a in 0..v {
            for b in 0..v {
                let _ = m.prob_many(&[a, b], &cands, &mut p, &mut k);
                let _ = m.top_k(&[a, b], 3);
                let _ = m.top_k(&[a, b], 50);
                let _ = m.count(&[a, b]);
            }
        }
        for n in 1..=m.order() {
            for _ in m.iter_order(n).take(10_000) {}
        }
        let _ = m.verify();
    }

    #[test]
    fn every_truncation_is_refused() {
        for stride in [0, 1] {
            let dir = tempfile::tempdir().unwrap();
            let (path, _) = small_model_with(dir.path(), stride);
            let bytes = std::fs::read(&path).unwrap();
            let cut = dir.path().join("cut.ngram");
            for len in 0..bytes.len() {
                std::fs::write(&cut, &bytes[..len]).unwrap();
                let err = NGramModel::open(&cut).expect_err(&format!("truncated to {len}"));
                assert!(matches!(err, NGramError::Corrupt { .. }), "{len}: {err}");
                assert!(err.to_string().contains("cut.ngram"), "{err}");
            }
        }
    }

    #[test]
    fn header_bytes_are_checked_and_section_bytes_verified() {
        for stride in [0, 1] {
            flipped_bytes_are_caught(stride);
        }
    }

    fn flipped_bytes_are_caught(stride: u32) {
        let dir = tempfile::tempdir().unwrap();
        let (path, c) = small_model_with(dir.path(), stride);
        let bytes = std::fs::read(&path).unwrap();
        let hl = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
        let bad = dir.path().join("bad.ngram");
        let skip = OpenOptions {
            skip_checksums: true,
            ..Default::default()
        };
        let mut caught_when_skipping = 0;
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            std::fs::write(&bad, &b).unwrap();
            // The default open checks every byte: the header by its checksum, the sections by
            // theirs.
            let err = NGramModel::open(&bad).expect_err(&format!("byte {i}"));
            let expect = match i {
                0..=7 => matches!(err, NGramError::NotAModel { .. }),
                8..=11 => matches!(err, NGramError::UnsupportedVersion { .. }),
                _ => matches!(err, NGramError::Corrupt { .. }),
            };
            assert!(expect, "byte {i}: {err}");
            if i >= hl {
                assert!(err.to_string().contains("checksum"), "byte {i}: {err}");
            }
            // Skipping the large sections' checksums: header and small sections still caught;
            // the rest is caught by verify, and queries never panic.
            match NGramModel::open_with(&bad, &skip) {
                Ok(m) => {
                    assert!(i >= hl, "header byte {i} passed");
                    let s = m
                        .header
                        .sections
                        .iter()
                        .find(|s| (s.offset..s.offset + s.length).contains(&(i as u64)))
                        .unwrap();
                    assert!(!always_checked(s), "byte {i} of {s:?} passed");
                    let err = m.verify().expect_err(&format!("section byte {i}"));
                    assert!(err.to_string().contains("checksum"), "{err}");
                    exercise(&m);
                }
                Err(e) => {
                    assert!(matches!(
                        e,
                        NGramError::Corrupt { .. }
                            | NGramError::NotAModel { .. }
                            | NGramError::UnsupportedVersion { .. }
                    ));
                    caught_when_skipping += 1;
                }
            }
        }
        assert!(
            caught_when_skipping > hl,
            "the small sections are checked too"
        );
        // The pristine file answers correctly after all that.
        let m = NGramModel::open(&path).unwrap();
        assert_eq!(m.integrity(), Integrity::Checksums);
        m.verify().unwrap();
        check_against(&m, &c, &contexts_of(&c));
        let m = NGramModel::open_with(&path, &skip).unwrap();
        assert_eq!(m.integrity(), Integrity::Small);
        check_against(&m, &c, &contexts_of(&c));
    }

    #[test]
    fn inconsistent_headers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = small_model(dir.path());
        let file_len = std::fs::metadata(&path).unwrap().len();
        type Patch = Box<dyn Fn(&mut Header)>;
        let cases: Vec<(&str, Patch)> = vec![
            (
                "outside",
                Box::new(move |h| h.sections[2].offset = file_len),
            ),
            ("outside", Box::new(|h| h.sections[0].offset = 8)),
            ("imply", Box::new(|h| h.sections[1].length += 8)),
            // The child-bucket table of order 2 has one entry per order-3 n-gram at stride 1.
            ("imply", Box::new(|h| h.orders[2].ngrams += 1)),
            ("width", Box::new(|h| h.orders[1].child_width += 1)),
            ("token width", Box::new(|h| h.token_bits += 1)),
            ("eos", Box::new(|h| h.eos = 100)),
            ("expected", Box::new(|h| h.sections.swap(0, 1))),
            ("bucket stride", Box::new(|h| h.version = 1)),
            ("bucket stride", Box::new(|h| h.bucket_stride = 0)),
            (
                "child bucket width",
                Box::new(|h| h.orders[0].bucket_width = 0),
            ),
            ("has children", Box::new(|h| h.orders[2].bucket_width = 3)),
            (
                "child bucket width",
                Box::new(|h| h.orders[1].bucket_width = h.orders[1].child_width + 1),
            ),
            ("imply", Box::new(|h| h.bucket_stride = 1000)),
            (
                "count code width",
                Box::new(|h| h.orders[1].count_width = 0),
            ),
            (
                "count code width",
                Box::new(|h| h.orders[2].count_width = 17),
            ),
            (
                "escaped counts",
                Box::new(|h| h.orders[2].count_escapes = 1000),
            ),
            // A version-2 reading of a version-3 file expects count ranks.
            ("count rank width", Box::new(|h| h.version = 2)),
        ];
        for (want, f) in cases {
            let p = dir.path().join("x.ngram");
            std::fs::copy(&path, &p).unwrap();
            patch_header(&p, f);
            let err = NGramModel::open(&p).expect_err(want);
            assert!(
                matches!(err, NGramError::Corrupt { .. }) && err.to_string().contains(want),
                "{want}: {err}"
            );
        }
        // Without buckets (version 1) the same patch reaches the CSR cross-check.
        let (path, _) = small_model_with(dir.path(), 0);
        patch_header(&path, |h| h.orders[2].ngrams += 1);
        let err = NGramModel::open(&path).unwrap_err();
        assert!(err.to_string().contains("child offsets span"), "{err}");
    }

    #[test]
    fn corrupt_offsets_found_at_query_time_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = small_model(dir.path());
        let mut bytes = std::fs::read(&path).unwrap();
        let m = NGramModel::open(&path).unwrap();
        // Point token 1's children past the end of order 2 (checksums then recomputed).
        let s = *m.header.section(SectionKind::ChildOffsets, 1).unwrap();
        let w = m.header.orders[0].child_width;
        drop(m);
        let bit = 2 * w as usize;
        for b in 0..w as usize {
            let at = s.offset as usize * 8 + bit + b;
            bytes[at / 8] |= 1 << (at % 8);
        }
        std::fs::write(&path, &bytes).unwrap();
        assert!(NGramModel::open(&path).is_err(), "stale checksum");
        rechecksum(&path);
        let m = NGramModel::open(&path).unwrap();
        let err = m.prob(&[1, 2], 3).unwrap_err();
        assert!(
            matches!(err, NGramError::Corrupt { .. }) && err.to_string().contains("children"),
            "{err}"
        );
        assert!(m.verify().is_err());
        exercise(&m);
    }

    #[test]
    fn corrupt_child_buckets_are_errors_at_query_time() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = small_model(dir.path());
        let mut bytes = std::fs::read(&path).unwrap();
        let m = NGramModel::open(&path).unwrap();
        m.verify().unwrap();
        // Every bucket entry of token 1's children set to all ones (checksums then recomputed).
        let (lo, hi) = m.children_of(1, 1).unwrap();
        let slice = BucketSlice::new(lo, hi, m.header.bucket_stride);
        assert!(slice.entries > 0, "token 1 has bucket entries at stride 1");
        let s = *m.header.section(SectionKind::ChildBuckets, 1).unwrap();
        let w = m.header.orders[0].bucket_width as u64;
        drop(m);
        for bit in slice.first * w..(slice.first + slice.entries) * w {
            let at = s.offset as usize * 8 + bit as usize;
            bytes[at / 8] |= 1 << (at % 8);
        }
        std::fs::write(&path, &bytes).unwrap();
        assert!(NGramModel::open(&path).is_err(), "stale checksum");
        rechecksum(&path);
        let mut m = NGramModel::open(&path).unwrap();
        m.small_context = 0;
        for r in [m.prob(&[1, 2], 3).map(|_| ()), m.count(&[1, 2]).map(|_| ())] {
            let err = r.unwrap_err();
            assert!(
                matches!(err, NGramError::Corrupt { .. }) && err.to_string().contains("bucket"),
                "{err}"
            );
        }
        assert!(m.verify().is_err());
        exercise(&m);
    }

    /// A damage done to a valid file: flip bits, overwrite bytes, cut or extend it.
    #[derive(Clone, Debug)]
    enum Damage {
        Flip(usize, u8),
        Set(usize, u8),
        Truncate(usize),
        Extend(Vec<u8>),
    }

    fn damage() -> impl Strategy<Value = Damage> {
        prop_oneof![
            4 => (any::<usize>(), 0u8..8).prop_map(|(i, b)| Damage::Flip(i, b)),
            2 => (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Damage::Set(i, v)),
            1 => any::<usize>().prop_map(Damage::Truncate),
            1 => proptest::collection::vec(any::<u8>(), 1..64).prop_map(Damage::Extend),
        ]
    }

    fn apply(bytes: &mut Vec<u8>, d: &Damage) {
        let n = bytes.len();
        match d {
            Damage::Flip(i, b) => bytes[i % n] ^= 1 << b,
            Damage::Set(i, v) => bytes[i % n] = *v,
            Damage::Truncate(i) => bytes.truncate(i % n),
            Damage::Extend(more) => bytes.extend(more),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// One bit flipped anywhere in the header or the section table: always refused on
        /// open, checksums skipped or not.
        #[test]
        fn header_bit_flips_are_always_detected(i in any::<usize>(), bit in 0u8..8, stride in 0u32..2) {
            let dir = tempfile::tempdir().unwrap();
            let (path, _) = small_model_with(dir.path(), stride);
            let mut bytes = std::fs::read(&path).unwrap();
            let hl = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
            bytes[i % hl] ^= 1 << bit;
            std::fs::write(&path, &bytes).unwrap();
            for skip_checksums in [false, true] {
                let opts = OpenOptions { skip_checksums, ..Default::default() };
                prop_assert!(NGramModel::open_with(&path, &opts).is_err(), "byte {}", i % hl);
            }
        }

        /// Random damage (bit flips, overwritten bytes, truncation, junk appended): the default
        /// open refuses every changed file with a clean error, and whatever opens without
        /// checksums answers every query (or errs) without panicking.
        #[test]
        fn damaged_files_never_panic(ds in proptest::collection::vec(damage(), 1..6), stride in 0u32..2) {
            let dir = tempfile::tempdir().unwrap();
            let (path, _) = small_model_with(dir.path(), stride);
            let good = std::fs::read(&path).unwrap();
            let mut bytes = good.clone();
            for d in &ds {
                if !bytes.is_empty() {
                    apply(&mut bytes, d);
                }
            }
            std::fs::write(&path, &bytes).unwrap();
            for in_memory in [false, true] {
                let opts = OpenOptions { in_memory, ..Default::default() };
                match NGramModel::open_with(&path, &opts) {
                    Ok(m) => {
                        prop_assert_eq!(&bytes, &good, "a damaged file opened");
                        exercise(&m);
                    }
                    Err(e) => {
                        prop_assert!(bytes != good, "{}", e);
                        prop_assert!(e.to_string().contains("small.ngram"), "{}", e);
                    }
                }
            }
            let skip = OpenOptions { skip_checksums: true, ..Default::default() };
            if let Ok(m) = NGramModel::open_with(&path, &skip) {
                exercise(&m);
            }
        }
    }

    #[test]
    fn trailing_bytes_and_gaps_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = small_model(dir.path());
        let bytes = std::fs::read(&path).unwrap();
        let bad = dir.path().join("bad.ngram");
        for junk in [1usize, 8, 1000] {
            let mut b = bytes.clone();
            b.extend(std::iter::repeat_n(0u8, junk));
            std::fs::write(&bad, &b).unwrap();
            let err = NGramModel::open(&bad).unwrap_err();
            assert!(
                err.to_string()
                    .contains(&format!("{junk} bytes after the last section")),
                "{err}"
            );
        }
        // A gap between two sections (offsets moved, checksum valid) is refused too.
        std::fs::write(&bad, &bytes).unwrap();
        patch_header(&bad, |h| {
            let last = h.sections.len() - 1;
            h.sections[last].offset += 8;
        });
        let mut b = std::fs::read(&bad).unwrap();
        b.extend([0u8; 8]);
        std::fs::write(&bad, &b).unwrap();
        let err = NGramModel::open(&bad).unwrap_err();
        assert!(err.to_string().contains("right after"), "{err}");
    }

    #[test]
    fn a_file_rewritten_in_place_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = small_model(dir.path());
        let bytes = std::fs::read(&path).unwrap();
        let mapped = NGramModel::open(&path).unwrap();
        let copied = NGramModel::open_with(
            &path,
            &OpenOptions {
                in_memory: true,
                ..Default::default()
            },
        )
        .unwrap();
        mapped.check_unchanged().unwrap();
        // Replaced by a rename: the mapping keeps the old file, nothing to report.
        let other = dir.path().join("new.ngram");
        std::fs::write(&other, &bytes).unwrap();
        std::fs::rename(&other, &path).unwrap();
        mapped.check_unchanged().unwrap();
        let mapped = NGramModel::open(&path).unwrap();
        // Rewritten in place (same inode, as `cp` over it does): reported, not a SIGBUS later.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(bytes.len() as u64 / 2)
            .unwrap();
        let err = mapped.check_unchanged().unwrap_err();
        assert!(matches!(err, NGramError::Changed { .. }), "{err}");
        assert!(err.to_string().contains("modified in place"), "{err}");
        // The in-memory copy is unaffected and still answers.
        copied.check_unchanged().unwrap();
        copied.top_k(&[1], 3).unwrap();
    }

    #[test]
    fn version_1_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let (path, c) = small_model_with(dir.path(), 0);
        let m = open_verified(&path);
        assert_eq!(m.info().format_version, 1);
        assert!(m.info().sections.iter().all(|s| s.kind != "child-buckets"));
        check_against(&m, &c, &contexts_of(&c));
        // A version this build does not know is refused by name, with what to do.
        patch_header(&path, |h| h.version = VERSION + 1);
        let err = NGramModel::open(&path).unwrap_err();
        assert!(
            matches!(
                err,
                NGramError::UnsupportedVersion {
                    found: 4,
                    min: 1,
                    max: 3,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("newer dart-ngram"), "{err}");
    }

    /// Version 2 files (count ranks at a fixed width) are read and answer as version 3 does;
    /// a merge rewrites one as version 3, smaller.
    #[test]
    fn version_2_files_are_read_and_merged_into_version_3() {
        let dir = tempfile::tempdir().unwrap();
        let docs: Vec<Vec<u32>> = (0..40u32)
            .map(|d| {
                (0..200u32)
                    .map(|i| (i * i + d) % 97 % (1 + i % 29))
                    .collect()
            })
            .collect();
        let c = count_corpus(&docs, 3, 100, Some(99), 1);
        let v2 = dir.path().join("v2.ngram");
        let layout = Layout {
            version: VERSION_PLAIN_COUNTS,
            bucket_stride: 8,
            code_width: None,
        };
        c.write_as(&v2, 4, &layout).unwrap();
        let m = open_verified(&v2);
        assert_eq!(m.info().format_version, 2);
        assert!(m.info().sections.iter().any(|s| s.kind == "count-ranks"));
        check_against(&m, &c, &contexts_of(&c));
        let v3 = dir.path().join("v3.ngram");
        crate::merge_models(&[&v2], &v3, &crate::MergeOptions::default()).unwrap();
        let m3 = open_verified(&v3);
        assert_eq!(m3.info().format_version, 3);
        let kinds: Vec<&str> = m3.info().sections.iter().map(|s| s.kind).collect();
        assert!(kinds.contains(&"count-codes") && !kinds.contains(&"count-ranks"));
        check_against(&m3, &c, &contexts_of(&c));
        assert!(m3.bytes() < m.bytes(), "{} vs {}", m3.bytes(), m.bytes());
    }

    /// A count-code block whose escape base points past the escapes: an error at query time
    /// (never a panic) and in verify; a base that is merely wrong is caught by verify.
    #[test]
    fn corrupt_count_codes_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (small, c) = small_model(dir.path());
        let path = dir.path().join("coded.ngram");
        // One-bit codes: every count above the smallest escapes.
        let layout = Layout {
            version: VERSION,
            bucket_stride: 1,
            code_width: Some(1),
        };
        c.write_as(&path, 2, &layout).unwrap();
        let m = open_verified(&path);
        check_against(&m, &c, &contexts_of(&c));
        assert!(m.header.orders[1].count_escapes > 0);
        assert!(m.bytes() != std::fs::metadata(&small).unwrap().len());
        let s = *m.header.section(SectionKind::CountCodes, 2).unwrap();
        drop(m);
        for (base, want) in [(1000u64, "escape"), (1, "escapes before it")] {
            let mut bytes = std::fs::read(&path).unwrap();
            let at = s.offset as usize;
            bytes[at..at + 8].copy_from_slice(&base.to_le_bytes());
            let bad = dir.path().join("bad.ngram");
            std::fs::write(&bad, &bytes).unwrap();
            assert!(NGramModel::open(&bad).is_err(), "stale checksum");
            rechecksum(&bad);
            let m = NGramModel::open(&bad).unwrap();
            let err = m.verify().unwrap_err();
            assert!(err.to_string().contains(want), "{err}");
            if base == 1000 {
                // [1, 2] was seen 5 times: an escaped count.
                let err = m.count(&[1, 2]).unwrap_err();
                assert!(
                    matches!(err, NGramError::Corrupt { .. }) && err.to_string().contains("escape"),
                    "{err}"
                );
                let err = m.prob(&[1], 2).unwrap_err();
                assert!(err.to_string().contains("escape"), "{err}");
            }
            exercise(&m);
        }
    }

    #[test]
    fn foreign_and_empty_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("foreign.bin");
        std::fs::write(
            &p,
            b"PK\x03\x04 this is a zip file, not a model at all, really......",
        )
        .unwrap();
        let err = NGramModel::open(&p).unwrap_err();
        assert!(
            matches!(err, NGramError::NotAModel { .. }) && err.to_string().contains("foreign.bin"),
            "{err}"
        );
        std::fs::write(&p, b"").unwrap();
        assert!(matches!(
            NGramModel::open(&p).unwrap_err(),
            NGramError::Corrupt { .. }
        ));
        let err = NGramModel::open(&dir.path().join("missing.ngram")).unwrap_err();
        assert!(matches!(err, NGramError::Io { .. }) && err.to_string().contains("missing.ngram"));
    }

    #[test]
    fn fingerprint_and_vocabulary_checks() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = small_model(dir.path());
        let m = NGramModel::open(&path).unwrap();
        m.check_fingerprint(&[7u8; 32]).unwrap();
        let err = m.check_fingerprint(&[8u8; 32]).unwrap_err();
        assert!(
            matches!(err, NGramError::TokenizerMismatch { .. }) && err.to_string().contains("0808"),
            "{err}"
        );
        let oov = |r: Result<()>| {
            matches!(
                r,
                Err(NGramError::TokenOutOfVocab {
                    token: 9,
                    vocab_size: 9
                })
            )
        };
        let (mut p, mut k) = ([0f32; 2], [0u8; 2]);
        assert!(oov(m.prob_many(&[1, 9], &[1, 2], &mut p, &mut k)));
        assert!(oov(m.prob_many(&[1, 2], &[1, 9], &mut p, &mut k)));
        assert!(oov(m.top_k(&[9], 3).map(|_| ())));
        assert!(oov(m.count(&[9]).map(|_| ())));
        // Only the last order-1 context tokens are used (and checked).
        assert!(m.prob_many(&[9, 1, 2], &[1, 2], &mut p, &mut k).is_ok());
        assert!(matches!(
            m.count(&[1, 2, 3, 1]),
            Err(NGramError::InvalidArgument(_))
        ));
        assert!(matches!(
            m.prob_many(&[1], &[1, 2], &mut p[..1], &mut k),
            Err(NGramError::InvalidArgument(_))
        ));
        assert!(m.iter_order(4).next().unwrap().is_err());
    }

    #[test]
    fn model_is_send_and_sync_and_opens_with_options() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<NGramModel>();
        let dir = tempfile::tempdir().unwrap();
        let (path, c) = small_model(dir.path());
        for in_memory in [false, true] {
            let opts = OpenOptions {
                verify: true,
                populate: true,
                lock: false,
                huge_pages: true,
                in_memory,
                skip_checksums: false,
                random_access: !in_memory,
                prefetch: false,
            };
            let m = NGramModel::open_with(&path, &opts).unwrap();
            check_against(&m, &c, &contexts_of(&c));
            // Populated (or copied): every byte is resident.
            assert_eq!(m.resident_bytes().unwrap(), m.bytes());
            // Evicting the pages changes no answer (they are read again from the file); an
            // in-memory copy has none to evict.
            for eviction in [Eviction::Mapping, Eviction::PageCache] {
                match m.evict_pages(eviction) {
                    Ok(()) => assert!(!in_memory),
                    Err(e) => assert!(in_memory && e.to_string().contains("in-memory"), "{e}"),
                }
                check_against(&m, &c, &contexts_of(&c));
            }
        }
        // A prefetching open answers at once and the same; the background read-ahead leaves
        // the whole file resident (the evictions above may have dropped it).
        let m = NGramModel::open_with(
            &path,
            &OpenOptions {
                prefetch: true,
                ..Default::default()
            },
        )
        .unwrap();
        check_against(&m, &c, &contexts_of(&c));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while m.resident_bytes().unwrap() < m.bytes() {
            assert!(
                std::time::Instant::now() < deadline,
                "prefetch never finished"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let m = NGramModel::open(&path).unwrap();
        let info = m.info();
        assert_eq!(info.total_ngrams, info.ngrams_per_order.iter().sum::<u64>());
        assert!(info.bytes_per_ngram > 0.0);
        let json = serde_json::to_string(&info).unwrap();
        assert!(json.contains("\"tokenizer_fingerprint\":\"0707"), "{json}");
    }
}
