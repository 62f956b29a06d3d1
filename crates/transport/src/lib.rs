//! The `KvTransport` trait: how kvbridge moves KV bytes between processes.
//!
//! KV data never crosses this trait as a buffer. It stays in [`MemoryRegion`]s registered with
//! a transport and moves as one-sided `(local region, offset, remote region, offset, len)`
//! descriptors, the way RDMA engines (Mooncake's transfer engine, NIXL, UCX) work: register
//! memory, exchange a descriptor through the handshake, post a batch of writes, learn when it
//! is done.
//!
//! # The contract
//!
//! Every implementation promises the nine points written on [`KvTransport`] (bounds before
//! bytes, every batch ends by its deadline, fencing after cancel or failure, notifications
//! follow data, peer loss is an error and not a hang, exact data, ids, declared capabilities,
//! shutdown). The conformance suite, the `kvbridge-conformance` crate (a dev-dependency),
//! checks each point, and every transport in this workspace runs it; see `docs/transports.md`.
//!
//! # Example
//!
//! ```
//! use kvbridge_transport::{TransferBatch, TransferOp, RegionId};
//! use std::time::Duration;
//!
//! let batch = TransferBatch::write(vec![TransferOp::new(RegionId(1), 0, RegionId(7), 4096, 73_728)])
//! .with_notification(bytes::Bytes::from_static(b"room 42 chunk 0"))
//! .with_timeout(Duration::from_secs(5));
//! assert_eq!(batch.total_bytes(), 73_728);
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub mod batch;
pub mod delegate;
mod error;
pub mod inbox;

/// The byte buffer of descriptors and notifications, re-exported so an implementer needs no
/// `bytes` dependency of its own.
pub use bytes::Bytes;
pub use delegate::Delegate;
pub use error::{Result, Side, TransportError};
/// Registered memory (`kvbridge-memory`): regions, claims and the raw vectored I/O.
pub use kvbridge_memory as memory;
pub use kvbridge_memory::{
    Access, AllocError, CLAIM_WAIT, ForeignMemory, MemoryError, MemoryKind, MemoryRegion, Operand,
    RangeError, RegionSlice, RegionSliceMut,
};
/// The poison-ignoring lock helpers (`kvbridge-sync`), re-exported for implementers.
pub use kvbridge_sync as sync;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "#{}", self.0)
            }
        }
    };
}

id_type!(
    /// A region registered with one transport instance. Remote region ids are the peer's own ids,
    /// learned through the handshake.
    RegionId
);
id_type!(
    /// A peer known to one transport instance: an outbound connection made by `connect`, or an
    /// inbound one (the origin of a [`Notification`]).
    PeerId
);
id_type!(
    /// A batch posted on one transport instance.
    BatchId
);

/// Whether a batch writes local bytes into the peer (push) or reads the peer's bytes (pull).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Copy `local[offset..+len]` into `remote[offset..+len]`.
    Write,
    /// Copy `remote[offset..+len]` into `local[offset..+len]` (needs [`Capabilities::reads`]).
    Read,
}

/// One copy between a local and a remote region: `count` rows of `len` bytes, row `i` from
/// `local_offset + i * local_stride` to `remote_offset + i * remote_stride` (for a write; a read
/// copies the other way). A plain [`TransferOp::new`] is one row. Rows let one descriptor carry
/// a strided relayout (every 4th token row of a page into a contiguous page) instead of one
/// descriptor per row; see [`with_rows`](Self::with_rows).
///
/// Build it with [`TransferOp::new`]: the struct is `#[non_exhaustive]` so later fields
/// (priorities, memory hints) are not breaking changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct TransferOp {
    /// Region registered with the transport that posts the batch.
    pub local_region: RegionId,
    /// Byte offset of the first row in the local region.
    pub local_offset: u64,
    /// Region registered with the peer.
    pub remote_region: RegionId,
    /// Byte offset of the first row in the remote region.
    pub remote_offset: u64,
    /// Bytes per row (zero is allowed and moves nothing).
    pub len: u64,
    /// Number of rows (1 for a contiguous copy; zero is allowed and moves nothing).
    pub count: u64,
    /// Distance in bytes between the starts of consecutive rows in the local region.
    pub local_stride: u64,
    /// Distance in bytes between the starts of consecutive rows in the remote region.
    pub remote_stride: u64,
}

