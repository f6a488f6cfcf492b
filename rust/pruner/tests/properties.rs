//! Property tests of every guarantee of the pruner, against a brute-force scorer and a slow
//! reference implementation (tests/common).

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use common::{slow_prune, BruteScorer};
use dart_pruner::{
    DraftRequest, DraftTree, NGramScorer, OwnedRequest, Pruner, PrunerConfig, PrunerError,
};
use proptest::prelude::*;

/// One random case: a scorer, a config and a request's arrays.
#[derive(Debug, Clone)]
struct Case {
    order: usize,
    vocab: u32,
    eos: Option<u32>,
    docs: Vec<Vec<u32>>,
    context: Vec<u32>,
    levels: usize,
    k: usize,
    ids: Vec<u32>,
    probs: Vec<f32>,
    config: PrunerConfig,
    budget: Option<usize>,
}

/// Probabilities drawn from a small set so that ties are frequent, plus exact 0 and 1.
fn prob_strategy() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => prop::sample::select(vec![0.0f32, 1.0, 0.5, 0.25, 0.125, 0.1, 0.05]),
        2 => 0.0f32..=1.0,
    ]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (1usize..=4, 3u32..=12, any::<bool>(), 1usize..=5, 1usize..=6)
        .prop_flat_map(|(order, vocab, has_eos, levels, kmax)| {
            let k = kmax.min(vocab as usize);
            let eos = has_eos.then_some(vocab - 1);
            let docs = prop::collection::vec(prop::collection::vec(0..vocab, 1..30), 1..6);
            let context = prop::collection::vec(0..vocab, 1..5);
            // Each row: k distinct ids (a shuffled prefix of the vocabulary).
            let rows = prop::collection::vec(
                Just((0..vocab).collect::<Vec<u32>>()).prop_shuffle(),
                levels,
            );
            let probs = prop::collection::vec(prob_strategy(), levels * k);
            let config = (
                1usize..=6,
                1usize..=30,
                prop::sample::select(vec![0.0f64, 0.7, 1.3]),
                prop::sample::select(vec![0.9f64, 1.0, 0.5]),
                prop::sample::select(vec![0.0f64, 0.5, 2.0]),
                any::<bool>(),
                prop::sample::select(vec![1e-10f64, 1e-3]),
            )
                .prop_map(|(beam, max_nodes, le, ld, nw, at0, eps)| PrunerConfig {
                    beam_width: beam,
                    max_nodes,
                    level_exponent: le,
                    logit_decay: ld,
                    ngram_weight: nw,
                    ngram_at_level0: at0,
                    eps,
                    ..Default::default()
                });
            let budget = prop::option::of(1usize..=40);
            (
                Just((order, vocab, eos, levels, k)),
                docs,
                context,
                rows,
                probs,
                config,
                budget,
            )
        })
        .prop_map(
            |((order, vocab, eos, levels, k), docs, context, rows, probs, config, budget)| {
                let ids = rows.iter().flat_map(|r| r[..k].to_vec()).collect();
                Case {
                    order,
                    vocab,
                    eos,
                    docs,
                    context,
                    levels,
                    k,
                    ids,
                    probs,
                    config,
                    budget,
                }
            },
        )
}

impl Case {
    fn scorer(&self) -> BruteScorer {
        // Documents end in EOS, as the builder appends it.
        let docs: Vec<Vec<u32>> = self
            .docs
            .iter()
            .map(|d| {
                let mut d = d.clone();
                d.extend(self.eos);
                d
            })
            .collect();
        BruteScorer::from_documents(self.order, self.vocab, self.eos, &docs)
    }

    fn request(&self) -> DraftRequest<'_> {
        DraftRequest {
            context: &self.context,
            topk_ids: &self.ids,
            topk_probs: &self.probs,
            levels: self.levels,
            k: self.k,
            budget: self.budget,
            lookup_path: &[],
        }
    }
}

