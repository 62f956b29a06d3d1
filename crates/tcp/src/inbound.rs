//! The receiving side: accept, authenticate, check descriptors, read payloads into regions.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvbridge_transport::batch::LocalIds;
use kvbridge_transport::memory::CLAIM_WAIT;
use kvbridge_transport::memory::checked_rows;
use kvbridge_transport::sync::{lock, read};
use kvbridge_transport::{MemoryError, MemoryRegion, Notification, PeerId, Result, TransportError};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::conn::{self, LinkError};
use crate::error::TcpError;
use crate::wire::{
    self, BeginStatus, CancelStatus, Frame, FrameType, RegionLen, RegionNeed, WireRows,
};
use crate::{BATCH_STATE_BYTES, NAME, Shared};

/// Bytes offered to one vectored read (between two checks that the batch is still live).
const READ_BYTES: u64 = 1 << 20;
/// Read-ahead of each connection: one read takes a small batch's frames whole (its `Begin`,
/// `Data` header and payload). Payload bytes wait here until their descriptors are checked;
/// larger reads bypass it.
const READ_AHEAD: usize = 16 << 10;
/// A connection's read half behind its read-ahead.
type Reader = tokio::io::BufReader<OwnedReadHalf>;
/// Descriptors offered to one vectored read.
const READ_SLICES: usize = 64;
/// Scratch buffer for draining the payload of a dropped batch.
const DRAIN_BUF: usize = 64 << 10;
/// Connections in the handshake at once; more wait in the kernel's backlog.
const MAX_HANDSHAKES: usize = 64;
/// `Pong`s remembered per session as epochs of `Begin` deadlines.
const EPOCHS: usize = 64;

/// Bytes an inbound peer is charged against `TcpConfig::max_inbound_pending_bytes` (its own
/// counter) and `TcpConfig::max_inbound_pending_bytes_total` (the listener's), released from
/// both when dropped: with its batch when the batch is forgotten, or with the batch's
/// notification once the application has taken it.
pub(crate) struct Charge {
    /// The peer's counter and the listener's.
    counters: [Arc<AtomicU64>; 2],
    bytes: u64,
}

