//! Bounded-memory counting of n-grams of orders 2..=N.
//!
//! Counts aggregate in one fixed-capacity open-addressing table ([`CountTable`]) sized from
//! the memory budget and allocated once, so it never rehashes. When it reaches its load
//! limit, its entries are sorted by `(order, key)` and spilled as one run file per order;
//! at the end the runs of each order are merged (k-way, bounded fan-in, with intermediate
//! merges when there are many runs) into one sorted stream per order for
//! [`dart_ngram::writer::write_model`].
//!
//! Run files are private temporaries: a sequence of `(varint key delta, varint count)`
//! records, keys strictly ascending. They live in a [`tempfile::TempDir`], so they are removed
//! when the counter or its result is dropped, on success, error or unwinding.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use dart_ngram::error::{NGramError, Result};
use dart_ngram::key;
use dart_ngram::varint;
use dart_ngram::writer::CountStream;

/// Bytes of one table slot: `(key, order << 56 | count)`.
pub const SLOT_BYTES: u64 = 16;
/// Fill limit of the table, in percent of its slots (linear probing slows past ~75%).
const MAX_LOAD_PERCENT: u64 = 70;
/// In-memory counts live in the low 56 bits of a slot's value, the order in the high 8.
const COUNT_BITS: u32 = 56;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// Runs merged at once; more runs get intermediate merges first. With [`RUN_BUF`] this bounds
/// the merge's buffers to `MAX_FAN_IN * RUN_BUF` bytes per order.
pub const MAX_FAN_IN: usize = 64;
/// Read/write buffer of one run file.
const RUN_BUF: usize = 64 * 1024;
/// Smallest table, whatever the budget, so tiny budgets still make progress.
const MIN_SLOTS: u64 = 1024;

/// What to do when the same n-gram is added twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DuplicatePolicy {
    /// Counting a corpus: occurrences add up.
    Sum,
    /// Importing a trie where each n-gram is one node: a repeat is an error.
    Reject,
}

/// Fixed-capacity linear-probing hash table from `(order, key)` to a count.
pub struct CountTable {
    slots: Vec<[u64; 2]>,
    len: u64,
    max_len: u64,
}

