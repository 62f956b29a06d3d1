//! Interaction tests with `MockKvTransport` (mockall): which calls a piece of code makes, with
//! what arguments, in what order — here for a small "push with one retry" helper of the kind
//! a coordinator builds on the trait.
//!
//! The mock is scripted the way the contract says a transport answers, and
//! `the_scripted_sequence_is_what_a_real_transport_does` runs the same helper and the same
//! calls against a real one, so the script cannot drift from the contract.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvbridge_mock::mockall::Sequence;
use kvbridge_mock::mockall::predicate::eq;
use kvbridge_mock::{FaultInjector, FaultScript, LoopbackTransport, MockKvTransport};
use kvbridge_transport::{
    BatchId, DynKvTransport, KvTransport, KvTransportExt, PeerId, RegionId, TransferBatch,
    TransferOp, TransportError,
};

/// Code under test: posts a batch; if it times out, posts it once more. A batch whose `wait`
/// returned `TimedOut` is already fenced (no byte of it lands later) and forgotten (contract
/// points 3 and 7), so there is nothing to cancel.
async fn push_with_one_retry(
    transport: &DynKvTransport,
    peer: PeerId,
    batch: TransferBatch,
) -> Result<(), TransportError> {
    let id = transport.post(peer, batch.clone()).await?;
    match transport.wait(id).await {
        Err(TransportError::TimedOut { .. }) => {
            let id = transport.post(peer, batch).await?;
            transport.wait(id).await
        }
        other => other,
    }
}

fn batch_to(local_region: RegionId, remote_region: RegionId) -> TransferBatch {
    TransferBatch::write(vec![TransferOp::new(
        local_region,
        0,
        remote_region,
        4096,
        4096,
    )])
    .with_notification(Bytes::from_static(b"room 7"))
    .with_timeout(Duration::from_millis(500))
}

fn batch() -> TransferBatch {
    batch_to(RegionId(1), RegionId(2))
}

/// The mock as a transport that times out the first batch and completes the second.
fn timing_out_once(seq: &mut Sequence) -> MockKvTransport {
    let mut mock = MockKvTransport::new();
    mock.expect_post()
        .withf(|peer, b| *peer == PeerId(3) && b.ops.len() == 1 && b.notification.is_some())
        .times(1)
        .in_sequence(seq)
        .returning(|_, _| Ok(BatchId(10)));
    mock.expect_wait()
        .with(eq(BatchId(10)))
        .times(1)
        .in_sequence(seq)
        .returning(|b| {
            Err(TransportError::TimedOut {
                batch: b,
                timeout: Duration::from_millis(500),
            })
        });
    mock.expect_post()
        .times(1)
        .in_sequence(seq)
        .returning(|_, _| Ok(BatchId(11)));
    mock.expect_wait()
        .with(eq(BatchId(11)))
        .times(1)
        .in_sequence(seq)
        .returning(|_| Ok(()));
    mock
}

#[tokio::test]
async fn timed_out_batch_is_retried_once_without_a_cancel() {
    let mut seq = Sequence::new();
    let mut mock = timing_out_once(&mut seq);
    // A cancel after `wait` reported the batch could only be `UnknownBatch`.
    mock.expect_cancel().never();
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

/// The mock's script, replayed on `LoopbackTransport` whose first batch stalls: the first
/// `wait` is `TimedOut`, a `cancel` of that batch afterwards is `UnknownBatch` (contract point
/// 7), the retry lands the bytes and its notification.
#[tokio::test(start_paused = true)]
async fn the_scripted_sequence_is_what_a_real_transport_does() {
    let sender = FaultInjector::new(LoopbackTransport::new(), FaultScript::new().stall_batch(0));
    let receiver = LoopbackTransport::new();
    let (src, src_mem) = sender.allocate_registered(8192).await.unwrap();
    let (dst, dst_mem) = receiver.allocate_registered(8192).await.unwrap();
    src_mem.fill(0, 4096, 0x5a).unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();

    let first = sender.post(peer, batch_to(src, dst)).await.unwrap();
    let r = sender.wait(first).await;
    assert!(
        matches!(r, Err(TransportError::TimedOut { batch, .. }) if batch == first),
        "{r:?}"
    );
    let r = sender.cancel(first).await;
    assert!(
        matches!(r, Err(TransportError::UnknownBatch { batch, .. }) if batch == first),
        "{r:?}"
    );
    assert_eq!(dst_mem.to_vec(4096, 4096).unwrap(), vec![0; 4096]);

    // The helper, on a fresh transport with the same fault, makes exactly the mock's calls.
    let sender = FaultInjector::new(LoopbackTransport::new(), FaultScript::new().stall_batch(0));
    let (src, src_mem) = sender.allocate_registered(8192).await.unwrap();
    src_mem.fill(0, 4096, 0x5a).unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
    push_with_one_retry(&sender, peer, batch_to(src, dst))
        .await
        .unwrap();
    assert_eq!(dst_mem.to_vec(4096, 4096).unwrap(), vec![0x5a; 4096]);
    assert_eq!(
        receiver.recv_notification().await.unwrap().payload,
        "room 7"
    );
}
