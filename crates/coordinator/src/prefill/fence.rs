//! The fence of a room's send task: every batch in flight cancelled at once under one
//! deadline, every waiter drained; a batch that cannot be proven final poisons the room (no
//! ABORT_ACK is sent for it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvbridge_transport::{BatchId, KvTransport, TransportError};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::send::{RoomDriver, WaitResult, Waited};
use crate::ids::RoomId;
use crate::memory::PackLease;
use crate::metrics::{add, inc};

impl RoomDriver {
    /// Cancels every batch still in flight, then waits for every waiter; returns whether some
    /// batch could not be proven final (the room is then poisoned).
    pub(super) async fn fence(&mut self) -> bool {
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
