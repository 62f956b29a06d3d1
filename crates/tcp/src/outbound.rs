//! The sending side: connect, post, stream pieces, fence.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvbridge_transport::memory::{checked_rows, rows_end};
use kvbridge_transport::sync::{lock, read};
use kvbridge_transport::{
    BatchId, MemoryRegion, PeerId, RegionId, RegionSlice, Result, Side, TransferBatch, TransferOp,
    TransportError,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::auth::HelloFields;
use crate::batch::{Refusal, TxBatch};
use crate::conn::{self, LinkError};
use crate::error::TcpError;
use crate::wire::{
    self, BeginStatus, CancelStatus, Frame, RegionLen, RegionNeed, WireOp, WireRows,
};
use crate::{NAME, Shared};
use kvbridge_transport::batch::{Fence, Outcome};

/// Descriptors in one `Data` frame (one `writev` carries the header and all their payloads,
/// and stays below the kernel's 1024-iovec limit).
const MAX_OPS_PER_FRAME: usize = 512;

/// Batches of at most this many payload bytes go out at once with their `Begin`, copied into
/// one frame on connection 0, without waiting for the receiver's answer.
const INLINE_BYTES: u64 = 64 << 10;

/// Read-ahead of a connection's reader (it reads control frames only).
const READ_AHEAD: usize = 4 << 10;

/// Entries of a peer's region table kept at most (16 bytes each on the wire), so a listener
/// cannot make this side hold more by announcing regions without end.
const MAX_REMOTE_REGIONS: usize = 1 << 18;

/// Iovecs offered to one vectored write at most (the kernel's limit is 1024).
const MAX_IOVECS: usize = 1024;

/// One descriptor with its local region resolved: `count` rows of `len` bytes (1 for a
/// contiguous op), `local_stride` / `remote_stride` apart. `post` checked every row's bounds
/// on this side (and, where known, on the peer's), so no offset computed here overflows.
struct LocalOp {
    region: MemoryRegion,
    local_offset: u64,
    remote_region: u64,
    remote_offset: u64,
    len: u64,
    count: u64,
    local_stride: u64,
    remote_stride: u64,
}

impl LocalOp {
    /// Payload bytes of all rows (`post` checked that this does not overflow).
    fn total(&self) -> u64 {
        self.len * self.count
    }

    /// The descriptor as the receiver sees it, in a `Rows` frame.
    fn wire(&self) -> WireRows {
        WireRows {
            region: self.remote_region,
            offset: self.remote_offset,
            len: self.len,
            rows: self.count,
            stride: self.remote_stride,
        }
    }

    /// The descriptor of a one-row op, in a `Data` frame.
    fn wire_op(&self) -> WireOp {
        WireOp {
            region: self.remote_region,
            offset: self.remote_offset,
            len: self.total(),
        }
    }

    /// Rows `first..first + n` of this op.
    fn rows(&self, first: u64, n: u64) -> LocalOp {
        LocalOp {
            region: self.region.clone(),
            local_offset: self.local_offset + first * self.local_stride,
            remote_region: self.remote_region,
            remote_offset: self.remote_offset + first * self.remote_stride,
            len: self.len,
            count: n,
            local_stride: self.local_stride,
            remote_stride: self.remote_stride,
        }
    }

    /// Bytes `from..from + n` of row `row`, as a one-row op.
    fn part_of_row(&self, row: u64, from: u64, n: u64) -> LocalOp {
        LocalOp {
            region: self.region.clone(),
            local_offset: self.local_offset + row * self.local_stride + from,
            remote_region: self.remote_region,
            remote_offset: self.remote_offset + row * self.remote_stride + from,
            len: n,
            count: 1,
            local_stride: n,
            remote_stride: n,
        }
    }

    /// Whether this op's bytes are gathered into the writer's staging buffer rather than
    /// handed to the kernel in place: its local ranges (rows, or the whole op) are shorter
    /// than [`STAGE_BELOW`], so an iovec each would cost more than a copy.
    fn staged(&self) -> bool {
        let range = if self.locally_contiguous() {
            self.total()
        } else {
            self.len
        };
        range < STAGE_BELOW && self.region.can_borrow()
    }

    /// Whether the rows are adjacent in the local region (one range), or there is one.
    fn locally_contiguous(&self) -> bool {
        self.count <= 1 || self.local_stride == self.len
    }

    /// The local ranges `(offset, len)` holding bytes `from..to` of the op's payload (its
    /// rows in order): one range when the rows are adjacent, otherwise one per row touched.
    fn local_parts(&self, from: u64, to: u64) -> LocalParts {
        LocalParts {
            offset: self.local_offset,
            len: self.len,
            stride: if self.locally_contiguous() {
                None
            } else {
                Some(self.local_stride)
            },
            from,
            to,
        }
    }

    /// Where an attempt that starts at payload byte `from` of this op ends: at most `budget`
    /// bytes and (rows being one iovec each) `iovecs` rows on.
    fn attempt_end(&self, from: u64, budget: u64, iovecs: usize) -> u64 {
        let mut to = self.total().min(from + budget);
        if !self.locally_contiguous() {
            let first_row = from / self.len;
            to = to.min((first_row + iovecs as u64).saturating_mul(self.len));
        }
        to
    }
}

/// Iterator of [`LocalOp::local_parts`].
struct LocalParts {
    offset: u64,
    len: u64,
    /// `None`: the rows are adjacent.
    stride: Option<u64>,
    from: u64,
    to: u64,
}

impl Iterator for LocalParts {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        if self.from >= self.to {
            return None;
        }
        let Some(stride) = self.stride else {
            let part = (self.offset + self.from, self.to - self.from);
            self.from = self.to;
            return Some(part);
        };
        let (row, pos) = (self.from / self.len, self.from % self.len);
        let n = (self.len - pos).min(self.to - self.from);
        self.from += n;
        Some((self.offset + row * stride + pos, n))
    }
}

/// The frame header of `ops` for batch `batch`: `Data` when every op is one row, `Rows`
/// otherwise.
fn encode_ops_header(batch: u64, ops: &[LocalOp]) -> Vec<u8> {
    if ops.iter().all(|op| op.count <= 1) {
        let wire: Vec<WireOp> = ops.iter().map(LocalOp::wire_op).collect();
        wire::encode_data_header(batch, &wire)
    } else {
        let wire: Vec<WireRows> = ops.iter().map(LocalOp::wire).collect();
        wire::encode_rows_header(batch, &wire)
    }
}

/// A posted batch's descriptors and how far the writers got: op `next`, its row `row`, and
/// `in_row` bytes into that row (a row longer than a piece is cut).
struct Job {
    batch: Arc<TxBatch>,
    ops: Vec<LocalOp>,
    next: usize,
    row: u64,
    in_row: u64,
}

impl Job {
    /// Payload bytes of the job not yet handed to a writer.
    #[cfg(test)]
    fn left(&self) -> u64 {
        let rest: u64 = self.ops[self.next..].iter().map(LocalOp::total).sum();
        let done = self
            .ops
            .get(self.next)
            .map_or(0, |op| self.row * op.len + self.in_row);
        rest - done
    }
}

