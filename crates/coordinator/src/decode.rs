//! The decode (receiving) agent.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvbridge_handshake::{PeerDescriptor, PeerTarget, RankMapping, check_with};
use kvbridge_transport::KvTransport;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::{Span, field};

use crate::agreement::{LocalOnly, RankAgreement};
use crate::channel::{ControlChannel, Endpoint, Envelope};
use crate::config::DecodeConfig;
use crate::directory::PrefillDirectory;
use crate::error::{CoordinatorError, Result, Side};
use crate::memory::KvMemory;
use crate::messages::{
    AbortAck, AbortRequest, CONTROL_PROTOCOL_VERSION, ControlMessage, Heartbeat, Registration,
    RegistrationOutcome, RegistrationReply, StatusUpdate, TransferInfo, TransportInfo, WireProblem,
    render_problems,
};
use crate::metrics::{Metrics, MetricsSnapshot, inc};
use crate::outbox::{Outbox, send_failed_to};
use crate::room::admit_room;
use crate::start::{check_role, current_runtime};
use crate::state::{
    FailureCause, FailureReason, KvTransferError, RoomState, RoomStatus, wait_terminal,
};
use crate::timer::{TimerGuard, spawn_timer_on};

const SIDE: Side = Side::Decode;

/// What the decode scheduler asks for when it starts receiving a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveRequest {
    /// The prefill deployment's bootstrap address (resolved by the [`PrefillDirectory`]).
    pub bootstrap_addr: String,
    /// The request's decode page ids from token position 0, one per decode page (virtual pages
    /// of `page_size · dcp_size` tokens under DCP), covering at least the whole prompt. The
    /// planners take the send range instead (entry 0 at the cached prefix); the agent converts,
    /// and code planning by hand uses `kvbridge_geometry::SendPages::from_page_table`.
    pub page_table: Vec<u64>,
    /// Tokens of the prompt the decode already holds (its prefix cache hit).
    pub cached_prefix_len: u64,
    /// The decode's aux (metadata) row for this room (ignored without aux buffers).
    pub aux_index: u64,
}

/// Proof that a failed room's pages may be reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceReport {
    /// The room.
    pub room: u64,
    /// Prefill endpoints that acknowledged the abort (empty when the metadata was never sent,
    /// so no prefill knew the pages).
    pub acked_by: Vec<Endpoint>,
    /// Time spent waiting for the acknowledgements.
    pub waited: Duration,
}

/// Builder of a [`DecodeAgent`]; see [`DecodeAgent::builder`].
pub struct DecodeAgentBuilder {
    descriptor: PeerDescriptor,
    memory: KvMemory,
    transport: Arc<dyn KvTransport>,
    channel: Arc<dyn ControlChannel>,
    directory: Arc<dyn PrefillDirectory>,
    config: DecodeConfig,
    agreement: Arc<dyn RankAgreement>,
}

impl std::fmt::Debug for DecodeAgentBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeAgentBuilder")
            .field("descriptor", &self.descriptor)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl DecodeAgentBuilder {
    /// Sets the configuration (default [`DecodeConfig::default`]).
    #[must_use]
    pub fn config(mut self, config: DecodeConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets the cross-rank agreement hook (default [`LocalOnly`]).
    #[must_use]
    pub fn agreement(mut self, agreement: Arc<dyn RankAgreement>) -> Self {
        self.agreement = agreement;
        self
    }

    /// Validates the setup and starts the control loop and the heartbeat. Must be called
    /// inside a tokio runtime (with the time driver).
    ///
    /// # Errors
    /// [`CoordinatorError::InvalidSetup`] when the descriptor is not a decode's, its memory
    /// does not match it, or no tokio runtime is running.
    pub fn start(self) -> Result<DecodeAgent> {
        let d = &self.descriptor;
        check_role(d, kvbridge_handshake::Role::Decode, "DecodeAgent")?;
        if d.page_size == 0 || d.dcp_size == 0 {
            return Err(CoordinatorError::InvalidSetup {
                message: format!(
                    "page_size and dcp_size must be positive, got page_size={} dcp_size={}",
                    d.page_size, d.dcp_size
                ),
            });
        }
        self.memory.validate(d)?;
        let runtime = current_runtime("DecodeAgent")?;
        let endpoint = self.channel.local_endpoint();
        let session = kvbridge_auth::random_u64();
        let metrics = Arc::new(Metrics::default());
        let inner = Arc::new_cyclic(|weak: &Weak<DecodeInner>| {
            let outbox = Outbox::new(
                self.channel.clone(),
                self.config.control_send_timeout,
                self.config.control_queue,
                metrics.clone(),
                send_failed_to(weak.clone(), DecodeInner::on_send_failed),
            );
            DecodeInner {
                endpoint,
                session,
                config: self.config,
                descriptor: self.descriptor,
                memory: self.memory,
                transport: self.transport,
                channel: self.channel,
                directory: self.directory,
                outbox,
                metrics,
                agreement: self.agreement,
                state: Mutex::new(DecodeState::default()),
                next_generation: AtomicU64::new(1),
            }
        });
        let control = runtime.spawn(control_loop(inner.channel.clone(), Arc::downgrade(&inner)));
        let heartbeat = runtime.spawn(heartbeat_loop(
            Arc::downgrade(&inner),
            inner.config.heartbeat_interval,
        ));
        inner.with_state(|st| {
            st.tasks
                .extend([control.abort_handle(), heartbeat.abort_handle()])
        });
        tracing::info!(
            endpoint = %inner.endpoint,
            tp_rank = inner.descriptor.attn_tp_rank,
            dcp_rank = inner.descriptor.dcp_rank,
            transport = inner.transport.name(),
            "decode agent started"
        );
        Ok(DecodeAgent { inner })
    }
}

/// The receiving side of kvbridge: for each room, finds the prefill ranks that hold its KV,
/// registers with them once, tells them where to write (pages, prefix, aux row), and reports
/// Success once every required prefill rank delivered — or Failed with the first reason.
///
/// After a failure or abort, [`release_when_fenced`](Self::release_when_fenced) returns only
/// when no byte of the room can land any more, so the pages can be reused safely.
///
/// Cloning gives another handle to the same agent.
#[derive(Clone)]
pub struct DecodeAgent {
    inner: Arc<DecodeInner>,
}

impl std::fmt::Debug for DecodeAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeAgent")
            .field("endpoint", &self.inner.endpoint)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct Resolved {
    mapping: RankMapping,
    targets: Vec<(PeerTarget, Endpoint)>,
}

enum PeerConn {
    Registering {
        notify: watch::Sender<bool>,
        _expiry: TimerGuard,
    },
    Accepted {
        rank: u32,
    },
    Rejected(Vec<WireProblem>, Instant),
    Unreachable {
        reason: String,
        since: Instant,
    },
}

#[derive(Debug, Clone)]
struct RoomTarget {
    endpoint: Endpoint,
    rank: u32,
    dummy: bool,
}

struct DecodeRoom {
    status: RoomStatus,
    incarnation: u64,
    generation: u64,
    created_at: Instant,
    targets: Vec<RoomTarget>,
    required_responses: u32,
    successes: BTreeSet<u32>,
    metadata_sent: bool,
    abort_generation: Option<u64>,
    unacked: BTreeSet<Endpoint>,
    acked: Vec<Endpoint>,
    fenced: watch::Sender<bool>,
    waiting_timer: Option<TimerGuard>,
    span: Span,
}

#[derive(Default)]
struct Health {
    misses: u32,
    waiting: Option<u64>,
}

#[derive(Default)]
struct DecodeState {
    rooms: HashMap<u64, DecodeRoom>,
    peers: HashMap<Endpoint, PeerConn>,
    addrs: HashMap<String, Arc<Resolved>>,
    health: HashMap<Endpoint, Health>,
    next_incarnation: u64,
    next_nonce: u64,
    closed: bool,
    tasks: Vec<AbortHandle>,
}

pub(crate) struct DecodeInner {
    config: DecodeConfig,
    descriptor: PeerDescriptor,
    memory: KvMemory,
    transport: Arc<dyn KvTransport>,
    channel: Arc<dyn ControlChannel>,
    directory: Arc<dyn PrefillDirectory>,
    endpoint: Endpoint,
    session: u64,
    outbox: Outbox,
    metrics: Arc<Metrics>,
    agreement: Arc<dyn RankAgreement>,
    /// Only [`DecodeInner::with_state`] locks it.
    state: Mutex<DecodeState>,
    next_generation: AtomicU64,
}

impl Drop for DecodeInner {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for t in st.tasks.drain(..) {
            t.abort();
        }
    }
}

