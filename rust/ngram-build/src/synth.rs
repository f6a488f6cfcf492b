//! A synthetic, pre-tokenized corpus for measuring the n-gram engine at scale (`dart-ngram
//! synth`): billions of tokens with the statistics that matter to a count model, made on the
//! machine instead of downloaded.
//!
//! The process, per token (all draws from one xoshiro256** stream per shard):
//!
//! * **Unigrams are Zipfian**: token ids `1..vocab_size` (id 0 is left for the end-of-document
//!   token the build appends, `--eos-id 0`) have probability proportional to
//!   `1 / rank^unigram_exponent`, rank = id (so low ids are frequent, as in BPE vocabularies).
//! * **Continuations are long-tailed**: with probability `1 - fresh` the token continues its
//!   context — the previous two tokens, or with probability `bigram_share` only the previous
//!   one — by drawing a rank `r` from a Zipf law over `1..=continuation_ranks` (exponent
//!   `continuation_exponent`) and mapping `(context, r)` through a hash onto the unigram law.
//!   Every context therefore has its own fixed, heavy-tailed list of favourite continuations
//!   (frequent tokens among them more often, so unigram marginals stay Zipfian), which is what
//!   makes real n-gram counts repeat. With probability `fresh` the token is drawn from the
//!   unigram law alone, which produces the long tail of n-grams seen once.
//! * **Documents** have lengths uniform in `doc_tokens / 2 ..= 3 * doc_tokens / 2`.
//!
//! Output: `shards` JSON-lines files `shard-00000.jsonl`, ... of `{"ids": [...]}` documents,
//! each of about `tokens / shards` tokens, which `dart-ngram build --eos-id 0 --vocab-size V`
//! reads. Shard `i` depends only on `(seed, i, the parameters)`: the same command writes the
//! same bytes, whatever the thread count.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use dart_ngram::error::{NGramError, Result};
use rayon::prelude::*;
use serde::Serialize;

/// Everything `dart-ngram synth` takes.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// Tokens to write in all (EOS not included: the build appends it).
    pub tokens: u64,
    pub shards: usize,
    /// Token ids are `0..vocab_size`; 0 is never written (the EOS id).
    pub vocab_size: u32,
    pub seed: u64,
    pub unigram_exponent: f64,
    pub continuation_exponent: f64,
    /// Distinct continuations a context can have.
    pub continuation_ranks: u32,
    /// Probability that a token ignores its context.
    pub fresh: f64,
    /// Probability that a continuing token looks at one previous token instead of two.
    pub bigram_share: f64,
    /// Mean document length in tokens.
    pub doc_tokens: u32,
    /// Shards written at once.
    pub threads: usize,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            tokens: 10_000_000,
            shards: 1,
            vocab_size: 50_000,
            seed: 0,
            unigram_exponent: 1.05,
            continuation_exponent: 1.1,
            continuation_ranks: 4096,
            fresh: 0.12,
            bigram_share: 0.3,
            doc_tokens: 1000,
            threads: 1,
        }
    }
}

/// What `synth` wrote.
#[derive(Clone, Debug, Serialize)]
pub struct SynthReport {
    pub files: Vec<PathBuf>,
    pub tokens: u64,
    pub documents: u64,
    pub bytes: u64,
    pub seconds: f64,
}

impl SynthOptions {
    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(NGramError::InvalidArgument(what));
        if self.vocab_size < 2 {
            return bad(format!(
                "vocab_size is {}; expected at least 2 (id 0 is the end-of-document token)",
                self.vocab_size
            ));
        }
        if self.shards == 0 || self.threads == 0 {
            return bad("shards and threads must be at least 1".into());
        }
        if self.tokens < self.shards as u64 {
            return bad(format!(
                "{} tokens cannot fill {} shards; expected at least one token per shard",
                self.tokens, self.shards
            ));
        }
        for (name, v) in [
            ("unigram_exponent", self.unigram_exponent),
            ("continuation_exponent", self.continuation_exponent),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{name} is {v}; expected a positive number"));
            }
        }
        for (name, v) in [("fresh", self.fresh), ("bigram_share", self.bigram_share)] {
            if !(0.0..=1.0).contains(&v) {
                return bad(format!("{name} is {v}; expected a probability in 0..=1"));
            }
        }
        if self.continuation_ranks == 0 || self.doc_tokens < 2 {
            return bad("continuation_ranks must be >= 1 and doc_tokens >= 2".into());
        }
        Ok(())
    }
}

