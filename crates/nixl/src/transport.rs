//! `NixlTransport`: the `KvTransport` contract on one NIXL agent with the UCX backend.
//!
//! Data moves as NIXL WRITE transfers, posted once and never recalled, so every batch is a
//! committing batch of the shared [`Batches`] table: it ends when NIXL reports it (done or
//! failed), and `cancel` waits for that ([`Batches::settle`]). A small control protocol rides
//! on NIXL notifications (see [`crate::control`]): a sender introduces itself at `connect`, and
//! a receiver tells its senders about every region it registers or deregisters and waits for
//! their acknowledgement, so the sender's region table is never stale and a deregistered
//! region receives no byte once `deregister` returned.
//!
//! One background thread per transport drives NIXL: it polls the transfers in flight and the
//! notifications (each poll also drives UCX's progress), sleeping 10 to 20 µs between polls
//! while transfers are in flight, 10 to 50 µs while something happened in the last 20 ms, and
//! backing off to 1 ms when idle (no busy spin); `post` wakes it. NIXL's own progress thread
//! is off by default ([`NixlOptions::progress_thread`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvbridge_transport::batch::{BatchTable, Batches, Fence, Outcome};
use kvbridge_transport::memory::{CLAIM_WAIT, MemoryError};
use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, Direction, KvTransport, MemoryRegion, Notification, PeerId,
    RegionId, Result, Side, TransferBatch, TransportError,
};
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, NotificationMap, OptArgs, RegDescList,
    RegistrationHandle, ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};
use tokio::sync::{mpsc, oneshot};

use crate::control::Control;
use crate::descriptor::{Descriptor, RemoteRegion};
use crate::ffi::{self, Segment};
use crate::runtime::Runtime;
use crate::stride::{Dlist, Run, StrideAgent};
use crate::{NAME, NixlError, NixlOptions, stats};

/// The polling thread's back-off: from `POLL_MIN` up to `POLL_IN_FLIGHT_MAX` while transfers
/// are in flight (each poll also drives UCX's progress, which the batch's completion waits
/// for), up to `POLL_BUSY_MAX` within `POLL_LINGER` of the last activity (an inbound TCP lane
/// needs the receiver's progress to land bytes), up to `POLL_IDLE_MAX` after that; `post`
/// wakes it at once. A poll that took `POLL_WORKED` or more did work inside UCX (read an
/// inbound stream, say) and counts as activity.
const POLL_MIN: Duration = Duration::from_micros(10);
/// How long `wait` polls NIXL itself before sleeping on the batch table.
const WAIT_DRIVES: Duration = Duration::from_micros(100);
const POLL_IN_FLIGHT_MAX: Duration = Duration::from_micros(20);
const POLL_BUSY_MAX: Duration = Duration::from_micros(50);
const POLL_IDLE_MAX: Duration = Duration::from_millis(1);
const POLL_LINGER: Duration = Duration::from_millis(20);
const POLL_WORKED: Duration = Duration::from_micros(20);

fn sleep_until(at: Instant) -> tokio::time::Sleep {
    tokio::time::sleep_until(tokio::time::Instant::from_std(at))
}

/// A region this transport does not know (any more), on `side`.
fn unknown_region(side: Side, region: RegionId) -> TransportError {
    TransportError::UnknownRegion {
        side,
        region,
        transport: NAME,
    }
}

fn call_err(call: &'static str, e: nixl_sys::NixlError, remedy: &'static str) -> TransportError {
    NixlError::Call {
        call,
        status: format!("{e:?} ({e})"),
        remedy,
    }
    .into()
}

struct LocalRegion {
    region: MemoryRegion,
    /// Deregisters from NIXL when dropped.
    _registration: RegistrationHandle,
}

struct OutPeer {
    name: String,
    regions: HashMap<u64, RemoteRegion>,
    /// Why the peer is unusable, once it is.
    lost: Option<String>,
}

struct InPeer {
    id: PeerId,
    /// Stopped answering control messages: skipped from then on.
    silent: bool,
}

struct Inflight {
    /// Shared with the call posting it; once `posted`, only this table's holder touches it.
    req: Arc<XferRequest>,
    /// Handed to NIXL (`postXferReq` returned): until then the polling thread neither asks
    /// NIXL about it nor fences it, since the post may still be running on another thread.
    posted: bool,
    peer: PeerId,
    /// Local regions it reads: kept registered until it ends.
    local_regions: Vec<u64>,
    remote_regions: Vec<u64>,
    /// The staging region its gathered rows are sent from, if any: back to the pool once
    /// NIXL no longer reads it.
    staging: Option<Staging>,
    /// The prepared stride lists its request was made from, released after the request.
    dlists: Vec<Dlist>,
}

/// A registered region holding a batch's gathered rows; deregistered before it is unmapped.
struct Staging {
    _registration: RegistrationHandle,
    region: MemoryRegion,
}

impl Staging {
    fn len(&self) -> usize {
        Segment::of(&self.region).len
    }
}

/// Idle staging regions kept mapped and registered for later batches: a fresh one costs a
/// mapping, its page faults and a UCX registration at every `post`, more than the copy into
/// it. At most `STAGING_POOL_MAX` idle regions of `STAGING_POOL_MAX_BYTES` in all are kept;
/// new ones are rounded up (to a power of two up to `STAGING_ROUND`, to a multiple of it
/// above) so later batches of similar shape fit.
const STAGING_POOL_MAX: usize = 8;
const STAGING_POOL_MAX_BYTES: usize = 512 << 20;
const STAGING_MIN: usize = 64 << 10;
const STAGING_ROUND: usize = 4 << 20;

/// Batches of at least this many bytes are posted from a blocking thread (`post` returns while
/// UCX copies); smaller ones from `post` itself, which saves a thread hop per small write.
const POST_ASIDE_BYTES: usize = 4 << 20;

/// Rows at most this long whose destinations are back to back are gathered into a staging
/// region at `post` (host memory only), so NIXL gets one descriptor per run instead of one per
/// row: UCX pays per descriptor, and a copy of a small row costs less.
const GATHER_MAX_ROW: usize = 16 * 1024;

/// An acknowledgement that waits until the batches in flight into regions the peer removed
/// have ended (the fencing point of the peer's `deregister`).
struct DeferredAck {
    to: String,
    seq: u64,
    waiting_on: Vec<BatchId>,
}

impl Drop for State {
    fn drop(&mut self) {
        // A transport dropped with transfers still in flight: releasing their requests or
        // deregistering the memory they read is not safe while NIXL may still use them, so
        // those are leaked instead (only in that case).
        if !self.inflight.is_empty() || !self.zombies.is_empty() {
            std::mem::forget(std::mem::take(&mut self.inflight));
            std::mem::forget(std::mem::take(&mut self.zombies));
            std::mem::forget(std::mem::take(&mut self.retired));
            std::mem::forget(std::mem::take(&mut self.regions));
        }
    }
}

impl State {
    /// An outbound peer that is known and not lost.
    fn usable(&self, peer: PeerId) -> Result<&OutPeer> {
        let p = self.out.get(&peer.0).ok_or(TransportError::UnknownPeer {
            peer,
            transport: NAME,
        })?;
        match &p.lost {
            Some(reason) => Err(TransportError::PeerLost {
                peer,
                transport: NAME,
                reason: reason.clone(),
            }),
            None => Ok(p),
        }
    }

    /// Refuses a batch about to be handed to NIXL when its peer was lost, or a region it names
    /// left either side's table, since its descriptors were checked: a deregistration that
    /// finished meanwhile did not wait for it (it waits only for batches in `inflight`).
    fn still_usable(&self, peer: PeerId, local: &[u64], remote: &[u64]) -> Result<()> {
        let p = self.usable(peer)?;
        if let Some(&r) = local.iter().find(|r| !self.regions.contains_key(r)) {
            return Err(unknown_region(Side::Local, RegionId(r)));
        }
        if let Some(&r) = remote.iter().find(|r| !p.regions.contains_key(r)) {
            return Err(unknown_region(Side::Remote, RegionId(r)));
        }
        Ok(())
    }

    /// Fenced batches (deadline passed) NIXL has: moved to the zombies; returns their peers,
    /// to be cut off so nothing more is sent. One still being posted is fenced once its post
    /// returned.
    fn fence_posted(&mut self) -> Vec<PeerId> {
        let mut cut = Vec::new();
        for id in std::mem::take(&mut self.fenced) {
            match self.inflight.get(&id) {
                Some(f) if !f.posted => self.fenced.push(id),
                Some(_) => {
                    if let Some(f) = self.inflight.remove(&id) {
                        cut.push(f.peer);
                        self.zombies.push(f);
                    }
                }
                None => {}
            }
        }
        cut
    }

