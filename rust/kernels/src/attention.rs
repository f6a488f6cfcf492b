//! Attention of a few queries over a key/value cache, each query on its own.
//!
//! Every (batch, head, query) is computed from its visible keys alone, in key order: their
//! scores (a dot product over the head dimension), the softmax (max, exponentials, their
//! sum), then the weighted sum of values, always with the same operations in the same order.
//! Blocked keys are skipped, not added as zeros. So a query's output depends only on its own
//! vector and on the keys and values it sees, not on how many other queries share the call
//! or where blocked keys sit in the cache: a node of a draft tree gets the bits that decoding
//! its path one token at a time would give (with [`crate::PackedMatrix`] for the linear
//! layers, a tree's logits equal one-token decoding's).
//!
//! Only the keys some query of a (batch, kv head) sees are read: a batched verification's
//! row sees its own cache and tree, not the other rows' longer stretches (stale positions
//! up to the longest row), so those are neither converted nor scored. A key's score is the
//! same bits wherever it sits, so this changes no output.
//!
//! Tensors are bf16 bits with arbitrary (non-negative) strides and a contiguous last
//! dimension ([`View4`]); scores and sums are f32; the output is rounded to bf16 once.

use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::error::{KernelError, Result};
use crate::matmul::pool;
use rayon::prelude::*;
use std::cell::Cell;

/// Mask values at or below this block a key (transformers writes the dtype's minimum,
/// PyTorch's SDPA takes -inf); other values are added to the score.
pub const BLOCKED_AT_OR_BELOW: f32 = -1e30;

/// A 4-D view of bf16 bits: `shape`, `strides` in elements (the last one must be 1).
#[derive(Clone, Copy, Debug)]
pub struct View4<'a> {
    data: &'a [u16],
    shape: [usize; 4],
    strides: [usize; 4],
}

impl<'a> View4<'a> {
    /// Checks that every element lies inside `data` and that rows are contiguous.
    pub fn new(
        what: &'static str,
        data: &'a [u16],
        shape: [usize; 4],
        strides: [usize; 4],
    ) -> Result<Self> {
        if strides[3] != 1 && shape[3] > 1 {
            return Err(KernelError::Layout {
                what,
                problem: "its last dimension must be contiguous",
            });
        }
        if shape.contains(&0) {
            return Err(KernelError::Layout {
                what,
                problem: "it has an empty dimension",
            });
        }
        let last: usize = shape.iter().zip(&strides).map(|(&n, &s)| (n - 1) * s).sum();
        if last >= data.len() {
            return Err(KernelError::Length {
                what,
                expected: last + 1,
                got: data.len(),
            });
        }
        Ok(Self {
            data,
            shape,
            strides,
        })
    }

    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }

    /// The contiguous last dimension at `[a, b, c, ..]`.
    fn row(&self, a: usize, b: usize, c: usize) -> &'a [u16] {
        let start = a * self.strides[0] + b * self.strides[1] + c * self.strides[2];
        &self.data[start..start + self.shape[3]]
    }
}

/// `softmax(q kᵀ · scale + mask) v` for queries `(batch, heads, n, dim)`, keys and values
/// `(batch, kv_heads, length, dim)` (query head `h` reads kv head `h / (heads / kv_heads)`),
/// and a mask `(1 | batch, 1 | heads, n, >= length)` or none (causal: query `i` sees keys up
/// to `length - n + i`). Writes `out` `(batch, n, heads, dim)`, contiguous, the layout
/// transformers' attention functions return. A query with no visible key gets NaN, as the
/// softmax of nothing does in PyTorch.
pub fn attention(
    query: &View4<'_>,
    key: &View4<'_>,
    value: &View4<'_>,
    mask: Option<&View4<'_>>,
    scale: f32,
    out: &mut [u16],
    threads: usize,
) -> Result<()> {
    attention_into(query, key, value, mask, scale, out, threads, Isa::best())
}

/// The instruction set a call runs on: the best this CPU has ([`Isa::best`]); tests ask for
/// the lesser ones too, since every one must keep a query's result independent of the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

impl Isa {
    /// The matmul's choice ([`crate::Backend::best`], capped by `DART_MAX_CPU_ISA` alike).
    pub(crate) fn best() -> Isa {
        Isa::of(crate::Backend::best())
    }

    /// The attention that goes with a matmul backend: AMX and AVX512-BF16 CPUs run the
    /// AVX-512 one.
    fn of(backend: crate::Backend) -> Isa {
        match backend {
            crate::Backend::Amx
            | crate::Backend::Avx512Bf16
            | crate::Backend::Avx512
            | crate::Backend::Auto => Isa::Avx512,
            crate::Backend::Avx2 => Isa::Avx2,
            crate::Backend::Scalar => Isa::Scalar,
        }
    }
}

/// An output element: bf16 bits (what models take) or f32 (what tests compare, since bf16
/// rounding would hide a difference in the order of operations).
pub(crate) trait Output: Copy + Send + Sync {
    fn from_f32(x: f32) -> Self;
}

impl Output for u16 {
    fn from_f32(x: f32) -> Self {
        f32_to_bf16(x)
    }
}

impl Output for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
}

