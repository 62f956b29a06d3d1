//! [`ShmTransport`]: connections, batches, the copy worker and the `KvTransport` impl.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use kvbridge_transport::batch::{BatchTable, Batches, Fence, Outcome, Step, deadline_after};
use kvbridge_transport::sync::{lock, read, write};
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, Direction, KvTransport, MemoryRegion, Notification, PeerId,
    RegionId, Result, Side, TransferBatch, TransportError,
};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::descriptor::Descriptor;
use crate::dir::{PrivateDir, default_base, random_bytes, sweep_stale};
use crate::doorbell::{self, Delivered, Hub, Producer};
use crate::map::{self, SharedMapping};
use crate::proto::{self, Frame, RegionStatus};
use crate::wire::{ReadError, Wire, WireReader};
use crate::{NAME, ShmError, ShmOptions};

/// Bytes copied between two checks of a batch's cancel flag, deadline and peer, when a batch is
/// copied by the task that posted it.
const CHUNK_BYTES: u64 = 1 << 20;
/// Bytes the copy worker copies of one batch before it turns to the next one it holds (and
/// checks the batch's cancel flag, deadline and peer). Copying the interleaved rows of several
/// batches a few strided ops at a time keeps their shared source pages close in time; turns of
/// 16 ops of 64 rows of 1152 bytes (1.2 MB) lost most of that (`docs/benchmarks.md`).
const TURN_BYTES: u64 = 128 << 10;
/// Budget charged per descriptor at least, so a chunk of tiny descriptors stays short too.
const OP_COST: u64 = 256;
/// Batches whose final state has not been collected by `wait`, at most.
const MAX_TRACKED_BATCHES: usize = 1 << 16;
/// Batches of at most this many bytes are copied, and their notification written, by the
/// posting task itself: a queue hop to the worker thread and a task spawn would cost more than
/// the copy.
const INLINE_BYTES: u64 = 64 << 10;
/// Copy jobs queued for the worker thread, at most.
const JOB_QUEUE: usize = 256;
/// Notifications received but not yet taken by `recv_notification`, at most.
const NOTIFICATION_QUEUE: usize = 4096;
/// Extra time past a deadline for a notification write to be fenced.
const FENCE_GRACE: Duration = Duration::from_millis(250);
/// How often a connection waiting for a slot looks for an evictable one again.
const EVICT_LOOK: Duration = Duration::from_millis(50);

/// Hands `value` to whoever waits for the answer `key`, if anyone still does.
fn answer<T>(waiters: &Mutex<HashMap<u64, oneshot::Sender<T>>>, key: u64, value: T) {
    if let Some(tx) = lock(waiters).remove(&key) {
        let _ = tx.send(value);
    }
}

/// A local registration.
struct LocalRegion {
    region: MemoryRegion,
    shared: Option<Arc<SharedMapping>>,
    /// Set by `deregister`: read batches in flight into the region stop at their next step.
    gone: Arc<AtomicBool>,
}

/// A peer's region mapped into this process.
struct RemoteRegion {
    id: RegionId,
    region: MemoryRegion,
    revoked: AtomicBool,
}

/// One control connection: outbound (made by `connect`; batches go out on it) or inbound
/// (accepted; notifications come in on it).
struct Conn {
    id: PeerId,
    outbound: bool,
    wire: Wire,
    lost: AtomicBool,
    lost_reason: Mutex<Option<String>>,
    /// Outbound: the peer's regions mapped so far.
    remote: Mutex<HashMap<RegionId, Arc<RemoteRegion>>>,
    region_waiters: Mutex<HashMap<u64, oneshot::Sender<Result<Arc<RemoteRegion>>>>>,
    /// Outbound: held while a region is looked up, so concurrent first posts wait for one
    /// mapping instead of each mapping (and populating) the whole region again.
    lookup: tokio::sync::Mutex<()>,
    pings: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// Inbound: regions whose file this peer received, and revocations awaiting its ack.
    shared: Mutex<HashSet<RegionId>>,
    revokes: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// Inbound: orders region answers against revocations on the wire.
    region_order: tokio::sync::Mutex<()>,
    /// Held (shared) by the copy worker while it copies a chunk for this peer; taken exclusively
    /// to fence copies (revocation, peer loss).
    copy_lock: RwLock<()>,
    task: Mutex<Option<AbortHandle>>,
    next_req: AtomicU64,
    /// Outbound: the peer's doorbell ring, which carries short notifications.
    bell: Option<Producer>,
    /// Inbound: when this peer last sent anything (a frame or a ring push), in milliseconds
    /// since the transport started; the longest-idle connection is the one evicted when a new
    /// peer finds every slot taken.
    last_heard: AtomicU64,
}

impl Conn {
    fn new(id: PeerId, outbound: bool, wire: Wire, bell: Option<Producer>) -> Self {
        Self {
            id,
            outbound,
            wire,
            bell,
            lost: AtomicBool::new(false),
            lost_reason: Mutex::new(None),
            remote: Mutex::new(HashMap::new()),
            region_waiters: Mutex::new(HashMap::new()),
            lookup: tokio::sync::Mutex::new(()),
            pings: Mutex::new(HashMap::new()),
            shared: Mutex::new(HashSet::new()),
            revokes: Mutex::new(HashMap::new()),
            region_order: tokio::sync::Mutex::new(()),
            copy_lock: RwLock::new(()),
            task: Mutex::new(None),
            next_req: AtomicU64::new(1),
            last_heard: AtomicU64::new(0),
        }
    }

    /// Publishes a copied batch's notification through the doorbell ring; `Ok(false)` when it
    /// must go over the socket instead (too long for a slot, the ring full, or no ring).
    fn ring(&self, payload: &[u8]) -> Result<bool> {
        match &self.bell {
            Some(bell) => bell.push(payload),
            None => Ok(false),
        }
    }

    fn lost_reason(&self) -> String {
        lock(&self.lost_reason)
            .clone()
            .unwrap_or_else(|| "the connection was closed".to_owned())
    }

    fn peer_lost(&self) -> TransportError {
        TransportError::PeerLost {
            peer: self.id,
            transport: NAME,
            reason: self.lost_reason(),
        }
    }

    /// The peer's region `id`, mapping it on first use.
    async fn remote_region(&self, id: RegionId, deadline: Instant) -> Result<Arc<RemoteRegion>> {
        if let Some(r) = lock(&self.remote).get(&id) {
            return Ok(Arc::clone(r));
        }
        let Ok(_one) = tokio::time::timeout_at(deadline, self.lookup.lock()).await else {
            return Err(self.no_answer("a region lookup"));
        };
        if let Some(r) = lock(&self.remote).get(&id) {
            return Ok(Arc::clone(r));
        }
        if self.lost.load(Ordering::Acquire) {
            return Err(self.peer_lost());
        }
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.region_waiters).insert(req, tx);
        let asked = tokio::time::timeout_at(
            deadline,
            self.wire
                .send(&Frame::GetRegion { req, region: id.0 }, None),
        )
        .await;
        let answer = match asked {
            Ok(Ok(())) => tokio::time::timeout_at(deadline, rx).await,
            Ok(Err(_)) => {
                lock(&self.region_waiters).remove(&req);
                return Err(self.peer_lost());
            }
            Err(_) => {
                lock(&self.region_waiters).remove(&req);
                return Err(self.no_answer("a region lookup"));
            }
        };
        match answer {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(self.peer_lost()),
            Err(_) => {
                lock(&self.region_waiters).remove(&req);
                Err(self.no_answer("a region lookup"))
            }
        }
    }

    fn no_answer(&self, what: &str) -> TransportError {
        TransportError::PeerLost {
            peer: self.id,
            transport: NAME,
            reason: format!("the peer did not answer {what} in time"),
        }
    }
}

/// The current time, on tokio's clock (which tests may pause).
fn now() -> std::time::Instant {
    Instant::now().into_std()
}

/// `wait`'s timer.
fn sleep_until(at: std::time::Instant) -> tokio::time::Sleep {
    tokio::time::sleep_until(Instant::from_std(at))
}

fn failed(batch: BatchId, peer: PeerId, reason: String) -> Outcome {
    Outcome::Failed(TransportError::BatchFailed {
        batch,
        peer,
        reason,
    })
}

fn lost(peer: PeerId, reason: String) -> Outcome {
    Outcome::Failed(TransportError::PeerLost {
        peer,
        transport: NAME,
        reason,
    })
}

/// One descriptor (a strided op stays one), resolved to indices into the job's region tables.
/// Every row of it was checked against both regions at `post` (`TransferOp::local_rows_in` / `remote_rows_in`), so row offsets
/// computed from it do not overflow.
#[derive(Debug, Clone, Copy)]
struct PlannedOp {
    local: u32,
    remote: u32,
    local_offset: u64,
    remote_offset: u64,
    len: u64,
    count: u64,
    local_stride: u64,
    remote_stride: u64,
}

/// Where a job's copy stands: row `row` of op `op`, `in_row` bytes into that row.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    op: usize,
    row: u64,
    in_row: u64,
}

/// A validated batch, ready for the copy worker.
struct Job {
    batches: Arc<Batches>,
    id: BatchId,
    conn: Arc<Conn>,
    direction: Direction,
    locals: Vec<MemoryRegion>,
    /// Each of `locals`' id and `deregister` flag: a read stops writing into a region once it is
    /// deregistered.
    local_gone: Vec<(RegionId, Arc<AtomicBool>)>,
    remotes: Vec<Arc<RemoteRegion>>,
    ops: Vec<PlannedOp>,
    /// Writes with streaming stores: a write batch of [`map::STREAM_MIN`] bytes or more.
    stream: bool,
    notification: Option<Bytes>,
    deadline: std::time::Instant,
    rt: tokio::runtime::Handle,
}

