//! The decode (receiving) agent: the async driver of the decode room machine
//! ([`kvbridge_machines::decode`], docs/lifecycle.md "Decode side").
//!
//! The machine holds every rule; this file feeds it control messages, directory answers,
//! failed sends and timer ticks (one timer task sleeping until
//! [`DecodeMachine::poll_timeout`]), and carries out its actions: queue a control message,
//! ask the directory, wake the waiters of a room.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvbridge_handshake::PeerDescriptor;
use kvbridge_transport::KvTransport;
use kvbridge_transport::sync::lock;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{Span, field};

use crate::agreement::{LocalOnly, RankAgreement};
use crate::channel::{ControlChannel, Endpoint, Envelope};
use crate::directory::PrefillDirectory;
use crate::error::{CoordinatorError, Result, Side};
use crate::ids::{Incarnation, RoomId, SessionId};
use crate::memory::KvMemory;
use crate::messages::{
    CONTROL_PROTOCOL_VERSION, ControlMessage, Registration, StatusUpdate, TransferInfo,
    TransportInfo,
};
use crate::metrics::{Metrics, MetricsSnapshot, inc};
use crate::outbox::{Outbox, send_failed_to};
use crate::shell::{Driver, Tasks};
use crate::start::{check_role, current_runtime};
use crate::state::{FailureCause, FailureReason, KvTransferError, RoomState, wait_terminal};
use crate::trace;
use kvbridge_control::TraceParent;
use kvbridge_machines::DecodeConfig;
use kvbridge_machines::decode::{Action, DecodeMachine, Event, RoomRequest};

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
    pub room: RoomId,
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

    /// Validates the setup and starts the control loop and the timer. Must be called inside a
    /// tokio runtime (with the time driver).
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
        let session = SessionId::from(kvbridge_auth::random_u64());
        let registration = Registration {
            protocol: CONTROL_PROTOCOL_VERSION,
            decode_endpoint: endpoint.clone(),
            session,
            descriptor: self.descriptor.clone(),
            transport: TransportInfo {
                name: self.transport.name().to_owned(),
                descriptor: self.transport.local_descriptor().to_vec(),
            },
            kv_regions: self.memory.kv.iter().map(|e| e.to_wire()).collect(),
            aux_regions: self.memory.aux.iter().map(|e| e.to_wire()).collect(),
        };
        let machine = DecodeMachine::new(
            self.config.clone(),
            registration,
            !self.memory.aux.is_empty(),
            Instant::now().into_std(),
        );
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
                config: self.config,
                descriptor: self.descriptor,
                memory: self.memory,
                transport: self.transport,
                directory: self.directory,
                outbox,
                metrics,
                agreement: self.agreement,
                core: Mutex::new(Core {
                    machine,
                    rooms: HashMap::new(),
                    timer_at: None,
                    tasks: Tasks::default(),
                }),
                wake: Arc::new(Notify::new()),
                me: weak.clone(),
            }
        });
        let tasks = Tasks::start(&runtime, &inner, self.channel, inner.wake.clone());
        inner.with_core(|c| c.tasks = tasks);
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

/// What waiters of one room watch, beside the machine's own record.
struct RoomSignals {
    state: watch::Sender<RoomState>,
    fence: watch::Sender<FenceSignal>,
    span: Span,
    /// `kv_bootstrap`: from `receive` until the metadata is sent (resolve, registration).
    bootstrap: Span,
    /// `kv_receive` per prefill rank sent the metadata, until its status or the room's end.
    ranks: Vec<(Endpoint, Span)>,
}

/// The fence as `release_when_fenced` sees it.
#[derive(Debug, Clone, Default)]
struct FenceSignal {
    fenced: bool,
    /// Fence deadlines passed so far (a waiter counts only those after it started).
    timeouts: u64,
    waited: Duration,
    pending: String,
}