    /// Local regions a transfer in flight (or a zombie) reads.
    fn sources_in_use(&self) -> HashSet<u64> {
        self.inflight
            .values()
            .chain(&self.zombies)
            .flat_map(|f| f.local_regions.iter().copied())
            .collect()
    }

    /// A transfer NIXL let go of (done, failed or a zombie no longer in progress): its request
    /// is released first, then its staging region goes back to the pool.
    fn release(&mut self, f: Inflight) {
        let Inflight {
            req,
            staging,
            dlists,
            ..
        } = f;
        drop(req);
        drop(dlists);
        self.recycle(staging);
    }

    /// Keeps `staging` (no longer read by any request) for a later batch, within the pool's
    /// bounds; otherwise it is deregistered and unmapped.
    fn recycle(&mut self, staging: Option<Staging>) {
        let Some(s) = staging else { return };
        let idle: usize = self.staging.iter().map(Staging::len).sum();
        if !self.staging_closed
            && self.staging.len() < STAGING_POOL_MAX
            && idle + s.len() <= STAGING_POOL_MAX_BYTES
        {
            self.staging.push(s);
        }
    }

    /// The smallest idle staging region of at least `len` bytes, taken out of the pool.
    fn take_staging(&mut self, len: usize) -> Option<Staging> {
        let i = (0..self.staging.len())
            .filter(|&i| self.staging[i].len() >= len)
            .min_by_key(|&i| self.staging[i].len())?;
        Some(self.staging.swap_remove(i))
    }

    /// Deregisters `local` from NIXL now, or once no transfer reads it any more.
    fn retire(&mut self, id: u64, local: LocalRegion) {
        if self.sources_in_use().contains(&id) {
            self.retired.push((id, local));
        }
    }
}

#[derive(Default)]
struct State {
    regions: HashMap<u64, LocalRegion>,
    out: HashMap<u64, OutPeer>,
    /// Inbound peers (senders that introduced themselves), by agent name.
    inbound: HashMap<String, InPeer>,
    /// Agent names whose NIXL metadata is loaded.
    loaded: HashSet<String>,
    inflight: HashMap<BatchId, Inflight>,
    /// Requests of fenced or failed batches NIXL still reports in progress: kept (releasing a
    /// request in progress is not safe) and polled until NIXL lets go of them.
    zombies: Vec<Inflight>,
    /// Local regions deregistered (or left at shutdown) while a transfer still read them:
    /// deregistered from NIXL once no transfer in flight or zombie names them (UCX must not
    /// lose the registration of memory it is still sending from).
    retired: Vec<(u64, LocalRegion)>,
    deferred: Vec<DeferredAck>,
    /// Batches whose deadline passed while NIXL still had them: their peer is cut off.
    fenced: Vec<BatchId>,
    /// Idle staging regions: only ones no request in flight (or zombie) reads, so a region
    /// handed out is never one a batch still sends from. Emptied at shutdown.
    staging: Vec<Staging>,
    /// Set at shutdown: staging regions are freed when their batch ends, not kept.
    staging_closed: bool,
}

pub(crate) struct Inner {
    agent: Agent,
    backend: Backend,
    name: String,
    caps: Capabilities,
    options: NixlOptions,
    batches: Batches,
    state: Mutex<State>,
    next_id: AtomicU64,
    closed: AtomicBool,
    /// Set once `shutdown` has told every peer: the poller may stop when nothing is in flight.
    finished: AtomicBool,
    /// Set by the transport's `Drop`: the poller stops at once.
    dropped: AtomicBool,
    /// Waiters for acks, by sequence number, with the agent that should answer.
    acks: Mutex<HashMap<u64, (String, oneshot::Sender<()>)>>,
    notify_tx: Mutex<Option<mpsc::UnboundedSender<Notification>>>,
    notify_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Notification>>,
    /// The polling thread, unparked by `post` when it sleeps long ([`Inner::nudge`]).
    poller: std::sync::OnceLock<std::thread::Thread>,
    /// Set by `post`: the polling thread counts it as activity.
    kicked: AtomicBool,
    /// How long the polling thread's current sleep is, in microseconds.
    poller_sleep_us: AtomicU64,
    /// Waits driving their own batch right now ([`Driving`]): the polling thread leaves
    /// NIXL to them.
    drivers: AtomicUsize,
    /// NIXL's stride descriptors for strided ops, or why they cannot be used here (it holds
    /// only the agent's handle, used while `agent` lives).
    stride: std::result::Result<StrideAgent, String>,
}

/// A [`KvTransport`] on a NIXL agent with the UCX backend (feature `nixl`).
///
/// Regions must come from [`allocate`](KvTransport::allocate) (or be foreign memory): a peer's
/// NIXL writes them behind the CPU's back, so they are never borrowed as Rust slices. Device
/// memory is accepted when the UCX backend reports VRAM support.
pub struct NixlTransport {
    inner: Arc<Inner>,
    poller: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("agent", &self.inner.name)
            .finish()
    }
}

impl NixlTransport {
    /// A transport with the default [`NixlOptions`].
    pub fn new() -> Result<Self> {
        Self::with_options(NixlOptions::default())
    }

    /// A transport on a fresh NIXL agent. Finds and loads the runtime first (see
    /// [`Runtime::locate`]); a missing runtime is an error naming `cargo xtask nixl-setup`.
    pub fn with_options(options: NixlOptions) -> Result<Self> {
        let rt = match &options.runtime {
            Some(rt) => rt.clone(),
            None => Runtime::locate()?,
        };
        ffi::load(&rt)?;
        static AGENTS: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "kvbridge-{}-{}-{:x}",
            std::process::id(),
            AGENTS.fetch_add(1, Ordering::Relaxed),
            Instant::now().elapsed().as_nanos() as u64 ^ std::ptr::addr_of!(AGENTS) as u64
        );
        let cfg = AgentConfig {
            // Off by default: on a host with few cores NIXL's progress thread contends with the
            // posting thread for UCX's worker lock and halves the rate of writes of many
            // descriptors; the polling thread drives UCX's progress instead.
            enable_prog_thread: options.progress_thread,
            pthr_delay_us: options.progress_interval.as_micros() as u64,
            thread_sync: ThreadSync::Strict,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&name, &cfg).map_err(|e| {
            call_err(
                "createAgent",
                e,
                "check that the runtime from `cargo xtask nixl-setup` is complete",
            )
        })?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| {
            call_err(
                "getPluginParams(UCX)",
                e,
                "the UCX plugin was not found: check NIXL_PLUGIN_DIR, or run `cargo xtask nixl-setup` again",
            )
        })?;
        let backend = agent.create_backend("UCX", &params).map_err(|e| {
            call_err(
                "createBackend(UCX)",
                e,
                "UCX found no usable transport: check UCX_TLS (e.g. unset it, or UCX_TLS=tcp)",
            )
        })?;
        let vram = agent
            .get_backend_params(&backend)
            .ok()
            .is_some_and(|(mems, _)| mems.iter().any(|m| matches!(m, Ok(MemType::Vram))));
        // The wheel's UCX reports VRAM support whether or not a GPU is there: declare device
        // memory only where a CUDA device node exists too.
        let gpu = std::path::Path::new("/dev/nvidiactl").exists();
        let caps = Capabilities::minimal()
            .with_cross_process(true)
            .with_device_memory(vram && gpu && options.device_memory);
        // Read only when the option is on (off, strided ops go per row and nothing is said).
        let stride = if options.stride_descriptors {
            StrideAgent::new(&agent)
        } else {
            Err("NixlOptions::stride_descriptors is off".to_owned())
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            agent,
            backend,
            name,
            caps,
            batches: Batches::from_table(
                BatchTable::new(NAME).with_commit_grace(options.commit_grace),
            ),
            options,
            state: Mutex::new(State::default()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
            acks: Mutex::new(HashMap::new()),
            notify_tx: Mutex::new(Some(tx)),
            notify_rx: tokio::sync::Mutex::new(rx),
            poller: std::sync::OnceLock::new(),
            kicked: AtomicBool::new(false),
            poller_sleep_us: AtomicU64::new(0),
            drivers: AtomicUsize::new(0),
            stride,
        });
        let weak = Arc::downgrade(&inner);
        let poller = std::thread::Builder::new()
            .name("kvbridge-nixl".to_owned())
            .spawn(move || poll_loop(weak))
            .map_err(|e| TransportError::Io {
                transport: NAME,
                context: "starting the NIXL polling thread".to_owned(),
                source: e,
            })?;
        let _ = inner.poller.set(poller.thread().clone());
        Ok(Self {
            inner,
            poller: Some(poller),
        })
    }

    /// The NIXL agent's name (unique per transport).
    pub fn agent_name(&self) -> &str {
        &self.inner.name
    }
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.finished.store(true, Ordering::SeqCst);
        // The poller is stopped and joined: a NIXL call of it that outlived the transport would
        // run under a process that may be exiting (and tearing NIXL's libraries down), and the
        // agent would be destroyed on the poller's thread instead of this one. It finishes at
        // most the turn it is in.
        self.inner.dropped.store(true, Ordering::SeqCst);
        if let Some(poller) = self.poller.take() {
            poller.thread().unpark();
            let _ = poller.join();
        }
    }
}