/// A slice of a job, written by one connection as one `Data` or `Rows` frame.
struct Piece {
    batch: Sending,
    ops: Vec<LocalOp>,
}

/// Marks a batch as having a piece in a writer's hands until dropped (also when the writer
/// task is aborted mid-write), so `Done` is reported only once its sources are released.
struct Sending(Arc<TxBatch>);

impl Drop for Sending {
    fn drop(&mut self) {
        self.0.piece_finished();
    }
}

struct CancelWait {
    remaining: usize,
    not_pending: bool,
    tx: Option<oneshot::Sender<bool>>,
}

#[derive(Default)]
struct Waiters {
    begin: HashMap<u64, oneshot::Sender<Frame>>,
    cancel: HashMap<u64, CancelWait>,
    ping: HashMap<u64, oneshot::Sender<()>>,
}

/// An outbound peer: the connections one `connect` opened.
pub(crate) struct OutPeer {
    pub(crate) id: PeerId,
    addr: SocketAddr,
    ctrl: Vec<mpsc::Sender<Vec<u8>>>,
    /// The connections' write halves, held by their writer tasks (so the sockets close with
    /// them) and borrowed for frames written without the writer task's hop.
    writers: Vec<std::sync::Weak<tokio::sync::Mutex<OwnedWriteHalf>>>,
    queue: Mutex<VecDeque<Job>>,
    work: Notify,
    waiters: Mutex<Waiters>,
    lost: AtomicBool,
    lost_reason: Mutex<Option<String>>,
    /// Notified once the peer is declared lost.
    lost_signal: Notify,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    ping_seq: AtomicU64,
    /// The peer's region table (id → length), as announced: a cache that lets `post` refuse
    /// what is certainly out of bounds. The receiver checks every write anyway.
    remote: Mutex<HashMap<u64, u64>>,
    /// The latest epoch for `Begin` deadlines: (0 for the `Welcome` or a `Pong`'s nonce, when
    /// this side read it).
    epoch: Mutex<(u64, Instant)>,
}

impl OutPeer {
    /// Applies announced (or answered) region lengths to the cached table.
    fn learn(&self, entries: &[RegionLen]) {
        let mut remote = lock(&self.remote);
        for e in entries {
            match e.len {
                // A full table stops learning: a region it lacks is left to the listener.
                Some(len)
                    if remote.len() < MAX_REMOTE_REGIONS || remote.contains_key(&e.region) =>
                {
                    remote.insert(e.region, len);
                }
                Some(_) => {}
                None => {
                    remote.remove(&e.region);
                }
            }
        }
    }

    fn lost_error(&self) -> TransportError {
        TransportError::PeerLost {
            peer: self.id,
            transport: NAME,
            reason: lock(&self.lost_reason)
                .clone()
                .unwrap_or_else(|| "the connection is closed".into()),
        }
    }

    pub(crate) fn abort_tasks(&self) {
        crate::abort_tasks(&self.tasks);
    }

    pub(crate) async fn join_tasks(&self) {
        crate::join_tasks(&self.tasks).await;
    }

    /// Declares the peer lost: stops its tasks and fails its pending batches. When the peer
    /// itself closed the link (`remote_closed`), it applies nothing more and batches fail at
    /// once; when this side gave up on it, a batch fails once the receiver's own deadline for
    /// it has passed, so no byte of it can land after the failure is reported.
    fn lose(self: &Arc<Self>, shared: &Arc<Shared>, reason: String, remote_closed: bool) {
        if self.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(peer = %self.id, addr = %self.addr, %reason, "lost peer");
        *lock(&self.lost_reason) = Some(reason.clone());
        self.lost_signal.notify_waiters();
        // The peer stays known (posts and probes report it lost, with the reason) until
        // `disconnect` forgets it.
        lock(&self.queue).clear();
        {
            let mut w = lock(&self.waiters);
            w.begin.clear();
            w.cancel.clear();
            w.ping.clear();
        }
        self.abort_tasks();
        let pending: Vec<_> = lock(&shared.batches)
            .values()
            .filter(|b| b.peer == self.id && !shared.is_final(b))
            .cloned()
            .collect();
        for b in pending {
            b.stop();
            let outcome = b.lost(reason.clone());
            match b.anchor().filter(|a| !remote_closed && *a > Instant::now()) {
                None => {
                    shared.finish(&b, outcome);
                }
                Some(anchor) => {
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep_until(anchor).await;
                        shared.finish(&b, outcome);
                    });
                }
            }
        }
    }

    /// Fences every pending batch, then closes the connections.
    pub(crate) async fn close(self: &Arc<Self>, shared: &Arc<Shared>, reason: &str) {
        let pending: Vec<_> = lock(&shared.batches)
            .values()
            .filter(|b| b.peer == self.id && !shared.is_final(b))
            .cloned()
            .collect();
        let mut fences = Vec::new();
        for b in pending {
            let shared = shared.clone();
            let peer = self.clone();
            let outcome = b.failed(reason.to_owned());
            fences.push(tokio::spawn(async move {
                fence_on(&shared, Some(peer), &b, outcome).await;
            }));
        }
        for f in fences {
            let _ = f.await;
        }
        self.lose(shared, reason.to_owned(), true);
        self.join_tasks().await;
    }

    pub(crate) async fn probe(&self, timeout: Duration) -> Result<()> {
        if self.lost.load(Ordering::Acquire) {
            return Err(self.lost_error());
        }
        let nonce = self.ping_seq.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.waiters).ping.insert(nonce, tx);
        let r = tokio::time::timeout(timeout, async {
            self.ctrl[0]
                .send(Frame::Ping { nonce }.encode())
                .await
                .ok()?;
            rx.await.ok()
        })
        .await;
        lock(&self.waiters).ping.remove(&nonce);
        match r {
            Ok(Some(())) => Ok(()),
            _ if self.lost.load(Ordering::Acquire) => Err(self.lost_error()),
            _ => Err(TransportError::PeerLost {
                peer: self.id,
                transport: NAME,
                reason: format!("no answer to a probe within {timeout:?}"),
            }),
        }
    }

    /// Takes the next piece to send: at most `piece_bytes` of payload and
    /// [`MAX_OPS_PER_FRAME`] descriptors of the oldest unfinished batch. A strided op is cut
    /// between rows (each part one descriptor); a row longer than what is left of a piece goes
    /// whole into the next one, and one longer than a whole piece is cut like a contiguous op.
    fn take_piece(&self, piece_bytes: u64) -> Option<Piece> {
        let mut q = lock(&self.queue);
        loop {
            let job = q.front_mut()?;
            if job.batch.stopped() {
                q.pop_front();
                continue;
            }
            let mut ops = Vec::new();
            let mut bytes = 0u64;
            while job.next < job.ops.len() && ops.len() < MAX_OPS_PER_FRAME && bytes < piece_bytes {
                let op = &job.ops[job.next];
                let budget = piece_bytes - bytes;
                if op.total() == 0 {
                    job.next += 1;
                    continue;
                }
                if job.in_row == 0 && op.len <= budget {
                    let n = (op.count - job.row).min(budget / op.len);
                    ops.push(op.rows(job.row, n));
                    bytes += n * op.len;
                    job.row += n;
                } else if job.in_row == 0 && op.count > 1 && op.len <= piece_bytes {
                    break;
                } else {
                    let n = (op.len - job.in_row).min(budget);
                    ops.push(op.part_of_row(job.row, job.in_row, n));
                    bytes += n;
                    job.in_row += n;
                    if job.in_row == op.len {
                        job.row += 1;
                        job.in_row = 0;
                    }
                }
                if job.row == op.count {
                    job.next += 1;
                    job.row = 0;
                }
            }
            let batch = job.batch.clone();
            if job.next >= job.ops.len() {
                q.pop_front();
            }
            if !ops.is_empty() {
                batch.piece_started();
                return Some(Piece {
                    batch: Sending(batch),
                    ops,
                });
            }
        }
    }
}

