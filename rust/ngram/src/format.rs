//! The on-disk layout: header, per-order records and section table (byte layout in
//! `docs/ngram-format.md`). Everything is little-endian; sections start at 8-byte offsets.
//!
//! Parsing checks the magic, the version, the header checksum and that every section lies
//! inside the file with exactly the size its counts imply. That is O(order), never a scan of
//! the data: section checksums are checked by [`crate::model::NGramModel`]'s open.

use std::path::Path;

use xxhash_rust::xxh3::xxh3_64;

use crate::bits::{
    coded_bytes, escape_code, escape_width, packed_bytes, width_for, MAX_CODE_WIDTH,
};
use crate::error::{NGramError, Result};

pub const MAGIC: [u8; 8] = *b"DARTNGRM";
/// Version written by default: child buckets and count codes.
pub const VERSION: u32 = 3;
/// Version 2: child buckets, count ranks at a fixed width (still read, and written on request).
pub const VERSION_PLAIN_COUNTS: u32 = 2;
/// Oldest version read: version 1 is version 2 without child buckets (`bucket_stride` 0).
pub const MIN_VERSION: u32 = 1;
/// Children per bucket-table entry written by default (see [`SectionKind::ChildBuckets`]):
/// about `bucket_width / 8` bits per n-gram, searches of about 8 entries after the jump.
pub const DEFAULT_BUCKET_STRIDE: u32 = 8;
/// Bytes before the per-order records.
pub const FIXED_HEADER: usize = 104;
/// Bytes of one per-order record in versions 1 and 2 (version 3 adds `count_escapes`).
pub const ORDER_RECORD: usize = 40;

/// Bytes of one per-order record in a file of `version`.
pub fn order_record_len(version: u32) -> usize {
    if version >= VERSION {
        ORDER_RECORD + 8
    } else {
        ORDER_RECORD
    }
}
/// Bytes of one section-table entry.
pub const SECTION_ENTRY: usize = 32;
/// `eos` value meaning "no end-of-document token".
pub const NO_EOS: u32 = u32::MAX;
/// Longest provenance string stored (longer ones are cut at a char boundary).
pub const MAX_SOURCE: usize = 4096;
/// Widest child-bucket entry a file may declare.
pub const MAX_BUCKET_WIDTH: u32 = 57;
/// Highest order a file may declare (keys are u64, so 64 one-bit tokens at most).
pub const MAX_ORDER: u32 = 64;

/// Kinds of sections. Values are part of the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum SectionKind {
    /// Order 1: `vocab_size` counts, packed at the order's `count_width`.
    UnigramCounts = 1,
    /// Order n < N: `entries(n) + 1` CSR offsets into order n+1, packed at `child_width`.
    ChildOffsets = 2,
    /// Order n >= 2: last token of each n-gram, packed at `token_bits`.
    Tokens = 3,
    /// Order n >= 2 (versions 1 and 2): rank of each n-gram's count in the order's count table,
    /// packed at `count_width`.
    CountRanks = 4,
    /// Order n >= 2: the distinct counts of the order, `u64`, strictly ascending.
    CountValues = 5,
    /// Order n < N: ids (index in order n; token id for n = 1) of the contexts that have a top
    /// list, strictly ascending, packed at `width_for(entries(n) - 1)`.
    TopContexts = 6,
    /// Order n < N: `top_list_len` child indices per listed context (relative to the context's
    /// first child, best first), packed at `top_rel_width`.
    TopLists = 7,
    /// Order n < N (version 2): `entries(n+1) / bucket_stride` relative child offsets at the
    /// order's `bucket_width`: each context's slice splits its children into buckets by token
    /// key, so a child is found by one table read and a search of a few entries.
    ChildBuckets = 8,
    /// Order 1 (version 2): `vocab_size` token keys, `u32` LE, non-decreasing in the token id
    /// (the writer's: the share of stored n-grams of orders >= 2 that end in a smaller id,
    /// scaled to 2^32), padded with zeros to a multiple of 8 bytes.
    TokenKeys = 9,
    /// Order n >= 2 (version 3): each n-gram's count rank as a `count_width`-bit code in
    /// 64-byte blocks (see [`crate::bits::CODE_BLOCK_BYTES`]); the all-ones code escapes.
    CountCodes = 10,
    /// Order n >= 2 (version 3): `count_escapes` escaped ranks, each stored minus the escape
    /// code, packed at `escape_width(count_values, count_width)`.
    CountEscapes = 11,
}

