//! Per-peer FIFO send queues over a [`ControlChannel`], so a slow peer never blocks an agent's
//! control loop and messages to one peer keep their order.
//!
//! A queue that carried nothing for [`QUEUE_IDLE`] ends (the next message makes a new one), so
//! replies to endpoints a peer merely claimed (a ping from a made-up name) do not pile up
//! queues and tasks for ever.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvbridge_transport::sync::lock;
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

/// How long a peer's queue lives without a message.
pub(crate) const QUEUE_IDLE: Duration = Duration::from_secs(60);

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
        let sent = self.with_queues(|queues| {
            let mut message = message;
            // A queue that just ended for idleness is replaced once.
            for _ in 0..2 {
                let tx = match queues.get(to).filter(|tx| !tx.is_closed()) {
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
                        // Drop ended queues now and then (amortised: at each power of two).
                        if queues.len() >= 64 && queues.len().is_power_of_two() {
                            queues.retain(|_, tx| !tx.is_closed());
                        }
                        tx
                    }
                };
                match tx.try_send(message) {
                    Ok(()) => return Ok(()),
                    Err(TrySendError::Full(_)) => return Err(true),
                    Err(TrySendError::Closed(m)) => message = m,
                }
                queues.remove(to);
            }
            Err(false)
        });
        match sent {
            Ok(()) => {}
            Err(true) => (self.on_fail)(
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
            Err(false) => (self.on_fail)(
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

    /// Queues currently alive.
    #[cfg(test)]
    fn queue_count(&self) -> usize {
        self.with_queues(|queues| queues.values().filter(|tx| !tx.is_closed()).count())
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
        let mut queues = lock(&self.queues);
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
    loop {
        let message = match tokio::time::timeout(QUEUE_IDLE, rx.recv()).await {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(_) => {
                // Idle: close, then deliver what raced in (later sends make a new queue).
                rx.close();
                match rx.try_recv() {
                    Ok(m) => m,
                    Err(_) => return,
                }
            }
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::InProcessControlHub;
    use crate::messages::Heartbeat;

    #[tokio::test(start_paused = true)]
    async fn queues_of_quiet_peers_end_and_are_made_again_on_demand() {
        let hub = InProcessControlHub::new();
        let me: Arc<dyn ControlChannel> = Arc::new(hub.channel("me").unwrap());
        let peer = hub.channel("peer").unwrap();
        let outbox = Outbox::new(
            me,
            Duration::from_secs(1),
            8,
            Arc::new(Metrics::default()),
            Arc::new(|_: &Endpoint, _, _, _| {}),
        );
        // Answers to 200 names nobody holds (as to pings from made-up endpoints).
        for i in 0..200 {
            outbox.send(
                &Endpoint::new(format!("made-up-{i}")),
                ControlMessage::Pong(Heartbeat { nonce: i }),
            );
        }
        assert_eq!(outbox.queue_count(), 200);
        tokio::time::sleep(QUEUE_IDLE + Duration::from_secs(1)).await;
        assert_eq!(outbox.queue_count(), 0, "every quiet queue ended");
        // A real peer is still reached, by a new queue.
        outbox.send(
            &Endpoint::new("peer"),
            ControlMessage::Pong(Heartbeat { nonce: 7 }),
        );
        let got = peer.recv().await.unwrap();
        assert_eq!(got.message, ControlMessage::Pong(Heartbeat { nonce: 7 }));
        // The ended entries are dropped as the table grows (here when it reaches 256).
        for i in 200..255 {
            outbox.send(
                &Endpoint::new(format!("made-up-{i}")),
                ControlMessage::Pong(Heartbeat { nonce: i }),
            );
        }
        let held = outbox.with_queues(|q| q.len());
        assert_eq!(held, 56, "only the live queues are kept");
    }
}
