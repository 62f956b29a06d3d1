//! The whole conformance suite over NIXL's UCX backend with the two peers in separate processes:
//! the sender is a `NixlTransport` in the test process, the receiver one in a child process (the
//! test binary re-run through `kvbridge_conformance::child`). Over the lanes UCX picks by
//! default here (directly and with the sender as `Arc<dyn KvTransport>`), and again with
//! `UCX_TLS=tcp` (the binary re-runs itself with that variable).
//!
//! The suite reads and writes the receiver's memory through `MemoryRegion` handles, so the
//! receiver's regions are shared: the parent's [`ReceiverProcess`] (a small `KvTransport` proxy)
//! allocates them as sealed memfds mapped shared (`kvbridge_nixl::allocate_shared`); the child
//! opens each file through `/proc/<parent>/fd/<fd>`, maps the same bytes
//! (`kvbridge_nixl::map_shared`) and registers them with its own NIXL agent. The proxy forwards
//! the receiver-side calls (`register`, `deregister`, `shutdown`) to the child as command lines on
//! its stdin, and the child answers with tagged lines; the child forwards every notification it
//! receives as a line too, so the suite's `recv_notification` sees them after the data, as the
//! contract says. See docs/TESTING.md ("NIXL across processes").
//!
//! Skipped, with the reason printed, when the NIXL runtime is not set up
//! (`cargo xtask nixl-setup`); `.ci/run` sets it up, so CI runs them all.
#![cfg(feature = "nixl")]

mod common;
#[path = "common/peer.rs"]
mod peer;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvbridge_conformance::child::{PeerProcess, is_peer};
use kvbridge_conformance::{CASES, Limits, SplitMix64, TransportPair};
use kvbridge_nixl::{NixlOptions, NixlTransport};
use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    BatchId, BatchState, Capabilities, KvTransport, MemoryRegion, Notification, PeerId, RegionId,
    Result, TransferBatch, TransferOp, TransportError,
};
use peer::{
    LANES_ENV, assert_failed_in_time, hex, later_batches_and_probes_fail, rerun_over_ucx_tcp, unhex,
};
use tokio::sync::{mpsc, oneshot};

/// Set in the receiver process.
const RECEIVER_ENV: &str = "KVBRIDGE_NIXL_SUITE_RECEIVER";
/// How long the proxy waits for one answer of the child: generous, for a loaded machine (the
/// suite bounds its own calls more tightly).
const ANSWER_LIMIT: Duration = Duration::from_secs(60);

fn options() -> NixlOptions {
    // The suite cannot allocate device memory across processes, so device memory stays off on
    // both sides even on a host with a GPU (the suite then checks that it is refused).
    NixlOptions::default().with_device_memory(false)
}

fn caps_text(c: Capabilities) -> String {
    format!(
        "{}:{}:{}:{}:{}",
        u8::from(c.reads),
        u8::from(c.cross_process),
        c.max_ops_per_batch.unwrap_or(0),
        u8::from(c.device_memory),
        u8::from(c.strided_ops)
    )
}

fn parse_caps(s: &str) -> Capabilities {
    let f: Vec<usize> = s
        .split(':')
        .map(|w| w.parse().expect("caps field"))
        .collect();
    Capabilities::minimal()
        .with_reads(f[0] == 1)
        .with_cross_process(f[1] == 1)
        .with_max_ops_per_batch((f[2] > 0).then_some(f[2]))
        .with_device_memory(f[3] == 1)
        .with_strided_ops(f[4] == 1)
}

// ---------------------------------------------------------------------------------------------
// The child: a receiving NixlTransport that obeys the proxy's commands.
// ---------------------------------------------------------------------------------------------

/// Not a test of its own: the entry point of the receiver processes. Without
/// `KVBRIDGE_NIXL_SUITE_RECEIVER` in the environment it returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_process_entry() {
    if !is_peer(RECEIVER_ENV) {
        return;
    }
    serve().await;
}