impl TransferOp {
    /// A copy of `len` bytes between `local_region[local_offset..]` and
    /// `remote_region[remote_offset..]` (one row).
    pub const fn new(
        local_region: RegionId,
        local_offset: u64,
        remote_region: RegionId,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        Self {
            local_region,
            local_offset,
            remote_region,
            remote_offset,
            len,
            count: 1,
            local_stride: len,
            remote_stride: len,
        }
    }

    /// The same copy repeated `count` times, each row `local_stride` bytes after the previous
    /// one locally and `remote_stride` bytes after it remotely.
    ///
    /// ```
    /// use kvbridge_transport::{RegionId, TransferOp};
    /// // 16 rows of 1152 bytes, every 4th row of the source, packed on the destination.
    /// let op = TransferOp::new(RegionId(1), 0, RegionId(2), 0, 1152).with_rows(16, 4 * 1152, 1152);
    /// assert_eq!(op.total_bytes(), 16 * 1152);
    /// assert_eq!(op.rows().nth(1).unwrap().local_offset, 4 * 1152);
    /// ```
    #[must_use]
    pub const fn with_rows(mut self, count: u64, local_stride: u64, remote_stride: u64) -> Self {
        self.count = count;
        self.local_stride = local_stride;
        self.remote_stride = remote_stride;
        self
    }

    /// Whether the op is one contiguous copy (at most one row).
    pub const fn is_contiguous(&self) -> bool {
        self.count <= 1
    }

    /// Bytes the op moves: `len * count`, saturating.
    pub const fn total_bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }

    /// The rows as one-row ops, in order. Offsets wrap rather than panic on overflow; bounds
    /// ([`memory::checked_rows`]) are checked before any row is used.
    pub fn rows(&self) -> impl ExactSizeIterator<Item = TransferOp> + '_ {
        let count = usize::try_from(self.count).unwrap_or(usize::MAX);
        (0..count).map(move |i| {
            let i = i as u64;
            TransferOp::new(
                self.local_region,
                self.local_offset
                    .wrapping_add(i.wrapping_mul(self.local_stride)),
                self.remote_region,
                self.remote_offset
                    .wrapping_add(i.wrapping_mul(self.remote_stride)),
                self.len,
            )
        })
    }

    /// The span of every local row of the op (first row's start to last row's end) in a region
    /// of `region_len` bytes, or [`TransportError::OutOfBounds`] on [`Side::Local`] naming the
    /// op's local region when a row lies outside it (or its end overflows).
    pub fn local_rows_in(&self, region_len: usize) -> Result<std::ops::Range<usize>> {
        memory::checked_rows(
            region_len,
            self.local_offset,
            self.local_stride,
            self.len,
            self.count,
        )
        .map_err(|e| TransportError::out_of_bounds(e, Side::Local, self.local_region))
    }

    /// [`local_rows_in`](Self::local_rows_in) for the remote rows ([`Side::Remote`]).
    pub fn remote_rows_in(&self, region_len: usize) -> Result<std::ops::Range<usize>> {
        memory::checked_rows(
            region_len,
            self.remote_offset,
            self.remote_stride,
            self.len,
            self.count,
        )
        .map_err(|e| TransportError::out_of_bounds(e, Side::Remote, self.remote_region))
    }

    /// Whether rows of this op overlap each other on the destination side of a batch in
    /// `direction` (the remote region for a write, the local one for a read). Such an op is
    /// refused with [`TransportError::InvalidArgument`]: its result would depend on row order.
    pub const fn rows_overlap_on_destination(&self, direction: Direction) -> bool {
        let stride = match direction {
            Direction::Write => self.remote_stride,
            Direction::Read => self.local_stride,
        };
        self.count > 1 && self.len > 0 && stride < self.len
    }
}

