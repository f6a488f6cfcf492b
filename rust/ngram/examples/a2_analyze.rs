// Temporary (engineer A2): bucket occupancy seen by the bench workload.
use dart_ngram::{key, NGramModel};
use std::collections::HashMap;
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 { self.0 ^= self.0 >> 12; self.0 ^= self.0 << 25; self.0 ^= self.0 >> 27; self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) }
    fn unit(&mut self) -> f64 { (self.next() >> 11) as f64 / (1u64 << 53) as f64 }
    fn zipf(&mut self, n: u32) -> u32 { let s = 1.1f64; let u = self.unit(); let hn = ((n as f64).powf(1.0 - s) - 1.0) / (1.0 - s); let x = (1.0 + u * hn * (1.0 - s)).powf(1.0 / (1.0 - s)); (x as u32).clamp(1, n) - 1 }
}
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let m = NGramModel::open(a[1].as_ref()).unwrap();
    let stride: u64 = a[2].parse().unwrap();
    let use_cdf = a.get(3).is_some();
    let bits = key::token_bits(m.vocab_size());
    let v = m.vocab_size() as u64;
    let mut kids2: HashMap<u64, Vec<u64>> = HashMap::new();
    for r in m.iter_order(2) { let (k, _) = r.unwrap(); kids2.entry(k >> bits).or_default().push(k & ((1 << bits) - 1)); }
    let mut kids3: HashMap<u64, Vec<u64>> = HashMap::new();
    for r in m.iter_order(3) { let (k, _) = r.unwrap(); kids3.entry(k >> bits).or_default().push(k & ((1 << bits) - 1)); }
    // Global CDF of child tokens over orders 2 and 3.
    let mut freq = vec![0u64; v as usize];
    for ch in kids2.values().chain(kids3.values()) { for &t in ch { freq[t as usize] += 1; } }
    let tot: u64 = freq.iter().sum();
    let mut cdf = vec![0u64; v as usize];
    let mut acc = 0u64;
    for t in 0..v as usize { cdf[t] = ((acc as u128 * (1u128 << 32)) / tot as u128) as u64; acc += freq[t]; }
    let f = |t: u64| -> u64 { if use_cdf { cdf[t as usize] } else { (t << 32) / v } };
    let tri: Vec<u64> = m.iter_order(3).step_by(97).map(|r| r.unwrap().0).take(1024).collect();
    let mut rng = Rng(42);
    let (mut n2, mut n1, mut s2, mut s1, mut found2, mut found1, mut r2, mut r1) = (0u64, 0u64, 0f64, 0f64, 0, 0, 0f64, 0f64);
    let mut hist = [0u64; 20];
    let (mut ideal, mut lock) = (0u64, 0u64);
    for k in tri {
        let ctx = [key::token_at(k, 3, 0, bits), key::token_at(k, 3, 1, bits)];
        let mut cands: Vec<u32> = m.top_k(&ctx, 12).unwrap().into_iter().map(|(t, _)| t).collect();
        while cands.len() < 25 { cands.push(rng.zipf(m.vocab_size())); }
        let c2 = &kids3[&((u64::from(ctx[0]) << bits) | u64::from(ctx[1]))];
        let c1 = &kids2[&u64::from(ctx[1])];
        let bsize = |ch: &Vec<u64>, t: u64| -> usize {
            let b = (ch.len() as u64 / stride).max(0);
            if b == 0 { return ch.len(); }
            let nb = b + 1;
            let bk = (f(t) * nb) >> 32;
            ch.iter().filter(|&&x| (f(x) * nb) >> 32 == bk).count()
        };
        let lg = |x: usize| -> u64 { if x <= 1 { 0 } else { 64 - ((x - 1) as u64).leading_zeros() as u64 } };
        let (mut mx2, mut mx1, mut np1) = (0usize, 0usize, 0u64);
        for &c in &cands {
            let c = u64::from(c);
            mx2 = mx2.max(bsize(c2, c)); ideal += lg(bsize(c2, c));
            if c2.binary_search(&c).is_err() { mx1 = mx1.max(bsize(c1, c)); np1 += 1; ideal += lg(bsize(c1, c)); }
        }
        lock += 25 * lg(mx2) + np1 * lg(mx1);
        for &c in &cands {
            let c = u64::from(c);
            n2 += 1; s2 += bsize(c2, c) as f64; r2 += c2.len() as f64;
            if c2.binary_search(&c).is_ok() { found2 += 1; continue; }
            n1 += 1; let bs = bsize(c1, c); s1 += bs as f64; r1 += c1.len() as f64;
            hist[(64 - (bs as u64).leading_zeros()) as usize] += 1;
            if c1.binary_search(&c).is_ok() { found1 += 1; }
        }
    }
    println!("level2: {n2} searches, found {found2}, mean range {:.1}, mean bucket {:.1}", r2 / n2 as f64, s2 / n2 as f64);
    println!("level1: {n1} searches, found {found1}, mean range {:.1}, mean bucket {:.1}", r1 / n1 as f64, s1 / n1 as f64);
    println!("level1 bucket size log2 hist: {hist:?}");
    println!("steps per call: per-candidate {:.1}, lockstep {:.1}", ideal as f64 / 1024.0, lock as f64 / 1024.0);
}
