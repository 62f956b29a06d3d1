//! Interaction tests with `MockKvTransport` (mockall): which calls a piece of code makes, with
//! what arguments, in what order — here for a small "push with one retry" helper of the kind
//! a coordinator builds on the trait.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvbridge_mock::MockKvTransport;
use kvbridge_transport::{
    BatchId, BatchState, DynKvTransport, PeerId, RegionId, TransferBatch, TransferOp,
    TransportError,
};
use mockall::Sequence;
use mockall::predicate::eq;

/// Code under test: posts a batch; if it times out, cancels it (fencing late writes) and posts
/// it once more.
async fn push_with_one_retry(
    transport: &DynKvTransport,
    peer: PeerId,
    batch: TransferBatch,
) -> Result<(), TransportError> {
    let id = transport.post(peer, batch.clone()).await?;
    match transport.wait(id).await {
        Err(TransportError::TimedOut { .. }) => {
            transport.cancel(id).await.ok();
            let id = transport.post(peer, batch).await?;
            transport.wait(id).await
        }
        other => other,
    }
}

fn batch() -> TransferBatch {
    TransferBatch::write(vec![TransferOp {
        local_region: RegionId(1),
        local_offset: 0,
        remote_region: RegionId(2),
        remote_offset: 4096,
        len: 4096,
    }])
    .with_notification(Bytes::from_static(b"room 7"))
    .with_timeout(Duration::from_millis(500))
}

#[tokio::test]
async fn timed_out_batch_is_cancelled_then_retried_once() {
    let mut mock = MockKvTransport::new();
    let mut seq = Sequence::new();
    mock.expect_post()
        .withf(|peer, b| *peer == PeerId(3) && b.ops.len() == 1 && b.notification.is_some())
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| Ok(BatchId(10)));
    mock.expect_wait()
        .with(eq(BatchId(10)))
        .times(1)
        .in_sequence(&mut seq)
        .returning(|b| {
            Err(TransportError::TimedOut {
                batch: b,
                timeout: Duration::from_millis(500),
            })
        });
    mock.expect_cancel()
        .with(eq(BatchId(10)))
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(BatchState::TimedOut));
    mock.expect_post()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| Ok(BatchId(11)));
    mock.expect_wait()
        .with(eq(BatchId(11)))
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));

    let transport: Arc<DynKvTransport> = Arc::new(mock);
    push_with_one_retry(&*transport, PeerId(3), batch())
        .await
        .unwrap();
}

#[tokio::test]
async fn other_failures_are_not_retried() {
    let mut mock = MockKvTransport::new();
    mock.expect_post().times(1).returning(|_, _| Ok(BatchId(1)));
    mock.expect_wait().times(1).returning(|b| {
        Err(TransportError::BatchFailed {
            batch: b,
            peer: PeerId(3),
            reason: "peer refused".into(),
        })
    });
    mock.expect_cancel().never();
    let r = push_with_one_retry(&mock, PeerId(3), batch()).await;
    assert!(
        matches!(r, Err(TransportError::BatchFailed { .. })),
        "{r:?}"
    );
}