/// The copy worker: one OS thread per transport, fed through a bounded queue. It serves the
/// batches it holds in turn, one step of at most [`TURN_BYTES`] each, taking newly queued ones
/// in between: a small batch does not wait behind a large one, and batches that read
/// interleaved rows of the same source (one per decode rank in a DCP relayout) read them close
/// together in time, which copies faster than one pass per batch. Such a gang keeps the front
/// of the line for up to [`GANG_STREAK`] turns in a row.
fn worker(mut jobs: mpsc::Receiver<Job>) {
    let mut turns: VecDeque<Copying> = VecDeque::new();
    // Gang turns in a row whose batches went back to the front (`requeue_gang`).
    let mut streak = 0u32;
    loop {
        if turns.is_empty() {
            match jobs.blocking_recv() {
                Some(job) => turns.push_back(Copying::new(job)),
                None => return,
            }
        }
        // Held jobs are bounded like the queue, so `post` still waits once both are full.
        while turns.len() < JOB_QUEUE {
            match jobs.try_recv() {
                Ok(job) => turns.push_back(Copying::new(job)),
                Err(_) => break,
            }
        }
        if waits_for_sibling(&mut turns) {
            // Its siblings copy first until they reach its op; then they go together.
            if let Some(mut first) = turns.pop_front() {
                first.passed += 1;
                turns.push_back(first);
            }
            continue;
        }
        let gang = gang_of(&mut turns);
        if gang.len() > 1 {
            // Taken out in reverse, so the indices still point at the members.
            let mut members: Vec<Copying> =
                gang.iter().rev().filter_map(|&i| turns.remove(i)).collect();
            members.reverse();
            let pending = gang_turn(&mut members);
            // A member ends in a gang turn only by failing: nothing is left to commit.
            let still: Vec<Copying> = members
                .into_iter()
                .zip(pending)
                .filter_map(|(mut copying, pending)| {
                    copying.passed = 0;
                    pending.then_some(copying)
                })
                .collect();
            requeue_gang(&mut turns, still, &mut streak);
            continue;
        }
        let Some(mut copying) = turns.pop_front() else {
            continue;
        };
        copying.passed = 0;
        if copying.turn(TURN_BYTES) {
            turns.push_back(copying);
        } else {
            let rt = copying.job.rt.clone();
            if let Some(commit) = copying.finish() {
                rt.spawn(commit);
            }
        }
    }
}

/// Gang turns in a row that keep their batches at the front of the line, at most. A gang
/// copies on until its batches end or this many turns have passed; then they go to the back
/// once, so the batches behind them get a turn (a later chunk's gang, a lone batch), and the
/// count starts over. Sending a gang to the back after every turn, as a plain round robin
/// does, makes two chunks' gangs alternate turn by turn: two source streams far apart and
/// twice the destination streams, which copied about 10% slower end to end
/// (docs/benchmarks.md, "Every pair against its baseline"). 64 turns are about 19 MB of a
/// DCP 1 -> 4 relayout, 2 ms at 10 GB/s: what a batch behind a gang waits at most.
const GANG_STREAK: u32 = 64;

/// Puts the members of a gang turn that are still pending (`still`, in their order) back in
/// line: at the front while the streak is below [`GANG_STREAK`], else at the back, and counts
/// the streak (which starts over when a gang ends).
fn requeue_gang<T>(turns: &mut VecDeque<T>, still: Vec<T>, streak: &mut u32) {
    if still.is_empty() {
        // The gang ended: the next one starts a streak of its own.
        *streak = 0;
    } else if *streak < GANG_STREAK {
        *streak += 1;
        for copying in still.into_iter().rev() {
            turns.push_front(copying);
        }
    } else {
        *streak = 0;
        turns.extend(still);
    }
}

/// Batches copied together in one gang turn, at most.
const GANG_MAX: usize = 8;

/// Times in a row a batch may wait for its siblings to catch up ([`waits_for_sibling`]).
const GANG_PASS: u32 = 512;
/// Held batches looked at for a sibling of the first.
const GANG_SCAN: usize = 16;
/// How far past the lowest next source row of a gang one gang turn copies; also how far apart
/// two batches' next rows (or, for siblings, their ops' first rows) may be to go together: the
/// rows of one relayout's batches are interleaved, those of different requests or chunks are
/// not.
const GANG_WINDOW: u64 = 4 * TURN_BYTES;

/// The held batches the worker copies together next (indices into `turns`, in order): the
/// first one and every other whose current op reads rows of the same local region, within
/// [`GANG_WINDOW`] of the first's next row, and writes a different peer region, when the first
/// can be copied in whole rows. Fewer than two: none.
fn gang_of(turns: &mut VecDeque<Copying>) -> Vec<usize> {
    let mut gang: Vec<usize> = Vec::new();
    let mut first: Option<(MemoryRegion, u64, Vec<*const RemoteRegion>)> = None;
    for (i, copying) in turns.iter_mut().enumerate() {
        if gang.len() == GANG_MAX {
            break;
        }
        let Some(op) = copying.gang_op() else {
            if i == 0 {
                return gang;
            }
            continue;
        };
        let source = &copying.job.locals[op.local as usize];
        let at = copying.source_at(&op);
        let dst = Arc::as_ptr(&copying.job.remotes[op.remote as usize]);
        match &mut first {
            None => first = Some((source.clone(), at, vec![dst])),
            Some((region, first_at, dsts)) => {
                if !region.same_region(source)
                    || dsts.contains(&dst)
                    || at.abs_diff(*first_at) > GANG_WINDOW
                {
                    continue;
                }
                dsts.push(dst);
            }
        }
        gang.push(i);
    }
    if gang.len() < 2 {
        gang.clear();
    }
    gang
}

/// Whether the first held batch should let a *sibling* copy first: another batch, at most
/// [`GANG_SCAN`] back, behind it (at an earlier op, or more than [`GANG_WINDOW`] back in the
/// same op), whose op at the first's op index reads the same local region from a first row
/// within [`GANG_WINDOW`] of the first's, and writes a different peer region. The batches of a
/// DCP relayout (one per decode rank, posted one after the other) are siblings: the first
/// posted starts alone and runs ahead into source regions (layers) the others have not
/// reached, where no gang can form; waiting for them lets them copy together again. A batch
/// waits at most [`GANG_PASS`] times in a row.
fn waits_for_sibling(turns: &mut VecDeque<Copying>) -> bool {
    let Some((first, rest)) = turns.make_contiguous().split_first_mut() else {
        return false;
    };
    if first.passed >= GANG_PASS {
        return false;
    }
    let Some(op) = first.gang_op() else {
        return false;
    };
    let at = first.at.op;
    let first_at = first.source_at(&op);
    let region = &first.job.locals[op.local as usize];
    let dst = Arc::as_ptr(&first.job.remotes[op.remote as usize]);
    rest.iter_mut().take(GANG_SCAN - 1).any(|other| {
        if other.job.ops.len() <= at || other.gang_op().is_none() {
            return false;
        }
        let theirs = other.job.ops[at];
        // Behind: at an earlier op, or in the same op too far back to be copied with it.
        let behind = other.at.op < at
            || (other.at.op == at
                && other.source_at(&theirs).saturating_add(GANG_WINDOW) < first_at);
        behind
            && theirs.local_offset.abs_diff(op.local_offset) <= GANG_WINDOW
            && other.job.locals[theirs.local as usize].same_region(region)
            && Arc::as_ptr(&other.job.remotes[theirs.remote as usize]) != dst
    })
}

/// One gang turn: the rows of each member's current op that start within [`GANG_WINDOW`] of
/// the gang's lowest next source row (so members that started late catch up with the others),
/// at most [`TURN_BYTES`] of each, copied in one pass in source order (`map::copy_together`),
/// under the batch table's lock for all of them and each peer's copy fence. Returns, per
/// member, whether its batch is still pending (a member ends here only by failing).
fn gang_turn(members: &mut [Copying]) -> Vec<bool> {
    #[cfg(test)]
    tests::GANG_TURNS.fetch_add(1, Ordering::Relaxed);
    let horizon = members
        .iter()
        .filter_map(|c| c.current_op().map(|op| c.source_at(&op)))
        .min()
        .unwrap_or(0)
        .saturating_add(GANG_WINDOW);
    let batches = Arc::clone(&members[0].job.batches);
    let ids: Vec<BatchId> = members.iter().map(|c| c.job.id).collect();
    batches.step_many(&ids, now(), |pending| {
        // Each peer's fence once (a second read of the same lock could wait behind a writer).
        let mut conns: Vec<&Arc<Conn>> = Vec::new();
        for (c, _) in members.iter().zip(pending).filter(|(_, p)| **p) {
            if !conns.iter().any(|x| Arc::ptr_eq(x, &c.job.conn)) {
                conns.push(&c.job.conn);
            }
        }
        let fences: Vec<_> = conns.iter().map(|c| read(&c.copy_lock)).collect();
        let mut steps: Vec<Option<Outcome>> = members.iter().map(|_| None).collect();
        // Members copied in this turn, and their rows.
        let (mut copying, mut rows): (Vec<usize>, Vec<map::GangRows<'_>>) =
            (Vec::new(), Vec::new());
        for (k, c) in members.iter().enumerate() {
            if !pending[k] {
                continue;
            }
            let Some(op) = c.current_op() else { continue };
            let remote = &c.job.remotes[op.remote as usize];
            if c.job.conn.lost.load(Ordering::Acquire) {
                steps[k] = Some(lost(c.job.conn.id, c.job.conn.lost_reason()));
            } else if remote.revoked.load(Ordering::Acquire) {
                steps[k] = Some(failed(c.job.id, c.job.conn.id, revoked(remote.id)));
            } else {
                let at = c.at;
                let from = c.source_at(&op);
                let below = match op.local_stride {
                    _ if from >= horizon => 0,
                    0 => u64::MAX,
                    stride => (horizon - from).div_ceil(stride),
                };
                let count = (op.count - at.row)
                    .min((TURN_BYTES / op.len).max(1))
                    .min(below);
                if count == 0 {
                    continue;
                }
                copying.push(k);
                rows.push(map::GangRows {
                    src: &c.job.locals[op.local as usize],
                    src_offset: op.local_offset + at.row * op.local_stride,
                    src_stride: op.local_stride,
                    dst: &remote.region,
                    dst_offset: op.remote_offset + at.row * op.remote_stride,
                    dst_stride: op.remote_stride,
                    len: op.len,
                    count,
                });
            }
        }
        let copied = map::copy_together(&rows, true);
        drop(fences);
        let moved: Vec<(usize, u64)> = match copied {
            Ok(()) => copying
                .iter()
                .zip(&rows)
                .map(|(&k, m)| (k, m.count))
                .collect(),
            Err((failed_at, e)) => {
                let k = copying[failed_at];
                steps[k] = Some(failed(
                    members[k].job.id,
                    members[k].job.conn.id,
                    format!("a copy was refused by the region: {e}"),
                ));
                Vec::new()
            }
        };
        for (k, count) in moved {
            members[k].at.row += count;
        }
        steps
            .into_iter()
            .map(|outcome| outcome.map_or(Step::Continue, Step::Finish))
            .collect()
    })
}

/// Copies a job's bytes at once; returns the write of its notification when that is what
/// remains.
fn copy_job(job: Job) -> Option<impl Future<Output = ()> + Send + 'static> {
    let mut copying = Copying::new(job);
    while copying.turn(CHUNK_BYTES) {}
    copying.finish()
}

/// A job being copied, between its steps.
struct Copying {
    job: Job,
    at: Cursor,
    /// The notification to write, once the batch was committed.
    committed: Option<Bytes>,
    /// Times in a row this batch, first in line, waited for a sibling ([`waits_for_sibling`]).
    passed: u32,
}

impl Copying {
    fn new(job: Job) -> Self {
        Self {
            job,
            at: Cursor::default(),
            committed: None,
            passed: 0,
        }
    }