impl Charge {
    /// Moves `bytes` of this charge (at most all of it) into a new one.
    fn split(&mut self, bytes: u64) -> Charge {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        Charge {
            counters: self.counters.clone(),
            bytes,
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        for counter in &self.counters {
            counter.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

/// Adds `charge` to `counter` unless that goes above `limit`: `Ok(after)`, or `Err(pending)`
/// with what it held.
fn add_within(counter: &AtomicU64, charge: u64, limit: u64) -> Result<u64, u64> {
    let mut pending = counter.load(Ordering::Acquire);
    loop {
        let after = pending.saturating_add(charge);
        if after > limit {
            return Err(pending);
        }
        match counter.compare_exchange_weak(pending, after, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok(after),
            Err(now) => pending = now,
        }
    }
}

/// An encoded control frame queued for a connection's writer, with the charge that covers it
/// while it waits (a `BeginAck` is as large as the region table of its `Begin`).
struct Outgoing {
    frame: Vec<u8>,
    _charge: Option<Charge>,
}

impl Outgoing {
    fn plain(frame: Vec<u8>) -> Self {
        Self {
            frame,
            _charge: None,
        }
    }
}

/// Per-batch state on the receiver, shared by the connections of one session.
struct RxBatch {
    total: u64,
    received: u64,
    /// Bytes of pieces being written right now.
    inflight: u64,
    notification: Option<Bytes>,
    /// What the batch is charged to its session (its `Begin` body and bookkeeping).
    charge: Charge,
    deadline: Instant,
    cancelled: bool,
    /// Refused at its `Begin` (sent without waiting for the answer): the data that follows is
    /// read and dropped until the sender's `Cancel` makes this side forget it.
    refused: bool,
    /// Pieces being written right now (a cancel is acknowledged only at zero).
    active: u32,
    cancels_seen: u16,
}

impl RxBatch {
    fn live(&self) -> bool {
        !self.cancelled && Instant::now() < self.deadline
    }
}

/// One inbound peer: the connections opened by one `connect` call of a remote transport.
pub(crate) struct Session {
    pub(crate) peer: PeerId,
    id: u64,
    conn_count: u16,
    /// Control queues of the connections, by index.
    ctrl: Mutex<Vec<Option<mpsc::Sender<Outgoing>>>>,
    batches: Mutex<HashMap<u64, RxBatch>>,
    writers_idle: Notify,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    pings: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    ping_seq: AtomicU64,
    idle: Duration,
    /// Bytes charged to this peer right now (see [`Charge`]).
    pending: Arc<AtomicU64>,
    /// When the earliest `Welcome` of the session was sent (epoch 0 of `Begin` deadlines).
    welcomed: Mutex<Instant>,
    /// Recent `Pong`s (nonce, when queued), the other epochs a `Begin` may name.
    epochs: Mutex<VecDeque<(u64, Instant)>>,
}

impl Session {
    pub(crate) fn abort_tasks(&self) {
        crate::abort_tasks(&self.tasks);
    }

    pub(crate) async fn join_tasks(&self) {
        crate::join_tasks(&self.tasks).await;
    }

    /// Closes every connection of the session and forgets it.
    pub(crate) async fn close(&self, shared: &Shared) {
        lock(&shared.sessions).remove(&self.id);
        self.join_tasks().await;
    }

    fn ctrl(&self, index: u16) -> Option<mpsc::Sender<Outgoing>> {
        lock(&self.ctrl).get(usize::from(index)).cloned().flatten()
    }

    pub(crate) async fn probe(&self, timeout: Duration) -> Result<()> {
        let lost = || TransportError::PeerLost {
            peer: self.peer,
            transport: NAME,
            reason: format!("no answer to a probe within {timeout:?}"),
        };
        let nonce = self.ping_seq.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pings).insert(nonce, tx);
        let Some(ctrl) = self.ctrl(0) else {
            return Err(lost());
        };
        let r = tokio::time::timeout(timeout, async {
            let ping = Outgoing::plain(Frame::Ping { nonce }.encode());
            ctrl.send(ping).await.ok()?;
            rx.await.ok()
        })
        .await;
        lock(&self.pings).remove(&nonce);
        match r {
            Ok(Some(())) => Ok(()),
            _ => Err(lost()),
        }
    }

    /// The instant a `Begin`'s deadline counts from: never later than the sender received the
    /// epoch's frame, so this side's deadline is never later than the sender's. An epoch not
    /// remembered (any more) counts from the session's first `Welcome`, which is earlier still.
    fn epoch(&self, epoch: u64) -> Instant {
        let welcomed = *lock(&self.welcomed);
        if epoch == 0 {
            return welcomed;
        }
        lock(&self.epochs)
            .iter()
            .find(|(n, _)| *n == epoch)
            .map_or(welcomed, |(_, at)| *at)
    }

    /// Records that a `Pong` with `nonce` is about to be sent (before it is, so the sender
    /// reads it later than this instant).
    fn record_pong(&self, nonce: u64) {
        if nonce == 0 {
            return;
        }
        let mut epochs = lock(&self.epochs);
        if epochs.len() == EPOCHS {
            epochs.pop_front();
        }
        epochs.push_back((nonce, Instant::now()));
    }

    /// Queues a region-table change for the peer (best effort: a peer that misses one still
    /// gets every write checked here, and learns the length from a refusal).
    fn announce(&self, entry: RegionLen) {
        if let Some(ctrl) = self.ctrl(0) {
            let frame = Frame::Regions {
                last: true,
                regions: vec![entry],
            };
            let _ = ctrl.try_send(Outgoing::plain(frame.encode()));
        }
    }

    fn lock_batches(&self) -> std::sync::MutexGuard<'_, HashMap<u64, RxBatch>> {
        lock(&self.batches)
    }

    fn batch_live(&self, batch: u64) -> bool {
        self.lock_batches().get(&batch).is_some_and(RxBatch::live)
    }

    pub(crate) fn pending_bytes(&self) -> u64 {
        self.pending.load(Ordering::Acquire)
    }

    /// Charges a `Begin` frame with a `body`-byte body to this peer and to the listener, or
    /// refuses it when the peer would go above `TcpConfig::max_inbound_pending_bytes` or all
    /// peers together above `TcpConfig::max_inbound_pending_bytes_total`.
    fn charge(&self, shared: &Shared, body: u32) -> Result<Charge, TcpError> {
        let charge = u64::from(body) + BATCH_STATE_BYTES;
        let limit = shared.config.max_inbound_pending_bytes;
        let after =
            add_within(&self.pending, charge, limit).map_err(|pending| TcpError::OverBudget {
                body,
                charge,
                pending,
                limit,
            })?;
        let total_limit = shared.config.max_inbound_pending_bytes_total;
        if let Err(pending) = add_within(&shared.pending_total, charge, total_limit) {
            self.pending.fetch_sub(charge, Ordering::AcqRel);
            return Err(TcpError::OverTotalBudget {
                body,
                charge,
                pending,
                limit: total_limit,
            });
        }
        shared.peak_pending.fetch_max(after, Ordering::AcqRel);
        Ok(Charge {
            counters: [self.pending.clone(), shared.pending_total.clone()],
            bytes: charge,
        })
    }
}

/// Tells every inbound peer that a region was registered (`len`) or deregistered (`None`).
/// Called with the region table's write lock held, so no connection admitted meanwhile misses
/// the change (it copies the table under the read lock).
pub(crate) fn announce(shared: &Shared, region: u64, len: Option<u64>) {
    let sessions: Vec<_> = lock(&shared.sessions).values().cloned().collect();
    for s in sessions {
        s.announce(RegionLen { region, len });
    }
}

/// The region table as `Regions` frames, the last one marked, for a connection's first bytes.
fn table_frames(table: &HashMap<u64, MemoryRegion, LocalIds>) -> Vec<u8> {
    let mut entries: Vec<RegionLen> = table
        .iter()
        .map(|(&region, r)| RegionLen {
            region,
            len: Some(r.len() as u64),
        })
        .collect();
    entries.sort_by_key(|e| e.region);
    let mut out = Vec::new();
    let mut chunks = entries.chunks(wire::REGIONS_PER_FRAME).peekable();
    if chunks.peek().is_none() {
        out.extend(
            Frame::Regions {
                last: true,
                regions: Vec::new(),
            }
            .encode(),
        );
    }
    while let Some(chunk) = chunks.next() {
        let frame = Frame::Regions {
            last: chunks.peek().is_none(),
            regions: chunk.to_vec(),
        };
        out.extend(frame.encode());
    }
    out
}

/// Accepts connections until the transport closes.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let connections = Arc::new(Semaphore::new(shared.config.max_inbound_connections));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = shared.wait_closed() => return,
        };
        let (stream, from) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = handshakes.clone().acquire_owned().await else {
            return;
        };
        let shared = shared.clone();
        let connections = connections.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = admit(shared, stream, connections).await {
                tracing::warn!(peer = %from, error = %e, "rejected an inbound connection");
            }
        });
    }
}