impl SectionKind {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => SectionKind::UnigramCounts,
            2 => SectionKind::ChildOffsets,
            3 => SectionKind::Tokens,
            4 => SectionKind::CountRanks,
            5 => SectionKind::CountValues,
            6 => SectionKind::TopContexts,
            7 => SectionKind::TopLists,
            8 => SectionKind::ChildBuckets,
            9 => SectionKind::TokenKeys,
            10 => SectionKind::CountCodes,
            11 => SectionKind::CountEscapes,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            SectionKind::UnigramCounts => "unigram-counts",
            SectionKind::ChildOffsets => "child-offsets",
            SectionKind::Tokens => "tokens",
            SectionKind::CountRanks => "count-ranks",
            SectionKind::CountValues => "count-values",
            SectionKind::TopContexts => "top-contexts",
            SectionKind::TopLists => "top-lists",
            SectionKind::ChildBuckets => "child-buckets",
            SectionKind::TokenKeys => "token-keys",
            SectionKind::CountCodes => "count-codes",
            SectionKind::CountEscapes => "count-escapes",
        }
    }
}

/// What the header says about one order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OrderRecord {
    /// Distinct n-grams of this order (order 1: unigrams with a non-zero count).
    pub ngrams: u64,
    /// Length of the count table (0 for order 1, whose counts are stored plainly).
    pub count_values: u64,
    /// Contexts of this order with a top list (0 for order N).
    pub top_contexts: u64,
    /// Width of the count column (order 1: counts; order >= 2: ranks in versions 1 and 2,
    /// rank codes in version 3).
    pub count_width: u32,
    /// Width of the CSR offsets into order n+1 (0 for order N).
    pub child_width: u32,
    /// Width of the top-list entries (0 when there are no lists).
    pub top_rel_width: u32,
    /// Width of the child-bucket entries (0 for order N and in version 1).
    pub bucket_width: u32,
    /// Version 3, order >= 2: ranks stored in the escape array (0 otherwise).
    pub count_escapes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Section {
    pub kind: SectionKind,
    /// 1-based order the section belongs to.
    pub order: u32,
    pub offset: u64,
    pub length: u64,
    pub checksum: u64,
}

/// The parsed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// [`MIN_VERSION`]..=[`VERSION`]: 1 exactly when `bucket_stride` is 0; 3 has count codes.
    pub version: u32,
    pub header_len: u32,
    pub order: u32,
    pub vocab_size: u32,
    pub token_bits: u32,
    pub eos: u32,
    pub fingerprint: [u8; 32],
    pub min_count: u64,
    pub total_tokens: u64,
    pub documents: u64,
    pub top_list_len: u32,
    /// Children per child-bucket entry (0: no child-bucket sections, version 1).
    pub bucket_stride: u32,
    pub orders: Vec<OrderRecord>,
    pub sections: Vec<Section>,
    pub source: String,
}

impl Header {
    /// Entries stored at order `n` (1-based): order 1 is dense by token id.
    pub fn entries(&self, n: usize) -> u64 {
        if n == 1 {
            u64::from(self.vocab_size)
        } else {
            self.orders[n - 1].ngrams
        }
    }

    /// Whether order-n count ranks are coded (version 3) rather than packed at a fixed width.
    pub fn coded_counts(&self) -> bool {
        self.version >= VERSION
    }

    /// Header byte length of a `version` file with `order` orders, `sections` sections and a
    /// source of `source_len`.
    pub fn byte_len(version: u32, order: usize, sections: usize, source_len: usize) -> usize {
        let body = FIXED_HEADER
            + order * order_record_len(version)
            + sections * SECTION_ENTRY
            + source_len;
        body.div_ceil(8) * 8 + 8
    }