/// Every structural guarantee of a tree, independent of how it was computed.
fn check_structure(tree: &DraftTree, root: u32, budget: usize) {
    let n = tree.len();
    assert!(
        n >= 1 && n - 1 <= budget,
        "{} nodes for budget {budget}",
        n - 1
    );
    assert_eq!(tree.tokens[0], i64::from(root));
    assert_eq!(
        (tree.parents[0], tree.depths[0], tree.scores[0]),
        (-1, 0, 0.0)
    );
    let mut children: Vec<HashSet<i64>> = vec![HashSet::new(); n];
    for i in 1..n {
        let p = tree.parents[i];
        assert!(
            p >= 0 && (p as usize) < i,
            "parent {p} of node {i} must precede it"
        );
        let p = p as usize;
        assert_eq!(tree.depths[i], tree.depths[p] + 1, "depth of node {i}");
        assert!(
            tree.scores[i] <= tree.scores[p],
            "node {i} outscores its parent"
        );
        assert!(
            children[p].insert(tree.tokens[i]),
            "duplicate sibling token {}",
            tree.tokens[i]
        );
        // Output order: depth asc, then score desc, then path asc.
        let (a, b) = (i - 1, i);
        if a > 0 {
            let ord = tree.depths[a]
                .cmp(&tree.depths[b])
                .then(tree.scores[b].partial_cmp(&tree.scores[a]).unwrap())
                .then(tree.path(a).cmp(&tree.path(b)));
            assert_eq!(
                ord,
                std::cmp::Ordering::Less,
                "nodes {a} and {b} out of order"
            );
        }
    }
    // Mask: exactly self and ancestors.
    for i in 0..n {
        let mut anc = HashSet::new();
        let mut x = i as i64;
        while x >= 0 {
            anc.insert(x as usize);
            x = tree.parents[x as usize];
        }
        for j in 0..n {
            assert_eq!(tree.mask(i, j), anc.contains(&j), "mask[{i}][{j}]");
        }
    }
    // Retrieve rows: every leaf once, in index order, root to leaf, then -1 padding.
    let leaves: Vec<usize> = (0..n).filter(|&i| children[i].is_empty()).collect();
    assert_eq!(tree.num_leaves(), leaves.len());
    let max_depth = *tree.depths.iter().max().unwrap() as usize;
    assert_eq!(tree.retrieve_width(), max_depth + 1);
    for (r, &leaf) in leaves.iter().enumerate() {
        let row = tree.retrieve_row(r);
        let d = tree.depths[leaf] as usize;
        assert_eq!(row[d], leaf as i64);
        assert_eq!(row[0], 0);
        for c in 1..=d {
            assert_eq!(tree.parents[row[c] as usize], row[c - 1]);
        }
        assert!(row[d + 1..].iter().all(|&x| x == -1));
    }
}

/// The slow reference's output as a DraftTree-comparable form.
fn assert_matches_slow(tree: &DraftTree, slow: &common::SlowTree) {
    assert_eq!(tree.len() - 1, slow.len(), "node count");
    for (i, (path, score)) in slow.iter().enumerate() {
        let got: Vec<u32> = tree.path(i + 1).iter().map(|&t| t as u32).collect();
        assert_eq!(&got, path, "path of node {}", i + 1);
        assert_eq!(
            tree.scores[i + 1].to_bits(),
            score.to_bits(),
            "score of node {}: {} vs {}",
            i + 1,
            tree.scores[i + 1],
            score
        );
    }
}

