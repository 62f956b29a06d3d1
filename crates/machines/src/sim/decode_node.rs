//! A decode rank: its machine, and in plain code what `DecodeAgent` does around it (feed it
//! control messages, directory answers and failed sends; carry out its actions) and what its
//! caller does (receive rooms into pages it allocates, abort, clear a finished room, wait for
//! a failed room's fence before its pages are used again).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvbridge_handshake::Role;

use super::checks::{Invariant, forward};
use super::schedule::{
    ABORT_RESEND_INTERVAL, ADDR, BOOTSTRAP_TIMEOUT, CONTROL_SEND_TIMEOUT, CREATE_TRIES, FENCE_ASKS,
    FENCE_TIMEOUT, HEARTBEAT_INTERVAL, HEARTBEAT_MAX_FAILURES, PAGE_TOKENS, SLACK, Topology,
    WAITING_TIMEOUT,
};
use super::world::{DecodeLifeId, Ev, World};
use crate::DecodeConfig;
use crate::decode::{Action, DecodeMachine, Event, RoomRequest};
use kvbridge_control::Endpoint;
use kvbridge_control::PrefillRankInfo;
use kvbridge_control::RoomState;
use kvbridge_control::{CONTROL_PROTOCOL_VERSION, ControlMessage, Registration, TransportInfo};
use kvbridge_control::{Generation, Incarnation, RoomId, SessionId};

/// Pages (or aux rows) of a decode process and the room life owning each. Freed slots are
/// handed out again first, so a page released too early is soon written by another room.
#[derive(Debug)]
pub(super) struct Pool {
    owner: Vec<Option<u64>>,
    free: Vec<u64>,
}

impl Pool {
    fn new(slots: u64) -> Self {
        Self {
            owner: vec![None; slots as usize],
            free: (0..slots).rev().collect(),
        }
    }

    fn take(&mut self, n: usize, life: u64) -> Option<Vec<u64>> {
        if self.free.len() < n {
            return None;
        }
        let slots = self.free.split_off(self.free.len() - n);
        for &s in &slots {
            self.owner[s as usize] = Some(life);
        }
        Some(slots)
    }

    fn give_back(&mut self, slots: &[u64]) {
        for &s in slots {
            self.owner[s as usize] = None;
            self.free.push(s);
        }
    }

    pub(super) fn owner(&self, slot: u64) -> Option<u64> {
        self.owner.get(slot as usize).copied().flatten()
    }
}

/// One room life on a decode rank, as its caller sees it.
#[derive(Debug)]
pub(super) struct DecodeLife {
    id: u64,
    plan: usize,
    incarnation: Option<Incarnation>,
    /// The last state reported.
    pub(super) state: RoomState,
    prefix: u64,
    tokens: u64,
    /// The room's generation, once its metadata went out.
    generation: Option<Generation>,
    /// The prefill ranks its metadata went to, and whether each is a dummy.
    targets: Vec<(usize, bool)>,
    pages: Vec<u64>,
    aux_row: Vec<u64>,
    fenced: bool,
    wants_fence: bool,
    fence_asks: u32,
    fence_answers: u32,
}

#[derive(Debug)]
pub(super) struct DecodeNode {
    pub(super) endpoint: Endpoint,
    /// Bumped by a restart (a new session, nothing of the old process kept).
    pub(super) epoch: u32,
    pub(super) machine: DecodeMachine,
    pub(super) timer_at: Option<Duration>,
    pub(super) lives: BTreeMap<RoomId, DecodeLife>,
    pub(super) pages: Pool,
    pub(super) aux_rows: Pool,
    /// Which room life each generation of this process belongs to.
    pub(super) generations: BTreeMap<Generation, u64>,
}

