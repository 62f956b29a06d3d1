//! The prefill (sending) agent: the async driver of the prefill rank's machine
//! ([`kvbridge_machines::prefill::PrefillMachine`]). It feeds the machine the events it sees
//! (control messages, calls, batch outcomes, timer ticks of one timer task) and carries out
//! the actions it answers: sends control messages, connects and disconnects the transport,
//! runs each room's send task (plan, post, wait, fence), publishes room states.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvbridge_handshake::{PeerDescriptor, check_with, prefill_unique_rank};
use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    BatchId, KvTransport, MemoryRegion, PeerId, TransferBatch, TransferOp, TransportError,
};
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{Span, field};

use crate::agreement::{LocalOnly, RankAgreement};
use crate::channel::{ControlChannel, Endpoint, Envelope};
use crate::directory::PrefillRankInfo;
use crate::error::{CoordinatorError, Result, Side};
use crate::ids::{Incarnation, RoomId, SessionId};
use crate::memory::{EntryRegion, KvHandles, KvMemory, PackLease, PackPool, pack_buffer_bytes};
use crate::messages::{
    CONTROL_PROTOCOL_VERSION, ControlMessage, Registration, RegistrationOutcome, RegistrationReply,
    TransferInfo, WireProblem, WireRegion, render_problems,
};
use crate::metrics::{Metrics, MetricsSnapshot, add, inc};
use crate::outbox::{Outbox, send_failed_to};
use crate::shell::{Driver, Tasks};
use crate::start::{check_role, current_runtime};
use crate::state::{
    FailureCause, FailureReason, KvTransferError, RoomState, RoomStatus, wait_at_least,
    wait_terminal,
};
use kvbridge_machines::PrefillConfig;
use kvbridge_machines::plan::{Chunk, PeerPlan, is_strided_source, pack_ops};
use kvbridge_machines::prefill::{
    AcceptedDecode, Action, BatchAction, BatchEvent, ChunkShape, Event, Known, MetaPeer,
    PrefillMachine, PrefillRoom, RankAction, RankEvent, RoomConfig, SendProgress, status_message,
};

const SIDE: Side = Side::Prefill;

/// Registrations handled concurrently (each may connect the transport).
const REGISTRATION_CONCURRENCY: usize = 16;

/// Builder of a [`PrefillAgent`]; see [`PrefillAgent::builder`].
pub struct PrefillAgentBuilder {
    descriptor: PeerDescriptor,
    memory: KvMemory,
    transport: Arc<dyn KvTransport>,
    channel: Arc<dyn ControlChannel>,
    config: PrefillConfig,
    agreement: Arc<dyn RankAgreement>,
    kv_regions: Option<Vec<MemoryRegion>>,
}

impl std::fmt::Debug for PrefillAgentBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillAgentBuilder")
            .field("descriptor", &self.descriptor)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PrefillAgentBuilder {
    /// Sets the configuration (default [`PrefillConfig::default`]).
    #[must_use]
    pub fn config(mut self, config: PrefillConfig) -> Self {
        self.config = config;
        self
    }

    /// Gives the agent CPU handles of its KV regions, one per KV entry in entry order
    /// ([`AllocatedMemory::kv_regions`](crate::AllocatedMemory::kv_regions)): the pack gather
    /// reads the source rows through them. Required with
    /// [`PrefillConfig::pack_buffers`], unused otherwise.
    #[must_use]
    pub fn kv_regions(mut self, regions: Vec<MemoryRegion>) -> Self {
        self.kv_regions = Some(regions);
        self
    }

    /// Sets the cross-rank agreement hook (default [`LocalOnly`]).
    #[must_use]
    pub fn agreement(mut self, agreement: Arc<dyn RankAgreement>) -> Self {
        self.agreement = agreement;
        self
    }

    /// Validates the setup and starts the agent's control loop. Must be called inside a tokio
    /// runtime (with the time driver).
    ///
    /// # Errors
    /// [`CoordinatorError::InvalidSetup`] when the descriptor is not a prefill's, its memory
    /// does not match it, pack buffers are configured without fitting KV region handles or
    /// with sizes that do not fit, or no tokio runtime is running.
    pub fn start(self) -> Result<PrefillAgent> {
        let d = &self.descriptor;
        check_role(d, kvbridge_handshake::Role::Prefill, "PrefillAgent")?;
        self.memory.validate(d)?;
        let pack = match &self.config.pack_buffers {
            None => None,
            Some(cfg) => {
                let Some(regions) = &self.kv_regions else {
                    return Err(CoordinatorError::InvalidSetup {
                        message: "pack buffers are configured but the agent has no KV region \
                                  handles to gather from; call PrefillAgentBuilder::kv_regions \
                                  with AllocatedMemory::kv_regions"
                            .to_owned(),
                    });
                };
                let sources = KvHandles::new(&self.memory, regions)?;
                let len = pack_buffer_bytes(d, cfg)?;
                Some(Pack {
                    pool: Arc::new(PackPool::new(self.transport.clone(), cfg.count, len)),
                    sources: Arc::new(sources),
                    max_chunk_tokens: cfg.max_chunk_tokens,
                })
            }
        };
        let runtime = current_runtime("PrefillAgent")?;
        let metrics = Arc::new(Metrics::default());
        let unique_rank = prefill_unique_rank(
            d.attn_tp_rank,
            d.attn_cp_rank,
            d.pp_rank,
            d.attn_cp_size.max(1),
            d.pp_size.max(1),
        );
        let inner = Arc::new_cyclic(|weak: &Weak<PrefillInner>| {
            let outbox = Outbox::new(
                self.channel.clone(),
                self.config.control_send_timeout,
                self.config.control_queue,
                metrics.clone(),
                send_failed_to(weak.clone(), PrefillInner::on_send_failed),
            );
            let room_config = RoomConfig {
                rank: unique_rank,
                endpoint: self.channel.local_endpoint(),
                bootstrap_timeout: self.config.bootstrap_timeout,
                waiting_timeout: self.config.waiting_timeout,
            };
            PrefillInner {
                endpoint: self.channel.local_endpoint(),
                core: Mutex::new(Core {
                    machine: PrefillMachine::new(room_config, self.config.max_rooms),
                    rooms: HashMap::new(),
                    timer_at: None,
                    tasks: Tasks::default(),
                }),
                config: self.config,
                descriptor: self.descriptor,
                unique_rank,
                memory: self.memory,
                pack,
                transport: self.transport,
                outbox,
                metrics,
                agreement: self.agreement,
                wake: Arc::new(Notify::new()),
                registrations: Arc::new(Semaphore::new(REGISTRATION_CONCURRENCY)),
            }
        });
        let tasks = Tasks::start(&runtime, &inner, self.channel, inner.wake.clone());
        inner.with_core(|c| c.tasks = tasks);
        tracing::info!(
            endpoint = %inner.endpoint,
            rank = inner.unique_rank,
            transport = inner.transport.name(),
            "prefill agent started"
        );
        Ok(PrefillAgent { inner })
    }
}

/// The sending side of kvbridge: serves decode ranks that register with it, and sends each
/// room's chunks to the decode ranks that asked for it.
///
/// Lifecycle of a room: [`create_room`](Self::create_room) (Bootstrapping) → every decode rank
/// of the room sends its metadata (WaitingForInput; [`wait_ready`](Self::wait_ready) returns
/// the decode prefix to send from) → [`send_chunk`](Self::send_chunk) for each chunk
/// (Transferring) → Success once the KV and aux rows of the last chunk landed at every decode
/// rank, or Failed with the first reason → [`clear`](Self::clear).
///
/// Cloning gives another handle to the same agent.
#[derive(Clone)]
pub struct PrefillAgent {
    inner: Arc<PrefillInner>,
}

