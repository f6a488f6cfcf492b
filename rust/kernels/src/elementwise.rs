//! The element-wise parts of a decoder layer in bf16: RMS norm, rotary embedding, SiLU-gated
//! product. Each is one pass over its rows instead of the 5-14 tensor operations (each
//! allocating, each dispatched from Python) that transformers spends on it, which on a
//! decoding step's few rows cost more than the arithmetic.
//!
//! Every row is computed on its own, in the same order whatever the number of rows, so these
//! keep the property the decoding kernels have: a tree node's values are one-token decoding's
//! bit for bit. [`rotary`] and [`silu_mul`] round where PyTorch's bf16 operations round (after
//! each operation), so they give transformers' bits; [`rms_norm`] sums the squares in its
//! own order (PyTorch's vectorised reduction order depends on the CPU), so its mean may differ
//! from PyTorch's in the last f32 bit.

use crate::bf16::bf16_to_f32;
use crate::error::{check_len, KernelError, Result};
use crate::expf::{LN2_HI, LN2_LO, POLY};

/// `weight * bf16(x * rsqrt(mean(x²) + eps))` per row of `dim` values (LlamaRMSNorm and
/// the norms written like it: Qwen2/3, Mistral), `x` and `out` `(rows, dim)`, `weight` `(dim,)`.
pub fn rms_norm(x: &[u16], weight: &[u16], eps: f32, out: &mut [u16]) -> Result<()> {
    check_rows("x", x.len(), weight.len())?;
    check_len("out", out.len(), x.len())?;
    vectorised!(rms_norm_rows(x, weight, eps, out));
    Ok(())
}

/// Rotary embedding as transformers' `apply_rotary_pos_emb` computes it in bf16:
/// `x * cos + rotate_half(x) * sin`, each product and the sum rounded to bf16.
/// `x` and `out` are `(tokens, heads, dim)`, `cos` and `sin` `(tokens, dim)`.
pub fn rotary(x: &[u16], cos: &[u16], sin: &[u16], dim: usize, out: &mut [u16]) -> Result<()> {
    check_len("sin", sin.len(), cos.len())?;
    check_len("out", out.len(), x.len())?;
    if dim == 0 || !dim.is_multiple_of(2) || !cos.len().is_multiple_of(dim) {
        return Err(KernelError::Shape {
            what: "cos",
            shape: vec![cos.len()],
            expected: "(tokens, dim) with an even dim",
        });
    }
    let tokens = cos.len() / dim;
    if tokens == 0 || !x.len().is_multiple_of(tokens * dim) {
        return Err(KernelError::Shape {
            what: "x",
            shape: vec![x.len()],
            expected: "(tokens, heads, dim) with cos's tokens and dim",
        });
    }
    vectorised!(rotary_rows(x, cos, sin, dim, out));
    Ok(())
}

/// `bf16(silu(gate)) * up`, rounded to bf16, as `act_fn(gate) * up` computes it in bf16:
/// `silu(g) = g / (1 + e^-g)` in f32 ([`exp`]: about 1 ulp, so a product may differ from
/// PyTorch's in the last bit where its f32 value sits on a bf16 rounding boundary).
pub fn silu_mul(gate: &[u16], up: &[u16], out: &mut [u16]) -> Result<()> {
    check_len("up", up.len(), gate.len())?;
    check_len("out", out.len(), gate.len())?;
    vectorised!(silu_mul_all(gate, up, out));
    Ok(())
}

/// Runs a kernel body compiled for the instruction set the matmul runs on
/// ([`crate::Backend::best`]: AVX-512 on AMX, AVX512-BF16 and AVX-512 CPUs, AVX2, or the
/// baseline; the same operations in the same order and no FMA contraction in each, so the
/// same bits).
macro_rules! vectorised {
    ($kernel:ident($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        match crate::Backend::best() {
            crate::Backend::Amx | crate::Backend::Avx512Bf16 | crate::Backend::Avx512 => {
                // SAFETY: Backend::best picks these only where AVX-512F/BW/VL run.
                unsafe { avx512::$kernel($($arg),*) };
                return Ok(());
            }
            crate::Backend::Avx2 => {
                // SAFETY: Backend::best picks this only where AVX2 and FMA run.
                unsafe { avx2::$kernel($($arg),*) };
                return Ok(());
            }
            _ => {}
        }
        // SAFETY: the baseline build asks nothing of the CPU (`unsafe` only as its twin is).
        unsafe { portable::$kernel($($arg),*) }
    }};
}
use vectorised;

