//! A `Delegate` decorator (the byte-counting wrapper of `kvbridge_transport::delegate`) over
//! `LoopbackTransport` keeps the whole contract, and counts what it should.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbridge_conformance::TransportPair;
use kvbridge_mock::LoopbackTransport;
use kvbridge_transport::{
    BatchId, KvTransport, KvTransportExt, PeerId, Result, TransferBatch, TransferOp,
};

/// Counts the bytes of every batch posted through it; everything else is the inner
/// transport's.
struct Counting<T> {
    inner: T,
    posted: AtomicU64,
}

impl<T> Counting<T> {
    fn new(inner: T) -> Self {
        Self {
            inner,
            posted: AtomicU64::new(0),
        }
    }
}

#[async_trait::async_trait]
impl<T: KvTransport> kvbridge_transport::Delegate for Counting<T> {
    fn inner(&self) -> &dyn KvTransport {
        &self.inner
    }

    async fn post(&self, peer: PeerId, batch: TransferBatch) -> Result<BatchId> {
        let bytes = batch.total_bytes();
        let id = self.inner.post(peer, batch).await?;
        self.posted.fetch_add(bytes, Ordering::Relaxed);
        Ok(id)
    }
}

async fn counting_pair() -> TransportPair {
    TransportPair::new(
        Arc::new(Counting::new(LoopbackTransport::new())),
        Arc::new(Counting::new(LoopbackTransport::new())),
    )
}

mod counting_loopback {
    kvbridge_conformance::conformance_tests!(super::counting_pair);
}

#[tokio::test]
async fn counts_posted_bytes_and_forwards_everything_else() {
    let sender = Counting::new(LoopbackTransport::new());
    let receiver = LoopbackTransport::new();
    assert_eq!(sender.name(), receiver.name());
    assert_eq!(sender.capabilities(), receiver.capabilities());
    let (src, src_mem) = sender.allocate_registered(8192).await.unwrap();
    let (dst, dst_mem) = receiver.allocate_registered(8192).await.unwrap();
    src_mem.fill(0, 8192, 3).unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
    let op = |offset, len| TransferOp::new(src, offset, dst, offset, len);
    sender
        .transfer(peer, TransferBatch::write(vec![op(0, 100), op(4096, 28)]))
        .await
        .unwrap();
    sender
        .transfer(peer, TransferBatch::write(vec![op(200, 1000)]))
        .await
        .unwrap();
    // A refused batch moved nothing and is not counted.
    assert!(
        sender
            .post(peer, TransferBatch::write(vec![op(8000, 1000)]))
            .await
            .is_err()
    );
    assert_eq!(sender.posted.load(Ordering::Relaxed), 1128);
    assert_eq!(dst_mem.to_vec(0, 100).unwrap(), vec![3; 100]);
    assert_eq!(dst_mem.to_vec(100, 100).unwrap(), vec![0; 100]);
    sender.shutdown().await.unwrap();
    assert!(sender.connect(&receiver.local_descriptor()).await.is_err());
}
