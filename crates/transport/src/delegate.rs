//! [`Delegate`]: write a transport decorator by overriding only the methods it changes.
//!
//! A decorator wraps a transport and changes a little of what it does: counts bytes, injects
//! faults, logs, throttles. Implement [`Delegate`] instead of [`KvTransport`]: name the wrapped
//! transport in [`Delegate::inner`], override the methods the decorator changes, and every other
//! method forwards to the inner transport. A blanket implementation makes every `Delegate` a
//! [`KvTransport`] (and so a [`KvTransportExt`](crate::KvTransportExt)).
//!
//! # Why a trait and not a macro
//!
//! `Delegate` carries one default method per [`KvTransport`] method, so overriding one is an
//! ordinary method in an ordinary `#[async_trait]` impl block, with the compiler checking its
//! signature against the trait. A forwarding macro would have to sit inside the
//! `#[async_trait]` block, which expands before the macro does and so never rewrites the
//! forwarded `async fn`s, or generate the whole block itself and be told which methods not to
//! forward.
//!
//! Forwarding costs one extra boxed future per async call, which is noise next to a batch.
//!
//! # Example: a byte-counting wrapper
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use kvbridge_transport::{BatchId, Delegate, KvTransport, PeerId, Result, TransferBatch};
//!
//! /// Counts the bytes of every batch posted through it; everything else is the inner
//! /// transport's.
//! struct Counting<T> {
//!     inner: T,
//!     posted: AtomicU64,
//! }
//!
//! #[async_trait::async_trait]
//! impl<T: KvTransport> Delegate for Counting<T> {
//!     fn inner(&self) -> &dyn KvTransport {
//!         &self.inner
//!     }
//!
//!     async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
//!         let bytes = batch.total_bytes();
//!         let id = self.inner.post(peer, batch).await?;
//!         self.posted.fetch_add(bytes, Ordering::Relaxed);
//!         Ok(id)
//!     }
//! }
//!
//! // A `Counting` is a transport like any other.
//! fn counted(inner: Arc<dyn KvTransport>) -> Arc<dyn KvTransport> {
//!     Arc::new(Counting { inner, posted: AtomicU64::new(0) })
//! }
//! # let _ = counted;
//! ```
//!
//! `crates/mock/tests/delegate.rs` runs this wrapper over `LoopbackTransport` through the whole
//! conformance suite.
//!
//! # Caveat
//!
//! `Delegate`'s methods have the names of [`KvTransport`]'s, so in a scope that imports both
//! traits, `wrapper.post(..)` is ambiguous. Implement it by path
//! (`impl kvbridge_transport::Delegate for ..`) without importing it, or call
//! `KvTransport::post(&wrapper, ..)`. Inside the overrides call the inner transport through
//! its own field or `self.inner()`, which is a plain `dyn KvTransport`.

use std::time::Duration;

use bytes::Bytes;

use crate::{
    BatchId, BatchState, Capabilities, KvTransport, MemoryRegion, Notification, PeerId, RegionId,
    Result, TransferBatch,
};

/// A [`KvTransport`] decorator: every method forwards to [`inner`](Self::inner) unless
/// overridden. See the [module docs](self).
///
/// A decorator keeps the [contract](KvTransport#contract) only if its overrides do: one that
/// rewrites batch ids or drops batches must answer `wait`, `cancel` and `batch_state` for them
/// as the contract says. Run the conformance suite on it.
#[async_trait::async_trait]
pub trait Delegate: Send + Sync + 'static {
    /// The wrapped transport, to which every method not overridden forwards.
    fn inner(&self) -> &dyn KvTransport;

    /// [`KvTransport::name`]: the inner transport's name.
    fn name(&self) -> &'static str {
        self.inner().name()
    }

    /// [`KvTransport::capabilities`].
    fn capabilities(&self) -> Capabilities {
        self.inner().capabilities()
    }

    /// [`KvTransport::allocate`]: the inner transport's memory (e.g. shared memory).
    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        self.inner().allocate(len)
    }

    /// [`KvTransport::register`].
    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        self.inner().register(region).await
    }

    /// [`KvTransport::deregister`].
    async fn deregister(&self, region: RegionId) -> Result<()> {
        self.inner().deregister(region).await
    }

    /// [`KvTransport::local_descriptor`].
    fn local_descriptor(&self) -> Bytes {
        self.inner().local_descriptor()
    }

    /// [`KvTransport::connect`].
    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        self.inner().connect(descriptor).await
    }

    /// [`KvTransport::disconnect`].
    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        self.inner().disconnect(peer).await
    }

    /// [`KvTransport::post`].
    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        self.inner().post(peer, batch).await
    }

    /// [`KvTransport::batch_state`].
    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        self.inner().batch_state(batch)
    }

    /// [`KvTransport::wait`].
    async fn wait(&self, batch: BatchId) -> Result<()> {
        self.inner().wait(batch).await
    }

    /// [`KvTransport::cancel`].
    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        self.inner().cancel(batch).await
    }

    /// [`KvTransport::recv_notification`].
    async fn recv_notification(&self) -> Result<Notification> {
        self.inner().recv_notification().await
    }

    /// [`KvTransport::probe`].
    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        self.inner().probe(peer, timeout).await
    }

    /// [`KvTransport::shutdown`].
    async fn shutdown(&self) -> Result<()> {
        self.inner().shutdown().await
    }
}