// `attention`'s arguments plus the instruction set (which tests choose).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_into<O: Output>(
    query: &View4<'_>,
    key: &View4<'_>,
    value: &View4<'_>,
    mask: Option<&View4<'_>>,
    scale: f32,
    out: &mut [O],
    threads: usize,
    isa: Isa,
) -> Result<()> {
    let [batch, heads, queries, dim] = query.shape;
    let [kb, kv_heads, length, kd] = key.shape;
    if kb != batch || kd != dim {
        return Err(shape_error(
            "key",
            key.shape,
            "(batch, kv_heads, length, dim)",
        ));
    }
    if value.shape != key.shape {
        return Err(shape_error("value", value.shape, "the key's shape"));
    }
    if heads % kv_heads != 0 {
        return Err(shape_error(
            "key",
            key.shape,
            "kv_heads dividing the query heads",
        ));
    }
    if let Some(m) = mask {
        let [mb, mh, mn, ml] = m.shape;
        if !(mb == 1 || mb == batch) || !(mh == 1 || mh == heads) || mn != queries || ml < length {
            return Err(shape_error(
                "mask",
                m.shape,
                "(1 | batch, 1 | heads, n, >= length)",
            ));
        }
    }
    if out.len() != batch * queries * heads * dim {
        return Err(KernelError::Length {
            what: "out",
            expected: batch * queries * heads * dim,
            got: out.len(),
        });
    }
    let group = heads / kv_heads;
    // Query rows computed together share one pass over the keys and values (they see the
    // same keys: the heads of one kv group at one query position, unless the mask differs
    // per head). A row's own arithmetic is the same in any unit.
    let per_unit = if mask.is_some_and(|m| m.shape[1] != 1) {
        1
    } else {
        group.min(max_rows(dim))
    };
    let units: Vec<(usize, usize, usize)> = (0..queries)
        .flat_map(|i| {
            (0..group)
                .step_by(per_unit)
                .map(move |h| (i, h, per_unit.min(group - h)))
        })
        .collect();
    let threads = threads.clamp(1, units.len());
    // This thread's buffers from its last call: a call per layer and step would otherwise
    // allocate, fault in and zero them anew (a third of a one-query call's time).
    let mut buffers = BUFFERS.take();
    let Buffers {
        keys_t,
        values_f32,
        seen,
        open,
        scratch,
    } = &mut buffers;
    // One mask for every head (or none): the kv heads of a batch row see the same keys.
    let per_head = mask.is_some_and(|m| m.shape[1] != 1);
    for b in 0..batch {
        if !per_head {
            seen_keys(mask, b, 0..1, queries, length, seen, open);
        }
        for g in 0..kv_heads {
            if per_head {
                let heads = g * group..(g + 1) * group;
                seen_keys(mask, b, heads, queries, length, seen, open);
            }
            // Keys of one kv head transposed to (dim, seen keys rounded up to 16) in f32: a
            // query's scores are then 16 keys per FMA, each key's dot product one lane summed
            // in dim order, the same wherever the key sits (no horizontal sums, whose order
            // would depend on it).
            let padded = seen.len().next_multiple_of(16);
            if keys_t.len() < dim * padded {
                keys_t.resize(dim * padded, 0.0);
            }
            let keys_t = &mut keys_t[..dim * padded];
            transpose_keys(key, b, g, seen, padded, keys_t, isa);
            // Values of the seen keys in f32, (seen, dim): converted once, read by every
            // query row.
            if values_f32.len() < seen.len() * dim {
                values_f32.resize(seen.len() * dim, 0.0);
            }
            let values_f32 = &mut values_f32[..seen.len() * dim];
            for (row, &j) in values_f32.chunks_exact_mut(dim).zip(seen.iter()) {
                for (o, &x) in row.iter_mut().zip(value.row(b, g, j as usize)) {
                    *o = bf16_to_f32(x);
                }
            }
            let head = Head {
                query,
                mask,
                keys_t,
                values: values_f32,
                seen,
                padded,
                length,
                scale,
                b,
                g,
                group,
                queries,
                isa,
            };
            let mut write = |(i, h0, rows): (usize, usize, usize), acc: &[f32]| {
                for r in 0..rows {
                    let at = ((b * queries + i) * heads + g * group + h0 + r) * dim;
                    for (o, &a) in out[at..at + dim].iter_mut().zip(&acc[r * dim..]) {
                        *o = O::from_f32(a);
                    }
                }
            };
            if threads == 1 {
                for &unit in &units {
                    head.unit(unit, scratch);
                    write(unit, &scratch.acc);
                }
            } else {
                let results: Vec<Vec<f32>> = pool(threads).install(|| {
                    units
                        .par_iter()
                        .map(|&unit| {
                            let mut worker = BUFFERS.take();
                            head.unit(unit, &mut worker.scratch);
                            let acc = worker.scratch.acc.clone();
                            BUFFERS.set(worker);
                            acc
                        })
                        .collect()
                });
                for (&unit, acc) in units.iter().zip(&results) {
                    write(unit, acc);
                }
            }
        }
    }
    buffers.shrink_if_huge();
    BUFFERS.set(buffers);
    Ok(())
}

thread_local! {
    /// Each thread's [`Buffers`], kept between calls ([`Cell::take`] leaves an empty set
    /// behind, so a nested call would only allocate its own).
    static BUFFERS: Cell<Buffers> = Cell::new(Buffers::default());
}