impl std::fmt::Debug for PrefillAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillAgent")
            .field("endpoint", &self.inner.endpoint)
            .field("rank", &self.inner.unique_rank)
            .finish_non_exhaustive()
    }
}

/// A decode rank this prefill accepted, as the room drivers use it.
pub(crate) struct AcceptedPeer {
    endpoint: Endpoint,
    session: SessionId,
    peer: PeerId,
    plan: PeerPlan,
    /// The decode's transport descriptor (to connect again after the connection was lost).
    descriptor: Vec<u8>,
}

/// The driver's handle of an accepted decode rank, as the machine carries it.
type Conn = Arc<AcceptedPeer>;
type RoomPeer = MetaPeer<Conn>;
type RoomEvent = Event<Conn>;

/// What the driver keeps beside the machine for one room.
struct RoomSide {
    /// The machine's state, published for `poll` / `wait`.
    status: RoomStatus,
    /// Chunks to the room's driver task, while it takes them.
    driver: Option<mpsc::Sender<Job>>,
    span: Span,
}

/// The machine and what the driver keeps beside it, under one lock.
struct Core {
    machine: PrefillMachine<Conn>,
    rooms: HashMap<RoomId, RoomSide>,
    /// What the timer task sleeps until.
    timer_at: Option<std::time::Instant>,
    /// The control loop and the timer task: they end with the agent.
    tasks: Tasks,
}

impl Core {
    /// A room the caller has not cleared: its machine and what the driver keeps beside it.
    fn visible(&self, room: RoomId) -> Result<(&PrefillRoom<Conn>, &RoomSide)> {
        self.machine
            .room(room)
            .filter(|m| !m.is_cleared())
            .zip(self.rooms.get(&room))
            .ok_or(CoordinatorError::UnknownRoom { room, side: SIDE })
    }
}

/// The pack path of an agent ([`PrefillConfig::pack_buffers`]).
struct Pack {
    pool: Arc<PackPool>,
    sources: Arc<KvHandles>,
    max_chunk_tokens: u64,
}

struct Job {
    chunk: Chunk,
    page_offset: u64,
    token_offset: u64,
}

pub(crate) struct PrefillInner {
    config: PrefillConfig,
    descriptor: PeerDescriptor,
    unique_rank: u32,
    memory: KvMemory,
    /// The pack-buffer pool and the handles its gather reads, when configured.
    pack: Option<Pack>,
    transport: Arc<dyn KvTransport>,
    endpoint: Endpoint,
    outbox: Outbox,
    metrics: Arc<Metrics>,
    agreement: Arc<dyn RankAgreement>,
    /// Only [`PrefillInner::with_core`] locks it.
    core: Mutex<Core>,
    /// Wakes the timer task when the machine's next deadline moved earlier.
    wake: Arc<Notify>,
    registrations: Arc<Semaphore>,
}

impl Driver for PrefillInner {
    const SIDE: Side = SIDE;

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    async fn hear(self: Arc<Self>, env: Envelope) {
        self.handle(env).await;
    }

    fn next_tick(&self) -> Option<std::time::Instant> {
        self.with_core(|c| {
            c.timer_at = c.machine.poll_timeout();
            c.timer_at
        })
    }

    fn tick(&self) {
        self.step(RankEvent::Timer);
    }
}

impl PrefillAgent {
    /// Starts building an agent from its descriptor, registered memory, transport and control
    /// channel.
    pub fn builder(
        descriptor: PeerDescriptor,
        memory: KvMemory,
        transport: Arc<dyn KvTransport>,
        channel: Arc<dyn ControlChannel>,
    ) -> PrefillAgentBuilder {
        PrefillAgentBuilder {
            descriptor,
            memory,
            transport,
            channel,
            config: PrefillConfig::default(),
            agreement: Arc::new(LocalOnly),
            kv_regions: None,
        }
    }

    /// This rank's control endpoint.
    pub fn endpoint(&self) -> Endpoint {
        self.inner.endpoint.clone()
    }

    /// This rank's descriptor.
    pub fn descriptor(&self) -> &PeerDescriptor {
        &self.inner.descriptor
    }

    /// This rank's id in status messages (docs/lifecycle.md, "Ranks").
    pub fn unique_rank(&self) -> u32 {
        self.inner.unique_rank
    }

    /// What this rank publishes to a bootstrap registry (or a [`StaticDirectory`](crate::StaticDirectory)).
    pub fn rank_info(&self) -> PrefillRankInfo {
        PrefillRankInfo {
            endpoint: self.endpoint(),
            descriptor: self.inner.descriptor.clone(),
        }
    }

    /// Creates a room (Bootstrapping) and starts its bootstrap deadline. Metadata decode ranks
    /// sent before this call is applied now.
    ///
    /// # Errors
    /// [`CoordinatorError::DuplicateRoom`] if the room exists (or is still draining after
    /// `clear`); [`CoordinatorError::Shutdown`]; [`CoordinatorError::InvalidRequest`] when
    /// the agent holds `max_rooms` rooms.
    pub fn create_room(&self, room: impl Into<RoomId>) -> Result<()> {
        self.inner.create_room(room.into())
    }

    /// The room's state on this rank.
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub fn poll(&self, room: impl Into<RoomId>) -> Result<RoomState> {
        let room = room.into();
        self.inner
            .with_core(|c| c.visible(room).map(|(_, s)| s.status.state()))
    }

    /// The room's state agreed with the other ranks through the [`RankAgreement`] hook.
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub async fn poll_agreed(&self, room: impl Into<RoomId>) -> Result<RoomState> {
        let room = room.into();
        let local = self.poll(room)?;
        Ok(self.inner.agreement.agree(room.into(), local).await)
    }

    /// The failure of a Failed room (`None` otherwise), with its first recorded reason.
    pub fn failure(&self, room: impl Into<RoomId>) -> Option<KvTransferError> {
        let room = room.into();
        self.inner
            .with_core(|c| c.visible(room).ok().and_then(|(_, s)| s.status.error(room)))
    }

    /// The decode prefix (tokens the decode already holds) once every decode rank sent its
    /// metadata; the prefill sends tokens from here.
    pub fn decode_prefix_len(&self, room: impl Into<RoomId>) -> Option<u64> {
        let room = room.into();
        self.inner
            .with_core(|c| c.visible(room).ok().and_then(|(m, _)| m.prefix()))
    }

    /// Waits until every decode rank of the room sent its metadata (WaitingForInput) and
    /// returns the decode prefix length to send from.
    ///
    /// # Errors
    /// The room's [`KvTransferError`] if it fails first; [`CoordinatorError::UnknownRoom`].
    pub async fn wait_ready(&self, room: impl Into<RoomId>) -> Result<u64> {
        let room = room.into();
        let rx = self
            .inner
            .with_core(|c| c.visible(room).map(|(_, s)| s.status.subscribe()))?;
        let state = wait_at_least(rx, RoomState::WaitingForInput).await;
        self.inner.with_core(|c| {
            let (m, s) = c.visible(room)?;
            match state {
                Some(RoomState::Failed) | None => Err(s.status.failure_or_unknown(room, SIDE)),
                Some(_) => Ok(m.prefix().unwrap_or(0)),
            }
        })
    }