fn link_to_transport(addr: SocketAddr, e: LinkError) -> TransportError {
    match e {
        LinkError::Protocol(e) => e.into(),
        LinkError::Io(source) => TransportError::Io {
            transport: NAME,
            context: format!("connecting to {addr}"),
            source,
        },
        LinkError::Eof => TransportError::Io {
            transport: NAME,
            context: format!(
                "connecting to {addr}: the listener closed the connection during the handshake \
                 (it may require a secret, or speak another protocol)"
            ),
            source: std::io::ErrorKind::ConnectionAborted.into(),
        },
        LinkError::Silent(d) | LinkError::HandshakeDeadline(d) => TransportError::Io {
            transport: NAME,
            context: format!("connecting to {addr}: no handshake answer within {d:?}"),
            source: std::io::ErrorKind::TimedOut.into(),
        },
    }
}

/// Opens the connections to a peer and starts their tasks.
pub(crate) async fn connect(shared: &Arc<Shared>, addr: SocketAddr) -> Result<Arc<OutPeer>> {
    let cfg = &shared.config;
    let count = cfg.connections_per_peer as u16;
    let session = kvbridge_auth::random_u64();
    let keepalive_ms = u32::try_from(cfg.keepalive_interval.as_millis()).unwrap_or(u32::MAX);
    let mut streams = Vec::with_capacity(usize::from(count));
    let mut welcomed = Instant::now();
    let mut table = Vec::new();
    for index in 0..count {
        let hello = HelloFields {
            session,
            conn_index: index,
            conn_count: count,
            keepalive_ms,
        };
        let attempt = tokio::time::timeout(cfg.connect_timeout, async {
            let mut s = TcpStream::connect(addr).await.map_err(LinkError::Io)?;
            let _ = s.set_nodelay(true);
            let at = conn::client_handshake(&mut s, cfg, hello).await?;
            if index == 0 {
                welcomed = at;
                table = read_table(&mut s, cfg).await?;
            }
            Ok::<_, LinkError>(s)
        })
        .await;
        match attempt {
            Ok(Ok(s)) => streams.push(s),
            Ok(Err(e)) => return Err(link_to_transport(addr, e)),
            Err(_) => {
                return Err(link_to_transport(
                    addr,
                    LinkError::Silent(cfg.connect_timeout),
                ));
            }
        }
    }
    let mut ctrl = Vec::new();
    let mut writers = Vec::new();
    let mut halves = Vec::new();
    for s in streams {
        let (tx, rx) = mpsc::channel(conn::CTRL_QUEUE);
        ctrl.push(tx);
        let (r, w) = s.into_split();
        let w = Arc::new(tokio::sync::Mutex::new(w));
        writers.push(Arc::downgrade(&w));
        halves.push(((r, w), rx));
    }
    let peer = Arc::new(OutPeer {
        id: shared.alloc_peer_id(),
        addr,
        ctrl,
        writers,
        queue: Mutex::new(VecDeque::new()),
        work: Notify::new(),
        waiters: Mutex::new(Waiters::default()),
        lost: AtomicBool::new(false),
        lost_reason: Mutex::new(None),
        lost_signal: Notify::new(),
        tasks: Mutex::new(Vec::new()),
        ping_seq: AtomicU64::new(1),
        remote: Mutex::new(HashMap::new()),
        epoch: Mutex::new((0, welcomed)),
    });
    peer.learn(&table);
    {
        let mut tasks = lock(&peer.tasks);
        for (index, ((r, w), rx)) in halves.into_iter().enumerate() {
            tasks.push(tokio::spawn(writer_task(
                shared.clone(),
                peer.clone(),
                w,
                rx,
            )));
            tasks.push(tokio::spawn(reader_task(
                shared.clone(),
                peer.clone(),
                r,
                index,
            )));
        }
        tasks.push(tokio::spawn(keepalive_task(
            peer.clone(),
            cfg.keepalive_interval,
        )));
    }
    lock(&shared.out_peers).insert(peer.id.0, peer.clone());
    if shared.is_closed() {
        peer.lose(shared, "the transport was shut down".into(), true);
        return Err(shared.closed_err());
    }
    tracing::debug!(peer = %peer.id, %addr, connections = count, "connected");
    Ok(peer)
}

/// Reads the listener's region table, sent after its `Welcome` on connection 0.
async fn read_table(
    s: &mut TcpStream,
    cfg: &crate::TcpConfig,
) -> Result<Vec<RegionLen>, LinkError> {
    let mut buf = Vec::new();
    let mut table = Vec::new();
    let mut silence = conn::Silence::new(cfg.connect_timeout);
    loop {
        match conn::read_frame(s, &mut buf, cfg.max_frame_len, &mut silence).await? {
            Frame::Regions { last, regions } => {
                let room = MAX_REMOTE_REGIONS.saturating_sub(table.len());
                table.extend(regions.into_iter().take(room));
                if last {
                    return Ok(table);
                }
            }
            Frame::Error { code, message } => {
                return Err(TcpError::Rejected { code, message }.into());
            }
            other => {
                return Err(TcpError::UnexpectedFrame {
                    got: other.frame_type().name(),
                    state: "waiting for the region table",
                }
                .into());
            }
        }
    }
}

async fn keepalive_task(peer: Arc<OutPeer>, interval: Duration) {
    let ping = Frame::Ping { nonce: 0 }.encode();
    loop {
        tokio::time::sleep(interval).await;
        // Connection 0's pings carry fresh nonces: each answer is a new epoch for deadlines.
        let nonce = peer.ping_seq.fetch_add(1, Ordering::Relaxed);
        let _ = peer.ctrl[0].try_send(Frame::Ping { nonce }.encode());
        for c in &peer.ctrl[1..] {
            // A full queue already keeps the link busy; the reader's timeout does the detecting.
            let _ = c.try_send(ping.clone());
        }
    }
}

/// Ends the peer after a failed read on connection `index`; a listener that only went silent
/// is told why first.
async fn lose_on_read_error(shared: &Arc<Shared>, peer: &Arc<OutPeer>, index: usize, e: LinkError) {
    let remote_closed = !matches!(e, LinkError::Silent(_));
    if let LinkError::Silent(d) = e {
        // This side gives up on a listener that may only be slow: tell it why.
        let why = TcpError::Closing {
            reason: format!(
                "the sender heard nothing on connection {index} for {d:?} (its \
                 keep-alive timeout); the listener is stalled or overloaded"
            ),
        };
        if peer.ctrl[index].try_send(conn::error_frame(&why)).is_ok() {
            tokio::time::sleep(conn::CLOSE_GRACE).await;
        }
    }
    peer.lose(shared, e.to_string(), remote_closed);
}

