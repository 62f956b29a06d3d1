//! One-shot timers that are cancelled when their guard drops.

use std::sync::{Arc, Weak};

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

/// Runs `f` on the agent behind `weak` (if it still exists) at the instant `at` (a room
/// machine's `poll_timeout`), unless the guard is dropped first.
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
