//! The batch table every transport needs: ids, states, deadlines, `wait` exactly once, cancel
//! and fencing — the lifecycle half of the [contract](crate::KvTransport#contract), written once.
//!
//! Sans-IO: no runtime, no clock, no thread. Callers pass the current [`Instant`] in and get
//! states out; `wait` sleeps with whatever timer the caller hands it, so the table works on any
//! executor (and on none: [`BatchTable`] is a plain `&mut self` state machine).
//!
//! Two layers:
//!
//! - [`BatchTable`]: the state machine. A transport with its own locking uses it directly.
//! - [`Batches`]: the table behind one mutex, with the two things every transport then writes
//!   by hand: a fence for the data mover ([`Batches::step`]) and an async
//!   [`wait`](Batches::wait) that wakes on completion or at the deadline.
//!
//! # Which contract points it carries
//!
//! - **2, every batch ends**: a pending batch is timed out as soon as any call passes a `now` at
//!   or after its deadline, and [`Batches::wait`] sleeps until the deadline at most (plus the
//!   commit grace for a committing batch), so `wait` returns by then even if the mover died.
//! - **3, fencing**: a final state is set only under the table's lock, and the mover moves
//!   bytes only inside [`Batches::step`], which holds that lock and runs nothing once the batch
//!   is final. Once `cancel`, `batch_state` or `wait` reported a failure, no step runs again.
//! - **4, notifications follow data**: deliver the notification inside the last `step`, the one
//!   that returns [`Step::Finish`]`(`[`Outcome::Done`]`)`; a batch made final first never runs it.
//!   A last piece that cannot be recalled once started (a notification write, posted work
//!   requests) is a [`Step::Commit`]: the batch then ends when that piece reports, and
//!   `cancel` waits for it ([`Batches::settle`]) instead of reporting a cancel it cannot keep.
//! - **5, peer loss**: [`Batches::fail_where`] fails every pending batch of a peer.
//! - **7, ids**: ids are handed out in increasing order and never reused; `wait` returns a final
//!   state exactly once and removes the batch; afterwards, and for ids never handed out, every
//!   call says [`TransportError::UnknownBatch`]. `cancel` of a finished batch returns its final
//!   state. A final state never changes.
//!
//! The transport still owns bounds (1), exact data (6), capabilities (8) and shutdown (9); for
//! 9 it calls [`Batches::fail_where`] so batches in flight reach a final state.
//!
//! # Example
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvbridge_transport::batch::{Batches, Outcome, Step};
//! use kvbridge_transport::{BatchState, PeerId};
//!
//! let batches = Batches::new("my-engine");
//! let t0 = Instant::now();
//! let id = batches.insert(PeerId(1), Duration::from_secs(5), t0).unwrap();
//! // The mover: one step per chunk, each under the fence.
//! assert!(batches.step(id, t0, || Step::Continue));
//! assert!(!batches.step(id, t0, || Step::Finish(Outcome::Done)));
//! assert_eq!(batches.cancel(id, t0).unwrap(), BatchState::Done);
//! assert!(batches.collect(id, t0).is_ready()); // what `wait` returns, once
//! assert!(batches.state(id, t0).is_err()); // unknown from now on
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::{BatchId, BatchState, PeerId, Result, TransportError};

/// The hasher of maps keyed by ids this side hands out itself (batch ids, region ids,
/// peer ids: sequential `u64`s): one multiplication where the default SipHash takes tens of
/// nanoseconds, several times per small batch. Never use it for keys a peer picks (they could
/// be chosen to collide); the default hasher guards those.
pub type LocalIds = BuildHasherDefault<LocalIdHasher>;

/// See [`LocalIds`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalIdHasher(u64);

/// Odd, with its bits spread (2^64 / golden ratio): multiplying by it spreads sequential ids
/// over both the low bits (the bucket) and the high bits (the tag) of the hash.
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for LocalIdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(SPREAD);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(32) ^ n).wrapping_mul(SPREAD);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// How a batch ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome {
    /// Every byte is visible at the destination (and the notification, if any, was delivered).
    Done,
    /// Cancelled by [`cancel`](crate::KvTransport::cancel).
    Cancelled,
    /// Its deadline passed first.
    TimedOut,
    /// Failed with this error; `wait` returns it as is.
    Failed(TransportError),
}

