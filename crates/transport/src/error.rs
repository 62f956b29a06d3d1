//! The one error type of `kvbridge-transport`, shared by every transport implementation.

use std::time::Duration;

use crate::{BatchId, PeerId, RegionId};
use kvbridge_memory::{MemoryError, RangeError};

/// Which side of a transfer a region or offset belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The region registered with the transport that posts the batch.
    Local,
    /// The region registered with the peer the batch targets.
    Remote,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Everything a [`KvTransport`](crate::KvTransport) operation, or a CPU access to a
/// [`MemoryRegion`](crate::MemoryRegion), can fail with.
///
/// Every message says what was wrong, the values seen and how to fix it. Third-party transports
/// report failures of their own with [`TransportError::Custom`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A descriptor addresses bytes outside its registered region. Refused before any byte moves.
    #[error(
        "{side} region {region} is {region_len} bytes, but a descriptor addresses [{offset}, {offset}+{len}); \
         fix the offsets (the planner's byte ranges must come from the same geometry the peer registered)"
    )]
    OutOfBounds {
        /// Which side's region.
        side: Side,
        /// The region addressed.
        region: RegionId,
        /// Offset of the descriptor.
        offset: u64,
        /// Length of the descriptor.
        len: u64,
        /// Registered length of the region.
        region_len: u64,
    },
    /// A descriptor names a region that is not registered (or was deregistered).
    #[error(
        "{side} region {region} is not registered with {transport}; register it first \
         (and exchange the remote region ids through the handshake)"
    )]
    UnknownRegion {
        /// Which side's region.
        side: Side,
        /// The region named.
        region: RegionId,
        /// The transport's name.
        transport: &'static str,
    },
    /// The peer id is not (or no longer) connected.
    #[error(
        "peer {peer} is not connected to {transport}; connect with the peer's descriptor first"
    )]
    UnknownPeer {
        /// The peer named.
        peer: PeerId,
        /// The transport's name.
        transport: &'static str,
    },
    /// The batch id is unknown (never posted, or its final state was already returned by `wait`).
    #[error(
        "batch {batch} is unknown to {transport}: it was never posted here or `wait` already returned its final state"
    )]
    UnknownBatch {
        /// The batch named.
        batch: BatchId,
        /// The transport's name.
        transport: &'static str,
    },
    /// The transport lacks a capability the call needs.
    #[error("{transport} does not support {operation}; {remedy}")]
    Unsupported {
        /// The transport's name.
        transport: &'static str,
        /// The operation asked for.
        operation: &'static str,
        /// What to do instead.
        remedy: &'static str,
    },
    /// An argument is invalid (zero-sized where not allowed, lengths that overflow, ...).
    #[error("invalid argument to {transport}: {message}")]
    InvalidArgument {
        /// The transport's name.
        transport: &'static str,
        /// What was wrong, the values seen and the fix.
        message: String,
    },
    /// A peer descriptor could not be understood.
    #[error(
        "bad peer descriptor for {transport}: {message}; pass the bytes of the peer's `local_descriptor()` unchanged"
    )]
    BadDescriptor {
        /// The transport's name.
        transport: &'static str,
        /// What was wrong.
        message: String,
    },
    /// The batch did not finish by its deadline. No byte of it lands after this is reported.
    #[error(
        "batch {batch} did not complete within its deadline of {timeout:?}; no byte of it lands later. \
         Raise the timeout or check the peer's health"
    )]
    TimedOut {
        /// The batch.
        batch: BatchId,
        /// The deadline it was posted with.
        timeout: Duration,
    },
    /// The batch was cancelled. No byte of it lands after this is reported.
    #[error("batch {batch} was cancelled; no byte of it lands later")]
    Cancelled {
        /// The batch.
        batch: BatchId,
    },
    /// The batch failed. No byte of it lands after this is reported.
    #[error("batch {batch} to peer {peer} failed: {reason}")]
    BatchFailed {
        /// The batch.
        batch: BatchId,
        /// The peer it targeted.
        peer: PeerId,
        /// Why it failed.
        reason: String,
    },
    /// The connection to a peer is gone (peer died, disconnected, or stopped answering).
    #[error(
        "lost peer {peer} on {transport}: {reason}; reconnect with its descriptor once it is back"
    )]
    PeerLost {
        /// The peer.
        peer: PeerId,
        /// The transport's name.
        transport: &'static str,
        /// What happened.
        reason: String,
    },
    /// The peer sent something that breaks the protocol. The connection is dropped.
    #[error("peer {peer} on {transport} broke the protocol: {message}; the connection was closed")]
    Protocol {
        /// The peer.
        peer: PeerId,
        /// The transport's name.
        transport: &'static str,
        /// What was wrong.
        message: String,
    },
    /// The transport was shut down.
    #[error("{transport} is shut down; create a new transport")]
    Closed {
        /// The transport's name.
        transport: &'static str,
    },
    /// An operating-system I/O error, with what was being done.
    #[error("{transport}: {context}: {source}")]
    Io {
        /// The transport's name.
        transport: &'static str,
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A CPU access to a region's bytes was refused (out of range, a conflicting access, device
    /// memory, a slice of foreign memory); the memory error says which and how to fix it.
    /// Nothing was read or written.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A failure specific to a third-party transport.
    #[error("{transport}: {source}")]
    Custom {
        /// The transport's name.
        transport: &'static str,
        /// The transport's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl TransportError {
    /// The contract's refusal of a descriptor outside `region` on `side`
    /// ([`TransportError::OutOfBounds`]), carrying the values of `range`.
    pub fn out_of_bounds(range: RangeError, side: Side, region: RegionId) -> Self {
        TransportError::OutOfBounds {
            side,
            region,
            offset: range.offset,
            len: range.len,
            region_len: range.region_len,
        }
    }
}

/// Result alias for transport operations.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;
