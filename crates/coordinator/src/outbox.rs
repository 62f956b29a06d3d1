//! Per-peer FIFO send queues over a [`ControlChannel`], so a slow peer never blocks an agent's
//! control loop and messages to one peer keep their order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

use crate::channel::{ControlChannel, Endpoint};
use crate::error::CoordinatorError;
use crate::messages::ControlMessage;
use crate::metrics::{Metrics, inc};

/// Called when a message could not be delivered: `(peer, message kind, room, error)`.
pub(crate) type SendFailed =
    Arc<dyn Fn(&Endpoint, &'static str, Option<u64>, CoordinatorError) + Send + Sync>;

/// A [`SendFailed`] that hands each failure to `handler` on the agent behind `weak`, on a task
/// of its own (the outbox may call it under its locks); nothing happens once the agent is gone.
pub(crate) fn send_failed_to<T: Send + Sync + 'static>(
    weak: Weak<T>,
    handler: fn(&T, &Endpoint, &'static str, Option<u64>, CoordinatorError),
) -> SendFailed {
    Arc::new(move |to, kind, room, err| {
        let w = weak.clone();
        let to = to.clone();
        tokio::spawn(async move {
            if let Some(inner) = w.upgrade() {
                handler(&inner, &to, kind, room, err);
            }
        });
    })
}

pub(crate) struct Outbox {
    channel: Arc<dyn ControlChannel>,
    timeout: Duration,
    capacity: usize,
    queues: Mutex<HashMap<Endpoint, mpsc::Sender<ControlMessage>>>,
    on_fail: SendFailed,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("timeout", &self.timeout)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Outbox {
    pub(crate) fn new(
        channel: Arc<dyn ControlChannel>,
        timeout: Duration,
        capacity: usize,
        metrics: Arc<Metrics>,
        on_fail: SendFailed,
    ) -> Self {
        Self {
            channel,
            timeout,
            capacity: capacity.max(1),
            queues: Mutex::new(HashMap::new()),
            on_fail,
            metrics,
        }
    }

    /// Queues `message` for `to`. Never waits: a full queue is reported through the failure
    /// callback (the peer is not reading).
    pub(crate) fn send(&self, to: &Endpoint, message: ControlMessage) {
        let kind = message.kind();
        let room = message.room();
        let tx = self.with_queues(|queues| match queues.get(to).filter(|tx| !tx.is_closed()) {
            Some(tx) => tx.clone(),
            None => {
                let (tx, rx) = mpsc::channel(self.capacity);
                tokio::spawn(drain(
                    self.channel.clone(),
                    to.clone(),
                    rx,
                    self.timeout,
                    self.on_fail.clone(),
                    self.metrics.clone(),
                ));
                queues.insert(to.clone(), tx.clone());
                tx
            }
        });
        match tx.try_send(message) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => (self.on_fail)(
                to,
                kind,
                room,
                CoordinatorError::ChannelSend {
                    channel: self.channel.name(),
                    endpoint: to.clone(),
                    reason: format!(
                        "{} control messages are already queued for this peer; it is not reading \
                         its control messages (overloaded, hung or gone)",
                        self.capacity
                    ),
                },
            ),
            Err(TrySendError::Closed(_)) => (self.on_fail)(
                to,
                kind,
                room,
                CoordinatorError::ChannelClosed {
                    channel: self.channel.name(),
                    reason: "the agent is shutting down".to_owned(),
                },
            ),
        }
    }

    /// Drops the queue of `to` (its task ends once the queue drains).
    pub(crate) fn forget(&self, to: &Endpoint) {
        self.with_queues(|queues| queues.remove(to));
    }

    /// Runs `f` on the queue table under its lock (the only place that takes it).
    fn with_queues<R>(
        &self,
        f: impl FnOnce(&mut HashMap<Endpoint, mpsc::Sender<ControlMessage>>) -> R,
    ) -> R {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut queues)
    }
}

async fn drain(
    channel: Arc<dyn ControlChannel>,
    to: Endpoint,
    mut rx: mpsc::Receiver<ControlMessage>,
    timeout: Duration,
    on_fail: SendFailed,
    metrics: Arc<Metrics>,
) {
    while let Some(message) = rx.recv().await {
        let kind = message.kind();
        let room = message.room();
        match tokio::time::timeout(timeout, channel.send(&to, message)).await {
            Ok(Ok(())) => inc(&metrics.control_sent),
            Ok(Err(e)) => on_fail(&to, kind, room, e),
            Err(_) => on_fail(
                &to,
                kind,
                room,
                CoordinatorError::SendTimeout {
                    channel: channel.name(),
                    endpoint: to.clone(),
                    message: kind,
                    timeout,
                },
            ),
        }
    }
}
