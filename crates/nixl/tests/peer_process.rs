//! Tests in which the peer is a separate OS process, over the UCX lanes UCX picks by default
//! and again with `UCX_TLS=tcp` (the test binary re-runs itself with that variable set).
//!
//! The child runs a receiving `NixlTransport`, reports on stdout (lines starting with an
//! upper-case tag) and obeys commands that arrive as notifications, so every command also proves
//! that notifications cross the process boundary after their data. Skipped, with the reason
//! printed, when the NIXL runtime is not set up (`cargo xtask nixl-setup`).
#![cfg(feature = "nixl")]

mod common;
#[path = "common/peer.rs"]
mod peer;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::runtime_ready;
use kvbridge_conformance::SplitMix64;
use kvbridge_conformance::child::{PeerProcess, is_peer, scattered_blocks, send_command};
use kvbridge_nixl::NixlTransport;
use kvbridge_transport::{KvTransport, KvTransportExt, RegionId, TransferBatch, TransferOp};
use peer::{
    LANES_ENV, assert_failed_in_time, hex, later_batches_and_probes_fail, rerun_over_ucx_tcp, unhex,
};

const CHILD_ENV: &str = "KVBRIDGE_NIXL_CHILD";
const LEN_ENV: &str = "KVBRIDGE_NIXL_CHILD_LEN";

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    SplitMix64::new(seed).bytes(len)
}

/// Not a test of its own: the entry point of the peer processes the tests below start. Without
/// `KVBRIDGE_NIXL_CHILD` in the environment it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_entry() {
    if !is_peer(CHILD_ENV) {
        return;
    }
    child_main().await;
}

async fn child_main() {
    let len: usize = std::env::var(LEN_ENV).unwrap().parse().unwrap();
    let t = NixlTransport::new().unwrap();
    let (id, region) = t.allocate_registered(len).await.unwrap();
    // The leading newline ends libtest's "test child_process_entry ... " line.
    println!("\nREADY {} {}", id.0, hex(&t.local_descriptor()));
    loop {
        let Ok(n) = t.recv_notification().await else {
            return;
        };
        let text = String::from_utf8_lossy(&n.payload).into_owned();
        let words: Vec<&str> = text.split(':').collect();
        match words.as_slice() {
            ["fill", seed, len] => {
                let (seed, len): (u64, usize) = (seed.parse().unwrap(), len.parse().unwrap());
                // The bytes are checked the moment the notification arrives.
                let got = region.to_vec(0, len as u64).unwrap();
                match got
                    .iter()
                    .zip(&pattern(seed, len))
                    .position(|(a, b)| a != b)
                {
                    None => println!("VERIFIED ok"),
                    Some(i) => println!("VERIFIED bad at {i}"),
                }
            }
            ["exit"] => {
                t.shutdown().await.unwrap();
                println!("BYE");
                return;
            }
            other => println!("UNKNOWN {other:?}"),
        }
    }
}

/// The receiving peer process.
struct Child(PeerProcess);

impl Child {
    fn spawn(len: usize) -> Self {
        Self(PeerProcess::spawn(
            "child_process_entry",
            [
                (CHILD_ENV, "receiver".to_owned()),
                (LEN_ENV, len.to_string()),
            ],
        ))
    }

    async fn line(&self, tag: &str) -> String {
        self.0.line(tag).await
    }

    async fn ready(&self) -> (RegionId, Vec<u8>) {
        let line = self.line("READY").await;
        let mut words = line.split(' ').skip(1);
        let id = RegionId(words.next().unwrap().parse().unwrap());
        (id, unhex(words.next().unwrap()))
    }
}

/// 64 KiB blocks covering `[0, len)` of both regions, in a scattered order.
fn scattered(local: RegionId, remote: RegionId, len: u64) -> Vec<TransferOp> {
    scattered_blocks(local, remote, len, 64 * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_writes_arrive_before_their_notifications() {
    if !runtime_ready() {
        return;
    }
    const LEN: usize = 8 << 20;
    let child = Child::spawn(LEN);
    let (remote, descriptor) = child.ready().await;
    let t = NixlTransport::new().unwrap();
    let (local, mem) = t.allocate_registered(LEN).await.unwrap();
    let peer = t.connect(&descriptor).await.unwrap();
    t.probe(peer, Duration::from_secs(5)).await.unwrap();
    for seed in 1..=3u64 {
        mem.write_at(0, &pattern(seed, LEN)).unwrap();
        let note = format!("fill:{seed}:{LEN}");
        t.transfer(
            peer,
            TransferBatch::write(scattered(local, remote, LEN as u64))
                .with_notification(Bytes::from(note))
                .with_timeout(Duration::from_secs(30)),
        )
        .await
        .unwrap();
        assert_eq!(child.line("VERIFIED").await, "VERIFIED ok", "seed {seed}");
    }
    send_command(&t, peer, "exit".into()).await;
    child.line("BYE").await;
    // The peer said goodbye: its loss is reported, not waited for.
    let start = Instant::now();
    loop {
        if t.probe(peer, Duration::from_secs(1)).await.is_err() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "a shut-down peer kept answering probes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    t.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_transfer_fails_the_batches_in_flight() {
    if !runtime_ready() {
        return;
    }
    const LEN: usize = 32 << 20;
    let mut child = Child::spawn(LEN);
    let (remote, descriptor) = child.ready().await;
    let t = Arc::new(NixlTransport::new().unwrap());
    let (local, _mem) = t.allocate_registered(LEN).await.unwrap();
    let peer = t.connect(&descriptor).await.unwrap();
    let deadline = Duration::from_secs(10);
    // Batches keep flowing until one fails; the peer is killed while they do.
    let sender = {
        let t = Arc::clone(&t);
        tokio::spawn(async move {
            let ops = scattered(local, remote, LEN as u64);
            for _ in 0..10_000 {
                let posted = Instant::now();
                let r = match t
                    .post(
                        peer,
                        TransferBatch::write(ops.clone()).with_timeout(deadline),
                    )
                    .await
                {
                    Ok(id) => t.wait(id).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    return (e, posted.elapsed());
                }
            }
            panic!("10000 batches completed although the peer was killed");
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.0.kill();
    let (err, took) = tokio::time::timeout(Duration::from_secs(60), sender)
        .await
        .expect("the batch in flight to a killed peer never ended")
        .unwrap();
    assert_failed_in_time(&err, took, deadline, "the batch in flight");
    // Later batches and probes fail too.
    later_batches_and_probes_fail(&*t, peer, local, remote, deadline).await;
}

/// Runs this binary's cross-process tests again with `UCX_TLS=tcp` (in the parent and, by
/// inheritance, the child), so the same checks cover UCX's TCP lane.
#[test]
fn cross_process_tests_over_ucx_tcp() {
    if is_peer(LANES_ENV) || is_peer(CHILD_ENV) {
        return;
    }
    if !runtime_ready() {
        return;
    }
    rerun_over_ucx_tcp(&["cross_process_writes", "a_peer_killed"], 2);
}
