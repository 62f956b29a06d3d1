//! A room's state and failure cause: the wire types statuses carry (docs/control-protocol.md,
//! "status"; the update rule is docs/lifecycle.md's).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a room is in its life (SGLang's `KVPoll`). Ordered by value, so the MIN over ranks is
/// the cross-rank agreement and `max` is the monotonic update.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "snake_case")]
pub enum RoomState {
    /// Terminal: the transfer failed (value 0).
    Failed = 0,
    /// Handshake not complete (value 1).
    #[default]
    Bootstrapping = 1,
    /// Handshake done; prefill waits for KV to send, decode waits for KV (value 2).
    WaitingForInput = 2,
    /// Chunks in flight (value 3).
    Transferring = 3,
    /// Terminal: every byte and the aux rows landed (value 4).
    Success = 4,
}

impl RoomState {
    /// All states, in value order.
    pub const ALL: [RoomState; 5] = [
        RoomState::Failed,
        RoomState::Bootstrapping,
        RoomState::WaitingForInput,
        RoomState::Transferring,
        RoomState::Success,
    ];

    /// Whether the state is final (Success or Failed).
    pub fn is_terminal(self) -> bool {
        matches!(self, RoomState::Success | RoomState::Failed)
    }

    /// SGLang's name, e.g. `"WaitingForInput"`.
    pub fn as_str(self) -> &'static str {
        match self {
            RoomState::Failed => "Failed",
            RoomState::Bootstrapping => "Bootstrapping",
            RoomState::WaitingForInput => "WaitingForInput",
            RoomState::Transferring => "Transferring",
            RoomState::Success => "Success",
        }
    }

    /// The result of applying `new` to `current` with the update rule (docs/lifecycle.md, "Room states":
    /// Failed is sticky, every other update is monotonic; creation is the caller's).
    pub fn apply(current: RoomState, new: RoomState) -> RoomState {
        if new == RoomState::Failed || current == RoomState::Failed {
            RoomState::Failed
        } else {
            current.max(new)
        }
    }
}

impl fmt::Display for RoomState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a room failed, as a small closed set for metrics and tests. The human text is in
/// `FailureReason::message` (kvbridge-coordinator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailureCause {
    /// The prefill room stayed in Bootstrapping past the bootstrap timeout, or the decode could
    /// not finish the handshake (directory, registration) in time.
    BootstrapTimeout,
    /// The decode sent its metadata but no Success came within the waiting timeout.
    WaitingTimeout,
    /// A transport batch did not complete by its deadline.
    BatchTimeout,
    /// A transport batch failed (peer lost, refused, ...).
    TransferError,
    /// The peer's descriptor is incompatible (every problem is in the message).
    PeerRejected,
    /// The heartbeat declared the peer dead.
    PeerLost,
    /// Aborted by the local caller (`abort`, or `clear` before the transfer ended); the peer
    /// reports [`FailureCause::RemoteFailure`].
    Aborted,
    /// Failed by the peer: a decode ABORT seen on the prefill, a prefill abort seen on the
    /// decode, or a Failed status from the prefill without a cause.
    RemoteFailure,
    /// A control message could not be delivered.
    ControlChannel,
    /// The prefill does not know this decode's registration (it restarted): the decode
    /// registers again for its next rooms.
    Unregistered,
    /// The transfer could not be planned (prefix misaligned, too few pages, ...).
    Planning,
    /// Two uses of the same room id collided.
    DuplicateRoom,
    /// The failure was only observed through cross-rank agreement.
    OtherRank,
    /// The agent shut down.
    Shutdown,
}

impl FailureCause {
    /// A stable snake_case name, as in the JSON form.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::BootstrapTimeout => "bootstrap_timeout",
            FailureCause::WaitingTimeout => "waiting_timeout",
            FailureCause::BatchTimeout => "batch_timeout",
            FailureCause::TransferError => "transfer_error",
            FailureCause::PeerRejected => "peer_rejected",
            FailureCause::PeerLost => "peer_lost",
            FailureCause::Aborted => "aborted",
            FailureCause::RemoteFailure => "remote_failure",
            FailureCause::ControlChannel => "control_channel",
            FailureCause::Unregistered => "unregistered",
            FailureCause::Planning => "planning",
            FailureCause::DuplicateRoom => "duplicate_room",
            FailureCause::OtherRank => "other_rank",
            FailureCause::Shutdown => "shutdown",
        }
    }
}

impl fmt::Display for FailureCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_is_monotonic_and_failed_is_sticky() {
        for a in RoomState::ALL {
            for b in RoomState::ALL {
                let r = RoomState::apply(a, b);
                if a == RoomState::Failed || b == RoomState::Failed {
                    assert_eq!(r, RoomState::Failed, "{a} + {b}");
                } else {
                    assert_eq!(r, a.max(b), "{a} + {b}");
                }
            }
        }
    }

    #[test]
    fn serde_names_match_sglang_states() {
        assert_eq!(
            serde_json::to_string(&RoomState::WaitingForInput).unwrap(),
            "\"waiting_for_input\""
        );
        assert_eq!(RoomState::Success as u8, 4);
        assert_eq!(RoomState::Failed as u8, 0);
    }

    #[test]
    fn causes_serialise_as_their_names() {
        for c in [
            FailureCause::TransferError,
            FailureCause::OtherRank,
            FailureCause::Shutdown,
        ] {
            assert_eq!(
                serde_json::to_string(&c).unwrap(),
                format!("\"{}\"", c.as_str())
            );
        }
    }
}
