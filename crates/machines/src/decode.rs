//! The decode room machine: every rule of a decode rank's rooms as plain data (docs/lifecycle.md,
//! "Decode side").
//!
//! [`DecodeMachine::handle`] takes one [`Event`] (a request, a directory answer, a control
//! message, a failed send, an abort, a timer tick) and the time, and returns the [`Action`]s
//! the driver carries out (send a control message, ask the directory, report a state, a fence
//! proven or timed out). [`DecodeMachine::poll_timeout`] says when the next timer tick is due.
//! No tokio, no clock, no I/O here: the `DecodeAgent` is the driver, and
//! the tests drive the machine by hand with explicit instants.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use kvbridge_handshake::{PeerDescriptor, check_with};

use crate::admit_room;
use crate::config::DecodeConfig;
use crate::error::{MachineError, Side};
use crate::state::{FailureCause, FailureReason, KvTransferError, Lifecycle, RoomState};
use kvbridge_control::Endpoint;
use kvbridge_control::PrefillRankInfo;
use kvbridge_control::{
    AbortAck, AbortRequest, ControlMessage, Heartbeat, Registration, RegistrationOutcome,
    RegistrationReply, StatusUpdate, TransferInfo, WireProblem, render_problems,
};
use kvbridge_control::{Generation, Incarnation, RoomId, SessionId};

const SIDE: Side = Side::Decode;

/// What a room needs from its request, already checked and converted by the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomRequest {
    /// The prefill deployment's bootstrap address.
    pub addr: String,
    /// Destination pages of the send range (entry 0 at the advertised prefix).
    pub dst_pages: Vec<u64>,
    /// The advertised prefix, in tokens.
    pub prefix: u64,
    /// The decode's aux row for the room.
    pub aux_index: u64,
}

/// Something that happened to the decode rank.
// Events and actions are moved once from the driver to the machine and back, never stored:
// boxing the large control messages would only add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Event {
    /// Start receiving a room (admitted by [`DecodeMachine::admit`] first).
    Receive {
        /// The room.
        room: RoomId,
        /// Its request.
        request: RoomRequest,
    },
    /// The directory answered for a bootstrap address asked by [`Action::Resolve`].
    Resolved {
        /// The address.
        addr: String,
        /// Every prefill rank behind it.
        ranks: Vec<PrefillRankInfo>,
    },
    /// The directory could not answer for a bootstrap address.
    ResolveFailed {
        /// The address.
        addr: String,
        /// The directory's error text.
        message: String,
    },
    /// A control message from a prefill rank.
    Control {
        /// The sender.
        from: Endpoint,
        /// The message.
        message: ControlMessage,
    },
    /// A control message sent by an [`Action::Send`] could not be delivered.
    SendFailed {
        /// The destination.
        to: Endpoint,
        /// The message kind ([`ControlMessage::kind`]).
        kind: &'static str,
        /// The message's room, if any.
        room: Option<RoomId>,
        /// The channel's error text.
        error: String,
    },
    /// The scheduler aborts the room.
    Abort {
        /// The room.
        room: RoomId,
    },
    /// Someone waits for the room's fence: arm its one deadline (`fence_timeout`) and the
    /// abort re-sends, unless armed already.
    FenceWanted {
        /// The room.
        room: RoomId,
    },
    /// The agent stops: every room that is not terminal fails; no room is admitted any more.
    Shutdown,
    /// [`DecodeMachine::poll_timeout`] passed.
    Timer,
}

/// What the driver must do.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Queue a control message (per-peer order kept).
    Send {
        /// The destination.
        to: Endpoint,
        /// The message.
        message: ControlMessage,
    },
    /// Ask the directory for the prefill ranks behind `addr`; answer with [`Event::Resolved`]
    /// or [`Event::ResolveFailed`].
    Resolve {
        /// The bootstrap address.
        addr: String,
    },
    /// The room's state changed (to WaitingForInput, Success or Failed).
    Report {
        /// The room.
        room: RoomId,
        /// Its new state.
        state: RoomState,
        /// Time since the room was received.
        elapsed: Duration,
    },
    /// No byte of the failed room can land any more: its pages may be released.
    Fenced {
        /// The room.
        room: RoomId,
        /// Abort acknowledgements it took (0: no prefill ever knew the pages).
        acks: usize,
    },
    /// The fence deadline passed without every acknowledgement: the pages stay quarantined.
    FenceTimedOut {
        /// The room.
        room: RoomId,
        /// How long the fence was awaited.
        waited: Duration,
        /// The peers that did not acknowledge.
        pending: Vec<Endpoint>,
    },
    /// The peer is gone: drop its send queue.
    ForgetPeer {
        /// The peer.
        endpoint: Endpoint,
    },
}

/// What [`DecodeMachine::forget`] returns about the room it removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forgotten {
    /// The prefill endpoints that acknowledged the room's abort.
    pub acked: Vec<Endpoint>,
    /// The room had failed and was not fenced yet.
    pub unfenced: bool,
}

