//! Bit-packed arrays of fixed-width unsigned integers, as stored in the model's columns.
//!
//! Value `i` of a `width`-bit array occupies bits `i*width .. (i+1)*width` of the section, bit 0
//! being the least significant bit of byte 0 (little-endian bit order). A section holding `n`
//! values is `packed_bytes(n, width)` long: the bits rounded up to whole 8-byte words plus one
//! zero word of slack, so a reader can always load 8 (or 16) bytes at a value's first byte
//! without a bounds special case.

use std::io::{self, Write};

/// Bits needed to store every value in `0..=max_value` (at least 1).
#[inline]
pub fn width_for(max_value: u64) -> u32 {
    (64 - max_value.leading_zeros()).max(1)
}

/// Byte length of a section holding `n` values of `width` bits (see the module docs).
pub fn packed_bytes(n: u64, width: u32) -> Option<u64> {
    let bits = n.checked_mul(u64::from(width))?;
    let words = bits.div_ceil(64);
    words.checked_add(1)?.checked_mul(8)
}

#[inline]
fn mask(width: u32) -> u64 {
    if width >= 64 {
        u64::MAX
    } else {
        (1u64 << width) - 1
    }
}

/// A read-only view of a packed array inside a mapped file.
///
/// Constructed only over a byte slice whose length was checked against
/// [`packed_bytes`] (see [`Packed::new`]), so `get(i)` with `i < len` never reads outside it.
#[derive(Clone, Copy, Debug)]
pub struct Packed<'a> {
    bytes: &'a [u8],
    len: u64,
    width: u32,
    mask: u64,
}

impl<'a> Packed<'a> {
    /// A view of `len` values of `width` bits (1..=64); `None` if `bytes` is too short.
    pub fn new(bytes: &'a [u8], len: u64, width: u32) -> Option<Self> {
        if !(1..=64).contains(&width) {
            return None;
        }
        let need = packed_bytes(len, width)?;
        if (bytes.len() as u64) < need {
            return None;
        }
        Some(Packed {
            bytes,
            len,
            width,
            mask: mask(width),
        })
    }

    /// A view over a section whose size [`Packed::new`] already accepted (at open). Skipping
    /// the size check is still memory-safe: a bad size would panic on a slice bound, never read
    /// out of bounds.
    #[inline]
    pub(crate) fn trusted(bytes: &'a [u8], len: u64, width: u32) -> Self {
        Packed {
            bytes,
            len,
            width,
            mask: mask(width),
        }
    }

