//! `kvbridge-tcp`: a [`KvTransport`] over TCP.
//!
//! Writes travel as `(region, offset, len)` descriptors followed by their payload; the
//! receiver checks every descriptor against its registered regions **before** it reads a
//! payload byte, then reads the payload from the socket straight into the region
//! ([`MemoryRegion::borrow_mut`]) — no buffer proportional to the transfer exists anywhere.
//! The wire format is specified in `docs/tcp-protocol.md`; its codec ([`wire`]) is sans-IO.
//!
//! - **Connections**: [`TcpTransport::bind`] listens (127.0.0.1 and an OS-assigned port by
//!   default); `local_descriptor()` is the UTF-8 text `kvbridge-tcp/3@<ip>:<port>`, which can
//!   travel inside a JSON handshake. `connect` opens [`TcpConfig::connections_per_peer`]
//!   connections; large batches are cut into pieces of [`TcpConfig::piece_bytes`] that are
//!   spread over them.
//! - **Peer region tables**: the listener sends its region table (ids and lengths) at `connect`
//!   and announces every `register` / `deregister`; `post` refuses a write outside a region it
//!   knows, and sends a batch of at most 64 KiB whole with its `Begin`, without waiting for an
//!   answer (one round trip). The listener still checks every write.
//! - **Strided ops** ([`Capabilities::strided_ops`]): an op of `count` rows at a stride travels
//!   as one `Rows` descriptor (or one per piece of it), its source rows gathered by vectored
//!   writes in place and scattered on receipt, every row's bounds checked on both sides
//!   before a byte of it moves.
//! - **Authentication**: with a [`TcpConfig::secret`], both sides prove it with an HMAC-SHA256
//!   challenge-response over both connection prefaces ([`auth`]).
//! - **Keep-alive**: the connecting side pings every [`TcpConfig::keepalive_interval`]; a side
//!   that hears nothing for [`TcpConfig::keepalive_timeout`] drops the peer, and its pending
//!   batches fail.
//! - **Fencing**: `cancel` and deadline expiry send a `Cancel` on every connection of the peer
//!   and wait for the receiver to acknowledge that it will apply nothing more of the batch. A
//!   receiver also stops applying a batch at its own copy of the deadline. A peer that does not
//!   acknowledge within [`TcpConfig::fence_grace`] is disconnected, and the batch is reported
//!   only once the receiver's deadline for it has passed.
//! - **Hardening**: frames above [`TcpConfig::max_frame_len`], unknown frame types, truncated
//!   or overflowing lengths, unknown regions, out-of-bounds writes and a wrong or missing
//!   secret each close the connection with a clear error; nothing a peer claims sizes an
//!   allocation, and no byte is written outside a registered region. What a peer can make the
//!   listener hold is bounded by [`TcpConfig::max_inbound_pending_bytes`] per peer and
//!   [`TcpConfig::max_inbound_connections`]; a handshake must finish within
//!   [`TcpConfig::connect_timeout`]. A side that closes a connection sends the reason first.
//!
//! Reads ([`Direction::Read`]) are not supported ([`Capabilities::reads`] is `false`).
//!
//! # Example
//!
//! ```
//! use kvbridge_tcp::{TcpConfig, TcpTransport};
//! use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config = TcpConfig::default().with_secret(b"shared secret".to_vec());
//! let decode = TcpTransport::bind(config.clone()).await?;
//! let prefill = TcpTransport::bind(config).await?;
//!
//! let (dst, dst_mem) = decode.allocate_registered(4096).await?;
//! let (src, src_mem) = prefill.allocate_registered(4096).await?;
//! src_mem.write_at(0, b"kv bytes")?;
//!
//! let peer = prefill.connect(&decode.local_descriptor()).await?;
//! let op = TransferOp::new(src, 0, dst, 100, 8);
//! prefill
//!     .transfer(peer, TransferBatch::write(vec![op]).with_notification("chunk 0".into()))
//!     .await?;
//! assert_eq!(decode.recv_notification().await?.payload, "chunk 0");
//! assert_eq!(dst_mem.to_vec(100, 8)?, b"kv bytes");
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, Direction, KvTransport, MemoryRegion, Notification, PeerId,
    RegionId, Result, Side, TransferBatch, TransportError,
};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinHandle;

