//! The control channel: how agents exchange small control messages (registration, per-room
//! metadata, status, abort, abort-ack, heartbeat).
//!
//! KV bytes never travel here; they go through a transport (`kvbridge_transport::KvTransport`).
//! The channel is a deliberately small trait so the same agents run in one process
//! ([`InProcessControlHub`]) and across processes (a TCP implementation framing
//! [`ControlMessage`]s as JSON).
//!
//! See [`ControlChannel`] for the contract every implementation honours.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvbridge_sync::lock;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

pub use crate::endpoint::Endpoint;
use crate::error::{ControlError, Result};
use crate::messages::ControlMessage;

/// A received control message and who sent it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The sender's [`ControlChannel::local_endpoint`] (reachable: heartbeats are answered
    /// there).
    pub from: Endpoint,
    /// The message.
    pub message: ControlMessage,
}

/// A bidirectional control channel bound to one local endpoint: how agents exchange small
/// control messages (registration, per-room metadata, status, abort, abort-ack, heartbeat).
/// KV bytes never travel here. Implementations: [`InProcessControlHub`] (one process) and a
/// network channel framing [`ControlMessage`]s as JSON.
///
/// # Contract for implementations
///
/// 1. **Addressing.** Endpoints are opaque strings ([`Endpoint`]); a channel knows its own
///    ([`ControlChannel::local_endpoint`]) and can send to any endpoint string a peer advertised.
/// 2. **Order.** Messages from one sender to one receiver arrive in the order they were sent
///    (the agents rely on a room's metadata arriving before its abort).
/// 3. **Bounded.** Queues are bounded; `send` may wait for room in the receiver's queue but
///    the agents always wrap it in a deadline, and report a [`SendTimeout`] naming the peer.
/// 4. **No hang on loss.** Sending to a peer that is gone fails (or is dropped, like a lost
///    datagram) instead of blocking forever; the agents' timeouts and heartbeat turn silence
///    into failures.
/// 5. **Self-contained messages.** Every [`ControlMessage`] is plain data (serde); nothing in it
///    refers to memory of the sending process, so a network implementation can frame it as JSON.
/// 6. **Sender identity.** [`Envelope::from`] is the sender's [`local_endpoint`] — the string
///    its peers use to reach it, not a socket's ephemeral address. Agents answer heartbeats
///    there; every other reply is addressed with the endpoints carried inside the messages.
///
/// [`local_endpoint`]: ControlChannel::local_endpoint
///
/// [`SendTimeout`]: ControlError::SendTimeout
#[async_trait::async_trait]
pub trait ControlChannel: Send + Sync + 'static {
    /// A short static name for logs and errors, e.g. `"in-process"` or `"tcp"`.
    fn name(&self) -> &'static str;

    /// This channel's own endpoint, which peers use to reach it.
    fn local_endpoint(&self) -> Endpoint;

    /// Sends `message` to `to`. May wait for queue space; never reorders messages to one peer.
    async fn send(&self, to: &Endpoint, message: ControlMessage) -> Result<()>;

    /// Waits for the next message from any peer. Returns
    /// [`ControlError::Closed`] once the channel is closed.
    async fn recv(&self) -> Result<Envelope>;
}

/// A trait object of any control channel.
pub type DynControlChannel = dyn ControlChannel;

#[async_trait::async_trait]
impl<T: ControlChannel + ?Sized> ControlChannel for Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn local_endpoint(&self) -> Endpoint {
        (**self).local_endpoint()
    }
    async fn send(&self, to: &Endpoint, message: ControlMessage) -> Result<()> {
        (**self).send(to, message).await
    }
    async fn recv(&self) -> Result<Envelope> {
        (**self).recv().await
    }
}

const IN_PROCESS: &str = "in-process";

/// Default per-endpoint queue length of the in-process hub.
pub const DEFAULT_HUB_QUEUE: usize = 1024;

#[derive(Debug)]
struct Slot {
    tx: mpsc::Sender<Envelope>,
    id: u64,
    partitioned: bool,
    stalled: bool,
}

#[derive(Debug, Default)]
struct HubState {
    slots: HashMap<Endpoint, Slot>,
    next_id: u64,
}

#[derive(Debug)]
struct HubInner {
    queue: usize,
    json_roundtrip: bool,
    state: Mutex<HubState>,
}

/// An in-process "network" of control endpoints: each [`InProcessChannel`] created from the
/// hub gets a bounded queue, and sends go straight into the destination's queue.
///
/// By default every message is serialised to JSON and parsed back on the way, so in-process
/// tests exercise exactly what crosses a process boundary. For fault tests the hub can
/// partition an endpoint (its messages in both directions vanish, like a dead host) or stall it
/// (sends to it never complete, like a peer that stopped reading its socket).
///
/// ```
/// use kvbridge_control::{ControlChannel, ControlMessage, Heartbeat, InProcessControlHub};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let hub = InProcessControlHub::new();
/// let a = hub.channel("a").unwrap();
/// let b = hub.channel("b").unwrap();
/// a.send(&b.local_endpoint(), ControlMessage::Ping(Heartbeat { nonce: 1 })).await.unwrap();
/// let got = b.recv().await.unwrap();
/// assert_eq!(got.from.as_str(), "a");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct InProcessControlHub {
    inner: Arc<HubInner>,
}

impl Default for InProcessControlHub {
    fn default() -> Self {
        Self::new()
    }
}

impl InProcessControlHub {
    /// A hub with [`DEFAULT_HUB_QUEUE`] messages per endpoint and JSON round-tripping on.
    pub fn new() -> Self {
        Self::with_options(DEFAULT_HUB_QUEUE, true)
    }

