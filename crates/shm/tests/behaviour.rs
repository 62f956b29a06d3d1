//! Shared-memory specific behaviour beyond the conformance suite: who may connect, where the
//! control socket lives and that it goes away, what peers may write into, and cancellation of
//! large batches.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use bytes::Bytes;
use kvbridge_shm::{ShmError, ShmOptions, ShmTransport};
use kvbridge_transport::{
    BatchState, KvTransport, KvTransportExt, MemoryRegion, TransferBatch, TransferOp,
    TransportError,
};

fn shm_error(e: &TransportError) -> &ShmError {
    match e {
        TransportError::Custom { source, .. } => source
            .downcast_ref::<ShmError>()
            .unwrap_or_else(|| panic!("not a ShmError: {e}")),
        other => panic!("expected a shm-specific error, got {other}"),
    }
}

fn own_uid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

#[tokio::test]
async fn a_peer_of_a_user_not_allowed_is_refused_by_the_listener() {
    let strict =
        ShmTransport::with_options(ShmOptions::default().with_allow_same_uid(false)).unwrap();
    let sender = ShmTransport::new().unwrap();
    let err = sender
        .connect(&strict.local_descriptor())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(shm_error(&err), ShmError::RefusedByPeer { .. }),
        "{text}"
    );
    assert!(
        text.contains(&format!("uid {}", own_uid())) && text.contains("allowed_uids"),
        "{text}"
    );
}

#[tokio::test]
async fn the_connecting_side_checks_the_listener_too() {
    let receiver = ShmTransport::new().unwrap();
    let uid = own_uid();
    let picky = ShmTransport::with_options(
        ShmOptions::default()
            .with_allow_same_uid(false)
            .with_allowed_uids([uid.wrapping_add(1)]),
    )
    .unwrap();
    let err = picky
        .connect(&receiver.local_descriptor())
        .await
        .unwrap_err();
    assert!(
        matches!(shm_error(&err), ShmError::PeerRejected { uid: u, .. } if *u == uid),
        "{err}"
    );
    // The allow-list admits that user.
    let listed = ShmTransport::with_options(
        ShmOptions::default()
            .with_allow_same_uid(false)
            .with_allowed_uids([uid]),
    )
    .unwrap();
    listed.connect(&receiver.local_descriptor()).await.unwrap();
}

#[tokio::test]
async fn a_descriptor_with_the_wrong_token_is_refused() {
    let receiver = ShmTransport::new().unwrap();
    let sender = ShmTransport::new().unwrap();
    let good = String::from_utf8(receiver.local_descriptor().to_vec()).unwrap();
    // Flip one token digit (the token follows the 15-byte prefix).
    let mut bad = good.clone().into_bytes();
    bad[15] = if bad[15] == b'0' { b'1' } else { b'0' };
    let err = sender.connect(&bad).await.unwrap_err();
    assert!(err.to_string().contains("token does not match"), "{err}");
    sender.connect(good.as_bytes()).await.unwrap();
}

#[tokio::test]
async fn the_descriptor_is_utf8_text_naming_a_private_socket() {
    let t = ShmTransport::new().unwrap();
    let text = String::from_utf8(t.local_descriptor().to_vec()).unwrap();
    assert!(text.starts_with("kvbridge-shm:1:"), "{text}");
    let dir = t.control_dir().to_path_buf();
    assert!(
        text.ends_with(&format!("{}/ctl.sock", dir.display())),
        "{text}"
    );
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("ctl.sock")), 0o600);
}

#[tokio::test]
async fn shutdown_and_drop_remove_the_control_directory() {
    let shm_before: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let a = ShmTransport::new().unwrap();
    let (_, region) = a.allocate_registered(1 << 20).await.unwrap();
    let dir = a.control_dir().to_path_buf();
    assert!(dir.exists());
    a.shutdown().await.unwrap();
    assert!(!dir.exists(), "shutdown left {}", dir.display());
    // The region stays usable by its holder after shutdown.
    region.write_at(0, b"still mapped").unwrap();

    let b = ShmTransport::new().unwrap();
    let _region = b.allocate(1 << 20).unwrap();
    let dir = b.control_dir().to_path_buf();
    drop(b);
    assert!(!dir.exists(), "drop left {}", dir.display());

    let shm_after: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        shm_after.iter().all(|f| shm_before.contains(f)),
        "new entries in /dev/shm: {shm_after:?}"
    );
}