#[inline]
fn mix(order: usize, key: u64) -> u64 {
    // murmur3's 64-bit finalizer: packed n-gram keys are highly structured, so their bits
    // must be spread before range reduction.
    let mut x = key ^ (order as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Asks for transparent huge pages over a large, not yet touched allocation (best effort):
/// the table is probed at random, so with 4 KB pages every insert misses the TLB and the
/// first touch of each page is a fault that zeroes 4 KB (measured: most of the counting time
/// of a 4 GB table went to the kernel).
fn advise_huge_pages<T>(v: &[T]) {
    const PAGE: usize = 4096;
    let start = v.as_ptr() as usize;
    let end = start + std::mem::size_of_val(v);
    let aligned = start.next_multiple_of(PAGE);
    if end > aligned + (2 << 20) {
        // SAFETY: the range lies inside the allocation; MADV_HUGEPAGE changes no contents.
        unsafe {
            libc::madvise(
                aligned as *mut libc::c_void,
                (end - aligned) / PAGE * PAGE,
                libc::MADV_HUGEPAGE,
            );
        }
    }
}

impl CountTable {
    /// A table using at most `bytes` of memory (at least [`MIN_SLOTS`] slots).
    pub fn with_bytes(bytes: u64) -> Self {
        let slots = (bytes / SLOT_BYTES).max(MIN_SLOTS);
        // vec![0; n] maps zeroed pages lazily: memory is touched only as slots fill.
        let table = CountTable {
            slots: vec![[0u64; 2]; slots as usize],
            len: 0,
            max_len: slots * MAX_LOAD_PERCENT / 100,
        };
        advise_huge_pages(&table.slots);
        table
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.slots.len() as u64 * SLOT_BYTES
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the next new n-gram must wait for a spill.
    pub fn is_full(&self) -> bool {
        self.len >= self.max_len
    }

    #[inline]
    fn home(&self, order: usize, key: u64) -> usize {
        // Range reduction by multiply-shift: any capacity, not just powers of two.
        ((u128::from(mix(order, key)) * u128::from(self.slots.len() as u64)) >> 64) as usize
    }

    /// Starts loading the slot where `(order, key)` would go, so that an [`add`](Self::add)
    /// issued a little later finds it in cache (the table is far larger than the caches).
    #[inline]
    pub fn prefetch(&self, order: usize, key: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.slots.as_ptr().wrapping_add(self.home(order, key));
            // SAFETY: prefetching never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (order, key);
    }

    /// Adds `count` to `(order, key)`; returns whether the n-gram was new.
    ///
    /// The caller spills when [`is_full`](Self::is_full); the table is never fuller than
    /// its load limit plus one, so probing always finds a free slot.
    #[inline]
    pub fn add(&mut self, order: usize, key: u64, count: u64) -> Result<bool> {
        let tag = (order as u64) << COUNT_BITS;
        let mut i = self.home(order, key);
        loop {
            let slot = &mut self.slots[i];
            if slot[1] == 0 {
                if count == 0 || count > COUNT_MASK {
                    return Err(count_error(order, key, count));
                }
                *slot = [key, tag | count];
                self.len += 1;
                return Ok(true);
            }
            if slot[0] == key && slot[1] & !COUNT_MASK == tag {
                let c = (slot[1] & COUNT_MASK) + count;
                if c > COUNT_MASK {
                    return Err(count_error(order, key, c));
                }
                slot[1] = tag | c;
                return Ok(false);
            }
            i += 1;
            if i == self.slots.len() {
                i = 0;
            }
        }
    }

    /// Moves the entries to the front, sorted by `(order, key)`; returns how many there are.
    fn compact_sorted(&mut self) -> usize {
        let mut w = 0usize;
        for r in 0..self.slots.len() {
            if self.slots[r][1] != 0 {
                if w != r {
                    self.slots[w] = self.slots[r];
                    self.slots[r] = [0, 0];
                }
                w += 1;
            }
        }
        // `order << 56 | count` sorts by order first; ties broken by key.
        self.slots[..w].sort_unstable_by_key(|s| (s[1] >> COUNT_BITS, s[0]));
        w
    }

    /// The entries sorted by `(order, key)`, leaving the table empty once the chunk is
    /// dropped.
    pub fn drain_sorted(&mut self) -> SortedChunk<'_> {
        let w = self.compact_sorted();
        self.len = 0;
        SortedChunk {
            slots: &mut self.slots[..w],
        }
    }
}

fn count_error(order: usize, key: u64, count: u64) -> NGramError {
    NGramError::InvalidArgument(format!(
        "count {count} of an order-{order} n-gram (key {key:#x}) is outside 1..=2^56-1 \
         in the in-memory counter"
    ))
}

/// The sorted contents of a drained [`CountTable`]; zeroes the slots when dropped.
pub struct SortedChunk<'a> {
    slots: &'a mut [[u64; 2]],
}

impl SortedChunk<'_> {
    /// The `(key, count)` pairs of one order, ascending by key.
    pub fn order(&self, order: usize) -> impl Iterator<Item = (u64, u64)> + '_ {
        live_order(self.slots, order)
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

impl Drop for SortedChunk<'_> {
    fn drop(&mut self) {
        self.slots.fill([0, 0]);
    }
}

// ---------------------------------------------------------------------------------------
// Run files

/// Writes one sorted run: `(varint key delta, varint count)` records
/// ([`varint::encode_pair`]).
pub struct RunWriter {
    path: PathBuf,
    out: BufWriter<File>,
    last: Option<u64>,
    records: u64,
}