impl Inner {
    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Wakes the polling thread for a new batch, as activity: its polls drive UCX's progress,
    /// which the batch's bytes and notification may still need.
    fn kick(&self) {
        self.kicked.store(true, Ordering::SeqCst);
        if let Some(poller) = self.poller.get() {
            poller.unpark();
        }
    }

    /// Marks activity for the polling thread, waking it only from a sleep longer than
    /// `POLL_BUSY_MAX`: a shorter one ends soon anyway, and a `wait` that follows drives its
    /// batch itself; each needless wake-up is a thread switch that competes with the peer's
    /// progress for the same cores.
    fn nudge(&self) {
        // The flag first: a polling thread about to sleep stores its sleep, then looks at the
        // flag, so one of the two sees the other.
        self.kicked.store(true, Ordering::SeqCst);
        if self.poller_sleep_us.load(Ordering::SeqCst) > POLL_BUSY_MAX.as_micros() as u64 {
            self.kick();
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(TransportError::Closed { transport: NAME })
        } else {
            Ok(())
        }
    }

    fn descriptor(&self, regions: Vec<RemoteRegion>) -> Result<Descriptor> {
        let metadata = self.agent.get_local_md().map_err(|e| {
            call_err(
                "getLocalMD",
                e,
                "the agent is unusable; create a new transport",
            )
        })?;
        Ok(Descriptor {
            name: self.name.clone(),
            regions,
            metadata,
        })
    }

    fn region_table(&self) -> Vec<RemoteRegion> {
        let st = lock(&self.state);
        let mut v: Vec<RemoteRegion> = st
            .regions
            .iter()
            .map(|(&id, r)| {
                let seg = Segment::of(&r.region);
                RemoteRegion {
                    id,
                    addr: seg.addr as u64,
                    len: seg.len as u64,
                    device: seg.device,
                }
            })
            .collect();
        v.sort_by_key(|r| r.id);
        v
    }

    fn send(&self, to: &str, msg: &Control) -> Result<()> {
        self.agent
            .send_notification(to, &msg.encode(), Some(&self.backend))
            .map_err(|e| {
                call_err(
                    "genNotif",
                    e,
                    "the peer's connection is gone; reconnect with its descriptor",
                )
            })
    }

    /// Sends a control message that the peer acknowledges, and waits for the ack.
    async fn request(&self, to: &str, make: impl FnOnce(u64) -> Control, within: Duration) -> bool {
        let seq = self.id();
        let (tx, rx) = oneshot::channel();
        lock(&self.acks).insert(seq, (to.to_owned(), tx));
        let sent = self.send(to, &make(seq)).is_ok();
        let ok = sent && matches!(tokio::time::timeout(within, rx).await, Ok(Ok(())));
        lock(&self.acks).remove(&seq);
        ok
    }

    /// Tells every inbound peer the current region table (plus the NIXL metadata of a new
    /// region) and waits for their acks; a peer that does not answer is skipped from then on.
    async fn publish(&self, md: Option<Vec<u8>>) {
        let table = self.region_table();
        let peers: Vec<String> = lock(&self.state)
            .inbound
            .iter()
            .filter(|(_, p)| !p.silent)
            .map(|(n, _)| n.clone())
            .collect();
        for name in peers {
            let ok = self
                .request(
                    &name,
                    |seq| Control::Update {
                        seq,
                        regions: table.clone(),
                        metadata: md.clone().unwrap_or_default(),
                    },
                    self.options.control_timeout,
                )
                .await;
            if !ok {
                tracing::warn!(peer = %name, "a NIXL peer did not acknowledge a region update; it is skipped from now on");
                if let Some(p) = lock(&self.state).inbound.get_mut(&name) {
                    p.silent = true;
                }
            }
        }
    }

    fn peer_lost(&self, peer: PeerId, reason: String) {
        let mut st = lock(&self.state);
        if let Some(p) = st.out.get_mut(&peer.0) {
            p.lost.get_or_insert(reason.clone());
        }
        drop(st);
        self.batches.fail_where(
            |p| p == peer,
            |_, peer| TransportError::PeerLost {
                peer,
                transport: NAME,
                reason: reason.clone(),
            },
        );
    }

    /// Hands batch `id` (in `inflight`, not yet posted) to NIXL. A batch NIXL finished inside
    /// the post ends here; otherwise the polling thread takes it over. On a refusal the batch
    /// leaves `inflight` (NIXL never had it) and the error and the peer-loss reason come back.
    fn post_now(
        &self,
        id: BatchId,
        req: &XferRequest,
    ) -> std::result::Result<(), (TransportError, String)> {
        let started = Instant::now();
        let posted = self.agent.post_xfer_req(req, None);
        stats::time(&stats::POST_NS, started);
        // UCX often finishes a write inside the post (its cma lane copies there, and a small
        // write may be acknowledged at once): such a batch ends here, without waiting for the
        // polling thread's next turn.
        let done =
            posted.is_ok() && matches!(self.agent.get_xfer_status(req), Ok(XferStatus::Success));
        let mut st = lock(&self.state);
        let Some(f) = st.inflight.get_mut(&id) else {
            return Ok(());
        };
        let peer = f.peer;
        match posted {
            Err(e) => {
                if let Some(f) = st.inflight.remove(&id) {
                    st.release(f);
                }
                drop(st);
                // NIXL refuses to post to an agent whose connection broke (the peer died).
                let reason = format!(
                    "NIXL postXferReq failed with status {e:?}: the peer process died or its \
                     UCX connection broke"
                );
                let e = TransportError::PeerLost {
                    peer,
                    transport: NAME,
                    reason: reason.clone(),
                };
                Err((e, reason))
            }
            Ok(_) if done => {
                if let Some(f) = st.inflight.remove(&id) {
                    st.release(f);
                }
                drop(st);
                self.batches.finish(id, Outcome::Done, Instant::now());
                // The notification may still wait in UCX's queue for a progress call.
                self.kick();
                Ok(())
            }
            Ok(_) => {
                f.posted = true;
                drop(st);
                self.nudge();
                Ok(())
            }
        }
    }

    // ---- the polling thread's work ----------------------------------------------------------

    fn poll_transfers(&self) -> bool {
        self.poll_transfers_locked(lock(&self.state))
    }

    /// [`poll_transfers`](Self::poll_transfers) unless another thread holds the state (the
    /// polling thread, polling the same transfers): `wait` then yields instead of sleeping on
    /// the lock.
    fn try_poll_transfers(&self) {
        match self.state.try_lock() {
            Ok(st) => {
                self.poll_transfers_locked(st);
            }
            Err(std::sync::TryLockError::Poisoned(e)) => {
                self.poll_transfers_locked(e.into_inner());
            }
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }

    fn poll_transfers_locked(&self, mut st: std::sync::MutexGuard<'_, State>) -> bool {
        let now = Instant::now();
        let cut = st.fence_posted();
        let mut busy = !cut.is_empty();
        let mut finished = Vec::new();
        for (&id, f) in st.inflight.iter().filter(|(_, f)| f.posted) {
            match self.agent.get_xfer_status(&f.req) {
                Ok(XferStatus::InProgress) => {}
                Ok(XferStatus::Success) => finished.push((id, Ok(()))),
                Err(e) => finished.push((id, Err((f.peer, e)))),
            }
        }
        let mut lost = Vec::new();
        for (id, r) in finished {
            busy = true;
            if let Some(f) = st.inflight.remove(&id) {
                st.release(f);
            }
            match r {
                Ok(()) => {
                    self.batches.finish(id, Outcome::Done, now);
                }
                Err((peer, e)) => {
                    let reason = format!(
                        "NIXL reported the transfer failed with status {e:?}: the peer process \
                         died or its UCX connection broke"
                    );
                    self.batches.finish(
                        id,
                        Outcome::Failed(TransportError::PeerLost {
                            peer,
                            transport: NAME,
                            reason: reason.clone(),
                        }),
                        now,
                    );
                    lost.push((peer, reason));
                }
            }
        }
        let (zombies, let_go): (Vec<_>, Vec<_>) =
            std::mem::take(&mut st.zombies).into_iter().partition(|f| {
                matches!(
                    self.agent.get_xfer_status(&f.req),
                    Ok(XferStatus::InProgress)
                )
            });
        st.zombies = zombies;
        for f in let_go {
            st.release(f);
        }
        if !st.retired.is_empty() {
            let used = st.sources_in_use();
            st.retired.retain(|(id, _)| used.contains(id));
        }
        // Acks deferred until the batches into removed regions ended.
        let inflight: HashSet<BatchId> = st.inflight.keys().copied().collect();
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut st.deferred)
            .into_iter()
            .partition(|d| d.waiting_on.iter().all(|b| !inflight.contains(b)));
        st.deferred = waiting;
        let cut_names: Vec<(PeerId, String)> = cut
            .iter()
            .filter_map(|p| st.out.get(&p.0).map(|o| (*p, o.name.clone())))
            .collect();
        drop(st);
        for d in ready {
            busy = true;
            let _ = self.send(&d.to, &Control::Ack { seq: d.seq });
        }
        for (peer, reason) in lost {
            self.peer_lost(peer, reason);
        }
        for (peer, name) in cut_names {
            // Closing the UCX endpoints stops whatever of the batch was not sent yet.
            let _ = self.agent.invalidate_remote_md(&name);
            lock(&self.state).loaded.remove(&name);
            self.peer_lost(
                peer,
                "a batch to it passed its deadline while NIXL still had it; the connection was \
                 closed to fence it"
                    .to_owned(),
            );
        }
        busy
    }

