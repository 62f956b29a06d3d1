//! kvbridge-bootstrap: how decode ranks find a prefill deployment's ranks.
//!
//! A prefill deployment runs one [`BootstrapServer`] (embedded in the prefill process, on
//! 127.0.0.1 by default). Each prefill rank registers its control endpoint and
//! [`PeerDescriptor`](kvbridge_handshake::PeerDescriptor) with `PUT /route`; a decode fetches
//! the deployment's parameters (`GET /route` with all ranks `-1`), one rank's endpoint
//! (`GET /route` with concrete ranks) or every rank at once (`GET /ranks`), and polls
//! `GET /health`. [`HttpDirectory`] is the [`PrefillDirectory`] a decode agent uses across
//! processes, [`StaticDirectory`] the one in a single process; [`BootstrapClient`] speaks every
//! route. The server also serves `GET /metrics` from a source its builder is given
//! ([`BootstrapServerBuilder::metrics`]). Routes, payloads and bounds are in
//! `docs/bootstrap.md`.
//!
//! The HTTP/1.1 server and client are small and bounded on purpose (heads parsed by
//! `httparse`, no HTTP framework): one request per connection, `Content-Length` bodies only,
//! limits on head size, header count, body size and time, and a 4xx with a message for
//! anything else. Nothing a peer sends can panic the server or size an allocation beyond the
//! configured limits.
//!
//! ```
//! use kvbridge_bootstrap::{BootstrapClient, BootstrapConfig, BootstrapServer, RankRegistration};
//! use kvbridge_handshake::{PeerDescriptor, Role};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> kvbridge_bootstrap::Result<()> {
//! let server = BootstrapServer::bind(BootstrapConfig::default()).await?;
//! let client = BootstrapClient::new(server.bootstrap_addr());
//! client.health().await?;
//! let descriptor = PeerDescriptor::mla(Role::Prefill, 64, 1, 1152).build().unwrap();
//! client.register(&RankRegistration::new("127.0.0.1:17000", descriptor)).await?;
//! assert!(client.readiness().await?.ready);
//! let ranks = client.ranks().await?;
//! assert_eq!(ranks[0].endpoint.as_str(), "127.0.0.1:17000");
//! # Ok(()) }
//! ```

mod auth;
mod client;
mod directory;
mod error;
// kvbridge-control's mutation harness, shared as one file rather than copied; its corpus
// path is relative to the crate that compiles it (`tests/corpus/http` here).
#[cfg(test)]
#[path = "../../control/src/fuzz.rs"]
mod fuzz;
mod http;
mod registry;
mod server;

pub use client::{BootstrapClient, ClientConfig, HttpDirectory, HttpReply};
pub use directory::{PrefillDirectory, StaticDirectory};
pub use error::{BootstrapError, Result};
pub use kvbridge_auth::Secret;
/// The control endpoint a rank publishes (kvbridge-control's).
pub use kvbridge_control::Endpoint;
/// One prefill rank as published to the registry (kvbridge-control's, so tokio-free code can
/// read it).
pub use kvbridge_control::PrefillRankInfo;
pub use registry::{
    DpRankEntry, DpRankQuery, MAX_DEPLOYMENT_RANKS, MISSING_INPUTS, PrefillServerInfo,
    RankEndpoint, RankList, RankRegistration, Readiness, Refusal, Registry,
};
pub use server::{BootstrapConfig, BootstrapServer, BootstrapServerBuilder, MetricsSource};
