//! The beam search itself, over an arena of nodes linked by parent pointers.
//!
//! Nothing is allocated per candidate: a path is its arena node (token + parent index), the
//! n-gram context of a beam path is rebuilt from at most `order - 1` parent hops into a reused
//! buffer, and all buffers live in a per-thread scratch that survives between calls.

use std::cell::RefCell;
use std::cmp::Ordering;

use crate::config::PrunerConfig;
use crate::error::{PrunerError, Result};
use crate::scorer::NGramScorer;
use crate::tree::DraftTree;

/// Validated inputs of one search.
pub(crate) struct Search<'a> {
    pub context: &'a [u32],
    pub ids: &'a [u32],
    pub probs: &'a [f32],
    pub levels: usize,
    pub k: usize,
    pub budget: usize,
    pub eos: Option<u32>,
    /// At most `budget` tokens.
    pub lookup_path: &'a [u32],
}

#[derive(Clone, Copy, Debug)]
struct Node {
    score: f64,
    parent: u32,
    token: u32,
    depth: u32,
}

#[derive(Default)]
struct Scratch {
    arena: Vec<Node>,
    beam: Vec<u32>,
    /// Every scored node (the candidates for the tree).
    pool: Vec<Ranked>,
    /// This level's nodes, EOS-ending ones apart (they rank last in the beam).
    level: Vec<Ranked>,
    level_eos: Vec<Ranked>,
    ties: Vec<Ranked>,
    row_terms: Vec<f64>,
    /// This level's distinct n-gram contexts (flattened) and their rows of probabilities:
    /// beam paths often end in the same tokens, and then one lookup serves them all.
    ngram_contexts: Vec<u32>,
    ngram_probs: Vec<f32>,
    ngram_context: Vec<u32>,
    out_index: Vec<u32>,
    /// Per lookup-path token: its rank among the kept nodes (u32::MAX if not kept).
    lookup_ranks: Vec<u32>,
}

impl Scratch {
    /// Bytes held by the buffers (their capacity).
    fn bytes(&self) -> usize {
        use std::mem::size_of;
        self.arena.capacity() * size_of::<Node>()
            + (self.pool.capacity()
                + self.level.capacity()
                + self.level_eos.capacity()
                + self.ties.capacity())
                * size_of::<Ranked>()
            + self.row_terms.capacity() * size_of::<f64>()
            + (self.beam.capacity()
                + self.ngram_contexts.capacity()
                + self.ngram_context.capacity()
                + self.out_index.capacity()
                + self.lookup_ranks.capacity())
                * size_of::<u32>()
            + self.ngram_probs.capacity() * size_of::<f32>()
    }
}

/// Scratch a thread keeps between calls; a larger one (left by an unusually large request) is
/// freed after the call, so a burst of large requests does not stay resident in every thread.
pub(crate) const SCRATCH_KEEP_BYTES: usize = 4 << 20;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Bytes of scratch the calling thread holds.
pub(crate) fn scratch_bytes() -> usize {
    SCRATCH.with(|cell| cell.try_borrow().map_or(0, |s| s.bytes()))
}

/// Token ids of two equal-depth paths compared root to leaf.
fn cmp_paths(arena: &[Node], mut a: u32, mut b: u32) -> Ordering {
    let mut order = Ordering::Equal;
    // Walking up, the difference closest to the root is the one that decides.
    while a != b {
        let (na, nb) = (&arena[a as usize], &arena[b as usize]);
        let c = na.token.cmp(&nb.token);
        if c != Ordering::Equal {
            order = c;
        }
        a = na.parent;
        b = nb.parent;
    }
    order
}

/// Maps a score to a `u64` whose ascending order is the score's descending order.
#[inline]
fn desc_key(score: f64) -> u64 {
    // + 0.0 turns -0.0 into 0.0: equal scores must get equal keys.
    let bits = (score + 0.0).to_bits();
    let asc = if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    };
    !asc
}

/// A candidate for selection: its score as an integer key (smaller is better) and its node.
#[derive(Clone, Copy)]
struct Ranked {
    key: u64,
    node: u32,
}

