//! [`LoopbackTransport`]: an in-process transport with the full contract and no sockets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use bytes::Bytes;
use kvbridge_transport::batch::{Batches, Outcome, Step, deadline_after};
use kvbridge_transport::memory::{CLAIM_WAIT, MemoryError};
use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, Direction, KvTransport, MemoryRegion, Notification, PeerId,
    RegionId, Result, Side, TransferBatch, TransportError,
};
use tokio::sync::{mpsc, watch};

const NAME: &str = "loopback";
const DESCRIPTOR_PREFIX: &str = "kvbridge-loopback/1:";

/// Tuning of a [`LoopbackTransport`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoopbackConfig {
    /// Whether read batches are supported (default `true`). Turn off to test callers' handling
    /// of a push-only transport.
    pub reads: bool,
    /// Declared batch size limit (default none); larger batches are refused at `post`.
    pub max_ops_per_batch: Option<usize>,
    /// Notifications queued for this transport before senders wait (default 1024).
    pub notification_capacity: usize,
    /// Batches queued for the copy worker before `post` waits (default 1024).
    pub queue_capacity: usize,
    /// Bytes copied per step; cancel and deadline checks happen between steps (default 256 KiB).
    pub chunk_bytes: usize,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        Self {
            reads: true,
            max_ops_per_batch: None,
            notification_capacity: 1024,
            queue_capacity: 1024,
            chunk_bytes: 256 * 1024,
        }
    }
}

impl LoopbackConfig {
    /// Sets [`reads`](Self::reads).
    pub fn with_reads(mut self, reads: bool) -> Self {
        self.reads = reads;
        self
    }

    /// Sets [`max_ops_per_batch`](Self::max_ops_per_batch).
    pub fn with_max_ops_per_batch(mut self, max: Option<usize>) -> Self {
        self.max_ops_per_batch = max;
        self
    }

    /// Sets [`notification_capacity`](Self::notification_capacity) (at least 1).
    pub fn with_notification_capacity(mut self, capacity: usize) -> Self {
        self.notification_capacity = capacity.max(1);
        self
    }

    /// Sets [`queue_capacity`](Self::queue_capacity) (at least 1).
    pub fn with_queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity.max(1);
        self
    }

    /// Sets [`chunk_bytes`](Self::chunk_bytes) (at least 1).
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes.max(1);
        self
    }
}

/// Every live loopback endpoint in the process, by the id in its descriptor.
fn registry() -> &'static Mutex<HashMap<u64, Weak<Endpoint>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u64, Weak<Endpoint>>>> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// An in-process [`KvTransport`] with the full contract: bounds checked at `post`, copies on a
/// worker task between registered regions, deadlines, cancel fencing, notifications after the
/// data, reads, peer loss. No sockets, no threads of its own: it needs a tokio runtime (with
/// the time driver) when batches are posted.
///
/// Instances find each other through a process-wide registry keyed by the unique id in their
/// [`local_descriptor`](KvTransport::local_descriptor); any number of them can connect to each
/// other (and to themselves).
///
/// ```
/// use std::sync::Arc;
/// use kvbridge_mock::LoopbackTransport;
/// use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> kvbridge_transport::Result<()> {
/// let prefill: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
/// let decode: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
/// let (src_id, src) = prefill.allocate_registered(4096).await?;
/// let (dst_id, dst) = decode.allocate_registered(4096).await?;
/// src.write_at(0, b"kv bytes").unwrap();
///
/// let peer = prefill.connect(&decode.local_descriptor()).await?;
/// let op = TransferOp::new(src_id, 0, dst_id, 100, 8);
/// prefill.transfer(peer, TransferBatch::write(vec![op])).await?;
/// assert_eq!(dst.to_vec(100, 8).unwrap(), b"kv bytes");
/// # Ok(()) }
/// ```
pub struct LoopbackTransport {
    ep: Arc<Endpoint>,
}