pub mod auth;
mod batch;
mod conn;
mod error;
mod inbound;
mod outbound;
pub mod wire;

pub use auth::Secret;
pub use error::TcpError;

use batch::TxBatch;
use inbound::Session;
use kvbridge_transport::batch::{BatchTable, Batches, LocalIds, Outcome};
use kvbridge_transport::sync::{lock, read, write};
use outbound::OutPeer;

/// The transport's name in logs and errors.
pub const NAME: &str = "tcp";

/// Settings of a [`TcpTransport`]. Both sides of a connection should use the same secret,
/// frame limit and keep-alive settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TcpConfig {
    /// Address the listener binds. Default `127.0.0.1:0` (loopback, OS-assigned port).
    pub bind_addr: SocketAddr,
    /// Address put in the descriptor when the bound one is not reachable by peers (e.g. when
    /// binding `0.0.0.0`). Default: the bound address.
    pub advertise_addr: Option<IpAddr>,
    /// Shared secret both sides must prove (HMAC-SHA256 challenge-response). Default: none.
    pub secret: Option<Secret>,
    /// TCP connections opened per outbound peer (1..=16); a batch is spread over them in
    /// pieces. Default 2: one connection's bytes are copied by one core on each side, which
    /// one 256 MiB block or strided rows cannot outrun (docs/benchmarks.md, "Across a real
    /// link").
    pub connections_per_peer: usize,
    /// Interval between keep-alive pings on each outbound connection. Default 1 s.
    pub keepalive_interval: Duration,
    /// Silence after which a peer is considered lost. Default 10 s.
    pub keepalive_timeout: Duration,
    /// Time allowed for `connect` (TCP connect and handshake). Default 5 s.
    pub connect_timeout: Duration,
    /// Time the receiver has to acknowledge a cancel before the peer is disconnected. Default 2 s.
    pub fence_grace: Duration,
    /// Largest frame body accepted (4 KiB..=16 MiB); bounds every buffer a peer can make this
    /// side fill. Payloads of `Data` frames are not counted (they go straight into regions).
    /// Default 1 MiB.
    pub max_frame_len: u32,
    /// Largest payload of one `Data` frame (the unit in which batches are spread over
    /// connections and in which cancels take effect), 4 KiB..=64 MiB. Default 4 MiB.
    pub piece_bytes: u64,
    /// Batches one inbound peer may have in flight here; more are refused. Default 65 536.
    pub max_inbound_batches: usize,
    /// Bytes one inbound peer may make this side hold for its batches: each batch it begins is
    /// charged its `Begin` body plus [`BATCH_STATE_BYTES`] from the moment its header arrives
    /// (before the body is read) until the batch is cancelled, or — when it carries a
    /// notification — until the application received that notification. A `Begin` that would
    /// go above the limit closes the peer's connections with error 15. At least
    /// `max_frame_len + BATCH_STATE_BYTES`; default 32 MiB.
    pub max_inbound_pending_bytes: u64,
    /// Bytes all inbound peers together may make this side hold, charged as for
    /// [`max_inbound_pending_bytes`](Self::max_inbound_pending_bytes): a `Begin` that would go
    /// above it closes that peer's connections with error 15. It bounds what many peers
    /// (authenticated or not, one per connection slot) can pin at once. At least
    /// `max_frame_len + BATCH_STATE_BYTES`; default 256 MiB.
    pub max_inbound_pending_bytes_total: u64,
    /// Inbound connections admitted at once (over all peers); the handshake of one more is
    /// answered with error 16. Each holds its slot until it closes. Default 1024.
    pub max_inbound_connections: usize,
    /// Read payloads straight into the destination regions (default `true`): each range is
    /// borrowed exclusively (`MemoryRegion::borrow_mut`) for the length of one `readv`, during
    /// which `MemoryRegion` accessors touching those bytes are refused. With `false`, payloads
    /// go through a fixed 1 MiB buffer per connection and `write_at` (one more copy), so the
    /// accessors are refused only for the bytes of a `write_at` in progress. Frames into
    /// foreign memory (never borrowed as a slice) are read in place too, by
    /// `kvbridge_transport::memory::recv_vectored` on the claimed raw ranges.
    pub receive_in_place: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            bind_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise_addr: None,
            secret: None,
            connections_per_peer: 2,
            keepalive_interval: Duration::from_secs(1),
            keepalive_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            fence_grace: Duration::from_secs(2),
            max_frame_len: 1 << 20,
            piece_bytes: 4 << 20,
            max_inbound_batches: 65_536,
            max_inbound_pending_bytes: 32 << 20,
            max_inbound_pending_bytes_total: 256 << 20,
            max_inbound_connections: 1024,
            receive_in_place: true,
        }
    }
}