/// The machine and the signals of its rooms, under one lock.
struct Core {
    machine: DecodeMachine,
    rooms: HashMap<RoomId, RoomSignals>,
    /// What the timer task sleeps until.
    timer_at: Option<std::time::Instant>,
    tasks: Tasks,
}

pub(crate) struct DecodeInner {
    config: DecodeConfig,
    descriptor: PeerDescriptor,
    memory: KvMemory,
    transport: Arc<dyn KvTransport>,
    directory: Arc<dyn PrefillDirectory>,
    endpoint: Endpoint,
    outbox: Outbox,
    metrics: Arc<Metrics>,
    agreement: Arc<dyn RankAgreement>,
    /// Only [`DecodeInner::with_core`] locks it.
    core: Mutex<Core>,
    /// Wakes the timer task when the machine's next deadline moved earlier.
    wake: Arc<Notify>,
    /// This agent, for the tasks it spawns.
    me: Weak<DecodeInner>,
}

impl Driver for DecodeInner {
    const SIDE: Side = SIDE;

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn hear(self: Arc<Self>, env: Envelope) -> impl Future<Output = ()> + Send {
        self.with_core(|c| {
            if let ControlMessage::Status(s) = &env.message {
                rank_status(c, &env.from, s);
            }
            self.run(
                c,
                Event::Control {
                    from: env.from,
                    message: env.message,
                },
            );
        });
        std::future::ready(())
    }

    fn next_tick(&self) -> Option<std::time::Instant> {
        self.with_core(|c| {
            c.timer_at = c.machine.poll_timeout();
            c.timer_at
        })
    }

