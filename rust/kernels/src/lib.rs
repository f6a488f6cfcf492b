//! CPU decoding kernels for DART's target model.
//!
//! Verifying a draft tree multiplies every weight matrix of the target by a few dozen rows
//! at most. On the CPU, general matmul libraries are tuned for many rows: oneDNN's bf16
//! kernel costs about 1.6x one row for 8 rows on SmolLM2, which caps what a tree can gain.
//! [`PackedMatrix`] is a matmul for exactly this shape: bf16 weights in a panel layout that
//! streams once per call (software-prefetched), up to 12 rows multiplied per weight load with
//! fp32 FMAs (faster than `vdpbf16ps` on the CPUs we measured), and every row computed in the
//! same order whatever the number of rows, so a row's result does not depend on which other
//! rows share the call (a tree's logits equal one-token decoding's, bit for bit). On CPUs
//! with AMX-BF16 the same layout feeds tile multiplications instead: up to 32 rows stream the
//! weights once (16 rows cost 1.1x one row on SmolLM2, 32 rows 1.4x), each row's bits again
//! independent of the others.
//!
//! [`attention()`] computes a tree's few queries over the cache with the same property: each
//! query from its own visible keys, in key order, so with both kernels a tree's logits are
//! one-token decoding's, bit for bit (greedy DART then equals greedy decoding exactly).
//!
//! [`rms_norm`], [`rotary`] and [`silu_mul`] are a decoder layer's element-wise parts, one
//! pass over the rows each (per-row too, so they keep that property).
//!
//! [`DecoderLayer`] runs a whole Llama decoder layer on them in one call, with the bits of
//! calling them one by one.
//!
//! No Python here; the bindings live in `rust/python`.

mod attention;
mod bf16;
mod elementwise;
mod error;
mod expf;
mod layer;
mod matmul;
#[cfg(target_arch = "x86_64")]
mod simd;

pub use attention::{attention, View4, BLOCKED_AT_OR_BELOW};
pub use bf16::{bf16_to_f32, f32_to_bf16};
pub use elementwise::{rms_norm, rotary, silu_mul};
pub use error::{KernelError, Result};
pub use layer::{CacheMut, DecoderLayer};
pub use matmul::{
    Backend, PackedMatrix, AMX_ROWS_PER_PASS, MAX_ROWS_PER_PASS, PAIRS_PER_BLOCK, PANEL_COLUMNS,
};
