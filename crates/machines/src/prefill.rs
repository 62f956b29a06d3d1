//! The prefill side's machines (docs/lifecycle.md, "Prefill rank" and "Prefill room"):
//! [`PrefillMachine`], one per rank (its rooms, the rooms not created yet, the decode ranks
//! per session, one deadline heap), and [`PrefillRoom`], one room's lifecycle, which the rank's
//! machine drives; [`SendProgress`] is the batch accounting of a room's sends.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvbridge_transport::BatchId;

use crate::error::MachineError;
use crate::state::{FailureCause, FailureReason, Lifecycle, RoomState};
use kvbridge_control::Endpoint;
use kvbridge_control::{AbortAck, ControlMessage, StatusUpdate, TransferInfo};
use kvbridge_control::{Generation, Incarnation, RoomId, SessionId};

/// What every room of one prefill agent shares.
#[derive(Debug, Clone)]
pub struct RoomConfig {
    /// The rank's unique rank, named in every status and ack.
    pub rank: u32,
    /// The rank's control endpoint.
    pub endpoint: Endpoint,
    /// How long a room may stay Bootstrapping.
    pub bootstrap_timeout: Duration,
    /// How long a ready room may take to end.
    pub waiting_timeout: Duration,
}

/// One decode rank's metadata for the room. `peer` is the driver's handle of the accepted
/// decode rank; `None` for a dummy peer (the room's metadata, nothing to send).
#[derive(Debug, Clone)]
pub struct MetaPeer<P> {
    /// The metadata as the decode rank sent it.
    pub info: TransferInfo,
    /// The driver's handle of the decode rank (`None`: a dummy).
    pub peer: Option<P>,
}

/// The sizes of a chunk the caller hands over (its pages are the driver's business).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkShape {
    /// Source pages in the chunk.
    pub pages: u64,
    /// Tokens in the chunk.
    pub tokens: u64,
    /// The last chunk of the room.
    pub is_last: bool,
    /// Tokens one source page id stands for (`page_size · dcp_size`).
    pub page_tokens: u64,
    /// The layers (KV entries) this hand-over carries when the chunk goes layer by layer
    /// (`None`: all of them at once).
    pub layers: Option<LayerPart>,
}

/// Part of a chunk sent layer by layer: KV entries `[start, end)` of `total`. A chunk's parts
/// come in order, `0..a`, `a..b`, ... up to `total`, all with the same pages and tokens; the
/// send range advances, and a last chunk concludes the room, with the part that reaches
/// `total` (docs/lifecycle.md, "Layer by layer").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPart {
    /// First entry of the part.
    pub start: u32,
    /// One past its last entry.
    pub end: u32,
    /// The entries a whole chunk has.
    pub total: u32,
}

/// A chunk whose first parts were handed over and whose other layers are due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OpenPart {
    pages: u64,
    tokens: u64,
    is_last: bool,
    next: u32,
}

/// What happens to a prefill room.
#[derive(Debug)]
pub enum Event<P> {
    /// A decode rank's metadata (already validated by the driver).
    Metadata(MetaPeer<P>),
    /// Fail the room (local abort or clear, shutdown, invalid metadata, a failed batch, ...).
    Fail(FailureReason),
    /// A decode rank is gone (it registered again with a new session): fails the room if the
    /// rank (of that session, when given) sent metadata for it.
    PeerGone {
        /// The decode rank.
        endpoint: Endpoint,
        /// Its session that is gone (`None`: any).
        session: Option<SessionId>,
        /// Why the room fails.
        reason: FailureReason,
    },
    /// A decode rank asks to abort the room; it is acknowledged once nothing can land.
    DecodeAbort {
        /// The decode rank, where the ack goes.
        from: Endpoint,
        /// The abort's generation, echoed in the ack.
        generation: Generation,
        /// Why, as the decode said.
        reason: String,
    },
    /// The caller hands over a chunk to send.
    Chunk(ChunkShape),
    /// The room's driver delivered every batch (KV and aux) to every decode rank.
    Delivered {
        /// The room's life the driver was started for.
        incarnation: Incarnation,
        /// Bytes delivered.
        bytes: u64,
    },
    /// The room's driver ended: every batch it posted is final, or `poisoned` (some batch
    /// could not be proven final).
    DriverEnded {
        /// The room's life the driver was started for.
        incarnation: Incarnation,
        /// Some batch could not be proven final.
        poisoned: bool,
    },
    /// A timer armed for [`PrefillRoom::poll_timeout`] fired.
    TimerFired {
        /// The room's life the timer was armed for.
        incarnation: Incarnation,
    },
    /// The caller forgets the room.
    Clear,
}

