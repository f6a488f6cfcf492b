//! LEB128 variable-length integers: 7 bits per byte, the lowest first, a set high bit saying
//! another byte follows. The build's sorted count runs and the writer's spools store sorted
//! `(key, count)` pairs this way ([`encode_pair`]: the key's increase, then the count) and
//! the writer its parents' children counts: most n-grams are seen a few times and differ from
//! the previous key in their last token, so a pair takes a few bytes.

use std::io::{self, BufRead, BufReader, Read};

/// Longest encoding of a `u64`.
pub const MAX_LEN: usize = 10;

/// Writes `v` at the start of `out` (which has room for [`MAX_LEN`] bytes or for `v`'s
/// encoding); returns the bytes used.
#[inline(always)]
pub fn encode(mut v: u64, out: &mut [u8]) -> usize {
    let mut n = 0;
    while v >= 0x80 {
        out[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    out[n] = v as u8;
    n + 1
}

/// The integer at the start of `bytes` and its length; `Ok(None)` if `bytes` ends inside it.
#[inline(always)]
pub fn decode(bytes: &[u8]) -> io::Result<Option<(u64, usize)>> {
    // Up to 8 bytes (56 bits) without a branch per byte: the first byte whose high bit is
    // clear ends the integer, and the 7-bit groups are gathered with shifts.
    if let Some(word) = bytes.get(..8) {
        let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        let ends = !w & 0x8080_8080_8080_8080;
        if ends != 0 {
            let len = (ends.trailing_zeros() / 8 + 1) as usize;
            // The integer's bytes without their continuation bits, then the 7-bit groups
            // closed up pairwise: into 14 bits per 16, 28 per 32, 56 per 64.
            let x = w & (u64::MAX >> (64 - 8 * len)) & 0x7f7f_7f7f_7f7f_7f7f;
            let x = ((x & 0x7f00_7f00_7f00_7f00) >> 1) | (x & 0x007f_007f_007f_007f);
            let x = ((x & 0x3fff_0000_3fff_0000) >> 2) | (x & 0x0000_3fff_0000_3fff);
            let x = ((x & 0x0fff_ffff_0000_0000) >> 4) | (x & 0x0000_0000_0fff_ffff);
            return Ok(Some((x, len)));
        }
    }
    let mut v = 0u64;
    for (i, &b) in bytes.iter().take(MAX_LEN).enumerate() {
        // The tenth byte holds the 64th bit alone.
        if i == MAX_LEN - 1 && b > 1 {
            return Err(overlong());
        }
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some((v, i + 1)));
        }
    }
    if bytes.len() >= MAX_LEN {
        return Err(overlong());
    }
    Ok(None)
}

/// Reads one integer from `r`: an `UnexpectedEof` error if the input ends inside it, an
/// `InvalidData` one if it is longer than 64 bits.
#[inline]
pub fn read<R: Read>(r: &mut BufReader<R>) -> io::Result<u64> {
    let buf = r.buffer();
    let buf = if buf.len() >= MAX_LEN { buf } else { fill(r)? };
    if let Some((v, n)) = decode(buf)? {
        r.consume(n);
        return Ok(v);
    }
    // The buffer ends inside the integer: a byte at a time across the refill.
    let mut bytes = [0u8; MAX_LEN];
    for i in 0..MAX_LEN {
        r.read_exact(&mut bytes[i..=i])?;
        if let Some((v, _)) = decode(&bytes[..=i])? {
            return Ok(v);
        }
    }
    Err(overlong())
}

/// Longest encoding of a `(key, count)` pair.
pub const MAX_PAIR_LEN: usize = 2 * MAX_LEN;

/// A `(key, count)` pair of a stream sorted by key, after the pair whose key was `prev` (0
/// before the first): the key's increase, then the count. Sorted n-gram keys mostly differ in
/// their last token, so a pair takes a few bytes instead of 16.
#[inline(always)]
pub fn encode_pair(prev: u64, key: u64, count: u64, out: &mut [u8; MAX_PAIR_LEN]) -> usize {
    debug_assert!(key >= prev, "keys ascend");
    let n = encode(key - prev, out);
    n + encode(count, &mut out[n..])
}