/// The kernels' bodies, written so that the compiler vectorises them (no branches per
/// element, slices zipped); compiled for the baseline, AVX2 and AVX-512 (the latter two may only
/// run where the CPU has them: hence `unsafe`).
macro_rules! kernels {
    ($($attr:meta)?) => {
        use super::*;

        $(#[$attr])?
        pub unsafe fn rms_norm_rows(x: &[u16], weight: &[u16], eps: f32, out: &mut [u16]) {
            let dim = weight.len();
            for (row, out) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
                // Eight partial sums, then a fixed tree: one order on every CPU.
                let mut partial = [0f32; 8];
                let mut chunks = row.chunks_exact(8);
                for chunk in &mut chunks {
                    for (p, &v) in partial.iter_mut().zip(chunk) {
                        let v = bf16_to_f32(v);
                        *p += v * v;
                    }
                }
                for (p, &v) in partial.iter_mut().zip(chunks.remainder()) {
                    let v = bf16_to_f32(v);
                    *p += v * v;
                }
                let sum = ((partial[0] + partial[4]) + (partial[2] + partial[6]))
                    + ((partial[1] + partial[5]) + (partial[3] + partial[7]));
                let scale = 1.0 / (sum / dim as f32 + eps).sqrt();
                for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
                    let normed = round(bf16_to_f32(v) * scale);
                    *o = to_bf16(bf16_to_f32(w) * normed);
                }
            }
        }

        $(#[$attr])?
        pub unsafe fn rotary_rows(x: &[u16], cos: &[u16], sin: &[u16], dim: usize, out: &mut [u16]) {
            let half = dim / 2;
            let heads = x.len() / cos.len();
            for (t, (x, out)) in x
                .chunks_exact(heads * dim)
                .zip(out.chunks_exact_mut(heads * dim))
                .enumerate()
            {
                let (cos, sin) = (&cos[t * dim..(t + 1) * dim], &sin[t * dim..(t + 1) * dim]);
                let (cos_lo, cos_hi) = cos.split_at(half);
                let (sin_lo, sin_hi) = sin.split_at(half);
                for (x, out) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
                    let (lo, hi) = x.split_at(half);
                    let (out_lo, out_hi) = out.split_at_mut(half);
                    // rotate_half(x) = (-x[half..], x[..half]).
                    for (((o, &l), &h), (&c, &s)) in
                        out_lo.iter_mut().zip(lo).zip(hi).zip(cos_lo.iter().zip(sin_lo))
                    {
                        let (l, h) = (bf16_to_f32(l), bf16_to_f32(h));
                        *o = to_bf16(round(l * bf16_to_f32(c)) + round(-h * bf16_to_f32(s)));
                    }
                    for (((o, &l), &h), (&c, &s)) in
                        out_hi.iter_mut().zip(lo).zip(hi).zip(cos_hi.iter().zip(sin_hi))
                    {
                        let (l, h) = (bf16_to_f32(l), bf16_to_f32(h));
                        *o = to_bf16(round(h * bf16_to_f32(c)) + round(l * bf16_to_f32(s)));
                    }
                }
            }
        }

        $(#[$attr])?
        pub unsafe fn silu_mul_all(gate: &[u16], up: &[u16], out: &mut [u16]) {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                let g = bf16_to_f32(g);
                let silu = round(g / (1.0 + exp(-g)));
                *o = to_bf16(silu * bf16_to_f32(u));
            }
        }
    };
}

mod portable {
    kernels!();
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    kernels!(target_feature(enable = "avx2,fma"));
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    kernels!(target_feature(enable = "avx512f,avx512bw,avx512vl"));
}

/// `value` rounded to the nearest bf16 (ties to even; NaN to 0x7FC0): [`crate::f32_to_bf16`]
/// without a branch, so loops over it vectorise.
#[inline(always)]
fn to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    if value.is_nan() {
        0x7FC0
    } else {
        rounded
    }
}

/// `value` rounded to bf16 and back: what a bf16 tensor holds after an operation.
#[inline(always)]
fn round(value: f32) -> f32 {
    bf16_to_f32(to_bf16(value))
}