    /// The op the cursor is in; `None` once past the last.
    fn current_op(&self) -> Option<PlannedOp> {
        self.job.ops.get(self.at.op).copied()
    }

    /// Where in its local region the cursor's next row starts (`op` is the current op).
    fn source_at(&self, op: &PlannedOp) -> u64 {
        // In range without overflow: every row was checked at `post`.
        op.local_offset + self.at.row * op.local_stride + self.at.in_row
    }

    /// Moves the cursor past ops with nothing left to copy, and returns the op it is in when
    /// a gang turn can copy it: a write, at a row's start, rows of at most [`TURN_BYTES`].
    fn gang_op(&mut self) -> Option<PlannedOp> {
        while let Some(op) = self.current_op() {
            if self.at.row < op.count && op.len > 0 {
                break;
            }
            self.at = Cursor {
                op: self.at.op + 1,
                ..Cursor::default()
            };
        }
        let op = self.current_op()?;
        let whole = self.at.in_row == 0 && op.len <= TURN_BYTES;
        (matches!(self.job.direction, Direction::Write) && whole && self.committed.is_none())
            .then_some(op)
    }

    /// Copies up to `budget` bytes in one step of the batch; false once the batch has ended or
    /// only its commit (see [`Copying::finish`]) remains.
    fn turn(&mut self, budget: u64) -> bool {
        let Self {
            job, at, committed, ..
        } = self;
        let Job {
            batches,
            id,
            conn,
            direction,
            locals,
            local_gone,
            remotes,
            ops,
            notification,
            stream,
            ..
        } = job;
        let id = *id;
        // Each step runs under the batch table's lock: cancel, the deadline and peer loss take
        // it to fence the batch, so once they report, no further step starts.
        batches.step(id, now(), || {
            let fence = read(&conn.copy_lock);
            let gone = (*direction == Direction::Read)
                .then(|| local_gone.iter().find(|(_, g)| g.load(Ordering::Acquire)))
                .flatten();
            let copied = if conn.lost.load(Ordering::Acquire) {
                Err(lost(conn.id, conn.lost_reason()))
            } else if let Some((region, _)) = gone {
                Err(failed(
                    id,
                    conn.id,
                    format!(
                        "this side deregistered its region {region} while the batch was reading \
                         into it"
                    ),
                ))
            } else {
                copy_chunk(*direction, *stream, locals, remotes, ops, at, budget)
                    .map_err(|reason| failed(id, conn.id, reason))
            };
            drop(fence);
            match copied {
                Err(outcome) => Step::Finish(outcome),
                Ok(()) if at.op < ops.len() => Step::Continue,
                Ok(()) => match notification.take() {
                    None => Step::Finish(Outcome::Done),
                    // Published in this step, so it is fenced like the copies: once cancel or
                    // the deadline reports, it has either been rung or never will be.
                    Some(payload) if matches!(conn.ring(&payload), Ok(true)) => {
                        Step::Finish(Outcome::Done)
                    }
                    // The notification write cannot be recalled once started: if it outlives
                    // the deadline by the grace, closing the connection keeps it from arriving.
                    Some(payload) => {
                        let conn = Arc::clone(conn);
                        *committed = Some(payload);
                        Step::Commit(Fence::new(move || conn.wire.shutdown()))
                    }
                },
            }
        })
    }

    /// The write of the notification, when the batch was committed and that is what remains.
    fn finish(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let Self { job, committed, .. } = self;
        committed.map(|payload| commit(job.batches, job.id, job.conn, payload, job.deadline))
    }
}

/// A batch's commit, run by the task that posted it. If that task stops polling (its `post`
/// future is dropped), the commit goes on as a task of its own, so the batch still ends.
struct InlineCommit {
    commit: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>,
    rt: tokio::runtime::Handle,
}

impl Future for InlineCommit {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if let Some(commit) = self.commit.as_mut() {
            std::task::ready!(commit.as_mut().poll(cx));
            self.commit = None;
        }
        std::task::Poll::Ready(())
    }
}

impl Drop for InlineCommit {
    fn drop(&mut self) {
        if let Some(commit) = self.commit.take() {
            self.rt.spawn(commit);
        }
    }
}

/// What `validate` resolved of a batch: its local regions (with their `deregister` flags), the
/// peer's, and the ops against both.
struct Validated {
    locals: Vec<MemoryRegion>,
    local_gone: Vec<(RegionId, Arc<AtomicBool>)>,
    remotes: Vec<Arc<RemoteRegion>>,
    ops: Vec<PlannedOp>,
}

/// Copies up to `budget` bytes of the batch from `at`, and moves `at` past what it copied; the
/// error says why the batch fails. Whole rows of a strided op go in one `map::copy_rows` call
/// (one pair of claims, one tight loop); a row longer than what is left of the chunk is left
/// for the next step, unless it is longer than the whole chunk: only such rows are cut.
fn copy_chunk(
    direction: Direction,
    stream: bool,
    locals: &[MemoryRegion],
    remotes: &[Arc<RemoteRegion>],
    ops: &[PlannedOp],
    at: &mut Cursor,
    mut budget: u64,
) -> std::result::Result<(), String> {
    let full = budget;
    while at.op < ops.len() && budget > 0 {
        let op = ops[at.op];
        if at.row >= op.count || op.len == 0 {
            *at = Cursor {
                op: at.op + 1,
                ..Cursor::default()
            };
            budget = budget.saturating_sub(OP_COST);
            continue;
        }
        let remote = &remotes[op.remote as usize];
        if remote.revoked.load(Ordering::Acquire) {
            return Err(revoked(remote.id));
        }
        if at.in_row == 0 && op.len > budget && budget < full {
            // The step ends at a row's start, not inside a row that the next one can copy
            // whole (and that a gang turn can then take).
            break;
        }
        let local = &locals[op.local as usize];
        // In range without overflow: every row was checked at `post`.
        let lo = op.local_offset + at.row * op.local_stride + at.in_row;
        let ro = op.remote_offset + at.row * op.remote_stride + at.in_row;
        let (rows, n) = if at.in_row == 0 && op.len <= budget {
            ((op.count - at.row).min(budget / op.len), op.len)
        } else {
            (1, (op.len - at.in_row).min(budget))
        };
        let (rs, ls) = (op.remote_stride, op.local_stride);
        let copied = match direction {
            Direction::Write => {
                map::copy_rows(local, lo, ls, &remote.region, ro, rs, n, rows, stream)
            }
            Direction::Read => {
                map::copy_rows(&remote.region, ro, rs, local, lo, ls, n, rows, false)
            }
        };
        if let Err(e) = copied {
            return Err(format!("a copy was refused by the region: {e}"));
        }
        budget = budget.saturating_sub((n * rows).max(OP_COST));
        if n == op.len {
            at.row += rows;
        } else {
            at.in_row += n;
            if at.in_row == op.len {
                at.row += 1;
                at.in_row = 0;
            }
        }
    }
    Ok(())
}

/// Why a batch fails when its peer deregistered a region it writes.
fn revoked(region: RegionId) -> String {
    format!("the peer deregistered its region {region} while the batch was running")
}

/// Sends a copied batch's notification and finishes the batch. The write is bounded by the
/// batch's deadline; a write abandoned half-way closes the connection (see `Wire::send`).
async fn commit(
    batches: Arc<Batches>,
    id: BatchId,
    conn: Arc<Conn>,
    payload: Bytes,
    deadline: std::time::Instant,
) {
    let sent = tokio::time::timeout_at(
        Instant::from_std(deadline),
        conn.wire.send(&Frame::Notify { payload }, None),
    )
    .await;
    let outcome = match sent {
        Ok(Ok(())) => Outcome::Done,
        Ok(Err(e)) => lost(
            conn.id,
            format!("the notification could not be sent ({e}): the peer is gone"),
        ),
        Err(_) => Outcome::TimedOut,
    };
    batches.finish(id, outcome, now());
}