/// Writes the corpus into `dir` (created if missing). Existing shard files are replaced.
pub fn synth(opts: &SynthOptions, dir: &Path) -> Result<SynthReport> {
    opts.check()?;
    std::fs::create_dir_all(dir).map_err(|e| NGramError::io(dir, e))?;
    let start = Instant::now();
    let unigram = Alias::zipf(opts.vocab_size as usize - 1, opts.unigram_exponent);
    let ranks = Alias::zipf(opts.continuation_ranks as usize, opts.continuation_exponent);
    let per = opts.tokens / opts.shards as u64;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads)
        .build()
        .map_err(|e| NGramError::InvalidArgument(format!("thread pool: {e}")))?;
    let shards: Vec<Result<(PathBuf, u64, u64, u64)>> = pool.install(|| {
        (0..opts.shards)
            .into_par_iter()
            .map(|i| {
                let tokens = if i + 1 == opts.shards {
                    opts.tokens - per * (opts.shards as u64 - 1)
                } else {
                    per
                };
                let path = dir.join(format!("shard-{i:05}.jsonl"));
                let (docs, bytes) = write_shard(opts, &unigram, &ranks, i as u64, tokens, &path)?;
                Ok((path, tokens, docs, bytes))
            })
            .collect()
    });
    let mut report = SynthReport {
        files: Vec::new(),
        tokens: 0,
        documents: 0,
        bytes: 0,
        seconds: 0.0,
    };
    for s in shards {
        let (path, tokens, docs, bytes) = s?;
        report.files.push(path);
        report.tokens += tokens;
        report.documents += docs;
        report.bytes += bytes;
    }
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

fn write_shard(
    opts: &SynthOptions,
    unigram: &Alias,
    ranks: &Alias,
    shard: u64,
    tokens: u64,
    path: &Path,
) -> Result<(u64, u64)> {
    let io = |e| NGramError::io(path, e);
    let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
    let mut gen = Generator::new(opts, unigram, ranks, shard);
    let mut line = Vec::with_capacity(16 * opts.doc_tokens as usize);
    let (mut left, mut docs, mut bytes) = (tokens, 0u64, 0u64);
    while left > 0 {
        let len = gen.doc_len().min(left);
        line.clear();
        line.extend_from_slice(b"{\"ids\": [");
        gen.start_document();
        for j in 0..len {
            if j > 0 {
                line.extend_from_slice(b", ");
            }
            push_decimal(&mut line, gen.next_token());
        }
        line.extend_from_slice(b"]}\n");
        out.write_all(&line).map_err(io)?;
        bytes += line.len() as u64;
        left -= len;
        docs += 1;
    }
    out.flush().map_err(io)?;
    Ok((docs, bytes))
}

fn push_decimal(out: &mut Vec<u8>, mut v: u32) {
    let mut buf = [0u8; 10];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// The per-shard token process described in the module documentation.
pub struct Generator<'a> {
    rng: Xoshiro,
    unigram: &'a Alias,
    ranks: &'a Alias,
    fresh: u64,
    bigram_share: u64,
    doc_tokens: u64,
    prev: [u32; 2],
    /// Tokens of the current document so far (contexts never span documents).
    pos: u32,
}

/// A probability as a threshold on a uniform u64.
fn threshold(p: f64) -> u64 {
    if p >= 1.0 {
        u64::MAX
    } else {
        (p * 18_446_744_073_709_551_616.0) as u64
    }
}