#[async_trait::async_trait]
impl<D: Delegate> KvTransport for D {
    fn name(&self) -> &'static str {
        Delegate::name(self)
    }
    fn capabilities(&self) -> Capabilities {
        Delegate::capabilities(self)
    }
    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        Delegate::allocate(self, len)
    }
    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        Delegate::register(self, region).await
    }
    async fn deregister(&self, region: RegionId) -> Result<()> {
        Delegate::deregister(self, region).await
    }
    fn local_descriptor(&self) -> Bytes {
        Delegate::local_descriptor(self)
    }
    async fn connect(&self, descriptor: &[u8]) -> Result<PeerId> {
        Delegate::connect(self, descriptor).await
    }
    async fn disconnect(&self, peer: PeerId) -> Result<()> {
        Delegate::disconnect(self, peer).await
    }
    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        Delegate::post(self, peer, batch).await
    }
    fn batch_state(&self, batch: BatchId) -> Result<BatchState> {
        Delegate::batch_state(self, batch)
    }
    async fn wait(&self, batch: BatchId) -> Result<()> {
        Delegate::wait(self, batch).await
    }
    async fn cancel(&self, batch: BatchId) -> Result<BatchState> {
        Delegate::cancel(self, batch).await
    }
    async fn recv_notification(&self) -> Result<Notification> {
        Delegate::recv_notification(self).await
    }
    async fn probe(&self, peer: PeerId, timeout: Duration) -> Result<()> {
        Delegate::probe(self, peer, timeout).await
    }
    async fn shutdown(&self) -> Result<()> {
        Delegate::shutdown(self).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mockall::predicate::eq;

    use super::*;
    use crate::{KvTransportExt, MockKvTransport, TransferOp};

    /// Overrides `name` and `post` only.
    struct Renamed(MockKvTransport);

    #[async_trait::async_trait]
    impl Delegate for Renamed {
        fn inner(&self) -> &dyn KvTransport {
            &self.0
        }
        fn name(&self) -> &'static str {
            "renamed"
        }
        async fn post(&self, peer: PeerId, mut batch: TransferBatch) -> Result<BatchId> {
            batch.ops.clear();
            self.0.post(peer, batch).await
        }
    }

    #[tokio::test]
    async fn overrides_replace_and_the_rest_forwards_unchanged() {
        let mut mock = MockKvTransport::new();
        mock.expect_name().never();
        mock.expect_capabilities()
            .times(1)
            .return_const(Capabilities::minimal().with_reads(true));
        mock.expect_post()
            .withf(|peer, b| *peer == PeerId(2) && b.ops.is_empty())
            .times(1)
            .returning(|_, _| Ok(BatchId(5)));
        mock.expect_wait()
            .with(eq(BatchId(5)))
            .times(1)
            .returning(|_| Ok(()));
        mock.expect_cancel()
            .with(eq(BatchId(6)))
            .times(1)
            .returning(|_| Ok(BatchState::Done));
        mock.expect_local_descriptor()
            .times(1)
            .returning(|| Bytes::from_static(b"inner"));
        let t: Arc<dyn KvTransport> = Arc::new(Renamed(mock));
        assert_eq!(t.name(), "renamed");
        assert!(t.capabilities().reads);
        assert_eq!(t.local_descriptor(), "inner");
        let op = TransferOp::new(RegionId(0), 0, RegionId(0), 0, 8);
        t.transfer(PeerId(2), TransferBatch::write(vec![op]))
            .await
            .unwrap();
        assert_eq!(t.cancel(BatchId(6)).await.unwrap(), BatchState::Done);
    }
}
