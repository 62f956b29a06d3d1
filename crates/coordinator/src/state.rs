//! The room state machine (spec 03 §2): states, the update rule, failure reasons.
//!
//! Both agents keep one [`RoomStatus`] per room and change it only through
//! [`RoomStatus::update`] / [`RoomStatus::fail`], which apply SGLang's `update_status` rule:
//! Failed is sticky, everything else is monotonic (`max(current, new)`), and the first failure
//! reason wins. Rooms absent from an agent's table are never re-created by a late message:
//! only explicit creation makes a room, so a cleared room is never resurrected.

use std::fmt;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::CoordinatorError;

/// The wire types of a room's state and failure cause live with the control messages.
pub use kvbridge_control::{FailureCause, RoomState};

/// The first recorded reason of a room's failure: a cause, the peer involved (if any) and the
/// text, which names both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureReason {
    /// Classification for metrics.
    pub cause: FailureCause,
    /// The peer involved (control endpoint), if any.
    pub peer: Option<String>,
    /// The human text (SGLang's wording where the spec gives one).
    pub message: String,
}

impl FailureReason {
    /// A reason without a peer.
    pub fn new(cause: FailureCause, message: impl Into<String>) -> Self {
        Self {
            cause,
            peer: None,
            message: message.into(),
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
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// A failed room, reported like SGLang — `KVTransferError(bootstrap_room={room}): {reason}` —
/// followed by the cause and the peer involved: ` [cause: {cause}; peer: {peer}]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KVTransferError(bootstrap_room={room}): {reason} [cause: {cause}{peer}]",
    cause = reason.cause,
    peer = reason.peer.as_deref().map(|p| format!("; peer: {p}")).unwrap_or_default())]
pub struct KvTransferError {
    /// The room.
    pub room: u64,
    /// The first recorded reason.
    pub reason: FailureReason,
    /// True when this rank recorded no reason of its own (the failure came from another rank
    /// through cross-rank agreement).
    pub is_from_another_rank: bool,
}

/// Default reason when a room failed without one recorded on this rank (spec 03 §8).
pub const UNKNOWN_REASON_FROM_ANOTHER_RANK: &str =
    "Failed due to an unknown reason from another rank";

/// One room's status: the state (observable through a `watch` channel, so it can be polled and
/// awaited) and the first failure reason.
///
/// It changes only through [`update`](Self::update) and [`fail`](Self::fail), which apply
/// SGLang's `update_status` rule: Failed is sticky, every other update is monotonic
/// (`max(current, new)`), and the first failure reason wins. Rooms are created only by the
/// local caller, never by a peer's message, so a cleared room is never resurrected.
#[derive(Debug)]
pub struct RoomStatus {
    state: watch::Sender<RoomState>,
    reason: Option<FailureReason>,
}

impl RoomStatus {
    /// A new room. Only [`RoomState::Bootstrapping`] and [`RoomState::WaitingForInput`] create
    /// rooms (rule 1); anything else is clamped to Bootstrapping.
    pub fn new(initial: RoomState) -> Self {
        let initial = match initial {
            RoomState::WaitingForInput => RoomState::WaitingForInput,
            _ => RoomState::Bootstrapping,
        };
        Self {
            state: watch::Sender::new(initial),
            reason: None,
        }
    }

    /// The current state.
    pub fn state(&self) -> RoomState {
        *self.state.borrow()
    }

    /// The recorded failure reason, if any.
    pub fn reason(&self) -> Option<&FailureReason> {
        self.reason.as_ref()
    }

    /// Applies the update rule; returns whether the state changed. A `Failed` update without a
    /// reason is allowed (the reason may come from another rank); prefer [`fail`](Self::fail).
    pub fn update(&mut self, new: RoomState) -> bool {
        let current = self.state();
        let next = RoomState::apply(current, new);
        if next != current {
            self.state.send_replace(next);
            true
        } else {
            false
        }
    }