impl Session {
    /// A session as its first connection is admitted.
    fn new(peer: PeerId, id: u64, conn_count: u16, idle: Duration, welcomed: Instant) -> Self {
        Session {
            peer,
            id,
            conn_count,
            ctrl: Mutex::new(vec![None; usize::from(conn_count)]),
            batches: Mutex::new(HashMap::new()),
            writers_idle: Notify::new(),
            tasks: Mutex::new(Vec::new()),
            pings: Mutex::new(HashMap::new()),
            ping_seq: AtomicU64::new(1),
            idle,
            pending: Arc::new(AtomicU64::new(0)),
            welcomed: Mutex::new(welcomed),
            epochs: Mutex::new(VecDeque::new()),
        }
    }
}

/// Handshake, then joins (or starts) the connection's session and starts its tasks, which
/// hold one of the `connections` slots until the connection ends.
async fn admit(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    connections: Arc<Semaphore>,
) -> Result<(), LinkError> {
    let _ = stream.set_nodelay(true);
    let slot = connections.try_acquire_owned().ok();
    let refuse = slot.is_none().then(|| TcpError::Closing {
        reason: format!(
            "the listener has {} connections already (TcpConfig::max_inbound_connections); \
             retry once some have closed, or raise the limit",
            shared.config.max_inbound_connections
        ),
    });
    // One deadline for the whole handshake, so a slow peer cannot hold a handshake slot longer.
    let limit = shared.config.connect_timeout;
    let handshake = conn::server_handshake(&mut stream, &shared.config, refuse);
    let (hello, welcomed) = tokio::time::timeout(limit, handshake)
        .await
        .map_err(|_| LinkError::HandshakeDeadline(limit))??;
    // The handshake refuses the connection when there is no slot.
    let Some(slot) = slot else {
        return Err(LinkError::Eof);
    };
    let (r, mut w) = stream.into_split();
    // Follow a peer that pings less often than this side expects, but only up to 4 times this
    // side's own timeout: an idle connection never stays open longer than that.
    let own = shared.config.keepalive_timeout;
    let idle = Duration::from_millis(u64::from(hello.keepalive_ms))
        .saturating_mul(4)
        .clamp(own, own.saturating_mul(4));
    // The region table goes first on connection 0; copied under the table's read lock with
    // the connection joining its session, so each later change is announced to it.
    let mut table = Vec::new();
    let session = {
        let regions = read(&shared.regions);
        if hello.conn_index == 0 {
            table = table_frames(&regions);
        }
        let mut sessions = lock(&shared.sessions);
        let session = sessions
            .entry(hello.session)
            .or_insert_with(|| {
                let peer = shared.alloc_peer_id();
                Arc::new(Session::new(
                    peer,
                    hello.session,
                    hello.conn_count,
                    idle,
                    welcomed,
                ))
            })
            .clone();
        {
            let mut first = lock(&session.welcomed);
            *first = (*first).min(welcomed);
        }
        let mut ctrl = lock(&session.ctrl);
        let slot = ctrl.get_mut(usize::from(hello.conn_index));
        match slot {
            Some(slot @ None) if session.conn_count == hello.conn_count => {
                let (tx, rx) = mpsc::channel(conn::CTRL_QUEUE);
                *slot = Some(tx);
                drop(ctrl);
                drop(sessions);
                drop(regions);
                Ok((session, rx))
            }
            _ => Err(TcpError::UnexpectedFrame {
                got: "Hello",
                state: "the session already has this connection (or another connection count)",
            }),
        }
    };
    let (session, ctrl_rx) = match session {
        Ok(s) => s,
        Err(e) => {
            conn::send_error(&mut w, &e).await;
            return Err(e.into());
        }
    };
    tracing::debug!(peer = %session.peer, conn = hello.conn_index, "inbound connection admitted");
    let w = Arc::new(tokio::sync::Mutex::new(w));
    let writer = tokio::spawn(writer_loop(w.clone(), table, ctrl_rx, session.peer, idle));
    let reader = tokio::spawn(reader_task(
        shared.clone(),
        session.clone(),
        (r, w),
        (hello.conn_index, slot),
        writer,
    ));
    lock(&session.tasks).push(reader);
    Ok(())
}

/// Sends `first` (the region table, on connection 0), then the connection's control frames
/// until its queue closes; a peer that does not read for `idle` cannot keep the writer (and
/// its socket) alive.
async fn writer_loop(
    w: conn::SharedWriter,
    first: Vec<u8>,
    mut rx: mpsc::Receiver<Outgoing>,
    peer: PeerId,
    idle: Duration,
) {
    let first = Outgoing::plain(first);
    let mut next = Some(first).filter(|f| !f.frame.is_empty());
    loop {
        let out = match next.take() {
            Some(f) => f,
            None => match rx.recv().await {
                Some(f) => f,
                None => return,
            },
        };
        let mut w = w.lock().await;
        match tokio::time::timeout(idle, w.write_all(&out.frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "sending to an inbound peer failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, ?idle, "an inbound peer read nothing; stopped sending");
                return;
            }
        }
    }
}