    #[inline]
    pub fn len(&self) -> u64 {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Value `i`; the caller guarantees `i < len` (checked in debug builds). An index past the
    /// end still cannot read outside the slice: it panics through the slice bounds check
    /// rather than returning garbage, and no caller passes one (file-derived indexes are
    /// checked against `len` first).
    #[inline]
    pub fn get(&self, i: u64) -> u64 {
        debug_assert!(i < self.len, "packed index {i} >= len {}", self.len);
        let bit = i * u64::from(self.width);
        let byte = (bit >> 3) as usize;
        let shift = (bit & 7) as u32;
        let lo = load_u64(self.bytes, byte);
        let mut v = lo >> shift;
        if shift + self.width > 64 {
            // Only widths above 56 bits can straddle 9 bytes; the slack word keeps this in range.
            let hi = u64::from(self.bytes[byte + 8]);
            v |= hi << (64 - shift);
        }
        v & self.mask
    }

    /// [`Self::get`] for arrays of at most 57-bit values (token ids are at most 32 bits),
    /// whose values never straddle 9 bytes: one load, one shift, one mask.
    #[inline(always)]
    pub fn get_narrow(&self, i: u64) -> u64 {
        debug_assert!(self.width <= 57 && i < self.len);
        let bit = i * u64::from(self.width);
        (load_u64(self.bytes, (bit >> 3) as usize) >> (bit & 7)) & self.mask
    }

    /// Index of the first value in `lo..hi` that is `>= target`, assuming that range is sorted
    /// ascending (`hi` if none). Branchless: the loop count depends only on the range length
    /// and each step is a conditional move, so searches for several candidates overlap in the
    /// CPU instead of stalling on mispredicted branches.
    #[inline]
    pub fn lower_bound(&self, lo: u64, hi: u64, target: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        let mut base = lo;
        let mut n = hi - lo;
        while n > 1 {
            let half = n / 2;
            base = if self.get(base + half) < target {
                base + half
            } else {
                base
            };
            n -= half;
        }
        base + u64::from(self.get(base) < target)
    }

    /// Entries [`Self::find_eq16`] compares at once.
    pub const SCAN16: u64 = 16;

    /// For a 16-bit array: the position (relative to `lo`) of the first of the `len <= 16`
    /// values from `lo` that equals `target`, as a bit mask over those values (0 = none);
    /// `None` when the 16 values from `lo` run past the array (the caller searches another
    /// way). One 32-byte load and a vector compare, no branch per value.
    #[inline(always)]
    pub fn eq_mask16(&self, lo: u64, len: u64, target: u16) -> Option<u32> {
        debug_assert!(self.width == 16 && len <= Self::SCAN16);
        let at = usize::try_from(lo).ok()?.checked_mul(2)?;
        let chunk: &[u8; 32] = self.bytes.get(at..at.checked_add(32)?)?.try_into().ok()?;
        let m = eq16(chunk, target);
        Some(m & ((1u32 << len) - 1))
    }

    /// Starts loading the cache line that holds value `i`, so that a [`Self::get`] issued a
    /// little later finds it in cache. Any `i` is allowed: past the end it prefetches an
    /// address outside the slice, which never faults and reads nothing.
    #[inline(always)]
    pub fn prefetch(&self, i: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let byte = (i.wrapping_mul(u64::from(self.width)) >> 3) as usize;
            let p = self.bytes.as_ptr().wrapping_add(byte);
            // SAFETY: a prefetch is a hint; it never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }

    /// Index of `target` in the sorted range `lo..hi`, if present.
    #[inline]
    pub fn find(&self, lo: u64, hi: u64, target: u64) -> Option<u64> {
        let i = self.lower_bound(lo, hi, target);
        (i < hi && self.get(i) == target).then_some(i)
    }
}

/// Bit `k` set iff little-endian `u16` number `k` of `chunk` is `target`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn eq16(chunk: &[u8; 32], target: u16) -> u32 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi16, _mm_movemask_epi8, _mm_packs_epi16, _mm_set1_epi16, _mm_set_epi64x,
    };
    let w = |i: usize| i64::from_le_bytes(chunk[i..i + 8].try_into().expect("8 bytes"));
    // SSE2 is part of x86_64: two compares of 8 lanes, packed to bytes (0xFFFF saturates to
    // 0xFF, 0 stays 0), then one bit per byte.
    let (w0, w1, w2, w3) = (w(0), w(8), w(16), w(24));
    // SAFETY: these intrinsics only need SSE2, which every x86_64 CPU has (it is enabled in
    // the target's baseline); they take no pointers.
    unsafe {
        let t = _mm_set1_epi16(target as i16);
        let a = _mm_cmpeq_epi16(_mm_set_epi64x(w1, w0), t);
        let b = _mm_cmpeq_epi16(_mm_set_epi64x(w3, w2), t);
        _mm_movemask_epi8(_mm_packs_epi16(a, b)) as u32
    }
}

/// Bit `k` set iff little-endian `u16` number `k` of `chunk` is `target`.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn eq16(chunk: &[u8; 32], target: u16) -> u32 {
    let mut m = 0u32;
    for k in 0..16 {
        let v = u16::from_le_bytes([chunk[2 * k], chunk[2 * k + 1]]);
        m |= u32::from(v == target) << k;
    }
    m
}