impl DecodeNode {
    pub(super) fn new(index: usize, t: Topology, epoch: u32, session: u64, now: Instant) -> Self {
        let endpoint = Endpoint::new(format!("decode-{index}"));
        let registration = Registration {
            protocol: CONTROL_PROTOCOL_VERSION,
            decode_endpoint: endpoint.clone(),
            session: SessionId(session),
            descriptor: t.descriptor(Role::Decode, index as u32),
            transport: TransportInfo {
                name: "sim".to_owned(),
                descriptor: super::transport_descriptor(index, epoch),
            },
            kv_regions: Vec::new(),
            aux_regions: Vec::new(),
        };
        let config = DecodeConfig::default()
            .with_bootstrap_timeout(BOOTSTRAP_TIMEOUT)
            .with_waiting_timeout(WAITING_TIMEOUT)
            .with_heartbeat_interval(HEARTBEAT_INTERVAL)
            .with_heartbeat_max_failures(HEARTBEAT_MAX_FAILURES)
            .with_control_send_timeout(CONTROL_SEND_TIMEOUT)
            .with_fence_timeout(FENCE_TIMEOUT)
            .with_abort_resend_interval(ABORT_RESEND_INTERVAL);
        Self {
            endpoint,
            epoch,
            machine: DecodeMachine::new(config, registration, t.has_aux, now),
            timer_at: None,
            lives: BTreeMap::new(),
            pages: Pool::new(1024),
            aux_rows: Pool::new(256),
            generations: BTreeMap::new(),
        }
    }
}

/// The decode machine asks again for registrations that expired together in its hash map's
/// order: runs of registrations are put in endpoint order so a seed replays the same anywhere.
fn canonical(mut actions: Vec<Action>) -> Vec<Action> {
    let is_register = |a: &Action| {
        matches!(
            a,
            Action::Send {
                message: ControlMessage::Register(_),
                ..
            }
        )
    };
    let mut i = 0;
    while i < actions.len() {
        let run = actions[i..].iter().take_while(|a| is_register(a)).count();
        actions[i..i + run].sort_by(|a, b| match (a, b) {
            (Action::Send { to: x, .. }, Action::Send { to: y, .. }) => x.cmp(y),
            _ => std::cmp::Ordering::Equal,
        });
        i += run.max(1);
    }
    actions
}

impl World {
    pub(super) fn decode_step(&mut self, d: usize, event: Event) {
        let now = self.instant();
        let actions = self.decodes[d].machine.handle(event, now);
        for action in canonical(actions) {
            self.decode_action(d, action);
        }
        self.arm_decode_timer(d);
    }

    pub(super) fn arm_decode_timer(&mut self, d: usize) {
        let Some(at) = self.decodes[d].machine.poll_timeout() else {
            return;
        };
        let at = self.offset(at);
        let n = &mut self.decodes[d];
        if n.timer_at.is_some_and(|t| t <= at) {
            return;
        }
        n.timer_at = Some(at);
        let epoch = n.epoch;
        self.schedule_at(at, Ev::DecodeTimer { d, epoch, at });
    }

    pub(super) fn decode_timer(&mut self, d: usize, epoch: u32, at: Duration) {
        let n = &mut self.decodes[d];
        if n.epoch != epoch || n.timer_at != Some(at) {
            return;
        }
        n.timer_at = None;
        self.decode_step(d, Event::Timer);
    }

    pub(super) fn decode_receive(&mut self, d: usize, from: Endpoint, message: ControlMessage) {
        self.decode_step(d, Event::Control { from, message });
    }

    fn decode_life_id(&self, d: usize, room: RoomId) -> Option<DecodeLifeId> {
        let n = &self.decodes[d];
        n.lives.get(&room).map(|l| DecodeLifeId {
            d,
            epoch: n.epoch,
            room,
            life: l.id,
        })
    }

    fn decode_life(&mut self, id: DecodeLifeId) -> Option<&mut DecodeLife> {
        let n = &mut self.decodes[id.d];
        if n.epoch != id.epoch {
            return None;
        }
        n.lives.get_mut(&id.room).filter(|l| l.id == id.life)
    }

