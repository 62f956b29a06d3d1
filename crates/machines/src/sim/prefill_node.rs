//! A prefill rank: its machine, and in plain code what `PrefillAgent` does around it (carry
//! out the machine's actions; its control messages are in `prefill_control.rs`) and what its
//! caller does (create rooms, hand over chunks once ready, abort, clear once terminal).

use std::collections::BTreeMap;
use std::time::Duration;

use kvbridge_handshake::{PeerDescriptor, Role};
use kvbridge_transport::PeerId;

use super::checks::{Invariant, forward};
use super::driver::DriverSim;
use super::schedule::{
    BOOTSTRAP_TIMEOUT, CREATE_TRIES, PAGE_TOKENS, SLACK, Topology, WAITING_TIMEOUT,
};
use super::world::{Ev, PrefillLifeId, World};
use crate::prefill::{
    Action, ChunkShape, Event, PrefillMachine, RankAction, RankEvent, RoomConfig,
};
use crate::{FailureCause, FailureReason, RoomState};
use kvbridge_control::ControlMessage;
use kvbridge_control::Endpoint;
use kvbridge_control::{RoomId, SessionId};

/// The driver's handle of an accepted decode rank: the transport connection and whom it
/// reaches (the decode process epoch it was made to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SimConn {
    pub(super) decode: usize,
    pub(super) decode_epoch: u32,
    pub(super) session: SessionId,
    pub(super) peer: PeerId,
}

/// A chunk the caller hands over: what the `PostChunk` of that step posts.
#[derive(Debug, Clone, Copy)]
pub(super) struct ChunkJob {
    pub(super) tokens: u64,
    pub(super) is_last: bool,
}

/// One room life on a prefill rank, as its caller and driver see it.
#[derive(Debug)]
pub(super) struct PrefillLife {
    pub(super) id: u64,
    pub(super) plan: usize,
    /// The last state reported.
    pub(super) state: RoomState,
    /// Tokens handed over so far.
    pub(super) sent: u64,
    pub(super) cleared: bool,
    /// An abort of it was acknowledged while the machine held it.
    pub(super) acked: bool,
    pub(super) driver: Option<DriverSim>,
}

#[derive(Debug)]
pub(super) struct PrefillNode {
    pub(super) endpoint: Endpoint,
    pub(super) rank: u32,
    pub(super) descriptor: PeerDescriptor,
    /// Bumped by a restart: events of an earlier process are dropped.
    pub(super) epoch: u32,
    pub(super) machine: PrefillMachine<SimConn>,
    pub(super) timer_at: Option<Duration>,
    pub(super) lives: BTreeMap<RoomId, PrefillLife>,
    pub(super) handing: Option<ChunkJob>,
    pub(super) refused: bool,
}

impl PrefillNode {
    pub(super) fn new(index: usize, t: Topology) -> Self {
        let endpoint = Endpoint::new(format!("prefill-{index}"));
        // One attention CP and PP rank: the unique rank is the TP rank.
        let rank = index as u32;
        Self {
            machine: Self::machine(&endpoint, rank),
            endpoint,
            rank,
            descriptor: t.descriptor(Role::Prefill, rank),
            epoch: 0,
            timer_at: None,
            lives: BTreeMap::new(),
            handing: None,
            refused: false,
        }
    }

    fn machine(endpoint: &Endpoint, rank: u32) -> PrefillMachine<SimConn> {
        let cfg = RoomConfig {
            rank,
            endpoint: endpoint.clone(),
            bootstrap_timeout: BOOTSTRAP_TIMEOUT,
            waiting_timeout: WAITING_TIMEOUT,
        };
        PrefillMachine::new(cfg, 4096)
    }
}

/// The prefill machine lists the rooms it fails together (a decode that registered again) in
/// its hash map's order, which differs from process to process: runs of room actions are put
/// in room order, each room's own actions keeping theirs, so a seed replays the same anywhere.
fn canonical(actions: Vec<RankAction>) -> Vec<RankAction> {
    let room_of = |a: &RankAction| match a {
        RankAction::Room { room, .. } | RankAction::EarlyExpired { room } => Some(*room),
        RankAction::Send { message, .. } => message.room(),
        RankAction::Disconnect { .. } => None,
    };
    let mut out = Vec::with_capacity(actions.len());
    let mut run: Vec<RankAction> = Vec::new();
    for a in actions {
        if room_of(&a).is_some() {
            run.push(a);
            continue;
        }
        run.sort_by_key(|a| room_of(a));
        out.append(&mut run);
        out.push(a);
    }
    run.sort_by_key(|a| room_of(a));
    out.append(&mut run);
    out
}