impl RunWriter {
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).map_err(|e| spill_io(path, e))?;
        Ok(RunWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(RUN_BUF, file),
            last: None,
            records: 0,
        })
    }

    pub fn push(&mut self, key: u64, count: u64) -> Result<()> {
        if let Some(last) = self.last.filter(|&last| key <= last) {
            return Err(NGramError::InvalidArgument(format!(
                "{}: run keys must be strictly ascending, got {key:#x} after {last:#x}",
                self.path.display()
            )));
        }
        let mut record = [0u8; varint::MAX_PAIR_LEN];
        let n = varint::encode_pair(self.last.unwrap_or(0), key, count, &mut record);
        self.last = Some(key);
        self.out
            .write_all(&record[..n])
            .map_err(|e| spill_io(&self.path, e))?;
        self.records += 1;
        Ok(())
    }

    /// Flushes the run; returns how many records it holds.
    pub fn finish(mut self) -> Result<u64> {
        self.out.flush().map_err(|e| spill_io(&self.path, e))?;
        Ok(self.records)
    }
}

/// I/O errors on spill files say where the spill directory is, since a full disk there is
/// the usual cause and `--tmp-dir` the remedy.
fn spill_io(path: &Path, e: std::io::Error) -> NGramError {
    if e.kind() == std::io::ErrorKind::StorageFull {
        return NGramError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(
                e.kind(),
                format!(
                    "{e}: the disk holding the temporary count runs is full; \
                     free space or point the temporary directory elsewhere (--tmp-dir)"
                ),
            ),
        };
    }
    NGramError::io(path, e)
}

/// Reads a run written by [`RunWriter`].
pub struct RunReader {
    path: PathBuf,
    input: BufReader<File>,
    last: u64,
}

impl RunReader {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| NGramError::io(path, e))?;
        Ok(RunReader {
            path: path.to_path_buf(),
            input: BufReader::with_capacity(RUN_BUF, file),
            last: 0,
        })
    }

    fn corrupt(&self, detail: &str) -> NGramError {
        NGramError::Corrupt {
            path: self.path.clone(),
            detail: format!("temporary count run: {detail}"),
        }
    }

    /// The next `(key, count)`, or `None` at the end of the run.
    pub fn next_pair(&mut self) -> Result<Option<(u64, u64)>> {
        let at_end = loop {
            match self.input.fill_buf() {
                Ok(b) => break b.is_empty(),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(NGramError::io(&self.path, e)),
            }
        };
        if at_end {
            return Ok(None);
        }
        let (key, count) =
            varint::read_pair(&mut self.input, self.last).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => self.corrupt("truncated record"),
                std::io::ErrorKind::InvalidData => self.corrupt(&e.to_string()),
                _ => NGramError::io(&self.path, e),
            })?;
        self.last = key;
        Ok(Some((key, count)))
    }
}

// ---------------------------------------------------------------------------------------
// Merging

/// One sorted input of a merge.
pub enum Source<'a> {
    Run(RunReader),
    Memory(Box<dyn Iterator<Item = (u64, u64)> + Send + 'a>),
}

impl Source<'_> {
    fn next_pair(&mut self) -> Result<Option<(u64, u64)>> {
        match self {
            Source::Run(r) => r.next_pair(),
            Source::Memory(it) => Ok(it.next()),
        }
    }
}

/// K-way merge of sorted sources, combining equal keys by the [`DuplicatePolicy`].
pub struct Merge<'a> {
    sources: Vec<Source<'a>>,
    heads: BinaryHeap<Reverse<(u64, u64, usize)>>,
    policy: DuplicatePolicy,
    started: bool,
    failed: bool,
    /// Names the n-gram in duplicate errors.
    describe: Box<dyn Fn(u64) -> String + Send + 'a>,
    source: Option<PathBuf>,
}

impl<'a> Merge<'a> {
    pub fn new(
        sources: Vec<Source<'a>>,
        policy: DuplicatePolicy,
        describe: Box<dyn Fn(u64) -> String + Send + 'a>,
    ) -> Self {
        Merge {
            heads: BinaryHeap::with_capacity(sources.len()),
            sources,
            policy,
            started: false,
            failed: false,
            describe,
            source: None,
        }
    }