    /// Records `reason` if none is recorded yet (first wins) and sets Failed. Returns whether
    /// this call moved the room to Failed (false when it already was).
    pub fn fail(&mut self, reason: FailureReason) -> bool {
        if self.reason.is_none() {
            self.reason = Some(reason);
        }
        self.update(RoomState::Failed)
    }

    /// A receiver that observes every change (for awaiting).
    pub fn subscribe(&self) -> watch::Receiver<RoomState> {
        self.state.subscribe()
    }

    /// The error to report for this room (`None` unless Failed).
    pub fn error(&self, room: u64) -> Option<KvTransferError> {
        if self.state() != RoomState::Failed {
            return None;
        }
        Some(match &self.reason {
            Some(r) => KvTransferError {
                room,
                reason: r.clone(),
                is_from_another_rank: false,
            },
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

    /// What a caller gets once the room ended badly: its [`KvTransferError`] when Failed,
    /// otherwise [`CoordinatorError::UnknownRoom`] (the room was cleared meanwhile).
    pub(crate) fn failure_or_unknown(&self, room: u64, side: &'static str) -> CoordinatorError {
        self.error(room)
            .map(CoordinatorError::from)
            .unwrap_or(CoordinatorError::UnknownRoom { room, side })
    }
}

/// Whether an agent may open one more room: not shut down, the id not held (`existing` is the
/// held room's state), fewer than `max_rooms` held. `how_to_free` ends the message of a full
/// agent (what the caller should do).
pub(crate) fn admit_room(
    side: &'static str,
    room: u64,
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

/// Waits on a status receiver until the room is terminal. Returns `None` when the room was
/// cleared (the sender dropped) before that.
pub(crate) async fn wait_terminal(mut rx: watch::Receiver<RoomState>) -> Option<RoomState> {
    loop {
        let s = *rx.borrow_and_update();
        if s.is_terminal() {
            return Some(s);
        }
        if rx.changed().await.is_err() {
            let s = *rx.borrow();
            return s.is_terminal().then_some(s);
        }
    }
}

/// Waits until the state is at least `target` (or terminal). `None` when cleared first.
pub(crate) async fn wait_at_least(
    mut rx: watch::Receiver<RoomState>,
    target: RoomState,
) -> Option<RoomState> {
    loop {
        let s = *rx.borrow_and_update();
        if s >= target || s.is_terminal() {
            return Some(s);
        }
        if rx.changed().await.is_err() {
            return None;
        }
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
        let mut s = RoomStatus::new(Bootstrapping);
        assert!(s.update(Transferring));
        assert!(!s.update(WaitingForInput), "no going back");
        assert_eq!(s.state(), Transferring);
        assert!(s.fail(FailureReason::new(FailureCause::Aborted, "first")));
        assert!(!s.fail(FailureReason::new(FailureCause::PeerLost, "second")));
        assert!(!s.update(Success), "Failed is sticky");
        assert_eq!(s.reason().unwrap().message, "first", "first reason wins");
        assert_eq!(
            s.error(7).unwrap().to_string(),
            "KVTransferError(bootstrap_room=7): first [cause: aborted]"
        );
    }

    #[test]
    fn creation_only_from_early_states_and_unknown_reason_text() {
        assert_eq!(
            RoomStatus::new(RoomState::Success).state(),
            RoomState::Bootstrapping
        );
        assert_eq!(
            RoomStatus::new(RoomState::WaitingForInput).state(),
            RoomState::WaitingForInput
        );
        let mut s = RoomStatus::new(RoomState::Bootstrapping);
        s.update(RoomState::Failed);
        let e = s.error(3).unwrap();
        assert!(e.is_from_another_rank);
        assert_eq!(
            e.to_string(),
            "KVTransferError(bootstrap_room=3): Failed due to an unknown reason from another rank \
             [cause: other_rank]"
        );
    }
}