/// Default deadline of a batch when none is given.
pub const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(30);

/// A batch of one-sided copies to one peer, with an optional notification and a deadline.
///
/// Build it with [`TransferBatch::write`], [`read`](Self::read) or [`new`](Self::new) (the
/// struct is `#[non_exhaustive]`); the fields stay public to read and to change.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransferBatch {
    /// Write (push) or read (pull).
    pub direction: Direction,
    /// The copies, in any order; they must not overlap on the destination side.
    pub ops: Vec<TransferOp>,
    /// Delivered to the peer after all bytes of the batch are visible there.
    pub notification: Option<Bytes>,
    /// Time from posting by which the batch reaches a final state.
    pub timeout: Duration,
}

impl TransferBatch {
    /// A write batch with the default deadline and no notification.
    pub fn write(ops: Vec<TransferOp>) -> Self {
        Self::new(Direction::Write, ops)
    }

    /// A read batch with the default deadline and no notification.
    pub fn read(ops: Vec<TransferOp>) -> Self {
        Self::new(Direction::Read, ops)
    }

    /// Attaches a notification delivered to the peer after the data.
    pub fn with_notification(mut self, payload: Bytes) -> Self {
        self.notification = Some(payload);
        self
    }

    /// Sets the deadline, counted from posting.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// A batch in `direction` with the default deadline and no notification.
    pub fn new(direction: Direction, ops: Vec<TransferOp>) -> Self {
        Self {
            direction,
            ops,
            notification: None,
            timeout: DEFAULT_BATCH_TIMEOUT,
        }
    }

    /// Sum of the bytes of every op (rows included; saturating).
    pub fn total_bytes(&self) -> u64 {
        self.ops
            .iter()
            .fold(0u64, |acc, op| acc.saturating_add(op.total_bytes()))
    }

    /// Refuses, with [`TransportError::InvalidArgument`], a batch with an op whose rows overlap
    /// each other on the destination ([`TransferOp::rows_overlap_on_destination`]): the result
    /// would depend on the order rows are copied in.
    pub fn check_destination_rows(&self, transport: &'static str) -> Result<()> {
        match (self.ops.iter().enumerate())
            .find(|(_, op)| op.rows_overlap_on_destination(self.direction))
        {
            None => Ok(()),
            Some((i, op)) => Err(TransportError::InvalidArgument {
                transport,
                message: format!(
                    "op {i} has {} rows of {} bytes whose destination stride is smaller than a \
                     row, so its rows overlap on the destination; use a destination stride of at \
                     least the row length",
                    op.count, op.len
                ),
            }),
        }
    }

    /// Number of rows the ops cover (a contiguous op is one row; saturating).
    pub fn row_count(&self) -> u64 {
        self.ops
            .iter()
            .fold(0u64, |acc, op| acc.saturating_add(op.count))
    }

    /// The same batch with every op split into one-row ops: the one expansion helper, for a
    /// transport without native strided support ([`Capabilities::strided_ops`] off), which calls
    /// it at the top of [`KvTransport::post`]. Bytes moved and destinations are unchanged.
    ///
    /// Refused with [`TransportError::InvalidArgument`], before anything is allocated: an op
    /// whose rows overlap on the destination ([`TransferOp::rows_overlap_on_destination`]), an
    /// op whose last row's end overflows `u64` ([`memory::checked_rows`] bounds the rest), and
    /// a batch of more than `max_rows` rows (pass the transport's
    /// [`Capabilities::max_ops_per_batch`]; never more than [`MAX_EXPANDED_ROWS`]).
    pub fn expand_rows(self, transport: &'static str, max_rows: Option<usize>) -> Result<Self> {
        if self.ops.iter().all(TransferOp::is_contiguous) {
            return Ok(self);
        }
        self.check_destination_rows(transport)?;
        let invalid = |message: String| TransportError::InvalidArgument { transport, message };
        for (i, op) in self.ops.iter().enumerate() {
            let overflows = |offset: u64, stride: u64| {
                memory::rows_end(offset, stride, op.len, op.count).is_none()
            };
            if overflows(op.local_offset, op.local_stride)
                || overflows(op.remote_offset, op.remote_stride)
            {
                return Err(invalid(format!(
                    "op {i} ({} rows of {} bytes, strides {}/{}, offsets {}/{}) ends past the \
                     64-bit address space; fix the offsets, strides or row count",
                    op.count,
                    op.len,
                    op.local_stride,
                    op.remote_stride,
                    op.local_offset,
                    op.remote_offset
                )));
            }
        }
        let limit = max_rows.unwrap_or(MAX_EXPANDED_ROWS).min(MAX_EXPANDED_ROWS) as u64;
        let rows = self.row_count();
        if rows > limit {
            return Err(invalid(format!(
                "a batch of {} ops covers {rows} rows, more than the {limit} rows this transport \
                 moves in one batch without native strided support; post fewer rows per batch, \
                 or use a transport whose capabilities() declare strided_ops",
                self.ops.len()
            )));
        }
        let mut ops = Vec::with_capacity(rows as usize);
        for op in &self.ops {
            ops.extend(op.rows());
        }
        Ok(Self { ops, ..self })
    }
}

