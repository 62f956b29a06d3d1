//! A [`ControlChannel`] over TCP, for agents in different processes or hosts.
//!
//! Every channel listens on one socket (127.0.0.1 and an OS-assigned port by default); its
//! [`Endpoint`] is the text `ip:port`, which peers put in their messages. Sending to an
//! endpoint opens one outbound connection to it (kept, and re-opened after a loss), so a pair
//! of agents talks over two connections, one per direction (like SGLang's ZMQ PUSH → PULL).
//!
//! # Wire format (version [`TCP_WIRE_VERSION`])
//!
//! docs/control-protocol.md, "TCP channel", specifies it byte by byte. In short: a client
//! hello (magic `KVBCTRL\0`, major version, flags with the minor version in their high byte, a
//! 16-byte nonce, the client's own endpoint), a server hello (magic, version, flags, its nonce,
//! its proof of the shared secret), the client's proof, the server's verdict, then `u32`-length
//! frames of one [`ControlMessage`] as JSON, client to server only. Peers of the same major
//! speak the lower minor; another major is refused with [`ControlError::VersionMismatch`]'s
//! text. The proofs are the kvbridge-auth challenge-response (labels
//! `kvbridge-control/1 client|server`) over both nonces and the endpoint name, so neither can be
//! replayed on another connection; they are compared in constant time. The secret
//! authenticates connections; it does not encrypt or sign frames (run the channel on a trusted
//! network, as the transports).
//!
//! # Hardening
//!
//! A version or secret mismatch, a malformed hello, a frame of length 0 or above
//! `max_frame_len`, or a frame that is not a control message each close that connection with a
//! logged reason and a counter in [`TcpControlStats`]; a well-formed message of a type this
//! version does not know (a newer minor's) is skipped and counted. Nothing a peer claims sizes
//! an allocation beyond `max_frame_len`, and nothing panics. A handshake must finish within
//! [`TcpControlConfig::handshake_timeout`], a frame whose first byte arrived must complete
//! within [`TcpControlConfig::frame_timeout`], and a connection on which no frame starts for
//! [`TcpControlConfig::idle_timeout`] is closed (the sending side closes its own after half of
//! that, so it is the one to end a quiet connection). Inbound connections are capped at
//! [`TcpControlConfig::max_connections`], the peer table at [`TcpControlConfig::max_peers`]:
//! an entry whose connect fails is removed, a full table drops ended and then idle entries,
//! and with every entry busy a send uses a connection of its own, so endpoint names a peer
//! claims cannot keep a later peer out. Every queue is bounded by [`TcpControlConfig::queue`]
//! messages. When a connection ends, both sides log why (docs/control-protocol.md, "Bounds",
//! lists every bound).
//!
//! # Loss
//!
//! A send to an endpoint nobody listens on fails at once ([`ControlError::Send`]). When an
//! established connection breaks, the messages still queued on it are lost (the contract's
//! "dropped like a datagram": the agents' deadlines and heartbeats turn that into failures)
//! and the next send reconnects.
//!
//! ```
//! use kvbridge_control::tcp::{TcpControlChannel, TcpControlConfig};
//! use kvbridge_control::{ControlChannel, ControlMessage, Heartbeat};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> kvbridge_control::Result<()> {
//! let config = TcpControlConfig::default().with_secret(b"s3cret".to_vec());
//! let a = TcpControlChannel::bind(config.clone()).await?;
//! let b = TcpControlChannel::bind(config).await?;
//! a.send(&b.local_endpoint(), ControlMessage::Ping(Heartbeat { nonce: 1 })).await?;
//! let got = b.recv().await?;
//! assert_eq!(got.from, a.local_endpoint());
//! assert_eq!(got.message, ControlMessage::Ping(Heartbeat { nonce: 1 }));
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvbridge_auth::{Label, Secret};
use kvbridge_sync::lock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::channel::{ControlChannel, Envelope};
use crate::endpoint::Endpoint;
use crate::error::{ControlError, Result};
use crate::listen::{Accepted, accept_bounded, closed};
use crate::messages::ControlMessage;
use crate::version::ProtocolVersion;

/// The channel's name in logs and errors.
pub const TCP_CHANNEL_NAME: &str = "tcp";

/// Version of the wire format in the [module docs](self). Peers of the same major speak the
/// lower minor; a peer of another major is refused during the handshake. Minor 1 added the
/// minor (in the flags' high byte) and skipping messages of unknown type.
pub const TCP_WIRE_VERSION: ProtocolVersion = ProtocolVersion::new(1, 1);

/// Longest endpoint name a client hello may carry.
pub const MAX_ENDPOINT_LEN: usize = 255;

/// Smallest and largest accepted [`TcpControlConfig::max_frame_len`].
pub const FRAME_LEN_RANGE: std::ops::RangeInclusive<u32> = 4096..=(64 << 20);

const MAGIC: [u8; 8] = *b"KVBCTRL\0";
const NONCE_LEN: usize = 16;
const TAG_LEN: usize = 32;
const MAX_REASON_LEN: usize = 1024;
const FLAG_SECRET: u16 = 1;
/// The flags' high byte carries the sender's minor version (0 from releases before minors).
const MINOR_SHIFT: u16 = 8;
const _: () = assert!(
    TCP_WIRE_VERSION.minor <= 0xff,
    "the minor must fit the flags' high byte"
);
const CLIENT_LABEL: Label = Label::CONTROL_CLIENT;
const SERVER_LABEL: Label = Label::CONTROL_SERVER;

/// Settings of a [`TcpControlChannel`]. Both sides should use the same secret and frame limit.
#[derive(Clone)]
#[non_exhaustive]
pub struct TcpControlConfig {
    /// Address the listener binds. Default `127.0.0.1:0` (loopback, OS-assigned port).
    pub bind_addr: SocketAddr,
    /// Address put in the endpoint when the bound one is not reachable by peers (e.g. when
    /// binding `0.0.0.0`). Default: the bound address.
    pub advertise_addr: Option<IpAddr>,
    /// Shared secret both sides must prove (HMAC-SHA256 challenge-response). Default: none.
    pub secret: Option<Secret>,
    /// Largest frame (one JSON message) sent or accepted, in bytes. Default 1 MiB.
    pub max_frame_len: u32,
    /// Messages queued for `recv`, and per outbound peer, before senders wait. Default 1024.
    pub queue: usize,
    /// Inbound connections served at once; more are closed at once. Default 1024.
    pub max_connections: usize,
    /// Endpoints whose connection is kept (the peer table). A full table drops ended, then
    /// idle entries; with every entry busy, a send to a new endpoint uses a connection of its
    /// own that closes after it. Default 4096.
    pub max_peers: usize,
    /// Time allowed for a TCP connect. Default 2 s.
    pub connect_timeout: Duration,
    /// Time allowed for the hello exchange, either side. Default 5 s.
    pub handshake_timeout: Duration,
    /// Time a frame has to arrive completely once its first byte did. Default 10 s.
    pub frame_timeout: Duration,
    /// Time one frame may take to write before the connection is dropped. Default 10 s.
    pub write_timeout: Duration,
    /// An accepted connection on which no frame starts for this long is closed. A sending
    /// side closes its own connection after half of it without a frame, so with the same
    /// setting on both sides the sender ends an idle connection first and no frame is lost to
    /// the race. Default 60 s.
    pub idle_timeout: Duration,
}