    fn decode_action(&mut self, d: usize, action: Action) {
        match action {
            Action::Send { to, message } => {
                if let ControlMessage::TransferInfo(info) = &message {
                    self.metadata_sent(d, &to, info.room, info.generation, info.is_dummy);
                }
                self.note(|| format!("  decode-{d} sends {}", super::summarize(&message)));
                let from = self.decodes[d].endpoint.clone();
                self.send(&from, to, message);
            }
            Action::Resolve { addr } => {
                let (epoch, after) = (self.decodes[d].epoch, self.rng.millis(1, 30));
                self.schedule(after, Ev::Resolved { d, epoch, addr });
            }
            Action::Report { room, state, .. } => {
                self.note(|| format!("  decode-{d} room {room}: {state}"));
                if let Some(id) = self.decode_life_id(d, room) {
                    self.decode_report(id, state);
                }
            }
            Action::Fenced { room, acks } => {
                self.note(|| format!("  decode-{d} room {room} fenced ({acks} acks)"));
                self.stats.fenced_by_acks += u64::from(acks > 0);
                if let Some(id) = self.decode_life_id(d, room) {
                    self.fenced(id, acks);
                }
            }
            Action::FenceTimedOut { room, pending, .. } => {
                self.note(|| format!("  decode-{d} room {room} fence timed out ({pending:?})"));
                self.stats.fence_timeouts += 1;
                if let Some(id) = self.decode_life_id(d, room) {
                    self.fence_timed_out(id, &pending);
                }
            }
            Action::ForgetPeer { .. } => {}
        }
    }

    fn metadata_sent(&mut self, d: usize, to: &Endpoint, room: RoomId, g: Generation, dummy: bool) {
        let p = self.prefills.iter().position(|n| &n.endpoint == to);
        let n = &mut self.decodes[d];
        let Some(life) = n.lives.get_mut(&room) else {
            return;
        };
        life.generation = Some(g);
        life.targets.extend(p.map(|p| (p, dummy)));
        n.generations.insert(g, life.id);
    }

    fn decode_report(&mut self, id: DecodeLifeId, state: RoomState) {
        let Some(life) = self.decode_life(id) else {
            return;
        };
        let prev = std::mem::replace(&mut life.state, state);
        if !forward(prev, state) {
            let what = format!("decode-{} room {}: {prev} then {state}", id.d, id.room);
            self.violate(Invariant::StatesMonotonic, what);
        }
        match state {
            RoomState::Success => {
                self.stats.decode_successes += 1;
                self.check_decode_success(id);
                let after = self.rng.millis(0, 1_000);
                self.schedule(after, Ev::DecodeDone(id));
            }
            RoomState::Failed => {
                self.stats.decode_failures += 1;
                let after = self.rng.millis(0, 500);
                self.schedule(after, Ev::WantFence(id));
            }
            _ => {}
        }
    }

    /// A decode room succeeds only once every byte of its range (and its aux row) landed from
    /// each non-dummy prefill rank its metadata went to, for this life's generation.
    fn check_decode_success(&mut self, id: DecodeLifeId) {
        let has_aux = self.knobs.topology.has_aux;
        let Some(life) = self.decodes[id.d].lives.get(&id.room) else {
            return;
        };
        let Some(g) = life.generation else {
            let what = format!(
                "decode-{} room {} succeeded before its metadata went out",
                id.d, id.room
            );
            return self.violate(Invariant::SuccessIsDelivered, what);
        };
        let key = (id.d, id.epoch, g);
        let senders: Vec<usize> = life.targets.iter().filter(|t| !t.1).map(|t| t.0).collect();
        let mut problems: Vec<String> = senders
            .iter()
            .filter_map(|&p| {
                let missing = self
                    .oracle
                    .missing(key, p, life.prefix, life.tokens, has_aux)?;
                Some(format!("{missing} from prefill-{p}"))
            })
            .collect();
        if senders.is_empty() {
            problems.push("no prefill rank sends it anything".to_owned());
        }
        if !problems.is_empty() {
            let what = format!(
                "decode-{} reported room {} (generation {g}) Success, but: {}",
                id.d,
                id.room,
                problems.join("; ")
            );
            self.violate(Invariant::SuccessIsDelivered, what);
        }
    }

    /// `Fenced`: no batch to this room life may land any more, nor be posted.
    fn fenced(&mut self, id: DecodeLifeId, acks: usize) {
        let Some(life) = self.decode_life(id) else {
            return;
        };
        life.fenced = true;
        let (generation, wants) = (life.generation, life.wants_fence);
        if let Some(g) = generation {
            let key = (id.d, id.epoch, g);
            if let Some(b) = self.transport.in_flight_to(key) {
                let what = format!(
                    "decode-{} reported room {} (generation {g}) fenced with {acks} acks while \
                     batch {} of prefill-{} can still land",
                    id.d,
                    id.room,
                    b.id,
                    b.owner().p
                );
                self.violate(Invariant::FenceHolds, what);
            }
            self.oracle.fenced.insert(key);
        }
        if wants {
            self.schedule(Duration::ZERO, Ev::Release(id));
        }
    }

