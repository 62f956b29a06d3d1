//! The prefill rank's machine: every room of one prefill rank, the rooms announced but not
//! created yet, the decode ranks that registered and the connections found lost, with one
//! timer for all of them (docs/lifecycle.md, "Prefill rank").
//!
//! The rules that span rooms live here: a registration of the same session answered as
//! before, a decode rank that registered again with a new session (it restarted) failing the
//! rooms of its old session, metadata checked against the rank's registration, aborts of rooms
//! not created yet. The driver does the I/O it is asked for (connect, disconnect, post) and
//! feeds back what came of it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::time::Instant;

use kvbridge_transport::PeerId;

use super::{Action, EarlyRooms, Event, MetaPeer, PrefillRoom, RoomConfig, failed_status};
use crate::admit_room;
use crate::error::{MachineError, Side};
use crate::state::{FailureCause, FailureReason};
use kvbridge_control::Endpoint;
use kvbridge_control::{AbortAck, AbortRequest, ControlMessage, TransferInfo, WireProblem};
use kvbridge_control::{Incarnation, RoomId, SessionId};

const SIDE: Side = Side::Prefill;

/// A decode rank this prefill accepted: the session it registered with, the transport
/// connection to it, and the driver's handle of it (`conn`: its plan and descriptor).
#[derive(Debug, Clone)]
pub struct AcceptedDecode<P> {
    /// The session it registered with.
    pub session: SessionId,
    /// The transport connection to it.
    pub peer: PeerId,
    /// The driver's handle of it.
    pub conn: P,
}

#[derive(Debug)]
enum DecodeRank<P> {
    Accepted(AcceptedDecode<P>),
    Rejected {
        session: SessionId,
        problems: Vec<WireProblem>,
    },
}

/// What the rank already knows of a registering decode session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Known {
    /// Accepted before: answer as before.
    Accepted,
    /// Refused before, for these problems: answer as before.
    Rejected(Vec<WireProblem>),
    /// Not seen: check, plan and connect it.
    New,
}

/// Something that happened to the prefill rank.
#[derive(Debug)]
pub enum RankEvent<P> {
    /// Create a room (admitted by [`PrefillMachine::admit`] first).
    Create {
        /// The room.
        room: RoomId,
    },
    /// A registering decode rank was checked, planned and connected.
    Registered {
        /// The decode rank's control endpoint.
        endpoint: Endpoint,
        /// Its session, connection and handle.
        decode: AcceptedDecode<P>,
    },
    /// A registering decode rank was refused.
    Rejected {
        /// The decode rank's control endpoint.
        endpoint: Endpoint,
        /// The session refused.
        session: SessionId,
        /// Why, as told to it.
        problems: Vec<WireProblem>,
    },
    /// A decode rank's metadata for a room, from the rank [`PrefillMachine::sender`] accepted:
    /// `conn` its handle (`None` for a dummy), `invalid` why it cannot be served.
    Metadata {
        /// The metadata.
        info: TransferInfo,
        /// The sender's handle (`None` for a dummy).
        conn: Option<P>,
        /// Why it cannot be served, if so.
        invalid: Option<FailureReason>,
    },
    /// A decode rank asks to abort a room.
    DecodeAbort(AbortRequest),
    /// Something that happened to one room (to its life `incarnation` only, when given):
    /// a local failure or abort, a chunk handed over, its driver delivered or ended, a clear.
    Room {
        /// The room.
        room: RoomId,
        /// Its life the event is for (`None`: whichever is held).
        incarnation: Option<Incarnation>,
        /// What happened.
        event: Event<P>,
    },
    /// A batch found the transport connection `peer` lost: the next room that needs it
    /// connects again first.
    PeerLost {
        /// The connection.
        peer: PeerId,
    },
    /// The rank stops: every room fails, no room is admitted any more.
    Shutdown,
    /// [`PrefillMachine::poll_timeout`] passed.
    Timer,
}

