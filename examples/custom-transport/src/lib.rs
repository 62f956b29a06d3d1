//! Example: a custom [`KvTransport`] over a trivial medium, checked by the conformance suite.
//!
//! The medium is a simulated NIC: every [`NicTransport`] owns one OS "progress thread" that
//! executes work requests from a bounded queue, the way one-sided engines (RDMA verbs, Mooncake's
//! transfer engine, NIXL, UCX) run their own progress threads. Endpoints find each other in a
//! process-wide `Mutex<HashMap>` "fabric", keyed by the id in their descriptor.
//!
//! The batch lifecycle — ids, states, deadlines, `wait` exactly once, cancel, fencing — is
//! [`kvbridge_transport::batch::Batches`]; this file only adds what is specific to the medium:
//!
//! - **Bounds before bytes**: every descriptor is resolved and checked in `post`, against the
//!   local regions and the peer's, before a work request is queued.
//! - **Fencing**: the progress thread copies each descriptor inside [`Batches::step`], which
//!   runs nothing once the batch is final (cancelled, timed out, failed), and re-checks the
//!   peer and its registrations there; `deregister` and `shutdown` take the memory lock that
//!   copies into the NIC hold.
//! - **Notifications after data**: pushed to the peer's bounded inbox
//!   ([`kvbridge_transport::inbox::NotificationInbox`]) in the last step, the one that declares
//!   the batch done.
//!
//! Its tests run `kvbridge_conformance::conformance_tests!` (see `tests/conformance.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvbridge_transport::batch::{Batches, Outcome, Step};
use kvbridge_transport::inbox::NotificationInbox;
use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, Direction, KvTransport, MemoryRegion, Notification, PeerId,
    RegionId, Result, Side, TransferBatch, TransportError,
};

const NAME: &str = "example-nic";
const PREFIX: &str = "example-nic:";
/// Work requests queued per NIC before `post` waits.
const QUEUE: usize = 256;
/// Notifications queued per NIC before senders wait (until their deadline).
const NOTIFICATIONS: usize = 1024;

/// The fabric: every live NIC in the process.
fn fabric() -> &'static Mutex<HashMap<u64, Weak<Nic>>> {
    static FABRIC: OnceLock<Mutex<HashMap<u64, Weak<Nic>>>> = OnceLock::new();
    FABRIC.get_or_init(Default::default)
}

/// A transport over a simulated NIC with its own progress thread.
pub struct NicTransport {
    nic: Arc<Nic>,
}

impl std::fmt::Debug for NicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NicTransport")
            .field("id", &self.nic.id)
            .finish()
    }
}

struct Nic {
    id: u64,
    /// Registered regions and the closed flag. Copies into this NIC's memory hold this lock,
    /// so `deregister` and `shutdown` fence them.
    memory: Mutex<Memory>,
    peers: Mutex<HashMap<PeerId, Arc<Link>>>,
    batches: Arc<Batches>,
    counter: AtomicU64,
    queue: SyncSender<WorkRequest>,
    /// Notifications for `recv_notification` (the contract crate's bounded inbox).
    inbox: NotificationInbox,
}

struct Memory {
    regions: HashMap<RegionId, MemoryRegion>,
    closed: bool,
}

struct Link {
    target: Weak<Nic>,
    inbound: PeerId,
    alive: AtomicBool,
}

/// One descriptor, resolved to region handles and checked.
struct Copy {
    local_id: RegionId,
    local: MemoryRegion,
    local_offset: u64,
    remote_id: RegionId,
    remote: MemoryRegion,
    remote_offset: u64,
    len: u64,
}

struct WorkRequest {
    batches: Arc<Batches>,
    id: BatchId,
    peer: PeerId,
    link: Arc<Link>,
    target: Arc<Nic>,
    /// The posting NIC: a read stops once its local region is deregistered there.
    own: Arc<Nic>,
    direction: Direction,
    copies: Vec<Copy>,
    notification: Option<Bytes>,
}

fn lost(peer: PeerId, reason: &str) -> TransportError {
    TransportError::PeerLost {
        peer,
        transport: NAME,
        reason: reason.into(),
    }
}

/// The progress thread: executes work requests until the NIC is dropped.
fn progress(queue: Receiver<WorkRequest>) {
    for wr in queue {
        execute(wr);
    }
}

fn unknown_region(side: Side, region: RegionId) -> TransportError {
    TransportError::UnknownRegion {
        side,
        region,
        transport: NAME,
    }
}

impl Memory {
    /// Whether `id` is still registered as `region` (not deregistered, nor its id reused).
    fn holds(&self, id: RegionId, region: &MemoryRegion) -> bool {
        self.regions.get(&id).is_some_and(|r| r.same_region(region))
    }
}

fn failed(e: TransportError) -> Step {
    Step::Finish(Outcome::Failed(e))
}