    fn fence_timed_out(&mut self, id: DecodeLifeId, pending: &[Endpoint]) {
        let provable = self.knobs.fences_provable();
        let Some(life) = self.decode_life(id) else {
            return;
        };
        life.fence_answers += 1;
        let asks = life.fence_asks;
        if provable {
            let what = format!(
                "decode-{} room {}: the fence timed out waiting for {pending:?}, though every \
                 batch of this schedule can be proven final",
                id.d, id.room
            );
            return self.violate(Invariant::RoomEnds, what);
        }
        // Asked again a few times, then the caller gives up the proof (the pages stay out).
        let ev = if asks < FENCE_ASKS {
            Ev::WantFence(id)
        } else {
            Ev::DecodeDone(id)
        };
        let after = self.rng.millis(0, 1_000);
        self.schedule(after, ev);
    }

    pub(super) fn want_fence(&mut self, id: DecodeLifeId) {
        let Some(life) = self.decode_life(id) else {
            return;
        };
        life.wants_fence = true;
        life.fence_asks += 1;
        let (ask, fenced) = (life.fence_asks, life.fenced);
        self.decode_step(id.d, Event::FenceWanted { room: id.room });
        if fenced {
            self.schedule(Duration::ZERO, Ev::Release(id));
        } else {
            let ev = Ev::FenceMustBeAnswered { life: id, ask };
            self.schedule(FENCE_TIMEOUT + SLACK, ev);
        }
    }

    /// The caller forgets the room: its pages are used again once it succeeded or was fenced
    /// (`fenced_only`: the fence's release), and stay out otherwise.
    pub(super) fn forget_life(&mut self, id: DecodeLifeId, fenced_only: bool) {
        let Some(life) = self.decode_life(id) else {
            return;
        };
        if fenced_only && !life.fenced {
            return;
        }
        let incarnation = if fenced_only { life.incarnation } else { None };
        let reuse = life.fenced || life.state == RoomState::Success;
        let n = &mut self.decodes[id.d];
        if n.machine.forget(id.room, incarnation).is_none() {
            return;
        }
        let Some(life) = n.lives.remove(&id.room) else {
            return;
        };
        if reuse {
            n.pages.give_back(&life.pages);
            n.aux_rows.give_back(&life.aux_row);
        }
        self.note(|| {
            format!(
                "  decode-{} forgets room {} (pages reused: {reuse})",
                id.d, id.room
            )
        });
        self.slot_ended(life.plan);
    }

    pub(super) fn receive(&mut self, d: usize, plan: usize, tries: u32) {
        // A room id poisoned on a prefill rank is never used again (its aborts stay
        // unacknowledged there): the request would take another id.
        if self.oracle.poisoned_ids.contains(&self.plans[plan].room) {
            return self.slot_ended(plan);
        }
        if self.earlier_use_open(plan) {
            return self.schedule(Duration::from_secs(1), Ev::Receive { d, plan, tries });
        }
        let rp = &self.plans[plan];
        let (room, tokens) = (rp.room, rp.tokens);
        let prefix = rp.prefix + u64::from(rp.misaligned);
        let life = self.next_life();
        let n = &mut self.decodes[d];
        let admitted = n.machine.admit(room).is_ok();
        let pages = n.pages.take(tokens.div_ceil(PAGE_TOKENS) as usize, life);
        let aux_row = n.aux_rows.take(1, life);
        let (page_table, aux_row) = match (admitted, pages, aux_row) {
            (true, Some(pages), Some(aux_row)) => (pages, aux_row),
            (_, pages, aux_row) => {
                // The id is still held (an earlier life not fenced yet), or no pages are free.
                n.pages.give_back(&pages.unwrap_or_default());
                n.aux_rows.give_back(&aux_row.unwrap_or_default());
                if tries < CREATE_TRIES {
                    let ev = Ev::Receive {
                        d,
                        plan,
                        tries: tries + 1,
                    };
                    self.schedule(Duration::from_secs(1), ev);
                } else {
                    self.slot_ended(plan);
                }
                return;
            }
        };
        let request = RoomRequest {
            addr: ADDR.to_owned(),
            dst_pages: page_table[(prefix / PAGE_TOKENS) as usize..].to_vec(),
            prefix,
            aux_index: aux_row[0],
        };
        n.lives.insert(
            room,
            DecodeLife {
                id: life,
                plan,
                incarnation: None,
                state: RoomState::Bootstrapping,
                prefix,
                tokens,
                generation: None,
                targets: Vec::new(),
                pages: page_table,
                aux_row,
                fenced: false,
                wants_fence: false,
                fence_asks: 0,
                fence_answers: 0,
            },
        );
        let id = self.decode_life_id(d, room).expect("just inserted");
        self.decode_step(d, Event::Receive { room, request });
        let incarnation = self.decodes[d].machine.incarnation(room);
        if let Some(l) = self.decode_life(id) {
            l.incarnation = incarnation;
        }
        let by = BOOTSTRAP_TIMEOUT + WAITING_TIMEOUT + SLACK;
        self.schedule(by, Ev::DecodeMustBeTerminal(id));
    }

