//! Room states, the update rule and failure reasons (docs/lifecycle.md, "States and the
//! update rule").
//!
//! A room's state and first failure reason live in a [`Lifecycle`] (what the room machines
//! hold) and change only through [`Lifecycle::update`] / [`Lifecycle::fail`], which apply
//! SGLang's `update_status` rule: Failed is sticky, everything else is monotonic
//! (`max(current, new)`), and the first failure reason wins. Rooms absent from a machine are
//! never re-created by a late message: only explicit creation makes a room, so a cleared room
//! is never resurrected.

use std::fmt;
use std::sync::Arc;

use kvbridge_transport::TransportError;
use serde::{Deserialize, Serialize};

use kvbridge_control::RoomId;

pub(crate) use kvbridge_control::{FailureCause, RoomState};

/// The first recorded reason of a room's failure: a cause, the peer involved (if any) and the
/// text, which names both.
///
/// A reason recorded on this rank may keep the typed error behind it ([`Self::caused_by`]);
/// that stays local (it is not serialized, and equality compares what the wire carries).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailureReason {
    /// Classification for metrics.
    pub cause: FailureCause,
    /// The peer involved (control endpoint), if any.
    pub peer: Option<String>,
    /// The human text (SGLang's wording where it has one).
    pub message: String,
    #[serde(skip)]
    source: Option<Arc<TransportError>>,
}

impl PartialEq for FailureReason {
    fn eq(&self, other: &Self) -> bool {
        (self.cause, &self.peer, &self.message) == (other.cause, &other.peer, &other.message)
    }
}

impl Eq for FailureReason {}

impl FailureReason {
    /// A reason without a peer.
    pub fn new(cause: FailureCause, message: impl Into<String>) -> Self {
        Self {
            cause,
            peer: None,
            message: message.into(),
            source: None,
        }
    }

    /// A reason naming a peer.
    pub fn with_peer(
        cause: FailureCause,
        peer: impl fmt::Display,
        message: impl Into<String>,
    ) -> Self {
        Self {
            cause,
            peer: Some(peer.to_string()),
            message: message.into(),
            source: None,
        }
    }

    /// This reason, keeping the transport error that caused it (reported as the
    /// [`source`](std::error::Error::source) of the room's [`KvTransferError`]).
    #[must_use]
    pub fn caused_by(mut self, error: TransportError) -> Self {
        self.source = Some(Arc::new(error));
        self
    }

    /// The transport error behind this reason, when it was recorded on this rank.
    pub fn transport_error(&self) -> Option<&TransportError> {
        self.source.as_deref()
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// A failed room, reported like SGLang — `KVTransferError(bootstrap_room={room}): {reason}` —
/// followed by the cause and the peer involved: ` [cause: {cause}; peer: {peer}]`. Its
/// [`source`](std::error::Error::source) is the [`TransportError`] that failed the room, when a
/// batch on this rank did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvTransferError {
    /// The room.
    pub room: RoomId,
    /// The first recorded reason.
    pub reason: FailureReason,
    /// True when this rank recorded no reason of its own (the failure came from another rank
    /// through cross-rank agreement).
    pub is_from_another_rank: bool,
}

impl KvTransferError {
    /// The error of `room` failed for `reason` (recorded on this rank).
    pub fn new(room: impl Into<RoomId>, reason: FailureReason) -> Self {
        Self {
            room: room.into(),
            reason,
            is_from_another_rank: false,
        }
    }
}

impl fmt::Display for KvTransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.reason;
        write!(
            f,
            "KVTransferError(bootstrap_room={}): {r} [cause: {}",
            self.room, r.cause
        )?;
        if let Some(p) = &r.peer {
            write!(f, "; peer: {p}")?;
        }
        f.write_str("]")
    }
}

