//! The shared-memory transport for `kvbridge-lab bench --transport shm`, and the baseline of its
//! `latency-4k` row: a raw cross-process wake-up round trip.
//!
//! The baseline copies the same 4 KiB with `memcpy`, then wakes a second process (this binary
//! with `--role raw-wake-peer`) through a [`DoorbellPair`], the shared-memory ring and futex
//! wake-up (with the same adaptive spin) that carry the transport's own notifications, and
//! waits until that process wakes it back the same way: the least any transport built on that
//! mechanism can spend to move 4 KiB and have the other process know it, and hear back.

use std::process::{Child, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvbridge_shm::{DoorbellPair, ShmTransport};
use kvbridge_transport::{KvTransport, MemoryRegion};

use super::TransportFuture;

/// How the `latency-4k` baseline is described in the report.
pub(super) const WAKE_BASELINE: &str = "memcpy plus a raw cross-process wake-up round trip \
     (doorbell-ring and futex ping-pong over shared memory between two processes)";

/// How long either end of the baseline waits for the other before giving up.
const WAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
    bell: Mutex<DoorbellPair>,
}

impl RawWakeBaseline {
    /// Starts the peer process (the pair's shared memory is its stdin) and waits until it
    /// answers once.
    pub(super) fn start() -> Result<Self, String> {
        let (bell, fd) =
            DoorbellPair::create().map_err(|e| format!("creating the doorbell pair: {e}"))?;
        let peer = kvbridge_lab::process::this_binary(None)?
            .args(["bench", "--transport", "shm", "--role", "raw-wake-peer"])
            .stdin(Stdio::from(fd))
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the wake-up peer process: {e}"))?;
        let this = Self {
            peer,
            bell: Mutex::new(bell),
        };
        this.ping()?;
        Ok(this)
    }

    fn ping(&self) -> Result<(), String> {
        let mut bell = self.bell.lock().map_err(|e| e.to_string())?;
        bell.ring(b"1")
            .map_err(|e| format!("waking the peer process: {e}"))?;
        match bell.wait(WAKE_TIMEOUT) {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(format!(
                "the peer process did not wake this one within {WAKE_TIMEOUT:?}"
            )),
            Err(e) => Err(format!("the peer process did not wake this one: {e}")),
        }
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
        // An empty frame ends the peer.
        if let Ok(bell) = self.bell.get_mut() {
            let _ = bell.ring(b"");
        }
        let _ = self.peer.wait();
    }
}

/// The peer process: answers each frame of the doorbell pair on its stdin, until an empty
/// frame comes or the process that started it is gone.
pub(super) fn raw_wake_peer() -> ExitCode {
    use std::os::fd::AsFd;
    let parent = std::os::unix::process::parent_id();
    let opened = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| e.to_string())
        .and_then(|fd| DoorbellPair::open(fd).map_err(|e| e.to_string()));
    let mut bell = match opened {
        Ok(bell) => bell,
        Err(e) => {
            eprintln!("kvbridge-lab bench raw-wake-peer: {e}");
            return ExitCode::from(1);
        }
    };
    loop {
        match bell.wait(Duration::from_secs(1)) {
            Ok(Some(frame)) if frame.is_empty() => return ExitCode::SUCCESS,
            Ok(Some(frame)) => {
                if let Err(e) = bell.ring(&frame) {
                    eprintln!("kvbridge-lab bench raw-wake-peer: {e}");
                    return ExitCode::from(1);
                }
            }
            Ok(None) if std::os::unix::process::parent_id() != parent => {
                return ExitCode::SUCCESS;
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("kvbridge-lab bench raw-wake-peer: {e}");
                return ExitCode::from(1);
            }
        }
    }
}
