//! The one error type of `kvbridge-shm`.
//!
//! Trait methods return [`TransportError`]; failures specific to shared memory are carried inside
//! [`TransportError::Custom`] as a [`ShmError`], so callers can downcast and match on them.

use kvbridge_transport::TransportError;

use crate::NAME;

/// Failures specific to the shared-memory transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call of the mapping layer failed.
    #[error(
        "{what} failed: {source}; check the memory limits (ulimit -l, cgroup memory.max) and /dev/shm"
    )]
    Map {
        /// What was being done.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A region file handed over by a peer is not one this transport can map safely.
    #[error(
        "the peer's region {region} cannot be mapped: {reason}; the peer must allocate regions it \
         registers for remote writes with `ShmTransport::allocate`"
    )]
    UnsafeRemoteRegion {
        /// The peer's region id.
        region: u64,
        /// What was wrong.
        reason: String,
    },
    /// The peer on the other end of the control socket runs as a user this transport does not
    /// accept.
    #[error(
        "refused a peer running as uid {uid} (pid {pid}): allowed are {allowed}; run both processes \
         as the same user or add the uid to `ShmOptions::allowed_uids`"
    )]
    PeerRejected {
        /// The peer's user id (from `SO_PEERCRED`).
        uid: u32,
        /// The peer's process id.
        pid: i32,
        /// The accepted users, as text.
        allowed: String,
    },
    /// The peer refused this connection and said why.
    #[error("the peer refused the connection: {reason}")]
    RefusedByPeer {
        /// The peer's explanation.
        reason: String,
    },
    /// A doorbell ring refused a frame, or the other process broke it.
    #[error(
        "doorbell ring: {reason}; a broken ring means the other process wrote garbage into shared \
         memory, so its connection is dropped"
    )]
    Doorbell {
        /// What was wrong.
        reason: String,
    },
    /// The private control directory or socket could not be set up.
    #[error(
        "could not set up the control socket in {dir}: {source}; set `ShmOptions::runtime_dir` to a \
         writable directory with a short path (or set XDG_RUNTIME_DIR)"
    )]
    Control {
        /// The directory used.
        dir: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

impl From<ShmError> for TransportError {
    fn from(e: ShmError) -> Self {
        TransportError::Custom {
            transport: NAME,
            source: Box::new(e),
        }
    }
}
