//! [`Pruner::prune_shared`]: a batch pruned by the calling thread and whichever pool threads
//! wake up in time to help.
//!
//! A thread outside rayon's pool (a Python generation loop, a GPU worker's host thread) that
//! calls `par_iter` hands the whole batch to the pool and sleeps until it is done: it pays a
//! pool thread's wake-up before any work starts and its own wake-up after, each tens to
//! hundreds of microseconds on a server whose cores idle between decoding steps. A batch of
//! small trees (a few nodes per row, as batched decoding builds) costs less than that to prune
//! on one thread. Here the caller starts on the requests at once and helpers join as they
//! wake, each claiming the next unclaimed request; the caller waits only for requests a helper
//! has already started (spinning: one request takes microseconds), never for a helper that has
//! not woken. A late helper finds nothing left and returns; it owns what it reads, so it may
//! outlive the call.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::{DraftTree, NGramScorer, OwnedRequest, Pruner, PrunerError, Result};

/// One batch being pruned: the next request to claim, how many are pruned, and a slot per
/// request for its result.
struct SharedBatch<S> {
    pruner: Arc<Pruner<S>>,
    requests: Vec<OwnedRequest>,
    next: AtomicUsize,
    finished: AtomicUsize,
    results: Vec<Mutex<Option<Result<DraftTree>>>>,
}

impl<S: NGramScorer> SharedBatch<S> {
    /// Claims and prunes requests until none is left unclaimed.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(request) = self.requests.get(i) else {
                return;
            };
            // A panic would leave the caller waiting for this slot forever: it becomes the
            // request's error instead (the search is written not to panic).
            let result = catch_unwind(AssertUnwindSafe(|| self.pruner.prune(&request.request())))
                .unwrap_or_else(|_| {
                    Err(PrunerError::Internal(format!(
                        "the search of request {i} panicked"
                    )))
                });
            *self.results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
            self.finished.fetch_add(1, Ordering::Release);
        }
    }

    fn unclaimed(&self) -> usize {
        self.requests
            .len()
            .saturating_sub(self.next.load(Ordering::Relaxed))
    }
}

/// Wakes one helper on rayon's global pool; each helper wakes the next while requests remain
/// unclaimed, so the caller pays for one notification, not one per thread.
fn spawn_helper<S: NGramScorer + 'static>(batch: &Arc<SharedBatch<S>>, helpers: usize) {
    if helpers == 0 || batch.unclaimed() <= 1 {
        return;
    }
    let batch = Arc::clone(batch);
    rayon::spawn(move || {
        spawn_helper(&batch, helpers - 1);
        batch.work();
    });
}

impl<S: NGramScorer + 'static> Pruner<S> {
    /// Prunes many requests: the calling thread works through them while pool threads join
    /// as they wake (see the module's notes). Results are in request order and identical to
    /// [`Pruner::prune`] of each; the latency is never much above pruning them all on the
    /// calling thread, and falls toward `1 / threads` of it when the batch is large.
    pub fn prune_shared(self: &Arc<Self>, requests: Vec<OwnedRequest>) -> Vec<Result<DraftTree>> {
        let n = requests.len();
        if n <= 1 {
            return requests.iter().map(|r| self.prune(&r.request())).collect();
        }
        let batch = Arc::new(SharedBatch {
            pruner: Arc::clone(self),
            results: (0..n).map(|_| Mutex::new(None)).collect(),
            requests,
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
        });
        spawn_helper(&batch, rayon::current_num_threads().min(n - 1));
        batch.work();
        // Requests a helper claimed may still be running, one per helper at most.
        let mut spins = 0u32;
        while batch.finished.load(Ordering::Acquire) < n {
            if spins < 1 << 12 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
        batch
            .results
            .iter()
            .map(|slot| {
                slot.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .expect("every claimed request stores its result before it counts as finished")
            })
            .collect()
    }
}
