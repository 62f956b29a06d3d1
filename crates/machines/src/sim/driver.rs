//! A prefill room's driver, as the coordinator's `RoomDriver` (`prefill/send.rs`) runs: it takes
//! one chunk at a time and posts it to every non-dummy decode rank (one post after the other,
//! without looking at the room in between), follows the batches with [`SendProgress`] (their
//! results wait while a chunk is being posted), posts the aux rows after the last chunk and reports
//! `Delivered`. Once the room failed (its own batch, or the machine's `CancelBatches`) it finishes
//! the chunk in hand, cancels every batch in flight at once, waits for the cancels within the grace
//! and for the waiters, and reports `DriverEnded`, poisoned when some batch could not be proven
//! final.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use kvbridge_transport::{BatchId, PeerId};

use super::checks::Invariant;
use super::prefill_node::SimConn;
use super::schedule::FENCE_GRACE;
use super::transport::Payload;
use super::world::{Ev, PrefillLifeId, World};
use crate::prefill::{BatchAction, BatchEvent, Event, RankEvent, SendProgress};
use crate::{FailureCause, FailureReason};
use kvbridge_control::Incarnation;
use kvbridge_control::TransferInfo;

/// A decode rank the room sends to, as the driver took it when it started.
#[derive(Debug)]
pub(super) struct Sender {
    pub(super) conn: SimConn,
    pub(super) info: TransferInfo,
}

#[derive(Debug, Clone, Copy)]
struct Job {
    first_token: u64,
    tokens: u64,
    is_last: bool,
}

/// The chunk being posted: the next decode rank to post it to, and what the accounting
/// asked for so far.
#[derive(Debug)]
struct InHand {
    job: Job,
    next: usize,
    due: Vec<BatchAction>,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Sending,
    /// Cancels not returned yet.
    Cancelling(BTreeSet<BatchId>),
    /// Waiting for the batches' waiters.
    Draining,
    Ended,
}

/// What a batch's waiter saw.
#[derive(Debug)]
pub(super) enum Waited {
    Done {
        bytes: u64,
    },
    Failed {
        lost: bool,
        peer: PeerId,
    },
    /// Not final within its deadline plus the grace.
    Hung,
}

/// A waiter's result the driver has not read yet (`sender`: decode rank, aux).
type Unread = (BatchId, (usize, bool), Waited);

#[derive(Debug)]
pub(super) struct DriverSim {
    incarnation: Incarnation,
    pub(super) senders: Vec<Sender>,
    progress: SendProgress,
    jobs: VecDeque<Job>,
    in_hand: Option<InHand>,
    planning: bool,
    /// Batches whose waiter has not ended.
    waiting: BTreeSet<BatchId>,
    /// Waiter results that came while a chunk was being posted.
    unread: VecDeque<Unread>,
    posted_to: Vec<bool>,
    /// The machine asked for the fence: no new chunk is taken.
    cancel_seen: bool,
    pub(super) delivered: bool,
    pub(super) phase: Phase,
    poisoned: bool,
}

impl DriverSim {
    fn new(incarnation: Incarnation, senders: Vec<Sender>) -> Self {
        Self {
            incarnation,
            progress: SendProgress::new(senders.len()),
            posted_to: vec![false; senders.len()],
            senders,
            jobs: VecDeque::new(),
            in_hand: None,
            planning: false,
            waiting: BTreeSet::new(),
            unread: VecDeque::new(),
            cancel_seen: false,
            delivered: false,
            phase: Phase::Sending,
            poisoned: false,
        }
    }

    /// Whether the driver's loop is where it looks at the room's state and its waiters.
    fn idle(&self) -> bool {
        self.phase == Phase::Sending && self.in_hand.is_none()
    }
}

impl World {
    fn driver(&mut self, id: PrefillLifeId) -> Option<&mut DriverSim> {
        self.prefill_life(id)?.driver.as_mut()
    }