    /// A hub with `queue` messages per endpoint (at least 1) and JSON round-tripping on or off.
    pub fn with_options(queue: usize, json_roundtrip: bool) -> Self {
        Self {
            inner: Arc::new(HubInner {
                queue: queue.max(1),
                json_roundtrip,
                state: Mutex::new(HubState::default()),
            }),
        }
    }

    /// Creates the channel of endpoint `name`. Fails if the name is taken by a live channel.
    ///
    /// # Errors
    /// [`ControlError::Closed`] when the endpoint name is in use.
    pub fn channel(&self, name: impl Into<String>) -> Result<InProcessChannel> {
        let endpoint = Endpoint(name.into());
        let (tx, rx) = mpsc::channel(self.inner.queue);
        let id = self.inner.with_state(|st| {
            if st.slots.contains_key(&endpoint) {
                return Err(ControlError::Closed {
                    channel: IN_PROCESS,
                    reason: format!(
                        "endpoint {endpoint} is already taken on this hub; give every agent its own endpoint name"
                    ),
                });
            }
            st.next_id += 1;
            let id = st.next_id;
            st.slots.insert(
                endpoint.clone(),
                Slot {
                    tx,
                    id,
                    partitioned: false,
                    stalled: false,
                },
            );
            Ok(id)
        })?;
        Ok(InProcessChannel {
            hub: self.inner.clone(),
            endpoint,
            id,
            rx: tokio::sync::Mutex::new(rx),
        })
    }

    /// Partitions `endpoint` (or heals it): while partitioned, messages to it and from it are
    /// silently dropped, like packets to a dead or unreachable host.
    pub fn set_partitioned(&self, endpoint: &Endpoint, partitioned: bool) {
        self.inner.with_state(|st| {
            if let Some(slot) = st.slots.get_mut(endpoint) {
                slot.partitioned = partitioned;
            }
        });
    }

    /// Stalls `endpoint` (or un-stalls it): while stalled, sends to it never complete, like a
    /// peer that stopped reading a full socket.
    pub fn set_stalled(&self, endpoint: &Endpoint, stalled: bool) {
        self.inner.with_state(|st| {
            if let Some(slot) = st.slots.get_mut(endpoint) {
                slot.stalled = stalled;
            }
        });
    }

    /// Endpoints currently registered on the hub.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self
            .inner
            .with_state(|st| st.slots.keys().cloned().collect());
        v.sort();
        v
    }
}

impl HubInner {
    /// Runs `f` on the hub's state under its lock (the only place that takes it).
    fn with_state<R>(&self, f: impl FnOnce(&mut HubState) -> R) -> R {
        f(&mut lock(&self.state))
    }
}

/// One endpoint of an [`InProcessControlHub`]. Dropping it removes the endpoint from the hub
/// (later sends to it fail with [`ControlError::UnknownEndpoint`]).
#[derive(Debug)]
pub struct InProcessChannel {
    hub: Arc<HubInner>,
    endpoint: Endpoint,
    id: u64,
    rx: tokio::sync::Mutex<mpsc::Receiver<Envelope>>,
}

impl Drop for InProcessChannel {
    fn drop(&mut self) {
        let (endpoint, id) = (&self.endpoint, self.id);
        self.hub.with_state(|st| {
            if st.slots.get(endpoint).is_some_and(|s| s.id == id) {
                st.slots.remove(endpoint)
            } else {
                None
            }
        });
    }
}

#[async_trait::async_trait]
impl ControlChannel for InProcessChannel {
    fn name(&self) -> &'static str {
        IN_PROCESS
    }

    fn local_endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }

    async fn send(&self, to: &Endpoint, message: ControlMessage) -> Result<()> {
        let message = if self.hub.json_roundtrip {
            let text = serde_json::to_string(&message).map_err(|e| ControlError::Protocol {
                channel: IN_PROCESS,
                endpoint: self.endpoint.clone(),
                message: format!("message does not serialise to JSON: {e}"),
            })?;
            serde_json::from_str(&text).map_err(|e| ControlError::Protocol {
                channel: IN_PROCESS,
                endpoint: self.endpoint.clone(),
                message: format!("message does not parse back from its JSON {text}: {e}"),
            })?
        } else {
            message
        };
        let (tx, drop_it, stalled) = self.hub.with_state(|st| {
            let me_partitioned = st.slots.get(&self.endpoint).is_some_and(|s| s.partitioned);
            match st.slots.get(to) {
                None => Err(ControlError::UnknownEndpoint {
                    channel: IN_PROCESS,
                    endpoint: to.clone(),
                }),
                Some(slot) => Ok((
                    slot.tx.clone(),
                    me_partitioned || slot.partitioned,
                    slot.stalled,
                )),
            }
        })?;
        if stalled {
            std::future::pending::<()>().await;
        }
        if drop_it {
            tracing::trace!(to = %to, kind = message.kind(), "in-process hub: partitioned, message dropped");
            return Ok(());
        }
        tx.send(Envelope {
            from: self.endpoint.clone(),
            message,
        })
        .await
        .map_err(|_| ControlError::UnknownEndpoint {
            channel: IN_PROCESS,
            endpoint: to.clone(),
        })
    }

    async fn recv(&self) -> Result<Envelope> {
        let mut rx = self.rx.lock().await;
        rx.recv().await.ok_or_else(|| ControlError::Closed {
            channel: IN_PROCESS,
            reason: format!("endpoint {} was removed from its hub", self.endpoint),
        })
    }
}