async fn reader_task(shared: Arc<Shared>, peer: Arc<OutPeer>, r: OwnedReadHalf, index: usize) {
    // Only control frames arrive here: one read takes a `Done` (or several) whole.
    let mut r = tokio::io::BufReader::with_capacity(READ_AHEAD, r);
    let mut buf = Vec::new();
    let max = shared.config.max_frame_len;
    let mut silence = conn::Silence::new(shared.config.keepalive_timeout);
    loop {
        let frame = match conn::read_frame(&mut r, &mut buf, max, &mut silence).await {
            Ok(f) => f,
            Err(e) => {
                lose_on_read_error(&shared, &peer, index, e).await;
                return;
            }
        };
        match frame {
            Frame::Pong { nonce } => {
                if nonce != 0 {
                    *lock(&peer.epoch) = (nonce, Instant::now());
                }
                if let Some(tx) = lock(&peer.waiters).ping.remove(&nonce) {
                    let _ = tx.send(());
                }
            }
            Frame::Regions { regions, .. } => peer.learn(&regions),
            Frame::Ping { nonce } => {
                let _ = peer.ctrl[index].try_send(Frame::Pong { nonce }.encode());
            }
            Frame::BeginAck {
                batch,
                status,
                ref regions,
            } => {
                peer.learn(regions);
                let waiter = lock(&peer.waiters).begin.remove(&batch);
                if let Some(tx) = waiter {
                    let _ = tx.send(frame);
                } else if status != BeginStatus::Accepted {
                    // A batch sent without waiting was refused: nothing of it was written;
                    // the cancel makes the receiver forget it.
                    if let Some(b) = shared.batch(batch).filter(|b| b.peer == peer.id) {
                        let why = refusal(status, &b.remote_ops, regions).into_error(b.id, b.peer);
                        let shared = shared.clone();
                        let peer = peer.clone();
                        tokio::spawn(async move {
                            fence_on(&shared, Some(peer), &b, Outcome::Failed(why)).await;
                        });
                    }
                }
            }
            Frame::Done { batch } => {
                if let Some(b) = shared.batch(batch).filter(|b| b.peer == peer.id) {
                    if !shared.try_finish_done(&b) {
                        let shared = shared.clone();
                        tokio::spawn(async move { shared.finish_done(&b).await });
                    }
                }
            }
            Frame::CancelAck { batch, status } => {
                let mut w = lock(&peer.waiters);
                if let Some(c) = w.cancel.get_mut(&batch) {
                    c.remaining = c.remaining.saturating_sub(1);
                    c.not_pending |= status == CancelStatus::NotPending;
                    if c.remaining == 0 {
                        if let Some(tx) = c.tx.take() {
                            let _ = tx.send(c.not_pending);
                        }
                        w.cancel.remove(&batch);
                    }
                }
            }
            Frame::Error { code, message } => {
                peer.lose(
                    &shared,
                    format!("the peer closed the connection with error {code}: {message}"),
                    true,
                );
                return;
            }
            other => {
                let e = TcpError::UnexpectedFrame {
                    got: other.frame_type().name(),
                    state: "sending batches",
                };
                peer.lose(&shared, e.to_string(), true);
                return;
            }
        }
    }
}

async fn writer_task(
    shared: Arc<Shared>,
    peer: Arc<OutPeer>,
    w: conn::SharedWriter,
    mut ctrl: mpsc::Receiver<Vec<u8>>,
) {
    let piece_bytes = shared.config.piece_bytes;
    let mut stage = Stage::default();
    let r: std::io::Result<()> = async {
        loop {
            // Control frames (cancels, pongs, pings) go first, between pieces.
            match ctrl.try_recv() {
                Ok(f) => {
                    w.lock().await.write_all(&f).await?;
                    continue;
                }
                Err(mpsc::error::TryRecvError::Disconnected) => return Ok(()),
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
            let notified = peer.work.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(piece) = peer.take_piece(piece_bytes) {
                send_piece(&*w.lock().await, piece, &mut stage).await?;
                // Waiting for a writable socket does not count against tokio's task budget,
                // so while the socket keeps up this loop would never give the worker back:
                // keep-alives, heartbeats and the other connections' writers would starve
                // for as long as pieces are queued (seconds on a loaded machine), and their
                // peers would drop them as silent.
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                biased;
                f = ctrl.recv() => match f {
                    Some(f) => w.lock().await.write_all(&f).await?,
                    None => return Ok(()),
                },
                () = &mut notified => {}
            }
        }
    }
    .await;
    if let Err(e) = r {
        // A failed send says little (a broken pipe, a reset); the reader may still find the
        // peer's `Error` frame saying why it closed, so let it name the cause first.
        let lost = peer.lost_signal.notified();
        tokio::pin!(lost);
        lost.as_mut().enable();
        if !peer.lost.load(Ordering::Acquire) {
            let _ = tokio::time::timeout(CAUSE_WAIT, lost).await;
        }
        peer.lose(&shared, format!("sending to the peer failed: {e}"), true);
    }
}

/// How long a writer whose send failed waits for the reader to learn why the peer closed.
const CAUSE_WAIT: Duration = Duration::from_millis(500);

/// Bytes offered to one non-blocking vectored write (about a loopback socket buffer).
const ATTEMPT_BYTES: u64 = 2 << 20;

/// Source bytes of one op in one attempt: the span of its rows borrowed in place (zero-copy,
/// shared, so other readers of the same rows are not held up), or the rows copied out, packed,
/// when the span cannot be borrowed (foreign memory, or a write in progress on it).
enum Source<'a> {
    Borrowed {
        span: RegionSlice,
        /// Local offset of the span's first byte.
        base: u64,
        op: &'a LocalOp,
        from: u64,
        to: u64,
    },
    Copied(Vec<u8>),
}

impl<'a> Source<'a> {
    /// Bytes `from..to` of `op`'s payload; `None` while they can be neither borrowed nor read.
    fn acquire(op: &'a LocalOp, from: u64, to: u64) -> Option<Self> {
        let (mut start, mut end) = (u64::MAX, 0);
        for (offset, len) in op.local_parts(from, to) {
            start = start.min(offset);
            end = end.max(offset + len);
        }
        // Never a waiting claim: this runs on the runtime's worker thread; the caller tries
        // again on a timer.
        if let Ok(span) = op.region.try_borrow(start, end - start) {
            return Some(Source::Borrowed {
                span,
                base: start,
                op,
                from,
                to,
            });
        }
        let mut v = vec![0u8; (to - from) as usize];
        let mut at = 0usize;
        for (offset, len) in op.local_parts(from, to) {
            let n = len as usize;
            op.region.try_read_at(offset, &mut v[at..at + n]).ok()?;
            at += n;
        }
        Some(Source::Copied(v))
    }