/// Reads commands (`<id> REG <fd> <len>`, `<id> DEREG <region>`, `<id> SHUTDOWN`) from stdin,
/// answers `REPLY <id> OK ...` or `REPLY <id> ERR <message>`, and prints `NOTE <from> <hex>` for
/// every notification. Ends when stdin closes (the parent is done or gone).
async fn serve() {
    let t = Arc::new(NixlTransport::with_options(options()).expect("receiver transport"));
    // The leading newline ends libtest's "test receiver_process_entry ... " line.
    println!(
        "\nREADY {} {}",
        caps_text(t.capabilities()),
        hex(&t.local_descriptor())
    );
    let notes = Arc::clone(&t);
    tokio::spawn(async move {
        loop {
            match notes.recv_notification().await {
                Ok(n) => println!("NOTE {} {}", n.from.0, hex(&n.payload)),
                Err(e) => {
                    println!("NOTES-END {e}");
                    return;
                }
            }
        }
    });
    let (tx, mut commands) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines().map_while(std::result::Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let parent = std::os::unix::process::parent_id();
    while let Some(line) = commands.recv().await {
        let mut words = line.split(' ');
        let id = words.next().unwrap_or_default().to_owned();
        let words: Vec<&str> = words.collect();
        match command(&t, parent, &words).await {
            Ok(text) => println!("REPLY {id} OK {text}"),
            Err(e) => println!("REPLY {id} ERR {}", e.replace('\n', " ")),
        }
    }
    let _ = t.shutdown().await;
}

async fn command(
    t: &NixlTransport,
    parent: u32,
    words: &[&str],
) -> std::result::Result<String, String> {
    match words {
        ["REG", fd, len] => {
            let len: usize = len.parse().map_err(|e| format!("bad length {len}: {e}"))?;
            let path = format!("/proc/{parent}/fd/{fd}");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| format!("opening {path}: {e}"))?;
            let region = kvbridge_nixl::map_shared(file, len)
                .map_err(|e| format!("mapping {path} ({len} bytes): {e}"))?;
            let id = t.register(region).await.map_err(|e| e.to_string())?;
            Ok(format!("{} {}", id.0, hex(&t.local_descriptor())))
        }
        ["DEREG", region] => {
            let region = RegionId(region.parse().map_err(|e| format!("bad region: {e}"))?);
            t.deregister(region).await.map_err(|e| e.to_string())?;
            Ok(hex(&t.local_descriptor()))
        }
        ["SHUTDOWN"] => {
            t.shutdown().await.map_err(|e| e.to_string())?;
            Ok(String::new())
        }
        other => Err(format!("unknown command {other:?}")),
    }
}

// ---------------------------------------------------------------------------------------------
// The parent: a proxy for the receiver in the child.
// ---------------------------------------------------------------------------------------------

type Answer = std::result::Result<String, String>;
/// Callers waiting for the child's answer, by request id.
type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Answer>>>>;

/// The receiving side of the pair, in the parent: a `KvTransport` whose receiver-side calls run
/// in the child. Regions it allocates are shared with the child; sending calls (`connect`,
/// `post`, ...) are refused, as the suite never makes them on the receiver.
struct ReceiverProcess {
    process: Mutex<PeerProcess>,
    pending: Pending,
    notes: tokio::sync::Mutex<mpsc::UnboundedReceiver<Notification>>,
    descriptor: Mutex<Bytes>,
    caps: Capabilities,
    next: AtomicU64,
}

const NAME: &str = kvbridge_nixl::NAME;
const ONLY_RECEIVES: &str = "the suite's receiver proxy only receives; send from the parent's \
                             own NixlTransport";

impl ReceiverProcess {
    /// Starts a receiver process and waits until its transport is up.
    async fn spawn() -> Self {
        let process = PeerProcess::spawn("receiver_process_entry", [(RECEIVER_ENV, "1")]);
        let ready = process.line("READY").await;
        let mut words = ready.split(' ').skip(1);
        let caps = parse_caps(words.next().expect("capabilities"));
        let descriptor = Bytes::from(unhex(words.next().expect("descriptor")));
        let pending: Pending = Arc::default();
        let (note_tx, notes) = mpsc::unbounded_channel();
        let lines = process.lines();
        let answers = Arc::clone(&pending);
        // The dispatcher: answers go to their callers, notifications to the queue. When the
        // child exits, pending callers and the queue see the end.
        tokio::spawn(async move {
            while let Some(line) = lines.next().await {
                let mut words = line.splitn(4, ' ');
                match (words.next(), words.next(), words.next()) {
                    (Some("NOTE"), Some(from), Some(payload)) => {
                        let from = PeerId(from.parse().expect("peer id"));
                        let _ = note_tx.send(Notification::new(from, Bytes::from(unhex(payload))));
                    }
                    (Some("REPLY"), Some(id), Some(status)) => {
                        let rest = words.next().unwrap_or_default().to_owned();
                        let answer = if status == "OK" { Ok(rest) } else { Err(rest) };
                        let id: u64 = id.parse().expect("reply id");
                        let waiting = lock(&answers).remove(&id);
                        if let Some(tx) = waiting {
                            let _ = tx.send(answer);
                        }
                    }
                    _ => {}
                }
            }
            lock(&answers).clear();
        });
        Self {
            process: Mutex::new(process),
            pending,
            notes: tokio::sync::Mutex::new(notes),
            descriptor: Mutex::new(descriptor),
            caps,
            next: AtomicU64::new(1),
        }
    }

