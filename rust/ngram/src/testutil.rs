//! Brute-force counting and queries over plain maps, the oracle of the format tests.

use std::collections::BTreeMap;
use std::path::Path;

use xxhash_rust::xxh3::xxh3_64;

use crate::error::Result;
use crate::format::Header;
use crate::key;
use crate::writer::{
    write_model, write_model_as, write_model_with_stride, CountStream, Layout, ModelMeta,
    WriteOptions, WriteReport,
};

#[derive(Clone, Debug)]
pub struct Counts {
    pub order: usize,
    pub vocab: u32,
    pub eos: Option<u32>,
    pub uni: Vec<u64>,
    /// All n-grams of orders 1..=N by token sequence.
    pub grams: BTreeMap<Vec<u32>, u64>,
    pub total: u64,
    pub docs: u64,
    pub min_count: u64,
}

/// Counts a corpus the DESIGN way: each document gets `eos` appended, k-grams never cross
/// documents; n-grams of order >= 2 below `min_count` are dropped.
pub fn count_corpus(
    docs: &[Vec<u32>],
    order: usize,
    vocab: u32,
    eos: Option<u32>,
    min_count: u64,
) -> Counts {
    let mut uni = vec![0u64; vocab as usize];
    let mut grams = BTreeMap::new();
    let mut total = 0;
    for d in docs {
        let mut d = d.clone();
        if let Some(e) = eos {
            d.push(e);
        }
        total += d.len() as u64;
        for i in 0..d.len() {
            uni[d[i] as usize] += 1;
            for n in 1..=order {
                if i + n <= d.len() {
                    *grams.entry(d[i..i + n].to_vec()).or_insert(0u64) += 1;
                }
            }
        }
    }
    grams.retain(|g: &Vec<u32>, c: &mut u64| g.len() == 1 || *c >= min_count);
    Counts {
        order,
        vocab,
        eos,
        uni,
        grams,
        total,
        docs: docs.len() as u64,
        min_count,
    }
}

impl Counts {
    pub fn meta(&self) -> ModelMeta {
        ModelMeta {
            order: self.order,
            vocab_size: self.vocab,
            tokenizer_fingerprint: [7u8; 32],
            eos_id: self.eos,
            min_count: self.min_count,
            total_tokens: self.total,
            documents: self.docs,
            source: "test".into(),
        }
    }

    /// The sorted key stream of order `n`.
    pub fn stream(&self, n: usize) -> Vec<(u64, u64)> {
        let bits = key::token_bits(self.vocab);
        let mut v: Vec<(u64, u64)> = self
            .grams
            .iter()
            .filter(|(g, _)| g.len() == n)
            .map(|(g, &c)| (key::pack(g, bits), c))
            .collect();
        v.sort_unstable();
        v
    }

    pub fn streams(&self) -> Vec<CountStream<'static>> {
        (2..=self.order)
            .map(|n| Box::new(self.stream(n).into_iter().map(Ok)) as CountStream<'static>)
            .collect()
    }

    pub fn write(&self, path: &Path, top_list_len: u32) -> Result<WriteReport> {
        write_model(
            path,
            &self.meta(),
            &self.uni,
            self.streams(),
            &WriteOptions {
                top_list_len,
                ..Default::default()
            },
        )
    }

    /// [`Self::write`] with `bucket_stride` children per child-bucket entry (0: version 1).
    pub fn write_with_stride(
        &self,
        path: &Path,
        top_list_len: u32,
        bucket_stride: u32,
    ) -> Result<WriteReport> {
        write_model_with_stride(
            path,
            &self.meta(),
            &self.uni,
            self.streams(),
            &WriteOptions {
                top_list_len,
                ..Default::default()
            },
            bucket_stride,
        )
    }

    /// [`Self::write`] in `layout` (an older format version, a forced count-code width).
    pub fn write_as(&self, path: &Path, top_list_len: u32, layout: &Layout) -> Result<WriteReport> {
        write_model_as(
            path,
            &self.meta(),
            &self.uni,
            self.streams(),
            &WriteOptions {
                top_list_len,
                ..Default::default()
            },
            layout,
        )
    }

    pub fn count(&self, g: &[u32]) -> u64 {
        if g.is_empty() {
            return self.total;
        }
        if g.len() == 1 {
            return self.uni[g[0] as usize];
        }
        self.grams.get(g).copied().unwrap_or(0)
    }

    /// P(c | context) by the DESIGN semantics, in f64.
    pub fn prob(&self, context: &[u32], c: u32) -> (f64, u8) {
        let ctx = &context[context.len().saturating_sub(self.order - 1)..];
        for len in (1..=ctx.len()).rev() {
            let s = &ctx[ctx.len() - len..];
            let cs = self.count(s);
            let mut g = s.to_vec();
            g.push(c);
            let cg = self.count(&g);
            if cs > 0 && cg > 0 {
                return (cg as f64 / cs as f64, len as u8);
            }
        }
        (0.0, 0)
    }

    pub fn top_k(&self, context: &[u32], k: usize) -> Vec<(u32, f64)> {
        let mut all: Vec<(u32, f64)> = (0..self.vocab)
            .map(|c| (c, self.prob(context, c).0))
            .filter(|&(_, p)| p > 0.0)
            .collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }

    /// The longest suffix of the context with a continuation, and its `k` best continuations.
    pub fn continuations(&self, context: &[u32], k: usize) -> (usize, Vec<(u32, f64)>) {
        let ctx = &context[context.len().saturating_sub(self.order - 1)..];
        for len in (0..=ctx.len()).rev() {
            let s = &ctx[ctx.len() - len..];
            let cs = self.count(s);
            let mut all: Vec<(u32, f64)> = (0..self.vocab)
                .filter_map(|c| {
                    let mut g = s.to_vec();
                    g.push(c);
                    let cg = self.count(&g);
                    (cs > 0 && cg > 0).then(|| (c, cg as f64 / cs as f64))
                })
                .collect();
            if !all.is_empty() {
                all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                all.truncate(k);
                return (len, all);
            }
        }
        (0, Vec::new())
    }
}

/// Recomputes every section checksum after the data was patched, as a buggy writer that
/// wrote wrong data would have: only range checks at query time can catch it.
pub fn rechecksum(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let mut h = Header::parse(path, &bytes, bytes.len() as u64).unwrap();
    for s in &mut h.sections {
        s.checksum = xxh3_64(&bytes[s.offset as usize..(s.offset + s.length) as usize]);
    }
    patch_header(path, |x| *x = h);
}

/// Rewrites a header field with a valid checksum, as a buggy writer would.
pub fn patch_header(path: &Path, f: impl FnOnce(&mut Header)) {
    let mut bytes = std::fs::read(path).unwrap();
    let mut h = Header::parse(path, &bytes, bytes.len() as u64).unwrap();
    f(&mut h);
    // A version patched across 2 -> 3 changes the order records' length.
    h.header_len =
        Header::byte_len(h.version, h.orders.len(), h.sections.len(), h.source.len()) as u32;
    let hb = h.to_bytes();
    bytes[..hb.len()].copy_from_slice(&hb);
    std::fs::write(path, bytes).unwrap();
}
