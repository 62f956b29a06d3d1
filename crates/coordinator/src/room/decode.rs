//! The decode room machine: every rule of a decode rank's rooms as plain data (docs/lifecycle.md,
//! "Decode side").
//!
//! [`DecodeMachine::handle`] takes one [`Event`] (a request, a directory answer, a control
//! message, a failed send, an abort, a timer tick) and the time, and returns the [`Action`]s
//! the driver carries out (send a control message, ask the directory, report a state, a fence
//! proven or timed out). [`DecodeMachine::poll_timeout`] says when the next timer tick is due.
//! No tokio, no clock, no I/O here: the [`DecodeAgent`](crate::DecodeAgent) is the driver, and
//! the tests drive the machine by hand with explicit instants.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use kvbridge_handshake::{PeerDescriptor, check_with};

use crate::channel::Endpoint;
use crate::config::DecodeConfig;
use crate::directory::PrefillRankInfo;
use crate::error::CoordinatorError;
use crate::ids::{Generation, Incarnation, RoomId, SessionId};
use crate::messages::{
    AbortAck, AbortRequest, ControlMessage, Heartbeat, Registration, RegistrationOutcome,
    RegistrationReply, StatusUpdate, TransferInfo, WireProblem, render_problems,
};
use crate::state::{FailureCause, FailureReason, KvTransferError, RoomState, admit_room};

const SIDE: &str = "decode";

/// What a room needs from its request, already checked and converted by the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RoomRequest {
    /// The prefill deployment's bootstrap address.
    pub(crate) addr: String,
    /// Destination pages of the send range (entry 0 at the advertised prefix).
    pub(crate) dst_pages: Vec<u64>,
    /// The advertised prefix, in tokens.
    pub(crate) prefix: u64,
    /// The decode's aux row for the room.
    pub(crate) aux_index: u64,
}

