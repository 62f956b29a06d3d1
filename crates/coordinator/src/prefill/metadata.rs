//! A decode rank's metadata for a room (`TransferInfo`): checked against its registration and
//! the pair's plan, then handed to the room's machine (after connecting again if the
//! connection was lost); a room it cannot be served fails with the reason.

use std::sync::Arc;

use super::{AcceptedPeer, Core, EARLY_TRACES, EARLY_TRACES_PER_ROOM, PrefillInner};
use crate::messages::TransferInfo;
use crate::state::{FailureCause, FailureReason, RoomState};
use crate::trace;
use kvbridge_machines::prefill::{RankEvent, status_message};

/// A decode rank's metadata as the room's trace sees it: its trace context joins the room's
/// span (the first one as parent), and a `kv_metadata` span says who asked for what. Metadata
/// of a room not created yet keeps its context for `create_room`.
fn join_trace(c: &mut Core, info: &TransferInfo) {
    let Some(side) = c.rooms.get_mut(&info.room) else {
        let Some(tp) = info.traceparent else { return };
        let full = c.early_traces.len() >= EARLY_TRACES;
        if let Some(early) = match c.early_traces.get_mut(&info.room) {
            Some(v) => Some(v),
            None if full => None,
            None => Some(c.early_traces.entry(info.room).or_default()),
        } {
            if early.len() < EARLY_TRACES_PER_ROOM {
                early.push(tp);
            }
        }
        return;
    };
    if let Some(tp) = &info.traceparent {
        trace::adopt(&side.span, tp, !side.traced);
        side.traced = true;
    }
    let _span = tracing::info_span!(
        parent: &side.span,
        "kv_metadata",
        room = info.room.get(),
        decode = %info.decode_endpoint,
        pages = info.dst_pages.len(),
        dummy = info.is_dummy,
        prefix = info.decode_prefix_len,
        required_dst_info_num = info.required_dst_info_num,
    );
}

impl PrefillInner {
    pub(super) fn reply_failed(&self, info: &TransferInfo, reason: &FailureReason) {
        self.outbox.send(
            &info.decode_endpoint,
            status_message(
                info.room,
                info,
                self.unique_rank,
                RoomState::Failed,
                Some(reason),
            ),
        );
    }

    /// Why what a decode rank asks for cannot be sent (`None`: it can).
    fn check_info(&self, info: &TransferInfo, peer: &AcceptedPeer) -> Option<FailureReason> {
        if info.is_dummy {
            return None;
        }
        if let Err(e) = peer.plan.check_prefix(info.decode_prefix_len) {
            return Some(FailureReason::with_peer(
                FailureCause::Planning,
                &info.decode_endpoint,
                e.0,
            ));
        }
        (!self.memory.aux.is_empty() && info.dst_aux_index.is_none()).then(|| {
            FailureReason::with_peer(
                FailureCause::Planning,
                &info.decode_endpoint,
                format!(
                    "room {}: decode {} sent no aux index, but both sides register aux buffers",
                    info.room, info.decode_endpoint
                ),
            )
        })
    }

    /// A decode rank's metadata for a room: checked against the rank's registration and the
    /// plan, then handed to the machine; a lost connection is connected again first.
    pub(super) fn on_transfer_info(self: &Arc<Self>, info: TransferInfo) {
        let lost = self.with_core(|c| {
            let conn = match c.machine.sender(&info) {
                Ok(a) => a.conn.clone(),
                Err(reason) => {
                    self.reply_failed(&info, &reason);
                    return None;
                }
            };
            join_trace(c, &info);
            if !info.is_dummy && c.machine.is_lost(conn.peer) {
                return Some((info, conn));
            }
            let invalid = self.check_info(&info, &conn);
            let conn = (!info.is_dummy).then_some(conn);
            self.step_locked(
                c,
                RankEvent::Metadata {
                    info,
                    conn,
                    invalid,
                },
            );
            None
        });
        if let Some((info, old)) = lost {
            let inner = self.clone();
            tokio::spawn(async move { inner.reconnect_then(info, old).await });
        }
    }
}
