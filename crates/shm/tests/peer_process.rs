//! Tests in which the peer is a separate OS process.
//!
//! The test binary re-executes itself (`--exact child_process_entry`, through
//! `kvbridge_conformance::child`) with `KVBRIDGE_SHM_CHILD` set; that child runs a
//! receiving `ShmTransport`, reports on stdout (lines starting with an upper-case tag) and obeys
//! commands that arrive as notifications, so every command also proves that notifications cross
//! the process boundary after their data.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvbridge_conformance::SplitMix64;
use kvbridge_conformance::child::{PeerProcess, is_peer, scattered_blocks, send_command};
use kvbridge_shm::{ShmOptions, ShmTransport};
use kvbridge_transport::{
    KvTransport, KvTransportExt, RegionId, Side, TransferBatch, TransferOp, TransportError,
};

const CHILD_ENV: &str = "KVBRIDGE_SHM_CHILD";
const DIR_ENV: &str = "KVBRIDGE_SHM_CHILD_DIR";
const LEN_ENV: &str = "KVBRIDGE_SHM_CHILD_LEN";

/// Deterministic test bytes.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    SplitMix64::new(seed).bytes(len)
}

/// Not a test of its own: the entry point of the peer processes the tests below start. Without
/// `KVBRIDGE_SHM_CHILD` in the environment it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_entry() {
    if !is_peer(CHILD_ENV) {
        return;
    }
    child_main().await;
    // Leave without running other cleanup: the parent checks what the transport removed itself.
    std::process::exit(0);
}

