//! The one error type of `kvbridge-tcp`.
//!
//! Wire and handshake failures are [`TcpError`]s; at the [`KvTransport`] boundary they become
//! [`TransportError`]s (a [`TransportError::Protocol`] for a peer that broke the protocol, a
//! [`TransportError::InvalidArgument`] for a bad configuration, ...).
//!
//! [`KvTransport`]: kvbridge_transport::KvTransport

use kvbridge_transport::TransportError;

/// Everything the wire codec, the connection handshake and the configuration can reject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TcpError {
    /// The connection did not start with the kvbridge-tcp magic.
    #[error(
        "connection preface has magic {got:02x?}, expected {expected:02x?} (\"KVBTCP\\r\\n\"); \
         the peer is not a kvbridge-tcp endpoint — check the address in the descriptor"
    )]
    BadMagic {
        /// The 8 bytes received.
        got: [u8; 8],
        /// The magic this build speaks.
        expected: [u8; 8],
    },
    /// The peer speaks another protocol version.
    #[error(
        "peer speaks kvbridge-tcp protocol version {got}, this build speaks version {supported}; \
         run the same kvbridge release on both sides"
    )]
    UnsupportedVersion {
        /// The version the peer announced.
        got: u16,
        /// The version this build speaks.
        supported: u16,
    },
    /// A frame header announced more bytes than the configured limit allows.
    #[error(
        "{kind} frame announces a {len}-byte body, above the limit of {max} bytes; \
         the peer is broken or hostile (raise `TcpConfig::max_frame_len` on both sides only if it is legitimate)"
    )]
    FrameTooLarge {
        /// The frame type's name.
        kind: &'static str,
        /// The announced body length.
        len: u64,
        /// The limit in force.
        max: u64,
    },
    /// A frame type this build does not know.
    #[error(
        "unknown frame type {ty:#04x}; the peer runs an incompatible build (same version, other frame set)"
    )]
    UnknownFrameType {
        /// The type byte received.
        ty: u8,
    },
    /// A field that must be zero (flags, reserved bits) is not.
    #[error(
        "{field} must be 0, got {value:#x}; the peer runs an incompatible build or the stream is corrupt"
    )]
    ReservedNotZero {
        /// Which field.
        field: &'static str,
        /// The value seen.
        value: u64,
    },
    /// A frame body is shorter (or longer) than its fields require.
    #[error(
        "{kind} frame body is {got} bytes, but its fields need {need} bytes; the stream is truncated or corrupt"
    )]
    BadLength {
        /// The frame type's name.
        kind: &'static str,
        /// Bytes its fields need.
        need: u64,
        /// Bytes the body has.
        got: u64,
    },
    /// Offsets or lengths whose sum overflows 64 bits.
    #[error("{what} overflows 64 bits ({a} + {b}); the peer sent an impossible length")]
    LengthOverflow {
        /// What was being added.
        what: &'static str,
        /// First operand.
        a: u64,
        /// Second operand.
        b: u64,
    },
    /// A text field is not UTF-8.
    #[error("{kind} frame carries text that is not UTF-8; the stream is corrupt")]
    BadText {
        /// The frame type's name.
        kind: &'static str,
    },
    /// A frame arrived where the protocol does not allow it.
    #[error(
        "unexpected {got} frame while {state}; the peer does not follow the kvbridge-tcp protocol"
    )]
    UnexpectedFrame {
        /// The frame type's name.
        got: &'static str,
        /// What this side was doing.
        state: &'static str,
    },
    /// This side requires a secret the peer did not present, or the reverse.
    #[error(
        "{side} requires a connection secret but the {other} has none; configure the same \
         `TcpConfig::secret` on both sides"
    )]
    SecretMissing {
        /// The side that has a secret ("this listener", "this transport").
        side: &'static str,
        /// The side without one.
        other: &'static str,
    },
    /// The peer's proof of the shared secret did not verify.
    #[error(
        "the {who}'s proof of the connection secret does not verify; both sides must be configured \
         with the same `TcpConfig::secret`"
    )]
    SecretMismatch {
        /// Whose proof failed ("peer", "listener").
        who: &'static str,
    },
    /// The peer rejected us and said why.
    #[error("the peer closed the connection with error {code}: {message}")]
    Rejected {
        /// The error code the peer sent.
        code: u16,
        /// The peer's message.
        message: String,
    },
    /// The peer sent a write this side refuses (unknown region, out of bounds, more bytes than
    /// announced, a batch never begun, overlapping concurrent writes).
    #[error("refused a write from the peer: {message}")]
    BadWrite {
        /// What was wrong, with the values seen.
        message: String,
    },
    /// The peer's pending batches would hold more bytes here than its budget allows.
    #[error(
        "a Begin frame of {body} bytes would charge {charge} bytes to the peer's pending batches \
         ({pending} bytes already: notifications of batches not yet complete or not yet received \
         by the application), above TcpConfig::max_inbound_pending_bytes = {limit}; the peer \
         begins batches it does not complete, or the receiving application does not take its \
         notifications (raise the limit on the listener only if that is legitimate)"
    )]
    OverBudget {
        /// Body length of the `Begin` frame that was refused.
        body: u32,
        /// What that batch would have been charged (body + per-batch state).
        charge: u64,
        /// Bytes the peer was charged already.
        pending: u64,
        /// The limit in force.
        limit: u64,
    },
    /// All inbound peers' pending batches together would hold more bytes here than the
    /// listener allows.
    #[error(
        "a Begin frame of {body} bytes would charge {charge} bytes to the pending batches of all \
         inbound peers ({pending} bytes already), above \
         TcpConfig::max_inbound_pending_bytes_total = {limit}; many peers begin batches they do \
         not complete, or the receiving application does not take its notifications (raise the \
         limit on the listener only if that many peers legitimately send at once)"
    )]
    OverTotalBudget {
        /// Body length of the `Begin` frame that was refused.
        body: u32,
        /// What that batch would have been charged (body + per-batch state).
        charge: u64,
        /// Bytes all inbound peers were charged already.
        pending: u64,
        /// The limit in force.
        limit: u64,
    },
    /// This side closes a healthy-looking connection for a reason of its own.
    #[error("closing the connection: {reason}")]
    Closing {
        /// Why, with the values involved.
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("TcpConfig::{field} is {value}, {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// The value seen.
        value: String,
        /// What is allowed.
        reason: &'static str,
    },
    /// A descriptor is not `kvbridge-tcp/3@<ip>:<port>`.
    #[error("descriptor {got:?} is not of the form \"kvbridge-tcp/3@<ip>:<port>\": {reason}")]
    BadDescriptor {
        /// The descriptor (lossy UTF-8, truncated to 128 bytes).
        got: String,
        /// What was wrong.
        reason: &'static str,
    },
}