    fn decode_life_of_plan(&self, d: usize, plan: usize) -> Option<DecodeLifeId> {
        let room = self.plans[plan].room;
        let l = self.decodes[d].lives.get(&room)?;
        (l.plan == plan)
            .then(|| self.decode_life_id(d, room))
            .flatten()
    }

    pub(super) fn decode_abort(&mut self, d: usize, plan: usize) {
        if let Some(id) = self.decode_life_of_plan(d, plan) {
            self.decode_step(d, Event::Abort { room: id.room });
        }
    }

    pub(super) fn decode_clear_plan(&mut self, d: usize, plan: usize) {
        if let Some(id) = self.decode_life_of_plan(d, plan) {
            self.forget_life(id, false);
        }
    }

    pub(super) fn resolved(&mut self, d: usize, epoch: u32, addr: String) {
        if self.decodes[d].epoch != epoch {
            return;
        }
        let event = if self.rng.chance(self.knobs.p_resolve_fails) {
            let message = format!("the directory did not answer for {addr}");
            Event::ResolveFailed { addr, message }
        } else {
            let ranks = self
                .prefills
                .iter()
                .map(|n| PrefillRankInfo {
                    endpoint: n.endpoint.clone(),
                    descriptor: n.descriptor.clone(),
                })
                .collect();
            Event::Resolved { addr, ranks }
        };
        self.decode_step(d, event);
    }

    pub(super) fn send_failed(
        &mut self,
        d: usize,
        epoch: u32,
        to: Endpoint,
        kind: &'static str,
        room: Option<RoomId>,
    ) {
        if self.decodes[d].epoch != epoch {
            return;
        }
        let error = format!("sending to {to} did not finish within {CONTROL_SEND_TIMEOUT:?}");
        let event = Event::SendFailed {
            to,
            kind,
            room,
            error,
        };
        self.decode_step(d, event);
    }

    pub(super) fn restart_decode(&mut self, d: usize) {
        self.stats.restarts += 1;
        self.note(|| format!("  decode-{d} restarts"));
        let session = self.rng.next_u64();
        let (t, now) = (self.knobs.topology, self.instant());
        let n = &mut self.decodes[d];
        let ended: Vec<usize> = n.lives.values().map(|l| l.plan).collect();
        let old = n.epoch;
        *n = DecodeNode::new(d, t, old + 1, session, now);
        for plan in ended {
            self.slot_ended(plan);
        }
        self.decode_process_gone(d, old);
        self.arm_decode_timer(d);
    }

    pub(super) fn decode_must_be_terminal(&mut self, id: DecodeLifeId) {
        let Some(life) = self.decode_life(id) else {
            return;
        };
        if !life.state.is_terminal() {
            let what = format!(
                "decode-{} room {} is still {} past its bootstrap and waiting deadlines",
                id.d, id.room, life.state
            );
            self.violate(Invariant::RoomEnds, what);
        }
    }

    pub(super) fn fence_must_be_answered(&mut self, id: DecodeLifeId, ask: u32) {
        let Some(life) = self.decode_life(id) else {
            return;
        };
        if !life.fenced && life.fence_answers < ask {
            let what = format!(
                "decode-{} room {}: no fence and no fence timeout {:?} after asking",
                id.d,
                id.room,
                FENCE_TIMEOUT + SLACK
            );
            self.violate(Invariant::RoomEnds, what);
        }
    }
}
