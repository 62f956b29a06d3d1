//! Control connections under pressure, as an attacker who holds the descriptor's token would
//! apply it: many connections that present the token and then stay silent, and connections that
//! never finish the opening exchange. Neither may cost a thread per connection or lock a
//! legitimate peer out. Each test counts this process's threads
//! and file descriptors, so this file's tests run one at a time (`SERIAL`).

use std::io::{Read as _, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvbridge_shm::{ShmOptions, ShmTransport};
use kvbridge_transport::{KvTransport, KvTransportExt, MemoryRegion, TransferBatch, TransferOp};

/// Thread and descriptor counts are per process: one test of this file at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn entries(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

/// The token and socket path of a descriptor (`kvbridge-shm:1:<32 hex digits>:<path>`), read
/// as an outsider would.
fn token_and_socket(descriptor: &[u8]) -> ([u8; 16], String) {
    let text = std::str::from_utf8(descriptor).unwrap();
    let rest = text.strip_prefix("kvbridge-shm:1:").unwrap();
    let (hex, path) = rest.split_once(':').unwrap();
    let mut token = [0u8; 16];
    for (i, b) in token.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    (token, path.to_owned())
}

/// Opens a connection and sends `Hello` with `token` (`[len: u32][kind 1][version: u32]
/// [token]`), then nothing more.
fn silent_peer(socket: &str, token: &[u8; 16]) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    let mut hello = Vec::new();
    hello.extend_from_slice(&20u32.to_le_bytes());
    hello.push(1);
    hello.extend_from_slice(&3u32.to_le_bytes());
    hello.extend_from_slice(token);
    s.write_all(&hello).unwrap();
    s
}

/// What reading one frame found.
enum Read {
    Frame(u8, Vec<u8>),
    Closed,
    Quiet,
}

/// Reads one frame (`[len: u32][kind][body]`) within `within`. Files passed with frames are
/// dropped by the kernel (this reader takes no ancillary data).
fn next_frame(s: &mut UnixStream, within: Duration) -> Read {
    s.set_read_timeout(Some(within)).unwrap();
    let mut header = [0u8; 5];
    match s.read_exact(&mut header) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Read::Quiet;
        }
        Err(_) => return Read::Closed,
    }
    let len = u32::from_le_bytes(header[..4].try_into().unwrap()) as usize;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    Read::Frame(header[4], body)
}

/// Reads frames from `s` until one of kind `kind` arrives (its body) or the connection closes
/// (`None`); panics when `within` passes first.
fn read_until_kind(s: &mut UnixStream, kind: u8, within: Duration) -> Option<Vec<u8>> {
    let end = Instant::now() + within;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no frame of kind {kind} within {within:?}");
        match next_frame(s, left) {
            Read::Frame(k, body) if k == kind => return Some(body),
            Read::Frame(..) | Read::Quiet => {}
            Read::Closed => return None,
        }
    }
}

/// A legitimate transfer into `receiver`: bytes written and a notification, both checked.
async fn legitimate_transfer(receiver: &ShmTransport) {
    let sender = ShmTransport::new().unwrap();
    let peer = sender
        .connect(&receiver.local_descriptor())
        .await
        .expect("a legitimate peer could not connect");
    let (target, target_mem) = receiver.allocate_registered(8192).await.unwrap();
    let source = MemoryRegion::allocate(8192).unwrap();
    source.fill(0, 8192, 0xa5).unwrap();
    let source_id = sender.register(source).await.unwrap();
    let op = TransferOp::new(source_id, 0, target, 0, 8192);
    sender
        .transfer(
            peer,
            TransferBatch::write(vec![op]).with_notification(Bytes::from_static(b"legit")),
        )
        .await
        .unwrap();
    assert_eq!(target_mem.to_vec(0, 8192).unwrap(), vec![0xa5; 8192]);
    let n = tokio::time::timeout(Duration::from_secs(10), receiver.recv_notification())
        .await
        .expect("no notification within 10 s")
        .unwrap();
    assert_eq!(&n.payload[..], b"legit");
}