    /// Sends one chunk of the room to every decode rank that asked for it: plans it with the
    /// pair's path, posts one batch per destination, and returns once the batches are posted
    /// (it waits only when `max_inflight_batches` are in flight). The last chunk's aux rows
    /// follow its KV.
    ///
    /// # Errors
    /// [`CoordinatorError::RoomNotReady`] before WaitingForInput; the room's
    /// [`KvTransferError`] when it failed (the chunk is dropped);
    /// [`CoordinatorError::InvalidRequest`] for chunks that break the chunking rules;
    /// [`CoordinatorError::UnknownRoom`].
    pub async fn send_chunk(&self, room: impl Into<RoomId>, chunk: Chunk) -> Result<()> {
        self.inner.clone().send_chunk(room.into(), chunk).await
    }

    /// Waits until the room is terminal: `Ok` on Success, its [`KvTransferError`] on Failed.
    ///
    /// # Errors
    /// [`CoordinatorError::Transfer`]; [`CoordinatorError::UnknownRoom`] (also when the room
    /// is cleared while waiting).
    pub async fn wait(&self, room: impl Into<RoomId>) -> Result<()> {
        let room = room.into();
        let rx = self
            .inner
            .with_core(|c| c.visible(room).map(|(_, s)| s.status.subscribe()))?;
        let state = wait_terminal(rx).await;
        self.inner.with_core(|c| {
            let (_, s) = c.visible(room)?;
            match state {
                Some(RoomState::Success) => Ok(()),
                _ => Err(s.status.failure_or_unknown(room, SIDE)),
            }
        })
    }

    /// Aborts the room (`Aborted by AbortReq.`): no further chunk is posted, batches in flight
    /// are cancelled, and the decode ranks are told.
    pub fn abort(&self, room: impl Into<RoomId>) {
        let reason = FailureReason::new(FailureCause::Aborted, "Aborted by AbortReq.");
        self.inner.room_step(room.into(), None, Event::Fail(reason));
    }

    /// Forgets a room. A room that is not terminal is aborted first; a room whose batches are
    /// still being fenced stays hidden until they are, so its id cannot be reused too early.
    pub fn clear(&self, room: impl Into<RoomId>) {
        self.inner.clear(room.into());
    }

    /// A snapshot of this agent's metrics.
    pub fn metrics(&self) -> MetricsSnapshot {
        let states: Vec<RoomState> = self
            .inner
            .with_core(|c| c.machine.visible_rooms().map(PrefillRoom::state).collect());
        let by_state = Metrics::count_states(states.into_iter());
        self.inner.metrics.snapshot(by_state)
    }

    /// Rooms currently held (not cleared).
    pub fn room_count(&self) -> usize {
        self.inner.with_core(|c| c.machine.visible_rooms().count())
    }

    /// Stops the agent: every room that is not terminal fails (`the prefill agent shut down`),
    /// the control loop stops. Batches in flight are fenced by their rooms' drivers.
    pub fn shutdown(&self) {
        self.inner.step(RankEvent::Shutdown);
        // Every room is terminal now (no deadline left); the rooms' send tasks still fence
        // and end on their own.
        let mut tasks = self.inner.with_core(|c| std::mem::take(&mut c.tasks));
        tasks.stop();
    }
}

/// What a machine step leaves to the caller once the state is unlocked.
#[derive(Default)]
struct Stepped {
    /// What became of a chunk handed over.
    chunk: Option<ChunkStep>,
    /// Transport connections to close (a decode rank registered again).
    disconnect: Vec<PeerId>,
}

/// What [`PrefillInner::send_chunk`] does once the state is unlocked.
enum ChunkStep {
    Refused(CoordinatorError),
    Queue {
        tx: mpsc::Sender<Job>,
        page_offset: u64,
        token_offset: u64,
        start: Option<DriverStart>,
    },
}

/// What a new room driver needs, taken under the lock and spawned after it.
struct DriverStart {
    incarnation: Incarnation,
    senders: Vec<RoomPeer>,
    prefix: u64,
    rx: mpsc::Receiver<Job>,
    status_rx: watch::Receiver<RoomState>,
    span: Span,
}

fn problem(code: &str, message: String, remedy: &str) -> WireProblem {
    WireProblem {
        code: code.to_owned(),
        message,
        remedy: remedy.to_owned(),
    }
}

/// The room clock: tokio's (virtual under paused time) as the machines' `std` instant.
fn now() -> std::time::Instant {
    Instant::now().into_std()
}

impl PrefillInner {
    /// Runs `f` on the machine and its rooms' side records under the lock; the only place
    /// that takes it. `f` gets the core, not the agent, and its result cannot borrow the
    /// guard, so the lock is released before the caller does anything else (a std mutex is
    /// not re-entrant: calling back into the agent under it would park the thread forever).
    fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        f(&mut lock(&self.core))
    }

    /// Feeds one event to the machine now and carries out its actions.
    fn step(&self, event: RankEvent<Conn>) -> Stepped {
        self.with_core(|c| self.step_locked(c, event))
    }

    /// Feeds `event` to one room (its life `incarnation` only, when given).
    fn room_step(
        &self,
        room: RoomId,
        incarnation: Option<Incarnation>,
        event: RoomEvent,
    ) -> Stepped {
        self.step(RankEvent::Room {
            room,
            incarnation,
            event,
        })
    }

    /// [`step`](Self::step) under a lock already held. The actions run under it too, so two
    /// threads' reports and sends keep the machine's order; none of them waits or takes the
    /// lock (the outbox only queues); what must wait is left to the caller in [`Stepped`].
    fn step_locked(&self, c: &mut Core, event: RankEvent<Conn>) -> Stepped {
        let mut out = Stepped::default();
        for action in c.machine.handle(event, now()) {
            match action {
                RankAction::Send { to, message } => self.outbox.send(&to, *message),
                RankAction::Room { room, action } => self.room_action(c, room, action, &mut out),
                RankAction::Disconnect { peer } => out.disconnect.push(peer),
                RankAction::EarlyExpired { room } => {
                    tracing::warn!(%room, "dropping metadata of a room that was never created");
                }
            }
        }
        let next = c.machine.poll_timeout();
        if next.is_some_and(|n| c.timer_at.is_none_or(|t| n < t)) {
            c.timer_at = next;
            self.wake.notify_one();
        }
        out
    }

    /// Carries out one room's action.
    fn room_action(&self, c: &mut Core, room: RoomId, action: Action, out: &mut Stepped) {
        let Core { machine, rooms, .. } = c;
        let Some(side) = rooms.get_mut(&room) else {
            return;
        };
        match action {
            Action::Send { to, message } => self.outbox.send(&to, *message),
            Action::Report { state, reason } => {
                self.report(machine.room(room), side, state, reason)
            }
            Action::Succeeded { bytes, elapsed } => {
                self.metrics.succeeded(elapsed);
                let ms = elapsed.as_millis() as u64;
                side.span.record("bytes", bytes);
                side.span.record("duration_ms", ms);
                tracing::info!(parent: &side.span, bytes, duration_ms = ms, "room transferred");
            }
            Action::PostChunk {
                page_offset,
                token_offset,
                start_driver,
            } => {
                out.chunk = Some(match machine.room(room) {
                    Some(m) => self.queue_chunk(m, side, page_offset, token_offset, start_driver),
                    None => ChunkStep::Refused(CoordinatorError::UnknownRoom { room, side: SIDE }),
                });
            }
            Action::RefuseChunk(e) => out.chunk = Some(ChunkStep::Refused(e.into())),
            Action::CancelBatches => side.driver = None,
            Action::AckWithheld { to } => {
                tracing::error!(parent: &side.span, decode = %to, "room is poisoned (a batch could not be fenced): no ABORT_ACK");
            }
            Action::Remove => {
                rooms.remove(&room);
            }
        }
    }

    /// Publishes a state change of a room's machine.
    fn report(
        &self,
        machine: Option<&PrefillRoom<Conn>>,
        side: &mut RoomSide,
        state: RoomState,
        reason: Option<FailureReason>,
    ) {
        match reason {
            Some(reason) if state == RoomState::Failed => {
                self.metrics.failed(reason.cause);
                tracing::warn!(parent: &side.span, cause = %reason.cause, peer = reason.peer.as_deref(), reason = %reason.message, "room failed");
                side.status.fail(reason);
            }
            _ => {
                if let Some(m) = machine.filter(|_| state == RoomState::WaitingForInput) {
                    tracing::debug!(parent: &side.span, decode_ranks = m.peers().len(), prefix = m.prefix(), "room ready");
                }
                side.status.update(state);
            }
        }
    }

    /// A chunk the machine accepted: queued to the room's driver (started first if needed).
    fn queue_chunk(
        &self,
        machine: &PrefillRoom<Conn>,
        side: &mut RoomSide,
        page_offset: u64,
        token_offset: u64,
        start_driver: bool,
    ) -> ChunkStep {
        let mut start = None;
        if start_driver {
            let (tx, rx) = mpsc::channel(self.config.max_inflight_batches.max(1));
            side.driver = Some(tx);
            start = Some(DriverStart {
                incarnation: machine.incarnation(),
                senders: machine
                    .peers()
                    .iter()
                    .filter(|p| p.peer.is_some())
                    .cloned()
                    .collect(),
                prefix: machine.prefix().unwrap_or(0),
                rx,
                status_rx: side.status.subscribe(),
                span: side.span.clone(),
            });
        }
        match side.driver.clone() {
            Some(tx) => ChunkStep::Queue {
                tx,
                page_offset,
                token_offset,
                start,
            },
            None => ChunkStep::Refused(CoordinatorError::InvalidRequest {
                what: "chunk",
                message: format!("room {} is no longer accepting chunks", machine.room()),
            }),
        }
    }

    /// Tells the machine `peer`'s connection is lost when a batch to it failed with `e`
    /// saying so.
    fn note_lost(&self, peer: PeerId, e: &TransportError) {
        if matches!(e, TransportError::PeerLost { .. }) {
            self.step(RankEvent::PeerLost { peer });
        }
    }
}