/// Most rows [`TransferBatch::expand_rows`] expands one batch into (16 Mi rows, 512 MiB of
/// descriptors): a bound on what a caller's strided batch can make a transport allocate.
pub const MAX_EXPANDED_ROWS: usize = 1 << 24;

/// What a transport can do. Callers and the conformance suite branch on these, never on names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Capabilities {
    /// [`Direction::Read`] batches are supported.
    pub reads: bool,
    /// Peers may live in another OS process.
    pub cross_process: bool,
    /// Largest number of descriptors in one batch, if limited. Must be at least 100,000 to pass
    /// the conformance suite's large-batch case unless declared smaller here.
    pub max_ops_per_batch: Option<usize>,
    /// Regions of [`MemoryKind::Device`] memory may be registered (host memory always may).
    pub device_memory: bool,
    /// Ops with several rows ([`TransferOp::with_rows`]) are moved natively, as one descriptor
    /// each. Without it the transport expands them ([`TransferBatch::expand_rows`]) and still
    /// accepts them.
    pub strided_ops: bool,
}

impl Capabilities {
    /// Capabilities with every optional feature off and no batch limit.
    pub const fn minimal() -> Self {
        Self {
            reads: false,
            cross_process: false,
            max_ops_per_batch: None,
            device_memory: false,
            strided_ops: false,
        }
    }

    /// Sets [`reads`](Self::reads).
    pub const fn with_reads(mut self, reads: bool) -> Self {
        self.reads = reads;
        self
    }

    /// Sets [`cross_process`](Self::cross_process).
    pub const fn with_cross_process(mut self, cross_process: bool) -> Self {
        self.cross_process = cross_process;
        self
    }

    /// Sets [`max_ops_per_batch`](Self::max_ops_per_batch).
    pub const fn with_max_ops_per_batch(mut self, max: Option<usize>) -> Self {
        self.max_ops_per_batch = max;
        self
    }

    /// Sets [`device_memory`](Self::device_memory).
    pub const fn with_device_memory(mut self, device_memory: bool) -> Self {
        self.device_memory = device_memory;
        self
    }

    /// Sets [`strided_ops`](Self::strided_ops).
    pub const fn with_strided_ops(mut self, strided_ops: bool) -> Self {
        self.strided_ops = strided_ops;
        self
    }

    /// Whether regions of this kind may be registered.
    pub fn accepts(&self, kind: MemoryKind) -> bool {
        match kind {
            MemoryKind::Host => true,
            MemoryKind::Device { .. } => self.device_memory,
            // A kind this crate does not know yet: not accepted until declared.
            _ => false,
        }
    }

    /// Refuses, with [`TransportError::Unsupported`], a region whose kind these capabilities do
    /// not accept: the first check of every [`KvTransport::register`].
    pub fn check_region(&self, transport: &'static str, region: &MemoryRegion) -> Result<()> {
        if self.accepts(region.kind()) {
            return Ok(());
        }
        Err(TransportError::Unsupported {
            transport,
            operation: "registering device memory (MemoryKind::Device)",
            remedy: "register host memory (its allocate(), or ForeignMemory::host), copy the \
                     bytes to host memory first, or use a transport whose capabilities() declare \
                     device_memory",
        })
    }
}