fn execute(wr: WorkRequest) {
    let WorkRequest {
        batches,
        id,
        peer,
        link,
        target,
        own,
        direction,
        copies,
        notification,
    } = wr;
    // One descriptor per step, under the batch table's fence.
    for copy in &copies {
        let more = batches.step(id, Instant::now(), || {
            if !link.alive.load(Ordering::Acquire) {
                return failed(lost(peer, "disconnected"));
            }
            // A read writes this side's region: still registered? (This NIC's lock is released
            // before the peer's is taken; `deregister` waits for the running step.)
            if direction == Direction::Read && !lock(&own.memory).holds(copy.local_id, &copy.local)
            {
                return failed(unknown_region(Side::Local, copy.local_id));
            }
            let memory = lock(&target.memory);
            if memory.closed {
                return failed(lost(peer, "the peer shut down"));
            }
            if !memory.holds(copy.remote_id, &copy.remote) {
                return failed(unknown_region(Side::Remote, copy.remote_id));
            }
            let moved = match direction {
                Direction::Write => copy.local.copy_to(
                    copy.local_offset,
                    &copy.remote,
                    copy.remote_offset,
                    copy.len,
                ),
                Direction::Read => copy.remote.copy_to(
                    copy.remote_offset,
                    &copy.local,
                    copy.local_offset,
                    copy.len,
                ),
            };
            match moved {
                Ok(()) => Step::Continue,
                Err(e) => failed(TransportError::BatchFailed {
                    batch: id,
                    peer,
                    reason: e.to_string(),
                }),
            }
        });
        if !more {
            return;
        }
    }
    // Data is in place: deliver the notification and declare the batch done in one step; while
    // the peer's inbox is full, wait for room (the step times the batch out at its deadline).
    while batches.step(id, Instant::now(), || {
        if lock(&target.memory).closed {
            return failed(lost(peer, "the peer shut down"));
        }
        match &notification {
            Some(payload) => match target
                .inbox
                .try_push(Notification::new(link.inbound, payload.clone()))
            {
                Ok(()) => Step::Finish(Outcome::Done),
                Err(_) => Step::Continue,
            },
            None => Step::Finish(Outcome::Done),
        }
    }) {
        let deadline = batches.deadline(id).unwrap_or_else(Instant::now);
        target.inbox.wait_for_room(deadline);
    }
}

impl Default for NicTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl NicTransport {
    /// A NIC joined to the process-wide fabric, with its progress thread started.
    pub fn new() -> Self {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let (queue, rx) = sync_channel(QUEUE);
        std::thread::Builder::new()
            .name(format!("example-nic-{id}"))
            .spawn(move || progress(rx))
            .expect("spawn the NIC progress thread");
        let nic = Arc::new(Nic {
            id,
            memory: Mutex::new(Memory {
                regions: HashMap::new(),
                closed: false,
            }),
            peers: Mutex::default(),
            batches: Arc::new(Batches::new(NAME)),
            counter: AtomicU64::new(1),
            queue,
            inbox: NotificationInbox::new(NAME, NOTIFICATIONS),
        });
        lock(fabric()).insert(id, Arc::downgrade(&nic));
        Self { nic }
    }

    fn next_id(&self) -> u64 {
        self.nic.counter.fetch_add(1, Ordering::Relaxed)
    }

    fn closed(&self) -> Result<()> {
        if lock(&self.nic.memory).closed {
            return Err(TransportError::Closed { transport: NAME });
        }
        Ok(())
    }

    fn link(&self, peer: PeerId) -> Result<Arc<Link>> {
        lock(&self.nic.peers)
            .get(&peer)
            .cloned()
            .ok_or(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            })
    }
}

/// Resolves `(region, offset, len)` against `regions`, or says why not.
fn resolve(
    regions: &HashMap<RegionId, MemoryRegion>,
    side: Side,
    region: RegionId,
    offset: u64,
    len: u64,
) -> Result<MemoryRegion> {
    let r = regions.get(&region).ok_or(TransportError::UnknownRegion {
        side,
        region,
        transport: NAME,
    })?;
    r.range(offset, len)
        .map_err(|e| TransportError::OutOfBounds {
            side,
            region,
            offset,
            len,
            region_len: e.region_len,
        })?;
    Ok(r.clone())
}