/// Reads the pair [`encode_pair`] wrote after key `prev`: errors as [`read`]'s, and
/// `InvalidData` if the key passes 64 bits.
#[inline(always)]
pub fn read_pair<R: Read>(r: &mut BufReader<R>, prev: u64) -> io::Result<(u64, u64)> {
    // Straight from the buffer when it holds a whole pair, as it does but near its end.
    let buf = r.buffer();
    let (delta, count) = match (buf.len() >= MAX_PAIR_LEN).then(|| decode(buf)) {
        Some(Ok(Some((delta, n)))) => match decode(&buf[n..])? {
            Some((count, m)) => {
                r.consume(n + m);
                (delta, count)
            }
            None => {
                r.consume(n);
                (delta, read(r)?)
            }
        },
        Some(Err(e)) => return Err(e),
        _ => (read(r)?, read(r)?),
    };
    let key = prev
        .checked_add(delta)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "key past 64 bits"))?;
    Ok((key, count))
}

/// `r`'s buffered bytes, refilled if empty (empty at the end of the input).
#[inline]
fn fill<R: BufRead>(r: &mut R) -> io::Result<&[u8]> {
    loop {
        match r.fill_buf() {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    r.fill_buf()
}

fn overlong() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "varint longer than 64 bits")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn values_round_trip_through_any_buffer_size(
            values in proptest::collection::vec(any::<u64>(), 0..200),
            small in proptest::collection::vec(0u64..300, 0..200),
            capacity in 1usize..24,
        ) {
            let all: Vec<u64> = values.into_iter().chain(small).collect();
            let mut bytes = Vec::new();
            for &v in &all {
                let mut b = [0u8; MAX_LEN];
                let n = encode(v, &mut b);
                bytes.extend_from_slice(&b[..n]);
            }
            // A reader whose buffer ends inside integers takes the byte-at-a-time path.
            let mut r = BufReader::with_capacity(capacity, bytes.as_slice());
            for &v in &all {
                prop_assert_eq!(read(&mut r).unwrap(), v);
            }
            prop_assert!(r.fill_buf().unwrap().is_empty());
        }
    }

    proptest! {
        #[test]
        fn sorted_pairs_round_trip(
            mut keys in proptest::collection::vec(any::<u64>(), 0..200),
            counts in proptest::collection::vec(any::<u64>(), 200),
            capacity in 1usize..40,
        ) {
            keys.sort_unstable();
            keys.dedup();
            let mut bytes = Vec::new();
            let mut prev = 0;
            for (&k, &c) in keys.iter().zip(&counts) {
                let mut b = [0u8; MAX_PAIR_LEN];
                let n = encode_pair(prev, k, c, &mut b);
                bytes.extend_from_slice(&b[..n]);
                prev = k;
            }
            let mut r = BufReader::with_capacity(capacity, bytes.as_slice());
            let mut prev = 0;
            for (&k, &c) in keys.iter().zip(&counts) {
                prop_assert_eq!(read_pair(&mut r, prev).unwrap(), (k, c));
                prev = k;
            }
            prop_assert!(r.fill_buf().unwrap().is_empty());
        }
    }

    #[test]
    fn a_key_past_64_bits_is_an_error() {
        let mut b = [0u8; MAX_PAIR_LEN];
        let n = encode_pair(0, 2, 7, &mut b);
        let err = read_pair(&mut BufReader::new(&b[..n]), u64::MAX - 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn lengths_and_bad_input() {
        let mut b = [0u8; MAX_LEN];
        assert_eq!(encode(0, &mut b), 1);
        assert_eq!(encode(127, &mut b), 1);
        assert_eq!(encode(128, &mut b), 2);
        assert_eq!(encode(u64::MAX, &mut b), MAX_LEN);
        assert_eq!(decode(&b).unwrap(), Some((u64::MAX, MAX_LEN)));
        // Cut short: more bytes needed, then the end of the input.
        assert_eq!(decode(&b[..4]).unwrap(), None);
        let err = read(&mut BufReader::new(&b[..4])).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        // Past 64 bits: a tenth byte above 1, or an eleventh.
        let mut long = [0xffu8; MAX_LEN];
        long[MAX_LEN - 1] = 2;
        assert_eq!(
            decode(&long).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        let longer = [0x80u8; MAX_LEN + 1];
        assert_eq!(
            decode(&longer).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert_eq!(
            read(&mut BufReader::new(&longer[..])).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }
}