/// What a step of the data mover did (see [`Batches::step`]).
#[derive(Debug)]
pub enum Step {
    /// More to move.
    Continue,
    /// The batch ends with this outcome (the last chunk moved: [`Outcome::Done`]).
    Finish(Outcome),
    /// The last piece (e.g. the notification write) is now in flight and cannot be recalled;
    /// whoever carries it calls [`Batches::finish`]. Until then the batch is *committing*: no
    /// step runs, `cancel` and peer failure leave it alone (it may still land), and if it is
    /// still unfinished at its deadline plus the table's
    /// [commit grace](BatchTable::with_commit_grace), the [`Fence`] runs first and the batch
    /// then times out.
    Commit(Fence),
}

/// What makes a committing batch's last piece unable to land (e.g. closing its connection),
/// run once if the batch must end before that piece reports. It runs under the table's lock,
/// so it must not call the table.
pub struct Fence(Box<dyn FnOnce() + Send>);

impl Fence {
    /// A fence that runs `f`.
    pub fn new(f: impl FnOnce() + Send + 'static) -> Self {
        Self(Box::new(f))
    }

    /// A fence with nothing to do (the piece is bounded by the deadline on its own).
    pub fn none() -> Self {
        Self::new(|| {})
    }
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fence")
    }
}

#[derive(Debug)]
struct Entry {
    peer: PeerId,
    timeout: Duration,
    posted: Instant,
    deadline: Instant,
    outcome: Option<Outcome>,
    /// `Some` once committing: the fence, until it ran.
    commit: Option<Option<Fence>>,
    wakers: Vec<Waker>,
}

impl Entry {
    /// When the batch times out: its deadline, plus `grace` once committing.
    fn end(&self, grace: Duration) -> Instant {
        match self.commit {
            None => self.deadline,
            Some(_) => self.deadline.checked_add(grace).unwrap_or(self.deadline),
        }
    }

    /// Times the batch out if `now` is past its end (fencing a committing one first); returns
    /// whether it is still not final.
    fn pending_at(&mut self, now: Instant, grace: Duration) -> bool {
        if self.outcome.is_none() && now >= self.end(grace) {
            if let Some(fence) = self.commit.as_mut().and_then(Option::take) {
                (fence.0)();
            }
            self.outcome = Some(Outcome::TimedOut);
        }
        self.outcome.is_none()
    }

    /// Not final and not committing: the mover may move bytes.
    fn movable_at(&mut self, now: Instant, grace: Duration) -> bool {
        self.pending_at(now, grace) && self.commit.is_none()
    }

    fn state(&self) -> BatchState {
        match &self.outcome {
            None => BatchState::Pending,
            Some(Outcome::Done) => BatchState::Done,
            Some(Outcome::Cancelled) => BatchState::Cancelled,
            Some(Outcome::TimedOut) => BatchState::TimedOut,
            Some(Outcome::Failed(e)) => BatchState::Failed(e.to_string()),
        }
    }
}

/// Wakers of `wait`s to wake once the table's lock is released.
#[derive(Debug, Default)]
#[must_use = "wake the waiters after releasing the lock around the table"]
pub struct Wakeups(Vec<Waker>);

impl Wakeups {
    /// Wakes every waiter.
    pub fn wake(self) {
        self.0.into_iter().for_each(Waker::wake);
    }

    fn extend(&mut self, other: Wakeups) {
        self.0.extend(other.0);
    }
}

