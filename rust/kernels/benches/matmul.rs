//! The decoding matmul on SmolLM2-135M's shapes: one pass over all 30 layers' linear weights
//! plus the tied output projection (268 MB in bf16, more than most caches), per row count.
//! `matmul/<backend>/<rows>` against `matmul/<backend>/1` is the cost of verifying a tree of
//! that many tokens relative to one decoding step (linear layers only), for every backend this
//! CPU runs (AMX tiles, AVX512-BF16 dot products, AVX-512 or AVX2 FMAs).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dart_kernels::{f32_to_bf16, Backend, PackedMatrix};

fn smollm2_weights() -> Vec<PackedMatrix> {
    let (hidden, kv, ffn, vocab) = (576, 192, 1536, 49152);
    let per_layer = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (ffn, hidden),
        (ffn, hidden),
        (hidden, ffn),
    ];
    let mut state = 1u32;
    let mut matrix = |n: usize, k: usize| {
        let w: Vec<u16> = (0..n * k)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                f32_to_bf16((state >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
            })
            .collect();
        PackedMatrix::pack(&w, n, k).unwrap()
    };
    let mut all: Vec<PackedMatrix> = (0..30)
        .flat_map(|_| per_layer.iter().map(|&(n, k)| (n, k)).collect::<Vec<_>>())
        .map(|(n, k)| matrix(n, k))
        .collect();
    all.push(matrix(vocab, hidden));
    all
}

fn bench(c: &mut Criterion) {
    let weights = smollm2_weights();
    let bytes: usize = weights.iter().map(PackedMatrix::packed_bytes).sum();
    let mut group = c.benchmark_group("matmul");
    group.sample_size(20);
    // Every SIMD kernel this CPU runs (the scalar one only where there is none).
    let mut backends = Backend::runnable();
    if backends.len() > 1 {
        backends.retain(|&b| b != Backend::Scalar);
    }
    for backend in backends {
        for rows in [1usize, 2, 4, 8, 16, 32, 64] {
            let x = vec![f32_to_bf16(0.01); rows * 1536];
            let mut out = vec![0u16; rows * 49152];
            group.throughput(Throughput::Bytes(bytes as u64));
            let id = BenchmarkId::new(backend.name(), rows);
            group.bench_with_input(id, &rows, |b, &rows| {
                b.iter(|| {
                    for w in &weights {
                        let k = w.in_features();
                        let n = w.out_features();
                        w.matmul_with(backend, &x[..rows * k], rows, None, &mut out[..rows * n], 1)
                            .unwrap();
                    }
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