/// Where a batch is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BatchState {
    /// Posted, not finished.
    Pending,
    /// Every byte is visible in the peer's memory.
    Done,
    /// Failed; no byte of it lands later.
    Failed(String),
    /// Cancelled; no byte of it lands later.
    Cancelled,
    /// Deadline passed; no byte of it lands later.
    TimedOut,
}

impl BatchState {
    /// Whether the state is final.
    pub fn is_final(&self) -> bool {
        !matches!(self, BatchState::Pending)
    }
}

/// A notification received from a peer, after the data of its batch.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Notification {
    /// The peer (inbound connection) that sent it.
    pub from: PeerId,
    /// The payload given to [`TransferBatch::with_notification`].
    pub payload: Bytes,
}

impl Notification {
    /// A notification from `from` carrying `payload`.
    pub fn new(from: PeerId, payload: Bytes) -> Self {
        Self { from, payload }
    }
}

/// A transport that moves bytes between registered memory regions of two peers.
///
/// Use it as `Arc<dyn KvTransport>` ([`DynKvTransport`]); convenience methods live in
/// [`KvTransportExt`]. To wrap a transport and change part of it, implement [`Delegate`].
///
/// # Contract
///
/// Every implementation promises the following. The conformance suite
/// (the `kvbridge-conformance` crate) checks each point; every transport in
/// this workspace runs it, and so should yours (see `docs/transports.md`).
///
/// 1. **Bounds before bytes.** A batch in which any descriptor addresses bytes outside its
///    registered region (local or remote), or names an unknown or deregistered region, is
///    refused as a whole before any byte of it moves — its valid descriptors included. Bounds
///    are those of [`memory::checked_range`] ([`memory::checked_rows`] for every row of an op):
///    `offset + len <= region length` without overflow,
///    so a zero-length descriptor may sit at the very end of a region but not past it. Local
///    problems are refused by [`post`](Self::post) with [`TransportError::OutOfBounds`] /
///    [`TransportError::UnknownRegion`] (side [`Side::Local`]; an `offset + len` overflow may be
///    [`TransportError::InvalidArgument`]). Remote problems are refused by `post` when the
///    transport knows the peer's regions, otherwise the peer checks the whole batch on arrival
///    and `wait` reports the failure; either way nothing lands. A peer can never make a
///    transport write outside a region registered with it.
/// 2. **Every batch ends.** A posted batch reaches exactly one final state — done, failed,
///    cancelled or timed out — no later than its deadline (plus a small, bounded grace for the
///    transport to fence it). [`wait`](Self::wait) never hangs past that.
/// 3. **Fencing.** Once `wait`, `batch_state` or `cancel` has reported a batch failed,
///    cancelled or timed out, no byte of that batch lands in the destination memory later.
///    Bytes that landed before may stay (each destination byte holds its old or its new value).
///    The same holds for a region once `deregister` or `shutdown` has returned: no byte of any
///    batch lands in it afterwards — a peer's writes into it, and this side's own reads into
///    it (a read batch in flight into a region deregistered here fails, or has already
///    completed). A write batch already posted may still read its local source until it ends.
/// 4. **Notifications follow data.** A batch's notification is delivered to the peer only after
///    every byte of that batch is visible in the peer's memory, exactly once, and never for a
///    batch that did not complete (refused, failed, cancelled, timed out).
/// 5. **Peer loss is an error, not a hang.** When a peer dies, shuts down or is disconnected,
///    its pending batches fail (by their deadline at the latest) with
///    [`TransportError::PeerLost`] or [`TransportError::BatchFailed`]; later batches to it fail
///    and [`probe`](Self::probe) reports it.
/// 6. **Exact data.** When a batch is done, every destination byte equals its source byte, for
///    any mix of regions, offsets and lengths (zero included), and for batches of at least
///    100,000 descriptors unless [`Capabilities::max_ops_per_batch`] declares fewer (larger
///    batches are then refused at `post`). An empty batch completes (and notifies).
/// 7. **Ids.** `wait` returns a batch's final state exactly once; afterwards, and for ids never
///    handed out, `wait`, `cancel` and `batch_state` fail with [`TransportError::UnknownBatch`].
///    Until then `batch_state` reports the state and `cancel` of a finished batch returns its
///    final state. Batch ids are not reused. Unknown peers are refused with
///    [`TransportError::UnknownPeer`]; a descriptor that is not the transport's with
///    [`TransportError::BadDescriptor`].
/// 8. **Capabilities are declared.** Whatever [`Capabilities`] says is off (reads, batch sizes)
///    is refused at `post` with [`TransportError::Unsupported`] (or `InvalidArgument` for a
///    batch over the limit), never silently ignored; a region of a memory kind it does not
///    accept (device memory unless [`Capabilities::device_memory`]) is refused at `register`
///    with `Unsupported`.
/// 9. **Shutdown.** After [`shutdown`](Self::shutdown), `post`, `register`, `connect` and
///    `recv_notification` fail with [`TransportError::Closed`]; batches in flight still reach a
///    final state.
///
/// Destinations of one batch must not overlap (the caller's rule, as with RDMA); batches that
/// run concurrently must not write the same bytes either.
///
/// # Implementing it
///
/// Keep your batches in a [`batch::Batches`] table: it hands out the ids and carries the
/// lifecycle of points 2 (deadlines), 3 (the mover moves bytes only inside
/// [`Batches::step`](batch::Batches::step), which runs nothing once a batch is final), 4 (the
/// notification goes out in the step that declares the batch done), 5
/// ([`fail_where`](batch::Batches::fail_where) on peer loss) and 7 (`wait` exactly once,
/// unknown ids, `cancel` of a finished batch). `batch_state`, `wait` and `cancel` are then one
/// line each; see `examples/custom-transport` and `docs/transports.md`.
///
/// # Why `wait` takes a `BatchId`, not a handle
///
/// Point 7's "`wait` returns a final state exactly once" is checked at run time
/// ([`TransportError::UnknownBatch`]) rather than made a type (a handle owning the id, consumed
/// by `wait`), for three reasons. `cancel` and `batch_state` are called on a batch while another
/// task waits for it (an abort path cancels every batch in flight), so a copyable id exists
/// anyway and the transport must answer stale ids without harm. The trait is used as
/// `Arc<dyn KvTransport>` from `&self`, so a handle could neither borrow the transport across
/// tasks nor own it without `Arc<Self>`. And bindings that cross a language boundary (Python,
/// C engines) pass plain integers, for which only the run-time check exists. A typed handle can
/// be layered on [`KvTransportExt`] later without changing the trait.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait::async_trait]
pub trait KvTransport: Send + Sync + 'static {
    /// A short static name for logs and errors, e.g. `"tcp"`.
    fn name(&self) -> &'static str;

    /// What this transport supports.
    fn capabilities(&self) -> Capabilities;

    /// Allocates memory suited to this transport (e.g. shared memory a peer process can map).
    /// The default is an owned, page-aligned, pre-faulted heap region.
    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        MemoryRegion::allocate(len).map_err(|e| TransportError::InvalidArgument {
            transport: self.name(),
            message: e.to_string(),
        })
    }

    /// Registers a region so local batches may read or write it and peers may target it.
    /// The transport keeps the region alive until it is deregistered. A region whose
    /// [`kind`](MemoryRegion::kind) the [`Capabilities`] do not accept is refused with
    /// [`TransportError::Unsupported`] ([`Capabilities::check_region`]).
    async fn register(&self, region: MemoryRegion) -> Result<RegionId>;

    /// Deregisters a region. Batches posted later that name it — local ones, and peers' batches
    /// targeting it — are refused, and once this returns no byte lands in it any more.
    async fn deregister(&self, region: RegionId) -> Result<()>;

    /// The bytes a peer passes to [`connect`](Self::connect) to reach this transport.
    fn local_descriptor(&self) -> Bytes;

    /// Connects to the peer described by `descriptor` (its `local_descriptor()`).
    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId>;

    /// Disconnects a peer; its pending batches fail.
    async fn disconnect(&self, peer: PeerId) -> Result<()>;

    /// Posts a batch to a peer. Bounds are checked here, before any byte moves.
    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId>;

    /// Current state of a batch, without waiting.
    fn batch_state(&self, batch: BatchId) -> Result<BatchState>;

    /// Waits until the batch reaches a final state (by its deadline at the latest) and returns
    /// `Ok(())` when done, or the failure ([`TransportError::TimedOut`],
    /// [`TransportError::Cancelled`], [`TransportError::BatchFailed`], ...).
    async fn wait(&self, batch: BatchId) -> Result<()>;

    /// Cancels a batch and returns its final state once no byte of it can land any more:
    /// [`BatchState::Cancelled`], or the final state it already had (e.g. `Done`). `wait` then
    /// returns that state once.
    async fn cancel(&self, batch: BatchId) -> Result<BatchState>;

    /// Waits for the next notification from any peer.
    async fn recv_notification(&self) -> Result<Notification>;

    /// Checks within `timeout` that a peer is alive and answering.
    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()>;

    /// Stops the transport: every connection closes, pending batches fail, later calls return
    /// [`TransportError::Closed`].
    async fn shutdown(&self) -> Result<()>;
}