    fn tick(&self) {
        self.step(Event::Timer);
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
    /// [`CoordinatorError::InvalidRequest`] (page table shorter than the prefix, aux index
    /// outside the aux buffers, `max_rooms`).
    pub fn receive(&self, room: impl Into<RoomId>, request: ReceiveRequest) -> Result<()> {
        self.receive_traced(room.into(), request, None)
    }

    /// [`receive`](Self::receive) with the room span's parent given as a W3C `traceparent`
    /// (an engine's request span when its tracing is not this process's `tracing`
    /// subscriber, e.g. SGLang's or vLLM's from Python) instead of the caller's current span.
    /// Without an OpenTelemetry layer it is `receive`.
    ///
    /// # Errors
    /// As [`receive`](Self::receive).
    pub fn receive_with_parent(
        &self,
        room: impl Into<RoomId>,
        request: ReceiveRequest,
        parent: &TraceParent,
    ) -> Result<()> {
        self.receive_traced(room.into(), request, Some(parent))
    }

    fn receive_traced(
        &self,
        room: RoomId,
        request: ReceiveRequest,
        parent: Option<&TraceParent>,
    ) -> Result<()> {
        let request = self.inner.room_request(room, request)?;
        // The caller's current span (an engine's request span, if any) is the parent.
        let span = tracing::info_span!(
            "kv_room",
            side = SIDE.as_str(),
            room = room.get(),
            tp_rank = self.inner.descriptor.attn_tp_rank,
            dcp_rank = self.inner.descriptor.dcp_rank,
            transport = self.inner.transport.name(),
            peer = %request.addr,
            pages = request.dst_pages.len(),
            prefix = request.prefix,
            bytes = field::Empty,
            duration_ms = field::Empty,
            otel.status_code = field::Empty,
            error.type = field::Empty,
        );
        if let Some(tp) = parent {
            trace::adopt(&span, tp, true);
        }
        let bootstrap = tracing::info_span!(parent: &span, "kv_bootstrap", room = room.get(), peer = %request.addr, otel.status_code = field::Empty, error.type = field::Empty);
        self.inner.with_core(|c| {
            c.machine.admit(room)?;
            c.rooms.insert(
                room,
                RoomSignals {
                    state: watch::Sender::new(RoomState::Bootstrapping),
                    fence: watch::Sender::new(FenceSignal::default()),
                    span,
                    bootstrap,
                    ranks: Vec::new(),
                },
            );
            self.inner.run(c, Event::Receive { room, request });
            Ok::<_, CoordinatorError>(())
        })?;
        inc(&self.inner.metrics.rooms_created);
        Ok(())
    }

    /// The room's state on this rank.
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub fn poll(&self, room: impl Into<RoomId>) -> Result<RoomState> {
        let room = room.into();
        self.inner
            .with_core(|c| c.machine.state(room))
            .ok_or_else(|| unknown(room))
    }

    /// The room's state agreed with the other ranks through the [`RankAgreement`] hook.
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub async fn poll_agreed(&self, room: impl Into<RoomId>) -> Result<RoomState> {
        let room = room.into();
        let local = self.poll(room)?;
        Ok(self.inner.agreement.agree(room.get(), local).await)
    }

    /// The failure of a Failed room (`None` otherwise), with its first recorded reason.
    pub fn failure(&self, room: impl Into<RoomId>) -> Option<KvTransferError> {
        let room = room.into();
        self.inner.with_core(|c| c.machine.failure(room))
    }

    /// How long a room that succeeded took from its metadata sent to the prefill ranks to
    /// their Success ([`DecodeMachine::transfer_time`]); `None` until it succeeded.
    pub fn transfer_time(&self, room: impl Into<RoomId>) -> Option<Duration> {
        let room = room.into();
        self.inner.with_core(|c| c.machine.transfer_time(room))
    }

    /// Waits until the room is terminal: `Ok` on Success, its [`KvTransferError`] on Failed.
    ///
    /// # Errors
    /// [`CoordinatorError::Transfer`]; [`CoordinatorError::UnknownRoom`] (also when the room
    /// is cleared while waiting).
    pub async fn wait(&self, room: impl Into<RoomId>) -> Result<()> {
        let room = room.into();
        let rx = self.inner.subscribe(room)?;
        let state = wait_terminal(rx).await;
        self.inner.with_core(|c| match state {
            Some(RoomState::Success) => Ok(()),
            _ => Err(c
                .machine
                .failure(room)
                .map_or_else(|| unknown(room), CoordinatorError::from)),
        })
    }

    /// Aborts the room (`Aborted by AbortReq.`) and tells its prefill peers (once), who
    /// acknowledge when nothing of the room can land any more.
    pub fn abort(&self, room: impl Into<RoomId>) {
        self.inner.step(Event::Abort { room: room.into() });
    }

    /// Whether a Failed room is fenced: every prefill peer acknowledged the abort (or none
    /// ever knew the pages).
    ///
    /// # Errors
    /// [`CoordinatorError::UnknownRoom`].
    pub fn is_fenced(&self, room: impl Into<RoomId>) -> Result<bool> {
        let room = room.into();
        self.inner
            .with_core(|c| c.machine.is_fenced(room))
            .ok_or_else(|| unknown(room))
    }

    /// Waits until the room is terminal and, if it Failed, until no byte of it can land any
    /// more — every prefill peer that received its metadata acknowledged the abort — then
    /// forgets the room and returns; its pages may be reused from then on. Unacknowledged
    /// aborts are re-sent every [`DecodeConfig::abort_resend_interval`]; all the peers' acks
    /// are awaited together, under one deadline.
    ///
    /// # Errors
    /// [`CoordinatorError::NotFailed`] when the room ended in Success (the pages hold its KV);
    /// [`CoordinatorError::FenceTimeout`] after [`DecodeConfig::fence_timeout`] without every
    /// acknowledgement: the room is kept and its pages **must stay quarantined**;
    /// [`CoordinatorError::UnknownRoom`].
    pub async fn release_when_fenced(&self, room: impl Into<RoomId>) -> Result<FenceReport> {
        self.inner.release_when_fenced(room.into()).await
    }

    /// Forgets a room. Prefer [`release_when_fenced`](Self::release_when_fenced) for a Failed
    /// room: clearing an unfenced room gives up the proof that its pages are safe.
    pub fn clear(&self, room: impl Into<RoomId>) {
        let room = room.into();
        let removed = self.inner.with_core(|c| {
            let f = c.machine.forget(room, None)?;
            Some((f, c.rooms.remove(&room)))
        });
        if let Some((f, signals)) = removed {
            if f.unfenced {
                let span = signals.map(|s| s.span).unwrap_or_else(Span::none);
                tracing::warn!(parent: &span, "cleared a failed room before it was fenced: its pages may still receive bytes");
            }
            self.inner.agreement.forget(room.get());
        }
    }

    /// A snapshot of this agent's metrics.
    pub fn metrics(&self) -> MetricsSnapshot {
        let by_state = self
            .inner
            .with_core(|c| Metrics::count_states(c.machine.states()));
        self.inner.metrics.snapshot(by_state)
    }

    /// Rooms currently held.
    pub fn room_count(&self) -> usize {
        self.inner.with_core(|c| c.machine.room_count())
    }

    /// Prefill endpoints this rank is registered with.
    pub fn registered_peers(&self) -> Vec<Endpoint> {
        self.inner.with_core(|c| c.machine.registered_peers())
    }

    /// Stops the agent: every room that is not terminal fails (and aborts its peers), the
    /// control loop and the timer stop.
    pub fn shutdown(&self) {
        self.inner.step(Event::Shutdown);
        let mut tasks = self.inner.with_core(|c| std::mem::take(&mut c.tasks));
        tasks.stop();
    }
}

fn unknown(room: RoomId) -> CoordinatorError {
    CoordinatorError::UnknownRoom { room, side: SIDE }
}

impl DecodeInner {
    /// Runs `f` on the machine and its rooms' signals under the lock; the only place that
    /// takes it. `f` gets the core, not the agent, and its result cannot borrow the guard, so
    /// the lock is released before the caller does anything else (a std mutex is not
    /// re-entrant: calling back into the agent under it would park the thread forever).
    fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        f(&mut lock(&self.core))
    }