/// Runs one connection's reader; when it ends, the whole session ends.
async fn reader_task(
    shared: Arc<Shared>,
    session: Arc<Session>,
    (r, w): (OwnedReadHalf, conn::SharedWriter),
    (index, _slot): (u16, OwnedSemaphorePermit),
    mut writer: JoinHandle<()>,
) {
    let mut rx = Receiver {
        shared: &shared,
        session: &session,
        index,
        writer: w,
        buf: Vec::new(),
        scratch: Vec::new(),
        bounce: Vec::new(),
        bounce_pending: 0..0,
        silence: conn::Silence::new(session.idle),
    };
    let mut r = Reader::with_capacity(READ_AHEAD, r);
    let Err(error) = rx.run(&mut r).await;
    drop(rx);
    let reason = error.to_string();
    let peer = session.peer;
    let pending = session.lock_batches().len();
    // Log why, and decide what to tell the peer before the socket closes.
    let tell = match &error {
        LinkError::Protocol(TcpError::Rejected { .. }) => {
            tracing::warn!(%peer, conn = index, %reason, pending, "inbound peer closed the connection with an error");
            None
        }
        LinkError::Protocol(e @ TcpError::Closing { .. }) => {
            tracing::warn!(%peer, conn = index, %reason, pending, "closing an inbound session");
            Some(e.clone())
        }
        LinkError::Protocol(e) => {
            tracing::warn!(%peer, conn = index, %reason, pending, "inbound peer broke the protocol; closing its session");
            Some(e.clone())
        }
        LinkError::Silent(d) => {
            tracing::warn!(%peer, conn = index, %reason, pending, "inbound peer went silent; closing its session");
            Some(TcpError::Closing {
                reason: format!(
                    "the listener heard nothing on connection {index} for {d:?} (its keep-alive \
                     timeout); the sender is stalled, or pings less often than the listener's \
                     TcpConfig::keepalive_timeout allows"
                ),
            })
        }
        LinkError::Io(_) | LinkError::HandshakeDeadline(_) => {
            tracing::warn!(%peer, conn = index, %reason, pending, "inbound connection failed; closing its session");
            None
        }
        LinkError::Eof => {
            tracing::debug!(%peer, conn = index, %reason, pending, "inbound connection ended");
            None
        }
    };
    // The error goes behind the control frames already queued; closing the queue ends the
    // writer once it is sent.
    if let Some(slot) = lock(&session.ctrl).get_mut(usize::from(index)) {
        if let (Some(tx), Some(e)) = (slot.take(), &tell) {
            let _ = tx.try_send(Outgoing::plain(conn::error_frame(e)));
        }
    }
    if tell.is_none()
        || tokio::time::timeout(conn::CLOSE_GRACE, &mut writer)
            .await
            .is_err()
    {
        writer.abort();
    }
    // One connection lost means the session is unusable: drop all of it.
    let removed = {
        let mut sessions = lock(&shared.sessions);
        match sessions.get(&session.id) {
            Some(s) if Arc::ptr_eq(s, &session) => sessions.remove(&session.id),
            _ => None,
        }
    };
    if removed.is_some() {
        // Tell the other connections of the session why they close too.
        let why = conn::error_frame(&TcpError::Closing {
            reason: format!(
                "connection {index} of this session ended ({reason}); a session lasts only as long \
                 as all its connections"
            ),
        });
        for slot in lock(&session.ctrl).iter_mut() {
            if let Some(tx) = slot.take() {
                let _ = tx.try_send(Outgoing::plain(why.clone()));
            }
        }
        session.abort_tasks();
    }
}

/// Clears a piece's `active` mark on every exit path.
struct ActiveGuard<'a> {
    session: &'a Session,
    batch: u64,
    bytes: u64,
    applied: bool,
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        let mut batches = self.session.lock_batches();
        // Only a cancel waits for the pieces of a batch, once it marked the batch cancelled
        // (or forgot it) under this lock.
        let cancel_waits = match batches.get_mut(&self.batch) {
            Some(b) => {
                b.active = b.active.saturating_sub(1);
                b.inflight = b.inflight.saturating_sub(self.bytes);
                if self.applied {
                    b.received += self.bytes;
                }
                b.cancelled
            }
            None => true,
        };
        drop(batches);
        if cancel_waits {
            self.session.writers_idle.notify_waiters();
        }
    }
}

/// What a `Begin` asks this side to keep, with its charge.
struct NewBatch {
    deadline: Instant,
    total: u64,
    notification: Option<Bytes>,
    charge: Charge,
    /// Answer even when accepted.
    ack: bool,
}

struct Receiver<'a> {
    shared: &'a Shared,
    session: &'a Session,
    index: u16,
    /// The connection's write half, for answers written without the writer task's hop.
    writer: conn::SharedWriter,
    buf: Vec<u8>,
    scratch: Vec<u8>,
    bounce: Vec<u8>,
    /// Bytes of `bounce` read from the socket but not yet placed (their destination was held).
    bounce_pending: std::ops::Range<usize>,
    /// The connection's keep-alive limit on reads.
    silence: conn::Silence,
}

