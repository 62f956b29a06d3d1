//! `kvbridge-control`: how kvbridge agents exchange small control messages (registration,
//! per-room metadata, status, abort, abort-ack, heartbeat). KV bytes never travel here.
//!
//! * [`ControlChannel`] — the small async trait the agents talk over, with its contract;
//!   [`Endpoint`] names an agent, [`Envelope`] is a received message and its sender.
//! * [`ControlMessage`] and its payloads — plain serde data, JSON on the wire, versioned by
//!   [`CONTROL_PROTOCOL_VERSION`] ([`ProtocolVersion`]: same major, the lower minor).
//! * [`InProcessControlHub`] — every agent in one process, with JSON round-tripping and fault
//!   injection (partition, stall).
//! * [`tcp::TcpControlChannel`] — the channel over TCP between processes or hosts, with the
//!   kvbridge-auth shared-secret handshake.
//! * [`ids`] — typed room, incarnation, generation and session ids; [`RoomState`] and
//!   [`FailureCause`], the state and cause a status carries.
//! * [`ControlError`] — the one error type; a third-party channel depends on this crate
//!   alone and reports its own failures as [`ControlError::Custom`].
//!
//! docs/control-protocol.md specifies every message, field, version rule and bound.
//!
//! ```
//! use kvbridge_control::{ControlChannel, ControlMessage, Heartbeat, InProcessControlHub};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> kvbridge_control::Result<()> {
//! let hub = InProcessControlHub::new();
//! let (a, b) = (hub.channel("a")?, hub.channel("b")?);
//! a.send(&b.local_endpoint(), ControlMessage::Ping(Heartbeat { nonce: 1 })).await?;
//! assert_eq!(b.recv().await?.message, ControlMessage::Ping(Heartbeat { nonce: 1 }));
//! # Ok(()) }
//! ```

pub mod channel;
mod endpoint;
mod error;
#[cfg(test)]
mod fuzz;
pub mod ids;
pub mod listen;
pub mod messages;
mod state;
pub mod tcp;
mod version;

pub use channel::{
    ControlChannel, DEFAULT_HUB_QUEUE, DynControlChannel, Envelope, InProcessChannel,
    InProcessControlHub,
};
pub use endpoint::Endpoint;
pub use error::{ControlError, Result};
pub use ids::{Generation, Incarnation, RoomId, SessionId};
pub use messages::{
    AbortAck, AbortRequest, CONTROL_PROTOCOL_VERSION, ControlMessage, Heartbeat, Registration,
    RegistrationOutcome, RegistrationReply, StatusUpdate, TransferInfo, TransportInfo, WireProblem,
    WireRegion, render_problems,
};
pub use state::{FailureCause, RoomState};
pub use version::ProtocolVersion;
