//! kvbridge-coordinator: prefill and decode agents that turn "send these pages of request R to
//! whoever is decoding it" into handshakes, plans, transport batches and a status you can poll.
//!
//! * [`PrefillAgent`] / [`DecodeAgent`] — one per rank, each built from its
//!   [`PeerDescriptor`](kvbridge_handshake::PeerDescriptor), its registered [`KvMemory`] and an
//!   `Arc<dyn KvTransport>`, talking over a [`ControlChannel`].
//! * [`ControlChannel`] — the small async trait the agents talk over (kvbridge-control,
//!   re-exported here); [`InProcessControlHub`] implements it in one process,
//!   [`net_channel::NetChannel`] over TCP, both framing the same [`ControlMessage`]s as JSON.
//! * [`PrefillDirectory`] — how a decode finds the prefill ranks behind a bootstrap address
//!   ([`StaticDirectory`] in one process).
//! * [`RoomState`] / [`RoomStatus`] — SGLang's `KVPoll` state machine with its update rule;
//!   [`RankAgreement`] — the pluggable cross-rank MIN.
//!
//! # Across processes
//!
//! The agents do not change; three pieces are swapped in:
//!
//! 1. a cross-process [`KvTransport`](kvbridge_transport::KvTransport) (shared memory, TCP) —
//!    allocate the KV memory through it ([`KvMemory::allocate`]) so the peer can reach it;
//! 2. a network [`ControlChannel`] whose [`local_endpoint`](ControlChannel::local_endpoint) is
//!    a reachable address and which frames [`ControlMessage`]s as JSON, keeping per-peer order
//!    and reporting the sender's endpoint in [`Envelope::from`] ([`net_channel::NetChannel`]);
//! 3. a [`PrefillDirectory`] that returns every prefill rank's [`PrefillRankInfo`] (descriptor
//!    and control endpoint) for a bootstrap address — the prefill ranks publish
//!    [`PrefillAgent::rank_info`] to a bootstrap registry ([`bootstrap::BootstrapServer`]), the
//!    decode's directory fetches it ([`bootstrap::HttpDirectory`]).
//!
//! # Example
//!
//! The shortest complete transfer: one MLA prefill rank, one decode rank, loopback transport.
//!
//! ```
//! use std::sync::Arc;
//! use kvbridge_coordinator::{
//!     Chunk, DecodeAgent, InProcessControlHub, KvMemory, PrefillAgent, ReceiveRequest,
//!     StaticDirectory,
//! };
//! use kvbridge_handshake::{PeerDescriptor, Role};
//! use kvbridge_mock::LoopbackTransport;
//! use kvbridge_transport::KvTransport;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // MLA, 2 layers, page size 16, 576-byte token rows.
//! let desc = |role| PeerDescriptor::mla(role, 16, 2, 576).build().unwrap();
//! let hub = InProcessControlHub::new();
//! let directory = StaticDirectory::new();
//!
//! let transport: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
//! let p_mem = KvMemory::allocate(&*transport, &desc(Role::Prefill), 8, 0).await?;
//! let prefill = PrefillAgent::builder(
//!     desc(Role::Prefill), p_mem.memory.clone(), transport, Arc::new(hub.channel("prefill-0")?),
//! )
//! .start()?;
//! directory.add_rank("prefill:8998", prefill.rank_info());
//!
//! let transport: Arc<dyn KvTransport> = Arc::new(LoopbackTransport::new());
//! let d_mem = KvMemory::allocate(&*transport, &desc(Role::Decode), 8, 0).await?;
//! let decode = DecodeAgent::builder(
//!     desc(Role::Decode), d_mem.memory.clone(), transport, Arc::new(hub.channel("decode-0")?),
//!     Arc::new(directory),
//! )
//! .start()?;
//!
//! // Room 1: 40 tokens in prefill pages [3, 5, 6], wanted in decode pages [7, 1, 2].
//! // The prefill "computes" room 1's KV: token p's row in layer l is 576 bytes of p + l, in
//! // slot p % 16 of page pages[p / 16].
//! let slot = |pages: &[u64], p: u64| pages[(p / 16) as usize] * 16 + p % 16;
//! let byte = |layer: usize, p: u64| (p as u8).wrapping_add(layer as u8);
//! for (layer, (region, entry)) in p_mem.kv_regions.iter().zip(&p_mem.memory.kv).enumerate() {
//!     for p in 0..40 {
//!         region.fill(entry.offset + slot(&[3, 5, 6], p) * 576, 576, byte(layer, p))?;
//!     }
//! }
//! prefill.create_room(1)?;
//! decode.receive(1, ReceiveRequest {
//!     bootstrap_addr: "prefill:8998".into(),
//!     page_table: vec![7, 1, 2],
//!     cached_prefix_len: 0,
//!     aux_index: 0,
//! })?;
//! let prefix = prefill.wait_ready(1).await?; // 0: the decode holds nothing yet
//! assert_eq!(prefix, 0);
//! prefill.send_chunk(1, Chunk::last(vec![3, 5, 6], 40, None)).await?;
//! decode.wait(1).await?;
//! prefill.wait(1).await?;
//!
//! for (layer, (region, entry)) in d_mem.kv_regions.iter().zip(&d_mem.memory.kv).enumerate() {
//!     for p in 0..40 {
//!         let row = region.to_vec(entry.offset + slot(&[7, 1, 2], p) * 576, 576)?;
//!         assert!(row.iter().all(|&b| b == byte(layer, p)), "layer {layer}, token {p}");
//!     }
//! }
//! # Ok(())
//! # }
//! ```

