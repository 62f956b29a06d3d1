//! One test per `FaultScript` fault mode: the failure surfaces as the documented final state.
//!
//! Time is paused (`start_paused`), so delays and deadlines run on tokio's virtual clock:
//! deterministic and instant.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvbridge_mock::{FaultInjector, FaultScript, LoopbackTransport};
use kvbridge_transport::{
    BatchState, KvTransport, KvTransportExt, MemoryRegion, PeerId, RegionId, TransferBatch,
    TransferOp, TransportError,
};
use tokio::time::Instant;

struct Setup {
    sender: Arc<FaultInjector<LoopbackTransport>>,
    receiver: Arc<FaultInjector<LoopbackTransport>>,
    peer: PeerId,
    src: (RegionId, MemoryRegion),
    dst: (RegionId, MemoryRegion),
}

const LEN: usize = 4096;

async fn setup(sender_script: FaultScript, receiver_script: FaultScript) -> Setup {
    let sender = Arc::new(FaultInjector::new(LoopbackTransport::new(), sender_script));
    let receiver = Arc::new(FaultInjector::new(
        LoopbackTransport::new(),
        receiver_script,
    ));
    let src = sender.allocate_registered(LEN).await.unwrap();
    let dst = receiver.allocate_registered(LEN).await.unwrap();
    let bytes: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8 + 1).collect();
    src.1.write_at(0, &bytes).unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
    Setup {
        sender,
        receiver,
        peer,
        src,
        dst,
    }
}

impl Setup {
    /// A batch copying `src[offset..offset+len]` to the same place in `dst`.
    fn batch(&self, offset: u64, len: u64, timeout: Duration) -> TransferBatch {
        TransferBatch::write(vec![TransferOp::new(
            self.src.0, offset, self.dst.0, offset, len,
        )])
        .with_timeout(timeout)
    }

    fn landed(&self, offset: u64, len: u64) -> bool {
        self.dst.1.to_vec(offset, len).unwrap() == self.src.1.to_vec(offset, len).unwrap()
    }

    fn untouched(&self, offset: u64, len: u64) -> bool {
        self.dst
            .1
            .to_vec(offset, len)
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    }
}

#[tokio::test(start_paused = true)]
async fn delayed_batch_lands_after_its_delay_or_times_out() {
    let s = setup(
        FaultScript::new().delay_batches(Duration::from_millis(300)),
        FaultScript::new(),
    )
    .await;
    let id = s
        .sender
        .post(s.peer, s.batch(0, 100, Duration::from_secs(1)))
        .await
        .unwrap();
    assert_eq!(s.sender.batch_state(id).unwrap(), BatchState::Pending);
    assert!(
        s.untouched(0, 100),
        "a delayed batch landed before its delay"
    );
    let start = Instant::now();
    s.sender.wait(id).await.unwrap();
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(s.landed(0, 100));

    // A delay longer than the deadline: TimedOut, and nothing lands even after the delay.
    let id = s
        .sender
        .post(s.peer, s.batch(200, 100, Duration::from_millis(100)))
        .await
        .unwrap();
    let r = s.sender.wait(id).await;
    assert!(
        matches!(r, Err(TransportError::TimedOut { batch, .. }) if batch == id),
        "{r:?}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(s.untouched(200, 100), "a timed-out delayed batch landed");
}

#[tokio::test(start_paused = true)]
async fn nth_batch_fails_without_moving_bytes_or_notifying() {
    let s = setup(FaultScript::new().fail_batch(1), FaultScript::new()).await;
    let note = |b: TransferBatch, text: &'static str| {
        b.with_notification(Bytes::from_static(text.as_bytes()))
    };
    s.sender
        .transfer(
            s.peer,
            note(s.batch(0, 10, Duration::from_secs(1)), "first"),
        )
        .await
        .unwrap();
    let id = s
        .sender
        .post(
            s.peer,
            note(s.batch(100, 10, Duration::from_secs(1)), "second"),
        )
        .await
        .unwrap();
    assert!(matches!(
        s.sender.batch_state(id),
        Ok(BatchState::Failed(_))
    ));
    let r = s.sender.wait(id).await;
    assert!(
        matches!(&r, Err(TransportError::BatchFailed { batch, peer, .. }) if *batch == id && *peer == s.peer),
        "{r:?}"
    );
    assert!(r.unwrap_err().to_string().contains("batch number 1"));
    assert!(s.untouched(100, 10));
    s.sender
        .transfer(
            s.peer,
            note(s.batch(200, 10, Duration::from_secs(1)), "third"),
        )
        .await
        .unwrap();
    assert!(s.landed(0, 10) && s.landed(200, 10));
    let got: Vec<Bytes> = vec![
        s.receiver.recv_notification().await.unwrap().payload,
        s.receiver.recv_notification().await.unwrap().payload,
    ];
    assert_eq!(
        got,
        [Bytes::from_static(b"first"), Bytes::from_static(b"third")]
    );
}

