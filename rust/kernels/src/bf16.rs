//! bf16 <-> f32, bit-compatible with PyTorch's `c10::BFloat16`.

/// The f32 a bf16 bit pattern stands for (exact: bf16 is f32's upper half).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `value` rounded to the nearest bf16, ties to even; every NaN becomes 0x7FC0 (as PyTorch).
#[inline]
pub fn f32_to_bf16(value: f32) -> u16 {
    if value.is_nan() {
        return 0x7FC0;
    }
    let bits = value.to_bits();
    let rounding = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_values() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        assert_eq!(f32_to_bf16(-2.0), 0xC000);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
        assert_eq!(f32_to_bf16(f32::NAN), 0x7FC0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up to the even one.
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
    }

    proptest! {
        #[test]
        fn round_trip_is_exact(bits in any::<u16>()) {
            let value = bf16_to_f32(bits);
            prop_assume!(!value.is_nan());
            prop_assert_eq!(f32_to_bf16(value), bits);
        }

        #[test]
        fn rounds_to_a_nearest_neighbour(value in -1e30f32..1e30f32) {
            let got = bf16_to_f32(f32_to_bf16(value)) as f64;
            let truncated = bf16_to_f32((value.to_bits() >> 16) as u16) as f64;
            let next = bf16_to_f32(((value.to_bits() >> 16) + 1) as u16) as f64;
            let v = value as f64;
            prop_assert!(got == truncated || got == next);
            let other = if got == truncated { next } else { truncated };
            prop_assert!((got - v).abs() <= (other - v).abs());
        }
    }
}