/// What the driver does for a prefill room.
#[derive(Debug)]
pub enum Action {
    /// Send a control message (boxed: a registration reply is large).
    Send {
        /// The destination.
        to: Endpoint,
        /// The message.
        message: Box<ControlMessage>,
    },
    /// The state changed: publish it (`reason` when it became Failed).
    Report {
        /// The new state.
        state: RoomState,
        /// Why it failed (with Failed).
        reason: Option<FailureReason>,
    },
    /// The room succeeded: `bytes` delivered, `elapsed` since creation (metrics, logs).
    Succeeded {
        /// Bytes delivered.
        bytes: u64,
        /// Time since the room was created.
        elapsed: Duration,
    },
    /// Post the chunk handed over, at these offsets into the send range; start the room's
    /// driver first when `start_driver`.
    PostChunk {
        /// Source pages of the send range before this chunk.
        page_offset: u64,
        /// Tokens of the send range before this chunk.
        token_offset: u64,
        /// This is the room's first chunk: start its driver.
        start_driver: bool,
    },
    /// The chunk handed over is refused (nothing is posted).
    RefuseChunk(MachineError),
    /// Stop taking chunks and cancel every batch in flight (the fence); the driver ends with
    /// [`Event::DriverEnded`].
    CancelBatches,
    /// A decode rank's abort is not acknowledged: a batch of the room could not be fenced.
    AckWithheld {
        /// The decode rank that asked.
        to: Endpoint,
    },
    /// Forget the room: it is cleared and nothing of it is in flight.
    Remove,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deadline {
    Bootstrap,
    Waiting,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    /// No chunk posted yet.
    Idle,
    /// Batches may be in flight: failure notices and abort acks wait for it to end.
    Running,
    /// Ended: every batch is final (or the room is poisoned).
    Ended,
}

/// One room's lifecycle on a prefill rank; see the module docs.
#[derive(Debug)]
pub struct PrefillRoom<P> {
    room: RoomId,
    incarnation: Incarnation,
    cfg: RoomConfig,
    life: Lifecycle,
    created_at: Instant,
    deadline: Option<(Deadline, Instant)>,
    peers: Vec<MetaPeer<P>>,
    required: u32,
    prefix: Option<u64>,
    pages_sent: u64,
    tokens_sent: u64,
    last_sent: bool,
    open_part: Option<OpenPart>,
    driver: Driver,
    /// Decode aborts to acknowledge once the driver ended.
    pending_acks: Vec<(Endpoint, Generation)>,
    poisoned: bool,
    /// Decode ranks already told the room failed.
    notified: HashSet<Endpoint>,
    cleared: bool,
}

impl<P: Clone> PrefillRoom<P> {
    /// A room created at `now` (Bootstrapping; its bootstrap deadline starts).
    pub fn new(room: RoomId, incarnation: Incarnation, cfg: RoomConfig, now: Instant) -> Self {
        let deadline = Some((Deadline::Bootstrap, now + cfg.bootstrap_timeout));
        Self {
            room,
            incarnation,
            cfg,
            life: Lifecycle::new(RoomState::Bootstrapping),
            created_at: now,
            deadline,
            peers: Vec::new(),
            required: 0,
            prefix: None,
            pages_sent: 0,
            tokens_sent: 0,
            last_sent: false,
            open_part: None,
            driver: Driver::Idle,
            pending_acks: Vec::new(),
            poisoned: false,
            notified: HashSet::new(),
            cleared: false,
        }
    }

    /// The room.
    pub fn room(&self) -> RoomId {
        self.room
    }

