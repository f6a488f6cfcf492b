//! A whole Llama decoder layer on a few rows, in one call.
//!
//! The layer's kernels ([`crate::rms_norm`], [`PackedMatrix`], [`crate::rotary`],
//! [`crate::attention()`], [`crate::silu_mul`]) each cost a few microseconds of work on a
//! decoding step's rows, but driving them from Python costs more: a tensor allocated, viewed
//! and checked per operation, about fifteen operations per layer, with the interpreter's own
//! code evicted by the weights every layer streams. [`DecoderLayer::forward`] runs the same
//! operations in the same order on the same kernels, so its output has the bits of the
//! operations called one by one (`x + attention(...)` and `x + mlp(...)` rounded to bf16 as
//! PyTorch's bf16 addition rounds).

use crate::attention::{attention, View4};
use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::elementwise::{rms_norm, rotary, silu_mul};
use crate::error::{check_len, KernelError, Result};
use crate::matmul::PackedMatrix;

/// A layer's key or value cache, `(batch, kv_heads, capacity, dim)` bf16 bits, any
/// non-negative strides (in elements) with a contiguous last dimension.
pub struct CacheMut<'a> {
    data: &'a mut [u16],
    shape: [usize; 4],
    strides: [usize; 4],
}

impl<'a> CacheMut<'a> {
    /// Checks that every element lies inside `data` and that rows are contiguous.
    pub fn new(
        what: &'static str,
        data: &'a mut [u16],
        shape: [usize; 4],
        strides: [usize; 4],
    ) -> Result<Self> {
        View4::new(what, data, shape, strides)?;
        Ok(Self {
            data,
            shape,
            strides,
        })
    }

    fn row_mut(&mut self, b: usize, g: usize, t: usize) -> &mut [u16] {
        let start = b * self.strides[0] + g * self.strides[1] + t * self.strides[2];
        &mut self.data[start..start + self.shape[3]]
    }

    /// Its first `length` positions, as attention reads them.
    fn view(&self, what: &'static str, length: usize) -> Result<View4<'_>> {
        let [b, kv, _, d] = self.shape;
        View4::new(what, self.data, [b, kv, length, d], self.strides)
    }
}

/// A Llama decoder layer's weights: two RMS norms, q/k/v stacked in one matrix (rows q, then
/// k, then v, as the separate projections' outputs concatenated), o, gate/up stacked
/// (gate's rows first) and down; no biases.
pub struct DecoderLayer<'a> {
    pub input_norm: &'a [u16],
    pub post_attention_norm: &'a [u16],
    pub eps: f32,
    pub qkv: &'a PackedMatrix,
    pub o: &'a PackedMatrix,
    pub gate_up: &'a PackedMatrix,
    pub down: &'a PackedMatrix,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The attention's score scale (`head_dim ** -0.5` for Llama).
    pub scale: f32,
}