async fn control_loop(channel: Arc<dyn ControlChannel>, weak: Weak<DecodeInner>) {
    loop {
        let env = match channel.recv().await {
            Ok(env) => env,
            Err(e) => {
                tracing::info!(error = %e, "decode control loop stops");
                return;
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        inc(&inner.metrics.control_received);
        inner.handle(env);
    }
}

async fn heartbeat_loop(weak: Weak<DecodeInner>, interval: Duration) {
    let interval = interval.max(Duration::from_millis(1));
    let mut ticker = tokio::time::interval_at(Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(inner) = weak.upgrade() else { return };
        inner.heartbeat_tick();
    }
}

impl DecodeAgent {
    /// Starts building an agent from its descriptor, registered memory, transport, control
    /// channel and the directory that resolves bootstrap addresses.
    pub fn builder(
        descriptor: PeerDescriptor,
        memory: KvMemory,
        transport: Arc<dyn KvTransport>,
        channel: Arc<dyn ControlChannel>,
        directory: Arc<dyn PrefillDirectory>,
    ) -> DecodeAgentBuilder {
        DecodeAgentBuilder {
            descriptor,
            memory,
            transport,
            channel,
            directory,
            config: DecodeConfig::default(),
            agreement: Arc::new(LocalOnly),
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

    /// The virtual page size (`page_size · dcp_size`) prefixes are aligned to.
    pub fn virtual_page_size(&self) -> u64 {
        self.inner.virtual_page()
    }

    /// The prefix the agent advertises for a cached prefix of `cached_prefix_len` tokens:
    /// rounded down to the virtual page, unless strict alignment is on.
    pub fn advertised_prefix(&self, cached_prefix_len: u64) -> u64 {
        self.inner.advertised_prefix(cached_prefix_len)
    }

    /// Starts receiving a room: creates it (Bootstrapping), then in the background resolves
    /// the prefill ranks, registers with new ones, and sends them the metadata
    /// (WaitingForInput). The room ends in Success or Failed; await it with
    /// [`wait`](Self::wait).
    ///
    /// The prefix: by default a cached prefix that is not a multiple of the virtual page is
    /// rounded down and the tail is received again (logged); with
    /// [`DecodeConfig::strict_prefix_alignment`] it is advertised as is, and the prefill fails
    /// the room with `PD DCP transfer requires decode_prefix_len to align to the virtual DCP
    /// page size ({V}), got {L}`.
    ///
    /// # Errors
    /// [`CoordinatorError::DuplicateRoom`], [`CoordinatorError::Shutdown`],
    /// [`CoordinatorError::InvalidRequest`] (page table shorter than the prefix, `max_rooms`).
    pub fn receive(&self, room: u64, request: ReceiveRequest) -> Result<()> {
        self.inner.clone().receive(room, request)
    }

    /// The room's state on this rank.
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub fn poll(&self, room: u64) -> Result<RoomState> {
        self.inner.with_state(|st| {
            st.rooms
                .get(&room)
                .map(|r| r.status.state())
                .ok_or(CoordinatorError::UnknownRoom {
                    room: room.into(),
                    side: SIDE,
                })
        })
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
            .with_state(|st| st.rooms.get(&room).and_then(|r| r.status.error(room)))
    }

    /// Waits until the room is terminal: `Ok` on Success, its [`KvTransferError`] on Failed.
    ///
    /// # Errors
    /// [`CoordinatorError::Transfer`]; [`CoordinatorError::UnknownRoom`] (also when the room
    /// is cleared while waiting).
    pub async fn wait(&self, room: u64) -> Result<()> {
        let rx = self.inner.with_state(|st| {
            st.rooms
                .get(&room)
                .map(|r| r.status.subscribe())
                .ok_or(CoordinatorError::UnknownRoom {
                    room: room.into(),
                    side: SIDE,
                })
        })?;
        let state = wait_terminal(rx).await;
        self.inner.with_state(|st| {
            let r = st.rooms.get(&room).ok_or(CoordinatorError::UnknownRoom {
                room: room.into(),
                side: SIDE,
            })?;
            match state {
                Some(RoomState::Success) => Ok(()),
                _ => Err(r.status.failure_or_unknown(room, SIDE)),
            }
        })
    }

    /// Aborts the room (`Aborted by AbortReq.`) and tells its prefill peers (once), who
    /// acknowledge when nothing of the room can land any more.
    pub fn abort(&self, room: u64) {
        self.inner.fail_room(
            room,
            None,
            FailureReason::new(FailureCause::Aborted, "Aborted by AbortReq."),
        );
    }

    /// Whether a Failed room is fenced: every prefill peer acknowledged the abort (or none
    /// ever knew the pages).
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub fn is_fenced(&self, room: u64) -> Result<bool> {
        self.inner.with_state(|st| {
            st.rooms
                .get(&room)
                .map(|r| r.status.state() == RoomState::Failed && *r.fenced.borrow())
                .ok_or(CoordinatorError::UnknownRoom {
                    room: room.into(),
                    side: SIDE,
                })
        })
    }

    /// Waits until the room is terminal and, if it Failed, until no byte of it can land any
    /// more — every prefill peer that received its metadata acknowledged the abort — then
    /// forgets the room and returns; its pages may be reused from then on. Unacknowledged
    /// aborts are re-sent every [`DecodeConfig::abort_resend_interval`].
    ///
    /// # Errors
    /// [`CoordinatorError::NotFailed`] when the room ended in Success (the pages hold its KV);
    /// [`CoordinatorError::FenceTimeout`] after [`DecodeConfig::fence_timeout`] without every
    /// acknowledgement: the room is kept and its pages **must stay quarantined**;
    /// [`CoordinatorError::UnknownRoom`].
    pub async fn release_when_fenced(&self, room: u64) -> Result<FenceReport> {
        self.inner.release_when_fenced(room).await
    }

    /// Forgets a room. Prefer [`release_when_fenced`](Self::release_when_fenced) for a Failed
    /// room: clearing an unfenced room gives up the proof that its pages are safe.
    pub fn clear(&self, room: u64) {
        let removed = self.inner.with_state(|st| st.rooms.remove(&room));
        if let Some(r) = removed {
            if r.status.state() == RoomState::Failed && !*r.fenced.borrow() {
                tracing::warn!(parent: &r.span, "cleared a failed room before it was fenced: its pages may still receive bytes");
            }
            self.inner.agreement.forget(room);
        }
    }

    /// A snapshot of this agent's metrics.
    pub fn metrics(&self) -> MetricsSnapshot {
        let states: Vec<RoomState> = self
            .inner
            .with_state(|st| st.rooms.values().map(|r| r.status.state()).collect());
        let by_state = Metrics::count_states(states.into_iter());
        self.inner.metrics.snapshot(by_state)
    }

    /// Rooms currently held.
    pub fn room_count(&self) -> usize {
        self.inner.with_state(|st| st.rooms.len())
    }

    /// Prefill endpoints this rank is registered with.
    pub fn registered_peers(&self) -> Vec<Endpoint> {
        let mut v: Vec<Endpoint> = self.inner.with_state(|st| {
            st.peers
                .iter()
                .filter(|(_, c)| matches!(c, PeerConn::Accepted { .. }))
                .map(|(e, _)| e.clone())
                .collect()
        });
        v.sort();
        v
    }

    /// Stops the agent: every room that is not terminal fails (and aborts its peers), the
    /// control loop and heartbeat stop.
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
                    format!("the decode agent at {} shut down", self.inner.endpoint),
                ),
            );
        }
        let tasks = self.inner.with_state(|st| std::mem::take(&mut st.tasks));
        for t in tasks {
            t.abort();
        }
    }
}