impl std::fmt::Debug for TcpControlConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpControlConfig")
            .field("bind_addr", &self.bind_addr)
            .field("advertise_addr", &self.advertise_addr)
            .field("secret", &self.secret)
            .field("max_frame_len", &self.max_frame_len)
            .field("queue", &self.queue)
            .field("max_connections", &self.max_connections)
            .field("max_peers", &self.max_peers)
            .field("connect_timeout", &self.connect_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("frame_timeout", &self.frame_timeout)
            .field("write_timeout", &self.write_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

impl Default for TcpControlConfig {
    fn default() -> Self {
        Self {
            bind_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise_addr: None,
            secret: None,
            max_frame_len: 1 << 20,
            queue: 1024,
            max_connections: 1024,
            max_peers: 4096,
            connect_timeout: Duration::from_secs(2),
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

impl TcpControlConfig {
    /// Sets [`secret`](Self::secret).
    #[must_use]
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(Secret::new(secret));
        self
    }

    /// Sets [`bind_addr`](Self::bind_addr).
    #[must_use]
    pub fn with_bind_addr(mut self, addr: SocketAddr) -> Self {
        self.bind_addr = addr;
        self
    }

    /// Sets [`advertise_addr`](Self::advertise_addr).
    #[must_use]
    pub fn with_advertise_addr(mut self, addr: IpAddr) -> Self {
        self.advertise_addr = Some(addr);
        self
    }

    /// Sets [`max_frame_len`](Self::max_frame_len).
    #[must_use]
    pub fn with_max_frame_len(mut self, len: u32) -> Self {
        self.max_frame_len = len;
        self
    }

    /// Sets [`queue`](Self::queue).
    #[must_use]
    pub fn with_queue(mut self, queue: usize) -> Self {
        self.queue = queue;
        self
    }

    /// Sets [`max_connections`](Self::max_connections).
    #[must_use]
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets [`max_peers`](Self::max_peers).
    #[must_use]
    pub fn with_max_peers(mut self, n: usize) -> Self {
        self.max_peers = n;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    #[must_use]
    pub fn with_connect_timeout(mut self, v: Duration) -> Self {
        self.connect_timeout = v;
        self
    }

    /// Sets [`handshake_timeout`](Self::handshake_timeout).
    #[must_use]
    pub fn with_handshake_timeout(mut self, v: Duration) -> Self {
        self.handshake_timeout = v;
        self
    }

    /// Sets [`frame_timeout`](Self::frame_timeout).
    #[must_use]
    pub fn with_frame_timeout(mut self, v: Duration) -> Self {
        self.frame_timeout = v;
        self
    }

    /// Sets [`write_timeout`](Self::write_timeout).
    #[must_use]
    pub fn with_write_timeout(mut self, v: Duration) -> Self {
        self.write_timeout = v;
        self
    }

    /// Sets [`idle_timeout`](Self::idle_timeout).
    #[must_use]
    pub fn with_idle_timeout(mut self, idle: Duration) -> Self {
        self.idle_timeout = idle;
        self
    }

    /// Checks every value is in range.
    ///
    /// # Errors
    /// [`ControlError::InvalidConfig`] naming the field, its value and the allowed range.
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Err(ControlError::InvalidConfig { message });
        if !FRAME_LEN_RANGE.contains(&self.max_frame_len) {
            return bad(format!(
                "TcpControlConfig::max_frame_len must be in {}..={} bytes, got {}",
                FRAME_LEN_RANGE.start(),
                FRAME_LEN_RANGE.end(),
                self.max_frame_len
            ));
        }
        if self.secret.as_ref().is_some_and(Secret::is_empty) {
            return bad(
                "TcpControlConfig::secret is empty; pass a non-empty secret or none".to_owned(),
            );
        }
        for (name, v) in [
            ("queue", self.queue),
            ("max_connections", self.max_connections),
            ("max_peers", self.max_peers),
        ] {
            if v == 0 {
                return bad(format!(
                    "TcpControlConfig::{name} must be at least 1, got 0"
                ));
            }
        }
        for (name, v) in [
            ("connect_timeout", self.connect_timeout),
            ("handshake_timeout", self.handshake_timeout),
            ("frame_timeout", self.frame_timeout),
            ("write_timeout", self.write_timeout),
            ("idle_timeout", self.idle_timeout),
        ] {
            if v.is_zero() {
                return bad(format!(
                    "TcpControlConfig::{name} must be positive, got {v:?}"
                ));
            }
        }
        Ok(())
    }
}

/// Counters of a [`TcpControlChannel`], for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpControlStats {
    /// Inbound connections that completed the handshake.
    pub accepted: u64,
    /// Inbound connections closed during the handshake (bad magic, version, secret, timeout).
    pub refused: u64,
    /// Inbound connections closed at once because `max_connections` were open.
    pub over_limit: u64,
    /// Inbound connections closed for a bad frame (length, JSON, timeout).
    pub protocol_errors: u64,
    /// Messages of a type this version does not know (a newer minor's), skipped.
    pub unknown_skipped: u64,
    /// Messages received.
    pub frames_received: u64,
    /// Messages handed to a connection for sending.
    pub frames_sent: u64,
    /// Outbound connections opened (first connects and reconnects).
    pub connects: u64,
    /// Inbound connections closed because no frame started within `idle_timeout`.
    pub idle_closed: u64,
    /// Peer-table entries removed: failed connects, dead connections, and idle peers evicted
    /// to make room for a new one.
    pub peers_pruned: u64,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    refused: AtomicU64,
    over_limit: AtomicU64,
    protocol_errors: AtomicU64,
    unknown_skipped: AtomicU64,
    frames_received: AtomicU64,
    frames_sent: AtomicU64,
    connects: AtomicU64,
    idle_closed: AtomicU64,
    peers_pruned: AtomicU64,
}

/// Resolves once the shutdown flag is set (at once if it already is).
fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// One outbound connection: a bounded queue of encoded frames drained by a writer task.
#[derive(Debug)]
struct OutConn {
    tx: mpsc::Sender<Vec<u8>>,
}

#[derive(Debug, Default)]
struct PeerSlot {
    conn: tokio::sync::Mutex<Option<OutConn>>,
}

impl PeerSlot {
    /// No connection, or one whose writer ended (and no send is using the slot).
    fn is_dead(&self) -> bool {
        self.conn
            .try_lock()
            .is_ok_and(|c| c.as_ref().is_none_or(|c| c.tx.is_closed()))
    }

    /// Nothing queued and no send using the slot: dropping it loses nothing (its writer
    /// finishes a frame in progress, then closes the connection).
    fn is_idle(&self) -> bool {
        self.conn.try_lock().is_ok_and(|c| {
            c.as_ref()
                .is_none_or(|c| c.tx.capacity() == c.tx.max_capacity())
        })
    }
}

#[derive(Debug)]
struct PeerEntry {
    slot: Arc<PeerSlot>,
    last_used: tokio::time::Instant,
}

#[derive(Debug)]
struct Shared {
    config: TcpControlConfig,
    endpoint: Endpoint,
    counters: Counters,
    /// Only [`Shared::with_peers`] locks it.
    peers: Mutex<HashMap<Endpoint, PeerEntry>>,
    shutdown: watch::Sender<bool>,
}

impl Shared {
    /// Runs `f` on the peer table under its lock (the only place that takes it).
    fn with_peers<R>(&self, f: impl FnOnce(&mut HashMap<Endpoint, PeerEntry>) -> R) -> R {
        f(&mut lock(&self.peers))
    }

    /// Removes `to`'s entry if it still holds `slot` (a connect through it failed).
    fn forget_slot(&self, to: &Endpoint, slot: &Arc<PeerSlot>) {
        let removed = self.with_peers(|peers| {
            let ours = peers.get(to).is_some_and(|e| Arc::ptr_eq(&e.slot, slot));
            ours && peers.remove(to).is_some()
        });
        if removed {
            bump(&self.counters.peers_pruned);
        }
    }
}

/// A [`ControlChannel`] over TCP; see the [module docs](self) for the wire format and limits.
///
/// Dropping it (or [`close`](Self::close)) stops the listener and every connection task.
#[derive(Debug)]
pub struct TcpControlChannel {
    shared: Arc<Shared>,
    rx: tokio::sync::Mutex<mpsc::Receiver<Envelope>>,
}

impl Drop for TcpControlChannel {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
    }
}

impl TcpControlChannel {
    /// Binds the listener and starts accepting peers. Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`ControlError::InvalidConfig`] for an invalid config or an address that cannot be
    /// bound.
    pub async fn bind(config: TcpControlConfig) -> Result<Self> {
        config.validate()?;
        let listener = TcpListener::bind(config.bind_addr).await.map_err(|e| {
            ControlError::InvalidConfig {
                message: format!(
                    "the control channel cannot listen on {}: {e}; choose a free address or port 0",
                    config.bind_addr
                ),
            }
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| ControlError::InvalidConfig {
                message: format!("the control channel's listener has no local address: {e}"),
            })?;
        let ip = config.advertise_addr.unwrap_or(local.ip());
        let endpoint = Endpoint(SocketAddr::new(ip, local.port()).to_string());
        let (tx, rx) = mpsc::channel(config.queue);
        let (shutdown, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            config,
            endpoint,
            counters: Counters::default(),
            peers: Mutex::new(HashMap::new()),
            shutdown,
        });
        tokio::spawn(accept_loop(listener, shared.clone(), tx));
        tracing::debug!(endpoint = %shared.endpoint, "control channel listening");
        Ok(Self {
            shared,
            rx: tokio::sync::Mutex::new(rx),
        })
    }

    /// A snapshot of the channel's counters.
    pub fn stats(&self) -> TcpControlStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TcpControlStats {
            accepted: g(&c.accepted),
            refused: g(&c.refused),
            over_limit: g(&c.over_limit),
            protocol_errors: g(&c.protocol_errors),
            unknown_skipped: g(&c.unknown_skipped),
            frames_received: g(&c.frames_received),
            frames_sent: g(&c.frames_sent),
            connects: g(&c.connects),
            idle_closed: g(&c.idle_closed),
            peers_pruned: g(&c.peers_pruned),
        }
    }

    /// Endpoints currently in the peer table (at most [`TcpControlConfig::max_peers`]).
    pub fn peer_count(&self) -> usize {
        self.shared.with_peers(|peers| peers.len())
    }

    /// The settings the channel runs with.
    pub fn config(&self) -> &TcpControlConfig {
        &self.shared.config
    }

    /// Stops the listener and every connection; `recv` then returns
    /// [`ControlError::Closed`] and `send` fails.
    pub fn close(&self) {
        self.shared.shutdown.send_replace(true);
        self.shared.with_peers(HashMap::clear);
    }

    fn closed_error(&self) -> ControlError {
        ControlError::Closed {
            channel: TCP_CHANNEL_NAME,
            reason: format!("the channel of {} was closed", self.shared.endpoint),
        }
    }

    /// The peer-table entry of `to`, made if needed. A full table first drops its dead
    /// entries, then its least recently used idle one, so names a peer merely claims (and
    /// that are never reached, or go quiet) cannot keep a later peer out. When every entry
    /// is busy the send gets a slot outside the table: its connection serves this send and
    /// closes once its frames are written, so a full table never refuses a send.
    fn slot(&self, to: &Endpoint) -> Arc<PeerSlot> {
        let max_peers = self.shared.config.max_peers;
        let now = tokio::time::Instant::now();
        let (slot, pruned) = self.shared.with_peers(|peers| {
            if let Some(e) = peers.get_mut(to) {
                e.last_used = now;
                return (e.slot.clone(), 0);
            }
            let before = peers.len();
            if before >= max_peers {
                peers.retain(|_, e| !e.slot.is_dead());
            }
            if peers.len() >= max_peers {
                let lru = peers
                    .iter()
                    .filter(|(_, e)| e.slot.is_idle())
                    .min_by_key(|(_, e)| e.last_used)
                    .map(|(k, _)| k.clone());
                if let Some(k) = lru {
                    peers.remove(&k);
                }
            }
            let pruned = (before - peers.len()) as u64;
            let s = Arc::new(PeerSlot::default());
            if peers.len() < max_peers {
                peers.insert(
                    to.clone(),
                    PeerEntry {
                        slot: s.clone(),
                        last_used: now,
                    },
                );
            }
            (s, pruned)
        });
        self.shared
            .counters
            .peers_pruned
            .fetch_add(pruned, Ordering::Relaxed);
        slot
    }
}

#[async_trait::async_trait]
impl ControlChannel for TcpControlChannel {
    fn name(&self) -> &'static str {
        TCP_CHANNEL_NAME
    }

    fn local_endpoint(&self) -> Endpoint {
        self.shared.endpoint.clone()
    }

    async fn send(&self, to: &Endpoint, message: ControlMessage) -> Result<()> {
        if *self.shared.shutdown.borrow() {
            return Err(self.closed_error());
        }
        let max = self.shared.config.max_frame_len as usize;
        let json = serde_json::to_vec(&message).map_err(|e| ControlError::Send {
            channel: TCP_CHANNEL_NAME,
            endpoint: to.clone(),
            reason: format!(
                "the {} message does not serialise to JSON: {e}",
                message.kind()
            ),
        })?;
        if json.len() > max {
            return Err(ControlError::Send {
                channel: TCP_CHANNEL_NAME,
                endpoint: to.clone(),
                reason: format!(
                    "the {} message is {} bytes of JSON, above max_frame_len {max}; raise \
                     TcpControlConfig::max_frame_len on both sides",
                    message.kind(),
                    json.len()
                ),
            });
        }
        let mut frame = Vec::with_capacity(4 + json.len());
        frame.extend_from_slice(&(json.len() as u32).to_be_bytes());
        frame.extend_from_slice(&json);
        let slot = self.slot(to);
        let mut conn = slot.conn.lock().await;
        // At most one reconnect per send: a connection found broken is replaced once.
        for _ in 0..2 {
            if conn.as_ref().is_none_or(|c| c.tx.is_closed()) {
                match connect(&self.shared, to).await {
                    Ok(c) => *conn = Some(c),
                    Err(e) => {
                        // An endpoint that cannot be reached keeps no entry.
                        self.shared.forget_slot(to, &slot);
                        return Err(e);
                    }
                }
            }
            let Some(c) = conn.as_ref() else { continue };
            match c.tx.send(frame).await {
                Ok(()) => {
                    bump(&self.shared.counters.frames_sent);
                    return Ok(());
                }
                Err(mpsc::error::SendError(f)) => {
                    frame = f;
                    *conn = None;
                }
            }
        }
        Err(ControlError::Send {
            channel: TCP_CHANNEL_NAME,
            endpoint: to.clone(),
            reason: "the connection broke twice in a row while sending; the peer is closing \
                     connections (restarting, or refusing this side)"
                .to_owned(),
        })
    }

    async fn recv(&self) -> Result<Envelope> {
        let mut shutdown = self.shared.shutdown.subscribe();
        if *shutdown.borrow_and_update() {
            return Err(self.closed_error());
        }
        let mut rx = self.rx.lock().await;
        tokio::select! {
            got = rx.recv() => got.ok_or_else(|| self.closed_error()),
            _ = closed(&mut shutdown) => Err(self.closed_error()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake pieces (sans-IO helpers, unit tested below).

/// A fresh nonce for a hello (16 bytes on this wire; kvbridge-auth is the random source).
fn nonce() -> [u8; NONCE_LEN] {
    let mut out = [0u8; NONCE_LEN];
    kvbridge_auth::random_bytes(&mut out);
    out
}

/// The transcript both tags cover: both nonces and the client's endpoint name (length first).
fn transcript<'a>(
    cn: &'a [u8; NONCE_LEN],
    sn: &'a [u8; NONCE_LEN],
    len: &'a [u8; 2],
    endpoint: &'a [u8],
) -> [&'a [u8]; 4] {
    [cn, sn, len, endpoint]
}

/// The tag of `label` over the transcript, or zeros without a secret.
fn tag_bytes(
    secret: Option<&Secret>,
    label: Label,
    cn: &[u8; NONCE_LEN],
    sn: &[u8; NONCE_LEN],
    endpoint: &[u8],
) -> [u8; TAG_LEN] {
    let len = (endpoint.len() as u16).to_be_bytes();
    secret.map_or([0; TAG_LEN], |s| {
        kvbridge_auth::prove(s, label, &transcript(cn, sn, &len, endpoint)).into()
    })
}

/// Checks a tag in constant time.
fn verify_tag(
    secret: &Secret,
    label: Label,
    cn: &[u8; NONCE_LEN],
    sn: &[u8; NONCE_LEN],
    endpoint: &[u8],
    got: &[u8],
) -> bool {
    let len = (endpoint.len() as u16).to_be_bytes();
    kvbridge_auth::verify(secret, label, &transcript(cn, sn, &len, endpoint), got).is_ok()
}

/// The fixed part of either hello: magic, version, flags, nonce.
const HELLO_HEAD: usize = 8 + 2 + 2 + NONCE_LEN;

fn encode_head(flags: u16, nonce: &[u8; NONCE_LEN]) -> [u8; HELLO_HEAD] {
    let mut h = [0u8; HELLO_HEAD];
    h[..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&TCP_WIRE_VERSION.major.to_be_bytes());
    let flags = flags | (TCP_WIRE_VERSION.minor << MINOR_SHIFT);
    h[10..12].copy_from_slice(&flags.to_be_bytes());
    h[12..].copy_from_slice(nonce);
    h
}

/// Parses a hello head: `(version, flags without the minor, nonce)`, or why it is not one.
fn decode_head(
    h: &[u8; HELLO_HEAD],
) -> std::result::Result<(ProtocolVersion, u16, [u8; NONCE_LEN]), String> {
    if h[..8] != MAGIC {
        return Err(format!(
            "the peer did not open with the kvbridge control preface (got {:02x?}); it is not a \
             kvbridge control channel",
            &h[..8]
        ));
    }
    let major = u16::from_be_bytes([h[8], h[9]]);
    let flags = u16::from_be_bytes([h[10], h[11]]);
    let mut n = [0u8; NONCE_LEN];
    n.copy_from_slice(&h[12..]);
    let version = ProtocolVersion::new(major, flags >> MINOR_SHIFT);
    Ok((version, flags & ((1 << MINOR_SHIFT) - 1), n))
}

/// The version both sides speak, or the refusal's text when the majors differ.
fn negotiate(theirs: ProtocolVersion) -> std::result::Result<ProtocolVersion, String> {
    TCP_WIRE_VERSION.negotiate(theirs).ok_or_else(|| {
        ControlError::VersionMismatch {
            protocol: "control channel wire",
            ours: TCP_WIRE_VERSION,
            theirs,
        }
        .to_string()
    })
}

/// Checks an endpoint name from a hello: 1..=255 bytes of printable UTF-8.
fn parse_endpoint(bytes: &[u8]) -> std::result::Result<Endpoint, String> {
    let s = std::str::from_utf8(bytes)
        .map_err(|_| "the peer's endpoint name is not UTF-8".to_owned())?;
    if s.is_empty() || s.len() > MAX_ENDPOINT_LEN || s.chars().any(char::is_control) {
        return Err(format!(
            "the peer's endpoint name {s:?} must be 1..={MAX_ENDPOINT_LEN} printable characters"
        ));
    }
    Ok(Endpoint(s.to_owned()))
}

fn flags_of(secret: Option<&Secret>) -> u16 {
    if secret.is_some() { FLAG_SECRET } else { 0 }
}

// ---------------------------------------------------------------------------------------------
// Outbound side.

async fn resolve(to: &Endpoint) -> std::result::Result<SocketAddr, String> {
    if let Ok(a) = to.as_str().parse::<SocketAddr>() {
        return Ok(a);
    }
    let mut addrs = tokio::net::lookup_host(to.as_str())
        .await
        .map_err(|e| format!("the endpoint is not an ip:port or a resolvable host:port ({e})"))?;
    addrs
        .next()
        .ok_or_else(|| "the endpoint's host name resolves to no address".to_owned())
}

async fn connect(shared: &Arc<Shared>, to: &Endpoint) -> Result<OutConn> {
    let cfg = &shared.config;
    let fail = |reason: String| ControlError::Send {
        channel: TCP_CHANNEL_NAME,
        endpoint: to.clone(),
        reason,
    };
    let addr = resolve(to).await.map_err(fail)?;
    let mut stream = match tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(addr)).await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(fail(format!(
                "cannot connect to {addr}: {e}; the peer is not running or not listening there"
            )));
        }
        Err(_) => {
            return Err(fail(format!(
                "connecting to {addr} did not finish within {:?}",
                cfg.connect_timeout
            )));
        }
    };
    let _ = stream.set_nodelay(true);
    match tokio::time::timeout(cfg.handshake_timeout, client_handshake(shared, &mut stream)).await {
        Ok(Ok(())) => {}
        Ok(Err(reason)) => return Err(fail(reason)),
        Err(_) => {
            return Err(fail(format!(
                "the peer did not complete the control-channel handshake within {:?}",
                cfg.handshake_timeout
            )));
        }
    }
    bump(&shared.counters.connects);
    let (tx, rx) = mpsc::channel(cfg.queue);
    tokio::spawn(writer(
        stream,
        rx,
        to.clone(),
        cfg.clone(),
        shared.shutdown.subscribe(),
    ));
    Ok(OutConn { tx })
}

