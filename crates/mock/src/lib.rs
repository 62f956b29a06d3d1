//! Test doubles for [`KvTransport`](kvbridge_transport::KvTransport).
//!
//! - [`LoopbackTransport`]: in-process, real semantics, no sockets. The default transport for
//!   behaviour tests of code built on kvbridge; it passes the whole conformance suite.
//! - [`FaultInjector`]: a decorator over any transport that delays batches, fails the n-th one,
//!   drops or delays notifications, disconnects after n bytes or stalls forever — scripted
//!   deterministically with [`FaultScript`].
//! - [`MockKvTransport`]: the mockall mock of the trait, for interaction tests (which calls, with
//!   what arguments, in what order). [`mockall`] itself is re-exported, so `Sequence` and
//!   `predicate` come in the version the mock was generated with, without a dependency of your
//!   own.
//!
//! # Scripting a mock
//!
//! A mock must answer as a real transport would, or the test proves nothing. Under the contract
//! (point 7 on [`KvTransport`](kvbridge_transport::KvTransport)) `wait` returns a batch's final
//! state once and then forgets the batch, so a batch whose `wait` returned
//! [`TimedOut`](kvbridge_transport::TransportError::TimedOut) is already fenced and needs no
//! `cancel`: a `cancel` would fail with
//! [`UnknownBatch`](kvbridge_transport::TransportError::UnknownBatch).
//!
//! ```
//! use std::time::Duration;
//! use kvbridge_mock::MockKvTransport;
//! use kvbridge_mock::mockall::{Sequence, predicate::eq};
//! use kvbridge_transport::{BatchId, KvTransport, PeerId, TransferBatch, TransportError};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let mut mock = MockKvTransport::new();
//! let mut seq = Sequence::new();
//! mock.expect_post().times(1).in_sequence(&mut seq).returning(|_, _| Ok(BatchId(1)));
//! mock.expect_wait().with(eq(BatchId(1))).times(1).in_sequence(&mut seq).returning(|b| {
//!     Err(TransportError::TimedOut { batch: b, timeout: Duration::from_secs(1) })
//! });
//! // What a real transport answers for a batch `wait` already reported.
//! mock.expect_cancel().returning(|b| {
//!     Err(TransportError::UnknownBatch { batch: b, transport: "mock" })
//! });
//!
//! let id = mock.post(PeerId(0), TransferBatch::write(vec![])).await.unwrap();
//! assert!(matches!(mock.wait(id).await, Err(TransportError::TimedOut { .. })));
//! assert!(matches!(mock.cancel(id).await, Err(TransportError::UnknownBatch { .. })));
//! # }
//! ```

mod fault;
mod loopback;

pub use fault::{FaultInjector, FaultScript};
pub use kvbridge_transport::MockKvTransport;
pub use loopback::{LoopbackConfig, LoopbackTransport};
/// The mocking library [`MockKvTransport`] was generated with (`Sequence`, `predicate`, ...).
pub use mockall;
