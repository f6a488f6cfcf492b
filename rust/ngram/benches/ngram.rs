//! Criterion benches of the model's hot paths: open, `prob_many` with 25 candidates after a
//! 2-token context (goal: <= 0.5 us warm), `top_k`, `count`.
//!
//! On a shared machine, set `DART_BENCH_CPU_TIME=1` to measure the bench thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`) instead of wall time: time the thread spends preempted by
//! other work is then left out (its cache pollution is not).
//!
//! The model is written from a synthetic Zipfian corpus of about 4M tokens (a 49152-token
//! vocabulary, each token drawn from a Zipf law shifted by its predecessor so contexts have
//! realistic fan-out). Set `DART_BENCH_MODEL=/path/model.ngram` to bench a real model too (a
//! version-1 file is read without child buckets; `dart-ngram merge OLD --output NEW` rewrites
//! it in the current version).

use std::hint::black_box;
use std::path::{Path, PathBuf};

use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{Criterion, Throughput};
use dart_ngram::{key, write_model, CountStream, ModelMeta, NGramModel, WriteOptions};
use rustc_hash::FxHashMap;

const VOCAB: u32 = 49152;
const TOKENS: usize = 4_000_000;

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Zipf(s = 1.1) over 1..=n by inverting the continuous approximation.
    fn zipf(&mut self, n: u32) -> u32 {
        let s = 1.1f64;
        let u = self.unit();
        let hn = ((n as f64).powf(1.0 - s) - 1.0) / (1.0 - s);
        let x = (1.0 + u * hn * (1.0 - s)).powf(1.0 / (1.0 - s));
        (x as u32).clamp(1, n) - 1
    }
}

fn synthetic_model(dir: &Path) -> PathBuf {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let bits = key::token_bits(VOCAB);
    let eos = VOCAB - 1;
    let mut uni = vec![0u64; VOCAB as usize];
    let mut maps: [FxHashMap<u64, u64>; 2] = [FxHashMap::default(), FxHashMap::default()];
    let (mut total, mut docs) = (0u64, 0u64);
    while (total as usize) < TOKENS {
        let len = 50 + (rng.next() % 400) as usize;
        let mut doc = Vec::with_capacity(len + 1);
        let mut prev = 0u32;
        for _ in 0..len {
            // Half the time a continuation tied to the previous token, else a free draw.
            let z = rng.zipf(VOCAB - 1);
            let t = if rng.next().is_multiple_of(2) {
                (prev.wrapping_mul(7919) + z) % (VOCAB - 1)
            } else {
                z
            };
            doc.push(t);
            prev = t;
        }
        doc.push(eos);
        for i in 0..doc.len() {
            uni[doc[i] as usize] += 1;
            for n in 2..=3 {
                if i + n <= doc.len() {
                    *maps[n - 2]
                        .entry(key::pack(&doc[i..i + n], bits))
                        .or_default() += 1;
                }
            }
        }
        total += doc.len() as u64;
        docs += 1;
    }
    let streams: Vec<CountStream<'static>> = maps
        .into_iter()
        .map(|m| {
            let mut v: Vec<(u64, u64)> = m.into_iter().collect();
            v.sort_unstable();
            Box::new(v.into_iter().map(Ok)) as CountStream<'static>
        })
        .collect();
    let meta = ModelMeta {
        order: 3,
        vocab_size: VOCAB,
        tokenizer_fingerprint: [0; 32],
        eos_id: Some(eos),
        min_count: 1,
        total_tokens: total,
        documents: docs,
        source: "synthetic zipf bench corpus".into(),
    };
    let path = dir.join("zipf.ngram");
    let report = write_model(&path, &meta, &uni, streams, &WriteOptions::default()).unwrap();
    let n: u64 = report.ngrams_per_order.iter().sum();
    eprintln!(
        "synthetic model: {total} tokens, n-grams per order {:?}, {} bytes, {:.2} bytes/n-gram",
        report.ngrams_per_order,
        report.bytes,
        report.bytes as f64 / n as f64
    );
    path
}

/// Query workload: 2-token contexts taken from stored trigrams, each with 25 candidates —
/// its best continuations mixed with random tokens, as a draft head's top-25 would be.
fn workload(m: &NGramModel, count: usize) -> Vec<([u32; 2], Vec<u32>)> {
    let bits = key::token_bits(m.vocab_size());
    let trigrams: Vec<u64> = m
        .iter_order(3)
        .step_by(97)
        .map(|r| r.unwrap().0)
        .take(count)
        .collect();
    let mut rng = Rng(42);
    trigrams
        .into_iter()
        .map(|k| {
            let ctx = [key::token_at(k, 3, 0, bits), key::token_at(k, 3, 1, bits)];
            let mut cands: Vec<u32> = m
                .top_k(&ctx, 12)
                .unwrap()
                .into_iter()
                .map(|(t, _)| t)
                .collect();
            while cands.len() < 25 {
                cands.push(rng.zipf(m.vocab_size()));
            }
            (ctx, cands)
        })
        .collect()
}