    /// This life of the room id on the rank.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// The room's state.
    pub fn state(&self) -> RoomState {
        self.life.state()
    }

    /// The decode prefix, once a decode rank sent metadata.
    pub fn prefix(&self) -> Option<u64> {
        self.prefix
    }

    /// Cleared by the caller (it may still be fenced).
    pub fn is_cleared(&self) -> bool {
        self.cleared
    }

    /// A batch of the room could not be proven final: the room is kept (hidden once cleared)
    /// and no abort of it is acknowledged.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// The decode ranks that sent metadata, in arrival order.
    pub fn peers(&self) -> &[MetaPeer<P>] {
        &self.peers
    }

    /// Whether `endpoint` (of `session`, when given) sent metadata for the room.
    pub fn has_peer(&self, endpoint: &Endpoint, session: Option<SessionId>) -> bool {
        self.peers.iter().any(|p| {
            &p.info.decode_endpoint == endpoint && session.is_none_or(|s| p.info.session == s)
        })
    }

    /// When the driver must feed [`Event::TimerFired`] (none once the room is terminal).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline.map(|(_, at)| at)
    }

    /// Applies `event` at `now`; returns what the driver must do, in order.
    pub fn handle(&mut self, event: Event<P>, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Metadata(mp) => self.on_metadata(mp, now, &mut out),
            Event::Fail(reason) => self.fail(reason, &mut out),
            Event::PeerGone {
                endpoint,
                session,
                reason,
            } => {
                if self.has_peer(&endpoint, session) {
                    self.fail(reason, &mut out);
                }
            }
            Event::DecodeAbort {
                from,
                generation,
                reason,
            } => self.on_decode_abort(from, generation, reason, &mut out),
            Event::Chunk(shape) => self.on_chunk(shape, now, &mut out),
            Event::Delivered { incarnation, bytes } => {
                if incarnation == self.incarnation && self.driver == Driver::Running {
                    self.succeed(bytes, now, &mut out);
                }
            }
            Event::DriverEnded {
                incarnation,
                poisoned,
            } => {
                if incarnation == self.incarnation && self.driver == Driver::Running {
                    self.on_driver_ended(poisoned, &mut out);
                }
            }
            Event::TimerFired { incarnation } => {
                if incarnation == self.incarnation {
                    self.on_timer(now, &mut out);
                }
            }
            Event::Clear => self.on_clear(&mut out),
        }
        out
    }

    fn on_metadata(&mut self, mp: MetaPeer<P>, now: Instant, out: &mut Vec<Action>) {
        let e = mp.info.decode_endpoint.clone();
        if let Some(existing) = self.peers.iter().find(|p| p.info.decode_endpoint == e) {
            // The same decode rank again: a retry of the same generation is a no-op, another
            // generation is a second use of the room id.
            if existing.info.generation != mp.info.generation {
                self.fail(
                    FailureReason::with_peer(
                        FailureCause::DuplicateRoom,
                        &e,
                        "Duplicate decode bootstrap room",
                    ),
                    out,
                );
            }
            return;
        }
        self.required = self.required.max(mp.info.required_dst_info_num);
        if self.prefix.is_none() {
            self.prefix = Some(mp.info.decode_prefix_len);
        }
        self.peers.push(mp);
        match self.life.state() {
            RoomState::Failed => self.failure_notices(out),
            RoomState::Bootstrapping if self.peers.len() as u32 >= self.required.max(1) => {
                self.report(RoomState::WaitingForInput, out);
                self.deadline = Some((Deadline::Waiting, now + self.cfg.waiting_timeout));
            }
            _ => {}
        }
    }

    fn on_decode_abort(
        &mut self,
        from: Endpoint,
        generation: Generation,
        reason: String,
        out: &mut Vec<Action>,
    ) {
        if self.life.state() != RoomState::Success {
            self.fail(
                FailureReason::with_peer(
                    FailureCause::RemoteFailure,
                    &from,
                    format!("Aborted by decode {from}: {reason}"),
                ),
                out,
            );
        }
        if self.driver == Driver::Running {
            self.pending_acks.push((from, generation));
        } else if self.poisoned {
            out.push(Action::AckWithheld { to: from });
        } else {
            out.push(self.ack(from, generation));
        }
    }

    fn on_chunk(&mut self, c: ChunkShape, now: Instant, out: &mut Vec<Action>) {
        let room = self.room;
        let invalid = |message: String| {
            Action::RefuseChunk(MachineError::InvalidRequest {
                what: "chunk",
                message,
            })
        };
        match self.life.state() {
            RoomState::Failed => {
                if let Some(e) = self.life.error(room) {
                    out.push(Action::RefuseChunk(e.into()));
                }
                return;
            }
            RoomState::Bootstrapping => {
                out.push(Action::RefuseChunk(MachineError::RoomNotReady {
                    room,
                    state: RoomState::Bootstrapping,
                    operation: "send_chunk",
                    needed: RoomState::WaitingForInput,
                }));
                return;
            }
            RoomState::Success => {
                out.push(invalid(format!("room {room} already ended in Success")));
                return;
            }
            RoomState::WaitingForInput | RoomState::Transferring => {}
        }
        if self.last_sent {
            out.push(invalid(format!(
                "the last chunk of room {room} was already sent"
            )));
            return;
        }
        if self.driver == Driver::Ended || self.cleared {
            out.push(invalid(format!("room {room} stopped accepting chunks")));
            return;
        }
        if let Err(message) = self.check_part(&c) {
            out.push(invalid(message));
            return;
        }
        // A later part of a chunk was checked with its first part.
        if self.open_part.is_none() {
            if let Err(message) = self.check_capacity(&c) {
                out.push(invalid(message));
                return;
            }
        }
        let (page_offset, token_offset) = (self.pages_sent, self.tokens_sent);
        let concludes = c.layers.is_none_or(|p| p.end == p.total);
        if concludes {
            self.tokens_sent += c.tokens;
            self.pages_sent += c.pages;
            self.last_sent = c.is_last;
            self.open_part = None;
        } else {
            self.open_part = Some(OpenPart {
                pages: c.pages,
                tokens: c.tokens,
                is_last: c.is_last,
                next: c.layers.map_or(0, |p| p.end),
            });
        }
        self.report(RoomState::Transferring, out);
        if self.peers.iter().all(|p| p.peer.is_none()) {
            // Only dummy peers: nothing to send; the last chunk concludes the room here.
            if concludes && c.is_last {
                self.succeed(0, now, out);
            }
            return;
        }
        let start_driver = self.driver == Driver::Idle;
        if start_driver {
            self.driver = Driver::Running;
        }
        out.push(Action::PostChunk {
            page_offset,
            token_offset,
            start_driver,
        });
    }

    /// A chunk's tokens fit its pages, which only the last chunk may leave part empty.
    fn check_capacity(&self, c: &ChunkShape) -> Result<(), String> {
        // The chunk starts at position prefix + tokens_sent, possibly mid-page.
        let page_tokens = c.page_tokens.max(1);
        let start = self.prefix.unwrap_or(0).saturating_add(self.tokens_sent) % page_tokens;
        let capacity = c
            .pages
            .saturating_mul(page_tokens)
            .saturating_sub(if c.pages == 0 { 0 } else { start });
        if c.tokens > capacity {
            return Err(format!(
                "num_kv_tokens must fit in the provided source pages, got tokens={}, \
                 capacity={capacity} ({} pages of {page_tokens} tokens, starting {start} \
                 tokens into the first)",
                c.tokens, c.pages
            ));
        }
        if !c.is_last && c.tokens != capacity {
            return Err(format!(
                "only the last chunk may end mid-page: this chunk has {} pages ({capacity} \
                 token slots from where the send range stands) but {} tokens; floor \
                 non-last chunks to whole pages",
                c.pages, c.tokens
            ));
        }
        Ok(())
    }

    /// A part of a chunk sent layer by layer follows the part before it, of the same chunk.
    fn check_part(&self, c: &ChunkShape) -> Result<(), String> {
        let room = self.room;
        if let Some(p) = c.layers {
            if p.start >= p.end || p.end > p.total {
                return Err(format!(
                    "layers [{}, {}) of {} is not a part of a chunk: it takes 0 <= start < end \
                     <= {}",
                    p.start, p.end, p.total, p.total
                ));
            }
        }
        let next = self.open_part.map_or(0, |o| o.next);
        let start = c.layers.map_or(0, |p| p.start);
        if start != next {
            return Err(match c.layers {
                Some(p) => format!(
                    "room {room} expects layers from {next}, got layers [{}, {}): a chunk's \
                     layers are handed over in order, each once",
                    p.start, p.end
                ),
                None => format!(
                    "room {room} is sending a chunk layer by layer and expects its layers \
                     from {next}: hand over the rest of that chunk before the next one"
                ),
            });
        }
        if let Some(o) = self.open_part {
            if (o.pages, o.tokens, o.is_last) != (c.pages, c.tokens, c.is_last) {
                return Err(format!(
                    "room {room} is sending a chunk of {} pages and {} tokens (last: {}) layer \
                     by layer, got a part of {} pages and {} tokens (last: {}): every part of \
                     a chunk has the same pages and tokens",
                    o.pages, o.tokens, o.is_last, c.pages, c.tokens, c.is_last
                ));
            }
        }
        Ok(())
    }

    fn on_driver_ended(&mut self, poisoned: bool, out: &mut Vec<Action>) {
        self.driver = Driver::Ended;
        self.poisoned |= poisoned;
        if self.life.state() == RoomState::Failed {
            self.failure_notices(out);
        }
        for (to, generation) in std::mem::take(&mut self.pending_acks) {
            if self.poisoned {
                out.push(Action::AckWithheld { to });
            } else {
                out.push(self.ack(to, generation));
            }
        }
        // A poisoned room is never forgotten: its aborts stay unacknowledged (below) for as
        // long as the rank lives, since a batch of it may still land.
        if self.cleared && !self.poisoned {
            out.push(Action::Remove);
        }
    }

    fn on_timer(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some((kind, at)) = self.deadline else {
            return;
        };
        if now < at {
            return;
        }
        let room = self.room;
        let state = self.life.state();
        let names: Vec<String> = self
            .peers
            .iter()
            .map(|p| p.info.decode_endpoint.to_string())
            .collect();
        let reason = match kind {
            Deadline::Bootstrap if state == RoomState::Bootstrapping => {
                // The decode ranks heard from so far are named (none: no decode asked for it).
                let heard = if names.is_empty() {
                    "no decode rank".to_owned()
                } else {
                    names.join(", ")
                };
                let secs = self.cfg.bootstrap_timeout.as_secs_f64();
                FailureReason::with_peer(
                    FailureCause::BootstrapTimeout,
                    heard,
                    format!("Request {room} timed out after {secs:.1}s in KVPoll.Bootstrapping"),
                )
            }
            Deadline::Waiting if !state.is_terminal() => {
                let secs = self.cfg.waiting_timeout.as_secs_f64();
                FailureReason::with_peer(
                    FailureCause::WaitingTimeout,
                    names.join(", "),
                    format!("Request {room} timed out after {secs:.1}s in KVPoll.{state}"),
                )
            }
            _ => {
                self.deadline = None;
                return;
            }
        };
        self.fail(reason, out);
    }

    fn on_clear(&mut self, out: &mut Vec<Action>) {
        if self.cleared {
            return;
        }
        if !self.life.state().is_terminal() {
            self.fail(
                FailureReason::new(FailureCause::Aborted, "Cleared before the transfer ended"),
                out,
            );
        }
        self.cleared = true;
        if self.driver == Driver::Running {
            out.push(Action::CancelBatches);
        } else if !self.poisoned {
            out.push(Action::Remove);
        }
    }

    /// Fails the room (first reason wins). Without a running driver the decode ranks are told
    /// now; otherwise the driver fences its batches first and they are told when it ends.
    fn fail(&mut self, reason: FailureReason, out: &mut Vec<Action>) {
        if !self.life.fail(reason) {
            return;
        }
        self.deadline = None;
        out.push(Action::Report {
            state: RoomState::Failed,
            reason: self.life.reason().cloned(),
        });
        if self.driver == Driver::Running {
            out.push(Action::CancelBatches);
        }
        self.failure_notices(out);
    }

    fn succeed(&mut self, bytes: u64, now: Instant, out: &mut Vec<Action>) {
        if !self.life.update(RoomState::Success) {
            return;
        }
        self.deadline = None;
        out.push(Action::Report {
            state: RoomState::Success,
            reason: None,
        });
        out.push(Action::Succeeded {
            bytes,
            elapsed: now.saturating_duration_since(self.created_at),
        });
        for p in self.peers.iter().filter(|p| p.peer.is_some()) {
            out.push(Action::Send {
                to: p.info.decode_endpoint.clone(),
                message: Box::new(self.status(&p.info, RoomState::Success, None)),
            });
        }
    }

    fn report(&mut self, state: RoomState, out: &mut Vec<Action>) {
        if self.life.update(state) {
            out.push(Action::Report {
                state,
                reason: None,
            });
        }
    }

    /// Failure statuses for every non-dummy decode rank not told yet (none while the driver
    /// may have batches in flight: they are told when it ends).
    fn failure_notices(&mut self, out: &mut Vec<Action>) {
        if self.driver == Driver::Running {
            return;
        }
        let reason =
            self.life.reason().cloned().unwrap_or_else(|| {
                FailureReason::new(FailureCause::OtherRank, "KV transfer failed")
            });
        for p in self.peers.iter().filter(|p| p.peer.is_some()) {
            if self.notified.insert(p.info.decode_endpoint.clone()) {
                out.push(Action::Send {
                    to: p.info.decode_endpoint.clone(),
                    message: Box::new(self.status(&p.info, RoomState::Failed, Some(&reason))),
                });
            }
        }
    }

    fn status(
        &self,
        info: &TransferInfo,
        state: RoomState,
        reason: Option<&FailureReason>,
    ) -> ControlMessage {
        status_message(self.room, info, self.cfg.rank, state, reason)
    }

    fn ack(&self, to: Endpoint, generation: Generation) -> Action {
        Action::Send {
            to,
            message: Box::new(ControlMessage::AbortAck(AbortAck {
                room: self.room,
                generation,
                prefill_rank: self.cfg.rank,
                prefill_endpoint: self.cfg.endpoint.clone(),
            })),
        }
    }
}