#[inline]
fn load_u64(bytes: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Streams values into the packed layout; [`PackedWriter::finish`] writes the last word and
/// the slack word, returning the number of bytes written (= `packed_bytes(n, width)`).
pub struct PackedWriter<W: Write> {
    out: W,
    width: u32,
    mask: u64,
    acc: u64,
    used: u32,
    count: u64,
    written: u64,
}

impl<W: Write> PackedWriter<W> {
    pub fn new(out: W, width: u32) -> Self {
        assert!(
            (1..=64).contains(&width),
            "packed width {width} outside 1..=64"
        );
        PackedWriter {
            out,
            width,
            mask: mask(width),
            acc: 0,
            used: 0,
            count: 0,
            written: 0,
        }
    }

    /// Appends one value; it must fit the width (checked: a silent truncation would corrupt).
    #[inline]
    pub fn push(&mut self, value: u64) -> io::Result<()> {
        if value & !self.mask != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("value {value} does not fit {} bits", self.width),
            ));
        }
        self.acc |= value << self.used;
        let total = self.used + self.width;
        if total >= 64 {
            self.out.write_all(&self.acc.to_le_bytes())?;
            self.written += 8;
            let consumed = 64 - self.used;
            self.acc = if consumed >= 64 { 0 } else { value >> consumed };
            self.used = total - 64;
        } else {
            self.used = total;
        }
        self.count += 1;
        Ok(())
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Flushes the partial word and the slack word; returns (inner writer, bytes written).
    pub fn finish(mut self) -> io::Result<(W, u64)> {
        if self.used > 0 {
            self.out.write_all(&self.acc.to_le_bytes())?;
            self.written += 8;
        }
        self.out.write_all(&[0u8; 8])?;
        self.written += 8;
        Ok((self.out, self.written))
    }
}

/// Count codes (format version 3): each value (a count rank) of a column is stored as a
/// `width`-bit code; a code below `2^width - 1` is the value itself, and the all-ones code
/// escapes to a separate packed array of `value - (2^width - 1)`. Counts are so skewed (most
/// n-grams are seen once or twice) that 2-3 bits cover all but a few percent of the values.
///
/// The codes lie in 64-byte blocks (one cache line when the section is aligned so): a `u64`
/// with the number of escapes in all earlier blocks, then 7 words of `64 / width` codes each
/// (codes never straddle words; unused high bits are zero). The escape index of a value is
/// then its block's base plus the all-ones codes before it in the block: one block read.
pub const CODE_BLOCK_BYTES: u64 = 64;
/// Code words per block (after the base word).
const CODE_WORDS: u64 = 7;
/// Widest count code a file may declare.
pub const MAX_CODE_WIDTH: u32 = 16;

/// Values per block of `width`-bit codes.
#[inline]
pub fn codes_per_block(width: u32) -> u64 {
    CODE_WORDS * u64::from(64 / width)
}

/// Byte length of a count-code section of `n` values at `width` bits (1..=[`MAX_CODE_WIDTH`]).
pub fn coded_bytes(n: u64, width: u32) -> Option<u64> {
    n.div_ceil(codes_per_block(width))
        .checked_mul(CODE_BLOCK_BYTES)
}

/// The escape code of `width`-bit codes (all ones), which is also the number of values
/// stored directly as codes.
#[inline]
pub fn escape_code(width: u32) -> u64 {
    mask(width)
}

/// Width of the escaped values of a column of ranks `0..table_len` coded at `width` bits.
pub fn escape_width(table_len: u64, width: u32) -> u32 {
    width_for(table_len.saturating_sub(escape_code(width) + 1))
}

/// The code of `value`, and what goes to the escape array if it does not fit the code.
#[inline]
pub fn code_of(value: u64, width: u32) -> (u64, Option<u64>) {
    let esc = escape_code(width);
    if value < esc {
        (value, None)
    } else {
        (esc, Some(value - esc))
    }
}

/// The code width (1..=[`MAX_CODE_WIDTH`]) that stores values with these frequencies
/// (`freq[v]` values equal `v`) in the fewest bytes, codes and escapes together, with its
/// number of escapes.
pub fn best_code_width(freq: &[u64]) -> (u32, u64) {
    let n: u64 = freq.iter().sum();
    let table = freq.len() as u64;
    let mut best = (u64::MAX, 1, 0);
    for w in 1..=MAX_CODE_WIDTH {
        let direct = (escape_code(w) as usize).min(freq.len());
        let escapes: u64 = freq[direct..].iter().sum();
        let bytes = coded_bytes(n, w)
            .unwrap_or(u64::MAX)
            .saturating_add(packed_bytes(escapes, escape_width(table, w)).unwrap_or(u64::MAX));
        if bytes < best.0 {
            best = (bytes, w, escapes);
        }
    }
    (best.1, best.2)
}

/// The shape of `width`-bit count codes, computed once per column (see [`Coded`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct CodeShape {
    width: u32,
    mask: u64,
    per_word: u64,
    per_block: u64,
    /// Bit 0 of every code of a word.
    lows: u64,
}

