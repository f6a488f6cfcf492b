//! The reference implementation's `.trie` format (DESIGN.md section 3), for tests.
//!
//! Little-endian, packed: `u64 order, u64 node_count`, then per node
//! `{i32 token, u64 parent, i32 freq, u64 n_children, n_children x {i32 child_token,
//! u64 child_id}}`. Node 0 is the root (freq = total tokens); a node's id is its index in the
//! file; the depth-d nodes are the d-grams. This module writes such files from counts (so
//! tests can make small reference files, with node ids and child lists in any order) and
//! reads them naively into memory, as an oracle to compare imports against. The importer
//! itself ([`crate::import`]) streams and never holds a file in memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use dart_ngram::error::{NGramError, Result};
use dart_ngram::key;
use dart_ngram::model::NGramModel;

/// Bytes of a node without its children.
pub const NODE_HEAD_BYTES: u64 = 4 + 8 + 4 + 8;
/// Bytes of one child entry.
pub const CHILD_BYTES: u64 = 4 + 8;
/// Token written for the root (the reference's root carries no token).
pub const ROOT_TOKEN: i32 = -1;

/// One node as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefNode {
    pub token: i32,
    pub parent: u64,
    pub freq: i32,
    pub children: Vec<(i32, u64)>,
}

/// Writes nodes exactly as given (no checks), so tests can also write corrupt files.
pub fn write_nodes(path: &Path, order: u64, nodes: &[RefNode]) -> Result<()> {
    let io = |e| NGramError::io(path, e);
    let mut w = BufWriter::new(File::create(path).map_err(io)?);
    w.write_all(&order.to_le_bytes()).map_err(io)?;
    w.write_all(&(nodes.len() as u64).to_le_bytes())
        .map_err(io)?;
    for n in nodes {
        w.write_all(&n.token.to_le_bytes()).map_err(io)?;
        w.write_all(&n.parent.to_le_bytes()).map_err(io)?;
        w.write_all(&n.freq.to_le_bytes()).map_err(io)?;
        w.write_all(&(n.children.len() as u64).to_le_bytes())
            .map_err(io)?;
        for &(t, id) in &n.children {
            w.write_all(&t.to_le_bytes()).map_err(io)?;
            w.write_all(&id.to_le_bytes()).map_err(io)?;
        }
    }
    w.flush().map_err(io)
}

/// A small deterministic generator for shuffling (tests must not depend on `rand`).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// Lays out the trie of `counts` (every n-gram of orders `1..=order` with its count; the set
/// must be prefix-closed) as reference nodes. Ids follow breadth-first order, or a random
/// order (root kept at 0; children lists shuffled too) when `shuffle_seed` is given.
/// Counts above `i32::MAX` are refused: the reference format cannot hold them.
pub fn nodes_from_counts(
    order: u64,
    total_tokens: u64,
    counts: &BTreeMap<Vec<u32>, u64>,
    shuffle_seed: Option<u64>,
) -> Result<Vec<RefNode>> {
    let freq = |what: &str, c: u64| -> Result<i32> {
        i32::try_from(c).map_err(|_| {
            NGramError::InvalidArgument(format!(
                "{what} has count {c}; the reference format stores counts as i32 (at most {})",
                i32::MAX
            ))
        })
    };
    // Breadth-first: all 1-grams, then all 2-grams, ...; BTreeMap order within a depth.
    let mut by_depth: Vec<Vec<(&Vec<u32>, u64)>> = vec![Vec::new(); order as usize];
    for (ngram, &c) in counts {
        let d = ngram.len();
        if d == 0 || d > order as usize {
            return Err(NGramError::InvalidArgument(format!(
                "n-gram {ngram:?} has {d} tokens; expected 1..={order}"
            )));
        }
        if d > 1 && !counts.contains_key(&ngram[..d - 1]) {
            return Err(NGramError::InvalidArgument(format!(
                "n-gram {ngram:?} has no prefix {:?}; expected a prefix-closed set",
                &ngram[..d - 1]
            )));
        }
        by_depth[d - 1].push((ngram, c));
    }
    let mut ngrams: Vec<(&Vec<u32>, u64)> = by_depth.into_iter().flatten().collect();
    let mut rng = shuffle_seed.map(SplitMix);
    if let Some(rng) = rng.as_mut() {
        rng.shuffle(&mut ngrams);
    }
    let mut id_of: BTreeMap<&[u32], u64> = BTreeMap::new();
    for (i, (ngram, _)) in ngrams.iter().enumerate() {
        id_of.insert(ngram.as_slice(), i as u64 + 1);
    }
    let mut nodes = Vec::with_capacity(ngrams.len() + 1);
    nodes.push(RefNode {
        token: ROOT_TOKEN,
        parent: 0,
        freq: freq("the root (total tokens)", total_tokens)?,
        children: Vec::new(),
    });
    for (ngram, c) in &ngrams {
        let parent = if ngram.len() == 1 {
            0
        } else {
            id_of[&ngram[..ngram.len() - 1]]
        };
        nodes.push(RefNode {
            token: *ngram.last().unwrap_or(&0) as i32,
            parent,
            freq: freq(&format!("n-gram {ngram:?}"), *c)?,
            children: Vec::new(),
        });
    }
    for id in 1..nodes.len() {
        let (p, t) = (nodes[id].parent as usize, nodes[id].token);
        nodes[p].children.push((t, id as u64));
    }
    if let Some(rng) = rng.as_mut() {
        for n in &mut nodes {
            rng.shuffle(&mut n.children);
        }
    }
    Ok(nodes)
}

