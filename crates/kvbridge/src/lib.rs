//! kvbridge moves an LLM's KV cache from the prefill servers that computed it to the decode
//! servers that generate from it (PD disaggregation), decode context parallelism included.
//!
//! This crate is the one dependency to start with: it re-exports the workspace's crates behind
//! features, so an integrator takes exactly the pieces it embeds.
//!
//! ```toml
//! [dependencies]
//! kvbridge = { version = "0.1", features = ["coordinator", "tcp"] }
//! ```
//!
//! | feature | module | what it gives you | runtime |
//! |---|---|---|---|
//! | `planner` (default) | `planner` (`kvbridge-geometry`) | pool geometry, the DCP owner rule, token, page and any-to-any plans, byte ranges | sans-IO |
//! | `handshake` (default) | `handshake` (`kvbridge-handshake`) | peer descriptors and their builders, every compatibility check with a code and a remedy, rank mapping | sans-IO |
//! | `transport` | `transport` (`kvbridge-transport`) | the `KvTransport` trait, registered memory | none |
//! | `mock` | `mock` (`kvbridge-mock`) | `LoopbackTransport`, `FaultInjector`, `MockKvTransport` | tokio |
//! | `shm` | `shm` (`kvbridge-shm`) | the shared-memory transport | tokio |
//! | `tcp` | `tcp` (`kvbridge-tcp`) | the TCP transport | tokio |
//! | `auth` | `auth` (`kvbridge-auth`) | the shared secret, its one challenge-response, the random source | none |
//! | `control` | `control` (`kvbridge-control`) | the `ControlChannel` trait, control messages, typed ids, the in-process and TCP channels | tokio |
//! | `bootstrap` | `bootstrap` (`kvbridge-bootstrap`) | the bootstrap registry server and client, prefill directories (implies `control`) | tokio |
//! | `machines` | `machines` (`kvbridge-machines`) | the sans-IO machines of a prefill and a decode rank, chunk planning (for an engine's own event loop) | none |
//! | `coordinator` | `coordinator` (`kvbridge-coordinator`) | prefill and decode agents, the request lifecycle (implies `planner`, `handshake`, `transport`, `control`, `bootstrap`, `machines`) | tokio |
//! | `full` | all of the above | | tokio |
//!
//! The conformance suite for a transport of your own is a dev-dependency of its own,
//! `kvbridge-conformance` (`conformance_tests!`).
//!
//! The defaults are the sans-IO pieces: no async runtime, no I/O. `docs/embedding.md` in the
//! repository walks through each way of embedding (planner alone, checks alone, a custom
//! transport and the conformance suite, tests with the mocks, the whole coordinator), every
//! example compiled and run by this crate's doctests.
//!
//! ```
//! # #[cfg(feature = "handshake")] {
//! use kvbridge::handshake::{PeerDescriptor, Role, check};
//! let prefill = PeerDescriptor::mla(Role::Prefill, 64, 61, 1152).build()?;
//! let decode = PeerDescriptor::mla(Role::Decode, 64, 61, 1152).attn_tp(4, 1).dcp(4).build()?;
//! assert!(check(&prefill, &decode).is_compatible());
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "planner")]
#[cfg_attr(docsrs, doc(cfg(feature = "planner")))]
#[doc(inline)]
pub use kvbridge_geometry as planner;

#[cfg(feature = "handshake")]
#[cfg_attr(docsrs, doc(cfg(feature = "handshake")))]
#[doc(inline)]
pub use kvbridge_handshake as handshake;

#[cfg(feature = "transport")]
#[cfg_attr(docsrs, doc(cfg(feature = "transport")))]
#[doc(inline)]
pub use kvbridge_transport as transport;

#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
#[doc(inline)]
pub use kvbridge_mock as mock;

#[cfg(feature = "shm")]
#[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
#[doc(inline)]
pub use kvbridge_shm as shm;

#[cfg(feature = "tcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "tcp")))]
#[doc(inline)]
pub use kvbridge_tcp as tcp;

#[cfg(feature = "auth")]
#[cfg_attr(docsrs, doc(cfg(feature = "auth")))]
#[doc(inline)]
pub use kvbridge_auth as auth;

#[cfg(feature = "control")]
#[cfg_attr(docsrs, doc(cfg(feature = "control")))]
#[doc(inline)]
pub use kvbridge_control as control;

#[cfg(feature = "bootstrap")]
#[cfg_attr(docsrs, doc(cfg(feature = "bootstrap")))]
#[doc(inline)]
pub use kvbridge_bootstrap as bootstrap;

#[cfg(feature = "machines")]
#[cfg_attr(docsrs, doc(cfg(feature = "machines")))]
#[doc(inline)]
pub use kvbridge_machines as machines;

#[cfg(feature = "coordinator")]
#[cfg_attr(docsrs, doc(cfg(feature = "coordinator")))]
#[doc(inline)]
pub use kvbridge_coordinator as coordinator;

/// The examples of `docs/embedding.md`, compiled and run as doctests.
#[cfg(all(doctest, feature = "full"))]
#[doc = include_str!("../../../docs/embedding.md")]
mod embedding {}
