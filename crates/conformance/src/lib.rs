//! The conformance suite every [`KvTransport`] runs against itself: the suite, the
//! child-process harness ([`child`]) and the seeded generator ([`SplitMix64`]) of kvbridge's
//! tests. A dev-dependency: nothing a deployment runs links it.
//!
//! **Not API-stable**: cases are added as the contract is sharpened; a transport that honours the
//! contract (`kvbridge_transport`'s crate docs, "The contract") keeps passing.
//!
//! # Use
//!
//! Add the crate to your dev-dependencies, and a factory that returns two fresh, unconnected
//! instances of your transport:
//!
//! ```toml
//! [dev-dependencies]
//! kvbridge-conformance = "0.1"
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! ```
//!
//! ```ignore
//! use kvbridge_conformance::TransportPair;
//!
//! async fn make_pair() -> TransportPair {
//!     TransportPair::new(Arc::new(MyTransport::new()), Arc::new(MyTransport::new()))
//! }
//!
//! mod conformance {
//!     kvbridge_conformance::conformance_tests!(super::make_pair);
//! }
//! ```
//!
//! [`conformance_tests!`](crate::conformance_tests) expands to one
//! `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]` per case, named after the case,
//! plus the same tests in a `dyn_transport` sub-module that run every case through
//! `Arc<dyn KvTransport>` wrappers ([`TransportPair::boxed`]). Each case is also a public
//! `async fn` taking a [`TransportPair`], for callers that want to drive it themselves.
//!
//! # What a case does
//!
//! The suite allocates regions with [`KvTransport::allocate`] on each side, registers them,
//! connects the sender to the receiver with the receiver's
//! [`local_descriptor`](KvTransport::local_descriptor), posts batches from the sender and checks
//! the receiver's memory byte for byte through its own [`MemoryRegion`] handles. Capabilities
//! come from `sender.capabilities()`; a case a transport cannot do is checked to be refused with
//! [`TransportError::Unsupported`], never skipped. Every await is bounded by the pair's
//! [`Limits`] (a slower transport raises them with [`TransportPair::with_limits`]), so a broken
//! transport fails with a message naming the transport and the contract point instead of
//! hanging. A fenced batch's destination is watched until the batch's deadline plus
//! [`Limits::fence_grace`], so a write that lands well after `cancel` returned fails the case.
//!
//! The suite needs no particular executor: its timers run on one `std` thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use kvbridge_memory::placeholder_device_region;
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, Direction, KvTransport, MemoryRegion, Notification, PeerId,
    RegionId, Side, TransferBatch, TransferOp, TransportError,
};

pub mod child;
mod rt;
mod seeded;

use rt::{join_all, sleep, timeout};
pub use seeded::{SplitMix64, mix64};

/// Makes a device-memory region of the given length, for transports that accept device memory.
pub type DeviceRegions = Arc<dyn Fn(usize) -> MemoryRegion + Send + Sync>;

/// Two fresh, unconnected instances of the transport under test.
#[derive(Clone)]
pub struct TransportPair {
    /// Posts the batches.
    pub sender: Arc<dyn KvTransport>,
    /// Receives them; its memory is checked.
    pub receiver: Arc<dyn KvTransport>,
    device_regions: Option<DeviceRegions>,
    limits: Limits,
}

/// The suite's wall-clock limits: how long it waits for a transport before failing it, and how
/// long it watches memory for bytes that must not land. The defaults suit the transports of
/// this workspace on a loaded machine; a transport whose calls are slower (an RDMA connection
/// setup, a remote device) raises them with [`TransportPair::with_limits`]. Every case takes
/// its limits from here.
///
/// ```
/// use std::time::Duration;
/// use kvbridge_conformance::Limits;
///
/// let slow = Limits::default()
///     .with_call(Duration::from_secs(30))
///     .with_deadline_grace(Duration::from_secs(5));
/// assert_eq!(slow.batch_timeout, Limits::default().batch_timeout);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Upper bound for one call that should return promptly: `connect`, `register`, `post`,
    /// `cancel`, `probe`, `shutdown`, an expected `recv_notification` (default 5 s).
    pub call: Duration,
    /// How long after a batch's deadline `wait` may take to return (default 2 s).
    pub deadline_grace: Duration,
    /// Deadline of ordinary batches, which should finish far sooner (default 10 s).
    pub batch_timeout: Duration,
    /// Deadline of the batches the suite interrupts (cancel, shutdown, peer loss): long
    /// enough that they are usually still in flight when interrupted (default 2 s).
    pub interrupted_batch_timeout: Duration,
    /// How long past a fenced batch's deadline the suite keeps watching its destination
    /// (default 500 ms). A cancelled, failed or timed-out batch is watched until its deadline
    /// plus this grace, counted from `post`, so a transport that lets a write land after the
    /// fence is caught unless the write comes later than the transport's own deadline would
    /// allow.
    pub fence_grace: Duration,
    /// How long the suite watches for something that must not happen at all: bytes of a
    /// refused batch, an extra notification; also the least time a fenced batch's destination
    /// is watched after the fence (default 50 ms).
    pub quiet: Duration,
    /// The timeout the suite passes to `probe` (default 1 s).
    pub probe: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            call: Duration::from_secs(5),
            deadline_grace: Duration::from_secs(2),
            batch_timeout: Duration::from_secs(10),
            interrupted_batch_timeout: Duration::from_secs(2),
            fence_grace: Duration::from_millis(500),
            quiet: Duration::from_millis(50),
            probe: Duration::from_secs(1),
        }
    }
}

impl Limits {
    /// Sets [`call`](Self::call).
    pub const fn with_call(mut self, limit: Duration) -> Self {
        self.call = limit;
        self
    }

    /// Sets [`deadline_grace`](Self::deadline_grace).
    pub const fn with_deadline_grace(mut self, grace: Duration) -> Self {
        self.deadline_grace = grace;
        self
    }

    /// Sets [`batch_timeout`](Self::batch_timeout).
    pub const fn with_batch_timeout(mut self, timeout: Duration) -> Self {
        self.batch_timeout = timeout;
        self
    }

    /// Sets [`interrupted_batch_timeout`](Self::interrupted_batch_timeout).
    pub const fn with_interrupted_batch_timeout(mut self, timeout: Duration) -> Self {
        self.interrupted_batch_timeout = timeout;
        self
    }

    /// Sets [`fence_grace`](Self::fence_grace).
    pub const fn with_fence_grace(mut self, grace: Duration) -> Self {
        self.fence_grace = grace;
        self
    }

    /// Sets [`quiet`](Self::quiet).
    pub const fn with_quiet(mut self, window: Duration) -> Self {
        self.quiet = window;
        self
    }

    /// Sets [`probe`](Self::probe).
    pub const fn with_probe(mut self, timeout: Duration) -> Self {
        self.probe = timeout;
        self
    }
}

impl std::fmt::Debug for TransportPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportPair")
            .field("sender", &self.sender.name())
            .field("receiver", &self.receiver.name())
            .field("limits", &self.limits)
            .finish()
    }
}

impl TransportPair {
    /// A pair from two transports.
    pub fn new(sender: Arc<dyn KvTransport>, receiver: Arc<dyn KvTransport>) -> Self {
        Self {
            sender,
            receiver,
            device_regions: None,
            limits: Limits::default(),
        }
    }

    /// Runs the cases under other wall-clock limits than the [defaults](Limits::default), for
    /// a transport that needs longer (a real RDMA connection setup is slower).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The limits the cases run under.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Gives the suite real device memory to register, for a transport whose capabilities
    /// declare [`device_memory`](Capabilities::device_memory) (the memory-kind case fails
    /// without it rather than skip).
    pub fn with_device_regions(mut self, make: DeviceRegions) -> Self {
        self.device_regions = Some(make);
        self
    }

    /// The same pair, each side wrapped once more as `Arc<dyn KvTransport>` (through the blanket
    /// `impl KvTransport for Arc<T>`), to prove the trait object forwards every call.
    pub fn boxed(self) -> Self {
        let sender: Arc<dyn KvTransport> = Arc::new(self.sender);
        let receiver: Arc<dyn KvTransport> = Arc::new(self.receiver);
        Self {
            sender,
            receiver,
            device_regions: self.device_regions,
            limits: self.limits,
        }
    }
}

/// How often the suite polls `batch_state`, and how long it lets a batch run before one of
/// the cancels: a pace, not a limit.
const POLL: Duration = Duration::from_millis(1);
/// Deadlines of the `deadline_expiry` batches: case inputs that expire mid-batch on any
/// transport, not limits.
const EXPIRING_DEADLINES: [Duration; 2] = [Duration::from_micros(1), Duration::from_millis(2)];

const BOUNDS: &str = "contract 1 (bounds before bytes)";
const ENDS: &str = "contract 2 (every batch ends by its deadline)";
const FENCING: &str = "contract 3 (fencing)";
const NOTIFY: &str = "contract 4 (notifications follow data)";
const PEER_LOSS: &str = "contract 5 (peer loss is an error, not a hang)";
const DATA: &str = "contract 6 (a done batch moved exactly its bytes)";
const IDS: &str = "contract 7 (batch, peer and region ids)";
const CAPS: &str = "contract 8 (capabilities are declared)";
const CLOSED: &str = "contract 9 (shutdown)";

/// One side's registered region and the suite's handle to its bytes.
struct Reg {
    id: RegionId,
    mem: MemoryRegion,
}

impl Reg {
    fn snapshot(&self) -> Vec<u8> {
        self.mem
            .to_vec(0, self.mem.len() as u64)
            .expect("whole-region read")
    }

    /// The region's bytes at a moment the transport must not be writing them: a read refused
    /// because a write is in progress fails `point`.
    fn settled(&self, name: &str, point: &str, what: &str) -> Vec<u8> {
        self.mem
            .to_vec(0, self.mem.len() as u64)
            .unwrap_or_else(|e| {
                panic!(
                    "[{name}] {point}: after {what}, receiver region {} was still being written \
                     when the suite read it ({e})",
                    self.id
                )
            })
    }
}

/// A connected pair with regions on both sides.
struct Rig {
    name: &'static str,
    sender: Arc<dyn KvTransport>,
    receiver: Arc<dyn KvTransport>,
    peer: PeerId,
    caps: Capabilities,
    limits: Limits,
    local: Vec<Reg>,
    remote: Vec<Reg>,
}

/// Awaits `fut` for at most `limit`, or panics naming the transport, the contract point and
/// what was being done.
async fn bounded<F: std::future::Future>(
    name: &str,
    point: &str,
    what: &str,
    limit: Duration,
    fut: F,
) -> F::Output {
    match timeout(limit, fut).await {
        Some(v) => v,
        None => panic!("[{name}] {point}: {what} did not return within {limit:?}"),
    }
}