    /// Sends one command and waits for its answer.
    async fn request(&self, command: String) -> Result<String> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let lost = |reason: String| TransportError::Custom {
            transport: NAME,
            source: format!("the receiver process: {reason}").into(),
        };
        lock(&self.process)
            .send(&format!("{id} {command}"))
            .map_err(|e| lost(format!("sending {command:?}: {e}")))?;
        match tokio::time::timeout(ANSWER_LIMIT, rx).await {
            Ok(Ok(Ok(text))) => Ok(text),
            Ok(Ok(Err(message))) => Err(lost(format!("{command:?} failed: {message}"))),
            Ok(Err(_)) => Err(lost(format!("exited before answering {command:?}"))),
            Err(_) => Err(lost(format!(
                "did not answer {command:?} within {ANSWER_LIMIT:?}"
            ))),
        }
    }

    /// Kills the child, as a crash would.
    fn kill(&self) {
        lock(&self.process).kill();
    }
}

#[async_trait::async_trait]
impl KvTransport for ReceiverProcess {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    fn allocate(&self, len: usize) -> Result<MemoryRegion> {
        kvbridge_nixl::allocate_shared(len).map_err(|e| TransportError::Io {
            transport: NAME,
            context: format!("allocating a {len}-byte shared region for the receiver process"),
            source: e,
        })
    }

    async fn register(&self, region: MemoryRegion) -> Result<RegionId> {
        // The child's capabilities decide, as its own register would (device memory cannot be
        // handed to another process here, so it never gets that far).
        self.caps.check_region(NAME, &region)?;
        let Some(fd) = kvbridge_nixl::shared_fd(&region) else {
            return Err(TransportError::InvalidArgument {
                transport: NAME,
                message: format!(
                    "a {}-byte region not made by this proxy's allocate() cannot reach the \
                     receiver process; allocate it with allocate()",
                    region.len()
                ),
            });
        };
        let answer = self.request(format!("REG {fd} {}", region.len())).await?;
        let (id, descriptor) = answer.split_once(' ').expect("REG answer");
        *lock(&self.descriptor) = Bytes::from(unhex(descriptor));
        Ok(RegionId(id.parse().expect("region id")))
    }

    async fn deregister(&self, region: RegionId) -> Result<()> {
        let descriptor = self.request(format!("DEREG {}", region.0)).await?;
        *lock(&self.descriptor) = Bytes::from(unhex(&descriptor));
        Ok(())
    }

    fn local_descriptor(&self) -> Bytes {
        lock(&self.descriptor).clone()
    }

    async fn connect(&self, _descriptor: &[u8]) -> Result<PeerId> {
        Err(unsupported("connect"))
    }

    async fn disconnect(&self, _peer: PeerId) -> Result<()> {
        Err(unsupported("disconnect"))
    }

    async fn post(&self, _peer: PeerId, _batch: TransferBatch) -> Result<BatchId> {
        Err(unsupported("post"))
    }

    fn batch_state(&self, _batch: BatchId) -> Result<BatchState> {
        Err(unsupported("batch_state"))
    }

    async fn wait(&self, _batch: BatchId) -> Result<()> {
        Err(unsupported("wait"))
    }

    async fn cancel(&self, _batch: BatchId) -> Result<BatchState> {
        Err(unsupported("cancel"))
    }

    async fn recv_notification(&self) -> Result<Notification> {
        // Cancel-safe: a notification the child forwarded stays queued until taken.
        let mut notes = self.notes.lock().await;
        notes
            .recv()
            .await
            .ok_or(TransportError::Closed { transport: NAME })
    }

    async fn probe(&self, _peer: PeerId, _timeout: Duration) -> Result<()> {
        Err(unsupported("probe"))
    }

    async fn shutdown(&self) -> Result<()> {
        self.request("SHUTDOWN".to_owned()).await.map(|_| ())
    }
}

fn unsupported(operation: &'static str) -> TransportError {
    TransportError::Unsupported {
        transport: NAME,
        operation,
        remedy: ONLY_RECEIVES,
    }
}

/// A sender here and a receiver in a new child process, or `None` (printing why) without the
/// NIXL runtime.
async fn cross_process_pair() -> Option<(TransportPair, Arc<ReceiverProcess>)> {
    if !common::runtime_ready() {
        return None;
    }
    // The sender first: loading NIXL sets environment variables, best done before this test
    // starts more threads (the child's line reader).
    let sender = Arc::new(NixlTransport::with_options(options()).expect("sender transport"));
    let receiver = Arc::new(ReceiverProcess::spawn().await);
    // One more process in the way: twice the default per-call bound, for a loaded machine.
    let limits = Limits::default().with_call(Duration::from_secs(10));
    let pair = TransportPair::new(sender, Arc::clone(&receiver) as Arc<dyn KvTransport>)
        .with_limits(limits);
    Some((pair, receiver))
}

