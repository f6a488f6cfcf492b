//! `dart-ngram bench MODEL`: what queries cost on one model, at any size: open time,
//! `P(c | context)` for 25 candidates and one prune (60 draft nodes, `--budget`), p50/p99,
//! with the file's pages warm and (`--cold`) evicted before each query.
//!
//! The workload is the pruner's (`dart_pruner::workload`): random walks over the model's own
//! best continuations give 16-token contexts; each of a request's 8 rows holds 25 candidates
//! (the walk's next token, the model's best continuations, Zipfian filler). A `P(c|context)`
//! lookup is one row: its context (the model reads the last `order - 1` tokens) and its 25
//! candidates, answered by one `prob_many`.
//!
//! * **warm**: the file is in the page cache (read once before measuring) and mapped
//!   (`MAP_POPULATE`); each lookup is timed the first time this process makes it (its cache
//!   lines come from DRAM, its pages need no fault);
//! * **repeat**: the same lookups again (lines may now be in the CPU caches);
//! * **cold** (`--cold`): before each timed lookup the model's pages are dropped from this
//!   process and from the page cache, then the small sections every open reads are read again
//!   (`NGramModel::evict_pages`): the lookup reads from disk as the first one of a fresh
//!   process on a cold machine would;
//! * **cold mapping** (`--cold-mapping`): the same with the page cache kept: the lookup's
//!   pages are minor faults, as in a fresh process (a restarted daemon, a new worker) on a
//!   host that has read the file recently;
//! * **prefetch** (`--prefetch`): the page cache is dropped, the model opened with
//!   `OpenOptions::prefetch` and lookups timed at once, while the background read-ahead runs
//!   (a cold start that serves at once), and the time until the file is resident.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use dart_ngram::{Eviction, NGramModel, OpenOptions};
use dart_pruner::workload::{draft_requests, walk_documents, OwnedRequest, Rng};
use dart_pruner::{DraftRequest, Pruner, PrunerConfig};
use serde::Serialize;

use crate::cmd_build::emit;

#[derive(clap::Args)]
pub struct Args {
    /// The model file.
    pub model: PathBuf,
    /// Draft requests generated (each gives 8 lookups of 25 candidates and one prune).
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    /// Also time lookups and prunes with the pages evicted before each (this many of each).
    #[arg(long)]
    pub cold: bool,
    /// Also time lookups and prunes with only this process's mapping of the pages dropped
    /// before each (the page cache kept).
    #[arg(long)]
    pub cold_mapping: bool,
    /// Also time a cold start with `prefetch`: lookups right after the open, and how long the
    /// background read-ahead takes to make the whole file resident.
    #[arg(long)]
    pub prefetch: bool,
    /// Lookups and prunes timed per cold figure.
    #[arg(long, default_value_t = 200)]
    pub cold_queries: usize,
    /// Check every section's checksum at open (reads the whole file); default: the small
    /// sections only, as `serve --skip-checksums`.
    #[arg(long)]
    pub checksums: bool,
    /// Open with `MADV_RANDOM` (page faults read one page, not the read-around window).
    #[arg(long)]
    pub random_access: bool,
    /// Open with `MADV_HUGEPAGE`.
    #[arg(long)]
    pub huge_pages: bool,
    /// Copy the model into anonymous memory on huge pages (no cold figures then).
    #[arg(long, conflicts_with_all = ["cold", "cold_mapping", "prefetch"])]
    pub in_memory: bool,
    /// Draft nodes of a timed prune (the reference's 60; DART's CPU trees are about 12, a
    /// batch row's a few): the beam stops at the paths such a tree can use.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub budget: u64,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

const LEVELS: usize = 8;
const K: usize = 25;

/// Percentiles of a set of timings, in microseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Timing {
    pub n: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    /// Page faults per timed call, mean: minor (page in the page cache, not mapped) and
    /// major (read from disk).
    pub minor_faults: f64,
    pub major_faults: f64,
}

/// One timed call: microseconds and the page faults it took.
struct Sample {
    us: f64,
    minor: u64,
    major: u64,
}

/// This thread's page faults so far (minor, major).
fn thread_faults() -> (u64, u64) {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    (u.ru_minflt as u64, u.ru_majflt as u64)
}