/// Starts the thread that reads every inbound connection's doorbell ring and delivers each
/// notification straight to `recv_notification`'s queue; a ring the peer broke drops its
/// connection with the reason.
fn start_hub(
    hub: Arc<Hub<Arc<Conn>>>,
    inner: std::sync::Weak<Inner>,
    notifications: mpsc::Sender<Notification>,
) -> Result<()> {
    let deliver = {
        let inner = inner.clone();
        move |conn: &Arc<Conn>, payload: Bytes| {
            if let Some(inner) = inner.upgrade() {
                inner.heard(conn);
            }
            let mut n = Notification::new(conn.id, payload);
            // A full queue waits for `recv_notification`, as the socket reader does.
            loop {
                match notifications.try_send(n) {
                    Ok(()) => return Delivered::Yes,
                    Err(mpsc::error::TrySendError::Closed(_)) => return Delivered::Stop,
                    Err(mpsc::error::TrySendError::Full(back)) => {
                        if conn.lost.load(Ordering::Acquire) {
                            return Delivered::Yes;
                        }
                        n = back;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
    };
    let broken = move |conn: &Arc<Conn>, reason: String| {
        let reason = format!("the peer broke its doorbell ring: {reason}");
        tracing::warn!(peer = %conn.id, "shm: {reason}");
        if let Some(inner) = inner.upgrade() {
            inner.lose(conn, reason);
        }
    };
    let alive = |conn: &Arc<Conn>| !conn.lost.load(Ordering::Acquire);
    std::thread::Builder::new()
        .name("kvbridge-shm-bell".into())
        .spawn(move || hub.run(deliver, broken, alive))
        .map(drop)
        .map_err(|e| TransportError::Io {
            transport: NAME,
            context: "starting the doorbell thread".into(),
            source: e,
        })
}

struct Inner {
    options: ShmOptions,
    own_uid: u32,
    token: [u8; 16],
    descriptor: Bytes,
    dir: PrivateDir,
    rt: tokio::runtime::Handle,
    next_id: AtomicU64,
    closed: AtomicBool,
    closed_notify: Notify,
    regions: Mutex<HashMap<RegionId, LocalRegion>>,
    conns: Mutex<HashMap<PeerId, Arc<Conn>>>,
    /// Ids, states, deadlines and the copy fence of every batch posted here.
    batches: Arc<Batches>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    notif_tx: mpsc::Sender<Notification>,
    notif_rx: tokio::sync::Mutex<mpsc::Receiver<Notification>>,
    accept_task: Mutex<Option<AbortHandle>>,
    /// One permit per inbound connection served (`ShmOptions::max_inbound_connections`).
    inbound_slots: Arc<Semaphore>,
    /// One permit per connection that found every slot taken and waits for one (as many as
    /// there are slots); beyond that a new connection is refused at once.
    waiting_room: Arc<Semaphore>,
    /// Reads the doorbell rings of every inbound connection, on one thread.
    hub: Arc<Hub<Arc<Conn>>>,
    /// Zero of `Conn::last_heard`.
    epoch: std::time::Instant,
}

impl Inner {
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Milliseconds since the transport started (the clock of `Conn::last_heard`).
    fn clock_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records that `conn`'s peer sent something.
    fn heard(&self, conn: &Conn) {
        conn.last_heard.store(self.clock_ms(), Ordering::Relaxed);
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(TransportError::Closed { transport: NAME })
        } else {
            Ok(())
        }
    }

    /// Marks a connection lost: closes it, fences copies into the peer's regions and fails the
    /// peer's pending batches.
    fn lose(&self, conn: &Arc<Conn>, reason: String) {
        self.lose_with(conn, reason, true);
    }

    fn lose_with(&self, conn: &Arc<Conn>, reason: String, shutdown: bool) {
        if conn.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::debug!(peer = %conn.id, %reason, "shm: connection lost");
        *lock(&conn.lost_reason) = Some(reason.clone());
        if shutdown {
            conn.wire.shutdown();
        }
        lock(&conn.region_waiters).clear();
        lock(&conn.pings).clear();
        lock(&conn.revokes).clear();
        {
            let _fence = write(&conn.copy_lock);
            for (_, r) in lock(&conn.remote).drain() {
                r.revoked.store(true, Ordering::Release);
            }
        }
        self.batches.fail_where(
            |peer| peer == conn.id,
            |_, peer| TransportError::PeerLost {
                peer,
                transport: NAME,
                reason: reason.clone(),
            },
        );
    }

    fn conn(&self, peer: PeerId) -> Result<Arc<Conn>> {
        lock(&self.conns)
            .get(&peer)
            .cloned()
            .ok_or(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            })
    }

    /// Stops everything that can be stopped without awaiting; used by `shutdown` and `Drop`.
    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(task) = lock(&self.accept_task).take() {
            task.abort();
        }
        self.hub.close();
        let conns: Vec<Arc<Conn>> = lock(&self.conns).drain().map(|(_, c)| c).collect();
        for conn in conns {
            self.lose(&conn, "the transport was shut down".to_owned());
            if let Some(task) = lock(&conn.task).take() {
                task.abort();
            }
        }
        self.batches.fail_where(
            |_| true,
            |batch, peer| TransportError::BatchFailed {
                batch,
                peer,
                reason: "the transport was shut down".to_owned(),
            },
        );
        *lock(&self.jobs) = None;
        lock(&self.regions).clear();
        self.dir.remove();
        self.closed_notify.notify_waiters();
    }

    /// Tells an inbound peer to stop writing into `only` (or every region it mapped) and waits
    /// for its confirmation; a peer that does not confirm in time is disconnected. Afterwards its
    /// transport writes nothing more into those regions.
    /// The connections peers opened to this transport (the ones that may map its regions).
    fn inbound_conns(&self) -> Vec<Arc<Conn>> {
        lock(&self.conns)
            .values()
            .filter(|c| !c.outbound)
            .cloned()
            .collect()
    }

    async fn revoke(&self, conn: &Arc<Conn>, only: Option<RegionId>) {
        let timeout = self.options.revoke_timeout;
        let acks = {
            let _order = conn.region_order.lock().await;
            let regions: Vec<RegionId> = {
                let mut shared = lock(&conn.shared);
                match only {
                    Some(r) if shared.remove(&r) => vec![r],
                    Some(_) => Vec::new(),
                    None => shared.drain().collect(),
                }
            };
            let mut acks = Vec::with_capacity(regions.len());
            for region in regions {
                let id = conn.next_req.fetch_add(1, Ordering::Relaxed);
                let (tx, rx) = oneshot::channel();
                lock(&conn.revokes).insert(id, tx);
                let frame = Frame::Revoke {
                    id,
                    region: region.0,
                };
                match tokio::time::timeout(timeout, conn.wire.send(&frame, None)).await {
                    Ok(Ok(())) => acks.push(rx),
                    _ => {
                        self.lose(conn, "could not tell the peer to stop writing".into());
                        return;
                    }
                }
            }
            acks
        };
        if acks.is_empty() {
            return;
        }
        let confirmed = async {
            for rx in acks {
                rx.await.ok()?;
            }
            Some(())
        };
        if !matches!(tokio::time::timeout(timeout, confirmed).await, Ok(Some(()))) {
            tracing::warn!(peer = %conn.id, "shm: a peer did not confirm it stopped writing; disconnecting it");
            self.lose(
                conn,
                format!("it did not confirm within {timeout:?} that it stopped writing into this side's regions"),
            );
        }
    }

    /// Accepts control connections until the transport closes.
    async fn accept_loop(self: Arc<Self>, listener: UnixListener) {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let inner = Arc::clone(&self);
                    match Arc::clone(&self.inbound_slots).try_acquire_owned() {
                        Ok(slot) => tokio::spawn(inner.serve_inbound(stream, slot)),
                        Err(_) => match Arc::clone(&self.waiting_room).try_acquire_owned() {
                            Ok(seat) => tokio::spawn(inner.admit_when_full(stream, seat)),
                            Err(_) => tokio::spawn(inner.refuse_over_limit(stream)),
                        },
                    };
                }
                Err(e) => {
                    tracing::warn!(error = %e, "shm: accept on the control socket failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// A connection that found every slot taken: the longest-idle established connection is
    /// evicted if it has been idle for `ShmOptions::evict_idle_after` (so idle connections, a
    /// peer's leak or an attacker's, cannot lock legitimate peers out), and the new one takes
    /// the first slot that frees within the handshake timeout (first come, first served), or
    /// is refused with the reason.
    async fn admit_when_full(self: Arc<Self>, stream: UnixStream, _seat: OwnedSemaphorePermit) {
        let deadline = Instant::now() + self.options.handshake_timeout;
        // Each waiting connection evicts one at most: the slot it freed may take a moment.
        let mut evicted = false;
        // One place in the semaphore's queue for the whole wait.
        let slot = Arc::clone(&self.inbound_slots).acquire_owned();
        tokio::pin!(slot);
        loop {
            if !evicted {
                evicted = self.evict_longest_idle();
            }
            // Looks for an evictable connection again this often while it waits.
            let look_again = (Instant::now() + EVICT_LOOK).min(deadline);
            match tokio::time::timeout_at(look_again, slot.as_mut()).await {
                Ok(Ok(slot)) => return self.serve_inbound(stream, slot).await,
                Ok(Err(_)) => return,
                Err(_) if Instant::now() >= deadline => {
                    return self.refuse_over_limit(stream).await;
                }
                Err(_) => {}
            }
        }
    }

    /// Evicts the inbound connection that has been idle longest, if it has been idle for at
    /// least `ShmOptions::evict_idle_after`; tells its peer why first. Whether one was.
    fn evict_longest_idle(&self) -> bool {
        let now = self.clock_ms();
        let Some(victim) = self
            .inbound_conns()
            .into_iter()
            .filter(|c| !c.lost.load(Ordering::Acquire))
            .min_by_key(|c| c.last_heard.load(Ordering::Relaxed))
        else {
            return false;
        };
        let idle =
            Duration::from_millis(now.saturating_sub(victim.last_heard.load(Ordering::Relaxed)));
        let least = self.options.evict_idle_after;
        if idle < least {
            return false;
        }
        let limit = self.options.max_inbound_connections;
        let reason = format!(
            "evicted: the peer serves its limit of {limit} inbound connections \
             (ShmOptions::max_inbound_connections) and a new one arrived; this connection had \
             sent nothing for {idle:?}, the longest of all (evictable after \
             ShmOptions::evict_idle_after = {least:?}); connect again, or raise the limit there"
        );
        tracing::warn!(peer = %victim.id, "shm: {reason}");
        let wire_owner = Arc::clone(&victim);
        let told = reason.clone();
        let hs = self.options.handshake_timeout;
        // The reason goes out first, bounded; the connection is lost either way.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(
                hs,
                wire_owner.wire.send(&Frame::Reject { reason: told }, None),
            )
            .await;
            wire_owner.wire.shutdown();
        });
        self.lose_quietly(&victim, reason);
        true
    }

    /// Marks `conn` lost without shutting its socket (an evicted peer still gets its reason).
    fn lose_quietly(&self, conn: &Arc<Conn>, reason: String) {
        self.lose_with(conn, reason, false);
    }

    /// Tells a peer beyond `ShmOptions::max_inbound_connections` why it is refused, within
    /// the handshake timeout, and closes.
    async fn refuse_over_limit(self: Arc<Self>, stream: UnixStream) {
        let limit = self.options.max_inbound_connections;
        let reason = format!(
            "this transport already serves {limit} inbound connections \
             (ShmOptions::max_inbound_connections = {limit}); connect again once one closes, or \
             raise the limit on this side"
        );
        tracing::warn!("shm: refused a connection: {reason}");
        let wire = Wire::new(stream);
        let _ = tokio::time::timeout(
            self.options.handshake_timeout,
            wire.send(&Frame::Reject { reason }, None),
        )
        .await;
    }

    /// Why a `Hello` with this version and token is refused, if it is.
    fn hello_refusal(
        &self,
        version: u32,
        token: [u8; crate::descriptor::TOKEN_LEN],
    ) -> Option<String> {
        if version != proto::VERSION {
            Some(format!(
                "protocol version {version} is not supported (this side speaks {})",
                proto::VERSION
            ))
        } else if token != self.token {
            Some(
                "the descriptor's token does not match this transport: the descriptor is \
                 stale or belongs to another transport"
                    .to_owned(),
            )
        } else {
            None
        }
    }

    /// Serves one inbound connection: credential check, handshake, then region lookups,
    /// notifications and liveness checks.
    async fn serve_inbound(self: Arc<Self>, stream: UnixStream, _slot: OwnedSemaphorePermit) {
        let wire = Wire::new(stream);
        let (uid, pid) = match wire.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "shm: could not read a peer's credentials; refused");
                return;
            }
        };
        if !self.options.allows(uid, self.own_uid) {
            let reason = ShmError::PeerRejected {
                uid,
                pid,
                allowed: self.options.describe_allowed(self.own_uid),
            }
            .to_string();
            tracing::warn!(uid, pid, "shm: {reason}");
            let _ = tokio::time::timeout(
                self.options.handshake_timeout,
                wire.send(&Frame::Reject { reason }, None),
            )
            .await;
            return;
        }
        let mut reader = WireReader::default();
        let hello = tokio::time::timeout(self.options.handshake_timeout, reader.next(&wire)).await;
        let refusal = match hello {
            Ok(Ok(Some((Frame::Hello { version, token }, _)))) => {
                self.hello_refusal(version, token)
            }
            Ok(Ok(Some((other, _)))) => Some(format!("expected Hello first, got {other:?}")),
            Ok(Ok(None)) | Ok(Err(_)) | Err(_) => return,
        };
        if let Some(reason) = refusal {
            tracing::warn!(uid, pid, "shm: refused a connection: {reason}");
            let _ = wire.send(&Frame::Reject { reason }, None).await;
            return;
        }
        let (ring, consumer) = match self.hub.ring() {
            Ok(ring) => ring,
            Err(e) => {
                let reason = format!("could not allocate the connection's doorbell ring: {e}");
                tracing::warn!(uid, pid, "shm: {reason}");
                let _ = wire.send(&Frame::Reject { reason }, None).await;
                return;
            }
        };
        let (Some(ring_fd), Some(page_fd)) = (doorbell::ring_fd(&ring), self.hub.page_fd()) else {
            return;
        };
        let conn = Arc::new(Conn::new(PeerId(self.next_id()), false, wire, None));
        self.heard(&conn);
        {
            let mut conns = lock(&self.conns);
            if self.closed.load(Ordering::Acquire) {
                return;
            }
            conns.insert(conn.id, Arc::clone(&conn));
        }
        // The ring joins the hub before the peer learns of it, so its first push is read.
        self.hub.join(Arc::clone(&conn), consumer);
        let welcome = Frame::Welcome {
            version: proto::VERSION,
            ring: doorbell::RING_BYTES as u64,
        };
        let bell = Frame::Bell {
            len: doorbell::BELL_PAGE_BYTES as u64,
        };
        let opened = async {
            conn.wire.send(&welcome, Some(ring_fd.as_fd())).await?;
            conn.wire.send(&bell, Some(page_fd.as_fd())).await
        };
        if let Err(e) = opened.await {
            self.lose(&conn, format!("could not finish the opening exchange: {e}"));
            lock(&self.conns).remove(&conn.id);
            return;
        }
        drop((ring_fd, page_fd));
        tracing::debug!(peer = %conn.id, uid, pid, "shm: accepted a peer");
        let reason = self.inbound_frames(&conn, &mut reader).await;
        self.lose(&conn, reason);
        lock(&self.conns).remove(&conn.id);
    }

    async fn inbound_frames(&self, conn: &Arc<Conn>, reader: &mut WireReader) -> String {
        loop {
            let (frame, _fd) = match reader.next(&conn.wire).await {
                Ok(Some(f)) => f,
                Ok(None) => return "the peer closed the connection".to_owned(),
                Err(e) => return e.to_string(),
            };
            self.heard(conn);
            let sent = match frame {
                Frame::GetRegion { req, region } => self.answer_region(conn, req, region).await,
                Frame::Notify { payload } => {
                    let n = Notification::new(conn.id, payload);
                    if self.notif_tx.send(n).await.is_err() {
                        return "the transport was shut down".to_owned();
                    }
                    Ok(())
                }
                Frame::Ping { nonce } => conn.wire.send(&Frame::Pong { nonce }, None).await,
                Frame::Pong { nonce } => {
                    answer(&conn.pings, nonce, ());
                    Ok(())
                }
                Frame::RevokeAck { id } => {
                    answer(&conn.revokes, id, ());
                    Ok(())
                }
                other => {
                    let message = format!("unexpected frame from a connecting peer: {other:?}");
                    tracing::warn!(peer = %conn.id, "shm: {message}");
                    return message;
                }
            };
            if let Err(e) = sent {
                return format!("writing to the control socket failed: {e}");
            }
        }
    }

    async fn answer_region(&self, conn: &Conn, req: u64, region: u64) -> std::io::Result<()> {
        let _order = conn.region_order.lock().await;
        let id = RegionId(region);
        let (status, len, shared) = match lock(&self.regions).get(&id) {
            None => (RegionStatus::Unknown, 0, None),
            Some(r) if r.region.is_empty() => (RegionStatus::Shared, 0, None),
            Some(r) => match &r.shared {
                Some(s) => {
                    lock(&conn.shared).insert(id);
                    (
                        RegionStatus::Shared,
                        r.region.len() as u64,
                        Some(Arc::clone(s)),
                    )
                }
                None => (RegionStatus::NotShared, r.region.len() as u64, None),
            },
        };
        let frame = Frame::Region {
            req,
            region,
            status,
            len,
        };
        conn.wire
            .send(&frame, shared.as_ref().map(|s| s.fd()))
            .await
    }

    /// Reads an outbound connection: region answers (mapping them), pongs, revocations.
    async fn outbound_frames(self: Arc<Self>, conn: Arc<Conn>, mut reader: WireReader) {
        let reason = loop {
            let (frame, fd) = match reader.next(&conn.wire).await {
                Ok(Some(f)) => f,
                Ok(None) => {
                    break "the peer closed the connection (it shut down or died)".to_owned();
                }
                Err(ReadError::Io(e)) => break format!("the control socket failed: {e}"),
                Err(ReadError::Proto(e)) => break format!("the peer broke the protocol: {e}"),
            };
            let sent = match frame {
                Frame::Region {
                    req,
                    region,
                    status,
                    len,
                } => {
                    let result = self
                        .map_answer(&conn, RegionId(region), status, len, fd)
                        .await;
                    answer(&conn.region_waiters, req, result);
                    Ok(())
                }
                Frame::Ping { nonce } => conn.wire.send(&Frame::Pong { nonce }, None).await,
                Frame::Pong { nonce } => {
                    answer(&conn.pings, nonce, ());
                    Ok(())
                }
                Frame::Reject { reason } => {
                    break format!("the peer closed the connection: {reason}");
                }
                Frame::Revoke { id, region } => {
                    {
                        // Waits for the chunk in flight (if any), after which no copy touches
                        // the region.
                        let _fence = write(&conn.copy_lock);
                        if let Some(r) = lock(&conn.remote).remove(&RegionId(region)) {
                            r.revoked.store(true, Ordering::Release);
                        }
                    }
                    conn.wire.send(&Frame::RevokeAck { id }, None).await
                }
                other => break format!("the peer broke the protocol: unexpected {other:?}"),
            };
            if let Err(e) = sent {
                break format!("writing to the control socket failed: {e}");
            }
        };
        self.lose(&conn, reason);
    }

    async fn map_answer(
        &self,
        conn: &Conn,
        id: RegionId,
        status: RegionStatus,
        len: u64,
        fd: Option<OwnedFd>,
    ) -> Result<Arc<RemoteRegion>> {
        match status {
            RegionStatus::Unknown => Err(TransportError::UnknownRegion {
                side: Side::Remote,
                region: id,
                transport: NAME,
            }),
            RegionStatus::NotShared => Err(TransportError::InvalidArgument {
                transport: NAME,
                message: format!(
                    "the peer's region {id} ({len} bytes) is not shared memory, so this process \
                     cannot write into it; the peer must allocate regions that others write into \
                     with `ShmTransport::allocate` (KvTransport::allocate of the shm transport)"
                ),
            }),
            RegionStatus::Shared => {
                let mapped = match fd {
                    None => map::allocate(0),
                    Some(fd) => tokio::task::spawn_blocking(move || map::map_remote(id.0, fd, len))
                        .await
                        .unwrap_or_else(|e| {
                            Err(ShmError::Map {
                                what: "mapping a peer region".into(),
                                source: std::io::Error::other(e.to_string()),
                            })
                        }),
                };
                let region = mapped.map_err(TransportError::from)?;
                let fresh = Arc::new(RemoteRegion {
                    id,
                    region,
                    revoked: AtomicBool::new(false),
                });
                if conn.lost.load(Ordering::Acquire) {
                    return Err(conn.peer_lost());
                }
                Ok(Arc::clone(lock(&conn.remote).entry(id).or_insert(fresh)))
            }
        }
    }
}