/// `default` cases per property, or `PROPTEST_CASES` when set (a soak run:
/// `PROPTEST_CASES=200000 cargo test --release -p dart-pruner --test properties`).
fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cases(1500))]

    #[test]
    fn agrees_with_slow_reference_and_keeps_every_guarantee(case in case_strategy()) {
        let scorer = case.scorer();
        let slow = slow_prune(&scorer, &case.config, &case.request());
        let pruner = Pruner::new(&scorer, case.config.clone()).unwrap();
        let tree = pruner.prune(&case.request()).unwrap();
        let budget = case.budget.unwrap_or(case.config.max_nodes);
        check_structure(&tree, *case.context.last().unwrap(), budget);
        assert_matches_slow(&tree, &slow);
        // The tree holds min(budget, every scored path).
        let mut paths = 0;
        let mut beam = 1;
        for _ in 0..case.levels {
            paths += beam * case.k;
            beam = (beam * case.k).min(case.config.beam_width);
        }
        prop_assert_eq!(tree.len() - 1, budget.min(paths));
        // Deterministic, and independent of the order of candidates within a row.
        prop_assert_eq!(&pruner.prune(&case.request()).unwrap(), &tree);
        let mut shuffled = case.clone();
        for l in 0..case.levels {
            let row: Vec<(u32, f32)> = (0..case.k).rev().map(|j| (case.ids[l * case.k + j], case.probs[l * case.k + j])).collect();
            for (j, (t, p)) in row.into_iter().enumerate() {
                shuffled.ids[l * case.k + j] = t;
                shuffled.probs[l * case.k + j] = p;
            }
        }
        prop_assert_eq!(&pruner.prune(&shuffled.request()).unwrap(), &tree);
    }

    #[test]
    fn batch_equals_one_by_one(cases in prop::collection::vec(case_strategy(), 1..6)) {
        // One scorer/config for the batch: take the first case's, and keep the others' arrays
        // only where they fit its vocabulary.
        let scorer = cases[0].scorer();
        let pruner = Pruner::new(&scorer, cases[0].config.clone()).unwrap();
        let reqs: Vec<DraftRequest<'_>> = cases.iter().map(|c| c.request()).collect();
        let batch = pruner.prune_batch(&reqs);
        // The same requests owned, pruned by this thread alongside the pool (repeated so the
        // batch outnumbers the threads), and from inside a pool thread.
        let shared = Arc::new(Pruner::new(Arc::new(cases[0].scorer()), cases[0].config.clone()).unwrap());
        let owned: Vec<OwnedRequest> = cases
            .iter()
            .cycle()
            .take(cases.len() * 7)
            .map(|c| OwnedRequest {
                context: c.context.clone(),
                topk_ids: c.ids.clone(),
                topk_probs: c.probs.clone(),
                levels: c.levels,
                k: c.k,
                budget: c.budget,
                lookup_path: Vec::new(),
            })
            .collect();
        let outside = shared.prune_shared(owned.clone());
        let inside = rayon::scope(|_| shared.prune_shared(owned.clone()));
        prop_assert_eq!(batch.len(), reqs.len());
        prop_assert_eq!(outside.len(), owned.len());
        prop_assert_eq!(inside.len(), owned.len());
        let same = |a: &Result<DraftTree, PrunerError>, b: &Result<DraftTree, PrunerError>| match (a, b) {
            (Ok(a), Ok(b)) => a == b,
            (Err(a), Err(b)) => a.to_string() == b.to_string(),
            _ => false,
        };
        for (i, r) in reqs.iter().enumerate() {
            let alone = pruner.prune(r);
            prop_assert!(same(&alone, &batch[i]), "prune {:?} vs batch {:?}", alone, batch[i]);
            for j in (i..owned.len()).step_by(reqs.len()) {
                prop_assert!(same(&alone, &outside[j]), "prune {:?} vs shared {:?}", alone, outside[j]);
                prop_assert!(same(&alone, &inside[j]), "prune {:?} vs shared in the pool {:?}", alone, inside[j]);
            }
        }
    }
}

fn tiny_scorer() -> BruteScorer {
    BruteScorer::from_documents(3, 10, Some(9), &[vec![1, 2, 3, 4, 9], vec![1, 2, 5, 9]])
}