/// e^x in f32 without branches (Cephes' expf: range reduction by ln 2, a degree-5
/// polynomial; about 1 ulp up to 88), infinite past f32's range (as libm's and PyTorch's:
/// silu(-100) is then -0, not a tiny number), and e^-87.3 (the smallest normal result) for
/// every x below -87.3.
#[inline(always)]
#[allow(clippy::manual_clamp)] // clamp's NaN handling keeps the compiler from vectorising
fn exp(x: f32) -> f32 {
    // Above 88, e^(x - ln 2) * 2: 2^n then stays within f32's exponents and the last
    // doubling overflows exactly where e^x does. max/min, not clamp: no NaN check per lane.
    let big = x > 88.0;
    let x = x.max(-87.3).min(89.0);
    let x = if big { x - std::f32::consts::LN_2 } else { x };
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = POLY[0];
    for c in &POLY[1..] {
        p = p * r + c;
    }
    let e = p * (r * r) + r + 1.0;
    // 2^n by its exponent bits (n in [-126, 127] after the clamp). n + 1.5 * 2^23 holds n in
    // its low mantissa bits: an integer without a float-to-int cast (which would not
    // vectorise: Rust's `as` saturates per lane).
    let n_bits = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000 - 127);
    let e = e * f32::from_bits(n_bits << 23);
    if big {
        e * 2.0
    } else {
        e
    }
}