/// What the driver must do for the prefill rank.
#[derive(Debug)]
pub enum RankAction {
    /// Queue a control message (boxed: a registration reply is large).
    Send {
        /// The destination.
        to: Endpoint,
        /// The message.
        message: Box<ControlMessage>,
    },
    /// Carry out a room's action (never [`Action::Send`]: those come as [`RankAction::Send`]).
    /// After [`Action::Remove`] the machine holds the room no more.
    Room {
        /// The room.
        room: RoomId,
        /// What to do for it.
        action: Action,
    },
    /// Close a transport connection nothing uses any more.
    Disconnect {
        /// The connection.
        peer: PeerId,
    },
    /// Metadata held for a room that was never created was dropped (its decode ranks told).
    EarlyExpired {
        /// The room.
        room: RoomId,
    },
}

/// Whose deadline a timer entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Due {
    Room(RoomId),
    Early(RoomId),
}

/// Every room of one prefill rank and its decode peers; see the module docs.
#[derive(Debug)]
pub struct PrefillMachine<P> {
    cfg: RoomConfig,
    max_rooms: usize,
    rooms: HashMap<RoomId, PrefillRoom<P>>,
    early: EarlyRooms<P>,
    decodes: HashMap<Endpoint, DecodeRank<P>>,
    /// Connections a batch found lost; the next room of that decode connects again first.
    lost: HashSet<PeerId>,
    /// The deadline armed for each room and early room (as in `timers`).
    armed: HashMap<Due, Instant>,
    /// Deadlines as armed (entries of moved deadlines stay until they reach the top).
    timers: BinaryHeap<Reverse<(Instant, Due)>>,
    next_incarnation: u64,
    closed: bool,
    out: Vec<RankAction>,
}

impl<P: Clone> PrefillMachine<P> {
    /// A machine for the rank described by `cfg`, holding at most `max_rooms` rooms.
    pub fn new(cfg: RoomConfig, max_rooms: usize) -> Self {
        Self {
            early: EarlyRooms::new(cfg.clone(), max_rooms),
            cfg,
            max_rooms,
            rooms: HashMap::new(),
            decodes: HashMap::new(),
            lost: HashSet::new(),
            armed: HashMap::new(),
            timers: BinaryHeap::new(),
            next_incarnation: 0,
            closed: false,
            out: Vec::new(),
        }
    }

    /// Handles one event at `now`; returns what the driver must do, in order.
    pub fn handle(&mut self, event: RankEvent<P>, now: Instant) -> Vec<RankAction> {
        match event {
            RankEvent::Create { room } => self.on_create(room, now),
            RankEvent::Registered { endpoint, decode } => self.on_registered(endpoint, decode, now),
            RankEvent::Rejected {
                endpoint,
                session,
                problems,
            } => {
                self.decodes
                    .insert(endpoint, DecodeRank::Rejected { session, problems });
            }
            RankEvent::Metadata {
                info,
                conn,
                invalid,
            } => self.on_metadata(info, conn, invalid, now),
            RankEvent::DecodeAbort(a) => self.on_decode_abort(a, now),
            RankEvent::Room {
                room,
                incarnation,
                event,
            } => {
                let live = self
                    .rooms
                    .get(&room)
                    .is_some_and(|r| incarnation.is_none_or(|i| i == r.incarnation()));
                if live {
                    self.room_event(room, event, now);
                }
            }
            RankEvent::PeerLost { peer } => {
                self.lost.insert(peer);
            }
            RankEvent::Shutdown => self.on_shutdown(now),
            RankEvent::Timer => self.on_timer(now),
        }
        // Deadlines that moved leave their entries behind: drop those on top, so
        // `poll_timeout` is the next real one.
        while let Some(&Reverse((at, due))) = self.timers.peek() {
            if self.armed.get(&due) == Some(&at) {
                break;
            }
            self.timers.pop();
        }
        std::mem::take(&mut self.out)
    }