    fn poll_notifications(&self) -> bool {
        let Ok(mut map) = NotificationMap::new() else {
            return false;
        };
        if self.agent.get_notifications(&mut map, None).is_err() {
            return false;
        }
        if map.is_empty().unwrap_or(true) {
            return false;
        }
        let agents: Vec<String> = map
            .agents()
            .filter_map(|a| a.ok().map(str::to_owned))
            .collect();
        for from in agents {
            let n = map.get_notifications_size(&from).unwrap_or(0);
            for i in 0..n {
                if let Ok(bytes) = map.get_notification_bytes(&from, i) {
                    self.on_message(&from, &bytes);
                }
            }
        }
        true
    }

    fn on_message(&self, from: &str, bytes: &[u8]) {
        let msg = match Control::decode(bytes) {
            Ok(m) => m,
            Err(why) => {
                tracing::warn!(peer = %from, "dropped a malformed NIXL notification: {why}");
                return;
            }
        };
        match msg {
            Control::User(payload) => {
                let id = {
                    let mut st = lock(&self.state);
                    match st.inbound.get(from) {
                        Some(p) => p.id,
                        None => {
                            let id = PeerId(self.id());
                            st.inbound
                                .insert(from.to_owned(), InPeer { id, silent: true });
                            id
                        }
                    }
                };
                if let Some(tx) = lock(&self.notify_tx).as_ref() {
                    let _ = tx.send(Notification::new(id, Bytes::from(payload)));
                }
            }
            Control::Hello { seq, descriptor } => self.on_hello(from, seq, &descriptor),
            Control::Ack { seq } => {
                if let Some((_, tx)) = lock(&self.acks).remove(&seq) {
                    let _ = tx.send(());
                }
            }
            Control::Probe { seq } => {
                let _ = self.send(from, &Control::Ack { seq });
            }
            Control::Update {
                seq,
                regions,
                metadata,
            } => self.on_update(from, seq, regions, &metadata),
            Control::Bye => {
                // Whoever waits for an answer from it stops waiting.
                lock(&self.acks).retain(|_, (to, _)| to != from);
                let peers: Vec<PeerId> = {
                    let mut st = lock(&self.state);
                    if let Some(p) = st.inbound.get_mut(from) {
                        p.silent = true;
                    }
                    st.out
                        .iter()
                        .filter(|(_, p)| p.name == from)
                        .map(|(&id, _)| PeerId(id))
                        .collect()
                };
                for peer in peers {
                    self.peer_lost(peer, "the peer shut down or disconnected".to_owned());
                }
            }
        }
    }

    /// A peer's `Hello`: its metadata loaded (once), then answered.
    fn on_hello(&self, from: &str, seq: u64, descriptor: &[u8]) {
        let d = match Descriptor::decode(descriptor) {
            Ok(d) if d.name == from => d,
            Ok(d) => {
                tracing::warn!(peer = %from, claimed = %d.name, "refused a NIXL hello whose descriptor names another agent");
                return;
            }
            Err(why) => {
                tracing::warn!(peer = %from, "refused a NIXL hello: {why}");
                return;
            }
        };
        let loaded = lock(&self.state).loaded.contains(from);
        if !loaded {
            if let Err(e) = self.agent.load_remote_md(&d.metadata) {
                tracing::warn!(peer = %from, "could not load a NIXL peer's metadata: {e:?}");
                return;
            }
            lock(&self.state).loaded.insert(from.to_owned());
        }
        {
            let mut st = lock(&self.state);
            let id = st.inbound.get(from).map(|p| p.id);
            let id = id.unwrap_or_else(|| PeerId(self.id()));
            st.inbound
                .insert(from.to_owned(), InPeer { id, silent: false });
        }
        let _ = self.send(from, &Control::Ack { seq });
    }

    /// A peer's new region table: batches in flight to removed regions must end before the
    /// update is acknowledged.
    fn on_update(&self, from: &str, seq: u64, regions: Vec<RemoteRegion>, metadata: &[u8]) {
        if !metadata.is_empty() {
            if let Err(e) = self.agent.load_remote_md(metadata) {
                tracing::warn!(peer = %from, "could not load a NIXL peer's region metadata: {e:?}");
            }
        }
        let mut st = lock(&self.state);
        let mut removed = HashSet::new();
        let table: HashMap<u64, RemoteRegion> = regions.into_iter().map(|r| (r.id, r)).collect();
        let mut peers = Vec::new();
        for (&pid, p) in st.out.iter_mut().filter(|(_, p)| p.name == from) {
            removed.extend(p.regions.keys().filter(|k| !table.contains_key(k)).copied());
            p.regions = table.clone();
            peers.push(PeerId(pid));
        }
        let waiting_on: Vec<BatchId> = st
            .inflight
            .iter()
            .filter(|(_, f)| {
                peers.contains(&f.peer) && f.remote_regions.iter().any(|r| removed.contains(r))
            })
            .map(|(&id, _)| id)
            .collect();
        st.deferred.push(DeferredAck {
            to: from.to_owned(),
            seq,
            waiting_on,
        });
    }
}

/// One `wait` driving its own batch, counted in `Inner::drivers` while it lives.
struct Driving<'a>(&'a Inner);

impl<'a> Driving<'a> {
    fn new(inner: &'a Inner) -> Self {
        inner.drivers.fetch_add(1, Ordering::SeqCst);
        Self(inner)
    }
}

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.0.drivers.fetch_sub(1, Ordering::SeqCst);
    }
}

fn poll_loop(weak: Weak<Inner>) {
    ffi::precise_sleeps();
    let mut backoff = POLL_MIN;
    let mut last_notifications = Instant::now();
    let mut last_activity = Instant::now();
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.dropped.load(Ordering::SeqCst) {
            return;
        }
        let in_flight = !lock(&inner.state).inflight.is_empty();
        // While bytes are in flight and the options allow it, every turn polls the transfers
        // (which drives UCX's progress on this side) and yields the CPU instead of sleeping;
        // notifications are still polled at the busy back-off's pace.
        let spin = in_flight && inner.options.poll_in_flight;
        // While a `wait` drives its batch, this thread stays out of NIXL's agent lock (every
        // NIXL call takes it) except to look for notifications every `WAIT_DRIVES`: a small
        // write's `wait` then finishes sooner (docs/benchmarks.md, NIXL).
        if inner.drivers.load(Ordering::SeqCst) > 0 {
            if last_notifications.elapsed() >= WAIT_DRIVES {
                inner.poll_notifications();
                last_notifications = Instant::now();
            }
            inner
                .poller_sleep_us
                .store(POLL_IN_FLIGHT_MAX.as_micros() as u64, Ordering::SeqCst);
            drop(inner);
            std::thread::park_timeout(POLL_IN_FLIGHT_MAX);
            continue;
        }
        let started = Instant::now();
        let mut busy = inner.poll_transfers();
        if !spin || last_notifications.elapsed() >= POLL_BUSY_MAX {
            busy |= inner.poll_notifications();
            last_notifications = Instant::now();
        }
        busy |= started.elapsed() >= POLL_WORKED;
        busy |= inner.kicked.swap(false, Ordering::SeqCst);
        let (idle, done) = {
            let st = lock(&inner.state);
            let idle = st.inflight.is_empty() && st.zombies.is_empty();
            (idle, idle && inner.finished.load(Ordering::SeqCst))
        };
        if done {
            return;
        }
        if spin {
            drop(inner);
            std::thread::yield_now();
            continue;
        }
        if busy || !idle {
            last_activity = Instant::now();
        }
        let max = if !idle {
            POLL_IN_FLIGHT_MAX
        } else if last_activity.elapsed() < POLL_LINGER {
            POLL_BUSY_MAX
        } else {
            POLL_IDLE_MAX
        };
        backoff = if busy {
            POLL_MIN
        } else {
            (backoff * 2).min(max)
        };
        inner
            .poller_sleep_us
            .store(backoff.as_micros() as u64, Ordering::SeqCst);
        // A `post` since this turn's look at the flag, that saw the previous (shorter) sleep,
        // left only the flag (`Inner::nudge`): take another turn instead of sleeping.
        if inner.kicked.load(Ordering::SeqCst) {
            continue;
        }
        drop(inner);
        std::thread::park_timeout(backoff);
    }
}