/// Keeps the `n` best of `items`: score descending, then depth ascending, then path
/// ascending. Integer keys do almost all the work; depths and paths are compared only among
/// the items whose score ties with the `n`-th best, so the result is exactly the first `n`
/// under the full order.
fn keep_best(arena: &[Node], items: &mut Vec<Ranked>, n: usize, ties: &mut Vec<Ranked>) {
    if items.len() <= n {
        return;
    }
    if n == 0 {
        items.clear();
        return;
    }
    let cut = items.select_nth_unstable_by_key(n - 1, |r| r.key).1.key;
    // Everything strictly better than the n-th item is kept; the items tied with it (on
    // either side of it after the partial sort) compete for the remaining places.
    ties.clear();
    let mut kept = 0;
    for i in 0..items.len() {
        let r = items[i];
        if r.key < cut {
            items[kept] = r; // kept <= i: never overwrites an unread item
            kept += 1;
        } else if r.key == cut {
            ties.push(r);
        }
    }
    let places = n - kept;
    if ties.len() > places {
        ties.sort_unstable_by(|a, b| {
            let (na, nb) = (&arena[a.node as usize], &arena[b.node as usize]);
            na.depth
                .cmp(&nb.depth)
                .then_with(|| cmp_paths(arena, a.node, b.node))
        });
        ties.truncate(places);
    }
    items.truncate(kept);
    items.extend_from_slice(ties);
}

/// Output order: depth ascending, then score descending, then path ascending.
fn output_order(arena: &[Node], a: u32, b: u32) -> Ordering {
    let (na, nb) = (&arena[a as usize], &arena[b as usize]);
    na.depth
        .cmp(&nb.depth)
        .then_with(|| nb.score.total_cmp(&na.score))
        .then_with(|| cmp_paths(arena, a, b))
}

pub(crate) fn run<S: NGramScorer + ?Sized>(
    scorer: &S,
    config: &PrunerConfig,
    search: &Search<'_>,
) -> Result<DraftTree> {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => {
            let result = run_with(scorer, config, search, &mut scratch);
            if scratch.bytes() > SCRATCH_KEEP_BYTES {
                *scratch = Scratch::default();
            }
            result
        }
        // Only reachable if a scorer re-enters the pruner on this thread.
        Err(_) => run_with(scorer, config, search, &mut Scratch::default()),
    })
}

