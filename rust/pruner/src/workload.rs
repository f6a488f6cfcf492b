//! Draft-like pruning requests over a real model, for benchmarks (the pruner's criterion
//! bench, `dart-ngram bench`): contexts are random walks over the model's own best
//! continuations, and each level's top-k row holds the walk's true next token near the top (a
//! decaying share of the time), the model's best continuations and Zipfian filler, with
//! softmaxed decaying logits as probabilities.

use dart_ngram::NGramModel;

pub use crate::OwnedRequest;

/// splitmix64: a small deterministic generator (benchmarks need repeatable inputs, not
/// statistical quality).
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Zipf's law over `0..n` (rank `i + 1` has weight `1 / (i + 1)^s`), by inverse CDF.
#[derive(Clone, Debug)]
pub struct Zipf(Vec<f64>);

impl Zipf {
    pub fn new(n: u32, s: f64) -> Zipf {
        let mut acc = 0.0;
        Zipf(
            (1..=n)
                .map(|r| {
                    acc += (r as f64).powf(-s);
                    acc
                })
                .collect(),
        )
    }

    pub fn sample(&self, rng: &mut Rng) -> u32 {
        let u = rng.unit() * self.0.last().copied().unwrap_or(0.0);
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1) as u32
    }
}

/// `n` token sequences of `len` tokens sampled from the model: each next token is one of the
/// 8 best continuations of the sequence so far (of its last token alone when the pair is
/// unseen).
pub fn walk_documents(model: &NGramModel, n: usize, len: usize, rng: &mut Rng) -> Vec<Vec<u32>> {
    let vocab = u64::from(model.vocab_size());
    let mut docs = vec![];
    let mut tries = 0usize;
    while docs.len() < n && tries < 100 * n.max(1) {
        tries += 1;
        let mut doc = vec![rng.below(vocab) as u32];
        while doc.len() < len {
            let mut next = model.top_k(&doc, 8).unwrap_or_default();
            if next.is_empty() {
                next = model.top_k(&doc[doc.len() - 1..], 8).unwrap_or_default();
            }
            match next.len() {
                0 => break,
                k => doc.push(next[rng.below(k as u64) as usize].0),
            }
        }
        if doc.len() == len {
            docs.push(doc);
        }
    }
    docs
}

/// `n` requests of `levels` rows of `k` candidates, at random positions of `docs` (each doc
/// needs at least `16 + levels + 1` tokens; 16 tokens of context).
pub fn draft_requests(
    model: &NGramModel,
    docs: &[Vec<u32>],
    n: usize,
    levels: usize,
    k: usize,
    rng: &mut Rng,
) -> Vec<OwnedRequest> {
    let vocab = model.vocab_size();
    let zipf = Zipf::new(vocab, 1.1);
    let usable: Vec<&Vec<u32>> = docs.iter().filter(|d| d.len() > 16 + levels).collect();
    let mut out = vec![];
    if usable.is_empty() || (vocab as usize) < k {
        return out;
    }
    while out.len() < n {
        let doc = usable[rng.below(usable.len() as u64) as usize];
        let pos = 15 + rng.below((doc.len() - 16 - levels) as u64) as usize;
        let context = doc[pos - 15..=pos].to_vec();
        let mut ids = Vec::with_capacity(levels * k);
        let mut probs = Vec::with_capacity(levels * k);
        for l in 0..levels {
            let truth = doc[pos + 1 + l] % vocab;
            let mut row: Vec<u32> = vec![];
            let push = |t: u32, row: &mut Vec<u32>| {
                if row.len() < k && !row.contains(&t) {
                    row.push(t);
                }
            };
            // The draft is right at the top a decaying share of the time.
            if rng.unit() < 0.8 / (l as f64 + 1.0).sqrt() {
                push(truth, &mut row);
            }
            let mut ctx = context.clone();
            ctx.extend(&doc[pos + 1..pos + 1 + l]);
            for (t, _) in model.top_k(&ctx, 10).unwrap_or_default() {
                push(t, &mut row);
            }
            push(truth, &mut row);
            while row.len() < k {
                push(zipf.sample(rng), &mut row);
            }
            // Softmax over decaying logits with noise.
            let logits: Vec<f64> = (0..k).map(|j| -0.35 * j as f64 + rng.unit()).collect();
            let z: f64 = logits.iter().map(|x| x.exp()).sum();
            ids.extend(row);
            probs.extend(logits.iter().map(|x| (x.exp() / z) as f32));
        }
        out.push(OwnedRequest {
            context,
            topk_ids: ids,
            topk_probs: probs,
            levels,
            k,
            ..OwnedRequest::default()
        });
    }
    out
}
