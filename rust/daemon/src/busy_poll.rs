//! Busy polling: the serving thread keeps reading its sockets for a while after each request
//! instead of going to sleep.
//!
//! An idle thread sleeps in `epoll_wait`; the next request must then wake it, and waking an
//! idle CPU costs tens of microseconds on many virtual machines (no halt polling), a large
//! share of a 0.3 ms prune round trip. A decode loop sends its next request within a few
//! milliseconds of the last answer, so for a short window after each request a task that only
//! yields keeps the runtime polling its sockets with a zero timeout: the next request is read
//! as soon as it lands. Past the window the task sleeps until a request wakes it again, so an
//! idle daemon burns no CPU.
//!
//! Polling works on the thread whose runtime owns the I/O driver: the daemon serves on one
//! `current_thread` runtime when busy polling is on (see `crate::run`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
// Tokio's clock: the runtime's (pausable) time, so the window can be tested without timing.
use tokio::time::Instant;

/// When the last request arrived, and a wake-up for the poller.
pub struct Activity {
    epoch: Instant,
    /// Nanoseconds after `epoch` of the last request.
    last: AtomicU64,
    wake: Notify,
    /// Polling rounds so far (each a yield that lets the runtime poll its sockets).
    rounds: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Activity {
            epoch: Instant::now(),
            last: AtomicU64::new(0),
            wake: Notify::new(),
            rounds: AtomicU64::new(0),
        })
    }

    /// Marks a request's arrival (a few nanoseconds; called for every request).
    pub fn touch(&self) {
        let now = self.epoch.elapsed().as_nanos() as u64;
        self.last.store(now, Ordering::Relaxed);
        self.wake.notify_one();
    }

    fn idle_for(&self) -> Duration {
        let now = self.epoch.elapsed().as_nanos() as u64;
        Duration::from_nanos(now.saturating_sub(self.last.load(Ordering::Relaxed)))
    }
}

/// Runs forever on the serving runtime: after each request, yields (so the runtime polls its
/// sockets without sleeping) until `window` passes without a request, then sleeps.
pub async fn poll_while_busy(activity: Arc<Activity>, window: Duration) {
    loop {
        activity.wake.notified().await;
        while activity.idle_for() < window {
            activity.rounds.fetch_add(1, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lets every other task run `n` times (the poller, if it polls, counts a round each).
    async fn yields(n: usize) {
        for _ in 0..n {
            tokio::task::yield_now().await;
        }
    }

    fn rounds(a: &Activity) -> u64 {
        a.rounds.load(Ordering::Relaxed)
    }

    /// Paused time: the clock moves only when the test advances it, so what is checked is the
    /// poller's logic (polls inside the window, sleeps past it, wakes on a request), not how
    /// much CPU a shared machine happened to give the thread.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn polls_for_the_window_after_a_request_then_sleeps() {
        let activity = Activity::new();
        let window = Duration::from_millis(60);
        let poller = tokio::spawn(poll_while_busy(Arc::clone(&activity), window));
        yields(10).await;
        assert_eq!(rounds(&activity), 0, "polled before any request");

        // Inside the window it keeps polling: a round each time it gets the thread.
        activity.touch();
        yields(10).await;
        let inside = rounds(&activity);
        assert!(inside >= 5, "only {inside} polling rounds in the window");
        tokio::time::advance(window / 2).await;
        yields(10).await;
        assert!(
            rounds(&activity) > inside,
            "stopped polling inside the window"
        );

        // Past the window it sleeps: no round however long nothing arrives.
        tokio::time::advance(window).await;
        yields(3).await;
        let asleep = rounds(&activity);
        yields(50).await;
        tokio::time::advance(Duration::from_secs(10)).await;
        yields(50).await;
        assert_eq!(rounds(&activity), asleep, "polled with no request");

        // A new request starts it again.
        activity.touch();
        yields(10).await;
        assert!(rounds(&activity) >= asleep + 5);
        poller.abort();
    }
}
