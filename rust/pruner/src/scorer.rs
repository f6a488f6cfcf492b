//! What the pruner needs from an n-gram model.

use std::sync::Arc;

use crate::error::Result;

/// Conditional probabilities `P(c | context)` under a backoff n-gram model.
///
/// `prob_many` reads the last `order() - 1` tokens of `context` (fewer when it is shorter) and
/// writes one probability per candidate into `probs` (same length as `candidates`).
pub trait NGramScorer: Send + Sync {
    fn order(&self) -> usize;
    fn vocab_size(&self) -> u32;
    fn eos_id(&self) -> Option<u32>;
    fn prob_many(&self, context: &[u32], candidates: &[u32], probs: &mut [f32]) -> Result<()>;
}

macro_rules! forward_scorer {
    ($($ty:ty),*) => {$(
        impl<S: NGramScorer + ?Sized> NGramScorer for $ty {
            #[inline]
            fn order(&self) -> usize {
                (**self).order()
            }
            #[inline]
            fn vocab_size(&self) -> u32 {
                (**self).vocab_size()
            }
            #[inline]
            fn eos_id(&self) -> Option<u32> {
                (**self).eos_id()
            }
            #[inline]
            fn prob_many(&self, context: &[u32], candidates: &[u32], probs: &mut [f32]) -> Result<()> {
                (**self).prob_many(context, candidates, probs)
            }
        }
    )*};
}

forward_scorer!(&S, Arc<S>, Box<S>);

impl NGramScorer for dart_ngram::NGramModel {
    fn order(&self) -> usize {
        dart_ngram::NGramModel::order(self)
    }
    fn vocab_size(&self) -> u32 {
        dart_ngram::NGramModel::vocab_size(self)
    }
    fn eos_id(&self) -> Option<u32> {
        dart_ngram::NGramModel::eos_id(self)
    }
    fn prob_many(&self, context: &[u32], candidates: &[u32], probs: &mut [f32]) -> Result<()> {
        // The pruner has no use for the matched lengths: a stack buffer, in chunks.
        const CHUNK: usize = 256;
        let mut matched = [0u8; CHUNK];
        for (c, p) in candidates.chunks(CHUNK).zip(probs.chunks_mut(CHUNK)) {
            dart_ngram::NGramModel::prob_many(self, context, c, p, &mut matched[..c.len()])?;
        }
        Ok(())
    }
}
