//! `kvbridge-machines`: the rules of kvbridge's prefill and decode ranks as plain state
//! machines, and the planning of a chunk into transport descriptors.
//!
//! A machine holds what one rank knows and nothing else: no tasks, no channels, no clock, no
//! I/O (no tokio in this crate's dependency tree). Its driver feeds it events with the current
//! instant — `handle(event, now)` — carries out the actions it answers (send a control message,
//! connect, post a chunk, cancel the batches in flight, report a state), and calls `handle`
//! again with the timer event once `poll_timeout()` has passed. So every rule can be tested by
//! driving a machine step by step with explicit instants, and any runtime — the tokio agents
//! of `kvbridge-coordinator`, a Python or C++ engine's own loop — can drive the same rules.
//!
//! * [`prefill::PrefillMachine`] — one per prefill rank: its rooms ([`prefill::PrefillRoom`]),
//!   the metadata held for rooms not created yet, the decode ranks that registered per session,
//!   the connections found lost; [`prefill::SendProgress`] is a room's batch accounting.
//! * [`decode::DecodeMachine`] — one per decode rank: its rooms, registrations, heartbeats and
//!   fences.
//! * [`plan::PeerPlan`] — one (prefill rank, decode rank) pair's plan: a [`plan::Chunk`] to the
//!   transport ops of each destination.
//! * [`Lifecycle`], [`FailureReason`], [`KvTransferError`] — a room's state under SGLang's
//!   update rule and its first failure reason; [`MachineError`] — what a machine refuses.
//! * [`PrefillConfig`], [`DecodeConfig`] — the ranks' deadlines and bounds.
//!
//! docs/lifecycle.md states every rule the machines implement.
//!
//! Driving a prefill rank's machine from a loop of your own: create a room, let its bootstrap
//! deadline pass, and carry out what the machine answers.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvbridge_control::{Endpoint, RoomState};
//! use kvbridge_machines::prefill::{Action, PrefillMachine, RankAction, RankEvent, RoomConfig};
//!
//! let config = RoomConfig {
//!     rank: 0,
//!     endpoint: Endpoint::new("prefill-0"),
//!     bootstrap_timeout: Duration::from_secs(30),
//!     waiting_timeout: Duration::from_secs(300),
//! };
//! // `()`: this driver keeps no handle per decode rank.
//! let mut machine = PrefillMachine::<()>::new(config, 1024);
//! let t0 = Instant::now();
//! let room = 7.into();
//! machine.admit(room)?;
//! machine.handle(RankEvent::Create { room }, t0);
//! // No decode rank sent its metadata: the deadline is due in 30 s.
//! let due = machine.poll_timeout().unwrap();
//! assert_eq!(due, t0 + Duration::from_secs(30));
//! for action in machine.handle(RankEvent::Timer, due) {
//!     if let RankAction::Room { action: Action::Report { state, reason }, .. } = action {
//!         assert_eq!(state, RoomState::Failed);
//!         assert!(reason.unwrap().message.contains("timed out"));
//!     }
//! }
//! # Ok::<(), kvbridge_machines::MachineError>(())
//! ```

mod config;
pub mod decode;
mod error;
pub mod plan;
pub mod prefill;
#[cfg(test)]
mod sim;
mod state;

pub use config::{DecodeConfig, PackBuffers, PrefillConfig};
pub use error::{MachineError, Result, Side};
pub use kvbridge_control::{FailureCause, RoomState};
pub use state::{FailureReason, KvTransferError, Lifecycle, UNKNOWN_REASON_FROM_ANOTHER_RANK};

use kvbridge_control::RoomId;

/// Whether a rank may open one more room: not shut down, the id not held (`existing` is the
/// held room's state), fewer than `max_rooms` held. `how_to_free` ends the message of a full
/// rank (what the caller should do).
fn admit_room(
    side: Side,
    room: RoomId,
    closed: bool,
    existing: Option<RoomState>,
    held: usize,
    max_rooms: usize,
    how_to_free: &str,
) -> Result<()> {
    if closed {
        return Err(MachineError::Shutdown { side });
    }
    if let Some(state) = existing {
        return Err(MachineError::DuplicateRoom { room, side, state });
    }
    if held >= max_rooms {
        return Err(MachineError::InvalidRequest {
            what: "room",
            message: format!(
                "this {side} agent already holds {held} rooms (max_rooms); {how_to_free}"
            ),
        });
    }
    Ok(())
}