/// A trait object of any transport.
pub type DynKvTransport = dyn KvTransport;

#[async_trait::async_trait]
impl<T: KvTransport + ?Sized> KvTransport for Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        (**self).allocate(len)
    }
    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        (**self).register(region).await
    }
    async fn deregister(&self, region: RegionId) -> Result<()> {
        (**self).deregister(region).await
    }
    fn local_descriptor(&self) -> Bytes {
        (**self).local_descriptor()
    }
    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        (**self).connect(descriptor).await
    }
    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        (**self).disconnect(peer).await
    }
    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        (**self).post(peer, batch).await
    }
    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        (**self).batch_state(batch)
    }
    async fn wait(&self, batch: BatchId) -> Result<()> {
        (**self).wait(batch).await
    }
    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        (**self).cancel(batch).await
    }
    async fn recv_notification(&self) -> Result<Notification> {
        (**self).recv_notification().await
    }
    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        (**self).probe(peer, timeout).await
    }
    async fn shutdown(&self) -> Result<()> {
        (**self).shutdown().await
    }
}

/// Convenience built on [`KvTransport`]; implemented for every transport, never by hand.
#[async_trait::async_trait]
pub trait KvTransportExt: KvTransport {
    /// Posts a batch and waits for it.
    async fn transfer(&self, peer: PeerId, batch: TransferBatch) -> Result<()> {
        let id = self.post(peer, batch).await?;
        self.wait(id).await
    }