fn err_of(scorer: &BruteScorer, config: PrunerConfig, req: DraftRequest<'_>) -> String {
    let e = Pruner::new(scorer, config)
        .unwrap()
        .prune(&req)
        .unwrap_err();
    e.to_string()
}

#[test]
fn hand_computed_tree() {
    // Two levels, k = 2, beam 1: level 0 keeps token 2 (p 0.7); level 1 extends only it.
    let scorer = tiny_scorer();
    let config = PrunerConfig {
        beam_width: 1,
        max_nodes: 3,
        ..Default::default()
    };
    let pruner = Pruner::new(&scorer, config).unwrap();
    let tree = pruner
        .prune(&DraftRequest {
            context: &[1],
            topk_ids: &[2, 7, 5, 3],
            topk_probs: &[0.7, 0.3, 0.3, 0.7],
            levels: 2,
            k: 2,
            budget: None,
            lookup_path: &[],
        })
        .unwrap();
    let ln = |p: f32| (f64::from(p) + 1e-10).ln();
    let w1 = 2f64.powf(-0.7);
    // After [1, 2] the corpus has 1 2 3 and 1 2 5 once each: P(3 | 1 2) = P(5 | 1 2) = 1/2.
    let s2 = ln(0.7);
    let s7 = ln(0.3);
    let s23 = s2 + w1 * (0.9 * ln(0.7) + 0.5 * ln(0.5));
    let s25 = s2 + w1 * (0.9 * ln(0.3) + 0.5 * ln(0.5));
    // The best 3 of the 4 scored paths: 2 > 2-3 > 7 > 2-5.
    assert!(s2 > s23 && s23 > s7 && s7 > s25);
    assert_eq!(tree.tokens, vec![1, 2, 7, 3]);
    assert_eq!(tree.parents, vec![-1, 0, 0, 1]);
    assert_eq!(tree.depths, vec![0, 1, 1, 2]);
    assert_eq!(tree.scores, vec![0.0, s2, s7, s23]);
    assert_eq!(tree.retrieve_indices, vec![0, 2, -1, 0, 1, 3]);
}

#[test]
fn eos_paths_rank_last_in_the_beam_but_stay_in_the_pool() {
    let scorer = tiny_scorer();
    let config = PrunerConfig {
        beam_width: 1,
        ..Default::default()
    };
    let pruner = Pruner::new(&scorer, config).unwrap();
    // EOS (9) is the most likely level-0 token, yet the beam extends 4.
    let tree = pruner
        .prune(&DraftRequest {
            context: &[3],
            topk_ids: &[9, 4, 1, 2],
            topk_probs: &[0.9, 0.1, 0.5, 0.5],
            levels: 2,
            k: 2,
            budget: None,
            lookup_path: &[],
        })
        .unwrap();
    assert_eq!(tree.tokens[1], 9, "EOS kept in the tree, best score");
    for i in 1..tree.len() {
        if tree.depths[i] == 2 {
            assert_eq!(
                tree.tokens[tree.parents[i] as usize], 4,
                "only 4 was extended"
            );
        }
    }
    // With EOS handling off (a model without EOS, no eos_id), 9 is extended instead.
    let no_eos = BruteScorer {
        eos: None,
        ..tiny_scorer()
    };
    let tree = Pruner::new(
        &no_eos,
        PrunerConfig {
            beam_width: 1,
            ..Default::default()
        },
    )
    .unwrap()
    .prune(&DraftRequest {
        context: &[3],
        topk_ids: &[9, 4, 1, 2],
        topk_probs: &[0.9, 0.1, 0.5, 0.5],
        levels: 2,
        k: 2,
        budget: None,
        lookup_path: &[],
    })
    .unwrap();
    assert!(tree
        .depths
        .iter()
        .zip(&tree.parents)
        .any(|(&d, &p)| d == 2 && tree.tokens[p as usize] == 9));
}