impl Receiver<'_> {
    async fn send(&self, frame: Frame) -> Result<(), LinkError> {
        self.send_out(Outgoing::plain(frame.encode())).await
    }

    async fn send_out(&self, out: Outgoing) -> Result<(), LinkError> {
        let Some(ctrl) = self.session.ctrl(self.index) else {
            return Err(LinkError::Eof);
        };
        ctrl.send(out).await.map_err(|_| LinkError::Eof)
    }

    /// Sends `frame` at once from this task when nothing is queued before it (see
    /// [`conn::write_now`]), otherwise through the writer task.
    async fn send_now(&self, frame: Frame) -> Result<(), LinkError> {
        // Looked at in place: a clone of the queue's sender costs two atomic updates.
        let idle = match lock(&self.session.ctrl).get(usize::from(self.index)) {
            Some(Some(ctrl)) => ctrl.capacity() == ctrl.max_capacity(),
            _ => return Err(LinkError::Eof),
        };
        match conn::write_now(&self.writer, idle, frame.encode(), self.session.idle) {
            Ok(()) => Ok(()),
            Err(frame) => self.send_out(Outgoing::plain(frame)).await,
        }
    }

    /// Serves the connection until it fails; returns why.
    async fn run(&mut self, r: &mut Reader) -> Result<std::convert::Infallible, LinkError> {
        let max = self.shared.config.max_frame_len;
        let (shared, session) = (self.shared, self.session);
        loop {
            // A `Begin` is charged to the peer's budget before its body is read.
            let mut charge = None;
            let frame =
                conn::read_frame_checked(r, &mut self.buf, max, &mut self.silence, |ty, len| {
                    if ty == FrameType::Begin {
                        charge = Some(session.charge(shared, len)?);
                    }
                    Ok(())
                })
                .await?;
            match frame {
                Frame::Ping { nonce } => {
                    session.record_pong(nonce);
                    self.send(Frame::Pong { nonce }).await?
                }
                Frame::Pong { nonce } => {
                    if let Some(tx) = lock(&self.session.pings).remove(&nonce) {
                        let _ = tx.send(());
                    }
                }
                Frame::Begin {
                    batch,
                    epoch,
                    remaining_ms,
                    total_bytes,
                    regions,
                    notification,
                    ack,
                } => {
                    let charge = charge.ok_or(TcpError::UnexpectedFrame {
                        got: "Begin",
                        state: "no budget was charged for it",
                    })?;
                    let deadline = session
                        .epoch(epoch)
                        .checked_add(Duration::from_millis(remaining_ms))
                        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
                    let begin = NewBatch {
                        deadline,
                        total: total_bytes,
                        notification,
                        charge,
                        ack,
                    };
                    self.begin(batch, regions, begin).await?
                }
                Frame::Data { batch, ops } => {
                    let ops = ops.into_iter().map(WireRows::from).collect();
                    self.data(r, batch, ops).await?
                }
                Frame::Rows { batch, ops } => self.data(r, batch, ops).await?,
                Frame::Cancel { batch } => self.cancel(batch).await?,
                Frame::Error { code, message } => {
                    return Err(TcpError::Rejected { code, message }.into());
                }
                other => {
                    return Err(TcpError::UnexpectedFrame {
                        got: other.frame_type().name(),
                        state: "receiving batches",
                    }
                    .into());
                }
            }
        }
    }

    async fn begin(
        &mut self,
        batch: u64,
        needs: Vec<RegionNeed>,
        new: NewBatch,
    ) -> Result<(), LinkError> {
        let total = new.total;
        // The answer echoes the region table; part of the Begin's charge covers it until sent.
        let mut charge = new.charge;
        let ack_charge = charge.split((wire::HEADER_LEN + 13 + 16 * needs.len()) as u64);
        let mut lens = Vec::with_capacity(needs.len());
        let mut ok = true;
        {
            let regions = read(&self.shared.regions);
            for need in &needs {
                let len = regions.get(&need.region).map(|r| r.len() as u64);
                ok &= len.is_some_and(|l| need.end <= l);
                lens.push(RegionLen {
                    region: need.region,
                    len,
                });
            }
        }
        let status = {
            let mut batches = self.session.lock_batches();
            if batches.contains_key(&batch) {
                return Err(TcpError::UnexpectedFrame {
                    got: "Begin",
                    state: "that batch id is already in flight",
                }
                .into());
            }
            let status = if !ok {
                BeginStatus::RegionRefused
            } else if batches.len() >= self.shared.config.max_inbound_batches {
                BeginStatus::Busy
            } else {
                BeginStatus::Accepted
            };
            // A refused batch whose data follows unasked is kept (charged, as a tombstone) so
            // that data is dropped, until the sender's `Cancel`.
            if status == BeginStatus::Accepted || !new.ack {
                batches.insert(
                    batch,
                    RxBatch {
                        total,
                        received: 0,
                        inflight: 0,
                        notification: new.notification,
                        charge,
                        deadline: new.deadline,
                        cancelled: status != BeginStatus::Accepted,
                        refused: status != BeginStatus::Accepted,
                        active: 0,
                        cancels_seen: 0,
                    },
                );
            }
            status
        };
        if status != BeginStatus::Accepted || new.ack {
            let ack = Frame::BeginAck {
                batch,
                status,
                regions: lens,
            };
            self.send_out(Outgoing {
                frame: ack.encode(),
                _charge: Some(ack_charge),
            })
            .await?;
        }
        if status == BeginStatus::Accepted && total == 0 {
            self.maybe_complete(batch).await?;
        }
        Ok(())
    }

    /// Completes the batch if all its bytes are in: notification first, then `Done`.
    async fn maybe_complete(&mut self, batch: u64) -> Result<(), LinkError> {
        let done = {
            let mut batches = self.session.lock_batches();
            match batches.get(&batch) {
                Some(b) if !b.cancelled && b.active == 0 && b.received == b.total => {
                    batches.remove(&batch)
                }
                _ => None,
            }
        };
        let Some(b) = done else { return Ok(()) };
        if let Some(payload) = b.notification {
            let n = Notification::new(self.session.peer, payload);
            // The charge stays with the notification until the application takes it. A full
            // queue pauses this connection (the common case, room, needs no waiting).
            match self.shared.notify_tx.try_send((n, b.charge)) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => return Err(LinkError::Eof),
                Err(mpsc::error::TrySendError::Full(item)) => tokio::select! {
                    r = self.shared.notify_tx.send(item) => r.map_err(|_| LinkError::Eof)?,
                    () = self.shared.wait_closed() => return Err(LinkError::Eof),
                },
            }
        }
        self.send_now(Frame::Done { batch }).await
    }

    /// The regions a `Data` or `Rows` frame writes, each descriptor checked against its
    /// region (every row, the last row's end without overflow, no overlapping rows).
    fn data_targets(&self, batch: u64, ops: &[WireRows]) -> Result<Vec<MemoryRegion>, LinkError> {
        let mut targets: Vec<MemoryRegion> = Vec::with_capacity(ops.len());
        for op in ops {
            let Some(region) = self.shared.region(op.region) else {
                return Err(protocol(format!(
                    "{} frame for batch {batch} writes region #{} which is not registered here",
                    frame_name(op),
                    op.region
                )));
            };
            // All rows, whatever the count, and the last row's end without overflow.
            if let Err(e) = checked_rows(region.len(), op.offset, op.stride, op.len, op.rows) {
                return Err(protocol(format!(
                    "{} frame for batch {batch} writes region #{} ({} rows of {} bytes, stride \
                     {}): {e}",
                    frame_name(op),
                    op.region,
                    op.rows,
                    op.len,
                    op.stride
                )));
            }
            if op.rows > 1 && op.len > 0 && op.stride < op.len {
                return Err(protocol(format!(
                    "Rows frame for batch {batch} writes {} rows of {} bytes to region #{} with \
                     a stride of {}: the rows overlap",
                    op.rows, op.len, op.region, op.stride
                )));
            }
            targets.push(region);
        }
        Ok(targets)
    }

    /// A `Data` or `Rows` frame: every descriptor, each row of a strided one included, is
    /// checked before any payload byte is read.
    async fn data(
        &mut self,
        r: &mut Reader,
        batch: u64,
        ops: Vec<WireRows>,
    ) -> Result<(), LinkError> {
        // The decoder checked that the sum does not overflow.
        let sum = ops.iter().fold(0u64, |a, op| a.saturating_add(op.total()));
        if let Some(refused) = self.take_refused(batch, sum)? {
            return self.drain(r, refused).await;
        }
        let targets = self.data_targets(batch, &ops)?;
        let total = sum;
        let apply = {
            let mut batches = self.session.lock_batches();
            let Some(b) = batches.get_mut(&batch) else {
                return Err(protocol(format!(
                    "Data frame for batch {batch}, which was never begun on this connection's session"
                )));
            };
            let after = b
                .received
                .checked_add(b.inflight)
                .and_then(|v| v.checked_add(total));
            if after.is_none_or(|a| a > b.total) {
                return Err(protocol(format!(
                    "batch {batch} announced {} bytes but Data frames carry more",
                    b.total
                )));
            }
            let live = b.live();
            if live {
                b.active += 1;
                b.inflight += total;
            }
            live
        };
        if !apply {
            return self.drain(r, total).await;
        }
        let mut guard = ActiveGuard {
            session: self.session,
            batch,
            bytes: total,
            applied: false,
        };
        let mut left = total;
        let mut dropping = false;
        // Foreign memory (a mapping others may write) is never borrowed as a slice.
        let in_place =
            self.shared.config.receive_in_place && targets.iter().all(MemoryRegion::can_borrow);
        // Position: descriptor index and payload bytes of it already read.
        let mut at = Cursor { op: 0, done: 0 };
        // The batch was found live just now (`apply`): the first read needs no second look
        // unless it has to wait (a clock read is not free on every machine).
        let mut fresh = true;
        // Since when the next destination bytes are held by another access, if they are.
        let mut held_since: Option<Instant> = None;
        while left > 0 {
            let ahead = r.buffer().len();
            if ahead == 0 && self.bounce_pending.is_empty() {
                fresh = false;
                conn::readable_timed(r.get_ref(), &mut self.silence).await?;
            }
            if !std::mem::take(&mut fresh) && !self.session.batch_live(batch) {
                dropping = true;
                break;
            }
            let n = match self.read_step(r, &ops, &targets, at, left, in_place)? {
                Moved::Bytes(n) => {
                    held_since = None;
                    n
                }
                Moved::Held(e) => {
                    // Another access (another session's write of the same bytes, a local
                    // reader) holds them: wait on the runtime's timer, never on this worker
                    // thread, as long as a blocking claim would have.
                    let since = *held_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= CLAIM_WAIT {
                        return Err(busy(batch, ops[at.op].region, e));
                    }
                    tokio::time::sleep(CLAIM_RETRY).await;
                    continue;
                }
            };
            left -= n;
            at.advance(&ops, n);
        }
        if dropping {
            drop(guard);
            // Payload already read into the bounce buffer is not on the socket any more.
            let read = std::mem::replace(&mut self.bounce_pending, 0..0).len() as u64;
            return self.drain(r, left - read).await;
        }
        guard.applied = true;
        drop(guard);
        self.maybe_complete(batch).await
    }

    /// One read of a frame's payload into its destinations, the way the configuration and
    /// the memory allow; never waits for a claim.
    fn read_step(
        &mut self,
        r: &mut Reader,
        ops: &[WireRows],
        targets: &[MemoryRegion],
        at: Cursor,
        left: u64,
        in_place: bool,
    ) -> Result<Moved, LinkError> {
        let ahead = r.buffer().len();
        if ahead > 0 {
            // Read ahead with an earlier frame; its descriptors are checked now.
            let n = (ahead as u64).min(left) as usize;
            let moved = scatter(ops, targets, at, &r.buffer()[..n]);
            if let Moved::Bytes(k) = moved {
                r.consume(k as usize);
            }
            Ok(moved)
        } else if in_place {
            self.read_in_place(r.get_ref(), ops, targets, at)
        } else if self.shared.config.receive_in_place {
            read_raw(r.get_ref(), ops, targets, at)
        } else {
            self.read_through_bounce(r.get_ref(), ops, targets, at, left)
        }
    }

    /// For a batch refused at its `Begin`: counts `bytes` more against what it announced and
    /// returns them, to be dropped unread by any region. `None` for every other batch.
    fn take_refused(&self, batch: u64, bytes: u64) -> Result<Option<u64>, LinkError> {
        let mut batches = self.session.lock_batches();
        let Some(b) = batches.get_mut(&batch).filter(|b| b.refused) else {
            return Ok(None);
        };
        match b.received.checked_add(bytes).filter(|a| *a <= b.total) {
            Some(after) => {
                b.received = after;
                Ok(Some(bytes))
            }
            None => Err(protocol(format!(
                "batch {batch} announced {} bytes but Data frames carry more",
                b.total
            ))),
        }
    }

    /// One non-blocking vectored read straight into the next destination ranges (a strided
    /// op's rows one by one, adjacent rows as one range), each borrowed for the duration of
    /// the call only and never waited for.
    fn read_in_place(
        &self,
        r: &OwnedReadHalf,
        ops: &[WireRows],
        targets: &[MemoryRegion],
        at: Cursor,
    ) -> Result<Moved, LinkError> {
        let mut slices = Vec::new();
        let mut budget = READ_BYTES;
        let mut c = at;
        while budget > 0 && slices.len() < READ_SLICES {
            let Some((offset, rest)) = c.segment(ops) else {
                break;
            };
            let len = rest.min(budget);
            // Never a waiting borrow: overlapping descriptors of one frame would wait on this
            // read's own earlier slices, on the runtime's worker thread.
            match targets[c.op].try_borrow_mut(offset, len) {
                Ok(s) => slices.push(s),
                // Overlapping descriptors in one frame: read up to the overlap.
                Err(_) if !slices.is_empty() => break,
                Err(e) => return Ok(Moved::Held(e)),
            }
            budget -= len;
            c.done += len;
        }
        let mut bufs: Vec<std::io::IoSliceMut<'_>> = slices
            .iter_mut()
            .map(|s| std::io::IoSliceMut::new(s))
            .collect();
        match r.try_read_vectored(&mut bufs) {
            Ok(0) => Err(LinkError::Eof),
            Ok(n) => Ok(Moved::Bytes(n as u64)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(Moved::Bytes(0)),
            Err(e) => Err(LinkError::Io(e)),
        }
    }

    /// One non-blocking read into the connection's fixed bounce buffer, then copied into the
    /// destination ranges with `write_at` (`TcpConfig::receive_in_place = false`).
    fn read_through_bounce(
        &mut self,
        r: &OwnedReadHalf,
        ops: &[WireRows],
        targets: &[MemoryRegion],
        at: Cursor,
        left: u64,
    ) -> Result<Moved, LinkError> {
        if self.bounce.is_empty() {
            self.bounce = vec![0; READ_BYTES as usize];
        }
        // Bytes an earlier read could not place yet (their destination was held) go first.
        if self.bounce_pending.is_empty() {
            let want = left.min(READ_BYTES) as usize;
            let n = match r.try_read(&mut self.bounce[..want]) {
                Ok(0) => return Err(LinkError::Eof),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(Moved::Bytes(0)),
                Err(e) => return Err(LinkError::Io(e)),
            };
            self.bounce_pending = 0..n;
        }
        let pending = self.bounce_pending.clone();
        let moved = scatter(ops, targets, at, &self.bounce[pending.clone()]);
        if let Moved::Bytes(k) = moved {
            self.bounce_pending = pending.start + k as usize..pending.end;
        }
        Ok(moved)
    }

    /// Reads and discards `n` payload bytes of a dropped batch (fixed-size scratch buffer).
    async fn drain(&mut self, r: &mut Reader, mut n: u64) -> Result<(), LinkError> {
        if self.scratch.is_empty() {
            self.scratch = vec![0; DRAIN_BUF];
        }
        while n > 0 {
            let k = n.min(DRAIN_BUF as u64) as usize;
            conn::read_exact_timed(r, &mut self.scratch[..k], &mut self.silence).await?;
            n -= k as u64;
        }
        Ok(())
    }

    /// Marks the batch cancelled, waits until no piece of it is being written, acknowledges.
    async fn cancel(&mut self, batch: u64) -> Result<(), LinkError> {
        let give_up = Instant::now() + self.session.idle;
        let status = loop {
            let notified = self.session.writers_idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut batches = self.session.lock_batches();
                match batches.get_mut(&batch) {
                    None => break CancelStatus::NotPending,
                    Some(b) => {
                        b.cancelled = true;
                        if b.active == 0 {
                            b.cancels_seen += 1;
                            if b.cancels_seen >= self.session.conn_count {
                                batches.remove(&batch);
                            }
                            break CancelStatus::Dropped;
                        }
                    }
                }
            }
            if tokio::time::timeout_at(give_up, notified).await.is_err() {
                let active = self
                    .session
                    .lock_batches()
                    .get(&batch)
                    .map_or(0, |b| b.active);
                return Err(TcpError::Closing {
                    reason: format!(
                        "the Cancel of batch {batch} on connection {} waited {:?} for {active} \
                         piece(s) of it still being written on other connections of the session",
                        self.index, self.session.idle
                    ),
                }
                .into());
            }
        };
        self.send(Frame::CancelAck { batch, status }).await
    }
}

