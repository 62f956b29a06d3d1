//! The one error type of `kvbridge-coordinator`.

use std::time::Duration;

use kvbridge_control::ControlError;
use kvbridge_machines::MachineError;
pub use kvbridge_machines::Side;

use crate::ids::RoomId;
use kvbridge_control::RoomState;
use kvbridge_machines::KvTransferError;

/// Everything a coordinator operation (agents, control channels, directories) can fail with.
///
/// A failed *transfer* is reported as [`CoordinatorError::Transfer`], whose text is SGLang's
/// `KVTransferError(bootstrap_room={room}): {reason}`. Control channels report through
/// [`CoordinatorError::Control`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordinatorError {
    /// The room failed; the reason is the first one recorded for it.
    #[error(transparent)]
    Transfer(#[from] KvTransferError),

    /// The room is not known to this agent (never created, or already cleared).
    #[error(
        "room {room} is not known to this {side} agent (never created, or cleared after it \
         ended); create it first and do not use a room after clear()"
    )]
    UnknownRoom {
        /// The room asked for.
        room: RoomId,
        /// The agent.
        side: Side,
    },

    /// The room already exists on this agent and was not cleared.
    #[error(
        "room {room} already exists on this {side} agent (state {state}); room ids may be \
         reused only after both sides cleared them"
    )]
    DuplicateRoom {
        /// The room asked for.
        room: RoomId,
        /// The agent.
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

    /// The caller passed something that cannot work (wrong chunk sizes, too many pages, ...).
    #[error("invalid {what}: {message}")]
    InvalidRequest {
        /// Which argument.
        what: &'static str,
        /// What was wrong, the values seen and the fix.
        message: String,
    },

    /// The agent's own configuration or memory does not match its descriptor.
    #[error("invalid agent setup: {message}")]
    InvalidSetup {
        /// What was wrong, the values seen and the fix.
        message: String,
    },

    /// A room's pages could not be proven safe to reuse in time: some sender neither
    /// acknowledged the abort nor was cut off by the transport. The pages must stay quarantined.
    #[error(
        "room {room}: no proof after {waited:?} that every sender stopped writing (still \
         unacknowledged: {pending}); keep the room's pages out of reuse, check the prefill \
         peers' health, or raise fence_timeout"
    )]
    FenceTimeout {
        /// The room.
        room: RoomId,
        /// How long we waited.
        waited: Duration,
        /// The peers that did not acknowledge, comma separated.
        pending: String,
    },

    /// The room ended in Success: there is nothing to fence, the pages hold the KV.
    #[error(
        "room {room} ended in Success, so its pages hold the transferred KV and are not \
         released by release_when_fenced; free them through your allocator when the request ends"
    )]
    NotFailed {
        /// The room.
        room: RoomId,
    },

    /// The agent was shut down.
    #[error("the {side} agent is shut down; create a new agent")]
    Shutdown {
        /// The agent.
        side: Side,
    },

    /// The control channel failed (send, timeout, closed, version, ...).
    #[error(transparent)]
    Control(#[from] ControlError),

    /// A failure specific to a third-party control channel or directory.
    #[error("{component}: {source}")]
    Custom {
        /// The component's name.
        component: &'static str,
        /// Its own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },

    /// The bootstrap registry, its client or a prefill directory failed.
    #[error(transparent)]
    Bootstrap(#[from] kvbridge_bootstrap::BootstrapError),

    /// The transport failed outside any room (connect, register, ...).
    #[error("transport {transport}: {context}: {source}")]
    Transport {
        /// The transport's name.
        transport: &'static str,
        /// What was being done.
        context: String,
        /// The transport's error.
        #[source]
        source: kvbridge_transport::TransportError,
    },
}

impl From<MachineError> for CoordinatorError {
    /// A machine's refusal as the agent reports it: the variant of the same name and text.
    fn from(e: MachineError) -> Self {
        match e {
            MachineError::Transfer(e) => Self::Transfer(e),
            MachineError::DuplicateRoom { room, side, state } => {
                Self::DuplicateRoom { room, side, state }
            }
            MachineError::RoomNotReady {
                room,
                state,
                operation,
                needed,
            } => Self::RoomNotReady {
                room,
                state,
                operation,
                needed,
            },
            MachineError::InvalidRequest { what, message } => {
                Self::InvalidRequest { what, message }
            }
            MachineError::Shutdown { side } => Self::Shutdown { side },
            other => Self::InvalidRequest {
                what: "request",
                message: other.to_string(),
            },
        }
    }
}

/// `Result` with [`CoordinatorError`] as the default error.
pub type Result<T, E = CoordinatorError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{FailureCause, FailureReason};

    #[test]
    fn a_machine_refusal_keeps_its_name_and_text() {
        let refusals = [
            MachineError::Transfer(KvTransferError::new(
                7,
                FailureReason::new(FailureCause::Aborted, "Aborted by AbortReq."),
            )),
            MachineError::DuplicateRoom {
                room: 7.into(),
                side: Side::Prefill,
                state: RoomState::Transferring,
            },
            MachineError::RoomNotReady {
                room: 7.into(),
                state: RoomState::Bootstrapping,
                operation: "send_chunk",
                needed: RoomState::WaitingForInput,
            },
            MachineError::InvalidRequest {
                what: "chunk",
                message: "too many tokens".into(),
            },
            MachineError::Shutdown { side: Side::Decode },
        ];
        for m in refusals {
            let text = m.to_string();
            let name = format!("{m:?}");
            let e = CoordinatorError::from(m);
            assert_eq!(e.to_string(), text);
            let variant = |d: &str| d.split([' ', '(', '{']).next().unwrap().to_owned();
            assert_eq!(variant(&format!("{e:?}")), variant(&name));
        }
    }
}