impl TcpConfig {
    /// Sets [`secret`](Self::secret).
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(Secret::new(secret));
        self
    }

    /// Sets [`bind_addr`](Self::bind_addr).
    pub fn with_bind_addr(mut self, addr: SocketAddr) -> Self {
        self.bind_addr = addr;
        self
    }

    /// Sets [`advertise_addr`](Self::advertise_addr).
    pub fn with_advertise_addr(mut self, addr: IpAddr) -> Self {
        self.advertise_addr = Some(addr);
        self
    }

    /// Sets [`connections_per_peer`](Self::connections_per_peer).
    pub fn with_connections_per_peer(mut self, n: usize) -> Self {
        self.connections_per_peer = n;
        self
    }

    /// Sets [`keepalive_interval`](Self::keepalive_interval).
    pub fn with_keepalive_interval(mut self, interval: Duration) -> Self {
        self.keepalive_interval = interval;
        self
    }

    /// Sets [`keepalive_timeout`](Self::keepalive_timeout).
    pub fn with_keepalive_timeout(mut self, timeout: Duration) -> Self {
        self.keepalive_timeout = timeout;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`fence_grace`](Self::fence_grace).
    pub fn with_fence_grace(mut self, grace: Duration) -> Self {
        self.fence_grace = grace;
        self
    }

    /// Sets [`max_frame_len`](Self::max_frame_len).
    pub fn with_max_frame_len(mut self, len: u32) -> Self {
        self.max_frame_len = len;
        self
    }

    /// Sets [`piece_bytes`](Self::piece_bytes).
    pub fn with_piece_bytes(mut self, bytes: u64) -> Self {
        self.piece_bytes = bytes;
        self
    }

    /// Sets [`max_inbound_batches`](Self::max_inbound_batches).
    pub fn with_max_inbound_batches(mut self, n: usize) -> Self {
        self.max_inbound_batches = n;
        self
    }

    /// Sets [`max_inbound_pending_bytes`](Self::max_inbound_pending_bytes).
    pub fn with_max_inbound_pending_bytes(mut self, bytes: u64) -> Self {
        self.max_inbound_pending_bytes = bytes;
        self
    }

    /// Sets [`max_inbound_pending_bytes_total`](Self::max_inbound_pending_bytes_total).
    pub fn with_max_inbound_pending_bytes_total(mut self, bytes: u64) -> Self {
        self.max_inbound_pending_bytes_total = bytes;
        self
    }

    /// Sets [`max_inbound_connections`](Self::max_inbound_connections).
    pub fn with_max_inbound_connections(mut self, n: usize) -> Self {
        self.max_inbound_connections = n;
        self
    }

    /// Sets [`receive_in_place`](Self::receive_in_place).
    pub fn with_receive_in_place(mut self, in_place: bool) -> Self {
        self.receive_in_place = in_place;
        self
    }

    /// Checks every value is in range.
    pub fn validate(&self) -> Result<(), TcpError> {
        let bad = |field, value: String, reason| {
            Err(TcpError::InvalidConfig {
                field,
                value,
                reason,
            })
        };
        if !(1..=16).contains(&self.connections_per_peer) {
            return bad(
                "connections_per_peer",
                self.connections_per_peer.to_string(),
                "must be between 1 and 16",
            );
        }
        if self.secret.as_ref().is_some_and(Secret::is_empty) {
            return bad(
                "secret",
                "empty".into(),
                "must not be empty; use None for no authentication",
            );
        }
        if self.keepalive_interval.is_zero() || self.keepalive_interval > Duration::from_secs(3600)
        {
            return bad(
                "keepalive_interval",
                format!("{:?}", self.keepalive_interval),
                "must be between 1 ns and 1 h",
            );
        }
        if self.keepalive_timeout <= self.keepalive_interval {
            return bad(
                "keepalive_timeout",
                format!("{:?}", self.keepalive_timeout),
                "must be longer than keepalive_interval (a few intervals is typical)",
            );
        }
        for (field, d) in [
            ("connect_timeout", self.connect_timeout),
            ("fence_grace", self.fence_grace),
        ] {
            if d.is_zero() {
                return bad(field, format!("{d:?}"), "must be above zero");
            }
        }
        if !(4096..=wire::WIRE_MAX_FRAME_LEN).contains(&self.max_frame_len) {
            return bad(
                "max_frame_len",
                self.max_frame_len.to_string(),
                "must be between 4096 and 16777216 bytes",
            );
        }
        if !(4096..=64 << 20).contains(&self.piece_bytes) {
            return bad(
                "piece_bytes",
                self.piece_bytes.to_string(),
                "must be between 4096 and 67108864 bytes",
            );
        }
        if self.max_inbound_batches == 0 {
            return bad("max_inbound_batches", "0".into(), "must be at least 1");
        }
        if !(1..=Semaphore::MAX_PERMITS).contains(&self.max_inbound_connections) {
            return bad(
                "max_inbound_connections",
                self.max_inbound_connections.to_string(),
                "must be at least 1",
            );
        }
        if self.max_inbound_pending_bytes < u64::from(self.max_frame_len) + BATCH_STATE_BYTES {
            return bad(
                "max_inbound_pending_bytes",
                self.max_inbound_pending_bytes.to_string(),
                "must hold at least one batch of the largest frame: max_frame_len + 128 bytes",
            );
        }
        if self.max_inbound_pending_bytes_total < u64::from(self.max_frame_len) + BATCH_STATE_BYTES
        {
            return bad(
                "max_inbound_pending_bytes_total",
                self.max_inbound_pending_bytes_total.to_string(),
                "must hold at least one batch of the largest frame: max_frame_len + 128 bytes",
            );
        }
        Ok(())
    }
}