impl World {
    pub(super) fn prefill_step(&mut self, p: usize, event: RankEvent<SimConn>) {
        let now = self.instant();
        let actions = self.prefills[p].machine.handle(event, now);
        for action in canonical(actions) {
            self.prefill_action(p, action);
        }
        self.arm_prefill_timer(p);
    }

    fn arm_prefill_timer(&mut self, p: usize) {
        let Some(at) = self.prefills[p].machine.poll_timeout() else {
            return;
        };
        let at = self.offset(at);
        let n = &mut self.prefills[p];
        if n.timer_at.is_some_and(|t| t <= at) {
            return;
        }
        n.timer_at = Some(at);
        let epoch = n.epoch;
        self.schedule_at(at, Ev::PrefillTimer { p, epoch, at });
    }

    pub(super) fn prefill_timer(&mut self, p: usize, epoch: u32, at: Duration) {
        let n = &mut self.prefills[p];
        if n.epoch != epoch || n.timer_at != Some(at) {
            return;
        }
        n.timer_at = None;
        self.prefill_step(p, RankEvent::Timer);
    }

    fn prefill_action(&mut self, p: usize, action: RankAction) {
        match action {
            RankAction::Send { to, message } => self.prefill_send(p, to, *message),
            RankAction::Room { room, action } => self.prefill_room_action(p, room, action),
            RankAction::Disconnect { peer } => self.disconnect(peer),
            RankAction::EarlyExpired { room } => {
                self.note(|| format!("  prefill-{p} dropped the metadata of room {room}"));
            }
        }
    }

    fn prefill_send(&mut self, p: usize, to: Endpoint, message: ControlMessage) {
        let epoch = self.prefills[p].epoch;
        match &message {
            ControlMessage::AbortAck(a) => {
                let room = a.room;
                if let Some(b) = self.transport.in_flight_from(p, epoch, room) {
                    let what = format!(
                        "prefill-{p} acknowledged an abort of room {room} (generation {}) to \
                         {to} while its batch {} to decode-{} can still land",
                        a.generation, b.id, b.decode.0
                    );
                    self.violate(Invariant::AckAfterFence, what);
                }
                if let Some(l) = self.prefills[p].lives.get_mut(&room) {
                    l.acked = true;
                }
                self.oracle.acked.insert((p, epoch, room, to.clone()));
            }
            ControlMessage::Status(s) if s.state == RoomState::Success => {
                let state = self.prefills[p].machine.room(s.room).map(|r| r.state());
                if state != Some(RoomState::Success) {
                    let what = format!(
                        "prefill-{p} sent Success for room {} to {to} while the room is {state:?}",
                        s.room
                    );
                    self.violate(Invariant::SuccessIsDelivered, what);
                }
            }
            _ => {}
        }
        self.note(|| format!("  prefill-{p} sends {}", super::summarize(&message)));
        let from = self.prefills[p].endpoint.clone();
        self.send(&from, to, message);
    }

    pub(super) fn prefill_life_id(&self, p: usize, room: RoomId) -> Option<PrefillLifeId> {
        let n = &self.prefills[p];
        n.lives.get(&room).map(|l| PrefillLifeId {
            p,
            epoch: n.epoch,
            room,
            life: l.id,
        })
    }

    pub(super) fn prefill_life(&mut self, id: PrefillLifeId) -> Option<&mut PrefillLife> {
        let n = &mut self.prefills[id.p];
        if n.epoch != id.epoch {
            return None;
        }
        n.lives.get_mut(&id.room).filter(|l| l.id == id.life)
    }

    fn prefill_room_action(&mut self, p: usize, room: RoomId, action: Action) {
        let Some(id) = self.prefill_life_id(p, room) else {
            return;
        };
        match action {
            Action::Send { to, message } => self.prefill_send(p, to, *message),
            Action::Report { state, reason } => {
                let why = reason.map(|r| r.message).unwrap_or_default();
                self.note(|| format!("  prefill-{p} room {room}: {state} {why}"));
                self.prefill_report(id, state);
            }
            Action::Succeeded { .. } | Action::AckWithheld { .. } => {}
            Action::PostChunk {
                token_offset,
                start_driver,
                ..
            } => self.queue_job(id, token_offset, start_driver),
            Action::RefuseChunk(_) => self.prefills[p].refused = true,
            Action::CancelBatches => self.cancel_batches(id),
            Action::Remove => {
                self.note(|| format!("  prefill-{p} room {room} removed"));
                if let Some(life) = self.prefills[p].lives.remove(&room) {
                    self.slot_ended(life.plan);
                }
            }
        }
    }