/// The deadline of a batch posted at `now` with `timeout`; a timeout too large for the clock
/// means "about a century" rather than a panic.
pub fn deadline_after(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// The batch lifecycle as a plain state machine: `&mut self`, explicit instants, no I/O.
///
/// Every method takes the caller's `now` where a deadline may have passed and applies it first
/// (a pending batch at or past its deadline becomes [`BatchState::TimedOut`]). Methods that
/// finish batches return the [`Wakeups`] of their `wait`ers, to be woken after the caller's
/// lock is released. [`Batches`] does all of that for you.
#[derive(Debug)]
pub struct BatchTable {
    transport: &'static str,
    next: u64,
    limit: Option<usize>,
    grace: Duration,
    entries: HashMap<BatchId, Entry, LocalIds>,
}

impl BatchTable {
    /// An empty table for the transport named `transport` (used in errors).
    pub fn new(transport: &'static str) -> Self {
        Self {
            transport,
            next: 1,
            limit: None,
            grace: Duration::ZERO,
            entries: HashMap::default(),
        }
    }

    /// Refuses new batches while `max` batches await `wait` (bounds the memory a caller that
    /// never waits can pin).
    pub fn with_limit(mut self, max: usize) -> Self {
        self.limit = Some(max);
        self
    }

    /// How long past its deadline a committing batch's last piece may take before the batch is
    /// fenced and timed out (default zero).
    pub fn with_commit_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    fn unknown(&self, batch: BatchId) -> TransportError {
        TransportError::UnknownBatch {
            batch,
            transport: self.transport,
        }
    }

    fn entry(&mut self, id: BatchId) -> Result<&mut Entry> {
        let transport = self.transport;
        self.entries
            .get_mut(&id)
            .ok_or(TransportError::UnknownBatch {
                batch: id,
                transport,
            })
    }

    /// Starts tracking a batch posted to `peer` at `now`; its deadline is `now + timeout`.
    /// Refused with `InvalidArgument` when the [limit](Self::with_limit) is reached.
    pub fn insert(&mut self, peer: PeerId, timeout: Duration, now: Instant) -> Result<BatchId> {
        if let Some(max) = self.limit.filter(|&m| self.entries.len() >= m) {
            return Err(TransportError::InvalidArgument {
                transport: self.transport,
                message: format!(
                    "{max} batches are waiting for `wait` to collect their final state; call \
                     `wait` on finished batches before posting more"
                ),
            });
        }
        let id = BatchId(self.next);
        self.next += 1;
        self.entries.insert(
            id,
            Entry {
                peer,
                timeout,
                posted: now,
                deadline: deadline_after(now, timeout),
                outcome: None,
                commit: None,
                wakers: Vec::new(),
            },
        );
        Ok(id)
    }

    /// Forgets a batch that `post` could not hand to its mover after all (the caller then
    /// returns an error instead of the id). Its id is not reused.
    pub fn forget(&mut self, id: BatchId) -> Wakeups {
        Wakeups(
            self.entries
                .remove(&id)
                .map(|e| e.wakers)
                .unwrap_or_default(),
        )
    }

    /// The peer a batch was posted to.
    pub fn peer(&self, id: BatchId) -> Option<PeerId> {
        self.entries.get(&id).map(|e| e.peer)
    }

    /// When a batch times out (for a committing one: without its grace).
    pub fn deadline(&self, id: BatchId) -> Option<Instant> {
        self.entries.get(&id).map(|e| e.deadline)
    }

    /// The timeout a batch was posted with: what [`TransportError::TimedOut`] reports.
    pub fn timeout(&self, id: BatchId) -> Option<Duration> {
        self.entries.get(&id).map(|e| e.timeout)
    }

    /// When a batch that is not final by then times out: its deadline, plus the commit grace
    /// once committing.
    pub fn end(&self, id: BatchId) -> Option<Instant> {
        self.entries.get(&id).map(|e| e.end(self.grace))
    }

    /// Number of batches whose final state `wait` has not collected yet.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no batch is tracked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the batch is known, not final and not committing at `now`: the mover's check.
    pub fn is_pending(&mut self, id: BatchId, now: Instant) -> bool {
        let grace = self.grace;
        self.entries
            .get_mut(&id)
            .is_some_and(|e| e.movable_at(now, grace))
    }

    /// Makes a movable batch committing (see [`Step::Commit`]); returns whether it did.
    pub fn commit(&mut self, id: BatchId, fence: Fence, now: Instant) -> bool {
        let grace = self.grace;
        let Some(e) = self.entries.get_mut(&id) else {
            return false;
        };
        let movable = e.movable_at(now, grace);
        if movable {
            e.commit = Some(Some(fence));
        }
        movable
    }

    /// `batch_state`: the state at `now` (a committing batch is still pending).
    pub fn state(&mut self, id: BatchId, now: Instant) -> Result<BatchState> {
        let grace = self.grace;
        let e = self.entry(id)?;
        e.pending_at(now, grace);
        Ok(e.state())
    }

    /// Records the final outcome of a pending batch; a batch already final (or unknown) keeps
    /// what it has. Returns whether this call set it, and the waiters to wake.
    pub fn finish(&mut self, id: BatchId, outcome: Outcome, now: Instant) -> (bool, Wakeups) {
        let grace = self.grace;
        let Some(e) = self.entries.get_mut(&id) else {
            return (false, Wakeups::default());
        };
        let set = e.pending_at(now, grace);
        if set {
            e.outcome = Some(outcome);
        }
        // Also when it was final already (or timed out just now): waiters sleep until the
        // deadline anyway, but waking them lets them collect promptly.
        (set, Wakeups(std::mem::take(&mut e.wakers)))
    }

    /// `cancel`: a pending batch becomes [`BatchState::Cancelled`]; a final one reports the
    /// final state it has. Fencing is the caller's: with [`Batches::step`] it is implied. A
    /// committing batch cannot be cancelled (its last piece may still land): it stays
    /// [`BatchState::Pending`], and [`Batches::settle`] waits for how it ends.
    pub fn cancel(&mut self, id: BatchId, now: Instant) -> Result<(BatchState, Wakeups)> {
        let grace = self.grace;
        let e = self.entry(id)?;
        let wakeups = Wakeups(std::mem::take(&mut e.wakers));
        if e.movable_at(now, grace) {
            e.outcome = Some(Outcome::Cancelled);
        }
        Ok((e.state(), wakeups))
    }

    /// Fails, with `error(id, peer)`, every pending batch whose peer matches `which` (peer loss,
    /// disconnect, shutdown). Committing batches are left to whoever carries their last piece.
    pub fn fail_where(
        &mut self,
        which: impl Fn(PeerId) -> bool,
        error: impl Fn(BatchId, PeerId) -> TransportError,
    ) -> Wakeups {
        let mut wakeups = Wakeups::default();
        for (&id, e) in self.entries.iter_mut() {
            if e.outcome.is_none() && e.commit.is_none() && which(e.peer) {
                e.outcome = Some(Outcome::Failed(error(id, e.peer)));
                wakeups.extend(Wakeups(std::mem::take(&mut e.wakers)));
            }
        }
        wakeups
    }

    /// `wait` without the waiting: the final result, exactly once (the batch is then
    /// forgotten), or `Pending`. Unknown and already collected ids are
    /// `Ready(Err(UnknownBatch))`.
    pub fn collect(&mut self, id: BatchId, now: Instant) -> Poll<Result<()>> {
        let (transport, grace) = (self.transport, self.grace);
        let Some(e) = self.entries.get_mut(&id) else {
            return Poll::Ready(Err(TransportError::UnknownBatch {
                batch: id,
                transport,
            }));
        };
        if e.pending_at(now, grace) {
            return Poll::Pending;
        }
        let Some(e) = self.entries.remove(&id) else {
            return Poll::Ready(Err(self.unknown(id)));
        };
        Poll::Ready(match e.outcome {
            None | Some(Outcome::Done) => Ok(()),
            Some(Outcome::Cancelled) => Err(TransportError::Cancelled { batch: id }),
            Some(Outcome::TimedOut) => Err(TransportError::TimedOut {
                batch: id,
                timeout: e.timeout,
            }),
            Some(Outcome::Failed(err)) => Err(err),
        })
    }

    /// Registers a waker to wake when the batch becomes final (by any call but a deadline
    /// passing: waiters sleep until the deadline themselves).
    pub fn register_waker(&mut self, id: BatchId, waker: &Waker) {
        if let Some(e) = self.entries.get_mut(&id) {
            if !e.wakers.iter().any(|w| w.will_wake(waker)) {
                e.wakers.push(waker.clone());
            }
        }
    }
}

/// A [`BatchTable`] behind one mutex: the table a transport keeps, with the data mover's fence
/// and an executor-agnostic `wait`.
///
/// Lock discipline: the closure given to [`step`](Self::step) runs under the table's lock, so
/// it must not call back into this table (it may take the transport's other locks, as long as
/// no code holding those calls into the table).
#[derive(Debug)]
pub struct Batches {
    table: Mutex<BatchTable>,
}

impl Batches {
    /// An empty table for the transport named `transport`.
    pub fn new(transport: &'static str) -> Self {
        Self::from_table(BatchTable::new(transport))
    }

    /// Wraps a configured table (e.g. [`BatchTable::with_limit`]).
    pub fn from_table(table: BatchTable) -> Self {
        Self {
            table: Mutex::new(table),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BatchTable> {
        crate::sync::lock(&self.table)
    }

    /// See [`BatchTable::insert`].
    pub fn insert(&self, peer: PeerId, timeout: Duration, now: Instant) -> Result<BatchId> {
        self.lock().insert(peer, timeout, now)
    }

    /// [`insert`](Self::insert), then [`step`](Self::step) with [`Step::Commit`]`(fence)`, under
    /// one lock (for a transport whose batches commit as they are posted, so a small batch pays
    /// for one lock, not two): the new id and its deadline.
    pub fn insert_committed(
        &self,
        peer: PeerId,
        timeout: Duration,
        now: Instant,
        fence: Fence,
    ) -> Result<(BatchId, Instant)> {
        let mut table = self.lock();
        let id = table.insert(peer, timeout, now)?;
        table.commit(id, fence, now);
        Ok((id, table.deadline(id).unwrap_or(now)))
    }

    /// See [`BatchTable::forget`].
    pub fn forget(&self, id: BatchId) {
        let wakeups = self.lock().forget(id);
        wakeups.wake();
    }

    /// See [`BatchTable::deadline`].
    pub fn deadline(&self, id: BatchId) -> Option<Instant> {
        self.lock().deadline(id)
    }

    /// See [`BatchTable::timeout`].
    pub fn timeout(&self, id: BatchId) -> Option<Duration> {
        self.lock().timeout(id)
    }

    /// See [`BatchTable::end`].
    pub fn end(&self, id: BatchId) -> Option<Instant> {
        self.lock().end(id)
    }

    /// See [`BatchTable::peer`].
    pub fn peer(&self, id: BatchId) -> Option<PeerId> {
        self.lock().peer(id)
    }

    /// See [`BatchTable::len`].
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// See [`BatchTable::is_empty`].
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// `batch_state`. See [`BatchTable::state`].
    pub fn state(&self, id: BatchId, now: Instant) -> Result<BatchState> {
        self.lock().state(id, now)
    }

    /// Records a final outcome (see [`BatchTable::finish`]); returns whether this call set it.
    pub fn finish(&self, id: BatchId, outcome: Outcome, now: Instant) -> bool {
        let (set, wakeups) = self.lock().finish(id, outcome, now);
        wakeups.wake();
        set
    }

    /// `cancel`: returns [`BatchState::Cancelled`] or the final state the batch already had.
    /// Because the mover moves bytes only inside [`step`](Self::step), under the same lock,
    /// no byte of a cancelled batch moves once this returns.
    pub fn cancel(&self, id: BatchId, now: Instant) -> Result<BatchState> {
        let (state, wakeups) = self.lock().cancel(id, now)?;
        wakeups.wake();
        Ok(state)
    }

    /// See [`BatchTable::fail_where`].
    pub fn fail_where(
        &self,
        which: impl Fn(PeerId) -> bool,
        error: impl Fn(BatchId, PeerId) -> TransportError,
    ) {
        let wakeups = self.lock().fail_where(which, error);
        wakeups.wake();
    }

    /// See [`BatchTable::collect`].
    pub fn collect(&self, id: BatchId, now: Instant) -> Poll<Result<()>> {
        self.lock().collect(id, now)
    }

    /// Returns once no [`step`](Self::step) is running: a condition the mover checks inside its
    /// steps, set before this call, holds for every step that runs afterwards. `deregister`
    /// uses it: mark the region gone, then `wait_for_steps`, and no byte of any batch touches
    /// the region once `deregister` returns.
    pub fn wait_for_steps(&self) {
        drop(self.lock());
    }

    /// The fence: runs `f` (one chunk of the mover's work) under the table's lock if the batch
    /// is pending at `now`, and records the outcome `f` returns with [`Step::Finish`]. Returns
    /// whether the batch is still pending afterwards, i.e. whether to run the next step; once
    /// it returns `false` the mover stops. `f` never runs for a batch that is final, so no byte
    /// moves after `cancel`, a deadline or a failure was reported.
    pub fn step(&self, id: BatchId, now: Instant, f: impl FnOnce() -> Step) -> bool {
        let mut table = self.lock();
        if !table.is_pending(id, now) {
            return false;
        }
        match f() {
            Step::Continue => true,
            Step::Finish(outcome) => {
                let (_, wakeups) = table.finish(id, outcome, now);
                drop(table);
                wakeups.wake();
                false
            }
            Step::Commit(fence) => {
                table.commit(id, fence, now);
                false
            }
        }
    }

    /// [`step`](Self::step) for several batches at once, for a mover that moves their bytes
    /// together (e.g. one pass over a source that several batches read rows of): `f` runs
    /// once under the table's lock with `pending[i]` telling whether `ids[i]` is pending at
    /// `now`, and returns one step per id (the step of a batch that was not pending is
    /// ignored: `f` must move no byte of it). Returns, per id, whether the batch is still
    /// pending afterwards. `f` does not run when none is pending.
    pub fn step_many(
        &self,
        ids: &[BatchId],
        now: Instant,
        f: impl FnOnce(&[bool]) -> Vec<Step>,
    ) -> Vec<bool> {
        let mut table = self.lock();
        let pending: Vec<bool> = ids.iter().map(|&id| table.is_pending(id, now)).collect();
        if !pending.contains(&true) {
            return pending;
        }
        let steps = f(&pending);
        let mut wakeups = Wakeups::default();
        let mut still = vec![false; ids.len()];
        for (i, step) in steps.into_iter().enumerate().take(ids.len()) {
            if !pending[i] {
                continue;
            }
            match step {
                Step::Continue => still[i] = true,
                Step::Finish(outcome) => wakeups.extend(table.finish(ids[i], outcome, now).1),
                Step::Commit(fence) => {
                    table.commit(ids[i], fence, now);
                }
            }
        }
        drop(table);
        wakeups.wake();
        still
    }

    /// `wait`: resolves with the batch's final result exactly once (see
    /// [`BatchTable::collect`]), when it becomes final or when it times out, whichever is first.
    ///
    /// `sleep_until` is the caller's timer (e.g. `|at| tokio::time::sleep_until(at.into())`):
    /// the only clock `wait` uses. Once a sleep until the batch's [end](BatchTable::end) has
    /// completed, the batch counts as timed out if it is still not final.
    pub async fn wait<F>(&self, id: BatchId, sleep_until: impl FnMut(Instant) -> F) -> Result<()>
    where
        F: Future<Output = ()>,
    {
        self.until_final(id, sleep_until, |table, now| table.collect(id, now))
            .await
    }

    /// Waits, like [`wait`](Self::wait), until the batch is final and returns its state
    /// without collecting it (so `wait` still returns it once): what `cancel` returns for a
    /// committing batch.
    pub async fn settle<F>(
        &self,
        id: BatchId,
        sleep_until: impl FnMut(Instant) -> F,
    ) -> Result<BatchState>
    where
        F: Future<Output = ()>,
    {
        self.until_final(id, sleep_until, |table, now| match table.state(id, now) {
            Ok(BatchState::Pending) => Poll::Pending,
            other => Poll::Ready(other),
        })
        .await
    }

    async fn until_final<T, F>(
        &self,
        id: BatchId,
        mut sleep_until: impl FnMut(Instant) -> F,
        mut take: impl FnMut(&mut BatchTable, Instant) -> Poll<Result<T>>,
    ) -> Result<T>
    where
        F: Future<Output = ()>,
    {
        // `known`: the latest instant known to have passed (the posting, then each end the
        // timer reached).
        let (mut known, mut end) = {
            let table = self.lock();
            match table.entries.get(&id) {
                Some(e) => (e.posted, e.end(table.grace)),
                None => return Err(table.unknown(id)),
            }
        };
        let mut sleep = std::pin::pin!(sleep_until(end));
        let mut fired = false;
        std::future::poll_fn(|cx| {
            loop {
                if !fired && sleep.as_mut().poll(cx).is_ready() {
                    fired = true;
                    known = known.max(end);
                }
                let mut table = self.lock();
                if let Poll::Ready(r) = take(&mut table, known) {
                    return Poll::Ready(r);
                }
                table.register_waker(id, cx.waker());
                // The end moves once the batch commits: sleep again until the new one.
                match table.end(id) {
                    Some(later) if fired && later > end => {
                        drop(table);
                        end = later;
                        sleep.set(sleep_until(end));
                        fired = false;
                    }
                    _ => return Poll::Pending,
                }
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests;