    /// The sections a model of this header must have, each with its exact byte length, in
    /// file order.
    pub fn expected_sections(&self) -> Option<Vec<(SectionKind, u32, u64)>> {
        let n_max = self.order as usize;
        let mut out = Vec::new();
        for n in 1..=n_max {
            let rec = &self.orders[n - 1];
            let entries = self.entries(n);
            let o = n as u32;
            if n == 1 {
                out.push((
                    SectionKind::UnigramCounts,
                    o,
                    packed_bytes(entries, rec.count_width)?,
                ));
                if self.bucket_stride > 0 {
                    out.push((SectionKind::TokenKeys, o, token_keys_bytes(entries)?));
                }
            } else {
                out.push((
                    SectionKind::Tokens,
                    o,
                    packed_bytes(entries, self.token_bits)?,
                ));
                if self.coded_counts() {
                    out.push((
                        SectionKind::CountCodes,
                        o,
                        coded_bytes(entries, rec.count_width)?,
                    ));
                    out.push((
                        SectionKind::CountEscapes,
                        o,
                        packed_bytes(
                            rec.count_escapes,
                            escape_width(rec.count_values, rec.count_width),
                        )?,
                    ));
                } else {
                    out.push((
                        SectionKind::CountRanks,
                        o,
                        packed_bytes(entries, rec.count_width)?,
                    ));
                }
                out.push((
                    SectionKind::CountValues,
                    o,
                    rec.count_values.checked_mul(8)?,
                ));
            }
            if n < n_max {
                out.push((
                    SectionKind::ChildOffsets,
                    o,
                    packed_bytes(entries.checked_add(1)?, rec.child_width)?,
                ));
                if self.bucket_stride > 0 {
                    out.push((
                        SectionKind::ChildBuckets,
                        o,
                        packed_bytes(self.bucket_entries(n + 1), rec.bucket_width)?,
                    ));
                }
                if rec.top_contexts > 0 {
                    out.push((
                        SectionKind::TopContexts,
                        o,
                        packed_bytes(rec.top_contexts, width_for(entries.saturating_sub(1)))?,
                    ));
                    let list = rec.top_contexts.checked_mul(u64::from(self.top_list_len))?;
                    out.push((
                        SectionKind::TopLists,
                        o,
                        packed_bytes(list, rec.top_rel_width)?,
                    ));
                }
            }
        }
        Some(out)
    }

    /// Length of the child-bucket table of order `n - 1` (whose children are order `n`).
    pub fn bucket_entries(&self, n: usize) -> u64 {
        match self.bucket_stride {
            0 => 0,
            d => self.entries(n) / u64::from(d),
        }
    }

