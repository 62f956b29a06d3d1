//! The prefill (sending) agent: the async driver of the prefill rank's machine
//! ([`kvbridge_machines::prefill::PrefillMachine`]). It feeds the machine the events it sees
//! (control messages, calls, batch outcomes, timer ticks of one timer task) and carries out
//! the actions it answers: sends control messages, connects and disconnects the transport,
//! runs each room's send task (plan, post, wait, fence), publishes room states.
//!
//! One file per job:
//! - `mod.rs` (here): the agent's API ([`PrefillAgent`], [`PrefillAgentBuilder`]), the state
//!   the agent keeps beside its machine, and the control messages it hears;
//! - `step.rs`: feeding the machine an event under the lock and carrying out its actions;
//! - `registration.rs`: a registering decode rank checked, planned and answered;
//! - `connections.rs`: the transport connected to a decode rank, and again after it was lost;
//! - `metadata.rs`: a decode rank's metadata for a room, checked and handed to the machine;
//! - `rooms.rs`: the caller's room calls (create, clear, send a chunk);
//! - `send.rs`: a room's send task (plan, post, follow each batch to its end);
//! - `pack.rs`: the pack path (a strided batch gathered into a pack buffer);
//! - `fence.rs`: the fence (every batch in flight cancelled, proven final or the room poisoned).

mod connections;
mod fence;
mod metadata;
mod pack;
mod registration;
mod rooms;
mod send;
mod step;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use kvbridge_handshake::{PeerDescriptor, prefill_unique_rank};
use kvbridge_transport::{KvTransport, MemoryRegion, PeerId};
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::time::Instant;
use tracing::{Span, field};

use crate::agreement::{LocalOnly, RankAgreement};
use crate::channel::{ControlChannel, Endpoint, Envelope};
use crate::directory::PrefillRankInfo;
use crate::error::{CoordinatorError, Result, Side};
use crate::ids::{RoomId, SessionId};
use crate::memory::{KvHandles, KvMemory, PackPool, pack_buffer_bytes};
use crate::messages::{ControlMessage, WireProblem};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::outbox::{Outbox, send_failed_to};
use crate::shell::{Driver, Tasks};
use crate::start::{check_role, current_runtime};
use crate::state::{
    FailureCause, FailureReason, KvTransferError, RoomState, RoomStatus, wait_at_least,
    wait_terminal,
};
use kvbridge_control::TraceParent;
use kvbridge_machines::PrefillConfig;
use kvbridge_machines::plan::{Chunk, PeerPlan};
use kvbridge_machines::prefill::{
    Event, MetaPeer, PrefillMachine, PrefillRoom, RankEvent, RoomConfig,
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
                    early_traces: HashMap::new(),
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
    /// Whether the span has joined a decode rank's trace (the first `traceparent` heard is
    /// its parent, later ones are links).
    traced: bool,
}

/// The machine and what the driver keeps beside it, under one lock.
struct Core {
    machine: PrefillMachine<Conn>,
    rooms: HashMap<RoomId, RoomSide>,
    /// What the timer task sleeps until.
    timer_at: Option<std::time::Instant>,
    /// The control loop and the timer task: they end with the agent.
    tasks: Tasks,
    /// Trace contexts of metadata that came before its room was created (the machine holds
    /// the metadata itself), in arrival order, taken by `create_room`.
    early_traces: HashMap<RoomId, Vec<TraceParent>>,
}

/// At most this many early rooms' trace contexts are kept, and at most
/// [`EARLY_TRACES_PER_ROOM`] per room (beyond that they go untraced): a peer cannot grow it.
const EARLY_TRACES: usize = 4096;
const EARLY_TRACES_PER_ROOM: usize = 64;

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
        self.inner.create_room(room.into(), None)
    }

    /// [`create_room`](Self::create_room) with the room span's parent given: an engine's
    /// request span as a W3C `traceparent` (an engine whose tracing is not this process's
    /// `tracing` subscriber, e.g. SGLang's from Python). The decode ranks' room spans become
    /// the span's links instead of its parent. Without an OpenTelemetry layer it is
    /// `create_room`.
    ///
    /// # Errors
    /// As [`create_room`](Self::create_room).
    pub fn create_room_with_parent(
        &self,
        room: impl Into<RoomId>,
        parent: &TraceParent,
    ) -> Result<()> {
        self.inner.create_room(room.into(), Some(parent))
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
    /// One control message heard: a registration (handled on its own task, a bounded number
    /// at once), a room's metadata, an abort, a ping.
    async fn handle(self: &Arc<Self>, env: Envelope) {
        match env.message {
            ControlMessage::Register(reg) => {
                let permit = self.registrations.clone().acquire_owned().await;
                let me = self.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let span = tracing::info_span!(
                        parent: None,
                        "kv_register",
                        side = SIDE.as_str(),
                        rank = me.unique_rank,
                        decode = %reg.decode_endpoint,
                        transport = me.transport.name(),
                        path = field::Empty,
                        outcome = field::Empty,
                        otel.status_code = field::Empty,
                        error.type = field::Empty,
                    );
                    tracing::Instrument::instrument(me.on_register(reg), span).await;
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
}
