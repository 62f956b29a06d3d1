//! The caller's calls on a room: create it, clear it, and hand it a chunk (checked, accepted by
//! the machine, queued to the room's send task, which the first chunk starts).

use std::sync::Arc;

use tracing::field;

use super::send::RoomDriver;
use super::step::ChunkStep;
use super::{Job, PrefillInner, RoomSide, SIDE};
use crate::error::{CoordinatorError, Result};
use crate::ids::RoomId;
use crate::metrics::inc;
use crate::state::{RoomState, RoomStatus};
use crate::trace;
use kvbridge_control::TraceParent;
use kvbridge_machines::plan::Chunk;
use kvbridge_machines::prefill::{ChunkShape, Event, LayerPart, RankEvent};

/// An entry index as the machine counts them (a rank has far fewer than 2^32 entries).
fn entry_index(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

impl PrefillInner {
    pub(super) fn create_room(&self, room: RoomId, parent: Option<&TraceParent>) -> Result<()> {
        let span = tracing::info_span!(
            parent: None,
            "kv_room",
            side = SIDE.as_str(),
            room = room.get(),
            rank = self.unique_rank,
            transport = self.transport.name(),
            peer = field::Empty,
            decode_ranks = field::Empty,
            bytes = field::Empty,
            duration_ms = field::Empty,
            otel.status_code = field::Empty,
            error.type = field::Empty,
        );
        self.with_core(|c| {
            c.machine.admit(room)?;
            inc(&self.metrics.rooms_created);
            tracing::debug!(parent: &span, "room created");
            // The caller's parent first; then metadata that came first carried the decode's
            // trace context (a link when the room already has its parent).
            if let Some(tp) = parent {
                trace::adopt(&span, tp, true);
            }
            let early = c.early_traces.remove(&room).unwrap_or_default();
            for (i, tp) in early.iter().enumerate() {
                trace::adopt(&span, tp, i == 0 && parent.is_none());
            }
            let side = RoomSide {
                status: RoomStatus::new(RoomState::Bootstrapping),
                driver: None,
                span,
                traced: parent.is_some() || !early.is_empty(),
            };
            c.rooms.insert(room, side);
            self.step_locked(c, RankEvent::Create { room });
            Ok(())
        })
    }

    pub(super) fn clear(&self, room: RoomId) {
        if self.with_core(|c| c.visible(room).is_err()) {
            return;
        }
        self.room_step(room, None, Event::Clear);
        self.agreement.forget(room.into());
    }

    /// Refuses chunks that break what the agent's memory and pack buffers allow.
    fn check_chunk(&self, chunk: &Chunk) -> Result<()> {
        let invalid = |message: String| {
            Err(CoordinatorError::InvalidRequest {
                what: "chunk",
                message,
            })
        };
        if let Some(layers) = &chunk.layers {
            let entries = self.memory.kv.len();
            if layers.start >= layers.end || layers.end > entries {
                return invalid(format!(
                    "layers {layers:?} is not a part of this rank's {entries} KV entries: send \
                     layers start..end with start < end <= {entries}"
                ));
            }
            if self.pack.is_some() {
                return invalid(
                    "this agent packs its chunks (pack buffers are set), which moves every \
                     layer of a chunk at once: send whole chunks (no layers), or start the \
                     agent without pack buffers to send layer by layer"
                        .to_owned(),
                );
            }
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
        let Some(i) = chunk.aux_index else {
            return Ok(());
        };
        let aux = self.memory.aux.iter().zip(&self.descriptor.aux_item_lens);
        for (j, (e, &item)) in aux.enumerate() {
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
        Ok(())
    }

    pub(super) async fn send_chunk(self: Arc<Self>, room: RoomId, mut chunk: Chunk) -> Result<()> {
        self.check_chunk(&chunk)?;
        let total = self.memory.kv.len();
        if chunk.layers.as_ref().is_some_and(|l| *l == (0..total)) {
            chunk.layers = None;
        }
        let layers = chunk.layers.as_ref().map(|l| LayerPart {
            start: entry_index(l.start),
            end: entry_index(l.end),
            total: entry_index(total),
        });
        self.with_core(|c| c.visible(room).map(|_| ()))?;
        // One page id stands for page_size · dcp_size tokens (the prefill's virtual page).
        let page_tokens = self
            .descriptor
            .page_size
            .saturating_mul(u64::from(self.descriptor.dcp_size.max(1)));
        let shape = ChunkShape {
            pages: chunk.pages.len() as u64,
            tokens: chunk.num_kv_tokens,
            is_last: chunk.is_last,
            page_tokens,
            layers,
        };
        let event = RankEvent::Room {
            room,
            incarnation: None,
            event: Event::Chunk(shape),
        };
        let step = self.with_core(|c| {
            c.machine.room(room)?;
            Some(self.step_locked(c, event).chunk)
        });
        let Some(step) = step else {
            return Err(CoordinatorError::UnknownRoom { room, side: SIDE });
        };
        // Nothing to post: the room has only dummy peers.
        let Some(step) = step else {
            return Ok(());
        };
        let (tx, page_offset, token_offset) = match step {
            ChunkStep::Refused(e) => return Err(e),
            ChunkStep::Queue {
                tx,
                page_offset,
                token_offset,
                start,
            } => {
                if let Some(d) = start {
                    let span = d.span.clone();
                    tokio::spawn(tracing::Instrument::instrument(
                        RoomDriver::new(self.clone(), room, &d).run(d.rx, d.status_rx),
                        span,
                    ));
                }
                (tx, page_offset, token_offset)
            }
        };
        // The room's last hand-over is the last chunk's final part: only that one posts aux
        // rows and concludes the send (earlier parts of the last chunk are not last).
        if chunk.layers.as_ref().is_some_and(|l| l.end < total) {
            chunk.is_last = false;
        }
        let job = Job {
            chunk,
            page_offset,
            token_offset,
        };
        if tx.send(job).await.is_err() {
            return self.with_core(|c| {
                let (_, s) = c.visible(room)?;
                Err(s.status.error(room).map(CoordinatorError::from).unwrap_or(
                    CoordinatorError::InvalidRequest {
                        what: "chunk",
                        message: format!("room {room} stopped accepting chunks"),
                    },
                ))
            });
        }
        Ok(())
    }
}