/// The shared-memory transport. See the [crate docs](crate).
pub struct ShmTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("socket", &self.inner.dir.socket())
            .field("closed", &self.inner.closed.load(Ordering::Relaxed))
            .finish()
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.inner.close();
        // A peer killed before it could clean up leaves its control directory; the survivor
        // removes it on its way out too, not only the next transport to start.
        sweep_stale(
            &self
                .inner
                .options
                .runtime_dir
                .clone()
                .unwrap_or_else(default_base),
        );
    }
}

impl ShmTransport {
    /// A transport with default [`ShmOptions`]. Must be called inside a Tokio runtime with I/O
    /// and time enabled.
    pub fn new() -> Result<Self> {
        Self::with_options(ShmOptions::default())
    }

    /// A transport with the given options. Must be called inside a Tokio runtime with I/O and
    /// time enabled. Creates the private control directory and socket and starts the copy
    /// worker thread.
    pub fn with_options(options: ShmOptions) -> Result<Self> {
        let rt =
            tokio::runtime::Handle::try_current().map_err(|_| TransportError::InvalidArgument {
                transport: NAME,
                message: "ShmTransport must be created inside a Tokio runtime (with I/O and time \
                          enabled); call it from async code or within Runtime::enter"
                    .to_owned(),
            })?;
        let max_inbound = options.max_inbound_connections;
        if !(1..=Semaphore::MAX_PERMITS).contains(&max_inbound) {
            return Err(TransportError::InvalidArgument {
                transport: NAME,
                message: format!(
                    "ShmOptions::max_inbound_connections = {max_inbound} must be at least 1 \
                     (and at most {})",
                    Semaphore::MAX_PERMITS
                ),
            });
        }
        let base = options.runtime_dir.clone().unwrap_or_else(default_base);
        let control = |source: std::io::Error| -> TransportError {
            ShmError::Control {
                dir: base.display().to_string(),
                source,
            }
            .into()
        };
        sweep_stale(&base);
        let dir = PrivateDir::create(&base).map_err(control)?;
        let std_listener = std::os::unix::net::UnixListener::bind(dir.socket()).map_err(control)?;
        std::fs::set_permissions(dir.socket(), std::fs::Permissions::from_mode(0o600))
            .map_err(control)?;
        std_listener.set_nonblocking(true).map_err(control)?;
        let listener = UnixListener::from_std(std_listener).map_err(control)?;
        let token: [u8; 16] = random_bytes();
        let descriptor = Descriptor {
            token,
            socket: dir.socket().to_path_buf(),
        }
        .encode()
        .ok_or_else(|| {
            control(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the socket path is not UTF-8, so it cannot travel in a descriptor",
            ))
        })?;
        let (job_tx, job_rx) = mpsc::channel(JOB_QUEUE);
        std::thread::Builder::new()
            .name("kvbridge-shm-copy".into())
            .spawn(move || worker(job_rx))
            .map_err(|e| TransportError::Io {
                transport: NAME,
                context: "starting the copy worker thread".into(),
                source: e,
            })?;
        let (notif_tx, notif_rx) = mpsc::channel(NOTIFICATION_QUEUE);
        let hub = Arc::new(Hub::new()?);
        let inner = Arc::new(Inner {
            options,
            own_uid: rustix::process::geteuid().as_raw(),
            token,
            descriptor: Bytes::from(descriptor),
            dir,
            rt,
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            closed_notify: Notify::new(),
            regions: Mutex::new(HashMap::new()),
            conns: Mutex::new(HashMap::new()),
            batches: Arc::new(Batches::from_table(
                BatchTable::new(NAME)
                    .with_limit(MAX_TRACKED_BATCHES)
                    .with_commit_grace(FENCE_GRACE),
            )),
            jobs: Mutex::new(Some(job_tx)),
            notif_tx,
            notif_rx: tokio::sync::Mutex::new(notif_rx),
            accept_task: Mutex::new(None),
            inbound_slots: Arc::new(Semaphore::new(max_inbound)),
            waiting_room: Arc::new(Semaphore::new(max_inbound)),
            hub: Arc::clone(&hub),
            epoch: std::time::Instant::now(),
        });
        start_hub(hub, Arc::downgrade(&inner), inner.notif_tx.clone())
            .inspect_err(|_| inner.close())?;
        let task = inner
            .rt
            .spawn(Arc::clone(&inner).accept_loop(listener))
            .abort_handle();
        *lock(&inner.accept_task) = Some(task);
        tracing::info!(socket = %inner.dir.socket().display(), "shm: transport listening");
        Ok(Self { inner })
    }

    /// The private directory holding the control socket (removed by `shutdown` and on drop).
    pub fn control_dir(&self) -> &std::path::Path {
        self.inner.dir.dir()
    }

    /// Whether `region` is shared memory made by [`allocate`](KvTransport::allocate) of a
    /// shared-memory transport (so peers can write into it once it is registered).
    pub fn is_shared(region: &MemoryRegion) -> bool {
        map::shared_of(region).is_some()
    }

    async fn validate(
        &self,
        conn: &Arc<Conn>,
        batch: &TransferBatch,
        deadline: Instant,
    ) -> Result<Validated> {
        let mut locals: Vec<MemoryRegion> = Vec::new();
        let mut local_gone = Vec::new();
        let mut local_idx: HashMap<RegionId, u32> = HashMap::new();
        let mut planned = Vec::with_capacity(batch.ops.len());
        {
            let regions = lock(&self.inner.regions);
            let mut last: Option<(RegionId, u32)> = None;
            for op in &batch.ops {
                let idx = match last {
                    Some((id, idx)) if id == op.local_region => idx,
                    _ => {
                        let idx = match local_idx.get(&op.local_region) {
                            Some(i) => *i,
                            None => {
                                let r = regions.get(&op.local_region).ok_or(
                                    TransportError::UnknownRegion {
                                        side: Side::Local,
                                        region: op.local_region,
                                        transport: NAME,
                                    },
                                )?;
                                locals.push(r.region.clone());
                                local_gone.push((op.local_region, Arc::clone(&r.gone)));
                                let i = (locals.len() - 1) as u32;
                                local_idx.insert(op.local_region, i);
                                i
                            }
                        };
                        last = Some((op.local_region, idx));
                        idx
                    }
                };
                op.local_rows_in(locals[idx as usize].len())?;
                planned.push(PlannedOp {
                    local: idx,
                    remote: 0,
                    local_offset: op.local_offset,
                    remote_offset: op.remote_offset,
                    len: op.len,
                    count: op.count,
                    local_stride: op.local_stride,
                    remote_stride: op.remote_stride,
                });
            }
        }
        let mut remotes: Vec<Arc<RemoteRegion>> = Vec::new();
        let mut remote_idx: HashMap<RegionId, u32> = HashMap::new();
        let mut last: Option<(RegionId, u32)> = None;
        for (op, plan) in batch.ops.iter().zip(planned.iter_mut()) {
            let idx = match last {
                Some((id, idx)) if id == op.remote_region => idx,
                _ => {
                    let idx = match remote_idx.get(&op.remote_region) {
                        Some(i) => *i,
                        None => {
                            let r = conn.remote_region(op.remote_region, deadline).await?;
                            remotes.push(r);
                            let i = (remotes.len() - 1) as u32;
                            remote_idx.insert(op.remote_region, i);
                            i
                        }
                    };
                    last = Some((op.remote_region, idx));
                    idx
                }
            };
            op.remote_rows_in(remotes[idx as usize].region.len())?;
            plan.remote = idx;
        }
        Ok(Validated {
            locals,
            local_gone,
            remotes,
            ops: planned,
        })
    }
}