/// Metadata and failures that arrive before their room is created (docs/lifecycle.md,
/// "Deadlines"): metadata is held, a failure is remembered (a *tombstone*), each for the
/// bootstrap timeout; [`PrefillRoom`] takes both when the room is created.
#[derive(Debug)]
pub struct EarlyRooms<P> {
    cfg: RoomConfig,
    max_rooms: usize,
    held: HashMap<RoomId, (Instant, Vec<MetaPeer<P>>)>,
    tombstones: HashMap<RoomId, (Instant, FailureReason)>,
}

impl<P> EarlyRooms<P> {
    /// Nothing held yet; at most `max_rooms` rooms' metadata and as many tombstones.
    pub fn new(cfg: RoomConfig, max_rooms: usize) -> Self {
        Self {
            cfg,
            max_rooms,
            held: HashMap::new(),
            tombstones: HashMap::new(),
        }
    }

    /// Metadata for a room not created yet (`invalid`: why it cannot be served), with
    /// `rooms` rooms held by the agent. Refused: the failure to tell its decode rank (and the
    /// metadata back).
    pub fn metadata(
        &mut self,
        room: RoomId,
        mp: MetaPeer<P>,
        invalid: Option<FailureReason>,
        rooms: usize,
        now: Instant,
    ) -> Result<(), Box<(FailureReason, MetaPeer<P>)>> {
        if let Some(reason) = invalid {
            // Fail fast: the decode is told now, the room fails when it is created.
            self.tombstone(room, reason.clone(), now);
            return Err(Box::new((reason, mp)));
        }
        if let Some((_, reason)) = self.tombstones.get(&room) {
            return Err(Box::new((reason.clone(), mp)));
        }
        if self.held.len() + rooms >= self.max_rooms && !self.held.contains_key(&room) {
            let (endpoint, max) = (&self.cfg.endpoint, self.max_rooms);
            let reason = FailureReason::with_peer(
                FailureCause::ControlChannel,
                endpoint,
                format!("prefill {endpoint} holds {max} rooms (max_rooms); room {room} is refused"),
            );
            return Err(Box::new((reason, mp)));
        }
        let until = now + self.cfg.bootstrap_timeout;
        self.held
            .entry(room)
            .or_insert_with(|| (until, Vec::new()))
            .1
            .push(mp);
        Ok(())
    }