    fn naming(mut self, source: Option<PathBuf>) -> Self {
        self.source = source;
        self
    }

    fn refill(&mut self, i: usize) -> Result<()> {
        if let Some((k, c)) = self.sources[i].next_pair()? {
            self.heads.push(Reverse((k, c, i)));
        }
        Ok(())
    }

    fn step(&mut self) -> Result<Option<(u64, u64)>> {
        if !self.started {
            self.started = true;
            for i in 0..self.sources.len() {
                self.refill(i)?;
            }
        }
        let Some(Reverse((key, mut count, i))) = self.heads.pop() else {
            return Ok(None);
        };
        self.refill(i)?;
        while let Some(&Reverse((k2, c2, j))) = self.heads.peek() {
            if k2 != key {
                break;
            }
            self.heads.pop();
            match self.policy {
                DuplicatePolicy::Sum => {
                    count = count
                        .checked_add(c2)
                        .ok_or_else(|| NGramError::CountOverflow {
                            path: PathBuf::new(),
                            detail: format!("the count of {} exceeds 2^64-1", (self.describe)(key)),
                        })?
                }
                DuplicatePolicy::Reject => {
                    return Err(duplicate_error(
                        self.source.as_deref(),
                        (self.describe)(key),
                    ))
                }
            }
            self.refill(j)?;
        }
        Ok(Some((key, count)))
    }
}