    /// Feeds one event to the machine now and carries out its actions.
    fn step(&self, event: Event) {
        self.with_core(|c| self.run(c, event));
    }

    /// [`step`](Self::step) under a lock already held. The actions run under it too, so two
    /// threads' reports and sends keep the machine's order; none of them waits or takes the
    /// lock (the outbox only queues, the directory runs on a task of its own).
    fn run(&self, c: &mut Core, event: Event) {
        let actions = c.machine.handle(event, Instant::now().into_std());
        for action in actions {
            self.execute(c, action);
        }
        let next = c.machine.poll_timeout();
        if next.is_some_and(|n| c.timer_at.is_none_or(|t| n < t)) {
            c.timer_at = next;
            self.wake.notify_one();
        }
    }

    fn execute(&self, c: &mut Core, action: Action) {
        match action {
            Action::Send { to, mut message } => {
                if let ControlMessage::TransferInfo(info) = &mut message {
                    metadata_sent(c, &to, info);
                }
                self.outbox.send(&to, message);
            }
            Action::Resolve { addr } => self.resolve(addr),
            Action::Report {
                room,
                state,
                elapsed,
            } => self.report(c, room, state, elapsed),
            Action::Fenced { room, acks } => {
                if acks > 0 {
                    inc(&self.metrics.rooms_fenced);
                }
                if let Some(s) = c.rooms.get(&room) {
                    s.fence.send_modify(|f| f.fenced = true);
                }
            }
            Action::FenceTimedOut {
                room,
                waited,
                pending,
            } => {
                if let Some(s) = c.rooms.get(&room) {
                    let pending: Vec<String> = pending.iter().map(|e| e.to_string()).collect();
                    s.fence.send_modify(|f| {
                        f.timeouts += 1;
                        f.waited = waited;
                        f.pending = pending.join(", ");
                    });
                }
            }
            Action::ForgetPeer { endpoint } => self.outbox.forget(&endpoint),
        }
    }