/// Writes a reference `.trie` file holding `counts` (see [`nodes_from_counts`]).
pub fn write_reference_trie(
    path: &Path,
    order: u64,
    total_tokens: u64,
    counts: &BTreeMap<Vec<u32>, u64>,
    shuffle_seed: Option<u64>,
) -> Result<()> {
    let nodes = nodes_from_counts(order, total_tokens, counts, shuffle_seed)?;
    write_nodes(path, order, &nodes)
}

/// Writes `model` as a reference `.trie`, streaming: it holds one node's child list at a
/// time, never the trie, so it can write files far larger than memory (import benchmarks).
/// Nodes go breadth first (the root, then the 1-grams, 2-grams, ... each order in key order),
/// so a node's children are the next order's consecutive keys that extend it and their ids
/// are consecutive. Returns the number of nodes written. Counts above `i32::MAX` and
/// n-grams whose prefix the model lacks are refused: the reference format cannot hold them
/// (and the partial file is removed).
pub fn write_reference_trie_from_model(path: &Path, model: &NGramModel) -> Result<u64> {
    let written = stream_model_as_trie(path, model);
    if written.is_err() {
        let _ = std::fs::remove_file(path);
    }
    written
}

fn stream_model_as_trie(path: &Path, model: &NGramModel) -> Result<u64> {
    let io = |e| NGramError::io(path, e);
    let order = model.order();
    let bits = key::token_bits(model.vocab_size());
    let freq = |n: usize, k: u64, c: u64| -> Result<i32> {
        i32::try_from(c).map_err(|_| {
            NGramError::InvalidArgument(format!(
                "n-gram {:?} of {} has count {c}; the reference format stores counts as i32 \
                 (at most {})",
                key::unpack(k, n, bits),
                model.path().display(),
                i32::MAX
            ))
        })
    };
    let root_freq = i32::try_from(model.total_tokens()).map_err(|_| {
        NGramError::InvalidArgument(format!(
            "{} counts {} tokens; the reference format stores counts as i32 (at most {})",
            model.path().display(),
            model.total_tokens(),
            i32::MAX
        ))
    })?;
    // Nodes per order: order 1 lists only the tokens that were seen.
    let mut per_order = model.ngrams_per_order();
    per_order[0] = model.iter_order(1).count() as u64;
    let mut first_id = vec![1u64; order + 2];
    for n in 1..=order {
        first_id[n + 1] = first_id[n] + per_order[n - 1];
    }
    let nodes = first_id[order + 1];
    let mut w = BufWriter::new(File::create(path).map_err(io)?);
    let mut put = |bytes: &[u8]| w.write_all(bytes).map_err(io);
    put(&(order as u64).to_le_bytes())?;
    put(&nodes.to_le_bytes())?;
    put(&ROOT_TOKEN.to_le_bytes())?;
    put(&0u64.to_le_bytes())?;
    put(&root_freq.to_le_bytes())?;
    put(&per_order[0].to_le_bytes())?;
    for (i, g) in model.iter_order(1).enumerate() {
        put(&(g?.0 as i32).to_le_bytes())?;
        put(&(first_id[1] + i as u64).to_le_bytes())?;
    }
    let orphan = |n: usize, k: u64| {
        NGramError::InvalidArgument(format!(
            "{} holds the n-gram {:?} but not its prefix; a reference trie cannot hold it",
            model.path().display(),
            key::unpack(k, n, bits)
        ))
    };
    let mut children: Vec<(i32, u64)> = Vec::new();
    for n in 1..=order {
        // Cursors over the parents' order (with their ids) and the children's.
        let mut parents = (n > 1).then(|| model.iter_order(n - 1).zip(first_id[n - 1]..));
        let mut parent: Option<(u64, u64)> = None;
        let mut kids = (n < order).then(|| model.iter_order(n + 1).zip(first_id[n + 1]..));
        let mut next_kid: Option<(u64, u64)> = None;
        let mut written = 0u64;
        for g in model.iter_order(n) {
            let (k, c) = g?;
            written += 1;
            let parent_id = match parents.as_mut() {
                None => 0,
                Some(ps) => loop {
                    if let Some((pk, id)) = parent.filter(|&(pk, _)| pk >= key::prefix(k, bits)) {
                        if pk != key::prefix(k, bits) {
                            return Err(orphan(n, k));
                        }
                        break id;
                    }
                    match ps.next() {
                        Some((p, id)) => parent = Some((p?.0, id)),
                        None => return Err(orphan(n, k)),
                    }
                },
            };
            children.clear();
            if let Some(ks) = kids.as_mut() {
                loop {
                    if next_kid.is_none() {
                        next_kid = match ks.next() {
                            Some((g, id)) => Some((g?.0, id)),
                            None => None,
                        };
                    }
                    let Some((ck, id)) = next_kid else { break };
                    let p = key::prefix(ck, bits);
                    if p < k {
                        return Err(orphan(n + 1, ck));
                    }
                    if p > k {
                        break;
                    }
                    children.push((key::token_at(ck, n + 1, n, bits) as i32, id));
                    next_kid = None;
                }
            }
            put(&(key::token_at(k, n, n - 1, bits) as i32).to_le_bytes())?;
            put(&parent_id.to_le_bytes())?;
            put(&freq(n, k, c)?.to_le_bytes())?;
            put(&(children.len() as u64).to_le_bytes())?;
            for &(t, id) in &children {
                put(&t.to_le_bytes())?;
                put(&id.to_le_bytes())?;
            }
        }
        if let Some((ck, _)) = next_kid {
            return Err(orphan(n + 1, ck));
        }
        if let Some(Some((g, _))) = kids.as_mut().map(|ks| ks.next()) {
            return Err(orphan(n + 1, g?.0));
        }
        if written != per_order[n - 1] {
            return Err(NGramError::Corrupt {
                path: model.path().to_path_buf(),
                detail: format!(
                    "order {n} lists {written} n-grams but its header says {}",
                    per_order[n - 1]
                ),
            });
        }
    }
    w.flush().map_err(io)?;
    Ok(nodes)
}

