//! One-shot timers that are cancelled when their guard drops.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::task::AbortHandle;
use tokio::time::Instant;

/// Cancels its timer when dropped.
#[derive(Debug)]
pub(crate) struct TimerGuard(Option<AbortHandle>);

impl Drop for TimerGuard {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// Runs `f` on the agent behind `weak` (if it still exists) after `delay`, unless the guard
/// is dropped first. Agents make their timers before locking their state, so the callback
/// (which locks it) is never built under the lock.
pub(crate) fn spawn_timer_on<T: Send + Sync + 'static>(
    weak: Weak<T>,
    delay: Duration,
    f: impl FnOnce(&T) + Send + 'static,
) -> TimerGuard {
    spawn_timer_at(weak, Instant::now() + delay, move |inner| f(inner))
}

/// As [`spawn_timer_on`], firing at the instant `at` (a room machine's `poll_timeout`).
pub(crate) fn spawn_timer_at<T: Send + Sync + 'static>(
    weak: Weak<T>,
    at: Instant,
    f: impl FnOnce(&Arc<T>) + Send + 'static,
) -> TimerGuard {
    let task = tokio::spawn(async move {
        tokio::time::sleep_until(at).await;
        if let Some(inner) = weak.upgrade() {
            f(&inner);
        }
    });
    TimerGuard(Some(task.abort_handle()))
}