impl DecodeInner {
    /// Runs `f` on the agent's state under its lock; the only place that takes it. `f` gets
    /// the state, not the agent, and its result cannot borrow the guard, so the lock is
    /// released before the caller does anything else (a std mutex is not re-entrant: calling
    /// back into the agent under it would park the thread forever).
    fn with_state<R>(&self, f: impl FnOnce(&mut DecodeState) -> R) -> R {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut st)
    }

    fn timer(
        self: &Arc<Self>,
        delay: Duration,
        f: impl FnOnce(&DecodeInner) + Send + 'static,
    ) -> TimerGuard {
        spawn_timer_on(Arc::downgrade(self), delay, f)
    }

    fn virtual_page(&self) -> u64 {
        self.descriptor.page_size * u64::from(self.descriptor.dcp_size.max(1))
    }

    fn advertised_prefix(&self, cached: u64) -> u64 {
        if self.config.strict_prefix_alignment {
            cached
        } else {
            let v = self.virtual_page();
            cached - cached % v
        }
    }

    fn next_generation(&self) -> u64 {
        self.next_generation.fetch_add(1, Ordering::Relaxed)
    }

    fn handle(self: &Arc<Self>, env: Envelope) {
        match env.message {
            ControlMessage::RegisterReply(r) => self.on_register_reply(r),
            ControlMessage::Status(s) => self.on_status(&env.from, s),
            ControlMessage::AbortAck(a) => self.on_abort_ack(a),
            ControlMessage::Pong(h) => self.on_pong(&env.from, h),
            ControlMessage::Ping(h) => self.outbox.send(&env.from, ControlMessage::Pong(h)),
            other => tracing::debug!(
                from = %env.from,
                kind = other.kind(),
                "decode ignores a message meant for a prefill"
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
        tracing::warn!(peer = %to, kind, room, error = %err, "decode could not deliver a control message");
        match kind {
            "register" => self.with_state(|st| {
                if let Some(PeerConn::Registering { notify: tx, .. }) = st.peers.get(to) {
                    let tx = tx.clone();
                    st.peers.insert(
                        to.clone(),
                        PeerConn::Unreachable {
                            reason: format!("_register_kv_args to prefill {to} failed: {err}"),
                            since: Instant::now(),
                        },
                    );
                    tx.send_replace(true);
                }
            }),
            "transfer_info" => {
                if let Some(room) = room {
                    self.fail_room(
                        room,
                        None,
                        FailureReason::with_peer(
                            FailureCause::ControlChannel,
                            to,
                            format!("send_metadata to prefill {to} failed: {err}"),
                        ),
                    );
                }
            }
            _ => {}
        }
    }

    fn receive(self: Arc<Self>, room: u64, req: ReceiveRequest) -> Result<()> {
        let v = self.virtual_page();
        let cached = req.cached_prefix_len;
        let prefix = self.advertised_prefix(cached);
        let first_page = usize::try_from(prefix / v).unwrap_or(usize::MAX);
        if first_page > req.page_table.len() {
            return Err(CoordinatorError::InvalidRequest {
                what: "page_table",
                message: format!(
                    "the page table has {} pages of {v} tokens but the prefix to keep is {prefix} \
                     tokens; pass the request's pages from token position 0",
                    req.page_table.len()
                ),
            });
        }
        for (j, (e, &item)) in self
            .memory
            .aux
            .iter()
            .zip(&self.descriptor.aux_item_lens)
            .enumerate()
        {
            let fits = req
                .aux_index
                .checked_add(1)
                .and_then(|n| n.checked_mul(item))
                .is_some_and(|end| end <= e.len);
            if !fits {
                return Err(CoordinatorError::InvalidRequest {
                    what: "aux_index",
                    message: format!(
                        "aux_index {} is outside aux buffer {j} ({} rows of {item} bytes)",
                        req.aux_index,
                        e.len / item.max(1)
                    ),
                });
            }
        }
        let span = tracing::info_span!(
            parent: None,
            "kv_room",
            side = SIDE.as_str(),
            room,
            peer = %req.bootstrap_addr,
            bytes = field::Empty,
            duration_ms = field::Empty
        );
        if prefix != cached {
            tracing::info!(
                parent: &span,
                cached_prefix_len = cached,
                advertised = prefix,
                virtual_page = v,
                "decode prefix {cached} is not a multiple of the virtual page {v}: advertising \
                 {prefix} and receiving the last {} cached tokens again",
                cached - prefix
            );
        } else if cached % v != 0 {
            tracing::warn!(
                parent: &span,
                cached_prefix_len = cached,
                virtual_page = v,
                "strict prefix alignment: advertising a prefix that is not a multiple of the \
                 virtual page; the prefill will refuse the room"
            );
        }
        let generation = self.next_generation();
        let max_rooms = self.config.max_rooms;
        let incarnation = self.with_state(|st| {
            admit_room(
                SIDE,
                room.into(),
                st.closed,
                st.rooms.get(&room).map(|r| r.status.state()),
                st.rooms.len(),
                max_rooms,
                "release finished rooms or raise DecodeConfig::max_rooms",
            )?;
            st.next_incarnation += 1;
            let incarnation = st.next_incarnation;
            st.rooms.insert(
                room,
                DecodeRoom {
                    status: RoomStatus::new(RoomState::Bootstrapping),
                    incarnation,
                    generation,
                    created_at: Instant::now(),
                    targets: Vec::new(),
                    required_responses: 0,
                    successes: BTreeSet::new(),
                    metadata_sent: false,
                    abort_generation: None,
                    unacked: BTreeSet::new(),
                    acked: Vec::new(),
                    fenced: watch::Sender::new(false),
                    waiting_timer: None,
                    span: span.clone(),
                },
            );
            Ok::<_, CoordinatorError>(incarnation)
        })?;
        inc(&self.metrics.rooms_created);
        let dst_pages = req.page_table[first_page..].to_vec();
        let me = self.clone();
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                me.bootstrap_room(
                    room,
                    incarnation,
                    req.bootstrap_addr,
                    dst_pages,
                    prefix,
                    req.aux_index,
                )
                .await;
            },
            span,
        ));
        Ok(())
    }

    async fn bootstrap_room(
        self: Arc<Self>,
        room: u64,
        incarnation: u64,
        addr: String,
        dst_pages: Vec<u64>,
        prefix: u64,
        aux_index: u64,
    ) {
        let timeout = self.config.bootstrap_timeout;
        // The peers not registered yet, named if the bootstrap times out.
        let pending: Arc<watch::Sender<Vec<Endpoint>>> = Arc::new(watch::Sender::new(Vec::new()));
        let handshake = {
            let me = self.clone();
            let addr = addr.clone();
            let pending = pending.clone();
            async move {
                let resolved = me.resolve(&addr).await?;
                pending.send_replace(resolved.targets.iter().map(|(_, e)| e.clone()).collect());
                // Kick every registration first, then wait for each (they run concurrently).
                let mut ranks = Vec::with_capacity(resolved.targets.len());
                let receivers: Vec<_> = resolved
                    .targets
                    .iter()
                    .map(|(_, e)| (e.clone(), me.start_registration(e)))
                    .collect();
                for (endpoint, rx) in receivers {
                    let rank = me.await_registration(&endpoint, rx).await?;
                    pending.send_modify(|p| p.retain(|p| p != &endpoint));
                    ranks.push(rank);
                }
                Ok::<_, FailureReason>((resolved, ranks))
            }
        };
        match tokio::time::timeout(timeout, handshake).await {
            Ok(Ok((resolved, ranks))) => self.send_metadata(
                room,
                incarnation,
                &resolved,
                &ranks,
                dst_pages,
                prefix,
                aux_index,
            ),
            Ok(Err(reason)) => self.fail_room(room, Some(incarnation), reason),
            Err(_) => {
                let waiting: Vec<String> = pending.borrow().iter().map(|e| e.to_string()).collect();
                let what = if waiting.is_empty() {
                    format!("the directory lookup of {addr}")
                } else {
                    format!("registration with {}", waiting.join(", "))
                };
                self.fail_room(
                    room,
                    Some(incarnation),
                    FailureReason::with_peer(
                        FailureCause::BootstrapTimeout,
                        waiting.first().cloned().unwrap_or_else(|| addr.clone()),
                        format!(
                            "Prefill bootstrap failed: {what} did not finish within {:.1}s \
                             (bootstrap_addr: {addr})",
                            timeout.as_secs_f64()
                        ),
                    ),
                );
            }
        }
    }

    /// Resolves a bootstrap address to the rank mapping and the peers' endpoints (cached).
    async fn resolve(&self, addr: &str) -> std::result::Result<Arc<Resolved>, FailureReason> {
        if let Some(r) = self.with_state(|st| st.addrs.get(addr).cloned()) {
            return Ok(r);
        }
        let ranks = self.directory.prefill_ranks(addr).await.map_err(|e| {
            FailureReason::with_peer(FailureCause::BootstrapTimeout, addr, e.to_string())
        })?;
        let Some(first) = ranks.first() else {
            return Err(FailureReason::with_peer(
                FailureCause::BootstrapTimeout,
                addr,
                format!("Could not fetch prefill parallel info from bootstrap_addr: {addr}"),
            ));
        };
        // Decode-side checks (spec 02 §3) before talking to anyone: fail fast with every problem.
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
            match found {
                Some(r) => targets.push((t.clone(), r.endpoint.clone())),
                None => {
                    return Err(FailureReason::with_peer(
                        FailureCause::BootstrapTimeout,
                        addr,
                        format!(
                            "Could not fetch bootstrap info for: prefill_dp_rank: 0 \
                             prefill_cp_rank: {} target_tp_rank: {} and target_pp_rank {}",
                            t.cp_rank, t.tp_rank, t.pp_rank
                        ),
                    ));
                }
            }
        }
        let resolved = Arc::new(Resolved { mapping, targets });
        self.with_state(|st| st.addrs.insert(addr.to_owned(), resolved.clone()));
        Ok(resolved)
    }

    /// Sends a registration to `endpoint` unless one is done or in progress; returns a
    /// receiver that flips when an outcome is known.
    fn start_registration(self: &Arc<Self>, endpoint: &Endpoint) -> watch::Receiver<bool> {
        // A registration that is never answered is forgotten so a later room can retry.
        let e = endpoint.clone();
        let timer = self.timer(self.config.bootstrap_timeout, move |inner| {
            inner.registration_expired(&e)
        });
        let remember = self.config.heartbeat_interval;
        let started = self.with_state(|st| {
            match st.peers.get(endpoint) {
                Some(PeerConn::Registering { notify: tx, .. }) => return Err(tx.subscribe()),
                Some(PeerConn::Accepted { .. }) => return Err(watch::Sender::new(true).subscribe()),
                // A refusal or an unreachable peer is remembered for a heartbeat interval (rooms
                // fail at once), then asked again: the prefill may have been fixed and restarted.
                Some(PeerConn::Rejected(_, since) | PeerConn::Unreachable { since, .. })
                    if since.elapsed() < remember =>
                {
                    return Err(watch::Sender::new(true).subscribe());
                }
                _ => {}
            }
            let (tx, rx) = watch::channel(false);
            st.peers.insert(
                endpoint.clone(),
                PeerConn::Registering {
                    notify: tx,
                    _expiry: timer,
                },
            );
            Ok(rx)
        });
        let rx = match started {
            Ok(rx) => rx,
            Err(known) => return known,
        };
        let reg = Registration {
            protocol: CONTROL_PROTOCOL_VERSION,
            decode_endpoint: self.endpoint.clone(),
            session: self.session.into(),
            descriptor: self.descriptor.clone(),
            transport: TransportInfo {
                name: self.transport.name().to_owned(),
                descriptor: self.transport.local_descriptor().to_vec(),
            },
            kv_regions: self.memory.kv.iter().map(|e| e.to_wire()).collect(),
            aux_regions: self.memory.aux.iter().map(|e| e.to_wire()).collect(),
        };
        self.outbox.send(endpoint, ControlMessage::Register(reg));
        rx
    }

    fn registration_expired(&self, endpoint: &Endpoint) {
        self.with_state(|st| {
            if let Some(PeerConn::Registering { notify: tx, .. }) = st.peers.get(endpoint) {
                tx.send_replace(true);
                st.peers.remove(endpoint);
            }
        });
    }

    async fn await_registration(
        self: &Arc<Self>,
        endpoint: &Endpoint,
        mut rx: watch::Receiver<bool>,
    ) -> std::result::Result<u32, FailureReason> {
        enum Next {
            Done(std::result::Result<u32, FailureReason>),
            Wait(watch::Receiver<bool>),
            Retry,
        }
        loop {
            if *rx.borrow_and_update() {
                let next = self.with_state(|st| match st.peers.get(endpoint) {
                    Some(PeerConn::Accepted { rank }) => Next::Done(Ok(*rank)),
                    Some(PeerConn::Rejected(problems, _)) => {
                        Next::Done(Err(FailureReason::with_peer(
                            FailureCause::PeerRejected,
                            endpoint,
                            render_problems(problems),
                        )))
                    }
                    Some(PeerConn::Unreachable { reason, .. }) => {
                        Next::Done(Err(FailureReason::with_peer(
                            FailureCause::ControlChannel,
                            endpoint,
                            reason.clone(),
                        )))
                    }
                    Some(PeerConn::Registering { notify: tx, .. }) => Next::Wait(tx.subscribe()),
                    None => Next::Retry,
                });
                match next {
                    Next::Done(r) => return r,
                    Next::Wait(r) => {
                        rx = r;
                        continue;
                    }
                    Next::Retry => {
                        rx = self.start_registration(endpoint);
                        if *rx.borrow() {
                            // Do not spin on a peer that cannot be reached right now.
                            tokio::time::sleep(self.config.heartbeat_interval).await;
                        }
                        continue;
                    }
                }
            }
            if rx.changed().await.is_err() {
                // The registration entry was replaced; look again.
                rx = watch::Sender::new(true).subscribe();
            }
        }
    }

    fn on_register_reply(&self, r: RegistrationReply) {
        if r.session.get() != self.session {
            tracing::debug!(prefill = %r.prefill_endpoint, "registration reply for an old session ignored");
            return;
        }
        let rejected = self.with_state(|st| {
        let conn = match r.result {
            RegistrationOutcome::Accepted { descriptor } => {
                tracing::info!(prefill = %r.prefill_endpoint, rank = r.prefill_rank, tp_rank = descriptor.attn_tp_rank, "registered with prefill rank");
                st.health
                    .insert(r.prefill_endpoint.clone(), Health::default());
                PeerConn::Accepted {
                    rank: r.prefill_rank,
                }
            }
            RegistrationOutcome::Rejected { problems } => {
                tracing::warn!(prefill = %r.prefill_endpoint, problems = %render_problems(&problems), "the prefill refused this decode rank");
                PeerConn::Rejected(problems, Instant::now())
            }
        };
        let rejected = match &conn {
            PeerConn::Rejected(problems, _) => Some(problems.clone()),
            _ => None,
        };
        if let Some(PeerConn::Registering { notify: tx, .. }) =
            st.peers.insert(r.prefill_endpoint.clone(), conn)
        {
            tx.send_replace(true);
        }
        rejected
        });
        if let Some(problems) = rejected {
            // Rooms already waiting on this peer fail at once with its problems.
            self.fail_rooms_of(
                &r.prefill_endpoint,
                FailureReason::with_peer(
                    FailureCause::PeerRejected,
                    &r.prefill_endpoint,
                    render_problems(&problems),
                ),
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn send_metadata(
        self: &Arc<Self>,
        room: u64,
        incarnation: u64,
        resolved: &Resolved,
        ranks: &[u32],
        dst_pages: Vec<u64>,
        prefix: u64,
        aux_index: u64,
    ) {
        let timeout = self.config.waiting_timeout;
        let timer = self.timer(timeout, move |inner| {
            inner.on_waiting_timeout(room, incarnation)
        });
        self.with_state(|st| {
        let Some(r) = st
            .rooms
            .get_mut(&room)
            .filter(|r| r.incarnation == incarnation)
        else {
            return;
        };
        if r.status.state() != RoomState::Bootstrapping {
            return;
        }
        let has_aux = !self.memory.aux.is_empty();
        r.targets = resolved
            .targets
            .iter()
            .zip(ranks)
            .map(|((t, e), &rank)| RoomTarget {
                endpoint: e.clone(),
                rank,
                dummy: t.is_dummy,
            })
            .collect();
        r.required_responses = resolved.mapping.required_prefill_response_num;
        for ((t, endpoint), _) in resolved.targets.iter().zip(ranks) {
            let info = TransferInfo {
                room: room.into(),
                generation: r.generation.into(),
                decode_endpoint: self.endpoint.clone(),
                session: self.session.into(),
                dst_pages: if t.is_dummy {
                    Vec::new()
                } else {
                    dst_pages.clone()
                },
                dst_aux_index: (!t.is_dummy && has_aux).then_some(aux_index),
                is_dummy: t.is_dummy,
                required_dst_info_num: t.required_dst_info_num,
                decode_prefix_len: prefix,
            };
            self.outbox
                .send(endpoint, ControlMessage::TransferInfo(info));
        }
        r.metadata_sent = true;
        r.status.update(RoomState::WaitingForInput);
        tracing::debug!(parent: &r.span, peers = r.targets.len(), required = r.required_responses, prefix, pages = dst_pages.len(), "metadata sent");
        r.waiting_timer = Some(timer);
        });
    }

    fn on_waiting_timeout(&self, room: u64, incarnation: u64) {
        // The peers that have not reported Success are the ones named.
        let silent = self.with_state(|st| {
            st.rooms.get(&room).and_then(|r| {
                (r.incarnation == incarnation && !r.status.state().is_terminal()).then(|| {
                    r.targets
                        .iter()
                        .filter(|t| !t.dummy && !r.successes.contains(&t.rank))
                        .map(|t| t.endpoint.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                })
            })
        });
        if let Some(silent) = silent {
            self.fail_room(
                room,
                Some(incarnation),
                FailureReason::with_peer(
                    FailureCause::WaitingTimeout,
                    silent,
                    format!(
                        "Request {room} timed out after {:.1}s in KVPoll.WaitingForInput",
                        self.config.waiting_timeout.as_secs_f64()
                    ),
                ),
            );
        }
    }

    fn on_status(&self, from: &Endpoint, s: StatusUpdate) {
        let room = s.room.get();
        let failed = self.with_state(|st| {
        let Some(r) = st.rooms.get_mut(&room) else {
            tracing::debug!(room, from = %from, "status for a room this decode does not hold: dropped");
            return None;
        };
        if s.generation.get() != r.generation {
            tracing::debug!(room, from = %from, "status for an earlier use of the room: dropped");
            return None;
        }
        let Some(target) = r.targets.iter().find(|t| t.rank == s.prefill_rank).cloned() else {
            tracing::warn!(parent: &r.span, rank = s.prefill_rank, from = %from, "status from a prefill rank that is not a peer of this room: dropped");
            return None;
        };
        match s.state {
            RoomState::Success => {
                if target.dummy {
                    tracing::warn!(parent: &r.span, rank = s.prefill_rank, "Success from a dummy prefill rank ignored");
                    return None;
                }
                r.successes.insert(s.prefill_rank);
                if r.successes.len() as u32 >= r.required_responses.max(1)
                    && r.status.state() != RoomState::Failed
                    && r.status.update(RoomState::Success)
                {
                    r.waiting_timer = None;
                    let elapsed = r.created_at.elapsed();
                    self.metrics.succeeded(elapsed);
                    r.span.record("duration_ms", elapsed.as_millis() as u64);
                    tracing::info!(parent: &r.span, duration_ms = elapsed.as_millis() as u64, responses = r.successes.len(), "room received");
                }
            }
            RoomState::Failed => {
                if s.cause == Some(FailureCause::Unregistered) {
                    // The prefill lost our registration (it restarted): register again next time.
                    st.peers.remove(&target.endpoint);
                    st.health.remove(&target.endpoint);
                    tracing::warn!(prefill = %target.endpoint, "the prefill does not know this decode any more; it will register again");
                }
                let r = st.rooms.get_mut(&room)?;
                if r.status.state() == RoomState::Success {
                    tracing::warn!(parent: &r.span, rank = s.prefill_rank, "Failed status after Success ignored");
                    return None;
                }
                let message = s.reason.clone().filter(|m| !m.is_empty()).unwrap_or_else(|| {
                    "Failed to get kvcache from prefill instance, it might be dead".to_owned()
                });
                // The prefill's own abort is `aborted` there and a remote failure here, as a
                // decode abort is on the prefill (docs/errors.md, "Abort causes").
                let (cause, message) = match s.cause {
                    Some(FailureCause::Aborted) => (
                        FailureCause::RemoteFailure,
                        format!("Aborted by prefill {}: {message}", target.endpoint),
                    ),
                    None => (FailureCause::RemoteFailure, message),
                    Some(c) => (c, message),
                };
                return Some(FailureReason::with_peer(
                    cause,
                    &target.endpoint,
                    message,
                ));
            }
            other => tracing::debug!(
                parent: &r.span,
                "Ignoring non-terminal status {other} for room {room} from prefill rank {}",
                s.prefill_rank
            ),
        }
        None
        });
        if let Some(reason) = failed {
            self.fail_room(room, None, reason);
        }
    }

    fn fail_rooms_of(&self, endpoint: &Endpoint, reason: FailureReason) {
        let rooms: Vec<u64> = self.with_state(|st| {
            st.rooms
                .iter()
                .filter(|(_, r)| {
                    r.status.state() != RoomState::Success
                        && r.targets.iter().any(|t| &t.endpoint == endpoint)
                })
                .map(|(&k, _)| k)
                .collect()
        });
        for room in rooms {
            self.fail_room(room, None, reason.clone());
        }
    }

    /// Fails a room (first reason wins). If its metadata went out, arms a new abort generation
    /// and sends ABORT to every peer that got it; otherwise the room is fenced at once.
    fn fail_room(&self, room: u64, incarnation: Option<u64>, reason: FailureReason) {
        self.with_state(|st| {
        let Some(r) = st.rooms.get_mut(&room) else {
            return;
        };
        if incarnation.is_some_and(|i| i != r.incarnation) {
            return;
        }
        if !r.status.fail(reason.clone()) {
            return;
        }
        r.waiting_timer = None;
        self.metrics.failed(reason.cause);
        tracing::warn!(parent: &r.span, cause = %reason.cause, peer = reason.peer.as_deref(), reason = %reason.message, "room failed");
        if r.metadata_sent {
            let generation = self.next_generation();
            r.abort_generation = Some(generation);
            r.unacked = r.targets.iter().map(|t| t.endpoint.clone()).collect();
            self.send_aborts(room, generation, &r.unacked, &reason.message);
            if r.unacked.is_empty() {
                r.fenced.send_replace(true);
            }
        } else {
            r.fenced.send_replace(true);
        }
        });
    }

    fn on_abort_ack(&self, a: AbortAck) {
        self.with_state(|st| {
        let Some(r) = st.rooms.get_mut(&a.room.get()) else {
            return;
        };
        if r.abort_generation != Some(a.generation.get()) {
            tracing::debug!(parent: &r.span, generation = a.generation.get(), "abort-ack for another generation ignored");
            return;
        }
        if r.unacked.remove(&a.prefill_endpoint) {
            r.acked.push(a.prefill_endpoint.clone());
            if r.unacked.is_empty() && !*r.fenced.borrow() {
                r.fenced.send_replace(true);
                inc(&self.metrics.rooms_fenced);
                tracing::info!(parent: &r.span, acks = r.acked.len(), "room fenced: every sender acknowledged the abort");
            }
        }
        });
    }

    async fn release_when_fenced(&self, room: u64) -> Result<FenceReport> {
        let (state_rx, mut fenced_rx) = self.with_state(|st| {
            st.rooms
                .get(&room)
                .map(|r| (r.status.subscribe(), r.fenced.subscribe()))
                .ok_or(CoordinatorError::UnknownRoom {
                    room: room.into(),
                    side: SIDE,
                })
        })?;
        if wait_terminal(state_rx).await != Some(RoomState::Failed) {
            return self.with_state(|st| match st.rooms.get(&room) {
                Some(r) if r.status.state() == RoomState::Success => {
                    Err(CoordinatorError::NotFailed { room: room.into() })
                }
                _ => Err(CoordinatorError::UnknownRoom {
                    room: room.into(),
                    side: SIDE,
                }),
            });
        }
        let started = Instant::now();
        let deadline = started + self.config.fence_timeout;
        let resend = self
            .config
            .abort_resend_interval
            .max(Duration::from_millis(1));
        loop {
            if *fenced_rx.borrow_and_update() {
                break;
            }
            tokio::select! {
                changed = fenced_rx.changed() => {
                    if changed.is_err() {
                        return Err(CoordinatorError::UnknownRoom {
                    room: room.into(),
                    side: SIDE,
                });
                    }
                }
                _ = tokio::time::sleep(resend) => self.resend_aborts(room),
                _ = tokio::time::sleep_until(deadline) => {
                    let pending = self.with_state(|st| {
                        st.rooms
                            .get(&room)
                            .map(|r| r.unacked.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", "))
                            .unwrap_or_default()
                    });
                    return Err(CoordinatorError::FenceTimeout {
                        room: room.into(),
                        waited: self.config.fence_timeout,
                        pending,
                    });
                }
            }
        }
        let removed = self.with_state(|st| st.rooms.remove(&room));
        self.agreement.forget(room);
        let acked_by = removed.map(|r| r.acked).unwrap_or_default();
        Ok(FenceReport {
            room,
            acked_by,
            waited: started.elapsed(),
        })
    }

    /// Queues an ABORT of `room` (this abort generation) to each of `to` (the outbox never
    /// waits, and takes no lock of the agent).
    fn send_aborts(&self, room: u64, generation: u64, to: &BTreeSet<Endpoint>, reason: &str) {
        for e in to {
            self.outbox.send(
                e,
                ControlMessage::Abort(AbortRequest {
                    room: room.into(),
                    generation: generation.into(),
                    decode_endpoint: self.endpoint.clone(),
                    reason: reason.to_owned(),
                }),
            );
        }
    }

    fn resend_aborts(&self, room: u64) {
        self.with_state(|st| {
            let Some(r) = st.rooms.get(&room) else { return };
            let (Some(generation), Some(reason)) = (r.abort_generation, r.status.reason()) else {
                return;
            };
            self.send_aborts(room, generation, &r.unacked, &reason.message);
        });
    }

    fn heartbeat_tick(&self) {
        let max_failures = self.config.heartbeat_max_failures.max(1);
        let lost = self.with_state(|st| {
            let mut lost = Vec::new();
            let accepted: Vec<Endpoint> = st
                .peers
                .iter()
                .filter(|(_, c)| matches!(c, PeerConn::Accepted { .. }))
                .map(|(e, _)| e.clone())
                .collect();
            for e in accepted {
                st.next_nonce += 1;
                let nonce = st.next_nonce;
                let h = st.health.entry(e.clone()).or_default();
                if h.waiting.is_some() {
                    h.misses += 1;
                }
                if h.misses >= max_failures {
                    lost.push((e, h.misses));
                } else {
                    h.waiting = Some(nonce);
                    self.outbox
                        .send(&e, ControlMessage::Ping(Heartbeat { nonce }));
                }
            }
            lost
        });
        for (e, misses) in lost {
            self.peer_lost(&e, misses);
        }
    }

    fn on_pong(&self, from: &Endpoint, h: Heartbeat) {
        // Nonces are unique per agent, so the answer is matched by nonce, not by `from`.
        self.with_state(|st| {
            match st.health.values_mut().find(|x| x.waiting == Some(h.nonce)) {
                Some(health) => {
                    health.waiting = None;
                    health.misses = 0;
                }
                None => {
                    tracing::debug!(from = %from, nonce = h.nonce, "late or unknown heartbeat answer")
                }
            }
        });
    }

    /// A prefill peer stopped answering: forget it (a later room registers again) and fail
    /// every room that depends on it and has not succeeded.
    fn peer_lost(&self, endpoint: &Endpoint, misses: u32) {
        let addrs: Vec<String> = self.with_state(|st| {
            st.peers.remove(endpoint);
            st.health.remove(endpoint);
            let addrs: Vec<String> = st
                .addrs
                .iter()
                .filter(|(_, r)| r.targets.iter().any(|(_, e)| e == endpoint))
                .map(|(a, _)| a.clone())
                .collect();
            for a in &addrs {
                st.addrs.remove(a);
            }
            addrs
        });
        self.outbox.forget(endpoint);
        let addr = addrs
            .first()
            .cloned()
            .unwrap_or_else(|| endpoint.to_string());
        tracing::warn!(prefill = %endpoint, misses, "prefill peer stopped answering heartbeats");
        self.fail_rooms_of(
            endpoint,
            FailureReason::with_peer(
                FailureCause::PeerLost,
                endpoint,
                format!(
                    "Lost connection with prefill instance (bootstrap_addr: {addr}): {endpoint} \
                     did not answer {misses} consecutive heartbeats"
                ),
            ),
        );
    }
}
