//! Test doubles for [`KvTransport`](kvbridge_transport::KvTransport).
//!
//! - [`LoopbackTransport`]: in-process, real semantics, no sockets. The default transport for
//!   behaviour tests of code built on kvbridge; it passes the whole conformance suite.
//! - [`MockKvTransport`]: the mockall mock of the trait, for interaction tests (which calls, with
//!   what arguments, in what order).

mod loopback;

pub use kvbridge_transport::MockKvTransport;
pub use loopback::{LoopbackConfig, LoopbackTransport};