fn check_rows(what: &'static str, len: usize, dim: usize) -> Result<()> {
    if dim > 0 && len.is_multiple_of(dim) {
        Ok(())
    } else {
        Err(KernelError::Shape {
            what,
            shape: vec![len],
            expected: "(rows, dim) with dim the weight's length",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::f32_to_bf16;
    use proptest::prelude::*;

    fn bf16s(values: &[f32]) -> Vec<u16> {
        values.iter().map(|&v| f32_to_bf16(v)).collect()
    }

    fn floats(len: usize) -> impl Strategy<Value = Vec<f32>> {
        proptest::collection::vec(-8f32..8.0, len)
    }

    proptest! {
        /// Rows are independent: a row's bits alone equal its bits among others.
        #[test]
        fn rms_norm_rows_are_independent(values in floats(5 * 24), weight in floats(24)) {
            let (x, w) = (bf16s(&values), bf16s(&weight));
            let mut all = vec![0u16; x.len()];
            rms_norm(&x, &w, 1e-5, &mut all).unwrap();
            for (row, want) in x.chunks(24).zip(all.chunks(24)) {
                let mut alone = vec![0u16; 24];
                rms_norm(row, &w, 1e-5, &mut alone).unwrap();
                prop_assert_eq!(&alone[..], want);
            }
        }

        /// Within a bf16 step of the definition computed in f64.
        #[test]
        fn rms_norm_is_the_definition(values in floats(3 * 20), weight in floats(20)) {
            let (x, w) = (bf16s(&values), bf16s(&weight));
            let mut out = vec![0u16; x.len()];
            rms_norm(&x, &w, 1e-6, &mut out).unwrap();
            for (row, got) in x.chunks(20).zip(out.chunks(20)) {
                let row: Vec<f64> = row.iter().map(|&v| bf16_to_f32(v) as f64).collect();
                let rms = (row.iter().map(|v| v * v).sum::<f64>() / 20.0 + 1e-6).sqrt();
                for ((&v, &g), &w) in row.iter().zip(got).zip(&w) {
                    let want = bf16_to_f32(w) as f64 * v / rms;
                    let got = bf16_to_f32(g) as f64;
                    prop_assert!((got - want).abs() <= want.abs() * 2f64.powi(-6) + 1e-6, "{} vs {}", got, want);
                }
            }
        }

        /// Rotary: per element, the rounded products and sum; tokens and heads independent.
        #[test]
        fn rotary_rounds_like_bf16_operations(
            values in floats(3 * 2 * 8), angles in floats(3 * 8),
        ) {
            let x = bf16s(&values);
            let cos = bf16s(&angles.iter().map(|a| a.cos()).collect::<Vec<_>>());
            let sin = bf16s(&angles.iter().map(|a| a.sin()).collect::<Vec<_>>());
            let mut out = vec![0u16; x.len()];
            rotary(&x, &cos, &sin, 8, &mut out).unwrap();
            let r = |v: f32| bf16_to_f32(f32_to_bf16(v));
            for t in 0..3 {
                for h in 0..2 {
                    let at = (t * 2 + h) * 8;
                    for c in 0..8 {
                        let xc = bf16_to_f32(x[at + c]);
                        let rot = if c < 4 { -bf16_to_f32(x[at + c + 4]) } else { bf16_to_f32(x[at + c - 4]) };
                        let want = f32_to_bf16(
                            r(xc * bf16_to_f32(cos[t * 8 + c])) + r(rot * bf16_to_f32(sin[t * 8 + c])),
                        );
                        prop_assert_eq!(out[at + c], want);
                    }
                }
            }
        }

        #[test]
        fn silu_mul_is_the_rounded_definition(gate in floats(40), up in floats(40)) {
            let (g, u) = (bf16s(&gate), bf16s(&up));
            let mut out = vec![0u16; 40];
            silu_mul(&g, &u, &mut out).unwrap();
            for i in 0..40 {
                let gi = bf16_to_f32(g[i]) as f64;
                let want = gi / (1.0 + (-gi).exp()) * bf16_to_f32(u[i]) as f64;
                let got = bf16_to_f32(out[i]) as f64;
                prop_assert!((got - want).abs() <= want.abs() * 2f64.powi(-7) + 1e-30, "{} vs {}", got, want);
            }
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        for i in 0..=200_000 {
            let x = -87.0 + 174.99 * i as f32 / 200_000.0;
            let (got, want) = (exp(x), x.exp());
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 2, "e^{x}: {got} vs {want} ({ulps} ulp)");
        }
        // Near the top, within 2^-16 (x - ln 2 rounds x): far below a bf16 step.
        for i in 0..=10_000 {
            let x = 88.0 + 0.72 * i as f32 / 10_000.0;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            assert!(
                (got / want - 1.0).abs() < 2f64.powi(-16),
                "e^{x}: {got} vs {want}"
            );
        }
        assert!(exp(88.73) == f32::INFINITY && exp(1000.0) == f32::INFINITY);
        assert!(exp(-1000.0) == exp(-87.3) && exp(-87.3) > 0.0);
    }

    /// The AVX2 and AVX-512 builds compute what the baseline build computes, bit for bit.
    #[test]
    #[cfg_attr(
        not(dart_cpu_avx2),
        ignore = "needs AVX2 and FMA, which this CPU lacks"
    )]
    fn the_simd_builds_give_the_baseline_bits() {
        assert!(crate::Backend::avx2_available());
        let avx512 = crate::Backend::avx512_available();
        let mut state = 7u32;
        let mut noise = |n: usize, spread: f32| -> Vec<u16> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    f32_to_bf16((state as f32 / u32::MAX as f32 - 0.5) * spread)
                })
                .collect()
        };
        let (dim, heads, tokens) = (64, 3, 7);
        let (x, weight) = (noise(tokens * heads * dim, 16.0), noise(dim, 4.0));
        let (cos, sin) = (noise(tokens * dim, 2.0), noise(tokens * dim, 2.0));
        let (gate, up) = (noise(999, 40.0), noise(999, 8.0));
        let mut want = vec![0u16; x.len()];
        let mut got = vec![0u16; x.len()];
        // SAFETY: AVX2 and FMA run here (asserted above), AVX-512 where `avx512` says so.
        unsafe {
            portable::rms_norm_rows(&x, &weight, 1e-5, &mut want);
            avx2::rms_norm_rows(&x, &weight, 1e-5, &mut got);
            assert_eq!(got, want, "rms_norm, AVX2");
            if avx512 {
                avx512::rms_norm_rows(&x, &weight, 1e-5, &mut got);
                assert_eq!(got, want, "rms_norm, AVX-512");
            }
            portable::rotary_rows(&x, &cos, &sin, dim, &mut want);
            avx2::rotary_rows(&x, &cos, &sin, dim, &mut got);
            assert_eq!(got, want, "rotary, AVX2");
            if avx512 {
                avx512::rotary_rows(&x, &cos, &sin, dim, &mut got);
                assert_eq!(got, want, "rotary, AVX-512");
            }
            let (mut want, mut got) = (vec![0u16; 999], vec![0u16; 999]);
            portable::silu_mul_all(&gate, &up, &mut want);
            avx2::silu_mul_all(&gate, &up, &mut got);
            assert_eq!(got, want, "silu_mul, AVX2");
            if avx512 {
                avx512::silu_mul_all(&gate, &up, &mut got);
                assert_eq!(got, want, "silu_mul, AVX-512");
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let mut out = vec![0u16; 6];
        assert!(rms_norm(&[0; 6], &[0; 4], 1e-5, &mut out).is_err());
        assert!(rms_norm(&[0; 8], &[0; 4], 1e-5, &mut out).is_err());
        assert!(rotary(&[0; 6], &[0; 3], &[0; 3], 3, &mut out).is_err());
        assert!(rotary(&[0; 6], &[0; 4], &[0; 4], 2, &mut out).is_err());
        assert!(rotary(&[0; 6], &[0; 6], &[0; 5], 2, &mut out).is_err());
        assert!(rotary(&[0; 6], &[0; 2], &[0; 2], 2, &mut out).is_ok());
        assert!(silu_mul(&[0; 6], &[0; 5], &mut out).is_err());
    }
}
