//! Sender-side batch state: one final outcome, reached once, observable without waiting.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvbridge_transport::{BatchId, BatchState, PeerId, RegionId, Side, TransportError};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::{NAME, Shared, lock};

/// How a batch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Done,
    Cancelled,
    TimedOut,
    Failed {
        reason: String,
        peer_lost: bool,
    },
    /// The receiver refused the batch at its `Begin`; nothing of it was written.
    Refused(Refusal),
}

/// Why the receiver refused a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    Unknown(RegionId),
    OutOfBounds {
        region: RegionId,
        offset: u64,
        len: u64,
        region_len: u64,
    },
    Busy,
}

impl Refusal {
    pub(crate) fn into_error(self, batch: BatchId, peer: PeerId) -> TransportError {
        match self {
            Refusal::Unknown(region) => TransportError::UnknownRegion {
                side: Side::Remote,
                region,
                transport: NAME,
            },
            Refusal::OutOfBounds {
                region,
                offset,
                len,
                region_len,
            } => TransportError::OutOfBounds {
                side: Side::Remote,
                region,
                offset,
                len,
                region_len,
            },
            Refusal::Busy => TransportError::BatchFailed {
                batch,
                peer,
                reason: "the peer has too many batches in flight from this transport; wait for \
                         some (or raise its TcpConfig::max_inbound_batches)"
                    .into(),
            },
        }
    }

    fn reason(&self) -> String {
        match self {
            Refusal::Unknown(region) => {
                format!("the peer has no region {region} registered; nothing was written")
            }
            Refusal::OutOfBounds {
                region,
                offset,
                len,
                region_len,
            } => format!(
                "the write of {len} bytes at offset {offset} is outside the peer's region \
                 {region} of {region_len} bytes; nothing was written"
            ),
            Refusal::Busy => "the peer has too many batches in flight from this transport".into(),
        }
    }
}

impl Outcome {
    pub(crate) fn into_result(self, b: &TxBatch) -> Result<(), TransportError> {
        match self {
            Outcome::Done => Ok(()),
            Outcome::Cancelled => Err(TransportError::Cancelled { batch: b.id }),
            Outcome::TimedOut => Err(TransportError::TimedOut {
                batch: b.id,
                timeout: b.timeout,
            }),
            Outcome::Failed {
                reason,
                peer_lost: true,
            } => Err(TransportError::PeerLost {
                peer: b.peer,
                transport: NAME,
                reason,
            }),
            Outcome::Failed { reason, .. } => Err(TransportError::BatchFailed {
                batch: b.id,
                peer: b.peer,
                reason,
            }),
            Outcome::Refused(r) => Err(r.into_error(b.id, b.peer)),
        }
    }
}

/// A batch posted by this transport.
pub(crate) struct TxBatch {
    pub(crate) id: BatchId,
    pub(crate) peer: PeerId,
    pub(crate) timeout: Duration,
    pub(crate) deadline: Instant,
    state: watch::Sender<Option<Outcome>>,
    /// Set once the batch is being fenced: no further piece of it is sent.
    stop: AtomicBool,
    fence_started: AtomicBool,
    /// Upper bound of the receiver's own deadline for this batch (set when it accepted it):
    /// after this instant the receiver applies no byte of it, whatever happens to the link.
    anchor: Mutex<Option<Instant>>,
    /// Pieces of this batch a writer is sending right now (their source ranges are borrowed).
    sending: AtomicUsize,
    sending_idle: Notify,
    /// Remote (region, offset, len) of each descriptor of a batch sent without waiting for
    /// the receiver's answer, to name what it refused.
    pub(crate) remote_ops: Vec<(RegionId, u64, u64)>,
}

impl TxBatch {
    pub(crate) fn new(id: BatchId, peer: PeerId, timeout: Duration, posted: Instant) -> Self {
        Self {
            id,
            peer,
            timeout,
            deadline: posted + timeout,
            state: watch::Sender::new(None),
            stop: AtomicBool::new(false),
            fence_started: AtomicBool::new(false),
            anchor: Mutex::new(None),
            sending: AtomicUsize::new(0),
            sending_idle: Notify::new(),
            remote_ops: Vec::new(),
        }
    }

    /// Records the final outcome unless one is recorded already; returns whether it did.
    pub(crate) fn finish(&self, outcome: Outcome) -> bool {
        self.stop.store(true, Ordering::Release);
        self.state.send_if_modified(|s| {
            if s.is_none() {
                tracing::debug!(batch = %self.id, ?outcome, "batch final");
                *s = Some(outcome);
                true
            } else {
                false
            }
        })
    }

    pub(crate) fn is_final(&self) -> bool {
        self.state.borrow().is_some()
    }

    pub(crate) fn outcome(&self) -> Option<Outcome> {
        self.state.borrow().clone()
    }

    pub(crate) fn state(&self) -> BatchState {
        match &*self.state.borrow() {
            None => BatchState::Pending,
            Some(Outcome::Done) => BatchState::Done,
            Some(Outcome::Cancelled) => BatchState::Cancelled,
            Some(Outcome::TimedOut) => BatchState::TimedOut,
            Some(Outcome::Failed { reason, .. }) => BatchState::Failed(reason.clone()),
            Some(Outcome::Refused(r)) => BatchState::Failed(r.reason()),
        }
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Claims the right to fence this batch; false if someone else already does.
    pub(crate) fn start_fence(&self) -> bool {
        !self.fence_started.swap(true, Ordering::AcqRel)
    }

    /// A writer starts sending a piece (borrowing its sources).
    pub(crate) fn piece_started(&self) {
        self.sending.fetch_add(1, Ordering::AcqRel);
    }

    /// A writer released a piece's sources.
    pub(crate) fn piece_finished(&self) {
        self.sending.fetch_sub(1, Ordering::AcqRel);
        self.sending_idle.notify_waiters();
    }

    /// Records `Done` at once if no writer holds a source range of the batch; false if one does
    /// (then [`finish_done`](Self::finish_done) waits for it).
    pub(crate) fn try_finish_done(&self) -> bool {
        if self.sending.load(Ordering::Acquire) != 0 {
            return false;
        }
        self.finish(Outcome::Done);
        true
    }

    /// Records `Done` once no writer holds a source range of the batch any more, so the caller
    /// may touch its memory the moment `wait` returns.
    pub(crate) async fn finish_done(&self) {
        loop {
            let idle = self.sending_idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.sending.load(Ordering::Acquire) == 0 {
                break;
            }
            idle.await;
        }
        self.finish(Outcome::Done);
    }

    pub(crate) fn set_anchor(&self, at: Instant) {
        *lock(&self.anchor) = Some(at);
    }

    pub(crate) fn anchor(&self) -> Option<Instant> {
        *lock(&self.anchor)
    }

    /// Waits for the final outcome. The deadline watchdog guarantees one; as a last resort
    /// (it cannot be reached unless a task died) the batch is failed well past its deadline.
    pub(crate) async fn wait_final(&self, shared: &Shared) -> Outcome {
        let mut rx = self.state.subscribe();
        let limit = self.deadline + shared.config.fence_grace * 2 + Duration::from_secs(1);
        tokio::select! {
            r = rx.wait_for(Option::is_some) => {
                if let Ok(v) = r {
                    if let Some(o) = v.clone() {
                        return o;
                    }
                }
            }
            () = tokio::time::sleep_until(limit) => {}
        }
        self.finish(Outcome::TimedOut);
        self.outcome().unwrap_or(Outcome::TimedOut)
    }

    /// Resolves when the batch is final.
    pub(crate) async fn finished(&self) {
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(Option::is_some).await;
    }
}