impl CodeShape {
    /// `None` for a width outside 1..=[`MAX_CODE_WIDTH`].
    pub fn new(width: u32) -> Option<Self> {
        if !(1..=MAX_CODE_WIDTH).contains(&width) {
            return None;
        }
        let per_word = u64::from(64 / width);
        let lows = (0..per_word).fold(0u64, |m, j| m | 1 << (j * u64::from(width)));
        Some(CodeShape {
            width,
            mask: mask(width),
            per_word,
            per_block: CODE_WORDS * per_word,
            lows,
        })
    }

    #[inline]
    pub fn width(&self) -> u32 {
        self.width
    }
}

/// A read-only view of a count-code column and its escapes (see [`CODE_BLOCK_BYTES`]).
#[derive(Clone, Copy, Debug)]
pub struct Coded<'a> {
    blocks: &'a [u8],
    escapes: Packed<'a>,
    width: u32,
    mask: u64,
    per_word: u64,
    per_block: u64,
    lows: u64,
}

impl<'a> Coded<'a> {
    /// A view of `len` codes of `width` bits and their escape array; `None` if `blocks` is
    /// too short or the width is outside 1..=[`MAX_CODE_WIDTH`].
    pub fn new(blocks: &'a [u8], len: u64, width: u32, escapes: Packed<'a>) -> Option<Self> {
        let shape = CodeShape::new(width)?;
        if (blocks.len() as u64) < coded_bytes(len, width)? {
            return None;
        }
        Some(Self::trusted(blocks, shape, escapes))
    }

    /// A view over blocks whose size [`Self::new`] already accepted (at open); a bad size
    /// would panic on a slice bound, never read out of bounds.
    #[inline(always)]
    pub fn trusted(blocks: &'a [u8], shape: CodeShape, escapes: Packed<'a>) -> Self {
        Coded {
            blocks,
            escapes,
            width: shape.width,
            mask: shape.mask,
            per_word: shape.per_word,
            per_block: shape.per_block,
            lows: shape.lows,
        }
    }

    #[inline]
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Escape codes (all-ones fields) in `word`.
    #[inline(always)]
    fn escapes_in(&self, word: u64) -> u64 {
        let mut all = word;
        for s in 1..self.width {
            all &= word >> s;
        }
        u64::from((all & self.lows).count_ones())
    }

    /// The escapes stored before block `b` (its base word).
    #[inline]
    pub fn block_base(&self, b: u64) -> u64 {
        load_u64(self.blocks, (b * CODE_BLOCK_BYTES) as usize)
    }

    /// The escape codes in block `b`.
    pub fn block_escapes(&self, b: u64) -> u64 {
        let at = (b * CODE_BLOCK_BYTES) as usize;
        (1..=CODE_WORDS as usize)
            .map(|w| self.escapes_in(load_u64(self.blocks, at + 8 * w)))
            .sum()
    }

    /// Value `i` (`i` below the column's length); `Err` with the escape index when the
    /// file's block bases point past the escape array (a corrupt file).
    #[inline]
    pub fn get(&self, i: u64) -> Result<u64, u64> {
        let (code, e) = self.read(i);
        self.pick(code, e)
    }

    /// The value a [`Self::read`] stands for; `Err` with the escape index when the block
    /// base points past the escapes.
    #[inline(always)]
    pub fn pick(&self, code: u64, e: u64) -> Result<u64, u64> {
        if code != self.mask {
            return Ok(code);
        }
        self.escaped(e).ok_or(e)
    }

    /// Escaped value number `e`; `None` past the escapes (a corrupt block base).
    #[inline(always)]
    pub fn escaped(&self, e: u64) -> Option<u64> {
        (e < self.escapes.len()).then(|| self.mask + self.escapes.get(e))
    }

    /// Starts loading escaped value number `e` (any `e`, as [`Packed::prefetch`]).
    #[inline(always)]
    pub fn prefetch_escape(&self, e: u64) {
        self.escapes.prefetch(e);
    }

