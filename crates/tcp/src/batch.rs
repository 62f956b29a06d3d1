//! Sender-side batches: their lifecycle lives in the shared batch table
//! ([`kvbridge_transport::batch`]); what is kept here is what the wire needs on top of it.
//!
//! A batch is *committing* (`Step::Commit`) from the moment it is posted: once its `Begin` may
//! have left, only the receiver's fence (its answer to `Cancel`) decides whether bytes of it
//! still land, so `cancel` and peer loss go through that fence and record the outcome
//! themselves. The table's commit grace is a backstop for a fence that never finishes.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use kvbridge_transport::batch::Outcome;
use kvbridge_transport::sync::lock;
use kvbridge_transport::{BatchId, BatchState, PeerId, RegionId, Side, TransferOp, TransportError};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::{NAME, Shared};

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
}

/// The table's clock: tokio's, so paused test time applies to deadlines too.
pub(crate) fn now() -> std::time::Instant {
    Instant::now().into_std()
}

/// The table's timer.
pub(crate) fn sleep_until(at: std::time::Instant) -> tokio::time::Sleep {
    tokio::time::sleep_until(at.into())
}

/// What the wire needs of a batch posted by this transport.
pub(crate) struct TxBatch {
    pub(crate) id: BatchId,
    pub(crate) peer: PeerId,
    pub(crate) deadline: Instant,
    /// Set once the batch is being fenced or is final: no further piece of it is sent.
    stop: AtomicBool,
    fence_started: AtomicBool,
    /// Upper bound of the receiver's own deadline for this batch (set when it accepted it):
    /// after this instant the receiver applies no byte of it, whatever happens to the link.
    anchor: Mutex<Option<Instant>>,
    /// Pieces of this batch a writer is sending right now (their source ranges are borrowed).
    sending: AtomicUsize,
    sending_idle: Notify,
    /// The descriptors of a batch sent without waiting for the receiver's answer, to name
    /// what it refused.
    pub(crate) remote_ops: Vec<TransferOp>,
}

impl TxBatch {
    pub(crate) fn new(id: BatchId, peer: PeerId, deadline: Instant) -> Self {
        Self {
            id,
            peer,
            deadline,
            stop: AtomicBool::new(false),
            fence_started: AtomicBool::new(false),
            anchor: Mutex::new(None),
            sending: AtomicUsize::new(0),
            sending_idle: Notify::new(),
            remote_ops: Vec::new(),
        }
    }

    /// The outcome of a batch that failed because the link to its peer is gone.
    pub(crate) fn lost(&self, reason: String) -> Outcome {
        Outcome::Failed(TransportError::PeerLost {
            peer: self.peer,
            transport: NAME,
            reason,
        })
    }

    /// The outcome of a batch that failed for `reason` with the link still up.
    pub(crate) fn failed(&self, reason: String) -> Outcome {
        Outcome::Failed(TransportError::BatchFailed {
            batch: self.id,
            peer: self.peer,
            reason,
        })
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

    pub(crate) fn set_anchor(&self, at: Instant) {
        *lock(&self.anchor) = Some(at);
    }

    pub(crate) fn anchor(&self) -> Option<Instant> {
        *lock(&self.anchor)
    }
}

impl Shared {
    /// Records the final outcome unless one is recorded already (and stops the writers);
    /// returns whether it did.
    pub(crate) fn finish(&self, b: &TxBatch, outcome: Outcome) -> bool {
        b.stop();
        let set = self.table.finish(b.id, outcome, now());
        if set {
            tracing::debug!(batch = %b.id, "batch final");
        }
        set
    }

    /// Whether the batch is final (or already collected by `wait`).
    pub(crate) fn is_final(&self, b: &TxBatch) -> bool {
        !matches!(self.table.state(b.id, now()), Ok(BatchState::Pending))
    }

    /// Resolves when the batch is final (at the latest at its deadline plus the commit grace).
    pub(crate) async fn finished(&self, b: &TxBatch) {
        let _ = self.table.settle(b.id, sleep_until).await;
    }

    /// Records `Done` at once if no writer holds a source range of the batch; false if one does
    /// (then [`finish_done`](Self::finish_done) waits for it).
    pub(crate) fn try_finish_done(&self, b: &TxBatch) -> bool {
        if b.sending.load(Ordering::Acquire) != 0 {
            return false;
        }
        self.finish(b, Outcome::Done);
        true
    }

    /// Records `Done` once no writer holds a source range of the batch any more, so the caller
    /// may touch its memory the moment `wait` returns.
    pub(crate) async fn finish_done(&self, b: &TxBatch) {
        loop {
            let idle = b.sending_idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if b.sending.load(Ordering::Acquire) == 0 {
                break;
            }
            idle.await;
        }
        self.finish(b, Outcome::Done);
    }
}