impl Rig {
    async fn new(pair: TransportPair, local_sizes: &[usize], remote_sizes: &[usize]) -> Self {
        let TransportPair {
            sender,
            receiver,
            limits,
            ..
        } = pair;
        let name = sender.name();
        let caps = sender.capabilities();
        let mut rng = SplitMix64::new(0x5EED_0000 ^ local_sizes.len() as u64);
        let mut local = Vec::new();
        for &len in local_sizes {
            local.push(register(name, &sender, len, &mut rng, "sender", limits.call).await);
        }
        let mut remote = Vec::new();
        for &len in remote_sizes {
            remote.push(register(name, &receiver, len, &mut rng, "receiver", limits.call).await);
        }
        let descriptor = receiver.local_descriptor();
        assert!(
            !descriptor.is_empty(),
            "[{name}] {IDS}: the receiver's local_descriptor() is empty"
        );
        let peer = bounded(
            name,
            PEER_LOSS,
            "connect",
            limits.call,
            sender.connect(&descriptor),
        )
        .await
        .unwrap_or_else(|e| {
            panic!("[{name}] connecting the sender to the receiver's descriptor failed: {e}")
        });
        Self {
            name,
            sender,
            receiver,
            peer,
            caps,
            limits,
            local,
            remote,
        }
    }

    async fn post(&self, batch: TransferBatch) -> Result<BatchId, TransportError> {
        bounded(
            self.name,
            ENDS,
            "post",
            self.limits.call,
            self.sender.post(self.peer, batch),
        )
        .await
    }

    /// Waits for a batch, panicking if `wait` outlives `timeout` plus the deadline grace.
    async fn wait(&self, id: BatchId, timeout: Duration) -> Result<(), TransportError> {
        bounded(
            self.name,
            ENDS,
            &format!("wait for batch {id} (deadline {timeout:?})"),
            timeout + self.limits.deadline_grace,
            self.sender.wait(id),
        )
        .await
    }

    /// Posts and waits, panicking on any error.
    async fn transfer_ok(&self, batch: TransferBatch, what: &str) {
        let timeout = batch.timeout;
        let id = self
            .post(batch)
            .await
            .unwrap_or_else(|e| panic!("[{}] {DATA}: posting {what} failed: {e}", self.name));
        self.wait(id, timeout)
            .await
            .unwrap_or_else(|e| panic!("[{}] {DATA}: {what} failed: {e}", self.name));
    }

    /// The receiver's next notification, panicking if it fails or does not come in time.
    async fn recv_notification_ok(&self) -> Notification {
        bounded(
            self.name,
            NOTIFY,
            "recv_notification",
            self.limits.call,
            self.receiver.recv_notification(),
        )
        .await
        .unwrap_or_else(|e| panic!("[{}] {NOTIFY}: recv_notification failed: {e}", self.name))
    }

    fn snapshot_remote(&self) -> Vec<Vec<u8>> {
        self.remote.iter().map(Reg::snapshot).collect()
    }

    fn assert_remote(&self, expected: &[Vec<u8>], point: &str, what: &str) {
        for (reg, want) in self.remote.iter().zip(expected) {
            assert_region(self.name, reg, want, point, what);
        }
    }

    /// Asserts the receiver's memory does not change over the [quiet](Limits::quiet) window.
    async fn assert_remote_quiet(&self, what: &str) {
        self.watch_remote(Instant::now() + self.limits.quiet, what)
            .await;
    }

    /// Asserts that no byte of a fenced batch lands later: the receiver's memory stays as it is
    /// now until the batch's `deadline` plus the [fence grace](Limits::fence_grace) have passed
    /// since `posted`, and for at least the [quiet](Limits::quiet) window. A transport's own
    /// deadline stops even a batch nobody cancelled, so a late write that this misses would
    /// have to outlive the transport's deadline too.
    async fn assert_fenced(&self, posted: Instant, deadline: Duration, what: &str) {
        let watch = deadline.saturating_add(self.limits.fence_grace);
        let until = posted
            .checked_add(watch)
            .unwrap_or(posted)
            .max(Instant::now() + self.limits.quiet);
        self.watch_remote(until, what).await;
    }

    /// Compares the receiver's memory with how it is now, every quiet window until `until`,
    /// so that a late write fails the case soon after it lands.
    async fn watch_remote(&self, until: Instant, what: &str) {
        let start = Instant::now();
        let before: Vec<Vec<u8>> = self
            .remote
            .iter()
            .map(|r| r.settled(self.name, FENCING, what))
            .collect();
        let step = self.limits.quiet.max(POLL);
        loop {
            let now = Instant::now();
            if now >= until {
                return;
            }
            sleep((until - now).min(step)).await;
            let later = format!("{what}, {:?} later", start.elapsed());
            self.assert_remote(&before, FENCING, &later);
        }
    }

    /// Deregisters `region` on the sender (`local`) or the receiver, within the call limit.
    async fn deregister(&self, local: bool, region: RegionId) {
        let (side, transport) = if local {
            ("sender", &self.sender)
        } else {
            ("receiver", &self.receiver)
        };
        bounded(
            self.name,
            IDS,
            "deregister",
            self.limits.call,
            transport.deregister(region),
        )
        .await
        .unwrap_or_else(|e| panic!("[{}] {IDS}: {side}.deregister failed: {e}", self.name));
    }

    fn op(&self, l: usize, lo: u64, r: usize, ro: u64, len: u64) -> TransferOp {
        TransferOp::new(self.local[l].id, lo, self.remote[r].id, ro, len)
    }
}

async fn register(
    name: &str,
    t: &Arc<dyn KvTransport>,
    len: usize,
    rng: &mut SplitMix64,
    side: &str,
    call: Duration,
) -> Reg {
    let mem = t
        .allocate(len)
        .unwrap_or_else(|e| panic!("[{name}] {side}.allocate({len}) failed: {e}"));
    assert_eq!(
        mem.len(),
        len,
        "[{name}] {side}.allocate({len}) returned a region of another length"
    );
    mem.write_at(0, &rng.bytes(len)).expect("fill new region");
    let id = bounded(name, IDS, "register", call, t.register(mem.clone()))
        .await
        .unwrap_or_else(|e| panic!("[{name}] {side}.register of a {len}-byte region failed: {e}"));
    Reg { id, mem }
}

fn assert_region(name: &str, reg: &Reg, want: &[u8], point: &str, what: &str) {
    let got = reg.settled(name, point, what);
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let differing = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!(
            "[{name}] {point}: after {what}, receiver region {} differs from the expected bytes \
             at offset {i} (got {:#04x}, expected {:#04x}; {differing} bytes differ in all)",
            reg.id, got[i], want[i]
        );
    }
}

/// Applies a write batch to a model of the remote regions.
fn apply(model: &mut [Vec<u8>], rig: &Rig, ops: &[TransferOp]) {
    for op in ops {
        let l = rig
            .local
            .iter()
            .find(|r| r.id == op.local_region)
            .expect("op names a suite region");
        let r = rig
            .remote
            .iter()
            .position(|r| r.id == op.remote_region)
            .expect("op names a suite region");
        for row in op.rows() {
            let src = l.mem.to_vec(row.local_offset, row.len).expect("in bounds");
            let start = row.remote_offset as usize;
            model[r][start..start + src.len()].copy_from_slice(&src);
        }
    }
}

/// Asserts that every byte of the remote regions is either its old or its new value (a batch
/// that ended without completing may have landed partly).
fn assert_old_or_new(rig: &Rig, old: &[Vec<u8>], new: &[Vec<u8>], point: &str, what: &str) {
    for ((reg, old), new) in rig.remote.iter().zip(old).zip(new) {
        let got = reg.settled(rig.name, point, what);
        if let Some(i) = (0..got.len()).find(|&i| got[i] != old[i] && got[i] != new[i]) {
            panic!(
                "[{}] {point}: after {what}, receiver region {} holds at offset {i} a byte \
                 ({:#04x}) that is neither the old ({:#04x}) nor the batch's ({:#04x})",
                rig.name, reg.id, got[i], old[i], new[i]
            );
        }
    }
}

fn err_kind(e: &TransportError) -> &'static str {
    match e {
        TransportError::OutOfBounds { .. } => "OutOfBounds",
        TransportError::UnknownRegion { .. } => "UnknownRegion",
        TransportError::UnknownPeer { .. } => "UnknownPeer",
        TransportError::UnknownBatch { .. } => "UnknownBatch",
        TransportError::Unsupported { .. } => "Unsupported",
        TransportError::InvalidArgument { .. } => "InvalidArgument",
        TransportError::BadDescriptor { .. } => "BadDescriptor",
        TransportError::TimedOut { .. } => "TimedOut",
        TransportError::Cancelled { .. } => "Cancelled",
        TransportError::BatchFailed { .. } => "BatchFailed",
        TransportError::PeerLost { .. } => "PeerLost",
        TransportError::Protocol { .. } => "Protocol",
        TransportError::Closed { .. } => "Closed",
        TransportError::Io { .. } => "Io",
        TransportError::Memory(_) => "Memory",
        TransportError::Custom { .. } => "Custom",
        _ => "another error",
    }
}

/// Posts a batch that must be refused because of a remote-side problem: either `post` refuses
/// it (and `at_post` accepts the error), or `wait` reports a failure. Either way the receiver's
/// memory must be unchanged, then and a little later.
async fn expect_remote_refusal(
    rig: &Rig,
    batch: TransferBatch,
    what: &str,
    at_post: impl Fn(&TransportError) -> bool,
) {
    let before = rig.snapshot_remote();
    let timeout = batch.timeout;
    match rig.post(batch).await {
        Err(e) => assert!(
            at_post(&e),
            "[{}] {BOUNDS}: {what} was refused at post with an unexpected error ({}): {e}",
            rig.name,
            err_kind(&e)
        ),
        Ok(id) => match rig.wait(id, timeout).await {
            Ok(()) => panic!(
                "[{}] {BOUNDS}: {what} was accepted and completed; it must be refused",
                rig.name
            ),
            Err(e) => assert!(
                matches!(
                    e,
                    TransportError::OutOfBounds {
                        side: Side::Remote,
                        ..
                    } | TransportError::UnknownRegion {
                        side: Side::Remote,
                        ..
                    } | TransportError::InvalidArgument { .. }
                        | TransportError::BatchFailed { .. }
                ),
                "[{}] {BOUNDS}: {what} failed at wait with an unexpected error ({}): {e}",
                rig.name,
                err_kind(&e)
            ),
        },
    }
    rig.assert_remote(&before, BOUNDS, &format!("{what} was refused"));
    rig.assert_remote_quiet(&format!("{what} was refused"))
        .await;
}