#[async_trait::async_trait]
impl KvTransport for NixlTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        self.inner.check_open()?;
        ffi::allocate(len).map_err(|e| TransportError::Io {
            transport: NAME,
            context: format!("mapping a {len}-byte region"),
            source: e,
        })
    }

    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        let inner = &self.inner;
        inner.check_open()?;
        inner.caps.check_region(NAME, &region)?;
        if region.can_borrow() {
            return Err(TransportError::InvalidArgument {
                transport: NAME,
                message: format!(
                    "a {}-byte owned region (MemoryRegion::allocate) cannot be registered: peers' \
                     NIXL agents write registered memory behind the CPU's back, which an owned \
                     region's borrows do not allow; allocate it with the transport's allocate()",
                    region.len()
                ),
            });
        }
        if region.is_empty() {
            // NIXL refuses empty registrations; an empty region needs none.
            return Err(TransportError::InvalidArgument {
                transport: NAME,
                message: "a zero-length region cannot be registered with NIXL; allocate at least one byte".to_owned(),
            });
        }
        let seg = Segment::of(&region);
        let registration = inner.agent.register_memory(&seg, None).map_err(|e| {
            call_err(
                "registerMem",
                e,
                "UCX could not register this memory (for device memory: is the device's \
                 driver loaded and the UCX CUDA module present?)",
            )
        })?;
        let id = inner.id();
        let md = partial_metadata(inner, seg)?;
        lock(&inner.state).regions.insert(
            id,
            LocalRegion {
                region,
                _registration: registration,
            },
        );
        inner.publish(md).await;
        Ok(RegionId(id))
    }

    async fn deregister(&self, region: RegionId) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let Some(local) = lock(&inner.state).regions.remove(&region.0) else {
            return Err(unknown_region(Side::Local, region));
        };
        // Senders drop the region from their tables and acknowledge once their batches into
        // it have ended; only then is it deregistered from NIXL.
        inner.publish(None).await;
        lock(&inner.state).retire(region.0, local);
        Ok(())
    }

    fn local_descriptor(&self) -> Bytes {
        match self.inner.descriptor(self.inner.region_table()) {
            Ok(d) => Bytes::from(d.encode()),
            Err(e) => {
                tracing::warn!("local_descriptor: {e}");
                Bytes::new()
            }
        }
    }

    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        let inner = &self.inner;
        inner.check_open()?;
        let d =
            Descriptor::decode(descriptor).map_err(|message| TransportError::BadDescriptor {
                transport: NAME,
                message,
            })?;
        if d.name == inner.name {
            return Err(TransportError::BadDescriptor {
                transport: NAME,
                message: "the descriptor is this transport's own".to_owned(),
            });
        }
        let loaded = lock(&inner.state).loaded.contains(&d.name);
        if !loaded {
            let name = inner.agent.load_remote_md(&d.metadata).map_err(|e| {
                TransportError::BadDescriptor {
                    transport: NAME,
                    message: format!("NIXL refused the peer's metadata (loadRemoteMD: {e:?})"),
                }
            })?;
            if name != d.name {
                let _ = inner.agent.invalidate_remote_md(&name);
                return Err(TransportError::BadDescriptor {
                    transport: NAME,
                    message: format!(
                        "the metadata is agent {name:?}'s but the descriptor names {:?}",
                        d.name
                    ),
                });
            }
            lock(&inner.state).loaded.insert(d.name.clone());
        }
        let me = inner.descriptor(inner.region_table())?.encode();
        let ok = inner
            .request(
                &d.name,
                |seq| Control::Hello {
                    seq,
                    descriptor: me,
                },
                inner.options.control_timeout,
            )
            .await;
        if !ok {
            return Err(TransportError::PeerLost {
                peer: PeerId(0),
                transport: NAME,
                reason: format!(
                    "agent {} did not answer the connection within {:?} (is it running, and do \
                     both hosts reach each other over the UCX lanes in UCX_TLS?)",
                    d.name, inner.options.control_timeout
                ),
            });
        }
        let id = inner.id();
        lock(&inner.state).out.insert(
            id,
            OutPeer {
                name: d.name,
                regions: d.regions.into_iter().map(|r| (r.id, r)).collect(),
                lost: None,
            },
        );
        Ok(PeerId(id))
    }

    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        let inner = &self.inner;
        let Some(p) = lock(&inner.state).out.remove(&peer.0) else {
            return Err(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            });
        };
        let _ = inner.send(&p.name, &Control::Bye);
        inner.batches.fail_where(
            |q| q == peer,
            |_, peer| TransportError::PeerLost {
                peer,
                transport: NAME,
                reason: "disconnected".to_owned(),
            },
        );
        Ok(())
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        let inner = &self.inner;
        inner.check_open()?;
        if batch.direction == Direction::Read {
            return Err(TransportError::Unsupported {
                transport: NAME,
                operation: "read batches",
                remedy: "post writes from the side that holds the data",
            });
        }
        // Strided ops go as NIXL stride descriptors where the runtime takes them; otherwise
        // (and for batches of contiguous ops) one descriptor per row.
        if inner.options.stride_descriptors && batch.ops.iter().any(|op| !op.is_contiguous()) {
            if let Some(id) = post_strided(inner, peer, &batch)? {
                return Ok(id);
            }
        }
        post_rows(inner, peer, batch).await
    }

    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        self.inner.batches.state(batch, Instant::now())
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        let inner = &self.inner;
        // A small write is mostly done a few microseconds after its post, once UCX's progress
        // ran: for up to `WAIT_DRIVES` the waiting task drives it itself, yielding to the
        // runtime between polls, instead of sleeping until the polling thread's next turn
        // wakes it (two thread wake-ups, tens of microseconds each on an idle virtual
        // machine). Then it sleeps on the batch table.
        let until = Instant::now() + WAIT_DRIVES;
        // Counted while it drives (also if this future is dropped half-way).
        let driving = Driving::new(inner);
        loop {
            if let Poll::Ready(r) = inner.batches.collect(batch, Instant::now()) {
                return r;
            }
            if Instant::now() >= until {
                drop(driving);
                // The polling thread takes over (`post` may not have woken it).
                inner.kick();
                return inner.batches.wait(batch, sleep_until).await;
            }
            inner.try_poll_transfers();
            tokio::task::yield_now().await;
        }
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        // A posted NIXL write cannot be recalled: cancel waits until NIXL reports how it ended
        // (or its deadline fences it), and reports that.
        let state = self.inner.batches.cancel(batch, Instant::now())?;
        if state != BatchState::Pending {
            return Ok(state);
        }
        self.inner.batches.settle(batch, sleep_until).await
    }

    async fn recv_notification(&self) -> Result<Notification> {
        self.inner.check_open()?;
        let mut rx = self.inner.notify_rx.lock().await;
        rx.recv()
            .await
            .ok_or(TransportError::Closed { transport: NAME })
    }

    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        let inner = &self.inner;
        inner.check_open()?;
        let name = {
            let st = lock(&inner.state);
            let p = st.usable(peer)?;
            p.name.clone()
        };
        if inner
            .request(&name, |seq| Control::Probe { seq }, timeout)
            .await
        {
            Ok(())
        } else {
            Err(TransportError::PeerLost {
                peer,
                transport: NAME,
                reason: format!("no answer to a probe within {timeout:?}"),
            })
        }
    }

    async fn shutdown(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        // Senders forget every region (and fence their batches into them) before the regions
        // are deregistered; then every peer hears that this agent is gone.
        let (regions, staging) = {
            let mut st = lock(&inner.state);
            st.staging_closed = true;
            (
                std::mem::take(&mut st.regions),
                std::mem::take(&mut st.staging),
            )
        };
        // Idle staging regions: no request reads them.
        drop(staging);
        inner.publish(None).await;
        {
            let mut st = lock(&inner.state);
            for (id, local) in regions {
                st.retire(id, local);
            }
        }
        let names: Vec<String> = {
            let st = lock(&inner.state);
            // Peers already gone are not told (NIXL could only fail to reach them).
            st.out
                .values()
                .filter(|p| p.lost.is_none())
                .map(|p| p.name.clone())
                .chain(
                    st.inbound
                        .iter()
                        .filter(|(_, p)| !p.silent)
                        .map(|(n, _)| n.clone()),
                )
                .collect::<HashSet<_>>()
                .into_iter()
                .collect()
        };
        for name in names {
            let _ = inner.send(&name, &Control::Bye);
        }
        inner.batches.fail_where(
            |_| true,
            |_, peer| TransportError::PeerLost {
                peer,
                transport: NAME,
                reason: "the transport was shut down".to_owned(),
            },
        );
        lock(&inner.notify_tx).take();
        inner.finished.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// A new batch in the table, committing from the start: once its notification or request is
/// handed to NIXL, only NIXL says how it ended. A peer's `Bye` or loss (`fail_where`) arriving
/// between the hand-over and the outcome `post` records must not fail a batch whose bytes and
/// notification were delivered (a peer that obeys a command and shuts down at once made
/// `transfer` of that command fail). The fence cuts the peer off if NIXL still has the batch
/// at its deadline.
fn insert_committed(
    inner: &Arc<Inner>,
    peer: PeerId,
    timeout: Duration,
    now: Instant,
) -> Result<BatchId> {
    let weak = Arc::downgrade(inner);
    let fenced = Arc::new(std::sync::OnceLock::new());
    let fence = {
        let fenced = Arc::clone(&fenced);
        Fence::new(move || {
            if let (Some(inner), Some(&id)) = (weak.upgrade(), fenced.get()) {
                lock(&inner.state).fenced.push(id);
            }
        })
    };
    let (id, _) = inner.batches.insert_committed(peer, timeout, now, fence)?;
    let _ = fenced.set(id);
    Ok(id)
}

/// A request made and the batch's bookkeeping, ready to be handed to NIXL.
struct Prepared {
    req: XferRequest,
    local_regions: Vec<u64>,
    remote_regions: Vec<u64>,
    staging: Option<Staging>,
    dlists: Vec<Dlist>,
    bytes: usize,
}

/// Posts `batch` with one NIXL descriptor per row (strided ops expanded), small rows packed on
/// the peer gathered into a staging region first.
async fn post_rows(inner: &Arc<Inner>, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
    let batch = batch.expand_rows(NAME, inner.caps.max_ops_per_batch)?;
    // Bounds before bytes: every descriptor checked before anything is posted.
    let (name, local, remote) = descriptors(inner, peer, &batch)?;
    let now = Instant::now();
    let id = insert_committed(inner, peer, batch.timeout, now)?;
    if local.is_empty() {
        // Nothing to move: the notification alone, then done.
        if let Some(payload) = &batch.notification {
            if let Err(e) = inner.send(&name, &Control::User(payload.to_vec())) {
                inner.batches.forget(id);
                return Err(e);
            }
        }
        inner.batches.finish(id, Outcome::Done, now);
        return Ok(id);
    }
    let local_regions = region_ids(local.iter().map(|l| l.3));
    let (local, remote, staging) = match gather(inner, local, remote).await {
        Ok(g) => g,
        Err(e) => {
            inner.batches.forget(id);
            return Err(e);
        }
    };
    let bytes: usize = local.iter().map(|l| l.1).sum();
    // Like a driving `wait`, a small batch's request is made and posted with the polling
    // thread out of NIXL's agent lock (every NIXL call takes it).
    let driving = (bytes < POST_ASIDE_BYTES).then(|| Driving::new(inner));
    let started = Instant::now();
    let req = match make_request(inner, &name, &local, &remote, batch.notification.as_deref()) {
        Ok(req) => req,
        Err(e) => {
            inner.batches.forget(id);
            return Err(e);
        }
    };
    stats::time(&stats::MAKE_NS, started);
    stats::ROW_BATCHES.fetch_add(1, Ordering::Relaxed);
    stats::ROW_DESCRIPTORS.fetch_add(local.len() as u64, Ordering::Relaxed);
    let prepared = Prepared {
        req,
        local_regions,
        remote_regions: region_ids(remote.iter().map(|r| r.3)),
        staging,
        dlists: Vec::new(),
        bytes,
    };
    submit(inner, id, peer, prepared, driving)
}

/// Hands a prepared batch `id` to NIXL: into `inflight` first (a deregistration on either side
/// then waits for it), the regions checked again under the same lock, then posted, from a
/// blocking thread when it is large.
fn submit(
    inner: &Arc<Inner>,
    id: BatchId,
    peer: PeerId,
    p: Prepared,
    driving: Option<Driving<'_>>,
) -> Result<BatchId> {
    let req = Arc::new(p.req);
    {
        // The regions are checked again under the lock for a deregistration that finished
        // since the descriptors were looked up.
        let mut st = lock(&inner.state);
        if let Err(e) = st.still_usable(peer, &p.local_regions, &p.remote_regions) {
            st.recycle(p.staging);
            drop(st);
            inner.batches.forget(id);
            return Err(e);
        }
        st.inflight.insert(
            id,
            Inflight {
                req: Arc::clone(&req),
                posted: false,
                peer,
                local_regions: p.local_regions,
                remote_regions: p.remote_regions,
                staging: p.staging,
                dlists: p.dlists,
            },
        );
    }
    // UCX's cma lane copies a write's bytes inside `postXferReq`. A large batch is posted
    // from a blocking thread, so `post` returns while UCX copies and the caller's next
    // batch is gathered meanwhile (docs/benchmarks.md).
    if p.bytes >= POST_ASIDE_BYTES {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let inner = Arc::clone(inner);
            rt.spawn_blocking(move || {
                if let Err((e, reason)) = inner.post_now(id, &req) {
                    inner.batches.finish(id, Outcome::Failed(e), Instant::now());
                    inner.peer_lost(peer, reason);
                }
            });
            return Ok(id);
        }
    }
    let posted = inner.post_now(id, &req);
    drop(driving);
    if let Err((e, reason)) = posted {
        inner.batches.forget(id);
        inner.peer_lost(peer, reason);
        return Err(e);
    }
    Ok(id)
}