    /// `PostChunk`: the chunk being handed over is queued to the room's driver, started first
    /// when the machine says so.
    pub(super) fn queue_job(&mut self, id: PrefillLifeId, token_offset: u64, start: bool) {
        let n = &mut self.prefills[id.p];
        let (Some(chunk), Some(room)) = (n.handing.take(), n.machine.room(id.room)) else {
            return;
        };
        let prefix = room.prefix().unwrap_or(0);
        let fresh = start.then(|| {
            let senders = room.peers().iter().filter_map(|m| {
                let conn = m.peer.clone()?;
                let info = m.info.clone();
                Some(Sender { conn, info })
            });
            DriverSim::new(room.incarnation(), senders.collect())
        });
        let Some(life) = self.prefill_life(id) else {
            return;
        };
        if let Some(d) = fresh {
            life.driver = Some(d);
        }
        let Some(d) = life.driver.as_mut() else {
            return;
        };
        d.jobs.push_back(Job {
            first_token: prefix + token_offset,
            tokens: chunk.tokens,
            is_last: chunk.is_last,
        });
        self.next_job(id);
    }

    /// Plans the next chunk (off the loop, a few milliseconds) if the loop is free for it.
    fn next_job(&mut self, id: PrefillLifeId) {
        let Some(d) = self.driver(id) else {
            return;
        };
        if !d.idle() || d.planning || d.jobs.is_empty() {
            return;
        }
        d.planning = true;
        let after = self.rng.millis(0, 5);
        self.schedule(after, Ev::Planned(id));
    }

    /// `CancelBatches`: no more chunks; the fence starts once the chunk in hand is posted.
    pub(super) fn cancel_batches(&mut self, id: PrefillLifeId) {
        let keep_posting = self.sabotage.post_after_cancel;
        let Some(d) = self.driver(id) else {
            return;
        };
        d.cancel_seen = true;
        if !keep_posting {
            d.jobs.clear();
        }
        self.schedule(Duration::ZERO, Ev::Fence(id));
    }

    /// A chunk is planned: it is posted to each decode rank in turn.
    pub(super) fn planned(&mut self, id: PrefillLifeId) {
        let keep_posting = self.sabotage.post_after_cancel;
        let Some(d) = self.driver(id) else {
            return;
        };
        d.planning = false;
        if d.cancel_seen && !keep_posting {
            return;
        }
        let Some(job) = d.jobs.pop_front() else {
            return;
        };
        if d.cancel_seen {
            let what = format!(
                "prefill-{} took a new chunk of room {} after its CancelBatches",
                id.p, id.room
            );
            self.violate(Invariant::FenceHolds, what);
        }
        let Some(d) = self.driver(id) else {
            return;
        };
        d.in_hand = Some(InHand {
            job,
            next: 0,
            due: Vec::new(),
        });
        self.post_next(id);
    }

    /// Posts the chunk in hand to the next decode rank; once every rank has it, the loop
    /// carries out what the accounting asks and goes on.
    pub(super) fn post_next(&mut self, id: PrefillLifeId) {
        let keep_posting = self.sabotage.post_after_cancel;
        let Some(d) = self.driver(id) else {
            return;
        };
        let Some(hand) = &d.in_hand else {
            return;
        };
        let (job, pi) = (hand.job, hand.next);
        // The room failed meanwhile: the rest of the chunk stays unposted, as the real
        // driver checks the room's state before each decode rank.
        if d.cancel_seen && !keep_posting {
            d.in_hand = None;
            return self.loop_top(id);
        }
        if pi < d.senders.len() {
            let payload = Payload::Kv {
                first: job.first_token,
                tokens: job.tokens,
            };
            let posted = self.post(id, pi, payload);
            let Some(d) = self.driver(id) else {
                return;
            };
            let Some(hand) = d.in_hand.as_mut() else {
                return;
            };
            match posted {
                Ok(more) => {
                    hand.due.extend(more);
                    hand.next += 1;
                    let after = self.rng.millis(0, 2);
                    return self.schedule(after, Ev::PostNext(id));
                }
                Err(reason) => {
                    d.in_hand = None;
                    return self.driver_failed(id, reason);
                }
            }
        }
        let Some(mut hand) = d.in_hand.take() else {
            return;
        };
        if job.is_last {
            hand.due
                .extend(d.progress.handle(BatchEvent::LastChunkPosted));
        }
        self.follow(id, hand.due);
        self.loop_top(id);
    }