/// Asserts `post` refuses a batch with a local-side problem before any byte moves.
async fn expect_local_refusal(
    rig: &Rig,
    batch: TransferBatch,
    what: &str,
    check: impl Fn(&TransportError) -> bool,
) {
    let before = rig.snapshot_remote();
    match rig.post(batch).await {
        Ok(id) => {
            let _ = rig.wait(id, rig.limits.batch_timeout).await;
            panic!(
                "[{}] {BOUNDS}: {what} was accepted by post; it must be refused there",
                rig.name
            )
        }
        Err(e) => assert!(
            check(&e),
            "[{}] {BOUNDS}: {what} was refused with an unexpected error ({}): {e}",
            rig.name,
            err_kind(&e)
        ),
    }
    rig.assert_remote(&before, BOUNDS, &format!("{what} was refused"));
}

fn is_unknown_batch(e: &TransportError, id: BatchId) -> bool {
    matches!(e, TransportError::UnknownBatch { batch, .. } if *batch == id)
}

/// Asserts `result` is `UnknownBatch` for `id`; `what` names the call (contract point "ids").
fn assert_unknown_batch<T: std::fmt::Debug>(
    name: &str,
    result: &Result<T, TransportError>,
    id: BatchId,
    what: impl std::fmt::Display,
) {
    assert!(
        matches!(result, Err(e) if is_unknown_batch(e, id)),
        "[{name}] {IDS}: {what} must fail with UnknownBatch, got {result:?}"
    );
}

/// A large write batch from local region 0 into remote region 0: `ops` descriptors (fewer if the
/// transport declares a smaller `max_ops_per_batch`) covering `total` bytes, in scattered order.
fn scattered_ops(rig: &Rig, total: usize, ops: usize) -> Vec<TransferOp> {
    let ops = rig
        .caps
        .max_ops_per_batch
        .map_or(ops, |m| ops.min(m))
        .max(1);
    scattered_ops_exact(rig, total, ops)
}