fn run_with<S: NGramScorer + ?Sized>(
    scorer: &S,
    config: &PrunerConfig,
    search: &Search<'_>,
    scratch: &mut Scratch,
) -> Result<DraftTree> {
    let Scratch {
        arena,
        beam,
        pool,
        level,
        level_eos,
        ties,
        row_terms,
        ngram_contexts,
        ngram_probs,
        ngram_context,
        out_index,
        lookup_ranks,
    } = scratch;
    let &Search {
        context,
        ids,
        probs,
        levels,
        k,
        budget,
        eos,
        lookup_path,
    } = search;
    let root_token = *context.last().expect("context checked non-empty");
    let eps = config.eps;
    let w_ngram = config.ngram_weight;
    let history = scorer.order().saturating_sub(1);
    // ln(q + eps) for the two most common n-gram probabilities, computed once.
    let ln_q0 = eps.ln();
    let ln_q1 = (1.0 + eps).ln();

    arena.clear();
    arena.push(Node {
        score: 0.0,
        parent: u32::MAX,
        token: root_token,
        depth: 0,
    });
    beam.clear();
    beam.push(0);
    pool.clear();
    row_terms.resize(k, 0.0);
    // Paths the full-width beam would hold at this level (the root's: one).
    let mut full_beam = 1usize;

    for level_index in 0..levels {
        let w_level = config.level_weight(level_index);
        let w_logit = config.logit_weight(level_index);
        if !(w_level.is_finite() && w_logit.is_finite()) {
            return Err(PrunerError::InvalidConfig(format!(
                "level {level_index}: level weight (level+1)^-level_exponent = {w_level} and logit \
                 weight logit_decay^level = {w_logit} must be finite (level_exponent = {}, \
                 logit_decay = {})",
                config.level_exponent, config.logit_decay
            )));
        }
        let row_ids = &ids[level_index * k..(level_index + 1) * k];
        let row_probs = &probs[level_index * k..(level_index + 1) * k];
        // The draft term does not depend on the beam path: once per row.
        for (term, &p) in row_terms.iter_mut().zip(row_probs) {
            *term = w_logit * (f64::from(p) + eps).ln();
        }
        let use_ngram = w_ngram != 0.0 && (level_index > 0 || config.ngram_at_level0);
        let depth = level_index as u32 + 1;
        level.clear();
        level_eos.clear();
        ngram_contexts.clear();
        ngram_probs.clear();
        for &b in beam.iter() {
            // Offset of this path's n-gram probabilities for the row in `ngram_probs`.
            let mut at = 0;
            if use_ngram {
                fill_ngram_context(arena, context, b, history, ngram_context);
                // Paths of one level have equally long contexts.
                let width = ngram_context.len();
                let seen = if width == 0 {
                    (!ngram_probs.is_empty()).then_some(0)
                } else {
                    ngram_contexts
                        .chunks_exact(width)
                        .position(|c| c == ngram_context.as_slice())
                };
                at = match seen {
                    Some(i) => i * k,
                    None => {
                        let at = ngram_probs.len();
                        ngram_contexts.extend_from_slice(ngram_context);
                        ngram_probs.resize(at + k, 0.0);
                        scorer.prob_many(ngram_context, row_ids, &mut ngram_probs[at..])?;
                        at
                    }
                };
            }
            let parent_score = arena[b as usize].score;
            for j in 0..k {
                let inner = if use_ngram {
                    let q = ngram_probs[at + j];
                    let ln_q = if q == 0.0 {
                        ln_q0
                    } else if q == 1.0 {
                        ln_q1
                    } else {
                        (f64::from(q) + eps).ln()
                    };
                    row_terms[j] + w_ngram * ln_q
                } else {
                    row_terms[j]
                };
                let delta = w_level * inner;
                if delta.is_nan() {
                    return Err(PrunerError::NonFiniteScore {
                        level: level_index,
                        token: row_ids[j],
                        level_exponent: config.level_exponent,
                        logit_decay: config.logit_decay,
                        ngram_weight: config.ngram_weight,
                    });
                }
                // ln(p + eps) exceeds 0 (by at most eps) only when p == 1; clamping keeps
                // scores non-increasing from parent to child, hence the tree prefix-closed.
                let delta = if delta > 0.0 { 0.0 } else { delta };
                let token = row_ids[j];
                let score = parent_score + delta;
                let is_eos = Some(token) == eos;
                let ranked = Ranked {
                    key: desc_key(score),
                    node: arena.len() as u32,
                };
                arena.push(Node {
                    score,
                    parent: b,
                    token,
                    depth,
                });
                pool.push(ranked);
                if is_eos {
                    level_eos.push(ranked);
                } else {
                    level.push(ranked);
                }
            }
        }
        if level_index + 1 < levels {
            // Beam rank: non-EOS paths first, then score descending, then path ascending.
            // Expanding a path pays only if a child of it is kept, and then so are the path
            // (its `depth` nodes: scores never increase along a path), the child, and every
            // path of its kind ranked above it at its level (none scores lower): so
            // only the `budget - depth` best paths of each kind can be worth expanding. The
            // beam stops there: the tree is the full beam's, and a search for a small tree
            // (a batch row's) makes fewer lookups. (This beam may then hold paths below the
            // full beam's cut, in place of children of paths it dropped; every such path
            // ranks behind `budget` nodes and never reaches the tree: docs/design.md.)
            // EOS paths fill the places the full beam's non-EOS paths leave: counted in the
            // full beam (`full_beam` paths, each with the row's non-EOS children), not in
            // this one, which would let extra EOS paths in and change the tree.
            let width = config.beam_width;
            let room = budget.saturating_sub(depth as usize);
            let eos_in_row = eos.map_or(0, |e| row_ids.iter().filter(|&&t| t == e).count());
            let full_non_eos = full_beam * (k - eos_in_row);
            beam.clear();
            keep_best(arena, level, width.min(room), ties);
            beam.extend(level.iter().map(|r| r.node));
            if full_non_eos < width {
                keep_best(arena, level_eos, (width - full_non_eos).min(room), ties);
                beam.extend(level_eos.iter().map(|r| r.node));
            }
            full_beam = (full_beam * k).min(width);
        }
    }

    // Every scored node is a candidate for the tree: score descending, then depth ascending
    // (a parent before a child it ties with), then path ascending.
    keep_best(arena, pool, budget, ties);
    if !lookup_path.is_empty() {
        graft_lookup_path(arena, pool, lookup_path, budget, lookup_ranks);
    }
    pool.sort_unstable_by(|a, b| output_order(arena, a.node, b.node));

    let n = pool.len() + 1;
    out_index.clear();
    out_index.resize(arena.len(), u32::MAX);
    out_index[0] = 0;
    let mut tokens = Vec::with_capacity(n);
    let mut parents = Vec::with_capacity(n);
    let mut depths = Vec::with_capacity(n);
    let mut scores = Vec::with_capacity(n);
    tokens.push(i64::from(root_token));
    parents.push(-1);
    depths.push(0);
    scores.push(0.0);
    for (i, a) in pool.iter().map(|r| r.node).enumerate() {
        let node = &arena[a as usize];
        let parent = out_index[node.parent as usize];
        // Scores never increase from parent to child and ties keep the shallower node, so
        // the parent always ranks (and is placed) first; checked rather than trusted.
        if parent == u32::MAX {
            return Err(PrunerError::Internal(format!(
                "node {a} (token {}, depth {}) was kept without its parent",
                node.token, node.depth
            )));
        }
        out_index[a as usize] = i as u32 + 1;
        tokens.push(i64::from(node.token));
        parents.push(i64::from(parent));
        depths.push(i64::from(node.depth));
        scores.push(node.score);
    }
    Ok(DraftTree::from_nodes(tokens, parents, depths, scores))
}