    /// A decode rank aborts a room not created yet: metadata held for it is dropped and the
    /// room remembered as cancelled, held or not, so metadata that comes later (handled after
    /// a reconnect, or overtaken on the wire) is refused and the room fails if it is created.
    /// Returns whether metadata was held.
    pub fn abort(&mut self, room: RoomId, from: &Endpoint, now: Instant) -> bool {
        let held = self.held.remove(&room).is_some();
        let reason = FailureReason::with_peer(
            FailureCause::DuplicateRoom,
            from,
            "Duplicate or cancelled bootstrap room",
        );
        self.tombstone(room, reason, now);
        held
    }

    fn tombstone(&mut self, room: RoomId, reason: FailureReason, now: Instant) {
        // Bounded like the rooms: past the bound a failure is told but not remembered.
        if self.tombstones.len() < self.max_rooms {
            let until = now + self.cfg.bootstrap_timeout;
            self.tombstones.insert(room, (until, reason));
        }
    }

    /// What the room being created inherits: the metadata held and the failure remembered.
    pub fn take(&mut self, room: RoomId) -> (Vec<MetaPeer<P>>, Option<FailureReason>) {
        let held = self.held.remove(&room).map(|(_, m)| m).unwrap_or_default();
        (held, self.tombstones.remove(&room).map(|(_, r)| r))
    }

