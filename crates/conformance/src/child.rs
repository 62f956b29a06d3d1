//! The one cross-process harness of the transports' tests: the test binary re-runs itself as a
//! peer process and talks to the parent through tagged stdout lines.
//!
//! The peer is one `#[test]` function (the *entry*) that returns at once unless its environment
//! variable is set ([`is_peer`]); the parent starts it with [`PeerProcess::spawn`], which runs
//! `<this test binary> --exact <entry> --nocapture --test-threads=1` with the given variables.
//! The peer reports on stdout in lines that start with an upper-case tag (`READY ...`,
//! `VERIFIED ok`); every other line (libtest's own, which start in lower case) is dropped. Its
//! first report starts with a newline, to end libtest's `test <entry> ... ` line.
//!
//! Waiting for a line is `async` and runtime-agnostic (the suite's own `std` timer), and bounded:
//! a peer that stops answering fails the test with a message instead of hanging it. A parent that
//! talks back sends lines to the peer's stdin ([`PeerProcess::send`]); a parent that reads lines
//! as they come (a dispatcher) takes them from a [`PeerLines`] handle, which waits as long as the
//! peer lives (its callers bound their own waits).
//!
//! ```ignore
//! const PEER_ENV: &str = "MY_TRANSPORT_PEER";
//!
//! #[test]
//! fn peer_entry() {
//!     if !is_peer(PEER_ENV) {
//!         return;
//!     }
//!     // ... run a receiving transport, then:
//!     println!("\nREADY {descriptor}");
//! }
//!
//! #[tokio::test]
//! async fn writes_cross_the_process_boundary() {
//!     let peer = PeerProcess::spawn("peer_entry", [(PEER_ENV, "1")]);
//!     let ready = peer.line("READY").await;
//!     // ...
//! }
//! ```

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::future::poll_fn;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::Bytes;

use super::rt::timeout;
use kvbridge_transport::sync::lock;
use kvbridge_transport::{
    KvTransport, KvTransportExt, PeerId, RegionId, TransferBatch, TransferOp,
};

/// How long [`PeerProcess::line`] waits by default: generous, for a loaded machine.
pub const LINE_LIMIT: Duration = Duration::from_secs(30);

/// Whether this process is a peer started by [`PeerProcess::spawn`] with `env` set.
#[must_use]
pub fn is_peer(env: &str) -> bool {
    std::env::var_os(env).is_some()
}

/// Runs this test binary again with `args` (test filters, libtest flags) and `envs`, and
/// returns its output: for re-running tests under other settings (say, another network lane).
///
/// # Panics
/// If the binary cannot be started.
pub fn rerun_self<I, K, V>(args: &[&str], envs: I) -> Output
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(args)
        .envs(envs)
        .output()
        .expect("re-run the test binary")
}

/// The tagged lines a peer printed and the parent has not taken yet.
#[derive(Default)]
struct Lines {
    queue: VecDeque<String>,
    closed: bool,
    waker: Option<Waker>,
}

/// A running peer process; killed and reaped when dropped.
pub struct PeerProcess {
    process: Child,
    stdin: Mutex<Option<ChildStdin>>,
    lines: PeerLines,
    limit: Duration,
}

/// A handle on the tagged lines of a [`PeerProcess`] ([`PeerProcess::lines`]), for one reader
/// that takes every line as it comes.
#[derive(Clone)]
pub struct PeerLines(Arc<Mutex<Lines>>);