async fn client_handshake(
    shared: &Shared,
    stream: &mut TcpStream,
) -> std::result::Result<(), String> {
    let secret = shared.config.secret.as_ref();
    let io = |e: std::io::Error| {
        format!(
            "the connection failed during the control-channel handshake ({e}); the peer may be \
             at its connection limit, or not a kvbridge control channel"
        )
    };
    let cn = nonce();
    let name = shared.endpoint.as_str().as_bytes();
    let mut hello = encode_head(flags_of(secret), &cn).to_vec();
    hello.extend_from_slice(&(name.len() as u16).to_be_bytes());
    hello.extend_from_slice(name);
    stream.write_all(&hello).await.map_err(io)?;
    let mut head = [0u8; HELLO_HEAD];
    stream.read_exact(&mut head).await.map_err(io)?;
    let (version, flags, sn) = decode_head(&head)?;
    let mut server_tag = [0u8; TAG_LEN];
    stream.read_exact(&mut server_tag).await.map_err(io)?;
    let spoken = negotiate(version)?;
    match (secret, flags & FLAG_SECRET != 0) {
        (Some(_), false) => {
            return Err(
                "the peer does not use a shared secret but this side does; configure the same \
                 secret on both sides"
                    .to_owned(),
            );
        }
        (None, true) => {
            return Err(
                "the peer requires a shared secret but this side has none; configure the same \
                 secret on both sides"
                    .to_owned(),
            );
        }
        (Some(s), true) => {
            if !verify_tag(s, SERVER_LABEL, &cn, &sn, name, &server_tag) {
                return Err(
                    "the peer could not prove the shared secret (wrong secret); configure the \
                     same secret on both sides"
                        .to_owned(),
                );
            }
        }
        (None, false) => {}
    }
    tracing::trace!(peer = %shared.endpoint, version = %spoken, "control channel: version agreed");
    let proof = tag_bytes(secret, CLIENT_LABEL, &cn, &sn, name);
    stream.write_all(&proof).await.map_err(io)?;
    let mut verdict = [0u8; 3];
    stream.read_exact(&mut verdict).await.map_err(io)?;
    let len = usize::from(u16::from_be_bytes([verdict[1], verdict[2]])).min(MAX_REASON_LEN);
    let mut reason = vec![0u8; len];
    stream.read_exact(&mut reason).await.map_err(io)?;
    match verdict[0] {
        0 => Ok(()),
        _ => Err(format!(
            "the peer refused the connection: {}",
            String::from_utf8_lossy(&reason)
        )),
    }
}

