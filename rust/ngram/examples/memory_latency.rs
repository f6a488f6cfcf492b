//! The latency of one dependent load from memory, with 4 KB and with 2 MB pages: what a chain
//! of n-gram lookups waits on per step once the model is larger than the caches (issue #22).
//!
//!     cargo run --release -p dart-ngram --example memory_latency -- [BYTES] [LOADS]
//!
//! A random cyclic permutation of the buffer's cache lines is followed load after load (each
//! address comes from the previous load, so nothing overlaps), once on a mapping advised
//! `MADV_NOHUGEPAGE` and once `MADV_HUGEPAGE`. Default: 1 GiB, 2,000,000 loads.

use std::time::Instant;

use memmap2::MmapMut;

/// A 64-bit xorshift: enough to shuffle the lines.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn chase_ns(bytes: usize, loads: usize, huge: bool) -> std::io::Result<f64> {
    let mut map = MmapMut::map_anon(bytes)?;
    let advice = if huge {
        libc::MADV_HUGEPAGE
    } else {
        libc::MADV_NOHUGEPAGE
    };
    // SAFETY: the range is this mapping; advice only changes how it is backed.
    unsafe { libc::madvise(map.as_mut_ptr().cast(), bytes, advice) };
    let words: &mut [u64] = as_words(&mut map);
    let lines = words.len() / 8;
    // Sattolo's algorithm: one cycle through every line.
    let mut order: Vec<usize> = (0..lines).collect();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..lines).rev() {
        let j = (next(&mut state) % i as u64) as usize;
        order.swap(i, j);
    }
    for (i, &line) in order.iter().enumerate() {
        words[line * 8] = (order[(i + 1) % lines] * 8) as u64;
    }
    let mut at = 0usize;
    let start = Instant::now();
    for _ in 0..loads {
        at = words[at] as usize;
    }
    let ns = start.elapsed().as_secs_f64() * 1e9 / loads as f64;
    std::hint::black_box(at);
    Ok(ns)
}

/// The mapping as u64 words (an anonymous mapping is page-aligned).
fn as_words(map: &mut MmapMut) -> &mut [u64] {
    let len = map.len() / 8;
    // SAFETY: page-aligned, `len * 8` bytes long, and u64 has no invalid bit patterns.
    unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().cast::<u64>(), len) }
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let bytes: usize = args.next().map_or(1 << 30, |a| a.parse().expect("BYTES"));
    let loads: usize = args.next().map_or(2_000_000, |a| a.parse().expect("LOADS"));
    for huge in [false, true] {
        let ns = chase_ns(bytes, loads, huge)?;
        let pages = if huge { "2 MB pages" } else { "4 KB pages" };
        println!(
            "{} MiB, {pages}: {ns:.1} ns per dependent load",
            bytes >> 20
        );
    }
    Ok(())
}
