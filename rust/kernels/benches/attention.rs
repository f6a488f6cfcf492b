//! Tree attention on SmolLM2-135M's shapes (9 query heads over 3 key/value heads of 64):
//! `attention/<queries>` over 300 cached keys plus the queries' own, with a causal mask, and
//! `attention_batch/4x5` as a batched verification of 4 rows with 5-node trees calls it: rows of
//! 39, 95, 462 and 31 cached tokens, stale positions up to the longest masked.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dart_kernels::{attention, f32_to_bf16, View4};

fn bench(c: &mut Criterion) {
    let (heads, kv_heads, dim, context) = (9, 3, 64, 300);
    let mut group = c.benchmark_group("attention");
    for queries in [1usize, 8, 24, 64] {
        let length = context + queries;
        let values = |n: usize, seed: usize| -> Vec<u16> {
            (0..n)
                .map(|i| f32_to_bf16((((i * 7919 + seed) % 1000) as f32 / 500.0) - 1.0))
                .collect()
        };
        let q = values(heads * queries * dim, 1);
        let k = values(kv_heads * length * dim, 2);
        let v = values(kv_heads * length * dim, 3);
        let mask: Vec<u16> = (0..queries)
            .flat_map(|i| (0..length).map(move |j| (i, j)))
            .map(|(i, j)| f32_to_bf16(if j <= context + i { 0.0 } else { f32::MIN }))
            .collect();
        let mut out = vec![0u16; queries * heads * dim];
        let qv = View4::new(
            "q",
            &q,
            [1, heads, queries, dim],
            [0, queries * dim, dim, 1],
        )
        .unwrap();
        let kv_shape = [1, kv_heads, length, dim];
        let kv_strides = [0, length * dim, dim, 1];
        let kv = View4::new("k", &k, kv_shape, kv_strides).unwrap();
        let vv = View4::new("v", &v, kv_shape, kv_strides).unwrap();
        let mv = View4::new("mask", &mask, [1, 1, queries, length], [0, 0, length, 1]).unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(queries), &queries, |b, _| {
            b.iter(|| attention(&qv, &kv, &vv, Some(&mv), 0.125, &mut out, 1).unwrap())
        });
    }
    group.finish();

    let (lengths, nodes) = ([39usize, 95, 462, 31], 5usize);
    let batch = lengths.len();
    let frontier = *lengths.iter().max().unwrap();
    let length = frontier + nodes;
    let values = |n: usize, seed: usize| -> Vec<u16> {
        (0..n)
            .map(|i| f32_to_bf16((((i * 7919 + seed) % 1000) as f32 / 500.0) - 1.0))
            .collect()
    };
    let q = values(batch * heads * nodes * dim, 1);
    let k = values(batch * kv_heads * length * dim, 2);
    let v = values(batch * kv_heads * length * dim, 3);
    // Row b sees its own cache, then its tree as a chain (node i sees nodes 0..=i).
    let mask: Vec<u16> = (0..batch)
        .flat_map(|b| (0..nodes).flat_map(move |i| (0..length).map(move |j| (b, i, j))))
        .map(|(b, i, j)| {
            let sees = j < lengths[b] || (j >= frontier && j <= frontier + i);
            f32_to_bf16(if sees { 0.0 } else { f32::MIN })
        })
        .collect();
    let mut out = vec![0u16; batch * nodes * heads * dim];
    let qv = View4::new(
        "q",
        &q,
        [batch, heads, nodes, dim],
        [heads * nodes * dim, nodes * dim, dim, 1],
    )
    .unwrap();
    let kv_shape = [batch, kv_heads, length, dim];
    let kv_strides = [kv_heads * length * dim, length * dim, dim, 1];
    let kv = View4::new("k", &k, kv_shape, kv_strides).unwrap();
    let vv = View4::new("v", &v, kv_shape, kv_strides).unwrap();
    let mv = View4::new(
        "mask",
        &mask,
        [batch, 1, nodes, length],
        [nodes * length, 0, length, 1],
    )
    .unwrap();
    c.bench_function("attention_batch/4x5", |b| {
        b.iter(|| attention(&qv, &kv, &vv, Some(&mv), 0.125, &mut out, 1).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
