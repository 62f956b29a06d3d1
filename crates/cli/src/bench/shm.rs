//! The shared-memory transport for `kvbridge bench --transport shm`, and the baseline of its
//! `latency-4k` row: a raw cross-process wake-up round trip.
//!
//! The baseline copies the same 4 KiB with `memcpy`, then wakes a second process (this binary
//! with `--role raw-wake-peer`) through a pipe and sleeps until that process wakes it back: the
//! least any transport can spend to move 4 KiB and have the other process know it, and hear
//! back. The transport's local `wait` is the same round trip (post, the peer's answer).

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvbridge_shm::ShmTransport;
use kvbridge_transport::{KvTransport, MemoryRegion};

use super::TransportFuture;

/// How the `latency-4k` baseline is described in the report.
pub(super) const WAKE_BASELINE: &str =
    "memcpy plus a raw cross-process wake-up round trip (pipe ping-pong between two processes)";

/// Creates a [`ShmTransport`] with default options (same-user peers, socket under
/// `$XDG_RUNTIME_DIR` or the temp directory).
pub(super) fn factory() -> TransportFuture {
    Box::pin(async {
        let t = ShmTransport::new().map_err(|e| e.to_string())?;
        super::created_control_dir(t.control_dir());
        Ok(Arc::new(t) as Arc<dyn KvTransport>)
    })
}

/// The waking end of the wake-up baseline, with the peer process it wakes.
pub(super) struct RawWakeBaseline {
    peer: Child,
    /// Taken (closed) on drop, which ends the peer.
    pipes: Mutex<Option<(ChildStdin, ChildStdout)>>,
}

impl RawWakeBaseline {
    /// Starts the peer process and waits until it answers once.
    pub(super) fn start() -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
        let mut peer = std::process::Command::new(exe)
            .args(["bench", "--transport", "shm", "--role", "raw-wake-peer"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the wake-up peer process: {e}"))?;
        let (Some(stdin), Some(stdout)) = (peer.stdin.take(), peer.stdout.take()) else {
            let _ = peer.kill();
            let _ = peer.wait();
            return Err("the wake-up peer process has no pipes".to_owned());
        };
        let this = Self {
            peer,
            pipes: Mutex::new(Some((stdin, stdout))),
        };
        this.ping()?;
        Ok(this)
    }

    fn ping(&self) -> Result<(), String> {
        let mut pipes = self.pipes.lock().map_err(|e| e.to_string())?;
        let (to, from) = pipes.as_mut().ok_or("the wake-up peer is closed")?;
        to.write_all(&[1])
            .map_err(|e| format!("waking the peer process: {e}"))?;
        let mut back = [0u8; 1];
        from.read_exact(&mut back)
            .map_err(|e| format!("the peer process did not wake this one: {e}"))
    }

    /// One timed run: copies `len` bytes from `src` into `dst`, then one wake-up round trip.
    pub(super) fn run(
        &self,
        src: &MemoryRegion,
        dst: &MemoryRegion,
        len: u64,
    ) -> Result<f64, String> {
        let start = Instant::now();
        src.copy_to(0, dst, 0, len).map_err(|e| e.to_string())?;
        self.ping()?;
        Ok(start.elapsed().as_secs_f64())
    }
}

impl Drop for RawWakeBaseline {
    fn drop(&mut self) {
        // Closing its stdin ends the peer.
        if let Ok(pipes) = self.pipes.get_mut() {
            pipes.take();
        }
        let _ = self.peer.wait();
    }
}

/// The peer process: answers each byte on stdin with one byte on stdout, until stdin closes.
pub(super) fn raw_wake_peer() -> ExitCode {
    let mut from = std::io::stdin().lock();
    let mut to = std::io::stdout().lock();
    let mut byte = [0u8; 1];
    loop {
        match from.read_exact(&mut byte) {
            Ok(()) => {
                if let Err(e) = to.write_all(&byte).and_then(|()| to.flush()) {
                    eprintln!("kvbridge bench raw-wake-peer: {e}");
                    return ExitCode::from(1);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvbridge bench raw-wake-peer: {e}");
                return ExitCode::from(1);
            }
        }
    }
}