/// What a call converts the keys and values into, and its per-unit scratch.
#[derive(Default)]
struct Buffers {
    /// Seen keys transposed, (dim, padded) in f32 (longer from earlier calls).
    keys_t: Vec<f32>,
    /// Seen values in f32, (seen, dim) (longer from earlier calls).
    values_f32: Vec<f32>,
    seen: Vec<u32>,
    /// Per cached position: whether some query sees it ([`seen_keys`]).
    open: Vec<bool>,
    scratch: Scratch,
}

impl Buffers {
    /// Buffers kept past this many f32 (64 MiB, a context of 256k keys at dim 64) are given
    /// back, so one huge call does not pin its memory for the thread's life.
    const KEEP_AT_MOST: usize = 16 << 20;

    fn shrink_if_huge(&mut self) {
        if self.keys_t.capacity() + self.values_f32.capacity() > Self::KEEP_AT_MOST {
            *self = Buffers::default();
        }
    }
}

/// Query rows per unit for a head dimension: their accumulators must fit in registers.
fn max_rows(dim: usize) -> usize {
    (16 / dim.div_ceil(16)).clamp(1, MAX_ROWS)
}

/// Query rows computed together at most.
const MAX_ROWS: usize = 4;

/// The keys (ascending) that some query of batch `b` sees through some head of `heads` (one
/// kv group), into `seen`: every key without a mask, else those the mask leaves open.
fn seen_keys(
    mask: Option<&View4<'_>>,
    b: usize,
    heads: std::ops::Range<usize>,
    queries: usize,
    length: usize,
    seen: &mut Vec<u32>,
    open: &mut Vec<bool>,
) {
    seen.clear();
    let Some(m) = mask else {
        seen.extend(0..length as u32);
        return;
    };
    let mb = if m.shape[0] == 1 { 0 } else { b };
    let heads = if m.shape[1] == 1 { 0..1 } else { heads };
    open.clear();
    open.resize(length, false);
    for h in heads {
        for i in 0..queries {
            for (o, &bits) in open.iter_mut().zip(&m.row(mb, h, i)[..length]) {
                // `!(x <= t)` also blocks NaN, as [`Head::unit`] does.
                *o |= bf16_to_f32(bits) > BLOCKED_AT_OR_BELOW;
            }
        }
    }
    seen.extend((0..length as u32).filter(|&j| open[j as usize]));
}

/// `keys_t[c * padded + t] = key[b, g, seen[t], c]` in f32, 0 for `t` past the seen keys.
fn transpose_keys(
    key: &View4<'_>,
    b: usize,
    g: usize,
    seen: &[u32],
    padded: usize,
    keys_t: &mut [f32],
    isa: Isa,
) {
    let dim = key.shape[3];
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && dim.is_multiple_of(2) {
        // SAFETY: Isa::Avx512 is only chosen where AVX-512F/BW/VL run; rows are in bounds
        // (View4::new).
        unsafe { avx512::transpose_keys(key, b, g, seen, padded, keys_t) };
        return;
    }
    let _ = isa;
    for (t, &j) in seen.iter().enumerate() {
        for (c, &bits) in key.row(b, g, j as usize).iter().enumerate() {
            keys_t[c * padded + t] = bf16_to_f32(bits);
        }
    }
    for c in 0..dim {
        keys_t[c * padded + seen.len()..(c + 1) * padded].fill(0.0);
    }
}

/// One (batch, kv head) of a call: its query rows share `keys_t` and `values`.
struct Head<'a, 'v> {
    query: &'a View4<'v>,
    mask: Option<&'a View4<'v>>,
    keys_t: &'a [f32],
    values: &'a [f32],
    /// The keys in `keys_t` and `values`, in order (their cache positions).
    seen: &'a [u32],
    padded: usize,
    length: usize,
    scale: f32,
    b: usize,
    g: usize,
    group: usize,
    queries: usize,
    isa: Isa,
}