/// Counts every k-gram (k = 1..=order) inside each document, as the reference does; returns
/// the counts and the total number of tokens. Documents are taken as given (EOS included).
pub fn count_documents(docs: &[Vec<u32>], order: usize) -> (BTreeMap<Vec<u32>, u64>, u64) {
    let mut counts = BTreeMap::new();
    let mut total = 0u64;
    for doc in docs {
        total += doc.len() as u64;
        for i in 0..doc.len() {
            for n in 1..=order.min(doc.len() - i) {
                *counts.entry(doc[i..i + n].to_vec()).or_insert(0) += 1;
            }
        }
    }
    (counts, total)
}

/// Brute-force `P(candidate | context)` over a map of counts, with the reference's
/// semantics (DESIGN.md section 3): the longest context (at most `order - 1` tokens) such that
/// context + candidate was counted wins; `(0, 0)` if none.
pub fn prob_from_counts(
    counts: &BTreeMap<Vec<u32>, u64>,
    order: usize,
    context: &[u32],
    candidate: u32,
) -> (f64, u8) {
    let max_ctx = order.saturating_sub(1).min(context.len());
    for len in (1..=max_ctx).rev() {
        let ctx = &context[context.len() - len..];
        let mut full = ctx.to_vec();
        full.push(candidate);
        if let (Some(&c), Some(&num)) = (counts.get(ctx), counts.get(&full)) {
            return (num as f64 / c as f64, len as u8);
        }
    }
    (0.0, 0)
}

/// A reference file read whole into memory (small files only: tests' oracle).
#[derive(Clone, Debug)]
pub struct RefTrie {
    pub order: u64,
    pub nodes: Vec<RefNode>,
}