/// A strided batch in NIXL's stride terms: one run per run of rows on each side (runs that
/// continue each other merged), every op checked against both sides' regions.
struct StridePlan {
    name: String,
    local: Vec<Run>,
    remote: Vec<Run>,
    /// Host (`false`) or device memory, per side.
    local_device: bool,
    remote_device: bool,
    blocks: u64,
    bytes: u64,
    local_regions: Vec<u64>,
    remote_regions: Vec<u64>,
    /// An op's rows are small host rows packed on the peer: the per-row path gathers them
    /// into one descriptor per run, which moves them faster than stride runs do (one UCX
    /// operation per block either way in NIXL 1.5; docs/benchmarks.md, NIXL).
    gathers: bool,
}

/// Appends `run` of region `region` to `runs`, merged into the last one when it continues it
/// in the same region.
fn push_run(runs: &mut Vec<Run>, last_region: &mut Option<u64>, run: Run, region: u64) {
    if *last_region == Some(region) {
        if let Some(last) = runs.last_mut() {
            if last.extend(&run) {
                return;
            }
        }
    }
    *last_region = Some(region);
    runs.push(run);
}

/// The stride runs of a write batch to `peer`, with the same checks as the per-row path:
/// rows that overlap on the destination, rows outside either side's region, too many rows,
/// host and device memory mixed on one side.
fn stride_plan(inner: &Inner, peer: PeerId, batch: &TransferBatch) -> Result<StridePlan> {
    batch.check_destination_rows(NAME)?;
    check_row_limit(inner, batch)?;
    let st = lock(&inner.state);
    let p = st.usable(peer)?;
    let mut plan = StridePlan {
        name: p.name.clone(),
        local: Vec::new(),
        remote: Vec::new(),
        local_device: false,
        remote_device: false,
        blocks: 0,
        bytes: 0,
        local_regions: Vec::new(),
        remote_regions: Vec::new(),
        gathers: false,
    };
    let mut last = (None, None);
    let mut kinds: (Option<bool>, Option<bool>) = (None, None);
    for op in &batch.ops {
        let l = st
            .regions
            .get(&op.local_region.0)
            .ok_or(unknown_region(Side::Local, op.local_region))?;
        let r = p
            .regions
            .get(&op.remote_region.0)
            .ok_or(unknown_region(Side::Remote, op.remote_region))?;
        let lseg = Segment::of(&l.region);
        op.local_rows_in(lseg.len)?;
        op.remote_rows_in(usize::try_from(r.len).unwrap_or(usize::MAX))?;
        if op.len == 0 || op.count == 0 {
            continue;
        }
        let (ldev, rdev) = (lseg.device.is_some(), r.device.is_some());
        if *kinds.0.get_or_insert(ldev) != ldev || *kinds.1.get_or_insert(rdev) != rdev {
            return Err(TransportError::InvalidArgument {
                transport: NAME,
                message: "a batch mixes host and device memory on one side; NIXL moves one \
                          memory type per side in a transfer: post them as separate batches"
                    .to_owned(),
            });
        }
        add_op(&mut plan, &mut last, op, lseg, r);
    }
    plan.local_device = kinds.0.unwrap_or(false);
    plan.remote_device = kinds.1.unwrap_or(false);
    plan.local_regions = region_ids(plan.local_regions.into_iter());
    plan.remote_regions = region_ids(plan.remote_regions.into_iter());
    Ok(plan)
}