#[test]
fn without_ngram_weight_no_lookup_is_made() {
    struct Failing;
    impl NGramScorer for Failing {
        fn order(&self) -> usize {
            3
        }
        fn vocab_size(&self) -> u32 {
            10
        }
        fn eos_id(&self) -> Option<u32> {
            None
        }
        fn prob_many(&self, _: &[u32], _: &[u32], _: &mut [f32]) -> Result<(), PrunerError> {
            Err(PrunerError::Scorer("lookup made".into()))
        }
    }
    let req = DraftRequest {
        context: &[1, 2],
        topk_ids: &[1, 2, 3, 4],
        topk_probs: &[0.5; 4],
        levels: 2,
        k: 2,
        budget: None,
        lookup_path: &[],
    };
    let off = PrunerConfig {
        ngram_weight: 0.0,
        ..Default::default()
    };
    assert_eq!(
        Pruner::new(Failing, off)
            .unwrap()
            .prune(&req)
            .unwrap()
            .len(),
        7
    );
    // With the weight on, the scorer's error comes through.
    let err = Pruner::new(Failing, PrunerConfig::default())
        .unwrap()
        .prune(&req)
        .unwrap_err();
    assert!(err.to_string().contains("lookup made"), "{err}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let s = tiny_scorer();
    let d = PrunerConfig::default;
    let ok_ids = [1u32, 2, 3, 4];
    let ok_p = [0.5f32; 4];
    let req =
        |context: &'static [u32], ids: &'static [u32], probs: &'static [f32], levels, k, budget| {
            DraftRequest {
                context,
                topk_ids: ids,
                topk_probs: probs,
                levels,
                k,
                budget,
                lookup_path: &[],
            }
        };
    let _ = (ok_ids, ok_p);
    let cases: Vec<(DraftRequest<'static>, &str)> = vec![
        (
            req(&[], &[1, 2, 3, 4], &[0.5; 4], 2, 2, None),
            "context is empty",
        ),
        (
            req(&[1], &[1, 2, 3], &[0.5; 4], 2, 2, None),
            "topk_ids has 3 elements",
        ),
        (
            req(&[1], &[1, 2, 3, 4], &[0.5; 3], 2, 2, None),
            "topk_probs 3",
        ),
        (req(&[1], &[], &[], 0, 2, None), "at least one level"),
        (
            req(&[1], &[], &[], 2, 0, None),
            "at least one level and one candidate",
        ),
        (
            req(&[1], &[1, 2, 3, 4], &[0.5; 4], 2, 2, Some(0)),
            "budget = 0",
        ),
        (
            req(&[1], &[1, 2, 3, 10], &[0.5; 4], 2, 2, None),
            "topk_ids[1][1] = 10 is outside the vocabulary",
        ),
        (
            req(&[12, 1], &[1, 2, 3, 4], &[0.5; 4], 2, 2, None),
            "context[0] = 12",
        ),
        (
            req(&[1], &[1, 2, 3, 3], &[0.5; 4], 2, 2, None),
            "row 1 holds token 3 twice (columns 0 and 1)",
        ),
        (
            req(&[1], &[1, 2, 3, 4], &[0.5, 1.5, 0.5, 0.5], 2, 2, None),
            "topk_probs[0][1] = 1.5",
        ),
        (
            req(&[1], &[1, 2, 3, 4], &[0.5, 0.5, -0.1, 0.5], 2, 2, None),
            "topk_probs[1][0] = -0.1",
        ),
        (
            req(&[1], &[1, 2, 3, 4], &[0.5, 0.5, 0.5, f32::NAN], 2, 2, None),
            "topk_probs[1][1] = NaN",
        ),
    ];
    for (r, expected) in cases {
        let err = err_of(&s, d(), r);
        assert!(
            err.contains(expected),
            "{err:?} should contain {expected:?}"
        );
    }
    // Only the tail the n-gram model reads is checked: an old bad id is not an error.
    assert!(Pruner::new(&s, d())
        .unwrap()
        .prune(&req(&[99, 1, 2], &[1, 2, 3, 4], &[0.5; 4], 2, 2, None))
        .is_ok());
    // Long rows take the sorting path of the duplicate check.
    let big = BruteScorer::from_documents(2, 1000, None, &[vec![1, 2]]);
    let mut ids: Vec<u32> = (0..100).collect();
    ids[70] = 3;
    let probs = vec![0.01f32; 100];
    let e = Pruner::new(&big, d())
        .unwrap()
        .prune(&DraftRequest {
            context: &[1],
            topk_ids: &ids,
            topk_probs: &probs,
            levels: 1,
            k: 100,
            budget: None,
            lookup_path: &[],
        })
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("holds token 3 twice (columns 3 and 70)"),
        "{e}"
    );
    // Config errors.
    let e = Pruner::new(
        &s,
        PrunerConfig {
            eos_id: Some(10),
            ..d()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("eos_id = 10"), "{e}");
    let e = Pruner::new(
        &s,
        PrunerConfig {
            beam_width: 0,
            ..d()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("beam_width = 0"), "{e}");
    // Weights that overflow at some level are an error, not a NaN tree.
    let cfg = PrunerConfig {
        level_exponent: -2000.0,
        ..d()
    };
    let e = Pruner::new(&s, cfg)
        .unwrap()
        .prune(&req(&[1], &[1, 2, 3, 4], &[0.5; 4], 2, 2, None))
        .unwrap_err();
    assert!(e.to_string().contains("level 1"), "{e}");
    let cfg = PrunerConfig {
        level_exponent: 2000.0,
        logit_decay: 1e308,
        ..d()
    };
    let e = Pruner::new(&s, cfg)
        .unwrap()
        .prune(&req(&[1], &[1, 2, 3, 4], &[0.0; 4], 2, 2, None))
        .unwrap_err();
    assert!(e.to_string().contains("not a number"), "{e}");
}

#[test]
fn probability_one_never_puts_a_child_above_its_parent() {
    // p = 1 and p_ngram = 1 make ln(1 + eps) > 0: the clamp keeps the child at its parent's
    // score and the tie goes to the parent, so a budget of 1 keeps the parent.
    let s = BruteScorer::from_documents(3, 10, None, &[vec![1, 2, 3]]);
    let p = Pruner::new(
        &s,
        PrunerConfig {
            eps: 1e-3,
            ..Default::default()
        },
    )
    .unwrap();
    let tree = p
        .prune(&DraftRequest {
            context: &[1],
            topk_ids: &[2, 3],
            topk_probs: &[1.0, 1.0],
            levels: 2,
            k: 1,
            budget: Some(1),
            lookup_path: &[],
        })
        .unwrap();
    assert_eq!(tree.tokens, vec![1, 2]);
    let tree = p
        .prune(&DraftRequest {
            context: &[1],
            topk_ids: &[2, 3],
            topk_probs: &[1.0, 1.0],
            levels: 2,
            k: 1,
            budget: Some(2),
            lookup_path: &[],
        })
        .unwrap();
    assert_eq!(tree.tokens, vec![1, 2, 3]);
    assert_eq!(tree.scores, vec![0.0, 0.0, 0.0]);
}

#[test]
fn pruner_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Pruner<Arc<BruteScorer>>>();
    assert_send_sync::<Pruner<Arc<dyn NGramScorer>>>();
    let dynamic: Arc<dyn NGramScorer> = Arc::new(tiny_scorer());
    let p = Pruner::new(dynamic, PrunerConfig::default()).unwrap();
    assert_eq!(p.context_tail_len(), 2);
    assert_eq!(p.eos_id(), Some(9));
}