    /// Serialises the header (checksum included) to exactly `header_len` bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.header_len as usize);
        b.extend_from_slice(&MAGIC);
        put_u32(&mut b, self.version);
        put_u32(&mut b, self.header_len);
        put_u32(&mut b, self.order);
        put_u32(&mut b, self.vocab_size);
        put_u32(&mut b, self.token_bits);
        put_u32(&mut b, self.eos);
        b.extend_from_slice(&self.fingerprint);
        put_u64(&mut b, self.min_count);
        put_u64(&mut b, self.total_tokens);
        put_u64(&mut b, self.documents);
        put_u32(&mut b, self.top_list_len);
        put_u32(&mut b, self.sections.len() as u32);
        put_u32(&mut b, self.source.len() as u32);
        put_u32(&mut b, self.bucket_stride);
        debug_assert_eq!(b.len(), FIXED_HEADER);
        for r in &self.orders {
            put_u64(&mut b, r.ngrams);
            put_u64(&mut b, r.count_values);
            put_u64(&mut b, r.top_contexts);
            put_u32(&mut b, r.count_width);
            put_u32(&mut b, r.child_width);
            put_u32(&mut b, r.top_rel_width);
            put_u32(&mut b, r.bucket_width);
            if self.coded_counts() {
                put_u64(&mut b, r.count_escapes);
            }
        }
        for s in &self.sections {
            put_u32(&mut b, s.kind as u32);
            put_u32(&mut b, s.order);
            put_u64(&mut b, s.offset);
            put_u64(&mut b, s.length);
            put_u64(&mut b, s.checksum);
        }
        b.extend_from_slice(self.source.as_bytes());
        while !b.len().is_multiple_of(8) {
            b.push(0);
        }
        let sum = xxh3_64(&b);
        put_u64(&mut b, sum);
        debug_assert_eq!(b.len(), self.header_len as usize);
        b
    }

    /// Parses and validates the header of a file of `file_len` bytes whose first bytes are
    /// `bytes` (at least the whole header when the file is that long).
    pub fn parse(path: &Path, bytes: &[u8], file_len: u64) -> Result<Header> {
        let corrupt = |detail: String| NGramError::Corrupt {
            path: path.to_path_buf(),
            detail,
        };
        if bytes.len() < 8 && MAGIC.starts_with(bytes) {
            return Err(corrupt(format!(
                "truncated: the file is {file_len} bytes, shorter than the {FIXED_HEADER}-byte header"
            )));
        }
        if bytes.len() < 8 || bytes[..8] != MAGIC {
            let found = &bytes[..bytes.len().min(8)];
            return Err(NGramError::NotAModel {
                path: path.to_path_buf(),
                detail: format!("expected magic {:?}, found {:?}", "DARTNGRM", escape(found)),
            });
        }
        if bytes.len() < FIXED_HEADER {
            return Err(corrupt(format!(
                "truncated: the file is {file_len} bytes, shorter than the {FIXED_HEADER}-byte header"
            )));
        }
        let mut r = Reader { b: bytes, at: 8 };
        let version = r.u32();
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(NGramError::UnsupportedVersion {
                path: path.to_path_buf(),
                found: version,
                min: MIN_VERSION,
                max: VERSION,
            });
        }
        let header_len = r.u32();
        if (header_len as usize) < FIXED_HEADER + 8 || !header_len.is_multiple_of(8) {
            return Err(corrupt(format!(
                "header length {header_len} is not a multiple of 8 of at least {}",
                FIXED_HEADER + 8
            )));
        }
        if u64::from(header_len) > file_len || header_len as usize > bytes.len() {
            return Err(corrupt(format!(
                "truncated: the header needs {header_len} bytes, the file has {file_len}"
            )));
        }
        let hl = header_len as usize;
        let stored = u64::from_le_bytes(bytes[hl - 8..hl].try_into().expect("8 bytes"));
        let actual = xxh3_64(&bytes[..hl - 8]);
        if stored != actual {
            return Err(corrupt(format!(
                "header checksum mismatch (stored {stored:016x}, computed {actual:016x})"
            )));
        }
        let order = r.u32();
        let vocab_size = r.u32();
        let token_bits = r.u32();
        let eos = r.u32();
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(r.take(32));
        let min_count = r.u64();
        let total_tokens = r.u64();
        let documents = r.u64();
        let top_list_len = r.u32();
        let n_sections = r.u32() as usize;
        let source_len = r.u32() as usize;
        let bucket_stride = r.u32();
        if order == 0 || order > MAX_ORDER {
            return Err(corrupt(format!("order {order} outside 1..={MAX_ORDER}")));
        }
        if vocab_size == 0 {
            return Err(corrupt("vocabulary size 0".into()));
        }
        let expect_bits = crate::key::token_bits(vocab_size);
        if token_bits != expect_bits {
            return Err(corrupt(format!(
                "token width {token_bits} bits, expected {expect_bits} for a vocabulary of {vocab_size}"
            )));
        }
        if u64::from(order) * u64::from(token_bits) > 64 {
            return Err(corrupt(format!(
                "order {order} x {token_bits}-bit tokens does not fit a 64-bit key"
            )));
        }
        if eos != NO_EOS && eos >= vocab_size {
            return Err(corrupt(format!(
                "eos id {eos} outside the vocabulary of {vocab_size}"
            )));
        }
        if top_list_len == 0 {
            return Err(corrupt("top list length 0".into()));
        }
        if source_len > MAX_SOURCE || n_sections > 8 * order as usize {
            return Err(corrupt(format!(
                "implausible header: {n_sections} sections, {source_len}-byte source"
            )));
        }
        if Header::byte_len(version, order as usize, n_sections, source_len) != hl {
            return Err(corrupt(format!(
                "header length {hl} does not match {order} orders, {n_sections} sections and a \
                 {source_len}-byte source"
            )));
        }
        let mut orders = Vec::with_capacity(order as usize);
        for _ in 0..order {
            let rec = OrderRecord {
                ngrams: r.u64(),
                count_values: r.u64(),
                top_contexts: r.u64(),
                count_width: r.u32(),
                child_width: r.u32(),
                top_rel_width: r.u32(),
                bucket_width: r.u32(),
                count_escapes: if version >= VERSION { r.u64() } else { 0 },
            };
            orders.push(rec);
        }
        let mut sections = Vec::with_capacity(n_sections);
        for i in 0..n_sections {
            let kind_raw = r.u32();
            let kind = SectionKind::from_u32(kind_raw)
                .ok_or_else(|| corrupt(format!("section {i} has unknown kind {kind_raw}")))?;
            sections.push(Section {
                kind,
                order: r.u32(),
                offset: r.u64(),
                length: r.u64(),
                checksum: r.u64(),
            });
        }
        let source = String::from_utf8_lossy(r.take(source_len)).into_owned();
        let h = Header {
            version,
            header_len,
            order,
            vocab_size,
            token_bits,
            eos,
            fingerprint,
            min_count,
            total_tokens,
            documents,
            top_list_len,
            bucket_stride,
            orders,
            sections,
            source,
        };
        h.validate(path, file_len)?;
        Ok(h)
    }

    /// Structural checks that need no scan of the data.
    fn validate(&self, path: &Path, file_len: u64) -> Result<()> {
        let corrupt = |detail: String| NGramError::Corrupt {
            path: path.to_path_buf(),
            detail,
        };
        let n_max = self.order as usize;
        if (self.version == 1) != (self.bucket_stride == 0) {
            return Err(corrupt(format!(
                "bucket stride {} in a version-{} file (version 1 has none, later ones need one)",
                self.bucket_stride, self.version
            )));
        }
        for (i, rec) in self.orders.iter().enumerate() {
            let n = i + 1;
            let entries = self.entries(n);
            if n == 1 {
                if rec.ngrams > entries
                    || rec.count_values != 0
                    || rec.count_escapes != 0
                    || !(1..=64).contains(&rec.count_width)
                {
                    return Err(corrupt(format!("order 1 record is inconsistent: {rec:?}")));
                }
            } else {
                if rec.count_values > rec.ngrams || (rec.ngrams > 0 && rec.count_values == 0) {
                    return Err(corrupt(format!(
                        "order {n}: {} distinct counts for {} n-grams",
                        rec.count_values, rec.ngrams
                    )));
                }
                if self.coded_counts() {
                    let w = rec.count_width;
                    if !(1..=MAX_CODE_WIDTH).contains(&w) {
                        return Err(corrupt(format!(
                            "order {n}: count code width {w} bits, expected 1..={MAX_CODE_WIDTH}"
                        )));
                    }
                    // Ranks below the escape code are stored as codes: a table that short
                    // leaves nothing to escape.
                    let none = rec.count_values <= escape_code(w);
                    if rec.count_escapes > rec.ngrams || (none && rec.count_escapes > 0) {
                        return Err(corrupt(format!(
                            "order {n}: {} escaped counts for {} n-grams and {} distinct \
                             counts at {w}-bit codes",
                            rec.count_escapes, rec.ngrams, rec.count_values
                        )));
                    }
                } else {
                    let w = width_for(rec.count_values.saturating_sub(1));
                    if rec.count_width != w {
                        return Err(corrupt(format!(
                            "order {n}: count rank width {} bits, expected {w}",
                            rec.count_width
                        )));
                    }
                }
            }
            if n < n_max {
                let next = self.orders[n].ngrams;
                let w = width_for(next);
                if rec.child_width != w {
                    return Err(corrupt(format!(
                        "order {n}: child offset width {} bits, expected {w} for {next} n-grams",
                        rec.child_width
                    )));
                }
                if rec.top_contexts > entries {
                    return Err(corrupt(format!(
                        "order {n}: {} top lists for {entries} contexts",
                        rec.top_contexts
                    )));
                }
                if rec.top_contexts > 0 && !(1..=32).contains(&rec.top_rel_width) {
                    return Err(corrupt(format!(
                        "order {n}: top list width {} bits",
                        rec.top_rel_width
                    )));
                }
                // Bucket entries are offsets inside one context's children, so they never
                // need more bits than the CSR offsets (nor, in any real file, 57: readers
                // load them with one unaligned 8-byte read).
                let max_bucket = rec.child_width.min(MAX_BUCKET_WIDTH);
                let bucket_ok = if self.bucket_stride == 0 {
                    rec.bucket_width == 0
                } else {
                    (1..=max_bucket).contains(&rec.bucket_width)
                };
                if !bucket_ok {
                    return Err(corrupt(format!(
                        "order {n}: child bucket width {} bits, expected {} with stride {}",
                        rec.bucket_width,
                        if self.bucket_stride == 0 {
                            "0".to_string()
                        } else {
                            format!("1..={max_bucket}")
                        },
                        self.bucket_stride
                    )));
                }
            } else if rec.child_width != 0 || rec.top_contexts != 0 || rec.bucket_width != 0 {
                return Err(corrupt(format!(
                    "order {n} (the highest) has children: {rec:?}"
                )));
            }
        }
        let expected = self
            .expected_sections()
            .ok_or_else(|| corrupt("section sizes overflow".into()))?;
        if expected.len() != self.sections.len() {
            return Err(corrupt(format!(
                "{} sections, expected {}",
                self.sections.len(),
                expected.len()
            )));
        }
        let mut at = u64::from(self.header_len);
        for (s, (kind, order, len)) in self.sections.iter().zip(&expected) {
            if s.kind != *kind || s.order != *order {
                return Err(corrupt(format!(
                    "section {} of order {} where {} of order {order} was expected",
                    s.kind.name(),
                    s.order,
                    kind.name()
                )));
            }
            if s.length != *len {
                return Err(corrupt(format!(
                    "section {} of order {order} is {} bytes, its counts imply {len}",
                    kind.name(),
                    s.length
                )));
            }
            let end = s.offset.checked_add(s.length);
            if !s.offset.is_multiple_of(8)
                || s.offset < u64::from(self.header_len)
                || end.is_none_or(|e| e > file_len)
            {
                return Err(corrupt(format!(
                    "section {} of order {order} at {}..+{} lies outside the {file_len}-byte file \
                     (truncated?)",
                    kind.name(),
                    s.offset,
                    s.length
                )));
            }
            // Sections follow the header and each other without gaps, so every byte of the
            // file is covered by the header checksum or a section checksum.
            if s.offset != at {
                return Err(corrupt(format!(
                    "section {} of order {order} starts at byte {}, expected {at} (right after \
                     the previous one)",
                    kind.name(),
                    s.offset
                )));
            }
            at = s.offset + s.length;
        }
        if at != file_len {
            return Err(corrupt(format!(
                "{} bytes after the last section (the sections end at byte {at} of the \
                 {file_len}-byte file)",
                file_len - at
            )));
        }
        Ok(())
    }

    /// The section of `kind` at `order`.
    pub fn section(&self, kind: SectionKind, order: usize) -> Option<&Section> {
        self.sections
            .iter()
            .find(|s| s.kind == kind && s.order as usize == order)
    }
}

