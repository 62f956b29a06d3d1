//! [`FaultInjector`]: a decorator that makes any transport misbehave, deterministically.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    BatchId, BatchState, Delegate, KvTransport, Notification, PeerId, Result, TransferBatch,
    TransferOp, TransportError,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Which batches or notifications a fault applies to, by their 0-based sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    All,
    Nth(u64),
}

impl Which {
    fn matches(self, n: u64) -> bool {
        match self {
            Which::All => true,
            Which::Nth(k) => k == n,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchFault {
    Delay(Duration),
    Fail,
    Stall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotificationFault {
    Drop,
    Delay(Duration),
}

/// A deterministic script of faults for a [`FaultInjector`]. The empty script (the default)
/// passes everything through unchanged.
///
/// Batches are numbered by the order of `post` calls on the injector, from 0; notifications by
/// the order in which the injector's `recv_notification` receives them, from 0. When several
/// batch faults match one batch, the first one added wins.
///
/// What each fault looks like to the caller (the documented final states):
///
/// | fault | `post` | final state (`wait`) | bytes in the peer | notification |
/// |---|---|---|---|---|
/// | [`delay_batches`](Self::delay_batches) / [`delay_batch`](Self::delay_batch) | `Ok` | done, or [`TransportError::TimedOut`] if the delay outlasts the deadline | all (if done) | after the data |
/// | [`fail_batch`](Self::fail_batch) | `Ok` | [`TransportError::BatchFailed`] | none | none |
/// | [`stall_batch`](Self::stall_batch) / [`stall_all_batches`](Self::stall_all_batches) | `Ok` | [`TransportError::TimedOut`] at the deadline ([`TransportError::Cancelled`] if cancelled first) | none | none |
/// | [`disconnect_after_bytes`](Self::disconnect_after_bytes) | `Ok`, then [`TransportError::PeerLost`] for later posts | [`TransportError::PeerLost`] for the batch crossing the limit | exactly the first `n` bytes (in descriptor order) | none for that batch |
/// | [`drop_notification`](Self::drop_notification) / [`drop_all_notifications`](Self::drop_all_notifications) | — | unchanged | unchanged | never returned by this side's `recv_notification` |
/// | [`delay_notifications`](Self::delay_notifications) | — | unchanged | unchanged | returned `d` later |
///
/// A delayed batch reaches the wrapped transport only after its delay, so refusals of bad
/// descriptors surface from `wait` instead of `post`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultScript {
    batch_faults: Vec<(Which, BatchFault)>,
    notification_faults: Vec<(Which, NotificationFault)>,
    disconnect_after: Option<u64>,
}

impl FaultScript {
    /// The empty script: pass-through.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds every batch back for `delay` before handing it to the wrapped transport.
    pub fn delay_batches(mut self, delay: Duration) -> Self {
        self.batch_faults
            .push((Which::All, BatchFault::Delay(delay)));
        self
    }

    /// Holds batch `n` (0-based) back for `delay`.
    pub fn delay_batch(mut self, n: u64, delay: Duration) -> Self {
        self.batch_faults
            .push((Which::Nth(n), BatchFault::Delay(delay)));
        self
    }

    /// Fails batch `n` (0-based): no byte of it moves and `wait` reports
    /// [`TransportError::BatchFailed`].
    pub fn fail_batch(mut self, n: u64) -> Self {
        self.batch_faults.push((Which::Nth(n), BatchFault::Fail));
        self
    }

    /// Never hands batch `n` (0-based) to the wrapped transport: it ends
    /// [`TransportError::TimedOut`] at its deadline.
    pub fn stall_batch(mut self, n: u64) -> Self {
        self.batch_faults.push((Which::Nth(n), BatchFault::Stall));
        self
    }

    /// Stalls every batch, as a peer that stopped answering would.
    pub fn stall_all_batches(mut self) -> Self {
        self.batch_faults.push((Which::All, BatchFault::Stall));
        self
    }

    /// Cuts the connection once `bytes` bytes have been sent in total: the batch that crosses
    /// the limit lands only its first bytes up to the limit, then fails with
    /// [`TransportError::PeerLost`], and every later batch to any peer is refused the same way.
    pub fn disconnect_after_bytes(mut self, bytes: u64) -> Self {
        self.disconnect_after = Some(bytes);
        self
    }

    /// Drops received notification `n` (0-based).
    pub fn drop_notification(mut self, n: u64) -> Self {
        self.notification_faults
            .push((Which::Nth(n), NotificationFault::Drop));
        self
    }

    /// Drops every received notification.
    pub fn drop_all_notifications(mut self) -> Self {
        self.notification_faults
            .push((Which::All, NotificationFault::Drop));
        self
    }

    /// Returns every received notification `delay` later.
    pub fn delay_notifications(mut self, delay: Duration) -> Self {
        self.notification_faults
            .push((Which::All, NotificationFault::Delay(delay)));
        self
    }

    fn batch_fault(&self, n: u64) -> Option<BatchFault> {
        self.batch_faults
            .iter()
            .find(|(w, _)| w.matches(n))
            .map(|(_, f)| *f)
    }

    fn notification_faults(&self, n: u64) -> impl Iterator<Item = NotificationFault> + '_ {
        self.notification_faults
            .iter()
            .filter(move |(w, _)| w.matches(n))
            .map(|(_, f)| *f)
    }
}

/// A [`KvTransport`] decorator (a [`Delegate`]) that injects the faults of a [`FaultScript`]
/// into the transport it wraps. Batch faults apply to batches posted through the injector; notification faults to
/// notifications received through it. With an empty script it is a pass-through that honours
/// the whole contract (it runs the conformance suite).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use kvbridge_mock::{FaultInjector, FaultScript, LoopbackTransport};
/// use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransportError};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let sender = FaultInjector::new(LoopbackTransport::new(), FaultScript::new().stall_all_batches());
/// let receiver = LoopbackTransport::new();
/// let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
/// let batch = TransferBatch::write(vec![]).with_timeout(Duration::from_millis(20));
/// let r = sender.transfer(peer, batch).await;
/// assert!(matches!(r, Err(TransportError::TimedOut { .. })));
/// # }
/// ```
pub struct FaultInjector<T> {
    inner: Arc<T>,
    script: FaultScript,
    posts: AtomicU64,
    received: AtomicU64,
    bytes_sent: Mutex<u64>,
    lost_peers: Mutex<HashSet<PeerId>>,
    batches: Mutex<HashMap<BatchId, Arc<Entry>>>,
    next_batch: AtomicU64,
}

impl<T: KvTransport> std::fmt::Debug for FaultInjector<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultInjector")
            .field("inner", &self.inner.name())
            .field("script", &self.script)
            .finish()
    }
}