    fn prefill_report(&mut self, id: PrefillLifeId, state: RoomState) {
        let Some(life) = self.prefill_life(id) else {
            return;
        };
        let prev = std::mem::replace(&mut life.state, state);
        if !forward(prev, state) {
            let what = format!("prefill-{} room {}: {prev} then {state}", id.p, id.room);
            self.violate(Invariant::StatesMonotonic, what);
        }
        match state {
            RoomState::WaitingForInput => {
                let after = self.rng.millis(0, 50);
                self.schedule(after, Ev::NextChunk(id));
            }
            RoomState::Success | RoomState::Failed => {
                if state == RoomState::Success {
                    self.stats.prefill_successes += 1;
                    self.check_prefill_success(id);
                } else {
                    self.stats.prefill_failures += 1;
                }
                // Most callers clear at once; some keep a finished room for a while.
                let after = if self.rng.chance(0.15) {
                    self.rng.millis(10_000, 40_000)
                } else {
                    self.rng.millis(0, 2_000)
                };
                self.schedule(after, Ev::PrefillDone(id));
            }
            _ => {}
        }
    }

    /// A prefill room succeeds only after its driver delivered every batch (or, with only
    /// dummy decode ranks, with nothing to send).
    fn check_prefill_success(&mut self, id: PrefillLifeId) {
        let n = &self.prefills[id.p];
        let (Some(life), Some(room)) = (n.lives.get(&id.room), n.machine.room(id.room)) else {
            return;
        };
        let tokens = self.plans[life.plan].tokens;
        let prefix = room.prefix().unwrap_or(0);
        let mut problems = Vec::new();
        match &life.driver {
            None if room.peers().iter().all(|m| m.peer.is_none()) => {}
            None => problems.push("no driver ever posted it".to_owned()),
            Some(d) if !d.delivered => problems.push("its driver did not deliver".to_owned()),
            Some(d) => {
                for s in &d.senders {
                    let life = (s.conn.decode, s.conn.decode_epoch, s.info.generation);
                    let aux = self.knobs.topology.has_aux && s.info.dst_aux_index.is_some();
                    let missing = self.oracle.missing(life, id.p, prefix, tokens, aux);
                    if let Some(m) = missing {
                        problems.push(format!("{m} at {}", s.info.decode_endpoint));
                    }
                }
            }
        }
        if !problems.is_empty() {
            let what = format!(
                "prefill-{} room {} reported Success, but {}",
                id.p,
                id.room,
                problems.join("; ")
            );
            self.violate(Invariant::SuccessIsDelivered, what);
        }
    }

    pub(super) fn create(&mut self, p: usize, plan: usize, tries: u32) {
        let room = self.plans[plan].room;
        // As the decode callers do: a poisoned id is not used again.
        if self.oracle.poisoned_ids.contains(&room) {
            return self.slot_ended(plan);
        }
        if self.earlier_use_open(plan) {
            return self.schedule(Duration::from_secs(1), Ev::Create { p, plan, tries });
        }
        if self.prefills[p].machine.admit(room).is_err() {
            // The id is still held by an earlier life (draining) or the process is new.
            if tries < CREATE_TRIES {
                self.schedule(
                    Duration::from_secs(1),
                    Ev::Create {
                        p,
                        plan,
                        tries: tries + 1,
                    },
                );
            } else {
                self.slot_ended(plan);
            }
            return;
        }
        if self.plans[..plan].iter().any(|e| e.room == room) {
            self.stats.rooms_reused += 1;
        }
        let life = PrefillLife {
            id: self.next_life(),
            plan,
            state: RoomState::Bootstrapping,
            sent: 0,
            cleared: false,
            acked: false,
            driver: None,
        };
        self.prefills[p].lives.insert(room, life);
        let id = self.prefill_life_id(p, room).expect("just inserted");
        self.prefill_step(p, RankEvent::Create { room });
        let by = BOOTSTRAP_TIMEOUT + WAITING_TIMEOUT + SLACK;
        self.schedule(by, Ev::PrefillMustBeTerminal(id));
    }

    /// The caller hands over the next chunk: whole pages from where the send range stands,
    /// the last one ending mid-page.
    pub(super) fn next_chunk(&mut self, id: PrefillLifeId) {
        let plan = match self.prefill_life(id) {
            Some(l) if !l.cleared => l.plan,
            _ => return,
        };
        let tokens = self.plans[plan].tokens;
        let p = id.p;
        let Some(room) = self.prefills[p].machine.room(id.room) else {
            return;
        };
        let prefix = room.prefix().unwrap_or(0);
        let sent = self.prefills[p].lives[&id.room].sent;
        let at = prefix + sent;
        let remaining = tokens.saturating_sub(at);
        if remaining == 0 {
            return;
        }
        let offset = at % PAGE_TOKENS;
        let pages = self.rng.between(1, 3);
        let capacity = pages * PAGE_TOKENS - offset;
        let (pages, chunk_tokens, is_last) = if remaining <= capacity {
            ((offset + remaining).div_ceil(PAGE_TOKENS), remaining, true)
        } else {
            (pages, capacity, false)
        };
        let n = &mut self.prefills[p];
        n.handing = Some(ChunkJob {
            tokens: chunk_tokens,
            is_last,
        });
        n.refused = false;
        let shape = ChunkShape {
            pages,
            tokens: chunk_tokens,
            is_last,
            page_tokens: PAGE_TOKENS,
            layers: None,
        };
        let event = RankEvent::Room {
            room: id.room,
            incarnation: None,
            event: Event::Chunk(shape),
        };
        self.prefill_step(p, event);
        let n = &mut self.prefills[p];
        n.handing = None;
        if n.refused {
            return;
        }
        if let Some(l) = self.prefill_life(id) {
            l.sent += chunk_tokens;
        }
        if !is_last {
            let after = self.rng.millis(0, 100);
            self.schedule(after, Ev::NextChunk(id));
        }
    }

