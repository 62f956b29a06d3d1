//! A room's send task ([`RoomDriver`]): plans each chunk for every decode rank off the
//! runtime's workers, posts its batches (through a pack buffer where the pack path applies),
//! follows each batch to its end, posts the aux rows once a peer's KV landed, and reports the
//! room delivered or failed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvbridge_transport::{BatchId, KvTransport, TransferBatch, TransferOp, TransportError};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::{Instrument, Span, field};

use super::pack::{has_strided_source, pack_batch};
use super::step::DriverStart;
use super::{Job, PrefillInner, RoomPeer};
use crate::channel::Endpoint;
use crate::ids::{Incarnation, RoomId};
use crate::memory::PackLease;
use crate::metrics::{add, inc};
use crate::state::{FailureCause, FailureReason, RoomState};
use crate::trace;
use kvbridge_machines::prefill::{BatchAction, BatchEvent, Event, SendProgress};

pub(super) enum Waited {
    Final(std::result::Result<(), TransportError>),
    Hung,
}

/// What a batch's waiter task reports.
pub(super) struct WaitResult {
    pub(super) pi: usize,
    pub(super) aux: bool,
    pub(super) id: BatchId,
    pub(super) bytes: u64,
    pub(super) waited: Waited,
    /// The batch's pack buffer, still held when the batch was not seen final.
    pub(super) lease: Option<PackLease>,
}

/// The task that posts one room's chunks and follows its batches ([`SendProgress`] keeps the
/// accounting); on failure it fences every batch in flight before the room's machine hears
/// [`Event::DriverEnded`] (which tells the decode ranks and acknowledges their aborts).
pub(super) struct RoomDriver {
    pub(super) inner: Arc<PrefillInner>,
    pub(super) room: RoomId,
    incarnation: Incarnation,
    /// The decode ranks sent to (no dummies), as [`SendProgress`] indexes them.
    peers: Vec<RoomPeer>,
    prefix: u64,
    pub(super) progress: SendProgress,
    pub(super) waits: JoinSet<WaitResult>,
    /// Pack buffers of batches whose waiter gave up (hung): released once the fence proves
    /// the batch final, retired otherwise.
    pub(super) hung_leases: HashMap<BatchId, PackLease>,
    /// The prefill's aux row, once the last chunk is posted.
    src_aux: Option<u64>,
    /// How long a batch is waited for: its deadline plus the grace.
    pub(super) wait_limit: Duration,
    /// Per peer: whether this room posted it a batch (only a connection found lost before
    /// that is connected again within the room).
    posted_to: Vec<bool>,
}