impl Iterator for Merge<'_> {
    type Item = Result<(u64, u64)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.step() {
            Ok(Some(p)) => Some(Ok(p)),
            Ok(None) => None,
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The counter

/// Counts n-grams of orders `2..=max_order` within a memory budget.
pub struct ExternalCounter {
    table: CountTable,
    max_order: usize,
    bits: u32,
    policy: DuplicatePolicy,
    dir: tempfile::TempDir,
    /// Held while the runs are in use: marks the directory as a live job's scratch.
    _lock: std::fs::File,
    /// Run files per order (index `order - 2`).
    runs: Vec<Vec<PathBuf>>,
    spills: u64,
    next_file: u64,
    /// The input named in duplicate errors ([`DuplicatePolicy::Reject`]).
    source: Option<PathBuf>,
}

/// The error for an n-gram met twice under [`DuplicatePolicy::Reject`].
fn duplicate_error(source: Option<&Path>, what: String) -> NGramError {
    let detail = format!("{what} occurs twice; expected each n-gram once");
    match source {
        Some(p) => NGramError::Corrupt {
            path: p.to_path_buf(),
            detail,
        },
        None => NGramError::InvalidArgument(detail),
    }
}

impl ExternalCounter {
    /// `table_bytes` is the memory the table may use; runs go to a fresh temporary directory
    /// inside `tmp_parent`.
    pub fn new(
        table_bytes: u64,
        max_order: usize,
        bits: u32,
        policy: DuplicatePolicy,
        tmp_parent: &Path,
    ) -> Result<Self> {
        dart_ngram::scratch::clean_stale(tmp_parent);
        let (dir, lock) = dart_ngram::scratch::tempdir(tmp_parent, "runs")?;
        Ok(ExternalCounter {
            table: CountTable::with_bytes(table_bytes),
            max_order,
            bits,
            policy,
            dir,
            _lock: lock,
            runs: vec![Vec::new(); max_order.saturating_sub(1)],
            spills: 0,
            next_file: 0,
            source: None,
        })
    }

    /// Names `path` (as corrupt) in duplicate errors.
    pub fn duplicates_name(mut self, path: &Path) -> Self {
        self.source = Some(path.to_path_buf());
        self
    }

    pub fn table_bytes(&self) -> u64 {
        self.table.capacity_bytes()
    }

    /// Number of times the table was spilled so far.
    pub fn spills(&self) -> u64 {
        self.spills
    }

    pub fn temp_dir(&self) -> &Path {
        self.dir.path()
    }

    /// See [`CountTable::prefetch`].
    #[inline]
    pub fn prefetch(&self, order: usize, key: u64) {
        self.table.prefetch(order, key);
    }

    /// Adds `count` occurrences of the n-gram `key` of `order` (2..=max_order).
    #[inline]
    pub fn add(&mut self, order: usize, key: u64, count: u64) -> Result<()> {
        debug_assert!((2..=self.max_order).contains(&order));
        let new = self.table.add(order, key, count)?;
        if !new && self.policy == DuplicatePolicy::Reject {
            return Err(duplicate_error(
                self.source.as_deref(),
                describe_key(key, order, self.bits),
            ));
        }
        if self.table.is_full() {
            self.spill()?;
        }
        Ok(())
    }

    fn new_run_path(&mut self, order: usize) -> PathBuf {
        self.next_file += 1;
        self.dir
            .path()
            .join(format!("order{order}-{:06}.run", self.next_file))
    }

    /// Sorts the table and writes one run per order.
    pub fn spill(&mut self) -> Result<()> {
        if self.table.is_empty() {
            return Ok(());
        }
        let paths: Vec<PathBuf> = (2..=self.max_order).map(|n| self.new_run_path(n)).collect();
        let chunk = self.table.drain_sorted();
        for (i, path) in paths.into_iter().enumerate() {
            let order = i + 2;
            let mut w = RunWriter::create(&path)?;
            for (k, c) in chunk.order(order) {
                w.push(k, c)?;
            }
            w.finish()?;
            self.runs[i].push(path);
        }
        drop(chunk);
        self.spills += 1;
        Ok(())
    }

    /// Ends counting: merges runs down to at most [`MAX_FAN_IN`] per order. When nothing
    /// was spilled the counts stay in memory and are streamed from the table.
    pub fn finish(mut self, cancel: Option<&AtomicBool>) -> Result<SortedCounts> {
        let in_memory = self.spills == 0;
        if !in_memory {
            self.spill()?;
            // The table is no longer needed: free it before merging.
            self.table = CountTable {
                slots: Vec::new(),
                len: 0,
                max_len: 0,
            };
            for i in 0..self.runs.len() {
                while self.runs[i].len() > MAX_FAN_IN {
                    if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                        return Err(interrupted());
                    }
                    let batch: Vec<PathBuf> = self.runs[i].drain(..MAX_FAN_IN).collect();
                    let out = self.new_run_path(i + 2);
                    let sources = batch
                        .iter()
                        .map(|p| RunReader::open(p).map(Source::Run))
                        .collect::<Result<Vec<_>>>()?;
                    let (bits, order) = (self.bits, i + 2);
                    let merge = Merge::new(
                        sources,
                        self.policy,
                        Box::new(move |k| describe_key(k, order, bits)),
                    )
                    .naming(self.source.clone());
                    let mut w = RunWriter::create(&out)?;
                    for pair in merge {
                        let (k, c) = pair?;
                        w.push(k, c)?;
                    }
                    w.finish()?;
                    for p in &batch {
                        std::fs::remove_file(p).map_err(|e| NGramError::io(p, e))?;
                    }
                    self.runs[i].push(out);
                }
            }
        } else {
            // Sorted in place and kept: `streams` reads the entries straight from the table.
            let live = self.table.compact_sorted();
            debug_assert_eq!(live as u64, self.table.len);
        }
        Ok(SortedCounts {
            table: self.table,
            in_memory,
            max_order: self.max_order,
            bits: self.bits,
            policy: self.policy,
            runs: self.runs,
            spills: self.spills,
            source: self.source,
            _dir: self.dir,
            _lock: self._lock,
        })
    }
}

pub(crate) fn interrupted() -> NGramError {
    NGramError::Interrupted {
        detail: "stopped on request; temporary files removed, no output written".into(),
    }
}

/// `"the 3-gram [1, 2, 3]"` for error messages.
pub fn describe_key(key: u64, order: usize, bits: u32) -> String {
    format!("the {order}-gram {:?}", key::unpack(key, order, bits))
}