#[async_trait::async_trait]
impl KvTransport for NicTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal().with_reads(true)
    }

    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        let mut memory = lock(&self.nic.memory);
        if memory.closed {
            return Err(TransportError::Closed { transport: NAME });
        }
        self.capabilities().check_region(NAME, &region)?;
        let id = RegionId(self.next_id());
        memory.regions.insert(id, region);
        Ok(id)
    }

    async fn deregister(&self, region: RegionId) -> Result<()> {
        self.closed()?;
        let removed = lock(&self.nic.memory).regions.remove(&region);
        if removed.is_none() {
            return Err(TransportError::UnknownRegion {
                side: Side::Local,
                region,
                transport: NAME,
            });
        }
        // Reads into the region check it in every step: once no step runs, none writes it.
        self.nic.batches.wait_for_steps();
        Ok(())
    }

    fn local_descriptor(&self) -> Bytes {
        Bytes::from(format!("{PREFIX}{}", self.nic.id))
    }

    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        self.closed()?;
        let bad = |message: String| TransportError::BadDescriptor {
            transport: NAME,
            message,
        };
        let id: u64 = std::str::from_utf8(descriptor)
            .ok()
            .and_then(|s| s.strip_prefix(PREFIX)?.parse().ok())
            .ok_or_else(|| {
                bad(format!(
                    "expected `{PREFIX}<id>`, got {} bytes",
                    descriptor.len()
                ))
            })?;
        let target = lock(fabric())
            .get(&id)
            .and_then(Weak::upgrade)
            .filter(|t| !lock(&t.memory).closed)
            .ok_or_else(|| {
                bad(format!(
                    "NIC {id} is not on the fabric (dropped or shut down)"
                ))
            })?;
        let inbound = PeerId(target.counter.fetch_add(1, Ordering::Relaxed));
        let peer = PeerId(self.next_id());
        let link = Link {
            target: Arc::downgrade(&target),
            inbound,
            alive: AtomicBool::new(true),
        };
        lock(&self.nic.peers).insert(peer, Arc::new(link));
        Ok(peer)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        self.closed()?;
        let link = lock(&self.nic.peers)
            .remove(&peer)
            .ok_or(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            })?;
        link.alive.store(false, Ordering::Release);
        self.nic
            .batches
            .fail_where(|p| p == peer, |_, p| lost(p, "disconnected"));
        Ok(())
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        self.closed()?;
        // Rows of strided ops are moved one descriptor each (no native strided support).
        let batch = batch.expand_rows(self.name(), self.capabilities().max_ops_per_batch)?;
        let link = self.link(peer)?;
        let target = link
            .target
            .upgrade()
            .ok_or_else(|| lost(peer, "the peer was dropped"))?;
        // Bounds before bytes: resolve every descriptor on both sides first.
        let mut copies = Vec::with_capacity(batch.ops.len());
        {
            let mine = lock(&self.nic.memory);
            for op in &batch.ops {
                let local = resolve(
                    &mine.regions,
                    Side::Local,
                    op.local_region,
                    op.local_offset,
                    op.len,
                )?;
                copies.push(Copy {
                    remote: local.clone(),
                    local_id: op.local_region,
                    local,
                    local_offset: op.local_offset,
                    remote_id: op.remote_region,
                    remote_offset: op.remote_offset,
                    len: op.len,
                });
            }
        }
        {
            let theirs = lock(&target.memory);
            if theirs.closed {
                return Err(lost(peer, "the peer shut down"));
            }
            for (op, copy) in batch.ops.iter().zip(&mut copies) {
                copy.remote = resolve(
                    &theirs.regions,
                    Side::Remote,
                    op.remote_region,
                    op.remote_offset,
                    op.len,
                )?;
            }
        }
        let id = self
            .nic
            .batches
            .insert(peer, batch.timeout, Instant::now())?;
        let mut wr = WorkRequest {
            batches: Arc::clone(&self.nic.batches),
            id,
            peer,
            link,
            target,
            own: Arc::clone(&self.nic),
            direction: batch.direction,
            copies,
            notification: batch.notification,
        };
        // The queue is bounded: when the NIC is busy, back off asynchronously.
        loop {
            match self.nic.queue.try_send(wr) {
                Ok(()) => return Ok(id),
                Err(TrySendError::Full(back)) => {
                    wr = back;
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                Err(TrySendError::Disconnected(_)) => {
                    self.nic.batches.forget(id);
                    return Err(TransportError::Closed { transport: NAME });
                }
            }
        }
    }

    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        self.nic.batches.state(batch, Instant::now())
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        let sleep = |at| tokio::time::sleep_until(tokio::time::Instant::from_std(at));
        self.nic.batches.wait(batch, sleep).await
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        self.nic.batches.cancel(batch, Instant::now())
    }

    async fn recv_notification(&self) -> Result<Notification> {
        self.closed()?;
        self.nic.inbox.recv().await
    }

    async fn probe(&self, peer: PeerId, _timeout: Duration) -> Result<()> {
        self.closed()?;
        let link = self.link(peer)?;
        match link.target.upgrade() {
            Some(t) if !lock(&t.memory).closed && link.alive.load(Ordering::Acquire) => Ok(()),
            _ => Err(lost(peer, "the peer is gone")),
        }
    }

    async fn shutdown(&self) -> Result<()> {
        {
            let mut memory = lock(&self.nic.memory);
            memory.closed = true;
            memory.regions.clear();
        }
        lock(fabric()).remove(&self.nic.id);
        for (_, link) in lock(&self.nic.peers).drain() {
            link.alive.store(false, Ordering::Release);
        }
        self.nic
            .batches
            .fail_where(|_| true, |_, _| TransportError::Closed { transport: NAME });
        self.nic.inbox.close();
        Ok(())
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        let mut fabric = lock(fabric());
        if fabric.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            fabric.remove(&self.id);
        }
    }
}