/// Connects to the control socket of descriptor `d` (at `path`) and checks the peer's user.
async fn dial(inner: &Inner, d: &Descriptor, path: &str) -> Result<Wire> {
    let io = |context: String, source: std::io::Error| TransportError::Io {
        transport: NAME,
        context,
        source,
    };
    let hs = inner.options.handshake_timeout;
    let stream = match tokio::time::timeout(hs, UnixStream::connect(&d.socket)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(io(
                format!(
                    "connecting to the peer's control socket {path} (is the peer running, and \
                     is its directory accessible to this user?)"
                ),
                e,
            ));
        }
        Err(_) => {
            return Err(io(
                format!("connecting to {path}"),
                std::io::ErrorKind::TimedOut.into(),
            ));
        }
    };
    let wire = Wire::new(stream);
    let (uid, pid) = wire
        .peer_cred()
        .map_err(|e| io("reading the peer's credentials".into(), e))?;
    if !inner.options.allows(uid, inner.own_uid) {
        tracing::warn!(
            uid,
            pid,
            "shm: refusing to connect to a peer of another user"
        );
        return Err(ShmError::PeerRejected {
            uid,
            pid,
            allowed: inner.options.describe_allowed(inner.own_uid),
        }
        .into());
    }
    Ok(wire)
}

/// The opening exchange on a fresh connection (bounded by `hs`): `Hello` with the peer's
/// token, answered by `Welcome` with its doorbell ring and `Bell` with its bell page, both
/// mapped here. Returns the ring's producer.
async fn opening_exchange(
    wire: &Wire,
    token: [u8; crate::descriptor::TOKEN_LEN],
    peer: PeerId,
    hs: Duration,
) -> Result<(Producer, WireReader)> {
    let deadline = Instant::now() + hs;
    let hello = Frame::Hello {
        version: proto::VERSION,
        token,
    };
    let mut reader = WireReader::default();
    match tokio::time::timeout_at(deadline, wire.send(&hello, None)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return Err(lost_opening(
                peer,
                format!("the opening exchange failed: {e}"),
            ));
        }
        Err(_) => {
            return Err(lost_opening(
                peer,
                format!("no answer to the opening exchange within {hs:?}"),
            ));
        }
    }
    let ring = opening_file(wire, &mut reader, peer, deadline, hs, "Welcome").await?;
    let page = opening_file(wire, &mut reader, peer, deadline, hs, "Bell").await?;
    let bell =
        Producer::with_bell_page(ring, 0, page).map_err(|message| TransportError::Protocol {
            peer,
            transport: NAME,
            message: format!("the peer's doorbell ring is unusable: {message}"),
        })?;
    Ok((bell, reader))
}

fn lost_opening(peer: PeerId, reason: String) -> TransportError {
    TransportError::PeerLost {
        peer,
        transport: NAME,
        reason,
    }
}

/// Reads the opening exchange's next frame, which must be `want` (`Welcome` or `Bell`) with
/// its file, and maps the file.
async fn opening_file(
    wire: &Wire,
    reader: &mut WireReader,
    peer: PeerId,
    deadline: Instant,
    hs: Duration,
    want: &'static str,
) -> Result<MemoryRegion> {
    let (len, fd) = match tokio::time::timeout_at(deadline, reader.next(wire)).await {
        Ok(Ok(Some((Frame::Welcome { ring, .. }, fd)))) if want == "Welcome" => (ring, fd),
        Ok(Ok(Some((Frame::Bell { len }, fd)))) if want == "Bell" => (len, fd),
        Ok(Ok(Some((Frame::Reject { reason }, _)))) => {
            return Err(ShmError::RefusedByPeer { reason }.into());
        }
        Ok(Ok(Some((other, _)))) => {
            return Err(TransportError::Protocol {
                peer,
                transport: NAME,
                message: format!("expected {want} in the opening exchange, got {other:?}"),
            });
        }
        Ok(Ok(None)) => {
            return Err(lost_opening(
                peer,
                "the peer closed the connection during the opening exchange".into(),
            ));
        }
        Ok(Err(e)) => {
            return Err(lost_opening(
                peer,
                format!("the opening exchange failed: {e}"),
            ));
        }
        Err(_) => {
            return Err(lost_opening(
                peer,
                format!("no answer to the opening exchange within {hs:?}"),
            ));
        }
    };
    let Some(fd) = fd else {
        return Err(TransportError::Protocol {
            peer,
            transport: NAME,
            message: format!("the peer's {want} came without its file"),
        });
    };
    tokio::task::spawn_blocking(move || map::map_remote(0, fd, len))
        .await
        .unwrap_or_else(|e| {
            Err(ShmError::Map {
                what: format!("mapping the file of the peer's {want}"),
                source: std::io::Error::other(e.to_string()),
            })
        })
        .map_err(Into::into)
}