/// A batch as the injector sees it.
struct Entry {
    peer: PeerId,
    timeout: Duration,
    deadline: Instant,
    /// Async so a forwarding task can hold it across the inner `post`, which fences `cancel`.
    state: tokio::sync::Mutex<Stage>,
    changed: Notify,
}

enum Stage {
    /// Not (yet) handed to the inner transport.
    Held,
    /// Handed over; the inner transport owns its fate.
    Forwarded(BatchId),
    /// Ended here.
    Final(BatchState, Option<TransportError>),
}

/// Rewrites the inner batch id in an error to the injector's id.
fn remap(e: TransportError, id: BatchId) -> TransportError {
    match e {
        TransportError::TimedOut { timeout, .. } => TransportError::TimedOut { batch: id, timeout },
        TransportError::Cancelled { .. } => TransportError::Cancelled { batch: id },
        TransportError::BatchFailed { peer, reason, .. } => TransportError::BatchFailed {
            batch: id,
            peer,
            reason,
        },
        TransportError::UnknownBatch { transport, .. } => TransportError::UnknownBatch {
            batch: id,
            transport,
        },
        other => other,
    }
}

impl<T: KvTransport> FaultInjector<T> {
    /// Wraps `inner` with `script`.
    pub fn new(inner: T, script: FaultScript) -> Self {
        Self::from_arc(Arc::new(inner), script)
    }

    /// Wraps `inner` with an empty script.
    pub fn pass_through(inner: T) -> Self {
        Self::new(inner, FaultScript::new())
    }

    /// Wraps a shared `inner` (e.g. to keep a handle to the undecorated transport).
    pub fn from_arc(inner: Arc<T>, script: FaultScript) -> Self {
        Self {
            inner,
            script,
            posts: AtomicU64::new(0),
            received: AtomicU64::new(0),
            bytes_sent: Mutex::new(0),
            lost_peers: Mutex::new(HashSet::new()),
            batches: Mutex::new(HashMap::new()),
            next_batch: AtomicU64::new(1),
        }
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &Arc<T> {
        &self.inner
    }

    /// The script in force.
    pub fn script(&self) -> &FaultScript {
        &self.script
    }

    fn entry(&self, id: BatchId) -> Result<Arc<Entry>> {
        lock(&self.batches)
            .get(&id)
            .cloned()
            .ok_or(TransportError::UnknownBatch {
                batch: id,
                transport: self.inner.name(),
            })
    }

    fn lost(&self, peer: PeerId) -> TransportError {
        TransportError::PeerLost {
            peer,
            transport: self.inner.name(),
            reason: "the fault injector cut the connection after its byte limit".into(),
        }
    }

    fn insert(&self, peer: PeerId, timeout: Duration, stage: Stage) -> (BatchId, Arc<Entry>) {
        let id = BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed));
        let entry = Arc::new(Entry {
            peer,
            timeout,
            deadline: Instant::now() + timeout,
            state: tokio::sync::Mutex::new(stage),
            changed: Notify::new(),
        });
        lock(&self.batches).insert(id, entry.clone());
        (id, entry)
    }

    /// How many bytes of `batch` may still go out before the scripted disconnect, or `None`
    /// when the whole batch fits (or there is no limit).
    fn take_bytes(&self, batch: &TransferBatch) -> Option<u64> {
        let limit = self.script.disconnect_after?;
        let mut sent = lock(&self.bytes_sent);
        let total = batch.total_bytes();
        let left = limit.saturating_sub(*sent);
        if total <= left {
            *sent += total;
            None
        } else {
            *sent = limit;
            Some(left)
        }
    }
}