    /// Allocates and registers a region in one step.
    async fn allocate_registered(&self, len: usize) -> Result<(RegionId, MemoryRegion)> {
        let region = self.allocate(len)?;
        let id = self.register(region.clone()).await?;
        Ok((id, region))
    }
}

impl<T: KvTransport + ?Sized> KvTransportExt for T {}

#[cfg(test)]
mod tests {
    use super::*;

    fn strided(count: u64, ls: u64, rs: u64, len: u64) -> TransferOp {
        TransferOp::new(RegionId(1), 8, RegionId(2), 16, len).with_rows(count, ls, rs)
    }

    #[test]
    fn expanding_rows_gives_one_op_per_row_with_the_same_bytes() {
        let batch = TransferBatch::write(vec![
            strided(3, 40, 10, 10),
            TransferOp::new(RegionId(1), 0, RegionId(2), 500, 7),
            strided(0, 1, 1, 5),
        ]);
        assert_eq!(batch.row_count(), 4);
        assert_eq!(batch.total_bytes(), 37);
        let expanded = batch.clone().expand_rows("t", None).unwrap();
        let want: Vec<(u64, u64, u64)> = vec![(8, 16, 10), (48, 26, 10), (88, 36, 10), (0, 500, 7)];
        let got: Vec<_> = expanded
            .ops
            .iter()
            .map(|o| (o.local_offset, o.remote_offset, o.len))
            .collect();
        assert_eq!(got, want);
        assert!(expanded.ops.iter().all(TransferOp::is_contiguous));
        assert_eq!(expanded.total_bytes(), batch.total_bytes());
        // A batch without rows comes back unchanged.
        let plain = TransferBatch::write(vec![TransferOp::new(RegionId(1), 0, RegionId(2), 0, 3)]);
        assert_eq!(plain.clone().expand_rows("t", Some(1)).unwrap(), plain);
    }