/// Times `f`, counting its page faults outside the timed span.
fn sample<T>(f: impl FnOnce() -> T) -> (Sample, T) {
    let (minor, major) = thread_faults();
    let start = Instant::now();
    let out = f();
    let us = micros(start);
    let (minor2, major2) = thread_faults();
    let s = Sample {
        us,
        minor: minor2 - minor,
        major: major2 - major,
    };
    (s, out)
}

impl Timing {
    fn of(samples: Vec<Sample>) -> Option<Timing> {
        if samples.is_empty() {
            return None;
        }
        let n = samples.len() as f64;
        let minor_faults = samples.iter().map(|s| s.minor as f64).sum::<f64>() / n;
        let major_faults = samples.iter().map(|s| s.major as f64).sum::<f64>() / n;
        let mut t: Vec<f64> = samples.iter().map(|s| s.us).collect();
        t.sort_by(f64::total_cmp);
        let q = |f: f64| t[((t.len() - 1) as f64 * f).round() as usize];
        Some(Timing {
            n: t.len(),
            p50_us: q(0.5),
            p99_us: q(0.99),
            mean_us: t.iter().sum::<f64>() / t.len() as f64,
            minor_faults,
            major_faults,
        })
    }
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub bytes: u64,
    pub ngrams: u64,
    pub open_options: String,
    /// Draft nodes of every timed prune.
    pub prune_budget: usize,
    /// Open time with the file's pages warm, and (`--cold`) evicted first.
    pub open_ms_warm: f64,
    pub open_ms_cold: Option<f64>,
    /// Reading the file into the page cache before the warm figures.
    pub warm_up_seconds: f64,
    pub prob25_warm: Option<Timing>,
    pub prob25_repeat: Option<Timing>,
    pub prob25_cold: Option<Timing>,
    pub prob25_cold_mapping: Option<Timing>,
    pub prune_warm: Option<Timing>,
    pub prune_repeat: Option<Timing>,
    pub prune_cold: Option<Timing>,
    pub prune_cold_mapping: Option<Timing>,
    /// `--prefetch`: the open, lookups timed right after it (page cache dropped first), and
    /// seconds from the open until every page of the file was resident.
    pub open_ms_prefetch: Option<f64>,
    pub prob25_prefetching: Option<Timing>,
    pub prefetch_seconds: Option<f64>,
    /// Resident memory of this process after the warm figures (`VmRSS`, `RssFile`, kB).
    pub rss_kb: Option<u64>,
    pub rss_file_kb: Option<u64>,
}

/// A field of `/proc/PID/status` in kB.
fn proc_status_kb(pid: &str, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn micros(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e6
}

/// Reads the file sequentially so that its pages are in the page cache.
fn warm_up(path: &std::path::Path) -> std::io::Result<f64> {
    use std::io::Read;
    let start = Instant::now();
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 8 << 20];
    while f.read(&mut buf)? > 0 {}
    Ok(start.elapsed().as_secs_f64())
}

/// One lookup: the context of row `l` of a request (the request's context and the first `l`
/// tokens of the walk, as the pruner asks) and that row's 25 candidates.
struct Lookup {
    context: Vec<u32>,
    candidates: Vec<u32>,
}

fn lookups(requests: &[OwnedRequest]) -> Vec<Lookup> {
    let mut out = Vec::new();
    for r in requests {
        for l in 0..r.levels {
            // The pruner's context for row l extends the root's by the path taken; take the
            // best candidate of each row above as that path.
            let mut context = r.context.clone();
            context.extend((0..l).map(|j| r.topk_ids[j * r.k]));
            out.push(Lookup {
                context,
                candidates: r.topk_ids[l * r.k..(l + 1) * r.k].to_vec(),
            });
        }
    }
    out
}

fn time_lookups(
    m: &NGramModel,
    ls: &[Lookup],
    evict: Option<Eviction>,
) -> Result<Vec<Sample>, dart_ngram::NGramError> {
    let mut probs = vec![0f32; K];
    let mut matched = vec![0u8; K];
    let mut t = Vec::with_capacity(ls.len());
    for l in ls {
        if let Some(e) = evict {
            m.evict_pages(e)?;
        }
        let (s, out) = sample(|| m.prob_many(&l.context, &l.candidates, &mut probs, &mut matched));
        out?;
        t.push(s);
        std::hint::black_box(&probs);
    }
    Ok(t)
}

