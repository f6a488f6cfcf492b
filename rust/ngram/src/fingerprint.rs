//! The tokenizer fingerprint stored in every model header.
//!
//! `SHA-256` over, for each token id `0..n` in order, the token string's UTF-8 byte length as
//! a little-endian `u32` followed by its bytes (an id without a token contributes length 0).
//! The vocabulary is every token the tokenizer knows, added tokens included, and `n` is the
//! highest id plus one. Python computes the same value from `tokenizer.get_vocab()` of a
//! transformers tokenizer, so a model can be checked against the tokenizer in use.

use sha2::{Digest, Sha256};

use crate::error::{NGramError, Result};

/// The fingerprint of models whose tokenizer is unknown (built from pre-tokenized ids).
pub const UNKNOWN: [u8; 32] = [0; 32];

/// Fingerprint of a vocabulary given as token strings by id (`""` for an id with no token).
pub fn fingerprint_from_vocab<'a>(tokens_by_id: impl Iterator<Item = &'a str>) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for token in tokens_by_id {
        // Length-prefixing keeps ["ab", "c"] and ["a", "bc"] apart.
        hasher.update((token.len() as u32).to_le_bytes());
        hasher.update(token.as_bytes());
    }
    hasher.finalize().into()
}

/// Fingerprint of a vocabulary given as `(token, id)` pairs in any order, as a tokenizer's
/// `get_vocab(with_added_tokens = true)` returns it. Ids missing from `0..=max id` count as
/// empty tokens. Two different tokens claiming one id is an error.
pub fn fingerprint_from_pairs<'a>(
    pairs: impl IntoIterator<Item = (&'a str, u32)>,
) -> Result<[u8; 32]> {
    let mut by_id: Vec<Option<&'a str>> = Vec::new();
    for (token, id) in pairs {
        let i = id as usize;
        if i >= by_id.len() {
            by_id.resize(i + 1, None);
        }
        match by_id[i] {
            Some(existing) if existing != token => {
                return Err(NGramError::InvalidArgument(format!(
                    "vocabulary maps both {existing:?} and {token:?} to id {id}; expected one token per id"
                )))
            }
            _ => by_id[i] = Some(token),
        }
    }
    Ok(fingerprint_from_vocab(
        by_id.iter().map(|t| t.unwrap_or("")),
    ))
}

/// Lower-case hexadecimal form (64 characters).
pub fn to_hex(fp: &[u8; 32]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for &b in fp {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Parses the hexadecimal form (64 hex digits, either case).
pub fn from_hex(s: &str) -> Result<[u8; 32]> {
    let bad = || {
        NGramError::InvalidArgument(format!(
            "tokenizer fingerprint {s:?} is not valid; expected 64 hexadecimal digits"
        ))
    };
    let bytes = s.as_bytes();
    if bytes.len() != 64 {
        return Err(bad());
    }
    let nibble = |c: u8| -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    };
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = (nibble(pair[0]).ok_or_else(bad)? << 4) | nibble(pair[1]).ok_or_else(bad)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_value() {
        // SHA-256 of the bytes 01 00 00 00 'a' 00 00 00 00 02 00 00 00 'b' 'c', computed
        // independently with Python's hashlib.
        let fp = fingerprint_from_vocab(["a", "", "bc"].into_iter());
        assert_eq!(
            to_hex(&fp),
            "b9ca7779ae4c72d7e8bc252ec51706f235fe965da2ec6f8fc4742c2cab1eb949"
        );
    }

    #[test]
    fn length_prefix_separates_tokens() {
        let a = fingerprint_from_vocab(["ab", "c"].into_iter());
        let b = fingerprint_from_vocab(["a", "bc"].into_iter());
        assert_ne!(a, b);
    }

    #[test]
    fn pairs_fill_holes_and_reject_conflicts() {
        let fp = fingerprint_from_pairs([("bc", 2), ("a", 0)]).unwrap();
        assert_eq!(fp, fingerprint_from_vocab(["a", "", "bc"].into_iter()));
        assert!(fingerprint_from_pairs([("a", 0), ("a", 0)]).is_ok());
        let err = fingerprint_from_pairs([("a", 0), ("b", 0)]).unwrap_err();
        assert!(err.to_string().contains("id 0"), "{err}");
    }

    #[test]
    fn bad_hex() {
        assert!(from_hex("zz").is_err());
        assert!(from_hex(&"g".repeat(64)).is_err());
        assert!(from_hex(&"A".repeat(64)).is_ok());
    }

    proptest! {
        #[test]
        fn hex_round_trip(bytes in prop::array::uniform32(any::<u8>())) {
            prop_assert_eq!(from_hex(&to_hex(&bytes)).unwrap(), bytes);
        }
    }
}
