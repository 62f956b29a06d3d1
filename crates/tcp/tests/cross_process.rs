//! Tests in which the receiving peer is a separate OS process.
//!
//! The test binary re-executes itself (`--exact child_process_entry`, through
//! `kvbridge_conformance::child`) with `KVBRIDGE_TCP_CHILD` set; the child runs a
//! receiving `TcpTransport` (same secret, same settings), prints `READY <region> <descriptor>`
//! and then checks its memory each time a notification `check:<seed>:<offset>:<len>` arrives,
//! answering `OK <offset>` or `BAD ...` on stdout — so every check also proves that a
//! notification crossed the process boundary after its data.

use std::time::Duration;

use bytes::Bytes;
use kvbridge_conformance::SplitMix64;
use kvbridge_conformance::child::{PeerProcess, is_peer};
use kvbridge_tcp::{TcpConfig, TcpTransport};
use kvbridge_transport::{
    KvTransport, KvTransportExt, PeerId, RegionId, Side, TransferBatch, TransferOp, TransportError,
};

const CHILD_ENV: &str = "KVBRIDGE_TCP_CHILD";
const LEN_ENV: &str = "KVBRIDGE_TCP_CHILD_LEN";
const SECRET: &[u8] = b"cross-process secret";

fn config() -> TcpConfig {
    TcpConfig::default()
        .with_secret(SECRET.to_vec())
        .with_connections_per_peer(2)
        .with_piece_bytes(256 << 10)
        .with_keepalive_interval(Duration::from_millis(100))
        .with_keepalive_timeout(Duration::from_secs(2))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    SplitMix64::new(seed).bytes(len)
}

/// Not a test of its own: the entry point of the peer processes the tests below start.
/// Without `KVBRIDGE_TCP_CHILD` it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_entry() {
    if !is_peer(CHILD_ENV) {
        return;
    }
    child_main().await;
    std::process::exit(0);
}

async fn child_main() {
    let len: usize = std::env::var(LEN_ENV).unwrap().parse().unwrap();
    let t = TcpTransport::bind(config()).await.unwrap();
    let (id, mem) = t.allocate_registered(len).await.unwrap();
    // The leading newline ends libtest's "test child_process_entry ... " line.
    println!(
        "\nREADY {} {}",
        id.0,
        String::from_utf8(t.local_descriptor().to_vec()).unwrap()
    );
    while let Ok(n) = t.recv_notification().await {
        let text = String::from_utf8_lossy(&n.payload).into_owned();
        let words: Vec<&str> = text.split(':').collect();
        if let ["check", seed, off, len] = words.as_slice() {
            let (seed, off, len): (u64, u64, usize) = (
                seed.parse().unwrap(),
                off.parse().unwrap(),
                len.parse().unwrap(),
            );
            let got = mem.to_vec(off, len as u64).unwrap();
            match got
                .iter()
                .zip(pattern(seed, len))
                .position(|(a, b)| *a != b)
            {
                None => println!("OK {off}"),
                Some(i) => println!("BAD byte {} of the block at {off}", i),
            }
        } else {
            println!("BAD unknown notification {text:?}");
        }
    }
}

/// Waits for the READY line: (region id, descriptor).
async fn ready(child: &PeerProcess) -> (RegionId, String) {
    let line = child.line("READY").await;
    let mut words = line.split_whitespace().skip(1);
    let region = RegionId(words.next().unwrap().parse().unwrap());
    (region, words.next().unwrap().to_owned())
}

async fn connect(len: usize) -> (PeerProcess, TcpTransport, PeerId, RegionId) {
    let child = PeerProcess::spawn(
        "child_process_entry",
        [(CHILD_ENV, "1".to_owned()), (LEN_ENV, len.to_string())],
    );
    let (remote, descriptor) = ready(&child).await;
    let t = TcpTransport::bind(config()).await.unwrap();
    let peer = t.connect(descriptor.as_bytes()).await.unwrap();
    (child, t, peer, remote)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_writes_are_checked_by_the_peer_at_notification_time() {
    const LEN: usize = 8 << 20;
    const BLOCK: usize = 1 << 20;
    let (child, t, peer, remote) = connect(LEN).await;
    let (local, src) = t.allocate_registered(LEN).await.unwrap();
    for i in 0..(LEN / BLOCK) as u64 {
        let seed = 100 + i;
        src.write_at(i * BLOCK as u64, &pattern(seed, BLOCK))
            .unwrap();
        // Scatter the block in 4 KiB pieces in reverse order, so descriptors and pieces
        // (256 KiB, over two connections) do not line up.
        let ops: Vec<TransferOp> = (0..(BLOCK / 4096) as u64)
            .rev()
            .map(|k| {
                TransferOp::new(
                    local,
                    i * BLOCK as u64 + k * 4096,
                    remote,
                    i * BLOCK as u64 + k * 4096,
                    4096,
                )
            })
            .collect();
        let note = format!("check:{seed}:{}:{BLOCK}", i * BLOCK as u64);
        t.transfer(
            peer,
            TransferBatch::write(ops).with_notification(Bytes::from(note)),
        )
        .await
        .unwrap();
        assert_eq!(child.line("OK").await, format!("OK {}", i * BLOCK as u64));
    }
    // Remote bounds come from the other process.
    let oob = TransferOp::new(local, 0, remote, LEN as u64 - 10, 11);
    match t.post(peer, TransferBatch::write(vec![oob])).await {
        Err(TransportError::OutOfBounds {
            side: Side::Remote,
            region_len,
            ..
        }) => assert_eq!(region_len, LEN as u64),
        other => panic!("expected a remote OutOfBounds, got {other:?}"),
    }
    t.probe(peer, Duration::from_secs(2)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_peer_process_fails_its_batches_by_their_deadline() {
    const LEN: usize = 64 << 20;
    let (mut child, t, peer, remote) = connect(LEN).await;
    let (local, _src) = t.allocate_registered(LEN).await.unwrap();
    let op = TransferOp::new(local, 0, remote, 0, LEN as u64);
    let deadline = Duration::from_secs(5);
    let id = t
        .post(peer, TransferBatch::write(vec![op]).with_timeout(deadline))
        .await
        .unwrap();
    child.kill();
    let r = tokio::time::timeout(deadline + Duration::from_secs(5), t.wait(id))
        .await
        .expect("wait hung past the deadline after the peer died");
    // Done if it all went through before the kill; otherwise an error, never a hang.
    if let Err(e) = r {
        assert!(
            matches!(
                e,
                TransportError::PeerLost { .. }
                    | TransportError::TimedOut { .. }
                    | TransportError::BatchFailed { .. }
            ),
            "{e}"
        );
    }
    let later = t.post(peer, TransferBatch::write(vec![op])).await;
    assert!(
        matches!(later, Err(TransportError::PeerLost { .. })),
        "{later:?}"
    );
    assert!(t.probe(peer, Duration::from_millis(500)).await.is_err());
}
