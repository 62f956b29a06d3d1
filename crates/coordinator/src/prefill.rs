//! The prefill (sending) agent.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvbridge_handshake::{PeerDescriptor, check_with, prefill_unique_rank};
use kvbridge_transport::{
    BatchId, KvTransport, MemoryRegion, PeerId, TransferBatch, TransferOp, TransportError,
};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;
use tracing::{Span, field};

use crate::agreement::{LocalOnly, RankAgreement};
use crate::channel::{ControlChannel, Endpoint, Envelope};
use crate::config::PrefillConfig;
use crate::directory::PrefillRankInfo;
use crate::error::{CoordinatorError, Result};
use crate::memory::{KvHandles, KvMemory, PackLease, PackPool, pack_buffer_bytes};
use crate::messages::{
    AbortAck, AbortRequest, CONTROL_PROTOCOL_VERSION, ControlMessage, Registration,
    RegistrationOutcome, RegistrationReply, StatusUpdate, TransferInfo, WireProblem,
    render_problems,
};
use crate::metrics::{Metrics, MetricsSnapshot, add, inc};
use crate::outbox::{Outbox, send_failed_to};
use crate::plan::{Chunk, PeerPlan, is_strided_source, pack_ops};
use crate::start::{check_role, current_runtime};
use crate::state::{
    FailureCause, FailureReason, KvTransferError, RoomState, RoomStatus, admit_room, wait_at_least,
    wait_terminal,
};
use crate::timer::{TimerGuard, spawn_timer_on};

const SIDE: &str = "prefill";

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
            PrefillInner {
                endpoint: self.channel.local_endpoint(),
                config: self.config,
                descriptor: self.descriptor,
                unique_rank,
                memory: self.memory,
                pack,
                transport: self.transport,
                channel: self.channel,
                outbox,
                metrics,
                agreement: self.agreement,
                state: Mutex::new(PrefillState::default()),
                incarnations: AtomicU64::new(0),
                registrations: Arc::new(Semaphore::new(REGISTRATION_CONCURRENCY)),
            }
        });
        let task = runtime.spawn(control_loop(inner.channel.clone(), Arc::downgrade(&inner)));
        inner.with_state(|st| st.control_task = Some(task.abort_handle()));
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

pub(crate) struct AcceptedPeer {
    endpoint: Endpoint,
    session: u64,
    peer: PeerId,
    plan: PeerPlan,
}

enum DecodePeer {
    Accepted(Arc<AcceptedPeer>),
    Rejected {
        session: u64,
        problems: Vec<WireProblem>,
    },
}

#[derive(Clone)]
struct RoomPeer {
    info: TransferInfo,
    /// `None` for a dummy peer.
    peer: Option<Arc<AcceptedPeer>>,
}

struct PrefillRoom {
    status: RoomStatus,
    incarnation: u64,
    created_at: Instant,
    cleared: bool,
    infos: Vec<RoomPeer>,
    required: u32,
    prefix: Option<u64>,
    pages_sent: u64,
    tokens_sent: u64,
    last_sent: bool,
    driver: Option<mpsc::Sender<Job>>,
    driver_alive: bool,
    pending_acks: Vec<(Endpoint, u64)>,
    poisoned: bool,
    notified: HashSet<Endpoint>,
    timer: Option<TimerGuard>,
    span: Span,
}

struct Pending {
    infos: Vec<RoomPeer>,
    _expiry: TimerGuard,
}

struct Tombstone {
    reason: FailureReason,
    _expiry: TimerGuard,
}

#[derive(Default)]
struct PrefillState {
    peers: HashMap<Endpoint, DecodePeer>,
    rooms: HashMap<u64, PrefillRoom>,
    pending: HashMap<u64, Pending>,
    tombstones: HashMap<u64, Tombstone>,
    closed: bool,
    control_task: Option<AbortHandle>,
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
    channel: Arc<dyn ControlChannel>,
    endpoint: Endpoint,
    outbox: Outbox,
    metrics: Arc<Metrics>,
    agreement: Arc<dyn RankAgreement>,
    /// Only [`PrefillInner::with_state`] locks it.
    state: Mutex<PrefillState>,
    /// Room incarnations, drawn before the state is locked (a room's timers name theirs).
    incarnations: AtomicU64,
    registrations: Arc<Semaphore>,
}

impl Drop for PrefillInner {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = st.control_task.take() {
            t.abort();
        }
    }
}