impl std::fmt::Debug for LoopbackTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackTransport")
            .field("id", &self.ep.id)
            .field("config", &self.ep.config)
            .finish()
    }
}

impl Default for LoopbackTransport {
    fn default() -> Self {
        Self::new()
    }
}

struct Endpoint {
    id: u64,
    config: LoopbackConfig,
    state: Mutex<EndpointState>,
    peers: Mutex<HashMap<PeerId, Arc<Link>>>,
    /// Ids, states, deadlines and the copy fence of every batch posted here.
    batches: Arc<Batches>,
    next_region: AtomicU64,
    next_peer: AtomicU64,
    notif_tx: mpsc::Sender<Notification>,
    notif_rx: tokio::sync::Mutex<mpsc::Receiver<Notification>>,
    closed_tx: watch::Sender<bool>,
    worker: Mutex<Option<mpsc::Sender<Job>>>,
}

struct EndpointState {
    regions: HashMap<RegionId, MemoryRegion>,
    closed: bool,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let mut reg = lock(registry());
        if reg.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            reg.remove(&self.id);
        }
    }
}

/// An outbound connection.
struct Link {
    target: Weak<Endpoint>,
    /// How the target knows us (the `from` of our notifications).
    inbound_id: PeerId,
    alive: AtomicBool,
}

struct ResolvedOp {
    local_id: RegionId,
    local: MemoryRegion,
    local_offset: usize,
    remote_id: RegionId,
    remote: MemoryRegion,
    remote_offset: usize,
    /// Bytes per row.
    len: usize,
    /// Rows; row `k` starts `k * stride` after the offsets (bounds checked at post).
    count: u64,
    local_stride: u64,
    remote_stride: u64,
}

struct Job {
    batches: Arc<Batches>,
    id: BatchId,
    peer: PeerId,
    deadline: std::time::Instant,
    target: Arc<Endpoint>,
    /// The posting side: a read stops once its local region is deregistered here.
    own: Arc<Endpoint>,
    link: Arc<Link>,
    direction: Direction,
    ops: Vec<ResolvedOp>,
    notification: Option<Bytes>,
    chunk_bytes: usize,
}

fn peer_lost(peer: PeerId, reason: &str) -> TransportError {
    TransportError::PeerLost {
        peer,
        transport: NAME,
        reason: reason.to_string(),
    }
}

async fn worker(mut rx: mpsc::Receiver<Job>) {
    while let Some(job) = rx.recv().await {
        run(job).await;
    }
}

/// The current time, on tokio's clock (which tests may pause).
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

fn failed(e: TransportError) -> Step {
    Step::Finish(Outcome::Failed(e))
}

/// A read batch's destinations: its distinct local regions (none for a write).
fn read_destinations(direction: Direction, ops: &[ResolvedOp]) -> Vec<(RegionId, &MemoryRegion)> {
    let mut into: Vec<(RegionId, &MemoryRegion)> = Vec::new();
    if direction == Direction::Read {
        for op in ops {
            if !into.iter().any(|(id, _)| *id == op.local_id) {
                into.push((op.local_id, &op.local));
            }
        }
    }
    into
}

/// Why a batch stops before its next step, from what this side knows: the link is down, or a
/// read's destination (`into`) was deregistered here. Takes and releases this side's lock
/// before the step takes the peer's (lock order); `deregister` waits for the running step
/// after removing the region.
fn stopped_here(
    link: &Link,
    peer: PeerId,
    own: &Endpoint,
    into: &[(RegionId, &MemoryRegion)],
) -> Option<TransportError> {
    if !link.alive.load(Ordering::Acquire) {
        return Some(peer_lost(
            peer,
            "disconnected while the batch was in flight",
        ));
    }
    if into.is_empty() {
        return None;
    }
    let own = lock(&own.state);
    into.iter()
        .find(|(id, r)| !own.regions.get(id).is_some_and(|m| m.same_region(r)))
        .map(|(id, _)| TransportError::UnknownRegion {
            side: Side::Local,
            region: *id,
            transport: NAME,
        })
}