/// Sorted counts of orders `2..=N`, ready to stream into the writer.
pub struct SortedCounts {
    table: CountTable,
    in_memory: bool,
    max_order: usize,
    bits: u32,
    policy: DuplicatePolicy,
    runs: Vec<Vec<PathBuf>>,
    spills: u64,
    source: Option<PathBuf>,
    _dir: tempfile::TempDir,
    _lock: std::fs::File,
}

impl SortedCounts {
    /// Times the table was spilled to disk during counting (0: everything fit in memory).
    pub fn spills(&self) -> u64 {
        self.spills
    }

    /// Run files merged at the end, all orders together.
    pub fn run_files(&self) -> usize {
        self.runs.iter().map(Vec::len).sum()
    }

    /// One stream per order `2..=N`, ascending by key, dropping n-grams seen fewer than
    /// `min_count` times.
    pub fn streams(&self, min_count: u64) -> Result<Vec<CountStream<'_>>> {
        let mut out: Vec<CountStream<'_>> = Vec::with_capacity(self.runs.len());
        for (i, runs) in self.runs.iter().enumerate() {
            let order = i + 2;
            let sources: Vec<Source<'_>> = if self.in_memory {
                let live = &self.table.slots[..self.table.len as usize];
                let chunk = live_order(live, order);
                vec![Source::Memory(Box::new(chunk))]
            } else {
                runs.iter()
                    .map(|p| RunReader::open(p).map(Source::Run))
                    .collect::<Result<_>>()?
            };
            let bits = self.bits;
            let merge = Merge::new(
                sources,
                self.policy,
                Box::new(move |k| describe_key(k, order, bits)),
            )
            .naming(self.source.clone());
            out.push(Box::new(merge.filter(move |r| match r {
                Ok((_, c)) => *c >= min_count,
                Err(_) => true,
            })));
        }
        debug_assert_eq!(out.len(), self.max_order.saturating_sub(1));
        Ok(out)
    }
}