/// Byte length of the token-keys section of a `vocab_size`-token vocabulary.
pub fn token_keys_bytes(vocab_size: u64) -> Option<u64> {
    Some(vocab_size.checked_mul(4)?.div_ceil(8) * 8)
}

/// Where a context's children lie in its order's child-bucket table, and which bucket a token
/// key falls in (the format's definition; see `docs/ngram-format.md`).
///
/// A context whose children are `lo..hi` in order n+1 owns table entries
/// `lo / stride .. hi / stride` (the slices of consecutive contexts tile the table). With `b`
/// entries it has `b + 1` buckets; a token whose key is `key` falls in bucket
/// `(key * (b + 1)) >> 32`, a monotone map onto `0..=b`. Entry `j` (`0 <= j < b`) is the
/// index, relative to `lo`, of the first child in bucket `j + 1` or later, so bucket `k` spans
/// `entry(k - 1) .. entry(k)` with `entry(-1) = 0` and `entry(b) = hi - lo`.
#[derive(Clone, Copy, Debug, Default)]
pub struct BucketSlice {
    /// First table entry of the context.
    pub first: u64,
    /// Table entries of the context (`b`); 0 = a single bucket, i.e. search all children.
    pub entries: u64,
}

impl BucketSlice {
    #[inline]
    pub fn new(lo: u64, hi: u64, stride: u32) -> Self {
        if stride == 0 || hi <= lo {
            return BucketSlice::default();
        }
        let d = u64::from(stride);
        // Writers use powers of two: a shift instead of two divisions on the lookup's path.
        let (first, end) = if d.is_power_of_two() {
            (lo >> d.trailing_zeros(), hi >> d.trailing_zeros())
        } else {
            (lo / d, hi / d)
        };
        BucketSlice {
            first,
            entries: end - first,
        }
    }