    #[test]
    fn expansion_refuses_overlap_overflow_and_too_many_rows() {
        let e = TransferBatch::write(vec![strided(2, 64, 32, 64)])
            .expand_rows("t", None)
            .unwrap_err();
        assert!(e.to_string().contains("overlap on the destination"), "{e}");
        // The same op is fine as a read: the destination is the local side, stride 64.
        assert!(
            TransferBatch::read(vec![strided(2, 64, 32, 64)])
                .expand_rows("t", None)
                .is_ok()
        );
        let e = TransferBatch::write(vec![strided(3, u64::MAX / 2, 8, 8)])
            .expand_rows("t", None)
            .unwrap_err();
        assert!(e.to_string().contains("64-bit address space"), "{e}");
        let e = TransferBatch::write(vec![strided(1 << 40, 0, 0, 0)])
            .expand_rows("t", None)
            .unwrap_err();
        assert!(e.to_string().contains("rows"), "{e}");
        let e = TransferBatch::write(vec![strided(5, 8, 8, 8)])
            .expand_rows("t", Some(4))
            .unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    }

    #[tokio::test]
    async fn mock_is_usable_as_dyn_transport() {
        let mut mock = MockKvTransport::new();
        mock.expect_name().return_const("mock");
        mock.expect_post()
            .withf(|peer, batch| *peer == PeerId(3) && batch.ops.len() == 1)
            .returning(|_, _| Ok(BatchId(9)));
        mock.expect_wait()
            .withf(|b| *b == BatchId(9))
            .returning(|_| Ok(()));
        let transport: Arc<DynKvTransport> = Arc::new(mock);
        let op = TransferOp::new(RegionId(0), 0, RegionId(0), 0, 8);
        transport
            .transfer(PeerId(3), TransferBatch::write(vec![op]))
            .await
            .unwrap();
        assert_eq!(transport.name(), "mock");
    }

    #[test]
    fn batch_total_saturates() {
        let op = TransferOp::new(RegionId(0), 0, RegionId(0), 0, u64::MAX);
        assert_eq!(TransferBatch::write(vec![op, op]).total_bytes(), u64::MAX);
    }

    #[test]
    fn device_memory_is_refused_unless_declared() {
        let device = memory::placeholder_device_region(1, 64);
        let host = MemoryRegion::allocate(64).unwrap();
        let caps = Capabilities::minimal();
        assert!(caps.check_region("t", &host).is_ok());
        let err = caps.check_region("t", &device).unwrap_err();
        assert!(matches!(err, TransportError::Unsupported { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("t does not support registering device memory")
                && text.contains("declare device_memory"),
            "{text}"
        );
        let gpu = caps.with_device_memory(true);
        assert!(gpu.accepts(MemoryKind::Device { id: 1 }));
        assert!(gpu.check_region("t", &device).is_ok());
        assert!(gpu.check_region("t", &host).is_ok());
    }

    #[test]
    fn errors_name_values_and_remedy() {
        let e = TransportError::OutOfBounds {
            side: Side::Remote,
            region: RegionId(4),
            offset: 10,
            len: 20,
            region_len: 16,
        };
        let text = e.to_string();
        assert!(text.contains("remote region #4 is 16 bytes"), "{text}");
        assert!(text.contains("[10, 10+20)"), "{text}");
    }
}