fn live_order(live: &[[u64; 2]], order: usize) -> impl Iterator<Item = (u64, u64)> + Send + '_ {
    let lo = live.partition_point(|s| ((s[1] >> COUNT_BITS) as usize) < order);
    let hi = live.partition_point(|s| ((s[1] >> COUNT_BITS) as usize) <= order);
    live[lo..hi].iter().map(|s| (s[0], s[1] & COUNT_MASK))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn collect(counts: &SortedCounts, min_count: u64) -> Vec<BTreeMap<u64, u64>> {
        counts
            .streams(min_count)
            .unwrap()
            .into_iter()
            .map(|s| {
                let v: Vec<(u64, u64)> = s.map(|r| r.unwrap()).collect();
                assert!(
                    v.windows(2).all(|w| w[0].0 < w[1].0),
                    "not strictly ascending"
                );
                v.into_iter().collect()
            })
            .collect()
    }

    #[test]
    fn varint_run_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r");
        let pairs = [
            (0u64, 1u64),
            (1, 127),
            (128, 128),
            (u64::MAX - 1, u64::MAX),
            (u64::MAX, 5),
        ];
        let mut w = RunWriter::create(&p).unwrap();
        for &(k, c) in &pairs {
            w.push(k, c).unwrap();
        }
        assert_eq!(w.finish().unwrap(), pairs.len() as u64);
        let mut r = RunReader::open(&p).unwrap();
        for &pair in &pairs {
            assert_eq!(r.next_pair().unwrap(), Some(pair));
        }
        assert_eq!(r.next_pair().unwrap(), None);
    }

    #[test]
    fn run_writer_rejects_unsorted() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = RunWriter::create(&dir.path().join("r")).unwrap();
        w.push(5, 1).unwrap();
        assert!(w.push(5, 1).is_err());
        assert!(w.push(4, 1).is_err());
    }

    #[test]
    fn truncated_run_is_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r");
        std::fs::write(&p, [0x85u8]).unwrap();
        let err = RunReader::open(&p).unwrap().next_pair().unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }

    #[test]
    fn full_disk_is_a_clear_error() {
        let full = Path::new("/dev/full");
        if !full.exists() {
            return;
        }
        let mut w = RunWriter::create(full).unwrap();
        let mut res = Ok(());
        for k in 0..100_000u64 {
            res = w.push(k, 1);
            if res.is_err() {
                break;
            }
        }
        let err = res.and_then(|_| w.finish().map(|_| ())).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("/dev/full") && msg.contains("--tmp-dir"),
            "{msg}"
        );
    }

    #[test]
    fn reject_policy_reports_the_ngram() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = ExternalCounter::new(0, 3, 4, DuplicatePolicy::Reject, dir.path()).unwrap();
        c.add(2, key::pack(&[1, 2], 4), 3).unwrap();
        let err = c.add(2, key::pack(&[1, 2], 4), 3).unwrap_err();
        assert!(err.to_string().contains("[1, 2]"), "{err}");
    }

    #[test]
    fn reject_policy_across_runs() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = ExternalCounter::new(0, 2, 4, DuplicatePolicy::Reject, dir.path()).unwrap();
        c.add(2, key::pack(&[3, 4], 4), 1).unwrap();
        c.spill().unwrap();
        c.add(2, key::pack(&[3, 4], 4), 1).unwrap();
        let counts = c.finish(None).unwrap();
        let err = counts
            .streams(1)
            .unwrap()
            .remove(0)
            .find_map(|r| r.err())
            .unwrap();
        assert!(err.to_string().contains("[3, 4]"), "{err}");
    }

    #[test]
    fn temp_dir_removed_on_drop() {
        let parent = tempfile::tempdir().unwrap();
        let mut c = ExternalCounter::new(0, 2, 8, DuplicatePolicy::Sum, parent.path()).unwrap();
        for k in 0..5000 {
            c.add(2, k, 1).unwrap();
        }
        assert!(c.spills() > 0);
        let counts = c.finish(None).unwrap();
        assert!(std::fs::read_dir(parent.path()).unwrap().count() == 1);
        drop(counts);
        assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        /// Any sequence of additions, any budget (forcing 0..many spills and intermediate
        /// merges), gives the brute-force sums.
        #[test]
        fn counter_equals_brute_force(
            adds in prop::collection::vec((2usize..=4, 0u64..300, 1u64..4), 0..6000),
            table_bytes in prop::sample::select(vec![0u64, 4096, 64 * 1024, 1 << 20]),
            min_count in 1u64..4,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let mut c = ExternalCounter::new(table_bytes, 4, 16, DuplicatePolicy::Sum, dir.path()).unwrap();
            let mut want = vec![BTreeMap::new(); 3];
            for &(order, key, count) in &adds {
                c.add(order, key, count).unwrap();
                *want[order - 2].entry(key).or_insert(0u64) += count;
            }
            let counts = c.finish(None).unwrap();
            for m in &mut want {
                m.retain(|_, c| *c >= min_count);
            }
            prop_assert_eq!(collect(&counts, min_count), want);
        }
    }

    #[test]
    fn many_runs_trigger_intermediate_merges() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = ExternalCounter::new(0, 2, 20, DuplicatePolicy::Sum, dir.path()).unwrap();
        let mut want = BTreeMap::new();
        // Enough distinct keys for ~3x MAX_FAN_IN spills of a minimum-size table.
        let n = (MIN_SLOTS * MAX_LOAD_PERCENT / 100) as usize * MAX_FAN_IN * 3;
        for i in 0..n {
            let k = (i as u64 * 7919) % 100_003;
            c.add(2, k, 1).unwrap();
            *want.entry(k).or_insert(0u64) += 1;
        }
        assert!(c.spills() as usize > 2 * MAX_FAN_IN);
        let counts = c.finish(None).unwrap();
        assert!(counts.run_files() <= MAX_FAN_IN);
        assert_eq!(collect(&counts, 1), vec![want]);
    }
}