    /// Bucket (in `0..=entries`) of a token whose key is `key`.
    #[inline]
    pub fn bucket(&self, key: u32) -> u64 {
        // key < 2^32, so the product fits 128 bits and the result is at most `entries`.
        ((u128::from(key) * u128::from(self.entries + 1)) >> 32) as u64
    }
}

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn escape(b: &[u8]) -> String {
    b.iter()
        .flat_map(|&c| std::ascii::escape_default(c))
        .map(char::from)
        .collect()
}

/// Cursor over header bytes whose length was checked before reading.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Consecutive contexts' slices tile the table exactly, and buckets are monotone in
        /// the key and stay inside the slice.
        #[test]
        fn bucket_slices_tile_and_buckets_are_monotone(
            sizes in prop::collection::vec(0u64..50, 1..40),
            stride in 1u32..10,
            mut keys in prop::collection::vec(any::<u32>(), 2..20),
        ) {
            keys.sort_unstable();
            let mut lo = 0;
            let mut next_first = 0;
            for n in sizes {
                let s = BucketSlice::new(lo, lo + n, stride);
                if s.entries > 0 {
                    prop_assert_eq!(s.first, next_first);
                }
                next_first += s.entries;
                let b: Vec<u64> = keys.iter().map(|&k| s.bucket(k)).collect();
                prop_assert!(b.windows(2).all(|w| w[0] <= w[1]));
                prop_assert!(b.iter().all(|&x| x <= s.entries));
                prop_assert_eq!(s.bucket(0), 0);
                prop_assert_eq!(s.bucket(u32::MAX), s.entries);
                lo += n;
            }
            prop_assert_eq!(next_first, lo / u64::from(stride));
        }
    }

    #[test]
    fn no_stride_no_buckets() {
        let s = BucketSlice::new(10, 1000, 0);
        assert_eq!((s.first, s.entries, s.bucket(u32::MAX)), (0, 0, 0));
        assert_eq!(token_keys_bytes(3), Some(16));
        assert_eq!(token_keys_bytes(4), Some(16));
        assert_eq!(token_keys_bytes(u64::MAX), None);
    }
}
