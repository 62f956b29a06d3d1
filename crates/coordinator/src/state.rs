//! A room's status as the agents publish it: [`Lifecycle`] (the state under the update rule
//! and the first failure reason, kept by the machines of `kvbridge-machines`) with a `watch`
//! channel, so callers can poll and await it.

use tokio::sync::watch;

use crate::error::{CoordinatorError, Side};
use crate::ids::RoomId;

pub use kvbridge_control::{FailureCause, RoomState};
use kvbridge_machines::Lifecycle;
pub use kvbridge_machines::{FailureReason, KvTransferError, UNKNOWN_REASON_FROM_ANOTHER_RANK};

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

impl RoomStatus {
    /// What a caller gets once the room ended badly: its [`KvTransferError`] when Failed,
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

#[cfg(test)]
mod tests {
    use super::*;

    // The update rule itself is `Lifecycle`'s (kvbridge-machines tests it); a status adds the
    // channel that publishes each change.
    #[test]
    fn a_status_publishes_every_change_and_keeps_the_first_reason() {
        let mut s = RoomStatus::new(RoomState::Bootstrapping);
        let mut rx = s.subscribe();
        assert!(s.update(RoomState::Transferring));
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), RoomState::Transferring);
        assert!(!s.update(RoomState::WaitingForInput), "no going back");
        assert!(
            !rx.has_changed().unwrap(),
            "nothing published without a change"
        );
        assert!(s.fail(FailureReason::new(FailureCause::Aborted, "first")));
        assert!(!s.fail(FailureReason::new(FailureCause::PeerLost, "second")));
        assert_eq!(*rx.borrow_and_update(), RoomState::Failed);
        assert_eq!(
            s.error(7).unwrap().to_string(),
            "KVTransferError(bootstrap_room=7): first [cause: aborted]"
        );
        assert_eq!(
            RoomStatus::new(RoomState::Success).state(),
            RoomState::Bootstrapping,
            "only early states create rooms"
        );
    }
}
