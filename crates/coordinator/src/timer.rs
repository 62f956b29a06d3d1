//! The agents' one timer task: it sleeps until the machine's next deadline and ticks it.

use std::sync::{Arc, Weak};

use tokio::sync::Notify;
use tokio::time::Instant;

/// What the timer task needs of an agent's driver.
pub(crate) trait Ticks: Send + Sync + 'static {
    /// The machine's next deadline, recorded (under the driver's lock) as what the timer task
    /// sleeps until, so a step that arms an earlier one knows to wake it.
    fn next_tick(&self) -> Option<std::time::Instant>;
    /// Feeds the machine its timer event now.
    fn tick(&self);
}

/// Sleeps until the machine's next deadline and ticks it; woken early through `wake` when a
/// step armed an earlier one. Holds no strong reference while it sleeps, so it ends with the
/// agent.
pub(crate) async fn timer_loop<T: Ticks>(weak: Weak<T>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(inner) = weak.upgrade() else { return };
            inner.next_tick()
        };
        let Some(next) = next else {
            wake.notified().await;
            continue;
        };
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep_until(Instant::from_std(next)) => {
                let Some(inner) = weak.upgrade() else { return };
                inner.tick();
            }
        }
    }
}
