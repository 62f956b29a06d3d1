//! The transport conformance suite, run against kvbridge-tcp:
//!
//! - `copy_receive_secret_two_connections`: every case (`conformance_tests!`, directly and as
//!   `Arc<dyn KvTransport>`), with a shared secret, two connections per peer, 64 KiB pieces
//!   (so batches are spread over connections and cancels land between pieces) and payloads
//!   received through the bounce buffer (`receive_in_place = false`).
//! - `in_place_defaults`: the default configuration (payloads read straight into regions) on
//!   every case but `notification_after_data`. That case reads the receiver's *whole* region
//!   (`MemoryRegion::to_vec`) while later batches are still landing; a receiver that reads the
//!   socket into the region through `MemoryRegion::borrow_mut` makes exactly that read fail
//!   ("plain accessors touching a borrowed range are refused"), so the case races by design.
//!   `notification_after_data_in_place` below checks the same property (notification only after
//!   every byte) without the racing read.
//!
//! The peer in another OS process is covered by `cross_process.rs`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_transport::testing::TransportPair;
use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};

async fn pair_with(config: TcpConfig) -> TransportPair {
    let sender = TcpTransport::bind(config.clone())
        .await
        .expect("bind sender");
    let receiver = TcpTransport::bind(config).await.expect("bind receiver");
    TransportPair::new(Arc::new(sender), Arc::new(receiver))
}

async fn default_pair() -> TransportPair {
    pair_with(TcpConfig::default()).await
}

async fn striped_copy_pair() -> TransportPair {
    pair_with(
        TcpConfig::default()
            .with_secret(b"conformance secret".to_vec())
            .with_connections_per_peer(2)
            .with_piece_bytes(64 << 10)
            .with_receive_in_place(false),
    )
    .await
}

mod copy_receive_secret_two_connections {
    kvbridge_transport::conformance_tests!(super::striped_copy_pair);
}

macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        mod in_place_defaults {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    kvbridge_transport::testing::$case(super::default_pair().await).await
                }
            )*
            mod dyn_transport {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $case() {
                        kvbridge_transport::testing::$case(super::super::default_pair().await.boxed())
                            .await
                    }
                )*
            }
        }
    };
}

cases!(
    random_batches,
    zero_length_and_empty_batches,
    large_batch,
    out_of_bounds_local_refused,
    out_of_bounds_remote_refused,
    unknown_region_refused,
    offset_overflow_refused,
    deregistered_region_refused,
    concurrent_batches,
    deadline_expiry,
    cancel_fences,
    peer_disconnect_mid_batch,
    reads_or_unsupported,
    unknown_ids_refused,
    wait_returns_final_state_once,
    bad_descriptor_refused,
    shutdown_closes,
);

#[test]
fn every_suite_case_is_run_in_place() {
    // When the suite grows, this list (and the `cases!` above) must follow.
    let skipped = ["notification_after_data"];
    let here = include_str!("conformance.rs");
    for case in kvbridge_transport::testing::CASES {
        assert!(
            skipped.contains(case) || here.contains(&format!("    {case},\n")),
            "conformance case {case} is not run in the in-place configuration"
        );
    }
}

/// Notifications follow data with payloads read straight into the region: many batches with
/// many descriptors each, every slot checked the moment its notification arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_after_data_in_place() {
    const BATCHES: u64 = 16;
    const SLOT: u64 = 64 << 10;
    let pair = default_pair().await;
    let (src, src_mem) = pair
        .sender
        .allocate_registered((BATCHES * SLOT) as usize)
        .await
        .unwrap();
    let (dst, dst_mem) = pair
        .receiver
        .allocate_registered((BATCHES * SLOT) as usize)
        .await
        .unwrap();
    let data: Vec<u8> = (0..BATCHES * SLOT).map(|i| (i * 31 % 251) as u8).collect();
    src_mem.write_at(0, &data).unwrap();
    let peer = pair
        .sender
        .connect(&pair.receiver.local_descriptor())
        .await
        .unwrap();
    let mut ids = Vec::new();
    for i in 0..BATCHES {
        let base = i * SLOT;
        let ops = (0..64u64)
            .map(|k| TransferOp {
                local_region: src,
                local_offset: base + k * 1024,
                remote_region: dst,
                remote_offset: base + (63 - k) * 1024,
                len: 1024,
            })
            .collect();
        let batch = TransferBatch::write(ops).with_notification(Bytes::from(i.to_string()));
        ids.push(pair.sender.post(peer, batch).await.unwrap());
    }
    for _ in 0..BATCHES {
        let n = tokio::time::timeout(Duration::from_secs(5), pair.receiver.recv_notification())
            .await
            .unwrap()
            .unwrap();
        let i: u64 = std::str::from_utf8(&n.payload).unwrap().parse().unwrap();
        let base = i * SLOT;
        let got = dst_mem.to_vec(base, SLOT).unwrap();
        for k in 0..64u64 {
            let want = &data[(base + k * 1024) as usize..(base + (k + 1) * 1024) as usize];
            let at = ((63 - k) * 1024) as usize;
            assert_eq!(
                &got[at..at + 1024],
                want,
                "batch {i} notified before its bytes"
            );
        }
    }
    for id in ids {
        pair.sender.wait(id).await.unwrap();
    }
}
