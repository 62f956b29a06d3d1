//! Test doubles for [`KvTransport`](kvbridge_transport::KvTransport).
//!
//! - [`LoopbackTransport`]: in-process, real semantics, no sockets. The default transport for
//!   behaviour tests of code built on kvbridge; it passes the whole conformance suite.
//! - [`FaultInjector`]: a decorator over any transport that delays batches, fails the n-th one,
//!   drops or delays notifications, disconnects after n bytes or stalls forever — scripted
//!   deterministically with [`FaultScript`].
//! - [`MockKvTransport`]: the mockall mock of the trait, for interaction tests (which calls, with
//!   what arguments, in what order).

mod fault;
mod loopback;

pub use fault::{FaultInjector, FaultScript};
pub use kvbridge_transport::MockKvTransport;
pub use loopback::{LoopbackConfig, LoopbackTransport};