impl PrefillInner {
    async fn handle(self: &Arc<Self>, env: Envelope) {
        match env.message {
            ControlMessage::Register(reg) => {
                let permit = self.registrations.clone().acquire_owned().await;
                let me = self.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    me.on_register(reg).await;
                });
            }
            ControlMessage::TransferInfo(info) => self.on_transfer_info(info),
            ControlMessage::Abort(a) => {
                self.step(RankEvent::DecodeAbort(a));
            }
            ControlMessage::Ping(h) => self.outbox.send(&env.from, ControlMessage::Pong(h)),
            other => tracing::debug!(
                from = %env.from,
                kind = other.kind(),
                "prefill ignores a message meant for a decode"
            ),
        }
    }

    fn on_send_failed(
        &self,
        to: &Endpoint,
        kind: &'static str,
        room: Option<u64>,
        err: CoordinatorError,
    ) {
        tracing::warn!(peer = %to, kind, ?room, error = %err, "prefill could not deliver a control message");
    }

    fn reply_rejected(&self, reg: &Registration, problems: Vec<WireProblem>) {
        tracing::warn!(
            decode = %reg.decode_endpoint,
            problems = %render_problems(&problems),
            "refusing an incompatible decode rank; still serving the others"
        );
        self.step(RankEvent::Rejected {
            endpoint: reg.decode_endpoint.clone(),
            session: reg.session,
            problems: problems.clone(),
        });
        self.reply(reg, RegistrationOutcome::Rejected { problems });
    }

    fn reply_accepted(&self, reg: &Registration) {
        let descriptor = self.descriptor.clone();
        self.reply(reg, RegistrationOutcome::Accepted { descriptor });
    }

    fn reply(&self, reg: &Registration, result: RegistrationOutcome) {
        self.outbox.send(
            &reg.decode_endpoint,
            ControlMessage::RegisterReply(RegistrationReply {
                protocol: CONTROL_PROTOCOL_VERSION,
                prefill_endpoint: self.endpoint.clone(),
                prefill_rank: self.unique_rank,
                session: reg.session,
                result,
            }),
        );
    }

    async fn on_register(self: &Arc<Self>, reg: Registration) {
        if CONTROL_PROTOCOL_VERSION.negotiate(reg.protocol).is_none() {
            let p = problem(
                "KVB-PROTOCOL",
                format!(
                    "control protocol version mismatch: decode speaks {}, this prefill speaks {}",
                    reg.protocol, CONTROL_PROTOCOL_VERSION
                ),
                "run kvbridge releases of the same major version on both sides",
            );
            return self.reply_rejected(&reg, vec![p]);
        }
        // Same session again (the decode retried, or registers again after a refusal):
        // answer as before.
        let known = self.with_core(|c| c.machine.known(&reg.decode_endpoint, reg.session));
        match known {
            Known::Accepted => return self.reply_accepted(&reg),
            Known::Rejected(problems) => return self.reply_rejected(&reg, problems),
            Known::New => {}
        }
        let (plan, path) = match self.plan_for(&reg) {
            Ok(p) => p,
            Err(problems) => return self.reply_rejected(&reg, problems),
        };
        let peer = match self.connect(&reg).await {
            Ok(p) => p,
            Err(p) => return self.reply_rejected(&reg, vec![p]),
        };
        let conn = Arc::new(AcceptedPeer {
            endpoint: reg.decode_endpoint.clone(),
            session: reg.session,
            peer,
            plan,
            descriptor: reg.transport.descriptor.clone(),
        });
        // A concurrent twin of the same registration that won keeps its connection (ours is
        // closed); an earlier session of the rank (it restarted) fails its rooms and is
        // disconnected.
        let stepped = self.step(RankEvent::Registered {
            endpoint: reg.decode_endpoint.clone(),
            decode: AcceptedDecode {
                session: reg.session,
                peer,
                conn,
            },
        });
        for peer in stepped.disconnect {
            let _ = self.transport.disconnect(peer).await;
        }
        tracing::info!(decode = %reg.decode_endpoint, path, "decode rank registered");
        self.reply_accepted(&reg);
    }

    /// Checks a registering decode rank against this one and plans the pair (with the path's
    /// name, for the log), or says every problem found.
    fn plan_for(
        &self,
        reg: &Registration,
    ) -> std::result::Result<(PeerPlan, String), Vec<WireProblem>> {
        let report = check_with(&self.descriptor, &reg.descriptor, &self.config.check);
        for w in &report.warnings {
            // E.g. KVB-W003: a decode of a newer minor version whose new fields this release
            // does not know; the pair still works.
            tracing::warn!(decode = %reg.decode_endpoint, code = %w.code, "{}", w.message);
        }
        let mut problems: Vec<WireProblem> =
            report.problems.iter().map(WireProblem::from).collect();
        if reg.transport.name != self.transport.name() {
            problems.push(problem(
                "KVB-TRANSPORT",
                format!(
                    "transport mismatch: the decode uses \"{}\", this prefill uses \"{}\"",
                    reg.transport.name,
                    self.transport.name()
                ),
                "start both sides with the same --transport",
            ));
        }
        let Some(m) = report.mapping.as_ref().filter(|_| problems.is_empty()) else {
            return Err(problems);
        };
        let wire = |entries: &[EntryRegion]| -> Vec<WireRegion> {
            entries.iter().map(|e| e.to_wire()).collect()
        };
        PeerPlan::new(
            m.path,
            &self.descriptor,
            &wire(&self.memory.kv),
            &wire(&self.memory.aux),
            &reg.descriptor,
            &reg.kv_regions,
            &reg.aux_regions,
        )
        .map(|p| (p, format!("{:?}", m.path)))
        .map_err(|e| {
            vec![problem(
                "KVB-PLAN",
                e.0,
                "register the decode's KV memory with the geometry its descriptor states",
            )]
        })
    }

    /// Connects the transport to a registering decode rank, bounded by the control send
    /// timeout.
    async fn connect(&self, reg: &Registration) -> std::result::Result<PeerId, WireProblem> {
        let name = self.transport.name();
        let timeout = self.config.control_send_timeout;
        let message = match tokio::time::timeout(
            timeout,
            self.transport.connect(&reg.transport.descriptor),
        )
        .await
        {
            Ok(Ok(p)) => return Ok(p),
            Ok(Err(e)) => format!("connecting the {name} transport to the decode failed: {e}"),
            Err(_) => format!(
                "connecting the {name} transport to the decode did not finish within {timeout:?}"
            ),
        };
        Err(problem(
            "KVB-CONNECT",
            message,
            "check the decode's transport is reachable from the prefill",
        ))
    }

    fn reply_failed(&self, info: &TransferInfo, reason: &FailureReason) {
        self.outbox.send(
            &info.decode_endpoint,
            status_message(
                info.room,
                info,
                self.unique_rank,
                RoomState::Failed,
                Some(reason),
            ),
        );
    }

    /// Why what a decode rank asks for cannot be sent (`None`: it can).
    fn check_info(&self, info: &TransferInfo, peer: &AcceptedPeer) -> Option<FailureReason> {
        if info.is_dummy {
            return None;
        }
        if let Err(e) = peer.plan.check_prefix(info.decode_prefix_len) {
            return Some(FailureReason::with_peer(
                FailureCause::Planning,
                &info.decode_endpoint,
                e.0,
            ));
        }
        (!self.memory.aux.is_empty() && info.dst_aux_index.is_none()).then(|| {
            FailureReason::with_peer(
                FailureCause::Planning,
                &info.decode_endpoint,
                format!(
                    "room {}: decode {} sent no aux index, but both sides register aux buffers",
                    info.room, info.decode_endpoint
                ),
            )
        })
    }

    /// A decode rank's metadata for a room: checked against the rank's registration and the
    /// plan, then handed to the machine; a lost connection is connected again first.
    fn on_transfer_info(self: &Arc<Self>, info: TransferInfo) {
        let lost = self.with_core(|c| {
            let conn = match c.machine.sender(&info) {
                Ok(a) => a.conn.clone(),
                Err(reason) => {
                    self.reply_failed(&info, &reason);
                    return None;
                }
            };
            if !info.is_dummy && c.machine.is_lost(conn.peer) {
                return Some((info, conn));
            }
            let invalid = self.check_info(&info, &conn);
            let conn = (!info.is_dummy).then_some(conn);
            self.step_locked(
                c,
                RankEvent::Metadata {
                    info,
                    conn,
                    invalid,
                },
            );
            None
        });
        if let Some((info, old)) = lost {
            let inner = self.clone();
            tokio::spawn(async move { inner.reconnect_then(info, old).await });
        }
    }

    /// Connects the transport to `old`'s decode rank again (its connection was lost), puts the
    /// new connection in its place, then handles `info`; a decode rank that cannot be reached
    /// fails the room, naming it.
    async fn reconnect_then(self: Arc<Self>, info: TransferInfo, old: Conn) {
        match self.reconnect(&old).await {
            Ok(_) => self.on_transfer_info(info),
            Err(why) => {
                let endpoint = &old.endpoint;
                let reason = FailureReason::with_peer(
                    FailureCause::TransferError,
                    endpoint,
                    format!("room {}: {why}", info.room),
                );
                self.reply_failed(&info, &reason);
            }
        }
    }

    /// Connects the transport to `old`'s decode rank again (its connection was lost) and puts
    /// the new connection in its place (unless a concurrent reconnect or a new registration
    /// replaced it first: then that one). The connection to use now, or why there is none.
    async fn reconnect(&self, old: &Conn) -> std::result::Result<Conn, String> {
        let name = self.transport.name();
        let endpoint = &old.endpoint;
        // Another room may have connected again already.
        let replaced = self.with_core(|c| {
            c.machine
                .replacement(endpoint, old.peer, old.session)
                .map(|a| a.conn.clone())
        });
        if let Some(current) = replaced {
            return Ok(current);
        }
        let timeout = self.config.control_send_timeout;
        let connected =
            tokio::time::timeout(timeout, self.transport.connect(&old.descriptor)).await;
        let peer = match connected {
            Ok(Ok(p)) => p,
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("it did not finish within {timeout:?}"),
                };
                return Err(format!(
                    "the {name} connection to decode {endpoint} was lost, and connecting again \
                     failed: {why}"
                ));
            }
        };
        let fresh = Arc::new(AcceptedPeer {
            endpoint: endpoint.clone(),
            session: old.session,
            peer,
            plan: old.plan.clone(),
            descriptor: old.descriptor.clone(),
        });
        let decode = AcceptedDecode {
            session: old.session,
            peer,
            conn: fresh.clone(),
        };
        let replaced = self.with_core(|c| c.machine.replace_lost(endpoint, old.peer, decode));
        match replaced {
            Ok(()) => {
                tracing::info!(decode = %endpoint, "connected the transport to the decode again after it was lost");
                let _ = self.transport.disconnect(old.peer).await;
                Ok(fresh)
            }
            Err(other) => {
                let _ = self.transport.disconnect(peer).await;
                other.map(|a| a.conn).ok_or_else(|| {
                    format!(
                        "decode {endpoint} registered again while its lost connection was replaced"
                    )
                })
            }
        }
    }

    fn create_room(&self, room: RoomId) -> Result<()> {
        let span = tracing::info_span!(
            parent: None,
            "kv_room",
            side = SIDE.as_str(),
            room = room.get(),
            peer = field::Empty,
            bytes = field::Empty,
            duration_ms = field::Empty
        );
        self.with_core(|c| {
            c.machine.admit(room)?;
            inc(&self.metrics.rooms_created);
            tracing::debug!(parent: &span, "room created");
            let side = RoomSide {
                status: RoomStatus::new(RoomState::Bootstrapping),
                driver: None,
                span,
            };
            c.rooms.insert(room, side);
            self.step_locked(c, RankEvent::Create { room });
            Ok(())
        })
    }

    fn clear(&self, room: RoomId) {
        if self.with_core(|c| c.visible(room).is_err()) {
            return;
        }
        self.room_step(room, None, Event::Clear);
        self.agreement.forget(room.into());
    }

    /// Refuses chunks that break what the agent's memory and pack buffers allow.
    fn check_chunk(&self, chunk: &Chunk) -> Result<()> {
        let invalid = |message: String| {
            Err(CoordinatorError::InvalidRequest {
                what: "chunk",
                message,
            })
        };
        if let Some(pack) = &self.pack {
            if chunk.num_kv_tokens > pack.max_chunk_tokens {
                return invalid(format!(
                    "the chunk has {} tokens but the pack buffers hold chunks of at most {} \
                     (PackBuffers::max_chunk_tokens); send smaller chunks or size the pack \
                     buffers for them",
                    chunk.num_kv_tokens, pack.max_chunk_tokens
                ));
            }
        }
        if chunk.is_last && !self.memory.aux.is_empty() && chunk.aux_index.is_none() {
            return invalid(
                "the last chunk needs the prefill's aux row (aux_index) because aux buffers are \
                 registered"
                    .to_owned(),
            );
        }
        let Some(i) = chunk.aux_index else {
            return Ok(());
        };
        let aux = self.memory.aux.iter().zip(&self.descriptor.aux_item_lens);
        for (j, (e, &item)) in aux.enumerate() {
            if i.checked_add(1)
                .and_then(|n| n.checked_mul(item))
                .is_none_or(|end| end > e.len)
            {
                return invalid(format!(
                    "aux_index {i} is outside aux buffer {j} ({} rows of {item} bytes)",
                    e.len / item.max(1)
                ));
            }
        }
        Ok(())
    }

    async fn send_chunk(self: Arc<Self>, room: RoomId, chunk: Chunk) -> Result<()> {
        self.check_chunk(&chunk)?;
        self.with_core(|c| c.visible(room).map(|_| ()))?;
        // One page id stands for page_size · dcp_size tokens (the prefill's virtual page).
        let page_tokens = self
            .descriptor
            .page_size
            .saturating_mul(u64::from(self.descriptor.dcp_size.max(1)));
        let shape = ChunkShape {
            pages: chunk.pages.len() as u64,
            tokens: chunk.num_kv_tokens,
            is_last: chunk.is_last,
            page_tokens,
        };
        let event = RankEvent::Room {
            room,
            incarnation: None,
            event: Event::Chunk(shape),
        };
        let step = self.with_core(|c| {
            c.machine.room(room)?;
            Some(self.step_locked(c, event).chunk)
        });
        let Some(step) = step else {
            return Err(CoordinatorError::UnknownRoom { room, side: SIDE });
        };
        // Nothing to post: the room has only dummy peers.
        let Some(step) = step else {
            return Ok(());
        };
        let (tx, page_offset, token_offset) = match step {
            ChunkStep::Refused(e) => return Err(e),
            ChunkStep::Queue {
                tx,
                page_offset,
                token_offset,
                start,
            } => {
                if let Some(d) = start {
                    let span = d.span.clone();
                    tokio::spawn(tracing::Instrument::instrument(
                        RoomDriver::new(self.clone(), room, &d).run(d.rx, d.status_rx),
                        span,
                    ));
                }
                (tx, page_offset, token_offset)
            }
        };
        let job = Job {
            chunk,
            page_offset,
            token_offset,
        };
        if tx.send(job).await.is_err() {
            return self.with_core(|c| {
                let (_, s) = c.visible(room)?;
                Err(s.status.error(room).map(CoordinatorError::from).unwrap_or(
                    CoordinatorError::InvalidRequest {
                        what: "chunk",
                        message: format!("room {room} stopped accepting chunks"),
                    },
                ))
            });
        }
        Ok(())
    }
}