#[tokio::test(start_paused = true)]
async fn stalled_batch_times_out_by_its_deadline_or_is_cancelled() {
    let s = setup(FaultScript::new().stall_all_batches(), FaultScript::new()).await;
    let start = Instant::now();
    let id = s
        .sender
        .post(s.peer, s.batch(0, 10, Duration::from_millis(250)))
        .await
        .unwrap();
    let r = s.sender.wait(id).await;
    assert!(
        matches!(r, Err(TransportError::TimedOut { batch, timeout }) if batch == id && timeout == Duration::from_millis(250)),
        "{r:?}"
    );
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_millis(300),
        "{waited:?}"
    );
    assert!(s.untouched(0, 10));

    let id = s
        .sender
        .post(s.peer, s.batch(0, 10, Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(s.sender.cancel(id).await.unwrap(), BatchState::Cancelled);
    assert!(
        matches!(s.sender.wait(id).await, Err(TransportError::Cancelled { batch }) if batch == id)
    );
    assert!(matches!(
        s.sender.wait(id).await,
        Err(TransportError::UnknownBatch { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn only_the_nth_batch_stalls() {
    let s = setup(FaultScript::new().stall_batch(0), FaultScript::new()).await;
    let stalled = s
        .sender
        .post(s.peer, s.batch(0, 10, Duration::from_millis(100)))
        .await
        .unwrap();
    s.sender
        .transfer(s.peer, s.batch(100, 10, Duration::from_secs(1)))
        .await
        .unwrap();
    assert!(s.landed(100, 10));
    assert!(matches!(
        s.sender.wait(stalled).await,
        Err(TransportError::TimedOut { .. })
    ));
    assert!(s.untouched(0, 10));
}

#[tokio::test(start_paused = true)]
async fn dropped_notification_never_arrives_but_its_batch_is_done() {
    let s = setup(FaultScript::new(), FaultScript::new().drop_notification(0)).await;
    for (i, text) in ["dropped", "kept"].into_iter().enumerate() {
        let b = s
            .batch(i as u64 * 100, 10, Duration::from_secs(1))
            .with_notification(Bytes::from_static(text.as_bytes()));
        s.sender.transfer(s.peer, b).await.unwrap();
    }
    assert!(s.landed(0, 10) && s.landed(100, 10));
    assert_eq!(
        &s.receiver.recv_notification().await.unwrap().payload[..],
        b"kept"
    );
    let more = tokio::time::timeout(Duration::from_secs(1), s.receiver.recv_notification()).await;
    assert!(more.is_err(), "a dropped notification arrived: {more:?}");

    let all = setup(
        FaultScript::new(),
        FaultScript::new().drop_all_notifications(),
    )
    .await;
    let b = all
        .batch(0, 10, Duration::from_secs(1))
        .with_notification(Bytes::from_static(b"x"));
    all.sender.transfer(all.peer, b).await.unwrap();
    let more = tokio::time::timeout(Duration::from_secs(1), all.receiver.recv_notification()).await;
    assert!(more.is_err(), "a dropped notification arrived: {more:?}");
}

#[tokio::test(start_paused = true)]
async fn delayed_notification_arrives_late_and_after_the_data() {
    let s = setup(
        FaultScript::new(),
        FaultScript::new().delay_notifications(Duration::from_millis(400)),
    )
    .await;
    let b = s
        .batch(0, 64, Duration::from_secs(1))
        .with_notification(Bytes::from_static(b"late"));
    s.sender.transfer(s.peer, b).await.unwrap();
    let start = Instant::now();
    let n = s.receiver.recv_notification().await.unwrap();
    assert!(start.elapsed() >= Duration::from_millis(400));
    assert_eq!(&n.payload[..], b"late");
    assert!(s.landed(0, 64));
}

#[tokio::test(start_paused = true)]
async fn disconnect_after_bytes_lands_exactly_the_prefix_then_loses_the_peer() {
    let s = setup(
        FaultScript::new().disconnect_after_bytes(100),
        FaultScript::new(),
    )
    .await;
    s.sender
        .transfer(s.peer, s.batch(0, 60, Duration::from_secs(1)))
        .await
        .unwrap();
    // 40 more bytes are allowed: the next batch (30 + 50 bytes) is cut 10 bytes into its
    // second descriptor.
    let batch = TransferBatch::write(vec![
        TransferOp::new(s.src.0, 1000, s.dst.0, 1000, 30),
        TransferOp::new(s.src.0, 2000, s.dst.0, 2000, 50),
    ])
    .with_notification(Bytes::from_static(b"never"))
    .with_timeout(Duration::from_secs(1));
    let id = s.sender.post(s.peer, batch).await.unwrap();
    let r = s.sender.wait(id).await;
    assert!(
        matches!(&r, Err(TransportError::PeerLost { peer, .. }) if *peer == s.peer),
        "{r:?}"
    );
    assert!(s.landed(0, 60));
    assert!(s.landed(1000, 30));
    assert!(
        s.landed(2000, 10) && s.untouched(2010, 40),
        "not exactly the 40-byte prefix"
    );
    let later = s
        .sender
        .post(s.peer, s.batch(3000, 1, Duration::from_secs(1)))
        .await;
    assert!(
        matches!(later, Err(TransportError::PeerLost { .. })),
        "{later:?}"
    );
    assert!(
        s.sender
            .probe(s.peer, Duration::from_secs(1))
            .await
            .is_err()
    );
    let n = tokio::time::timeout(Duration::from_secs(1), s.receiver.recv_notification()).await;
    assert!(n.is_err(), "a cut batch notified: {n:?}");
}