/// Like [`scattered_ops`], with exactly `ops` descriptors.
fn scattered_ops_exact(rig: &Rig, total: usize, ops: usize) -> Vec<TransferOp> {
    let piece = (total / ops) as u64;
    let n = ops as u64;
    // i -> i * m + 13 (mod n) is a permutation when m and n are coprime.
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let m = (7919..)
        .find(|&m| gcd(m, n) == 1)
        .expect("a coprime multiplier");
    (0..n)
        .map(|i| {
            let j = (i * m + 13) % n;
            rig.op(0, i * piece, 0, j * piece, piece)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The cases.
// ---------------------------------------------------------------------------------------------

/// Random write batches (deterministic seed) across several regions of odd sizes, each verified
/// byte for byte against a model of the receiver's memory.
pub async fn random_batches(pair: TransportPair) {
    let rig = Rig::new(
        pair,
        &[64 * 1024, 4096 + 17, 1000],
        &[128 * 1024, 3000, 777],
    )
    .await;
    let mut rng = SplitMix64::new(0xC0FF_EE01);
    let mut model = rig.snapshot_remote();
    for round in 0..12 {
        // New source bytes each round, so stale data cannot pass.
        for l in &rig.local {
            l.mem.write_at(0, &rng.bytes(l.mem.len())).unwrap();
        }
        let n_ops = 1 + rng.below(150) as usize;
        let mut taken: Vec<Vec<(u64, u64)>> = vec![Vec::new(); rig.remote.len()];
        let mut ops = Vec::new();
        for _ in 0..n_ops {
            let r = rng.below(rig.remote.len() as u64) as usize;
            let l = rng.below(rig.local.len() as u64) as usize;
            let rlen = rig.remote[r].mem.len() as u64;
            let llen = rig.local[l].mem.len() as u64;
            let max = rlen
                .min(llen)
                .min(if rng.below(8) == 0 { 16 * 1024 } else { 600 });
            let len = rng.below(max + 1);
            let ro = rng.below(rlen - len + 1);
            let lo = rng.below(llen - len + 1);
            // Destinations of one batch never overlap (the trait's rule); retry elsewhere.
            if taken[r].iter().any(|&(s, e)| ro < e && s < ro + len) {
                continue;
            }
            taken[r].push((ro, ro + len));
            ops.push(rig.op(l, lo, r, ro, len));
        }
        apply(&mut model, &rig, &ops);
        let what = format!("random batch {round} ({} ops)", ops.len());
        rig.transfer_ok(
            TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
            &what,
        )
        .await;
        rig.assert_remote(&model, DATA, &what);
    }
}

/// Zero-length descriptors (including one at the very end of a region) move nothing and
/// complete; an empty batch completes and still delivers its notification.
pub async fn zero_length_and_empty_batches(pair: TransportPair) {
    let rig = Rig::new(pair, &[4096], &[4096]).await;
    let before = rig.snapshot_remote();
    rig.transfer_ok(
        TransferBatch::write(vec![]).with_timeout(rig.limits.batch_timeout),
        "an empty batch",
    )
    .await;
    rig.transfer_ok(
        TransferBatch::write(vec![
            rig.op(0, 0, 0, 0, 0),
            rig.op(0, 17, 0, 4000, 0),
            rig.op(0, 4096, 0, 4096, 0),
        ])
        .with_timeout(rig.limits.batch_timeout),
        "a batch of zero-length descriptors",
    )
    .await;
    rig.assert_remote(&before, DATA, "zero-length and empty batches");

    // A zero-length descriptor between real ones.
    let mut model = before.clone();
    let ops = vec![
        rig.op(0, 0, 0, 100, 10),
        rig.op(0, 50, 0, 0, 0),
        rig.op(0, 20, 0, 200, 30),
    ];
    apply(&mut model, &rig, &ops);
    rig.transfer_ok(
        TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
        "a mixed batch",
    )
    .await;
    rig.assert_remote(
        &model,
        DATA,
        "a batch mixing zero-length and real descriptors",
    );

    let payload = Bytes::from_static(b"empty batch notification");
    rig.transfer_ok(
        TransferBatch::write(vec![])
            .with_notification(payload.clone())
            .with_timeout(rig.limits.batch_timeout),
        "an empty batch with a notification",
    )
    .await;
    let n = bounded(
        rig.name,
        NOTIFY,
        "recv_notification after an empty batch with a notification",
        rig.limits.call,
        rig.receiver.recv_notification(),
    )
    .await
    .unwrap_or_else(|e| panic!("[{}] {NOTIFY}: recv_notification failed: {e}", rig.name));
    assert_eq!(
        n.payload, payload,
        "[{}] {NOTIFY}: wrong notification payload",
        rig.name
    );
}

/// A batch of 100,000 scattered descriptors is verified byte for byte. A transport that declares
/// `max_ops_per_batch` below that runs a batch of exactly its limit and must refuse one more.
pub async fn large_batch(pair: TransportPair) {
    const WANT: usize = 100_000;
    const PIECE: usize = 16;
    let caps = pair.sender.capabilities();
    let n = caps.max_ops_per_batch.map_or(WANT, |m| m.min(WANT));
    assert!(
        n > 0,
        "[{}] {CAPS}: max_ops_per_batch is Some(0)",
        pair.sender.name()
    );
    let size = (n + 1) * PIECE;
    let rig = Rig::new(pair, &[size], &[size]).await;
    let mut ops = scattered_ops_exact(&rig, n * PIECE, n);
    // Vary the lengths a little (never past the slot, so destinations stay disjoint).
    for (i, op) in ops.iter_mut().enumerate() {
        op.len = 1 + (i % PIECE) as u64;
    }
    let mut model = rig.snapshot_remote();
    apply(&mut model, &rig, &ops);
    let what = format!("a batch of {n} descriptors");
    rig.transfer_ok(
        TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
        &what,
    )
    .await;
    rig.assert_remote(&model, DATA, &what);

    if let Some(max) = caps.max_ops_per_batch.filter(|&m| m < WANT) {
        let ops = scattered_ops_exact(&rig, (max + 1) * PIECE, max + 1);
        expect_local_refusal(
            &rig,
            TransferBatch::write(ops),
            &format!("a batch of {} descriptors (declared limit {max})", max + 1),
            |e| {
                matches!(
                    e,
                    TransportError::InvalidArgument { .. } | TransportError::Unsupported { .. }
                )
            },
        )
        .await;
    }
}

/// A descriptor past the end of a local region is refused at `post` with
/// [`TransportError::OutOfBounds`] naming the local side and the values, and nothing moves.
pub async fn out_of_bounds_local_refused(pair: TransportPair) {
    let rig = Rig::new(pair, &[4096], &[8192]).await;
    for (offset, len) in [(4090u64, 8u64), (4096, 1), (5000, 0), (0, 4097)] {
        let ops = vec![rig.op(0, 0, 0, 0, 100), rig.op(0, offset, 0, 1000, len)];
        let region = rig.local[0].id;
        expect_local_refusal(
            &rig,
            TransferBatch::write(ops),
            &format!("a batch reading local [{offset}, {offset}+{len}) of a 4096-byte region"),
            |e| {
                matches!(e, TransportError::OutOfBounds { side: Side::Local, region: r, offset: o, len: l, region_len: 4096 }
                    if *r == region && *o == offset && *l == len)
            },
        )
        .await;
    }
    // The refusals did not break anything.
    let mut model = rig.snapshot_remote();
    let ops = vec![rig.op(0, 0, 0, 0, 4096)];
    apply(&mut model, &rig, &ops);
    rig.transfer_ok(
        TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
        "a valid batch after refusals",
    )
    .await;
    rig.assert_remote(&model, DATA, "a valid batch after refusals");
}

/// A descriptor past the end of a remote region is refused, at `post` (with
/// [`TransportError::OutOfBounds`] naming the remote side) or by a failed `wait`; either way no
/// byte of the batch — not even its valid descriptors — lands.
pub async fn out_of_bounds_remote_refused(pair: TransportPair) {
    let rig = Rig::new(pair, &[8192], &[4096]).await;
    let region = rig.remote[0].id;
    for (offset, len) in [(4090u64, 8u64), (4096, 1), (5000, 0), (0, 4097)] {
        let ops = vec![rig.op(0, 0, 0, 0, 100), rig.op(0, 1000, 0, offset, len)];
        expect_remote_refusal(
            &rig,
            TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
            &format!("a batch writing remote [{offset}, {offset}+{len}) of a 4096-byte region"),
            |e| {
                matches!(e, TransportError::OutOfBounds { side: Side::Remote, region: r, offset: o, len: l, region_len: 4096 }
                    if *r == region && *o == offset && *l == len)
            },
        )
        .await;
    }
}

/// Descriptors naming regions that were never registered are refused: local ones at `post` with
/// [`TransportError::UnknownRegion`], remote ones at `post` or by a failed `wait`; nothing moves.
pub async fn unknown_region_refused(pair: TransportPair) {
    let rig = Rig::new(pair, &[4096], &[4096]).await;
    let bogus = RegionId(u64::MAX - 7);
    let mut op = rig.op(0, 0, 0, 0, 64);
    op.local_region = bogus;
    expect_local_refusal(
        &rig,
        TransferBatch::write(vec![rig.op(0, 0, 0, 100, 10), op]),
        "a batch naming an unknown local region",
        |e| matches!(e, TransportError::UnknownRegion { side: Side::Local, region, .. } if *region == bogus),
    )
    .await;
    let mut op = rig.op(0, 0, 0, 0, 64);
    op.remote_region = bogus;
    expect_remote_refusal(
        &rig,
        TransferBatch::write(vec![rig.op(0, 0, 0, 100, 10), op]).with_timeout(rig.limits.batch_timeout),
        "a batch naming an unknown remote region",
        |e| matches!(e, TransportError::UnknownRegion { side: Side::Remote, region, .. } if *region == bogus),
    )
    .await;
}

/// `offset + len` overflowing `u64` is refused (as out of bounds or an invalid argument), on
/// either side, before any byte moves.
pub async fn offset_overflow_refused(pair: TransportPair) {
    let rig = Rig::new(pair, &[4096], &[4096]).await;
    let overflow = |e: &TransportError| {
        matches!(
            e,
            TransportError::OutOfBounds { .. } | TransportError::InvalidArgument { .. }
        )
    };
    for (offset, len) in [(u64::MAX - 2, 8u64), (1, u64::MAX), (u64::MAX, u64::MAX)] {
        let mut op = rig.op(0, 0, 0, 0, len);
        op.local_offset = offset;
        expect_local_refusal(
            &rig,
            TransferBatch::write(vec![rig.op(0, 0, 0, 100, 10), op]),
            &format!("a local descriptor with offset {offset} + len {len} overflowing u64"),
            overflow,
        )
        .await;
        let mut op = rig.op(0, 0, 0, 0, len);
        op.remote_offset = offset;
        expect_remote_refusal(
            &rig,
            TransferBatch::write(vec![rig.op(0, 0, 0, 100, 10), op])
                .with_timeout(rig.limits.batch_timeout),
            &format!("a remote descriptor with offset {offset} + len {len} overflowing u64"),
            |e| overflow(e) || matches!(e, TransportError::OutOfBounds { .. }),
        )
        .await;
    }
}

/// A deregistered region is refused like an unknown one: on the sender at `post`, on the
/// receiver at `post` or by a failed `wait`, and nothing lands in it. Deregistering twice fails.
pub async fn deregistered_region_refused(pair: TransportPair) {
    let rig = Rig::new(pair, &[4096, 4096], &[4096, 4096]).await;
    // Prove both regions work first.
    let mut model = rig.snapshot_remote();
    let ops = vec![rig.op(0, 0, 0, 0, 64), rig.op(1, 0, 1, 0, 64)];
    apply(&mut model, &rig, &ops);
    rig.transfer_ok(
        TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
        "a batch before deregistration",
    )
    .await;
    rig.assert_remote(&model, DATA, "a batch before deregistration");

    let local = rig.local[1].id;
    rig.deregister(true, local).await;
    expect_local_refusal(
        &rig,
        TransferBatch::write(vec![rig.op(1, 0, 0, 0, 64)]),
        "a batch reading a deregistered local region",
        |e| matches!(e, TransportError::UnknownRegion { side: Side::Local, region, .. } if *region == local),
    )
    .await;
    let again = bounded(
        rig.name,
        IDS,
        "deregister",
        rig.limits.call,
        rig.sender.deregister(local),
    )
    .await;
    assert!(
        matches!(again, Err(TransportError::UnknownRegion { region, .. }) if region == local),
        "[{}] {IDS}: deregistering region {local} twice must fail with UnknownRegion, got {again:?}",
        rig.name
    );

    let remote = rig.remote[1].id;
    rig.deregister(false, remote).await;
    expect_remote_refusal(
        &rig,
        TransferBatch::write(vec![rig.op(0, 0, 1, 0, 64)]).with_timeout(rig.limits.batch_timeout),
        "a batch writing a region the receiver deregistered",
        |e| matches!(e, TransportError::UnknownRegion { side: Side::Remote, region, .. } if *region == remote),
    )
    .await;
}

/// Every notification arrives only once its batch's bytes are visible in the receiver's memory,
/// and a refused batch never produces one.
pub async fn notification_after_data(pair: TransportPair) {
    const BATCHES: usize = 16;
    const SLOT: usize = 64 * 1024;
    let rig = Rig::new(pair, &[BATCHES * SLOT], &[BATCHES * SLOT]).await;
    let mut expected = Vec::new();
    let mut ids = Vec::new();
    // One snapshot before any batch: the batches write disjoint slots, so the model stays exact,
    // and the receiver's memory is never read while a transport may be writing into it.
    let mut model = rig.snapshot_remote();
    for i in 0..BATCHES {
        let base = (i * SLOT) as u64;
        // Many descriptors per batch, so a transport that notifies early is caught mid-copy.
        let ops: Vec<_> = (0..64u64)
            .map(|k| rig.op(0, base + k * 1024, 0, base + (63 - k) * 1024, 1024))
            .collect();
        apply(&mut model, &rig, &ops);
        expected.push(model[0][i * SLOT..(i + 1) * SLOT].to_vec());
        let batch = TransferBatch::write(ops)
            .with_notification(Bytes::from(format!("batch {i}")))
            .with_timeout(rig.limits.batch_timeout);
        ids.push(
            rig.post(batch).await.unwrap_or_else(|e| {
                panic!("[{}] {NOTIFY}: posting batch {i} failed: {e}", rig.name)
            }),
        );
    }
    let mut seen = [false; BATCHES];
    for _ in 0..BATCHES {
        let n = rig.recv_notification_ok().await;
        // Check the bytes before anything else can happen.
        let text = String::from_utf8_lossy(&n.payload).into_owned();
        let i: usize = text
            .strip_prefix("batch ")
            .and_then(|s| s.parse().ok())
            .filter(|&i: &usize| i < BATCHES)
            .unwrap_or_else(|| {
                panic!(
                    "[{}] {NOTIFY}: unexpected notification payload {text:?}",
                    rig.name
                )
            });
        // A read refused because the bytes are still being written is a late write too.
        let got = rig.remote[0].mem.to_vec((i * SLOT) as u64, SLOT as u64);
        assert!(
            got.as_ref().is_ok_and(|got| *got == expected[i]),
            "[{}] {NOTIFY}: the notification of batch {i} arrived before all its bytes were \
             visible in the receiver's memory ({})",
            rig.name,
            got.map_or_else(|e| e.to_string(), |_| "they differ".into())
        );
        assert!(
            !seen[i],
            "[{}] {NOTIFY}: batch {i} was notified twice",
            rig.name
        );
        seen[i] = true;
    }
    for id in ids {
        rig.wait(id, rig.limits.batch_timeout)
            .await
            .unwrap_or_else(|e| panic!("[{}] {DATA}: batch {id} failed: {e}", rig.name));
    }

    refused_batch_never_notifies(&rig, (BATCHES * SLOT) as u64).await;
}

/// A batch refused for writing past the receiver's region (of `region_len` bytes) delivers no
/// notification; the next good batch does.
async fn refused_batch_never_notifies(rig: &Rig, region_len: u64) {
    // A refused batch never notifies.
    let bad = TransferBatch::write(vec![rig.op(0, 0, 0, region_len, 1)])
        .with_notification(Bytes::from_static(b"refused"))
        .with_timeout(rig.limits.batch_timeout);
    expect_remote_refusal(
        rig,
        bad,
        "an out-of-bounds batch with a notification",
        |e| {
            matches!(
                e,
                TransportError::OutOfBounds {
                    side: Side::Remote,
                    ..
                }
            )
        },
    )
    .await;
    rig.transfer_ok(
        TransferBatch::write(vec![rig.op(0, 0, 0, 0, 8)])
            .with_notification(Bytes::from_static(b"good"))
            .with_timeout(rig.limits.batch_timeout),
        "a batch after a refused one",
    )
    .await;
    let n = rig.recv_notification_ok().await;
    assert_eq!(
        &n.payload[..],
        b"good",
        "[{}] {NOTIFY}: a refused batch delivered its notification",
        rig.name
    );
    let extra = timeout(rig.limits.quiet, rig.receiver.recv_notification()).await;
    assert!(
        extra.is_none(),
        "[{}] {NOTIFY}: an unexpected extra notification arrived: {extra:?}",
        rig.name
    );
}

/// Many batches posted and awaited concurrently all complete, with exact bytes and one
/// notification each.
pub async fn concurrent_batches(pair: TransportPair) {
    const BATCHES: usize = 64;
    const SLOT: u64 = 4096;
    let size = BATCHES * SLOT as usize;
    let rig = Rig::new(pair, &[size], &[size]).await;
    let mut rng = SplitMix64::new(0xC0_C0_C0);
    let mut model = rig.snapshot_remote();
    let mut batches = Vec::new();
    for i in 0..BATCHES as u64 {
        let mut ops = Vec::new();
        let mut at = 0;
        while at < SLOT {
            let len = (1 + rng.below(300)).min(SLOT - at);
            let src = rng.below(size as u64 - len);
            ops.push(rig.op(0, src, 0, i * SLOT + at, len));
            at += len;
        }
        apply(&mut model, &rig, &ops);
        batches.push(
            TransferBatch::write(ops)
                .with_notification(Bytes::from(i.to_le_bytes().to_vec()))
                .with_timeout(rig.limits.batch_timeout),
        );
    }
    let posted = join_all(batches.into_iter().map(|b| rig.post(b)).collect()).await;
    let ids: Vec<BatchId> = posted
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.unwrap_or_else(|e| {
                panic!(
                    "[{}] {DATA}: concurrent post of batch {i} failed: {e}",
                    rig.name
                )
            })
        })
        .collect();
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        ids.len(),
        "[{}] {IDS}: concurrent posts returned duplicate batch ids",
        rig.name
    );
    let waited = join_all(
        ids.iter()
            .map(|&id| rig.wait(id, rig.limits.batch_timeout))
            .collect(),
    )
    .await;
    for (id, r) in ids.iter().zip(waited) {
        r.unwrap_or_else(|e| panic!("[{}] {DATA}: concurrent batch {id} failed: {e}", rig.name));
    }
    rig.assert_remote(&model, DATA, &format!("{BATCHES} concurrent batches"));
    let mut seen = [false; BATCHES];
    for _ in 0..BATCHES {
        let n = rig.recv_notification_ok().await;
        let i = <[u8; 8]>::try_from(&n.payload[..])
            .map(u64::from_le_bytes)
            .ok()
            .filter(|&i| (i as usize) < BATCHES && !seen[i as usize])
            .unwrap_or_else(|| {
                panic!(
                    "[{}] {NOTIFY}: unexpected or repeated notification {:?}",
                    rig.name, n.payload
                )
            });
        seen[i as usize] = true;
    }
}

