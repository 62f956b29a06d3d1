//! The simulated world: one event queue on a virtual clock, the control channel, and the loop
//! that runs a schedule until every room life it started has ended.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::checks::{Invariant, Oracle, Stats, Violation};
use super::decode_node::DecodeNode;
use super::prefill_node::{PrefillNode, SimConn};
use super::rng::Rng;
use super::schedule::{
    BATCH_TIMEOUT, BOOTSTRAP_TIMEOUT, CONTROL_SEND_TIMEOUT, FENCE_ASKS, FENCE_GRACE, FENCE_TIMEOUT,
    Knobs, Restart, RoomPlan, Sabotage, Schedule, WAITING_TIMEOUT,
};
use kvbridge_control::Endpoint;
use kvbridge_control::RoomId;
use kvbridge_control::{ControlMessage, Registration, TransferInfo};
use kvbridge_transport::BatchId;

/// More events than any schedule needs: past it the run is taken for one that never ends.
const EVENT_BUDGET: u64 = 400_000;

/// One prefill room life: the rank, its process epoch, the room and the life's own number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefillLifeId {
    pub(super) p: usize,
    pub(super) epoch: u32,
    pub(super) room: RoomId,
    pub(super) life: u64,
}

/// One decode room life, as [`PrefillLifeId`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DecodeLifeId {
    pub(super) d: usize,
    pub(super) epoch: u32,
    pub(super) room: RoomId,
    pub(super) life: u64,
}

/// Something due at an instant of the virtual clock.
#[derive(Debug)]
pub(super) enum Ev {
    Deliver {
        to: Endpoint,
        from: Endpoint,
        message: Box<ControlMessage>,
    },
    PrefillTimer {
        p: usize,
        epoch: u32,
        at: Duration,
    },
    DecodeTimer {
        d: usize,
        epoch: u32,
        at: Duration,
    },
    // The prefill callers.
    Create {
        p: usize,
        plan: usize,
        tries: u32,
    },
    NextChunk(PrefillLifeId),
    PrefillAbort {
        p: usize,
        plan: usize,
    },
    PrefillClear {
        p: usize,
        plan: usize,
    },
    PrefillDone(PrefillLifeId),
    // The prefill agents' tasks.
    Connected {
        p: usize,
        epoch: u32,
        registration: Box<Registration>,
    },
    Reconnected {
        p: usize,
        epoch: u32,
        info: Box<TransferInfo>,
        old: SimConn,
    },
    Planned(PrefillLifeId),
    PostNext(PrefillLifeId),
    Fence(PrefillLifeId),
    FenceGrace(PrefillLifeId),
    // The transport.
    BatchFinal {
        batch: BatchId,
        version: u32,
    },
    WaiterGivesUp {
        batch: BatchId,
    },
    CancelReturned {
        owner: PrefillLifeId,
        batch: BatchId,
        ok: bool,
    },
    // The decode callers.
    Receive {
        d: usize,
        plan: usize,
        tries: u32,
    },
    DecodeAbort {
        d: usize,
        plan: usize,
    },
    DecodeClear {
        d: usize,
        plan: usize,
    },
    DecodeDone(DecodeLifeId),
    WantFence(DecodeLifeId),
    Release(DecodeLifeId),
    // The decode agents' tasks.
    Resolved {
        d: usize,
        epoch: u32,
        addr: String,
    },
    SendFailed {
        d: usize,
        epoch: u32,
        to: Endpoint,
        kind: &'static str,
        room: Option<RoomId>,
    },
    Restart(Restart),
    // Deadlines the checks hold the machines to.
    PrefillMustBeTerminal(PrefillLifeId),
    PrefillMustBeGone(PrefillLifeId),
    DecodeMustBeTerminal(DecodeLifeId),
    FenceMustBeAnswered {
        life: DecodeLifeId,
        ask: u32,
    },
}

/// How a schedule ended.
#[derive(Debug)]
pub(super) struct Outcome {
    pub(super) violation: Option<Violation>,
    pub(super) stats: Stats,
    /// The last events (empty unless traced).
    pub(super) trace: Vec<String>,
}

