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

    /// CPU time of the calling thread (the current-thread runtime's only thread).
    fn thread_cpu() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid clock id and a valid out-pointer.
        assert_eq!(
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) },
            0
        );
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn polls_for_the_window_after_a_request_then_sleeps() {
        let activity = Activity::new();
        let window = Duration::from_millis(60);
        let poller = tokio::spawn(poll_while_busy(Arc::clone(&activity), window));
        tokio::task::yield_now().await; // the poller now waits for a request

        // Inside the window the thread keeps polling (it burns CPU while the test task
        // sleeps), and other tasks and timers still run.
        activity.touch();
        let (wall, cpu) = (Instant::now(), thread_cpu());
        tokio::time::sleep(Duration::from_millis(40)).await;
        let busy = thread_cpu() - cpu;
        assert!(
            wall.elapsed() < Duration::from_millis(1000),
            "a timer starved"
        );
        assert!(
            busy >= Duration::from_millis(10),
            "polled only {busy:?} of 40 ms"
        );

        // Past the window it sleeps: next to no CPU while nothing arrives.
        tokio::time::sleep(window).await;
        let cpu = thread_cpu();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let idle = thread_cpu() - cpu;
        assert!(
            idle < Duration::from_millis(20),
            "{idle:?} of CPU in 100 ms idle"
        );

        // A new request starts it again.
        activity.touch();
        let cpu = thread_cpu();
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(thread_cpu() - cpu >= Duration::from_millis(10));
        poller.abort();
    }
}