#[async_trait::async_trait]
impl KvTransport for ShmTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_reads(true)
            .with_cross_process(true)
            .with_max_ops_per_batch(None)
            .with_strided_ops(true)
    }

    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        self.inner.check_open()?;
        map::allocate(len).map_err(TransportError::from)
    }

    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        self.inner.check_open()?;
        self.capabilities().check_region(NAME, &region)?;
        let id = RegionId(self.inner.next_id());
        let shared = map::shared_of(&region);
        lock(&self.inner.regions).insert(
            id,
            LocalRegion {
                region,
                shared,
                gone: Arc::default(),
            },
        );
        Ok(id)
    }

    async fn deregister(&self, region: RegionId) -> Result<()> {
        self.inner.check_open()?;
        let Some(removed) = lock(&self.inner.regions).remove(&region) else {
            return Err(TransportError::UnknownRegion {
                side: Side::Local,
                region,
                transport: NAME,
            });
        };
        // Reads of this side into the region stop: the flag is checked in every copy step, and
        // once no step runs, every later one sees it.
        removed.gone.store(true, Ordering::Release);
        self.inner.batches.wait_for_steps();
        // Peers that mapped the region must stop writing into it before this returns.
        let conns = self.inner.inbound_conns();
        for conn in conns {
            self.inner.revoke(&conn, Some(region)).await;
        }
        Ok(())
    }

    fn local_descriptor(&self) -> Bytes {
        self.inner.descriptor.clone()
    }

    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        self.inner.check_open()?;
        let inner = &self.inner;
        let d = Descriptor::parse(descriptor).map_err(|message| TransportError::BadDescriptor {
            transport: NAME,
            message,
        })?;
        let hs = inner.options.handshake_timeout;
        let path = d.socket.display().to_string();
        let wire = dial(inner, &d, &path).await?;
        let peer = PeerId(inner.next_id());
        let (bell, reader) = opening_exchange(&wire, d.token, peer, hs).await?;
        let conn = Arc::new(Conn::new(peer, true, wire, Some(bell)));
        {
            let mut conns = lock(&inner.conns);
            inner.check_open()?;
            conns.insert(peer, Arc::clone(&conn));
        }
        let task = inner
            .rt
            .spawn(Arc::clone(inner).outbound_frames(Arc::clone(&conn), reader))
            .abort_handle();
        *lock(&conn.task) = Some(task);
        tracing::debug!(%peer, socket = %path, "shm: connected");
        Ok(peer)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        self.inner.check_open()?;
        let conn = lock(&self.inner.conns)
            .remove(&peer)
            .ok_or(TransportError::UnknownPeer {
                peer,
                transport: NAME,
            })?;
        self.inner
            .lose(&conn, "disconnected by this side".to_owned());
        if let Some(task) = lock(&conn.task).take() {
            task.abort();
        }
        Ok(())
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        self.inner.check_open()?;
        // Strided ops stay one descriptor each (native support); rows that overlap on the
        // destination are refused before anything else, as the expansion helper would.
        batch.check_destination_rows(NAME)?;
        let conn = self.inner.conn(peer)?;
        if !conn.outbound {
            return Err(TransportError::Unsupported {
                transport: NAME,
                operation: "posting batches to a peer that connected to this transport",
                remedy: "connect to the peer's descriptor and post on that connection",
            });
        }
        if conn.lost.load(Ordering::Acquire) {
            return Err(conn.peer_lost());
        }
        if let Some(n) = &batch.notification {
            if n.len() > proto::MAX_NOTIFICATION {
                return Err(TransportError::InvalidArgument {
                    transport: NAME,
                    message: format!(
                        "a notification of {} bytes exceeds the limit of {} bytes; send large \
                         data through a region",
                        n.len(),
                        proto::MAX_NOTIFICATION
                    ),
                });
            }
        }
        let now = Instant::now();
        let deadline = Instant::from_std(deadline_after(now.into_std(), batch.timeout));
        // Looking up the peer's regions is part of validation: bounded by the handshake timeout,
        // not by the batch deadline (a batch past its deadline still validates, then times out).
        let lookup_deadline = deadline.max(now + self.inner.options.handshake_timeout);
        let Validated {
            locals,
            local_gone,
            remotes,
            ops,
        } = self.validate(&conn, &batch, lookup_deadline).await?;
        let batch_bytes = batch.total_bytes();
        let id = self
            .inner
            .batches
            .insert(peer, batch.timeout, now.into_std())?;
        let jobs = lock(&self.inner.jobs).clone();
        let Some(jobs) = jobs else {
            self.inner.batches.forget(id);
            return Err(TransportError::Closed { transport: NAME });
        };
        let job = Job {
            batches: Arc::clone(&self.inner.batches),
            id,
            conn,
            direction: batch.direction,
            locals,
            local_gone,
            remotes,
            ops,
            stream: batch_bytes >= map::STREAM_MIN,
            notification: batch.notification,
            deadline: deadline.into_std(),
            rt: self.inner.rt.clone(),
        };
        if batch_bytes <= INLINE_BYTES {
            let rt = job.rt.clone();
            if let Some(commit) = copy_job(job) {
                InlineCommit {
                    commit: Some(Box::pin(commit)),
                    rt,
                }
                .await;
            }
            return Ok(id);
        }
        let outcome = match tokio::time::timeout_at(deadline, jobs.send(job)).await {
            Ok(Ok(())) => return Ok(id),
            Ok(Err(_)) => failed(id, peer, "the transport was shut down".into()),
            Err(_) => Outcome::TimedOut,
        };
        self.inner.batches.finish(id, outcome, self::now());
        Ok(id)
    }

    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        self.inner.check_open()?;
        self.inner.batches.state(batch, self::now())
    }

    async fn wait(&self, batch: BatchId) -> Result<()> {
        self.inner.check_open()?;
        self.inner.batches.wait(batch, sleep_until).await
    }

    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        self.inner.check_open()?;
        match self.inner.batches.cancel(batch, self::now())? {
            // Its notification is being written: report how it ends.
            BatchState::Pending => self.inner.batches.settle(batch, sleep_until).await,
            state => Ok(state),
        }
    }

    async fn recv_notification(&self) -> Result<Notification> {
        self.inner.check_open()?;
        let closed = self.inner.closed_notify.notified();
        tokio::pin!(closed);
        closed.as_mut().enable();
        self.inner.check_open()?;
        let mut rx = tokio::select! {
            rx = self.inner.notif_rx.lock() => rx,
            _ = &mut closed => return Err(TransportError::Closed { transport: NAME }),
        };
        tokio::select! {
            n = rx.recv() => n.ok_or(TransportError::Closed { transport: NAME }),
            _ = &mut closed => Err(TransportError::Closed { transport: NAME }),
        }
    }

    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        self.inner.check_open()?;
        let conn = self.inner.conn(peer)?;
        if conn.lost.load(Ordering::Acquire) {
            return Err(conn.peer_lost());
        }
        let nonce = conn.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&conn.pings).insert(nonce, tx);
        let exchange = async {
            conn.wire.send(&Frame::Ping { nonce }, None).await.ok()?;
            rx.await.ok()
        };
        let answered = tokio::time::timeout(timeout, exchange).await;
        lock(&conn.pings).remove(&nonce);
        match answered {
            Ok(Some(())) => Ok(()),
            Ok(None) => Err(conn.peer_lost()),
            Err(_) => Err(TransportError::PeerLost {
                peer,
                transport: NAME,
                reason: format!("no answer to a probe within {timeout:?}"),
            }),
        }
    }

    async fn shutdown(&self) -> Result<()> {
        self.inner.check_open()?;
        // Fence peers first: once this returns, no peer's transport writes into our regions.
        let conns = self.inner.inbound_conns();
        for conn in &conns {
            self.inner.revoke(conn, None).await;
        }
        self.inner.close();
        tracing::info!("shm: transport shut down");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_transport::{KvTransportExt, TransferOp};

    /// Gang turns taken by any copy worker of this test binary.
    pub(super) static GANG_TURNS: AtomicU64 = AtomicU64::new(0);

    /// A gang's pending batches go back to the front, in order, for `GANG_STREAK` turns in a
    /// row; the next turn sends them behind the others once, and the streak starts over.
    #[test]
    fn a_gang_keeps_the_front_for_a_bounded_streak() {
        // Batches 1 and 2 are a gang; 7 and 8 wait behind it.
        let mut turns: VecDeque<u32> = VecDeque::from([7, 8]);
        let mut streak = 0;
        for turn in 0..GANG_STREAK {
            requeue_gang(&mut turns, vec![1, 2], &mut streak);
            assert_eq!(turns, [1, 2, 7, 8], "turn {turn}");
            assert_eq!(streak, turn + 1);
            turns.drain(..2);
        }
        requeue_gang(&mut turns, vec![1, 2], &mut streak);
        assert_eq!(turns, [7, 8, 1, 2]);
        assert_eq!(streak, 0);
        // The gang behind now gets the front; a member that ended is not put back.
        turns.drain(..2);
        requeue_gang(&mut turns, vec![8], &mut streak);
        assert_eq!(turns, [8, 1, 2]);
        assert_eq!(streak, 1);
        // A gang that ended leaves the line as it was and the streak at zero.
        turns.pop_front();
        requeue_gang(&mut turns, Vec::new(), &mut streak);
        assert_eq!((turns, streak), (VecDeque::from([1, 2]), 0));
    }

    /// Concurrent first posts to a peer look its region up once. Each lookup maps (and
    /// populates) the whole region, so a first wave of N rooms used to map it N times, and
    /// every room of the wave waited for all of those mappings.
    #[tokio::test(flavor = "current_thread")]
    async fn concurrent_first_posts_look_a_peer_region_up_once() {
        const POSTS: u64 = 8;
        let receiver = ShmTransport::new().unwrap();
        let sender = Arc::new(ShmTransport::new().unwrap());
        let (dst, _) = receiver
            .allocate_registered((POSTS * 4096) as usize)
            .await
            .unwrap();
        let (src, _) = sender
            .allocate_registered((POSTS * 4096) as usize)
            .await
            .unwrap();
        let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
        let conn = sender.inner.conn(peer).unwrap();
        let before = conn.next_req.load(Ordering::Relaxed);
        let mut posts = tokio::task::JoinSet::new();
        for i in 0..POSTS {
            let sender = Arc::clone(&sender);
            posts.spawn(async move {
                let op = TransferOp::new(src, i * 4096, dst, i * 4096, 4096);
                sender.transfer(peer, TransferBatch::write(vec![op])).await
            });
        }
        while let Some(r) = posts.join_next().await {
            r.unwrap().unwrap();
        }
        let lookups = conn.next_req.load(Ordering::Relaxed) - before;
        assert_eq!(
            lookups, 1,
            "{POSTS} concurrent first posts sent {lookups} region lookups"
        );
    }

    /// Short notifications are one push into the peer's doorbell ring; longer ones still go
    /// over the socket. Both arrive, after their bytes.
    #[tokio::test]
    async fn short_notifications_ring_the_doorbell_and_long_ones_use_the_socket() {
        let receiver = ShmTransport::new().unwrap();
        let sender = ShmTransport::new().unwrap();
        let (dst, dst_region) = receiver.allocate_registered(8192).await.unwrap();
        let (src, src_region) = sender.allocate_registered(8192).await.unwrap();
        src_region.fill(0, 8192, 9).unwrap();
        let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
        let conn = sender.inner.conn(peer).unwrap();
        let bell = conn
            .bell
            .as_ref()
            .expect("an outbound connection has a ring");
        let wait = Duration::from_secs(30);
        for (i, len) in [
            (0u64, 7usize),
            (1, doorbell::SLOT_PAYLOAD),
            (2, 1000),
            (3, 0),
        ] {
            let op = TransferOp::new(src, i * 2048, dst, i * 2048, 2048);
            let payload = Bytes::from(vec![i as u8 + 1; len]);
            sender
                .transfer(
                    peer,
                    TransferBatch::write(vec![op]).with_notification(payload.clone()),
                )
                .await
                .unwrap();
            let n = tokio::time::timeout(wait, receiver.recv_notification())
                .await
                .expect("the notification never arrived")
                .unwrap();
            assert_eq!(n.payload, payload, "notification {i}");
            assert_eq!(
                dst_region.to_vec(i * 2048, 2048).unwrap(),
                vec![9; 2048],
                "batch {i}'s bytes"
            );
        }
        // The 1000-byte payload went over the socket.
        assert_eq!(bell.pushed(), 3);
    }

    /// A peer that writes garbage into the doorbell ring is dropped with the reason, on both
    /// sides; nothing hangs or panics.
    #[tokio::test]
    async fn a_peer_that_scribbles_on_the_doorbell_ring_is_dropped() {
        let receiver = ShmTransport::new().unwrap();
        let sender = ShmTransport::new().unwrap();
        let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
        let conn = sender.inner.conn(peer).unwrap();
        // A tail far ahead of anything pushed.
        conn.bell.as_ref().unwrap().scribble(0, 1 << 20);
        let dropped = async {
            loop {
                let inbound = receiver.inner.inbound_conns();
                if inbound.is_empty() && conn.lost.load(Ordering::Acquire) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), dropped)
            .await
            .expect("the connection of a peer that broke its ring was not dropped");
        let err = sender
            .probe(peer, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::PeerLost { .. }), "{err:?}");
    }

    /// Strided ops are moved natively, each as one descriptor: rows across chunk boundaries,
    /// rows longer than a chunk, and reads, land exactly where the rows say; rows that overlap
    /// on the destination are refused before anything moves.
    #[tokio::test]
    async fn strided_ops_move_natively_across_chunks() {
        const MIB: u64 = 1 << 20;
        let receiver = ShmTransport::new().unwrap();
        let sender = ShmTransport::new().unwrap();
        assert!(sender.capabilities().strided_ops);
        let (dst, dst_region) = receiver.allocate_registered(8 << 20).await.unwrap();
        let (src, src_region) = sender.allocate_registered(16 << 20).await.unwrap();
        let (back, back_region) = sender.allocate_registered(16 << 20).await.unwrap();
        let bytes: Vec<u8> = (0..16 * MIB).map(|i| (i * 31 + i / 4099) as u8).collect();
        src_region.write_at(0, &bytes).unwrap();
        let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
        // 3000 rows of 1152 bytes, every 4th row of the source, packed on the destination;
        // then 2 rows of 1.5 MiB (longer than a chunk), 2 MiB apart on the source.
        let dcp = TransferOp::new(src, 1152, dst, 0, 1152).with_rows(3000, 4 * 1152, 1152);
        let long = TransferOp::new(src, 12 * MIB, dst, 4 * MIB, 3 * MIB / 2).with_rows(
            2,
            2 * MIB,
            3 * MIB / 2 + 4096,
        );
        sender
            .transfer(peer, TransferBatch::write(vec![dcp, long]))
            .await
            .unwrap();
        let got = dst_region.to_vec(0, 8 * MIB).unwrap();
        for op in [dcp, long] {
            for row in op.rows() {
                let (s, d, n) = (
                    row.local_offset as usize,
                    row.remote_offset as usize,
                    row.len as usize,
                );
                assert_eq!(&got[d..d + n], &bytes[s..s + n], "row at {d}");
            }
        }
        // Read the packed rows back, spread every 3rd row on this side.
        let read = TransferOp::new(back, 0, dst, 0, 1152).with_rows(3000, 3 * 1152, 1152);
        sender
            .transfer(peer, TransferBatch::read(vec![read]))
            .await
            .unwrap();
        let spread = back_region.to_vec(0, 3000 * 3 * 1152).unwrap();
        for (i, row) in read.rows().enumerate() {
            let l = row.local_offset as usize;
            let s = dcp.local_offset as usize + i * 4 * 1152;
            assert_eq!(&spread[l..l + 1152], &bytes[s..s + 1152], "read row {i}");
        }
        let overlapping = TransferOp::new(src, 0, dst, 0, 1152).with_rows(2, 1152, 1000);
        let err = sender
            .post(peer, TransferBatch::write(vec![overlapping]))
            .await
            .unwrap_err();
        assert!(
            matches!(err, TransportError::InvalidArgument { .. }),
            "{err}"
        );
        let past = TransferOp::new(src, 0, dst, 0, 1152).with_rows(8000, 4 * 1152, 1152);
        let err = sender
            .post(peer, TransferBatch::write(vec![past]))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::OutOfBounds {
                    side: Side::Local,
                    ..
                }
            ),
            "{err}"
        );
    }

    /// A `post` dropped while writing a small batch's notification must not strand the batch:
    /// the rest of the commit runs as a task of its own.
    #[tokio::test]
    async fn an_inline_commit_dropped_half_way_still_runs_to_the_end() {
        let (go_tx, go_rx) = oneshot::channel::<()>();
        let (done_tx, done_rx) = oneshot::channel::<()>();
        let mut inline = Box::pin(InlineCommit {
            commit: Some(Box::pin(async move {
                let _ = go_rx.await;
                let _ = done_tx.send(());
            })),
            rt: tokio::runtime::Handle::current(),
        });
        // Polled once by the posting task: it waits on `go`.
        let polled = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(inline.as_mut().poll(cx).is_pending())
        })
        .await;
        assert!(polled, "the commit should wait for its signal");
        drop(inline);
        go_tx
            .send(())
            .expect("the dropped commit must still be alive");
        tokio::time::timeout(Duration::from_secs(30), done_rx)
            .await
            .expect("the detached commit never finished")
            .expect("the detached commit was dropped, not run");
    }

    /// Batches to four peers through one transport, their rows interleaved in one source as a
    /// DCP 1 -> 4 relayout posts them, are copied together (gang turns): each lands byte for byte with its
    /// notification, and cancelling the largest once its first rows landed leaves the others
    /// complete and the cancelled one fenced (nothing of it lands after `cancel` reports, and
    /// its notification never arrives).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_batches_take_turns_and_a_cancelled_one_is_fenced_alone() {
        const ROW: u64 = 1152;
        const ROWS: u64 = 8192;
        const LONG: u64 = 48 << 20;
        const CANCELLED: usize = 1;
        let wait = Duration::from_secs(60);
        let sender = ShmTransport::new().unwrap();
        let src_len = 4 * ROWS * ROW;
        let (src, src_region) = sender.allocate_registered(src_len as usize).await.unwrap();
        let (long_src, long_region) = sender.allocate_registered(LONG as usize).await.unwrap();
        let bytes: Vec<u8> = (0..src_len).map(|i| (i * 7 + i / 1153) as u8 | 1).collect();
        src_region.write_at(0, &bytes).unwrap();
        let long_bytes: Vec<u8> = (0..LONG).map(|i| (i * 13 + i / 4099) as u8 | 1).collect();
        long_region.write_at(0, &long_bytes).unwrap();
        let mut ranks = Vec::new();
        for rank in 0..4u64 {
            let receiver = ShmTransport::new().unwrap();
            let len = ROWS * ROW + if rank as usize == CANCELLED { LONG } else { 0 };
            let (dst, dst_region) = receiver.allocate_registered(len as usize).await.unwrap();
            let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
            // Rank r's rows are every 4th row of the source from row r, packed.
            let mut ops =
                vec![TransferOp::new(src, rank * ROW, dst, 0, ROW).with_rows(ROWS, 4 * ROW, ROW)];
            if rank as usize == CANCELLED {
                ops.push(TransferOp::new(long_src, 0, dst, ROWS * ROW, LONG));
            }
            let batch = TransferBatch::write(ops).with_notification(Bytes::from(vec![rank as u8]));
            ranks.push((receiver, peer, dst, dst_region, batch, len));
        }
        // Each peer's region mapped first (a write of zeros), so the four posts below follow
        // each other closely and their batches are copied together.
        let (zeros, _) = sender.allocate_registered(64).await.unwrap();
        for (_, peer, dst, _, _, _) in &ranks {
            sender
                .transfer(
                    *peer,
                    TransferBatch::write(vec![TransferOp::new(zeros, 0, *dst, 0, 64)]),
                )
                .await
                .unwrap();
        }
        let gang_turns = GANG_TURNS.load(Ordering::Relaxed);
        let mut ids = Vec::new();
        for (_, peer, _, _, batch, _) in &ranks {
            ids.push(sender.post(*peer, batch.clone()).await.unwrap());
        }
        // Cancel once its first row landed (every source byte is odd, the destination zeroed).
        let cancelled = &ranks[CANCELLED].3;
        tokio::time::timeout(wait, async {
            while cancelled.to_vec(0, 1).unwrap() == [0] {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the batch to cancel never started");
        let state = sender.cancel(ids[CANCELLED]).await.unwrap();
        let at_cancel = cancelled.to_vec(0, ranks[CANCELLED].5).unwrap();
        for (rank, (receiver, _, _, dst_region, _, len)) in ranks.iter().enumerate() {
            if rank == CANCELLED {
                continue;
            }
            tokio::time::timeout(wait, sender.wait(ids[rank]))
                .await
                .expect("a batch never finished")
                .unwrap_or_else(|e| panic!("rank {rank}'s batch failed: {e}"));
            let got = dst_region.to_vec(0, *len).unwrap();
            for row in 0..ROWS as usize {
                let s = (4 * row + rank) * ROW as usize;
                let d = row * ROW as usize;
                assert!(
                    got[d..d + ROW as usize] == bytes[s..s + ROW as usize],
                    "rank {rank}, row {row}"
                );
            }
            let n = tokio::time::timeout(wait, receiver.recv_notification())
                .await
                .expect("a notification never arrived")
                .unwrap();
            assert_eq!(
                &n.payload[..],
                &[rank as u8][..],
                "rank {rank}'s notification"
            );
        }
        // Every byte of the cancelled batch that landed is its own (a step may end inside a
        // row, so a row can be cut).
        let landed = |got: &[u8]| {
            for (d, &have) in got.iter().enumerate() {
                let (row, at) = (d / ROW as usize, d % ROW as usize);
                let want = if row < ROWS as usize {
                    bytes[(4 * row + CANCELLED) * ROW as usize + at]
                } else {
                    long_bytes[d - (ROWS * ROW) as usize]
                };
                assert!(have == 0 || have == want, "byte {d} of the cancelled batch");
            }
        };
        let (receiver, peer, dst, dst_region, _, len) = &ranks[CANCELLED];
        let got = dst_region.to_vec(0, *len).unwrap();
        landed(&got);
        match state {
            BatchState::Cancelled => {
                assert_eq!(got, at_cancel, "bytes landed after cancel reported");
            }
            // Finished before the cancel came (a very slow test task): then it is whole.
            BatchState::Done => assert!(got.iter().all(|&b| b != 0)),
            other => panic!("cancel reported {other:?}"),
        }
        // Notifications of one connection arrive in order: had the cancelled batch's been
        // sent, it would come before this one.
        sender
            .transfer(
                *peer,
                TransferBatch::write(vec![TransferOp::new(
                    src,
                    CANCELLED as u64 * ROW,
                    *dst,
                    0,
                    ROW,
                )])
                .with_notification(Bytes::from_static(b"after")),
            )
            .await
            .unwrap();
        let n = tokio::time::timeout(wait, receiver.recv_notification())
            .await
            .expect("the later notification never arrived")
            .unwrap();
        let expected: &[u8] = if matches!(state, BatchState::Cancelled) {
            b"after"
        } else {
            &[CANCELLED as u8]
        };
        assert_eq!(&n.payload[..], expected);
        // The interleaved rows went through gang turns (one pass over the source for all).
        assert!(
            GANG_TURNS.load(Ordering::Relaxed) > gang_turns,
            "no gang turn was taken"
        );
    }
}