mod agreement;
/// The bootstrap registry, server and client: [`kvbridge_bootstrap`], re-exported.
pub use kvbridge_bootstrap as bootstrap;
/// The sans-IO machines the agents drive, and chunk planning: [`kvbridge_machines`],
/// re-exported.
pub use kvbridge_machines as machines;
mod decode;
/// The prefill directories ([`kvbridge_bootstrap`]), under the path the agents use.
mod directory {
    pub use kvbridge_bootstrap::{PrefillDirectory, PrefillRankInfo, StaticDirectory};
}
mod error;
mod memory;
mod metrics;
pub mod net_channel;
mod outbox;
mod prefill;
mod shell;
mod start;
mod state;
mod trace;

// The control channel, its messages and ids are kvbridge-control's; these keep the paths
// `crate::channel`, `crate::messages` and `kvbridge_coordinator::ids` of earlier releases.
pub use kvbridge_control::ids;
use kvbridge_control::{channel, messages};

pub use agreement::{LocalOnly, RankAgreement, SharedMin};
pub use decode::{DecodeAgent, DecodeAgentBuilder, FenceReport, ReceiveRequest};
pub use directory::{PrefillDirectory, PrefillRankInfo, StaticDirectory};
pub use error::{CoordinatorError, Result, Side};
pub use kvbridge_control::{
    AbortAck, AbortRequest, CONTROL_PROTOCOL_VERSION, ControlMessage, Heartbeat, Registration,
    RegistrationOutcome, RegistrationReply, StatusUpdate, TransferInfo, TransportInfo, WireProblem,
    WireRegion, render_problems,
};
pub use kvbridge_control::{
    ControlChannel, ControlError, DEFAULT_HUB_QUEUE, DynControlChannel, Endpoint, Envelope,
    InProcessChannel, InProcessControlHub, ProtocolVersion,
};
pub use kvbridge_control::{Generation, Incarnation, RoomId, SessionId, TraceParent};
pub use kvbridge_machines::plan::Chunk;
pub use kvbridge_machines::{DecodeConfig, PackBuffers, PrefillConfig};
pub use memory::{AllocatedMemory, EntryRegion, KvMemory};
pub use metrics::{LATENCY_BUCKETS_MS, LatencyHistogram, MetricsSnapshot, prometheus};
pub use prefill::{PrefillAgent, PrefillAgentBuilder};
pub use state::{
    FailureCause, FailureReason, KvTransferError, RoomState, RoomStatus,
    UNKNOWN_REASON_FROM_ANOTHER_RANK,
};
pub use trace::{set_batch_span_status, set_span_parent};