/// The first `bytes` bytes of `ops`, in order (the last op cut after its last whole row, plus
/// the start of the next row).
fn prefix(ops: &[TransferOp], mut bytes: u64) -> Vec<TransferOp> {
    let mut out = Vec::new();
    for op in ops {
        if bytes == 0 {
            break;
        }
        if op.total_bytes() <= bytes {
            out.push(*op);
            bytes -= op.total_bytes();
            continue;
        }
        // `len > 0` here: a zero-byte op fits any budget.
        let whole = bytes / op.len;
        if whole > 0 {
            out.push(op.with_rows(whole, op.local_stride, op.remote_stride));
        }
        if let Some(mut part) = op.rows().nth(whole as usize) {
            part.len = bytes % op.len;
            if part.len > 0 {
                out.push(part);
            }
        }
        break;
    }
    out
}

/// The time left until `deadline`, at least a microsecond so the inner transport sees a
/// positive timeout.
fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_micros(1))
}

/// Overrides what the faults change; registration, connections, descriptors and shutdown are
/// the inner transport's.
#[async_trait::async_trait]
impl<T: KvTransport> Delegate for FaultInjector<T> {
    fn inner(&self) -> &dyn KvTransport {
        &*self.inner
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        let n = self.posts.fetch_add(1, Ordering::Relaxed);
        if lock(&self.lost_peers).contains(&peer) {
            return Err(self.lost(peer));
        }
        let timeout = batch.timeout;
        match self.script.batch_fault(n) {
            None => {}
            Some(BatchFault::Fail) => {
                let name = self.inner.name();
                let (id, entry) = self.insert(peer, timeout, Stage::Held);
                let e = TransportError::BatchFailed {
                    batch: id,
                    peer,
                    reason: format!(
                        "the fault injector failed batch number {n} as scripted ({name})"
                    ),
                };
                *entry.state.lock().await =
                    Stage::Final(BatchState::Failed(e.to_string()), Some(e));
                return Ok(id);
            }
            Some(BatchFault::Stall) => return Ok(self.insert(peer, timeout, Stage::Held).0),
            Some(BatchFault::Delay(delay)) => {
                let (id, entry) = self.insert(peer, timeout, Stage::Held);
                let inner = self.inner.clone();
                let cut = self.take_bytes(&batch);
                if cut.is_some() {
                    lock(&self.lost_peers).insert(peer);
                }
                tokio::spawn(async move {
                    tokio::time::sleep_until((Instant::now() + delay).min(entry.deadline)).await;
                    let mut stage = entry.state.lock().await;
                    if !matches!(*stage, Stage::Held) {
                        return;
                    }
                    *stage = if Instant::now() >= entry.deadline {
                        Stage::Final(BatchState::TimedOut, None)
                    } else {
                        forward(&*inner, &entry, peer, batch, cut).await
                    };
                    entry.changed.notify_waiters();
                });
                return Ok(id);
            }
        }
        let cut = self.take_bytes(&batch);
        if cut.is_some() {
            lock(&self.lost_peers).insert(peer);
        }
        match cut {
            None => {
                let inner_id = self.inner.post(peer, batch).await?;
                Ok(self.insert(peer, timeout, Stage::Forwarded(inner_id)).0)
            }
            Some(_) => {
                let (id, entry) = self.insert(peer, timeout, Stage::Held);
                let mut stage = entry.state.lock().await;
                *stage = forward(&*self.inner, &entry, peer, batch, cut).await;
                Ok(id)
            }
        }
    }

    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        let entry = self.entry(batch)?;
        let Ok(mut stage) = entry.state.try_lock() else {
            return Ok(BatchState::Pending);
        };
        match &*stage {
            Stage::Forwarded(inner) => self.inner.batch_state(*inner).map_err(|e| remap(e, batch)),
            Stage::Final(state, _) => Ok(state.clone()),
            Stage::Held if Instant::now() >= entry.deadline => {
                *stage = Stage::Final(BatchState::TimedOut, None);
                entry.changed.notify_waiters();
                Ok(BatchState::TimedOut)
            }
            Stage::Held => Ok(BatchState::Pending),
        }
    }

    async fn wait(&self, id: BatchId) -> Result<()> {
        let entry = self.entry(id)?;
        loop {
            let changed = entry.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let mut stage = entry.state.lock().await;
            match &mut *stage {
                Stage::Forwarded(inner) => {
                    let inner = *inner;
                    drop(stage);
                    let r = self.inner.wait(inner).await.map_err(|e| remap(e, id));
                    if lock(&self.batches).remove(&id).is_none() {
                        return Err(TransportError::UnknownBatch {
                            batch: id,
                            transport: self.inner.name(),
                        });
                    }
                    return r;
                }
                Stage::Final(state, error) => {
                    if lock(&self.batches).remove(&id).is_none() {
                        return Err(TransportError::UnknownBatch {
                            batch: id,
                            transport: self.inner.name(),
                        });
                    }
                    return match (state.clone(), error.take()) {
                        (BatchState::Done, _) => Ok(()),
                        (_, Some(e)) => Err(e),
                        (BatchState::Cancelled, None) => {
                            Err(TransportError::Cancelled { batch: id })
                        }
                        (BatchState::TimedOut, None) => Err(TransportError::TimedOut {
                            batch: id,
                            timeout: entry.timeout,
                        }),
                        (state, None) => Err(TransportError::BatchFailed {
                            batch: id,
                            peer: entry.peer,
                            reason: format!("{state:?}"),
                        }),
                    };
                }
                Stage::Held if Instant::now() >= entry.deadline => {
                    *stage = Stage::Final(BatchState::TimedOut, None);
                    continue;
                }
                Stage::Held => {}
            }
            drop(stage);
            tokio::select! {
                _ = &mut changed => {}
                _ = tokio::time::sleep_until(entry.deadline) => {}
            }
        }
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        let entry = self.entry(batch)?;
        // A forwarding task holds this lock across the inner `post`; once we have it, the batch
        // is either still held here (and never will be forwarded) or owned by the inner side.
        let mut stage = entry.state.lock().await;
        match &*stage {
            Stage::Forwarded(inner) => self.inner.cancel(*inner).await.map_err(|e| remap(e, batch)),
            Stage::Final(state, _) => Ok(state.clone()),
            Stage::Held => {
                let state = if Instant::now() >= entry.deadline {
                    BatchState::TimedOut
                } else {
                    BatchState::Cancelled
                };
                *stage = Stage::Final(state.clone(), None);
                entry.changed.notify_waiters();
                Ok(state)
            }
        }
    }

    async fn recv_notification(&self) -> Result<Notification> {
        loop {
            let notification = self.inner.recv_notification().await?;
            let n = self.received.fetch_add(1, Ordering::Relaxed);
            let mut dropped = false;
            for fault in self.script.notification_faults(n) {
                match fault {
                    NotificationFault::Drop => dropped = true,
                    NotificationFault::Delay(d) => tokio::time::sleep(d).await,
                }
            }
            if !dropped {
                return Ok(notification);
            }
        }
    }

    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        if lock(&self.lost_peers).contains(&peer) {
            return Err(self.lost(peer));
        }
        self.inner.probe(peer, timeout).await
    }
}