pub(super) struct World {
    pub(super) knobs: Knobs,
    pub(super) sabotage: Sabotage,
    pub(super) rng: Rng,
    base: Instant,
    pub(super) now: Duration,
    end: Duration,
    queue: BTreeMap<(Duration, u64), Ev>,
    seq: u64,
    pub(super) prefills: Vec<PrefillNode>,
    pub(super) decodes: Vec<DecodeNode>,
    pub(super) transport: super::transport::Transport,
    /// When the last message of each (sender, receiver) pair is delivered: the channel keeps
    /// each pair's order (its contract); messages of different pairs overtake each other.
    fifo: BTreeMap<(Endpoint, Endpoint), Duration>,
    pub(super) plans: Vec<RoomPlan>,
    pub(super) oracle: Oracle,
    /// Caller slots (a rank's part of a plan) not ended yet, per plan: the run ends when
    /// none is left.
    open: Vec<usize>,
    next_life: u64,
    pub(super) stats: Stats,
    trace: Option<(usize, VecDeque<String>)>,
    violation: Option<Violation>,
}

impl World {
    /// The world of `seed`, its clock starting at `base`; `trace` keeps that many of the last
    /// events (0: none, the fast path).
    pub(super) fn new(seed: u64, sabotage: Sabotage, base: Instant, trace: usize) -> Self {
        let mut rng = Rng::new(seed);
        let schedule = Schedule::draw(&mut rng);
        let t = schedule.knobs.topology;
        let prefills = (0..t.prefill_tp as usize)
            .map(|p| PrefillNode::new(p, t))
            .collect();
        let decodes = (0..t.decode_tp as usize)
            .map(|d| DecodeNode::new(d, t, 0, rng.next_u64(), base))
            .collect();
        // Room for the last creation's whole life, fence retries included, and some.
        let end = schedule.last_start()
            + BOOTSTRAP_TIMEOUT
            + WAITING_TIMEOUT
            + (FENCE_TIMEOUT + Duration::from_secs(2)) * FENCE_ASKS
            + Duration::from_secs(120);
        let mut w = Self {
            knobs: schedule.knobs,
            sabotage,
            rng,
            base,
            now: Duration::ZERO,
            end,
            queue: BTreeMap::new(),
            seq: 0,
            prefills,
            decodes,
            transport: Default::default(),
            fifo: BTreeMap::new(),
            plans: schedule.plans,
            oracle: Oracle::default(),
            open: Vec::new(),
            next_life: 0,
            stats: Stats::default(),
            trace: (trace > 0).then(|| (trace, VecDeque::new())),
            violation: None,
        };
        w.schedule_callers();
        for (at, r) in schedule.restarts {
            w.schedule_at(at, Ev::Restart(r));
        }
        for d in 0..w.decodes.len() {
            w.arm_decode_timer(d);
        }
        w
    }

    fn schedule_callers(&mut self) {
        let mut evs = Vec::new();
        for (plan, rp) in self.plans.iter().enumerate() {
            for (p, side) in rp.prefill.iter().enumerate() {
                let Some(s) = side else { continue };
                evs.push((s.start, Ev::Create { p, plan, tries: 0 }));
                evs.extend(s.abort.map(|at| (at, Ev::PrefillAbort { p, plan })));
                evs.extend(s.clear.map(|at| (at, Ev::PrefillClear { p, plan })));
            }
            for (d, side) in rp.decode.iter().enumerate() {
                let Some(s) = side else { continue };
                evs.push((s.start, Ev::Receive { d, plan, tries: 0 }));
                evs.extend(s.abort.map(|at| (at, Ev::DecodeAbort { d, plan })));
                evs.extend(s.clear.map(|at| (at, Ev::DecodeClear { d, plan })));
            }
        }
        self.open = vec![0; self.plans.len()];
        for (_, e) in &evs {
            if let Ev::Create { plan, .. } | Ev::Receive { plan, .. } = e {
                self.open[*plan] += 1;
            }
        }
        for (at, ev) in evs {
            self.schedule_at(at, ev);
        }
    }