proptest! {
    // Each case writes a model file: fewer cases.
    #![proptest_config(cases(300))]

    #[test]
    fn real_model_gives_the_brute_force_tree(case in case_strategy()) {
        // The mmap'd model answers exactly as the brute-force counts, so the trees agree.
        let scorer = case.scorer();
        let dir = tempfile::tempdir().unwrap();
        let model = Arc::new(common::write_real_model(&scorer, case.docs.len() as u64, &dir.path().join("m.ngram")));
        prop_assert_eq!(model.eos_id(), scorer.eos);
        let real = Pruner::new(model, case.config.clone()).unwrap();
        let brute = Pruner::new(&scorer, case.config.clone()).unwrap();
        prop_assert_eq!(real.prune(&case.request()).unwrap(), brute.prune(&case.request()).unwrap());
    }
}

/// Draft-like requests at the real workload's size (k = 25, 8 levels, beam 20, 60 nodes):
/// peaked rows over a vocabulary whose corpus makes n-gram hits common.
fn realistic_case() -> impl Strategy<Value = (Vec<Vec<u32>>, Vec<u32>, Vec<u32>, Vec<f32>)> {
    let vocab = 60u32;
    (
        prop::collection::vec(prop::collection::vec(0..vocab / 3, 5..80), 20..40),
        prop::collection::vec(0..vocab, 2..6),
        prop::collection::vec(Just((0..vocab).collect::<Vec<u32>>()).prop_shuffle(), 8),
        prop::collection::vec(0.0f64..2.0, 8 * 25),
    )
        .prop_map(|(docs, context, rows, noise)| {
            let ids = rows.iter().flat_map(|r| r[..25].to_vec()).collect();
            let mut probs = Vec::with_capacity(200);
            for l in 0..8 {
                let logits: Vec<f64> = (0..25)
                    .map(|j| -0.35 * j as f64 + noise[l * 25 + j])
                    .collect();
                let z: f64 = logits.iter().map(|x| x.exp()).sum();
                probs.extend(logits.iter().map(|x| (x.exp() / z) as f32));
            }
            (docs, context, ids, probs)
        })
}