/// Refuses a batch of more rows than the per-row path would take (the same limit, so the two
/// forms accept the same batches; NIXL's indices are `i32`).
fn check_row_limit(inner: &Inner, batch: &TransferBatch) -> Result<()> {
    let limit = inner
        .caps
        .max_ops_per_batch
        .unwrap_or(kvbridge_transport::MAX_EXPANDED_ROWS)
        .min(kvbridge_transport::MAX_EXPANDED_ROWS)
        .min(i32::MAX as usize) as u64;
    if batch.row_count() > limit {
        // The per-row path words the refusal.
        return Err(batch
            .clone()
            .expand_rows(NAME, Some(limit as usize))
            .err()
            .unwrap_or(TransportError::InvalidArgument {
                transport: NAME,
                message: format!("a batch of more than {limit} rows; post fewer rows per batch"),
            }));
    }
    Ok(())
}

/// Adds `op`'s rows to `plan` as runs (merged into the last run of each side where they
/// continue it), a source with overlapping rows as one run per row.
fn add_op(
    plan: &mut StridePlan,
    last: &mut (Option<u64>, Option<u64>),
    op: &kvbridge_transport::TransferOp,
    lseg: Segment,
    r: &RemoteRegion,
) {
    let (ldev, rdev) = (lseg.device.is_some(), r.device.is_some());
    plan.gathers |= !ldev
        && !rdev
        && op.count > 1
        && op.len as usize <= GATHER_MAX_ROW
        && op.remote_stride == op.len
        && op.local_stride != op.len;
    let stride = |s: u64| if op.count == 1 { op.len } else { s };
    let local = Run {
        addr: lseg.addr as u64 + op.local_offset,
        len: op.len,
        device: u64::from(lseg.device.unwrap_or(0)),
        stride: stride(op.local_stride),
        count: op.count,
    };
    if local.stride < local.len {
        // Source rows that overlap (a stride below the row, zero included): NIXL refuses
        // such a run, so each row is a run of its own.
        for row in 0..op.count {
            let one = Run {
                addr: local.addr + row * op.local_stride,
                stride: op.len,
                count: 1,
                ..local
            };
            push_run(&mut plan.local, &mut last.0, one, op.local_region.0);
        }
    } else {
        push_run(&mut plan.local, &mut last.0, local, op.local_region.0);
    }
    let remote = Run {
        addr: r.addr + op.remote_offset,
        len: op.len,
        device: u64::from(r.device.unwrap_or(0)),
        stride: stride(op.remote_stride),
        count: op.count,
    };
    push_run(&mut plan.remote, &mut last.1, remote, op.remote_region.0);
    plan.local_regions.push(op.local_region.0);
    plan.remote_regions.push(op.remote_region.0);
    plan.blocks += op.count;
    plan.bytes += op.total_bytes();
}

/// Posts a strided batch as NIXL stride descriptors. `Ok(None)` when it should go the per-row
/// path instead: nothing to move, rows that path gathers ([`StridePlan::gathers`]), or the
/// stride form is unavailable or refused (then counted, and said once).
fn post_strided(
    inner: &Arc<Inner>,
    peer: PeerId,
    batch: &TransferBatch,
) -> Result<Option<BatchId>> {
    let plan = stride_plan(inner, peer, batch)?;
    if plan.blocks == 0 || plan.gathers {
        return Ok(None);
    }
    let stride = match &inner.stride {
        Ok(s) => s,
        Err(why) => {
            stride_fallback(why);
            return Ok(None);
        }
    };
    let mem = |device: bool| Segment::mem_type(device.then_some(0));
    let bytes = usize::try_from(plan.bytes).unwrap_or(usize::MAX);
    let driving = (bytes < POST_ASIDE_BYTES).then(|| Driving::new(inner));
    let started = Instant::now();
    let prepared = stride
        .prep(&inner.agent, None, mem(plan.local_device), &plan.local)
        .map_err(|e| format!("local list: {e}"))
        .and_then(|l| {
            let r = stride
                .prep(
                    &inner.agent,
                    Some(&plan.name),
                    mem(plan.remote_device),
                    &plan.remote,
                )
                .map_err(|e| format!("remote list (agent {}): {e}", plan.name))?;
            Ok((l, r))
        });
    let (local, remote) = match prepared {
        Ok(lists) => lists,
        Err(why) => {
            stride_fallback(&format!(
                "NIXL refused a stride list at prepXferDlist, {why}"
            ));
            return Ok(None);
        }
    };
    let id = insert_committed(inner, peer, batch.timeout, Instant::now())?;
    let blocks = plan.blocks as usize;
    let req = match make_stride_request(
        inner,
        &local,
        &remote,
        blocks,
        batch.notification.as_deref(),
    ) {
        Ok(req) => req,
        Err(why) => {
            inner.batches.forget(id);
            stride_fallback(&why);
            return Ok(None);
        }
    };
    stats::time(&stats::MAKE_NS, started);
    stats::STRIDE_BATCHES.fetch_add(1, Ordering::Relaxed);
    stats::STRIDE_LOCAL.fetch_add(plan.local.len() as u64, Ordering::Relaxed);
    stats::STRIDE_REMOTE.fetch_add(plan.remote.len() as u64, Ordering::Relaxed);
    stats::STRIDE_BLOCKS.fetch_add(plan.blocks, Ordering::Relaxed);
    let prepared = Prepared {
        req,
        local_regions: plan.local_regions,
        remote_regions: plan.remote_regions,
        staging: None,
        dlists: vec![local, remote],
        bytes,
    };
    submit(inner, id, peer, prepared, driving).map(Some)
}

/// Counts a strided batch that goes as per-row descriptors, and says why the first time.
fn stride_fallback(why: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    stats::STRIDE_FALLBACKS.fetch_add(1, Ordering::Relaxed);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            reason = %why,
            "NIXL stride descriptors are not used: strided ops go to NIXL as one descriptor per \
             row (slower for many small rows); counted in kvbridge_nixl::stats().stride_fallbacks"
        );
    }
}

/// The options every request carries: the UCX backend, and the batch's notification.
fn request_args(
    inner: &Inner,
    notification: Option<&[u8]>,
) -> std::result::Result<OptArgs, nixl_sys::NixlError> {
    let mut args = OptArgs::new()?;
    args.add_backend(&inner.backend)?;
    if let Some(payload) = notification {
        let msg = Control::User(payload.to_vec()).encode();
        args.set_has_notification(true)?;
        args.set_notification_message(&msg)?;
    }
    Ok(args)
}

/// A WRITE request over every block of two prepared stride lists (the indices count blocks,
/// not runs); the error is why NIXL refused it, for the fallback's warning.
fn make_stride_request(
    inner: &Inner,
    local: &Dlist,
    remote: &Dlist,
    blocks: usize,
    notification: Option<&[u8]>,
) -> std::result::Result<XferRequest, String> {
    let args =
        request_args(inner, notification).map_err(|e| format!("optional arguments: {e:?}"))?;
    let indices: Vec<i32> = (0..blocks as i32).collect();
    inner
        .agent
        .make_xfer_req(
            XferOp::Write,
            local.handle(),
            &indices,
            remote.handle(),
            &indices,
            Some(&args),
        )
        .map_err(|e| format!("NIXL refused the stride request at makeXferReq ({e:?})"))
}

/// NIXL's metadata of one newly registered region, for the peers that already loaded the rest.
fn partial_metadata(inner: &Inner, seg: Segment) -> Result<Option<Vec<u8>>> {
    let mut descs = RegDescList::new(Segment::mem_type(seg.device)).map_err(|e| {
        call_err(
            "createRegDlist",
            e,
            "the agent is unusable; create a new transport",
        )
    })?;
    descs.add_desc(seg.addr, seg.len, u64::from(seg.device.unwrap_or(0)));
    Ok(inner.agent.get_local_partial_md(&descs, None).ok())
}

type LocalDesc = (usize, usize, Option<u32>, u64);
type RemoteDesc = (usize, usize, Option<u32>, u64);