    /// Runs the schedule to its end: every caller slot ended, or the first broken invariant.
    pub(super) fn run(mut self) -> Outcome {
        while self.violation.is_none() && self.open.iter().any(|&n| n > 0) {
            let Some(((at, _), ev)) = self.queue.pop_first() else {
                let what = format!("nothing left to happen, yet {}", self.open_lives());
                self.violate(Invariant::RoomEnds, what);
                break;
            };
            if at > self.end {
                let what = format!("the schedule's end passed with {}", self.open_lives());
                self.violate(Invariant::RoomEnds, what);
                break;
            }
            self.stats.events += 1;
            if self.stats.events > EVENT_BUDGET {
                let what = format!("{EVENT_BUDGET} events did not end the run");
                self.violate(Invariant::RoomEnds, what);
                break;
            }
            self.now = at;
            self.note(|| describe(&ev));
            self.dispatch(ev);
        }
        Outcome {
            violation: self.violation,
            stats: self.stats,
            trace: self.trace.map(|(_, t)| t.into()).unwrap_or_default(),
        }
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Deliver { to, from, message } => self.deliver(&to, from, *message),
            Ev::PrefillTimer { p, epoch, at } => self.prefill_timer(p, epoch, at),
            Ev::DecodeTimer { d, epoch, at } => self.decode_timer(d, epoch, at),
            Ev::Create { p, plan, tries } => self.create(p, plan, tries),
            Ev::NextChunk(id) => self.next_chunk(id),
            Ev::PrefillAbort { p, plan } => self.prefill_abort(p, plan),
            Ev::PrefillClear { p, plan } => self.prefill_clear_plan(p, plan),
            Ev::PrefillDone(id) => self.prefill_clear(id),
            Ev::Connected {
                p,
                epoch,
                registration,
            } => self.connected(p, epoch, *registration),
            Ev::Reconnected {
                p,
                epoch,
                info,
                old,
            } => self.reconnected(p, epoch, *info, &old),
            Ev::Planned(id) => self.planned(id),
            Ev::PostNext(id) => self.post_next(id),
            Ev::Fence(id) => self.fence_asked(id),
            Ev::FenceGrace(id) => self.fence_grace(id),
            Ev::BatchFinal { batch, version } => self.batch_final(batch, version),
            Ev::WaiterGivesUp { batch } => self.waiter_gives_up(batch),
            Ev::CancelReturned { owner, batch, ok } => self.cancel_returned(owner, batch, ok),
            Ev::Receive { d, plan, tries } => self.receive(d, plan, tries),
            Ev::DecodeAbort { d, plan } => self.decode_abort(d, plan),
            Ev::DecodeClear { d, plan } => self.decode_clear_plan(d, plan),
            Ev::DecodeDone(id) => self.forget_life(id, false),
            Ev::WantFence(id) => self.want_fence(id),
            Ev::Release(id) => self.forget_life(id, true),
            Ev::Resolved { d, epoch, addr } => self.resolved(d, epoch, addr),
            Ev::SendFailed {
                d,
                epoch,
                to,
                kind,
                room,
            } => self.send_failed(d, epoch, to, kind, room),
            Ev::Restart(Restart::Prefill(p)) => self.restart_prefill(p),
            Ev::Restart(Restart::Decode(d)) => self.restart_decode(d),
            Ev::PrefillMustBeTerminal(id) => self.prefill_must_be_terminal(id),
            Ev::PrefillMustBeGone(id) => self.prefill_must_be_gone(id),
            Ev::DecodeMustBeTerminal(id) => self.decode_must_be_terminal(id),
            Ev::FenceMustBeAnswered { life, ask } => self.fence_must_be_answered(life, ask),
        }
    }

    /// The machines' clock at the current virtual instant.
    pub(super) fn instant(&self) -> Instant {
        self.base + self.now
    }

    /// A machine's instant as an offset of the virtual clock (never in the past).
    pub(super) fn offset(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.base).max(self.now)
    }

    pub(super) fn schedule_at(&mut self, at: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at, self.seq), ev);
    }

    pub(super) fn schedule(&mut self, after: Duration, ev: Ev) {
        self.schedule_at(self.now + after, ev);
    }

    pub(super) fn next_life(&mut self) -> u64 {
        self.next_life += 1;
        self.next_life
    }

    /// A caller slot of `plan` ended (its life ended, its process restarted, or it gave up
    /// creating).
    pub(super) fn slot_ended(&mut self, plan: usize) {
        self.open[plan] -= 1;
    }

    /// Whether an earlier plan with `plan`'s room id is still held somewhere: a request's id
    /// is used again only once every rank let go of its earlier use, so two requests never
    /// meet under one id.
    pub(super) fn earlier_use_open(&self, plan: usize) -> bool {
        let room = self.plans[plan].room;
        (0..plan).any(|q| self.plans[q].room == room && self.open[q] > 0)
    }

    /// Records the first broken invariant; the run stops there.
    pub(super) fn violate(&mut self, invariant: Invariant, what: String) {
        if self.violation.is_none() {
            self.note(|| format!("VIOLATION {invariant:?}: {what}"));
            self.violation = Some(Violation {
                invariant,
                at: self.now,
                what,
            });
        }
    }

    /// Adds a line to the trace (built only when tracing).
    pub(super) fn note(&mut self, line: impl FnOnce() -> String) {
        if let Some((cap, t)) = &mut self.trace {
            if t.len() == *cap {
                t.pop_front();
            }
            t.push_back(format!("{:>12?} {}", self.now, line()));
        }
    }

    /// Sends a control message: dropped, failed back to a decode sender after the send
    /// timeout, or delivered after a random delay (sometimes twice), in order per pair.
    pub(super) fn send(&mut self, from: &Endpoint, to: Endpoint, message: ControlMessage) {
        let kind = message.kind();
        if self.rng.chance(self.knobs.p_drop) {
            self.stats.messages_dropped += 1;
            self.note(|| format!("  dropped {kind} {from} -> {to}"));
            return;
        }
        let decode = self
            .decodes
            .iter()
            .position(|n| &n.endpoint == from)
            .filter(|_| matches!(kind, "register" | "transfer_info"));
        if let Some(d) = decode.filter(|_| self.rng.chance(self.knobs.p_send_fails)) {
            let (epoch, room) = (self.decodes[d].epoch, message.room());
            let ev = Ev::SendFailed {
                d,
                epoch,
                to,
                kind,
                room,
            };
            self.schedule(CONTROL_SEND_TIMEOUT, ev);
            return;
        }
        let delay = self.rng.millis(0, self.knobs.message_delay_ms);
        let last = self.fifo.entry((from.clone(), to.clone())).or_default();
        let at = (self.now + delay).max(*last);
        *last = at;
        if self.rng.chance(self.knobs.p_duplicate) {
            self.stats.messages_duplicated += 1;
            let copy = Ev::Deliver {
                to: to.clone(),
                from: from.clone(),
                message: Box::new(message.clone()),
            };
            self.schedule_at(at, copy);
        }
        let from = from.clone();
        let message = Box::new(message);
        self.schedule_at(at, Ev::Deliver { to, from, message });
    }

    fn deliver(&mut self, to: &Endpoint, from: Endpoint, message: ControlMessage) {
        if let Some(p) = self.prefills.iter().position(|n| &n.endpoint == to) {
            self.prefill_receive(p, from, message);
        } else if let Some(d) = self.decodes.iter().position(|n| &n.endpoint == to) {
            self.decode_receive(d, from, message);
        }
    }

    /// The room lives still held, for a stuck run's report.
    fn open_lives(&self) -> String {
        let mut lives = Vec::new();
        for n in &self.prefills {
            for (room, l) in &n.lives {
                let state = n.machine.room(*room).map(|m| m.state());
                let driver = l.driver.as_ref().map(|d| format!("{:?}", d.phase));
                lives.push(format!(
                    "{} room {room}: {state:?}, driver {driver:?}",
                    n.endpoint
                ));
            }
        }
        for n in &self.decodes {
            for (room, l) in &n.lives {
                lives.push(format!("{} room {room}: {:?}", n.endpoint, l.state));
            }
        }
        let open: usize = self.open.iter().sum();
        format!("{open} caller slots open: {}", lives.join("; "))
    }

    /// How long a prefill room's driver may take to end once fenced: every cancel within
    /// the grace, then every waiter within its batch's deadline plus the grace.
    pub(super) fn fence_bound() -> Duration {
        FENCE_GRACE + BATCH_TIMEOUT + FENCE_GRACE
    }
}

/// One line of the trace for `ev`.
fn describe(ev: &Ev) -> String {
    match ev {
        Ev::Deliver { to, from, message } => {
            format!("{from} -> {to}: {}", super::summarize(message))
        }
        Ev::Connected {
            p, registration, ..
        } => format!(
            "prefill-{p} connected to {} (session {})",
            registration.decode_endpoint, registration.session
        ),
        Ev::Reconnected { p, info, .. } => format!(
            "prefill-{p} reconnected to {} for room {}",
            info.decode_endpoint, info.room
        ),
        other => format!("{other:?}"),
    }
}