/// Makes the kept nodes (`pool`, the `budget` best) hold `path` (at most `budget` tokens):
/// keeps the largest number `j` of best nodes such that `j` plus the path's nodes missing
/// from them fits the budget, then adds those missing nodes (score `-inf`).
fn graft_lookup_path(
    arena: &mut Vec<Node>,
    pool: &mut Vec<Ranked>,
    path: &[u32],
    budget: usize,
    ranks: &mut Vec<u32>,
) {
    // Rank order: score descending, then depth ascending, then path ascending (a parent
    // always ranks before its children, so every prefix of the ranking is prefix-closed).
    pool.sort_unstable_by(|a, b| {
        a.key.cmp(&b.key).then_with(|| {
            let (na, nb) = (&arena[a.node as usize], &arena[b.node as usize]);
            na.depth
                .cmp(&nb.depth)
                .then_with(|| cmp_paths(arena, a.node, b.node))
        })
    });
    // The rank of each path node among the kept ones; once one is missing, so are all
    // deeper ones (the kept set is prefix-closed).
    ranks.clear();
    let mut parent = 0u32;
    for &token in path {
        let found = pool.iter().position(|r| {
            let n = &arena[r.node as usize];
            n.parent == parent && n.token == token
        });
        match found {
            Some(rank) => {
                ranks.push(rank as u32);
                parent = pool[rank].node;
            }
            None => break,
        }
    }
    ranks.resize(path.len(), u32::MAX);
    // Keeping the best j nodes costs j + (path nodes ranked at or after j); the cost grows
    // with j, so the largest j that fits is found walking down from the budget.
    let missing_from = |j: usize| ranks.iter().filter(|&&r| r as usize >= j).count();
    let mut keep = budget.min(pool.len());
    while keep > 0 && keep + missing_from(keep) > budget {
        keep -= 1;
    }
    pool.truncate(keep);
    let mut parent = 0u32;
    for (depth, (&token, &rank)) in path.iter().zip(ranks.iter()).enumerate() {
        parent = if (rank as usize) < keep {
            pool[rank as usize].node
        } else {
            let node = arena.len() as u32;
            arena.push(Node {
                score: f64::NEG_INFINITY,
                parent,
                token,
                depth: depth as u32 + 1,
            });
            pool.push(Ranked {
                key: desc_key(f64::NEG_INFINITY),
                node,
            });
            node
        };
    }
}

/// The last `history` tokens of `context ++ path(node)` (fewer if there are not that many).
fn fill_ngram_context(
    arena: &[Node],
    context: &[u32],
    node: u32,
    history: usize,
    out: &mut Vec<u32>,
) {
    out.clear();
    let mut at = node;
    // Arena node 0 is the root, which is `context.last()`: stop there and read the context.
    while out.len() < history && at != 0 {
        let n = &arena[at as usize];
        out.push(n.token);
        at = n.parent;
    }
    let need = history - out.len();
    let from_context = &context[context.len().saturating_sub(need)..];
    out.extend(from_context.iter().rev());
    out.reverse();
}
