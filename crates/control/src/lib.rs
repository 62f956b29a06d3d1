//! `kvbridge-control`: how kvbridge agents exchange small control messages (registration,
//! per-room metadata, status, abort, abort-ack, heartbeat). KV bytes never travel here.
//!
//! Plain data, always available:
//!
//! * [`ControlMessage`] and its payloads — plain serde data, JSON on the wire, versioned by
//!   [`CONTROL_PROTOCOL_VERSION`] ([`ProtocolVersion`]: same major, the lower minor);
//!   [`Endpoint`] names an agent.
//! * [`ids`] — typed room, incarnation, generation and session ids; [`RoomState`] and
//!   [`FailureCause`], the state and cause a status carries.
//! * [`TraceParent`] — the W3C trace context a room's `transfer_info` may carry.
//! * [`PrefillRankInfo`] — a prefill rank (control endpoint and descriptor) as a bootstrap
//!   registry publishes it.
//! * [`ControlError`] — the one error type; a third-party channel depends on this crate
//!   alone and reports its own failures as [`ControlError::Custom`].
//!
//! With the default feature `channel` (tokio, async-trait, the kvbridge-auth handshake):
//! `ControlChannel`, `Envelope`, the in-process hub, the `tcp` channel and the `listen`
//! accept step. Without it the crate depends on no async runtime, so sans-IO state machines
//! (driven from Python or a C ABI) can use its data.
//!
//! docs/control-protocol.md specifies every message, field, version rule and bound.
#![cfg_attr(
    feature = "channel",
    doc = r#"
The channel side:

* [`ControlChannel`] — the small async trait the agents talk over, with its contract;
  [`Envelope`] is a received message and its sender.
* [`InProcessControlHub`] — every agent in one process, with JSON round-tripping and fault
  injection (partition, stall).
* [`tcp::TcpControlChannel`] — the channel over TCP between processes or hosts, with the
  kvbridge-auth shared-secret handshake.

```
use kvbridge_control::{ControlChannel, ControlMessage, Heartbeat, InProcessControlHub};
# #[tokio::main(flavor = "current_thread")]
# async fn main() -> kvbridge_control::Result<()> {
let hub = InProcessControlHub::new();
let (a, b) = (hub.channel("a")?, hub.channel("b")?);
a.send(&b.local_endpoint(), ControlMessage::Ping(Heartbeat { nonce: 1 })).await?;
assert_eq!(b.recv().await?.message, ControlMessage::Ping(Heartbeat { nonce: 1 }));
# Ok(()) }
```
"#
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "channel")]
#[cfg_attr(docsrs, doc(cfg(feature = "channel")))]
pub mod channel;
mod endpoint;
mod error;
#[cfg(all(test, feature = "channel"))]
mod fuzz;
pub mod ids;
#[cfg(feature = "channel")]
#[cfg_attr(docsrs, doc(cfg(feature = "channel")))]
pub mod listen;
pub mod messages;
mod rank;
mod state;
#[cfg(feature = "channel")]
#[cfg_attr(docsrs, doc(cfg(feature = "channel")))]
pub mod tcp;
mod trace;
mod version;

#[cfg(feature = "channel")]
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
pub use rank::PrefillRankInfo;
pub use state::{FailureCause, RoomState};
pub use trace::TraceParent;
pub use version::ProtocolVersion;