#[tokio::test]
async fn heap_memory_is_a_fine_source_but_not_a_target() {
    let receiver = ShmTransport::new().unwrap();
    let sender = ShmTransport::new().unwrap();
    let heap = MemoryRegion::allocate(8192).unwrap();
    assert!(!ShmTransport::is_shared(&heap));
    let heap_target = receiver.register(heap).await.unwrap();
    let (shm_target, target_mem) = receiver.allocate_registered(8192).await.unwrap();
    assert!(ShmTransport::is_shared(&target_mem));

    let source = MemoryRegion::allocate(8192).unwrap();
    source.fill(0, 8192, 0x5a).unwrap();
    let source_id = sender.register(source).await.unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
    let op = |remote_region| TransferOp::new(source_id, 0, remote_region, 0, 8192);
    sender
        .transfer(peer, TransferBatch::write(vec![op(shm_target)]))
        .await
        .unwrap();
    assert_eq!(target_mem.to_vec(0, 8192).unwrap(), vec![0x5a; 8192]);

    let err = sender
        .transfer(peer, TransferBatch::write(vec![op(heap_target)]))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, TransportError::InvalidArgument { .. })
            && text.contains("not shared memory")
            && text.contains("ShmTransport::allocate"),
        "{text}"
    );
}

#[tokio::test]
async fn batches_go_out_on_connections_this_side_made() {
    let receiver = ShmTransport::new().unwrap();
    let sender = ShmTransport::new().unwrap();
    sender.connect(&receiver.local_descriptor()).await.unwrap();
    sender
        .transfer(
            sender.connect(&receiver.local_descriptor()).await.unwrap(),
            TransferBatch::write(vec![]).with_notification(Bytes::from_static(b"hi")),
        )
        .await
        .unwrap();
    let inbound = receiver.recv_notification().await.unwrap().from;
    receiver
        .probe(inbound, Duration::from_secs(2))
        .await
        .unwrap();
    let err = receiver
        .post(inbound, TransferBatch::write(vec![]))
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Unsupported { .. }), "{err}");
}

#[tokio::test]
async fn oversized_notifications_are_refused_at_post() {
    let receiver = ShmTransport::new().unwrap();
    let sender = ShmTransport::new().unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
    let big = Bytes::from(vec![0u8; (16 << 20) + 1]);
    let err = sender
        .post(peer, TransferBatch::write(vec![]).with_notification(big))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("exceeds the limit"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_large_batch_stops_it_and_nothing_lands_afterwards() {
    const LEN: usize = 64 << 20;
    let receiver = ShmTransport::new().unwrap();
    let sender = ShmTransport::new().unwrap();
    let (dst, dst_mem) = receiver.allocate_registered(LEN).await.unwrap();
    let (src, src_mem) = sender.allocate_registered(LEN).await.unwrap();
    src_mem.fill(0, LEN as u64, 0xee).unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
    // One 64 MiB descriptor: cancel must not wait for all of it.
    let op = TransferOp::new(src, 0, dst, 0, LEN as u64);
    let id = sender
        .post(
            peer,
            TransferBatch::write(vec![op]).with_notification(Bytes::from_static(b"never")),
        )
        .await
        .unwrap();
    let state = sender.cancel(id).await.unwrap();
    let landed = dst_mem.to_vec(0, LEN as u64).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        dst_mem.to_vec(0, LEN as u64).unwrap() == landed,
        "bytes landed after cancel returned {state:?}"
    );
    match state {
        BatchState::Cancelled => {
            let err = sender.wait(id).await.unwrap_err();
            assert!(matches!(err, TransportError::Cancelled { .. }), "{err}");
            // A cancelled batch never notifies.
            let none =
                tokio::time::timeout(Duration::from_millis(50), receiver.recv_notification()).await;
            assert!(none.is_err(), "{none:?}");
        }
        BatchState::Done => sender.wait(id).await.unwrap(),
        other => panic!("cancel returned {other:?}"),
    }
}

#[tokio::test]
async fn connections_beyond_the_limit_are_refused_until_one_closes() {
    // No connection is idle long enough to be evicted; a waiting peer is refused at the
    // handshake deadline.
    let receiver = ShmTransport::with_options(
        ShmOptions::default()
            .with_max_inbound_connections(1)
            .with_evict_idle_after(Duration::from_secs(3600))
            .with_handshake_timeout(Duration::from_millis(300)),
    )
    .unwrap();
    let first = ShmTransport::new().unwrap();
    first.connect(&receiver.local_descriptor()).await.unwrap();
    let second = ShmTransport::new().unwrap();
    let err = second
        .connect(&receiver.local_descriptor())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("max_inbound_connections = 1"),
        "the refusal names the limit: {text}"
    );
    // The slot is free again once the first peer is gone.
    drop(first);
    let mut tries = 0;
    while let Err(e) = second.connect(&receiver.local_descriptor()).await {
        tries += 1;
        assert!(
            tries < 200,
            "still refused after the first peer closed: {e}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(matches!(
        ShmTransport::with_options(ShmOptions::default().with_max_inbound_connections(0)),
        Err(TransportError::InvalidArgument { .. })
    ));
}