/// Batches with tiny deadlines end as done or [`TransportError::TimedOut`] by their deadline
/// (plus a bounded grace), never hang; a timed-out batch lands nothing afterwards.
pub async fn deadline_expiry(pair: TransportPair) {
    const SIZE: usize = 2 << 20;
    let rig = Rig::new(pair, &[SIZE], &[SIZE]).await;
    for (round, deadline) in EXPIRING_DEADLINES.into_iter().enumerate() {
        let (old, new, ops) = scattered_round(&rig, round as u64 + 40);
        let what = format!("a 2 MiB batch with a {deadline:?} deadline");
        let posted = Instant::now();
        let id = match rig
            .post(TransferBatch::write(ops).with_timeout(deadline))
            .await
        {
            Ok(id) => id,
            Err(e) => panic!("[{}] {ENDS}: posting {what} failed: {e}", rig.name),
        };
        match rig.wait(id, deadline).await {
            Ok(()) => rig.assert_remote(&new, DATA, &what),
            Err(TransportError::TimedOut { batch, .. }) if batch == id => {
                let what = format!("{what} timed out");
                assert_old_or_new(&rig, &old, &new, FENCING, &what);
                rig.assert_fenced(posted, deadline, &what).await;
            }
            Err(e) => panic!(
                "[{}] {ENDS}: {what} must end done or TimedOut, got {}: {e}",
                rig.name,
                err_kind(&e)
            ),
        }
        let again = rig.wait(id, deadline).await;
        assert_unknown_batch(
            rig.name,
            &again,
            id,
            format!("a second wait for batch {id}"),
        );
    }
}

/// A round over the rig's first regions: new source bytes from `seed`, 4096 scattered ops over
/// the whole source, the receiver's memory as it is now (`old`) and as the ops leave it (`new`).
fn scattered_round(rig: &Rig, seed: u64) -> (Vec<Vec<u8>>, Vec<Vec<u8>>, Vec<TransferOp>) {
    let size = rig.local[0].mem.len();
    rig.local[0]
        .mem
        .write_at(0, &SplitMix64::new(seed).bytes(size))
        .unwrap();
    let old = rig.snapshot_remote();
    let ops = scattered_ops(rig, size, 4096);
    let mut new = old.clone();
    apply(&mut new, rig, &ops);
    (old, new, ops)
}

/// One round of [`cancel_fences`]: new source bytes from `seed`, `ops` posted as one batch with
/// `deadline`, cancelled at once (or after a short pause when `late`), then the state `cancel`
/// returned checked against the receiver's memory (fenced unless done) and against `wait`,
/// which reports it once.
async fn cancel_round(rig: &Rig, ops: Vec<TransferOp>, deadline: Duration, seed: u64, late: bool) {
    rig.local[0]
        .mem
        .write_at(0, &SplitMix64::new(seed).bytes(rig.local[0].mem.len()))
        .unwrap();
    let old = rig.snapshot_remote();
    let mut new = old.clone();
    apply(&mut new, rig, &ops);
    let posted = Instant::now();
    let id = rig
        .post(TransferBatch::write(ops).with_timeout(deadline))
        .await
        .unwrap_or_else(|e| panic!("[{}] {FENCING}: post failed: {e}", rig.name));
    if late {
        sleep(POLL).await;
    }
    let state = bounded(
        rig.name,
        FENCING,
        "cancel",
        rig.limits.call,
        rig.sender.cancel(id),
    )
    .await
    .unwrap_or_else(|e| panic!("[{}] {FENCING}: cancel of batch {id} failed: {e}", rig.name));
    let what = format!("batch {id} was cancelled (cancel returned {state:?})");
    match state {
        BatchState::Done => {
            rig.assert_remote(&new, DATA, &what);
            let r = rig.wait(id, deadline).await;
            assert!(
                r.is_ok(),
                "[{}] {IDS}: cancel reported batch {id} done, but wait returned {r:?}",
                rig.name
            );
        }
        // Timed out: the machine was slow enough that the deadline passed before cancel.
        BatchState::Cancelled | BatchState::TimedOut => {
            assert_old_or_new(rig, &old, &new, FENCING, &what);
            rig.assert_fenced(posted, deadline, &what).await;
            let r = rig.wait(id, deadline).await;
            assert!(
                match (&state, &r) {
                    (BatchState::Cancelled, Err(TransportError::Cancelled { batch })) =>
                        *batch == id,
                    (BatchState::TimedOut, Err(TransportError::TimedOut { batch, .. })) =>
                        *batch == id,
                    _ => false,
                },
                "[{}] {IDS}: cancel reported batch {id} {state:?}, but wait returned {r:?}",
                rig.name
            );
        }
        other => panic!(
            "[{}] {FENCING}: cancel of a healthy batch must return Done, Cancelled or \
             (past its deadline) TimedOut, got {other:?}",
            rig.name
        ),
    }
    let again = bounded(
        rig.name,
        IDS,
        "cancel",
        rig.limits.call,
        rig.sender.cancel(id),
    )
    .await;
    assert_unknown_batch(rig.name, &again, id, "cancel after wait returned");
}

/// After `cancel` returns, no byte of the batch lands; `cancel` returns the final state, which
/// `wait` then reports once. A cancelled batch's destination is watched until its deadline
/// ([`Limits::interrupted_batch_timeout`]) plus the [fence grace](Limits::fence_grace), so a
/// write that lands well after `cancel` returned is caught.
pub async fn cancel_fences(pair: TransportPair) {
    const SIZE: usize = 2 << 20;
    let rig = Rig::new(pair, &[SIZE], &[SIZE]).await;
    let deadline = rig.limits.interrupted_batch_timeout;
    for round in 0..3u64 {
        let ops = scattered_ops(&rig, SIZE, 4096);
        cancel_round(&rig, ops, deadline, round + 90, round == 1).await;
    }
    // Cancelling a batch that already finished keeps its final state.
    let mut model = rig.snapshot_remote();
    let ops = vec![rig.op(0, 0, 0, 0, 4096)];
    apply(&mut model, &rig, &ops);
    let id = rig
        .post(TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout))
        .await
        .unwrap();
    let state = wait_final_state(&rig, id).await;
    assert_eq!(
        state,
        BatchState::Done,
        "[{}] {DATA}: a small batch did not complete",
        rig.name
    );
    let cancelled = bounded(
        rig.name,
        FENCING,
        "cancel",
        rig.limits.call,
        rig.sender.cancel(id),
    )
    .await;
    assert!(
        matches!(cancelled, Ok(BatchState::Done)),
        "[{}] {FENCING}: cancel of a finished batch must return Ok(Done), got {cancelled:?}",
        rig.name
    );
    rig.wait(id, rig.limits.batch_timeout)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "[{}] {IDS}: wait after cancelling a done batch must return Ok, got {e}",
                rig.name
            )
        });
    rig.assert_remote(&model, DATA, "a small batch");
}

/// A batch that does not complete never notifies, and one that completes notifies once:
/// notifying batches cancelled at once after `post` and batches whose deadline expires are
/// watched until their deadline plus the [fence grace](Limits::fence_grace), and no
/// notification may arrive for them (one that arrives at `post`, before the data, is caught
/// this way too, whatever the timing); one that `cancel` or `wait` reports done must have
/// delivered its notification, after its bytes.
pub async fn notifications_only_for_completed_batches(pair: TransportPair) {
    const SIZE: usize = 2 << 20;
    let rig = Rig::new(pair, &[SIZE], &[SIZE]).await;
    let rounds = [
        (
            "cancelled at once",
            rig.limits.interrupted_batch_timeout,
            true,
        ),
        (
            "cancelled at once",
            rig.limits.interrupted_batch_timeout,
            true,
        ),
        ("expiring", EXPIRING_DEADLINES[0], false),
        ("expiring", EXPIRING_DEADLINES[1], false),
    ];
    for (round, (how, deadline, cancel)) in rounds.into_iter().enumerate() {
        let (old, new, ops) = scattered_round(&rig, round as u64 + 70);
        let payload = format!("round {round}");
        let posted = Instant::now();
        let id = rig
            .post(
                TransferBatch::write(ops)
                    .with_notification(Bytes::from(payload.clone()))
                    .with_timeout(deadline),
            )
            .await
            .unwrap_or_else(|e| panic!("[{}] {NOTIFY}: post failed: {e}", rig.name));
        let state = if cancel {
            bounded(
                rig.name,
                FENCING,
                "cancel",
                rig.limits.call,
                rig.sender.cancel(id),
            )
            .await
            .unwrap_or_else(|e| panic!("[{}] {FENCING}: cancel failed: {e}", rig.name))
        } else {
            wait_final_state(&rig, id).await
        };
        let _ = rig.wait(id, deadline).await;
        let what = format!("a notifying 2 MiB batch {how} (deadline {deadline:?}) ended {state:?}");
        if state == BatchState::Done {
            rig.assert_remote(&new, DATA, &what);
            let n = rig.recv_notification_ok().await;
            assert_eq!(
                n.payload,
                payload.as_bytes(),
                "[{}] {NOTIFY}: {what}: another notification arrived instead of its own",
                rig.name
            );
        } else {
            assert_old_or_new(&rig, &old, &new, FENCING, &what);
            // Watched as long as a late write is (`assert_fenced`), and at least `quiet`.
            let until =
                (posted + deadline + rig.limits.fence_grace).max(Instant::now() + rig.limits.quiet);
            let left = until.saturating_duration_since(Instant::now());
            let got = timeout(left, rig.receiver.recv_notification()).await;
            assert!(
                got.is_none(),
                "[{}] {NOTIFY}: {what}, yet a notification arrived: {:?}",
                rig.name,
                got.map(|n| n.map(|n| String::from_utf8_lossy(&n.payload).into_owned()))
            );
        }
    }
    // The receiver still gets the notification of a batch that completes, and only that one.
    refused_batch_never_notifies(&rig, SIZE as u64).await;
}

