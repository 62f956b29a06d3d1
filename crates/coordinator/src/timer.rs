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

/// Runs `f` after `delay` unless the returned guard is dropped first.
pub(crate) fn spawn_timer(delay: Duration, f: impl FnOnce() + Send + 'static) -> TimerGuard {
    let task = tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        f();
    });
    TimerGuard(Some(task.abort_handle()))
}