impl DecoderLayer<'_> {
    /// The layer on `hidden` `(batch, tokens, hidden)`: its keys and values are written to
    /// cache positions `start..start + tokens` of every batch row, its queries attend to the
    /// cache's first `start + tokens` positions through `mask` (`(1 | batch, 1 | heads,
    /// tokens, >= start + tokens)`, additive, bf16 bits) or causally without one. `cos` and
    /// `sin` are the rotary tables `(batch, tokens, head_dim)`. Writes the layer's output
    /// `(batch, tokens, hidden)` to `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        hidden: &[u16],
        batch: usize,
        tokens: usize,
        cos: &[u16],
        sin: &[u16],
        keys: &mut CacheMut<'_>,
        values: &mut CacheMut<'_>,
        start: usize,
        mask: Option<&View4<'_>>,
        out: &mut [u16],
        threads: usize,
    ) -> Result<()> {
        let width = self.input_norm.len();
        check_len("hidden", hidden.len(), batch * tokens * width)?;
        if self.qkv.in_features() != width {
            return Err(self.shape_error("qkv"));
        }
        let mut normed = vec![0u16; batch * tokens * width];
        rms_norm(hidden, self.input_norm, self.eps, &mut normed)?;
        self.forward_normed(
            &normed, hidden, batch, tokens, cos, sin, keys, values, start, mask, out, threads,
        )
    }

    /// [`Self::forward`] after the input norm, which the caller applied: `normed` `(batch,
    /// tokens, q/k/v inputs)` is what q, k and v multiply, `residual` `(batch, tokens,
    /// hidden)` what the attention's output is added to (for a decoder layer, its input;
    /// a DART draft head's layer attends over a wider input, its two halves normed apart,
    /// and adds to one of them). `input_norm` is not read.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_normed(
        &self,
        normed: &[u16],
        residual: &[u16],
        batch: usize,
        tokens: usize,
        cos: &[u16],
        sin: &[u16],
        keys: &mut CacheMut<'_>,
        values: &mut CacheMut<'_>,
        start: usize,
        mask: Option<&View4<'_>>,
        out: &mut [u16],
        threads: usize,
    ) -> Result<()> {
        let width = self.o.out_features();
        let (heads, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let rows = batch * tokens;
        self.check(width)?;
        check_len("normed", normed.len(), rows * self.qkv.in_features())?;
        check_len("residual", residual.len(), rows * width)?;
        check_len("out", out.len(), rows * width)?;
        check_len("cos", cos.len(), rows * d)?;
        check_len("sin", sin.len(), rows * d)?;
        let cache_shape = [batch, kv, start + tokens, d];
        for cache in [&*keys, &*values] {
            let [b, g, capacity, dim] = cache.shape;
            if b != batch || g != kv || dim != d || capacity < start + tokens {
                return Err(KernelError::Shape {
                    what: "cache",
                    shape: cache.shape.to_vec(),
                    expected: "(batch, kv_heads, >= start + tokens, head_dim)",
                });
            }
        }

        // Attention block: q/k/v, rotary, cache, attention, o, residual.
        let qkv_width = self.qkv.out_features();
        let mut qkv = vec![0u16; rows * qkv_width];
        self.qkv.matmul(normed, rows, None, &mut qkv, threads)?;
        let mut queries = vec![0u16; rows * heads * d];
        let mut rotated_keys = vec![0u16; kv * d];
        for t in 0..rows {
            let row = &qkv[t * qkv_width..(t + 1) * qkv_width];
            let (cos, sin) = (&cos[t * d..(t + 1) * d], &sin[t * d..(t + 1) * d]);
            let (q, rest) = row.split_at(heads * d);
            let (k, v) = rest.split_at(kv * d);
            rotary(
                q,
                cos,
                sin,
                d,
                &mut queries[t * heads * d..(t + 1) * heads * d],
            )?;
            rotary(k, cos, sin, d, &mut rotated_keys)?;
            let (b, i) = (t / tokens, t % tokens);
            for g in 0..kv {
                let at = g * d..(g + 1) * d;
                keys.row_mut(b, g, start + i)
                    .copy_from_slice(&rotated_keys[at.clone()]);
                values.row_mut(b, g, start + i).copy_from_slice(&v[at]);
            }
        }
        let query = View4::new(
            "query",
            &queries,
            [batch, heads, tokens, d],
            [tokens * heads * d, d, heads * d, 1],
        )?;
        let (key, value) = (
            keys.view("keys", start + tokens)?,
            values.view("values", start + tokens)?,
        );
        debug_assert_eq!(key.shape(), cache_shape);
        let mut attended = vec![0u16; rows * heads * d];
        attention(
            &query,
            &key,
            &value,
            mask,
            self.scale,
            &mut attended,
            threads,
        )?;
        let mut projected = vec![0u16; rows * width];
        self.o
            .matmul(&attended, rows, None, &mut projected, threads)?;
        let mut attended_sum = vec![0u16; rows * width];
        add(residual, &projected, &mut attended_sum);

        // MLP block: norm, gate/up, SiLU product, down, residual.
        let mut normed = vec![0u16; rows * width];
        rms_norm(
            &attended_sum,
            self.post_attention_norm,
            self.eps,
            &mut normed,
        )?;
        let inner = self.down.in_features();
        let mut gate_up = vec![0u16; rows * 2 * inner];
        self.gate_up
            .matmul(&normed, rows, None, &mut gate_up, threads)?;
        let mut product = vec![0u16; rows * inner];
        for (row, act) in gate_up
            .chunks_exact(2 * inner)
            .zip(product.chunks_exact_mut(inner))
        {
            let (gate, up) = row.split_at(inner);
            silu_mul(gate, up, act)?;
        }
        self.down
            .matmul(&product, rows, None, &mut projected, threads)?;
        add(&attended_sum, &projected, out);
        Ok(())
    }

    fn shape_error(&self, what: &'static str) -> KernelError {
        KernelError::Shape {
            what,
            shape: vec![
                self.heads,
                self.kv_heads,
                self.head_dim,
                self.o.out_features(),
                self.down.in_features(),
            ],
            expected: "a Llama layer: (heads + 2 kv_heads) x head_dim q/k/v outputs, \
                       heads x head_dim o inputs, 2 x intermediate gate/up outputs, \
                       kv_heads dividing heads (shape: heads, kv_heads, head_dim, hidden, \
                       intermediate)",
        }
    }

    /// The weights' shapes against each other and the hidden width (q/k/v's inputs may be
    /// wider: [`Self::forward_normed`]).
    fn check(&self, width: usize) -> Result<()> {
        let (heads, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let inner = self.down.in_features();
        let fits = [
            (
                "post_attention_norm",
                self.post_attention_norm.len() == width,
            ),
            ("heads", kv > 0 && d > 0 && heads % kv == 0),
            ("qkv", self.qkv.out_features() == (heads + 2 * kv) * d),
            ("o", self.o.in_features() == heads * d),
            (
                "gate_up",
                self.gate_up.in_features() == width && self.gate_up.out_features() == 2 * inner,
            ),
            ("down", self.down.out_features() == width),
        ];
        match fits.iter().find(|(_, ok)| !ok) {
            Some(&(what, _)) => Err(self.shape_error(what)),
            None => Ok(()),
        }
    }
}

/// `out = bf16(a + b)`: PyTorch's bf16 addition (in f32, rounded to nearest even once).
fn add(a: &[u16], b: &[u16], out: &mut [u16]) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f32_to_bf16(bf16_to_f32(x) + bf16_to_f32(y));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bf16 values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<u16> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                f32_to_bf16((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect()
    }

    /// The layer's operations one kernel call at a time, as the Python layer calls them.
    #[allow(clippy::too_many_arguments)]
    fn step_by_step(
        layer: &DecoderLayer<'_>,
        hidden: &[u16],
        batch: usize,
        tokens: usize,
        cos: &[u16],
        sin: &[u16],
        cache: (&mut [u16], &mut [u16]),
        capacity: usize,
        start: usize,
    ) -> Vec<u16> {
        let mut normed = vec![0; hidden.len()];
        rms_norm(hidden, layer.input_norm, layer.eps, &mut normed).unwrap();
        step_by_step_normed(
            layer, &normed, hidden, batch, tokens, cos, sin, cache, capacity, start,
        )
    }

    /// [`step_by_step`] after the input norm (`normed`, added to `residual`).
    #[allow(clippy::too_many_arguments)]
    fn step_by_step_normed(
        layer: &DecoderLayer<'_>,
        normed: &[u16],
        hidden: &[u16],
        batch: usize,
        tokens: usize,
        cos: &[u16],
        sin: &[u16],
        cache: (&mut [u16], &mut [u16]),
        capacity: usize,
        start: usize,
    ) -> Vec<u16> {
        let (h, kv, d) = (layer.heads, layer.kv_heads, layer.head_dim);
        let width = layer.o.out_features();
        let rows = batch * tokens;
        let mut normed_mlp = vec![0; rows * width];
        let mut q = vec![0; rows * h * d];
        let mut k = vec![0; rows * kv * d];
        let mut v = vec![0; rows * kv * d];
        let qkv = layer.qkv.out_features();
        let mut all = vec![0; rows * qkv];
        layer.qkv.matmul(normed, rows, None, &mut all, 1).unwrap();
        for t in 0..rows {
            let row = &all[t * qkv..(t + 1) * qkv];
            q[t * h * d..(t + 1) * h * d].copy_from_slice(&row[..h * d]);
            k[t * kv * d..(t + 1) * kv * d].copy_from_slice(&row[h * d..(h + kv) * d]);
            v[t * kv * d..(t + 1) * kv * d].copy_from_slice(&row[(h + kv) * d..]);
        }
        let (mut qr, mut kr) = (vec![0; q.len()], vec![0; k.len()]);
        rotary(&q, cos, sin, d, &mut qr).unwrap();
        rotary(&k, cos, sin, d, &mut kr).unwrap();
        let (keys, values) = cache;
        let at = |b: usize, g: usize, p: usize| ((b * kv + g) * capacity + p) * d;
        for b in 0..batch {
            for i in 0..tokens {
                for g in 0..kv {
                    let src = ((b * tokens + i) * kv + g) * d;
                    let dst = at(b, g, start + i);
                    keys[dst..dst + d].copy_from_slice(&kr[src..src + d]);
                    values[dst..dst + d].copy_from_slice(&v[src..src + d]);
                }
            }
        }
        let strides = [kv * capacity * d, capacity * d, d, 1];
        let shape = [batch, kv, start + tokens, d];
        let key = View4::new("k", keys, shape, strides).unwrap();
        let value = View4::new("v", values, shape, strides).unwrap();
        let query = View4::new(
            "q",
            &qr,
            [batch, h, tokens, d],
            [tokens * h * d, d, h * d, 1],
        )
        .unwrap();
        let mut attended = vec![0; rows * h * d];
        attention(&query, &key, &value, None, layer.scale, &mut attended, 1).unwrap();
        let mut o = vec![0; rows * width];
        layer.o.matmul(&attended, rows, None, &mut o, 1).unwrap();
        let mut residual = vec![0; rows * width];
        add(hidden, &o, &mut residual);
        rms_norm(
            &residual,
            layer.post_attention_norm,
            layer.eps,
            &mut normed_mlp,
        )
        .unwrap();
        let inner = layer.down.in_features();
        let mut gu = vec![0; rows * 2 * inner];
        layer
            .gate_up
            .matmul(&normed_mlp, rows, None, &mut gu, 1)
            .unwrap();
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for row in gu.chunks_exact(2 * inner) {
            gate.extend_from_slice(&row[..inner]);
            up.extend_from_slice(&row[inner..]);
        }
        let mut product = vec![0; rows * inner];
        silu_mul(&gate, &up, &mut product).unwrap();
        layer.down.matmul(&product, rows, None, &mut o, 1).unwrap();
        let mut out = vec![0; rows * width];
        add(&residual, &o, &mut out);
        out
    }

    /// A layer's weights, deterministic from `seed`: q/k/v take `in_width` inputs.
    struct Weights {
        norms: [Vec<u16>; 2],
        matrices: [PackedMatrix; 4],
        shape: (usize, usize, usize),
    }

    impl Weights {
        fn new(
            (width, in_width, heads, kv, d, inner): (usize, usize, usize, usize, usize, usize),
            seed: u64,
        ) -> Self {
            let pack = |n: usize, k: usize, s: u64| {
                PackedMatrix::pack(&values(n * k, seed + s), n, k).unwrap()
            };
            Self {
                norms: [values(width, seed + 5), values(width, seed + 6)],
                matrices: [
                    pack((heads + 2 * kv) * d, in_width, 1),
                    pack(width, heads * d, 2),
                    pack(2 * inner, width, 3),
                    pack(width, inner, 4),
                ],
                shape: (heads, kv, d),
            }
        }

        fn layer(&self) -> DecoderLayer<'_> {
            let [qkv, o, gate_up, down] = &self.matrices;
            let (heads, kv_heads, head_dim) = self.shape;
            DecoderLayer {
                input_norm: &self.norms[0],
                post_attention_norm: &self.norms[1],
                eps: 1e-5,
                qkv,
                o,
                gate_up,
                down,
                heads,
                kv_heads,
                head_dim,
                scale: 0.25,
            }
        }
    }

    #[test]
    fn the_layer_is_its_kernels_called_one_by_one() {
        let (width, kv, d) = (64, 2, 16);
        let weights = Weights::new((width, width, 4, kv, d, 96), 0);
        let layer = weights.layer();
        let (batch, tokens, start, capacity) = (2, 3, 5, 12);
        let hidden = values(batch * tokens * width, 7);
        let (cos, sin) = (values(batch * tokens * d, 8), values(batch * tokens * d, 9));
        let cached = values(batch * kv * capacity * d, 10);
        let (mut k1, mut v1) = (cached.clone(), cached.clone());
        let want = step_by_step(
            &layer,
            &hidden,
            batch,
            tokens,
            &cos,
            &sin,
            (&mut k1, &mut v1),
            capacity,
            start,
        );
        let (mut k2, mut v2) = (cached.clone(), cached);
        let strides = [kv * capacity * d, capacity * d, d, 1];
        let shape = [batch, kv, capacity, d];
        let mut keys = CacheMut::new("keys", &mut k2, shape, strides).unwrap();
        let mut vals = CacheMut::new("values", &mut v2, shape, strides).unwrap();
        let mut got = vec![0; hidden.len()];
        layer
            .forward(
                &hidden, batch, tokens, &cos, &sin, &mut keys, &mut vals, start, None, &mut got, 1,
            )
            .unwrap();
        assert_eq!(got, want);
        assert_eq!((k2, v2), (k1, v1));
        // A cache too short for the tokens is refused before anything is written.
        let mut short = vec![0; batch * kv * (start + 1) * d];
        let short_shape = [batch, kv, start + 1, d];
        let short_strides = [kv * (start + 1) * d, (start + 1) * d, d, 1];
        let mut keys = CacheMut::new("keys", &mut short, short_shape, short_strides).unwrap();
        let mut other = vec![0; batch * kv * (start + 1) * d];
        let mut vals = CacheMut::new("values", &mut other, short_shape, short_strides).unwrap();
        let err = layer
            .forward(
                &hidden, batch, tokens, &cos, &sin, &mut keys, &mut vals, start, None, &mut got, 1,
            )
            .unwrap_err();
        assert!(err.to_string().contains("cache"), "{err}");
    }

    /// A draft head's layer: q/k/v read a wider input the caller normed, the attention's
    /// output is added to another (narrower) one.
    #[test]
    fn a_layer_after_its_input_norm_takes_a_wider_input() {
        let (width, kv, d) = (32, 1, 16);
        let weights = Weights::new((width, 2 * width, 2, kv, d, 48), 30);
        let layer = weights.layer();
        let (batch, tokens, start, capacity) = (2, 4, 3, 9);
        let normed = values(batch * tokens * 2 * width, 16);
        let residual = values(batch * tokens * width, 17);
        let (cos, sin) = (
            values(batch * tokens * d, 18),
            values(batch * tokens * d, 19),
        );
        let cached = values(batch * kv * capacity * d, 20);
        let (mut k1, mut v1) = (cached.clone(), cached.clone());
        let want = step_by_step_normed(
            &layer,
            &normed,
            &residual,
            batch,
            tokens,
            &cos,
            &sin,
            (&mut k1, &mut v1),
            capacity,
            start,
        );
        let (mut k2, mut v2) = (cached.clone(), cached);
        let strides = [kv * capacity * d, capacity * d, d, 1];
        let shape = [batch, kv, capacity, d];
        let mut got = vec![0; residual.len()];
        {
            let mut keys = CacheMut::new("keys", &mut k2, shape, strides).unwrap();
            let mut vals = CacheMut::new("values", &mut v2, shape, strides).unwrap();
            layer
                .forward_normed(
                    &normed, &residual, batch, tokens, &cos, &sin, &mut keys, &mut vals, start,
                    None, &mut got, 1,
                )
                .unwrap();
        }
        assert_eq!(got, want);
        assert_eq!((&k2, &v2), (&k1, &v1));
        // The plain forward takes only inputs as wide as its norm.
        let mut keys = CacheMut::new("keys", &mut k2, shape, strides).unwrap();
        let mut vals = CacheMut::new("values", &mut v2, shape, strides).unwrap();
        let err = layer
            .forward(
                &residual, batch, tokens, &cos, &sin, &mut keys, &mut vals, start, None, &mut got,
                1,
            )
            .unwrap_err();
        assert!(
            matches!(err, KernelError::Shape { what: "qkv", .. }),
            "{err}"
        );
    }
}