impl std::error::Error for KvTransferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.reason
            .transport_error()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Default reason when a room failed without one recorded on this rank (docs/lifecycle.md,
/// "Failure reasons").
pub const UNKNOWN_REASON_FROM_ANOTHER_RANK: &str =
    "Failed due to an unknown reason from another rank";

/// A room's state and first failure reason under the update rule, without any channel: what
/// the room machines hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lifecycle {
    state: RoomState,
    reason: Option<FailureReason>,
}

impl Lifecycle {
    /// A new room. Only Bootstrapping and WaitingForInput create rooms; anything else is
    /// clamped to Bootstrapping.
    pub fn new(initial: RoomState) -> Self {
        let state = match initial {
            RoomState::WaitingForInput => RoomState::WaitingForInput,
            _ => RoomState::Bootstrapping,
        };
        Self {
            state,
            reason: None,
        }
    }

    /// The current state.
    pub fn state(&self) -> RoomState {
        self.state
    }

    /// The first failure reason recorded, if any.
    pub fn reason(&self) -> Option<&FailureReason> {
        self.reason.as_ref()
    }

    /// Applies the update rule; returns whether the state changed.
    pub fn update(&mut self, new: RoomState) -> bool {
        let next = RoomState::apply(self.state, new);
        let changed = next != self.state;
        self.state = next;
        changed
    }

    /// Records `reason` if none is recorded yet (first wins) and sets Failed; returns whether
    /// this call moved the room to Failed.
    pub fn fail(&mut self, reason: FailureReason) -> bool {
        if self.reason.is_none() {
            self.reason = Some(reason);
        }
        self.update(RoomState::Failed)
    }

    /// The error to report for the room (`None` unless Failed).
    pub fn error(&self, room: RoomId) -> Option<KvTransferError> {
        if self.state != RoomState::Failed {
            return None;
        }
        Some(match &self.reason {
            Some(r) => KvTransferError::new(room, r.clone()),
            None => KvTransferError {
                room,
                reason: FailureReason::new(
                    FailureCause::OtherRank,
                    UNKNOWN_REASON_FROM_ANOTHER_RANK,
                ),
                is_from_another_rank: true,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_rule_is_monotonic_and_failed_is_sticky() {
        use RoomState::*;
        for a in RoomState::ALL {
            for b in RoomState::ALL {
                let r = RoomState::apply(a, b);
                if a == Failed || b == Failed {
                    assert_eq!(r, Failed, "{a} + {b}");
                } else {
                    assert_eq!(r, a.max(b), "{a} + {b}");
                    assert!(r >= a);
                }
            }
        }
        let mut s = Lifecycle::new(Bootstrapping);
        assert!(s.update(Transferring));
        assert!(!s.update(WaitingForInput), "no going back");
        assert_eq!(s.state(), Transferring);
        assert!(s.fail(FailureReason::new(FailureCause::Aborted, "first")));
        assert!(!s.fail(FailureReason::new(FailureCause::PeerLost, "second")));
        assert!(!s.update(Success), "Failed is sticky");
        assert_eq!(s.reason().unwrap().message, "first", "first reason wins");
        assert_eq!(
            s.error(7.into()).unwrap().to_string(),
            "KVTransferError(bootstrap_room=7): first [cause: aborted]"
        );
    }

    #[test]
    fn creation_only_from_early_states_and_unknown_reason_text() {
        assert_eq!(
            Lifecycle::new(RoomState::Success).state(),
            RoomState::Bootstrapping
        );
        assert_eq!(
            Lifecycle::new(RoomState::WaitingForInput).state(),
            RoomState::WaitingForInput
        );
        let mut s = Lifecycle::new(RoomState::Bootstrapping);
        s.update(RoomState::Failed);
        let e = s.error(3.into()).unwrap();
        assert!(e.is_from_another_rank);
        assert_eq!(
            e.to_string(),
            "KVTransferError(bootstrap_room=3): Failed due to an unknown reason from another rank \
             [cause: other_rank]"
        );
    }
}