    /// Calls `f` with these bytes, slice by slice, in payload order.
    fn each_slice<'s>(&'s self, mut f: impl FnMut(&'s [u8])) {
        match self {
            Source::Borrowed {
                span,
                base,
                op,
                from,
                to,
            } => {
                for (offset, len) in op.local_parts(*from, *to) {
                    let at = (offset - base) as usize;
                    f(&span[at..at + len as usize]);
                }
            }
            Source::Copied(v) => f(v),
        }
    }
}

/// Local ranges shorter than this (a strided op's rows, or a whole short op) are gathered into
/// the writer's staging buffer and written from there: the kernel's cost per iovec exceeds a
/// user-space copy of that many bytes.
const STAGE_BELOW: u64 = 4 << 10;

/// Bytes gathered into a writer's staging buffer at a time, each batch one `writev`: small
/// enough to stay in the CPU's cache between the gather and the kernel's copy out of it, and
/// below the 64 KiB of one loopback or GSO segment, so no write leaves a tiny segment behind
/// (64 KiB exactly would: a 65,483-byte segment and a 53-byte one, each sent at once).
const STAGE_BYTES: u64 = 63 << 10;

/// A writer's staging buffer, reused from piece to piece: bytes `from..from + buf.len()` of the
/// frame being written, gathered from short source ranges ([`LocalOp::staged`]).
#[derive(Default)]
struct Stage {
    buf: Vec<u8>,
    from: u64,
}

/// Part of one op in one write attempt: `op`'s payload bytes `from..to`, which start at byte
/// `at` of the frame.
struct Part<'a> {
    op: &'a LocalOp,
    from: u64,
    to: u64,
    at: u64,
}

/// Writes a piece as one `Data` or `Rows` frame: header, descriptors and payloads in vectored
/// writes. Long source ranges are written in place (an iovec each, nothing copied); short
/// ones (rows of a strided op, small ops) are gathered into `stage` first, at most
/// [`STAGE_BYTES`] at a time, and written from there.
///
/// Source ranges are borrowed only for the duration of each non-blocking `writev` (or of a
/// gather), never while waiting for the socket, so the application can write its own memory
/// meanwhile.
async fn send_piece(w: &OwnedWriteHalf, piece: Piece, stage: &mut Stage) -> std::io::Result<()> {
    let header = encode_ops_header(piece.batch.0.id.0, &piece.ops);
    let head = header.len() as u64;
    let total = head + piece.ops.iter().map(LocalOp::total).sum::<u64>();
    stage.buf.clear();
    let mut done = 0u64;
    while done < total {
        w.writable().await?;
        let header_left = &header[(done.min(head)) as usize..];
        let staged = stage.from..stage.from + stage.buf.len() as u64;
        let sent = if staged.contains(&done) {
            // The rest of what an earlier attempt gathered.
            let rest = [IoSlice::new(&stage.buf[(done - staged.start) as usize..])];
            Some(written(w.try_write_vectored(&rest))?)
        } else {
            match next_attempt(&piece.ops, head, done) {
                (parts, true) => write_gathered(w, header_left, &parts, stage)?,
                (parts, false) => write_in_place(w, header_left, &parts)?,
            }
        };
        match sent {
            Some(n) => done += n,
            // Another access holds a source range for the length of one write; try again
            // shortly.
            None => tokio::time::sleep(Duration::from_micros(100)).await,
        }
    }
    Ok(())
}

/// The parts of the next write attempt from frame byte `done` on (past the `head` bytes of the
/// header), and whether they are gathered: an attempt is all short ranges (at most
/// [`STAGE_BYTES`], gathered) or all long ones (at most [`ATTEMPT_BYTES`] and
/// [`MAX_IOVECS`] iovecs, in place).
fn next_attempt(ops: &[LocalOp], head: u64, done: u64) -> (Vec<Part<'_>>, bool) {
    let mut parts = Vec::new();
    let mut gather = None;
    let mut budget = ATTEMPT_BYTES;
    // One iovec is the header's.
    let mut iovecs = MAX_IOVECS - 1;
    let mut at = head;
    for op in ops {
        let end = at + op.total();
        if end <= done {
            at = end;
            continue;
        }
        let staged = op.staged();
        if *gather.get_or_insert(staged) != staged {
            break;
        }
        if staged && parts.is_empty() {
            budget = STAGE_BYTES;
        }
        let from = done.saturating_sub(at);
        let to = if staged {
            op.total().min(from + budget)
        } else {
            op.attempt_end(from, budget, iovecs)
        };
        parts.push(Part {
            op,
            from,
            to,
            at: at + from,
        });
        budget -= to - from;
        if !staged {
            iovecs = iovecs.saturating_sub(if op.locally_contiguous() {
                1
            } else {
                ((to - 1) / op.len - from / op.len + 1) as usize
            });
        }
        at = end;
        // What follows in the frame comes after the rest of this op.
        if budget == 0 || iovecs == 0 || to < op.total() {
            break;
        }
    }
    (parts, gather == Some(true))
}