impl Head<'_, '_> {
    /// Query `i` of heads `g * group + h0 ..` (`rows` of them, seeing the same keys) into
    /// `s.acc`, row after row.
    fn unit(&self, (i, h0, rows): (usize, usize, usize), s: &mut Scratch) {
        let h = self.g * self.group + h0;
        let length = self.length;
        s.visible.clear();
        s.adds.clear();
        match self.mask {
            Some(m) => {
                let row = m.row(
                    if m.shape[0] == 1 { 0 } else { self.b },
                    if m.shape[1] == 1 { 0 } else { h },
                    i,
                );
                // Visible keys by their place among the seen ones (where keys_t holds them).
                for (t, &j) in self.seen.iter().enumerate() {
                    let add = bf16_to_f32(row[j as usize]);
                    // `!(x <= t)` also blocks NaN.
                    if add > BLOCKED_AT_OR_BELOW {
                        s.visible.push(t as u32);
                        s.adds.push(add);
                    }
                }
            }
            None => {
                // Every key is seen (seen_keys): places are positions.
                let last = (length + i + 1).saturating_sub(self.queries).min(length);
                s.visible.extend(0..last as u32);
                s.adds.resize(last, 0.0);
            }
        }
        s.q.clear();
        for r in 0..rows {
            s.q.extend(
                self.query
                    .row(self.b, h + r, i)
                    .iter()
                    .map(|&x| bf16_to_f32(x)),
            );
        }
        let dim = s.q.len() / rows;
        s.dots.clear();
        s.dots.resize(rows * self.padded, 0.0);
        s.acc.clear();
        s.acc.resize(rows * dim, 0.0);
        s.scores.clear();
        for _ in 0..rows {
            s.scores.extend_from_slice(&s.adds);
        }
        // SAFETY (both): an Isa is only chosen where the CPU runs it (Isa::best, or a test's
        // runnable_isas).
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx512 && dim.div_ceil(16) * rows <= 16 {
            unsafe { avx512::unit(self.keys_t, self.padded, self.values, self.scale, rows, s) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx2 {
            unsafe {
                scalar::unit_avx2(self.keys_t, self.padded, self.values, self.scale, rows, s)
            };
            return;
        }
        scalar::unit(self.keys_t, self.padded, self.values, self.scale, rows, s);
    }
}

/// Per-thread buffers of one unit of query rows.
#[derive(Default)]
struct Scratch {
    /// The rows' queries in f32, (rows, dim).
    q: Vec<f32>,
    /// Their dot products with every key, (rows, length rounded up to 16).
    dots: Vec<f32>,
    /// The keys they see, in order, and the mask's addition to each.
    visible: Vec<u32>,
    adds: Vec<f32>,
    /// (rows, visible): mask additions, then scores, then exponentials.
    scores: Vec<f32>,
    /// The output rows in f32, (rows, dim).
    acc: Vec<f32>,
}

fn shape_error(what: &'static str, shape: [usize; 4], expected: &'static str) -> KernelError {
    KernelError::Shape {
        what,
        shape: shape.to_vec(),
        expected,
    }
}

/// The portable path (CPUs without AVX-512, head dimensions over 256): the same definition
/// in scalar operations, row after row. The dot products are the SIMD path's bit for bit;
/// the softmax rounds differently (a sequential sum, libm's exp), but it too treats each
/// query on its own, so it shares the property that matters. On CPUs with AVX2 and FMA
/// (without AVX-512) it runs compiled for them ([`scalar::unit_avx2`]).
mod scalar {
    use super::*;

    /// [`unit`] compiled for AVX2 and FMA: the same operations in the same order (`mul_add`
    /// is one fused FMA either way, and nothing is reassociated), so the same bits, with the
    /// loops over keys and over the head dimension vectorised.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn unit_avx2(
        keys_t: &[f32],
        padded: usize,
        values: &[f32],
        scale: f32,
        rows: usize,
        s: &mut Scratch,
    ) {
        unit(keys_t, padded, values, scale, rows, s)
    }

    #[inline(always)]
    pub fn unit(
        keys_t: &[f32],
        padded: usize,
        values: &[f32],
        scale: f32,
        rows: usize,
        s: &mut Scratch,
    ) {
        let dim = s.q.len() / rows;
        let n = s.visible.len();
        for r in 0..rows {
            let q = &s.q[r * dim..(r + 1) * dim];
            let dots = &mut s.dots[r * padded..(r + 1) * padded];
            for (c, &qc) in q.iter().enumerate() {
                for (dot, &k) in dots.iter_mut().zip(&keys_t[c * padded..(c + 1) * padded]) {
                    *dot = qc.mul_add(k, *dot);
                }
            }
            let scores = &mut s.scores[r * n..(r + 1) * n];
            for (score, &j) in scores.iter_mut().zip(&s.visible) {
                *score = dots[j as usize].mul_add(scale, *score);
            }
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for score in scores.iter_mut() {
                *score = (*score - max).exp();
                sum += *score;
            }
            let acc = &mut s.acc[r * dim..(r + 1) * dim];
            for (&p, &j) in scores.iter().zip(&s.visible) {
                let row = &values[j as usize * dim..(j as usize + 1) * dim];
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a = p.mul_add(v, *a);
                }
            }
            let sum = if n == 0 { f32::NAN } else { sum };
            for a in acc.iter_mut() {
                *a /= sum;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use crate::expf::{LN2_HI, LN2_LO, POLY};
    use crate::simd::lanes;
    use std::arch::x86_64::*;

    /// `scalar::unit` with AVX-512, for `rows * ceil(dim / 16) <= 16` (accumulators in
    /// registers; the caller checks).
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn unit(
        keys_t: &[f32],
        padded: usize,
        values: &[f32],
        scale: f32,
        rows: usize,
        s: &mut Scratch,
    ) {
        match rows {
            1 => unit_rows::<1>(keys_t, padded, values, scale, s),
            2 => unit_rows::<2>(keys_t, padded, values, scale, s),
            3 => unit_rows::<3>(keys_t, padded, values, scale, s),
            4 => unit_rows::<4>(keys_t, padded, values, scale, s),
            n => unreachable!("at most MAX_ROWS rows per unit, got {n}"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn unit_rows<const R: usize>(
        keys_t: &[f32],
        padded: usize,
        values: &[f32],
        scale: f32,
        s: &mut Scratch,
    ) {
        let dim = s.q.len() / R;
        let chunks = dim.div_ceil(16);
        let tail = tail_mask(dim);
        // Dot products, 4 x 16 keys per pass over the queries (one lane per key, dim in order).
        let (kt, q, dots) = (keys_t.as_ptr(), s.q.as_ptr(), s.dots.as_mut_ptr());
        let full = padded / 64 * 64;
        for block in (0..full).step_by(64) {
            dot_block::<R, 4>(q, dim, kt, padded, block, dots);
        }
        for block in (full..padded).step_by(16) {
            dot_block::<R, 1>(q, dim, kt, padded, block, dots);
        }
        // Per row: scores, then max, exponentials and their sum, 16 at a time in key order.
        let n = s.visible.len();
        let mut sums = [0f32; R];
        for (r, sum) in sums.iter_mut().enumerate() {
            let row_dots = &s.dots[r * padded..];
            let scores = &mut s.scores[r * n..(r + 1) * n];
            for (score, &j) in scores.iter_mut().zip(&s.visible) {
                *score = row_dots[j as usize].mul_add(scale, *score);
            }
            let mut maxv = _mm512_set1_ps(f32::NEG_INFINITY);
            for start in (0..n).step_by(16) {
                let m = lanes(n - start);
                let v = _mm512_mask_loadu_ps(maxv, m, scores.as_ptr().add(start));
                maxv = _mm512_max_ps(maxv, v);
            }
            let max = _mm512_set1_ps(_mm512_reduce_max_ps(maxv));
            let mut sumv = _mm512_setzero_ps();
            for start in (0..n).step_by(16) {
                let m = lanes(n - start);
                let p = scores.as_mut_ptr().add(start);
                let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p), max));
                _mm512_mask_storeu_ps(p, m, e);
                sumv = _mm512_add_ps(sumv, _mm512_maskz_mov_ps(m, e));
            }
            *sum = if n == 0 {
                f32::NAN
            } else {
                _mm512_reduce_add_ps(sumv)
            };
        }
        // Weighted values, in key order (accumulators in registers: one kernel per width).
        macro_rules! weighted {
            ($($ch:literal)*) => {
                match chunks {
                    $($ch => weighted::<R, $ch>(s, values, dim, tail, &sums),)*
                    _ => unreachable!("rows x chunks <= 16"),
                }
            };
        }
        weighted!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
    }

    /// Scores of keys `block..block + 16 * W` (before scaling) for R query rows into `dots`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn dot_block<const R: usize, const W: usize>(
        q: *const f32,
        dim: usize,
        kt: *const f32,
        padded: usize,
        block: usize,
        dots: *mut f32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); W]; R];
        for c in 0..dim {
            let row = kt.add(c * padded + block);
            let mut k = [_mm512_setzero_ps(); W];
            for (w, kw) in k.iter_mut().enumerate() {
                *kw = _mm512_loadu_ps(row.add(w * 16));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let qv = _mm512_set1_ps(*q.add(r * dim + c));
                for (a, &kw) in acc_r.iter_mut().zip(&k) {
                    *a = _mm512_fmadd_ps(qv, kw, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (w, a) in acc_r.iter().enumerate() {
                _mm512_storeu_ps(dots.add(r * padded + block + w * 16), *a);
            }
        }
    }

    /// `acc[r] = sum_t p[r, t] values[visible_t] / sums[r]`, head dimension CH x 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weighted<const R: usize, const CH: usize>(
        s: &mut Scratch,
        values: &[f32],
        dim: usize,
        tail: __mmask16,
        sums: &[f32; R],
    ) {
        let n = s.visible.len();
        let mut acc = [[_mm512_setzero_ps(); CH]; R];
        for (t, &j) in s.visible.iter().enumerate() {
            let v = values.as_ptr().add(j as usize * dim);
            let mut vc = [_mm512_setzero_ps(); CH];
            for (c, x) in vc.iter_mut().enumerate() {
                let m = if c + 1 == CH { tail } else { 0xFFFF };
                *x = _mm512_maskz_loadu_ps(m, v.add(c * 16));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*s.scores.get_unchecked(r * n + t));
                for (a, &x) in acc_r.iter_mut().zip(&vc) {
                    *a = _mm512_fmadd_ps(p, x, *a);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let div = _mm512_set1_ps(sums[r]);
            for (c, a) in acc_r.iter().enumerate() {
                let m = if c + 1 == CH { tail } else { 0xFFFF };
                _mm512_mask_storeu_ps(
                    s.acc.as_mut_ptr().add(r * dim + c * 16),
                    m,
                    _mm512_div_ps(*a, div),
                );
            }
        }
    }

    fn tail_mask(dim: usize) -> __mmask16 {
        lanes(dim - (dim.div_ceil(16) - 1) * 16)
    }

    /// `super::transpose_keys` for an even head dimension: for 16 keys at a time, one
    /// gather per pair of dimensions (32 bits: dimension c low, c + 1 high).
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VL; `keys_t` holds `dim * padded` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn transpose_keys(
        key: &View4<'_>,
        b: usize,
        g: usize,
        seen: &[u32],
        padded: usize,
        keys_t: &mut [f32],
    ) {
        let dim = key.shape[3];
        let base = key.row(b, g, 0).as_ptr();
        let stride = _mm512_set1_epi32(key.strides[2] as i32);
        let high_half = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        for block in (0..padded).step_by(16) {
            let m = lanes(seen.len().saturating_sub(block));
            let positions = _mm512_maskz_loadu_epi32(m, seen.as_ptr().add(block).cast());
            let rows = _mm512_mullo_epi32(positions, stride);
            for c in (0..dim).step_by(2) {
                let idx = _mm512_add_epi32(rows, _mm512_set1_epi32(c as i32));
                // Element offsets (u16) scaled by 2 bytes; masked-off lanes read nothing.
                let pair =
                    _mm512_mask_i32gather_epi32::<2>(_mm512_setzero_si512(), m, idx, base.cast());
                let lo = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(pair));
                let hi = _mm512_castsi512_ps(_mm512_and_si512(pair, high_half));
                _mm512_storeu_ps(keys_t.as_mut_ptr().add(c * padded + block), lo);
                _mm512_storeu_ps(keys_t.as_mut_ptr().add((c + 1) * padded + block), hi);
            }
        }
    }

    /// e^x for x <= 0 (scores minus their max): Cephes' expf (range reduction by ln 2, a
    /// degree-5 polynomial; about 1 ulp), 0 below -87 (where e^x leaves f32's normal range).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn exp(x: __m512) -> __m512 {
        let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.0));
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(POLY[0]);
        for &c in &POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let r2 = _mm512_mul_ps(r, r);
        let e = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
        _mm512_maskz_mov_ps(!underflow, _mm512_scalef_ps(e, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A contiguous (a, b, c, d) tensor of bf16 bits.
    struct Tensor {
        data: Vec<u16>,
        shape: [usize; 4],
    }

    impl Tensor {
        fn new(shape: [usize; 4], values: impl Iterator<Item = f32>) -> Self {
            let data: Vec<u16> = values
                .take(shape.iter().product())
                .map(f32_to_bf16)
                .collect();
            assert_eq!(data.len(), shape.iter().product::<usize>());
            Self { data, shape }
        }
        fn view(&self) -> View4<'_> {
            let [_, b, c, d] = self.shape;
            View4::new("t", &self.data, self.shape, [b * c * d, c * d, d, 1]).unwrap()
        }
        fn at(&self, i: [usize; 4]) -> f64 {
            let [_, b, c, d] = self.shape;
            bf16_to_f32(self.data[((i[0] * b + i[1]) * c + i[2]) * d + i[3]]) as f64
        }
    }

    fn noise(seed: u32) -> impl Iterator<Item = f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).max(1);
        std::iter::repeat_with(move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32 - 0.5) * 4.0
        })
    }

    fn run(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, threads: usize) -> Vec<u16> {
        run_into(q, k, v, mask, threads, Isa::best())
    }

    fn run_into<O: Output + Default>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        threads: usize,
        isa: Isa,
    ) -> Vec<O> {
        let [b, h, n, d] = q.shape;
        let mut out = vec![O::default(); b * n * h * d];
        let mask = mask.map(Tensor::view);
        let (q, k, v) = (q.view(), k.view(), v.view());
        attention_into(&q, &k, &v, mask.as_ref(), 0.125, &mut out, threads, isa).unwrap();
        out
    }

    #[test]
    fn matches_f64_softmax_attention() {
        let (b, h, kvh, n, l, d) = (2, 6, 2, 5, 40, 24);
        let q = Tensor::new([b, h, n, d], noise(1));
        let k = Tensor::new([b, kvh, l, d], noise(2));
        let v = Tensor::new([b, kvh, l, d], noise(3));
        // Per head: a random pattern of blocked keys, additive values elsewhere.
        let mask = Tensor::new(
            [b, h, n, l + 3],
            noise(4).map(|x| if x > 1.0 { f32::MIN } else { x / 4.0 }),
        );
        let got = run(&q, &k, &v, Some(&mask), 2);
        for (bi, hi, i) in itertools(b, h, n) {
            let g = hi / (h / kvh);
            let scores: Vec<Option<f64>> = (0..l)
                .map(|j| {
                    let m = mask.at([bi, hi, i, j]);
                    (m > -1e30).then(|| {
                        (0..d)
                            .map(|c| q.at([bi, hi, i, c]) * k.at([bi, g, j, c]))
                            .sum::<f64>()
                            * 0.125
                            + m
                    })
                })
                .collect();
            let max = scores
                .iter()
                .flatten()
                .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let sum: f64 = scores.iter().flatten().map(|s| (s - max).exp()).sum();
            for c in 0..d {
                let want: f64 = scores
                    .iter()
                    .enumerate()
                    .filter_map(|(j, s)| s.map(|s| (s - max).exp() / sum * v.at([bi, g, j, c])))
                    .sum();
                let got = bf16_to_f32(got[((bi * n + i) * h + hi) * d + c]) as f64;
                assert!(
                    (got - want).abs() <= want.abs() * 2f64.powi(-8) + 1e-5,
                    "b{bi} h{hi} q{i} c{c}: {got} vs {want}"
                );
            }
        }
    }

    /// Every instruction set this CPU runs, the best first.
    fn runnable_isas() -> Vec<Isa> {
        let mut isas: Vec<Isa> = crate::Backend::runnable()
            .into_iter()
            .map(Isa::of)
            .collect();
        isas.dedup();
        isas
    }

    /// The AVX2 build of the portable path promises the portable path's bits exactly (the
    /// same operations, vectorised), masked and batched, any number of threads.
    #[test]
    #[cfg_attr(
        not(dart_cpu_avx2),
        ignore = "needs AVX2 and FMA, which this CPU lacks"
    )]
    fn the_avx2_path_gives_the_portable_paths_bits() {
        assert!(
            crate::Backend::avx2_available(),
            "built for AVX2 and FMA but they do not run here"
        );
        for (seed, dim) in [(11u32, 64usize), (12, 24), (13, 7), (14, 80)] {
            let (b, h, kvh, n, l) = (2, 6, 2, 9, 70);
            let q = Tensor::new([b, h, n, dim], noise(seed));
            let k = Tensor::new([b, kvh, l, dim], noise(seed ^ 1));
            let v = Tensor::new([b, kvh, l, dim], noise(seed ^ 2));
            let mask = Tensor::new(
                [b, h, n, l],
                noise(seed ^ 3).map(|x| if x > 1.2 { f32::MIN } else { x / 3.0 }),
            );
            for mask in [None, Some(&mask)] {
                let scalar: Vec<f32> = run_into(&q, &k, &v, mask, 1, Isa::Scalar);
                let avx2: Vec<f32> = run_into(&q, &k, &v, mask, 2, Isa::Avx2);
                assert!(
                    scalar
                        .iter()
                        .zip(&avx2)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "dim {dim}, mask {}",
                    mask.is_some()
                );
            }
        }
    }

    fn itertools(b: usize, h: usize, n: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        (0..b).flat_map(move |bi| (0..h).flat_map(move |hi| (0..n).map(move |i| (bi, hi, i))))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(60))]

        /// The property the decoding depends on: every query of a tree (a context every query
        /// sees, then tree nodes each seeing some of the nodes before it and itself) gets the
        /// bits it gets alone over exactly the keys it sees, in order, without a mask.
        #[test]
        fn a_tree_query_equals_the_query_alone_over_its_visible_keys(
            context in 1usize..50,
            nodes in 1usize..20,
            dim in prop::sample::select(vec![7usize, 8, 16, 24, 64, 80]),
            seed in any::<u32>(),
            edges in proptest::collection::vec(any::<bool>(), 400),
            threads in 1usize..3,
            isa in prop::sample::select(runnable_isas()),
        ) {
            let (heads, kv_heads) = (4, 2);
            let length = context + nodes;
            let q = Tensor::new([1, heads, nodes, dim], noise(seed));
            let k = Tensor::new([1, kv_heads, length, dim], noise(seed ^ 1));
            let v = Tensor::new([1, kv_heads, length, dim], noise(seed ^ 2));
            let sees = |i: usize, j: usize| j < context || j == context + i
                || (j < context + i && edges[(i * 20 + j - context) % 400]);
            let mask = Tensor::new(
                [1, 1, nodes, length],
                (0..nodes).flat_map(|i| (0..length).map(move |j| (i, j)))
                    .map(|(i, j)| if sees(i, j) { 0.0 } else { f32::MIN }),
            );
            // In f32: bf16 rounding would hide most differences in the order of operations.
            let tree: Vec<f32> = run_into(&q, &k, &v, Some(&mask), threads, isa);
            for i in 0..nodes {
                let visible: Vec<usize> = (0..length).filter(|&j| sees(i, j)).collect();
                let pick = |t: &Tensor| Tensor::new(
                    [1, kv_heads, visible.len(), dim],
                    (0..kv_heads).flat_map(|g| visible.iter().flat_map(move |&j| (0..dim).map(move |c| (g, j, c))))
                        .map(|(g, j, c)| t.at([0, g, j, c]) as f32),
                );
                let one_q = Tensor::new(
                    [1, heads, 1, dim],
                    (0..heads).flat_map(|h| (0..dim).map(move |c| (h, c))).map(|(h, c)| q.at([0, h, i, c]) as f32),
                );
                let alone: Vec<f32> = run_into(&one_q, &pick(&k), &pick(&v), None, 1, isa);
                let got = &tree[i * heads * dim..(i + 1) * heads * dim];
                prop_assert!(got.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// The same with a mask per head (each head its own tree, as a batch of trees or
        /// head-specific masks give): every (head, query) gets its bits alone.
        #[test]
        fn a_per_head_tree_query_equals_the_query_alone(
            context in 0usize..40,
            nodes in 1usize..14,
            dim in prop::sample::select(vec![8usize, 24, 64]),
            seed in any::<u32>(),
            edges in proptest::collection::vec(any::<bool>(), 500),
        ) {
            let (heads, kv_heads) = (6, 2);
            let length = context + nodes;
            let q = Tensor::new([1, heads, nodes, dim], noise(seed));
            let k = Tensor::new([1, kv_heads, length, dim], noise(seed ^ 1));
            let v = Tensor::new([1, kv_heads, length, dim], noise(seed ^ 2));
            let sees = |h: usize, i: usize, j: usize| j == context + i
                || (j < context + i && edges[(h * 83 + i * 20 + j) % 500]);
            let mask = Tensor::new(
                [1, heads, nodes, length],
                (0..heads)
                    .flat_map(|h| (0..nodes).flat_map(move |i| (0..length).map(move |j| (h, i, j))))
                    .map(|(h, i, j)| if sees(h, i, j) { 0.0 } else { f32::MIN }),
            );
            let tree: Vec<f32> = run_into(&q, &k, &v, Some(&mask), 1, Isa::best());
            for (h, i) in (0..heads).flat_map(|h| (0..nodes).map(move |i| (h, i))) {
                let g = h / (heads / kv_heads);
                let visible: Vec<usize> = (0..length).filter(|&j| sees(h, i, j)).collect();
                let pick = |t: &Tensor| Tensor::new(
                    [1, 1, visible.len(), dim],
                    visible.iter().flat_map(|&j| (0..dim).map(move |c| (j, c)))
                        .map(|(j, c)| t.at([0, g, j, c]) as f32),
                );
                let one_q = Tensor::new([1, 1, 1, dim], (0..dim).map(|c| q.at([0, h, i, c]) as f32));
                let alone: Vec<f32> = run_into(&one_q, &pick(&k), &pick(&v), None, 1, Isa::best());
                let at = (i * heads + h) * dim;
                prop_assert!(tree[at..at + dim].iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// A batched verification: row b holds `lengths[b]` cached keys, stale keys up to the
        /// longest row (masked), then its tree. Each query gets the bits it gets alone over its
        /// own visible keys, although the call reads only the keys some query of the row sees.
        #[test]
        fn a_batched_row_query_equals_the_query_alone(
            lengths in proptest::collection::vec(0usize..40, 1..4),
            nodes in 1usize..8,
            seed in any::<u32>(),
            edges in proptest::collection::vec(any::<bool>(), 64),
        ) {
            let (heads, kv_heads, dim) = (4, 2, 32);
            let batch = lengths.len();
            let frontier = *lengths.iter().max().unwrap();
            let length = frontier + nodes;
            let q = Tensor::new([batch, heads, nodes, dim], noise(seed));
            let k = Tensor::new([batch, kv_heads, length, dim], noise(seed ^ 1));
            let v = Tensor::new([batch, kv_heads, length, dim], noise(seed ^ 2));
            let sees = |b: usize, i: usize, j: usize| {
                j < lengths[b]
                    || j == frontier + i
                    || (j >= frontier && j < frontier + i && edges[(i * 8 + j - frontier) % 64])
            };
            let mask = Tensor::new(
                [batch, 1, nodes, length],
                (0..batch)
                    .flat_map(|b| (0..nodes).flat_map(move |i| (0..length).map(move |j| (b, i, j))))
                    .map(|(b, i, j)| if sees(b, i, j) { 0.0 } else { f32::MIN }),
            );
            let got: Vec<f32> = run_into(&q, &k, &v, Some(&mask), 1, Isa::best());
            for (b, i) in (0..batch).flat_map(|b| (0..nodes).map(move |i| (b, i))) {
                let visible: Vec<usize> = (0..length).filter(|&j| sees(b, i, j)).collect();
                let pick = |t: &Tensor| Tensor::new(
                    [1, kv_heads, visible.len(), dim],
                    (0..kv_heads).flat_map(|g| visible.iter().flat_map(move |&j| (0..dim).map(move |c| (g, j, c))))
                        .map(|(g, j, c)| t.at([b, g, j, c]) as f32),
                );
                let one_q = Tensor::new(
                    [1, heads, 1, dim],
                    (0..heads).flat_map(|h| (0..dim).map(move |c| (h, c))).map(|(h, c)| q.at([b, h, i, c]) as f32),
                );
                let alone: Vec<f32> = run_into(&one_q, &pick(&k), &pick(&v), None, 1, Isa::best());
                let at = (b * nodes + i) * heads * dim;
                prop_assert!(got[at..at + heads * dim].iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }

    #[test]
    fn no_mask_is_causal_from_the_end() {
        let (n, l, d) = (4, 9, 16);
        let q = Tensor::new([1, 2, n, d], noise(7));
        let k = Tensor::new([1, 1, l, d], noise(8));
        let v = Tensor::new([1, 1, l, d], noise(9));
        let causal = Tensor::new(
            [1, 1, n, l],
            (0..n).flat_map(|i| {
                (0..l).map(move |j| {
                    if j <= l - n + i {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            }),
        );
        assert_eq!(run(&q, &k, &v, None, 1), run(&q, &k, &v, Some(&causal), 1));
    }

    #[test]
    fn a_query_that_sees_nothing_gets_nan() {
        let q = Tensor::new([1, 1, 1, 16], noise(1));
        let k = Tensor::new([1, 1, 3, 16], noise(2));
        let mask = Tensor::new([1, 1, 1, 3], std::iter::repeat(f32::MIN));
        let out = run(&q, &k, &k, Some(&mask), 1);
        assert!(out.iter().all(|&x| bf16_to_f32(x).is_nan()));
    }

    #[test]
    fn shapes_and_layouts_that_do_not_fit_are_errors() {
        let q = Tensor::new([1, 3, 2, 8], noise(1));
        let k = Tensor::new([1, 2, 5, 8], noise(2));
        let mut out = vec![0u16; 48];
        let err = attention(&q.view(), &k.view(), &k.view(), None, 1.0, &mut out, 1).unwrap_err();
        assert!(err.to_string().contains("kv_heads dividing"), "{err}");
        let k1 = Tensor::new([1, 1, 5, 8], noise(2));
        let short = Tensor::new([1, 1, 2, 4], noise(3));
        let err = attention(
            &q.view(),
            &k1.view(),
            &k1.view(),
            Some(&short.view()),
            1.0,
            &mut out,
            1,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("mask has shape [1, 1, 2, 4]"),
            "{err}"
        );
        assert!(matches!(
            View4::new("key", &k.data, [1, 2, 5, 8], [80, 40, 8, 2]),
            Err(KernelError::Layout { what: "key", .. })
        ));
        assert!(matches!(
            View4::new("key", &k.data[..79], [1, 2, 5, 8], [80, 40, 8, 1]),
            Err(KernelError::Length {
                what: "key",
                expected: 80,
                got: 79
            })
        ));
        let err = attention(
            &q.view(),
            &k1.view(),
            &k1.view(),
            None,
            1.0,
            &mut out[..47],
            1,
        )
        .unwrap_err();
        assert_eq!(
            err,
            KernelError::Length {
                what: "out",
                expected: 48,
                got: 47
            }
        );
    }
}