/// What one pending inbound batch is charged on top of its `Begin` body (its bookkeeping here),
/// against [`TcpConfig::max_inbound_pending_bytes`].
pub const BATCH_STATE_BYTES: u64 = 128;

/// Formats the descriptor of a listener.
fn format_descriptor(addr: SocketAddr) -> String {
    format!("kvbridge-tcp/{}@{addr}", wire::VERSION)
}

/// Parses `kvbridge-tcp/3@<ip>:<port>`.
pub fn parse_descriptor(descriptor: &[u8]) -> Result<SocketAddr, TcpError> {
    let shown = || {
        let cut = &descriptor[..descriptor.len().min(128)];
        String::from_utf8_lossy(cut).into_owned()
    };
    let text = std::str::from_utf8(descriptor).map_err(|_| TcpError::BadDescriptor {
        got: shown(),
        reason: "it is not UTF-8",
    })?;
    let rest = text
        .strip_prefix("kvbridge-tcp/")
        .ok_or(TcpError::BadDescriptor {
            got: shown(),
            reason: "it does not start with \"kvbridge-tcp/\"",
        })?;
    let (version, addr) = rest.split_once('@').ok_or(TcpError::BadDescriptor {
        got: shown(),
        reason: "the '@' before the address is missing",
    })?;
    if version != wire::VERSION.to_string() {
        return Err(TcpError::BadDescriptor {
            got: shown(),
            reason: "only protocol version 3 is supported; run the same kvbridge release on both sides",
        });
    }
    addr.parse().map_err(|_| TcpError::BadDescriptor {
        got: shown(),
        reason: "the address is not <ip>:<port>",
    })
}