async fn writer(
    stream: TcpStream,
    mut rx: mpsc::Receiver<Vec<u8>>,
    to: Endpoint,
    cfg: TcpControlConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    let (mut rd, mut wr) = stream.into_split();
    let mut probe = [0u8; 64];
    // Half the receiver's idle bound: this side ends a quiet connection first, so no frame is
    // written into a connection the receiver is closing.
    let idle = cfg.idle_timeout / 2;
    let mut frames = 0u64;
    loop {
        tokio::select! {
            biased;
            frame = rx.recv() => {
                let Some(frame) = frame else {
                    tracing::debug!(peer = %to, frames, "outbound control connection no longer used; closing it");
                    return;
                };
                match tokio::time::timeout(cfg.write_timeout, wr.write_all(&frame)).await {
                    Ok(Ok(())) => frames += 1,
                    Ok(Err(e)) => {
                        tracing::warn!(peer = %to, error = %e, frames, frame_len = frame.len(), "control connection lost while writing a frame (the frame is lost; the peer's log says why it closed); the next send reconnects");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(peer = %to, timeout = ?cfg.write_timeout, frames, "control connection dropped: the peer did not read a frame within write_timeout");
                        return;
                    }
                }
            }
            // The server never writes after the verdict: any read result means the connection
            // is gone (or the peer broke the protocol).
            r = rd.read(&mut probe) => {
                match r {
                    Ok(0) => tracing::info!(peer = %to, frames, "control connection closed by the peer (end of stream: it shut down, restarted, or refused a frame; its log says why); the next send reconnects"),
                    Ok(n) => tracing::warn!(peer = %to, bytes = n, "the peer wrote after its verdict, which the protocol forbids; closing the connection"),
                    Err(e) => tracing::warn!(peer = %to, error = %e, frames, "control connection failed while idle; the next send reconnects"),
                }
                return;
            }
            () = tokio::time::sleep(idle) => {
                // Frames queued meanwhile are still written; later sends see the queue closed
                // and reconnect.
                rx.close();
                while let Ok(frame) = rx.try_recv() {
                    if tokio::time::timeout(cfg.write_timeout, wr.write_all(&frame)).await.is_err() {
                        break;
                    }
                }
                tracing::debug!(peer = %to, idle = ?idle, frames, "closing an idle outbound control connection (half of idle_timeout without a frame); the next send reconnects");
                return;
            }
            _ = closed(&mut shutdown) => return,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Inbound side.

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, tx: mpsc::Sender<Envelope>) {
    let limit = Arc::new(Semaphore::new(shared.config.max_connections));
    let mut shutdown = shared.shutdown.subscribe();
    while let Some(accepted) =
        accept_bounded(&listener, &limit, &mut shutdown, "control channel").await
    {
        let (stream, addr, permit) = match accepted {
            Accepted::Admitted(stream, addr, permit) => (stream, addr, permit),
            Accepted::OverLimit(stream, addr) => {
                bump(&shared.counters.over_limit);
                tracing::warn!(peer = %addr, limit = shared.config.max_connections, "control channel: too many connections, closing a new one");
                drop(stream);
                continue;
            }
        };
        let shared = shared.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut shutdown = shared.shutdown.subscribe();
            tokio::select! {
                _ = serve_conn(stream, addr, &shared, tx) => {}
                _ = closed(&mut shutdown) => {}
            }
        });
    }
}