    /// When the driver must call [`Self::expire`] for `room`.
    pub fn poll_timeout(&self, room: RoomId) -> Option<Instant> {
        let held = self.held.get(&room).map(|(t, _)| *t);
        let tomb = self.tombstones.get(&room).map(|(t, _)| *t);
        held.into_iter().chain(tomb).min()
    }

    /// Drops what is due for `room` at `now`; held metadata is answered with a bootstrap
    /// timeout (to each non-dummy decode rank).
    pub fn expire(&mut self, room: RoomId, now: Instant) -> Vec<Action> {
        if self.tombstones.get(&room).is_some_and(|(t, _)| *t <= now) {
            self.tombstones.remove(&room);
        }
        let mut out = Vec::new();
        if self.held.get(&room).is_none_or(|(t, _)| *t > now) {
            return out;
        }
        let Some((_, infos)) = self.held.remove(&room) else {
            return out;
        };
        let (endpoint, secs) = (&self.cfg.endpoint, self.cfg.bootstrap_timeout.as_secs_f64());
        let reason = FailureReason::with_peer(
            FailureCause::BootstrapTimeout,
            endpoint,
            format!(
                "prefill {endpoint} never created room {room} within the bootstrap timeout of \
                 {secs:.1}s"
            ),
        );
        for mp in infos.iter().filter(|m| !m.info.is_dummy) {
            let (to, message) = failed_status(room, &mp.info, self.cfg.rank, &reason);
            out.push(Action::Send { to, message });
        }
        out
    }
}