impl<'a> Generator<'a> {
    pub fn new(opts: &SynthOptions, unigram: &'a Alias, ranks: &'a Alias, shard: u64) -> Self {
        Generator {
            rng: Xoshiro::seeded(opts.seed ^ mix64(shard.wrapping_add(0x5EED))),
            unigram,
            ranks,
            fresh: threshold(opts.fresh),
            bigram_share: threshold(opts.bigram_share),
            doc_tokens: u64::from(opts.doc_tokens),
            prev: [0; 2],
            pos: 0,
        }
    }

    fn doc_len(&mut self) -> u64 {
        let half = self.doc_tokens / 2;
        half + self.rng.next() % (2 * half + 1)
    }

    fn start_document(&mut self) {
        self.pos = 0;
    }

    /// The next token id (`1..vocab_size`).
    pub fn next_token(&mut self) -> u32 {
        let u = self.rng.next();
        let t = if self.pos == 0 || u < self.fresh {
            self.unigram.sample(self.rng.next())
        } else {
            let bigram = self.pos == 1 || self.rng.next() < self.bigram_share;
            let context = if bigram {
                mix64(u64::from(self.prev[1]) | 1 << 40)
            } else {
                mix64(u64::from(self.prev[0]) << 20 ^ u64::from(self.prev[1]))
            };
            let rank = self.ranks.sample(self.rng.next()) as u64;
            self.unigram
                .sample(mix64(context ^ rank.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
        };
        let t = t as u32 + 1;
        self.prev = [self.prev[1], t];
        self.pos += 1;
        t
    }
}

/// murmur3's 64-bit finalizer.
fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// xoshiro256** (Blackman and Vigna), seeded through splitmix64.
struct Xoshiro([u64; 4]);

impl Xoshiro {
    fn seeded(seed: u64) -> Self {
        let mut x = seed;
        let mut s = [0u64; 4];
        for v in &mut s {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            *v = z ^ (z >> 31);
        }
        Xoshiro(s)
    }

    fn next(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }
}

/// Walker's alias table: one draw from a discrete law per uniform u64.
pub struct Alias {
    /// Per column: the threshold (of the low 32 bits of a draw) below which the column is kept.
    keep: Vec<u32>,
    alias: Vec<u32>,
}

impl Alias {
    /// Zipf's law over `0..n` (rank `i + 1`, weight `1 / (i + 1)^s`).
    pub fn zipf(n: usize, s: f64) -> Self {
        let w: Vec<f64> = (0..n).map(|i| ((i + 1) as f64).powf(-s)).collect();
        Self::new(&w)
    }

    /// Vose's construction; `weights` non-empty, finite, positive.
    pub fn new(weights: &[f64]) -> Self {
        let n = weights.len();
        let total: f64 = weights.iter().sum();
        let mut scaled: Vec<f64> = weights.iter().map(|w| w * n as f64 / total).collect();
        let (mut small, mut large): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|&i| scaled[i] < 1.0);
        let mut keep = vec![u32::MAX; n];
        let mut alias: Vec<u32> = (0..n as u32).collect();
        while let (Some(s), Some(&l)) = (small.pop(), large.last()) {
            keep[s] = (scaled[s] * 4_294_967_296.0).min(4_294_967_295.0) as u32;
            alias[s] = l as u32;
            scaled[l] -= 1.0 - scaled[s];
            if scaled[l] < 1.0 {
                large.pop();
                small.push(l);
            }
        }
        Alias { keep, alias }
    }

    /// The outcome for the uniform draw `u`: the high 32 bits pick a column, the low 32 bits
    /// decide between it and its alias.
    pub fn sample(&self, u: u64) -> usize {
        let col = ((u >> 32) * self.keep.len() as u64) >> 32;
        let col = col as usize;
        if (u as u32) < self.keep[col] {
            col
        } else {
            self.alias[col] as usize
        }
    }

    pub fn len(&self) -> usize {
        self.keep.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keep.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustc_hash::FxHashMap;

    #[test]
    fn alias_table_draws_its_law() {
        let law = [0.5, 0.25, 0.125, 0.125];
        let a = Alias::new(&law);
        let mut rng = Xoshiro::seeded(7);
        let mut seen = [0u64; 4];
        let draws = 400_000;
        for _ in 0..draws {
            seen[a.sample(rng.next())] += 1;
        }
        for (i, &p) in law.iter().enumerate() {
            let f = seen[i] as f64 / draws as f64;
            assert!((f - p).abs() < 0.005, "outcome {i}: {f} vs {p}");
        }
    }

    fn corpus_with(dir: &Path, seed: u64, threads: usize, fresh: f64) -> SynthReport {
        let opts = SynthOptions {
            tokens: 200_000,
            shards: 3,
            vocab_size: 5000,
            seed,
            doc_tokens: 300,
            threads,
            fresh,
            ..Default::default()
        };
        synth(&opts, dir).unwrap()
    }

    fn corpus(dir: &Path, seed: u64, threads: usize) -> SynthReport {
        corpus_with(dir, seed, threads, SynthOptions::default().fresh)
    }

    #[test]
    fn the_same_seed_writes_the_same_bytes_whatever_the_threads() {
        let (a, b, c) = (tempdir(), tempdir(), tempdir());
        let ra = corpus(a.path(), 1, 1);
        let rb = corpus(b.path(), 1, 3);
        let rc = corpus(c.path(), 2, 1);
        assert_eq!(ra.tokens, 200_000);
        assert_eq!(ra.files.len(), 3);
        for (fa, (fb, fc)) in ra.files.iter().zip(rb.files.iter().zip(&rc.files)) {
            let (x, y, z) = (read(fa), read(fb), read(fc));
            assert_eq!(x, y);
            assert_ne!(x, z, "another seed must give another corpus");
        }
    }

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn read(p: &Path) -> Vec<u8> {
        std::fs::read(p).unwrap()
    }

    struct Stats {
        unigrams: Vec<u64>,
        /// Distinct trigrams per trigram occurrence.
        novelty: f64,
    }

    fn stats(r: &SynthReport) -> Stats {
        let mut unigrams = vec![0u64; 5000];
        let mut tri: FxHashMap<[u32; 3], u64> = FxHashMap::default();
        let mut tokens = 0u64;
        for f in &r.files {
            let text = String::from_utf8(read(f)).unwrap();
            for line in text.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                let ids: Vec<u32> = v["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect();
                for w in ids.windows(3) {
                    *tri.entry([w[0], w[1], w[2]]).or_default() += 1;
                }
                for &t in &ids {
                    assert!((1..5000).contains(&t), "id {t} out of 1..5000");
                    unigrams[t as usize] += 1;
                    tokens += 1;
                }
            }
        }
        assert_eq!(tokens, r.tokens);
        let occurrences: u64 = tri.values().sum();
        Stats {
            unigrams,
            novelty: tri.len() as f64 / occurrences as f64,
        }
    }

    /// The statistics the generator promises: ids in range and never 0, Zipf-like unigrams,
    /// contexts whose continuations repeat far more than independent draws would.
    #[test]
    fn statistics_are_zipfian_with_repeating_continuations() {
        let (a, b) = (tempdir(), tempdir());
        let s = stats(&corpus(a.path(), 3, 2));
        let independent = stats(&corpus_with(b.path(), 3, 2, 1.0));
        for u in [&s.unigrams, &independent.unigrams] {
            // Zipf with exponent ~1: id 1 about ten times as frequent as id 10.
            let ratio = u[1] as f64 / u[10] as f64;
            assert!((5.0..20.0).contains(&ratio), "count(1)/count(10) = {ratio}");
        }
        assert!(
            s.novelty < 0.95 * independent.novelty,
            "distinct trigrams per occurrence: {} with contexts, {} independent",
            s.novelty,
            independent.novelty
        );
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        let dir = tempdir();
        for (opts, needle) in [
            (
                SynthOptions {
                    vocab_size: 1,
                    ..Default::default()
                },
                "vocab_size",
            ),
            (
                SynthOptions {
                    fresh: 1.5,
                    ..Default::default()
                },
                "fresh",
            ),
            (
                SynthOptions {
                    tokens: 2,
                    shards: 3,
                    ..Default::default()
                },
                "shards",
            ),
        ] {
            let err = synth(&opts, dir.path()).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
