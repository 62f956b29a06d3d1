//! The receiving side: accept, authenticate, check descriptors, read payloads into regions.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvbridge_transport::{MemoryRegion, Notification, PeerId, Result, TransportError};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::conn::{self, LinkError};
use crate::error::TcpError;
use crate::wire::{BeginStatus, CancelStatus, Frame, RegionLen, RegionNeed, WireOp};
use crate::{NAME, Shared, lock};

/// Bytes offered to one vectored read (between two checks that the batch is still live).
const READ_BYTES: u64 = 1 << 20;
/// Descriptors offered to one vectored read.
const READ_SLICES: usize = 64;
/// Scratch buffer for draining the payload of a dropped batch.
const DRAIN_BUF: usize = 64 << 10;
/// Connections in the handshake at once; more wait in the kernel's backlog.
const MAX_HANDSHAKES: usize = 64;

/// Per-batch state on the receiver, shared by the connections of one session.
struct RxBatch {
    total: u64,
    received: u64,
    /// Bytes of pieces being written right now.
    inflight: u64,
    notification: Option<Bytes>,
    deadline: Instant,
    cancelled: bool,
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
    ctrl: Mutex<Vec<Option<mpsc::Sender<Vec<u8>>>>>,
    batches: Mutex<HashMap<u64, RxBatch>>,
    writers_idle: Notify,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    pings: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    ping_seq: AtomicU64,
    idle: Duration,
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

    fn ctrl(&self, index: u16) -> Option<mpsc::Sender<Vec<u8>>> {
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
            ctrl.send(Frame::Ping { nonce }.encode()).await.ok()?;
            rx.await.ok()
        })
        .await;
        lock(&self.pings).remove(&nonce);
        match r {
            Ok(Some(())) => Ok(()),
            _ => Err(lost()),
        }
    }

    fn lock_batches(&self) -> std::sync::MutexGuard<'_, HashMap<u64, RxBatch>> {
        lock(&self.batches)
    }

    fn batch_live(&self, batch: u64) -> bool {
        self.lock_batches().get(&batch).is_some_and(RxBatch::live)
    }
}

/// Accepts connections until the transport closes.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
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
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = admit(shared, stream).await {
                tracing::warn!(peer = %from, error = %e, "rejected an inbound connection");
            }
        });
    }
}