/// Polls `batch_state` until final (bounded).
async fn wait_final_state(rig: &Rig, id: BatchId) -> BatchState {
    let polled = timeout(
        rig.limits.batch_timeout + rig.limits.deadline_grace,
        async {
            loop {
                match rig.sender.batch_state(id) {
                    Ok(BatchState::Pending) => sleep(POLL).await,
                    Ok(s) => return s,
                    Err(e) => panic!(
                        "[{}] {IDS}: batch_state of a posted, unwaited batch {id} failed: {e}",
                        rig.name
                    ),
                }
            }
        },
    )
    .await;
    polled.unwrap_or_else(|| {
        panic!(
            "[{}] {ENDS}: batch_state of batch {id} stayed Pending past its deadline",
            rig.name
        )
    })
}

/// The receiver shuts down while a large batch is in flight: `wait` returns (an error, unless the
/// batch had already completed) by the deadline, later batches fail, and `probe` reports the
/// peer lost.
pub async fn peer_disconnect_mid_batch(pair: TransportPair) {
    const SIZE: usize = 4 << 20;
    let rig = Rig::new(pair, &[SIZE], &[SIZE]).await;
    bounded(
        rig.name,
        PEER_LOSS,
        "probe",
        rig.limits.call,
        rig.sender.probe(rig.peer, rig.limits.probe),
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "[{}] {PEER_LOSS}: probe of a live peer failed: {e}",
            rig.name
        )
    });
    let deadline = rig.limits.interrupted_batch_timeout;
    let ops = scattered_ops(&rig, SIZE, 32 * 1024);
    let posted = Instant::now();
    let id = rig
        .post(TransferBatch::write(ops).with_timeout(deadline))
        .await
        .unwrap_or_else(|e| panic!("[{}] {PEER_LOSS}: post failed: {e}", rig.name));
    bounded(
        rig.name,
        PEER_LOSS,
        "receiver.shutdown",
        rig.limits.call,
        rig.receiver.shutdown(),
    )
    .await
    .unwrap_or_else(|e| panic!("[{}] {PEER_LOSS}: receiver.shutdown failed: {e}", rig.name));
    // Done (it finished before the shutdown) or an error; never a hang.
    if rig.wait(id, deadline).await.is_err() {
        rig.assert_fenced(
            posted,
            deadline,
            "the in-flight batch failed on peer shutdown",
        )
        .await;
    }
    // A batch posted after the peer is gone fails, at post or at wait.
    let before = rig.snapshot_remote();
    let after = rig
        .post(TransferBatch::write(vec![rig.op(0, 0, 0, 0, 4096)]).with_timeout(deadline))
        .await;
    if let Ok(id) = after {
        let r = rig.wait(id, deadline).await;
        assert!(
            r.is_err(),
            "[{}] {PEER_LOSS}: a batch posted after the receiver shut down completed",
            rig.name
        );
    }
    rig.assert_remote(
        &before,
        PEER_LOSS,
        "a batch posted after the receiver shut down",
    );
    let probe = bounded(
        rig.name,
        PEER_LOSS,
        "probe of a shut-down peer",
        rig.limits.call,
        rig.sender.probe(rig.peer, rig.limits.probe),
    )
    .await;
    assert!(
        probe.is_err(),
        "[{}] {PEER_LOSS}: probe of a shut-down peer returned Ok",
        rig.name
    );
}

/// Reads: a transport declaring [`Capabilities::reads`] round-trips a read batch byte for byte;
/// one that does not refuses it at `post` with [`TransportError::Unsupported`].
pub async fn reads_or_unsupported(pair: TransportPair) {
    let rig = Rig::new(pair, &[64 * 1024], &[64 * 1024]).await;
    let ops: Vec<_> = (0..64u64)
        .map(|i| rig.op(0, i * 1024, 0, (63 - i) * 1024, 1000))
        .collect();
    let batch = TransferBatch::read(ops.clone()).with_timeout(rig.limits.batch_timeout);
    assert_eq!(batch.direction, Direction::Read);
    if !rig.caps.reads {
        let before = rig.local[0].snapshot();
        let r = rig.post(batch).await;
        assert!(
            matches!(r, Err(TransportError::Unsupported { .. })),
            "[{}] {CAPS}: capabilities().reads is false, so a read batch must be refused with \
             Unsupported at post, got {r:?}",
            rig.name
        );
        assert!(
            rig.local[0].snapshot() == before,
            "[{}] {CAPS}: a refused read batch changed local memory",
            rig.name
        );
        return;
    }
    let remote_before = rig.snapshot_remote();
    let mut want = rig.local[0].snapshot();
    for op in &ops {
        let src = rig.remote[0].mem.to_vec(op.remote_offset, op.len).unwrap();
        let at = op.local_offset as usize;
        want[at..at + src.len()].copy_from_slice(&src);
    }
    rig.transfer_ok(batch, "a read batch").await;
    assert_region(rig.name, &rig.local[0], &want, DATA, "a read batch");
    rig.assert_remote(
        &remote_before,
        DATA,
        "a read batch (the source must not change)",
    );
    // Bounds apply to reads as well.
    let bad = rig.op(0, 0, 0, 64 * 1024 - 4, 8);
    let before = rig.local[0].snapshot();
    let r = rig
        .post(TransferBatch::read(vec![bad]).with_timeout(rig.limits.batch_timeout))
        .await;
    if let Ok(id) = r {
        let w = rig.wait(id, rig.limits.batch_timeout).await;
        assert!(
            w.is_err(),
            "[{}] {BOUNDS}: an out-of-bounds read batch completed",
            rig.name
        );
    }
    assert!(
        rig.local[0].snapshot() == before,
        "[{}] {BOUNDS}: a refused read batch changed local memory",
        rig.name
    );
}

/// A read stops writing into a local region once `deregister` of that region returned
/// (contract 3): read batches of many small ops are posted and their local region deregistered
/// while they run (three rounds: at once, after 1 ms, after 5 ms); whatever the batch then
/// reports, the region's bytes as they were when `deregister` returned never change again.
/// Transports without `reads` pass at once.
pub async fn local_deregister_fences_reads(pair: TransportPair) {
    const SIZE: usize = 16 << 20;
    let rig = Rig::new(pair, &[SIZE, SIZE, SIZE], &[SIZE]).await;
    if !rig.caps.reads {
        return;
    }
    for (round, delay) in [0u64, 1, 5].into_iter().enumerate() {
        let ops: Vec<_> = (0..SIZE as u64 / 1024)
            .map(|i| rig.op(round, i * 1024, 0, i * 1024, 1000))
            .collect();
        let id = rig
            .post(TransferBatch::read(ops).with_timeout(rig.limits.batch_timeout))
            .await
            .unwrap_or_else(|e| panic!("[{}] {DATA}: a read batch was refused: {e}", rig.name));
        sleep(Duration::from_millis(delay)).await;
        let region = rig.local[round].id;
        rig.deregister(true, region).await;
        let at_deregister = rig.local[round].snapshot();
        // Done (it finished first) or failed: either is allowed; bytes after the fence are not.
        let _ = rig.wait(id, rig.limits.batch_timeout).await;
        sleep(rig.limits.fence_grace).await;
        assert!(
            rig.local[round].snapshot() == at_deregister,
            "[{}] {FENCING}: a read batch wrote into local region {region} after \
             deregister({region}) returned (round {round}, deregistered {delay} ms after post)",
            rig.name
        );
    }
}

/// Ids that were never handed out are refused: `wait`, `cancel` and `batch_state` of an unknown
/// batch fail with [`TransportError::UnknownBatch`]; `post`, `probe` and `disconnect` to an
/// unknown peer with [`TransportError::UnknownPeer`].
pub async fn unknown_ids_refused(pair: TransportPair) {
    let rig = Rig::new(pair, &[4096], &[4096]).await;
    let id = BatchId(u64::MAX - 3);
    let w = rig.wait(id, rig.limits.batch_timeout).await;
    assert_unknown_batch(rig.name, &w, id, "wait of an unknown batch");
    let c = bounded(
        rig.name,
        IDS,
        "cancel",
        rig.limits.call,
        rig.sender.cancel(id),
    )
    .await;
    assert_unknown_batch(rig.name, &c, id, "cancel of an unknown batch");
    let s = rig.sender.batch_state(id);
    assert_unknown_batch(rig.name, &s, id, "batch_state of an unknown batch");
    let peer = PeerId(u64::MAX - 5);
    let unknown_peer = |r: &Result<(), TransportError>| matches!(r, Err(TransportError::UnknownPeer { peer: p, .. }) if *p == peer);
    let p = bounded(
        rig.name,
        IDS,
        "post",
        rig.limits.call,
        rig.sender
            .post(peer, TransferBatch::write(vec![rig.op(0, 0, 0, 0, 8)])),
    )
    .await
    .map(|_| ());
    assert!(
        unknown_peer(&p),
        "[{}] {IDS}: post to an unknown peer must fail with UnknownPeer, got {p:?}",
        rig.name
    );
    let pr = bounded(
        rig.name,
        IDS,
        "probe",
        rig.limits.call,
        rig.sender.probe(peer, rig.limits.probe),
    )
    .await;
    assert!(
        unknown_peer(&pr),
        "[{}] {IDS}: probe of an unknown peer must fail with UnknownPeer, got {pr:?}",
        rig.name
    );
    let d = bounded(
        rig.name,
        IDS,
        "disconnect",
        rig.limits.call,
        rig.sender.disconnect(peer),
    )
    .await;
    assert!(
        unknown_peer(&d),
        "[{}] {IDS}: disconnect of an unknown peer must fail with UnknownPeer, got {d:?}",
        rig.name
    );
    // After a real disconnect, the peer id is unknown.
    bounded(
        rig.name,
        IDS,
        "disconnect",
        rig.limits.call,
        rig.sender.disconnect(rig.peer),
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "[{}] {IDS}: disconnect of a connected peer failed: {e}",
            rig.name
        )
    });
    let before = rig.snapshot_remote();
    let p = rig
        .post(TransferBatch::write(vec![rig.op(0, 0, 0, 0, 8)]))
        .await;
    assert!(
        matches!(&p, Err(TransportError::UnknownPeer { peer, .. }) if *peer == rig.peer),
        "[{}] {IDS}: post to a disconnected peer must fail with UnknownPeer, got {p:?}",
        rig.name
    );
    rig.assert_remote(&before, IDS, "a post to a disconnected peer");
}