enum Waited {
    Final(std::result::Result<(), TransportError>),
    Hung,
}

/// What a batch's waiter task reports.
struct WaitResult {
    pi: usize,
    aux: bool,
    id: BatchId,
    bytes: u64,
    waited: Waited,
    /// The batch's pack buffer, still held when the batch was not seen final.
    lease: Option<PackLease>,
}

/// Whether a batch has an op whose source rows are strided (what the pack path gathers).
fn has_strided_source(ops: &[TransferOp]) -> bool {
    ops.iter().any(is_strided_source)
}

/// Takes a pack buffer (waiting while all are out, bounded by `wait_limit` and by the room
/// failing), gathers the batch's strided source rows into it off the runtime's workers, and
/// returns the ops to post from it.
async fn pack_batch(
    inner: &Arc<PrefillInner>,
    pack: &Pack,
    ops: Vec<TransferOp>,
    room: RoomId,
    endpoint: &Endpoint,
    wait_limit: Duration,
    mut status_rx: watch::Receiver<RoomState>,
) -> std::result::Result<Option<(Vec<TransferOp>, PackLease)>, FailureReason> {
    let fail = |cause, what: String| {
        FailureReason::with_peer(
            cause,
            endpoint,
            format!("Failed to send kv chunk of {room} to {endpoint}: {what}"),
        )
    };
    if !pack.pool.has_free() {
        inc(&inner.metrics.pack_waits);
    }
    let acquired = tokio::time::timeout(wait_limit, async {
        tokio::select! {
            lease = pack.pool.acquire() => Some(lease),
            _ = status_rx.wait_for(|s| *s == RoomState::Failed) => None,
        }
    })
    .await;
    let lease = match acquired {
        Ok(Some(Ok(lease))) => lease,
        Ok(Some(Err(e))) => {
            return Err(fail(FailureCause::TransferError, e.to_string()));
        }
        // The room failed meanwhile; the driver sees it next.
        Ok(None) => return Ok(None),
        Err(_) => {
            return Err(fail(
                FailureCause::BatchTimeout,
                format!(
                    "no pack buffer became free within {wait_limit:?} (every batch holding one \
                     should have ended by then); raise PackBuffers::count"
                ),
            ));
        }
    };
    let sources = pack.sources.clone();
    let capacity = pack.pool.buffer_len();
    let gathered = tokio::task::spawn_blocking(move || {
        let r = pack_ops(ops, lease.id(), capacity)
            .map_err(|e| e.0)
            .and_then(|p| {
                let Some(dst) = lease.region() else {
                    return Err("the pack buffer has no handle".to_owned());
                };
                sources.gather(&p.gathers, dst).map(|()| p)
            });
        (r, lease)
    })
    .await;
    match gathered {
        Ok((Ok(p), lease)) => {
            inc(&inner.metrics.pack_batches);
            add(&inner.metrics.pack_bytes, p.bytes);
            Ok(Some((p.ops, lease)))
        }
        Ok((Err(e), lease)) => {
            // Nothing was posted from it.
            lease.release();
            Err(fail(FailureCause::Planning, e))
        }
        Err(e) => Err(fail(
            FailureCause::Planning,
            format!("the pack gather task died: {e}"),
        )),
    }
}