    fn report(&self, c: &mut Core, room: RoomId, state: RoomState, elapsed: Duration) {
        let Some(s) = c.rooms.get_mut(&room) else {
            return;
        };
        s.state.send_replace(state);
        match state {
            RoomState::Success => {
                self.metrics.succeeded(elapsed);
                let ms = elapsed.as_millis() as u64;
                s.span.record("duration_ms", ms);
                end_spans(s, None);
                tracing::info!(parent: &s.span, duration_ms = ms, "room received");
            }
            RoomState::Failed => {
                if let Some(e) = c.machine.failure(room) {
                    end_spans(s, Some(&e.reason));
                    self.metrics.failed(e.reason.cause);
                    tracing::warn!(parent: &s.span, cause = %e.reason.cause, peer = e.reason.peer.as_deref(), reason = %e.reason.message, "room failed");
                }
            }
            _ => tracing::debug!(parent: &s.span, %state, "room state"),
        }
    }

    /// Asks the directory on a task of its own and feeds the answer back.
    fn resolve(&self, addr: String) {
        let weak = self.me.clone();
        let directory = self.directory.clone();
        tokio::spawn(async move {
            let answer = directory.prefill_ranks(&addr).await;
            let Some(inner) = weak.upgrade() else { return };
            inner.step(match answer {
                Ok(ranks) => Event::Resolved { addr, ranks },
                Err(e) => Event::ResolveFailed {
                    addr,
                    message: e.to_string(),
                },
            });
        });
    }

