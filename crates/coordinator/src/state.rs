//! Room states, the update rule and failure reasons (docs/lifecycle.md, "States and the
//! update rule").
//!
//! A room's state and first failure reason live in a [`Lifecycle`] (what the room machines
//! hold) and change only through [`Lifecycle::update`] / [`Lifecycle::fail`], which apply
//! SGLang's `update_status` rule: Failed is sticky, everything else is monotonic
//! (`max(current, new)`), and the first failure reason wins. [`RoomStatus`] is the same with
//! a `watch` channel, so callers can await it. Rooms absent from an agent's table are never
//! re-created by a late message: only explicit creation makes a room, so a cleared room is
//! never resurrected.

use std::fmt;
use std::sync::Arc;

use kvbridge_transport::TransportError;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::ids::RoomId;

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

    /// The result of applying `new` to `current` with the update rule (Failed is sticky,
    /// otherwise the larger state wins; creation is the caller's, see docs/lifecycle.md).
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
/// [`FailureReason::message`].
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
/// the room machines (`crate::room`) hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Lifecycle {
    state: RoomState,
    reason: Option<FailureReason>,
}

impl Lifecycle {
    /// A new room. Only Bootstrapping and WaitingForInput create rooms; anything else is
    /// clamped to Bootstrapping.
    pub(crate) fn new(initial: RoomState) -> Self {
        let state = match initial {
            RoomState::WaitingForInput => RoomState::WaitingForInput,
            _ => RoomState::Bootstrapping,
        };
        Self {
            state,
            reason: None,
        }
    }

    pub(crate) fn state(&self) -> RoomState {
        self.state
    }

    pub(crate) fn reason(&self) -> Option<&FailureReason> {
        self.reason.as_ref()
    }

    /// Applies the update rule; returns whether the state changed.
    pub(crate) fn update(&mut self, new: RoomState) -> bool {
        let next = RoomState::apply(self.state, new);
        let changed = next != self.state;
        self.state = next;
        changed
    }

    /// Records `reason` if none is recorded yet (first wins) and sets Failed; returns whether
    /// this call moved the room to Failed.
    pub(crate) fn fail(&mut self, reason: FailureReason) -> bool {
        if self.reason.is_none() {
            self.reason = Some(reason);
        }
        self.update(RoomState::Failed)
    }

    /// The error to report for the room (`None` unless Failed).
    pub(crate) fn error(&self, room: RoomId) -> Option<KvTransferError> {
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
    life: Lifecycle,
}

impl RoomStatus {
    /// A new room. Only [`RoomState::Bootstrapping`] and [`RoomState::WaitingForInput`] create
    /// rooms; anything else is clamped to Bootstrapping.
    pub fn new(initial: RoomState) -> Self {
        let life = Lifecycle::new(initial);
        Self {
            state: watch::Sender::new(life.state()),
            life,
        }
    }

    /// The current state.
    pub fn state(&self) -> RoomState {
        self.life.state()
    }

    /// The recorded failure reason, if any.
    pub fn reason(&self) -> Option<&FailureReason> {
        self.life.reason()
    }

    /// Applies the update rule; returns whether the state changed. A `Failed` update without a
    /// reason is allowed (the reason may come from another rank); prefer [`fail`](Self::fail).
    pub fn update(&mut self, new: RoomState) -> bool {
        let changed = self.life.update(new);
        if changed {
            self.state.send_replace(self.life.state());
        }
        changed
    }

    /// Records `reason` if none is recorded yet (first wins) and sets Failed. Returns whether
    /// this call moved the room to Failed (false when it already was).
    pub fn fail(&mut self, reason: FailureReason) -> bool {
        let changed = self.life.fail(reason);
        if changed {
            self.state.send_replace(self.life.state());
        }
        changed
    }

    /// A receiver that observes every change (for awaiting).
    pub fn subscribe(&self) -> watch::Receiver<RoomState> {
        self.state.subscribe()
    }

    /// The error to report for this room (`None` unless Failed).
    pub fn error(&self, room: impl Into<RoomId>) -> Option<KvTransferError> {
        self.life.error(room.into())
    }
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

    #[test]
    fn serde_names_match_sglang_states() {
        assert_eq!(
            serde_json::to_string(&RoomState::WaitingForInput).unwrap(),
            "\"waiting_for_input\""
        );
        assert_eq!(RoomState::Success as u8, 4);
        assert_eq!(RoomState::Failed as u8, 0);
    }
}