/// `wait` returns a batch's final state exactly once; afterwards the batch is unknown to `wait`,
/// `cancel` and `batch_state`. Before that, `batch_state` reports it.
pub async fn wait_returns_final_state_once(pair: TransportPair) {
    let rig = Rig::new(pair, &[4096], &[4096]).await;
    let mut model = rig.snapshot_remote();
    let ops = vec![rig.op(0, 0, 0, 0, 4096)];
    apply(&mut model, &rig, &ops);
    let id = rig
        .post(TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout))
        .await
        .unwrap_or_else(|e| panic!("[{}] {DATA}: post failed: {e}", rig.name));
    let state = wait_final_state(&rig, id).await;
    assert_eq!(
        state,
        BatchState::Done,
        "[{}] {DATA}: a small batch did not complete",
        rig.name
    );
    let still = rig.sender.batch_state(id);
    assert!(
        matches!(still, Ok(BatchState::Done)),
        "[{}] {IDS}: batch_state must keep reporting Done until wait returns, got {still:?}",
        rig.name
    );
    rig.assert_remote(&model, DATA, "a small batch reported Done");
    rig.wait(id, rig.limits.batch_timeout)
        .await
        .unwrap_or_else(|e| panic!("[{}] {IDS}: wait of a done batch failed: {e}", rig.name));
    let w = rig.wait(id, rig.limits.batch_timeout).await;
    assert_unknown_batch(rig.name, &w, id, "a second wait");
    let s = rig.sender.batch_state(id);
    assert_unknown_batch(rig.name, &s, id, "batch_state after wait returned");
    // Ids are not reused.
    let id2 = rig
        .post(TransferBatch::write(vec![]).with_timeout(rig.limits.batch_timeout))
        .await
        .unwrap();
    assert_ne!(id, id2, "[{}] {IDS}: a batch id was reused", rig.name);
    rig.wait(id2, rig.limits.batch_timeout).await.unwrap();
}

/// A descriptor that is not one of this transport's is refused with
/// [`TransportError::BadDescriptor`].
pub async fn bad_descriptor_refused(pair: TransportPair) {
    let name = pair.sender.name();
    let call = pair.limits.call;
    for bad in [&b""[..], &b"\xff\x00 definitely not a descriptor \x01"[..]] {
        let r = bounded(name, IDS, "connect", call, pair.sender.connect(bad)).await;
        assert!(
            matches!(r, Err(TransportError::BadDescriptor { .. })),
            "[{name}] {IDS}: connect({bad:?}) must fail with BadDescriptor, got {r:?}"
        );
    }
}

/// After `shutdown`, calls fail with [`TransportError::Closed`] and a batch in flight still
/// reaches a final state.
pub async fn shutdown_closes(pair: TransportPair) {
    const SIZE: usize = 2 << 20;
    let rig = Rig::new(pair, &[SIZE], &[SIZE]).await;
    let ops = scattered_ops(&rig, SIZE, 4096);
    let deadline = rig.limits.interrupted_batch_timeout;
    let id = rig
        .post(TransferBatch::write(ops).with_timeout(deadline))
        .await
        .unwrap_or_else(|e| panic!("[{}] {CLOSED}: post failed: {e}", rig.name));
    let region = rig
        .sender
        .allocate(64)
        .unwrap_or_else(|e| panic!("[{}] allocate failed: {e}", rig.name));
    bounded(
        rig.name,
        CLOSED,
        "shutdown",
        rig.limits.call,
        rig.sender.shutdown(),
    )
    .await
    .unwrap_or_else(|e| panic!("[{}] {CLOSED}: shutdown failed: {e}", rig.name));
    // Done, failed or closed: any final answer, by the deadline.
    let _ = rig.wait(id, deadline).await;
    let closed = |r: &Result<(), TransportError>| matches!(r, Err(TransportError::Closed { .. }));
    let p = rig
        .post(TransferBatch::write(vec![rig.op(0, 0, 0, 0, 8)]))
        .await
        .map(|_| ());
    assert!(
        closed(&p),
        "[{}] {CLOSED}: post after shutdown must fail with Closed, got {p:?}",
        rig.name
    );
    let r = bounded(
        rig.name,
        CLOSED,
        "register",
        rig.limits.call,
        rig.sender.register(region),
    )
    .await
    .map(|_| ());
    assert!(
        closed(&r),
        "[{}] {CLOSED}: register after shutdown must fail with Closed, got {r:?}",
        rig.name
    );
    let descriptor = rig.receiver.local_descriptor();
    let c = bounded(
        rig.name,
        CLOSED,
        "connect",
        rig.limits.call,
        rig.sender.connect(&descriptor),
    )
    .await
    .map(|_| ());
    assert!(
        closed(&c),
        "[{}] {CLOSED}: connect after shutdown must fail with Closed, got {c:?}",
        rig.name
    );
    let n = bounded(
        rig.name,
        CLOSED,
        "recv_notification",
        rig.limits.call,
        rig.sender.recv_notification(),
    )
    .await
    .map(|_| ());
    assert!(
        closed(&n),
        "[{}] {CLOSED}: recv_notification after shutdown must fail with Closed, got {n:?}",
        rig.name
    );
}

/// A transport may learn the receiver's regions once, at `connect` (a peer region table), but a
/// region the receiver registers **after** `connect` is writable as soon as its `register`
/// returned — small and large batches alike — and a write past its end is refused (at `post`
/// with [`TransportError::OutOfBounds`] naming the remote side, or by a failed `wait`) without
/// touching memory.
pub async fn regions_registered_after_connect(pair: TransportPair) {
    const LARGE: usize = 256 * 1024;
    let mut rig = Rig::new(pair, &[LARGE], &[4096]).await;
    let mut rng = SplitMix64::new(0x7AB1E);
    rig.remote.push(
        register(
            rig.name,
            &rig.receiver,
            4096,
            &mut rng,
            "receiver",
            rig.limits.call,
        )
        .await,
    );
    rig.remote.push(
        register(
            rig.name,
            &rig.receiver,
            LARGE,
            &mut rng,
            "receiver",
            rig.limits.call,
        )
        .await,
    );
    let mut model = rig.snapshot_remote();
    for ops in [
        vec![rig.op(0, 0, 1, 0, 4096)],
        vec![
            rig.op(0, 0, 2, LARGE as u64 / 2, LARGE as u64 / 2),
            rig.op(0, LARGE as u64 / 2, 2, 0, LARGE as u64 / 2),
        ],
    ] {
        apply(&mut model, &rig, &ops);
        rig.transfer_ok(
            TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
            "a batch into a region the receiver registered after connect",
        )
        .await;
        rig.assert_remote(
            &model,
            DATA,
            "a batch into a region the receiver registered after connect",
        );
    }
    let small = rig.remote[1].id;
    for (offset, len) in [(4000u64, 200u64), (0, 4097), (4096, LARGE as u64 / 2)] {
        expect_remote_refusal(
            &rig,
            TransferBatch::write(vec![rig.op(0, 0, 0, 0, 64), rig.op(0, 0, 1, offset, len)])
                .with_timeout(rig.limits.batch_timeout),
            &format!(
                "a batch writing [{offset}, {offset}+{len}) of a 4096-byte region registered \
                 after connect"
            ),
            |e| {
                matches!(e, TransportError::OutOfBounds { side: Side::Remote, region, region_len: 4096, .. }
                    if *region == small)
            },
        )
        .await;
    }
}

/// Regions the receiver does not have when a batch arrives — deregistered after `connect`
/// (so a table learned at `connect` is stale), or never registered — are refused at `post` with
/// [`TransportError::UnknownRegion`] naming the remote side, or by a failed `wait`, for small and
/// large batches, without touching memory; the peer keeps working afterwards.
pub async fn stale_or_unknown_remote_regions_refused(pair: TransportPair) {
    const LARGE: u64 = 256 * 1024;
    let rig = Rig::new(pair, &[LARGE as usize], &[LARGE as usize, LARGE as usize]).await;
    let gone = rig.remote[1].id;
    rig.deregister(false, gone).await;
    let bogus = RegionId(u64::MAX - 11);
    for (region, what) in [
        (gone, "deregistered after connect"),
        (bogus, "never registered"),
    ] {
        for len in [64, LARGE] {
            let mut op = rig.op(0, 0, 1, 0, len);
            op.remote_region = region;
            expect_remote_refusal(
                &rig,
                TransferBatch::write(vec![rig.op(0, 0, 0, 0, 64), op]).with_timeout(rig.limits.batch_timeout),
                &format!("a {len}-byte write into a remote region {what}"),
                |e| matches!(e, TransportError::UnknownRegion { side: Side::Remote, region: r, .. } if *r == region),
            )
            .await;
        }
    }
    let mut model = rig.snapshot_remote();
    let ops = vec![rig.op(0, 0, 0, 0, LARGE)];
    apply(&mut model, &rig, &ops);
    rig.transfer_ok(
        TransferBatch::write(ops).with_timeout(rig.limits.batch_timeout),
        "a valid batch after refused ones",
    )
    .await;
    rig.assert_remote(&model, DATA, "a valid batch after refused ones");
}

/// A region of device memory is refused at `register` with [`TransportError::Unsupported`]
/// unless the transport's capabilities declare
/// [`device_memory`](Capabilities::device_memory); then it is accepted (the pair supplies the
/// memory, [`TransportPair::with_device_regions`]). Host memory is accepted either way.
pub async fn device_memory_refused_unless_declared(pair: TransportPair) {
    const LEN: usize = 4096;
    let name = pair.sender.name();
    let call = pair.limits.call;
    for (side, t) in [("sender", &pair.sender), ("receiver", &pair.receiver)] {
        let declared = t.capabilities().device_memory;
        let device = match (&pair.device_regions, declared) {
            (_, false) => placeholder_device_region(0, LEN),
            (Some(make), true) => make(LEN),
            (None, true) => panic!(
                "[{name}] {CAPS}: the {side} declares device_memory, so the suite needs device \
                 memory to register; build the pair with TransportPair::with_device_regions"
            ),
        };
        let kind = device.kind();
        assert!(
            !kind.is_host(),
            "[{name}] {CAPS}: the device region for the {side} is {kind}, not device memory"
        );
        let r = bounded(name, CAPS, "register", call, t.register(device)).await;
        match (declared, r) {
            (false, Err(TransportError::Unsupported { .. })) => {}
            (false, r) => panic!(
                "[{name}] {CAPS}: the {side} does not declare device_memory, so registering \
                 {LEN} bytes of {kind} must fail with Unsupported, got {r:?}"
            ),
            (true, Ok(id)) => bounded(name, CAPS, "deregister", call, t.deregister(id))
                .await
                .unwrap_or_else(|e| {
                    panic!("[{name}] {CAPS}: {side}.deregister of a device region failed: {e}")
                }),
            (true, Err(e)) => panic!(
                "[{name}] {CAPS}: the {side} declares device_memory but refused {LEN} bytes of \
                 {kind}: {e}"
            ),
        }
        let host = t
            .allocate(LEN)
            .unwrap_or_else(|e| panic!("[{name}] {side}.allocate({LEN}) failed: {e}"));
        let id = bounded(name, CAPS, "register", call, t.register(host))
            .await
            .unwrap_or_else(|e| {
                panic!("[{name}] {CAPS}: {side}.register of host memory failed: {e}")
            });
        bounded(name, CAPS, "deregister", call, t.deregister(id))
            .await
            .unwrap_or_else(|e| panic!("[{name}] {CAPS}: {side}.deregister failed: {e}"));
    }
}