/// State shared by the handle and every task of one transport.
pub(crate) struct Shared {
    pub(crate) config: TcpConfig,
    pub(crate) descriptor: Bytes,
    pub(crate) local_addr: SocketAddr,
    pub(crate) regions: RwLock<HashMap<u64, MemoryRegion, LocalIds>>,
    next_region: AtomicU64,
    /// Peer ids for both outbound peers and inbound sessions.
    pub(crate) next_peer: AtomicU64,
    pub(crate) out_peers: Mutex<HashMap<u64, Arc<OutPeer>, LocalIds>>,
    /// Inbound sessions by session id.
    pub(crate) sessions: Mutex<HashMap<u64, Arc<Session>>>,
    /// Ids, states, deadlines, `wait` and `cancel` of the batches this side posted.
    pub(crate) table: Batches,
    /// What the wire needs of each batch in `table`, until `wait` collects it.
    pub(crate) batches: Mutex<HashMap<u64, Arc<TxBatch>, LocalIds>>,
    pub(crate) deadlines: outbound::Deadlines,
    /// Notifications of completed batches, each with the charge of its batch (released when
    /// the application takes it).
    pub(crate) notify_tx: mpsc::Sender<(Notification, inbound::Charge)>,
    notify_rx: tokio::sync::Mutex<mpsc::Receiver<(Notification, inbound::Charge)>>,
    /// The most bytes any one inbound peer was ever charged (see `inbound_pending_stats`).
    pub(crate) peak_pending: AtomicU64,
    /// Bytes charged to all inbound peers together (`max_inbound_pending_bytes_total`).
    pub(crate) pending_total: Arc<AtomicU64>,
    pub(crate) closed: AtomicBool,
    pub(crate) closed_tx: watch::Sender<bool>,
    listener_task: Mutex<Option<JoinHandle<()>>>,
}

/// Capacity of the notification queue; a full queue pauses the connections that deliver more.
const NOTIFICATION_QUEUE: usize = 4096;

impl Shared {
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(crate) fn closed_err(&self) -> TransportError {
        TransportError::Closed { transport: NAME }
    }