    /// The code of value `i` and the escape index it has if the code is the escape code
    /// (for [`Self::pick`]). Nothing here branches on the code: a branch on a value that
    /// just missed the cache mispredicts half the time and holds back every later load, so
    /// a batch reads every code first and picks afterwards.
    #[inline(always)]
    pub fn read(&self, i: u64) -> (u64, u64) {
        let b = i / self.per_block;
        let at = i - b * self.per_block;
        let word = at / self.per_word;
        let field = at - word * self.per_word;
        let base = (b * CODE_BLOCK_BYTES) as usize;
        let w = load_u64(self.blocks, base + 8 + 8 * word as usize);
        let shift = field * u64::from(self.width);
        let code = (w >> shift) & self.mask;
        let mut e = load_u64(self.blocks, base);
        for j in 0..word as usize {
            e = e.wrapping_add(self.escapes_in(load_u64(self.blocks, base + 8 + 8 * j)));
        }
        // Fields below this one (`shift < 64`: a word holds `64 / width` codes).
        (
            code,
            e.wrapping_add(self.escapes_in(w & ((1u64 << shift) - 1))),
        )
    }

    /// Values `start..start + out.len()` into `out`, in one sequential sweep (a whole-column
    /// reader's path: no per-value block scan). The escape index restarts at each block's
    /// base word, so a value reads exactly what [`Self::get`] gives; `Err((j, e))` where
    /// `out[j]`'s escape index `e` is past the escapes (a corrupt file).
    pub fn decode(&self, start: u64, out: &mut [u64]) -> Result<(), (usize, u64)> {
        let mut i = start;
        let mut j = 0usize;
        let (_, mut e) = if out.is_empty() {
            return Ok(());
        } else {
            self.read(i)
        };
        while j < out.len() {
            let b = i / self.per_block;
            let at = i - b * self.per_block;
            if at == 0 {
                e = self.block_base(b);
            }
            let word = at / self.per_word;
            let mut field = at - word * self.per_word;
            let w = load_u64(self.blocks, (b * CODE_BLOCK_BYTES + 8 + 8 * word) as usize);
            while field < self.per_word && j < out.len() {
                let code = (w >> (field * u64::from(self.width))) & self.mask;
                out[j] = if code == self.mask {
                    let v = self.escaped(e).ok_or((j, e))?;
                    e = e.wrapping_add(1);
                    v
                } else {
                    code
                };
                field += 1;
                j += 1;
                i += 1;
            }
        }
        Ok(())
    }

    /// Starts loading the block that holds value `i` (both cache lines it may span). Any
    /// `i` is allowed, as [`Packed::prefetch`].
    #[inline(always)]
    pub fn prefetch(&self, i: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let at = ((i / self.per_block).wrapping_mul(CODE_BLOCK_BYTES)) as usize;
            let p = self.blocks.as_ptr().wrapping_add(at);
            // SAFETY: a prefetch is a hint; it never faults, whatever the address.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch(p.cast::<i8>(), _MM_HINT_T0);
                _mm_prefetch(p.wrapping_add(63).cast::<i8>(), _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }
}

/// Streams values into count-code blocks (see [`CODE_BLOCK_BYTES`]); the escaped values
/// ([`code_of`]) are written separately, by a [`PackedWriter`] at [`escape_width`].
pub struct CodedWriter<W: Write> {
    out: W,
    width: u32,
    per_word: u64,
    block: [u64; 8],
    /// Values in the current block, and where the next one goes: its word in the block and
    /// its shift there (kept as it goes: a division per value was a tenth of a merge).
    filled: u64,
    word: usize,
    shift: u32,
    escapes: u64,
    written: u64,
}

impl<W: Write> CodedWriter<W> {
    pub fn new(out: W, width: u32) -> Self {
        assert!(
            (1..=MAX_CODE_WIDTH).contains(&width),
            "code width {width} outside 1..={MAX_CODE_WIDTH}"
        );
        CodedWriter {
            out,
            width,
            per_word: u64::from(64 / width),
            block: [0; 8],
            filled: 0,
            word: 1,
            shift: 0,
            escapes: 0,
            written: 0,
        }
    }

    /// Appends one value.
    #[inline]
    pub fn push(&mut self, value: u64) -> io::Result<()> {
        if self.filled == 0 {
            self.block = [0; 8];
            self.block[0] = self.escapes;
        }
        let (code, escaped) = code_of(value, self.width);
        self.escapes += u64::from(escaped.is_some());
        self.block[self.word] |= code << self.shift;
        self.shift += self.width;
        if u64::from(self.shift) == self.per_word * u64::from(self.width) {
            self.word += 1;
            self.shift = 0;
        }
        self.filled += 1;
        if self.filled == CODE_WORDS * self.per_word {
            self.flush_block()?;
        }
        Ok(())
    }