impl PeerLines {
    /// The next tagged line, waiting as long as the peer runs; `None` once it exited (its
    /// stdout closed) and every line was taken.
    pub async fn next(&self) -> Option<String> {
        poll_fn(|cx| {
            let mut l = lock(&self.0);
            if let Some(line) = l.queue.pop_front() {
                return Poll::Ready(Some(line));
            }
            if l.closed {
                return Poll::Ready(None);
            }
            l.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

impl PeerProcess {
    /// Starts this test binary's test `entry` as a peer, with `envs` set (one of them the
    /// variable its entry checks with [`is_peer`]).
    ///
    /// # Panics
    /// If the process cannot be started.
    pub fn spawn<I, K, V>(entry: &str, envs: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let mut process = Command::new(std::env::current_exe().expect("the test binary's path"))
            .args(["--exact", entry, "--nocapture", "--test-threads=1"])
            .envs(envs)
            .stdout(Stdio::piped())
            .stdin(Stdio::piped())
            .spawn()
            .expect("spawn the peer process");
        let stdin = process.stdin.take();
        let stdout = process.stdout.take().expect("the peer's stdout is piped");
        let lines = Arc::new(Mutex::new(Lines::default()));
        let shared = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with(|c: char| c.is_ascii_uppercase()) {
                    let mut l = lock(&shared);
                    l.queue.push_back(line);
                    if let Some(w) = l.waker.take() {
                        w.wake();
                    }
                }
            }
            let mut l = lock(&shared);
            l.closed = true;
            if let Some(w) = l.waker.take() {
                w.wake();
            }
        });
        Self {
            process,
            stdin: Mutex::new(stdin),
            lines: PeerLines(lines),
            limit: LINE_LIMIT,
        }
    }

    /// Waits at most `limit` (instead of [`LINE_LIMIT`]) for each line.
    #[must_use]
    pub fn with_line_limit(mut self, limit: Duration) -> Self {
        self.limit = limit;
        self
    }

    /// The next tagged line, which must start with `tag`.
    ///
    /// # Panics
    /// If the peer prints no tagged line within the limit, exits first, or the line starts
    /// otherwise.
    pub async fn line(&self, tag: &str) -> String {
        let line = match timeout(self.limit, self.lines.next()).await {
            Some(Some(line)) => line,
            Some(None) => panic!("the peer process exited before printing a {tag} line"),
            None => panic!(
                "the peer process printed no {tag} line within {:?}",
                self.limit
            ),
        };
        assert!(
            line.starts_with(tag),
            "expected {tag}, the peer said {line:?}"
        );
        line
    }

    /// The peer's tagged lines, for a reader that takes them as they come instead of with
    /// [`line`](Self::line) (never both at once).
    #[must_use]
    pub fn lines(&self) -> PeerLines {
        self.lines.clone()
    }

    /// Writes `line` and a newline to the peer's stdin, where a peer that takes commands reads
    /// them (its stdin closes when the `PeerProcess` drops).
    ///
    /// # Errors
    /// When the peer's stdin is closed (the peer exited).
    pub fn send(&self, line: &str) -> std::io::Result<()> {
        let mut stdin = lock(&self.stdin);
        let pipe = stdin
            .as_mut()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::BrokenPipe))?;
        pipe.write_all(format!("{line}\n").as_bytes())?;
        pipe.flush()
    }

    /// Kills the peer (as a crash would) and reaps it.
    ///
    /// # Panics
    /// If the process cannot be signalled or waited for.
    pub fn kill(&mut self) {
        self.process.kill().expect("kill the peer process");
        self.process.wait().expect("reap the peer process");
    }

    /// Waits for the peer to exit by itself.
    ///
    /// # Panics
    /// If the process cannot be waited for.
    pub fn wait(&mut self) -> ExitStatus {
        self.process.wait().expect("wait for the peer process")
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// Ops covering `[0, len)` of `local` and `remote` in blocks of `block` bytes, in a scattered
/// order (block `j` to block `j`), so a transport that moves them in order is not favoured.
#[must_use]
pub fn scattered_blocks(
    local: RegionId,
    remote: RegionId,
    len: u64,
    block: u64,
) -> Vec<TransferOp> {
    let n = len / block;
    (0..n)
        .map(|i| (i * 7919 + 13) % n)
        .map(|j| TransferOp::new(local, j * block, remote, j * block, block))
        .collect()
}

/// Sends `text` to the peer as the notification of an empty batch: a command the peer obeys
/// once every earlier batch's bytes are in its memory.
///
/// # Panics
/// If the batch fails.
pub async fn send_command(t: &dyn KvTransport, peer: PeerId, text: String) {
    t.transfer(
        peer,
        TransferBatch::write(vec![]).with_notification(Bytes::from(text)),
    )
    .await
    .unwrap_or_else(|e| panic!("sending the command to the peer process failed: {e}"));
}