/// The task that posts one room's chunks and follows its batches ([`SendProgress`] keeps the
/// accounting); on failure it fences every batch in flight before the room's machine hears
/// [`Event::DriverEnded`] (which tells the decode ranks and acknowledges their aborts).
struct RoomDriver {
    inner: Arc<PrefillInner>,
    room: RoomId,
    incarnation: Incarnation,
    /// The decode ranks sent to (no dummies), as [`SendProgress`] indexes them.
    peers: Vec<RoomPeer>,
    prefix: u64,
    progress: SendProgress,
    waits: JoinSet<WaitResult>,
    /// Pack buffers of batches whose waiter gave up (hung): released once the fence proves
    /// the batch final, retired otherwise.
    hung_leases: HashMap<BatchId, PackLease>,
    /// The prefill's aux row, once the last chunk is posted.
    src_aux: Option<u64>,
    /// How long a batch is waited for: its deadline plus the grace.
    wait_limit: Duration,
    /// Per peer: whether this room posted it a batch (only a connection found lost before
    /// that is connected again within the room).
    posted_to: Vec<bool>,
}

impl RoomDriver {
    fn new(inner: Arc<PrefillInner>, room: RoomId, d: &DriverStart) -> Self {
        let wait_limit = inner.config.batch_timeout + inner.config.fence_grace;
        Self {
            inner,
            room,
            incarnation: d.incarnation,
            progress: SendProgress::new(d.senders.len()),
            peers: d.senders.clone(),
            prefix: d.prefix,
            waits: JoinSet::new(),
            hung_leases: HashMap::new(),
            src_aux: None,
            wait_limit,
            posted_to: vec![false; d.senders.len()],
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Job>, mut status_rx: watch::Receiver<RoomState>) {
        let failure = self.send(&mut rx, &mut status_rx).await.err();
        drop(rx);
        let (room, incarnation) = (self.room, self.incarnation);
        if let Some(reason) = failure {
            self.inner
                .room_step(room, Some(incarnation), Event::Fail(reason));
        }
        let poisoned = self.fence().await;
        if poisoned {
            tracing::error!(%room, "a batch of the room could not be fenced; the room is poisoned");
        }
        self.inner.room_step(
            room,
            Some(incarnation),
            Event::DriverEnded {
                incarnation,
                poisoned,
            },
        );
    }

    /// Posts chunks and follows their batches until the room is delivered (`Ok`), fails
    /// elsewhere (`Ok`: the room's status says so) or fails here (the reason).
    async fn send(
        &mut self,
        rx: &mut mpsc::Receiver<Job>,
        status_rx: &mut watch::Receiver<RoomState>,
    ) -> std::result::Result<(), FailureReason> {
        let max_inflight = self.inner.config.max_inflight_batches.max(1);
        let mut input_open = true;
        loop {
            if *status_rx.borrow() == RoomState::Failed {
                return Ok(());
            }
            let due = tokio::select! {
                biased;
                changed = status_rx.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    continue;
                }
                Some(joined) = self.waits.join_next(), if !self.waits.is_empty() => {
                    self.on_waited(joined)?
                }
                job = rx.recv(), if input_open && self.waits.len() < max_inflight => match job {
                    Some(job) => self.on_job(job, status_rx).await?,
                    None => {
                        input_open = false;
                        continue;
                    }
                },
            };
            if self.follow(due).await? {
                return Ok(());
            }
        }
    }

