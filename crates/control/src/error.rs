//! The one error type of `kvbridge-control`.

use std::time::Duration;

use crate::endpoint::Endpoint;
use crate::version::ProtocolVersion;

/// Everything a control channel can fail with. The coordinator wraps it as
/// `CoordinatorError::Control`; a third-party channel reports its own failures through
/// [`ControlError::Custom`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// A control message could not be sent.
    #[error("control channel {channel}: sending to {endpoint} failed: {reason}")]
    Send {
        /// The channel implementation's name, e.g. `"in-process"`.
        channel: &'static str,
        /// The destination.
        endpoint: Endpoint,
        /// What happened and what to check.
        reason: String,
    },

    /// No endpoint of that name is reachable on this channel.
    #[error(
        "control channel {channel}: no endpoint {endpoint} is reachable; check the peer is \
         running and the endpoint string it advertised"
    )]
    UnknownEndpoint {
        /// The channel implementation's name.
        channel: &'static str,
        /// The endpoint asked for.
        endpoint: Endpoint,
    },

    /// A send did not complete within its deadline (the peer is not draining its queue).
    #[error(
        "control channel {channel}: sending {message} to {endpoint} did not complete within \
         {timeout:?}; the peer is not reading its control messages (overloaded or hung)"
    )]
    SendTimeout {
        /// The channel implementation's name.
        channel: &'static str,
        /// The destination.
        endpoint: Endpoint,
        /// The message kind.
        message: &'static str,
        /// The deadline.
        timeout: Duration,
    },

    /// The channel is closed (shut down locally, or the endpoint name is taken).
    #[error("control channel {channel} is closed: {reason}")]
    Closed {
        /// The channel implementation's name.
        channel: &'static str,
        /// Why.
        reason: String,
    },

    /// A message broke the control protocol (it does not survive its JSON form).
    #[error("control channel {channel}: peer {endpoint} broke the protocol: {message}")]
    Protocol {
        /// The channel implementation's name.
        channel: &'static str,
        /// The peer.
        endpoint: Endpoint,
        /// What was wrong.
        message: String,
    },

    /// The peer speaks another major version of a protocol.
    #[error(
        "{protocol} version mismatch: the peer speaks {theirs}, this side {ours}; versions \
         talk only within one major, so run kvbridge releases of the same major version on \
         both sides"
    )]
    VersionMismatch {
        /// Which protocol: `"control channel wire"` or `"control message"`.
        protocol: &'static str,
        /// This side's version.
        ours: ProtocolVersion,
        /// The peer's version.
        theirs: ProtocolVersion,
    },

    /// A channel's configuration is invalid or its address cannot be used.
    #[error("invalid control channel setup: {message}")]
    InvalidConfig {
        /// What was wrong, the values seen and the fix.
        message: String,
    },

    /// A failure specific to a third-party control channel.
    #[error("control channel {channel}: {source}")]
    Custom {
        /// The channel implementation's name.
        channel: &'static str,
        /// Its own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// `Result` with [`ControlError`] as the default error.
pub type Result<T, E = ControlError> = std::result::Result<T, E>;
