//! What the simulation checks, and the bookkeeping the checks read: the bytes each prefill
//! rank landed in each decode room life, and the decode room lives already fenced.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use kvbridge_control::Endpoint;
use kvbridge_control::RoomState;
use kvbridge_control::{Generation, RoomId};

/// The promises a schedule is checked against (docs/lifecycle.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Invariant {
    /// 1. Every room life ends: terminal by its deadlines, a cleared prefill room let go once
    ///    its driver ended, every fence a decode caller waits for answered (and proven when no
    ///    batch of the schedule can hang), and the run itself ends within its event budget.
    RoomEnds,
    /// 2. Success only for what landed: a decode room succeeds only once every byte of its
    ///    range and its aux row arrived from each non-dummy prefill rank of this life; a
    ///    prefill room only after its driver delivered every batch.
    SuccessIsDelivered,
    /// 3. Fences hold: no batch is posted for a prefill room after its `CancelBatches`, or to
    ///    a decode room life already fenced; a decode room is reported fenced only when no
    ///    batch to it can land; no byte lands on pages a decode released.
    FenceHolds,
    /// 4. An abort ack only once no batch of the room can land on that prefill rank, and no
    ///    post from that room life after it.
    AckAfterFence,
    /// States move forward only; Failed is sticky.
    StatesMonotonic,
}

#[derive(Debug, Clone)]
pub(super) struct Violation {
    pub(super) invariant: Invariant,
    pub(super) at: Duration,
    pub(super) what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} broken at {:?}: {}",
            self.invariant, self.at, self.what
        )
    }
}

/// Whether `next` may follow `prev` in a room's reports: forward only, nothing after Failed.
pub(super) fn forward(prev: RoomState, next: RoomState) -> bool {
    prev != RoomState::Failed && (next == RoomState::Failed || next > prev)
}

/// Which decode room life (decode index, its process epoch, the room's generation) a
/// prefill rank wrote to.
pub(super) type LifeKey = (usize, u32, Generation);

/// The token ranges and aux row one prefill rank landed in one decode room life.
#[derive(Debug, Default)]
struct Coverage {
    ranges: Vec<(u64, u64)>,
    aux: bool,
}

impl Coverage {
    fn covers(&self, from: u64, to: u64) -> bool {
        let mut ranges = self.ranges.clone();
        ranges.sort_unstable();
        let mut reached = from;
        for (a, b) in ranges {
            if a > reached {
                break;
            }
            reached = reached.max(b);
        }
        reached >= to
    }
}

#[derive(Debug, Default)]
pub(super) struct Oracle {
    coverage: BTreeMap<(LifeKey, usize), Coverage>,
    /// Decode room lives reported fenced: nothing may be posted to them any more.
    pub(super) fenced: BTreeSet<LifeKey>,
    /// Prefill room lives whose driver ended poisoned (rank, process epoch, life).
    pub(super) poisoned: BTreeSet<(usize, u32, u64)>,
    /// Room ids a prefill rank holds poisoned: taken for good, so callers use other ids.
    pub(super) poisoned_ids: BTreeSet<RoomId>,
    /// Abort acks sent (prefill rank, process epoch, room, decode endpoint).
    pub(super) acked: BTreeSet<(usize, u32, RoomId, Endpoint)>,
}

impl Oracle {
    pub(super) fn landed_tokens(&mut self, life: LifeKey, prefill: usize, from: u64, to: u64) {
        let c = self.coverage.entry((life, prefill)).or_default();
        c.ranges.push((from, to));
    }

    pub(super) fn landed_aux(&mut self, life: LifeKey, prefill: usize) {
        self.coverage.entry((life, prefill)).or_default().aux = true;
    }

    /// What is missing of `[from, to)` (and the aux row when `aux`) from `prefill` in `life`.
    pub(super) fn missing(
        &self,
        life: LifeKey,
        prefill: usize,
        from: u64,
        to: u64,
        aux: bool,
    ) -> Option<String> {
        let Some(c) = self.coverage.get(&(life, prefill)) else {
            return Some("no byte".to_owned());
        };
        if !c.covers(from, to) {
            return Some(format!(
                "tokens {from}..{to} not all landed ({:?})",
                c.ranges
            ));
        }
        (aux && !c.aux).then(|| "its aux row".to_owned())
    }
}

/// Counters summed over schedules, to show the runs reach the paths they are meant to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Stats {
    pub(super) events: u64,
    pub(super) decode_successes: u64,
    pub(super) decode_failures: u64,
    pub(super) prefill_successes: u64,
    pub(super) prefill_failures: u64,
    pub(super) fenced_by_acks: u64,
    pub(super) fence_timeouts: u64,
    pub(super) batches_posted: u64,
    pub(super) batches_failed: u64,
    pub(super) cancels: u64,
    pub(super) poisoned_rooms: u64,
    pub(super) early_metadata: u64,
    pub(super) reconnects: u64,
    pub(super) messages_dropped: u64,
    pub(super) messages_duplicated: u64,
    pub(super) restarts: u64,
    pub(super) rooms_reused: u64,
}

impl Stats {
    pub(super) fn add(&mut self, o: &Stats) {
        let pairs = [
            (&mut self.events, o.events),
            (&mut self.decode_successes, o.decode_successes),
            (&mut self.decode_failures, o.decode_failures),
            (&mut self.prefill_successes, o.prefill_successes),
            (&mut self.prefill_failures, o.prefill_failures),
            (&mut self.fenced_by_acks, o.fenced_by_acks),
            (&mut self.fence_timeouts, o.fence_timeouts),
            (&mut self.batches_posted, o.batches_posted),
            (&mut self.batches_failed, o.batches_failed),
            (&mut self.cancels, o.cancels),
            (&mut self.poisoned_rooms, o.poisoned_rooms),
            (&mut self.early_metadata, o.early_metadata),
            (&mut self.reconnects, o.reconnects),
            (&mut self.messages_dropped, o.messages_dropped),
            (&mut self.messages_duplicated, o.messages_duplicated),
            (&mut self.restarts, o.restarts),
            (&mut self.rooms_reused, o.rooms_reused),
        ];
        for (mine, theirs) in pairs {
            *mine += theirs;
        }
    }
}