    /// Resolves once the transport is shut down.
    pub(crate) async fn wait_closed(&self) {
        let mut rx = self.closed_tx.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    pub(crate) fn region(&self, id: u64) -> Option<MemoryRegion> {
        read(&self.regions).get(&id).cloned()
    }

    pub(crate) fn alloc_peer_id(&self) -> PeerId {
        PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn batch(&self, id: u64) -> Option<Arc<TxBatch>> {
        lock(&self.batches).get(&id).cloned()
    }

    pub(crate) fn out_peer(&self, id: u64) -> Option<Arc<OutPeer>> {
        lock(&self.out_peers).get(&id).cloned()
    }

    fn session_by_peer(&self, peer: PeerId) -> Option<Arc<Session>> {
        lock(&self.sessions)
            .values()
            .find(|s| s.peer == peer)
            .cloned()
    }
}

/// A [`KvTransport`] over TCP. Create it with [`bind`](Self::bind) inside a tokio runtime; its
/// tasks run on that runtime. Dropping the last handle shuts it down.
pub struct TcpTransport {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("local_addr", &self.shared.local_addr)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// Binds the listener and starts accepting peers.
    pub async fn bind(config: TcpConfig) -> Result<Self> {
        config.validate()?;
        let listener = tokio::net::TcpListener::bind(config.bind_addr)
            .await
            .map_err(|source| TransportError::Io {
                transport: NAME,
                context: format!(
                    "binding the listener to {} (choose a free address or port 0)",
                    config.bind_addr
                ),
                source,
            })?;
        let bound = listener.local_addr().map_err(|source| TransportError::Io {
            transport: NAME,
            context: "reading the listener's address".into(),
            source,
        })?;
        let advertised = SocketAddr::new(config.advertise_addr.unwrap_or(bound.ip()), bound.port());
        let (notify_tx, notify_rx) = mpsc::channel(NOTIFICATION_QUEUE);
        let (closed_tx, _) = watch::channel(false);
        let commit_grace = config
            .fence_grace
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(1));
        let shared = Arc::new(Shared {
            descriptor: Bytes::from(format_descriptor(advertised)),
            local_addr: bound,
            config,
            regions: RwLock::new(HashMap::default()),
            next_region: AtomicU64::new(1),
            next_peer: AtomicU64::new(1),
            out_peers: Mutex::new(HashMap::default()),
            sessions: Mutex::new(HashMap::new()),
            // A fence that cannot finish leaves the peer within twice its grace (and the
            // receiver's own deadline for the batch is its anchor): the backstop comes after.
            table: Batches::from_table(BatchTable::new(NAME).with_commit_grace(commit_grace)),
            batches: Mutex::new(HashMap::default()),
            deadlines: outbound::Deadlines::default(),
            notify_tx,
            notify_rx: tokio::sync::Mutex::new(notify_rx),
            peak_pending: AtomicU64::new(0),
            pending_total: Arc::new(AtomicU64::new(0)),
            closed: AtomicBool::new(false),
            closed_tx,
            listener_task: Mutex::new(None),
        });
        tokio::spawn(outbound::deadline_task(shared.clone()));
        let task = tokio::spawn(inbound::accept_loop(shared.clone(), listener));
        *lock(&shared.listener_task) = Some(task);
        tracing::info!(addr = %bound, "kvbridge-tcp listening");
        Ok(Self { shared })
    }

    /// Binds with the default configuration (127.0.0.1, OS-assigned port, no secret).
    pub async fn new() -> Result<Self> {
        Self::bind(TcpConfig::default()).await
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// The configuration in force.
    pub fn config(&self) -> &TcpConfig {
        &self.shared.config
    }

    /// Bytes charged against [`TcpConfig::max_inbound_pending_bytes`]: `(now, peak)`, where
    /// `now` sums the live inbound peers and `peak` is the most any one peer was ever charged.
    /// For tests and diagnostics.
    #[doc(hidden)]
    pub fn inbound_pending_stats(&self) -> (u64, u64) {
        let now = lock(&self.shared.sessions)
            .values()
            .map(|s| s.pending_bytes())
            .sum();
        (now, self.shared.peak_pending.load(Ordering::Acquire))
    }

    fn check_open(&self) -> Result<()> {
        if self.shared.is_closed() {
            Err(self.shared.closed_err())
        } else {
            Ok(())
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        shutdown_now(&self.shared);
    }
}

/// Aborts every task in `tasks` without waiting.
pub(crate) fn abort_tasks(tasks: &Mutex<Vec<JoinHandle<()>>>) {
    for t in lock(tasks).iter() {
        t.abort();
    }
}

/// Aborts the tasks in `tasks` and waits (at most 5 s each) until they are gone.
pub(crate) async fn join_tasks(tasks: &Mutex<Vec<JoinHandle<()>>>) {
    let tasks: Vec<_> = lock(tasks).drain(..).collect();
    for t in tasks {
        t.abort();
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
}

/// Marks the transport closed and aborts every task without waiting (used by `Drop`).
fn shutdown_now(shared: &Arc<Shared>) {
    if shared.closed.swap(true, Ordering::AcqRel) {
        return;
    }
    shared.closed_tx.send_replace(true);
    if let Some(t) = lock(&shared.listener_task).take() {
        t.abort();
    }
    let peers: Vec<_> = lock(&shared.out_peers).drain().map(|(_, p)| p).collect();
    for p in peers {
        p.abort_tasks();
    }
    let sessions: Vec<_> = lock(&shared.sessions).drain().map(|(_, s)| s).collect();
    for s in sessions {
        s.abort_tasks();
    }
    let batches: Vec<_> = lock(&shared.batches).values().cloned().collect();
    for b in batches {
        shared.finish(&b, b.failed("the transport was shut down".into()));
    }
}

#[async_trait::async_trait]
impl KvTransport for TcpTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_cross_process(true)
            .with_strided_ops(true)
    }

    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        self.check_open()?;
        self.capabilities().check_region(NAME, &region)?;
        let id = self.shared.next_region.fetch_add(1, Ordering::Relaxed);
        let len = region.len() as u64;
        let mut regions = write(&self.shared.regions);
        regions.insert(id, region);
        inbound::announce(&self.shared, id, Some(len));
        drop(regions);
        Ok(RegionId(id))
    }

    async fn deregister(&self, region: RegionId) -> Result<()> {
        self.check_open()?;
        let mut regions = write(&self.shared.regions);
        let removed = regions.remove(&region.0);
        if removed.is_some() {
            inbound::announce(&self.shared, region.0, None);
        }
        drop(regions);
        match removed {
            Some(_) => Ok(()),
            None => Err(TransportError::UnknownRegion {
                side: Side::Local,
                region,
                transport: NAME,
            }),
        }
    }

    fn local_descriptor(&self) -> Bytes {
        self.shared.descriptor.clone()
    }

    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        self.check_open()?;
        let addr = parse_descriptor(descriptor)?;
        let peer = outbound::connect(&self.shared, addr).await?;
        Ok(peer.id)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        self.check_open()?;
        let out = lock(&self.shared.out_peers).remove(&peer.0);
        if let Some(out) = out {
            out.close(&self.shared, "disconnected by the caller").await;
            return Ok(());
        }
        if let Some(session) = self.shared.session_by_peer(peer) {
            session.close(&self.shared).await;
            return Ok(());
        }
        Err(TransportError::UnknownPeer {
            peer,
            transport: NAME,
        })
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        self.check_open()?;
        if batch.direction == Direction::Read {
            return Err(TransportError::Unsupported {
                transport: NAME,
                operation: "read batches",
                remedy: "post a write batch from the peer that holds the data",
            });
        }
        let Some(out) = self.shared.out_peer(peer.0) else {
            return Err(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            });
        };
        outbound::post(&self.shared, &out, batch).await
    }

    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        self.shared.table.state(batch, batch::now())
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        let r = self.shared.table.wait(batch, batch::sleep_until).await;
        if let Some(b) = lock(&self.shared.batches).remove(&batch.0) {
            self.shared.deadlines.forget(&b);
        }
        r
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        // Every posted batch is committing: the receiver's fence decides how it ends.
        let state = self.shared.table.cancel(batch, batch::now())?;
        if state != BatchState::Pending {
            return Ok(state);
        }
        if let Some(b) = self.shared.batch(batch.0) {
            outbound::fence(&self.shared, &b, Outcome::Cancelled).await;
        }
        self.shared.table.settle(batch, batch::sleep_until).await
    }

    async fn recv_notification(&self) -> Result<Notification> {
        self.check_open()?;
        // One watch of the closing for both waits, subscribed only if one has to wait (each
        // subscription costs a lock; a small write's notification is on its round trip).
        let closed = self.shared.wait_closed();
        tokio::pin!(closed);
        let mut rx = match self.shared.notify_rx.try_lock() {
            Ok(rx) => rx,
            Err(_) => tokio::select! {
                rx = self.shared.notify_rx.lock() => rx,
                () = &mut closed => return Err(self.shared.closed_err()),
            },
        };
        tokio::select! {
            biased;
            n = rx.recv() => n.map(|(n, _charge)| n).ok_or_else(|| self.shared.closed_err()),
            () = &mut closed => Err(self.shared.closed_err()),
        }
    }

    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        self.check_open()?;
        if let Some(out) = self.shared.out_peer(peer.0) {
            return out.probe(timeout).await;
        }
        if let Some(session) = self.shared.session_by_peer(peer) {
            return session.probe(timeout).await;
        }
        Err(TransportError::UnknownPeer {
            peer,
            transport: NAME,
        })
    }

    async fn shutdown(&self) -> Result<()> {
        if self.shared.is_closed() {
            return Ok(());
        }
        // Fence what is in flight while the connections still work, then close everything.
        let pending: Vec<_> = lock(&self.shared.batches).values().cloned().collect();
        let mut fences = Vec::new();
        for b in pending {
            if self.shared.is_final(&b) {
                continue;
            }
            let shared = self.shared.clone();
            fences.push(tokio::spawn(async move {
                let outcome = b.failed("the transport was shut down".into());
                outbound::fence(&shared, &b, outcome).await;
            }));
        }
        for f in fences {
            let _ = f.await;
        }
        let peers: Vec<_> = lock(&self.shared.out_peers).values().cloned().collect();
        let sessions: Vec<_> = lock(&self.shared.sessions).values().cloned().collect();
        let listener = lock(&self.shared.listener_task).take();
        shutdown_now(&self.shared);
        // Wait until no task can touch memory any more.
        for p in peers {
            p.join_tasks().await;
        }
        for s in sessions {
            s.join_tasks().await;
        }
        if let Some(l) = listener {
            l.abort();
            let _ = l.await;
        }
        tracing::info!(addr = %self.shared.local_addr, "kvbridge-tcp shut down");
        Ok(())
    }
}