async fn serve_conn(
    mut stream: TcpStream,
    addr: SocketAddr,
    shared: &Arc<Shared>,
    tx: mpsc::Sender<Envelope>,
) {
    let _ = stream.set_nodelay(true);
    let cfg = &shared.config;
    let from = match tokio::time::timeout(
        cfg.handshake_timeout,
        server_handshake(shared, &mut stream),
    )
    .await
    {
        Ok(Ok(from)) => from,
        Ok(Err(reason)) => {
            bump(&shared.counters.refused);
            tracing::warn!(peer = %addr, %reason, "control channel: refused a connection");
            return;
        }
        Err(_) => {
            bump(&shared.counters.refused);
            tracing::warn!(peer = %addr, timeout = ?cfg.handshake_timeout, "control channel: handshake timed out");
            return;
        }
    };
    bump(&shared.counters.accepted);
    tracing::debug!(peer = %addr, from = %from, "control connection accepted");
    let mut frames = 0u64;
    loop {
        let limits = FrameLimits {
            max_len: cfg.max_frame_len,
            frame_timeout: cfg.frame_timeout,
            idle_timeout: cfg.idle_timeout,
        };
        let body = match read_frame(&mut stream, limits).await {
            Ok(body) => body,
            Err(FrameEnd::Closed) => {
                tracing::debug!(peer = %addr, from = %from, frames, "control connection closed by the peer (end of stream between frames)");
                return;
            }
            Err(FrameEnd::Idle(idle)) => {
                bump(&shared.counters.idle_closed);
                tracing::info!(peer = %addr, from = %from, frames, idle = ?idle, "control channel: closing a connection on which no frame started within idle_timeout");
                return;
            }
            Err(FrameEnd::Broken(reason)) => {
                bump(&shared.counters.protocol_errors);
                tracing::warn!(peer = %addr, from = %from, frames, %reason, "control channel: closing a connection");
                return;
            }
        };
        match decode_message(&body) {
            Ok(None) => {
                bump(&shared.counters.unknown_skipped);
                tracing::debug!(peer = %addr, from = %from, "control channel: skipped a message of a type this version does not know (a newer minor's)");
            }
            Ok(Some(message)) => {
                frames += 1;
                bump(&shared.counters.frames_received);
                let env = Envelope {
                    from: from.clone(),
                    message,
                };
                if tx.send(env).await.is_err() {
                    tracing::debug!(peer = %addr, from = %from, "control channel closed; closing its connections");
                    return;
                }
            }
            Err(reason) => {
                bump(&shared.counters.protocol_errors);
                tracing::warn!(peer = %addr, from = %from, frames, %reason, "control channel: closing a connection that sent a frame that is not a control message");
                return;
            }
        }
    }
}