    /// When the next [`RankEvent::Timer`] is due (a room's deadline, or the end of what is
    /// held for a room not created yet).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// Whether one more room may be created under `room`.
    ///
    /// # Errors
    /// [`MachineError::Shutdown`], [`MachineError::DuplicateRoom`],
    /// [`MachineError::InvalidRequest`] (`max_rooms`).
    pub fn admit(&self, room: RoomId) -> Result<(), MachineError> {
        if self
            .rooms
            .get(&room)
            .is_some_and(|r| r.is_cleared() && r.is_poisoned())
        {
            return Err(MachineError::InvalidRequest {
                what: "room",
                message: format!(
                    "room {room} is poisoned on this prefill rank: a batch of it could not be \
                     proven final, so its id stays taken while the rank runs (and its decode \
                     keeps the pages quarantined); use another room id, and check the \
                     transport's health"
                ),
            });
        }
        // Counted only for the message of a full rank.
        let full = self.rooms.len() >= self.max_rooms;
        let poisoned = if full { self.poisoned_rooms() } else { 0 };
        let how_to_free = if poisoned == 0 {
            "clear finished rooms or raise PrefillConfig::max_rooms".to_owned()
        } else {
            format!(
                "{poisoned} of them are poisoned rooms kept for good (a batch of each could not \
                 be proven final: check the transport's health); clear finished rooms or raise \
                 PrefillConfig::max_rooms"
            )
        };
        admit_room(
            SIDE,
            room,
            self.closed,
            self.rooms.get(&room).map(PrefillRoom::state),
            self.rooms.len(),
            self.max_rooms,
            &how_to_free,
        )
    }

    /// Rooms kept, cleared, because a batch of each could not be proven final.
    pub fn poisoned_rooms(&self) -> usize {
        self.rooms
            .values()
            .filter(|r| r.is_cleared() && r.is_poisoned())
            .count()
    }

    /// The room's machine, cleared or not (`None`: not held).
    pub fn room(&self, room: RoomId) -> Option<&PrefillRoom<P>> {
        self.rooms.get(&room)
    }

