//! Requests and configurations beyond the pruner's limits are errors (not aborts, not minutes
//! of work), checked before anything is allocated; scratch memory is returned; a cancelled
//! batch stops.

use std::sync::atomic::{AtomicBool, Ordering};

use dart_pruner::{DraftRequest, NGramScorer, Pruner, PrunerConfig, PrunerError, PrunerLimits};

/// A scorer that knows nothing: every n-gram probability is 0 (the draft alone decides).
#[derive(Debug)]
struct Uniform(u32);

impl NGramScorer for Uniform {
    fn order(&self) -> usize {
        3
    }
    fn vocab_size(&self) -> u32 {
        self.0
    }
    fn eos_id(&self) -> Option<u32> {
        None
    }
    fn prob_many(&self, _: &[u32], _: &[u32], probs: &mut [f32]) -> dart_pruner::Result<()> {
        probs.fill(0.0);
        Ok(())
    }
}

/// `levels` rows of `k` distinct ids with decreasing probabilities.
fn draft(levels: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    let ids = (0..levels).flat_map(|_| 0..k as u32).collect();
    let probs = (0..levels)
        .flat_map(|_| (0..k).map(move |j| 1.0 / (j + 2) as f32))
        .collect();
    (ids, probs)
}

fn request<'a>(ids: &'a [u32], probs: &'a [f32], levels: usize, k: usize) -> DraftRequest<'a> {
    DraftRequest {
        context: &[1, 2],
        topk_ids: ids,
        topk_probs: probs,
        levels,
        k,
        budget: None,
        lookup_path: &[],
    }
}

fn limit_name(err: PrunerError) -> &'static str {
    match err {
        PrunerError::LimitExceeded { limit_name, .. } => limit_name,
        other => panic!("expected LimitExceeded, got {other:?}"),
    }
}

/// The case: a 64 x 256 draft with a budget of 2^32 - 1 asked for a 10^11-cell
/// attention mask and aborted the process.
#[test]
fn a_huge_budget_is_an_error_not_an_abort() {
    let pruner = Pruner::new(Uniform(1000), PrunerConfig::default()).unwrap();
    let (ids, probs) = draft(64, 256);
    let req = DraftRequest {
        budget: Some(u32::MAX as usize),
        ..request(&ids, &probs, 64, 256)
    };
    let err = pruner.prune(&req).unwrap_err();
    assert!(err.to_string().contains("--max-nodes"), "{err}");
    assert_eq!(limit_name(err), "max_nodes");
    // Within the limit the same draft is pruned.
    let req = DraftRequest {
        budget: Some(1024),
        ..req
    };
    assert_eq!(pruner.prune(&req).unwrap().len(), 1025);
}

/// Overrides like the issue's `beam_width=10**7, max_nodes=10**7` are refused when the
/// pruner is made, before any request runs.
#[test]
fn oversized_configurations_are_refused() {
    for (config, name) in [
        (
            PrunerConfig {
                beam_width: 10_000_000,
                ..Default::default()
            },
            "max_beam_width",
        ),
        (
            PrunerConfig {
                max_nodes: 10_000_000,
                ..Default::default()
            },
            "max_nodes",
        ),
    ] {
        let err = Pruner::new(Uniform(1000), config).unwrap_err();
        assert_eq!(limit_name(err), name);
    }
}

#[test]
fn shapes_beyond_the_limits_are_refused_before_their_arrays_are_read() {
    let pruner = Pruner::new(Uniform(1 << 20), PrunerConfig::default()).unwrap();
    // Declared shapes beyond the limits fail on the shape alone (no array that large exists).
    let req = |levels, k| DraftRequest {
        levels,
        k,
        ..request(&[], &[], levels, k)
    };
    assert_eq!(
        limit_name(pruner.prune(&req(65, 1)).unwrap_err()),
        "max_levels"
    );
    assert_eq!(
        limit_name(pruner.prune(&req(1, 1025)).unwrap_err()),
        "max_k"
    );
    assert_eq!(
        limit_name(pruner.prune(&req(usize::MAX, usize::MAX)).unwrap_err()),
        "max_levels"
    );
    // Every dimension within its limit, the product beyond max_scored_paths.
    let wide = Pruner::new(
        Uniform(1 << 20),
        PrunerConfig {
            beam_width: 1024,
            ..Default::default()
        },
    )
    .unwrap();
    let (ids, probs) = draft(64, 1024);
    let err = wide.prune(&request(&ids, &probs, 64, 1024)).unwrap_err();
    assert_eq!(limit_name(err), "max_scored_paths");
}

#[test]
fn limits_can_be_raised_and_lowered() {
    let tight = PrunerLimits {
        max_levels: 4,
        ..Default::default()
    };
    let pruner = Pruner::with_limits(Uniform(100), PrunerConfig::default(), tight).unwrap();
    let (ids, probs) = draft(5, 8);
    let err = pruner.prune(&request(&ids, &probs, 5, 8)).unwrap_err();
    assert_eq!(limit_name(err), "max_levels");
    assert!(pruner
        .prune(&request(&ids[..32], &probs[..32], 4, 8))
        .is_ok());
    let roomy = PrunerLimits {
        max_beam_width: 4096,
        ..Default::default()
    };
    let config = PrunerConfig {
        beam_width: 2048,
        ..Default::default()
    };
    assert!(Pruner::new(Uniform(100), config.clone()).is_err());
    assert!(Pruner::with_limits(Uniform(100), config, roomy).is_ok());
}

/// The largest request the default limits allow leaves no more than the kept scratch behind:
/// without the shrink a burst of such requests stays resident in every pool thread.
#[test]
fn scratch_beyond_the_kept_size_is_freed_after_the_call() {
    let config = PrunerConfig {
        beam_width: 1024,
        max_nodes: 1024,
        ..Default::default()
    };
    let pruner = Pruner::new(Uniform(1 << 20), config).unwrap();
    // 1,000 + 1,000 x 1,000 scored paths: just under the default max_scored_paths (2^20).
    let (ids, probs) = draft(2, 1000);
    let tree = pruner.prune(&request(&ids, &probs, 2, 1000)).unwrap();
    assert_eq!(tree.len(), 1025);
    assert!(
        dart_pruner::scratch_bytes_of_this_thread() <= 4 << 20,
        "{} bytes of scratch kept",
        dart_pruner::scratch_bytes_of_this_thread()
    );
    // A small request's scratch is kept for the next call.
    let small = Pruner::new(Uniform(1000), PrunerConfig::default()).unwrap();
    let (ids, probs) = draft(4, 25);
    small.prune(&request(&ids, &probs, 4, 25)).unwrap();
    assert!(dart_pruner::scratch_bytes_of_this_thread() > 0);
}

#[test]
fn a_cancelled_batch_stops_and_says_so() {
    let pruner = Pruner::new(Uniform(1000), PrunerConfig::default()).unwrap();
    let (ids, probs) = draft(4, 25);
    let reqs = vec![request(&ids, &probs, 4, 25); 8];
    let go = AtomicBool::new(false);
    let done = pruner.prune_batch_until(&reqs, &go);
    assert!(done.iter().all(|r| r.is_ok()));
    let stop = AtomicBool::new(true);
    let cancelled = pruner.prune_batch_until(&reqs, &stop);
    assert_eq!(cancelled.len(), 8);
    for r in cancelled {
        assert!(matches!(r, Err(PrunerError::Cancelled)), "{r:?}");
    }
    stop.store(false, Ordering::Relaxed);
    assert_eq!(
        pruner.prune_batch_until(&reqs, &stop)[0].as_ref().unwrap(),
        done[0].as_ref().unwrap()
    );
}