/// Strided ops (several rows each, [`TransferOp::with_rows`]) move every row: a DCP relayout
/// (every 4th row of the source into contiguous rows), its inverse, random strides and row
/// counts, zero rows and zero-length rows (at the very end of a region too). The same batch
/// expanded into one op per row ([`TransferBatch::expand_rows`]) leaves the same bytes. Runs on
/// transports with and without native strided support ([`Capabilities::strided_ops`]).
pub async fn strided_ops_move_every_row(pair: TransportPair) {
    const SIZE: usize = 256 * 1024;
    let rig = Rig::new(pair, &[SIZE], &[SIZE, 4096]).await;
    let mut rng = SplitMix64::new(0x5712_1DE5);
    let row = 1152u64;
    let mut rounds: Vec<(&str, Vec<TransferOp>)> = vec![
        (
            "a DCP 1 -> 4 relayout (16 rows of 1152 B every 4 rows, packed)",
            (0..4)
                .map(|k| {
                    rig.op(0, k * row, 0, k * 16 * row, row)
                        .with_rows(16, 4 * row, row)
                })
                .collect(),
        ),
        (
            "a DCP 4 -> 1 relayout (packed rows spread every 4 rows)",
            (0..4)
                .map(|k| {
                    rig.op(0, k * 16 * row, 0, k * row, row)
                        .with_rows(16, row, 4 * row)
                })
                .collect(),
        ),
        (
            "zero rows and zero-length rows, at the end of a region too",
            vec![
                rig.op(0, SIZE as u64, 1, 4096, 100).with_rows(0, 1, 1),
                rig.op(0, 0, 1, 4096, 0).with_rows(7, 3, 0),
                rig.op(0, 100, 1, 0, 8).with_rows(3, 0, 8),
                rig.op(0, 7, 0, 200_000, 1).with_rows(1, 0, 0),
            ],
        ),
    ];
    // Random rows in disjoint destination slots of 16 KiB each.
    let mut random = Vec::new();
    for slot in 0..12u64 {
        let len = 1 + rng.below(300);
        let remote_stride = len + rng.below(64);
        let count = 1 + rng.below(16_384 / remote_stride);
        let local_stride = rng.below(2 * len + 1);
        let local_span = (count - 1) * local_stride + len;
        let lo = rng.below(SIZE as u64 - local_span + 1);
        random.push(rig.op(0, lo, 0, slot * 16_384, len).with_rows(
            count,
            local_stride,
            remote_stride,
        ));
    }
    rounds.push(("random strides and row counts", random));
    for (round, (what, ops)) in rounds.into_iter().enumerate() {
        for expanded in [false, true] {
            rig.local[0].mem.write_at(0, &rng.bytes(SIZE)).unwrap();
            let mut model = rig.snapshot_remote();
            apply(&mut model, &rig, &ops);
            let mut batch =
                TransferBatch::write(ops.clone()).with_timeout(rig.limits.batch_timeout);
            let what = if expanded {
                batch = batch.expand_rows(rig.name, None).unwrap_or_else(|e| {
                    panic!("[{}] {DATA}: expand_rows of {what}: {e}", rig.name)
                });
                format!("round {round}: {what}, expanded into one op per row")
            } else {
                format!("round {round}: {what}")
            };
            rig.transfer_ok(batch, &what).await;
            rig.assert_remote(&model, DATA, &what);
        }
    }
}

/// Every row of a strided op is bounds-checked before any byte moves: a last row past the end
/// (local: refused at `post`; remote: at `post` or by `wait`), rows whose offsets overflow
/// `u64`, and rows that overlap each other on the destination are refused, and nothing of the
/// batch lands — its valid ops included.
pub async fn strided_bounds_refused(pair: TransportPair) {
    let rig = Rig::new(pair, &[8192], &[8192]).await;
    let valid = rig.op(0, 0, 0, 0, 100);
    // 8 rows of 64 every 1024: the last ends at 7 * 1024 + 64 = 7232; from 1000 it is 8232.
    let local_past = rig.op(0, 1000, 0, 4000, 64).with_rows(8, 1024, 64);
    expect_local_refusal(
        &rig,
        TransferBatch::write(vec![valid, local_past]),
        "a strided op whose last local row ends at 8232 of an 8192-byte region",
        |e| {
            matches!(
                e,
                TransportError::OutOfBounds {
                    side: Side::Local,
                    ..
                }
            ) || matches!(e, TransportError::InvalidArgument { .. })
        },
    )
    .await;
    let remote_past = rig.op(0, 4000, 0, 1000, 64).with_rows(8, 64, 1024);
    expect_remote_refusal(
        &rig,
        TransferBatch::write(vec![valid, remote_past]).with_timeout(rig.limits.batch_timeout),
        "a strided op whose last remote row ends at 8232 of an 8192-byte region",
        |e| {
            matches!(
                e,
                TransportError::OutOfBounds {
                    side: Side::Remote,
                    ..
                }
            ) || matches!(e, TransportError::InvalidArgument { .. })
        },
    )
    .await;
    let overflow = |e: &TransportError| {
        matches!(
            e,
            TransportError::OutOfBounds { .. } | TransportError::InvalidArgument { .. }
        )
    };
    for (count, stride) in [(3u64, u64::MAX / 2), (u64::MAX, 8), (2, u64::MAX)] {
        let local = rig.op(0, 0, 0, 0, 8).with_rows(count, stride, 8);
        expect_local_refusal(
            &rig,
            TransferBatch::write(vec![valid, local]),
            &format!("{count} local rows every {stride} bytes (overflowing u64)"),
            overflow,
        )
        .await;
        let remote = rig.op(0, 0, 0, 0, 8).with_rows(count, 8, stride);
        expect_remote_refusal(
            &rig,
            TransferBatch::write(vec![valid, remote]).with_timeout(rig.limits.batch_timeout),
            &format!("{count} remote rows every {stride} bytes (overflowing u64)"),
            overflow,
        )
        .await;
    }
    let overlapping = rig.op(0, 0, 0, 1000, 64).with_rows(4, 64, 32);
    expect_local_refusal(
        &rig,
        TransferBatch::write(vec![valid, overlapping]),
        "a strided op whose 64-byte destination rows are 32 bytes apart (overlapping)",
        |e| matches!(e, TransportError::InvalidArgument { .. }),
    )
    .await;
}

/// A cancelled batch of a few large strided ops is fenced mid-op: no row of it lands after
/// `cancel` reported it cancelled (or timed out).
pub async fn cancel_fences_mid_strided_op(pair: TransportPair) {
    const SIZE: usize = 2 << 20;
    let rig = Rig::new(pair, &[SIZE], &[SIZE]).await;
    let deadline = rig.limits.interrupted_batch_timeout;
    let row = 1152u64;
    let rows = SIZE as u64 / (4 * row);
    for round in 0..2u64 {
        // Four ops of `rows` rows each: every 4th source row, packed on the destination.
        let ops: Vec<_> = (0..4)
            .map(|k| {
                rig.op(0, k * row, 0, k * rows * row, row)
                    .with_rows(rows, 4 * row, row)
            })
            .collect();
        cancel_round(&rig, ops, deadline, round + 190, round == 1).await;
    }
}

/// Expands, in the caller's module, to one
/// `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]` per conformance case, named
/// after the case, each calling `kvbridge_conformance::<case>($make_pair().await)`; and
/// to the same tests in a sub-module `dyn_transport` that run each case through
/// `Arc<dyn KvTransport>` wrappers ([`TransportPair::boxed`](crate::TransportPair::boxed)).
///
/// `$make_pair` is a path to an `async fn() -> TransportPair` returning two fresh, unconnected
/// transports. The caller needs `tokio` with the `macros` and `rt-multi-thread` features in its
/// dev-dependencies. Invoke it inside a module of its own (`mod conformance { ... }`).
///
/// ```ignore
/// mod conformance {
///     kvbridge_conformance::conformance_tests!(super::make_pair);
/// }
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($make_pair:expr) => {
        #[doc(hidden)]
        async fn __kvbridge_make_pair() -> $crate::TransportPair {
            ($make_pair)().await
        }

        $crate::__conformance_cases!($crate::__conformance_emit_direct);

        /// The conformance cases again, through `Arc<dyn KvTransport>` wrappers.
        mod dyn_transport {
            $crate::__conformance_cases!($crate::__conformance_emit_boxed);
        }
    };
}

/// The list of case names, passed to an emitter macro.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($emit:path) => {
        $emit! {
            random_batches,
            zero_length_and_empty_batches,
            large_batch,
            out_of_bounds_local_refused,
            out_of_bounds_remote_refused,
            unknown_region_refused,
            offset_overflow_refused,
            deregistered_region_refused,
            notification_after_data,
            notifications_only_for_completed_batches,
            concurrent_batches,
            deadline_expiry,
            cancel_fences,
            peer_disconnect_mid_batch,
            reads_or_unsupported,
            local_deregister_fences_reads,
            unknown_ids_refused,
            wait_returns_final_state_once,
            bad_descriptor_refused,
            shutdown_closes,
            device_memory_refused_unless_declared,
            regions_registered_after_connect,
            stale_or_unknown_remote_regions_refused,
            strided_ops_move_every_row,
            strided_bounds_refused,
            cancel_fences_mid_strided_op,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_emit_direct {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::$case(__kvbridge_make_pair().await).await
            }
        )*
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_emit_boxed {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::$case(super::__kvbridge_make_pair().await.boxed()).await
            }
        )*
    };
}

/// Names of every case, in the order the macro emits them.
pub const CASES: &[&str] = &[
    "random_batches",
    "zero_length_and_empty_batches",
    "large_batch",
    "out_of_bounds_local_refused",
    "out_of_bounds_remote_refused",
    "unknown_region_refused",
    "offset_overflow_refused",
    "deregistered_region_refused",
    "notification_after_data",
    "notifications_only_for_completed_batches",
    "concurrent_batches",
    "deadline_expiry",
    "cancel_fences",
    "peer_disconnect_mid_batch",
    "reads_or_unsupported",
    "local_deregister_fences_reads",
    "unknown_ids_refused",
    "wait_returns_final_state_once",
    "bad_descriptor_refused",
    "shutdown_closes",
    "device_memory_refused_unless_declared",
    "regions_registered_after_connect",
    "stale_or_unknown_remote_regions_refused",
    "strided_ops_move_every_row",
    "strided_bounds_refused",
    "cancel_fences_mid_strided_op",
];
