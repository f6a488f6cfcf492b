//! Additive merge of models built from disjoint shards of a corpus.
//!
//! Counts of the same n-gram are summed: with unpruned inputs the result is exactly the model
//! of the concatenated corpus. Each order is a k-way merge of the inputs' sorted levels,
//! streamed into the writer, so memory stays bounded by the writer's needs.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{NGramError, Result};
use crate::model::{hex, NGramModel, OrderChunks};
use crate::writer::{
    write_model_in_ranges, CountStream, KeyRange, ModelMeta, WriteOptions, WriteReport,
};

/// How to merge.
#[derive(Clone, Debug)]
pub struct MergeOptions {
    /// Accept inputs pruned with `min_count > 1`. Their sum is *not* the model of the
    /// concatenated corpus (an n-gram dropped from one shard loses its count there), so this
    /// is refused unless asked for.
    pub allow_pruned: bool,
    /// Drop n-grams of order >= 2 whose summed count is below this (1 = keep all). With
    /// pruned inputs the output is pruned at least at the highest input `min_count`, so the
    /// header's `min_count` stays true.
    pub min_count: u64,
    /// Top-list length of the output.
    pub write: WriteOptions,
    /// Provenance stored in the output (default `"dart-ngram merge of N models"`).
    pub source: Option<String>,
    /// Threads: 1 merges and spools on the calling thread; more split the n-grams into
    /// first-token ranges (balanced by the inputs' own offsets) merged and spooled that many
    /// at a time. The output is the same bytes whatever the number.
    pub threads: usize,
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            allow_pruned: false,
            min_count: 1,
            write: WriteOptions::default(),
            source: None,
            threads: 1,
        }
    }
}

/// Merges `inputs` (same order, vocabulary, tokenizer and EOS) into `output`, atomically.
pub fn merge_models(inputs: &[&Path], output: &Path, opts: &MergeOptions) -> Result<WriteReport> {
    if inputs.is_empty() {
        return Err(NGramError::InvalidArgument(
            "merge needs at least one input model".into(),
        ));
    }
    if opts.min_count == 0 {
        return Err(NGramError::InvalidArgument(
            "merge min_count 0; use 1 to keep every n-gram".into(),
        ));
    }
    crate::writer::check_not_an_input(output, inputs.iter().copied())?;
    let models = inputs
        .iter()
        .map(|p| NGramModel::open(p))
        .collect::<Result<Vec<_>>>()?;
    let first = &models[0];
    let mismatch = |m: &NGramModel, what: &str, a: String, b: String| {
        NGramError::InvalidArgument(format!(
            "cannot merge {} ({what} {b}) with {} ({what} {a}): every input needs the same {what}",
            m.path().display(),
            first.path().display()
        ))
    };
    for m in &models[1..] {
        if m.order() != first.order() {
            return Err(mismatch(
                m,
                "order",
                first.order().to_string(),
                m.order().to_string(),
            ));
        }
        if m.vocab_size() != first.vocab_size() {
            return Err(mismatch(
                m,
                "vocabulary size",
                first.vocab_size().to_string(),
                m.vocab_size().to_string(),
            ));
        }
        if m.tokenizer_fingerprint() != first.tokenizer_fingerprint() {
            return Err(NGramError::TokenizerMismatch {
                detail: format!(
                    "cannot merge {} (tokenizer {}) with {} (tokenizer {})",
                    m.path().display(),
                    hex(&m.tokenizer_fingerprint()),
                    first.path().display(),
                    hex(&first.tokenizer_fingerprint())
                ),
            });
        }
        if m.eos_id() != first.eos_id() {
            return Err(mismatch(
                m,
                "eos id",
                format!("{:?}", first.eos_id()),
                format!("{:?}", m.eos_id()),
            ));
        }
    }
    if !opts.allow_pruned {
        if let Some(m) = models.iter().find(|m| m.min_count() > 1) {
            return Err(NGramError::InvalidArgument(format!(
                "{} was pruned with min_count {}: merging pruned shards is not the model of the \
                 concatenated corpus; build shards unpruned and prune the merge (min_count), or \
                 allow pruned inputs explicitly",
                m.path().display(),
                m.min_count()
            )));
        }
    }
    let overflow = |what: &str| NGramError::CountOverflow {
        path: output.to_path_buf(),
        detail: format!("summed {what} exceed 64 bits"),
    };
    let vocab = first.vocab_size() as usize;
    let mut unigrams = vec![0u64; vocab];
    let (mut total, mut docs) = (0u64, 0u64);
    for m in &models {
        for item in m.iter_order(1) {
            let (t, c) = item?;
            let slot = &mut unigrams[t as usize];
            *slot = slot
                .checked_add(c)
                .ok_or_else(|| overflow("unigram counts"))?;
        }
        total = total
            .checked_add(m.total_tokens())
            .ok_or_else(|| overflow("token totals"))?;
        docs = docs.saturating_add(m.documents());
    }
    let min_count = models
        .iter()
        .map(|m| m.min_count())
        .max()
        .unwrap_or(1)
        .max(opts.min_count);
    let meta = ModelMeta {
        order: first.order(),
        vocab_size: first.vocab_size(),
        tokenizer_fingerprint: first.tokenizer_fingerprint(),
        eos_id: first.eos_id(),
        min_count,
        total_tokens: total,
        documents: docs,
        source: opts
            .source
            .clone()
            .unwrap_or_else(|| format!("dart-ngram merge of {} models", models.len())),
    };
    let read = opts.write.progress.as_deref().map(|p| {
        let total = models
            .iter()
            .flat_map(|m| m.ngrams_per_order().into_iter().skip(1))
            .fold(0u64, u64::saturating_add);
        p.input_total.store(total, Ordering::Relaxed);
        &p.input_done
    });
    let threads = opts.threads.max(1);
    // More ranges than threads, so that uneven ranges even out over the cores.
    let bounds = if threads == 1 {
        vec![0, first.vocab_size()]
    } else {
        split_points(&models, threads * RANGES_PER_THREAD)?
    };
    let ranges = bounds
        .windows(2)
        .map(|w| KeyRange {
            first: w[0]..w[1],
            streams: (2..=first.order())
                .map(|n| {
                    let sources = models
                        .iter()
                        .map(|m| m.chunks_from(n, w[0]..w[1]))
                        .collect();
                    Box::new(KMerge::new(sources, output, read).filter(move |r| match r {
                        Ok((_, c)) => *c >= min_count,
                        Err(_) => true,
                    })) as CountStream<'_>
                })
                .collect(),
        })
        .collect();
    write_model_in_ranges(output, &meta, &unigrams, ranges, &opts.write, threads)
}