    /// The rooms the caller has not cleared.
    pub fn visible_rooms(&self) -> impl Iterator<Item = &PrefillRoom<P>> + '_ {
        self.rooms.values().filter(|r| !r.is_cleared())
    }

    /// What the rank knows of decode `endpoint`'s `session`.
    pub fn known(&self, endpoint: &Endpoint, session: SessionId) -> Known {
        match self.decodes.get(endpoint) {
            Some(DecodeRank::Accepted(p)) if p.session == session => Known::Accepted,
            Some(DecodeRank::Rejected {
                session: s,
                problems,
            }) if *s == session => Known::Rejected(problems.clone()),
            _ => Known::New,
        }
    }

    /// The accepted decode rank that sent `info`, or why its metadata cannot be used.
    ///
    /// # Errors
    /// The rank never registered, was refused, or `info` comes from its earlier session.
    pub fn sender(&self, info: &TransferInfo) -> Result<&AcceptedDecode<P>, FailureReason> {
        let (room, me) = (info.room, &self.cfg.endpoint);
        match self.decodes.get(&info.decode_endpoint) {
            None => Err(FailureReason::with_peer(
                FailureCause::Unregistered,
                me,
                format!(
                    "decode {} sent metadata for room {room} without registering with prefill \
                     {me} first",
                    info.decode_endpoint
                ),
            )),
            Some(DecodeRank::Rejected { problems, .. }) => Err(FailureReason::with_peer(
                FailureCause::PeerRejected,
                me,
                kvbridge_control::render_problems(problems),
            )),
            Some(DecodeRank::Accepted(p)) if p.session != info.session => {
                Err(FailureReason::with_peer(
                    FailureCause::RemoteFailure,
                    &info.decode_endpoint,
                    format!(
                        "room {room}: metadata from an old session of decode {} (session {} != {})",
                        info.decode_endpoint, info.session, p.session
                    ),
                ))
            }
            Some(DecodeRank::Accepted(p)) => Ok(p),
        }
    }

    /// Whether a batch found the connection `peer` lost (and nothing replaced it since).
    pub fn is_lost(&self, peer: PeerId) -> bool {
        self.lost.contains(&peer)
    }

    /// The connection that already replaced the lost connection `old` of decode `endpoint`
    /// (of the same session), if another room connected again first.
    pub fn replacement(
        &self,
        endpoint: &Endpoint,
        old: PeerId,
        session: SessionId,
    ) -> Option<&AcceptedDecode<P>> {
        match self.decodes.get(endpoint) {
            Some(DecodeRank::Accepted(p)) if p.peer != old && p.session == session => Some(p),
            _ => None,
        }
    }

    /// Puts the new connection `fresh` in place of the lost connection `old` of decode
    /// `endpoint`.
    ///
    /// # Errors
    /// `fresh` is not used (the driver closes it): `Some` connection of the same session
    /// replaced `old` first, or `None` when the decode registered again meanwhile.
    pub fn replace_lost(
        &mut self,
        endpoint: &Endpoint,
        old: PeerId,
        fresh: AcceptedDecode<P>,
    ) -> Result<(), Option<AcceptedDecode<P>>> {
        match self.decodes.get_mut(endpoint) {
            Some(DecodeRank::Accepted(p)) if p.peer == old => {
                *p = fresh;
                self.lost.remove(&old);
                Ok(())
            }
            Some(DecodeRank::Accepted(p)) if p.session == fresh.session => Err(Some(p.clone())),
            _ => Err(None),
        }
    }

    fn on_create(&mut self, room: RoomId, now: Instant) {
        if self.admit(room).is_err() {
            return;
        }
        self.next_incarnation += 1;
        let incarnation = Incarnation::from(self.next_incarnation);
        let machine = PrefillRoom::new(room, incarnation, self.cfg.clone(), now);
        self.rooms.insert(room, machine);
        let (held, tomb) = self.early.take(room);
        self.armed.remove(&Due::Early(room));
        self.rearm(Due::Room(room));
        for mp in held {
            self.room_event(room, Event::Metadata(mp), now);
        }
        if let Some(reason) = tomb {
            self.room_event(room, Event::Fail(reason), now);
        }
    }

    fn on_registered(&mut self, endpoint: Endpoint, decode: AcceptedDecode<P>, now: Instant) {
        let session = decode.session;
        if let Some(DecodeRank::Accepted(p)) = self.decodes.get(&endpoint) {
            if p.session == session {
                // A concurrent twin of the same registration won: it keeps its connection.
                self.out.push(RankAction::Disconnect { peer: decode.peer });
                return;
            }
        }
        let Some(DecodeRank::Accepted(old)) = self
            .decodes
            .insert(endpoint.clone(), DecodeRank::Accepted(decode))
        else {
            return;
        };
        let reason = FailureReason::with_peer(
            FailureCause::RemoteFailure,
            &endpoint,
            format!(
                "decode {endpoint} registered again with a new session (it restarted); its \
                 earlier rooms are failed"
            ),
        );
        let rooms: Vec<RoomId> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.has_peer(&endpoint, Some(old.session)))
            .map(|(&k, _)| k)
            .collect();
        for room in rooms {
            let event = Event::PeerGone {
                endpoint: endpoint.clone(),
                session: Some(old.session),
                reason: reason.clone(),
            };
            self.room_event(room, event, now);
        }
        self.lost.remove(&old.peer);
        self.out.push(RankAction::Disconnect { peer: old.peer });
    }

    fn on_metadata(
        &mut self,
        info: TransferInfo,
        conn: Option<P>,
        invalid: Option<FailureReason>,
        now: Instant,
    ) {
        let room = info.room;
        let mp = MetaPeer { info, peer: conn };
        if self.rooms.get(&room).is_some_and(|r| !r.is_cleared()) {
            // The room fails first; adding the metadata then tells this peer (and every other).
            if let Some(reason) = invalid {
                self.room_event(room, Event::Fail(reason), now);
            }
            self.room_event(room, Event::Metadata(mp), now);
            return;
        }
        let rooms = self.rooms.len();
        if let Err(refused) = self.early.metadata(room, mp, invalid, rooms, now) {
            let (reason, mp) = *refused;
            let (to, message) = failed_status(room, &mp.info, self.cfg.rank, &reason);
            self.out.push(RankAction::Send { to, message });
        }
        self.rearm(Due::Early(room));
    }

    fn on_decode_abort(&mut self, a: AbortRequest, now: Instant) {
        let room = a.room;
        let known = self
            .rooms
            .get(&room)
            .is_some_and(|r| r.has_peer(&a.decode_endpoint, None) || !r.is_cleared());
        if known {
            let event = Event::DecodeAbort {
                from: a.decode_endpoint,
                generation: a.generation,
                reason: a.reason,
            };
            return self.room_event(room, event, now);
        }
        // Not a room of ours (any more): nothing of it is in flight. Held metadata is dropped
        // and the room remembered as cancelled, should it be created after all.
        self.early.abort(room, &a.decode_endpoint, now);
        self.rearm(Due::Early(room));
        self.out.push(RankAction::Send {
            to: a.decode_endpoint.clone(),
            message: Box::new(ControlMessage::AbortAck(AbortAck {
                room,
                generation: a.generation,
                prefill_rank: self.cfg.rank,
                prefill_endpoint: self.cfg.endpoint.clone(),
            })),
        });
    }

    fn on_shutdown(&mut self, now: Instant) {
        self.closed = true;
        let endpoint = self.cfg.endpoint.clone();
        let rooms: Vec<RoomId> = self.rooms.keys().copied().collect();
        for room in rooms {
            let reason = FailureReason::with_peer(
                FailureCause::Shutdown,
                &endpoint,
                format!("the prefill agent at {endpoint} shut down"),
            );
            self.room_event(room, Event::Fail(reason), now);
        }
    }

    fn on_timer(&mut self, now: Instant) {
        while let Some(&Reverse((at, due))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            if self.armed.get(&due) != Some(&at) {
                continue;
            }
            self.armed.remove(&due);
            match due {
                Due::Room(room) => {
                    if let Some(incarnation) = self.rooms.get(&room).map(PrefillRoom::incarnation) {
                        self.room_event(room, Event::TimerFired { incarnation }, now);
                    }
                }
                Due::Early(room) => {
                    let sends = self.early.expire(room, now);
                    if !sends.is_empty() {
                        self.out.push(RankAction::EarlyExpired { room });
                    }
                    for action in sends {
                        if let Action::Send { to, message } = action {
                            self.out.push(RankAction::Send { to, message });
                        }
                    }
                    self.rearm(Due::Early(room));
                }
            }
        }
    }

    /// Feeds `event` to the room's machine and passes its actions on; forgets the room once
    /// it says so.
    fn room_event(&mut self, room: RoomId, event: Event<P>, now: Instant) {
        let Some(machine) = self.rooms.get_mut(&room) else {
            return;
        };
        let mut removed = false;
        for action in machine.handle(event, now) {
            match action {
                Action::Send { to, message } => self.out.push(RankAction::Send { to, message }),
                action => {
                    removed |= matches!(action, Action::Remove);
                    self.out.push(RankAction::Room { room, action });
                }
            }
        }
        if removed {
            self.rooms.remove(&room);
        }
        self.rearm(Due::Room(room));
    }

    /// Arms the deadline `due` has now (a new heap entry only when it moved).
    fn rearm(&mut self, due: Due) {
        let want = match due {
            Due::Room(room) => self.rooms.get(&room).and_then(PrefillRoom::poll_timeout),
            Due::Early(room) => self.early.poll_timeout(room),
        };
        match want {
            None => {
                self.armed.remove(&due);
            }
            Some(at) => {
                if self.armed.insert(due, at) != Some(at) {
                    self.timers.push(Reverse((at, due)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