async fn child_main() {
    let dir = PathBuf::from(std::env::var_os(DIR_ENV).expect("runtime dir"));
    let len: usize = std::env::var(LEN_ENV).unwrap().parse().unwrap();
    let t = ShmTransport::with_options(ShmOptions::default().with_runtime_dir(&dir)).unwrap();
    let (id, region) = t.allocate_registered(len).await.unwrap();
    let mut regions = vec![(id, region)];
    // The leading newline ends libtest's "test child_process_entry ... " line.
    println!(
        "\nREADY {} {} {}",
        id.0,
        t.control_dir().display(),
        String::from_utf8(t.local_descriptor().to_vec()).unwrap()
    );
    loop {
        let Ok(n) = t.recv_notification().await else {
            return;
        };
        let text = String::from_utf8_lossy(&n.payload).into_owned();
        let words: Vec<&str> = text.split(':').collect();
        match words.as_slice() {
            ["fill", region, seed, off, len] => {
                let (region, seed, off, len): (u64, u64, u64, usize) = (
                    region.parse().unwrap(),
                    seed.parse().unwrap(),
                    off.parse().unwrap(),
                    len.parse().unwrap(),
                );
                let mem = &regions.iter().find(|(i, _)| i.0 == region).unwrap().1;
                // The bytes are checked the moment the notification arrives.
                let got = mem.to_vec(off, len as u64).unwrap();
                let want = pattern(seed, len);
                match got.iter().zip(&want).position(|(a, b)| a != b) {
                    None => println!("VERIFIED ok"),
                    Some(i) => println!("VERIFIED bad at {i}"),
                }
            }
            ["register", len] => {
                let (id, mem) = t.allocate_registered(len.parse().unwrap()).await.unwrap();
                regions.push((id, mem));
                println!("REGISTERED {}", id.0);
            }
            ["deregister", region] => {
                t.deregister(RegionId(region.parse().unwrap()))
                    .await
                    .unwrap();
                println!("DEREGISTERED");
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
    fn spawn(dir: &Path, len: usize) -> Self {
        Self(PeerProcess::spawn(
            "child_process_entry",
            [
                (CHILD_ENV, "receiver".into()),
                (DIR_ENV, dir.as_os_str().to_owned()),
                (LEN_ENV, len.to_string().into()),
            ],
        ))
    }

    /// The next tagged line, which must start with `tag`.
    async fn line(&self, tag: &str) -> String {
        self.0.line(tag).await
    }

    /// Waits for the READY line: (region id, control dir, descriptor).
    async fn ready(&self) -> (RegionId, PathBuf, String) {
        let line = self.line("READY").await;
        let mut words = line.split(' ').skip(1);
        let id = RegionId(words.next().unwrap().parse().unwrap());
        let dir = PathBuf::from(words.next().unwrap());
        let descriptor = words.next().unwrap().to_owned();
        (id, dir, descriptor)
    }
}

fn base_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvb-shm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// 64 KiB blocks covering `[0, len)` of both regions, in a scattered order.
fn scattered(local: RegionId, remote: RegionId, len: u64) -> Vec<TransferOp> {
    scattered_blocks(local, remote, len, 64 * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_process_writes_reads_fetches_and_fences() {
    const LEN: usize = 8 << 20;
    let base = base_dir("round-trip");
    let child = Child::spawn(&base, LEN);
    let (remote, child_dir, descriptor) = child.ready().await;
    assert!(child_dir.starts_with(&base) && child_dir.exists());

    let t = ShmTransport::with_options(ShmOptions::default().with_runtime_dir(&base)).unwrap();
    let (local, mem) = t.allocate_registered(LEN).await.unwrap();
    let peer = t.connect(descriptor.as_bytes()).await.unwrap();
    t.probe(peer, Duration::from_secs(2)).await.unwrap();

    // Writes: the peer checks its memory the moment each notification arrives.
    for seed in 1..=3u64 {
        mem.write_at(0, &pattern(seed, LEN)).unwrap();
        let ops = scattered(local, remote, LEN as u64);
        let note = format!("fill:{}:{seed}:0:{LEN}", remote.0);
        t.transfer(
            peer,
            TransferBatch::write(ops).with_notification(Bytes::from(note)),
        )
        .await
        .unwrap();
        assert_eq!(child.line("VERIFIED").await, "VERIFIED ok", "seed {seed}");
    }

    // Reads pull the peer's bytes.
    let (scratch, scratch_mem) = t.allocate_registered(1 << 20).await.unwrap();
    let read = TransferOp::new(scratch, 0, remote, 4096, 1 << 20);
    t.transfer(peer, TransferBatch::read(vec![read]))
        .await
        .unwrap();
    assert!(scratch_mem.to_vec(0, 1 << 20).unwrap() == pattern(3, LEN)[4096..4096 + (1 << 20)]);

    // A region the peer registers after connect is fetched when a batch first names it.
    send_command(&t, peer, "register:65536".into()).await;
    let late = RegionId(child.line("REGISTERED").await[11..].parse().unwrap());
    mem.write_at(0, &pattern(9, 65536)).unwrap();
    let op = TransferOp::new(local, 0, late, 0, 65536);
    let note = format!("fill:{}:9:0:65536", late.0);
    t.transfer(
        peer,
        TransferBatch::write(vec![op]).with_notification(Bytes::from(note)),
    )
    .await
    .unwrap();
    assert_eq!(child.line("VERIFIED").await, "VERIFIED ok");

    // Once the peer's deregister returns, this side no longer writes into the region.
    send_command(&t, peer, format!("deregister:{}", late.0)).await;
    child.line("DEREGISTERED").await;
    let refused = t.transfer(peer, TransferBatch::write(vec![op])).await;
    assert!(
        matches!(
            refused,
            Err(TransportError::UnknownRegion {
                side: Side::Remote,
                region,
                ..
            }) if region == late
        ),
        "{refused:?}"
    );

    // A clean exit removes the peer's control directory.
    send_command(&t, peer, "exit".into()).await;
    child.line("BYE").await;
    let mut child = child;
    let status = child.0.wait();
    assert!(status.success(), "{status}");
    assert!(
        !child_dir.exists(),
        "{} was left behind",
        child_dir.display()
    );
    let probe = t.probe(peer, Duration::from_secs(1)).await;
    assert!(probe.is_err(), "{probe:?}");
    t.shutdown().await.unwrap();
    std::fs::remove_dir(&base).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_peer_mid_transfer_fails_batches_by_their_deadline() {
    const LEN: usize = 16 << 20;
    const DEADLINE: Duration = Duration::from_secs(3);
    let base = base_dir("kill");
    let shm_before = std::fs::read_dir("/dev/shm")
        .map(|d| d.count())
        .unwrap_or(0);
    let mut child = Child::spawn(&base, LEN);
    let (remote, child_dir, descriptor) = child.ready().await;

    let t = Arc::new(
        ShmTransport::with_options(ShmOptions::default().with_runtime_dir(&base)).unwrap(),
    );
    let (local, mem) = t.allocate_registered(LEN).await.unwrap();
    mem.write_at(0, &pattern(5, LEN)).unwrap();
    let peer = t.connect(descriptor.as_bytes()).await.unwrap();
    let note = format!("fill:{}:5:0:{LEN}", remote.0);
    t.transfer(
        peer,
        TransferBatch::write(scattered(local, remote, LEN as u64))
            .with_notification(Bytes::from(note)),
    )
    .await
    .unwrap();
    assert_eq!(child.line("VERIFIED").await, "VERIFIED ok");

    // Keep posting 16 MiB batches; kill the peer while they run.
    let sender = Arc::clone(&t);
    let poster = tokio::spawn(async move {
        let mut outcomes = Vec::new();
        let mut failures_in_a_row = 0;
        while failures_in_a_row < 3 && outcomes.len() < 500 {
            let batch = TransferBatch::write(scattered(local, remote, LEN as u64))
                .with_notification(Bytes::from_static(b"more"))
                .with_timeout(DEADLINE);
            let started = Instant::now();
            let result = match sender.post(peer, batch).await {
                Ok(id) => tokio::time::timeout(DEADLINE + Duration::from_secs(2), sender.wait(id))
                    .await
                    .unwrap_or_else(|_| panic!("wait outlived the batch deadline by 2 s")),
                Err(e) => Err(e),
            };
            assert!(started.elapsed() < DEADLINE + Duration::from_secs(2));
            failures_in_a_row = if result.is_err() {
                failures_in_a_row + 1
            } else {
                0
            };
            outcomes.push(result);
        }
        outcomes
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    child.0.kill();
    let outcomes = tokio::time::timeout(Duration::from_secs(60), poster)
        .await
        .expect("the posting loop ends once the peer is gone")
        .unwrap();
    let last = outcomes.last().unwrap();
    assert!(
        matches!(
            last,
            Err(TransportError::PeerLost { .. } | TransportError::BatchFailed { .. })
        ),
        "after the peer died, batches fail with PeerLost or BatchFailed, got {last:?}"
    );
    let probe = t.probe(peer, Duration::from_millis(500)).await;
    assert!(probe.is_err(), "{probe:?}");

    // The killed peer could not clean up; its directory goes when the next transport starts
    // in the same place. Shared memory was never in /dev/shm.
    assert!(child_dir.exists());
    let next = ShmTransport::with_options(ShmOptions::default().with_runtime_dir(&base)).unwrap();
    assert!(
        !child_dir.exists(),
        "{} was left behind",
        child_dir.display()
    );
    let shm_after = std::fs::read_dir("/dev/shm")
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(shm_after <= shm_before, "/dev/shm gained entries");
    next.shutdown().await.unwrap();
    t.shutdown().await.unwrap();
    std::fs::remove_dir(&base).unwrap();
}
