//! What both agents share around their machine: the control loop, the one timer task, and
//! the tasks that end with the agent.

use std::future::Future;
use std::sync::{Arc, Weak};

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::channel::{ControlChannel, Envelope};
use crate::error::Side;
use crate::metrics::{Metrics, inc};

/// What the shell needs of an agent's driver.
pub(crate) trait Driver: Send + Sync + 'static {
    /// The agent's side, for the log.
    const SIDE: Side;
    /// The agent's metrics (the control loop counts every message received).
    fn metrics(&self) -> &Metrics;
    /// Handles one control message.
    fn hear(self: Arc<Self>, env: Envelope) -> impl Future<Output = ()> + Send;
    /// The machine's next deadline, recorded (under the driver's lock) as what the timer task
    /// sleeps until, so a step that arms an earlier one knows to wake it.
    fn next_tick(&self) -> Option<std::time::Instant>;
    /// Feeds the machine its timer event now.
    fn tick(&self);
}

/// An agent's background tasks (its control loop and timer): stopped by
/// [`stop`](Self::stop) or when dropped with the agent.
#[derive(Debug, Default)]
pub(crate) struct Tasks(Vec<AbortHandle>);

impl Tasks {
    /// Starts the control loop over `channel` and the timer task of the agent `inner`; `wake`
    /// wakes the timer when a step armed an earlier deadline.
    pub(crate) fn start<T: Driver>(
        runtime: &Handle,
        inner: &Arc<T>,
        channel: Arc<dyn ControlChannel>,
        wake: Arc<Notify>,
    ) -> Self {
        let control = runtime.spawn(control_loop(channel, Arc::downgrade(inner)));
        let timer = runtime.spawn(timer_loop(Arc::downgrade(inner), wake));
        Self(vec![control.abort_handle(), timer.abort_handle()])
    }

    /// Stops every task.
    pub(crate) fn stop(&mut self) {
        for t in self.0.drain(..) {
            t.abort();
        }
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Hands every control message to the agent until the channel closes or the agent is gone.
/// Holds no strong reference while it waits.
async fn control_loop<T: Driver>(channel: Arc<dyn ControlChannel>, weak: Weak<T>) {
    loop {
        let env = match channel.recv().await {
            Ok(env) => env,
            Err(e) => {
                tracing::info!(side = T::SIDE.as_str(), error = %e, "control loop stops");
                return;
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        inc(&inner.metrics().control_received);
        inner.hear(env).await;
    }
}

/// Sleeps until the machine's next deadline and ticks it; woken early through `wake` when a
/// step armed an earlier one. Holds no strong reference while it sleeps, so it ends with the
/// agent.
async fn timer_loop<T: Driver>(weak: Weak<T>, wake: Arc<Notify>) {
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