fn time_prunes(
    m: &NGramModel,
    pruner: &Pruner<Arc<NGramModel>>,
    rs: &[OwnedRequest],
    budget: usize,
    evict: Option<Eviction>,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    let mut t = Vec::with_capacity(rs.len());
    for r in rs {
        if let Some(e) = evict {
            m.evict_pages(e)?;
        }
        // A single request is pruned on this thread: its faults are this thread's.
        let request = DraftRequest {
            budget: Some(budget),
            ..r.request()
        };
        let (s, tree) = sample(|| pruner.prune(&request));
        t.push(s);
        std::hint::black_box(tree?);
    }
    Ok(t)
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let opts = OpenOptions {
        skip_checksums: !args.checksums,
        random_access: args.random_access,
        huge_pages: args.huge_pages,
        in_memory: args.in_memory,
        ..Default::default()
    };
    let open_options = format!(
        "{}{}{}{}",
        if args.checksums {
            "checksums"
        } else {
            "skip-checksums"
        },
        if args.random_access {
            ", random-access"
        } else {
            ""
        },
        if args.huge_pages { ", huge-pages" } else { "" },
        if args.in_memory { ", in-memory" } else { "" },
    );
    let open_ms = || -> Result<(f64, NGramModel), dart_ngram::NGramError> {
        let start = Instant::now();
        let m = NGramModel::open_with(&args.model, &opts)?;
        Ok((start.elapsed().as_secs_f64() * 1e3, m))
    };
    let mut rng = Rng(args.seed);
    let mut report = BenchReport {
        model: args.model.display().to_string(),
        bytes: 0,
        ngrams: 0,
        open_options,
        prune_budget: args.budget as usize,
        open_ms_warm: 0.0,
        open_ms_cold: None,
        warm_up_seconds: 0.0,
        prob25_warm: None,
        prob25_repeat: None,
        prob25_cold: None,
        prob25_cold_mapping: None,
        prune_warm: None,
        prune_repeat: None,
        prune_cold: None,
        prune_cold_mapping: None,
        open_ms_prefetch: None,
        prob25_prefetching: None,
        prefetch_seconds: None,
        rss_kb: None,
        rss_file_kb: None,
    };
    if args.cold {
        NGramModel::open_with(&args.model, &opts)?.evict_pages(Eviction::PageCache)?;
        report.open_ms_cold = Some(open_ms()?.0);
    }
    report.warm_up_seconds =
        warm_up(&args.model).map_err(|e| dart_ngram::NGramError::io(&args.model, e))?;
    let (warm_open, model) = open_ms()?;
    // The warm figures are of a model whose pages are cached and mapped (as in a daemon that
    // has served a while): no page faults, only cache and TLB misses.
    drop(model);
    let model = NGramModel::open_with(
        &args.model,
        &OpenOptions {
            populate: !args.in_memory,
            ..opts.clone()
        },
    )?;
    report.open_ms_warm = warm_open;
    report.bytes = model.bytes();
    report.ngrams = model.ngrams_per_order().iter().sum();
    let model = Arc::new(model);
    let docs = walk_documents(&model, 300, 60, &mut rng);
    let requests = draft_requests(&model, &docs, args.requests, LEVELS, K, &mut rng);
    if requests.is_empty() {
        return Err(format!(
            "{}: no random walk of 60 tokens found; the model is too small to benchmark",
            args.model.display()
        )
        .into());
    }
    // Lookups in a shuffled order, so consecutive ones do not share a request's context.
    let mut ls = lookups(&requests);
    for i in (1..ls.len()).rev() {
        ls.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let pruner = Pruner::new(model.clone(), PrunerConfig::default())?;
    // Prunes first (their lookups differ from the rows' lookups only by the path taken), then
    // the lookups: both are first touches of most of their cache lines.
    let (half, rest) = requests.split_at(requests.len() / 2);
    let budget = report.prune_budget;
    let prunes = |rs: &[OwnedRequest], evict| time_prunes(&model, &pruner, rs, budget, evict);
    report.prune_warm = Timing::of(prunes(half, None)?);
    report.prob25_warm = Timing::of(time_lookups(&model, &ls, None)?);
    report.prob25_repeat = Timing::of(time_lookups(&model, &ls, None)?);
    report.prune_repeat = Timing::of(prunes(half, None)?);
    report.rss_kb = proc_status_kb("self", "VmRSS");
    report.rss_file_kb = proc_status_kb("self", "RssFile");
    // Each cold figure takes its own lookups and prunes: none was made before by this
    // process.
    let mut cold_ls = ls.chunks(args.cold_queries.max(1));
    let mut cold_rs = rest.chunks(args.cold_queries.max(1));
    if args.cold_mapping {
        let e = Some(Eviction::Mapping);
        report.prob25_cold_mapping =
            Timing::of(time_lookups(&model, cold_ls.next().unwrap_or(&[]), e)?);
        report.prune_cold_mapping = Timing::of(prunes(cold_rs.next().unwrap_or(&[]), e)?);
    }
    if args.cold {
        let e = Some(Eviction::PageCache);
        report.prob25_cold = Timing::of(time_lookups(&model, cold_ls.next().unwrap_or(&[]), e)?);
        report.prune_cold = Timing::of(prunes(cold_rs.next().unwrap_or(&[]), e)?);
    }
    if args.prefetch && !args.in_memory {
        model.evict_pages(Eviction::PageCache)?;
        drop(pruner);
        drop(model);
        let start = Instant::now();
        let model = NGramModel::open_with(
            &args.model,
            &OpenOptions {
                prefetch: true,
                ..opts.clone()
            },
        )?;
        report.open_ms_prefetch = Some(start.elapsed().as_secs_f64() * 1e3);
        report.prob25_prefetching =
            Timing::of(time_lookups(&model, cold_ls.next().unwrap_or(&[]), None)?);
        while model.resident_bytes()? < model.bytes() {
            if start.elapsed().as_secs() > 3600 {
                return Err("the prefetch did not make the file resident within an hour".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        report.prefetch_seconds = Some(start.elapsed().as_secs_f64());
    }
    if args.json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    }
    emit(&summary(&report))
}

fn summary(r: &BenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model            {} ({} bytes, {} n-grams)",
        r.model, r.bytes, r.ngrams
    );
    let _ = writeln!(s, "open options     {}", r.open_options);
    let _ = writeln!(s, "prune budget     {} draft nodes", r.prune_budget);
    let _ = writeln!(s, "open             {:.2} ms warm", r.open_ms_warm);
    if let Some(c) = r.open_ms_cold {
        let _ = writeln!(s, "open cold        {c:.2} ms");
    }
    let _ = writeln!(s, "warm-up read     {:.1} s", r.warm_up_seconds);
    for (name, t) in [
        ("P(c|ctx) x25 warm", &r.prob25_warm),
        ("P(c|ctx) x25 repeat", &r.prob25_repeat),
        ("P(c|ctx) x25 cold", &r.prob25_cold),
        ("P(c|ctx) x25 cold mapping", &r.prob25_cold_mapping),
        ("P(c|ctx) x25 while prefetching", &r.prob25_prefetching),
        ("prune warm", &r.prune_warm),
        ("prune repeat", &r.prune_repeat),
        ("prune cold", &r.prune_cold),
        ("prune cold mapping", &r.prune_cold_mapping),
    ] {
        if let Some(t) = t {
            let _ = writeln!(
                s,
                "{name:<30} p50 {:9.2} us  p99 {:9.2} us  mean {:9.2} us  (n = {}){}",
                t.p50_us,
                t.p99_us,
                t.mean_us,
                t.n,
                if t.minor_faults + t.major_faults > 0.0 {
                    format!(
                        ", faults {:.1} minor + {:.1} major",
                        t.minor_faults, t.major_faults
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    if let (Some(o), Some(p)) = (r.open_ms_prefetch, r.prefetch_seconds) {
        let _ = writeln!(
            s,
            "prefetch         open {o:.2} ms, whole file resident after {p:.2} s"
        );
    }
    if let (Some(a), Some(b)) = (r.rss_kb, r.rss_file_kb) {
        let _ = writeln!(s, "rss              {a} kB ({b} kB of file pages)");
    }
    s
}