/// Copies one batch in chunks, each a step under the batch table's fence, checking peer and
/// registrations before each; then notifies and finishes it.
async fn run(job: Job) {
    if copy_all(&job).await {
        notify_and_finish(job).await;
    }
}

/// Copies every op of the batch, a chunk of `chunk_bytes` per step (cancel and deadline
/// checks between steps). `false` when the batch ended early (it is then final).
async fn copy_all(job: &Job) -> bool {
    let (batches, target, link, ops) = (&job.batches, &job.target, &job.link, &job.ops);
    let (id, peer, direction, chunk_bytes) = (job.id, job.peer, job.direction, job.chunk_bytes);
    let read_into = read_destinations(direction, ops);
    // Position: op `i`, row `row` of it, `done_in_row` bytes of that row copied.
    let mut i = 0;
    let mut row = 0u64;
    let mut done_in_row = 0;
    // Since when a local access holds bytes of the next copy, if one does: the copy is tried
    // again on the runtime's timer (never waited for on this worker thread), as long as a
    // blocking claim would have waited.
    let mut held_since: Option<std::time::Instant> = None;
    while i < ops.len() {
        let mut held = false;
        let more = batches.step(id, now(), || {
            if let Some(e) = stopped_here(link, peer, &job.own, &read_into) {
                return failed(e);
            }
            let target = lock(&target.state);
            if target.closed {
                return failed(peer_lost(
                    peer,
                    "the peer shut down while the batch was in flight",
                ));
            }
            let mut budget = chunk_bytes;
            let mut steps = 0;
            while i < ops.len() && budget > 0 && steps < 4096 {
                let op = &ops[i];
                if !target
                    .regions
                    .get(&op.remote_id)
                    .is_some_and(|r| r.same_region(&op.remote))
                {
                    return failed(TransportError::UnknownRegion {
                        side: Side::Remote,
                        region: op.remote_id,
                        transport: NAME,
                    });
                }
                if row == op.count || op.len == 0 {
                    i += 1;
                    row = 0;
                    continue;
                }
                let n = (op.len - done_in_row).min(budget);
                // In bounds and without overflow: post checked every row (`TransferOp::local_rows_in`).
                let (lo, ro) = (
                    op.local_offset as u64 + row * op.local_stride + done_in_row as u64,
                    op.remote_offset as u64 + row * op.remote_stride + done_in_row as u64,
                );
                let copied = match direction {
                    Direction::Write => op.local.try_copy_to(lo, &op.remote, ro, n as u64),
                    Direction::Read => op.remote.try_copy_to(ro, &op.local, lo, n as u64),
                };
                match copied {
                    Ok(()) => held_since = None,
                    Err(MemoryError::AccessConflict { .. })
                        if held_since
                            .get_or_insert_with(std::time::Instant::now)
                            .elapsed()
                            < CLAIM_WAIT =>
                    {
                        held = true;
                        break;
                    }
                    // Only possible if a caller holds a `borrow_mut` over the bytes.
                    Err(e) => {
                        return failed(TransportError::BatchFailed {
                            batch: id,
                            peer,
                            reason: format!("copy refused: {e}; release borrowed region slices"),
                        });
                    }
                }
                done_in_row += n;
                budget -= n;
                steps += 1;
                if done_in_row == op.len {
                    row += 1;
                    done_in_row = 0;
                }
            }
            Step::Continue
        });
        if !more {
            return false;
        }
        if held {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
    true
}

/// With every byte in place: the notification (when the batch has one), then `Done`.
async fn notify_and_finish(job: Job) {
    let Job {
        batches,
        id,
        peer,
        deadline,
        target,
        link,
        notification,
        ..
    } = job;
    // All bytes are in place. Reserve room for the notification before declaring the batch
    // done, so a done batch always notifies and a failed one never does.
    let permit = match &notification {
        None => None,
        Some(payload) => {
            let deadline = tokio::time::Instant::from_std(deadline);
            match tokio::time::timeout_at(deadline, target.notif_tx.reserve()).await {
                Ok(Ok(permit)) => Some((permit, payload.clone())),
                Ok(Err(_)) => {
                    let e = peer_lost(peer, "the peer stopped receiving notifications");
                    batches.finish(id, Outcome::Failed(e), now());
                    return;
                }
                Err(_) => {
                    batches.finish(id, Outcome::TimedOut, now());
                    return;
                }
            }
        }
    };
    batches.step(id, now(), || {
        if lock(&target.state).closed {
            return failed(peer_lost(
                peer,
                "the peer shut down before the batch completed",
            ));
        }
        if let Some((permit, payload)) = permit {
            permit.send(Notification::new(link.inbound_id, payload));
        }
        Step::Finish(Outcome::Done)
    });
}

impl LoopbackTransport {
    /// A transport with the default [`LoopbackConfig`].
    pub fn new() -> Self {
        Self::with_config(LoopbackConfig::default())
    }

    /// A transport with the given configuration.
    pub fn with_config(config: LoopbackConfig) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let (notif_tx, notif_rx) = mpsc::channel(config.notification_capacity.max(1));
        let ep = Arc::new(Endpoint {
            id,
            config,
            state: Mutex::new(EndpointState {
                regions: HashMap::new(),
                closed: false,
            }),
            peers: Mutex::new(HashMap::new()),
            batches: Arc::new(Batches::new(NAME)),
            next_region: AtomicU64::new(1),
            next_peer: AtomicU64::new(1),
            notif_tx,
            notif_rx: tokio::sync::Mutex::new(notif_rx),
            closed_tx: watch::Sender::new(false),
            worker: Mutex::new(None),
        });
        lock(registry()).insert(id, Arc::downgrade(&ep));
        Self { ep }
    }

    /// Two fresh, unconnected transports with the default configuration.
    pub fn pair() -> (Self, Self) {
        (Self::new(), Self::new())
    }

    /// The configuration this transport was built with.
    pub fn config(&self) -> &LoopbackConfig {
        &self.ep.config
    }

    fn check_open(&self) -> Result<()> {
        if lock(&self.ep.state).closed {
            return Err(TransportError::Closed { transport: NAME });
        }
        Ok(())
    }

    /// The link to `peer` and the peer's endpoint, while both exist.
    fn linked(&self, peer: PeerId) -> Result<(Arc<Link>, Arc<Endpoint>)> {
        let link = lock(&self.ep.peers)
            .get(&peer)
            .cloned()
            .ok_or(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            })?;
        let target = link
            .target
            .upgrade()
            .ok_or_else(|| peer_lost(peer, "the peer transport was dropped"))?;
        Ok((link, target))
    }

    async fn enqueue(&self, job: Job) -> Result<()> {
        let tx = {
            let mut slot = lock(&self.ep.worker);
            match slot.as_ref().filter(|tx| !tx.is_closed()) {
                Some(tx) => tx.clone(),
                None => {
                    let handle = tokio::runtime::Handle::try_current().map_err(|_| {
                        TransportError::InvalidArgument {
                            transport: NAME,
                            message: "post was called outside a tokio runtime; the loopback \
                                      transport copies on a tokio task, so call it from one"
                                .into(),
                        }
                    })?;
                    let (tx, rx) = mpsc::channel(self.ep.config.queue_capacity.max(1));
                    handle.spawn(worker(rx));
                    *slot = Some(tx.clone());
                    tx
                }
            }
        };
        tx.send(job)
            .await
            .map_err(|_| TransportError::Closed { transport: NAME })
    }
}