/// Parses one frame body as a [`ControlMessage`] (`None`: a type this version does not know),
/// or says why it is not one.
fn decode_message(body: &[u8]) -> std::result::Result<Option<ControlMessage>, String> {
    ControlMessage::from_json(body).map_err(|e| {
        format!(
            "a frame of {} bytes is not a control message: {e}",
            body.len()
        )
    })
}

/// Runs the server side of the hello exchange; returns the client's endpoint.
async fn server_handshake<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    shared: &Shared,
    stream: &mut S,
) -> std::result::Result<Endpoint, String> {
    let io = |e: std::io::Error| format!("connection failed during the handshake: {e}");
    let secret = shared.config.secret.as_ref();
    let mut head = [0u8; HELLO_HEAD];
    stream.read_exact(&mut head).await.map_err(io)?;
    let (version, flags, cn) = decode_head(&head)?;
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await.map_err(io)?;
    let len = usize::from(u16::from_be_bytes(len));
    if len == 0 || len > MAX_ENDPOINT_LEN {
        return Err(format!(
            "the client's endpoint name is {len} bytes; it must be 1..={MAX_ENDPOINT_LEN}"
        ));
    }
    let mut name = vec![0u8; len];
    stream.read_exact(&mut name).await.map_err(io)?;
    let sn = nonce();
    let mut reply = encode_head(flags_of(secret), &sn).to_vec();
    reply.extend_from_slice(&tag_bytes(secret, SERVER_LABEL, &cn, &sn, &name));
    stream.write_all(&reply).await.map_err(io)?;
    let mut proof = [0u8; TAG_LEN];
    stream.read_exact(&mut proof).await.map_err(io)?;
    let verdict = negotiate(version).and_then(|_| match (secret, flags & FLAG_SECRET != 0) {
        (Some(_), false) => Err(
            "this endpoint requires a shared secret; configure the same secret on both sides"
                .to_owned(),
        ),
        (None, true) => Err(
            "this endpoint does not use a shared secret but the client does; \
                             configure the same secret on both sides"
                .to_owned(),
        ),
        (Some(s), true) if !verify_tag(s, CLIENT_LABEL, &cn, &sn, &name, &proof) => Err(
            "the client could not prove the shared secret (wrong secret); configure the same \
             secret on both sides"
                .to_owned(),
        ),
        _ => parse_endpoint(&name),
    });
    let (code, text) = match &verdict {
        Ok(_) => (0u8, String::new()),
        Err(r) => (1u8, r.clone()),
    };
    let mut text = text.into_bytes();
    text.truncate(MAX_REASON_LEN);
    let mut out = vec![code];
    out.extend_from_slice(&(text.len() as u16).to_be_bytes());
    out.extend_from_slice(&text);
    stream.write_all(&out).await.map_err(io)?;
    verdict
}

