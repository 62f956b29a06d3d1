//! Feeding the prefill rank's machine: one event at a time under the agent's one lock, and
//! the actions it answers carried out (sends queued, room states published, a room's send
//! task started and handed its chunks); what must wait is left to the caller ([`Stepped`]).

use kvbridge_transport::sync::lock;
use kvbridge_transport::{PeerId, TransportError};
use tokio::sync::{mpsc, watch};
use tracing::Span;

use super::{Conn, Core, Job, PrefillInner, RoomEvent, RoomPeer, RoomSide, SIDE, now};
use crate::error::CoordinatorError;
use crate::ids::{Incarnation, RoomId};
use crate::state::{FailureReason, RoomState};
use crate::trace;
use kvbridge_machines::prefill::{Action, PrefillRoom, RankAction, RankEvent};

/// What a machine step leaves to the caller once the state is unlocked.
#[derive(Default)]
pub(super) struct Stepped {
    /// What became of a chunk handed over.
    pub(super) chunk: Option<ChunkStep>,
    /// Transport connections to close (a decode rank registered again).
    pub(super) disconnect: Vec<PeerId>,
}

/// What [`PrefillInner::send_chunk`] does once the state is unlocked.
pub(super) enum ChunkStep {
    Refused(CoordinatorError),
    Queue {
        tx: mpsc::Sender<Job>,
        page_offset: u64,
        token_offset: u64,
        start: Option<DriverStart>,
    },
}

/// What a new room driver needs, taken under the lock and spawned after it.
pub(super) struct DriverStart {
    pub(super) incarnation: Incarnation,
    pub(super) senders: Vec<RoomPeer>,
    pub(super) prefix: u64,
    pub(super) rx: mpsc::Receiver<Job>,
    pub(super) status_rx: watch::Receiver<RoomState>,
    pub(super) span: Span,
}

impl PrefillInner {
    /// Runs `f` on the machine and its rooms' side records under the lock; the only place
    /// that takes it. `f` gets the core, not the agent, and its result cannot borrow the
    /// guard, so the lock is released before the caller does anything else (a std mutex is
    /// not re-entrant: calling back into the agent under it would park the thread forever).
    pub(super) fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        f(&mut lock(&self.core))
    }

    /// Feeds one event to the machine now and carries out its actions.
    pub(super) fn step(&self, event: RankEvent<Conn>) -> Stepped {
        self.with_core(|c| self.step_locked(c, event))
    }

    /// Feeds `event` to one room (its life `incarnation` only, when given).
    pub(super) fn room_step(
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
    pub(super) fn step_locked(&self, c: &mut Core, event: RankEvent<Conn>) -> Stepped {
        let mut out = Stepped::default();
        for action in c.machine.handle(event, now()) {
            match action {
                RankAction::Send { to, message } => self.outbox.send(&to, *message),
                RankAction::Room { room, action } => self.room_action(c, room, action, &mut out),
                RankAction::Disconnect { peer } => out.disconnect.push(peer),
                RankAction::EarlyExpired { room } => {
                    c.early_traces.remove(&room);
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
                trace::ok(&side.span);
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
                trace::fail_with(&side.span, &reason);
                tracing::warn!(parent: &side.span, cause = %reason.cause, peer = reason.peer.as_deref(), reason = %reason.message, "room failed");
                side.status.fail(reason);
            }
            _ => {
                if let Some(m) = machine.filter(|_| state == RoomState::WaitingForInput) {
                    side.span.record("decode_ranks", m.peers().len());
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
    pub(super) fn note_lost(&self, peer: PeerId, e: &TransportError) {
        if matches!(e, TransportError::PeerLost { .. }) {
            self.step(RankEvent::PeerLost { peer });
        }
    }
}