/// Gathers `parts` into `stage` and writes what is left of the header and the staged bytes:
/// the bytes sent, or `None` when no source could be read and nothing was sent.
fn write_gathered(
    w: &OwnedWriteHalf,
    header_left: &[u8],
    parts: &[Part<'_>],
    stage: &mut Stage,
) -> std::io::Result<Option<u64>> {
    stage.buf.clear();
    stage.from = parts.first().map_or(0, |p| p.at);
    for p in parts {
        match Source::acquire(p.op, p.from, p.to) {
            Some(s) => s.each_slice(|bytes| stage.buf.extend_from_slice(bytes)),
            None => break,
        }
    }
    if header_left.is_empty() && stage.buf.is_empty() {
        return Ok(None);
    }
    let mut slices = Vec::with_capacity(2);
    if !header_left.is_empty() {
        slices.push(IoSlice::new(header_left));
    }
    slices.push(IoSlice::new(&stage.buf));
    Ok(Some(written(w.try_write_vectored(&slices))?))
}

/// Writes what is left of the header and `parts` straight from the sources (borrowed for the
/// one call): the bytes sent, or `None` when a source is momentarily written and nothing was
/// sent.
fn write_in_place(
    w: &OwnedWriteHalf,
    header_left: &[u8],
    parts: &[Part<'_>],
) -> std::io::Result<Option<u64>> {
    use std::os::fd::AsFd;
    if parts.iter().any(|p| !p.op.region.can_borrow()) {
        // Memory that cannot be borrowed (foreign) is written by the kernel straight from
        // its claimed raw ranges.
        let ranges: Vec<(&MemoryRegion, u64, u64)> = parts
            .iter()
            .flat_map(|p| {
                p.op.local_parts(p.from, p.to)
                    .map(|(offset, len)| (&p.op.region, offset, len))
            })
            .collect();
        let stream: &tokio::net::TcpStream = w.as_ref();
        return match stream.try_io(tokio::io::Interest::WRITABLE, || {
            kvbridge_transport::memory::send_vectored(stream.as_fd(), header_left, &ranges)
        }) {
            Err(e) if e.get_ref().is_some_and(|i| i.is::<TransportError>()) => Ok(None),
            r => written(r).map(Some),
        };
    }
    let mut sources = Vec::with_capacity(parts.len());
    for p in parts {
        match Source::acquire(p.op, p.from, p.to) {
            Some(s) => sources.push(s),
            None => break,
        }
    }
    if header_left.is_empty() && sources.is_empty() {
        return Ok(None);
    }
    let mut slices = Vec::with_capacity(MAX_IOVECS.min(1 + sources.len() * 4));
    if !header_left.is_empty() {
        slices.push(IoSlice::new(header_left));
    }
    for s in &sources {
        s.each_slice(|bytes| slices.push(IoSlice::new(bytes)));
    }
    Ok(Some(written(w.try_write_vectored(&slices))?))
}

/// What one non-blocking write sent: 0 when the socket was full.
fn written(r: std::io::Result<usize>) -> std::io::Result<u64> {
    match r {
        Ok(0) => Err(std::io::ErrorKind::WriteZero.into()),
        Ok(n) => Ok(n as u64),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// Why the receiver refused a batch, named from its answer (`lens`: the lengths of the regions
/// the batch writes, as the receiver has them).
fn refusal(status: BeginStatus, ops: &[TransferOp], lens: &[RegionLen]) -> Refusal {
    if status == BeginStatus::Busy {
        return Refusal::Busy;
    }
    let lens: HashMap<u64, Option<u64>> = lens.iter().map(|r| (r.region, r.len)).collect();
    for op in ops {
        match lens.get(&op.remote_region.0).copied().flatten() {
            None => return Refusal::Unknown(op.remote_region),
            Some(region_len) => {
                if let Some(refused) = remote_out_of_bounds(op, region_len) {
                    return refused;
                }
            }
        }
    }
    Refusal::Unknown(lens.keys().next().map_or(RegionId(0), |&r| RegionId(r)))
}

/// Whether some row of `op` falls outside a remote region of `region_len` bytes (or its end
/// overflows), named as the bounds check names it.
fn remote_out_of_bounds(op: &TransferOp, region_len: u64) -> Option<Refusal> {
    // A length beyond this side's address space is as long as any region can be here.
    let len = usize::try_from(region_len).unwrap_or(usize::MAX);
    let e = checked_rows(len, op.remote_offset, op.remote_stride, op.len, op.count).err()?;
    Some(Refusal::OutOfBounds {
        region: op.remote_region,
        offset: e.offset,
        len: e.len,
        region_len,
    })
}

/// Descriptors `post` checks between two yields to the runtime.
const RESOLVE_SLICE: usize = 4096;

/// Posts a batch: local checks, remote checks against the peer's announced region table, then
/// either one frame with the `Begin` and all the data (small batches, no waiting), or the
/// `Begin` round trip and the pieces.
pub(crate) async fn post(
    shared: &Arc<Shared>,
    peer: &Arc<OutPeer>,
    mut batch: TransferBatch,
) -> Result<BatchId> {
    if peer.lost.load(Ordering::Acquire) {
        return Err(peer.lost_error());
    }
    let cfg = &shared.config;
    batch.check_destination_rows(NAME)?;
    let (ops, needs, total) = resolve_local(shared, &batch).await?;
    check_remote(peer, cfg, &batch, &needs)?;
    // One clock read for both (a clock read is not free on every machine).
    let now = crate::batch::now();
    // Committing from the start: once any byte of the `Begin` may have left, only the
    // receiver's fence decides how the batch ends (`fence`). The receiver applies nothing past
    // its own deadline (at most the anchor), so the table's backstop needs no fence of its own.
    let (id, deadline) =
        shared
            .table
            .insert_committed(peer.id, batch.timeout, now, Fence::none())?;
    let deadline = Instant::from_std(deadline);
    let mut b = TxBatch::new(id, peer.id, deadline);
    // The deadline counts from an epoch the receiver stamped no later than this side read it,
    // so the receiver's deadline for the batch is never later than `b.deadline`.
    let (epoch, epoch_at) = *lock(&peer.epoch);
    let remaining = b.deadline.saturating_duration_since(epoch_at);
    let remaining_ms = u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX);
    let begin = |ack| Frame::Begin {
        batch: id.0,
        epoch,
        remaining_ms,
        total_bytes: total,
        regions: needs
            .iter()
            .map(|(&region, &end)| RegionNeed { region, end })
            .collect(),
        notification: batch.notification.clone(),
        ack,
    };
    // A small batch goes out whole with its Begin, copied now (its sources are free at once)
    // into the one buffer that is written.
    let inline = if total <= INLINE_BYTES && ops.len() <= MAX_OPS_PER_FRAME {
        inline_frame(begin(false), id.0, &ops, total)
    } else {
        None
    };
    if inline.is_some() {
        // Kept to name what the receiver refuses; the batch itself is not needed any more.
        b.remote_ops = std::mem::take(&mut batch.ops);
    }
    let b = Arc::new(b);
    lock(&shared.batches).insert(id.0, b.clone());
    let forget = || {
        shared.table.forget(id);
        lock(&shared.batches).remove(&id.0);
        lock(&peer.waiters).begin.remove(&id.0);
    };
    b.set_anchor(b.deadline + Duration::from_millis(1));
    if let Some(frame) = inline {
        return send_inline(shared, peer, b, frame, forget).await;
    }
    let begin = begin(true).encode();
    begin_and_queue(shared, peer, b, begin, ops, total, &batch.ops, forget).await
}

/// Sends a small batch whole (its `Begin` and bytes in one buffer, no acknowledgement asked).
async fn send_inline(
    shared: &Shared,
    peer: &OutPeer,
    b: Arc<TxBatch>,
    frame: Vec<u8>,
    forget: impl Fn(),
) -> Result<BatchId> {
    let id = b.id;
    // Written from here when connection 0 is idle: one task hop less per small batch.
    let ctrl = &peer.ctrl[0];
    let idle = ctrl.capacity() == ctrl.max_capacity();
    let direct = match peer.writers[0].upgrade() {
        Some(w) => conn::write_now(&w, idle, frame, shared.config.keepalive_timeout),
        None => Err(frame),
    };
    let sent = match direct {
        Ok(()) => Ok(Ok(())),
        Err(frame) => tokio::time::timeout_at(b.deadline, ctrl.send(frame)).await,
    };
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(_)) => {
            forget();
            return Err(peer.lost_error());
        }
        Err(_) => {
            // Never queued: nothing can land.
            shared.finish(&b, Outcome::TimedOut);
            return Ok(id);
        }
    }
    shared.deadlines.watch(b);
    Ok(id)
}

/// Sends the `Begin` of a batch with pieces, waits for the receiver's answer (bounded by the
/// batch's deadline) and queues the pieces for the connections' writers.
#[allow(clippy::too_many_arguments)]
async fn begin_and_queue(
    shared: &Shared,
    peer: &OutPeer,
    b: Arc<TxBatch>,
    begin: Vec<u8>,
    ops: Vec<LocalOp>,
    total: u64,
    remote_ops: &[TransferOp],
    forget: impl Fn(),
) -> Result<BatchId> {
    let id = b.id;
    let (tx, rx) = oneshot::channel();
    lock(&peer.waiters).begin.insert(id.0, tx);
    let answer = tokio::time::timeout_at(b.deadline, async {
        peer.ctrl[0].send(begin).await.ok()?;
        rx.await.ok()
    })
    .await;
    let ack = match answer {
        Ok(Some(ack)) => ack,
        Ok(None) => {
            forget();
            return Err(peer.lost_error());
        }
        Err(_) => {
            // The deadline passed before the receiver answered: no byte was sent, so the batch
            // ends timed out. Let the receiver forget it if it accepts it later.
            lock(&peer.waiters).begin.remove(&id.0);
            shared.finish(&b, Outcome::TimedOut);
            for c in &peer.ctrl {
                let _ = c.try_send(Frame::Cancel { batch: id.0 }.encode());
            }
            return Ok(id);
        }
    };
    let Frame::BeginAck {
        status, regions, ..
    } = ack
    else {
        forget();
        return Err(peer.lost_error());
    };
    if status != BeginStatus::Accepted {
        forget();
        return Err(refusal(status, remote_ops, &regions).into_error(id, peer.id));
    }
    if total > 0 {
        lock(&peer.queue).push_back(Job {
            batch: b.clone(),
            ops,
            next: 0,
            row: 0,
            in_row: 0,
        });
        peer.work.notify_waiters();
    }
    shared.deadlines.watch(b);
    Ok(id)
}

/// The batch's ops resolved against this side's regions, every row bounds-checked: the ops,
/// the end each remote region must reach, and the batch's total bytes.
async fn resolve_local(
    shared: &Shared,
    batch: &TransferBatch,
) -> Result<(Vec<LocalOp>, BTreeMap<u64, u64>, u64)> {
    // Bounds before bytes, local side.
    let mut ops = Vec::with_capacity(batch.ops.len());
    let mut needs: BTreeMap<u64, u64> = BTreeMap::new();
    let mut total = 0u64;
    for (k, slice) in batch.ops.chunks(RESOLVE_SLICE).enumerate() {
        if k > 0 {
            // A batch can carry hundreds of thousands of descriptors (one per token row of a
            // head slice): checking them all in one poll would hold this runtime worker for
            // long enough that keep-alives and the other connections' tasks miss their
            // deadlines, and peers drop the connection.
            tokio::task::yield_now().await;
        }
        let regions = read(&shared.regions);
        for op in slice {
            let region = regions
                .get(&op.local_region.0)
                .ok_or(TransportError::UnknownRegion {
                    side: Side::Local,
                    region: op.local_region,
                    transport: NAME,
                })?;
            // Every row of a strided op, overflow included, before anything is sent.
            op.local_rows_in(region.len())?;
            let end =
                rows_end(op.remote_offset, op.remote_stride, op.len, op.count).unwrap_or(u64::MAX);
            let need = needs.entry(op.remote_region.0).or_insert(0);
            *need = (*need).max(end);
            total = op
                .len
                .checked_mul(op.count)
                .and_then(|bytes| total.checked_add(bytes))
                .ok_or_else(|| TransportError::InvalidArgument {
                    transport: NAME,
                    message: "the batch's lengths add up to more than 2^64 bytes; split it".into(),
                })?;
            ops.push(LocalOp {
                region: region.clone(),
                local_offset: op.local_offset,
                remote_region: op.remote_region.0,
                remote_offset: op.remote_offset,
                len: op.len,
                count: op.count,
                local_stride: op.local_stride,
                remote_stride: op.remote_stride,
            });
        }
    }
    Ok((ops, needs, total))
}

/// Refuses what cannot work on the remote side before anything is sent: a write outside a
/// region the peer announced, or a `Begin` larger than one frame.
fn check_remote(
    peer: &OutPeer,
    cfg: &crate::TcpConfig,
    batch: &TransferBatch,
    needs: &BTreeMap<u64, u64>,
) -> Result<()> {
    // Remote side, against the announced table: a region's length never changes while it is
    // registered (ids are not reused), so a write outside a known region is refused here. A
    // region not in the table may have been registered since; the receiver decides.
    {
        let remote = lock(&peer.remote);
        for op in &batch.ops {
            if let Some(&region_len) = remote.get(&op.remote_region.0) {
                if let Some(refused) = remote_out_of_bounds(op, region_len) {
                    return Err(refused.into_error(BatchId(0), peer.id));
                }
            }
        }
    }
    let notification_len = batch.notification.as_ref().map_or(0, |n| n.len());
    let begin_len = wire::BEGIN_FIXED as usize + 16 * needs.len() + notification_len;
    if begin_len > cfg.max_frame_len as usize {
        return Err(TransportError::InvalidArgument {
            transport: NAME,
            message: format!(
                "the notification ({notification_len} bytes) and {} distinct remote regions do not fit \
                 one frame of {} bytes; shorten the notification or raise TcpConfig::max_frame_len",
                needs.len(),
                cfg.max_frame_len
            ),
        });
    }
    Ok(())
}

/// A small batch as one buffer: its `Begin`, then (when it has bytes) its one `Data` (or
/// `Rows`) frame with the payload copied from the sources. `None` when a source range is
/// momentarily written (the batch then takes the path with pieces, which waits for it).
fn inline_frame(begin: Frame, batch: u64, ops: &[LocalOp], total: u64) -> Option<Vec<u8>> {
    if total == 0 {
        return Some(begin.encode());
    }
    // Ops without bytes are left out: the receiver needs no descriptor for them.
    let with_bytes: Vec<LocalOp>;
    let ops = if ops.iter().all(|op| op.total() > 0) {
        ops
    } else {
        with_bytes = ops
            .iter()
            .filter(|op| op.total() > 0)
            .map(|op| op.rows(0, op.count))
            .collect();
        &with_bytes
    };
    let header = encode_ops_header(batch, ops);
    // One allocation for the whole batch.
    let mut frame = Vec::with_capacity(begin.encoded_len_hint() + header.len() + total as usize);
    begin.encode_into(&mut frame);
    let mut at = frame.len() + header.len();
    frame.extend_from_slice(&header);
    frame.resize(at + total as usize, 0);
    for op in ops {
        for (offset, len) in op.local_parts(0, op.total()) {
            let n = len as usize;
            op.region.try_read_at(offset, &mut frame[at..at + n]).ok()?;
            at += n;
        }
    }
    Some(frame)
}

/// Posted batches by deadline, watched by one task per transport ([`deadline_task`]) rather
/// than a task (and a wake-up of another worker) per batch.
#[derive(Default)]
pub(crate) struct Deadlines {
    due: Mutex<Due>,
    earlier: Notify,
}

#[derive(Default)]
struct Due {
    batches: BTreeMap<(Instant, u64), Arc<TxBatch>>,
    /// When the task wakes next on its own; `None` while it waits for the first batch.
    wake_at: Option<Instant>,
}

impl Deadlines {
    /// The batch is fenced at its deadline unless `wait` collected it first.
    fn watch(&self, b: Arc<TxBatch>) {
        let at = b.deadline;
        let wake = {
            let mut due = lock(&self.due);
            due.batches.insert((at, b.id.0), b);
            due.wake_at.is_none_or(|w| at < w)
        };
        if wake {
            self.earlier.notify_one();
        }
    }

    /// Stops watching a collected batch.
    pub(crate) fn forget(&self, b: &TxBatch) {
        lock(&self.due).batches.remove(&(b.deadline, b.id.0));
    }
}

/// Fences every batch still pending at its deadline, until the transport closes.
pub(crate) async fn deadline_task(shared: Arc<Shared>) {
    let closed = shared.wait_closed();
    tokio::pin!(closed);
    let deadlines = &shared.deadlines;
    loop {
        let earlier = deadlines.earlier.notified();
        let next = {
            let mut due = lock(&deadlines.due);
            due.wake_at = due.batches.keys().next().map(|k| k.0);
            due.wake_at
        };
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = sleep => {}
            () = earlier => continue,
            () = &mut closed => return,
        }
        let expired = {
            let mut due = lock(&deadlines.due);
            let later = due.batches.split_off(&(Instant::now(), u64::MAX));
            std::mem::replace(&mut due.batches, later)
        };
        for b in expired.into_values() {
            if !shared.is_final(&b) {
                let shared = shared.clone();
                tokio::spawn(async move { fence(&shared, &b, Outcome::TimedOut).await });
            }
        }
    }
}