    fn flush_block(&mut self) -> io::Result<()> {
        for w in self.block {
            self.out.write_all(&w.to_le_bytes())?;
        }
        self.written += CODE_BLOCK_BYTES;
        self.filled = 0;
        self.word = 1;
        self.shift = 0;
        Ok(())
    }

    /// Writes the last, partial block; returns (inner writer, bytes written, escapes).
    pub fn finish(mut self) -> io::Result<(W, u64, u64)> {
        if self.filled > 0 {
            self.flush_block()?;
        }
        Ok((self.out, self.written, self.escapes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pack(values: &[u64], width: u32) -> Vec<u8> {
        let mut w = PackedWriter::new(Vec::new(), width);
        for &v in values {
            w.push(v).unwrap();
        }
        let (bytes, n) = w.finish().unwrap();
        assert_eq!(n, bytes.len() as u64);
        assert_eq!(Some(n), packed_bytes(values.len() as u64, width));
        bytes
    }

    #[test]
    fn widths() {
        assert_eq!(width_for(0), 1);
        assert_eq!(width_for(1), 1);
        assert_eq!(width_for(2), 2);
        assert_eq!(width_for(255), 8);
        assert_eq!(width_for(256), 9);
        assert_eq!(width_for(u64::MAX), 64);
    }

    #[test]
    fn value_too_wide_is_an_error() {
        let mut w = PackedWriter::new(Vec::new(), 3);
        assert!(w.push(8).is_err());
        assert!(w.push(7).is_ok());
    }

    #[test]
    fn short_slice_is_refused() {
        let bytes = pack(&[1, 2, 3], 5);
        assert!(Packed::new(&bytes, 3, 5).is_some());
        assert!(Packed::new(&bytes[..bytes.len() - 1], 3, 5).is_none());
        assert!(Packed::new(&bytes, 3, 0).is_none());
        assert!(Packed::new(&bytes, 3, 65).is_none());
    }

    fn code(values: &[u64], width: u32) -> (Vec<u8>, Vec<u8>, u64) {
        let mut w = CodedWriter::new(Vec::new(), width);
        let mut e = PackedWriter::new(Vec::new(), 64);
        for &v in values {
            w.push(v).unwrap();
            if let (_, Some(x)) = code_of(v, width) {
                e.push(x).unwrap();
            }
        }
        let (blocks, n, escapes) = w.finish().unwrap();
        assert_eq!(Some(n), coded_bytes(values.len() as u64, width));
        assert_eq!(n, blocks.len() as u64);
        (blocks, e.finish().unwrap().0, escapes)
    }

    #[test]
    fn code_widths_are_chosen_by_size() {
        // Nearly all values 0: one bit.
        let mut freq = vec![1_000_000u64, 10, 10, 10];
        freq.extend([1; 4000]);
        assert_eq!(best_code_width(&freq).0, 1);
        let (w, e) = best_code_width(&[700, 120, 50, 30, 20, 80]);
        assert_eq!(e, freq_above(&[700, 120, 50, 30, 20, 80], w));
        assert_eq!(escape_width(4106, 2), width_for(4106 - 4));
        assert_eq!(escape_width(3, 2), 1);
    }

    fn freq_above(freq: &[u64], w: u32) -> u64 {
        freq.iter().skip(escape_code(w) as usize).sum()
    }

    #[test]
    fn a_block_base_past_the_escapes_is_an_error() {
        let values = vec![3u64; 10];
        let (mut blocks, esc, escapes) = code(&values, 2);
        assert_eq!(escapes, 10);
        blocks[0] = 9; // base 9: value 1 would be escape 10 of 10
        let e = Packed::new(&esc, escapes, 64).unwrap();
        let c = Coded::new(&blocks, 10, 2, e).unwrap();
        assert_eq!(c.get(0), Ok(3));
        assert_eq!(c.get(1), Err(10));
    }

    /// Bytes of a column of values with frequencies `freq` coded at `width`.
    fn coded_size(freq: &[u64], width: u32) -> u64 {
        let n = freq.iter().sum();
        coded_bytes(n, width).unwrap()
            + packed_bytes(
                freq_above(freq, width),
                escape_width(freq.len() as u64, width),
            )
            .unwrap()
    }

    proptest! {
        #[test]
        fn best_code_width_is_the_smallest(freq in prop::collection::vec(0u64..5000, 1..300)) {
            let (w, e) = best_code_width(&freq);
            prop_assert_eq!(e, freq_above(&freq, w));
            for other in 1..=MAX_CODE_WIDTH {
                prop_assert!(coded_size(&freq, w) <= coded_size(&freq, other));
            }
        }

        /// Every value reads back whatever the width and the mix of direct and escaped codes,
        /// across block boundaries; block bases count the escapes before them.
        #[test]
        fn coded_round_trip(
            width in 1u32..=MAX_CODE_WIDTH,
            raw in prop::collection::vec((0u8..10, any::<u64>()), 0..1200),
        ) {
            let values: Vec<u64> = raw
                .iter()
                .map(|&(sel, v)| if sel < 8 { v % 4 } else { v % 100_000 })
                .collect();
            let (blocks, esc, escapes) = code(&values, width);
            let expect_esc = values.iter().filter(|&&v| v >= escape_code(width)).count() as u64;
            prop_assert_eq!(escapes, expect_esc);
            let e = Packed::new(&esc, escapes, 64).unwrap();
            let c = Coded::new(&blocks, values.len() as u64, width, e).unwrap();
            prop_assert!(Coded::new(&blocks[..blocks.len().saturating_sub(1)], values.len() as u64, width, e).is_none() || values.is_empty());
            for i in [0, values.len() as u64, u64::MAX / 2] {
                c.prefetch(i);
            }
            let mut before = 0;
            for (i, &v) in values.iter().enumerate() {
                let i = i as u64;
                if i.is_multiple_of(codes_per_block(width)) {
                    prop_assert_eq!(c.block_base(i / codes_per_block(width)), before);
                }
                before += u64::from(v >= escape_code(width));
                prop_assert_eq!(c.get(i), Ok(v));
            }
            let blocks_n = (values.len() as u64).div_ceil(codes_per_block(width));
            let total: u64 = (0..blocks_n).map(|b| c.block_escapes(b)).sum();
            prop_assert_eq!(total, escapes);
            // A sequential decode of any range reads the same values.
            let n = values.len();
            for (lo, hi) in [(0, n), (n / 3, n), (n / 2, n / 2 + 1), (n / 5, n - n / 7)] {
                let hi = hi.min(n);
                let lo = lo.min(hi);
                let mut out = vec![0u64; hi - lo];
                prop_assert_eq!(c.decode(lo as u64, &mut out), Ok(()));
                prop_assert_eq!(&out[..], &values[lo..hi]);
            }
        }

        #[test]
        fn round_trip(width in 1u32..=64, raw in prop::collection::vec(any::<u64>(), 0..200)) {
            let values: Vec<u64> = raw.iter().map(|v| v & mask(width)).collect();
            let bytes = pack(&values, width);
            let p = Packed::new(&bytes, values.len() as u64, width).unwrap();
            // Prefetches anywhere, inside or far past the slice, neither fault nor change a value.
            for i in [0, values.len() as u64, (values.len() as u64 + 1) << 40, u64::MAX] {
                p.prefetch(i);
            }
            for (i, &v) in values.iter().enumerate() {
                p.prefetch(i as u64);
                prop_assert_eq!(p.get(i as u64), v);
            }
        }

        #[test]
        fn search_matches_std(width in 1u32..=20, raw in prop::collection::vec(any::<u64>(), 0..100), target in any::<u64>(), cut in 0usize..100) {
            let mut values: Vec<u64> = raw.iter().map(|v| v & mask(width)).collect();
            values.sort_unstable();
            let target = target & mask(width);
            let bytes = pack(&values, width);
            let p = Packed::new(&bytes, values.len() as u64, width).unwrap();
            let lo = cut.min(values.len());
            let expect = lo + values[lo..].partition_point(|&v| v < target);
            prop_assert_eq!(p.lower_bound(lo as u64, values.len() as u64, target), expect as u64);
            prop_assert_eq!(p.find(lo as u64, values.len() as u64, target).is_some(), values[lo..].contains(&target));
        }
    }
}