/// The calling thread's CPU time, in nanoseconds.
struct ThreadCpuTime;

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a constant Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Measurement for ThreadCpuTime {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        thread_cpu_ns()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_ns() - start
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &CpuNs
    }
}

/// Formats nanoseconds of CPU time.
struct CpuNs;

impl ValueFormatter for CpuNs {
    fn scale_values(&self, typical: f64, values: &mut [f64]) -> &'static str {
        let (div, unit) = match typical {
            t if t < 1e3 => (1.0, "ns cpu"),
            t if t < 1e6 => (1e3, "µs cpu"),
            t if t < 1e9 => (1e6, "ms cpu"),
            _ => (1e9, "s cpu"),
        };
        values.iter_mut().for_each(|v| *v /= div);
        unit
    }
    fn scale_throughputs(&self, _: f64, t: &Throughput, values: &mut [f64]) -> &'static str {
        let n = match t {
            Throughput::Bytes(n) | Throughput::BytesDecimal(n) | Throughput::Elements(n) => *n,
        };
        values.iter_mut().for_each(|v| *v = n as f64 * 1e9 / *v);
        "/s cpu"
    }
    fn scale_for_machines(&self, _: &mut [f64]) -> &'static str {
        "ns"
    }
}

fn bench_model<M: Measurement + 'static>(c: &mut Criterion<M>, name: &str, path: &Path) {
    let m = NGramModel::open(path).unwrap();
    let info = m.info();
    eprintln!(
        "{name}: {} bytes, {:?} n-grams per order, {:.2} bytes/n-gram",
        info.bytes, info.ngrams_per_order, info.bytes_per_ngram
    );
    c.bench_function(&format!("{name}/open"), |b| {
        b.iter(|| NGramModel::open(black_box(path)).unwrap())
    });
    let skip = dart_ngram::OpenOptions {
        skip_checksums: true,
        ..Default::default()
    };
    c.bench_function(&format!("{name}/open_skip_checksums"), |b| {
        b.iter(|| NGramModel::open_with(black_box(path), &skip).unwrap())
    });
    let work = workload(&m, 1024);
    let mut probs = [0f32; 25];
    let mut matched = [0u8; 25];
    let mut i = 0;
    c.bench_function(&format!("{name}/prob_many_25"), |b| {
        b.iter(|| {
            let (ctx, cands) = &work[i % work.len()];
            i += 1;
            m.prob_many(ctx, cands, &mut probs, &mut matched).unwrap();
            black_box(&probs);
        })
    });
    // The same 8 queries over and over: their data stays in the CPU caches, so this shows the
    // instruction cost apart from the memory misses of the line above.
    c.bench_function(&format!("{name}/prob_many_25_hot8"), |b| {
        b.iter(|| {
            let (ctx, cands) = &work[i % 8];
            i += 1;
            m.prob_many(ctx, cands, &mut probs, &mut matched).unwrap();
            black_box(&probs);
        })
    });
    c.bench_function(&format!("{name}/top_k_25"), |b| {
        b.iter(|| {
            let (ctx, _) = &work[i % work.len()];
            i += 1;
            black_box(m.top_k(ctx, 25).unwrap())
        })
    });
    c.bench_function(&format!("{name}/count_trigram"), |b| {
        b.iter(|| {
            let (ctx, cands) = &work[i % work.len()];
            i += 1;
            black_box(m.count(&[ctx[0], ctx[1], cands[0]]).unwrap())
        })
    });
}

fn benches<M: Measurement + 'static>(c: &mut Criterion<M>) {
    let dir = tempfile::tempdir().unwrap();
    let path = synthetic_model(dir.path());
    bench_model(c, "zipf4M", &path);
    if let Ok(real) = std::env::var("DART_BENCH_MODEL") {
        bench_model(c, "real", Path::new(&real));
    }
}

fn main() {
    if std::env::var_os("DART_BENCH_CPU_TIME").is_some_and(|v| v == "1") {
        let mut c = Criterion::default()
            .with_measurement(ThreadCpuTime)
            .configure_from_args();
        benches(&mut c);
        c.final_summary();
    } else {
        let mut c = Criterion::default().configure_from_args();
        benches(&mut c);
        c.final_summary();
    }
}