/// Sends `cancel` on each of `conns` and waits for all their answers; whether any said the
/// batch was no longer pending. `None` when the peer is lost meanwhile.
async fn cancel_round(
    peer: &OutPeer,
    batch: u64,
    conns: &[mpsc::Sender<Vec<u8>>],
    cancel: &[u8],
) -> Option<bool> {
    let (tx, rx) = oneshot::channel();
    lock(&peer.waiters).cancel.insert(
        batch,
        CancelWait {
            remaining: conns.len(),
            not_pending: false,
            tx: Some(tx),
        },
    );
    for c in conns {
        c.send(cancel.to_vec()).await.ok()?;
    }
    rx.await.ok()
}

/// Brings a pending batch to `outcome` so that no byte of it lands afterwards.
pub(crate) async fn fence(shared: &Arc<Shared>, b: &Arc<TxBatch>, outcome: Outcome) {
    let peer = shared.out_peer(b.peer.0);
    fence_on(shared, peer, b, outcome).await;
}

async fn fence_on(
    shared: &Arc<Shared>,
    peer: Option<Arc<OutPeer>>,
    b: &Arc<TxBatch>,
    outcome: Outcome,
) {
    if shared.is_final(b) {
        return;
    }
    let grace = shared.config.fence_grace;
    if !b.start_fence() {
        // Someone else fences it; they finish it within their grace (or at the anchor).
        let limit = b.anchor().unwrap_or_else(Instant::now).max(Instant::now()) + grace * 2;
        if tokio::time::timeout_at(limit, shared.finished(b))
            .await
            .is_err()
        {
            shared.finish(b, outcome);
        }
        return;
    }
    b.stop();
    let Some(peer) = peer.filter(|p| !p.lost.load(Ordering::Acquire)) else {
        // The peer is gone; losing it scheduled this batch's failure (at its anchor).
        let limit = b.anchor().unwrap_or_else(Instant::now).max(Instant::now()) + grace;
        if tokio::time::timeout_at(limit, shared.finished(b))
            .await
            .is_err()
        {
            shared.finish(b, outcome);
        }
        return;
    };
    let cancel = Frame::Cancel { batch: b.id.0 }.encode();
    let acked = tokio::time::timeout(grace, async {
        // Connection 0 first: it carries the batch's `Begin`, so a `Cancel` on another
        // connection cannot reach the receiver before the batch does.
        let not_pending = cancel_round(&peer, b.id.0, &peer.ctrl[..1], &cancel).await?;
        if not_pending || peer.ctrl.len() == 1 {
            return Some(not_pending);
        }
        cancel_round(&peer, b.id.0, &peer.ctrl[1..], &cancel).await
    })
    .await;
    lock(&peer.waiters).cancel.remove(&b.id.0);
    match acked {
        // The receiver had already completed it: its `Done` is on the way.
        Ok(Some(true)) => shared.finish_done(b).await,
        Ok(Some(false)) => {
            shared.finish(b, outcome);
        }
        _ => {
            peer.lose(
                shared,
                format!(
                    "the peer did not acknowledge the cancel of batch {} within {grace:?}",
                    b.id
                ),
                false,
            );
            if let Some(anchor) = b.anchor() {
                tokio::time::sleep_until(anchor).await;
            }
            shared.finish(b, outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{TcpConfig, TcpTransport};
    use kvbridge_transport::{KvTransport, KvTransportExt, TransferOp};

    /// Payload bytes of the queued jobs not yet taken by a writer.
    fn queued_bytes(p: &OutPeer) -> u64 {
        lock(&p.queue).iter().map(Job::left).sum()
    }

    /// On one thread, with the socket keeping up (the whole batch fits the loopback buffers),
    /// other tasks must still run between two pieces: the writer used to send every queued
    /// piece in one poll, starving keep-alives and the other connections. The batch is larger
    /// than `INLINE_BYTES`, so it goes through the writer's queue in pieces.
    #[tokio::test(flavor = "current_thread")]
    async fn the_writer_lets_other_tasks_run_between_pieces() {
        const PIECE: u64 = 16 << 10;
        const PIECES: u64 = 8;
        const _: () = assert!(PIECE * PIECES > INLINE_BYTES);
        let config = TcpConfig::default().with_piece_bytes(PIECE);
        let decode = TcpTransport::bind(config.clone()).await.unwrap();
        let prefill = TcpTransport::bind(config).await.unwrap();
        let len = (PIECE * PIECES) as usize;
        let (dst, dst_mem) = decode.allocate_registered(len).await.unwrap();
        let (src, src_mem) = prefill.allocate_registered(len).await.unwrap();
        src_mem.fill(0, len as u64, 7).unwrap();
        let peer = prefill.connect(&decode.local_descriptor()).await.unwrap();
        let out = prefill.shared.out_peer(peer.0).unwrap();

        // Records the bytes still queued each time it runs, until the batch is sent.
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sent = Arc::new(AtomicBool::new(false));
        let witness = tokio::spawn({
            let (seen, sent, out) = (seen.clone(), sent.clone(), out.clone());
            async move {
                while !sent.load(Ordering::Acquire) {
                    lock(&seen).push(queued_bytes(&out));
                    tokio::task::yield_now().await;
                }
            }
        });
        let op = TransferOp::new(src, 0, dst, 0, len as u64);
        prefill
            .transfer(peer, TransferBatch::write(vec![op]))
            .await
            .unwrap();
        sent.store(true, Ordering::Release);
        witness.await.unwrap();
        assert_eq!(dst_mem.to_vec(0, len as u64).unwrap(), vec![7; len]);
        let seen = lock(&seen).clone();
        assert!(
            seen.iter().any(|&q| q > 0 && q < PIECE * PIECES),
            "no other task ran while the {PIECES} pieces were being sent (bytes queued each \
             time the witness ran: {seen:?})"
        );
    }
}
