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
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// When the last request arrived, and a wake-up for the poller.
pub struct Activity {
    epoch: Instant,
    /// Nanoseconds after `epoch` of the last request.
    last: AtomicU64,
    wake: Notify,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Activity {
            epoch: Instant::now(),
            last: AtomicU64::new(0),
            wake: Notify::new(),
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
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn polls_for_the_window_after_a_request_then_sleeps() {
        let activity = Activity::new();
        let window = Duration::from_millis(30);
        let poller = tokio::spawn(poll_while_busy(Arc::clone(&activity), window));
        // While polling, the runtime still runs other tasks and timers.
        activity.touch();
        let started = Instant::now();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(started.elapsed() < Duration::from_millis(500));
        assert!(activity.idle_for() >= Duration::from_millis(5));
        // Past the window the poller sleeps: a sleeping runtime makes no progress on its own,
        // yet a timer still fires on time.
        tokio::time::sleep(window * 2).await;
        assert!(activity.idle_for() >= window);
        activity.touch();
        assert!(activity.idle_for() < window);
        poller.abort();
    }
}