/// Hands a held batch to the inner transport. With `cut = Some(n)`, only its first `n` bytes go
/// (and are awaited), then the connection is cut and the batch fails with `PeerLost`.
async fn forward<T: KvTransport + ?Sized>(
    inner: &T,
    entry: &Entry,
    peer: PeerId,
    mut batch: TransferBatch,
    cut: Option<u64>,
) -> Stage {
    batch.timeout = remaining(entry.deadline);
    let Some(bytes) = cut else {
        return match inner.post(peer, batch).await {
            Ok(inner_id) => Stage::Forwarded(inner_id),
            Err(e) => Stage::Final(BatchState::Failed(e.to_string()), Some(e)),
        };
    };
    let head =
        TransferBatch::new(batch.direction, prefix(&batch.ops, bytes)).with_timeout(batch.timeout);
    let sent = match inner.post(peer, head).await {
        Ok(inner_id) => inner.wait(inner_id).await,
        Err(e) => Err(e),
    };
    let _ = inner.disconnect(peer).await;
    let e = match sent {
        Ok(()) => TransportError::PeerLost {
            peer,
            transport: inner.name(),
            reason: format!("the fault injector cut the connection after {bytes} more bytes"),
        },
        Err(e) => e,
    };
    Stage::Final(BatchState::Failed(e.to_string()), Some(e))
}