    /// The top of the driver's loop: a failed room is fenced; otherwise the waiters' results
    /// that came meanwhile are read, then the next chunk is taken.
    fn loop_top(&mut self, id: PrefillLifeId) {
        loop {
            let Some(d) = self.driver(id) else {
                return;
            };
            if !d.idle() {
                return;
            }
            if d.cancel_seen {
                return self.begin_fence(id);
            }
            let Some((batch, sender, waited)) = d.unread.pop_front() else {
                break;
            };
            self.read_waited(id, batch, sender, waited);
        }
        self.next_job(id);
    }

    /// Carries out what the batch accounting asks (aux posts, the delivery).
    fn follow(&mut self, id: PrefillLifeId, mut due: Vec<BatchAction>) {
        while let Some(action) = due.pop() {
            match action {
                BatchAction::PostAux { peer } => match self.post_aux(id, peer) {
                    Ok(more) => due.extend(more),
                    Err(reason) => return self.driver_failed(id, reason),
                },
                BatchAction::Delivered { bytes } => {
                    let Some(d) = self.driver(id) else {
                        return;
                    };
                    d.delivered = true;
                    let incarnation = d.incarnation;
                    let event = Event::Delivered { incarnation, bytes };
                    self.room_step(id, incarnation, event);
                    // Delivered: the driver ends (nothing is in flight to fence).
                    return self.begin_fence(id);
                }
            }
        }
    }

    fn post_aux(
        &mut self,
        id: PrefillLifeId,
        pi: usize,
    ) -> Result<Vec<BatchAction>, FailureReason> {
        let has_aux = self.knobs.topology.has_aux;
        let Some(d) = self.driver(id) else {
            return Ok(Vec::new());
        };
        if has_aux && d.senders[pi].info.dst_aux_index.is_some() {
            self.post(id, pi, Payload::Aux)
        } else {
            Ok(d.progress.handle(BatchEvent::NoAux { peer: pi }))
        }
    }

    /// Posts a batch to decode rank `pi`; a connection lost before this room sent it anything
    /// is connected again once.
    fn post(
        &mut self,
        id: PrefillLifeId,
        pi: usize,
        payload: Payload,
    ) -> Result<Vec<BatchAction>, FailureReason> {
        let Some(d) = self.driver(id) else {
            return Ok(Vec::new());
        };
        let (conn, info, retry) = (
            d.senders[pi].conn.clone(),
            d.senders[pi].info.clone(),
            !d.posted_to[pi],
        );
        let mut posted = self.transport_post(id, pi, &conn, &info, payload);
        if let (Err(e), true) = (&posted, retry) {
            if e.is_lost() {
                self.prefill_step(id.p, RankEvent::PeerLost { peer: conn.peer });
            }
            if let Ok(fresh) = self.reconnect(id.p, &conn) {
                posted = self.transport_post(id, pi, &fresh, &info, payload);
                if let Some(d) = self.driver(id) {
                    d.senders[pi].conn = fresh;
                }
            }
        }
        let aux = matches!(payload, Payload::Aux);
        let batch = match posted {
            Ok(batch) => batch,
            Err(e) => {
                if e.is_lost() {
                    self.prefill_step(id.p, RankEvent::PeerLost { peer: conn.peer });
                }
                return Err(batch_failure(id, &info, aux, &e.to_string()));
            }
        };
        self.check_post(id, batch, &conn, &info);
        let Some(d) = self.driver(id) else {
            return Ok(Vec::new());
        };
        d.posted_to[pi] = true;
        d.waiting.insert(batch);
        Ok(d.progress.handle(BatchEvent::Posted {
            peer: pi,
            id: batch,
            aux,
        }))
    }