/// A bootstrap address resolved: who to register with and what each does for a room.
#[derive(Debug, Clone)]
struct Resolved {
    targets: Vec<TargetInfo>,
    required_responses: u32,
}

#[derive(Debug, Clone)]
struct TargetInfo {
    endpoint: Endpoint,
    dummy: bool,
    required_dst_info_num: u32,
}

#[derive(Debug, Clone)]
enum Peer {
    Registering {
        expires: Instant,
    },
    Accepted {
        rank: u32,
        misses: u32,
        waiting: Option<u64>,
    },
    Rejected {
        problems: Vec<WireProblem>,
        since: Instant,
    },
    Unreachable {
        reason: String,
        since: Instant,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the directory.
    Resolving,
    /// Waiting for registrations (targets without a rank).
    Registering,
    /// The metadata went out: the prefills know the pages.
    Sent,
}

#[derive(Debug, Clone)]
struct Target {
    info: TargetInfo,
    rank: Option<u32>,
}

#[derive(Debug, Clone, Default)]
struct Fence {
    generation: Option<Generation>,
    unacked: BTreeSet<Endpoint>,
    acked: Vec<Endpoint>,
    fenced: bool,
    started: Option<Instant>,
    deadline: Option<Instant>,
    next_resend: Option<Instant>,
}

#[derive(Debug, Clone)]
struct Room {
    incarnation: Incarnation,
    generation: Generation,
    created_at: Instant,
    /// State and first failure reason, under the update rule.
    life: Lifecycle,
    request: RoomRequest,
    phase: Phase,
    targets: Vec<Target>,
    required_responses: u32,
    successes: BTreeSet<u32>,
    bootstrap_deadline: Option<Instant>,
    waiting_deadline: Option<Instant>,
    /// When the metadata last went to the prefill ranks, and when the room then succeeded.
    metadata_sent: Option<Instant>,
    succeeded: Option<Instant>,
    fence: Fence,
}

impl Room {
    fn waits_on(&self, e: &Endpoint) -> bool {
        self.phase == Phase::Registering
            && self
                .targets
                .iter()
                .any(|t| t.rank.is_none() && &t.info.endpoint == e)
    }

    fn has_target(&self, e: &Endpoint) -> bool {
        self.targets.iter().any(|t| &t.info.endpoint == e)
    }
}

/// Every room of one decode rank, its prefill peers and their health.
#[derive(Debug)]
pub struct DecodeMachine {
    config: DecodeConfig,
    descriptor: PeerDescriptor,
    /// Sent as is to every prefill rank this rank registers with.
    registration: Registration,
    endpoint: Endpoint,
    session: SessionId,
    has_aux: bool,
    rooms: HashMap<RoomId, Room>,
    peers: HashMap<Endpoint, Peer>,
    addrs: HashMap<String, Resolved>,
    resolving: BTreeSet<String>,
    /// Room deadlines as armed (entries of cancelled deadlines stay until due: a tick finds
    /// nothing to do for them).
    deadlines: BinaryHeap<Reverse<(Instant, RoomId)>>,
    next_heartbeat: Instant,
    next_generation: u64,
    next_incarnation: u64,
    next_nonce: u64,
    closed: bool,
    out: Vec<Action>,
}

impl DecodeMachine {
    /// A machine for the rank that sends `registration` (its endpoint, session, descriptor and
    /// memory), started at `now`.
    pub fn new(
        config: DecodeConfig,
        registration: Registration,
        has_aux: bool,
        now: Instant,
    ) -> Self {
        let interval = heartbeat_interval(&config);
        Self {
            descriptor: registration.descriptor.clone(),
            endpoint: registration.decode_endpoint.clone(),
            session: registration.session,
            registration,
            config,
            has_aux,
            rooms: HashMap::new(),
            peers: HashMap::new(),
            addrs: HashMap::new(),
            resolving: BTreeSet::new(),
            deadlines: BinaryHeap::new(),
            next_heartbeat: now + interval,
            next_generation: 1,
            next_incarnation: 0,
            next_nonce: 0,
            closed: false,
            out: Vec::new(),
        }
    }