macro_rules! emit_cross_process {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some((pair, _receiver)) = super::cross_process_pair().await else { return };
                kvbridge_conformance::$case(pair).await
            }
        )*
    };
}

macro_rules! emit_cross_process_boxed {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some((pair, _receiver)) = super::cross_process_pair().await else { return };
                kvbridge_conformance::$case(pair.boxed()).await
            }
        )*
    };
}

/// Every case of the suite, the receiver in another process.
mod suite {
    kvbridge_conformance::__conformance_cases!(emit_cross_process);
}

/// The same, with the sender used as `Arc<dyn KvTransport>` (default lanes only).
mod as_dyn {
    kvbridge_conformance::__conformance_cases!(emit_cross_process_boxed);
}

/// The receiver process is killed while 32 MiB batches flow into it (each writes the other of
/// two patterns, so every batch changes every byte): the batch that fails ends by its deadline
/// plus the commit grace with the peer lost, every byte of the receiver's memory — still
/// readable here through the shared mapping — is the value before that batch or the batch's own,
/// and stays so; later batches and probes fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_batch_receiver_process() {
    const LEN: usize = 32 << 20;
    let Some((pair, receiver)) = cross_process_pair().await else {
        return;
    };
    let (sender, dst) = (pair.sender, pair.receiver);
    let local = sender.allocate(LEN).unwrap();
    let remote = dst.allocate(LEN).unwrap();
    let local_id = sender.register(local.clone()).await.unwrap();
    let remote_id = dst.register(remote.clone()).await.unwrap();
    let peer = sender.connect(&dst.local_descriptor()).await.unwrap();
    sender.probe(peer, Duration::from_secs(5)).await.unwrap();
    let ops: Vec<TransferOp> =
        kvbridge_conformance::child::scattered_blocks(local_id, remote_id, LEN as u64, 16 * 1024);
    let patterns = [
        SplitMix64::new(0x4B11).bytes(LEN),
        SplitMix64::new(0x4B12).bytes(LEN),
    ];
    let deadline = Duration::from_secs(10);
    // A pace, not a limit: batches complete in milliseconds, so the kill lands amid them.
    let killer = {
        let receiver = Arc::clone(&receiver);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            receiver.kill();
        })
    };
    let mut before = remote.to_vec(0, LEN as u64).unwrap();
    let mut failed = None;
    for k in 0..10_000 {
        let new = &patterns[k % 2];
        local.write_at(0, new).unwrap();
        let posted = Instant::now();
        let outcome = match sender
            .post(
                peer,
                TransferBatch::write(ops.clone()).with_timeout(deadline),
            )
            .await
        {
            Ok(id) => tokio::time::timeout(Duration::from_secs(60), sender.wait(id))
                .await
                .expect("a batch to a killed process never ended"),
            Err(e) => Err(e),
        };
        let after = remote.to_vec(0, LEN as u64).unwrap();
        match outcome {
            Ok(()) => {
                assert!(
                    after == *new,
                    "done batch {k} left other bytes than its own"
                );
                before = after;
            }
            Err(e) => {
                failed = Some((k, e, posted.elapsed(), before, new.clone(), after));
                break;
            }
        }
    }
    killer.await.unwrap();
    let (k, err, took, old, new, after) =
        failed.expect("10000 batches completed although the receiver process was killed");
    assert_failed_in_time(&err, took, deadline, &format!("batch {k}"));
    let torn = (0..LEN).find(|&i| after[i] != old[i] && after[i] != new[i]);
    assert_eq!(
        torn, None,
        "batch {k}: a byte is neither the old value nor the batch's"
    );
    // Nothing lands later: the memory keeps its bytes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        remote.to_vec(0, LEN as u64).unwrap() == after,
        "bytes landed after batch {k} failed"
    );
    later_batches_and_probes_fail(&*sender, peer, local_id, remote_id, deadline).await;
}

/// Runs the whole cross-process suite and the kill test again with `UCX_TLS=tcp` (in the parent
/// and, by inheritance, the receiver process), so every case also passes over UCX's TCP lane.
#[test]
fn whole_suite_across_processes_over_ucx_tcp() {
    if is_peer(LANES_ENV) || is_peer(RECEIVER_ENV) {
        return;
    }
    if !common::runtime_ready() {
        return;
    }
    rerun_over_ucx_tcp(&["suite::", "killed_mid_batch"], CASES.len() + 1);
}