#[async_trait::async_trait]
impl KvTransport for LoopbackTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_reads(self.ep.config.reads)
            .with_strided_ops(true)
            .with_max_ops_per_batch(self.ep.config.max_ops_per_batch)
    }

    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        let mut state = lock(&self.ep.state);
        if state.closed {
            return Err(TransportError::Closed { transport: NAME });
        }
        self.capabilities().check_region(NAME, &region)?;
        let id = RegionId(self.ep.next_region.fetch_add(1, Ordering::Relaxed));
        state.regions.insert(id, region);
        Ok(id)
    }

    async fn deregister(&self, region: RegionId) -> Result<()> {
        // Taking the state lock fences a peer's copies into the region: they check its
        // registration under this lock before every chunk.
        let removed = {
            let mut state = lock(&self.ep.state);
            if state.closed {
                return Err(TransportError::Closed { transport: NAME });
            }
            state.regions.remove(&region)
        };
        if removed.is_none() {
            return Err(TransportError::UnknownRegion {
                side: Side::Local,
                region,
                transport: NAME,
            });
        }
        // This side's reads into the region check its registration in every step: once no
        // step runs, none writes into it again.
        self.ep.batches.wait_for_steps();
        Ok(())
    }

    fn local_descriptor(&self) -> Bytes {
        Bytes::from(format!("{DESCRIPTOR_PREFIX}{}", self.ep.id))
    }

    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        self.check_open()?;
        let bad = |message: String| TransportError::BadDescriptor {
            transport: NAME,
            message,
        };
        let id: u64 = std::str::from_utf8(descriptor)
            .ok()
            .and_then(|s| s.strip_prefix(DESCRIPTOR_PREFIX))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                bad(format!(
                    "expected `{DESCRIPTOR_PREFIX}<id>`, got {:?}",
                    String::from_utf8_lossy(&descriptor[..descriptor.len().min(64)])
                ))
            })?;
        let target = lock(registry())
            .get(&id)
            .and_then(Weak::upgrade)
            .ok_or_else(|| {
                bad(format!(
                    "no loopback transport #{id} is alive in this process"
                ))
            })?;
        if lock(&target.state).closed {
            return Err(bad(format!("loopback transport #{id} is shut down")));
        }
        let inbound_id = PeerId(target.next_peer.fetch_add(1, Ordering::Relaxed));
        let peer = PeerId(self.ep.next_peer.fetch_add(1, Ordering::Relaxed));
        let link = Arc::new(Link {
            target: Arc::downgrade(&target),
            inbound_id,
            alive: AtomicBool::new(true),
        });
        lock(&self.ep.peers).insert(peer, link);
        tracing::debug!(transport = NAME, %peer, target = id, "connected");
        Ok(peer)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        self.check_open()?;
        let link = lock(&self.ep.peers)
            .remove(&peer)
            .ok_or(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            })?;
        link.alive.store(false, Ordering::Release);
        self.ep.batches.fail_where(
            |p| p == peer,
            |_, p| peer_lost(p, "disconnected by this side"),
        );
        Ok(())
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        self.check_open()?;
        let config = &self.ep.config;
        if batch.direction == Direction::Read && !config.reads {
            return Err(TransportError::Unsupported {
                transport: NAME,
                operation: "read batches",
                remedy: "build the loopback transport with LoopbackConfig::with_reads(true) or post writes",
            });
        }
        if let Some(max) = config.max_ops_per_batch.filter(|&m| batch.ops.len() > m) {
            return Err(TransportError::InvalidArgument {
                transport: NAME,
                message: format!(
                    "a batch of {} descriptors exceeds the declared limit of {max}; split it",
                    batch.ops.len()
                ),
            });
        }
        let (link, target) = self.linked(peer)?;

        // Resolve and bounds-check every descriptor (every row of it) before anything is
        // queued.
        batch.check_destination_rows(NAME)?;
        let mut ops = Vec::with_capacity(batch.ops.len());
        {
            let state = lock(&self.ep.state);
            for op in &batch.ops {
                let region =
                    state
                        .regions
                        .get(&op.local_region)
                        .ok_or(TransportError::UnknownRegion {
                            side: Side::Local,
                            region: op.local_region,
                            transport: NAME,
                        })?;
                let range = op.local_rows_in(region.len())?;
                ops.push(ResolvedOp {
                    local_id: op.local_region,
                    local: region.clone(),
                    local_offset: range.start,
                    remote_id: op.remote_region,
                    remote: region.clone(),
                    remote_offset: 0,
                    // Fits: one row lies inside the region.
                    len: op.len as usize,
                    count: op.count,
                    local_stride: op.local_stride,
                    remote_stride: op.remote_stride,
                });
            }
        }
        {
            let state = lock(&target.state);
            if state.closed {
                return Err(peer_lost(peer, "the peer is shut down"));
            }
            for (op, resolved) in batch.ops.iter().zip(ops.iter_mut()) {
                let region =
                    state
                        .regions
                        .get(&op.remote_region)
                        .ok_or(TransportError::UnknownRegion {
                            side: Side::Remote,
                            region: op.remote_region,
                            transport: NAME,
                        })?;
                let range = op.remote_rows_in(region.len())?;
                resolved.remote = region.clone();
                resolved.remote_offset = range.start;
            }
        }

        let posted = now();
        let id = self.ep.batches.insert(peer, batch.timeout, posted)?;
        tracing::debug!(transport = NAME, %peer, batch = %id, ops = ops.len(), "posted");
        let job = Job {
            batches: Arc::clone(&self.ep.batches),
            id,
            peer,
            deadline: deadline_after(posted, batch.timeout),
            target,
            own: Arc::clone(&self.ep),
            link,
            direction: batch.direction,
            ops,
            notification: batch.notification,
            chunk_bytes: config.chunk_bytes.max(1),
        };
        if let Err(e) = self.enqueue(job).await {
            self.ep.batches.forget(id);
            return Err(e);
        }
        Ok(id)
    }

    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        self.ep.batches.state(batch, now())
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        let sleep = |at| tokio::time::sleep_until(tokio::time::Instant::from_std(at));
        self.ep.batches.wait(batch, sleep).await
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        // The worker copies only inside `Batches::step`, under the table's lock, so once this
        // returns no chunk of a cancelled batch is in flight or starts.
        self.ep.batches.cancel(batch, now())
    }

    async fn recv_notification(&self) -> Result<Notification> {
        let mut closed = self.ep.closed_tx.subscribe();
        if *closed.borrow_and_update() {
            return Err(TransportError::Closed { transport: NAME });
        }
        let mut rx = tokio::select! {
            rx = self.ep.notif_rx.lock() => rx,
            _ = closed.wait_for(|c| *c) => return Err(TransportError::Closed { transport: NAME }),
        };
        tokio::select! {
            biased;
            _ = closed.wait_for(|c| *c) => Err(TransportError::Closed { transport: NAME }),
            n = rx.recv() => n.ok_or(TransportError::Closed { transport: NAME }),
        }
    }

    async fn probe(&self, peer: PeerId, _timeout: Duration) -> Result<()> {
        self.check_open()?;
        let (_, target) = self.linked(peer)?;
        if lock(&target.state).closed {
            return Err(peer_lost(peer, "the peer is shut down"));
        }
        Ok(())
    }

    async fn shutdown(&self) -> Result<()> {
        {
            let mut state = lock(&self.ep.state);
            if state.closed {
                return Ok(());
            }
            // Under the state lock: no copy into our regions is in flight, and none starts.
            state.closed = true;
            state.regions.clear();
        }
        self.ep.closed_tx.send_replace(true);
        lock(registry()).remove(&self.ep.id);
        for link in lock(&self.ep.peers).drain() {
            link.1.alive.store(false, Ordering::Release);
        }
        self.ep
            .batches
            .fail_where(|_| true, |_, _| TransportError::Closed { transport: NAME });
        tracing::info!(transport = NAME, id = self.ep.id, "shut down");
        Ok(())
    }
}