proptest! {
    #![proptest_config(cases(40))]

    #[test]
    fn realistic_sizes_agree_with_slow_reference((docs, context, ids, probs) in realistic_case()) {
        let scorer = BruteScorer::from_documents(3, 60, Some(59), &docs);
        let req = DraftRequest { context: &context, topk_ids: &ids, topk_probs: &probs, levels: 8, k: 25, budget: None, lookup_path: &[] };
        for config in [PrunerConfig::default(), PrunerConfig { max_nodes: 200, beam_width: 8, ..Default::default() }] {
            let tree = Pruner::new(&scorer, config.clone()).unwrap().prune(&req).unwrap();
            check_structure(&tree, *context.last().unwrap(), config.max_nodes);
            assert_matches_slow(&tree, &slow_prune(&scorer, &config, &req));
        }
    }
}

#[test]
fn paths_ending_alike_share_one_lookup() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Counting(BruteScorer, AtomicUsize);
    impl NGramScorer for Counting {
        fn order(&self) -> usize {
            self.0.order
        }
        fn vocab_size(&self) -> u32 {
            self.0.vocab_size
        }
        fn eos_id(&self) -> Option<u32> {
            self.0.eos
        }
        fn prob_many(&self, c: &[u32], t: &[u32], p: &mut [f32]) -> Result<(), PrunerError> {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.prob_many(c, t, p)
        }
    }
    // Rows [1 2] [3] [4 5] [6 7], all paths kept: at level 3 the paths 1-3-4 and 2-3-4 end in
    // the same two tokens, as do 1-3-5 and 2-3-5 (the 3-gram context is the last two).
    let docs = vec![vec![1, 3, 4, 6], vec![2, 3, 5, 7], vec![3, 4, 7]];
    let counting = Counting(
        BruteScorer::from_documents(3, 10, None, &docs),
        AtomicUsize::new(0),
    );
    let req = DraftRequest {
        context: &[0],
        topk_ids: &[1, 2, 3, 0, 4, 5, 6, 7],
        topk_probs: &[0.6, 0.4, 1.0, 0.0, 0.5, 0.5, 0.7, 0.3],
        levels: 4,
        k: 2,
        budget: Some(100),
        lookup_path: &[],
    };
    let config = PrunerConfig {
        beam_width: 8,
        ..Default::default()
    };
    let tree = Pruner::new(&counting, config.clone())
        .unwrap()
        .prune(&req)
        .unwrap();
    // Level 1: 2 contexts; level 2: 4 paths, contexts (1 3) (2 3) (1 0) (2 0); level 3: 8
    // paths ending in (3 4) (3 5) (0 4) (0 5): 4 distinct. 2 + 4 + 4 = 10 instead of 14.
    assert_eq!(counting.1.load(Ordering::Relaxed), 10);
    assert_matches_slow(&tree, &slow_prune(&counting.0, &config, &req));
}