/// Result alias for this crate's sans-IO parts.
pub(crate) type Result<T, E = TcpError> = std::result::Result<T, E>;

impl TcpError {
    /// The code sent in an error frame for this failure.
    pub fn code(&self) -> u16 {
        match self {
            TcpError::BadMagic { .. } => 1,
            TcpError::UnsupportedVersion { .. } => 2,
            TcpError::FrameTooLarge { .. } => 3,
            TcpError::UnknownFrameType { .. } => 4,
            TcpError::ReservedNotZero { .. } => 5,
            TcpError::BadLength { .. } => 6,
            TcpError::LengthOverflow { .. } => 7,
            TcpError::BadText { .. } => 8,
            TcpError::UnexpectedFrame { .. } => 9,
            TcpError::SecretMissing { .. } => 10,
            TcpError::SecretMismatch { .. } => 11,
            TcpError::Rejected { code, .. } => *code,
            TcpError::InvalidConfig { .. } => 12,
            TcpError::BadWrite { .. } => 14,
            TcpError::OverBudget { .. } | TcpError::OverTotalBudget { .. } => 15,
            TcpError::Closing { .. } => 16,
            TcpError::BadDescriptor { .. } => 13,
        }
    }
}

impl From<TcpError> for TransportError {
    fn from(e: TcpError) -> Self {
        match e {
            TcpError::InvalidConfig { .. } => TransportError::InvalidArgument {
                transport: crate::NAME,
                message: e.to_string(),
            },
            TcpError::BadDescriptor { .. } => TransportError::BadDescriptor {
                transport: crate::NAME,
                message: e.to_string(),
            },
            other => TransportError::Custom {
                transport: crate::NAME,
                source: Box::new(other),
            },
        }
    }
}
