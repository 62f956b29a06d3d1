//! The pack path (`PrefillConfig::pack_buffers`): a batch with strided source rows takes a
//! buffer from the pool (waiting, bounded, while all are out), gathers its rows into it off the
//! runtime's workers and is posted from it as contiguous ranges.

use std::sync::Arc;
use std::time::Duration;

use kvbridge_transport::TransferOp;
use tokio::sync::watch;

use super::{Pack, PrefillInner};
use crate::channel::Endpoint;
use crate::ids::RoomId;
use crate::memory::PackLease;
use crate::metrics::{add, inc};
use crate::state::{FailureCause, FailureReason, RoomState};
use kvbridge_machines::plan::{is_strided_source, pack_ops};

/// Whether a batch has an op whose source rows are strided (what the pack path gathers).
pub(super) fn has_strided_source(ops: &[TransferOp]) -> bool {
    ops.iter().any(is_strided_source)
}

/// Takes a pack buffer (waiting while all are out, bounded by `wait_limit` and by the room
/// failing), gathers the batch's strided source rows into it off the runtime's workers, and
/// returns the ops to post from it.
pub(super) async fn pack_batch(
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
