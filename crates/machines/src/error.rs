//! The one error type of `kvbridge-machines`: what a machine refuses.

use std::fmt;

use kvbridge_control::{RoomId, RoomState};

use crate::state::KvTransferError;

/// Which side's machine reports an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Side {
    /// A prefill rank.
    Prefill,
    /// A decode rank.
    Decode,
}

impl Side {
    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a machine refuses: a room it cannot admit, a chunk it cannot take. The agents of
/// `kvbridge-coordinator` report each as the `CoordinatorError` variant of the same name and
/// text.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MachineError {
    /// The room failed; the reason is the first one recorded for it.
    #[error(transparent)]
    Transfer(#[from] KvTransferError),

    /// The room already exists on this rank and was not cleared.
    #[error(
        "room {room} already exists on this {side} agent (state {state}); room ids may be \
         reused only after both sides cleared them"
    )]
    DuplicateRoom {
        /// The room asked for.
        room: RoomId,
        /// The rank's side.
        side: Side,
        /// Its current state.
        state: RoomState,
    },

    /// The operation needs a room state the room is not in yet.
    #[error(
        "room {room} is in state {state}, but {operation} needs {needed}; wait for it \
         (e.g. PrefillAgent::wait_ready) before calling {operation}"
    )]
    RoomNotReady {
        /// The room.
        room: RoomId,
        /// Its current state.
        state: RoomState,
        /// What was attempted.
        operation: &'static str,
        /// The state it needs.
        needed: RoomState,
    },

    /// The caller passed something that cannot work (wrong chunk sizes, too many rooms, ...).
    #[error("invalid {what}: {message}")]
    InvalidRequest {
        /// Which argument.
        what: &'static str,
        /// What was wrong, the values seen and the fix.
        message: String,
    },

    /// The rank was shut down.
    #[error("the {side} agent is shut down; create a new agent")]
    Shutdown {
        /// The rank's side.
        side: Side,
    },
}

/// `Result` with [`MachineError`] as the default error.
pub type Result<T, E = MachineError> = std::result::Result<T, E>;