/// Something that happened to the decode rank.
// Events and actions are moved once from the driver to the machine and back, never stored:
// boxing the large control messages would only add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub(crate) enum Event {
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
pub(crate) enum Action {
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
pub(crate) struct Forgotten {
    /// The prefill endpoints that acknowledged the room's abort.
    pub(crate) acked: Vec<Endpoint>,
    /// The room had failed and was not fenced yet.
    pub(crate) unfenced: bool,
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
    state: RoomState,
    reason: Option<FailureReason>,
    request: RoomRequest,
    phase: Phase,
    targets: Vec<Target>,
    required_responses: u32,
    successes: BTreeSet<u32>,
    bootstrap_deadline: Option<Instant>,
    waiting_deadline: Option<Instant>,
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
pub(crate) struct DecodeMachine {
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
    pub(crate) fn new(
        config: DecodeConfig,
        registration: Registration,
        has_aux: bool,
        now: Instant,
    ) -> Self {
        let interval = heartbeat_interval(&config);
        Self {
            descriptor: registration.descriptor.clone(),
            endpoint: registration.decode_endpoint.clone(),
            session: SessionId::from(registration.session),
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
    pub(crate) fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
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
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
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
    /// [`CoordinatorError::Shutdown`], [`CoordinatorError::DuplicateRoom`],
    /// [`CoordinatorError::InvalidRequest`] (`max_rooms`).
    pub(crate) fn admit(&self, room: RoomId) -> Result<(), CoordinatorError> {
        admit_room(
            SIDE,
            room.into(),
            self.closed,
            self.state(room),
            self.rooms.len(),
            self.config.max_rooms,
            "release finished rooms or raise DecodeConfig::max_rooms",
        )
    }

    /// The room's state (`None`: not held).
    pub(crate) fn state(&self, room: RoomId) -> Option<RoomState> {
        self.rooms.get(&room).map(|r| r.state)
    }

    /// The states of every room held.
    pub(crate) fn states(&self) -> impl Iterator<Item = RoomState> + '_ {
        self.rooms.values().map(|r| r.state)
    }

    /// The room's life on this rank.
    pub(crate) fn incarnation(&self, room: RoomId) -> Option<Incarnation> {
        self.rooms.get(&room).map(|r| r.incarnation)
    }

    /// The failure of a Failed room, with its first reason.
    pub(crate) fn failure(&self, room: RoomId) -> Option<KvTransferError> {
        let r = self.rooms.get(&room)?;
        let reason = r.reason.clone().filter(|_| r.state == RoomState::Failed)?;
        Some(KvTransferError {
            room: room.into(),
            reason,
            is_from_another_rank: false,
        })
    }

    /// Whether the room failed and is fenced (`None`: not held).
    pub(crate) fn is_fenced(&self, room: RoomId) -> Option<bool> {
        self.rooms
            .get(&room)
            .map(|r| r.state == RoomState::Failed && r.fence.fenced)
    }

    /// Rooms held.
    pub(crate) fn room_count(&self) -> usize {
        self.rooms.len()
    }

    /// The prefill endpoints that accepted this rank, sorted.
    pub(crate) fn registered_peers(&self) -> Vec<Endpoint> {
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
    pub(crate) fn forget(
        &mut self,
        room: RoomId,
        incarnation: Option<Incarnation>,
    ) -> Option<Forgotten> {
        if incarnation.is_some_and(|i| self.incarnation(room) != Some(i)) {
            return None;
        }
        let r = self.rooms.remove(&room)?;
        Some(Forgotten {
            unfenced: r.state == RoomState::Failed && !r.fence.fenced,
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
                state: r.state,
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
                state: RoomState::Bootstrapping,
                reason: None,
                request,
                phase: Phase::Resolving,
                targets: Vec::new(),
                required_responses: 0,
                successes: BTreeSet::new(),
                bootstrap_deadline: Some(deadline),
                waiting_deadline: None,
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
                        && r.state == RoomState::Bootstrapping
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
        if r.state != RoomState::Bootstrapping {
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
                && r.state == RoomState::Bootstrapping
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
        r.state = RoomState::WaitingForInput;
        let mut sends = Vec::with_capacity(r.targets.len());
        for t in &r.targets {
            let dummy = t.info.dummy;
            let info = TransferInfo {
                room: room.into(),
                generation: r.generation.into(),
                decode_endpoint: self.endpoint.clone(),
                session: self.session.into(),
                dst_pages: if dummy {
                    Vec::new()
                } else {
                    r.request.dst_pages.clone()
                },
                dst_aux_index: (!dummy && self.has_aux).then_some(r.request.aux_index),
                is_dummy: dummy,
                required_dst_info_num: t.info.required_dst_info_num,
                decode_prefix_len: r.request.prefix,
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
        if SessionId::from(r.session) != self.session {
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
        let room = RoomId::from(s.room);
        let Some(r) = self.rooms.get_mut(&room) else {
            tracing::debug!(%room, from = %from, "status for a room this decode does not hold: dropped");
            return;
        };
        if Generation::from(s.generation) != r.generation {
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
                if enough && !r.state.is_terminal() {
                    r.state = RoomState::Success;
                    r.waiting_deadline = None;
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
        for room in self.rooms_where(|r| !r.state.is_terminal() && r.has_target(e)) {
            self.fail_room(room, reason.clone(), now);
        }
    }

    /// Fails a room (the first reason wins; Failed is sticky). If its metadata went out, a new
    /// abort generation is armed and every target gets an abort; otherwise no prefill knew the
    /// pages and the room is fenced at once.
    fn fail_room(&mut self, room: RoomId, reason: FailureReason, now: Instant) {
        let sent = match self.rooms.get(&room) {
            None => return,
            Some(r) if r.state == RoomState::Failed => return,
            Some(r) => r.phase == Phase::Sent,
        };
        let generation = sent.then(|| self.fresh_generation());
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        tracing::warn!(%room, cause = %reason.cause, peer = reason.peer.as_deref(), reason = %reason.message, "room failed");
        let text = reason.message.clone();
        r.reason.get_or_insert(reason);
        r.state = RoomState::Failed;
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
                room: room.into(),
                generation: generation.into(),
                decode_endpoint: self.endpoint.clone(),
                reason: reason.to_owned(),
            });
            self.send(&e, message);
        }
    }

    /// Only an ack of the current abort generation counts; the last one fences the room.
    fn on_abort_ack(&mut self, a: AbortAck, _now: Instant) {
        let room = RoomId::from(a.room);
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.fence.generation != Some(Generation::from(a.generation)) {
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
        if r.state != RoomState::Failed || r.fence.fenced || r.fence.deadline.is_some() {
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
        for room in self.rooms_where(|r| !r.state.is_terminal()) {
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
        if due(r.bootstrap_deadline) && r.state == RoomState::Bootstrapping {
            let reason = self.bootstrap_timeout_reason(r);
            self.fail_room(room, reason, now);
        } else if due(r.waiting_deadline) && !r.state.is_terminal() {
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
                .reason
                .as_ref()
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
mod tests {
    use kvbridge_handshake::Role;
    use proptest::prelude::*;

    use super::*;
    use crate::messages::{CONTROL_PROTOCOL_VERSION, TransportInfo};

    const ADDR: &str = "prefill.test:8998";
    const SESSION: u64 = 7;
    const SEC: Duration = Duration::from_secs(1);

    fn ep(name: &str) -> Endpoint {
        Endpoint::new(name)
    }

    fn prefill_ep(i: u32) -> Endpoint {
        ep(&format!("prefill-{i}"))
    }

    /// The decode and prefill descriptors of a topology: MLA (one real prefill rank, the others
    /// dummies) or MHA (every prefill rank sends its heads), prefill TP `tp`, decode TP 1.
    fn descriptors(mla: bool, tp: u32) -> (PeerDescriptor, Vec<PeerDescriptor>) {
        let d = |role, tp, rank| {
            let b = if mla {
                PeerDescriptor::mla(role, 16, 2, 64)
            } else {
                PeerDescriptor::mha(role, 16, 1, 8, 128).kv_cache_dtype("bfloat16")
            };
            b.attn_tp(tp, rank).build().unwrap()
        };
        (
            d(Role::Decode, 1, 0),
            (0..tp).map(|r| d(Role::Prefill, tp, r)).collect(),
        )
    }

    struct Rig {
        m: DecodeMachine,
        t0: Instant,
        prefills: Vec<PeerDescriptor>,
    }

    impl Rig {
        fn new(mla: bool, tp: u32, config: DecodeConfig) -> Self {
            let (decode, prefills) = descriptors(mla, tp);
            let registration = Registration {
                protocol: CONTROL_PROTOCOL_VERSION,
                decode_endpoint: ep("decode-0"),
                session: SESSION,
                descriptor: decode,
                transport: TransportInfo {
                    name: "loopback".into(),
                    descriptor: Vec::new(),
                },
                kv_regions: Vec::new(),
                aux_regions: Vec::new(),
            };
            let t0 = Instant::now();
            Self {
                m: DecodeMachine::new(config, registration, true, t0),
                t0,
                prefills,
            }
        }

        fn one_to_one() -> Self {
            Self::new(true, 1, DecodeConfig::default())
        }

        fn at(&mut self, secs: f64, event: Event) -> Vec<Action> {
            let now = self.t0 + Duration::from_secs_f64(secs);
            self.m.handle(event, now)
        }

        fn ranks(&self) -> Vec<PrefillRankInfo> {
            self.prefills
                .iter()
                .enumerate()
                .map(|(i, d)| PrefillRankInfo {
                    endpoint: prefill_ep(i as u32),
                    descriptor: d.clone(),
                })
                .collect()
        }

        fn resolved(&self) -> Event {
            Event::Resolved {
                addr: ADDR.into(),
                ranks: self.ranks(),
            }
        }

        fn accept(&self, i: u32) -> Event {
            reply(
                i,
                SESSION,
                RegistrationOutcome::Accepted {
                    descriptor: self.prefills[i as usize].clone(),
                },
            )
        }

        /// Receives `room` and registers with every prefill rank; returns the metadata actions.
        fn make_waiting(&mut self, room: u64, secs: f64) -> Vec<Action> {
            let a = self.at(secs, receive(room));
            let mut out = a.clone();
            if a.contains(&Action::Resolve { addr: ADDR.into() }) {
                let ev = self.resolved();
                out.extend(self.at(secs, ev));
            }
            for i in 0..self.prefills.len() as u32 {
                let ev = self.accept(i);
                out.extend(self.at(secs, ev));
            }
            assert_eq!(self.m.state(RoomId(room)), Some(RoomState::WaitingForInput));
            out
        }
    }

    fn receive(room: u64) -> Event {
        Event::Receive {
            room: RoomId(room),
            request: RoomRequest {
                addr: ADDR.into(),
                dst_pages: vec![4, 5, 6],
                prefix: 0,
                aux_index: 2,
            },
        }
    }

    fn reply(i: u32, session: u64, result: RegistrationOutcome) -> Event {
        Event::Control {
            from: prefill_ep(i),
            message: ControlMessage::RegisterReply(RegistrationReply {
                protocol: CONTROL_PROTOCOL_VERSION,
                prefill_endpoint: prefill_ep(i),
                prefill_rank: i,
                session,
                result,
            }),
        }
    }

    fn rejected(i: u32) -> Event {
        reply(
            i,
            SESSION,
            RegistrationOutcome::Rejected {
                problems: vec![WireProblem {
                    code: "KVB-E001".into(),
                    message: "Page size mismatch".into(),
                    remedy: "use one page size".into(),
                }],
            },
        )
    }

    fn status(room: u64, generation: Generation, rank: u32, state: RoomState) -> Event {
        Event::Control {
            from: prefill_ep(rank),
            message: ControlMessage::Status(StatusUpdate {
                room,
                generation: generation.into(),
                state,
                prefill_rank: rank,
                reason: (state == RoomState::Failed).then(|| "boom".to_owned()),
                cause: (state == RoomState::Failed).then_some(FailureCause::TransferError),
            }),
        }
    }

    fn ack(room: u64, generation: Generation, rank: u32) -> Event {
        Event::Control {
            from: prefill_ep(rank),
            message: ControlMessage::AbortAck(AbortAck {
                room,
                generation: generation.into(),
                prefill_rank: rank,
                prefill_endpoint: prefill_ep(rank),
            }),
        }
    }

    fn infos(actions: &[Action]) -> Vec<(Endpoint, TransferInfo)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send {
                    to,
                    message: ControlMessage::TransferInfo(t),
                } => Some((to.clone(), t.clone())),
                _ => None,
            })
            .collect()
    }

    fn aborts(actions: &[Action]) -> Vec<(Endpoint, AbortRequest)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send {
                    to,
                    message: ControlMessage::Abort(t),
                } => Some((to.clone(), t.clone())),
                _ => None,
            })
            .collect()
    }

    fn sends(actions: &[Action], kind: &str) -> Vec<Endpoint> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { to, message } if message.kind() == kind => Some(to.clone()),
                _ => None,
            })
            .collect()
    }

    fn reports(actions: &[Action]) -> Vec<RoomState> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Report { state, .. } => Some(*state),
                _ => None,
            })
            .collect()
    }

    fn generation_of(actions: &[Action]) -> Generation {
        Generation::from(infos(actions)[0].1.generation)
    }

    fn cause(r: &Rig, room: u64) -> FailureCause {
        r.m.failure(RoomId(room)).unwrap().reason.cause
    }

    fn message(r: &Rig, room: u64) -> String {
        r.m.failure(RoomId(room)).unwrap().reason.message
    }

    #[test]
    fn a_room_resolves_registers_sends_its_metadata_and_succeeds() {
        let mut r = Rig::one_to_one();
        let a = r.at(0.0, receive(1));
        assert_eq!(a, vec![Action::Resolve { addr: ADDR.into() }]);
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Bootstrapping));
        let ev = r.resolved();
        let a = r.at(0.1, ev);
        assert_eq!(sends(&a, "register"), vec![prefill_ep(0)]);
        let ev = r.accept(0);
        let a = r.at(0.2, ev);
        let sent = infos(&a);
        assert_eq!(sent.len(), 1);
        let (to, info) = &sent[0];
        assert_eq!(to, &prefill_ep(0));
        assert_eq!(info.dst_pages, vec![4, 5, 6]);
        assert_eq!(info.dst_aux_index, Some(2));
        assert_eq!((info.session, info.is_dummy), (SESSION, false));
        assert_eq!(reports(&a), vec![RoomState::WaitingForInput]);
        assert_eq!(r.m.registered_peers(), vec![prefill_ep(0)]);
        let g = Generation::from(info.generation);
        let a = r.at(1.0, status(1, g, 0, RoomState::Success));
        assert_eq!(
            a,
            vec![Action::Report {
                room: RoomId(1),
                state: RoomState::Success,
                elapsed: SEC,
            }]
        );
        // A second room reuses the resolution and the registration.
        let a = r.at(2.0, receive(2));
        assert_eq!(infos(&a).len(), 1, "{a:?}");
        assert!(sends(&a, "register").is_empty());
    }