/// The token paths (root excluded) of a tree's nodes, optionally only the beam's (finite
/// score) nodes.
fn node_paths(tree: &DraftTree, beam_only: bool) -> HashSet<Vec<i64>> {
    (1..tree.len())
        .filter(|&i| !beam_only || tree.scores[i].is_finite())
        .map(|i| tree.path(i))
        .collect()
}

proptest! {
    #![proptest_config(cases(800))]

    #[test]
    fn lookup_path_is_held_and_the_beam_fills_the_rest(
        case in case_strategy(),
        path_seed in prop::collection::vec(0u32..64, 0..9),
    ) {
        let scorer = case.scorer();
        let pruner = Pruner::new(&scorer, case.config.clone()).unwrap();
        let budget = case.budget.unwrap_or(case.config.max_nodes);
        let path: Vec<u32> = path_seed.iter().map(|t| t % case.vocab).collect();
        let req = DraftRequest { lookup_path: &path, ..case.request() };
        let tree = pruner.prune(&req).unwrap();
        check_structure(&tree, *case.context.last().unwrap(), budget);
        // The path, cut to the budget, is in the tree.
        let held = &path[..path.len().min(budget)];
        let paths = node_paths(&tree, false);
        for d in 1..=held.len() {
            let prefix: Vec<i64> = held[..d].iter().map(|&t| i64::from(t)).collect();
            prop_assert!(paths.contains(&prefix), "path prefix {:?} missing", prefix);
        }
        // The beam's nodes are exactly the plain tree of that many nodes...
        let beam = node_paths(&tree, true);
        let plain = |j: usize| {
            if j == 0 {
                return HashSet::new();
            }
            node_paths(&pruner.prune(&DraftRequest { budget: Some(j), ..case.request() }).unwrap(), false)
        };
        let j = beam.len();
        prop_assert_eq!(&beam, &plain(j));
        // ... and one more would not fit beside the path.
        let all = plain(budget);
        if j < all.len() {
            let more = plain(j + 1);
            let missing = (1..=held.len())
                .filter(|&d| !more.contains(&held[..d].iter().map(|&t| i64::from(t)).collect::<Vec<_>>()))
                .count();
            prop_assert!(j + 1 + missing > budget, "kept {} beam nodes; {} fit", j, j + 1);
        }
        // An empty path changes nothing.
        if path.is_empty() {
            prop_assert_eq!(&tree, &pruner.prune(&case.request()).unwrap());
        }
    }
}

#[test]
fn lookup_path_out_of_vocabulary_is_an_error() {
    let scorer = tiny_scorer();
    let vocab = scorer.vocab_size();
    let (ids, probs) = (vec![1u32, 2], vec![0.6f32, 0.4]);
    let path = [1u32, vocab];
    let req = DraftRequest {
        context: &[0],
        topk_ids: &ids,
        topk_probs: &probs,
        levels: 1,
        k: 2,
        budget: None,
        lookup_path: &path,
    };
    let msg = err_of(&scorer, PrunerConfig::default(), req);
    assert!(msg.contains("lookup_path[1]"), "{msg}");
}