/// How far the payload of a frame has been read: descriptor `op`, `done` bytes of it.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    op: usize,
    done: u64,
}

impl Cursor {
    /// Where the payload goes on from here, as [`segment`] (past descriptors with no bytes
    /// left); `None` at the end of the frame's payload.
    fn segment(&mut self, ops: &[WireRows]) -> Option<(u64, u64)> {
        while self.op < ops.len() && self.done == ops[self.op].total() {
            self.op += 1;
            self.done = 0;
        }
        ops.get(self.op).map(|op| segment(op, self.done))
    }

    /// Moves `n` payload bytes on (over descriptors without bytes too).
    fn advance(&mut self, ops: &[WireRows], mut n: u64) {
        while n > 0 && self.op < ops.len() {
            let step = (ops[self.op].total() - self.done).min(n);
            self.done += step;
            n -= step;
            if self.done == ops[self.op].total() {
                self.op += 1;
                self.done = 0;
            }
        }
    }
}

/// The destination of `op`'s payload from byte `done` on: `(offset, bytes)` up to the end of
/// the row, or of the op when its rows are adjacent. In bounds: `checked_rows` passed.
fn segment(op: &WireRows, done: u64) -> (u64, u64) {
    if op.is_contiguous() {
        return (op.offset + done, op.total() - done);
    }
    let (row, pos) = (done / op.len, done % op.len);
    (op.offset + row * op.stride + pos, op.len - pos)
}