    #[test]
    fn success_needs_every_required_rank_once_and_of_the_current_generation() {
        let mut r = Rig::new(false, 2, DecodeConfig::default());
        let a = r.make_waiting(1, 0.0);
        assert_eq!(infos(&a).len(), 2);
        assert!(infos(&a).iter().all(|(_, i)| !i.is_dummy));
        let g = generation_of(&a);
        let stale = Generation::from(g.get() + 100);
        assert!(
            r.at(1.0, status(1, stale, 0, RoomState::Success))
                .is_empty()
        );
        assert!(
            r.at(1.0, status(1, stale, 1, RoomState::Success))
                .is_empty()
        );
        assert!(r.at(1.0, status(1, g, 0, RoomState::Success)).is_empty());
        assert!(
            r.at(1.0, status(1, g, 0, RoomState::Success)).is_empty(),
            "the same rank twice is one response"
        );
        assert!(
            r.at(1.0, status(1, g, 9, RoomState::Success)).is_empty(),
            "not a peer of the room"
        );
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::WaitingForInput));
        let a = r.at(1.0, status(1, g, 1, RoomState::Success));
        assert_eq!(reports(&a), vec![RoomState::Success]);
    }

    #[test]
    fn dummy_ranks_learn_the_room_but_their_success_does_not_count() {
        let mut r = Rig::new(true, 2, DecodeConfig::default());
        let a = r.make_waiting(1, 0.0);
        let sent = infos(&a);
        assert_eq!(sent.len(), 2);
        let (real, dummy): (Vec<_>, Vec<_>) = sent.iter().partition(|(_, i)| !i.is_dummy);
        assert_eq!((real.len(), dummy.len()), (1, 1), "{sent:?}");
        let dummy_info = &dummy[0].1;
        assert!(dummy_info.dst_pages.is_empty());
        assert_eq!(dummy_info.dst_aux_index, None);
        let rank = |e: &Endpoint| if e == &prefill_ep(0) { 0 } else { 1 };
        let g = generation_of(&a);
        assert!(
            r.at(1.0, status(1, g, rank(&dummy[0].0), RoomState::Success))
                .is_empty()
        );
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::WaitingForInput));
        let a = r.at(1.0, status(1, g, rank(&real[0].0), RoomState::Success));
        assert_eq!(reports(&a), vec![RoomState::Success]);
    }

    #[test]
    fn the_first_failure_wins_and_failed_is_sticky() {
        let mut r = Rig::one_to_one();
        let a = r.make_waiting(1, 0.0);
        let g = generation_of(&a);
        let a = r.at(1.0, status(1, g, 0, RoomState::Failed));
        assert_eq!(reports(&a), vec![RoomState::Failed]);
        assert_eq!(message(&r, 1), "boom");
        assert_eq!(cause(&r, 1), FailureCause::TransferError);
        for ev in [
            Event::Abort { room: RoomId(1) },
            status(1, g, 0, RoomState::Success),
            status(1, g, 0, RoomState::Failed),
        ] {
            let a = r.at(2.0, ev);
            assert!(reports(&a).is_empty(), "{a:?}");
            assert!(aborts(&a).is_empty(), "one abort per failure: {a:?}");
        }
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Failed));
        assert_eq!(message(&r, 1), "boom", "first reason wins");
        // A Failed status after Success is ignored.
        let a = r.make_waiting(2, 3.0);
        let g = generation_of(&a);
        r.at(4.0, status(2, g, 0, RoomState::Success));
        assert!(r.at(4.0, status(2, g, 0, RoomState::Failed)).is_empty());
        assert_eq!(r.m.state(RoomId(2)), Some(RoomState::Success));
    }

    #[test]
    fn only_acks_of_the_abort_generation_fence_the_room() {
        let mut r = Rig::new(false, 2, DecodeConfig::default());
        let a = r.make_waiting(1, 0.0);
        let g = generation_of(&a);
        let a = r.at(1.0, Event::Abort { room: RoomId(1) });
        assert_eq!(cause(&r, 1), FailureCause::Aborted);
        let sent = aborts(&a);
        assert_eq!(sent.len(), 2);
        let abort_g = Generation::from(sent[0].1.generation);
        assert_ne!(abort_g, g, "the abort arms a fresh generation");
        assert!(sent.iter().all(|(_, x)| x.reason == "Aborted by AbortReq."));
        assert_eq!(r.m.is_fenced(RoomId(1)), Some(false));
        assert!(r.at(1.5, ack(1, g, 0)).is_empty(), "the room's generation");
        assert!(r.at(1.5, ack(1, abort_g, 1)).is_empty());
        assert!(r.at(1.5, ack(1, abort_g, 1)).is_empty(), "twice is once");
        assert_eq!(
            r.m.is_fenced(RoomId(1)),
            Some(false),
            "rank 0 acked only a stale one"
        );
        let a = r.at(2.0, ack(1, abort_g, 0));
        assert_eq!(
            a,
            vec![Action::Fenced {
                room: RoomId(1),
                acks: 2
            }]
        );
        assert_eq!(r.m.is_fenced(RoomId(1)), Some(true));
        let f = r.m.forget(RoomId(1), None).unwrap();
        assert_eq!(
            (f.acked, f.unfenced),
            (vec![prefill_ep(1), prefill_ep(0)], false)
        );
    }

    #[test]
    fn a_room_that_never_sent_its_metadata_is_fenced_at_once() {
        let mut r = Rig::one_to_one();
        r.at(0.0, receive(1));
        let a = r.at(0.5, Event::Abort { room: RoomId(1) });
        assert!(aborts(&a).is_empty());
        assert!(a.contains(&Action::Fenced {
            room: RoomId(1),
            acks: 0
        }));
        assert_eq!(r.m.is_fenced(RoomId(1)), Some(true));
        // The late directory answer does not revive it.
        let ev = r.resolved();
        assert!(sends(&r.at(1.0, ev), "register").is_empty());
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Failed));
    }

    #[test]
    fn the_fence_resends_aborts_and_is_bounded_by_one_deadline() {
        let config = DecodeConfig {
            fence_timeout: 10 * SEC,
            abort_resend_interval: 2 * SEC,
            heartbeat_interval: 1000 * SEC,
            ..DecodeConfig::default()
        };
        let mut r = Rig::new(false, 2, config);
        r.make_waiting(1, 0.0);
        let a = r.at(1.0, Event::Abort { room: RoomId(1) });
        let abort_g = Generation::from(aborts(&a)[0].1.generation);
        r.at(1.0, ack(1, abort_g, 0));
        assert!(r.at(1.0, Event::FenceWanted { room: RoomId(1) }).is_empty());
        assert_eq!(r.m.poll_timeout(), Some(r.t0 + 3 * SEC));
        let a = r.at(3.0, Event::Timer);
        assert_eq!(
            sends(&a, "abort"),
            vec![prefill_ep(1)],
            "only the peer that has not acknowledged"
        );
        // A second waiter shares the deadline.
        r.at(5.0, Event::FenceWanted { room: RoomId(1) });
        assert!(
            r.at(10.9, Event::Timer)
                .iter()
                .all(|a| !matches!(a, Action::FenceTimedOut { .. }))
        );
        let a = r.at(11.0, Event::Timer);
        assert!(
            a.contains(&Action::FenceTimedOut {
                room: RoomId(1),
                waited: 10 * SEC,
                pending: vec![prefill_ep(1)],
            }),
            "{a:?}"
        );
        assert_eq!(r.m.is_fenced(RoomId(1)), Some(false));
        assert!(r.m.forget(RoomId(9), None).is_none());
        // Asked again: a new deadline; the ack fences the room.
        r.at(12.0, Event::FenceWanted { room: RoomId(1) });
        let a = r.at(12.5, ack(1, abort_g, 1));
        assert!(a.contains(&Action::Fenced {
            room: RoomId(1),
            acks: 2
        }));
        assert!(
            r.at(22.0, Event::Timer)
                .iter()
                .all(|a| !matches!(a, Action::FenceTimedOut { .. }))
        );
    }

    #[test]
    fn bootstrap_timeout_names_the_silent_registration_or_the_directory() {
        let mut r = Rig::one_to_one();
        r.at(0.0, receive(1));
        let ev = r.resolved();
        r.at(0.0, ev);
        assert_eq!(
            r.m.poll_timeout(),
            Some(r.t0 + 5 * SEC),
            "the first heartbeat"
        );
        r.at(29.9, Event::Timer);
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Bootstrapping));
        let a = r.at(30.0, Event::Timer);
        assert_eq!(reports(&a), vec![RoomState::Failed]);
        assert_eq!(cause(&r, 1), FailureCause::BootstrapTimeout);
        assert_eq!(
            message(&r, 1),
            "Prefill bootstrap failed: registration with prefill-0 did not finish within 30.0s \
             (bootstrap_addr: prefill.test:8998)"
        );
        assert_eq!(
            r.m.failure(RoomId(1)).unwrap().reason.peer.as_deref(),
            Some("prefill-0")
        );
        assert_eq!(
            r.m.is_fenced(RoomId(1)),
            Some(true),
            "nothing was published"
        );
        // Without a directory answer.
        r.at(31.0, receive(2));
        let ev = r.resolved();
        r.at(31.0, ev);
        r.at(
            40.0,
            Event::Receive {
                room: RoomId(3),
                request: RoomRequest {
                    addr: "other:1".into(),
                    ..match receive(3) {
                        Event::Receive { request, .. } => request,
                        _ => unreachable!(),
                    }
                },
            },
        );
        r.at(70.0, Event::Timer);
        assert!(message(&r, 3).contains("the directory lookup of other:1 did not finish"));
    }

    #[test]
    fn waiting_timeout_names_the_peers_that_did_not_succeed_and_aborts_them() {
        let mut r = Rig::new(false, 2, DecodeConfig::default());
        let a = r.make_waiting(1, 0.0);
        let g = generation_of(&a);
        r.at(10.0, status(1, g, 0, RoomState::Success));
        let a = r.at(300.0, Event::Timer);
        assert_eq!(reports(&a), vec![RoomState::Failed]);
        assert_eq!(cause(&r, 1), FailureCause::WaitingTimeout);
        assert_eq!(
            message(&r, 1),
            "Request 1 timed out after 300.0s in KVPoll.WaitingForInput"
        );
        assert_eq!(
            r.m.failure(RoomId(1)).unwrap().reason.peer.as_deref(),
            Some("prefill-1")
        );
        assert_eq!(aborts(&a).len(), 2, "both peers knew the pages");
    }

    #[test]
    fn a_peer_that_misses_its_heartbeats_is_lost_with_its_rooms() {
        let config = DecodeConfig {
            heartbeat_interval: 2 * SEC,
            heartbeat_max_failures: 2,
            ..DecodeConfig::default()
        };
        let mut r = Rig::new(true, 1, config);
        r.make_waiting(1, 0.0);
        let a = r.at(2.0, Event::Timer);
        let ping = a
            .iter()
            .find_map(|a| match a {
                Action::Send {
                    message: ControlMessage::Ping(h),
                    ..
                } => Some(*h),
                _ => None,
            })
            .expect("a ping");
        // Answered: the count starts again.
        let pong = Event::Control {
            from: prefill_ep(0),
            message: ControlMessage::Pong(ping),
        };
        r.at(2.5, pong);
        r.at(4.0, Event::Timer);
        r.at(6.0, Event::Timer);
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::WaitingForInput));
        let a = r.at(8.0, Event::Timer);
        assert!(a.contains(&Action::ForgetPeer {
            endpoint: prefill_ep(0)
        }));
        assert_eq!(cause(&r, 1), FailureCause::PeerLost);
        assert_eq!(
            message(&r, 1),
            "Lost connection with prefill instance (bootstrap_addr: prefill.test:8998): \
             prefill-0 did not answer 2 consecutive heartbeats"
        );
        assert!(r.m.registered_peers().is_empty());
        // The next room resolves and registers again.
        let a = r.at(9.0, receive(2));
        assert_eq!(a, vec![Action::Resolve { addr: ADDR.into() }]);
    }

    #[test]
    fn a_refusal_fails_the_waiting_rooms_and_is_remembered_for_a_heartbeat_interval() {
        let mut r = Rig::one_to_one();
        r.at(0.0, receive(1));
        r.at(0.0, receive(2));
        let ev = r.resolved();
        let a = r.at(0.0, ev);
        assert_eq!(
            sends(&a, "register"),
            vec![prefill_ep(0)],
            "one registration per peer"
        );
        let a = r.at(0.1, rejected(0));
        assert_eq!(reports(&a), vec![RoomState::Failed, RoomState::Failed]);
        assert_eq!(cause(&r, 2), FailureCause::PeerRejected);
        assert!(message(&r, 1).contains("Page size mismatch"));
        let a = r.at(1.0, receive(3));
        assert!(sends(&a, "register").is_empty());
        assert_eq!(cause(&r, 3), FailureCause::PeerRejected);
        let a = r.at(6.0, receive(4));
        assert_eq!(sends(&a, "register"), vec![prefill_ep(0)], "asked again");
    }

    #[test]
    fn an_undeliverable_registration_fails_the_room_with_the_channel_error() {
        let mut r = Rig::one_to_one();
        r.at(0.0, receive(1));
        let ev = r.resolved();
        r.at(0.0, ev);
        let a = r.at(
            1.0,
            Event::SendFailed {
                to: prefill_ep(0),
                kind: "register",
                room: None,
                error: "did not complete within 1s".into(),
            },
        );
        assert_eq!(reports(&a), vec![RoomState::Failed]);
        assert_eq!(cause(&r, 1), FailureCause::ControlChannel);
        assert_eq!(
            message(&r, 1),
            "_register_kv_args to prefill prefill-0 failed: did not complete within 1s"
        );
        // A lost metadata message fails its room too.
        let mut r = Rig::one_to_one();
        r.make_waiting(1, 0.0);
        let a = r.at(
            1.0,
            Event::SendFailed {
                to: prefill_ep(0),
                kind: "transfer_info",
                room: Some(RoomId(1)),
                error: "closed".into(),
            },
        );
        assert_eq!(reports(&a), vec![RoomState::Failed]);
        assert_eq!(aborts(&a).len(), 1);
        assert_eq!(cause(&r, 1), FailureCause::ControlChannel);
    }

    #[test]
    fn an_unregistered_status_makes_the_next_room_register_again() {
        let mut r = Rig::one_to_one();
        let a = r.make_waiting(1, 0.0);
        let g = generation_of(&a);
        let ev = Event::Control {
            from: prefill_ep(0),
            message: ControlMessage::Status(StatusUpdate {
                room: 1,
                generation: g.into(),
                state: RoomState::Failed,
                prefill_rank: 0,
                reason: Some("without registering with prefill prefill-0 first".into()),
                cause: Some(FailureCause::Unregistered),
            }),
        };
        r.at(1.0, ev);
        assert_eq!(cause(&r, 1), FailureCause::Unregistered);
        let a = r.at(2.0, receive(2));
        assert_eq!(sends(&a, "register"), vec![prefill_ep(0)]);
    }

    #[test]
    fn replies_to_another_session_are_ignored_and_pings_answered() {
        let mut r = Rig::one_to_one();
        r.at(0.0, receive(1));
        let ev = r.resolved();
        r.at(0.0, ev);
        let stale = reply(
            0,
            SESSION + 1,
            RegistrationOutcome::Accepted {
                descriptor: r.prefills[0].clone(),
            },
        );
        assert!(r.at(0.1, stale).is_empty());
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Bootstrapping));
        let ping = Event::Control {
            from: ep("anyone"),
            message: ControlMessage::Ping(Heartbeat { nonce: 3 }),
        };
        assert_eq!(
            r.at(0.2, ping),
            vec![Action::Send {
                to: ep("anyone"),
                message: ControlMessage::Pong(Heartbeat { nonce: 3 }),
            }]
        );
    }

    #[test]
    fn shutdown_fails_the_rooms_in_flight_and_admits_no_more() {
        let mut r = Rig::one_to_one();
        let a = r.make_waiting(1, 0.0);
        r.at(0.5, status(1, generation_of(&a), 0, RoomState::Success));
        r.make_waiting(2, 1.0);
        let a = r.at(2.0, Event::Shutdown);
        assert_eq!(reports(&a), vec![RoomState::Failed]);
        assert_eq!(r.m.state(RoomId(1)), Some(RoomState::Success));
        assert_eq!(cause(&r, 2), FailureCause::Shutdown);
        assert!(matches!(
            r.m.admit(RoomId(3)),
            Err(CoordinatorError::Shutdown { .. })
        ));
        assert!(matches!(Rig::one_to_one().m.admit(RoomId(1)), Ok(())));
        assert!(matches!(
            r.m.admit(RoomId(1)),
            Err(CoordinatorError::Shutdown { .. })
        ));
    }

    #[test]
    fn a_held_room_id_is_refused_and_forget_respects_the_incarnation() {
        let mut r = Rig::one_to_one();
        r.at(0.0, receive(1));
        assert!(matches!(
            r.m.admit(RoomId(1)),
            Err(CoordinatorError::DuplicateRoom { .. })
        ));
        let first = r.m.incarnation(RoomId(1)).unwrap();
        r.m.forget(RoomId(1), None);
        r.at(1.0, receive(1));
        let second = r.m.incarnation(RoomId(1)).unwrap();
        assert_ne!(first, second);
        assert!(
            r.m.forget(RoomId(1), Some(first)).is_none(),
            "an older life"
        );
        assert!(r.m.forget(RoomId(1), Some(second)).is_some());
        assert_eq!(r.m.room_count(), 0);
    }

    /// One step of a random run over rooms 1..=3 and the two MHA prefill ranks (both real).
    #[derive(Debug, Clone)]
    enum Op {
        Receive(u64),
        Resolve(bool),
        Reply(u32, bool),
        Status(u64, u32, bool, bool),
        Abort(u64),
        Ack(u64, u32, bool),
        FenceWanted(u64),
        SendFailed(u32, Option<u64>),
        Forget(u64),
        Advance(u64),
        Shutdown,
    }

    fn op() -> impl Strategy<Value = Op> {
        let room = 1..=3u64;
        let rank = 0..2u32;
        prop_oneof![
            30 => room.clone().prop_map(Op::Receive),
            20 => prop::bool::weighted(0.8).prop_map(Op::Resolve),
            30 => (rank.clone(), prop::bool::weighted(0.9)).prop_map(|(r, a)| Op::Reply(r, a)),
            40 => (room.clone(), rank.clone(), prop::bool::weighted(0.7), prop::bool::weighted(0.8))
                .prop_map(|(m, r, s, c)| Op::Status(m, r, s, c)),
            10 => room.clone().prop_map(Op::Abort),
            30 => (room.clone(), rank.clone(), prop::bool::weighted(0.8))
                .prop_map(|(m, r, c)| Op::Ack(m, r, c)),
            10 => room.clone().prop_map(Op::FenceWanted),
            5 => (rank, prop::option::of(room.clone())).prop_map(|(r, m)| Op::SendFailed(r, m)),
            5 => room.prop_map(Op::Forget),
            20 => (0..3_000u64).prop_map(Op::Advance),
            3 => (0..400_000u64).prop_map(Op::Advance),
            1 => Just(Op::Shutdown),
        ]
    }

    /// What the run has seen of one life of a room.
    #[derive(Debug, Default)]
    struct Life {
        states: Vec<RoomState>,
        generation: Option<Generation>,
        metadata_to: BTreeSet<Endpoint>,
        successes: BTreeSet<u32>,
        abort_generation: Option<Generation>,
        acked: BTreeSet<Endpoint>,
        first_reason: Option<FailureReason>,
        fenced: bool,
    }

    fn check(lives: &mut HashMap<RoomId, Life>, m: &DecodeMachine, actions: &[Action]) {
        for a in actions {
            match a {
                Action::Send { to, message } => match message {
                    ControlMessage::TransferInfo(t) => {
                        let l = lives.get_mut(&RoomId(t.room)).unwrap();
                        l.generation = Some(Generation::from(t.generation));
                        l.metadata_to.insert(to.clone());
                    }
                    ControlMessage::Abort(x) => {
                        let l = lives.get_mut(&RoomId(x.room)).unwrap();
                        let g = Generation::from(x.generation);
                        assert!(!l.metadata_to.is_empty(), "abort of a room never published");
                        assert_ne!(Some(g), l.generation, "an abort generation is fresh");
                        assert!(
                            l.abort_generation.is_none_or(|a| a == g),
                            "one abort generation per life"
                        );
                        l.abort_generation = Some(g);
                    }
                    _ => {}
                },
                Action::Report { room, state, .. } => {
                    let l = lives.get_mut(room).unwrap();
                    let last = l.states.last().copied().unwrap_or(RoomState::Bootstrapping);
                    assert_ne!(last, RoomState::Failed, "Failed is sticky");
                    assert!(
                        *state == RoomState::Failed || *state > last,
                        "{last} -> {state}: states only move forward"
                    );
                    if *state == RoomState::Success {
                        assert!(l.successes.len() >= 2, "Success before every required rank");
                    }
                    l.states.push(*state);
                }
                Action::Fenced { room, acks } => {
                    let l = lives.get_mut(room).unwrap();
                    assert_eq!(l.states.last(), Some(&RoomState::Failed));
                    assert!(!l.fenced, "fenced twice");
                    if *acks == 0 {
                        assert!(l.metadata_to.is_empty(), "fenced without the acks");
                    } else {
                        assert_eq!(l.acked, l.metadata_to, "fenced before every ack");
                    }
                    l.fenced = true;
                }
                _ => {}
            }
        }
        for (room, l) in lives.iter_mut() {
            if let Some(e) = m.failure(*room) {
                match &l.first_reason {
                    None => l.first_reason = Some(e.reason),
                    Some(first) => assert_eq!(first, &e.reason, "the first reason wins"),
                }
            }
            assert_eq!(
                m.state(*room),
                Some(*l.states.last().unwrap_or(&RoomState::Bootstrapping))
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Random orders of requests, answers, statuses, aborts, acks (current and stale
        /// generations), send failures, time and shutdown: states only move forward, Failed is
        /// sticky with its first reason, Success needs both ranks of the current generation,
        /// and a room is fenced only by every ack of its abort generation (or when nothing was
        /// published).
        #[test]
        fn lifecycle_rules_hold_in_any_event_order(ops in prop::collection::vec(op(), 1..80)) {
            let mut r = Rig::new(false, 2, DecodeConfig::default());
            let mut now = 0u64;
            let mut lives: HashMap<RoomId, Life> = HashMap::new();
            for op in ops {
                let t = |ms: u64| ms as f64 / 1000.0;
                let event = match op {
                    Op::Receive(room) => {
                        if r.m.admit(RoomId(room)).is_err() {
                            continue;
                        }
                        lives.insert(RoomId(room), Life::default());
                        receive(room)
                    }
                    Op::Resolve(true) => r.resolved(),
                    Op::Resolve(false) => Event::ResolveFailed {
                        addr: ADDR.into(),
                        message: "not registered yet".into(),
                    },
                    Op::Reply(i, true) => r.accept(i),
                    Op::Reply(i, false) => rejected(i),
                    Op::Status(room, rank, success, current) => {
                        let Some(l) = lives.get_mut(&RoomId(room)) else { continue };
                        let g = l.generation.unwrap_or(Generation(0));
                        let g = if current { g } else { Generation(g.get() + 1000) };
                        let state = if success { RoomState::Success } else { RoomState::Failed };
                        if current && success && l.metadata_to.contains(&prefill_ep(rank)) {
                            l.successes.insert(rank);
                        }
                        status(room, g, rank, state)
                    }
                    Op::Abort(room) => Event::Abort { room: RoomId(room) },
                    Op::Ack(room, rank, current) => {
                        let Some(l) = lives.get_mut(&RoomId(room)) else { continue };
                        let g = if current {
                            l.abort_generation.unwrap_or(Generation(0))
                        } else {
                            l.generation.unwrap_or(Generation(0))
                        };
                        if current && l.abort_generation.is_some() && l.metadata_to.contains(&prefill_ep(rank)) {
                            l.acked.insert(prefill_ep(rank));
                        }
                        ack(room, g, rank)
                    }
                    Op::FenceWanted(room) => Event::FenceWanted { room: RoomId(room) },
                    Op::SendFailed(rank, room) => Event::SendFailed {
                        to: prefill_ep(rank),
                        kind: if room.is_some() { "transfer_info" } else { "register" },
                        room: room.map(RoomId),
                        error: "closed".into(),
                    },
                    Op::Forget(room) => {
                        r.m.forget(RoomId(room), None);
                        lives.remove(&RoomId(room));
                        continue;
                    }
                    Op::Advance(ms) => {
                        now += ms;
                        Event::Timer
                    }
                    Op::Shutdown => Event::Shutdown,
                };
                let actions = r.at(t(now), event);
                check(&mut lives, &r.m, &actions);
                prop_assert!(r.m.poll_timeout().is_some());
            }
        }
    }
}