    fn prefill_life_of_plan(&self, p: usize, plan: usize) -> Option<PrefillLifeId> {
        let room = self.plans[plan].room;
        let l = self.prefills[p].lives.get(&room)?;
        (l.plan == plan)
            .then(|| self.prefill_life_id(p, room))
            .flatten()
    }

    pub(super) fn prefill_abort(&mut self, p: usize, plan: usize) {
        let Some(id) = self.prefill_life_of_plan(p, plan) else {
            return;
        };
        let reason = FailureReason::new(FailureCause::Aborted, "Aborted by AbortReq.");
        let event = RankEvent::Room {
            room: id.room,
            incarnation: None,
            event: Event::Fail(reason),
        };
        self.prefill_step(p, event);
    }

    pub(super) fn prefill_clear_plan(&mut self, p: usize, plan: usize) {
        if let Some(id) = self.prefill_life_of_plan(p, plan) {
            self.prefill_clear(id);
        }
    }

    /// The caller clears the room: it must be let go once its driver ended.
    pub(super) fn prefill_clear(&mut self, id: PrefillLifeId) {
        match self.prefill_life(id) {
            Some(l) if !l.cleared => l.cleared = true,
            _ => return,
        }
        let event = RankEvent::Room {
            room: id.room,
            incarnation: None,
            event: Event::Clear,
        };
        self.prefill_step(id.p, event);
        self.schedule(Self::fence_bound() + SLACK, Ev::PrefillMustBeGone(id));
    }

    pub(super) fn restart_prefill(&mut self, p: usize) {
        self.stats.restarts += 1;
        self.note(|| format!("  prefill-{p} restarts"));
        let n = &mut self.prefills[p];
        let ended: Vec<usize> = std::mem::take(&mut n.lives)
            .into_values()
            .map(|l| l.plan)
            .collect();
        let old = n.epoch;
        n.epoch += 1;
        n.machine = PrefillNode::machine(&n.endpoint, n.rank);
        n.timer_at = None;
        for plan in ended {
            self.slot_ended(plan);
        }
        self.prefill_process_gone(p, old);
    }

    pub(super) fn prefill_must_be_terminal(&mut self, id: PrefillLifeId) {
        if self.prefill_life(id).is_none() {
            return;
        }
        let state = self.prefills[id.p].machine.room(id.room).map(|r| r.state());
        if !state.is_some_and(RoomState::is_terminal) {
            let what = format!(
                "prefill-{} room {} is still {state:?} past its bootstrap and waiting deadlines",
                id.p, id.room
            );
            self.violate(Invariant::RoomEnds, what);
        }
    }

    pub(super) fn prefill_must_be_gone(&mut self, id: PrefillLifeId) {
        // A poisoned room is kept for good, hidden, so its aborts stay unacknowledged
        // (`prefill_send` checks no ack goes out while its batch can land); the caller that
        // cleared it is done with it.
        if self.oracle.poisoned.contains(&(id.p, id.epoch, id.life)) {
            if self.prefill_life(id).is_none() {
                return;
            }
            if self.prefills[id.p].machine.room(id.room).is_none() {
                let what = format!(
                    "prefill-{} forgot poisoned room {} once it was cleared",
                    id.p, id.room
                );
                return self.violate(Invariant::FenceHolds, what);
            }
            if let Some(life) = self.prefills[id.p].lives.remove(&id.room) {
                self.slot_ended(life.plan);
            }
            return;
        }
        let Some(l) = self.prefill_life(id) else {
            return;
        };
        let driver = l.driver.as_ref().map(|d| format!("{:?}", d.phase));
        let what = format!(
            "prefill-{} room {} is still held {:?} after it was cleared (driver {driver:?})",
            id.p,
            id.room,
            Self::fence_bound() + SLACK
        );
        self.violate(Invariant::RoomEnds, what);
    }
}
