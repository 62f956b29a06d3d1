//! One-shot timers that are cancelled when their guard drops.

use std::time::Duration;

use tokio::task::AbortHandle;

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
    weak: std::sync::Weak<T>,
    delay: Duration,
    f: impl FnOnce(&T) + Send + 'static,
) -> TimerGuard {
    spawn_timer(delay, move || {
        if let Some(inner) = weak.upgrade() {
            f(&inner);
        }
    })
}

/// Runs `f` after `delay` unless the returned guard is dropped first.
pub(crate) fn spawn_timer(delay: Duration, f: impl FnOnce() + Send + 'static) -> TimerGuard {
    let task = tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        f();
    });
    TimerGuard(Some(task.abort_handle()))
}
