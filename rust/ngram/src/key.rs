//! Packing of an n-gram (up to `order` token ids) into one `u64` whose numeric order is the
//! lexicographic order of the tokens: `key = t0 << ((n-1)*bits) | ... | t_{n-1}`.
//!
//! Every sorted stream of `(key, count)` in this crate uses this layout, with `bits` the
//! model's token width ([`token_bits`]), so a sorted key stream is already in the CSR order
//! of the on-disk levels.

use crate::error::{NGramError, Result};

/// Number of bits needed to store any token id below `vocab_size` (at least 1).
pub fn token_bits(vocab_size: u32) -> u32 {
    let max_id = vocab_size.saturating_sub(1);
    (32 - max_id.leading_zeros()).max(1)
}

/// Checks that n-grams of `order` tokens of a `vocab_size` vocabulary fit one `u64` key.
pub fn check_order_fits(order: usize, vocab_size: u32) -> Result<()> {
    let bits = token_bits(vocab_size) as usize;
    if order == 0 || order * bits > 64 {
        return Err(NGramError::InvalidArgument(format!(
            "order {order} with a vocabulary of {vocab_size} tokens needs {} bits per key; \
             at most 64 are supported (order 1..={})",
            order * bits,
            64 / bits
        )));
    }
    Ok(())
}

/// Packs `tokens` (each `< 2^bits`) into a key.
#[inline]
pub fn pack(tokens: &[u32], bits: u32) -> u64 {
    tokens
        .iter()
        .fold(0u64, |key, &t| (key << bits) | u64::from(t))
}

/// Token `i` (0-based, from the left) of a key holding `n` tokens.
#[inline]
pub fn token_at(key: u64, n: usize, i: usize, bits: u32) -> u32 {
    let shift = (n - 1 - i) as u32 * bits;
    ((key >> shift) & ((1u64 << bits) - 1)) as u32
}

/// The key of the first `n - 1` tokens (the context of the last token).
#[inline]
pub fn prefix(key: u64, bits: u32) -> u64 {
    key >> bits
}

/// Unpacks a key holding `n` tokens.
pub fn unpack(key: u64, n: usize, bits: u32) -> Vec<u32> {
    (0..n).map(|i| token_at(key, n, i, bits)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bits_for_vocab() {
        assert_eq!(token_bits(1), 1);
        assert_eq!(token_bits(2), 1);
        assert_eq!(token_bits(3), 2);
        assert_eq!(token_bits(49152), 16);
        assert_eq!(token_bits(151_936), 18);
    }

    #[test]
    fn order_limit() {
        assert!(check_order_fits(3, 151_936).is_ok());
        assert!(check_order_fits(4, 151_936).is_err());
        assert!(check_order_fits(4, 49152).is_ok());
    }

    proptest! {
        #[test]
        fn pack_round_trip_and_order(a in prop::collection::vec(0u32..49152, 3), b in prop::collection::vec(0u32..49152, 3)) {
            let bits = token_bits(49152);
            prop_assert_eq!(unpack(pack(&a, bits), 3, bits), a.clone());
            prop_assert_eq!(pack(&a, bits).cmp(&pack(&b, bits)), a.cmp(&b));
            prop_assert_eq!(prefix(pack(&a, bits), bits), pack(&a[..2], bits));
        }
    }
}
