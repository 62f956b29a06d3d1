//! Dropping a transport stops and joins its polling thread before the drop returns. A polling
//! thread left running (it used to be detached, to stop at its next turn) could still be inside
//! a NIXL call when the process exits and NIXL's libraries are torn down under it, and it would
//! destroy the agent on its own thread after the drop returned.
#![cfg(feature = "nixl")]

mod common;

use std::time::Duration;

use kvbridge_nixl::{NixlOptions, NixlTransport};
use kvbridge_transport::{KvTransport, KvTransportExt, TransferBatch, TransferOp};

/// Threads of this process, by id, with their names.
fn threads() -> std::collections::BTreeMap<String, String> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .map(|t| {
                    let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                    (
                        t.file_name().to_string_lossy().into_owned(),
                        comm.trim().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_transport_joins_its_polling_thread() {
    if !common::runtime_ready() {
        return;
    }
    // With batches in flight the polling thread polls without sleeping, so a drop finds it
    // inside a turn (holding the transport) most of the time.
    let options = || {
        NixlOptions::default()
            .with_device_memory(false)
            .with_poll_in_flight(true)
    };
    let rx = NixlTransport::with_options(options()).unwrap();
    let (dst, _dst) = rx.allocate_registered(1 << 16).await.unwrap();
    // The first agent may start threads of UCX's that live as long as the process.
    drop(NixlTransport::with_options(options()).unwrap());
    tokio::time::sleep(Duration::from_millis(50)).await;
    for round in 0..10 {
        let before = threads();
        let tx = NixlTransport::with_options(options()).unwrap();
        let (src, _src) = tx.allocate_registered(1 << 16).await.unwrap();
        let peer = tx.connect(&rx.local_descriptor()).await.unwrap();
        for i in 0..8 {
            let op = TransferOp::new(src, i * 4096, dst, i * 4096, 4096);
            tx.post(peer, TransferBatch::write(vec![op])).await.unwrap();
        }
        drop(tx);
        let after = threads();
        let new: Vec<_> = after
            .iter()
            .filter(|(id, _)| !before.contains_key(*id))
            .collect();
        assert!(
            new.is_empty(),
            "round {round}: threads started meanwhile outlived the transport's drop: {new:?} \
             (before: {before:?})"
        );
    }
}