    /// Handles one event at `now`; returns what the driver must do, in order.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        match event {
            Event::Receive { room, request } => self.on_receive(room, request, now),
            Event::Resolved { addr, ranks } => self.on_resolved(addr, &ranks, now),
            Event::ResolveFailed { addr, message } => {
                self.resolving.remove(&addr);
                let reason =
                    FailureReason::with_peer(FailureCause::BootstrapTimeout, &addr, message);
                self.fail_resolving(&addr, &reason, now);
            }
            Event::Control { from, message } => self.on_control(from, message, now),
            Event::SendFailed {
                to,
                kind,
                room,
                error,
            } => self.on_send_failed(&to, kind, room, &error, now),
            Event::Abort { room } => self.fail_room(
                room,
                FailureReason::new(FailureCause::Aborted, "Aborted by AbortReq."),
                now,
            ),
            Event::FenceWanted { room } => self.on_fence_wanted(room, now),
            Event::Shutdown => self.on_shutdown(now),
            Event::Timer => self.on_timer(now),
        }
        std::mem::take(&mut self.out)
    }

    /// When the next [`Event::Timer`] is due (a room deadline, a registration expiry or the
    /// next heartbeat).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let registrations = self.peers.values().filter_map(|p| match p {
            Peer::Registering { expires } => Some(*expires),
            _ => None,
        });
        self.deadlines
            .peek()
            .map(|Reverse((t, _))| *t)
            .into_iter()
            .chain(registrations)
            .chain([self.next_heartbeat])
            .min()
    }

    /// Whether one more room may be received under `room`.
    ///
    /// # Errors
    /// [`MachineError::Shutdown`], [`MachineError::DuplicateRoom`],
    /// [`MachineError::InvalidRequest`] (`max_rooms`).
    pub fn admit(&self, room: RoomId) -> Result<(), MachineError> {
        admit_room(
            SIDE,
            room,
            self.closed,
            self.state(room),
            self.rooms.len(),
            self.config.max_rooms,
            "release finished rooms or raise DecodeConfig::max_rooms",
        )
    }

    /// The room's state (`None`: not held).
    pub fn state(&self, room: RoomId) -> Option<RoomState> {
        self.rooms.get(&room).map(|r| r.life.state())
    }

    /// The states of every room held.
    pub fn states(&self) -> impl Iterator<Item = RoomState> + '_ {
        self.rooms.values().map(|r| r.life.state())
    }

    /// The room's life on this rank.
    pub fn incarnation(&self, room: RoomId) -> Option<Incarnation> {
        self.rooms.get(&room).map(|r| r.incarnation)
    }

    /// The failure of a Failed room, with its first reason.
    pub fn failure(&self, room: RoomId) -> Option<KvTransferError> {
        self.rooms.get(&room)?.life.error(room)
    }

    /// How long a room that succeeded took from its metadata sent to the prefill ranks to
    /// their Success: one control message each way, the prefill's posts and writes, and
    /// whatever the prefill waited for after the metadata came (its compute, where the decode
    /// asked first). Not the registration before it. `None` for a room not held or that has
    /// not succeeded.
    pub fn transfer_time(&self, room: RoomId) -> Option<Duration> {
        let r = self.rooms.get(&room)?;
        Some(r.succeeded?.saturating_duration_since(r.metadata_sent?))
    }

    /// Whether the room failed and is fenced (`None`: not held).
    pub fn is_fenced(&self, room: RoomId) -> Option<bool> {
        self.rooms
            .get(&room)
            .map(|r| r.life.state() == RoomState::Failed && r.fence.fenced)
    }

    /// Rooms held.
    pub fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// The prefill endpoints that accepted this rank, sorted.
    pub fn registered_peers(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Accepted { .. }))
            .map(|(e, _)| e.clone())
            .collect();
        v.sort();
        v
    }

    /// Removes the room (only the life `incarnation` when given).
    pub fn forget(&mut self, room: RoomId, incarnation: Option<Incarnation>) -> Option<Forgotten> {
        if incarnation.is_some_and(|i| self.incarnation(room) != Some(i)) {
            return None;
        }
        let r = self.rooms.remove(&room)?;
        Some(Forgotten {
            unfenced: r.life.state() == RoomState::Failed && !r.fence.fenced,
            acked: r.fence.acked,
        })
    }

    fn fresh_generation(&mut self) -> Generation {
        let g = Generation::from(self.next_generation);
        self.next_generation += 1;
        g
    }

    fn arm(&mut self, at: Instant, room: RoomId) {
        self.deadlines.push(Reverse((at, room)));
    }

    fn send(&mut self, to: &Endpoint, message: ControlMessage) {
        self.out.push(Action::Send {
            to: to.clone(),
            message,
        });
    }

    fn report(&mut self, room: RoomId, now: Instant) {
        if let Some(r) = self.rooms.get(&room) {
            self.out.push(Action::Report {
                room,
                state: r.life.state(),
                elapsed: now.saturating_duration_since(r.created_at),
            });
        }
    }

    fn on_receive(&mut self, room: RoomId, request: RoomRequest, now: Instant) {
        self.next_incarnation += 1;
        let generation = self.fresh_generation();
        let deadline = now + self.config.bootstrap_timeout;
        let addr = request.addr.clone();
        self.rooms.insert(
            room,
            Room {
                incarnation: Incarnation::from(self.next_incarnation),
                generation,
                created_at: now,
                life: Lifecycle::new(RoomState::Bootstrapping),
                request,
                phase: Phase::Resolving,
                targets: Vec::new(),
                required_responses: 0,
                successes: BTreeSet::new(),
                bootstrap_deadline: Some(deadline),
                waiting_deadline: None,
                metadata_sent: None,
                succeeded: None,
                fence: Fence::default(),
            },
        );
        self.arm(deadline, room);
        if let Some(resolved) = self.addrs.get(&addr).cloned() {
            self.start_registering(room, &resolved, now);
        } else if self.resolving.insert(addr.clone()) {
            self.out.push(Action::Resolve { addr });
        }
    }

    fn rooms_where(&self, f: impl Fn(&Room) -> bool) -> Vec<RoomId> {
        let mut v: Vec<RoomId> = self
            .rooms
            .iter()
            .filter(|(_, r)| f(r))
            .map(|(&k, _)| k)
            .collect();
        v.sort();
        v
    }

    fn on_resolved(&mut self, addr: String, ranks: &[PrefillRankInfo], now: Instant) {
        self.resolving.remove(&addr);
        match self.check_ranks(&addr, ranks) {
            Ok(resolved) => {
                self.addrs.insert(addr.clone(), resolved.clone());
                let waiting = self.rooms_where(|r| {
                    r.phase == Phase::Resolving
                        && r.life.state() == RoomState::Bootstrapping
                        && r.request.addr == addr
                });
                for room in waiting {
                    self.start_registering(room, &resolved, now);
                }
            }
            Err(reason) => self.fail_resolving(&addr, &reason, now),
        }
    }

    fn fail_resolving(&mut self, addr: &str, reason: &FailureReason, now: Instant) {
        for room in self.rooms_where(|r| r.phase == Phase::Resolving && r.request.addr == addr) {
            self.fail_room(room, reason.clone(), now);
        }
    }

    /// The decode-side handshake checks (docs/lifecycle.md, "Decode side") against the first
    /// rank, then the endpoint of every target of the rank mapping.
    fn check_ranks(
        &self,
        addr: &str,
        ranks: &[PrefillRankInfo],
    ) -> Result<Resolved, FailureReason> {
        let Some(first) = ranks.first() else {
            return Err(FailureReason::with_peer(
                FailureCause::BootstrapTimeout,
                addr,
                format!("Could not fetch prefill parallel info from bootstrap_addr: {addr}"),
            ));
        };
        let report = check_with(&first.descriptor, &self.descriptor, &self.config.check);
        if !report.problems.is_empty() {
            let problems: Vec<WireProblem> =
                report.problems.iter().map(WireProblem::from).collect();
            return Err(FailureReason::with_peer(
                FailureCause::PeerRejected,
                addr,
                render_problems(&problems),
            ));
        }
        let Some(mapping) = report.mapping else {
            return Err(FailureReason::with_peer(
                FailureCause::PeerRejected,
                addr,
                "the handshake found no problem but produced no rank mapping",
            ));
        };
        let mut targets = Vec::with_capacity(mapping.peers.len());
        for t in &mapping.peers {
            let found = ranks.iter().find(|r| {
                r.descriptor.attn_tp_rank == t.tp_rank
                    && r.descriptor.attn_cp_rank == t.cp_rank
                    && r.descriptor.pp_rank == t.pp_rank
            });
            let Some(r) = found else {
                return Err(FailureReason::with_peer(
                    FailureCause::BootstrapTimeout,
                    addr,
                    format!(
                        "Could not fetch bootstrap info for: prefill_dp_rank: 0 \
                         prefill_cp_rank: {} target_tp_rank: {} and target_pp_rank {}",
                        t.cp_rank, t.tp_rank, t.pp_rank
                    ),
                ));
            };
            targets.push(TargetInfo {
                endpoint: r.endpoint.clone(),
                dummy: t.is_dummy,
                required_dst_info_num: t.required_dst_info_num,
            });
        }
        Ok(Resolved {
            targets,
            required_responses: mapping.required_prefill_response_num,
        })
    }

    /// Registers the room's targets: known peers count at once, new ones get a registration,
    /// a refusal or an unreachable peer remembered for a heartbeat interval fails the room.
    fn start_registering(&mut self, room: RoomId, resolved: &Resolved, now: Instant) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.life.state() != RoomState::Bootstrapping {
            return;
        }
        r.targets = resolved
            .targets
            .iter()
            .map(|info| Target {
                info: info.clone(),
                rank: None,
            })
            .collect();
        r.required_responses = resolved.required_responses;
        r.phase = Phase::Registering;
        let remember = heartbeat_interval(&self.config);
        for t in &resolved.targets {
            let e = &t.endpoint;
            let failure = match self.peers.get(e) {
                Some(Peer::Accepted { rank, .. }) => {
                    let rank = *rank;
                    self.set_rank(room, e, rank);
                    None
                }
                Some(Peer::Registering { .. }) => None,
                Some(Peer::Rejected { problems, since }) if now - *since < remember => {
                    Some(FailureReason::with_peer(
                        FailureCause::PeerRejected,
                        e,
                        render_problems(problems),
                    ))
                }
                Some(Peer::Unreachable { reason, since }) if now - *since < remember => Some(
                    FailureReason::with_peer(FailureCause::ControlChannel, e, reason.clone()),
                ),
                _ => {
                    self.register(e, now);
                    None
                }
            };
            if let Some(reason) = failure {
                self.fail_room(room, reason, now);
                return;
            }
        }
        self.send_metadata_if_registered(room, now);
    }

    fn register(&mut self, e: &Endpoint, now: Instant) {
        self.peers.insert(
            e.clone(),
            Peer::Registering {
                expires: now + self.config.bootstrap_timeout,
            },
        );
        let message = ControlMessage::Register(self.registration.clone());
        self.send(e, message);
    }

    fn set_rank(&mut self, room: RoomId, e: &Endpoint, rank: u32) {
        if let Some(r) = self.rooms.get_mut(&room) {
            for t in r.targets.iter_mut().filter(|t| &t.info.endpoint == e) {
                t.rank = Some(rank);
            }
        }
    }

    fn send_metadata_if_registered(&mut self, room: RoomId, now: Instant) {
        let ready = self.rooms.get(&room).is_some_and(|r| {
            r.phase == Phase::Registering
                && r.life.state() == RoomState::Bootstrapping
                && r.targets.iter().all(|t| t.rank.is_some())
        });
        if ready {
            self.send_metadata(room, now);
        }
    }

    /// Tells every target where the room's KV goes (dummies learn only the room), then waits
    /// for Success within `waiting_timeout`.
    fn send_metadata(&mut self, room: RoomId, now: Instant) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let deadline = now + self.config.waiting_timeout;
        r.phase = Phase::Sent;
        r.bootstrap_deadline = None;
        r.waiting_deadline = Some(deadline);
        r.metadata_sent = Some(now);
        r.life.update(RoomState::WaitingForInput);
        let mut sends = Vec::with_capacity(r.targets.len());
        for t in &r.targets {
            let dummy = t.info.dummy;
            let info = TransferInfo {
                room,
                generation: r.generation,
                decode_endpoint: self.endpoint.clone(),
                session: self.session,
                dst_pages: if dummy {
                    Vec::new()
                } else {
                    r.request.dst_pages.clone()
                },
                dst_aux_index: (!dummy && self.has_aux).then_some(r.request.aux_index),
                is_dummy: dummy,
                required_dst_info_num: t.info.required_dst_info_num,
                decode_prefix_len: r.request.prefix,
                // The driver adds the room span's trace context (the machine knows no spans).
                traceparent: None,
            };
            sends.push((t.info.endpoint.clone(), ControlMessage::TransferInfo(info)));
        }
        tracing::debug!(%room, peers = sends.len(), required = r.required_responses, "metadata sent");
        for (to, message) in sends {
            self.send(&to, message);
        }
        self.arm(deadline, room);
        self.report(room, now);
    }

    fn on_control(&mut self, from: Endpoint, message: ControlMessage, now: Instant) {
        match message {
            ControlMessage::RegisterReply(r) => self.on_register_reply(r, now),
            ControlMessage::Status(s) => self.on_status(&from, s, now),
            ControlMessage::AbortAck(a) => self.on_abort_ack(a, now),
            ControlMessage::Pong(h) => self.on_pong(&from, h),
            ControlMessage::Ping(h) => self.send(&from, ControlMessage::Pong(h)),
            other => tracing::debug!(
                from = %from,
                kind = other.kind(),
                "decode ignores a message meant for a prefill"
            ),
        }
    }

    fn on_register_reply(&mut self, r: RegistrationReply, now: Instant) {
        if r.session != self.session {
            tracing::debug!(prefill = %r.prefill_endpoint, "registration reply for an old session ignored");
            return;
        }
        let e = r.prefill_endpoint;
        match r.result {
            RegistrationOutcome::Accepted { descriptor } => {
                tracing::info!(prefill = %e, rank = r.prefill_rank, tp_rank = descriptor.attn_tp_rank, "registered with prefill rank");
                self.peers.insert(
                    e.clone(),
                    Peer::Accepted {
                        rank: r.prefill_rank,
                        misses: 0,
                        waiting: None,
                    },
                );
                for room in self.rooms_where(|room| room.waits_on(&e)) {
                    self.set_rank(room, &e, r.prefill_rank);
                    self.send_metadata_if_registered(room, now);
                }
            }
            RegistrationOutcome::Rejected { problems } => {
                let text = render_problems(&problems);
                tracing::warn!(prefill = %e, problems = %text, "the prefill refused this decode rank");
                self.peers.insert(
                    e.clone(),
                    Peer::Rejected {
                        problems,
                        since: now,
                    },
                );
                // Rooms waiting on this peer, or served by it, fail at once with its problems.
                let reason = FailureReason::with_peer(FailureCause::PeerRejected, &e, text);
                self.fail_rooms_of(&e, &reason, now);
            }
        }
    }

    /// Counts a Success of a required rank of the current generation; a Failed status fails
    /// the room (unless it already succeeded).
    fn on_status(&mut self, from: &Endpoint, s: StatusUpdate, now: Instant) {
        let room = s.room;
        let Some(r) = self.rooms.get_mut(&room) else {
            tracing::debug!(%room, from = %from, "status for a room this decode does not hold: dropped");
            return;
        };
        if s.generation != r.generation {
            tracing::debug!(%room, from = %from, "status for an earlier use of the room: dropped");
            return;
        }
        let Some(target) = r
            .targets
            .iter()
            .find(|t| t.rank == Some(s.prefill_rank))
            .map(|t| t.info.clone())
        else {
            tracing::warn!(%room, rank = s.prefill_rank, from = %from, "status from a prefill rank that is not a peer of this room: dropped");
            return;
        };
        match s.state {
            RoomState::Success if target.dummy => {
                tracing::warn!(%room, rank = s.prefill_rank, "Success from a dummy prefill rank ignored");
            }
            RoomState::Success => {
                r.successes.insert(s.prefill_rank);
                let enough = r.successes.len() as u32 >= r.required_responses.max(1);
                if enough && !r.life.state().is_terminal() {
                    r.life.update(RoomState::Success);
                    r.waiting_deadline = None;
                    r.succeeded = Some(now);
                    self.report(room, now);
                }
            }
            RoomState::Failed => self.on_failed_status(room, &target, s, now),
            other => tracing::debug!(
                %room,
                "Ignoring non-terminal status {other} for room {room} from prefill rank {}",
                s.prefill_rank
            ),
        }
    }

    fn on_failed_status(
        &mut self,
        room: RoomId,
        target: &TargetInfo,
        s: StatusUpdate,
        now: Instant,
    ) {
        if s.cause == Some(FailureCause::Unregistered) {
            // The prefill lost this decode's registration (it restarted): register again next
            // time.
            self.peers.remove(&target.endpoint);
            tracing::warn!(prefill = %target.endpoint, "the prefill does not know this decode any more; it will register again");
        }
        if self.state(room) == Some(RoomState::Success) {
            tracing::warn!(%room, rank = s.prefill_rank, "Failed status after Success ignored");
            return;
        }
        let message = s.reason.filter(|m| !m.is_empty()).unwrap_or_else(|| {
            "Failed to get kvcache from prefill instance, it might be dead".to_owned()
        });
        // The prefill's own abort is `aborted` there and a remote failure here, as a decode
        // abort is on the prefill (docs/errors.md, "Transfer failure causes").
        let (cause, message) = match s.cause {
            Some(FailureCause::Aborted) => (
                FailureCause::RemoteFailure,
                format!("Aborted by prefill {}: {message}", target.endpoint),
            ),
            None => (FailureCause::RemoteFailure, message),
            Some(c) => (c, message),
        };
        let reason = FailureReason::with_peer(cause, &target.endpoint, message);
        self.fail_room(room, reason, now);
    }

    fn on_send_failed(
        &mut self,
        to: &Endpoint,
        kind: &'static str,
        room: Option<RoomId>,
        error: &str,
        now: Instant,
    ) {
        match (kind, room) {
            ("register", _) => {
                if !matches!(self.peers.get(to), Some(Peer::Registering { .. })) {
                    return;
                }
                let reason = format!("_register_kv_args to prefill {to} failed: {error}");
                self.peers.insert(
                    to.clone(),
                    Peer::Unreachable {
                        reason: reason.clone(),
                        since: now,
                    },
                );
                let reason = FailureReason::with_peer(FailureCause::ControlChannel, to, reason);
                for room in self.rooms_where(|r| r.waits_on(to)) {
                    self.fail_room(room, reason.clone(), now);
                }
            }
            ("transfer_info", Some(room)) => self.fail_room(
                room,
                FailureReason::with_peer(
                    FailureCause::ControlChannel,
                    to,
                    format!("send_metadata to prefill {to} failed: {error}"),
                ),
                now,
            ),
            _ => {}
        }
    }

    fn fail_rooms_of(&mut self, e: &Endpoint, reason: &FailureReason, now: Instant) {
        for room in self.rooms_where(|r| !r.life.state().is_terminal() && r.has_target(e)) {
            self.fail_room(room, reason.clone(), now);
        }
    }

    /// Fails a room (the first reason wins; Failed is sticky). If its metadata went out, a new
    /// abort generation is armed and every target gets an abort; otherwise no prefill knew the
    /// pages and the room is fenced at once.
    fn fail_room(&mut self, room: RoomId, reason: FailureReason, now: Instant) {
        let sent = match self.rooms.get(&room) {
            None => return,
            Some(r) if r.life.state() == RoomState::Failed => return,
            Some(r) => r.phase == Phase::Sent,
        };
        let generation = sent.then(|| self.fresh_generation());
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let text = reason.message.clone();
        r.life.fail(reason);
        r.bootstrap_deadline = None;
        r.waiting_deadline = None;
        r.fence.generation = generation;
        if sent {
            r.fence.unacked = r.targets.iter().map(|t| t.info.endpoint.clone()).collect();
        }
        let fenced_now = r.fence.unacked.is_empty();
        r.fence.fenced = fenced_now;
        self.report(room, now);
        if let Some(generation) = generation {
            self.send_aborts(room, generation, &text);
        }
        if fenced_now {
            self.out.push(Action::Fenced { room, acks: 0 });
        }
    }

    fn send_aborts(&mut self, room: RoomId, generation: Generation, reason: &str) {
        let Some(r) = self.rooms.get(&room) else {
            return;
        };
        let to: Vec<Endpoint> = r.fence.unacked.iter().cloned().collect();
        for e in to {
            let message = ControlMessage::Abort(AbortRequest {
                room,
                generation,
                decode_endpoint: self.endpoint.clone(),
                reason: reason.to_owned(),
            });
            self.send(&e, message);
        }
    }

    /// Only an ack of the current abort generation counts; the last one fences the room.
    fn on_abort_ack(&mut self, a: AbortAck, _now: Instant) {
        let room = a.room;
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.fence.generation != Some(a.generation) {
            tracing::debug!(%room, generation = %a.generation, "abort-ack for another generation ignored");
            return;
        }
        if !r.fence.unacked.remove(&a.prefill_endpoint) {
            return;
        }
        r.fence.acked.push(a.prefill_endpoint);
        if r.fence.unacked.is_empty() && !r.fence.fenced {
            r.fence.fenced = true;
            r.fence.deadline = None;
            r.fence.next_resend = None;
            let acks = r.fence.acked.len();
            tracing::info!(%room, acks, "room fenced: every sender acknowledged the abort");
            self.out.push(Action::Fenced { room, acks });
        }
    }

    fn on_fence_wanted(&mut self, room: RoomId, now: Instant) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.life.state() != RoomState::Failed || r.fence.fenced || r.fence.deadline.is_some() {
            return;
        }
        let deadline = now + self.config.fence_timeout;
        let resend = now + resend_interval(&self.config);
        r.fence.started = Some(now);
        r.fence.deadline = Some(deadline);
        r.fence.next_resend = Some(resend);
        self.arm(deadline, room);
        self.arm(resend, room);
    }

    fn on_shutdown(&mut self, now: Instant) {
        self.closed = true;
        let reason = FailureReason::with_peer(
            FailureCause::Shutdown,
            &self.endpoint,
            format!("the decode agent at {} shut down", self.endpoint),
        );
        for room in self.rooms_where(|r| !r.life.state().is_terminal()) {
            self.fail_room(room, reason.clone(), now);
        }
    }

    fn on_timer(&mut self, now: Instant) {
        let mut due = Vec::new();
        while let Some(Reverse((t, room))) = self.deadlines.peek().copied() {
            if t > now {
                break;
            }
            self.deadlines.pop();
            due.push(room);
        }
        due.sort();
        due.dedup();
        for room in due {
            self.room_deadlines(room, now);
        }
        self.expire_registrations(now);
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + heartbeat_interval(&self.config);
            self.heartbeat(now);
        }
    }

    fn room_deadlines(&mut self, room: RoomId, now: Instant) {
        let Some(r) = self.rooms.get(&room) else {
            return;
        };
        let due = |d: Option<Instant>| d.is_some_and(|d| d <= now);
        if due(r.bootstrap_deadline) && r.life.state() == RoomState::Bootstrapping {
            let reason = self.bootstrap_timeout_reason(r);
            self.fail_room(room, reason, now);
        } else if due(r.waiting_deadline) && !r.life.state().is_terminal() {
            let reason = self.waiting_timeout_reason(room, r);
            self.fail_room(room, reason, now);
        }
        self.fence_deadlines(room, now);
    }

    fn bootstrap_timeout_reason(&self, r: &Room) -> FailureReason {
        let addr = &r.request.addr;
        let waiting: Vec<String> = r
            .targets
            .iter()
            .filter(|t| t.rank.is_none())
            .map(|t| t.info.endpoint.to_string())
            .collect();
        let what = if r.phase == Phase::Resolving {
            format!("the directory lookup of {addr}")
        } else {
            format!("registration with {}", waiting.join(", "))
        };
        FailureReason::with_peer(
            FailureCause::BootstrapTimeout,
            waiting.first().unwrap_or(addr),
            format!(
                "Prefill bootstrap failed: {what} did not finish within {:.1}s \
                 (bootstrap_addr: {addr})",
                self.config.bootstrap_timeout.as_secs_f64()
            ),
        )
    }

    /// Names the peers that have not reported Success.
    fn waiting_timeout_reason(&self, room: RoomId, r: &Room) -> FailureReason {
        let silent: Vec<String> = r
            .targets
            .iter()
            .filter(|t| !t.info.dummy && !t.rank.is_some_and(|k| r.successes.contains(&k)))
            .map(|t| t.info.endpoint.to_string())
            .collect();
        FailureReason::with_peer(
            FailureCause::WaitingTimeout,
            silent.join(", "),
            format!(
                "Request {room} timed out after {:.1}s in KVPoll.WaitingForInput",
                self.config.waiting_timeout.as_secs_f64()
            ),
        )
    }

    fn fence_deadlines(&mut self, room: RoomId, now: Instant) {
        let resend = resend_interval(&self.config);
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.fence.fenced {
            return;
        }
        if r.fence.deadline.is_some_and(|d| d <= now) {
            let waited = r
                .fence
                .started
                .map_or(self.config.fence_timeout, |s| now - s);
            r.fence.deadline = None;
            r.fence.next_resend = None;
            let pending = r.fence.unacked.iter().cloned().collect();
            self.out.push(Action::FenceTimedOut {
                room,
                waited,
                pending,
            });
            return;
        }
        if r.fence.next_resend.is_some_and(|t| t <= now) {
            let next = now + resend;
            r.fence.next_resend = Some(next);
            let generation = r.fence.generation;
            let reason = r
                .life
                .reason()
                .map(|x| x.message.clone())
                .unwrap_or_default();
            self.arm(next, room);
            if let Some(generation) = generation {
                self.send_aborts(room, generation, &reason);
            }
        }
    }

    /// A registration never answered is forgotten; rooms still waiting on it ask again.
    fn expire_registrations(&mut self, now: Instant) {
        let expired: Vec<Endpoint> = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Registering { expires } if *expires <= now))
            .map(|(e, _)| e.clone())
            .collect();
        for e in expired {
            self.peers.remove(&e);
            if !self.rooms_where(|r| r.waits_on(&e)).is_empty() {
                self.register(&e, now);
            }
        }
    }

    /// Pings every accepted peer; one that missed `heartbeat_max_failures` answers in a row is
    /// lost.
    fn heartbeat(&mut self, now: Instant) {
        let max_failures = self.config.heartbeat_max_failures.max(1);
        let mut accepted: Vec<Endpoint> = self
            .peers
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Accepted { .. }))
            .map(|(e, _)| e.clone())
            .collect();
        accepted.sort();
        let mut lost = Vec::new();
        for e in accepted {
            self.next_nonce += 1;
            let nonce = self.next_nonce;
            let Some(Peer::Accepted {
                misses, waiting, ..
            }) = self.peers.get_mut(&e)
            else {
                continue;
            };
            if waiting.is_some() {
                *misses += 1;
            }
            if *misses >= max_failures {
                lost.push((e, *misses));
            } else {
                *waiting = Some(nonce);
                self.send(&e, ControlMessage::Ping(Heartbeat { nonce }));
            }
        }
        for (e, misses) in lost {
            self.peer_lost(&e, misses, now);
        }
    }

    fn on_pong(&mut self, from: &Endpoint, h: Heartbeat) {
        // Nonces are unique per agent, so the answer is matched by nonce, not by `from`.
        let found = self.peers.values_mut().find_map(|p| match p {
            Peer::Accepted {
                misses, waiting, ..
            } if *waiting == Some(h.nonce) => Some((misses, waiting)),
            _ => None,
        });
        match found {
            Some((misses, waiting)) => {
                *misses = 0;
                *waiting = None;
            }
            None => {
                tracing::debug!(from = %from, nonce = h.nonce, "late or unknown heartbeat answer")
            }
        }
    }

    /// A prefill peer stopped answering: forget it (a later room registers again) and fail
    /// every room that depends on it and has not ended.
    fn peer_lost(&mut self, e: &Endpoint, misses: u32, now: Instant) {
        self.peers.remove(e);
        let mut addrs: Vec<String> = self
            .addrs
            .iter()
            .filter(|(_, r)| r.targets.iter().any(|t| &t.endpoint == e))
            .map(|(a, _)| a.clone())
            .collect();
        addrs.sort();
        for a in &addrs {
            self.addrs.remove(a);
        }
        self.out.push(Action::ForgetPeer {
            endpoint: e.clone(),
        });
        let addr = addrs.first().cloned().unwrap_or_else(|| e.to_string());
        tracing::warn!(prefill = %e, misses, "prefill peer stopped answering heartbeats");
        let reason = FailureReason::with_peer(
            FailureCause::PeerLost,
            e,
            format!(
                "Lost connection with prefill instance (bootstrap_addr: {addr}): {e} \
                 did not answer {misses} consecutive heartbeats"
            ),
        );
        // Rooms that already failed stay as they are; their fence still waits for this peer.
        self.fail_rooms_of(e, &reason, now);
    }
}

fn heartbeat_interval(config: &DecodeConfig) -> Duration {
    config.heartbeat_interval.max(Duration::from_millis(1))
}

fn resend_interval(config: &DecodeConfig) -> Duration {
    config.abort_resend_interval.max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests;
