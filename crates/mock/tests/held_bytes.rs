//! A copy into bytes a local access holds waits for it on the runtime's timer, not on the
//! runtime's thread: other tasks run meanwhile, and the copy lands once the bytes are free.

use std::time::{Duration, Instant};

use kvbridge_mock::LoopbackTransport;
use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};

#[tokio::test(flavor = "current_thread")]
async fn a_copy_into_held_bytes_waits_on_the_timer_and_lands() {
    let sender = LoopbackTransport::new();
    let receiver = LoopbackTransport::new();
    let (src, src_mem) = sender.allocate_registered(64).await.unwrap();
    let (dst, dst_mem) = receiver.allocate_registered(64).await.unwrap();
    src_mem.write_at(0, b"landed when free").unwrap();
    let peer = sender.connect(&receiver.local_descriptor()).await.unwrap();
    // Held on another thread for 300 ms.
    let held = dst_mem.borrow_mut(8, 16).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(held);
    });
    let batch = TransferBatch::write(vec![TransferOp::new(src, 0, dst, 8, 16)]);
    let id = sender.post(peer, batch).await.unwrap();
    // The runtime's only thread keeps running other work while the copy waits: a blocking
    // claim would have held it (and this ticker) for the whole 300 ms.
    let started = Instant::now();
    let mut ticks = 0;
    while started.elapsed() < Duration::from_millis(150) {
        tokio::time::sleep(Duration::from_millis(5)).await;
        ticks += 1;
    }
    assert!(
        ticks >= 5,
        "the runtime's thread ran {ticks} ticks in 150 ms"
    );
    release.join().unwrap();
    tokio::time::timeout(Duration::from_secs(5), sender.wait(id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dst_mem.to_vec(8, 16).unwrap(), b"landed when free");
}