async fn control_loop(channel: Arc<dyn ControlChannel>, weak: Weak<PrefillInner>) {
    loop {
        let env = match channel.recv().await {
            Ok(env) => env,
            Err(e) => {
                tracing::info!(error = %e, "prefill control loop stops");
                return;
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        inc(&inner.metrics.control_received);
        inner.handle(env).await;
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

    /// This rank's id in status messages (spec 03 §1).
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

    /// Creates a room (Bootstrapping) and starts its bootstrap timer. Metadata decode ranks
    /// sent before this call is applied now.
    ///
    /// # Errors
    /// [`CoordinatorError::DuplicateRoom`] if the room exists (or is still draining after
    /// `clear`); [`CoordinatorError::Shutdown`]; [`CoordinatorError::InvalidRequest`] when
    /// the agent holds `max_rooms` rooms.
    pub fn create_room(&self, room: u64) -> Result<()> {
        self.inner.create_room(room)
    }

    /// The room's state on this rank.
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub fn poll(&self, room: u64) -> Result<RoomState> {
        self.inner
            .with_state(|st| st.visible(room).map(|r| r.status.state()))
    }

    /// The room's state agreed with the other ranks through the [`RankAgreement`] hook.
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub async fn poll_agreed(&self, room: u64) -> Result<RoomState> {
        let local = self.poll(room)?;
        Ok(self.inner.agreement.agree(room, local).await)
    }

    /// The failure of a Failed room (`None` otherwise), with its first recorded reason.
    pub fn failure(&self, room: u64) -> Option<KvTransferError> {
        self.inner
            .with_state(|st| st.visible(room).ok().and_then(|r| r.status.error(room)))
    }

    /// The decode prefix (tokens the decode already holds) once every decode rank sent its
    /// metadata; the prefill sends tokens from here.
    pub fn decode_prefix_len(&self, room: u64) -> Option<u64> {
        self.inner
            .with_state(|st| st.visible(room).ok().and_then(|r| r.prefix))
    }

    /// Waits until every decode rank of the room sent its metadata (WaitingForInput) and
    /// returns the decode prefix length to send from.
    ///
    /// # Errors
    /// The room's [`KvTransferError`] if it fails first; [`CoordinatorError::UnknownRoom`].
    pub async fn wait_ready(&self, room: u64) -> Result<u64> {
        let rx = self
            .inner
            .with_state(|st| st.visible(room).map(|r| r.status.subscribe()))?;
        let state = wait_at_least(rx, RoomState::WaitingForInput).await;
        self.inner.with_state(|st| {
            let r = st.visible(room)?;
            match state {
                Some(RoomState::Failed) | None => Err(r.status.failure_or_unknown(room, SIDE)),
                Some(_) => Ok(r.prefix.unwrap_or(0)),
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
    pub async fn send_chunk(&self, room: u64, chunk: Chunk) -> Result<()> {
        self.inner.clone().send_chunk(room, chunk).await
    }

    /// Waits until the room is terminal: `Ok` on Success, its [`KvTransferError`] on Failed.
    ///
    /// # Errors
    /// [`CoordinatorError::Transfer`]; [`CoordinatorError::UnknownRoom`] (also when the room
    /// is cleared while waiting).
    pub async fn wait(&self, room: u64) -> Result<()> {
        let rx = self
            .inner
            .with_state(|st| st.visible(room).map(|r| r.status.subscribe()))?;
        let state = wait_terminal(rx).await;
        self.inner.with_state(|st| {
            let r = st.visible(room)?;
            match state {
                Some(RoomState::Success) => Ok(()),
                _ => Err(r.status.failure_or_unknown(room, SIDE)),
            }
        })
    }

    /// Aborts the room (`Aborted by AbortReq.`): no further chunk is posted, batches in flight
    /// are cancelled, and the decode ranks are told.
    pub fn abort(&self, room: u64) {
        self.inner.fail_room(
            room,
            None,
            FailureReason::new(FailureCause::Aborted, "Aborted by AbortReq."),
        );
    }

    /// Forgets a room. A room that is not terminal is aborted first; a room whose batches are
    /// still being fenced stays hidden until they are, so its id cannot be reused too early.
    pub fn clear(&self, room: u64) {
        self.inner.clear(room);
    }

    /// A snapshot of this agent's metrics.
    pub fn metrics(&self) -> MetricsSnapshot {
        let states: Vec<RoomState> = self.inner.with_state(|st| {
            st.rooms
                .values()
                .filter(|r| !r.cleared)
                .map(|r| r.status.state())
                .collect()
        });
        let by_state = Metrics::count_states(states.into_iter());
        self.inner.metrics.snapshot(by_state)
    }

    /// Rooms currently held (not cleared).
    pub fn room_count(&self) -> usize {
        self.inner
            .with_state(|st| st.rooms.values().filter(|r| !r.cleared).count())
    }

    /// Stops the agent: every room that is not terminal fails (`the prefill agent shut down`),
    /// the control loop stops. Batches in flight are fenced by their rooms' drivers.
    pub fn shutdown(&self) {
        let rooms: Vec<u64> = self.inner.with_state(|st| {
            st.closed = true;
            st.rooms.keys().copied().collect()
        });
        for room in rooms {
            self.inner.fail_room(
                room,
                None,
                FailureReason::with_peer(
                    FailureCause::Shutdown,
                    &self.inner.endpoint,
                    format!("the prefill agent at {} shut down", self.inner.endpoint),
                ),
            );
        }
        if let Some(t) = self.inner.with_state(|st| st.control_task.take()) {
            t.abort();
        }
    }
}

impl PrefillState {
    /// Remembers for a while why a room failed before it was created.
    fn tombstone(
        &mut self,
        max_rooms: usize,
        room: u64,
        reason: FailureReason,
        expiry: TimerGuard,
    ) {
        if self.tombstones.len() >= max_rooms {
            tracing::warn!(
                room,
                "too many tombstoned rooms; this one is not remembered"
            );
            return;
        }
        self.tombstones.insert(
            room,
            Tombstone {
                reason,
                _expiry: expiry,
            },
        );
    }

    fn visible(&self, room: u64) -> Result<&PrefillRoom> {
        self.rooms
            .get(&room)
            .filter(|r| !r.cleared)
            .ok_or(CoordinatorError::UnknownRoom { room, side: SIDE })
    }
}

fn status_failed(
    room: u64,
    info: &TransferInfo,
    rank: u32,
    reason: &FailureReason,
) -> ControlMessage {
    ControlMessage::Status(StatusUpdate {
        room,
        generation: info.generation,
        state: RoomState::Failed,
        prefill_rank: rank,
        reason: Some(reason.message.clone()),
        cause: Some(reason.cause),
    })
}

impl PrefillInner {
    /// Runs `f` on the agent's state under its lock; the only place that takes it. `f` gets
    /// the state, not the agent, and its result cannot borrow the guard, so the lock is
    /// released before the caller does anything else (a std mutex is not re-entrant: calling
    /// back into the agent under it would park the thread forever).
    fn with_state<R>(&self, f: impl FnOnce(&mut PrefillState) -> R) -> R {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut st)
    }

    fn timer(
        self: &Arc<Self>,
        delay: Duration,
        f: impl FnOnce(&PrefillInner) + Send + 'static,
    ) -> TimerGuard {
        spawn_timer_on(self.weak(), delay, f)
    }

    fn weak(self: &Arc<Self>) -> Weak<Self> {
        Arc::downgrade(self)
    }

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
            ControlMessage::Abort(a) => self.on_abort(a),
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
        tracing::warn!(peer = %to, kind, room, error = %err, "prefill could not deliver a control message");
    }

    fn reply_rejected(&self, reg: &Registration, problems: Vec<WireProblem>) {
        tracing::warn!(
            decode = %reg.decode_endpoint,
            problems = %render_problems(&problems),
            "refusing an incompatible decode rank; still serving the others"
        );
        self.with_state(|st| {
            st.peers.insert(
                reg.decode_endpoint.clone(),
                DecodePeer::Rejected {
                    session: reg.session,
                    problems: problems.clone(),
                },
            )
        });
        self.outbox.send(
            &reg.decode_endpoint,
            ControlMessage::RegisterReply(RegistrationReply {
                protocol: CONTROL_PROTOCOL_VERSION,
                prefill_endpoint: self.endpoint.clone(),
                prefill_rank: self.unique_rank,
                session: reg.session,
                result: RegistrationOutcome::Rejected { problems },
            }),
        );
    }

    async fn on_register(self: &Arc<Self>, reg: Registration) {
        let problem = |code: &str, message: String, remedy: &str| WireProblem {
            code: code.to_owned(),
            message,
            remedy: remedy.to_owned(),
        };
        if reg.protocol != CONTROL_PROTOCOL_VERSION {
            let p = problem(
                "KVB-PROTOCOL",
                format!(
                    "control protocol version mismatch: decode speaks {}, this prefill speaks {}",
                    reg.protocol, CONTROL_PROTOCOL_VERSION
                ),
                "run the same kvbridge release on both sides",
            );
            return self.reply_rejected(&reg, vec![p]);
        }
        // Same session again (the decode retried, or registers again after a refusal):
        // answer as before.
        let known = self.with_state(|st| match st.peers.get(&reg.decode_endpoint) {
            Some(DecodePeer::Accepted(p)) if p.session == reg.session => Known::Accepted,
            Some(DecodePeer::Rejected { session, problems }) if *session == reg.session => {
                Known::Rejected(problems.clone())
            }
            _ => Known::New,
        });
        match known {
            Known::Accepted => return self.reply_accepted(&reg),
            Known::Rejected(problems) => return self.reply_rejected(&reg, problems),
            Known::New => {}
        }
        let report = check_with(&self.descriptor, &reg.descriptor, &self.config.check);
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
        let plan = match (&report.mapping, problems.is_empty()) {
            (Some(m), true) => match PeerPlan::new(
                m.path,
                &self.descriptor,
                &self.memory,
                &reg.descriptor,
                &reg.kv_regions,
                &reg.aux_regions,
            ) {
                Ok(p) => Some(p),
                Err(e) => {
                    problems.push(problem(
                        "KVB-PLAN",
                        e.0,
                        "register the decode's KV memory with the geometry its descriptor states",
                    ));
                    None
                }
            },
            _ => None,
        };
        let Some(plan) = plan.filter(|_| problems.is_empty()) else {
            return self.reply_rejected(&reg, problems);
        };
        let connect = tokio::time::timeout(
            self.config.control_send_timeout,
            self.transport.connect(&reg.transport.descriptor),
        )
        .await;
        let peer = match connect {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                let p = problem(
                    "KVB-CONNECT",
                    format!(
                        "connecting the {} transport to the decode failed: {e}",
                        self.transport.name()
                    ),
                    "check the decode's transport is reachable from the prefill",
                );
                return self.reply_rejected(&reg, vec![p]);
            }
            Err(_) => {
                let p = problem(
                    "KVB-CONNECT",
                    format!(
                        "connecting the {} transport to the decode did not finish within {:?}",
                        self.transport.name(),
                        self.config.control_send_timeout
                    ),
                    "check the decode's transport is reachable from the prefill",
                );
                return self.reply_rejected(&reg, vec![p]);
            }
        };
        let accepted = Arc::new(AcceptedPeer {
            endpoint: reg.decode_endpoint.clone(),
            session: reg.session,
            peer,
            plan,
        });
        let old = self.with_state(|st| match st.peers.get(&reg.decode_endpoint) {
            // The same registration, handled concurrently, won: keep its connection.
            Some(DecodePeer::Accepted(p)) if p.session == reg.session => Err(()),
            _ => Ok(st
                .peers
                .insert(reg.decode_endpoint.clone(), DecodePeer::Accepted(accepted))),
        });
        let Ok(old) = old else {
            let _ = self.transport.disconnect(peer).await;
            return self.reply_accepted(&reg);
        };
        if let Some(DecodePeer::Accepted(old)) = old {
            self.fail_rooms_of(
                &old.endpoint,
                Some(old.session),
                FailureReason::with_peer(
                    FailureCause::RemoteFailure,
                    &old.endpoint,
                    format!(
                        "decode {} registered again with a new session (it restarted); its \
                         earlier rooms are failed",
                        old.endpoint
                    ),
                ),
            );
            let _ = self.transport.disconnect(old.peer).await;
        }
        tracing::info!(
            decode = %reg.decode_endpoint,
            path = ?report.mapping.as_ref().map(|m| m.path),
            "decode rank registered"
        );
        self.reply_accepted(&reg);
    }

    fn reply_accepted(&self, reg: &Registration) {
        self.outbox.send(
            &reg.decode_endpoint,
            ControlMessage::RegisterReply(RegistrationReply {
                protocol: CONTROL_PROTOCOL_VERSION,
                prefill_endpoint: self.endpoint.clone(),
                prefill_rank: self.unique_rank,
                session: reg.session,
                result: RegistrationOutcome::Accepted {
                    descriptor: self.descriptor.clone(),
                },
            }),
        );
    }

    fn fail_rooms_of(&self, endpoint: &Endpoint, session: Option<u64>, reason: FailureReason) {
        let rooms: Vec<u64> = self.with_state(|st| {
            st.rooms
                .iter()
                .filter(|(_, r)| {
                    r.infos.iter().any(|p| {
                        &p.info.decode_endpoint == endpoint
                            && session.is_none_or(|s| p.info.session == s)
                    })
                })
                .map(|(&k, _)| k)
                .collect()
        });
        for room in rooms {
            self.fail_room(room, None, reason.clone());
        }
    }

    fn on_transfer_info(self: &Arc<Self>, info: TransferInfo) {
        let room = info.room;
        let reply_failed = |reason: FailureReason| {
            self.outbox.send(
                &info.decode_endpoint,
                status_failed(room, &info, self.unique_rank, &reason),
            );
        };
        let peer = self.with_state(|st| match st.peers.get(&info.decode_endpoint) {
            None => Err(FailureReason::with_peer(
                FailureCause::Unregistered,
                &self.endpoint,
                format!(
                    "decode {} sent metadata for room {room} without registering with prefill \
                     {} first",
                    info.decode_endpoint, self.endpoint
                ),
            )),
            Some(DecodePeer::Rejected { problems, .. }) => Err(FailureReason::with_peer(
                FailureCause::PeerRejected,
                &self.endpoint,
                render_problems(problems),
            )),
            Some(DecodePeer::Accepted(p)) if p.session != info.session => {
                Err(FailureReason::with_peer(
                    FailureCause::RemoteFailure,
                    &info.decode_endpoint,
                    format!(
                        "room {room}: metadata from an old session of decode {} (session {} != {})",
                        info.decode_endpoint, info.session, p.session
                    ),
                ))
            }
            Some(DecodePeer::Accepted(p)) => Ok(p.clone()),
        });
        let peer = match peer {
            Ok(p) => p,
            Err(reason) => return reply_failed(reason),
        };
        let rp = RoomPeer {
            peer: (!info.is_dummy).then(|| peer.clone()),
            info: info.clone(),
        };
        // Validate what the decode asks for before accepting it.
        let invalid = if info.is_dummy {
            None
        } else if let Err(e) = peer.plan.check_prefix(info.decode_prefix_len) {
            Some(FailureReason::with_peer(
                FailureCause::Planning,
                &info.decode_endpoint,
                e.0,
            ))
        } else if !self.memory.aux.is_empty() && info.dst_aux_index.is_none() {
            Some(FailureReason::with_peer(
                FailureCause::Planning,
                &info.decode_endpoint,
                format!(
                    "room {room}: decode {} sent no aux index, but both sides register aux buffers",
                    info.decode_endpoint
                ),
            ))
        } else {
            None
        };
        // Timers are made before the lock is taken; the one not kept is cancelled on drop.
        let expiry = match &invalid {
            Some(_) => self.timer(self.config.bootstrap_timeout, move |inner| {
                inner.forget_tombstone(room)
            }),
            None => self.timer(self.config.bootstrap_timeout, move |inner| {
                inner.expire_pending(room)
            }),
        };
        let max_rooms = self.config.max_rooms;
        let step = self.with_state(|st| {
            if st.rooms.get(&room).is_some_and(|r| !r.cleared) {
                return match invalid {
                    // The room fails; adding the info then tells this peer (and every other).
                    Some(reason) => MetadataStep::FailThenAdd(reason, rp),
                    None => MetadataStep::Added(match st.rooms.get_mut(&room) {
                        Some(r) => add_info(r, rp, self.unique_rank),
                        None => Added::default(),
                    }),
                };
            }
            if let Some(reason) = invalid {
                // Fail fast: tell the decode now, and fail the room when it is created.
                st.tombstone(max_rooms, room, reason.clone(), expiry);
                return MetadataStep::Reply(reason);
            }
            if let Some(t) = st.tombstones.get(&room) {
                return MetadataStep::Reply(t.reason.clone());
            }
            if st.pending.len() + st.rooms.len() >= max_rooms && !st.pending.contains_key(&room) {
                return MetadataStep::Reply(FailureReason::with_peer(
                    FailureCause::ControlChannel,
                    &self.endpoint,
                    format!(
                        "prefill {} holds {max_rooms} rooms (max_rooms); room {room} is refused",
                        self.endpoint
                    ),
                ));
            }
            st.pending
                .entry(room)
                .or_insert_with(|| Pending {
                    infos: Vec::new(),
                    _expiry: expiry,
                })
                .infos
                .push(rp);
            MetadataStep::Pending
        });
        match step {
            MetadataStep::Added(added) => self.apply_added(room, added),
            MetadataStep::FailThenAdd(reason, rp) => {
                self.fail_room(room, None, reason);
                let added = self.with_state(|st| match st.rooms.get_mut(&room) {
                    Some(r) => add_info(r, rp, self.unique_rank),
                    None => Added::default(),
                });
                self.apply_added(room, added);
            }
            MetadataStep::Reply(reason) => reply_failed(reason),
            MetadataStep::Pending => {}
        }
    }

    fn forget_tombstone(&self, room: u64) {
        self.with_state(|st| st.tombstones.remove(&room));
    }

    fn expire_pending(&self, room: u64) {
        let Some(p) = self.with_state(|st| st.pending.remove(&room)) else {
            return;
        };
        let reason = FailureReason::with_peer(
            FailureCause::BootstrapTimeout,
            &self.endpoint,
            format!(
                "prefill {} never created room {room} within the bootstrap timeout of {:.1}s",
                self.endpoint,
                self.config.bootstrap_timeout.as_secs_f64()
            ),
        );
        tracing::warn!(room, reason = %reason, "dropping metadata of a room that was never created");
        for rp in p.infos.iter().filter(|p| !p.info.is_dummy) {
            self.outbox.send(
                &rp.info.decode_endpoint,
                status_failed(room, &rp.info, self.unique_rank, &reason),
            );
        }
    }

    fn create_room(self: &Arc<Self>, room: u64) -> Result<()> {
        let incarnation = self.incarnations.fetch_add(1, Ordering::Relaxed) + 1;
        let timer = self.timer(self.config.bootstrap_timeout, move |inner| {
            inner.on_bootstrap_timeout(room, incarnation)
        });
        let span = tracing::info_span!(
            parent: None,
            "kv_room",
            side = SIDE,
            room,
            peer = field::Empty,
            bytes = field::Empty,
            duration_ms = field::Empty
        );
        let max_rooms = self.config.max_rooms;
        let (added, tomb) = self.with_state(|st| {
            admit_room(
                SIDE,
                room,
                st.closed,
                st.rooms.get(&room).map(|r| r.status.state()),
                st.rooms.len(),
                max_rooms,
                "clear finished rooms or raise PrefillConfig::max_rooms",
            )?;
            let mut r = PrefillRoom {
                status: RoomStatus::new(RoomState::Bootstrapping),
                incarnation,
                created_at: Instant::now(),
                cleared: false,
                infos: Vec::new(),
                required: 0,
                prefix: None,
                pages_sent: 0,
                tokens_sent: 0,
                last_sent: false,
                driver: None,
                driver_alive: false,
                pending_acks: Vec::new(),
                poisoned: false,
                notified: HashSet::new(),
                timer: Some(timer),
                span,
            };
            inc(&self.metrics.rooms_created);
            tracing::debug!(parent: &r.span, "room created");
            let tomb = st.tombstones.remove(&room).map(|t| t.reason);
            let mut added = Vec::new();
            if let Some(p) = st.pending.remove(&room) {
                for rp in p.infos {
                    added.push(add_info(&mut r, rp, self.unique_rank));
                }
            }
            st.rooms.insert(room, r);
            Ok::<_, CoordinatorError>((added, tomb))
        })?;
        for a in added {
            self.apply_added(room, a);
        }
        if let Some(reason) = tomb {
            self.fail_room(room, Some(incarnation), reason);
        }
        Ok(())
    }

    fn on_bootstrap_timeout(&self, room: u64, incarnation: u64) {
        // The decode ranks heard from so far are named (none: no decode ever asked for it).
        let heard = self.with_state(|st| {
            st.rooms.get(&room).and_then(|r| {
                (r.incarnation == incarnation && r.status.state() == RoomState::Bootstrapping).then(
                    || {
                        let names: Vec<String> = r
                            .infos
                            .iter()
                            .map(|p| p.info.decode_endpoint.to_string())
                            .collect();
                        if names.is_empty() {
                            "no decode rank".to_owned()
                        } else {
                            names.join(", ")
                        }
                    },
                )
            })
        });
        if let Some(heard) = heard {
            let secs = self.config.bootstrap_timeout.as_secs_f64();
            self.fail_room(
                room,
                Some(incarnation),
                FailureReason::with_peer(
                    FailureCause::BootstrapTimeout,
                    heard,
                    format!("Request {room} timed out after {secs:.1}s in KVPoll.Bootstrapping"),
                ),
            );
        }
    }

    fn apply_added(self: &Arc<Self>, room: u64, added: Added) {
        for (to, msg) in added.sends {
            self.outbox.send(&to, msg);
        }
        if let Some(reason) = added.duplicate {
            self.fail_room(room, None, reason);
        }
        if !added.ready {
            return;
        }
        let Some(incarnation) = self.with_state(|st| st.rooms.get(&room).map(|r| r.incarnation))
        else {
            return;
        };
        let timer = self.timer(self.config.waiting_timeout, move |inner| {
            inner.on_waiting_timeout(room, incarnation)
        });
        self.with_state(|st| {
            if let Some(r) = st
                .rooms
                .get_mut(&room)
                .filter(|r| r.incarnation == incarnation && !r.status.state().is_terminal())
            {
                r.timer = Some(timer);
            }
        });
    }

    fn on_waiting_timeout(&self, room: u64, incarnation: u64) {
        let stuck = self.with_state(|st| {
            st.rooms.get(&room).and_then(|r| {
                let state = r.status.state();
                (r.incarnation == incarnation && !state.is_terminal()).then(|| {
                    let peers: Vec<String> = r
                        .infos
                        .iter()
                        .map(|p| p.info.decode_endpoint.to_string())
                        .collect();
                    (state, peers.join(", "))
                })
            })
        });
        if let Some((state, peers)) = stuck {
            let secs = self.config.waiting_timeout.as_secs_f64();
            self.fail_room(
                room,
                Some(incarnation),
                FailureReason::with_peer(
                    FailureCause::WaitingTimeout,
                    peers,
                    format!("Request {room} timed out after {secs:.1}s in KVPoll.{state}"),
                ),
            );
        }
    }

    /// Fails a room (first reason wins). When no driver runs, the decode peers are told now;
    /// otherwise the driver fences its batches first and tells them when it ends.
    fn fail_room(&self, room: u64, incarnation: Option<u64>, reason: FailureReason) {
        let sends = self.with_state(|st| {
            let r = st.rooms.get_mut(&room)?;
            if incarnation.is_some_and(|i| i != r.incarnation) || !r.status.fail(reason.clone())
            {
                return None;
            }
            self.metrics.failed(reason.cause);
            r.timer = None;
            tracing::warn!(parent: &r.span, cause = %reason.cause, peer = reason.peer.as_deref(), reason = %reason.message, "room failed");
            (!r.driver_alive).then(|| failure_notices(r, self.unique_rank))
        });
        for (to, msg) in sends.into_iter().flatten() {
            self.outbox.send(&to, msg);
        }
    }

    fn on_abort(self: &Arc<Self>, a: AbortRequest) {
        let room = a.room;
        let ack = ControlMessage::AbortAck(AbortAck {
            room,
            generation: a.generation,
            prefill_rank: self.unique_rank,
            prefill_endpoint: self.endpoint.clone(),
        });
        let known = self.with_state(|st| {
            st.rooms
                .get(&room)
                .filter(|r| {
                    r.infos
                        .iter()
                        .any(|p| p.info.decode_endpoint == a.decode_endpoint)
                        || !r.cleared
                })
                .map(|r| r.status.state())
        });
        let Some(state) = known else {
            let expiry = self.timer(self.config.bootstrap_timeout, move |inner| {
                inner.forget_tombstone(room)
            });
            let max_rooms = self.config.max_rooms;
            self.with_state(|st| {
                if st.pending.remove(&room).is_some() {
                    tracing::debug!(room, "abort before the room was created: tombstoned");
                    let reason = FailureReason::with_peer(
                        FailureCause::DuplicateRoom,
                        &a.decode_endpoint,
                        "Duplicate or cancelled bootstrap room",
                    );
                    st.tombstone(max_rooms, room, reason, expiry);
                }
            });
            return self.outbox.send(&a.decode_endpoint, ack);
        };
        if state != RoomState::Success {
            self.fail_room(
                room,
                None,
                FailureReason::with_peer(
                    FailureCause::RemoteFailure,
                    &a.decode_endpoint,
                    format!("Aborted by decode {}: {}", a.decode_endpoint, a.reason),
                ),
            );
        }
        let ack_now = self.with_state(|st| {
            let Some(r) = st.rooms.get_mut(&room) else {
                return true;
            };
            if r.driver_alive {
                r.pending_acks.push((a.decode_endpoint.clone(), a.generation));
                false
            } else if r.poisoned {
                tracing::error!(parent: &r.span, decode = %a.decode_endpoint, "room is poisoned (a batch could not be fenced): no ABORT_ACK");
                false
            } else {
                true
            }
        });
        if ack_now {
            self.outbox.send(&a.decode_endpoint, ack);
        }
    }

    fn clear(&self, room: u64) {
        let state = self.with_state(|st| st.visible(room).ok().map(|r| r.status.state()));
        let Some(state) = state else { return };
        if !state.is_terminal() {
            self.fail_room(
                room,
                None,
                FailureReason::new(FailureCause::Aborted, "Cleared before the transfer ended"),
            );
        }
        self.with_state(|st| {
            let r = st.rooms.get_mut(&room)?;
            if r.driver_alive {
                r.cleared = true;
                r.driver = None;
                None
            } else {
                st.rooms.remove(&room)
            }
        });
        self.agreement.forget(room);
    }

    async fn send_chunk(self: Arc<Self>, room: u64, chunk: Chunk) -> Result<()> {
        // One page id stands for page_size · dcp_size tokens (the prefill's virtual page).
        let page_tokens = self
            .descriptor
            .page_size
            .saturating_mul(u64::from(self.descriptor.dcp_size.max(1)));
        fn invalid<T>(message: String) -> Result<T> {
            Err(CoordinatorError::InvalidRequest {
                what: "chunk",
                message,
            })
        }
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
        if let Some(i) = chunk.aux_index {
            for (j, (e, &item)) in self
                .memory
                .aux
                .iter()
                .zip(&self.descriptor.aux_item_lens)
                .enumerate()
            {
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
        }
        let max_inflight = self.config.max_inflight_batches.max(1);
        let step = self.with_state(|st| {
            let r = match st.rooms.get_mut(&room).filter(|r| !r.cleared) {
                Some(r) => r,
                None => return Err(CoordinatorError::UnknownRoom { room, side: SIDE }),
            };
            match r.status.state() {
                RoomState::Failed => {
                    return Err(r.status.failure_or_unknown(room, SIDE));
                }
                RoomState::Bootstrapping => {
                    return Err(CoordinatorError::RoomNotReady {
                        room,
                        state: RoomState::Bootstrapping,
                        operation: "send_chunk",
                        needed: RoomState::WaitingForInput,
                    });
                }
                RoomState::Success => {
                    return invalid(format!("room {room} already ended in Success"));
                }
                _ => {}
            }
            if r.last_sent {
                return invalid(format!("the last chunk of room {room} was already sent"));
            }
            // The chunk starts at position prefix + tokens_sent, possibly mid-page.
            let start = r.prefix.unwrap_or(0).saturating_add(r.tokens_sent) % page_tokens.max(1);
            let capacity = (chunk.pages.len() as u64)
                .saturating_mul(page_tokens)
                .saturating_sub(if chunk.pages.is_empty() { 0 } else { start });
            if chunk.num_kv_tokens > capacity {
                return invalid(format!(
                    "num_kv_tokens must fit in the provided source pages, got tokens={}, \
                     capacity={capacity} ({} pages of {page_tokens} tokens, starting {start} \
                     tokens into the first)",
                    chunk.num_kv_tokens,
                    chunk.pages.len()
                ));
            }
            if !chunk.is_last && chunk.num_kv_tokens != capacity {
                return invalid(format!(
                    "only the last chunk may end mid-page: this chunk has {} pages ({capacity} \
                     token slots from where the send range stands) but {} tokens; floor \
                     non-last chunks to whole pages",
                    chunk.pages.len(),
                    chunk.num_kv_tokens
                ));
            }
            let page_offset = r.pages_sent;
            let token_offset = r.tokens_sent;
            r.tokens_sent += chunk.num_kv_tokens;
            r.pages_sent += chunk.pages.len() as u64;
            r.last_sent = chunk.is_last;
            r.status.update(RoomState::Transferring);
            let senders: Vec<RoomPeer> = r
                .infos
                .iter()
                .filter(|p| p.peer.is_some())
                .cloned()
                .collect();
            if senders.is_empty() {
                // Only dummy peers: nothing to send; the last chunk concludes locally.
                return Ok(ChunkStep::Local {
                    conclude: chunk.is_last,
                });
            }
            let mut start = None;
            if r.driver.is_none() && !r.driver_alive {
                let (tx, rx) = mpsc::channel(max_inflight);
                r.driver = Some(tx);
                r.driver_alive = true;
                start = Some(DriverStart {
                    incarnation: r.incarnation,
                    senders,
                    prefix: r.prefix.unwrap_or(0),
                    rx,
                    status_rx: r.status.subscribe(),
                    span: r.span.clone(),
                });
            }
            let Some(tx) = r.driver.clone() else {
                return invalid(format!("room {room} is no longer accepting chunks"));
            };
            Ok(ChunkStep::Queue {
                tx,
                job: Job {
                    chunk,
                    page_offset,
                    token_offset,
                },
                start,
            })
        })?;
        let (tx, job) = match step {
            ChunkStep::Local { conclude } => {
                if conclude {
                    self.conclude_success(room, None, 0);
                }
                return Ok(());
            }
            ChunkStep::Queue { tx, job, start } => {
                if let Some(d) = start {
                    tokio::spawn(tracing::Instrument::instrument(
                        drive_room(
                            self.clone(),
                            room,
                            d.incarnation,
                            d.senders,
                            d.prefix,
                            d.rx,
                            d.status_rx,
                        ),
                        d.span,
                    ));
                }
                (tx, job)
            }
        };
        if tx.send(job).await.is_err() {
            return self.with_state(|st| {
                let r = st.visible(room)?;
                Err(r.status.error(room).map(CoordinatorError::from).unwrap_or(
                    CoordinatorError::InvalidRequest {
                        what: "chunk",
                        message: format!("room {room} stopped accepting chunks"),
                    },
                ))
            });
        }
        Ok(())
    }

    fn conclude_success(&self, room: u64, incarnation: Option<u64>, bytes: u64) {
        let sends = self.with_state(|st| {
            let r = st.rooms.get_mut(&room)?;
            if incarnation.is_some_and(|i| i != r.incarnation)
                || r.status.state() == RoomState::Failed
            {
                return None;
            }
            Some(conclude(r, room, self.unique_rank, bytes, &self.metrics))
        });
        for (to, msg) in sends.into_iter().flatten() {
            self.outbox.send(&to, msg);
        }
    }

    /// The driver of `room` ended: its batches are all final (or the room is poisoned).
    fn driver_finished(&self, room: u64, incarnation: u64, poisoned: bool) {
        let sends = self.with_state(|st| {
            let r = st
                .rooms
                .get_mut(&room)
                .filter(|r| r.incarnation == incarnation)?;
            let sends = driver_ended(r, room, poisoned, self.unique_rank, &self.endpoint);
            if r.cleared {
                st.rooms.remove(&room);
            }
            Some(sends)
        });
        for (to, msg) in sends.into_iter().flatten() {
            self.outbox.send(&to, msg);
        }
    }
}

/// Marks a room Success; returns the statuses to send.
fn conclude(
    r: &mut PrefillRoom,
    room: u64,
    rank: u32,
    bytes: u64,
    metrics: &Metrics,
) -> Vec<(Endpoint, ControlMessage)> {
    r.status.update(RoomState::Success);
    r.timer = None;
    let elapsed = r.created_at.elapsed();
    metrics.succeeded(elapsed);
    r.span.record("bytes", bytes);
    r.span.record("duration_ms", elapsed.as_millis() as u64);
    tracing::info!(parent: &r.span, bytes, duration_ms = elapsed.as_millis() as u64, "room transferred");
    r.infos
        .iter()
        .filter(|p| p.peer.is_some())
        .map(|p| {
            (
                p.info.decode_endpoint.clone(),
                ControlMessage::Status(StatusUpdate {
                    room,
                    generation: p.info.generation,
                    state: RoomState::Success,
                    prefill_rank: rank,
                    reason: None,
                    cause: None,
                }),
            )
        })
        .collect()
}

/// Records that a room's driver ended; returns the notices and acks now due.
fn driver_ended(
    r: &mut PrefillRoom,
    room: u64,
    poisoned: bool,
    rank: u32,
    endpoint: &Endpoint,
) -> Vec<(Endpoint, ControlMessage)> {
    r.driver_alive = false;
    r.driver = None;
    r.poisoned |= poisoned;
    let mut sends = Vec::new();
    if r.status.state() == RoomState::Failed {
        sends.extend(failure_notices_inner(r, rank));
    }
    let acks = std::mem::take(&mut r.pending_acks);
    if r.poisoned {
        if !acks.is_empty() {
            tracing::error!(parent: &r.span, "room is poisoned (a batch could not be fenced): no ABORT_ACK is sent");
        }
    } else {
        for (to, generation) in acks {
            sends.push((
                to,
                ControlMessage::AbortAck(AbortAck {
                    room,
                    generation,
                    prefill_rank: rank,
                    prefill_endpoint: endpoint.clone(),
                }),
            ));
        }
    }
    sends
}

/// What [`PrefillInner::on_transfer_info`] does once the state is unlocked.
enum MetadataStep {
    Added(Added),
    FailThenAdd(FailureReason, RoomPeer),
    Reply(FailureReason),
    Pending,
}

/// What [`PrefillInner::send_chunk`] does once the state is unlocked.
enum ChunkStep {
    /// Only dummy peers: nothing to send (the last chunk concludes the room).
    Local { conclude: bool },
    Queue {
        tx: mpsc::Sender<Job>,
        job: Job,
        start: Option<DriverStart>,
    },
}

/// What a new room driver needs, taken under the lock and spawned after it.
struct DriverStart {
    incarnation: u64,
    senders: Vec<RoomPeer>,
    prefix: u64,
    rx: mpsc::Receiver<Job>,
    status_rx: watch::Receiver<RoomState>,
    span: Span,
}

/// What the prefill already knows of a registering decode session.
enum Known {
    Accepted,
    Rejected(Vec<WireProblem>),
    New,
}

/// What adding a decode rank's metadata to a room asks the caller to do.
#[derive(Default)]
struct Added {
    /// Messages to send (failure notices for a room that already failed).
    sends: Vec<(Endpoint, ControlMessage)>,
    /// The room just became ready (WaitingForInput): arm its waiting timer.
    ready: bool,
    /// The same decode rank sent metadata of another generation: fail the room with this.
    duplicate: Option<FailureReason>,
}

/// Adds a decode rank's metadata to a room.
fn add_info(r: &mut PrefillRoom, rp: RoomPeer, rank: u32) -> Added {
    let e = rp.info.decode_endpoint.clone();
    if let Some(existing) = r.infos.iter().find(|p| p.info.decode_endpoint == e) {
        let mut out = Added::default();
        if existing.info.generation != rp.info.generation {
            out.duplicate = Some(FailureReason::with_peer(
                FailureCause::DuplicateRoom,
                &e,
                "Duplicate decode bootstrap room",
            ));
        }
        return out;
    }
    if r.infos.is_empty() {
        r.span.record("peer", e.as_str());
    }
    r.required = r.required.max(rp.info.required_dst_info_num);
    if r.prefix.is_none() {
        r.prefix = Some(rp.info.decode_prefix_len);
    }
    r.infos.push(rp);
    match r.status.state() {
        RoomState::Failed => Added {
            sends: failure_notices(r, rank),
            ..Added::default()
        },
        RoomState::Bootstrapping if r.infos.len() as u32 >= r.required.max(1) => {
            r.status.update(RoomState::WaitingForInput);
            r.timer = None;
            tracing::debug!(parent: &r.span, decode_ranks = r.infos.len(), prefix = r.prefix, "room ready");
            Added {
                ready: true,
                ..Added::default()
            }
        }
        _ => Added::default(),
    }
}

/// Failure statuses for every non-dummy peer not told yet (none while a driver still fences
/// the room's batches: it tells them when it ends).
fn failure_notices(r: &mut PrefillRoom, rank: u32) -> Vec<(Endpoint, ControlMessage)> {
    if r.driver_alive {
        return Vec::new();
    }
    failure_notices_inner(r, rank)
}

fn failure_notices_inner(r: &mut PrefillRoom, rank: u32) -> Vec<(Endpoint, ControlMessage)> {
    let reason = r
        .status
        .reason()
        .cloned()
        .unwrap_or_else(|| FailureReason::new(FailureCause::OtherRank, "KV transfer failed"));
    let mut out = Vec::new();
    for p in r.infos.iter().filter(|p| p.peer.is_some()) {
        if r.notified.insert(p.info.decode_endpoint.clone()) {
            out.push((
                p.info.decode_endpoint.clone(),
                status_failed(p.info.room, &p.info, rank, &reason),
            ));
        }
    }
    out
}

/// Per decode peer progress inside a room's driver.
struct SendPeer {
    rp: RoomPeer,
    outstanding: usize,
    last_posted: bool,
    aux_posted: bool,
    done: bool,
    bytes: u64,
}

impl SendPeer {
    /// Every KV batch of the last chunk is done and the aux rows are not posted yet.
    fn ready_for_aux(&self) -> bool {
        self.last_posted && self.outstanding == 0 && !self.aux_posted && !self.done
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
    room: u64,
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
        Ok(Some(Err(e))) => return Err(fail(FailureCause::TransferError, e.to_string())),
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

/// Posts a room's chunks and waits for its batches; on failure, fences every batch in flight
/// before the decode peers are told (and before any abort is acknowledged).
async fn drive_room(
    inner: Arc<PrefillInner>,
    room: u64,
    incarnation: u64,
    senders: Vec<RoomPeer>,
    prefix: u64,
    mut rx: mpsc::Receiver<Job>,
    mut status_rx: watch::Receiver<RoomState>,
) {
    let mut peers: Vec<SendPeer> = senders
        .into_iter()
        .map(|rp| SendPeer {
            rp,
            outstanding: 0,
            last_posted: false,
            aux_posted: false,
            done: false,
            bytes: 0,
        })
        .collect();
    let mut waits: JoinSet<WaitResult> = JoinSet::new();
    // Pack buffers of batches whose waiter gave up (hung): released once the fence proves
    // the batch final, retired otherwise.
    let mut hung_leases: HashMap<BatchId, PackLease> = HashMap::new();
    let mut inflight: HashMap<BatchId, usize> = HashMap::new();
    let mut input_open = true;
    let mut src_aux: Option<u64> = None;
    let mut failure: Option<FailureReason> = None;
    let max_inflight = inner.config.max_inflight_batches.max(1);
    let wait_limit = inner.config.batch_timeout + inner.config.fence_grace;

    // Posts `ops` to peer `pi` (reading the pack buffer `lease`, if any); records the wait.
    // Returns a failure reason on error.
    macro_rules! post {
        ($pi:expr, $ops:expr, $aux:expr, $lease:expr) => {{
            let pi: usize = $pi;
            let ops: Vec<TransferOp> = $ops;
            let lease: Option<PackLease> = $lease;
            let n_ops = ops.len() as u64;
            let rows: u64 = ops.iter().map(|o| o.count).sum();
            let bytes: u64 = ops.iter().map(TransferOp::total_bytes).sum();
            let batch = TransferBatch::write(ops).with_timeout(inner.config.batch_timeout);
            let peer = peers[pi].rp.peer.as_ref().map(|p| p.peer);
            match peer {
                None => {
                    if let Some(l) = lease {
                        l.release();
                    }
                    None
                }
                Some(peer_id) => match inner.transport.post(peer_id, batch).await {
                    Ok(id) => {
                        inc(&inner.metrics.batches_posted);
                        add(&inner.metrics.descriptors_posted, n_ops);
                        add(&inner.metrics.rows_posted, rows);
                        inflight.insert(id, pi);
                        let t = inner.transport.clone();
                        waits.spawn(async move {
                            let w = match tokio::time::timeout(wait_limit, t.wait(id)).await {
                                Ok(r) => Waited::Final(r),
                                Err(_) => Waited::Hung,
                            };
                            // Final: no byte of the batch is read any more.
                            let lease = match (&w, lease) {
                                (Waited::Final(_), Some(l)) => {
                                    l.release();
                                    None
                                }
                                (_, l) => l,
                            };
                            WaitResult {
                                pi,
                                aux: $aux,
                                id,
                                bytes,
                                waited: w,
                                lease,
                            }
                        });
                        None
                    }
                    Err(e) => {
                        // Refused: nothing of the batch moves.
                        if let Some(l) = lease {
                            l.release();
                        }
                        Some(batch_failure(
                            room,
                            &peers[pi].rp.info.decode_endpoint,
                            $aux,
                            &e,
                        ))
                    }
                },
            }
        }};
    }

    loop {
        if failure.is_some() {
            break;
        }
        if peers.iter().all(|p| p.done) {
            let total: u64 = peers.iter().map(|p| p.bytes).sum();
            inner.conclude_success(room, Some(incarnation), total);
            break;
        }
        if *status_rx.borrow() == RoomState::Failed {
            break;
        }
        tokio::select! {
            biased;
            changed = status_rx.changed() => {
                if changed.is_err() || *status_rx.borrow() == RoomState::Failed {
                    break;
                }
            }
            Some(joined) = waits.join_next(), if !waits.is_empty() => {
                let Ok(WaitResult { pi, aux: is_aux, id, bytes, waited, lease }) = joined else {
                    failure = Some(FailureReason::new(FailureCause::TransferError, format!("Failed to send kv chunk of {room}: a batch waiter task died")));
                    continue;
                };
                match waited {
                    Waited::Final(Ok(())) => {
                        inflight.remove(&id);
                        inc(&inner.metrics.batches_done);
                        add(&inner.metrics.bytes_transferred, bytes);
                        let p = &mut peers[pi];
                        p.bytes += bytes;
                        if is_aux {
                            p.done = true;
                        } else {
                            p.outstanding -= 1;
                        }
                    }
                    Waited::Final(Err(e)) => {
                        inflight.remove(&id);
                        inc(&inner.metrics.batches_failed);
                        failure = Some(batch_failure(room, &peers[pi].rp.info.decode_endpoint, is_aux, &e));
                        continue;
                    }
                    Waited::Hung => {
                        if let Some(l) = lease {
                            hung_leases.insert(id, l);
                        }
                        inc(&inner.metrics.batches_failed);
                        let what = if is_aux { "aux data" } else { "kv chunk" };
                        failure = Some(FailureReason::with_peer(
                            FailureCause::BatchTimeout,
                            &peers[pi].rp.info.decode_endpoint,
                            format!(
                                "Failed to send {what} of {room} to {}: the transport did not finish batch {id} within {wait_limit:?} (its deadline plus grace)",
                                peers[pi].rp.info.decode_endpoint
                            ),
                        ));
                        continue;
                    }
                }
            }
            job = rx.recv(), if input_open && waits.len() < max_inflight => {
                let Some(job) = job else {
                    input_open = false;
                    continue;
                };
                // Planning is linear in the chunk's descriptors (hundreds of thousands when
                // every token row of a head slice is one): it runs off the runtime's workers,
                // so heartbeats, keep-alives and the other rooms' transfers go on meanwhile.
                let targets: Vec<RoomPeer> = peers.iter().map(|p| p.rp.clone()).collect();
                let planned = tokio::task::spawn_blocking(move || {
                    let ops: Vec<_> = targets
                        .iter()
                        .map(|rp| {
                            rp.peer.as_ref().map(|ap| {
                                ap.plan.chunk_ops(
                                    &job.chunk,
                                    job.page_offset,
                                    job.token_offset,
                                    &rp.info.dst_pages,
                                    prefix,
                                )
                            })
                        })
                        .collect();
                    (job, ops)
                })
                .await;
                let (job, planned) = match planned {
                    Ok(p) => p,
                    Err(e) => {
                        failure = Some(FailureReason::new(
                            FailureCause::Planning,
                            format!("Failed to send kv chunk of {room}: the planning task died: {e}"),
                        ));
                        continue;
                    }
                };
                for (pi, ops) in planned.into_iter().enumerate() {
                    let Some(ops) = ops else { continue };
                    let endpoint = peers[pi].rp.info.decode_endpoint.clone();
                    match ops {
                        Ok(ops) if ops.is_empty() => {}
                        Ok(ops) => {
                            let (ops, lease) = match &inner.pack {
                                Some(pack) if has_strided_source(&ops) => {
                                    match pack_batch(&inner, pack, ops, room, &endpoint, wait_limit, status_rx.clone()).await {
                                        Ok(Some((ops, lease))) => (ops, Some(lease)),
                                        // The room failed while waiting for a buffer.
                                        Ok(None) => break,
                                        Err(f) => {
                                            failure = Some(f);
                                            break;
                                        }
                                    }
                                }
                                _ => (ops, None),
                            };
                            if let Some(f) = post!(pi, ops, false, lease) {
                                failure = Some(f);
                                break;
                            }
                            peers[pi].outstanding += 1;
                        }
                        Err(e) => {
                            failure = Some(FailureReason::with_peer(
                                FailureCause::Planning,
                                &endpoint,
                                format!("Failed to send kv chunk of {room} to {endpoint}: {}", e.0),
                            ));
                            break;
                        }
                    }
                }
                if job.chunk.is_last {
                    src_aux = job.chunk.aux_index;
                    for p in &mut peers {
                        p.last_posted = true;
                    }
                }
            }
        }
        if failure.is_some() {
            break;
        }
        // Aux rows follow the KV: post them once every KV batch of the peer is done.
        for pi in 0..peers.len() {
            let p = &peers[pi];
            if !p.ready_for_aux() {
                continue;
            }
            let ops = match (src_aux, p.rp.info.dst_aux_index, p.rp.peer.as_ref()) {
                (Some(s), Some(d), Some(ap)) => ap.plan.aux_ops(s, d),
                _ => Ok(Vec::new()),
            };
            peers[pi].aux_posted = true;
            match ops {
                Ok(ops) if ops.is_empty() => peers[pi].done = true,
                Ok(ops) => {
                    if let Some(f) = post!(pi, ops, true, None) {
                        failure = Some(f);
                        break;
                    }
                }
                Err(e) => {
                    let endpoint = peers[pi].rp.info.decode_endpoint.clone();
                    failure = Some(FailureReason::with_peer(
                        FailureCause::Planning,
                        &endpoint,
                        format!("Failed to send aux data of {room} to {endpoint}: {}", e.0),
                    ));
                    break;
                }
            }
        }
    }
    drop(rx);
    if let Some(reason) = failure {
        inner.fail_room(room, Some(incarnation), reason);
    }
    let ids: Vec<BatchId> = inflight.keys().copied().collect();
    let mut poisoned = fence(
        &inner.transport,
        room,
        ids,
        inner.config.fence_grace,
        &mut hung_leases,
    )
    .await;
    // Every batch still waited on ends here and is counted once: done when it finished before
    // the cancel took hold, failed otherwise (cancelled, failed, or hung).
    let metrics = &inner.metrics;
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
    match tokio::time::timeout(wait_limit, drain).await {
        Ok(hung) => poisoned |= hung,
        Err(_) => {
            add(&metrics.batches_failed, waits.len() as u64);
            waits.abort_all();
            poisoned = true;
        }
    }
    if poisoned {
        tracing::error!(
            room,
            "a batch of the room could not be fenced; the room is poisoned"
        );
    }
    inner.driver_finished(room, incarnation, poisoned);
}

/// Cancels every batch in `ids` at once and waits, bounded by one deadline `grace` from now,
/// until each cancel returned (no byte of the batch can land any more). Releases the pack
/// buffers of fenced hung batches; returns whether some batch could not be proven fenced.
async fn fence(
    transport: &Arc<dyn KvTransport>,
    room: u64,
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
                tracing::error!(room, batch = %id, error = %e, "cancel failed: the batch cannot be proven fenced");
                poisoned = true;
            }
            Ok(Some(Err(e))) => {
                tracing::error!(room, error = %e, "a cancel task died: its batch cannot be proven fenced");
                poisoned = true;
            }
            Err(_) => {
                tracing::error!(
                    room,
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

fn batch_failure(room: u64, endpoint: &Endpoint, aux: bool, e: &TransportError) -> FailureReason {
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
}