/// First-token ranges per thread of a threaded merge.
const RANGES_PER_THREAD: usize = 4;

/// Token ids `0 = b[0] < b[1] < ... = vocab_size` splitting the inputs' n-grams of orders >= 2
/// into about `ranges` runs of similar size, read from the inputs' child offsets.
fn split_points(models: &[NGramModel], ranges: usize) -> Result<Vec<u32>> {
    let vocab = models[0].vocab_size();
    let order = models[0].order();
    // n-grams of orders >= 2 whose first token is below `t`, over every input.
    let below = |t: u32| -> Result<u64> {
        let mut sum = 0u64;
        for m in models {
            for n in 2..=order {
                sum = sum.saturating_add(m.first_entry(n, t)?);
            }
        }
        Ok(sum)
    };
    let total = below(vocab)?;
    let mut bounds = vec![0u32];
    for j in 1..ranges as u64 {
        let target = (u128::from(total) * u128::from(j) / ranges as u128) as u64;
        // The first token with at least `target` n-grams before it.
        let (mut lo, mut hi) = (*bounds.last().expect("starts at 0"), vocab);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if below(mid)? < target {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if lo > *bounds.last().expect("starts at 0") && lo < vocab {
            bounds.push(lo);
        }
    }
    bounds.push(vocab);
    Ok(bounds)
}

/// A [`KMerge`] key past every `u64` key: an exhausted source.
const DONE: u128 = u128::MAX;

/// Sums equal keys across several orders' chunks, ascending by key, with a tournament tree
/// of losers over the sources' heads: taking the smallest key costs `log2(k)` comparisons of
/// plain integers against the losers on one path (loads that do not wait on each other), and
/// no heap entries move. Heads are read straight from each source's decoded chunk.
struct KMerge<'p, 'm> {
    sources: Vec<OrderChunks<'m>>,
    /// Each source's decoded chunk and the position of its head in it.
    chunks: Vec<Vec<(u64, u64)>>,
    pos: Vec<usize>,
    /// Each source's current key, [`DONE`] once it is exhausted (above every key, so the
    /// comparisons are plain integer ones), and count.
    keys: Vec<u128>,
    counts: Vec<u64>,
    /// `losers[j]` lost the match at node `j` (`1..leaves`; node `j`'s children are `2j`,
    /// `2j+1`, leaves `leaves..2 * leaves` are the sources, padded with exhausted ones);
    /// `winner` has the smallest head.
    losers: Vec<usize>,
    winner: usize,
    leaves: usize,
    primed: bool,
    failed: bool,
    output: &'p Path,
    /// Input n-grams read, counted a chunk at a time for a progress display.
    read: Option<&'p AtomicU64>,
}

impl<'p, 'm> KMerge<'p, 'm> {
    fn new(sources: Vec<OrderChunks<'m>>, output: &'p Path, read: Option<&'p AtomicU64>) -> Self {
        let n = sources.len();
        let leaves = n.next_power_of_two();
        KMerge {
            chunks: vec![Vec::new(); n],
            pos: vec![0; n],
            sources,
            keys: vec![DONE; leaves],
            counts: vec![0; leaves],
            losers: vec![0; leaves],
            winner: 0,
            leaves,
            primed: false,
            failed: false,
            output,
            read,
        }
    }

    /// Reads source `i`'s next head: from its chunk, or a new chunk at the chunk's end.
    #[inline(always)]
    fn load(&mut self, i: usize) -> Result<()> {
        let p = self.pos[i] + 1;
        if let Some(&(k, c)) = self.chunks[i].get(p) {
            self.pos[i] = p;
            self.keys[i] = u128::from(k);
            self.counts[i] = c;
            return Ok(());
        }
        self.refill(i)
    }

    #[inline(never)]
    fn refill(&mut self, i: usize) -> Result<()> {
        self.sources[i].refill(&mut self.chunks[i])?;
        if let Some(read) = self.read {
            read.fetch_add(self.chunks[i].len() as u64, Ordering::Relaxed);
        }
        self.pos[i] = 0;
        match self.chunks[i].first() {
            Some(&(k, c)) => {
                self.keys[i] = u128::from(k);
                self.counts[i] = c;
            }
            None => self.keys[i] = DONE,
        }
        Ok(())
    }

    /// Advances the winner, source `i`, and replays its path to the root against the losers
    /// there (equal keys in any order: their counts are summed).
    #[inline]
    fn pull(&mut self, i: usize) -> Result<()> {
        self.load(i)?;
        let (mut w, mut wkey) = (i, self.keys[i]);
        let mut j = (self.leaves + i) / 2;
        while j >= 1 {
            let l = self.losers[j];
            let lkey = self.keys[l];
            // Which source wins is a coin toss to the branch predictor: select, don't jump.
            let swap = lkey < wkey;
            self.losers[j] = std::hint::select_unpredictable(swap, w, l);
            (w, wkey) = std::hint::select_unpredictable(swap, (l, lkey), (w, wkey));
            j /= 2;
        }
        self.winner = w;
        Ok(())
    }

    fn step(&mut self) -> Result<Option<(u64, u64)>> {
        if !self.primed {
            self.primed = true;
            for i in 0..self.sources.len() {
                self.refill(i)?;
            }
            // Winners of every match, bottom up; each node keeps its loser.
            let mut won: Vec<usize> = (0..2 * self.leaves)
                .map(|j| j.saturating_sub(self.leaves))
                .collect();
            for j in (1..self.leaves).rev() {
                let (a, b) = (won[2 * j], won[2 * j + 1]);
                let (w, l) = if self.keys[b] < self.keys[a] {
                    (b, a)
                } else {
                    (a, b)
                };
                won[j] = w;
                self.losers[j] = l;
            }
            self.winner = won[1];
        }
        let i = self.winner;
        let key = self.keys[i];
        if key == DONE {
            return Ok(None);
        }
        let mut sum = self.counts[i];
        self.pull(i)?;
        loop {
            let j = self.winner;
            if self.keys[j] != key {
                return Ok(Some((key as u64, sum)));
            }
            sum = sum
                .checked_add(self.counts[j])
                .ok_or_else(|| NGramError::CountOverflow {
                    path: self.output.to_path_buf(),
                    detail: format!("summed count of key {key:#x} exceeds 64 bits"),
                })?;
            self.pull(j)?;
        }
    }
}

impl Iterator for KMerge<'_, '_> {
    type Item = Result<(u64, u64)>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.step() {
            Ok(v) => v.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::count_corpus;
    use proptest::prelude::*;

    fn orders(m: &NGramModel) -> Vec<Vec<(u64, u64)>> {
        (1..=m.order())
            .map(|n| m.iter_order(n).collect::<Result<_>>().unwrap())
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Any split of the first tokens walks the order in pieces that put together are it.
        #[test]
        fn ranges_of_an_order_concatenate_to_it(
            docs in prop::collection::vec(prop::collection::vec(0u32..30, 0..40), 1..8),
            order in 1usize..=4,
            cuts in prop::collection::vec(0u32..32, 0..5),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("m.ngram");
            count_corpus(&docs, order, 31, Some(30), 1).write(&p, 2).unwrap();
            let m = NGramModel::open(&p).unwrap();
            let mut bounds = cuts;
            bounds.extend([0, 31]);
            bounds.sort_unstable();
            for n in 1..=order {
                let whole: Vec<_> = m.iter_order(n).collect::<Result<_>>().unwrap();
                let mut pieces = Vec::new();
                for w in bounds.windows(2) {
                    let part: Vec<_> = m.iter_order_from(n, w[0]..w[1]).collect::<Result<_>>().unwrap();
                    let bits = crate::key::token_bits(31);
                    for &(k, _) in &part {
                        let t = (k >> (bits * (n as u32 - 1))) as u32;
                        prop_assert!((w[0]..w[1]).contains(&t));
                    }
                    pieces.extend(part);
                }
                prop_assert_eq!(pieces, whole);
            }
        }

        #[test]
        fn merge_equals_the_model_of_the_concatenation(
            docs in prop::collection::vec(prop::collection::vec(0u32..12, 0..30), 0..10),
            cut in 0usize..10,
            shards in 1usize..4,
            order in 1usize..=3,
            min_count in 1u64..=3,
            threads in 1usize..=4,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let cut = cut.min(docs.len());
            let parts: Vec<&[Vec<u32>]> = match shards {
                1 => vec![&docs[..]],
                2 => vec![&docs[..cut], &docs[cut..]],
                _ => vec![&docs[..cut], &[], &docs[cut..]],
            };
            let mut paths = Vec::new();
            for (i, part) in parts.iter().enumerate() {
                let p = dir.path().join(format!("shard{i}.ngram"));
                count_corpus(part, order, 13, Some(12), 1).write(&p, 2).unwrap();
                paths.push(p);
            }
            let out = dir.path().join("merged.ngram");
            let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
            let opts = MergeOptions { min_count, write: WriteOptions { top_list_len: 2, ..Default::default() }, ..Default::default() };
            let report = merge_models(&refs, &out, &opts).unwrap();
            let whole = count_corpus(&docs, order, 13, Some(12), min_count);
            let wp = dir.path().join("whole.ngram");
            whole.write(&wp, 2).unwrap();
            let (m, w) = (NGramModel::open(&out).unwrap(), NGramModel::open(&wp).unwrap());
            m.verify().unwrap();
            prop_assert_eq!(orders(&m), orders(&w));
            prop_assert_eq!(report.ngrams_per_order, w.ngrams_per_order());
            prop_assert_eq!(m.total_tokens(), w.total_tokens());
            prop_assert_eq!(m.documents(), w.documents());
            prop_assert_eq!(m.min_count(), min_count);
            // Any thread count writes the same bytes, and its progress counts every input
            // n-gram and every byte written.
            let threaded = dir.path().join("threaded.ngram");
            let progress = std::sync::Arc::new(crate::writer::WriteProgress::default());
            let write = WriteOptions { progress: Some(progress.clone()), ..opts.write.clone() };
            let report = merge_models(&refs, &threaded, &MergeOptions { threads, write, ..opts }).unwrap();
            prop_assert_eq!(std::fs::read(&threaded).unwrap(), std::fs::read(&out).unwrap());
            let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
            let inputs: u64 = refs.iter().map(|p| NGramModel::open(p).unwrap().ngrams_per_order().iter().skip(1).sum::<u64>()).sum();
            prop_assert_eq!(load(&progress.input_total), inputs);
            prop_assert_eq!(load(&progress.input_done), inputs);
            prop_assert_eq!(load(&progress.output_total), report.bytes);
            prop_assert_eq!(load(&progress.output_done), report.bytes);
        }
    }

    /// A shard whose counts are corrupt deep inside an order (checksums recomputed, so only
    /// decoding finds it) fails the merge with its name, at any thread count, and leaves
    /// nothing at the output path nor beside it.
    #[test]
    fn an_input_corrupt_deep_inside_fails_the_merge_cleanly() {
        use crate::format::{Header, SectionKind};
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // A few thousand trigrams, so that their count codes span many blocks.
        let mut x = 7u64;
        let docs: Vec<Vec<u32>> = (0..40)
            .map(|_| {
                (0..200)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        ((x >> 33) % 300) as u32
                    })
                    .collect()
            })
            .collect();
        let good = d.join("good.ngram");
        let bad = d.join("bad.ngram");
        count_corpus(&docs[..20], 3, 301, Some(300), 1)
            .write(&good, 32)
            .unwrap();
        count_corpus(&docs[20..], 3, 301, Some(300), 1)
            .write(&bad, 32)
            .unwrap();
        let mut bytes = std::fs::read(&bad).unwrap();
        let h = Header::parse(&bad, &bytes, bytes.len() as u64).unwrap();
        let codes = h
            .sections
            .iter()
            .find(|s| s.kind == SectionKind::CountCodes && s.order == 3)
            .unwrap();
        assert!(codes.length >= 64 * 8, "{} bytes of codes", codes.length);
        // A block three quarters in: its escape base far past the escapes, every code an escape.
        let at = (codes.offset + codes.length / 64 * 3 / 4 * 64) as usize;
        bytes[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        bytes[at + 8..at + 64].fill(0xff);
        std::fs::write(&bad, bytes).unwrap();
        crate::testutil::rechecksum(&bad);
        let out = d.join("merged.ngram");
        for threads in 1..=4 {
            let err = merge_models(
                &[good.as_path(), bad.as_path()],
                &out,
                &MergeOptions {
                    threads,
                    ..Default::default()
                },
            )
            .unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(err, NGramError::Corrupt { .. }) && msg.contains("bad.ngram"),
                "{threads} threads: {msg}"
            );
            let mut left: Vec<_> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            left.sort();
            assert_eq!(left, ["bad.ngram", "good.ngram"], "{threads} threads");
        }
    }

    #[test]
    fn incompatible_inputs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let docs = vec![vec![1, 2, 3, 1, 2]];
        let write = |name: &str, c: crate::testutil::Counts| {
            let p = d.join(name);
            c.write(&p, 32).unwrap();
            p
        };
        let a = write("a.ngram", count_corpus(&docs, 3, 5, None, 1));
        let order = write("order.ngram", count_corpus(&docs, 2, 5, None, 1));
        let vocab = write("vocab.ngram", count_corpus(&docs, 3, 6, None, 1));
        let eos = write("eos.ngram", count_corpus(&docs, 3, 5, Some(4), 1));
        let pruned = write("pruned.ngram", count_corpus(&docs, 3, 5, None, 2));
        let out = d.join("out.ngram");
        let run = |b: &Path, opts: &MergeOptions| merge_models(&[a.as_path(), b], &out, opts);
        let def = MergeOptions::default();
        for (b, want) in [
            (&order, "order"),
            (&vocab, "vocabulary size"),
            (&eos, "eos id"),
        ] {
            let msg = run(b, &def).unwrap_err().to_string();
            assert!(
                msg.contains(want)
                    && msg.contains("a.ngram")
                    && msg.contains(b.file_name().unwrap().to_str().unwrap()),
                "{msg}"
            );
        }
        let msg = run(&pruned, &def).unwrap_err().to_string();
        assert!(
            msg.contains("pruned.ngram") && msg.contains("min_count 2"),
            "{msg}"
        );
        run(
            &pruned,
            &MergeOptions {
                allow_pruned: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(NGramModel::open(&out).unwrap().min_count(), 2);
        // Another tokenizer: patch the fingerprint through the writer.
        let c = count_corpus(&docs, 3, 5, None, 1);
        let other = d.join("other.ngram");
        let mut meta = c.meta();
        meta.tokenizer_fingerprint = [9; 32];
        crate::writer::write_model(&other, &meta, &c.uni, c.streams(), &WriteOptions::default())
            .unwrap();
        let err = run(&other, &def).unwrap_err();
        assert!(matches!(err, NGramError::TokenizerMismatch { .. }), "{err}");
        assert!(merge_models(&[], &out, &def).is_err());
    }
}