    /// Invariants 3 and 4 at a post: not once the fence's cancels began, not to a fenced
    /// decode room life, not after the room acknowledged an abort.
    fn check_post(
        &mut self,
        id: PrefillLifeId,
        batch: BatchId,
        conn: &SimConn,
        info: &TransferInfo,
    ) {
        let room = id.room;
        let target = (conn.decode, conn.decode_epoch, info.generation);
        let (fencing, late, acked) = match self.prefill_life(id) {
            Some(l) => {
                let d = l.driver.as_ref();
                let fencing = d.is_some_and(|d| d.phase != Phase::Sending);
                (fencing, d.is_some_and(|d| d.cancel_seen), l.acked)
            }
            None => (false, false, false),
        };
        let to = format!("decode-{} (generation {})", conn.decode, info.generation);
        if late {
            let what = format!(
                "prefill-{} posted batch {batch} of room {room} to {to} after its CancelBatches",
                id.p
            );
            self.violate(Invariant::FenceHolds, what);
        }
        if fencing {
            let what = format!(
                "prefill-{} posted batch {batch} of room {room} to {to} after its fence began",
                id.p
            );
            self.violate(Invariant::FenceHolds, what);
        }
        if self.oracle.fenced.contains(&target) {
            let what = format!(
                "prefill-{} posted batch {batch} of room {room} to {to}, a room life the decode \
                 already reported fenced",
                id.p
            );
            self.violate(Invariant::FenceHolds, what);
        }
        if acked {
            let what = format!(
                "prefill-{} posted batch {batch} of room {room} to {to} after acknowledging an \
                 abort of the room",
                id.p
            );
            self.violate(Invariant::AckAfterFence, what);
        }
    }

    /// A batch's waiter ended (`sender`: its decode rank, and whether it is the aux rows).
    /// The driver reads the result at the top of its loop: now, or once the chunk in hand is
    /// posted.
    pub(super) fn batch_waited(
        &mut self,
        id: PrefillLifeId,
        batch: BatchId,
        sender: (usize, bool),
        waited: Waited,
    ) {
        let Some(d) = self.driver(id) else {
            return;
        };
        if !d.waiting.remove(&batch) {
            return;
        }
        match d.phase {
            // The fence counts the waiters; one that gave up poisons the room.
            Phase::Cancelling(_) | Phase::Draining | Phase::Ended => {
                d.poisoned |= matches!(waited, Waited::Hung);
                self.drain_check(id);
            }
            Phase::Sending => {
                d.unread.push_back((batch, sender, waited));
                self.loop_top(id);
            }
        }
    }

    fn read_waited(
        &mut self,
        id: PrefillLifeId,
        batch: BatchId,
        (pi, aux): (usize, bool),
        waited: Waited,
    ) {
        let Some(d) = self.driver(id) else {
            return;
        };
        let info = d.senders[pi].info.clone();
        match waited {
            Waited::Done { bytes } => {
                let due = d.progress.handle(BatchEvent::Done { id: batch, bytes });
                self.follow(id, due);
            }
            Waited::Failed { lost, peer } => {
                d.progress.handle(BatchEvent::Failed { id: batch });
                if lost {
                    self.prefill_step(id.p, RankEvent::PeerLost { peer });
                }
                let why = if lost {
                    "the peer was lost"
                } else {
                    "transfer error"
                };
                self.driver_failed(id, batch_failure(id, &info, aux, why));
            }
            Waited::Hung => {
                let what = if aux { "aux data" } else { "kv chunk" };
                let reason = FailureReason::with_peer(
                    FailureCause::BatchTimeout,
                    &info.decode_endpoint,
                    format!(
                        "Failed to send {what} of {} to {}: the transport did not finish batch \
                         {batch} within its deadline plus grace",
                        id.room, info.decode_endpoint
                    ),
                );
                self.driver_failed(id, reason);
            }
        }
    }