/// The Failed status of `room` for the decode rank of `info`, and where it goes.
pub(crate) fn failed_status(
    room: RoomId,
    info: &TransferInfo,
    rank: u32,
    reason: &FailureReason,
) -> (Endpoint, Box<ControlMessage>) {
    let message = status_message(room, info, rank, RoomState::Failed, Some(reason));
    (info.decode_endpoint.clone(), Box::new(message))
}

/// The status of `room` for the decode rank of `info` (Success, or Failed with `reason`).
pub fn status_message(
    room: RoomId,
    info: &TransferInfo,
    rank: u32,
    state: RoomState,
    reason: Option<&FailureReason>,
) -> ControlMessage {
    ControlMessage::Status(StatusUpdate {
        room,
        generation: info.generation,
        state,
        prefill_rank: rank,
        reason: reason.map(|r| r.message.clone()),
        cause: reason.map(|r| r.cause),
    })
}

/// Batch accounting of one room's sends to its decode ranks (indexed as the driver lists
/// them): which batches are in flight, when a rank's aux rows are due (after every KV batch of
/// the last chunk landed there), and when everything is delivered.
#[derive(Debug)]
pub struct SendProgress {
    peers: Vec<PeerProgress>,
    inflight: HashMap<BatchId, (usize, bool)>,
    last_posted: bool,
    delivered: bool,
}