    fn subscribe(&self, room: RoomId) -> Result<watch::Receiver<RoomState>> {
        self.with_core(|c| c.rooms.get(&room).map(|s| s.state.subscribe()))
            .ok_or_else(|| unknown(room))
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

    /// Checks a request against this rank's memory and converts it for the machine: the
    /// advertised prefix and the send range's pages.
    fn room_request(&self, room: RoomId, req: ReceiveRequest) -> Result<RoomRequest> {
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
        let aux = self.memory.aux.iter().zip(&self.descriptor.aux_item_lens);
        for (j, (e, &item)) in aux.enumerate() {
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
        if prefix != cached {
            tracing::info!(
                room = room.get(),
                cached_prefix_len = cached,
                advertised = prefix,
                virtual_page = v,
                "decode prefix {cached} is not a multiple of the virtual page {v}: advertising \
                 {prefix} and receiving the last {} cached tokens again",
                cached - prefix
            );
        } else if cached % v != 0 {
            tracing::warn!(
                room = room.get(),
                cached_prefix_len = cached,
                virtual_page = v,
                "strict prefix alignment: advertising a prefix that is not a multiple of the \
                 virtual page; the prefill will refuse the room"
            );
        }
        Ok(RoomRequest {
            addr: req.bootstrap_addr,
            dst_pages: req.page_table[first_page..].to_vec(),
            prefix,
            aux_index: req.aux_index,
        })
    }

    /// Waits for the terminal state, then (Failed) for the fence under the machine's one
    /// deadline, then forgets the room.
    async fn release_when_fenced(&self, room: RoomId) -> Result<FenceReport> {
        let started = Instant::now();
        match wait_terminal(self.subscribe(room)?).await {
            Some(RoomState::Failed) => {}
            Some(_) => return Err(CoordinatorError::NotFailed { room }),
            None => return Err(unknown(room)),
        }
        let (mut rx, seen, incarnation) = self
            .with_core(|c| {
                let rx = c.rooms.get(&room)?.fence.subscribe();
                let seen = rx.borrow().timeouts;
                let incarnation = c.machine.incarnation(room)?;
                self.run(c, Event::FenceWanted { room });
                Some((rx, seen, incarnation))
            })
            .ok_or_else(|| unknown(room))?;
        loop {
            let f = rx.borrow_and_update().clone();
            if f.fenced {
                break;
            }
            if f.timeouts > seen {
                return Err(CoordinatorError::FenceTimeout {
                    room,
                    waited: f.waited,
                    pending: f.pending,
                });
            }
            if rx.changed().await.is_err() {
                return Err(unknown(room));
            }
        }
        Ok(FenceReport {
            room,
            acked_by: self.forget_fenced(room, incarnation),
            waited: started.elapsed(),
        })
    }

    /// Forgets a fenced room (this life of it only); returns who acknowledged its abort.
    fn forget_fenced(&self, room: RoomId, incarnation: Incarnation) -> Vec<Endpoint> {
        let forgotten = self.with_core(|c| {
            let f = c.machine.forget(room, Some(incarnation))?;
            c.rooms.remove(&room);
            Some(f)
        });
        self.agreement.forget(room.get());
        forgotten.map(|f| f.acked).unwrap_or_default()
    }

    fn on_send_failed(
        &self,
        to: &Endpoint,
        kind: &'static str,
        room: Option<u64>,
        err: CoordinatorError,
    ) {
        tracing::warn!(peer = %to, kind, room, error = %err, "decode could not deliver a control message");
        let event = Event::SendFailed {
            to: to.clone(),
            kind,
            room: room.map(RoomId::from),
            error: err.to_string(),
        };
        self.step(event);
    }
}

/// The metadata for one prefill rank is going out: it carries the room span's trace context,
/// the bootstrap is over, and that rank's `kv_receive` span starts.
fn metadata_sent(c: &mut Core, to: &Endpoint, info: &mut TransferInfo) {
    let Some(s) = c.rooms.get_mut(&info.room) else {
        return;
    };
    info.traceparent = trace::traceparent(&s.span);
    if !s.bootstrap.is_none() {
        trace::ok(&s.bootstrap);
        s.bootstrap = Span::none();
    }
    let span = tracing::info_span!(
        parent: &s.span,
        "kv_receive",
        room = info.room.get(),
        prefill = %to,
        prefill_rank = field::Empty,
        pages = info.dst_pages.len(),
        dummy = info.is_dummy,
        otel.status_code = field::Empty,
        error.type = field::Empty,
    );
    s.ranks.push((to.clone(), span));
}

/// A prefill rank's status for a room ends its `kv_receive` span: its data landed (Success)
/// or it failed with its cause.
fn rank_status(c: &mut Core, from: &Endpoint, status: &StatusUpdate) {
    let Some(s) = c.rooms.get_mut(&status.room) else {
        return;
    };
    let Some(i) = s.ranks.iter().position(|(e, _)| e == from) else {
        return;
    };
    let (_, span) = s.ranks.swap_remove(i);
    span.record("prefill_rank", status.prefill_rank);
    match status.state {
        RoomState::Success => trace::ok(&span),
        RoomState::Failed => trace::fail(
            &span,
            status.cause.unwrap_or(FailureCause::RemoteFailure),
            status
                .reason
                .as_deref()
                .unwrap_or("the prefill rank failed the room"),
        ),
        _ => {
            s.ranks.push((from.clone(), span));
        }
    }
}

/// The room reached its end: the room span and every span still open under it end with its
/// outcome (`None`: success), so an aborted or timed-out room leaves no span open.
fn end_spans(s: &mut RoomSignals, failure: Option<&FailureReason>) {
    let open = std::mem::take(&mut s.ranks)
        .into_iter()
        .map(|(_, span)| span);
    let bootstrap = std::mem::replace(&mut s.bootstrap, Span::none());
    for span in open
        .chain(std::iter::once(bootstrap))
        .chain([s.span.clone()])
    {
        match failure {
            Some(reason) => trace::fail_with(&span, reason),
            None => trace::ok(&span),
        }
    }
}