/// The frame type a descriptor came in, for errors.
fn frame_name(op: &WireRows) -> &'static str {
    if op.rows == 1 && op.stride == op.len {
        "Data"
    } else {
        "Rows"
    }
}

/// One non-blocking vectored read straight into the next destination ranges of regions that
/// cannot be borrowed (foreign memory): the kernel writes the claimed raw memory, nothing is
/// copied and no slice of it is made.
fn read_raw(
    r: &OwnedReadHalf,
    ops: &[WireRows],
    targets: &[MemoryRegion],
    at: Cursor,
) -> Result<Moved, LinkError> {
    use std::os::fd::AsFd;
    let mut ranges = Vec::new();
    let mut budget = READ_BYTES;
    let mut c = at;
    while budget > 0 && ranges.len() < READ_SLICES {
        let Some((offset, rest)) = c.segment(ops) else {
            break;
        };
        let len = rest.min(budget);
        ranges.push((&targets[c.op], offset, len));
        budget -= len;
        c.done += len;
    }
    let stream: &tokio::net::TcpStream = r.as_ref();
    match stream.try_io(tokio::io::Interest::READABLE, || {
        kvbridge_transport::memory::recv_vectored(stream.as_fd(), &ranges)
    }) {
        Ok(0) => Err(LinkError::Eof),
        Ok(n) => Ok(Moved::Bytes(n as u64)),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(Moved::Bytes(0)),
        Err(e) => match e.downcast::<MemoryError>() {
            Ok(t) => Ok(Moved::Held(t)),
            Err(e) => Err(LinkError::Io(e)),
        },
    }
}

