//! What `dart-ngram build` promises beyond its output: peak memory within `--memory` plus a
//! documented constant while it spills, and a model file that is never seen half written.
#![cfg(target_os = "linux")]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dart_ngram::model::NGramModel;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dart-ngram"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The fixed memory beside `--memory` that the README documents: the binary and its
/// libraries, the tokenizer, the batches in flight, the merge's and the writer's buffers
/// (measured: 34 MiB peak at `--memory 24M` here, from ids on 2 threads; 90 MB at 12M with
/// SmolLM2's tokenizer).
const RSS_CONSTANT: u64 = 80 << 20;

/// `docs` documents of random ids over a `vocab`-token vocabulary (xorshift from `seed`):
/// almost every 2- and 3-gram is distinct, so the counts outgrow a small budget.
fn random_corpus(path: &Path, docs: usize, tokens_per_doc: usize, vocab: u64, seed: u64) {
    let mut state = seed | 1;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for _ in 0..docs {
        let ids: Vec<String> = (0..tokens_per_doc)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % vocab).to_string()
            })
            .collect();
        writeln!(f, "{{\"ids\": [{}]}}", ids.join(",")).unwrap();
    }
    f.flush().unwrap();
}

/// Runs `dart-ngram` with `args` to the end; its exit status, its peak RSS in bytes (the
/// kernel's high-water mark of the child, from `wait4`), and stdout.
// Reaped by wait4 below (std's wait would not give the child's rusage).
#[allow(clippy::zombie_processes)]
fn run_measured(args: &[&str]) -> (i32, u64, String) {
    let child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut stdout = child.stdout.unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut out).unwrap();
    let mut status = 0;
    // SAFETY: plain syscall on our own child; `usage` is written by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(waited, pid, "wait4: {}", std::io::Error::last_os_error());
    // ru_maxrss is in KiB on Linux.
    (status, usage.ru_maxrss as u64 * 1024, out)
}

/// A build whose counts need several times the budget spills, and its peak RSS stays within
/// the budget plus the documented constant (a build that ignores `--memory` needs ~300 MB).
#[test]
fn a_spilling_build_stays_within_its_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.jsonl");
    // 4M tokens: ~8M distinct 2- and 3-grams, ~180 MB of table in memory.
    random_corpus(&corpus, 4000, 1000, 50_000, 0x9E37_79B9_7F4A_7C15);
    let out = dir.path().join("m.ngram");
    let budget: u64 = 24 << 20;
    let (status, rss, stdout) = run_measured(&[
        "build",
        "--input",
        s(&corpus),
        "--output",
        s(&out),
        "--vocab-size",
        "50000",
        "--no-eos",
        "--threads",
        "2",
        "--memory",
        "24M",
        "--json",
        "-q",
    ]);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "status {status}"
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let spilled = report["spilled_runs"].as_u64().unwrap();
    eprintln!(
        "peak RSS {:.1} MiB, budget {} MiB + constant {} MiB, {spilled} spilled runs",
        rss as f64 / (1 << 20) as f64,
        budget >> 20,
        RSS_CONSTANT >> 20
    );
    assert!(
        rss <= budget + RSS_CONSTANT,
        "peak RSS {rss} bytes > budget {budget} + constant {RSS_CONSTANT}"
    );
    assert!(
        spilled >= 4,
        "the build did not spill enough to test the budget: {spilled}"
    );
    NGramModel::open(&out).unwrap();
}

/// `kill -9` while the model file is being written: the previous model stays under the
/// output's name, byte for byte, and nothing half written ever appears there. (The killed
/// build's hidden temporary file `.dart-ngram-*.tmp` stays behind in the directory.)
#[test]
fn kill_9_during_the_final_write_leaves_the_old_model() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.jsonl");
    std::fs::write(&small, "{\"ids\": [1, 2, 3]}\n{\"ids\": [2, 3]}\n").unwrap();
    let out = dir.path().join("m.ngram");
    let build = |input: &Path| {
        let mut cmd = bin();
        cmd.args(["build", "--input", s(input), "--output", s(&out)])
            .args(["--vocab-size", "50000", "--no-eos", "--threads", "2", "-q"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    };
    assert!(build(&small).status().unwrap().success());
    let old = std::fs::read(&out).unwrap();

    let big = dir.path().join("big.jsonl");
    random_corpus(&big, 2000, 1000, 50_000, 7);
    let old_meta = std::fs::metadata(&out).unwrap();
    // Once counting is done the model is written: into the writer's temporary file (with
    // the output's name changed only by the final rename), or, by a writer that wrote in
    // place, into the output itself.
    let writing = || {
        let temp = std::fs::read_dir(dir.path()).unwrap().find_map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = e.metadata().unwrap();
            let is_temp = name.starts_with(".dart-ngram-") && name.ends_with(".tmp");
            (is_temp && meta.is_file() && meta.len() > 0).then_some(name)
        });
        let now = std::fs::metadata(&out).unwrap();
        let touched =
            now.len() != old_meta.len() || now.modified().unwrap() != old_meta.modified().unwrap();
        temp.or_else(|| touched.then(|| "the output itself".to_string()))
    };
    let mut child = build(&big).spawn().unwrap();
    let start = Instant::now();
    let seen = loop {
        if let Some(name) = writing() {
            break name;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the build ended before its write was seen"
        );
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no write began in 2 minutes"
        );
        std::thread::sleep(Duration::from_micros(200));
    };
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the build finished before the kill: {status}"
    );
    eprintln!("killed while writing {seen}");
    assert_eq!(
        std::fs::read(&out).unwrap(),
        old,
        "the output changed under its name"
    );
    NGramModel::open(&out).unwrap();
    // The next build is not disturbed by what the killed one left.
    assert!(build(&small).status().unwrap().success());
    assert_eq!(std::fs::read(&out).unwrap(), old);
}