    /// Executes what the batch accounting asks; `true` once the room is delivered.
    async fn follow(
        &mut self,
        mut due: Vec<BatchAction>,
    ) -> std::result::Result<bool, FailureReason> {
        while let Some(action) = due.pop() {
            match action {
                BatchAction::PostAux { peer } => {
                    let more = self.post_aux(peer).await?;
                    due.extend(more);
                }
                BatchAction::Delivered { bytes } => {
                    let incarnation = self.incarnation;
                    self.inner.room_step(
                        self.room,
                        Some(incarnation),
                        Event::Delivered { incarnation, bytes },
                    );
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    fn on_waited(
        &mut self,
        joined: std::result::Result<WaitResult, tokio::task::JoinError>,
    ) -> std::result::Result<Vec<BatchAction>, FailureReason> {
        let room = self.room;
        let metrics = &self.inner.metrics;
        let Ok(w) = joined else {
            return Err(FailureReason::new(
                FailureCause::TransferError,
                format!("Failed to send kv chunk of {room}: a batch waiter task died"),
            ));
        };
        let endpoint = &self.peers[w.pi].info.decode_endpoint;
        match w.waited {
            Waited::Final(Ok(())) => {
                inc(&metrics.batches_done);
                add(&metrics.bytes_transferred, w.bytes);
                Ok(self.progress.handle(BatchEvent::Done {
                    id: w.id,
                    bytes: w.bytes,
                }))
            }
            Waited::Final(Err(e)) => {
                inc(&metrics.batches_failed);
                if let Some(p) = &self.peers[w.pi].peer {
                    self.inner.note_lost(p.peer, &e);
                }
                self.progress.handle(BatchEvent::Failed { id: w.id });
                Err(batch_failure(room, endpoint, w.aux, e))
            }
            Waited::Hung => {
                if let Some(l) = w.lease {
                    self.hung_leases.insert(w.id, l);
                }
                inc(&metrics.batches_failed);
                let what = if w.aux { "aux data" } else { "kv chunk" };
                Err(FailureReason::with_peer(
                    FailureCause::BatchTimeout,
                    endpoint,
                    format!(
                        "Failed to send {what} of {room} to {endpoint}: the transport did not \
                         finish batch {} within {:?} (its deadline plus grace)",
                        w.id, self.wait_limit
                    ),
                ))
            }
        }
    }

    /// Plans a chunk for every decode rank and posts its batches (through a pack buffer when
    /// the source rows are strided and the agent has pack buffers).
    async fn on_job(
        &mut self,
        job: Job,
        status_rx: &watch::Receiver<RoomState>,
    ) -> std::result::Result<Vec<BatchAction>, FailureReason> {
        let room = self.room;
        let (job, planned) = self.plan(job).await?;
        let mut due = Vec::new();
        for (pi, ops) in planned.into_iter().enumerate() {
            // The room failed meanwhile (its fence is due): the rest of the chunk stays
            // unposted.
            if *status_rx.borrow() == RoomState::Failed {
                return Ok(due);
            }
            let endpoint = self.peers[pi].info.decode_endpoint.clone();
            let ops = ops.map_err(|e| {
                FailureReason::with_peer(
                    FailureCause::Planning,
                    &endpoint,
                    format!("Failed to send kv chunk of {room} to {endpoint}: {}", e.0),
                )
            })?;
            if ops.is_empty() {
                continue;
            }
            let (ops, lease) = match &self.inner.pack {
                Some(pack) if has_strided_source(&ops) => {
                    let packed = pack_batch(
                        &self.inner,
                        pack,
                        ops,
                        room,
                        &endpoint,
                        self.wait_limit,
                        status_rx.clone(),
                    )
                    .await?;
                    // None: the room failed while waiting for a buffer.
                    let Some((ops, lease)) = packed else {
                        return Ok(due);
                    };
                    (ops, Some(lease))
                }
                _ => (ops, None),
            };
            due.extend(self.post(pi, ops, false, lease).await?);
        }
        if job.chunk.is_last {
            self.src_aux = job.chunk.aux_index;
            due.extend(self.progress.handle(BatchEvent::LastChunkPosted));
        }
        Ok(due)
    }

    /// Plans a chunk for every decode rank. Planning is linear in the chunk's descriptors
    /// (hundreds of thousands when every token row of a head slice is one): it runs off the
    /// runtime's workers, so heartbeats, keep-alives and the other rooms' transfers go on.
    async fn plan(
        &self,
        job: Job,
    ) -> std::result::Result<
        (
            Job,
            Vec<std::result::Result<Vec<TransferOp>, kvbridge_machines::plan::PlanError>>,
        ),
        FailureReason,
    > {
        let targets = self.peers.clone();
        let prefix = self.prefix;
        tokio::task::spawn_blocking(move || {
            let ops = targets
                .iter()
                .map(|rp| match &rp.peer {
                    Some(ap) => ap.plan.chunk_ops(
                        &job.chunk,
                        job.page_offset,
                        job.token_offset,
                        &rp.info.dst_pages,
                        prefix,
                    ),
                    None => Ok(Vec::new()),
                })
                .collect();
            (job, ops)
        })
        .await
        .map_err(|e| {
            FailureReason::new(
                FailureCause::Planning,
                format!(
                    "Failed to send kv chunk of {}: the planning task died: {e}",
                    self.room
                ),
            )
        })
    }

    /// Posts decode rank `pi`'s aux rows (or records that it needs none).
    async fn post_aux(
        &mut self,
        pi: usize,
    ) -> std::result::Result<Vec<BatchAction>, FailureReason> {
        let p = &self.peers[pi];
        let ops = match (self.src_aux, p.info.dst_aux_index, p.peer.as_ref()) {
            (Some(s), Some(d), Some(ap)) => ap.plan.aux_ops(s, d),
            _ => Ok(Vec::new()),
        };
        match ops {
            Ok(ops) if ops.is_empty() => Ok(self.progress.handle(BatchEvent::NoAux { peer: pi })),
            Ok(ops) => self.post(pi, ops, true, None).await,
            Err(e) => {
                let endpoint = &p.info.decode_endpoint;
                Err(FailureReason::with_peer(
                    FailureCause::Planning,
                    endpoint,
                    format!(
                        "Failed to send aux data of {} to {endpoint}: {}",
                        self.room, e.0
                    ),
                ))
            }
        }
    }

    /// Posts `ops` to decode rank `pi` (reading the pack buffer `lease`, if any) and starts
    /// waiting for the batch.
    async fn post(
        &mut self,
        pi: usize,
        ops: Vec<TransferOp>,
        aux: bool,
        lease: Option<PackLease>,
    ) -> std::result::Result<Vec<BatchAction>, FailureReason> {
        let Some(peer_id) = self.peers[pi].peer.as_ref().map(|p| p.peer) else {
            if let Some(l) = lease {
                l.release();
            }
            return Ok(Vec::new());
        };
        let n_ops = ops.len() as u64;
        let rows: u64 = ops.iter().map(|o| o.count).sum();
        let bytes: u64 = ops.iter().map(TransferOp::total_bytes).sum();
        let batch = TransferBatch::write(ops).with_timeout(self.inner.config.batch_timeout);
        // Kept for one retry while this room has sent the peer nothing yet.
        let retry = (!self.posted_to[pi]).then(|| batch.clone());
        let mut posted = self.inner.transport.post(peer_id, batch).await;
        if let (Err(e), Some(batch)) = (&posted, retry) {
            // A connection lost before this room sent it anything (the link went quiet, or
            // the decode was stopped, since the last room): connect again, once.
            // (Unknown: another room replaced the lost connection since this room began.)
            if matches!(
                e,
                TransportError::PeerLost { .. } | TransportError::UnknownPeer { .. }
            ) {
                self.inner.note_lost(peer_id, e);
                let old = self.peers[pi].peer.clone();
                if let Some(Ok(fresh)) = match old {
                    Some(old) => Some(self.inner.reconnect(&old).await),
                    None => None,
                } {
                    let peer_id = fresh.peer;
                    self.peers[pi].peer = Some(fresh);
                    posted = self.inner.transport.post(peer_id, batch).await;
                }
            }
        }
        let id = match posted {
            Ok(id) => {
                self.posted_to[pi] = true;
                id
            }
            Err(e) => {
                // Refused: nothing of the batch moves.
                if let Some(l) = lease {
                    l.release();
                }
                self.inner.note_lost(peer_id, &e);
                let endpoint = &self.peers[pi].info.decode_endpoint;
                return Err(batch_failure(self.room, endpoint, aux, e));
            }
        };
        let metrics = &self.inner.metrics;
        inc(&metrics.batches_posted);
        add(&metrics.descriptors_posted, n_ops);
        add(&metrics.rows_posted, rows);
        let t = self.inner.transport.clone();
        let wait_limit = self.wait_limit;
        self.waits.spawn(async move {
            let waited = match tokio::time::timeout(wait_limit, t.wait(id)).await {
                Ok(r) => Waited::Final(r),
                Err(_) => Waited::Hung,
            };
            // Final: no byte of the batch is read any more.
            let lease = match (&waited, lease) {
                (Waited::Final(_), Some(l)) => {
                    l.release();
                    None
                }
                (_, l) => l,
            };
            WaitResult {
                pi,
                aux,
                id,
                bytes,
                waited,
                lease,
            }
        });
        Ok(self
            .progress
            .handle(BatchEvent::Posted { peer: pi, id, aux }))
    }

    /// Cancels every batch still in flight, then waits for every waiter; returns whether some
    /// batch could not be proven final (the room is then poisoned).
    async fn fence(&mut self) -> bool {
        let ids = self.progress.in_flight();
        let grace = self.inner.config.fence_grace;
        let mut poisoned = fence(
            &self.inner.transport,
            self.room,
            ids,
            grace,
            &mut self.hung_leases,
        )
        .await;
        // Every batch still waited on ends here and is counted once: done when it finished
        // before the cancel took hold, failed otherwise (cancelled, failed, or hung).
        let metrics = &self.inner.metrics;
        let waits = &mut self.waits;
        let drain = async {
            let mut hung = false;
            while let Some(joined) = waits.join_next().await {
                match joined {
                    Ok(WaitResult {
                        bytes,
                        waited: Waited::Final(Ok(())),
                        ..
                    }) => {
                        inc(&metrics.batches_done);
                        add(&metrics.bytes_transferred, bytes);
                    }
                    // Its lease (if any) drops unreleased: the buffer is retired.
                    Ok(WaitResult {
                        waited: Waited::Hung,
                        ..
                    }) => {
                        inc(&metrics.batches_failed);
                        hung = true;
                    }
                    _ => inc(&metrics.batches_failed),
                }
            }
            hung
        };
        match tokio::time::timeout(self.wait_limit, drain).await {
            Ok(hung) => poisoned |= hung,
            Err(_) => {
                add(&metrics.batches_failed, self.waits.len() as u64);
                self.waits.abort_all();
                poisoned = true;
            }
        }
        poisoned
    }
}

/// Cancels every batch in `ids` at once and waits, bounded by one deadline `grace` from now,
/// until each cancel returned (no byte of the batch can land any more). Releases the pack
/// buffers of fenced hung batches; returns whether some batch could not be proven fenced.
async fn fence(
    transport: &Arc<dyn KvTransport>,
    room: RoomId,
    ids: Vec<BatchId>,
    grace: Duration,
    hung_leases: &mut HashMap<BatchId, PackLease>,
) -> bool {
    let deadline = Instant::now() + grace;
    let mut cancels = JoinSet::new();
    for id in ids {
        let t = transport.clone();
        cancels.spawn(async move { (id, t.cancel(id).await) });
    }
    let mut poisoned = false;
    loop {
        match tokio::time::timeout_at(deadline, cancels.join_next()).await {
            Ok(None) => return poisoned,
            // A final state, or one already handed to `wait`, or a transport that shut down
            // (every batch failed): no byte of it can land any more.
            Ok(Some(Ok((
                id,
                Ok(_) | Err(TransportError::UnknownBatch { .. } | TransportError::Closed { .. }),
            )))) => {
                if let Some(l) = hung_leases.remove(&id) {
                    l.release();
                }
            }
            Ok(Some(Ok((id, Err(e))))) => {
                tracing::error!(%room, batch = %id, error = %e, "cancel failed: the batch cannot be proven fenced");
                poisoned = true;
            }
            Ok(Some(Err(e))) => {
                tracing::error!(%room, error = %e, "a cancel task died: its batch cannot be proven fenced");
                poisoned = true;
            }
            Err(_) => {
                tracing::error!(
                    %room,
                    pending = cancels.len(),
                    ?grace,
                    "cancels did not return within the fence grace"
                );
                cancels.abort_all();
                return true;
            }
        }
    }
}

/// Why a room fails when one of its batches failed with `e` (kept as the typed source).
fn batch_failure(room: RoomId, endpoint: &Endpoint, aux: bool, e: TransportError) -> FailureReason {
    let cause = match e {
        TransportError::TimedOut { .. } => FailureCause::BatchTimeout,
        _ => FailureCause::TransferError,
    };
    let what = if aux { "aux data" } else { "kv chunk" };
    FailureReason::with_peer(
        cause,
        endpoint,
        format!("Failed to send {what} of {room} to {endpoint}: {e}"),
    )
    .caused_by(e)
}