/// Copies `bytes`, the payload from `at` on, into the destination ranges with `try_write_at`,
/// up to the first range another access holds; [`Moved::Held`] when that is the first.
fn scatter(ops: &[WireRows], targets: &[MemoryRegion], at: Cursor, bytes: &[u8]) -> Moved {
    let (mut c, mut done) = (at, 0usize);
    while done < bytes.len() {
        // `bytes` never runs past the frame's payload (the caller counts what is left).
        let Some((offset, rest)) = c.segment(ops) else {
            break;
        };
        let step = (rest as usize).min(bytes.len() - done);
        match targets[c.op].try_write_at(offset, &bytes[done..done + step]) {
            Ok(()) => {}
            Err(e) if done == 0 => return Moved::Held(e),
            Err(_) => break,
        }
        done += step;
        c.done += step as u64;
    }
    Moved::Bytes(done as u64)
}

/// What one read into a frame's destinations did.
enum Moved {
    /// Payload bytes placed (0: the socket had none yet).
    Bytes(u64),
    /// None: another access holds the next destination bytes (the refusal says which).
    Held(MemoryError),
}

/// How often a read whose destination is held looks again (within [`CLAIM_WAIT`]).
const CLAIM_RETRY: std::time::Duration = std::time::Duration::from_millis(1);

fn busy(batch: u64, region: u64, e: MemoryError) -> LinkError {
    protocol(format!("batch {batch} cannot write region #{region}: {e}"))
}

fn protocol(message: String) -> LinkError {
    LinkError::Protocol(TcpError::BadWrite { message })
}