impl RefTrie {
    /// Reads a file naively (no validation beyond what parsing needs).
    pub fn read(path: &Path) -> Result<RefTrie> {
        let mut bytes = Vec::new();
        File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| NGramError::io(path, e))?;
        let mut pos = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let s = bytes.get(pos..pos + n).ok_or_else(|| NGramError::Corrupt {
                path: path.to_path_buf(),
                detail: format!("truncated at byte {pos}"),
            })?;
            pos += n;
            Ok(s)
        };
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let i32_at = |b: &[u8]| i32::from_le_bytes(b.try_into().expect("4 bytes"));
        let order = u64_at(take(8)?);
        let count = u64_at(take(8)?);
        let mut nodes = Vec::new();
        for _ in 0..count {
            let token = i32_at(take(4)?);
            let parent = u64_at(take(8)?);
            let freq = i32_at(take(4)?);
            let n = u64_at(take(8)?);
            let mut children = Vec::new();
            for _ in 0..n {
                children.push((i32_at(take(4)?), u64_at(take(8)?)));
            }
            nodes.push(RefNode {
                token,
                parent,
                freq,
                children,
            });
        }
        Ok(RefTrie { order, nodes })
    }

    /// The reference's lookup: walk child lists from the root. `None` if not in the trie.
    pub fn count(&self, ngram: &[u32]) -> Option<u64> {
        let mut node = self.nodes.first()?;
        for &t in ngram {
            let &(_, id) = node.children.iter().find(|&&(ct, _)| ct == t as i32)?;
            node = self.nodes.get(id as usize)?;
        }
        Some(node.freq as u64)
    }

    /// The reference's probability of `candidate` after `context` (DESIGN.md section 3):
    /// longest context (at most `order - 1` tokens) such that context + candidate is in the
    /// trie; `(0, 0)` if none.
    pub fn prob(&self, context: &[u32], candidate: u32) -> (f64, u8) {
        let max_ctx = (self.order as usize).saturating_sub(1).min(context.len());
        for len in (1..=max_ctx).rev() {
            let ctx = &context[context.len() - len..];
            let mut full = ctx.to_vec();
            full.push(candidate);
            if let (Some(c), Some(num)) = (self.count(ctx), self.count(&full)) {
                return (num as f64 / c as f64, len as u8);
            }
        }
        (0.0, 0)
    }

    /// Every n-gram in the trie with its count (depth-first walk).
    pub fn all_ngrams(&self) -> BTreeMap<Vec<u32>, u64> {
        let mut out = BTreeMap::new();
        let mut stack: Vec<(u64, Vec<u32>)> = vec![(0, Vec::new())];
        while let Some((id, path)) = stack.pop() {
            for &(t, child) in &self.nodes[id as usize].children {
                let mut p = path.clone();
                p.push(t as u32);
                out.insert(p.clone(), self.nodes[child as usize].freq as u64);
                stack.push((child, p));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_round_trip_any_layout() {
        let docs = vec![vec![1, 2, 3, 1, 2, 9], vec![2, 3], vec![7]];
        let (counts, total) = count_documents(&docs, 3);
        assert_eq!(total, 9);
        assert_eq!(counts[&vec![1, 2]], 2);
        assert_eq!(counts[&vec![2, 3]], 2);
        assert!(
            !counts.contains_key(&vec![9, 2]),
            "nothing spans two documents"
        );
        let dir = tempfile::tempdir().unwrap();
        for seed in [None, Some(1), Some(2)] {
            let p = dir.path().join("t.trie");
            write_reference_trie(&p, 3, total, &counts, seed).unwrap();
            let trie = RefTrie::read(&p).unwrap();
            assert_eq!(trie.nodes[0].freq, 9);
            assert_eq!(trie.all_ngrams(), counts);
            assert_eq!(trie.count(&[1, 2, 3]), Some(1));
            assert_eq!(trie.prob(&[1, 2], 3), (0.5, 2));
            assert_eq!(trie.prob(&[5, 2], 3), (2.0 / 3.0, 1));
            assert_eq!(trie.prob(&[5, 5], 3), (0.0, 0));
            let bytes = std::fs::metadata(&p).unwrap().len();
            let nodes = counts.len() as u64 + 1;
            assert_eq!(
                bytes,
                16 + nodes * NODE_HEAD_BYTES + (nodes - 1) * CHILD_BYTES
            );
        }
    }

    #[test]
    fn refuses_what_the_format_cannot_hold() {
        let mut counts = BTreeMap::new();
        counts.insert(vec![1], 1u64 << 31);
        assert!(nodes_from_counts(2, 1 << 31, &counts, None).is_err());
        let mut counts = BTreeMap::new();
        counts.insert(vec![1, 2], 1u64);
        let err = nodes_from_counts(2, 1, &counts, None).unwrap_err();
        assert!(err.to_string().contains("prefix"), "{err}");
    }
}
