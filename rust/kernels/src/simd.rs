//! AVX-512 helpers shared by the kernels.

use std::arch::x86_64::*;

/// The first `left` of 16 lanes (all 16 when `left >= 16`).
pub fn lanes(left: usize) -> __mmask16 {
    if left >= 16 {
        0xFFFF
    } else {
        (1u16 << left) - 1
    }
}

/// Round to nearest even bf16, NaN to 0x7FC0: `crate::f32_to_bf16` on 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub fn to_bf16(v: __m512) -> __m256i {
    let bits = _mm512_castps_si512(v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let result = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm512_cvtepi32_epi16(result)
}