#[derive(Debug, Default, Clone)]
struct PeerProgress {
    outstanding: usize,
    aux_posted: bool,
    done: bool,
    bytes: u64,
}

/// What happens to a room's batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchEvent {
    /// A batch was posted to decode rank `peer` (`aux`: its aux rows).
    Posted {
        /// The decode rank's index.
        peer: usize,
        /// The batch.
        id: BatchId,
        /// It carries the aux rows.
        aux: bool,
    },
    /// Every KV batch of the last chunk is posted.
    LastChunkPosted,
    /// Decode rank `peer` needs no aux batch (nothing to copy).
    NoAux {
        /// The decode rank's index.
        peer: usize,
    },
    /// A batch is done: every byte landed.
    Done {
        /// The batch.
        id: BatchId,
        /// Its bytes.
        bytes: u64,
    },
    /// A batch reached a final failed state (no byte of it lands any more).
    Failed {
        /// The batch.
        id: BatchId,
    },
}

/// What the driver does next for a room's batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchAction {
    /// Post decode rank `peer`'s aux rows.
    PostAux {
        /// The decode rank's index.
        peer: usize,
    },
    /// Every batch of every decode rank is done: the room is delivered.
    Delivered {
        /// Bytes delivered over every decode rank.
        bytes: u64,
    },
}

impl SendProgress {
    /// Nothing posted yet to `peers` decode ranks.
    pub fn new(peers: usize) -> Self {
        Self {
            peers: vec![PeerProgress::default(); peers],
            inflight: HashMap::new(),
            last_posted: false,
            delivered: false,
        }
    }

    /// Batches posted and not seen final: what a fence cancels.
    pub fn in_flight(&self) -> Vec<BatchId> {
        self.inflight.keys().copied().collect()
    }

    /// Bytes done so far, over every decode rank.
    pub fn bytes(&self) -> u64 {
        self.peers.iter().map(|p| p.bytes).sum()
    }

    /// Applies `event`; returns the aux posts now due and, once, the delivery.
    pub fn handle(&mut self, event: BatchEvent) -> Vec<BatchAction> {
        match event {
            BatchEvent::Posted { peer, id, aux } => {
                self.inflight.insert(id, (peer, aux));
                if !aux {
                    self.peers[peer].outstanding += 1;
                }
            }
            BatchEvent::LastChunkPosted => self.last_posted = true,
            BatchEvent::NoAux { peer } => self.peers[peer].done = true,
            BatchEvent::Done { id, bytes } => {
                if let Some((peer, aux)) = self.inflight.remove(&id) {
                    let p = &mut self.peers[peer];
                    p.bytes += bytes;
                    if aux {
                        p.done = true;
                    } else {
                        p.outstanding -= 1;
                    }
                }
            }
            BatchEvent::Failed { id } => {
                self.inflight.remove(&id);
            }
        }
        self.due()
    }

    fn due(&mut self) -> Vec<BatchAction> {
        let mut out = Vec::new();
        if !self.last_posted {
            return out;
        }
        for (i, p) in self.peers.iter_mut().enumerate() {
            if p.outstanding == 0 && !p.aux_posted && !p.done {
                p.aux_posted = true;
                out.push(BatchAction::PostAux { peer: i });
            }
        }
        if !self.delivered && self.peers.iter().all(|p| p.done) {
            self.delivered = true;
            out.push(BatchAction::Delivered {
                bytes: self.bytes(),
            });
        }
        out
    }
}

mod machine;
pub use machine::{AcceptedDecode, Known, PrefillMachine, RankAction, RankEvent};

#[cfg(test)]
mod tests;