/// The attack of the report: connections that present the token and then stay open. Before, each
/// cost a reader thread and the cap filled with them, so a legitimate peer was refused
/// (`connect: lost peer … the opening exchange failed … Broken pipe`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_with_the_token_cost_no_thread_and_lock_no_peer_out() {
    let _serial = SERIAL.lock().await;
    const CAP: usize = 64;
    let receiver = ShmTransport::with_options(
        ShmOptions::default()
            .with_max_inbound_connections(CAP)
            .with_evict_idle_after(Duration::from_millis(200)),
    )
    .unwrap();
    let (token, socket) = token_and_socket(&receiver.local_descriptor());
    let (threads_before, fds_before) = (entries("/proc/self/task"), entries("/proc/self/fd"));

    let mut attackers: Vec<UnixStream> = (0..CAP).map(|_| silent_peer(&socket, &token)).collect();
    // Every one is accepted: its Welcome and Bell arrive.
    for a in &mut attackers {
        read_until_kind(a, 11, Duration::from_secs(10)).expect("an attacker was not accepted");
    }
    let threads = entries("/proc/self/task");
    assert!(
        threads <= threads_before + 2,
        "{CAP} idle connections took the threads from {threads_before} to {threads}"
    );
    // Per connection: the attacker's end, the transport's end and its ring's file. (The copies
    // of the ring's and the bell page's files that went out with Welcome and Bell are closed
    // once the sends return, which under load may trail the attacker's read a little.)
    let fd_bound = fds_before + 3 * CAP + 4;
    let settled = Instant::now() + Duration::from_secs(10);
    let mut fds = entries("/proc/self/fd");
    while fds > fd_bound && Instant::now() < settled {
        tokio::time::sleep(Duration::from_millis(20)).await;
        fds = entries("/proc/self/fd");
    }
    assert!(
        fds <= fd_bound,
        "{CAP} idle connections took the file descriptors from {fds_before} to {fds}"
    );

    // Every slot is held by an idle connection; a legitimate peer still gets in.
    tokio::time::sleep(Duration::from_millis(300)).await;
    legitimate_transfer(&receiver).await;

    // One attacker was evicted, and told why.
    let reasons: Vec<String> = attackers
        .iter_mut()
        .filter_map(|a| match next_frame(a, Duration::from_millis(50)) {
            Read::Frame(3, body) => Some(String::from_utf8_lossy(&body).into_owned()),
            Read::Frame(kind, _) => panic!("an idle attacker got a frame of kind {kind}"),
            Read::Closed => Some("closed without a reason".to_owned()),
            Read::Quiet => None,
        })
        .collect();
    assert_eq!(reasons.len(), 1, "evicted: {reasons:?}");
    assert!(
        reasons[0].contains("evicted") && reasons[0].contains(&format!("limit of {CAP}")),
        "{}",
        reasons[0]
    );
}

/// A connection that does not finish the opening exchange by the handshake deadline is closed,
/// which frees its slot for a legitimate peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_says_hello_is_closed_at_the_deadline() {
    let _serial = SERIAL.lock().await;
    let receiver = ShmTransport::with_options(
        ShmOptions::default()
            .with_max_inbound_connections(1)
            .with_handshake_timeout(Duration::from_millis(300)),
    )
    .unwrap();
    let (_, socket) = token_and_socket(&receiver.local_descriptor());
    let started = Instant::now();
    let mut mute = UnixStream::connect(&socket).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The legitimate peer waits for the slot the mute connection holds until its deadline.
    legitimate_transfer(&receiver).await;
    assert_eq!(
        read_until_kind(&mut mute, 0xff, Duration::from_secs(10)),
        None,
        "the mute connection was not closed"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "the mute connection was closed before its deadline: {:?}",
        started.elapsed()
    );
}