/// The bounds [`read_frame`] enforces.
#[derive(Debug, Clone, Copy)]
struct FrameLimits {
    max_len: u32,
    frame_timeout: Duration,
    idle_timeout: Duration,
}

/// Why a connection yields no further frame.
#[derive(Debug, PartialEq, Eq)]
enum FrameEnd {
    /// A clean end of stream between frames.
    Closed,
    /// No frame started within the idle timeout.
    Idle(Duration),
    /// The peer broke the protocol or the connection failed: why.
    Broken(String),
}

/// Reads one frame body (its length checked before anything is allocated).
async fn read_frame<R: tokio::io::AsyncRead + Unpin>(
    stream: &mut R,
    limits: FrameLimits,
) -> std::result::Result<Vec<u8>, FrameEnd> {
    let FrameLimits {
        max_len: max,
        frame_timeout,
        idle_timeout,
    } = limits;
    let mut header = [0u8; 4];
    // Wait up to the idle bound for a frame to start ...
    match tokio::time::timeout(idle_timeout, stream.read(&mut header[..1])).await {
        Err(_) => return Err(FrameEnd::Idle(idle_timeout)),
        Ok(Ok(0)) => return Err(FrameEnd::Closed),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(FrameEnd::Broken(format!("read failed: {e}"))),
    }
    // ... but once it started, all of it must arrive in time.
    let rest = async {
        stream
            .read_exact(&mut header[1..])
            .await
            .map_err(|e| format!("the connection ended inside a frame header: {e}"))?;
        let len = u32::from_be_bytes(header);
        check_frame_len(len, max)?;
        let mut body = Vec::new();
        let got = (&mut *stream)
            .take(u64::from(len))
            .read_to_end(&mut body)
            .await
            .map_err(|e| format!("read failed inside a frame: {e}"))?;
        if got != len as usize {
            return Err(format!(
                "the connection ended after {got} of the frame's {len} bytes"
            ));
        }
        Ok(body)
    };
    match tokio::time::timeout(frame_timeout, rest).await {
        Ok(r) => r.map_err(FrameEnd::Broken),
        Err(_) => Err(FrameEnd::Broken(format!(
            "a frame started but did not complete within {frame_timeout:?} (frame_timeout)"
        ))),
    }
}

