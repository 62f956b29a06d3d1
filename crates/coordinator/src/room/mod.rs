//! The rooms' lifecycles as plain state machines (docs/lifecycle.md).
//!
//! A machine holds one room's lifecycle on one agent and nothing else: no tasks, no channels,
//! no clock, no I/O. Its driver (the agent) feeds it events with the current instant —
//! `handle(event, now)` — and executes the actions it answers (send a control message, post a
//! chunk, cancel the batches in flight, report the state), and calls `handle` again with the
//! timer event once `poll_timeout()` has passed. So every lifecycle rule can be tested by
//! driving a machine step by step with explicit instants.

pub(crate) mod decode;
pub(crate) mod prefill;

use crate::error::{CoordinatorError, Side};
use crate::ids::RoomId;
use crate::state::{RoomState, RoomStatus};

impl RoomStatus {
    /// What a caller gets once the room ended badly: its [`KvTransferError`](crate::KvTransferError) when Failed,
    /// otherwise [`CoordinatorError::UnknownRoom`] (the room was cleared meanwhile).
    pub(crate) fn failure_or_unknown(
        &self,
        room: impl Into<RoomId>,
        side: Side,
    ) -> CoordinatorError {
        let room = room.into();
        self.error(room)
            .map(CoordinatorError::from)
            .unwrap_or(CoordinatorError::UnknownRoom { room, side })
    }
}

/// Whether an agent may open one more room: not shut down, the id not held (`existing` is the
/// held room's state), fewer than `max_rooms` held. `how_to_free` ends the message of a full
/// agent (what the caller should do).
pub(crate) fn admit_room(
    side: Side,
    room: RoomId,
    closed: bool,
    existing: Option<RoomState>,
    held: usize,
    max_rooms: usize,
    how_to_free: &str,
) -> Result<(), CoordinatorError> {
    if closed {
        return Err(CoordinatorError::Shutdown { side });
    }
    if let Some(state) = existing {
        return Err(CoordinatorError::DuplicateRoom { room, side, state });
    }
    if held >= max_rooms {
        return Err(CoordinatorError::InvalidRequest {
            what: "room",
            message: format!(
                "this {side} agent already holds {held} rooms (max_rooms); {how_to_free}"
            ),
        });
    }
    Ok(())
}
