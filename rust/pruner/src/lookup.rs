//! Prompt lookup: a continuation proposed from the context itself.
//!
//! Text often repeats its own context (code restating a signature, an answer quoting its
//! question, a summary reusing the document's phrases). [`PromptLookup`] finds the latest
//! earlier occurrence of the context's last `n` tokens (the longest `n` from `max_ngram` down
//! to `min_ngram` that occurs) and proposes the tokens that followed it, as transformers'
//! prompt lookup decoding does. DART merges that path into its draft tree
//! ([`crate::DraftRequest::lookup_path`]), so the tree covers both what the head predicts and
//! what the context repeats.
//!
//! The index is incremental: [`PromptLookup::extend`] costs `O(new tokens x n-gram sizes)` and
//! [`PromptLookup::propose`] `O(n-gram sizes + proposed tokens)`, whatever the context's length.

use std::collections::HashMap;

use crate::error::{PrunerError, Result};

/// The longest n-gram a key packs (4 tokens of 32 bits in a `u128`).
pub const MAX_NGRAM: usize = 4;

/// An incremental prompt-lookup index over one sequence.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    tokens: Vec<u32>,
    min_ngram: usize,
    max_ngram: usize,
    /// `latest[n - min_ngram]`: per n-gram, the exclusive end of its latest occurrence that
    /// some token follows (end <= len - 1), i.e. every occurrence but a suffix of the context.
    latest: Vec<HashMap<u128, u32>>,
}

fn key(gram: &[u32]) -> u128 {
    gram.iter().fold(0u128, |k, &t| k << 32 | u128::from(t))
}

impl PromptLookup {
    /// An empty index matching suffixes of `min_ngram..=max_ngram` tokens (1 <= min <= max <=
    /// [`MAX_NGRAM`]).
    pub fn new(min_ngram: usize, max_ngram: usize) -> Result<Self> {
        if !(1 <= min_ngram && min_ngram <= max_ngram && max_ngram <= MAX_NGRAM) {
            return Err(PrunerError::InvalidConfig(format!(
                "prompt lookup n-gram sizes {min_ngram}..={max_ngram}: expected 1 <= min <= max \
                 <= {MAX_NGRAM}"
            )));
        }
        Ok(PromptLookup {
            tokens: Vec::new(),
            min_ngram,
            max_ngram,
            latest: vec![HashMap::new(); max_ngram - min_ngram + 1],
        })
    }

    pub fn min_ngram(&self) -> usize {
        self.min_ngram
    }

    pub fn max_ngram(&self) -> usize {
        self.max_ngram
    }

    /// Tokens indexed so far.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Forgets every token (the allocations are kept for the next sequence).
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.latest.iter_mut().for_each(HashMap::clear);
    }

    /// Appends tokens to the sequence.
    pub fn extend(&mut self, tokens: &[u32]) {
        let old = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        // Ends old..=len-1 become followed by a token (end `old` by the first new one).
        let last = self.tokens.len().saturating_sub(1);
        for end in old.max(1)..=last {
            for (i, map) in self.latest.iter_mut().enumerate() {
                let n = self.min_ngram + i;
                if end >= n {
                    map.insert(key(&self.tokens[end - n..end]), end as u32);
                }
            }
        }
    }

    /// The tokens that followed the latest earlier occurrence of the longest matching suffix
    /// (`max_ngram` tokens down to `min_ngram`), at most `max_tokens` of them; empty when no
    /// suffix occurs earlier. The continuation may run into the suffix itself (a repeating
    /// pattern continues).
    pub fn propose(&self, max_tokens: usize) -> &[u32] {
        let len = self.tokens.len();
        if max_tokens == 0 {
            return &[];
        }
        for n in (self.min_ngram..=self.max_ngram).rev() {
            if len < n {
                continue;
            }
            if let Some(&end) = self.latest[n - self.min_ngram].get(&key(&self.tokens[len - n..])) {
                let end = end as usize;
                return &self.tokens[end..len.min(end + max_tokens)];
            }
        }
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition, searched backwards from scratch.
    fn brute_force(tokens: &[u32], min: usize, max: usize, m: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min..=max).rev() {
            if len < n {
                continue;
            }
            let suffix = &tokens[len - n..];
            for end in (n..len).rev() {
                if &tokens[end - n..end] == suffix {
                    return tokens[end..len.min(end + m)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn proposes_what_followed_the_latest_match() {
        let mut lookup = PromptLookup::new(1, 3).unwrap();
        lookup.extend(&[1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]);
        // "1 2 3" occurred twice before the suffix; the latest was followed by 5 6 1 2 3.
        assert_eq!(lookup.propose(3), &[5, 6, 1]);
        assert_eq!(lookup.propose(10), &[5, 6, 1, 2, 3]);
        assert_eq!(lookup.propose(0), &[] as &[u32]);
        lookup.extend(&[7]);
        assert_eq!(lookup.propose(4), &[] as &[u32]);
        lookup.extend(&[1]);
        // Only "1" matches now (no earlier "7 1").
        assert_eq!(lookup.propose(2), &[2, 3]);
    }

    #[test]
    fn a_repeating_pattern_continues_into_the_suffix() {
        let mut lookup = PromptLookup::new(2, 2).unwrap();
        lookup.extend(&[4, 4, 4]);
        assert_eq!(lookup.propose(5), &[4]);
    }

    #[test]
    fn rejects_bad_sizes() {
        for (min, max) in [(0, 2), (3, 2), (1, 5)] {
            assert!(PromptLookup::new(min, max).is_err());
        }
    }

    proptest! {
        #[test]
        fn matches_the_definition(
            chunks in prop::collection::vec(prop::collection::vec(0u32..6, 0..8), 1..8),
            min in 1usize..=4,
            extra in 0usize..=3,
            m in 0usize..10,
        ) {
            let max = (min + extra).min(MAX_NGRAM);
            let mut lookup = PromptLookup::new(min, max).unwrap();
            let mut all = Vec::new();
            for chunk in &chunks {
                lookup.extend(chunk);
                all.extend_from_slice(chunk);
                let want = brute_force(&all, min, max, m);
                prop_assert_eq!(lookup.propose(m), want.as_slice());
            }
            lookup.clear();
            prop_assert!(lookup.is_empty());
            prop_assert_eq!(lookup.propose(m), &[] as &[u32]);
        }
    }
}