fn check_frame_len(len: u32, max: u32) -> std::result::Result<(), String> {
    if len == 0 {
        return Err("a frame of length 0 (frames carry one JSON message)".to_owned());
    }
    if len > max {
        return Err(format!(
            "a frame of {len} bytes exceeds max_frame_len {max}; raise \
             TcpControlConfig::max_frame_len on both sides if messages are really that large"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz;
    use proptest::prelude::*;

    fn test_shared() -> Shared {
        Shared {
            config: TcpControlConfig::default(),
            endpoint: Endpoint::new("127.0.0.1:9"),
            counters: Counters::default(),
            peers: Mutex::new(HashMap::new()),
            shutdown: watch::channel(false).0,
        }
    }

    const FUZZ_LIMITS: FrameLimits = FrameLimits {
        max_len: *FRAME_LEN_RANGE.start(),
        frame_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(10),
    };

    /// What the server side makes of a connection that sent `input` and closed: the
    /// handshake's verdict, then each frame (decoded or refused), then how it ended.
    async fn serve_bytes(shared: &Shared, input: &[u8]) -> Vec<String> {
        let (_peer, mut conn) = fuzz::peer_sent(input).await;
        let mut seen = Vec::new();
        match server_handshake(shared, &mut conn).await {
            Ok(from) => {
                assert!((1..=MAX_ENDPOINT_LEN).contains(&from.as_str().len()));
                seen.push(format!("accepted {from}"));
            }
            Err(reason) => {
                assert!(!reason.is_empty());
                seen.push(format!("refused: {reason}"));
                return seen;
            }
        }
        loop {
            match read_frame(&mut conn, FUZZ_LIMITS).await {
                Ok(body) => {
                    assert!(!body.is_empty() && body.len() <= FUZZ_LIMITS.max_len as usize);
                    match decode_message(&body) {
                        Ok(Some(m)) => seen.push(m.kind().to_owned()),
                        Ok(None) => seen.push("skipped".to_owned()),
                        Err(reason) => {
                            assert!(reason.contains("is not a control message"), "{reason}");
                            seen.push("not a message".to_owned());
                            return seen;
                        }
                    }
                }
                Err(FrameEnd::Closed) => return seen,
                Err(FrameEnd::Broken(reason)) => {
                    assert!(!reason.is_empty());
                    seen.push(format!("closed: {reason}"));
                    return seen;
                }
                Err(FrameEnd::Idle(_)) => panic!("a connection that ended cannot be idle"),
            }
        }
    }

    #[test]
    fn control_corpus_seeds_are_whole_sessions() {
        let rt = fuzz::runtime();
        let shared = test_shared();
        for seed in fuzz::corpus("control") {
            let seen = rt.block_on(serve_bytes(&shared, &seed));
            assert!(seen[0].starts_with("accepted"), "{seen:?}");
            assert!(seen.len() >= 2, "{seen:?}");
            assert!(
                !seen
                    .iter()
                    .any(|s| s.contains("closed") || s == "not a message"),
                "{seen:?}"
            );
        }
    }

    proptest! {
        #![proptest_config(fuzz::config())]

        /// Mutated control-channel sessions: the handshake and frame decoders never panic,
        /// never hang on input that ended, never allocate a frame above the limit, and end
        /// every connection with a decoded value or a reason.
        #[test]
        fn fuzz_control_sessions(input in fuzz::mutated(fuzz::corpus("control"))) {
            let rt = fuzz::runtime();
            let shared = test_shared();
            let seen = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(60), serve_bytes(&shared, &input))
                    .await
                    .expect("a finished input is decoded without waiting")
            });
            prop_assert!(!seen.is_empty());
        }
    }

    /// Writes the control corpus seeds (run by hand after a wire-format change:
    /// `cargo test -p kvbridge-control --lib -- --ignored write_control_corpus`).
    #[test]
    #[ignore = "regenerates tests/corpus/control"]
    fn write_control_corpus() {
        use crate::messages::*;
        let descriptor =
            kvbridge_handshake::PeerDescriptor::mla(kvbridge_handshake::Role::Decode, 16, 2, 64)
                .aux_item_lens(vec![64])
                .build()
                .unwrap();
        let ep = Endpoint::new("127.0.0.1:4000");
        let frame = |m: &ControlMessage| {
            let j = serde_json::to_vec(m).unwrap();
            let mut f = (j.len() as u32).to_be_bytes().to_vec();
            f.extend_from_slice(&j);
            f
        };
        let session = |msgs: &[ControlMessage]| {
            let mut v = encode_head(0, &[7; NONCE_LEN]).to_vec();
            v.extend_from_slice(&(ep.as_str().len() as u16).to_be_bytes());
            v.extend_from_slice(ep.as_str().as_bytes());
            v.extend_from_slice(&[0; TAG_LEN]);
            for m in msgs {
                v.extend_from_slice(&frame(m));
            }
            v
        };
        let reg = Registration {
            protocol: CONTROL_PROTOCOL_VERSION,
            decode_endpoint: ep.clone(),
            session: 3.into(),
            descriptor: descriptor.clone(),
            transport: TransportInfo {
                name: "tcp".into(),
                descriptor: vec![1, 2, 3, 4],
            },
            kv_regions: vec![WireRegion {
                region: 1,
                offset: 0,
                len: 65536,
            }],
            aux_regions: vec![WireRegion {
                region: 2,
                offset: 0,
                len: 512,
            }],
        };
        let info = TransferInfo {
            room: 11.into(),
            generation: 2.into(),
            decode_endpoint: ep.clone(),
            session: 3.into(),
            dst_pages: vec![4, 9, 1, 7],
            dst_aux_index: Some(0),
            is_dummy: false,
            required_dst_info_num: 1,
            decode_prefix_len: 16,
            traceparent: None,
        };
        let seeds: Vec<(&str, Vec<ControlMessage>)> = vec![
            (
                "01-ping",
                vec![ControlMessage::Ping(Heartbeat { nonce: 7 })],
            ),
            ("02-register", vec![ControlMessage::Register(reg)]),
            ("03-transfer-info", vec![ControlMessage::TransferInfo(info)]),
            (
                "04-status-abort",
                vec![
                    ControlMessage::Status(StatusUpdate {
                        room: 11.into(),
                        generation: 2.into(),
                        state: crate::state::RoomState::Failed,
                        prefill_rank: 0,
                        reason: Some("KV transfer failed".into()),
                        cause: Some(crate::state::FailureCause::TransferError),
                    }),
                    ControlMessage::Abort(AbortRequest {
                        room: 11.into(),
                        generation: 3.into(),
                        decode_endpoint: ep.clone(),
                        reason: "Aborted by AbortReq.".into(),
                    }),
                    ControlMessage::AbortAck(AbortAck {
                        room: 11.into(),
                        generation: 3.into(),
                        prefill_rank: 0,
                        prefill_endpoint: ep.clone(),
                    }),
                    ControlMessage::Pong(Heartbeat { nonce: 7 }),
                ],
            ),
            (
                "05-register-reply",
                vec![ControlMessage::RegisterReply(RegistrationReply {
                    protocol: CONTROL_PROTOCOL_VERSION,
                    prefill_endpoint: ep.clone(),
                    prefill_rank: 0,
                    session: 3.into(),
                    result: RegistrationOutcome::Rejected {
                        problems: vec![WireProblem {
                            code: "KVB-TRANSPORT".into(),
                            message: "transport mismatch".into(),
                            remedy: "start both sides with the same --transport".into(),
                        }],
                    },
                })],
            ),
        ];
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/control");
        std::fs::create_dir_all(&dir).unwrap();
        for (name, msgs) in seeds {
            std::fs::write(dir.join(format!("{name}.bin")), session(&msgs)).unwrap();
        }
    }

    #[test]
    fn tags_bind_label_nonces_and_endpoint() {
        let (cn, sn) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let (k, x) = (Secret::new(b"k".to_vec()), Secret::new(b"x".to_vec()));
        let t = tag_bytes(Some(&k), CLIENT_LABEL, &cn, &sn, b"a:1");
        assert!(verify_tag(&k, CLIENT_LABEL, &cn, &sn, b"a:1", &t));
        assert!(!verify_tag(&x, CLIENT_LABEL, &cn, &sn, b"a:1", &t));
        assert!(!verify_tag(&k, SERVER_LABEL, &cn, &sn, b"a:1", &t));
        assert!(!verify_tag(&k, CLIENT_LABEL, &sn, &cn, b"a:1", &t));
        assert!(!verify_tag(&k, CLIENT_LABEL, &cn, &sn, b"a:2", &t));
        assert!(!verify_tag(&k, CLIENT_LABEL, &cn, &sn, b"a:1", &t[..31]));
        // The wire format is unchanged: HMAC(secret, label | cn | sn | len | endpoint).
        use hmac::Mac;
        let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"k").unwrap();
        m.update(b"kvbridge-control/1 client");
        m.update(&cn);
        m.update(&sn);
        m.update(&[0, 3]);
        m.update(b"a:1");
        assert_eq!(t[..], m.finalize().into_bytes()[..]);
        assert_eq!(
            tag_bytes(None, CLIENT_LABEL, &cn, &sn, b"a:1"),
            [0; TAG_LEN]
        );
    }

    #[test]
    fn head_round_trips_and_rejects_foreign_magic() {
        let n = [9u8; NONCE_LEN];
        let h = encode_head(FLAG_SECRET, &n);
        assert_eq!(decode_head(&h).unwrap(), (TCP_WIRE_VERSION, FLAG_SECRET, n));
        let mut bad = h;
        bad[0] = b'G';
        assert!(
            decode_head(&bad)
                .unwrap_err()
                .contains("not a kvbridge control channel")
        );
    }

    #[test]
    fn endpoint_names_are_checked() {
        assert_eq!(
            parse_endpoint(b"127.0.0.1:5").unwrap().as_str(),
            "127.0.0.1:5"
        );
        assert!(parse_endpoint(b"").is_err());
        assert!(parse_endpoint(&[0xff, 0xfe]).is_err());
        assert!(parse_endpoint(b"a\nb").is_err());
        assert!(parse_endpoint(&[b'a'; 256]).is_err());
    }

    #[test]
    fn frame_lengths_are_bounded() {
        assert!(check_frame_len(0, 4096).is_err());
        assert!(
            check_frame_len(4097, 4096)
                .unwrap_err()
                .contains("exceeds max_frame_len")
        );
        assert!(check_frame_len(4096, 4096).is_ok());
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn config_is_validated() {
        assert!(TcpControlConfig::default().validate().is_ok());
        assert!(
            TcpControlConfig::default()
                .with_max_frame_len(10)
                .validate()
                .is_err()
        );
        assert!(
            TcpControlConfig::default()
                .with_secret(Vec::new())
                .validate()
                .is_err()
        );
        assert!(
            TcpControlConfig::default()
                .with_queue(0)
                .validate()
                .is_err()
        );
        let dbg = format!(
            "{:?}",
            TcpControlConfig::default().with_secret(b"hunter2".to_vec())
        );
        assert!(!dbg.contains("hunter2"), "{dbg}");
    }
}