    fn room_step(&mut self, id: PrefillLifeId, incarnation: Incarnation, event: Event<SimConn>) {
        let event = RankEvent::Room {
            room: id.room,
            incarnation: Some(incarnation),
            event,
        };
        self.prefill_step(id.p, event);
    }

    /// The driver failed the room itself; it fences whether or not the room had failed.
    fn driver_failed(&mut self, id: PrefillLifeId, reason: FailureReason) {
        let Some(d) = self.driver(id) else {
            return;
        };
        let incarnation = d.incarnation;
        self.room_step(id, incarnation, Event::Fail(reason));
        self.begin_fence(id);
    }

    /// `Ev::Fence` (after `CancelBatches`): fences at once, or once the chunk in hand is
    /// posted.
    pub(super) fn fence_asked(&mut self, id: PrefillLifeId) {
        if self.driver(id).is_some_and(|d| d.idle()) {
            self.begin_fence(id);
        }
    }

    /// Cancels every batch in flight at once, under one deadline (the grace).
    fn begin_fence(&mut self, id: PrefillLifeId) {
        let Some(d) = self.driver(id) else {
            return;
        };
        if d.phase != Phase::Sending {
            return;
        }
        // Results not read yet are waiters that ended: only one that gave up counts.
        d.poisoned |= d.unread.drain(..).any(|r| matches!(r.2, Waited::Hung));
        d.in_hand = None;
        let mut ids = d.progress.in_flight();
        // The accounting keeps them in a hash map: cancel in a fixed order.
        ids.sort_unstable();
        if ids.is_empty() {
            d.phase = Phase::Draining;
            return self.drain_check(id);
        }
        d.phase = Phase::Cancelling(ids.iter().copied().collect());
        for batch in ids {
            self.cancel(id, batch);
        }
        self.schedule(FENCE_GRACE, Ev::FenceGrace(id));
    }

    pub(super) fn cancel_returned(&mut self, id: PrefillLifeId, batch: BatchId, ok: bool) {
        let Some(d) = self.driver(id) else {
            return;
        };
        let Phase::Cancelling(pending) = &mut d.phase else {
            return;
        };
        if !pending.remove(&batch) {
            return;
        }
        d.poisoned |= !ok;
        if pending.is_empty() {
            d.phase = Phase::Draining;
            self.drain_check(id);
        }
    }

    /// The grace passed: cancels still out cannot be proven, the room is poisoned.
    pub(super) fn fence_grace(&mut self, id: PrefillLifeId) {
        let Some(d) = self.driver(id) else {
            return;
        };
        if matches!(d.phase, Phase::Cancelling(_)) {
            d.poisoned = true;
            d.phase = Phase::Draining;
            self.drain_check(id);
        }
    }

    /// Once every waiter ended, the driver ends and tells the machine.
    fn drain_check(&mut self, id: PrefillLifeId) {
        let drop_end = self.sabotage.drop_driver_ended;
        let Some(d) = self.driver(id) else {
            return;
        };
        if d.phase != Phase::Draining || !d.waiting.is_empty() {
            return;
        }
        d.phase = Phase::Ended;
        let (incarnation, poisoned) = (d.incarnation, d.poisoned);
        if poisoned {
            self.stats.poisoned_rooms += 1;
            self.oracle.poisoned.insert((id.p, id.epoch, id.life));
            self.oracle.poisoned_ids.insert(id.room);
        }
        if drop_end {
            return;
        }
        let event = Event::DriverEnded {
            incarnation,
            poisoned,
        };
        self.room_step(id, incarnation, event);
    }
}

fn batch_failure(id: PrefillLifeId, info: &TransferInfo, aux: bool, why: &str) -> FailureReason {
    let what = if aux { "aux data" } else { "kv chunk" };
    let to = &info.decode_endpoint;
    FailureReason::with_peer(
        FailureCause::TransferError,
        to,
        format!("Failed to send {what} of {} to {to}: {why}", id.room),
    )
}