/// Handshake, then joins (or starts) the connection's session and starts its tasks.
async fn admit(shared: Arc<Shared>, mut stream: TcpStream) -> Result<(), LinkError> {
    let _ = stream.set_nodelay(true);
    let hello = conn::server_handshake(&mut stream, &shared.config).await?;
    let (r, mut w) = stream.into_split();
    let idle = shared
        .config
        .keepalive_timeout
        .max(Duration::from_millis(u64::from(hello.keepalive_ms).min(3_600_000)) * 4);
    let session = {
        let mut sessions = lock(&shared.sessions);
        let session = sessions
            .entry(hello.session)
            .or_insert_with(|| {
                Arc::new(Session {
                    peer: shared.alloc_peer_id(),
                    id: hello.session,
                    conn_count: hello.conn_count,
                    ctrl: Mutex::new(vec![None; usize::from(hello.conn_count)]),
                    batches: Mutex::new(HashMap::new()),
                    writers_idle: Notify::new(),
                    tasks: Mutex::new(Vec::new()),
                    pings: Mutex::new(HashMap::new()),
                    ping_seq: AtomicU64::new(1),
                    idle,
                })
            })
            .clone();
        let mut ctrl = lock(&session.ctrl);
        let slot = ctrl.get_mut(usize::from(hello.conn_index));
        match slot {
            Some(slot @ None) if session.conn_count == hello.conn_count => {
                let (tx, rx) = mpsc::channel(conn::CTRL_QUEUE);
                *slot = Some(tx);
                drop(ctrl);
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
    let writer = tokio::spawn(writer_loop(w, ctrl_rx));
    let reader = tokio::spawn(reader_task(
        shared.clone(),
        session.clone(),
        r,
        hello.conn_index,
        writer,
    ));
    lock(&session.tasks).push(reader);
    Ok(())
}

async fn writer_loop(mut w: OwnedWriteHalf, mut rx: mpsc::Receiver<Vec<u8>>) -> OwnedWriteHalf {
    while let Some(frame) = rx.recv().await {
        if w.write_all(&frame).await.is_err() {
            break;
        }
    }
    w
}

/// Runs one connection's reader; when it ends, the whole session ends.
async fn reader_task(
    shared: Arc<Shared>,
    session: Arc<Session>,
    mut r: OwnedReadHalf,
    index: u16,
    writer: JoinHandle<OwnedWriteHalf>,
) {
    let mut rx = Receiver {
        shared: &shared,
        session: &session,
        index,
        buf: Vec::new(),
        scratch: Vec::new(),
        bounce: Vec::new(),
    };
    let result = rx.run(&mut r).await;
    let reason = match &result {
        Ok(()) => "closed".to_owned(),
        Err(e) => e.to_string(),
    };
    // Stop sending, then tell the peer why (a protocol error) before the socket closes.
    if let Some(slot) = lock(&session.ctrl).get_mut(usize::from(index)) {
        *slot = None;
    }
    if let Err(LinkError::Protocol(e)) = &result {
        tracing::warn!(peer = %session.peer, error = %e, "peer broke the protocol; closing");
        let w = tokio::time::timeout(Duration::from_millis(200), writer).await;
        if let Ok(Ok(mut w)) = w {
            conn::send_error(&mut w, e).await;
        }
    } else {
        tracing::debug!(peer = %session.peer, %reason, "inbound connection ended");
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
        for slot in lock(&session.ctrl).iter_mut() {
            *slot = None;
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
        if let Some(b) = batches.get_mut(&self.batch) {
            b.active = b.active.saturating_sub(1);
            b.inflight = b.inflight.saturating_sub(self.bytes);
            if self.applied {
                b.received += self.bytes;
            }
        }
        drop(batches);
        self.session.writers_idle.notify_waiters();
    }
}

struct Receiver<'a> {
    shared: &'a Shared,
    session: &'a Session,
    index: u16,
    buf: Vec<u8>,
    scratch: Vec<u8>,
    bounce: Vec<u8>,
}

impl Receiver<'_> {
    async fn send(&self, frame: Frame) -> Result<(), LinkError> {
        let Some(ctrl) = self.session.ctrl(self.index) else {
            return Err(LinkError::Eof);
        };
        ctrl.send(frame.encode()).await.map_err(|_| LinkError::Eof)
    }

    async fn run(&mut self, r: &mut OwnedReadHalf) -> Result<(), LinkError> {
        let max = self.shared.config.max_frame_len;
        loop {
            let frame = conn::read_frame(r, &mut self.buf, max, self.session.idle).await?;
            match frame {
                Frame::Ping { nonce } => self.send(Frame::Pong { nonce }).await?,
                Frame::Pong { nonce } => {
                    if let Some(tx) = lock(&self.session.pings).remove(&nonce) {
                        let _ = tx.send(());
                    }
                }
                Frame::Begin {
                    batch,
                    remaining_ms,
                    total_bytes,
                    regions,
                    notification,
                } => {
                    self.begin(batch, remaining_ms, total_bytes, regions, notification)
                        .await?
                }
                Frame::Data { batch, ops } => self.data(r, batch, ops).await?,
                Frame::Cancel { batch } => self.cancel(batch).await?,
                Frame::Error { code, message } => {
                    return Err(LinkError::Io(std::io::Error::other(format!(
                        "peer closed the connection with error {code}: {message}"
                    ))));
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
        remaining_ms: u64,
        total: u64,
        needs: Vec<RegionNeed>,
        notification: Option<Bytes>,
    ) -> Result<(), LinkError> {
        let mut lens = Vec::with_capacity(needs.len());
        let mut ok = true;
        for need in &needs {
            let len = self.shared.region(need.region).map(|r| r.len() as u64);
            ok &= len.is_some_and(|l| need.end <= l);
            lens.push(RegionLen {
                region: need.region,
                len,
            });
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
            if !ok {
                BeginStatus::RegionRefused
            } else if batches.len() >= self.shared.config.max_inbound_batches {
                BeginStatus::Busy
            } else {
                let deadline = Instant::now() + Duration::from_millis(remaining_ms);
                batches.insert(
                    batch,
                    RxBatch {
                        total,
                        received: 0,
                        inflight: 0,
                        notification,
                        deadline,
                        cancelled: false,
                        active: 0,
                        cancels_seen: 0,
                    },
                );
                BeginStatus::Accepted
            }
        };
        self.send(Frame::BeginAck {
            batch,
            status,
            regions: lens,
        })
        .await?;
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
            let n = Notification {
                from: self.session.peer,
                payload,
            };
            tokio::select! {
                r = self.shared.notify_tx.send(n) => r.map_err(|_| LinkError::Eof)?,
                () = self.shared.wait_closed() => return Err(LinkError::Eof),
            }
        }
        self.send(Frame::Done { batch }).await
    }

    /// A `Data` frame: every descriptor is checked before any payload byte is read.
    async fn data(
        &mut self,
        r: &mut OwnedReadHalf,
        batch: u64,
        ops: Vec<WireOp>,
    ) -> Result<(), LinkError> {
        let mut targets: Vec<MemoryRegion> = Vec::with_capacity(ops.len());
        let mut total = 0u64;
        for op in &ops {
            let Some(region) = self.shared.region(op.region) else {
                return Err(protocol(format!(
                    "Data frame for batch {batch} writes region #{} which is not registered here",
                    op.region
                )));
            };
            if let Err(e) = region.range(op.offset, op.len) {
                return Err(protocol(format!(
                    "Data frame for batch {batch} writes region #{}: {e}",
                    op.region
                )));
            }
            // The decoder checked that the sum does not overflow.
            total = total.saturating_add(op.len);
            targets.push(region);
        }
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
        let idle = self.session.idle;
        let mut left = total;
        let mut dropping = false;
        // Foreign memory (a mapping others may write) is never borrowed as a slice.
        let in_place =
            self.shared.config.receive_in_place && targets.iter().all(MemoryRegion::can_borrow);
        // Position: descriptor index and bytes of it already read.
        let (mut at, mut pos) = (0usize, 0u64);
        while at < ops.len() {
            if ops[at].len == pos {
                at += 1;
                pos = 0;
                continue;
            }
            match tokio::time::timeout(idle, r.readable()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(LinkError::Io(e)),
                Err(_) => return Err(LinkError::Silent(idle)),
            }
            if !self.session.batch_live(batch) {
                dropping = true;
                break;
            }
            let n = if in_place {
                self.read_in_place(r, batch, &ops, &targets, at, pos)?
            } else {
                self.read_through_bounce(r, batch, &ops, &targets, at, pos)?
            };
            left -= n;
            let mut n = n;
            while n > 0 {
                let rest = ops[at].len - pos;
                if rest == 0 {
                    at += 1;
                    pos = 0;
                    continue;
                }
                let step = rest.min(n);
                pos += step;
                n -= step;
            }
        }
        if dropping {
            drop(guard);
            return self.drain(r, left).await;
        }
        guard.applied = true;
        drop(guard);
        self.maybe_complete(batch).await
    }

    /// One non-blocking vectored read straight into the next descriptors' ranges, borrowed
    /// for the duration of the call only.
    fn read_in_place(
        &self,
        r: &OwnedReadHalf,
        batch: u64,
        ops: &[WireOp],
        targets: &[MemoryRegion],
        at: usize,
        pos: u64,
    ) -> Result<u64, LinkError> {
        let mut slices = Vec::new();
        let mut budget = READ_BYTES;
        let (mut k, mut from) = (at, pos);
        while k < ops.len() && budget > 0 && slices.len() < READ_SLICES {
            let op = &ops[k];
            let len = (op.len - from).min(budget);
            if len > 0 {
                match targets[k].borrow_mut(op.offset + from, len) {
                    Ok(s) => slices.push(s),
                    // Overlapping descriptors in one frame: read up to the overlap.
                    Err(_) if !slices.is_empty() => break,
                    Err(e) => return Err(busy(batch, op.region, e)),
                }
                budget -= len;
            }
            k += 1;
            from = 0;
        }
        let mut bufs: Vec<std::io::IoSliceMut<'_>> = slices
            .iter_mut()
            .map(|s| std::io::IoSliceMut::new(s))
            .collect();
        match r.try_read_vectored(&mut bufs) {
            Ok(0) => Err(LinkError::Eof),
            Ok(n) => Ok(n as u64),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(LinkError::Io(e)),
        }
    }

    /// One non-blocking read into the connection's fixed bounce buffer, then copied into the
    /// descriptors' ranges with `write_at` (`TcpConfig::receive_in_place = false`).
    fn read_through_bounce(
        &mut self,
        r: &OwnedReadHalf,
        batch: u64,
        ops: &[WireOp],
        targets: &[MemoryRegion],
        at: usize,
        pos: u64,
    ) -> Result<u64, LinkError> {
        if self.bounce.is_empty() {
            self.bounce = vec![0; READ_BYTES as usize];
        }
        let left: u64 = ops[at..].iter().map(|op| op.len).sum::<u64>() - pos;
        let want = left.min(READ_BYTES) as usize;
        let n = match r.try_read(&mut self.bounce[..want]) {
            Ok(0) => return Err(LinkError::Eof),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) => return Err(LinkError::Io(e)),
        };
        let (mut k, mut from, mut done) = (at, pos, 0usize);
        while done < n {
            let op = &ops[k];
            let step = ((op.len - from) as usize).min(n - done);
            if step > 0 {
                targets[k]
                    .write_at(op.offset + from, &self.bounce[done..done + step])
                    .map_err(|e| busy(batch, op.region, e))?;
            }
            done += step;
            k += 1;
            from = 0;
        }
        Ok(n as u64)
    }

    /// Reads and discards `n` payload bytes of a dropped batch (fixed-size scratch buffer).
    async fn drain(&mut self, r: &mut OwnedReadHalf, mut n: u64) -> Result<(), LinkError> {
        if self.scratch.is_empty() {
            self.scratch = vec![0; DRAIN_BUF];
        }
        while n > 0 {
            let k = n.min(DRAIN_BUF as u64) as usize;
            conn::read_exact_timed(r, &mut self.scratch[..k], self.session.idle).await?;
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
                return Err(LinkError::Silent(self.session.idle));
            }
        };
        self.send(Frame::CancelAck { batch, status }).await
    }
}

fn busy(batch: u64, region: u64, e: kvbridge_transport::AccessError) -> LinkError {
    protocol(format!("batch {batch} cannot write region #{region}: {e}"))
}

fn protocol(message: String) -> LinkError {
    LinkError::Protocol(TcpError::BadWrite { message })
}