/// The NIXL descriptors of a write batch to `peer` (one per row), every one checked against
/// both sides' regions: the peer's agent name, the local and the remote descriptors.
fn descriptors(
    inner: &Inner,
    peer: PeerId,
    batch: &TransferBatch,
) -> Result<(String, Vec<LocalDesc>, Vec<RemoteDesc>)> {
    let st = lock(&inner.state);
    let p = st.usable(peer)?;
    let mut local = Vec::with_capacity(batch.ops.len());
    let mut remote = Vec::with_capacity(batch.ops.len());
    // The last regions looked up: consecutive ops (the rows of one strided op) share them.
    let mut last: Option<(RegionId, Segment, RegionId, &RemoteRegion)> = None;
    for op in &batch.ops {
        let (lseg, r) = match last {
            Some((l, lseg, r, rr)) if l == op.local_region && r == op.remote_region => (lseg, rr),
            _ => {
                let l = st
                    .regions
                    .get(&op.local_region.0)
                    .ok_or(unknown_region(Side::Local, op.local_region))?;
                let r = p
                    .regions
                    .get(&op.remote_region.0)
                    .ok_or(unknown_region(Side::Remote, op.remote_region))?;
                let lseg = Segment::of(&l.region);
                last = Some((op.local_region, lseg, op.remote_region, r));
                (lseg, r)
            }
        };
        // One row each: `post` expanded strided ops first.
        op.local_rows_in(lseg.len)?;
        op.remote_rows_in(usize::try_from(r.len).unwrap_or(usize::MAX))?;
        if op.len == 0 {
            continue;
        }
        local.push((
            lseg.addr + op.local_offset as usize,
            op.len as usize,
            lseg.device,
            op.local_region.0,
        ));
        remote.push((
            (r.addr + op.remote_offset) as usize,
            op.len as usize,
            r.device,
            op.remote_region.0,
        ));
    }
    // One NIXL descriptor list holds one memory type per side.
    let mixed = |d: &[(usize, usize, Option<u32>, u64)]| {
        d.windows(2).any(|w| w[0].2.is_some() != w[1].2.is_some())
    };
    if mixed(&local) || mixed(&remote) {
        return Err(TransportError::InvalidArgument {
            transport: NAME,
            message: "a batch mixes host and device memory on one side; NIXL moves one \
                          memory type per side in a transfer: post them as separate batches"
                .to_owned(),
        });
    }
    Ok((p.name.clone(), local, remote))
}

/// Region ids, once each, sorted: consecutive descriptors mostly share theirs, so runs are
/// collapsed before sorting (a strided batch has one descriptor per row).
fn region_ids(ids: impl Iterator<Item = u64>) -> Vec<u64> {
    let mut v: Vec<u64> = Vec::new();
    for id in ids {
        if v.last() != Some(&id) {
            v.push(id);
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// Gathers runs of small host-memory rows whose destinations are back to back (the rows of a
/// strided op packed on the peer) into one registered staging region, one descriptor pair
/// per run; other descriptors stay as they are. The copy happens here, at `post`, so the
/// source rows are read before `post` returns. `post` runs on the caller's async runtime, so a
/// source another access holds is waited for on the runtime's timer, never on its worker.
async fn gather(
    inner: &Inner,
    local: Vec<LocalDesc>,
    remote: Vec<RemoteDesc>,
) -> Result<(Vec<LocalDesc>, Vec<RemoteDesc>, Option<Staging>)> {
    // A run: descriptors i..j, each a small host row of one local region, the remote ones back
    // to back in one region.
    let small =
        |i: usize| local[i].2.is_none() && remote[i].2.is_none() && local[i].1 <= GATHER_MAX_ROW;
    let mut runs = Vec::new();
    let mut i = 0;
    while i < local.len() {
        let mut j = i + 1;
        if small(i) {
            while j < local.len()
                && small(j)
                && remote[j].3 == remote[i].3
                && local[j].3 == local[i].3
                && remote[j - 1].0 + remote[j - 1].1 == remote[j].0
                && local[j - 1].0 + local[j - 1].1 != local[j].0
            {
                j += 1;
            }
        }
        runs.push(i..j);
        i = j;
    }
    let staged: usize = runs
        .iter()
        .filter(|r| r.len() > 1)
        .map(|r| local[r.clone()].iter().map(|l| l.1).sum::<usize>())
        .sum();
    if staged == 0 {
        return Ok((local, remote, None));
    }
    let (pooled, sources) = {
        let mut st = lock(&inner.state);
        let mut m: HashMap<u64, (usize, MemoryRegion)> = HashMap::new();
        for r in runs.iter().filter(|r| r.len() > 1) {
            let id = local[r.start].3;
            if let Some(l) = st.regions.get(&id) {
                m.entry(id)
                    .or_insert_with(|| (Segment::of(&l.region).addr, l.region.clone()));
            }
        }
        (st.take_staging(staged), m)
    };
    let staging = match pooled {
        Some(s) => s,
        None => new_staging(inner, staged)?,
    };
    let region = &staging.region;
    let seg = Segment::of(region);
    let mut out_local = Vec::with_capacity(runs.len());
    let mut out_remote = Vec::with_capacity(runs.len());
    let mut at = 0;
    for r in runs {
        if r.len() == 1 {
            out_local.push(local[r.start]);
            out_remote.push(remote[r.start]);
            continue;
        }
        let start = at;
        let rows = &local[r.clone()];
        let id = rows[0].3;
        let (base, src) = sources
            .get(&id)
            .ok_or(unknown_region(Side::Local, RegionId(id)))?;
        // One claim of the run's source span and one of its staging range, not one per row
        // (docs/benchmarks.md, NIXL).
        let rows: Vec<(u64, u64)> = rows
            .iter()
            .map(|l| ((l.0 - base) as u64, l.1 as u64))
            .collect();
        at += gather_run(src, &rows, region, at as u64).await? as usize;
        out_local.push((seg.addr + start, at - start, None, id));
        let first = remote[r.start];
        out_remote.push((first.0, at - start, None, first.3));
    }
    Ok((out_local, out_remote, Some(staging)))
}

/// `src.gather_to` without a blocking wait: a conflicting access is tried again on the
/// runtime's timer, for as long as a blocking claim would have waited.
async fn gather_run(
    src: &MemoryRegion,
    rows: &[(u64, u64)],
    staging: &MemoryRegion,
    at: u64,
) -> Result<u64> {
    let since = Instant::now();
    loop {
        match src.try_gather_to(rows, staging, at) {
            Err(MemoryError::AccessConflict { .. }) if since.elapsed() < CLAIM_WAIT => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            done => return Ok(done?),
        }
    }
}

/// A new registered staging region for at least `staged` bytes, rounded up so later batches
/// of similar shape reuse it.
fn new_staging(inner: &Inner, staged: usize) -> Result<Staging> {
    let len = if staged <= STAGING_ROUND {
        staged.max(STAGING_MIN).next_power_of_two()
    } else {
        staged.div_ceil(STAGING_ROUND).saturating_mul(STAGING_ROUND)
    };
    let region = ffi::allocate(len).map_err(|e| TransportError::Io {
        transport: NAME,
        context: format!("mapping a {len}-byte staging region for gathered rows"),
        source: e,
    })?;
    let registration = inner
        .agent
        .register_memory(&Segment::of(&region), None)
        .map_err(|e| {
            call_err(
                "registerMem",
                e,
                "UCX could not register a staging region; post fewer rows per batch",
            )
        })?;
    Ok(Staging {
        _registration: registration,
        region,
    })
}

fn make_request(
    inner: &Inner,
    to: &str,
    local: &[LocalDesc],
    remote: &[RemoteDesc],
    notification: Option<&[u8]>,
) -> Result<XferRequest> {
    let unusable = |e| {
        call_err(
            "createXferDlist",
            e,
            "the agent is unusable; create a new transport",
        )
    };
    let mem = |d: Option<u32>| Segment::mem_type(d);
    let mut l = XferDescList::new(mem(local[0].2)).map_err(unusable)?;
    for &(addr, len, dev, _) in local {
        l.add_desc(addr, len, u64::from(dev.unwrap_or(0)));
    }
    let mut r = XferDescList::new(mem(remote[0].2)).map_err(unusable)?;
    for &(addr, len, dev, _) in remote {
        r.add_desc(addr, len, u64::from(dev.unwrap_or(0)));
    }
    let args = request_args(inner, notification).map_err(unusable)?;
    inner
        .agent
        .create_xfer_req(XferOp::Write, &l, &r, to, Some(&args))
        .map_err(|e| {
            call_err(
                "createXferReq",
                e,
                "NIXL does not know these regions of the peer (mixed host and device memory in \
                 one batch, or metadata out of date): reconnect with the peer's current descriptor",
            )
        })
}