impl RoomDriver {
    pub(super) fn new(inner: Arc<PrefillInner>, room: RoomId, d: &DriverStart) -> Self {
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

    pub(super) async fn run(
        mut self,
        mut rx: mpsc::Receiver<Job>,
        mut status_rx: watch::Receiver<RoomState>,
    ) {
        let failure = self.send(&mut rx, &mut status_rx).await.err();
        drop(rx);
        let (room, incarnation) = (self.room, self.incarnation);
        let failed = failure.is_some();
        if let Some(reason) = failure {
            self.inner
                .room_step(room, Some(incarnation), Event::Fail(reason));
        }
        let fence_span = (failed || !self.progress.in_flight().is_empty()).then(|| {
            tracing::info_span!(
                "kv_fence",
                room = room.get(),
                batches = self.progress.in_flight().len(),
                poisoned = field::Empty,
                otel.status_code = field::Empty,
                error.type = field::Empty,
            )
        });
        let span = fence_span.clone().unwrap_or_else(Span::none);
        let poisoned = self.fence().instrument(span.clone()).await;
        span.record("poisoned", poisoned);
        if poisoned {
            trace::fail(
                &span,
                FailureCause::BatchTimeout,
                "a batch of the room could not be fenced; the room is poisoned",
            );
        }
        drop(fence_span);
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

    /// [`post_chunk`](Self::post_chunk) in a `kv_chunk` span, marked failed with the reason.
    async fn on_job(
        &mut self,
        job: Job,
        status_rx: &watch::Receiver<RoomState>,
    ) -> std::result::Result<Vec<BatchAction>, FailureReason> {
        let span = tracing::info_span!(
            "kv_chunk",
            room = self.room.get(),
            tokens = job.chunk.num_kv_tokens,
            pages = job.chunk.pages.len(),
            token_offset = job.token_offset,
            last = job.chunk.is_last,
            decode_ranks = self.peers.len(),
            otel.status_code = field::Empty,
            error.type = field::Empty,
        );
        let done = self
            .post_chunk(job, status_rx)
            .instrument(span.clone())
            .await;
        if let Err(reason) = &done {
            trace::fail_with(&span, reason);
        }
        done
    }

    /// Plans a chunk for every decode rank and posts its batches (through a pack buffer when
    /// the source rows are strided and the agent has pack buffers).
    async fn post_chunk(
        &mut self,
        job: Job,
        status_rx: &watch::Receiver<RoomState>,
    ) -> std::result::Result<Vec<BatchAction>, FailureReason> {
        let room = self.room;
        let (job, planned) = self
            .plan(job)
            .instrument(tracing::info_span!("kv_plan"))
            .await?;
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
            let span = tracing::info_span!(
                "kv_post",
                decode_rank = pi,
                decode = %endpoint,
                ops = ops.len(),
                packed = field::Empty,
                otel.status_code = field::Empty,
                error.type = field::Empty,
            );
            let posted = self
                .post_rank(pi, ops, &endpoint, status_rx)
                .instrument(span.clone());
            match posted.await {
                Ok(Some(more)) => due.extend(more),
                Ok(None) => return Ok(due),
                Err(reason) => {
                    trace::fail_with(&span, &reason);
                    return Err(reason);
                }
            }
        }
        if job.chunk.is_last {
            self.src_aux = job.chunk.aux_index;
            due.extend(self.progress.handle(BatchEvent::LastChunkPosted));
        }
        Ok(due)
    }

    /// Posts one decode rank's part of a chunk, packed where that applies; `None` when the
    /// room failed while waiting for a pack buffer.
    async fn post_rank(
        &mut self,
        pi: usize,
        ops: Vec<TransferOp>,
        endpoint: &Endpoint,
        status_rx: &watch::Receiver<RoomState>,
    ) -> std::result::Result<Option<Vec<BatchAction>>, FailureReason> {
        let room = self.room;
        let (ops, lease) = match &self.inner.pack {
            Some(pack) if has_strided_source(&ops) => {
                let packed = pack_batch(
                    &self.inner,
                    pack,
                    ops,
                    room,
                    endpoint,
                    self.wait_limit,
                    status_rx.clone(),
                )
                .await?;
                // None: the room failed while waiting for a buffer.
                let Some((ops, lease)) = packed else {
                    return Ok(None);
                };
                Span::current().record("packed", true);
                (ops, Some(lease))
            }
            _ => (ops, None),
        };
        self.post(pi, ops, false, lease).await.map(Some)
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
        let span = tracing::info_span!(
            "kv_batch",
            room = self.room.get(),
            decode_rank = pi,
            decode = %self.peers[pi].info.decode_endpoint,
            batch = %id,
            aux,
            ops = n_ops,
            rows,
            bytes,
            transport = self.inner.transport.name(),
            otel.status_code = field::Empty,
            error.type = field::Empty,
        );
        self.wait_for(pi, id, aux, bytes, lease, span);
        Ok(self
            .progress
            .handle(BatchEvent::Posted { peer: pi, id, aux }))
    }

    /// Follows a posted batch on a waiter task, within the wait limit; its `kv_batch` span
    /// ends with it.
    fn wait_for(
        &mut self,
        pi: usize,
        id: BatchId,
        aux: bool,
        bytes: u64,
        lease: Option<PackLease>,
        span: Span,
    ) {
        let t = self.inner.transport.clone();
        let wait_limit = self.wait_limit;
        self.waits.spawn(async move {
            let waited = match tokio::time::timeout(wait_limit, t.wait(id)).await {
                Ok(r) => Waited::Final(r),
                Err(_) => Waited::Hung,
            };
            end_batch_span(span, &waited);
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
    }
}

/// Ends a `kv_batch` span with how its batch ended.
fn end_batch_span(span: Span, waited: &Waited) {
    match waited {
        Waited::Final(Ok(())) => trace::ok(&span),
        Waited::Final(Err(e)) => {
            let cause = match e {
                TransportError::TimedOut { .. } => FailureCause::BatchTimeout,
                _ => FailureCause::TransferError,
            };
            trace::fail(&span, cause, &e.to_string());
        }
        Waited::Hung => trace::fail(
            &span,
            FailureCause::BatchTimeout,
            "the transport did not finish the batch within its deadline plus grace",
        ),
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
