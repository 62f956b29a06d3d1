//! kvbridge-coordinator: prefill and decode agents that turn "send these pages of request R to
//! whoever is decoding it" into handshakes, plans, transport batches and a status you can poll.
//!
//! * [`PrefillAgent`] / [`DecodeAgent`] — one per rank, each built from its
//!   [`PeerDescriptor`](kvbridge_handshake::PeerDescriptor), its registered [`KvMemory`] and an
//!   `Arc<dyn KvTransport>`, talking over a [`ControlChannel`].
//! * [`ControlChannel`] — the small async trait the agents talk over; [`InProcessControlHub`]
//!   implements it in one process, a network implementation frames the same
//!   [`ControlMessage`]s as JSON.
//! * [`PrefillDirectory`] — how a decode finds the prefill ranks behind a bootstrap address
//!   ([`StaticDirectory`] in one process).
//! * [`RoomState`] / [`RoomStatus`] — SGLang's `KVPoll` state machine with its update rule;
//!   [`RankAgreement`] — the pluggable cross-rank MIN.
//! * [`testing`] — fill prefill memory with bytes derived from (entry, position) and verify
//!   every byte a decode rank holds.

mod agreement;
mod channel;
mod config;
mod decode;
mod directory;
mod error;
mod memory;
mod messages;
mod metrics;
mod outbox;
mod plan;
mod prefill;
mod state;
pub mod testing;
mod timer;

pub use agreement::{LocalOnly, RankAgreement, SharedMin};
pub use channel::{
    ControlChannel, DEFAULT_HUB_QUEUE, DynControlChannel, Endpoint, Envelope, InProcessChannel,
    InProcessControlHub,
};
pub use config::{DecodeConfig, PrefillConfig};
pub use decode::{DecodeAgent, DecodeAgentBuilder, FenceReport, ReceiveRequest};
pub use directory::{PrefillDirectory, PrefillRankInfo, StaticDirectory};
pub use error::{CoordinatorError, Result};
pub use memory::{AllocatedMemory, EntryRegion, KvMemory};
pub use messages::{
    AbortAck, AbortRequest, CONTROL_PROTOCOL_VERSION, ControlMessage, Heartbeat, Registration,
    RegistrationOutcome, RegistrationReply, StatusUpdate, TransferInfo, TransportInfo, WireProblem,
    WireRegion, render_problems,
};
pub use metrics::{LATENCY_BUCKETS_MS, LatencyHistogram, MetricsSnapshot};
pub use plan::Chunk;
pub use prefill::{PrefillAgent, PrefillAgentBuilder};
pub use state::{
    FailureCause, FailureReason, KvTransferError, RoomState, RoomStatus,
    UNKNOWN_REASON_FROM_ANOTHER_RANK,
};
